"""A PostgreSQL store call waiting for a session's lock another connection holds: a caller
cancelled meanwhile - a drain at its lease's local deadline, a plain call's timeout - is
withdrawn unrun, and its task goes on then, not when the lock is freed (DESIGN §6.17: no
drain outlives its lease, drains of one session never overlap). The lock is the session's
advisory lock (`ts_lock_key`), which every function of the store takes first."""

from __future__ import annotations

import gc
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import psycopg
import pytest
import trio
from helpers import HeldLock, TakesAgainAtGo, released_at_the_latest
from helpers import pg_engine_at as engine_at
from helpers import pg_raw as raw

import trio_sessions
from trio_sessions import _store
from trio_sessions._backend import Job
from trio_sessions._postgres import PgTx, PostgresStore
from trio_sessions._postgres.engine import Withdrawals, _Withdrawn

WAIT_S = 30.0  # a bound on each wait below, never reached when the test passes

# How long another connection holds the session's lock at the most: far longer than a
# lease of LEASE, so a caller that waits for it is told apart from one that does not (and
# longer than LOCK_TIMEOUT_MS, after which the store retries the wait).
HOLD_S = 8.0
LEASE = 1.0


class _LockHolder(HeldLock):
    """Another connection holding session `session_id`'s advisory lock in an open
    transaction (as another process's store call does while it runs), and its claim's row:
    the heartbeat cannot renew the claim meanwhile, so the lease runs out."""

    conn: psycopg.Connection[Any]

    def __init__(self, conn: psycopg.Connection[Any], session_id: str) -> None:
        super().__init__(conn)
        self.session_id = session_id

    def take(self) -> None:
        self.conn.execute("BEGIN")
        self.conn.execute("SELECT pg_advisory_xact_lock(ts_lock_key(%s))", (self.session_id,))
        self.conn.execute(
            "SELECT id FROM session_execution WHERE session_id = %s FOR UPDATE", (self.session_id,)
        )
        self._took()

    def inputs(self) -> list[tuple[Any, ...]]:
        return self.conn.execute(
            "SELECT session_id FROM session_input ORDER BY session_id"
        ).fetchall()


@asynccontextmanager
async def _lock_holder(url: str, schema: str, session_id: str) -> AsyncIterator[_LockHolder]:
    """A `_LockHolder` that lets go `HOLD_S` after it took the lock at the latest (a caller
    that waits for it then fails its test instead of hanging it), and at the block's end."""
    with raw(url, schema) as conn:
        holder = _LockHolder(conn, session_id)
        async with released_at_the_latest(holder, HOLD_S):
            yield holder


@pytest.fixture
def pg_store(pg_url: str, migrated_schema: str) -> PostgresStore:
    return PostgresStore(pg_url, schema=migrated_schema)


async def test_a_drain_waiting_for_its_sessions_lock_stops_within_its_lease(
    pg_store: PostgresStore,
) -> None:
    """A drain whose take waits for its session's lock another connection holds is stopped
    at its lease's local deadline and exits while the lock is still held: its call is
    withdrawn, the statement waiting for the lock cancelled. Before, it ran on past its
    lease until the holder let go (the wait retried lock timeouts for up to 15 s), while a
    successor's drain could already run."""
    drain = TakesAgainAtGo()

    with trio.fail_after(HOLD_S + 20):
        async with (
            _lock_holder(pg_store.url, pg_store.schema, "s") as holder,
            trio_sessions.open_runtime(pg_store, drain, lease=LEASE) as runtime,
        ):
            await runtime.submit("s", {"n": 1})
            await drain.first_taken.wait()
            await runtime.submit("s", {"n": 2})  # a pending input: the take writes
            holder.take()
            started = trio.current_time()
            drain.go.set()
            await drain.exited.wait()
            assert holder.held, "the drain ran on past its lease, until the lock was freed"
            assert trio.current_time() - started < LEASE + 1.0
            holder.release()


