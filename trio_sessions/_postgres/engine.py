"""The PostgreSQL engine: one connection and the transactions run on it (`PgEngine`), by one
thread at a time - group commit, retries, reconnects and uncertain COMMITs - and the sync
`_backend.Engine` over it (`open_engine`: the CLI, the soak's admin, the bench, tests).

Transactions (`PgEngine.run_batch`, group commit): every operation queued during one
hand-off runs in ONE transaction, without per-operation savepoints (more than 64
subtransactions slow the whole server down). Operations of one `pg_batched` kind share one
set-based function call; the rest run one by one. If any operation raises - a refusal such
as `LeaseLost` or a database error - the whole batch rolls back and each operation re-runs
alone in its own transaction, where an operation that raises is rolled back and gets the
error. An operation marked `autocommit_when_alone` that runs alone is one autocommit call;
if the server refuses that call whole (`NEEDS_TRANSACTION`: part of its work needs more
statements), it runs again in a transaction. A batch of one `pg_batched(...,
autocommit=True)` kind only (a web process's submits) is its set-based call alone, in
autocommit; the jobs it leaves to the row path (nothing written for them) then run alone.
Serialisation failures, deadlocks, lock and statement timeouts (40001, 40P01, 55P03,
57014) retry the whole transaction with a small, bounded backoff; a connection lost before
COMMIT is re-opened and the transaction re-run (nothing committed). Other database errors
reach the caller as `StoreError`.

Reads run each on its own snapshot, never in a write batch; the reads of one hand-off
marked `pg_read_batched` (a stream's read) are one set-wise call in autocommit. A read
whose connection is lost runs again within the same bounds, then fails with a plain
`StoreError`: it committed nothing, so no outcome is unknown.

Signals (DESIGN §8 "Notifications scale"): at most one `pg_notify` per transaction, on the
schema's channel, its payload the signalled sessions one per line (or empty: look at
everything, when they do not fit). A write transaction begins with
`trio_sessions.defer_signals` set, so its functions defer their signals (`ts_signal`), each
call's reply reading the sessions deferred so far; those and the ones the client signalled
(`tx.notify`) are sent by `ts_flush_signals` AFTER the COMMIT, in the COMMIT's own message,
in a transaction of their own with `synchronous_commit` off. A notifying transaction holds
a database-wide lock from its COMMIT to the end of that COMMIT's WAL flush: inside a
batch's transaction, it queued every notifying commit of every process behind every
other's flush (the chat load's commits waited there most). The signals' own transaction
writes nothing to flush. A listener sees a signal only after the change committed; if
that transaction fails or its outcome is unknown, the engine sends the empty payload
instead (best effort: the fallback poll covers the rest). Alone, an autocommit call signals
its own session itself (one round trip, the lock held through its flush), and so does a
set-based call in autocommit, once for its batch: measured under the chat load, a batch of
submits committed in one round trip answered sooner than in two with the lock kept off
its flush.

Uncertain COMMIT: just before COMMIT the transaction's id is read (or taken from the reply
of its last function call). If the connection breaks during COMMIT, the outcome is unknown:
we reconnect and ask the server (`pg_xact_status`): committed -> the operations' results
stand (never re-applied); aborted -> re-run; in progress -> poll. Past the bound every
operation gets `StoreError`, so the runtime never treats an uncertain claim as its own: if
it landed, it expires and recovery takes it. A lost reply to an autocommit call is resolved
by calling again with `retry`: the function reads back by natural key whether it landed.

Withdrawn callers (`Withdrawals`, the threaded executor's hand-offs): a write whose caller
was cancelled is withdrawn unrun where nothing of it committed - before its transaction (or
autocommit call) sends anything, or once a statement of it still unanswered `CANCEL_AFTER_S`
after it was sent (waiting for a session's lock) is cancelled (`cancel_safe`), the
transaction rolled back before its COMMIT; the rest of its batch runs again without it.

Invariants:
* an operation that raised has written nothing; results are reported only after COMMIT;
* a cancel reaches the server only while a statement of an attempt before its COMMIT is
  unanswered, and the worker sends nothing more until that request is done: it never lands
  on a COMMIT or a later statement (the server ignores one that finds its backend idle);
* an outcome is never guessed: a COMMIT whose outcome cannot be read back within
  `RECONNECT_PATIENCE_S` is a `StoreError`, never a retry that could apply twice;
* methods never raise for an operation's failure: outcomes go on the `Job`.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal, TypeVar, TypeVarTuple, Unpack

import psycopg

from .. import _codec, _observe
from .._backend import (
    FALLBACK,
    NEEDS_TRANSACTION,
    BackendName,
    Job,
    NeedsTransaction,
    StoreStatistics,
    Tx,
    driver_error,
    session_named,
)
from .._errors import OutcomeUnknown, StoreError
from .._naming import check_postgres_name, check_schema
from .connections import channel, connect, migrate, schema_version
from .transactions import (
    _BEGIN_NOWAIT,
    _BEGIN_READ,
    _BEGIN_WRITE,
    _DEFERRED_SIGNALS,
    BindingCursor,
    Mode,
    PgTx,
    bound,
    lock_sessions_first,
)

T = TypeVar("T")
Ts = TypeVarTuple("Ts")
AutocommitFailure = Literal["refused", "lost", "retry"]

_FLUSH = (
    "SELECT set_config('synchronous_commit', 'off', true), ts_flush_signals(CAST(%s AS text[]))"
)
# After a transaction that took session locks ended without signalling them - committed
# (after its COMMIT, in the same message) or an operation alone refused and rolled back
# (`PgEngine._signal_refused`): the signal, in a transaction of its own, for those of the
# sessions an acquire waits for (a doorbell, no claim, not paused).
_WAITING = "ts_waiting(CAST(%s AS text[]))"
SIGNAL_WAITING = (
    f"SELECT set_config('synchronous_commit', 'off', true), ts_flush_signals({_WAITING})"
)
# Both after one COMMIT: one `ts_flush_signals`, so one notification (DESIGN §8).
_FLUSH_AND_SIGNAL_WAITING = (
    "SELECT set_config('synchronous_commit', 'off', true),"
    f" ts_flush_signals(CAST(%s AS text[]) || {_WAITING})"
)
# Retries: SQLSTATEs after which the whole transaction is re-run.
RETRYABLE_SQLSTATES = frozenset({"40001", "40P01", "55P03", "57014"})
MAX_ATTEMPTS = 8
# How long a lost connection is re-opened (and an uncertain commit polled) before StoreError.
RECONNECT_PATIENCE_S = 10.0
# At most this many operations per transaction (the rest follow in the same hand-off): a
# huge transaction holds many session locks at once and costs more to re-run alone.
BATCH_LIMIT = 64
# A statement still unanswered this long after it was sent is cancelled once a caller of
# its transaction was cancelled (`Withdrawals`): one that answers sooner - the common
# case, an interrupt while a drain's write runs - is let be, and its transaction commits.
CANCEL_AFTER_S = 0.05
# The longest a cancel request waits for the server to take it (the worker waits for it).
CANCEL_TIMEOUT_S = 5.0


def _store_error(exc: BaseException) -> BaseException:
    return driver_error(exc) if isinstance(exc, psycopg.Error) else exc


def _connection_lost(conn: Any, exc: BaseException) -> bool:
    """Whether `exc` means the connection is gone (not a server-reported statement error)."""
    if not isinstance(exc, psycopg.Error):
        return False
    if conn is not None and (conn.closed or conn.broken):
        return True
    state = exc.sqlstate
    if state is None and isinstance(exc, psycopg.DataError):
        # The driver refused a parameter before sending it (a NUL in a text): the
        # connection is fine and nothing reached the server - that job's own error, not a
        # lost reply to re-open for (and never an outcome left unknown).
        return False
    # No SQLSTATE: a client-side failure (socket closed, EOF). 08: connection exceptions;
    # 57P01-57P03: the server terminated us (pg_terminate_backend, shutdown); 25P03: our
    # idle-in-transaction timeout fired.
    return state is None or state.startswith("08") or state in {"57P01", "57P02", "57P03", "25P03"}


def autocommit_failure(conn: Any, exc: BaseException) -> AutocommitFailure | None:
    """What an autocommit call's failure `exc` on `conn` means: `refused` - the server
    refused the call whole (`NEEDS_TRANSACTION`), nothing written, it runs in a transaction;
    `lost` - the connection is gone, and a write's call may have landed; `retry` - the
    server refused it in a way that is retried (`RETRYABLE_SQLSTATES`), nothing written;
    None - the operation's own refusal, or a database error, the caller's."""
    state = exc.sqlstate if isinstance(exc, psycopg.Error) else None
    if state == NEEDS_TRANSACTION:
        return "refused"
    if _connection_lost(conn, exc):
        return "lost"
    return "retry" if state in RETRYABLE_SQLSTATES else None


class _JobRaised(Exception):
    """An operation raised; the transaction was rolled back."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


