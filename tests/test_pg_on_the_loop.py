"""A lone autocommit call on the trio thread (`_postgres.onloop`): an idle lane's connection
driven without blocking, no hand-off to its worker thread - and what the loop does not
settle goes to the worker as the engine's own autocommit call would have left it: a call
refused for a transaction runs in one (once, not as a second call), a call whose connection
was lost is read back and lands once, and a caller cancelled while its call waits for a
lock is withdrawn with nothing written."""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import psycopg
import pytest
import trio
import trio.testing
from helpers import pg_raw, terminate_on

from trio_sessions import _codec, _store, _transcript
from trio_sessions import _observe as events
from trio_sessions._backend import StoreStatistics, Tx, autocommit_when_alone
from trio_sessions._bench.load import StepMeter
from trio_sessions._decisions import IterationVerdict
from trio_sessions._model import ToolPart
from trio_sessions._postgres import PgThreadExecutor, PgTx, PostgresStore, onloop

WAIT_S = 30.0  # a bound on each wait below, never reached when the test passes
LEASE_MS = 30_000
STALL_S = 0.050  # DESIGN §6.26: no event-loop stall above 50 ms from the library


@pytest.fixture
def pg_store(pg_url: str, migrated_schema: str) -> PostgresStore:
    return PostgresStore(pg_url, schema=migrated_schema, writers=1, listen=False)


@asynccontextmanager
async def _executor(store: PostgresStore) -> AsyncIterator[PgThreadExecutor]:
    async with store.open_executor(None) as executor:
        assert isinstance(executor, PgThreadExecutor)
        # Its lanes' pumps, started just now, are runnable until they first wait.
        await trio.testing.wait_all_tasks_blocked()
        yield executor


@contextmanager
def _control_and_holder(
    store: PostgresStore,
) -> Iterator[tuple[psycopg.Connection[Any], psycopg.Connection[Any]]]:
    """Within `WAIT_S`: a connection to look with, and one to hold a session's lock with."""
    with (
        trio.fail_after(WAIT_S),
        pg_raw(store.url, store.schema) as control,
        pg_raw(store.url, store.schema) as holder,
    ):
        yield control, holder


def _figures(executor: PgThreadExecutor) -> tuple[int, int, int]:
    """Calls on the loop, hand-offs to the worker, transactions (loop calls included)."""
    store: StoreStatistics = executor.statistics()
    return store.inline_runs, store.handoffs, store.transactions


def _inputs(conn: psycopg.Connection[Any]) -> list[tuple[Any, ...]]:
    return conn.execute("SELECT session_id, id FROM session_input ORDER BY id").fetchall()


def _take_session_lock(conn: psycopg.Connection[Any], session_id: str) -> None:
    """Hold `session_id`'s advisory lock in an open transaction on `conn`, as another
    process's store call does while it runs: every function of the store takes it first."""
    conn.execute("BEGIN")
    conn.execute("SELECT pg_advisory_xact_lock(ts_lock_key(%s))", (session_id,))


async def _until_it_waits_for_a_lock(control: psycopg.Connection[Any], pid: int | None) -> None:
    assert pid is not None
    waiting = "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s"
    while control.execute(waiting, (pid,)).fetchone() != ("Lock",):
        await trio.sleep(0.01)


async def test_a_lone_call_runs_on_the_loop_and_calls_started_together_share_a_hand_off(
    pg_store: PostgresStore,
) -> None:
    """A call alone, on an idle lane, with no other task runnable runs on the trio thread:
    no hand-off. Of calls started together, the first to run goes on the loop (trio counts
    as runnable only the tasks of its next batch, not those of the batch running now: as
    for SQLite's lone caller) and the others, queued behind it, share one hand-off."""
    with trio.fail_after(WAIT_S), pg_raw(pg_store.url, pg_store.schema) as control:
        async with _executor(pg_store) as executor:
            stored = await executor.run(_store.submit, "s", '{"n": 1}', "in-1")
            assert stored == "in-1"
            assert _figures(executor) == (1, 0, 1)

            async def submit(number: int) -> None:
                await executor.run(_store.submit, f"t{number}", '{"n": 2}', f"in-t{number}")

            async with trio.open_nursery() as nursery:
                for number in range(3):
                    nursery.start_soon(submit, number)
            loop_calls, handoffs, _ = _figures(executor)
            assert (loop_calls, handoffs) == (2, 1)
        assert [row[1] for row in _inputs(control)] == ["in-1", "in-t0", "in-t1", "in-t2"]


