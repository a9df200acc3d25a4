"""SQLite transactions, synchronously: `SQLiteTx` (one open transaction as an operation sees
it), group-commit batches (`run_batch`, `try_run_batch`), and `SQLiteEngine`, the sync
`_backend.Engine` over one connection (CLI, soak, bench, tests).

Nothing here knows trio: every function runs on the thread that calls it, and the executors
(`executors`) decide which thread that is (the event loop's, or their worker's).

Invariants: every write transaction is `BEGIN IMMEDIATE` (`connections.begin_immediate`), so
`tx.now` is read after the only write lock was taken; several operations may share one
transaction (group commit): the operations of one `sqlite_batched` kind (two or more) run
set-wise first, a few statements for all of them, and every other operation - with those the
set-wise run did not settle, for which it wrote nothing - runs alone inside its own
savepoint, so one operation's error (a refusal such as `LeaseLost`) rolls back only its own
writes; an error SQLite answers by rolling back the whole transaction fails
every operation of the batch, and so does a database file deleted or replaced under the
runtime (`DatabaseFile`). Errors are stored on the jobs, never raised, and an SQLite error
reaches the caller as `StoreError` (`store_error`). A read marked `reads_stored_bytes` that
meets text another tool wrote that is not UTF-8 runs again on its snapshot with such text as
bytes (`run_read`), to name the row malformed; so does a write marked so (`_run_job`),
its writes undone first (one marked `reads_stored_bytes_first` has none yet).
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, TypeVarTuple, Unpack

import attrs

from .. import _codec, _liveness
from .._backend import (
    FALLBACK,
    READS_STORED_BYTES_FIRST,
    BackendName,
    Job,
    Params,
    Tx,
    driver_error,
    executor_closed,
    now_ms,
)
from .._errors import TrioSessionsError
from .connections import DatabaseFile, begin_immediate, connect, is_locked, schema_version

if TYPE_CHECKING:
    from .._handoff import BatchStart

T = TypeVar("T")
Ts = TypeVarTuple("Ts")


# Test seam: False runs every job of a group commit alone, each in its own savepoint (the
# path set-wise jobs fall back to), e.g. to inject a fault into one job of a group.
SET_WISE = True


class SQLiteTx:
    """One open `BEGIN IMMEDIATE` transaction. The write lock is the database's only one,
    so it already serialises every session: `lock_session` is a no-op, and `now` is read
    once, after the lock was taken."""

    def __init__(self, conn: sqlite3.Connection, now: int, database: str | None = None) -> None:
        self.conn = conn
        self.now = now
        self._database = database  # its file, when the caller knows it (`DatabaseFile`)

    # Every operation runs in a write transaction: never one call in autocommit.
    autocommit = False

    @property
    def dialect(self) -> BackendName:
        return "sqlite"

    @property
    def call_id(self) -> str:
        return ""  # in process: no reply is lost, none is read back

    def call(self, function: str, *args: Any, idempotent: bool = True) -> list[Any]:
        raise NotImplementedError("server-side functions are PostgreSQL's")

    def execute(self, sql: str, params: Params = ()) -> sqlite3.Cursor:
        return self.conn.execute(sql, params)

    def one(self, sql: str, params: Params = ()) -> Any:
        return self.conn.execute(sql, params).fetchone()

    def executemany(self, sql: str, rows: Sequence[Params]) -> sqlite3.Cursor:
        return self.conn.executemany(sql, rows)

    def lock_session(self, session_id: str) -> None:
        # BEGIN IMMEDIATE holds the only write lock: every session is already serialised.
        pass

    def lock_sessions(self, session_ids: Collection[str]) -> None:
        pass

    def lock_claims(self, execution_ids: Sequence[str]) -> None:
        pass

    def notify(self, session_id: str, *, watchers_only: bool = False) -> None:
        # Other connections notice every commit through `PRAGMA data_version`, which cannot
        # say what changed; the event loop's own commits (`ChangeReader.own_conn`) are no
        # change signal at all (each write offers its change to local watchers itself).
        pass

    @contextlib.contextmanager
    def savepoint(self) -> Iterator[None]:
        self.conn.execute("SAVEPOINT nested")
        try:
            yield
        except BaseException:
            self.conn.execute("ROLLBACK TO nested")
            raise
        finally:
            self.conn.execute("RELEASE nested")

    @contextlib.contextmanager
    def stored_bytes(self) -> Iterator[None]:
        """Meanwhile, text another tool wrote that is not UTF-8 is read as its bytes
        (`_codec.utf8_or_bytes`), which a decoder names malformed, instead of failing the
        whole read (`_store.recovery_batch`: a cancelled claim ends over such a message)."""
        self.conn.text_factory = _codec.utf8_or_bytes
        try:
            yield
        finally:
            self.conn.text_factory = str

    def refused_value(self, exc: BaseException) -> str | None:
        undecodable = isinstance(exc, sqlite3.OperationalError) and str(exc).startswith(
            "Could not decode to UTF-8"
        )
        return f"a row's text is not UTF-8: {exc}" if undecodable else None

    def free_tokens(self, owner_ids: Sequence[str] | None) -> set[str]:
        # Lock files beside the database (`_liveness`): a few syscalls, no SQL.
        database = self._database or database_file(self.conn)
        if database is None:
            return set()
        return _liveness.free_file_tokens(database, owner_ids)

    def forget_tokens(self, owner_ids: Sequence[str]) -> None:
        database = self._database or database_file(self.conn)
        if database is not None:
            _liveness.forget_file_tokens(database, owner_ids)


def run_read(op: Callable[..., T], tx: SQLiteTx, args: Sequence[Any]) -> T:
    """`op(tx, *args)`, a read. A row's text that is not UTF-8 (SQLite keeps whatever bytes
    another tool wrote as TEXT) fails the driver's whole read with an error naming neither
    row nor table; a read marked `_backend.reads_stored_bytes` then runs once more on the
    same snapshot with such text read as its bytes, which it names malformed."""
    try:
        return op(tx, *args)
    except sqlite3.OperationalError as exc:
        if tx.refused_value(exc) is None or not op.__dict__.get("reads_stored_bytes"):
            raise
    with tx.stored_bytes():
        return op(tx, *args)


def read_snapshot(
    conn: sqlite3.Connection, clock: Callable[[], float], op: Callable[..., T], args: Sequence[Any]
) -> T:
    """`op(tx, *args)` on one snapshot of an executor's connection (one deferred transaction,
    rolled back: it never takes the write lock, so never waits for a writer); an SQLite
    error as `StoreError`, a connection closed with its runtime as `executor_closed`."""
    try:
        conn.execute("BEGIN")
    except sqlite3.ProgrammingError:  # closed with its runtime
        raise executor_closed() from None
    try:
        return run_read(op, SQLiteTx(conn, now_ms(clock)), args)
    except sqlite3.Error as exc:
        raise store_error(exc) from exc
    finally:
        conn.execute("ROLLBACK")


# The connection of a Tx whose operation runs no SQL (`run_without_sql`): closed, so a
# statement there fails at once instead of running on a connection another thread uses.
_NO_CONNECTION = sqlite3.connect(":memory:", check_same_thread=False)
_NO_CONNECTION.close()


def run_without_sql(
    op: Callable[..., T], clock: Callable[[], float], database: str, args: Sequence[Any]
) -> T:
    """`op(tx, *args)` for an operation marked `_backend.runs_off_the_loop` (system calls,
    no SQL: the probe of the liveness tokens beside `database`), on no connection and in
    no transaction: any thread may run it, beside the reads and writes on the others."""
    return op(SQLiteTx(_NO_CONNECTION, now_ms(clock), database), *args)


def database_file(conn: sqlite3.Connection) -> str | None:
    """The main database's file, symlinks resolved (None in memory: no liveness tokens
    there): every process finds the same tokens beside it, whatever name it opened."""
    name = str(conn.execute("PRAGMA database_list").fetchone()[2])
    return os.path.realpath(name) if name else None


def store_error(exc: BaseException) -> BaseException:
    return driver_error(exc) if isinstance(exc, sqlite3.Error) else exc


def run_batch(
    conn: sqlite3.Connection,
    clock: Callable[[], float],
    jobs: list[Job],
    file: DatabaseFile | None = None,
    start: BatchStart | None = None,
) -> None:
    """Run `jobs` in one `BEGIN IMMEDIATE` transaction (group commit).

    Each job runs in its own savepoint, so one job's error rolls back only its own writes;
    the others commit together. A failed BEGIN or COMMIT fails every job, with nothing
    written, and so does a `file` that was deleted or replaced. Errors are stored on the
    jobs, never raised. With a `start`, a job its caller withdrew before the BEGIN took
    the lock is dropped unrun (its caller was cancelled), and once every job was, the
    wait for the lock ends with nothing begun.
    """
    if file is not None and file.refuse(jobs):
        return
    try:
        if not begin_immediate(conn, None if start is None else start.abandoned):
            return  # every caller withdrawn while it waited for the lock
    except sqlite3.Error as exc:
        for job in jobs:
            job.error = store_error(exc)
        return
    if start is not None:
        jobs = start.begin(jobs)
        if not jobs:  # withdrawn just as the lock was taken: nothing ran
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
            return
    _run_jobs(conn, clock, jobs, file)


def try_run_batch(
    conn: sqlite3.Connection,
    clock: Callable[[], float],
    jobs: list[Job],
    file: DatabaseFile | None = None,
) -> bool:
    """Like `run_batch`, but only if the write lock is free right now: False, with nothing
    run, when another connection holds it. Never waits (the connection's busy timeout is
    expected to be 0), so it is safe to call on the event loop."""
    if file is not None and file.refuse(jobs):
        return True
    try:
        conn.execute("BEGIN IMMEDIATE")
    except sqlite3.Error as exc:  # also a file that is no database (now): a StoreError
        if isinstance(exc, sqlite3.OperationalError) and is_locked(exc):
            return False
        for job in jobs:
            job.error = store_error(exc)
        return True
    _run_jobs(conn, clock, jobs, file)
    return True


def _run_jobs(
    conn: sqlite3.Connection,
    clock: Callable[[], float],
    jobs: list[Job],
    file: DatabaseFile | None = None,
) -> None:
    """Run jobs inside the open transaction and commit. Never raises: errors go on jobs.

    SQLite may roll a whole transaction back by itself (disk full, I/O error): then no job
    committed, whatever it returned, and every job reports the failure.
    """
    try:
        _run_jobs_or_raise(conn, clock, jobs, file)
    except sqlite3.Error as exc:
        if conn.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
        for job in jobs:
            job.result = None
            if not isinstance(job.error, TrioSessionsError):  # a job's own refusal stays
                job.error = store_error(exc)


def _run_jobs_or_raise(
    conn: sqlite3.Connection,
    clock: Callable[[], float],
    jobs: list[Job],
    file: DatabaseFile | None = None,
) -> None:
    try:
        now = now_ms(clock)
    except Exception as exc:  # a reading that is no time, or the clock's own error
        # Nothing ran yet: every job fails with it, and the transaction must not stay open.
        conn.execute("ROLLBACK")
        for job in jobs:
            job.error = exc
        return
    tx = SQLiteTx(conn, now, None if file is None else file.tokens)
    grouped = len(jobs) > 1
    if grouped and SET_WISE:
        jobs = _run_set_wise(conn, tx, jobs)
    for job in jobs:
        if grouped:
            conn.execute("SAVEPOINT job")
        try:
            job.result = _run_job(conn, tx, job)
        except Exception as exc:
            job.error = store_error(exc)
            if not conn.in_transaction:
                raise _TransactionLost(exc) from exc
            if grouped:
                conn.execute("ROLLBACK TO job")
                conn.execute("RELEASE job")
            else:
                conn.execute("ROLLBACK")
                return
        else:
            if grouped:
                conn.execute("RELEASE job")
    conn.execute("COMMIT")


def _run_job(conn: sqlite3.Connection, tx: SQLiteTx, job: Job) -> Any:
    """`job.op(tx, *args)`. An operation marked `reads_stored_bytes` that meets text
    another tool wrote that is not UTF-8 runs again, its writes so far undone, with such
    text read as its bytes (as `run_read` does), so that it names the row malformed: the
    driver's refusal is a `StoreError`, which a finalizer retries while its lease lasts -
    for ever, with the same bytes in the row."""
    marked = job.op.__dict__.get("reads_stored_bytes")
    if not marked:
        return job.op(tx, *job.args)
    # A connection a test wraps offers `execute`, `executemany` and `in_transaction` only:
    # without the count of its changes, the savepoint below.
    changes = getattr(conn, "total_changes", None)
    if marked == READS_STORED_BYTES_FIRST and changes is not None:
        # Its reads of stored text come before its writes: nothing to undo before running
        # it again - unless a write went first after all, when the refusal stands (its
        # writes are undone with it).
        try:
            return job.op(tx, *job.args)
        except sqlite3.OperationalError as exc:
            if (
                tx.refused_value(exc) is None
                or not conn.in_transaction
                or conn.total_changes != changes
            ):
                raise
        with tx.stored_bytes():
            return job.op(tx, *job.args)
    conn.execute("SAVEPOINT stored_bytes")
    try:
        result = job.op(tx, *job.args)
    except sqlite3.OperationalError as exc:
        if tx.refused_value(exc) is None or not conn.in_transaction:
            raise
        conn.execute("ROLLBACK TO stored_bytes")
        with tx.stored_bytes():
            result = job.op(tx, *job.args)
    conn.execute("RELEASE stored_bytes")
    return result


def _run_set_wise(conn: sqlite3.Connection, tx: SQLiteTx, jobs: list[Job]) -> list[Job]:
    """Run the batch's jobs of each `sqlite_batched` kind (two or more) set-wise, each
    kind in one savepoint; returns the jobs left to run one by one - every other job, and
    those a set-wise run did not settle (`FALLBACK`: nothing was written for them). A
    set-wise run that raises is rolled back whole, and its jobs run one by one instead."""
    kinds: dict[Any, list[Job]] = {}
    for job in jobs:
        many = job.op.__dict__.get("sqlite_batched")
        if many is not None:
            kinds.setdefault(many, []).append(job)
    settled: set[int] = set()
    for many, kind in kinds.items():
        if len(kind) < 2:
            continue
        conn.execute("SAVEPOINT kind")
        try:
            results = many(tx, [job.args for job in kind])
        except Exception as exc:
            if not conn.in_transaction:
                raise _TransactionLost(exc) from exc
            conn.execute("ROLLBACK TO kind")
            conn.execute("RELEASE kind")
            continue
        conn.execute("RELEASE kind")
        for job, result in zip(kind, results, strict=True):
            if result is not FALLBACK:
                job.result = result
                settled.add(id(job))
    if not settled:
        return jobs
    return [job for job in jobs if id(job) not in settled]


class _TransactionLost(sqlite3.Error):
    """SQLite rolled the whole transaction back on its own after a job's error."""


