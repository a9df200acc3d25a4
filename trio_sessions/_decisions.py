"""Pure claim, lease and recovery decisions: functions of (row, now, owner), no I/O, no clock.

The store's SQL fences implement exactly these predicates (tests compare the two), so every
rule here can be checked exhaustively without a database:

* a lease is live iff `expires_at > now`; an expired lease is never revived;
* the acquire path inserts a claim only when the doorbell is set and no claim row exists;
* recovery acts only on an expired claim it holds a recovery lease for, and decides in this
  order: live again, cancelling, superseded, malformed, paused, budget exhausted (never for
  a claim handed back by a graceful shutdown), resume;
* how a busy period's claim ended decides, once (`decide_ending`), what the runtime writes for
  it: nothing is written for a claim whose lease is lost or that is not ours (except passing a
  user interrupt on to the claim's holder), a shutdown never finishes a claim (it hands it back
  for recovery), and a user interrupt never hands one back (recovery would resume it);
* a paused session is never claimed, and a busy period on it ends at its next iteration
  boundary (DESIGN §5.1);
* a submit decides what a busy session does with it (`on_busy`) from the claim's phase and
  whether due inputs wait untaken;
* how a busy period's claim ended decides, once (`decide_ending`), what the runtime writes for
  it: nothing is written for a claim whose lease is lost or that is not ours (except passing a
  user interrupt on to the claim's holder), a shutdown never finishes a claim (it hands it back
  for recovery), and a user interrupt never hands one back (recovery would resume it);
* a claim whose owner is *gone* - its liveness token seen free and staying free for the
  takeover grace (DESIGN §4 "Owner liveness") - counts as expired; an owner whose token is
  held keeps its live claims until their leases run out.
"""

from __future__ import annotations

import enum

import attrs

from ._model import InterruptReason, OutcomeKind


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
    PAUSED = "paused"  # the doorbell stays set for `resume`


def acquire_verdict(
    *, doorbell_set: bool, claim_row: ClaimRow | None, paused: bool = False
) -> AcquireVerdict:
    """The acquire path never overwrites a claim row: live or expired, own or foreign; and
    never claims a paused session."""
    if claim_row is not None:
        return AcquireVerdict.HELD
    if paused:
        return AcquireVerdict.PAUSED
    if not doorbell_set:
        return AcquireVerdict.NO_DOORBELL
    return AcquireVerdict.CLAIM


class IterationVerdict(enum.Enum):
    """What a drain's normal return leads to (the finish transaction of the drain loop)."""

    CONTINUE = "continue"  # doorbell set: take it, drain again under the same claim
    RELEASE = "release"  # nothing pending: delete the claim
    # cancelling, doorbell set (or rung for untaken inputs): delete the claim, a successor
    # takes it
    HAND_OVER = "hand_over"
    PAUSE = "pause"  # paused: delete the claim, leave the doorbell set for `resume`


def iteration_verdict(
    *, doorbell_set: bool, phase: str, paused: bool, untaken_inputs: bool
) -> IterationVerdict:
    """After a drain call returned normally. A pause ends the busy period at this boundary;
    a claim marked cancelling (an interrupt that arrived as the call returned) starts no
    further iteration of its own: a fresh successor takes what is pending - its set
    doorbell, and like an interrupt's cleanup the due inputs still untaken (`untaken_inputs`:
    marked cancelling before its drain took them, it was given none), for which the
    doorbell is rung. A running claim's drain that returned without taking its inputs chose
    so (`untaken_inputs` does not matter then)."""
    if paused:
        return IterationVerdict.PAUSE
    if phase == "cancelling":
        handed_over = doorbell_set or untaken_inputs
        return IterationVerdict.HAND_OVER if handed_over else IterationVerdict.RELEASE
    if doorbell_set:
        return IterationVerdict.CONTINUE
    return IterationVerdict.RELEASE


ON_BUSY = ("queue", "interrupt", "reject")


class SubmitVerdict(enum.Enum):
    QUEUE = "queue"  # store it; the next drain iteration takes it
    INTERRUPT = "interrupt"  # store it and mark the running claim cancelling
    REJECT = "reject"  # store nothing: `SessionBusy`


