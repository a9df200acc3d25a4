"""The demo's summary: every check is computed from the database the scenes left.

Responsibility: `CHECKS`, one pure function per claim the demo makes, `verify` that runs
them on a fresh connection, and `print_summary`. Invariants: a check reads the database
(and the scenes' `Facts`) and never assumes its outcome - on a database where nothing
happened every check fails; a check that cannot even read what it expects fails instead
of crashing the summary; the demo exits 0 only if every check passes.
"""

from __future__ import annotations

import json
import signal
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from .scenes import GHOST_EXECUTION, TAKEOVER_GRACE, Facts


@attrs.frozen
class Check:
    name: str
    passed: bool
    detail: str


def _messages(conn: sqlite3.Connection, session_id: str, role: str) -> list[dict[str, Any]]:
    rows = conn.execute(
        "SELECT execution_id, data, time_created, time_updated FROM session_message"
        " WHERE session_id = ? AND role = ? ORDER BY seq",
        (session_id, role),
    ).fetchall()
    keys = ("execution_id", "data", "time_created", "time_updated")
    return [{**dict(zip(keys, row, strict=True)), "data": json.loads(row[1])} for row in rows]


def _tools(message: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in message["data"]["parts"] if p["type"] == "tool"]


def _clean(message: dict[str, Any]) -> bool:
    """Finished without error, every tool call completed."""
    data = message["data"]
    return (
        data["finished"] is True
        and data["error"] is None
        and all(p["status"] == "completed" for p in _tools(message))
    )


def check_normal_turn(conn: sqlite3.Connection, facts: Facts) -> Check:
    replies = _messages(conn, "chat-1", "assistant")
    tools = [p["status"] for m in replies for p in _tools(m)]
    passed = len(replies) == 1 and _clean(replies[0]) and tools == ["completed"] * 2
    return Check(
        "normal turn: chat-1 answered in one turn, 2 tool calls completed",
        passed,
        f"{len(replies)} assistant message(s), tool calls {tools}",
    )


def check_coalescing(conn: sqlite3.Connection, facts: Facts) -> Check:
    replies = _messages(conn, "chat-2", "assistant")
    inputs = _messages(conn, "chat-2", "user")
    passed = (
        facts.wakes_during_turn == 5
        and len(inputs) == 4
        and len(replies) == 2
        and all(_clean(m) for m in replies)
    )
    return Check(
        "coalescing: 5 wakes during a turn caused exactly 1 more turn (chat-2)",
        passed,
        f"wakes counted {facts.wakes_during_turn}, {len(inputs)} inputs, {len(replies)} turns",
    )


def check_interrupted_call(conn: sqlite3.Connection, facts: Facts) -> Check:
    replies = _messages(conn, "chat-3", "assistant")
    first = replies[0] if replies else None
    passed = (
        facts.interrupt_accepted
        and first is not None
        and first["data"]["finished"] is True
        and first["data"]["error"] == "interrupted"
        and [(p["status"], p["error"]) for p in _tools(first)] == [("error", "interrupted")]
    )
    shown = None if first is None else [(p["status"], p["error"]) for p in _tools(first)]
    return Check(
        "interrupt: chat-3's running tool call failed as 'interrupted', message finished",
        passed,
        f"accepted={facts.interrupt_accepted}, tool calls {shown}",
    )


def check_one_successor(conn: sqlite3.Connection, facts: Facts) -> Check:
    replies = _messages(conn, "chat-3", "assistant")
    inputs = _messages(conn, "chat-3", "user")
    executions = {m["execution_id"] for m in replies}
    pending = conn.execute("SELECT COUNT(*) FROM session_input WHERE session_id = 'chat-3'")
    passed = (
        len(replies) == 2
        and len(executions) == 2
        and _clean(replies[1])
        and len(inputs) == 2
        and inputs[1]["execution_id"] == replies[1]["execution_id"]
        and pending.fetchone()[0] == 0
    )
    return Check(
        "interrupt: exactly one successor turn took the queued input (chat-3)",
        passed,
        f"{len(replies)} turns by {len(executions)} executions, {len(inputs)} inputs taken",
    )


def check_worker_killed(conn: sqlite3.Connection, facts: Facts) -> Check:
    killed = facts.worker_exit == -signal.SIGKILL if hasattr(signal, "SIGKILL") else True
    passed = (
        killed
        and facts.worker_owner is not None
        and facts.worker_claim_owner == facts.worker_owner
        and facts.worker_lease_end_ms is not None
    )
    return Check(
        "crash: the worker process held chat-4's claim when it was SIGKILLed",
        passed,
        f"exit status {facts.worker_exit}, claim owner {facts.worker_claim_owner}",
    )