def _retried_state(error: BaseException) -> str | None:
    """The SQLSTATE a re-run is for when the server refused the transaction in a way that
    is retried (`RETRYABLE_SQLSTATES`); None when the re-run is for a lost connection."""
    sqlstate = getattr(error, "sqlstate", None)
    return sqlstate if sqlstate in RETRYABLE_SQLSTATES else None


class _Rerun(Exception):
    """Nothing committed and the transaction may be run again (a retryable error, or a
    connection lost before COMMIT or during an aborted one)."""

    def __init__(self, cause: BaseException) -> None:
        self.cause = cause


class _Withdrawn(Exception):
    """A caller of the transaction (or autocommit call) was cancelled, and nothing of it
    committed: it was never sent, cancelled while a statement waited, or rolled back before
    its COMMIT (`Withdrawals`)."""


class Withdrawals:
    """The callers of one hand-off's writes cancelled while the worker runs them (PostgreSQL's
    `_handoff.BatchStart`): a cancelled caller's operation is withdrawn unrun - its caller
    goes on, cancelled - where nothing of it committed, so a drain stopped at its lease's
    deadline exits then, not when another connection lets go of its session's lock (up to
    `LOCK_TIMEOUT_MS`, retried for up to `RECONNECT_PATIENCE_S`; DESIGN §6.17).

    A cancelled caller asks (`withdraw`, on the trio thread): one whose operation no attempt
    has begun for goes on at once (the worker never runs it, however long the operations
    before it wait); the others wait for the worker's verdict. The worker withdraws the
    operation before a transaction (or autocommit call) holding it sends anything; and
    while one of its statements is still unanswered `CANCEL_AFTER_S` after it was sent
    (waiting for a lock), that statement is cancelled
    (psycopg's `cancel_safe`, from a thread of its own), the transaction rolled back, its
    cancelled callers' operations withdrawn and the others run again. Where the cancel came
    too late for its statement, the transaction is rolled back before COMMIT all the same.
    A caller that asked while no statement of its attempt was unanswered, or one that
    answered in time, has each later statement of the attempt timed the same way: the one
    that waits for a lock is cancelled all the same.

    Invariants:
    * a committed operation is always reported: no cancel is ever sent while no statement
      of ours is in flight, nor once the transaction's COMMIT is due (`commit`), and the
      worker sends nothing more on the connection until a cancel request under way is done
      (`statement`) - the server has signalled its backend by then, which ignores a cancel
      that finds it idle, so a late one never lands on a later statement (a COMMIT, the next
      batch's); the server's 57014 means the statement (an autocommit call with it) rolled
      back, as for statement_timeout's, which the engine retries;
    * an operation whose earlier attempt's reply was lost (`Job.reply_lost`: it may have
      landed) is never withdrawn; one left uncancelled runs to its outcome, its caller told;
    * at most one cancel thread per statement, and none while no caller asked: the common
      path costs a lock taken twice per statement (`_Statement`, no generator).
    """

    def __init__(self, on_withdrawn: Callable[[list[Job]], None]) -> None:
        self._lock = threading.Lock()
        self._on_withdrawn = on_withdrawn  # in the worker thread: wake their callers
        self._asked: set[int] = set()  # ids of the jobs whose callers were cancelled
        self._begun: set[int] = set()  # ids of the jobs an attempt (or more) was for
        # The running attempt's jobs, which may be withdrawn but for those whose reply was lost.
        self._current: Sequence[Job] = ()
        self._statements = 0
        # The statement unanswered: its number, the connection (as connected), sent when.
        self._in_flight: tuple[int, Any, float] | None = None
        self._timed = 0  # the statement a cancel thread was started for (numbers from 1)
        self._cancelled = False  # a cancel was sent during the running attempt
        self._sending: threading.Event | None = None  # set once that request is done

    def withdraw(self, job: Job) -> bool:
        """On the trio thread: `job`'s caller was cancelled. Withdrawn at once (True) while
        no attempt holding it has begun - the worker never runs it (`attempt`), and its
        caller does not wait for the operations before it; else the worker decides (False):
        it withdraws the job unless it committed, or is past its COMMIT."""
        with self._lock:
            self._asked.add(id(job))
            if id(job) not in self._begun:
                return True
            if job.reply_lost or not any(each is job for each in self._current):
                return False
            number = self._time()  # None between statements: the next one is timed
        if number is not None:
            self._start(number)
        return False

    def _time(self) -> int | None:
        """Under the lock, a caller of the attempt having asked: the statement in flight to
        time, unless none is or it already is (or a cancel was sent)."""
        flight = self._in_flight
        if flight is None or flight[0] == self._timed or self._cancelled:
            return None
        self._timed = flight[0]
        return flight[0]

    def _start(self, number: int) -> None:
        threading.Thread(
            target=self._cancel_unanswered,
            args=(number,),
            name="trio-sessions-pg-cancel",
            daemon=True,
        ).start()

    def _cancel_unanswered(self, number: int) -> None:
        """Cancel statement `number` if it is still unanswered `CANCEL_AFTER_S` after it was
        sent."""
        with self._lock:
            flight = self._in_flight
            if flight is None or flight[0] != number:
                return
            pause = flight[2] + CANCEL_AFTER_S - time.monotonic()
        if pause > 0:
            time.sleep(pause)
        with self._lock:
            flight = self._in_flight
            if flight is None or flight[0] != number or self._cancelled:
                return
            self._cancelled = True
            sending = self._sending = threading.Event()
        try:
            with contextlib.suppress(Exception):  # a connection gone: its statement ended
                flight[1].cancel_safe(timeout=CANCEL_TIMEOUT_S)
        finally:
            sending.set()

    def attempt(self, jobs: Sequence[Job], *, certain: bool = True) -> None:
        """In the worker: a transaction (or autocommit call) for `jobs` begins; `_Withdrawn`
        before anything is sent when a caller of one was cancelled. Not `certain`: a lost
        reply of an earlier attempt may have landed - none of them may be withdrawn."""
        with self._lock:
            self._cancelled = False
            self._begun.update(map(id, jobs))
            self._current = jobs if certain else ()
            if self._asking():
                raise _Withdrawn

    def _asking(self) -> bool:
        """Under the lock: whether a caller of the running attempt asked to withdraw."""
        asked = self._asked
        return bool(asked) and any(id(job) in asked and not job.reply_lost for job in self._current)

    def statement(self, conn: Any) -> _Statement:
        """In the worker, around each statement of the attempt sent on `conn` (the
        connection as connected): cancellable while unanswered. `_Withdrawn` for the
        server's 57014 after a cancel of ours, and before sending once one was sent. One
        context manager serves every statement of a transaction."""
        return _Statement(self, conn)

    def _sent(self, conn: Any) -> None:
        """Before a statement is sent (`_Statement`)."""
        with self._lock:
            if self._cancelled:  # it came too late for the statement before
                raise _Withdrawn
            self._statements += 1
            self._in_flight = (self._statements, conn, time.monotonic())
            # A caller asked before this statement: timed as if it asked now.
            number = self._time() if self._asked and self._asking() else None
        if number is not None:
            self._start(number)

    def _answered(self) -> bool:
        """The statement answered: no cancel starts from now on, and one under way is waited
        for. Whether one was sent during the attempt."""
        with self._lock:
            self._in_flight = None
            sending, cancelled = self._sending, self._cancelled
            self._sending = None
        if sending is not None:
            sending.wait()
        return cancelled

    def commit(self) -> None:
        """In the worker, before the attempt's COMMIT: `_Withdrawn` (roll back) once a cancel
        was sent during it; from here on its callers wait for its outcome."""
        with self._lock:
            if self._cancelled:
                raise _Withdrawn
            self._current = ()

    def withdrawn(self, jobs: Sequence[Job]) -> list[Job]:
        """In the worker, after `_Withdrawn` (nothing of `jobs` committed): those of the
        attempt's that may be withdrawn whose callers were cancelled are withdrawn, their
        callers woken; the others, to run again."""
        with self._lock:
            current = {id(job) for job in self._current}
            self._current = ()
            self._cancelled = False
            gone = [
                job
                for job in jobs
                if id(job) in current and id(job) in self._asked and not job.reply_lost
            ]
        for job in gone:
            job.withdrawn = True
        if gone:
            self._on_withdrawn(gone)
        return [job for job in jobs if not job.withdrawn]


