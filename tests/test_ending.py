"""The ending table (`_decisions.decide_ending`): how a claim's busy period ended decides,
once, what the runtime writes, the outcome, and whether a successor acquisition is due.

Exhaustive over every (cause, reason, owned, lease lost, claim gone): the table is
pinned row by row, and the contract's invariants (DESIGN §6) are checked over every row
independently of it.
"""

from __future__ import annotations

import itertools

import pytest

from trio_sessions._decisions import (
    EndingCause,
    EndingPlan,
    EndingWrite,
    Successor,
    decide_ending,
)
from trio_sessions._model import InterruptReason

REASONS: tuple[InterruptReason | None, ...] = (None, "user", "shutdown", "lease_lost")
BOOLS = (False, True)
ROWS = list(itertools.product(EndingCause, REASONS, BOOLS, BOOLS, BOOLS))

C, W, S = EndingCause, EndingWrite, Successor
NONE, PASS, BACK, MARK, FINI, FAIL = (
    W.NOTHING,
    W.PASS_ON_INTERRUPT,
    W.HAND_BACK,
    W.MARK_CANCELLING,
    W.FINISH_INTERRUPTED,
    W.FINISH_FAILED,
)
LOST = EndingPlan(NONE, "interrupted", "lease_lost", S.NEVER)
# The same, when the store holds no claim of ours any more (the session deleted, or taken
# over): nobody recovers it from us, so a ring since is taken by a successor.
GONE = EndingPlan(NONE, "interrupted", "lease_lost", S.IF_RUNG)

# (cause, reason, owned) -> plan, for an ending that did not come from losing the lease.
TABLE: dict[tuple[EndingCause, InterruptReason | None, bool], EndingPlan] = {}
for owned in (False, True):
    TABLE.update(
        {
            (C.NOT_CLAIMED, None, owned): EndingPlan(NONE, "deferred", None, S.IF_RUNG),
            (C.NOT_CLAIMED, "user", owned): EndingPlan(PASS, "interrupted", "user", S.NEVER),
            # No execution here took the wake, durable for the holder or the next owner:
            # deferred (DESIGN §5 run). An audit found a run's wake_and_acquire that met
            # another owner's claim as the runtime closed returning interrupted/shutdown.
            (C.NOT_CLAIMED, "shutdown", owned): EndingPlan(NONE, "deferred", None, S.NEVER),
            (C.NOT_CLAIMED, "lease_lost", owned): LOST,
            (C.FAILED, "lease_lost", owned): LOST,
            (C.INTERRUPTED, "lease_lost", owned): LOST,
            **{
                (C.RELEASED, reason, owned): EndingPlan(NONE, "succeeded", None, S.IF_RUNG)
                for reason in REASONS
            },
        }
    )
TABLE.update(
    {
        (C.FAILED, None, False): EndingPlan(NONE, "failed", None, S.NEVER),
        (C.FAILED, None, True): EndingPlan(FAIL, "failed", None, S.AFTER_FINISH),
        # A drain that fails once an interrupt was accepted (a cleanup that raised when it
        # was cancelled) ends as the interrupt asked: a user's stop re-arms the doorbell
        # for what it did not take, a shutdown hands the claim back (an audit found both
        # finished as failed: the input stranded, the answer never resumed).
        (C.FAILED, "user", False): EndingPlan(NONE, "interrupted", "user", S.IF_RUNG),
        (C.FAILED, "shutdown", False): EndingPlan(NONE, "interrupted", "shutdown", S.NEVER),
        (C.FAILED, "user", True): EndingPlan(FINI, "interrupted", "user", S.AFTER_FINISH),
        (C.FAILED, "shutdown", True): EndingPlan(BACK, "interrupted", "shutdown", S.NEVER),
        (C.INTERRUPTED, None, False): EndingPlan(NONE, "interrupted", "user", S.IF_RUNG),
        (C.INTERRUPTED, "user", False): EndingPlan(NONE, "interrupted", "user", S.IF_RUNG),
        (C.INTERRUPTED, "shutdown", False): EndingPlan(NONE, "interrupted", "shutdown", S.NEVER),
        (C.INTERRUPTED, None, True): EndingPlan(FINI, "interrupted", "user", S.AFTER_FINISH),
        (C.INTERRUPTED, "user", True): EndingPlan(FINI, "interrupted", "user", S.AFTER_FINISH),
        (C.INTERRUPTED, "shutdown", True): EndingPlan(BACK, "interrupted", "shutdown", S.NEVER),
        (C.STOPPED, None, False): EndingPlan(NONE, "interrupted", "shutdown", S.NEVER),
        (C.STOPPED, "user", False): EndingPlan(NONE, "interrupted", "user", S.NEVER),
        (C.STOPPED, "shutdown", False): EndingPlan(NONE, "interrupted", "shutdown", S.NEVER),
        (C.STOPPED, "lease_lost", False): EndingPlan(NONE, "interrupted", "lease_lost", S.NEVER),
        (C.STOPPED, None, True): EndingPlan(BACK, "interrupted", "shutdown", S.NEVER),
        (C.STOPPED, "user", True): EndingPlan(MARK, "interrupted", "user", S.NEVER),
        (C.STOPPED, "shutdown", True): EndingPlan(BACK, "interrupted", "shutdown", S.NEVER),
        # A stopped busy period hands the claim back even when the heartbeat found the lease
        # lost: the hand-back is fenced, so it writes nothing for a lease another owner took.
        (C.STOPPED, "lease_lost", True): EndingPlan(BACK, "interrupted", "lease_lost", S.NEVER),
    }
)


