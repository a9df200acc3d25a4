"""The SQLite engine: connections, schema and migrations, transactions, and the executors
that bring operations from trio to SQLite (one writer path, group commit).

Every write transaction is `BEGIN IMMEDIATE`, retried past "database is locked" for up to
`LOCK_PATIENCE_S`, so the lock error never reaches a caller. Several operations may share
one transaction (group commit), each inside its own savepoint, so one operation's error
rolls back only its own writes.

`ThreadExecutor` (production) queues operations and groups every operation queued in one
round of the event loop into one transaction (group commit). It runs that transaction on the
trio thread, on a second connection that never waits: when the write lock is free at once
(the common case, no other process writing), nothing crosses to a thread - a trio -> thread
hand-off costs more than a whole SQLite cycle on our machines, and when the event loop is
never idle (a producer submitting while drains run) every operation would pay one. When
another process holds the lock, the group goes to the worker thread, which waits for it;
operations arriving meanwhile join the next group. A lone caller (nothing queued, nothing
in flight, no other task runnable: the group would be just itself) skips the queue. The
loop's connection never checkpoints (a checkpoint may fsync); the worker does, every
`CHECKPOINT_EVERY` commits on the loop, beside the writers (PASSIVE), and holds them back
only when the WAL could not restart for `WAL_RESTART_FRAMES` frames. With WAL and
synchronous=NORMAL a commit does not fsync, so the event loop never blocks on a lock or a
disk flush. `InlineExecutor` (tests)
runs each operation on the trio thread in its own transaction, so virtual time never jumps
while SQLite works.

The database file is created 0600 (its -wal and -shm follow its mode), and every write batch
first checks that the path still names the file the executor opened (`DatabaseFile`): one
deleted or replaced under a running runtime fails the batch with `StoreError` instead of
committing into an orphaned inode. A WAL that checkpoints cannot shrink (a reader that
never ends) is logged once it passes `WAL_WARN_BYTES`.

Invariant, both executors: an operation that has begun is never abandoned. If its caller is
cancelled while it is queued, it is withdrawn unrun; once taken, the caller waits for it (as
`trio.to_thread.run_sync` does with `abandon_on_cancel=False`), so a write that committed is
always reported, never mistaken for one that did not happen.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sqlite3
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from typing import Any, TypeVar, TypeVarTuple, Unpack

import attrs
import trio

from . import _liveness, _observe, _schema
from ._backend import BackendName, Job, OwnChange, Params, StoreStatistics, Tx, driver_error, now_ms
from ._errors import SchemaTooNew, StoreError, TrioSessionsError
from ._filewatch import FileWatch, open_watch
from ._handoff import HandoffQueue, Queued, pumping

T = TypeVar("T")
Ts = TypeVarTuple("Ts")

# PRAGMA synchronous in WAL mode: NORMAL (the default) survives a process crash, but the
# newest commits may roll back after a power loss or OS crash; FULL syncs the WAL at every
# commit, so a commit that returned survives those too.
SYNCHRONOUS = ("NORMAL", "FULL")

SCHEMA_VERSION = _schema.SQLITE_SCHEMA_VERSION
_MIGRATIONS = _schema.SQLITE_MIGRATIONS  # in `_schema`, beside PostgreSQL's
OUR_TABLES = _schema.SQLITE_OUR_TABLES

BUSY_TIMEOUT_MS = 5_000
# How long BEGIN IMMEDIATE keeps retrying a lock held by another process before the caller
# sees a StoreError. Each attempt already waits `BUSY_TIMEOUT_MS` inside SQLite.
LOCK_PATIENCE_S = 120.0


# ---------------------------------------------------------------------------------------------
# Connection, schema, transactions


def connect(
    path: str | os.PathLike[str], *, create: bool = True, synchronous: str = "NORMAL"
) -> sqlite3.Connection:
    """Open a connection with our settings and bring the schema up to date.

    `SchemaTooNew` (and nothing written) when the file comes from a newer library;
    `StoreError` when `create` is false and the file is missing or not ours.
    """
    path = os.fspath(path)
    if not create and not os.path.exists(path):
        raise StoreError(f"no database at {path!r}")
    if create:
        _create_owner_only(path)
    try:
        conn = sqlite3.connect(
            path, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None, check_same_thread=False
        )
    except sqlite3.Error as exc:
        raise StoreError(f"cannot open {path!r}: {exc}") from exc
    try:
        _configure(conn, synchronous)
        if create:
            migrate(conn)
        else:
            _require_ours(conn, path)
    except BaseException:
        conn.close()
        raise
    return conn


def _create_owner_only(path: str) -> None:
    """Create a missing database file readable by its owner only (0600), whatever the umask.

    SQLite would create it 0644 - transcripts readable by every local user - and it gives
    the -wal and -shm files the database file's mode, so those are 0600 too. An existing
    file keeps the mode its operator chose.
    """
    if path in ("", ":memory:"):
        return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return
    except OSError as exc:
        raise StoreError(f"cannot open {path!r}: {exc}") from exc
    try:
        os.fchmod(fd, 0o600)  # the umask may have taken bits away from 0600 as well
    finally:
        os.close(fd)


@attrs.define(eq=False)
class DatabaseFile:
    """The file the runtime's connections opened, by device and inode, so that a file
    deleted or replaced under a running runtime is noticed at the next write batch instead
    of commits going on into an orphaned inode (and vanishing at exit).

    `problem` costs one `os.stat` (a few microseconds) per batch. `identity` is None when
    there is no file to follow (`:memory:`). Safe from any thread: the worst race is the
    event logged twice.
    """

    path: str
    identity: tuple[int, int] | None
    reported: bool = False

    @classmethod
    def opened(cls, path: str | os.PathLike[str]) -> DatabaseFile:
        """The file at `path` now (call right after connecting): an absolute path, so a
        later `chdir` changes nothing."""
        name = os.path.abspath(os.fspath(path))
        try:
            st = os.stat(name)
        except OSError:
            return cls(name, None)
        return cls(name, (st.st_dev, st.st_ino))

    def problem(self) -> str | None:
        """None while the path still names the opened file; else what happened to it."""
        if self.identity is None:
            return None
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            problem = "deleted"
        except OSError as exc:
            problem = f"inaccessible ({exc.strerror})"
        else:
            if (st.st_dev, st.st_ino) == self.identity:
                return None
            problem = "replaced"
        if not self.reported:
            self.reported = True
            _observe.database_file_lost(self.path, problem)
        return problem

    def refuse(self, jobs: list[Job]) -> bool:
        """Fail every job with `StoreError`, writing nothing, if the file is gone or was
        replaced; True when it did."""
        problem = self.problem()
        if problem is None:
            return False
        for job in jobs:
            job.error = StoreError(
                f"the database file {self.path!r} was {problem} while this runtime had it"
                " open: nothing more is written (restart on the right file)"
            )
        return True


def check_synchronous(value: object) -> str:
    """A valid `synchronous` setting ('NORMAL' or 'FULL'), or `ValueError`/`TypeError`."""
    if not isinstance(value, str):
        raise TypeError(f"synchronous must be a str, got {type(value).__name__}")
    if value not in SYNCHRONOUS:
        raise ValueError(f"synchronous must be 'NORMAL' or 'FULL', got {value!r}")
    return value


def _configure(conn: sqlite3.Connection, synchronous: str = "NORMAL") -> None:
    synchronous = check_synchronous(synchronous)  # never interpolate anything else
    try:
        conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        conn.execute("PRAGMA foreign_keys = ON")
        conn.execute(f"PRAGMA synchronous = {synchronous}")
    except sqlite3.DatabaseError as exc:
        raise StoreError(f"{_database_name(conn)!r} is not an SQLite database: {exc}") from exc


def _database_name(conn: sqlite3.Connection) -> str:
    try:
        return str(conn.execute("PRAGMA database_list").fetchone()[2])
    except sqlite3.Error:
        return "the database"


def schema_version(conn: sqlite3.Connection) -> int:
    return int(conn.execute("PRAGMA user_version").fetchone()[0])


def migrate(conn: sqlite3.Connection) -> None:
    """Apply pending migrations in one `BEGIN IMMEDIATE` transaction; idempotent."""
    try:
        if schema_version(conn) > SCHEMA_VERSION:
            raise SchemaTooNew(_too_new(conn))
        if schema_version(conn) == SCHEMA_VERSION:
            conn.execute("PRAGMA journal_mode = WAL")
            return
        conn.execute("PRAGMA journal_mode = WAL")
        _begin_immediate(conn)
        try:
            # Re-read under the write lock: another process may have migrated meanwhile.
            version = schema_version(conn)
            if version > SCHEMA_VERSION:
                raise SchemaTooNew(_too_new(conn))
            for target in range(version + 1, SCHEMA_VERSION + 1):
                for statement in _MIGRATIONS[target].split(";"):
                    if statement.strip():
                        conn.execute(statement)
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
    except sqlite3.Error as exc:
        raise StoreError(f"cannot migrate the schema: {exc}") from exc


def _too_new(conn: sqlite3.Connection) -> str:
    return (
        f"database schema version {schema_version(conn)} is newer than this trio_sessions "
        f"understands ({SCHEMA_VERSION}); upgrade trio_sessions. The file was not modified."
    )


def _require_ours(conn: sqlite3.Connection, path: str) -> None:
    """Refuse a file that is not SQLite, or not ours, without writing to it."""
    # Imported here: sqlite-utils costs ~0.2 s to import, and only operators' tools (which
    # open with create=False) need its introspection.
    import sqlite_utils

    try:
        tables = set(sqlite_utils.Database(conn).table_names())
    except sqlite3.DatabaseError as exc:
        raise StoreError(f"{path!r} is not an SQLite database: {exc}") from exc
    if not tables >= OUR_TABLES:
        missing = ", ".join(sorted(OUR_TABLES - tables))
        raise StoreError(f"{path!r} is not a trio_sessions database (no {missing})")
    if schema_version(conn) > SCHEMA_VERSION:
        raise SchemaTooNew(_too_new(conn))


def _is_locked(exc: sqlite3.OperationalError) -> bool:
    return "locked" in str(exc) or "busy" in str(exc)


def _begin_immediate(conn: sqlite3.Connection) -> None:
    """Take the write lock, waiting out other processes; "database is locked" never escapes."""
    deadline = time.monotonic() + LOCK_PATIENCE_S
    pause = 0.001
    while True:
        try:
            conn.execute("BEGIN IMMEDIATE")
            return
        except sqlite3.OperationalError as exc:
            if not _is_locked(exc) or time.monotonic() >= deadline:
                raise
            time.sleep(pause)
            pause = min(pause * 2, 0.05)


class SQLiteTx:
    """One open `BEGIN IMMEDIATE` transaction. The write lock is the database's only one,
    so it already serialises every session: `lock_session` is a no-op, and `now` is read
    once, after the lock was taken."""

    def __init__(self, conn: sqlite3.Connection, now: int, database: str | None = None) -> None:
        self.conn = conn
        self.now = now
        self._database = database  # its file, when the caller knows it (`DatabaseFile`)

    @property
    def dialect(self) -> BackendName:
        return "sqlite"

    def call(self, function: str, *args: Any, idempotent: bool = True) -> list[Any]:
        raise NotImplementedError("server-side functions are PostgreSQL's")

    def execute(self, sql: str, params: Params = ()) -> sqlite3.Cursor:
        return self.conn.execute(sql, params)

    def one(self, sql: str, params: Params = ()) -> Any:
        return self.conn.execute(sql, params).fetchone()

    def lock_session(self, session_id: str) -> None:
        # BEGIN IMMEDIATE holds the only write lock: every session is already serialised.
        pass

    def lock_claims(self, execution_ids: Sequence[str]) -> None:
        pass

    def notify(self, session_id: str, *, watchers_only: bool = False) -> None:
        # Other connections notice every commit through `PRAGMA data_version` (which cannot
        # say what changed, so `watchers_only` changes nothing here).
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

    def free_tokens(self, owner_ids: Sequence[str] | None) -> set[str]:
        # Lock files beside the database (`_liveness`): a few syscalls, no SQL.
        database = self._database or _database_file(self.conn)
        if database is None:
            return set()
        return _liveness.free_file_tokens(database, owner_ids)

    def forget_tokens(self, owner_ids: Sequence[str]) -> None:
        database = self._database or _database_file(self.conn)
        if database is not None:
            _liveness.forget_file_tokens(database, owner_ids)


def _database_file(conn: sqlite3.Connection) -> str | None:
    """The main database's file (None in memory: no liveness tokens there)."""
    return str(conn.execute("PRAGMA database_list").fetchone()[2]) or None


