"""`testing.crash` while a store call of a verb or a background path is in flight: its reply,
answered after the crash, makes the crashed runtime write nothing more, start nothing, keep
no entry, and its caller gets an answer (a verb: `StoreError`, as a crashed runtime's verbs
raise) - never trio's "Nursery is closed to new arrivals" or a wait for ever."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from helpers import LateReply, Raw, Recorder, WrappedStore, now_ms, runtime
from trio.testing import MockClock

from trio_sessions import Store, StoreError, _store, _verbs, testing
from trio_sessions._store.recovery_scan import scan_and_lease

Clock = Callable[[], float]
TABLES = ("session", "session_input", "session_execution", "session_message", "session_recovery")


def snapshot(raw: Raw) -> dict[str, list[str]]:
    """Every row of the tables a runtime writes, for a before/after comparison."""
    return {table: sorted(map(repr, raw.rows(f"SELECT * FROM {table}"))) for table in TABLES}


async def call_after_crash(
    rt: Any, raw: Raw, held: ArmedReply, call: Callable[[], Any]
) -> list[BaseException]:
    """Start `call`, crash the runtime once `held`'s operation committed, then answer it:
    what the call raised (it must end), once the rows are checked as the crash left them."""
    raised: list[BaseException] = []
    held.armed = True
    async with trio.open_nursery() as nursery:

        async def calling() -> None:
            try:
                await call()
            except Exception as exc:
                raised.append(exc)

        nursery.start_soon(calling)
        await held.committed.wait()
        testing.crash(rt)
        await trio.testing.wait_all_tasks_blocked()
        left = snapshot(raw)
        held.answer.set()
    await trio.testing.wait_all_tasks_blocked()
    assert snapshot(raw) == left  # the crashed runtime wrote nothing more
    assert not rt.active_sessions()
    return raised


class ArmedReply(LateReply):
    """`LateReply` holding its operation's reply only once the test armed it (the runtime's
    opening runs the same operations: a recovery pass)."""

    armed = False

    async def run(self, op: Any, *args: Any) -> Any:
        if not self.armed:
            return await self._inner.run(op, *args)
        self.armed = False
        return await super().run(op, *args)


def holding(store: Store, op: Any) -> WrappedStore[ArmedReply]:
    return WrappedStore(store, lambda executor: ArmedReply(executor, op, shield=True))


QUIET = {"recovery_interval": 10_000.0}


async def test_a_purge_batch_answered_after_a_crash_deletes_no_further_batch(
    store: Store,
    clock: Clock,
    db_path: Path,
    autojump_clock: MockClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`purge` runs in batches: one answered after `testing.crash` sends no further batch
    (the crashed runtime deletes nothing more) and the call raises `StoreError`, as a
    crashed runtime's verbs do - not a purge that goes on deleting sessions for a dead
    owner."""
    monkeypatch.setattr(_verbs, "PURGE_BATCH", 1)
    raw = Raw(db_path)
    held = holding(store, _store.purge_batch)
    async with runtime(held, Recorder(), clock, **QUIET) as rt:
        assert held.executor is not None
        for name in ("a", "b", "c"):
            await rt.submit(name, {"n": 1})
            await rt.wait_idle(name)
        await trio.sleep(100)
        raised = await call_after_crash(rt, raw, held.executor, lambda: rt.purge(idle_for=50))
        assert [type(exc) for exc in raised] == [StoreError]
        assert "crashed" in str(raised[0])
    names = [row[0] for row in raw.rows("SELECT id FROM session ORDER BY id")]
    assert names == ["b", "c"]  # the batch answered late, and no other


async def test_a_recovery_scan_answered_after_a_crash_promotes_and_takes_over_nothing(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """`recover_once()` whose scan is answered after `testing.crash`: the pass goes no
    further - no scheduled input found due is promoted, no claim it leased is taken over -
    and the call raises `StoreError`, as a crashed runtime's verbs do (and as the same
    pass does when the crash comes in its `before_recovery_apply` seam), not a report of a
    pass the dead runtime never made."""
    raw = Raw(db_path)
    held = holding(store, scan_and_lease)
    drain = Recorder()
    async with runtime(held, drain, clock, **QUIET) as rt:
        assert held.executor is not None
        await rt.submit("later", {"n": 1}, delay=1_000)
        raw.write("UPDATE session_input SET due_at = ?", (now_ms(clock) - 1,))  # due now
        raw.seed_claim("s", "dead", expires_at=now_ms(clock) - 1_000, owner_id="other")
        raised = await call_after_crash(rt, raw, held.executor, rt.recover_once)
        assert [type(exc) for exc in raised] == [StoreError]
        assert "crashed" in str(raised[0])
        assert raw.one("SELECT due_at FROM session_input")[0] is not None  # not promoted
        assert raw.claim("s")[1] == "other"  # not taken over
    assert drain.calls == []


async def test_a_quarantine_lifted_after_a_crash_raises_and_takes_over_nothing(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """`release_quarantine(resume=True)` whose lift is answered after `testing.crash`: the
    crashed runtime takes nothing over and the call raises `StoreError` - not a normal
    return, which says the takeover was committed and its drain started here."""
    raw = Raw(db_path)
    held = holding(store, _store.lift_quarantine)
    drain = Recorder()
    async with runtime(held, drain, clock, **QUIET) as rt:
        assert held.executor is not None
        raw.seed_claim("q", "poison", expires_at=now_ms(clock) - 1)
        raw.seed_assistant("q", "poison", 1, '{"parts": [], "finished": "no"}')
        assert (await rt.recover_once()).quarantined == 1
        raised = await call_after_crash(
            rt, raw, held.executor, lambda: rt.release_quarantine("poison", resume=True)
        )
        assert [type(exc) for exc in raised] == [StoreError]
        assert "crashed" in str(raised[0])
        assert raw.claim("q")[0] == "poison"  # not taken over
    assert drain.calls == []
