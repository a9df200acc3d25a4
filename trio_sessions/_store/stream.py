"""Stream reads behind `runtime.stream()` (DESIGN §5.2): what changed since a position.

A *position* is what a stream's client holds: every message with `seq <= top` (the one at
`top` identified by a tag of its id; top 0 with no tag: nothing held yet), all of them final
except the *open* ones listed with the version the client has. `stream_changes` answers,
from one read snapshot, the changes that bring such a client up to date, and `stream_heads`
reads, for many streams at once, what the change scan compares their positions with (newest
seqs, versions of named messages).

Invariants:
* work is proportional to the change, never to the transcript: a message is looked up by
  key or by `(session_id, seq)`; the data of a message is read only when the client must
  replace it; an open message the client follows append by append costs the new
  `session_message_delta` rows only;
* an "append" is one delta row (its text, as stored): the same events a live stream saw,
  as long as the deltas are not folded yet; a tool change or a finish folds them, and a
  client one version behind it gets the write's recorded step (`session_message_change`:
  a "part", a "finish") - one that missed more, or a write that was more than one event,
  gets the message whole;
* a read is bounded, so no read or the events made of it stalls the event loop (SQLite
  reads on it): at most `DELTAS_PER_READ` appends and about `NEW_BYTES_PER_READ` of their
  text (a client far behind in a long open reply gets the rest in the next reads, `more`),
  then at most `NEW_MESSAGES_PER_READ` new messages and about `NEW_BYTES_PER_READ` of their
  data and streamed text; the text streamed onto a message sent whole is joined by SQLite
  (`streamed_onto`), not row by row in Python;
* a message the client holds that is gone or replaced (another id at its seq) means the
  transcript was rewritten (truncate, delete): the answer starts from the newest of the
  position's *marks* (a few of the messages the client holds, by seq and tag) that is
  still stored with every mark below it - message ids are never reused, and a truncate
  deletes a suffix, a delete everything, so such a message and every one before it are
  the client's still (a message set aside from the middle, `session_message_rejected`,
  leaves only the marks below it) - or from nothing when none is (the client is told to
  drop what follows, then gets every message after it, in bounded pages).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from typing import Any

import attrs

from .. import _codec
from .._backend import FALLBACK, Tx, autocommit_when_alone, pg_read_batched, reads_stored_bytes
from .._errors import MalformedRecord
from .._model import AssistantData, Message, Step
from .._validate import MAX_INT64
from .common import (
    _chunks,
    _in_list,
    leading,
    leading_rows,
    placed,
    spend_rows,
    streamed_texts_of,
)
from .transcript import _decode_message, _streamed_texts


@functools.lru_cache(maxsize=4096)  # the change scan tags the same open messages every look
def message_tag(message_id: str) -> str:
    """A short, stable tag of a message id (12 hex digits): tells a message from the one
    that replaced it at the same seq, without putting whole ids into cursors."""
    return hashlib.blake2b(message_id.encode(), digest_size=6).hexdigest()


@attrs.frozen
class Held:
    """An open message a client holds: its seq, tag and the version it has."""

    seq: int
    tag: str
    version: int


# One below every seq but the smallest a store holds (SQLite INTEGER, PostgreSQL bigint): the
# seq a client that holds nothing reads after, so a message another tool wrote at a seq
# below 1 is read - and refused as malformed, as `transcript()` refuses it.
BEFORE_EVERY_SEQ = -(2**63)


@attrs.frozen
class Position:
    """What a stream's client holds (see the module docstring). `marks`: (seq, tag) of some
    of the messages it holds below its top, where a read after a rewrite may resume - known
    to a stream that sent them, not part of a cursor nor of the position's identity."""

    top: int = 0
    top_tag: str = ""
    open: tuple[Held, ...] = ()
    marks: tuple[tuple[int, str], ...] = attrs.field(default=(), eq=False, repr=False)

    @property
    def holds_top(self) -> bool:
        """Whether the client holds a message (top 0 with no tag: nothing yet; a message
        another tool wrote at seq 0 has its tag)."""
        return self.top != 0 or self.top_tag != ""

    @property
    def after(self) -> int:
        """The seq the messages new to this client follow."""
        return self.top if self.holds_top else BEFORE_EVERY_SEQ

    def named(self) -> list[tuple[int, str]]:
        """The messages this position names, as (seq, tag): its top (if any), then the open
        ones - each of which must still hold, or the transcript was rewritten."""
        top = [(self.top, self.top_tag)] if self.holds_top else []
        return top + [(held.seq, held.tag) for held in self.open]


@attrs.frozen
class Whole:
    """A message to send whole: its row as a `Message` (or why it does not decode), its
    version and whether it can still change."""

    seq: int
    message_id: str
    message: Message | MalformedRecord
    version: int
    open: bool


@attrs.frozen
class Appended:
    """One delta row of an open message: the text appended, making `version`."""

    seq: int
    message_id: str
    text: str
    version: int


@attrs.frozen
class Stepped:
    """The one event - a tool part, a finish - that made an open message's `version`."""

    seq: int
    message_id: str
    step: Step
    version: int


Change = Whole | Appended | Stepped


@attrs.frozen
class StreamChanges:
    """The changes from a position, in order. `rewritten`: the client must drop what it
    holds past `kept` first (None: everything), and the changes are those from `kept`.
    `more`: new messages were left out (a bounded read); ask again."""

    changes: list[Change]
    rewritten: bool = False
    more: bool = False  # also: an open message's appends were left out
    # The ids of the messages the position names (top and open ones) that still hold.
    ids: dict[int, str] = attrs.field(factory=dict)
    # After a rewrite: the part of the position that still holds (its top a mark).
    kept: Position | None = None


