"""SQLite connections: opening and configuring them, the database file (created 0600, and
followed by device and inode), the schema's migrations, the write lock, and WAL checkpoints.

Invariants: a connection is configured (`busy_timeout`, foreign keys, `synchronous`, the
`ts_utf8` function the scans over every session use) before any use, and `synchronous` is
only ever 'NORMAL' or 'FULL' (`check_synchronous`: never interpolate anything else); a file
that is not SQLite, not ours, or from a newer library is refused with nothing written
(`SchemaTooNew`, `StoreError`); migrations run in one `BEGIN IMMEDIATE` transaction,
re-reading the version under the write lock; taking the write lock (`begin_immediate`)
retries "database is locked" for up to `LOCK_PATIENCE_S` (every `LOCK_POLL_MAX_S` at most
on the executor's connection), so that error never reaches a caller, and stops with nothing
begun once every caller of the batch withdrew; a checkpoint never raises (the WAL keeps
every commit).
"""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Callable

import attrs

from .. import _codec, _observe, _schema
from .._backend import Job
from .._errors import SchemaTooNew, StoreError, StoreLost
from .._naming import IN_MEMORY_NAMES

# PRAGMA synchronous in WAL mode: NORMAL (the default) survives a process crash, but the
# newest commits may roll back after a power loss or OS crash; FULL syncs the WAL at every
# commit, so a commit that returned survives those too.
SYNCHRONOUS = ("NORMAL", "FULL")

SCHEMA_VERSION = _schema.SQLITE_SCHEMA_VERSION
_MIGRATIONS = _schema.SQLITE_MIGRATIONS  # in `_schema`, beside PostgreSQL's
OUR_TABLES = _schema.SQLITE_OUR_TABLES

BUSY_TIMEOUT_MS = 5_000
# How long BEGIN IMMEDIATE keeps retrying a lock held by another process before the caller
# sees a StoreError.
LOCK_PATIENCE_S = 120.0
# How soon `begin_immediate` tries again for a lock another process holds (seconds),
# doubling up to the second figure: a try costs microseconds, a lock freed meanwhile
# stays unused for at most one pause.
LOCK_POLL_S = 0.0002
LOCK_POLL_MAX_S = 0.002
# The size a WAL file is cut back to once it restarts (`journal_size_limit`): a reader
# holding a snapshot, or several processes' checkpoints racing each other's commits, may let
# it grow for a while, and SQLite otherwise keeps the file at its largest size for good.
WAL_SIZE_LIMIT = 64 * 1024 * 1024
# How long a best-effort write (`run_nowait`: a shutdown's hand-back) tries for a lock
# another process holds, as PostgreSQL's NOWAIT_LOCK_TIMEOUT_MS: a commit's moment, not a
# long transaction.
NOWAIT_PATIENCE_S = 0.05


