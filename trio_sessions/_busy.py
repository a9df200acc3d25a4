"""The claims this runtime holds and their busy periods: the claim handoff, the drain loop,
the finalizer, and the local registry of sessions (DESIGN §6).

A busy period is one task of the runtime's nursery: it acquires a claim (or takes over one
recovery resumed), runs drain iterations while the doorbell rings, then acts on how the
claim ended, and starts its successor claim when one is due. Its shielded scope covers only
the claim commit, the local registration flip and the finalizer installation; the drain,
heartbeats, reads and cleanup stay cancellable.

Invariants kept here: one live owner per session; a claim committed while an interrupt is
pending is cleaned (user) or retained with an expired lease (shutdown) and its drain never
starts; wakes recorded when an interrupt begins survive into exactly one successor; nothing
is written for a claim after its lease is lost; a claim is never handed back while its drain
runs; one terminal outcome per busy period and every registry entry released. How a claim
ended is decided once, by `_decisions.decide_ending`; this module only carries it out.

The registry, the flags and the executor are the `Runtime`'s (so a test that swaps
`runtime._db` reaches every write here too); `BusyPeriods` keeps only the hand-back being
gathered and when a look last found the token whole.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, NoReturn, TypeVar

import attrs
import trio

from . import _liveness, _observe, _store
from ._coordinator import Execution, SessionEntry
from ._decisions import (
    AcquireVerdict,
    EndingCause,
    EndingPlan,
    EndingWrite,
    IterationVerdict,
    Successor,
    decide_ending,
)
from ._drain import DrainContext, current_drain
from ._errors import LeaseLost, MalformedRecord, OutcomeUnknown, StaleContext, StoreError
from ._lease import self_fence_deadline
from ._model import Claim, Outcome

if TYPE_CHECKING:
    from ._backend import Token
    from ._verbs import Runtime

T = TypeVar("T")

# A hand-back (expiring a lease on purpose) is best effort: past this bound, or when another
# process holds the write lock, the lease simply runs out instead.
HAND_BACK_TIMEOUT = 5.0
# Schedule points a drain about to start gives the token's watch when the token looks lost:
# the watch becomes runnable at the next I/O poll, and runs before or after this task in
# that round, so two suffice; a few more cost nothing on a path this rare.
TOKEN_WATCH_TURNS = 4


@attrs.define(eq=False)
class _HandBack:
    """Claims handed back together (`BusyPeriods._expire`): the first one's task sends
    them, the others wait for `done`."""

    entries: list[SessionEntry] = attrs.Factory(list)
    done: trio.Event = attrs.Factory(trio.Event)

    def claims(self) -> list[str]:
        return [entry.execution_id for entry in self.entries]


@attrs.frozen
class _Ending:
    """How one claim's drain section ended, before the finalizer acted on it."""

    kind: Literal["not_claimed", "claim_failed", "released", "failed", "interrupted"]
    error: BaseException | None = None
    # Released because its claim was marked cancelling while a wake waits: a successor
    # takes it (the interrupted busy period starts no iteration of its own).
    handed_over: bool = False
    # The store did not say whether the iteration's end landed (a PostgreSQL COMMIT whose
    # reply was lost past the engine's bound): treated as a lost lease - nothing more is
    # written, the lease runs out and recovery takes the claim over.
    uncertain: bool = False
    # The drain returned, and its iteration's end could not close an open message (a row
    # another tool broke, `MalformedRecord`): the claim is kept for quarantine - the
    # drain did not fail, and the log says which (`_observe.claim_kept_malformed`).
    finish_refused: bool = False


@attrs.define(eq=False)
class _Retried:
    """One ending's writes retried (`BusyPeriods._retrying`): whether `claim ending
    retried` was said - once per ending, also an interrupt's, which is two writes - and
    whether an attempt's outcome was unknown (it may have committed: a retry that finds
    the claim gone may be finding its own work)."""

    said: bool = False
    unknown: bool = False


# Frozen, so one instance serves every claim that ends this way (most end so): no
# allocation per busy period.
_RELEASED = _Ending("released")
_HANDED_OVER = _Ending("released", handed_over=True)
_NOT_CLAIMED = _Ending("not_claimed")
_INTERRUPTED = _Ending("interrupted")
_SUCCEEDED = Outcome("succeeded")
# The ending table's cause of each kind of ending. A claim attempt that failed is a failure
# of a claim not ours: the table writes nothing (the wake stays durable; the change loop or
# a recovery pass tries again).
_CAUSES = {
    "not_claimed": EndingCause.NOT_CLAIMED,
    # No drain ran: as for a claim another owner holds (the wake stays durable; a user's
    # interrupt accepted meanwhile is passed on, to the claim if it landed after all).
    "claim_failed": EndingCause.NOT_CLAIMED,
    "released": EndingCause.RELEASED,
    "failed": EndingCause.FAILED,
    "interrupted": EndingCause.INTERRUPTED,
}
_DEFERRED = Outcome("deferred")


def _lost_lease_error(error: BaseException | None) -> bool:
    """Whether a drain's error says its claim was lost: a fenced write refused. A stale
    context's is the drain's own defect (its claim is still ours): it fails the drain."""
    return isinstance(error, LeaseLost) and not isinstance(error, StaleContext)


