"""Fault injection: sqlite3.OperationalError at a chosen statement of every write operation.

The store's connection is wrapped (`Store(path, inline=True, wrap_connection=...)`) by a
proxy that raises "disk I/O error" or "database is locked" at the k-th statement of a
chosen transaction; each test sweeps k over every statement of the operation, BEGIN and
COMMIT included, on a fresh database. Whatever fails, the proxy checks that the rolled back
transaction left the database exactly as it was before it began (no partial write), and
the test checks that the runtime keeps running: the affected call raises `StoreError` or the
affected drain fails, retries or is recovered, and other sessions continue.

"database is locked" at BEGIN IMMEDIATE is waited out by the store, so there the operation
succeeds: the lock never reaches the caller.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
from helpers import records
from trio.testing import MockClock

import trio_sessions
from trio_sessions import (
    DrainContext,
    Outcome,
    RecoveryReport,
    Runtime,
    StoreError,
    ToolPart,
    _observe,
    _sqlite,
    _store,
    testing,
)
from trio_sessions._codec import decode_assistant

Clock = Callable[[], float]
Drain = Callable[[DrainContext], Awaitable[None]]

LEASE = 3.0
MESSAGES = ("disk I/O error", "database is locked")
TABLES = ("session", "session_input", "session_execution", "session_recovery", "session_message")
MAX_STATEMENTS = 40


def snapshot(reader: sqlite3.Connection) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every table, as committed."""
    return {
        table: sorted(reader.execute(f"SELECT * FROM {table}").fetchall(), key=repr)
        for table in TABLES
    }


@attrs.define
class Plan:
    statement: int  # 1 = the BEGIN itself
    message: str
    transaction: int = 1  # which transaction after arming (1 = the next one)
    match: str | None = None  # instead: fail every statement containing this text


