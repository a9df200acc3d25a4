"""The PostgreSQL backend: connections, transactions, the engine with group commit, the
listener, and the executors that bring operations from trio to PostgreSQL.

psycopg is an optional extra (`trio-sessions[postgres]`): only this package imports it. We
use its sync API from threads; its async API is asyncio-only.

Modules, in the order a call passes them:
* `executors`: `PostgresStore` and its executors (`_backend.Executor`): the trio side, a few
  writer lanes, each a worker thread of its own taking one batch at a time (group commit;
  one session's operations on one lane), or inline on the trio thread (tests);
* `engine`: `PgEngine`, one connection and its transactions - batches, set-based calls,
  autocommit calls, retries, reconnects, uncertain COMMITs - and the sync `open_engine`;
* `transactions`: `PgTx`, one transaction as an operation sees it, and the SQL dialect;
* `connections`: opening and setting up a connection, and migrating the schema;
* `listener`: the connections that hold session state - LISTEN, and the liveness token's.

Every name the rest of the package, its tools and its tests use is re-exported here, so
callers write `_postgres.X` whatever module X lives in.
"""

from __future__ import annotations

from .connections import (
    _MIGRATIONS,
    CLIENT_CONNECT_TIMEOUT_S,
    IDLE_IN_TRANSACTION_TIMEOUT_MS,
    LOCK_TIMEOUT_MS,
    MIGRATION_LOCK_NAMESPACE,
    SCHEMA_VERSION,
    SERVER_KEEPALIVES,
    STATEMENT_TIMEOUT_MS,
    TCP_USER_TIMEOUT_MS,
    channel,
    connect,
    migrate,
    schema_version,
    session_lock_namespace,
)
from .engine import (
    BATCH_LIMIT,
    MAX_ATTEMPTS,
    RECONNECT_PATIENCE_S,
    RETRYABLE_SQLSTATES,
    PgEngine,
    PgSyncEngine,
    open_engine,
    run_op,
)
from .executors import (
    MAX_WRITERS,
    WRITERS,
    PgInlineExecutor,
    PgThreadExecutor,
    PostgresStore,
    open_thread_executor,
)
from .listener import (
    TOKEN_CLIENT_KEEPALIVES,
    TOKEN_SERVER_SETTINGS,
    PgListener,
    token_connection,
)
from .transactions import NOWAIT_LOCK_TIMEOUT_MS, Mode, PgTx, translate

__all__ = [
    "BATCH_LIMIT",
    "CLIENT_CONNECT_TIMEOUT_S",
    "IDLE_IN_TRANSACTION_TIMEOUT_MS",
    "LOCK_TIMEOUT_MS",
    "MAX_ATTEMPTS",
    "MAX_WRITERS",
    "MIGRATION_LOCK_NAMESPACE",
    "NOWAIT_LOCK_TIMEOUT_MS",
    "RECONNECT_PATIENCE_S",
    "RETRYABLE_SQLSTATES",
    "SCHEMA_VERSION",
    "SERVER_KEEPALIVES",
    "STATEMENT_TIMEOUT_MS",
    "TCP_USER_TIMEOUT_MS",
    "TOKEN_CLIENT_KEEPALIVES",
    "TOKEN_SERVER_SETTINGS",
    "WRITERS",
    "_MIGRATIONS",
    "Mode",
    "PgEngine",
    "PgInlineExecutor",
    "PgListener",
    "PgSyncEngine",
    "PgThreadExecutor",
    "PgTx",
    "PostgresStore",
    "channel",
    "connect",
    "migrate",
    "open_engine",
    "open_thread_executor",
    "run_op",
    "schema_version",
    "session_lock_namespace",
    "token_connection",
    "translate",
]
