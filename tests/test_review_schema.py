"""Review of schema creation, versioning, migration and startup (DESIGN §3, §8), both
backends: foreign stores refused clearly and untouched, older stores opened with their data.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

import trio_sessions
from trio_sessions import StoreError
from trio_sessions._postgres import PostgresStore

# ---------------------------------------------------------------------------------------------
# A store that is not ours


def test_a_foreign_schema_version_table_is_refused_as_not_ours(pg_url: str, pg_schema: str) -> None:
    """A schema whose `schema_version` table is another tool's (Flyway's of old: versions
    such as '1.2' in a varchar) is refused with a StoreError, not a ValueError traceback,
    and its table is left as it was."""
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(
            sql.SQL(
                "CREATE TABLE {}.schema_version(installed_rank INTEGER PRIMARY KEY,"
                " version VARCHAR(50), description VARCHAR(200))"
            ).format(sql.Identifier(pg_schema))
        )
        conn.execute(
            sql.SQL(
                "INSERT INTO {}.schema_version VALUES (1, '1.1', 'init'), (2, '1.2', 'more')"
            ).format(sql.Identifier(pg_schema))
        )
    engine = PostgresStore(pg_url, schema=pg_schema).engine()
    with pytest.raises(StoreError):
        engine.open()
    with psycopg.connect(pg_url, autocommit=True) as conn:
        tables = conn.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = %s", (pg_schema,)
        ).fetchall()
    assert tables == [("schema_version",)]


async def test_a_failed_migration_leaves_a_foreign_sqlite_file_as_it_was(tmp_path: Path) -> None:
    """An SQLite file of another application (its own `session` table, rollback journal)
    is refused with a StoreError, and the refused migration leaves the file as it was: still
    in its journal mode, not switched to WAL."""
    path = tmp_path / "app.db"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE session(token TEXT PRIMARY KEY, user_id INTEGER)")
    conn.execute("INSERT INTO session VALUES ('abc', 1)")
    conn.commit()
    assert conn.execute("PRAGMA journal_mode").fetchone() == ("delete",)
    conn.close()
    with pytest.raises(StoreError, match="session already exists"):
        async with trio_sessions.open_runtime(path, None):
            pass  # pragma: no cover
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("delete",)
        assert conn.execute("SELECT * FROM session").fetchall() == [("abc", 1)]
    finally:
        conn.close()
