"""Watchers of live transcripts, fed by local writes and by the change signal (no SQL).

A `Watcher` holds, per message, the newest snapshot not yet delivered. Snapshots are ordered
by the message's durable `version` (bumped by every change), so a snapshot offered twice -
once by the local writer, once by a store scan - is delivered once, and an older state is
never delivered after a newer one. A slow watcher skips intermediate snapshots of a message
but always gets its latest. A watcher replaying its history holds what is offered live past
the replay's reach until the replay reached it: the history first (DESIGN §5). Idle watchers
cost no task and no polling: the runtime's one change loop offers them what changed, reading
only what changed (the hub below). What a watcher and the hub remember per message follows
the transcript: a message a rewrite removed (truncate, delete) is forgotten once a look read
the session whole.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import attrs
import trio

from . import _store
from ._errors import MalformedRecord
from ._model import Message

Snapshot = Message | MalformedRecord
# The newest version seen of a message never seen: below every version a 64-bit column
# holds. Our writes count from 0, but another tool may write a negative version, and a
# watcher comparing with -1 dropped that message's every snapshot, silently.
NEVER_SEEN = -(2**63) - 1
# The executor's `read`: runs a read-only store operation off the event loop.
Read = Callable[..., Awaitable[Any]]


class Watcher(AsyncIterator[Message]):
    """One `runtime.watch()` block's feed of message snapshots."""

    def __init__(self, session_id: str, after_seq: int) -> None:
        self.session_id = session_id
        self.after_seq = after_seq
        self._pending: dict[str, tuple[Snapshot, int]] = {}
        # While the history is replayed: how far its replay reached (None once it is over),
        # and the newest snapshot offered of each message past that (with its seq), held
        # until the replay reaches the message - else a reply written now would come
        # before the questions it answers (DESIGN §5: the history first).
        self._reach: int | None = after_seq
        self._held: dict[str, tuple[Snapshot, int, int]] = {}
        self._seen: dict[str, int] = {}
        # Messages gone whose last snapshot still waits: delivered, but not remembered.
        self._forgotten: set[str] = set()
        self._ready = trio.Event()
        self._closed = False

    def offer(self, message_id: str, seq: int, snapshot: Snapshot, version: int) -> None:
        """A message was created or changed; keep it if newer than anything held for it."""
        if seq <= self.after_seq:
            return
        reach = self._reach
        if reach is not None and seq <= reach and message_id in self._held:
            # The replay reached a message offered live meanwhile: its newest snapshot
            # takes the message's place in the history (the replay's is older, or it).
            self._pending[message_id] = self._held.pop(message_id)[:2]
            self._ready.set()
        if version <= self._newest(message_id):
            return
        if reach is not None and seq > reach:
            self._held[message_id] = (snapshot, version, seq)
            return
        self._pending[message_id] = (snapshot, version)
        self._ready.set()

    def replaying_to(self, seq: int) -> None:
        """The replay offers the history up to `seq` next (at once, in seq order)."""
        self._reach = seq

    def replay_over(self) -> None:
        """The history is all offered: what waited past it follows, in seq order."""
        self._reach = None
        self._release_held()

    def _release_held(self) -> None:
        for message_id, (snapshot, version, _) in sorted(
            self._held.items(), key=lambda item: item[1][2]
        ):
            self._pending[message_id] = (snapshot, version)
        self._held.clear()
        self._ready.set()

    def close(self) -> None:
        self._closed = True
        self._release_held()

    def forget(self, message_id: str) -> None:
        """The message no longer exists (its transcript was rewritten): nothing more is
        offered for it, so no version of it need be remembered - once a snapshot still
        waiting for the consumer, if any, was delivered. One held back for the replay is
        dropped: released after the replay, it would come after the message that took its
        seq (a review's find)."""
        self._held.pop(message_id, None)
        if message_id in self._pending:
            self._forgotten.add(message_id)
        else:
            self._seen.pop(message_id, None)

    def _newest(self, message_id: str) -> int:
        held = self._held.get(message_id) or self._pending.get(message_id)
        return held[1] if held is not None else self._seen.get(message_id, NEVER_SEEN)

    def __aiter__(self) -> Watcher:
        return self

    async def __anext__(self) -> Message:
        # A checkpoint per message, also when one is ready: a consumer working through a
        # long replay never holds the event loop for the whole of it.
        await trio.lowlevel.checkpoint()
        while not self._pending:
            if self._closed:
                raise StopAsyncIteration
            await self._ready.wait()
            self._ready = trio.Event()
        message_id = next(iter(self._pending))
        snapshot, version = self._pending.pop(message_id)
        if message_id in self._forgotten:
            self._forgotten.discard(message_id)
        else:
            self._seen[message_id] = version
        if isinstance(snapshot, MalformedRecord):
            raise snapshot
        return snapshot


