"""The fenced store operations, written once for every backend (synchronous).

Each operation is a function `op(tx, ...)` that a backend runs inside one write transaction
(`_backend.Tx`; several operations may share one transaction: group commit). SQL here is the
subset SQLite and PostgreSQL agree on; where they differ, `tx` offers a named hook
(`lock_session`, `lock_claims`, `not_in`, `savepoint`) and nothing else here knows the
dialect.

Serialisation: every operation that reads and then writes a session's rows first takes
`tx.lock_session(session_id)` - a no-op on SQLite (its write transaction holds the only
write lock), a lock held to COMMIT on PostgreSQL, whose READ COMMITTED would otherwise let a
takeover commit between a fence read and the write behind it. Operations keyed by an
execution look up its session (which an execution never changes), lock it, then check the
fence under the lock. `tx.now` is read after the operation's locks, so a fence never
compares against a time from before a lock wait.

Invariants kept here:
* the acquire path inserts a claim only when no `session_execution` row exists for the
  session (never an overwrite, live or expired, own or foreign) and the doorbell is set;
* every write a drain makes is fenced on its claim - the *claim fence* (`CLAIM_FENCE`) -
  and a fence that matches no row raises `LeaseLost` with nothing written;
* a heartbeat never revives an expired lease; recovery replaces a claim only fenced on the
  exact old execution id still being expired (the *recovery fence*);
* an input is either pending in `session_input` or a user message, never both, never none.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs

from . import _codec, _decisions, _transcript
from ._backend import Tx
from ._decisions import AcquireVerdict, ClaimRow, RecoveryDecision, RecoveryFacts
from ._errors import InputConflict, LeaseLost, MalformedRecord
from ._model import (
    BUDGET_EXHAUSTED,
    INTERRUPTED,
    OWNER_LOST,
    AssistantData,
    Input,
    Message,
)

# The claim fence: the exact execution, held by this owner, on a live lease. Every write a
# drain makes carries it - in the WHERE clause of the write, or checked by `_require_claim`
# under the session lock before the writes that follow.
CLAIM_FENCE = "id = :execution AND owner_id = :owner AND expires_at > :now"
# The recovery fence: the exact old execution, still expired.
RECOVERY_FENCE = "id = :execution AND expires_at <= :now"


def _fence(tx: Tx, execution_id: str, owner_id: str | None = None) -> dict[str, Any]:
    return {"execution": execution_id, "owner": owner_id, "now": tx.now}


def _lease_lost(execution_id: str) -> LeaseLost:
    return LeaseLost(f"execution {execution_id!r} no longer holds a live claim")


def _no_longer_expired(execution_id: str) -> LeaseLost:
    return LeaseLost(f"execution {execution_id!r} is no longer an expired claim")


def new_id() -> str:
    return uuid.uuid4().hex


# ---------------------------------------------------------------------------------------------
# Fences and small reads


def _claim_row(tx: Tx, session_id: str) -> ClaimRow | None:
    row = tx.one(
        "SELECT id, owner_id, phase, expires_at FROM session_execution WHERE session_id = ?",
        (session_id,),
    )
    return None if row is None else ClaimRow(*row)


def _lock_execution(tx: Tx, execution_id: str) -> str | None:
    """Take the session lock of an execution's session; its session id, or None when no
    claim row carries this execution id (an execution never changes session)."""
    row = tx.one("SELECT session_id FROM session_execution WHERE id = ?", (execution_id,))
    if row is None:
        return None
    tx.lock_session(str(row[0]))
    return str(row[0])


def _require_claim(tx: Tx, execution_id: str, owner_id: str) -> str:
    """The claim fence for writes to other tables; returns the claim's session id.

    Checked under the session lock, held to COMMIT, so nobody can move the claim before the
    writes that follow commit.
    """
    session_id = _lock_execution(tx, execution_id)
    if session_id is None or (
        tx.one(
            f"SELECT 1 FROM session_execution WHERE {CLAIM_FENCE}",
            _fence(tx, execution_id, owner_id),
        )
        is None
    ):
        raise _lease_lost(execution_id)
    return session_id


def _newest_seq(tx: Tx, session_id: str) -> int | None:
    row = tx.one("SELECT MAX(seq) FROM session_message WHERE session_id = ?", (session_id,))
    return None if row[0] is None else int(row[0])


def _next_message_seq(tx: Tx, session_id: str) -> int:
    return (_newest_seq(tx, session_id) or 0) + 1


def _has_pending_inputs(tx: Tx, session_id: str) -> bool:
    return (
        tx.one("SELECT 1 FROM session_input WHERE session_id = ? LIMIT 1", (session_id,))
        is not None
    )


def _doorbell_set(tx: Tx, session_id: str) -> bool:
    row = tx.one("SELECT time_woken FROM session WHERE id = ?", (session_id,))
    return row is not None and row[0] is not None


def _ring(tx: Tx, session_id: str) -> None:
    tx.notify(session_id)
    tx.execute(
        "UPDATE session SET time_woken = COALESCE(time_woken, ?), wakes = wakes + 1 WHERE id = ?",
        (tx.now, session_id),
    )


def _take_doorbell(tx: Tx, session_id: str) -> None:
    tx.execute("UPDATE session SET time_woken = NULL, wakes = 0 WHERE id = ?", (session_id,))


def _reset_attempts(tx: Tx, session_id: str) -> None:
    # Conditional, so the common case (already 0) dirties no page.
    tx.execute(
        "UPDATE session SET wake_attempts = 0 WHERE id = ? AND wake_attempts != 0", (session_id,)
    )


# ---------------------------------------------------------------------------------------------
# Wake and submit


def wake(tx: Tx, session_id: str) -> None:
    """Durable doorbell: create the session if absent, set `time_woken` (if unset), count it."""
    tx.lock_session(session_id)
    tx.notify(session_id)
    tx.execute(
        "INSERT INTO session(id, time_created, time_woken, wakes) VALUES (?, ?, ?, 1)"
        " ON CONFLICT(id) DO UPDATE SET time_woken = COALESCE(session.time_woken, ?),"
        " wakes = session.wakes + 1",
        (session_id, tx.now, tx.now, tx.now),
    )


def submit(tx: Tx, session_id: str, payload: str, input_id: str) -> str:
    """Admit an input and ring the doorbell, idempotently by `input_id`.

    The same id and payload for the same session returns the stored id and writes nothing,
    also after the input was taken; the same id for another session, or with another
    payload, raises `InputConflict`.
    """
    tx.lock_session(session_id)
    if not _known_input(tx, session_id, input_id, payload):
        _insert_input(tx, session_id, payload, input_id, ring=True)
    return input_id


def _known_input(tx: Tx, session_id: str, input_id: str, payload: str) -> bool:
    """Whether the input id is stored (pending, taken or set aside); `InputConflict` for
    another session or another payload (compared as JSON values, not as text)."""
    known = tx.one(
        "SELECT session_id, payload FROM session_input WHERE id = ?"
        " UNION ALL SELECT session_id, data FROM session_message WHERE input_id = ?"
        " UNION ALL SELECT session_id, payload FROM session_input_rejected WHERE id = ?"
        " LIMIT 1",
        (input_id, input_id, input_id),
    )
    if known is None:
        return False
    if known[0] != session_id:
        raise InputConflict(
            f"input id {input_id!r} belongs to session {known[0]!r}, not {session_id!r}"
        )
    if known[1] != payload and _canonical(known[1]) != _canonical(payload):
        raise InputConflict(
            f"input id {input_id!r} of session {session_id!r} was stored with another payload"
        )
    return True


def _canonical(text: str) -> str | None:
    """One spelling per JSON value (key order and spacing ignored; 1 and 1.0 differ)."""
    try:
        return json.dumps(_codec.loads(text), sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError):
        return None  # malformed: equal to nothing


def _insert_input(tx: Tx, session_id: str, payload: str, input_id: str, *, ring: bool) -> None:
    """Insert a pending input; `ring=False` when a claim inserted in this same transaction
    takes the wake at once (so the doorbell is never written)."""
    doorbell = tx.now if ring else None
    if ring:
        tx.notify(session_id)
    row = tx.one(
        "INSERT INTO session(id, time_created, time_woken, wakes, input_seq)"
        " VALUES (?, ?, ?, ?, 1)"
        " ON CONFLICT(id) DO UPDATE SET time_woken = COALESCE(session.time_woken, ?),"
        " wakes = session.wakes + ?, input_seq = session.input_seq + 1"
        " RETURNING input_seq",
        (session_id, tx.now, doorbell, int(ring), doorbell, int(ring)),
    )
    tx.execute(
        "INSERT INTO session_input(id, session_id, seq, payload, time_created)"
        " VALUES (?, ?, ?, ?, ?)",
        (input_id, session_id, row[0], payload, tx.now),
    )


# ---------------------------------------------------------------------------------------------
# Acquire, heartbeat, finish


@attrs.frozen
class Acquired:
    """The result of the acquire transaction."""

    verdict: AcquireVerdict
    attempt: int = 0
    holder: str | None = None


def acquire(tx: Tx, session_id: str, execution_id: str, owner_id: str, lease_ms: int) -> Acquired:
    """Insert the claim only if no claim row exists and the doorbell is set; take the doorbell."""
    tx.lock_session(session_id)
    session = tx.one("SELECT time_woken FROM session WHERE id = ?", (session_id,))
    claim = _claim_row(tx, session_id)
    verdict = _decisions.acquire_verdict(
        doorbell_set=session is not None and session[0] is not None, claim_row=claim
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
    if claim is not None or _known_input(tx, session_id, input_id, payload):
        stored = submit(tx, session_id, payload, input_id)
        return stored, acquire(tx, session_id, execution_id, owner_id, lease_ms)
    _insert_input(tx, session_id, payload, input_id, ring=False)
    return input_id, _insert_claim(tx, session_id, execution_id, owner_id, lease_ms)


def _ensure_session(tx: Tx, session_id: str) -> None:
    tx.execute(
        "INSERT INTO session(id, time_created) VALUES (?, ?) ON CONFLICT(id) DO NOTHING",
        (session_id, tx.now),
    )


def _insert_claim(
    tx: Tx, session_id: str, execution_id: str, owner_id: str, lease_ms: int
) -> Acquired:
    """Insert the claim for a session known to have no claim row; take a set doorbell."""
    row = tx.one("SELECT time_woken, wake_attempts FROM session WHERE id = ?", (session_id,))
    tx.execute(
        "INSERT INTO session_execution"
        "(id, session_id, owner_id, phase, anchor_seq, time_created, heartbeat_at, expires_at)"
        " VALUES (?, ?, ?, 'running', ?, ?, NULL, ?)",
        (
            execution_id,
            session_id,
            owner_id,
            _newest_seq(tx, session_id),
            tx.now,
            tx.now + lease_ms,
        ),
    )
    if row[0] is not None:
        _take_doorbell(tx, session_id)
    return Acquired(AcquireVerdict.CLAIM, attempt=int(row[1]))


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


def finish_iteration(tx: Tx, execution_id: str, owner_id: str) -> bool:
    """After a drain returned: take a set doorbell and continue (True), or release (False).

    Either way, a message the drain left open is finished and its running tools failed
    (`interrupted`): nothing stays `running` forever. Serialised with `wake` by the write
    lock: a wake either committed before this, and is taken here, or finds no claim
    afterwards and leads to a fresh acquisition.
    """
    session_id = _require_claim(tx, execution_id, owner_id)
    _close_open_messages(tx, execution_id, INTERRUPTED)
    if _doorbell_set(tx, session_id):
        _take_doorbell(tx, session_id)
        return True
    _delete_claim(tx, execution_id, owner_id)
    _reset_attempts(tx, session_id)
    return False


def _delete_claim(tx: Tx, execution_id: str, owner_id: str) -> None:
    deleted = tx.execute(
        f"DELETE FROM session_execution WHERE {CLAIM_FENCE}", _fence(tx, execution_id, owner_id)
    ).rowcount
    if deleted != 1:
        raise _lease_lost(execution_id)


def finish_failed(tx: Tx, execution_id: str, owner_id: str, error: str) -> bool:
    """A drain raised: close its open message as failed, delete the claim, reset attempts.

    Untaken inputs do not re-arm the doorbell (that would loop on a drain that always
    fails); a doorbell already set stays set. Returns whether it is set (one follow-up).
    """
    session_id = _require_claim(tx, execution_id, owner_id)
    _close_open_messages(tx, execution_id, error)
    _delete_claim(tx, execution_id, owner_id)
    _reset_attempts(tx, session_id)
    return _doorbell_set(tx, session_id)


def mark_cancelling(tx: Tx, execution_id: str, owner_id: str) -> None:
    """First step of an interrupt's cleanup: make the cancellation durable (claim fence)."""
    _lock_execution(tx, execution_id)
    updated = tx.execute(
        f"UPDATE session_execution SET phase = 'cancelling' WHERE {CLAIM_FENCE}",
        _fence(tx, execution_id, owner_id),
    ).rowcount
    if updated != 1:
        raise _lease_lost(execution_id)


