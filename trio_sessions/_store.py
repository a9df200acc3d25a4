"""All SQL of trio_sessions: schema, migrations and the fenced operations (synchronous).

Each operation is a function `op(tx, ...)` run inside one write transaction that the
executor opened with `BEGIN IMMEDIATE` (several operations may share one transaction: group
commit, each inside its own savepoint). `tx.now` is read once, after the write lock was
taken, so a fence never compares against a time from before a lock wait.

Invariants kept here:
* the acquire path inserts a claim only when no `session_execution` row exists for the
  session (never an overwrite, live or expired, own or foreign) and the doorbell is set;
* every write a drain makes is fenced on its claim - the *claim fence*: `id = :execution
  AND owner_id = :owner AND expires_at > :now` - and a fence that matches no row raises
  `LeaseLost` with nothing written;
* a heartbeat never revives an expired lease; recovery replaces a claim only fenced on the
  exact old execution id still being expired;
* an input is either pending in `session_input` or a user message, never both, never none.

PostgreSQL can mirror these statements one for one; nothing here depends on SQLite's
single-writer lock except `BEGIN IMMEDIATE` itself.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import attrs

from . import _codec, _decisions, _transcript
from ._decisions import AcquireVerdict, ClaimRow, RecoveryDecision, RecoveryFacts
from ._errors import (
    InputConflict,
    LeaseLost,
    MalformedRecord,
    SchemaTooNew,
    StoreError,
    TrioSessionsError,
)
from ._model import (
    BUDGET_EXHAUSTED,
    INTERRUPTED,
    OWNER_LOST,
    AssistantData,
    Input,
    Message,
)

T = TypeVar("T")

SCHEMA_VERSION = 1

# The small, hot tables are WITHOUT ROWID: keyed by their text primary key directly, each
# write touches one b-tree less (fewer WAL pages per commit). Messages keep a rowid: their
# rows are large.
_MIGRATIONS: dict[int, str] = {
    1: """
CREATE TABLE session(
    id TEXT PRIMARY KEY,
    time_created INTEGER NOT NULL,
    time_woken INTEGER,
    wakes INTEGER NOT NULL DEFAULT 0,
    wake_attempts INTEGER NOT NULL DEFAULT 0
        CONSTRAINT session_wake_attempts_check CHECK (wake_attempts >= 0),
    input_seq INTEGER NOT NULL DEFAULT 0
) WITHOUT ROWID;
CREATE INDEX session_time_woken ON session(time_woken) WHERE time_woken IS NOT NULL;
CREATE TABLE session_input(
    id TEXT PRIMARY KEY,
    session_id TEXT NOT NULL REFERENCES session(id) ON DELETE CASCADE,
    seq INTEGER NOT NULL,
    payload TEXT NOT NULL,
    time_created INTEGER NOT NULL,
    UNIQUE(session_id, seq)
) WITHOUT ROWID;
CREATE TABLE session_execution(
    id TEXT PRIMARY KEY,
    session_id TEXT NOT NULL UNIQUE REFERENCES session(id) ON DELETE CASCADE,
    owner_id TEXT NOT NULL,
    phase TEXT NOT NULL
        CONSTRAINT session_execution_phase_check CHECK (phase IN ('running', 'cancelling')),
    anchor_seq INTEGER,
    time_created INTEGER NOT NULL,
    heartbeat_at INTEGER,
    expires_at INTEGER NOT NULL
) WITHOUT ROWID;
CREATE INDEX session_execution_expires_at ON session_execution(expires_at);
CREATE TABLE session_recovery(
    execution_id TEXT PRIMARY KEY,
    session_id TEXT NOT NULL,
    owner_id TEXT NOT NULL,
    expires_at INTEGER NOT NULL,
    recovery_error TEXT,
    time_created INTEGER NOT NULL,
    time_quarantined INTEGER
) WITHOUT ROWID;
CREATE TABLE session_message(
    id TEXT PRIMARY KEY,
    session_id TEXT NOT NULL REFERENCES session(id) ON DELETE CASCADE,
    execution_id TEXT,
    input_id TEXT UNIQUE,
    role TEXT NOT NULL CONSTRAINT session_message_role_check
        CHECK (role IN ('user', 'assistant', 'system')),
    seq INTEGER NOT NULL,
    data TEXT NOT NULL,
    time_created INTEGER NOT NULL,
    time_updated INTEGER NOT NULL,
    UNIQUE(session_id, seq)
);
CREATE INDEX session_message_execution ON session_message(execution_id)
    WHERE execution_id IS NOT NULL;
