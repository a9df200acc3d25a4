"""The SQL layer: the public schema, connection settings and migrations, every fenced
operation (its positive case and each way its fence refuses), acquire, submit, the
finish/wake serialisation, group commit, and the recovery reads and outcomes.

Every operation runs through `_sqlite.run_op` on a real SQLite file at a fixed instant of a
fake clock; "nothing written" is checked by comparing every row of every table.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import Raw, check_pre_streaming_upgrade, seed_pre_streaming

from trio_sessions import (
    AssistantData,
    InputConflict,
    LeaseLost,
    SchemaTooNew,
    StoreError,
    ToolPart,
    _backend,
    _codec,
    _sqlite,
    _store,
    _transcript,
)
from trio_sessions._decisions import AcquireVerdict, RecoveryDecision
from trio_sessions._model import BUDGET_EXHAUSTED, INTERRUPTED, OWNER_LOST

NOW = 1_800_000_000_000
LEASE = 30_000
ME = "recoverer"


class Db:
    """A real SQLite file and a fake clock (integer ms) that tests move by hand."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.conn = _sqlite.connect(path)
        self.now = NOW

    def clock(self) -> float:
        return self.now / 1000

    def run(self, op: Callable[..., Any], *args: Any) -> Any:
        assert _backend.now_ms(self.clock) == self.now
        return _sqlite.run_op(self.conn, self.clock, op, *args)

    def rows(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        return self.conn.execute(sql, params).fetchall()

    def snapshot(self) -> dict[str, list[tuple[Any, ...]]]:
        return {
            table: sorted(self.rows(f"SELECT * FROM {table}"), key=repr)
            for table in sorted(_sqlite.OUR_TABLES)
        }

    def claim(
        self, session_id: str = "s", owner: str = "owner-a", execution: str = "exec-1"
    ) -> str:
        self.run(_store.wake, session_id)
        acquired = self.run(_store.acquire, session_id, execution, owner, LEASE)
        assert acquired.verdict is AcquireVerdict.CLAIM
        return execution

    def claim_row(self, session_id: str = "s") -> tuple[Any, ...] | None:
        found = self.rows(
            "SELECT id, owner_id, phase, anchor_seq, time_created, heartbeat_at, expires_at"
            " FROM session_execution WHERE session_id = ?",
            (session_id,),
        )
        return found[0] if found else None

    def doorbell(self, session_id: str = "s") -> tuple[Any, ...]:
        """(time_woken, wakes, wake_attempts)"""
        [row] = self.rows(
            "SELECT time_woken, wakes, wake_attempts FROM session WHERE id = ?", (session_id,)
        )
        return row

    def message(self, message_id: str) -> AssistantData:
        [(text,)] = self.rows("SELECT data FROM session_message WHERE id = ?", (message_id,))
        return _codec.decode_assistant(text, key=message_id)

    def put_message(
        self,
        message_id: str,
        execution_id: str | None,
        seq: int,
        data: str,
        role: str = "assistant",
    ) -> None:
        self.conn.execute(
            "INSERT INTO session_message(id, session_id, execution_id, role, seq, data,"
            " time_created, time_updated) VALUES (?, 's', ?, ?, ?, ?, 0, 0)",
            (message_id, execution_id, role, seq, data),
        )

    def expire(self, session_id: str = "s") -> None:
        """Move the clock to the claim's expiry instant: the lease is no longer live."""
        row = self.claim_row(session_id)
        assert row is not None
        self.now = row[6]


@pytest.fixture
def db(tmp_path: Path) -> Iterator[Db]:
    database = Db(tmp_path / "store.db")
    try:
        yield database
    finally:
        database.conn.close()


def busy_claim(db: Db) -> str:
    """A live claim of owner-a on session 's' with a pending input, a taken input, an open
    assistant message (one running tool, one completed tool, text) and a set doorbell."""
    db.run(_store.submit, "s", '{"n": 1}', "in-taken")
    execution = db.claim()
    db.run(_store.take_inputs, execution, "owner-a")
    db.run(_store.begin_assistant, execution, "owner-a", "m-1")

    def build(data: AssistantData) -> AssistantData:
        data = _transcript.append_text(data, "thinking")
        data = _transcript.start_tool(data, "running", "search", {"q": 1})
        data = _transcript.start_tool(data, "done", "search", {"q": 2})
        return _transcript.settle_tool(data, "done", output=[1, 2])

    db.run(_store.update_assistant, execution, "owner-a", "m-1", build)
    db.run(_store.submit, "s", '{"n": 2}', "in-pending")
    return execution


def tools(data: AssistantData) -> dict[str, tuple[str, str | None]]:
    return {p.call_id: (p.status, p.error) for p in data.parts if isinstance(p, ToolPart)}


# ---------------------------------------------------------------------------------------------
# Schema and connection

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
        db.put_message("m", None, 1, "{}", role="robot")


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


# ---------------------------------------------------------------------------------------------
# Wake and submit


def test_wake_creates_session_and_coalesces(db: Db) -> None:
    """wake creates the session, sets time_woken once (the first wake) and counts every wake."""
    db.run(_store.wake, "s")
    db.now += 1000
    db.run(_store.wake, "s")
    db.run(_store.wake, "s")
    assert db.doorbell() == (NOW, 3, 0)


def test_submit_stores_input_and_rings(db: Db) -> None:
    """submit creates the session, rings the doorbell and stores inputs with increasing seq."""
    assert db.run(_store.submit, "s", '{"n": 1}', "in-1") == "in-1"
    assert db.run(_store.submit, "s", '{"n": 2}', "in-2") == "in-2"
    assert db.doorbell() == (NOW, 2, 0)
    assert db.rows("SELECT id, session_id, seq, payload FROM session_input ORDER BY seq") == [
        ("in-1", "s", 1, '{"n": 1}'),
        ("in-2", "s", 2, '{"n": 2}'),
    ]


def test_submit_is_idempotent_by_input_id(db: Db) -> None:
    """The same input id and payload for the same session returns the id, writes nothing."""
    db.run(_store.submit, "s", '{"n": 1}', "in-1")
    before = db.snapshot()
    db.now += 5000
    assert db.run(_store.submit, "s", '{"n": 1}', "in-1") == "in-1"
    assert db.snapshot() == before


def test_submit_is_idempotent_after_the_input_was_taken(db: Db) -> None:
    """After the input became a user message, resubmitting it returns the id, writes nothing."""
    db.run(_store.submit, "s", '{"n": 1}', "in-1")
    execution = db.claim()
    db.run(_store.take_inputs, execution, "owner-a")
    assert db.run(_store.finish_iteration, execution, "owner-a") is False
    before = db.snapshot()
    assert db.run(_store.submit, "s", '{"n": 1}', "in-1") == "in-1"
    assert db.snapshot() == before
    assert db.rows("SELECT * FROM session_input") == []


@pytest.mark.parametrize("taken", [False, True], ids=["pending", "taken"])
def test_submit_same_id_other_session_conflicts(db: Db, taken: bool) -> None:
    """An input id stored for another session raises InputConflict and writes nothing."""
    db.run(_store.submit, "s", '{"n": 1}', "in-1")
    if taken:
        execution = db.claim()
        db.run(_store.take_inputs, execution, "owner-a")
    before = db.snapshot()
    with pytest.raises(InputConflict, match="in-1"):
        db.run(_store.submit, "other", '{"n": 1}', "in-1")
    assert db.snapshot() == before


# ---------------------------------------------------------------------------------------------
# Acquire


@pytest.mark.parametrize("expired", [False, True], ids=["live", "expired"])
@pytest.mark.parametrize("owner", ["owner-a", "owner-b"], ids=["own", "foreign"])
def test_acquire_never_overwrites_a_claim_row(db: Db, expired: bool, owner: str) -> None:
    """Invariant 2: a claim row (live or expired, own or foreign) is never overwritten; the
    doorbell stays set for the holder or recovery."""
    db.claim(owner="owner-a", execution="exec-1")
    db.run(_store.wake, "s")
    if expired:
        db.expire()
        db.now += 60_000
    before = db.snapshot()
    acquired = db.run(_store.acquire, "s", "exec-new", owner, LEASE)
    assert acquired.verdict is AcquireVerdict.HELD
    assert acquired.holder == "owner-a"
    assert db.snapshot() == before


def test_acquire_needs_the_doorbell(db: Db) -> None:
    """Without a set doorbell nothing is claimed, for an idle session or an unknown one."""
    execution = db.claim()
    db.run(_store.finish_iteration, execution, "owner-a")
    before = db.snapshot()
    assert db.run(_store.acquire, "s", "exec-2", "owner-a", LEASE).verdict is (
        AcquireVerdict.NO_DOORBELL
    )
    assert db.run(_store.acquire, "ghost", "exec-3", "owner-a", LEASE).verdict is (
        AcquireVerdict.NO_DOORBELL
    )
    assert db.snapshot() == before


def test_acquire_takes_doorbell_and_anchors_at_newest_seq(db: Db) -> None:
    """acquire inserts a running claim with anchor_seq = newest message seq and takes the
    doorbell; it reports the session's wake_attempts."""
    db.run(_store.submit, "s", '{"n": 1}', "in-1")
    db.run(_store.submit, "s", '{"n": 2}', "in-2")
    first = db.claim(execution="exec-1")
    db.run(_store.take_inputs, first, "owner-a")
    db.run(_store.begin_assistant, first, "owner-a", "m-1")
    assert db.run(_store.finish_iteration, first, "owner-a") is False
    db.conn.execute("UPDATE session SET wake_attempts = 4")
    db.now += 1000
    db.run(_store.wake, "s")
    db.run(_store.wake, "s")
    acquired = db.run(_store.acquire, "s", "exec-2", "owner-b", LEASE)
    assert acquired.verdict is AcquireVerdict.CLAIM
    assert acquired.attempt == 4
    assert db.claim_row() == ("exec-2", "owner-b", "running", 3, db.now, None, db.now + LEASE)
    assert db.doorbell() == (None, 0, 4)


def test_acquire_on_empty_session_has_null_anchor(db: Db) -> None:
    """With no messages yet, the claim's anchor_seq is NULL."""
    db.claim()
    claim = db.claim_row()
    assert claim is not None
    assert claim[3] is None


# ---------------------------------------------------------------------------------------------
# Fenced drain writes: positive cases


def test_finish_iteration_releases_and_resets_attempts(db: Db) -> None:
    """With no doorbell, finish_iteration deletes the claim and resets wake_attempts."""
    execution = db.claim()
    db.conn.execute("UPDATE session SET wake_attempts = 3")
    assert db.run(_store.finish_iteration, execution, "owner-a") is False
    assert db.claim_row() is None
    assert db.doorbell() == (None, 0, 0)


def test_wake_during_claim_makes_finish_continue(db: Db) -> None:
    """Invariant 9: a wake committed while the claim exists is taken by finish_iteration
    (continue) instead of the claim being deleted; the next finish then releases."""
    execution = db.claim()
    claim = db.claim_row()
    db.run(_store.wake, "s")
    db.run(_store.wake, "s")
    assert db.run(_store.finish_iteration, execution, "owner-a") is True
    assert db.claim_row() == claim
    assert db.doorbell()[:2] == (None, 0)
    assert db.run(_store.finish_iteration, execution, "owner-a") is False
    assert db.claim_row() is None


def test_wake_after_release_finds_no_claim_and_acquires(db: Db) -> None:
    """The other order of the serialisation: a wake after the finish leaves a doorbell that
    a fresh acquire takes."""
    execution = db.claim()
    assert db.run(_store.finish_iteration, execution, "owner-a") is False
    db.run(_store.wake, "s")
    assert db.run(_store.acquire, "s", "exec-2", "owner-b", LEASE).verdict is AcquireVerdict.CLAIM


def test_finish_failed_closes_message_and_does_not_rearm(db: Db) -> None:
    """finish_failed fails the open message and its running tools, deletes the claim, resets
    attempts, and leaves untaken inputs without re-arming the doorbell."""
    execution = busy_claim(db)
    db.conn.execute("UPDATE session SET time_woken = NULL, wakes = 0")  # taken mid-drain
    db.conn.execute("UPDATE session SET wake_attempts = 2")
    assert db.run(_store.finish_failed, execution, "owner-a", "failed: boom") is False
    assert db.claim_row() is None
    message = db.message("m-1")
    assert message.finished
    assert message.error == "failed: boom"
    assert tools(message) == {"running": ("error", "failed: boom"), "done": ("completed", None)}
    assert db.doorbell() == (None, 0, 0)
    assert db.rows("SELECT id FROM session_input") == [("in-pending",)]


def test_finish_failed_reports_an_already_set_doorbell(db: Db) -> None:
    """A doorbell set before the failure stays set and is reported (one follow-up)."""
    execution = busy_claim(db)
    assert db.run(_store.finish_failed, execution, "owner-a", "failed") is True
    assert db.doorbell()[0] is not None


def test_mark_cancelling_changes_only_the_phase(db: Db) -> None:
    """mark_cancelling makes the cancellation durable and touches nothing else."""
    execution = busy_claim(db)
    before = db.snapshot()
    db.run(_store.mark_cancelling, execution, "owner-a")
    after = db.snapshot()
    assert after["session_execution"] == [
        tuple("cancelling" if v == "running" else v for v in row)
        for row in before["session_execution"]
    ]
    assert {k: v for k, v in after.items() if k != "session_execution"} == {
        k: v for k, v in before.items() if k != "session_execution"
    }


def test_finish_interrupted_cleans_and_rearms_for_pending_inputs(db: Db) -> None:
    """finish_interrupted finishes the message as interrupted, fails running tools, deletes
    the claim and re-arms the doorbell because an input is still pending."""
    execution = busy_claim(db)
    db.run(_store.finish_iteration, execution, "owner-a")  # doorbell taken
    assert db.doorbell()[0] is None
    db.run(_store.mark_cancelling, execution, "owner-a")
    assert db.run(_store.finish_interrupted, execution, "owner-a") is True
    assert db.claim_row() is None
    message = db.message("m-1")
    assert message.finished
    assert message.error == INTERRUPTED
    assert tools(message) == {"running": ("error", INTERRUPTED), "done": ("completed", None)}
    assert db.doorbell()[0] == db.now


def test_finish_interrupted_without_inputs_leaves_no_doorbell(db: Db) -> None:
    """With nothing pending and no wake, an interrupt leaves no doorbell: no successor."""
    execution = db.claim()
    assert db.run(_store.finish_interrupted, execution, "owner-a") is False
    assert db.doorbell()[:2] == (None, 0)
    assert db.claim_row() is None


def test_take_inputs_turns_inputs_into_user_messages_in_order(db: Db) -> None:
    """take_inputs returns pending inputs in seq order and moves each into a user message."""
    db.run(_store.submit, "s", '{"n": 1}', "in-1")
    db.run(_store.submit, "s", '{"n": 2}', "in-2")
    execution = db.claim()
    taken = db.run(_store.take_inputs, execution, "owner-a")
    assert [(i.id, i.payload) for i in taken] == [("in-1", {"n": 1}), ("in-2", {"n": 2})]
    assert db.rows("SELECT * FROM session_input") == []
    assert db.rows(
        "SELECT input_id, role, seq, data, execution_id FROM session_message ORDER BY seq"
    ) == [
        ("in-1", "user", 1, '{"n": 1}', execution),
        ("in-2", "user", 2, '{"n": 2}', execution),
    ]
    assert db.run(_store.take_inputs, execution, "owner-a") == []


def test_begin_and_update_assistant(db: Db) -> None:
    """begin_assistant appends an empty open message at the next seq; update_assistant applies
    a transition to the stored row and returns the new value."""
    db.run(_store.submit, "s", '{"n": 1}', "in-1")
    execution = db.claim()
    db.run(_store.take_inputs, execution, "owner-a")
    db.run(_store.begin_assistant, execution, "owner-a", "m-1")
    assert db.rows("SELECT role, seq, execution_id FROM session_message WHERE id = 'm-1'") == [
        ("assistant", 2, execution)
    ]
    assert db.message("m-1") == _transcript.EMPTY
    result, version = db.run(
        _store.update_assistant,
        execution,
        "owner-a",
        "m-1",
        lambda d: _transcript.append_text(d, "hi"),
    )
    assert version == 1
    assert result == db.message("m-1") == _transcript.append_text(_transcript.EMPTY, "hi")


def test_heartbeat_renews_all_claims_in_one_transaction(db: Db) -> None:
    """heartbeat renews each held live claim to now+lease, records heartbeat_at and reports
    each phase (cancelling too); a lost one reports None."""
    a = db.claim("a", execution="exec-a")
    b = db.claim("b", execution="exec-b")
    db.run(_store.mark_cancelling, b, "owner-a")
    db.now += 10_000
    phases = db.run(_store.heartbeat, "owner-a", [a, b, "exec-gone"], LEASE)
    assert phases == {a: "running", b: "cancelling", "exec-gone": None}
    for session in ("a", "b"):
        row = db.claim_row(session)
        assert row is not None
        assert (row[5], row[6]) == (db.now, db.now + LEASE)


def test_expire_claims_counts_only_own_live_claims(db: Db) -> None:
    """Shutdown expiry ends own live leases (phase kept) and returns how many it ended."""
    a = db.claim("a", execution="exec-a")
    b = db.claim("b", execution="exec-b")
    db.run(_store.mark_cancelling, b, "owner-a")
    db.claim("c", owner="owner-b", execution="exec-c")
    foreign = db.claim_row("c")
    assert db.run(_store.expire_claims, "owner-a", [a, b, "exec-c", "exec-none"]) == 2
    row_a, row_b = db.claim_row("a"), db.claim_row("b")
    assert row_a is not None
    assert (row_a[2], row_a[6]) == ("running", db.now)
    assert row_b is not None
    assert (row_b[2], row_b[6]) == ("cancelling", db.now)
    assert db.claim_row("c") == foreign
    assert db.run(_store.expire_claims, "owner-a", [a, b]) == 0


# ---------------------------------------------------------------------------------------------
# Fenced drain writes: every refusal raises LeaseLost and writes nothing

REFUSALS = ["wrong_owner", "wrong_execution", "expired", "expired_long_ago"]

FENCED: dict[str, Callable[[Db, str, str], Any]] = {
    "finish_iteration": lambda db, e, o: db.run(_store.finish_iteration, e, o),
    "finish_failed": lambda db, e, o: db.run(_store.finish_failed, e, o, "failed"),
    "mark_cancelling": lambda db, e, o: db.run(_store.mark_cancelling, e, o),
    "finish_interrupted": lambda db, e, o: db.run(_store.finish_interrupted, e, o),
    "take_inputs": lambda db, e, o: db.run(_store.take_inputs, e, o),
    "begin_assistant": lambda db, e, o: db.run(_store.begin_assistant, e, o, "m-new"),
    "update_assistant": lambda db, e, o: db.run(
        _store.update_assistant, e, o, "m-1", lambda d: _transcript.append_text(d, "x")
    ),
}


def refuse(db: Db, how: str, execution: str) -> tuple[str, str]:
    if how == "wrong_owner":
        return execution, "owner-b"
    if how == "wrong_execution":
        return "exec-other", "owner-a"
    db.expire()
    if how == "expired_long_ago":
        db.now += 3_600_000
    return execution, "owner-a"


@pytest.mark.parametrize("how", REFUSALS)
@pytest.mark.parametrize("op", sorted(FENCED))
def test_fence_refusal_raises_lease_lost_and_writes_nothing(db: Db, op: str, how: str) -> None:
    """Invariant 13: a fenced write by the wrong owner, the wrong execution or after the lease
    ended raises LeaseLost and leaves every row as it was."""
    execution = busy_claim(db)
    execution, owner = refuse(db, how, execution)
    before = db.snapshot()
    with pytest.raises(LeaseLost):
        FENCED[op](db, execution, owner)
    assert db.snapshot() == before


@pytest.mark.parametrize("op", sorted(FENCED))
def test_fence_holds_one_ms_before_expiry(db: Db, op: str) -> None:
    """The lease is live until its last millisecond: each fenced write still succeeds then."""
    execution = busy_claim(db)
    db.expire()
    db.now -= 1
    before = db.snapshot()
    FENCED[op](db, execution, "owner-a")  # raises LeaseLost if the fence refused
    assert db.snapshot() != before


@pytest.mark.parametrize("how", REFUSALS)
def test_heartbeat_refusal_never_revives(db: Db, how: str) -> None:
    """Invariant 4: a heartbeat for a lost lease reports None and leaves the row untouched."""
    execution = busy_claim(db)
    execution, owner = refuse(db, how, execution)
    before = db.snapshot()
    assert db.run(_store.heartbeat, owner, [execution], LEASE) == {execution: None}
    assert db.snapshot() == before


@pytest.mark.parametrize("how", REFUSALS)
def test_expire_claims_refusal_counts_zero(db: Db, how: str) -> None:
    """Shutdown expiry of a claim it does not hold live returns 0 and writes nothing."""
    execution = busy_claim(db)
    execution, owner = refuse(db, how, execution)
    before = db.snapshot()
    assert db.run(_store.expire_claims, owner, [execution]) == 0
    assert db.snapshot() == before


def test_update_assistant_refuses_another_executions_message(db: Db) -> None:
    """A live claim still cannot write a message that belongs to another execution."""
    db.claim("s")
    db.put_message("m-foreign", "exec-old", 1, _codec.encode_assistant(_transcript.EMPTY))
    before = db.snapshot()
    with pytest.raises(LeaseLost):
        db.run(
            _store.update_assistant,
            "exec-1",
            "owner-a",
            "m-foreign",
            lambda d: _transcript.append_text(d, "x"),
        )
    assert db.snapshot() == before


def test_zombie_owner_cannot_write_after_takeover(db: Db) -> None:
    """After recovery took over an expired claim, every write of the old owner is refused."""
    execution = busy_claim(db)
    db.expire()
    candidate = _store.Candidate("s", execution)
    assert db.run(_store.take_recovery_leases, ME, LEASE, [candidate]) == [candidate]
    recovered = db.run(_store.apply_recovery, ME, candidate, "exec-new", LEASE, 10)
    assert recovered.decision is RecoveryDecision.RESUME
    before = db.snapshot()
    for op in sorted(FENCED):
        with pytest.raises(LeaseLost):
            FENCED[op](db, execution, "owner-a")
    assert db.run(_store.heartbeat, "owner-a", [execution], LEASE) == {execution: None}
    assert db.snapshot() == before


# ---------------------------------------------------------------------------------------------
# Group commit


def wake_then_fail(tx: _sqlite.SQLiteTx, session_id: str) -> None:
    _store.wake(tx, session_id)
    raise RuntimeError("boom")


def bad_sql(tx: _sqlite.SQLiteTx, session_id: str) -> None:
    _store.wake(tx, session_id)
    tx.execute("INSERT INTO no_such_table VALUES (1)")


def sessions(db: Db) -> list[str]:
    return [row[0] for row in db.rows("SELECT id FROM session ORDER BY id")]


def test_group_commit_isolates_a_failing_job(db: Db) -> None:
    """One job raising rolls back only its own writes; the other jobs commit together."""
    jobs = [
        _backend.Job(_store.wake, ("s1",)),
        _backend.Job(wake_then_fail, ("s2",)),
        _backend.Job(_store.submit, ("s3", '{"n": 1}', "in-3")),
        _backend.Job(bad_sql, ("s4",)),
        _backend.Job(_store.wake, ("s5",)),
    ]
    _sqlite.run_batch(db.conn, db.clock, jobs)
    assert sessions(db) == ["s1", "s3", "s5"]
    assert [job.error is None for job in jobs] == [True, False, True, False, True]
    assert isinstance(jobs[1].error, RuntimeError)
    assert isinstance(jobs[3].error, StoreError)
    assert isinstance(jobs[3].error.__cause__, sqlite3.OperationalError)
    assert jobs[2].unwrap() == "in-3"
    with pytest.raises(RuntimeError, match="boom"):
        jobs[1].unwrap()
    assert not db.conn.in_transaction


def test_group_commit_with_a_refused_fence(db: Db) -> None:
    """A LeaseLost in one job of a batch leaves the batch's other writes committed."""
    execution = db.claim()
    jobs = [
        _backend.Job(_store.mark_cancelling, (execution, "owner-b")),
        _backend.Job(_store.heartbeat, ("owner-a", [execution], LEASE)),
    ]
    _sqlite.run_batch(db.conn, db.clock, jobs)
    assert isinstance(jobs[0].error, LeaseLost)
    assert jobs[1].unwrap() == {execution: "running"}
    row = db.claim_row()
    assert row is not None
    assert row[2] == "running"
    assert row[5] == db.now


def test_single_failing_job_rolls_back(db: Db) -> None:
    """A lone job that fails after writing leaves nothing behind and no open transaction."""
    with pytest.raises(RuntimeError):
        db.run(wake_then_fail, "s")
    assert sessions(db) == []
    assert not db.conn.in_transaction
    db.run(_store.wake, "s")
    assert sessions(db) == ["s"]


# ---------------------------------------------------------------------------------------------
# Recovery reads


def expired_claim(db: Db, session_id: str, expires_at: int, owner: str = "dead") -> str:
    execution = db.claim(session_id, owner=owner, execution="exec-" + session_id)
    db.conn.execute(
        "UPDATE session_execution SET expires_at = ? WHERE id = ?", (expires_at, execution)
    )
    return execution


def woken_at(db: Db, session_id: str, at: int) -> None:
    now, db.now = db.now, at
    db.run(_store.wake, session_id)
    db.now = now


def put_recovery(
    db: Db,
    execution: str,
    owner: str,
    expires_at: int,
    error: str | None = None,
    *,
    session_id: str | None = None,
) -> None:
    """A session_recovery row; its session defaults to the one `expired_claim` named."""
    session_id = session_id or execution.removeprefix("exec-")
    db.conn.execute(
        "INSERT INTO session_recovery(execution_id, session_id, owner_id, expires_at,"
        " recovery_error, time_created, time_quarantined) VALUES (?, ?, ?, ?, ?, 0, ?)",
        (execution, session_id, owner, expires_at, error, None if error is None else 0),
    )


def names(candidates: list[_store.Candidate]) -> list[tuple[str, str | None]]:
    return [(c.session_id, c.execution_id) for c in candidates]


def ordering_fixture(db: Db) -> None:
    expired_claim(db, "late", NOW - 1000)
    expired_claim(db, "early", NOW - 5000)
    expired_claim(db, "mid", NOW - 3000)
    db.run(_store.wake, "mid")  # an expired claim with a doorbell is listed once, as expired
    expired_claim(db, "exact", NOW)  # expires_at == now: expired
    db.claim("live", owner="alive", execution="exec-live")
    woken_at(db, "bell-new", NOW - 100)
    woken_at(db, "bell-old", NOW - 9000)
    woken_at(db, "bell-mid", NOW - 2000)


def test_recovery_candidates_ordering(db: Db) -> None:
    """Expired claims oldest expiry first, then unclaimed doorbells oldest wake first; live
    claims are never candidates."""
    ordering_fixture(db)
    assert names(db.run(_store.recovery_candidates, ME, 100, [])) == [
        ("early", "exec-early"),
        ("mid", "exec-mid"),
        ("late", "exec-late"),
        ("exact", "exec-exact"),
        ("bell-old", None),
        ("bell-mid", None),
        ("bell-new", None),
    ]


@pytest.mark.parametrize(
    ("limit", "count_expired", "count_bells"), [(1, 1, 0), (4, 4, 0), (5, 4, 1), (6, 4, 2)]
)
def test_recovery_candidates_share_one_limit(
    db: Db, limit: int, count_expired: int, count_bells: int
) -> None:
    """Expired claims and doorbells share one budget, expired claims first."""
    ordering_fixture(db)
    found = db.run(_store.recovery_candidates, ME, limit, [])
    assert len(found) == limit
    assert sum(c.execution_id is not None for c in found) == count_expired
    assert sum(c.execution_id is None for c in found) == count_bells
    assert names(found) == names(db.run(_store.recovery_candidates, ME, 100, []))[:limit]


def test_recovery_candidates_exclusions_do_not_use_the_budget(db: Db) -> None:
    """Quarantined executions, another owner's live recovery lease and local sessions are
    excluded in SQL, so the budget reaches the valid rows behind them."""
    for i, session in enumerate(["quarantined", "leased", "local", "valid"]):
        expired_claim(db, session, NOW - 10_000 + i)
    put_recovery(db, "exec-quarantined", ME, NOW + LEASE, error="bad row")
    put_recovery(db, "exec-leased", "other-recoverer", NOW + 1)
    woken_at(db, "local-bell", NOW - 50_000)
    woken_at(db, "bell", NOW - 40_000)
    local = ["local", "local-bell"]
    assert names(db.run(_store.recovery_candidates, ME, 1, local)) == [("valid", "exec-valid")]
    assert names(db.run(_store.recovery_candidates, ME, 100, local)) == [
        ("valid", "exec-valid"),
        ("bell", None),
    ]


def test_recovery_candidates_include_own_and_expired_recovery_leases(db: Db) -> None:
    """An own live recovery lease, or another owner's expired one, does not hide a claim."""
    expired_claim(db, "mine", NOW - 2000)
    expired_claim(db, "stale", NOW - 1000)
    put_recovery(db, "exec-mine", ME, NOW + LEASE)
    put_recovery(db, "exec-stale", "other-recoverer", NOW)
    assert names(db.run(_store.recovery_candidates, ME, 10, [])) == [
        ("mine", "exec-mine"),
        ("stale", "exec-stale"),
    ]


def test_a_stale_candidate_gets_no_recovery_lease(db: Db) -> None:
    """A candidate whose claim another recoverer took over after this scan read it gets no
    recovery lease: a lease row with no claim behind it is never scanned again, so if its
    recoverer then died it would stay forever (found by the PostgreSQL soak)."""
    execution = busy_claim(db)
    db.expire()
    candidate = _store.Candidate("s", execution)
    assert db.run(_store.recovery_candidates, ME, 10, []) == [candidate]
    assert db.run(_store.take_recovery_leases, "other", LEASE, [candidate]) == [candidate]
    db.run(_store.apply_recovery, "other", candidate, "exec-new", LEASE, 10)
    assert db.rows("SELECT * FROM session_recovery") == []
    assert db.run(_store.take_recovery_leases, ME, LEASE, [candidate]) == []
    assert db.rows("SELECT * FROM session_recovery") == []


def test_recovery_candidates_writes_nothing(db: Db) -> None:
    """The candidate scan is a read."""
    ordering_fixture(db)
    before = db.snapshot()
    db.run(_store.recovery_candidates, ME, 100, [])
    assert db.snapshot() == before


# ---------------------------------------------------------------------------------------------
# Recovery leases


def recovery_rows(db: Db) -> list[tuple[Any, ...]]:
    return db.rows(
        "SELECT execution_id, owner_id, expires_at, recovery_error FROM session_recovery"
        " ORDER BY execution_id"
    )


def test_take_recovery_leases_rules(db: Db) -> None:
    """Taken when absent, own or expired; refused when another owner's is live or when
    quarantined; refused rows are unchanged and only taken candidates are returned."""
    for session in ("absent", "own", "foreign-live", "foreign-expired", "quarantined"):
        expired_claim(db, session, NOW - 1)
    put_recovery(db, "exec-own", ME, NOW + 5)
    put_recovery(db, "exec-foreign-live", "other", NOW + 1)
    put_recovery(db, "exec-foreign-expired", "other", NOW)
    put_recovery(db, "exec-quarantined", ME, NOW + LEASE, error="bad")
    candidates = db.run(_store.recovery_candidates, ME, 100, [])
    candidates.append(_store.Candidate("quarantined", "exec-quarantined"))
    candidates.append(_store.Candidate("foreign-live", "exec-foreign-live"))
    taken = db.run(_store.take_recovery_leases, ME, LEASE, candidates)
    assert sorted(c.session_id for c in taken) == ["absent", "foreign-expired", "own"]
    assert recovery_rows(db) == [
        ("exec-absent", ME, NOW + LEASE, None),
        ("exec-foreign-expired", ME, NOW + LEASE, None),
        ("exec-foreign-live", "other", NOW + 1, None),
        ("exec-own", ME, NOW + LEASE, None),
        ("exec-quarantined", ME, NOW + LEASE, "bad"),
    ]


# ---------------------------------------------------------------------------------------------
# Recovery outcomes


def recover(db: Db, execution: str, *, max_resumes: int = 10, take: bool = True) -> Any:
    candidate = _store.Candidate("s", execution)
    if take:
        assert db.run(_store.take_recovery_leases, ME, LEASE, [candidate]) == [candidate]
    return db.run(_store.apply_recovery, ME, candidate, "exec-new", LEASE, max_resumes)


def test_recovery_skips_a_live_lease(db: Db) -> None:
    """Invariant 5: a claim whose lease is live is never recovered; only the recovery row goes."""
    execution = busy_claim(db)
    before = db.snapshot()
    recovered = recover(db, execution)
    assert (recovered.decision, recovered.fence_lost) == (RecoveryDecision.SKIP_LIVE, False)
    assert db.snapshot() == before


def test_recovery_of_a_vanished_claim_is_gone(db: Db) -> None:
    """A claim that finished after the lease was taken is left alone (GONE)."""
    execution = db.claim()
    db.expire()
    candidate = _store.Candidate("s", execution)
    db.run(_store.take_recovery_leases, ME, LEASE, [candidate])
    db.conn.execute("DELETE FROM session_execution")
    recovered = db.run(_store.apply_recovery, ME, candidate, "exec-new", LEASE, 10)
    assert recovered.decision is RecoveryDecision.GONE
    assert recovery_rows(db) == []


def test_recovery_finishes_a_cancelling_claim(db: Db) -> None:
    """Invariant 5: an expired cancellation claim is finished as cancelled, never resumed;
    running tools fail 'interrupted' and the doorbell is re-armed for the pending input."""
    execution = busy_claim(db)
    db.run(_store.finish_iteration, execution, "owner-a")  # doorbell taken
    db.run(_store.mark_cancelling, execution, "owner-a")
    db.expire()
    recovered = recover(db, execution)
    assert recovered.decision is RecoveryDecision.FINISH_CANCELLED
    assert recovered.new_execution_id is None
    assert db.claim_row() is None
    message = db.message("m-1")
    assert message.finished
    assert message.error == INTERRUPTED
    assert tools(message) == {"running": ("error", INTERRUPTED), "done": ("completed", None)}
    assert db.doorbell()[0] == db.now
    assert recovery_rows(db) == []


def test_recovery_drops_a_superseded_execution(db: Db) -> None:
    """Invariant 5: an assistant message of another execution after the anchor means the claim
    is dropped, never resumed; the doorbell is re-armed for the pending input."""
    execution = busy_claim(db)
    db.run(_store.finish_iteration, execution, "owner-a")  # doorbell taken
    db.put_message("m-later", "exec-successor", 10, _codec.encode_assistant(_transcript.EMPTY))
    db.expire()
    recovered = recover(db, execution)
    assert recovered.decision is RecoveryDecision.DROP_SUPERSEDED
    assert db.claim_row() is None
    message = db.message("m-1")
    assert message.finished
    assert _transcript.unsettled_calls(message) == []
    assert db.message("m-later") == _transcript.EMPTY
    assert db.doorbell()[0] == db.now
    assert recovery_rows(db) == []


def test_null_anchor_is_superseded_by_any_other_assistant_message(db: Db) -> None:
    """With anchor_seq NULL, any assistant message of another execution supersedes."""
    execution = db.claim()
    db.put_message("m-other", "exec-successor", 1, _codec.encode_assistant(_transcript.EMPTY))
    db.expire()
    assert recover(db, execution).decision is RecoveryDecision.DROP_SUPERSEDED


def test_older_or_user_messages_do_not_supersede(db: Db) -> None:
    """Messages at or before the anchor, and user messages, never supersede: the claim resumes."""
    db.run(_store.wake, "s")
    db.put_message("m-old", "exec-0", 1, _codec.encode_assistant(_transcript.EMPTY))
    execution = db.claim()
    db.put_message("m-user", "exec-successor", 2, '{"n": 1}', role="user")
    db.expire()
    assert recover(db, execution).decision is RecoveryDecision.RESUME


def test_recovery_quarantines_a_malformed_newest_message(db: Db) -> None:
    """A newest assistant message that does not decode quarantines the execution: the reason is
    stored, the claim and message are untouched and the scan skips it from then on."""
    execution = busy_claim(db)
    db.conn.execute("UPDATE session_message SET data = '{\"parts\": 1}' WHERE id = 'm-1'")
    db.expire()
    before = db.snapshot()
    recovered = recover(db, execution)
    assert (recovered.decision, recovered.fence_lost) == (RecoveryDecision.QUARANTINE, False)
    [(owner, error, quarantined_at)] = db.rows(
        "SELECT owner_id, recovery_error, time_quarantined FROM session_recovery"
    )
    assert owner == ME
    assert quarantined_at == db.now
    assert "m-1" in error
    assert "parts" in error
    after = db.snapshot()
    assert {k: v for k, v in after.items() if k != "session_recovery"} == {
        k: v for k, v in before.items() if k != "session_recovery"
    }
    assert db.run(_store.recovery_candidates, ME, 100, []) == []
    candidate = _store.Candidate("s", execution)
    assert db.run(_store.take_recovery_leases, ME, LEASE, [candidate]) == []
    assert db.run(_store.quarantined)[0]["execution_id"] == execution


def test_quarantine_loses_its_fence_to_another_recovery_owner(db: Db) -> None:
    """Invariant 10: when another owner holds the recovery lease, quarantining writes zero rows,
    reports fence_lost and touches nothing."""
    execution = busy_claim(db)
    db.conn.execute("UPDATE session_message SET data = 'not json' WHERE id = 'm-1'")
    db.expire()
    put_recovery(db, execution, "other-recoverer", db.now + LEASE, session_id="s")
    before = db.snapshot()
    recovered = recover(db, execution, take=False)
    assert recovered.fence_lost
    assert recovered.decision in (RecoveryDecision.QUARANTINE, RecoveryDecision.GONE)
    assert db.snapshot() == before


# (recovery owner, recovery lease expiry, recovery_error, candidate session) at now = NOW
QUARANTINE_FENCE = {
    "exact": (ME, NOW + 1, None, "s"),
    "other_owner": ("other-recoverer", NOW + LEASE, None, "s"),
    "recovery_lease_expired": (ME, NOW, None, "s"),
    "already_quarantined": (ME, NOW + LEASE, "earlier reason", "s"),
    "other_session": (ME, NOW + LEASE, None, "not-s"),
}


@pytest.mark.parametrize("how", sorted(QUARANTINE_FENCE))
def test_quarantine_fence_is_exact(db: Db, how: str) -> None:
    """Invariant 10: the quarantine UPDATE is fenced on execution, session, recovery owner,
    live recovery lease and not-yet-quarantined; only the exact match writes the reason, any
    mismatch writes zero rows and reports fence_lost."""
    owner, expires_at, error, session_id = QUARANTINE_FENCE[how]
    execution = db.claim()
    db.run(_store.begin_assistant, execution, "owner-a", "m-1")
    db.conn.execute("UPDATE session_message SET data = '[]' WHERE id = 'm-1'")
    db.conn.execute("UPDATE session_execution SET expires_at = ?", (NOW - 1,))
    put_recovery(db, execution, owner, expires_at, error, session_id="s")
    before = db.snapshot()
    reason = "malformed session_message row 'm-1'"
    recovered = db.run(_store.quarantine, ME, _store.Candidate(session_id, execution), reason)
    assert recovered.decision is RecoveryDecision.QUARANTINE
    if how == "exact":
        assert not recovered.fence_lost
        [(recovery_error, quarantined_at)] = db.rows(
            "SELECT recovery_error, time_quarantined FROM session_recovery"
        )
        assert recovery_error == reason
        assert quarantined_at == NOW
    else:
        assert recovered.fence_lost
        assert db.snapshot() == before


def test_recovery_exhausted_budget_fails_without_rearming(db: Db) -> None:
    """wake_attempts >= max_resumes finishes as failed ('resume budget exhausted'), resets the
    attempts and does not re-arm the doorbell for the pending input."""
    execution = busy_claim(db)
    db.conn.execute("UPDATE session SET time_woken = NULL, wakes = 0")  # taken mid-drain
    db.conn.execute("UPDATE session SET wake_attempts = 3")
    db.expire()
    recovered = recover(db, execution, max_resumes=3)
    assert recovered.decision is RecoveryDecision.EXHAUSTED
    assert db.claim_row() is None
    message = db.message("m-1")
    assert message.finished
    assert message.error == BUDGET_EXHAUSTED
    assert tools(message) == {"running": ("error", BUDGET_EXHAUSTED), "done": ("completed", None)}
    assert db.doorbell() == (None, 0, 0)
    assert db.rows("SELECT id FROM session_input") == [("in-pending",)]
    assert recovery_rows(db) == []


def test_recovery_resume_replaces_the_claim(db: Db) -> None:
    """Resume replaces the expired claim with a fresh one of the recovery owner (anchor at the
    newest seq), counts wake_attempts+1, fails unsettled tools 'interrupted: owner lost'."""
    execution = busy_claim(db)
    db.conn.execute("UPDATE session SET wake_attempts = 1")
    db.expire()
    db.now += 5000
    recovered = recover(db, execution)
    assert recovered.decision is RecoveryDecision.RESUME
    assert (recovered.new_execution_id, recovered.attempt) == ("exec-new", 2)
    assert db.claim_row() == ("exec-new", ME, "running", 2, db.now, None, db.now + LEASE)
    assert db.doorbell() == (None, 0, 2)
    message = db.message("m-1")
    assert message.finished
    assert message.error == OWNER_LOST
    assert tools(message) == {"running": ("error", OWNER_LOST), "done": ("completed", None)}
    assert db.rows("SELECT id FROM session_input") == [("in-pending",)]
    assert recovery_rows(db) == []
    assert db.run(_store.take_inputs, "exec-new", ME)[0].id == "in-pending"


def test_takeover_is_fenced_on_the_old_claim_still_expired(db: Db) -> None:
    """The takeover UPDATE refuses a claim that is live (LeaseLost) and writes nothing, even
    the message it would have closed."""
    execution = busy_claim(db)
    facts, _ = db.run(_store._recovery_facts, _store.Candidate("s", execution))
    before = db.snapshot()
    with pytest.raises(LeaseLost):
        db.run(_store._take_over, ME, _store.Candidate("s", execution), "exec-new", LEASE, facts)
    assert db.snapshot() == before


def test_recovery_quarantines_a_row_that_cannot_be_rewritten(db: Db) -> None:
    """A message whose JSON cannot be written back is treated as malformed (quarantined)."""
    execution = db.claim()
    db.run(_store.begin_assistant, execution, "owner-a", "m-1")
    db.conn.execute(
        "UPDATE session_message SET data = ? WHERE id = 'm-1'",
        (
            '{"parts": [{"type": "tool", "call_id": "c", "name": "n", "input": {},'
            ' "status": "completed", "output": 1e400, "error": null}],'
            ' "finished": false, "error": null}',
        ),
    )
    db.expire()
    assert recover(db, execution).decision is RecoveryDecision.QUARANTINE


def test_recovery_quarantines_a_deeply_nested_row(db: Db) -> None:
    """A pathologically nested message is quarantined like any other malformed row."""
    execution = db.claim()
    db.run(_store.begin_assistant, execution, "owner-a", "m-1")
    depth = 100_000
    db.conn.execute(
        "UPDATE session_message SET data = ? WHERE id = 'm-1'",
        (
            '{"parts": [], "finished": false, "error": null, "x": '
            + "[" * depth
            + "]" * depth
            + "}",
        ),
    )
    db.expire()
    assert recover(db, execution).decision is RecoveryDecision.QUARANTINE


def test_group_commit_survives_sqlite_rolling_back_on_its_own(tmp_path: Path) -> None:
    """When SQLite itself rolls the whole transaction back after one job's error (disk
    full, I/O error), no job in the group reports success and nothing raises."""
    conn = _sqlite.connect(tmp_path / "db")

    def first(tx: _sqlite.SQLiteTx) -> str:
        _store.wake(tx, "a")
        return "ok"

    def second(tx: _sqlite.SQLiteTx) -> None:
        tx.conn.execute("ROLLBACK")  # what SQLite does by itself for SQLITE_FULL
        raise sqlite3.OperationalError("database or disk is full")

    jobs = [_backend.Job(first, ()), _backend.Job(second, ())]
    _sqlite.run_batch(conn, lambda: 1.8e9, jobs)
    assert all(isinstance(job.error, StoreError) for job in jobs)
    assert jobs[0].result is None
    assert conn.execute("SELECT id FROM session").fetchall() == []
    assert not conn.in_transaction
    conn.close()


# ---------------------------------------------------------------------------------------------
# Issue 14: set-aside records, handed-back claims, input conflicts, schema version 2


def test_submit_same_id_different_payload_conflicts(db: Db) -> None:
    """The same input id with another payload raises InputConflict, pending or taken; the same
    payload (any key order or spacing) stays idempotent."""
    db.run(_store.submit, "s", '{"a": 1, "b": [2]}', "in-1")
    db.run(_store.submit, "s", '{"n": 2}', "in-2")
    execution = db.claim()
    db.run(_store.submit, "s", '{"n": 3}', "in-3")
    db.run(_store.take_inputs, execution, "owner-a")
    db.run(_store.submit, "s", '{"n": 4}', "in-4")
    before = db.snapshot()
    for input_id, payload in (("in-1", '{"a": 1, "b": [2, 3]}'), ("in-4", '{"n": 4.0}')):
        with pytest.raises(InputConflict, match=input_id):
            db.run(_store.submit, "s", payload, input_id)
    assert db.run(_store.submit, "s", '{"b":[2],"a":1}', "in-1") == "in-1"
    assert db.run(_store.submit, "s", '{"n":4}', "in-4") == "in-4"
    assert db.snapshot() == before


def test_take_inputs_sets_a_malformed_input_aside(db: Db) -> None:
    """An input that is not a JSON object moves to session_input_rejected with its reason;
    the valid inputs around it are delivered in order and nothing stays pending."""
    db.run(_store.submit, "s", '{"n": 1}', "in-1")
    db.run(_store.submit, "s", "[1]", "in-bad")
    db.run(_store.submit, "s", '{"n": 3}', "in-3")
    execution = db.claim()
    taken = db.run(_store.take_inputs, execution, "owner-a")
    assert [(i.id, i.payload) for i in taken] == [("in-1", {"n": 1}), ("in-3", {"n": 3})]
    assert db.rows("SELECT * FROM session_input") == []
    [(input_id, session_id, seq, payload, reason, created)] = db.rows(
        "SELECT id, session_id, seq, payload, reason, time_created FROM session_input_rejected"
    )
    assert (input_id, session_id, seq, payload, created) == ("in-bad", "s", 2, "[1]", NOW)
    assert "in-bad" in reason and "JSON object" in reason
    assert db.rows("SELECT input_id, seq FROM session_message ORDER BY seq") == [
        ("in-1", 1),
        ("in-3", 2),
    ]
    assert db.run(_store.take_inputs, execution, "owner-a") == []
    assert [r["id"] for r in db.run(_store.rejected_inputs, None)] == ["in-bad"]
    assert db.run(_store.drop_rejected_input, "in-bad") == "s"
    assert db.rows("SELECT * FROM session_input_rejected") == []
    with pytest.raises(ValueError, match="in-bad"):
        db.run(_store.drop_rejected_input, "in-bad")


def test_drop_quarantined_sets_the_malformed_message_aside(db: Db) -> None:
    """Dropping a quarantine moves the malformed message (raw text kept) to
    session_message_rejected, so the session's transcript reads again."""
    execution = busy_claim(db)
    db.conn.execute("UPDATE session_message SET data = '{\"parts\": 1}' WHERE id = 'm-1'")
    db.expire()
    assert recover(db, execution).decision is RecoveryDecision.QUARANTINE
    db.run(_store.drop_quarantined, execution)
    [row] = db.rows(
        "SELECT id, session_id, execution_id, seq, data, reason, time_created"
        " FROM session_message_rejected"
    )
    assert row[:5] == ("m-1", "s", execution, 2, '{"parts": 1}')
    assert "parts" in row[5]
    assert row[6] == db.now
    messages = db.run(_store.read_transcript, "s")
    assert [(m.role, m.input_id) for m in messages] == [("user", "in-taken")]


def test_finish_iteration_closes_open_messages(db: Db) -> None:
    """A drain that returned without finish(): finish_iteration finishes its open message and
    fails its running tools ('interrupted'), whether the claim continues or is released."""
    execution = busy_claim(db)
    db.run(_store.wake, "s")
    assert db.run(_store.finish_iteration, execution, "owner-a") is True
    message = db.message("m-1")
    assert (message.finished, message.error) == (True, INTERRUPTED)
    assert tools(message) == {"running": ("error", INTERRUPTED), "done": ("completed", None)}
    db.run(_store.begin_assistant, execution, "owner-a", "m-2")
    assert db.run(_store.finish_iteration, execution, "owner-a") is False
    assert (db.message("m-2").finished, db.message("m-2").error) == (True, INTERRUPTED)


def test_handed_back_claim_resumes_without_counting(db: Db) -> None:
    """A claim handed back by a graceful shutdown is resumed even with the resume budget used
    up, and does not count wake_attempts; the new claim is not marked handed back."""
    execution = busy_claim(db)
    db.conn.execute("UPDATE session SET wake_attempts = 3")
    assert db.run(_store.expire_claims, "owner-a", [execution]) == 1
    assert db.rows("SELECT handed_back FROM session_execution") == [(1,)]
    recovered = recover(db, execution, max_resumes=3)
    assert recovered.decision is RecoveryDecision.RESUME
    assert recovered.attempt == 3
    assert db.doorbell()[2] == 3
    assert db.rows("SELECT id, handed_back FROM session_execution") == [("exec-new", 0)]


def test_upgrade_of_a_version_1_file_adds_set_aside_tables(tmp_path: Path) -> None:
    """A version-1 file is upgraded in place on open: its rows kept, the set-aside tables and
    session_execution.handed_back (0 for existing claims) added."""
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
        assert _sqlite.schema_version(conn) == _sqlite.SCHEMA_VERSION == 5
        assert conn.execute("SELECT id, handed_back FROM session_execution").fetchall() == [
            ("e", 0)
        ]
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
    assert seen == [2, 2, 1, 1]
