"""What a recovery pass costs on SQLite, in statements and transactions: the scan and the
recovery leases share one transaction and a fixed number of statements whatever the batch
(DESIGN §7, recovery >= 0.5x raw); and a batch that mixes outcomes applies each claim's
own rules."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
from helpers import Raw, now_ms, runtime
from trio.testing import MockClock

from trio_sessions import DrainContext, Store, _store
from trio_sessions._decisions import RecoveryDecision
from trio_sessions._store.recovery_batch import _replace_claims
from trio_sessions._store.recovery_scan import scan_and_lease

from .common import LEASE, ME, NOW, Db, expired_claim, put_recovery


@contextmanager
def counted(conn: sqlite3.Connection) -> Iterator[list[str]]:
    """Every statement `conn` runs meanwhile, transaction control and pragmas left out (the
    sync engine asks for the database's file name, which the runtime's executor knows)."""
    seen: list[str] = []

    def trace(sql: str) -> None:
        if sql.split(None, 1)[0].upper() not in {"BEGIN", "COMMIT", "ROLLBACK", "PRAGMA"}:
            seen.append(sql)

    conn.set_trace_callback(trace)
    try:
        yield seen
    finally:
        conn.set_trace_callback(None)


def statements(db: Db, op: Callable[..., Any], *args: Any) -> tuple[Any, list[str]]:
    with counted(db.conn) as seen:
        result = db.run(op, *args)
    return result, seen


@pytest.mark.sqlite_only
@pytest.mark.parametrize("n", [10, 100])
def test_scan_and_lease_costs_statements_per_pass_not_per_claim(db: Db, n: int) -> None:
    """SQLite: the scan of `n` expired claims and their recovery leases, in one transaction:
    the same four statements for 10 claims as for 100 (expired claims, doorbells, the
    leases' upsert, the next due input), and a lease on each claim found."""
    for index in range(n):
        expired_claim(db, f"s{index:03}", NOW - 1000 - index)
    (candidates, free, leased, due), seen = statements(db, scan_and_lease, ME, n + 1, [], [], LEASE)
    assert len(candidates) == n and leased == candidates and free == set() and due is None
    assert len(seen) == 4, seen
    assert db.rows("SELECT COUNT(*) FROM session_recovery WHERE owner_id = ?", (ME,)) == [(n,)]


@pytest.mark.sqlite_only
def test_scan_and_lease_keeps_the_lease_rules(db: Db) -> None:
    """In one transaction, the leases keep `take_recovery_leases`' rules: none on a row
    another owner holds live (excluded from the scan) or on a quarantined one; an expired
    lease of another owner, or one of ours, is taken."""
    for name in ("free", "theirs", "stale", "ours", "poison"):
        expired_claim(db, name, NOW - 1000)
    put_recovery(db, "exec-theirs", "other", NOW + 5000)
    put_recovery(db, "exec-stale", "other", NOW - 1)
    put_recovery(db, "exec-ours", ME, NOW + 5000)
    put_recovery(db, "exec-poison", ME, NOW - 1, "malformed")
    candidates, _, leased, _ = db.run(scan_and_lease, ME, 10, [], [], LEASE)
    assert sorted(c.session_id for c in candidates) == ["free", "ours", "stale"]
    assert leased == candidates
    assert db.rows(
        "SELECT execution_id, owner_id, expires_at FROM session_recovery ORDER BY execution_id"
    ) == [
        ("exec-free", ME, NOW + LEASE),
        ("exec-ours", ME, NOW + LEASE),
        ("exec-poison", ME, NOW - 1),
        ("exec-stale", ME, NOW + LEASE),
        ("exec-theirs", "other", NOW + 5000),
    ]


def test_a_batch_applies_each_claims_own_outcome(db: Db) -> None:
    """One batch with a plain resume, a handed-back claim (resumes uncounted), a claim whose
    lease went live again (skipped, untouched), a claim that vanished (gone) and one whose
    recovery lease another owner took (fence lost): each gets its own outcome, and only the
    resumed ones are replaced."""
    for name in ("plain", "live", "vanished", "stolen"):
        expired_claim(db, name, NOW - 1000)
    db.claim("back", owner="dead", execution="exec-back")
    assert db.run(_store.expire_claims, "dead", ["exec-back"]) == 1  # a graceful hand-back
    db.write("UPDATE session SET wake_attempts = 2")
    candidates = [
        _store.Candidate(name, f"exec-{name}")
        for name in ("plain", "back", "live", "vanished", "stolen")
    ]
    assert db.run(_store.take_recovery_leases, ME, LEASE, candidates) == candidates
    db.write("UPDATE session_execution SET expires_at = ? WHERE id = 'exec-live'", (NOW + 5000,))
    db.write("DELETE FROM session_execution WHERE id = 'exec-vanished'")
    db.write("UPDATE session_recovery SET owner_id = 'other' WHERE execution_id = 'exec-stolen'")
    items = [(candidate, f"new-{candidate.session_id}") for candidate in candidates]
    results = db.run(_store.apply_recovery_batch, ME, items, LEASE, 10, [])
    outcomes = [(r.decision, r.fence_lost, r.new_execution_id, r.attempt) for r in results]
    assert outcomes == [
        (RecoveryDecision.RESUME, False, "new-plain", 3),
        (RecoveryDecision.RESUME, False, "new-back", 2),
        (RecoveryDecision.SKIP_LIVE, False, None, 0),
        (RecoveryDecision.GONE, False, None, 0),
        (RecoveryDecision.GONE, True, None, 0),
    ]
    assert db.rows(
        "SELECT session_id, id, owner_id, expires_at FROM session_execution ORDER BY session_id"
    ) == [
        ("back", "new-back", ME, NOW + LEASE),
        ("live", "exec-live", "dead", NOW + 5000),
        ("plain", "new-plain", ME, NOW + LEASE),
        ("stolen", "exec-stolen", "dead", NOW - 1000),
    ]
    assert db.rows("SELECT id, wake_attempts FROM session ORDER BY id") == [
        ("back", 2),
        ("live", 2),
        ("plain", 3),
        ("stolen", 2),
        ("vanished", 2),
    ]
    # Ours are gone whatever the outcome; the other owner's lease is left alone.
    assert db.rows("SELECT execution_id, owner_id FROM session_recovery") == [
        ("exec-stolen", "other")
    ]


@pytest.mark.sqlite_only
async def test_a_recovery_pass_writes_in_two_transactions(
    store: Store, clock: Callable[[], float], db_path: Path, autojump_clock: MockClock
) -> None:
    """SQLite: a runtime's recovery pass over expired claims writes in two transactions -
    the scan with its recovery leases, then the takeover - and resumes every claim."""
    gate = trio.Event()

    async def drain(ctx: DrainContext) -> None:
        await gate.wait()  # no release lands inside the counted pass

    raw = Raw(db_path)
    async with runtime(store, drain, clock, recovery_interval=10_000.0) as rt:
        for index in range(5):
            raw.seed_claim(f"s{index}", f"dead-{index}", expires_at=now_ms(clock) - 1)
        before = rt._db.statistics().transactions
        report = await rt.recover_once()
        written = rt._db.statistics().transactions - before
        gate.set()
        for index in range(5):
            await rt.wait_idle(f"s{index}")
    assert (report.examined, report.resumed) == (5, 5)
    assert written == 2
    assert raw.rows("SELECT * FROM session_execution") == []


def test_a_batch_takeover_reports_exactly_the_claims_it_replaced(db: Db) -> None:
    """The batch takeover (one statement for the batch on SQLite) returns the old ids whose
    recovery fence matched - not the whole batch when one claim's lease is live again or
    its claim vanished - and replaces only those."""
    for name in ("a", "b", "live", "c"):
        expired_claim(db, name, NOW - 1000)
    db.write("UPDATE session_execution SET expires_at = ? WHERE id = 'exec-live'", (NOW + 5000,))
    claims = [(f"exec-{name}", f"new-{name}", None, None) for name in ("a", "b", "live", "c")]
    claims.append(("exec-vanished", "new-vanished", None, None))
    replaced = db.run(_replace_claims, claims, ME, LEASE)
    assert replaced == {"exec-a", "exec-b", "exec-c"}
    assert db.rows("SELECT id, owner_id FROM session_execution ORDER BY id") == [
        ("exec-live", "dead"),
        ("new-a", ME),
        ("new-b", ME),
        ("new-c", ME),
    ]
    everything = [(f"new-{name}", f"newer-{name}", None, None) for name in ("a", "b")]
    db.write("UPDATE session_execution SET expires_at = ?", (NOW - 1,))
    assert db.run(_replace_claims, everything, ME, LEASE) == {"new-a", "new-b"}
