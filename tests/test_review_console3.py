"""Review tests (51dc1d7, 9484950, 30b3c66): the console's live page after a rewrite, and
its tables' paging on stored bytes. Each fails on the reviewed code for the reason its
docstring gives."""

from __future__ import annotations

import contextlib
import re
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio.testing
from console_process import DEADLINE, console

import trio_sessions
from trio_sessions import StreamEvent
from trio_sessions._console import PAGE_SIZE, Console, Guard
from trio_sessions._console_html import PageFeed
from trio_sessions._model import AssistantData, Message, TextPart
from trio_sessions._store.stream import Held, Position, Shown, StreamChanges, Whole, message_tag
from trio_sessions._stream import EventStream, encode_cursor, session_tag

pytestmark = pytest.mark.slow


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

    stream = EventStream("s", position, read)
    console = Console(_Runtime(stream, shown), "", Guard(None, False))  # type: ignore[arg-type]
    sent: list[bytes] = []

    async def send(message: Any) -> None:
        sent.append(message.get("body", b""))

    async def receive() -> Any:
        await trio.sleep_forever()  # the page stays

    async with trio.open_nursery() as nursery:
        query = {"cursor": encode_cursor(session_tag("s"), position), "from": str(shown_from)}
        nursery.start_soon(console.events, "s", query, None, receive, send)
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


def test_messages_after_a_rewrite_that_emptied_the_page_are_shown() -> None:
    """A page shows seqs 10 to 19 (1 to 9 on its earlier page). The transcript is emptied
    (`delete_session`, or `truncate(after_seq=0)`): the page is told to drop everything
    (`drop_after` 0, no earlier message remains, so no reload) and shows nothing. The
    conversation goes on: new messages 1, 2, ... - all below the page's first seq
    (`shown_from` stays 10), which `PageFeed` now ignores as "not on the page". The page
    stays empty while the transcript grows, until seq 10, then shows 10 on without 1 to
    9: a gap. (Before 51dc1d7 such a message was added to the page.) Expected: a new
    message after the page was emptied is an update (or a reload), never nothing."""
    feed = PageFeed("s", 10, {seq: message_tag(f"m{seq}") for seq in range(10, 20)}, {})
    truncate = StreamEvent(encode_cursor(session_tag("s"), Position()), 0, "", "truncate", None)
    assert '"drop_after": 0' in feed.feed([truncate], settled=True)
    new = StreamEvent(
        encode_cursor(session_tag("s"), Position(1, message_tag("new1"))),
        1,
        "user",
        "message",
        {"text": "a new conversation"},
    )
    text = feed.feed([new], settled=True)
    assert "a new conversation" in text or '"reload": true' in text, (
        f"a message stored after the page was emptied sent {text!r}"
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
