"""The runtime: coordinator scenarios, claim handoff, heartbeat, interrupt, drain loop.

Deterministic: inline store, autojump virtual clock, gates and seams. Scenario titles follow
the reference coordinator suite (reference-design.md §6.1), adapted to our semantics.
"""

from __future__ import annotations

import inspect
import sqlite3
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from helpers import (
    ExecutorSeam,
    JumpingClock,
    LateReply,
    LooksHeld,
    Raw,
    Recorder,
    WrappedStore,
    now_ms,
    runtime,
    start_run,
)
from trio.testing import MockClock

import trio_sessions
from trio_sessions import (
    Claim,
    DrainContext,
    LeaseLost,
    Outcome,
    Runtime,
    Store,
    StoreError,
    _store,
    testing,
)

Clock = Callable[[], float]


async def test_joins_concurrent_runs_for_one_session(
    store: Store, clock: Clock, autojump_clock: MockClock
) -> None:
    """Two concurrent runs of one session share one drain and one outcome."""
    drain = Recorder()
    gate = drain.hold()
    outcomes: list[Outcome] = []
    async with runtime(store, drain, clock) as rt, trio.open_nursery() as nursery:

        async def run() -> None:
            outcomes.append(await rt.run("s"))

        nursery.start_soon(run)
        nursery.start_soon(run)
        await drain.entered.wait()
        gate.set()
    assert outcomes == [Outcome("succeeded"), Outcome("succeeded")]
    assert len(drain.calls) == 1


async def test_wake_while_idle_starts_execution(
    store: Store, clock: Clock, autojump_clock: MockClock
) -> None:
    """A wake on an idle session starts a drain; wait_idle waits for it to finish."""
    drain = Recorder()
    async with runtime(store, drain, clock) as rt:
        await rt.wake("s")
        await rt.wait_idle("s")
        assert len(drain.calls) == 1
        assert not rt.is_active("s")


async def test_active_sessions_snapshot(
    store: Store, clock: Clock, autojump_clock: MockClock
) -> None:
    """active_sessions goes {} -> {A} -> {A,B} -> {B} -> {} as gated drains finish."""
    gates = {"A": trio.Event(), "B": trio.Event()}
    entered = {"A": trio.Event(), "B": trio.Event()}

    async def drain(ctx: DrainContext) -> None:
        entered[ctx.session_id].set()
        await gates[ctx.session_id].wait()

    async with runtime(store, drain, clock) as rt:
        assert rt.active_sessions() == frozenset()
        await rt.wake("A")
        await entered["A"].wait()
        assert rt.active_sessions() == {"A"}
        await rt.wake("B")
        await entered["B"].wait()
        assert rt.active_sessions() == {"A", "B"}
        gates["A"].set()
        await rt.wait_idle("A")
        assert rt.active_sessions() == {"B"}
        gates["B"].set()
        await rt.wait_idle("B")
        assert rt.active_sessions() == frozenset()


