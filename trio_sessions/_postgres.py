"""The PostgreSQL engine: connections, schema and migrations, transactions, and the executors
that bring operations from trio to PostgreSQL (one writer path, group commit).

psycopg is an optional extra (`trio-sessions[postgres]`): only this module imports it. We use
its sync API from threads; its async API is asyncio-only.

Connections: TWO per executor, hence per runtime (size `max_connections` at two per process
plus headroom): the writer, which runs every operation (writes in batches, reads and nowait
work alone) on one worker thread at a time (`PgThreadExecutor`) or on the trio thread
(`PgInlineExecutor`, tests); and the listener (`listen=True`), an autocommit LISTEN
connection awaited on libpq's socket. Each is set up by libpq options so that a dead, paused
or partitioned host releases its locks within about one default lease, not the 2-hour
default keepalive: server-side `idle_in_transaction_session_timeout`, `statement_timeout`,
`lock_timeout`, TCP keepalives and `client_connection_check_interval`; client-side libpq
keepalives, `tcp_user_timeout` and `connect_timeout`. `search_path` is the configured
schema; isolation is READ COMMITTED, autocommit off.

Transactions (`PgEngine.run_batch`, group commit): every operation queued during one
hand-off runs in ONE transaction, without per-operation savepoints (more than 64
subtransactions slow the whole server down). If any operation raises - a refusal such as
`LeaseLost` or a database error - the whole batch rolls back and each operation re-runs
alone in its own transaction, where an operation that raises is rolled back and gets the
error. Serialisation failures, deadlocks, lock and statement timeouts (40001, 40P01, 55P03,
57014) retry the whole transaction with a small, bounded backoff; a connection lost before
COMMIT is re-opened and the transaction re-run (nothing committed). Other database errors
reach the caller as `StoreError`. Sessions a transaction signals (`tx.notify`) get one
`pg_notify` per session just before its COMMIT, on the schema's channel.

Uncertain COMMIT: just before COMMIT the transaction's id is read. If the connection breaks
during COMMIT, the outcome is unknown: we reconnect and ask the server
(`pg_xact_status`): committed -> the operations' results stand (never re-applied); aborted
-> re-run; in progress -> poll. Past the bound every operation gets `StoreError`, so the
runtime never treats an uncertain claim as its own: if it landed, it expires and recovery
takes it.

Invariants:
* an operation that has begun is never abandoned (as in `_sqlite`): a caller cancelled while
  its operation is queued sees it withdrawn unrun; once taken, the caller waits for its
  outcome, so a committed write is always reported;
* an operation that raised has written nothing; results are reported only after COMMIT;
* `tx.now` is the server's `clock_timestamp()` in ms (or the injected test clock), read
  once per operation AFTER its locks: it is reset before each operation and whenever
  `lock_claims` takes a lock, and `lock_session` reads it in the lock's own statement once
  the lock is granted, so a fence never compares with a time from before a lock wait;
* `lock_session` is a transaction-scoped advisory lock, held to COMMIT: the serialisation
  point `_store` relies on under READ COMMITTED.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import random
import re
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, Literal, TypeVar, TypeVarTuple, Unpack

import attrs
import psycopg
import psycopg.conninfo
import psycopg.pq
import trio
from psycopg import sql

from . import _liveness, _observe, _schema
from ._backend import (
    FALLBACK,
    BackendName,
    Job,
    NeedsTransaction,
    OwnChange,
    Params,
    StoreStatistics,
    Tx,
    driver_error,
    now_ms,
)
from ._errors import SchemaTooNew, StoreError
from ._handoff import HandoffQueue, Queued, pumping
from ._naming import check_postgres_name, check_schema, mask_password, secrets_of

T = TypeVar("T")
Ts = TypeVarTuple("Ts")

SCHEMA_VERSION = _schema.POSTGRES_SCHEMA_VERSION
_MIGRATIONS = _schema.POSTGRES_MIGRATIONS  # in `_schema`, beside SQLite's
_BACKFILLS = _schema.POSTGRES_BACKFILLS

# Advisory-lock namespaces (the first int4 of the two-key form), so our keys never collide
# with an application's single-bigint advisory locks. Session locks hash the session id;
# the migration lock hashes the schema, so stores in different schemas migrate in parallel.
SESSION_LOCK_NAMESPACE = 0x74735331  # "tsS1"
MIGRATION_LOCK_NAMESPACE = 0x74734D31  # "tsM1"

# Per-connection server settings. A few seconds for statements and lock waits: our
# transactions are short, and a wait that long means a stuck peer (retried, bounded).
STATEMENT_TIMEOUT_MS = 10_000
LOCK_TIMEOUT_MS = 5_000
# A paused or partitioned owner's open transaction (and its locks) ends within this.
IDLE_IN_TRANSACTION_TIMEOUT_MS = 15_000
# run_nowait: a lock held by another process is not waited for beyond this.
NOWAIT_LOCK_TIMEOUT_MS = 50
SERVER_KEEPALIVES = {"idle": 10, "interval": 5, "count": 3}
# The liveness token's connection (`_liveness`): the server frees a dead host's token within
# about 5 s (2 + 3 x 1), and the client notices a broken connection sooner (about 3 s:
# 1 + 2 x 1, or 2 s of unacknowledged data), so a partitioned owner has stopped its drains
# before others can see its token free.
TOKEN_SERVER_SETTINGS = {
    "tcp_keepalives_idle": 2,
    "tcp_keepalives_interval": 1,
    "tcp_keepalives_count": 3,
    "client_connection_check_interval": 1_000,
}
TOKEN_CLIENT_KEEPALIVES = {
    "keepalives_idle": 1,
    "keepalives_interval": 1,
    "keepalives_count": 2,
    "tcp_user_timeout": 2_000,
}
CLIENT_CONNECT_TIMEOUT_S = 5
TCP_USER_TIMEOUT_MS = 15_000

# Retries: SQLSTATEs after which the whole transaction is re-run.
RETRYABLE_SQLSTATES = frozenset({"40001", "40P01", "55P03", "57014"})
MAX_ATTEMPTS = 8
# How long a lost connection is re-opened (and an uncertain commit polled) before StoreError.
RECONNECT_PATIENCE_S = 10.0
# At most this many operations per transaction (the rest follow in the same hand-off): a
# huge transaction holds many session locks at once and costs more to re-run alone.
BATCH_LIMIT = 64

_SERVER_MS = "floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint"
_SERVER_NOW = f"SELECT {_SERVER_MS}"
# A session lock and the server's clock read after it is granted: one round trip.
_LOCK_SESSION = (
    "WITH locked AS MATERIALIZED"
    f" (SELECT pg_advisory_xact_lock({SESSION_LOCK_NAMESPACE}, hashtext(%s)))"
    f" SELECT {_SERVER_MS} FROM locked"
)
_LOCK_SESSION_ANY = _LOCK_SESSION.replace("%s", "?")
# How each kind of transaction begins: sent with its first statement, in one message.
_BEGIN = "BEGIN ISOLATION LEVEL READ COMMITTED; "
_BEGIN_READ = "BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY; "
_BEGIN_NOWAIT = f"{_BEGIN}SET LOCAL lock_timeout = {NOWAIT_LOCK_TIMEOUT_MS}; "

# How a transaction runs: `write` (retried, group-committed), `nowait` (alone, a short
# lock_timeout, lock waits not retried), `read` (alone, one REPEATABLE READ snapshot).
Mode = Literal["write", "nowait", "read"]


# ---------------------------------------------------------------------------------------------
# SQL dialect: `?` and `:name` parameters become psycopg's `%s` and `%(name)s`

# A quoted string or a `::` cast is kept as it is; a bare `%` is escaped for psycopg.
_TOKEN = re.compile(r"'(?:[^']|'')*'|::|\?|:([A-Za-z_][A-Za-z0-9_]*)|%")


def _token(match: re.Match[str]) -> str:
    token = match.group(0)
    if token == "?":
        return "%s"
    if token == "%":
        return "%%"
    if match.group(1) is not None:
        return f"%({match.group(1)})s"
    return token


@functools.lru_cache(maxsize=2048)
def translate(statement: str) -> str:
    """The shared SQL of `_store` (SQLite's parameter styles) in psycopg's style."""
    return _TOKEN.sub(_token, statement)


# ---------------------------------------------------------------------------------------------
# Connections and schema


def _quote_ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _option(name: str, value: object) -> str:
    # libpq's `options` splits on spaces; a backslash escapes a space or a backslash.
    text = f"{name}={value}".replace("\\", "\\\\").replace(" ", "\\ ")
    return f"-c {text}"


def _server_options(schema: str, overrides: Mapping[str, object] | None = None) -> str:
    settings: dict[str, object] = {
        "search_path": _quote_ident(schema),
        "statement_timeout": STATEMENT_TIMEOUT_MS,
        "lock_timeout": LOCK_TIMEOUT_MS,
        "idle_in_transaction_session_timeout": IDLE_IN_TRANSACTION_TIMEOUT_MS,
        "tcp_keepalives_idle": SERVER_KEEPALIVES["idle"],
        "tcp_keepalives_interval": SERVER_KEEPALIVES["interval"],
        "tcp_keepalives_count": SERVER_KEEPALIVES["count"],
        # The server notices a vanished client during a long statement, too.
        "client_connection_check_interval": 5_000,
    }
    settings.update(overrides or {})
    return " ".join(_option(name, value) for name, value in settings.items())


def channel(schema: str) -> str:
    """The LISTEN/NOTIFY channel of a schema's store (channels are per database)."""
    name = "trio_sessions" if schema == "public" else f"trio_sessions.{schema}"
    if len(name.encode()) > 63:  # NAMEDATALEN: longer names are truncated by the server
        name = f"trio_sessions.{hashlib.sha1(schema.encode()).hexdigest()}"
    return name


def connect(
    url: str,
    schema: str,
    *,
    server: Mapping[str, object] | None = None,
    client: Mapping[str, int] | None = None,
) -> psycopg.Connection[Any]:
    """A connection with our settings (not yet migrated); `StoreError` if it fails.
    `server`/`client` override server settings and libpq's keepalive parameters."""
    try:
        given = psycopg.conninfo.conninfo_to_dict(url)
        options = " ".join(
            filter(None, [str(given.get("options") or ""), _server_options(schema, server)])
        )
        keepalives: dict[str, Any] = {
            "keepalives_idle": 10,
            "keepalives_interval": 5,
            "keepalives_count": 3,
            "tcp_user_timeout": TCP_USER_TIMEOUT_MS,
        }
        keepalives.update(client or {})
        conn = psycopg.connect(
            url,
            autocommit=False,
            options=options,
            application_name=str(given.get("application_name") or "trio_sessions"),
            connect_timeout=CLIENT_CONNECT_TIMEOUT_S,
            keepalives=1,
            **keepalives,
        )
    except psycopg.Error as exc:
        # libpq may quote the connection string it could not use: the error is shown with
        # the password masked, and without the driver's own error as its cause (a traceback
        # would print that one's text unmasked).
        message = mask_password(f"{type(exc).__name__}: {exc}", secrets=secrets_of(url))
        raise StoreError(message) from None
    # Explicit: a database or role default must not change the isolation the fences assume.
    conn.isolation_level = psycopg.IsolationLevel.READ_COMMITTED
    return conn


def schema_version(conn: Any) -> int:
    """The schema's version; 0 when it has no `schema_version` table (or does not exist)."""
    if conn.execute("SELECT to_regclass('schema_version')").fetchone()[0] is None:
        return 0
    row = conn.execute("SELECT max(version) FROM schema_version").fetchone()
    return 0 if row[0] is None else int(row[0])


def migrate(conn: Any, schema: str) -> None:
    """Bring the schema up to date in one transaction; idempotent, safe from many hosts.

    Serialised by an advisory lock per schema, so processes starting together wait for the
    first one's migration and then find nothing to do. `SchemaTooNew`, with nothing
    written (not even the schema), when a newer library migrated it.
    """
    try:
        conn.execute(
            f"SELECT pg_advisory_xact_lock({MIGRATION_LOCK_NAMESPACE}, hashtext(%s))", (schema,)
        )
        # Read under the lock: another process may have migrated while we waited.
        version = schema_version(conn)
        if version > SCHEMA_VERSION:
            raise SchemaTooNew(
                f"schema {schema!r} has version {version}, newer than this trio_sessions "
                f"understands ({SCHEMA_VERSION}); upgrade trio_sessions. Nothing was modified."
            )
        if version < SCHEMA_VERSION:
            exists = conn.execute(
                "SELECT 1 FROM pg_namespace WHERE nspname = %s", (schema,)
            ).fetchone()
            if exists is None:
                # Checked first: CREATE ... IF NOT EXISTS still needs the CREATE privilege.
                conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
            if version == 0:
                conn.execute("CREATE TABLE schema_version(version INTEGER NOT NULL)")
                conn.execute("INSERT INTO schema_version(version) VALUES (0)")
            for target in range(version + 1, SCHEMA_VERSION + 1):
                for statement in _MIGRATIONS[target].split(";"):
                    if statement.strip():
                        conn.execute(statement)
                if target in _BACKFILLS:
                    _BACKFILLS[target](conn)
            conn.execute("UPDATE schema_version SET version = %s", (SCHEMA_VERSION,))
        conn.commit()
    except BaseException as exc:
        with contextlib.suppress(psycopg.Error):
            conn.rollback()
        if isinstance(exc, psycopg.Error):
            raise StoreError(f"cannot migrate schema {schema!r}: {exc}") from exc
        raise


# ---------------------------------------------------------------------------------------------
# Transactions


class PgTx:
    """One open READ COMMITTED transaction, as an operation sees it (`_backend.Tx`), or one
    autocommit call (`autocommit=True`: a single function call and nothing else).

    The connection is in autocommit mode; a transaction begins with the first statement
    sent, which carries `begin` (`BEGIN ...;`) in the same message: no round trip of its
    own. A function call also reads the transaction's id in its reply, so a transaction
    that ends with a call needs no read before COMMIT (DESIGN §8 "Uncertain commits").
    """

    def __init__(
        self,
        conn: Any,
        clock: Callable[[], float] | None,
        *,
        begin: str = _BEGIN,
        autocommit: bool = False,
        retry: bool = False,
    ) -> None:
        self.conn = conn
        self._clock = clock
        self._now: int | None = None
        # Sessions to signal at COMMIT (insertion-ordered; one pg_notify per session).
        self.notified: dict[str, None] = {}
        # Advisory xact locks are re-entrant and held to COMMIT: taking one twice in a
        # transaction (two operations of a batch on one session) costs a round trip only.
        self._locked: set[str] = set()
        # A connection outside autocommit (a test's) begins its transactions itself.
        self._begin: str | None = None if autocommit or not conn.autocommit else begin
        self.autocommit = autocommit
        self.retry = retry
        self.begun = False  # a statement was sent (a transaction is open unless autocommit)
        self.xid: str | None = None
        self.xid_fresh = False  # `xid` was read by the last statement sent

    @property
    def now(self) -> int:
        if self._now is None:
            if self._clock is not None:
                self._now = now_ms(self._clock)
            else:
                row: Any = self._send(_SERVER_NOW, ()).fetchone()
                self._now = int(row[0])
        return self._now

    @property
    def dialect(self) -> BackendName:
        return "postgres"

    def begin_operation(self) -> None:
        """Each operation reads its own `now`, after its own locks."""
        self._now = None

    def _send(self, statement: str, params: Params) -> psycopg.Cursor[Any]:
        if self.autocommit and self.begun:
            raise NeedsTransaction("a second statement needs a transaction")
        self.begun = True  # from here on, the statement may have reached the server
        self.xid_fresh = False
        if self._begin is None:
            cursor: psycopg.Cursor[Any] = self.conn.execute(statement, params)
            return cursor
        statement, self._begin = self._begin + statement, None
        cursor = self.conn.execute(statement, params)
        while cursor.nextset():  # past BEGIN (and SET LOCAL) to the statement's result
            pass
        return cursor

    def execute(self, statement: str, params: Params = ()) -> psycopg.Cursor[Any]:
        if self.autocommit:
            raise NeedsTransaction("only a function call runs alone in autocommit")
        return self._send(translate(statement), params)

    def one(self, statement: str, params: Params = ()) -> Any:
        return self.execute(statement, params).fetchone()

    def call(self, function: str, *args: Any, idempotent: bool = True) -> list[Any]:
        if self.autocommit and not idempotent:
            raise NeedsTransaction(f"{function} cannot be read back after a lost reply")
        fixed_now = None if self._clock is None else now_ms(self._clock)
        params = (*args, fixed_now, self.retry)
        placeholders = ", ".join(["%s"] * len(params))
        rows = self._send(
            f"SELECT f.*, pg_current_xact_id_if_assigned()::text FROM {function}({placeholders}) f",
            params,
        ).fetchall()
        if rows:
            self.xid = rows[-1][-1]
            self.xid_fresh = True
        return [tuple(row[:-1]) for row in rows]

    def lock_session(self, session_id: str) -> None:
        if session_id in self._locked:
            return
        # The wait may have been long: the clock is read after it, in the same round trip
        # (the MATERIALIZED CTE runs first).
        row = self.one(_LOCK_SESSION_ANY, (session_id,))
        self._locked.add(session_id)
        self._now = int(row[0]) if self._clock is None else None

    def lock_claims(self, execution_ids: Sequence[str]) -> None:
        if not execution_ids:
            return
        # NO KEY UPDATE (not KEY SHARE): it conflicts with a takeover's UPDATE. Sorted, so
        # two owners locking overlapping sets never deadlock.
        self.execute(
            "SELECT id FROM session_execution WHERE id = ANY(?) ORDER BY id FOR NO KEY UPDATE",
            (sorted(execution_ids),),
        )
        self._now = None

    def notify(self, session_id: str) -> None:
        # Sent once per transaction, just before COMMIT: the server delivers notifications
        # only if it commits, and drops duplicates within one transaction anyway.
        self.notified[session_id] = None

    def free_tokens(self, owner_ids: Sequence[str] | None) -> set[str]:
        # pg_locks is the lock manager's present state, not a snapshot: read after the
        # operation's own locks, it is the re-check a takeover needs.
        rows = self.conn.execute(
            _liveness.FREE_PG_TOKENS,
            {"all": owner_ids is None, "owners": list(owner_ids or ())},
        ).fetchall()
        return {str(row[0]) for row in rows}

    def forget_tokens(self, owner_ids: Sequence[str]) -> None:
        if owner_ids:
            self.conn.execute(_liveness.FORGET_PG_TOKENS, (list(owner_ids),))

    @contextlib.contextmanager
    def savepoint(self) -> Iterator[None]:
        locked = set(self._locked)
        self.execute("SAVEPOINT nested")
        try:
            yield
        except BaseException:
            self.execute("ROLLBACK TO SAVEPOINT nested")
            # Locks taken inside a rolled-back subtransaction are released with it.
            self._locked = locked
            raise
        finally:
            self.execute("RELEASE SAVEPOINT nested")


def _store_error(exc: BaseException) -> BaseException:
    return driver_error(exc) if isinstance(exc, psycopg.Error) else exc


def _connection_lost(conn: Any, exc: BaseException) -> bool:
    """Whether `exc` means the connection is gone (not a server-reported statement error)."""
    if not isinstance(exc, psycopg.Error):
        return False
    if conn is not None and (conn.closed or conn.broken):
        return True
    state = exc.sqlstate
    # No SQLSTATE: a client-side failure (socket closed, EOF). 08: connection exceptions;
    # 57P01-57P03: the server terminated us (pg_terminate_backend, shutdown); 25P03: our
    # idle-in-transaction timeout fired.
    return state is None or state.startswith("08") or state in {"57P01", "57P02", "57P03", "25P03"}


class _JobRaised(Exception):
    """An operation raised; the transaction was rolled back."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


class _Rerun(Exception):
    """Nothing committed and the transaction may be run again (a retryable error, or a
    connection lost before COMMIT or during an aborted one)."""

    def __init__(self, cause: BaseException) -> None:
        self.cause = cause


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
        self.backend_pid: int | None = None
        self.channel = channel(schema)
        self.transactions = 0
        self.retries = 0
        self.reconnects = 0

    # -- connection ---------------------------------------------------------------------------

    def open(self) -> None:
        """Connect and migrate (`SchemaTooNew` / `StoreError` on failure)."""
        conn = connect(self.url, self.schema)
        try:
            migrate(conn, self.schema)
        except BaseException:
            conn.close()
            raise
        self.conn = self._wrapped(conn)

    def close(self) -> None:
        if self.conn is not None:
            with contextlib.suppress(psycopg.Error):
                self.conn.close()
            self.conn = None

    def _wrapped(self, conn: psycopg.Connection[Any]) -> Any:
        # Transactions begin explicitly, with their first statement (`PgTx`): BEGIN costs
        # no round trip of its own. Parameters are bound client-side, so a statement can
        # share its message with the BEGIN before it.
        conn.autocommit = True
        conn.cursor_factory = psycopg.ClientCursor
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
        pause = 0.02
        while True:
            try:
                self.conn = self._wrapped(connect(self.url, self.schema))
            except StoreError:
                # The last attempt is made at the deadline, not a pause before it: the
                # caller gets StoreError only once the whole bound has passed.
                remaining = deadline - time.monotonic()
                if remaining <= 0:
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
            retries=self.retries,
            reconnects=self.reconnects,
        )

    def run_jobs(
        self, jobs: Sequence[Job], nowait: Sequence[Job] = (), reads: Sequence[Job] = ()
    ) -> None:
        """One hand-off: `nowait` and `reads` jobs alone each, the rest in batches of
        `BATCH_LIMIT`."""
        for job in nowait:
            self.run_alone(job, "nowait")
        for start in range(0, len(jobs), BATCH_LIMIT):
            self.run_batch(jobs[start : start + BATCH_LIMIT])
        for job in reads:
            self.run_alone(job, "read")

    def run_batch(self, jobs: Sequence[Job]) -> None:
        """Run `jobs` in one transaction (group commit). Never raises: outcomes go on jobs.

        If any job raises, nothing of the batch is kept and every job runs again alone: no
        savepoint per job, so the common case costs one transaction and no subtransaction.
        """
        if len(jobs) == 1:
            self.run_alone(jobs[0])
            return
        try:
            results = self._transaction(jobs, "write", alone=False)
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

    def run_alone(self, job: Job, mode: Mode = "write") -> None:
        """Run one job in its own transaction - or as one autocommit call, if it is marked
        `autocommit_when_alone`. Never raises: the outcome goes on the job."""
        if mode == "write" and job.op.__dict__.get("autocommit_when_alone", False):
            try:
                job.result = self._autocommit(job)
            except NeedsTransaction:
                pass  # nothing was written: run it in a transaction instead
            except StoreError as exc:
                job.error = exc
                return
            except Exception as exc:  # the operation's own refusal (LeaseLost, ...)
                job.error = _store_error(exc)
                return
            else:
                return
        try:
            [job.result] = self._transaction([job], mode, alone=True)
        except _JobRaised as raised:
            job.error = _store_error(raised.error)
        except StoreError as exc:
            job.error = exc

    def _transaction(self, jobs: Sequence[Job], mode: Mode, *, alone: bool) -> list[Any]:
        """Run and commit; retried within the bounds. `_JobRaised` when a job raised (rolled
        back), `StoreError` past the bounds."""
        deadline = time.monotonic() + RECONNECT_PATIENCE_S
        attempt = 0
        while True:
            attempt += 1
            try:
                conn = self._connection(deadline)
                return self._attempt(conn, jobs, mode, alone=alone, deadline=deadline)
            except _Rerun as rerun:
                if attempt >= MAX_ATTEMPTS or time.monotonic() >= deadline:
                    raise driver_error(rerun.cause) from rerun.cause
                self.retries += 1
                _observe.store_retry("postgres", rerun.cause, attempt)
                time.sleep(min(0.005 * 2**attempt, 0.2) * random.uniform(0.5, 1.0))

    def _autocommit(self, job: Job) -> Any:
        """Run a job as one autocommit call (`PgTx(autocommit=True)`), within the bounds.

        A connection lost around the call leaves its outcome unknown: the call runs again
        with `retry`, and the function reads back by natural key whether the lost one
        landed (DESIGN §8 "Uncertain commits"). `NeedsTransaction` before anything was
        sent; `StoreError` past the bounds; the operation's own errors as they are."""
        deadline = time.monotonic() + RECONNECT_PATIENCE_S
        attempt = 0
        retry = False
        lost: BaseException | None = None
        while True:
            attempt += 1
            try:
                conn = self._connection(deadline)
            except StoreError as exc:
                if retry:  # never guessed: the lost call may have landed
                    raise _unknown_outcome(lost, exc) from lost
                raise
            self.transactions += 1
            tx = PgTx(conn, self.clock, autocommit=True, retry=retry)
            try:
                return job.op(tx, *job.args)
            except NeedsTransaction:
                raise
            except Exception as exc:
                if _connection_lost(conn, exc):
                    self.close()  # the next attempt re-opens it
                    retry = retry or tx.begun
                    lost = exc
                elif not (isinstance(exc, psycopg.Error) and exc.sqlstate in RETRYABLE_SQLSTATES):
                    raise  # the operation's own refusal, or a database error
                if attempt >= MAX_ATTEMPTS or time.monotonic() >= deadline:
                    if retry:
                        raise _unknown_outcome(exc, driver_error(exc)) from exc
                    raise driver_error(exc) from exc
                self.retries += 1
                _observe.store_retry("postgres", exc, attempt)
                time.sleep(min(0.005 * 2**attempt, 0.2) * random.uniform(0.5, 1.0))

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
            arrays = [list(c) for c in zip(*(jobs[i].args for i in indexes), strict=True)]
            for ordinal, *row in tx.call(function, *arrays):
                index = indexes[ordinal - 1]
                result = interpret(jobs[index].args, tuple(row))
                if result is not FALLBACK:
                    results[index] = result
                    settled.add(index)
        for index, job in enumerate(jobs):
            if index not in settled:
                tx.begin_operation()
                results[index] = job.op(tx, *job.args)
        return results

    def _attempt(
        self, conn: Any, jobs: Sequence[Job], mode: Mode, *, alone: bool, deadline: float
    ) -> list[Any]:
        self.transactions += 1
        nowait = mode == "nowait"
        begin = _BEGIN_NOWAIT if nowait else _BEGIN_READ if mode == "read" else _BEGIN
        tx = PgTx(conn, self.clock, begin=begin)
        xid = None
        try:
            results = self._run_jobs(tx, jobs)
            # Read just before COMMIT (not at BEGIN): only a transaction that wrote has an
            # id, and a read-only one needs no read-back. The signals travel with it (a
            # notification alone assigns no id before COMMIT: re-sent after an uncertain
            # COMMIT, it costs a duplicate wake-up, which the doorbell absorbs). A
            # transaction that ended with a function call has its id already.
            if tx.notified:
                xid = tx.one(
                    "SELECT pg_current_xact_id_if_assigned()::text,"
                    " (SELECT count(pg_notify(?, s)) FROM unnest(CAST(? AS text[])) AS s)",
                    (self.channel, list(tx.notified)),
                )[0]
            elif tx.xid_fresh or mode == "read":
                xid = tx.xid
            elif tx.begun:
                xid = tx.one("SELECT pg_current_xact_id_if_assigned()::text")[0]
        except Exception as exc:
            self._rollback()
            if _connection_lost(conn, exc):
                self.close()  # the next attempt re-opens it
                raise _Rerun(exc) from exc
            retryable = isinstance(exc, psycopg.Error) and exc.sqlstate in RETRYABLE_SQLSTATES
            # A batch re-runs its jobs alone instead (a deadlock between two batches is
            # unlikely to recur between single operations); nowait never waits again.
            if retryable and alone and not nowait:
                raise _Rerun(exc) from exc
            raise _JobRaised(exc) from exc
        except BaseException:
            self._rollback()
            raise
        if not tx.begun:
            return results  # nothing was sent: nothing to commit
        try:
            conn.commit()
        except psycopg.Error as exc:
            if not _connection_lost(conn, exc):
                # The server answered: it rolled the transaction back.
                self._rollback()
                if exc.sqlstate in RETRYABLE_SQLSTATES and not nowait:
                    raise _Rerun(exc) from exc
                raise _JobRaised(exc) from exc
            if self._committed(xid, exc, deadline):
                return results
            raise _Rerun(exc) from exc
        return results

    def _committed(self, xid: str | None, lost: psycopg.Error, deadline: float) -> bool:
        """After a connection broke during COMMIT: did it commit? Read back from the server;
        `StoreError` when that cannot be known within the bound (never guessed)."""
        self.close()  # lost, even if the client has not yet read the connection's end
        if xid is None:
            return False  # it wrote nothing: running it again changes nothing
        while True:
            try:
                conn = self._connection(deadline)
                status = conn.execute("SELECT pg_xact_status(%s::xid8)", (xid,)).fetchone()[0]
                conn.rollback()  # end the read's transaction
            except psycopg.Error as exc:
                self.close()
                status = None
                if time.monotonic() >= deadline:
                    raise driver_error(exc) from exc
            except StoreError as exc:
                raise StoreError(
                    f"the outcome of a COMMIT is unknown (connection lost: {lost}); {exc}"
                ) from lost
            if status == "committed":
                return True
            if status == "aborted":
                return False
            # 'in progress': the server has not yet noticed the broken connection.
            if time.monotonic() >= deadline:
                raise StoreError(
                    f"the outcome of a COMMIT is unknown (connection lost: {lost}); "
                    f"transaction {xid} is still {status!r}"
                ) from lost
            time.sleep(0.02)


def _unknown_outcome(lost: BaseException | None, error: StoreError) -> StoreError:
    return StoreError(
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
        conn = self.engine.conn
        try:
            return schema_version(conn)
        except psycopg.Error as exc:
            raise driver_error(exc) from exc
        finally:
            conn.rollback()

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
    if migrate:
        engine.open()
    else:
        engine.conn = connect(url, schema)
    return PgSyncEngine(engine)


# ---------------------------------------------------------------------------------------------
# Signals between processes


class PgListener:
    """The LISTEN connection (autocommit), awaited trio-natively on libpq's socket: nothing
    is ever in flight on it, so waiting is cancellable at any instant.

    Notifications are lost while it is disconnected (the server queues nothing for a
    listener that is gone): after every reconnect it reports a change, so the runtime
    rescans. The doorbell stays the truth; this only cuts latency.
    """

    def __init__(self, url: str, schema: str, *, inline: bool) -> None:
        self.url = url
        self.schema = schema
        self.channel = channel(schema)
        self.inline = inline
        self.conn: psycopg.Connection[Any] | None = None
        self.reconnects = 0

    def _connect(self) -> psycopg.Connection[Any]:
        conn = connect(self.url, self.schema)
        try:
            conn.autocommit = True  # a listener inside a transaction holds the queue back
            conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self.channel)))
        except psycopg.Error as exc:
            conn.close()
            raise driver_error(exc) from exc
        return conn

    async def open(self) -> None:
        self.conn = await self._connect_async()

    async def _connect_async(self) -> psycopg.Connection[Any]:
        if self.inline:
            return self._connect()
        return await trio.to_thread.run_sync(self._connect)

    def close(self) -> None:
        if self.conn is not None:
            with contextlib.suppress(psycopg.Error):
                self.conn.close()
            self.conn = None

    async def wait(
        self,
        kick: trio.Event,
        fallback: float,
        wanted: Callable[[int, str], bool] | None = None,
    ) -> None:
        """Return on a notification `wanted(sender's backend pid, session id)` (default:
        any), when `kick` is set, or after `fallback` seconds."""
        with trio.move_on_after(fallback):
            async with trio.open_nursery() as nursery:

                async def kicked() -> None:
                    await kick.wait()
                    nursery.cancel_scope.cancel()

                nursery.start_soon(kicked)
                await self._notified(wanted)
                nursery.cancel_scope.cancel()

    async def _notified(self, wanted: Callable[[int, str], bool] | None) -> None:
        if self.conn is None or self.conn.closed or self.conn.broken:
            self.close()
            try:
                self.conn = await self._connect_async()
            except StoreError as exc:
                _observe.listener_reconnect_failed(self.channel, exc)
                await trio.sleep_forever()  # until the fallback poll's timeout
            self.reconnects += 1
            _observe.listener_reconnected(self.channel)
            return  # notifications sent meanwhile are lost: rescan now
        pgconn = self.conn.pgconn
        while True:
            if self._take_notifications(pgconn, wanted):
                return
            await trio.lowlevel.wait_readable(pgconn.socket)
            try:
                pgconn.consume_input()
            except psycopg.OperationalError:
                self.close()
                return  # reconnect at the next wait; rescan now

    @staticmethod
    def _take_notifications(
        pgconn: psycopg.pq.abc.PGconn, wanted: Callable[[int, str], bool] | None
    ) -> bool:
        got = False
        while (notify := pgconn.notifies()) is not None:
            session_id = notify.extra.decode(errors="replace")
            got = got or wanted is None or wanted(notify.be_pid, session_id)
        return got


