"""A truncate of a long watched conversation costs the watchers' looks what it changed,
not the transcript (DESIGN §6.26: work per change proportional to the change)."""

from __future__ import annotations

from typing import Any

import pytest
import trio
from helpers import runtime

from trio_sessions import DrainContext, _store, testing

MESSAGES = 2_000
CUT = 10


async def test_a_truncate_of_a_long_watched_session_reads_what_it_changed(
    store: Any, autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A watcher of the last messages of a 2,000-message session: the edit (truncate the
    last ten, then a new message at a reused seq) reaches it, and the looks after the
    truncate read a few messages whole - they read the 1,980 unchanged ones below the
    watcher's `after_seq`, which the hub never remembered."""

    async def drain(ctx: DrainContext) -> None:
        await ctx.take_inputs()

    async with runtime(store, drain, testing.trio_clock()) as rt:
        for index in range(MESSAGES):
            await rt.submit("s", {"n": index})
        await rt.wait_idle("s")
        per_look: list[int] = []
        changes = _store.changes

        def counted(tx: Any, *args: Any) -> Any:
            found = changes(tx, *args)
            per_look.append(len(found.watched.messages))
            return found

        async with rt.watch("s", after_seq=MESSAGES - 2 * CUT) as updates:
            replayed = [await updates.__anext__() for _ in range(2 * CUT)]
            monkeypatch.setattr(_store, "changes", counted)
            assert await rt.truncate("s", after_seq=MESSAGES - CUT) == CUT
            await rt.submit("s", {"n": "edited"})
            async for message in updates:
                if message.data == {"n": "edited"}:
                    break
    assert [message.seq for message in replayed][-1] == MESSAGES
    assert message.seq == MESSAGES - CUT + 1
    assert sum(per_look) <= CUT, per_look
