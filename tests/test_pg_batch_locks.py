"""A PostgreSQL group-commit batch takes its sessions' locks in one global order.

Two processes' batches that touch the same two sessions in opposite orders - a worker's
batch taking one chat's inputs after another chat's append, beside the other worker's batch
of acquisitions of both - deadlock if each operation locks its own session as it runs: the
server detects it only after `deadlock_timeout` (a second), and everything queued behind
either batch's locks stalls that long. The engine locks every session its batch names, in
the functions' order, with the batch's first statement. An acquire from a doorbell never
waits for a session's lock: it answers at once, and the runtime passes over that doorbell
until the lock's holder is done, instead of asking again and again.
"""

from __future__ import annotations

import threading
from typing import Any

import psycopg
import pytest
import trio
import trio.testing
from conftest import fresh_schema
from helpers import HoldsBusy
from helpers import pg_engine_at as engine_at
from helpers import pg_raw as raw

from trio_sessions import _backend, _store, open_runtime
from trio_sessions._backend import Job
from trio_sessions._decisions import AcquireVerdict
from trio_sessions._postgres import PgTx, PostgresStore, connections, run_op

WAIT_S = 30.0  # a bound on each gate, never reached when the test passes


def _backend_waits_for_a_lock(url: str, pid: int) -> bool:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (pid,)
        ).fetchone()
    return row is not None and row[0] == "Lock"


def test_two_batches_naming_two_sessions_in_opposite_orders_never_deadlock(
    pg_url: str, migrated_schema: str
) -> None:
    first_locked = threading.Event()
    second_locked = threading.Event()
    holder: list[int] = []

    def lock(tx: PgTx, session_id: str) -> str:
        tx.lock_session(session_id)
        return session_id

    def lock_then_wait_for_the_other(tx: PgTx, session_id: str) -> str:
        # Batch one holds its first session, then waits until batch two either holds its
        # own first session (each operation locking as it runs: the deadlock follows) or
        # waits for a lock (the batch's locks were all taken up front: no deadlock).
        tx.lock_session(session_id)
        first_locked.set()
        for _ in range(int(WAIT_S / 0.01)):
            if second_locked.wait(0.01) or _backend_waits_for_a_lock(pg_url, holder[0]):
                return session_id
        raise AssertionError("batch two neither took a lock nor waited for one")

    def lock_and_say_so(tx: PgTx, session_id: str) -> str:
        tx.lock_session(session_id)
        second_locked.set()
        return session_id

    with (
        engine_at(pg_url, migrated_schema, 1.0) as one,
        engine_at(pg_url, migrated_schema, 1.0) as two,
    ):
        assert two.backend_pid is not None
        holder.append(two.backend_pid)
        batch_one = [
            _backend.Job(lock_then_wait_for_the_other, ("chat-a",)),
            _backend.Job(lock, ("chat-b",)),
        ]
        batch_two = [
            _backend.Job(lock_and_say_so, ("chat-b",)),
            _backend.Job(lock, ("chat-a",)),
        ]
        runner = threading.Thread(target=one.run_batch, args=(batch_one,))
        runner.start()
        assert first_locked.wait(WAIT_S)
        two.run_batch(batch_two)
        runner.join(WAIT_S)
        assert not runner.is_alive()
        outcomes: list[Any] = [job.unwrap() for job in batch_one + batch_two]
        assert outcomes == ["chat-a", "chat-b", "chat-b", "chat-a"]
        # Each batch one transaction: none was re-run alone after a deadlock, none retried.
        assert (one.transactions, two.transactions) == (1, 1)
        assert one.retries == two.retries == 0


def test_a_batch_locks_sessions_whose_ids_need_quoting(pg_url: str, migrated_schema: str) -> None:
    # The lock statement travels with the batch's first statement, bound client-side.
    sessions = ["50%'off", 'a"b\\c', "{x,y}", "naïve", "%s"]

    def lock(tx: PgTx, session_id: str) -> str:
        tx.lock_session(session_id)
        return session_id

    with engine_at(pg_url, migrated_schema, 1.0) as engine:
        batch = [_backend.Job(lock, (session_id,)) for session_id in sessions]
        engine.run_batch(batch)
        assert [job.unwrap() for job in batch] == sessions
        assert engine.transactions == 1


def _hold_session_lock(conn: psycopg.Connection[Any], session_id: str) -> None:
    conn.execute("BEGIN")
    conn.execute("SELECT ts_lock(%s)", (session_id,))


def _run_beside_a_held_lock(engine: Any, holder: psycopg.Connection[Any], jobs: list[Job]) -> bool:
    """Run `jobs` as one batch while `holder`'s transaction holds a lock, then end that
    transaction; whether the batch was still waiting for it after WAIT_S / 3."""
    runner = threading.Thread(target=engine.run_batch, args=(jobs,))
    runner.start()
    runner.join(WAIT_S / 3)
    waited = runner.is_alive()
    holder.execute("ROLLBACK")
    runner.join(WAIT_S)
    return waited


