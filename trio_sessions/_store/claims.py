"""Claims while held and at their end: heartbeat, finish, interrupt and the shutdown
hand-back (taking a claim is `acquisition`).

Invariants kept here:
* every write a drain makes is fenced on its claim (`CLAIM_FENCE`), and a fence that
  matches no row raises `LeaseLost` with nothing written;
* a heartbeat never revives an expired lease;
* every ending (finish, failure, interrupt) closes the execution's open messages in the
  same transaction as it deletes the claim: nothing stays `running` forever; an
  interrupt re-arms the doorbell when inputs remain (exactly one successor);
* on SQLite a heartbeat renews all its claims in one fenced statement, and a group
  commit's `end_iteration` jobs run set-wise (`sqlite_batched`) under the same fence; a
  job the set-wise read does not settle writes nothing there and runs alone after; one
  alone whose verdict is sure to be `RELEASE` deletes its claim in one fenced statement
  (`_released_at_once`), and any other writes nothing there and is judged as before.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from .. import _decisions
from .._backend import (
    FALLBACK,
    NeedsTransaction,
    Tx,
    autocommit_when_alone,
    caller_yields_next,
    pg_batched,
    reads_stored_bytes,
    reads_stored_bytes_first,
    sqlite_batched,
)
from .._decisions import IterationVerdict
from .._errors import MalformedRecord
from .._model import INTERRUPTED
from .common import (
    CLAIM_FENCE,
    SESSION_FENCE,
    _doorbell_set,
    _fence,
    _has_pending_inputs,
    _lease_lost,
    _require_claim,
    _require_claim_session,
    _reset_attempts,
    _ring,
    _session_fence,
    _take_doorbell,
    unknown_phase,
    wake_attempts_of,
)
from .transcript import OPEN_ASSISTANT, _close_open_messages, maybe_open_data


@autocommit_when_alone
def heartbeat(
    tx: Tx, owner_id: str, execution_ids: Iterable[str], lease_ms: int
) -> dict[str, str | None]:
    """Renew every listed claim in this one transaction; returns execution id -> phase.

    None means the lease is lost: the fence (exact id, owner, live lease) matched nothing,
    so an expired lease is never revived.
    """
    execution_ids = sorted(execution_ids)
    if tx.dialect == "postgres":
        if not execution_ids:
            return {}
        rows = tx.call("ts_heartbeat", owner_id, execution_ids, lease_ms)
        return {str(e): None if phase is None else str(phase) for e, phase in rows}
    tx.lock_claims(execution_ids)
    phases: dict[str, str | None] = dict.fromkeys(execution_ids)
    if not execution_ids:
        return phases
    # One statement for every claim, each row on the claim fence (`CLAIM_FENCE`).
    renewed = tx.execute(
        "UPDATE session_execution SET expires_at = :expires, heartbeat_at = :now"
        " WHERE id IN (SELECT value FROM json_each(:executions)) AND owner_id = :owner"
        " AND expires_at > :now RETURNING id, phase",
        {
            "executions": json.dumps(execution_ids),
            "owner": owner_id,
            "now": tx.now,
            "expires": tx.now + lease_ms,
        },
    ).fetchall()
    for execution_id, phase in renewed:
        phases[str(execution_id)] = str(phase)
    return phases


def _pg_iteration_finished(args: tuple[Any, ...], row: tuple[Any, ...]) -> Any:
    """`ts_finish`'s row for an iteration as `end_iteration` answers; `FALLBACK` when the
    execution left a message open (nothing was written)."""
    verdict, _ = row
    if verdict == "lease_lost":
        raise _lease_lost(args[1])
    if verdict == "open_messages":
        return FALLBACK
    return IterationVerdict(verdict)


def _end_iterations(tx: Tx, rows: Sequence[tuple[Any, ...]]) -> list[Any]:
    """SQLite group commit, set-wise: the batch's `end_iteration` jobs in a few statements.

    One read checks every claim fence and reads each session's doorbell, resume count and
    pause; a running claim whose drain left no message open then continues (its doorbell
    taken) or is deleted, all of them in one statement of each kind. Every other job -
    a fence that fails (`LeaseLost`), an open message, a claim marked cancelling, a paused
    session, a resume count that is no integer, a session named twice - is `FALLBACK`,
    with nothing written for it: it runs on its own (`end_iteration`) after these, under
    the same write lock.
    """
    results: list[Any] = [FALLBACK] * len(rows)
    firsts: dict[str, int] = {}
    for index, (session_id, _, _) in enumerate(rows):
        firsts.setdefault(session_id, index)
    found = tx.execute(
        "SELECT j.key, s.time_woken IS NOT NULL, s.wake_attempts FROM json_each(:rows) j"
        " JOIN session_execution c ON c.id = json_extract(j.value, '$[1]')"
        " AND c.session_id = json_extract(j.value, '$[0]')"
        " AND c.owner_id = json_extract(j.value, '$[2]') AND c.expires_at > :now"
        " JOIN session s ON s.id = c.session_id"
        " WHERE c.phase = 'running' AND s.time_paused IS NULL"
        # Any other resume count is refused alone (`wake_attempts_of`), the claim kept.
        " AND typeof(s.wake_attempts) = 'integer'"
        " AND NOT EXISTS (SELECT 1 FROM session_message m WHERE m.execution_id = c.id"
        f" AND {OPEN_ASSISTANT})",
        {"rows": json.dumps([rows[index] for index in firsts.values()]), "now": tx.now},
    ).fetchall()
    indexes = list(firsts.values())
    continuing: list[str] = []
    released: list[str] = []
    resets: list[str] = []
    for key, doorbell, attempts in found:
        index = indexes[key]
        session_id, execution_id, _ = rows[index]
        verdict = _decisions.iteration_verdict(
            doorbell_set=bool(doorbell), phase="running", paused=False, untaken_inputs=False
        )
        if verdict is IterationVerdict.CONTINUE:
            continuing.append(session_id)
        else:
            released.append(execution_id)
            if attempts:
                resets.append(session_id)
        results[index] = verdict
    if continuing:
        tx.execute(
            "UPDATE session SET time_woken = NULL, wakes = 0"
            " WHERE id IN (SELECT value FROM json_each(?))",
            (json.dumps(continuing),),
        )
    if released:
        # Each fence was read in this transaction, under the only write lock: ids suffice.
        tx.execute(
            "DELETE FROM session_execution WHERE id IN (SELECT value FROM json_each(?))",
            (json.dumps(released),),
        )
    if resets:
        tx.execute(
            "UPDATE session SET wake_attempts = 0 WHERE id IN (SELECT value FROM json_each(?))",
            (json.dumps(resets),),
        )
    return results


@autocommit_when_alone
@caller_yields_next
@reads_stored_bytes_first
@pg_batched("ts_finish_iterations", _pg_iteration_finished)
@sqlite_batched(_end_iterations)
def end_iteration(tx: Tx, session_id: str, execution_id: str, owner_id: str) -> IterationVerdict:
    """After a drain returned: take a set doorbell and continue, or delete the claim.

    Either way, a message the drain left open is finished and its running tools failed
    (`interrupted`): nothing stays `running` forever. One that does not decode (another
    tool's write) cannot be: `MalformedRecord`, nothing written, the claim left for
    recovery to quarantine - as for a claim whose phase is unknown
    (`_refuse_unknown_phase`). Serialised with `wake` by the write lock: a wake either
    committed before this, and is taken here, or finds no claim afterwards and leads to a
    fresh acquisition. A paused session's busy period ends here
    with its doorbell left set (for `resume`); a claim marked cancelling never continues:
    its set doorbell is left for a successor, and rung for the due inputs its drain was not
    given (`_decisions.iteration_verdict`), as an interrupt's cleanup does.
    """
    if tx.dialect == "postgres":
        # Alone, one call in autocommit (read back by execution id after a lost reply),
        # unless it continues: then `ts_finish` refuses it, and it runs in a transaction.
        [row] = tx.call("ts_finish", session_id, execution_id, owner_id, "iteration", tx.autocommit)
        result = _pg_iteration_finished((session_id, execution_id, owner_id), row)
        if result is not FALLBACK:
            return IterationVerdict(result)
    if tx.dialect == "sqlite" and _released_at_once(tx, session_id, execution_id, owner_id):
        return IterationVerdict.RELEASE
    claimed = _require_claim_session(tx, session_id, execution_id, owner_id, OPEN_ASSISTANT)
    _refuse_unknown_phase(execution_id, claimed.phase)
    if claimed.open_messages:
        _close_open_messages(tx, execution_id, INTERRUPTED, malformed_keeps_claim=True)
    cancelling = claimed.phase == "cancelling"
    verdict = _decisions.iteration_verdict(
        doorbell_set=claimed.doorbell,
        phase=claimed.phase,
        paused=claimed.paused,
        untaken_inputs=cancelling and _has_pending_inputs(tx, claimed.session_id),
    )
    if verdict is IterationVerdict.CONTINUE:
        _take_doorbell(tx, claimed.session_id)
        return verdict
    if verdict is IterationVerdict.HAND_OVER and not claimed.doorbell:
        _ring(tx, claimed.session_id)
    _delete_claim(tx, execution_id, owner_id)
    if claimed.wake_attempts:
        _reset_attempts(tx, claimed.session_id)
    return verdict


def _released_at_once(tx: Tx, session_id: str, execution_id: str, owner_id: str) -> bool:
    """SQLite, the common end of a drain call: a running claim under its fence, its drain
    left no message open, its session's doorbell unset, no pause and a whole resume count -
    so the verdict is `RELEASE` - is deleted in one statement, its resume count reset;
    False, with nothing written, for anything else, which the fence read then judges."""
    row = tx.one(
        f"DELETE FROM session_execution WHERE {SESSION_FENCE.format(t='')}"
        " AND phase = 'running'"
        " AND EXISTS (SELECT 1 FROM session s WHERE s.id = :session"
        " AND s.time_woken IS NULL AND s.time_paused IS NULL"
        # Any other resume count, read back only after the DELETE, is left to the fence
        # read, which reads it before any write: text that is not UTF-8 is read again as
        # bytes there (`reads_stored_bytes_first`), to name the session malformed.
        " AND typeof(s.wake_attempts) = 'integer')"
        " AND NOT EXISTS (SELECT 1 FROM session_message"
        f" WHERE execution_id = :execution AND {OPEN_ASSISTANT})"
        " RETURNING (SELECT s.wake_attempts FROM session s WHERE s.id = :session)",
        _session_fence(tx, session_id, execution_id, owner_id),
    )
    if row is None:
        return False
    if wake_attempts_of(session_id, row[0]):  # `MalformedRecord`: undone with the job
        _reset_attempts(tx, session_id)
    return True


def _refuse_unknown_phase(execution_id: str, phase: str) -> None:
    """A drain's own end over a claim whose phase another tool wrote past the CHECK
    (SQLite): `MalformedRecord`, nothing written, the claim kept for recovery to
    quarantine, as recovery would - never continued or released as if running. The
    set-wise end (`_end_iterations`) reads running claims only and leaves this one to the
    row path; PostgreSQL's CHECK keeps any other phase out."""
    unknown = unknown_phase(execution_id, phase)
    if unknown is not None:
        raise unknown


def _pg_finish(tx: Tx, session_id: str, execution_id: str, owner_id: str, kind: str) -> str | None:
    """PostgreSQL: `ts_finish` ends the iteration or busy period in one call, unless the
    execution left a message open (None: nothing was written, the caller's own path
    closes it by the transcript rules). `continue`, or `released` / `released-set` (the
    doorbell is set afterwards)."""
    [(verdict, doorbell)] = tx.call(
        "ts_finish", session_id, execution_id, owner_id, kind, False, idempotent=False
    )
    if verdict == "lease_lost":
        raise _lease_lost(execution_id)
    if verdict == "open_messages":
        return None
    return "released-set" if verdict == "released" and doorbell else str(verdict)


def _delete_claim(tx: Tx, execution_id: str, owner_id: str) -> None:
    deleted = tx.execute(
        f"DELETE FROM session_execution WHERE {CLAIM_FENCE}", _fence(tx, execution_id, owner_id)
    ).rowcount
    if deleted != 1:
        raise _lease_lost(execution_id)


@reads_stored_bytes
def finish_failed(tx: Tx, session_id: str, execution_id: str, owner_id: str, error: str) -> bool:
    """A drain raised: close its open message as failed, delete the claim, reset attempts.
    `MalformedRecord` (nothing written) when an open message does not decode, or the
    claim's phase is unknown - another tool's write: the claim stays for recovery to
    quarantine.

    Untaken inputs do not re-arm the doorbell (that would loop on a drain that always
    fails); a doorbell already set stays set. Returns whether it is set (one follow-up).
    """
    if tx.dialect == "postgres":
        verdict = _pg_finish(tx, session_id, execution_id, owner_id, "failed")
        if verdict is not None:
            return verdict == "released-set"
    claimed = _require_claim_session(tx, session_id, execution_id, owner_id, OPEN_ASSISTANT)
    _refuse_unknown_phase(execution_id, claimed.phase)
    if claimed.open_messages:
        _close_open_messages(tx, execution_id, error, malformed_keeps_claim=True)
    _delete_claim(tx, execution_id, owner_id)
    _reset_attempts(tx, session_id)
    return _doorbell_set(tx, session_id)


@autocommit_when_alone
def mark_cancelling(
    tx: Tx, session_id: str, execution_id: str, owner_id: str, ring: bool = False
) -> None:
    """First step of an interrupt's cleanup: make the cancellation durable (claim fence).
    `ring`: the claim took its doorbell to drain again and no drain call answered it yet -
    ring it again in the same transaction, so that wake goes to a successor whether this
    cleanup's second step runs or recovery finishes the claim (invariant 7)."""
    if ring and tx.autocommit:
        # The mark and the ring land together or not at all: never the mark alone.
        raise NeedsTransaction("a ring shares the mark's transaction")
    if tx.dialect == "postgres":
        if tx.call("ts_mark_cancelling", session_id, execution_id, owner_id) != [("ok",)]:
            raise _lease_lost(execution_id)
    else:
        tx.lock_session(session_id)
        updated = tx.execute(
            f"UPDATE session_execution SET phase = 'cancelling' WHERE {SESSION_FENCE.format(t='')}",
            _session_fence(tx, session_id, execution_id, owner_id),
        ).rowcount
        if updated != 1:
            raise _lease_lost(execution_id)
    if ring:
        _ring(tx, session_id)


@attrs.frozen
class Interrupted:
    """What an interrupt's cleanup did (`finish_interrupted`)."""

    # Whether the doorbell is set afterwards (exactly one successor).
    doorbell: bool
    # The open messages it could not finish (they do not decode) and left as they are:
    # the claim is deleted all the same (DESIGN §4), so the caller tells the operator.
    left_open: tuple[MalformedRecord, ...] = ()


@reads_stored_bytes
def finish_interrupted(tx: Tx, session_id: str, execution_id: str, owner_id: str) -> Interrupted:
    """Second step of an interrupt's cleanup, one transaction: finish the open message and
    fail its running tools (`interrupted`), delete the claim, re-arm the doorbell if inputs
    remain. An open message that does not decode (another tool's write) is left as it is,
    and said in the result."""
    if tx.dialect == "postgres":
        verdict = _pg_finish(tx, session_id, execution_id, owner_id, "interrupted")
        if verdict is not None:
            return Interrupted(verdict == "released-set")
    _require_claim(tx, session_id, execution_id, owner_id)
    left_open = _close_open_messages(tx, execution_id, INTERRUPTED)
    _delete_claim(tx, execution_id, owner_id)
    _reset_attempts(tx, session_id)
    if _has_pending_inputs(tx, session_id):
        _ring(tx, session_id)
    return Interrupted(_doorbell_set(tx, session_id), left_open)


@reads_stored_bytes
def messages_left_open(tx: Tx, execution_id: str) -> tuple[MalformedRecord, ...]:
    """The open assistant messages of an execution whose claim is gone that do not decode
    (none while its claim exists): what an ending that deletes its claim whatever its
    messages hold left open, as `finish_interrupted` says in its result - read back when
    that result was lost (an outcome unknown, the retry finding the claim gone)."""
    if tx.one("SELECT 1 FROM session_execution WHERE id = ?", (execution_id,)) is not None:
        return ()
    rows = tx.execute(
        "SELECT id, data, finished FROM session_message"
        f" WHERE execution_id = ? AND {OPEN_ASSISTANT} ORDER BY seq",
        (execution_id,),
    ).fetchall()
    left_open: list[MalformedRecord] = []
    for message_id, text, finished in rows:
        try:
            maybe_open_data(tx, message_id, text, finished)
        except MalformedRecord as exc:
            left_open.append(exc)
    return tuple(left_open)


# A claim quarantined by recovery (it may still hold its dead owner's live lease): no drain
# runs it, and what becomes of it is the quarantine's own actions' choice - marked
# `cancelling`, a later resume would finish it as cancelled, its malformed message left open
# and no quarantine left to drop.
_NOT_QUARANTINED = (
    "NOT EXISTS (SELECT 1 FROM session_recovery r WHERE r.execution_id = session_execution.id"
    " AND r.recovery_error IS NOT NULL)"
)


# A claim marked cancelling whose lease already ran out is marked handed back as well: no
# drain of it can still run, so - as for a graceful shutdown's hand-back - every runtime's
# change look brings a recovery pass at once (`handed_back_condition`), which finishes it as
# cancelled, instead of the next pass of `recovery_interval`. (`handed_back` also spares a
# resume from being counted: a cancelling claim is never resumed.)
STOPPED_AFTER_EXPIRY = "CASE WHEN expires_at <= {now} THEN 1 ELSE handed_back END"


def request_cancel(tx: Tx, session_id: str) -> bool:
    """Interrupt another owner's claim: `phase='cancelling'` fenced on its running row, not
    quarantined, and its owner signalled. Its lease may have run out (a dead owner's, or one
    a graceful shutdown handed back in a rolling restart): marked (and handed back,
    `STOPPED_AFTER_EXPIRY`), recovery finishes it as cancelled at once instead of resuming
    the work the user stopped. On PostgreSQL one call (`ts_request_cancel`) in a
    transaction: whether a lost reply's call landed cannot be read back (nothing names
    it), so COMMIT's outcome is asked for."""
    if tx.dialect == "postgres":
        [(marked,)] = tx.call("ts_request_cancel", session_id, idempotent=False)
        return bool(marked)
    tx.lock_session(session_id)
    tx.notify(session_id)
    return (
        tx.execute(
            "UPDATE session_execution SET phase = 'cancelling',"
            f" handed_back = {STOPPED_AFTER_EXPIRY.format(now=':now')}"
            f" WHERE session_id = :session AND phase = 'running' AND {_NOT_QUARANTINED}",
            {"session": session_id, "now": tx.now},
        ).rowcount
        == 1
    )


def expire_claims(tx: Tx, owner_id: str, execution_ids: Sequence[str]) -> int:
    """Shutdown: keep the claims (phase unchanged) but end their leases now, fenced, and
    mark them handed back: recovery resumes them without counting a resume."""
    execution_ids = sorted(execution_ids)
    if tx.dialect == "postgres":
        if not execution_ids:
            return 0
        return int(tx.call("ts_expire_claims", owner_id, execution_ids, idempotent=False)[0][0])
    tx.lock_claims(execution_ids)
    expired = 0
    for execution_id in execution_ids:
        expired += tx.execute(
            f"UPDATE session_execution SET expires_at = :now, handed_back = 1 WHERE {CLAIM_FENCE}",
            _fence(tx, execution_id, owner_id),
        ).rowcount
    return expired


def cancel_own_claims(tx: Tx, owner_id: str, claims: Sequence[tuple[str, str, bool]]) -> int:
    """Leave claims whose user interrupt was accepted to recovery, when their own cleanup
    cannot run (the runtime closing, our liveness token lost): `phase='cancelling'` and the
    lease ended now, fenced on owner and execution (live or expired), so recovery finishes
    each at once as cancelled - never resumes work a user stopped (§6.6). `claims`:
    (execution id, session id, ring) - `ring` for a claim that took its doorbell to drain
    again with no drain call answering it yet: that wake is rung again with it (§6.7)."""
    claims = sorted(claims)
    # Sessions first, then claims: every writer's order (a submit that interrupts writes
    # the session row, then the claim), so two never wait for each other.
    tx.lock_sessions(sorted({session_id for _, session_id, _ in claims}))
    tx.lock_claims([execution_id for execution_id, _, _ in claims])
    marked = 0
    for execution_id, session_id, ring in claims:
        # Also a claim already marked (another runtime's interrupt, or this claim's own
        # mark whose reply was lost): its lease ends now, and the wake it took is rung. A
        # retry of this very call rings once more - one more count, the doorbell the same.
        updated = tx.execute(
            "UPDATE session_execution SET phase = 'cancelling',"
            " expires_at = CASE WHEN expires_at > ? THEN ? ELSE expires_at END"
            " WHERE id = ? AND owner_id = ?",
            (tx.now, tx.now, execution_id, owner_id),
        ).rowcount
        if updated:
            marked += 1
            tx.notify(session_id)  # another runtime's recovery finishes it at once
            if ring:
                _ring(tx, session_id)
    return marked


# ---------------------------------------------------------------------------------------------
# PostgreSQL: this family's server-side functions (created by `_schema`'s migrations; see
# `_store.pg_functions` for their conventions)

PG_FUNCTIONS = r"""
-- Renew every listed claim of this owner that is still live; the others are lost (phase
-- NULL): an expired lease is never revived. Row locks in id order, then the clock.
CREATE OR REPLACE FUNCTION ts_heartbeat(p_owner text, p_execs text[], p_lease bigint,
    p_now bigint, p_retry boolean)
RETURNS TABLE(execution_id text, phase text)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_now bigint;
BEGIN
    PERFORM 1 FROM session_execution c WHERE c.id = ANY(p_execs)
        ORDER BY c.id FOR NO KEY UPDATE;
    v_now := ts_now(p_now);
    RETURN QUERY
    WITH renewed AS (
        UPDATE session_execution c SET expires_at = v_now + p_lease, heartbeat_at = v_now
        WHERE c.id = ANY(p_execs) AND c.owner_id = p_owner AND c.expires_at > v_now
        RETURNING c.id, c.phase)
    SELECT e.id, r.phase FROM unnest(p_execs) AS e(id) LEFT JOIN renewed r ON r.id = e.id;
    -- A worker at max_active makes no recovery scan, whose call sweeps cancels' traces
    -- past their ten minutes: its heartbeat does.
    PERFORM ts_forget_cancelled(v_now);
END $$;

-- Shutdown: end these claims' leases now (fenced), handed back, and signal their sessions.
-- Returns how many.
CREATE OR REPLACE FUNCTION ts_expire_claims(p_owner text, p_execs text[], p_now bigint,
    p_retry boolean)
RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_now bigint; v_sessions text[];
BEGIN
    PERFORM 1 FROM session_execution c WHERE c.id = ANY(p_execs)
        ORDER BY c.id FOR NO KEY UPDATE;
    v_now := ts_now(p_now);
    WITH handed AS (
        UPDATE session_execution c SET expires_at = v_now, handed_back = 1
        WHERE c.id = ANY(p_execs) AND c.owner_id = p_owner AND c.expires_at > v_now
        RETURNING c.session_id)
    SELECT COALESCE(array_agg(h.session_id), '{}') INTO v_sessions FROM handed h;
    -- Every runtime that drains takes them over at this signal (its change look finds
    -- them), not at its next recovery pass: one notification, as a batch's.
    IF current_setting('trio_sessions.defer_signals', true) IS DISTINCT FROM 'on' THEN
        PERFORM ts_flush_signals(v_sessions);
    ELSE
        PERFORM ts_signal(s.s) FROM unnest(v_sessions) AS s(s);
    END IF;
    RETURN cardinality(v_sessions);
END $$;

-- The cancellation made durable (claim fence). Verdicts: ok, lease_lost. Idempotent.
CREATE OR REPLACE FUNCTION ts_mark_cancelling(p_session text, p_exec text, p_owner text,
    p_now bigint, p_retry boolean)
RETURNS text
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_session text; v_now bigint;
BEGIN
    SELECT l.session_id, l.now INTO v_session, v_now
        FROM ts_lock_execution(p_session, p_exec, p_now) l;
    UPDATE session_execution SET phase = 'cancelling'
        WHERE id = p_exec AND session_id = p_session AND owner_id = p_owner
        AND expires_at > v_now;
    RETURN CASE WHEN FOUND THEN 'ok' ELSE 'lease_lost' END;
END $$;

-- Interrupt another owner's claim (`request_cancel`): phase cancelling, fenced on its running row,
-- live or expired (then handed back too: STOPPED_AFTER_EXPIRY), not quarantined (_NOT_QUARANTINED),
-- and its owner signalled. Whether it marked one. Not idempotent (a second call finds the row
-- cancelling): called in a transaction, never retried by read-back.
CREATE OR REPLACE FUNCTION ts_request_cancel(p_session text, p_now bigint, p_retry boolean)
RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_now bigint;
BEGIN
    v_now := ts_lock_now(p_session, p_now);
    PERFORM ts_signal(p_session);
    UPDATE session_execution SET phase = 'cancelling', handed_back = {stopped_after_expiry}
        WHERE session_id = p_session AND phase = 'running' AND {not_quarantined};
    RETURN FOUND;
END $$;

-- The end of a busy period or iteration, under the claim fence. p_kind: 'iteration'
-- (verdicts as IterationVerdict: continue takes the doorbell; release, hand_over and pause
-- delete the claim; hand_over rings for due inputs a cancelling claim's drain was not
-- given), 'failed' (released; untaken inputs do not re-arm the doorbell) or 'interrupted'
-- (released; due inputs re-arm it). `doorbell`: whether it is set
-- afterwards. Also lease_lost, or open_messages when the execution left a message open:
-- closing it needs the transcript rules, so the caller takes its own path (nothing was
-- written here).
-- An ending that deletes the claim leaves its execution and verdict on the session row
-- (released_execution, released_verdict): a retry after a lost reply (p_retry) whose claim
-- is gone reads them back instead of answering lease_lost. p_whole (an iteration's end
-- alone, one call in autocommit): a continue is refused (NEEDS_TRANSACTION, nothing
-- written), as a retry could not tell the doorbell it took from one never set.
CREATE OR REPLACE FUNCTION ts_finish(p_session text, p_exec text, p_owner text, p_kind text,
    p_whole boolean, p_now bigint, p_retry boolean, OUT verdict text, OUT doorbell boolean)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_session text; v_now bigint; v_woken bigint; v_phase text; v_paused bigint;
BEGIN
    SELECT l.session_id, l.now INTO v_session, v_now
        FROM ts_lock_execution(p_session, p_exec, p_now) l;
    SELECT s.time_woken, c.phase, s.time_paused INTO v_woken, v_phase, v_paused
        FROM session_execution c JOIN session s ON s.id = c.session_id
        WHERE c.id = p_exec AND c.session_id = p_session AND c.owner_id = p_owner
        AND c.expires_at > v_now;
    IF NOT FOUND THEN
        -- A retry: the lost call ended the claim if it left its mark (a call that wrote
        -- nothing left none, and a continue never ends alone).
        SELECT s.released_verdict, s.time_woken IS NOT NULL INTO verdict, doorbell
            FROM session s WHERE p_retry AND s.id = p_session
            AND s.released_execution = p_exec;
        IF NOT FOUND THEN
            verdict := 'lease_lost';
            doorbell := NULL;
        END IF;
        RETURN;
    END IF;
    -- Maybe open: not marked 1 (the partial index session_message_open), so a mark another
    -- tool broke is read too, and refused by the caller's path.
    IF EXISTS (SELECT 1 FROM session_message m WHERE m.execution_id = p_exec
               AND m.finished <> 1 AND m.role = 'assistant') THEN
        verdict := 'open_messages';
        RETURN;
    END IF;
    IF p_kind = 'iteration' THEN
        -- As _decisions.iteration_verdict: a pause ends the busy period (the doorbell stays
        -- for resume); a claim marked cancelling never continues (a successor takes a set
        -- doorbell: hand_over).
        verdict := CASE WHEN v_paused IS NOT NULL THEN 'pause'
                        WHEN v_phase = 'cancelling' AND v_woken IS NOT NULL THEN 'hand_over'
                        WHEN v_phase = 'cancelling' THEN 'release'
                        WHEN v_woken IS NOT NULL THEN 'continue'
                        ELSE 'release' END;
        IF verdict = 'continue' THEN
            IF p_whole THEN
                PERFORM ts_needs_transaction();
            END IF;
            UPDATE session SET time_woken = NULL, wakes = 0 WHERE id = v_session;
            doorbell := false;
            RETURN;
        END IF;
    ELSE
        verdict := 'released';
    END IF;
    DELETE FROM session_execution WHERE id = p_exec;
    -- Due inputs re-arm the doorbell after an interrupt, and at the iteration end of a claim
    -- marked cancelling with no doorbell set: its drain was given none of them, and the
    -- successor rung for them takes them (hand_over). Only due inputs: the due timer rings
    -- for scheduled ones.
    IF (p_kind = 'interrupted' OR (verdict = 'release' AND v_phase = 'cancelling'))
            AND ts_due_inputs(v_session, v_now) THEN
        PERFORM ts_ring(v_session, v_now);
        v_woken := v_now;
        IF verdict = 'release' THEN
            verdict := 'hand_over';
        END IF;
    END IF;
    UPDATE session SET wake_attempts = 0, released_execution = p_exec,
        released_verdict = verdict WHERE id = v_session;
    doorbell := v_woken IS NOT NULL;
END $$;


-- Group commit, set-wise: one call for a batch's iteration ends (`end_iteration`), as
-- ts_finish(..., 'iteration') answers each. Every session lock first, in the functions'
-- order (ts_lock_key, id), then the clock. The common ends - lease lost, a message left open
-- (nothing written), or a running claim's continue, release or pause - are settled for the
-- whole batch by one statement; a session named twice in the batch (its ends run in
-- order) and a claim marked cancelling (hand over, ring over) go through ts_finish one by
-- one after it, in the lock order.
CREATE OR REPLACE FUNCTION ts_finish_iterations(p_sessions text[], p_execs text[],
    p_owners text[], p_now bigint, p_retry boolean)
RETURNS TABLE(ord bigint, verdict text, doorbell boolean)
LANGUAGE plpgsql VOLATILE
@GENERIC_PLAN@ AS $$
DECLARE
    v_now bigint; v_ords bigint[]; v_verdicts text[]; v_doorbells boolean[]; r record;
BEGIN
    PERFORM ts_lock_all(p_sessions);
    v_now := ts_now(p_now);
    WITH job AS (
        SELECT u.s, u.e, u.o, u.n, count(*) OVER (PARTITION BY u.s) AS copies
        FROM unnest(p_sessions, p_execs, p_owners) WITH ORDINALITY AS u(s, e, o, n)),
    -- The claim fence (exact execution of the session named, this owner, a live lease).
    fact AS MATERIALIZED (
        SELECT j.n, j.s, j.e, c.phase, s.time_woken, s.time_paused,
            c.id IS NOT NULL AND c.session_id = j.s AND c.owner_id = j.o
                AND c.expires_at > v_now AS held,
            EXISTS (SELECT 1 FROM session_message m WHERE m.execution_id = j.e
                    AND m.finished <> 1 AND m.role = 'assistant') AS open
        FROM job j
        LEFT JOIN session_execution c ON c.id = j.e
        LEFT JOIN session s ON s.id = j.s
        WHERE j.copies = 1),
    -- As ts_finish: a pause ends the busy period (its doorbell stays for resume); NULL for
    -- a claim marked cancelling (ts_finish decides it).
    decided AS MATERIALIZED (
        SELECT f.n, f.s, f.e, f.time_woken,
            CASE WHEN NOT f.held THEN 'lease_lost'
                 WHEN f.open THEN 'open_messages'
                 WHEN f.time_paused IS NOT NULL THEN 'pause'
                 WHEN f.phase = 'cancelling' THEN NULL
                 WHEN f.time_woken IS NOT NULL THEN 'continue'
                 ELSE 'release' END AS v
        FROM fact f),
    taken AS (
        UPDATE session s SET time_woken = NULL, wakes = 0
        FROM decided d WHERE d.v = 'continue' AND s.id = d.s),
    released AS (
        DELETE FROM session_execution c USING decided d
        WHERE d.v IN ('release', 'pause') AND c.id = d.e),
    -- Its execution and verdict left on the session row, as ts_finish leaves them.
    reset AS (
        UPDATE session s SET wake_attempts = 0, released_execution = d.e,
            released_verdict = d.v FROM decided d
        WHERE d.v IN ('release', 'pause') AND s.id = d.s)
    SELECT array_agg(d.n), array_agg(d.v),
        array_agg(CASE WHEN d.v = 'continue' THEN false
                       WHEN d.v IN ('release', 'pause') THEN d.time_woken IS NOT NULL END)
        INTO v_ords, v_verdicts, v_doorbells
        FROM decided d WHERE d.v IS NOT NULL;
    RETURN QUERY SELECT * FROM unnest(v_ords, v_verdicts, v_doorbells);
    FOR r IN SELECT u.s, u.e, u.o, u.n
             FROM unnest(p_sessions, p_execs, p_owners) WITH ORDINALITY AS u(s, e, o, n)
             WHERE NOT u.n = ANY(COALESCE(v_ords, '{}'))
             ORDER BY ts_lock_key(u.s), u.s, u.n LOOP
        SELECT r.n, f.verdict, f.doorbell INTO ord, verdict, doorbell
            FROM ts_finish(r.s, r.e, r.o, 'iteration', false, p_now, p_retry) f;
        RETURN NEXT;
    END LOOP;
END $$;
""".replace("{not_quarantined}", _NOT_QUARANTINED).replace(
    "{stopped_after_expiry}", STOPPED_AFTER_EXPIRY.format(now="v_now")
)