""",
}

OUR_TABLES = frozenset(
    {"session", "session_input", "session_execution", "session_recovery", "session_message"}
)

BUSY_TIMEOUT_MS = 5_000
# How long BEGIN IMMEDIATE keeps retrying a lock held by another process before the caller
# sees a StoreError. Each attempt already waits `BUSY_TIMEOUT_MS` inside SQLite.
LOCK_PATIENCE_S = 120.0


# ---------------------------------------------------------------------------------------------
# Connection, schema, transactions


def connect(path: str | os.PathLike[str], *, create: bool = True) -> sqlite3.Connection:
    """Open a connection with our settings and bring the schema up to date.

    `SchemaTooNew` (and nothing written) when the file comes from a newer library;
    `StoreError` when `create` is false and the file is missing or not ours.
    """
    path = os.fspath(path)
    if not create and not os.path.exists(path):
        raise StoreError(f"no database at {path!r}")
    try:
        conn = sqlite3.connect(
            path, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None, check_same_thread=False
        )
    except sqlite3.Error as exc:
        raise StoreError(f"cannot open {path!r}: {exc}") from exc
    try:
        _configure(conn)
        if create:
            migrate(conn)
        else:
            _require_ours(conn, path)
    except BaseException:
        conn.close()
        raise
    return conn


def _configure(conn: sqlite3.Connection) -> None:
    try:
        conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        conn.execute("PRAGMA foreign_keys = ON")
        conn.execute("PRAGMA synchronous = NORMAL")
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


@attrs.define
class Tx:
    """One open write transaction: the connection and the instant it runs at (ms)."""

    conn: sqlite3.Connection
    now: int

    def execute(self, sql: str, params: Sequence[Any] | dict[str, Any] = ()) -> sqlite3.Cursor:
        return self.conn.execute(sql, params)

    def one(self, sql: str, params: Sequence[Any] | dict[str, Any] = ()) -> Any:
        return self.conn.execute(sql, params).fetchone()


@attrs.define(eq=False)
class Job:
    """One operation waiting for a transaction; `result`/`error` are filled by `run_batch`."""

    op: Callable[..., Any]
    args: tuple[Any, ...]
    result: Any = None
    error: BaseException | None = None

    def unwrap(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.result


def _store_error(exc: BaseException) -> BaseException:
    if isinstance(exc, sqlite3.Error):
        error = StoreError(f"{type(exc).__name__}: {exc}")
        error.__cause__ = exc
        return error
    return exc


def run_batch(conn: sqlite3.Connection, clock: Callable[[], float], jobs: list[Job]) -> None:
    """Run `jobs` in one `BEGIN IMMEDIATE` transaction (group commit).

    Each job runs in its own savepoint, so one job's error rolls back only its own writes;
    the others commit together. A failed BEGIN or COMMIT fails every job, with nothing
    written. Errors are stored on the jobs, never raised.
    """
    try:
        _begin_immediate(conn)
    except sqlite3.Error as exc:
        for job in jobs:
            job.error = _store_error(exc)
        return
    _run_jobs(conn, clock, jobs)


def try_run_batch(conn: sqlite3.Connection, clock: Callable[[], float], jobs: list[Job]) -> bool:
    """Like `run_batch`, but only if the write lock is free right now: False, with nothing
    run, when another connection holds it. Never waits (the connection's busy timeout is
    expected to be 0), so it is safe to call on the event loop."""
    try:
        conn.execute("BEGIN IMMEDIATE")
    except sqlite3.OperationalError as exc:
        if _is_locked(exc):
            return False
        for job in jobs:
            job.error = _store_error(exc)
        return True
    _run_jobs(conn, clock, jobs)
    return True


def connect_nonblocking(path: str | os.PathLike[str]) -> sqlite3.Connection:
    """A second connection for work on the event loop: it never waits for a lock and never
    checkpoints (a checkpoint may fsync); `checkpoint` runs on the worker connection."""
    conn = sqlite3.connect(
        os.fspath(path), timeout=0, isolation_level=None, check_same_thread=False
    )
    _configure(conn)
    conn.execute("PRAGMA busy_timeout = 0")
    conn.execute("PRAGMA wal_autocheckpoint = 0")
    return conn


def checkpoint(conn: sqlite3.Connection) -> None:
    """Copy the WAL back into the database without blocking writers (PASSIVE)."""
    conn.execute("PRAGMA wal_checkpoint(PASSIVE)")


def _run_jobs(conn: sqlite3.Connection, clock: Callable[[], float], jobs: list[Job]) -> None:
    """Run jobs inside the open transaction and commit. Never raises: errors go on jobs.

    SQLite may roll a whole transaction back by itself (disk full, I/O error): then no job
    committed, whatever it returned, and every job reports the failure.
    """
    try:
        _run_jobs_or_raise(conn, clock, jobs)
    except sqlite3.Error as exc:
        if conn.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
        for job in jobs:
            job.result = None
            if not isinstance(job.error, TrioSessionsError):  # a job's own refusal stays
                job.error = _store_error(exc)


def _run_jobs_or_raise(
    conn: sqlite3.Connection, clock: Callable[[], float], jobs: list[Job]
) -> None:
    tx = Tx(conn, now_ms(clock))
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


def now_ms(clock: Callable[[], float]) -> int:
    return int(clock() * 1000)


def new_id() -> str:
    return uuid.uuid4().hex


# ---------------------------------------------------------------------------------------------
# Fences and small reads


def _claim_row(tx: Tx, session_id: str) -> ClaimRow | None:
    row = tx.one(
        "SELECT id, owner_id, phase, expires_at FROM session_execution WHERE session_id = ?",
        (session_id,),
    )
    return None if row is None else ClaimRow(*row)


def _require_claim(tx: Tx, execution_id: str, owner_id: str) -> str:
    """The claim fence for writes to other tables; returns the claim's session id.

    Read inside this BEGIN IMMEDIATE transaction, so nobody can move the claim before the
    writes that follow commit.
    """
    row = tx.one(
        "SELECT session_id FROM session_execution WHERE id = ? AND owner_id = ? AND expires_at > ?",
        (execution_id, owner_id, tx.now),
    )
    if row is None:
        raise LeaseLost(f"execution {execution_id!r} no longer holds a live claim")
    return str(row[0])


def _next_message_seq(tx: Tx, session_id: str) -> int:
    row = tx.one("SELECT MAX(seq) FROM session_message WHERE session_id = ?", (session_id,))
    return 1 if row[0] is None else int(row[0]) + 1


def _newest_seq(tx: Tx, session_id: str) -> int | None:
    row = tx.one("SELECT MAX(seq) FROM session_message WHERE session_id = ?", (session_id,))
    return None if row[0] is None else int(row[0])


def _has_pending_inputs(tx: Tx, session_id: str) -> bool:
    return (
        tx.one("SELECT 1 FROM session_input WHERE session_id = ? LIMIT 1", (session_id,))
        is not None
    )


def _doorbell_set(tx: Tx, session_id: str) -> bool:
    row = tx.one("SELECT time_woken FROM session WHERE id = ?", (session_id,))
    return row is not None and row[0] is not None


def _ring(tx: Tx, session_id: str) -> None:
    tx.execute(
        "UPDATE session SET time_woken = COALESCE(time_woken, ?), wakes = wakes + 1 WHERE id = ?",
        (tx.now, session_id),
    )


def _take_doorbell(tx: Tx, session_id: str) -> None:
    tx.execute("UPDATE session SET time_woken = NULL, wakes = 0 WHERE id = ?", (session_id,))


def _reset_attempts(tx: Tx, session_id: str) -> None:
    # Conditional, so the common case (already 0) dirties no page.
    tx.execute(
        "UPDATE session SET wake_attempts = 0 WHERE id = ? AND wake_attempts != 0", (session_id,)
    )


# ---------------------------------------------------------------------------------------------
# Wake and submit


def wake(tx: Tx, session_id: str) -> None:
    """Durable doorbell: create the session if absent, set `time_woken` (if unset), count it."""
    tx.execute(
        "INSERT INTO session(id, time_created, time_woken, wakes) VALUES (?, ?, ?, 1)"
        " ON CONFLICT(id) DO UPDATE SET time_woken = COALESCE(session.time_woken, ?),"
        " wakes = session.wakes + 1",
        (session_id, tx.now, tx.now, tx.now),
    )


def submit(tx: Tx, session_id: str, payload: str, input_id: str) -> str:
    """Admit an input and ring the doorbell, idempotently by `input_id`.

    The same id for the same session returns the stored id and writes nothing, also after
    the input was taken; the same id for another session raises `InputConflict`.
    """
    if not _known_input(tx, session_id, input_id):
        _insert_input(tx, session_id, payload, input_id, ring=True)
    return input_id


def _known_input(tx: Tx, session_id: str, input_id: str) -> bool:
    """Whether the input id is stored (pending or taken); `InputConflict` for another session."""
    known = tx.one(
        "SELECT session_id FROM session_input WHERE id = ?"
        " UNION ALL SELECT session_id FROM session_message WHERE input_id = ? LIMIT 1",
        (input_id, input_id),
    )
    if known is None:
        return False
    if known[0] != session_id:
        raise InputConflict(
            f"input id {input_id!r} belongs to session {known[0]!r}, not {session_id!r}"
        )
    return True


def _insert_input(tx: Tx, session_id: str, payload: str, input_id: str, *, ring: bool) -> None:
    """Insert a pending input; `ring=False` when a claim inserted in this same transaction
    takes the wake at once (so the doorbell is never written)."""
    doorbell = tx.now if ring else None
    row = tx.one(
        "INSERT INTO session(id, time_created, time_woken, wakes, input_seq)"
        " VALUES (?, ?, ?, ?, 1)"
        " ON CONFLICT(id) DO UPDATE SET time_woken = COALESCE(session.time_woken, ?),"
        " wakes = session.wakes + ?, input_seq = session.input_seq + 1"
        " RETURNING input_seq",
        (session_id, tx.now, doorbell, int(ring), doorbell, int(ring)),
    )
    tx.execute(
        "INSERT INTO session_input(id, session_id, seq, payload, time_created)"
        " VALUES (?, ?, ?, ?, ?)",
        (input_id, session_id, row[0], payload, tx.now),
    )


# ---------------------------------------------------------------------------------------------
# Acquire, heartbeat, finish


@attrs.frozen
class Acquired:
    """The result of the acquire transaction."""

    verdict: AcquireVerdict
    attempt: int = 0
    holder: str | None = None


def acquire(tx: Tx, session_id: str, execution_id: str, owner_id: str, lease_ms: int) -> Acquired:
    """Insert the claim only if no claim row exists and the doorbell is set; take the doorbell."""
    session = tx.one("SELECT time_woken FROM session WHERE id = ?", (session_id,))
    claim = _claim_row(tx, session_id)
    verdict = _decisions.acquire_verdict(
        doorbell_set=session is not None and session[0] is not None, claim_row=claim
    )
    if verdict is not AcquireVerdict.CLAIM:
        return Acquired(verdict, holder=None if claim is None else claim.owner_id)
    return _insert_claim(tx, session_id, execution_id, owner_id, lease_ms)


def wake_and_acquire(
    tx: Tx, session_id: str, execution_id: str, owner_id: str, lease_ms: int
) -> tuple[None, Acquired]:
    """`wake` and the acquire it rings for, in one transaction.

    When the claim is taken here, the doorbell is rung and taken at once, so it is never
    written: the same durable result with fewer pages per commit.
    """
    claim = _claim_row(tx, session_id)
    if claim is not None:
        wake(tx, session_id)
        return None, Acquired(AcquireVerdict.HELD, holder=claim.owner_id)
    _ensure_session(tx, session_id)
    return None, _insert_claim(tx, session_id, execution_id, owner_id, lease_ms)


def submit_and_acquire(
    tx: Tx,
    session_id: str,
    payload: str,
    input_id: str,
    execution_id: str,
    owner_id: str,
    lease_ms: int,
) -> tuple[str, Acquired]:
    """`submit` and the acquire it rings for, in one transaction (see `wake_and_acquire`)."""
    claim = _claim_row(tx, session_id)
    if claim is not None or _known_input(tx, session_id, input_id):
        stored = submit(tx, session_id, payload, input_id)
        return stored, acquire(tx, session_id, execution_id, owner_id, lease_ms)
    _insert_input(tx, session_id, payload, input_id, ring=False)
    return input_id, _insert_claim(tx, session_id, execution_id, owner_id, lease_ms)


def _ensure_session(tx: Tx, session_id: str) -> None:
    tx.execute(
        "INSERT INTO session(id, time_created) VALUES (?, ?) ON CONFLICT(id) DO NOTHING",
        (session_id, tx.now),
    )


def _insert_claim(
    tx: Tx, session_id: str, execution_id: str, owner_id: str, lease_ms: int
) -> Acquired:
    """Insert the claim for a session known to have no claim row; take a set doorbell."""
    row = tx.one("SELECT time_woken, wake_attempts FROM session WHERE id = ?", (session_id,))
    tx.execute(
        "INSERT INTO session_execution"
        "(id, session_id, owner_id, phase, anchor_seq, time_created, heartbeat_at, expires_at)"
        " VALUES (?, ?, ?, 'running', ?, ?, NULL, ?)",
        (
            execution_id,
            session_id,
            owner_id,
            _newest_seq(tx, session_id),
            tx.now,
            tx.now + lease_ms,
        ),
    )
    if row[0] is not None:
        _take_doorbell(tx, session_id)
    return Acquired(AcquireVerdict.CLAIM, attempt=int(row[1]))


def heartbeat(
    tx: Tx, owner_id: str, execution_ids: Iterable[str], lease_ms: int
) -> dict[str, str | None]:
    """Renew every listed claim in this one transaction; returns execution id -> phase.

    None means the lease is lost: the fence (exact id, owner, live lease) matched nothing,
    so an expired lease is never revived.
    """
    phases: dict[str, str | None] = {}
    for execution_id in execution_ids:
        row = tx.one(
            "UPDATE session_execution SET expires_at = ?, heartbeat_at = ?"
            " WHERE id = ? AND owner_id = ? AND expires_at > ? RETURNING phase",
            (tx.now + lease_ms, tx.now, execution_id, owner_id, tx.now),
        )
        phases[execution_id] = None if row is None else str(row[0])
    return phases


def finish_iteration(tx: Tx, execution_id: str, owner_id: str) -> bool:
    """After a drain returned: take a set doorbell and continue (True), or release (False).

    Serialised with `wake` by the write lock: a wake either committed before this, and is
    taken here, or finds no claim afterwards and leads to a fresh acquisition.
    """
    session_id = _require_claim(tx, execution_id, owner_id)
    if _doorbell_set(tx, session_id):
        _take_doorbell(tx, session_id)
        return True
    _delete_claim(tx, execution_id, owner_id)
    _reset_attempts(tx, session_id)
    return False


def _delete_claim(tx: Tx, execution_id: str, owner_id: str) -> None:
    # The claim fence, in the WHERE clause of the write itself.
    deleted = tx.execute(
        "DELETE FROM session_execution WHERE id = ? AND owner_id = ? AND expires_at > ?",
        (execution_id, owner_id, tx.now),
    ).rowcount
    if deleted != 1:
        raise LeaseLost(f"execution {execution_id!r} no longer holds a live claim")


def finish_failed(tx: Tx, execution_id: str, owner_id: str, error: str) -> bool:
    """A drain raised: close its open message as failed, delete the claim, reset attempts.

    Untaken inputs do not re-arm the doorbell (that would loop on a drain that always
    fails); a doorbell already set stays set. Returns whether it is set (one follow-up).
    """
    session_id = _require_claim(tx, execution_id, owner_id)
    _close_open_messages(tx, execution_id, error)
    _delete_claim(tx, execution_id, owner_id)
    _reset_attempts(tx, session_id)
    return _doorbell_set(tx, session_id)


def mark_cancelling(tx: Tx, execution_id: str, owner_id: str) -> None:
    """First step of an interrupt's cleanup: make the cancellation durable (claim fence)."""
    updated = tx.execute(
        "UPDATE session_execution SET phase = 'cancelling'"
        " WHERE id = ? AND owner_id = ? AND expires_at > ?",
        (execution_id, owner_id, tx.now),
    ).rowcount
    if updated != 1:
        raise LeaseLost(f"execution {execution_id!r} no longer holds a live claim")


