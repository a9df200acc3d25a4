"""How operations get from trio to PostgreSQL: the executors (`_backend.Executor`) over one
`PgEngine` and an optional `PgListener`, and `PostgresStore`, the store a runtime opens.

`PgThreadExecutor` (the default) hands every operation queued during one hand-off to one
worker thread at a time (group commit); `PgInlineExecutor` (`inline=True`, tests) runs each
operation in its own transaction on the trio thread, so virtual time never jumps while
PostgreSQL works.

Connections: TWO per executor, hence per runtime (size `max_connections` at two per process
plus headroom): the writer (the engine's), and the listener (`listen=True`); the liveness
token's connection (`hold_token`) is a third while the runtime holds the token.

Invariants:
* an operation that has begun is never abandoned (as in `_sqlite`): a caller cancelled while
  its operation is queued sees it withdrawn unrun; once taken, the caller waits for its
  outcome, so a committed write is always reported;
* a notification our own writer sent is not a change worth a look, unless the runtime says
  it still needs it (`own`).
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, TypeVar, TypeVarTuple, Unpack

import attrs
import psycopg
import trio

from .. import _liveness
from .._backend import BackendName, Job, OwnChange, StoreStatistics, Tx
from .._handoff import HandoffQueue, Queued, pumping
from .._naming import check_postgres_name, check_schema, mask_password
from .engine import PgEngine
from .listener import PgListener, Wanted, _wait_for_change, token_connection
from .transactions import Mode

T = TypeVar("T")
Ts = TypeVarTuple("Ts")


def _hold_token(
    engine: PgEngine, owner_id: str, *, inline: bool
) -> AbstractAsyncContextManager[_liveness.PgToken]:
    return _liveness.hold_pg_token(
        functools.partial(token_connection, engine.url, engine.schema), owner_id, inline=inline
    )


def _statistics(
    engine: PgEngine, listener: PgListener | None, handoffs: int = 0
) -> StoreStatistics:
    figures = engine.statistics(handoffs)
    if listener is not None:
        figures = attrs.evolve(figures, reconnects=figures.reconnects + listener.reconnects)
    return figures


@attrs.define(eq=False)
class PgInlineExecutor:
    """Each operation runs in its own transaction on the trio thread (deterministic tests:
    virtual time never jumps while PostgreSQL works)."""

    engine: PgEngine
    listener: PgListener | None = None
    backend: BackendName = "postgres"

    def statistics(self) -> StoreStatistics:
        return _statistics(self.engine, self.listener)

    async def _run(self, mode: Mode, op: Callable[..., T], args: tuple[Any, ...]) -> T:
        await trio.lowlevel.checkpoint_if_cancelled()
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
        own: OwnChange = None,
        follows: OwnChange = None,
    ) -> None:
        await _wait_for_change(self.listener, kick, fallback, _wanted(self.engine, own, follows))

    def hold_token(self, owner_id: str) -> AbstractAsyncContextManager[_liveness.PgToken]:
        return _hold_token(self.engine, owner_id, inline=True)


def _wanted(engine: PgEngine, own: OwnChange, follows: OwnChange) -> Wanted:
    """Whether a notification's session (backend pid, session, watchers only) is worth a
    look: not one our own writer sent, unless `own` says this runtime still needs it; and a
    transcript-only change only if `follows` says a watcher or stream here follows it."""

    def wanted(pid: int, session_id: str, watchers_only: bool) -> bool:
        if watchers_only and follows is not None and not follows(session_id):
            return False
        return pid != engine.backend_pid or (own is not None and own(session_id))

    return wanted


@attrs.define(eq=False)
class PgThreadExecutor:
    """Group commit through one worker hand-off at a time. Use `open_thread_executor`."""

    engine: PgEngine
    listener: PgListener | None = None
    _handoff: HandoffQueue = attrs.Factory(HandoffQueue)
    _limiter: trio.CapacityLimiter = attrs.Factory(lambda: trio.CapacityLimiter(1))
    backend: BackendName = "postgres"

    def statistics(self) -> StoreStatistics:
        return _statistics(self.engine, self.listener, self._handoff.handoffs)

    async def run(self, op: Callable[[Tx, Unpack[Ts]], T], *args: *Ts) -> T:
        result: T = await self._submit(Job(op, args), "write")
        return result

    async def run_nowait(self, op: Callable[[Tx, Unpack[Ts]], T], *args: *Ts) -> T:
        # Queued like any operation (the writer's batch ends soon), then run alone with a
        # short lock_timeout: another process's lock is not waited for.
        result: T = await self._submit(Job(op, args), "nowait")
        return result

    async def read(self, op: Callable[[Tx, Unpack[Ts]], T], *args: *Ts) -> T:
        # Through the same writer hand-off: one connection per process. Alone, on one
        # REPEATABLE READ snapshot; PostgreSQL readers never wait for writers.
        result: T = await self._submit(Job(op, args), "read")
        return result

    async def wait_for_change(
        self,
        kick: trio.Event,
        fallback: float,
        *,
        own: OwnChange = None,
        follows: OwnChange = None,
    ) -> None:
        await _wait_for_change(self.listener, kick, fallback, _wanted(self.engine, own, follows))

    def hold_token(self, owner_id: str) -> AbstractAsyncContextManager[_liveness.PgToken]:
        return _hold_token(self.engine, owner_id, inline=False)

    async def _submit(self, job: Job, mode: Mode) -> Any:
        # Cancellation first: a caller cancelled while the runtime closes sees Cancelled,
        # not an error about the executor it was cancelled out of.
        await trio.lowlevel.checkpoint_if_cancelled()
        return await self._handoff.submit(job, mode)

    async def _hand_off(self, batch: list[Queued]) -> None:
        by_mode: dict[str, list[Job]] = {"write": [], "nowait": [], "read": []}
        for queued in batch:
            by_mode[queued.mode].append(queued.job)
        await trio.to_thread.run_sync(
            self.engine.run_jobs,
            by_mode["write"],
            by_mode["nowait"],
            by_mode["read"],
            limiter=self._limiter,
        )


@asynccontextmanager
async def open_thread_executor(
    engine: PgEngine, listener: PgListener | None = None
) -> AsyncIterator[PgThreadExecutor]:
    """A `PgThreadExecutor` whose pump lives in its own nursery, for the block's duration."""
    executor = PgThreadExecutor(engine, listener)
    async with pumping(executor._handoff, executor._hand_off):
        yield executor