@asynccontextmanager
async def _hold_token(
    conn: sqlite3.Connection, owner_id: str, *, inline: bool
) -> AsyncIterator[_liveness.FileToken]:
    database = _database_file(conn)
    if database is None:
        raise StoreError("an in-memory database cannot hold liveness tokens")
    async with _liveness.hold_file_token(database, owner_id, inline=inline) as token:
        yield token


def _store_error(exc: BaseException) -> BaseException:
    return driver_error(exc) if isinstance(exc, sqlite3.Error) else exc


def run_batch(
    conn: sqlite3.Connection,
    clock: Callable[[], float],
    jobs: list[Job],
    file: DatabaseFile | None = None,
) -> None:
    """Run `jobs` in one `BEGIN IMMEDIATE` transaction (group commit).

    Each job runs in its own savepoint, so one job's error rolls back only its own writes;
    the others commit together. A failed BEGIN or COMMIT fails every job, with nothing
    written, and so does a `file` that was deleted or replaced. Errors are stored on the
    jobs, never raised.
    """
    if file is not None and file.refuse(jobs):
        return
    try:
        _begin_immediate(conn)
    except sqlite3.Error as exc:
        for job in jobs:
            job.error = _store_error(exc)
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
    except sqlite3.OperationalError as exc:
        if _is_locked(exc):
            return False
        for job in jobs:
            job.error = _store_error(exc)
        return True
    _run_jobs(conn, clock, jobs, file)
    return True


