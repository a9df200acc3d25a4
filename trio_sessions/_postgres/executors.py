"""How operations get from trio to PostgreSQL: the executors (`_backend.Executor`) over one
`PgEngine` and an optional `PgListener`, and `PostgresStore`, the store a runtime opens.

`PgThreadExecutor` (the default) runs `writers` writer lanes, each one engine (one
connection) fed by its own group-commit queue and a worker thread of its own (no
`trio.to_thread` per batch: the hand-offs, not the server, dominated a sequential cycle):
every operation queued on a lane during one hand-off runs in that lane's batches, while
the other lanes' batches run in parallel (the server's per-row work, not fsync, bounds a
set-based batch: one connection leaves the server's other cores idle). `PgInlineExecutor`
(`inline=True`, tests) runs each operation in its own transaction on the trio thread, so
virtual time never jumps while PostgreSQL works.

A lone caller (its lane idle, no other task runnable) of an operation that runs alone as
one autocommit call skips the worker: the call runs on the lane's connection from the
trio thread, without blocking (`onloop`) - on the sequential cycle the hand-off's thread
wake-ups cost more than the server's work for the call.

Connections per executor, hence per runtime: `writers` writer connections (default
`WRITERS`), the listener (`listen=True`), and the liveness token's connection (`hold_token`)
while the runtime holds the token - size `max_connections` at `writers + 2` per process plus
headroom. The inline executor has one writer.

Invariants:
* an operation that has begun is never abandoned (as in `_sqlite`): a caller cancelled while
  its operation is queued sees it withdrawn unrun; once taken, the caller waits for its
  outcome, so a committed write is always reported - but a write's worker withdraws it
  unrun (`engine.Withdrawals`) where nothing of it committed: before its transaction (or
  autocommit call) sends anything, or when a statement of it still unanswered after
  `CANCEL_AFTER_S` (waiting for a session's lock another connection holds) is cancelled and
  the transaction rolled back before its COMMIT, the others of its batch run again - so a
  drain stopped at its lease's deadline exits then, not when the lock is freed (DESIGN
  §6.17); an operation whose earlier attempt's reply was lost is never withdrawn;
* a session's operations queued or running are all on one lane, so they run on one
  connection in the order they were queued (within one batch, the set-wise calls of a
  kind come before the jobs run one by one: operations queued together are concurrent
  callers'), and two lanes' batches never wait for each other's session locks (a batch
  takes its sessions' locks first, in one order, so batches of two processes wait rather
  than deadlock; one that still arises is retried, 40P01);
* a session with nothing queued or running goes to the first lane while that lane holds
  less than four full hand-offs (`spill_at`), else to the least busy lane: at a light load one
  lane's larger batches commit less often and keep fewer server backends busy (the chat
  load answered faster on one lane than on three); under a heavy one every lane works;
* an operation whose first argument is not a session id (a recovery pass's scan and
  takeover, a heartbeat) has no session's order to keep: it goes to the least busy lane
  and runs first in its hand-off, in a transaction of its own (alone, one autocommit call
  if it can be), not behind or inside a batch of drains' writes;
* a notification our own writers sent is not a change worth a look (the runtime handles its
  own writes where it makes them), nor is another process's transcript-only one for a
  session no watcher or stream here follows (`follows`).
"""

from __future__ import annotations

import functools
import queue
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, TypeVar, TypeVarTuple, Unpack

import attrs
import psycopg
import trio

from .. import _liveness
from .._backend import (
    BackendName,
    Follows,
    Job,
    Signal,
    StoreStatistics,
    Tx,
    closed_before_run,
    executor_closed,
    session_named,
)
from .._errors import StoreError
from .._handoff import Queued
from .._naming import check_postgres_name, check_schema, display_name
from .._validate import check_flag
from . import onloop
from .engine import BATCH_LIMIT, PgEngine, Withdrawals
from .listener import PgListener, Wanted, _wait_for_change, token_connection
from .transactions import Mode

T = TypeVar("T")
Ts = TypeVarTuple("Ts")

