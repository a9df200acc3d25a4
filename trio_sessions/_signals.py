"""Watchers of live transcripts, fed by local writes and by the change signal (no SQL).

A `Watcher` holds, per message, the newest snapshot not yet delivered. Snapshots are ordered
by the message's durable `version` (bumped by every change), so a snapshot offered twice -
once by the local writer, once by a store scan - is delivered once, and an older state is
never delivered after a newer one. A slow watcher skips intermediate snapshots of a message
but always gets its latest. Idle watchers cost no task and no polling: the runtime's one
change loop offers them what changed.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import trio

from ._errors import MalformedRecord
from ._model import Message

Snapshot = Message | MalformedRecord


class Watcher(AsyncIterator[Message]):
    """One `runtime.watch()` block's feed of message snapshots."""

    def __init__(self, session_id: str, after_seq: int) -> None:
        self.session_id = session_id
        self.after_seq = after_seq
        self._pending: dict[str, tuple[Snapshot, int]] = {}
        self._seen: dict[str, int] = {}
        self._ready = trio.Event()
        self._closed = False

    def offer(self, message_id: str, seq: int, snapshot: Snapshot, version: int) -> None:
        """A message was created or changed; keep it if newer than anything held for it."""
        if seq <= self.after_seq or version <= self._newest(message_id):
            return
        self._pending[message_id] = (snapshot, version)
        self._ready.set()

    def close(self) -> None:
        self._closed = True
        self._ready.set()

    def _newest(self, message_id: str) -> int:
        held = self._pending.get(message_id)
        return held[1] if held is not None else self._seen.get(message_id, -1)

    def __aiter__(self) -> Watcher:
        return self

    async def __anext__(self) -> Message:
        while not self._pending:
            if self._closed:
                raise StopAsyncIteration
            await self._ready.wait()
            self._ready = trio.Event()
        message_id = next(iter(self._pending))
        snapshot, version = self._pending.pop(message_id)
        self._seen[message_id] = version
        if isinstance(snapshot, MalformedRecord):
            raise snapshot
        return snapshot


class WatchHub:
    """Every watcher of this runtime, by session; what each session's watchers have seen."""

    def __init__(self) -> None:
        self._watchers: dict[str, set[Watcher]] = {}
        self._known: dict[str, dict[str, int]] = {}

    def add(self, session_id: str, after_seq: int) -> Watcher:
        watcher = Watcher(session_id, after_seq)
        self._watchers.setdefault(session_id, set()).add(watcher)
        self._known.setdefault(session_id, {})
        return watcher

    def remove(self, watcher: Watcher) -> None:
        watcher.close()
        watchers = self._watchers.get(watcher.session_id, set())
        watchers.discard(watcher)
        if not watchers:
            self._watchers.pop(watcher.session_id, None)
            self._known.pop(watcher.session_id, None)

    def watching(self, session_id: str) -> bool:
        """Whether any watcher follows this session (a writer builds no snapshot otherwise)."""
        return session_id in self._watchers

    def watched(self) -> dict[str, dict[str, int]]:
        """Per watched session, the newest version offered of each message (a store scan
        only fetches messages newer than this)."""
        return {session_id: dict(known) for session_id, known in self._known.items()}

    def publish(
        self, session_id: str, message_id: str, seq: int, snapshot: Snapshot, version: int
    ) -> None:
        watchers = self._watchers.get(session_id)
        if not watchers:
            return
        known = self._known[session_id]
        known[message_id] = max(known.get(message_id, -1), version)
        for watcher in watchers:
            watcher.offer(message_id, seq, snapshot, version)

    def close(self) -> None:
        for watchers in self._watchers.values():
            for watcher in watchers:
                watcher.close()
