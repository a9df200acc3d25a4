"""Recovery's store operations: the candidate scan (order, limit, exclusions), recovery
leases, and each decision applied (skip live, gone, finish cancelled, drop superseded,
quarantine and its fence, exhausted, resume and its takeover fence, handed back). On both
backends, through the sync engine."""

from __future__ import annotations

from typing import Any

import pytest
from backends import finish_iteration

from trio_sessions import (
    LeaseLost,
    _codec,
    _store,
    _transcript,
)
from trio_sessions._decisions import RecoveryDecision
from trio_sessions._model import BUDGET_EXHAUSTED, INTERRUPTED, OWNER_LOST
from trio_sessions._store import recovery_batch
from trio_sessions._store.recovery_scan import scan_and_lease

from .common import (
    LEASE,
    ME,
    NOW,
    Db,
    busy_claim,
    expired_claim,
    lease,
    names,
    put_recovery,
    recover,
    tools,
    woken_at,
)


def ordering_fixture(db: Db) -> None:
    expired_claim(db, "late", NOW - 1000)
    expired_claim(db, "early", NOW - 5000)
    expired_claim(db, "mid", NOW - 3000)
    db.run(_store.wake, "mid")  # an expired claim with a doorbell is listed once, as expired
    expired_claim(db, "exact", NOW)  # expires_at == now: expired
    db.claim("live", owner="alive", execution="exec-live")
    woken_at(db, "bell-new", NOW - 100)
    woken_at(db, "bell-old", NOW - 9000)
    woken_at(db, "bell-mid", NOW - 2000)


def scan(db: Db, limit: int, local: list[str] | None = None) -> list[_store.Candidate]:
    """The candidates of a recovery pass of ours now (`scan_and_lease`, the runtime's scan)."""
    found: list[_store.Candidate] = db.run(scan_and_lease, ME, limit, local or [], [], LEASE)[0]
    return found


def test_recovery_candidates_ordering(db: Db) -> None:
    """Expired claims oldest expiry first, then unclaimed doorbells oldest wake first; live
    claims are never candidates."""
    ordering_fixture(db)
    assert names(scan(db, 100)) == [
        ("early", "exec-early"),
        ("mid", "exec-mid"),
        ("late", "exec-late"),
        ("exact", "exec-exact"),
        ("bell-old", None),
        ("bell-mid", None),
        ("bell-new", None),
    ]


@pytest.mark.parametrize(
    ("limit", "count_expired", "count_bells"), [(1, 1, 0), (4, 4, 0), (5, 4, 1), (6, 4, 2)]
)
def test_recovery_candidates_share_one_limit(
    db: Db, limit: int, count_expired: int, count_bells: int
) -> None:
    """Expired claims and doorbells share one budget, expired claims first."""
    ordering_fixture(db)
    found = scan(db, limit)
    assert len(found) == limit
    assert sum(c.execution_id is not None for c in found) == count_expired
    assert sum(c.execution_id is None for c in found) == count_bells
    assert names(found) == names(scan(db, 100))[:limit]  # our own leases hide nothing


def test_recovery_candidates_exclusions_do_not_use_the_budget(db: Db) -> None:
    """Quarantined executions, another owner's live recovery lease and local sessions are
    excluded in SQL, so the budget reaches the valid rows behind them."""
    for i, session in enumerate(["quarantined", "leased", "local", "valid"]):
        expired_claim(db, session, NOW - 10_000 + i)
    put_recovery(db, "exec-quarantined", ME, NOW + LEASE, error="bad row")
    put_recovery(db, "exec-leased", "other-recoverer", NOW + 1)
    woken_at(db, "local-bell", NOW - 50_000)
    woken_at(db, "bell", NOW - 40_000)
    local = ["local", "local-bell"]
    assert names(scan(db, 1, local)) == [("valid", "exec-valid")]
    assert names(scan(db, 100, local)) == [
        ("valid", "exec-valid"),
        ("bell", None),
    ]


