"""One writer path from trio to a worker thread, shared by both engines (group commit).

Operations queue here; a pump hands everything queued to the engine's worker thread in one
go, and whatever arrives while that hand-off is in flight joins the next one. A trio ->
thread hand-off costs more than a whole SQLite cycle on our machines and a PostgreSQL commit
costs an fsync, so concurrent operations share both.

Invariant: an operation that has begun is never abandoned. If its caller is cancelled while
it is queued, it is withdrawn unrun; so it is when taken in a batch whose engine has not
begun it yet (a `BatchStart`: SQLite's worker thread waiting for the write lock another
process holds - nothing of the batch ran, and a drain cancelled at its lease's deadline must
not wait up to `LOCK_PATIENCE_S` for it, DESIGN §6.17), and when its engine withdraws it
unrun later (PostgreSQL's `Withdrawals`: the statement waiting for a session's lock another
connection holds is cancelled, rolled back before COMMIT - the caller waits for that verdict,
then sees its cancellation); once begun, the caller waits for its
outcome (as `trio.to_thread.run_sync` does with `abandon_on_cancel=False`), so a write that
committed is always reported, never mistaken for one that did not happen, nor one that did
not run for one that did (a hand-off that raises leaves its callers `OutcomeUnknown`, but
for those it already gave their outcome: `Queued.finish` early, for operations done before
the rest). When the pump stops, every operation still queued fails with `StoreError`, and
later ones are refused.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any, Protocol

import attrs
import trio

from ._backend import Job, closed_before_run, executor_closed
from ._errors import OutcomeUnknown, StoreError


class Withdrawable(Protocol):
    """A batch handed to a worker thread whose operations a cancelled caller may still
    withdraw (`BatchStart`; PostgreSQL's `Withdrawals`)."""

    def withdraw(self, job: Job) -> bool:
        """Withdraw `job` now (True), or leave the verdict to the worker (False): the caller
        waits for the job's outcome, which `Job.withdrawn` may then say never ran."""
        ...


class BatchStart:
    """Whether a batch handed to a worker thread has begun (SQLite: its BEGIN IMMEDIATE took
    the write lock). Until then a caller cancelled withdraws its operation (`withdraw`, on
    the trio thread), which the worker drops unrun (`begin`), and a worker whose operations
    were all withdrawn stops waiting (`abandoned`, between its tries for the lock); from
    then on every operation left runs and its caller waits for the outcome. One lock
    decides between a withdrawal and the start, so one that races it ends one way: unrun
    and the caller cancelled, or run and the caller told."""

    def __init__(self, size: int) -> None:
        self._lock = threading.Lock()
        self._begun = False
        self._left = size
        self._withdrawn: set[int] = set()  # ids of the jobs withdrawn

    def withdraw(self, job: Job) -> bool:
        """Withdraw `job` unless its batch has begun; True when it did."""
        with self._lock:
            if self._begun:
                return False
            self._withdrawn.add(id(job))
            self._left -= 1
            return True

    @property
    def begun(self) -> bool:
        """The batch took the write lock (a read, no lock: the trio thread's look while the
        worker may be taking it)."""
        return self._begun

    def abandoned(self) -> bool:
        """Every operation of the batch was withdrawn: nothing to begin (a read, no lock:
        a withdrawal that comes after the read is still dropped by `begin`)."""
        return self._left == 0

    def begin(self, jobs: list[Job]) -> list[Job]:
        """The batch has begun (call right after it did): its jobs not withdrawn, which
        now run whatever their callers do."""
        with self._lock:
            self._begun = True
        if not self._withdrawn:
            return jobs
        return [job for job in jobs if id(job) not in self._withdrawn]


@attrs.define(eq=False)
class Queued:
    """One operation waiting for a hand-off; `mode` tells the engine how to run it. Its
    caller's `task` sleeps until `finish` reschedules it (once): no Event or parking lot per
    operation, on the path every write takes."""

    job: Job
    mode: str = "write"
    task: trio.lowlevel.Task | None = None
    taken: bool = False
    finished: bool = False
    # Set when taken into a worker's batch that may wait before it begins: a cancelled
    # caller can still withdraw the operation until it does.
    start: Withdrawable | None = None

    def finish(self) -> None:
        if not self.finished:
            self.finished = True
            # No withdrawal after this: and PostgreSQL's `Withdrawals` holds its batch of
            # `Queued`s (to wake them), a cycle that would keep every hand-off's jobs and
            # results for the cyclic collector, whose full passes then stall the loop.
            self.start = None
            if self.task is not None:
                trio.lowlevel.reschedule(self.task)

    async def outcome(self, withdraw: Callable[[Queued], None]) -> Any:
        """Sleep until `finish`, then return the job's result or raise its error. Cancelled
        while still queued, the operation is withdrawn unrun (`withdraw` takes it off its
        queue), and so it is when taken into a batch that has not begun (`start`: the
        worker drops it); once begun, the caller waits for its outcome like a
        non-abandoning to_thread call, and the next checkpoint delivers the cancellation -
        at once when the worker withdrew the operation unrun meanwhile (`Job.withdrawn`)."""

        def abort(_: Any) -> trio.lowlevel.Abort:
            if not self.taken:
                withdraw(self)
            elif self.start is None or not self.start.withdraw(self.job):
                return trio.lowlevel.Abort.FAILED
            self.finished = True
            self.start = None  # as `finish` lets go of it
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)
        if self.job.withdrawn:
            # Only a cancelled caller's operation is withdrawn: this checkpoint raises its
            # Cancelled (unless a shield came up since, which leaves it no result to take).
            await trio.lowlevel.checkpoint()
            raise StoreError("the operation was withdrawn unrun, its caller cancelled")
        return self.job.unwrap()


