"""Contention: four processes hammering one SQLite file with wakes, drains and recovery.

Each process runs the real threaded store (its group-commit worker thread and the
never-waiting connection used on the event loop) and, for a bounded number of operations,
submits inputs to shared sessions, wakes them, runs them and calls `recover_once`. No
"database is locked" - nor any `StoreError` - may reach a caller or fail a drain. The
connection is wrapped to count, honestly, what the store absorbed on the way: write-lock
waits inside SQLite's busy handler (BEGIN IMMEDIATE that took longer than 5 ms), lock errors
the store retried or fell back from, and the slowest wait.

Run as a script (`python tests/test_contention.py worker ...`), this file is one process.
"""

from __future__ import annotations

import json
import random
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trio.lowlevel

import trio_sessions
from trio_sessions import DrainContext, Store, testing

PROCESSES = 4
SESSIONS = 8
OPERATIONS = 600
WAIT_MS = 5.0
JOIN_PATIENCE = 5.0  # seconds; a run() here finishes in milliseconds unless it is lost


@attrs.define
class LockStats:
    """What the store absorbed, counted at the connection (both connections of a process)."""

    begins: int = 0
    waits: int = 0  # BEGIN IMMEDIATE that waited for the write lock (> WAIT_MS)
    max_wait_ms: float = 0.0
    lock_errors_worker: int = 0  # raised after SQLite's own busy wait; the store retries
    lock_errors_loop: int = 0  # the never-waiting event-loop connection found the lock taken
    other_errors: list[str] = attrs.Factory(list)
    _mutex: threading.Lock = attrs.Factory(threading.Lock)

    def wrap(self, conn: sqlite3.Connection) -> CountingConnection:
        return CountingConnection(conn, self)


class CountingConnection:
    """The store uses only `execute`, `executemany` and `in_transaction`."""

    def __init__(self, conn: sqlite3.Connection, stats: LockStats) -> None:
        self._conn = conn
        self._stats = stats

    def execute(self, sql: str, params: Any = ()) -> sqlite3.Cursor:
        started = time.perf_counter()
        on_loop = threading.current_thread() is threading.main_thread()
        try:
            return self._conn.execute(sql, params)
        except sqlite3.OperationalError as exc:
            with self._stats._mutex:
                if "locked" in str(exc) or "busy" in str(exc):
                    if on_loop:
                        self._stats.lock_errors_loop += 1
                    else:
                        self._stats.lock_errors_worker += 1
                else:
                    self._stats.other_errors.append(f"{sql[:40]}: {exc}")
            raise
        finally:
            if sql.startswith("BEGIN"):
                waited = (time.perf_counter() - started) * 1000
                with self._stats._mutex:
                    self._stats.begins += 1
                    self._stats.max_wait_ms = max(self._stats.max_wait_ms, waited)
                    if waited > WAIT_MS:
                        self._stats.waits += 1

    def executemany(self, sql: str, rows: Any) -> sqlite3.Cursor:
        # Only inside a write transaction, which already holds the lock: no wait to count.
        return self._conn.executemany(sql, rows)

    @property
    def in_transaction(self) -> bool:
        return self._conn.in_transaction


