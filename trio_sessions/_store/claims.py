"""Claims: acquire, heartbeat, finish, interrupt and the shutdown hand-back.

Invariants kept here:
* the acquire path inserts a claim only when no `session_execution` row exists for the
  session (never an overwrite, live or expired, own or foreign) and the doorbell is set;
  it takes the doorbell in the same transaction;
* every write a drain makes is fenced on its claim (`CLAIM_FENCE`), and a fence that
  matches no row raises `LeaseLost` with nothing written;
* a heartbeat never revives an expired lease;
* every ending (finish, failure, interrupt) closes the execution's open messages in the
  same transaction as it deletes the claim: nothing stays `running` forever; an
  interrupt re-arms the doorbell when inputs remain (exactly one successor).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import attrs

from .. import _decisions
from .._backend import Tx
from .._decisions import AcquireVerdict, IterationVerdict
from .._model import INTERRUPTED
from .common import (
    CLAIM_FENCE,
    SESSION_FENCE,
    _claim_row,
    _doorbell_set,
    _fence,
    _has_pending_inputs,
    _lease_lost,
    _paused,
    _require_claim,
    _require_claim_session,
    _reset_attempts,
    _ring,
    _session_fence,
    _take_doorbell,
)
from .inputs import _ensure_session, _insert_input, _known_input, submit, wake
from .transcript import _close_open_messages


@attrs.frozen
class Acquired:
    """The result of the acquire transaction."""

    verdict: AcquireVerdict
    attempt: int = 0
    holder: str | None = None


def acquire(tx: Tx, session_id: str, execution_id: str, owner_id: str, lease_ms: int) -> Acquired:
    """Insert the claim only if no claim row exists, the session is not paused and the
    doorbell is set; take the doorbell."""
    tx.lock_session(session_id)
    session = tx.one("SELECT time_woken, time_paused FROM session WHERE id = ?", (session_id,))
    claim = _claim_row(tx, session_id)
    verdict = _decisions.acquire_verdict(
        doorbell_set=session is not None and session[0] is not None,
        claim_row=claim,
        paused=session is not None and session[1] is not None,
    )
    if verdict is not AcquireVerdict.CLAIM:
        return Acquired(verdict, holder=None if claim is None else claim.owner_id)
    return _insert_claim(tx, session_id, execution_id, owner_id, lease_ms)


def wake_and_acquire(
    tx: Tx, session_id: str, execution_id: str, owner_id: str, lease_ms: int
) -> tuple[None, Acquired]:
    """`wake` and the acquire it rings for, in one transaction.

    When the claim is taken here, the doorbell is rung and taken at once, so it is never
    written: the same durable result with fewer pages per commit.
    """
    tx.lock_session(session_id)
    claim = _claim_row(tx, session_id)
    if claim is not None:
        wake(tx, session_id)
        return None, Acquired(AcquireVerdict.HELD, holder=claim.owner_id)
    if _paused(tx, session_id):
        wake(tx, session_id)  # kept for `resume`
        return None, Acquired(AcquireVerdict.PAUSED)
    _ensure_session(tx, session_id)
    return None, _insert_claim(tx, session_id, execution_id, owner_id, lease_ms)


def submit_and_acquire(
    tx: Tx,
    session_id: str,
    payload: str,
    input_id: str,
    execution_id: str,
    owner_id: str,
    lease_ms: int,
) -> tuple[str, Acquired]:
    """`submit` and the acquire it rings for, in one transaction (see `wake_and_acquire`)."""
    tx.lock_session(session_id)
    claim = _claim_row(tx, session_id)
    if (
        claim is not None
        or _known_input(tx, session_id, input_id, payload)
        or _paused(tx, session_id)
    ):
        stored = submit(tx, session_id, payload, input_id)
        return stored, acquire(tx, session_id, execution_id, owner_id, lease_ms)
    session = _insert_input(tx, session_id, payload, input_id, ring=False)
    return input_id, _insert_claim(tx, session_id, execution_id, owner_id, lease_ms, session)


def _insert_claim(
    tx: Tx,
    session_id: str,
    execution_id: str,
    owner_id: str,
    lease_ms: int,
    session: tuple[int | None, int] | None = None,
) -> Acquired:
    """Insert the claim for a session known to have no claim row; take a set doorbell.

    `session` is the session's (time_woken, wake_attempts) when this transaction already
    read them; `anchor_seq` is the newest message seq, read in the insert itself."""
    if session is None:
        session = tx.one(
            "SELECT time_woken, wake_attempts FROM session WHERE id = ?", (session_id,)
        )
    time_woken, attempts = session
    tx.execute(
        "INSERT INTO session_execution"
        "(id, session_id, owner_id, phase, anchor_seq, time_created, heartbeat_at, expires_at)"
        " VALUES (?, ?, ?, 'running',"
        " (SELECT MAX(seq) FROM session_message WHERE session_id = ?), ?, NULL, ?)",
        (execution_id, session_id, owner_id, session_id, tx.now, tx.now + lease_ms),
    )
    if time_woken is not None:
        _take_doorbell(tx, session_id)
    return Acquired(AcquireVerdict.CLAIM, attempt=int(attempts))


def heartbeat(
    tx: Tx, owner_id: str, execution_ids: Iterable[str], lease_ms: int
) -> dict[str, str | None]:
    """Renew every listed claim in this one transaction; returns execution id -> phase.

    None means the lease is lost: the fence (exact id, owner, live lease) matched nothing,
    so an expired lease is never revived.
    """
    execution_ids = sorted(execution_ids)
    tx.lock_claims(execution_ids)
    phases: dict[str, str | None] = {}
    for execution_id in execution_ids:
        row = tx.one(
            "UPDATE session_execution SET expires_at = :expires, heartbeat_at = :now"
            f" WHERE {CLAIM_FENCE} RETURNING phase",
            {**_fence(tx, execution_id, owner_id), "expires": tx.now + lease_ms},
        )
        phases[execution_id] = None if row is None else str(row[0])
    return phases


def finish_iteration(tx: Tx, session_id: str, execution_id: str, owner_id: str) -> bool:
    """`end_iteration`: True when the claim continues (the doorbell was taken)."""
    return end_iteration(tx, session_id, execution_id, owner_id) is IterationVerdict.CONTINUE


def end_iteration(tx: Tx, session_id: str, execution_id: str, owner_id: str) -> IterationVerdict:
    """After a drain returned: take a set doorbell and continue, or delete the claim.

    Either way, a message the drain left open is finished and its running tools failed
    (`interrupted`): nothing stays `running` forever. Serialised with `wake` by the write
    lock: a wake either committed before this, and is taken here, or finds no claim
    afterwards and leads to a fresh acquisition. A paused session's busy period ends here
    with its doorbell left set (for `resume`); a claim marked cancelling never continues:
    its set doorbell is left for a successor (`_decisions.iteration_verdict`).
    """
    claimed = _require_claim_session(tx, session_id, execution_id, owner_id)
    _close_open_messages(tx, execution_id, INTERRUPTED)
    verdict = _decisions.iteration_verdict(
        doorbell_set=claimed.doorbell, phase=claimed.phase, paused=claimed.paused
    )
    if verdict is IterationVerdict.CONTINUE:
        _take_doorbell(tx, claimed.session_id)
        return verdict
    _delete_claim(tx, execution_id, owner_id)
    if claimed.wake_attempts:
        _reset_attempts(tx, claimed.session_id)
    return verdict


def _delete_claim(tx: Tx, execution_id: str, owner_id: str) -> None:
    deleted = tx.execute(
        f"DELETE FROM session_execution WHERE {CLAIM_FENCE}", _fence(tx, execution_id, owner_id)
    ).rowcount
    if deleted != 1:
        raise _lease_lost(execution_id)


def finish_failed(tx: Tx, session_id: str, execution_id: str, owner_id: str, error: str) -> bool:
    """A drain raised: close its open message as failed, delete the claim, reset attempts.

    Untaken inputs do not re-arm the doorbell (that would loop on a drain that always
    fails); a doorbell already set stays set. Returns whether it is set (one follow-up).
    """
    _require_claim(tx, session_id, execution_id, owner_id)
    _close_open_messages(tx, execution_id, error)
    _delete_claim(tx, execution_id, owner_id)
    _reset_attempts(tx, session_id)
    return _doorbell_set(tx, session_id)


def mark_cancelling(tx: Tx, session_id: str, execution_id: str, owner_id: str) -> None:
    """First step of an interrupt's cleanup: make the cancellation durable (claim fence)."""
    tx.lock_session(session_id)
    updated = tx.execute(
        f"UPDATE session_execution SET phase = 'cancelling' WHERE {SESSION_FENCE.format(t='')}",
        _session_fence(tx, session_id, execution_id, owner_id),
    ).rowcount
    if updated != 1:
        raise _lease_lost(execution_id)