class Faults:
    """The fault seam: raises at a chosen statement and proves the rollback was complete."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.plan: Plan | None = None
        self.message = ""
        self.begins = 0
        self.index = 0
        self.in_target = False
        self.fired: list[str] = []
        self.completed_unfired = False
        self.before: dict[str, list[tuple[Any, ...]]] | None = None
        self.fired_in_transaction = False
        self.rollbacks_checked = 0
        self._reader: sqlite3.Connection | None = None

    @property
    def reader(self) -> sqlite3.Connection:
        if self._reader is None:
            self._reader = sqlite3.connect(self.path)
        return self._reader

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()

    def wrap(self, conn: sqlite3.Connection) -> FaultyConnection:
        return FaultyConnection(conn, self)

    def arm(self, statement: int, message: str, *, transaction: int = 1) -> None:
        """Fail the `statement`-th statement of the `transaction`-th transaction from now."""
        self.plan = Plan(statement, message, transaction)
        self.message = message
        self.begins = 0
        self.fired = []
        self.completed_unfired = False

    def arm_matching(self, match: str, message: str) -> None:
        """Fail every statement containing `match` until disarmed."""
        self.plan = Plan(0, message, match=match)
        self.message = message
        self.fired = []

    def disarm(self) -> None:
        self.plan = None

    @property
    def fired_at_begin_locked(self) -> bool:
        return bool(self.fired) and self.fired[0].startswith("BEGIN") and "locked" in self.message

    def before_statement(self, sql: str) -> None:
        plan = self.plan
        if plan is None or sql.startswith("ROLLBACK"):
            return
        if sql.startswith("BEGIN"):
            self.begins += 1
            self.index = 0
            self.fired_in_transaction = False
            self.in_target = plan.match is not None or self.begins == plan.transaction
            if self.in_target:
                self.before = snapshot(self.reader)
        if not self.in_target:
            return
        self.index += 1
        hit = plan.match in sql if plan.match is not None else self.index == plan.statement
        if hit:
            self.fired.append(sql)
            self.fired_in_transaction = True
            if plan.match is None:
                self.plan = None
            raise sqlite3.OperationalError(plan.message)
        if sql == "COMMIT" and plan.match is None:
            self.completed_unfired = True
            self.plan = None

    def after_statement(self, sql: str) -> None:
        if sql == "ROLLBACK" and self.fired_in_transaction:
            # The atomicity check: a failed transaction leaves every row as it was.
            assert snapshot(self.reader) == self.before
            self.rollbacks_checked += 1
            self.fired_in_transaction = False
            self.in_target = self.plan is not None and self.plan.match is not None


class FaultyConnection:
    """A connection proxy: the store only uses `execute`, `executemany` (one statement of
    the seam, however many rows) and `in_transaction`."""

    def __init__(self, conn: sqlite3.Connection, faults: Faults) -> None:
        self._conn = conn
        self._faults = faults

    def execute(self, sql: str, params: Any = ()) -> sqlite3.Cursor:
        self._faults.before_statement(sql)
        cursor = self._conn.execute(sql, params)
        self._faults.after_statement(sql)
        return cursor

    def executemany(self, sql: str, rows: Any) -> sqlite3.Cursor:
        self._faults.before_statement(sql)
        cursor = self._conn.executemany(sql, rows)
        self._faults.after_statement(sql)
        return cursor

    @property
    def in_transaction(self) -> bool:
        return self._conn.in_transaction


@attrs.define
class Worker:
    """A drain that takes its inputs, answers with one settled tool call and can be held."""

    calls: list[tuple[str, bool]] = attrs.Factory(list)
    gate: trio.Event | None = None
    entered: trio.Event = attrs.Factory(trio.Event)
    before_return: Callable[[DrainContext], None] | None = None

    async def __call__(self, ctx: DrainContext) -> None:
        self.calls.append((ctx.session_id, ctx.resumed))
        inputs = await ctx.take_inputs()
        writer = await ctx.begin_assistant()
        await writer.start_tool("c1", "echo", {"inputs": [i.id for i in inputs]})
        self.entered.set()
        if self.gate is not None:
            await self.gate.wait()
        await writer.settle_tool("c1", len(inputs))
        await writer.finish()
        if self.before_return is not None:
            self.before_return(ctx)


@asynccontextmanager
async def open_faulty(
    path: Path, drain: Drain | None, clock: Clock, faults: Faults, **options: Any
) -> AsyncIterator[Runtime]:
    store = trio_sessions.Store(path, inline=True, wrap_connection=faults.wrap)
    options.setdefault("lease", LEASE)
    options.setdefault("recovery_interval", 1_000.0)
    async with trio_sessions.open_runtime(store, drain, clock=clock, **options) as runtime:
        yield runtime


def started_run(nursery: trio.Nursery, runtime: Runtime, session_id: str) -> list[Outcome]:
    """`runtime.run(session_id)` started in `nursery`: its outcome lands in the list
    returned once it ends."""
    outcomes: list[Outcome] = []

    async def run() -> None:
        outcomes.append(await runtime.run(session_id))

    nursery.start_soon(run)
    return outcomes


def rows(path: Path, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    conn = sqlite3.connect(path)
    try:
        return conn.execute(sql, params).fetchall()
    finally:
        conn.close()


def taken_inputs(path: Path, session_id: str) -> list[str]:
    return [
        r[0]
        for r in rows(
            path,
            "SELECT input_id FROM session_message WHERE session_id = ? AND role = 'user'"
            " ORDER BY seq",
            (session_id,),
        )
    ]


def assert_consistent(path: Path) -> None:
    """Durable invariants that hold whatever failed: an input is pending xor a user message,
    every assistant row decodes, and every pending input has a doorbell or a claim."""
    both = rows(
        path,
        "SELECT i.id FROM session_input i JOIN session_message m ON m.input_id = i.id",
    )
    assert both == []
    for message_id, data in rows(
        path, "SELECT id, data FROM session_message WHERE role = 'assistant'"
    ):
        decode_assistant(data, key=message_id)


def assert_no_stranded_input(path: Path) -> None:
    stranded = rows(
        path,
        "SELECT DISTINCT i.session_id FROM session_input i JOIN session s ON s.id = i.session_id"
        " WHERE s.time_woken IS NULL AND NOT EXISTS"
        " (SELECT 1 FROM session_execution e WHERE e.session_id = i.session_id)",
    )
    assert stranded == []


async def sweep(
    tmp_path: Path, message: str, scenario: Callable[[Path, Faults, int], Awaitable[None]]
) -> int:
    """Run `scenario` for k = 1, 2, ... on fresh databases until the fault no longer fires."""
    for k in range(1, MAX_STATEMENTS):
        path = tmp_path / f"k{k}.db"
        faults = Faults(path)
        faults.message = message
        try:
            with trio.fail_after(600):  # virtual seconds: a hang fails fast under autojump
                await scenario(path, faults, k)
        finally:
            faults.close()
        if faults.completed_unfired:
            assert k > 2, "the operation ran fewer statements than BEGIN + one + COMMIT"
            return k
        assert faults.fired, f"k={k}: the armed transaction never ran"
        if not faults.fired[0].startswith("BEGIN"):
            assert faults.rollbacks_checked == 1, f"k={k}: no rollback was seen and checked"
    raise AssertionError("the operation never completed without the fault")


def expect(faults: Faults, error: BaseException | None) -> bool:
    """Did the call fail? Only where it must: a lock at BEGIN is waited out."""
    if not faults.fired or faults.fired_at_begin_locked:
        assert error is None, error
        return False
    assert isinstance(error, StoreError), error
    assert faults.message in str(error)
    return True


async def recover_past_fault(
    runtime: Runtime, faults: Faults, path: Path, dead_owner: str
) -> RecoveryReport:
    """A recovery pass with a fault armed; if the fault failed it, the dead owner's claim is
    untouched and uncounted, and the next pass is the one returned."""
    error = None
    try:
        report = await runtime.recover_once()
    except StoreError as exc:
        error = exc
    if expect(faults, error):
        assert rows(path, "SELECT owner_id, phase FROM session_execution") == [
            (dead_owner, "running")
        ]
        assert rows(path, "SELECT wake_attempts FROM session") == [(0,)]
        report = await runtime.recover_once()
    return report


async def run_other(runtime: Runtime, path: Path) -> None:
    """Other sessions are unaffected: a fresh one runs to completion."""
    session_id = f"other-{trio.current_time()}"
    await runtime.submit(session_id, {"other": True})
    await runtime.wait_idle(session_id)
    assert len(taken_inputs(path, session_id)) == 1


# ---------------------------------------------------------------------------------------------
# The caller's own writes: submit and wake


@pytest.mark.parametrize("message", MESSAGES)
async def test_submit_fault_writes_nothing_and_retry_succeeds(
    tmp_path: Path, clock: Clock, autojump_clock: MockClock, message: str
) -> None:
    """A failed submit stores no input and no doorbell; a retry with the same id lands once."""

    async def scenario(path: Path, faults: Faults, k: int) -> None:
        worker = Worker()
        async with open_faulty(path, worker, clock, faults) as runtime:
            faults.arm(k, message)
            error = None
            try:
                await runtime.submit("s", {"n": 1}, input_id="i1")
            except StoreError as exc:
                error = exc
            if expect(faults, error):
                assert rows(path, "SELECT * FROM session_input") == []
                assert rows(path, "SELECT * FROM session WHERE id = 's'") == []
            await run_other(runtime, path)
            assert await runtime.submit("s", {"n": 1}, input_id="i1") == "i1"
            await runtime.wait_idle("s")
            assert taken_inputs(path, "s") == ["i1"]
            assert_consistent(path)

    assert await sweep(tmp_path, message, scenario) >= 4


@pytest.mark.parametrize("message", MESSAGES)
async def test_wake_fault_leaves_the_doorbell_unset(
    tmp_path: Path, clock: Clock, autojump_clock: MockClock, message: str
) -> None:
    """A failed wake sets no doorbell and counts no wake; the next wake runs the session."""

    async def scenario(path: Path, faults: Faults, k: int) -> None:
        worker = Worker()
        async with open_faulty(path, worker, clock, faults) as runtime:
            await runtime.submit("s", {"n": 1})
            await runtime.wait_idle("s")
            faults.arm(k, message)
            error = None
            try:
                await runtime.wake("s")
            except StoreError as exc:
                error = exc
            if expect(faults, error):
                assert rows(path, "SELECT time_woken, wakes FROM session WHERE id = 's'") == [
                    (None, 0)
                ]
                assert not runtime.is_active("s")
            await runtime.wait_idle("s")
            await run_other(runtime, path)
            outcome = await runtime.run("s")
            assert outcome.kind == "succeeded"

    assert await sweep(tmp_path, message, scenario) >= 3


# ---------------------------------------------------------------------------------------------
# The runtime's own transactions: acquire, heartbeat, finish, interrupt cleanup, recovery


@pytest.mark.parametrize("message", MESSAGES)
async def test_acquire_fault_leaves_the_wake_durable_for_recovery(
    tmp_path: Path, clock: Clock, autojump_clock: MockClock, message: str
) -> None:
    """A failed claim commit inserts no claim and keeps the doorbell; the next recovery
    pass acquires it. (The wake comes from a process that runs no drains, so the acquire is
    a transaction of its own, started by the first recovery pass.)"""
    acquire_statements: set[str] = set()

    async def scenario(path: Path, faults: Faults, k: int) -> None:
        conn = _sqlite.connect(path)
        try:
            _sqlite.run_op(conn, clock, _store.submit, "s", '{"n":1}', "i1")
        finally:
            conn.close()
        worker = Worker()
        faults.arm(k, message, transaction=2)  # 1 = the first scan, 2 = its acquire
        async with open_faulty(path, worker, clock, faults, recovery_interval=1.0) as runtime:
            await runtime.wait_idle("s")
            acquire_statements.update(faults.fired)
            if faults.fired and not faults.fired_at_begin_locked:
                assert worker.calls == []
                assert rows(path, "SELECT * FROM session_execution") == []
                assert rows(path, "SELECT id FROM session_input") == [("i1",)]
                assert rows(path, "SELECT time_woken IS NOT NULL FROM session") == [(1,)]
                await trio.sleep(1.5)  # one recovery pass takes the unclaimed doorbell
                await runtime.wait_idle("s")
            assert worker.calls == [("s", False)]
            assert taken_inputs(path, "s") == ["i1"]
            assert rows(path, "SELECT * FROM session_execution") == []
            await run_other(runtime, path)

    assert await sweep(tmp_path, message, scenario) >= 6
    assert any(sql.startswith("INSERT INTO session_execution") for sql in acquire_statements)


@pytest.mark.parametrize("message", MESSAGES)
async def test_heartbeat_fault_is_retried_and_claims_survive(
    tmp_path: Path, clock: Clock, autojump_clock: MockClock, message: str
) -> None:
    """A failed heartbeat changes no lease; the next tick renews both claims; drains finish."""

    async def scenario(path: Path, faults: Faults, k: int) -> None:
        gate = trio.Event()
        worker = Worker(gate=gate)
        async with open_faulty(path, worker, clock, faults) as runtime:
            await runtime.submit("s1", {"n": 1})
            await runtime.submit("s2", {"n": 2})
            await trio.sleep(0.01)
            assert runtime.active_sessions() == {"s1", "s2"}
            before = rows(path, "SELECT id, expires_at FROM session_execution ORDER BY id")
            faults.arm(k, message)  # the next transaction is the heartbeat at lease/3
            await trio.sleep(LEASE / 3)
            assert faults.fired or faults.completed_unfired
            if faults.fired and not faults.fired_at_begin_locked:
                assert runtime.statistics().heartbeat_transactions == 1
                assert rows(path, "SELECT id, expires_at FROM session_execution ORDER BY id") == (
                    before
                )
            await trio.sleep(LEASE / 3)  # the next tick renews
            after = rows(path, "SELECT id, expires_at FROM session_execution ORDER BY id")
            assert [e for e, _ in after] == [e for e, _ in before]
            assert all(a > b for (_, a), (_, b) in zip(after, before, strict=True))
            gate.set()
            await runtime.wait_idle("s1")
            await runtime.wait_idle("s2")
            assert rows(path, "SELECT * FROM session_execution") == []
            assert sorted(s for s, _ in worker.calls) == ["s1", "s2"]

    assert await sweep(tmp_path, message, scenario) >= 4


@pytest.mark.parametrize("message", MESSAGES)
async def test_heartbeats_failing_for_a_lease_lose_it_without_writing(
    tmp_path: Path, clock: Clock, autojump_clock: MockClock, message: str
) -> None:
    """Heartbeats failing for a whole lease: the watchdog cancels the drain, nothing more is
    written for it, and recovery resumes the claim once the store is back."""
    path = tmp_path / "db"
    faults = Faults(path)
    gate = trio.Event()
    worker = Worker(gate=gate)
    async with open_faulty(path, worker, clock, faults) as runtime:
        async with trio.open_nursery() as nursery:
            outcomes = started_run(nursery, runtime, "s")
            await worker.entered.wait()
            faults.arm_matching("heartbeat_at = :now", message)
            transcript = rows(path, "SELECT id, data FROM session_message ORDER BY seq")
            claim = rows(path, "SELECT * FROM session_execution")
            await trio.sleep(LEASE + 0.01)
            assert outcomes and outcomes[0].kind == "interrupted"
            assert outcomes[0].reason == "lease_lost"
            assert len(faults.fired) >= 2
            faults.disarm()
            gate.set()  # the cancelled drain is gone; nothing it could still write lands
            await trio.sleep(LEASE)
            assert rows(path, "SELECT id, data FROM session_message ORDER BY seq") == transcript
            assert rows(path, "SELECT * FROM session_execution") == claim
        report = await runtime.recover_once()  # the store is back: the claim is resumed
        assert report.resumed == 1
        await runtime.wait_idle("s")
    assert worker.calls == [("s", False), ("s", True)]
    assert rows(path, "SELECT * FROM session_execution") == []
    assert faults.rollbacks_checked >= 2
    faults.close()


class StuckStore:
    """While `hang` is set, the store is unreachable: a statement on the event loop finds the
    write lock taken, and the heartbeat's UPDATE blocks in the store's worker thread."""

    def __init__(self) -> None:
        self.hang = threading.Event()
        self.stuck = threading.Event()
        self.release = threading.Event()

    def wrap(self, conn: sqlite3.Connection) -> StuckConnection:
        return StuckConnection(conn, self)


class StuckConnection:
    def __init__(self, conn: sqlite3.Connection, store: StuckStore) -> None:
        self._conn = conn
        self._store = store

    def execute(self, sql: str, params: Any = ()) -> sqlite3.Cursor:
        if self._store.hang.is_set():
            if threading.current_thread() is threading.main_thread():
                if sql.startswith("BEGIN"):
                    raise sqlite3.OperationalError("database is locked")
            elif "heartbeat_at = :now" in sql:
                self._store.stuck.set()
                self._store.release.wait(60)
        return self._conn.execute(sql, params)

    def executemany(self, sql: str, rows: Any) -> sqlite3.Cursor:
        return self._conn.executemany(sql, rows)

    @property
    def in_transaction(self) -> bool:
        return self._conn.in_transaction


async def test_watchdog_cancels_a_drain_while_its_heartbeat_hangs(
    tmp_path: Path, mock_clock: MockClock
) -> None:
    """A heartbeat stuck in the store for longer than the lease: the local watchdog still
    treats the lease as lost and cancels the drain (DESIGN §4: 'even while the store is
    unreachable')."""
    stuck = StuckStore()
    # The threaded executor, so a stuck statement blocks its worker thread, not trio; the
    # virtual clock moves only when this test jumps it, until the heartbeat is stuck.
    store = trio_sessions.Store(tmp_path / "db", wrap_connection=stuck.wrap)
    gate = trio.Event()
    worker = Worker(gate=gate)
    async with (
        trio_sessions.open_runtime(
            store, worker, clock=testing.trio_clock(), lease=LEASE, recovery_interval=1_000.0
        ) as runtime,
        trio.open_nursery() as nursery,
    ):
        outcomes = started_run(nursery, runtime, "s")
        await worker.entered.wait()
        stuck.hang.set()
        try:
            mock_clock.jump(LEASE / 3)  # the first heartbeat is due
            reached = await trio.to_thread.run_sync(stuck.stuck.wait, 10.0)
            assert reached, "the heartbeat never reached the store"
            # From here virtual time runs on whenever trio is idle, the heartbeat's
            # thread stuck or not.
            mock_clock.autojump_threshold = 0.01
            await trio.sleep(LEASE * 2)
            lost_in_time = [(o.kind, o.reason) for o in outcomes]
        finally:
            stuck.hang.clear()
            stuck.release.set()
        gate.set()
    assert lost_in_time == [("interrupted", "lease_lost")]


TAKE = "take_inputs"
WRITES = ("begin_assistant", "append_text", "start_tool", "settle_tool", "finish")


@pytest.mark.parametrize("message", MESSAGES)
@pytest.mark.parametrize("operation", [TAKE, *WRITES])
async def test_drain_write_fault_is_atomic_and_the_drain_can_retry(
    tmp_path: Path, clock: Clock, autojump_clock: MockClock, message: str, operation: str
) -> None:
    """A failed take_inputs or assistant write changes nothing; retrying it lands it once."""

    async def scenario(path: Path, faults: Faults, k: int) -> None:
        errors: list[BaseException | None] = []

        async def attempt(step: str, call: Callable[[], Awaitable[Any]]) -> Any:
            if step == operation:
                faults.arm(k, message)
                try:
                    result = await call()
                except StoreError as exc:
                    errors.append(exc)
                else:
                    errors.append(None)
                    return result
            return await call()

        async def drain(ctx: DrainContext) -> None:
            if ctx.session_id != "s":  # run_other's session: no faults there
                await ctx.take_inputs()
                return
            inputs = await attempt(TAKE, ctx.take_inputs)
            assert [i.id for i in inputs] == ["i1"]
            writer = await attempt("begin_assistant", ctx.begin_assistant)
            await attempt("append_text", lambda: writer.append_text("thinking"))
            await attempt("start_tool", lambda: writer.start_tool("c1", "echo", {"x": 1}))
            await attempt("settle_tool", lambda: writer.settle_tool("c1", "ok"))
            await attempt("finish", writer.finish)

        async with open_faulty(path, drain, clock, faults) as runtime:
            await runtime.submit("s", {"n": 1}, input_id="i1")
            outcome = await runtime.run("s")
            assert outcome.kind == "succeeded", outcome
            expect(faults, errors[0])
            await run_other(runtime, path)
            messages = await runtime.transcript("s")
        assert [(m.role, m.input_id) for m in messages] == [("user", "i1"), ("assistant", None)]
        data = messages[1].data
        assert data.finished and data.error is None
        assert data.parts[0] == trio_sessions.TextPart("thinking")
        assert data.parts[1] == ToolPart("c1", "echo", {"x": 1}, "completed", "ok", None)
        assert len(data.parts) == 2
        assert_consistent(path)

    assert await sweep(tmp_path, message, scenario) >= 4


@pytest.mark.parametrize("message", MESSAGES)
async def test_take_inputs_fault_that_fails_the_drain_keeps_the_input(
    tmp_path: Path, clock: Clock, autojump_clock: MockClock, message: str
) -> None:
    """A drain failing on a store error leaves its input pending, whole, for the next wake."""

    async def scenario(path: Path, faults: Faults, k: int) -> None:
        worker = Worker()

        async def drain(ctx: DrainContext) -> None:
            if not worker.calls:
                faults.arm(k, message)  # the next transaction is take_inputs
            await worker(ctx)

        async with open_faulty(path, drain, clock, faults) as runtime:
            await runtime.submit("s", {"n": 1}, input_id="i1")
            await runtime.wait_idle("s")
            if faults.fired and not faults.fired_at_begin_locked:
                assert rows(path, "SELECT id FROM session_input") == [("i1",)]
                assert rows(path, "SELECT * FROM session_execution") == []
                # A failed drain does not re-arm the doorbell for its untaken input (by
                # design: no loop on a drain that always fails); the next wake delivers it.
                assert rows(path, "SELECT time_woken FROM session") == [(None,)]
                assert (await runtime.run("s")).kind == "succeeded"
            assert taken_inputs(path, "s") == ["i1"]
            await run_other(runtime, path)
            assert_consistent(path)

    assert await sweep(tmp_path, message, scenario) >= 4


@pytest.mark.parametrize("message", MESSAGES)
async def test_finish_fault_fails_the_drain_and_releases_the_claim(
    tmp_path: Path, clock: Clock, autojump_clock: MockClock, message: str
) -> None:
    """A failed finish transaction: the drain's outcome is failed, the claim is still released
    by the failure path, and the transcript keeps the finished answer."""

    async def scenario(path: Path, faults: Faults, k: int) -> None:
        worker = Worker()
        # Only the first drain's finish gets the fault (run() below may start another).
        worker.before_return = lambda ctx: None if len(worker.calls) > 1 else faults.arm(k, message)
        async with open_faulty(path, worker, clock, faults) as runtime:
            await runtime.submit("s", {"n": 1}, input_id="i1")
            outcome = await runtime.run("s")
            if faults.fired and not faults.fired_at_begin_locked:
                assert outcome.kind == "failed"
                assert isinstance(outcome.error, StoreError)
            else:
                assert outcome.kind == "succeeded"
            await runtime.wait_idle("s")
            assert rows(path, "SELECT * FROM session_execution") == []
            messages = await runtime.transcript("s")
            assert [m.input_id for m in messages if m.role == "user"] == ["i1"]
            answer = messages[-1].data
            assert answer.finished and answer.error is None
            await run_other(runtime, path)
            assert_no_stranded_input(path)

    assert await sweep(tmp_path, message, scenario) >= 4


async def interrupt_scenario(
    path: Path, faults: Faults, k: int, clock: Clock, message: str, transaction: int
) -> tuple[Worker, Outcome]:
    """Interrupt a held drain with the fault armed in its cleanup; wait out lease + recovery."""
    gate = trio.Event()
    worker = Worker(gate=gate)
    async with open_faulty(path, worker, clock, faults, recovery_interval=0.5) as runtime:
        async with trio.open_nursery() as nursery:
            # One wake, by run() itself: a wake racing the claim would rightly leave a
            # doorbell for exactly one successor, which is not what this checks.
            outcomes = started_run(nursery, runtime, "s")
            await worker.entered.wait()
            faults.arm(k, message, transaction=transaction)
            assert await runtime.interrupt("s")
        gate.set()  # only the interrupted drain was held; a resumed one would run through
        await runtime.wait_idle("s")
        await trio.sleep(LEASE + 1.0)  # past the lease and a recovery pass
        await runtime.wait_idle("s")
        await run_other(runtime, path)
    return worker, outcomes[0]


@pytest.mark.parametrize("message", MESSAGES)
async def test_interrupt_finish_fault_leaves_a_cancelling_claim_recovery_finishes(
    tmp_path: Path, clock: Clock, autojump_clock: MockClock, message: str
) -> None:
    """finish_interrupted fails: the claim stays 'cancelling'; recovery finishes it as
    interrupted after the lease, and the interrupted work is never resumed."""

    async def scenario(path: Path, faults: Faults, k: int) -> None:
        worker, outcome = await interrupt_scenario(path, faults, k, clock, message, 2)
        assert outcome == Outcome("interrupted", "user")
        assert [c for c in worker.calls if c[0] == "s"] == [("s", False)]
        assert rows(path, "SELECT * FROM session_execution") == []
        assert rows(path, "SELECT * FROM session_recovery") == []
        data = decode_assistant(
            rows(path, "SELECT data FROM session_message WHERE role = 'assistant'")[0][0],
            key="m",
        )
        assert data.finished and data.error == "interrupted"
        assert data.parts[0].status == "error"  # type: ignore[union-attr]

    assert await sweep(tmp_path, message, scenario) >= 4


@pytest.mark.parametrize("message", MESSAGES)
async def test_interrupt_mark_cancelling_fault_never_resumes_the_work(
    tmp_path: Path, clock: Clock, autojump_clock: MockClock, message: str
) -> None:
    """mark_cancelling fails during an accepted user interrupt: the work is still never
    resumed (the contract: interrupted work is cleaned or retained as cancelling)."""
    path = tmp_path / "db"
    faults = Faults(path)
    with trio.fail_after(600):
        # Statement 2 of the cleanup's first transaction: BEGIN, then mark_cancelling's UPDATE
        # (it names its session: no SELECT reads the session back first).
        worker, outcome = await interrupt_scenario(path, faults, 2, clock, message, 1)
    faults.close()
    assert faults.fired[0].startswith("UPDATE session_execution SET phase = 'cancelling'")
    assert outcome == Outcome("interrupted", "user")
    assert [c for c in worker.calls if c[0] == "s"] == [("s", False)]  # never resumed


@pytest.mark.parametrize("message", MESSAGES)
@pytest.mark.parametrize("transaction", [1, 2, 3], ids=["candidates", "leases", "apply"])
async def test_recovery_fault_is_atomic_and_the_next_pass_recovers(
    tmp_path: Path, clock: Clock, autojump_clock: MockClock, message: str, transaction: int
) -> None:
    """A failed recovery transaction (scan, recovery leases or takeover) changes nothing
    partially; recover_once raises StoreError and the next pass resumes the dead claim."""

    async def scenario(path: Path, faults: Faults, k: int) -> None:
        dead = Worker(gate=trio.Event())
        async with trio_sessions.open_runtime(
            testing.inline_store(path), dead, clock=clock, lease=LEASE
        ) as doomed:
            await doomed.submit("s", {"n": 1}, input_id="i1")
            await dead.entered.wait()
            testing.crash(doomed)
        dead_owner = doomed.owner_id
        worker = Worker()
        async with open_faulty(path, worker, clock, faults) as runtime:
            await trio.sleep(LEASE + 0.01)
            faults.arm(k, message, transaction=transaction)
            report = await recover_past_fault(runtime, faults, path, dead_owner)
            assert report.resumed == 1
            await runtime.wait_idle("s")
            await run_other(runtime, path)
        assert [c for c in worker.calls if c[0] == "s"] == [("s", True)]
        assert rows(path, "SELECT * FROM session_execution") == []
        assert rows(path, "SELECT * FROM session_recovery") == []
        answers = [
            decode_assistant(d, key="m")
            for (d,) in rows(path, "SELECT data FROM session_message WHERE role='assistant'")
        ]
        assert answers[0].error == "interrupted: owner lost"
        assert answers[1].finished and answers[1].error is None

    assert await sweep(tmp_path, message, scenario) >= 3


@pytest.mark.parametrize("message", MESSAGES)
async def test_plain_takeover_fault_is_atomic_and_the_next_pass_recovers(
    tmp_path: Path, clock: Clock, autojump_clock: MockClock, message: str
) -> None:
    """A claim whose drain wrote no assistant message is taken over set-wise (one prepared
    statement per claim): a fault at any statement of that transaction changes nothing, and
    the next pass resumes the claim, counted once."""

    async def scenario(path: Path, faults: Faults, k: int) -> None:
        entered = trio.Event()

        async def hold(ctx: DrainContext) -> None:
            entered.set()  # crashes before taking its input or writing any message
            await trio.sleep_forever()

        async with trio_sessions.open_runtime(
            testing.inline_store(path), hold, clock=clock, lease=LEASE
        ) as doomed:
            await doomed.submit("s", {"n": 1}, input_id="i1")
            await entered.wait()
            testing.crash(doomed)
        dead_owner = doomed.owner_id
        worker = Worker()
        async with open_faulty(path, worker, clock, faults) as runtime:
            await trio.sleep(LEASE + 0.01)
            faults.arm(k, message, transaction=2)  # the scan and its leases come first
            report = await recover_past_fault(runtime, faults, path, dead_owner)
            if k == 2:  # the transaction's first statement: the set-wise takeover
                assert faults.fired[0].startswith("UPDATE session_execution SET id = :new")
            assert report.resumed == 1
            await runtime.wait_idle("s")
            await run_other(runtime, path)
        assert [c for c in worker.calls if c[0] == "s"] == [("s", True)]
        assert taken_inputs(path, "s") == ["i1"]
        assert rows(path, "SELECT * FROM session_execution") == []
        assert rows(path, "SELECT * FROM session_recovery") == []
        assert_consistent(path)

    assert await sweep(tmp_path, message, scenario) >= 3


@pytest.mark.parametrize("message", MESSAGES)
async def test_recovery_loop_survives_failing_passes(
    tmp_path: Path, clock: Clock, autojump_clock: MockClock, message: str
) -> None:
    """Recovery passes failing for a while never stop the runtime; once the store is back
    the next pass resumes the dead claim, and other sessions ran all along."""
    path = tmp_path / "db"
    faults = Faults(path)
    dead = Worker(gate=trio.Event())
    async with trio_sessions.open_runtime(
        testing.inline_store(path), dead, clock=clock, lease=LEASE
    ) as doomed:
        await doomed.submit("s", {"n": 1})
        await dead.entered.wait()
        testing.crash(doomed)
    worker = Worker()
    async with open_faulty(path, worker, clock, faults, recovery_interval=0.5) as runtime:
        faults.arm_matching("FROM session_execution e", message)
        await trio.sleep(LEASE * 2)
        assert len(faults.fired) >= 5
        assert worker.calls == []
        await run_other(runtime, path)
        faults.disarm()
        await trio.sleep(0.6)
        await runtime.wait_idle("s")
    assert ("s", True) in worker.calls
    assert rows(path, "SELECT * FROM session_execution") == []
    faults.close()


@pytest.mark.parametrize("message", ["disk I/O error"])
async def test_first_recovery_pass_fault_fails_the_open(
    tmp_path: Path, clock: Clock, autojump_clock: MockClock, message: str
) -> None:
    """A store error in the first recovery pass fails open_runtime with one StoreError."""
    path = tmp_path / "db"
    faults = Faults(path)
    faults.arm(2, message)
    with pytest.raises(StoreError, match="disk I/O error"):
        async with open_faulty(path, Worker(), clock, faults):
            pytest.fail("the runtime opened")  # pragma: no cover
    faults.close()


async def hold_and_close(path: Path, clock: Clock, faults: Faults, arm: Callable[[], None]) -> Any:
    """Open, claim one session with a held drain, arm the fault, close; returns the claim."""
    first = Worker(gate=trio.Event())
    async with open_faulty(path, first, clock, faults) as runtime:
        await runtime.submit("s", {"n": 1}, input_id="i1")
        await first.entered.wait()
        claim = rows(path, "SELECT id, phase, expires_at FROM session_execution")
        arm()
    return claim


async def resumed_by_next_owner(path: Path, clock: Clock) -> None:
    second = Worker()
    async with trio_sessions.open_runtime(
        testing.inline_store(path), second, clock=clock, lease=LEASE, recovery_interval=0.5
    ) as runtime:
        await trio.sleep(LEASE + 0.6)
        await runtime.wait_idle("s")
    assert second.calls == [("s", True)]
    assert rows(path, "SELECT * FROM session_execution") == []


@pytest.mark.parametrize("message", MESSAGES)
async def test_shutdown_expire_fault_leaves_a_claim_that_recovery_resumes(
    tmp_path: Path, clock: Clock, autojump_clock: MockClock, message: str
) -> None:
    """Shutdown cannot end its lease early (every expire fails): the claim stays exactly as
    it was, closing raises nothing, and the next owner resumes it once the lease runs out."""
    path = tmp_path / "db"
    faults = Faults(path)
    claim = await hold_and_close(
        path, clock, faults, lambda: faults.arm_matching("SET expires_at = :now", message)
    )
    assert faults.fired
    assert rows(path, "SELECT id, phase, expires_at FROM session_execution") == claim
    await resumed_by_next_owner(path, clock)
    faults.close()


@pytest.mark.parametrize("message", MESSAGES)
async def test_shutdown_transaction_fault_is_atomic(
    tmp_path: Path, clock: Clock, autojump_clock: MockClock, message: str
) -> None:
    """A fault anywhere in the first shutdown transaction: the claim is kept, its lease
    either ended now (a later attempt landed) or untouched; the next owner resumes it."""

    async def scenario(path: Path, faults: Faults, k: int) -> None:
        claim = await hold_and_close(path, clock, faults, lambda: faults.arm(k, message))
        ((execution_id, phase, expires_at),) = rows(
            path, "SELECT id, phase, expires_at FROM session_execution"
        )
        assert (execution_id, phase) == claim[0][:2]
        assert expires_at in (claim[0][2], int(clock() * 1000))
        await resumed_by_next_owner(path, clock)

    assert await sweep(tmp_path, message, scenario) >= 3


# ---------------------------------------------------------------------------------------------
# Interrupt cleanup racing the runtime's own shutdown (found while sweeping the finalizer)


async def test_interrupt_then_close_never_resumes_the_interrupted_work(
    tmp_path: Path, clock: Clock, autojump_clock: MockClock
) -> None:
    """A user interrupt accepted just before the runtime closes: its cleanup still makes the
    cancellation durable, so the next owner finishes the claim and never resumes it."""
    path = tmp_path / "db"
    calls: list[tuple[str, bool]] = []

    async def drain(ctx: DrainContext) -> None:
        calls.append((ctx.session_id, ctx.resumed))
        await ctx.take_inputs()
        if len(calls) > 1:
            return
        try:
            await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True):
                await trio.sleep(0.1)  # the drain's own cleanup, e.g. closing a connection

    with trio.fail_after(60):
        async with trio_sessions.open_runtime(
            testing.inline_store(path), drain, clock=clock, lease=LEASE
        ) as runtime:
            await runtime.submit("s", {"n": 1})
            await trio.sleep(0.01)
            assert await runtime.interrupt("s")
    # The runtime is closed; whatever its cleanup managed, the interrupt must stick.
    with trio.fail_after(60):
        async with trio_sessions.open_runtime(
            testing.inline_store(path), drain, clock=clock, lease=LEASE, recovery_interval=0.5
        ) as runtime:
            await trio.sleep(LEASE + 1.0)
            await runtime.wait_idle("s")
    assert calls == [("s", False)]
    assert rows(path, "SELECT * FROM session_execution") == []


