"""Where a contract test's data lives: an SQLite file or a PostgreSQL schema (a helper).

Every test that takes the `store` fixture runs once per backend (`conftest.py`), with the
same assertions: a backend difference is a bug unless DESIGN §8 names it. `Location` is what
the `db_path` fixture gives such a test; `Raw` and `query` read and write it as an operator
would, on a connection of their own, with the same SQL on both backends (`?` parameters).
"""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path
from typing import Any

import attrs


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


def write(location: Location, sql: str, params: tuple[Any, ...] = ()) -> None:
    if isinstance(location, PgLocation):
        import psycopg

        with psycopg.connect(location.url, options=f"-c search_path={location.schema}") as conn:
            conn.execute(_pg(sql), params)
        return
    lite = sqlite3.connect(location)
    try:
        with lite:
            lite.execute("PRAGMA foreign_keys = ON")
            lite.execute(sql, params)
    finally:
        lite.close()


def _pg(sql: str) -> str:
    if sql.lstrip().upper().startswith("PRAGMA"):
        raise ValueError(f"SQLite-only statement in a test that runs on PostgreSQL: {sql}")
    return _PLACEHOLDER.sub("%s", sql.replace("%", "%%"))
