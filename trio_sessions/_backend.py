"""The seam between the runtime and a store backend: three small protocols and a job.

The runtime knows nothing of drivers or dialects. It calls `Executor.run(op, *args)`, and a
backend runs the synchronous operation `op(tx, *args)` (written once, in `_store/`) inside
one write transaction, off the event loop or inline, possibly grouped with other operations
(group commit). A `StoreBackend` is the user-facing store object (`SQLiteStore`,
`PostgresStore`) that opens an executor. An `Engine` (`open_engine`) runs the same operations
synchronously, one transaction per call, outside any runtime: the CLI, the tools, the tests.

Invariants every backend keeps:
* an operation that has begun is never abandoned: a caller cancelled while its operation is
  queued sees it withdrawn unrun; once taken, the caller waits for its outcome, so a write
  that committed is always reported, never mistaken for one that did not happen;
* an operation that raises has written nothing (its own writes are rolled back, others in
  the same transaction are not);
* `tx.now` is the *lease clock* in integer milliseconds, read after the operation's own
  locks (`lock_session`): the runtime's injected clock on SQLite, the server's clock on
  PostgreSQL unless a test passes one. Hosts' clocks never decide a fence there.
* `StoreError` reaches a caller only for a failure the backend could not retry within its
  bound, never for a race between owners.
"""

from __future__ import annotations

import functools
import os
import random
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, AbstractContextManager
from typing import Any, Literal, Protocol, TypeVar, TypeVarTuple, Unpack

import attrs
import trio

from ._errors import StoreError
from ._naming import POSTGRES_SCHEMES as POSTGRES_SCHEMES
from ._naming import store_kind

T = TypeVar("T")
Ts = TypeVarTuple("Ts")

BackendName = Literal["sqlite", "postgres"]
# Whether a watcher or stream of this runtime follows a session (`Executor.wait_for_change`).
Follows = Callable[[str], bool] | None
Params = Sequence[Any] | Mapping[str, Any]


class Cursor(Protocol):
    """What an operation reads back from a statement."""

    @property
    def rowcount(self) -> int: ...

    def fetchone(self) -> Any: ...

    def fetchall(self) -> list[Any]: ...

    def __iter__(self) -> Iterator[Any]: ...

    def close(self) -> None: ...