class _Statement:
    """`Withdrawals.statement`: a plain context manager (no generator, nothing allocated per
    statement) around every statement of a write."""

    __slots__ = ("_conn", "_withdrawals")

    def __init__(self, withdrawals: Withdrawals, conn: Any) -> None:
        self._withdrawals = withdrawals
        self._conn = conn

    def __enter__(self) -> None:
        self._withdrawals._sent(self._conn)

    def __exit__(self, kind: object, exc: BaseException | None, traceback: object) -> None:
        cancelled = self._withdrawals._answered()
        if cancelled and isinstance(exc, psycopg.Error) and exc.sqlstate == "57014":
            raise _Withdrawn from exc


class PgEngine:
    """One connection and the transactions run on it, by one thread at a time.

    Sync, and blocking: `PgThreadExecutor` calls it from its worker thread,
    `PgInlineExecutor` from the trio thread.
    """

    def __init__(
        self,
        url: str,
        schema: str,
        clock: Callable[[], float] | None,
        wrap_connection: Callable[[psycopg.Connection[Any]], Any] | None = None,
    ) -> None:
        self.url = url
        self.schema = schema
        self.clock = clock
        self.wrap_connection = wrap_connection
        self.conn: Any = None
        self._raw: Any = None  # `conn` as connected, whatever `wrap_connection` made of it
        # In a hand-off (`_hand_off`): whether the server failed to answer (a reply cut
        # short, a reconnect given up) - its other jobs then fail at once, so a hand-off of
        # many fails within one bound, not a bound per job.
        self._in_hand_off = False
        self._silent = False
        # The hand-off's cancelled callers (`run_jobs`); None: no caller is ever withdrawn.
        self._withdrawals: Withdrawals | None = None
        self.backend_pid: int | None = None
        self.transactions = 0
        self.loop_calls = 0  # autocommit calls run from the trio thread (`onloop`)
        self.retries = 0
        self.reconnects = 0

    # -- connection ---------------------------------------------------------------------------

    def open(self, *, migrate_schema: bool = True) -> None:
        """Connect and migrate (`SchemaTooNew` / `StoreError` on failure); with
        `migrate_schema=False` only connect (another engine of the executor migrated)."""
        conn = connect(self.url, self.schema)
        try:
            if migrate_schema:
                migrate(conn, self.schema)
        except BaseException:
            conn.close()
            raise
        self.conn = self._wrapped(conn)

    def close(self) -> None:
        if self.conn is not None:
            if getattr(self._raw, "cut", False):  # the server stopped answering
                self._silent = self._in_hand_off
            with contextlib.suppress(psycopg.Error):
                self.conn.close()
            self.conn = None

    def _wrapped(self, conn: psycopg.Connection[Any]) -> Any:
        # Transactions begin explicitly, with their first statement (`PgTx`): BEGIN costs
        # no round trip of its own. Parameters are bound client-side, so a statement can
        # share its message with the BEGIN before it - but a function call that is its own
        # message server-side, and prepared once it recurs (`BindingCursor`).
        conn.autocommit = True
        conn.cursor_factory = BindingCursor
        self._raw = conn
        # Read by the listener from the trio thread: notifications this connection sent
        # are this runtime's own changes.
        self.backend_pid = conn.info.backend_pid
        return conn if self.wrap_connection is None else self.wrap_connection(conn)

    def _connection(self, deadline: float) -> Any:
        """The open connection, re-opened with backoff if it broke (until `deadline`)."""
        conn = self.conn
        if conn is not None and not conn.closed and not conn.broken:
            return conn
        self.close()
        if self._silent:
            raise StoreError("the PostgreSQL server did not answer earlier in this hand-off")
        pause = 0.02
        while True:
            try:
                self.conn = self._wrapped(connect(self.url, self.schema))
            except StoreError:
                # The last attempt is made at the deadline, not a pause before it: the
                # caller gets StoreError only once the whole bound has passed.
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self._silent = self._in_hand_off
                    raise
                time.sleep(min(pause * random.uniform(0.5, 1.0), remaining))
                pause = min(pause * 2, 1.0)
            else:
                self.reconnects += 1
                _observe.store_reconnected("postgres")
                return self.conn

    def _rollback(self) -> None:
        with contextlib.suppress(psycopg.Error):
            self.conn.rollback()

    # -- transactions -------------------------------------------------------------------------

    def statistics(self, handoffs: int = 0) -> StoreStatistics:
        return StoreStatistics(
            "postgres",
            transactions=self.transactions,
            handoffs=handoffs,
            inline_runs=self.loop_calls,
            retries=self.retries,
            reconnects=self.reconnects,
        )

    def run_jobs(
        self,
        jobs: Sequence[Job],
        nowait: Sequence[Job] = (),
        alone: Sequence[Job] = (),
        withdrawals: Withdrawals | None = None,
    ) -> None:
        """One hand-off's writes: `alone` (writes on no session) first, each in its own
        transaction (one autocommit call if it can be), then `nowait` jobs alone each, the
        rest in batches of `BATCH_LIMIT`. Its reads follow (`run_reads`). With
        `withdrawals`, a job whose caller was cancelled is withdrawn where nothing of it
        committed."""
        with self._hand_off():
            self._withdrawals = withdrawals
            try:
                for job in alone:
                    self.run_alone(job)
                for job in nowait:
                    self.run_alone(job, "nowait")
                for start in range(0, len(jobs), BATCH_LIMIT):
                    self.run_batch(jobs[start : start + BATCH_LIMIT])
            finally:
                self._withdrawals = None

    def _guard(self) -> contextlib.AbstractContextManager[None] | None:
        """Around each statement of a write (`PgTx`): cancellable for a cancelled caller."""
        if self._withdrawals is None:
            return None
        return self._withdrawals.statement(self._raw)

    def _withdraw(self, jobs: Sequence[Job]) -> list[Job]:
        """After `_Withdrawn`: the jobs withdrawn (their callers go on); the rest."""
        assert self._withdrawals is not None
        return self._withdrawals.withdrawn(jobs)

    @contextlib.contextmanager
    def _hand_off(self) -> Iterator[None]:
        """The jobs of one hand-off: once the server failed to answer one, the others fail
        at once (their callers wait for the whole hand-off)."""
        self._in_hand_off, self._silent = True, False
        try:
            yield
        finally:
            self._in_hand_off, self._silent = False, False

    def run_reads(self, reads: Sequence[Job]) -> None:
        """Reads, each on its own snapshot - but those of one `pg_read_batched` kind (two or
        more) as ONE set-wise call. Never raises: outcomes go on the jobs."""
        with self._hand_off():
            self._run_reads(reads)

    def _run_reads(self, reads: Sequence[Job]) -> None:
        kinds: dict[str, list[Job]] = {}
        alone: list[Job] = []
        for job in reads:
            batched = job.op.__dict__.get("pg_read_batched")
            if batched is None:
                alone.append(job)
            else:
                kinds.setdefault(batched[0], []).append(job)
        for function, jobs in kinds.items():
            if len(jobs) < 2:
                alone += jobs
                continue
            for start in range(0, len(jobs), BATCH_LIMIT):
                alone += self._read_set_wise(function, jobs[start : start + BATCH_LIMIT])
        for job in alone:
            self.run_alone(job, "read")

    def _read_set_wise(self, function: str, jobs: Sequence[Job]) -> list[Job]:
        """One autocommit call of `function` for `jobs`; the jobs it could not settle."""
        _, pack, interpret = jobs[0].op.__dict__["pg_read_batched"]
        call = Job(_call, (function, _codec.dumps([pack(job.args) for job in jobs])))
        try:
            rows = self._autocommit(call, read=True)
        except StoreError as exc:
            for job in jobs:
                job.error = exc
            return []
        except psycopg.Error:  # the set-wise call refused: each read on its own says why
            return list(jobs)
        by_job: dict[int, list[tuple[Any, ...]]] = {}
        for ordinal, *row in rows:
            by_job.setdefault(int(ordinal), []).append(tuple(row))
        unsettled: list[Job] = []
        for ordinal, job in enumerate(jobs, start=1):
            result = interpret(job.args, by_job.get(ordinal, []))
            if result is FALLBACK:
                unsettled.append(job)
            else:
                job.result = result
        return unsettled

    def run_batch(self, jobs: Sequence[Job]) -> None:
        """Run `jobs` in one transaction (group commit) - or, all of one kind marked
        `pg_batched(..., autocommit=True)`, as its set-based call in autocommit. Never
        raises: outcomes go on jobs.

        If any job raises in the transaction, nothing of the batch is kept and every job
        runs again alone: no savepoint per job, so the common case costs one transaction
        and no subtransaction.
        """
        if len(jobs) == 1:
            self.run_alone(jobs[0])
            return
        if _one_autocommit_kind(jobs):
            for job in self._set_wise_alone(jobs):
                self.run_alone(job)
            return
        try:
            results = self._transaction(jobs, "write", alone=False)
        except _Withdrawn:  # rolled back: the others run again without the withdrawn
            if rest := self._withdraw(jobs):
                self.run_batch(rest)
            return
        except _JobRaised:
            for job in jobs:
                self.run_alone(job)
            return
        except StoreError as exc:
            for job in jobs:
                job.error = exc
            return
        for job, result in zip(jobs, results, strict=True):
            job.result = result

    def _set_wise_alone(self, jobs: Sequence[Job]) -> list[Job]:
        """`jobs`, all of one kind marked `pg_batched(..., autocommit=True)`, as ONE call of
        its set-wise function in autocommit: one round trip, one transaction and one signal
        for the batch, a lost reply resolved by calling again (each row answers what the
        lost call did: idempotent by natural key). Returns the jobs it left to run on their
        own: its rows' FALLBACK (nothing written for them), or all of them when the call
        failed whole (they are idempotent alike: a lost call's rows read themselves back)."""
        function, interpret = jobs[0].op.__dict__["pg_batched"]
        call = Job(_call, (function, *_set_wise_arguments(jobs)))
        try:
            rows = self._autocommit(call, callers=jobs)
        except StoreError as exc:
            for job in jobs:
                job.error = exc
            return []
        except Exception:  # refused whole, failed before sending, or `_Withdrawn`: each
            return _after_call(call, jobs)  # alone says why (or is withdrawn)
        settled: set[int] = set()
        for ordinal, *row in rows:  # in the order the call applied them
            index = int(ordinal) - 1
            try:
                result = interpret(jobs[index].args, tuple(row))
            except Exception as exc:  # the job's own refusal: nothing written for it
                jobs[index].error = _store_error(exc)
            else:
                if result is FALLBACK:
                    continue
                jobs[index].result = result
            settled.add(index)
        # The call again read each row back (`p_retry`): a FALLBACK row landed nowhere.
        return [job for index, job in enumerate(jobs) if index not in settled]

    def run_alone(self, job: Job, mode: Mode = "write") -> None:
        """Run one job in its own transaction - or as one autocommit call, if it is marked
        `autocommit_when_alone`. Never raises: the outcome goes on the job."""
        try:
            self._run_alone(job, mode)
        except _Withdrawn:  # nothing of it committed
            for rest in self._withdraw([job]):
                self.run_alone(rest, mode)

    def _run_alone(self, job: Job, mode: Mode) -> None:
        # A read that is one function call is one statement: its own snapshot, no BEGIN.
        if (
            mode != "nowait"
            and job.op.__dict__.get("autocommit_when_alone", False)
            and not job.autocommit_refused
        ):
            try:
                job.result = self._autocommit(job, read=mode == "read")
            except _Withdrawn:
                raise
            except NeedsTransaction:
                # Nothing was written: run it in a transaction instead - whose calls read
                # back whether a lost earlier attempt landed (`Job.reply_lost`).
                pass
            except StoreError as exc:
                job.error = exc
                return
            except Exception as exc:  # the operation's own refusal (LeaseLost, ...)
                job.error = _store_error(exc)
                return
            else:
                return
        try:
            [job.result] = self._transaction([job], mode, alone=True, retry=job.reply_lost)
        except _JobRaised as raised:
            job.error = _store_error(raised.error)
        except StoreError as exc:
            job.error = exc

    def _transaction(
        self, jobs: Sequence[Job], mode: Mode, *, alone: bool, retry: bool = False
    ) -> list[Any]:
        """Run and commit; retried within the bounds. `_JobRaised` when a job raised (rolled
        back), `StoreError` past the bounds - `OutcomeUnknown` with `retry`: the calls read
        back whether a lost autocommit attempt of the job landed, and that attempt's outcome
        stays unknown when this transaction cannot run."""
        deadline = time.monotonic() + RECONNECT_PATIENCE_S
        attempt = 0
        while True:
            attempt += 1
            try:
                conn = self._connection(deadline)
                return self._attempt(conn, jobs, mode, alone=alone, deadline=deadline, retry=retry)
            except _Rerun as rerun:
                if attempt >= MAX_ATTEMPTS or time.monotonic() >= deadline:
                    error = driver_error(rerun.cause)
                    if retry:
                        error = _unknown_outcome(rerun.cause, error)
                    raise error from rerun.cause
                self.count_retry(rerun.cause, attempt)
                time.sleep(min(0.005 * 2**attempt, 0.2) * random.uniform(0.5, 1.0))
            except OutcomeUnknown:
                raise
            except StoreError as exc:  # no connection within the bounds
                if retry:
                    raise _unknown_outcome(exc.__cause__, exc) from exc
                raise

    def _autocommit(
        self, job: Job, *, read: bool = False, callers: Sequence[Job] | None = None
    ) -> Any:
        """Run a job as one autocommit call (`PgTx(autocommit=True)`), within the bounds.

        A connection lost around a write's call leaves its outcome unknown: the call runs
        again with `retry`, and the function reads back by natural key whether the lost one
        landed (DESIGN §8 "Uncertain commits"); past the bounds, `OutcomeUnknown`. A `read`
        commits nothing: it only runs again, and past the bounds it is a plain
        `StoreError`. `NeedsTransaction` before anything was sent, or when the server
        refused the call whole (`NEEDS_TRANSACTION`: nothing written); the operation's own
        errors as they are; `_Withdrawn` (nothing committed) for a write whose caller - or
        one of its `callers`, for a set-wise call - was cancelled (`Withdrawals`)."""
        deadline = time.monotonic() + RECONNECT_PATIENCE_S
        attempt = 0
        lost: BaseException | None = None
        while True:
            attempt += 1
            try:
                conn = self._connection(deadline)
            except StoreError as exc:
                if job.reply_lost:  # never guessed: the lost call may have landed
                    raise _unknown_outcome(lost, exc) from lost
                raise
            guard = None if read else self._guard()
            if guard is not None:
                self._withdrawals.attempt(  # type: ignore[union-attr]
                    [job] if callers is None else callers, certain=not job.reply_lost
                )
            self.transactions += 1
            tx = PgTx(conn, self.clock, autocommit=True, retry=job.reply_lost, job=job, guard=guard)
            try:
                return job.op(tx, *job.args)
            except (NeedsTransaction, _Withdrawn):
                raise
            except Exception as exc:
                failure = autocommit_failure(conn, exc)
                if failure is None:
                    raise  # the operation's own refusal, or a database error
                if failure == "refused":  # nothing written
                    raise NeedsTransaction(str(exc)) from exc
                if failure == "lost":
                    self.close()  # the next attempt re-opens it
                    # A read's lost reply leaves nothing unknown: it wrote nothing.
                    job.reply_lost = job.reply_lost or (tx.begun and not read)
                    lost = exc
                if attempt >= MAX_ATTEMPTS or time.monotonic() >= deadline:
                    if job.reply_lost:
                        raise _unknown_outcome(exc, driver_error(exc)) from exc
                    raise driver_error(exc) from exc
                self.count_retry(exc, attempt)
                time.sleep(min(0.005 * 2**attempt, 0.2) * random.uniform(0.5, 1.0))

    def count_retry(self, cause: BaseException, attempt: int) -> None:
        """Attempt `attempt` committed nothing and runs again (a retry, logged)."""
        self.retries += 1
        _observe.store_retry("postgres", cause, attempt, _retried_state(cause))

    @staticmethod
    def _run_jobs(tx: PgTx, jobs: Sequence[Job]) -> list[Any]:
        """Run the jobs in `tx`: those of one `pg_batched` kind (two or more) as one
        set-wise call, the rest (and the rows it could not settle) one by one."""
        results: list[Any] = [None] * len(jobs)
        kinds: dict[str, list[int]] = {}
        for index, job in enumerate(jobs):
            batched = job.op.__dict__.get("pg_batched")
            if batched is not None:
                kinds.setdefault(batched[0], []).append(index)
        settled: set[int] = set()
        for function, indexes in kinds.items():
            if len(indexes) < 2:
                continue
            interpret = jobs[indexes[0]].op.__dict__["pg_batched"][1]
            tx.begin_operation()
            arrays = _set_wise_arguments([jobs[index] for index in indexes])
            for ordinal, *row in tx.call(function, *arrays):
                index = indexes[ordinal - 1]
                result = interpret(jobs[index].args, tuple(row))
                if result is not FALLBACK:
                    results[index] = result
                    settled.add(index)
        for index, job in enumerate(jobs):
            if index not in settled:
                tx.begin_operation(job)
                results[index] = job.op(tx, *job.args)
        return results

    def _attempt(
        self,
        conn: Any,
        jobs: Sequence[Job],
        mode: Mode,
        *,
        alone: bool,
        deadline: float,
        retry: bool = False,
    ) -> list[Any]:
        self.transactions += 1
        nowait = mode == "nowait"
        # A batch's functions defer their signals to one notification before COMMIT; alone,
        # an operation's calls signal its own session themselves (at most one notification,
        # and no statement of its own for it).
        if nowait:
            begin = _BEGIN_NOWAIT
        elif mode == "read":
            begin = _BEGIN_READ
        else:
            begin = _write_begin(jobs)
        # A write's cancelled callers are withdrawn (`Withdrawals`), before its COMMIT.
        withdrawals = None if mode == "read" else self._withdrawals
        guard = None if withdrawals is None else self._guard()
        tx = PgTx(conn, self.clock, begin=begin, retry=retry, guard=guard)
        xid = None
        try:
            if withdrawals is not None:
                withdrawals.attempt(jobs, certain=not retry)
            results = self._run_jobs(tx, jobs)
            # Read just before COMMIT (not at BEGIN): only a transaction that wrote has an
            # id, and a read-only one needs no read-back. The signals travel with it, in
            # one notification for the whole transaction (a notification assigns no id
            # before COMMIT: re-sent after an uncertain COMMIT, it costs a duplicate
            # wake-up, which the doorbell absorbs). A transaction that ended with a
            # function call has its id already.
            if mode == "read":
                xid = tx.xid
            elif tx.begun and (not tx.xid_fresh or tx.deferred is None):
                xid, tx.deferred = tx.one(
                    f"SELECT pg_current_xact_id_if_assigned()::text, {_DEFERRED_SIGNALS}"
                )
            else:
                xid = tx.xid
            if withdrawals is not None:
                withdrawals.commit()  # last: nothing is cancelled from here on
        except Exception as exc:
            self._rollback()
            if _connection_lost(conn, exc):
                self.close()  # the next attempt re-opens it
                raise _Rerun(exc) from exc
            withdrawn = isinstance(exc, _Withdrawn)
            retryable = isinstance(exc, psycopg.Error) and exc.sqlstate in RETRYABLE_SQLSTATES
            # A batch re-runs its jobs alone instead (a deadlock between two batches is
            # unlikely to recur between single operations); nowait never waits again.
            if retryable and alone and not nowait:
                raise _Rerun(exc) from exc
            # The sessions its statements locked, and those its functions meant to signal
            # (their locks taken server-side; the signals rolled back with it). Withdrawn,
            # a batch's operations may never run again to signal them.
            refused = tx.locked.union(filter(None, (tx.deferred or "").split("\n")))
            if (alone or withdrawn) and refused:
                self._signal_refused(conn, refused)
            if withdrawn:
                raise
            raise _JobRaised(exc) from exc
        except BaseException:
            self._rollback()
            raise
        signals = [*tx.notified, *filter(None, (tx.deferred or "").split("\n"))]
        flush = bool(signals)
        if not tx.begun:  # nothing was written: only the client's signals, if any
            if flush:
                self._send_signals(conn, bound(signals))
            return results
        # After the COMMIT, in its own message (no round trip): the signals, and the
        # sessions whose locks the transaction took without signalling them, for those an
        # acquire waits for (`SIGNAL_WAITING`). An acquire that met such a lock answered
        # 'busy' and its runtime passes over that doorbell until a signal names the session
        # - the holder was to claim it or signal it - and an operation that ended with
        # neither (a skipping purge, an operator's drop) held the drain back until the
        # worker's fallback poll (seconds). Both in one call: one notification.
        after: tuple[str, tuple[str, ...]] = (_FLUSH, (bound(signals),))
        unsignalled = sorted(tx.locked.difference(signals))
        if unsignalled:
            waiting = bound(unsignalled)
            after = (
                (_FLUSH_AND_SIGNAL_WAITING, (bound(signals), waiting))
                if flush
                else (SIGNAL_WAITING, (waiting,))
            )
            flush = True
        try:
            if flush:
                conn.execute(f"COMMIT; {after[0]}", after[1])
            else:
                conn.commit()
        except psycopg.Error as exc:
            if not _connection_lost(conn, exc):
                self._rollback()
                if flush and self._landed(conn, xid):
                    # The COMMIT landed; the signals' own transaction after it did not.
                    self._look_at_everything()
                    return results
                # The server answered: it rolled the transaction back.
                if exc.sqlstate in RETRYABLE_SQLSTATES and not nowait:
                    raise _Rerun(exc) from exc
                raise _JobRaised(exc) from exc
            if self._committed(xid, exc, deadline):
                if flush:  # whether the signals' transaction ran is unknown
                    self._look_at_everything()
                return results
            raise _Rerun(exc) from exc
        return results

    def _signal_refused(self, conn: Any, sessions: frozenset[str]) -> None:
        """After an operation alone raised (rolled back) holding these sessions' locks (or its
        functions', which name them in the signals they deferred): signal them. An acquire
        from a doorbell that met one of those locks answered 'busy' and its runtime passes
        over that doorbell until a signal names the session (the holder was to claim it or
        signal it once committed); rolled back, the holder does neither - an edit refused
        for the very input a worker came for held that input's drain back until the
        worker's fallback poll (seconds). Only those an acquire waits for (a doorbell, no
        claim, not paused): a zombie's refused write signals nothing while another claim
        holds its session. Best effort, as every signal: one round trip, on refusals only."""
        with contextlib.suppress(psycopg.Error):
            conn.execute(SIGNAL_WAITING, (bound(sorted(sessions)),))

    def _send_signals(self, conn: Any, sessions: str) -> None:
        try:
            conn.execute(_FLUSH, (sessions,))
        except psycopg.Error as exc:
            if _connection_lost(conn, exc):
                self.close()
                raise _Rerun(exc) from exc
            raise _JobRaised(exc) from exc

    @staticmethod
    def _landed(conn: Any, xid: str | None) -> bool:
        """Whether transaction `xid` committed, asked on a connection that still works."""
        if xid is None:
            return False  # it wrote nothing
        try:
            return _xact_status(conn, xid) == "committed"
        except psycopg.Error:
            return False

    def _look_at_everything(self) -> None:
        """After a committed transaction whose signals may not have been sent: the empty
        payload, on which every listener looks at everything (as after its reconnect).
        Best effort: a listener's fallback poll covers a failure here too."""
        with contextlib.suppress(psycopg.Error, StoreError):
            self._connection(time.monotonic() + 1.0).execute(
                "SELECT set_config('synchronous_commit', 'off', true), pg_notify(%s, '')",
                (channel(self.schema),),
            )

    def _committed(self, xid: str | None, lost: psycopg.Error, deadline: float) -> bool:
        """After a connection broke during COMMIT: did it commit? Read back from the server;
        `StoreError` when that cannot be known within the bound (never guessed)."""
        self.close()  # lost, even if the client has not yet read the connection's end
        if xid is None:
            return False  # it wrote nothing: running it again changes nothing
        while True:
            try:
                conn = self._connection(deadline)
                status = _xact_status(conn, xid)
                conn.rollback()  # end the read's transaction
            except psycopg.Error as exc:
                self.close()
                status = None
                if time.monotonic() >= deadline:
                    raise OutcomeUnknown(
                        f"the outcome of a COMMIT is unknown (connection lost: {lost});"
                        f" {driver_error(exc)}"
                    ) from exc
            except StoreError as exc:
                raise OutcomeUnknown(
                    f"the outcome of a COMMIT is unknown (connection lost: {lost}); {exc}"
                ) from lost
            if status == "committed":
                return True
            if status == "aborted":
                return False
            # 'in progress': the server has not yet noticed the broken connection.
            if time.monotonic() >= deadline:
                raise OutcomeUnknown(
                    f"the outcome of a COMMIT is unknown (connection lost: {lost}); "
                    f"transaction {xid} is still {status!r}"
                ) from lost
            time.sleep(0.02)


