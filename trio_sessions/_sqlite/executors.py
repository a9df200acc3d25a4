"""`SQLiteStore` and its executors (`_backend.Executor`): how operations get from trio to
SQLite, one writer path with group commit.

`ThreadExecutor` (production) queues operations and groups every operation queued in one
round of the event loop into one transaction (group commit). It runs that transaction on
the trio thread, on a second connection that never waits: when the write lock is free at
once (the common case, no other process writing), nothing crosses to a thread - a trio ->
thread hand-off costs more than a whole SQLite cycle on our machines, and when the event
loop is never idle (a producer submitting while drains run) every operation would pay one.
When another process holds the lock, the group goes to the worker thread, which waits for
it; operations arriving meanwhile join the next group. A lone caller (nothing queued,
nothing in flight, no other task runnable: the group would be just itself) skips the queue.
The loop's connection never checkpoints (a checkpoint may fsync); the worker does, every
`CHECKPOINT_EVERY` commits on the loop, beside the writers (PASSIVE), and holds them back
only when the WAL could not restart for `WAL_RESTART_FRAMES` frames. With WAL and
synchronous=NORMAL a commit does not fsync, so the event loop never blocks on a lock or a
disk flush. Nor on data: a transaction on the loop, and a read, run within the loop's
budget (`_codec.loop_budget`, DESIGN §6.26: no step over 50 ms); an operation that meets
more (a message holding large tool results) raises `_codec.OffTheLoop` with its writes
rolled back, and runs again in the worker thread, whose result its caller gets. The loop's
own commits are no change signal (`ChangeReader.own_conn`), while the worker's are (as
another process's).
`InlineExecutor` (tests) runs each operation on the trio thread in its own transaction, so
virtual time never jumps while SQLite works.

Every write batch first checks that the path still names the file the executor opened
(`DatabaseFile`). A WAL that checkpoints cannot shrink (a reader that never ends) is logged
once it passes `WAL_WARN_BYTES`.

Invariant, both executors: an operation that has begun is never abandoned. If its caller is
cancelled while it is queued, it is withdrawn unrun, and so it is while its batch waits in
the worker thread for the write lock another process holds (`_handoff.BatchStart`: nothing
of it ran; a drain stopped at its lease's deadline exits then, not up to `LOCK_PATIENCE_S`
later, DESIGN §6.17); once the batch's BEGIN IMMEDIATE took the lock, or the operation runs
on the loop, the caller waits for it (as `trio.to_thread.run_sync` does with
`abandon_on_cancel=False`), so a write that committed is always reported, never mistaken for
one that did not happen.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sqlite3
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar, TypeVarTuple, Unpack

import attrs
import trio

from .. import _codec, _liveness, _observe
from .._backend import BackendName, Follows, Job, StoreStatistics, Tx, executor_closed
from .._errors import StoreError
from .._filewatch import open_watch
from .._handoff import BatchStart, HandoffQueue, Queued, pumping
from .._naming import check_sqlite_path
from .._validate import check_flag
from .changes import CHANGE_POLL, ChangeReader
from .connections import (
    BUSY_TIMEOUT_MS,
    LOCK_POLL_MAX_S,
    LOCK_POLL_S,
    NOWAIT_PATIENCE_S,
    DatabaseFile,
    check_synchronous,
    checkpoint,
    connect,
    connect_nonblocking,
    database_name,
    poll_for_lock,
)
from .engine import database_file, read_snapshot, run_batch, run_without_sql, try_run_batch

T = TypeVar("T")
Ts = TypeVarTuple("Ts")


@asynccontextmanager
async def _hold_token(
    conn: sqlite3.Connection, owner_id: str, *, inline: bool
) -> AsyncIterator[_liveness.FileToken]:
    database = database_file(conn)
    if database is None:
        raise StoreError("an in-memory database cannot hold liveness tokens")
    async with _liveness.hold_file_token(database, owner_id, inline=inline) as token:
        yield token


# WAL grows by a few pages per commit; checkpoint well before SQLite's own 1000-page mark.
CHECKPOINT_EVERY = 200
# A checkpoint that runs while commits continue never copies the newest frames, so the WAL
# cannot restart and keeps growing; once it is this long (~16 MB at 4 KiB pages), the next
# checkpoint holds the writers back until it is done.
WAL_RESTART_FRAMES = 4_000
# A WAL this long (bytes) that checkpoints cannot shrink is logged (WAL_NOT_CHECKPOINTED):
# four times what a busy runtime's WAL reaches before a checkpoint restarts it.
WAL_WARN_BYTES = 64 * 1024 * 1024


@attrs.define(eq=False)
class InlineExecutor:
    """Each operation runs in its own transaction on the trio thread (deterministic tests)."""

    conn: sqlite3.Connection
    clock: Callable[[], float]
    reader: ChangeReader
    backend: BackendName = "sqlite"
    transactions: int = 0
    file: DatabaseFile | None = None
    # Set when its store's block exits: a call then says so, as the other executors do,
    # not the driver's "Cannot operate on a closed database".
    closed: bool = False

    async def read(self, op: Callable[[Tx, Unpack[Ts]], T], *args: *Ts) -> T:
        return await self.reader.read(op, *args)

    async def wait_for_change(
        self,
        kick: trio.Event,
        fallback: float,
        *,
        follows: Follows = None,
    ) -> None:
        # Deterministic tests: no look in real time (it would race the steps a test drives
        # under the virtual clock). The kick, or the fallback poll on trio's (virtual) clock
        # when another connection committed meanwhile - another runtime on this store, whose
        # doorbells, interrupts and transcripts this runtime's drains, watchers and streams
        # then learn, as the inline PostgreSQL store's do from its notifications (§6.20).
        # A runtime alone on its store (its own commits are no change) looks at its kick
        # only. The change signal itself is tested on the threaded store, in real time.
        while True:
            with trio.move_on_after(fallback):
                await kick.wait()
                return
            if self.reader._changed():
                return

    def statistics(self) -> StoreStatistics:
        # Every transaction runs on the trio thread.
        return StoreStatistics(
            "sqlite", transactions=self.transactions, inline_runs=self.transactions
        )

    def hold_token(self, owner_id: str) -> contextlib.AbstractAsyncContextManager[Any]:
        return _hold_token(self.conn, owner_id, inline=True)

    async def run(self, op: Callable[[Tx, Unpack[Ts]], T], *args: *Ts) -> T:
        await trio.lowlevel.checkpoint_if_cancelled()
        self._check_open()
        job = Job(op, args)
        self.transactions += 1
        run_batch(self.conn, self.clock, [job], self.file)
        # Always a schedule point right after the transaction, `caller_yields_next` or not:
        # tests start a task from inside one and rely on it running before anything else.
        await trio.lowlevel.cancel_shielded_checkpoint()
        result: T = job.unwrap()
        return result

    async def run_nowait(self, op: Callable[[Tx, Unpack[Ts]], T], *args: *Ts) -> T:
        await trio.lowlevel.checkpoint_if_cancelled()
        self._check_open()
        self.conn.execute("PRAGMA busy_timeout = 0")  # really not waiting, here too
        try:
            result: T = _run_nowait(self.conn, self.clock, op, args, self.file)
        finally:
            self.conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        await trio.lowlevel.cancel_shielded_checkpoint()
        return result

    def _check_open(self) -> None:
        if self.closed:
            raise executor_closed()


def _caller_yields_next(job: Job) -> bool:
    """`_backend.caller_yields_next`: a success whose caller's own schedule point follows."""
    return job.error is None and "caller_yields_next" in job.op.__dict__


