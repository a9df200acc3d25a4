"""Waiting for SQLite's write lock held by another process (`_sqlite.begin_immediate`):
the lock is tried again every few milliseconds at most, never after SQLite's own busy
handler's sleeps (up to 100 ms between its tries), so a lock freed is taken within one
short pause; "database is locked" never escapes, and the connection keeps its own busy
timeout for its other statements."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import pytest

from trio_sessions import _sqlite
from trio_sessions._sqlite import connections

pytestmark = pytest.mark.sqlite_only


def test_a_held_write_lock_is_tried_again_within_a_short_pause(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another connection holds the write lock through five tries: each try returns at
    once (no wait inside SQLite), the pauses between them stay at most `LOCK_POLL_MAX_S`,
    the sixth takes the lock, and the connection's busy timeout is what it was."""
    path = tmp_path / "lock.db"
    conn = _sqlite.connect(path)
    conn.execute("PRAGMA busy_timeout = 50")  # a try inside SQLite's handler: >= 50 ms
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    pauses: list[float] = []

    def sleep(seconds: float) -> None:
        pauses.append(seconds)
        if len(pauses) == 5:
            holder.execute("ROLLBACK")  # the other process commits: the lock is free

    monkeypatch.setattr(time, "sleep", sleep)
    started = time.monotonic()
    connections.begin_immediate(conn)
    elapsed = time.monotonic() - started
    try:
        assert conn.in_transaction
        assert len(pauses) == 5
        assert max(pauses) <= connections.LOCK_POLL_MAX_S
        # Six tries that each returned at once; SQLite's handler would have slept 50 ms
        # in each of the five that failed.
        assert elapsed < 0.2, elapsed
    finally:
        conn.execute("ROLLBACK")
    assert conn.execute("PRAGMA busy_timeout").fetchone()[0] == 50
    conn.close()
    holder.close()


def test_a_lock_never_freed_ends_in_the_error_after_the_patience(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past `LOCK_PATIENCE_S` the error is SQLite's own (the executors turn it into a
    `StoreError` for every job of the batch), and the busy timeout is restored."""
    path = tmp_path / "lock.db"
    conn = _sqlite.connect(path)
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    now = [0.0]

    def sleep(seconds: float) -> None:
        now[0] += seconds

    monkeypatch.setattr(time, "sleep", sleep)
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    monkeypatch.setattr(connections, "LOCK_PATIENCE_S", 1.0)
    with pytest.raises(sqlite3.OperationalError, match="locked"):
        connections.begin_immediate(conn)
    assert now[0] >= 1.0
    assert not conn.in_transaction
    assert conn.execute("PRAGMA busy_timeout").fetchone()[0] == _sqlite.BUSY_TIMEOUT_MS
    holder.execute("ROLLBACK")
    conn.close()
    holder.close()
