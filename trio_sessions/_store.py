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
* an input is either pending in `session_input` or a user message, never both, never none;
* a streamed append writes one small `session_message_delta` row, whatever the message's
  size; every tool-part change and every finish folds the message's deltas into
  `session_message.data` in the same transaction, and every reader merges the deltas still
  pending, so each sees the complete message. A message's version - the newest of its
  row's and its deltas' - grows with every change.
"""

from __future__ import annotations

import json
import os
import time
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
_CLAIM_FENCE_OF = "{t}id = :execution AND {t}owner_id = :owner AND {t}expires_at > :now"
CLAIM_FENCE = _CLAIM_FENCE_OF.format(t="")
# The recovery fence: the exact old execution, still expired - or held by an owner found
# gone in this very transaction (its liveness token free: `tx.free_tokens`).
RECOVERY_FENCE = "id = :execution AND (expires_at <= :now OR owner_id = :gone_owner)"


def _fence(
    tx: Tx, execution_id: str, owner_id: str | None = None, gone_owner: str | None = None
) -> dict[str, Any]:
    return {"execution": execution_id, "owner": owner_id, "now": tx.now, "gone_owner": gone_owner}


def _gone_owner(facts: RecoveryFacts) -> str | None:
    """The claim's owner when it is gone (for the recovery fence), else None."""
    return facts.claim.owner_id if facts.owner_gone and facts.claim is not None else None


def _lease_lost(execution_id: str) -> LeaseLost:
    return LeaseLost(f"execution {execution_id!r} no longer holds a live claim")


def _no_longer_expired(execution_id: str) -> LeaseLost:
    return LeaseLost(f"execution {execution_id!r} is no longer an expired claim")


def new_id() -> str:
    """32 hex digits: the wall-clock millisecond (48 bits), then 80 random bits.

    Ids made later sort later, so new rows keyed by them land on the rightmost pages of
    their b-trees instead of on random ones: a commit writes a few pages, not one per row
    (a recovery pass replacing 100 claims commits in half the time). Unique as a random
    id: 80 random bits within each millisecond.
    """
    return f"{time.time_ns() // 1_000_000:012x}{os.urandom(10).hex()}"


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
    return _require_claim_session(tx, execution_id, owner_id).session_id


@attrs.frozen
class _ClaimedSession:
    """What the claim fence read about the claim's session, under the session lock (a wake
    serialises on that lock, so none of it can move before COMMIT)."""

    session_id: str
    doorbell: bool
    wake_attempts: int


def _require_claim_session(tx: Tx, execution_id: str, owner_id: str) -> _ClaimedSession:
    """`_require_claim`, reading the session's doorbell and resume count in the same
    statement."""
    session_id = _lock_execution(tx, execution_id)
    row = (
        None
        if session_id is None
        else tx.one(
            "SELECT s.time_woken, s.wake_attempts FROM session_execution c"
            f" JOIN session s ON s.id = c.session_id WHERE {_CLAIM_FENCE_OF.format(t='c.')}",
            _fence(tx, execution_id, owner_id),
        )
    )
    if session_id is None or row is None:
        raise _lease_lost(execution_id)
    return _ClaimedSession(session_id, row[0] is not None, int(row[1]))


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


def _insert_input(
    tx: Tx, session_id: str, payload: str, input_id: str, *, ring: bool
) -> tuple[int | None, int]:
    """Insert a pending input; `ring=False` when a claim inserted in this same transaction
    takes the wake at once (so the doorbell is never written). Returns the session's
    doorbell and resume count as they are now (for the claim that may follow)."""
    doorbell = tx.now if ring else None
    if ring:
        tx.notify(session_id)
    row = tx.one(
        "INSERT INTO session(id, time_created, time_woken, wakes, input_seq)"
        " VALUES (?, ?, ?, ?, 1)"
        " ON CONFLICT(id) DO UPDATE SET time_woken = COALESCE(session.time_woken, ?),"
        " wakes = session.wakes + ?, input_seq = session.input_seq + 1"
        " RETURNING input_seq, time_woken, wake_attempts",
        (session_id, tx.now, doorbell, int(ring), doorbell, int(ring)),
    )
    tx.execute(
        "INSERT INTO session_input(id, session_id, seq, payload, time_created)"
        " VALUES (?, ?, ?, ?, ?)",
        (input_id, session_id, row[0], payload, tx.now),
    )
    return row[1], int(row[2])


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
    session = _insert_input(tx, session_id, payload, input_id, ring=False)
    return input_id, _insert_claim(tx, session_id, execution_id, owner_id, lease_ms, session)