def finish_interrupted(tx: Tx, execution_id: str, owner_id: str) -> bool:
    """Second step of an interrupt's cleanup, one transaction: finish the open message and
    fail its running tools (`interrupted`), delete the claim, re-arm the doorbell if inputs
    remain. Returns whether the doorbell is set afterwards (exactly one successor)."""
    session_id = _require_claim(tx, execution_id, owner_id)
    _close_open_messages(tx, execution_id, INTERRUPTED)
    _delete_claim(tx, execution_id, owner_id)
    _reset_attempts(tx, session_id)
    if _has_pending_inputs(tx, session_id):
        _ring(tx, session_id)
    return _doorbell_set(tx, session_id)


def request_cancel(tx: Tx, session_id: str) -> bool:
    """Interrupt another owner's claim: `phase='cancelling'` fenced on the live running row."""
    return (
        tx.execute(
            "UPDATE session_execution SET phase = 'cancelling'"
            " WHERE session_id = ? AND phase = 'running' AND expires_at > ?",
            (session_id, tx.now),
        ).rowcount
        == 1
    )


def cancel_held_claim(tx: Tx, session_id: str) -> bool:
    """An interrupt accepted locally while another owner's claim turned up at acquire: mark
    that claim cancelling even if its lease already expired, so recovery finishes it as
    cancelled instead of resuming it."""
    return (
        tx.execute(
            "UPDATE session_execution SET phase = 'cancelling'"
            " WHERE session_id = ? AND phase = 'running'",
            (session_id,),
        ).rowcount
        == 1
    )


