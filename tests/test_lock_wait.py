"""Waiting for SQLite's write lock held by another process (`_sqlite.begin_immediate` on
the executor's worker connection): the lock is tried again every few milliseconds at most,
never after SQLite's own busy handler's sleeps (up to 100 ms between its tries), so a lock
freed is taken within one short pause; "database is locked" never escapes before the
patience is spent."""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from helpers import HeldLock, TakesAgainAtGo, released_at_the_latest

import trio_sessions
from trio_sessions import _codec, _sqlite, testing
from trio_sessions._backend import Job
from trio_sessions._handoff import BatchStart
from trio_sessions._sqlite import connections

pytestmark = pytest.mark.sqlite_only


async def test_the_executors_writer_connection_waits_for_the_lock_by_itself(
    tmp_path: Path,
) -> None:
    """The threaded executor's worker connection has SQLite's busy handler off: its
    batches wait for the lock in `begin_immediate`'s short pauses."""
    async with _sqlite.SQLiteStore(tmp_path / "s.db").open_executor(None) as executor:
        assert isinstance(executor, _sqlite.ThreadExecutor)
        assert executor.conn.execute("PRAGMA busy_timeout").fetchone()[0] == 0


def test_a_held_write_lock_is_tried_again_within_a_short_pause(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another connection holds the write lock through five tries: the pauses between
    them stay at most `LOCK_POLL_MAX_S`, and the sixth takes the lock."""
    path = tmp_path / "lock.db"
    conn = connections.poll_for_lock(_sqlite.connect(path))
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    pauses: list[float] = []

    def sleep(seconds: float) -> None:
        pauses.append(seconds)
        if len(pauses) == 5:
            holder.execute("ROLLBACK")  # the other process commits: the lock is free

    monkeypatch.setattr(time, "sleep", sleep)
    connections.begin_immediate(conn)
    try:
        assert conn.in_transaction
        assert len(pauses) == 5
        assert max(pauses) <= connections.LOCK_POLL_MAX_S
    finally:
        conn.execute("ROLLBACK")
    conn.close()
    holder.close()


def test_a_lock_never_freed_ends_in_the_error_after_the_patience(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past `LOCK_PATIENCE_S` the error is SQLite's own (the executors turn it into a
    `StoreError` for every job of the batch), nothing begun."""
    path = tmp_path / "lock.db"
    conn = connections.poll_for_lock(_sqlite.connect(path))
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    now = [0.0]

    def sleep(seconds: float) -> None:
        now[0] += seconds

    monkeypatch.setattr(time, "sleep", sleep)
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    monkeypatch.setattr(connections, "LOCK_PATIENCE_S", 1.0)
    with pytest.raises(sqlite3.OperationalError, match="locked"):
        connections.begin_immediate(conn)
    assert now[0] >= 1.0
    assert not conn.in_transaction
    holder.execute("ROLLBACK")
    conn.close()
    holder.close()


async def test_a_shutdown_hand_back_outlasts_another_process_s_short_commit(
    tmp_path: Path,
) -> None:
    """Under load another process holds the write lock for a moment at any instant. The
    shutdown's hand-back (`run_nowait`) must not give up at the first "locked" - PostgreSQL
    waits `NOWAIT_LOCK_TIMEOUT_MS` (50 ms) for it - or a graceful restart under load leaves
    its claims to lease expiry and counts their takeover against the resume budget (and an
    accepted interrupt's mark-cancelling, on the same path, is lost)."""
    path = tmp_path / "handback.db"
    entered = trio.Event()

    async def holding(ctx: trio_sessions.DrainContext) -> None:
        await ctx.take_inputs()
        entered.set()
        await trio.sleep_forever()

    holder = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    async with trio_sessions.open_runtime(path, holding) as runtime:
        await runtime.submit("s", {"n": 1})
        await entered.wait()
        holder.execute("BEGIN IMMEDIATE")  # another process's commit, 10 ms long
        commit = threading.Timer(0.01, holder.execute, ["ROLLBACK"])
        commit.start()
    commit.join()
    try:
        assert holder.execute("SELECT handed_back FROM session_execution").fetchall() == [(1,)]
    finally:
        holder.close()


# How long another process holds the write lock in the tests below at the most: far longer
# than a lease of LEASE, so a caller that waits for it is told apart from one that does not.
HOLD_S = 8.0
LEASE = 1.0


class _LockHolder(HeldLock):
    """Another process's connection holding SQLite's write lock (BEGIN IMMEDIATE)."""

    def __init__(self, path: Path) -> None:
        super().__init__(sqlite3.connect(path, isolation_level=None, check_same_thread=False))

    def take(self) -> None:
        self.conn.execute("BEGIN IMMEDIATE")
        self._took()

    def wake_then_take(self, session_id: str) -> None:
        """Another process's wake of a new session, then - right after its commit, no trio
        task running between - a transaction of its own holding the lock."""
        now = int(time.time() * 1000)
        self.conn.execute(
            "INSERT INTO session(id, time_created, time_woken, wakes) VALUES (?, ?, ?, 1)",
            (session_id, now, now),
        )
        self.take()


async def _release_once_closing(runtime: Any, holder: _LockHolder) -> None:
    """Let the lock go once `runtime` is closing and what its close started is waiting."""
    while not runtime._closing:
        await trio.testing.wait_all_tasks_blocked()
    await trio.testing.wait_all_tasks_blocked()
    holder.release()


@asynccontextmanager
async def _lock_holder(path: Path) -> AsyncIterator[_LockHolder]:
    """A `_LockHolder` that lets go by `HOLD_S` after it took the lock at the latest (a
    caller that waits for the lock then fails its test instead of hanging it), and at
    the block's end."""
    holder = _LockHolder(path)
    try:
        async with released_at_the_latest(holder, HOLD_S):
            yield holder
    finally:
        holder.conn.close()


async def test_a_drain_waiting_for_the_write_lock_stops_within_its_lease(tmp_path: Path) -> None:
    """A drain whose write waits for the write lock another process holds is stopped at
    its lease's local deadline and exits while the lock is still held, not when it is
    freed: its batch had not begun, so its caller is withdrawn (DESIGN §6.17: no drain
    outlives its lease, drains of one session never overlap). Found by a soak at load 12:
    a drain sat in `take_inputs` two seconds past its lease, its successors already in."""
    path = tmp_path / "lease.db"
    drain = TakesAgainAtGo()

    async with (
        _lock_holder(path) as holder,
        trio_sessions.open_runtime(path, drain, lease=LEASE) as runtime,
    ):
        await runtime.submit("s", {"n": 1})
        await drain.first_taken.wait()
        await runtime.submit("s", {"n": 2})  # a pending input: the take writes
        holder.take()
        drain.go.set()
        await drain.exited.wait()
        assert holder.held, "the drain ran on past its lease, until the lock was freed"
        holder.release()


async def test_a_caller_cancelled_while_its_batch_waits_for_the_lock_is_withdrawn(
    tmp_path: Path,
) -> None:
    """A submit cancelled while its batch waits in the worker thread for the write lock
    another process holds returns at once, and nothing of it is written once the lock is
    freed: nothing had begun, so it is withdrawn as a queued operation is."""
    path = tmp_path / "withdrawn.db"
    async with (
        _lock_holder(path) as holder,
        trio_sessions.open_runtime(path, None) as runtime,
    ):
        holder.take()
        with trio.move_on_after(0.2) as waited:
            await runtime.submit("s", {"n": 1})
        assert holder.held, "the cancelled submit waited until the lock was freed"
        assert waited.cancelled_caught
        holder.release()
        await runtime.submit("t", {"n": 2})  # after the withdrawn batch, in the same writer
        assert holder.conn.execute("SELECT session_id FROM session_input").fetchall() == [("t",)]


@asynccontextmanager
async def _a_batch_waiting_for_the_held_lock(
    path: Path, op: Any, *args: Any
) -> AsyncIterator[tuple[_LockHolder, _sqlite.ThreadExecutor, trio.Nursery]]:
    """A threaded executor whose first write landed; then another process holds the write
    lock, and `op(*args)` is handed to the worker, whose batch waits for that lock."""
    async with (
        _lock_holder(path) as holder,
        _sqlite.SQLiteStore(path).open_executor(None) as executor,
        trio.open_nursery() as nursery,
    ):
        assert isinstance(executor, _sqlite.ThreadExecutor)
        await executor.run(_mark, "first")
        holder.take()
        nursery.start_soon(executor.run, op, *args)
        await trio.testing.wait_all_tasks_blocked()
        yield holder, executor, nursery


def _mark(tx: Any, name: str) -> str:
    tx.execute("CREATE TABLE IF NOT EXISTS mark(name TEXT)")
    tx.execute("INSERT INTO mark VALUES (?)", (name,))
    return name


class _WithdrawnAtBegin:
    """A worker connection whose BEGIN IMMEDIATE succeeds just as `then` runs (a cancelled
    caller's withdrawal on the trio thread, racing the lock taken)."""

    def __init__(self, conn: sqlite3.Connection, then: Any) -> None:
        self._conn = conn
        self._then = then

    def execute(self, sql: str, params: Any = ()) -> sqlite3.Cursor:
        cursor = self._conn.execute(sql, params)
        if sql == "BEGIN IMMEDIATE":
            self._then()
        return cursor

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


def test_a_withdrawal_racing_the_lock_taken_ends_one_way(tmp_path: Path) -> None:
    """A caller withdrawing just as its batch's BEGIN IMMEDIATE took the lock is withdrawn
    (nothing of its job runs, the others commit); one withdrawing after the batch began is
    refused and its job runs and commits (its caller waits for it); a batch withdrawn whole
    begins nothing, leaving the lock to others."""
    conn = connections.poll_for_lock(_sqlite.connect(tmp_path / "race.db"))

    def marks() -> list[str]:
        return [row[0] for row in conn.execute("SELECT name FROM mark ORDER BY rowid")]

    withdrawn, kept = Job(_mark, ("withdrawn",)), Job(_mark, ("kept",))
    start = BatchStart(2)
    outcomes: list[bool] = []
    racing = _WithdrawnAtBegin(conn, lambda: outcomes.append(start.withdraw(withdrawn)))
    _sqlite.run_batch(racing, time.time, [withdrawn, kept], None, start)  # type: ignore[arg-type]
    assert outcomes == [True]
    assert (withdrawn.result, kept.result) == (None, "kept")
    assert marks() == ["kept"]
    assert not start.withdraw(kept)  # begun: too late, its outcome stands

    late = Job(_mark, ("late",))
    start = BatchStart(1)
    _sqlite.run_batch(conn, time.time, [late], None, start)
    assert not start.withdraw(late)
    assert late.result == "late"

    alone = Job(_mark, ("alone",))
    start = BatchStart(1)
    racing = _WithdrawnAtBegin(conn, lambda: outcomes.append(start.withdraw(alone)))
    _sqlite.run_batch(racing, time.time, [alone], None, start)  # type: ignore[arg-type]
    assert outcomes == [True, True]
    assert not conn.in_transaction  # the empty transaction rolled back, the lock let go
    assert alone.result is None and alone.error is None

    never = Job(_mark, ("never",))
    start = BatchStart(1)
    assert start.withdraw(never)
    assert not connections.begin_immediate(conn, start.abandoned)
    _sqlite.run_batch(conn, time.time, [never], None, start)
    assert not conn.in_transaction
    assert marks() == ["kept", "late"]
    conn.close()


async def test_a_hand_back_is_not_queued_behind_a_batch_waiting_for_the_lock(
    tmp_path: Path,
) -> None:
    """`run_nowait` (shutdown's hand-backs, an interrupt's mark) while the worker's batch
    waits for the write lock another process holds is tried on the loop for
    `NOWAIT_PATIENCE_S` and refused, as when nothing is in flight - not queued behind that
    batch, which waits as long as the lock is held (a close whose drain's take waited for
    the lock took the hand-back's whole 5 s bound; before the withdrawal, until the lock
    was freed). Found by review of the withdrawal of a batch that has not begun."""
    path = tmp_path / "nowait.db"
    async with _a_batch_waiting_for_the_held_lock(path, _mark, "waiting") as (holder, executor, _):
        assert executor._handoff.in_flight  # its batch waits in the worker for the lock
        with trio.move_on_after(HOLD_S / 2) as bound:
            with pytest.raises(trio_sessions.StoreError, match="locked"):
                await executor.run_nowait(_mark, "nowait")
        assert not bound.cancelled_caught, "the hand-back waited behind the worker's batch"
        assert holder.held
        holder.release()  # the waiting batch now commits
    check = sqlite3.connect(path)
    assert [row[0] for row in check.execute("SELECT name FROM mark ORDER BY rowid")] == [
        "first",
        "waiting",
    ]
    check.close()


def _in_the_worker(tx: Any, began: threading.Event, go: threading.Event) -> str:
    """Runs only in the worker thread (on the loop it goes off it), and holds its batch
    - begun: the write lock taken - until `go`."""
    if threading.current_thread() is threading.main_thread():
        raise _codec.OffTheLoop("the worker thread's")
    tx.execute("CREATE TABLE IF NOT EXISTS mark(name TEXT)")
    began.set()
    go.wait(HOLD_S)
    return "worker"


async def test_a_hand_back_waits_for_the_worker_s_batch_that_holds_the_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the worker's batch has begun (this process holds the write lock), `run_nowait`
    joins the next hand-off instead of trying the loop, which could only fail until that
    batch ends: it lands once the batch is done."""
    monkeypatch.setattr(_sqlite.executors, "NOWAIT_PATIENCE_S", 0.0)  # one try on the loop
    path = tmp_path / "begun.db"
    began, go = threading.Event(), threading.Event()
    results: list[str] = []

    async def run_nowait() -> None:
        results.append(await executor.run_nowait(_mark, "after"))

    async with (
        _sqlite.SQLiteStore(path).open_executor(None) as executor,
        trio.open_nursery() as nursery,
    ):
        assert isinstance(executor, _sqlite.ThreadExecutor)
        nursery.start_soon(executor.run, _in_the_worker, began, go)
        await trio.to_thread.run_sync(began.wait)
        nursery.start_soon(run_nowait)
        await trio.testing.wait_all_tasks_blocked()
        assert not results  # waiting for the batch, not refused
        go.set()
    assert results == ["after"]


async def test_a_stop_s_mark_withdrawn_at_its_bound_is_said_in_the_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A closing runtime's last try at a user's stop (`_mark_cancelling_nowait`, bounded by
    `HAND_BACK_TIMEOUT`) joins the next hand-off while the worker's batch holds the lock;
    when another process takes the lock before that hand-off begins, the bound withdraws
    the mark unrun. The claim stays 'running' and recovery resumes the work the user
    stopped: the log must say so (`stop not recorded`), as it does when the store refuses
    the mark - the withdrawal raised Cancelled past the log, which only caught StoreError.
    Found by review of the withdrawal meeting the busy period's shutdown writes."""
    path = tmp_path / "mark.db"
    entered = trio.Event()
    began, go = threading.Event(), threading.Event()

    async def holding(ctx: trio_sessions.DrainContext) -> None:
        await ctx.take_inputs()
        entered.set()
        await trio.sleep_forever()

    async with (
        _lock_holder(path) as holder,
        trio_sessions.open_runtime(path, holding) as runtime,
    ):
        await runtime.submit("s", {"n": 1})
        await entered.wait()
        entry = runtime._entries["s"]
        executor = runtime._db
        assert isinstance(executor, _sqlite.ThreadExecutor)
        real_try = _sqlite.engine.try_run_batch

        def taken_first(*args: Any) -> bool:
            # Another process takes the lock just as the next hand-off tries it.
            monkeypatch.setattr(_sqlite.executors, "try_run_batch", real_try)
            holder.take()
            return real_try(*args)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(executor.run, _in_the_worker, began, go)
            await trio.to_thread.run_sync(began.wait)
            monkeypatch.setattr(_sqlite.executors, "try_run_batch", taken_first)
            done = trio.Event()

            async def stop() -> None:
                with trio.move_on_after(0.2, shield=True) as bound:
                    await runtime._busy._mark_cancelling_nowait(entry)
                assert bound.cancelled_caught  # withdrawn at the bound, the lock still held
                done.set()

            nursery.start_soon(stop)
            await trio.testing.wait_all_tasks_blocked()
            go.set()
            await done.wait()
        assert holder.held
        holder.release()
        phase = holder.conn.execute("SELECT phase FROM session_execution").fetchall()
        assert phase == [("running",)]
        assert any(
            record.msg == trio_sessions._observe.STOP_NOT_RECORDED for record in caplog.records
        ), "the stop that did not land left no word in the log"


async def test_a_hand_back_tried_on_the_loop_joins_the_worker_s_batch_once_it_took_the_lock(
    tmp_path: Path,
) -> None:
    """`run_nowait` called while the worker's batch waits for another process's lock is
    tried on the loop (not queued behind that batch). When that lock is freed and the
    worker's batch takes it, this process holds the lock now: the tries on the loop can
    only fail until that batch ends, so the hand-back must join the next hand-off as when
    the batch had begun at the call - not give up after `NOWAIT_PATIENCE_S` behind our own
    batch (a close's hand-back then failed: the claims waited out their leases). Found by
    review of the withdrawal meeting shutdown's hand-backs."""
    path = tmp_path / "joined.db"
    began, go = threading.Event(), threading.Event()
    results: list[Any] = []
    done = trio.Event()

    async def run_nowait() -> None:
        try:
            results.append(await executor.run_nowait(_mark, "after"))
        except trio_sessions.StoreError as exc:
            results.append(exc)
        done.set()

    async with _a_batch_waiting_for_the_held_lock(path, _in_the_worker, began, go) as (
        holder,
        executor,
        nursery,
    ):
        assert executor._worker_batch is not None and not executor._worker_batch.begun
        nursery.start_soon(run_nowait)
        await trio.testing.wait_all_tasks_blocked()  # tried on the loop: locked, it pauses
        assert not results
        # Freed, and taken by the worker before the loop tries again (the loop is held
        # here until the worker's batch runs).
        holder.release()
        assert began.wait(HOLD_S)
        with trio.move_on_after(10 * connections.NOWAIT_PATIENCE_S):
            await done.wait()
        go.set()
        await done.wait()
    assert results == ["after"], results


class _SaysWhenTheWorkerWaits:
    """Wraps the executor's connections (`SQLiteStore.wrap_connection`): `waiting` is set
    once a worker thread's BEGIN IMMEDIATE found the write lock held (its batch waits)."""

    def __init__(self) -> None:
        self.waiting = trio.Event()
        self._token = trio.lowlevel.current_trio_token()

    def __call__(self, conn: sqlite3.Connection) -> Any:
        return _TellsOfALockedBegin(conn, self)

    def locked(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            self._token.run_sync_soon(self.waiting.set)


class _TellsOfALockedBegin:
    def __init__(self, conn: sqlite3.Connection, says: _SaysWhenTheWorkerWaits) -> None:
        self._conn = conn
        self._says = says

    def execute(self, sql: str, params: Any = ()) -> sqlite3.Cursor:
        try:
            return self._conn.execute(sql, params)
        except sqlite3.OperationalError:
            if sql == "BEGIN IMMEDIATE":
                self._says.locked()
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


async def test_a_close_does_not_wait_for_a_claim_acquisition_stuck_on_another_process_s_lock(
    tmp_path: Path,
) -> None:
    """Another process rings a doorbell and then holds the write lock (a long operator
    transaction, a backup): this runtime's acquisition of that session waits in the worker
    thread for the lock, shielded. Closing the runtime then (a rolling restart's SIGTERM)
    must not wait for the lock - nothing of the acquisition has begun, so the close
    withdraws it unrun - and the doorbell stays rung: the next runtime drains the session.
    Before, the close waited until the lock was freed (up to `LOCK_PATIENCE_S`, 120 s;
    measured 14.5 s with a lock held 15 s). Found by review of the close path (note 54)."""
    path = tmp_path / "acquire.db"
    drained: list[str] = []

    async def drain(ctx: trio_sessions.DrainContext) -> None:
        drained.append(ctx.session_id)

    says = _SaysWhenTheWorkerWaits()
    store = _sqlite.SQLiteStore(path, wrap_connection=says)
    async with _lock_holder(path) as holder:
        async with trio_sessions.open_runtime(store, drain) as runtime:
            holder.wake_then_take("s")
            await says.waiting.wait()  # the acquisition's batch waits for the lock
            assert runtime.is_active("s")
            assert not drained
        assert holder.held, "the close waited for the acquisition until the lock was freed"
        holder.release()
    check = sqlite3.connect(path)
    try:
        assert check.execute("SELECT time_woken IS NOT NULL FROM session").fetchall() == [(1,)]
        assert check.execute("SELECT count(*) FROM session_execution").fetchall() == [(0,)]
    finally:
        check.close()
    async with trio_sessions.open_runtime(path, drain) as runtime:
        await runtime.wait_idle("s")
    assert drained == ["s"]


class _HoldsTheBegunBatch(_SaysWhenTheWorkerWaits):
    """As `_SaysWhenTheWorkerWaits`, and a worker thread's batch whose BEGIN IMMEDIATE took
    the lock sets `began` at its next statement (the batch has begun: `BatchStart.begin`
    came between) and is held there until `go`."""

    def __init__(self) -> None:
        super().__init__()
        self.began = trio.Event()
        self.go = threading.Event()

    def __call__(self, conn: sqlite3.Connection) -> Any:
        return _HoldsABegin(conn, self)

    def begun(self) -> None:
        if threading.current_thread() is not threading.main_thread() and not self.go.is_set():
            self._token.run_sync_soon(self.began.set)
            self.go.wait(HOLD_S)


class _HoldsABegin(_TellsOfALockedBegin):
    began = False

    def execute(self, sql: str, params: Any = ()) -> sqlite3.Cursor:
        if self.began:
            self.began = False
            assert isinstance(self._says, _HoldsTheBegunBatch)
            self._says.begun()
        cursor = super().execute(sql, params)
        self.began = sql == "BEGIN IMMEDIATE"
        return cursor


async def test_a_close_waits_for_a_claim_acquisition_that_took_the_lock_and_hands_it_back(
    tmp_path: Path,
) -> None:
    """The other side of the close's withdrawal: an acquisition whose BEGIN IMMEDIATE took
    the lock runs to its end - the claim commits and is registered together, as the
    shielded handoff promises - and the close hands that claim back unrun (no drain starts
    once the runtime closes), so the next runtime resumes it at once, not after a lease."""
    path = tmp_path / "begun.db"
    drained: list[bool] = []

    async def drain(ctx: trio_sessions.DrainContext) -> None:
        drained.append(ctx.resumed)

    says = _HoldsTheBegunBatch()
    store = _sqlite.SQLiteStore(path, wrap_connection=says)
    async with _lock_holder(path) as holder, trio.open_nursery() as nursery:
        async with trio_sessions.open_runtime(store, drain) as runtime:
            holder.wake_then_take("s")
            await says.waiting.wait()
            holder.release()  # the acquisition's batch takes the lock, and is held begun
            await says.began.wait()

            async def go_once_closing() -> None:
                while not runtime._closing:
                    await trio.testing.wait_all_tasks_blocked()
                await trio.testing.wait_all_tasks_blocked()  # the close waits for it
                says.go.set()

            nursery.start_soon(go_once_closing)
        assert says.go.is_set()
    assert not drained
    check = sqlite3.connect(path)
    try:
        rows = check.execute("SELECT handed_back, phase FROM session_execution").fetchall()
        assert rows == [(1, "running")]
    finally:
        check.close()
    async with trio_sessions.open_runtime(path, drain) as runtime:
        await runtime.wait_idle("s")
    assert drained == [True]


async def test_a_close_right_after_a_ring_does_not_begin_its_acquisition(tmp_path: Path) -> None:
    """A ring that registered a session's acquisition just before the runtime closed (the
    change loop's, in the same scheduler round): its busy period's first step comes after
    the close began, and must not begin a shielded acquisition then - one that waits for
    another process's lock held the close as long as that lock. Its doorbell stays rung for
    the next runtime. Found by review of the close's withdrawal (the acquisition's shield,
    raised after the close lifted the others)."""
    path = tmp_path / "ring.db"
    drained: list[str] = []

    async def drain(ctx: trio_sessions.DrainContext) -> None:
        drained.append(ctx.session_id)

    async with _lock_holder(path) as holder:
        async with trio_sessions.open_runtime(path, drain) as runtime:
            holder.wake_then_take("s")
            assert runtime._busy.ring("s") is not None  # registered; its task not yet run
        assert holder.held, "the close waited for an acquisition it began itself"
        holder.release()
    async with trio_sessions.open_runtime(path, drain) as runtime:
        await runtime.wait_idle("s")
    assert drained == ["s"]


async def test_a_close_does_not_wait_for_a_failed_drain_s_finish_stuck_on_another_process_s_lock(
    tmp_path: Path,
) -> None:
    """A drain fails just as another process takes the write lock (a long operator
    transaction): its finalizer's write (`finish_failed`) waits for the lock in the worker
    thread. A close then (SIGTERM) must not wait for it: the close withdraws it unrun, and
    as after a store error at close the claim stays durable - recovery takes it over once
    the closed runtime's liveness token is free, and the drain runs again. Before, the
    close waited until the lock was freed (up to `LOCK_PATIENCE_S`, 120 s). Found by review
    of the close path's writes that wait for locks."""
    path = tmp_path / "finish.db"
    taken, go, resumed = trio.Event(), trio.Event(), trio.Event()
    says = _SaysWhenTheWorkerWaits()

    async def failing(ctx: trio_sessions.DrainContext) -> None:
        if ctx.resumed:
            resumed.set()
            return
        await ctx.take_inputs()
        taken.set()
        await go.wait()
        raise RuntimeError("the model refused")

    store = _sqlite.SQLiteStore(path, wrap_connection=says)
    async with _lock_holder(path) as holder:
        async with trio_sessions.open_runtime(store, failing) as runtime:
            await runtime.submit("s", {"n": 1})
            await taken.wait()
            holder.take()
            go.set()
            await says.waiting.wait()  # the failed finish waits for the lock
        assert holder.held, "the close waited for the failed drain's finish"
        holder.release()
        claims = holder.conn.execute("SELECT phase, handed_back FROM session_execution")
        assert claims.fetchall() == [("running", 0)]
    with trio.fail_after(HOLD_S):
        async with trio_sessions.open_runtime(path, failing, recovery_interval=0.05):
            await resumed.wait()


async def test_a_close_passes_on_a_user_s_interrupt_accepted_while_acquiring_a_held_session(
    tmp_path: Path,
) -> None:
    """A user interrupts a session this runtime is acquiring (`interrupt` returns True: "a
    claim being acquired") while another runtime holds its claim, and the acquisition waits
    for another process's write lock; then this runtime closes. The accepted interrupt is
    owed to the holder (`_pass_on_interrupt`: its claim marked cancelling): the close must
    not withdraw that acquisition, as it withdraws a plain one, or the holder's drain runs
    on, the user's stop lost. A user's stop finishes its own cleanup at a close. Found by
    review of the close's withdrawal (revV56)."""
    path = tmp_path / "pass-on.db"
    started, stopped = trio.Event(), trio.Event()

    async def holding(ctx: trio_sessions.DrainContext) -> None:
        started.set()
        try:
            await trio.sleep_forever()
        finally:
            stopped.set()

    says = _SaysWhenTheWorkerWaits()
    store = _sqlite.SQLiteStore(path, wrap_connection=says)
    async with (
        trio_sessions.open_runtime(path, holding) as other,
        _lock_holder(path) as holder,
        trio.open_nursery() as nursery,
    ):
        await other.submit("s", {"n": 1})
        await started.wait()
        async with trio_sessions.open_runtime(store, holding) as runtime:
            holder.take()
            assert runtime._busy.ring("s") is not None
            await says.waiting.wait()  # the acquisition waits for the lock
            assert await runtime.interrupt("s")
            nursery.start_soon(_release_once_closing, runtime, holder)
        holder.release()
        with trio.fail_after(HOLD_S):
            await stopped.wait()  # the holder was told of the user's stop


async def test_a_close_lets_a_failed_drain_s_finish_a_user_stopped_meanwhile_land(
    tmp_path: Path,
) -> None:
    """A drain fails and its finish (`finish_failed`) waits for another process's write
    lock; meanwhile its user interrupts the session (`interrupt` returns True), and then
    the runtime closes. The close withdraws a failed finish still waiting for the lock, the
    claim left running for recovery to resume - but a user's stop finishes its own cleanup
    at a close (cut, recovery would resume the work the user stopped): this finish must
    land, so nothing is left to resume. Found by review of the close's withdrawals
    (revV56): the claim was left running, and the next runtime ran the drain again."""
    path = tmp_path / "finish-stopped.db"
    taken, go = trio.Event(), trio.Event()
    resumed: list[str] = []
    says = _SaysWhenTheWorkerWaits()

    async def failing(ctx: trio_sessions.DrainContext) -> None:
        if ctx.resumed:
            resumed.append(ctx.session_id)
            return
        await ctx.take_inputs()
        taken.set()
        await go.wait()
        raise RuntimeError("the model refused")

    store = _sqlite.SQLiteStore(path, wrap_connection=says)
    async with _lock_holder(path) as holder, trio.open_nursery() as nursery:
        async with trio_sessions.open_runtime(store, failing) as runtime:
            await runtime.submit("s", {"n": 1})
            await taken.wait()
            holder.take()
            go.set()
            await says.waiting.wait()  # the failed finish waits for the lock
            assert await runtime.interrupt("s")
            nursery.start_soon(_release_once_closing, runtime, holder)
        holder.release()
        claims = holder.conn.execute("SELECT phase, handed_back FROM session_execution")
        assert claims.fetchall() == []
    async with trio_sessions.open_runtime(path, failing, recovery_interval=0.05) as runtime:
        await runtime.recover_once()
        await runtime.wait_idle("s")
    assert resumed == []


async def test_a_close_does_not_wait_for_a_recovery_takeover_stuck_on_another_process_s_lock(
    tmp_path: Path,
) -> None:
    """A recovery pass leased a dead owner's expired claim, and its takeover (one shielded
    transaction, the registrations flipped with its commit) waits in the worker thread
    for the write lock another process took meanwhile. Closing the runtime then must not
    wait for the lock, as it does not for a claim acquisition: nothing of the takeover has
    begun, the claim stays expired, and the next runtime resumes it once the recovery
    lease runs out. Found by review of the close's withdrawals (revV56): the close waited
    for the registered entries until the lock was freed (up to `LOCK_PATIENCE_S`)."""
    path = tmp_path / "takeover.db"
    resumed = trio.Event()

    async def drain(ctx: trio_sessions.DrainContext) -> None:
        assert ctx.resumed
        resumed.set()

    says = _SaysWhenTheWorkerWaits()
    store = _sqlite.SQLiteStore(path, wrap_connection=says)
    async with _lock_holder(path) as holder:
        async with trio_sessions.open_runtime(store, drain, lease=LEASE) as runtime:
            holder.conn.execute("INSERT INTO session(id, time_created) VALUES ('s', 0)")
            holder.conn.execute(
                "INSERT INTO session_execution(id, session_id, owner_id, phase,"
                " time_created, expires_at) VALUES ('e', 's', 'dead', 'running', 0, 1)"
            )

            async def take_the_lock(execution_ids: list[str]) -> None:
                holder.take()

            testing.set_seams(runtime, before_recovery_apply=take_the_lock)
            runtime._recover_now.set()
            await says.waiting.wait()  # the takeover's batch waits for the lock
            assert runtime.is_active("s")
        assert holder.held, "the close waited for the recovery takeover until the lock was freed"
        holder.release()
        rows = holder.conn.execute("SELECT owner_id, phase FROM session_execution").fetchall()
        assert rows == [("dead", "running")]
    with trio.fail_after(HOLD_S):
        async with trio_sessions.open_runtime(path, drain, recovery_interval=0.05):
            await resumed.wait()  # once the closed runtime's recovery lease ran out
