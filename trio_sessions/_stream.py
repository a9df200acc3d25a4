"""Resumable event streams (DESIGN §5.2): a session's transcript as the events a UI applies.

An `EventStream` tracks what its client holds - a *position*: every message up to `top`,
final but for the open ones, each at a version - and yields the events that move the client
forward, each with the cursor of the position it reaches. Events come from two sources:

* *offers* from this runtime's writers (an append, a tool part, a finish, a new message), with
  the version the write made: applied only when it is exactly the next version of a message
  the client holds, so a write offered twice, or after a read already brought it, is sent once;
* *reads* of the store (`_store.stream_changes`) from the current position, whenever
  the stream is *dirty*: at its start, when an offer does not fit (a gap: a write this
  stream was not offered, or offers dropped because the consumer is slow), when a local write
  without an offer touched the session, or when the change scan (`StreamHub.look`) finds a
  named message changed, gone, or a newer message stored by another process;
* the change scan's *catch-up*: one read for every stream it found behind, or whose
  session a signal named (`_store.stream_catch_up`), applied to each stream still at the
  position it was read from - the appends another process made to the messages it
  follows; a stream that misses more, or is not free to take it (reading, offers or
  events waiting), is marked dirty and reads by itself.

A rewritten transcript (a truncate, a deletion) costs what it changed: the stream keeps
*marks* - the tags of a few messages it sent (`marked`: a few dozen) - and its read after
the rewrite resumes at the newest mark still stored with every one below it ("truncate"
there, then the messages after it); with none it sends every message again. A stream
opened at a cursor, which knows only its top, reads the marks of the messages stored as it
opens (past `MARKS_FROM`), and keeps them once a read finds its top still stored.

Invariants: an event is computed against the position the previous event reached, so
applying the events in order reproduces the transcript, with no gap and no duplicate; the
cursor names that position exactly, so a stream opened at it continues with the events after
it; a client's position is never advanced past what it was sent. Memory per stream is bounded
(a slow consumer's offers are dropped for one read); an idle stream costs no task.

Two hooks serve the library's own consumers (the console's page feed, which holds back
what a rewrite resends until the stream has sent all it read), not the public API:
`EventStream.left_out` (whether the last read, the stream's own or the change scan's
catch-up, left messages or appends out: more follow at once) and `EventStream.on_settled`
(awaited in the consumer's task after a read of the stream's own that brought no event and
left nothing out: no event would carry what is held back).
"""

from __future__ import annotations

import collections
import contextlib
import copy
import hashlib
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterator
from typing import Any, Literal

import attrs
import trio

from . import _store
from ._errors import MalformedRecord
from ._model import AssistantData, TextPart, ToolPart
from ._store.stream import (
    BEFORE_EVERY_SEQ,
    STREAMS_PER_CATCH_UP,
    Appended,
    Heads,
    Held,
    Position,
    Stepped,
    StreamChanges,
    Whole,
    marked,
    message_tag,
)
from ._validate import MAX_INT64

EventKind = Literal["message", "append", "part", "finish", "truncate"]


@attrs.frozen
class StreamEvent:
    """One change of a session's transcript, as `runtime.stream()` yields it.

    `kind` and `data`:

    * `"message"`: the message's full data as `transcript()` shows it (`AssistantData`, or a
      user/system message's dict): replace your copy of message `seq`;
    * `"append"`: `str`, text appended to assistant message `seq`: append it to its last text
      part (a new text part if the last part is a tool or there is none);
    * `"part"`: one `ToolPart`: add it, or replace the part with the same `call_id`;
    * `"finish"`: `{"error": str | None}`: mark message `seq` finished with that error;
    * `"truncate"`: `None` (and `role` is `""`): drop every message with a seq above `seq` -
      the transcript was rewritten (truncated or deleted); the current messages past `seq`
      follow (`seq` is 0 when none the client holds is known to be stored still).

    `cursor` is opaque (ASCII letters, digits and `.:,`, safe in an SSE `id:` field): pass it
    to `runtime.stream(..., cursor=)` to continue with exactly the events after this one.
    """

    cursor: str
    seq: int
    role: str
    kind: EventKind
    data: Any

    def to_json(self) -> dict[str, Any]:
        """The event as a JSON-ready dict (`data` as DESIGN §3 stores it; a copy)."""
        data = self.data
        if isinstance(data, AssistantData | ToolPart | TextPart):
            data = data.to_json()
        else:
            data = copy.deepcopy(data)
        return {
            "cursor": self.cursor,
            "seq": self.seq,
            "role": self.role,
            "kind": self.kind,
            "data": data,
        }


