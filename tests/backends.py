"""Where a contract test's data lives: an SQLite file or a PostgreSQL schema (a helper).

Every test that takes the `store` fixture runs once per backend (`conftest.py`), with the
same assertions: a backend difference is a bug unless DESIGN §8 names it. `Location` is what
the `db_path` fixture gives such a test; `Raw` and `query` read and write it as an operator
would, on a connection of their own, with the same SQL on both backends (`?` parameters).

`EngineDb` is how the store tests run operations and read rows: the sync `Engine`
(`_backend.open_engine`) on either backend, at a lease clock the test moves by hand; its
`rows` is the one way those tests read a row.
"""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs

from trio_sessions import _backend, _store
from trio_sessions._backend import Engine, Tx
from trio_sessions._decisions import IterationVerdict


@attrs.frozen
class PgLocation:
    """A PostgreSQL schema standing in for a database file."""

    url: str
    schema: str


Location = Path | PgLocation

_PLACEHOLDER = re.compile(r"\?")


def rows(location: Location, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    if isinstance(location, PgLocation):
        import psycopg

        with psycopg.connect(location.url, options=f"-c search_path={location.schema}") as conn:
            return [tuple(row) for row in conn.execute(_pg(sql), params).fetchall()]
    lite = sqlite3.connect(location)
    try:
        return lite.execute(sql, params).fetchall()
    finally:
        lite.close()


class Reader:
    """`rows` on one connection held open, for a test that reads after every step: a
    PostgreSQL connection per read (~5 ms, a server process each) was most of such a step.
    Every read is its own autocommit statement, so it sees every commit before it, as a
    fresh connection's would; nothing is held between reads. Close it before the location
    goes (a pooled schema is given back)."""

    def __init__(self, location: Location) -> None:
        self.location = location
        self._conn: Any
        if isinstance(location, PgLocation):
            import psycopg

            options = f"-c search_path={location.schema}"
            self._conn = psycopg.connect(location.url, autocommit=True, options=options)
        else:
            # Used from whichever thread reads (one at a time); no implicit transaction.
            self._conn = sqlite3.connect(location, isolation_level=None, check_same_thread=False)

    def rows(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        if isinstance(self.location, PgLocation):
            sql = _pg(sql)
        return [tuple(row) for row in self._conn.execute(sql, params).fetchall()]

    def close(self) -> None:
        self._conn.close()


@contextmanager
def _writing(location: Location, sql: str) -> Iterator[tuple[Any, str]]:
    """A cursor in one transaction on a connection of its own (committed when the block
    succeeds), and `sql` as its backend takes it."""
    if isinstance(location, PgLocation):
        import psycopg

        options = f"-c search_path={location.schema}"
        with psycopg.connect(location.url, options=options) as conn, conn.cursor() as cursor:
            yield cursor, _pg(sql)
        return
    lite = sqlite3.connect(location)
    try:
        with lite:
            lite.execute("PRAGMA foreign_keys = ON")
            yield lite, sql
    finally:
        lite.close()


def write(location: Location, sql: str, params: tuple[Any, ...] = ()) -> None:
    with _writing(location, sql) as (cursor, statement):
        cursor.execute(statement, params)


def write_many(location: Location, sql: str, rows: Iterable[tuple[Any, ...]]) -> None:
    """`write` for each of `rows`, in one transaction on one connection: seeding hundreds
    of rows costs one connection, not one each (a PostgreSQL connection is ~10 ms)."""
    with _writing(location, sql) as (cursor, statement):
        cursor.executemany(statement, list(rows))


def _pg(sql: str) -> str:
    if sql.lstrip().upper().startswith("PRAGMA"):
        raise ValueError(f"SQLite-only statement in a test that runs on PostgreSQL: {sql}")
    return _PLACEHOLDER.sub("%s", sql.replace("%", "%%"))


# ---------------------------------------------------------------------------------------------
# The sync engine at a hand-moved clock


@attrs.define
class HandClock:
    """A lease clock (integer ms since the epoch) that a test moves by hand."""

    now: int

    def __call__(self) -> float:
        return self.now / 1000


def open_engine(
    location: Location, *, clock: Callable[[], float] | None = None, migrate: bool = True
) -> Engine:
    """The sync engine on a test's location (SQLite file or PostgreSQL schema)."""
    if isinstance(location, PgLocation):
        return _backend.open_engine(
            location.url, schema=location.schema, migrate=migrate, clock=clock
        )
    return _backend.open_engine(location, migrate=migrate, clock=clock)


def _select(tx: Tx, sql: str, params: tuple[Any, ...]) -> list[tuple[Any, ...]]:
    return [tuple(row) for row in tx.execute(sql, params).fetchall()]


def _write(tx: Tx, sql: str, params: tuple[Any, ...]) -> None:
    tx.execute(sql, params)


@attrs.define(eq=False)
class EngineDb:
    """A store opened through the sync `Engine`, every operation at `now` (integer ms)."""

    engine: Engine
    location: Location
    clock: HandClock

    @property
    def now(self) -> int:
        return self.clock.now

    @now.setter
    def now(self, value: int) -> None:
        self.clock.now = value

    @property
    def dialect(self) -> str:
        return self.engine.dialect

    def run(self, op: Callable[..., Any], *args: Any) -> Any:
        """Run a store operation in its own transaction at `now`."""
        assert _backend.now_ms(self.clock) == self.now
        return self.engine.run(op, *args)

    def rows(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        """Read rows (`?` parameters, the same SQL on both backends)."""
        return self.engine.read(_select, sql, params)

    def write(self, sql: str, params: tuple[Any, ...] = ()) -> None:
        """Write rows behind the store's back, as an operator or a fault would."""
        self.engine.run(_write, sql, params)

    def snapshot(self, tables: Iterable[str]) -> dict[str, list[tuple[Any, ...]]]:
        """Every row of `tables`: "nothing written" compares two of these."""
        return {
            table: sorted(self.rows(f"SELECT * FROM {table}"), key=repr) for table in sorted(tables)
        }

    @property
    def sqlite_conn(self) -> sqlite3.Connection:
        """The engine's own SQLite connection (tests of an SQLite-only seam)."""
        conn = getattr(self.engine, "conn", None)
        assert isinstance(conn, sqlite3.Connection), "an SQLite-only test ran on PostgreSQL"
        return conn


def finish_iteration(tx: Tx, session_id: str, execution_id: str, owner_id: str) -> bool:
    """`_store.end_iteration` as the store tests ask it: True when the claim continues (the
    doorbell was taken)."""
    verdict = _store.end_iteration(tx, session_id, execution_id, owner_id)
    return verdict is IterationVerdict.CONTINUE
