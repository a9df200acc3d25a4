"""A watched session that grows by many messages at once (a fork into it, another process's
batch) reaches its watchers in bounded looks (DESIGN §6.26: work per step proportional to
a bounded change, no loop stall), as a new watcher's replay does."""

from __future__ import annotations

from typing import Any

import pytest
import trio
from helpers import runtime

from trio_sessions import DrainContext, _store, testing
from trio_sessions._store.changes import REPLAY_CHUNK

MESSAGES = 250


async def test_a_fork_into_a_watched_session_reaches_its_watcher_in_bounded_looks(
    store: Any, autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """250 messages forked into a session a watcher follows: every one reaches the watcher
    in seq order, and no change look reads more than `REPLAY_CHUNK` of them at once (it
    read all 250 - 20,000 stalled the event loop 130 ms on SQLite)."""
    per_look: list[int] = []
    changes = _store.changes

    def counted(tx: Any, *args: Any) -> Any:
        found = changes(tx, *args)
        per_look.append(len(found.watched.messages))
        return found

    monkeypatch.setattr(_store, "changes", counted)

    async def drain(ctx: DrainContext) -> None:
        await ctx.take_inputs()

    async with runtime(store, drain, testing.trio_clock()) as rt:
        for index in range(MESSAGES):
            await rt.submit("source", {"n": index})
        await rt.wait_idle("source")
        seen: list[int] = []
        async with rt.watch("fork") as updates:
            await rt.fork("source", "fork")
            async for message in updates:
                seen.append(message.seq)
                if len(seen) == MESSAGES:
                    break
    assert seen == list(range(1, MESSAGES + 1))
    assert max(per_look) <= REPLAY_CHUNK, per_look