def expire_claims(tx: Tx, owner_id: str, execution_ids: Sequence[str]) -> int:
    """Shutdown: keep the claims (phase unchanged) but end their leases now, fenced."""
    expired = 0
    for execution_id in execution_ids:
        expired += tx.execute(
            "UPDATE session_execution SET expires_at = ?"
            " WHERE id = ? AND owner_id = ? AND expires_at > ?",
            (tx.now, execution_id, owner_id, tx.now),
        ).rowcount
    return expired


# ---------------------------------------------------------------------------------------------
# Inputs and transcript


def take_inputs(tx: Tx, execution_id: str, owner_id: str) -> list[Input]:
    """Consume pending inputs in seq order, appending each as a user message (claim fence)."""
    session_id = _require_claim(tx, execution_id, owner_id)
    rows = tx.execute(
        "SELECT id, payload FROM session_input WHERE session_id = ? ORDER BY seq", (session_id,)
    ).fetchall()
    taken = []
    seq = _next_message_seq(tx, session_id)
    for input_id, payload in rows:
        taken.append(
            Input(input_id, _codec.decode_object(payload, table="session_input", key=input_id))
        )
        tx.execute(
            "INSERT INTO session_message(id, session_id, execution_id, input_id, role, seq, data,"
            " time_created, time_updated) VALUES (?, ?, ?, ?, 'user', ?, ?, ?, ?)",
            (new_id(), session_id, execution_id, input_id, seq, payload, tx.now, tx.now),
        )
        seq += 1
    tx.execute("DELETE FROM session_input WHERE session_id = ?", (session_id,))
    return taken