def connect_nonblocking(
    path: str | os.PathLike[str], *, synchronous: str = "NORMAL"
) -> sqlite3.Connection:
    """A second connection for work on the event loop: it never waits for a lock and never
    checkpoints (a checkpoint may fsync); `checkpoint` runs on the worker connection."""
    conn = sqlite3.connect(
        os.fspath(path), timeout=0, isolation_level=None, check_same_thread=False
    )
    _configure(conn, synchronous)
    conn.execute("PRAGMA busy_timeout = 0")
    conn.execute("PRAGMA wal_autocheckpoint = 0")
    return conn


def checkpoint(conn: sqlite3.Connection) -> tuple[int, int] | None:
    """Copy the WAL back into the database without blocking writers (PASSIVE); returns the
    WAL's length in frames and how many of them are copied. With no commit meanwhile, a
    whole copy lets the WAL restart from 0 at the next commit.

    Never raises: a failed checkpoint (an I/O error, a full disk) loses nothing - the WAL
    keeps every commit - so it is logged and None returned; the next one is due after
    another `CHECKPOINT_EVERY` commits on the loop (SQLite's own autocheckpoint on the
    worker connection runs meanwhile).
    """
    try:
        _busy, frames, copied = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
    except sqlite3.Error as exc:
        _observe.checkpoint_failed(exc)
        return None
    return int(frames), int(copied)


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
                job.error = _store_error(exc)