async def _wait_for_change(
    listener: PgListener | None,
    kick: trio.Event,
    fallback: float,
    wanted: Callable[[int, str], bool] | None = None,
) -> None:
    if listener is not None:
        await listener.wait(kick, fallback, wanted)
        return
    with trio.move_on_after(fallback):  # poll-only (listen=False): e.g. behind PgBouncer
        await kick.wait()


# ---------------------------------------------------------------------------------------------
# The liveness token's connection


def token_connection(url: str, schema: str) -> psycopg.Connection[Any]:
    """A direct, autocommit connection for the liveness token (`_liveness`), with keepalives
    shorter than every other connection's."""
    conn = connect(url, schema, server=TOKEN_SERVER_SETTINGS, client=TOKEN_CLIENT_KEEPALIVES)
    conn.autocommit = True
    return conn


def _hold_token(
    engine: PgEngine, owner_id: str, *, inline: bool
) -> AbstractAsyncContextManager[_liveness.PgToken]:
    return _liveness.hold_pg_token(
        functools.partial(token_connection, engine.url, engine.schema), owner_id, inline=inline
    )


# ---------------------------------------------------------------------------------------------
# Executors


def _statistics(
    engine: PgEngine, listener: PgListener | None, handoffs: int = 0
) -> StoreStatistics:
    figures = engine.statistics(handoffs)
    if listener is not None:
        figures = attrs.evolve(figures, reconnects=figures.reconnects + listener.reconnects)
    return figures


