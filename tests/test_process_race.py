"""Invariant 1 across processes: two OS processes, each with its own connection, race
`_store.acquire` on one SQLite file for many rounds; each round exactly one wins and the
lock contention never surfaces as "database is locked".
"""

from __future__ import annotations

import contextlib
import multiprocessing
import time
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Barrier
from pathlib import Path

import pytest

from trio_sessions import _sqlite, _store

ROUNDS = 200
LEASE_MS = 30_000
BUDGET_S = 30.0  # the whole test, process start-up included
STEP_TIMEOUT_S = 10.0


def contender(path: str, owner_id: str, parent: Connection, barrier: Barrier) -> None:
    """Child process: for each session id received, meet the rival at the barrier, then try
    to acquire it; report the verdict or the error text."""
    conn = _sqlite.connect(path)
    try:
        parent.send(("ready", owner_id))
        while (session_id := parent.recv()) is not None:
            barrier.wait(timeout=STEP_TIMEOUT_S)
            try:
                acquired = _sqlite.run_op(
                    conn, time.time, _store.acquire, session_id, _store.new_id(), owner_id, LEASE_MS
                )
            except Exception as exc:  # reported to the parent, which fails the test
                parent.send(("error", f"{type(exc).__name__}: {exc}"))
            else:
                parent.send(("ok", acquired.verdict.value))
    finally:
        conn.close()


def receive(pipe: Connection) -> tuple[str, str]:
    assert pipe.poll(STEP_TIMEOUT_S), "a contender stopped answering"
    message: tuple[str, str] = pipe.recv()
    return message


@pytest.mark.slow
def test_two_processes_racing_acquire_have_one_winner_per_round(tmp_path: Path) -> None:
    """200 rounds of two processes acquiring a freshly woken session: exactly one claim per
    round, the claim row names the winner, and no "database is locked" error ever escapes."""
    started = time.monotonic()
    path = tmp_path / "race.db"
    conn = _sqlite.connect(path)
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(2)
    owners = ("owner-a", "owner-b")
    pipes: list[Connection] = []
    processes = []
    try:
        for owner in owners:
            mine, theirs = context.Pipe()
            process = context.Process(
                target=contender, args=(str(path), owner, theirs, barrier), daemon=True
            )
            process.start()
            theirs.close()
            pipes.append(mine)
            processes.append(process)
        assert [receive(pipe) for pipe in pipes] == [("ready", owner) for owner in owners]

        winners: dict[str, int] = dict.fromkeys(owners, 0)
        errors: list[str] = []
        for round_no in range(ROUNDS):
            session_id = f"race-{round_no}"
            _sqlite.run_op(conn, time.time, _store.wake, session_id)
            for pipe in pipes:
                pipe.send(session_id)
            answers = [receive(pipe) for pipe in pipes]
            errors += [text for kind, text in answers if kind == "error"]
            verdicts = [text for kind, text in answers if kind == "ok"]
            assert sorted(verdicts) == ["claim", "held"], (round_no, answers)
            winner = owners[verdicts.index("claim")]
            winners[winner] += 1
            rows = conn.execute(
                "SELECT owner_id FROM session_execution WHERE session_id = ?", (session_id,)
            ).fetchall()
            assert rows == [(winner,)]
            assert time.monotonic() - started < BUDGET_S, f"too slow: {round_no} rounds"

        assert errors == []
        assert sum(winners.values()) == ROUNDS
        assert conn.execute("SELECT COUNT(*) FROM session_execution").fetchone() == (ROUNDS,)
        assert conn.execute(
            "SELECT COUNT(*) FROM session WHERE time_woken IS NOT NULL"
        ).fetchone() == (0,)
    finally:
        for pipe in pipes:
            with contextlib.suppress(OSError):  # a contender that already died
                pipe.send(None)
        for process in processes:
            process.join(timeout=STEP_TIMEOUT_S)
            if process.is_alive():
                process.kill()
                process.join()
        conn.close()
    assert [process.exitcode for process in processes] == [0, 0]
