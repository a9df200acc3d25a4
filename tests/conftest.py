"""Test policy for trio_sessions.

* Concurrency tests are deterministic: pytest-trio's `autojump_clock`, a runtime clock tied
  to trio's virtual time (`trio_sessions.testing.trio_clock`), the inline store (SQLite on
  the trio thread, so virtual time never jumps while a worker thread blocks), gates made of
  `trio.Event`, the `acquisition_hook` and the seams in `trio_sessions.testing`.
  No sleeping "to let things settle".
* Crash tests use real processes killed with SIGKILL against a real SQLite file, bounded in
  time and count (marked `slow`, still part of the regular run).
* Every test has a one-line docstring saying what it proves, and fails when that breaks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import backends
import pytest
import trio
from backends import EngineDb, HandClock, PgLocation

from trio_sessions import Store, testing


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Every test that takes `store` or `engine` is a contract test: it runs on both
    backends, unless marked `sqlite_only` (with the reason)."""
    parametrized = {
        name.strip()
        for marker in metafunc.definition.iter_markers("parametrize")
        for name in (
            marker.args[0].split(",") if isinstance(marker.args[0], str) else marker.args[0]
        )
    }
    if (
        ("store" in metafunc.fixturenames or "engine" in metafunc.fixturenames)
        and "store" not in parametrized
        and "backend" not in parametrized
        and metafunc.definition.get_closest_marker("sqlite_only") is None
    ):
        metafunc.parametrize("backend", ["sqlite", "postgres"], indirect=True)


@pytest.fixture
def backend(request: pytest.FixtureRequest) -> str:
    return str(getattr(request, "param", "sqlite"))


@pytest.fixture
def db_path(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> Any:
    """Where the test's data lives: an SQLite file, or a PostgreSQL schema - migrated and
    empty (`migrated_schema`), or fresh and empty for a test marked `pg_unmigrated`."""
    if backend == "postgres":
        unmigrated = request.node.get_closest_marker("pg_unmigrated") is not None
        schema = request.getfixturevalue("pg_schema" if unmigrated else "migrated_schema")
        return PgLocation(request.getfixturevalue("pg_url"), schema)
    return tmp_path / "sessions.db"


@pytest.fixture
def live_store(db_path: Any) -> Any:
    """The test's store with its own threads and change signal (real time)."""
    if isinstance(db_path, PgLocation):
        from trio_sessions._postgres import PostgresStore

        return PostgresStore(db_path.url, schema=db_path.schema)
    return Store(db_path)


@pytest.fixture
def store(db_path: Any) -> Any:
    """The contract tests' store: inline (deterministic under the virtual clock)."""
    if isinstance(db_path, PgLocation):
        from trio_sessions._postgres import PostgresStore

        return PostgresStore(db_path.url, schema=db_path.schema, inline=True)
    return testing.inline_store(db_path)


# A fixed instant for store tests (integer ms); `engine.now` moves it.
ENGINE_EPOCH_MS = 1_800_000_000_000


@pytest.fixture
def engine(db_path: Any) -> Iterator[EngineDb]:
    """The store through the sync `Engine` (`_backend.open_engine`), migrated, at a lease
    clock the test moves by hand (`engine.now`, integer ms): store operations run one per
    transaction, and `engine.rows` reads rows, with the same SQL on both backends."""
    clock = HandClock(ENGINE_EPOCH_MS)
    opened = backends.open_engine(db_path, clock=clock)
    try:
        yield EngineDb(opened, db_path, clock)
    finally:
        opened.close()


@pytest.fixture
def clock(autojump_clock: trio.testing.MockClock) -> Callable[[], float]:
    """A runtime clock (epoch seconds) tied to the autojump virtual clock.

    pytest-trio hands a clock to `trio.run` only when the test itself takes it as an
    argument, so a test using this fixture must also take `autojump_clock` directly.
    """

    def now() -> float:
        return testing.DEFAULT_EPOCH + autojump_clock.current_time()

    return now


def query(db_path: Any, sql: str, params: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
    """Read the database as an operator would, on a separate connection."""
    return backends.rows(db_path, sql, params)


# ---------------------------------------------------------------------------------------------
# PostgreSQL: one throwaway server per test session (or TRIO_SESSIONS_PG_URL), a schema per
# test: fresh and empty (`pg_schema`), or migrated and emptied from a pool (`migrated_schema`,
# the contract tests'). Imported lazily, so SQLite-only runs never touch psycopg.


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """A PostgreSQL URL for the whole session; the server fails loudly if it cannot start."""
    from pg_server import postgres_url

    with postgres_url() as url:
        yield url


@pytest.fixture
def pg_schema(pg_url: str) -> Iterator[str]:
    """A fresh, empty schema (unique name), dropped with everything in it after the test."""
    yield from fresh_schema(pg_url)


@pytest.fixture(scope="session")
def migrated_schemas(pg_url: str) -> Iterator[Any]:
    from pg_schemas import MigratedSchemas

    schemas = MigratedSchemas(pg_url)
    try:
        yield schemas
    finally:
        schemas.close()


@pytest.fixture
def migrated_schema(migrated_schemas: Any) -> Iterator[str]:
    """A schema migrated to the current version, with no rows but its version's: reused
    from test to test when a test left it exactly as migrated (`pg_schemas`)."""
    name = migrated_schemas.take()
    try:
        yield name
    finally:
        migrated_schemas.give_back(name)


def fresh_schema(pg_url: str) -> Iterator[str]:
    """Create a schema of a unique name, yield it, then drop it with everything in it."""
    import uuid

    import psycopg
    from psycopg import sql

    name = f"test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(name)))
    yield name
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(name)))


@pytest.fixture
def logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    """The library's log records, DEBUG and up (read them with `helpers.records`)."""
    caplog.set_level(logging.DEBUG, logger="trio_sessions")
    return caplog