def test_recovery_candidates_include_own_and_expired_recovery_leases(db: Db) -> None:
    """An own live recovery lease, or another owner's expired one, does not hide a claim."""
    expired_claim(db, "mine", NOW - 2000)
    expired_claim(db, "stale", NOW - 1000)
    put_recovery(db, "exec-mine", ME, NOW + LEASE)
    put_recovery(db, "exec-stale", "other-recoverer", NOW)
    assert names(scan(db, 10)) == [
        ("mine", "exec-mine"),
        ("stale", "exec-stale"),
    ]


def test_a_stale_candidate_gets_no_recovery_lease(db: Db) -> None:
    """A claim another recoverer took over gets no recovery lease from our pass: a lease row
    with no claim behind it is never scanned again, so if its recoverer then died it would
    stay forever (found by the PostgreSQL soak, when the scan and the leases were two
    transactions; `scan_and_lease` leases only claims its own transaction reads)."""
    execution = busy_claim(db)
    db.expire()
    candidate = _store.Candidate("s", execution)
    assert lease(db, candidate, owner="other") == [candidate]
    db.run(_store.apply_recovery, "other", candidate, "exec-new", LEASE, 10)
    assert db.rows("SELECT * FROM session_recovery") == []
    assert db.run(scan_and_lease, ME, 10, [], [], LEASE)[2] == []
    assert db.rows("SELECT * FROM session_recovery") == []


def test_recovery_scan_writes_nothing_but_its_leases(db: Db) -> None:
    """The candidate scan writes nothing but the recovery leases on the expired claims it
    found."""
    ordering_fixture(db)
    before = db.snapshot()
    del before["session_recovery"]
    leased = db.run(scan_and_lease, ME, 100, [], [], LEASE)[2]
    assert sorted(
        db.rows("SELECT execution_id, owner_id, expires_at FROM session_recovery")
    ) == sorted((c.execution_id, ME, NOW + LEASE) for c in leased)
    assert len(leased) == 4  # the expired claims of `ordering_fixture`
    after = db.snapshot()
    del after["session_recovery"]
    assert after == before


def recovery_rows(db: Db) -> list[tuple[Any, ...]]:
    return db.rows(
        "SELECT execution_id, owner_id, expires_at, recovery_error FROM session_recovery"
        " ORDER BY execution_id"
    )


def test_recovery_lease_rules(db: Db) -> None:
    """A pass's leases (`scan_and_lease`): taken when absent, own or expired; refused when
    another owner's is live or when quarantined (the scan leaves those claims out); refused
    rows are unchanged and only taken candidates are returned."""
    for session in ("absent", "own", "foreign-live", "foreign-expired", "quarantined"):
        expired_claim(db, session, NOW - 1)
    put_recovery(db, "exec-own", ME, NOW + 5)
    put_recovery(db, "exec-foreign-live", "other", NOW + 1)
    put_recovery(db, "exec-foreign-expired", "other", NOW)
    put_recovery(db, "exec-quarantined", ME, NOW + LEASE, error="bad")
    candidates, _, taken, _ = db.run(scan_and_lease, ME, 100, [], [], LEASE)
    assert taken == candidates
    assert sorted(c.session_id for c in taken) == ["absent", "foreign-expired", "own"]
    assert recovery_rows(db) == [
        ("exec-absent", ME, NOW + LEASE, None),
        ("exec-foreign-expired", ME, NOW + LEASE, None),
        ("exec-foreign-live", "other", NOW + 1, None),
        ("exec-own", ME, NOW + LEASE, None),
        ("exec-quarantined", ME, NOW + LEASE, "bad"),
    ]


def test_recovery_skips_a_live_lease(db: Db) -> None:
    """Invariant 5: a claim whose lease is live is never recovered; only the recovery row goes."""
    execution = busy_claim(db)
    before = db.snapshot()
    live_at = db.now
    db.expire()
    lease(db, _store.Candidate("s", execution))  # a pass whose clock runs ahead (skew)
    db.now = live_at
    recovered = recover(db, execution, take=False)
    assert (recovered.decision, recovered.fence_lost) == (RecoveryDecision.SKIP_LIVE, False)
    assert db.snapshot() == before


