"""Migrated PostgreSQL schemas for the contract tests, reused (a helper, not a test file).

Migrating a schema - a dozen tables and about a hundred server-side functions - takes some
150 ms, most of what a PostgreSQL contract test costs, and the suite runs hundreds. So a
contract test's schema (`db_path`, `store`, `engine` on PostgreSQL) comes from this pool,
migrated already, and goes back emptied - but only when it is exactly as a migration left
it: the same structure (`fingerprint`: tables, columns, indexes, constraints, triggers,
functions, privileges and the schema version), every row of ours removed, and no other
connection holding one of its advisory locks (a process the test started and that lingers:
its liveness token or session locks would be the next test's; other schemas' locks, of other
clients of the same server, do not count). Anything else, or any error doing so (a lingering
transaction's lock past the lock timeout included), and the schema is dropped instead. A
test that needs an empty schema takes `pg_schema`.
"""

from __future__ import annotations

import uuid
from typing import Any

import psycopg
from psycopg import sql

from trio_sessions import _backend
from trio_sessions._postgres.connections import MIGRATION_LOCK_NAMESPACE

# Everything about a schema's structure a test could change, in one text per object.
_FINGERPRINT = """
WITH ns AS MATERIALIZED (SELECT oid FROM pg_namespace WHERE nspname = %(schema)s)
SELECT md5(string_agg(x, '|' ORDER BY x)) FROM (
    SELECT 'n:' || coalesce(nspacl::text, '') || nspowner::text FROM pg_namespace
        WHERE nspname = %(schema)s
    UNION ALL SELECT 'r:' || relname || relkind::text || relowner::text
            || coalesce(relacl::text, '') || relrowsecurity::text
        FROM pg_class WHERE relnamespace = (SELECT oid FROM ns)
    UNION ALL SELECT 'a:' || c.relname || '.' || a.attname || ':'
            || format_type(a.atttypid, a.atttypmod) || a.attnotnull::text
            || coalesce(pg_get_expr(d.adbin, d.adrelid), '')
        FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
        LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
        WHERE c.relnamespace = (SELECT oid FROM ns) AND a.attnum > 0
        AND NOT a.attisdropped
    UNION ALL SELECT 'i:' || indexdef FROM pg_indexes WHERE schemaname = %(schema)s
    UNION ALL SELECT 'k:' || conname || pg_get_constraintdef(oid) FROM pg_constraint
        WHERE connamespace = (SELECT oid FROM ns)
    UNION ALL SELECT 't:' || pg_get_triggerdef(t.oid) FROM pg_trigger t
        JOIN pg_class c ON c.oid = t.tgrelid WHERE c.relnamespace = (SELECT oid FROM ns)
    UNION ALL SELECT 'f:' || p.proname || p.proargtypes::text || p.prorettype::text
            || md5(p.prosrc) || p.provolatile::text || coalesce(p.proconfig::text, '')
            || coalesce(p.proacl::text, '') || p.proowner::text
        FROM pg_proc p WHERE p.pronamespace = (SELECT oid FROM ns)
    UNION ALL SELECT 'y:' || typname FROM pg_type
        WHERE typnamespace = (SELECT oid FROM ns) AND typrelid = 0
) f(x)
"""

# A test's few rows are emptied with DELETE and a VACUUM (a few ms); TRUNCATE, which gives
# each of a dozen tables and their indexes new files, costs ~70 ms - per PostgreSQL contract
# test, as much as the rest of its set-up. Past this many rows TRUNCATE, as before.
_DELETE_AT_MOST = 1_000

# Another connection's advisory locks of this schema: an owner's liveness token (its class
# is the schema's, `_liveness._TOKEN_CLASS`), the schema's migration lock, a session lock of
# one of its sessions (`ts_lock_key`). pg_locks shows a two-key lock as (classid, objid,
# objsubid = 2) and a bigint key as its high and low halves (objsubid = 1), as unsigned oids.
# Other schemas' locks - other clients of the same server - are not ours to wait for.
_SCHEMAS_ADVISORY_LOCKS = sql.SQL(
    "SELECT count(*) FROM pg_locks l WHERE l.locktype = 'advisory'"
    " AND l.pid <> pg_backend_pid()"
    " AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
    " AND CASE l.objsubid"
    "   WHEN 2 THEN l.classid = (hashtext('trio_sessions.owner:' || {name})::bigint"
    "       & 4294967295)::oid"
    "     OR (l.classid = {migration}::oid"
    "       AND l.objid = (hashtext({name})::bigint & 4294967295)::oid)"
    "   ELSE (l.classid::bigint << 32 | l.objid::bigint)"
    "     IN (SELECT {lock_key}(s.id) FROM {sessions} s) END"
)


