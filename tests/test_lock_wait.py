"""Waiting for SQLite's write lock held by another process (`_sqlite.begin_immediate` on
the executor's worker connection): the lock is tried again every few milliseconds at most,
never after SQLite's own busy handler's sleeps (up to 100 ms between its tries), so a lock
freed is taken within one short pause; "database is locked" never escapes before the
patience is spent."""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path

import pytest
import trio

import trio_sessions
from trio_sessions import _sqlite
from trio_sessions._sqlite import connections

pytestmark = pytest.mark.sqlite_only


async def test_the_executors_writer_connection_waits_for_the_lock_by_itself(
    tmp_path: Path,
) -> None:
    """The threaded executor's worker connection has SQLite's busy handler off: its
    batches wait for the lock in `begin_immediate`'s short pauses."""
    async with _sqlite.SQLiteStore(tmp_path / "s.db").open_executor(None) as executor:
        assert isinstance(executor, _sqlite.ThreadExecutor)
        assert executor.conn.execute("PRAGMA busy_timeout").fetchone()[0] == 0


def test_a_held_write_lock_is_tried_again_within_a_short_pause(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another connection holds the write lock through five tries: the pauses between
    them stay at most `LOCK_POLL_MAX_S`, and the sixth takes the lock."""
    path = tmp_path / "lock.db"
    conn = connections.poll_for_lock(_sqlite.connect(path))
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    pauses: list[float] = []

    def sleep(seconds: float) -> None:
        pauses.append(seconds)
        if len(pauses) == 5:
            holder.execute("ROLLBACK")  # the other process commits: the lock is free

    monkeypatch.setattr(time, "sleep", sleep)
    connections.begin_immediate(conn)
    try:
        assert conn.in_transaction
        assert len(pauses) == 5
        assert max(pauses) <= connections.LOCK_POLL_MAX_S
    finally:
        conn.execute("ROLLBACK")
    conn.close()
    holder.close()


def test_a_lock_never_freed_ends_in_the_error_after_the_patience(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past `LOCK_PATIENCE_S` the error is SQLite's own (the executors turn it into a
    `StoreError` for every job of the batch), nothing begun."""
    path = tmp_path / "lock.db"
    conn = connections.poll_for_lock(_sqlite.connect(path))
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
    holder.execute("ROLLBACK")
    conn.close()
    holder.close()


async def test_a_shutdown_hand_back_outlasts_another_process_s_short_commit(
    tmp_path: Path,
) -> None:
    """Under load another process holds the write lock for a moment at any instant. The
    shutdown's hand-back (`run_nowait`) must not give up at the first "locked" - PostgreSQL
    waits `NOWAIT_LOCK_TIMEOUT_MS` (50 ms) for it - or a graceful restart under load leaves
    its claims to lease expiry and counts their takeover against the resume budget (and an
    accepted interrupt's mark-cancelling, on the same path, is lost)."""
    path = tmp_path / "handback.db"
    entered = trio.Event()

    async def holding(ctx: trio_sessions.DrainContext) -> None:
        await ctx.take_inputs()
        entered.set()
        await trio.sleep_forever()

    holder = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    async with trio_sessions.open_runtime(path, holding) as runtime:
        await runtime.submit("s", {"n": 1})
        await entered.wait()
        holder.execute("BEGIN IMMEDIATE")  # another process's commit, 10 ms long
        commit = threading.Timer(0.01, holder.execute, ["ROLLBACK"])
        commit.start()
    commit.join()
    try:
        assert holder.execute("SELECT handed_back FROM session_execution").fetchall() == [(1,)]
    finally:
        holder.close()
