"""SQLite's schema, connection settings and migrations: the public names, named CHECKs,
foreign keys, indexes, WAL and the pragmas, idempotent and refused (too new) migrations,
in-place upgrades. SQLite only: these read SQLite's catalogue and driver errors
(PostgreSQL's schema: tests/test_postgres.py)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from helpers import Raw, check_pre_streaming_upgrade, seed_pre_streaming

from trio_sessions import (
    SchemaTooNew,
    StoreError,
    _sqlite,
    _store,
)

from .common import (
    Db,
)

# Every test here: SQLite's catalogue, pragmas, driver errors and file format.
pytestmark = pytest.mark.sqlite_only


SCHEMA = {
    "session": {"id", "time_created", "time_woken", "wakes", "wake_attempts"},
    "session_input": {"id", "session_id", "seq", "payload", "time_created"},
    "session_execution": {
        "id",
        "session_id",
        "owner_id",
        "phase",
        "anchor_seq",
        "time_created",
        "heartbeat_at",
        "expires_at",
    },
    "session_recovery": {
        "execution_id",
        "session_id",
        "owner_id",
        "expires_at",
        "recovery_error",
        "time_created",
        "time_quarantined",
    },
    "session_message": {
        "id",
        "session_id",
        "execution_id",
        "input_id",
        "role",
        "seq",
        "data",
        "time_created",
        "time_updated",
    },
}


NOT_NULL = {
    "session": {"time_created", "wakes", "wake_attempts"},
    "session_input": {"session_id", "seq", "payload", "time_created"},
    "session_execution": {"session_id", "owner_id", "phase", "time_created", "expires_at"},
    "session_recovery": {"session_id", "owner_id", "expires_at", "time_created"},
    "session_message": {"session_id", "role", "seq", "data", "time_created", "time_updated"},
}


PRIMARY_KEY = {
    "session": "id",
    "session_input": "id",
    "session_execution": "id",
    "session_recovery": "execution_id",
    "session_message": "id",
}


def unique_column_sets(db: Db, table: str) -> set[tuple[str, ...]]:
    found = set()
    for _, name, unique, *_ in db.rows(f"PRAGMA index_list({table})"):
        if unique:
            found.add(tuple(row[2] for row in db.rows(f"PRAGMA index_info({name})")))
    return found


@pytest.mark.parametrize("table", sorted(SCHEMA))
def test_schema_has_the_public_names(db: Db, table: str) -> None:
    """Every table and column DESIGN §3 names exists, with its NOT NULLs and primary key."""
    info = db.rows(f"PRAGMA table_info({table})")
    columns = {row[1]: row for row in info}
    assert SCHEMA[table] <= set(columns)
    for column in NOT_NULL[table]:
        assert columns[column][3] == 1, f"{table}.{column} must be NOT NULL"
    assert [row[1] for row in info if row[5]] == [PRIMARY_KEY[table]]


def test_schema_unique_constraints_and_foreign_keys(db: Db) -> None:
    """The UNIQUE constraints and ON DELETE CASCADE references of DESIGN §3 are in place."""
    assert ("session_id",) in unique_column_sets(db, "session_execution")
    assert ("session_id", "seq") in unique_column_sets(db, "session_input")
    assert ("session_id", "seq") in unique_column_sets(db, "session_message")
    assert ("input_id",) in unique_column_sets(db, "session_message")
    for table in ("session_input", "session_execution", "session_message"):
        references = {
            (r[2], r[3], r[4], r[6]) for r in db.rows(f"PRAGMA foreign_key_list({table})")
        }
        assert ("session", "session_id", "id", "CASCADE") in references


def test_schema_indexes(db: Db) -> None:
    """A partial index on session(time_woken) and an index on session_execution(expires_at)."""
    sql = {
        name: text
        for name, text in db.rows("SELECT name, sql FROM sqlite_master WHERE type = 'index'")
    }
    woken = [s for s in sql.values() if s and "ON session(time_woken)" in s]
    assert len(woken) == 1
    assert "WHERE time_woken IS NOT NULL" in woken[0]
    assert any(s and "ON session_execution(expires_at)" in s for s in sql.values())


def test_phase_check_is_named(db: Db) -> None:
    """An invalid phase fails with an IntegrityError naming session_execution_phase_check."""
    db.run(_store.wake, "existing")
    with pytest.raises(sqlite3.IntegrityError, match="session_execution_phase_check"):
        db.conn.execute(
            "INSERT INTO session_execution(id, session_id, owner_id, phase, time_created,"
            " expires_at) VALUES ('bad', 'existing', 'owner', 'invalid', 0, 1)"
        )
    assert db.rows("SELECT * FROM session_execution") == []


def test_wake_attempts_check_is_named(db: Db) -> None:
    """A negative wake_attempts fails with an IntegrityError naming session_wake_attempts_check."""
    db.run(_store.wake, "s")
    with pytest.raises(sqlite3.IntegrityError, match="session_wake_attempts_check"):
        db.conn.execute("UPDATE session SET wake_attempts = -1 WHERE id = 's'")
    assert db.doorbell()[2] == 0


def test_role_check(db: Db) -> None:
    """A message role outside user/assistant/system is refused by a CHECK."""
    db.run(_store.wake, "s")
    with pytest.raises(sqlite3.IntegrityError, match="CHECK"):
        db.conn.execute(
            "INSERT INTO session_message(id, session_id, execution_id, role, seq, data,"
            " time_created, time_updated) VALUES ('m', 's', NULL, 'robot', 1, '{}', 0, 0)"
        )


def test_connection_settings(db: Db) -> None:
    """WAL, foreign keys on, synchronous=NORMAL and a busy timeout on every connection."""
    assert db.rows("PRAGMA journal_mode") == [("wal",)]
    assert db.rows("PRAGMA foreign_keys") == [(1,)]
    assert db.rows("PRAGMA synchronous") == [(1,)]
    assert db.rows("PRAGMA busy_timeout")[0][0] > 0
    assert db.rows("PRAGMA user_version") == [(_sqlite.SCHEMA_VERSION,)]
    assert db.conn.isolation_level is None


def test_foreign_keys_are_enforced(db: Db) -> None:
    """An input for a session that does not exist is refused (foreign_keys=ON really holds)."""
    with pytest.raises(sqlite3.IntegrityError, match="FOREIGN KEY"):
        db.conn.execute(
            "INSERT INTO session_input(id, session_id, seq, payload, time_created)"
            " VALUES ('i', 'ghost', 1, '{}', 0)"
        )


def test_migration_is_idempotent(db: Db) -> None:
    """Connecting again leaves the schema, the version and the data exactly as they were."""
    db.run(_store.submit, "s", '{"n": 1}', "in-1")
    schema = db.rows("SELECT type, name, tbl_name, sql FROM sqlite_master ORDER BY name")
    data = db.snapshot()
    for _ in range(2):
        again = _sqlite.connect(db.path)
        try:
            assert (
                again.execute(
                    "SELECT type, name, tbl_name, sql FROM sqlite_master ORDER BY name"
                ).fetchall()
                == schema
            )
            assert _sqlite.schema_version(again) == _sqlite.SCHEMA_VERSION
        finally:
            again.close()
    assert db.snapshot() == data


def file_bytes(path: Path) -> dict[str, bytes | None]:
    wal = path.with_name(path.name + "-wal")
    return {
        "db": path.read_bytes(),
        "wal": wal.read_bytes() if wal.exists() else None,
    }


def test_schema_too_new_leaves_our_file_unchanged(tmp_path: Path) -> None:
    """A trio_sessions file from a newer version raises SchemaTooNew and is not modified."""
    path = tmp_path / "newer.db"
    _sqlite.connect(path).close()
    raw = sqlite3.connect(path)
    raw.execute(f"PRAGMA user_version = {_sqlite.SCHEMA_VERSION + 1}")
    raw.close()
    before = file_bytes(path)
    with pytest.raises(SchemaTooNew, match="newer"):
        _sqlite.connect(path)
    with pytest.raises(SchemaTooNew):
        _sqlite.connect(path, create=False)
    assert file_bytes(path) == before
    assert issubclass(SchemaTooNew, StoreError)


def test_schema_too_new_foreign_file_gets_no_tables(tmp_path: Path) -> None:
    """A rollback-journal file with a higher user_version is refused untouched: no WAL switch,
    no tables created."""
    path = tmp_path / "other.db"
    raw = sqlite3.connect(path)
    raw.execute("CREATE TABLE unrelated(x)")
    raw.execute("PRAGMA user_version = 99")
    raw.commit()
    raw.close()
    before = file_bytes(path)
    with pytest.raises(SchemaTooNew):
        _sqlite.connect(path)
    assert file_bytes(path) == before
    check = sqlite3.connect(path)
    try:
        assert check.execute("PRAGMA journal_mode").fetchone() == ("delete",)
        assert check.execute("SELECT name FROM sqlite_master").fetchall() == [("unrelated",)]
    finally:
        check.close()


def test_upgrade_of_a_version_1_file_adds_set_aside_tables(tmp_path: Path) -> None:
    """A version-1 file is upgraded in place on open: its rows kept, the set-aside tables and
    session_execution.handed_back (0 for existing claims) added, and its partial index."""
    path = tmp_path / "v1.db"
    old = sqlite3.connect(path)
    old.executescript(_sqlite._MIGRATIONS[1])
    old.execute("PRAGMA user_version = 1")
    old.execute("INSERT INTO session(id, time_created) VALUES ('s', 0)")
    old.execute(
        "INSERT INTO session_execution(id, session_id, owner_id, phase, time_created,"
        " expires_at) VALUES ('e', 's', 'o', 'running', 0, 1)"
    )
    old.commit()
    old.close()
    conn = _sqlite.connect(path)
    try:
        assert _sqlite.schema_version(conn) == _sqlite.SCHEMA_VERSION == 9
        assert conn.execute("SELECT id, handed_back FROM session_execution").fetchall() == [
            ("e", 0)
        ]
        # Version 7: the handed-back claims' partial index, which the change look reads.
        indexes = conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = ?",
            ("session_execution",),
        ).fetchall()
        assert ("session_execution_handed_back",) in indexes
        # Version 8: when a write that left no newer row or time of its own was made.
        assert conn.execute("SELECT time_written FROM session").fetchall() == [(None,)]
        for table, columns in (
            ("session_input_rejected", ["id", "session_id", "seq", "payload", "reason"]),
            ("session_message_rejected", ["id", "session_id", "execution_id", "seq", "data"]),
        ):
            found = [row[1] for row in conn.execute(f"PRAGMA table_info({table})")]
            assert columns == [c for c in found if c in columns]
    finally:
        conn.close()


async def test_upgrade_of_a_version_3_file_adds_streaming(tmp_path: Path) -> None:
    """A version-3 file is upgraded in place on open (to the current version, through 4's
    streaming): messages are marked
    finished from their JSON, the stream and delta tables are added, and an open reply
    written before the upgrade is still closed by recovery."""
    path = tmp_path / "v3.db"
    old = sqlite3.connect(path)
    for version in (1, 2, 3):
        old.executescript(_sqlite._MIGRATIONS[version])
    old.execute("PRAGMA user_version = 3")
    old.close()
    raw = Raw(path)
    seed_pre_streaming(raw)
    _sqlite.connect(path).close()
    assert raw.rows("PRAGMA user_version") == [(_sqlite.SCHEMA_VERSION,)]
    await check_pre_streaming_upgrade(raw, path)


def test_upgrade_of_a_version_8_file_indexes_every_message_an_ending_reads_as_open(
    tmp_path: Path,
) -> None:
    """Every ending reads an execution's maybe-open messages as `finished <> 1` since
    version 9, so a mark another tool set to 2 is read and refused, not passed over;
    version 9's step makes the partial index cover those rows, and the read stays one
    search of it."""
    from trio_sessions._store.transcript import MAYBE_OPEN

    path = tmp_path / "v8.db"
    old = sqlite3.connect(path)
    for version in range(1, 9):
        old.executescript(_sqlite._MIGRATIONS[version])
    old.execute("PRAGMA user_version = 8")
    old.execute("INSERT INTO session(id, time_created) VALUES ('s', 0)")
    for seq, finished in ((1, 1), (2, 2), (3, 0)):
        old.execute(
            "INSERT INTO session_message(id, session_id, execution_id, role, seq, data,"
            " time_created, time_updated, finished) VALUES (?, 's', 'e', 'assistant', ?, '{}',"
            " 0, 0, ?)",
            (f"m{seq}", seq, finished),
        )
    old.commit()
    old.close()
    conn = _sqlite.connect(path)
    try:
        assert _sqlite.schema_version(conn) == 9
        [(definition,)] = conn.execute(
            "SELECT sql FROM sqlite_master WHERE name = 'session_message_open'"
        ).fetchall()
        assert definition.endswith("WHERE finished <> 1"), definition
        query = (
            "SELECT id FROM session_message m"
            f" WHERE m.execution_id = 'e' AND m.{MAYBE_OPEN} AND m.role = 'assistant'"
        )
        assert conn.execute(query + " ORDER BY id").fetchall() == [("m2",), ("m3",)]
        [(_, _, _, plan)] = conn.execute("EXPLAIN QUERY PLAN " + query).fetchall()
    finally:
        conn.close()
    assert "USING INDEX session_message_open (execution_id=?)" in plan, plan


def test_synchronous_option_applies_to_every_connection(tmp_path: Path) -> None:
    """SQLiteStore(synchronous='FULL') sets PRAGMA synchronous=FULL on each connection the
    runtime opens (default NORMAL)."""
    import trio

    seen: list[int] = []

    def capture(conn: sqlite3.Connection) -> sqlite3.Connection:
        seen.append(conn.execute("PRAGMA synchronous").fetchone()[0])
        return conn

    async def main() -> None:
        for synchronous in ("FULL", "NORMAL"):
            store = _sqlite.SQLiteStore(
                tmp_path / "db", synchronous=synchronous, wrap_connection=capture
            )
            async with store.open_executor(None):
                pass

    trio.run(main)
    # The connections it wraps: the worker's writer, the loop's, the large reads'.
    assert seen == [2, 2, 2, 1, 1, 1]