def test_recovery_of_a_vanished_claim_is_gone(db: Db) -> None:
    """A claim that finished after the lease was taken is left alone (GONE)."""
    execution = db.claim()
    db.expire()
    candidate = _store.Candidate("s", execution)
    lease(db, candidate)
    db.write("DELETE FROM session_execution")
    recovered = db.run(_store.apply_recovery, ME, candidate, "exec-new", LEASE, 10)
    assert recovered.decision is RecoveryDecision.GONE
    assert recovery_rows(db) == []


def test_recovery_finishes_a_cancelling_claim(db: Db) -> None:
    """Invariant 5: an expired cancellation claim is finished as cancelled, never resumed;
    running tools fail 'interrupted' and the doorbell is re-armed for the pending input."""
    execution = busy_claim(db)
    db.run(finish_iteration, "s", execution, "owner-a")  # doorbell taken
    db.run(_store.mark_cancelling, "s", execution, "owner-a")
    db.expire()
    recovered = recover(db, execution)
    assert recovered.decision is RecoveryDecision.FINISH_CANCELLED
    assert recovered.new_execution_id is None
    assert db.claim_row() is None
    message = db.message("m-1")
    assert message.finished
    assert message.error == INTERRUPTED
    assert tools(message) == {"running": ("error", INTERRUPTED), "done": ("completed", None)}
    assert db.doorbell()[0] == db.now
    assert recovery_rows(db) == []


def test_recovery_drops_a_superseded_execution(db: Db) -> None:
    """Invariant 5: an assistant message of another execution after the anchor means the claim
    is dropped, never resumed; the doorbell is re-armed for the pending input."""
    execution = busy_claim(db)
    db.run(finish_iteration, "s", execution, "owner-a")  # doorbell taken
    db.put_message("m-later", "exec-successor", 10, _codec.encode_assistant(_transcript.EMPTY))
    db.expire()
    recovered = recover(db, execution)
    assert recovered.decision is RecoveryDecision.DROP_SUPERSEDED
    assert db.claim_row() is None
    message = db.message("m-1")
    assert message.finished
    assert _transcript.unsettled_calls(message) == []
    assert db.message("m-later") == _transcript.EMPTY
    assert db.doorbell()[0] == db.now
    assert recovery_rows(db) == []


def test_null_anchor_is_superseded_by_any_other_assistant_message(db: Db) -> None:
    """With anchor_seq NULL, any assistant message of another execution supersedes."""
    execution = db.claim()
    db.put_message("m-other", "exec-successor", 1, _codec.encode_assistant(_transcript.EMPTY))
    db.expire()
    assert recover(db, execution).decision is RecoveryDecision.DROP_SUPERSEDED


def test_older_or_user_messages_do_not_supersede(db: Db) -> None:
    """Messages at or before the anchor, and user messages, never supersede: the claim resumes."""
    db.run(_store.wake, "s")
    db.put_message("m-old", "exec-0", 1, _codec.encode_assistant(_transcript.EMPTY))
    execution = db.claim()
    db.put_message("m-user", "exec-successor", 2, '{"n": 1}', role="user")
    db.expire()
    assert recover(db, execution).decision is RecoveryDecision.RESUME


def test_recovery_quarantines_a_malformed_newest_message(db: Db) -> None:
    """A newest assistant message that does not decode quarantines the execution: the reason is
    stored, the claim and message are untouched and the scan skips it from then on."""
    execution = busy_claim(db)
    db.write("UPDATE session_message SET data = '{\"parts\": 1}' WHERE id = 'm-1'")
    db.expire()
    before = db.snapshot()
    recovered = recover(db, execution)
    assert (recovered.decision, recovered.fence_lost) == (RecoveryDecision.QUARANTINE, False)
    [(owner, error, quarantined_at)] = db.rows(
        "SELECT owner_id, recovery_error, time_quarantined FROM session_recovery"
    )
    assert owner == ME
    assert quarantined_at == db.now
    assert "m-1" in error
    assert "parts" in error
    after = db.snapshot()
    assert {k: v for k, v in after.items() if k != "session_recovery"} == {
        k: v for k, v in before.items() if k != "session_recovery"
    }
    candidates, _, leased, _ = db.run(scan_and_lease, ME, 100, [], [], LEASE)
    assert (candidates, leased) == ([], [])
    assert db.run(_store.quarantined)[0]["execution_id"] == execution


