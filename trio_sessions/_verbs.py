"""`Runtime`: the handle `open_runtime` yields - the verbs its callers use (submit, wake,
run, interrupt, watch, stream, conversation control, recovery), the state shared by its
collaborators, and what it keeps while open (its liveness token, the heartbeat, shutdown).

Each verb checks its arguments before anything is written, then runs its store operations;
a durable wake (submit, wake, run, resume) hands the session to the busy periods
(`_busy.BusyPeriods`), which acquire, drain and end its claims, and the background loops
(`_loops.BackgroundLoops`) bring in what other processes did.
Both collaborators keep no state of their own: the registry of sessions (`_entries`), the
flags and the executor are this object's, so there is one place to read them.

Invariants kept here (DESIGN §6): at most one registry entry per session, and a caller never
waits on the drain it runs in; a graceful shutdown cancels the drains and hands a claim back
only once its drain exited - drains of one session never overlap in time (§6.21); on the loss
of the liveness token every drain stops at once and writes nothing more, and its claims are
handed back once the drains exited and the store answers.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import attrs
import trio

from . import _codec, _observe, _store, _validate
from ._backend import Executor, Token, executor_closed
from ._busy import BusyPeriods
from ._coordinator import SessionEntry
from ._decisions import ON_BUSY
from ._drain import Drain, refuse_waiting_for_own_drain
from ._errors import OutcomeUnknown, StoreError
from ._lease import LeaseKeeper
from ._liveness import GoneOwners
from ._loops import BackgroundLoops
from ._model import Message, Outcome, RecoveryReport, RuntimeStatistics
from ._recovery import Recovery
from ._schedule import DueTimer
from ._signals import Watcher, WatchHub
from ._store.stream import Position
from ._stream import EventStream, StreamHub, decode_cursor
from ._validate import validate_session_id

if TYPE_CHECKING:
    from ._runtime import _Config

# Sessions examined per purge transaction: short transactions, never blocking a drain.
PURGE_BATCH = 200


@attrs.define(eq=False)
class Seams:
    """Test seams (see `trio_sessions.testing`): awaited at named steps when set."""

    before_finish: Callable[[str], Awaitable[None]] | None = None
    after_finish: Callable[[str], Awaitable[None]] | None = None
    before_recovery_apply: Callable[[list[str]], Awaitable[None]] | None = None


class Runtime:
    """Handle returned by `open_runtime`. Create it only through `open_runtime`.

    Conventions of its coroutines (each docstring says what differs):

    * *Durable when it returns* means committed: on SQLite with `synchronous="NORMAL"` (the
      default) a commit survives a process crash but may roll back after a power loss or an
      OS crash, with `"FULL"` it survives both; on PostgreSQL it follows the server's
      `synchronous_commit`.
    * *Cancellation* of a call that writes: cancelled while its transaction is still queued,
      nothing is written and `trio.Cancelled` propagates; once the transaction has started,
      the call waits for it, returns its result as usual, and the cancellation arrives at the
      caller's next checkpoint - so a write that committed is never reported as undone.
    * *Raises*: `TypeError`/`ValueError` for a bad argument, before anything is written;
      `StoreError` when the store failed beyond the backend's retries (never for a race
      between owners; nothing of that call was written, except on PostgreSQL after a
      COMMIT whose outcome stayed unknown, which the runtime never treats as its own);
      `RuntimeError`, before anything is written, when awaited in another trio run than the
      one that opened the runtime (from another thread, use `trio.from_thread.run`).
    """

    def __init__(
        self, *, executor: Executor, nursery: trio.Nursery, drain: Drain | None, config: _Config
    ) -> None:
        # Claims and their busy periods (working on this object's state: it keeps only the
        # hand-back being gathered and when a look last found the token whole).
        self._busy = BusyPeriods(self)
        # What reaches this runtime from outside a local call (the same: it keeps no state).
        self._loops = BackgroundLoops(self)
        self._db = executor
        self._nursery = nursery
        # The run that opened it: the only one its verbs may be awaited in (`_check_run`).
        self._trio_token = trio.lowlevel.current_trio_token()
        self._drain = drain
        self._owner_id = config.owner_id
        self._lease_ms = int(config.lease * 1000)
        self._heartbeat_interval = config.heartbeat_interval
        self._recovery_interval = config.recovery_interval
        self._lease = config.lease
        self._lease_keeper = LeaseKeeper(
            executor,
            self._busy.owned_entries,
            owner_id=config.owner_id,
            lease=config.lease,
            interval=config.heartbeat_interval,
        )
        # The heartbeat outlives the runtime's own cancellation: a drain that does not stop
        # when cancelled keeps its lease until it exits (§6.21). Cancelled by `open_runtime`
        # once no claim is owned any more.
        self._heartbeat_scope = trio.CancelScope(shield=True)
        # So does the watch of the liveness token, for the same drains: a token lost while
        # closing waits for them is taken again at once, or their claims would look free
        # to the others - who resume them after the grace, beside the drains still running.
        # Cancelled with the heartbeat.
        self._token_scope = trio.CancelScope(shield=True)
        self._shutdown_grace = config.shutdown_grace
        self._hook = config.acquisition_hook
        self._entries: dict[str, SessionEntry] = {}
        # Doorbells the change scan passes over for now (`BackgroundLoops.pass_over`), each
        # until when at most (trio clock).
        self._passed_over: dict[str, float] = {}
        self._recovery = Recovery(
            executor,
            owner_id=config.owner_id,
            lease_ms=self._lease_ms,
            batch=config.recovery_batch,
            max_resumes=config.max_resumes,
        )
        self._closing = False
        # A recovery takeover in flight (`_loops.apply_recovery`): the close cancels it.
        self._takeover: trio.CancelScope | None = None
        self._closed = False  # its `open_runtime` block exited
        self._crashed_event = trio.Event()  # `testing.crash`: it writes nothing more
        self._seams = Seams()
        self._drains_running = 0
        self._remote_signals = 0
        self._max_active = config.max_active
        self._watchers = WatchHub()
        self._streams = StreamHub()
        # Set to look at the store now rather than at the next change signal.
        self._kick = trio.Event()
        # Set to run a recovery pass now rather than at the next recovery interval (a
        # claim handed back elsewhere waits for its takeover).
        self._recover_now = trio.Event()
        # Owner liveness (DESIGN §4): other owners' tokens as seen, and whether ours is
        # lost now (between a loss and its re-take, with the claims taken meanwhile).
        self._gone_owners = GoneOwners(config.takeover_grace)
        self._token: Token | None = None  # held while this runtime drains
        self._token_lost = False
        self._lost_claims: dict[str, SessionEntry] = {}
        # The earliest due time of a scheduled input (runtimes that drain run it).
        self._due = DueTimer()

    # -- public API ---------------------------------------------------------------------------

    @property
    def owner_id(self) -> str:
        """name + host + pid + nonce, unique to this runtime instance."""
        return self._owner_id

    async def submit(
        self,
        session_id: str,
        payload: dict[str, Any],
        *,
        input_id: str | None = None,
        on_busy: str = "queue",
        delay: float | None = None,
        truncate_after: int | None = None,
    ) -> str:
        """Store an input and wake the session; returns the input id.

        Durable when it returns: the input and the wake are committed in one transaction, and
        the drain starts at once - here if this runtime drains and has room (`max_active`),
        else in any runtime on the store.

        `on_busy` says what an input does to a busy session (a claim exists, or due inputs
        wait untaken): `"queue"` (default) stores it for the next drain iteration;
        `"interrupt"` stores it and, in the same transaction, marks a running claim
        `cancelling` and signals it - the drain stops at once (its open message finished
        `"interrupted"`) and exactly one successor takes this input and every other pending
        one; `"reject"` raises `SessionBusy` and stores nothing (a retry of an input already
        stored returns its id).

        `delay` (seconds) schedules the input: stored now, invisible to `take_inputs()` until
        that much time has passed by the store's lease clock (the server's on PostgreSQL),
        then it wakes the session by itself - in any runtime on the store that drains, also
        after restarts. A session whose only inputs are scheduled is not busy. `0`/`None`:
        due now.

        `truncate_after` (a seq) edits and regenerates in the same transaction: the
        session's messages with a higher seq are deleted (as `truncate`) and the input
        stored - all or nothing. Everything that refuses the edit is checked before
        anything is deleted: a retry of this input id returns it and deletes nothing, an
        `InputConflict`, and `SessionBusy` unless the session is idle - while a claim is
        held or due inputs wait, whatever `on_busy` (inputs that came after the edited
        message, answered before the edit, would reorder the conversation). Not with a
        `delay` or `"interrupt"` (`ValueError`).

        Idempotent by `input_id` (also after the input was taken): a retry with the same id
        and payload stores nothing new and returns the id. Raises `InputConflict` when the
        id belongs to another session or to a different payload; `SessionBusy` (above);
        `TypeError`/`ValueError` for a bad session id, a payload that is not a JSON object or
        is over 1 MiB, a bad `input_id`, a NUL character in any of them (PostgreSQL cannot
        store one, so no backend does), an unknown `on_busy`, a negative or non-finite
        `delay`, or `"interrupt"` with a delay (an interrupt cannot wait); `StoreError`.
        Cancellation: nothing written if the transaction had not started, else the input is
        stored (and the running drain interrupted) and the call returns (see `Runtime`); a
        large payload's check runs in a worker thread and is not interrupted.
        """
        self._check_run()
        session_id = validate_session_id(session_id)
        text = await _validate.checked_json(_codec.check_json_object, payload, "payload")
        # A large payload's check ran in a worker thread: crashed meanwhile, store nothing.
        self._refuse_if_crashed()
        input_id = _validate.validate_input_id(input_id)
        if on_busy not in ON_BUSY:
            raise ValueError(f"on_busy must be one of {', '.join(ON_BUSY)}; got {on_busy!r}")
        delay_ms = _validate.delay_ms(delay)
        if delay_ms and on_busy == "interrupt":
            raise ValueError('on_busy="interrupt" needs an input due now (delay=None)')
        if truncate_after is not None:
            after_seq = _validate.count(truncate_after, "truncate_after", 0)
            if delay_ms or on_busy == "interrupt":
                raise ValueError(
                    "truncate_after edits an idle session now: no delay, and on_busy"
                    f' "queue" or "reject" (got delay={delay!r}, on_busy={on_busy!r})'
                )
            return await self._submit_truncating(session_id, text, input_id, after_seq)
        if delay_ms:
            stored = await self._db.run(
                _store.submit_scheduled, session_id, text, input_id, delay_ms, on_busy
            )
            self._due.arm(delay_ms)
            return stored
        if on_busy == "queue":
            stored, _ = await self._busy.signal(
                session_id, (_store.submit, _store.submit_and_acquire), session_id, text, input_id
            )
            return str(stored)
        (stored, marked), _ = await self._busy.signal(
            session_id,
            (_store.submit_controlled, _store.submit_controlled_and_acquire),
            session_id,
            text,
            input_id,
            on_busy,
        )
        if (entry := self._local_claim(session_id, marked)) is not None:
            # The claim it marked cancelling is ours (owned, or its acquisition's reply
            # still on its way): stop it at once, as `interrupt()`; its cleanup re-arms the
            # doorbell for the successor. Any other local entry - a successor that took
            # this input, an acquisition that found another owner's claim - runs on.
            entry.interrupt("user")
        elif marked is not None:
            self._recover_soon_if_stopped_after_expiry()
        return str(stored)

    async def _submit_truncating(
        self, session_id: str, text: str, input_id: str, after_seq: int
    ) -> str:
        try:
            stored = await self._db.run(
                _store.submit_truncating, session_id, text, input_id, after_seq
            )
        finally:  # also when its reply was lost after the commit (`OutcomeUnknown`)
            self._loops.changed_here(session_id)
        self._busy.ring(session_id)
        return str(stored)

    @property
    def _crashed(self) -> bool:
        return self._crashed_event.is_set()

    def _check_run(self) -> None:
        """`RuntimeError` unless called in the trio run that opened the runtime: its nursery,
        executor and events belong to that run, and a verb awaited in another (a worker
        thread's `trio.run`) would commit, then start its drain there and break both runs.
        Every async verb calls it first, before anything is written (one lookup, ~0.1 µs)."""
        if trio.lowlevel.current_trio_token() is not self._trio_token:
            raise RuntimeError(
                "a Runtime is used only in the trio run that opened it; this call comes from"
                " another trio.run (another thread?): use trio.from_thread.run to call it"
            )
        self._refuse_if_crashed()

    def _refuse_if_crashed(self) -> None:
        """`StoreError` after `testing.crash`: as a killed process's, nothing more is
        written - also by a verb of many transactions whose reply came after the crash."""
        if self._crashed:
            raise StoreError("the runtime crashed (testing.crash): it writes nothing more")

    def _local_claim(self, session_id: str, execution_id: str | None) -> SessionEntry | None:
        """The local entry of the claim a store operation named, if it is this runtime's."""
        entry = self._entries.get(session_id)
        if entry is None or execution_id is None or entry.execution_id != execution_id:
            return None
        return entry

    async def wake(self, session_id: str) -> None:
        """Record a durable wake, then start or ring the local execution.

        Durable when it returns: the session's doorbell is set (the session row is created
        if absent). Wakes coalesce: N wakes during a drain cause one more drain iteration.
        Raises `TypeError`/`ValueError` for a bad session id, `StoreError`. Cancellation:
        as `submit` - no wake if the transaction had not started, else it is recorded.
        """
        self._check_run()
        session_id = validate_session_id(session_id)
        await self._busy.signal(session_id, (_store.wake, _store.wake_and_acquire), session_id)

    async def run(self, session_id: str) -> Outcome:
        """Wake the session and wait for the outcome of the execution that takes the wake.

        Durable before it waits: the wake is committed (or, with the session already
        running here, joined). `Outcome(kind='deferred')` when this runtime does not take
        it now - another owner holds the session, no room is left under `max_active`, the
        runtime is closing, or its liveness token is lost: the wake stays durable for the
        runtime that takes it. A drain's exception is returned in the
        outcome (`failed`, `error=`), never raised here. Raises `RuntimeError` when called
        from a drain (or a task it started) on its own session, `TypeError`/`ValueError`
        for a bad session id, `StoreError` when the wake could not be recorded
        (`OutcomeUnknown` when whether it was is unknown).
        Cancellation: cancelling this call only stops the waiting - it never cancels the
        execution, and a wake already committed stays.
        """
        self._check_run()
        session_id = validate_session_id(session_id)
        refuse_waiting_for_own_drain(self, session_id, "run")
        entry = self._entries.get(session_id)
        if entry is not None and entry.joinable():
            # Running or being acquired here: join it without forcing another iteration.
            # (Finishing or stopping: only a new wake can reach it, so record one first.)
            if not entry.owned:
                entry.needs_wake = True  # if this acquisition fails, ours is recorded
            return await entry.current.wait()
        _, execution = await self._busy.signal(
            session_id, (_store.wake, _store.wake_and_acquire), session_id
        )
        if execution is None:
            return Outcome("deferred")
        return await execution.wait()

    async def interrupt(self, session_id: str, *, reason: str = "user") -> bool:
        """Stop the session's running work; returns at acceptance, before cleanup finishes.

        Local claim (or one being acquired): its drain is cancelled at once and `True`
        returned; nothing is durable yet - the cleanup that follows within milliseconds
        marks the claim `cancelling`, finishes the open message as `interrupted` and
        releases the claim (had the process died first, recovery would resume the work).
        Claim held by another owner: durable when it returns - `phase='cancelling'` is
        committed and signalled, so the owner cancels within milliseconds and recovery
        finishes the claim (never resumes it) if the owner is dead - also once its lease ran
        out (a crashed owner's, or one a rolling restart's shutdown handed back: work that
        would otherwise resume), then at once, by the pass the mark brings. `False` when
        nothing is running, it is already stopping, or its claim is quarantined (the
        quarantine's actions decide it). Wakes recorded before or during the interrupt
        survive into exactly one successor.

        `reason="shutdown"` stops a drain as this runtime's close does: its claim is handed
        back and recovery resumes the work. Only a claim of this runtime's own can be handed
        back (another process's drain runs until its own shutdown): for a claim held
        elsewhere it writes nothing and returns `False`.

        Raises `ValueError` for a reason other than `user`/`shutdown`, `TypeError`/
        `ValueError` for a bad session id, `StoreError` (the remote case only).
        Cancellation: an interrupt accepted locally stays accepted (the call returns);
        the remote write behaves as `submit`'s.
        """
        self._check_run()
        session_id = validate_session_id(session_id)
        if reason not in ("user", "shutdown"):
            raise ValueError(f"interrupt reason must be 'user' or 'shutdown', got {reason!r}")
        entry = self._entries.get(session_id)
        if entry is not None:
            accepted = entry.interrupt(reason)  # type: ignore[arg-type]
            # Accepted is accepted: a cancellation arriving now must not hide that.
            await trio.lowlevel.cancel_shielded_checkpoint()
            return accepted
        if reason == "shutdown":
            # The remote signal can only ask for a user's stop, which would end the work
            # for good: the opposite of a hand-back.
            await trio.lowlevel.checkpoint()
            return False
        marked = await self._db.run(_store.request_cancel, session_id)
        if marked:
            self._recover_soon_if_stopped_after_expiry()
        return marked

    def _recover_soon_if_stopped_after_expiry(self) -> None:
        """Another owner's claim was just marked cancelling: if its lease had run out (a
        dead owner's, or handed back), no drain of it runs and the mark handed it back, so
        a recovery pass finishes it now. Other runtimes' change looks bring theirs; ours
        passes over our own commits, so this runtime's pass is asked for here - a pass
        that finds nothing when the claim was live, at the rate users press Stop."""
        self._recover_now.set()

    async def wait_idle(self, session_id: str) -> None:
        """Wait until this runtime holds no execution for the session, successors included.

        Never starts work and writes nothing; it does not wait for other processes' claims.
        Raises `RuntimeError` when called from a drain (or a task it started) on its own
        session, `TypeError`/`ValueError` for a bad session id. Cancellation only stops the
        waiting.
        """
        self._check_run()
        session_id = validate_session_id(session_id)
        refuse_waiting_for_own_drain(self, session_id, "wait_idle")
        entry = self._entries.get(session_id)
        if entry is None:
            await trio.lowlevel.checkpoint()
            return
        while entry is not None:
            await entry.released().wait()
            woke_others = entry.joined or self._busy.followed(session_id)
            entry = self._entries.get(session_id)
        if woke_others:
            # The tasks the busy period's end woke with us (its joiners, the session's
            # watchers) have their turn before we return; with none, waiting was the
            # checkpoint, and one more would cost a scheduler round per cycle for nothing.
            await trio.lowlevel.cancel_shielded_checkpoint()

    def statistics(self) -> RuntimeStatistics:
        """A snapshot of this runtime's counts and its store's own figures."""
        return RuntimeStatistics(
            active_sessions=len(self._entries),
            owned_claims=len(self._busy.owned_entries()),
            drains_running=self._drains_running,
            tasks=len(self._nursery.child_tasks),
            heartbeat_transactions=self._lease_keeper.transactions,
            recovery=self._recovery.totals,
            remote_signals=self._remote_signals,
            store=self._db.statistics(),
        )

    def is_active(self, session_id: str) -> bool:
        """Whether this runtime holds or is acquiring an execution for the session.

        Raises `TypeError`/`ValueError` for a bad session id."""
        return validate_session_id(session_id) in self._entries

    def active_sessions(self) -> frozenset[str]:
        """The sessions this runtime holds or is acquiring executions for, now."""
        return frozenset(self._entries)

    async def transcript(self, session_id: str) -> list[Message]:
        """The session's messages in seq order, from one consistent read snapshot.

        Writes nothing; open assistant messages are read as merged so far (every
        acknowledged append). Raises `MalformedRecord` for a row that does not decode,
        `TypeError`/`ValueError` for a bad session id, `StoreError`. Cancellation: the read
        is dropped or completes; either way nothing changes.
        """
        self._check_run()
        session_id = validate_session_id(session_id)
        return await self._db.read(_store.read_transcript, session_id)

    async def recover_once(self) -> RecoveryReport:
        """Run one bounded recovery pass now (never concurrently with another).

        Durable when it returns: every decision of the pass is committed - takeovers (their
        drains already started here), cancelled or superseded claims finished, quarantines
        recorded, exhausted budgets failed - and unclaimed doorbells have been started.
        A producer runtime (`drain=None`), or one closing, recovers nothing and reports
        nothing. Raises `StoreError` when a transaction of the pass failed (what committed
        before stands; the rows keep their recovery leases and a later pass retries them),
        and once the runtime's block exited, as every verb (the store closed with it).
        Cancellation stops the pass between transactions: each takeover commits together
        with the start of its drain (shielded), so a claim taken over is never left without
        its drain.
        """
        self._check_run()
        if self._closed:
            # Not the empty report a closing runtime gives: a caller looping until a pass
            # examines nothing would read the store as holding no work.
            raise executor_closed()
        if self._drain is None or self._closing:
            await trio.lowlevel.checkpoint()
            return RecoveryReport()
        async with self._recovery.lock:
            self._refuse_if_crashed()  # crashed while it waited for a pass in flight
            with _observe.recovery_pass(self._owner_id) as observed:
                report = await self._loops.recovery_pass()
                observed.done(report)
        self._recovery.record(report)
        return report

    async def release_quarantine(self, execution_id: str, *, resume: bool) -> None:
        """Act on a quarantined execution.

        `resume=True` clears the quarantine and recovers it at once under the normal rules
        (the budget counts); durable when it returns: the takeover is committed and its
        drain started here, or it was quarantined again and `MalformedRecord` is raised, or
        another rule ended it - with its resume budget spent it is finished as failed
        ("resume budget exhausted") and, as after any failed drain, its untaken inputs wait
        for the next wake (`resume=False` resets the budget and rings the doorbell). A
        runtime that cannot drain it here (a producer, `drain=None`; or no room left under
        `max_active`) clears the quarantine and lets go of it: the next recovery pass of
        any runtime with room examines it (as the CLI's `quarantine release --resume`).
        `resume=False` sets its malformed messages aside (raw text kept), finishes its open
        transcript as owner-lost, deletes the claim, resets the resume budget and re-arms
        the doorbell if inputs remain, in one transaction, durable when it returns; the
        drain that doorbell calls for starts here if this runtime drains and has room, else
        anywhere.

        Raises `ValueError` unless the execution is quarantined, `TypeError` for bad
        arguments, `StoreError`. Cancellation: the drop is one transaction (as `submit`);
        a resume cancelled after the quarantine was lifted - or whose takeover the
        runtime's close withdrew while it waited for another process's lock, which returns
        normally - leaves the execution under this runtime's recovery lease, and the next
        recovery pass anywhere examines it once that runs out or this runtime is gone.
        """
        self._check_run()
        execution_id = _validate.validate_id(execution_id, "execution_id")
        if not isinstance(resume, bool):
            raise TypeError(f"resume must be a bool, got {type(resume).__name__}")
        async with self._recovery.lock:
            self._refuse_if_crashed()  # crashed while it waited for a pass in flight
            if not resume:
                session_id, doorbell = await self._recovery.drop_quarantine(execution_id)
                self._loops.changed_here(session_id)  # its open messages were closed
                _observe.quarantine_released(execution_id, self._owner_id, resume=False)
                if doorbell:
                    # Our own commit is no change signal here (as `resume`): start it now.
                    self._busy.ring(session_id)
                return
            if self._drain is None:
                await self._recovery.lift_quarantine(execution_id, for_anyone=True)
                _observe.quarantine_released(execution_id, self._owner_id, resume=True)
                return
            candidate = await self._recovery.lift_quarantine(execution_id)
            _observe.quarantine_released(execution_id, self._owner_id, resume=True)
            # A dead owner's claim may still hold a live lease (quarantined once its free
            # liveness token was seen): the owners seen gone let the takeover take it now.
            gone = self._gone_owners.gone(trio.current_time())
            report = await self._loops.apply_recovery([candidate], gone)
            self._recovery.record(report)  # a takeover as a pass's: counted alike
            if report.quarantined:
                raise await self._recovery.quarantine_error(execution_id)

    # -- conversation control (DESIGN §5.1) ---------------------------------------------------

    async def cancel_input(self, input_id: str) -> bool:
        """Withdraw an input no drain has taken yet (a "Stop" pressed before pickup, a
        cancelled reminder); `True` and it is gone, durably, when it returns (its id is
        forgotten: a later `submit` with it stores a new input). `False` when it was already
        taken (it is a user message now) or is unknown; nothing is written then.

        Raises `TypeError`/`ValueError` for a bad id, `StoreError`. Cancellation: as
        `submit` - nothing withdrawn if the transaction had not started.
        """
        self._check_run()
        input_id = _validate.validate_id(input_id, "input_id")
        return await self._db.run(_store.cancel_input, input_id)

    async def pause(self, session_id: str) -> None:
        """Hold the session: it still accepts inputs, wakes and interrupts durably, but no
        drain starts on it in any runtime until `resume`. A running busy period ends at its
        next iteration boundary (the current drain call finishes normally) and leaves the
        doorbell set; recovery finishes a dead owner's claim of it as owner-lost instead of
        resuming it. Pausing an unknown session creates it, paused. Idempotent.

        Durable when it returns. Raises `TypeError`/`ValueError` for a bad session id,
        `StoreError`. Cancellation: as `submit`.
        """
        self._check_run()
        session_id = validate_session_id(session_id)
        await self._db.run(_store.pause, session_id)

    async def resume(self, session_id: str) -> None:
        """Lift a pause; when inputs or wakes are pending, ring the doorbell so exactly one
        busy period starts (here if this runtime drains and has room, else anywhere).
        Idempotent; an unknown or unpaused session is left as it is (inputs a drain chose
        not to take keep waiting for the next wake).

        Durable when it returns. Raises `TypeError`/`ValueError` for a bad session id,
        `StoreError`. Cancellation: as `submit`.
        """
        self._check_run()
        session_id = validate_session_id(session_id)
        if await self._db.run(_store.resume, session_id):
            self._busy.ring(session_id)

    async def delete_session(self, session_id: str) -> bool:
        """Erase the session: every row of it (inputs, also scheduled and set-aside ones,
        messages and their streamed text, claims, recovery rows) is removed in one
        transaction, durable when it returns; `True` when it existed.

        A running drain is interrupted: here at once, in another process or host through
        the store's signal (its claim is gone, so it stops and writes nothing). Any write
        the old drain still attempts raises `LeaseLost`. A later `submit` starts a fresh,
        empty session. Raises `TypeError`/`ValueError` for a bad session id, `StoreError`.
        Cancellation: as `submit` - nothing deleted if the transaction had not started.
        """
        self._check_run()
        session_id = validate_session_id(session_id)
        # A local claim this delete removes is not lost (`SessionEntry.deleting`), also
        # when its drain or the change scan finds it gone before the reply comes back.
        deleting = self._entries.get(session_id)
        if deleting is not None:
            deleting.deleting = True
        unknown = False
        try:
            existed, removed = await self._db.run(_store.delete_session, session_id)
        except OutcomeUnknown:
            unknown = True  # it may have landed: a loss found later may be this delete's
            raise
        finally:  # also when its reply was lost after the commit (`OutcomeUnknown`)
            self._loops.changed_here(session_id)
            if deleting is not None and not unknown:
                # Answered: the claim it removed is marked lost just below, with no
                # checkpoint between; a loss found from now on is news again - also
                # when this delete removed no claim of that entry's (a successor's,
                # an acquisition answered after it).
                deleting.deleting = False
        # The claim the delete removed, if ours (owned, or its acquisition's reply still on
        # its way): stop its drain, write nothing for it. An entry made meanwhile holds a
        # fresh session's claim, which runs on.
        if (entry := self._local_claim(session_id, removed)) is not None:
            entry.lose_claim()
        return existed

    async def purge(self, *, idle_for: float) -> int:
        """Delete every session with no claim, no pending input or wake, and no write for
        `idle_for` seconds (by the store's lease clock; a `truncate`, a `cancel_input`, a
        `resume` that lifted a pause or a dropped quarantine counts, though it leaves no
        newer message); returns how many.

        Runs in short transactions of at most `PURGE_BATCH` sessions each, so it never
        holds up a drain; each is durable when it commits. Raises `TypeError`/`ValueError`
        for a bad `idle_for` (0 to 1e9 seconds), `StoreError`. Cancellation: between
        transactions - the sessions deleted so far stay deleted.
        """
        self._check_run()
        idle_ms = math.ceil(_validate.duration(idle_for, "idle_for") * 1000)
        purged = 0
        after: str | None = ""
        while after is not None:
            self._refuse_if_crashed()  # a batch answered after the crash: no next one
            try:
                deleted, after = await self._db.run(_store.purge_batch, idle_ms, after, PURGE_BATCH)
            except OutcomeUnknown:
                self._kick.set()  # which sessions it deleted is unknown: look at them all
                raise
            for session_id in deleted:  # as after delete_session
                self._loops.changed_here(session_id)
            purged += len(deleted)
        return purged

    async def fork(
        self, session_id: str, new_session_id: str, *, through_seq: int | None = None
    ) -> None:
        """Create `new_session_id` holding copies of the session's messages with `seq <=
        through_seq` (all when `None`): same seq, role and data, with any streamed text
        merged; an unfinished assistant message is copied finished with `error=
        "interrupted"` (its running tools failed the same way). The source is untouched.

        One transaction, durable when it returns: never a half-copied transcript. Raises
        `ValueError` when `new_session_id` exists or the session does not, `MalformedRecord`
        for an open message that does not decode (nothing copied), `TypeError`/`ValueError`
        for bad arguments, `StoreError`. Cancellation: as `submit`.
        """
        self._check_run()
        session_id = validate_session_id(session_id)
        new_session_id = validate_session_id(new_session_id)
        if new_session_id == session_id:
            raise ValueError(f"cannot fork session {session_id!r} into itself")
        if through_seq is not None:
            through_seq = _validate.count(through_seq, "through_seq", 0)
        try:
            await self._db.run(_store.fork, session_id, new_session_id, through_seq)
        finally:  # also when its reply was lost after the commit (`OutcomeUnknown`)
            self._loops.changed_here(new_session_id)

    async def truncate(self, session_id: str, *, after_seq: int) -> int:
        """Delete the session's messages with `seq > after_seq`; returns how many. To edit and
        regenerate, `submit(..., truncate_after=after_seq)` deletes them and stores the
        edited text in one transaction.

        One transaction, durable when it returns: never a half-truncated transcript.
        Raises `SessionBusy` (nothing deleted) while a claim is held on the session,
        `TypeError`/`ValueError` for bad arguments, `StoreError`. Cancellation: as `submit`.
        """
        self._check_run()
        session_id = validate_session_id(session_id)
        after_seq = _validate.count(after_seq, "after_seq", 0)
        try:
            return await self._db.run(_store.truncate, session_id, after_seq)
        finally:  # also when its reply was lost after the commit (`OutcomeUnknown`)
            self._loops.changed_here(session_id)

    # -- signals between processes ------------------------------------------------------------

    @asynccontextmanager
    async def watch(self, session_id: str, *, after_seq: int = 0) -> AsyncIterator[Watcher]:
        """Follow a session's transcript: first every stored message with `seq > after_seq`,
        then a snapshot of each message whenever it is created or changed, by this runtime
        or any other process on the store, until the block exits or the runtime closes.

        Per message, snapshots arrive in write order; a slow watcher may skip intermediate
        snapshots but never the latest. Every snapshot is of committed state. Writes
        nothing. A malformed row raises `MalformedRecord` in this watcher only; entering
        raises `TypeError`/`ValueError` for bad arguments and `StoreError` if the first read
        fails. Costs no task and no polling of its own; cancelling the block simply leaves
        it. This runtime's watchers and streams of a session share what they are shown (one
        snapshot for all): copy a message's dicts before editing them. An edit never reaches
        the store or the drain writing the message.
        """
        self._check_run()
        session_id = validate_session_id(session_id)
        after_seq = _validate.count(after_seq, "after_seq", 0)
        self._check_following()
        watcher = self._watchers.add(session_id, after_seq)
        try:
            await self._watchers.replay(watcher, self._db.read)
            yield watcher
        finally:
            self._watchers.remove(watcher)

    @asynccontextmanager
    async def stream(
        self, session_id: str, *, cursor: str | None = None
    ) -> AsyncIterator[EventStream]:
        """Follow a session's transcript as resumable events (`StreamEvent`, DESIGN §5.2).

        With `cursor=None`: one `"message"` event per stored message, then an event for each
        change, by this runtime or any other process on the store, until the block exits or
        the runtime closes. With the `cursor` of an event a stream yielded (in any process):
        exactly the events after that one - no gap, no duplicate - also after the message
        finished (then one `"message"` event may stand for the deltas missed). Applying the
        events in order reproduces `transcript()`. An `"append"` event carries only the
        appended text; local writes arrive without a store round trip.

        Writes nothing; costs no task and no polling of its own. Entering raises
        `ValueError` for a malformed cursor or another session's, `TypeError`/`ValueError`
        for a bad session id; iterating raises `MalformedRecord` for a row that does not
        decode (this stream only) and `StoreError` when a read fails (iterate again to
        retry). Cancelling the block simply leaves it. An event's data is shared as
        `watch()`'s snapshots are (`StreamEvent.to_json()` makes a copy).
        """
        self._check_run()
        session_id = validate_session_id(session_id)
        position = decode_cursor(session_id, cursor)
        marks = await self._stream_marks(session_id, position)
        self._check_following()
        events = self._streams.open(session_id, position, self._db.read, marks)
        try:
            yield events
        finally:
            self._streams.remove(events)

    async def _stream_marks(
        self, session_id: str, position: Position
    ) -> tuple[tuple[int, str], ...]:
        """For a stream opened at a cursor deep in a transcript: the marks its client holds
        if the stream's first read finds its newest message still stored, so a truncate
        after it sends what changed, not the transcript (`_store.stream_marks`). None for
        a short one, or when the read fails: the stream works without them."""
        if position.top < _store.MARKS_FROM:
            return ()
        with contextlib.suppress(StoreError):
            return await self._db.read(_store.stream_marks, session_id, position.top)
        return ()

    def _check_following(self) -> None:
        """A watch or stream starts only in an open runtime: closing ends those it has, and
        nothing would feed one entered later (it would wait forever). Crashed meanwhile
        (its first read answered after `testing.crash`): said so, as every verb does."""
        self._refuse_if_crashed()
        if self._closing:
            raise StoreError("the runtime is closed: no watch or stream starts now")

    # -- owner liveness -----------------------------------------------------------------------

    async def _keep_token(self, token: Token) -> None:
        """On the loss of our liveness token (its connection broke), stop every drain at
        once, writing nothing for them, and take the token again at once, beside their
        exits: while a drain of ours still runs, its claim must look held to the others,
        who take it over once the token stayed free for the grace - a drain may take longer
        than that to exit (§6.21). Each claim is handed back once its drain exited and the
        store answers. A claim taken over all the same (the token could not be taken again
        within the grace: a partition) had its drain stopped at once.

        The token taken again is watched from that moment: handing back the last loss's
        claims waits for their drains to exit and for the store, and a loss meanwhile must
        stop the drains started since at once too, so that waiting runs beside the watch.

        Shielded like the heartbeat (`_token_scope`): closing waits for drains to exit, and
        the token must stay held until they did."""
        with self._token_scope:
            await self._watch_token(token)

    async def _watch_token(self, token: Token) -> None:
        while True:
            await token.wait_lost()
            self._token_lost = True
            _observe.token_lost(self._owner_id, len(self._busy.owned_entries()))
            for entry in self._busy.owned_entries():
                self._lost_claims[entry.execution_id] = entry
                entry.lose_lease()
            self._nursery.start_soon(self._busy.hand_back_lost_claims)
            await token.retake()
            self._token_lost = False  # new claims are ours again
            _observe.token_retaken(self._owner_id)
            self._nursery.start_soon(self._settle_lost_claims)

    async def _settle_lost_claims(self) -> None:
        """After the token was taken again: hand back the claims lost with it (also any
        committed while it was retaken), then resume them, here or anywhere."""
        await self._busy.hand_back_lost_claims()
        with contextlib.suppress(StoreError):  # else the next pass takes them
            await self.recover_once()

    # -- lifecycle ----------------------------------------------------------------------------

    async def _shutdown(self) -> None:
        """Cancel the drains, wait until each has exited, and only then hand its claim back
        (each busy period does that as its drain exits: `_expire`). Drains of one session
        never overlap in time, graceful restarts included (§6.21).

        A drain still running after `shutdown_grace` (a blocking call in a thread, a
        shielded `finally`) keeps its claim and its heartbeat until it exits or its lease
        self-fences; a claim is never handed back while its drain runs. A claim acquisition
        in flight is shielded; the close lifts the shield of one whose doorbell is durable,
        so if it has not begun (waiting for another process's lock) it is withdrawn unrun,
        its doorbell left rung. One that began, a run's wake recorded with its acquire, or
        one a user's interrupt was accepted for (owed to the claim's holder), is waited
        for; the log past the grace counts drains and acquisitions apart. A failed drain's
        finish still waiting for such a lock is withdrawn as well, its claim left durably
        for recovery (as after a store error at close) - unless its user stopped the
        session meanwhile: that stop finishes its own cleanup.
        """
        self._closing = True
        # A claim already stopping for a user interrupt finishes its own cleanup (handing
        # it back would let recovery resume the work).
        for entry in list(self._entries.values()):
            entry.interrupt("shutdown")
            # An acquisition not yet begun is withdrawn (its doorbell stays rung), not
            # waited for: it may wait up to LOCK_PATIENCE_S for another process's lock.
            entry.withdraw_acquisition()
            entry.withdraw_failed_finish()  # the same wait, on a failed drain's finish
        if self._takeover is not None:
            # And on a recovery takeover not yet begun: its entries are released unclaimed.
            self._takeover.cancel()
        with trio.move_on_after(self._shutdown_grace):
            await self._all_released()
        if self._entries:
            _observe.drains_outlive_grace(self._owner_id, list(self._entries.values()))
            await self._all_released()

    async def _all_released(self) -> None:
        while self._entries:
            await next(iter(self._entries.values())).released().wait()

    async def _keep_leases(self) -> None:
        with self._heartbeat_scope:
            await self._lease_keeper.run()