def finish_interrupted(tx: Tx, execution_id: str, owner_id: str) -> bool:
    """Second step of an interrupt's cleanup, one transaction: finish the open message and
    fail its running tools (`interrupted`), delete the claim, re-arm the doorbell if inputs
    remain. Returns whether the doorbell is set afterwards (exactly one successor)."""
    session_id = _require_claim(tx, execution_id, owner_id)
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


# ---------------------------------------------------------------------------------------------
# Inputs and transcript


def take_inputs(tx: Tx, execution_id: str, owner_id: str) -> list[Input]:
    """Consume pending inputs in seq order, appending each as a user message (claim fence).

    An input whose payload does not decode to a JSON object never blocks the ones behind
    it: it moves to `session_input_rejected` (raw text and reason kept for the operator).
    """
    session_id = _require_claim(tx, execution_id, owner_id)
    tx.notify(session_id)
    rows = tx.execute(
        "SELECT id, seq, payload FROM session_input WHERE session_id = ? ORDER BY seq",
        (session_id,),
    ).fetchall()
    taken = []
    seq = _next_message_seq(tx, session_id)
    for input_id, input_seq, payload in rows:
        try:
            decoded = _codec.decode_object(payload, table="session_input", key=input_id)
        except MalformedRecord as exc:
            tx.execute(
                "INSERT INTO session_input_rejected(id, session_id, seq, payload, reason,"
                " time_created) VALUES (?, ?, ?, ?, ?, ?)",
                (input_id, session_id, input_seq, payload, str(exc), tx.now),
            )
            continue
        taken.append(Input(input_id, decoded))
        tx.execute(
            "INSERT INTO session_message(id, session_id, execution_id, input_id, role, seq, data,"
            " time_created, time_updated) VALUES (?, ?, ?, ?, 'user', ?, ?, ?, ?)",
            (new_id(), session_id, execution_id, input_id, seq, payload, tx.now, tx.now),
        )
        seq += 1
    tx.execute("DELETE FROM session_input WHERE session_id = ?", (session_id,))
    return taken


