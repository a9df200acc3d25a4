"""SQLite's change signal: `ChangeReader` reads on a connection of its own, on the trio
thread, and tells a waiting runtime when another connection committed.

Invariants: a read runs on one snapshot (one deferred transaction, rolled back: it never takes
the write lock, so it never waits for a writer); `PRAGMA data_version` changes with every
commit made on any other connection, this process's writers included, so a watcher sees its
own runtime's writes too; a change is reported at most every `CHANGE_GAP` seconds, and where
the WAL file cannot be watched the reader polls (`CHANGE_POLL`, `SQLiteStore`'s setting).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from typing import TypeVar, TypeVarTuple, Unpack

import attrs
import trio

from .._backend import OwnChange, Tx, now_ms
from .._filewatch import FileWatch
from .engine import SQLiteTx, store_error

T = TypeVar("T")
Ts = TypeVarTuple("Ts")


# How often a runtime looks for other connections' commits (`PRAGMA data_version` costs a
# few µs) where the WAL file cannot be watched.
CHANGE_POLL = 0.005
# The most often a reader reports a change: under load every commit is one, and a look per
# commit would cost more than the commits.
CHANGE_GAP = 0.005
# After a WAL write with no commit visible yet, the reader looks again after CHANGE_GAP,
# doubling, while the pause stays below this (seconds).
WRITE_SETTLE_MAX = 0.5


@attrs.define(eq=False)
class ChangeReader:
    """Reads on the trio thread on a connection of its own: a WAL reader never waits for the
    write lock, and `PRAGMA data_version` on it changes with every commit made on any other
    connection - this process's writers included, so watchers see their writes too. With a
    watch on the WAL file (`_filewatch`), an idle reader sleeps until a commit writes it."""

    conn: sqlite3.Connection
    clock: Callable[[], float]
    poll: float
    watch: FileWatch | None = None
    _version: int = 0
    _next_look: float = 0.0

    async def read(self, op: Callable[[Tx, Unpack[Ts]], T], *args: *Ts) -> T:
        """Run a read-only operation on one snapshot, on the trio thread."""
        await trio.lowlevel.checkpoint_if_cancelled()
        self.conn.execute("BEGIN")  # one snapshot for the whole operation
        try:
            result = op(SQLiteTx(self.conn, now_ms(self.clock)), *args)
        except sqlite3.Error as exc:
            raise store_error(exc) from exc
        finally:
            self.conn.execute("ROLLBACK")
        await trio.lowlevel.cancel_shielded_checkpoint()
        return result

    async def wait_for_change(
        self,
        kick: trio.Event,
        fallback: float,
        *,
        own: OwnChange = None,
        follows: OwnChange = None,
    ) -> None:
        """Return when another connection committed, `kick` is set, or after `fallback` seconds."""
        with trio.move_on_after(fallback):
            with trio.move_on_at(self._next_look):
                await kick.wait()
            settle = 0.0  # > 0: the WAL was written, and no commit is visible yet
            while not kick.is_set():
                if self.watch is not None:
                    self.watch.discard()  # events so far are covered by the look below
                version = self.conn.execute("PRAGMA data_version").fetchone()[0]
                if version != self._version:
                    self._version = version
                    self._next_look = trio.current_time() + CHANGE_GAP
                    return
                if 0 < settle <= WRITE_SETTLE_MAX:
                    # A writer writes its frames, then publishes the commit in the WAL
                    # index (the -shm file, not watched): a look between the two sees
                    # nothing, and no event follows. Look again shortly.
                    with trio.move_on_after(settle):
                        await kick.wait()
                    settle *= 2
                    continue
                settle = CHANGE_GAP if await self._signal(kick) else 0.0

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