async def hammer(db: Path, index: int, operations: int) -> dict[str, Any]:
    """One process: submits, wakes, runs and recovery passes on shared sessions."""
    stats = LockStats()
    errors: list[str] = []
    outcomes: dict[str, int] = {}
    submitted: list[str] = []
    rng = random.Random(index)

    async def drain(ctx: DrainContext) -> None:
        try:
            inputs = await ctx.take_inputs()
            writer = await ctx.begin_assistant()
            await writer.append_text(f"{len(inputs)} from {index}")
            await writer.finish()
        except Exception as exc:
            errors.append(f"drain: {exc!r}")
            raise

    pending: dict[int, str] = {}
    unresolved: list[str] = []
    async with (
        trio_sessions.open_runtime(
            Store(db, wrap_connection=stats.wrap),
            drain,
            owner_id=f"p{index}",
            lease=10.0,
            recovery_interval=0.05,
        ) as runtime,
        trio.open_nursery() as nursery,
    ):
        for op in range(operations):
            session_id = f"s{rng.randrange(SESSIONS)}"
            choice = rng.random()
            try:
                if choice < 0.5:
                    input_id = f"p{index}-{op}"
                    await runtime.submit(session_id, {"op": op}, input_id=input_id)
                    submitted.append(input_id)
                elif choice < 0.7:
                    await runtime.wake(session_id)
                elif choice < 0.9:

                    async def run(session_id: str = session_id, op: int = op) -> None:
                        pending[op] = session_id
                        try:
                            with trio.move_on_after(JOIN_PATIENCE) as patience:
                                outcome = await runtime.run(session_id)
                        except Exception as exc:
                            errors.append(f"run: {exc!r}")
                            return
                        finally:
                            del pending[op]
                        if patience.cancelled_caught:
                            # See test_run_joining_a_deferred_acquisition_always_returns.
                            unresolved.append(session_id)
                            return
                        outcomes[outcome.kind] = outcomes.get(outcome.kind, 0) + 1
                        if outcome.kind == "failed":
                            errors.append(f"run failed: {outcome.error!r}")

                    nursery.start_soon(run)
                else:
                    await runtime.recover_once()
            except Exception as exc:
                errors.append(f"op {op}: {exc!r}")
            if rng.random() < 0.3:
                await trio.lowlevel.checkpoint()
        with trio.move_on_after(30) as settle:
            while pending:
                await trio.sleep(0.01)
            for session_id in (f"s{i}" for i in range(SESSIONS)):
                await runtime.wait_idle(session_id)
        if settle.cancelled_caught:
            entries = {
                s: (e.execution_id, e.owned, e.deciding, e.reason, e.rings, e.rings_seen)
                for s, e in runtime._entries.items()
            }
            errors.append(f"never settled: runs waiting {pending}, registry {entries}")
            nursery.cancel_scope.cancel()
    return {
        "index": index,
        "submitted": submitted,
        "outcomes": outcomes,
        "errors": errors + stats.other_errors,
        "unresolved_joins": len(unresolved),
        "begins": stats.begins,
        "lock_waits": stats.waits,
        "max_wait_ms": round(stats.max_wait_ms, 1),
        "lock_errors_worker": stats.lock_errors_worker,
        "lock_errors_loop": stats.lock_errors_loop,
    }


def rows(db: Path, sql: str) -> list[tuple[Any, ...]]:
    conn = sqlite3.connect(db)
    try:
        return conn.execute(sql).fetchall()
    finally:
        conn.close()


async def sweep_remaining(db: Path) -> None:
    """A last owner takes whatever the workers left durable (a wake that found a claim of a
    process that was closing): recovery picks it up; nothing may be stuck."""

    async def drain(ctx: DrainContext) -> None:
        await ctx.take_inputs()

    async with trio_sessions.open_runtime(
        Store(db), drain, lease=10.0, recovery_interval=0.05
    ) as runtime:
        with trio.fail_after(20):
            while rows(db, "SELECT 1 FROM session_input LIMIT 1") or rows(
                db, "SELECT 1 FROM session_execution LIMIT 1"
            ):
                await runtime.recover_once()
                await trio.sleep(0.05)


