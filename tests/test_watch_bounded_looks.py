"""A watched session that changes a lot at once reaches its watchers in bounded looks
(DESIGN §6.26: work per change proportional to the change, no step of the event loop over
50 ms), as a new watcher's replay does: a session that grows by many messages at once (a
fork into it, another process's batch), a truncate of a long watched conversation, a
session deleted and forked into. Each test counts the messages every change look reads
whole (`_store.changes`)."""

from __future__ import annotations

from typing import Any

import pytest
import trio
from backends import EngineDb, write_many
from helpers import runtime

from trio_sessions import DrainContext, Runtime, _store, testing
from trio_sessions._signals import WatchHub
from trio_sessions._store.changes import NEW_PER_LOOK


async def _take_only(ctx: DrainContext) -> None:
    await ctx.take_inputs()


async def _conversation(rt: Runtime, session_id: str, messages: int) -> None:
    """`messages` user messages in `session_id`, each `{"n": index}`."""
    for index in range(messages):
        await rt.submit(session_id, {"n": index})
    await rt.wait_idle(session_id)


def _count_looks(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """From now on, the number of messages each change look reads whole."""
    per_look: list[int] = []
    changes = _store.changes

    def counted(tx: Any, *args: Any) -> Any:
        found = changes(tx, *args)
        per_look.append(len(found.watched.messages))
        return found

    monkeypatch.setattr(_store, "changes", counted)
    return per_look


async def test_a_fork_into_a_watched_session_reaches_its_watcher_in_bounded_looks(
    store: Any, autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """250 messages forked into a session a watcher follows: every one reaches the watcher
    in seq order, and no change look reads more than `NEW_PER_LOOK` of them at once (it
    read all 250 - 20,000 stalled the event loop 130 ms on SQLite)."""
    messages = 250
    per_look = _count_looks(monkeypatch)
    async with runtime(store, _take_only, testing.trio_clock()) as rt:
        await _conversation(rt, "source", messages)
        seen: list[int] = []
        async with rt.watch("fork") as updates:
            await rt.fork("source", "fork")
            async for message in updates:
                seen.append(message.seq)
                if len(seen) == messages:
                    break
    assert seen == list(range(1, messages + 1))
    assert max(per_look) <= NEW_PER_LOOK, per_look


@pytest.mark.parametrize(
    ("messages", "cut", "watched"),
    [
        # A watcher of the last 20 of 2,000 messages, the last ten truncated: the looks read
        # the 1,980 unchanged ones below its `after_seq`, which the hub never remembered.
        (2_000, 10, 20),
        # A watcher of the last two of 300, both truncated: the hub remembers none below the
        # cut, and the read down the transcript for the newest remembered message went to
        # its start (298 read whole; found by reading `_rewritten_news`).
        (300, 2, 2),
    ],
)
async def test_a_truncate_of_a_long_watched_session_reads_what_it_changed(
    store: Any,
    autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
    messages: int,
    cut: int,
    watched: int,
) -> None:
    """A watcher of a long session's last messages: an edit (truncate the last `cut`, then
    a new message at a reused seq) reaches it, and the looks after the truncate read no
    more messages whole than the edit changed."""
    async with runtime(store, _take_only, testing.trio_clock()) as rt:
        await _conversation(rt, "s", messages)
        async with rt.watch("s", after_seq=messages - watched) as updates:
            replayed = [await updates.__anext__() for _ in range(watched)]
            per_look = _count_looks(monkeypatch)
            assert await rt.truncate("s", after_seq=messages - cut) == cut
            await rt.submit("s", {"n": "edited"})
            async for message in updates:
                if message.data == {"n": "edited"}:
                    break
    assert [message.seq for message in replayed] == list(
        range(messages - watched + 1, messages + 1)
    )
    assert message.seq == messages - cut + 1
    assert sum(per_look) <= cut, per_look


async def test_a_watched_session_deleted_and_forked_into_reaches_its_watcher_in_bounded_looks(
    store: Any, autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A watched session is deleted and a 300-message conversation forked into its id (a
    "restart from this branch" button): every message reaches the watcher in seq order, and
    no look reads more than `NEW_PER_LOOK` of them whole. The look that found the session
    rewritten read all 300 (no remembered message left: every one new), where a fork into
    a session not yet made is read over several looks. Found by reading
    `_rewritten_news`."""
    messages = 300
    async with runtime(store, _take_only, testing.trio_clock()) as rt:
        await _conversation(rt, "source", messages)
        await rt.submit("s", {"n": "first"})
        await rt.wait_idle("s")
        async with rt.watch("s") as updates:
            assert (await updates.__anext__()).data == {"n": "first"}
            per_look = _count_looks(monkeypatch)
            assert await rt.delete_session("s")
            await rt.fork("source", "s")
            seen = []
            async for message in updates:
                seen.append((message.seq, message.data))
                if len(seen) == messages:
                    break
    assert seen == [(index + 1, {"n": index}) for index in range(messages)]
    assert max(per_look) <= NEW_PER_LOOK, per_look


def _grow(engine: EngineDb, session_id: str, first_seq: int, count: int) -> None:
    """`count` finished user messages in `session_id` from `first_seq` on, written directly
    (another process's writes: only a change look offers them to this runtime's watchers)."""
    write_many(
        engine.location,
        "INSERT INTO session_message(id, session_id, role, seq, data, time_created,"
        " time_updated, finished) VALUES (?, ?, 'user', ?, ?, 0, 0, 1)",
        (
            (f"{session_id}-{seq}", session_id, seq, f'{{"text": "{seq}"}}')
            for seq in range(first_seq, first_seq + count)
        ),
    )


def test_a_session_gaining_a_looks_worth_before_every_look_never_starves_the_others(
    engine: EngineDb,
) -> None:
    """Two watched sessions: "busy" gains more than `NEW_PER_LOOK` messages before every
    look, "quiet" one message before the first. The quiet one's message is offered by the
    second look at the latest. The looks visited the sessions in the hub's order and cut
    the rest once one look's worth was read: "busy", watched first, filled every look and
    "quiet" waited as long as "busy" kept growing (found by reading `_session_news`)."""
    for session_id in ("busy", "quiet"):
        engine.write("INSERT INTO session(id, time_created) VALUES (?, 0)", (session_id,))
    hub = WatchHub()
    for session_id in ("busy", "quiet"):
        hub.add(session_id, after_seq=0)
        hub.cover(session_id, (0, None))
    _grow(engine, "quiet", 1, 1)
    offered: list[list[str]] = []  # per look, the sessions whose messages it offered
    for look in range(4):
        _grow(engine, "busy", look * (NEW_PER_LOOK + 1) + 1, NEW_PER_LOOK + 1)
        found = engine.engine.read(_store.changes, "owner", [], [], 0, hub.followed())
        hub.apply(found.watched)
        assert len(found.watched.messages) <= NEW_PER_LOOK
        assert "busy" in found.watched.behind  # it gained more than a look reads
        offered.append(sorted({snapshot.session_id for snapshot in found.watched.messages}))
    assert any("quiet" in sessions for sessions in offered[:2]), offered
    assert sum("quiet" in sessions for sessions in offered) == 1, offered
    assert hub.followed()["quiet"].high_seq == 1


def test_a_rewritten_session_is_not_starved_by_one_gaining_a_looks_worth_before_every_look(
    engine: EngineDb,
) -> None:
    """As above, for a session whose covered message is gone (an edit: truncated, a new
    message at its seq), whose news `_rewritten_news` reads: "busy", watched first, fills
    every look, and the edited session's new message is offered by the second look at the
    latest - crowded out of the first, the next look visits it first."""
    for session_id in ("busy", "edited"):
        engine.write("INSERT INTO session(id, time_created) VALUES (?, 0)", (session_id,))
    _grow(engine, "edited", 1, 1)
    hub = WatchHub()
    for session_id in ("busy", "edited"):
        hub.add(session_id, after_seq=0)
    hub.cover("busy", (0, None))
    hub.cover("edited", (1, "edited-1"))
    engine.write("DELETE FROM session_message WHERE id = 'edited-1'")
    engine.write(
        "INSERT INTO session_message(id, session_id, role, seq, data, time_created,"
        " time_updated, finished) VALUES ('edited-new', 'edited', 'user', 1, '{}', 0, 0, 1)"
    )
    offered: list[list[str]] = []  # per look, the messages of "edited" it offered
    for look in range(4):
        _grow(engine, "busy", look * (NEW_PER_LOOK + 1) + 1, NEW_PER_LOOK + 1)
        found = engine.engine.read(_store.changes, "owner", [], [], 0, hub.followed())
        hub.apply(found.watched)
        assert len(found.watched.messages) <= NEW_PER_LOOK
        offered.append([s.message_id for s in found.watched.messages if s.session_id == "edited"])
    assert ["edited-new"] in offered[:2], offered
    assert [m for look in offered for m in look] == ["edited-new"], offered


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