def _run_nowait(
    conn: sqlite3.Connection,
    clock: Callable[[], float],
    op: Callable[..., T],
    args: tuple[Any, ...],
    file: DatabaseFile | None,
) -> T:
    job = Job(op, args)
    if not try_run_batch(conn, clock, [job], file):
        raise _Locked("the database is locked by another process; not waiting")
    result: T = job.unwrap()
    return result


class _Locked(StoreError):
    """`_run_nowait` found another connection holding the write lock: nothing ran."""


@attrs.define(eq=False)
class ThreadExecutor:
    """Group commit on the loop, or through the worker thread when another process holds
    the write lock. Use `open_thread_executor`."""

    conn: sqlite3.Connection
    clock: Callable[[], float]
    reader: ChangeReader
    # Reads too large for the loop, in a worker thread on a connection and limiter of
    # their own: one slow read never holds up the writes of the process.
    read_conn: sqlite3.Connection
    inline_conn: sqlite3.Connection | None = None
    file: DatabaseFile | None = None
    # The database's page size: the WAL's length in bytes is frames x this.
    page_size: int = 4096
    _handoff: HandoffQueue = attrs.Factory(HandoffQueue)
    # The batch in the worker thread, while it is there: whether it took the write lock yet.
    _worker_batch: BatchStart | None = None
    _limiter: trio.CapacityLimiter = attrs.Factory(lambda: trio.CapacityLimiter(1))
    _read_limiter: trio.CapacityLimiter = attrs.Factory(lambda: trio.CapacityLimiter(1))
    # The reads that run no SQL (`_backend.runs_off_the_loop`: the liveness probe), in a
    # thread of their own: a look for gone owners never waits for a large read.
    _probe_limiter: trio.CapacityLimiter = attrs.Factory(lambda: trio.CapacityLimiter(1))
    _nursery: trio.Nursery | None = None
    _inline_since_checkpoint: int = 0
    _checkpoint_due: bool = False
    _checkpointing: bool = False
    _wal_frames: int = 0
    _wal_warned: bool = False
    inline_runs: int = 0
    thread_handoffs: int = 0
    # Reads over the loop's budget, run again in the worker thread (tests look).
    thread_reads: int = 0
    backend: BackendName = "sqlite"
    # Whether the `run` that just returned left its schedule point to its caller
    # (`_backend.caller_yields_next`, run on the loop); the caller reads it at once.
    left_schedule_point: bool = False

    def statistics(self) -> StoreStatistics:
        handoffs = self.thread_handoffs
        return StoreStatistics(
            "sqlite",
            transactions=handoffs + self.inline_runs,
            handoffs=handoffs,
            inline_runs=self.inline_runs,
        )

    async def run(self, op: Callable[[Tx, Unpack[Ts]], T], *args: *Ts) -> T:
        # Cancellation first: a caller cancelled while the runtime closes sees Cancelled,
        # not an error about the executor it was cancelled out of.
        await trio.lowlevel.checkpoint_if_cancelled()
        self._handoff.check_open()
        job = Job(op, args)
        if self._lone_caller() and self._run_on_the_loop([job], self.file) and not job.off_the_loop:
            # Set and read with no checkpoint between (see `left_schedule_point`).
            self.left_schedule_point = _caller_yields_next(job)
            if not self.left_schedule_point:
                await trio.lowlevel.cancel_shielded_checkpoint()
            inline_result: T = job.unwrap()
            return inline_result
        # Queued (the worker thread's, if it went off the loop): the hand-off's rules for a
        # cancelled caller, and its group commit, apply.
        result: T = await self._handoff.submit(job)
        self.left_schedule_point = False  # it waited for the hand-off
        return result

    async def run_nowait(self, op: Callable[[Tx, Unpack[Ts]], T], *args: *Ts) -> T:
        # No loop budget here: these are shutdown's hand-backs (claims released, wakes kept),
        # which decode no transcript, and they must not wait for the worker thread.
        await trio.lowlevel.checkpoint_if_cancelled()
        if self.inline_conn is None or self._worker_holds_the_lock():
            return await self.run(op, *args)
        # Another process's commit holds the lock for a moment at any instant under load:
        # tried again in short pauses for NOWAIT_PATIENCE_S (PostgreSQL's lock_timeout),
        # on the loop, so the caller's deadline still bounds it.
        deadline = trio.current_time() + NOWAIT_PATIENCE_S
        pause = LOCK_POLL_S
        while True:
            try:
                result: T = _run_nowait(self.inline_conn, self.clock, op, args, self.file)
            except _Locked:
                if self._worker_holds_the_lock():
                    # The worker's batch took the lock since (another process freed it):
                    # the loop's tries could only fail until that batch ends.
                    return await self.run(op, *args)
                if trio.current_time() >= deadline:
                    raise
                await trio.sleep(pause)
                pause = min(pause * 2, LOCK_POLL_MAX_S)
                continue
            await trio.lowlevel.cancel_shielded_checkpoint()
            return result

    def _worker_holds_the_lock(self) -> bool:
        """Whether the worker holds this process's write lock now (its batch, or upkeep):
        it ends soon. A batch still waiting for another process's lock is no reason to
        queue behind it: it waits as long as that lock is held."""
        batch = self._worker_batch
        return self._handoff.in_flight and (batch is None or batch.begun)

    async def read(self, op: Callable[[Tx, Unpack[Ts]], T], *args: *Ts) -> T:
        off_the_loop = op.__dict__.get("runs_off_the_loop", False)
        if off_the_loop and self.file is not None:
            # System calls only (the liveness probe): in a thread of its own, never queued
            # behind a large read in the read thread (one transcript's: about a second).
            return await trio.to_thread.run_sync(
                run_without_sql, op, self.clock, self.file.tokens, args, limiter=self._probe_limiter
            )
        if not off_the_loop:
            try:
                return await self.reader.read(op, *args)
            except _codec.OffTheLoop:
                pass  # too much data for the loop: the worker thread reads it
        # A WAL reader never waits for the write lock; the loop's other readers, and the
        # writers, go on meanwhile.
        self.thread_reads += 1
        return await trio.to_thread.run_sync(
            read_snapshot, self.read_conn, self.clock, op, args, limiter=self._read_limiter
        )

    async def wait_for_change(
        self,
        kick: trio.Event,
        fallback: float,
        *,
        follows: Follows = None,
    ) -> None:
        # `follows` filters nothing here: `data_version` cannot say which session changed.
        await self.reader.wait_for_change(kick, fallback)

    def hold_token(self, owner_id: str) -> contextlib.AbstractAsyncContextManager[Any]:
        return _hold_token(self.reader.conn, owner_id, inline=False)

    def _lone_caller(self) -> bool:
        return (
            self.inline_conn is not None
            and self._handoff.idle()
            and trio.lowlevel.current_statistics().tasks_runnable == 0
        )

    def _run_on_the_loop(self, jobs: list[Job], file: DatabaseFile | None) -> bool:
        """Run `jobs` in one transaction on the trio thread, within the loop's budget, if
        the write lock is free now (False: nothing ran). A job over the budget is marked
        `off_the_loop`, its writes rolled back and its outcome cleared, for the worker
        thread to run; the others committed."""
        assert self.inline_conn is not None
        # The budget spans the whole synchronous batch: what the loop decodes and encodes
        # in this one step, whichever job does it.
        with _codec.loop_budget():
            ran = try_run_batch(self.inline_conn, self.clock, jobs, file)
        if not ran:
            return False
        stayed = False
        for job in jobs:
            if isinstance(job.error, _codec.OffTheLoop):
                job.error = job.result = None
                job.off_the_loop = True
            else:
                stayed = True
        if stayed:  # else it rolled back, or committed nothing
            self._count_inline_commit()
        return True

    def _count_inline_commit(self) -> None:
        self.inline_runs += 1
        self._inline_since_checkpoint += 1
        if self._inline_since_checkpoint < CHECKPOINT_EVERY or self._checkpointing:
            return
        self._inline_since_checkpoint = 0
        if self._wal_frames >= WAL_RESTART_FRAMES or self._nursery is None:
            self._checkpoint_due = True  # the pump runs it with the writers held back
            self._handoff.poke()
        else:
            self._checkpointing = True
            self._nursery.start_soon(self._checkpoint_beside_writers)

    async def _checkpoint_beside_writers(self) -> None:
        # PASSIVE never takes the write lock: commits on the loop go on meanwhile, so the
        # event loop never waits for the copy or its fsync.
        try:
            done = await trio.to_thread.run_sync(checkpoint, self.conn, limiter=self._limiter)
        finally:
            self._checkpointing = False
        if done is not None:
            # Commits went on meanwhile: the WAL restarts only after a checkpoint with the
            # writers held back, so its length is what counts.
            self._wal_frames = done[0]
            self._watch_wal()

    async def _hand_off(self, batch: list[Queued]) -> None:
        jobs = [queued.job for queued in batch]
        # No schedule point of its own on the loop: the pump's wait for more work is one,
        # and the callers go on in the very next scheduler round instead of one later.
        if self.file is not None and self.file.refuse(jobs):
            return
        # Group commit on the trio thread when the write lock is free: a thread hand-off
        # costs more than the whole group's SQL, and when the event loop is never idle
        # (a producer submitting while drains run) every operation would pay one. A job
        # that went off the loop before is never tried there again.
        on_the_loop = [job for job in jobs if not job.off_the_loop]
        # (The file was checked just above.)
        if (
            on_the_loop
            and self.inline_conn is not None
            and self._run_on_the_loop(on_the_loop, None)
        ):
            jobs = [job for job in jobs if job.off_the_loop]
            if not jobs:
                return
            # Those that committed on the loop go on now, not after the worker's batch.
            for queued in batch:
                if not queued.job.off_the_loop:
                    queued.finish()
        self.thread_handoffs += 1
        # Until the worker's BEGIN IMMEDIATE takes the lock (another process may hold it
        # for long), a cancelled caller withdraws its operation; those finished on the loop
        # above are no longer the worker's.
        start = BatchStart(len(jobs))
        for queued in batch:
            if not queued.finished:
                queued.start = start
        self._worker_batch = start
        try:
            await trio.to_thread.run_sync(
                run_batch, self.conn, self.clock, jobs, self.file, start, limiter=self._limiter
            )
        finally:
            self._worker_batch = None

    async def _checkpoint_if_due(self) -> None:
        if not self._checkpoint_due:
            return
        self._checkpoint_due = False
        # In flight for the loop's commits too: a checkpoint racing new commits never copies
        # every frame, and the WAL then cannot restart (it grew past 90 MB in a 100k-cycle
        # run). Operations meanwhile queue and group-commit right after.
        self._handoff.in_flight = True
        try:
            done = await trio.to_thread.run_sync(checkpoint, self.conn, limiter=self._limiter)
        finally:
            self._handoff.in_flight = False
        if done is not None:
            frames, copied = done
            self._wal_frames = frames - copied  # copied whole: the WAL restarts
            self._watch_wal()

    def _watch_wal(self) -> None:
        """Log once per crossing a WAL that grew past `WAL_WARN_BYTES`: checkpoints cannot
        copy it back, because a reader (another connection's open read transaction) still
        uses its older frames, so it cannot restart and only grows."""
        wal_bytes = self._wal_frames * self.page_size
        if wal_bytes < WAL_WARN_BYTES:
            self._wal_warned = False
        elif not self._wal_warned:
            self._wal_warned = True
            path = self.file.path if self.file is not None else database_name(self.conn)
            _observe.wal_not_checkpointed(path, wal_bytes, self._wal_frames, WAL_WARN_BYTES)