def begin_assistant(tx: Tx, execution_id: str, owner_id: str, message_id: str) -> int:
    """Start an empty, unfinished assistant message; returns its seq."""
    session_id = _require_claim(tx, execution_id, owner_id)
    seq = _next_message_seq(tx, session_id)
    tx.execute(
        "INSERT INTO session_message(id, session_id, execution_id, role, seq, data,"
        " time_created, time_updated) VALUES (?, ?, ?, 'assistant', ?, ?, ?, ?)",
        (
            message_id,
            session_id,
            execution_id,
            seq,
            _codec.encode_assistant(_transcript.EMPTY),
            tx.now,
            tx.now,
        ),
    )
    tx.notify(session_id)
    return seq


def update_assistant(
    tx: Tx,
    execution_id: str,
    owner_id: str,
    message_id: str,
    transition: Callable[[AssistantData], AssistantData],
) -> tuple[AssistantData, int]:
    """Read-modify-write of one assistant message under the claim fence; returns the new
    data and its version (for watchers, without another round trip).

    The transition runs on the durable row, so the settlement state machine checks what is
    stored, not what a writer remembers.
    """
    session_id = _require_claim(tx, execution_id, owner_id)
    row = tx.one(
        "SELECT data FROM session_message WHERE id = ? AND execution_id = ?",
        (message_id, execution_id),
    )
    if row is None:
        raise LeaseLost(f"message {message_id!r} is not owned by execution {execution_id!r}")
    data = transition(_codec.decode_assistant(row[0], key=message_id))
    version = _write_assistant(tx, message_id, data)
    tx.notify(session_id)
    return data, version