def file_name(path: str | os.PathLike[str]) -> str:
    """`path` as SQLite opens the file of that name: where sqlite3 is built with
    SQLITE_USE_URI (Debian's is), a name that starts with `file:` is read as a URI - `file:x`
    opens `x` - while the library creates, checks and watches the file `file:x` itself
    (`_create_owner_only`, `DatabaseFile`): two databases for one store. `./` keeps it a
    name (a `Path` cannot: `Path("./file:x")` is `file:x` again)."""
    name = os.fspath(path)
    return f"./{name}" if name.startswith("file:") else name


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
            file_name(path),
            timeout=BUSY_TIMEOUT_MS / 1000,
            isolation_level=None,
            check_same_thread=False,
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
    if path in IN_MEMORY_NAMES:
        return
    try:
        # At the file a symlink names (one provisioned before the first run): O_EXCL on
        # the link itself fails, whether or not its target exists.
        fd = os.open(os.path.realpath(path), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return
    except OSError as exc:
        raise StoreError(f"cannot open {path!r}: {exc}") from exc
    try:
        os.fchmod(fd, 0o600)  # the umask may have taken bits away from 0600 as well
    finally:
        os.close(fd)


# What `DatabaseFile.problem` finds that no later write can undo.
_LOST_FOR_GOOD = ("deleted", "replaced")


@attrs.define(eq=False)
class DatabaseFile:
    """The file the runtime's connections opened, by device and inode, so that a file
    deleted or replaced under a running runtime is noticed at the next write batch instead
    of commits going on into an orphaned inode (and vanishing at exit).

    `problem` costs one `os.stat` (a few microseconds) per batch. `identity` is None when
    there is no file to follow (`:memory:`). Safe from any thread: the worst race is the
    event logged twice.

    `path` is the name the runtime was given (a symlink re-pointed elsewhere is a replaced
    file); `tokens` the file it resolves to, where SQLite opened it and where every process
    keeps its liveness tokens (`engine.database_file`), whichever name it was given.
    """

    path: str
    identity: tuple[int, int] | None
    reported: bool = False
    tokens: str = attrs.field(
        kw_only=True,
        default=attrs.Factory(lambda self: os.path.realpath(self.path), takes_self=True),
    )

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
        # Logged once, and only for good: a file that cannot be looked at for a moment (a
        # permission changed on its directory) fails that write alone, and must not use up
        # the event its later deletion needs.
        if problem in _LOST_FOR_GOOD and not self.reported:
            self.reported = True
            _observe.database_file_lost(self.path, problem)
        return problem

    def refuse(self, jobs: list[Job]) -> bool:
        """Fail every job, writing nothing, if the file is gone or was replaced (`StoreLost`:
        for good) or cannot be looked at now (`StoreError`); True when it did."""
        problem = self.problem()
        if problem is None:
            return False
        error = StoreLost if problem in _LOST_FOR_GOOD else StoreError
        for job in jobs:
            job.error = error(
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
    conn.create_function("ts_utf8", 1, _is_utf8, deterministic=True)
    try:
        conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        conn.execute("PRAGMA foreign_keys = ON")
        conn.execute(f"PRAGMA synchronous = {synchronous}")
        conn.execute(f"PRAGMA journal_size_limit = {int(WAL_SIZE_LIMIT)}")
    except sqlite3.DatabaseError as exc:
        raise _unreadable(database_name(conn), exc) from exc


def _is_utf8(stored: bytes | None) -> bool:
    """`ts_utf8(CAST(column AS BLOB))`: whether a text column's bytes are UTF-8 text.
    SQLite keeps whatever bytes another tool writes as TEXT, and the driver refuses the
    whole read of a row that holds any other; a scan over many sessions passes over such
    rows with this, so one of them never fails the others' read."""
    return isinstance(_codec.utf8_or_bytes(stored or b""), str)


def database_name(conn: sqlite3.Connection) -> str:
    try:
        return str(conn.execute("PRAGMA database_list").fetchone()[2])
    except sqlite3.Error:
        return "the database"


def schema_version(conn: sqlite3.Connection) -> int:
    return int(conn.execute("PRAGMA user_version").fetchone()[0])


def migrate(conn: sqlite3.Connection) -> None:
    """Apply pending migrations in one `BEGIN IMMEDIATE` transaction, then switch the file
    to WAL; idempotent. The switch is lasting and outside any transaction, so it comes only
    once the file is ours: a migration that fails (another program's file, whose tables
    clash with ours) leaves that file in its own journal mode."""
    try:
        version = schema_version(conn)
        if version > SCHEMA_VERSION:
            raise SchemaTooNew(_too_new(conn))
        if version < SCHEMA_VERSION:
            _apply_migrations(conn)
        conn.execute("PRAGMA journal_mode = WAL")
    except sqlite3.Error as exc:
        raise StoreError(f"cannot migrate the schema: {exc}") from exc


def _apply_migrations(conn: sqlite3.Connection) -> None:
    """The pending migrations, in one `BEGIN IMMEDIATE` transaction."""
    begin_immediate(conn)
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
        raise _unreadable(path, exc) from exc
    if not tables >= OUR_TABLES:
        missing = ", ".join(sorted(OUR_TABLES - tables))
        raise StoreError(f"{path!r} is not a trio_sessions database (no {missing})")
    if schema_version(conn) > SCHEMA_VERSION:
        raise SchemaTooNew(_too_new(conn))


def _unreadable(name: str, exc: sqlite3.DatabaseError) -> StoreError:
    """Why a file could not be read as a database: another connection's lock that kept
    even readers out past the busy timeout (an exclusive locking mode, a rollback-journal
    write), or a file that is no SQLite database."""
    if isinstance(exc, sqlite3.OperationalError) and is_locked(exc):
        return StoreError(
            f"{name!r} is locked by another connection, which kept even readers out for"
            f" {BUSY_TIMEOUT_MS / 1000:g} s (an exclusive locking mode or a rollback-journal"
            " write); nothing was written - try again once it lets go"
        )
    return StoreError(f"{name!r} is not an SQLite database: {exc}")


def is_locked(exc: sqlite3.OperationalError) -> bool:
    return "locked" in str(exc) or "busy" in str(exc)


def begin_immediate(conn: sqlite3.Connection, abandoned: Callable[[], bool] | None = None) -> bool:
    """Take the write lock, waiting out other processes; "database is locked" never escapes.
    False, with nothing begun, once `abandoned()` says before a try that no one waits for
    the transaction any more (`_handoff.BatchStart`: every caller was cancelled).

    While another process holds the lock, BEGIN IMMEDIATE is tried again every
    `LOCK_POLL_S`, doubling up to `LOCK_POLL_MAX_S`. On a connection whose busy timeout is
    0 (`poll_for_lock`: the executor's worker connection) that is the whole wait: SQLite's
    own busy handler sleeps 1, 2, 5, 10, 15, 20, 25 ... 100 ms between its tries, so a lock
    freed just after one stays unused for up to that long - under a chat load (three
    processes committing hundreds of times a second) those sleeps were the write tails,
    25-130 ms. A failed try costs a few microseconds."""
    deadline = time.monotonic() + LOCK_PATIENCE_S
    pause = LOCK_POLL_S
    while True:
        if abandoned is not None and abandoned():
            return False
        try:
            conn.execute("BEGIN IMMEDIATE")
            return True
        except sqlite3.OperationalError as exc:
            if not is_locked(exc) or time.monotonic() >= deadline:
                raise
        time.sleep(pause)
        pause = min(pause * 2, LOCK_POLL_MAX_S)


def poll_for_lock(conn: sqlite3.Connection) -> sqlite3.Connection:
    """Switch SQLite's busy handler off on a connection whose writes all begin with
    `begin_immediate`, which then waits for the lock by itself, in short pauses. Its other
    statements never wait for a lock either: in WAL mode a reader never does, nor does a
    statement of a transaction holding the write lock, nor a PASSIVE checkpoint (the
    event loop's connection, `connect_nonblocking`, runs whole batches this way)."""
    conn.execute("PRAGMA busy_timeout = 0")
    return conn


def connect_nonblocking(
    path: str | os.PathLike[str], *, synchronous: str = "NORMAL"
) -> sqlite3.Connection:
    """A second connection for work on the event loop: it never waits for a lock and never
    checkpoints (a checkpoint may fsync); `checkpoint` runs on the worker connection."""
    conn = sqlite3.connect(
        file_name(path), timeout=0, isolation_level=None, check_same_thread=False
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
