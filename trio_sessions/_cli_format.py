"""The operator CLI's text output (`_cli`): each listing and each command's result as the
lines a terminal shows; `--json` prints the same data as one JSON document instead.

Invariants: nothing here reads or writes a database - every function formats what a command
already read; a rejected input's payload is cut to 200 characters (its length said), so one
huge record never floods the terminal; every stored text (ids, reasons, payloads: another
tool may write any) goes through `_shown`, so no character of it acts on the terminal.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Sequence
from typing import Any

from ._store import malformed_columns


def _shown(value: Any) -> Any:
    """A stored text as a terminal may print it: one that is not printable (a newline that
    would split a row, a NUL, an ANSI escape) escaped as `repr` shows it, without its
    quotes; any other value as it is."""
    if not isinstance(value, str) or value.isprintable():
        return value
    return repr(value)[1:-1]


def _cells(text: str) -> int:
    """How many terminal cells `text` takes: two for a wide character (CJK, most emoji),
    none for a combining mark, one for any other - so ids in any script line up."""
    return sum(
        0 if unicodedata.combining(c) else 2 if unicodedata.east_asian_width(c) in "WF" else 1
        for c in text
    )


def _table(header: Sequence[str], rows: list[list[str]]) -> list[str]:
    lines = [[(cell, _cells(cell)) for cell in line] for line in (header, *rows)]
    widths = [max(cells for _, cells in column) for column in zip(*lines, strict=True)]
    return [
        "  ".join(
            cell + " " * (width - cells) for (cell, cells), width in zip(line, widths, strict=True)
        ).rstrip()
        for line in lines
    ]


def format_status(status: dict[str, Any]) -> str:
    s = status["summary"]
    lines = [
        f"{s['sessions']} sessions; claims: {s['live_claims']} live, {s['expired_claims']}"
        f" expired, {s['quarantined']} quarantined; doorbells set: {s['doorbells']};"
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
    wakes = "?" if bell is None or bell["wakes"] is None else bell["wakes"]
    doorbell = "-" if bell is None else f"set {_ago(bell['age_s'])} ({wakes} wakes)"
    claim = session["claim"]
    if claim is None:
        inputs = str(session["pending_inputs"])
        return [_shown(session["id"]), doorbell, inputs, "-", "idle", "", "", _note(session)]
    if claim["expired"]:
        lease = f"expired {_ago(claim['expired_since_s'])}"
    elif claim["lease_remaining_s"] is None:
        lease = "?"
    else:
        lease = f"{claim['lease_remaining_s']:.1f}s left"
    age = claim["heartbeat_age_s"]
    unreadable = "session_execution.heartbeat_at" in malformed_columns(session)
    heartbeat = "never" if age is None and not unreadable else _ago(age)
    return [
        *(_shown(session["id"]), doorbell, str(session["pending_inputs"])),
        *(_shown(claim["owner_id"]), _shown(claim["phase"]), lease, heartbeat, _note(session)),
    ]


def _note(session: dict[str, Any]) -> str:
    """What else an operator must know of a session: quarantined, paused (its doorbell may
    be set, yet no drain starts), inputs scheduled for later (pending with no doorbell, yet
    not stranded: their due time rings it), resumes spent, what in its rows is malformed."""
    claim = session["claim"]
    notes = [
        "QUARANTINED" if claim is not None and claim["quarantined"] else "",
        "paused" if session["paused"] else "",
        f"{session['scheduled_inputs']} scheduled" if session["scheduled_inputs"] else "",
        f"resumes={session['wake_attempts']}" if session["wake_attempts"] else "",
        "MALFORMED: " + "; ".join(session["malformed"]) if session["malformed"] else "",
    ]
    return " ".join(note for note in notes if note)


def _ago(seconds: float | None) -> str:
    # None: the row's time is no number (`_store.status` says why, in `malformed`).
    if seconds is None:
        return "?"
    # Negative: stamped by a clock ahead of the one read here (a runtime's `clock=`, a host
    # clock stepped back) - "-5.0s ago" would read as a typo.
    return f"{seconds:.1f}s ago" if seconds >= 0 else f"{-seconds:.1f}s ahead"


def _count(rows: list[Any], matched: int, what: str) -> str:
    """A listing's first line: how many rows match, and how many of them `--limit` shows."""
    shown = "" if len(rows) == matched else f"showing {len(rows)} of "
    return f"{shown}{matched} {what}:"


