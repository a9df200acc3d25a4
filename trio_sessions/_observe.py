"""What the library tells an operator: log events, and OpenTelemetry spans and metrics.

Every event is defined here once, as one function with a stable message and documented
`extra` keys, so the modules that detect an event call it by name and never spell a message
themselves. The message (`record.msg`) is a constant template: its values are the record's
args and, for machines, its `extra` fields (`record.session_id`, ...). Nothing is printed:
records go to `logging.getLogger("trio_sessions")` and the application decides where.

OpenTelemetry is optional (the `otel` extra) and imported here only. Without
`opentelemetry-api` installed every telemetry call is a plain no-op. With it, spans and
metrics go to the global tracer and meter providers, the OTel convention for libraries: they
are no-ops until the application configures an SDK, and record from then on (also into
runtimes opened earlier). Metric attributes have low cardinality (never a session id);
spans carry the ids.

Invariants: no event raises into its caller (logging reports its own handler errors), and
the engine events (`store_retry`, `store_reconnected`, `checkpoint_failed`,
`database_file_lost`, `wal_not_checkpointed`) are safe from the store's worker threads: they
never touch trio.
"""

from __future__ import annotations

import logging
import os
import traceback
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from types import TracebackType
from typing import TYPE_CHECKING, Any

import attrs
import trio

from ._decisions import RecoveryDecision
from ._errors import LeaseLost, MalformedRecord, StoreError
from ._model import RecoveryReport
from ._naming import mask_password

if TYPE_CHECKING:
    from opentelemetry.metrics import Counter, Histogram, UpDownCounter
    from opentelemetry.trace import Span, StatusCode, Tracer

    from ._coordinator import SessionEntry
    from ._store import Candidate, Recovered

logger = logging.getLogger("trio_sessions")
# With logging left unconfigured, Python would print WARNING and above to stderr (its "last
# resort" handler); a library's events are the application's to route, so nothing is printed.
logger.addHandler(logging.NullHandler())

# -- messages (record.msg): part of the public surface, listed in the README --------------------

DRAIN_FAILED = "drain failed: session %s, execution %s"
CLAIM_KEPT_MALFORMED = "claim kept for quarantine, a record is malformed: session %s, execution %s"
MESSAGE_LEFT_OPEN = "malformed message left open: session %s, execution %s"
ENDING_RETRIED = "claim ending retried: session %s, execution %s"
CLAIM_ATTEMPT_FAILED = "claim attempt failed: session %s"
CLAIM_LOST = "claim lost: session %s, execution %s"
SESSION_DELETED = "claim ended, session deleted: session %s, execution %s"
SELF_FENCED = "self-fenced: session %s, execution %s"
HEARTBEAT_FAILED = "heartbeat failed: %d claims not renewed"
TAKEOVER = "takeover: session %s, execution %s replaces %s"
QUARANTINED = "quarantined: session %s, execution %s"
RESUMES_EXHAUSTED = "resume budget exhausted: session %s, execution %s"
QUARANTINE_LIFTED = "quarantine lifted: execution %s"
QUARANTINE_DROPPED = "quarantine dropped: execution %s"
RECOVERY_PASS = "recovery pass: examined %d, resumed %d, quarantined %d"
RECOVERY_PASS_FAILED = "recovery pass failed"
HANDED_BACK = "claims handed back: %d"
TOKEN_LOST = "liveness token lost: %d claims stopped"
TOKEN_RETAKEN = "liveness token taken again"
TOKEN_TAKE_FAILED = "liveness token not taken"
HAND_BACK_FAILED = "hand-back failed: %d claims keep their leases"
STOP_NOT_RECORDED = "stop not recorded: session %s, execution %s"
DRAINS_OUTLIVE_GRACE = (
    "shutdown waits for %d drains still running and %d claims being acquired after the grace"
)
STORE_RETRY = "store transaction retried: %s"
STORE_RECONNECTED = "store reconnected"
LISTENER_RECONNECTED = "listener reconnected"
LISTENER_RECONNECT_FAILED = "listener reconnect failed"
CHECKPOINT_FAILED = "checkpoint failed"
WAL_NOT_CHECKPOINTED = "WAL not checkpointed: %d bytes"
DATABASE_FILE_LOST = "database file %s: %s"

