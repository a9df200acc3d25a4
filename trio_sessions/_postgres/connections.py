"""PostgreSQL connections: how one is opened and set up, and the schema's migrations.

psycopg is an optional extra (`trio-sessions[postgres]`): only the `_postgres` package imports
it. We use its sync API from threads; its async API is asyncio-only.

Every connection is set up by libpq options so that a dead, paused or partitioned host
releases its locks within about one default lease, not the 2-hour default keepalive:
server-side `idle_in_transaction_session_timeout`, `statement_timeout`, `lock_timeout`, TCP
keepalives and `client_connection_check_interval`; client-side libpq keepalives,
`tcp_user_timeout` and `connect_timeout`; and a bound on each wait for a reply
(`_ReplyWatchdog`). `search_path` is the configured schema; isolation is
READ COMMITTED, autocommit off (the engine switches its own connection to autocommit: its
transactions begin with their first statement).

Invariants:
* a connection string's password never reaches an error (`connect` masks it and drops the
  driver's error as cause);
* every wait for a reply is bounded, from a connection's first statement after the login on
  (`connect` watches it before it sends anything);
* migrations run in one transaction under an advisory lock per schema: processes starting
  together wait for the first one's migration (up to `MIGRATION_WAIT_S`) and then find
  nothing to do; a schema a newer library migrated is refused (`SchemaTooNew`) with nothing
  written.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import socket
import threading
import time
import weakref
from collections.abc import Mapping
from typing import Any

import psycopg
import psycopg.conninfo
from psycopg import sql

from .. import _schema
from .._errors import SchemaTooNew, StoreError
from .._naming import mask_password, secrets_of

SCHEMA_VERSION = _schema.POSTGRES_SCHEMA_VERSION
_MIGRATIONS = _schema.POSTGRES_MIGRATIONS  # in `_schema`, beside SQLite's
_BACKFILLS = _schema.POSTGRES_BACKFILLS

# Advisory locks. A session's is a single-bigint key, 64 bits of a hash of its id seeded
# with its schema's `session_lock_namespace` (`ts_lock_key`): the same session id in two
# stores of one database is two locks. An application's own bigint advisory locks share
# that key space, and one of theirs matches one of ours with a chance of about 2^-64 per
# pair. The migration lock is two-key - this namespace, then a hash of the schema - so
# stores in different schemas migrate in parallel.
MIGRATION_LOCK_NAMESPACE = 0x74734D31  # "tsM1"

# Per-connection server settings. A few seconds for statements and lock waits: our
# transactions are short, and a wait that long means a stuck peer (retried, bounded).
STATEMENT_TIMEOUT_MS = 10_000
LOCK_TIMEOUT_MS = 5_000
# A paused or partitioned owner's open transaction (and its locks) ends within this.
IDLE_IN_TRANSACTION_TIMEOUT_MS = 15_000
SERVER_KEEPALIVES = {"idle": 10, "interval": 5, "count": 3}
CLIENT_CONNECT_TIMEOUT_S = 5
TCP_USER_TIMEOUT_MS = 15_000
# How long an open waits for another process's migration of the same schema (its lock)
# before `StoreError`: a migration is no fence, and a large store's may take longer than
# LOCK_TIMEOUT_MS. Below REPLY_BOUND_S, which would end the wait as a lost connection.
MIGRATION_WAIT_S = 20.0
# The longest a connection waits for one reply. The server ends any statement within
# STATEMENT_TIMEOUT_MS, and a message of ours holds at most two that may wait (a batch's
# lock-taking call and its first statement), so a longer wait is a server (or a proxy) that
# stopped answering while the kernel keeps the connection up - TCP_USER_TIMEOUT and
# keepalives never fire then. The wait is ended as a lost connection (`_ReplyWatchdog`).
REPLY_BOUND_S = 25.0


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


# A notification payload line's prefix for a transcript-only change (`ts_signal_watchers`,
# `PgTx.notify(watchers_only=True)`): session ids are printable, so never begin with it.
WATCHERS_ONLY = "\t"


def channel(schema: str) -> str:
    """The LISTEN/NOTIFY channel of a schema's store (channels are per database)."""
    name = "trio_sessions" if schema == "public" else f"trio_sessions.{schema}"
    if len(name.encode()) > 63:  # NAMEDATALEN: longer names are truncated by the server
        name = f"trio_sessions.{hashlib.sha1(schema.encode()).hexdigest()}"
    return name


