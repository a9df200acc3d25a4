"""Review of the operator console: what it costs per page, how its logins and links behave
as an operator uses them, and how it fails to start. Real processes on a real store, over
real HTTP (as tests/test_console.py); every wait bounded."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from backends import Location, PgLocation
from console_process import DEADLINE, Process, console, environment
from helpers import Raw

import trio_sessions

pytestmark = pytest.mark.slow

TOKEN = "console-test-token-0123456789"
BOTH = pytest.mark.parametrize("backend", ["sqlite", "postgres"], indirect=True)


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


def seed(path: Location, *session_ids: str) -> None:
    async def submit_all() -> None:
        async with trio_sessions.open_runtime(store_of(path), None) as producer:
            for session_id in session_ids:
                await producer.submit(session_id, {"text": "hello"})

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
    seed(store, "s000")
    Raw(store).write(
        "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 1000)"
        " INSERT INTO session_recovery(execution_id, session_id, owner_id, expires_at,"
        " recovery_error, time_created, time_quarantined)"
        " SELECT 'e' || i, 's' || i, 'o', 0, 'bad', 0, i FROM n"
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
    seed(store, "big")
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
    seed(store, "big")
    seed_messages(store, "big", 100)
    with (
        console_on(store, tmp_path) as (url, _),
        httpx.Client(base_url=url, timeout=DEADLINE) as client,
    ):
        page = client.get("/sessions/big").text
        assert page.count('<div class="message ') == 100
        events = re.search(r'data-events="([^"]+)"', page)
        assert events is not None
        with client.stream("GET", events.group(1).replace("&amp;", "&")) as stream:
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
    seed(first_store, "a1")
    seed(second_store, "b1")
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
    seed(store, "s000")
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
    assert completed.returncode != 0
    assert "Traceback" not in completed.stderr, completed.stderr[-600:]
    assert f"127.0.0.1:{port}" in completed.stderr


@BOTH
def test_a_session_named_by_dot_segments_can_be_opened_and_acted_on(
    db_path: Location, tmp_path: Path
) -> None:
    """Session ids the runtime accepts ("..", "."), linked as `/sessions/..` and acted on by
    a form posting to `/sessions/../pause`: every client resolves those (RFC 3986 §5.2.4;
    browsers also for "%2E") to `/` and `/pause`. The session's page cannot be opened (the
    link shows the list, or 404) and its buttons answer 404 "no such action"."""
    store = db_path
    seed(store, "..", ".")
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
    seed(store, "s000")
    Raw(store).write("INSERT INTO session(id, time_created) VALUES (?, 0)", ("tab\tid",))
    with (
        console_on(store, tmp_path) as (url, _),
        httpx.Client(base_url=url, timeout=DEADLINE) as client,
    ):
        listing = client.get("/").text
        links = re.findall(r'<td><a href="(/sessions/[^"]+)">', listing)
        assert "/sessions/s000" in links
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
    seed(store, "s000", "s001")
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
    """The sessions and quarantine tables offer no action on a row whose id is not UTF-8
    (an action by the shown name would miss, or hit another row), but a session page's
    pending inputs do: the cancel button posts the replaced id, `cancel_input` finds no
    such input, and the console answers 303 as if it had been cancelled - the input stays."""
    store = tmp_path / "db"
    seed(store, "s000")
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
        csrf = re.search(r'name="csrf" value="([0-9a-f]+)"', page)
        assert csrf is not None
        for action in buttons:
            answer = client.post(action, data={"csrf": csrf.group(1), "back": "/"})
            assert answer.status_code == 303
    left = Raw(store).one("SELECT COUNT(*) FROM session_input WHERE id = CAST(X'69FF' AS TEXT)")
    assert not buttons or left == (0,), f"{buttons} answered 303 and cancelled nothing"