# The most new messages one read sends whole, and about the most bytes of their data (at
# least one message): a long transcript, or one of large tool results, is sent in pages,
# so no read stalls the event loop (SQLite reads and decodes on it).
NEW_MESSAGES_PER_READ = 200
NEW_BYTES_PER_READ = 1 << 20
# The most appends one read sends (and about `NEW_BYTES_PER_READ` of their text): a client
# that resumes early in a long open reply (100,000 words) gets it in pages too - the rows
# read, and the events and cursors the stream makes of them on the event loop: 10-15 ms of
# CPU a page on a slow 2-core machine (5,000 a page took 50-76 ms there, over §6.26's 50).
# PostgreSQL's `ts_stream_changes_many` holds it (one more, for `more`): a change to it is a
# change to that function, so a new schema version.
DELTAS_PER_READ = 1_000

# A message's version as streams order it (for `session_message m`): the newest of its
# row's and its deltas'.
_VERSION = (
    "COALESCE((SELECT MAX(d.version) FROM session_message_delta d WHERE d.message_id = m.id),"
    " m.version)"
)
# A message's row as `_whole_from` takes it (for `session_message m`).
_WHOLE_COLUMNS = f"m.id, m.role, m.seq, m.data, m.execution_id, m.input_id, {_VERSION}"


def _pg_arguments(session_id: str, position: Position, limit: int) -> dict[str, Any]:
    """`ts_stream_changes`'s arguments for a read from `position`, by name."""
    return {
        "session": session_id,
        "named": [seq for seq, _ in position.named()],
        "open_seqs": [held.seq for held in position.open],
        "open_versions": [held.version for held in position.open],
        "top": position.after,
        "limit": limit,
    }


def _read_arguments(args: tuple[Any, ...]) -> tuple[str, Position, int]:
    """A `stream_changes` job's arguments, its limit defaulted."""
    session_id, position, *rest = args
    return session_id, position, int(rest[0]) if rest else NEW_MESSAGES_PER_READ


def _pg_pack(args: tuple[Any, ...]) -> dict[str, Any]:
    return _pg_arguments(*_read_arguments(args))


def _pg_interpret(args: tuple[Any, ...], rows: Sequence[tuple[Any, ...]]) -> Any:
    found = _changes_from_rows(*_read_arguments(args), rows)
    return FALLBACK if found is None else found


@pg_read_batched("ts_stream_changes_many", _pg_pack, _pg_interpret)
@autocommit_when_alone
@reads_stored_bytes
def stream_changes(
    tx: Tx, session_id: str, position: Position, limit: int = NEW_MESSAGES_PER_READ
) -> StreamChanges:
    """The changes that bring a client at `position` up to date (at most `limit` new
    messages; `more` says there are others). On PostgreSQL one call of `ts_stream_changes`
    (alone: one autocommit statement, one snapshot; the reads of one hand-off: one call of
    `ts_stream_changes_many`); a rewritten transcript is read by statements after it."""
    if tx.dialect == "postgres":
        arguments = _pg_arguments(session_id, position, limit)
        rows = tx.call("ts_stream_changes", *arguments.values())
        found = _changes_from_rows(session_id, position, limit, rows)
        if found is None:  # a rewrite, or a step row that does not decode: they tell which
            return stream_changes_by_statements(tx, session_id, position, limit)
        return found
    return stream_changes_by_statements(tx, session_id, position, limit)


def stream_changes_by_statements(
    tx: Tx, session_id: str, position: Position, limit: int = NEW_MESSAGES_PER_READ
) -> StreamChanges:
    """`stream_changes` as a few statements, each an index probe (SQLite's form; on
    PostgreSQL the reference `ts_stream_changes` is checked against)."""
    ids: dict[int, str] = {}
    for seq, tag in position.named():
        row = tx.one(
            "SELECT id FROM session_message WHERE session_id = ? AND seq = ?", (session_id, seq)
        )
        if row is None or message_tag(str(row[0])) != tag:
            return _rewritten(tx, session_id, position, limit)
        ids[seq] = str(row[0])
    changes: list[Change] = []
    for held in position.open:
        found, cut = _changes_of_open(tx, session_id, ids[held.seq], held, _room(changes))
        changes += found
        if cut:  # the rest of its appends, and what follows them, come with the next read
            return StreamChanges(changes, more=True, ids=ids)
    new, more = _new_messages(tx, session_id, position.after, limit)
    return StreamChanges(changes + new, more=more, ids=ids)


def _room(changes: Sequence[Change]) -> tuple[int, int]:
    """How many more appends, and about how many more bytes of their text, a read that
    found `changes` may send (`DELTAS_PER_READ`, `NEW_BYTES_PER_READ`)."""
    appended = [change.text for change in changes if isinstance(change, Appended)]
    return DELTAS_PER_READ - len(appended), NEW_BYTES_PER_READ - sum(map(len, appended))