def format_quarantine(rows: list[dict[str, Any]], matched: int) -> str:
    """`rows`: the first of the `matched` quarantined executions (all, without --limit)."""
    if not rows:
        return "no quarantined executions"
    lines = [_count(rows, matched, "quarantined execution(s)")]
    for row in rows:
        claim = f"  claim owner: {_shown(row['claim_owner_id'])} ({_shown(row['claim_phase'])})"
        if row["claim_owner_id"] is None and row["claim_phase"] is None:
            # Another tool deleted the claim row; Python's None would read as an owner's name.
            claim = "  claim: none (the claim row is gone)"
        lines += [
            "",
            f"execution {_shown(row['execution_id'])}  session {_shown(row['session_id'])}",
            claim,
            f"  quarantined {_ago(row['quarantined_for_s'])} by {_shown(row['recovery_owner'])}",
            *(f"  MALFORMED: {problem}" for problem in row["malformed"]),
            *(f"  - {_shown(reason)}" for reason in str(row["recovery_error"]).split("; ")),
        ]
    lines += ["", "act with: quarantine release DB EXECUTION_ID --resume|--drop"]
    return "\n".join(lines)


def format_rejected_inputs(rows: list[dict[str, Any]], matched: int) -> str:
    """`rows`: the first of the `matched` rejected inputs (all, without --limit)."""
    if not rows:
        return "no rejected inputs"
    lines = [_count(rows, matched, "rejected input(s)")]
    for row in rows:
        lines += [
            "",
            f"input {_shown(row['id'])}  session {_shown(row['session_id'])}  seq {row['seq']}",
            f"  payload: {_shown(_shorten(row['payload']))}",
            f"  - {_shown(row['reason'])}",
            *(f"  MALFORMED: {problem}" for problem in row["malformed"]),
        ]
    lines += ["", "delete one with: inputs drop DB INPUT_ID"]
    return "\n".join(lines)


def _shorten(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def format_input_drop(result: dict[str, Any]) -> str:
    input_id, session_id = result["input_id"], _shown(result["session_id"])
    return f"dropped rejected input {input_id} of session {session_id}"


def format_control(result: dict[str, Any]) -> str:
    action = result["action"]
    if action == "purge":
        return f"purged {result['purged']} sessions idle for {result['idle_for_s']:g} s"
    if action == "cancel":
        return f"cancelled input {result['input_id']}"
    if action == "resume":
        started = "pending work rang its doorbell" if result["rung"] else "no doorbell rung"
        return f"resumed {result['session_id']} ({started})"
    if action == "pause" and result["created"]:
        return (
            f"paused {result['session_id']} (no such session existed: created it, paused;"
            " `delete` removes it)"
        )
    return f"{'paused' if action == 'pause' else 'deleted'} {result['session_id']}"


def format_health(health: dict[str, Any]) -> str:
    if health["ok"]:
        return f"ok: {health['db']} (schema version {health['schema_version']})"
    return f"unhealthy: {health['reason']}"


def format_release(result: dict[str, Any]) -> str:
    execution, session = result["execution_id"], _shown(result["session_id"])
    if result["action"] == "drop":
        return (
            f"dropped execution {execution} of session {session}: its messages that do not"
            " decode are set aside in session_message_rejected (raw text kept), its other"
            " open messages finished as owner-lost, the claim deleted, and the doorbell"
            " re-armed if inputs remain."
        )
    return (
        f"lifted the quarantine on execution {execution} of session {session}: the next"
        " recovery pass of a runtime on this database examines it under the normal rules"
        " (resumed if its records decode now, quarantined again if they still do not)."
    )
