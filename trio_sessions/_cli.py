"""The operator CLI, `python -m trio_sessions`: look at a database and act on quarantine.

Commands:
* `status DB [--session S] [--state STATE] [--limit N]` - every session (or those matching
  the filters) with its claim (owner, phase, lease remaining or expired since, heartbeat
  age), its pending doorbell and inputs;
* `quarantine list DB` - executions that recovery set aside because a record is malformed;
* `quarantine release DB EXECUTION_ID --resume|--drop` - the operator's decision;
* `inputs list DB [--session S]` - inputs set aside because their payload does not decode
  (they never block the inputs behind them);
* `inputs drop DB INPUT_ID` - delete one of them;
* `health DB` - exit 0 when the database opens and its schema is current (for probes);
* `worker MODULE:DRAIN --store ...` - run a drain as a long-lived worker (`_worker`).
Every listing takes `--json` (one JSON document on stdout).

Invariants: a database is never created or migrated by accident - every command opens it
with `_sqlite.connect(path, create=False)`, which refuses a missing file, a file that is not
SQLite and an SQLite file that is not ours. Listings only read (one read snapshot, no write
lock); `quarantine release` and `inputs drop` are the only commands that write, and they
write through the store's own operations, in one transaction each. The `worker` command is
the exception: it runs a runtime, which creates and migrates its store as `open_runtime`
always does.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from . import _backend, _sqlite, _store, _worker
from ._errors import StoreError
from ._runtime import make_owner_id

T = TypeVar("T")

EXIT_OK = 0
EXIT_FAILED = 1  # the database was refused or the command could not be carried out


# ---------------------------------------------------------------------------------------------
# Reading


def now_ms() -> int:
    return _backend.now_ms(time.time)


def read_snapshot(conn: sqlite3.Connection, read: Callable[[_sqlite.SQLiteTx], T]) -> T:
    """Run `read` inside one deferred read transaction: a consistent snapshot, no lock."""
    conn.execute("BEGIN")
    try:
        return read(_sqlite.SQLiteTx(conn, now_ms()))
    finally:
        conn.execute("COMMIT")


_STATUS_SQL = """
SELECT s.id, s.time_created, s.time_woken, s.wakes, s.wake_attempts,
       (SELECT COUNT(*) FROM session_input i WHERE i.session_id = s.id),
       (SELECT COUNT(*) FROM session_message m WHERE m.session_id = s.id),
       e.id, e.owner_id, e.phase, e.time_created, e.heartbeat_at, e.expires_at,
       r.owner_id, r.expires_at, r.recovery_error
