"""Review of resumable streams and watchers: defects found (each test fails on the code it
was written against)."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing
from helpers import runtime
from trio.testing import MockClock

import trio_sessions
from trio_sessions import AssistantData, DrainContext, TextPart


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
