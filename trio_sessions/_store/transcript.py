"""The transcript: taking inputs as user messages, assistant messages and their streamed
text, and reading the transcript back.

Invariants kept here:
* every write is under the claim fence (`_require_claim`), so a write of an execution
  that lost its claim raises `LeaseLost` with nothing written;
* a streamed append writes one small `session_message_delta` row, whatever the message's
  size; every tool-part change and every finish folds the message's deltas into
  `session_message.data` in the same transaction, and every reader merges the deltas still
  pending, so each sees the complete message. A message's version - the newest of its
  row's and its deltas' - grows with every change;
* an input that does not decode never blocks those behind it (set aside, raw text kept);
  a stored message that does not decode is never rewritten (recovery quarantines it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .. import _codec, _transcript
from .._backend import Tx
from .._errors import LeaseLost, MalformedRecord
from .._model import AssistantData, Input, Message
from .common import DUE, _next_message_seq, _require_claim, _require_claim_session, new_id


def take_inputs(tx: Tx, session_id: str, execution_id: str, owner_id: str) -> list[Input]:
    """Consume the due pending inputs in seq order, appending each as a user message (claim
    fence). Scheduled inputs not yet due by the lease clock stay pending, unseen.

    An input whose payload does not decode to a JSON object never blocks the ones behind
    it: it moves to `session_input_rejected` (raw text and reason kept for the operator).
    A claim marked cancelling takes nothing: its drain is being interrupted, and the
    inputs are left for the successor its cleanup rings for (DESIGN §5.1, on_busy).
    """
    if _require_claim_session(tx, session_id, execution_id, owner_id).phase == "cancelling":
        return []
    tx.notify(session_id)
    due = {"session": session_id, "now": tx.now}
    rows = tx.execute(
        f"SELECT id, seq, payload FROM session_input WHERE session_id = :session AND {DUE}"
        " ORDER BY seq",
        due,
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
    tx.execute(f"DELETE FROM session_input WHERE session_id = :session AND {DUE}", due)
    return taken


def begin_assistant(
    tx: Tx, session_id: str, execution_id: str, owner_id: str, message_id: str
) -> int:
    """Start an empty, unfinished assistant message, open for streaming; returns its seq."""
    _require_claim(tx, session_id, execution_id, owner_id)
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
    tx: Tx, session_id: str, execution_id: str, owner_id: str, message_id: str, text: str
) -> tuple[AssistantData | None, int]:
    """Stream text onto an open assistant message under the claim fence: one small
    `session_message_delta` row, never a rewrite of the message, so an append costs the
    same however large the message grew. Returns (None, the new version): the message is
    what it was plus `text`.

    A message with no stream row - finished, another execution's, or written by hand -
    takes `update_assistant`'s whole-row path instead, which raises as it always did
    (`MessageFinished`, `LeaseLost`, `MalformedRecord`) or returns the new data.
    """
    _require_claim(tx, session_id, execution_id, owner_id)
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
            session_id,
            execution_id,
            owner_id,
            message_id,
            lambda data: _transcript.append_text(data, text),
        )
    tx.notify(session_id)
    return None, int(row[0])


def update_assistant(
    tx: Tx,
    session_id: str,
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
    _require_claim(tx, session_id, execution_id, owner_id)
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