def _xact_status(conn: Any, xid: str) -> str | None:
    """The server's word on transaction `xid`: 'committed', 'aborted', 'in progress'."""
    row = conn.execute("SELECT pg_xact_status(%s::xid8)", (xid,)).fetchone()
    return None if row is None else str(row[0])


def _write_begin(jobs: Sequence[Job]) -> str:
    """How a write transaction begins: with its sessions' locks, in one order, when it
    names two or more (`lock_sessions_first`) - but not those only an operation that never
    waits for a session's lock names (`skips_a_busy_session`)."""
    sessions = {
        s
        for job in jobs
        if (s := session_named(job.op, job.args)) is not None
        and not job.op.__dict__.get("skips_a_busy_session", False)
    }
    return lock_sessions_first(_BEGIN_WRITE, sessions) if len(sessions) > 1 else _BEGIN_WRITE


def _one_autocommit_kind(jobs: Sequence[Job]) -> bool:
    """Whether the batch is jobs of one kind only, whose set-wise call can run in
    autocommit (`pg_batched(..., autocommit=True)`)."""
    op = jobs[0].op
    return bool(op.__dict__.get("pg_batched_autocommit")) and all(job.op is op for job in jobs)


def _schema_version(tx: Any) -> int:
    """The schema's version, read on the transaction's connection (no statement of its
    own: nothing to begin or commit)."""
    return schema_version(tx.conn)


