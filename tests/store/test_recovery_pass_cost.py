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

from trio_sessions import DrainContext, Store, _codec, _store, _transcript
from trio_sessions._decisions import RecoveryDecision
from trio_sessions._store.recovery_batch import _take_over_plain
from trio_sessions._store.recovery_scan import scan_and_lease

from .common import LEASE, ME, NOW, Db, expired_claim, lease, put_recovery


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
    the same four statements for 10 claims as for 100 (the expired claims leased in the
    statement that finds them, then those whose expiry is no time - the pass has room left -,
    doorbells, the next due input), and a lease on each claim found, oldest expiry first."""
    for index in range(n):
        expired_claim(db, f"s{index:03}", NOW - 1000 - index)
    (candidates, free, leased, due), seen = statements(db, scan_and_lease, ME, n + 1, [], [], LEASE)
    assert len(candidates) == n and leased == candidates and free == set() and due is None
    assert [c.session_id for c in candidates] == [f"s{i:03}" for i in reversed(range(n))]
    assert len(seen) == 4, seen
    assert f"e.expires_at > {2**63 - 1}" in seen[1], seen
    assert db.rows("SELECT COUNT(*) FROM session_recovery WHERE owner_id = ?", (ME,)) == [(n,)]


@pytest.mark.sqlite_only
def test_scan_and_lease_keeps_the_lease_rules(db: Db) -> None:
    """In one transaction, the leases keep the recovery lease rules: none on a row another
    owner holds live (excluded from the scan) or on a quarantined one; an expired lease of
    another owner, or one of ours, is taken."""
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


def test_scan_and_lease_takes_a_gone_owners_recovery_lease_over(db: Db) -> None:
    """The live recovery lease of an owner found gone (it died, or closed, between its scan
    and its takeover) is no live one: the scan finds its claim and the upsert takes the
    lease over, not a whole lease later. Another owner's live lease, and a quarantine
    whatever its owner, still keep their claims out."""
    for name in ("gone", "theirs", "poison"):
        expired_claim(db, name, NOW - 1000)
    put_recovery(db, "exec-gone", "gone-recoverer", NOW + 5000)
    put_recovery(db, "exec-theirs", "other", NOW + 5000)
    put_recovery(db, "exec-poison", "gone-recoverer", NOW + 5000, "malformed")
    candidates, _, leased, _ = db.run(scan_and_lease, ME, 10, [], ["gone-recoverer"], LEASE)
    assert [c.session_id for c in candidates] == ["gone"]
    assert leased == candidates
    assert db.rows(
        "SELECT execution_id, owner_id, expires_at FROM session_recovery ORDER BY execution_id"
    ) == [
        ("exec-gone", ME, NOW + LEASE),
        ("exec-poison", "gone-recoverer", NOW + 5000),
        ("exec-theirs", "other", NOW + 5000),
    ]


@pytest.mark.sqlite_only
@pytest.mark.parametrize("n", [10, 100])
def test_a_batch_takes_plain_claims_over_with_one_prepared_statement(db: Db, n: int) -> None:
    """SQLite: `n` leased expired claims with no assistant message are taken over by one
    prepared takeover statement run once per claim, and a fixed number of other statements
    per batch - no SELECT at all (the resume conditions are in the takeover's WHERE)."""
    for index in range(n):
        expired_claim(db, f"s{index:03}", NOW - 1000 - index)
    candidates, _, leased, _ = db.run(scan_and_lease, ME, n, [], [], LEASE)
    assert leased == candidates and len(candidates) == n
    items = [(candidate, f"new-{candidate.session_id}") for candidate in candidates]
    results, seen = statements(db, _store.apply_recovery_batch, ME, items, LEASE, 10, [])
    assert [(r.decision, r.new_execution_id, r.attempt) for r in results] == [
        (RecoveryDecision.RESUME, new, 1) for _, new in items
    ]
    takeovers = [sql for sql in seen if sql.startswith("UPDATE session_execution SET id")]
    others = [sql for sql in seen if not sql.startswith("UPDATE session_execution SET id")]
    assert len(takeovers) == n
    assert not [sql for sql in seen if sql.lstrip().upper().startswith("SELECT")], seen
    assert len(others) == 2, others  # the resumes counted, our recovery leases deleted


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
    lease(db, *candidates)
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


@pytest.mark.sqlite_only
def test_a_batch_takeover_reports_exactly_the_claims_it_replaced(db: Db) -> None:
    """SQLite: the batch takeover (one prepared statement run per claim) returns the
    positions whose takeover matched - not the whole batch when one claim's lease is live
    again or its claim vanished - and replaces, counts and lets go of only those."""
    for name in ("a", "b", "live", "c"):
        expired_claim(db, name, NOW - 1000)
    candidates = [_store.Candidate(name, f"exec-{name}") for name in ("a", "b", "live", "c")]
    lease(db, *candidates)
    expired_claim(db, "vanished", NOW - 1000)  # not leased: a claim gone before its lease
    db.write("UPDATE session_execution SET expires_at = ? WHERE id = 'exec-live'", (NOW + 5000,))
    db.write("DELETE FROM session_execution WHERE id = 'exec-vanished'")
    items = [(candidate, f"new-{candidate.session_id}") for candidate in candidates]
    items.append((_store.Candidate("vanished", "exec-vanished"), "new-vanished"))
    assert db.run(_take_over_plain, ME, items, LEASE, 10, frozenset()) == {0: 1, 1: 1, 3: 1}
    assert db.rows("SELECT id, owner_id FROM session_execution ORDER BY id") == [
        ("exec-live", "dead"),
        ("new-a", ME),
        ("new-b", ME),
        ("new-c", ME),
    ]
    assert db.rows("SELECT id, wake_attempts FROM session ORDER BY id") == [
        ("a", 1),
        ("b", 1),
        ("c", 1),
        ("live", 0),
        ("vanished", 0),
    ]
    assert db.rows("SELECT execution_id FROM session_recovery") == [("exec-live",)]


def test_plain_claims_the_takeover_refuses_get_their_own_decision(db: Db) -> None:
    """Claims with no assistant message that must not resume - paused, budget spent,
    cancelling, superseded, another owner's recovery lease - are refused by the batch
    takeover and decided row by row, each with its own outcome, in the same batch as a
    plain resume; a handed-back claim with its budget spent resumes uncounted."""
    names = ("plain", "paused", "spent", "back", "cancelling", "superseded", "theirs")
    for name in names:
        if name == "back":
            db.claim("back", owner="dead", execution="exec-back")
            assert db.run(_store.expire_claims, "dead", ["exec-back"]) == 1  # handed back
        else:
            expired_claim(db, name, NOW - 1000)
    db.write("UPDATE session SET wake_attempts = 3 WHERE id IN ('spent', 'back')")
    db.write("UPDATE session SET time_paused = ? WHERE id = 'paused'", (NOW - 10,))
    db.write("UPDATE session_execution SET phase = 'cancelling' WHERE id = 'exec-cancelling'")
    db.write(
        "INSERT INTO session_message(id, session_id, execution_id, role, seq, data,"
        " time_created, time_updated) VALUES ('m-other', 'superseded', 'exec-other',"
        " 'assistant', 1, ?, 0, 0)",
        (_codec.encode_assistant(_transcript.EMPTY),),
    )
    candidates = [_store.Candidate(name, f"exec-{name}") for name in names]
    lease(db, *candidates)
    db.write("UPDATE session_recovery SET owner_id = 'other' WHERE execution_id = 'exec-theirs'")
    items = [(candidate, f"new-{candidate.session_id}") for candidate in candidates]
    results = db.run(_store.apply_recovery_batch, ME, items, LEASE, 3, [])
    outcomes = {
        name: (r.decision, r.fence_lost, r.new_execution_id, r.attempt)
        for name, r in zip(names, results, strict=True)
    }
    assert outcomes == {
        "plain": (RecoveryDecision.RESUME, False, "new-plain", 1),
        "paused": (RecoveryDecision.FINISH_PAUSED, False, None, 0),
        "spent": (RecoveryDecision.EXHAUSTED, False, None, 0),
        "back": (RecoveryDecision.RESUME, False, "new-back", 3),
        "cancelling": (RecoveryDecision.FINISH_CANCELLED, False, None, 0),
        "superseded": (RecoveryDecision.DROP_SUPERSEDED, False, None, 0),
        "theirs": (RecoveryDecision.GONE, True, None, 0),
    }
    assert db.rows(
        "SELECT session_id, id, owner_id, handed_back FROM session_execution ORDER BY session_id"
    ) == [
        ("back", "new-back", ME, 0),
        ("plain", "new-plain", ME, 0),
        ("theirs", "exec-theirs", "dead", 0),
    ]
    assert db.rows("SELECT id, wake_attempts FROM session ORDER BY id") == [
        ("back", 3),
        ("cancelling", 0),
        ("paused", 0),
        ("plain", 1),
        ("spent", 0),
        ("superseded", 0),
        ("theirs", 0),
    ]
    assert db.rows("SELECT execution_id, owner_id FROM session_recovery") == [
        ("exec-theirs", "other")
    ]


def test_a_claim_named_twice_in_a_batch_is_taken_over_once(db: Db) -> None:
    """A candidate twice in one batch: the first is taken over and counted once; the second
    finds its claim replaced (gone, its fence lost) and writes nothing."""
    expired_claim(db, "s", NOW - 1000)
    candidate = _store.Candidate("s", "exec-s")
    lease(db, candidate)
    items = [(candidate, "new-1"), (candidate, "new-2")]
    results = db.run(_store.apply_recovery_batch, ME, items, LEASE, 10, [])
    assert [(r.decision, r.fence_lost, r.new_execution_id, r.attempt) for r in results] == [
        (RecoveryDecision.RESUME, False, "new-1", 1),
        (RecoveryDecision.GONE, True, None, 0),
    ]
    assert db.rows("SELECT id, owner_id FROM session_execution") == [("new-1", ME)]
    assert db.rows("SELECT wake_attempts FROM session") == [(1,)]
    assert db.rows("SELECT * FROM session_recovery") == []
