"""Recovery and the resumed drains' iteration ends on PostgreSQL, set-wise (DESIGN §8 "One
round trip per operation": the takeover of a batch in one statement, FOR UPDATE ... SKIP
LOCKED; §7: recovery of 10,000 expired claims >= 0.3x raw).

A batch of expired claims is applied by one call (`ts_recover`) under the same rules as the
row path (resume counted or not, live lease skipped, another owner's recovery lease left
alone), a claim row another transaction holds locked is skipped instead of waited for, and
a batch's plain iteration ends are settled without the per-row function (`ts_finish`).
Exact clocks (`fixed`), the engine's own transactions (`run_op`), round trips counted on the
wire by the bench's relay.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from helpers import fixed
from helpers import pg_engine_at as engine_at
from helpers import pg_raw as raw

from trio_sessions import _store
from trio_sessions._bench.roundtrips import counting_url
from trio_sessions._decisions import AcquireVerdict, RecoveryDecision
from trio_sessions._postgres import PgEngine, PgTx, connect, run_op
from trio_sessions._store.recovery_scan import scan_and_lease

LEASE_MS = 30_000
DEAD, ME, OTHER = "dead", "rescuer", "other-rescuer"


def claim(engine: PgEngine, session_id: str, owner: str = DEAD, lease_ms: int = 500) -> str:
    """A claim of `owner` on `session_id` (execution `e-<session>`), its lease `lease_ms`."""
    execution_id = f"e-{session_id}"
    run_op(engine, _store.wake, session_id)
    acquired = run_op(engine, _store.acquire, session_id, execution_id, owner, lease_ms)
    assert acquired.verdict is AcquireVerdict.CLAIM
    return execution_id


def candidates(*session_ids: str) -> list[_store.Candidate]:
    return [_store.Candidate(s, f"e-{s}") for s in session_ids]


def test_a_batch_of_claims_is_recovered_in_one_call(pg_url: str, migrated_schema: str) -> None:
    """Expired claims with no assistant message - counted resumes, a handed-back one, a
    live one, one under another owner's recovery lease - are applied by one function call,
    alone in autocommit (1 round trip, whatever the batch), each by its own rule."""
    with engine_at(pg_url, migrated_schema, 1.0) as owner:
        for session_id in ("a", "b", "c"):
            claim(owner, session_id)
        claim(owner, "back")
        run_op(owner, _store.expire_claims, DEAD, ["e-back"])  # a graceful hand-back
        claim(owner, "live")
        claim(owner, "theirs")
    with raw(pg_url, migrated_schema) as conn:
        conn.execute("UPDATE session SET wake_attempts = 2 WHERE id = 'a'")
    batch = candidates("a", "b", "c", "back", "live", "theirs")
    with engine_at(pg_url, migrated_schema, 2.0) as other:
        # Another owner's pass, with the other sessions held locally, leases 'theirs'.
        local = ["a", "b", "c", "back", "live"]
        _, _, leased, _ = run_op(other, scan_and_lease, OTHER, 10, local, [], LEASE_MS)
        assert leased == batch[5:]
    with counting_url(pg_url) as (url, proxy), engine_at(url, migrated_schema, 2.0) as rescuer:
        _, _, leased, _ = run_op(rescuer, scan_and_lease, ME, 10, [], [], LEASE_MS)
        assert leased == candidates("back", "a", "b", "c", "live")  # oldest expiry first
        with raw(pg_url, migrated_schema) as conn:  # its owner renewed it after our lease
            conn.execute("UPDATE session_execution SET expires_at = 61000 WHERE id = 'e-live'")
        items = [(candidate, f"new-{candidate.session_id}") for candidate in batch]
        before = proxy.round_trips
        results = run_op(rescuer, _store.apply_recovery_batch, ME, items, LEASE_MS, 10)
        assert proxy.round_trips - before == 1
    assert [(r.decision, r.fence_lost, r.new_execution_id, r.attempt) for r in results] == [
        (RecoveryDecision.RESUME, False, "new-a", 3),
        (RecoveryDecision.RESUME, False, "new-b", 1),
        (RecoveryDecision.RESUME, False, "new-c", 1),
        (RecoveryDecision.RESUME, False, "new-back", 0),  # handed back: not counted
        (RecoveryDecision.SKIP_LIVE, False, None, 0),
        (RecoveryDecision.GONE, True, None, 0),  # another owner's recovery lease
    ]
    with raw(pg_url, migrated_schema) as conn:
        claims = conn.execute(
            "SELECT session_id, id, owner_id, phase, expires_at, heartbeat_at, handed_back,"
            " time_created FROM session_execution ORDER BY session_id"
        ).fetchall()
        assert claims == [
            ("a", "new-a", ME, "running", 2000 + LEASE_MS, None, 0, 2000),
            ("b", "new-b", ME, "running", 2000 + LEASE_MS, None, 0, 2000),
            ("back", "new-back", ME, "running", 2000 + LEASE_MS, None, 0, 2000),
            ("c", "new-c", ME, "running", 2000 + LEASE_MS, None, 0, 2000),
            ("live", "e-live", DEAD, "running", 61_000, None, 0, 1000),
            ("theirs", "e-theirs", DEAD, "running", 1500, None, 0, 1000),
        ]
        # The takeover takes the doorbell and counts the resume (not for a hand-back).
        assert conn.execute(
            "SELECT id, wake_attempts, time_woken, wakes FROM session ORDER BY id"
        ).fetchall() == [
            ("a", 3, None, 0),
            ("b", 1, None, 0),
            ("back", 0, None, 0),
            ("c", 1, None, 0),
            ("live", 0, None, 0),
            ("theirs", 0, None, 0),
        ]
        # Ours are deleted; another owner's recovery row is not ours to touch.
        assert conn.execute("SELECT execution_id, owner_id FROM session_recovery").fetchall() == [
            ("e-theirs", OTHER)
        ]


def test_a_batch_mixing_rows_the_set_cannot_decide_applies_each_rule(
    pg_url: str, migrated_schema: str
) -> None:
    """Claims the set-wise call leaves to the row path in the same transaction - a claim
    marked cancelling, an exhausted budget, a paused session - are finished by their rules
    beside a plain resume."""
    with engine_at(pg_url, migrated_schema, 1.0) as owner:
        for session_id in ("plain", "cancelling", "exhausted", "paused"):
            claim(owner, session_id)
        run_op(owner, _store.mark_cancelling, "cancelling", "e-cancelling", DEAD)
        run_op(owner, _store.pause, "paused")
    with raw(pg_url, migrated_schema) as conn:
        conn.execute("UPDATE session SET wake_attempts = 10 WHERE id = 'exhausted'")
    batch = candidates("plain", "cancelling", "exhausted", "paused")
    with engine_at(pg_url, migrated_schema, 2.0) as rescuer:
        _, _, leased, _ = run_op(rescuer, scan_and_lease, ME, 10, [], [], LEASE_MS)
        assert leased == candidates("cancelling", "exhausted", "paused", "plain")
        items = [(candidate, f"new-{candidate.session_id}") for candidate in batch]
        results = run_op(rescuer, _store.apply_recovery_batch, ME, items, LEASE_MS, 10)
    assert [r.decision for r in results] == [
        RecoveryDecision.RESUME,
        RecoveryDecision.FINISH_CANCELLED,
        RecoveryDecision.EXHAUSTED,
        RecoveryDecision.FINISH_PAUSED,
    ]
    with raw(pg_url, migrated_schema) as conn:
        assert conn.execute("SELECT id, owner_id FROM session_execution").fetchall() == [
            ("new-plain", ME)
        ]
        assert conn.execute("SELECT count(*) FROM session_recovery").fetchall() == [(0,)]


def while_a_claim_row_is_locked(
    pg_url: str, pg_schema: str, execution_id: str, call: Callable[[], Any]
) -> Any:
    """`call()`'s result, run in a thread while another transaction holds the claim row
    `execution_id` locked; asserts it finished while the lock was held (DESIGN §8: skipped,
    not waited for - waiting, it could not)."""
    with raw(pg_url, pg_schema) as holder, holder.transaction():
        holder.execute("SELECT id FROM session_execution WHERE id = %s FOR UPDATE", (execution_id,))
        done = threading.Event()
        outcome: list[Any] = []

        def run() -> None:
            try:
                outcome.append(call())
            finally:
                done.set()

        threading.Thread(target=run, daemon=True).start()
        finished_while_locked = done.wait(10)
    done.wait(30)
    assert finished_while_locked, f"it waited for the claim row {execution_id!r} locked"
    [result] = outcome
    return result


def test_takeover_skips_a_claim_row_locked_by_another_transaction(
    pg_url: str, migrated_schema: str
) -> None:
    """DESIGN §8: the takeover skips a claim row another transaction holds locked (a
    heartbeat, another recoverer) instead of waiting for it: that claim is reported as a
    lost fence with nothing written and our recovery lease kept (a later pass looks again);
    the rest of the batch is taken over."""
    with engine_at(pg_url, migrated_schema, 1.0) as owner:
        claim(owner, "busy")
        claim(owner, "free")
    batch = candidates("busy", "free")
    items = [(candidate, f"new-{candidate.session_id}") for candidate in batch]
    with engine_at(pg_url, migrated_schema, 2.0) as rescuer:
        assert run_op(rescuer, scan_and_lease, ME, 10, [], [], LEASE_MS)[2] == batch
        results = while_a_claim_row_is_locked(
            pg_url,
            migrated_schema,
            "e-busy",
            lambda: run_op(rescuer, _store.apply_recovery_batch, ME, items, LEASE_MS, 10),
        )
    assert [(r.decision, r.fence_lost) for r in results] == [
        (RecoveryDecision.GONE, True),
        (RecoveryDecision.RESUME, False),
    ]
    with raw(pg_url, migrated_schema) as conn:
        assert conn.execute(
            "SELECT session_id, id, owner_id FROM session_execution ORDER BY session_id"
        ).fetchall() == [("busy", "e-busy", DEAD), ("free", "new-free", ME)]
        assert conn.execute("SELECT execution_id, owner_id FROM session_recovery").fetchall() == [
            ("e-busy", ME)
        ]


def test_the_scan_skips_a_claim_row_locked_by_another_transaction(
    pg_url: str, migrated_schema: str
) -> None:
    """DESIGN §8, §6.14: a recovery pass's scan skips an expired claim whose row another
    transaction holds locked (a heartbeat, another recoverer's scan) instead of waiting for
    it, and leases the other expired claim. Waiting, the pass - and every session behind it
    - would stall until that transaction ends."""
    with engine_at(pg_url, migrated_schema, 1.0) as owner:
        claim(owner, "busy")
        claim(owner, "free")
    with engine_at(pg_url, migrated_schema, 2.0) as rescuer:
        found, _, leased, _ = while_a_claim_row_is_locked(
            pg_url,
            migrated_schema,
            "e-busy",
            lambda: run_op(rescuer, scan_and_lease, ME, 10, [], [], LEASE_MS),
        )
    assert found == leased == candidates("free")
    with raw(pg_url, migrated_schema) as conn:
        assert conn.execute("SELECT execution_id, owner_id FROM session_recovery").fetchall() == [
            ("e-free", ME)
        ]


def test_a_batch_of_iteration_ends_is_settled_without_the_row_function(
    pg_url: str, migrated_schema: str
) -> None:
    """`ts_finish_iterations` settles a batch's common iteration ends - release, continue,
    pause, lease lost (another owner's claim, or our own whose lease ran out: nothing
    written, §6.13), a message left open - in one statement, each as `ts_finish` answers
    it, and calls `ts_finish` only for what the set leaves to it: a claim marked cancelling
    (hand over) and a session named twice (its ends in order)."""
    with engine_at(pg_url, migrated_schema, 1.0) as engine:
        sessions = ("release", "continue", "paused", "lost", "open", "cancel", "twice", "expired")
        for session_id in sessions:
            claim(engine, session_id, owner=ME, lease_ms=LEASE_MS)
        for session_id in ("continue", "paused", "cancel", "twice", "expired"):
            run_op(engine, _store.wake, session_id)  # a doorbell set during the drain
        run_op(engine, _store.pause, "paused")
        run_op(engine, _store.begin_assistant, "open", "e-open", ME, "m-open")
        run_op(engine, _store.mark_cancelling, "cancel", "e-cancel", ME)
    with raw(pg_url, migrated_schema) as conn:
        conn.execute("UPDATE session SET wake_attempts = 1 WHERE id IN ('release', 'expired')")
        # Its lease ran out before its end landed (the batch's clock reads 2.0 s).
        conn.execute("UPDATE session_execution SET expires_at = 1500 WHERE id = 'e-expired'")
    jobs = [
        ("release", "e-release", ME),
        ("continue", "e-continue", ME),
        ("paused", "e-paused", ME),
        ("lost", "e-lost", OTHER),  # not this owner's claim
        ("open", "e-open", ME),
        ("cancel", "e-cancel", ME),
        ("twice", "e-twice", ME),
        ("twice", "e-twice", ME),
        ("expired", "e-expired", ME),
    ]
    conn = connect(pg_url, migrated_schema)
    try:
        conn.execute("SET track_functions = 'pl'")
        tx = PgTx(conn, fixed(2.0))
        rows = tx.call(
            "ts_finish_iterations", *(list(column) for column in zip(*jobs, strict=True))
        )
        row_calls = conn.execute(
            "SELECT COALESCE(sum(calls), 0) FROM pg_stat_xact_user_functions"
            " WHERE funcname = 'ts_finish'"
        ).fetchone()
        conn.commit()
    finally:
        conn.close()
    assert sorted(rows) == [
        (1, "release", False),
        (2, "continue", False),
        (3, "pause", True),
        (4, "lease_lost", None),
        (5, "open_messages", None),
        (6, "hand_over", True),
        (7, "continue", False),
        (8, "release", False),
        (9, "lease_lost", None),
    ]
    assert row_calls == (3,)  # cancel, twice, twice
    with raw(pg_url, migrated_schema) as check:
        assert check.execute(
            "SELECT session_id FROM session_execution ORDER BY session_id"
        ).fetchall() == [("continue",), ("expired",), ("lost",), ("open",)]
        assert check.execute(
            "SELECT id, time_woken IS NOT NULL, wake_attempts FROM session ORDER BY id"
        ).fetchall() == [
            ("cancel", True, 0),
            ("continue", False, 0),
            ("expired", True, 1),  # untouched: its doorbell and count stay for recovery
            ("lost", False, 0),  # untouched: the acquire took its doorbell
            ("open", False, 0),
            ("paused", True, 0),
            ("release", False, 0),
            ("twice", False, 0),
        ]