# -- span and metric names ------------------------------------------------------------------------

DRAIN_SPAN = "trio_sessions.drain"
RECOVERY_SPAN = "trio_sessions.recovery_pass"
ACTIVE_DRAINS = "trio_sessions.drains.active"
WAKE_LATENCY = "trio_sessions.drain.wake_latency"
DRAIN_DURATION = "trio_sessions.drain.duration"
TAKEOVERS = "trio_sessions.takeovers"
QUARANTINES = "trio_sessions.quarantines"
CLAIMS_LOST = "trio_sessions.claims_lost"

# Seconds: from a fast local drain to a long agent turn (OTel's default buckets are for ms).
_SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0)


# -- the drain ------------------------------------------------------------------------------------


def drain_failed(entry: SessionEntry, owner_id: str, error: BaseException | None) -> None:
    """ERROR, with the traceback. extra: session_id, execution_id, owner_id, attempt,
    resumed, error (its repr)."""
    logger.error(
        DRAIN_FAILED,
        entry.session_id,
        entry.execution_id,
        exc_info=error,
        extra={**_claim(entry, owner_id), "error": mask_password(repr(error))},
    )


def claim_kept_malformed(entry: SessionEntry, owner_id: str, error: MalformedRecord) -> None:
    """WARNING, no traceback (bad data, not a defect to chase): a finish could not close
    the claim's open message - a row another tool broke - so the claim is kept; once its
    lease runs out recovery quarantines it, for the operator to act on. Not a failed drain
    when the drain returned. extra: session_id, execution_id, owner_id, attempt, resumed,
    table, key, reason."""
    logger.warning(
        CLAIM_KEPT_MALFORMED,
        entry.session_id,
        entry.execution_id,
        extra={**_claim(entry, owner_id), **_malformed(error)},
    )


def ending_retried(entry: SessionEntry, owner_id: str, error: StoreError) -> None:
    """WARNING, once per ending: a claim's ending (a failed drain's finish, or an
    interrupt's mark and finish) has failed for a heartbeat interval. It is retried for as long
    as the claim is ours - giving up would leave recovery to resume work meant to stop -
    and `run()` waits meanwhile, so the operator hears of it. extra: session_id,
    execution_id, owner_id, attempt, resumed, error."""
    logger.warning(
        ENDING_RETRIED,
        entry.session_id,
        entry.execution_id,
        extra={**_claim(entry, owner_id), "error": mask_password(str(error))},
    )


def message_left_open(
    session_id: str, execution_id: str, owner_id: str, error: MalformedRecord, ending: str
) -> None:
    """WARNING, no traceback: an ending that deletes its claim whatever its messages hold
    (`ending`: `interrupted`, a local interrupt's cleanup; `finished_cancelled` or
    `dropped_superseded`, recovery's - DESIGN §4's order) could not finish an open message
    that does not decode (a row another tool broke) and left it as it is. Nothing will
    quarantine it - the claim is gone - and `transcript()` raises `MalformedRecord` until
    an operator truncates the session before it. extra: session_id, execution_id,
    owner_id, table, key, reason, ending."""
    logger.warning(
        MESSAGE_LEFT_OPEN,
        session_id,
        execution_id,
        extra={
            "session_id": session_id,
            "execution_id": execution_id,
            "owner_id": owner_id,
            **_malformed(error),
            "ending": ending,
        },
    )


def claim_attempt_failed(entry: SessionEntry, owner_id: str, error: BaseException | None) -> None:
    """WARNING: acquiring a session's claim failed (the store did not answer: a server
    stopped, a table locked beyond the retries) - no drain ran and nothing was claimed; the
    wake stays durable and the change loop or the next recovery pass tries again. A store
    error carries no traceback (it is not a defect); anything else does. extra:
    session_id, execution_id (the prospective claim's), owner_id, error."""
    logger.warning(
        CLAIM_ATTEMPT_FAILED,
        entry.session_id,
        exc_info=None if isinstance(error, StoreError) else error,
        extra={
            "session_id": entry.session_id,
            "execution_id": entry.execution_id,
            "owner_id": owner_id,
            "error": mask_password(str(error)),
        },
    )