# Two session ids with one 32-bit hash (hashtext): a lock keyed by it was one lock for both.
SAME_HASHTEXT = ("chat-236080", "chat-263218")


def test_sessions_whose_ids_share_a_32_bit_hash_never_block_each_other(
    pg_url: str, migrated_schema: str
) -> None:
    """DESIGN §6.14: different sessions never block each other. The session lock's key is
    64 bits (one collision expected among some 5e9 ids, not 1e5): while a transaction holds
    one session's lock, a submit to the other commits at once, and an acquire of it claims
    (a doorbell's acquire answered held, a drain deferred to the next recovery pass); the
    held session's own submit waits for its lock."""
    held, other = SAME_HASHTEXT
    with engine_at(pg_url, migrated_schema, 1.0) as engine, raw(pg_url, migrated_schema) as holder:
        [(one, two)] = holder.execute("SELECT hashtext(%s), hashtext(%s)", SAME_HASHTEXT).fetchall()
        assert one == two  # the premise: the ids collide in 32 bits
        run_op(engine, _store.wake, other)
        _hold_session_lock(holder, held)
        jobs = [
            Job(_store.submit, (other, "{}", "i-other")),
            Job(_store.acquire, (other, "e-other", "me", 30_000)),
        ]
        runner = threading.Thread(target=engine.run_batch, args=(jobs,))
        runner.start()
        runner.join(WAIT_S / 3)
        waited = runner.is_alive()
        blocked = [Job(_store.submit, (held, "{}", "i-held"))]
        behind = threading.Thread(target=engine.run_batch, args=(blocked,))
        held_waited = False
        if not waited:
            behind.start()
            behind.join(1.0)
            held_waited = behind.is_alive()
        holder.execute("ROLLBACK")
        runner.join(WAIT_S)
        assert not waited, "a submit waited for another session's lock"
        assert jobs[0].unwrap() == "i-other"
        assert jobs[1].unwrap().verdict is AcquireVerdict.CLAIM
        behind.join(WAIT_S)
        assert held_waited, "the held session's own submit did not wait for its lock"
        assert blocked[0].unwrap() == "i-held"


def test_one_session_id_in_two_stores_of_one_database_is_two_locks(
    pg_url: str, pg_schema: str
) -> None:
    """DESIGN §6.14 and §6.27: two stores (schemas) of one database are two stores; their
    sessions share nothing, however they are named - tenants numbering their chats 1, 2, ...
    name the same ids. While a transaction in one store holds session `chat-1`'s lock, the
    other store's submit to its own `chat-1` commits at once and its acquire claims (a
    doorbell's acquire answered held: the drain waited for the next recovery pass)."""
    other_schemas = fresh_schema(pg_url)
    other_schema = next(other_schemas)
    try:
        with (
            engine_at(pg_url, pg_schema, 1.0) as engine,
            engine_at(pg_url, other_schema, 1.0),
            raw(pg_url, other_schema) as holder,
        ):
            run_op(engine, _store.wake, "chat-1")
            _hold_session_lock(holder, "chat-1")
            jobs = [
                Job(_store.submit, ("chat-1", "{}", "i-1")),
                Job(_store.acquire, ("chat-1", "e-1", "me", 30_000)),
            ]
            waited = _run_beside_a_held_lock(engine, holder, jobs)
            assert not waited, "a submit waited for a lock held in another store"
            assert jobs[0].unwrap() == "i-1"
            assert jobs[1].unwrap().verdict is AcquireVerdict.CLAIM
    finally:
        next(other_schemas, None)


@pytest.mark.parametrize("together", [False, True], ids=["alone", "in-a-batch"])
def test_an_acquire_of_a_session_another_transaction_holds_answers_at_once(
    pg_url: str, migrated_schema: str, together: bool
) -> None:
    """Two workers see the same doorbell: the one whose acquire finds the session's lock
    taken (the other's acquire, a submit still committing) claims nothing and does not wait
    - nor does the rest of its batch - since whoever holds the lock claims the session or
    signals it again once committed. The doorbell stays for them; a later acquire claims."""
    with engine_at(pg_url, migrated_schema, 1.0) as engine, raw(pg_url, migrated_schema) as holder:
        run_op(engine, _store.wake, "busy")
        run_op(engine, _store.wake, "free")
        _hold_session_lock(holder, "busy")
        jobs = [Job(_store.acquire, ("busy", "e1", "me", 30_000))]
        if together:
            jobs.append(Job(_store.acquire, ("free", "e2", "me", 30_000)))
            jobs.append(Job(_store.submit, ("other", "{}", "i1")))
        waited = _run_beside_a_held_lock(engine, holder, jobs)
        assert not waited, "the batch waited for the session's lock"
        assert jobs[0].unwrap().verdict is AcquireVerdict.HELD
        if together:
            assert jobs[1].unwrap().verdict is AcquireVerdict.CLAIM
            assert jobs[2].unwrap() == "i1"
        rung = holder.execute("SELECT time_woken IS NOT NULL FROM session WHERE id = 'busy'")
        assert rung.fetchone() == (True,)
        assert run_op(engine, _store.acquire, "busy", "e3", "me", 30_000).verdict is (
            AcquireVerdict.CLAIM
        )