# ---------------------------------------------------------------------------------------------
# Errors after which SQLite itself rolled the transaction back
#
# SQLITE_IOERR, SQLITE_FULL, SQLITE_BUSY and SQLITE_NOMEM "may cause an automatic rollback"
# of the whole transaction (sqlite.org/lang_transaction.html): the savepoints and the
# transaction are gone by the time the store reacts to the error.


class AutoRollback:
    """Raises `message` at the first statement containing `match`, after rolling the
    transaction back the way SQLite does on an I/O error or a full disk."""

    def __init__(
        self,
        match: str,
        message: str,
        *,
        skip: int = 0,
        in_group: bool = False,
        rollback: bool = True,
    ) -> None:
        self.rollback = rollback  # False: SQLite kept the transaction (the savepoint path)
        self.match = match
        self.message = message
        self.skip = skip  # let this many matching statements through first
        self.in_group = in_group  # only inside a group commit (jobs in savepoints)
        self.armed = False
        self.fired = 0

    def wrap(self, conn: sqlite3.Connection) -> AutoRollbackConnection:
        return AutoRollbackConnection(conn, self)


class AutoRollbackConnection:
    def __init__(self, conn: sqlite3.Connection, plan: AutoRollback) -> None:
        self._conn = conn
        self._plan = plan
        self._grouped = False

    def execute(self, sql: str, params: Any = ()) -> sqlite3.Cursor:
        plan = self._plan
        if sql in ("SAVEPOINT job", "SAVEPOINT kind"):
            self._grouped = True
        elif sql in ("COMMIT", "ROLLBACK"):
            self._grouped = False
        if plan.armed and plan.match in sql and (self._grouped or not plan.in_group):
            if plan.skip:
                plan.skip -= 1
                return self._conn.execute(sql, params)
            plan.armed = False
            plan.fired += 1
            if plan.rollback:
                self._conn.execute("ROLLBACK")
            raise sqlite3.OperationalError(plan.message)
        return self._conn.execute(sql, params)

    def executemany(self, sql: str, rows: Any) -> sqlite3.Cursor:
        return self._conn.executemany(sql, rows)

    @property
    def in_transaction(self) -> bool:
        return self._conn.in_transaction


