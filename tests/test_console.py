"""The operator console and the metrics endpoints over real HTTP (the browser drives the same
pages in tests/test_browser.py): who may read and act, what a page shows, what a scrape
shows. Real processes on a real store; every wait bounded."""

from __future__ import annotations

import re
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path

import httpx
import pytest
import trio
from console_process import (
    DEADLINE,
    console,
    environment,
    seed_quarantine,
    spawn,
    wait_for_line,
    worker,
)
from helpers import Raw

import trio_sessions

pytestmark = pytest.mark.slow

TOKEN = "console-test-token-0123456789"


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
    ],
    ids=["public-bind-without-token", "bad-log-level"],
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
        "INSERT INTO session_recovery(execution_id, session_id, owner_id, expires_at,"
        " recovery_error, time_created, time_quarantined)"
        " VALUES (CAST(X'6EFF' AS TEXT), 's001', 'o', 0, 'bad', 0, 0)"
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
        for back in ("/\\evil.example/", "/\t/evil.example/", "/sessions/x\nX: y", "/\x00"):
            answer = client.post("/inputs/none/cancel", data={"csrf": csrf, "back": back})
            assert (answer.status_code, answer.headers["location"]) == (303, "/"), back
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