# ---------------------------------------------------------------------------------------------
# Cursors: "1.<session tag>.<top>.<top tag>.<seq>:<tag>:<version>,..." (the open messages)

# Seqs and versions: whole numbers up to the largest 64-bit integer (checked after parsing).
_NUMBER = r"(?:0|[1-9][0-9]{0,18})"
_TAG = r"[0-9a-f]{12}"
_CURSOR = re.compile(
    rf"1\.({_TAG})\.({_NUMBER})\.((?:{_TAG})?)\.((?:{_NUMBER}:{_TAG}:{_NUMBER}"
    rf"(?:,{_NUMBER}:{_TAG}:{_NUMBER})*)?)"
)


def session_tag(session_id: str) -> str:
    return hashlib.blake2b(session_id.encode(), digest_size=6, person=b"session").hexdigest()


def encode_cursor(session_id_tag: str, position: Position) -> str:
    held = ",".join(f"{h.seq}:{h.tag}:{h.version}" for h in position.open)
    return f"1.{session_id_tag}.{position.top}.{position.top_tag}.{held}"


def decode_cursor(session_id: str, cursor: object) -> Position:
    """The position a cursor names (None: nothing held yet); `ValueError` for a malformed
    cursor or another session's."""
    if cursor is None:
        return Position()
    if not isinstance(cursor, str):
        raise TypeError(f"cursor must be a str or None, got {type(cursor).__name__}")
    match = _CURSOR.fullmatch(cursor)
    if match is None:
        raise ValueError(f"malformed stream cursor: {cursor[:100]!r}")
    tag, top_text, top_tag, held_text = match.groups()
    if tag != session_tag(session_id):
        raise ValueError(f"the stream cursor belongs to another session than {session_id!r}")
    top = int(top_text)
    held = tuple(
        Held(int(seq), h_tag, int(version))
        for seq, h_tag, version in (item.split(":") for item in held_text.split(",") if item)
    )
    seqs = [h.seq for h in held]
    numbers = [top, *seqs, *(h.version for h in held)]
    # Holding nothing (no top tag): top 0 and no open message; else none above the top,
    # and an open top message under the top's own tag (one seq, one message).
    if (top_tag == "" and (top != 0 or seqs)) or any(seq > top for seq in seqs):
        raise ValueError(f"malformed stream cursor: {cursor[:100]!r}")
    if any(h.seq == top and h.tag != top_tag for h in held):
        raise ValueError(f"malformed stream cursor: {cursor[:100]!r}")
    if max(numbers) > MAX_INT64:
        raise ValueError(f"malformed stream cursor: {cursor[:100]!r}")
    if seqs != sorted(set(seqs)):
        raise ValueError(f"malformed stream cursor: {cursor[:100]!r}")
    return Position(top, top_tag, held)


# ---------------------------------------------------------------------------------------------
# Offers from this runtime's writers


@attrs.frozen
class Offer:
    """A local write to an assistant message, with the event it makes: `kind` "message" with
    `version == 0` for a message just begun; `open` whether it can change after this."""

    message_id: str
    seq: int
    version: int
    kind: EventKind
    data: Any
    open: bool


# A consumer this far behind the writers gets one read instead of the offers it missed.
MAX_PENDING_OFFERS = 1_000


Read = Callable[..., Awaitable[Any]]


@attrs.define
class _Open:
    """An open message the client holds; `message_id` unknown until a read names it."""

    tag: str
    version: int
    message_id: str | None