@pytest.mark.parametrize("message", ["disk I/O error", "database or disk is full"])
async def test_automatic_rollback_still_reports_store_error(
    tmp_path: Path, clock: Clock, autojump_clock: MockClock, message: str
) -> None:
    """An error after which SQLite rolled back by itself: submit raises StoreError, nothing
    is written, and the runtime keeps working."""
    plan = AutoRollback("INSERT INTO session_input", message)
    store = trio_sessions.Store(tmp_path / "db", inline=True, wrap_connection=plan.wrap)
    async with trio_sessions.open_runtime(store, Worker(), clock=clock) as runtime:
        plan.armed = True
        with pytest.raises(StoreError, match=message):
            await runtime.submit("s", {"n": 1}, input_id="i1")
        assert plan.fired == 1
        assert rows(tmp_path / "db", "SELECT * FROM session_input") == []
        await run_other(runtime, tmp_path / "db")


@pytest.mark.parametrize("set_wise", [False, True], ids=["one-by-one", "set-wise"])
@pytest.mark.parametrize("rollback", [True, False], ids=["sqlite-rolled-back", "savepoint"])
async def test_group_commit_fault_fails_no_caller_silently(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rollback: bool, set_wise: bool
) -> None:
    """A threaded store groups concurrent submits into one transaction and one of them hits
    an error (after which SQLite may have rolled everything back): every submit either
    raises StoreError or is durable, and the runtime keeps working. Set-wise, the error
    hits the statement that inserts the group's inputs: if SQLite kept the transaction,
    each submit runs again alone and none fails."""
    monkeypatch.setattr(_sqlite.engine, "SET_WISE", set_wise)
    path = tmp_path / "db"
    # One by one, the third submit inside a group commit fails: two ran before it in its
    # batch; set-wise, the group's one input insert does.
    plan = AutoRollback(
        "INSERT INTO session_input",
        "disk I/O error",
        skip=0 if set_wise else 2,
        in_group=True,
        rollback=rollback,
    )
    results: dict[int, str | BaseException] = {}

    async def drain(ctx: DrainContext) -> None:
        await ctx.take_inputs()

    async with trio_sessions.open_runtime(
        trio_sessions.Store(path, wrap_connection=plan.wrap), drain
    ) as runtime:

        async def submit(i: int) -> None:
            try:
                results[i] = await runtime.submit(f"s{i}", {"n": i}, input_id=f"in{i}")
            except Exception as exc:
                results[i] = exc

        plan.armed = True
        async with trio.open_nursery() as nursery:
            for i in range(6):
                nursery.start_soon(submit, i)
        assert plan.fired == 1
        durable = {row[0] for row in rows(path, "SELECT id FROM session_input")} | {
            row[0] for row in rows(path, "SELECT input_id FROM session_message")
        }
        for i, result in results.items():
            if isinstance(result, BaseException):
                assert isinstance(result, StoreError), result
            else:
                assert result in durable, f"submit {i} returned but wrote nothing"
        failed = [r for r in results.values() if isinstance(r, BaseException)]
        if set_wise and not rollback:
            assert failed == []  # the set-wise statement rolled back; each ran again alone
        else:
            assert failed, "the failing submit reported nothing"
        if not rollback and not set_wise:
            assert len(failed) == 1  # a savepoint undoes only its own job
        await runtime.submit("after", {"n": 0})
        await runtime.wait_idle("after")