def test_quarantine_loses_its_fence_to_another_recovery_owner(db: Db) -> None:
    """Invariant 10: when another owner holds the recovery lease, quarantining writes zero rows,
    reports fence_lost and touches nothing."""
    execution = busy_claim(db)
    db.write("UPDATE session_message SET data = 'not json' WHERE id = 'm-1'")
    db.expire()
    put_recovery(db, execution, "other-recoverer", db.now + LEASE, session_id="s")
    before = db.snapshot()
    recovered = recover(db, execution, take=False)
    assert recovered.fence_lost
    assert recovered.decision in (RecoveryDecision.QUARANTINE, RecoveryDecision.GONE)
    assert db.snapshot() == before


# (recovery owner, recovery lease expiry, recovery_error, candidate session) at now = NOW
QUARANTINE_FENCE = {
    "exact": (ME, NOW + 1, None, "s"),
    "other_owner": ("other-recoverer", NOW + LEASE, None, "s"),
    "recovery_lease_expired": (ME, NOW, None, "s"),
    "already_quarantined": (ME, NOW + LEASE, "earlier reason", "s"),
    "other_session": (ME, NOW + LEASE, None, "not-s"),
}


@pytest.mark.parametrize("how", sorted(QUARANTINE_FENCE))
def test_quarantine_fence_is_exact(db: Db, how: str) -> None:
    """Invariant 10: the quarantine UPDATE is fenced on execution, session, recovery owner,
    live recovery lease and not-yet-quarantined; only the exact match writes the reason, any
    mismatch writes zero rows and reports fence_lost."""
    owner, expires_at, error, session_id = QUARANTINE_FENCE[how]
    execution = db.claim()
    db.run(_store.begin_assistant, "s", execution, "owner-a", "m-1")
    db.write("UPDATE session_message SET data = '[]' WHERE id = 'm-1'")
    db.write("UPDATE session_execution SET expires_at = ?", (NOW - 1,))
    put_recovery(db, execution, owner, expires_at, error, session_id="s")
    before = db.snapshot()
    reason = "malformed session_message row 'm-1'"
    recovered = db.run(_store.quarantine, ME, _store.Candidate(session_id, execution), reason)
    assert recovered.decision is RecoveryDecision.QUARANTINE
    if how == "exact":
        assert not recovered.fence_lost
        [(recovery_error, quarantined_at)] = db.rows(
            "SELECT recovery_error, time_quarantined FROM session_recovery"
        )
        assert recovery_error == reason
        assert quarantined_at == NOW
    else:
        assert recovered.fence_lost
        assert db.snapshot() == before


def test_recovery_exhausted_budget_fails_without_rearming(db: Db) -> None:
    """wake_attempts >= max_resumes finishes as failed ('resume budget exhausted'), resets the
    attempts and does not re-arm the doorbell for the pending input."""
    execution = busy_claim(db)
    db.write("UPDATE session SET time_woken = NULL, wakes = 0")  # taken mid-drain
    db.write("UPDATE session SET wake_attempts = 3")
    db.expire()
    recovered = recover(db, execution, max_resumes=3)
    assert recovered.decision is RecoveryDecision.EXHAUSTED
    assert db.claim_row() is None
    message = db.message("m-1")
    assert message.finished
    assert message.error == BUDGET_EXHAUSTED
    assert tools(message) == {"running": ("error", BUDGET_EXHAUSTED), "done": ("completed", None)}
    assert db.doorbell() == (None, 0, 0)
    assert db.rows("SELECT id FROM session_input") == [("in-pending",)]
    assert recovery_rows(db) == []