def _run_jobs_or_raise(
    conn: sqlite3.Connection,
    clock: Callable[[], float],
    jobs: list[Job],
    file: DatabaseFile | None = None,
) -> None:
    tx = SQLiteTx(conn, now_ms(clock), None if file is None else file.path)
    grouped = len(jobs) > 1
    for job in jobs:
        if grouped:
            conn.execute("SAVEPOINT job")
        try:
            job.result = job.op(tx, *job.args)
        except Exception as exc:
            job.error = _store_error(exc)
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
            return op(SQLiteTx(self.conn, now_ms(self.clock)), *args)
        except sqlite3.Error as exc:
            raise _store_error(exc) from exc
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


# WAL grows by a few pages per commit; checkpoint well before SQLite's own 1000-page mark.
CHECKPOINT_EVERY = 200
# A checkpoint that runs while commits continue never copies the newest frames, so the WAL
# cannot restart and keeps growing; once it is this long (~16 MB at 4 KiB pages), the next
# checkpoint holds the writers back until it is done.
WAL_RESTART_FRAMES = 4_000
# A WAL this long (bytes) that checkpoints cannot shrink is logged (WAL_NOT_CHECKPOINTED):
# four times what a busy runtime's WAL reaches before a checkpoint restarts it.
WAL_WARN_BYTES = 64 * 1024 * 1024