# Writer connections (lanes) of the default executor. Measured with the bench's 1,000
# sessions in flight on a busy 2-core host, paired rounds against raw psycopg: 1 writer
# 2.6-4.2x, 2 writers 3.5-7.2x, 3 writers 5.1-8.3x, 4 writers 3.9-8.4x (medians of runs;
# one writer is bound by the server's work per row on one core). Three: four no better
# here, and each costs every process a connection.
WRITERS = 3
MAX_WRITERS = 16
# At most one transaction's worth of operations per hand-off: the first batch's callers
# go on (their drains run on the trio thread) while the server works on the next batches.
HANDOFF_LIMIT = BATCH_LIMIT
# The first lane's load (operations queued or running) from which a session with nothing
# queued spills to the least busy lane: four full hand-offs. Measured against one (the
# PostgreSQL bench sections, alternating): a recovery pass's resumed drains release on the
# first lane in a few large batches instead of beside the next pass's scan on the others,
# recovery 0.36x against 0.31x raw; 1,000 in flight and the chat load alike.
SPILL_AT = 4 * HANDOFF_LIMIT


def _hold_token(
    engine: PgEngine, owner_id: str, *, inline: bool
) -> AbstractAsyncContextManager[_liveness.PgToken]:
    return _liveness.hold_pg_token(
        functools.partial(token_connection, engine.url, engine.schema), owner_id, inline=inline
    )


def _statistics(
    engines: Sequence[PgEngine], listener: PgListener | None, handoffs: int = 0
) -> StoreStatistics:
    each = [engine.statistics() for engine in engines]
    return StoreStatistics(
        "postgres",
        transactions=sum(figures.transactions for figures in each),
        handoffs=handoffs,
        inline_runs=sum(figures.inline_runs for figures in each),
        retries=sum(figures.retries for figures in each),
        reconnects=sum(figures.reconnects for figures in each)
        + (0 if listener is None else listener.reconnects),
    )


@attrs.define(eq=False)
class PgInlineExecutor:
    """Each operation runs in its own transaction on the trio thread (deterministic tests:
    virtual time never jumps while PostgreSQL works)."""

    engine: PgEngine
    listener: PgListener | None = None
    backend: BackendName = "postgres"
    closed: bool = False

    def statistics(self) -> StoreStatistics:
        figures = _statistics([self.engine], self.listener)
        # Every transaction runs on the trio thread.
        return attrs.evolve(figures, inline_runs=figures.transactions)

    async def _run(self, mode: Mode, op: Callable[..., T], args: tuple[Any, ...]) -> T:
        await trio.lowlevel.checkpoint_if_cancelled()
        if self.closed:
            raise executor_closed()
        job = Job(op, args)
        self.engine.run_alone(job, mode)
        await trio.lowlevel.cancel_shielded_checkpoint()
        result: T = job.unwrap()
        return result

    async def run(self, op: Callable[[Tx, Unpack[Ts]], T], *args: *Ts) -> T:
        return await self._run("write", op, args)

    async def run_nowait(self, op: Callable[[Tx, Unpack[Ts]], T], *args: *Ts) -> T:
        return await self._run("nowait", op, args)

    async def read(self, op: Callable[[Tx, Unpack[Ts]], T], *args: *Ts) -> T:
        return await self._run("read", op, args)

    async def wait_for_change(
        self,
        kick: trio.Event,
        fallback: float,
        *,
        follows: Follows = None,
    ) -> Signal | None:
        wanted = _wanted([self.engine], follows)
        return await _wait_for_change(self.listener, kick, fallback, wanted)

    def hold_token(self, owner_id: str) -> AbstractAsyncContextManager[_liveness.PgToken]:
        return _hold_token(self.engine, owner_id, inline=True)


