"""`open_runtime` and `serve_runtime`: a runtime's life from open to close.

Opening checks every option before anything is opened (`_Config`), opens the store's
executor, takes the liveness token (a runtime that drains holds it from before its first
claim until after its last drain exited), runs the first recovery pass, and starts the
background tasks - heartbeat, recovery loop, token keeping, owner watching, due timer and
change loop - in the runtime's own nursery. Closing cancels the drains, waits until each
exited, and only then hands its claim back (`Runtime._shutdown`, shielded); the heartbeat
runs until then. Exactly one exception escapes the block, unwrapped: the block's own, or
the one a background task ended the runtime with (`StoreLost`, a test seam's error).

The runtime itself is `_verbs.Runtime`; its claims' choreography is `_busy`, its background
loops `_loops`. This module re-exports the names other modules import from here.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio

from . import _validate
from ._backend import Executor, StoreBackend, Token
from ._drain import TAKE_INPUTS_CHUNK as TAKE_INPUTS_CHUNK
from ._drain import AssistantWriter as AssistantWriter
from ._drain import Drain
from ._drain import DrainContext as DrainContext
from ._errors import StoreError
from ._lease import SELF_FENCE_MARGIN, self_fence_deadline
from ._liveness import MIN_TAKEOVER_GRACE
from ._model import Claim
from ._naming import ACCEPTED_FORMS, check_file_store, store_kind
from ._sqlite import SQLiteStore
from ._validate import make_owner_id as make_owner_id
from ._verbs import Runtime as Runtime
from ._verbs import Seams as Seams

AcquisitionHook = Callable[[Claim], Awaitable[None]]


@asynccontextmanager
async def open_runtime(
    store: str | os.PathLike[str] | StoreBackend,
    drain: Drain | None,
    *,
    owner_id: str | None = None,
    lease: float = 30.0,
    heartbeat_interval: float | None = None,
    recovery_interval: float = 5.0,
    recovery_batch: int = 100,
    max_resumes: int = 10,
    max_active: int | None = None,
    clock: Callable[[], float] | None = None,
    acquisition_hook: AcquisitionHook | None = None,
    shutdown_grace: float | None = None,
    takeover_grace: float = 0.5,
) -> AsyncIterator[Runtime]:
    """Open the store, run the first recovery pass, and yield a `Runtime`.

    The store is created and migrated on open (an SQLite file, a PostgreSQL schema). The
    runtime owns a nursery: drains, the heartbeat and the recovery task run in it.
    Leaving the block - normally, by an exception or by cancellation - cancels the drains,
    waits until each drain has exited, and only then hands its claim back: the claim is
    kept and its lease expired (shielded, bounded by a few seconds; if that cannot land the
    lease simply runs out), so any owner recovers it at once, without counting against its
    resume budget. A drain that has not exited after `shutdown_grace` seconds (default
    lease/3: a blocking call in a thread, a shielded `finally`) is logged and keeps its claim
    and its heartbeat until it exits, so closing waits for it: drains of one session never
    overlap in time, graceful restarts included. Exceptions from drains become outcomes;
    only the block's own exception escapes, unwrapped. (`Exception`s only: a drain raising
    `KeyboardInterrupt` or `SystemExit` ends the whole runtime - trio's rule for those - and
    it escapes this block, unwrapped, after the shutdown above.)

    A runtime that drains holds a liveness token from open to close (DESIGN §4 "Owner
    liveness"): when its process dies, the OS or the server releases it, and other runtimes
    take its claims over once it stayed free for `takeover_grace` seconds (default 0.5, at
    least 0.02), long before their leases run out. Losing it while alive (its PostgreSQL
    connection broke) stops every drain at once with reason `lease_lost`; their claims are
    handed back once they exited, and the token is taken again.

    Raises, before anything is opened, `TypeError`/`ValueError` for a bad option or store
    (an in-memory SQLite database, `""` or `":memory:"`, is no store: `ValueError`) (and
    `TypeError` for a plain `def` drain or acquisition hook; a `clock` is read once, and one
    that gives no epoch seconds from 0 to 1e11 is refused - a later such reading fails the
    transaction that read it with an error naming the clock); then `SchemaTooNew` for a
    store written by a newer library and `StoreError` when the store cannot be opened or the
    first recovery pass fails. Cancelled while opening: whatever opened is closed again.

    `drain=None` opens a producer: `submit`, `wake`, `interrupt` and `transcript` work and
    are durable, but it never claims a session, recovers, or heartbeats (and holds no
    liveness token); `run` returns `deferred` and the wakes wait for a runtime that drains.
    """
    backend = _resolve_store(store)
    if isinstance(backend, SQLiteStore):
        check_file_store(backend.path)
    if drain is not None:
        _validate.async_callable(drain, "drain", "a DrainContext, or None")
    lease = _validate.lease(lease)
    heartbeat = (
        lease / 3
        if heartbeat_interval is None
        else _validate.seconds(heartbeat_interval, "heartbeat_interval")
    )
    if heartbeat >= lease:
        raise ValueError(f"heartbeat_interval ({heartbeat}) must be shorter than lease ({lease})")
    if heartbeat >= self_fence_deadline(0.0, lease):
        # A claim made just after a tick waits a whole interval for its first renewal, and
        # its drain stops at its local deadline (§6.17): past it, every drain longer than
        # that would be stopped as lease_lost with the store answering every renewal.
        raise ValueError(
            f"heartbeat_interval ({heartbeat}) must be shorter than"
            f" {1 - SELF_FENCE_MARGIN:.0%} of lease ({lease}): a drain whose claim is not"
            " renewed by then is stopped"
        )
    shutdown_grace = (
        lease / 3
        if shutdown_grace is None
        else _validate.duration(shutdown_grace, "shutdown_grace")
    )
    recovery_interval = _validate.seconds(recovery_interval, "recovery_interval")
    recovery_batch = _validate.count(recovery_batch, "recovery_batch", 1)
    max_resumes = _validate.count(max_resumes, "max_resumes", 0)
    if max_active is not None:
        max_active = _validate.count(max_active, "max_active", 1)
    if owner_id is not None:
        owner_id = _validate.validate_id(owner_id, "owner id")
    takeover_grace = _validate.duration(
        takeover_grace, "takeover_grace", minimum=MIN_TAKEOVER_GRACE
    )
    if clock is not None:
        clock = _validate.clock(clock)
    if acquisition_hook is not None:
        _validate.async_callable(acquisition_hook, "acquisition_hook", "a Claim")
    config = _Config(
        owner_id=make_owner_id(owner_id),
        lease=lease,
        heartbeat_interval=heartbeat,
        recovery_interval=recovery_interval,
        recovery_batch=recovery_batch,
        max_resumes=max_resumes,
        max_active=max_active,
        clock=clock,
        acquisition_hook=acquisition_hook,
        shutdown_grace=shutdown_grace,
        takeover_grace=takeover_grace,
    )
    raised: BaseException | None = None  # the block's own exception
    escaping: BaseException | None = None
    try:
        async with _open_runtime(backend, drain, config) as runtime:
            try:
                yield runtime
            except BaseException as exc:
                raised = exc
                raise
    except BaseExceptionGroup as group:
        escaping = _the_one_exception(group, raised)
        if escaping is group:
            raise
    if escaping is not None:
        # Raised here, outside the handler: its own cause and context stay as they were.
        raise escaping


def _the_one_exception(
    group: BaseExceptionGroup[Any], raised: BaseException | None
) -> BaseException:
    """The exception a runtime's block lets escape. A group here wraps one exception - the
    block's own, or the one a background task ended the runtime with - once per nursery it
    crossed: exactly one escapes, as from any context manager. A group the block raised
    itself escapes as that very group (trio's cancel scopes pass on a copy of it: `derive`,
    the same message and members)."""
    single: BaseException = group
    while not _is_or_copies(single, raised):
        if not (isinstance(single, BaseExceptionGroup) and len(single.exceptions) == 1):
            return single
        single = single.exceptions[0]
    assert raised is not None
    return raised


def _is_or_copies(exc: BaseException, raised: BaseException | None) -> bool:
    if exc is raised:
        return True
    return (
        isinstance(exc, BaseExceptionGroup)
        and isinstance(raised, BaseExceptionGroup)
        and exc.message == raised.message
        and _leaves(exc) == _leaves(raised)
    )


def _leaves(exc: BaseException) -> list[int]:
    """The identities of a group's exceptions that are no groups, in order: what a copy of
    it keeps (trio copies the groups nested in it too)."""
    if not isinstance(exc, BaseExceptionGroup):
        return [id(exc)]
    return [leaf for member in exc.exceptions for leaf in _leaves(member)]


async def serve_runtime(
    store: str | os.PathLike[str] | StoreBackend,
    drain: Drain | None,
    *,
    task_status: trio.TaskStatus[Runtime] = trio.TASK_STATUS_IGNORED,
    **options: Any,
) -> None:
    """`open_runtime` for `nursery.start`: returns the `Runtime` once it is open (its first
    recovery pass done), then runs until cancelled; cancelling it closes the runtime as
    leaving `open_runtime` does (drains cancelled, claims handed back with expired leases).
    After `testing.crash` it returns, as a killed process's task ends (its token released,
    its claims left to recovery). Options are `open_runtime`'s, and so are the errors,
    raised from `nursery.start`."""
    async with open_runtime(store, drain, **options) as runtime:
        task_status.started(runtime)
        await runtime._crashed_event.wait()


def postgres_store(url: str, **options: Any) -> StoreBackend:
    """`PostgresStore(url, **options)`; `StoreError` saying how to install the `postgres`
    extra when psycopg is missing - a setup step, not a bug to report with a traceback."""
    try:
        from ._postgres import PostgresStore  # psycopg is an optional extra
    except ImportError as exc:
        raise StoreError(
            f"a postgresql:// URL needs psycopg: pip install 'trio-sessions[postgres]' ({exc})"
        ) from exc
    return PostgresStore(url, **options)


def _resolve_store(store: object) -> StoreBackend:
    """A path is an SQLite file; a postgresql:// or postgres:// URL a PostgreSQL database;
    another connection string a `ValueError` (`_naming.store_kind` decides)."""
    if isinstance(store, str | os.PathLike):
        if store_kind(store) == "postgres":
            return postgres_store(os.fspath(store))
        return SQLiteStore(store)
    if callable(getattr(store, "open_executor", None)):
        return store  # type: ignore[return-value]
    raise TypeError(f"store must be {ACCEPTED_FORMS}, got {type(store).__name__}")


@attrs.frozen
class _Config:
    """`open_runtime`'s options, validated."""

    owner_id: str
    lease: float
    heartbeat_interval: float
    recovery_interval: float
    recovery_batch: int
    max_resumes: int
    max_active: int | None
    clock: Callable[[], float] | None
    acquisition_hook: AcquisitionHook | None
    shutdown_grace: float
    takeover_grace: float = 0.5


