"""Recovery: applying the pure decision (`_decisions.decide_recovery`) to each expired claim
or unclaimed doorbell whose recovery lease this owner took (the scan and the leases are
`recovery_scan`).

Invariants kept here:
* recovery replaces a claim only fenced on the exact old execution id still being expired
  (`RECOVERY_FENCE`): the row-by-row takeover (`_replace_claim`); SQLite's set-wise path
  (`recovery_batch._take_over_plain`) and PostgreSQL's (`ts_recover`, on the claim rows no
  other transaction holds locked) spell the same fence in their takeovers; a claim of
  a gone owner (DESIGN §4 "Owner liveness") counts as expired only if its token is still
  free when the applying transaction re-checks it;
* it acts only on a row whose recovery lease it holds (live, unquarantined, ours); a
  quarantine is written with the exact quarantine fence, and zero rows means ownership
  moved: nothing else is touched;
* a claim handed back by a graceful shutdown resumes without counting a resume;
* one row's failure never undoes another's recovery (savepoint per row); a row recovery
  cannot process is quarantined, never retried forever.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from .. import _decisions
from .._backend import Tx, reads_stored_bytes
from .._decisions import ClaimRow, RecoveryDecision, RecoveryFacts
from .._errors import MalformedRecord
from .._model import BUDGET_EXHAUSTED, INTERRUPTED, OWNER_LOST
from .common import (
    RECOVERY_FENCE,
    _chunks,
    _fence,
    _has_pending_inputs,
    _in_list,
    _newest_seq,
    _no_longer_expired,
    _reset_attempts,
    _ring,
    unknown_phase,
    wake_attempts_of,
)
from .recovery_scan import Candidate
from .transcript import MAYBE_OPEN, _close_open_messages, maybe_open_data

# Whether a claim is superseded: any other execution's assistant message after the claim's
# anchor (any at all for a claim taken before any message). One spelling for the
# row-by-row read (parameters) and the set-wise one (correlated on the claim row).
_SUPERSEDED_OF = (
    "EXISTS (SELECT 1 FROM session_message m WHERE m.session_id = {session}"
    " AND m.role = 'assistant' AND (m.execution_id IS NULL OR m.execution_id != {execution})"
    " AND m.seq > COALESCE({anchor}, 0))"
)


def _superseded(*, session: str, execution: str, anchor: str) -> str:
    return _SUPERSEDED_OF.format(session=session, execution=execution, anchor=anchor)


def _recovery_facts(tx: Tx, candidate: Candidate) -> tuple[RecoveryFacts, str | None]:
    """What recovery decides on, and why the newest assistant message is malformed (None
    when it decodes or there is none)."""
    session_id, execution_id = candidate.session_id, candidate.execution_id
    row = tx.one(
        "SELECT id, owner_id, phase, expires_at, anchor_seq, handed_back FROM session_execution"
        " WHERE session_id = ?",
        (session_id,),
    )
    claim = None if row is None else ClaimRow(*row[:4])
    # Another execution's anchor is never used: the decision for a replaced claim is GONE.
    ours = claim is not None and claim.execution_id == execution_id
    if ours and type(row[3]) is not int:
        # Another tool's write (SQLite keeps any value): no lease to judge, no decision.
        reasons = [f"expires_at is {row[3]!r:.60}, not a time"]
        raise MalformedRecord("session_execution", str(execution_id), reasons)
    unknown = unknown_phase(str(execution_id), row[2]) if ours else None
    if unknown is not None:
        # Past the phase's CHECK: whether a cancellation was asked for - never resumed -
        # cannot be told.
        raise unknown
    anchor_seq = row[4] if ours else None
    if anchor_seq is not None and type(anchor_seq) is not int:
        # Another tool's write again: whether a message came after it cannot be told
        # (`seq > 'abc'` holds for no number), so neither can whether it was superseded.
        reasons = [f"anchor_seq is {anchor_seq!r:.60}, not a seq"]
        raise MalformedRecord("session_execution", str(execution_id), reasons)
    superseded = bool(
        tx.one(
            "SELECT " + _superseded(session=":session", execution=":execution", anchor=":anchor"),
            {"session": session_id, "execution": execution_id, "anchor": anchor_seq or 0},
        )[0]
    )
    malformed = newest_assistant_malformed(tx, str(execution_id))
    malformed_reason = None if malformed is None else str(malformed)
    attempts = tx.one("SELECT wake_attempts, time_paused FROM session WHERE id = ?", (session_id,))
    if attempts is None and ours:
        # Only another tool, with foreign keys off, leaves a claim without its session: a
        # drain resumed on it would run for no session and lose its claim at once.
        reasons = [f"its session {session_id!r} has no row"]
        raise MalformedRecord("session_execution", str(execution_id), reasons)
    facts = RecoveryFacts(
        claim=claim,
        superseded=superseded,
        newest_assistant_malformed=malformed_reason is not None,
        wake_attempts=0 if attempts is None else wake_attempts_of(session_id, attempts[0]),
        handed_back=ours and bool(row[5]),
        paused=attempts is not None and attempts[1] is not None,
    )
    return facts, malformed_reason


@reads_stored_bytes
def newest_assistant_malformed(tx: Tx, execution_id: str) -> MalformedRecord | None:
    """Why the execution's newest assistant message - or an older one it left open - does
    not decode (None when each does or there is none): what recovery quarantines the
    execution for, as that message's `MalformedRecord` (its table, its key, its reasons).
    An older open one counts because its owner's finish refused to end the busy period
    over it (`_close_open_messages`, `malformed_keeps_claim`) and a takeover would pass
    over it, leaving it open for ever - as one whose mark another tool broke (neither 0
    nor 1: `broken_mark`), which the finish refuses too. One read: the newest row first,
    then the maybe open ones (`MAYBE_OPEN`)."""
    rows = tx.execute(
        "SELECT id, data, finished FROM session_message"
        f" WHERE execution_id = ? AND role = 'assistant' AND ({MAYBE_OPEN} OR seq = ("
        "SELECT MAX(seq) FROM session_message WHERE execution_id = ? AND role = 'assistant'))"
        " ORDER BY seq DESC",
        (execution_id, execution_id),
    ).fetchall()
    if not rows:
        return None
    message_id, text, finished = rows[0]
    try:
        # Refused as the finishes refuse it: no id a takeover could close it by, no
        # decoding, or a mark neither 0 nor 1.
        data = maybe_open_data(tx, message_id, text, finished)
    except MalformedRecord as exc:
        return exc
    # Every finish looks for open messages by this mark (`MAYBE_OPEN`): one another tool
    # set to 1 would leave the message open, its tools `running` for ever, under a takeover.
    if finished == 1 and not data.finished:
        reason = "finished is 1 while its data is open: no finish would close it"
        return MalformedRecord("session_message", str(message_id), [reason])
    for older_id, older_text, older_finished in rows[1:]:
        try:
            maybe_open_data(tx, older_id, older_text, older_finished)
        except MalformedRecord as exc:
            return exc
    return None


@attrs.frozen
class Recovered:
    """What applying recovery to one expired claim did."""

    decision: RecoveryDecision
    fence_lost: bool = False
    new_execution_id: str | None = None
    attempt: int = 0
    reason: str | None = None  # why a quarantined row does not decode
    # A cancelled or superseded claim's open messages that do not decode, left as they are
    # with the claim deleted (DESIGN §4's order): the runtime tells the operator.
    left_open: tuple[MalformedRecord, ...] = ()


def apply_recovery(
    tx: Tx,
    owner_id: str,
    candidate: Candidate,
    new_execution_id: str,
    lease_ms: int,
    max_resumes: int,
    gone: frozenset[str] = frozenset(),
) -> Recovered:
    """Decide and act on one expired claim whose recovery lease we took.

    Every ending but quarantine deletes the `session_recovery` row. Quarantine writes with
    the *quarantine fence* - exact execution, session, recovery owner, live recovery lease,
    not yet quarantined - and zero rows means ownership moved: nothing else is touched.
    """
    execution_id = candidate.execution_id
    assert execution_id is not None
    tx.lock_session(candidate.session_id)
    facts, malformed_reason = _recovery_facts(tx, candidate)
    if facts.claim is not None and facts.claim.owner_id in gone:
        facts = attrs.evolve(facts, owner_gone=True)
    decision = _decisions.decide_recovery(facts, execution_id, tx.now, max_resumes)
    if decision is RecoveryDecision.QUARANTINE:
        assert malformed_reason is not None
        return quarantine(tx, owner_id, candidate, malformed_reason)
    if not _holds_recovery_lease(tx, execution_id, owner_id):
        # Another recovery owner holds this row now: act on nothing of theirs.
        return Recovered(RecoveryDecision.GONE, fence_lost=True)
    if decision is RecoveryDecision.RESUME:
        return _take_over(tx, owner_id, candidate, new_execution_id, lease_ms, facts)
    if decision in (
        RecoveryDecision.FINISH_CANCELLED,
        RecoveryDecision.DROP_SUPERSEDED,
        RecoveryDecision.FINISH_PAUSED,
        RecoveryDecision.EXHAUSTED,
    ):
        left_open = _end_expired_claim(tx, candidate, decision, _gone_owner(facts))
    else:
        left_open = ()
    _delete_recovery_row(tx, execution_id, owner_id)
    return Recovered(decision, left_open=left_open)


def _holds_recovery_lease(tx: Tx, execution_id: str, owner_id: str) -> bool:
    """The recovery-lease fence: our live, unquarantined `session_recovery` row."""
    row = tx.one(
        "SELECT 1 FROM session_recovery WHERE execution_id = ? AND owner_id = ?"
        " AND expires_at > ? AND recovery_error IS NULL",
        (execution_id, owner_id, tx.now),
    )
    return row is not None


def quarantine(tx: Tx, owner_id: str, candidate: Candidate, why: str) -> Recovered:
    """Quarantine with the exact fence; zero rows means another owner holds it now."""
    updated = tx.execute(
        "UPDATE session_recovery SET recovery_error = :why, time_quarantined = :now"
        " WHERE execution_id = :e AND session_id = :s AND owner_id = :me"
        " AND expires_at > :now AND recovery_error IS NULL",
        {
            "why": why,
            "now": tx.now,
            "e": candidate.execution_id,
            "s": candidate.session_id,
            "me": owner_id,
        },
    ).rowcount
    if updated != 1:
        return Recovered(RecoveryDecision.QUARANTINE, fence_lost=True)
    return Recovered(RecoveryDecision.QUARANTINE, reason=why)


def _delete_recovery_row(tx: Tx, execution_id: str, owner_id: str) -> None:
    _delete_recovery_rows(tx, owner_id, [execution_id])


def _gone_owner(facts: RecoveryFacts) -> str | None:
    """The claim's owner when it is gone (for the recovery fence), else None."""
    return facts.claim.owner_id if facts.owner_gone and facts.claim is not None else None