def _wanted(engines: Sequence[PgEngine], follows: Follows) -> Wanted:
    """Whether a notification's session (backend pid, session, watchers only) is worth a
    look: not one our own writers sent; and a transcript-only change only if `follows` says
    a watcher or stream here follows it."""

    def wanted(pid: int, session_id: str, watchers_only: bool) -> bool:
        if watchers_only and follows is not None and not follows(session_id):
            return False
        # Read per notification: a writer's pid changes when it reconnects.
        return not any(pid == engine.backend_pid for engine in engines)

    return wanted


def _on_a_session(job: Job) -> bool:
    return session_named(job.op, job.args) is not None


@attrs.define(eq=False)
class _Placed:
    """The lane a session's queued and running operations are on, and how many."""

    lane: _Lane
    count: int = 0


@attrs.define(eq=False)
class _Lane:
    """One writer: an engine (one connection), its group-commit queue, and a worker thread
    of its own.

    No `trio.to_thread` per batch: an idle lane's pump hands what was queued to the worker
    one trio pass after the first submit (so operations started together share a batch;
    a write on no session, which runs alone anyway, goes at once),
    and the worker's completion (one `run_sync_soon` callback) wakes each caller directly
    and hands over at once what queued meanwhile - the fewest trio passes and thread
    wake-ups between a call and its reply (on the sequential cycle the hand-offs cost more
    than the server's work). A hand-off with writes and reads wakes the writes' callers
    first, before its reads run.

    Invariants (as `_handoff.HandoffQueue`): a caller cancelled while its operation is
    queued sees it withdrawn unrun; so does a write's caller while no attempt for its
    operation has begun; else it waits for the outcome - which for a write may be its
    withdrawal by the worker, nothing of it committed (`engine.Withdrawals`, one per
    hand-off). Only the trio thread touches the queue; the worker sees a batch only
    through its inbox.
    """

    engine: PgEngine
    limit: int = HANDOFF_LIMIT
    handoffs: int = 0
    closed: bool = False
    _queue: list[Queued] = attrs.Factory(list)
    _in_flight: list[Queued] | None = None
    _idle: trio.Event | None = None
    _inbox: queue.SimpleQueue[tuple[list[Queued], Withdrawals] | None] = attrs.Factory(
        queue.SimpleQueue
    )
    _token: trio.lowlevel.TrioToken | None = None
    _wake: trio.Event = attrs.Factory(trio.Event)

    def start(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        thread = threading.Thread(
            target=self._work, name=f"trio-sessions-pg-{id(self):x}", daemon=True
        )
        thread.start()

    async def submit(self, job: Job, mode: str) -> Any:
        if self.closed:
            raise executor_closed()
        if self._in_flight is None and not self._queue and onloop.may_run(self.engine, job, mode):
            return await self._on_the_loop(job, mode)
        return await self._queued(job, mode)

    async def _on_the_loop(self, job: Job, mode: str) -> Any:
        """`onloop.run_on_the_loop`, the lane in flight meanwhile: what queues waits for it.
        What the loop leaves to the worker is handed over at once, first in the hand-off
        of what queued meanwhile - a session's operations keep their order - and so also
        once the lane closed meanwhile: `close` waits for it as for any batch in flight."""
        self._in_flight = []
        try:
            settled = await onloop.run_on_the_loop(self.engine, job, read=mode == "read")
        except BaseException:
            self._done([])
            raise
        if settled:
            self._done([])
            return job.unwrap()
        queued = Queued(job, mode, trio.lowlevel.current_task())
        self._queue.insert(0, queued)
        self._dispatch()
        if job.reply_lost:
            # It may have landed: its caller waits for the worker's read-back, never
            # withdrawing it (as the worker never withdraws it).
            with trio.CancelScope(shield=True):
                return await queued.outcome(self._queue.remove)
        return await queued.outcome(self._queue.remove)

    async def _queued(self, job: Job, mode: str) -> Any:
        queued = Queued(job, mode, trio.lowlevel.current_task())
        self._queue.append(queued)
        if self._in_flight is None:
            if len(self._queue) == 1 and mode == "write" and not _on_a_session(job):
                # A write on no session (a recovery pass's scan or takeover) runs alone
                # in any hand-off: it has no batch to wait for, so it goes now rather than
                # a trio pass later with the pump - a pass that the drains the last
                # takeover started fill (PostgreSQL recovery 4-6 % faster, alternating).
                self._dispatch()
            else:
                self._wake.set()
        return await queued.outcome(lambda withdrawn: self._queue.remove(withdrawn))

    async def pump(self) -> None:
        """Hand an idle lane's queue to the worker, one trio pass after the first submit
        (a busy lane's next batch is handed over by `_done`)."""
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            if self._in_flight is None and self._queue and not self.closed:
                self._dispatch()

    def _dispatch(self) -> None:
        batch, self._queue = self._queue[: self.limit], self._queue[self.limit :]
        # A write's caller cancelled in the worker is withdrawn where nothing of it
        # committed (its statement waiting for a session's lock cancelled), and woken then.
        token = self._token
        assert token is not None

        def wake(jobs: list[Job]) -> None:
            gone = {id(job) for job in jobs}
            token.run_sync_soon(_finish, [queued for queued in batch if id(queued.job) in gone])

        withdrawals = Withdrawals(wake)
        for queued in batch:
            queued.taken = True
            if queued.mode != "read":
                queued.start = withdrawals
        self.handoffs += 1
        self._in_flight = batch
        self._inbox.put((batch, withdrawals))

    def _work(self) -> None:
        """The worker thread: each batch the trio side hands over, until told to stop - its
        writes, then its reads. The writes' callers go on once their transactions are
        over: a write's reply never waits for the reads that shared its hand-off."""
        assert self._token is not None
        while (handed := self._inbox.get()) is not None:
            batch, withdrawals = handed
            writes = [queued for queued in batch if queued.mode != "read"]
            reads = [queued for queued in batch if queued.mode == "read"]
            if writes:
                _reporting(writes, functools.partial(self._run_writes, withdrawals=withdrawals))
                if reads:
                    self._token.run_sync_soon(_finish, writes)
            if reads:
                _reporting(reads, self._run_reads)
            self._token.run_sync_soon(self._done, batch)

    def _run_writes(self, writes: list[Queued], withdrawals: Withdrawals) -> None:
        by_mode: dict[str, list[Job]] = {"write": [], "nowait": [], "alone": []}
        for queued in writes:
            mode = queued.mode
            # A write whose call on the loop may have landed (`Job.reply_lost`) runs alone,
            # first: its call reads back with `retry`, which a batch's would not.
            if mode == "write" and (queued.job.reply_lost or not _on_a_session(queued.job)):
                mode = "alone"
            by_mode[mode].append(queued.job)
        self.engine.run_jobs(by_mode["write"], by_mode["nowait"], by_mode["alone"], withdrawals)

    def _run_reads(self, reads: list[Queued]) -> None:
        self.engine.run_reads([queued.job for queued in reads])

    @property
    def load(self) -> int:
        """Operations queued or in flight here: a call on the loop (`_on_the_loop`, no
        batch) counts as one."""
        flight = self._in_flight
        return len(self._queue) + (0 if flight is None else max(1, len(flight)))

    def _done(self, batch: list[Queued]) -> None:
        """On the trio thread: the batch's callers go on (a write's caller that went on
        before the reads is not woken twice: `Queued.finish` acts once); what queued
        meanwhile is next."""
        self._in_flight = None
        _finish(batch)
        if self._queue and not self.closed:
            self._dispatch()
        elif self._idle is not None:
            self._idle.set()

    async def close(self) -> None:
        """Refuse new work, fail what is queued, wait (shielded) for the batch in flight,
        and stop the worker."""
        self.closed = True
        for queued in self._queue:
            queued.job.error = closed_before_run()
            queued.finish()
        self._queue.clear()
        if self._in_flight is not None:
            self._idle = trio.Event()
            with trio.CancelScope(shield=True):
                await self._idle.wait()
        self._inbox.put(None)


def _reporting(batch: list[Queued], run: Callable[[list[Queued]], None]) -> None:
    """`run(batch)` - and should it raise (the engine never raises for a job), every job of
    the batch reports it."""
    try:
        run(batch)
    except BaseException as exc:
        for queued in batch:
            if queued.job.error is None:
                queued.job.error = StoreError(f"the store's worker failed: {exc!r}")


def _finish(batch: list[Queued]) -> None:
    """On the trio thread: the batch's callers go on."""
    for queued in batch:
        queued.finish()


@attrs.define(eq=False)
class PgThreadExecutor:
    """Group commit on `writers` lanes, one connection and worker hand-off at a time each.
    Use `open_thread_executor`."""

    engines: Sequence[PgEngine]
    listener: PgListener | None = None
    spill_at: int = SPILL_AT
    _placed: dict[str, _Placed] = attrs.Factory(dict)
    _lanes: list[_Lane] = attrs.field(init=False)
    backend: BackendName = "postgres"

    @_lanes.default
    def _lanes_default(self) -> list[_Lane]:
        return [_Lane(engine) for engine in self.engines]

    @property
    def engine(self) -> PgEngine:
        """The first lane's engine (where the liveness token's connection goes)."""
        return self.engines[0]

    def statistics(self) -> StoreStatistics:
        handoffs = sum(lane.handoffs for lane in self._lanes)
        return _statistics(self.engines, self.listener, handoffs)

    async def run(self, op: Callable[[Tx, Unpack[Ts]], T], *args: *Ts) -> T:
        result: T = await self._submit(Job(op, args), "write")
        return result

    async def run_nowait(self, op: Callable[[Tx, Unpack[Ts]], T], *args: *Ts) -> T:
        # Queued like any operation (the writer's batch ends soon), then run alone with a
        # short lock_timeout: another process's lock is not waited for.
        result: T = await self._submit(Job(op, args), "nowait")
        return result

    async def read(self, op: Callable[[Tx, Unpack[Ts]], T], *args: *Ts) -> T:
        # Through the session's writer lane: a fixed number of connections per process.
        # Alone, on one REPEATABLE READ snapshot; PostgreSQL readers never wait for writers.
        result: T = await self._submit(Job(op, args), "read")
        return result

    async def wait_for_change(
        self,
        kick: trio.Event,
        fallback: float,
        *,
        follows: Follows = None,
    ) -> Signal | None:
        wanted = _wanted(self.engines, follows)
        return await _wait_for_change(self.listener, kick, fallback, wanted)

    def hold_token(self, owner_id: str) -> AbstractAsyncContextManager[_liveness.PgToken]:
        return _hold_token(self.engine, owner_id, inline=False)

    def _least_busy(self) -> _Lane:
        return min(self._lanes, key=lambda each: each.load)  # the first idle one

    async def _submit(self, job: Job, mode: Mode) -> Any:
        # Cancellation first: a caller cancelled while the runtime closes sees Cancelled,
        # not an error about the executor it was cancelled out of.
        await trio.lowlevel.checkpoint_if_cancelled()
        lanes = self._lanes
        if len(lanes) == 1:
            return await lanes[0].submit(job, mode)
        session_id = session_named(job.op, job.args)
        if session_id is None:  # no session's order to keep
            return await self._least_busy().submit(job, mode)
        placed = self._placed.get(session_id)
        if placed is None:
            lane = lanes[0] if lanes[0].load < self.spill_at else self._least_busy()
            placed = self._placed[session_id] = _Placed(lane)
        placed.count += 1
        try:
            return await placed.lane.submit(job, mode)
        finally:
            placed.count -= 1
            if not placed.count:
                del self._placed[session_id]


@asynccontextmanager
async def open_thread_executor(
    engines: PgEngine | Sequence[PgEngine], listener: PgListener | None = None
) -> AsyncIterator[PgThreadExecutor]:
    """A `PgThreadExecutor` over `engines` (one lane each, opened), whose pumps live in a
    nursery of their own, for the block's duration."""
    executor = PgThreadExecutor([engines] if isinstance(engines, PgEngine) else engines, listener)
    # Shielded, cancelled only when the executor closes: cleanup that runs shielded while
    # the runtime is cancelled from outside still reaches the database.
    pumps = [trio.CancelScope(shield=True) for _ in executor._lanes]

    async def pump(lane: _Lane, scope: trio.CancelScope) -> None:
        with scope:
            await lane.pump()

    async with trio.open_nursery() as nursery:
        for lane, scope in zip(executor._lanes, pumps, strict=True):
            lane.start()
            nursery.start_soon(pump, lane, scope)
        try:
            yield executor
        finally:
            for lane in executor._lanes:
                await lane.close()
            for scope in pumps:
                scope.cancel()


def _masked(url: str) -> str:
    return repr(display_name(url))


def _check_writers(_store: object, _attribute: object, writers: object) -> None:
    if isinstance(writers, bool) or not isinstance(writers, int):
        raise TypeError(f"writers must be an int, got {type(writers).__name__}")
    if not 1 <= writers <= MAX_WRITERS:
        raise ValueError(f"writers must be 1 to {MAX_WRITERS}, got {writers}")


@attrs.frozen
class PostgresStore:
    """A PostgreSQL database (and schema), and how to reach it from trio (many hosts).

    Leases are judged by the server's clock unless `open_executor` gets one (tests).
    `inline=True` runs psycopg on the trio thread (deterministic tests with a virtual
    clock); the default hands work to `writers` writer connections (1-16, default
    `WRITERS`), each with its own thread, and groups the concurrent operations of each per
    hand-off; one session's operations always use the same one. `listen=True` keeps a
    LISTEN connection, so other hosts' wakes and interrupts arrive within milliseconds;
    `listen=False` (poll-only, e.g. behind a transaction-pooling PgBouncer) relies on the
    runtime's fallback poll.
    """

    url: str = attrs.field(repr=_masked, validator=lambda _s, _a, url: check_postgres_name(url))
    schema: str = attrs.field(
        default="public", kw_only=True, validator=lambda _s, _a, schema: check_schema(schema)
    )
    inline: bool = attrs.field(default=False, kw_only=True, validator=check_flag)
    listen: bool = attrs.field(default=True, kw_only=True, validator=check_flag)
    writers: int = attrs.field(default=WRITERS, kw_only=True, validator=_check_writers)
    # Test seam: wraps each connection the engine opens (also after a reconnect), e.g. to
    # break the connection at COMMIT (fault injection, counting).
    wrap_connection: Callable[[psycopg.Connection[Any]], Any] | None = attrs.field(
        default=None, kw_only=True, repr=False
    )

    def engine(self, clock: Callable[[], float] | None = None) -> PgEngine:
        """An engine for this store (not yet connected; call `open()`)."""
        return PgEngine(self.url, self.schema, clock, self.wrap_connection)

    @asynccontextmanager
    async def open_executor(
        self, clock: Callable[[], float] | None
    ) -> AsyncIterator[PgInlineExecutor | PgThreadExecutor]:
        # clock=None: the server's clock_timestamp() is the lease clock of every host.
        engines = [self.engine(clock) for _ in range(1 if self.inline else self.writers)]
        listener = PgListener(self.url, self.schema, inline=self.inline) if self.listen else None
        try:
            for index, engine in enumerate(engines):
                # The first connection migrates; the others find the schema up to date.
                if self.inline:
                    engine.open()
                else:
                    await trio.to_thread.run_sync(
                        functools.partial(engine.open, migrate_schema=index == 0)
                    )
            if listener is not None:
                await listener.open()
            if self.inline:
                inline = PgInlineExecutor(engines[0], listener)
                try:
                    yield inline
                finally:
                    inline.closed = True  # its engine would reconnect for a later call
            else:
                async with open_thread_executor(engines, listener) as executor:
                    yield executor
        finally:
            if listener is not None:
                listener.close()
            for engine in engines:
                if self.inline:
                    engine.close()
                else:
                    with trio.CancelScope(shield=True):
                        await trio.to_thread.run_sync(engine.close)