def _changes_from_rows(
    session_id: str, position: Position, limit: int, rows: Sequence[tuple[Any, ...]]
) -> StreamChanges | None:
    """`stream_changes` from `ts_stream_changes`'s rows; None when a message the position
    names is gone or replaced (the transcript was rewritten: read from scratch) or a step
    row does not decode (that message goes whole)."""
    ids: dict[int, str] = {}
    wholes: dict[int, tuple[Any, ...]] = {}
    fresh: list[tuple[Any, ...]] = []
    appended: dict[int, list[tuple[int, str]]] = {}
    deltas_of: dict[str, list[tuple[int, str]]] = {}
    steps: dict[int, Stepped] = {}
    for kind, seq, message_id, role, data, execution_id, input_id, version, text in rows:
        if kind == "step":
            try:
                step = _codec.decode_step(role, data, key=message_id)
            except MalformedRecord:
                return None  # the statements' read sends that message whole
            steps[seq] = Stepped(seq, message_id, step, version)
        elif kind == "named":
            if message_id is not None:  # else no message is at that seq now
                ids[seq] = message_id
        elif kind == "append":
            appended.setdefault(seq, []).append((version, text))
        elif kind == "delta":
            deltas_of.setdefault(message_id, []).append((version, text))
        else:
            row = (message_id, role, seq, data, execution_id, input_id, version)
            if kind == "whole":
                wholes[seq] = row
            else:
                fresh.append(row)
    # Every pair the position names, not one tag per seq: its top and an open message
    # may name one seq (the same message, or a position no stream makes - one seq, two
    # tags - which the statements' read also takes for a rewrite).
    if any(seq not in ids or message_tag(ids[seq]) != tag for seq, tag in position.named()):
        return None
    streamed = {key: [text for _, text in sorted(texts)] for key, texts in deltas_of.items()}
    fresh.sort(key=lambda row: placed(row[2]))
    changes: list[Change] = []
    for held in position.open:
        if held.seq in wholes:
            changes.append(_whole_of(session_id, wholes[held.seq], streamed))
            continue
        if held.seq in steps:
            changes.append(steps[held.seq])
        deltas = sorted(appended.get(held.seq, []))
        message_id = ids[held.seq]
        texts = _codec.decode_streamed([text for _, text in deltas], key=message_id)
        kept = _within(texts, _room(changes))
        changes += [
            Appended(held.seq, message_id, text, version)
            for (version, _), text in zip(deltas, kept, strict=False)
        ]
        if len(kept) < len(texts):  # as `stream_changes_by_statements` pages them
            return StreamChanges(changes, more=True, ids=ids)
    sized = [(*row, text_bytes([row[3], *streamed.get(str(row[0]), [])])) for row in fresh]
    page, more = leading(sized, count=limit, size_bytes=NEW_BYTES_PER_READ)
    changes += [_whole_of(session_id, tuple(row), streamed) for row in page]
    return StreamChanges(changes, more=more, ids=ids)


def _within(texts: list[str], room: tuple[int, int]) -> list[str]:
    """The leading texts that fit in `room` (`_room`; at least one when any fits)."""
    count, size_bytes = room
    kept: list[str] = []
    for text in texts[: max(count, 0)]:
        size_bytes -= len(text)
        if kept and size_bytes < 0:
            break
        kept.append(text)
    return kept


def _whole_of(session_id: str, row: tuple[Any, ...], streamed: dict[str, list[str]]) -> Whole:
    return _whole_from(session_id, row, streamed.get(str(row[0]), []))


def _from_scratch(tx: Tx, session_id: str, limit: int) -> StreamChanges:
    new, more = _new_messages(tx, session_id, BEFORE_EVERY_SEQ, limit)
    return StreamChanges(new, rewritten=True, more=more)


def marked(seq: int, top: int) -> bool:
    """Whether a stream whose newest message is at `top` keeps the mark (seq, tag) of the
    message it sent at `seq` below it, for a read after a rewrite (`Position.marks`): a
    multiple of 2**i within 4 * 2**i of the top. At most two per power of two - a few dozen
    however long the transcript - and for any seq n below the top, one at most `top - n`
    below n: after a truncate past n, the stream sends again fewer messages than were
    deleted, not the transcript. Once false for a seq, false for every later top."""
    return 0 < seq < top and top - seq < 4 * (seq & -seq)


def _marked_seqs(top: int) -> list[int]:
    """Every seq `marked` below `top`: for each power of two, its multiples within four of
    it below the top (a few dozen)."""
    seqs: set[int] = set()
    power = 1
    while power < top:
        first = (top - 4 * power) // power * power + power
        seqs.update(range(max(first, power), top, power))
        power *= 2
    return sorted(seq for seq in seqs if marked(seq, top))


# A stream opened at a cursor whose newest message is at least this far in reads its marks
# as it opens (`stream_marks`): below, sending the transcript again after a truncate costs
# about what that read would.
MARKS_FROM = 64


@reads_stored_bytes
def stream_marks(tx: Tx, session_id: str, top: int) -> tuple[tuple[int, str], ...]:
    """The marks (seq, tag) of the messages stored now at the seqs a stream whose newest
    message is at `top` keeps (`marked`): for a stream opened at a cursor, which knows only
    its newest message. They hold for its client once a later read finds that message still
    stored: ids are never reused, and a truncate or a delete below it would have removed
    it too. One statement (on PostgreSQL in a read transaction: two round trips)."""
    seqs = _marked_seqs(top)
    marks: list[tuple[int, str]] = []
    for chunk in _chunks(seqs):
        for seq, message_id in tx.execute(
            "SELECT seq, id FROM session_message WHERE session_id = ?"
            f" AND seq IN {_in_list(chunk)}",
            (session_id, *chunk),
        ).fetchall():
            if isinstance(message_id, str) and type(seq) is int:
                marks.append((seq, message_tag(message_id)))
    return tuple(sorted(marks))


def _rewritten(tx: Tx, session_id: str, position: Position, limit: int) -> StreamChanges:
    """The changes for a client whose position no longer holds: from the part of it that
    still does (`_kept`), else from nothing."""
    kept = _kept(tx, session_id, position)
    if kept is None:
        return _from_scratch(tx, session_id, limit)
    # `kept` has no marks: should it not hold either (an open message it keeps was
    # replaced, which no truncate or delete does), this read is from scratch.
    found = stream_changes_by_statements(tx, session_id, kept, limit)
    return found if found.rewritten else attrs.evolve(found, rewritten=True, kept=kept)


