"""A stream that starts behind reads the messages it missed in pages of about
`NEW_BYTES_PER_READ` of their data (README "Resumable event streams"; DESIGN §6.20: the
same on every backend)."""

from __future__ import annotations

from typing import Any

import pytest
import trio
from helpers import runtime

from trio_sessions import DrainContext, _store, testing

# Tool outputs of about 300 KB: four fill a read's 1 MiB of message data.
OUTPUT = "x" * 300_000
MESSAGES = 12


@pytest.mark.parametrize("backend", ["sqlite", "postgres"], indirect=True)
async def test_a_stream_behind_reads_large_messages_in_pages_of_about_a_mebibyte(
    store: Any, autojump_clock: trio.testing.MockClock
) -> None:
    """Twelve answers each holding a 300 KB tool result: a stream opened from nothing gets
    them in reads of about 1 MiB each (a few messages), not all twelve (3.6 MB) in one."""

    async def drain(ctx: DrainContext) -> None:
        await ctx.take_inputs()
        for index in range(MESSAGES):
            writer = await ctx.begin_assistant()
            await writer.start_tool(f"c{index}", "fetch", {})
            await writer.settle_tool(f"c{index}", OUTPUT)
            await writer.finish()

    async with runtime(store, drain, testing.trio_clock()) as rt:
        await rt.submit("s", {"q": 1})
        await rt.wait_idle("s")
        async with rt.stream("s") as events:
            first = [await events.__anext__(), *events.take_ready()]
            assert events.left_out  # the rest follows in the next reads
    assert first[0].seq == 1
    stored_bytes = sum(
        len(part.output)
        for event in first
        if event.role == "assistant"
        for part in event.data.parts
    )
    # At least one message, then about 1 MiB at most (as `_new_messages` pages them).
    assert stored_bytes <= _store.stream.NEW_BYTES_PER_READ + len(OUTPUT), len(first)


def test_a_postgresql_read_of_missed_messages_fetches_about_a_page_of_them(
    pg_url: str, migrated_schema: str
) -> None:
    """The server itself sends a read about a page of the messages it missed, not up to 200
    of them whatever their size for the client to cut: in seq order, every message that
    the ones before it leave room for - the first over `NEW_BYTES_PER_READ` and one more,
    which tells the client that more follow. A small question, then answers of 300 KB
    (one holding part of it as streamed text): the fifth message takes the page over
    1 MiB, the sixth is the one more."""
    import json

    from helpers import pg_raw

    with pg_raw(pg_url, migrated_schema) as conn:
        conn.execute("INSERT INTO session(id, time_created) VALUES ('s', 0)")
        conn.execute(
            "INSERT INTO session_message(id, session_id, role, seq, data, time_created,"
            " time_updated, finished) VALUES ('m1', 's', 'user', 1, '{}', 0, 0, 1)"
        )
        for seq in range(2, MESSAGES + 2):
            streamed = seq == 3  # a third of its text streamed, not yet folded in
            text = OUTPUT[: 200_000 if streamed else None]
            data = {"parts": [{"type": "text", "text": text}], "finished": not streamed}
            conn.execute(
                "INSERT INTO session_message(id, session_id, role, seq, data, time_created,"
                " time_updated, finished) VALUES (%s, 's', 'assistant', %s, %s, 0, 0, %s)",
                (f"m{seq}", seq, json.dumps(data), int(not streamed)),
            )
            if streamed:
                conn.execute(
                    "INSERT INTO session_message_delta(message_id, version, text)"
                    " VALUES (%s, 1, %s)",
                    (f"m{seq}", OUTPUT[200_000:]),
                )
        position = {"session": "s", "top": 0, "limit": 200, "named": []}
        position |= {"open_seqs": [], "open_versions": []}
        rows = conn.execute(
            "SELECT seq FROM ts_stream_changes_many(%s, NULL, false) WHERE kind = 'new'"
            " ORDER BY seq",
            (json.dumps([position]),),
        ).fetchall()
    assert [seq for (seq,) in rows] == [1, 2, 3, 4, 5, 6]
