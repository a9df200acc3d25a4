"""How a busy period ends when it is stopped: an interrupt accepted while a claim commits,
while the runtime closes, while the liveness token is lost or the store is busy, a drain
whose cleanup raises once it was cancelled, a stale context, a failing acquisition or test
hook. What was asked - a user's stop, a shutdown's hand-back - must stand: a user's stop is
never resumed, a hand-back is, and no input is stranded (DESIGN §4, §6.6, §6.7, §6.16).
Found by audits; each test failed before its fix. Deterministic: inline store, autojump
virtual clock, gates and executor seams."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from helpers import (
    ExecutorSeam,
    LateReply,
    LosableTokenExecutor,
    Raw,
    Recorder,
    WrappedStore,
    runtime,
    start_run,
)
from test_uncertain_writes import LostReplies
from trio.testing import MockClock

from trio_sessions import AssistantData, Claim, DrainContext, Outcome, Store, _store
from trio_sessions._errors import OutcomeUnknown, StoreError

Clock = Callable[[], float]


async def test_a_user_interrupt_accepted_while_a_wakes_claim_commits_survives_a_close(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """An interrupt accepted (True) while a wake's acquisition is in flight, with the
    runtime closing before the claim's reply arrives: the claim is cleaned as the user
    asked (§6.6 "cleaned (user)"), never handed back for a later owner to resume."""
    calls: list[DrainContext] = []

    async def drain(ctx: DrainContext) -> None:
        calls.append(ctx)

    held = WrappedStore(
        store, lambda executor: LateReply(executor, _store.wake_and_acquire, shield=True)
    )
    async with trio.open_nursery() as nursery, runtime(held, drain, clock) as rt:
        nursery.start_soon(rt.wake, "s")
        await trio.testing.wait_all_tasks_blocked()
        assert held.executor is not None
        await held.executor.committed.wait()
        assert await rt.interrupt("s") is True  # accepted: the user asked to stop

        async def answer_once_closing() -> None:
            await trio.testing.wait_all_tasks_blocked()  # the close is waiting
            assert rt._closing and held.executor is not None
            held.executor.answer.set()

        nursery.start_soon(answer_once_closing)
    assert calls == []
    claim = Raw(db_path).claim("s")
    later = Recorder()
    async with runtime(store, later, clock) as second:
        await second.wait_idle("s")
    # Expected: the accepted user interrupt cleaned the claim (or left it 'cancelling' for
    # recovery to finish as cancelled); no later owner runs the drain.
    assert [c.resumed for c in later.calls] == [], "the interrupted work was resumed"
    assert claim is None or claim[2] == "cancelling", claim


async def test_a_shutdown_interrupt_hands_back_only_a_claim_of_this_runtimes_own(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """`interrupt(s, reason="shutdown")` hands the claim back for recovery to resume. For a
    claim another runtime held, it was sent as that owner's user stop: the drain ended
    `interrupted/user`, its answer was closed and nothing resumed it - the opposite of a
    hand-back. Found by two audits. Only this runtime's own claim can be handed back: for
    one held elsewhere it writes nothing and returns False, and that drain runs on."""
    outcomes: dict[str, list[Outcome]] = {}
    entered = {"s-local": trio.Event(), "s-remote": trio.Event()}
    resumed: list[str] = []
    finish = trio.Event()

    async def drain(ctx: DrainContext) -> None:
        if ctx.resumed:
            resumed.append(ctx.session_id)
            return
        entered[ctx.session_id].set()
        await finish.wait()

    async with (
        runtime(store, drain, clock) as owner,
        runtime(store, None, clock) as other,
        trio.open_nursery() as nursery,
    ):
        for where in ("local", "remote"):
            outcomes[where] = start_run(nursery, owner, f"s-{where}")
            await entered[f"s-{where}"].wait()
        assert await owner.interrupt("s-local", reason="shutdown") is True
        assert await other.interrupt("s-remote", reason="shutdown") is False
        await owner.wait_idle("s-local")
        assert Raw(db_path).claim("s-remote")[2] == "running"
        finish.set()
        await owner.wait_idle("s-remote")
        await owner.recover_once()
        await owner.wait_idle("s-local")
    assert outcomes["local"] == [Outcome("interrupted", "shutdown")]
    assert outcomes["remote"] == [Outcome("succeeded")]
    assert resumed == ["s-local"]


async def test_a_shutdown_interrupt_of_a_live_runtime_is_resumed_by_it_at_once(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """A claim this runtime hands back while it stays open (`interrupt(s,
    reason="shutdown")`) is resumed by its own recovery pass at once, as another runtime's
    hand-back is (its signal brings the pass). It waited for the next pass (`recovery_interval`)
    on the inline store and for the change loop's fallback poll elsewhere: the change loop
    passes over the runtime's own commits. Found by an audit (a differential campaign)."""
    calls: list[bool] = []
    entered, resumed = trio.Event(), trio.Event()

    async def drain(ctx: DrainContext) -> None:
        calls.append(ctx.resumed)
        if ctx.resumed:
            resumed.set()
            return
        entered.set()
        await trio.sleep_forever()

    async with runtime(store, drain, clock, recovery_interval=600) as rt:
        await rt.wake("s")
        await entered.wait()
        assert await rt.interrupt("s", reason="shutdown") is True
        with trio.fail_after(1):
            await resumed.wait()
        await rt.wait_idle("s")
    assert calls == [False, True]
    assert Raw(db_path).claim("s") is None