def submit_verdict(
    on_busy: str, *, claim_phase: str | None, due_inputs_pending: bool
) -> SubmitVerdict:
    """What a new input does to a session that may be busy: a claim exists (`claim_phase`
    is its phase), or due inputs wait untaken. Scheduled inputs not yet due do not make a
    session busy."""
    busy = claim_phase is not None or due_inputs_pending
    if on_busy == "reject" and busy:
        return SubmitVerdict.REJECT
    if on_busy == "interrupt" and claim_phase == "running":
        return SubmitVerdict.INTERRUPT
    return SubmitVerdict.QUEUE


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
    FINISH_PAUSED = "finish_paused"  # a paused session's dead claim: owner-lost, rung for resume
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
    paused: bool = False


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
    if facts.paused:
        return RecoveryDecision.FINISH_PAUSED
    if not facts.handed_back and facts.wake_attempts >= max_resumes:
        return RecoveryDecision.EXHAUSTED
    return RecoveryDecision.RESUME


def rearms_doorbell(decision: RecoveryDecision) -> bool:
    """Which endings re-arm the doorbell for untaken inputs.

    A failed ending (budget exhausted) does not: that would loop on work that always fails.
    """
    return decision in (
        RecoveryDecision.FINISH_CANCELLED,
        RecoveryDecision.DROP_SUPERSEDED,
        RecoveryDecision.FINISH_PAUSED,
    )


def rings_after_recovery(decision: RecoveryDecision) -> bool:
    """Which endings the runtime that recovered rings at once, its own commit being no
    change signal to it: those that may leave the session's doorbell set with no claim -
    the ones that re-arm it, and an exhausted one (it re-arms nothing, but a message rung
    while its claim was held is a new wake, not the failed work) - but a paused session's,
    whose doorbell waits for `resume`. Ringing registers the successor before the pass
    returns, so `wait_idle` waits for it; with no doorbell set, the ring claims nothing."""
    return (
        rearms_doorbell(decision) or decision is RecoveryDecision.EXHAUSTED
    ) and decision is not RecoveryDecision.FINISH_PAUSED


def owes_a_drain(decision: RecoveryDecision) -> bool:
    """Which endings ring the doorbell whatever is pending: a paused session's claim cut
    short (its owner restarted or died mid-answer) is owed a drain once resumed. The
    question it was answering is a user message by then, not a pending input: without the
    ring, `resume` would find nothing to do and the question would stay unanswered."""
    return decision is RecoveryDecision.FINISH_PAUSED


class EndingCause(enum.Enum):
    """How one claim's part of a busy period ended."""

    NOT_CLAIMED = "not_claimed"  # the acquisition did not claim (held elsewhere, withdrawn)
    RELEASED = "released"  # the finish transaction found no doorbell and released the claim
    FAILED = "failed"  # the drain (or its acquisition) raised, or broke the drain contract
    INTERRUPTED = "interrupted"  # the drain's scope was cancelled (an interrupt, the deadline)
    STOPPED = "stopped"  # the busy period's task itself was cancelled (runtime closing)


class EndingWrite(enum.Enum):
    """What the runtime writes for the claim once it ended."""

    NOTHING = "nothing"
    # Mark the claim's holder (another owner) cancelling: a user interrupt accepted while
    # this runtime was still acquiring.
    PASS_ON_INTERRUPT = "pass_on_interrupt"
    # Keep the claim, end its lease now: any owner recovers it at once (a shutdown).
    HAND_BACK = "hand_back"
    # Best effort and bounded: mark it cancelling, so recovery finishes it and never resumes.
    MARK_CANCELLING = "mark_cancelling"
    # Mark it cancelling, then finish it as interrupted (retried while the claim is ours).
    FINISH_INTERRUPTED = "finish_interrupted"
    # Finish it as failed (retried while the claim is ours).
    FINISH_FAILED = "finish_failed"


class Successor(enum.Enum):
    """Whether the busy period goes on with a fresh acquisition from the same entry."""

    NEVER = "never"
    # If a wake rang the entry since its last deciding transaction.
    IF_RUNG = "if_rung"
    # If the finish write landed and read the doorbell set, or a wake rang since it began;
    # never if it did not land (the claim is left for recovery).
    AFTER_FINISH = "after_finish"


