"""Review S59: a rewrite (truncate) of a watched session reads what its watchers can be
offered, not the messages at or below every watcher's `after_seq` (DESIGN §6.26)."""

from __future__ import annotations

from typing import Any

import pytest
import trio
from helpers import runtime

from trio_sessions import DrainContext, _store, testing
from trio_sessions._signals import WatchHub
from trio_sessions._store.changes import NEW_PER_LOOK

MESSAGES = 300


async def test_a_truncate_below_every_watchers_after_seq_reads_no_transcript(
    store: Any, autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A watcher of a 300-message session's last two messages (`after_seq` 298): an edit
    (truncate those two, then a new message at seq 299) reaches it, and the looks read a
    message or two whole. They read all 298 left below the cut - the hub remembered none of
    them (no watcher was offered one), so the read down the transcript for the newest
    remembered message went to its start. Found by reading `_rewritten_news`."""

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

        async with rt.watch("s", after_seq=MESSAGES - 2) as updates:
            replayed = [await updates.__anext__() for _ in range(2)]
            monkeypatch.setattr(_store, "changes", counted)
            assert await rt.truncate("s", after_seq=MESSAGES - 2) == 2
            await rt.submit("s", {"n": "edited"})
            async for message in updates:
                if message.data == {"n": "edited"}:
                    break
    assert [message.seq for message in replayed] == [MESSAGES - 1, MESSAGES]
    assert message.seq == MESSAGES - 1
    assert sum(per_look) <= 2, per_look


async def test_a_watched_session_deleted_and_forked_into_reaches_its_watcher_in_bounded_looks(
    store: Any, autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A watched session is deleted and a 300-message conversation forked into its id (a
    "restart from this branch" button): every message reaches the watcher in seq order, and
    no look reads more than `NEW_PER_LOOK` of them whole. The look that found the session
    rewritten read all 300 (no remembered message left: every one new), where a fork into
    a session not yet made is read over several looks. Found by reading
    `_rewritten_news`."""
    per_look: list[int] = []
    changes = _store.changes

    def counted(tx: Any, *args: Any) -> Any:
        found = changes(tx, *args)
        per_look.append(len(found.watched.messages))
        return found

    async def drain(ctx: DrainContext) -> None:
        await ctx.take_inputs()

    async with runtime(store, drain, testing.trio_clock()) as rt:
        for index in range(MESSAGES):
            await rt.submit("source", {"n": index})
        await rt.submit("s", {"n": "first"})
        await rt.wait_idle("source")
        await rt.wait_idle("s")
        async with rt.watch("s") as updates:
            assert (await updates.__anext__()).data == {"n": "first"}
            monkeypatch.setattr(_store, "changes", counted)
            assert await rt.delete_session("s")
            await rt.fork("source", "s")
            seen = []
            async for message in updates:
                seen.append((message.seq, message.data))
                if len(seen) == MESSAGES:
                    break
    assert seen == [(index + 1, {"n": index}) for index in range(MESSAGES)]
    assert max(per_look) <= NEW_PER_LOOK, per_look


def test_a_look_reads_the_floor_of_the_watchers_there_when_it_reads() -> None:
    """A look's rewrite read stops at the watchers' lowest `after_seq` as it is when it
    reads, not when the look began: a watcher entering meanwhile (the look reads on a
    worker thread on PostgreSQL) may replay messages a truncate then removes, and the
    look must offer it what replaced them. A floor taken when the look began would leave
    that watcher's new messages below the first watcher's `after_seq` unread."""
    hub = WatchHub()
    first = hub.add("s", after_seq=298)
    hub.cover("s", (300, "m300"))
    followed = hub.followed()["s"]
    assert followed.floor() == 298
    second = hub.add("s", after_seq=0)
    assert followed.floor() == 0
    hub.remove(second)
    assert hub.followed()["s"].floor() == 298
    hub.remove(first)