def _write_assistant(tx: Tx, message_id: str, data: AssistantData) -> int:
    """Store new data; every change bumps `version`, which orders watchers' snapshots."""
    row = tx.one(
        "UPDATE session_message SET data = ?, time_updated = ?, version = version + 1"
        " WHERE id = ? RETURNING version",
        (_codec.encode_assistant(data), tx.now, message_id),
    )
    return int(row[0])


def _close_open_messages(tx: Tx, execution_id: str, reason: str) -> None:
    """Finish every open assistant message of an execution as interrupted/failed.

    A row that does not decode is left as it is: recovery quarantines such rows, and
    rewriting it would destroy what an operator needs to see.
    """
    rows = tx.execute(
        "SELECT id, data FROM session_message WHERE execution_id = ? AND role = 'assistant'",
        (execution_id,),
    ).fetchall()
    for message_id, text in rows:
        try:
            data = _codec.decode_assistant(text, key=message_id)
        except MalformedRecord:
            continue
        if not data.finished:
            _write_assistant(tx, message_id, _transcript.interrupt(data, reason))


def read_transcript(tx: Tx, session_id: str) -> list[Message]:
    rows = tx.execute(
        "SELECT id, role, seq, data, execution_id, input_id FROM session_message"
        " WHERE session_id = ? ORDER BY seq",
        (session_id,),
    ).fetchall()
    return [_decode_message(session_id, *row) for row in rows]