class FailingCheckpoints:
    """Fails the first `failures` WAL checkpoints with "disk I/O error"; counts the rest."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.failed = 0
        self.succeeded = 0

    def wrap(self, conn: sqlite3.Connection) -> FailingCheckpointConnection:
        return FailingCheckpointConnection(conn, self)


class FailingCheckpointConnection:
    def __init__(self, conn: sqlite3.Connection, plan: FailingCheckpoints) -> None:
        self._conn = conn
        self._plan = plan

    def execute(self, sql: str, params: Any = ()) -> sqlite3.Cursor:
        if "wal_checkpoint" in sql:
            if self._plan.failed < self._plan.failures:
                self._plan.failed += 1
                raise sqlite3.OperationalError("disk I/O error")
            self._plan.succeeded += 1
        return self._conn.execute(sql, params)

    def executemany(self, sql: str, rows: Any) -> sqlite3.Cursor:
        return self._conn.executemany(sql, rows)

    @property
    def in_transaction(self) -> bool:
        return self._conn.in_transaction


async def test_failed_checkpoint_is_logged_and_retried_while_the_runtime_serves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A WAL checkpoint failing with "disk I/O error" is logged ("checkpoint failed") and
    retried later; every submit around it stays durable and the runtime keeps serving."""
    monkeypatch.setattr(_sqlite.executors, "CHECKPOINT_EVERY", 2)
    plan = FailingCheckpoints(failures=2)
    path = tmp_path / "db"
    caplog.set_level("WARNING", logger="trio_sessions")
    submitted = 0
    with trio.fail_after(20):
        async with trio_sessions.open_runtime(
            trio_sessions.Store(path, wrap_connection=plan.wrap), None
        ) as producer:
            while plan.succeeded == 0:
                await producer.submit(f"s{submitted}", {"n": submitted})
                submitted += 1
                await trio.sleep(0.001)  # lets the executor's pump run a due checkpoint
            await producer.submit("after", {"n": -1})
    assert plan.failed == 2
    assert len(rows(path, "SELECT id FROM session_input")) == submitted + 1
    failures = [r for r in caplog.records if r.getMessage() == "checkpoint failed"]
    assert len(failures) == 2
    assert all("disk I/O error" in str(r.error) for r in failures)  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------------------------