# How often a runtime looks for other connections' commits (`PRAGMA data_version` costs a
# few µs) where the WAL file cannot be watched.
CHANGE_POLL = 0.005
# The most often a reader reports a change: under load every commit is one, and a look per
# commit would cost more than the commits.
CHANGE_GAP = 0.005
# After a WAL write with no commit visible yet, the reader looks again after CHANGE_GAP,
# doubling, while the pause stays below this (seconds).
WRITE_SETTLE_MAX = 0.5


@attrs.define(eq=False)
class ChangeReader:
    """Reads on the trio thread on a connection of its own: a WAL reader never waits for the
    write lock, and `PRAGMA data_version` on it changes with every commit made on any other
    connection - this process's writers included, so watchers see their writes too. With a
    watch on the WAL file (`_filewatch`), an idle reader sleeps until a commit writes it."""

    conn: sqlite3.Connection
    clock: Callable[[], float]
    poll: float
    watch: FileWatch | None = None
    _version: int = 0
    _next_look: float = 0.0

    async def read(self, op: Callable[[Tx, Unpack[Ts]], T], *args: *Ts) -> T:
        """Run a read-only operation on one snapshot, on the trio thread."""
        await trio.lowlevel.checkpoint_if_cancelled()
        self.conn.execute("BEGIN")  # one snapshot for the whole operation
        try:
            result = op(SQLiteTx(self.conn, now_ms(self.clock)), *args)
        except sqlite3.Error as exc:
            raise _store_error(exc) from exc
        finally:
            self.conn.execute("ROLLBACK")
        await trio.lowlevel.cancel_shielded_checkpoint()
        return result

    async def wait_for_change(
        self,
        kick: trio.Event,
        fallback: float,
        *,
        own: OwnChange = None,
        follows: OwnChange = None,
    ) -> None:
        """Return when another connection committed, `kick` is set, or after `fallback` seconds."""
        with trio.move_on_after(fallback):
            with trio.move_on_at(self._next_look):
                await kick.wait()
            settle = 0.0  # > 0: the WAL was written, and no commit is visible yet
            while not kick.is_set():
                if self.watch is not None:
                    self.watch.discard()  # events so far are covered by the look below
                version = self.conn.execute("PRAGMA data_version").fetchone()[0]
                if version != self._version:
                    self._version = version
                    self._next_look = trio.current_time() + CHANGE_GAP
                    return
                if 0 < settle <= WRITE_SETTLE_MAX:
                    # A writer writes its frames, then publishes the commit in the WAL
                    # index (the -shm file, not watched): a look between the two sees
                    # nothing, and no event follows. Look again shortly.
                    with trio.move_on_after(settle):
                        await kick.wait()
                    settle *= 2
                    continue
                settle = CHANGE_GAP if await self._signal(kick) else 0.0

    async def _signal(self, kick: trio.Event) -> bool:
        """Sleep until the WAL file is written (True) or `kick` is set (or one poll,
        unwatched)."""
        watch = self.watch
        if watch is None:
            with trio.move_on_after(self.poll):
                await kick.wait()
            return False
        written = False
        async with trio.open_nursery() as nursery:

            async def on_write() -> None:
                nonlocal written
                await watch.wait()
                written = True
                nursery.cancel_scope.cancel()

            async def on_kick() -> None:
                await kick.wait()
                nursery.cancel_scope.cancel()

            nursery.start_soon(on_kick)
            nursery.start_soon(on_write)
        return written