@attrs.frozen
class ClaimSeen:
    """A claim as a log line names it, taken when its event happened: a line written after
    an await names that claim, not the successor its entry may have moved on to."""

    session_id: str
    execution_id: str
    attempt: int
    resumed: bool
    deleting: bool

    @classmethod
    def of(cls, entry: SessionEntry) -> ClaimSeen:
        return cls(
            entry.session_id, entry.execution_id, entry.attempt, entry.resumed, entry.deleting
        )


def claim_lost(entry: SessionEntry | ClaimSeen, owner_id: str, *, cause: str) -> None:
    """WARNING: the store no longer holds this claim for us (expired, or taken over); its
    drain is stopped and nothing more is written for it. extra: session_id, execution_id,
    owner_id, attempt, resumed, cause (`heartbeat`: a renewal matched nothing; `write`: a
    fenced write did; `gone`: the store's changes show its row gone - taken over (gone
    with its session, deleted by another process, is `session_deleted`); `store`: the
    store did not say whether the iteration's end landed, so the claim is left to
    recovery). Nothing for a claim this runtime's own `delete_session` removes
    (`entry.deleting`): gone on purpose."""
    if entry.deleting:
        return
    logger.warning(
        CLAIM_LOST,
        entry.session_id,
        entry.execution_id,
        extra={**_claim(entry, owner_id), "cause": cause},
    )
    _telemetry.count(CLAIMS_LOST, {"cause": cause})


def session_deleted(entry: ClaimSeen, owner_id: str) -> None:
    """INFO: the store's changes show this claim gone with its session - deleted by another
    process (`delete_session`, a user's erasure): its drain is stopped and nothing more is
    written for it. Removed on purpose, so no `claim lost` and no `claims_lost` count, which
    tell an operator that a lease ran out or another owner took over. extra: session_id,
    execution_id, owner_id, attempt, resumed."""
    if entry.deleting:
        return
    logger.info(
        SESSION_DELETED, entry.session_id, entry.execution_id, extra=_claim(entry, owner_id)
    )


def self_fenced(entry: SessionEntry, owner_id: str) -> None:
    """WARNING: the drain reached its local lease deadline with no renewal confirmed (the
    store slow or unreachable, or the process paused) and was stopped before the durable
    expiry. extra: session_id, execution_id, owner_id, attempt, resumed."""
    logger.warning(SELF_FENCED, entry.session_id, entry.execution_id, extra=_claim(entry, owner_id))
    _telemetry.count(CLAIMS_LOST, {"cause": "self_fenced"})


def heartbeat_failed(owner_id: str, claims: int, error: BaseException) -> None:
    """WARNING: a renewal transaction failed; retried at the next tick while each drain's
    local deadline still bounds it. extra: owner_id, claims, error."""
    logger.warning(
        HEARTBEAT_FAILED,
        claims,
        extra={"owner_id": owner_id, "claims": claims, "error": _text(error)},
    )


def _malformed(error: MalformedRecord) -> dict[str, Any]:
    """The extra fields naming a malformed row: its table, key and why."""
    return {"table": error.table, "key": error.key, "reason": "; ".join(error.reasons)}


def _claim(entry: SessionEntry | ClaimSeen, owner_id: str) -> dict[str, Any]:
    return {
        "session_id": entry.session_id,
        "execution_id": entry.execution_id,
        "owner_id": owner_id,
        "attempt": entry.attempt,
        "resumed": entry.resumed,
    }