async def test_a_caller_cancelled_while_its_call_waits_for_the_lock_is_withdrawn(
    pg_store: PostgresStore,
) -> None:
    """A submit cancelled while its call waits for its session's lock another connection
    holds returns at once, and nothing of it is written once the lock is freed; a call
    after it on the same writer runs as usual."""
    with trio.fail_after(HOLD_S + 20):
        async with (
            _lock_holder(pg_store.url, pg_store.schema, "s") as holder,
            trio_sessions.open_runtime(pg_store, None) as runtime,
        ):
            holder.take()
            with trio.move_on_after(0.3) as waited:
                await runtime.submit("s", {"n": 1})
            assert waited.cancelled_caught
            assert holder.held, "the cancelled submit waited until the lock was freed"
            holder.release()
            await runtime.submit("t", {"n": 2})
            assert holder.inputs() == [("t",)]


def _mark(tx: PgTx, session_id: str) -> str:
    """A write on `session_id`, under its lock."""
    tx.lock_session(session_id)
    tx.execute("INSERT INTO mark VALUES (?)", (session_id,))
    return session_id


def _waits_for_a_lock(url: str, pid: int) -> bool:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (pid,)
        ).fetchone()
    return row is not None and row[0] == "Lock"


async def _until_a_statement_waits_for_a_lock(conn: psycopg.Connection[Any], text: str) -> None:
    """Return once a statement holding `text` waits for a lock on the server (polled
    through `conn`, another connection; the caller's `fail_after` bounds it)."""
    waiting = (
        "SELECT count(*) FROM pg_stat_activity"
        " WHERE wait_event_type = 'Lock' AND query LIKE '%%' || %s || '%%'"
    )
    while conn.execute(waiting, (text,)).fetchone() == (0,):
        await trio.sleep(0.01)


def _until_it_waits_for_a_lock(url: str, engine: Any, runner: threading.Thread, what: str) -> None:
    """Return once the engine's connection, run by `runner`, waits for a lock (within
    `WAIT_S`)."""
    assert engine.backend_pid is not None
    for _ in range(int(WAIT_S / 0.01)):
        if _waits_for_a_lock(url, engine.backend_pid):
            return
        runner.join(0.01)
    raise AssertionError(f"{what} never waited for the lock")


def test_a_batch_waiting_for_a_lock_drops_the_withdrawn_and_commits_the_rest(
    pg_url: str, migrated_schema: str
) -> None:
    """A batch waiting for one session's lock another connection holds: its caller cancelled,
    the waiting statement is cancelled, the batch rolled back, that job withdrawn unrun (its
    caller woken then) and the other job run again and committed - all while the lock is
    still held, and on the same connection: the cancel lands on no later statement. Nothing
    of the withdrawn job is written once the lock is freed."""
    with engine_at(pg_url, migrated_schema, 1.0) as engine, raw(pg_url, migrated_schema) as holder:
        holder.execute("CREATE TABLE mark(name TEXT)")
        holder.execute("BEGIN")
        holder.execute("SELECT pg_advisory_xact_lock(ts_lock_key('s'))")
        woken: list[list[Job]] = []
        withdrawals = Withdrawals(woken.append)
        waiting, other = Job(_mark, ("s",)), Job(_mark, ("t",))
        runner = threading.Thread(
            target=engine.run_jobs, args=([waiting, other],), kwargs={"withdrawals": withdrawals}
        )
        runner.start()
        _until_it_waits_for_a_lock(pg_url, engine, runner, "the batch")
        assert not withdrawals.withdraw(waiting)  # the worker's verdict: the caller waits
        runner.join(WAIT_S / 3)
        assert not runner.is_alive(), "the batch waited on for the lock"
        assert woken == [[waiting]]
        assert waiting.withdrawn and waiting.result is None and waiting.error is None
        assert not other.withdrawn and other.unwrap() == "t"
        holder.execute("ROLLBACK")
        assert holder.execute("SELECT name FROM mark").fetchall() == [("t",)]
        holder.execute("DROP TABLE mark")


class _Connection:
    """A connection's cancel, counted (nothing reaches a server)."""

    def __init__(self) -> None:
        self.cancels = 0
        self.cancelled = threading.Event()

    def cancel_safe(self, timeout: float) -> None:
        self.cancels += 1
        self.cancelled.set()


