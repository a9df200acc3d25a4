"""SQLite's change signal: `ChangeReader` reads on a connection of its own, on the trio
thread, and tells a waiting runtime when another connection committed.

Invariants: a read runs on one snapshot (one deferred transaction, rolled back: it never
takes the write lock, so it never waits for a writer), and decodes at most `budget` units of
data on the event loop (`_codec.loop_budget`: a read meeting more raises
`_codec.OffTheLoop`, which the threaded executor answers by running it in its worker
thread); `PRAGMA data_version` on a connection changes with every commit made on any other
connection. Read on the connection the event loop commits on (`own_conn`), it changes with
every commit but the loop's own: other processes', and this process's worker thread's (those
get a look, conservatively). The loop's own commits are handled where they are made (a
doorbell rung, a claim interrupted, a due timer armed, a watcher or stream offered its
write, the change loop kicked), so they are no change, as PostgreSQL skips its own writers'
notifications. The deterministic executor's `own_conn` is its one connection; it asks
`_changed` itself, at its fallback poll on the virtual clock, never watching in real time.
A change is reported at most every `CHANGE_GAP` seconds, and where the WAL file cannot be
watched the reader polls (`CHANGE_POLL`, `SQLiteStore`'s setting).
"""

from __future__ import annotations

import math
import sqlite3
from collections.abc import Callable
from typing import TypeVar, TypeVarTuple, Unpack

import attrs
import trio

from .. import _codec
from .._backend import Tx
from .._filewatch import FileWatch
from .engine import read_snapshot

T = TypeVar("T")
Ts = TypeVarTuple("Ts")


# How often a runtime looks for other connections' commits (`PRAGMA data_version` costs a
# few µs) where the WAL file cannot be watched.
CHANGE_POLL = 0.005
# The most often a reader looks at the signal (so reports a change): under load every commit
# is one, and a look per commit would cost more than the commits.
CHANGE_GAP = 0.005
# After a WAL write with no commit visible yet, the reader looks again after CHANGE_GAP,
# doubling, while the pause stays below this (seconds).
WRITE_SETTLE_MAX = 0.5


@attrs.define(eq=False)
class ChangeReader:
    """Reads on the trio thread on a connection of its own: a WAL reader never waits for the
    write lock. A change is another connection's commit (`PRAGMA data_version` on
    `own_conn`, the event loop's writer, else on its own connection). With a watch on the
    WAL file (`_filewatch`), an idle reader sleeps until a commit writes it."""

    conn: sqlite3.Connection
    clock: Callable[[], float]
    poll: float
    watch: FileWatch | None = None
    # The connection the event loop commits on (`ThreadExecutor.inline_conn`, unwrapped):
    # read only on the trio thread, between its batches, which run synchronously there.
    own_conn: sqlite3.Connection | None = None
    # The units of data a read may decode on the event loop (`_codec.loop_budget`); None,
    # no bound: the deterministic executor, which has no thread to send a read to.
    budget: int | None = None
    _version: int = 0
    _next_check: float = 0.0

    async def read(self, op: Callable[[Tx, Unpack[Ts]], T], *args: *Ts) -> T:
        """Run a read-only operation on one snapshot, on the trio thread, within `budget`:
        one that meets more data raises `_codec.OffTheLoop` (its snapshot ended), for the
        executor to run it again in its worker thread."""
        await trio.lowlevel.checkpoint_if_cancelled()
        with _codec.loop_budget(self.budget):
            result = read_snapshot(self.conn, self.clock, op, args)
        await trio.lowlevel.cancel_shielded_checkpoint()
        return result

    async def wait_for_change(self, kick: trio.Event, fallback: float) -> None:
        """Return when another connection committed, `kick` is set, or after `fallback`
        seconds."""
        with trio.move_on_after(fallback):
            settle = 0.0  # > 0: the WAL was written, and no commit was visible at the check
            written = False  # the WAL was written since the last check
            while True:
                # At most one check per CHANGE_GAP: under load every commit writes the WAL,
                # ours too, and a wake-up per commit would cost more than the commits.
                with trio.move_on_at(self._next_check):
                    await kick.wait()
                if kick.is_set():
                    return
                if self.watch is not None:
                    written = self.watch.discard() or written  # the check below covers them
                self._next_check = trio.current_time() + CHANGE_GAP
                if self._changed():
                    return
                if written:
                    # Our own commits, or a writer that wrote its frames and has not yet
                    # published the commit in the WAL index (the -shm file, not watched):
                    # no event follows that. Check again after the gap.
                    settle, written = CHANGE_GAP, False
                    continue
                # Nothing written since: a commit still unpublished gets checks further
                # apart, while the settle stays below WRITE_SETTLE_MAX; else, sleep until
                # the next write.
                settle = settle * 2 if settle * 2 <= WRITE_SETTLE_MAX else 0.0
                with trio.move_on_after(settle or math.inf):
                    written = await self._signal(kick)

    def _changed(self) -> bool:
        """Whether another connection committed since the last call."""
        conn = self.conn if self.own_conn is None else self.own_conn
        try:
            version: int = conn.execute("PRAGMA data_version").fetchone()[0]
        except sqlite3.Error:
            # A look that failed (an I/O error, a file damaged in place) is a lost signal,
            # never the runtime's end: the fallback poll's look at the store meets the
            # error as a `StoreError`, where the change loop retries it.
            version = self._version
        changed, self._version = version != self._version, version
        return changed

    async def _signal(self, kick: trio.Event) -> bool:
        """Sleep until the WAL file is written (True) or `kick` is set (or one poll,
        unwatched)."""
        watch = self.watch
        if watch is None:
            with trio.move_on_after(self.poll):
                await kick.wait()
            return False
        written = False
        async with trio.open_nursery() as nursery:

            async def on_write() -> None:
                nonlocal written
                await watch.wait()
                written = True
                nursery.cancel_scope.cancel()

            async def on_kick() -> None:
                await kick.wait()
                nursery.cancel_scope.cancel()

            nursery.start_soon(on_kick)
            nursery.start_soon(on_write)
        return written