def _kept(tx: Tx, session_id: str, position: Position) -> Position | None:
    """The position up to the newest of its marks that is stored - the same id at its seq
    - with every mark below it (None: none is): a truncate deletes the messages past a seq
    and a delete all of them, and ids are never reused, so the client holds that message
    and each before it as stored - unless a message below it was set aside from the middle
    of the transcript (`drop_quarantined`, the one writer that deletes there: a row of
    `session_message_rejected`), so only marks below the first such seq are taken. A probe
    per mark (a stream keeps a few: `EventStream`), then one for the set-aside seqs."""
    marked = sorted({(seq, tag) for seq, tag in position.marks if seq < position.top})
    stored: dict[int, str] = {}
    for chunk in _chunks(sorted({seq for seq, _ in marked})):
        for seq, message_id in tx.execute(
            "SELECT seq, id FROM session_message WHERE session_id = ?"
            f" AND seq IN {_in_list(chunk)}",
            (session_id, *chunk),
        ).fetchall():
            stored[placed(seq)] = str(message_id)
    top: tuple[int, str] | None = None
    for seq, tag in marked:
        message_id = stored.get(seq)
        if message_id is None or message_tag(message_id) != tag:
            break
        top = (seq, tag)
    if top is None:
        return None
    # Read after the marks: a set-aside committed before that read is seen here.
    (first_set_aside,) = tx.one(
        "SELECT MIN(seq) FROM session_message_rejected WHERE session_id = ?", (session_id,)
    )
    if first_set_aside is not None and placed(first_set_aside) <= top[0]:
        below = [mark for mark in marked if mark[0] < placed(first_set_aside)]
        if not below:
            return None
        top = below[-1]
    return Position(*top, tuple(held for held in position.open if held.seq <= top[0]))


def _changes_of_open(
    tx: Tx, session_id: str, message_id: str, held: Held, room: tuple[int, int]
) -> tuple[list[Change], bool]:
    """An open message's changes since `held`: its new deltas, after the step that made its
    version when that is the one the client missed; else the message whole. At most the
    deltas that fit in `room` (`_room`); the flag says whether others were left out."""
    version, kind, data = tx.one(
        "SELECT m.version, c.kind, c.data FROM session_message m"
        " LEFT JOIN session_message_change c ON c.message_id = m.id AND c.version = m.version"
        " WHERE m.id = ?",
        (message_id,),
    )
    changes: list[Change] = []
    # One another tool wrote as no number goes last, as everywhere in a stream's order (a
    # bare `TypeError` here, else): the client gets the message whole.
    version = placed(version)
    if version > held.version:
        step = _step_missed(held, version, kind, data, message_id)
        if step is None:
            return [_whole(tx, session_id, message_id)], False
        changes.append(Stepped(held.seq, message_id, step, version))
    count, size_bytes = room
    rows, cut = leading_rows(
        tx.execute(
            "SELECT version, text, length(text) FROM session_message_delta"
            " WHERE message_id = ? AND version > ? ORDER BY version LIMIT ?",
            (message_id, held.version, max(count, 0) + 1),
        ),
        count=max(count, 0),
        size_bytes=size_bytes,
    )
    texts = _codec.decode_streamed(
        [_codec.streamed_text(version, text) for version, text in rows], key=message_id
    )
    appended = [
        Appended(held.seq, message_id, text, placed(version))
        for (version, _), text in zip(rows, texts, strict=True)
    ]
    return changes + appended, cut


def _step_missed(held: Held, version: int, kind: Any, data: Any, message_id: str) -> Step | None:
    """The step recorded with a message's `version` when it is the one change a client at
    `held` missed and it decodes; None: the client gets the message whole (more changed,
    the deltas it missed are folded now; or the step row is unreadable)."""
    if version != held.version + 1 or kind is None:
        return None
    try:
        return _codec.decode_step(kind, data, key=message_id)
    except MalformedRecord:
        return None


def _whole(tx: Tx, session_id: str, message_id: str) -> Whole:
    row = tx.one(
        f"SELECT {_WHOLE_COLUMNS} FROM session_message m WHERE m.id = ?",
        (message_id,),
    )
    return _decoded(tx, session_id, row)


def _new_messages(tx: Tx, session_id: str, after: int, limit: int) -> tuple[list[Change], bool]:
    """The messages past seq `after`, whole (`NEW_MESSAGES_PER_READ`, and about
    `NEW_BYTES_PER_READ` of their data and streamed text), and whether others were left out."""
    rows = tx.execute(
        f"SELECT {_WHOLE_COLUMNS}, length(m.data) FROM session_message m"
        " WHERE m.session_id = ? AND m.seq > ? ORDER BY m.seq LIMIT ?",
        (session_id, after, limit + 1),
    )
    kept, more = leading_rows(rows, count=limit, size_bytes=NEW_BYTES_PER_READ)
    wholes: list[Change] = []
    size = 0
    for row in kept:
        streamed = _streamed_of(tx, row)
        size += text_bytes([row[3], *streamed])
        if wholes and size > NEW_BYTES_PER_READ:
            return wholes, True  # its streamed text filled the read: it comes with the next
        wholes.append(_whole_from(session_id, row, streamed))
    return wholes, more


def _decoded(tx: Tx, session_id: str, row: Sequence[Any]) -> Whole:
    return _whole_from(session_id, row, _streamed_of(tx, row))


def _streamed_of(tx: Tx, row: Sequence[Any]) -> list[Any]:
    """The texts streamed onto the message of a `_WHOLE_COLUMNS` row (`streamed_onto`)."""
    return streamed_onto(tx, str(row[0])) if row[1] == "assistant" else []


# SQLite: a message's streamed texts joined in version order. The search by the WITHOUT
# ROWID table's primary key (message_id, version) reads the rows in that order, and the
# aggregate joins them as read; SQLite 3.40 takes no ORDER BY in an aggregate, and an
# ordered subquery in between doubles the cost. An index that covered `text` would change
# the order: tests/store/test_stream_catch_up.py pins this plan (and
# tests/test_watch_look_statements.py that of a change look's join of several messages,
# `GROUP BY message_id`). The columns: how many of the texts are no text or have a version
# that is no whole number, and the texts joined.
JOINED_COLUMNS = (
    "sum(typeof(text) <> 'text' OR typeof(version) <> 'integer'), group_concat(text, '')"
)
JOIN_STREAMED = f"SELECT {JOINED_COLUMNS} FROM session_message_delta WHERE message_id = ?"