@attrs.define
class DrainIteration:
    """One drain call as telemetry sees it, used as a context manager around the call: a
    span, the active-drains count, the drain duration and (for an iteration a wake started,
    `woken_at` on trio's clock) the wake-to-start latency. `fail` marks a defect found after
    the call returned.

    Outcome: `succeeded`, `failed` (it raised, or a defect) or `interrupted` (cancelled, or
    ended by its lost lease: `LeaseLost` from a fenced write, as the finalizer counts it).
    A plain object rather than a generator: one lives as long as its drain call, and 10,000
    drains must stay cheap.
    """

    entry: SessionEntry
    owner_id: str
    woken_at: float | None
    outcome: str = "succeeded"
    error: BaseException | None = None
    _started: float = 0.0
    _metered: bool = False
    _span: AbstractContextManager[Span | None] | None = None
    _current: Span | None = None

    def fail(self, error: BaseException | None) -> None:
        if error is not None:
            self.outcome, self.error = "failed", error

    def __enter__(self) -> DrainIteration:
        telemetry = _telemetry
        if telemetry.metering():
            self._metered = True
            self._started = trio.current_time()
            if self.woken_at is not None:
                telemetry.record(WAKE_LATENCY, self._started - self.woken_at, {})
            telemetry.add(ACTIVE_DRAINS, 1)
        if not telemetry.tracing():
            return self
        entry = self.entry
        self._span = telemetry.span(
            DRAIN_SPAN,
            {
                "trio_sessions.session_id": entry.session_id,
                "trio_sessions.execution_id": entry.execution_id,
                "trio_sessions.attempt": entry.attempt,
                "trio_sessions.resumed": entry.resumed,
                "trio_sessions.owner_id": self.owner_id,
            },
        )
        self._current = self._span.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if not self._metered and self._span is None:
            return
        if exc is not None:
            if isinstance(exc, Exception) and not isinstance(exc, LeaseLost):
                self.fail(exc)
            else:  # cancelled, or ended by its lost lease (as the finalizer counts it)
                self.outcome = "interrupted"
        telemetry = _telemetry
        if self._metered:
            # Only what this call added: a provider set meanwhile never sees a -1 alone.
            telemetry.add(ACTIVE_DRAINS, -1)
            telemetry.record(
                DRAIN_DURATION, trio.current_time() - self._started, {"outcome": self.outcome}
            )
        if self._span is not None:
            telemetry.end_iteration(self._current, self)
            self._span.__exit__(exc_type, exc, traceback)


def drain_iteration(entry: SessionEntry, owner_id: str, woken_at: float | None) -> DrainIteration:
    """The telemetry of one drain call (see `DrainIteration`)."""
    return DrainIteration(entry, owner_id, woken_at)


# -- recovery -------------------------------------------------------------------------------------


@attrs.define
class RecoveryPass:
    """One recovery pass as telemetry sees it; `done` logs its summary."""

    owner_id: str
    span: Span | None

    def done(self, report: RecoveryReport) -> None:
        """Every pass: RECOVERY_PASS, INFO when it found work (any count above 0), else
        DEBUG - an idle pass every few seconds is no news. extra: owner_id and each
        `RecoveryReport` count (examined, resumed, finished_cancelled, dropped_superseded,
        quarantined, exhausted, skipped_live, fence_lost, doorbells_started,
        finished_paused)."""
        counts = attrs.asdict(report)
        logger.log(
            logging.INFO if any(counts.values()) else logging.DEBUG,
            RECOVERY_PASS,
            report.examined,
            report.resumed,
            report.quarantined,
            extra={"owner_id": self.owner_id, **counts},
        )
        if self.span is not None:
            self.span.set_attributes({f"trio_sessions.{k}": v for k, v in counts.items()})


@contextmanager
def recovery_pass(owner_id: str) -> Iterator[RecoveryPass]:
    """Around one recovery pass: a span; a pass that fails logs RECOVERY_PASS_FAILED
    (WARNING, with the traceback; extra: owner_id, error) - the next pass retries."""
    with _telemetry.span(RECOVERY_SPAN, {"trio_sessions.owner_id": owner_id}) as span:
        try:
            yield RecoveryPass(owner_id, span)
        except Exception as exc:
            logger.warning(
                RECOVERY_PASS_FAILED,
                exc_info=exc,
                extra={"owner_id": owner_id, "error": _text(exc)},
            )
            _telemetry.end_failed(span, exc)
            raise