async def test_failure_is_an_outcome_and_releases_everything(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """A raising drain gives Outcome('failed', error) and leaves no claim and no entry."""
    boom = ValueError("boom")

    async def drain(ctx: DrainContext) -> None:
        raise boom

    async with runtime(store, drain, clock) as rt:
        outcome = await rt.run("s")
        assert outcome == Outcome("failed", error=boom)
        assert rt.active_sessions() == frozenset()
    assert Raw(db_path).claim("s") is None


async def test_closing_runtime_keeps_claims_with_expired_lease(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """Leaving open_runtime cancels drains, keeps their claims and sets expires_at=now."""
    drain = Recorder()
    drain.hold()
    async with runtime(store, drain, clock) as rt:
        await rt.wake("s")
        await drain.entered.wait()
        execution_id = drain.calls[0].execution_id
        closed_at = now_ms(clock)
    claim = Raw(db_path).claim("s")
    assert claim is not None
    assert claim[0] == execution_id and claim[2] == "running"
    assert claim[3] == closed_at


async def test_wakes_during_a_drain_coalesce(
    store: Store, clock: Clock, autojump_clock: MockClock
) -> None:
    """Three wakes during drain 1 cause exactly one more drain, not three (invariant 8)."""
    drain = Recorder()
    gate = drain.hold()
    async with runtime(store, drain, clock) as rt:
        await rt.wake("s")
        await drain.entered.wait()
        for _ in range(3):
            await rt.wake("s")
        drain.gate = None
        gate.set()
        await rt.wait_idle("s")
    assert len(drain.calls) == 2
    assert drain.calls[0].execution_id == drain.calls[1].execution_id


async def test_wake_during_follow_up_runs_again(
    store: Store, clock: Clock, autojump_clock: MockClock
) -> None:
    """A wake during drain 1 and another during drain 2 give exactly three drains."""
    gates = [trio.Event(), trio.Event(), trio.Event()]
    entered = [trio.Event(), trio.Event(), trio.Event()]
    calls = 0

    async def drain(ctx: DrainContext) -> None:
        nonlocal calls
        index = calls
        calls += 1
        entered[index].set()
        await gates[index].wait()

    async with runtime(store, drain, clock) as rt:
        await rt.wake("s")
        await entered[0].wait()
        await rt.wake("s")
        gates[0].set()
        await entered[1].wait()
        await rt.wake("s")
        gates[1].set()
        gates[2].set()
        await rt.wait_idle("s")
    assert calls == 3


async def test_interrupt_while_idle_does_nothing(
    store: Store, clock: Clock, autojump_clock: MockClock
) -> None:
    """interrupt() on an idle session returns False and the next run is unaffected."""
    async with runtime(store, Recorder(), clock) as rt:
        assert await rt.interrupt("s") is False
        assert await rt.run("s") == Outcome("succeeded")


async def test_interrupt_active_execution(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """A user interrupt cancels the drain, the caller sees interrupted(user), the claim goes."""
    drain = Recorder()
    drain.hold()
    async with runtime(store, drain, clock) as rt, trio.open_nursery() as nursery:
        outcomes = start_run(nursery, rt, "s")
        await drain.entered.wait()
        assert await rt.interrupt("s") is True
        await rt.wait_idle("s")
    assert outcomes == [Outcome("interrupted", "user")]
    assert len(drain.calls) == 1
    assert Raw(db_path).claim("s") is None


async def test_interrupt_is_acknowledged_before_cleanup_settles(
    store: Store, clock: Clock, autojump_clock: MockClock
) -> None:
    """interrupt() returns while the drain's own cleanup is still blocked; a second
    interrupt is a no-op; the single outcome is interrupted(user)."""
    cleanup_gate = trio.Event()
    entered = trio.Event()

    async def drain(ctx: DrainContext) -> None:
        try:
            entered.set()
            await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True):
                await cleanup_gate.wait()

    async with runtime(store, drain, clock) as rt, trio.open_nursery() as nursery:
        outcomes = start_run(nursery, rt, "s")
        await entered.wait()
        assert await rt.interrupt("s") is True
        await trio.testing.wait_all_tasks_blocked()
        assert rt.is_active("s") and outcomes == []
        assert await rt.interrupt("s") is False
        cleanup_gate.set()
        await rt.wait_idle("s")
    assert outcomes == [Outcome("interrupted", "user")]


async def test_wake_during_interrupt_cleanup_starts_exactly_one_successor(
    store: Store, clock: Clock, autojump_clock: MockClock
) -> None:
    """A wake recorded while an interrupt's cleanup runs survives into exactly one
    successor execution with its own claim (invariant 7)."""
    cleanup_gate = trio.Event()
    entered = trio.Event()
    executions: list[str] = []

    async def drain(ctx: DrainContext) -> None:
        executions.append(ctx.execution_id)
        if len(executions) > 1:
            return
        try:
            entered.set()
            await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True):
                await cleanup_gate.wait()

    async with runtime(store, drain, clock) as rt:
        await rt.wake("s")
        await entered.wait()
        await rt.interrupt("s")
        await rt.wake("s")
        await rt.wake("s")
        cleanup_gate.set()
        await rt.wait_idle("s")
    assert len(executions) == 2
    assert executions[0] != executions[1]


async def test_wakes_recorded_before_interrupt_survive(
    store: Store, clock: Clock, autojump_clock: MockClock
) -> None:
    """Wakes pending when the interrupt begins start exactly one successor (invariant 7)."""
    drain = Recorder()
    drain.hold()
    async with runtime(store, drain, clock) as rt:
        await rt.wake("s")
        await drain.entered.wait()
        drain.gate = None
        await rt.wake("s")
        await rt.wake("s")
        await rt.interrupt("s")
        await rt.wait_idle("s")
    assert len(drain.calls) == 2
    assert drain.calls[0].execution_id != drain.calls[1].execution_id


async def test_failure_racing_a_wake_gets_one_follow_up(
    store: Store, clock: Clock, autojump_clock: MockClock
) -> None:
    """A wake during a drain that then fails gives exactly one follow-up execution."""
    calls = 0
    entered = trio.Event()
    gate = trio.Event()

    async def drain(ctx: DrainContext) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            entered.set()
            await gate.wait()
            raise RuntimeError("first drain fails")

    async with runtime(store, drain, clock) as rt, trio.open_nursery() as nursery:
        outcomes = start_run(nursery, rt, "s")
        await entered.wait()
        await rt.wake("s")
        gate.set()
        await rt.wait_idle("s")
    assert calls == 2
    assert outcomes[0].kind == "failed"


async def test_cancelled_joiner_does_not_cancel_execution(
    store: Store, clock: Clock, autojump_clock: MockClock
) -> None:
    """Cancelling one of two joined run() calls leaves the execution running to success."""
    drain = Recorder()
    gate = drain.hold()
    async with runtime(store, drain, clock) as rt, trio.open_nursery() as nursery:
        outcomes = start_run(nursery, rt, "s")
        await drain.entered.wait()
        with trio.move_on_after(1):
            await rt.run("s")
        assert rt.is_active("s")
        gate.set()
        await rt.wait_idle("s")
    assert outcomes == [Outcome("succeeded")]
    assert len(drain.calls) == 1


async def test_different_sessions_run_concurrently(
    store: Store, clock: Clock, autojump_clock: MockClock
) -> None:
    """Two sessions' drains are inside the drain at the same time (invariant 14)."""
    inside: set[str] = set()
    both = trio.Event()

    async def drain(ctx: DrainContext) -> None:
        inside.add(ctx.session_id)
        if len(inside) == 2:
            both.set()
        await both.wait()

    async with runtime(store, drain, clock) as rt:
        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(rt.run, "a")
                nursery.start_soon(rt.run, "b")
    assert inside == {"a", "b"}


async def test_self_waking_drain_does_not_grow_the_stack(
    store: Store, clock: Clock, autojump_clock: MockClock
) -> None:
    """A drain that wakes itself three times the recursion limit completes in one claim,
    iteratively."""
    runs = 0
    # Any frame a busy period kept per iteration ends in RecursionError well before this:
    # a copy whose drain loop recursed instead of looping failed here on both backends.
    # The limit, for the test, is its own stack and 300 frames more (a drain's wake sits
    # about as deep as the test itself), not the interpreter's 1,000: three times it is some
    # 1,100 iterations, not 3,000 (a round trip each on PostgreSQL), and a recursing loop
    # still runs out within the first 300.
    recursion_limit = len(inspect.stack(0)) + 300
    limit = 3 * recursion_limit
    holder: list[trio_sessions.Runtime] = []

    async def drain(ctx: DrainContext) -> None:
        nonlocal runs
        runs += 1
        if runs < limit:
            await holder[0].wake(ctx.session_id)

    default_limit = sys.getrecursionlimit()
    sys.setrecursionlimit(recursion_limit)
    try:
        async with runtime(store, drain, clock) as rt:
            holder.append(rt)
            outcome = await rt.run("s")
    finally:
        sys.setrecursionlimit(default_limit)
    assert outcome == Outcome("succeeded")
    assert runs == limit


# --- claim handoff ------------------------------------------------------------------------


def _pausing_hook(paused: trio.Event, release: trio.Event) -> Callable[[Claim], Any]:
    async def hook(claim: Claim) -> None:
        paused.set()
        await release.wait()

    return hook


async def test_user_interrupt_at_commit_boundary_cleans_claim(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """Interrupted right after the claim commits: the drain never runs, the claim is
    deleted (invariant 6, user)."""
    drain = Recorder()
    paused, release = trio.Event(), trio.Event()
    async with runtime(store, drain, clock, acquisition_hook=_pausing_hook(paused, release)) as rt:
        async with trio.open_nursery() as nursery:
            outcomes = start_run(nursery, rt, "s")
            await paused.wait()
            assert Raw(db_path).claim("s") is not None
            assert await rt.interrupt("s") is True
            release.set()
        assert outcomes == [Outcome("interrupted", "user")]
        assert drain.calls == []
        assert Raw(db_path).claim("s") is None
        assert not rt.is_active("s")


async def test_shutdown_interrupt_at_commit_boundary_retains_claim(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """Interrupted with reason shutdown right after commit: the drain never runs, the
    claim is retained with expires_at = now (invariant 6, shutdown)."""
    drain = Recorder()
    paused, release = trio.Event(), trio.Event()
    async with runtime(store, drain, clock, acquisition_hook=_pausing_hook(paused, release)) as rt:
        await rt.wake("s")
        await paused.wait()
        execution_id = Raw(db_path).claim("s")[0]
        assert await rt.interrupt("s", reason="shutdown") is True
        release.set()
        await rt.wait_idle("s")
        assert drain.calls == []
        claim = Raw(db_path).claim("s")
        assert claim is not None and claim[0] == execution_id and claim[2] == "running"
        assert claim[3] == now_ms(clock)


async def test_runtime_closing_during_handoff_retains_claim(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """The runtime closing while a claim is in its handoff keeps the claim, lease expired."""
    drain = Recorder()
    paused = trio.Event()
    async with runtime(
        store, drain, clock, acquisition_hook=_pausing_hook(paused, trio.Event())
    ) as rt:
        await rt.wake("s")
        await paused.wait()
        closed_at = now_ms(clock)
    claim = Raw(db_path).claim("s")
    assert claim is not None and claim[3] == closed_at
    assert drain.calls == []


@pytest.mark.parametrize("when", ["while-the-claim-commits", "from-the-acquisition-hook"])
async def test_an_interrupt_as_the_claim_lands_keeps_the_drain_from_starting(
    db_path: Path, clock: Clock, autojump_clock: MockClock, when: str
) -> None:
    """Invariant 6: an interrupt that arrives while the wake's claim transaction commits,
    or that the acquisition hook sends as its last act (no checkpoint after it), is
    accepted; the claim is cleaned and the drain never starts, not even its first line."""
    drain = Recorder()
    accepted: list[bool] = []
    holder: list[trio_sessions.Runtime] = []

    async def interrupt(*_: object) -> None:
        accepted.append(await holder[0].interrupt("s"))

    trigger = _TriggerOnStatement("INSERT INTO session_execution", interrupt)
    options: dict[str, Any] = {}
    if when == "while-the-claim-commits":
        store = Store(db_path, inline=True, wrap_connection=trigger.wrap)
    else:
        store, options["acquisition_hook"] = Store(db_path, inline=True), interrupt
    async with trio.open_nursery() as nursery:
        trigger.nursery = nursery
        async with runtime(store, drain, clock, **options) as rt:
            holder.append(rt)
            await rt.wake("s")
            await rt.wait_idle("s")
    assert accepted == [True]
    assert drain.calls == []
    assert Raw(db_path).claim("s") is None


async def test_a_submit_cancelled_before_its_transaction_leaves_no_entry(
    db_path: Path, clock: Clock, autojump_clock: MockClock
) -> None:
    """Invariant 15 (registry entries are always released): a submit or wake whose caller
    is cancelled before its transaction wrote nothing, and drops the entry it registered
    for the claim - the session is not active, and the next submit drains it."""
    drain = Recorder()
    async with runtime(Store(db_path, inline=True), drain, clock) as rt:
        for call in (lambda: rt.submit("s", {"n": 1}), lambda: rt.wake("s")):
            with trio.CancelScope() as cancelled:
                cancelled.cancel()
                await call()
            assert cancelled.cancelled_caught
            left = rt.active_sessions()
            if left:
                testing.crash(rt)  # else closing waits for the leftover entry forever
            assert left == frozenset()
            assert not rt.is_active("s")
        assert Raw(db_path).one("SELECT COUNT(*) FROM session_input") == (0,)
        await rt.submit("s", {"n": 2})
        await rt.wait_idle("s")
    assert [call.session_id for call in drain.calls] == ["s"]


async def test_never_reenters_own_claim_missing_from_registry(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """A live claim row with this runtime's own owner id but no registry entry is never
    re-entered or overwritten by acquire (invariants 2 and 3)."""
    drain = Recorder()
    async with runtime(store, drain, clock) as rt:
        raw = Raw(db_path)
        raw.seed_claim("s", "orphan", expires_at=now_ms(clock) + 60_000, owner_id=rt.owner_id)
        assert await rt.run("s") == Outcome("deferred")
        assert drain.calls == []
        assert raw.claim("s")[0] == "orphan"
        assert raw.one("SELECT time_woken IS NOT NULL FROM session WHERE id='s'") == (1,)


async def test_run_defers_to_another_owner(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """run() on a session held by another owner returns deferred; the wake stays durable
    and the other owner's finish takes it (never a second owner: invariant 1)."""
    first, second = Recorder(), Recorder()
    gate = first.hold()
    async with runtime(store, first, clock) as a, runtime(store, second, clock) as b:
        await a.wake("s")
        await first.entered.wait()
        assert await b.run("s") == Outcome("deferred")
        assert second.calls == []
        first.gate = None
        gate.set()
        await a.wait_idle("s")
    assert len(first.calls) == 2  # A's finish saw B's durable wake
    assert Raw(db_path).claim("s") is None


# --- heartbeat -----------------------------------------------------------------------------


async def test_heartbeat_keeps_lease_alive(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """A drain running for ten leases keeps its claim: heartbeats renew it."""

    async def drain(ctx: DrainContext) -> None:
        await trio.sleep(100)
        assert await ctx.take_inputs() == []

    async with runtime(store, drain, clock, lease=10.0) as rt:
        assert await rt.run("s") == Outcome("succeeded")


async def test_heartbeat_never_revives_expired_lease(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """The wall clock passes the lease between ticks: the drain is cancelled with
    lease_lost and the row is left untouched (invariant 4, invariant 13)."""
    jumping = JumpingClock(clock)
    drain = Recorder()
    drain.hold()
    async with runtime(store, drain, jumping, lease=9.0) as rt, trio.open_nursery() as nursery:
        outcomes = start_run(nursery, rt, "s")
        await drain.entered.wait()
        before = Raw(db_path).claim("s")
        jumping.offset += 60.0
        await rt.wait_idle("s")
        assert outcomes == [Outcome("interrupted", "lease_lost")]
        assert Raw(db_path).claim("s") == before


async def test_one_heartbeat_transaction_per_tick(
    store: Store, clock: Clock, autojump_clock: MockClock
) -> None:
    """Fifty active drains cost one heartbeat transaction per tick."""
    gate = trio.Event()
    entered = 0

    async def drain(ctx: DrainContext) -> None:
        nonlocal entered
        entered += 1
        await gate.wait()

    async with runtime(store, drain, clock, lease=30.0) as rt:
        for index in range(50):
            await rt.wake(f"s{index}")
        await trio.testing.wait_all_tasks_blocked()
        assert entered == 50
        before = rt.statistics().heartbeat_transactions
        await trio.sleep(10.5)
        assert rt.statistics().heartbeat_transactions - before == 1
        gate.set()


async def test_remote_interrupt_through_heartbeat(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """interrupt() on a runtime that does not hold the claim writes phase='cancelling' and
    returns True; the owner's next heartbeat cancels its drain and cleans the claim."""
    drain = Recorder()
    drain.hold()
    async with runtime(store, drain, clock) as owner, runtime(store, Recorder(), clock) as other:
        async with trio.open_nursery() as nursery:
            outcomes = start_run(nursery, owner, "s")
            await drain.entered.wait()
            assert await other.interrupt("s") is True
            assert Raw(db_path).claim("s")[2] == "cancelling"
            assert await other.interrupt("s") is False
        assert outcomes == [Outcome("interrupted", "user")]
        assert Raw(db_path).claim("s") is None


# --- inputs and interrupts ------------------------------------------------------------------


async def test_interrupt_with_untaken_inputs_rearms_doorbell(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """Inputs whose doorbell the claim already took, left untaken by an interrupted drain,
    re-arm the doorbell so exactly one successor takes them (invariant 16)."""
    async with trio_sessions.open_runtime(store, None, clock=clock) as producer:
        await producer.submit("s", {"n": 1}, input_id="i1")
        await producer.submit("s", {"n": 2}, input_id="i2")
    drain = Recorder()
    drain.take_inputs = False
    drain.hold()
    async with runtime(store, drain, clock) as rt:
        await drain.entered.wait()  # the first recovery pass acquired the doorbell
        assert Raw(db_path).rows("SELECT time_woken FROM session") == [(None,)]
        drain.take_inputs = True
        drain.gate = None
        await rt.interrupt("s")
        await rt.wait_idle("s")
    assert len(drain.calls) == 2
    assert drain.taken == ["i1", "i2"]
    assert Raw(db_path).rows("SELECT id FROM session_input") == []


async def test_a_wake_taken_to_go_on_survives_an_interrupt_before_the_next_drain_call(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """A drain wakes its own session and returns; its iteration end takes that doorbell to
    go on (same claim). An interrupt accepted at any moment around that end - before it,
    while it is answered, before the next drain call, during it - leaves the wake to exactly
    one successor (invariant 7): the drain runs twice, whichever moment. Before, an
    interrupt landing after the end took the doorbell and before the next call started
    finished the claim as interrupted with the doorbell taken: the wake was gone. Found by
    an audit. Every moment from 0 to 15 schedule points after the drain returned."""
    calls: dict[str, int] = {}
    returned: dict[str, trio.Event] = {}
    opened: list[Runtime] = []

    async def drain(ctx: DrainContext) -> None:
        calls[ctx.session_id] = calls.get(ctx.session_id, 0) + 1
        if calls[ctx.session_id] == 1:
            await opened[0].wake(ctx.session_id)
            returned[ctx.session_id].set()

    async with runtime(store, drain, clock) as rt:
        opened.append(rt)
        for moment in range(16):
            session_id = f"s{moment}"
            returned[session_id] = trio.Event()
            await rt.wake(session_id)
            await returned[session_id].wait()
            for _ in range(moment):
                await trio.lowlevel.checkpoint()
            await rt.interrupt(session_id)
            await rt.wait_idle(session_id)
    assert calls == {f"s{moment}": 2 for moment in range(16)}
    assert Raw(db_path).rows("SELECT id FROM session WHERE time_woken IS NOT NULL") == []
    assert Raw(db_path).rows("SELECT id FROM session_execution") == []


class _DeletedWhileStopping(ExecutorSeam):
    """Once the first iteration end answered (`ended` set, the interrupting task let run),
    another process deletes the session right after the interrupt's cleanup marked the
    claim cancelling."""

    ended = trio.Event()

    async def run(self, op: Any, *args: Any) -> Any:
        result = await self._inner.run(op, *args)
        if op is _store.end_iteration and not self.ended.is_set():
            self.ended.set()
            for _ in range(3):
                await trio.lowlevel.cancel_shielded_checkpoint()
        if op is _store.mark_cancelling:
            await self._inner.run(_store.delete_session, args[0])
        return result


async def test_a_session_deleted_during_that_interrupts_cleanup_stays_deleted(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """The wake such a cleanup keeps (the test above) is rung with the claim fence, in its
    first step: a session another process deleted meanwhile is not made again, doorbell
    set, nor drained again (a review found a separate wake doing both)."""
    calls: list[str] = []
    opened: list[Runtime] = []
    _DeletedWhileStopping.ended = trio.Event()

    async def drain(ctx: DrainContext) -> None:
        calls.append(ctx.execution_id)
        if len(calls) == 1:
            await opened[0].wake(ctx.session_id)

    async with runtime(WrappedStore(store, _DeletedWhileStopping), drain, clock) as rt:
        opened.append(rt)
        await rt.wake("s")
        await _DeletedWhileStopping.ended.wait()
        assert await rt.interrupt("s")
        await rt.wait_idle("s")
        await trio.sleep(5)  # virtual: any successor would have run
    assert len(calls) == 1
    assert Raw(db_path).rows("SELECT id FROM session") == []


async def test_remote_interrupt_before_the_drain_took_its_inputs_strands_none(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """Marked cancelling by another runtime between the claim's commit and its drain's
    take_inputs: the drain is given nothing and returns before its owner hears of the
    interrupt; its iteration end rings for the pending input, which a successor takes
    (invariant 16; the soak once caught this input stranded: no doorbell, no claim)."""
    takes: list[list[str]] = []
    taken = trio.Event()

    async def drain(ctx: DrainContext) -> None:
        takes.append([i.id for i in await ctx.take_inputs()])
        taken.set()

    async with trio_sessions.open_runtime(store, None, clock=clock) as producer:
        await producer.submit("s", {"n": 1}, input_id="i1")
    paused, release = trio.Event(), trio.Event()
    # The owner notices the interrupt only once its drain took: on PostgreSQL the mark's
    # notification could bring a change look that stops the claim before its drain starts
    # (the successor alone takes i1; the ending under test never runs).
    wrapped = WrappedStore(store, LooksHeld)
    # The other runtime is a producer: one that drains runs an opening recovery pass, which
    # may find the doorbell before the owner's claim took it and acquire "s" too - winning
    # it (the hook never runs), or holding the interrupt as its own until its acquisition
    # finds the claim held, passing it on only after the owner's drain took i1.
    async with (
        runtime(wrapped, drain, clock, acquisition_hook=_pausing_hook(paused, release)) as owner,
        runtime(store, None, clock) as other,
    ):
        assert wrapped.executor is not None
        wrapped.executor.until = taken
        await paused.wait()
        assert await other.interrupt("s") is True
        release.set()
        await owner.wait_idle("s")
        assert Raw(db_path).rows("SELECT id FROM session_input") == []
    assert takes == [[], ["i1"]]


async def test_interrupt_held_by_a_runtime_acquiring_the_session_reaches_its_holder(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """The race the test above leaves out: the interrupting runtime drains too, and its own
    acquisition of the session (a doorbell its recovery pass or change loop found) is in
    flight, so the interrupt is accepted locally as its prospective claim's (DESIGN §4:
    True at once). Once that acquisition finds the session held, the interrupt is passed
    on to the holder - whose drain took the input meanwhile - and stops it: the input is
    taken once, nothing stays pending, and the claim is gone."""
    takes: list[list[str]] = []
    took, stopped = trio.Event(), trio.Event()

    async def drain(ctx: DrainContext) -> None:
        takes.append([i.id for i in await ctx.take_inputs()])
        took.set()
        try:
            await trio.sleep_forever()
        finally:
            stopped.set()

    async with trio_sessions.open_runtime(store, None, clock=clock) as producer:
        await producer.submit("s", {"n": 1}, input_id="i1")
    paused, release = trio.Event(), trio.Event()
    held = WrappedStore(store, _HeldAcquireExecutor)
    quiet = {"recovery_interval": 10_000.0}
    async with (
        runtime(store, drain, clock, acquisition_hook=_pausing_hook(paused, release)) as owner,
        runtime(held, Recorder(), clock, **quiet) as other,
    ):
        assert held.executor is not None
        await paused.wait()  # the owner's claim committed; its drain not started
        assert other._busy.ring("s") is not None  # as a doorbell found a moment before
        await held.executor.acquiring.wait()
        assert await other.interrupt("s") is True  # accepted as the prospective claim's
        release.set()
        await took.wait()  # the owner's drain took i1
        held.executor.proceed.set()  # the acquisition finds the session held
        await other.wait_idle("s")
        raw = Raw(db_path)
        assert raw.claim("s")[2] == "cancelling"  # passed on to the holder's claim
        await stopped.wait()  # the holder heard of it (a change signal, or its heartbeat)
        await owner.wait_idle("s")
        assert raw.rows("SELECT id FROM session_input") == []
        assert raw.claim("s") is None
    assert takes == [["i1"]]


async def test_two_runtimes_hammering_three_sessions(
    store: Store, clock: Clock, autojump_clock: MockClock
) -> None:
    """Two owners on one file: never two drains of one session at once, no input lost."""
    inside: dict[str, int] = {}
    overlap: list[str] = []
    taken: list[str] = []

    async def drain(ctx: DrainContext) -> None:
        inside[ctx.session_id] = inside.get(ctx.session_id, 0) + 1
        if inside[ctx.session_id] > 1:
            overlap.append(ctx.session_id)
        taken.extend(i.id for i in await ctx.take_inputs())
        await trio.sleep(0.01)
        inside[ctx.session_id] -= 1

    sent: list[str] = []
    async with (
        runtime(store, drain, clock, recovery_interval=0.5) as a,
        runtime(store, drain, clock, recovery_interval=0.5) as b,
    ):
        for index in range(120):
            rt = a if index % 3 else b
            input_id = f"in-{index}"
            sent.append(input_id)
            await rt.submit(f"s{index % 3}", {"n": index}, input_id=input_id)
            await trio.sleep(0.003 * (index % 5))
        for session in ("s0", "s1", "s2"):
            await a.wait_idle(session)
            await b.wait_idle(session)
    assert overlap == []
    assert sorted(taken) == sorted(sent)


async def test_cross_process_wake_before_finish_is_drained(
    store: Store, clock: Clock, autojump_clock: MockClock
) -> None:
    """Another owner's wake committed just before the holder's finish transaction makes
    the holder continue (invariant 9, one order)."""
    drain = Recorder()
    paused, release = trio.Event(), trio.Event()

    async def before_finish(session_id: str) -> None:
        if not release.is_set():
            paused.set()
            await release.wait()

    async with runtime(store, drain, clock) as a, runtime(store, Recorder(), clock) as b:
        testing.set_seams(a, before_finish=before_finish)
        await a.wake("s")
        await paused.wait()
        await b.wake("s")  # durable; B's acquire sees A's claim and defers
        release.set()
        await a.wait_idle("s")
        await b.wait_idle("s")
    assert len(drain.calls) == 2


@pytest.mark.sqlite_only  # the SQLite connection seam forces the interleaving
async def test_cross_process_wake_after_finish_is_drained(
    db_path: Path, store: Store, clock: Clock, autojump_clock: MockClock
) -> None:
    """Another owner's wake committed just after the holder's finish deleted the claim
    finds no claim and acquires itself (invariant 9, the other order)."""
    first, second = Recorder(), Recorder()
    async with runtime(store, second, clock) as other, trio.open_nursery() as nursery:
        woken = trio.Event()

        async def wake_from_other() -> None:
            await other.wake("s")
            woken.set()

        trigger = _TriggerOnStatement("DELETE FROM session_execution", wake_from_other)
        trigger.nursery = nursery
        holder_store = Store(db_path, inline=True, wrap_connection=trigger.wrap)
        async with runtime(holder_store, first, clock) as holder:
            await holder.wake("s")
            await holder.wait_idle("s")
        await woken.wait()
        await other.wait_idle("s")
    assert len(first.calls) == 1
    assert len(second.calls) == 1


class _TriggerOnStatement:
    """Connection proxy: after a statement containing `needle` runs, start `action` once
    (it runs at the executor's next checkpoint, i.e. right after that transaction)."""

    def __init__(self, needle: str, action: Callable[[], Any]) -> None:
        self.needle = needle
        self.action = action
        self.fired = False
        self.nursery: trio.Nursery | None = None

    def wrap(self, conn: sqlite3.Connection) -> Any:
        trigger = self

        class Proxy:
            @property
            def in_transaction(self) -> bool:
                return conn.in_transaction

            def execute(self, sql: str, params: Any = ()) -> sqlite3.Cursor:
                cursor = conn.execute(sql, params)
                if not trigger.fired and trigger.needle in sql and trigger.nursery is not None:
                    trigger.fired = True
                    trigger.nursery.start_soon(trigger.action)
                return cursor

            def executemany(self, sql: str, rows: Any) -> sqlite3.Cursor:
                return conn.executemany(sql, rows)

        return Proxy()


async def test_local_ring_after_finish_began_starts_one_successor(
    store: Store, db_path: Path, clock: Clock, autojump_clock: MockClock
) -> None:
    """A local wake committed after the finish transaction deleted the claim, whose ring
    reaches the still-held registry entry, is honoured by exactly one successor from the
    same entry (invariant 9, local race at the finish boundary)."""
    drain = Recorder()
    async with runtime(store, drain, clock) as rt:
        rang = False

        async def wake_at_finish_boundary(session_id: str) -> None:
            nonlocal rang
            if not rang:
                rang = True
                assert Raw(db_path).claim(session_id) is None  # the finish released it
                await rt.wake(session_id)  # durable, then rings the entry still held

        testing.set_seams(rt, after_finish=wake_at_finish_boundary)
        await rt.wake("s")
        await rt.wait_idle("s")
    assert rang
    assert len(drain.calls) == 2
    assert drain.calls[0].execution_id != drain.calls[1].execution_id
    assert Raw(db_path).rows("SELECT time_woken FROM session") == [(None,)]


async def test_body_exception_escapes_alone(
    store: Store, clock: Clock, autojump_clock: MockClock
) -> None:
    """An exception raised in the runtime block escapes as itself, not as a group."""
    with pytest.raises(KeyError):
        async with runtime(store, Recorder(), clock):
            raise KeyError("mine")


async def test_lease_lost_drain_writes_nothing(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """After the lease is lost, a drain's write raises LeaseLost and stores nothing
    (invariant 13)."""
    jumping = JumpingClock(clock)
    errors: list[BaseException] = []
    jumped = trio.Event()

    async def drain(ctx: DrainContext) -> None:
        await jumped.wait()
        try:
            with trio.CancelScope(shield=True):
                await ctx.begin_assistant()
        except LeaseLost as exc:
            errors.append(exc)
            raise

    async with runtime(store, drain, jumping, lease=9.0) as rt:
        await rt.wake("s")
        await trio.testing.wait_all_tasks_blocked()
        jumping.offset += 60.0
        jumped.set()
        await rt.wait_idle("s")
    assert len(errors) == 1
    assert Raw(db_path).rows("SELECT id FROM session_message") == []


async def test_a_drain_stopped_by_its_own_deadline_is_lease_lost_though_a_renewal_follows(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """The process stalls (a blocking call) for most of a lease: the drain's local deadline
    passes, so its next checkpoint stops it (§6.17). The heartbeat, due meanwhile, still
    renews the claim - the store's lease has not run out - and moved the deadline on: the
    drain's shielded cleanup then wrote, and the busy period ended as a *user* interrupt,
    its answer finished "interrupted" and its claim deleted, never resumed. Found by an
    audit. Once the deadline passed the lease counts as lost: the cleanup's write raises
    LeaseLost, nothing is written, and the claim is left for recovery."""
    lease = 9.0
    errors: list[BaseException] = []

    async def drain(ctx: DrainContext) -> None:
        await ctx.take_inputs()
        writer = await ctx.begin_assistant()
        autojump_clock.jump(lease * 0.95)  # the whole thread blocked: no task ran
        try:
            await trio.lowlevel.checkpoint()
        finally:
            with trio.CancelScope(shield=True):
                await trio.sleep(0.05)  # the heartbeat runs meanwhile
                try:
                    await writer.append_text("cleaning up")
                except LeaseLost as exc:
                    errors.append(exc)

    async with runtime(store, drain, clock, lease=lease) as rt:
        await rt.submit("s", {"n": 1})
        outcome = await rt.run("s")
        claim = Raw(db_path).claim("s")
        messages = await rt.transcript("s")
    assert outcome == Outcome("interrupted", "lease_lost")
    assert [type(e) for e in errors] == [LeaseLost]
    assert claim is not None  # left for recovery, which resumes the work
    assert [(m.role, m.data.finished) for m in messages if m.role == "assistant"] == [
        ("assistant", False)
    ]


async def test_a_drain_stopped_by_its_deadline_keeps_its_claim_until_it_exits(
    store: Store, clock: Clock, autojump_clock: MockClock
) -> None:
    """Stopped by its local deadline after a stall, a drain still runs its shielded
    cleanup (a side effect of 3 s here): its claim stays renewed at the store until the
    drain exits, so another runtime's recovery never starts the session's drain while this
    one still runs (§6.17, §6.21). A review found the heartbeat dropping the claim at once,
    which let the other runtime start 2.5 s before the first drain had exited."""
    lease = 9.0
    exited: list[float] = []
    started_elsewhere: list[float] = []

    async def stalls(ctx: DrainContext) -> None:
        await ctx.take_inputs()
        autojump_clock.jump(lease * 0.95)  # the whole thread blocked
        try:
            await trio.lowlevel.checkpoint()
        finally:
            with trio.CancelScope(shield=True):
                await trio.sleep(3.0)
                exited.append(trio.current_time())

    async def elsewhere(ctx: DrainContext) -> None:
        started_elsewhere.append(trio.current_time())

    async with (
        runtime(store, stalls, clock, lease=lease) as first,
        runtime(store, elsewhere, clock, lease=lease, recovery_interval=0.25),
    ):
        await first.submit("s", {"n": 1})
        await trio.sleep(40)  # virtual: the lease runs out after the drain exited
    [exit_time] = exited
    assert started_elsewhere, "recovery resumes the claim once its lease ran out"
    assert min(started_elsewhere) >= exit_time, (exit_time, started_elsewhere)


async def test_cancelling_open_runtime_while_it_opens_is_a_plain_cancellation(
    tmp_path: Path,
) -> None:
    """Cancelled while its first recovery pass waits for another connection's lock on the
    file (a worker's SIGTERM at start-up, say), `open_runtime` ends as a cancellation the
    caller's scope catches - not an ExceptionGroup of 'Nursery is closed to new arrivals'
    from starting the runtime's tasks in the task nursery the cancellation had closed,
    which made the worker exit 1 with a traceback. Found by an audit. Real time, bounded
    (the default store waits for the lock in its worker thread)."""
    path = tmp_path / "s.db"
    async with trio_sessions.open_runtime(path, Recorder()):
        pass  # the schema
    locked = threading.Event()

    def hold_the_lock() -> None:  # for 1 s, as another process's long write would
        conn = sqlite3.connect(path, isolation_level=None)
        conn.execute("BEGIN EXCLUSIVE")
        locked.set()
        time.sleep(1.0)
        conn.rollback()
        conn.close()

    holder = threading.Thread(target=hold_the_lock)
    holder.start()
    try:
        await trio.to_thread.run_sync(locked.wait, 10)
        with trio.fail_after(10), trio.move_on_after(0.3) as cancelled:
            async with trio_sessions.open_runtime(path, Recorder()):
                pytest.fail("opened although cancelled")
    finally:
        await trio.to_thread.run_sync(holder.join)
    assert cancelled.cancelled_caught


async def test_the_inline_store_counts_every_transaction_as_run_on_the_trio_thread(
    store: Store, clock: Clock, autojump_clock: MockClock
) -> None:
    """`statistics().store.inline_runs` is the store's batches run on the trio thread (the
    `_inline_runs_total` metric); the tests' inline store runs every one there, and said
    none. Found by an audit."""
    async with runtime(store, Recorder(), clock) as rt:
        await rt.submit("s", {"n": 1})
        await rt.wait_idle("s")
        figures = rt.statistics().store
    assert 0 < figures.transactions == figures.inline_runs
    assert figures.handoffs == 0


async def test_serve_runtime_with_nursery_start(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """nursery.start(serve_runtime, ...) returns an open runtime; cancelling it closes the
    runtime like leaving open_runtime (claims kept, leases expired)."""
    drain = Recorder()
    drain.hold()
    async with trio.open_nursery() as nursery:
        rt = await nursery.start(
            lambda task_status: trio_sessions.serve_runtime(
                store, drain, clock=clock, task_status=task_status
            )
        )
        await rt.wake("s")
        await drain.entered.wait()
        closed_at = now_ms(clock)
        nursery.cancel_scope.cancel()
    claim = Raw(db_path).claim("s")
    assert claim is not None and claim[3] == closed_at


# --- regressions found in review ----------------------------------------------------------


async def test_closing_during_user_interrupt_cleanup_never_resumes_it(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """The runtime closing while a user interrupt's cleanup runs does not expire that claim
    as if it were shut down: the interrupt completes, and no later owner resumes it."""
    entered = trio.Event()

    async def drain(ctx: DrainContext) -> None:
        entered.set()
        try:
            await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True):
                await trio.sleep(0.5)  # a drain that needs a moment to clean up

    async with runtime(store, drain, clock) as rt:
        await rt.wake("s")
        await entered.wait()
        assert await rt.interrupt("s") is True
    assert Raw(db_path).claim("s") is None
    later = Recorder()
    async with runtime(store, later, clock):
        pass
    assert later.calls == []


async def test_run_after_interrupt_takes_the_successor(
    store: Store, clock: Clock, autojump_clock: MockClock
) -> None:
    """run() asked for after an accepted interrupt records a wake and returns the outcome
    of the successor that takes it, not the interrupted execution's."""
    calls = 0
    entered = trio.Event()

    async def drain(ctx: DrainContext) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            entered.set()
            await trio.sleep_forever()

    async with runtime(store, drain, clock) as rt:
        await rt.wake("s")
        await entered.wait()
        assert await rt.interrupt("s") is True
        assert await rt.run("s") == Outcome("succeeded")
    assert calls == 2


async def test_outer_cancellation_resolves_joiners_as_shutdown(
    store: Store, clock: Clock, autojump_clock: MockClock
) -> None:
    """Cancelling the runtime from outside resolves every joiner with interrupted/shutdown,
    never with deferred or an earlier iteration's outcome (invariant 15)."""
    calls = 0
    entered = trio.Event()

    async def drain(ctx: DrainContext) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("first execution fails")
        entered.set()
        await trio.sleep_forever()

    outcomes: list[Outcome] = []
    async with trio.open_nursery() as joiners, trio.open_nursery() as runtimes:
        rt = await runtimes.start(
            lambda task_status: trio_sessions.serve_runtime(
                store, drain, clock=clock, task_status=task_status
            )
        )
        first = await rt.run("s")
        assert first.kind == "failed"

        async def join() -> None:
            outcomes.append(await rt.run("s"))

        joiners.start_soon(join)  # outside the scope that is cancelled
        await entered.wait()
        runtimes.cancel_scope.cancel()
    assert outcomes == [Outcome("interrupted", "shutdown")]


async def test_no_recovery_while_closing(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """While the runtime waits for a slow drain to close, recovery starts nothing: a dead
    owner's expired claim is neither resumed nor charged a resume."""
    entered = trio.Event()

    async def drain(ctx: DrainContext) -> None:
        entered.set()
        try:
            await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True):
                await trio.sleep(3)  # slow, bounded cleanup while the runtime closes

    raw = Raw(db_path)
    async with runtime(store, drain, clock, recovery_interval=0.5) as rt:
        await rt.wake("busy")
        await entered.wait()
        raw.seed_claim("dead", "dead-exec", expires_at=now_ms(clock) + 1_000)
    assert raw.claim("dead")[0] == "dead-exec"
    assert raw.one("SELECT wake_attempts FROM session WHERE id = 'dead'") == (0,)


async def test_accepted_interrupt_reaches_the_owner_found_at_acquire(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """An interrupt accepted while this runtime was still acquiring, when the acquire finds
    another owner holding the session, is passed on to that owner (phase='cancelling')."""
    raw = Raw(db_path)
    async with runtime(store, Recorder(), clock, **{"recovery_interval": 10_000.0}) as rt:
        raw.seed_claim("s", "foreign", expires_at=now_ms(clock) + 60_000, owner_id="other")
        raw.write("UPDATE session SET time_woken = 1 WHERE id = 's'")
        report = await rt.recover_once()  # a doorbell with a claim: not a candidate
        assert report.doorbells_started == 0
        raw.write("DELETE FROM session_execution WHERE id = 'foreign'")
        await rt.recover_once()  # registers a prospective acquisition for 's'
        assert rt.is_active("s")
        raw.seed_claim("s", "foreign", expires_at=now_ms(clock) + 60_000, owner_id="other")
        assert await rt.interrupt("s") is True
        await rt.wait_idle("s")
    assert raw.claim("s")[1:3] == ("other", "cancelling")


async def test_outer_cancellation_never_undoes_an_accepted_interrupt(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """A user interrupt accepted as the runtime is cancelled from outside leaves the claim
    'cancelling' (its cleanup was cut short), so the next owner finishes it as cancelled
    and never resumes the work the user stopped."""
    started = trio.Event()

    async def drain(ctx: DrainContext) -> None:
        writer = await ctx.begin_assistant()
        await writer.start_tool("c1", "slow", {})
        started.set()
        await trio.sleep_forever()

    with trio.CancelScope() as outer:
        async with runtime(store, drain, clock, lease=10.0) as rt:
            await rt.wake("s")
            await started.wait()
            outer.cancel()  # Ctrl-C, a supervisor, serve_runtime's scope...
            assert await rt.interrupt("s") is True  # ...in the same scheduling step
            await trio.sleep_forever()
    assert Raw(db_path).claim("s")[2] == "cancelling"
    later = Recorder()
    async with runtime(store, later, clock, lease=10.0) as rt:
        await trio.sleep(11)  # past the lease: recovery has examined the claim
    assert later.calls == []
    assert Raw(db_path).claim("s") is None


# ---------------------------------------------------------------------------------------------
# Issue 14: what a returned drain leaves, its stale context, waiting on itself, restarts


async def test_open_messages_are_finished_when_a_drain_returns(
    store: Store, clock: Clock, autojump_clock: MockClock
) -> None:
    """A drain that returns without finish(): its message is finished and its running tool
    failed ('interrupted') before the next coalesced iteration and after the release."""
    seen: list[list[Any]] = []

    async def drain(ctx: DrainContext) -> None:
        seen.append([(m.role, m.data) for m in await ctx.transcript()])
        if len(seen) <= 2:
            writer = await ctx.begin_assistant()
            await writer.start_tool(f"c{len(seen)}", "search", {})
        if len(seen) == 1:
            await rt.wake("s")  # one more iteration of the same claim

    async with runtime(store, drain, clock) as rt:
        assert await rt.run("s") == Outcome("succeeded")
        messages = await rt.transcript("s")
    assert len(seen) == 2
    [(role, data)] = seen[1]
    assert (role, data.finished, data.error) == ("assistant", True, "interrupted")
    for message in messages:
        assert (message.data.finished, message.data.error) == (True, "interrupted")
        [part] = message.data.parts
        assert (part.status, part.error) == ("error", "interrupted")


async def test_run_or_wait_idle_from_a_drain_on_its_own_session_raises(
    store: Store, clock: Clock, autojump_clock: MockClock
) -> None:
    """run() and wait_idle() called from a drain (or its child task) on its own session raise
    RuntimeError at once instead of waiting for themselves; other sessions still work."""
    errors: list[BaseException] = []

    async def drain(ctx: DrainContext) -> None:
        if ctx.session_id != "s":
            return
        with trio.fail_after(1):
            for call in (rt.run, rt.wait_idle):
                try:
                    await call("s")
                except RuntimeError as exc:
                    errors.append(exc)
            async with trio.open_nursery() as nursery:

                async def child() -> None:
                    try:
                        await rt.run("s")
                    except RuntimeError as exc:
                        errors.append(exc)

                nursery.start_soon(child)
            assert await rt.run("other") == Outcome("succeeded")

    async with runtime(store, drain, clock) as rt:
        assert await rt.run("s") == Outcome("succeeded")
    assert len(errors) == 3
    assert all("own session" in str(e) for e in errors)


async def test_a_context_used_after_its_drain_returned_raises_lease_lost(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """A DrainContext (and its writers) used after its drain returned raises LeaseLost for
    every call, also during the next coalesced iteration of the same claim, writing nothing."""
    stale: list[Any] = []
    errors: dict[str, BaseException] = {}

    async def drain(ctx: DrainContext) -> None:
        if not stale:
            writer = await ctx.begin_assistant()
            await writer.start_tool("c1", "search", {})
            stale.extend([ctx, writer])
            await rt.wake("s")
            return
        old_ctx, old_writer = stale
        assert old_ctx.execution_id == ctx.execution_id  # the same claim, next iteration
        calls: dict[str, Callable[[], Awaitable[object]]] = {
            "take_inputs": lambda: old_ctx.take_inputs(),
            "begin_assistant": lambda: old_ctx.begin_assistant(),
            "transcript": lambda: old_ctx.transcript(),
            "append_text": lambda: old_writer.append_text("late"),
            "start_tool": lambda: old_writer.start_tool("c2", "late", {}),
            "settle_tool": lambda: old_writer.settle_tool("c1", 1),
            "fail_tool": lambda: old_writer.fail_tool("c1", "late"),
            "finish": lambda: old_writer.finish(),
        }
        before = Raw(db_path).rows("SELECT id, seq, data FROM session_message ORDER BY seq")
        for name, call in calls.items():
            try:
                await call()
            except LeaseLost as exc:
                errors[name] = exc
        assert Raw(db_path).rows("SELECT id, seq, data FROM session_message ORDER BY seq") == (
            before
        )

    async with runtime(store, drain, clock) as rt:
        assert await rt.run("s") == Outcome("succeeded")
        with pytest.raises(LeaseLost):
            await stale[0].take_inputs()
    assert sorted(errors) == sorted(
        [
            "take_inputs",
            "begin_assistant",
            "transcript",
            "append_text",
            "start_tool",
            "settle_tool",
            "fail_tool",
            "finish",
        ]
    )


async def test_graceful_restarts_do_not_use_up_the_resume_budget(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """Rolling restarts: a claim handed back at shutdown is resumed by the next runtime every
    time, with max_resumes=1, and wake_attempts stays 0."""
    drain = Recorder()
    for restart in range(3):
        drain.hold()
        async with runtime(store, drain, clock, max_resumes=1) as rt:
            if restart == 0:
                await rt.wake("s")
            await drain.entered.wait()
            assert (drain.calls[-1].resumed, drain.calls[-1].attempt) == (restart > 0, 0)
        assert Raw(db_path).one("SELECT wake_attempts FROM session WHERE id = 's'") == (0,)
    drain.gate = None
    async with runtime(store, drain, clock, max_resumes=1) as rt:
        await rt.wait_idle("s")
    assert [c.resumed for c in drain.calls] == [False, True, True, True]
    assert Raw(db_path).claim("s") is None


_ACQUISITIONS = (_store.acquire, _store.wake_and_acquire, _store.submit_and_acquire)


class _SlowAcquireExecutor(ExecutorSeam):
    """An executor whose acquisitions (or other `ops`) answer `delay` seconds (trio time)
    after they committed."""

    def __init__(self, inner: Any, delay: float, ops: tuple[Any, ...] = _ACQUISITIONS) -> None:
        super().__init__(inner)
        self._delay = delay
        self._ops = ops

    async def run(self, op: Any, *args: Any) -> Any:
        result = await self._inner.run(op, *args)
        if op in self._ops:
            await trio.sleep(self._delay)
        return result


async def test_a_claim_past_its_local_deadline_at_commit_reaches_no_user_code(
    store: Store, clock: Clock, autojump_clock: MockClock
) -> None:
    """The claim's answer arrives after its local deadline (the process stopped between
    the commit and the reply, or the reply took longer than the lease): another runtime may
    already have taken it over, so neither the acquisition hook nor the drain runs."""
    drain = Recorder()
    hooked: list[Claim] = []

    async def hook(claim: Claim) -> None:
        hooked.append(claim)

    slow = WrappedStore(store, lambda e: _SlowAcquireExecutor(e, 31.0))  # the lease is 30 s
    async with runtime(slow, drain, clock, acquisition_hook=hook) as rt:
        await rt.wake("s")
        await rt.wait_idle("s")
    assert hooked == []
    assert drain.calls == []


async def test_a_rung_claim_answered_past_its_local_deadline_reaches_no_user_code(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """Invariant 17, the busy period's own acquisition (a doorbell found by recovery, a
    successor, a joiner): the local deadline counts from when the acquire was *sent*, so a
    claim answered 31 s into a 30 s lease runs neither hook nor drain. Timed from the reply,
    the drain would start with 27 s left locally while the store's lease had already expired
    (another runtime may be draining the session)."""
    async with trio_sessions.open_runtime(store, None, clock=clock) as producer:
        await producer.submit("s", {"n": 1}, input_id="i1")  # a doorbell, no local entry
    drain = Recorder()
    hooked: list[Claim] = []

    async def hook(claim: Claim) -> None:
        hooked.append(claim)

    slow = WrappedStore(store, lambda e: _SlowAcquireExecutor(e, 31.0))  # the lease is 30 s
    quiet = {"recovery_interval": 10_000.0}  # only the first pass, which rings the doorbell
    async with runtime(slow, drain, clock, acquisition_hook=hook, **quiet) as rt:
        await rt.wait_idle("s")
    assert hooked == []
    assert drain.calls == []
    # The acquire did commit (the claim is this runtime's, left to expire): not a pass in
    # which nothing was acquired at all.
    assert Raw(db_path).claim("s")[1] == rt.owner_id


async def test_a_takeover_answered_past_its_local_deadline_reaches_no_user_code(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """Invariant 17 for recovery: a takeover whose reply comes 31 s after it was sent (30 s
    lease) never starts the resumed drain nor its hook - its local deadline counts from the
    send. Timed from the reply, the resumed drain would run past the durable expiry."""
    raw = Raw(db_path)
    async with runtime(store, Recorder(), clock, recovery_interval=10_000.0):
        pass  # create the schema
    raw.seed_claim("s", "dead-exec", expires_at=now_ms(clock) - 1)
    drain = Recorder()
    hooked: list[Claim] = []

    async def hook(claim: Claim) -> None:
        hooked.append(claim)

    slow = WrappedStore(
        store, lambda e: _SlowAcquireExecutor(e, 31.0, (_store.apply_recovery_batch,))
    )
    async with runtime(
        slow,
        drain,
        clock,
        acquisition_hook=hook,
        recovery_interval=10_000.0,
    ) as rt:
        await rt.wait_idle("s")  # the first pass took it over while opening
        claim = raw.claim("s")
        assert claim is not None and claim[0] != "dead-exec" and claim[1] == rt.owner_id
    assert hooked == []
    assert drain.calls == []


class _LateThenUnreachableExecutor(ExecutorSeam):
    """An executor whose first heartbeat answers `delay` seconds (trio time) after it
    committed, and whose later heartbeats fail: the store became unreachable."""

    def __init__(self, inner: Any, delay: float) -> None:
        super().__init__(inner)
        self._delay = delay
        self.renewals = 0

    async def run(self, op: Any, *args: Any) -> Any:
        if op is not _store.heartbeat:
            return await self._inner.run(op, *args)
        self.renewals += 1
        if self.renewals > 1:
            raise trio_sessions.StoreError("the store is unreachable")
        result = await self._inner.run(op, *args)
        await trio.sleep(self._delay)
        return result


async def test_a_renewal_answered_late_counts_from_when_it_was_sent(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """Invariant 17: a heartbeat whose reply takes 15 s of a 30 s lease, then a store that
    cannot be reached: the drain is stopped (lease_lost) before the durable expiry that
    renewal wrote, because the renewed local deadline counts from when it was sent. Timed
    from the reply, it would run 12 s past that expiry, beside a recovering owner."""
    stopped_at: list[float] = []
    entered = trio.Event()

    async def drain(ctx: DrainContext) -> None:
        entered.set()
        try:
            await trio.sleep_forever()
        finally:
            stopped_at.append(clock())

    raw = Raw(db_path)
    slow = WrappedStore(store, lambda e: _LateThenUnreachableExecutor(e, 15.0))  # beats: 10 s
    async with runtime(slow, drain, clock) as rt, trio.open_nursery() as nursery:
        outcomes = start_run(nursery, rt, "s")
        await entered.wait()
        acquired_expiry = raw.claim("s")[3]
    assert outcomes == [Outcome("interrupted", "lease_lost")]
    renewed_expiry = raw.claim("s")[3]  # a lost lease writes nothing
    assert renewed_expiry > acquired_expiry  # the late renewal did land
    assert stopped_at and stopped_at[0] * 1000 < renewed_expiry


class _SlowFinishUnreachableExecutor(ExecutorSeam):
    """An executor whose drain-iteration ends answer `delay` seconds (trio time) after they
    committed, and whose heartbeats fail meanwhile: the store became unreachable."""

    def __init__(self, inner: Any, delay: float) -> None:
        super().__init__(inner)
        self._delay = delay

    async def run(self, op: Any, *args: Any) -> Any:
        if op is _store.heartbeat:
            raise trio_sessions.StoreError("the store is unreachable")
        result = await self._inner.run(op, *args)
        if op is _store.end_iteration:
            with trio.CancelScope(shield=True):  # taken: its caller waits for the reply
                await trio.sleep(self._delay)
        return result


async def test_an_iteration_end_answered_past_its_local_deadline_reaches_no_user_code(
    store: Store, clock: Clock, autojump_clock: MockClock
) -> None:
    """Invariant 17, the drain loop: a wake coalesced during a drain, whose iteration end
    (it took that doorbell to go on) is answered 31 s into a 30 s lease with no renewal
    meanwhile: the next drain call never starts - the store's lease has run out and another
    runtime may be draining the session already."""
    calls: list[DrainContext] = []
    entered, finish = trio.Event(), trio.Event()

    async def drain(ctx: DrainContext) -> None:
        calls.append(ctx)
        if len(calls) == 1:
            entered.set()
            await finish.wait()

    slow = WrappedStore(store, lambda e: _SlowFinishUnreachableExecutor(e, 31.0))  # lease: 30 s
    async with runtime(slow, drain, clock) as rt, trio.open_nursery() as nursery:
        outcomes = start_run(nursery, rt, "s")
        await entered.wait()
        await rt.wake("s")  # coalesced: the iteration end takes it and goes on
        finish.set()
    assert outcomes == [Outcome("interrupted", "lease_lost")]
    assert len(calls) == 1


def _held_elsewhere(raw: Raw, clock: Clock) -> None:
    """Another owner holds 's' (a live claim: its drain running)."""
    raw.seed_claim("s", "foreign", expires_at=now_ms(clock) + 60_000, owner_id="other")


def _doorbell_taken_elsewhere(raw: Raw) -> None:
    """The holder's iteration end took the doorbell of 's', to drain again."""
    raw.write("UPDATE session SET time_woken = NULL, wakes = 0 WHERE id = 's'")


async def _doorbell_unclaimed(store: Store, clock: Clock) -> None:
    """A doorbell rung on 's' by a producer, with no claim: the next runtime's first
    recovery pass finds it and acquires."""
    async with trio_sessions.open_runtime(store, None, clock=clock) as producer:
        await producer.wake("s")


def _late_wake_and_acquire(store: Store) -> WrappedStore[LateReply]:
    """The store, its `wake_and_acquire` committed at once and answered (shielded) only
    once its executor's `answer` is set."""
    return WrappedStore(
        store, lambda executor: LateReply(executor, _store.wake_and_acquire, shield=True)
    )


def _set_once_closing(nursery: trio.Nursery, rt: Runtime, event: trio.Event) -> None:
    """Set `event` once the runtime's close waits (the block it is opened by exits)."""

    async def set_once_closing() -> None:
        await trio.testing.wait_all_tasks_blocked()  # the close is waiting
        assert rt._closing
        event.set()

    nursery.start_soon(set_once_closing)


class _HeldAcquireExecutor(ExecutorSeam):
    """An executor whose next `acquire` waits, before it runs, until `proceed` is set;
    `acquiring` is set once it waits."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.acquiring = trio.Event()
        self.proceed = trio.Event()

    async def run(self, op: Any, *args: Any) -> Any:
        if op is _store.acquire and not self.proceed.is_set():
            self.acquiring.set()
            with trio.CancelScope(shield=True):  # sent: its caller waits for the reply
                await self.proceed.wait()
        return await self._inner.run(op, *args)


async def test_a_run_joining_an_acquisition_that_finds_the_session_held_records_its_wake(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """run() joins an acquisition already sent (a doorbell recovery found); another owner
    took that doorbell and holds the session by the time it commits. run() returns
    `deferred` - which promises its wake stays durable for the holder - so the wake must
    be recorded: the holder's drain may have started before run() was called."""
    raw = Raw(db_path)
    await _doorbell_unclaimed(store, clock)
    held = WrappedStore(store, _HeldAcquireExecutor)
    quiet = {"recovery_interval": 10_000.0}
    async with runtime(held, Recorder(), clock, **quiet) as rt, trio.open_nursery() as nursery:
        assert held.executor is not None
        await held.executor.acquiring.wait()  # the first pass rang 's': its acquire was sent
        outcomes = start_run(nursery, rt, "s")
        await trio.testing.wait_all_tasks_blocked()
        # Another owner took the doorbell and holds the session (its drain running).
        _held_elsewhere(raw, clock)
        _doorbell_taken_elsewhere(raw)
        held.executor.proceed.set()
        await rt.wait_idle("s")
    assert outcomes == [Outcome("deferred")]
    assert raw.one("SELECT time_woken FROM session WHERE id = 's'")[0] is not None


async def test_a_run_joining_an_acquisition_that_finds_the_session_held_at_close_records_its_wake(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """As above, with the runtime closing before the acquisition is answered: no successor
    acquisition records the joined run's wake then, so the close does. run() returns
    `deferred` with its wake durable for the holder (DESIGN §5 `run`), not
    interrupted/shutdown for an execution that never was - with its wake never stored,
    and the holder's drain maybe started before run() was called."""
    raw = Raw(db_path)
    await _doorbell_unclaimed(store, clock)
    held = WrappedStore(store, _HeldAcquireExecutor)
    quiet = {"recovery_interval": 10_000.0}
    async with trio.open_nursery() as nursery, runtime(held, Recorder(), clock, **quiet) as rt:
        assert held.executor is not None
        await held.executor.acquiring.wait()  # the first pass rang 's': its acquire was sent
        outcomes = start_run(nursery, rt, "s")
        await trio.testing.wait_all_tasks_blocked()
        # Another owner took the doorbell and holds the session (its drain running).
        _held_elsewhere(raw, clock)
        _doorbell_taken_elsewhere(raw)

        _set_once_closing(nursery, rt, held.executor.proceed)
    assert outcomes == [Outcome("deferred")]
    assert raw.one("SELECT time_woken FROM session WHERE id = 's'")[0] is not None


async def test_a_run_whose_acquisition_finds_the_session_held_at_close_is_deferred(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """run()'s own wake commits with its acquisition, which finds another owner holding
    the session; the runtime starts closing before the reply arrives. Its wake is durable
    for the holder and no execution of this runtime took it: `deferred` (DESIGN §5 `run`,
    and run()'s docstring: "the runtime is closing"), not interrupted/shutdown."""
    raw = Raw(db_path)
    held = _late_wake_and_acquire(store)
    quiet = {"recovery_interval": 10_000.0}
    async with trio.open_nursery() as nursery, runtime(held, Recorder(), clock, **quiet) as rt:
        assert held.executor is not None
        _held_elsewhere(raw, clock)
        outcomes = start_run(nursery, rt, "s")
        await held.executor.committed.wait()

        _set_once_closing(nursery, rt, held.executor.answer)
    assert outcomes == [Outcome("deferred")]
    assert raw.one("SELECT time_woken FROM session WHERE id = 's'")[0] is not None


class _HeldThenLateExecutor(_HeldAcquireExecutor):
    """As `_HeldAcquireExecutor`, and a `wake_and_acquire` whose reply reaches its caller
    only once `answer` is set (it commits at once; `committed` is set then)."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.committed = trio.Event()
        self.answer = trio.Event()

    async def run(self, op: Any, *args: Any) -> Any:
        result = await super().run(op, *args)
        if op is _store.wake_and_acquire:
            self.committed.set()
            with trio.CancelScope(shield=True):  # sent: its caller waits for the reply
                await self.answer.wait()
        return result


async def test_a_run_joining_a_joiner_s_wake_in_flight_that_finds_the_session_held_records_its_wake(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """The successor acquisition that records a joined run's wake (wake_and_acquire) finds
    the session held; a second run() joins it after that wake committed and before the
    reply arrived, and the holder took the doorbell meanwhile. The second run's wake must
    be recorded as the first's was, before it returns `deferred` (DESIGN §5 `run`): the
    holder's drain that took the doorbell started before that run() was called."""
    raw = Raw(db_path)
    await _doorbell_unclaimed(store, clock)
    held = WrappedStore(store, _HeldThenLateExecutor)
    quiet = {"recovery_interval": 10_000.0}
    async with runtime(held, Recorder(), clock, **quiet) as rt, trio.open_nursery() as nursery:
        assert held.executor is not None
        await held.executor.acquiring.wait()  # the first pass rang 's': its acquire was sent
        first = start_run(nursery, rt, "s")
        await trio.testing.wait_all_tasks_blocked()
        _held_elsewhere(raw, clock)
        _doorbell_taken_elsewhere(raw)
        held.executor.proceed.set()
        await held.executor.committed.wait()  # the first run's wake, with its acquire
        # The holder's iteration end took that doorbell, to drain again.
        _doorbell_taken_elsewhere(raw)
        second = start_run(nursery, rt, "s")  # joins the acquisition in flight
        await trio.testing.wait_all_tasks_blocked()
        held.executor.answer.set()
        await rt.wait_idle("s")
        await trio.testing.wait_all_tasks_blocked()
    assert first + second == [Outcome("deferred")] * 2
    assert raw.one("SELECT time_woken FROM session WHERE id = 's'")[0] is not None


async def test_a_run_joining_a_wake_s_held_acquisition_at_close_records_its_wake(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """As the joiner test above, on the path a wake's own acquisition takes (`signal`:
    wake_and_acquire, then `settle_unclaimed`): run() joins while the reply is on its way,
    the holder took the doorbell meanwhile, and the runtime starts closing before the
    reply arrives. No successor records the joined run's wake at a close, so it must be
    recorded before run() returns `deferred` (DESIGN §5 `run`) - the holder's drain that
    took the doorbell may have started before run() was called."""
    raw = Raw(db_path)
    held = _late_wake_and_acquire(store)
    quiet = {"recovery_interval": 10_000.0}
    async with trio.open_nursery() as nursery, runtime(held, Recorder(), clock, **quiet) as rt:
        assert held.executor is not None
        _held_elsewhere(raw, clock)
        nursery.start_soon(rt.wake, "s")
        await held.executor.committed.wait()  # found the session held; the reply waits
        # The holder's iteration end took that doorbell, to drain again.
        _doorbell_taken_elsewhere(raw)
        outcomes = start_run(nursery, rt, "s")  # joins the acquisition in flight
        await trio.testing.wait_all_tasks_blocked()
        assert rt._entries["s"].needs_wake

        _set_once_closing(nursery, rt, held.executor.answer)
    assert outcomes == [Outcome("deferred")]
    assert raw.one("SELECT time_woken FROM session WHERE id = 's'")[0] is not None


async def test_a_joined_run_s_wake_recorded_after_a_shutdown_interrupt_is_taken_at_once(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """run() joins an acquisition in flight; `interrupt(s, reason="shutdown")` stops it
    while the runtime stays open, and it finds no doorbell (another owner drained it
    meanwhile). The joined run's wake is recorded and run() returns `deferred` - then, the
    session free and the runtime open with room, this runtime takes that wake at once, as
    it resumes a claim it hands back (`recovery_interval` is crash recovery only, not
    pickup latency: README). It waited for the next pass: the release asked for one only
    when the outcome named the shutdown, which a stop that claimed nothing no longer does."""
    raw = Raw(db_path)
    await _doorbell_unclaimed(store, clock)
    held = WrappedStore(store, _HeldAcquireExecutor)
    recorder = Recorder()
    quiet = {"recovery_interval": 10_000.0}
    async with runtime(held, recorder, clock, **quiet) as rt, trio.open_nursery() as nursery:
        assert held.executor is not None
        await held.executor.acquiring.wait()  # the first pass rang 's': its acquire was sent
        outcomes = start_run(nursery, rt, "s")
        await trio.testing.wait_all_tasks_blocked()
        assert await rt.interrupt("s", reason="shutdown") is True
        # Another owner took the doorbell and drained it, its claim gone already.
        _doorbell_taken_elsewhere(raw)
        held.executor.proceed.set()
        await rt.wait_idle("s")
        assert outcomes == [Outcome("deferred")]
        assert raw.one("SELECT time_woken FROM session WHERE id = 's'")[0] is not None
        with trio.fail_after(1):
            await recorder.entered.wait()
        await rt.wait_idle("s")
    assert len(recorder.calls) == 1


class _LateReplyFailingWake(LateReply):
    """As `LateReply` on `wake_and_acquire` (shielded), and a `wake` sent without waiting
    for locks (`run_nowait`: the close's writes) that fails with a `StoreError` without
    running, as one finding another process's write lock does."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner, _store.wake_and_acquire, shield=True)
        self.wakes_refused = 0

    async def run_nowait(self, op: Any, *args: Any) -> Any:
        if op is _store.wake:
            self.wakes_refused += 1
            await trio.lowlevel.checkpoint()
            raise StoreError("database is locked (for a test)")
        return await self._inner.run_nowait(op, *args)


async def test_a_run_joining_a_wake_s_held_acquisition_at_close_whose_wake_fails_raises(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """As above, and the close's write of the joined run's wake fails: run() raises
    `StoreError` - as a run whose own wake could not be recorded does - instead of
    returning `deferred` for a wake never stored, and the entry is released, so the close
    ends (`_record_joined_wake_then_release`)."""
    raw = Raw(db_path)
    held = WrappedStore(store, _LateReplyFailingWake)
    raised: list[BaseException] = []

    async def run_and_catch(rt: Runtime) -> None:
        try:
            await rt.run("s")
        except StoreError as exc:
            raised.append(exc)

    quiet = {"recovery_interval": 10_000.0}
    async with trio.open_nursery() as nursery, runtime(held, Recorder(), clock, **quiet) as rt:
        assert held.executor is not None
        _held_elsewhere(raw, clock)
        nursery.start_soon(rt.wake, "s")
        await held.executor.committed.wait()  # found the session held; the reply waits
        # The holder's iteration end took that doorbell, to drain again.
        _doorbell_taken_elsewhere(raw)
        nursery.start_soon(run_and_catch, rt)  # joins the acquisition in flight
        await trio.testing.wait_all_tasks_blocked()
        assert rt._entries["s"].needs_wake

        _set_once_closing(nursery, rt, held.executor.answer)
    assert held.executor.wakes_refused == 1
    assert [type(exc) for exc in raised] == [StoreError]
    assert "could not be recorded" in str(raised[0])
    assert not rt._entries
    assert raw.one("SELECT time_woken FROM session WHERE id = 's'")[0] is None


async def test_a_wake_s_acquisition_answered_after_a_crash_leaves_its_claim_live(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """`testing.crash` while a wake's own acquisition (`signal`: wake_and_acquire) is on its
    way, and it claims: a crashed runtime writes nothing more - its claims stay with live
    leases, as a killed process's (`testing.crash`) - so that claim is not handed back (an
    expired lease, taken over at once rather than after the takeover grace or the lease),
    and no drain starts."""
    raw = Raw(db_path)
    held = _late_wake_and_acquire(store)
    drain = Recorder()
    outcomes: list[Outcome] = []
    quiet = {"recovery_interval": 10_000.0}
    async with trio.open_nursery() as nursery, runtime(held, drain, clock, **quiet) as rt:
        assert held.executor is not None

        async def run() -> None:
            outcomes.append(await rt.run("s"))

        nursery.start_soon(run)
        await held.executor.committed.wait()  # claimed; the reply waits
        testing.crash(rt)
        held.executor.answer.set()
        await trio.testing.wait_all_tasks_blocked()
        claim = raw.claim("s")
        assert claim is not None
        assert claim[3] > now_ms(clock)  # its lease live, as the dead owner left it
    assert outcomes == [Outcome("interrupted", "shutdown")]
    assert drain.calls == []


async def test_a_wake_s_held_acquisition_answered_after_a_crash_writes_and_starts_nothing(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """As above, the acquisition finding the session held and a user's interrupt accepted
    for it meanwhile (owed to the holder): answered after `testing.crash`, nothing is
    passed on (a crashed runtime writes nothing more) and nothing is started in the
    crashed runtime's closed nursery - the wake returns, instead of raising trio's
    "Nursery is closed to new arrivals" with the session left registered for ever."""
    raw = Raw(db_path)
    held = _late_wake_and_acquire(store)
    raised: list[BaseException] = []
    quiet = {"recovery_interval": 10_000.0}
    async with trio.open_nursery() as nursery, runtime(held, Recorder(), clock, **quiet) as rt:
        assert held.executor is not None
        _held_elsewhere(raw, clock)

        async def wake() -> None:
            try:
                await rt.wake("s")
            except Exception as exc:
                raised.append(exc)

        nursery.start_soon(wake)
        await held.executor.committed.wait()  # found the session held; the reply waits
        assert await rt.interrupt("s")  # accepted for the prospective claim
        testing.crash(rt)
        await trio.testing.wait_all_tasks_blocked()  # its tasks ended, its nursery closed
        held.executor.answer.set()
        await trio.testing.wait_all_tasks_blocked()
        assert raised == []
        assert not rt.is_active("s")
        assert raw.claim("s")[2] == "running"  # the dead owner passed nothing on


async def test_a_recovery_takeover_answered_after_a_crash_starts_nothing(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """As above, for a `recover_once()` whose takeover of a dead owner's claim is answered
    after `testing.crash`: the crashed runtime starts no drain in its closed nursery and
    keeps no entry - the call raises `StoreError` (the runtime crashed), as a crashed
    runtime's verbs do, not trio's "Nursery is closed to new arrivals" with the session
    registered for ever - and the claim it took over stays with its live lease."""
    raw = Raw(db_path)
    held = WrappedStore(
        store, lambda executor: LateReply(executor, _store.apply_recovery_batch, shield=True)
    )
    drain = Recorder()
    raised: list[BaseException] = []
    quiet = {"recovery_interval": 10_000.0}
    async with trio.open_nursery() as nursery, runtime(held, drain, clock, **quiet) as rt:
        assert held.executor is not None
        raw.seed_claim("s", "dead", expires_at=now_ms(clock) - 1_000, owner_id="other")

        async def recover() -> None:
            try:
                await rt.recover_once()
            except Exception as exc:
                raised.append(exc)

        nursery.start_soon(recover)
        await held.executor.committed.wait()  # taken over; the reply waits
        testing.crash(rt)
        await trio.testing.wait_all_tasks_blocked()  # its tasks ended, its nursery closed
        held.executor.answer.set()
        await trio.testing.wait_all_tasks_blocked()
        assert [type(exc) for exc in raised] == [StoreError]
        assert "crashed" in str(raised[0])
        assert not rt.is_active("s")
        claim = raw.claim("s")
        assert claim[1] == rt.owner_id and claim[3] > now_ms(clock)  # live, as left
    assert drain.calls == []


class _UnbegunSuccessorExecutor(ExecutorSeam):
    """An executor whose interrupt cleanup (`mark_cancelling`) waits until `stopping` is
    set, and whose `acquire` after it never begins: it waits, cancellable, as a batch
    waiting for another process's write lock does (`acquiring` is set then)."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.stopping = trio.Event()
        self.acquiring = trio.Event()

    async def run(self, op: Any, *args: Any) -> Any:
        if op is _store.mark_cancelling:
            await self.stopping.wait()
        elif op is _store.acquire and self.stopping.is_set():
            self.acquiring.set()
            await trio.sleep_forever()
        return await self._inner.run(op, *args)


async def test_a_run_waiting_for_a_successor_withdrawn_at_close_is_deferred(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """run() while an interrupt stops the session: its wake is recorded and rings a
    successor acquisition, which the runtime's close withdraws before it began (its
    doorbell left rung). No execution here took the wake, which stays durable for the next
    owner: `deferred`, as for an acquisition that found the session held - not
    interrupted/shutdown for an execution that never was."""
    drain = Recorder()
    drain.hold()  # running until the interrupt
    held = WrappedStore(store, _UnbegunSuccessorExecutor)
    async with trio.open_nursery() as nursery, runtime(held, drain, clock) as rt:
        assert held.executor is not None
        await rt.wake("s")
        await drain.entered.wait()
        assert await rt.interrupt("s") is True
        outcomes = start_run(nursery, rt, "s")  # stopping: its wake rings a successor
        await trio.testing.wait_all_tasks_blocked()
        held.executor.stopping.set()
        await held.executor.acquiring.wait()
    assert outcomes == [Outcome("deferred")]
    assert Raw(db_path).one("SELECT time_woken FROM session WHERE id = 's'")[0] is not None
    assert len(drain.calls) == 1


async def test_a_heartbeat_interval_past_the_self_fence_is_refused(
    store: Store, clock: Clock, autojump_clock: MockClock
) -> None:
    """Each drain self-fences 10% of a lease before the durable expiry (§6.17), and a claim
    made just after a tick waits a whole interval for its first renewal: an interval past
    that bound would stop every drain longer than it as `lease_lost` with the store
    answering every renewal, so it is refused up front; one just inside it keeps a drain
    three leases long alive."""
    finished: list[float] = []

    async def long_drain(ctx: DrainContext) -> None:
        await trio.sleep(90.0)
        finished.append(trio.current_time())

    with pytest.raises(ValueError, match=r"heartbeat_interval \(28.0\) must be shorter than 90%"):
        async with runtime(store, long_drain, clock, lease=30.0, heartbeat_interval=28.0):
            pytest.fail("the runtime must not open")
    async with runtime(store, long_drain, clock, lease=30.0, heartbeat_interval=26.0) as rt:
        assert await rt.run("s") == Outcome("succeeded")
    assert finished


@pytest.mark.parametrize(
    "group",
    [
        pytest.param(lambda: ExceptionGroup("mine", [KeyError("k")]), id="flat"),
        pytest.param(
            lambda: ExceptionGroup(
                "outer", [ExceptionGroup("inner", [KeyError("k")]), ValueError("v")]
            ),
            id="nested",
        ),
    ],
)
async def test_the_blocks_own_exception_group_escapes_as_itself(
    store: Store,
    clock: Clock,
    autojump_clock: MockClock,
    group: Callable[[], ExceptionGroup[Exception]],
) -> None:
    """An ExceptionGroup the block raises itself - the group of a nursery of the caller's,
    inside the runtime's block - escapes as that very group, as any exception of the block
    does: the runtime unwraps only the groups its own nurseries made. It escaped as the bare
    exception inside it, so an `except ExceptionGroup` around the block missed it. Found by
    an audit. Trio's cancel scopes pass on a copy of the group, with copies of the groups
    nested in it (a review's find): it is recognised by its message and the identity of its
    exceptions that are no groups."""
    mine = group()
    with pytest.raises(ExceptionGroup) as caught:
        async with runtime(store, Recorder(), clock):
            raise mine
    assert caught.value is mine


async def test_a_shutdown_grace_of_zero_is_accepted(
    store: Store, clock: Clock, autojump_clock: MockClock
) -> None:
    """`shutdown_grace=0` - warn at once about drains still running on close, without
    waiting first - is a valid grace: it bounds no durable time (unlike a lease, whose
    whole milliseconds are stored). It was refused as under a millisecond. Found by an
    audit."""
    drain = Recorder()
    async with runtime(store, drain, clock, shutdown_grace=0) as rt:
        assert await rt.run("s") == Outcome("succeeded")


async def test_a_write_after_close_says_the_store_is_closed_on_the_inline_store_too(
    store: Store, clock: Clock, autojump_clock: MockClock
) -> None:
    """A verb awaited after the runtime's block exited raises the same `StoreError` on
    every store - "the store executor is closed", as reads and the threaded stores say -
    not the inline SQLite store's leaked driver error ("ProgrammingError: Cannot operate
    on a closed database."). Found by an audit."""
    async with runtime(store, Recorder(), clock) as rt:
        await rt.run("s")
    with pytest.raises(StoreError) as caught:
        await rt.submit("s", {"q": 1})
    assert "closed database" not in str(caught.value)
    assert "executor is closed" in str(caught.value)


@pytest.mark.parametrize("producer", [False, True], ids=["drains", "producer"])
async def test_recover_once_after_close_says_the_store_is_closed(
    store: Store, clock: Clock, autojump_clock: MockClock, producer: bool
) -> None:
    """`recover_once()` awaited after the runtime's block exited raises the `StoreError`
    every other verb raises there ("the store executor is closed"). It returned an empty
    `RecoveryReport`, so a caller looping until a pass examined nothing stopped as if the
    store held no work, while a write beside it failed. Found by an audit."""
    async with runtime(store, None if producer else Recorder(), clock) as rt:
        pass
    with pytest.raises(StoreError) as caught:
        await rt.recover_once()
    assert "executor is closed" in str(caught.value)