def _delete_expired_claim(tx: Tx, execution_id: str, gone_owner: str | None) -> None:
    deleted = tx.execute(
        f"DELETE FROM session_execution WHERE {RECOVERY_FENCE}",
        _fence(tx, execution_id, gone_owner=gone_owner),
    ).rowcount
    if deleted != 1:
        raise _no_longer_expired(execution_id)


def _end_expired_claim(
    tx: Tx, candidate: Candidate, decision: RecoveryDecision, gone_owner: str | None
) -> tuple[MalformedRecord, ...]:
    """Finish an expired claim that is not resumed, deleting it; returns the open messages
    left as they are (they do not decode)."""
    execution_id = candidate.execution_id
    assert execution_id is not None
    reason = {
        RecoveryDecision.FINISH_CANCELLED: INTERRUPTED,
        RecoveryDecision.DROP_SUPERSEDED: OWNER_LOST,
        RecoveryDecision.FINISH_PAUSED: OWNER_LOST,
        RecoveryDecision.EXHAUSTED: BUDGET_EXHAUSTED,
    }[decision]
    left_open = _close_open_messages(tx, execution_id, reason)
    _delete_expired_claim(tx, execution_id, gone_owner)
    if decision is RecoveryDecision.EXHAUSTED:
        _reset_attempts(tx, candidate.session_id)
    if _decisions.owes_a_drain(decision) or (
        _decisions.rearms_doorbell(decision) and _has_pending_inputs(tx, candidate.session_id)
    ):
        _ring(tx, candidate.session_id)
    return left_open