HandOff = Callable[[list[Queued]], Awaitable[None]]


@attrs.define(eq=False)
class HandoffQueue:
    """The operations waiting for the worker, and whether a hand-off is in flight."""

    _queue: list[Queued] = attrs.Factory(list)
    _work: trio.Event = attrs.Factory(trio.Event)
    closed: bool = False
    # True while the worker holds this process's connection (a batch, or engine upkeep).
    in_flight: bool = False
    handoffs: int = 0
    # At most this many operations per hand-off (None: everything queued). The rest wait
    # for the next one, which then also takes what arrived meanwhile: each batch's callers
    # go on as soon as it is done, instead of after the whole queue.
    limit: int | None = None

    def idle(self) -> bool:
        return not self._queue and not self.in_flight

    def poke(self) -> None:
        """Wake the pump with nothing queued (the engine has upkeep to do)."""
        self._work.set()

    def check_open(self) -> None:
        if self.closed:
            raise executor_closed()

    def submit(self, job: Job, mode: str = "write") -> Coroutine[Any, Any, Any]:
        """Queue `job` for the next hand-off; await the result for its outcome (see the
        invariant). Queued at once, by the call: the caller awaits it right away, and the
        wait is `Queued.outcome` itself, with no coroutine of its own around it."""
        self.check_open()
        queued = Queued(job, mode, trio.lowlevel.current_task())
        self._queue.append(queued)
        self._work.set()
        return queued.outcome(self._withdraw)

    def _withdraw(self, queued: Queued) -> None:
        self._queue.remove(queued)

    async def pump(
        self,
        scope: trio.CancelScope,
        hand_off: HandOff,
        upkeep: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """Hand every queued operation to `hand_off`, batch after batch; `upkeep` runs at
        each wake-up before the batch is taken (it may set `in_flight` while it works).

        Runs in `scope`, shielded and cancelled only when the executor closes, so cleanup
        that runs shielded while the runtime is cancelled from outside still reaches the
        database.
        """
        try:
            with scope:
                while True:
                    await self._work.wait()
                    self._work = trio.Event()
                    if upkeep is not None:
                        await upkeep()
                    if scope.cancel_called:
                        # Closed meanwhile (an upkeep or a wake-up finished after it):
                        # a hand-off begun now would be cancelled before it ran anything,
                        # and its callers handed no outcome. What is queued fails below.
                        break
                    await self._hand_off_queued(hand_off)
        finally:
            self.closed = True
            for queued in self._queue:
                queued.job.error = closed_before_run()
                queued.finish()
            self._queue.clear()

    async def _hand_off_queued(self, hand_off: HandOff) -> None:
        if self.limit is None:
            batch, self._queue = self._queue, []
        else:
            batch, self._queue = self._queue[: self.limit], self._queue[self.limit :]
            if self._queue:
                self._work.set()  # the pump comes back for the rest at once
        if not batch:
            return
        for queued in batch:
            queued.taken = True
        self.handoffs += 1
        self.in_flight = True
        try:
            await hand_off(batch)
        except trio.Cancelled:
            # Only the executor's close cancels the pump, and a hand-off is cancelled then
            # only before anything ran (waiting for the worker's limiter: its thread is never
            # abandoned): refused as what the close left queued is.
            for queued in batch:
                if not queued.finished and queued.job.error is None:
                    queued.job.error = closed_before_run()
            raise
        except BaseException as exc:
            # An error no engine made a job's outcome: whether the batch ran is unknown,
            # and a caller must never take its unfilled result for a committed write.
            for queued in batch:
                if not queued.finished and queued.job.error is None:
                    queued.job.error = OutcomeUnknown(f"the store's writer failed: {exc!r}")
            raise
        finally:
            self.in_flight = False
            for queued in batch:
                queued.finish()


@asynccontextmanager
async def pumping(
    queue: HandoffQueue,
    hand_off: HandOff,
    upkeep: Callable[[], Awaitable[None]] | None = None,
) -> AsyncIterator[None]:
    """Run `queue`'s pump in a nursery of its own for the block's duration."""
    pump_scope = trio.CancelScope(shield=True)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(queue.pump, pump_scope, hand_off, upkeep)
        try:
            yield
        finally:
            pump_scope.cancel()