def test_table_covers_every_cause_reason_and_ownership() -> None:
    """The pinned table has a row for every (cause, reason, owned): nothing is left out."""
    wanted = set(itertools.product(EndingCause, REASONS, (False, True)))
    assert set(TABLE) == wanted


@pytest.mark.parametrize(("cause", "reason", "owned", "lease_lost", "claim_gone"), ROWS)
def test_decide_ending_matches_the_table(
    cause: EndingCause,
    reason: InterruptReason | None,
    owned: bool,
    lease_lost: bool,
    claim_gone: bool,
) -> None:
    """Every row: losing the lease (drain failed or cancelled by it) writes nothing and ends
    `lease_lost`; the lost-lease flag changes nothing for any other cause. A claim gone from
    the store changes only the lost-lease rows of a busy period that was not stopped: a
    ring since takes a successor."""
    plan = decide_ending(
        cause, reason=reason, owned=owned, lease_lost=lease_lost, claim_gone=claim_gone
    )
    if lease_lost and cause in (C.FAILED, C.INTERRUPTED):
        expected = LOST
    else:
        expected = TABLE[cause, reason, owned]
    if claim_gone and expected == LOST and cause is not C.STOPPED:
        expected = GONE
    assert plan == expected


@pytest.mark.parametrize(("cause", "reason", "owned", "lease_lost", "claim_gone"), ROWS)
def test_ending_invariants(
    cause: EndingCause,
    reason: InterruptReason | None,
    owned: bool,
    lease_lost: bool,
    claim_gone: bool,
) -> None:
    """The contract's rules hold on every row, whatever the table's detail: nothing durable
    for a claim not ours (only a user interrupt passed on to its holder), a shutdown never
    finishes a claim whose drain did not fail on its own, a user interrupt never hands one
    back, no successor after a shutdown, a stopped busy period or a lost lease (unless the
    claim is gone from the store: nobody recovers it from us), and a finish's
    successor only after a finish."""
    plan = decide_ending(
        cause, reason=reason, owned=owned, lease_lost=lease_lost, claim_gone=claim_gone
    )
    if not owned:
        assert plan.write in (NONE, PASS)
    if plan.write is PASS:
        assert (cause, reason) == (C.NOT_CLAIMED, "user")
    if reason == "shutdown" and cause is not C.FAILED:
        assert plan.write in (NONE, BACK)
    if reason == "user":
        assert plan.write is not BACK
    if plan.reason == "shutdown" or cause is C.STOPPED:
        assert plan.successor is S.NEVER
    if plan.reason == "lease_lost" and cause is not C.STOPPED:
        assert plan.successor is (S.IF_RUNG if claim_gone else S.NEVER)
    assert (plan.successor is S.AFTER_FINISH) == (plan.write in (FINI, FAIL))
    if plan.reason == "lease_lost" and cause is not C.STOPPED:
        assert plan.write is NONE
    expected_kinds = {
        C.NOT_CLAIMED: {"deferred", "interrupted"},
        C.RELEASED: {"succeeded"},
        C.FAILED: {"failed", "interrupted"},
        C.INTERRUPTED: {"interrupted"},
        C.STOPPED: {"interrupted"},
    }
    assert plan.outcome in expected_kinds[cause]
    assert (plan.reason is None) == (plan.outcome in ("deferred", "succeeded", "failed"))