class Tx(Protocol):
    """One open write transaction, as an operation sees it.

    SQL uses `?` positional or `:name` named parameters; a backend translates them.
    """

    @property
    def now(self) -> int:
        """The lease clock (ms since the epoch), read once per operation after its locks."""
        ...

    @property
    def dialect(self) -> BackendName:
        """Which SQL the transaction speaks: a statement for one dialect only is chosen on
        this, beside the shared form in the same `_store` module."""
        ...

    @property
    def autocommit(self) -> bool:
        """Whether the operation runs as one function call in autocommit (PostgreSQL, an
        `autocommit_when_alone` operation run alone): a call that could leave work for a
        further statement asks the server to refuse it whole instead (`NEEDS_TRANSACTION`)."""
        ...

    @property
    def call_id(self) -> str:
        """The running operation's own id, the same in every attempt of it (`Job.call_id`).
        PostgreSQL stores it with an input a submit stores, so a call again after a lost
        reply tells its own lost call's input from an earlier call's of the same input id;
        SQLite's calls run in process, lose no reply and need none ("")."""
        ...

    def call(self, function: str, *args: Any, idempotent: bool = True) -> list[Any]:
        """PostgreSQL only: one call of a server-side function of the store's schema
        (`_store.pg_functions`), one round trip; its rows. The function gets `args`, then the
        test clock (NULL: the server's) and whether this is a retry after a lost reply.
        `idempotent=False`: a retry could not tell whether the lost call landed, so the
        call needs a transaction (never alone in autocommit)."""
        ...

    def execute(self, sql: str, params: Params = ()) -> Cursor: ...

    def one(self, sql: str, params: Params = ()) -> Any: ...

    def executemany(self, sql: str, rows: Sequence[Params]) -> Cursor:
        """SQLite only: one prepared statement run once per row of parameters (the cursor's
        rowcount is the rows changed in all); PostgreSQL batches in server-side functions."""
        ...

    def lock_session(self, session_id: str) -> None:
        """The per-session serialisation point, held to COMMIT: every operation that reads
        and then writes a session's rows takes it first. A no-op on SQLite, whose write
        transaction already holds the database's only write lock."""
        ...

    def lock_sessions(self, session_ids: Collection[str]) -> None:
        """`lock_session` for several sessions, in the one order every transaction takes
        several in (the lock key's, then the id), so two transactions never deadlock."""
        ...

    def lock_claims(self, execution_ids: Sequence[str]) -> None:
        """Lock these claim rows (sorted, so two owners never deadlock) before a fenced
        write compares their leases with `now`: a row lock waited for must not make `now`
        older than the row it guards. A no-op on SQLite."""
        ...

    def notify(self, session_id: str, *, watchers_only: bool = False) -> None:
        """Signal other runtimes on the store that this session changed, if the transaction
        commits. A no-op on SQLite, whose readers notice any commit (`PRAGMA data_version`);
        `pg_notify` in the same transaction on PostgreSQL. `watchers_only`: only the
        session's transcript changed, which concerns only runtimes that watch or stream
        it (`wait_for_change`'s `follows`), not the doorbell every runtime may answer."""
        ...

    def savepoint(self) -> AbstractContextManager[None]:
        """A nested scope whose writes roll back alone if it raises (the error propagates)."""
        ...

    def refused_value(self, exc: BaseException) -> str | None:
        """Why `exc` is the driver's refusal of a value a row holds - a malformed row, not a
        failing store - or None. SQLite: text that is not UTF-8 (it keeps whatever bytes
        another tool wrote). PostgreSQL: a data exception (SQLSTATE class 22), such as a
        version at the top of its range that a write cannot step past."""
        ...

    def free_tokens(self, owner_ids: Sequence[str] | None) -> set[str]:
        """The owners (of `owner_ids`; None: every owner on record) whose liveness token is
        free now (DESIGN §4 "Owner liveness"). An owner with no token on record (no lock file
        on SQLite, no `session_owner` row on PostgreSQL) is never free: its lease decides."""
        ...

    def forget_tokens(self, owner_ids: Sequence[str]) -> None:
        """Remove the record of these owners' tokens where still free (they are gone and
        hold no live claim)."""
        ...


@attrs.frozen
class Signal:
    """What a change signal named (PostgreSQL): the sessions that changed, and whether every
    change it names was to a transcript only (no doorbell, claim or input moved)."""

    sessions: frozenset[str]
    transcripts_only: bool


class NeedsTransaction(Exception):
    """Raised by a `Tx` in autocommit before it sends a statement that must share a
    transaction with others, or when the server refused a call whole (`NEEDS_TRANSACTION`):
    the backend runs the operation again in a transaction. Nothing was written by the
    operation when it is raised (an earlier attempt whose reply was lost may have written:
    `Job.reply_lost`)."""


# The SQLSTATE a server-side function raises, in autocommit, when part of its work needs
# statements of the client in the same transaction (`ts_recover`'s row-by-row claims): it
# wrote nothing, and the engine runs the operation again in a transaction.
NEEDS_TRANSACTION = "TSROW"


def autocommit_when_alone(op: Callable[..., T]) -> Callable[..., T]:
    """Mark an operation whose PostgreSQL form is one idempotent function call (or one
    read statement): alone, it runs in autocommit (one round trip; a lost reply is resolved
    by calling again, which reads back by natural key). Its other paths raise
    `NeedsTransaction` first."""
    op.__dict__["autocommit_when_alone"] = True
    return op


def never_replayed(op: Callable[..., T]) -> Callable[..., T]:
    """Mark an operation that decides from data its caller's other tasks may change while
    it waits for its reply (the writer's `Known` message, whose dicts its readers may
    edit): PostgreSQL never runs it as a call on the loop (`_postgres.onloop`), which runs
    an operation twice around its reply and needs both runs to decide alike."""
    op.__dict__["never_replayed"] = True
    return op


