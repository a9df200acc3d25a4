"""The SQLite backend (the embedded default, one host): connections, transactions with group
commit, the change signal, and the executors that bring operations from trio to SQLite.

Modules, in the order a call passes them:
* `executors`: `SQLiteStore` and its executors (`_backend.Executor`): the trio side, group
  commit on the event loop or through one worker thread, or inline on the trio thread (tests);
* `engine`: `SQLiteTx`, one transaction as an operation sees it; the group-commit batches; the
  sync `SQLiteEngine` and `open_engine` - no trio;
* `connections`: opening and configuring a connection, the database file, migrating the
  schema, the write lock and WAL checkpoints;
* `changes`: `ChangeReader`, the reads on the trio thread and the signal that another
  connection committed.

Every name the rest of the package, its tools and its tests use is re-exported here, so
callers write `_sqlite.X` whatever module X lives in. A test that patches a setting patches
it where it is read (`_sqlite.executors.CHANGE_POLL`).
"""

from __future__ import annotations

from .changes import CHANGE_GAP, CHANGE_POLL, WRITE_SETTLE_MAX, ChangeReader
from .connections import (
    _MIGRATIONS,
    BUSY_TIMEOUT_MS,
    LOCK_PATIENCE_S,
    OUR_TABLES,
    SCHEMA_VERSION,
    SYNCHRONOUS,
    DatabaseFile,
    check_synchronous,
    checkpoint,
    connect,
    connect_nonblocking,
    migrate,
    schema_version,
)
from .engine import SQLiteEngine, SQLiteTx, open_engine, run_batch, run_op, try_run_batch
from .executors import (
    CHECKPOINT_EVERY,
    WAL_RESTART_FRAMES,
    WAL_WARN_BYTES,
    InlineExecutor,
    SQLiteStore,
    ThreadExecutor,
    open_thread_executor,
)

__all__ = [
    "BUSY_TIMEOUT_MS",
    "CHANGE_GAP",
    "CHANGE_POLL",
    "CHECKPOINT_EVERY",
    "LOCK_PATIENCE_S",
    "OUR_TABLES",
    "SCHEMA_VERSION",
    "SYNCHRONOUS",
    "WAL_RESTART_FRAMES",
    "WAL_WARN_BYTES",
    "WRITE_SETTLE_MAX",
    "_MIGRATIONS",
    "ChangeReader",
    "DatabaseFile",
    "InlineExecutor",
    "SQLiteEngine",
    "SQLiteStore",
    "SQLiteTx",
    "ThreadExecutor",
    "check_synchronous",
    "checkpoint",
    "connect",
    "connect_nonblocking",
    "migrate",
    "open_engine",
    "open_thread_executor",
    "run_batch",
    "run_op",
    "schema_version",
    "try_run_batch",
]