def _decode_message(
    session_id: str,
    message_id: str,
    role: str,
    seq: int,
    data: str,
    execution_id: str | None,
    input_id: str | None,
) -> Message:
    decoded: Any
    if role == "assistant":
        decoded = _codec.decode_assistant(data, key=message_id)
    else:
        decoded = _codec.decode_object(data, table="session_message", key=message_id)
    return Message(message_id, session_id, role, seq, decoded, execution_id, input_id)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# Recovery


@attrs.frozen
class Candidate:
    """A recovery candidate: an expired claim (`execution_id` set) or an unclaimed doorbell."""

    session_id: str
    execution_id: str | None


def recovery_candidates(
    tx: Tx, owner_id: str, limit: int, local_sessions: Sequence[str]
) -> list[Candidate]:
    """The oldest `limit` candidates: expired claims by `expires_at`, then unclaimed doorbells
    by `time_woken`. Quarantined executions, executions under another owner's live recovery
    lease and sessions held locally are excluded here, so they never use up the budget."""
    not_local, local = tx.not_in("e.session_id", local_sessions)
    expired = tx.execute(
        "SELECT e.session_id, e.id FROM session_execution e"
        f" WHERE e.expires_at <= :now AND {not_local}"
        " AND NOT EXISTS (SELECT 1 FROM session_recovery r WHERE r.execution_id = e.id"
        "   AND (r.recovery_error IS NOT NULL OR (r.owner_id != :me AND r.expires_at > :now)))"
        " ORDER BY e.expires_at, e.id LIMIT :limit",
        {"now": tx.now, "excluded": local, "me": owner_id, "limit": limit},
    ).fetchall()
    candidates = [Candidate(session_id, execution_id) for session_id, execution_id in expired]
    if len(candidates) < limit:
        doorbells = _unclaimed_doorbells(tx, local_sessions, limit - len(candidates))
        candidates += [Candidate(session_id, None) for session_id in doorbells]
    return candidates


def _unclaimed_doorbells(tx: Tx, local_sessions: Sequence[str], limit: int) -> list[str]:
    """Sessions with a set doorbell and no claim row, oldest wake first, except those held
    locally (a crash between wake and acquire, or a wake from another process)."""
    not_local, local = tx.not_in("s.id", local_sessions)
    rows = tx.execute(
        "SELECT s.id FROM session s WHERE s.time_woken IS NOT NULL"
        " AND NOT EXISTS (SELECT 1 FROM session_execution e WHERE e.session_id = s.id)"
        f" AND {not_local} ORDER BY s.time_woken, s.id LIMIT :limit",
        {"excluded": local, "limit": limit},
    ).fetchall()
    return [str(row[0]) for row in rows]