def finish_interrupted(tx: Tx, session_id: str, execution_id: str, owner_id: str) -> bool:
    """Second step of an interrupt's cleanup, one transaction: finish the open message and
    fail its running tools (`interrupted`), delete the claim, re-arm the doorbell if inputs
    remain. Returns whether the doorbell is set afterwards (exactly one successor)."""
    _require_claim(tx, session_id, execution_id, owner_id)
    _close_open_messages(tx, execution_id, INTERRUPTED)
    _delete_claim(tx, execution_id, owner_id)
    _reset_attempts(tx, session_id)
    if _has_pending_inputs(tx, session_id):
        _ring(tx, session_id)
    return _doorbell_set(tx, session_id)


def request_cancel(tx: Tx, session_id: str) -> bool:
    """Interrupt another owner's claim: `phase='cancelling'` fenced on the live running row."""
    tx.lock_session(session_id)
    tx.notify(session_id)
    return (
        tx.execute(
            "UPDATE session_execution SET phase = 'cancelling'"
            " WHERE session_id = ? AND phase = 'running' AND expires_at > ?",
            (session_id, tx.now),
        ).rowcount
        == 1
    )


def cancel_held_claim(tx: Tx, session_id: str) -> bool:
    """An interrupt accepted locally while another owner's claim turned up at acquire: mark
    that claim cancelling even if its lease already expired, so recovery finishes it as
    cancelled instead of resuming it."""
    tx.lock_session(session_id)
    tx.notify(session_id)
    return (
        tx.execute(
            "UPDATE session_execution SET phase = 'cancelling'"
            " WHERE session_id = ? AND phase = 'running'",
            (session_id,),
        ).rowcount
        == 1
    )


def expire_claims(tx: Tx, owner_id: str, execution_ids: Sequence[str]) -> int:
    """Shutdown: keep the claims (phase unchanged) but end their leases now, fenced, and
    mark them handed back: recovery resumes them without counting a resume."""
    execution_ids = sorted(execution_ids)
    tx.lock_claims(execution_ids)
    expired = 0
    for execution_id in execution_ids:
        expired += tx.execute(
            f"UPDATE session_execution SET expires_at = :now, handed_back = 1 WHERE {CLAIM_FENCE}",
            _fence(tx, execution_id, owner_id),
        ).rowcount
    return expired
