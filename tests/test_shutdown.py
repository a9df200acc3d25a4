"""Graceful shutdown (DESIGN §4 Shutdown, §6.21): a claim is handed back only after its drain
exited, so drains of one session never overlap in time, graceful restarts included.

Deterministic: inline store, autojump virtual clock, gates. A drain that does not stop when
cancelled is a shielded wait (as a `finally` that awaits) or a blocking call in a thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from helpers import (
    ExecutorSeam,
    LateReply,
    Raw,
    WrappedStore,
    now_ms,
    open_tool_message,
    runtime,
)
from trio.testing import MockClock

import trio_sessions
from trio_sessions import DrainContext, Store, StoreError, _store
from trio_sessions._backend import Job
from trio_sessions._codec import decode_assistant
from trio_sessions._errors import OutcomeUnknown
from trio_sessions._handoff import HandoffQueue, Queued, pumping

Clock = Callable[[], float]
LEASE = 30.0


class Overlap:
    """Counts the drains of one session running at once, across runtimes."""

    def __init__(self) -> None:
        self.running = 0
        self.peak = 0
        self.calls: list[DrainContext] = []

    def enter(self, ctx: DrainContext) -> None:
        self.calls.append(ctx)
        self.running += 1
        self.peak = max(self.peak, self.running)

    def leave(self) -> None:
        self.running -= 1


async def test_close_hands_a_claim_back_only_after_its_drain_exited(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """A drain whose cleanup outlasts the shutdown grace keeps its claim (and its lease,
    renewed) until it exits; only then is the claim handed back and resumed elsewhere: the
    two runtimes' drains never overlap."""
    overlap = Overlap()
    cleaning, let_go = trio.Event(), trio.Event()

    async def stubborn(ctx: DrainContext) -> None:
        overlap.enter(ctx)
        try:
            if not ctx.resumed:
                await trio.sleep_forever()
        finally:
            if not ctx.resumed:
                with trio.CancelScope(shield=True):  # a `finally` that awaits, uncancellable
                    cleaning.set()
                    await let_go.wait()
            overlap.leave()

    closed = trio.Event()
    async with runtime(store, stubborn, clock, lease=LEASE) as other:

        async def close_first() -> None:
            async with runtime(store, stubborn, clock, lease=LEASE) as first:
                await first.wake("s")
                await trio.testing.wait_all_tasks_blocked()
                assert first.is_active("s")
            closed.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(close_first)
            await cleaning.wait()
            try:
                # Three leases and many recovery passes later, the stubborn drain still
                # runs: its claim must still be live, held by the first runtime.
                for _ in range(9):
                    await trio.sleep(LEASE / 3)
                    report = await other.recover_once()
                    assert report.resumed == 0, report
                    assert overlap.peak == 1
                assert not closed.is_set()
            finally:
                let_go.set()  # a failed check must not leave the drain stuck forever
            await closed.wait()
        await other.recover_once()
        await other.wait_idle("s")
    assert overlap.peak == 1
    assert [ctx.resumed for ctx in overlap.calls] == [False, True]
    # A graceful hand-back does not count against the resume budget.
    assert overlap.calls[1].attempt == 0
    assert Raw(db_path).claim("s") is None