@pytest.mark.parametrize("together", [False, True], ids=["alone", "in-a-batch"])
def test_an_acquire_of_a_claimed_session_takes_no_lock(
    pg_url: str, migrated_schema: str, together: bool
) -> None:
    """The worker that lost the race for a session answers held from the claim it sees,
    without taking the session's lock: the winner's next operation on it (taking the
    inputs) never waits for the loser's batch to commit."""
    with engine_at(pg_url, migrated_schema, 1.0) as engine, raw(pg_url, migrated_schema) as holder:
        for session_id in ("won", "free"):
            run_op(engine, _store.wake, session_id)
        assert run_op(engine, _store.acquire, "won", "e0", "winner", 30_000).verdict is (
            AcquireVerdict.CLAIM
        )
        _hold_session_lock(holder, "free")  # a batch alone would skip it: keep it busy
        jobs = [Job(_store.acquire, ("won", "e1", "loser", 30_000))]
        if together:
            jobs.append(Job(_store.acquire, ("free", "e2", "loser", 30_000)))
        try:
            # In the loser's own transaction (begun with its first statement), the way its
            # batch leaves it before COMMIT.
            tx = PgTx(engine.conn, None)
            results = engine._run_jobs(tx, jobs)
            locked = holder.execute(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = %s",
                (engine.backend_pid,),
            ).fetchone()
        finally:
            engine.conn.execute("ROLLBACK")
            holder.execute("ROLLBACK")
    assert [result.verdict for result in results] == [AcquireVerdict.HELD] * len(jobs)
    assert results[0].holder == "winner"
    assert locked == (0,)


def _ids_in_the_other_order(conn: psycopg.Connection[Any]) -> tuple[str, str]:
    """Two session ids whose lock keys sort the other way round from the ids."""
    for n in range(1_000):
        first, second = f"fork-a-{n}", f"fork-b-{n}"
        row = conn.execute("SELECT ts_lock_key(%s) > ts_lock_key(%s)", (first, second))
        if row.fetchone() == (True,):
            return first, second
    raise AssertionError("no such pair among 1,000")


def test_an_operation_locking_two_sessions_takes_them_in_the_lock_order(
    pg_url: str, migrated_schema: str
) -> None:
    """`fork` locks its source and its new session; every multi-session lock must take them
    in one order - the key's (`ts_lock_all`) - or a fork beside a batch naming both
    deadlocks: the fork holds the source and waits for the new one, the other holds the
    new one and waits for the source (the server breaks it after deadlock_timeout, a
    second, and re-runs one). Here the other transaction holds the session first in key
    order: the fork waits for it holding nothing, and the other takes the second at once."""
    with engine_at(pg_url, migrated_schema, 1.0) as engine, raw(pg_url, migrated_schema) as holder:
        source, new = _ids_in_the_other_order(holder)
        assert source < new
        run_op(engine, _store.wake, source)
        holder.execute("BEGIN")
        holder.execute("SELECT ts_lock(%s)", (new,))  # first in key order
        assert engine.backend_pid is not None
        forking = [Job(_store.fork, (source, new, None))]
        runner = threading.Thread(target=engine.run_batch, args=(forking,))
        runner.start()
        for _ in range(int(WAIT_S / 0.01)):
            if _backend_waits_for_a_lock(pg_url, engine.backend_pid) or not runner.is_alive():
                break
            threading.Event().wait(0.01)
        try:
            holder.execute("SET LOCAL lock_timeout = '500ms'")
            holder.execute("SELECT ts_lock(%s)", (source,))  # the fork must not hold it
        finally:
            holder.execute("ROLLBACK")
            runner.join(WAIT_S)
        assert forking[0].unwrap() == 0
        assert engine.retries == 0