def reads_stored_bytes(op: Callable[..., T]) -> Callable[..., T]:
    """Mark a read that names a row malformed when one of its text columns comes as bytes.
    SQLite keeps whatever bytes another tool writes as TEXT, and its driver refuses the
    whole read of a row that is not UTF-8; such a read then runs again on the same snapshot
    with that text read as its bytes (`_sqlite.engine.run_read`). Any other read raises
    `StoreError`, as it did. A write marked so runs again too, its writes undone
    (`_sqlite.engine._run_job`): a claim's endings, which read its open messages."""
    op.__dict__["reads_stored_bytes"] = True
    return op


# `reads_stored_bytes_first`'s mark.
READS_STORED_BYTES_FIRST = "first"


def reads_stored_bytes_first(op: Callable[..., T]) -> Callable[..., T]:
    """`reads_stored_bytes` for a write whose every read of stored text comes before its
    first write (a drain's `end_iteration`, on the path every cycle takes): a read that
    meets bytes finds nothing to undo, so SQLite runs it with no savepoint of its own
    (`_sqlite.engine._run_job`, which checks that nothing was written)."""
    op.__dict__["reads_stored_bytes"] = READS_STORED_BYTES_FIRST
    return op


def runs_off_the_loop(op: Callable[..., T]) -> Callable[..., T]:
    """Mark a read whose work is system calls rather than SQL (SQLite's probe of the
    liveness token files beside the database): an executor that reads on the event loop's
    thread runs it in a worker thread. Each call gives up the GIL, and taking it back
    waits for whatever C call another thread is in (a settle's encode of one part, 10-30
    ms), so a probe of a few files held the loop for 60-100 ms of wall time for 2 ms of
    work. Its thread is its own, with no connection (`_sqlite.engine.run_without_sql`: a
    statement there fails): in the read thread it waited for every large read queued
    there, a second each (a transcript holding large tool results)."""
    op.__dict__["runs_off_the_loop"] = True
    return op


def skips_a_busy_session(op: Callable[..., T]) -> Callable[..., T]:
    """Mark an operation on one session that never waits for another transaction's lock on
    it (PostgreSQL: it answers at once instead - an acquire from a doorbell, which leaves
    the session to whoever is working on it): a batch does not take that session's lock
    up front for it (`lock_sessions_first`)."""
    op.__dict__["skips_a_busy_session"] = True
    return op


def caller_yields_next(op: Callable[..., T]) -> Callable[..., T]:
    """Mark an operation whose every caller, once it succeeded, gives the event loop up
    itself soon after, with nothing slow in between (`_busy`: a wake that took the claim
    starts its busy period first, so the caller's schedule point also starts the drain;
    the end of a drain iteration releases the claim and ends the task, or yields before the
    next drain call). The production SQLite executor, running it on the event loop, skips
    its own trailing schedule point after a success and says so (`left_schedule_point`,
    read by the caller at once): one scheduler round less each (DESIGN §7, the trio
    floor). The thread hand-off and the deterministic test executors keep theirs. Only a
    schedule point is skipped, never a cancellation point, and an operation that raised
    still yields. Elsewhere a loop of calls could starve the other tasks."""
    op.__dict__["caller_yields_next"] = True
    return op


# What a batched form's `interpret` answers for a row it cannot settle: nothing was written
# for it; the operation runs on its own in the same transaction.
FALLBACK: Any = object()


def pg_batched(
    function: str,
    interpret: Callable[[tuple[Any, ...], tuple[Any, ...]], Any],
    *,
    autocommit: bool = False,
    call_ids: bool = False,
) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """Mark an operation that PostgreSQL group-commits set-wise: the jobs of one batch that
    call it become ONE call of `function` (one array per argument, in the operation's
    order; rows `(ordinal, *row)` back), and `interpret(args, row)` gives each job's result
    (or raises its refusal, or returns `FALLBACK`: nothing written, the job runs on its
    own). `autocommit`: every row of `function` is idempotent by natural key - called
    again, it answers what the first call did, whatever `p_retry` says - so a batch of
    these jobs only is that one call in autocommit (one round trip). `call_ids`: `function`
    also takes each job's `Job.call_id`, as one more array after the operation's."""

    def mark(op: Callable[..., T]) -> Callable[..., T]:
        op.__dict__["pg_batched"] = (function, interpret)
        op.__dict__["pg_batched_autocommit"] = autocommit
        op.__dict__["pg_batched_call_ids"] = call_ids
        return op

    return mark