def test_a_cancel_too_late_for_its_statement_still_withdraws_before_commit() -> None:
    """A cancel sent while a statement was unanswered, which answered all the same (the lock
    granted just then): the attempt sends nothing more and never reaches its COMMIT - it
    rolls back, its caller's job withdrawn."""
    conn = _Connection()
    withdrawals = Withdrawals(lambda jobs: None)
    job = Job(_mark, ("s",))
    withdrawals.attempt([job])
    with withdrawals.statement(conn):
        withdrawals.withdraw(job)
        assert conn.cancelled.wait(WAIT_S)  # sent; the statement answers after it
    with pytest.raises(_Withdrawn), withdrawals.statement(conn):
        raise AssertionError("a statement was sent after the cancel")
    with pytest.raises(_Withdrawn):
        withdrawals.commit()
    assert withdrawals.withdrawn([job]) == [] and job.withdrawn
    assert conn.cancels == 1


def test_an_operation_past_its_commit_or_whose_reply_was_lost_is_never_withdrawn() -> None:
    """A caller cancelled once its transaction's COMMIT is due waits for the outcome: no
    cancel is sent; nor is one for a job an earlier attempt of which may have landed (its
    reply lost), and that job runs on."""
    conn = _Connection()
    withdrawals = Withdrawals(lambda jobs: None)
    job = Job(_mark, ("s",))
    withdrawals.attempt([job])
    with withdrawals.statement(conn):
        pass
    withdrawals.commit()
    assert not withdrawals.withdraw(job)
    assert conn.cancels == 0

    lost = Job(_mark, ("t",))
    lost.reply_lost = True
    withdrawals.withdraw(lost)
    withdrawals.attempt([lost])  # not withdrawn before it is sent
    assert withdrawals.withdrawn([lost]) == [lost] and not lost.withdrawn
    withdrawals.attempt([job], certain=False)  # nor any job of an uncertain attempt
    assert withdrawals.withdrawn([job]) == [job] and not job.withdrawn


def test_a_cancel_that_finds_the_backend_idle_never_lands_on_its_next_statement(
    pg_url: str,
) -> None:
    """The server ignores a cancel request that finds the backend idle (a statement
    answered before it came): once `cancel_safe` returned, the next statement on the
    connection runs - what `Withdrawals` relies on to never cancel a COMMIT or the next
    batch."""
    with psycopg.connect(pg_url, autocommit=True) as conn:
        for _ in range(20):
            conn.execute("SELECT 1")
            conn.cancel_safe(timeout=WAIT_S)
            assert conn.execute("SELECT pg_sleep(0.01), 2").fetchone() == ("", 2)


def test_a_caller_who_asked_before_the_waiting_statement_has_it_cancelled() -> None:
    """A caller cancelled while a statement of its transaction answers within
    `CANCEL_AFTER_S` (or between two statements): the cancel is not sent for that one, but a
    later statement of the attempt still unanswered `CANCEL_AFTER_S` after it was sent (the
    one waiting for a lock) is cancelled. Before, the request was dropped with the statement
    it came during, and the later statement waited for the lock as if no caller had asked."""
    conn = _Connection()
    withdrawals = Withdrawals(lambda jobs: None)
    job = Job(_mark, ("s",))
    withdrawals.attempt([job])
    with withdrawals.statement(conn):
        withdrawals.withdraw(job)  # the statement answers at once
    with withdrawals.statement(conn):  # the next one waits
        assert conn.cancelled.wait(WAIT_S), "the waiting statement was never cancelled"
    assert conn.cancels == 1

    between = Withdrawals(lambda jobs: None)
    later = Job(_mark, ("t",))
    between.attempt([later])
    with between.statement(conn):
        pass
    conn.cancelled.clear()
    between.withdraw(later)  # between two statements: none is in flight
    with between.statement(conn):
        assert conn.cancelled.wait(WAIT_S), "the waiting statement was never cancelled"
    assert conn.cancels == 2


def _gated(tx: PgTx, name: str, reached: threading.Event, go: threading.Event) -> str:
    """A write on no session that lets the test act between its statements."""
    tx.execute("INSERT INTO mark VALUES (?)", (name,))
    reached.set()
    assert go.wait(WAIT_S)
    return name