async def test_a_call_refused_for_a_transaction_on_the_loop_runs_once_in_one(
    pg_store: PostgresStore,
) -> None:
    """An iteration whose session's doorbell is set continues: its call (`ts_finish`)
    refuses it on the loop, nothing written, and the worker runs it in a transaction at
    once - not as a second autocommit call refused again."""
    with trio.fail_after(WAIT_S):
        async with _executor(pg_store) as executor:
            args = ("s", '{"n": 1}', "in-1", "exec-1", "owner", LEASE_MS)
            await executor.run(_store.submit_and_acquire, *args)
            await executor.run(_store.wake, "s")
            before = _figures(executor)
            verdict = await executor.run(_store.end_iteration, "s", "exec-1", "owner")
            after = _figures(executor)
    assert verdict is IterationVerdict.CONTINUE
    # One call on the loop, one hand-off, two transactions: the call and the worker's.
    assert (after[0] - before[0], after[1] - before[1], after[2] - before[2]) == (1, 1, 2)


async def test_a_call_on_the_loop_whose_connection_is_killed_is_read_back_and_lands_once(
    pg_store: PostgresStore,
) -> None:
    """The lane's backend killed while its call on the loop waits for a session's lock:
    the call may have landed as far as the client knows, so the worker re-opens the
    connection and calls again with `retry`, which reads back whether it did - the input
    is stored once, and the caller is told its id."""
    with _control_and_holder(pg_store) as (control, holder):
        async with _executor(pg_store) as executor:
            engine = executor.engine
            killed = engine.backend_pid
            assert killed is not None
            _take_session_lock(holder, "s")
            stored: list[str] = []

            async def submit() -> None:
                stored.append(await executor.run(_store.submit, "s", '{"n": 1}', "in-1"))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(submit)
                await _until_it_waits_for_a_lock(control, killed)
                terminate_on(control, killed)
                holder.execute("COMMIT")
            assert stored == ["in-1"]
            assert engine.backend_pid != killed
            assert engine.reconnects == 1
            loop_calls, handoffs, _ = _figures(executor)
            assert (loop_calls, handoffs) == (1, 1)
        assert _inputs(control) == [("s", "in-1")]


async def test_a_caller_cancelled_while_its_call_on_the_loop_waits_for_a_lock_is_withdrawn(
    pg_store: PostgresStore,
) -> None:
    """A caller cancelled while its call on the loop waits for a session's lock another
    connection holds goes on while the lock is still held: the statement is cancelled,
    nothing of it is written once the lock is freed, and the lane's next call runs on the
    same connection."""
    with _control_and_holder(pg_store) as (control, holder):
        async with _executor(pg_store) as executor:
            engine = executor.engine
            pid = engine.backend_pid
            _take_session_lock(holder, "s")
            async with trio.open_nursery() as nursery:
                cancelled = trio.CancelScope()

                async def submit() -> None:
                    with cancelled:
                        await executor.run(_store.submit, "s", '{"n": 1}', "in-1")
                    nursery.cancel_scope.cancel()  # what follows never runs: the test's end

                nursery.start_soon(submit)
                await _until_it_waits_for_a_lock(control, pid)
                cancelled.cancel()
                await trio.sleep_forever()
            assert cancelled.cancelled_caught
            waiting = "SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
            assert control.execute(waiting).fetchall() == [], "the cancelled call still waits"
            holder.execute("COMMIT")
            await executor.run(_store.submit, "t", '{"n": 2}', "in-2")
            assert engine.backend_pid == pid and engine.reconnects == 0
            assert _figures(executor)[:2] == (2, 0)
        assert _inputs(control) == [("t", "in-2")]