def _ensure_session(tx: Tx, session_id: str) -> None:
    tx.execute(
        "INSERT INTO session(id, time_created) VALUES (?, ?) ON CONFLICT(id) DO NOTHING",
        (session_id, tx.now),
    )


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


def finish_iteration(tx: Tx, execution_id: str, owner_id: str) -> bool:
    """After a drain returned: take a set doorbell and continue (True), or release (False).

    Either way, a message the drain left open is finished and its running tools failed
    (`interrupted`): nothing stays `running` forever. Serialised with `wake` by the write
    lock: a wake either committed before this, and is taken here, or finds no claim
    afterwards and leads to a fresh acquisition.
    """
    claimed = _require_claim_session(tx, execution_id, owner_id)
    _close_open_messages(tx, execution_id, INTERRUPTED)
    if claimed.doorbell:
        _take_doorbell(tx, claimed.session_id)
        return True
    _delete_claim(tx, execution_id, owner_id)
    if claimed.wake_attempts:
        _reset_attempts(tx, claimed.session_id)
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
            " time_created, time_updated, finished) VALUES (?, ?, ?, ?, 'user', ?, ?, ?, ?, 1)",
            (new_id(), session_id, execution_id, input_id, seq, payload, tx.now, tx.now),
        )
        seq += 1
    tx.execute("DELETE FROM session_input WHERE session_id = ?", (session_id,))
    return taken


def begin_assistant(tx: Tx, execution_id: str, owner_id: str, message_id: str) -> int:
    """Start an empty, unfinished assistant message, open for streaming; returns its seq."""
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
    tx.execute(
        "INSERT INTO session_message_stream(message_id, execution_id, version) VALUES (?, ?, 0)",
        (message_id, execution_id),
    )
    tx.notify(session_id)
    return seq


def append_assistant_text(
    tx: Tx, execution_id: str, owner_id: str, message_id: str, text: str
) -> tuple[AssistantData | None, int]:
    """Stream text onto an open assistant message under the claim fence: one small
    `session_message_delta` row, never a rewrite of the message, so an append costs the
    same however large the message grew. Returns (None, the new version): the message is
    what it was plus `text`.

    A message with no stream row - finished, another execution's, or written by hand -
    takes `update_assistant`'s whole-row path instead, which raises as it always did
    (`MessageFinished`, `LeaseLost`, `MalformedRecord`) or returns the new data.
    """
    session_id = _require_claim(tx, execution_id, owner_id)
    # Serialised with every other write to this message by the session lock, so the
    # newest version read here is still the newest when the row lands.
    row = tx.one(
        "INSERT INTO session_message_delta(message_id, version, text)"
        " SELECT s.message_id, COALESCE((SELECT MAX(d.version) FROM session_message_delta d"
        "   WHERE d.message_id = s.message_id), s.version) + 1, :text"
        " FROM session_message_stream s"
        " WHERE s.message_id = :message AND s.execution_id = :execution"
        " RETURNING version",
        {"message": message_id, "execution": execution_id, "text": text},
    )
    if row is None:
        return update_assistant(
            tx,
            execution_id,
            owner_id,
            message_id,
            lambda data: _transcript.append_text(data, text),
        )
    tx.notify(session_id)
    return None, int(row[0])


