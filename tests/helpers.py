"""Shared helpers for the runtime tests: open a deterministic runtime, gates, raw rows."""

from __future__ import annotations

import copy
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import attrs
import backends
import pytest
import trio
import trio.testing

import trio_sessions
from trio_sessions import DrainContext, Outcome, Runtime, testing
from trio_sessions._backend import StoreBackend
from trio_sessions._codec import decode_assistant, encode_assistant
from trio_sessions._model import AssistantData, TextPart, ToolPart

if TYPE_CHECKING:
    import psycopg

    from trio_sessions._postgres import PgEngine

T = TypeVar("T")
Drain = Callable[[DrainContext], Awaitable[None]]
VIRTUAL_TIME_LIMIT = 3_600.0


@asynccontextmanager
async def runtime(
    store: StoreBackend, drain: Drain | None, clock: Callable[[], float], **options: Any
) -> AsyncIterator[Runtime]:
    """A runtime on the inline store and the virtual clock (lease 30 s unless given; a
    producer when `drain` is None).

    Bounded in virtual time, so a test whose runtime hangs fails fast instead of blocking.
    """
    with trio.fail_after(VIRTUAL_TIME_LIMIT):
        async with trio_sessions.open_runtime(store, drain, clock=clock, **options) as rt:
            yield rt


W = TypeVar("W")


class WrappedStore(Generic[W]):
    """A store whose executor a test wraps (`wrap(executor)`: one that holds, slows or fails
    chosen operations); `executor` is that wrapper once the runtime opened it."""

    def __init__(self, inner: Any, wrap: Callable[[Any], W]) -> None:
        self._inner = inner
        self._wrap = wrap
        self.executor: W | None = None

    @asynccontextmanager
    async def open_executor(self, clock: Any) -> AsyncIterator[Any]:
        async with self._inner.open_executor(clock) as executor:
            self.executor = self._wrap(executor)
            yield self.executor


class ExecutorSeam:
    """A store executor that is `inner` in all but what a subclass defines: a test's seam in
    the runtime's path to the store."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class LooksHeld(ExecutorSeam):
    """The runtime's executor, whose change waits answer only once `until` is set, when a
    test set one: the runtime's change look learns of another runtime's write - on
    PostgreSQL through a notification, which may arrive at any scheduling step - only
    after what the test lets run first. Wrap the executor from the runtime's opening
    (`WrappedStore`): a seam put in afterwards misses the wait already under way."""

    until: trio.Event | None = None

    async def wait_for_change(self, *args: Any, **kwargs: Any) -> Any:
        signal = await self._inner.wait_for_change(*args, **kwargs)
        if self.until is not None:
            await self.until.wait()
        return signal


class LateReply(ExecutorSeam):
    """The runtime's executor, whose reply to one operation reaches its caller only once
    the test says so (the operation itself commits at once): the window a thread hand-off
    leaves between a commit and the caller running again. `shield`: the caller waits for
    the reply even when cancelled, as a caller whose operation was taken does."""

    def __init__(self, inner: Any, op: Any, *, shield: bool = False) -> None:
        super().__init__(inner)
        self._op = op
        self._shield = shield
        self.committed = trio.Event()
        self.answer = trio.Event()

    async def run(self, op: Any, *args: Any) -> Any:
        result = await self._inner.run(op, *args)
        if op is self._op:
            self.committed.set()
            with trio.CancelScope(shield=self._shield):
                await self.answer.wait()
        return result


class JumpingClock:
    """The virtual clock plus a wall-clock offset the test can jump."""

    def __init__(self, base: Callable[[], float]) -> None:
        self.base = base
        self.offset = 0.0

    def __call__(self) -> float:
        return self.base() + self.offset


async def write_as_zombie(
    jumped: trio.Event, write: Callable[[], Awaitable[object]], errors: list[BaseException]
) -> None:
    """In a drain: once the test jumped the clock past the lease, attempt `write` (shielded,
    so it is reached despite lease_lost) and record the `LeaseLost` it raises in `errors`."""
    await jumped.wait()
    try:
        with trio.CancelScope(shield=True):
            await write()
    except trio_sessions.LeaseLost as exc:
        errors.append(exc)


async def run_and_jump(
    rt: Runtime, clock: JumpingClock, jumped: trio.Event, snapshot: Callable[[], T]
) -> T:
    """Run session 's' until its drain blocks, take `snapshot()`, jump `clock` a minute
    (past any test lease), set `jumped`, and return the snapshot once the run ended."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(rt.run, "s")
        await trio.testing.wait_all_tasks_blocked()
        before = snapshot()
        clock.offset += 60.0
        jumped.set()
    return before