@attrs.define(eq=False)
class InlineExecutor:
    """Each operation runs in its own transaction on the trio thread (deterministic tests)."""

    conn: sqlite3.Connection
    clock: Callable[[], float]
    reader: ChangeReader
    backend: BackendName = "sqlite"
    transactions: int = 0
    file: DatabaseFile | None = None

    async def read(self, op: Callable[[Tx, Unpack[Ts]], T], *args: *Ts) -> T:
        return await self.reader.read(op, *args)

    async def wait_for_change(
        self,
        kick: trio.Event,
        fallback: float,
        *,
        own: OwnChange = None,
        follows: OwnChange = None,
    ) -> None:
        # Deterministic tests: no background look at the store (it would race the steps a
        # test drives under the virtual clock), only an explicit kick. The change signal
        # itself is tested on the threaded store, in real time.
        await kick.wait()

    def statistics(self) -> StoreStatistics:
        return StoreStatistics("sqlite", transactions=self.transactions)

    def hold_token(self, owner_id: str) -> contextlib.AbstractAsyncContextManager[Any]:
        return _hold_token(self.conn, owner_id, inline=True)

    async def run(self, op: Callable[[Tx, Unpack[Ts]], T], *args: *Ts) -> T:
        await trio.lowlevel.checkpoint_if_cancelled()
        job = Job(op, args)
        self.transactions += 1
        run_batch(self.conn, self.clock, [job], self.file)
        await trio.lowlevel.cancel_shielded_checkpoint()
        result: T = job.unwrap()
        return result

    async def run_nowait(self, op: Callable[[Tx, Unpack[Ts]], T], *args: *Ts) -> T:
        await trio.lowlevel.checkpoint_if_cancelled()
        self.conn.execute("PRAGMA busy_timeout = 0")  # really not waiting, here too
        try:
            result: T = _run_nowait(self.conn, self.clock, op, args, self.file)
        finally:
            self.conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        await trio.lowlevel.cancel_shielded_checkpoint()
        return result


def _run_nowait(
    conn: sqlite3.Connection,
    clock: Callable[[], float],
    op: Callable[..., T],
    args: tuple[Any, ...],
    file: DatabaseFile | None,
) -> T:
    job = Job(op, args)
    if not try_run_batch(conn, clock, [job], file):
        raise StoreError("the database is locked by another process; not waiting")
    result: T = job.unwrap()
    return result