def test_recovery_resume_replaces_the_claim(db: Db) -> None:
    """Resume replaces the expired claim with a fresh one of the recovery owner (anchor at the
    newest seq), counts wake_attempts+1, fails unsettled tools 'interrupted: owner lost'."""
    execution = busy_claim(db)
    db.write("UPDATE session SET wake_attempts = 1")
    db.expire()
    db.now += 5000
    recovered = recover(db, execution)
    assert recovered.decision is RecoveryDecision.RESUME
    assert (recovered.new_execution_id, recovered.attempt) == ("exec-new", 2)
    assert db.claim_row() == ("exec-new", ME, "running", 2, db.now, None, db.now + LEASE)
    assert db.doorbell() == (None, 0, 2)
    message = db.message("m-1")
    assert message.finished
    assert message.error == OWNER_LOST
    assert tools(message) == {"running": ("error", OWNER_LOST), "done": ("completed", None)}
    assert db.rows("SELECT id FROM session_input") == [("in-pending",)]
    assert recovery_rows(db) == []
    assert db.run(_store.take_inputs, "s", "exec-new", ME)[0].id == "in-pending"


def test_takeover_is_fenced_on_the_old_claim_still_expired(db: Db) -> None:
    """The takeover UPDATE refuses a claim that is live (LeaseLost) and writes nothing, even
    the message it would have closed."""
    execution = busy_claim(db)
    facts, _ = db.run(_store._recovery_facts, _store.Candidate("s", execution))
    before = db.snapshot()
    with pytest.raises(LeaseLost):
        db.run(_store._take_over, ME, _store.Candidate("s", execution), "exec-new", LEASE, facts)
    assert db.snapshot() == before


def test_handed_back_claim_resumes_without_counting(db: Db) -> None:
    """A claim handed back by a graceful shutdown is resumed even with the resume budget used
    up, and does not count wake_attempts; the new claim is not marked handed back."""
    execution = busy_claim(db)
    db.write("UPDATE session SET wake_attempts = 3")
    assert db.run(_store.expire_claims, "owner-a", [execution]) == 1
    assert db.rows("SELECT handed_back FROM session_execution") == [(1,)]
    recovered = recover(db, execution, max_resumes=3)
    assert recovered.decision is RecoveryDecision.RESUME
    assert recovered.attempt == 3
    assert db.doorbell()[2] == 3
    assert db.rows("SELECT id, handed_back FROM session_execution") == [("exec-new", 0)]


def test_recovery_quarantines_a_row_that_cannot_be_rewritten(db: Db) -> None:
    """A message whose JSON cannot be written back is treated as malformed (quarantined)."""
    execution = db.claim()
    db.run(_store.begin_assistant, "s", execution, "owner-a", "m-1")
    db.write(
        "UPDATE session_message SET data = ? WHERE id = 'm-1'",
        (
            '{"parts": [{"type": "tool", "call_id": "c", "name": "n", "input": {},'
            ' "status": "completed", "output": 1e400, "error": null}],'
            ' "finished": false, "error": null}',
        ),
    )
    db.expire()
    assert recover(db, execution).decision is RecoveryDecision.QUARANTINE


def test_recovery_quarantines_a_deeply_nested_row(db: Db) -> None:
    """A pathologically nested message is quarantined like any other malformed row."""
    execution = db.claim()
    db.run(_store.begin_assistant, "s", execution, "owner-a", "m-1")
    depth = 100_000
    db.write(
        "UPDATE session_message SET data = ? WHERE id = 'm-1'",
        (
            '{"parts": [], "finished": false, "error": null, "x": '
            + "[" * depth
            + "]" * depth
            + "}",
        ),
    )
    db.expire()
    assert recover(db, execution).decision is RecoveryDecision.QUARANTINE


@pytest.mark.parametrize("backend", ["postgres"], indirect=True)
def test_recovery_scan_skips_claims_locked_by_others(db: Db) -> None:
    """DESIGN §8 on PostgreSQL: the scan of expired claims skips a claim row another
    transaction holds locked (a takeover or heartbeat in flight) instead of waiting for it,
    and the skipped row does not use up the limit."""
    import psycopg
    from backends import PgLocation

    expired_claim(db, "busy", NOW - 5000)
    expired_claim(db, "free", NOW - 3000)
    assert isinstance(db.location, PgLocation)
    with psycopg.connect(db.location.url, options=f"-c search_path={db.location.schema}") as other:
        other.execute("SELECT id FROM session_execution WHERE id = 'exec-busy' FOR UPDATE")
        assert names(scan(db, 1)) == [("free", "exec-free")]
        other.rollback()
    assert names(scan(db, 1)) == [("busy", "exec-busy")]  # our lease on 'free' hides nothing