@autocommit_when_alone
def _submit_then_decode(tx: Tx, session_id: str, input_id: str, text: str) -> int:
    """A submit (one call) whose caller then decodes `text`; the thread it decoded on."""
    _store.submit(tx, session_id, '{"n": 1}', input_id)
    _codec.loads(text)
    return threading.get_ident()


async def test_a_call_on_the_loop_over_the_loops_budget_is_read_back_in_the_worker(
    pg_store: PostgresStore,
) -> None:
    """A call on the loop whose reply holds more than the loop may decode (DESIGN §6.26,
    `_codec.loop_budget`) is not decoded there: its write landed, so the worker calls
    again with `retry`, which reads back what it did - the input is stored once, and its
    caller gets the worker's answer, decoded off the loop."""
    big = _codec.dumps([[] for _ in range(_codec.LOOP_BUDGET_UNITS // 3 + 1)])
    loop = threading.get_ident()
    with trio.fail_after(WAIT_S), pg_raw(pg_store.url, pg_store.schema) as control:
        async with _executor(pg_store) as executor:
            assert await executor.run(_submit_then_decode, "s", "in-1", "[]") == loop
            assert _figures(executor)[:2] == (1, 0)
            assert await executor.run(_submit_then_decode, "t", "in-2", big) != loop
            assert _figures(executor)[:2] == (2, 1)
        assert _inputs(control) == [("s", "in-1"), ("t", "in-2")]


async def test_a_call_the_loop_leaves_to_the_worker_runs_before_the_sessions_next_operation(
    pg_store: PostgresStore,
) -> None:
    """A session's operations run in the order they were queued, also when the first ran on
    the loop and left its call to the worker (here: its connection killed while it waited
    for the session's lock, so it is read back with `retry`): the session's next operation,
    queued behind the call on the loop meanwhile, runs after it, not before."""
    with _control_and_holder(pg_store) as (control, holder):
        async with _executor(pg_store) as executor:
            killed = executor.engine.backend_pid
            assert killed is not None
            _take_session_lock(holder, "s")
            stored: list[str] = []

            async def submit(input_id: str) -> None:
                stored.append(await executor.run(_store.submit, "s", '{"n": 1}', input_id))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(submit, "in-1")
                await _until_it_waits_for_a_lock(control, killed)
                nursery.start_soon(submit, "in-2")
                await trio.testing.wait_all_tasks_blocked()  # queued behind the call
                assert _figures(executor)[:2] == (1, 0)
                terminate_on(control, killed)
                holder.execute("COMMIT")
            assert sorted(stored) == ["in-1", "in-2"]
        by_seq = "SELECT id FROM session_input WHERE session_id = 's' ORDER BY seq"
        assert control.execute(by_seq).fetchall() == [("in-1",), ("in-2",)]


async def test_a_call_on_the_loop_refused_while_the_executor_closes_runs_before_it_closes(
    pg_store: PostgresStore,
) -> None:
    """The executor closing waits for a call on the loop in flight, and for what that call
    leaves to the worker: a call the server refuses for a transaction (nothing written)
    runs in one before the lane stops and its caller is answered - not queued on a closed
    lane, where nothing ever runs it and its caller waits for ever."""
    with _control_and_holder(pg_store) as (control, holder):
        verdicts: list[IterationVerdict] = []
        async with trio.open_nursery() as nursery, _executor(pg_store) as executor:
            pid = executor.engine.backend_pid
            args = ("s", '{"n": 1}', "in-1", "exec-1", "owner", LEASE_MS)
            await executor.run(_store.submit_and_acquire, *args)
            await executor.run(_store.wake, "s")  # so `ts_finish` refuses the call
            _take_session_lock(holder, "s")

            async def end() -> None:
                ended = await executor.run(_store.end_iteration, "s", "exec-1", "owner")
                verdicts.append(ended)

            async def release() -> None:
                await trio.testing.wait_all_tasks_blocked()  # closing, waiting for the call
                assert all(lane.closed for lane in executor._lanes)
                holder.execute("COMMIT")

            nursery.start_soon(end)
            await _until_it_waits_for_a_lock(control, pid)
            nursery.start_soon(release)
        assert verdicts == [IterationVerdict.CONTINUE]


async def test_a_write_on_no_session_goes_to_an_idle_lane_not_behind_a_call_on_the_loop(
    pg_url: str, migrated_schema: str
) -> None:
    """A write on no session (a heartbeat) goes to the least busy lane: a lane whose call
    on the loop waits for a session's lock is busy, so the heartbeat runs on the idle lane
    at once - not behind that call, until the lock is freed or its `lock_timeout`."""
    store = PostgresStore(pg_url, schema=migrated_schema, writers=2, listen=False)
    with _control_and_holder(store) as (control, holder):
        async with _executor(store) as executor:
            first, second = executor.engines
            _take_session_lock(holder, "s")
            async with trio.open_nursery() as nursery:
                nursery.start_soon(executor.run, _store.submit, "s", '{"n": 1}', "in-1")
                await _until_it_waits_for_a_lock(control, first.backend_pid)
                renewed = await executor.run(_store.heartbeat, "owner", ["exec-1"], LEASE_MS)
                assert renewed == {"exec-1": None}
                assert (first.transactions, second.transactions) == (1, 1)
                holder.execute("COMMIT")
        assert _inputs(control) == [("s", "in-1")]


async def test_a_call_on_the_loop_whose_connection_was_lost_counts_and_logs_its_retry(
    pg_store: PostgresStore, caplog: pytest.LogCaptureFixture
) -> None:
    """A call on the loop whose connection turns out lost, run again by the worker, is a
    retry as the engine's own autocommit call's would be: counted in
    `StoreStatistics.retries` and logged (`store transaction retried: connection lost`)."""
    caplog.set_level(logging.INFO, logger="trio_sessions")
    with trio.fail_after(WAIT_S), pg_raw(pg_store.url, pg_store.schema) as control:
        async with _executor(pg_store) as executor:
            killed = executor.engine.backend_pid
            assert killed is not None
            terminate_on(control, killed)  # idle: the client learns it with its next call
            assert await executor.run(_store.submit, "s", '{"n": 1}', "in-1") == "in-1"
            store = executor.statistics()
        assert _inputs(control) == [("s", "in-1")]
    assert (store.inline_runs, store.handoffs, store.reconnects) == (1, 1, 1)
    assert store.retries == 1
    [retry] = [record for record in caplog.records if record.msg == events.STORE_RETRY]
    assert retry.getMessage() == "store transaction retried: connection lost"


@pytest.mark.serial
async def test_a_lone_read_of_a_long_transcript_never_stalls_the_loop(
    pg_store: PostgresStore,
) -> None:
    """A lone `read_transcript` of a 20,000-message session (DESIGN §6.26): its call runs
    on the loop, but its reply is not fetched and decoded there: one task step of 100-150 ms
    of CPU fetched the rows and decoded message after message (each small, so `loads`
    charged the loop's budget little for each) until the budget ran out, and the worker
    read it all again. Real time (CPU)."""
    count = 20_000
    with trio.fail_after(WAIT_S), pg_raw(pg_store.url, pg_store.schema) as control:
        control.execute("INSERT INTO session(id, time_created) VALUES ('big', 0)")
        with control.cursor() as cursor:
            cursor.executemany(
                "INSERT INTO session_message(id, session_id, role, seq, data, time_created,"
                " time_updated, finished) VALUES (%s, 'big', 'user', %s, %s, 0, 0, 1)",
                [
                    (f"m{seq:08d}", seq, _codec.dumps({"text": str(seq)}))
                    for seq in range(1, count + 1)
                ],
            )
        async with _executor(pg_store) as executor:
            with StepMeter() as meter:
                messages = await executor.read(_store.read_transcript, "big")
                await trio.lowlevel.checkpoint()  # the read's last step ends in the meter
            assert _figures(executor)[:2] == (1, 1)  # called on the loop, read in the worker
    assert [message.seq for message in messages] == list(range(1, count + 1))
    assert meter.longest_cpu < STALL_S, meter.longest_cpu


@pytest.mark.parametrize("kind", ["read", "write"])
async def test_a_call_on_the_loop_cut_by_the_reply_watchdog_fails_then_not_a_reconnect_later(
    pg_url: str, migrated_schema: str, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """DESIGN §8 (a reply not come within `REPLY_BOUND_S`: the connection counts as lost
    and the call fails with `StoreError`): a lone call on the loop when the server stops
    answering, its connection kept up, fails once the reply watchdog cuts its wait - a
    read with `StoreError`, a write with `OutcomeUnknown` - as the worker's call does (the
    server did not answer in its hand-off: nothing more is tried there), not after the
    worker re-opened the connection for up to `RECONNECT_PATIENCE_S` more, a connect
    timeout per attempt, against a server that accepts TCP and never answers."""
    from test_worker import HangingProxy

    from trio_sessions._errors import OutcomeUnknown, StoreError
    from trio_sessions._postgres import connections
    from trio_sessions._postgres.engine import RECONNECT_PATIENCE_S

    monkeypatch.setattr(connections, "REPLY_BOUND_S", 2.0)  # waited out: short here
    proxy = HangingProxy.to(pg_url)
    with trio.fail_after(WAIT_S):
        async with trio.open_nursery() as nursery:
            await proxy.serve(nursery)
            store = PostgresStore(
                proxy.url(pg_url), schema=migrated_schema, writers=1, listen=False
            )
            async with _executor(store) as executor:

                async def call(input_id: str) -> Any:
                    if kind == "read":
                        return await executor.read(_store.read_transcript, "s")
                    return await executor.run(_store.submit, "s", '{"n": 1}', input_id)

                await call("in-1")
                proxy.stall()
                started = time.monotonic()
                with pytest.raises(StoreError) as raised:
                    await call("in-2")
                elapsed = time.monotonic() - started
                assert _figures(executor)[0] == 2  # both on the loop
            nursery.cancel_scope.cancel()
    # A write's call may have landed; a read leaves nothing unknown.
    assert isinstance(raised.value, OutcomeUnknown) == (kind == "write")
    bound = connections.REPLY_BOUND_S + RECONNECT_PATIENCE_S / 2
    assert elapsed < bound, f"StoreError after {elapsed:.1f} s"


async def test_an_operation_given_an_iterator_renews_what_it_names_alone(
    pg_store: PostgresStore,
) -> None:
    """A call on the loop runs its operation twice (recording its statement, then reading
    its reply), so an argument read only once - an iterator - would be empty the second
    time: a heartbeat given one renewed the claim and answered `{}`. Such a call goes to
    the worker, which runs the operation once, as before."""
    with trio.fail_after(WAIT_S):
        async with _executor(pg_store) as executor:
            args = ("s", '{"n": 1}', "in-1", "exec-1", "owner", LEASE_MS)
            await executor.run(_store.submit_and_acquire, *args)
            renewed = await executor.run(_store.heartbeat, "owner", iter(["exec-1"]), LEASE_MS)
            assert renewed == {"exec-1": "running"}
            assert _figures(executor)[:2] == (1, 1)


def test_a_psycopg_without_the_execute_generator_as_called_runs_every_call_in_the_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The loop drives psycopg's private generator of a cursor's execute: a psycopg whose
    generator is gone, or takes other arguments, is no error - every call goes to the
    worker, as before the loop path."""
    assert onloop._drivable()

    def other(self: object, query: object, *, prepare: object = None) -> None:
        raise AssertionError("never called")

    monkeypatch.setattr(psycopg.Cursor, "_execute_gen", other)
    assert not onloop._drivable()
    for klass in psycopg.Cursor.__mro__:
        if "_execute_gen" in vars(klass):
            monkeypatch.delattr(klass, "_execute_gen")
    assert not onloop._drivable()


async def test_a_tool_settled_on_the_loop_while_a_reader_edits_its_input_settles_once(
    pg_store: PostgresStore,
) -> None:
    """A call on the loop runs its operation twice, its statement's reply awaited between:
    a reader that edits the tool input it was shown meanwhile (`Known`: the writer's data
    is written from only while it still encodes as stored) made the second run take the
    read path, which needs a transaction - so the worker applied the settlement again onto
    the message the first run's call had already settled: `DuplicateSettlement` for a
    settlement that landed once. The caller gets the settlement that landed, as from the
    worker, whose operation runs once."""
    claim = ("s", "exec-1", "owner", "m1")
    start = functools.partial(_transcript.start_tool, call_id="c1", name="echo", input={"x": 1})
    settle = functools.partial(_transcript.settle_tool, call_id="c1", output={"ok": 1})
    with _control_and_holder(pg_store) as (control, holder):
        async with _executor(pg_store) as executor:
            args = ("s", '{"n": 1}', "in-1", "exec-1", "owner", LEASE_MS)
            await executor.run(_store.submit_and_acquire, *args)
            await executor.run(_store.begin_assistant, *claim)
            data, version, _, text = await executor.run(_store.update_assistant, *claim, start)
            known = _store.Known(data, (), version, text)
            [tool] = [part for part in data.parts if isinstance(part, ToolPart)]
            _take_session_lock(holder, "s")
            settled: list[Any] = []

            async def update() -> None:
                settled.append(await executor.run(_store.update_assistant, *claim, settle, known))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(update)
                await _until_it_waits_for_a_lock(control, executor.engine.backend_pid)
                tool.input["x"] = 2  # a reader's edit of what it was shown
                holder.execute("COMMIT")
            [(after, settled_version, _, _)] = settled
            assert settled_version == version + 1
            [tool_after] = [part for part in after.parts if isinstance(part, ToolPart)]
            assert tool_after.status == "completed"
        stored = "SELECT version FROM session_message WHERE id = 'm1'"
        assert control.execute(stored).fetchone() == (version + 1,)


def _diverging(first: Callable[[Tx, str], object]) -> Callable[..., tuple[str, bool]]:
    """A made-up operation: `first` on its first run (the call on the loop); on its second,
    a statement that needs a transaction, sent before anything else; on any later one (the
    worker's), whether its calls read back (`retry`)."""

    @autocommit_when_alone
    def diverging(tx: Tx, session_id: str, runs: list[int]) -> tuple[str, bool]:
        runs.append(len(runs) + 1)
        if len(runs) == 1:
            first(tx, session_id)
        if len(runs) == 2:
            tx.execute("SELECT 1")
        assert isinstance(tx, PgTx)
        return "worker", tx.retry

    return diverging


def _submit(tx: Tx, session_id: str) -> None:
    _store.submit(tx, session_id, '{"n": 1}', "in-1")


def _call_what_the_server_refuses(tx: Tx, session_id: str) -> None:
    tx.call("ts_no_such_function", session_id)


_submit_then_diverge = _diverging(_submit)
_fail_then_diverge = _diverging(_call_what_the_server_refuses)


async def test_an_operation_whose_second_run_sends_another_statement_is_read_back(
    pg_store: PostgresStore,
) -> None:
    """A call on the loop reads its reply through the operation's second run, which must
    send first what the first run sent. One that does not (it raised `NeedsTransaction`
    before sending, here) says nothing about the call that ran: not "refused, nothing
    written", which would run it again in a transaction as a first call - the worker calls
    again with `retry`, reading back what the landed call did, as after a lost reply."""
    with trio.fail_after(WAIT_S), pg_raw(pg_store.url, pg_store.schema) as control:
        async with _executor(pg_store) as executor:
            runs: list[int] = []
            result = await executor.run(_submit_then_diverge, "s", runs)
            assert (result, runs) == (("worker", True), [1, 2, 3])
            assert _figures(executor)[:2] == (1, 1)
        assert _inputs(control) == [("s", "in-1")]


async def test_a_diverging_second_run_after_a_server_error_is_no_unknown_outcome(
    pg_store: PostgresStore,
) -> None:
    """A call on the loop that the server answered with an error wrote nothing: a second
    run that then does not send what the first sent leaves it to the worker as a first
    call, not as one whose reply was lost - whose read-back, should the server then be
    gone, would say `OutcomeUnknown` of a call whose outcome is known."""
    with trio.fail_after(WAIT_S):
        async with _executor(pg_store) as executor:
            runs: list[int] = []
            result = await executor.run(_fail_then_diverge, "s", runs)
            assert (result, runs) == (("worker", False), [1, 2, 3])
            assert executor.engine.reconnects == 0
            assert _figures(executor)[:2] == (1, 1)