@attrs.define(eq=False)
class PgInlineExecutor:
    """Each operation runs in its own transaction on the trio thread (deterministic tests:
    virtual time never jumps while PostgreSQL works)."""

    engine: PgEngine
    listener: PgListener | None = None
    backend: BackendName = "postgres"

    def statistics(self) -> StoreStatistics:
        return _statistics(self.engine, self.listener)

    async def _run(self, mode: Mode, op: Callable[..., T], args: tuple[Any, ...]) -> T:
        await trio.lowlevel.checkpoint_if_cancelled()
        job = Job(op, args)
        self.engine.run_alone(job, mode)
        await trio.lowlevel.cancel_shielded_checkpoint()
        result: T = job.unwrap()
        return result

    async def run(self, op: Callable[[Tx, Unpack[Ts]], T], *args: *Ts) -> T:
        return await self._run("write", op, args)

    async def run_nowait(self, op: Callable[[Tx, Unpack[Ts]], T], *args: *Ts) -> T:
        return await self._run("nowait", op, args)

    async def read(self, op: Callable[[Tx, Unpack[Ts]], T], *args: *Ts) -> T:
        return await self._run("read", op, args)

    async def wait_for_change(
        self, kick: trio.Event, fallback: float, *, own: OwnChange = None
    ) -> None:
        await _wait_for_change(self.listener, kick, fallback, _wanted(self.engine, own))

    def hold_token(self, owner_id: str) -> AbstractAsyncContextManager[_liveness.PgToken]:
        return _hold_token(self.engine, owner_id, inline=True)