def quarantined_beside_a_resumed_claim(db: Db, execution: str) -> None:
    """Expire session 's' (claimed by `execution`) and a valid claim, recover both in one
    batch, and assert the first is quarantined and the valid one resumes (§6.11)."""
    db.expire()
    expired_claim(db, "good", NOW - 1)
    candidates = [_store.Candidate("s", execution), _store.Candidate("good", "exec-good")]
    lease(db, *candidates)
    items = [(candidate, f"new-{candidate.session_id}") for candidate in candidates]
    results = db.run(_store.apply_recovery_batch, ME, items, LEASE, 10, [])
    assert [r.decision for r in results] == [RecoveryDecision.QUARANTINE, RecoveryDecision.RESUME]


MAX_INT64 = 2**63 - 1


@pytest.mark.parametrize("where", ["message", "delta"])
def test_a_version_at_the_top_of_its_range_is_quarantined_not_the_whole_pass(
    db: Db, where: str
) -> None:
    """§6.11: an open message whose version (or a delta's) another tool set to 2**63 - 1
    leaves no next version for the message's close. That claim is quarantined, and the
    valid claim in the same batch resumes: the overflow (PostgreSQL's 'bigint out of range',
    SQLite's OverflowError) failed the whole pass, every pass."""
    execution = busy_claim(db)
    if where == "message":
        db.write("UPDATE session_message SET version = ? WHERE id = 'm-1'", (MAX_INT64,))
    else:
        db.run(_store.append_assistant_text, "s", execution, "owner-a", "m-1", " more")
        db.write("UPDATE session_message_delta SET version = ?", (MAX_INT64,))
    quarantined_beside_a_resumed_claim(db, execution)
    [(error,)] = db.rows("SELECT recovery_error FROM session_recovery")
    assert "out of range" in error


@pytest.mark.parametrize("error", [ValueError, TypeError, RecursionError])
def test_a_claim_whose_recovery_raises_is_quarantined_not_the_whole_pass(
    db: Db, monkeypatch: pytest.MonkeyPatch, error: type[Exception]
) -> None:
    """§6.11: a claim whose row-by-row recovery raises what a row no decoder foresaw makes
    (a ValueError, a TypeError, a RecursionError from a pathological value) is poison: it is
    quarantined with the error named, and the valid claim in the same batch resumes. Let
    through, the error failed the whole pass, every pass, and starved the claims behind."""
    real = _store.apply_recovery  # what recovery_batch calls row by row

    def poisoned(tx: Any, owner_id: str, candidate: _store.Candidate, *args: Any) -> Any:
        if candidate.session_id == "s":
            raise error("a row no decoder foresaw")
        return real(tx, owner_id, candidate, *args)

    monkeypatch.setattr(recovery_batch, "apply_recovery", poisoned)
    execution = busy_claim(db)  # an open message: recovered row by row
    quarantined_beside_a_resumed_claim(db, execution)
    [(quarantined, why)] = db.rows("SELECT execution_id, recovery_error FROM session_recovery")
    assert quarantined == execution and error.__name__ in why
    assert db.rows(
        "SELECT session_id, id, owner_id FROM session_execution ORDER BY session_id"
    ) == [("good", "new-good", ME), ("s", execution, "owner-a")]


