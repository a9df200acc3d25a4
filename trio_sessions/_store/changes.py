"""Changes made by other processes (read-only): what the change signal points at.

Invariants kept here:
* these operations only read;
* a watched message's snapshot carries its version (the newest of its row's and its
  deltas') and the complete message, its streamed text merged; a message whose version
  is not newer than the one the watcher saw is not read.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from .._backend import Tx
from .._errors import MalformedRecord
from .._model import Message
from .common import _IN_CHUNK, _in_list
from .control import next_due
from .recovery import _unclaimed_doorbells
from .transcript import _decode_message, _streamed_texts

# (session id, message id, seq, the message or why it does not decode, version)
Snapshot = tuple[str, str, int, Message | MalformedRecord, int]


@attrs.frozen
class Changes:
    """What another process (or this one) may have changed since the last look."""

    doorbells: list[str]  # unclaimed sessions with a set doorbell, oldest first
    cancelling: list[str]  # execution ids of our claims another process marked cancelling
    messages: list[Snapshot]  # of watched sessions only
    # Our claims whose row is gone (their session deleted by another process); looked up
    # only while we hold at most `_IN_CHUNK` claims (else the heartbeat finds them).
    gone: list[str] = attrs.Factory(list)
    next_due_ms: int | None = None  # when the earliest scheduled input falls due


def changes(
    tx: Tx,
    owner_id: str,
    local_sessions: Sequence[str],
    owned_executions: Sequence[str],
    doorbell_limit: int,
    watched: dict[str, dict[str, int]],
) -> Changes:
    """Read what the change signal points at: doorbells this runtime may take, cancellations
    of its claims (`owned_executions`) and those of them that are gone, messages of watched
    sessions whose version is newer than the one given (`watched[session][message_id]`;
    absent = never seen), and when the earliest scheduled input falls due."""
    doorbells = _unclaimed_doorbells(tx, local_sessions, doorbell_limit) if doorbell_limit else []
    rows: list[Any] = []  # no claim of ours: none to be cancelled
    gone: list[str] = []
    if 0 < len(owned_executions) <= _IN_CHUNK:
        # A few claims of ours: looked up by key, no scan of every owner's claims.
        found = tx.execute(
            f"SELECT id, phase FROM session_execution WHERE id IN {_in_list(owned_executions)}"
            " AND owner_id = ?",
            (*owned_executions, owner_id),
        ).fetchall()
        rows = [row for row in found if row[1] == "cancelling"]
        present = {str(row[0]) for row in found}
        gone = [e for e in owned_executions if e not in present]
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
    return Changes(doorbells, cancelling, messages, gone, next_due(tx))


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