def test_a_job_whose_caller_was_cancelled_before_its_statement_waits_is_withdrawn_then(
    pg_url: str, migrated_schema: str
) -> None:
    """A batch whose second job waits for a session's lock another connection holds, its
    caller cancelled while the first job ran (no statement in flight): the waiting statement
    is cancelled all the same, that job withdrawn and the first committed while the lock is
    still held. Before, the lock was waited for until it was freed (here lock_timeout is
    off, as a long wait: the engine's own gives up after `LOCK_TIMEOUT_MS`)."""
    with engine_at(pg_url, migrated_schema, 1.0) as engine, raw(pg_url, migrated_schema) as holder:
        holder.execute("CREATE TABLE mark(name TEXT)")
        engine.conn.execute("SET lock_timeout = 0")
        holder.execute("BEGIN")
        holder.execute("SELECT pg_advisory_xact_lock(ts_lock_key('s'))")
        woken: list[list[Job]] = []
        withdrawals = Withdrawals(woken.append)
        reached, go = threading.Event(), threading.Event()
        first, waiting = Job(_gated, ("t", reached, go)), Job(_mark, ("s",))
        runner = threading.Thread(
            target=engine.run_jobs, args=([first, waiting],), kwargs={"withdrawals": withdrawals}
        )
        runner.start()
        try:
            assert reached.wait(WAIT_S)
            assert not withdrawals.withdraw(waiting)  # between two statements
            go.set()
            runner.join(WAIT_S / 3)
            assert not runner.is_alive(), "the batch waited on for the lock"
            assert woken == [[waiting]] and waiting.withdrawn
            assert first.unwrap() == "t"
        finally:
            go.set()
            holder.execute("ROLLBACK")
            runner.join(WAIT_S)
        assert holder.execute("SELECT name FROM mark").fetchall() == [("t",)]
        holder.execute("DROP TABLE mark")


def test_a_job_no_attempt_has_begun_is_withdrawn_at_once(pg_url: str, migrated_schema: str) -> None:
    """A caller cancelled while an earlier operation of its hand-off still runs (here one
    held at a gate, as one waiting for another session's lock another connection holds, up
    to `RECONNECT_PATIENCE_S` of lock-timeout retries): nothing of its own operation was
    sent, so it is withdrawn at once (`withdraw` says True, its caller goes on) and the
    worker never runs it. Before, the caller waited for the verdict until the worker came
    to its operation - a drain past its lease outlived it by the other operation's wait."""
    with engine_at(pg_url, migrated_schema, 1.0) as engine, raw(pg_url, migrated_schema) as check:
        check.execute("CREATE TABLE mark(name TEXT)")
        woken: list[list[Job]] = []
        withdrawals = Withdrawals(woken.append)
        reached, go = threading.Event(), threading.Event()
        first, later = Job(_gated, ("t", reached, go)), Job(_mark, ("s",))
        runner = threading.Thread(
            target=engine.run_jobs,
            args=([later],),
            kwargs={"alone": [first], "withdrawals": withdrawals},
        )
        runner.start()
        try:
            assert reached.wait(WAIT_S)
            assert withdrawals.withdraw(later), "the caller waits for the operation before it"
        finally:
            go.set()
            runner.join(WAIT_S)
        assert not runner.is_alive()
        assert later.withdrawn and woken == [[later]]
        assert first.unwrap() == "t"
        assert check.execute("SELECT name FROM mark").fetchall() == [("t",)]
        check.execute("DROP TABLE mark")

    begun = Withdrawals(lambda jobs: None)
    job = Job(_mark, ("u",))
    begun.attempt([job])
    assert not begun.withdraw(job)  # begun: the worker decides


async def test_a_hand_off_leaves_no_reference_cycle_behind(pg_store: PostgresStore) -> None:
    """Each write's `Queued` held its hand-off's `Withdrawals`, whose wake held the batch of
    `Queued`s: a reference cycle per hand-off, so every hand-off's operations, jobs and
    results stayed in memory until the cyclic collector ran - and a full collection over
    that garbage stalled the event loop for about 90 ms in the bench's `watch()` replay.
    With the collector off, nothing of a finished hand-off is left for it to find."""
    gc.collect()
    gc.disable()
    try:
        async with trio_sessions.open_runtime(pg_store, None) as runtime:
            for n in range(20):
                await runtime.submit(f"s{n}", {"n": n})
        # The runtime closed: its lanes' workers and their last hand-offs are gone too.
        left = [obj for obj in gc.get_objects() if isinstance(obj, Withdrawals)]
        assert left == [], f"{len(left)} hand-offs' Withdrawals wait for the collector"
    finally:
        gc.enable()


