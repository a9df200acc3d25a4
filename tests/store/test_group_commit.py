"""SQLite's group commit (`_sqlite.run_batch`): a failing job rolls back only its own
writes, a refused fence leaves the batch's others committed, SQLite rolling back on its own
leaves no job reporting success. SQLite only: these drive the SQLite executor's batch on
its connection (PostgreSQL's batches: tests/test_postgres.py)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from trio_sessions import (
    LeaseLost,
    StoreError,
    _backend,
    _sqlite,
    _store,
)

from .common import (
    LEASE,
    Db,
)

# Every test here: the SQLite executor's batch on its own connection.
pytestmark = pytest.mark.sqlite_only


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
        _backend.Job(_store.mark_cancelling, ("s", execution, "owner-b")),
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
