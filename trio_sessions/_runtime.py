"""`open_runtime`: the claim handoff, the drain loop, heartbeats, interrupts and recovery.

Each busy session runs in one task of the runtime's nursery. Its shielded scope covers only
the claim commit, the local registration flip and the finalizer installation; the drain,
heartbeats, reads and cleanup stay cancellable. The recovery pass runs as a sibling task.

Invariants kept here (DESIGN §6): one live owner per session; a claim committed while an
interrupt is pending is cleaned (user) or retained with an expired lease (shutdown) and its
drain never starts; wakes recorded when an interrupt begins survive into exactly one
successor; nothing is written for a claim after its lease is lost; one terminal outcome per
busy period and every registry entry released.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import math
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, Literal, NoReturn, TypeVar

import attrs
import trio

from . import _codec, _observe, _store, _transcript
from ._backend import Executor, StoreBackend, Token
from ._coordinator import Execution, SessionEntry
from ._decisions import (
    ON_BUSY,
    AcquireVerdict,
    EndingCause,
    EndingWrite,
    IterationVerdict,
    RecoveryDecision,
    Successor,
    decide_ending,
)
from ._errors import DuplicateSettlement, LeaseLost, StoreError, UnknownToolCall
from ._lease import LeaseKeeper, self_fence_deadline
from ._liveness import GoneOwners
from ._model import (
    AssistantData,
    Claim,
    Input,
    Message,
    Outcome,
    RecoveryReport,
    RuntimeStatistics,
    ToolPart,
)
from ._naming import ACCEPTED_FORMS, store_kind
from ._recovery import Recovery, report_of
from ._schedule import DueTimer
from ._signals import Watcher, WatchHub
from ._sqlite import SQLiteStore
from ._stream import EventStream, Offer, StreamHub, decode_cursor

T = TypeVar("T")
Drain = Callable[["DrainContext"], Awaitable[None]]
AcquisitionHook = Callable[[Claim], Awaitable[None]]

MAX_ID_LENGTH = 200
# A hand-back (expiring a lease on purpose) is best effort: past this bound, or when another
# process holds the write lock, the lease simply runs out instead.
HAND_BACK_TIMEOUT = 5.0
# The change loop looks at the store at least this often, signal or not.
CHANGE_FALLBACK_POLL = 2.0
# Durable wakes taken per look (the rest at the next one).
CHANGE_BATCH = 100
# Sessions examined per purge transaction: short transactions, never blocking a drain.
PURGE_BATCH = 200
# The most inputs one `take_inputs()` takes by default (one short transaction and one short
# step of the event loop, whatever the backlog).
TAKE_INPUTS_CHUNK = _store.TAKE_INPUTS_CHUNK


def validate_session_id(session_id: object, *, what: str = "session id") -> str:
    """A valid id (`what` names it in the error: a session id, an owner id)."""
    if not isinstance(session_id, str):
        raise TypeError(f"{what} must be a str, got {type(session_id).__name__}")
    _codec.check_text(session_id[: MAX_ID_LENGTH + 1], what)
    if not 1 <= len(session_id) <= MAX_ID_LENGTH:
        raise ValueError(
            f"{what} must be 1-{MAX_ID_LENGTH} characters, got {len(session_id)}: "
            f"{session_id[:40]!r}"
        )
    if not session_id.isprintable():
        raise ValueError(f"{what} must be printable, got {session_id!r}")
    return session_id


def _validate_input_id(input_id: object) -> str:
    if input_id is None:
        return _store.new_id()
    if not isinstance(input_id, str):
        raise TypeError(f"input_id must be a str or None, got {type(input_id).__name__}")
    _codec.check_text(input_id[: MAX_ID_LENGTH + 1], "input_id")
    if not 1 <= len(input_id) <= MAX_ID_LENGTH or not input_id.isprintable():
        raise ValueError(f"input_id must be 1-{MAX_ID_LENGTH} printable characters: {input_id!r}")
    return input_id


def make_owner_id(name: str | None) -> str:
    """name + host + pid + a random nonce: unique per runtime instance, never reused."""
    nonce = _store.new_id()[:12]
    base = f"{socket.gethostname()}:{os.getpid()}:{nonce}"
    return base if name is None else f"{name}@{base}"


def _seconds(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{what} must be a number of seconds, got {type(value).__name__}")
    # Durable times are whole milliseconds: anything shorter would round to nothing.
    if not math.isfinite(value) or value < 0.001:
        raise ValueError(f"{what} must be at least 0.001 seconds, got {value!r}")
    return float(value)


def _count(value: object, what: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {value}")
    return value


@attrs.define(eq=False)
class Seams:
    """Test seams (see `trio_sessions.testing`): awaited at named steps when set."""

    before_finish: Callable[[str], Awaitable[None]] | None = None
    after_finish: Callable[[str], Awaitable[None]] | None = None
    before_recovery_apply: Callable[[list[str]], Awaitable[None]] | None = None


def _delay_ms(delay: object) -> int:
    """A scheduled input's delay in whole milliseconds, rounded up (never due early)."""
    if delay is None:
        return 0
    if isinstance(delay, bool) or not isinstance(delay, int | float):
        raise TypeError(f"delay must be a number of seconds or None, got {type(delay).__name__}")
    if not math.isfinite(delay) or delay < 0:
        raise ValueError(f"delay must be a finite number of seconds >= 0, got {delay!r}")
    return math.ceil(delay * 1000)