@attrs.define(eq=False)
class ThreadExecutor:
    """Group commit on the loop, or through the worker thread when another process holds
    the write lock. Use `open_thread_executor`."""

    conn: sqlite3.Connection
    clock: Callable[[], float]
    reader: ChangeReader
    inline_conn: sqlite3.Connection | None = None
    file: DatabaseFile | None = None
    # The database's page size: the WAL's length in bytes is frames x this.
    page_size: int = 4096
    _handoff: HandoffQueue = attrs.Factory(HandoffQueue)
    _limiter: trio.CapacityLimiter = attrs.Factory(lambda: trio.CapacityLimiter(1))
    _nursery: trio.Nursery | None = None
    _inline_since_checkpoint: int = 0
    _checkpoint_due: bool = False
    _checkpointing: bool = False
    _wal_frames: int = 0
    _wal_warned: bool = False
    inline_runs: int = 0
    thread_handoffs: int = 0
    backend: BackendName = "sqlite"

    def statistics(self) -> StoreStatistics:
        handoffs = self.thread_handoffs
        return StoreStatistics(
            "sqlite",
            transactions=handoffs + self.inline_runs,
            handoffs=handoffs,
            inline_runs=self.inline_runs,
        )

    async def run(self, op: Callable[[Tx, Unpack[Ts]], T], *args: *Ts) -> T:
        # Cancellation first: a caller cancelled while the runtime closes sees Cancelled,
        # not an error about the executor it was cancelled out of.
        await trio.lowlevel.checkpoint_if_cancelled()
        self._handoff.check_open()
        job = Job(op, args)
        if self._lone_caller():
            assert self.inline_conn is not None
            if try_run_batch(self.inline_conn, self.clock, [job], self.file):
                self._count_inline_commit()
                await trio.lowlevel.cancel_shielded_checkpoint()
                inline_result: T = job.unwrap()
                return inline_result
        result: T = await self._handoff.submit(job)
        return result

    async def run_nowait(self, op: Callable[[Tx, Unpack[Ts]], T], *args: *Ts) -> T:
        await trio.lowlevel.checkpoint_if_cancelled()
        if self._handoff.in_flight or self.inline_conn is None:
            # The worker holds this process's write lock now: its batch ends soon.
            return await self.run(op, *args)
        result: T = _run_nowait(self.inline_conn, self.clock, op, args, self.file)
        await trio.lowlevel.cancel_shielded_checkpoint()
        return result

    async def read(self, op: Callable[[Tx, Unpack[Ts]], T], *args: *Ts) -> T:
        return await self.reader.read(op, *args)

    async def wait_for_change(
        self,
        kick: trio.Event,
        fallback: float,
        *,
        own: OwnChange = None,
        follows: OwnChange = None,
    ) -> None:
        await self.reader.wait_for_change(kick, fallback, own=own, follows=follows)

    def hold_token(self, owner_id: str) -> contextlib.AbstractAsyncContextManager[Any]:
        return _hold_token(self.reader.conn, owner_id, inline=False)

    def _lone_caller(self) -> bool:
        return (
            self.inline_conn is not None
            and self._handoff.idle()
            and trio.lowlevel.current_statistics().tasks_runnable == 0
        )

    def _count_inline_commit(self) -> None:
        self.inline_runs += 1
        self._inline_since_checkpoint += 1
        if self._inline_since_checkpoint < CHECKPOINT_EVERY or self._checkpointing:
            return
        self._inline_since_checkpoint = 0
        if self._wal_frames >= WAL_RESTART_FRAMES or self._nursery is None:
            self._checkpoint_due = True  # the pump runs it with the writers held back
            self._handoff.poke()
        else:
            self._checkpointing = True
            self._nursery.start_soon(self._checkpoint_beside_writers)

    async def _checkpoint_beside_writers(self) -> None:
        # PASSIVE never takes the write lock: commits on the loop go on meanwhile, so the
        # event loop never waits for the copy or its fsync.
        try:
            done = await trio.to_thread.run_sync(checkpoint, self.conn, limiter=self._limiter)
        finally:
            self._checkpointing = False
        if done is not None:
            # Commits went on meanwhile: the WAL restarts only after a checkpoint with the
            # writers held back, so its length is what counts.
            self._wal_frames = done[0]
            self._watch_wal()

    async def _hand_off(self, batch: list[Queued]) -> None:
        jobs = [queued.job for queued in batch]
        if self.file is not None and self.file.refuse(jobs):
            await trio.lowlevel.cancel_shielded_checkpoint()
            return
        # Group commit on the trio thread when the write lock is free: a thread hand-off
        # costs more than the whole group's SQL, and when the event loop is never idle
        # (a producer submitting while drains run) every operation would pay one.
        if self.inline_conn is not None and try_run_batch(self.inline_conn, self.clock, jobs):
            self._count_inline_commit()
            await trio.lowlevel.cancel_shielded_checkpoint()
            return
        self.thread_handoffs += 1
        await trio.to_thread.run_sync(
            run_batch, self.conn, self.clock, jobs, self.file, limiter=self._limiter
        )

    async def _checkpoint_if_due(self) -> None:
        if not self._checkpoint_due:
            return
        self._checkpoint_due = False
        # In flight for the loop's commits too: a checkpoint racing new commits never copies
        # every frame, and the WAL then cannot restart (it grew past 90 MB in a 100k-cycle
        # run). Operations meanwhile queue and group-commit right after.
        self._handoff.in_flight = True
        try:
            done = await trio.to_thread.run_sync(checkpoint, self.conn, limiter=self._limiter)
        finally:
            self._handoff.in_flight = False
        if done is not None:
            frames, copied = done
            self._wal_frames = frames - copied  # copied whole: the WAL restarts
            self._watch_wal()

    def _watch_wal(self) -> None:
        """Log once per crossing a WAL that grew past `WAL_WARN_BYTES`: checkpoints cannot
        copy it back, because a reader (another connection's open read transaction) still
        uses its older frames, so it cannot restart and only grows."""
        wal_bytes = self._wal_frames * self.page_size
        if wal_bytes < WAL_WARN_BYTES:
            self._wal_warned = False
        elif not self._wal_warned:
            self._wal_warned = True
            path = self.file.path if self.file is not None else _database_name(self.conn)
            _observe.wal_not_checkpointed(path, wal_bytes, self._wal_frames, WAL_WARN_BYTES)