def check_recovered(conn: sqlite3.Connection, facts: Facts) -> Check:
    replies = _messages(conn, "chat-4", "assistant")
    lost = replies[0] if replies else None
    passed = (
        len(replies) == 2
        and lost is not None
        and lost["data"]["finished"] is True
        and [p["error"] for p in _tools(lost)] == ["interrupted: owner lost"]
        and replies[1]["execution_id"] != lost["execution_id"]
        and _clean(replies[1])
        and facts.takeover_owner == facts.demo_owner
        and facts.takeover_ms is not None
        and facts.worker_lease_end_ms is not None
        and facts.worker_killed_ms is not None
        and facts.worker_killed_ms + TAKEOVER_GRACE * 1000
        <= facts.takeover_ms
        < facts.worker_lease_end_ms
    )
    waited = (
        None
        if facts.takeover_ms is None or facts.worker_killed_ms is None
        else f"{(facts.takeover_ms - facts.worker_killed_ms) / 1000:.2f} s"
    )
    return Check(
        "recovery: another owner resumed chat-4 after the grace, before the lease expired",
        passed,
        f"taken over by {facts.takeover_owner} {waited} after the kill; {len(replies)} messages",
    )


def check_quarantined(conn: sqlite3.Connection, facts: Facts) -> Check:
    rows = conn.execute(
        "SELECT r.recovery_error, e.id FROM session_recovery r"
        " LEFT JOIN session_execution e ON e.id = r.execution_id"
        " WHERE r.execution_id = ? AND r.recovery_error IS NOT NULL",
        (GHOST_EXECUTION,),
    ).fetchall()
    passed = len(rows) == 1 and rows[0][1] == GHOST_EXECUTION
    return Check(
        "quarantine: chat-5's corrupt record is quarantined, its claim kept for an operator",
        passed,
        f"reason: {rows[0][0] if rows else None}",
    )


def check_carried_on(conn: sqlite3.Connection, facts: Facts) -> Check:
    quarantined_at = conn.execute(
        "SELECT time_quarantined FROM session_recovery WHERE execution_id = ?",
        (GHOST_EXECUTION,),
    ).fetchone()
    booking = _messages(conn, "chat-6", "assistant")
    weather = _messages(conn, "chat-7", "assistant")
    at = None if quarantined_at is None else quarantined_at[0]
    passed = (
        at is not None
        and len(booking) == 1
        and len(weather) == 1
        and _clean(booking[0])
        and _clean(weather[0])
        and booking[0]["time_created"] <= at <= booking[0]["time_updated"]
    )
    return Check(
        "carry on: chat-6 (mid-turn across the quarantine) and chat-7 finished normally",
        passed,
        f"{len(booking)} + {len(weather)} clean turns",
    )


def check_nothing_stranded(conn: sqlite3.Connection, facts: Facts) -> Check:
    stranded = conn.execute(
        "SELECT COUNT(DISTINCT i.session_id) FROM session_input i JOIN session s"
        " ON s.id = i.session_id WHERE s.time_woken IS NULL AND NOT EXISTS"
        " (SELECT 1 FROM session_execution e WHERE e.session_id = s.id)"
    ).fetchone()[0]
    claims = [row[0] for row in conn.execute("SELECT id FROM session_execution")]
    passed = stranded == 0 and claims == [GHOST_EXECUTION]
    return Check(
        "no stranded work: no input without a doorbell or claim; only the quarantined claim left",
        passed,
        f"{stranded} session(s) with stranded inputs, claims left {claims}",
    )


CHECKS = (
    check_normal_turn,
    check_coalescing,
    check_interrupted_call,
    check_one_successor,
    check_worker_killed,
    check_recovered,
    check_quarantined,
    check_carried_on,
    check_nothing_stranded,
)


def verify(db: Path, facts: Facts) -> list[Check]:
    conn = sqlite3.connect(db)
    try:
        return [_safely(check, conn, facts) for check in CHECKS]
    finally:
        conn.close()


def _safely(
    check: Callable[[sqlite3.Connection, Facts], Check], conn: sqlite3.Connection, facts: Facts
) -> Check:
    """A check that cannot even read what it expects fails; it does not crash the summary."""
    try:
        return check(conn, facts)
    except (LookupError, TypeError, ValueError, sqlite3.Error) as exc:
        return Check(check.__name__, False, f"could not evaluate: {exc!r}")


def print_summary(checks: list[Check], elapsed: float) -> None:
    print("\n-- Summary: checks computed from the database " + "-" * 32, flush=True)
    for check in checks:
        print(f"  {'PASS' if check.passed else 'FAIL'}  {check.name}")
        print(f"        {check.detail}")
    passed = sum(check.passed for check in checks)
    print(f"\n{passed}/{len(checks)} checks passed in {elapsed:.1f} s.", flush=True)
