"""The contract tests' pool of migrated PostgreSQL schemas (`pg_schemas`) hands a schema on
to the next test only as a fresh migration leaves it: emptied of rows, and never after a
test changed its structure or left a lock behind."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pg_schemas
import psycopg
import pytest
from pg_schemas import MigratedSchemas

from trio_sessions import _liveness, _postgres
from trio_sessions._postgres.connections import MIGRATION_LOCK_NAMESPACE


@pytest.fixture
def pool(pg_url: str) -> Iterator[MigratedSchemas]:
    schemas = MigratedSchemas(pg_url)
    try:
        yield schemas
    finally:
        schemas.close()


def on(pg_url: str, schema: str) -> psycopg.Connection[Any]:
    return psycopg.connect(pg_url, autocommit=True, options=f"-c search_path={schema}")


def test_a_schema_comes_back_migrated_and_empty(pg_url: str, pool: MigratedSchemas) -> None:
    """Rows of every kind a test writes are gone; the version row stays."""
    first = pool.take()
    with on(pg_url, first) as conn:
        assert conn.execute("SELECT version FROM schema_version").fetchall() == [
            (_postgres.SCHEMA_VERSION,)
        ]
        conn.execute("SELECT ts_submit('s', '{}', 'i1', 'call-1', 1000, false)")
        assert conn.execute("SELECT count(*) FROM session_input").fetchall() == [(1,)]
    pool.give_back(first)
    assert pool.take() == first
    with on(pg_url, first) as conn:
        assert conn.execute("SELECT count(*) FROM session_input").fetchall() == [(0,)]
        assert conn.execute("SELECT count(*) FROM session").fetchall() == [(0,)]
        assert conn.execute("SELECT version FROM schema_version").fetchall() == [
            (_postgres.SCHEMA_VERSION,)
        ]


def test_a_schema_with_many_rows_comes_back_empty(pg_url: str, pool: MigratedSchemas) -> None:
    """Past the rows a DELETE empties cheaply (`_DELETE_AT_MOST`), the tables are truncated:
    the schema still comes back migrated and empty."""
    first = pool.take()
    many = pg_schemas._DELETE_AT_MOST + 1
    with on(pg_url, first) as conn:
        conn.execute(
            "INSERT INTO session(id, time_created)"
            " SELECT 's' || n, 0 FROM generate_series(1, %s) n",
            (many,),
        )
    pool.give_back(first)
    assert pool.take() == first
    with on(pg_url, first) as conn:
        assert conn.execute("SELECT count(*) FROM session").fetchall() == [(0,)]
        assert conn.execute("SELECT version FROM schema_version").fetchall() == [
            (_postgres.SCHEMA_VERSION,)
        ]


CHANGES: dict[str, Callable[[psycopg.Connection[Any]], object]] = {
    "function-replaced": lambda c: c.execute(
        "CREATE OR REPLACE FUNCTION ts_lock_key(p_session text) RETURNS bigint"
        " LANGUAGE sql IMMUTABLE AS $$ SELECT 1::bigint $$"
    ),
    "function-added": lambda c: c.execute(
        "CREATE FUNCTION extra() RETURNS int LANGUAGE sql AS $$ SELECT 1 $$"
    ),
    "function-dropped": lambda c: c.execute("DROP FUNCTION ts_lock_key(text) CASCADE"),
    "column-added": lambda c: c.execute("ALTER TABLE session ADD COLUMN extra int"),
    "index-dropped": lambda c: c.execute(
        "DROP INDEX " + c.execute("SELECT indexname FROM pg_indexes WHERE schemaname ="
        " current_schema() AND indexname NOT LIKE '%key' LIMIT 1").fetchall()[0][0]
    ),
    "trigger-added": lambda c: (
        c.execute(
            "CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS"
            " $$ BEGIN RAISE EXCEPTION 'no'; END $$"
        ),
        c.execute("CREATE TRIGGER refuse BEFORE INSERT ON session FOR EACH ROW"
                  " EXECUTE FUNCTION refuse()"),
    ),
    "privilege-revoked": lambda c: c.execute("REVOKE ALL ON session FROM PUBLIC, CURRENT_USER"),
    "version-changed": lambda c: c.execute("UPDATE schema_version SET version = version + 1"),
    "table-added": lambda c: c.execute("CREATE TABLE extra(x int)"),
}  # fmt: skip


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_schema_a_test_changed_is_dropped_not_reused(
    pg_url: str, pool: MigratedSchemas, change: str
) -> None:
    first = pool.take()
    with on(pg_url, first) as conn:
        CHANGES[change](conn)
    pool.give_back(first)
    assert pool.take() != first
    with psycopg.connect(pg_url, autocommit=True) as conn:
        gone = conn.execute("SELECT count(*) FROM pg_namespace WHERE nspname = %s", (first,))
        assert gone.fetchall() == [(0,)]


# A lingering connection's advisory locks of the schema, as the library takes them.
LINGERING_LOCKS: dict[str, Callable[[psycopg.Connection[Any], str], object]] = {
    "liveness token": lambda conn, schema: conn.execute(_liveness._TAKE, ("owner-1",)),
    "migration lock": lambda conn, schema: conn.execute(
        "SELECT pg_advisory_lock(%s, hashtext(%s))", (MIGRATION_LOCK_NAMESPACE, schema)
    ),
    "session lock": lambda conn, schema: conn.execute("SELECT pg_advisory_lock(ts_lock_key('s'))"),
}  # fmt: skip


@pytest.mark.parametrize("lock", list(LINGERING_LOCKS))
def test_a_schema_is_not_reused_while_another_connection_holds_its_advisory_lock(
    pg_url: str, pool: MigratedSchemas, lock: str
) -> None:
    """A process the test started may linger with its liveness token (a session-level
    advisory lock), a migration or a session lock: the next test on the same schema would
    see that owner alive, or wait."""
    first = pool.take()
    with on(pg_url, first) as conn:
        conn.execute("SELECT ts_submit('s', '{}', 'i1', 'call-1', 1000, false)")
    with on(pg_url, first) as lingering:
        LINGERING_LOCKS[lock](lingering, first)
        pool.give_back(first)
    assert pool.take() != first


def test_another_schemas_advisory_locks_do_not_keep_a_schema_from_reuse(
    pg_url: str, pool: MigratedSchemas
) -> None:
    """Other clients of the same server (another test run, a soak) hold advisory locks of
    their own schemas, or none of ours at all: the schema comes back all the same."""
    first, other = pool.take(), pool.take()
    with on(pg_url, first) as conn:
        conn.execute("SELECT ts_submit('s', '{}', 'i1', 'call-1', 1000, false)")
    with on(pg_url, other) as lingering:
        for take in LINGERING_LOCKS.values():
            take(lingering, other)
        lingering.execute("SELECT pg_advisory_lock(42)")
        pool.give_back(first)
        assert pool.take() == first