class MigratedSchemas:
    """Schemas migrated to the current version, one per test at a time (`take`,
    `give_back`); `close` drops them all."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._conn = psycopg.connect(url, autocommit=True)
        self._free: list[str] = []
        self._prints: dict[str, str] = {}  # schema -> its fingerprint as migrated
        self._tables: dict[str, list[str]] = {}  # schema -> the tables to empty

    def take(self) -> str:
        if self._free:
            return self._free.pop()
        name = f"test_{uuid.uuid4().hex[:12]}"
        self._conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(name)))
        _backend.open_engine(self.url, schema=name, migrate=True).close()
        tables = [
            row[0]
            for row in self._conn.execute(
                "SELECT tablename FROM pg_tables WHERE schemaname = %s"
                " AND tablename <> 'schema_version' ORDER BY tablename",
                (name,),
            )
        ]
        self._prints[name] = self._fingerprint(name)
        self._tables[name] = tables
        if self._rows(name):
            raise AssertionError(f"a fresh migration left rows in {name}: the pool needs work")
        return name

    def give_back(self, name: str) -> None:
        try:
            reusable = self._reusable(name)
        except psycopg.Error:
            reusable = False
        if reusable:
            self._free.append(name)
        else:
            self._drop(name)

    def close(self) -> None:
        for name in list(self._prints):
            self._drop(name)
        self._conn.close()

    def _reusable(self, name: str) -> bool:
        """Empty the schema if it is as migrated; whether it is (and now empty)."""
        locks = _SCHEMAS_ADVISORY_LOCKS.format(
            name=sql.Literal(name),
            migration=sql.Literal(MIGRATION_LOCK_NAMESPACE),
            lock_key=sql.Identifier(name, "ts_lock_key"),
            sessions=sql.Identifier(name, "session"),
        )
        if self._conn.execute(locks).fetchone() != (0,):
            return False
        if self._fingerprint(name) != self._prints[name]:
            return False
        tables = sql.SQL(", ").join(sql.Identifier(name, t) for t in self._tables[name])
        with self._conn.transaction():
            self._conn.execute("SET LOCAL lock_timeout = '500ms'")
            deleted = self._rows(name) <= _DELETE_AT_MOST
            if deleted:
                for table in self._tables[name]:
                    delete = sql.SQL("DELETE FROM {}").format(sql.Identifier(name, table))
                    self._conn.execute(delete)
            else:
                self._conn.execute(sql.SQL("TRUNCATE {}").format(tables))
        if deleted:
            # The dead rows go now, not whenever autovacuum comes: the next test's rows then
            # land in the tables' pages in the order it writes them, as in a truncated table.
            # A reused schema thus behaves as a fresh one even for a read with no ORDER BY
            # (the store's reads that decide which statements follow order their rows, as
            # drop_quarantined's now does; the fault sweep depends on that).
            self._conn.execute("SET lock_timeout = '500ms'")
            try:
                self._conn.execute(sql.SQL("VACUUM {}").format(tables))
            finally:
                self._conn.execute("RESET lock_timeout")
        return not self._rows(name)

    def _fingerprint(self, name: str) -> str:
        [(found,)] = self._conn.execute(_FINGERPRINT, {"schema": name}).fetchall()
        return str(found) + f"|v:{self._version(name)}"

    def _version(self, name: str) -> list[tuple[Any, ...]]:
        query = sql.SQL("SELECT * FROM {}").format(sql.Identifier(name, "schema_version"))
        return sorted(tuple(row) for row in self._conn.execute(query))

    def _rows(self, name: str) -> int:
        counts = [
            sql.SQL("(SELECT count(*) FROM {})").format(sql.Identifier(name, t))
            for t in self._tables[name]
        ]
        query = sql.SQL("SELECT {}").format(sql.SQL(" + ").join(counts))
        [(total,)] = self._conn.execute(query).fetchall()
        return int(total)

    def _drop(self, name: str) -> None:
        self._prints.pop(name, None)
        self._tables.pop(name, None)
        self._conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))