def test_the_change_look_reports_a_handed_back_claim_a_pass_would_take(db: Db) -> None:
    """A claim handed back by a graceful shutdown is reported by the change look - other
    runtimes then run their recovery pass at once - only when the pass would take it:
    not with no room (`doorbell_limit` 0), not for a session held here, a quarantined
    execution or one with another owner's recovery row (live, or run out: the look reads
    no clock, and leaves that one to the next pass); an expired claim that was not handed
    back (a dead owner's, which waits out the grace) is not reported."""

    def reported(local: list[str] = [], limit: int = 10) -> bool:  # noqa: B006 - read only
        found: bool = db.run(_store.changes, ME, local, [], limit, {}).handed_back
        return found

    expired_claim(db, "dead", NOW - 1000)
    assert not reported()
    execution = db.claim("s", owner="stopped", execution="exec-s")
    assert not reported()  # live
    assert db.run(_store.expire_claims, "stopped", [execution]) == 1
    assert reported()
    assert not reported(limit=0)
    assert not reported(local=["s"])
    put_recovery(db, execution, "other", NOW + LEASE)
    assert not reported()
    db.write("DELETE FROM session_recovery WHERE execution_id = ?", (execution,))
    put_recovery(db, execution, ME, NOW + LEASE)  # our own lease: the pass takes it
    assert reported()
    db.write("DELETE FROM session_recovery WHERE execution_id = ?", (execution,))
    put_recovery(db, execution, "other", NOW - 1)  # another's, run out
    assert not reported()
    db.write("DELETE FROM session_recovery WHERE execution_id = ?", (execution,))
    put_recovery(db, execution, ME, NOW + LEASE, "malformed")
    assert not reported()


@pytest.mark.parametrize("stop", ["request_cancel", "submit_controlled"])
def test_a_stop_of_a_claim_whose_lease_ran_out_hands_it_back(db: Db, stop: str) -> None:
    """A user's Stop (`interrupt()` of another owner's claim, or a message sent with
    `on_busy="interrupt"`) marks the claim cancelling, and - only when its lease ran out,
    so no drain of it still runs - handed back too: the change look reports it, so every
    runtime with room runs its recovery pass at once and finishes it as cancelled, not at
    the next pass of `recovery_interval`. A live claim's owner stops its own drain."""

    def reported() -> bool:
        found: bool = db.run(_store.changes, ME, [], [], 10, {}).handed_back
        return found

    def stop_it(session_id: str, execution_id: str) -> None:
        if stop == "request_cancel":
            assert db.run(_store.request_cancel, session_id) is True
        else:
            marked = db.run(
                _store.submit_controlled, session_id, '{"n": 1}', f"in-{session_id}", "interrupt"
            )
            assert marked == (f"in-{session_id}", execution_id)

    live = db.claim("live", owner="alive", execution="exec-live")
    stop_it("live", live)
    assert not reported()
    expired = expired_claim(db, "dead", NOW - 1)
    assert not reported()  # a dead owner's: the next pass, after the grace
    stop_it("dead", expired)
    assert reported()
    assert db.rows(
        "SELECT session_id, phase, handed_back FROM session_execution ORDER BY session_id"
    ) == [("dead", "cancelling", 1), ("live", "cancelling", 0)]


@pytest.mark.parametrize("stop", ["request_cancel", "submit_controlled"])
def test_a_stop_at_the_very_ms_a_lease_ends_hands_back_what_recovery_takes_as_expired(
    db: Db, stop: str
) -> None:
    """The Stop's test of a lease that ran out (`STOPPED_AFTER_EXPIRY`: `expires_at <= now`)
    is the recovery scan's (`_expired_claims`) and the heartbeat's (renews only while
    `expires_at > now`): a claim whose lease ends at this very millisecond is handed back
    and is a candidate of the pass the change look brings; one a millisecond later is
    neither - its owner may still renew it."""
    edge = expired_claim(db, "edge", NOW)
    expired_claim(db, "later", NOW + 1)
    for session_id in ("edge", "later"):
        if stop == "request_cancel":
            assert db.run(_store.request_cancel, session_id) is True
        else:
            args = (session_id, '{"n": 1}', f"in-{session_id}", "interrupt")
            db.run(_store.submit_controlled, *args)
    assert db.rows(
        "SELECT session_id, phase, handed_back FROM session_execution ORDER BY session_id"
    ) == [("edge", "cancelling", 1), ("later", "cancelling", 0)]
    assert db.run(_store.changes, ME, [], [], 10, {}).handed_back
    assert scan(db, 10) == [_store.Candidate("edge", edge)]
