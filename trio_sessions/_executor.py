"""How store operations reach SQLite from trio: one writer path.

`ThreadExecutor` (production) hands operations to a worker thread and groups every
operation that arrives while a hand-off is in flight into the next transaction (group
commit): a trio -> thread hand-off costs more than a whole SQLite cycle on our machines, so
concurrent operations share one. `InlineExecutor` (tests) runs each operation on the trio
thread, so virtual time never jumps while SQLite works.

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
from ._store import Job, run_batch

T = TypeVar("T")


class Executor(Protocol):
    """Runs store operations `op(tx, *args)`, each inside a write transaction."""

    async def run(self, op: Callable[..., T], *args: Any) -> T: ...


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
    _queue: list[_Queued] = attrs.Factory(list)
    _work: trio.Event = attrs.Factory(trio.Event)
    _closed: bool = False
    _limiter: trio.CapacityLimiter = attrs.Factory(lambda: trio.CapacityLimiter(1))
    handoffs: int = 0

    async def run(self, op: Callable[..., T], *args: Any) -> T:
        # Cancellation first: a caller cancelled while the runtime closes sees Cancelled,
        # not an error about the executor it was cancelled out of.
        await trio.lowlevel.checkpoint_if_cancelled()
        if self._closed:
            raise StoreError("the store executor is closed")
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

    async def pump(self) -> None:
        """Feed the worker: every operation queued during a hand-off joins the next one."""
        try:
            while True:
                await self._work.wait()
                self._work = trio.Event()
                batch, self._queue = self._queue, []
                if not batch:
                    continue
                for queued in batch:
                    queued.taken = True
                jobs = [queued.job for queued in batch]
                self.handoffs += 1
                try:
                    await trio.to_thread.run_sync(
                        run_batch, self.conn, self.clock, jobs, limiter=self._limiter
                    )
                finally:
                    for queued in batch:
                        queued.done.set()
        finally:
            self._closed = True
            for queued in self._queue:
                queued.job.error = StoreError("the store executor closed before this ran")
                queued.done.set()
            self._queue.clear()


@asynccontextmanager
async def open_thread_executor(
    conn: sqlite3.Connection, clock: Callable[[], float]
) -> AsyncIterator[ThreadExecutor]:
    """A `ThreadExecutor` whose pump lives in its own nursery, for the block's duration."""
    executor = ThreadExecutor(conn, clock)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(executor.pump)
        try:
            yield executor
        finally:
            nursery.cancel_scope.cancel()