def _wanted(engine: PgEngine, own: OwnChange) -> Callable[[int, str], bool]:
    """Whether a notification (backend pid, session) is worth a look: not one our own writer
    sent, unless `own` says this runtime still needs it."""

    def wanted(pid: int, session_id: str) -> bool:
        return pid != engine.backend_pid or (own is not None and own(session_id))

    return wanted


@attrs.define(eq=False)
class PgThreadExecutor:
    """Group commit through one worker hand-off at a time. Use `open_thread_executor`."""

    engine: PgEngine
    listener: PgListener | None = None
    _handoff: HandoffQueue = attrs.Factory(HandoffQueue)
    _limiter: trio.CapacityLimiter = attrs.Factory(lambda: trio.CapacityLimiter(1))
    backend: BackendName = "postgres"

    def statistics(self) -> StoreStatistics:
        return _statistics(self.engine, self.listener, self._handoff.handoffs)

    async def run(self, op: Callable[[Tx, Unpack[Ts]], T], *args: *Ts) -> T:
        result: T = await self._submit(Job(op, args), "write")
        return result

    async def run_nowait(self, op: Callable[[Tx, Unpack[Ts]], T], *args: *Ts) -> T:
        # Queued like any operation (the writer's batch ends soon), then run alone with a
        # short lock_timeout: another process's lock is not waited for.
        result: T = await self._submit(Job(op, args), "nowait")
        return result

    async def read(self, op: Callable[[Tx, Unpack[Ts]], T], *args: *Ts) -> T:
        # Through the same writer hand-off: one connection per process. Alone, on one
        # REPEATABLE READ snapshot; PostgreSQL readers never wait for writers.
        result: T = await self._submit(Job(op, args), "read")
        return result

    async def wait_for_change(
        self, kick: trio.Event, fallback: float, *, own: OwnChange = None
    ) -> None:
        await _wait_for_change(self.listener, kick, fallback, _wanted(self.engine, own))

    def hold_token(self, owner_id: str) -> AbstractAsyncContextManager[_liveness.PgToken]:
        return _hold_token(self.engine, owner_id, inline=False)

    async def _submit(self, job: Job, mode: Mode) -> Any:
        # Cancellation first: a caller cancelled while the runtime closes sees Cancelled,
        # not an error about the executor it was cancelled out of.
        await trio.lowlevel.checkpoint_if_cancelled()
        return await self._handoff.submit(job, mode)

    async def _hand_off(self, batch: list[Queued]) -> None:
        by_mode: dict[str, list[Job]] = {"write": [], "nowait": [], "read": []}
        for queued in batch:
            by_mode[queued.mode].append(queued.job)
        await trio.to_thread.run_sync(
            self.engine.run_jobs,
            by_mode["write"],
            by_mode["nowait"],
            by_mode["read"],
            limiter=self._limiter,
        )