def streamed_onto(tx: Tx, message_id: str) -> list[Any]:
    """The texts streamed onto a message since its data was written, as
    `_codec.decode_streamed` checks them and `_transcript.with_streamed` joins them. On
    SQLite, joined by SQLite into one when every one is text: an open reply of 150,000
    words is one C loop (~20 ms), not 150,000 Python rows (~100 ms) - and on the event
    loop only as many rows and as much text as its budget allows (`spend_rows`): more goes
    to the worker thread.
    Row by row otherwise: a row that is no text, or whose version is no whole number (its
    place unknown: `_codec.Misplaced`), is named by its index, and PostgreSQL's reads run in
    threads."""
    if tx.dialect == "sqlite":
        # Its rows and their text charged first, read no further than the loop's budget
        # reaches: 150,000 rows took the join 35-60 ms here, 25 of 2 MB each 160 ms.
        spend_rows(
            tx, (message_id,), "length(text) FROM session_message_delta WHERE message_id = ?"
        )
        not_text, joined = tx.one(JOIN_STREAMED, (message_id,))
        return streamed_joined(tx, message_id, not_text, joined)
    return _streamed_texts(tx, message_id)


def streamed_joined(tx: Tx, message_id: str, not_text: Any, joined: Any) -> list[Any]:
    """`streamed_onto` from what SQLite joined (`JOINED_COLUMNS`): the one text when every
    one is text, else the texts read again row by row (`_codec.decode_streamed` names the
    bad one)."""
    if joined is None:
        return []
    if not not_text and isinstance(joined, str):
        return [joined]
    return _streamed_texts(tx, message_id)


def text_bytes(values: Sequence[Any]) -> int:
    """About the bytes of these stored texts - a message's data and the texts streamed onto
    it - as SQL's `length` counts them (anything else another tool stored counts 0)."""
    return sum(len(value) for value in values if isinstance(value, str | bytes))


def _whole_from(session_id: str, row: Sequence[Any], streamed: Sequence[Any]) -> Whole:
    """A message row - (id, role, seq, data, execution_id, input_id, version) - with the
    texts streamed onto it, as a `Whole`."""
    message_id, seq = str(row[0]), placed(row[2])
    message: Message | MalformedRecord
    try:
        message = _decode_message(session_id, row[:6], streamed)
    except MalformedRecord as exc:
        message = exc
    still_open = isinstance(message, Message) and (
        isinstance(message.data, AssistantData) and not message.data.finished
    )
    return Whole(seq, message_id, message, placed(row[6]), still_open)


@attrs.frozen
class Tail:
    """A page of a transcript, as the console shows it: its messages oldest first (each a
    `Whole`: a `Message`, or why its row does not decode), whether earlier ones exist, and
    - for the newest page - the position a stream's client holding exactly these messages
    is at (None for an earlier page, or when the newest row has no id or seq to name)."""

    messages: list[Whole]
    earlier: bool
    position: Position | None


@reads_stored_bytes
def transcript_tail(tx: Tx, session_id: str, before: int | None, limit: int) -> Tail:
    """The last `limit` messages with a seq below `before` (None: the newest), with their
    streamed text merged, from one read snapshot: keyset paging on `(session_id, seq)`, so
    a page costs the same however long the transcript. The newest page comes with the
    stream position of what it shows (`stream_changes` from it sends exactly what changed
    since this read: no gap, no duplicate): its top is the newest message, and the open
    messages it follows are the open ones shown - an open message before the page is not
    shown, so its changes are not followed either. A statement for the messages, and one
    per `_IN_CHUNK` of the page's assistant messages for their deltas (one for a page of
    `TRANSCRIPT_PAGE_SIZE`), however long the transcript."""
    where = "m.session_id = ?" + ("" if before is None else " AND m.seq < ?")
    rows = tx.execute(
        f"SELECT {_WHOLE_COLUMNS} FROM session_message m WHERE {where} ORDER BY m.seq DESC LIMIT ?",
        (session_id, limit + 1) if before is None else (session_id, before, limit + 1),
    ).fetchall()
    kept = rows[:limit][::-1]
    streamed = streamed_texts_of(tx, [str(row[0]) for row in kept if row[1] == "assistant"])
    wholes = [_whole_from(session_id, row, streamed.get(str(row[0]), [])) for row in kept]
    position = None
    if before is None and not kept:
        position = Position()
    elif before is None and isinstance(kept[-1][0], str):  # else an id that is not UTF-8
        position = _position_of(wholes)
    return Tail(wholes, earlier=len(rows) > limit, position=position)


def _position_of(wholes: Sequence[Whole]) -> Position | None:
    """What a client holding these messages (the newest last) holds; None when the newest
    has no seq to name (SQLite keeps text in an INTEGER column: placed last)."""
    newest = wholes[-1]
    if newest.seq == MAX_INT64:
        return None
    held = tuple(
        Held(whole.seq, message_tag(whole.message_id), whole.version)
        for whole in wholes
        if whole.open
    )
    return Position(newest.seq, message_tag(newest.message_id), held)


@attrs.frozen
class Shown:
    """What the console's event stream reads when it opens for a page at a stream
    position: the ids of the messages stored at the seqs the page shows (from its first
    one, at most the `limit` the console asks for: `FOLLOWED_IDS`), and the open messages
    the position holds, as stored now."""

    ids: dict[int, str]
    held: list[Whole]