# Conversation control (DESIGN §5.1): each call is one transaction, all or nothing


async def _seed_control(path: Path, clock: Clock) -> None:
    """Session "s": one answered turn, paused, with a pending and a scheduled input;
    session "idle": one answered turn; session "open": a claim whose drain is mid-answer
    (left by a runtime that vanished)."""
    hold = trio.Event()

    async def drain(ctx: DrainContext) -> None:
        await ctx.take_inputs()
        writer = await ctx.begin_assistant()
        await writer.append_text("hi")
        if ctx.session_id == "open":
            await hold.wait()
        await writer.finish()

    async with trio_sessions.open_runtime(testing.inline_store(path), drain, clock=clock) as rt:
        for session_id in ("s", "idle"):
            await rt.submit(session_id, {"n": 1})
            await rt.wait_idle(session_id)
        await rt.pause("s")
        await rt.submit("s", {"n": 2}, input_id="pending")
        await rt.submit("s", {"n": 3}, input_id="later", delay=60)
        await rt.submit("open", {"n": 1})
        await trio.testing.wait_all_tasks_blocked()
        testing.crash(rt)


CONTROL_CALLS: dict[str, Callable[[Runtime], Awaitable[object]]] = {
    "submit-interrupt": lambda rt: rt.submit("open", {"n": 2}, input_id="x", on_busy="interrupt"),
    "submit-reject": lambda rt: rt.submit("idle", {"n": 2}, input_id="x", on_busy="reject"),
    "submit-scheduled": lambda rt: rt.submit("idle", {"n": 2}, input_id="x", delay=5),
    "cancel_input": lambda rt: rt.cancel_input("pending"),
    "pause": lambda rt: rt.pause("idle"),
    "resume": lambda rt: rt.resume("s"),
    "delete_session": lambda rt: rt.delete_session("open"),
    "purge": lambda rt: rt.purge(idle_for=0),
    "fork": lambda rt: rt.fork("open", "copy"),
    "truncate": lambda rt: rt.truncate("s", after_seq=1),
}