def update_assistant(
    tx: Tx,
    execution_id: str,
    owner_id: str,
    message_id: str,
    transition: Callable[[AssistantData], AssistantData],
) -> tuple[AssistantData, int]:
    """Read-modify-write of one assistant message under the claim fence, its streamed text
    folded in; returns the new data and its version (for watchers, without another round
    trip).

    The transition runs on the durable message, so the settlement state machine checks what
    is stored, not what a writer remembers.
    """
    session_id = _require_claim(tx, execution_id, owner_id)
    row = tx.one(
        "SELECT data FROM session_message WHERE id = ? AND execution_id = ?",
        (message_id, execution_id),
    )
    if row is None:
        raise LeaseLost(f"message {message_id!r} is not owned by execution {execution_id!r}")
    data = transition(_assistant_data(tx, message_id, row[0]))
    version = _write_assistant(tx, message_id, execution_id, data)
    tx.notify(session_id)
    return data, version


def _streamed_texts(tx: Tx, message_id: str) -> list[Any]:
    """The texts streamed onto a message since its data was last written, in order, as
    stored (`_codec.decode_streamed` checks them)."""
    rows = tx.execute(
        "SELECT text FROM session_message_delta WHERE message_id = ? ORDER BY version",
        (message_id,),
    ).fetchall()
    return [row[0] for row in rows]


def _assistant_data(tx: Tx, message_id: str, text: str) -> AssistantData:
    """An assistant message as every reader sees it: its data with its streamed text merged
    (`MalformedRecord` when either does not decode)."""
    data = _codec.decode_assistant(text, key=message_id)
    streamed = _codec.decode_streamed(_streamed_texts(tx, message_id), key=message_id)
    return _transcript.with_streamed(data, streamed)


# The version a write makes: one past the newest of the row's and its deltas'.
_NEXT_VERSION = (
    "COALESCE((SELECT MAX(d.version) FROM session_message_delta d"
    " WHERE d.message_id = :message), version) + 1"
)


def _write_assistant(tx: Tx, message_id: str, execution_id: str, data: AssistantData) -> int:
    """Store the complete message (deltas folded in, then dropped) and return its version:
    every change bumps it, which orders watchers' snapshots. An open message keeps its
    stream row, at the new version; a finished one loses it (nothing streams onto it)."""
    row = tx.one(
        f"UPDATE session_message SET data = :data, finished = :finished, time_updated = :now,"
        f" version = {_NEXT_VERSION} WHERE id = :message RETURNING version",
        {
            "data": _codec.encode_assistant(data),
            "finished": int(data.finished),
            "now": tx.now,
            "message": message_id,
        },
    )
    version = int(row[0])
    tx.execute("DELETE FROM session_message_delta WHERE message_id = ?", (message_id,))
    if data.finished:
        tx.execute("DELETE FROM session_message_stream WHERE message_id = ?", (message_id,))
    else:
        tx.execute(
            "INSERT INTO session_message_stream(message_id, execution_id, version)"
            " VALUES (?, ?, ?) ON CONFLICT(message_id) DO UPDATE SET version = excluded.version",
            (message_id, execution_id, version),
        )
    return version


def _close_open_messages(tx: Tx, execution_id: str, reason: str) -> None:
    """Finish every open assistant message of an execution as interrupted/failed.

    Only rows not marked finished are read (a partial index: a drain's finish does not grow
    with its transcript). A row that does not decode is left as it is: recovery quarantines
    such rows, and rewriting it would destroy what an operator needs to see.
    """
    rows = tx.execute(
        "SELECT id, data FROM session_message"
        " WHERE execution_id = ? AND finished = 0 AND role = 'assistant'",
        (execution_id,),
    ).fetchall()
    for message_id, text in rows:
        try:
            data = _assistant_data(tx, message_id, text)
        except MalformedRecord:
            continue
        if not data.finished:  # a finished row written by hand stays exactly as it is
            _write_assistant(tx, message_id, execution_id, _transcript.interrupt(data, reason))


def read_transcript(tx: Tx, session_id: str) -> list[Message]:
    """The session's messages in seq order, each with its streamed text merged."""
    rows = tx.execute(
        "SELECT id, role, seq, data, execution_id, input_id FROM session_message"
        " WHERE session_id = ? ORDER BY seq",
        (session_id,),
    ).fetchall()
    streamed: dict[str, list[Any]] = {}
    for message_id, text in tx.execute(
        "SELECT d.message_id, d.text FROM session_message_delta d"
        " JOIN session_message m ON m.id = d.message_id"
        " WHERE m.session_id = ? ORDER BY d.message_id, d.version",
        (session_id,),
    ).fetchall():
        streamed.setdefault(message_id, []).append(text)
    return [_decode_message(session_id, row, streamed.get(row[0], ())) for row in rows]