def begin_assistant(tx: Tx, execution_id: str, owner_id: str, message_id: str) -> None:
    session_id = _require_claim(tx, execution_id, owner_id)
    tx.execute(
        "INSERT INTO session_message(id, session_id, execution_id, role, seq, data,"
        " time_created, time_updated) VALUES (?, ?, ?, 'assistant', ?, ?, ?, ?)",
        (
            message_id,
            session_id,
            execution_id,
            _next_message_seq(tx, session_id),
            _codec.encode_assistant(_transcript.EMPTY),
            tx.now,
            tx.now,
        ),
    )


def update_assistant(
    tx: Tx,
    execution_id: str,
    owner_id: str,
    message_id: str,
    transition: Callable[[AssistantData], AssistantData],
) -> AssistantData:
    """Read-modify-write of one assistant message under the claim fence.

    The transition runs on the durable row, so the settlement state machine checks what is
    stored, not what a writer remembers.
    """
    _require_claim(tx, execution_id, owner_id)
    row = tx.one(
        "SELECT data FROM session_message WHERE id = ? AND execution_id = ?",
        (message_id, execution_id),
    )
    if row is None:
        raise LeaseLost(f"message {message_id!r} is not owned by execution {execution_id!r}")
    data = transition(_codec.decode_assistant(row[0], key=message_id))
    _write_assistant(tx, message_id, data)
    return data