@reads_stored_bytes
def shown_messages(tx: Tx, session_id: str, low: int, position: Position, limit: int) -> Shown:
    """The messages a page showing seqs `low` to `position.top` holds, as stored now (see
    `Shown`): the ids by an index range of at most `limit` rows, without their data; the
    open messages the position names whole, with their streamed text, a statement for
    their rows and one for their deltas per `_IN_CHUNK` of them (the caller bounds how
    many a position may name). An open message whose seq holds another message now is
    left out (the transcript was rewritten: a stream from the position says so)."""
    rows: list[Sequence[Any]] = []
    # A page from past the top shows no seq; and `low` may be 2**63 (a position at the last
    # seq: none follows it), which SQLite cannot bind.
    if low <= position.top:
        rows = tx.execute(
            "SELECT seq, id FROM session_message WHERE session_id = ? AND seq >= ? AND seq <= ?"
            " ORDER BY seq LIMIT ?",
            (session_id, low, position.top, limit),
        ).fetchall()
    ids = {placed(seq): str(message_id) for seq, message_id in rows}
    tags = {held.seq: held.tag for held in position.open}
    found: list[Sequence[Any]] = []
    for chunk in _chunks(sorted(tags)):
        found += tx.execute(
            f"SELECT {_WHOLE_COLUMNS} FROM session_message m WHERE m.session_id = ?"
            f" AND m.seq IN {_in_list(chunk)} ORDER BY m.seq",
            (session_id, *chunk),
        ).fetchall()
    same = [row for row in found if message_tag(str(row[0])) == tags.get(placed(row[2]))]
    streamed = streamed_texts_of(tx, [str(row[0]) for row in same if row[1] == "assistant"])
    held = [_whole_from(session_id, row, streamed.get(str(row[0]), [])) for row in same]
    return Shown(ids, held)


# The most streams one catch-up read answers (`stream_catch_up`): the change scan's read
# stays short on the event loop however many streams are behind.
STREAMS_PER_CATCH_UP = 100


@autocommit_when_alone
@reads_stored_bytes
def stream_catch_up(tx: Tx, reads: Sequence[tuple[str, Position]]) -> list[StreamChanges | None]:
    """For many streams at once, on one snapshot: per `(session_id, position)`, exactly what
    `stream_changes` would answer, or None - the stream reads by itself. The change scan's
    read for the streams it found behind: under a chat load every commit of a worker
    leaves many streams one append behind, and a read per stream would cost the event loop
    a transaction and a few statements per stream per word.

    On SQLite, set-wise in three statements however many streams: the messages the
    positions name, the sessions with a message past a position's top, and the new deltas
    of the open messages held; a stream that misses more than appends (a message changed
    whole, a new message, a rewritten transcript, a row that does not decode) or more than
    `DELTAS_PER_READ` of them gets None - and so does one past `DELTAS_PER_READ` appends
    for the catch-up in all (`_within_one_step`).
    On PostgreSQL, one call of `ts_stream_changes_many`; None only for a rewritten
    transcript."""
    if not reads:
        return []
    if tx.dialect == "postgres":
        rows = tx.call(
            "ts_stream_changes_many",
            _codec.dumps([_pg_arguments(s, p, NEW_MESSAGES_PER_READ) for s, p in reads]),
        )
        by_read: dict[int, list[tuple[Any, ...]]] = {}
        for ordinal, *row in rows:
            by_read.setdefault(int(ordinal), []).append(tuple(row))
        return _within_one_step(
            [
                _changes_from_rows(s, p, NEW_MESSAGES_PER_READ, by_read.get(ordinal, []))
                for ordinal, (s, p) in enumerate(reads, start=1)
            ]
        )
    answers: list[StreamChanges | None] = []
    room = DELTAS_PER_READ
    for start in range(0, len(reads), STREAMS_PER_CATCH_UP):
        found, room = _appends_set_wise(tx, reads[start : start + STREAMS_PER_CATCH_UP], room)
        answers += found
    return answers


def _within_one_step(answers: list[StreamChanges | None]) -> list[StreamChanges | None]:
    """A catch-up's answers, the streams past `DELTAS_PER_READ` appends in all left to read
    by themselves: the stream makes the events of every answer in one step of the event
    loop (ten streams 4,000 words behind: 155 ms, a review measured), while a stream's own
    reads page them, one step each."""
    room = DELTAS_PER_READ
    kept: list[StreamChanges | None] = []
    for answer in answers:
        if answer is not None:
            appended = sum(isinstance(change, Appended) for change in answer.changes)
            if appended > room:
                answer = None
            else:
                room -= appended
        kept.append(answer)
    return kept


def _appends_set_wise(
    tx: Tx, reads: Sequence[tuple[str, Position]], room: int
) -> tuple[list[StreamChanges | None], int]:
    """`stream_catch_up` on SQLite for a chunk of reads, sending at most `room` appends in
    all (a read past it gets None: `_within_one_step`, decided before its deltas are read);
    returns the answers and the room left."""
    named = sorted({(s, seq) for s, p in reads for seq, _ in p.named()})
    # Per named message: its id, its row's version and its newest version (`_VERSION`).
    rows: dict[tuple[str, int], tuple[str, int, int]] = {}
    if named:
        for session, seq, message_id, version, newest in tx.execute(
            f"WITH w(s, q) AS (VALUES {_values(len(named), 2)})"
            f" SELECT w.s, w.q, m.id, m.version, {_VERSION} FROM w"
            " JOIN session_message m ON m.session_id = w.s AND m.seq = w.q",
            tuple(value for pair in named for value in pair),
        ).fetchall():
            rows[(str(session), placed(seq))] = (str(message_id), placed(version), placed(newest))
    tops = sorted({(s, p.after) for s, p in reads})
    newer = {
        (str(session), int(top))
        for session, top in tx.execute(
            f"WITH w(s, t) AS (VALUES {_values(len(tops), 2)}) SELECT w.s, w.t FROM w"
            " WHERE EXISTS (SELECT 1 FROM session_message m"
            " WHERE m.session_id = w.s AND m.seq > w.t)",
            tuple(value for pair in tops for value in pair),
        ).fetchall()
    }
    # Per read: the ids its position names, or None when it misses more than appends.
    ids_of: list[dict[int, str] | None] = []
    for session, position in reads:
        found: dict[int, str] = {}
        for seq, tag in position.named():
            row = rows.get((session, seq))
            if row is None or message_tag(row[0]) != tag:
                break  # rewritten
            found[seq] = row[0]
        else:
            if (session, position.after) not in newer and all(
                _only_appends(rows[(session, h.seq)], h) for h in position.open
            ):
                missed = sum(rows[(session, h.seq)][2] - h.version for h in position.open)
                if missed <= room:
                    room -= missed
                    ids_of.append(found)
                    continue
        # Rewritten, a new message, an open one changed whole, or more appends than a read
        # sends, or than this catch-up has room left for: its own read pages them.
        ids_of.append(None)
    held = sorted(
        {
            (ids[h.seq], h.version)
            for (_, position), ids in zip(reads, ids_of, strict=True)
            if ids is not None
            for h in position.open
        }
    )
    deltas: dict[tuple[str, int], list[tuple[int, Any]]] = {}
    if held:
        for message_id, after, version, text in tx.execute(
            f"WITH w(m, v) AS (VALUES {_values(len(held), 2)})"
            " SELECT w.m, w.v, d.version, d.text FROM w"
            " JOIN session_message_delta d ON d.message_id = w.m AND d.version > w.v"
            " ORDER BY w.m, w.v, d.version",
            tuple(value for pair in held for value in pair),
        ).fetchall():
            deltas.setdefault((str(message_id), placed(after)), []).append(
                (placed(version), _codec.streamed_text(version, text))
            )
    answers: list[StreamChanges | None] = []
    for (_, position), ids in zip(reads, ids_of, strict=True):
        if ids is None:
            answers.append(None)
            continue
        changes: list[Change] = []
        try:
            for h in position.open:
                message_id = ids[h.seq]
                rows_of = deltas.get((message_id, h.version), [])
                texts = _codec.decode_streamed([text for _, text in rows_of], key=message_id)
                changes += [
                    Appended(h.seq, message_id, text, version)
                    for (version, _), text in zip(rows_of, texts, strict=True)
                ]
        except MalformedRecord:
            answers.append(None)  # its own read raises it, to this stream only
            continue
        answers.append(StreamChanges(changes, ids=ids))
    return answers, room


