"""Pure claim, lease and recovery decisions: functions of (row, now, owner), no I/O, no clock.

The store's SQL fences implement exactly these predicates (tests compare the two), so every
rule here can be checked exhaustively without a database:

* a lease is live iff `expires_at > now`; an expired lease is never revived;
* the acquire path inserts a claim only when the doorbell is set and no claim row exists;
* recovery acts only on an expired claim it holds a recovery lease for, and decides in this
  order: live again, cancelling, superseded, malformed, budget exhausted (never for a claim
  handed back by a graceful shutdown), resume;
* a claim whose owner is *gone* - its liveness token seen free and staying free for the
  takeover grace (DESIGN §4 "Owner liveness") - counts as expired; an owner whose token is
  held keeps its live claims until their leases run out.
"""

from __future__ import annotations

import enum

import attrs


def lease_is_live(expires_at: int, now: int) -> bool:
    """A lease is live strictly before its expiry instant."""
    return expires_at > now


def token_free_since(previous: float | None, free: bool, now: float) -> float | None:
    """When the current run of free sightings of an owner's liveness token began (None while
    it is held): a token seen held again - an owner that re-took it - restarts the grace."""
    if not free:
        return None
    return now if previous is None else previous


def token_gone(free_since: float | None, now: float, grace: float) -> bool:
    """An owner is gone once its token, first seen free at `free_since`, stayed free for
    `grace`: long enough for an owner that lost its token while alive (a broken
    connection) to have noticed and cancelled its drains, which it does in milliseconds."""
    return free_since is not None and now - free_since >= grace


@attrs.frozen
class ClaimRow:
    """The fields of a `session_execution` row that decisions look at."""

    execution_id: str
    owner_id: str
    phase: str
    expires_at: int


def holds_live_claim(row: ClaimRow | None, execution_id: str, owner_id: str, now: int) -> bool:
    """The fence of every write a drain makes: exact execution, exact owner, live lease."""
    return (
        row is not None
        and row.execution_id == execution_id
        and row.owner_id == owner_id
        and lease_is_live(row.expires_at, now)
    )


def renewed_expiry(
    row: ClaimRow | None, execution_id: str, owner_id: str, now: int, lease_ms: int
) -> int | None:
    """The new `expires_at` a heartbeat writes, or None when the lease is lost (never revived)."""
    if not holds_live_claim(row, execution_id, owner_id, now):
        return None
    return now + lease_ms


class AcquireVerdict(enum.Enum):
    CLAIM = "claim"
    NO_DOORBELL = "no_doorbell"
    HELD = "held"


def acquire_verdict(*, doorbell_set: bool, claim_row: ClaimRow | None) -> AcquireVerdict:
    """The acquire path never overwrites a claim row: live or expired, own or foreign."""
    if claim_row is not None:
        return AcquireVerdict.HELD
    if not doorbell_set:
        return AcquireVerdict.NO_DOORBELL
    return AcquireVerdict.CLAIM


@attrs.frozen
class RecoveryLeaseRow:
    owner_id: str
    expires_at: int
    quarantined: bool


def may_take_recovery_lease(row: RecoveryLeaseRow | None, owner_id: str, now: int) -> bool:
    """Absent, expired, or already ours; never a quarantined row."""
    if row is None:
        return True
    if row.quarantined:
        return False
    return row.owner_id == owner_id or not lease_is_live(row.expires_at, now)


class RecoveryDecision(enum.Enum):
    GONE = "gone"  # the claim row is no longer the one we examined
    SKIP_LIVE = "skip_live"
    FINISH_CANCELLED = "finish_cancelled"
    DROP_SUPERSEDED = "drop_superseded"
    QUARANTINE = "quarantine"
    EXHAUSTED = "exhausted"
    RESUME = "resume"


@attrs.frozen
class RecoveryFacts:
    """What one recovery transaction read about one expired claim."""

    claim: ClaimRow | None
    superseded: bool
    newest_assistant_malformed: bool
    wake_attempts: int
    # Handed back by a graceful shutdown: resumed without counting against the budget.
    handed_back: bool = False
    # The claim's owner is gone (`token_gone`, re-checked in this transaction): its lease
    # counts as expired.
    owner_gone: bool = False


def decide_recovery(
    facts: RecoveryFacts, execution_id: str, now: int, max_resumes: int
) -> RecoveryDecision:
    """Recovery's rules, in the contract's order."""
    claim = facts.claim
    if claim is None or claim.execution_id != execution_id:
        return RecoveryDecision.GONE
    if lease_is_live(claim.expires_at, now) and not facts.owner_gone:
        return RecoveryDecision.SKIP_LIVE
    if claim.phase == "cancelling":
        return RecoveryDecision.FINISH_CANCELLED
    if facts.superseded:
        return RecoveryDecision.DROP_SUPERSEDED
    if facts.newest_assistant_malformed:
        return RecoveryDecision.QUARANTINE
    if not facts.handed_back and facts.wake_attempts >= max_resumes:
        return RecoveryDecision.EXHAUSTED
    return RecoveryDecision.RESUME


def rearms_doorbell(decision: RecoveryDecision) -> bool:
    """Which endings re-arm the doorbell for untaken inputs.

    A failed ending (budget exhausted) does not: that would loop on work that always fails.
    """
    return decision in (RecoveryDecision.FINISH_CANCELLED, RecoveryDecision.DROP_SUPERSEDED)