def _call(tx: Tx, function: str, *args: Any) -> list[Any]:
    return tx.call(function, *args)


def _after_call(call: Job, jobs: Sequence[Job]) -> list[Job]:
    """`jobs`, left to run alone after their set-wise `call` failed whole: if a reply of the
    call was lost, it may have landed for them, and their own calls read back."""
    if call.reply_lost:
        for job in jobs:
            job.reply_lost = True
    return list(jobs)


def _set_wise_arguments(jobs: Sequence[Job]) -> list[list[Any]]:
    """The arguments of one set-wise call for `jobs` (of one `pg_batched` kind): an array
    per argument of the operation, then the jobs' own ids if the function takes them - the
    same in every attempt of the call, as each job's alone would be (`Job.call_id`)."""
    arrays = [list(column) for column in zip(*(job.args for job in jobs), strict=True)]
    if jobs[0].op.__dict__["pg_batched_call_ids"]:
        arrays.append([job.call_id for job in jobs])
    return arrays


def _unknown_outcome(lost: BaseException | None, error: StoreError) -> OutcomeUnknown:
    return OutcomeUnknown(
        f"the outcome of a COMMIT is unknown (a call in autocommit; connection lost: {lost}); "
        f"{error}"
    )


def run_op(engine: PgEngine, op: Callable[[Tx, Unpack[Ts]], T], *args: *Ts) -> T:
    """Run one operation in its own transaction, synchronously (tools, CLI, tests)."""
    job = Job(op, args)
    engine.run_batch([job])
    result: T = job.unwrap()
    return result