class EventStream(AsyncIterator[StreamEvent]):
    """One `runtime.stream()` block's feed of events (iterate it from one task)."""

    def __init__(
        self,
        session_id: str,
        position: Position,
        read: Read,
        marks: Collection[tuple[int, str]] = (),
    ) -> None:
        self.session_id = session_id
        self._session_tag = session_tag(session_id)
        self._read = read
        self._top = position.top
        self._top_tag = position.top_tag
        self._top_id: str | None = None
        # The marks of the messages sent below the top (`marked`): seq -> tag. A stream
        # opened at a cursor knows none below its top; the ones read as it opened
        # (`_store.stream_marks`) count once a read finds its top still stored
        # (`_confirm_marks`) - until then a rewrite sends it everything again.
        self._marks: dict[int, str] = {}
        self._unconfirmed_marks = dict(marks)
        self._open = {h.seq: _Open(h.tag, h.version, None) for h in position.open}
        self._offers: collections.deque[Offer] = collections.deque()
        # Newest version offered, per message held open or with an offer waiting: only
        # those are ever looked up (`behind`), so no entry outlives both, and a stream open
        # for a whole conversation holds none for the replies that finished.
        self._offered: dict[str, int] = {}
        self._ready: collections.deque[StreamEvent] = collections.deque()
        self._error: MalformedRecord | None = None
        self.dirty = True  # the first read brings the client up to date
        self._wakeup = trio.Event()
        self._closed = False
        self._iterating = False
        self._reading = False  # its own read is under way: its answer comes from before
        # Whether the last read (its own or the change scan's) left changes out: the
        # stream reads on at once, so a consumer holding something back until the stream
        # has sent all it read (the console's page feed after a rewrite) waits for the rest.
        self.left_out = False
        # Awaited in the consumer's task after a read of its own that brought no event and
        # left nothing out - the stream is up to date and has nothing to yield: what such a
        # consumer holds back goes out then (no event would carry it).
        self.on_settled: Callable[[], Awaitable[None]] | None = None
        # `_position()` as last built (None: the position moved since): every event's cursor
        # and every look's catch-up ask for it, and it changes far less often.
        self._position_now: Position | None = None

    # -- fed by the hub ---------------------------------------------------------------------

    def offer(self, offer: Offer) -> None:
        if len(self._offers) >= MAX_PENDING_OFFERS:
            self._offers.clear()
            self._forget_offered_unheld()
            self.dirty = True
        else:
            self._offers.append(offer)
            self._offered[offer.message_id] = max(
                offer.version, self._offered.get(offer.message_id, -1)
            )
        self._wakeup.set()

    def mark_dirty(self) -> None:
        self.dirty = True
        self._wakeup.set()

    def close(self) -> None:
        self._closed = True
        self._wakeup.set()

    def catch_up_position(self) -> Position | None:
        """The position a read for this stream by the change scan may start from (None:
        it must read by itself - it is due to anyway, is reading, or has offers or an
        error waiting, which go first, or events its consumer has not taken yet: a slow
        consumer's memory stays one read's answer, its next read waits for it)."""
        if self.dirty or self._reading or self._offers or self._ready or self._closed:
            return None
        if self._error is not None:
            return None
        return self._position()

    def catch_up(self, position: Position, changes: StreamChanges | None) -> None:
        """The change scan's read from `position` (`catch_up_position`): applied if the
        stream is still there and free to take it, else (or for None) it reads by itself."""
        now = self.catch_up_position()
        if changes is None or (now is not position and now != position):
            self.mark_dirty()
            return
        self._apply_read(changes)
        self._wakeup.set()

    def watched(self) -> tuple[int, list[str]]:
        """What the change scan must look at for this stream: the seq its new messages
        follow (`Position.after`: the newest it holds, if any), and the ids of the messages
        whose change or loss it must see (the top one, whose loss means a rewrite, and the
        open ones)."""
        ids = [held.message_id for held in self._open.values() if held.message_id is not None]
        if self._top_id is not None:
            ids.append(self._top_id)
        return self._position().after, ids

    def behind(self, heads: Heads) -> bool:
        """Whether the store holds more than this stream holds or was offered, judged
        against the stream's position now (the scan's read may have raced the offers)."""
        if heads.newest.get(self.session_id, BEFORE_EVERY_SEQ) > self._position().after:
            return True
        if self._top_id is not None and self._top_id not in heads.versions:
            return True
        for held in self._open.values():
            if held.message_id is None:
                continue
            known = max(held.version, self._offered.get(held.message_id, -1))
            if heads.versions.get(held.message_id, known + 1) > known:
                return True
        return False

    # -- iteration --------------------------------------------------------------------------

    def __aiter__(self) -> EventStream:
        return self

    async def __anext__(self) -> StreamEvent:
        if self._iterating:
            raise trio.BusyResourceError("another task is already iterating this stream")
        self._iterating = True
        try:
            return await self._next()
        finally:
            self._iterating = False

    async def _next(self) -> StreamEvent:
        while True:
            if self._ready:
                return self._ready.popleft()
            if self._error is not None:
                error, self._error = self._error, None
                raise error
            if self._offers:
                # Offers first: a read after them finds only what they did not bring.
                self._apply_offer(self._offers.popleft())
                continue
            if self._closed:
                raise StopAsyncIteration  # the block or the runtime is closing: no more reads
            if self.dirty:
                self.dirty = False
                self._reading = True
                try:
                    changes = await self._read(
                        _store.stream_changes, self.session_id, self._position()
                    )
                except BaseException:
                    self.dirty = True  # cancelled or failed: read again next time
                    raise
                finally:
                    self._reading = False
                self._apply_read(changes)
                if not (changes.more or self._ready) and self.on_settled is not None:
                    await self.on_settled()
                continue
            await self._wakeup.wait()
            self._wakeup = trio.Event()

    def take_ready(self) -> list[StreamEvent]:
        """The events that follow the last one at once, without waiting or reading the
        store: the events of the last read not taken yet and the offers waiting, applied -
        in the order iteration would yield them. A consumer that got an event writes these
        with it in one go: one socket write instead of one each, so a consumer that fell
        behind catches up in fewer, larger writes. Empty when the next event needs a read
        or a wait; an error waiting is left to the next `__anext__`. At most
        `MAX_PENDING_OFFERS` offers wait, so the list stays bounded."""
        if self._iterating:
            raise trio.BusyResourceError("another task is already iterating this stream")
        taken: list[StreamEvent] = []
        while True:
            if self._ready:
                taken.append(self._ready.popleft())
            elif self._offers and self._error is None:
                self._apply_offer(self._offers.popleft())
            else:
                return taken

    def _position(self) -> Position:
        if self._position_now is None:
            held = tuple(Held(seq, h.tag, h.version) for seq, h in sorted(self._open.items()))
            marks = tuple(self._marks.items())
            self._position_now = Position(self._top, self._top_tag, held, marks)
        return self._position_now

    def _confirm_marks(self) -> None:
        """A read found the top still stored: the marks read as the stream opened, from
        before that read, name messages its client holds (a truncate or a delete below the
        top would have removed the top too; ids are never reused)."""
        if self._unconfirmed_marks:
            for seq, tag in self._unconfirmed_marks.items():
                if marked(seq, self._top):
                    self._marks.setdefault(seq, tag)
            self._unconfirmed_marks.clear()
            self._position_now = None

    def _new_top(self, seq: int, tag: str, message_id: str) -> None:
        """The client holds a message past its top now: the old top is marked if it is
        to be (`marked`), and the marks no longer to be are forgotten."""
        if self._top_tag:
            self._marks[self._top] = self._top_tag
        self._top, self._top_tag, self._top_id = seq, tag, message_id
        for old in [old for old in self._marks if not marked(old, seq)]:
            del self._marks[old]
        self._position_now = None

    def _emit(self, kind: EventKind, seq: int, role: str, data: Any) -> None:
        cursor = encode_cursor(self._session_tag, self._position())
        self._ready.append(StreamEvent(cursor, seq, role, kind, data))

    def _apply_read(self, read: StreamChanges) -> None:
        self.left_out = read.more
        if read.more:
            self.dirty = True
        if read.rewritten:
            # Read before the top was found gone: they may name what the client does not hold.
            self._unconfirmed_marks.clear()
            # Drop what follows the part of the position that still holds (`read.kept`:
            # its top a mark of this stream's; None: nothing holds).
            kept = read.kept or Position()
            self._top, self._top_tag, self._top_id = kept.top, kept.top_tag, None
            for seq in [seq for seq in self._open if seq > kept.top or not kept.holds_top]:
                del self._open[seq]
            for seq in [seq for seq in self._marks if seq >= kept.top or not kept.holds_top]:
                del self._marks[seq]
            self._forget_offered_unheld()
            self._position_now = None
            self._emit("truncate", kept.top, "", None)
        if self._top in read.ids:
            self._top_id = read.ids[self._top]
            self._confirm_marks()
        for seq, held in self._open.items():
            held.message_id = read.ids.get(seq, held.message_id)
        for change in read.changes:
            if isinstance(change, Appended):
                self._open[change.seq].version = change.version
                self._position_now = None
                self._emit("append", change.seq, "assistant", change.text)
                continue
            if isinstance(change, Stepped):
                self._take_step(change)
                continue
            if not self._take_whole(change):
                return

    def _take_whole(self, change: Whole) -> bool:
        message = change.message
        if isinstance(message, MalformedRecord):
            self._error = message
            self.dirty = True  # read again: an operator may repair it
            return False
        tag = message_tag(change.message_id)
        self._position_now = None
        # Holding nothing yet (no top tag), the first message is the top whatever its seq.
        if not self._top_tag or change.seq > self._top:
            self._new_top(change.seq, tag, change.message_id)
        if change.open:
            self._open[change.seq] = _Open(tag, change.version, change.message_id)
        else:
            self._drop(change.seq)
        self._emit("message", change.seq, message.role, message.data)
        return True

    def _take_step(self, change: Stepped) -> None:
        kind, data = change.step
        self._open[change.seq].version = change.version
        self._position_now = None
        if kind == "finish":
            self._drop(change.seq)
        self._emit(kind, change.seq, "assistant", data)

    def _drop(self, seq: int) -> None:
        held = self._open.pop(seq, None)
        self._position_now = None
        if held is not None and held.message_id is not None:
            self._offered.pop(held.message_id, None)

    def _forget_offered_unheld(self) -> None:
        """Drop the offered versions of messages neither held open nor with an offer
        waiting (the offers were dropped, or the transcript was rewritten)."""
        keep = {held.message_id for held in self._open.values()}
        keep.update(offer.message_id for offer in self._offers)
        for message_id in [m for m in self._offered if m not in keep]:
            del self._offered[message_id]

    def _apply_offer(self, offer: Offer) -> None:
        held = self._open.get(offer.seq)
        if offer.version == 0 and held is None and offer.seq == self._top + 1 and not self.dirty:
            # A message just begun right after the newest one held: nothing in between. (Not
            # while a read is due: the messages held may have been rewritten meanwhile.)
            tag = message_tag(offer.message_id)
            self._new_top(offer.seq, tag, offer.message_id)
            self._open[offer.seq] = _Open(tag, 0, offer.message_id)
            self._position_now = None
            self._emit("message", offer.seq, "assistant", offer.data)
            return
        if held is None or held.message_id != offer.message_id:
            # Not a message this client follows (yet): read. The read brings it as it is
            # then, so what was offered of it is moot: a message a read found finished
            # meanwhile would otherwise stay on record for the stream's whole life.
            self._offered.pop(offer.message_id, None)
            self.dirty = True
            return
        if offer.version <= held.version:
            return  # already sent (by a read, or offered twice)
        if offer.version != held.version + 1:
            self.dirty = True  # a change in between was not offered here
            return
        held.version = offer.version
        self._position_now = None
        if not offer.open:
            self._drop(offer.seq)
        self._emit(offer.kind, offer.seq, "assistant", offer.data)