@contextmanager
def opened(engine: PgEngine) -> Iterator[PgEngine]:
    """A PostgreSQL engine, open for the block."""
    engine.open()
    try:
        yield engine
    finally:
        engine.close()


def fixed(seconds: float) -> Callable[[], float]:
    """A lease clock stopped at `seconds` (ms = seconds * 1000)."""
    return lambda: seconds


@contextmanager
def pg_engine_at(url: str, schema: str, seconds: float) -> Iterator[PgEngine]:
    """A PostgreSQL engine on `schema` whose lease clock is stopped at `seconds`."""
    from trio_sessions._postgres import PostgresStore

    with opened(PostgresStore(url, schema=schema).engine(fixed(seconds))) as engine:
        yield engine


@contextmanager
def pg_raw(url: str, schema: str) -> Iterator[psycopg.Connection[Any]]:
    """A plain autocommit connection with `schema` first on its search path."""
    import psycopg

    with psycopg.connect(url, autocommit=True, options=f"-c search_path={schema}") as conn:
        yield conn


def terminate_backend(url: str, pid: int) -> None:
    """Kill backend `pid` from a connection of its own and wait until it is gone."""
    import psycopg  # lazily: SQLite-only runs never touch psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        terminate_on(conn, pid)


def terminate_on(control: psycopg.Connection[Any], pid: int) -> None:
    """Kill backend `pid` from the autocommit connection `control` and return once it is
    gone (a real server: this waits in real time, bounded)."""
    control.execute("SELECT pg_terminate_backend(%s)", (pid,))
    deadline = time.monotonic() + 10
    while control.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone():
        assert time.monotonic() < deadline, f"backend {pid} survived termination"
        time.sleep(0.001)


@attrs.define
class Recorder:
    """A drain that records each call and can be held on a gate."""

    calls: list[DrainContext] = attrs.Factory(list)
    gate: trio.Event | None = None
    entered: trio.Event = attrs.Factory(trio.Event)
    take_inputs: bool = True
    taken: list[str] = attrs.Factory(list)

    async def __call__(self, ctx: DrainContext) -> None:
        self.calls.append(ctx)
        if self.take_inputs:
            self.taken += [i.id for i in await ctx.take_inputs()]
        self.entered.set()
        if self.gate is not None:
            await self.gate.wait()

    def hold(self) -> trio.Event:
        self.gate = trio.Event()
        self.entered = trio.Event()
        return self.gate


@attrs.define
class HoldsBusy:
    """A drain that records the sessions it drains, in order, and holds session "busy"
    until `let_go`: with `max_active=1`, the one place stays taken until then."""

    started: list[str] = attrs.Factory(list)
    let_go: trio.Event = attrs.Factory(trio.Event)

    async def __call__(self, ctx: DrainContext) -> None:
        self.started.append(ctx.session_id)
        if ctx.session_id == "busy":
            await self.let_go.wait()