def recovered(
    candidate: Candidate, new_execution_id: str, result: Recovered, owner_id: str
) -> None:
    """What applying recovery to one expired claim did, when an operator should know:

    * TAKEOVER (INFO): resumed under a new execution. extra: session_id, execution_id (the
      new one), previous_execution_id, owner_id, attempt.
    * QUARANTINED (WARNING): its rows do not decode; nothing resumes it until an operator
      acts. extra: session_id, execution_id, owner_id, reason.
    * RESUMES_EXHAUSTED (WARNING): finished as failed after `max_resumes` takeovers.
      extra: session_id, execution_id, owner_id.
    * MESSAGE_LEFT_OPEN (WARNING, `message_left_open`): finished as cancelled or dropped as
      superseded over an open message that does not decode, one per such message.
    A result whose fence was lost (another recovery owner acted) is not an event here.
    """
    if result.fence_lost:
        return
    for error in result.left_open:
        assert candidate.execution_id is not None
        message_left_open(
            candidate.session_id,
            candidate.execution_id,
            owner_id,
            error,
            _ENDINGS.get(result.decision, result.decision.value),
        )
    if result.decision is RecoveryDecision.RESUME:
        # Its extras are built only for a logger that takes them: a pass resumes a batch of
        # claims, and INFO is usually off.
        if logger.isEnabledFor(logging.INFO):
            logger.info(
                TAKEOVER,
                candidate.session_id,
                new_execution_id,
                candidate.execution_id,
                extra={
                    "session_id": candidate.session_id,
                    "owner_id": owner_id,
                    "execution_id": new_execution_id,
                    "previous_execution_id": candidate.execution_id,
                    "attempt": result.attempt,
                },
            )
        _telemetry.count(TAKEOVERS, {})
    elif result.decision is RecoveryDecision.QUARANTINE:
        logger.warning(
            QUARANTINED,
            candidate.session_id,
            candidate.execution_id,
            extra={**_ids(candidate, owner_id), "reason": result.reason},
        )
        _telemetry.count(QUARANTINES, {})
    elif result.decision is RecoveryDecision.EXHAUSTED:
        logger.warning(
            RESUMES_EXHAUSTED,
            candidate.session_id,
            candidate.execution_id,
            extra=_ids(candidate, owner_id),
        )


# Recovery's endings as `message_left_open` names them (the `RecoveryReport` fields).
_ENDINGS = {
    RecoveryDecision.FINISH_CANCELLED: "finished_cancelled",
    RecoveryDecision.DROP_SUPERSEDED: "dropped_superseded",
}


def _ids(candidate: Candidate, owner_id: str) -> dict[str, Any]:
    return {
        "session_id": candidate.session_id,
        "owner_id": owner_id,
        "execution_id": candidate.execution_id,
    }


def quarantine_released(execution_id: str, owner_id: str, *, resume: bool) -> None:
    """INFO: an operator acted on a quarantine (QUARANTINE_LIFTED for a resume, else
    QUARANTINE_DROPPED). extra: execution_id, owner_id."""
    message = QUARANTINE_LIFTED if resume else QUARANTINE_DROPPED
    logger.info(message, execution_id, extra={"execution_id": execution_id, "owner_id": owner_id})


# -- shutdown -------------------------------------------------------------------------------------


def handed_back(owner_id: str, execution_ids: Sequence[str], handed: int) -> None:
    """INFO: shutdown kept these claims and expired their leases (their drains had exited),
    so any owner recovers them at once. `handed` (the count logged, extra `claims`) is how
    many the store still held as ours: a claim deleted or taken over meanwhile changed no
    row, and no runtime will resume it. extra: owner_id, claims, execution_ids (all sent)."""
    logger.info(
        HANDED_BACK,
        handed,
        extra={"owner_id": owner_id, "claims": handed, "execution_ids": execution_ids},
    )


def token_lost(owner_id: str, claims: int) -> None:
    """ERROR: this runtime's liveness token was lost while it lives (its PostgreSQL
    connection broke); every drain is stopped at once and its claim handed back once it
    exited. extra: owner_id, claims."""
    logger.error(TOKEN_LOST, claims, extra={"owner_id": owner_id, "claims": claims})


