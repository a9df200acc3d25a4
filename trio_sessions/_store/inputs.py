"""Admission: the durable doorbell (`wake`) and idempotent inputs (`submit`).

Invariants kept here:
* an input id is stored once: the same id and payload for the same session writes nothing
  (pending, taken or set aside); another session or another payload is `InputConflict`;
* an input is either pending in `session_input` or a user message, never both, never none
  (`transcript.take_inputs` moves it);
* every write here takes the session lock first, and rings the change signal.
"""

from __future__ import annotations

import json

from .. import _codec
from .._backend import Tx
from .._errors import InputConflict


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


def _ensure_session(tx: Tx, session_id: str) -> None:
    tx.execute(
        "INSERT INTO session(id, time_created) VALUES (?, ?) ON CONFLICT(id) DO NOTHING",
        (session_id, tx.now),
    )