def take_recovery_leases(
    tx: Tx, owner_id: str, lease_ms: int, candidates: Sequence[Candidate]
) -> list[Candidate]:
    """Take a recovery lease on each expired claim: only if absent, expired or ours, and never
    on a quarantined row. Returns the candidates whose lease we now hold."""
    taken = []
    for candidate in candidates:
        row = tx.one(
            "INSERT INTO session_recovery(execution_id, session_id, owner_id, expires_at,"
            " time_created) VALUES (:e, :s, :me, :exp, :now)"
            " ON CONFLICT(execution_id) DO UPDATE SET owner_id = :me, expires_at = :exp"
            " WHERE session_recovery.recovery_error IS NULL"
            " AND (session_recovery.owner_id = :me OR session_recovery.expires_at <= :now)"
            " RETURNING execution_id",
            {
                "e": candidate.execution_id,
                "s": candidate.session_id,
                "me": owner_id,
                "exp": tx.now + lease_ms,
                "now": tx.now,
            },
        )
        if row is not None:
            taken.append(candidate)
    return taken


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
    anchor_seq = row[4] if ours else None
    superseded = (
        tx.one(
            "SELECT 1 FROM session_message WHERE session_id = :session AND role = 'assistant'"
            " AND (execution_id IS NULL OR execution_id != :execution) AND seq > :anchor"
            " LIMIT 1",
            # Any other execution's message supersedes a claim taken before any message.
            {"session": session_id, "execution": execution_id, "anchor": anchor_seq or 0},
        )
        is not None
    )
    newest = tx.one(
        "SELECT id, data FROM session_message WHERE execution_id = ? AND role = 'assistant'"
        " ORDER BY seq DESC LIMIT 1",
        (execution_id,),
    )
    malformed_reason = None if newest is None else _malformed_reason(newest[0], newest[1])
    attempts = tx.one("SELECT wake_attempts FROM session WHERE id = ?", (session_id,))
    facts = RecoveryFacts(
        claim=claim,
        superseded=superseded,
        newest_assistant_malformed=malformed_reason is not None,
        wake_attempts=0 if attempts is None else int(attempts[0]),
        handed_back=ours and bool(row[5]),
    )
    return facts, malformed_reason


def _malformed_reason(message_id: str, text: str) -> str | None:
    try:
        _codec.decode_assistant(text, key=message_id)
    except MalformedRecord as exc:
        return str(exc)
    return None


@attrs.frozen
class Recovered:
    """What applying recovery to one expired claim did."""

    decision: RecoveryDecision
    fence_lost: bool = False
    new_execution_id: str | None = None
    attempt: int = 0
    reason: str | None = None  # why a quarantined row does not decode


def apply_recovery(
    tx: Tx,
    owner_id: str,
    candidate: Candidate,
    new_execution_id: str,
    lease_ms: int,
    max_resumes: int,
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
        RecoveryDecision.EXHAUSTED,
    ):
        _end_expired_claim(tx, candidate, decision)
    _delete_recovery_row(tx, execution_id, owner_id)
    return Recovered(decision)


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
    # Only our own recovery row: another owner's lease or quarantine is not ours to touch.
    tx.execute(
        "DELETE FROM session_recovery WHERE execution_id = ? AND owner_id = ?"
        " AND recovery_error IS NULL",
        (execution_id, owner_id),
    )


def _delete_expired_claim(tx: Tx, execution_id: str) -> None:
    deleted = tx.execute(
        f"DELETE FROM session_execution WHERE {RECOVERY_FENCE}", _fence(tx, execution_id)
    ).rowcount
    if deleted != 1:
        raise _no_longer_expired(execution_id)


def _end_expired_claim(tx: Tx, candidate: Candidate, decision: RecoveryDecision) -> None:
    execution_id = candidate.execution_id
    assert execution_id is not None
    reason = {
        RecoveryDecision.FINISH_CANCELLED: INTERRUPTED,
        RecoveryDecision.DROP_SUPERSEDED: OWNER_LOST,
        RecoveryDecision.EXHAUSTED: BUDGET_EXHAUSTED,
    }[decision]
    _close_open_messages(tx, execution_id, reason)
    _delete_expired_claim(tx, execution_id)
    if decision is RecoveryDecision.EXHAUSTED:
        _reset_attempts(tx, candidate.session_id)
    if _decisions.rearms_doorbell(decision) and _has_pending_inputs(tx, candidate.session_id):
        _ring(tx, candidate.session_id)


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
    replaced = tx.execute(
        "UPDATE session_execution SET id = :new, owner_id = :me, phase = 'running',"
        " anchor_seq = :anchor, time_created = :now, heartbeat_at = NULL, expires_at = :expires,"
        f" handed_back = 0 WHERE {RECOVERY_FENCE}",
        {
            **_fence(tx, old),
            "new": new_execution_id,
            "me": owner_id,
            "anchor": _newest_seq(tx, candidate.session_id),
            "expires": tx.now + lease_ms,
        },
    ).rowcount
    if replaced != 1:
        raise _no_longer_expired(old)
    # A claim handed back by a graceful shutdown resumes without counting: rolling
    # restarts are not a crash loop.
    counted = 0 if facts.handed_back else 1
    tx.execute(
        "UPDATE session SET wake_attempts = wake_attempts + ?, time_woken = NULL, wakes = 0"
        " WHERE id = ?",
        (counted, candidate.session_id),
    )
    _delete_recovery_row(tx, old, owner_id)
    return Recovered(
        RecoveryDecision.RESUME,
        new_execution_id=new_execution_id,
        attempt=facts.wake_attempts + counted,
    )