def pg_read_batched(
    function: str,
    pack: Callable[[tuple[Any, ...]], Any],
    interpret: Callable[[tuple[Any, ...], Sequence[tuple[Any, ...]]], Any],
) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """Mark a read that PostgreSQL answers set-wise: the reads of one hand-off that call it
    become ONE call of `function` (alone in autocommit: one statement, one snapshot), given
    the JSON array of `pack(args)` per read; its rows are `(ordinal, *row)`, and
    `interpret(args, rows)` gives each read's result from its own rows (or `FALLBACK`: the
    read runs on its own)."""

    def mark(op: Callable[..., T]) -> Callable[..., T]:
        op.__dict__["pg_read_batched"] = (function, pack, interpret)
        return op

    return mark


# The random bits of ids (`new_call_id`, `_store.common.new_id`): a generator of their own,
# seeded from the OS at import and again in every forked child (two processes never share a
# stream), and out of reach of tests that seed the global `random` (pytest-randomly,
# hypothesis). Not `os.urandom` per id: a system call gives up the GIL, and a PostgreSQL
# writer thread asking for one per job of its batch waited 52 us each for the trio thread
# to give it back (1,000 sessions in flight).
RANDOM_BITS = random.Random()
os.register_at_fork(after_in_child=RANDOM_BITS.seed)


def new_call_id() -> str:
    """A call's own id (`Job.call_id`): 64 random bits."""
    return RANDOM_BITS.getrandbits(64).to_bytes(8, "big").hex()


