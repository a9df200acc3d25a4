"""How store operations reach SQLite from trio: one writer path.

`ThreadExecutor` (production) hands operations to a worker thread and groups every
operation that arrives while a hand-off is in flight into the next transaction (group
commit): a trio -> thread hand-off costs more than a whole SQLite cycle on our machines, so
concurrent operations share one. When nothing is queued, nothing is in flight and no other
task is waiting to run (a lone caller: the group would be just itself), it instead runs the
operation on the trio thread on a second connection that never waits: if the write lock is
not free at once, the operation takes the thread path. That connection never checkpoints
(a checkpoint may fsync); the worker does, every `CHECKPOINT_EVERY` inline commits. With
WAL and synchronous=NORMAL a commit does not fsync, so the event loop never blocks on a
lock or a disk flush. `InlineExecutor` (tests) runs each operation on the trio thread, so
virtual time never jumps while SQLite works.

Invariant, both executors: an operation that has begun is never abandoned. If its caller is
cancelled while it is queued, it is withdrawn unrun; once taken, the caller waits for it (as
`trio.to_thread.run_sync` does with `abandon_on_cancel=False`), so a write that committed is
always reported, never mistaken for one that did not happen.
"""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, Protocol, TypeVar

import attrs
import trio

from ._errors import StoreError
from ._store import BUSY_TIMEOUT_MS, Job, checkpoint, run_batch, try_run_batch

T = TypeVar("T")

# WAL grows by a few pages per commit; checkpoint well before SQLite's own 1000-page mark.
CHECKPOINT_EVERY = 200


class Executor(Protocol):
    """Runs store operations `op(tx, *args)`, each inside a write transaction."""

    async def run(self, op: Callable[..., T], *args: Any) -> T: ...

    async def run_nowait(self, op: Callable[..., T], *args: Any) -> T:
        """Like `run`, but if another process holds the write lock, raise `StoreError` at
        once instead of waiting for it (best-effort writes with a deadline: shutdown)."""
        ...


@attrs.define(eq=False)
class InlineExecutor:
    """Each operation runs in its own transaction on the trio thread (deterministic tests)."""

    conn: sqlite3.Connection
    clock: Callable[[], float]

    async def run(self, op: Callable[..., T], *args: Any) -> T:
        await trio.lowlevel.checkpoint_if_cancelled()
        job = Job(op, args)
        run_batch(self.conn, self.clock, [job])
        await trio.lowlevel.cancel_shielded_checkpoint()
        result: T = job.unwrap()
        return result

    async def run_nowait(self, op: Callable[..., T], *args: Any) -> T:
        await trio.lowlevel.checkpoint_if_cancelled()
        self.conn.execute("PRAGMA busy_timeout = 0")  # really not waiting, here too
        try:
            result: T = _run_nowait(self.conn, self.clock, op, args)
        finally:
            self.conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        await trio.lowlevel.cancel_shielded_checkpoint()
        return result


def _run_nowait(
    conn: sqlite3.Connection,
    clock: Callable[[], float],
    op: Callable[..., T],
    args: tuple[Any, ...],
) -> T:
    job = Job(op, args)
    if not try_run_batch(conn, clock, [job]):
        raise StoreError("the database is locked by another process; not waiting")
    result: T = job.unwrap()
    return result


@attrs.define(eq=False)
class _Queued:
    job: Job
    done: trio.Event = attrs.Factory(trio.Event)
    taken: bool = False