def _outcome(plan: EndingPlan, error: BaseException | None = None) -> Outcome:
    """The busy period's outcome a plan names (a shared instance for the common ones)."""
    if plan.reason is None and error is None:
        if plan.outcome == "succeeded":
            return _SUCCEEDED
        if plan.outcome == "deferred":
            return _DEFERRED
    return Outcome(plan.outcome, plan.reason, error)


class BusyPeriods:
    """The runtime's busy periods: how a session's claim is taken, drained and ended."""

    def __init__(self, runtime: Runtime) -> None:
        self._runtime = runtime
        self._hand_back: _HandBack | None = None  # claims joining the next hand-back
        # When a look last found the runtime's token whole: on trio's clock, and on one that
        # counts a suspended host's time (`_liveness.since_boot`).
        self._token_whole_at = (-math.inf, -math.inf)

    # -- local registry -----------------------------------------------------------------------

    async def signal(
        self, session_id: str, ops: tuple[Callable[..., Any], Callable[..., Any]], *args: Any
    ) -> tuple[Any, Execution | None]:
        """Run a durable wake (`ops[0]`), then ring the local execution that will take it.

        For a session idle here, the prospective exact claim is registered before any I/O
        and the acquire joins the wake's transaction: one transaction instead of two. The
        executor never abandons a transaction it started, so once it returns, the claim
        commit, the registration flip and the finalizer installation (handing the owned
        entry to its task) happen with no checkpoint between them; if the caller is
        cancelled before the transaction starts, nothing was written and the prospective
        registration is dropped.
        """
        runtime = self._runtime
        wake_only, wake_and_acquire = ops
        if (
            session_id in runtime._entries
            or runtime._closing
            or runtime._drain is None
            or not self._has_capacity()
        ):
            result = await runtime._db.run(wake_only, *args)
            return result, self.ring(session_id)
        sent_at = trio.current_time()
        entry = self.register(session_id, sent_at=sent_at)
        entry.begin_deciding()
        entry.woken_at = sent_at
        try:
            # mypy cannot check `*args` of a Callable[..., Any] against a TypeVarTuple.
            result, acquired = await runtime._db.run(
                wake_and_acquire,  # type: ignore[arg-type]
                *args,
                entry.execution_id,
                runtime._owner_id,
                runtime._lease_ms,
            )
            left = self._left_schedule_point()
        except BaseException:
            self.settle_unclaimed(entry)
            raise
        execution = entry.current  # joiners follow a successor if one starts from it
        if acquired.verdict is not AcquireVerdict.CLAIM:
            self.settle_unclaimed(entry)
        else:
            self.own(entry, attempt=acquired.attempt, resumed=False, sent_at=sent_at)
            entry.keep_going()
            if runtime._closing:
                # Committed while the runtime closes (its nursery may be gone): never start
                # a drain now. The claim goes back for recovery - marked cancelling if a
                # user's interrupt was accepted meanwhile (that reason stays).
                entry.interrupt("shutdown")
                self._release(entry, await self._stop_owned(entry))
            else:
                runtime._nursery.start_soon(self.busy_period, entry)
        # The schedule point the transaction left to its caller (`caller_yields_next`),
        # taken once the busy period started: one scheduler round then runs both the
        # caller and the new drain. (Inline, as at each such point: a helper coroutine would
        # cost a coroutine object per operation, on the path every submit takes.)
        if left:
            await trio.lowlevel.cancel_shielded_checkpoint()
        return result, execution

    def _left_schedule_point(self) -> bool:
        """Whether the store operation that just returned (`caller_yields_next`) left its
        schedule point to us: read before any checkpoint. Executors that never skip one
        (the thread hand-off, the deterministic test stores) have no such flag."""
        return bool(getattr(self._runtime._db, "left_schedule_point", False))

    def settle_unclaimed(self, entry: SessionEntry) -> None:
        """A prospective acquisition that did not claim (held elsewhere, withdrawn, failed,
        or a recovery placeholder that did not take over).

        A user interrupt accepted meanwhile is passed on to the holder; a ring since it
        decided, or a joined run's wake, gets a fresh acquisition - or, with none to start
        (the runtime closing, a shutdown interrupt), that wake is recorded here; otherwise:
        deferred. After `testing.crash` nothing is written or started.
        """
        runtime = self._runtime
        entry.deciding = False
        plan = decide_ending(
            EndingCause.NOT_CLAIMED, reason=entry.reason, owned=False, claim_gone=entry.claim_gone
        )
        if runtime._crashed:
            # A killed process (`testing.crash`): nothing more is written, and nothing starts
            # in its nursery (closed once its tasks ended).
            self._release(entry, _outcome(plan))
        elif plan.write is EndingWrite.PASS_ON_INTERRUPT:
            runtime._nursery.start_soon(self._pass_on_then_release, entry)
        elif (
            plan.successor is Successor.IF_RUNG
            and (entry.rung_since_decision() or entry.needs_wake)
            and not runtime._closing
        ):
            entry.start_successor(_store.new_id())
            runtime._nursery.start_soon(self.busy_period, entry)
        elif entry.needs_wake and plan.outcome == "deferred":
            # A run joined it in flight, and no successor records that run's wake (the
            # runtime closing): recorded first, as `_one_claim` does (`_record_joined_wake`).
            runtime._nursery.start_soon(self._record_joined_wake_then_release, entry)
        else:
            self._release(entry, _outcome(plan))

    def abandon(self, entry: SessionEntry) -> None:
        """A crashed runtime's claim (`testing.crash`), answered after the crash: released
        with nothing written, the claim left as a killed process leaves it (a live lease)."""
        plan = decide_ending(EndingCause.STOPPED, reason=entry.reason, owned=False)
        self._release(entry, _outcome(plan))

    async def _record_joined_wake_then_release(self, entry: SessionEntry) -> None:
        """`settle_unclaimed`'s entry, kept registered until its joined run's wake landed
        (a close waits for it, bounded as that write is)."""
        try:
            await self._record_joined_wake(entry)
        finally:
            self._release(entry, _DEFERRED)

    async def _pass_on_then_release(self, entry: SessionEntry) -> None:
        try:
            await self._pass_on_interrupt(entry)
        finally:
            self._release(entry, Outcome("interrupted", "user"))

    def ring(self, session_id: str) -> Execution | None:
        """After a durable wake: ring the local entry, or register one and start acquiring."""
        runtime = self._runtime
        entry = runtime._entries.get(session_id)
        if entry is not None:
            return entry.ring()
        if runtime._closing or runtime._drain is None or not self._has_capacity():
            return None  # the wake stays durable for a runtime with room
        entry = self.register(session_id)
        entry.woken_at = trio.current_time()
        runtime._nursery.start_soon(self.busy_period, entry)
        return entry.current

    def followed(self, session_id: str) -> bool:
        """Whether a watcher or stream here follows the session (another process's
        transcript-only change to any other session needs no look: a worker ignores the
        tokens another worker streams)."""
        runtime = self._runtime
        return runtime._watchers.watching(session_id) or runtime._streams.watching(session_id)

    def _has_capacity(self) -> bool:
        return self.capacity_left(1) > 0

    def capacity_left(self, wanted: int) -> int:
        """How many of `wanted` more sessions this runtime may take now: none while our
        liveness token is lost (a claim made then is handed straight back; the wakes stay
        durable, and the pass after the token is taken again starts them)."""
        runtime = self._runtime
        if runtime._token_lost:
            return 0
        if runtime._max_active is None:
            return wanted
        return max(0, min(wanted, runtime._max_active - len(runtime._entries)))

    def owned_entries(self) -> list[SessionEntry]:
        return [entry for entry in self._runtime._entries.values() if entry.owned]

    def register(self, session_id: str, *, sent_at: float | None = None) -> SessionEntry:
        """The prospective exact claim, registered before any I/O; `sent_at`: when its claim
        transaction is sent, if known (its scope is made with the local deadline `own`
        gives it on success)."""
        deadline = (
            math.inf if sent_at is None else self_fence_deadline(sent_at, self._runtime._lease)
        )
        entry = SessionEntry(session_id, _store.new_id(), scope=trio.CancelScope(deadline=deadline))
        self._runtime._entries[session_id] = entry
        return entry

    def _release(self, entry: SessionEntry, outcome: Outcome) -> None:
        runtime = self._runtime
        entry.disown()
        if runtime._entries.get(entry.session_id) is entry:
            del runtime._entries[entry.session_id]
            if (
                runtime._max_active is not None
                or outcome.reason == "lease_lost"
                or entry.claim_gone
            ):
                # Room again, or a claim lost or gone (its session maybe deleted here or
                # elsewhere, and submitted to again): look for durable wakes left waiting -
                # the change scan passes over the sessions this runtime holds.
                runtime._kick.set()
            if "shutdown" in (outcome.reason, entry.reason) and not runtime._closing:
                # Handed back while we stay open (`interrupt(s, reason="shutdown")`): our
                # own pass resumes it now, as another runtime's signal would bring it - the
                # change loop passes over our own commits. Only now, as the pass skips
                # the sessions we hold. Also when it claimed nothing (its outcome
                # `deferred`): a joined run's wake recorded then waits for the same pass.
                runtime._recover_now.set()
        entry.close(outcome)

    # -- one busy period ----------------------------------------------------------------------

    async def busy_period(self, entry: SessionEntry) -> None:
        """One busy period: this claim (already owned, or acquired here) and its successors."""
        runtime = self._runtime
        outcome = _DEFERRED
        try:
            while True:
                outcome, successor_due = await self._one_claim(entry)
                if not successor_due or runtime._closing or runtime._crashed:
                    break
                entry.start_successor(_store.new_id())
        except BaseException:
            # Cancelled from outside (the runtime's scope) or an internal error: this busy
            # period was stopped, whatever an earlier iteration's outcome was.
            # The drain has exited (a cancellation only leaves it once it did).
            if runtime._crashed:
                plan = decide_ending(EndingCause.STOPPED, reason=entry.reason, owned=False)
                outcome = _outcome(plan)
            else:
                outcome = await self._stop_owned(entry)
            raise
        finally:
            self._release(entry, outcome)
        if entry.yield_owed and not entry.woke_waiters():
            # The schedule point the last finish left to us (`caller_yields_next`) is
            # skipped only when the end woke a task: runnable now, it shows the next busy
            # period of this scheduler round that it is not alone, so that one's finish
            # joins a group commit instead of committing alone (a recovery pass's resumed
            # drains end together, and nobody waits for them).
            await trio.lowlevel.cancel_shielded_checkpoint()

    async def _stop_owned(self, entry: SessionEntry) -> Outcome:
        """A busy period stopped from outside (the runtime closing) once its drain exited:
        with the claim still ours, hand it back so any owner can recover it at once - or,
        when a user's interrupt was accepted, mark it cancelling, so recovery finishes it
        and never resumes it. Shielded and bounded, as trio asks of cleanup."""
        # A user's stop stays one when a lost lease or token took over the reason since.
        reason = "user" if entry.stopped_by_user else entry.reason
        # A crashed runtime (`testing.crash`) writes nothing, as a killed process: its claim
        # stays with its live lease (a wake's acquisition answered after the crash, `signal`).
        owned = entry.owned and not self._runtime._crashed
        plan = decide_ending(EndingCause.STOPPED, reason=reason, owned=owned)
        if plan.write is EndingWrite.MARK_CANCELLING:
            with trio.move_on_after(HAND_BACK_TIMEOUT, shield=True):
                await self._mark_cancelling_nowait(entry)
        elif plan.write is EndingWrite.HAND_BACK:
            await self._expire(entry)
        return _outcome(plan)

    async def _one_claim(self, entry: SessionEntry) -> tuple[Outcome, bool]:
        """Acquire (or take over a recovered claim), drain, finalize. Returns the outcome
        and whether a successor acquisition is due."""
        ending: _Ending | None = None
        try:
            with entry.scope:
                ending = await self._claim(entry)
                if ending is None:
                    # Its own call, not one made by `_claim`: the drain's every step then
                    # resumes one coroutine fewer.
                    ending = await self._drain_loop(entry)
        except Exception as exc:  # a drain's ExceptionGroup once our Cancelled was removed
            # Not owned: the claim attempt itself failed (a store error while acquiring),
            # and no drain ran.
            ending = _Ending("failed" if entry.owned else "claim_failed", error=exc)
            if not entry.owned and not entry.signalled:
                self._runtime._loops.pass_over(entry.session_id)
        if ending is None:
            # Stopped before any claim of this acquisition: withdrawn unrun by the close
            # (`withdraw_acquisition`), it claimed nothing - no execution was interrupted.
            claimed = entry.owned or entry.disowned
            ending = _INTERRUPTED if claimed else _NOT_CLAIMED
        outcome, successor_due = await self._finalize(entry, ending)
        self._runtime._loops.changed_here(entry.session_id)  # the store closed open messages
        if ending.kind == "claim_failed" and entry.needs_wake:
            # A run joined this acquisition, which was to record its wake and failed: that
            # run raises, as a run whose own wake could not be recorded does (a successor
            # would meet the same store error, again and again).
            entry.needs_wake = False
            assert ending.error is not None
            entry.current.fail(ending.error)
        elif (
            entry.needs_wake
            and entry.reason == "shutdown"
            and not entry.owned
            and not self._runtime._crashed
        ):
            # A run joined this acquisition after it was sent, and it claimed nothing:
            # stopped for a shutdown (the runtime closing), it starts no successor - the
            # acquisition that would record that run's wake. Recorded here then, the run
            # is deferred, its wake durable for the session's holder or the next owner.
            await self._record_joined_wake(entry)
        elif not (successor_due and entry.needs_wake):  # else joiners follow the successor
            entry.current.resolve(outcome)
        return outcome, successor_due

    async def _record_joined_wake(self, entry: SessionEntry) -> None:
        """The wake of a run that joined an acquisition which claimed nothing, with no
        successor to record it (`_one_claim`): its joiners are deferred once it landed.
        Shielded and bounded, never waiting for another process's lock, as every write of
        a close: if it cannot land, they raise `StoreError`, as a run whose own wake
        could not be recorded does."""
        entry.needs_wake = False
        error: BaseException = TimeoutError("the wake timed out")
        with trio.move_on_after(HAND_BACK_TIMEOUT, shield=True):
            try:
                await self._runtime._db.run_nowait(_store.wake, entry.session_id)
            except StoreError as exc:
                error = exc
            else:
                entry.current.resolve(_DEFERRED)
                return
        entry.current.fail(error)

    async def _claim(self, entry: SessionEntry) -> _Ending | None:
        """Acquire the claim unless already owned; None once the drain may start."""
        runtime = self._runtime
        if not entry.owned:
            entry.begin_deciding()
            entry.signalled = False  # only a signal taken from now on follows its answer
            # Shielded: the claim commit, the registration flip and the finalizer
            # installation (entry.owned is what the finalizer acts on) happen together or
            # not at all; an interrupt meanwhile is honoured right after. The runtime's
            # close lifts the shield of a plain acquire (`withdraw_acquisition`, which
            # decides which): one that has not begun is then withdrawn unrun, its doorbell
            # left rung - also one whose task comes to it only once the close began (rung
            # just before). A joiner's wake, recorded with the acquire, is no doorbell yet:
            # that one stays shielded.
            with trio.CancelScope(shield=True) as shield:
                if not entry.needs_wake:
                    entry.acquisition = shield
                    if runtime._closing:
                        entry.withdraw_acquisition()
                sent_at = trio.current_time()
                if entry.needs_wake:  # a joiner's wake, recorded with the acquire
                    # Taken as it is sent: a run joining while it is in flight (its commit
                    # maybe made already, the holder's drain started since) sets it again.
                    entry.needs_wake = False
                    try:
                        _, acquired = await runtime._db.run(
                            _store.wake_and_acquire,
                            entry.session_id,
                            entry.execution_id,
                            runtime._owner_id,
                            runtime._lease_ms,
                        )
                    except BaseException:
                        entry.needs_wake = True  # not recorded: its joiners raise
                        raise
                else:
                    acquired = await runtime._db.run(
                        _store.acquire,
                        entry.session_id,
                        entry.execution_id,
                        runtime._owner_id,
                        runtime._lease_ms,
                    )
                left = self._left_schedule_point()
                if acquired.verdict is AcquireVerdict.CLAIM:
                    self.own(entry, attempt=acquired.attempt, resumed=False, sent_at=sent_at)
                entry.acquisition = None
            if acquired.verdict is not AcquireVerdict.CLAIM:
                if acquired.locked and not entry.signalled:
                    runtime._loops.pass_over(entry.session_id)
                # The schedule point the acquire left to its caller (`caller_yields_next`);
                # a claim goes on to its drain, which gives the loop up (or the task ends).
                if left:
                    await trio.lowlevel.cancel_shielded_checkpoint()
                return _NOT_CLAIMED
            entry.keep_going()
        # Neither the hook nor the drain starts for a claim past its local deadline when
        # its commit was answered, or interrupted during the handoff.
        await trio.lowlevel.checkpoint_if_cancelled()
        if runtime._hook is not None:
            await self._run_hook(entry)
            await trio.lowlevel.checkpoint_if_cancelled()  # interrupted during the hook
        return None

    async def _run_hook(self, entry: SessionEntry) -> None:
        """The test hook (`acquisition_hook`). Its error is the test's, as a test seam's is:
        raised from a task of the runtime's own, it ends the runtime's block, and this claim
        is handed back with no drain started (nothing it owes is lost: recovery resumes it)."""
        runtime = self._runtime
        assert runtime._hook is not None
        try:
            await runtime._hook(
                Claim(entry.session_id, entry.execution_id, runtime._owner_id, entry.resumed)
            )
        except Exception as exc:
            runtime._nursery.start_soon(_raise, exc)
            entry.interrupt("shutdown")

    def own(self, entry: SessionEntry, *, attempt: int, resumed: bool, sent_at: float) -> None:
        """The claim committed; its local deadline counts from before it was sent."""
        runtime = self._runtime
        deadline = self_fence_deadline(sent_at, runtime._lease)
        entry.own(attempt=attempt, resumed=resumed, deadline=deadline)
        if runtime._token_lost:
            # Committed while our liveness token is free: others may take it over, so its
            # drain never starts; `Runtime._keep_token` hands it back with the others.
            runtime._lost_claims[entry.execution_id] = entry
            entry.lose_lease()

    def _token_looks_lost(self, token: Token) -> bool:
        """Whether the drain about to start must let the token's watch run first; a look
        that found the token whole moments ago on both clocks stands (`TOKEN_LOOK_GAP`: a
        stopped process's pause shows on trio's clock, a suspended host's on the other)."""
        now = (trio.current_time(), _liveness.since_boot())
        then = self._token_whole_at
        gap = _liveness.TOKEN_LOOK_GAP
        if now[0] - then[0] < gap and now[1] - then[1] < gap:
            return False
        if token.looks_lost():
            return True
        self._token_whole_at = now
        return False

    async def _let_the_token_watch_run_first(self, token: Token) -> None:
        """Paused (in the claim's handoff, say) while the server dropped our token's
        connection, this task may run before the one that watches the token - while the
        others take the claim over once the token stayed free for the grace. Its loss is on
        the socket already: a few schedule points let the watch (`Runtime._keep_token`)
        run first, and its verdict is the one that counts - a loss cancels this claim's
        scope (the drain never starts), anything else (a notice) lets it start."""
        for _ in range(TOKEN_WATCH_TURNS):
            await trio.lowlevel.checkpoint()
            if not token.looks_lost():
                return

    async def _drain_loop(self, entry: SessionEntry) -> _Ending:
        runtime = self._runtime
        while True:
            if runtime._token is not None and self._token_looks_lost(runtime._token):
                await self._let_the_token_watch_run_first(runtime._token)
            context = DrainContext(runtime, entry)
            assert runtime._drain is not None  # producers never register an entry
            # The task (and every task the drain starts) knows which session it drains, so
            # waiting on that very session fails at once instead of waiting for itself.
            draining = current_drain.set((runtime, entry.session_id))
            runtime._drains_running += 1
            entry.wake_taken = False  # this call takes it
            woken_at, entry.woken_at = entry.woken_at, None
            try:
                with _observe.drain_iteration(entry, runtime._owner_id, woken_at) as iteration:
                    await runtime._drain(context)
                    iteration.fail(context._defect)
            except Exception as exc:
                return _Ending("failed", error=exc)
            finally:
                runtime._drains_running -= 1
                current_drain.reset(draining)
                context._returned = True
                context._let_go()
            if context._defect is not None:
                return _Ending("failed", error=context._defect)
            await self._owe_unsure_inputs(entry)
            entry.begin_deciding()
            if runtime._seams.before_finish is not None:
                await _test_seam(runtime, runtime._seams.before_finish, entry.session_id)
            try:
                verdict = await runtime._db.run(
                    _store.end_iteration, entry.session_id, entry.execution_id, runtime._owner_id
                )
                left = self._left_schedule_point()
            except LeaseLost as exc:
                return _Ending("failed", error=exc)
            except MalformedRecord as exc:
                return _Ending("failed", error=exc, finish_refused=True)
            except OutcomeUnknown as exc:
                # The end may have landed and taken the doorbell to continue: finishing the
                # claim as failed then would strand the input that rang (a failed finish
                # does not re-arm). Recovery resumes the claim whichever way it went.
                return _Ending("failed", error=exc, uncertain=True)
            runtime._loops.changed_here(entry.session_id)  # messages left open were closed
            if verdict is not IterationVerdict.CONTINUE:
                entry.disown()
                entry.yield_owed = left
                if runtime._seams.after_finish is not None:
                    await _test_seam(runtime, runtime._seams.after_finish, entry.session_id)
                return _HANDED_OVER if verdict is IterationVerdict.HAND_OVER else _RELEASED
            entry.keep_going()
            entry.wake_taken = True
            # The schedule point the finish left to us (`caller_yields_next`): a drain that
            # never awaits, woken again and again, must not starve the other tasks.
            if left:
                await trio.lowlevel.cancel_shielded_checkpoint()
            # No drain call starts for a claim stopped while its finish was answered (the
            # runtime closing, an interrupt) or answered past its local deadline (another
            # owner may hold the session by then): it ends as if that call had been stopped
            # at once - a handed-back or lost claim is resumed by recovery.
            await trio.lowlevel.checkpoint_if_cancelled()

    async def _owe_unsure_inputs(self, entry: SessionEntry) -> None:
        """A drain returned while a `take_inputs` of its execution ended with its outcome
        unknown and was not called again: what that call took, if it landed, no drain was
        given. Ring once, so the busy period goes on (unless paused or stopping) and the
        next iteration's `take_inputs` reads it back (DESIGN §8 "Uncertain commits"). A
        ring that fails leaves those inputs as user messages, as the drain left them."""
        takes = entry.takes
        if takes.unsure_from is None or takes.rang:
            return
        takes.rang = True
        with contextlib.suppress(StoreError):
            await self._runtime._db.run(_store.wake, entry.session_id)
            entry.ring()

    async def _finalize(self, entry: SessionEntry, ending: _Ending) -> tuple[Outcome, bool]:
        """The finalizer: act on how the claim ended. Cancellable (runtime closing): then
        the claim stays as it is durably and recovery finishes it."""
        runtime = self._runtime
        if runtime._crashed:
            return Outcome("interrupted", "shutdown"), False
        # The heartbeat or the token watch found it (and logged it), not its deadline.
        known_lost = entry.reason == "lease_lost" and not entry.fenced_by_deadline
        lease_lost = ending.kind in ("failed", "interrupted") and (
            _lost_lease_error(ending.error) or ending.uncertain or entry.self_fenced()
        )
        cause = _CAUSES[ending.kind]
        plan = decide_ending(
            cause,
            reason=entry.reason,
            owned=entry.owned,
            lease_lost=lease_lost,
            claim_gone=entry.claim_gone,
        )
        if plan.reason == "lease_lost":
            if not known_lost:
                self._log_claim_lost(entry, ending.error)
            entry.disown()
            successor_due = plan.successor is Successor.IF_RUNG and entry.rung_since_decision()
            return Outcome("interrupted", "lease_lost", ending.error), successor_due
        # A drain's error is in the outcome and the log, also when an interrupt ended it.
        error = ending.error if ending.kind == "failed" else None
        if ending.kind == "claim_failed":
            _observe.claim_attempt_failed(entry, runtime._owner_id, ending.error)
        elif ending.finish_refused and plan.write is not EndingWrite.FINISH_INTERRUPTED:
            # Said here, once, whatever the write below does: it may give up on a store
            # error (closing, lease lost) with the claim left as it is all the same. Not
            # before an interrupt's cleanup: that deletes the claim whatever its messages
            # hold (DESIGN §4) and says what it left open - or, refused too, that it kept it.
            assert isinstance(error, MalformedRecord)
            _observe.claim_kept_malformed(entry, runtime._owner_id, error)
        elif error is not None:
            _observe.drain_failed(entry, runtime._owner_id, error)
        refused = ending.finish_refused
        match plan.write:
            case EndingWrite.FINISH_FAILED:
                return await self._finish_failed(entry, error, refused=refused)
            case EndingWrite.FINISH_INTERRUPTED:
                return await self._finish_interrupted(entry, error)
            case EndingWrite.HAND_BACK:
                await self._expire(entry)
            case EndingWrite.PASS_ON_INTERRUPT:
                await self._pass_on_interrupt(entry)
        # A run joined after this acquisition was sent (`needs_wake`): its wake was never
        # recorded, and a holder's drain may have started before it; the successor's
        # acquisition records it, and that run's outcome is the successor's.
        rung = entry.rung_since_decision() or (ending is _NOT_CLAIMED and entry.needs_wake)
        successor_due = plan.successor is Successor.IF_RUNG and rung
        # Released by a claim marked cancelling with a wake waiting: a successor takes it.
        return _outcome(plan, error), successor_due or ending.handed_over

    def _log_claim_lost(self, entry: SessionEntry, error: BaseException | None) -> None:
        if isinstance(error, LeaseLost):
            _observe.claim_lost(entry, self._runtime._owner_id, cause="write")
        elif isinstance(error, OutcomeUnknown):
            _observe.claim_lost(entry, self._runtime._owner_id, cause="store")
        else:
            _observe.self_fenced(entry, self._runtime._owner_id)

    async def _pass_on_interrupt(self, entry: SessionEntry) -> None:
        """A user interrupt accepted while this runtime was still acquiring, and another
        owner turned out to hold the claim: mark that claim cancelling, live or expired
        (an expired one is finished by recovery as cancelled, never resumed)."""
        if entry.reason == "user":
            try:
                await self._runtime._db.run(_store.request_cancel, entry.session_id)
            except StoreError as exc:
                _observe.stop_not_recorded(entry, self._runtime._owner_id, exc)

    async def _mark_cancelling_nowait(self, entry: SessionEntry) -> None:
        """Leave a claim a user stopped to recovery, marked cancelling with its lease ended
        (its own cleanup cannot run: the runtime closes), without waiting for another
        process's lock. If even that cannot land, the claim stays 'running' and recovery
        would resume it: said in the log."""
        runtime = self._runtime
        claim = (entry.execution_id, entry.session_id, entry.wake_taken)
        try:
            await runtime._db.run_nowait(_store.cancel_own_claims, runtime._owner_id, [claim])
        except StoreError as exc:
            _observe.stop_not_recorded(entry, runtime._owner_id, exc)
        except trio.Cancelled:
            # The caller's bound ran out with the mark unrun (withdrawn while it waited for
            # another process's lock: one that ran is reported, never cancelled).
            _observe.stop_not_recorded(entry, runtime._owner_id, TimeoutError("mark timed out"))
            raise
        entry.disown()

    async def _finish_failed(
        self, entry: SessionEntry, error: BaseException | None, *, refused: bool = False
    ) -> tuple[Outcome, bool]:
        """`refused`: the iteration's end was refused by a malformed record, and that was
        logged already (`_finalize`)."""
        outcome = Outcome("failed", error=error)
        if not entry.owned:
            return outcome, False
        # The exception's type only: its text may hold secrets (an API key in a KeyError),
        # and users read the transcript. Its text and traceback are in the log (DESIGN §5.1).
        shown = "failed" if error is None else f"failed: {type(error).__name__}"
        entry.begin_deciding()
        try:
            # The runtime's close cancels it (`withdraw_failed_finish`): still waiting for
            # another process's lock, it is withdrawn unrun, not waited for up to
            # LOCK_PATIENCE_S; one that began, or one a user stopped meanwhile (that stop
            # finishes its own cleanup), is waited for, as ever.
            with trio.CancelScope() as finishing:
                entry.failed_finish = finishing
                doorbell = await self._retrying(
                    entry,
                    _store.finish_failed,
                    entry.session_id,
                    entry.execution_id,
                    self._runtime._owner_id,
                    shown,
                )
        except LeaseLost:
            # The claim is gone (its session deleted by another process before the signal
            # came, or taken over): nobody passes on a wake rung meanwhile.
            entry.claim_gone = True
            return outcome, False
        except MalformedRecord as exc:
            # A row of it is malformed (another tool's write): the claim stays durable, its
            # lease runs out and recovery quarantines it.
            if not refused:
                _observe.claim_kept_malformed(entry, self._runtime._owner_id, exc)
            return outcome, False
        except StoreError:
            # The claim stays durable; its lease runs out and recovery takes it from there.
            return outcome, False
        finally:
            entry.failed_finish = None
        if finishing.cancelled_caught:
            # Withdrawn by the close: as after a store error then, the claim stays durable.
            return outcome, False
        entry.disown()
        return outcome, doorbell or entry.rung_since_decision()

    async def _finish_interrupted(
        self, entry: SessionEntry, error: BaseException | None
    ) -> tuple[Outcome, bool]:
        """An interrupt's cleanup - also after an iteration's end a malformed record
        refused (`_finalize` said nothing of it: this cleanup deletes the claim all the
        same, and says so of each message it leaves open)."""
        outcome = Outcome("interrupted", "user", error)
        if not entry.owned:
            return outcome, entry.rung_since_decision()
        retried = _Retried()
        try:
            await self._retrying_mark_cancelling(entry, retried)
            retried.unknown = False  # the finish's own outcome is what counts below
            entry.begin_deciding()
            ended = await self._retrying(
                entry,
                _store.finish_interrupted,
                entry.session_id,
                entry.execution_id,
                self._runtime._owner_id,
                retried=retried,
            )
        except LeaseLost:
            # The claim is gone (its session deleted during this cleanup, or taken over):
            # nobody passes on a wake rung meanwhile - a fresh session's submit, whose
            # doorbell this cleanup was to answer.
            entry.claim_gone = True
            if retried.unknown:
                # Or our own finish deleted it, its outcome unknown: what it left open,
                # read back (best effort: the message stays, the log is all a failure costs).
                with contextlib.suppress(StoreError):
                    left = await self._runtime._db.read(
                        _store.messages_left_open, entry.execution_id
                    )
                    self._left_open(entry, left)
            return outcome, False
        except MalformedRecord as exc:
            # Left as 'cancelling': recovery quarantines it (a row of it malformed).
            _observe.claim_kept_malformed(entry, self._runtime._owner_id, exc)
            return outcome, False
        except StoreError:
            # Left as 'cancelling' once that write landed: recovery finishes it as
            # cancelled and never resumes it.
            return outcome, False
        self._left_open(entry, ended.left_open)
        entry.disown()
        return outcome, ended.doorbell or entry.rung_since_decision()

    def _left_open(self, entry: SessionEntry, left_open: Sequence[MalformedRecord]) -> None:
        for error in left_open:
            _observe.message_left_open(
                entry.session_id, entry.execution_id, self._runtime._owner_id, error, "interrupted"
            )

    async def _retrying_mark_cancelling(self, entry: SessionEntry, retried: _Retried) -> None:
        """An interrupt's first, durable step. A close gives up `_retrying` at the first
        store error; the mark is then tried once more without waiting for locks (shielded,
        bounded), as a stopped busy period's is: without it the claim would stay
        'running', and recovery would resume work the user stopped."""
        mark = (entry.session_id, entry.execution_id, self._runtime._owner_id)
        try:
            # A wake taken to go on that no drain call answered yet is rung again with it.
            await self._retrying(
                entry, _store.mark_cancelling, *mark, entry.wake_taken, retried=retried
            )
        except StoreError:
            if not self._runtime._closing or entry.reason == "lease_lost":
                raise  # a lost lease: no durable write
            with trio.move_on_after(HAND_BACK_TIMEOUT, shield=True):
                await self._mark_cancelling_nowait(entry)
            raise

    async def _retrying(
        self, entry: SessionEntry, op: Callable[..., T], *args: Any, retried: _Retried | None = None
    ) -> T:
        """A finalizer write, retried through store errors while the claim is still ours.

        Giving up early would release the registry entry with the claim still 'running',
        and recovery would then resume work that was meant to stop. The heartbeat keeps
        renewing the claim meanwhile; once the lease is lost (or the runtime closes), the
        last error is raised and the durable state is left for recovery. Retried for a
        heartbeat interval, it says so - once per ending (`retried`: the ending's other
        writes share it).
        """
        runtime = self._runtime
        if retried is None:
            retried = _Retried()
        pause = 0.01
        said_at = trio.current_time() + runtime._heartbeat_interval
        while True:
            try:
                return await runtime._db.run(op, *args)
            except StoreError as exc:
                retried.unknown = retried.unknown or isinstance(exc, OutcomeUnknown)
                if entry.reason == "lease_lost" or runtime._closing:
                    raise
                if not retried.said and trio.current_time() >= said_at:
                    _observe.ending_retried(entry, runtime._owner_id, exc)
                    retried.said = True
            await trio.sleep(pause)
            pause = min(pause * 2, runtime._heartbeat_interval)

    async def _expire(self, entry: SessionEntry) -> None:
        """Hand a claim back (shutdown): keep it, end its lease now so any owner can recover
        it at once. Only ever called once the claim's drain has exited (§6.21).

        The claims of the drains that exit in one scheduler round go back in one
        transaction: a close stops them all at once, and a transaction each kept the last
        of them waiting for all the others'. Shielded and bounded, as trio asks of
        cleanup, and never waiting for another process's lock: if it cannot land, the
        lease simply runs out.
        """
        if not entry.owned:
            return
        batch = self._hand_back
        if batch is None:
            batch = self._hand_back = _HandBack()
            leading = True
        else:
            leading = False
        batch.entries.append(entry)
        with trio.move_on_after(HAND_BACK_TIMEOUT, shield=True):
            if leading:
                await self._hand_back_together(batch)
            else:
                await batch.done.wait()
        entry.disown()

    async def _hand_back_together(self, batch: _HandBack) -> None:
        """Send `batch`'s hand-back once the drains exiting in this scheduler round joined
        it, and report it for all of its claims."""
        runtime = self._runtime
        error: BaseException | None = TimeoutError("hand-back timed out")
        handed = 0
        try:
            await trio.lowlevel.cancel_shielded_checkpoint()
            self._hand_back = None  # later exits make a batch of their own
            handed = await runtime._db.run_nowait(
                _store.expire_claims, runtime._owner_id, batch.claims()
            )
            error = None
        except StoreError as exc:
            error = exc
        except trio.Cancelled:
            raise  # the bound ran out
        except BaseException as exc:
            error = exc
            raise
        finally:
            if error is None:
                _observe.handed_back(runtime._owner_id, batch.claims(), handed)
            else:
                _observe.hand_back_failed(runtime._owner_id, batch.claims(), error)
            batch.done.set()

    async def hand_back_lost_claims(self) -> None:
        """Expire the claims kept while our liveness token was lost - marked cancelling
        instead when a user's interrupt of it was accepted - each once its drain exited,
        retrying until the store answers."""
        runtime = self._runtime
        pause = 0.01
        while runtime._lost_claims:
            lost = dict(runtime._lost_claims)
            for entry in lost.values():
                # A claim is never handed back while its drain runs (§6.21); a lost lease
                # ends the busy period, with no successor.
                await entry.released().wait()
            stopped = [
                (key, entry.session_id, entry.wake_taken)
                for key, entry in lost.items()
                if entry.stopped_by_user
            ]
            handed = sorted(key for key, entry in lost.items() if not entry.stopped_by_user)
            try:
                if stopped:
                    await runtime._db.run(_store.cancel_own_claims, runtime._owner_id, stopped)
                if handed:
                    await runtime._db.run(_store.expire_claims, runtime._owner_id, handed)
            except StoreError:
                await trio.sleep(pause)  # until the store answers
                pause = min(pause * 2, 1.0)
                continue
            for execution_id in lost:
                runtime._lost_claims.pop(execution_id, None)


async def _test_seam(
    runtime: Runtime, seam: Callable[[str], Awaitable[None]], session_id: str
) -> None:
    """Run a test seam (`testing.set_seams`). Its error is the test's, not the drain's (no
    `failed` outcome, no "drain failed"): raised from a task of the runtime's own, it ends
    the runtime's block as any test code's error would, and this busy period goes on as if
    the seam had returned until that cancels it."""
    try:
        await seam(session_id)
    except Exception as exc:
        runtime._nursery.start_soon(_raise, exc)


async def _raise(error: Exception) -> NoReturn:
    raise error
