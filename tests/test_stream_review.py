"""Review of resumable streams and watchers: defects found (each test fails on the code it
was written against)."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from helpers import runtime
from trio.testing import MockClock

import trio_sessions
from trio_sessions import AssistantData, DrainContext, TextPart
from trio_sessions._bench.load import StepMeter, library_schema

STALL_S = 0.050  # DESIGN §7: no event-loop stall above 50 ms from the library


async def _look(rt: trio_sessions.Runtime) -> None:
    """Let `rt`'s change loop look at the store once (the inline store's change loop runs
    only when kicked) and everything settle."""
    await trio.testing.wait_all_tasks_blocked()
    rt._kick.set()
    await trio.testing.wait_all_tasks_blocked()


async def _latest(watcher: Any, into: dict[int, Any]) -> None:
    async for message in watcher:
        into[message.seq] = message.data


@pytest.mark.sqlite_only  # the inline SQLite store looks at other runtimes' commits on a kick only
async def test_a_second_watcher_entering_before_a_remote_finish_is_looked_at_keeps_the_first_informed(
    store: Any, clock: Any, autojump_clock: MockClock
) -> None:
    """Two watchers of one session in a web runtime; a worker runtime finishes the reply.
    The second watcher enters after the worker's commit but before the web runtime's change
    loop looked at it: its replay reads the finished message. The first watcher must still
    get the finished message (DESIGN §5: a watcher may skip intermediate snapshots but never
    a message's latest one) - the replay must not record, for every watcher of the session,
    a version only the new watcher was offered."""
    go = trio.Event()

    async def drain(ctx: DrainContext) -> None:
        await ctx.take_inputs()
        writer = await ctx.begin_assistant()
        await writer.append_text("hello")
        await go.wait()
        await writer.append_text(" world")
        await writer.finish()

    first: dict[int, Any] = {}
    second: dict[int, Any] = {}
    async with (
        runtime(store, drain, clock) as worker,
        runtime(store, None, clock) as web,
        web.watch("s") as watcher,
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(_latest, watcher, first)
        await worker.submit("s", {"text": "q"})
        await _look(web)
        assert first[2] == AssistantData((TextPart("hello"),), False, None)
        go.set()
        await worker.wait_idle("s")
        # The web runtime has not looked at the finish yet; a second watcher enters now.
        async with web.watch("s") as late:
            nursery.start_soon(_latest, late, second)
            for _ in range(5):
                await _look(web)
            final = {m.seq: m.data for m in await web.transcript("s")}
            assert second == final
            assert first == final, "the first watcher never got the finished reply"
        nursery.cancel_scope.cancel()


def _seed_tool_heavy_transcript(db: Path, session_id: str, count: int, size: int) -> None:
    """`count` finished assistant messages, each holding one completed tool call whose
    output is about `size` bytes of structured JSON (search results, a fetched page's
    parsed rows: what an agent's transcript holds), written directly."""
    library_schema(db)
    conn = sqlite3.connect(db)
    with conn:
        conn.execute("INSERT INTO session(id, time_created) VALUES (?, 0)", (session_id,))
        for seq in range(1, count + 1):
            output = [{"title": "result", "n": n, "ok": True} for n in range(size // 40)]
            data = {
                "parts": [
                    {
                        "type": "tool",
                        "call_id": "c1",
                        "name": "search",
                        "input": {},
                        "status": "completed",
                        "output": output,
                        "error": None,
                    }
                ],
                "finished": True,
                "error": None,
            }
            conn.execute(
                "INSERT INTO session_message(id, session_id, role, seq, data, time_created,"
                " time_updated, finished) VALUES (?, ?, 'assistant', ?, ?, 0, 0, 1)",
                (f"m{seq:06d}", session_id, seq, json.dumps(data)),
            )
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()


async def test_a_stream_of_a_tool_heavy_transcript_never_stalls_the_loop(tmp_path: Path) -> None:
    """Entering `stream()` (cursor=None) on a session of 200 assistant messages with ~100 KB
    tool results each (22 MB) sends every message without one task step of the library
    above 50 ms of CPU (DESIGN §6.26, §7) - as `watch()` does on the same session (its
    replay reads at most `REPLAY_CHUNK_BYTES` per step: ~20 ms here). The stream's read is
    bounded by count only (`NEW_MESSAGES_PER_READ` = 200 messages, whatever their size)
    and runs on the event loop's thread on SQLite: one step of ~200 ms, stalling every other
    task of the process (every other chat's stream, every submit). Real time, bounded."""
    db = tmp_path / "s.db"
    count = 200
    _seed_tool_heavy_transcript(db, "big", count, 100_000)
    received = 0
    with trio.fail_after(60):
        async with trio_sessions.open_runtime(db, None, recovery_interval=3600) as rt:
            with StepMeter() as meter:
                async with rt.stream("big") as events:
                    async for _ in events:
                        received += 1
                        if received == count:
                            break
    assert received == count
    assert meter.longest_cpu < STALL_S, meter.longest_cpu