def _write_assistant(tx: Tx, message_id: str, data: AssistantData) -> None:
    tx.execute(
        "UPDATE session_message SET data = ?, time_updated = ? WHERE id = ?",
        (_codec.encode_assistant(data), tx.now, message_id),
    )


def _close_open_messages(tx: Tx, execution_id: str, reason: str) -> None:
    """Finish every open assistant message of an execution as interrupted/failed.

    A row that does not decode is left as it is: recovery quarantines such rows, and
    rewriting it would destroy what an operator needs to see.
    """
    rows = tx.execute(
        "SELECT id, data FROM session_message WHERE execution_id = ? AND role = 'assistant'",
        (execution_id,),
    ).fetchall()
    for message_id, text in rows:
        try:
            data = _codec.decode_assistant(text, key=message_id)
        except MalformedRecord:
            continue
        if not data.finished:
            _write_assistant(tx, message_id, _transcript.interrupt(data, reason))


def read_transcript(tx: Tx, session_id: str) -> list[Message]:
    rows = tx.execute(
        "SELECT id, role, seq, data, execution_id, input_id FROM session_message"
        " WHERE session_id = ? ORDER BY seq",
        (session_id,),
    ).fetchall()
    return [_decode_message(session_id, *row) for row in rows]


def _decode_message(
    session_id: str,
    message_id: str,
    role: str,
    seq: int,
    data: str,
    execution_id: str | None,
    input_id: str | None,
) -> Message:
    decoded: Any
    if role == "assistant":
        decoded = _codec.decode_assistant(data, key=message_id)
    else:
        decoded = _codec.decode_object(data, table="session_message", key=message_id)
    return Message(message_id, session_id, role, seq, decoded, execution_id, input_id)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# Recovery


@attrs.frozen
class Candidate:
    """A recovery candidate: an expired claim (`execution_id` set) or an unclaimed doorbell."""

    session_id: str
    execution_id: str | None


def recovery_candidates(
    tx: Tx, owner_id: str, limit: int, local_sessions: Sequence[str]
) -> list[Candidate]:
    """The oldest `limit` candidates: expired claims by `expires_at`, then unclaimed doorbells
    by `time_woken`. Quarantined executions, executions under another owner's live recovery
    lease and sessions held locally are excluded here, so they never use up the budget."""
    local = _codec.dumps(list(local_sessions))
    expired = tx.execute(
        "SELECT e.session_id, e.id FROM session_execution e"
        " WHERE e.expires_at <= :now"
        " AND e.session_id NOT IN (SELECT value FROM json_each(:local))"
        " AND NOT EXISTS (SELECT 1 FROM session_recovery r WHERE r.execution_id = e.id"
        "   AND (r.recovery_error IS NOT NULL OR (r.owner_id != :me AND r.expires_at > :now)))"
        " ORDER BY e.expires_at, e.id LIMIT :limit",
        {"now": tx.now, "local": local, "me": owner_id, "limit": limit},
    ).fetchall()
    candidates = [Candidate(session_id, execution_id) for session_id, execution_id in expired]
    if len(candidates) < limit:
        doorbells = tx.execute(
            "SELECT s.id FROM session s WHERE s.time_woken IS NOT NULL"
            " AND NOT EXISTS (SELECT 1 FROM session_execution e WHERE e.session_id = s.id)"
            " AND s.id NOT IN (SELECT value FROM json_each(:local))"
            " ORDER BY s.time_woken, s.id LIMIT :limit",
            {"local": local, "limit": limit - len(candidates)},
        ).fetchall()
        candidates += [Candidate(row[0], None) for row in doorbells]
    return candidates


def take_recovery_leases(
    tx: Tx, owner_id: str, lease_ms: int, candidates: Sequence[Candidate]
) -> list[Candidate]:
    """Take a recovery lease on each expired claim: only if absent, expired or ours, and never
    on a quarantined row. Returns the candidates whose lease we now hold."""
    taken = []
    for candidate in candidates:
        row = tx.one(
            "INSERT INTO session_recovery(execution_id, session_id, owner_id, expires_at,"
            " time_created) VALUES (:e, :s, :me, :exp, :now)"
            " ON CONFLICT(execution_id) DO UPDATE SET owner_id = :me, expires_at = :exp"
            " WHERE session_recovery.recovery_error IS NULL"
            " AND (session_recovery.owner_id = :me OR session_recovery.expires_at <= :now)"
            " RETURNING execution_id",
            {
                "e": candidate.execution_id,
                "s": candidate.session_id,
                "me": owner_id,
                "exp": tx.now + lease_ms,
                "now": tx.now,
            },
        )
        if row is not None:
            taken.append(candidate)
    return taken