def _seq(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{what} must be >= 0, got {value}")
    return value


@attrs.frozen
class _Ending:
    """How one claim's drain section ended, before the finalizer acted on it."""

    kind: Literal["not_claimed", "claim_failed", "released", "failed", "interrupted"]
    error: BaseException | None = None
    # Released because its claim was marked cancelling while a wake waits: a successor
    # takes it (the interrupted busy period starts no iteration of its own).
    handed_over: bool = False


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
      COMMIT whose outcome stayed unknown, which the runtime never treats as its own).
    """

    def __init__(
        self, *, executor: Executor, nursery: trio.Nursery, drain: Drain | None, config: _Config
    ) -> None:
        self._db = executor
        self._nursery = nursery
        self._drain = drain
        self._owner_id = config.owner_id
        self._lease_ms = int(config.lease * 1000)
        self._heartbeat_interval = config.heartbeat_interval
        self._recovery_interval = config.recovery_interval
        self._lease = config.lease
        self._lease_keeper = LeaseKeeper(
            executor,
            self._owned_entries,
            owner_id=config.owner_id,
            lease=config.lease,
            interval=config.heartbeat_interval,
        )
        # The heartbeat outlives the runtime's own cancellation: a drain that does not stop
        # when cancelled keeps its lease until it exits (§6.21). Cancelled by `_close` once
        # no claim is owned any more.
        self._heartbeat_scope = trio.CancelScope(shield=True)
        self._shutdown_grace = config.shutdown_grace
        self._hook = config.acquisition_hook
        self._entries: dict[str, SessionEntry] = {}
        self._recovery = Recovery(
            executor,
            owner_id=config.owner_id,
            lease_ms=self._lease_ms,
            batch=config.recovery_batch,
            max_resumes=config.max_resumes,
        )
        self._closing = False
        self._crashed = False
        self._seams = Seams()
        self._drains_running = 0
        self._remote_signals = 0
        self._max_active = config.max_active
        self._watchers = WatchHub()
        self._streams = StreamHub()
        # Set to look at the store now rather than at the next change signal.
        self._kick = trio.Event()
        # Owner liveness (DESIGN §4): other owners' tokens as seen, and whether ours is
        # lost now (between a loss and its re-take, with the claims taken meanwhile).
        self._gone_owners = GoneOwners(config.takeover_grace)
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
        validate_session_id(session_id)
        text = await _checked_json(_codec.check_json_object, payload, "payload")
        input_id = _validate_input_id(input_id)
        if on_busy not in ON_BUSY:
            raise ValueError(f"on_busy must be one of {', '.join(ON_BUSY)}; got {on_busy!r}")
        delay_ms = _delay_ms(delay)
        if delay_ms and on_busy == "interrupt":
            raise ValueError('on_busy="interrupt" needs an input due now (delay=None)')
        if delay_ms:
            stored = await self._db.run(
                _store.submit_scheduled, session_id, text, input_id, delay_ms, on_busy
            )
            self._due.arm(delay_ms)
            return stored
        if on_busy == "queue":
            stored, _ = await self._signal(
                session_id, (_store.submit, _store.submit_and_acquire), session_id, text, input_id
            )
            return str(stored)
        (stored, interrupted), _ = await self._signal(
            session_id,
            (_store.submit_controlled, _store.submit_controlled_and_acquire),
            session_id,
            text,
            input_id,
            on_busy,
        )
        entry = self._entries.get(session_id)
        if interrupted and entry is not None:
            # Our own claim, or one we are acquiring: stop it at once, as `interrupt()`;
            # its cleanup re-arms the doorbell for the successor (inputs are pending).
            entry.interrupt("user")
        return str(stored)

    async def wake(self, session_id: str) -> None:
        """Record a durable wake, then start or ring the local execution.

        Durable when it returns: the session's doorbell is set (the session row is created
        if absent). Wakes coalesce: N wakes during a drain cause one more drain iteration.
        Raises `TypeError`/`ValueError` for a bad session id, `StoreError`. Cancellation:
        as `submit` - no wake if the transaction had not started, else it is recorded.
        """
        validate_session_id(session_id)
        await self._signal(session_id, (_store.wake, _store.wake_and_acquire), session_id)

    async def run(self, session_id: str) -> Outcome:
        """Wake the session and wait for the outcome of the execution that takes the wake.

        Durable before it waits: the wake is committed (or, with the session already
        running here, joined). `Outcome(kind='deferred')` when another owner holds the
        session: the wake stays durable for it. A drain's exception is returned in the
        outcome (`failed`, `error=`), never raised here. Raises `RuntimeError` when called
        from a drain (or a task it started) on its own session, `TypeError`/`ValueError`
        for a bad session id, `StoreError` when the wake could not be recorded.
        Cancellation: cancelling this call only stops the waiting - it never cancels the
        execution, and a wake already committed stays.
        """
        validate_session_id(session_id)
        _refuse_waiting_for_own_drain(self, session_id, "run")
        entry = self._entries.get(session_id)
        if entry is not None and entry.joinable():
            # Running or being acquired here: join it without forcing another iteration.
            # (Finishing or stopping: only a new wake can reach it, so record one first.)
            if not entry.owned:
                entry.needs_wake = True  # if this acquisition fails, ours is recorded
            return await entry.current.wait()
        _, execution = await self._signal(
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
        finishes the claim (never resumes it) if the owner is dead. `False` when nothing is
        running or it is already stopping. Wakes recorded before or during the interrupt
        survive into exactly one successor.

        Raises `ValueError` for a reason other than `user`/`shutdown`, `TypeError`/
        `ValueError` for a bad session id, `StoreError` (the remote case only).
        Cancellation: an interrupt accepted locally stays accepted (the call returns);
        the remote write behaves as `submit`'s.
        """
        validate_session_id(session_id)
        if reason not in ("user", "shutdown"):
            raise ValueError(f"interrupt reason must be 'user' or 'shutdown', got {reason!r}")
        entry = self._entries.get(session_id)
        if entry is not None:
            accepted = entry.interrupt(reason)  # type: ignore[arg-type]
            # Accepted is accepted: a cancellation arriving now must not hide that.
            await trio.lowlevel.cancel_shielded_checkpoint()
            return accepted
        return await self._db.run(_store.request_cancel, session_id)

    async def wait_idle(self, session_id: str) -> None:
        """Wait until this runtime holds no execution for the session, successors included.

        Never starts work and writes nothing; it does not wait for other processes' claims.
        Raises `RuntimeError` when called from a drain (or a task it started) on its own
        session, `TypeError`/`ValueError` for a bad session id. Cancellation only stops the
        waiting.
        """
        validate_session_id(session_id)
        _refuse_waiting_for_own_drain(self, session_id, "wait_idle")
        while (entry := self._entries.get(session_id)) is not None:
            await entry.released.wait()
        await trio.lowlevel.checkpoint()

    def statistics(self) -> RuntimeStatistics:
        """A snapshot of this runtime's counts and its store's own figures."""
        return RuntimeStatistics(
            active_sessions=len(self._entries),
            owned_claims=len(self._owned_entries()),
            drains_running=self._drains_running,
            tasks=len(self._nursery.child_tasks),
            heartbeat_transactions=self._lease_keeper.transactions,
            recovery=self._recovery.totals,
            remote_signals=self._remote_signals,
            store=self._db.statistics(),
        )

    def is_active(self, session_id: str) -> bool:
        """Whether this runtime holds or is acquiring an execution for the session."""
        return session_id in self._entries

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
        validate_session_id(session_id)
        return await self._db.read(_store.read_transcript, session_id)

    async def recover_once(self) -> RecoveryReport:
        """Run one bounded recovery pass now (never concurrently with another).

        Durable when it returns: every decision of the pass is committed - takeovers (their
        drains already started here), cancelled or superseded claims finished, quarantines
        recorded, exhausted budgets failed - and unclaimed doorbells have been started.
        A producer runtime (`drain=None`) recovers nothing and reports nothing. Raises
        `StoreError` when a transaction of the pass failed (what committed before stands;
        the rows keep their recovery leases and a later pass retries them). Cancellation
        stops the pass between transactions: each takeover commits together with the start
        of its drain (shielded), so a claim taken over is never left without its drain.
        """
        if self._drain is None or self._closing:
            await trio.lowlevel.checkpoint()
            return RecoveryReport()
        async with self._recovery.lock:
            with _observe.recovery_pass(self._owner_id) as observed:
                report = await self._recovery_pass()
                observed.done(report)
        self._recovery.record(report)
        return report

    async def release_quarantine(self, execution_id: str, *, resume: bool) -> None:
        """Act on a quarantined execution.

        `resume=True` clears the quarantine and recovers it at once under the normal rules
        (the budget counts); durable when it returns: the takeover is committed and its
        drain started here, or it was quarantined again and `MalformedRecord` is raised.
        `resume=False` sets its malformed messages aside (raw text kept), finishes its open
        transcript as owner-lost, deletes the claim, resets the resume budget and re-arms
        the doorbell if inputs remain, in one transaction, durable when it returns.

        Raises `ValueError` unless the execution is quarantined, `TypeError` for bad
        arguments, `StoreError`. Cancellation: the drop is one transaction (as `submit`);
        a resume cancelled after the quarantine was lifted leaves the execution under this
        runtime's recovery lease, and the next recovery pass anywhere examines it once that
        runs out.
        """
        if not isinstance(execution_id, str):
            raise TypeError(f"execution_id must be a str, got {type(execution_id).__name__}")
        if not isinstance(resume, bool):
            raise TypeError(f"resume must be a bool, got {type(resume).__name__}")
        async with self._recovery.lock:
            if not resume:
                await self._recovery.drop_quarantine(execution_id)
                _observe.quarantine_released(execution_id, self._owner_id, resume=False)
                return
            candidate = await self._recovery.lift_quarantine(execution_id)
            _observe.quarantine_released(execution_id, self._owner_id, resume=True)
            report = await self._apply_recovery([candidate])
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
        if not isinstance(input_id, str):
            raise TypeError(f"input_id must be a str, got {type(input_id).__name__}")
        if not 1 <= len(input_id) <= MAX_ID_LENGTH:
            raise ValueError(f"input_id must be 1-{MAX_ID_LENGTH} characters: {input_id!r}")
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
        validate_session_id(session_id)
        await self._db.run(_store.pause, session_id)

    async def resume(self, session_id: str) -> None:
        """Lift a pause; when inputs or wakes are pending, ring the doorbell so exactly one
        busy period starts (here if this runtime drains and has room, else anywhere).
        Idempotent; an unknown or unpaused session is left as it is.

        Durable when it returns. Raises `TypeError`/`ValueError` for a bad session id,
        `StoreError`. Cancellation: as `submit`.
        """
        validate_session_id(session_id)
        if await self._db.run(_store.resume, session_id):
            self._ring(session_id)

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
        validate_session_id(session_id)
        existed = await self._db.run(_store.delete_session, session_id)
        self._streams.touch(session_id)
        entry = self._entries.get(session_id)
        if entry is not None:
            # Its claim is gone with the session: stop the drain, write nothing for it.
            entry.lose_lease()
        return existed

    async def purge(self, *, idle_for: float) -> int:
        """Delete every session with no claim, no pending input or wake, and no write for
        `idle_for` seconds (by the store's lease clock); returns how many.

        Runs in short transactions of at most `PURGE_BATCH` sessions each, so it never
        holds up a drain; each is durable when it commits. Raises `TypeError`/`ValueError`
        for a bad `idle_for` (a finite number >= 0), `StoreError`. Cancellation: between
        transactions - the sessions deleted so far stay deleted.
        """
        if isinstance(idle_for, bool) or not isinstance(idle_for, int | float):
            raise TypeError(f"idle_for must be a number of seconds, got {type(idle_for).__name__}")
        if not math.isfinite(idle_for) or idle_for < 0:
            raise ValueError(f"idle_for must be a finite number of seconds >= 0, got {idle_for!r}")
        idle_ms = math.ceil(idle_for * 1000)
        purged = 0
        after: str | None = ""
        while after is not None:
            deleted, after = await self._db.run(_store.purge_batch, idle_ms, after, PURGE_BATCH)
            purged += deleted
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
        validate_session_id(session_id)
        validate_session_id(new_session_id)
        if new_session_id == session_id:
            raise ValueError(f"cannot fork session {session_id!r} into itself")
        if through_seq is not None:
            through_seq = _seq(through_seq, "through_seq")
        await self._db.run(_store.fork, session_id, new_session_id, through_seq)
        self._streams.touch(new_session_id)

    async def truncate(self, session_id: str, *, after_seq: int) -> int:
        """Delete the session's messages with `seq > after_seq`; returns how many. "Edit and
        regenerate": truncate, then submit the edited text.

        One transaction, durable when it returns: never a half-truncated transcript.
        Raises `SessionBusy` (nothing deleted) while a claim is held on the session,
        `TypeError`/`ValueError` for bad arguments, `StoreError`. Cancellation: as `submit`.
        """
        validate_session_id(session_id)
        after_seq = _seq(after_seq, "after_seq")
        deleted = await self._db.run(_store.truncate, session_id, after_seq)
        self._streams.touch(session_id)
        return deleted

    # -- local registry -----------------------------------------------------------------------

    async def _signal(
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
        wake_only, wake_and_acquire = ops
        if (
            session_id in self._entries
            or self._closing
            or self._drain is None
            or not self._has_capacity()
        ):
            result = await self._db.run(wake_only, *args)
            return result, self._ring(session_id)
        entry = self._register(session_id)
        entry.begin_deciding()
        sent_at = entry.woken_at = trio.current_time()
        try:
            # mypy cannot check `*args` of a Callable[..., Any] against a TypeVarTuple.
            result, acquired = await self._db.run(
                wake_and_acquire,  # type: ignore[arg-type]
                *args,
                entry.execution_id,
                self._owner_id,
                self._lease_ms,
            )
        except BaseException:
            self._settle_unclaimed(entry)
            raise
        execution = entry.current  # joiners follow a successor if one starts from it
        if acquired.verdict is not AcquireVerdict.CLAIM:
            self._settle_unclaimed(entry)
            return result, execution
        self._own(entry, attempt=acquired.attempt, resumed=False, sent_at=sent_at)
        entry.keep_going()
        if self._closing:
            # Committed while the runtime closes (its nursery may be gone): keep the claim
            # for recovery with an expired lease; never start a drain now.
            entry.interrupt("shutdown")
            await self._expire(entry)
            self._release(entry, Outcome("interrupted", "shutdown"))
        else:
            self._nursery.start_soon(self._busy_period, entry)
        return result, execution

    def _settle_unclaimed(self, entry: SessionEntry) -> None:
        """A prospective acquisition that did not claim (held elsewhere, withdrawn, failed,
        or a recovery placeholder that did not take over).

        A user interrupt accepted meanwhile is passed on to the holder; a ring since it
        decided, or a joined run's wake, gets a fresh acquisition; otherwise: deferred.
        """
        entry.deciding = False
        plan = decide_ending(EndingCause.NOT_CLAIMED, reason=entry.reason, owned=False)
        if plan.write is EndingWrite.PASS_ON_INTERRUPT:
            self._nursery.start_soon(self._pass_on_then_release, entry)
        elif (
            plan.successor is Successor.IF_RUNG
            and (entry.rung_since_decision() or entry.needs_wake)
            and not self._closing
        ):
            entry.start_successor(_store.new_id())
            self._nursery.start_soon(self._busy_period, entry)
        else:
            self._release(entry, Outcome(plan.outcome, plan.reason))

    async def _pass_on_then_release(self, entry: SessionEntry) -> None:
        try:
            await self._pass_on_interrupt(entry)
        finally:
            self._release(entry, Outcome("interrupted", "user"))

    def _ring(self, session_id: str) -> Execution | None:
        """After a durable wake: ring the local entry, or register one and start acquiring."""
        entry = self._entries.get(session_id)
        if entry is not None:
            return entry.ring()
        if self._closing or self._drain is None or not self._has_capacity():
            return None  # the wake stays durable for a runtime with room
        entry = self._register(session_id)
        entry.woken_at = trio.current_time()
        self._nursery.start_soon(self._busy_period, entry)
        return entry.current

    def _has_capacity(self) -> bool:
        return self._max_active is None or len(self._entries) < self._max_active

    def _capacity_left(self, wanted: int) -> int:
        if self._max_active is None:
            return wanted
        return max(0, min(wanted, self._max_active - len(self._entries)))

    def _owned_entries(self) -> list[SessionEntry]:
        return [entry for entry in self._entries.values() if entry.owned]

    def _register(self, session_id: str) -> SessionEntry:
        # The prospective exact claim, registered before any I/O.
        entry = SessionEntry(session_id, _store.new_id())
        self._entries[session_id] = entry
        return entry

    def _release(self, entry: SessionEntry, outcome: Outcome) -> None:
        entry.disown()
        if self._entries.get(entry.session_id) is entry:
            del self._entries[entry.session_id]
            if self._max_active is not None:
                self._kick.set()  # room again: look for durable wakes left waiting
        entry.close(outcome)

    # -- one busy period ----------------------------------------------------------------------

    async def _busy_period(self, entry: SessionEntry) -> None:
        """One busy period: this claim (already owned, or acquired here) and its successors."""
        outcome = Outcome("deferred")
        try:
            while True:
                outcome, successor_due = await self._one_claim(entry)
                if not successor_due or self._closing or self._crashed:
                    break
                entry.start_successor(_store.new_id())
        except BaseException:
            # Cancelled from outside (the runtime's scope) or an internal error: this busy
            # period was stopped, whatever an earlier iteration's outcome was.
            plan = decide_ending(EndingCause.STOPPED, reason=entry.reason, owned=entry.owned)
            outcome = Outcome(plan.outcome, plan.reason)
            # The drain has exited (a cancellation only leaves it once it did): with the
            # claim still ours, hand it back so any owner can recover it at once. A claim
            # whose user interrupt was accepted is marked cancelling instead, so recovery
            # finishes it and never resumes it.
            if not self._crashed:
                if plan.write is EndingWrite.MARK_CANCELLING:
                    with trio.move_on_after(HAND_BACK_TIMEOUT, shield=True):
                        await self._mark_cancelling_nowait(entry)
                elif plan.write is EndingWrite.HAND_BACK:
                    await self._expire(entry)
            raise
        finally:
            self._release(entry, outcome)

    async def _one_claim(self, entry: SessionEntry) -> tuple[Outcome, bool]:
        """Acquire (or take over a recovered claim), drain, finalize. Returns the outcome
        and whether a successor acquisition is due."""
        ending: _Ending | None = None
        try:
            with entry.scope:
                ending = await self._claim_and_drain(entry)
        except Exception as exc:  # a drain's ExceptionGroup once our Cancelled was removed
            # Not owned: the claim attempt itself failed (a store error while acquiring),
            # and no drain ran.
            ending = _Ending("failed" if entry.owned else "claim_failed", error=exc)
        if ending is None:
            ending = _Ending("interrupted")
        outcome, successor_due = await self._finalize(entry, ending)
        self._streams.touch(entry.session_id)  # open messages were closed by the store
        entry.current.resolve(outcome)
        return outcome, successor_due

    async def _claim_and_drain(self, entry: SessionEntry) -> _Ending:
        if not entry.owned:
            entry.begin_deciding()
            # Shielded: the claim commit, the registration flip and the finalizer
            # installation (entry.owned is what the finalizer acts on) happen together or
            # not at all; an interrupt meanwhile is honoured right after.
            with trio.CancelScope(shield=True):
                sent_at = trio.current_time()
                if entry.needs_wake:  # a joiner's wake, recorded with the acquire
                    _, acquired = await self._db.run(
                        _store.wake_and_acquire,
                        entry.session_id,
                        entry.execution_id,
                        self._owner_id,
                        self._lease_ms,
                    )
                    entry.needs_wake = False
                else:
                    acquired = await self._db.run(
                        _store.acquire,
                        entry.session_id,
                        entry.execution_id,
                        self._owner_id,
                        self._lease_ms,
                    )
                if acquired.verdict is AcquireVerdict.CLAIM:
                    self._own(entry, attempt=acquired.attempt, resumed=False, sent_at=sent_at)
            if acquired.verdict is not AcquireVerdict.CLAIM:
                return _Ending("not_claimed")
            entry.keep_going()
        if self._hook is not None:
            await self._hook(
                Claim(entry.session_id, entry.execution_id, self._owner_id, entry.resumed)
            )
        # The drain never starts for a claim whose interrupt arrived during the handoff.
        await trio.lowlevel.checkpoint_if_cancelled()
        return await self._drain_loop(entry)

    def _own(self, entry: SessionEntry, *, attempt: int, resumed: bool, sent_at: float) -> None:
        """The claim committed; its local deadline counts from before it was sent."""
        entry.own(
            attempt=attempt, resumed=resumed, deadline=self_fence_deadline(sent_at, self._lease)
        )
        if self._token_lost:
            # Committed while our liveness token is free: others may take it over, so its
            # drain never starts; the claim is handed back with the others (`_keep_token`).
            self._lost_claims[entry.execution_id] = entry
            entry.lose_lease()

    async def _drain_loop(self, entry: SessionEntry) -> _Ending:
        while True:
            context = DrainContext(self, entry)
            assert self._drain is not None  # producers never register an entry
            # The task (and every task the drain starts) knows which session it drains, so
            # waiting on that very session fails at once instead of waiting for itself.
            draining = _draining.set((self, entry.session_id))
            self._drains_running += 1
            woken_at, entry.woken_at = entry.woken_at, None
            try:
                with _observe.drain_iteration(entry, self._owner_id, woken_at) as iteration:
                    await self._drain(context)
                    iteration.fail(context._defect)
            except Exception as exc:
                return _Ending("failed", error=exc)
            finally:
                self._drains_running -= 1
                _draining.reset(draining)
                context._returned = True
            if context._defect is not None:
                return _Ending("failed", error=context._defect)
            entry.begin_deciding()
            if self._seams.before_finish is not None:
                await self._seams.before_finish(entry.session_id)
            try:
                verdict = await self._db.run(
                    _store.end_iteration, entry.session_id, entry.execution_id, self._owner_id
                )
            except LeaseLost as exc:
                return _Ending("failed", error=exc)
            self._streams.touch(entry.session_id)  # messages left open were closed
            if verdict is not IterationVerdict.CONTINUE:
                entry.disown()
                if self._seams.after_finish is not None:
                    await self._seams.after_finish(entry.session_id)
                return _Ending("released", handed_over=verdict is IterationVerdict.HAND_OVER)
            entry.keep_going()

    async def _finalize(self, entry: SessionEntry, ending: _Ending) -> tuple[Outcome, bool]:
        """The finalizer: act on how the claim ended. Cancellable (runtime closing): then
        the claim stays as it is durably and recovery finishes it."""
        if self._crashed:
            return Outcome("interrupted", "shutdown"), False
        known_lost = entry.reason == "lease_lost"  # the heartbeat found it (and logged it)
        lease_lost = ending.kind in ("failed", "interrupted") and (
            isinstance(ending.error, LeaseLost) or entry.self_fenced()
        )
        # A claim attempt that failed is a failure of a claim not ours: the table writes
        # nothing (the wake stays durable; the change loop or a recovery pass tries again).
        cause = EndingCause.FAILED if ending.kind == "claim_failed" else EndingCause(ending.kind)
        plan = decide_ending(cause, reason=entry.reason, owned=entry.owned, lease_lost=lease_lost)
        if plan.reason == "lease_lost":
            if not known_lost:
                self._log_claim_lost(entry, ending.error)
            entry.disown()
            return Outcome("interrupted", "lease_lost", ending.error), False
        if ending.kind == "claim_failed":
            _observe.claim_attempt_failed(entry, self._owner_id, ending.error)
        elif plan.outcome == "failed":
            _observe.drain_failed(entry, self._owner_id, ending.error)
        match plan.write:
            case EndingWrite.FINISH_FAILED:
                return await self._finish_failed(entry, ending.error)
            case EndingWrite.FINISH_INTERRUPTED:
                return await self._finish_interrupted(entry)
            case EndingWrite.HAND_BACK:
                await self._expire(entry)
            case EndingWrite.PASS_ON_INTERRUPT:
                await self._pass_on_interrupt(entry)
        error = ending.error if plan.outcome == "failed" else None
        successor_due = plan.successor is Successor.IF_RUNG and entry.rung_since_decision()
        # Released by a claim marked cancelling with a wake waiting: a successor takes it.
        return Outcome(plan.outcome, plan.reason, error), successor_due or ending.handed_over

    def _log_claim_lost(self, entry: SessionEntry, error: BaseException | None) -> None:
        if isinstance(error, LeaseLost):
            _observe.claim_lost(entry, self._owner_id, cause="write")
        else:
            _observe.self_fenced(entry, self._owner_id)

    async def _pass_on_interrupt(self, entry: SessionEntry) -> None:
        """A user interrupt accepted while this runtime was still acquiring, and another
        owner turned out to hold the claim: mark that claim cancelling, live or expired
        (an expired one is finished by recovery as cancelled, never resumed)."""
        if entry.reason == "user":
            with contextlib.suppress(StoreError):
                await self._db.run(_store.cancel_held_claim, entry.session_id)

    async def _mark_cancelling_nowait(self, entry: SessionEntry) -> None:
        with contextlib.suppress(StoreError, LeaseLost):
            await self._db.run_nowait(
                _store.mark_cancelling, entry.session_id, entry.execution_id, self._owner_id
            )
        entry.disown()

    async def _finish_failed(
        self, entry: SessionEntry, error: BaseException | None
    ) -> tuple[Outcome, bool]:
        outcome = Outcome("failed", error=error)
        if not entry.owned:
            return outcome, False
        # The exception's type only: its text may hold secrets (an API key in a KeyError),
        # and users read the transcript. Its text and traceback are in the log (DESIGN §5.1).
        shown = "failed" if error is None else f"failed: {type(error).__name__}"
        entry.begin_deciding()
        try:
            doorbell = await self._retrying(
                entry,
                _store.finish_failed,
                entry.session_id,
                entry.execution_id,
                self._owner_id,
                shown,
            )
        except (LeaseLost, StoreError):
            # The claim stays durable; its lease runs out and recovery takes it from there.
            return outcome, False
        entry.disown()
        return outcome, doorbell or entry.rung_since_decision()

    async def _finish_interrupted(self, entry: SessionEntry) -> tuple[Outcome, bool]:
        outcome = Outcome("interrupted", "user")
        if not entry.owned:
            return outcome, entry.rung_since_decision()
        try:
            await self._retrying(
                entry, _store.mark_cancelling, entry.session_id, entry.execution_id, self._owner_id
            )
            entry.begin_deciding()
            doorbell = await self._retrying(
                entry,
                _store.finish_interrupted,
                entry.session_id,
                entry.execution_id,
                self._owner_id,
            )
        except (LeaseLost, StoreError):
            # Left as 'cancelling' once that write landed: recovery finishes it as
            # cancelled and never resumes it.
            return outcome, False
        entry.disown()
        return outcome, doorbell or entry.rung_since_decision()

    async def _retrying(self, entry: SessionEntry, op: Callable[..., T], *args: Any) -> T:
        """A finalizer write, retried through store errors while the claim is still ours.

        Giving up early would release the registry entry with the claim still 'running',
        and recovery would then resume work that was meant to stop. The heartbeat keeps
        renewing the claim meanwhile; once the lease is lost (or the runtime closes), the
        last error is raised and the durable state is left for recovery.
        """
        pause = 0.01
        while True:
            try:
                return await self._db.run(op, *args)
            except StoreError:
                if entry.reason == "lease_lost" or self._closing:
                    raise
            await trio.sleep(pause)
            pause = min(pause * 2, self._heartbeat_interval)

    async def _expire(self, entry: SessionEntry) -> None:
        """Hand a claim back (shutdown): keep it, end its lease now so any owner can recover
        it at once. Only ever called once the claim's drain has exited (§6.21).

        Shielded and bounded, as trio asks of cleanup, and never waiting for another
        process's lock: if it cannot land, the lease simply runs out.
        """
        if not entry.owned:
            return
        claims = [entry.execution_id]
        with trio.move_on_after(HAND_BACK_TIMEOUT, shield=True) as bounded:
            try:
                await self._db.run_nowait(_store.expire_claims, self._owner_id, claims)
            except StoreError as exc:
                _observe.hand_back_failed(self._owner_id, claims, exc)
            else:
                _observe.handed_back(self._owner_id, claims)
        if bounded.cancelled_caught:
            _observe.hand_back_failed(self._owner_id, claims, TimeoutError("hand-back timed out"))
        entry.disown()

    # -- signals between processes ------------------------------------------------------------

    async def _change_loop(self) -> None:
        """React to other processes' commits: take durable wakes that no runtime holds,
        honour remote interrupts of our claims at once, feed watchers. A lost signal costs
        latency only: the fallback poll and recovery still find the work."""
        while True:
            await self._db.wait_for_change(
                self._kick,
                CHANGE_FALLBACK_POLL,
                own=self._watchers.watching,
                follows=self._follows,
            )
            self._kick = trio.Event()
            with contextlib.suppress(StoreError):  # looked at again at the next signal
                await self._look_at_changes()

    def _follows(self, session_id: str) -> bool:
        """Whether a watcher or stream here follows the session: another process's
        transcript-only change to any other session needs no look (a worker ignores the
        tokens another worker streams)."""
        return self._watchers.watching(session_id) or self._streams.watching(session_id)

    async def _look_at_changes(self) -> None:
        takes_wakes = self._drain is not None and not self._closing
        changes = await self._db.read(
            _store.changes,
            self._owner_id,
            list(self._entries),
            [entry.execution_id for entry in self._owned_entries()],
            self._capacity_left(CHANGE_BATCH) if takes_wakes else 0,
            self._watchers.followed(),
        )
        for session_id in changes.doorbells:
            if session_id not in self._entries and self._ring(session_id) is not None:
                self._remote_signals += 1
        cancelling, gone = set(changes.cancelling), set(changes.gone)
        for entry in list(self._entries.values()):
            if entry.owned and entry.execution_id in cancelling and entry.interrupt("user"):
                self._remote_signals += 1
            elif entry.owned and not entry.deciding and entry.execution_id in gone:
                # Deleted by another process (`delete_session`): nothing is left to write.
                # (A transaction of our own that may delete it sets `deciding` first.)
                entry.lose_lease()
                self._remote_signals += 1
        self._due.arm(changes.next_due_ms)
        self._watchers.apply(changes.watched)
        await self._streams.look(self._db.read)

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
        it.
        """
        validate_session_id(session_id)
        after_seq = _count(after_seq, "after_seq", 0)
        watcher = self._watchers.add(session_id, after_seq)
        try:
            # The history up to the newest message now, in short reads (a long transcript
            # never holds the event loop); what comes after, the change loop finds.
            through, _ = head = await self._db.read(_store.newest_message, session_id)
            self._watchers.cover(session_id, head)
            while after_seq < through:
                replayed = await self._db.read(
                    _store.watched_messages, session_id, after_seq, through
                )
                if not replayed:
                    break
                for snapshot in replayed:
                    self._watchers.publish(snapshot, only=watcher)
                after_seq = replayed[-1].seq
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
        retry). Cancelling the block simply leaves it.
        """
        validate_session_id(session_id)
        position = decode_cursor(session_id, cursor)
        events = self._streams.open(session_id, position, self._db.read)
        try:
            yield events
        finally:
            self._streams.remove(events)

    # -- recovery -----------------------------------------------------------------------------

    async def _recovery_loop(self) -> None:
        while True:
            await trio.sleep(self._recovery_interval)
            with contextlib.suppress(StoreError):  # the next pass retries; leases keep rows
                await self.recover_once()

    async def _recovery_pass(self) -> RecoveryReport:
        # Owners whose liveness token stayed free for the grace, as last seen: their live
        # claims count as expired (re-checked in the takeover's own transaction).
        gone = self._gone_owners.gone(trio.current_time())
        # Scheduled inputs that fell due while no timer ran (a restart) ring their doorbells
        # first, so this very pass starts them; the timer is armed for the rest.
        next_due = await self._db.read(_store.next_due)
        if next_due is not None and next_due <= 0:
            next_due = await self._fire_due()
        self._due.arm(next_due)
        # With max_active, take recovery leases only on what this runtime has room for: a
        # lease it would not act on keeps the row from every other runtime for a lease.
        scan = await self._recovery.scan(
            list(self._entries), self._capacity_left(self._recovery.batch), gone
        )
        if scan.free_owners is not None:  # sightings for the next pass (no extra look)
            self._gone_owners.observe(scan.free_owners - {self._owner_id}, trio.current_time())
        applied = await self._apply_recovery(scan.leased, gone) if scan.leased else RecoveryReport()
        report = attrs.evolve(
            applied, examined=scan.examined, fence_lost=applied.fence_lost + scan.fence_lost
        )
        started = 0
        for candidate in scan.doorbells:
            if (
                candidate.session_id not in self._entries
                and self._ring(candidate.session_id) is not None
            ):
                started += 1
        return attrs.evolve(report, doorbells_started=started)

    async def _apply_recovery(
        self, leased: list[_store.Candidate], gone: frozenset[str] = frozenset()
    ) -> RecoveryReport:
        """Apply recovery to claims whose recovery lease we hold, then start resumed drains."""
        if self._seams.before_recovery_apply is not None:
            await self._seams.before_recovery_apply([c.execution_id or "" for c in leased])
        entries = []
        for candidate in leased[: self._capacity_left(len(leased))]:
            if candidate.session_id in self._entries:
                continue  # became busy locally since the scan; its own claim rules apply
            entries.append((candidate, self._register(candidate.session_id)))
        resumed: list[SessionEntry] = []
        try:
            # Shielded: the takeover commit and the registration flips happen together.
            with trio.CancelScope(shield=True):
                sent_at = trio.current_time()
                results = await self._recovery.apply(
                    [(c, e.execution_id) for c, e in entries], gone
                )
                for (candidate, entry), result in zip(entries, results, strict=True):
                    _observe.recovered(candidate, entry.execution_id, result, self._owner_id)
                    self._streams.touch(candidate.session_id)
                    if result.decision is RecoveryDecision.RESUME and not result.fence_lost:
                        self._own(entry, attempt=result.attempt, resumed=True, sent_at=sent_at)
                        entry.keep_going()
                        resumed.append(entry)
        finally:
            for _, entry in entries:
                if not entry.owned:
                    self._settle_unclaimed(entry)
        for entry in resumed:
            # Closing meanwhile: the busy period starts already interrupted (shutdown), so
            # the takeover is kept with an expired lease, never drained.
            if self._closing:
                entry.interrupt("shutdown")
            self._nursery.start_soon(self._busy_period, entry)
        return report_of(results)

    # -- owner liveness -----------------------------------------------------------------------

    async def _look_at_owners(self) -> frozenset[str]:
        """Look at other owners' liveness tokens; the owners gone now (free for the grace)."""
        free = await self._db.read(_store.free_tokens)
        free.discard(self._owner_id)
        return self._gone_owners.observe(free, trio.current_time())

    async def _watch_owners(self, poll: float) -> None:
        """Notice a released token within a poll, not a recovery interval: once an owner is
        gone, a recovery pass takes its claims over; owners gone without live claims are
        forgotten (their token's record removed)."""
        while True:
            await trio.sleep(poll)
            with contextlib.suppress(StoreError):  # looked at again at the next poll
                gone = await self._look_at_owners()
                if gone and not self._token_lost:
                    await self.recover_once()
                    left = await self._db.run(_store.forget_gone_owners, sorted(gone))
                    self._gone_owners.forget(gone - set(left))

    async def _keep_token(self, token: Token) -> None:
        """On the loss of our liveness token (its connection broke), stop every drain at
        once, writing nothing for them; hand their claims back once they exited and the
        store answers; then take the token again. Others may take the claims over after
        the grace meanwhile: no drain of ours may still run by then."""
        while True:
            await token.wait_lost()
            self._token_lost = True
            _observe.token_lost(self._owner_id, len(self._owned_entries()))
            for entry in self._owned_entries():
                self._lost_claims[entry.execution_id] = entry
                entry.lose_lease()
            await self._hand_back_lost_claims()
            await token.retake()
            self._token_lost = False
            await self._hand_back_lost_claims()  # any claimed while the token was retaken
            _observe.token_retaken(self._owner_id)
            with contextlib.suppress(StoreError):  # else the next pass takes them
                await self.recover_once()  # resume the claims handed back, here or anywhere

    async def _hand_back_lost_claims(self) -> None:
        pause = 0.01
        while self._lost_claims:
            lost = dict(self._lost_claims)
            for entry in lost.values():
                # A claim is never handed back while its drain runs (§6.21); a lost lease
                # ends the busy period, with no successor.
                await entry.released.wait()
            try:
                await self._db.run(_store.expire_claims, self._owner_id, sorted(lost))
            except StoreError:
                await trio.sleep(pause)  # until the store answers
                pause = min(pause * 2, 1.0)
                continue
            for execution_id in lost:
                self._lost_claims.pop(execution_id, None)

    async def _fire_due(self) -> int | None:
        """Promote the scheduled inputs now due (their doorbells rung, one transaction) and
        start their drains here; returns when the next one falls due (ms, None for none)."""
        due = await self._db.run(_store.promote_due, CHANGE_BATCH)
        for session_id in due.sessions:
            self._ring(session_id)
        return due.next_due_ms

    # -- lifecycle ----------------------------------------------------------------------------

    async def _shutdown(self) -> None:
        """Cancel the drains, wait until each has exited, and only then hand its claim back
        (each busy period does that as its drain exits: `_expire`). Drains of one session
        never overlap in time, graceful restarts included (§6.21).

        A drain still running after `shutdown_grace` (a blocking call in a thread, a
        shielded `finally`) keeps its claim and its heartbeat until it exits or its lease
        self-fences; a claim is never handed back while its drain runs.
        """
        self._closing = True
        # A claim already stopping for a user interrupt finishes its own cleanup (handing
        # it back would let recovery resume the work).
        for entry in list(self._entries.values()):
            entry.interrupt("shutdown")
        with trio.move_on_after(self._shutdown_grace):
            await self._all_released()
        if self._entries:
            _observe.drains_outlive_grace(
                self._owner_id, [e.execution_id for e in self._entries.values() if e.owned]
            )
            await self._all_released()

    async def _all_released(self) -> None:
        while self._entries:
            await next(iter(self._entries.values())).released.wait()

    async def _keep_leases(self) -> None:
        with self._heartbeat_scope:
            await self._lease_keeper.run()


# ---------------------------------------------------------------------------------------------
# What a drain sees


# The (runtime, session id) whose drain the current task runs - also in tasks the drain
# started - so that waiting on that very session fails at once instead of deadlocking.
# Set around each drain call by `Runtime._drain_loop`.
_draining: contextvars.ContextVar[tuple[Runtime, str] | None] = contextvars.ContextVar(
    "trio_sessions_draining", default=None
)


def _refuse_waiting_for_own_drain(runtime: Runtime, session_id: str, what: str) -> None:
    draining = _draining.get()
    if draining is not None and draining[0] is runtime and draining[1] == session_id:
        raise RuntimeError(
            f"{what}() called from the drain of its own session {session_id!r}: it would wait"
            " for itself (the drain's return ends the execution it waits for)"
        )


def _is_async_callable(drain: object) -> bool:
    """An `async def` function (also bound or wrapped in `functools.partial`), or an object
    whose `__call__` is one."""
    return inspect.iscoroutinefunction(drain) or (
        callable(drain) and inspect.iscoroutinefunction(type(drain).__call__)
    )


class DrainContext:
    """One drain iteration's view of its claim. Every write is fenced on the live claim and
    raises `LeaseLost` (writing nothing) once the lease is gone - and so does every call
    once this iteration's drain returned, even during the claim's next iteration.

    Attributes:
        session_id: the session being drained.
        execution_id: this claim's id (`session_execution.id`); messages written here carry
            it. A takeover by recovery gets a new one.
        owner_id: the runtime that holds the claim (`Runtime.owner_id`).
        attempt: `session.wake_attempts` - automatic resumes after crashes since the session
            last finished normally (0 on a fresh claim; a graceful hand-back does not count).
        resumed: `True` when recovery took this claim over from a dead or stopped owner; its
            inputs were taken by that owner, so find what is owed in `transcript()`.

    Writes are durable when they return and cancellation behaves as for `Runtime`'s calls
    (queued: nothing written; started: completes, cancellation at the next checkpoint). An
    interrupt, a lost lease or the runtime closing reaches the drain as `trio.Cancelled`:
    let it propagate - the runtime finishes the open messages (nothing at all for a lost
    lease).
    """

    def __init__(self, runtime: Runtime, entry: SessionEntry) -> None:
        self._runtime = runtime
        self.session_id = entry.session_id
        self.execution_id = entry.execution_id
        self.owner_id = runtime.owner_id
        self.attempt = entry.attempt
        self.resumed = entry.resumed
        self._defect: BaseException | None = None
        self._returned = False
        self._entry = entry

    def _check_live(self) -> None:
        if self._returned:
            raise LeaseLost(
                f"this DrainContext of execution {self.execution_id!r} is stale: its drain"
                " already returned"
            )
        if self._entry.reason == "lease_lost":
            # Known lost here first (the liveness token, a heartbeat): the store may still
            # hold the lease for a moment, but nothing more is written for this claim.
            raise LeaseLost(f"execution {self.execution_id!r} lost its claim")

    async def take_inputs(self, *, limit: int | None = None) -> list[Input]:
        """Consume the oldest pending inputs in seq order, at most `limit` of them
        (default `TAKE_INPUTS_CHUNK`); each becomes a user message, atomically.

        Durable when it returns: in one fenced transaction the inputs left `session_input`
        and were appended as `role='user'` messages. Only inputs that are due: a scheduled
        one (`submit(delay=)`) stays unseen until its time. A bounded chunk keeps each call
        one short transaction and one short step of the event loop, whatever the backlog:
        to drain everything, call again until it returns `[]`; a drain that returns instead
        gets the rest in its busy period's next iteration (the doorbell stays set while due
        inputs are pending). None once this claim was asked to stop (another process's
        interrupt on its way): a successor takes them. An input whose payload does not
        decode is set aside for the operator, never returned and never blocking the others.
        Raises `TypeError`/`ValueError` for a bad `limit`, `LeaseLost` (nothing taken) when
        the claim is gone or this context is stale, `StoreError`. Cancellation: nothing
        taken if the transaction had not started, else the inputs are taken (they are user
        messages now, found again by `transcript()`).
        """
        limit = TAKE_INPUTS_CHUNK if limit is None else _count(limit, "limit", 1)
        self._check_live()
        taken = await self._runtime._db.run(
            _store.take_inputs, self.session_id, self.execution_id, self.owner_id, limit
        )
        self._runtime._streams.touch(self.session_id)  # new user messages: streams read them
        return taken

    async def transcript(self) -> list[Message]:
        """The session's messages in seq order (`MalformedRecord` for a row that does not
        decode): a resumed drain finds here the user message it still owes an answer to.

        Reads one consistent snapshot and writes nothing. Raises `LeaseLost` when this
        context is stale, `StoreError`. Cancellation drops the read.
        """
        self._check_live()
        return await self._runtime._db.read(_store.read_transcript, self.session_id)

    async def begin_assistant(self) -> AssistantWriter:
        """Start an assistant message (unfinished, no parts) and return its writer.

        Durable when it returns (one fenced transaction); local watchers see it at once.
        Raises `LeaseLost`, `StoreError`. A message left open when the drain ends, however
        it ends, is finished by the runtime: `interrupted`, failed with the drain's error,
        or normally with its running tools failed.
        """
        self._check_live()
        message_id = _store.new_id()
        with self._runtime._streams.writing(self.session_id):
            seq = await self._runtime._db.run(
                _store.begin_assistant,
                self.session_id,
                self.execution_id,
                self.owner_id,
                message_id,
            )
        writer = AssistantWriter(self, message_id, seq)
        writer._publish(0)
        writer._offer(0, "message", _transcript.EMPTY)
        return writer


class AssistantWriter:
    """Writes one assistant message; each call is one fenced transaction.

    Every method is durable when it returns (an acknowledged append survives a crash) and
    reaches local watchers without a store round trip. Each raises `TypeError`/`ValueError`
    for a bad argument before writing, `MessageFinished` once the message is finished,
    `LeaseLost` (nothing written) once the claim is gone or the drain returned, and
    `StoreError`. Cancellation: nothing written if the transaction had not started, else
    the change is stored and the cancellation arrives at the next checkpoint.

    A second settlement of a tool call raises `DuplicateSettlement` (an unknown call id,
    `UnknownToolCall`): a defect that fails the drain even if the drain catches it.
    """

    def __init__(self, context: DrainContext, message_id: str, seq: int) -> None:
        self._context = context
        self.message_id = message_id
        self._seq = seq
        # The message as stored: `_data` plus the texts streamed onto it since, merged only
        # when a local watcher needs a snapshot (an append costs the same on any message).
        self._data = _transcript.EMPTY
        self._streamed: list[str] = []
        self._version = 0  # as stored, so a retried append can tell whether it landed

    async def append_text(self, text: str) -> None:
        """Stream text onto the message: one small durable write whatever the message's size;
        consecutive appends extend one text part (streamed tokens). `ValueError` for a text
        over 1 MiB in UTF-8 (`MAX_PAYLOAD_BYTES`; stream a long text in pieces) or holding a
        NUL character."""
        _codec.check_text(text, "text")
        context = self._context
        context._check_live()
        with context._runtime._streams.writing(context.session_id):
            data, version = await context._runtime._db.run(
                _store.append_assistant_text,
                context.session_id,
                context.execution_id,
                context.owner_id,
                self.message_id,
                text,
                self._version,
            )
        self._version = version
        if data is None:
            self._streamed.append(text)
            self._offer(version, "append", text)
        else:
            self._data, self._streamed = data, []
            self._offer(version, "message", data)
        self._publish(version)

    async def start_tool(self, call_id: str, name: str, input: dict[str, Any]) -> None:
        """Record a tool call as `running`, before running it. `ValueError` if `call_id` was
        already started in this message, `input` is not a JSON object of at most 1 MiB
        (`MAX_PAYLOAD_BYTES`, encoded), or a NUL character is in `call_id`, `name` or
        `input`. If the owner dies before it settles, recovery fails it with "interrupted:
        owner lost": the call may or may not have happened."""
        for value, what in ((call_id, "call_id"), (name, "name")):
            if not isinstance(value, str) or not value:
                raise TypeError(f"{what} must be a non-empty str, got {value!r:.80}")
            _codec.check_text(value, what)
        await _checked_json(_codec.check_json_object, input, "tool input")
        await self._update(
            lambda data: _transcript.start_tool(data, call_id, name, input), call_id=call_id
        )

    async def settle_tool(self, call_id: str, output: Any) -> None:
        """Record a running tool call as `completed` with its JSON `output`: at most 1 MiB
        encoded (`MAX_PAYLOAD_BYTES`) and no NUL character in it (`ValueError`)."""
        await _checked_json(
            _codec.check_json, output, "tool output", limit=_codec.MAX_PAYLOAD_BYTES
        )
        await self._update(
            lambda data: _transcript.settle_tool(data, call_id, output=output), call_id=call_id
        )

    async def fail_tool(self, call_id: str, error: str) -> None:
        """Record a running tool call as `error` with the reason `error`: at most 1 MiB in
        UTF-8 (`MAX_PAYLOAD_BYTES`) and no NUL character (`ValueError`)."""
        _codec.check_text(error, "error")
        await self._update(
            lambda data: _transcript.settle_tool(data, call_id, error=error), call_id=call_id
        )

    async def finish(self) -> None:
        """Finish the message normally; a tool call still running is failed, not left
        running forever. No further change is accepted."""
        await self._update(_transcript.finish)

    async def _update(
        self, transition: Callable[[AssistantData], AssistantData], *, call_id: str | None = None
    ) -> None:
        """Apply a transition; `call_id` names the one tool part it changes (else: finish)."""
        context = self._context
        context._check_live()
        # Finishing fails running tools too: then the stream gets the whole message.
        fails_tools = bool(_transcript.unsettled_calls(self._data))
        try:
            with context._runtime._streams.writing(context.session_id):
                data, version = await context._runtime._db.run(
                    _store.update_assistant,
                    context.session_id,
                    context.execution_id,
                    context.owner_id,
                    self.message_id,
                    transition,
                )
        except (DuplicateSettlement, UnknownToolCall) as exc:
            context._defect = context._defect or exc
            raise
        self._data, self._streamed = data, []
        self._version = version
        if call_id is not None:
            part = next(p for p in data.parts if isinstance(p, ToolPart) and p.call_id == call_id)
            self._offer(version, "part", part)
        elif fails_tools:
            self._offer(version, "message", data)
        else:
            self._offer(version, "finish", {"error": data.error})
        self._publish(version)

    def _offer(
        self, version: int, kind: Literal["message", "append", "part", "finish"], data: Any
    ) -> None:
        """Local streams get the change now, as the event it makes (no store round trip)."""
        context = self._context
        streams = context._runtime._streams
        if streams.watching(context.session_id):
            is_open = not (isinstance(data, AssistantData) and data.finished) and kind != "finish"
            offer = Offer(self.message_id, self._seq, version, kind, data, is_open)
            streams.offer(context.session_id, offer)

    def _publish(self, version: int) -> None:
        """Local watchers get the snapshot now, with no store round trip."""
        context = self._context
        if not context._runtime._watchers.watching(context.session_id):
            return
        if self._streamed:
            self._data = _transcript.with_streamed(self._data, self._streamed)
            self._streamed = []
        message = Message(
            self.message_id,
            context.session_id,
            "assistant",
            self._seq,
            self._data,
            context.execution_id,
            None,
        )
        context._runtime._watchers.publish(
            _store.Snapshot(
                context.session_id,
                self.message_id,
                self._seq,
                message,
                version,
                None,  # the row's version is not known here: a look reads it whole
                not self._data.finished,
            )
        )


# ---------------------------------------------------------------------------------------------
# open_runtime


@asynccontextmanager
async def open_runtime(
    store: str | os.PathLike[str] | StoreBackend,
    drain: Drain | None,
    *,
    owner_id: str | None = None,
    lease: float = 30.0,
    heartbeat_interval: float | None = None,
    recovery_interval: float = 5.0,
    recovery_batch: int = 100,
    max_resumes: int = 10,
    max_active: int | None = None,
    clock: Callable[[], float] | None = None,
    acquisition_hook: AcquisitionHook | None = None,
    shutdown_grace: float | None = None,
    takeover_grace: float = 0.5,
) -> AsyncIterator[Runtime]:
    """Open the store, run the first recovery pass, and yield a `Runtime`.

    The store is created and migrated on open (an SQLite file, a PostgreSQL schema). The
    runtime owns a nursery: drains, the heartbeat and the recovery task run in it.
    Leaving the block - normally, by an exception or by cancellation - cancels the drains,
    waits until each drain has exited, and only then hands its claim back: the claim is
    kept and its lease expired (shielded, bounded by a few seconds; if that cannot land the
    lease simply runs out), so any owner recovers it at once, without counting against its
    resume budget. A drain that has not exited after `shutdown_grace` seconds (default
    lease/3: a blocking call in a thread, a shielded `finally`) is logged and keeps its claim
    and its heartbeat until it exits, so closing waits for it: drains of one session never
    overlap in time, graceful restarts included. Exceptions from drains become outcomes;
    only the block's own exception escapes, unwrapped. (`Exception`s only: a drain raising
    `KeyboardInterrupt` or `SystemExit` ends the whole runtime - trio's rule for those - and
    it escapes this block, unwrapped, after the shutdown above.)

    A runtime that drains holds a liveness token from open to close (DESIGN §4 "Owner
    liveness"): when its process dies, the OS or the server releases it, and other runtimes
    take its claims over once it stayed free for `takeover_grace` seconds (default 0.5),
    long before their leases run out. Losing it while alive (its PostgreSQL connection
    broke) stops every drain at once with reason `lease_lost`; their claims are handed back
    once they exited, and the token is taken again.

    Raises, before anything is opened, `TypeError`/`ValueError` for a bad option (and
    `TypeError` for a plain `def` drain); then `SchemaTooNew` for a store written by a newer
    library and `StoreError` when the store cannot be opened or the first recovery pass
    fails. Cancelled while opening: whatever opened is closed again.

    `drain=None` opens a producer: `submit`, `wake`, `interrupt` and `transcript` work and
    are durable, but it never claims a session, recovers, or heartbeats (and holds no
    liveness token); `run` returns `deferred` and the wakes wait for a runtime that drains.
    """
    backend = _resolve_store(store)
    if drain is not None and not _is_async_callable(drain):
        raise TypeError(
            "drain must be an async function (or an object with an async __call__)"
            f" taking a DrainContext, or None; got {drain!r}"
        )
    lease = _seconds(lease, "lease")
    heartbeat = (
        lease / 3
        if heartbeat_interval is None
        else _seconds(heartbeat_interval, "heartbeat_interval")
    )
    if heartbeat >= lease:
        raise ValueError(f"heartbeat_interval ({heartbeat}) must be shorter than lease ({lease})")
    shutdown_grace = (
        lease / 3 if shutdown_grace is None else _seconds(shutdown_grace, "shutdown_grace")
    )
    recovery_interval = _seconds(recovery_interval, "recovery_interval")
    recovery_batch = _count(recovery_batch, "recovery_batch", 1)
    max_resumes = _count(max_resumes, "max_resumes", 0)
    if max_active is not None:
        max_active = _count(max_active, "max_active", 1)
    if owner_id is not None:
        owner_id = validate_session_id(owner_id, what="owner id")
    takeover_grace = _seconds(takeover_grace, "takeover_grace")
    if clock is not None and not callable(clock):
        raise TypeError("clock must be a zero-argument callable returning epoch seconds")
    if acquisition_hook is not None and not callable(acquisition_hook):
        raise TypeError("acquisition_hook must be an async callable taking a Claim")
    config = _Config(
        owner_id=make_owner_id(owner_id),
        lease=lease,
        heartbeat_interval=heartbeat,
        recovery_interval=recovery_interval,
        recovery_batch=recovery_batch,
        max_resumes=max_resumes,
        max_active=max_active,
        clock=clock,
        acquisition_hook=acquisition_hook,
        shutdown_grace=shutdown_grace,
        takeover_grace=takeover_grace,
    )
    try:
        async with _open_runtime(backend, drain, config) as runtime:
            yield runtime
    except BaseExceptionGroup as group:
        # Background tasks never raise, so a group here wraps the block's own exception
        # (once per nursery it crossed): exactly one exception escapes, as from any
        # context manager.
        single: BaseException = group
        while isinstance(single, BaseExceptionGroup) and len(single.exceptions) == 1:
            single = single.exceptions[0]
        if single is group:
            raise
        raise single from None


async def serve_runtime(
    store: str | os.PathLike[str] | StoreBackend,
    drain: Drain | None,
    *,
    task_status: trio.TaskStatus[Runtime] = trio.TASK_STATUS_IGNORED,
    **options: Any,
) -> NoReturn:
    """`open_runtime` for `nursery.start`: returns the `Runtime` once it is open (its first
    recovery pass done), then runs until cancelled; cancelling it closes the runtime as
    leaving `open_runtime` does (drains cancelled, claims handed back with expired leases).
    Options are `open_runtime`'s, and so are the errors, raised from `nursery.start`."""
    async with open_runtime(store, drain, **options) as runtime:
        task_status.started(runtime)
        await trio.sleep_forever()


def _resolve_store(store: object) -> StoreBackend:
    """A path is an SQLite file; a postgresql:// or postgres:// URL a PostgreSQL database;
    another connection string a `ValueError` (`_naming.store_kind` decides)."""
    if isinstance(store, str | os.PathLike):
        if store_kind(store) == "postgres":
            from ._postgres import PostgresStore  # psycopg is an optional extra

            return PostgresStore(os.fspath(store))
        return SQLiteStore(store)
    if callable(getattr(store, "open_executor", None)):
        return store  # type: ignore[return-value]
    raise TypeError(f"store must be {ACCEPTED_FORMS}, got {type(store).__name__}")


async def _checked_json(check: Callable[..., str], value: Any, what: str, **options: Any) -> str:
    """A `_codec` JSON check of a caller's value, in a worker thread when the value is large
    (§6.26: checking and encoding a 1 MiB value, or refusing a 50 MB one, must not stall the
    event loop). The thread is not abandoned on cancellation: it ends with the check."""
    if _codec.is_small(value):
        return check(value, what, **options)
    return await trio.to_thread.run_sync(functools.partial(check, value, what, **options))


@attrs.frozen
class _Config:
    """`open_runtime`'s options, validated."""

    owner_id: str
    lease: float
    heartbeat_interval: float
    recovery_interval: float
    recovery_batch: int
    max_resumes: int
    max_active: int | None
    clock: Callable[[], float] | None
    acquisition_hook: AcquisitionHook | None
    shutdown_grace: float
    takeover_grace: float = 0.5


@asynccontextmanager
async def _holding_token(
    executor: Executor, drain: Drain | None, owner_id: str
) -> AsyncIterator[Token | None]:
    if drain is None:
        yield None
        return
    async with executor.hold_token(owner_id) as token:
        yield token


@asynccontextmanager
async def _open_runtime(
    store: StoreBackend, drain: Drain | None, config: _Config
) -> AsyncIterator[Runtime]:
    async with (
        store.open_executor(config.clock) as executor,
        # Held from before the first claim until after the last drain exited (§4 Owner
        # liveness); a producer never claims, so it holds none.
        _holding_token(executor, drain, config.owner_id) as token,
        trio.open_nursery() as nursery,
    ):
        runtime = Runtime(executor=executor, nursery=nursery, drain=drain, config=config)
        if token is not None:
            await runtime.recover_once()
            nursery.start_soon(runtime._keep_leases)
            nursery.start_soon(runtime._recovery_loop)
            nursery.start_soon(runtime._keep_token, token)
            if token.poll_interval is not None:
                nursery.start_soon(runtime._watch_owners, token.poll_interval)
            nursery.start_soon(runtime._due.run, runtime._fire_due)
        nursery.start_soon(runtime._change_loop)
        try:
            yield runtime
        finally:
            runtime._watchers.close()
            runtime._streams.close()
            try:
                if not runtime._crashed:
                    # Shielded and not bounded here: it waits for drains to exit, which no
                    # deadline can hurry (a nursery waits for its tasks anyway); every
                    # write it makes is bounded on its own.
                    with trio.CancelScope(shield=True):
                        await runtime._shutdown()
            finally:
                runtime._heartbeat_scope.cancel()
                nursery.cancel_scope.cancel()