def _only_appends(row: tuple[str, int, int], held: Held) -> bool:
    """Whether a client holding an open message at `held` missed only appends to it, and
    no more than one read sends (`row`: its id, row version and newest version)."""
    _, version, newest = row
    return version <= held.version and newest - held.version <= DELTAS_PER_READ


def _values(rows: int, columns: int) -> str:
    """`(?, ?), (?, ?), ...`: a VALUES list of `rows` rows of placeholders."""
    row = "(" + ", ".join("?" * columns) + ")"
    return ", ".join([row] * rows)


@attrs.frozen
class Heads:
    """What the change scan found for a set of streams: per session, its newest message
    seq (absent: no message); per message id asked about, its version (absent: gone)."""

    newest: dict[str, int]
    versions: dict[str, int]


def stream_heads(tx: Tx, tops: dict[str, int], message_ids: Sequence[str]) -> Heads:
    """The newest seq of each session past `tops[session]` (absent when none is newer), and
    the current version of each message id. A few statements, whatever the count; each an
    index probe, never a scan of a transcript."""
    versions: dict[str, int] = {}
    for chunk in _chunks(sorted(set(message_ids))):
        for message_id, version in tx.execute(
            f"SELECT m.id, {_VERSION} FROM session_message m WHERE m.id IN {_in_list(chunk)}",
            tuple(chunk),
        ).fetchall():
            versions[str(message_id)] = placed(version)
    newest: dict[str, int] = {}
    sessions = sorted(tops)
    for start in range(0, len(sessions), _SESSIONS_PER_STATEMENT):
        chunk = sessions[start : start + _SESSIONS_PER_STATEMENT]
        terms = " OR ".join(["(session_id = ? AND seq > ?)"] * len(chunk))
        for session, seq in tx.execute(
            f"SELECT session_id, MAX(seq) FROM session_message WHERE {terms} GROUP BY session_id",
            tuple(value for s in chunk for value in (s, tops[s])),
        ).fetchall():
            newest[str(session)] = placed(seq)
    return Heads(newest, versions)


_SESSIONS_PER_STATEMENT = 200


# ---------------------------------------------------------------------------------------------
# PostgreSQL: this family's server-side functions (created by `_schema`'s migrations; see
# `_store.pg_functions` for their conventions)