def _take_over(
    tx: Tx,
    owner_id: str,
    candidate: Candidate,
    new_execution_id: str,
    lease_ms: int,
    facts: RecoveryFacts,
) -> Recovered:
    old = candidate.execution_id
    assert old is not None
    _close_open_messages(tx, old, OWNER_LOST)
    anchor = _newest_seq(tx, candidate.session_id)
    if not _replace_claim(
        tx, old, new_execution_id, owner_id, anchor, lease_ms, _gone_owner(facts)
    ):
        raise _no_longer_expired(old)
    # A claim handed back by a graceful shutdown resumes without counting: rolling
    # restarts are not a crash loop.
    counted = 0 if facts.handed_back else 1
    _count_resume(tx, bool(counted), candidate.session_id)
    _delete_recovery_row(tx, old, owner_id)
    return Recovered(
        RecoveryDecision.RESUME,
        new_execution_id=new_execution_id,
        attempt=facts.wake_attempts + counted,
    )


def _replace_claim(
    tx: Tx,
    old_execution_id: str,
    new_execution_id: str,
    owner_id: str,
    anchor_seq: int | None,
    lease_ms: int,
    gone_owner: str | None,
) -> bool:
    """The takeover, fenced on the exact old execution still expired - or still held by
    `gone_owner`, whose token this transaction found free (`RECOVERY_FENCE`): the claim
    becomes ours, running, on a fresh lease. False when the fence matched nothing (nothing
    written)."""
    replaced = tx.execute(
        "UPDATE session_execution SET id = :new, owner_id = :me, phase = 'running',"
        " anchor_seq = :anchor, time_created = :now, heartbeat_at = NULL, expires_at = :expires,"
        f" handed_back = 0 WHERE {RECOVERY_FENCE}",
        {
            **_fence(tx, old_execution_id, gone_owner=gone_owner),
            "new": new_execution_id,
            "me": owner_id,
            "anchor": anchor_seq,
            "expires": tx.now + lease_ms,
        },
    ).rowcount
    return bool(replaced == 1)


def _count_resume(tx: Tx, counts: bool, session_id: str) -> None:
    """After a takeover: take the session's doorbell, and count a resume when `counts` (a
    claim handed back by a graceful shutdown resumes without counting)."""
    tx.execute(
        "UPDATE session SET wake_attempts = wake_attempts + ?, time_woken = NULL, wakes = 0"
        " WHERE id = ?",
        (int(counts), session_id),
    )


def end_recovery_leases(tx: Tx, owner_id: str, execution_ids: Sequence[str]) -> None:
    """Let go of our recovery leases on these executions, unacted on (no room for them
    after all, or their session became busy here): any runtime's next pass may take them,
    instead of waiting for the leases to run out."""
    _delete_recovery_rows(tx, owner_id, execution_ids)


def _delete_recovery_rows(tx: Tx, owner_id: str, execution_ids: Sequence[str]) -> None:
    # Only our own recovery rows: another owner's lease or quarantine is not ours to touch.
    for chunk in _chunks(execution_ids):
        tx.execute(
            f"DELETE FROM session_recovery WHERE execution_id IN {_in_list(chunk)}"
            " AND owner_id = ? AND recovery_error IS NULL",
            (*chunk, owner_id),
        )
