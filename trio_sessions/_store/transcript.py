"""The transcript: assistant messages and their streamed text, and reading the transcript
back (inputs become user messages in `intake`).

Invariants kept here:
* every write is under the claim fence (`_require_claim`), so a write of an execution
  that lost its claim raises `LeaseLost` with nothing written;
* a streamed append writes one small `session_message_delta` row, whatever the message's
  size; every tool-part change and every finish folds the message's deltas into
  `session_message.data` in the same transaction, and every reader merges the deltas still
  pending, so each sees the complete message. A message's version - the newest of its
  row's and its deltas' - grows with every change;
* every write of `data` records its stream step (`session_message_change`): the one event
  that made the new version (a tool part, a finish), or none when it was more than one;
* a stored message that does not decode is never rewritten (recovery quarantines it).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any, get_args

import attrs

from .. import _codec, _transcript
from .._backend import (
    FALLBACK,
    Tx,
    autocommit_when_alone,
    never_replayed,
    pg_batched,
    reads_stored_bytes,
)
from .._errors import LeaseLost, MalformedRecord, TrioSessionsError
from .._model import AssistantData, Message, Role, Step
from .common import (
    _lease_lost,
    _next_message_seq,
    _require_claim,
    fetched_on_budget,
    pg_set_wise,
    whole_number,
)

# An empty assistant message, as stored (also a literal in `ts_begin_assistants`).
_EMPTY_DATA = _codec.encode_assistant(_transcript.EMPTY)


def _pg_begun(args: tuple[Any, ...], row: tuple[Any, ...]) -> int:
    verdict, seq = row
    if verdict != "ok":
        raise _lease_lost(args[1])
    return int(seq)


@autocommit_when_alone
@pg_batched("ts_begin_assistants", _pg_begun)
def begin_assistant(
    tx: Tx, session_id: str, execution_id: str, owner_id: str, message_id: str
) -> int:
    """Start an empty, unfinished assistant message, open for streaming; returns its seq."""
    if tx.dialect == "postgres":
        args = (session_id, execution_id, owner_id, message_id)
        [row] = tx.call("ts_begin_assistant", *args, _EMPTY_DATA)
        return _pg_begun(args, row)
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
            _EMPTY_DATA,
            tx.now,
            tx.now,
        ),
    )
    tx.execute(
        "INSERT INTO session_message_stream(message_id, execution_id, version) VALUES (?, ?, 0)",
        (message_id, execution_id),
    )
    tx.notify(session_id, watchers_only=True)
    return seq


def _pg_appended(args: tuple[Any, ...], row: tuple[Any, ...]) -> Any:
    """`ts_append_text`'s row as `append_assistant_text` answers; `FALLBACK` for a message
    with no stream row of this execution (nothing was written: the whole-row path decides)."""
    verdict, version = row
    if verdict == "ok":
        return None, int(version)
    if verdict == "lease_lost":
        raise _lease_lost(args[1])
    return FALLBACK


# An open message's newest version on SQLite: its newest streamed text's, else its stream
# row's (`s`).
_TOP_DELTA = (
    "COALESCE((SELECT MAX(d.version) FROM session_message_delta d"
    " WHERE d.message_id = s.message_id), s.version)"
)


def _check_top_delta(tx: Tx, message_id: str, execution_id: str) -> None:
    """`MalformedRecord` when the append found the message streaming but its newest version
    no whole number (another tool's write); nothing when it is not streaming."""
    row = tx.one(
        f"SELECT {_TOP_DELTA} FROM session_message_stream s"
        " WHERE s.message_id = ? AND s.execution_id = ?",
        (message_id, execution_id),
    )
    if row is not None and type(row[0]) is not int:
        reasons = [f"version {row[0]!r:.60} is no whole number: no next version follows it"]
        raise MalformedRecord("session_message_delta", message_id, reasons)


@autocommit_when_alone
@pg_batched("ts_append_texts", _pg_appended)
def append_assistant_text(
    tx: Tx,
    session_id: str,
    execution_id: str,
    owner_id: str,
    message_id: str,
    text: str,
    after_version: int | None = None,
) -> tuple[AssistantData | None, int]:
    """Stream text onto an open assistant message under the claim fence: one small
    `session_message_delta` row, never a rewrite of the message, so an append costs the
    same however large the message grew. Returns (None, the new version): the message is
    what it was plus `text`.

    A message with no stream row - finished, another execution's, or written by hand -
    takes `update_assistant`'s whole-row path instead, which raises as it always did
    (`MessageFinished`, `LeaseLost`, `MalformedRecord`) or returns the new data.

    `after_version` is the message's version as the writer last saw it: on PostgreSQL the
    append is then one autocommit call, and a retry after a lost reply finds the delta
    just after that version with this text instead of appending it twice.
    """
    if tx.dialect == "postgres":
        args = (session_id, execution_id, owner_id, message_id, text, after_version)
        [row] = tx.call("ts_append_text", *args, idempotent=after_version is not None)
        result = _pg_appended(args, row)
        if result is not FALLBACK:
            return result  # type: ignore[no-any-return]
        # not_streaming: nothing was written; the whole-row path below.
    _require_claim(tx, session_id, execution_id, owner_id)
    # Serialised with every other write to this message by the session lock, so the
    # newest version read here is still the newest when the row lands.
    # Only after a whole-number version: SQLite keeps whatever another tool writes in an
    # INTEGER column, and text + 1 (or a REAL + 1) names no next version (PostgreSQL's
    # column is typed, and it has no typeof: `whole_number`).
    row = tx.one(
        "INSERT INTO session_message_delta(message_id, version, text)"
        f" SELECT s.message_id, {_TOP_DELTA} + 1, :text"
        " FROM session_message_stream s"
        " WHERE s.message_id = :message AND s.execution_id = :execution"
        f" AND {whole_number(tx, _TOP_DELTA)}"
        " RETURNING version",
        {"message": message_id, "execution": execution_id, "text": text},
    )
    if row is None:
        _check_top_delta(tx, message_id, execution_id)
        data, version, *_ = update_assistant(  # text: never one step, the message goes whole
            tx,
            session_id,
            execution_id,
            owner_id,
            message_id,
            lambda data: _transcript.append_text(data, text),
        )
        return data, version
    tx.notify(session_id, watchers_only=True)
    return None, _next_version(message_id, row[0])


@autocommit_when_alone
@never_replayed
def update_assistant(
    tx: Tx,
    session_id: str,
    execution_id: str,
    owner_id: str,
    message_id: str,
    transition: Callable[[AssistantData], AssistantData],
    known: Known | None = None,
) -> tuple[AssistantData, int, Step | None, str | None]:
    """Read-modify-write of one assistant message under the claim fence, its streamed text
    folded in; returns the new data, its version, its stream step (`_transcript.step`,
    recorded with it), for watchers and streams without another round trip, and on
    PostgreSQL the data's stored encoding (the writer's next `Known.text`; None on SQLite).

    The transition runs on the durable message, so the settlement state machine checks what
    is stored, not what a writer remembers. On PostgreSQL, `known` - what the writer stored
    last (data, texts streamed since, version) - saves the read: the transition runs on it
    and the result is written only if the message is still at that version (one call,
    `ts_update_message`, alone in autocommit); otherwise, or when the transition refuses
    the known message or its data no longer encodes as stored, the durable message is read
    and the transition runs on it. On SQLite, `known` saves decoding the message read: its
    data is used while it encodes as stored (`_encodes_as`), checked again once the new
    message is encoded.
    """
    if tx.dialect == "postgres" and known is not None:
        updated = _pg_update_known(
            tx, session_id, execution_id, owner_id, message_id, transition, known
        )
        if updated is not None:
            return updated
    if tx.dialect == "postgres":
        [(verdict, text, streamed, now)] = tx.call(
            "ts_read_message", session_id, execution_id, owner_id, message_id, idempotent=False
        )
        if verdict == "lease_lost":
            raise _lease_lost(execution_id)
        if verdict != "ok":
            raise _not_owned(message_id, execution_id)
        data, step = _applied(
            transition,
            _transcript.with_streamed(
                _codec.decode_assistant(text, key=message_id),
                _codec.decode_streamed(list(streamed), key=message_id),
            ),
        )
        written = _codec.encode_assistant(data)
        [(version,)] = tx.call(
            "ts_write_message",
            execution_id,
            message_id,
            written,
            data.finished,
            now,
            True,
            *_step_columns(step),
            idempotent=False,
        )
        return data, int(version), step, written
    _require_claim(tx, session_id, execution_id, owner_id)
    row = tx.one(
        "SELECT data FROM session_message WHERE id = ? AND execution_id = ?",
        (message_id, execution_id),
    )
    if row is None:
        raise _not_owned(message_id, execution_id)
    held = known if known is not None and _encodes_as(known.data, row[0]) else None
    if held is not None:
        base = _transcript.with_streamed(held.data, _streamed(tx, message_id))
    else:
        base = _assistant_data(tx, message_id, row[0])
    data, step = _applied(transition, base)
    columns = _Written.of(data, step)
    in_worker_thread = _codec.budget_left() is None  # on the loop, nothing runs between
    if held is not None and in_worker_thread and not _encodes_as(held.data, row[0]):
        # A reader edited what the writer holds while this ran (in the worker thread: the
        # SQL between releases the GIL), maybe before the new message was encoded: the
        # message as stored, as PostgreSQL's `_pg_update_known` checks after encoding.
        data, step = _applied(transition, _assistant_data(tx, message_id, row[0]))
        columns = _Written.of(data, step)
    version = _write_assistant(tx, message_id, execution_id, data, step, columns)
    tx.notify(session_id, watchers_only=True)
    return data, version, step, None


def message_as_stored(
    tx: Tx, session_id: str, execution_id: str, owner_id: str, message_id: str
) -> tuple[AssistantData, int, int] | None:
    """An assistant message of this claim as stored now - its data with its streamed text
    merged, its version and its seq - under the claim fence; None when there is none.
    What a writer reads back before acting again after a write whose outcome is unknown
    (`OutcomeUnknown`, DESIGN §8 "Uncertain commits"): whether that write landed."""
    _require_claim(tx, session_id, execution_id, owner_id)
    row = tx.one(
        "SELECT m.data, COALESCE((SELECT MAX(d.version) FROM session_message_delta d"
        " WHERE d.message_id = m.id), m.version), m.seq FROM session_message m"
        " WHERE m.id = ? AND m.execution_id = ? AND m.role = 'assistant'",
        (message_id, execution_id),
    )
    if row is None:
        return None
    return _assistant_data(tx, message_id, row[0]), int(row[1]), int(row[2])


@attrs.frozen
class Known:
    """What a writer stored last of its message: data, the texts streamed onto it since,
    the version they make, and the data's stored encoding. The writer's local readers are
    shown its very objects, and a reader may edit the dicts of a tool part it was shown:
    the data is written from only while it still encodes as `text` (None: unknown)."""

    data: AssistantData
    streamed: tuple[str, ...]
    version: int
    text: str | None


def _pg_update_known(
    tx: Tx,
    session_id: str,
    execution_id: str,
    owner_id: str,
    message_id: str,
    transition: Callable[[AssistantData], AssistantData],
    known: Known,
) -> tuple[AssistantData, int, Step | None, str] | None:
    """`ts_update_message` with the transition applied to `known`: (data, version, step,
    its encoding) when it was written; None (nothing written) when the message moved past
    `known.version`, the transition refuses it, or the known data was edited since it was
    stored (a reader's edit here, or another tool's edit of the row, which leaves the
    version as it was) - the caller reads the durable message."""
    if known.text is None:
        return None
    try:
        data, step = _applied(transition, _transcript.with_streamed(known.data, known.streamed))
        # The new message first, then the check: a reader's edits are never undone, so
        # one that reached `written` shows in the check too.
        written = _codec.encode_assistant(data)
        if _codec.encode_assistant(known.data) != known.text:
            return None
    except (ValueError, TypeError, RuntimeError, TrioSessionsError):
        # A refusal is the stored message's to make (it raises it again); a value a reader
        # put in that JSON cannot hold makes the known data unusable, not the write.
        return None
    [(verdict, version)] = tx.call(
        "ts_update_message",
        session_id,
        execution_id,
        owner_id,
        message_id,
        known.version,
        hashlib.sha256(known.text.encode()).digest(),
        written,
        data.finished,
        *_step_columns(step),
    )
    if verdict == "lease_lost":
        raise _lease_lost(execution_id)
    if verdict == "not_owned":
        raise _not_owned(message_id, execution_id)
    return None if verdict == "moved" else (data, int(version), step, written)


def _applied(
    transition: Callable[[AssistantData], AssistantData], before: AssistantData
) -> tuple[AssistantData, Step | None]:
    """The message after `transition`, and the stream step that made it from `before`."""
    after = transition(before)
    return after, _transcript.step(before, after)


def _step_columns(step: Step | None) -> tuple[str | None, str | None]:
    """A stream step's `session_message_change` columns (kind, data); None for none."""
    return (None, None) if step is None else (step[0], _codec.encode_step(step))


def _not_owned(message_id: str, execution_id: str) -> LeaseLost:
    return LeaseLost(f"message {message_id!r} is not owned by execution {execution_id!r}")


def _encodes_as(data: AssistantData, text: Any) -> bool:
    """SQLite: whether the writer's held data is still what the row stores - it encodes as
    the row's `text`, byte for byte (no reader edited it since it was written). Encoding
    costs a fraction of decoding, and a message made from the held data shares its
    unchanged parts with the writer's: a decoded copy would be dropped on the event loop
    when the writer takes the new message (26 ms for four tool results of 300,000 nodes).
    `OffTheLoop` passes through: the executor's worker thread runs the write again."""
    if not isinstance(text, str):
        return False
    try:
        return _codec.encode_assistant(data) == text
    except (ValueError, TypeError, RecursionError):
        return False  # a reader put in a value JSON cannot hold: the stored one is read


def _streamed(tx: Tx, message_id: str) -> list[str]:
    """The texts streamed onto a message since its data was written, checked."""
    return _codec.decode_streamed(_streamed_texts(tx, message_id), key=message_id)


@attrs.frozen
class _Written:
    """A message's columns as a write stores them, encoded once: its data, and the stream
    step that made its version (`_step_columns`)."""

    data: str
    step: tuple[str | None, str | None]

    @classmethod
    def of(cls, data: AssistantData, step: Step | None) -> _Written:
        return cls(_codec.encode_assistant(data), _step_columns(step))


def _streamed_texts(tx: Tx, message_id: str) -> list[Any]:
    """The texts streamed onto a message since its data was last written, in order, as
    stored (`_codec.decode_streamed` checks them)."""
    rows = tx.execute(
        "SELECT version, text FROM session_message_delta WHERE message_id = ? ORDER BY version",
        (message_id,),
    ).fetchall()
    return [_codec.streamed_text(version, text) for version, text in rows]


def _assistant_data(tx: Tx, message_id: str, text: str) -> AssistantData:
    """An assistant message as every reader sees it: its data with its streamed text merged
    (`MalformedRecord` when either does not decode)."""
    data = _codec.decode_assistant(text, key=message_id)
    return _transcript.with_streamed(data, _streamed(tx, message_id))


# The version a write makes: one past the newest of the row's and its deltas'.
_NEXT_VERSION = (
    "COALESCE((SELECT MAX(d.version) FROM session_message_delta d"
    " WHERE d.message_id = :message), version) + 1"
)


def _write_assistant(
    tx: Tx,
    message_id: str,
    execution_id: str,
    data: AssistantData,
    step: Step | None = None,
    written: _Written | None = None,
) -> int:
    """Store the complete message (deltas folded in, then dropped) and return its version:
    every change bumps it, which orders watchers' snapshots. An open message keeps its
    stream row, at the new version; a finished one loses it (nothing streams onto it). The
    stream step that made the version is recorded with it (none: a stream one version
    behind gets the message whole). `written`: the columns, if encoded already."""
    written = written or _Written.of(data, step)
    row = tx.one(
        f"UPDATE session_message SET data = :data, finished = :finished, time_updated = :now,"
        f" version = {_NEXT_VERSION} WHERE id = :message RETURNING version",
        {
            "data": written.data,
            "finished": int(data.finished),
            "now": tx.now,
            "message": message_id,
        },
    )
    version = _next_version(message_id, row[0])
    tx.execute("DELETE FROM session_message_delta WHERE message_id = ?", (message_id,))
    if data.finished:
        tx.execute("DELETE FROM session_message_stream WHERE message_id = ?", (message_id,))
    else:
        tx.execute(
            "INSERT INTO session_message_stream(message_id, execution_id, version)"
            " VALUES (?, ?, ?) ON CONFLICT(message_id) DO UPDATE SET version = excluded.version",
            (message_id, execution_id, version),
        )
    kind, step_data = written.step
    if kind is None:
        tx.execute("DELETE FROM session_message_change WHERE message_id = ?", (message_id,))
    else:
        tx.execute(
            "INSERT INTO session_message_change(message_id, version, kind, data)"
            " VALUES (?, ?, ?, ?) ON CONFLICT(message_id) DO UPDATE"
            " SET version = excluded.version, kind = excluded.kind, data = excluded.data",
            (message_id, version, kind, step_data),
        )
    return version


def _next_version(message_id: str, version: Any) -> int:
    """The version a write made, or `MalformedRecord` when the row's (or a delta's) was
    already the largest 64-bit integer, set by another tool: SQLite then computes a REAL
    and stores it (PostgreSQL refuses the UPDATE with 'bigint out of range')."""
    if type(version) is not int:
        reasons = [f"version out of range: no version after {version!r}"]
        raise MalformedRecord("session_message", message_id, reasons)
    return version


def _no_id() -> MalformedRecord:
    """A message whose id is NULL: SQLite's rowid table keeps the NULL another tool writes
    (PostgreSQL's primary key refuses it), and no write can name the message."""
    return MalformedRecord("session_message", "NULL", ["id is NULL"])


def unnamed(message_id: object) -> MalformedRecord | None:
    """Why no write can name a message by its id (None when one can): a NULL (`_no_id`),
    or - read as its bytes (`SQLiteTx.stored_bytes`) - text another tool wrote that is not
    UTF-8, which the driver's error, naming only the column, did not say of which row: a
    write by those bytes finds no row."""
    if message_id is None:
        return _no_id()
    if type(message_id) is not str:
        reasons = [f"id {message_id!r} is not UTF-8 text"]  # as the transcript's reader
        return MalformedRecord("session_message", _codec.shown_text(message_id), reasons)
    return None


def maybe_open_data(tx: Tx, message_id: Any, text: Any, finished: Any) -> AssistantData:
    """A maybe-open assistant message (`MAYBE_OPEN`) as an ending or recovery judges it:
    its data with its streamed text merged, or `MalformedRecord` when no write can name it
    (`unnamed`), it does not decode, or its mark is broken (`broken_mark`) - every reader
    of such rows refuses the same ones."""
    refused = unnamed(message_id)
    if refused is not None:
        raise refused
    data = _assistant_data(tx, message_id, text)
    refused = broken_mark(message_id, finished)
    if refused is not None:
        raise refused
    return data


# The rows an ending reads as maybe open (the partial index `session_message_open` covers
# exactly these: SQLite version 9, PostgreSQL version 29). Not `finished = 0`: a mark
# another tool set to any other value (2, text) would be passed over, the message left open
# for ever with its claim deleted in silence; read, it is refused (`broken_mark`).
MAYBE_OPEN = "finished <> 1"
# The messages an ending finishes (`_close_open_messages`): an execution's maybe-open
# assistant messages.
OPEN_ASSISTANT = f"{MAYBE_OPEN} AND role = 'assistant'"


def maybe_open(finished: Any) -> bool:
    """`MAYBE_OPEN` for a mark already read: a row every ending reads as maybe open."""
    return bool(finished != 1)


def broken_mark(message_id: Any, finished: Any) -> MalformedRecord | None:
    """The message's `MalformedRecord` when its `finished` mark is neither 0 (maybe open) nor
    1 (finished): another tool's write, which neither an ending nor recovery can judge."""
    if type(finished) is int and finished in (0, 1):
        return None
    return MalformedRecord(
        "session_message", str(message_id), [f"finished is {finished!r:.60}, not 0 or 1"]
    )


def _close_open_messages(
    tx: Tx, execution_id: str, reason: str, *, malformed_keeps_claim: bool = False
) -> tuple[MalformedRecord, ...]:
    """Finish every open assistant message of an execution as interrupted/failed.

    Only rows not marked finished are read (`MAYBE_OPEN`, a partial index: a drain's finish
    does not grow with its transcript). A row that does not decode, whose mark is
    neither 0 nor 1, or whose id names no row (`maybe_open_data`), is left as it is:
    recovery quarantines such rows, and rewriting it would destroy what an operator needs
    to see. So `malformed_keeps_claim` (an owner's finish that would delete its running
    claim next) raises its `MalformedRecord` instead, rolling the finish back: the claim
    stays for recovery to quarantine - deleted, nothing would ever list the message.
    Otherwise (an interrupt's or a cancelled or superseded claim's end, which deletes the
    claim all the same: DESIGN §4's order) returns each such row's `MalformedRecord`, for
    the caller to tell the operator: nothing else will, and `transcript()` raises until one
    acts.

    Every row is read (its stored text too) before the first is written: an ending's
    reads of stored text all come before its writes (`reads_stored_bytes_first`).
    """
    rows = tx.execute(
        "SELECT id, data, session_id, finished FROM session_message"
        f" WHERE execution_id = ? AND {OPEN_ASSISTANT}",
        (execution_id,),
    ).fetchall()
    left_open: list[MalformedRecord] = []
    closing: list[tuple[str, str, AssistantData]] = []
    for message_id, text, session_id, finished in rows:
        try:
            data = maybe_open_data(tx, message_id, text, finished)
        except MalformedRecord as exc:
            if malformed_keeps_claim:
                raise
            left_open.append(exc)
            continue
        if not data.finished:  # a finished row written by hand stays exactly as it is
            closing.append((message_id, session_id, data))
    for message_id, session_id, data in closing:
        _write_assistant(tx, message_id, execution_id, _transcript.interrupt(data, reason))
        # For the session's watchers (on SQLite, this runtime's own ones too).
        tx.notify(session_id, watchers_only=True)
    return tuple(left_open)


@autocommit_when_alone
@reads_stored_bytes
def read_transcript(tx: Tx, session_id: str) -> list[Message]:
    """The session's messages in seq order, each with its streamed text merged. On
    PostgreSQL one call (`ts_read_transcript`): alone in autocommit, one snapshot and one
    round trip."""
    if tx.dialect != "postgres":
        return read_transcript_by_statements(tx, session_id)
    messages: list[Any] = []
    streamed: dict[str, list[tuple[int, Any]]] = {}
    for kind, message_id, role, seq, data, execution_id, input_id in tx.call(
        "ts_read_transcript", session_id
    ):
        if kind == "message":
            messages.append((message_id, role, seq, data, execution_id, input_id))
        else:  # a delta: its version in `seq`, its text in `data`
            streamed.setdefault(message_id, []).append((seq, data))
    messages.sort(key=lambda row: row[2])
    return [
        _decode_message(session_id, row, [text for _, text in sorted(streamed.get(row[0], []))])
        for row in messages
    ]


def read_transcript_by_statements(tx: Tx, session_id: str) -> list[Message]:
    """`read_transcript` statement by statement (SQLite)."""
    # Each row charged to the loop's budget: short messages cost their rows, not their text
    # (50,000 of them took 89 ms of the loop decoded within the budget of their text).
    rows = fetched_on_budget(
        tx.execute(
            "SELECT id, role, seq, data, execution_id, input_id FROM session_message"
            " WHERE session_id = ? ORDER BY seq",
            (session_id,),
        )
    )
    streamed: dict[str, list[Any]] = {}
    for message_id, version, text in fetched_on_budget(
        tx.execute(
            "SELECT d.message_id, d.version, d.text FROM session_message_delta d"
            " JOIN session_message m ON m.id = d.message_id"
            " WHERE m.session_id = ? ORDER BY d.message_id, d.version",
            (session_id,),
        )
    ):
        streamed.setdefault(message_id, []).append(_codec.streamed_text(version, text))
    return [_decode_message(session_id, row, streamed.get(row[0], ())) for row in rows]


_ROLES = frozenset(get_args(Role))


def _shape_reasons(row: Sequence[Any]) -> list[str]:
    """Why a message row - (id, role, seq, data, execution_id, input_id) - holds what the
    store never writes in its role, seq or ids (SQLite keeps what another tool writes past
    a CHECK, into an INTEGER column, or as TEXT that is not UTF-8, read as bytes; either
    store keeps a seq below 1)."""
    message_id, role, seq, _, execution_id, input_id = row
    reasons = []
    if role not in _ROLES:
        reasons.append(f"role {role!r} is none of {', '.join(sorted(_ROLES))}")
    if type(seq) is not int:
        reasons.append(f"seq {seq!r} is no whole number")
    elif seq < 1:
        # A session's seqs count from 1 (DESIGN §5: `watch(after_seq=0)` and
        # `truncate(after_seq=0)` mean every message): a stream or watcher could not name
        # a message before them.
        reasons.append(f"seq {seq} is below 1")
    if message_id is None:
        # SQLite's `id TEXT PRIMARY KEY` of a rowid table takes the NULL another tool
        # writes (PostgreSQL's refuses it): a message no reader can name.
        reasons.append("id is NULL")
    for column, value in (
        ("id", message_id),
        ("execution_id", execution_id),
        ("input_id", input_id),
    ):
        if value is not None and type(value) is not str:
            reasons.append(f"{column} {value!r} is not UTF-8 text")
        elif value is not None and _codec.NUL in value:
            # SQLite keeps one another tool writes; no writer does (§8).
            reasons.append(f"{column} {value!r} holds a NUL character, which no writer stores")
    return reasons


def _decode_message(session_id: str, row: Sequence[Any], streamed: Sequence[Any]) -> Message:
    """A message row - (id, role, seq, data, execution_id, input_id) - with the texts
    streamed onto it since its data was written."""
    message_id, role, seq, data, execution_id, input_id = row
    reasons = _shape_reasons(row)
    if reasons:
        key = "NULL" if message_id is None else _codec.shown_text(message_id)
        raise MalformedRecord("session_message", key, reasons)
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
# PostgreSQL: this family's server-side functions (created by `_schema`'s migrations; see
# `_store.pg_functions` for their conventions)

PG_FUNCTIONS = (
    r"""
-- read_transcript in one statement (one snapshot): rows (kind, id, role, seq, data,
-- execution_id, input_id) - 'message': a message row; 'delta': a text streamed onto the
-- message `id`, its version in `seq` and its text in `data`. Unordered: the caller sorts.
CREATE OR REPLACE FUNCTION ts_read_transcript(p_session text, p_now bigint, p_retry boolean)
RETURNS TABLE(kind text, id text, role text, seq bigint, data text, execution_id text,
    input_id text)
LANGUAGE sql STABLE AS $$
    SELECT 'message', m.id, m.role, m.seq::bigint, m.data, m.execution_id, m.input_id
        FROM session_message m WHERE m.session_id = p_session
    UNION ALL
    SELECT 'delta', d.message_id, NULL, d.version::bigint, d.text, NULL, NULL
        FROM session_message_delta d JOIN session_message m ON m.id = d.message_id
        WHERE m.session_id = p_session
$$;

-- Streamed text onto an open message: one delta row. Verdicts: ok (version), lease_lost,
-- not_streaming (no stream row of this execution: the caller's whole-row path).
CREATE OR REPLACE FUNCTION ts_append_text(p_session text, p_exec text, p_owner text,
    p_message text, p_text text, p_after bigint, p_now bigint, p_retry boolean,
    OUT verdict text, OUT version bigint)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_session text; v_now bigint; v_base bigint;
BEGIN
    SELECT l.session_id, l.now INTO v_session, v_now
        FROM ts_lock_execution(p_session, p_exec, p_now) l;
    IF v_session IS NULL OR NOT ts_holds(p_exec, p_owner, v_now) THEN
        verdict := 'lease_lost';
        RETURN;
    END IF;
    SELECT s.version INTO v_base FROM session_message_stream s
        WHERE s.message_id = p_message AND s.execution_id = p_exec;
    IF NOT FOUND THEN
        verdict := 'not_streaming';
        RETURN;
    END IF;
    -- A lost reply: the delta after the writer's version, with this text, is this append.
    IF p_retry AND p_after IS NOT NULL AND EXISTS (
            SELECT 1 FROM session_message_delta d WHERE d.message_id = p_message
            AND d.version = p_after + 1 AND d.text = p_text) THEN
        verdict := 'ok';
        version := p_after + 1;
        RETURN;
    END IF;
    INSERT INTO session_message_delta(message_id, version, text)
        SELECT p_message, COALESCE(MAX(d.version), v_base) + 1, p_text
        FROM session_message_delta d WHERE d.message_id = p_message
        RETURNING session_message_delta.version INTO version;
    PERFORM ts_signal_watchers(v_session);
    verdict := 'ok';
END $$;


-- An empty, unfinished assistant message open for streaming. Verdicts: ok (seq),
-- lease_lost. Idempotent by message id (a lost reply's retry finds it).
CREATE OR REPLACE FUNCTION ts_begin_assistant(p_session text, p_exec text, p_owner text,
    p_message text, p_data text, p_now bigint, p_retry boolean, OUT verdict text, OUT seq bigint)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_session text; v_now bigint;
BEGIN
    SELECT l.session_id, l.now INTO v_session, v_now
        FROM ts_lock_execution(p_session, p_exec, p_now) l;
    IF v_session IS NULL OR NOT ts_holds(p_exec, p_owner, v_now) THEN
        verdict := 'lease_lost';
        RETURN;
    END IF;
    verdict := 'ok';
    IF p_retry THEN
        SELECT m.seq INTO seq FROM session_message m
            WHERE m.id = p_message AND m.execution_id = p_exec;
        IF FOUND THEN
            RETURN;
        END IF;
    END IF;
    INSERT INTO session_message(id, session_id, execution_id, role, seq, data, time_created,
            time_updated)
        SELECT p_message, v_session, p_exec, 'assistant', COALESCE(MAX(m.seq), 0) + 1, p_data,
            v_now, v_now
        FROM session_message m WHERE m.session_id = v_session
        RETURNING session_message.seq INTO seq;
    INSERT INTO session_message_stream(message_id, execution_id, version)
        VALUES (p_message, p_exec, 0);
    PERFORM ts_signal_watchers(v_session);
END $$;

-- update_assistant from what the writer stored last: p_data is written (as
-- ts_write_message) only if the message - the newest of its row's and its deltas'
-- versions - is still at p_known, the version that writer last stored, and its data is
-- still the text that writer stored (p_known_digest: its SHA-256). Verdicts: ok
-- (version), moved (nothing written: the caller reads the message), lease_lost,
-- not_owned. A lost reply's call (p_retry) is read back by its result: the message at
-- p_known + 1 with p_data.
CREATE OR REPLACE FUNCTION ts_update_message(p_session text, p_exec text, p_owner text,
    p_message text, p_known bigint, p_known_digest bytea, p_data text, p_finished boolean,
    p_step_kind text, p_step_data text, p_now bigint, p_retry boolean, OUT verdict text,
    OUT version bigint)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_session text; v_now bigint; v_data text;
BEGIN
    SELECT l.session_id, l.now INTO v_session, v_now
        FROM ts_lock_execution(p_session, p_exec, p_now) l;
    IF v_session IS NULL OR NOT ts_holds(p_exec, p_owner, v_now) THEN
        verdict := 'lease_lost';
        RETURN;
    END IF;
    SELECT m.data, COALESCE((SELECT MAX(d.version) FROM session_message_delta d
                             WHERE d.message_id = m.id), m.version)
        INTO v_data, version
        FROM session_message m WHERE m.id = p_message AND m.execution_id = p_exec;
    IF NOT FOUND THEN
        verdict := 'not_owned';
        RETURN;
    END IF;
    IF p_retry AND version = p_known + 1 AND v_data = p_data THEN
        verdict := 'ok';
        RETURN;
    END IF;
    -- Another tool's edit of the data (an operator's redaction, a bad write) leaves the
    -- version as it was: the stored data must still be what that writer stored.
    IF version <> p_known OR sha256(convert_to(v_data, 'UTF8')) <> p_known_digest THEN
        verdict := 'moved';
        RETURN;
    END IF;
    version := ts_write_message(p_exec, p_message, p_data, p_finished, v_now, true,
        p_step_kind, p_step_data, p_now, p_retry);
    verdict := 'ok';
END $$;

-- update_assistant, first half: the message as stored (data, and the texts streamed onto it
-- since, in order) under the claim fence, and the clock read after the lock. Verdicts: ok,
-- lease_lost, not_owned (no such message of this execution).
CREATE OR REPLACE FUNCTION ts_read_message(p_session text, p_exec text, p_owner text,
    p_message text, p_now bigint, p_retry boolean,
    OUT verdict text, OUT data text, OUT streamed text[], OUT now bigint)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_session text;
BEGIN
    SELECT l.session_id, l.now INTO v_session, now
        FROM ts_lock_execution(p_session, p_exec, p_now) l;
    IF v_session IS NULL OR NOT ts_holds(p_exec, p_owner, now) THEN
        verdict := 'lease_lost';
        RETURN;
    END IF;
    SELECT m.data INTO data FROM session_message m
        WHERE m.id = p_message AND m.execution_id = p_exec;
    IF NOT FOUND THEN
        verdict := 'not_owned';
        RETURN;
    END IF;
    SELECT COALESCE(array_agg(d.text ORDER BY d.version), '{}') INTO streamed
        FROM session_message_delta d WHERE d.message_id = p_message;
    verdict := 'ok';
END $$;

-- update_assistant, second half (and closing an open message): store the complete message,
-- its deltas folded in and dropped, at the next version; an open message keeps its stream
-- row at that version, a finished one loses it; the stream step that made the version
-- (p_step_kind NULL: none) is recorded with it. Run after ts_read_message in the same
-- transaction (its lock and its clock `p_at`). Returns the new version.
CREATE OR REPLACE FUNCTION ts_write_message(p_exec text, p_message text, p_data text,
    p_finished boolean, p_at bigint, p_signal boolean, p_step_kind text, p_step_data text,
    p_now bigint, p_retry boolean)
RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_version bigint; v_session text;
BEGIN
    UPDATE session_message m SET data = p_data, finished = p_finished::int, time_updated = p_at,
        version = COALESCE((SELECT MAX(d.version) FROM session_message_delta d
                            WHERE d.message_id = p_message), m.version) + 1
        WHERE m.id = p_message RETURNING m.version, m.session_id INTO v_version, v_session;
    DELETE FROM session_message_delta WHERE message_id = p_message;
    IF p_finished THEN
        DELETE FROM session_message_stream WHERE message_id = p_message;
    ELSE
        INSERT INTO session_message_stream(message_id, execution_id, version)
            VALUES (p_message, p_exec, v_version)
            ON CONFLICT (message_id) DO UPDATE SET version = excluded.version;
    END IF;
    IF p_step_kind IS NULL THEN
        DELETE FROM session_message_change WHERE message_id = p_message;
    ELSE
        INSERT INTO session_message_change(message_id, version, kind, data)
            VALUES (p_message, v_version, p_step_kind, p_step_data)
            ON CONFLICT (message_id) DO UPDATE SET version = excluded.version,
                kind = excluded.kind, data = excluded.data;
    END IF;
    IF p_signal THEN
        PERFORM ts_signal_watchers(v_session);
    END IF;
    RETURN v_version;
END $$;

"""
    + pg_set_wise(
        "ts_begin_assistants",
        "ts_begin_assistant",
        [("session", "text"), ("exec", "text"), ("owner", "text"), ("message", "text")],
        [("verdict", "text"), ("seq", "bigint")],
        constants="'" + _EMPTY_DATA.replace("'", "''") + "'",
    )
    + pg_set_wise(
        "ts_append_texts",
        "ts_append_text",
        [
            ("session", "text"),
            ("exec", "text"),
            ("owner", "text"),
            ("message", "text"),
            ("text", "text"),
            ("after", "bigint"),
        ],
        [("verdict", "text"), ("version", "bigint")],
    )
)