async def test_close_waits_for_a_drain_blocked_in_a_thread(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """A drain blocked in `trio.to_thread.run_sync` (uncancellable) when the runtime closes:
    no other runtime resumes the session while that thread runs; once it returns, the
    claim is handed back and resumed at once."""
    overlap = Overlap()
    in_thread, blocker = trio.Event(), threading.Event()

    async def blocking(ctx: DrainContext) -> None:
        overlap.enter(ctx)
        try:
            if not ctx.resumed:
                trio.lowlevel.current_trio_token().run_sync_soon(in_thread.set)
                await trio.to_thread.run_sync(blocker.wait)
        finally:
            overlap.leave()

    async with runtime(store, blocking, clock, lease=LEASE) as other:

        async def close_first() -> None:
            async with (
                runtime(store, blocking, clock, lease=LEASE) as first,
                trio.open_nursery() as inner,
            ):
                inner.start_soon(first.run, "s")  # a joiner cancelled below: never the drain
                await in_thread.wait()
                inner.cancel_scope.cancel()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(close_first)
            await in_thread.wait()
            try:
                for _ in range(6):
                    await trio.sleep(LEASE / 2)
                    assert (await other.recover_once()).resumed == 0
                assert overlap.peak == 1 and overlap.running == 1
            finally:
                blocker.set()  # a failed check must not leave the thread blocked forever
        await other.recover_once()
        await other.wait_idle("s")
    assert overlap.peak == 1
    assert [ctx.resumed for ctx in overlap.calls] == [False, True]
    assert Raw(db_path).claim("s") is None


async def test_an_open_cancelled_after_its_first_pass_took_a_claim_over_hands_it_back_undrained(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """The opening recovery pass took a dead owner's claim over, and the open is then
    cancelled (a SIGTERM while a worker starts), before the heartbeat and the close's
    shutdown exist. No drain of it may start there - nothing would renew its lease while
    it ran (§6.17, §6.21) - and the claim is handed back at once, so another runtime
    resumes it in its next pass (not a lease later), counting no second resume. Asked by
    an audit of the close path (audR56); it holds: the resumed busy periods are tasks that
    first run once the open yields, and they start cancelled."""
    calls: list[DrainContext] = []

    async def drain(ctx: DrainContext) -> None:
        calls.append(ctx)

    opening = trio.CancelScope()

    class SigtermAfterTheTakeover(ExecutorSeam):
        async def run(self, op: Any, *args: Any) -> Any:
            result = await self._inner.run(op, *args)
            if op is _store.apply_recovery_batch:
                opening.cancel()  # lands at the open's next checkpoint, after the takeover
            return result

    async with runtime(store, drain, clock, lease=LEASE, recovery_interval=3600.0) as other:
        raw = Raw(db_path)
        raw.seed_claim("s", "dead-e", expires_at=now_ms(clock) - 1)
        with opening:
            async with runtime(WrappedStore(store, SigtermAfterTheTakeover), drain, clock):
                pytest.fail("the open was cancelled")  # pragma: no cover
        assert opening.cancelled_caught
        assert calls == []
        [(execution_id, phase, handed_back, expires_at)] = raw.rows(
            "SELECT id, phase, handed_back, expires_at FROM session_execution"
        )
        assert execution_id != "dead-e", "the opening pass did not take the claim over"
        assert (phase, handed_back, expires_at) == ("running", 1, now_ms(clock))
        assert (await other.recover_once()).resumed == 1
        await other.wait_idle("s")
    assert [(ctx.resumed, ctx.attempt) for ctx in calls] == [(True, 1)]
    assert raw.claim("s") is None


async def test_close_hands_back_at_once_when_drains_stop_promptly(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """Drains that stop when cancelled: close hands their claims back in well under the
    grace, and the next runtime's first pass resumes them without counting a resume."""
    entered = trio.Event()

    async def prompt(ctx: DrainContext) -> None:
        entered.set()
        await trio.sleep_forever()

    async with runtime(store, prompt, clock, lease=LEASE) as first:
        await first.wake("s")
        await entered.wait()
        started = trio.current_time()
    assert trio.current_time() - started < 1.0
    claim = Raw(db_path).claim("s")
    assert claim is not None
    resumed: list[DrainContext] = []

    async def record(ctx: DrainContext) -> None:
        resumed.append(ctx)

    async with runtime(store, record, clock, lease=LEASE) as second:
        await second.wait_idle("s")
    assert [(ctx.resumed, ctx.attempt) for ctx in resumed] == [(True, 0)]


class HandBacks(ExecutorSeam):
    """The runtime's executor, recording each hand-back's claims as it is sent."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.sent: list[list[str]] = []

    async def run_nowait(self, op: Any, *args: Any) -> Any:
        if op is _store.expire_claims:
            self.sent.append(sorted(args[1]))
        return await self._inner.run_nowait(op, *args)


async def test_close_hands_back_the_claims_of_drains_that_stop_together_at_once(
    store: Store, clock: Clock, autojump_clock: MockClock
) -> None:
    """Closing a runtime with many drains that stop when cancelled hands their claims back
    in one transaction, not one each (200 live chats: the last one's session waited for
    200 transactions before another worker could take it over); a drain that exits later
    hands its own back when it does. Every claim is handed back."""
    wrapped = WrappedStore(store, HandBacks)
    entered: dict[str, str] = {}
    all_in, let_go = trio.Event(), trio.Event()

    async def drain(ctx: DrainContext) -> None:
        entered[ctx.session_id] = ctx.execution_id
        if len(entered) == 6:
            all_in.set()
        try:
            await trio.sleep_forever()
        finally:
            if ctx.session_id == "late":
                with trio.CancelScope(shield=True):  # a cleanup that outlasts the others
                    await let_go.wait()

    async def late_exit() -> None:
        await trio.sleep(1.0)
        let_go.set()

    async with trio.open_nursery() as nursery, runtime(wrapped, drain, clock, lease=LEASE) as first:
        for session_id in ("late", "s1", "s2", "s3", "s4", "s5"):
            await first.wake(session_id)
        await all_in.wait()
        nursery.start_soon(late_exit)  # during the close
    assert wrapped.executor is not None
    prompt = sorted(entered[f"s{n}"] for n in range(1, 6))
    assert wrapped.executor.sent == [prompt, [entered["late"]]]
    resumed: list[str] = []

    async def record(ctx: DrainContext) -> None:
        resumed.append(ctx.session_id)

    async with runtime(store, record, clock, lease=LEASE) as second:
        for session_id in entered:
            await second.wait_idle(session_id)
    assert sorted(resumed) == sorted(entered)


async def test_no_drain_iteration_starts_once_the_runtime_is_closing(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """A wake coalesced during a drain, whose iteration end (taking that doorbell to go on)
    is answered only after the runtime began closing: no further drain call starts - the
    claim is handed back, and the next runtime resumes it (the wake is not lost)."""
    calls: list[DrainContext] = []
    entered, finish = trio.Event(), trio.Event()

    async def drain(ctx: DrainContext) -> None:
        calls.append(ctx)
        if len(calls) == 1:
            entered.set()
            await finish.wait()

    held = WrappedStore(
        store, lambda executor: LateReply(executor, _store.end_iteration, shield=True)
    )
    async with trio.open_nursery() as nursery:
        async with runtime(held, drain, clock, lease=LEASE) as rt:
            await rt.wake("s")
            await entered.wait()
            await rt.wake("s")  # coalesced: the iteration end takes it and goes on
            finish.set()
            assert held.executor is not None
            await held.executor.committed.wait()

            async def answer_once_closing() -> None:
                await trio.testing.wait_all_tasks_blocked()  # the close is waiting
                assert rt._closing and held.executor is not None
                held.executor.answer.set()

            nursery.start_soon(answer_once_closing)
        assert [c.resumed for c in calls] == [False]
    claim = Raw(db_path).claim("s")
    assert claim is not None and claim[2] == "running"  # handed back for recovery
    resumed: list[DrainContext] = []

    async def record(ctx: DrainContext) -> None:
        resumed.append(ctx)

    async with runtime(store, record, clock, lease=LEASE) as second:
        await second.wait_idle("s")
    assert [c.resumed for c in resumed] == [True]


async def test_an_operation_queued_as_the_executor_closes_is_refused_never_dropped(
    autojump_clock: MockClock,
) -> None:
    """The group-commit queue's invariant at close: an operation queued while the pump
    is busy with upkeep (a WAL checkpoint in a worker thread) when the executor closes
    either runs or fails with `StoreError` - never returns a result it did not produce.
    The hand-off models the SQLite one: `trio.to_thread.run_sync` first checks for
    cancellation, before anything runs."""
    queue = HandoffQueue()
    in_upkeep, upkeep_done = trio.Event(), trio.Event()
    results: list[object] = []

    async def upkeep() -> None:
        if not in_upkeep.is_set():
            in_upkeep.set()
            with trio.CancelScope(shield=True):  # a worker thread is not abandoned
                await upkeep_done.wait()

    async def hand_off(batch: list[Queued]) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()  # as trio.to_thread.run_sync begins
        for queued in batch:
            queued.job.result = queued.job.op(*queued.job.args)

    async def caller() -> None:
        try:
            results.append(await queue.submit(Job(str.upper, ("ran",))))
        except StoreError as exc:
            results.append(exc)

    async def end_upkeep_once_closing() -> None:
        await trio.testing.wait_all_tasks_blocked()  # the close waits for the pump
        upkeep_done.set()

    async with trio.open_nursery() as nursery, pumping(queue, hand_off, upkeep):
        queue.poke()
        await in_upkeep.wait()
        nursery.start_soon(caller)
        await trio.testing.wait_all_tasks_blocked()  # queued behind the upkeep
        nursery.start_soon(end_upkeep_once_closing)
    assert len(results) == 1
    assert results == ["RAN"] or isinstance(results[0], StoreError), results


async def test_a_hand_off_that_raises_never_reports_its_batch_done(
    autojump_clock: MockClock,
) -> None:
    """The group-commit queue's invariant when the hand-off itself raises (a driver error no
    engine turned into a job's outcome, `MemoryError` for SQLite's SQLITE_NOMEM): its taken
    callers were finished with no error and got `None`, as if their writes had committed,
    while the pump died. Whether such a batch ran is unknown: each caller gets that."""
    queue = HandoffQueue()
    outcomes: list[object] = []

    async def hand_off(batch: list[Queued]) -> None:
        raise MemoryError

    async def caller() -> None:
        try:
            outcomes.append(await queue.submit(Job(str.upper, ("ran",))))
        except StoreError as exc:
            outcomes.append(exc)

    with pytest.RaisesGroup(MemoryError, flatten_subgroups=True):
        async with trio.open_nursery() as nursery, pumping(queue, hand_off):
            nursery.start_soon(caller)
            await trio.sleep_forever()  # ended by the pump's error
    [outcome] = outcomes
    assert isinstance(outcome, OutcomeUnknown), outcome


async def test_an_interrupt_during_a_rolling_restarts_handoff_stops_the_work(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """A user presses Stop between a graceful shutdown's hand-back and the takeover (a
    rolling restart): the interrupt is accepted and the handed-back claim is finished as
    cancelled, never resumed."""
    entered = trio.Event()
    calls: list[DrainContext] = []

    async def drain(ctx: DrainContext) -> None:
        calls.append(ctx)
        if not ctx.resumed:
            entered.set()
            await trio.sleep_forever()

    async with runtime(store, drain, clock, lease=LEASE) as first:
        await first.wake("s")
        await entered.wait()
    claim = Raw(db_path).claim("s")
    assert claim is not None and claim[2] == "running"  # handed back, lease ended
    async with trio_sessions.open_runtime(store, None, clock=clock) as producer:
        accepted = await producer.interrupt("s")
    async with runtime(store, drain, clock, lease=LEASE) as second:
        await second.wait_idle("s")
    assert accepted
    assert [c.resumed for c in calls] == [False]
    assert Raw(db_path).claim("s") is None


async def test_an_interrupt_of_a_dead_owners_claim_stops_the_work_for_good(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """A user presses Stop after the owner died mid-step (its lease ran out, no recovery
    yet): accepted, and recovery finishes the claim as cancelled - its open reply finished
    `interrupted`, its running tool failed - never resumed; the input sent meanwhile goes to
    exactly one successor."""
    raw = Raw(db_path)
    calls: list[DrainContext] = []

    async def drain(ctx: DrainContext) -> None:
        calls.append(ctx)
        await ctx.take_inputs()

    async with trio_sessions.open_runtime(store, None, clock=clock) as producer:
        raw.seed_claim("s", "dead-e", expires_at=now_ms(clock) - 1)
        message_id = raw.seed_assistant("s", "dead-e", 1, open_tool_message())
        assert await producer.interrupt("s")
        await producer.submit("s", {"n": 1}, input_id="i1")
    async with runtime(store, drain, clock, lease=LEASE) as rt:
        assert rt.statistics().recovery.finished_cancelled == 1
        await rt.wait_idle("s")
    [data] = raw.rows("SELECT data FROM session_message WHERE id = ?", (message_id,))
    reply = decode_assistant(data[0], key=message_id)
    assert (reply.finished, reply.error) == (True, "interrupted")
    assert [getattr(part, "status", None) for part in reply.parts] == ["error"]
    assert [c.resumed for c in calls] == [False]
    assert raw.claim("s") is None
    assert raw.rows("SELECT id FROM session_input") == []


async def test_a_batch_the_close_stopped_before_its_thread_ran_is_refused_not_unknown() -> None:
    """The SQLite hand-off waits for the worker thread's limiter, which a passive WAL
    checkpoint (`_checkpoint_beside_writers`) may hold; the executor closing meanwhile
    cancels `trio.to_thread.run_sync` before anything ran. Its callers must fail as
    operations the close left unrun do (`StoreError`), not `OutcomeUnknown` - which tells
    them their write may have committed (9d48c58 made every error of a hand-off that)."""
    queue = HandoffQueue()
    limiter = trio.CapacityLimiter(1)
    ran: list[str] = []
    results: list[object] = []

    async def hand_off(batch: list[Queued]) -> None:
        def run() -> None:
            for queued in batch:
                ran.append(queued.job.op(*queued.job.args))
                queued.job.result = ran[-1]

        await trio.to_thread.run_sync(run, limiter=limiter)

    async def caller() -> None:
        try:
            results.append(await queue.submit(Job(str.upper, ("ran",))))
        except StoreError as exc:
            results.append(exc)

    async with trio.open_nursery() as nursery:
        await limiter.acquire()  # the checkpoint's thread holds it
        async with pumping(queue, hand_off):
            nursery.start_soon(caller)
            await trio.testing.wait_all_tasks_blocked()  # the hand-off waits for the limiter
        limiter.release()
    assert ran == []
    assert len(results) == 1 and isinstance(results[0], StoreError), results
    assert not isinstance(results[0], OutcomeUnknown), results


async def test_a_full_runtime_resumes_a_handed_back_answer_before_a_newer_message(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """A rolling restart hands an answer back to a runtime at its `max_active`; a new chat's
    message arrives meanwhile. When a place frees, the cut answer goes on first (a recovery
    pass takes expired and handed-back claims before doorbells, §4): the user whose answer
    was cut does not watch it frozen behind newer work. (The change look rang the new
    chat's doorbell into the freed place first, and the pass it triggered found none left.)
    Found by the rolling-restart audit (audQ53)."""
    started: list[str] = []
    busy_gate, cut_entered, both_ran = trio.Event(), trio.Event(), trio.Event()

    async def drain(ctx: DrainContext) -> None:
        started.append(ctx.session_id)
        await ctx.take_inputs()
        if ctx.session_id == "busy":
            await busy_gate.wait()
        elif ctx.session_id == "cut" and not ctx.resumed:
            cut_entered.set()
            await trio.sleep_forever()  # cut by the restart
        if {"cut", "new"} <= set(started):
            both_ran.set()

    async with runtime(store, drain, clock, lease=LEASE, max_active=1) as full:
        await full.submit("busy", {"n": 1})
        await trio.testing.wait_all_tasks_blocked()
        assert started == ["busy"]
        async with runtime(store, drain, clock, lease=LEASE) as stopping:
            await stopping.submit("cut", {"n": 1})
            await cut_entered.wait()
            started.remove("cut")  # its first run, on the runtime that stops
        await full.submit("new", {"n": 1})
        await trio.testing.wait_all_tasks_blocked()
        assert started == ["busy"]  # no place left for either
        busy_gate.set()
        await both_ran.wait()
    assert started == ["busy", "cut", "new"]