@attrs.define(eq=False)
class ThreadExecutor:
    """Group commit through one worker hand-off at a time. Use `open_thread_executor`."""

    conn: sqlite3.Connection
    clock: Callable[[], float]
    inline_conn: sqlite3.Connection | None = None
    _queue: list[_Queued] = attrs.Factory(list)
    _work: trio.Event = attrs.Factory(trio.Event)
    _closed: bool = False
    _in_flight: bool = False
    _limiter: trio.CapacityLimiter = attrs.Factory(lambda: trio.CapacityLimiter(1))
    _inline_since_checkpoint: int = 0
    _checkpoint_due: bool = False
    handoffs: int = 0
    inline_runs: int = 0

    async def run(self, op: Callable[..., T], *args: Any) -> T:
        # Cancellation first: a caller cancelled while the runtime closes sees Cancelled,
        # not an error about the executor it was cancelled out of.
        await trio.lowlevel.checkpoint_if_cancelled()
        if self._closed:
            raise StoreError("the store executor is closed")
        if self._lone_caller():
            job = Job(op, args)
            assert self.inline_conn is not None
            if try_run_batch(self.inline_conn, self.clock, [job]):
                self._count_inline_commit()
                await trio.lowlevel.cancel_shielded_checkpoint()
                inline_result: T = job.unwrap()
                return inline_result
        queued = _Queued(Job(op, args))
        self._queue.append(queued)
        self._work.set()
        try:
            await queued.done.wait()
        except trio.Cancelled:
            if not queued.taken:
                self._queue.remove(queued)
                raise
            # Taken: the operation is running; wait for its result like a non-abandoning
            # to_thread call, then let the next checkpoint deliver the cancellation.
            with trio.CancelScope(shield=True):
                await queued.done.wait()
        result: T = queued.job.unwrap()
        return result

    async def run_nowait(self, op: Callable[..., T], *args: Any) -> T:
        await trio.lowlevel.checkpoint_if_cancelled()
        if self._in_flight or self.inline_conn is None:
            # The worker holds this process's write lock now: its batch ends soon.
            return await self.run(op, *args)
        result: T = _run_nowait(self.inline_conn, self.clock, op, args)
        await trio.lowlevel.cancel_shielded_checkpoint()
        return result

    def _lone_caller(self) -> bool:
        return (
            self.inline_conn is not None
            and not self._queue
            and not self._in_flight
            and trio.lowlevel.current_statistics().tasks_runnable == 0
        )

    def _count_inline_commit(self) -> None:
        self.inline_runs += 1
        self._inline_since_checkpoint += 1
        if self._inline_since_checkpoint >= CHECKPOINT_EVERY:
            self._inline_since_checkpoint = 0
            self._checkpoint_due = True
            self._work.set()

    async def pump(self, scope: trio.CancelScope) -> None:
        """Feed the worker: every operation queued during a hand-off joins the next one.

        Runs in `scope`, shielded and cancelled only when the executor closes, so cleanup
        that runs shielded while the runtime is cancelled from outside still reaches SQLite.
        """
        try:
            with scope:
                await self._pump_forever()
        finally:
            self._closed = True
            for queued in self._queue:
                queued.job.error = StoreError("the store executor closed before this ran")
                queued.done.set()
            self._queue.clear()

    async def _pump_forever(self) -> None:
        while True:
            await self._work.wait()
            self._work = trio.Event()
            if self._checkpoint_due:
                self._checkpoint_due = False
                # In flight for the inline path too: a checkpoint racing new commits never
                # copies every frame, and the WAL then cannot restart (it grew past 90 MB
                # in a 100k-cycle run). Operations meanwhile queue for the worker and
                # group-commit right after.
                self._in_flight = True
                try:
                    await trio.to_thread.run_sync(checkpoint, self.conn, limiter=self._limiter)
                finally:
                    self._in_flight = False
            batch, self._queue = self._queue, []
            if not batch:
                continue
            for queued in batch:
                queued.taken = True
            jobs = [queued.job for queued in batch]
            self.handoffs += 1
            self._in_flight = True
            try:
                await trio.to_thread.run_sync(
                    run_batch, self.conn, self.clock, jobs, limiter=self._limiter
                )
            finally:
                self._in_flight = False
                for queued in batch:
                    queued.done.set()


@asynccontextmanager
async def open_thread_executor(
    conn: sqlite3.Connection,
    clock: Callable[[], float],
    *,
    inline_conn: sqlite3.Connection | None = None,
) -> AsyncIterator[ThreadExecutor]:
    """A `ThreadExecutor` whose pump lives in its own nursery, for the block's duration.

    `inline_conn` (from `_store.connect_nonblocking`) enables the lone-caller fast path.
    """
    executor = ThreadExecutor(conn, clock, inline_conn=inline_conn)
    pump_scope = trio.CancelScope(shield=True)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(executor.pump, pump_scope)
        try:
            yield executor
        finally:
            pump_scope.cancel()
