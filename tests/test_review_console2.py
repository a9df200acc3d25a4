"""Review of the console's paging and live session page (929a56d..15ed947): defects the
change introduced or left. Each test fails on 15ed947 for the reason its docstring gives."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio.testing
from console_process import DEADLINE, console
from helpers import Raw

import trio_sessions
from trio_sessions import StreamEvent
from trio_sessions._console import Console, Guard
from trio_sessions._console_html import PageFeed
from trio_sessions._store.stream import Held, Position, Shown, StreamChanges, message_tag
from trio_sessions._stream import EventStream, encode_cursor, session_tag


def seed_ids(path: Path, *session_ids: str) -> None:
    async def submit_all() -> None:
        async with trio_sessions.open_runtime(path, None) as producer:
            for session_id in session_ids:
                await producer.submit(session_id, {"text": "hello"})

    trio.run(submit_all)


def seed_messages(path: Path, session_id: str, count: int) -> None:
    """`count` finished user messages (seq 10 ...), ids m1 ...."""
    Raw(path).write(
        "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?)"
        " INSERT INTO session_message(id, session_id, role, seq, data, time_created,"
        " time_updated) SELECT 'm' || i, ?, 'user', i + 9, '{\"text\": \"message\"}', 0, 0"
        " FROM n",
        (count, session_id),
    )


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


# ---------------------------------------------------------------------------------------------
# The live page after a rewrite


@pytest.mark.slow
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
        events_url = re.search(r'data-events="([^"]+)"', page)
        assert events_url is not None
        with client.stream("GET", events_url.group(1).replace("&amp;", "&")) as stream:
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
    console = Console(_Runtime(stream, shown), "", Guard(None, False))  # type: ignore[arg-type]
    cursor = encode_cursor(session_tag("s"), Position(3, tag))
    sent: list[bytes] = []

    async def send(message: Any) -> None:
        sent.append(message.get("body", b""))

    async def receive() -> Any:
        await trio.sleep_forever()  # the page stays

    async with trio.open_nursery() as nursery:
        query = {"cursor": cursor, "from": "1"}
        nursery.start_soon(console.events, "s", query, None, receive, send)
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    assert reads == 2 and not stream.dirty  # the stream has nothing more to send
    text = b"".join(sent).decode()
    assert '"drop_after": 0' in text, f"the page was sent {text!r}"


def test_an_open_message_before_the_page_is_not_followed_after_a_rewrite() -> None:
    """A page shows seqs 10 to 19; an open assistant message at seq 3 is before it. After a
    rewrite the stream sends every message again and follows the open ones - seq 3 too.
    PageFeed holds seq 3's "message" back (not shown) without keeping a copy, so its next
    append is a change to a message it holds no copy of: a reload of the page (a "message"
    event for it would put message 3 at the bottom of the page), where the page should
    ignore a message it does not show."""
    held = Held(3, message_tag("open3"), 1)

    def cursor(top: int, top_id: str) -> str:
        return encode_cursor(session_tag("s"), Position(top, message_tag(top_id), (held,)))

    truncate = StreamEvent(encode_cursor(session_tag("s"), Position()), 0, "", "truncate", None)
    parts = {"parts": [{"type": "text", "text": "he"}], "finished": False, "error": None}
    open3 = StreamEvent(cursor(3, "open3"), 3, "assistant", "message", parts)
    resent = [
        StreamEvent(cursor(seq, f"m{seq}"), seq, "user", "message", {"text": "x"})
        for seq in range(10, 20)
    ]
    feed = PageFeed("s", 10, {seq: message_tag(f"m{seq}") for seq in range(10, 20)}, {})
    assert "drop_after" in feed.feed([truncate, open3, *resent], settled=True)
    held2 = Held(3, message_tag("open3"), 2)
    append = StreamEvent(
        encode_cursor(session_tag("s"), Position(19, message_tag("m19"), (held2,))),
        3,
        "assistant",
        "append",
        "llo",
    )
    text = feed.feed([append], settled=True)
    assert text == "", f"an append to a message the page does not show sent {text!r}"


# ---------------------------------------------------------------------------------------------
# Paging


@pytest.mark.slow
def test_the_quarantine_table_never_links_a_page_to_itself(tmp_path: Path) -> None:
    """`_page_after` says a page of ids that are not UTF-8 "may skip, it never loops". But
    it pages on after the last row's shown name (replacement characters), and 128 stored
    ids b"x\\xff" + one byte all show as "x\\ufffd\\ufffd" and all sort after it: the second
    page is the first again, and its "next" link is itself - forever."""
    store = tmp_path / "db"
    seed_ids(store, "s000")
    values = ", ".join(
        f"(CAST(X'78FF{byte:02X}' AS TEXT), 's000', 'o', 0, 'bad', 0, 0)"
        for byte in range(0x80, 0x100)
    )
    Raw(store).write(
        "INSERT INTO session_recovery(execution_id, session_id, owner_id, expires_at,"
        f" recovery_error, time_created, time_quarantined) VALUES {values}"
    )
    with (
        console(str(store), tmp_path) as (url, _),
        httpx.Client(base_url=url, timeout=DEADLINE) as client,
    ):
        links = []
        page = client.get("/").text
        for _ in range(3):
            link = re.search(r'id="quarantine-next" href="([^"]+)"', page)
            if link is None:
                break
            links.append(link.group(1))
            page = client.get(link.group(1).replace("&amp;", "&")).text
    assert len(links) == len(set(links)), f"a next link leads to the same page: {links}"
