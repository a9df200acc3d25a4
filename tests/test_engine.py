"""The sync `Engine` (`_backend.open_engine`): one store operation per transaction, outside a
runtime, the same on SQLite and PostgreSQL; `Tx.dialect` names the SQL a transaction speaks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from backends import PgLocation
from helpers import terminate_backend

from trio_sessions import _backend, _postgres, _schema, _store
from trio_sessions._backend import Engine, Tx
from trio_sessions._errors import InputConflict, StoreError

BOTH = pytest.mark.parametrize("backend", ["sqlite", "postgres"], indirect=True)


def open_at(location: Any, *, migrate: bool) -> Engine:
    if isinstance(location, PgLocation):
        return _backend.open_engine(location.url, schema=location.schema, migrate=migrate)
    return _backend.open_engine(location, migrate=migrate)


def dialect_of(tx: Tx) -> str:
    return tx.dialect


@pytest.mark.pg_unmigrated  # opens an empty schema
@BOTH
def test_an_engine_runs_store_operations_in_their_own_transactions(
    backend: str, db_path: Any
) -> None:
    engine = open_at(db_path, migrate=True)
    try:
        assert engine.dialect == backend
        assert engine.run(dialect_of) == engine.read(dialect_of) == backend
        expected = {
            "sqlite": _schema.SQLITE_SCHEMA_VERSION,
            "postgres": _schema.POSTGRES_SCHEMA_VERSION,
        }[backend]
        assert engine.schema_version() == expected
        assert engine.run(_store.submit, "s", '{"n": 1}', "in-1") == "in-1"
        # A raising operation writes nothing; the engine stays usable.
        with pytest.raises(InputConflict):
            engine.run(_store.submit, "s", '{"n": 2}', "in-1")
        status = engine.read(_store.status)
        assert [(s["id"], s["pending_inputs"]) for s in status["sessions"]] == [("s", 1)]
    finally:
        engine.close()


@pytest.mark.pg_unmigrated  # opens an empty schema
@BOTH
def test_an_engine_opened_without_migrate_never_writes_the_schema(
    backend: str, db_path: Any
) -> None:
    if backend == "sqlite":
        assert isinstance(db_path, Path)
        with pytest.raises(StoreError):
            open_at(db_path, migrate=False)
        assert not db_path.exists()
        return
    engine = open_at(db_path, migrate=False)
    try:
        assert engine.schema_version() == 0
    finally:
        engine.close()


def test_a_schema_needs_a_postgresql_url(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="postgresql://"):
        _backend.open_engine(tmp_path / "s.db", schema="public")


def test_a_postgresql_engines_schema_version_survives_a_lost_connection(
    pg_url: str, migrated_schema: str
) -> None:
    """`schema_version()` after the server ended the engine's connection (a restart, an
    admin's pg_terminate_backend) re-opens it, as `run` and `read` do: no bare driver error
    (`psycopg.OperationalError`) reaches the CLI's health check."""
    engine = _backend.open_engine(pg_url, schema=migrated_schema)
    try:
        assert isinstance(engine, _postgres.PgSyncEngine)
        terminate_backend(pg_url, engine.engine.conn.info.backend_pid)
        assert engine.schema_version() == _schema.POSTGRES_SCHEMA_VERSION
        assert engine.engine.reconnects == 1
    finally:
        engine.close()