@attrs.define(eq=False)
class _Session:
    """One watched session: its watchers and what they were offered (`_store.Followed`)."""

    watchers: set[Watcher] = attrs.Factory(set)
    covered: bool = False  # a head was read: looks may follow it
    high_seq: int = 0
    high_id: str | None = None
    open: dict[str, _store.Snapshot] = attrs.Factory(dict)
    known: dict[str, int] = attrs.Factory(dict)
    # The messages remembered in `known` since the current look began (`followed`).
    fresh: set[str] = attrs.Factory(set)
    # How many times messages gone were forgotten: a replay read before the latest time
    # may hold such a message, which must not look new to the hub.
    forgettings: int = 0
    # The lowest `after_seq` of the watchers, set on the loop as they come and go, read by
    # a look when it reads (`Followed.floor`): a watcher that entered after the look began
    # may have replayed a message the look's rewrite read must then offer it again.
    floor: int = 0

    def lowest_after_seq(self) -> int:
        return self.floor


class WatchHub:
    """Every watcher of this runtime, by session, and what each session's watchers were
    offered: the newest seq a look covered and the messages that may still change. One look
    serves every watcher of a session (many watchers share one read), and it reads only
    past that seq and those messages - never the whole transcript (DESIGN §6.26)."""

    def __init__(self) -> None:
        self._sessions: dict[str, _Session] = {}
        # The session the next look visits first: the first one the last look read none of
        # the news of, other sessions' having filled it (`Watched.crowded`). The looks go
        # round the sessions so: each visits its first one with room, so the first crowded
        # out is always another, further on - one session gaining a look's worth before
        # every look never starves those after it.
        self._first: str | None = None

    def add(self, session_id: str, after_seq: int) -> Watcher:
        watcher = Watcher(session_id, after_seq)
        session = self._sessions.setdefault(session_id, _Session(floor=after_seq))
        session.floor = min(session.floor, after_seq)
        session.watchers.add(watcher)
        return watcher

    def remove(self, watcher: Watcher) -> None:
        watcher.close()
        session = self._sessions.get(watcher.session_id)
        if session is None:
            return
        session.watchers.discard(watcher)
        if not session.watchers:
            del self._sessions[watcher.session_id]
        else:
            session.floor = min(other.after_seq for other in session.watchers)

    async def replay(self, watcher: Watcher, read: Read) -> None:
        """A new watcher's history up to the session's newest message now, in short reads (a
        long transcript never holds the event loop); what comes after, the change loop finds."""
        session_id, after_seq = watcher.session_id, watcher.after_seq
        through, _ = head = await read(_store.newest_message, session_id)
        self.cover(session_id, head)
        while after_seq < through:
            forgettings = self._forgettings(session_id)
            replayed = await read(_store.watched_messages, session_id, after_seq, through)
            if not replayed:
                break
            # Read before messages gone were forgotten: it may hold them, and offered as
            # news they would reach the watchers that had them already. Its own, then.
            stale = self._forgettings(session_id) != forgettings
            after_seq = replayed[-1].seq
            watcher.replaying_to(after_seq)
            for snapshot in replayed:
                self.publish(snapshot, only=watcher, remember=not stale)
        watcher.replay_over()

    def _forgettings(self, session_id: str) -> int:
        session = self._sessions.get(session_id)
        return 0 if session is None else session.forgettings

    def cover(self, session_id: str, head: tuple[int, str | None]) -> None:
        """The session's newest message when its first watcher entered: later looks read
        only past it (its watchers replay what came before, in chunks of their own)."""
        session = self._sessions.get(session_id)
        if session is not None and not session.covered:
            session.covered = True
            session.high_seq, session.high_id = head

    def watching(self, session_id: str) -> bool:
        """Whether any watcher follows this session (a writer builds no snapshot otherwise)."""
        return session_id in self._sessions

    def followed(self) -> dict[str, _store.Followed]:
        """Per watched session, what a look starts from, in the order it visits them (from
        the one the last look crowded out on, round: `_first`). The open messages are a
        copy (a few per session): a look may read on a worker thread (PostgreSQL), on a
        snapshot taken before a local write that adds one - the look would take that
        message, absent from its snapshot, for gone and stop following it (or meet it
        removed meanwhile). `known` is the hub's own: a look only looks versions up in it,
        and one newer than its snapshot was offered by the local write that made it."""
        for session in self._sessions.values():
            session.fresh.clear()  # a look begins
        order = list(self._sessions.items())
        start = next((i for i, (s, _) in enumerate(order) if s == self._first), 0)
        return {
            session_id: _store.Followed(
                session.high_seq,
                session.high_id,
                dict(session.open),
                session.known,
                session.lowest_after_seq,
            )
            for session_id, session in order[start:] + order[:start]
            if session.covered
        }

    def apply(self, found: _store.Watched) -> None:
        """What a look found: publish it and move each session's covered seq on."""
        self._first = found.crowded[0] if found.crowded else None
        for message_id in found.gone:
            for watched in self._sessions.values():
                watched.open.pop(message_id, None)
        for session_id, present in found.present.items():
            session = self._sessions.get(session_id)
            if session is not None:
                self._forget_gone(session, present)
        for snapshot in found.messages:
            self.publish(snapshot)
        for session_id, (high_seq, high_id) in found.heads.items():
            session = self._sessions.get(session_id)
            if session is not None:
                session.high_seq, session.high_id = high_seq, high_id

    @staticmethod
    def _forget_gone(session: _Session, present: frozenset[str]) -> None:
        """A look read the session's whole transcript (`present`: its messages then): the
        messages remembered before that look began and not among them no longer exist, and
        no look offers them again (ids are never reused), so neither the hub nor a watcher
        keeps their versions - else a watcher open across many edits would hold every
        message it ever saw. One remembered since the look began may have been written
        after its read: it stays."""
        gone = [m for m in session.known if m not in present and m not in session.fresh]
        if gone:
            session.forgettings += 1
        for message_id in gone:
            session.known.pop(message_id, None)
            session.open.pop(message_id, None)
            for watcher in session.watchers:
                watcher.forget(message_id)

    def publish(
        self, snapshot: _store.Snapshot, only: Watcher | None = None, *, remember: bool = True
    ) -> None:
        """Offer a snapshot to the session's watchers (or to `only`, a watcher replaying
        its history) and remember it (unless `remember` is False: offered to `only`
        alone): an open message is followed until it is finished."""
        session = self._sessions.get(snapshot.session_id)
        if session is None:
            return
        message_id = snapshot.message_id
        # A replay past the covered seq is not remembered: the next look still finds that
        # message new and offers it to the session's other watchers too.
        remember = remember and (only is None or snapshot.seq <= session.high_seq)
        offered_to = session.watchers if only is None else {only}
        known = session.known.get(message_id, NEVER_SEEN)
        if remember and snapshot.version >= known:
            session.known[message_id] = snapshot.version
            session.fresh.add(message_id)
            if snapshot.open:
                session.open[message_id] = snapshot
            else:
                session.open.pop(message_id, None)
            if snapshot.version > known:
                # Remembered, this version is one no later look offers again: a replay
                # that read it first (another process wrote it since the last look) offers
                # it to every watcher of the session. (One the hub knew was offered to
                # them all then: a replay of it stays the replaying watcher's.)
                offered_to = session.watchers
        for watcher in offered_to:
            watcher.offer(message_id, snapshot.seq, snapshot.message, snapshot.version)

    def close(self) -> None:
        for session in self._sessions.values():
            for watcher in session.watchers:
                watcher.close()