@pytest.mark.serial
@pytest.mark.slow
def test_four_processes_never_see_a_locked_database(tmp_path: Path) -> None:
    """Four processes contending for one file: every operation and drain succeeds, no lock
    error reaches a caller, and every submitted input is taken exactly once."""
    db = tmp_path / "contention.db"
    go = tmp_path / "go"
    trio.run(_create, db)
    processes = [
        subprocess.Popen(
            [sys.executable, __file__, "worker", str(db), str(index), str(OPERATIONS), str(go)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for index in range(PROCESSES)
    ]
    go.touch()
    reports = []
    for process in processes:
        stdout, stderr = process.communicate(timeout=60)
        assert process.returncode == 0, stderr
        reports.append(json.loads(stdout.strip().splitlines()[-1]))
    trio.run(sweep_remaining, db)

    totals = {
        key: sum(r[key] for r in reports)
        for key in ("begins", "lock_waits", "lock_errors_worker", "lock_errors_loop")
    }
    print(
        f"contention: {PROCESSES} processes x {OPERATIONS} operations; {totals['begins']}"
        f" transactions, {totals['lock_waits']} waited for the write lock (max"
        f" {max(r['max_wait_ms'] for r in reports)} ms), lock errors absorbed:"
        f" {totals['lock_errors_worker']} retried by the worker thread,"
        f" {totals['lock_errors_loop']} event-loop attempts handed to it;"
        f" {sum(r['unresolved_joins'] for r in reports)} run() joins never resolved"
    )
    assert [r["errors"] for r in reports] == [[]] * PROCESSES
    assert [r["unresolved_joins"] for r in reports] == [0] * PROCESSES
    assert all("failed" not in r["outcomes"] for r in reports)
    assert sum(sum(r["outcomes"].values()) for r in reports) > 0
    submitted = sorted(i for r in reports for i in r["submitted"])
    taken = sorted(
        i for (i,) in rows(db, "SELECT input_id FROM session_message WHERE role = 'user'")
    )
    assert taken == submitted
    assert rows(db, "SELECT * FROM session_input") == []
    assert rows(db, "SELECT * FROM session_execution") == []
    assert rows(db, "SELECT id FROM session WHERE time_woken IS NOT NULL") == []
    assert totals["begins"] > PROCESSES * OPERATIONS / 2


async def _create(db: Path) -> None:
    async def drain(ctx: DrainContext) -> None:
        raise AssertionError("nothing to drain yet")  # pragma: no cover

    async with trio_sessions.open_runtime(Store(db), drain):
        pass


if __name__ == "__main__":
    _, _, db_arg, index_arg, operations_arg, go_arg = sys.argv
    while not Path(go_arg).exists():  # start together, so the processes really contend
        time.sleep(0.01)
    report = trio.run(hammer, Path(db_arg), int(index_arg), int(operations_arg))
    print(json.dumps(report))


# ---------------------------------------------------------------------------------------------
# In-process contention on one session (found by the test above)


async def test_run_joining_a_deferred_acquisition_always_returns(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """wake, run and wake racing on a session another owner holds: run() always returns
    (deferred) - a joiner is resolved exactly once (DESIGN §6.15)."""
    path = tmp_path / "db"
    clock = testing.trio_clock()

    async def drain(ctx: DrainContext) -> None:
        raise AssertionError("the session is held by another owner")  # pragma: no cover

    unresolved = 0
    async with trio_sessions.open_runtime(
        testing.inline_store(path), drain, clock=clock
    ) as runtime:
        for attempt in range(100):
            session_id = f"s{attempt}"
            conn = sqlite3.connect(path)
            with conn:  # a live claim of another owner: every acquire here is deferred
                conn.execute("INSERT INTO session(id, time_created) VALUES (?, 0)", (session_id,))
                conn.execute(
                    "INSERT INTO session_execution(id, session_id, owner_id, phase,"
                    " time_created, expires_at) VALUES (?, ?, 'other', 'running', 0, ?)",
                    (f"e{attempt}", session_id, int(clock() * 1000) + 3_600_000),
                )
            conn.close()
            outcomes: list[trio_sessions.Outcome] = []

            async def run(
                session_id: str = session_id, outcomes: list[trio_sessions.Outcome] = outcomes
            ) -> None:
                outcomes.append(await runtime.run(session_id))

            with trio.move_on_after(10) as patience:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(runtime.wake, session_id)
                    nursery.start_soon(run)
                    nursery.start_soon(runtime.wake, session_id)
            if patience.cancelled_caught:
                unresolved += 1
            else:
                assert outcomes == [trio_sessions.Outcome("deferred")]
    assert unresolved == 0


async def test_run_during_a_recovery_pass_is_never_lost(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """run() racing a recovery pass that finishes a cancelled claim: the run still records
    its wake and returns the outcome of the execution that takes it."""
    path = tmp_path / "db"
    clock = testing.trio_clock()
    calls: list[str] = []

    async def drain(ctx: DrainContext) -> None:
        calls.append(ctx.session_id)
        await ctx.take_inputs()

    lost = 0
    async with trio_sessions.open_runtime(
        testing.inline_store(path), drain, clock=clock, recovery_interval=1e6
    ) as runtime:
        for attempt in range(40):
            session_id = f"s{attempt}"
            conn = sqlite3.connect(path)
            with conn:  # a dead owner's expired claim, asked to cancel: recovery finishes it
                conn.execute("INSERT INTO session(id, time_created) VALUES (?, 0)", (session_id,))
                conn.execute(
                    "INSERT INTO session_execution(id, session_id, owner_id, phase,"
                    " time_created, expires_at) VALUES (?, ?, 'dead', 'cancelling', 0, ?)",
                    (f"e{attempt}", session_id, int(clock() * 1000) - 1),
                )
            conn.close()
            outcomes: list[trio_sessions.Outcome] = []
            async with trio.open_nursery() as nursery:

                async def run(
                    session_id: str = session_id,
                    outcomes: list[trio_sessions.Outcome] = outcomes,
                ) -> None:
                    outcomes.append(await runtime.run(session_id))

                async def during_apply(execution_ids: list[str], run: Any = run) -> None:
                    nursery.start_soon(run)

                testing.set_seams(runtime, before_recovery_apply=during_apply)
                await runtime.recover_once()
            testing.set_seams(runtime)
            await runtime.wait_idle(session_id)
            if outcomes != [trio_sessions.Outcome("succeeded")]:
                lost += 1
    assert lost == 0