@asynccontextmanager
async def _holding_token(
    executor: Executor, drain: Drain | None, owner_id: str
) -> AsyncIterator[Token | None]:
    if drain is None:
        yield None
        return
    async with executor.hold_token(owner_id) as token:
        yield token


@asynccontextmanager
async def _open_runtime(
    store: StoreBackend, drain: Drain | None, config: _Config
) -> AsyncIterator[Runtime]:
    async with (
        store.open_executor(config.clock) as executor,
        # Held from before the first claim until after the last drain exited (§4 Owner
        # liveness); a producer never claims, so it holds none.
        _holding_token(executor, drain, config.owner_id) as token,
        trio.open_nursery() as outer,
    ):
        runtime: Runtime | None = None

        def tasks_stopping() -> None:
            # A task's error ends the block too, at once - its `finally` closes the runtime
            # (the heartbeat, shielded, outlives the tasks until then) - except after
            # `testing.crash`, when the block runs on.
            if runtime is None or not runtime._crashed:
                outer.cancel_scope.cancel()

        # The runtime's tasks (drains, loops) live in a nursery of their own beside the
        # caller's block, not around it: `testing.crash` stops every one of them, as a
        # killed process's, while the block - a test going on to watch the takeover -
        # runs on.
        nursery: trio.Nursery = await outer.start(_task_nursery, tasks_stopping)
        runtime = Runtime(executor=executor, nursery=nursery, drain=drain, config=config)
        if token is not None:
            runtime._token = token
            await runtime.recover_once()
            # Cancelled while the pass's transaction was waited for (never abandoned): the
            # cancellation closed the task nursery, so it ends the open here, as itself.
            await trio.lowlevel.checkpoint_if_cancelled()
            nursery.start_soon(runtime._keep_leases)
            nursery.start_soon(runtime._loops.recovery_loop)
            nursery.start_soon(runtime._keep_token, token)
            if token.poll_interval is not None:
                nursery.start_soon(runtime._loops.watch_owners, token.poll_interval)
            nursery.start_soon(runtime._due.run, runtime._loops.fire_due)
        nursery.start_soon(runtime._loops.change_loop)
        try:
            yield runtime
        finally:
            runtime._watchers.close()
            runtime._streams.close()
            try:
                if not runtime._crashed:
                    # Shielded and not bounded here: it waits for drains to exit, which no
                    # deadline can hurry (a nursery waits for its tasks anyway); every
                    # write it makes is bounded on its own.
                    with trio.CancelScope(shield=True):
                        await runtime._shutdown()
            finally:
                runtime._heartbeat_scope.cancel()
                runtime._token_scope.cancel()
                runtime._closed = True
                outer.cancel_scope.cancel()


async def _task_nursery(
    stopping: Callable[[], None], *, task_status: trio.TaskStatus[trio.Nursery]
) -> None:
    """A nursery for the runtime's tasks, open until cancelled - by the runtime closing, a
    task's error or `testing.crash` - which calls `stopping` at once, while its tasks
    (the shielded heartbeat, a drain's cleanup) may still run (`_open_runtime`)."""
    async with trio.open_nursery() as nursery:
        task_status.started(nursery)
        try:
            await trio.sleep_forever()
        finally:
            stopping()
