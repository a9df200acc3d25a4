"""Owner liveness as pure decisions (DESIGN §4 "Owner liveness", §6.22): when an owner whose
token was seen free counts as gone, and what recovery then does with its live-leased claim.
Exhaustive over small grids: every (free since, now, grace) and every claim shape."""

from __future__ import annotations

import itertools

from trio_sessions._decisions import (
    ClaimRow,
    RecoveryDecision,
    RecoveryFacts,
    decide_recovery,
    token_free_since,
    token_gone,
)
from trio_sessions._liveness import GoneOwners

INSTANTS = [i * 0.125 for i in range(0, 25)]  # 0 .. 3 s
GRACES = [0.125, 0.5, 1.0, 2.0]


def test_token_gone_only_after_staying_free_for_the_grace() -> None:
    """gone <=> seen free at `since` and `now - since >= grace`; held (None) is never gone."""
    for grace, now in itertools.product(GRACES, INSTANTS):
        assert token_gone(None, now, grace) is False
        for since in INSTANTS:
            if since > now:
                continue
            assert token_gone(since, now, grace) is (now - since >= grace), (since, now, grace)


def test_free_since_tracks_the_first_free_sighting_and_resets_when_held() -> None:
    """Every sequence of observations: `since` is the start of the current free run, so an
    owner seen held at any point is judged from scratch (a re-taken token restarts the
    grace); never gone before `grace` has passed since the run began."""
    for pattern in itertools.product([False, True], repeat=6):
        for grace in GRACES:
            since: float | None = None
            run_start: float | None = None
            for step, free in enumerate(pattern):
                now = step * 0.25
                since = token_free_since(since, free, now)
                run_start = (run_start if run_start is not None else now) if free else None
                assert since == run_start
                gone = token_gone(since, now, grace)
                assert gone is (free and run_start is not None and now - run_start >= grace)
                if gone:
                    assert all(pattern[i] for i in range(int((now - grace) / 0.25), step + 1))


def test_recovery_treats_a_gone_owners_live_claim_as_expired() -> None:
    """Every claim shape, lease live or expired, owner gone or not: with the owner gone the
    decision is the one an expired lease gets; with the owner's token held a live lease is
    always skipped (a live owner is never taken over, §6.22)."""
    for (
        expires_at,
        phase,
        superseded,
        malformed,
        attempts,
        gone,
        same_execution,
    ) in itertools.product(
        [5, 10, 15],
        ["running", "cancelling"],
        [False, True],
        [False, True],
        [0, 3],
        [False, True],
        [False, True],
    ):
        now = 10
        claim = ClaimRow("e" if same_execution else "other", "o", phase, expires_at)
        facts = RecoveryFacts(
            claim=claim,
            superseded=superseded,
            newest_assistant_malformed=malformed,
            wake_attempts=attempts,
            owner_gone=gone,
        )
        decision = decide_recovery(facts, "e", now, 3)
        if not same_execution:
            assert decision is RecoveryDecision.GONE
            continue
        as_expired = decide_recovery(
            RecoveryFacts(
                claim=ClaimRow("e", "o", phase, now),
                superseded=superseded,
                newest_assistant_malformed=malformed,
                wake_attempts=attempts,
            ),
            "e",
            now,
            3,
        )
        if gone or expires_at <= now:
            assert decision is as_expired
        else:
            assert decision is RecoveryDecision.SKIP_LIVE


def test_gone_owners_restarts_the_grace_of_an_owner_seen_holding_its_token_again() -> None:
    """`GoneOwners.observe` feeds `token_free_since` only the owners seen free: an owner seen
    free once (its token's connection broke), then holding its token again, is judged from
    scratch at its next free sighting. Kept from the first sighting, a live owner that
    re-took its token and claimed again would count as gone after the grace, and its live
    claims would be taken over (§6.22); found by mutation, as the pure decision's grid
    above never goes through the tracker."""
    owners = GoneOwners(grace=0.5)
    assert owners.observe({"a", "b"}, 0.0) == frozenset()
    assert owners.observe({"b"}, 0.25) == frozenset()  # "a" holds its token again
    assert owners.observe({"a", "b"}, 0.5) == {"b"}  # "a": free again since 0.5 only
    assert owners.observe({"a", "b"}, 0.75) == {"b"}
    assert owners.observe({"a", "b"}, 1.0) == {"a", "b"}