def quarantined(tx: Tx) -> list[dict[str, Any]]:
    rows = tx.execute(
        "SELECT execution_id, session_id, owner_id, recovery_error, time_quarantined"
        " FROM session_recovery WHERE recovery_error IS NOT NULL ORDER BY time_quarantined"
    ).fetchall()
    keys = ("execution_id", "session_id", "recovery_owner", "recovery_error", "time_quarantined")
    return [dict(zip(keys, row, strict=True)) for row in rows]


def lift_quarantine(tx: Tx, execution_id: str, owner_id: str, lease_ms: int) -> Candidate:
    """Clear a quarantine and take the recovery lease on it at once (for a resume)."""
    row = _quarantined_row(tx, execution_id)
    tx.execute(
        "UPDATE session_recovery SET recovery_error = NULL, time_quarantined = NULL,"
        " owner_id = ?, expires_at = ? WHERE execution_id = ?",
        (owner_id, tx.now + lease_ms, execution_id),
    )
    return Candidate(row[0], execution_id)


def drop_quarantined(tx: Tx, execution_id: str) -> None:
    """Operator drop: set the execution's messages that do not decode aside (raw text kept
    in `session_message_rejected`), so the transcript reads again; finish the rest of its
    open transcript as owner-lost, delete the claim, reset attempts, re-arm the doorbell if
    inputs remain."""
    session_id = _quarantined_row(tx, execution_id)[0]
    _set_aside_malformed_messages(tx, session_id, execution_id)
    _close_open_messages(tx, execution_id, OWNER_LOST)
    tx.execute("DELETE FROM session_execution WHERE id = ?", (execution_id,))
    _reset_attempts(tx, session_id)
    if _has_pending_inputs(tx, session_id):
        _ring(tx, session_id)
    tx.execute("DELETE FROM session_recovery WHERE execution_id = ?", (execution_id,))


def _set_aside_malformed_messages(tx: Tx, session_id: str, execution_id: str) -> None:
    rows = tx.execute(
        "SELECT id, role, seq, data, input_id FROM session_message WHERE execution_id = ?",
        (execution_id,),
    ).fetchall()
    for message_id, role, seq, data, input_id in rows:
        try:
            _decode_message(session_id, message_id, role, seq, data, execution_id, input_id)
        except MalformedRecord as exc:
            tx.execute(
                "INSERT INTO session_message_rejected(id, session_id, execution_id, seq, data,"
                " reason, time_created) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (message_id, session_id, execution_id, seq, data, str(exc), tx.now),
            )
            tx.execute("DELETE FROM session_message WHERE id = ?", (message_id,))


def rejected_inputs(tx: Tx, session_id: str | None) -> list[dict[str, Any]]:
    """Inputs set aside by `take_inputs` because they do not decode, oldest first."""
    rows = tx.execute(
        "SELECT id, session_id, seq, payload, reason, time_created FROM session_input_rejected"
        " WHERE CAST(:session AS TEXT) IS NULL OR session_id = :session"
        " ORDER BY time_created, session_id, seq",
        {"session": session_id},
    ).fetchall()
    keys = ("id", "session_id", "seq", "payload", "reason", "time_created")
    return [dict(zip(keys, row, strict=True)) for row in rows]


def drop_rejected_input(tx: Tx, input_id: str) -> str:
    """Operator drop of a set-aside input; returns its session id, `ValueError` if none."""
    row = tx.one("SELECT session_id FROM session_input_rejected WHERE id = ?", (input_id,))
    if row is None:
        raise ValueError(f"input {input_id!r} is not a rejected input")
    tx.lock_session(str(row[0]))
    tx.execute("DELETE FROM session_input_rejected WHERE id = ?", (input_id,))
    return str(row[0])