@attrs.define(eq=False)
class Job:
    """One operation waiting for a transaction; a backend fills `result` or `error`."""

    op: Callable[..., Any]
    args: tuple[Any, ...]
    result: Any = None
    error: BaseException | None = None
    # An attempt of it may have landed: its reply was lost. Every later attempt - again, in
    # a transaction after autocommit, alone after its batch - reads back whether it did
    # (`p_retry`), never runs as a first call.
    reply_lost: bool = attrs.field(default=False, init=False)
    # It met more data than the event loop may decode or encode at once (`_codec.OffTheLoop`,
    # SQLite's loop-thread store): nothing of it committed there, and every later attempt
    # runs in the worker thread - a batch holding it is never tried on the loop again.
    off_the_loop: bool = attrs.field(default=False, init=False)
    # Withdrawn unrun by the worker (PostgreSQL's `Withdrawals`): its caller was cancelled
    # and nothing of it committed; the caller's wait ends in its cancellation.
    withdrawn: bool = attrs.field(default=False, init=False)
    # An autocommit call of it was refused whole, or it needed a second statement, on the
    # trio thread (PostgreSQL's `_postgres.onloop`): nothing of it written there, and the
    # worker runs it in a transaction, not as a call that would be refused again.
    autocommit_refused: bool = attrs.field(default=False, init=False)
    _call_id: str | None = attrs.field(default=None, init=False, repr=False)

    @property
    def call_id(self) -> str:
        """This call's own id, the same in every attempt of it - again after a lost reply,
        in a transaction after autocommit, alone after its batch - and no other call's:
        what a retry's read-back tells its own lost call by (`Tx.call_id`). Made when
        first asked for: only submits ask."""
        if self._call_id is None:
            self._call_id = new_call_id()
        return self._call_id

    def unwrap(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.result


@functools.cache
def _keyed_by_session(op: Callable[..., Any]) -> bool:
    code = getattr(op, "__code__", None)
    return code is not None and code.co_argcount >= 2 and code.co_varnames[1] == "session_id"


def session_named(op: Callable[..., Any], args: tuple[Any, ...]) -> str | None:
    """The session an operation called with `args` names - by the store's convention, its
    first argument after the transaction, `session_id` - or None (a recovery pass, a
    heartbeat: no one session)."""
    if args and isinstance(args[0], str) and _keyed_by_session(op):
        return args[0]
    return None


@attrs.frozen
class StoreStatistics:
    """A backend's own figures, as `Runtime.statistics().store` reports them."""

    backend: BackendName
    transactions: int = 0
    handoffs: int = 0
    inline_runs: int = 0
    retries: int = 0
    reconnects: int = 0


def sqlite_batched(
    many: Callable[[Any, Sequence[tuple[Any, ...]]], list[Any]],
) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """Mark an operation that SQLite group-commits set-wise: the jobs of one batch that
    call it (two or more) run as ONE `many(tx, [job.args, ...])`, a few statements for
    all of them, which answers each job's result in order - or `FALLBACK` for a job it did
    not settle, having written nothing for it: that job then runs on its own in the same
    transaction (where a refusal is raised to its caller alone)."""

    def mark(op: Callable[..., T]) -> Callable[..., T]:
        op.__dict__["sqlite_batched"] = many
        return op

    return mark


class Token(Protocol):
    """This runtime's liveness token, held (`Executor.hold_token`)."""

    # How often other owners' tokens are worth a look, in seconds; None: only at recovery
    # passes (inline stores: deterministic tests look when they choose).
    poll_interval: float | None

    async def wait_lost(self) -> None:
        """Return when the token was lost while this process lives (PostgreSQL: its
        connection broke). Never returns on SQLite: only the process's death frees it."""
        ...

    def looks_lost(self) -> bool:
        """Whether the token's loss may be there to see already, looked at without waiting
        or reading: after a pause, the server's end of its connection may be on the
        socket before the task in `wait_lost` has run - which reads it, and decides.
        Never true on SQLite."""
        ...

    async def retake(self) -> None:
        """Take the token again, waiting (with backoff) until it is ours."""
        ...


class Executor(Protocol):
    """Runs store operations `op(tx, *args)`, each inside a write transaction."""

    backend: BackendName

    async def run(self, op: Callable[[Tx, Unpack[Ts]], T], *args: *Ts) -> T: ...

    async def run_nowait(self, op: Callable[[Tx, Unpack[Ts]], T], *args: *Ts) -> T:
        """Like `run`, but never wait for another process's lock beyond a commit's moment
        (about 50 ms): raise `StoreError` instead (best-effort writes with a deadline:
        shutdown)."""
        ...

    async def read(self, op: Callable[[Tx, Unpack[Ts]], T], *args: *Ts) -> T:
        """Run a read-only operation on one consistent snapshot, never taking the write
        lock (transcripts, watchers, the change scan)."""
        ...

    async def wait_for_change(
        self,
        kick: trio.Event,
        fallback: float,
        *,
        follows: Follows = None,
    ) -> Signal | None:
        """Return when another connection may have committed (SQLite: `data_version`;
        PostgreSQL: a notification), when `kick` is set, or after `fallback` seconds (the slow
        fallback poll: a lost signal costs latency, never work). What changed: what the
        signal named (PostgreSQL), or None when anything may have (SQLite, a kick, the poll).
        A backend that can tell this runtime's own commits apart (PostgreSQL: the notifying
        backend's pid; SQLite: `data_version` on the event loop's writer connection) skips
        them: the runtime handles its own writes where it makes them.

        `follows(session_id)`: whether a watcher or stream of this runtime follows that
        session; a backend that can tell a transcript-only change
        (`Tx.notify(watchers_only=True)`) skips those of the sessions nobody here follows
        (None: nothing is skipped)."""
        ...

    def hold_token(self, owner_id: str) -> AbstractAsyncContextManager[Token]:
        """Take this owner's liveness token and hold it for the block (DESIGN §4 "Owner
        liveness"): released when the block exits or the process dies."""
        ...

    def statistics(self) -> StoreStatistics: ...


class StoreBackend(Protocol):
    """A user-facing store object: where the data lives and how to reach it."""

    def open_executor(
        self, clock: Callable[[], float] | None
    ) -> AbstractAsyncContextManager[Executor]:
        """Connect, migrate the schema, and yield an executor for the block's duration.

        `clock=None` means the backend's own lease clock (wall clock on SQLite, the
        server's clock on PostgreSQL)."""
        ...


class Engine(Protocol):
    """A store opened synchronously, outside any runtime (CLI, soak, bench, tests): every
    call runs one operation in its own transaction on the calling thread, with the same
    fences, retries and errors an executor gives it."""

    @property
    def dialect(self) -> BackendName: ...

    def run(self, op: Callable[[Tx, Unpack[Ts]], T], *args: *Ts) -> T:
        """Run `op` in its own write transaction and commit; its error is raised with
        nothing written."""
        ...

    def read(self, op: Callable[[Tx, Unpack[Ts]], T], *args: *Ts) -> T:
        """Run a read-only `op` on one consistent snapshot, taking no write lock."""
        ...

    def schema_version(self) -> int:
        """The store's schema version (0: not a store of ours)."""
        ...

    def close(self) -> None: ...


def is_postgres_url(store: object) -> bool:
    """Whether `store` names a PostgreSQL store (`_naming.store_kind`: `ValueError` for a
    connection string of another form)."""
    return isinstance(store, str | os.PathLike) and store_kind(store) == "postgres"


def open_engine(
    store: str | os.PathLike[str],
    *,
    migrate: bool = True,
    schema: str | None = None,
    clock: Callable[[], float] | None = None,
) -> Engine:
    """Open `store` synchronously: a path is an SQLite file, a `postgresql://` URL a
    PostgreSQL schema (`schema`, default `public`).

    `migrate=True` creates the store if absent and brings its schema up to date, as
    `open_runtime` does; `migrate=False` never writes the schema: SQLite refuses a missing
    file or one that is not ours (`StoreError`), PostgreSQL connects as it is (read
    `schema_version()`: 0 for a schema without our tables). `clock` is the lease clock
    (SQLite: default the wall clock; PostgreSQL: default the server's).
    """
    if is_postgres_url(store):
        from . import _postgres  # psycopg is an optional extra

        return _postgres.open_engine(
            str(store), schema=schema or "public", migrate=migrate, clock=clock
        )
    if schema is not None:
        raise ValueError("schema= needs a postgresql:// URL as the store")
    from . import _sqlite

    return _sqlite.open_engine(store, migrate=migrate, clock=clock)


def driver_error(exc: BaseException) -> StoreError:
    """A driver's error as the `StoreError` callers see (the driver's one kept as cause)."""
    error = StoreError(f"{type(exc).__name__}: {exc}")
    error.__cause__ = exc
    return error


def executor_closed() -> StoreError:
    """What a call on a store executor that closed (with its runtime) raises, whichever
    executor and path noticed."""
    return StoreError("the store executor is closed")


def closed_before_run() -> StoreError:
    """What an operation gets whose store executor closed while it waited (queued, or
    handed off but not yet run): nothing of it ran."""
    return StoreError("the store executor closed before this ran")


# The lease clock's readings are epoch seconds up to this (about the year 5138): stored as
# 64-bit milliseconds with durations of up to 1e9 s added to them, no sum overflows.
MAX_CLOCK_SECONDS = 1e11


def now_ms(clock: Callable[[], float]) -> int:
    """The lease clock's reading in whole milliseconds; `TypeError`/`ValueError` naming the
    clock for a reading that is no time (`epoch_seconds`). Read once per transaction: the
    check is two type tests and a comparison."""
    now = clock()
    if (type(now) is float or type(now) is int) and 0 <= now <= MAX_CLOCK_SECONDS:
        return int(now * 1000)
    return int(epoch_seconds(now, "the runtime's clock reading") * 1000)


def epoch_seconds(value: object, what: str) -> float:
    """A time in epoch seconds, from 0 to `MAX_CLOCK_SECONDS`: `TypeError` for a non-number
    (a str, a bool), `ValueError` for NaN, infinity or a time out of range."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{what} must be a number of epoch seconds, got {type(value).__name__}")
    if not 0 <= value <= MAX_CLOCK_SECONDS:
        raise ValueError(f"{what} must be 0 to {MAX_CLOCK_SECONDS:g} epoch seconds, got {value!r}")
    return float(value)