@pytest.mark.parametrize("name", CONTROL_CALLS)
async def test_control_call_fault_writes_nothing_and_retry_succeeds(
    tmp_path: Path, clock: Clock, autojump_clock: MockClock, name: str
) -> None:
    """A fault at any statement of a conversation-control call rolls all of it back (the
    fault seam checks every row) and raises StoreError; the retry lands."""
    call = CONTROL_CALLS[name]
    message = MESSAGES[0]

    async def scenario(path: Path, faults: Faults, k: int) -> None:
        await _seed_control(path, clock)
        async with open_faulty(path, None, clock, faults, lease=1_000) as producer:
            faults.arm(k, message)
            error = None
            try:
                await call(producer)
            except StoreError as exc:
                error = exc
            if expect(faults, error):
                await call(producer)
            assert_consistent(path)

    assert await sweep(tmp_path, message, scenario) >= 4


async def test_an_ending_retried_past_a_heartbeat_interval_says_so_once(
    tmp_path: Path, clock: Clock, autojump_clock: MockClock, logs: pytest.LogCaptureFixture
) -> None:
    """A drain's ending (its claim's delete) fails again and again while the heartbeat keeps
    the lease: the finalizer retries for as long as the claim is ours, and `run()` waits.
    The operator learns of it once the retries have lasted a heartbeat interval - one
    WARNING naming the session, the execution and the error, however long they go on -
    and the ending lands once the store takes it."""
    path = tmp_path / "db.sqlite"
    faults = Faults(path)
    worker = Worker()
    async with open_faulty(path, worker, clock, faults, heartbeat_interval=1.0) as runtime:
        faults.arm_matching("DELETE FROM session_execution", "disk I/O error")
        async with trio.open_nursery() as nursery:
            outcomes = started_run(nursery, runtime, "s")
            await trio.sleep(0.9)
            assert faults.fired, "the ending was not tried"
            assert records(logs, _observe.ENDING_RETRIED) == []
            await trio.sleep(5.0)
            assert outcomes == [], "the ending gave up while the claim was ours"
            [record] = records(logs, _observe.ENDING_RETRIED)
            assert (record.session_id, record.execution_id) == ("s", worker_execution(path))
            assert "disk I/O error" in record.error
            faults.disarm()
        assert [outcome.kind for outcome in outcomes] == ["failed"]
        await runtime.wait_idle("s")
    assert rows(path, "SELECT * FROM session_execution") == []
    assert len(records(logs, _observe.ENDING_RETRIED)) == 1