def token_retaken(owner_id: str) -> None:
    """INFO: the liveness token is held again; new claims drain as usual. extra: owner_id."""
    logger.info(TOKEN_RETAKEN, extra={"owner_id": owner_id})


def token_take_failed(owner_id: str, error: BaseException) -> None:
    """WARNING: an attempt to take this runtime's PostgreSQL liveness token failed (its
    connection refused, or the lock still held); tried again after a pause - opening the
    runtime fails with `StoreError` past its bound. extra: owner_id, error."""
    logger.warning(TOKEN_TAKE_FAILED, extra={"owner_id": owner_id, "error": _text(error)})


def drains_outlive_grace(owner_id: str, entries: Sequence[SessionEntry]) -> None:
    """WARNING: closing, these busy periods did not end within `shutdown_grace`. Drains
    still running (a blocking call in a thread, a shielded `finally`) keep their claims
    and heartbeat until they exit. A claim being acquired is a shielded transaction (the
    claim commit and its registration happen together or not at all): the close withdraws
    one that has not begun, but a run's wake recorded with its acquire, or an acquisition
    a user's interrupt was accepted for, may wait up to `LOCK_PATIENCE_S` for another
    process's SQLite write lock - and so may what follows an acquisition before a claim
    was ours (a user's interrupt passed on to its holder). Closing waits for both; they
    are counted apart (the close once said it waited for "0 drains" while it waited for an
    acquisition). extra: owner_id, claims, execution_ids (the drains'), acquiring (the
    session ids of the claims being acquired)."""
    execution_ids = [entry.execution_id for entry in entries if entry.owned]
    acquiring = [entry.session_id for entry in entries if not entry.owned and not entry.disowned]
    logger.warning(
        DRAINS_OUTLIVE_GRACE,
        len(execution_ids),
        len(acquiring),
        extra={
            "owner_id": owner_id,
            "claims": len(execution_ids),
            "execution_ids": execution_ids,
            "acquiring": acquiring,
        },
    )


def stop_not_recorded(entry: SessionEntry, owner_id: str, error: BaseException) -> None:
    """WARNING: a user's interrupt was accepted, but the store did not take its durable
    mark (`phase='cancelling'`) before the runtime gave up (closing): the claim stays
    'running', and recovery may resume the work the user stopped. extra: session_id,
    execution_id, owner_id, error."""
    logger.warning(
        STOP_NOT_RECORDED,
        entry.session_id,
        entry.execution_id,
        extra={
            "session_id": entry.session_id,
            "execution_id": entry.execution_id,
            "owner_id": owner_id,
            "error": _text(error),
        },
    )


def hand_back_failed(owner_id: str, execution_ids: Sequence[str], error: BaseException) -> None:
    """WARNING: the hand-back did not land; the claims wait for their leases to run out.
    extra: owner_id, claims, execution_ids, error."""
    logger.warning(
        HAND_BACK_FAILED,
        len(execution_ids),
        extra={
            "owner_id": owner_id,
            "claims": len(execution_ids),
            "execution_ids": execution_ids,
            "error": _text(error),
        },
    )


# -- the store engines (any thread) ---------------------------------------------------------------


def store_retry(backend: str, error: BaseException, retry: int, sqlstate: str | None) -> None:
    """INFO: a transaction that committed nothing runs again (serialisation failure,
    deadlock, lock or statement timeout: its `sqlstate`; or a connection lost before COMMIT:
    None, whatever code the server sent as it went, such as 57P01 on a shutdown). extra:
    backend, sqlstate, retry (1 for the first re-run), error."""
    logger.info(
        STORE_RETRY,
        sqlstate or "connection lost",
        extra={"backend": backend, "sqlstate": sqlstate, "retry": retry, "error": _text(error)},
    )


def store_reconnected(backend: str) -> None:
    """WARNING: the engine's connection broke and a new one was opened. extra: backend."""
    logger.warning(STORE_RECONNECTED, extra={"backend": backend})