def _quarantined_row(tx: Tx, execution_id: str) -> Any:
    """The quarantined row's (session id,), under its session lock; `ValueError` if none."""
    row = tx.one(
        "SELECT session_id FROM session_recovery WHERE execution_id = ?"
        " AND recovery_error IS NOT NULL",
        (execution_id,),
    )
    if row is None:
        raise ValueError(f"execution {execution_id!r} is not quarantined")
    tx.lock_session(str(row[0]))
    return row


def apply_recovery_batch(
    tx: Tx,
    owner_id: str,
    items: list[tuple[Candidate, str]],
    lease_ms: int,
    max_resumes: int,
) -> list[Recovered]:
    """`apply_recovery` for each (candidate, new execution id), each in its own savepoint:
    one row's failure never undoes another's recovery."""
    results = []
    for candidate, new_execution_id in items:
        try:
            with tx.savepoint():
                result = apply_recovery(
                    tx, owner_id, candidate, new_execution_id, lease_ms, max_resumes
                )
        except LeaseLost:
            result = Recovered(RecoveryDecision.GONE, fence_lost=True)
        except (MalformedRecord, ValueError, TypeError, RecursionError) as exc:
            # A row recovery cannot process is poison: quarantine it (exact fence) rather
            # than fail the pass, so it never starves the rows behind it.
            result = quarantine(tx, owner_id, candidate, f"recovery failed: {exc!r}")
        results.append(result)
    return results


# ---------------------------------------------------------------------------------------------
# Changes made by other processes (read-only)


# (session id, message id, seq, the message or why it does not decode, version)
Snapshot = tuple[str, str, int, Message | MalformedRecord, int]


@attrs.frozen
class Changes:
    """What another process (or this one) may have changed since the last look."""

    doorbells: list[str]  # unclaimed sessions with a set doorbell, oldest first
    cancelling: list[str]  # execution ids of our claims another process marked cancelling
    messages: list[Snapshot]  # of watched sessions only


def changes(
    tx: Tx,
    owner_id: str,
    local_sessions: Sequence[str],
    doorbell_limit: int,
    watched: dict[str, dict[str, int]],
) -> Changes:
    """Read what the change signal points at: doorbells this runtime may take, cancellations
    of its claims, and messages of watched sessions whose version is newer than the one
    given (`watched[session][message_id]`; absent = never seen)."""
    doorbells = _unclaimed_doorbells(tx, local_sessions, doorbell_limit) if doorbell_limit else []
    cancelling = [
        str(row[0])
        for row in tx.execute(
            "SELECT id FROM session_execution WHERE owner_id = ? AND phase = 'cancelling'",
            (owner_id,),
        ).fetchall()
    ]
    messages = [
        snapshot
        for session_id, seen in watched.items()
        for snapshot in _message_snapshots(
            tx, "session_id = :session", {"session": session_id}, seen
        )
    ]
    return Changes(doorbells, cancelling, messages)


def watched_messages(tx: Tx, session_id: str, after_seq: int) -> list[Snapshot]:
    """Every stored message of the session with `seq > after_seq`, in seq order."""
    return _message_snapshots(
        tx, "session_id = :session AND seq > :after", {"session": session_id, "after": after_seq}
    )


def _message_snapshots(
    tx: Tx, where: str, params: dict[str, Any], seen: dict[str, int] | None = None
) -> list[Snapshot]:
    """Messages matching `where`, skipping those whose version is not newer than `seen`;
    the data of a skipped message is never read."""
    stale = [
        str(row[0])
        for row in tx.execute(
            f"SELECT id, version FROM session_message WHERE {where} ORDER BY seq", params
        ).fetchall()
        if seen is None or seen.get(row[0], -1) < row[1]
    ]
    snapshots: list[Snapshot] = []
    for message_id in stale:
        row = tx.one(
            "SELECT session_id, id, role, seq, data, execution_id, input_id, version"
            " FROM session_message WHERE id = ?",
            (message_id,),
        )
        snapshot: Message | MalformedRecord
        try:
            snapshot = _decode_message(*row[:7])
        except MalformedRecord as exc:
            snapshot = exc
        snapshots.append((str(row[0]), message_id, int(row[3]), snapshot, int(row[7])))
    return snapshots