@asynccontextmanager
async def open_thread_executor(
    conn: sqlite3.Connection,
    clock: Callable[[], float],
    reader: ChangeReader,
    *,
    inline_conn: sqlite3.Connection | None = None,
    file: DatabaseFile | None = None,
) -> AsyncIterator[ThreadExecutor]:
    """A `ThreadExecutor` whose pump lives in its own nursery, for the block's duration.

    `inline_conn` (from `connect_nonblocking`) enables the lone-caller fast path; `file`,
    the check that the database file is still the one opened, at every write batch.
    """
    page_size = int(conn.execute("PRAGMA page_size").fetchone()[0])
    executor = ThreadExecutor(
        conn, clock, reader, inline_conn=inline_conn, file=file, page_size=page_size
    )
    async with (
        trio.open_nursery() as nursery,
        pumping(executor._handoff, executor._hand_off, executor._checkpoint_if_due),
    ):
        executor._nursery = nursery
        yield executor


@attrs.frozen
class SQLiteStore:
    """An SQLite file, and how to reach it from trio (the embedded default, one host).

    `inline=True` runs SQLite on the trio thread (deterministic tests with a virtual clock);
    the default hands work to a thread and groups concurrent operations per hand-off.
    `synchronous` is SQLite's durability setting for every connection: `"NORMAL"` (default)
    survives a process crash, but the newest commits may roll back after a power loss or an
    OS crash; `"FULL"` makes a commit that returned survive those too (an fsync per commit).
    """

    path: str | os.PathLike[str]
    inline: bool = False
    synchronous: str = attrs.field(
        default="NORMAL", kw_only=True, validator=lambda _s, _a, value: check_synchronous(value)
    )
    # Test seam: wraps each connection the runtime opens, e.g. to raise
    # sqlite3.OperationalError at a chosen statement (fault injection, counting).
    wrap_connection: Callable[[sqlite3.Connection], Any] | None = attrs.field(
        default=None, kw_only=True, repr=False
    )

    @asynccontextmanager
    async def open_executor(
        self, clock: Callable[[], float] | None
    ) -> AsyncIterator[InlineExecutor | ThreadExecutor]:
        # One host: the lease clock is the runtime's (wall clock unless a test passes one).
        clock = clock or time.time
        with contextlib.ExitStack() as connections:
            if self.inline:
                conn = connections.enter_context(
                    contextlib.closing(connect(self.path, synchronous=self.synchronous))
                )
                file = DatabaseFile.opened(self.path)
                reader = self._reader(connections, clock, CHANGE_POLL)
                yield InlineExecutor(self._wrapped(conn), clock, reader, file=file)
                return
            conn = connections.enter_context(
                contextlib.closing(
                    await trio.to_thread.run_sync(
                        functools.partial(connect, self.path, synchronous=self.synchronous)
                    )
                )
            )
            file = DatabaseFile.opened(self.path)
            inline_conn = connections.enter_context(
                contextlib.closing(connect_nonblocking(self.path, synchronous=self.synchronous))
            )
            reader = self._reader(connections, clock, CHANGE_POLL)
            async with open_thread_executor(
                self._wrapped(conn),
                clock,
                reader,
                inline_conn=self._wrapped(inline_conn),
                file=file,
            ) as executor:
                yield executor

    def _reader(
        self, connections: contextlib.ExitStack, clock: Callable[[], float], poll: float
    ) -> ChangeReader:
        conn = connections.enter_context(
            contextlib.closing(connect_nonblocking(self.path, synchronous=self.synchronous))
        )
        conn.execute("SELECT 1 FROM sqlite_master LIMIT 1")  # the WAL file exists from here
        watch = open_watch(f"{os.fspath(self.path)}-wal")
        if watch is not None:
            connections.callback(watch.close)
        return ChangeReader(conn, clock, poll, watch)

    def _wrapped(self, conn: sqlite3.Connection) -> sqlite3.Connection:
        return conn if self.wrap_connection is None else self.wrap_connection(conn)