FROM session s
LEFT JOIN session_execution e ON e.session_id = s.id
LEFT JOIN session_recovery r ON r.execution_id = e.id
ORDER BY s.id
"""


def read_status(tx: _sqlite.SQLiteTx) -> dict[str, Any]:
    """Every session with its doorbell, pending inputs and claim, as plain JSON values."""
    sessions = [_session(tx.now, row) for row in tx.execute(_STATUS_SQL).fetchall()]
    claims = [s["claim"] for s in sessions if s["claim"] is not None]
    return {
        "now": tx.now,
        "summary": {
            "sessions": len(sessions),
            "claims": len(claims),
            "live_claims": sum(not c["expired"] for c in claims),
            "expired_claims": sum(c["expired"] for c in claims),
            "quarantined": sum(c["quarantined"] for c in claims),
            "doorbells": sum(s["doorbell"] is not None for s in sessions),
            "pending_inputs": sum(s["pending_inputs"] for s in sessions),
        },
        "matched": len(sessions),
        "sessions": sessions,
    }


# A session can be in several states at once: a live claim with a doorbell set is both
# `active` and `woken`; a quarantined claim is also `expired` (as in the summary's counts).
STATES = ("idle", "woken", "active", "expired", "quarantined")


def in_state(session: dict[str, Any], state: str) -> bool:
    """Whether a session of `read_status` is in `state` (one of `STATES`)."""
    claim = session["claim"]
    if state == "idle":
        return claim is None and session["doorbell"] is None
    if state == "woken":
        return session["doorbell"] is not None
    if claim is None:
        return False
    if state == "active":
        return not claim["expired"]
    if state == "expired":
        return bool(claim["expired"])
    return bool(claim["quarantined"])


def filter_status(
    status: dict[str, Any],
    *,
    session_ids: Sequence[str] = (),
    state: str | None = None,
    limit: int | None = None,
) -> dict[str, Any]:
    """`status` with only the matching sessions, at most `limit` of them in id order.

    The summary still counts the whole database; `matched` counts the sessions that match
    the filters before `limit`.
    """
    sessions = [
        s
        for s in status["sessions"]
        if (not session_ids or s["id"] in session_ids) and (state is None or in_state(s, state))
    ]
    return {**status, "matched": len(sessions), "sessions": sessions[:limit]}


def _session(now: int, row: Sequence[Any]) -> dict[str, Any]:
    (session_id, created, woken, wakes, attempts, inputs, messages, *claim) = row
    doorbell = None
    if woken is not None:
        doorbell = {"time_woken": woken, "wakes": wakes, "age_s": _seconds(now - woken)}
    return {
        "id": session_id,
        "time_created": created,
        "doorbell": doorbell,
        "pending_inputs": inputs,
        "messages": messages,
        "wake_attempts": attempts,
        "claim": _claim(now, claim) if claim[0] is not None else None,
    }


def _claim(now: int, row: Sequence[Any]) -> dict[str, Any]:
    (execution_id, owner, phase, created, heartbeat, expires, rec_owner, rec_expires, error) = row
    recovery = None
    if rec_owner is not None:
        recovery = {"owner_id": rec_owner, "expires_at": rec_expires, "recovery_error": error}
    return {
        "execution_id": execution_id,
        "owner_id": owner,
        "phase": phase,
        "time_created": created,
        "expires_at": expires,
        "expired": expires <= now,
        "lease_remaining_s": _seconds(max(0, expires - now)),
        "expired_since_s": _seconds(max(0, now - expires)),
        "heartbeat_at": heartbeat,
        "heartbeat_age_s": None if heartbeat is None else _seconds(now - heartbeat),
        "quarantined": error is not None,
        "recovery": recovery,
    }


def read_quarantine(tx: _sqlite.SQLiteTx) -> list[dict[str, Any]]:
    """Quarantined executions, oldest first, with the claim they hold back."""
    rows = _store.quarantined(tx)
    for row in rows:
        claim = tx.one(
            "SELECT owner_id, phase, expires_at FROM session_execution WHERE id = ?",
            (row["execution_id"],),
        )
        row["claim_owner_id"], row["claim_phase"] = (None, None) if claim is None else claim[:2]
        row["quarantined_for_s"] = _seconds(tx.now - (row["time_quarantined"] or tx.now))
    return rows


# The schema version that added `session_input_rejected`: an older file has none.
REJECTED_INPUTS_SINCE = 3


def read_rejected_inputs(conn: sqlite3.Connection, session_id: str | None) -> list[Any]:
    """Inputs set aside as malformed, oldest first (of one session, if given)."""
    if _sqlite.schema_version(conn) < REJECTED_INPUTS_SINCE:
        return []
    return read_snapshot(conn, lambda tx: _store.rejected_inputs(tx, session_id))


def _seconds(ms: int) -> float:
    return round(ms / 1000, 3)


def check_health(db: str) -> dict[str, Any]:
    """Open `db` as the listings do (never creating or migrating it) and read from it: `ok`
    when it is ours, its schema is the one this library writes, and its tables answer."""
    expected = _sqlite.SCHEMA_VERSION
    health: dict[str, Any] = {
        "ok": False,
        "db": db,
        "schema_version": None,
        "expected_schema_version": expected,
        "reason": None,
    }
    try:
        conn = _sqlite.connect(db, create=False)
    except StoreError as exc:
        return {**health, "reason": str(exc) if db in str(exc) else f"{db}: {exc}"}
    try:
        version = _sqlite.schema_version(conn)
        health["schema_version"] = version
        if version != expected:
            reason = (
                f"{db}: schema version {version} is not the current {expected}; opening it"
                " with a runtime of this library migrates it"
            )
            return {**health, "reason": reason}
        read_snapshot(conn, lambda tx: tx.execute("SELECT COUNT(*) FROM session").fetchone())
    except sqlite3.Error as exc:
        return {**health, "reason": f"{db}: cannot read: {exc}"}
    finally:
        conn.close()
    return {**health, "ok": True}


# ---------------------------------------------------------------------------------------------
# Writing


def release(conn: sqlite3.Connection, execution_id: str, *, resume: bool) -> dict[str, Any]:
    """Act on one quarantined execution; `ValueError` unless it is quarantined.

    `--drop` runs the store's drop: the open transcript is finished as owner-lost (a row
    that does not decode is left as it is), the claim deleted, the resume budget reset and
    the doorbell re-armed if inputs remain. `--resume` clears the quarantine and ends our
    recovery lease at once: the next recovery pass of any runtime on this file examines the
    execution under the normal rules - resumed if its records now decode, quarantined again
    if they still do not. The CLI runs no drains, so it cannot resume the work itself.
    """
    if resume:
        candidate = _sqlite.run_op(
            conn, time.time, _store.lift_quarantine, execution_id, make_owner_id("cli"), 0
        )
        session_id = candidate.session_id
    else:
        session_id = _session_of_quarantined(conn, execution_id)
        _sqlite.run_op(conn, time.time, _store.drop_quarantined, execution_id)
    return {
        "execution_id": execution_id,
        "session_id": session_id,
        "action": "resume" if resume else "drop",
    }


def drop_input(conn: sqlite3.Connection, input_id: str) -> dict[str, Any]:
    """Delete one set-aside input; `ValueError` unless it is one."""
    if _sqlite.schema_version(conn) < REJECTED_INPUTS_SINCE:
        raise ValueError(f"input {input_id!r} is not a rejected input")
    session_id = _sqlite.run_op(conn, time.time, _store.drop_rejected_input, input_id)
    return {"input_id": input_id, "session_id": session_id, "action": "drop"}


def _session_of_quarantined(conn: sqlite3.Connection, execution_id: str) -> str:
    for row in read_snapshot(conn, _store.quarantined):
        if row["execution_id"] == execution_id:
            return str(row["session_id"])
    raise ValueError(f"execution {execution_id!r} is not quarantined")


# ---------------------------------------------------------------------------------------------
# Text output


def _table(header: Sequence[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows, strict=True)]
    return [
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        for line in (header, *rows)
    ]


def format_status(status: dict[str, Any]) -> str:
    s = status["summary"]
    lines = [
        f"{s['sessions']} sessions; claims: {s['live_claims']} live, {s['expired_claims']}"
        f" expired ({s['quarantined']} quarantined); doorbells set: {s['doorbells']};"
        f" pending inputs: {s['pending_inputs']}"
    ]
    shown = len(status["sessions"])
    if shown != s["sessions"]:
        lines.append(f"showing {shown} of {status['matched']} matching sessions")
    if not shown:
        return "\n".join(lines)
    header = ["SESSION", "DOORBELL", "INPUTS", "OWNER", "PHASE", "LEASE", "HEARTBEAT", "NOTE"]
    rows = [_status_row(session) for session in status["sessions"]]
    return "\n".join([*lines, "", *_table(header, rows)])


def _status_row(session: dict[str, Any]) -> list[str]:
    bell = session["doorbell"]
    doorbell = "-" if bell is None else f"set {bell['age_s']:.1f}s ago ({bell['wakes']} wakes)"
    claim = session["claim"]
    if claim is None:
        return [session["id"], doorbell, str(session["pending_inputs"]), "-", "idle", "", "", ""]
    if claim["expired"]:
        lease = f"expired {claim['expired_since_s']:.1f}s ago"
    else:
        lease = f"{claim['lease_remaining_s']:.1f}s left"
    age = claim["heartbeat_age_s"]
    heartbeat = "never" if age is None else f"{age:.1f}s ago"
    note = "QUARANTINED" if claim["quarantined"] else ""
    if session["wake_attempts"]:
        note = f"{note} resumes={session['wake_attempts']}".strip()
    return [
        *(session["id"], doorbell, str(session["pending_inputs"])),
        *(claim["owner_id"], claim["phase"], lease, heartbeat, note),
    ]


def format_quarantine(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "no quarantined executions"
    lines = [f"{len(rows)} quarantined execution(s):"]
    for row in rows:
        lines += [
            "",
            f"execution {row['execution_id']}  session {row['session_id']}",
            f"  claim owner: {row['claim_owner_id']} ({row['claim_phase']})",
            f"  quarantined {row['quarantined_for_s']:.1f}s ago by {row['recovery_owner']}",
            *(f"  - {reason}" for reason in str(row["recovery_error"]).split("; ")),
        ]
    lines += ["", "act with: quarantine release DB EXECUTION_ID --resume|--drop"]
    return "\n".join(lines)


def format_rejected_inputs(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "no rejected inputs"
    lines = [f"{len(rows)} rejected input(s):"]
    for row in rows:
        lines += [
            "",
            f"input {row['id']}  session {row['session_id']}  seq {row['seq']}",
            f"  payload: {_shorten(row['payload'])}",
            f"  - {row['reason']}",
        ]
    lines += ["", "delete one with: inputs drop DB INPUT_ID"]
    return "\n".join(lines)


def _shorten(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def format_input_drop(result: dict[str, Any]) -> str:
    return f"dropped rejected input {result['input_id']} of session {result['session_id']}"


def format_health(health: dict[str, Any]) -> str:
    if health["ok"]:
        return f"ok: {health['db']} (schema version {health['schema_version']})"
    return f"unhealthy: {health['reason']}"


def format_release(result: dict[str, Any]) -> str:
    execution, session = result["execution_id"], result["session_id"]
    if result["action"] == "drop":
        return (
            f"dropped execution {execution} of session {session}: its open messages are"
            " finished as owner-lost (a row that does not decode is left as it is), the claim"
            " deleted, and the doorbell re-armed if inputs remain."
        )
    return (
        f"lifted the quarantine on execution {execution} of session {session}: the next"
        " recovery pass of a runtime on this database examines it under the normal rules"
        " (resumed if its records decode now, quarantined again if they still do not)."
    )


# ---------------------------------------------------------------------------------------------
# Commands


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("db", metavar="DB", help="path of an existing trio_sessions database")
    common.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser = argparse.ArgumentParser(
        prog="python -m trio_sessions",
        description="Inspect a trio_sessions database and act on quarantined executions, or "
        "run a worker. Listings only read; a missing file or a database that is not ours is "
        "refused.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    status = commands.add_parser(
        "status", parents=[common], help="sessions, claims, leases, doorbells and inputs"
    )
    status.add_argument(
        "--session",
        action="append",
        default=[],
        metavar="S",
        help="only this session (repeatable)",
    )
    status.add_argument(
        "--state",
        choices=STATES,
        help="only sessions in this state: idle (no claim, no doorbell), woken (doorbell"
        " set), active (live claim), expired (expired claim), quarantined",
    )
    status.add_argument(
        "--limit", type=_positive_int, metavar="N", help="at most N sessions, in id order"
    )
    quarantine = commands.add_parser("quarantine", help="list or release quarantined executions")
    actions = quarantine.add_subparsers(dest="action", required=True, metavar="ACTION")
    actions.add_parser("list", parents=[common], help="quarantined executions and why")
    release_cmd = actions.add_parser(
        "release", parents=[common], help="resume or drop a quarantined execution (writes)"
    )
    release_cmd.add_argument("execution_id", metavar="EXECUTION_ID")
    choice = release_cmd.add_mutually_exclusive_group(required=True)
    choice.add_argument(
        "--resume", action="store_true", help="clear it; the next recovery pass examines it"
    )
    choice.add_argument(
        "--drop", action="store_true", help="finish it as owner-lost and delete its claim"
    )
    inputs = commands.add_parser("inputs", help="list or drop inputs set aside as malformed")
    input_actions = inputs.add_subparsers(dest="inputs_action", required=True, metavar="ACTION")
    list_inputs = input_actions.add_parser(
        "list", parents=[common], help="inputs whose payload does not decode, and why"
    )
    list_inputs.add_argument("--session", metavar="S", help="only this session's")
    drop_cmd = input_actions.add_parser(
        "drop", parents=[common], help="delete one rejected input (writes)"
    )
    drop_cmd.add_argument("input_id", metavar="INPUT_ID")
    commands.add_parser(
        "health",
        parents=[common],
        help="exit 0 when the database opens and its schema is current (for probes)",
    )
    _worker.add_parser(commands)
    return parser


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected at least 1, got {value}")
    return value


def run_command(args: argparse.Namespace, conn: sqlite3.Connection) -> tuple[Any, str]:
    """Carry out the parsed command; returns (JSON value, text)."""
    if args.command == "status":
        status = read_snapshot(conn, read_status)
        status = filter_status(status, session_ids=args.session, state=args.state, limit=args.limit)
        return status, format_status(status)
    if args.command == "inputs":
        if args.inputs_action == "list":
            rows = read_rejected_inputs(conn, args.session)
            return rows, format_rejected_inputs(rows)
        dropped = drop_input(conn, args.input_id)
        return dropped, format_input_drop(dropped)
    if args.action == "list":
        rows = read_snapshot(conn, read_quarantine)
        return rows, format_quarantine(rows)
    result = release(conn, args.execution_id, resume=args.resume)
    return result, format_release(result)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns the exit status (0 done, 1 refused or failed, 2 usage)."""
    args = build_parser().parse_args(argv)
    if args.command == "worker":
        return _worker.run(args)
    if args.command == "health":
        health = check_health(args.db)
        if args.json:
            _print(json.dumps(health, indent=2))
        elif health["ok"]:
            _print(format_health(health))
        else:
            print(format_health(health), file=sys.stderr)
        return EXIT_OK if health["ok"] else EXIT_FAILED
    try:
        conn = _sqlite.connect(args.db, create=False)
    except StoreError as exc:
        return _fail(args.db, exc)
    try:
        value, text = run_command(args, conn)
    except (StoreError, ValueError) as exc:
        return _fail(args.db, exc)
    finally:
        conn.close()
    _print(json.dumps(value, indent=2) if args.json else text)
    return EXIT_OK


def _print(text: str) -> None:
    try:
        print(text, flush=True)
    except BrokenPipeError:
        # `... | head`: the reader left. Point stdout at devnull so the interpreter's own
        # flush at exit does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _fail(db: str, exc: Exception) -> int:
    message = str(exc) if db in str(exc) else f"{db}: {exc}"
    print(f"error: {message}", file=sys.stderr)
    return EXIT_FAILED