@asynccontextmanager
async def open_thread_executor(
    engine: PgEngine, listener: PgListener | None = None
) -> AsyncIterator[PgThreadExecutor]:
    """A `PgThreadExecutor` whose pump lives in its own nursery, for the block's duration."""
    executor = PgThreadExecutor(engine, listener)
    async with pumping(executor._handoff, executor._hand_off):
        yield executor


def _masked(url: str) -> str:
    return repr(mask_password(url))


@attrs.frozen
class PostgresStore:
    """A PostgreSQL database (and schema), and how to reach it from trio (many hosts).

    Leases are judged by the server's clock unless `open_executor` gets one (tests).
    `inline=True` runs psycopg on the trio thread (deterministic tests with a virtual
    clock); the default hands work to one writer thread and groups concurrent operations
    per hand-off. `listen=True` keeps a LISTEN connection, so other hosts' wakes and
    interrupts arrive within milliseconds; `listen=False` (poll-only, e.g. behind a
    transaction-pooling PgBouncer) relies on the runtime's fallback poll.
    """

    url: str = attrs.field(repr=_masked, validator=lambda _s, _a, url: check_postgres_name(url))
    schema: str = attrs.field(
        default="public", kw_only=True, validator=lambda _s, _a, schema: check_schema(schema)
    )
    inline: bool = attrs.field(default=False, kw_only=True)
    listen: bool = attrs.field(default=True, kw_only=True)
    # Test seam: wraps each connection the engine opens (also after a reconnect), e.g. to
    # break the connection at COMMIT (fault injection, counting).
    wrap_connection: Callable[[psycopg.Connection[Any]], Any] | None = attrs.field(
        default=None, kw_only=True, repr=False
    )

    def engine(self, clock: Callable[[], float] | None = None) -> PgEngine:
        """An engine for this store (not yet connected; call `open()`)."""
        return PgEngine(self.url, self.schema, clock, self.wrap_connection)

    @asynccontextmanager
    async def open_executor(
        self, clock: Callable[[], float] | None
    ) -> AsyncIterator[PgInlineExecutor | PgThreadExecutor]:
        # clock=None: the server's clock_timestamp() is the lease clock of every host.
        engine = self.engine(clock)
        listener = PgListener(self.url, self.schema, inline=self.inline) if self.listen else None
        if self.inline:
            engine.open()
        else:
            await trio.to_thread.run_sync(engine.open)
        try:
            if listener is not None:
                await listener.open()
            if self.inline:
                yield PgInlineExecutor(engine, listener)
            else:
                async with open_thread_executor(engine, listener) as executor:
                    yield executor
        finally:
            if listener is not None:
                listener.close()
            if self.inline:
                engine.close()
            else:
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(engine.close)
