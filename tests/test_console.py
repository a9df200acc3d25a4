"""The operator console and the metrics endpoints over real HTTP (the browser drives the same
pages in tests/test_browser.py): who may read and act, what a page shows, what a scrape
shows. Real processes on a real store; every wait bounded."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.parse
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio.testing
from backends import Location, PgLocation
from console_process import (
    DEADLINE,
    Process,
    console,
    environment,
    seed_quarantine,
    spawn,
    wait_for_line,
    worker,
)
from helpers import Raw

import trio_sessions
from trio_sessions._console import FOLLOWED_IDS, PAGE_SIZE, Console, Guard, HTTPError, _fields
from trio_sessions._model import AssistantData, Message, TextPart
from trio_sessions._store.stream import (
    Appended,
    Held,
    Position,
    Shown,
    StreamChanges,
    Whole,
    message_tag,
)
from trio_sessions._stream import EventStream, decode_cursor, encode_cursor, session_tag

pytestmark = pytest.mark.slow

TOKEN = "console-test-token-0123456789"
BOTH = pytest.mark.parametrize("backend", ["sqlite", "postgres"], indirect=True)
# Quarantined executions another tool wrote (or a test), as the store keeps them.
QUARANTINE_ROWS = (
    "INSERT INTO session_recovery(execution_id, session_id, owner_id, expires_at,"
    " recovery_error, time_created, time_quarantined)"
)


def seed(path: Path, sessions: int) -> None:
    async def submit_all() -> None:
        async with trio_sessions.open_runtime(path, None) as producer:
            for index in range(sessions):
                await producer.submit(f"s{index:03d}", {"text": f"hello {index}"})

    trio.run(submit_all)


def session_ids(page: str) -> list[str]:
    return re.findall(r'<tr data-session="([^"]+)"', page)


def csrf_of(page: str) -> str:
    match = re.search(r'name="csrf" value="([0-9a-f]+)"', page)
    assert match is not None, page
    return match.group(1)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--bind", "0.0.0.0:0"], "without a token"),
        (["--log-level", "x"], "log-level"),
        (["--keep-alive", "0"], "--keep-alive must be a positive number of seconds"),
        (["--keep-alive", "nan"], "--keep-alive must be a positive number of seconds"),
    ],
    ids=["public-bind-without-token", "bad-log-level", "keep-alive-0", "keep-alive-nan"],
)
def test_a_setting_to_change_exits_2_before_opening_the_store(
    tmp_path: Path, options: list[str], message: str
) -> None:
    """On a non-loopback address the console refuses to start without a token; an unknown
    --log-level is a usage error too (it was a ValueError's traceback, exit 1). Exit 2 with
    a message, before the store is opened."""
    store = tmp_path / "db"
    completed = subprocess.run(
        [sys.executable, "-m", "trio_sessions", "console", "--store", str(store), *options],
        capture_output=True,
        text=True,
        env=environment(),
        timeout=DEADLINE,
        check=False,
    )
    assert completed.returncode == 2, completed.stderr
    assert message in completed.stderr and "Traceback" not in completed.stderr
    assert not store.exists()


def test_every_request_needs_the_token(tmp_path: Path) -> None:
    """With a token: no token, a wrong bearer or a wrong login is 401 (the event stream
    too); the right bearer reads; `/?token=` sets an HttpOnly cookie that reads after."""
    store = tmp_path / "db"
    seed(store, 3)
    with console(str(store), tmp_path, "--token", TOKEN) as (url, _):
        with httpx.Client(base_url=url, timeout=DEADLINE) as client:
            assert client.get("/").status_code == 401
            assert client.get("/sessions/s000/events").status_code == 401
            assert client.get("/metrics").status_code == 401
            wrong = {"Authorization": "Bearer not-the-token-at-all"}
            assert client.get("/", headers=wrong).status_code == 401
            assert client.get("/?token=wrong").status_code == 401
            bearer = {"Authorization": f"Bearer {TOKEN}"}
            page = client.get("/", headers=bearer)
            assert page.status_code == 200
            assert session_ids(page.text) == ["s000", "s001", "s002"]
        with httpx.Client(base_url=url, timeout=DEADLINE) as browser:
            login = browser.get(f"/?token={TOKEN}")
            assert login.status_code == 303
            cookie = login.headers["set-cookie"]
            assert "HttpOnly" in cookie and "SameSite=Strict" in cookie
            assert session_ids(browser.get("/").text) == ["s000", "s001", "s002"]


def test_actions_need_the_csrf_field_and_read_only_refuses_them(tmp_path: Path) -> None:
    """A POST from the browser's cookie without the page's CSRF field is refused (403) and
    does nothing; with it, the action runs. A read-only console shows no action and refuses
    every POST, bearer or not."""
    store = tmp_path / "db"
    raw = Raw(store)
    seed(store, 1)
    seed_quarantine(store, "s000", "dead")
    with (
        console(str(store), tmp_path, "--token", TOKEN) as (url, _),
        httpx.Client(base_url=url, timeout=DEADLINE) as browser,
    ):
        browser.get(f"/?token={TOKEN}")
        page = browser.get("/").text
        assert 'data-execution="dead"' in page
        refused = browser.post("/quarantine/dead/drop", data={"do": "drop"})
        assert refused.status_code == 403
        assert raw.one("SELECT COUNT(*) FROM session_execution") == (1,)
        done = browser.post("/quarantine/dead/drop", data={"csrf": csrf_of(page)})
        assert done.status_code == 303
        assert raw.one("SELECT COUNT(*) FROM session_execution") == (0,)
    seed_quarantine(store, "s000", "again", seq=2)
    log_dir = tmp_path / "ro"
    log_dir.mkdir()
    with console(str(store), log_dir, "--token", TOKEN, "--read-only") as (url, _):
        bearer = {"Authorization": f"Bearer {TOKEN}"}
        with httpx.Client(base_url=url, timeout=DEADLINE, headers=bearer) as client:
            page = client.get("/").text
            assert 'data-execution="again"' in page and "read-only" in page
            assert 'method="post"' not in page
            assert client.post("/quarantine/again/drop").status_code == 403
            assert client.post("/sessions/s000/interrupt").status_code == 403
    assert raw.one("SELECT COUNT(*) FROM session_execution") == (1,)


def test_every_action_form_asks_the_browser_not_to_restore_its_state(tmp_path: Path) -> None:
    """Each action's form - whose button the page disables once it posts - carries
    `autocomplete="off"`: Firefox restores a form control's state, `disabled` included,
    on a page shown again by Back or a reload, so the button came back disabled and the
    action could not be taken again. Found by audit (audB54)."""
    store = tmp_path / "db"
    seed(store, 1)  # a pending input: its cancel button, and pause
    seed_quarantine(store, "s000", "dead")  # the quarantine's buttons
    with (
        console(str(store), tmp_path) as (url, _),
        httpx.Client(base_url=url, timeout=DEADLINE) as client,
    ):
        pages = [client.get("/").text, client.get("/sessions/s000").text]
    forms = [form for page in pages for form in re.findall(r'<form method="post"[^>]*>', page)]
    labels = {
        label for page in pages for label in re.findall(r'<button name="do" value="(\w+)"', page)
    }
    assert labels >= {"pause", "delete", "cancel", "resume", "drop"}, labels
    assert forms and all('autocomplete="off"' in form for form in forms), forms


def test_sessions_are_paged_and_searched_in_the_store(tmp_path: Path) -> None:
    """The list shows 50 sessions a page in id order with a link to the next page, and a
    search matches ids containing the text; a session page shows its transcript. A row
    with text in an INTEGER column (SQLite keeps what another tool wrote) is listed as a
    malformed row, saying which column holds what: it failed the whole page with a 500.
    Whatever a row holds reaches the page escaped (a pending input's seq did not). A
    session or a quarantine whose id is not UTF-8 is listed with its bytes but offers no
    link or action, and paging never skips the sessions its shown name sorts after."""
    store = tmp_path / "db"
    seed(store, 120)
    Raw(store).write("UPDATE session SET time_woken = 'yesterday' WHERE id = 's003'")
    Raw(store).write("UPDATE session_input SET seq = '<i>seq</i>' WHERE session_id = 's005'")
    Raw(store).write("INSERT INTO session(id, time_created) VALUES (CAST(X'7A7AFF' AS TEXT), 0)")
    for index in range(49):  # a page of "zz..." ids ending with a bad one, then "zzé"
        name = "zz" + chr(97 + index // 26) + chr(97 + index % 26)
        Raw(store).write(f"INSERT INTO session(id, time_created) VALUES ('{name}', 0)")
    Raw(store).write("INSERT INTO session(id, time_created) VALUES (CAST(X'7A7A80' AS TEXT), 0)")
    Raw(store).write("INSERT INTO session(id, time_created) VALUES ('zz\u00e9', 0)")
    Raw(store).write(
        f"{QUARANTINE_ROWS} VALUES (CAST(X'6EFF' AS TEXT), 's001', 'o', 0, 'bad', 0, 0)"
    )
    with (
        console(str(store), tmp_path) as (url, _),
        httpx.Client(base_url=url, timeout=DEADLINE) as client,
    ):
        first = client.get("/").text
        assert session_ids(first) == [f"s{i:03d}" for i in range(50)]
        assert "sessions <b>172</b>" in first  # and the "zz..." ones below
        link = re.search(r'id="next" href="([^"]+)"', first)
        assert link is not None
        second = client.get(link.group(1).replace("&amp;", "&")).text
        assert session_ids(second) == [f"s{i:03d}" for i in range(50, 100)]
        assert session_ids(client.get("/", params={"q": "11"}).text) == [
            "s011",
            "s110",
            "s111",
            "s112",
            "s113",
            "s114",
            "s115",
            "s116",
            "s117",
            "s118",
            "s119",
        ]
        assert client.get("/sessions/nope").status_code == 404
        assert "waiting" in client.get("/sessions/s007").text
        malformed = "malformed row: session.time_woken is &#x27;yesterday&#x27;"
        assert first.count(malformed) == 1
        assert malformed in client.get("/sessions/s003").text
        shown = "(malformed: session_input.seq is &#x27;&lt;i&gt;seq&lt;/i&gt;&#x27;, not a whole"
        assert shown in client.get("/sessions/s005").text
        assert_nul_refused(client)
        # An id that is not UTF-8 (no str names it): listed with its bytes, with no link and
        # no action - a pause by the shown name created another session.
        # The first page of "zz" ends with a bad id: the next page starts after the last
        # good one, never after the bad one's replaced name ("zz\ufffd" sorts after "zzé").
        # A row may show twice, none is skipped.
        first_zz = client.get("/", params={"q": "zz"}).text
        assert "session.id is not UTF-8 text (X&#x27;7A7A80&#x27;)" in first_zz
        link = re.search(r'id="next" href="([^"]+)"', first_zz)
        assert link is not None
        second_zz = client.get(link.group(1).replace("&amp;", "&")).text
        assert "zz\u00e9" in session_ids(second_zz)
        assert "session.id is not UTF-8 text (X&#x27;7A7AFF&#x27;)" in second_zz
        for page in (first_zz, second_zz):
            assert "%EF%BF%BD" not in page and 'data-session="zz\ufffd' not in page
        # A quarantine whose execution id is not UTF-8: listed, but no button acts on it.
        assert "session_recovery.execution_id is not UTF-8 text (X&#x27;6EFF&#x27;)" in first
        assert "/quarantine/n%EF%BF%BD" not in first


def assert_nul_refused(client: httpx.Client) -> None:
    """A NUL in a search or a session's path names no session: 400 and 404 saying so, on
    both backends (PostgreSQL's refusal of the text answered 'store error')."""
    for params in ({"q": "\x00"}, {"after": "a\x00"}):
        refused = client.get("/", params=params)
        assert refused.status_code == 400
        assert "no session id holds a NUL character" in refused.text
    assert client.get("/sessions/a%00b").status_code == 404


def test_the_store_password_never_reaches_a_page(tmp_path: Path, pg_url: str) -> None:
    """A PostgreSQL URL with a password: pages and metrics show it masked, never the
    password itself. (And a NUL in a search is refused as on SQLite.)"""
    password = "s3cret/pw?x"
    quoted = "s3cret%2Fpw%3Fx"
    parts = urllib.parse.urlsplit(pg_url)
    netloc = f"{parts.username or 'postgres'}:{quoted}@{parts.hostname}:{parts.port}"
    url_with_password = urllib.parse.urlunsplit(parts._replace(netloc=netloc))
    # The console serves a store as it is (it never creates one): made here.
    from trio_sessions._postgres import open_engine

    open_engine(url_with_password, schema="public").close()
    with (
        console(url_with_password, tmp_path) as (url, process),
        httpx.Client(base_url=url, timeout=DEADLINE) as client,
    ):
        pages = client.get("/").text + client.get("/metrics").text
        assert_nul_refused(client)
    for shown in (pages, process.output()):
        assert password not in shown and quoted not in shown
    assert "***" in pages


def test_a_worker_serves_metrics_a_scraper_reads(tmp_path: Path) -> None:
    """`worker --metrics-bind`: a scrape shows the worker's drains, claims, recovery totals
    and store retries in the Prometheus text format."""
    store = tmp_path / "db"
    seed(store, 2)
    with worker(
        str(store), tmp_path, "worker_drain:reply", "w1", "--metrics-bind", "127.0.0.1:0"
    ) as process:
        match = wait_for_line(process, r"worker metrics on (http://\S+)")
        deadline = time.monotonic() + DEADLINE
        while True:
            text = httpx.get(match.group(1), timeout=DEADLINE).text
            if "trio_sessions_store_transactions_total" in text and re.search(
                r'trio_sessions_recovery_total\{[^}]*kind="doorbells_started"[^}]*\} [1-9]', text
            ):
                break
            assert time.monotonic() < deadline, text
            time.sleep(0.1)
    for name in (
        "trio_sessions_drains_running",
        "trio_sessions_owned_claims",
        "trio_sessions_store_retries_total",
        "trio_sessions_heartbeat_transactions_total",
    ):
        assert re.search(rf"^{name}\{{", text, re.MULTILINE), text
    assert 'owner_id="w1@' in text


def test_opentelemetry_instrument_traces_a_worker_without_touching_the_drain(
    tmp_path: Path,
) -> None:
    """The README's recipe: `opentelemetry-instrument` around the unchanged worker command
    configures the SDK, and the drain call and recovery pass come out as spans."""
    store = tmp_path / "db"
    seed(store, 1)
    launcher = Path(sys.executable).parent / "opentelemetry-instrument"
    env = environment(
        OTEL_SERVICE_NAME="worker",
        OTEL_TRACES_EXPORTER="console",
        OTEL_METRICS_EXPORTER="none",
        OTEL_LOGS_EXPORTER="none",
    )
    log = tmp_path / "worker.log"
    with log.open("wb") as out:
        worker_command = ["-m", "trio_sessions", "worker", "worker_drain:reply"]
        process = subprocess.Popen(
            [str(launcher), sys.executable, *worker_command, "--store", str(store)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        deadline = time.monotonic() + DEADLINE
        while '"name": "trio_sessions.drain"' not in log.read_text():
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
    finally:
        process.terminate()
        process.wait(timeout=DEADLINE)
    spans = log.read_text()
    assert '"trio_sessions.session_id": "s000"' in spans
    assert '"name": "trio_sessions.recovery_pass"' in spans


def test_a_loopback_console_refuses_hostile_requests_without_acting(tmp_path: Path) -> None:
    """Without a token the console answers only to a loopback host name: a page that
    rebinds its own name to 127.0.0.1 gets 403 (it read every page and acted before). A
    path whose encoding is not UTF-8 is a 400 with nothing written (it was a session named
    U+FFFD). An action's return page is one of the console's own - no other site, however
    spelled (a backslash, a tab) - and a line break or a NUL in it is not a 500 after the
    action ran. A quarantined session's page opens (the operator's delete button is
    there) and its event stream says why and stays open, where both failed on the
    malformed row."""
    store = tmp_path / "db"
    raw = Raw(store)
    seed(store, 1)
    backs = ("/\\evil.example/", "/\t/evil.example/", "/sessions/x\nX: y", "/\x00")
    # One pending input per hostile return page: each cancel acts, then redirects.
    cancellable = [f"in-{index}" for index in range(len(backs))]
    seed_inputs(store, "s000", *cancellable)
    seed_quarantine(store, "s000", "dead")
    with (
        console(str(store), tmp_path) as (url, _),
        httpx.Client(base_url=url, timeout=DEADLINE) as client,
    ):
        port = urllib.parse.urlsplit(url).port
        rebound = client.get("/", headers={"host": f"attacker.example:{port}"})
        assert rebound.status_code == 403
        assert "csrf" not in rebound.text
        for loopback in (f"localhost:{port}", f"LOCALHOST.:{port}", f"[::1]:{port}"):
            assert client.get("/", headers={"host": loopback}).status_code == 200, loopback
        page = client.get("/")
        assert page.status_code == 200
        csrf = csrf_of(page.text)
        hostile = client.post("/sessions/%ff/pause", data={"csrf": csrf})
        assert hostile.status_code == 400
        assert raw.one("SELECT COUNT(*) FROM session") == (1,)
        for input_id, back in zip(cancellable, backs, strict=True):
            answer = client.post(f"/inputs/{input_id}/cancel", data={"csrf": csrf, "back": back})
            assert (answer.status_code, answer.headers["location"]) == (303, "/"), back
        assert raw.one("SELECT COUNT(*) FROM session_input WHERE id LIKE 'in-%'") == (0,)
        session = client.get("/sessions/s000")
        assert session.status_code == 200
        assert "malformed" in session.text and "/sessions/s000/delete" in session.text
        with client.stream("GET", "/sessions/s000/events") as events:
            assert events.status_code == 200
            received = b""
            for chunk in events.iter_bytes():  # the stream stays open: no reconnect loop
                received += chunk
                if b"\n\n" in received:
                    break
            assert received.startswith(b": malformed record")


def test_a_console_on_a_missing_database_is_refused_and_creates_nothing(tmp_path: Path) -> None:
    """README "Operations": `python -m trio_sessions` "never creates or migrates a database:
    a missing file ... is refused with an error and exit status 1" (the CLI's invariant
    names the worker as the only exception). The console opened a producer runtime on
    whatever path it was given, so a mistyped `--store` created an empty store (and would
    migrate an older one under the processes still running on it) and served it as if
    all were well."""
    store = tmp_path / "mistyped.db"
    argv = ["-m", "trio_sessions", "console", "--store", str(store), "--bind", "127.0.0.1:0"]
    process = spawn(argv, tmp_path / "console.log")
    try:
        code = process.process.wait(timeout=DEADLINE)
    except subprocess.TimeoutExpired:
        process.stop()
        pytest.fail(f"the console served a store it created: {process.output()}")
    assert code == 1, process.output()
    assert "Traceback" not in process.output()
    assert not store.exists()


# ---------------------------------------------------------------------------------------------
# What a page costs, logins across consoles, bind errors, ids in URLs and queries (review)


def store_of(path: Location) -> Any:
    if isinstance(path, PgLocation):
        from trio_sessions._postgres import PostgresStore

        return PostgresStore(path.url, schema=path.schema)
    return path


@contextmanager
def console_on(path: Location, log_dir: Path, *args: str) -> Iterator[tuple[str, Process]]:
    """A console on the SQLite file or the PostgreSQL schema `path`."""
    if isinstance(path, PgLocation):
        with console(path.url, log_dir, "--schema", path.schema, *args) as served:
            yield served
    else:
        with console(str(path), log_dir, *args) as served:
            yield served


def seed_ids(path: Location, *session_ids: str) -> None:
    """A session for each id, each with one input."""

    async def submit_all() -> None:
        async with trio_sessions.open_runtime(store_of(path), None) as producer:
            for session_id in session_ids:
                await producer.submit(session_id, {"text": "hello"})

    trio.run(submit_all)


def seed_inputs(path: Location, session_id: str, *input_ids: str) -> None:
    """A pending input of `session_id` for each of `input_ids`."""

    async def submit_all() -> None:
        async with trio_sessions.open_runtime(store_of(path), None) as producer:
            for input_id in input_ids:
                await producer.submit(session_id, {"text": "hello"}, input_id=input_id)

    trio.run(submit_all)


def seed_messages(path: Location, session_id: str, count: int) -> None:
    """`count` finished user messages (seq 10 ...) in one statement."""
    Raw(path).write(
        "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?)"
        " INSERT INTO session_message(id, session_id, role, seq, data, time_created,"
        " time_updated) SELECT 'm' || i, ?, 'user', i + 9, '{\"text\": \"message\"}', 0, 0"
        " FROM n",
        (count, session_id),
    )


@BOTH
def test_the_quarantine_table_costs_a_page_not_the_store(db_path: Location, tmp_path: Path) -> None:
    """README: the sessions list is "paged in the store (one page costs the same with 100,000
    sessions)". But every list page - the first, the next ones, each search - also renders
    every quarantined execution in the store with two forms each, unpaged
    (`_store.quarantined` has no limit): 1,000 quarantines make each page of 50 sessions
    carry 1,000 rows."""
    store = db_path
    seed_ids(store, "s000")
    Raw(store).write(
        "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 1000)"
        f" {QUARANTINE_ROWS} SELECT 'e' || i, 's' || i, 'o', 0, 'bad', 0, i FROM n"
    )
    with (
        console_on(store, tmp_path) as (url, _),
        httpx.Client(base_url=url, timeout=DEADLINE) as client,
    ):
        for params in ({}, {"q": "s000"}):
            page = client.get("/", params=params)
            assert page.status_code == 200
            shown = page.text.count("data-execution=")
            assert shown <= 100, f"one page of sessions lists {shown} quarantined executions"


@BOTH
def test_a_session_page_costs_a_page_not_the_whole_transcript(
    db_path: Location, tmp_path: Path
) -> None:
    """A session page renders every message of the transcript (`runtime.transcript()`, no
    limit): a 5,000-message session is one page of 5,000 messages (20,000: 2 MB of HTML),
    where the list is careful to cost one page whatever the store holds."""
    store = db_path
    seed_ids(store, "big")
    seed_messages(store, "big", 5_000)
    with (
        console_on(store, tmp_path) as (url, _),
        httpx.Client(base_url=url, timeout=DEADLINE) as client,
    ):
        page = client.get("/sessions/big")
        assert page.status_code == 200
        shown = page.text.count('<div class="message ')
        assert shown <= 1_000, f"one session page renders {shown} messages"


@BOTH
def test_the_live_stream_does_not_send_again_what_the_page_shows(
    db_path: Location, tmp_path: Path
) -> None:
    """The session page renders the transcript, then its script follows the page's
    `data-events` URL - a stream opened with no cursor, which sends every stored message
    again (one "message" event each, each replacing its node on the page) before the first
    change: a 20,000-message session costs the page 2.8 MB of events and 20,000 DOM
    replacements more. The first event after the page should be the first change since
    it - here a truncate made once the stream is open - not a copy of message 10."""
    store = db_path
    seed_ids(store, "big")
    seed_messages(store, "big", 100)
    with (
        console_on(store, tmp_path) as (url, _),
        httpx.Client(base_url=url, timeout=DEADLINE) as client,
    ):
        page = client.get("/sessions/big").text
        assert page.count('<div class="message ') == 100
        with client.stream("GET", events_path(page)) as stream:
            assert stream.status_code == 200

            async def truncate() -> None:
                async with trio_sessions.open_runtime(store_of(store), None) as producer:
                    await producer.truncate("big", after_seq=50)

            trio.run(truncate)
            first = None
            for line in stream.iter_lines():
                if line.startswith("data: "):
                    first = json.loads(line[len("data: ") :])
                    break
    assert first == {"drop_after": 50}, f"the stream's first event: {str(first)[:120]}"


def test_two_consoles_on_one_host_keep_their_own_logins(tmp_path: Path) -> None:
    """Cookies are not isolated by port (RFC 6265 §8.5), and every console sets the same
    cookie name to its token on `Path=/`. An operator running two consoles on one host (two
    stores, two tokens) is logged out of the first by logging in to the second, and the
    browser hands each console the other's token - as it does to every other service on
    that host name, on any port."""
    first_store, second_store = tmp_path / "a.db", tmp_path / "b.db"
    seed_ids(first_store, "a1")
    seed_ids(second_store, "b1")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    other_token = "another-console-token-9876543210"
    with (
        console(str(first_store), tmp_path / "a", "--token", TOKEN) as (first, _),
        console(str(second_store), tmp_path / "b", "--token", other_token) as (second, _),
        httpx.Client(timeout=DEADLINE) as browser,  # one cookie jar, as one browser
    ):
        assert browser.get(f"{first}/?token={TOKEN}").status_code == 303
        assert browser.get(f"{first}/").status_code == 200
        leaked = browser.get(f"{second}/").request.headers.get("cookie", "")
        assert browser.get(f"{second}/?token={other_token}").status_code == 303
        assert browser.get(f"{second}/").status_code == 200
        assert browser.get(f"{first}/").status_code == 200, "logged out of the first console"
    assert TOKEN not in leaked, "the first console's token went to the second console"


def test_a_bind_address_in_use_is_an_error_not_a_traceback(tmp_path: Path) -> None:
    """`console --bind` on a port another process holds (or an address not on this host):
    the operator gets hypercorn's OSError as a 40-line traceback, where every other setting
    to change is one line of `error: ...` (test_console's exit-2 cases)."""
    store = tmp_path / "db"
    seed_ids(store, "s000")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = ["console", "--store", str(store), "--bind", f"127.0.0.1:{port}"]
        completed = subprocess.run(
            [sys.executable, "-m", "trio_sessions", *argv],
            capture_output=True,
            text=True,
            env=environment(),
            timeout=DEADLINE,
            check=False,
        )
    assert completed.returncode == 2, completed.stderr[-600:]
    assert "Traceback" not in completed.stderr, completed.stderr[-600:]
    assert f"error: cannot listen on 127.0.0.1:{port}: " in completed.stderr


@BOTH
def test_a_session_named_by_dot_segments_can_be_opened_and_acted_on(
    db_path: Location, tmp_path: Path
) -> None:
    """Session ids the runtime accepts ("..", "."), linked as `/sessions/..` and acted on by
    a form posting to `/sessions/../pause`: every client resolves those (RFC 3986 §5.2.4;
    browsers also for "%2E") to `/` and `/pause`. The session's page cannot be opened (the
    link shows the list, or 404) and its buttons answer 404 "no such action"."""
    store = db_path
    seed_ids(store, "..", ".")
    with (
        console_on(store, tmp_path) as (url, _),
        httpx.Client(base_url=url, timeout=DEADLINE) as client,
    ):
        listing = client.get("/").text
        links = re.findall(r'<td><a href="(/sessions/[^"]+)">', listing)
        actions = re.findall(r'<form method="post" action="([^"]+/pause)"', listing)
        csrf = re.search(r'name="csrf" value="([0-9a-f]+)"', listing)
        assert len(links) == 2 and len(actions) == 2 and csrf is not None, listing
        failures = []
        for link in links:
            page = client.get(link)
            if page.status_code != 200 or "<title>Session " not in page.text:
                failures.append((link, page.status_code, str(page.url)))
        for action in actions:
            done = client.post(action, data={"csrf": csrf.group(1)})
            if done.status_code != 303:
                failures.append((action, done.status_code, str(done.url)))
        assert failures == [], failures
        assert Raw(store).rows("SELECT id FROM session WHERE time_paused IS NULL") == []


@BOTH
def test_a_session_id_the_runtime_refuses_is_not_linked_to_a_400(
    db_path: Location, tmp_path: Path
) -> None:
    """A session id another tool wrote that `validate_session_id` refuses (a tab in it) is
    listed with a link and buttons as any other; its page answers 400 "session id must be
    printable" (session_status reads it, then `transcript()` refuses the id) and so do its
    buttons: the operator cannot see or delete it in the console. A non-UTF-8 id is shown
    unlinked, as a malformed row; this one should be too, or its page should open."""
    store = db_path
    seed_ids(store, "s000")
    Raw(store).write("INSERT INTO session(id, time_created) VALUES (?, 0)", ("tab\tid",))
    with (
        console_on(store, tmp_path) as (url, _),
        httpx.Client(base_url=url, timeout=DEADLINE) as client,
    ):
        listing = client.get("/").text
        links = re.findall(r'<td><a href="(/sessions/[^"]+)">', listing)
        assert "/sessions/s000" in links
        assert "<tr><td>tab\tid</td>" in listing, "the refused id is no longer listed"
        assert "an id the runtime refuses" in listing
        for link in links:
            page = client.get(link)
            assert page.status_code == 200, (link, page.status_code, page.text[-200:])


@BOTH
def test_a_query_that_is_not_utf8_is_refused_not_searched_as_replacement_characters(
    db_path: Location, tmp_path: Path
) -> None:
    """A path that is not UTF-8 is a 400 (`_segments`: "never a replacement character's
    id"), but `_query` decodes the query with replacement characters: `?after=%FF` lists
    the sessions after U+FFFD - none - and `?q=%FF` searches for U+FFFD, both as an empty
    200 page that says nothing was wrong with the request."""
    store = db_path
    seed_ids(store, "s000", "s001")
    with (
        console_on(store, tmp_path) as (url, _),
        httpx.Client(base_url=url, timeout=DEADLINE) as client,
    ):
        for query in ("q=%FF", "after=%FF", "q=s%C3"):
            answer = client.get(f"/?{query}")
            shown = re.findall(r'data-session="([^"]+)"', answer.text)
            assert answer.status_code == 400, (query, answer.status_code, shown)
            assert "UTF-8" in answer.text or "utf-8" in answer.text


def test_a_pending_input_whose_id_is_not_utf8_offers_no_cancel_button(tmp_path: Path) -> None:
    """A session page lists a pending input whose id is not UTF-8 with its reason and no
    cancel button, as the tables list such rows without actions: a button would post the
    shown (replaced) id, which `cancel_input` finds no input by, and the console would
    answer 303 as if it had cancelled it. The input stays."""
    store = tmp_path / "db"
    seed_ids(store, "s000")
    Raw(store).write(
        "INSERT INTO session_input(id, session_id, seq, payload, time_created)"
        " VALUES (CAST(X'69FF' AS TEXT), 's000', 99, '{}', 0)"
    )
    with (
        console(str(store), tmp_path) as (url, _),
        httpx.Client(base_url=url, timeout=DEADLINE) as client,
    ):
        page = client.get("/sessions/s000").text
        assert "session_input.id is not UTF-8 text (X&#x27;69FF&#x27;)" in page
        buttons = re.findall(r'action="(/inputs/i%EF%BF%BD/cancel)"', page)  # the shown id
        assert buttons == [], f"{buttons}: a cancel button by the shown id"
        row = re.search(r'<tr data-input="i\ufffd">.*?</tr>', page)
        assert row is not None and "<form" not in row.group(0), "a cancel form for it"
        assert page.count('action="/inputs/') == 1  # the seeded input's, only
    left = Raw(store).one("SELECT COUNT(*) FROM session_input WHERE id = CAST(X'69FF' AS TEXT)")
    assert left == (1,)


def test_a_scheduled_inputs_due_time_reads_as_a_time(tmp_path: Path) -> None:
    """A session page shows when a scheduled input falls due as a UTC time, not as the
    store's epoch milliseconds ("at 1796592531788 ms", found by an audit)."""
    store = tmp_path / "db"
    seed_ids(store, "s000")
    Raw(store).write(
        "INSERT INTO session_input(id, session_id, seq, payload, time_created, due_at)"
        " VALUES ('later', 's000', 99, '{}', 0, 1796592531788)"
    )
    with (
        console(str(store), tmp_path) as (url, _),
        httpx.Client(base_url=url, timeout=DEADLINE) as client,
    ):
        page = client.get("/sessions/s000").text
    row = re.search(r'<tr data-input="later">.*?</tr>', page)
    assert row is not None and "<td>at 2026-12-06 21:28:51.788 UTC</td>" in row.group(0), row


@BOTH
def test_a_pending_input_and_a_message_in_any_script_read_as_written(
    db_path: Location, tmp_path: Path
) -> None:
    """A session page shows a pending input's payload and a user message's text as the user
    wrote them, not as the `\\uXXXX` escapes the store's JSON holds (an operator read
    "h\\u00e9llo \\u65e5\\u672c" for "héllo 日本", found by an audit)."""
    store = db_path

    async def submit() -> None:
        async with trio_sessions.open_runtime(store_of(store), None) as producer:
            await producer.submit("s", {"text": "héllo 日本 😀"}, input_id="pending")

    trio.run(submit)
    Raw(store).write(
        "INSERT INTO session_message(id, session_id, role, seq, data, time_created,"
        " time_updated) VALUES ('m1', 's', 'user', 1, ?, 0, 0)",
        (json.dumps({"text": "für dich"}),),
    )
    with (
        console_on(store, tmp_path) as (url, _),
        httpx.Client(base_url=url, timeout=DEADLINE) as client,
    ):
        page = client.get("/sessions/s").text
    row = re.search(r'<tr data-input="pending">.*?</tr>', page)
    assert row is not None and "héllo 日本 😀" in row.group(0), row
    message = re.search(r'<div class="message user" data-seq="1">.*?</div>', page)
    assert message is not None and "für dich" in message.group(0), message


def test_the_quarantine_table_pages_through_every_execution_once(tmp_path: Path) -> None:
    """The quarantine table's link to its next page (keyset by execution id, the sessions'
    page and search kept) lists each quarantined execution exactly once, 100 a page."""
    store = tmp_path / "db"
    seed_ids(store, "s000")
    Raw(store).write(
        "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 250)"
        f" {QUARANTINE_ROWS} SELECT printf('e%03d', i), 's000', 'o', 0, 'bad', 0, i FROM n"
    )
    with (
        console(str(store), tmp_path) as (url, _),
        httpx.Client(base_url=url, timeout=DEADLINE) as client,
    ):
        seen: list[str] = []
        page = client.get("/", params={"q": "s0"}).text
        for _ in range(5):  # 3 pages; more is a link that leads back
            shown = re.findall(r'data-execution="([^"]+)"', page)
            assert 0 < len(shown) <= 100 and session_ids(page) == ["s000"]
            seen += shown
            link = re.search(r'id="quarantine-next" href="([^"]+)"', page)
            if link is None:
                break
            assert "q=s0" in link.group(1)
            page = client.get(link.group(1).replace("&amp;", "&")).text
        else:
            pytest.fail(f"the quarantine table's next links never end: {len(seen)} listed")
    assert seen == [f"e{i:03d}" for i in range(1, 251)]


def test_a_session_page_links_to_its_earlier_messages(tmp_path: Path) -> None:
    """A session page shows its newest 200 messages and links to the 200 before them (keyset
    by seq), down to the first; an earlier page follows no live stream."""
    store = tmp_path / "db"
    seed_ids(store, "long")
    seed_messages(store, "long", 450)  # seqs 10 to 459
    with (
        console(str(store), tmp_path) as (url, _),
        httpx.Client(base_url=url, timeout=DEADLINE) as client,
    ):
        pages = [client.get("/sessions/long").text]
        assert "data-events=" in pages[0]
        while (link := re.search(r'id="earlier" href="([^"]+)"', pages[-1])) is not None:
            pages.append(client.get(link.group(1).replace("&amp;", "&")).text)
        seqs = [[int(s) for s in re.findall(r'data-seq="(\d+)"', page)] for page in pages]
    assert seqs == [list(range(260, 460)), list(range(60, 260)), list(range(10, 60))]
    assert all("data-events=" not in page for page in pages[1:])


def test_a_session_pages_transcript_links_keep_its_pending_inputs_page(tmp_path: Path) -> None:
    """On the second page of pending inputs, "earlier messages" and "newest messages" went
    back to the first page of inputs. Each link now keeps the other table's page."""
    store = tmp_path / "db"
    seed_ids(store, "long")
    seed_messages(store, "long", 450)

    async def submit_all() -> None:
        async with trio_sessions.open_runtime(str(store), None) as producer:
            for index in range(PAGE_SIZE + 10):
                await producer.submit("long", {"i": index})

    trio.run(submit_all)

    def inputs_shown(page: str) -> list[str]:
        return re.findall(r'<tr data-input="[^"]+"><td>(\d+)</td>', page)

    def follow(page: str, link_id: str) -> str:
        link = re.search(rf'id="{link_id}" href="([^"]+)"', page)
        assert link is not None, (link_id, page)
        return client.get(link.group(1).replace("&amp;", "&")).text

    with (
        console(str(store), tmp_path) as (url, _),
        httpx.Client(base_url=url, timeout=DEADLINE) as client,
    ):
        second_inputs = follow(client.get("/sessions/long").text, "inputs-next")
        earlier = follow(second_inputs, "earlier")
        newest = follow(earlier, "newest")
    assert len(inputs_shown(second_inputs)) == 11  # seed_ids submitted one more
    assert inputs_shown(earlier) == inputs_shown(second_inputs)
    assert inputs_shown(newest) == inputs_shown(second_inputs)
    assert re.findall(r'data-seq="(\d+)"', earlier)[0] == "60"


def sse_events(lines: Iterator[str]) -> Iterator[tuple[str | None, Any]]:
    """(the `id:` of the event or None, its data as JSON) per SSE event; comments skipped."""
    event_id, data = None, None
    for line in lines:
        if line.startswith("id: "):
            event_id = line[len("id: ") :]
        elif line.startswith("data: "):
            data = json.loads(line[len("data: ") :])
        elif line == "" and data is not None:
            yield event_id, data
            event_id, data = None, None


def events_path(page: str) -> str:
    """The path of a session page's live stream (its `data-events`)."""
    events = re.search(r'data-events="([^"]+)"', page)
    assert events is not None, page
    return events.group(1).replace("&amp;", "&")


def test_the_live_stream_misses_nothing_since_the_page_and_resumes_from_last_event_id(
    tmp_path: Path,
) -> None:
    """A message stored after the page was read but before its stream opened is the
    stream's first event (no gap), with an SSE `id:`; a stream reopened with that id as
    Last-Event-ID (an EventSource's reconnect) sends it no more, only what follows - here
    a truncate, as one drop of the messages after the cut."""
    store = tmp_path / "db"
    seed_ids(store, "s")
    seed_messages(store, "s", 10)  # seqs 10 to 19
    with (
        console(str(store), tmp_path) as (url, _),
        httpx.Client(base_url=url, timeout=DEADLINE) as client,
    ):
        page = client.get("/sessions/s").text
        path = events_path(page)
        Raw(store).write(
            "INSERT INTO session_message(id, session_id, role, seq, data, time_created,"
            " time_updated) VALUES ('late', 's', 'user', 20, '{\"text\": \"late\"}', 0, 0)"
        )
        with client.stream("GET", path) as stream:
            event_id, first = next(sse_events(stream.iter_lines()))
        assert first["seq"] == 20 and "late" in first["html"] and event_id
        with client.stream("GET", path, headers={"last-event-id": event_id}) as stream:
            assert stream.status_code == 200

            async def truncate() -> None:
                async with trio_sessions.open_runtime(store, None) as producer:
                    await producer.truncate("s", after_seq=15)

            trio.run(truncate)
            _, resumed = next(sse_events(stream.iter_lines()))
    assert resumed == {"drop_after": 15}


def test_an_open_message_on_the_page_streams_its_appends(tmp_path: Path) -> None:
    """An open assistant message the page shows is followed from the version the page
    read: text streamed onto it since arrives as one append of that text (the console
    holds its copy), not the message again."""
    store = tmp_path / "db"
    seed_ids(store, "s")
    raw = Raw(store)
    raw.seed_assistant(
        "s",
        "x1",
        1,
        '{"parts": [{"type": "text", "text": "he"}], "finished": false, "error": null}',
    )
    with (
        console(str(store), tmp_path) as (url, _),
        httpx.Client(base_url=url, timeout=DEADLINE) as client,
    ):
        page = client.get("/sessions/s").text
        assert ">he</span>" in page
        with client.stream("GET", events_path(page)) as stream:
            raw.write(
                "INSERT INTO session_message_delta(message_id, version, text)"
                " VALUES ('m-x1-1', 1, 'llo')"
            )
            _, first = next(sse_events(stream.iter_lines()))
    assert first == {"seq": 1, "append": "llo"}


def test_an_answer_holding_a_bidi_override_reads_escaped_on_the_page_and_live(
    tmp_path: Path,
) -> None:
    """An assistant message holding U+202E (a model's output, a prompt injection's) is
    shown with it escaped on the page and in the text streamed onto it, as a payload is:
    the operator read the answer reversed. Found by audit (audB54)."""
    store = tmp_path / "db"
    seed_ids(store, "s")
    raw = Raw(store)
    opened = {"parts": [{"type": "text", "text": "ok \u202eevil"}], "finished": False}
    raw.seed_assistant("s", "x1", 1, json.dumps({**opened, "error": None}))
    with (
        console(str(store), tmp_path) as (url, _),
        httpx.Client(base_url=url, timeout=DEADLINE) as client,
    ):
        page = client.get("/sessions/s").text
        assert ">ok \\u202eevil</span>" in page and "\u202e" not in page
        with client.stream("GET", events_path(page)) as stream:
            raw.write(
                "INSERT INTO session_message_delta(message_id, version, text)"
                " VALUES ('m-x1-1', 1, ?)",
                ("\u2067more\u2069",),
            )
            _, first = next(sse_events(stream.iter_lines()))
    assert first == {"seq": 1, "append": "\\u2067more\\u2069"}


# ---------------------------------------------------------------------------------------------
# The live page after a rewrite; paging on stored bytes; ids marked in URLs (second review)


def test_a_rewrite_does_not_send_again_a_message_the_page_received_live(tmp_path: Path) -> None:
    """PageFeed holds back, after a "truncate", the messages the page shows unchanged - but
    its `known` is only what the stream read when it opened: a message the page got live
    since (seq 20 here) is not in it, so a truncate that keeps it is a drop after 19 and
    message 20 sent again (a duplicate; the same page reconnected would hold it back)."""
    store = tmp_path / "db"
    seed_ids(store, "s")
    seed_messages(store, "s", 10)  # seqs 10 to 19
    with (
        console(str(store), tmp_path) as (url, _),
        httpx.Client(base_url=url, timeout=DEADLINE) as client,
    ):
        page = client.get("/sessions/s").text
        with client.stream("GET", events_path(page)) as stream:
            events = sse_events(stream.iter_lines())
            Raw(store).write(
                "INSERT INTO session_message(id, session_id, role, seq, data, time_created,"
                " time_updated) VALUES ('late1', 's', 'user', 20, '{\"text\": \"a\"}', 0, 0),"
                " ('late2', 's', 'user', 21, '{\"text\": \"b\"}', 0, 0)"
            )
            seen = []
            while 21 not in seen:
                _, update = next(events)
                seen.append(update["seq"])
            assert seen == [20, 21]

            async def truncate() -> None:
                async with trio_sessions.open_runtime(store, None) as producer:
                    await producer.truncate("s", after_seq=20)

            trio.run(truncate)
            _, after_truncate = next(events)
    assert after_truncate == {"drop_after": 20}, "message 20, shown as stored, is sent again"


class _Runtime:
    """Just what `Console.events` uses of a runtime, over one real `EventStream`."""

    def __init__(self, stream: EventStream, shown: Shown) -> None:
        self._stream = stream
        self._shown = shown
        self._db = self

    async def read(self, job: Any, *args: Any) -> Any:
        return self._shown  # `_store.shown_messages`

    @contextlib.asynccontextmanager
    async def stream(self, session_id: str, *, cursor: str | None = None) -> AsyncIterator[Any]:
        yield self._stream


async def test_a_deleted_transcript_is_dropped_from_the_page_when_the_stream_settles() -> None:
    """After a "truncate" PageFeed waits for the stream to be `settled` (not dirty) before it
    tells the page what to drop; the console asks only when an event arrives. A stream left
    dirty by its read (the change scan marked it while it read: it reads by itself again)
    whose next read finds nothing - here the session was deleted - yields no more events:
    the page never gets its drop and shows the deleted messages until the next change."""
    tag = message_tag("m3")
    reads = 0
    stream: EventStream

    async def read(job: Any, session_id: str, position: Position) -> StreamChanges:
        nonlocal reads
        reads += 1
        if reads == 1:
            stream.mark_dirty()  # the change scan saw the delete while this read ran
            return StreamChanges([], rewritten=True)  # the session was deleted
        return StreamChanges([])  # nothing changed since

    stream = EventStream("s", Position(3, tag), read)
    shown = Shown({1: "m1", 2: "m2", 3: "m3"}, [])
    text = await _sent_to_page(stream, shown, Position(3, tag), shown_from=1)
    assert reads == 2 and not stream.dirty  # the stream has nothing more to send
    assert '"drop_after": 0' in text, f"the page was sent {text!r}"


async def test_a_drop_held_back_over_several_reads_is_sent_when_a_read_brings_nothing() -> None:
    """A rewrite whose messages come in more than one read (`more`) holds the drop back
    until the last read; when that read brings nothing (the messages it would have sent
    were deleted meanwhile) no event carries the drop: it is sent from the read itself."""
    tag = message_tag("m3")
    reads = 0

    async def read(job: Any, session_id: str, position: Position) -> StreamChanges:
        nonlocal reads
        reads += 1
        if reads == 1:
            return StreamChanges([], rewritten=True, more=True)  # more of them to read
        return StreamChanges([])  # the rest were deleted meanwhile

    stream = EventStream("s", Position(3, tag), read)
    shown = Shown({1: "m1", 2: "m2", 3: "m3"}, [])
    text = await _sent_to_page(stream, shown, Position(3, tag), shown_from=1)
    assert reads == 2
    assert text.count('"drop_after": 0') == 1


def _user(seq: int) -> Whole:
    message = Message(f"m{seq}", "s", "user", seq, {"text": f"u{seq}"}, None, None)
    return Whole(seq, f"m{seq}", message, 0, False)


def _assistant(seq: int, text: str, *, finished: bool, version: int) -> Whole:
    data = AssistantData((TextPart(text),), finished, None)
    message = Message(f"m{seq}", "s", "assistant", seq, data, None, None)
    return Whole(seq, f"m{seq}", message, version, not finished)


async def _page_text(
    position: Position, shown: Shown, reads: list[StreamChanges], shown_from: int
) -> str:
    """What `Console.events` sends a page showing `position` (its stream opened with
    `shown` as the console's read, then the stream's reads `reads` in turn) until the
    stream waits."""
    answers = iter(reads)

    async def read(job: Any, session_id: str, at: Position) -> StreamChanges:
        return next(answers, StreamChanges([]))

    return await _sent_to_page(EventStream("s", position, read), shown, position, shown_from)


async def _sent_to_page(
    stream: EventStream,
    shown: Shown,
    position: Position,
    shown_from: int,
    last_event_id: str | None = None,
) -> str:
    """What `Console.events` sends a page that shows messages from `shown_from` on and holds
    `position` (`stream` behind it, `shown` as the console's read) until nothing moves; with
    `last_event_id`, an EventSource's reconnect of that page (its URL unchanged)."""
    console = Console(_Runtime(stream, shown), "", Guard(None, False))  # type: ignore[arg-type]
    sent: list[bytes] = []

    async def send(message: Any) -> None:
        sent.append(message.get("body", b""))

    async def receive() -> Any:
        await trio.sleep_forever()  # the page stays

    async with trio.open_nursery() as nursery:
        query = {"cursor": encode_cursor(session_tag("s"), position), "from": str(shown_from)}
        nursery.start_soon(console.events, "s", query, last_event_id, receive, send)
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    return b"".join(sent).decode()


async def test_a_message_that_finished_while_the_page_loaded_is_held_back_by_a_rewrite() -> None:
    """The page shows messages 1 to 3, 3 an open assistant message; it finishes before the
    page's stream opens, so the console sends it whole as the stream's first update
    (`_followed`). The page now shows it final, as stored - but `known` never learns it
    (`_followed` leaves the position's open seqs out, and `open_tags` is built from the
    moved position, which no longer holds it): a rewrite that keeps messages 1 to 3 is a
    drop after 2 and message 3 sent again, where one received live (`_record`) is held
    back. Expected: only "drop_after": 3 after the rewrite."""
    tag3 = message_tag("m3")
    position = Position(3, tag3, (Held(3, tag3, 1),))
    finished = _assistant(3, "hello", finished=True, version=2)
    shown = Shown({1: "m1", 2: "m2", 3: "m3"}, [finished])
    rewrite = StreamChanges([_user(1), _user(2), finished], rewritten=True)
    text = await _page_text(position, shown, [rewrite], shown_from=1)
    first, _, after_rewrite = text.partition("\n\n")
    assert '"seq": 3' in first and "hello" in first  # the finish, sent when the stream opened
    assert '"drop_after": 3' in after_rewrite and '"seq": 3' not in after_rewrite, (
        f"message 3, shown as stored, is sent again: {after_rewrite!r}"
    )


def test_the_quarantine_table_never_links_a_page_to_itself(tmp_path: Path) -> None:
    """128 stored execution ids b"x\\xff" + one byte (not UTF-8: each shown as
    "x\\ufffd\\ufffd", a name that sorts before all of them) are each listed once over the
    quarantine table's pages, and no next link repeats: a page starts after the last row's
    stored bytes, never after its shown name (the second page was the first again, its
    next link itself)."""
    store = tmp_path / "db"
    seed_ids(store, "s000")
    values = ", ".join(
        f"(CAST(X'78FF{byte:02X}' AS TEXT), 's000', 'o', 0, 'bad', 0, 0)"
        for byte in range(0x80, 0x100)
    )
    Raw(store).write(f"{QUARANTINE_ROWS} VALUES {values}")
    with console(str(store), tmp_path) as (url, _):
        links, shown = _quarantine_pages(url, most=4, counting=NOT_UTF8_EXECUTION)
    assert len(links) == len(set(links)), f"a next link leads to the same page: {links}"
    assert shown == 128, "each of them listed once, by its stored bytes"


def test_the_quarantine_table_pages_through_blob_execution_ids_once_each(
    tmp_path: Path,
) -> None:
    """A BLOB execution id another tool wrote (SQLite orders every BLOB after all text)
    that ends a quarantine page starts the next page after it as a BLOB: 110 BLOB ids after
    a text one are each listed once over the table's pages, and no next link repeats."""
    store = tmp_path / "db"
    seed_ids(store, "s000")
    values = ", ".join(
        f"(X'{f'b{index:03d}'.encode().hex()}', 's000', 'o', 0, 'bad', 0, 0)"
        for index in range(110)
    )
    Raw(store).write(f"{QUARANTINE_ROWS} VALUES ('a', 's000', 'o', 0, 'bad', 0, 0), {values}")
    with console(str(store), tmp_path) as (url, _):
        links, shown = _quarantine_pages(url, most=4, counting=NOT_UTF8_EXECUTION)
    assert len(links) == len(set(links)) == 1, f"next links: {links}"
    assert shown == 110, "each BLOB id listed once"


NOT_UTF8_EXECUTION = "session_recovery.execution_id is not UTF-8"


def _quarantine_pages(url: str, *, most: int, counting: str) -> tuple[list[str], int]:
    """Follow the quarantine table's next links from the first page, at most `most` pages:
    the links followed, and how often `counting` was shown over all the pages."""
    with httpx.Client(base_url=url, timeout=DEADLINE) as client:
        links = []
        page = client.get("/").text
        shown = page.count(counting)
        for _ in range(most - 1):
            link = re.search(r'id="quarantine-next" href="([^"]+)"', page)
            if link is None:
                break
            links.append(link.group(1))
            page = client.get(link.group(1).replace("&amp;", "&")).text
            shown += page.count(counting)
    return links, shown


def _listed_rows(page: str) -> list[str]:
    """The first cell of each row of the sessions table (a session's id as shown)."""
    table = re.search(r'<table id="sessions">.*?<tbody>(.*?)</tbody>', page, re.S)
    assert table is not None, page
    return re.findall(r"<tr[^>]*><td>(?:<a [^>]*>)?([^<]*)<", table.group(1))


def test_the_sessions_table_pages_through_blob_ids_once_each(tmp_path: Path) -> None:
    """SQLite keeps a BLOB another tool wrote in the TEXT id column, and orders every BLOB
    after all text; its driver reads it as bytes, so `session_page` returns such a row's
    `last` as bytes and the next link says `after_hex=`. Two faults: `_page_key` turns
    hex that is UTF-8 back into a str, so `_pages_on` (`last != after`: b"b048" != "b048")
    links a page to itself; and `CAST(:after AS TEXT)` compares a BLOB's key as text, which
    every BLOB sorts after, so the page after one lists the same BLOB ids again (and the
    text ids after its text) - here /?after_hex=62303438 is the first page of BLOB ids
    again, linking itself, and the ten past it are never listed. Expected: following the
    next links lists every session once, no link repeated."""
    store = tmp_path / "db"

    async def submit() -> None:
        async with trio_sessions.open_runtime(store, None) as producer:
            await producer.submit("s000", {"text": "hello"})

    trio.run(submit)
    blobs = [f"b{index:03d}".encode() for index in range(PAGE_SIZE + 10)]
    with contextlib.closing(sqlite3.connect(store)) as connection:
        connection.executemany(
            "INSERT INTO session(id, time_created) VALUES (?, 0)", [(blob,) for blob in blobs]
        )
        connection.commit()
    with (
        console(str(store), tmp_path) as (url, _),
        httpx.Client(base_url=url, timeout=DEADLINE) as client,
    ):
        page = client.get("/").text
        listed = _listed_rows(page)
        links: list[str] = []
        for _ in range(4):
            link = re.search(r'id="next" href="([^"]+)"', page)
            if link is None:
                break
            links.append(link.group(1))
            page = client.get(link.group(1).replace("&amp;", "&")).text
            listed += _listed_rows(page)
    assert len(links) == len(set(links)), f"a next link leads back: {links}"
    assert sorted(listed) == sorted(["s000", *(blob.decode() for blob in blobs)]), (
        f"{len(listed)} rows listed over {len(links) + 1} pages: {listed}"
    )


def test_the_sessions_table_pages_past_a_stored_id_holding_nul(tmp_path: Path) -> None:
    """SQLite keeps whatever text another tool writes: here an id "b\\x00" (valid UTF-8, so
    listed as text) ends the first page. The next link pages after the last row's stored
    id - `after=b%00` - and the console refuses every NUL in a page key ("no session id
    holds a NUL character", a rule for PostgreSQL, which cannot store one), so the next
    page is a 400 and "c" is never reachable; `after_hex=6200` is decoded back to the same
    text and refused alike. Expected: the next link lists "c"."""
    store = tmp_path / "db"

    async def submit() -> None:
        async with trio_sessions.open_runtime(store, None) as producer:
            await producer.submit("c", {"text": "hello"})

    trio.run(submit)
    with contextlib.closing(sqlite3.connect(store)) as connection:
        connection.executemany(
            "INSERT INTO session(id, time_created) VALUES (?, 0)",
            [(f"a{index:03d}",) for index in range(PAGE_SIZE - 1)],
        )
        connection.execute(
            "INSERT INTO session(id, time_created) VALUES (CAST(X'6200' AS TEXT), 0)"
        )
        connection.commit()
    with (
        console(str(store), tmp_path) as (url, _),
        httpx.Client(base_url=url, timeout=DEADLINE) as client,
    ):
        first = client.get("/").text
        assert len(_listed_rows(first)) == PAGE_SIZE
        link = re.search(r'id="next" href="([^"]+)"', first)
        assert link is not None
        second = client.get(link.group(1).replace("&amp;", "&"))
    assert second.status_code == 200, f"{link.group(1)}: {second.status_code} {second.text[-200:]}"
    assert _listed_rows(second.text) == ["c"]


@BOTH
def test_ids_marked_with_a_tilde_round_trip_through_links_forms_and_routes(
    db_path: Location, tmp_path: Path
) -> None:
    """Ids that start with "~" or are dot segments are linked and acted on as themselves:
    "~" is doubled, "." and ".." get one; a segment with one "~" before anything else is
    no id (a 400: an old link `/sessions/~foo` named session "~foo", never "foo")."""
    store = db_path
    ids = ["~", "~~", "~.", "~foo", ".", "..", "foo"]
    seed_ids(store, *ids)
    with (
        console_on(store, tmp_path) as (url, _),
        httpx.Client(base_url=url, timeout=DEADLINE) as client,
    ):
        listing = client.get("/").text
        rows = re.findall(r'<tr data-session="([^"]+)"><td><a href="([^"]+)">', listing)
        linked = {html_id.replace("&#x27;", "'"): link for html_id, link in rows}
        assert linked == {
            "~": "/sessions/~~",
            "~~": "/sessions/~~~",
            "~.": "/sessions/~~.",
            "~foo": "/sessions/~~foo",
            ".": "/sessions/~.",
            "..": "/sessions/~..",
            "foo": "/sessions/foo",
        }
        csrf = csrf_of(listing)
        for session_id, link in linked.items():
            page = client.get(link)
            assert page.status_code == 200 and f"<title>Session {session_id}</title>" in page.text
            assert f'action="{link}/pause"' in page.text
            assert client.post(f"{link}/pause", data={"csrf": csrf}).status_code == 303
            paused = Raw(store).one(
                "SELECT time_paused IS NOT NULL FROM session WHERE id = ?", (session_id,)
            )
            assert paused in ((1,), (True,)), session_id
        answer = client.get("/sessions/~foo")
        assert answer.status_code == 400 and "doubled" in answer.text
        assert client.post("/sessions/~foo/resume", data={"csrf": csrf}).status_code == 400
    assert Raw(store).rows("SELECT id FROM session WHERE time_paused IS NULL") == []


def test_logging_in_expires_the_cookie_that_held_the_raw_token(tmp_path: Path) -> None:
    """Earlier consoles kept the raw token in `trio_sessions_console`: a login expires it,
    so a browser stops sending the token to every service on the host name."""
    store = tmp_path / "db"
    seed_ids(store, "s000")
    with (
        console(str(store), tmp_path, "--token", TOKEN) as (url, _),
        httpx.Client(base_url=url, timeout=DEADLINE) as client,
    ):
        client.cookies.set("trio_sessions_console", TOKEN, domain="127.0.0.1")
        answer = client.get("/", params={"token": TOKEN})
        assert answer.status_code == 303
        cookies = answer.headers.get_list("set-cookie")
        assert any(c.startswith("trio_sessions_console=; Max-Age=0;") for c in cookies), cookies
        assert "trio_sessions_console" not in client.cookies
        assert client.get("/").status_code == 200


def test_a_raw_byte_in_a_query_is_refused_saying_it_is_not_percent_encoded() -> None:
    """A browser percent-encodes every byte past ASCII; a raw one is a 400 that says so
    (not "is not UTF-8 text" for valid UTF-8 sent raw), and %FF is not UTF-8."""
    with pytest.raises(HTTPError, match="not percent-encoded UTF-8"):
        _fields("q=caf\u00e9".encode(), "query")
    with pytest.raises(HTTPError, match="not UTF-8 text"):
        _fields(b"q=%FF", "query")
    assert _fields(b"q=caf%C3%A9", "query") == {"q": "caf\u00e9"}


def test_a_resumed_stream_names_at_most_followed_ids_open_messages(tmp_path: Path) -> None:
    """A Last-Event-ID is the client's to write: one naming more open messages than a page
    follows is a 400, before any read (each costs the console's read work)."""
    store = tmp_path / "db"
    seed_ids(store, "s")
    tag = message_tag("x")

    def cursor(count: int) -> str:
        held = tuple(Held(seq, tag, 1) for seq in range(1, count + 1))
        return encode_cursor(session_tag("s"), Position(count, tag, held))

    with (
        console(str(store), tmp_path) as (url, _),
        httpx.Client(base_url=url, timeout=DEADLINE) as client,
    ):
        path = "/sessions/s/events"
        refused = client.get(path, headers={"last-event-id": cursor(FOLLOWED_IDS + 1)})
        assert refused.status_code == 400 and "at most" in refused.text
        with client.stream("GET", path, headers={"last-event-id": cursor(FOLLOWED_IDS)}) as ok:
            assert ok.status_code == 200
            _, first = next(sse_events(ok.iter_lines()))
    assert first == {"drop_after": 0}  # none of them is stored: a rewrite, for the page


@BOTH
def test_a_cursor_at_the_last_seq_streams_as_on_postgresql_not_a_500(
    db_path: Location, tmp_path: Path
) -> None:
    """A well-formed cursor whose top is seq 2**63-1 (a client's Last-Event-ID, or
    ?cursor=) is a position `runtime.stream()` takes - no message follows it - but the
    console's event stream answered 500 on SQLite (OverflowError: the first seq after the
    top, 2**63, bound as a SQLite INTEGER) and 200 on PostgreSQL. Found by an audit.
    Both answer 200 and the same first event: the stored transcript is not the one the
    cursor names, a rewrite for the page."""
    store = db_path
    seed_ids(store, "s")
    cursor = f"1.{session_tag('s')}.{2**63 - 1}.{message_tag('x')}."
    with (
        console_on(store, tmp_path) as (url, _),
        httpx.Client(base_url=url, timeout=DEADLINE) as client,
    ):
        path = "/sessions/s/events"
        firsts = []
        for headers, params in (({"last-event-id": cursor}, {}), ({}, {"cursor": cursor})):
            with client.stream("GET", path, headers=headers, params=params) as stream:
                assert stream.status_code == 200, (headers, params)
                firsts.append(next(sse_events(stream.iter_lines()))[1])
    assert firsts == [{"drop_after": 0}] * 2


@BOTH
def test_an_empty_session_or_execution_id_is_listed_on_the_first_page(
    db_path: Location, tmp_path: Path
) -> None:
    """Another tool may store a session or a quarantined execution whose id is "" (the CLI's
    `status` lists it); the console's first page of either table asked for ids after "",
    and never listed it. Found by an audit. Listed now: the session as an id the runtime
    refuses, the execution without buttons (a URL's empty segment names nothing: they
    would answer 404; the CLI refuses the id too), saying so."""
    store = db_path
    seed_ids(store, "visible")
    Raw(store).write("INSERT INTO session(id, time_created) VALUES ('', 0)")
    Raw(store).write(QUARANTINE_ROWS + " VALUES ('', 'visible', 'o', 0, 'bad', 0, 0)")
    with (
        console_on(store, tmp_path) as (url, _),
        httpx.Client(base_url=url, timeout=DEADLINE) as client,
    ):
        page = client.get("/").text
    sessions = page.split('<table id="sessions">')[1].split("</table>")[0]
    assert sessions.count("<tr") == 3, sessions  # the head, "" and "visible"
    assert "<tr><td></td>" in sessions and "an id the runtime refuses" in sessions
    assert session_ids(page) == ["visible"]
    row = re.search(r'<tr data-execution="">.*?</tr>', page)
    assert row is not None and "<form" not in row.group(0), page
    assert "an empty id: no action" in row.group(0)


@BOTH
def test_interrupt_is_offered_only_where_it_can_act_and_says_when_nothing_was(
    db_path: Location, tmp_path: Path
) -> None:
    """The console offered `interrupt` on every session holding a claim; on one already
    stopping `runtime.interrupt()` does nothing and returns False, and the console answered
    303 as if it had acted. Found by an audit. The button is shown for a claim that is not
    stopping (an expired one too: marked, recovery finishes it as cancelled); a POST that
    interrupts nothing (a page from before the claim began stopping) is a 409 that says so,
    changing nothing."""
    store = db_path
    seed_ids(store, "gone", "stopping", "live")
    now = int(time.time() * 1000)
    raw = Raw(store)
    raw.seed_claim("gone", "e-gone", expires_at=now - 1)
    raw.seed_claim("stopping", "e-stopping", expires_at=now + 600_000, phase="cancelling")
    raw.seed_claim("live", "e-live", expires_at=now + 600_000)
    with (
        console_on(store, tmp_path) as (url, _),
        httpx.Client(base_url=url, timeout=DEADLINE) as client,
    ):
        listing = client.get("/").text
        offered = re.findall(r'action="/sessions/([^/"]+)/interrupt"', listing)
        assert offered == ["gone", "live"], offered
        for session_id in ("gone", "stopping", "live"):
            page = client.get(f"/sessions/{session_id}").text
            assert ('value="interrupt"' in page) == (session_id != "stopping"), session_id
        answer = client.post("/sessions/stopping/interrupt", data={"csrf": csrf_of(listing)})
        assert answer.status_code == 409 and "nothing was interrupted" in answer.text
        for session_id in ("gone", "live"):
            done = client.post(f"/sessions/{session_id}/interrupt", data={"csrf": csrf_of(listing)})
            assert done.status_code == 303, session_id
    phases = dict(raw.rows("SELECT id, phase FROM session_execution"))
    assert phases == {"e-gone": "cancelling", "e-stopping": "cancelling", "e-live": "cancelling"}


@BOTH
def test_a_session_page_pages_through_every_pending_input_once(
    db_path: Location, tmp_path: Path
) -> None:
    """A session page said "pending inputs 120" and listed the first 50 (PAGE_SIZE), with
    no way to see or cancel the rest. Found by an audit. The table says how many of them
    it shows and links to the next page (keyset by seq), each input listed once; a cancel
    on a later page comes back to that page."""

    async def submit_all() -> None:
        async with trio_sessions.open_runtime(store_of(db_path), None) as producer:
            for index in range(120):
                await producer.submit("many", {"i": index})

    trio.run(submit_all)
    with (
        console_on(db_path, tmp_path) as (url, _),
        httpx.Client(base_url=url, timeout=DEADLINE) as client,
    ):
        pages = [client.get("/sessions/many").text]
        assert f"{PAGE_SIZE} of 120 pending inputs shown" in pages[0]
        for _ in range(4):  # 3 pages; more is a link that never ends
            link = re.search(r'id="inputs-next" href="([^"]+)"', pages[-1])
            if link is None:
                break
            pages.append(client.get(link.group(1).replace("&amp;", "&")).text)
        else:
            pytest.fail("the pending inputs' next links never end")
        seqs = [
            [int(seq) for seq in re.findall(r'<tr data-input="[^"]+"><td>(\d+)</td>', page)]
            for page in pages
        ]
        back = re.search(r'name="back" value="([^"]+)"', pages[1])
        assert back is not None
        cancelled = client.post(
            re.findall(r'action="(/inputs/[^"]+/cancel)"', pages[1])[0],
            data={"csrf": csrf_of(pages[1]), "back": back.group(1).replace("&amp;", "&")},
        )
        assert cancelled.status_code == 303
        again = client.get(cancelled.headers["location"]).text
    assert seqs == [list(range(1, 51)), list(range(51, 101)), list(range(101, 121))]
    assert re.findall(r'<tr data-input="[^"]+"><td>(\d+)</td>', again)[0] == "52"
    assert "50 of 119 pending inputs shown" in again


def test_a_pause_time_another_tool_wrote_as_a_real_still_reads_as_paused(
    db_path: Location, tmp_path: Path
) -> None:
    """A session whose `time_paused` another tool wrote as 12.5 is paused (the store reads
    any pause time so); the listing shows that time as null, malformed, and the console
    must still say "paused" and offer resume, not pause (it read the time, not the flag)."""
    store = db_path
    seed_ids(store, "held")
    Raw(store).write("UPDATE session SET time_paused = 12.5 WHERE id = 'held'")
    with (
        console_on(store, tmp_path) as (url, _),
        httpx.Client(base_url=url, timeout=DEADLINE) as client,
    ):
        page = client.get("/sessions/held").text
    assert "paused, " in page
    assert 'action="/sessions/held/resume"' in page
    assert 'action="/sessions/held/pause"' not in page


@BOTH
def test_the_consoles_cancel_of_an_input_a_drain_already_took_says_nothing_was_cancelled(
    db_path: Location, tmp_path: Path
) -> None:
    """An operator presses "cancel" on a pending input a moment after a drain took it (the
    page is from before): `cancel_input` withdraws nothing, yet the console answered 303
    back to the page as if it had cancelled it, where the CLI's `inputs cancel` says "not
    pending" and the console's interrupt answers 409. Found by an audit. It is a 409 that
    says so; the drain's user message stays."""

    async def take_one() -> None:
        async def takes(ctx: trio_sessions.DrainContext) -> None:
            await ctx.take_inputs()

        async with trio_sessions.open_runtime(store_of(db_path), takes) as runtime:
            await runtime.submit("s", {"text": "hello"}, input_id="in-1")
            await runtime.wait_idle("s")

    trio.run(take_one)
    with (
        console_on(db_path, tmp_path) as (url, _),
        httpx.Client(base_url=url, timeout=DEADLINE) as client,
    ):
        page = client.get("/sessions/s")
        assert page.status_code == 200
        answer = client.post("/inputs/in-1/cancel", data={"csrf": csrf_of(page.text)})
    assert answer.status_code == 409, (answer.status_code, answer.headers.get("location"))
    assert "nothing was cancelled" in answer.text and "in-1" in answer.text
    assert Raw(db_path).one("SELECT COUNT(*) FROM session_message WHERE input_id = 'in-1'") == (1,)


@BOTH
def test_a_delete_of_an_unknown_session_says_there_is_none(
    db_path: Location, tmp_path: Path
) -> None:
    """The console's delete of a session that is not there (deleted meanwhile from another
    page, or by the CLI) redirected to the list as if it had deleted it, where the CLI's
    `delete` exits 1 "no session". It is a 404 that says so, creating nothing; a delete of
    one that exists still erases it and goes back to the list."""
    seed_ids(db_path, "here")
    with (
        console_on(db_path, tmp_path) as (url, _),
        httpx.Client(base_url=url, timeout=DEADLINE) as client,
    ):
        csrf = csrf_of(client.get("/sessions/here").text)
        missing = client.post("/sessions/gone/delete", data={"csrf": csrf})
        deleted = client.post("/sessions/here/delete", data={"csrf": csrf})
    assert missing.status_code == 404, (missing.status_code, missing.headers.get("location"))
    assert "nothing was deleted" in missing.text and "gone" in missing.text
    assert (deleted.status_code, deleted.headers["location"]) == (303, "/")
    assert Raw(db_path).rows("SELECT id FROM session") == []


@BOTH
def test_a_pause_from_a_page_of_a_deleted_session_brings_nothing_back(
    db_path: Location, tmp_path: Path
) -> None:
    """A session page left open while the session is deleted (from another page, the CLI,
    a user's erasure) still shows its pause button; pressing it made the session again
    (`pause` creates an unknown session, paused): an erased conversation back in the list,
    empty and paused, with nothing saying why. It is a 404 that says so, creating nothing,
    as the delete and the interrupt of such a page say nothing was done; a pause of one
    that exists still pauses it. Found by an audit of the console over real HTTP."""
    seed_ids(db_path, "here", "gone")
    with (
        console_on(db_path, tmp_path) as (url, _),
        httpx.Client(base_url=url, timeout=DEADLINE) as client,
    ):
        csrf = csrf_of(client.get("/sessions/gone").text)
        assert client.post("/sessions/gone/delete", data={"csrf": csrf}).status_code == 303
        stale = client.post("/sessions/gone/pause", data={"csrf": csrf})
        paused = client.post("/sessions/here/pause", data={"csrf": csrf})
    assert stale.status_code == 404, (stale.status_code, stale.headers.get("location"))
    assert "nothing was paused" in stale.text and "gone" in stale.text
    assert (paused.status_code, paused.headers["location"]) == (303, "/sessions/here")
    assert Raw(db_path).rows("SELECT id, time_paused IS NOT NULL FROM session") == [("here", True)]


@pytest.mark.parametrize("backend", ["postgres"], indirect=True)
def test_the_console_reads_the_schema_from_the_environment(
    db_path: PgLocation, tmp_path: Path
) -> None:
    """README "Several hosts": `TRIO_SESSIONS_SCHEMA` is read by "both kinds of process";
    the console took its schema from `--schema` only and refused the store at `public`.
    It reads the variable too (`--schema` wins over it), as the worker and the CLI do."""
    seed_ids(db_path, "here")
    with (
        console(db_path.url, tmp_path, TRIO_SESSIONS_SCHEMA=db_path.schema) as (url, _),
        httpx.Client(base_url=url, timeout=DEADLINE) as client,
    ):
        assert session_ids(client.get("/").text) == ["here"]


async def test_a_page_emptied_by_a_rewrite_follows_its_new_messages_after_a_reconnect() -> None:
    """A page shows seqs 10 to 12 (its URL: `from=10`). The transcript is emptied (an edit
    of its first message, a delete) and a new conversation starts: the feed drops
    everything and shows the new messages 1 and 2 (it lowers its `shown_from`), 2 an open
    answer. The EventSource reconnects (a network
    blip, a console restart) with the same URL and Last-Event-ID: the new feed took its
    first seq from the URL again (10), so the answer's appends to message 2 were "not on
    the page" - nothing was sent, and the page showed the answer's first word, open,
    forever. Found by following console pages over real HTTP while a chat service edited
    its conversations."""
    page = Position(12, message_tag("m12"))
    shown = Shown({10: "m10", 11: "m11", 12: "m12"}, [])
    answer = _assistant(2, "You", finished=False, version=0)
    reads = [StreamChanges([], rewritten=True), StreamChanges([_user(1), answer])]

    async def read_on(job: Any, session_id: str, position: Position) -> StreamChanges:
        if len(reads) == 2:
            stream.mark_dirty()  # the new conversation is stored meanwhile: read again
        return reads.pop(0) if reads else StreamChanges([])

    stream = EventStream("s", page, read_on)
    text = await _sent_to_page(stream, shown, page, shown_from=10)
    assert '"drop_after": 0' in text and '"seq": 2' in text  # the page shows 1 and 2 now
    last_event_id = re.findall(r"^id: (\S+)$", text, re.MULTILINE)[-1]
    at = decode_cursor("s", last_event_id)
    assert at.top == 2 and [held.seq for held in at.open] == [2]
    appended = iter([StreamChanges([Appended(2, "m2", " said", 1)], ids={2: "m2"})])

    async def read(job: Any, session_id: str, position: Position) -> StreamChanges:
        return next(appended, StreamChanges([]))

    text = await _sent_to_page(
        EventStream("s", at, read), Shown({1: "m1", 2: "m2"}, [answer]), page, 10, last_event_id
    )
    assert '{"seq": 2, "append": " said"}' in text, f"the reconnected page was sent {text!r}"


async def test_an_idle_event_stream_sends_a_keep_alive_comment(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A page's event stream with nothing to send writes an SSE comment every `keep_alive`
    seconds after its last write (15 by default), as the chat example's does: it was silent
    while idle, so a proxy cut it (nginx: after 60 s) and a browser gone without closing
    held it - its task, its stream's reads - until the session next changed. Found by an
    audit, after the chat example got its keep-alive."""
    tag = message_tag("m1")
    changes: list[StreamChanges] = []

    async def read(job: Any, session_id: str, position: Position) -> StreamChanges:
        return changes.pop() if changes else StreamChanges([])

    answer = _assistant(1, "some", finished=False, version=0)
    position = Position(1, tag, (Held(1, tag, 0),))
    stream = EventStream("s", position, read)
    console = Console(_Runtime(stream, Shown({1: "m1"}, [answer])), "", Guard(None, False))  # type: ignore[arg-type]
    sent: list[tuple[float, bytes]] = []

    async def send(message: Any) -> None:
        sent.append((trio.current_time(), message.get("body", b"")))

    async def receive() -> Any:
        await trio.sleep_forever()  # the page stays

    query = {"cursor": encode_cursor(session_tag("s"), position), "from": "1"}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(console.events, "s", query, None, receive, send)
        await trio.sleep(5)
        changes.append(StreamChanges([Appended(1, "m1", " more", 1)], ids={1: "m1"}))
        stream.mark_dirty()  # the append: the stream's last write, at 5 s
        await trio.sleep(31)
        nursery.cancel_scope.cancel()
    assert [at for at, body in sent if b'" more"' in body] == [5]
    comments = [at for at, body in sent if body == b": keep-alive\n\n"]
    assert comments == [20, 35], f"sent {sent!r}"


def test_a_keep_alive_that_is_no_positive_time_is_refused() -> None:
    """`Console(keep_alive=0)` would write a comment after each comment, without end (a
    flood per page), and NaN never wrote one: refused, as `CHAT_KEEP_ALIVE` is."""
    for value in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="keep_alive must be"):
            Console(None, "", Guard(None, False), keep_alive=value)  # type: ignore[arg-type]


async def answered(console: Console, path: str) -> tuple[int, Any, str]:
    """The status, headers and body `console` answers `GET path` with (called as an ASGI
    app, no server)."""
    sent: list[Any] = []

    async def receive() -> Any:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Any) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "GET",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "headers": [(b"host", b"127.0.0.1")],
    }
    await console(scope, receive, send)
    body = b"".join(message.get("body", b"") for message in sent).decode()
    return sent[0]["status"], dict(sent[0]["headers"]), body


async def served_by_a_store_that_raises(message: str, path: str) -> tuple[int, Any, str]:
    """The status, headers and body a console answers `GET path` with when every store read
    raises `StoreError(message)`."""

    class Down:
        _db = property(lambda self: self)

        async def read(self, job: Any, *args: Any) -> Any:
            raise trio_sessions.StoreError(message)

    return await answered(Console(Down(), "", Guard(None, False)), path)  # type: ignore[arg-type]


async def test_a_store_that_does_not_answer_is_a_503_not_a_bad_request(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A page read while the store is down (PostgreSQL restarting, the file's disk gone)
    answered 400 "store error": a status that blames the request, which a client or a
    probe then does not retry, and which reads to an operator as a bad link. It is 503
    (the service is unavailable for now), with a Retry-After; the error is logged in one
    line (it was nowhere: an operator saw 503s and no reason)."""
    for path in ("/", "/sessions/s"):
        status, headers, body = await served_by_a_store_that_raises(
            "connection refused: password=secret", path
        )
        assert status == 503, (path, status, body)
        assert "store error" in body and "secret" not in body
        # When to come back, and why for the operator (in the log too).
        assert int(headers[b"retry-after"]) > 0, headers
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 2 and all("connection refused" in line for line in warned), warned


async def test_a_store_error_page_says_which_error() -> None:
    """The 503 page said only "store error": the operator at the console had to find the
    process's log to learn whether the server was down, a file locked or a disk full. It
    names the error now - its type and message, escaped, a password in it masked - and
    never a traceback. Found by the audit (audM55)."""
    status, _, body = await served_by_a_store_that_raises(
        "database is locked <b> password=secret", "/"
    )
    assert status == 503
    assert "StoreError: database is locked &lt;b&gt; password=***" in body, body
    assert "secret" not in body and "<b>" not in body and "Traceback" not in body


@pytest.mark.parametrize("when", ["opening", "streaming"])
async def test_a_session_pages_event_stream_outlives_a_store_that_does_not_answer(
    when: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The store down when a page's event stream opens, or while it streams: the stream
    sends an SSE `retry:` and ends, so the page's EventSource reconnects from its last
    event a few seconds later - and the reason is logged in one line. (Opening, it was a
    503, on which an EventSource fails for good: the page stopped following the session,
    saying nothing, until reloaded. Streaming, the StoreError escaped the app in an
    exception group: a traceback, and a response never ended.)"""

    class Events:
        on_settled = None
        left_out = False

        def __aiter__(self) -> Events:
            return self

        async def __anext__(self) -> Any:
            raise trio_sessions.StoreError("connection refused: password=secret")

    class Down:
        @contextlib.asynccontextmanager
        async def stream(self, session_id: str, cursor: str | None) -> AsyncIterator[Events]:
            if when == "opening":
                raise trio_sessions.StoreError("connection refused: password=secret")
            yield Events()

    console = Console(Down(), "", Guard(None, False))  # type: ignore[arg-type]
    sent: list[Any] = []

    async def receive() -> Any:
        await trio.sleep_forever()

    async def send(message: Any) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "GET",
        "path": "/sessions/s/events",
        "raw_path": b"/sessions/s/events",
        "query_string": b"",
        "headers": [(b"host", b"127.0.0.1")],
    }
    with trio.fail_after(10):
        await console(scope, receive, send)
    assert (
        sent[0]["status"] == 200 and (b"content-type", b"text/event-stream") in sent[0]["headers"]
    )
    assert b"".join(message.get("body", b"") for message in sent[1:]) == b"retry: 5000\n\n"
    assert sent[-1].get("more_body", False) is False  # ended: the EventSource reconnects
    assert [record.levelname for record in caplog.records] == ["WARNING"], caplog.records