def _recovery_facts(tx: Tx, candidate: Candidate) -> tuple[RecoveryFacts, str | None]:
    """What recovery decides on, and why the newest assistant message is malformed (None
    when it decodes or there is none)."""
    session_id, execution_id = candidate.session_id, candidate.execution_id
    row = tx.one(
        "SELECT id, owner_id, phase, expires_at, anchor_seq FROM session_execution"
        " WHERE session_id = ?",
        (session_id,),
    )
    claim = None if row is None else ClaimRow(*row[:4])
    # Another execution's anchor is never used: the decision for a replaced claim is GONE.
    anchor_seq = row[4] if claim is not None and claim.execution_id == execution_id else None
    superseded = (
        tx.one(
            "SELECT 1 FROM session_message WHERE session_id = ? AND role = 'assistant'"
            " AND execution_id IS NOT ? AND (? IS NULL OR seq > ?) LIMIT 1",
            (session_id, execution_id, anchor_seq, anchor_seq),
        )
        is not None
    )
    newest = tx.one(
        "SELECT id, data FROM session_message WHERE execution_id = ? AND role = 'assistant'"
        " ORDER BY seq DESC LIMIT 1",
        (execution_id,),
    )
    malformed_reason = None if newest is None else _malformed_reason(newest[0], newest[1])
    attempts = tx.one("SELECT wake_attempts FROM session WHERE id = ?", (session_id,))
    facts = RecoveryFacts(
        claim=claim,
        superseded=superseded,
        newest_assistant_malformed=malformed_reason is not None,
        wake_attempts=0 if attempts is None else int(attempts[0]),
    )
    return facts, malformed_reason


def _malformed_reason(message_id: str, text: str) -> str | None:
    try:
        _codec.decode_assistant(text, key=message_id)
    except MalformedRecord as exc:
        return str(exc)
    return None


@attrs.frozen
class Recovered:
    """What applying recovery to one expired claim did."""

    decision: RecoveryDecision
    fence_lost: bool = False
    new_execution_id: str | None = None
    attempt: int = 0


def apply_recovery(
    tx: Tx,
    owner_id: str,
    candidate: Candidate,
    new_execution_id: str,
    lease_ms: int,
    max_resumes: int,
) -> Recovered:
    """Decide and act on one expired claim whose recovery lease we took.

    Every ending but quarantine deletes the `session_recovery` row. Quarantine writes with
    the *quarantine fence* - exact execution, session, recovery owner, live recovery lease,
    not yet quarantined - and zero rows means ownership moved: nothing else is touched.
    """
    execution_id = candidate.execution_id
    assert execution_id is not None
    facts, malformed_reason = _recovery_facts(tx, candidate)
    decision = _decisions.decide_recovery(facts, execution_id, tx.now, max_resumes)
    if decision is RecoveryDecision.QUARANTINE:
        assert malformed_reason is not None
        return quarantine(tx, owner_id, candidate, malformed_reason)
    if not _holds_recovery_lease(tx, execution_id, owner_id):
        # Another recovery owner holds this row now: act on nothing of theirs.
        return Recovered(RecoveryDecision.GONE, fence_lost=True)
    if decision is RecoveryDecision.RESUME:
        return _take_over(tx, owner_id, candidate, new_execution_id, lease_ms, facts)
    if decision in (
        RecoveryDecision.FINISH_CANCELLED,
        RecoveryDecision.DROP_SUPERSEDED,
        RecoveryDecision.EXHAUSTED,
    ):
        _end_expired_claim(tx, candidate, decision)
    _delete_recovery_row(tx, execution_id, owner_id)
    return Recovered(decision)


def _holds_recovery_lease(tx: Tx, execution_id: str, owner_id: str) -> bool:
    """The recovery-lease fence: our live, unquarantined `session_recovery` row."""
    row = tx.one(
        "SELECT 1 FROM session_recovery WHERE execution_id = ? AND owner_id = ?"
        " AND expires_at > ? AND recovery_error IS NULL",
        (execution_id, owner_id, tx.now),
    )
    return row is not None


def quarantine(tx: Tx, owner_id: str, candidate: Candidate, why: str) -> Recovered:
    """Quarantine with the exact fence; zero rows means another owner holds it now."""
    updated = tx.execute(
        "UPDATE session_recovery SET recovery_error = :why, time_quarantined = :now"
        " WHERE execution_id = :e AND session_id = :s AND owner_id = :me"
        " AND expires_at > :now AND recovery_error IS NULL",
        {
            "why": why,
            "now": tx.now,
            "e": candidate.execution_id,
            "s": candidate.session_id,
            "me": owner_id,
        },
    ).rowcount
    if updated != 1:
        return Recovered(RecoveryDecision.QUARANTINE, fence_lost=True)
    return Recovered(RecoveryDecision.QUARANTINE)