def run_op(
    conn: sqlite3.Connection,
    clock: Callable[[], float],
    op: Callable[[Tx, Unpack[Ts]], T],
    *args: *Ts,
) -> T:
    """Run one operation in its own transaction, synchronously (tools, CLI, tests)."""
    job = Job(op, args)
    run_batch(conn, clock, [job])
    result: T = job.unwrap()
    return result


@attrs.define
class SQLiteEngine:
    """`_backend.Engine` on one SQLite connection (`open_engine`)."""

    conn: sqlite3.Connection
    clock: Callable[[], float] = time.time

    @property
    def dialect(self) -> BackendName:
        return "sqlite"

    def run(self, op: Callable[[Tx, Unpack[Ts]], T], *args: *Ts) -> T:
        return run_op(self.conn, self.clock, op, *args)

    def read(self, op: Callable[[Tx, Unpack[Ts]], T], *args: *Ts) -> T:
        self.conn.execute("BEGIN")  # one deferred read transaction: a snapshot, no lock
        try:
            return run_read(op, SQLiteTx(self.conn, now_ms(self.clock)), args)
        except sqlite3.Error as exc:
            raise store_error(exc) from exc
        finally:
            self.conn.execute("ROLLBACK")

    def schema_version(self) -> int:
        return schema_version(self.conn)

    def close(self) -> None:
        self.conn.close()


def open_engine(
    path: str | os.PathLike[str],
    *,
    migrate: bool = True,
    clock: Callable[[], float] | None = None,
) -> SQLiteEngine:
    """`_backend.open_engine` for a path (`connect(path, create=migrate)`)."""
    return SQLiteEngine(connect(path, create=migrate), clock or time.time)