class StreamHub:
    """Every stream of this runtime, by session."""

    def __init__(self) -> None:
        self._streams: dict[str, set[EventStream]] = {}
        # Sessions with a local write in flight: its offer follows, so the change scan
        # leaves their streams alone (it would send whole what the offer sends as a delta).
        self._writing: collections.Counter[str] = collections.Counter()

    @contextlib.contextmanager
    def writing(self, session_id: str) -> Iterator[None]:
        """Around a local write that offers its change (or touches) when it returns."""
        self._writing[session_id] += 1
        try:
            yield
        finally:
            self._writing[session_id] -= 1
            if not self._writing[session_id]:
                del self._writing[session_id]

    def open(
        self,
        session_id: str,
        position: Position,
        read: Read,
        marks: Collection[tuple[int, str]] = (),
    ) -> EventStream:
        stream = EventStream(session_id, position, read, marks)
        self._streams.setdefault(session_id, set()).add(stream)
        return stream

    def remove(self, stream: EventStream) -> None:
        stream.close()
        streams = self._streams.get(stream.session_id, set())
        streams.discard(stream)
        if not streams:
            self._streams.pop(stream.session_id, None)

    def watching(self, session_id: str) -> bool:
        """Whether any stream follows this session (a writer builds no offer otherwise)."""
        return session_id in self._streams

    def offer(self, session_id: str, offer: Offer) -> None:
        for stream in self._streams.get(session_id, ()):
            stream.offer(offer)

    def touch(self, session_id: str) -> None:
        """A local write this hub was offered nothing for changed the session's messages."""
        for stream in self._streams.get(session_id, ()):
            stream.mark_dirty()

    async def look(self, read: Read, signalled: Collection[str] | None = None) -> None:
        """After a change signal: catch up the streams behind the store (`_catch_up`; a
        stream already dirty reads by itself). The streams of the sessions a signal named
        are caught up at once: those sessions changed. After a signal that named none
        (None: a fallback poll, a reconnect), one heads read finds which of all the streams
        are behind."""
        streams = [
            stream
            for session_id, group in self._streams.items()
            if session_id not in self._writing and (signalled is None or session_id in signalled)
            for stream in group
            if not stream.dirty
        ]
        if not streams:
            return
        if signalled is not None:
            # Mostly another process's appends to these very sessions, and the catch-up read
            # answers a stream that is not behind with nothing (one not free to take it
            # reads by itself): a heads read first would cost every streamed word a second
            # round trip.
            await self._catch_up(streams, read)
            return
        tops: dict[str, int] = {}
        ids: list[str] = []
        for stream in streams:
            top, named = stream.watched()
            tops[stream.session_id] = min(top, tops.get(stream.session_id, top))
            ids += named
        heads = await read(_store.stream_heads, tops, ids)
        await self._catch_up([stream for stream in streams if stream.behind(heads)], read)

    async def _catch_up(self, streams: list[EventStream], read: Read) -> None:
        """One read for the streams behind (`stream_catch_up`, per `STREAMS_PER_CATCH_UP`),
        its answers applied to the streams still at the position it read from: under a
        chat load, a worker's commit leaves many streams one append behind, and a read of
        their own each would cost a transaction and a few statements per stream per word.
        A stream the read does not answer (it misses more than appends) reads by itself."""
        for start in range(0, len(streams), STREAMS_PER_CATCH_UP):
            asked: list[tuple[EventStream, Position]] = []
            for stream in streams[start : start + STREAMS_PER_CATCH_UP]:
                position = stream.catch_up_position()
                if position is None:
                    stream.mark_dirty()
                else:
                    asked.append((stream, position))
            if not asked:
                continue
            try:
                answers = await read(
                    _store.stream_catch_up,
                    [(stream.session_id, position) for stream, position in asked],
                )
            except BaseException:
                for stream, _ in asked:
                    stream.mark_dirty()  # each reads by itself, and sees any error itself
                raise
            for (stream, position), answer in zip(asked, answers, strict=True):
                stream.catch_up(position, answer)

    def close(self) -> None:
        for streams in self._streams.values():
            for stream in streams:
                stream.close()