def _delete_recovery_row(tx: Tx, execution_id: str, owner_id: str) -> None:
    # Only our own recovery row: another owner's lease or quarantine is not ours to touch.
    tx.execute(
        "DELETE FROM session_recovery WHERE execution_id = ? AND owner_id = ?"
        " AND recovery_error IS NULL",
        (execution_id, owner_id),
    )


def _delete_expired_claim(tx: Tx, execution_id: str) -> None:
    # The recovery fence: the exact old execution id, still expired.
    deleted = tx.execute(
        "DELETE FROM session_execution WHERE id = ? AND expires_at <= ?", (execution_id, tx.now)
    ).rowcount
    if deleted != 1:
        raise LeaseLost(f"execution {execution_id!r} is no longer an expired claim")


def _end_expired_claim(tx: Tx, candidate: Candidate, decision: RecoveryDecision) -> None:
    execution_id = candidate.execution_id
    assert execution_id is not None
    reason = {
        RecoveryDecision.FINISH_CANCELLED: INTERRUPTED,
        RecoveryDecision.DROP_SUPERSEDED: OWNER_LOST,
        RecoveryDecision.EXHAUSTED: BUDGET_EXHAUSTED,
    }[decision]
    _close_open_messages(tx, execution_id, reason)
    _delete_expired_claim(tx, execution_id)
    if decision is RecoveryDecision.EXHAUSTED:
        _reset_attempts(tx, candidate.session_id)
    if _decisions.rearms_doorbell(decision) and _has_pending_inputs(tx, candidate.session_id):
        _ring(tx, candidate.session_id)


def _take_over(
    tx: Tx,
    owner_id: str,
    candidate: Candidate,
    new_execution_id: str,
    lease_ms: int,
    facts: RecoveryFacts,
) -> Recovered:
    old = candidate.execution_id
    assert old is not None
    _close_open_messages(tx, old, OWNER_LOST)
    replaced = tx.execute(
        "UPDATE session_execution SET id = ?, owner_id = ?, phase = 'running', anchor_seq = ?,"
        " time_created = ?, heartbeat_at = NULL, expires_at = ?"
        " WHERE id = ? AND expires_at <= ?",  # the recovery fence
        (
            new_execution_id,
            owner_id,
            _newest_seq(tx, candidate.session_id),
            tx.now,
            tx.now + lease_ms,
            old,
            tx.now,
        ),
    ).rowcount
    if replaced != 1:
        raise LeaseLost(f"execution {old!r} is no longer an expired claim")
    tx.execute(
        "UPDATE session SET wake_attempts = wake_attempts + 1, time_woken = NULL, wakes = 0"
        " WHERE id = ?",
        (candidate.session_id,),
    )
    _delete_recovery_row(tx, old, owner_id)
    return Recovered(
        RecoveryDecision.RESUME,
        new_execution_id=new_execution_id,
        attempt=facts.wake_attempts + 1,
    )


def quarantined(tx: Tx) -> list[dict[str, Any]]:
    rows = tx.execute(
        "SELECT execution_id, session_id, owner_id, recovery_error, time_quarantined"
        " FROM session_recovery WHERE recovery_error IS NOT NULL ORDER BY time_quarantined"
    ).fetchall()
    keys = ("execution_id", "session_id", "recovery_owner", "recovery_error", "time_quarantined")
    return [dict(zip(keys, row, strict=True)) for row in rows]


def lift_quarantine(tx: Tx, execution_id: str, owner_id: str, lease_ms: int) -> Candidate:
    """Clear a quarantine and take the recovery lease on it at once (for a resume)."""
    row = _quarantined_row(tx, execution_id)
    tx.execute(
        "UPDATE session_recovery SET recovery_error = NULL, time_quarantined = NULL,"
        " owner_id = ?, expires_at = ? WHERE execution_id = ?",
        (owner_id, tx.now + lease_ms, execution_id),
    )
    return Candidate(row[0], execution_id)


def drop_quarantined(tx: Tx, execution_id: str) -> None:
    """Operator drop: finish the open transcript as owner-lost, delete the claim, reset
    attempts, re-arm the doorbell if inputs remain."""
    session_id = _quarantined_row(tx, execution_id)[0]
    _close_open_messages(tx, execution_id, OWNER_LOST)
    tx.execute("DELETE FROM session_execution WHERE id = ?", (execution_id,))
    _reset_attempts(tx, session_id)
    if _has_pending_inputs(tx, session_id):
        _ring(tx, session_id)
    tx.execute("DELETE FROM session_recovery WHERE execution_id = ?", (execution_id,))


def _quarantined_row(tx: Tx, execution_id: str) -> Any:
    row = tx.one(
        "SELECT session_id FROM session_recovery WHERE execution_id = ?"
        " AND recovery_error IS NOT NULL",
        (execution_id,),
    )
    if row is None:
        raise ValueError(f"execution {execution_id!r} is not quarantined")
    return row


def run_op(
    conn: sqlite3.Connection, clock: Callable[[], float], op: Callable[..., T], *args: Any
) -> T:
    """Run one operation in its own transaction, synchronously (tools, CLI, tests)."""
    job = Job(op, args)
    run_batch(conn, clock, [job])
    result: T = job.unwrap()
    return result