async def test_an_interrupt_accepted_during_a_rung_acquire_whose_outcome_is_unknown_holds(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """A user interrupt accepted (True) while an acquisition started by a ring (here
    `resume`) is in flight, whose claim landed but whose reply was lost: the interrupt is
    passed on to that claim - marked cancelling, so recovery finishes it and never resumes
    the work (as the wake-and-acquire path does: `BusyPeriods.settle_unclaimed`)."""
    calls: list[bool] = []

    async def drain(ctx: DrainContext) -> None:
        calls.append(ctx.resumed)

    async with runtime(store, drain, clock) as rt:
        await rt.pause("s")
        await rt.wake("s")  # durable, no claim: the session is paused
        lost = LostReplies(rt)
        ran, release = trio.Event(), trio.Event()
        lost.lose(_store.acquire, landed=True, hold=(ran, release))
        await rt.resume("s")  # rings: a busy period acquires
        await ran.wait()  # the claim landed; its reply is on its way
        assert await rt.interrupt("s") is True
        release.set()
        await rt.wait_idle("s")
        claim = Raw(db_path).claim("s")
    autojump_clock.jump(120.0)  # well past the lease: any owner may recover it
    async with runtime(store, drain, clock) as second:
        await second.wait_idle("s")
    assert calls == [], f"the interrupted work ran (resumed={calls}); claim was {claim}"


async def test_a_drain_failing_on_a_stale_context_fails_and_leaves_no_orphaned_claim(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """A drain that fails because it used an earlier iteration's context (`LeaseLost`: "a
    context used after its drain returned ... raises LeaseLost", DESIGN §5) has not lost its
    lease: its busy period ends `failed` with that error and its claim is finished, not
    left live and unrenewed - which reports `lease_lost`, keeps every later run of the
    session deferred until the lease runs out, then has recovery resume it as a crash."""
    contexts: list[DrainContext] = []

    async def drain(ctx: DrainContext) -> None:
        contexts.append(ctx)
        if len(contexts) == 1:
            await rt.wake("s")  # coalesced: a second iteration follows
            return
        if len(contexts) == 2:
            await contexts[0].take_inputs()  # the first iteration's context: stale

    async with runtime(store, drain, clock) as rt:
        outcome = await rt.run("s")
        claim = Raw(db_path).claim("s")
        again = await rt.run("s")
    assert outcome.kind == "failed", outcome
    assert claim is None, f"an orphaned live claim of our own: {claim}"
    assert again == Outcome("succeeded"), again


class FailsOnceWhileClosing(ExecutorSeam):
    """The runtime's executor, whose first call of `operation` made while the runtime is
    closing fails with a `StoreError` (the store busy for a moment: another process's long
    write transaction), without running; every other call goes through."""

    def __init__(self, inner: Any, operation: Any) -> None:
        super().__init__(inner)
        self._operation: Any = operation
        self.runtime: Any = None
        self.failed = False

    async def run(self, operation: Any, *args: Any) -> Any:
        if operation is self._operation and self.runtime is not None and self.runtime._closing:
            self._operation = None
            self.failed = True
            raise StoreError("the store is busy (for a test)")
        return await self._inner.run(operation, *args)


async def test_a_user_interrupt_whose_cleanup_meets_a_busy_store_while_closing_is_not_resumed(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """An accepted user interrupt whose cleanup's first write fails once because the store
    is briefly busy, as the runtime closes: the work is never resumed by a later owner
    (DESIGN §4: "If cleanup is cancelled, the claim stays with phase='cancelling'; recovery
    finishes it"). Open, the cleanup retries; closing, it gives up at once and leaves the
    claim 'running' with a live lease, which the next owner takes over and resumes."""
    entered, let_go = trio.Event(), trio.Event()
    calls: list[bool] = []

    async def drain(ctx: DrainContext) -> None:
        calls.append(ctx.resumed)
        if len(calls) > 1:
            return
        entered.set()
        try:
            await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True):
                await let_go.wait()  # a drain that needs a moment to clean up

    held = WrappedStore(store, lambda ex: FailsOnceWhileClosing(ex, _store.mark_cancelling))
    async with trio.open_nursery() as nursery, runtime(held, drain, clock) as rt:
        assert held.executor is not None
        held.executor.runtime = rt
        await rt.wake("s")
        await entered.wait()
        assert await rt.interrupt("s") is True

        async def let_go_once_closing() -> None:
            await trio.testing.wait_all_tasks_blocked()  # the close is waiting
            assert rt._closing
            let_go.set()

        nursery.start_soon(let_go_once_closing)
    assert held.executor.failed
    claim = Raw(db_path).claim("s")
    autojump_clock.jump(60.0)  # past the lease: the next owner's first pass looks at it
    async with runtime(store, drain, clock) as second:
        await second.wait_idle("s")
    assert calls == [False], f"the interrupted work was resumed; claim was {claim}"


async def test_an_acquisition_hook_that_raises_ends_the_runtime_and_strands_no_input(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """An `acquisition_hook` (a test hook) that raises, before any drain ran: the claim was
    finished as if a drain had failed, which does not re-arm the doorbell for inputs it
    never took - the input was stranded, with neither doorbell nor claim. Found by an
    audit. The hook's error is the test's, as a test seam's is: it ends the runtime's block,
    and the claim is handed back with no drain started, so the next runtime resumes it."""
    drain = Recorder()

    async def hook(claim: Claim) -> None:
        raise ConnectionError("the tracing backend is down")

    async def submit_until_the_hook_fails() -> None:
        async with runtime(store, drain, clock, acquisition_hook=hook) as rt:
            await rt.submit("s", {"q": 1}, input_id="i1")
            await trio.sleep_forever()

    with pytest.raises(ConnectionError):
        await submit_until_the_hook_fails()
    assert drain.calls == []
    assert Raw(db_path).rows("SELECT id FROM session_input") == [("i1",)]
    claim = Raw(db_path).claim("s")
    assert claim is not None and claim[2] == "running", claim
    later: list[list[str]] = []

    async def take(ctx: DrainContext) -> None:
        later.append([i.id for i in await ctx.take_inputs()])

    async with runtime(store, take, clock) as second:
        await second.wait_idle("s")
    assert later == [["i1"]]


class FailsOnce:
    """The runtime's store executor, whose next call of one operation waits for `go`,
    then fails with `error` (default: a `StoreError` without running - SQLite: another
    process held the write lock past `busy_timeout`). Everything else goes to the executor."""

    def __init__(
        self,
        runtime: Any,
        operation: Any,
        error: StoreError | None = None,
    ) -> None:
        self._executor = runtime._db
        self._operation: Any = operation
        self._error = error or StoreError("database is locked (for a test)")
        self.sent, self.go = trio.Event(), trio.Event()
        runtime._db = self

    def __getattr__(self, name: str) -> Any:
        return getattr(self._executor, name)

    async def run(self, operation: Any, *args: Any) -> Any:
        if operation is self._operation:
            self._operation = None
            self.sent.set()
            await self.go.wait()
            raise self._error
        return await self._executor.run(operation, *args)


async def _run_joining_an_acquisition_that_fails(
    store: Store, clock: Clock, error: StoreError | None = None
) -> list[BaseException]:
    """A paused session's durable wake; `resume` rings it and a busy period acquires; a
    `run()` joins that acquisition in flight, which then fails with `error` (`FailsOnce`).
    The wake durable before is drained after all (once, checked here); returns what the
    run raised."""
    drain = Recorder()
    raised: list[BaseException] = []

    async def run_and_catch(rt: Any) -> None:
        try:
            await rt.run("s")
        except StoreError as exc:
            raised.append(exc)

    async with runtime(store, drain, clock) as rt:
        await rt.pause("s")
        await rt.wake("s")  # durable, no claim: the session is paused
        failing = FailsOnce(rt, _store.acquire, error)
        await rt.resume("s")  # rings: a busy period acquires
        await failing.sent.wait()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_and_catch, rt)  # joins the acquisition in flight
            await trio.testing.wait_all_tasks_blocked()
            failing.go.set()
        await drain.entered.wait()  # the durable wake is taken after all
        await rt.wait_idle("s")
    assert len(drain.calls) == 1
    return raised


async def test_a_run_joining_an_acquisition_that_fails_raises_its_store_error(
    store: Store, clock: Clock, autojump_clock: MockClock
) -> None:
    """`run()` joined an acquisition (here started by `resume`) whose transaction failed
    with a store error: no drain ran, and the acquisition was to record the run's wake
    too. It was told `failed` with the store's error, as if a drain had failed (an audit's
    find); then `deferred` - yet no wake of its was recorded (a review's). It raises the
    `StoreError` now, as a run whose own wake could not be recorded does; the wake that
    was durable before is still drained."""
    raised = await _run_joining_an_acquisition_that_fails(store, clock)
    assert [type(exc) for exc in raised] == [StoreError]
    assert "the wake could not be recorded" in str(raised[0])


async def test_a_run_joining_an_acquisition_whose_outcome_is_unknown_raises_outcome_unknown(
    store: Store, clock: Clock, autojump_clock: MockClock
) -> None:
    """As above, the acquisition's COMMIT reply lost (`OutcomeUnknown`): whether it landed -
    its claim, which would serve the joined run - is unknown, and the run is told so with
    `OutcomeUnknown`, as a run whose own wake's outcome is unknown is, not a plain
    `StoreError` saying the wake was not recorded (a review's find)."""
    lost = OutcomeUnknown("a COMMIT reply lost (for a test)")
    raised = await _run_joining_an_acquisition_that_fails(store, clock, lost)
    assert [type(exc) for exc in raised] == [OutcomeUnknown]
    assert "a COMMIT reply lost" in str(raised[0])


class InterruptAfterContinue(LosableTokenExecutor):
    """The store's executor (its token a `LosableToken`): once armed, right after an
    iteration's end took the doorbell to drain again (CONTINUE), the user interrupts and
    the liveness token is lost - before the next drain call starts."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.runtime: Any = None
        self.armed = False

    async def run(self, operation: Any, *args: Any) -> Any:
        result = await self._inner.run(operation, *args)
        if operation is _store.end_iteration and self.armed:
            self.armed = False
            assert await self.runtime.interrupt("s") is True
            assert self.token is not None
            self.token.lose()
        return result


async def test_a_wake_taken_to_go_on_survives_a_stop_handed_back_with_the_token_lost(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """A wake recorded during a drain call is taken by the iteration's end to drain again;
    the user interrupts and the liveness token is lost before the next call starts. The
    claim, handed back marked cancelling, dropped that wake: no successor, no doorbell
    (found by a review). It is rung again with the mark (§6.7), as the normal cleanup's
    mark does: once recovery finished the claim, one successor drains it."""
    wrapped = WrappedStore(store, InterruptAfterContinue)
    calls: list[bool] = []

    async def drain(ctx: DrainContext) -> None:
        calls.append(ctx.resumed)
        if len(calls) == 1:
            await rt.wake("s")  # recorded during the call: the end takes it
            assert wrapped.executor is not None
            wrapped.executor.armed = True

    async with runtime(wrapped, drain, clock) as rt:
        assert wrapped.executor is not None and wrapped.executor.token is not None
        wrapped.executor.runtime = rt
        await rt.wake("s")
        await wrapped.executor.token.retaken.wait()
        await rt.wait_idle("s")
        await trio.testing.wait_all_tasks_blocked()
        await rt.recover_once()
        await rt.wait_idle("s")
    assert calls == [False, False]


async def test_an_accepted_interrupt_survives_a_token_loss_while_its_drain_exits(
    store: Store, clock: Clock, autojump_clock: MockClock
) -> None:
    """A user interrupt accepted (True), then the liveness token is lost (PostgreSQL: its
    connection broke) while the interrupted drain still exits: the claim is handed back
    once the drain exited, as DESIGN §4 asks - but still as a stopped claim, so the work
    is finished as interrupted, never resumed (recovery "never resume[s]" a cancellation,
    §4). Observed: it is handed back 'running' and this very runtime resumes it."""
    wrapped = WrappedStore(store, LosableTokenExecutor)
    entered, may_exit = trio.Event(), trio.Event()
    calls: list[bool] = []

    async def drain(ctx: DrainContext) -> None:
        calls.append(ctx.resumed)
        if ctx.resumed:
            return
        entered.set()
        try:
            await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True):  # a cleanup that takes a moment
                await may_exit.wait()

    async with runtime(wrapped, drain, clock) as rt:
        assert wrapped.executor is not None and wrapped.executor.token is not None
        token = wrapped.executor.token
        await rt.wake("s")
        await entered.wait()
        assert await rt.interrupt("s") is True  # the user pressed Stop
        token.lose()
        await token.retaken.wait()
        may_exit.set()
        await rt.wait_idle("s")
        await trio.testing.wait_all_tasks_blocked()
        await rt.recover_once()
        await rt.wait_idle("s")
    assert calls == [False], f"the interrupted work was resumed: {calls}"


class CleanupRaises:
    """A drain whose first call takes its inputs only if told, starts a reply, and then
    waits until cancelled - and its cleanup raises (a resource whose close fails when
    cancelled, an `ExceptionGroup` from a nursery): the exception replaces trio's
    `Cancelled`. Later calls take their inputs and return."""

    def __init__(self, *, take_first: bool) -> None:
        self.take_first = take_first
        self.calls: list[tuple[bool, list[str]]] = []
        self.entered = trio.Event()

    async def __call__(self, ctx: DrainContext) -> None:
        if self.calls:
            self.calls.append((ctx.resumed, [i.id for i in await ctx.take_inputs()]))
            return
        taken = [i.id for i in await ctx.take_inputs()] if self.take_first else []
        self.calls.append((ctx.resumed, taken))
        reply = await ctx.begin_assistant()
        await reply.append_text("thinking")
        self.entered.set()
        try:
            await trio.sleep_forever()
        finally:
            raise RuntimeError("closing the model stream failed")


async def test_an_interrupt_whose_drain_cleanup_raises_strands_no_input(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """§4 interrupt / §6.16: the claim took the doorbell for i1, its drain had not taken i1
    yet, and the user interrupts (accepted: True). The drain's cleanup raises while it is
    cancelled, so the busy period ends as *failed* (`finish_failed`: no doorbell re-armed)
    instead of interrupted: i1 stays pending with no doorbell and no claim - stranded, never
    answered (not by recovery either) until some other wake. Expected: as for any interrupt,
    the doorbell is re-armed for the untaken input and one successor takes it."""
    drain = CleanupRaises(take_first=False)
    raw = Raw(db_path)
    async with runtime(store, drain, clock, recovery_interval=5) as rt:
        await rt.submit("s", {"n": 1}, input_id="i1")
        await drain.entered.wait()
        assert await rt.interrupt("s")
        await rt.wait_idle("s")
        await rt.recover_once()
        await rt.wait_idle("s")
        pending = raw.rows("SELECT id FROM session_input")
        doorbell = raw.one("SELECT time_woken FROM session WHERE id = 's'")[0]
    assert pending == [] or doorbell is not None, "i1 stranded: pending, no doorbell, no claim"
    assert drain.calls == [(False, []), (False, ["i1"])]


async def test_a_shutdown_whose_drain_cleanup_raises_still_hands_the_claim_back(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """§4 Shutdown: the runtime closes (a worker's SIGTERM, a rolling restart) while a drain
    answers. The drain's cleanup raises while it is cancelled, and the busy period ends as
    *failed*: the claim is deleted and the half-written answer finished "failed:
    RuntimeError" - never handed back, never resumed by the next runtime, so a routine
    restart abandons the answer for good. Expected: the claim handed back (phase running,
    expired) and resumed once by the next runtime."""
    drain = CleanupRaises(take_first=True)
    raw = Raw(db_path)
    async with runtime(store, drain, clock) as rt:
        await rt.submit("s", {"n": 1}, input_id="i1")
        await drain.entered.wait()
    claim = raw.claim("s")
    async with runtime(store, drain, clock) as again:
        await again.wait_idle("s")
        messages = await again.transcript("s")
    assert claim is not None and claim[2] == "running", "the claim was not handed back"
    reply = messages[1].data
    assert isinstance(reply, AssistantData)
    assert reply.error != "failed: RuntimeError"
    assert [resumed for resumed, _ in drain.calls] == [False, True]


async def test_on_busy_interrupt_with_a_drain_cleanup_that_raises_finishes_it_interrupted(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """§5.1 on_busy="interrupt": "the running drain stops at once (its open message finished
    "interrupted", as for interrupt())". With a drain whose cleanup raises when cancelled,
    the reply the user cut off reads "failed: RuntimeError" (and the run's outcome is
    `failed`), as if the agent had crashed. Expected: "interrupted"."""
    drain = CleanupRaises(take_first=True)
    async with runtime(store, drain, clock) as rt, trio.open_nursery() as nursery:
        await rt.submit("s", {"n": 1}, input_id="i1")
        await drain.entered.wait()
        outcomes = start_run(nursery, rt, "s")
        await trio.testing.wait_all_tasks_blocked()
        await rt.submit("s", {"n": 2}, input_id="i2", on_busy="interrupt")
        await rt.wait_idle("s")
        messages = await rt.transcript("s")
    reply = messages[1].data
    assert isinstance(reply, AssistantData)
    assert (reply.finished, reply.error) == (True, "interrupted")
    assert [o.kind for o in outcomes] == ["interrupted"]
    assert drain.calls == [(False, ["i1"]), (False, ["i2"])]