class PgSyncEngine:
    """`_backend.Engine` over one `PgEngine` (`open_engine`): the same retries, reconnects
    and uncertain-COMMIT handling as a runtime's executor, on the calling thread."""

    def __init__(self, engine: PgEngine) -> None:
        self.engine = engine

    @property
    def dialect(self) -> BackendName:
        return "postgres"

    def run(self, op: Callable[[Tx, Unpack[Ts]], T], *args: *Ts) -> T:
        return run_op(self.engine, op, *args)

    def read(self, op: Callable[[Tx, Unpack[Ts]], T], *args: *Ts) -> T:
        job = Job(op, args)
        self.engine.run_alone(job, "read")
        result: T = job.unwrap()
        return result

    def schema_version(self) -> int:
        # Read as an operation: a lost connection is re-opened within the bounds, as for
        # `run` and `read`, and the driver's errors reach the caller as `StoreError`.
        return self.read(_schema_version)

    def close(self) -> None:
        self.engine.close()


def open_engine(
    url: str,
    *,
    schema: str = "public",
    migrate: bool = True,
    clock: Callable[[], float] | None = None,
) -> PgSyncEngine:
    """`_backend.open_engine` for a URL. `migrate=False` connects without migrating (a
    broken connection is re-opened the same way: `PgEngine` reconnects with `connect`).
    `ValueError`/`TypeError` for a URL or schema name `PostgresStore` would refuse."""
    check_postgres_name(url)
    check_schema(schema)
    engine = PgEngine(url, schema, clock)
    # Opened as a runtime's engines are (autocommit between transactions): a bare
    # connection would run an autocommit call inside an implicit transaction that nothing
    # commits.
    engine.open(migrate_schema=migrate)
    return PgSyncEngine(engine)