def listener_reconnected(channel: str) -> None:
    """INFO: the LISTEN connection is back (signals sent meanwhile are lost; the runtime
    rescans). extra: channel."""
    logger.info(LISTENER_RECONNECTED, extra={"channel": channel})


def listener_reconnect_failed(channel: str, error: BaseException) -> None:
    """WARNING: the LISTEN connection could not be re-opened; the fallback poll covers it
    until the next try. extra: channel, error."""
    logger.warning(LISTENER_RECONNECT_FAILED, extra={"channel": channel, "error": _text(error)})


def checkpoint_failed(error: BaseException) -> None:
    """WARNING: an SQLite WAL checkpoint failed (nothing is lost: the WAL keeps every
    commit). extra: error."""
    logger.warning(CHECKPOINT_FAILED, extra={"error": _text(error)})


class MaskTracebacks(logging.Filter):
    """Formats a record's traceback once, with passwords masked, before any handler does
    (a handler's formatter uses the text it finds): an exception's text may quote a
    connection string."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None and record.exc_text is None:
            text = "".join(traceback.format_exception(record.exc_info[1]))
            record.exc_text = mask_password(text).rstrip("\n")
        return True


logger.addFilter(MaskTracebacks())


def _text(error: BaseException) -> str:
    """An error's text for a log field or a span: a driver's error may quote the store's
    connection string, so any password in it is masked."""
    return mask_password(str(error))


def database_file_lost(path: str, problem: str) -> None:
    """ERROR, once per runtime: the SQLite file this runtime opened was deleted or replaced
    (`problem`: `deleted` or `replaced`); every write from here on fails with `StoreLost`
    rather than committing into the orphaned file, which would vanish at exit, and a
    runtime that drains ends. Restart on the right file. extra: path, problem."""
    logger.error(DATABASE_FILE_LOST, path, problem, extra={"path": path, "problem": problem})


def wal_not_checkpointed(path: str, wal_bytes: int, wal_frames: int, bound_bytes: int) -> None:
    """WARNING, once each time the WAL crosses the bound: the SQLite WAL grew past
    `bound_bytes` and checkpoints cannot copy it back, because a reader that never ends (an
    open read transaction on another connection: a shell, a backup, a long query) still
    uses its older frames. It grows until that reader ends. extra: path, wal_bytes,
    wal_frames, bound_bytes."""
    logger.warning(
        WAL_NOT_CHECKPOINTED,
        wal_bytes,
        extra={
            "path": path,
            "wal_bytes": wal_bytes,
            "wal_frames": wal_frames,
            "bound_bytes": bound_bytes,
        },
    )


# -- OpenTelemetry (the only place that imports it) -----------------------------------------------


class _Telemetry:
    """The tracer and instruments, or nothing at all when opentelemetry-api is absent."""

    def __init__(self) -> None:
        try:
            from opentelemetry import metrics, trace
            from opentelemetry.metrics import _internal as metrics_api
        except ImportError:  # the `otel` extra is not installed
            self.enabled = False
            return
        self.enabled = True
        self._error: StatusCode = trace.StatusCode.ERROR
        self._tracer_provider = trace.get_tracer_provider
        self._no_sdk = trace.ProxyTracerProvider
        self._trace_api: Any = trace
        # `get_tracer_provider()` looks the environment up on every call while no provider
        # is set (6 % of a cycle with 1,000 sessions in flight): unless a provider is named
        # there, the one `set_tracer_provider` keeps is read where the API keeps it.
        self._provider_from_env = "OTEL_PYTHON_TRACER_PROVIDER" in os.environ or not hasattr(
            trace, "_TRACER_PROVIDER"
        )
        self._tracer: Tracer = trace.get_tracer("trio_sessions")
        meter = metrics.get_meter("trio_sessions")
        # Where the API keeps the provider `set_meter_provider` set (None until then; one
        # named in the environment was loaded by `get_meter` above). An API that keeps it
        # elsewhere is always metered.
        self._metrics_api: Any = metrics_api
        self._meter_provider_unknown = not hasattr(metrics_api, "_METER_PROVIDER")
        self._up_down: dict[str, UpDownCounter] = {
            ACTIVE_DRAINS: meter.create_up_down_counter(
                ACTIVE_DRAINS, unit="{drain}", description="Drain calls running now."
            )
        }
        self._histograms: dict[str, Histogram] = {
            WAKE_LATENCY: meter.create_histogram(
                WAKE_LATENCY,
                unit="s",
                description="From a wake reaching this runtime to the drain starting.",
                explicit_bucket_boundaries_advisory=_SECONDS_BUCKETS,
            ),
            DRAIN_DURATION: meter.create_histogram(
                DRAIN_DURATION,
                unit="s",
                description="One drain call, by outcome.",
                explicit_bucket_boundaries_advisory=_SECONDS_BUCKETS,
            ),
        }
        self._counters: dict[str, Counter] = {
            TAKEOVERS: meter.create_counter(
                TAKEOVERS,
                unit="{claim}",
                description="Claims recovery resumed (expired, or a dead owner's).",
            ),
            QUARANTINES: meter.create_counter(
                QUARANTINES,
                unit="{claim}",
                description="Claims recovery quarantined (expired, or a dead owner's).",
            ),
            CLAIMS_LOST: meter.create_counter(
                CLAIMS_LOST, unit="{claim}", description="Claims whose lease was lost, by cause."
            ),
        }

    def count(self, name: str, attributes: dict[str, str]) -> None:
        if self.metering():
            self._counters[name].add(1, attributes)

    def metering(self) -> bool:
        # With no meter provider set, every instrument is the API's proxy and records
        # nothing, yet the calls cost a few us per drain call: skip them. A provider set
        # later gets the instruments' data from then on, as with the proxies.
        if not self.enabled:
            return False
        return self._meter_provider_unknown or self._metrics_api._METER_PROVIDER is not None

    def add(self, name: str, amount: int) -> None:
        self._up_down[name].add(amount)

    def record(self, name: str, seconds: float, attributes: dict[str, str]) -> None:
        self._histograms[name].record(seconds, attributes)

    def tracing(self) -> bool:
        # With no SDK configured (the global provider is still the API's proxy) a span would
        # record nothing, yet cost about 10 us per drain call: skip it.
        if not self.enabled:
            return False
        if self._provider_from_env:
            return not isinstance(self._tracer_provider(), self._no_sdk)
        provider = self._trace_api._TRACER_PROVIDER  # None until a provider is set
        return provider is not None and not isinstance(provider, self._no_sdk)

    @contextmanager
    def span(self, name: str, attributes: dict[str, Any]) -> Iterator[Span | None]:
        if not self.tracing():
            yield None
            return
        # Exceptions are recorded by the callers, which know which ones are failures (a
        # cancellation is not).
        with self._tracer.start_as_current_span(
            name, attributes=attributes, record_exception=False, set_status_on_exception=False
        ) as span:
            yield span

    def end_iteration(self, span: Span | None, iteration: DrainIteration) -> None:
        if span is None:
            return
        span.set_attribute("trio_sessions.outcome", iteration.outcome)
        error = iteration.error
        if error is not None:
            # The drain's own exception: its text and traceback may hold secrets (an API
            # key in a tool's error) and go to the log only (`drain failed`), never to a
            # collector - as never to the transcript. Its type is what a trace needs.
            span.add_event(
                "exception",
                {"exception.type": type(error).__qualname__, "exception.escaped": False},
            )
            span.set_status(self._error, type(error).__name__)

    def end_failed(self, span: Span | None, error: BaseException) -> None:
        """A failure of the library's own work (a store error, a recovery pass): recorded as
        `span.record_exception` would, with any connection string's password masked."""
        if span is None:
            return
        stacktrace = "".join(traceback.format_exception(error))
        span.add_event(
            "exception",
            {
                "exception.type": type(error).__qualname__,
                "exception.message": _text(error),
                "exception.stacktrace": mask_password(stacktrace),
                "exception.escaped": False,
            },
        )
        span.set_status(self._error, f"{type(error).__name__}: {_text(error)}")


_telemetry = _Telemetry()