def worker_execution(path: Path) -> str:
    [(execution_id,)] = rows(path, "SELECT id FROM session_execution")
    return str(execution_id)


async def test_an_interrupts_ending_retried_past_a_heartbeat_interval_says_so_once(
    tmp_path: Path, clock: Clock, autojump_clock: MockClock, logs: pytest.LogCaptureFixture
) -> None:
    """An interrupt's ending is two writes (the mark, then the finish), each retried for
    as long as the claim is ours. README's event table says `claim ending retried` is
    logged once per ending; here both writes fail for longer than a heartbeat interval,
    one after the other, and the one interrupt was reported twice. Found by review
    (revB55)."""
    path = tmp_path / "db.sqlite"
    faults = Faults(path)
    worker = Worker(gate=trio.Event())
    async with open_faulty(path, worker, clock, faults, heartbeat_interval=1.0) as runtime:
        async with trio.open_nursery() as nursery:
            outcomes = started_run(nursery, runtime, "s")
            await worker.entered.wait()
            execution_id = worker_execution(path)
            faults.arm_matching("SET phase = 'cancelling'", "disk I/O error")
            assert await runtime.interrupt("s") is True
            await trio.sleep(2.5)
            assert faults.fired, "the mark was not tried"
            assert len(records(logs, _observe.ENDING_RETRIED)) == 1
            # The mark lands at its next try; the finish after it fails as long again.
            faults.arm_matching("DELETE FROM session_execution", "disk I/O error")
            await trio.sleep(2.5)
            assert faults.fired, "the finish was not tried"
            assert outcomes == [], "the ending gave up while the claim was ours"
            faults.disarm()
        assert [(outcome.kind, outcome.reason) for outcome in outcomes] == [("interrupted", "user")]
        await runtime.wait_idle("s")
    assert rows(path, "SELECT * FROM session_execution") == []
    [record] = records(logs, _observe.ENDING_RETRIED)
    assert (record.session_id, record.execution_id) == ("s", execution_id)