@attrs.frozen
class EndingPlan:
    """What to write, the busy period's outcome (kind and reason), and whether a successor
    acquisition is due."""

    write: EndingWrite
    outcome: OutcomeKind
    reason: InterruptReason | None
    successor: Successor


# The two plans nearly every claim ends with (frozen: shared, not built per claim).
_RELEASED = EndingPlan(EndingWrite.NOTHING, "succeeded", None, Successor.IF_RUNG)
_DEFERRED = EndingPlan(EndingWrite.NOTHING, "deferred", None, Successor.IF_RUNG)
_DEFERRED_AT_SHUTDOWN = EndingPlan(EndingWrite.NOTHING, "deferred", None, Successor.NEVER)


def decide_ending(
    cause: EndingCause,
    *,
    reason: InterruptReason | None,
    owned: bool,
    lease_lost: bool = False,
    claim_gone: bool = False,
) -> EndingPlan:
    """The ending table: (cause, interrupt reason, claim still ours, lease lost, claim gone)
    -> plan.

    `owned` is whether the claim is still this entry's (committed and not yet released);
    `lease_lost` whether the drain's failure or cancellation came from losing the lease (a
    fenced write refused, or the local self-fence deadline passed; the reason `lease_lost`
    means the heartbeat already found it); `claim_gone` whether the store holds no claim
    of ours for it any more - its session deleted (here, or elsewhere: the change scan
    found its row gone), or taken over (the reason is then `lease_lost`). A crashed runtime (a
    test's simulated process death) consults no table: it writes nothing.
    """
    plan = _ending_plan(cause, reason=reason, owned=owned, lease_lost=lease_lost)
    if claim_gone and plan.reason == "lease_lost" and cause is not EndingCause.STOPPED:
        # No claim of ours is left for recovery: a wake rung since (a submit to the fresh
        # session) is this runtime's to take, as after any other interrupt - its
        # acquisition finds the claim held if another owner took it over.
        return _GONE
    return plan


_GONE = EndingPlan(EndingWrite.NOTHING, "interrupted", "lease_lost", Successor.IF_RUNG)


def _ending_plan(
    cause: EndingCause, *, reason: InterruptReason | None, owned: bool, lease_lost: bool
) -> EndingPlan:
    if cause is EndingCause.STOPPED:
        # The drain has exited (a cancellation only leaves it once it did).
        if not owned:
            write = EndingWrite.NOTHING
        elif reason == "user":
            write = EndingWrite.MARK_CANCELLING
        else:
            write = EndingWrite.HAND_BACK
        return EndingPlan(write, "interrupted", reason or "shutdown", Successor.NEVER)
    if cause is EndingCause.RELEASED:
        return _RELEASED
    if cause is EndingCause.NOT_CLAIMED:
        if reason == "user":
            return EndingPlan(EndingWrite.PASS_ON_INTERRUPT, "interrupted", reason, Successor.NEVER)
        if reason == "shutdown":
            # No execution here took the wake, and it stays durable for the session's holder
            # or the next owner: deferred, as a run that finds the runtime closing is.
            return _DEFERRED_AT_SHUTDOWN
        if reason is not None:
            return EndingPlan(EndingWrite.NOTHING, "interrupted", reason, Successor.NEVER)
        return _DEFERRED
    if lease_lost or reason == "lease_lost":
        # No durable write, and no successor: recovery owns the claim now.
        return EndingPlan(EndingWrite.NOTHING, "interrupted", "lease_lost", Successor.NEVER)
    if cause is EndingCause.FAILED and reason is None:
        if not owned:
            return EndingPlan(EndingWrite.NOTHING, "failed", None, Successor.NEVER)
        return EndingPlan(EndingWrite.FINISH_FAILED, "failed", None, Successor.AFTER_FINISH)
    # Interrupted: also a drain that failed on its way out (a cleanup that raised when it
    # was cancelled) - what the interrupt asked for stands.
    if reason == "shutdown":
        write = EndingWrite.HAND_BACK if owned else EndingWrite.NOTHING
        return EndingPlan(write, "interrupted", "shutdown", Successor.NEVER)
    if not owned:
        return EndingPlan(EndingWrite.NOTHING, "interrupted", "user", Successor.IF_RUNG)
    return EndingPlan(EndingWrite.FINISH_INTERRUPTED, "interrupted", "user", Successor.AFTER_FINISH)