def test_a_batch_whose_first_message_waits_within_every_server_timeout_is_not_cut(
    pg_url: str, migrated_schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DESIGN §8: "`StoreError` reaches a caller only after a bound, and never for a race".
    A batch's first message carries two statements - its sessions' locks (`ts_lock_all`)
    and its first operation's first statement - and the server bounds each on its own
    (statement_timeout per statement of a message, lock_timeout per lock wait). Here each
    lock wait is just under the lock timeout and each statement two of them, just under
    the statement timeout: nothing the server would end, the whole reply four waits. A
    reply watchdog of 1.5 statement timeouts (REPLY_BOUND_S once was 15 s: "the server ends
    any statement within 10 s") counts one wait as one statement, cuts it, and the batch -
    nothing wrong with it, only peers that held its locks a while - ends as StoreError.

    The server's bounds and the watchdog's are the code's, scaled down together (to 22%,
    their ratios kept) so that the waits take 4 s, not 18 s."""
    scale = 0.22
    for name in ("STATEMENT_TIMEOUT_MS", "LOCK_TIMEOUT_MS", "REPLY_BOUND_S"):
        monkeypatch.setattr(connections, name, getattr(connections, name) * scale)
    wait_s = 0.9 * connections.LOCK_TIMEOUT_MS / 1000  # 4.5 s unscaled
    assert 2 * wait_s < connections.STATEMENT_TIMEOUT_MS / 1000  # each statement: two waits
    assert 4 * wait_s > 1.5 * connections.STATEMENT_TIMEOUT_MS / 1000  # the reply: four
    sessions = ["w-a", "w-b", "w-c", "w-d"]

    def lock_two_more(tx: PgTx, session_id: str, others: list[str]) -> str:
        tx.lock_sessions(others)  # the first statement: sent with the batch's locks
        return session_id

    def nothing(tx: PgTx, session_id: str) -> str:
        tx.lock_session(session_id)
        return session_id

    with engine_at(pg_url, migrated_schema, 1.0) as engine, raw(pg_url, migrated_schema) as probe:
        keys = {s: probe.execute("SELECT ts_lock_key(%s)", (s,)).fetchall()[0][0] for s in sessions}
        # The batch's two sessions, then the operation's two, each pair in the lock order.
        first = sorted(sessions[:2], key=lambda s: (keys[s], s))
        second = sorted(sessions[2:], key=lambda s: (keys[s], s))
        holders = [
            psycopg.connect(pg_url, options=f"-c search_path={migrated_schema}") for _ in range(4)
        ]
        try:
            for conn, session in zip(holders, first + second, strict=True):
                conn.execute("SELECT pg_advisory_xact_lock(ts_lock_key(%s))", (session,))
            timers = [
                threading.Timer(wait_s * (index + 1), conn.commit)
                for index, conn in enumerate(holders)
            ]
            for timer in timers:
                timer.start()
            jobs = [
                _backend.Job(lock_two_more, (first[0], second)),
                _backend.Job(nothing, (first[1],)),
            ]
            engine.run_batch(jobs)
            for timer in timers:
                timer.join(WAIT_S)
            cut_and_retried = engine.retries
        finally:
            for conn in holders:
                conn.close()
    assert cut_and_retried == 0
    assert [job.error for job in jobs] == [None, None]
    assert [job.result for job in jobs] == [first[0], first[1]]


async def test_a_doorbell_locked_elsewhere_does_not_keep_max_active_spinning(
    pg_url: str, migrated_schema: str, clock: Any, autojump_clock: Any
) -> None:
    """max_active=1: the one place frees while the oldest waiting doorbell's session is
    locked by another transaction (a fork, a delete, an operator's). Its acquire answers at
    once without claiming, which frees the place again; the change scan must then go on to
    the next waiting session, not pick the locked one again and again (a hot loop of scans
    and acquires for as long as the lock is held, every other waiting session held back)."""
    drain = HoldsBusy()
    let_go, started = drain.let_go, drain.started

    store = PostgresStore(pg_url, schema=migrated_schema, inline=True)
    with trio.fail_after(600), raw(pg_url, migrated_schema) as holder:
        async with open_runtime(store, drain, clock=clock, max_active=1) as rt:
            await rt.wake("busy")
            await rt.wake("locked")  # no room: both wait, oldest first
            await rt.wake("next")
            await trio.testing.wait_all_tasks_blocked()
            assert started == ["busy"]
            _hold_session_lock(holder, "locked")
            sent = rt.statistics().store.transactions
            let_go.set()
            # Scheduler rounds, not virtual time: a hot loop never lets the clock jump.
            for _ in range(500):
                if "next" in started:
                    break
                await trio.lowlevel.checkpoint()
            spent = rt.statistics().store.transactions - sent
            assert started == ["busy", "next"], f"{spent} transactions meanwhile"
            assert spent < 20
            holder.execute("ROLLBACK")
            while "locked" not in started:  # at the change loop's fallback look, at most
                await trio.sleep(0.1)