def _decode_message(session_id: str, row: Sequence[Any], streamed: Sequence[Any]) -> Message:
    """A message row - (id, role, seq, data, execution_id, input_id) - with the texts
    streamed onto it since its data was written."""
    message_id, role, seq, data, execution_id, input_id = row
    decoded: Any
    if role == "assistant":
        decoded = _transcript.with_streamed(
            _codec.decode_assistant(data, key=message_id),
            _codec.decode_streamed(streamed, key=message_id),
        )
    else:
        decoded = _codec.decode_object(data, table="session_message", key=message_id)
    return Message(message_id, session_id, role, seq, decoded, execution_id, input_id)


# ---------------------------------------------------------------------------------------------
# Recovery


@attrs.frozen
class Candidate:
    """A recovery candidate: an expired claim (`execution_id` set) or an unclaimed doorbell."""

    session_id: str
    execution_id: str | None


def recovery_candidates(
    tx: Tx,
    owner_id: str,
    limit: int,
    local_sessions: Sequence[str],
    gone_owners: Sequence[str] = (),
) -> list[Candidate]:
    """The oldest `limit` candidates: expired claims (and every claim of `gone_owners`,
    owners whose liveness token stayed free for the grace) by `expires_at`, then unclaimed
    doorbells by `time_woken`. Quarantined executions, executions under another owner's live
    recovery lease and sessions held locally are excluded here, so they never use up the
    budget."""
    not_local, local = tx.not_in("e.session_id", local_sessions)
    gone = {f"gone{index}": owner for index, owner in enumerate(gone_owners)}
    of_gone = "".join(f" OR e.owner_id = :{name}" for name in gone)
    expired = tx.execute(
        "SELECT e.session_id, e.id FROM session_execution e"
        f" WHERE (e.expires_at <= :now{of_gone}) AND {not_local}"
        " AND NOT EXISTS (SELECT 1 FROM session_recovery r WHERE r.execution_id = e.id"
        "   AND (r.recovery_error IS NOT NULL OR (r.owner_id != :me AND r.expires_at > :now)))"
        " ORDER BY e.expires_at, e.id LIMIT :limit",
        {"now": tx.now, "excluded": local, "me": owner_id, "limit": limit, **gone},
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
    on a quarantined row. Returns the candidates whose lease we now hold. One statement per
    `_IN_CHUNK` parameters (a multi-row upsert)."""
    expires = tx.now + lease_ms
    taken: set[str] = set()
    per_statement = _IN_CHUNK // 5  # five parameters per row
    for start in range(0, len(candidates), per_statement):
        chunk = candidates[start : start + per_statement]
        rows = tx.execute(
            "INSERT INTO session_recovery(execution_id, session_id, owner_id, expires_at,"
            " time_created) VALUES "
            + ", ".join(["(?, ?, ?, ?, ?)"] * len(chunk))
            + " ON CONFLICT(execution_id) DO UPDATE SET owner_id = excluded.owner_id,"
            " expires_at = excluded.expires_at"
            " WHERE session_recovery.recovery_error IS NULL"
            " AND (session_recovery.owner_id = excluded.owner_id"
            "   OR session_recovery.expires_at <= excluded.time_created)"
            " RETURNING execution_id",
            [
                value
                for candidate in chunk
                for value in (
                    candidate.execution_id,
                    candidate.session_id,
                    owner_id,
                    expires,
                    tx.now,
                )
            ],
        ).fetchall()
        leased = [str(row[0]) for row in rows]
        taken.update(leased)
        taken.difference_update(_drop_leases_without_claim(tx, owner_id, leased))
    return [candidate for candidate in candidates if candidate.execution_id in taken]


def _drop_leases_without_claim(tx: Tx, owner_id: str, execution_ids: Sequence[str]) -> set[str]:
    """Undo the leases just taken on claims that are gone: another recoverer took them over
    after our scan read them. Nothing scans a lease row without its claim, so one left behind
    by a recoverer that then died would stay forever. A separate statement, so on
    PostgreSQL it sees a takeover that committed while the upsert waited on its lease row."""
    if not execution_ids:
        return set()
    rows = tx.execute(
        "DELETE FROM session_recovery WHERE owner_id = ? AND recovery_error IS NULL"
        f" AND execution_id IN {_in_list(execution_ids)}"
        " AND NOT EXISTS (SELECT 1 FROM session_execution e"
        "   WHERE e.id = session_recovery.execution_id)"
        " RETURNING execution_id",
        [owner_id, *execution_ids],
    ).fetchall()
    return {str(row[0]) for row in rows}


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
    malformed_reason = None if newest is None else _malformed_reason(tx, newest[0], newest[1])
    attempts = tx.one("SELECT wake_attempts FROM session WHERE id = ?", (session_id,))
    facts = RecoveryFacts(
        claim=claim,
        superseded=superseded,
        newest_assistant_malformed=malformed_reason is not None,
        wake_attempts=0 if attempts is None else int(attempts[0]),
        handed_back=ours and bool(row[5]),
    )
    return facts, malformed_reason


def _malformed_reason(tx: Tx, message_id: str, text: str) -> str | None:
    try:
        _assistant_data(tx, message_id, text)
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
        RecoveryDecision.EXHAUSTED,
    ):
        _end_expired_claim(tx, candidate, decision, _gone_owner(facts))
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


def _delete_expired_claim(tx: Tx, execution_id: str, gone_owner: str | None) -> None:
    deleted = tx.execute(
        f"DELETE FROM session_execution WHERE {RECOVERY_FENCE}",
        _fence(tx, execution_id, gone_owner=gone_owner),
    ).rowcount
    if deleted != 1:
        raise _no_longer_expired(execution_id)


def _end_expired_claim(
    tx: Tx, candidate: Candidate, decision: RecoveryDecision, gone_owner: str | None
) -> None:
    execution_id = candidate.execution_id
    assert execution_id is not None
    reason = {
        RecoveryDecision.FINISH_CANCELLED: INTERRUPTED,
        RecoveryDecision.DROP_SUPERSEDED: OWNER_LOST,
        RecoveryDecision.EXHAUSTED: BUDGET_EXHAUSTED,
    }[decision]
    _close_open_messages(tx, execution_id, reason)
    _delete_expired_claim(tx, execution_id, gone_owner)
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
            **_fence(tx, old, gone_owner=_gone_owner(facts)),
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
    _unmark_finished(tx, execution_id)
    return Candidate(row[0], execution_id)


def _unmark_finished(tx: Tx, execution_id: str) -> None:
    """The operator may have repaired the execution's messages by hand (the documented way
    out of a quarantine), and `finished` does not follow a hand-written `data`: count them
    as maybe open again, so closing the execution reads what they say now."""
    tx.execute(
        "UPDATE session_message SET finished = 0"
        " WHERE execution_id = ? AND role = 'assistant' AND finished = 1",
        (execution_id,),
    )


def drop_quarantined(tx: Tx, execution_id: str) -> None:
    """Operator drop: set the execution's messages that do not decode aside (raw text kept
    in `session_message_rejected`), so the transcript reads again; finish the rest of its
    open transcript as owner-lost, delete the claim, reset attempts, re-arm the doorbell if
    inputs remain."""
    session_id = _quarantined_row(tx, execution_id)[0]
    _set_aside_malformed_messages(tx, session_id, execution_id)
    _unmark_finished(tx, execution_id)
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
        streamed = _streamed_texts(tx, message_id)
        try:
            _decode_message(
                session_id, (message_id, role, seq, data, execution_id, input_id), streamed
            )
        except MalformedRecord as exc:
            # The raw data is kept; text streamed onto it since goes into the reason (its
            # rows leave with the message).
            reason = str(exc) + (f"; streamed since: {streamed!r}" if streamed else "")
            tx.execute(
                "INSERT INTO session_message_rejected(id, session_id, execution_id, seq, data,"
                " reason, time_created) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (message_id, session_id, execution_id, seq, data, reason, tx.now),
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
    gone_owners: Sequence[str] = (),
) -> list[Recovered]:
    """`apply_recovery` for each (candidate, new execution id); one row's failure never
    undoes another's recovery.

    Set-wise where no transcript needs decoding: the facts of every candidate come from one
    statement, and a claim whose execution wrote no assistant message is taken over (or
    skipped) with the same fences, row by row in SQL but with no savepoint, since its first
    write is its fence. Every other candidate goes through `apply_recovery` in a savepoint.
    """
    results: dict[int, Recovered] = {}
    plain: list[_PlainItem] = []
    for session_id in sorted({candidate.session_id for candidate, _ in items}):
        tx.lock_session(session_id)
    # Re-checked here, after the locks: an owner is gone only if its token is free now.
    gone = frozenset(tx.free_tokens(gone_owners)) if gone_owners else frozenset()
    facts_of = _plain_recovery_facts(tx, owner_id, [c for c, _ in items], gone)
    for index, (candidate, new_execution_id) in enumerate(items):
        known = facts_of.get(candidate.execution_id or "")
        decision: RecoveryDecision | None = None
        if known is not None:
            facts, newest_seq, leased = known
            decision = _decisions.decide_recovery(
                facts, candidate.execution_id or "", tx.now, max_resumes
            )
        if known is None or decision not in _PLAIN_DECISIONS:
            results[index] = _apply_one(
                tx, owner_id, candidate, new_execution_id, lease_ms, max_resumes, gone
            )
        elif not leased:
            # Another recovery owner holds this row now: act on nothing of theirs.
            results[index] = Recovered(RecoveryDecision.GONE, fence_lost=True)
        else:
            plain.append(
                _PlainItem(index, candidate, new_execution_id, facts, newest_seq, decision)
            )
    results.update(_apply_plain(tx, owner_id, plain, lease_ms))
    return [results[index] for index in range(len(items))]


@attrs.frozen
class _PlainItem:
    """A candidate `apply_recovery_batch` acts on set-wise, with what it read about it."""

    position: int
    candidate: Candidate
    new_execution_id: str
    facts: RecoveryFacts
    newest_seq: int | None
    decision: RecoveryDecision


# Decisions `apply_recovery_batch` applies set-wise to a claim with no assistant message
# (no transcript to close); a superseded, cancelled or exhausted claim goes row by row.
_PLAIN_DECISIONS = (RecoveryDecision.RESUME, RecoveryDecision.SKIP_LIVE, RecoveryDecision.GONE)
# Parameters per IN list: well below SQLite's and PostgreSQL's limits.
_IN_CHUNK = 500


def _apply_one(
    tx: Tx,
    owner_id: str,
    candidate: Candidate,
    new_execution_id: str,
    lease_ms: int,
    max_resumes: int,
    gone: frozenset[str],
) -> Recovered:
    try:
        with tx.savepoint():
            return apply_recovery(
                tx, owner_id, candidate, new_execution_id, lease_ms, max_resumes, gone
            )
    except LeaseLost:
        return Recovered(RecoveryDecision.GONE, fence_lost=True)
    except (MalformedRecord, ValueError, TypeError, RecursionError) as exc:
        # A row recovery cannot process is poison: quarantine it (exact fence) rather
        # than fail the pass, so it never starves the rows behind it.
        return quarantine(tx, owner_id, candidate, f"recovery failed: {exc!r}")


def _chunks(values: Sequence[str]) -> Iterable[Sequence[str]]:
    for start in range(0, len(values), _IN_CHUNK):
        yield values[start : start + _IN_CHUNK]


def _in_list(values: Sequence[str]) -> str:
    return "(" + ", ".join("?" * len(values)) + ")"


def _plain_recovery_facts(
    tx: Tx, owner_id: str, candidates: Sequence[Candidate], gone: frozenset[str]
) -> dict[str, tuple[RecoveryFacts, int | None, bool]]:
    """For each candidate claim (still present) whose execution wrote no assistant message:
    its recovery facts, the session's newest message seq, and whether we hold its recovery
    lease. Read under the session locks, after which `tx.now` is read."""
    execution_ids = [c.execution_id for c in candidates if c.execution_id is not None]
    found: dict[str, tuple[RecoveryFacts, int | None, bool]] = {}
    for chunk in _chunks(execution_ids):
        rows = tx.execute(
            "SELECT e.id, e.owner_id, e.phase, e.expires_at, e.handed_back, s.wake_attempts,"
            " (SELECT MAX(m.seq) FROM session_message m WHERE m.session_id = e.session_id),"
            # Any other execution's message supersedes a claim taken before any message.
            " EXISTS (SELECT 1 FROM session_message m WHERE m.session_id = e.session_id"
            "   AND m.role = 'assistant' AND (m.execution_id IS NULL OR m.execution_id != e.id)"
            "   AND m.seq > COALESCE(e.anchor_seq, 0)),"
            " EXISTS (SELECT 1 FROM session_recovery r WHERE r.execution_id = e.id"
            "   AND r.owner_id = ? AND r.expires_at > ? AND r.recovery_error IS NULL)"
            " FROM session_execution e JOIN session s ON s.id = e.session_id"
            f" WHERE e.id IN {_in_list(chunk)} AND NOT EXISTS (SELECT 1 FROM session_message m"
            "   WHERE m.execution_id = e.id AND m.role = 'assistant')",
            (owner_id, tx.now, *chunk),
        ).fetchall()
        for row in rows:
            execution_id, owner, phase, expires_at, handed_back, attempts = row[:6]
            facts = RecoveryFacts(
                claim=ClaimRow(execution_id, owner, phase, expires_at),
                superseded=bool(row[7]),
                newest_assistant_malformed=False,
                wake_attempts=int(attempts),
                handed_back=bool(handed_back),
                owner_gone=owner in gone,
            )
            found[execution_id] = (facts, None if row[6] is None else int(row[6]), bool(row[8]))
    return found


def _apply_plain(
    tx: Tx,
    owner_id: str,
    plain: list[_PlainItem],
    lease_ms: int,
) -> dict[int, Recovered]:
    """Take over (RESUME) or let go (SKIP_LIVE, GONE) of claims whose recovery lease we
    hold and whose execution wrote no assistant message: nothing to close or decode."""
    results: dict[int, Recovered] = {}
    done: list[str] = []  # recovery rows of ours to delete
    counted: dict[bool, list[str]] = {True: [], False: []}
    for item in plain:
        index, candidate, facts, decision = item.position, item.candidate, item.facts, item.decision
        old = candidate.execution_id
        assert old is not None
        if decision is not RecoveryDecision.RESUME:
            done.append(old)
            results[index] = Recovered(decision)
            continue
        # The recovery fence comes first: zero rows means nothing was written for it.
        replaced = tx.execute(
            "UPDATE session_execution SET id = :new, owner_id = :me, phase = 'running',"
            " anchor_seq = :anchor, time_created = :now, heartbeat_at = NULL,"
            f" expires_at = :expires, handed_back = 0 WHERE {RECOVERY_FENCE}",
            {
                **_fence(tx, old, gone_owner=_gone_owner(facts)),
                "new": item.new_execution_id,
                "me": owner_id,
                "anchor": item.newest_seq,
                "expires": tx.now + lease_ms,
            },
        ).rowcount
        if replaced != 1:
            results[index] = Recovered(RecoveryDecision.GONE, fence_lost=True)
            continue
        # A claim handed back by a graceful shutdown resumes without counting.
        counts = not facts.handed_back
        counted[counts].append(candidate.session_id)
        done.append(old)
        results[index] = Recovered(
            RecoveryDecision.RESUME,
            new_execution_id=item.new_execution_id,
            attempt=facts.wake_attempts + int(counts),
        )
    for counts, session_ids in counted.items():
        for chunk in _chunks(session_ids):
            tx.execute(
                "UPDATE session SET wake_attempts = wake_attempts + ?, time_woken = NULL,"
                f" wakes = 0 WHERE id IN {_in_list(chunk)}",
                (int(counts), *chunk),
            )
    for chunk in _chunks(done):
        # Only our own recovery rows: another owner's lease or quarantine is not ours.
        tx.execute(
            f"DELETE FROM session_recovery WHERE execution_id IN {_in_list(chunk)}"
            " AND owner_id = ? AND recovery_error IS NULL",
            (*chunk, owner_id),
        )
    return results


# ---------------------------------------------------------------------------------------------
# Owner liveness (DESIGN §4): other owners' tokens


def free_tokens(tx: Tx) -> set[str]:
    """Every owner on record whose liveness token is free now (read-only)."""
    return tx.free_tokens(None)


def forget_gone_owners(tx: Tx, owner_ids: Sequence[str]) -> list[str]:
    """Of these gone owners, those still holding live claims that recovery may take (not
    quarantined); the token records of the others are removed where still free."""
    if not owner_ids:
        return []
    rows = tx.execute(
        "SELECT DISTINCT e.owner_id FROM session_execution e"
        f" WHERE e.owner_id IN {_in_list(owner_ids)} AND e.expires_at > ?"
        " AND NOT EXISTS (SELECT 1 FROM session_recovery r WHERE r.execution_id = e.id"
        "   AND r.recovery_error IS NOT NULL)",
        (*owner_ids, tx.now),
    ).fetchall()
    left = sorted(str(row[0]) for row in rows)
    tx.forget_tokens([owner for owner in owner_ids if owner not in left])
    return left


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
    owned_executions: Sequence[str],
    doorbell_limit: int,
    watched: dict[str, dict[str, int]],
) -> Changes:
    """Read what the change signal points at: doorbells this runtime may take, cancellations
    of its claims (`owned_executions`), and messages of watched sessions whose version is
    newer than the one given (`watched[session][message_id]`; absent = never seen)."""
    doorbells = _unclaimed_doorbells(tx, local_sessions, doorbell_limit) if doorbell_limit else []
    rows: list[Any] = []  # no claim of ours: none to be cancelled
    if 0 < len(owned_executions) <= _IN_CHUNK:
        # A few claims of ours: looked up by key, no scan of every owner's claims.
        rows = tx.execute(
            f"SELECT id FROM session_execution WHERE id IN {_in_list(owned_executions)}"
            " AND owner_id = ? AND phase = 'cancelling'",
            (*owned_executions, owner_id),
        ).fetchall()
    elif owned_executions:
        # Many: one scan costs less than as many lookups.
        rows = tx.execute(
            "SELECT id FROM session_execution WHERE owner_id = ? AND phase = 'cancelling'",
            (owner_id,),
        ).fetchall()
    cancelling = [str(row[0]) for row in rows]
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
    the data of a skipped message is never read. A message's version is the newest of its
    row's and its streamed deltas'; its snapshot has the streamed text merged."""
    stale = [
        str(row[0])
        for row in tx.execute(
            f"SELECT m.id, {_VERSION} FROM session_message m WHERE {where} ORDER BY m.seq",
            params,
        ).fetchall()
        if seen is None or seen.get(row[0], -1) < row[1]
    ]
    snapshots: list[Snapshot] = []
    for message_id in stale:
        session_id, *message, version = tx.one(
            "SELECT m.session_id, m.id, m.role, m.seq, m.data, m.execution_id, m.input_id,"
            f" {_VERSION} FROM session_message m WHERE m.id = ?",
            (message_id,),
        )
        snapshot: Message | MalformedRecord
        streamed = _streamed_texts(tx, message_id) if message[1] == "assistant" else []
        try:
            snapshot = _decode_message(session_id, message, streamed)
        except MalformedRecord as exc:
            snapshot = exc
        snapshots.append((str(session_id), message_id, int(message[2]), snapshot, int(version)))
    return snapshots


# A message's version as watchers order it (for `session_message m`).
_VERSION = (
    "COALESCE((SELECT MAX(d.version) FROM session_message_delta d WHERE d.message_id = m.id),"
    " m.version)"
)
