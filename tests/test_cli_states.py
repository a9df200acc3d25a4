"""The operator CLI's session states on both backends: a quarantined claim is quarantined
whatever its lease, in `status`'s filters, its summary and its text."""

from __future__ import annotations

from typing import Any

import pytest
from backends import EngineDb

from trio_sessions import _cli, _store
from trio_sessions._cli_format import format_status
from trio_sessions._store.operator import STATES

LEASE_MS = 600_000
QUARANTINE_ROW = (
    "INSERT INTO session_recovery(execution_id, session_id, owner_id, expires_at,"
    " recovery_error, time_created, time_quarantined) VALUES (?, ?, 'recovery', ?, 'malformed',"
    " ?, ?)"
)


def seed_claim(engine: EngineDb, session_id: str, *, expires_at: int) -> None:
    """A session holding a claim of another owner, its lease ending at `expires_at`."""
    engine.write("INSERT INTO session(id, time_created) VALUES (?, 0)", (session_id,))
    engine.write(
        "INSERT INTO session_execution(id, session_id, owner_id, phase, time_created,"
        " expires_at) VALUES (?, ?, 'owner-gone', 'running', 0, ?)",
        (f"exec-{session_id}", session_id, expires_at),
    )


def quarantine(engine: EngineDb, session_id: str) -> None:
    """Recovery's quarantine of the session's claim (its records do not decode)."""
    now = engine.now
    engine.write(QUARANTINE_ROW, (f"exec-{session_id}", session_id, now + LEASE_MS, now, now))


def status(engine: EngineDb, *flags: str) -> dict[str, Any]:
    """`status DB *flags --json` run on the test's engine (its hand clock)."""
    args = _cli.build_parser().parse_args(["status", "db", *flags, "--json"])
    value, _ = _cli.run_command(args, engine.engine)
    return dict(value)


def ids(listed: dict[str, Any]) -> list[str]:
    return [session["id"] for session in listed["sessions"]]


def test_a_quarantined_claim_whose_lease_is_live_is_quarantined_not_active(
    engine: EngineDb,
) -> None:
    """A liveness takeover quarantines a dead owner's claim long before its lease runs out.
    `status` counted such a claim as live and listed it under `--state active` (the CLI took
    every quarantined claim to be expired, which it no longer is). Found by the reviewers
    of stop 59. A quarantined claim is in state `quarantined` only, whatever its lease: not
    `active` and not `expired`, and the summary counts live, expired and quarantined claims
    apart (they add up to the claims)."""
    seed_claim(engine, "live", expires_at=engine.now + LEASE_MS)
    seed_claim(engine, "expired", expires_at=engine.now - 1)
    seed_claim(engine, "taken", expires_at=engine.now + LEASE_MS)
    quarantine(engine, "taken")
    seed_claim(engine, "poison", expires_at=engine.now - 1)
    quarantine(engine, "poison")
    assert ids(status(engine, "--state", "active")) == ["live"]
    assert ids(status(engine, "--state", "expired")) == ["expired"]
    assert ids(status(engine, "--state", "quarantined")) == ["poison", "taken"]
    summary = status(engine)["summary"]
    assert (summary["claims"], summary["live_claims"], summary["expired_claims"]) == (4, 1, 1)
    assert summary["quarantined"] == 2
    text = format_status(engine.engine.read(_store.status))
    assert text.startswith("4 sessions; claims: 1 live, 1 expired, 2 quarantined;"), text


def listed_in(session: dict[str, Any], state: str) -> bool:
    """Whether a listed session is in `state`, as its row reads (claim, doorbell, pause)."""
    claim = session["claim"]
    held = claim is not None and not claim["quarantined"]
    return bool(
        {
            "idle": claim is None and session["doorbell"] is None,
            "woken": session["doorbell"] is not None,
            "active": held and not claim["expired"],
            "expired": held and claim["expired"],
            "quarantined": claim is not None and claim["quarantined"],
            "paused": session["paused"],
        }[state]
    )