def test_a_withdrawn_forget_of_gone_owners_waiting_for_a_row_lock_is_cancelled(
    pg_url: str, migrated_schema: str
) -> None:
    """`forget_gone_owners` deleting a gone owner's token record (`tx.forget_tokens`)
    while another connection holds that `session_owner` row locked, its caller cancelled:
    the waiting statement is cancelled and the job withdrawn, while the lock is still held,
    as every other statement of a write. `PgTx.free_tokens` and `forget_tokens` sent
    their statements past the statement guard, so the wait ran on whatever the caller -
    here (`lock_timeout` off, as a long wait) until `statement_timeout` failed the job
    with a `StoreError` 10 s later, never withdrawn. Found by an audit."""
    with engine_at(pg_url, migrated_schema, 1.0) as engine, raw(pg_url, migrated_schema) as holder:
        holder.execute("INSERT INTO session_owner(owner_id, time_created) VALUES ('gone', 0)")
        engine.conn.execute("SET lock_timeout = 0")
        holder.execute("BEGIN")
        holder.execute("SELECT owner_id FROM session_owner WHERE owner_id = 'gone' FOR UPDATE")
        woken: list[list[Job]] = []
        withdrawals = Withdrawals(woken.append)
        forget = Job(_store.forget_gone_owners, (["gone"],))
        runner = threading.Thread(
            target=engine.run_jobs,
            args=((),),
            kwargs={"alone": [forget], "withdrawals": withdrawals},
        )
        runner.start()
        try:
            _until_it_waits_for_a_lock(pg_url, engine, runner, "the forget")
            assert not withdrawals.withdraw(forget)  # the worker's verdict: the caller waits
            runner.join(WAIT_S / 3)
            assert not runner.is_alive(), "the forget waited on for the row lock"
            assert woken == [[forget]] and forget.withdrawn
        finally:
            holder.execute("ROLLBACK")
            runner.join(WAIT_S)
        assert holder.execute("SELECT owner_id FROM session_owner").fetchall() == [("gone",)]


class _RowLockHolder(HeldLock):
    """Another connection holding a session's row lock in an open transaction (an
    operator's `UPDATE session ...` not committed yet) - not its advisory lock, which an
    acquire never waits for ('busy')."""

    conn: psycopg.Connection[Any]

    def take(self) -> None:
        self.conn.execute("BEGIN")
        self.conn.execute("SELECT id FROM session WHERE id = 's' FOR UPDATE")
        self._took()


async def test_a_close_does_not_wait_for_a_claim_acquisition_stuck_on_a_row_lock(
    pg_store: PostgresStore,
) -> None:
    """Another connection holds a woken session's row lock (a long operator transaction):
    the opening recovery pass starts its acquisition, whose doorbell update waits for the
    lock, shielded. Closing the runtime then must not wait for it - the close withdraws the
    acquisition, its statement cancelled and rolled back - and the doorbell stays rung for
    the next runtime. Before, the close waited until the lock was freed (its wait is cut
    at `lock_timeout` and retried for up to `RECONNECT_PATIENCE_S`, about 10 s)."""
    drained: list[str] = []

    async def drain(ctx: trio_sessions.DrainContext) -> None:
        drained.append(ctx.session_id)

    with trio.fail_after(HOLD_S + 20):
        with (
            raw(pg_store.url, pg_store.schema) as other,
            raw(pg_store.url, pg_store.schema) as conn,
        ):
            other.execute(
                "INSERT INTO session(id, time_created, time_woken, wakes) VALUES ('s', 0, 0, 1)"
            )
            holder = _RowLockHolder(conn)
            async with released_at_the_latest(holder, HOLD_S):
                holder.take()
                async with trio_sessions.open_runtime(pg_store, drain) as runtime:
                    assert runtime.is_active("s")  # its acquisition waits for the lock
                    await _until_a_statement_waits_for_a_lock(other, "ts_acquire")
                    closing = trio.current_time()
                assert trio.current_time() - closing < 1.0, "the close waited for the lock"
                assert holder.held
                holder.release()
            assert other.execute("SELECT time_woken FROM session").fetchall() == [(0,)]
            assert other.execute("SELECT count(*) FROM session_execution").fetchall() == [(0,)]
        async with trio_sessions.open_runtime(pg_store, drain) as runtime:
            await runtime.wait_idle("s")
    assert drained == ["s"]