def session_lock_namespace(schema: str) -> int:
    """The seed of a schema's session lock keys (a signed bigint, as `hashtextextended`
    takes it), computed here and written into its functions: every process agrees."""
    digest = hashlib.sha256(f"trio_sessions.session:{schema}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


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
    except psycopg.Error as exc:
        # libpq quotes the piece it could not parse, which may be the rest of a password
        # (an unencoded '&' or a quote in it): the quoted pieces are not shown.
        message = re.sub(r'"[^"]*"', '"..."', f"{type(exc).__name__}: {exc}")
        raise StoreError(mask_password(message, secrets=secrets_of(url))) from None
    try:
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
        conn = _WatchedConnection.connect(
            url,
            autocommit=False,
            options=options,
            application_name=str(given.get("application_name") or "trio_sessions"),
            connect_timeout=CLIENT_CONNECT_TIMEOUT_S,
            keepalives=1,
            **keepalives,
        )
    except psycopg.Error as exc:
        raise _masked(exc, url) from None
    # Explicit: a database or role default must not change the isolation the fences assume.
    conn.isolation_level = psycopg.IsolationLevel.READ_COMMITTED
    # Watched before its first statement: a server that hangs right after the login would
    # hold every open and reconnect for ever (the listener's in a thread trio cannot cancel).
    _WATCHDOG.watch(conn)
    _never_idle_out(conn, url)
    return conn


def _never_idle_out(conn: psycopg.Connection[Any], url: str) -> None:
    """Turn off an admin's `idle_session_timeout` (PostgreSQL 14 on) for this session: the
    listener's and the liveness token's connections are idle by design - the server ending
    the token's would stop every drain of the runtime each time, the listener's cost a
    rescan. Set here, not in the startup options: an older server refuses a parameter it
    does not know, and only now is its version known."""
    if conn.info.server_version < 140000:
        return
    try:
        conn.execute("SET idle_session_timeout = 0")
        conn.commit()
    except psycopg.Error as exc:
        conn.close()
        raise _masked(exc, url) from None


def _masked(exc: psycopg.Error, url: str) -> StoreError:
    """The driver's error while connecting, as a `StoreError`: libpq may quote the
    connection string it could not use, so the password is masked - and the caller raises
    it without the driver's error as its cause (a traceback would print that one's text
    unmasked)."""
    return StoreError(mask_password(f"{type(exc).__name__}: {exc}", secrets=secrets_of(url)))


class _WatchedConnection(psycopg.Connection[Any]):
    """A connection that says since when it waits for the server (every blocking wait of
    psycopg's goes through `wait`), for `_ReplyWatchdog`; `cut` once it cut a wait short."""

    waiting_since: float | None = None
    cut = False

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        self.waiting_since = time.monotonic()
        try:
            return super().wait(*args, **kwargs)
        finally:
            self.waiting_since = None


class _ReplyWatchdog:
    """Ends a watched connection's wait for a reply once it passed `REPLY_BOUND_S`: shuts
    its socket down, so the waiting thread gets a lost connection - which the engine
    re-opens, or reports as `StoreError` past its bound (DESIGN §8) - instead of waiting for
    ever. One daemon thread per process, started with the first connection watched;
    connections are held weakly."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watched: weakref.WeakSet[_WatchedConnection] = weakref.WeakSet()
        self._thread: threading.Thread | None = None

    def watch(self, conn: _WatchedConnection) -> None:
        with self._lock:
            self._watched.add(conn)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="trio-sessions-pg-watchdog", daemon=True
                )
                self._thread.start()

    def _run(self) -> None:
        while True:
            time.sleep(REPLY_BOUND_S / 25)
            # Never dies: a watchdog thread gone would leave every wait unbounded again.
            with contextlib.suppress(Exception):
                self._cut_stuck()

    def _cut_stuck(self) -> None:
        cutoff = time.monotonic() - REPLY_BOUND_S
        with self._lock:
            # A collected connection's removal runs in whichever thread dropped it, outside
            # our lock: a copy that meets one raises, and the next tick copies again.
            watched = list(self._watched)
        for conn in watched:
            if (conn.waiting_since or cutoff) < cutoff:
                conn.cut = True
                _shut_down(conn)


_WATCHDOG = _ReplyWatchdog()


def _shut_down(conn: _WatchedConnection) -> None:
    """Shut the connection's socket down under its waiting thread (never closing the
    descriptor, which psycopg owns)."""
    with contextlib.suppress(OSError, psycopg.Error):
        fd = conn.pgconn.socket
        sock = socket.socket(fileno=fd)
        try:
            sock.shutdown(socket.SHUT_RDWR)
        finally:
            sock.detach()


def schema_version(conn: Any) -> int:
    """The schema's version; 0 when it has no `schema_version` table (or does not exist).

    `StoreError` when its `schema_version` table is another tool's (a common name: Flyway's
    of old keeps versions such as '1.2' in text): ours has an integer `version` column
    (columns a later release may add are no reason to refuse it: a newer store is
    `SchemaTooNew`), and a schema holding a version but not our `session` table is no
    trio_sessions store either - neither is migrated nor misread as a version.
    """
    columns = conn.execute(
        "SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute"
        " WHERE attrelid = to_regclass('schema_version') AND attnum > 0 AND NOT attisdropped"
        " ORDER BY attnum"
    ).fetchall()
    if not columns:
        return 0
    if dict(columns).get("version") != "integer":
        shape = ", ".join(f"{name} {kind}" for name, kind in columns)
        raise _not_ours(conn, f"its schema_version table is another tool's ({shape})")
    row = conn.execute(
        "SELECT max(version), to_regclass('session') IS NOT NULL FROM schema_version"
    ).fetchone()
    version, ours = (0 if row[0] is None else int(row[0])), row[1]
    if 0 < version <= SCHEMA_VERSION and not ours:  # a newer one is `SchemaTooNew`
        raise _not_ours(
            conn, f"it has a schema_version table (version {version}) but no session table"
        )
    return version


def _not_ours(conn: Any, why: str) -> StoreError:
    [schema] = conn.execute("SELECT current_schema()").fetchone()
    return StoreError(f"schema {schema!r} is not a trio_sessions store: {why}; nothing was written")


def _wait_for_migration_lock(conn: Any, schema: str) -> None:
    """Take the schema's migration lock, waiting up to `MIGRATION_WAIT_S` for another
    process's migration (`StoreError` past it, saying so); only this wait is that long:
    the migration's own statements keep the connection's timeouts. One message."""
    wait_ms = int(MIGRATION_WAIT_S * 1000)
    statements = sql.SQL(
        "SET LOCAL lock_timeout = {wait}; SET LOCAL statement_timeout = {statement};"
        " SELECT pg_advisory_xact_lock({namespace}, hashtext({schema}));"
        " SET LOCAL lock_timeout = DEFAULT; SET LOCAL statement_timeout = DEFAULT"
    ).format(
        wait=sql.Literal(wait_ms),
        statement=sql.Literal(wait_ms + 1000),  # the lock timeout ends the wait first
        namespace=sql.Literal(MIGRATION_LOCK_NAMESPACE),
        schema=sql.Literal(schema),
    )
    try:
        conn.execute(statements)
    except psycopg.errors.LockNotAvailable:
        raise StoreError(
            f"cannot migrate schema {schema!r}: another process is migrating it (waited"
            f" {MIGRATION_WAIT_S:g} s for its lock); nothing was written - open it again"
            " once that one is done"
        ) from None


def migrate(conn: Any, schema: str) -> None:
    """Bring the schema up to date in one transaction; idempotent, safe from many hosts.

    Serialised by an advisory lock per schema, so processes starting together wait for the
    first one's migration (up to `MIGRATION_WAIT_S`, then `StoreError`) and then find
    nothing to do. `SchemaTooNew`, with nothing written (not even the schema), when a
    newer library migrated it.
    """
    try:
        _wait_for_migration_lock(conn, schema)
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