PG_FUNCTIONS = r"""
-- stream_changes for many streams in one statement (one snapshot), set-wise: p_positions is
-- a JSON array of ts_stream_changes' arguments by name; rows (ord, ts_stream_changes'
-- columns) for each position. Each lookup is an index probe per position (OFFSET 0 keeps
-- the planner from flattening it into a join that scans a whole table: it guesses a
-- hundred elements in any JSON array), in a plan made once per connection (a generic
-- plan: nothing in it depends on the values).
CREATE OR REPLACE FUNCTION ts_stream_changes_many(p_positions text, p_now bigint,
    p_retry boolean)
RETURNS TABLE(ord bigint, kind text, seq bigint, id text, role text, data text,
    execution_id text, input_id text, version bigint, text text)
LANGUAGE plpgsql STABLE SET plan_cache_mode = force_generic_plan AS $$
BEGIN
    RETURN QUERY WITH pos AS MATERIALIZED (
        SELECT p.ord, p.pos->>'session' AS session, (p.pos->>'top')::bigint AS top,
                (p.pos->>'limit')::bigint AS lim, p.pos
            FROM jsonb_array_elements(p_positions::jsonb) WITH ORDINALITY AS p(pos, ord)
    ), open_rows AS MATERIALIZED (
        SELECT pos.ord, o.seq::bigint AS seq,
                (pos.pos->'open_versions'->>(o.n::int - 1))::bigint AS held,
                m.id, m.version AS row_version
            FROM pos CROSS JOIN LATERAL jsonb_array_elements_text(pos.pos->'open_seqs')
                WITH ORDINALITY AS o(seq, n)
            CROSS JOIN LATERAL (SELECT m.id, m.version FROM session_message m
                WHERE m.session_id = pos.session AND m.seq = o.seq::bigint OFFSET 0) m
    ), opened AS MATERIALIZED (
        SELECT h.*, c.kind AS step, c.data AS step_data
            FROM open_rows h LEFT JOIN LATERAL (SELECT c.kind, c.data
                FROM session_message_change c WHERE c.message_id = h.id
                AND c.version = h.row_version AND h.row_version = h.held + 1 OFFSET 0) c ON true
    ), whole AS MATERIALIZED (
        SELECT o.ord, 'whole' AS kind, r.*
            FROM opened o CROSS JOIN LATERAL (
                SELECT m.id, m.role, m.seq, m.data, m.execution_id, m.input_id, m.version
                    FROM session_message m WHERE m.id = o.id OFFSET 0) r
            WHERE o.row_version > o.held AND o.step IS NULL
        UNION ALL
        SELECT pos.ord, 'new', f.id, f.role, f.seq, f.data, f.execution_id, f.input_id,
                f.version
            FROM pos CROSS JOIN LATERAL (
                SELECT n.*, COALESCE(SUM(n.size) OVER (ORDER BY n.seq
                        ROWS BETWEEN UNBOUNDED PRECEDING AND 2 PRECEDING), 0) AS before
                    FROM (SELECT m.id, m.role, m.seq, m.data, m.execution_id, m.input_id,
                            m.version, COALESCE(length(m.data), 0) + CASE
                                WHEN m.role = 'assistant' THEN COALESCE((
                                    SELECT SUM(length(d.text)) FROM session_message_delta d
                                    WHERE d.message_id = m.id), 0)
                                ELSE 0 END AS size
                        FROM session_message m
                        WHERE m.session_id = pos.session AND m.seq > pos.top
                        ORDER BY m.seq LIMIT pos.lim + 1) n) f
            WHERE f.before <= {new_bytes_per_read}
    )
    SELECT pos.ord, 'named', n.seq::bigint, m.id, NULL, NULL, NULL, NULL, NULL::bigint, NULL
        FROM pos CROSS JOIN LATERAL jsonb_array_elements_text(pos.pos->'named') AS n(seq)
        LEFT JOIN LATERAL (SELECT m.id FROM session_message m
            WHERE m.session_id = pos.session AND m.seq = n.seq::bigint OFFSET 0) m ON true
    UNION ALL
    SELECT w.ord, w.kind, w.seq, w.id, w.role, w.data, w.execution_id, w.input_id,
            COALESCE((SELECT MAX(d.version) FROM session_message_delta d
                      WHERE d.message_id = w.id), w.version), NULL
        FROM whole w
    UNION ALL
    SELECT o.ord, 'step', o.seq, o.id, o.step, o.step_data, NULL, NULL, o.row_version, NULL
        FROM opened o WHERE o.step IS NOT NULL
    UNION ALL
    SELECT o.ord, 'append', o.seq, o.id, NULL, NULL, NULL, NULL, d.version, d.text
        FROM opened o CROSS JOIN LATERAL (SELECT d.version, d.text FROM session_message_delta d
            WHERE d.message_id = o.id AND d.version > o.held
            ORDER BY d.version LIMIT {appends_per_call}) d
        WHERE o.row_version <= o.held OR o.step IS NOT NULL
    UNION ALL
    SELECT w.ord, 'delta', w.seq, w.id, NULL, NULL, NULL, NULL, d.version, d.text
        FROM whole w CROSS JOIN LATERAL (SELECT d.version, d.text FROM session_message_delta d
            WHERE d.message_id = w.id OFFSET 0) d
        WHERE w.role = 'assistant';
END $$;

-- stream_changes in one statement (one snapshot): rows (kind, seq, id, role, data,
-- execution_id, input_id, version, text) - 'named': the id at each seq the position names
-- (NULL: none); for each open message held at a version, 'whole' (its row, when its data
-- changed since: the deltas are folded) or 'append' (each newer delta: version, text),
-- after its 'step' (role: the kind, data: the event's) when the write that changed its
-- data since is the one step the client missed;
-- 'new': the messages past p_top, at most p_limit + 1, cut by size in seq order: each one
-- whose predecessors but the nearest hold at most NEW_BYTES_PER_READ of data and streamed
-- text - so the first message over that much, and one more to tell the caller that more
-- follow (it cuts the page, as `leading` does); 'delta': the streamed texts of each
-- whole and new assistant message (version, text). Unordered: the caller sorts, and
-- compares the named ids with its tags (a mismatch: the transcript was rewritten, read
-- from scratch). The set-wise read above, for one position: one query for both.
CREATE OR REPLACE FUNCTION ts_stream_changes(p_session text, p_named bigint[],
    p_open_seqs bigint[], p_open_versions bigint[], p_top bigint, p_limit bigint,
    p_now bigint, p_retry boolean)
RETURNS TABLE(kind text, seq bigint, id text, role text, data text, execution_id text,
    input_id text, version bigint, text text)
LANGUAGE sql STABLE AS $$
    SELECT c.kind, c.seq, c.id, c.role, c.data, c.execution_id, c.input_id, c.version, c.text
        FROM ts_stream_changes_many(jsonb_build_array(jsonb_build_object(
            'session', p_session, 'named', p_named, 'open_seqs', p_open_seqs,
            'open_versions', p_open_versions, 'top', p_top, 'limit', p_limit))::text,
            p_now, p_retry) c
$$;
""".replace(
    # One page of a long open reply and one more (`more`): a reader far behind fetches a page
    # per read, not every missed delta each time (`_changes_from_rows` cuts the page).
    "{appends_per_call}",
    str(DELTAS_PER_READ + 1),
).replace(
    # And about a page of the messages it missed (`_changes_from_rows` cuts it too): a tool
    # result of a few hundred KB in each is no 200 of them in one read.
    "{new_bytes_per_read}",
    str(NEW_BYTES_PER_READ),
)