async def test_a_close_does_not_wait_for_a_failed_drain_s_finish_stuck_on_the_sessions_lock(
    pg_store: PostgresStore,
) -> None:
    """A drain fails just as another connection takes its session's lock (a long operator
    transaction): its finalizer's write waits for the lock. A close then must not wait for
    it - the close withdraws it, its statement cancelled - and the claim stays durable for
    recovery. Before, the close waited until the lock was freed (the wait is cut at
    `lock_timeout` and retried for up to `RECONNECT_PATIENCE_S`)."""
    taken, go = trio.Event(), trio.Event()

    async def failing(ctx: trio_sessions.DrainContext) -> None:
        await ctx.take_inputs()
        taken.set()
        await go.wait()
        raise RuntimeError("the model refused")

    with trio.fail_after(HOLD_S + 20):
        async with _lock_holder(pg_store.url, pg_store.schema, "s") as holder:
            with raw(pg_store.url, pg_store.schema) as other:
                async with trio_sessions.open_runtime(pg_store, failing) as runtime:
                    await runtime.submit("s", {"n": 1})
                    await taken.wait()
                    holder.take()
                    go.set()
                    await _until_a_statement_waits_for_a_lock(other, "ts_finish")
                    closing = trio.current_time()
                assert trio.current_time() - closing < 1.0, "the close waited for the lock"
                assert holder.held
                holder.release()
                claims = other.execute("SELECT phase FROM session_execution").fetchall()
                assert claims == [("running",)]


async def test_a_close_does_not_wait_for_a_recovery_takeover_stuck_on_a_row_lock(
    pg_store: PostgresStore,
) -> None:
    """As tests/test_lock_wait.py's test of the same name, on PostgreSQL: a recovery pass
    leased a dead owner's expired claim, and its takeover waits for the session's row lock
    (an operator's transaction not committed yet). The close must not wait for it - the
    takeover is withdrawn, its statement cancelled and rolled back - and the claim stays
    the dead owner's, for the next runtime once our recovery lease ran out. Before, the
    close waited until the lock was freed. Found by review (revV56)."""
    resumed = trio.Event()

    async def drain(ctx: trio_sessions.DrainContext) -> None:
        assert ctx.resumed
        resumed.set()

    with trio.fail_after(HOLD_S + 20):
        with (
            raw(pg_store.url, pg_store.schema) as other,
            raw(pg_store.url, pg_store.schema) as conn,
        ):
            holder = _RowLockHolder(conn)
            async with released_at_the_latest(holder, HOLD_S):
                async with trio_sessions.open_runtime(pg_store, drain, lease=LEASE) as runtime:
                    other.execute("INSERT INTO session(id, time_created) VALUES ('s', 0)")
                    other.execute(
                        "INSERT INTO session_execution(id, session_id, owner_id, phase,"
                        " time_created, expires_at) VALUES ('e', 's', 'dead', 'running', 0, 1)"
                    )
                    holder.take()
                    runtime._recover_now.set()
                    await _until_a_statement_waits_for_a_lock(other, "")  # the takeover, any text
                    assert runtime.is_active("s")
                    closing = trio.current_time()
                assert trio.current_time() - closing < 1.0, "the close waited for the lock"
                assert holder.held
                holder.release()
            claims = other.execute("SELECT owner_id, phase FROM session_execution").fetchall()
            assert claims == [("dead", "running")]
        async with trio_sessions.open_runtime(pg_store, drain, recovery_interval=0.05):
            await resumed.wait()  # once the closed runtime's recovery lease ran out
