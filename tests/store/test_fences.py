"""Every fenced write refuses the wrong owner, the wrong execution and an ended lease with
LeaseLost and writes nothing; the lease is live until its last millisecond; a heartbeat
never revives; a zombie owner cannot write after a takeover. On both backends: "nothing
written" is checked by comparing every row of every table."""

from __future__ import annotations

import pytest

from trio_sessions import (
    LeaseLost,
    _codec,
    _store,
    _transcript,
)
from trio_sessions._decisions import RecoveryDecision

from .common import (
    FENCED,
    LEASE,
    ME,
    REFUSALS,
    Db,
    busy_claim,
    lease,
    refuse,
)


@pytest.mark.parametrize("how", REFUSALS)
@pytest.mark.parametrize("op", sorted(FENCED))
def test_fence_refusal_raises_lease_lost_and_writes_nothing(db: Db, op: str, how: str) -> None:
    """Invariant 13: a fenced write by the wrong owner, the wrong execution or after the lease
    ended raises LeaseLost and leaves every row as it was."""
    execution = busy_claim(db)
    execution, owner = refuse(db, how, execution)
    before = db.snapshot()
    with pytest.raises(LeaseLost):
        FENCED[op](db, execution, owner)
    assert db.snapshot() == before


@pytest.mark.parametrize("op", sorted(FENCED))
def test_fence_refuses_the_claim_named_with_another_session(db: Db, op: str) -> None:
    """The claim fence includes the session a drain names: its own execution and owner on a
    live lease, named with another session (one with a claim and inputs of its own), raise
    LeaseLost and leave every row as it was."""
    execution = busy_claim(db)
    db.run(_store.submit, "t", '{"n": 1}', "in-t")
    db.claim("t", execution="exec-t")
    before = db.snapshot()
    with pytest.raises(LeaseLost):
        FENCED[op](db, execution, "owner-a", s="t")
    assert db.snapshot() == before


@pytest.mark.parametrize("op", sorted(FENCED))
def test_fence_holds_one_ms_before_expiry(db: Db, op: str) -> None:
    """The lease is live until its last millisecond: each fenced write still succeeds then."""
    execution = busy_claim(db)
    db.expire()
    db.now -= 1
    before = db.snapshot()
    FENCED[op](db, execution, "owner-a")  # raises LeaseLost if the fence refused
    assert db.snapshot() != before


@pytest.mark.parametrize("how", REFUSALS)
def test_heartbeat_refusal_never_revives(db: Db, how: str) -> None:
    """Invariant 4: a heartbeat for a lost lease reports None and leaves the row untouched."""
    execution = busy_claim(db)
    execution, owner = refuse(db, how, execution)
    before = db.snapshot()
    assert db.run(_store.heartbeat, owner, [execution], LEASE) == {execution: None}
    assert db.snapshot() == before


@pytest.mark.parametrize("how", REFUSALS)
def test_expire_claims_refusal_counts_zero(db: Db, how: str) -> None:
    """Shutdown expiry of a claim it does not hold live returns 0 and writes nothing."""
    execution = busy_claim(db)
    execution, owner = refuse(db, how, execution)
    before = db.snapshot()
    assert db.run(_store.expire_claims, owner, [execution]) == 0
    assert db.snapshot() == before


def test_update_assistant_refuses_another_executions_message(db: Db) -> None:
    """A live claim still cannot write a message that belongs to another execution."""
    db.claim("s")
    db.put_message("m-foreign", "exec-old", 1, _codec.encode_assistant(_transcript.EMPTY))
    before = db.snapshot()
    with pytest.raises(LeaseLost):
        db.run(
            _store.update_assistant,
            "s",
            "exec-1",
            "owner-a",
            "m-foreign",
            lambda d: _transcript.append_text(d, "x"),
        )
    assert db.snapshot() == before


def test_zombie_owner_cannot_write_after_takeover(db: Db) -> None:
    """After recovery took over an expired claim, every write of the old owner is refused."""
    execution = busy_claim(db)
    db.expire()
    candidate = _store.Candidate("s", execution)
    lease(db, candidate)
    recovered = db.run(_store.apply_recovery, ME, candidate, "exec-new", LEASE, 10)
    assert recovered.decision is RecoveryDecision.RESUME
    before = db.snapshot()
    for op in sorted(FENCED):
        with pytest.raises(LeaseLost):
            FENCED[op](db, execution, "owner-a")
    assert db.run(_store.heartbeat, "owner-a", [execution], LEASE) == {execution: None}
    assert db.snapshot() == before