@pytest.mark.sqlite_only("another tool's text or REAL in an INTEGER column: SQLite keeps it")
def test_each_state_lists_the_sessions_whose_rows_read_so(engine: EngineDb) -> None:
    """`status --state` filters in its read (SQL), and the listing says each session's claim,
    doorbell and pause: both agree for every state, also for a lease another tool wrote as
    text (live, as the store treats it) or as a REAL (expired, as recovery reads it)."""
    seed_claim(engine, "live", expires_at=engine.now + LEASE_MS)
    seed_claim(engine, "expired", expires_at=engine.now - 1)
    seed_claim(engine, "taken", expires_at=engine.now + LEASE_MS)
    quarantine(engine, "taken")
    seed_claim(engine, "text-lease", expires_at=engine.now)
    seed_claim(engine, "real-lease", expires_at=engine.now)
    engine.write("UPDATE session_execution SET expires_at = 'soon' WHERE id = 'exec-text-lease'")
    engine.write("UPDATE session_execution SET expires_at = 1000.5 WHERE id = 'exec-real-lease'")
    engine.write(
        "INSERT INTO session(id, time_created, time_woken, wakes) VALUES ('rung', 0, 1, 1)"
    )
    engine.write("INSERT INTO session(id, time_created, time_paused) VALUES ('held', 0, 1)")
    engine.write("UPDATE session SET time_woken = 2, wakes = 1 WHERE id = 'live'")
    every = status(engine)["sessions"]
    for state in STATES:
        expected = [session["id"] for session in every if listed_in(session, state)]
        assert ids(status(engine, "--state", state)) == expected, state
        assert expected, state  # every state has a session in it here
    assert ids(status(engine, "--state", "active")) == ["live", "text-lease"]
    assert ids(status(engine, "--state", "expired")) == ["expired", "real-lease"]
    summary = status(engine)["summary"]
    assert (summary["live_claims"], summary["expired_claims"], summary["quarantined"]) == (2, 2, 1)


@pytest.mark.sqlite_only("another tool's rows of no session: SQLite keeps them, foreign keys off")
def test_the_summary_counts_what_the_listing_of_every_session_shows(engine: EngineDb) -> None:
    """`status`'s summary is aggregates, not a sum over the listing (stop 60): it counted
    another tool's input of a session that is gone among the pending inputs, which no
    session listed holds and no drain ever takes. The summary counts the listing's inputs,
    claims and quarantines: those of sessions that are there."""
    seed_claim(engine, "kept", expires_at=engine.now + LEASE_MS)
    input_row = (
        "INSERT INTO session_input(id, session_id, seq, payload, time_created, due_at)"
        " VALUES (?, ?, 1, '{}', 0, ?)"
    )
    engine.write(input_row, ("in-kept", "kept", None))
    engine.write("INSERT INTO session(id, time_created) VALUES ('later', 0)")
    engine.write(input_row, ("in-later", "later", engine.now + LEASE_MS))  # scheduled
    conn = engine.sqlite_conn
    conn.execute("PRAGMA foreign_keys = OFF")
    try:
        seed_claim(engine, "gone", expires_at=engine.now + LEASE_MS)
        quarantine(engine, "gone")
        engine.write(input_row, ("in-gone", "gone", None))
        engine.write("DELETE FROM session WHERE id = 'gone'")
    finally:
        conn.execute("PRAGMA foreign_keys = ON")
    listed = status(engine)
    sessions, summary = listed["sessions"], listed["summary"]
    assert ids(listed) == ["kept", "later"]
    claims = [session["claim"] for session in sessions if session["claim"] is not None]
    assert summary["pending_inputs"] == sum(s["pending_inputs"] for s in sessions) == 2
    assert summary["claims"] == len(claims) == 1
    assert summary["quarantined"] == sum(c["quarantined"] for c in claims) == 0
    assert summary["sessions"] == len(sessions)