class Raw:
    """Direct SQL on the database (SQLite file or PostgreSQL schema), as an operator would."""

    def __init__(self, path: backends.Location) -> None:
        self.path = path

    def rows(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        return backends.rows(self.path, sql, params)

    def one(self, sql: str, params: tuple[Any, ...] = ()) -> Any:
        rows = self.rows(sql, params)
        return rows[0] if rows else None

    def write(self, sql: str, params: tuple[Any, ...] = ()) -> None:
        backends.write(self.path, sql, params)

    def write_many(self, sql: str, rows: Iterable[tuple[Any, ...]]) -> None:
        backends.write_many(self.path, sql, rows)

    def claim(self, session_id: str) -> Any:
        return self.one(
            "SELECT id, owner_id, phase, expires_at FROM session_execution WHERE session_id = ?",
            (session_id,),
        )

    def seed_user_message(
        self, session_id: str, message_id: str, seq: Any, data: str = '{"text": "hi"}'
    ) -> None:
        """A user message another tool wrote by hand (its session row too, if absent): any
        `seq` a column may keep - an int out of the store's range, or on SQLite text or a
        REAL."""
        self.write(
            "INSERT INTO session(id, time_created) VALUES (?, 0) ON CONFLICT(id) DO NOTHING",
            (session_id,),
        )
        self.write(
            "INSERT INTO session_message(id, session_id, role, seq, data, time_created,"
            " time_updated) VALUES (?, ?, 'user', ?, ?, 0, 0)",
            (message_id, session_id, seq, data),
        )

    def seed_input(self, session_id: str, input_id: str, seq: int, payload: str) -> None:
        """An input another tool wrote by hand, `payload` the column's raw text, as the only
        input of a new session (its `input_seq` at `seq`: a submit goes after it)."""
        self.write(
            "INSERT INTO session(id, time_created, input_seq) VALUES (?, 0, ?)", (session_id, seq)
        )
        self.write(
            "INSERT INTO session_input(id, session_id, seq, payload, time_created)"
            " VALUES (?, ?, ?, ?, 0)",
            (input_id, session_id, seq, payload),
        )

    def seed_claim(
        self,
        session_id: str,
        execution_id: str,
        *,
        expires_at: int,
        owner_id: str = "dead-owner",
        phase: str = "running",
        anchor_seq: int | None = None,
        wake_attempts: int = 0,
    ) -> None:
        """A claim left behind by another owner (typically a dead one)."""
        self.write(
            "INSERT INTO session(id, time_created, wake_attempts) VALUES (?, 0, ?)"
            " ON CONFLICT(id) DO UPDATE SET wake_attempts = excluded.wake_attempts",
            (session_id, wake_attempts),
        )
        self.write(
            "INSERT INTO session_execution(id, session_id, owner_id, phase, anchor_seq,"
            " time_created, expires_at) VALUES (?, ?, ?, ?, ?, 0, ?)",
            (execution_id, session_id, owner_id, phase, anchor_seq, expires_at),
        )

    def seed_assistant(
        self, session_id: str, execution_id: str, seq: int, data: str | AssistantData
    ) -> str:
        message_id = f"m-{execution_id}-{seq}"
        text = data if isinstance(data, str) else encode_assistant(data)
        self.write(
            "INSERT INTO session_message(id, session_id, execution_id, role, seq, data,"
            " time_created, time_updated) VALUES (?, ?, ?, 'assistant', ?, ?, 0, 0)",
            (message_id, session_id, execution_id, seq, text),
        )
        return message_id


class SlowToExit:
    """A drain that takes its inputs and waits to be cancelled, then takes until `may_exit`
    is set to exit (a blocking call that lands later): `entered` once it took them,
    `exiting` once its cancellation came; `on_exit` runs as it exits."""

    def __init__(self, on_exit: Callable[[], None] | None = None) -> None:
        self.entered, self.exiting, self.may_exit = trio.Event(), trio.Event(), trio.Event()
        self._on_exit = on_exit

    async def __call__(self, ctx: DrainContext) -> None:
        await ctx.take_inputs()
        self.entered.set()
        try:
            await trio.sleep_forever()
        finally:
            self.exiting.set()
            with trio.CancelScope(shield=True):
                await self.may_exit.wait()
            if self._on_exit is not None:
                self._on_exit()

    async def close_during(
        self,
        store: StoreBackend,
        clock: Callable[[], float],
        while_closing: Callable[[], Awaitable[None]],
        *,
        before_close: Callable[[], Awaitable[None]] | None = None,
        **options: Any,
    ) -> None:
        """Open a runtime draining with this drain and submit to session "s"; once the drain
        runs (and `before_close` returned), close the runtime as a worker's SIGTERM does -
        the close waits for this drain to exit - while `while_closing` runs beside it."""
        async with trio.open_nursery() as helpers:
            with trio.CancelScope() as closing:
                async with runtime(store, self, clock, **options) as owner:
                    await owner.submit("s", {"n": 1})
                    await self.entered.wait()
                    if before_close is not None:
                        await before_close()
                    helpers.start_soon(while_closing)
                    closing.cancel()
                    await trio.sleep_forever()


async def answer_ok(ctx: DrainContext) -> None:
    """A drain that takes its inputs and answers "ok" in one finished assistant message."""
    await ctx.take_inputs()
    reply = await ctx.begin_assistant()
    await reply.append_text("ok")
    await reply.finish()


def apply_event(view: dict[int, dict[str, Any]], event: dict[str, Any]) -> None:
    """A client applying one stream event (DESIGN §5.2) to its copy of the messages (a
    copy: the same events are applied again to other views)."""
    kind, seq, data = event["kind"], event["seq"], copy.deepcopy(event["data"])
    if kind == "truncate":
        for stale in [n for n in view if n > seq]:
            del view[stale]
    elif kind == "message":
        view[seq] = {"role": event["role"], "data": data}
    else:
        message = view[seq]["data"]
        parts = message["parts"]
        if kind == "append":
            if parts and parts[-1]["type"] == "text":
                parts[-1]["text"] += data
            else:
                parts.append({"type": "text", "text": data})
        elif kind == "part":
            same = [i for i, p in enumerate(parts) if p.get("call_id") == data["call_id"]]
            if same:
                parts[same[0]] = data
            else:
                parts.append(data)
        else:
            assert kind == "finish", event
            message["finished"], message["error"] = True, data["error"]


def start_run(nursery: trio.Nursery, rt: Runtime, session_id: str) -> list[Outcome]:
    """Start `rt.run(session_id)` in `nursery`; its outcome lands in the returned list."""
    outcomes: list[Outcome] = []

    async def run() -> None:
        outcomes.append(await rt.run(session_id))

    nursery.start_soon(run)
    return outcomes


def open_tool_message(call_id: str = "call-1") -> AssistantData:
    """An unfinished assistant message with one running tool call."""
    part = ToolPart(call_id, "search", {"q": "x"}, "running", None, None)
    return AssistantData(parts=(part,), finished=False, error=None)


def now_ms(clock: Callable[[], float]) -> int:
    return int(clock() * 1000)


# A store written before streaming (SQLite version 3, PostgreSQL version 1): a user
# message, another execution's malformed and finished replies, and the open reply of an
# expired claim. Nested "finished" keys must not be mistaken for the message's own.
PRE_STREAMING_OPEN = AssistantData(
    parts=(
        TextPart("partial"),
        ToolPart("c1", "search", {"finished": True}, "running", None, None),
    ),
    finished=False,
    error=None,
)
PRE_STREAMING_DONE = AssistantData(
    parts=(ToolPart("c0", "search", {}, "completed", {"finished": False}, None),),
    finished=True,
    error=None,
)


def build_pg_schema(conn: Any, version: int) -> None:
    """The tables of a PostgreSQL store at schema `version`, on `conn` (its search_path
    the schema): the version row and every migration's statements up to it - no functions
    (a test creates what that version held)."""
    from trio_sessions import _postgres

    conn.execute("CREATE TABLE schema_version(version INTEGER NOT NULL)")
    conn.execute("INSERT INTO schema_version VALUES (%s)", (version,))
    for step in range(1, version + 1):
        for statement in _postgres._MIGRATIONS[step].split(";"):
            if statement.strip():
                conn.execute(statement)


def seed_pre_streaming(raw: Raw) -> None:
    raw.write("INSERT INTO session(id, time_created) VALUES ('s', 0)")
    raw.write(
        "INSERT INTO session_execution(id, session_id, owner_id, phase, anchor_seq,"
        " time_created, expires_at) VALUES ('e', 's', 'dead', 'running', 3, 0, 1)"
    )
    for message_id, execution_id, input_id, role, seq, data in (
        ("u1", "e", "i1", "user", 1, '{"text": "q"}'),
        ("bad", "old", None, "assistant", 2, '{"parts": 1}'),
        ("done", "old", None, "assistant", 3, encode_assistant(PRE_STREAMING_DONE)),
        ("open", "e", None, "assistant", 4, encode_assistant(PRE_STREAMING_OPEN)),
    ):
        raw.write(
            "INSERT INTO session_message(id, session_id, execution_id, input_id, role, seq,"
            " data, time_created, time_updated) VALUES (?, 's', ?, ?, ?, ?, ?, 0, 0)",
            (message_id, execution_id, input_id, role, seq, data),
        )


async def check_pre_streaming_upgrade(raw: Raw, store: Any) -> None:
    """After the upgrade: user and finished messages are marked finished, the open and the
    malformed one are not; no stream rows. Then recovery resumes the expired claim and
    closes its open reply: nothing written before the upgrade stays running forever."""
    assert raw.rows("SELECT id, finished FROM session_message ORDER BY seq") == [
        ("u1", 1),
        ("bad", 0),
        ("done", 1),
        ("open", 0),
    ]
    assert raw.rows("SELECT COUNT(*) FROM session_message_stream") == [(0,)]
    assert raw.rows("SELECT COUNT(*) FROM session_message_delta") == [(0,)]
    resumed: list[bool] = []

    async def drain(ctx: DrainContext) -> None:
        resumed.append(ctx.resumed)

    with trio.fail_after(10):
        async with trio_sessions.open_runtime(store, drain) as rt:
            await rt.wait_idle("s")
    assert resumed == [True]
    data, finished = raw.one("SELECT data, finished FROM session_message WHERE id = 'open'")
    closed = decode_assistant(data, key="open")
    assert (closed.finished, closed.error, finished) == (True, "interrupted: owner lost", 1)
    assert closed.parts[0] == TextPart("partial")


__all__ = ["Raw", "Recorder", "open_tool_message", "runtime", "testing"]


def records(caplog: pytest.LogCaptureFixture, message: str) -> list[Any]:
    """The records of one event, by its stable message (typed Any: `extra` attributes)."""
    return [r for r in caplog.records if r.msg == message]


class LosableToken:
    """The runtime's liveness token, lost whenever the test says (`lose`): as a PostgreSQL
    token's connection broken by the server, on any backend, in virtual time."""

    def __init__(self, inner: Any) -> None:
        self.poll_interval = inner.poll_interval
        self._lost = trio.Event()
        self._notice = False
        self.retaken = trio.Event()
        self.looks = 0

    def lose(self) -> None:
        self._lost.set()

    def notice_arrives(self) -> None:
        """Something other than the server's farewell is on the token's socket (a notice):
        `looks_lost` says lost until the watch's next turn reads it."""
        self._notice = True

    def looks_lost(self) -> bool:
        self.looks += 1
        if self._notice:
            self._notice = False  # read by the watch at its next turn
            return True
        return self._lost.is_set()

    async def wait_lost(self) -> None:
        await self._lost.wait()

    async def retake(self) -> None:
        self._lost = trio.Event()
        self.retaken.set()
        await trio.lowlevel.checkpoint()


class LosableTokenExecutor(ExecutorSeam):
    """The store's executor, whose liveness token is a `LosableToken`."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.token: LosableToken | None = None

    @asynccontextmanager
    async def hold_token(self, owner_id: str) -> AsyncIterator[LosableToken]:
        async with self._inner.hold_token(owner_id) as inner:
            self.token = LosableToken(inner)
            yield self.token


class HeldLock:
    """A lock another connection (`conn`) holds in an open transaction, as another
    process's write does: a subclass's `take` begins it and calls `_took`; `release` rolls
    it back, once (`held`), and `taken` is set once it was first taken."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.held = False
        self.taken = trio.Event()

    def _took(self) -> None:
        self.held = True
        self.taken.set()

    def release(self) -> None:
        if self.held:
            self.held = False
            self.conn.execute("ROLLBACK")


@asynccontextmanager
async def released_at_the_latest(holder: HeldLock, hold_s: float) -> AsyncIterator[None]:
    """Lets `holder` go `hold_s` after it took its lock at the latest (a caller that waits
    for the lock then fails its test instead of hanging it), and at the block's end."""
    async with trio.open_nursery() as nursery:

        async def release_at_the_latest() -> None:
            await holder.taken.wait()
            await trio.sleep(hold_s)
            holder.release()

        nursery.start_soon(release_at_the_latest)
        try:
            yield
        finally:
            holder.release()
            nursery.cancel_scope.cancel()


class TakesAgainAtGo:
    """A drain whose first busy period takes its inputs, waits for `go`, then takes again
    (a write the test makes wait for a lock another connection holds); `exited` is set
    once that busy period's drain left, however. Later busy periods (its lost claim
    recovered) return at once: nothing to see."""

    def __init__(self) -> None:
        self.first_taken = trio.Event()
        self.go = trio.Event()
        self.exited = trio.Event()
        self.calls = 0

    async def __call__(self, ctx: DrainContext) -> None:
        self.calls += 1
        if self.calls > 1:
            return
        try:
            await ctx.take_inputs()
            self.first_taken.set()
            await self.go.wait()
            await ctx.take_inputs()
        finally:
            self.exited.set()