def _masked(url: str) -> str:
    return repr(mask_password(url))


@attrs.frozen
class PostgresStore:
    """A PostgreSQL database (and schema), and how to reach it from trio (many hosts).

    Leases are judged by the server's clock unless `open_executor` gets one (tests).
    `inline=True` runs psycopg on the trio thread (deterministic tests with a virtual
    clock); the default hands work to one writer thread and groups concurrent operations
    per hand-off. `listen=True` keeps a LISTEN connection, so other hosts' wakes and
    interrupts arrive within milliseconds; `listen=False` (poll-only, e.g. behind a
    transaction-pooling PgBouncer) relies on the runtime's fallback poll.
    """

    url: str = attrs.field(repr=_masked, validator=lambda _s, _a, url: check_postgres_name(url))
    schema: str = attrs.field(
        default="public", kw_only=True, validator=lambda _s, _a, schema: check_schema(schema)
    )
    inline: bool = attrs.field(default=False, kw_only=True)
    listen: bool = attrs.field(default=True, kw_only=True)
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
        engine = self.engine(clock)
        listener = PgListener(self.url, self.schema, inline=self.inline) if self.listen else None
        if self.inline:
            engine.open()
        else:
            await trio.to_thread.run_sync(engine.open)
        try:
            if listener is not None:
                await listener.open()
            if self.inline:
                yield PgInlineExecutor(engine, listener)
            else:
                async with open_thread_executor(engine, listener) as executor:
                    yield executor
        finally:
            if listener is not None:
                listener.close()
            if self.inline:
                engine.close()
            else:
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(engine.close)