@asynccontextmanager
async def open_thread_executor(
    conn: sqlite3.Connection,
    clock: Callable[[], float],
    reader: ChangeReader,
    *,
    read_conn: sqlite3.Connection,
    inline_conn: sqlite3.Connection | None = None,
    file: DatabaseFile | None = None,
) -> AsyncIterator[ThreadExecutor]:
    """A `ThreadExecutor` whose pump lives in its own nursery, for the block's duration.

    `inline_conn` (from `connect_nonblocking`) enables the lone-caller fast path; `file`,
    the check that the database file is still the one opened, at every write batch;
    `read_conn`, the connection of the reads too large for the loop.
    """
    page_size = int(conn.execute("PRAGMA page_size").fetchone()[0])
    executor = ThreadExecutor(
        conn, clock, reader, read_conn, inline_conn=inline_conn, file=file, page_size=page_size
    )
    async with (
        trio.open_nursery() as nursery,
        pumping(executor._handoff, executor._hand_off, executor._checkpoint_if_due),
    ):
        executor._nursery = nursery
        yield executor


@attrs.frozen
class SQLiteStore:
    """An SQLite file, and how to reach it from trio (the embedded default, one host).

    `inline=True` runs SQLite on the trio thread (deterministic tests with a virtual clock);
    the default hands work to a thread and groups concurrent operations per hand-off.
    `synchronous` is SQLite's durability setting for every connection: `"NORMAL"` (default)
    survives a process crash, but the newest commits may roll back after a power loss or an
    OS crash; `"FULL"` makes a commit that returned survive those too (an fsync per commit).
    Construction checks the arguments (`TypeError`/`ValueError` naming the bad one): `path`
    is a str or `os.PathLike` of one with no NUL or lone surrogate, `inline` a bool.
    """

    path: str | os.PathLike[str] = attrs.field(
        validator=lambda _s, _a, path: check_sqlite_path(path)
    )
    inline: bool = attrs.field(default=False, validator=check_flag)
    synchronous: str = attrs.field(
        default="NORMAL", kw_only=True, validator=lambda _s, _a, value: check_synchronous(value)
    )
    # Test seam: wraps each connection the runtime opens, e.g. to raise
    # sqlite3.OperationalError at a chosen statement (fault injection, counting).
    wrap_connection: Callable[[sqlite3.Connection], Any] | None = attrs.field(
        default=None, kw_only=True, repr=False
    )

    @asynccontextmanager
    async def open_executor(
        self, clock: Callable[[], float] | None
    ) -> AsyncIterator[InlineExecutor | ThreadExecutor]:
        # One host: the lease clock is the runtime's (wall clock unless a test passes one).
        clock = clock or time.time
        with contextlib.ExitStack() as connections:
            if self.inline:
                conn = connections.enter_context(
                    contextlib.closing(connect(self.path, synchronous=self.synchronous))
                )
                file = DatabaseFile.opened(self.path)
                reader = self._reader(connections, clock, CHANGE_POLL, own_conn=conn)
                reader._changed()  # from here on: other connections' commits
                inline = InlineExecutor(self._wrapped(conn), clock, reader, file=file)
                try:
                    yield inline
                finally:
                    inline.closed = True
                return
            conn = connections.enter_context(
                contextlib.closing(
                    await trio.to_thread.run_sync(
                        functools.partial(connect, self.path, synchronous=self.synchronous)
                    )
                )
            )
            poll_for_lock(conn)  # its batches wait for the lock in short pauses, not SQLite's
            file = DatabaseFile.opened(self.path)
            inline_conn = connections.enter_context(
                contextlib.closing(connect_nonblocking(self.path, synchronous=self.synchronous))
            )
            reader = self._reader(connections, clock, CHANGE_POLL, own_conn=inline_conn)
            reader.budget = _codec.LOOP_BUDGET_UNITS  # a worker thread reads larger data
            read_conn = connections.enter_context(
                contextlib.closing(connect_nonblocking(self.path, synchronous=self.synchronous))
            )
            async with open_thread_executor(
                self._wrapped(conn),
                clock,
                reader,
                inline_conn=self._wrapped(inline_conn),
                file=file,
                read_conn=self._wrapped(read_conn),  # wrapped last: seams count the others
            ) as executor:
                yield executor

    def _reader(
        self,
        connections: contextlib.ExitStack,
        clock: Callable[[], float],
        poll: float,
        *,
        own_conn: sqlite3.Connection | None = None,
    ) -> ChangeReader:
        conn = connections.enter_context(
            contextlib.closing(connect_nonblocking(self.path, synchronous=self.synchronous))
        )
        conn.execute("SELECT 1 FROM sqlite_master LIMIT 1")  # the WAL file exists from here
        # The WAL sits beside the file the name resolves to (a symlink's target), where
        # SQLite opened it: a watch on `<link>-wal` would never fire, leaving a 5 ms poll.
        watch = open_watch(f"{os.path.realpath(self.path)}-wal")
        if watch is not None:
            connections.callback(watch.close)
        # `own_conn` unwrapped: the signal's PRAGMA is no statement of a batch.
        return ChangeReader(conn, clock, poll, watch, own_conn)

    def _wrapped(self, conn: sqlite3.Connection) -> sqlite3.Connection:
        return conn if self.wrap_connection is None else self.wrap_connection(conn)
