"""Which writer lane a PostgreSQL operation runs on (`PgThreadExecutor`).

At a light load every session's operations share the first lane: its batches are larger,
so a process commits (and notifies) less often, and fewer of the server's backends compete
for the host's cores - under the chat load, three lanes each committing one operation at a
time were slower than one lane. A session whose operations are queued or running stays on
their lane (they run in order, on one connection); a new one spills to the least busy lane
once the first lane holds four full hand-offs (`spill_at`). A hand-off's writes reply
before its reads run.
"""

from __future__ import annotations

import threading

import pytest
import trio
import trio.testing
from helpers import opened, pg_raw

from trio_sessions import _store
from trio_sessions._backend import Job, Tx
from trio_sessions._postgres import PgThreadExecutor, PostgresStore
from trio_sessions._postgres.executors import _Lane


def backend(tx: Tx, session_id: str) -> int:
    [pid] = tx.one("SELECT pg_backend_pid()")
    return int(pid)


def held_open(tx: Tx, session_id: str, gate: threading.Event) -> int:
    """An operation that keeps its lane busy until `gate` is set."""
    [pid] = tx.one("SELECT pg_backend_pid()")
    assert gate.wait(timeout=20)
    return int(pid)


async def test_at_a_light_load_every_session_shares_the_first_lane(
    pg_url: str, pg_schema: str
) -> None:
    store = PostgresStore(pg_url, schema=pg_schema, writers=3, listen=False)
    with trio.fail_after(30):
        async with store.open_executor(None) as executor:
            assert isinstance(executor, PgThreadExecutor)
            first = executor.engines[0].backend_pid
            pids = [await executor.run(backend, f"s{n}") for n in range(12)]
            together: list[int] = []

            async def one(session_id: str) -> None:
                together.append(await executor.run(backend, session_id))

            async with trio.open_nursery() as nursery:
                for n in range(12):
                    nursery.start_soon(one, f"t{n}")
    assert set(pids) == set(together) == {first}


async def test_a_busy_first_lane_spills_new_sessions_but_keeps_its_own(
    pg_url: str, pg_schema: str
) -> None:
    store = PostgresStore(pg_url, schema=pg_schema, writers=3, listen=False)
    gate = threading.Event()
    got: dict[str, int] = {}
    with trio.fail_after(30):
        async with store.open_executor(None) as executor:
            assert isinstance(executor, PgThreadExecutor)
            executor.spill_at = 1
            pids = [engine.backend_pid for engine in executor.engines]

            async def one(name: str, session_id: str) -> None:
                got[name] = await executor.run(held_open, session_id, gate)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(one, "a", "s-a")
                await trio.testing.wait_all_tasks_blocked()
                # "s-a" is running on the first lane: its next operation queues behind
                # it there; a new session goes to the least busy lane.
                nursery.start_soon(one, "a-again", "s-a")
                nursery.start_soon(one, "b", "s-b")
                await trio.testing.wait_all_tasks_blocked()
                nursery.start_soon(one, "c", "s-c")
                await trio.testing.wait_all_tasks_blocked()
                gate.set()
    assert got == {"a": pids[0], "a-again": pids[0], "b": pids[1], "c": pids[2]}


async def test_a_write_replies_before_the_reads_of_its_hand_off_run(
    pg_url: str, pg_schema: str
) -> None:
    """A hand-off runs its writes, then its reads: a write's caller goes on once its
    transaction committed, not after the reads queued beside it (under the chat load, a
    web process's submit waited up to 7 ms for stream reads it had nothing to do with)."""
    store = PostgresStore(pg_url, schema=pg_schema, writers=1, listen=False)
    busy, read_gate = threading.Event(), threading.Event()
    wrote = trio.Event()
    read: list[int] = []
    with trio.fail_after(30):
        async with store.open_executor(None) as executor, trio.open_nursery() as nursery:
            assert isinstance(executor, PgThreadExecutor)
            lane = executor.engines[0].backend_pid

            async def write() -> None:
                await executor.run(_store.wake, "s-write")
                wrote.set()

            async def held_read() -> None:
                read.append(await executor.read(held_open, "s-read", read_gate))

            nursery.start_soon(executor.run, held_open, "s-busy", busy)
            await trio.testing.wait_all_tasks_blocked()
            # Both queue behind the busy lane, so its next hand-off takes them together.
            nursery.start_soon(write)
            nursery.start_soon(held_read)
            await trio.testing.wait_all_tasks_blocked()
            busy.set()
            try:
                with trio.fail_after(10):
                    await wrote.wait()  # while the read of its hand-off still runs
                with pg_raw(pg_url, pg_schema) as conn:
                    woken = conn.execute("SELECT wakes FROM session WHERE id = 's-write'")
                    assert woken.fetchall() == [(1,)]  # committed, seen from elsewhere
                assert read == []
            finally:
                read_gate.set()
    assert read == [lane]


def pid_of_no_session(tx: Tx) -> int:
    """A write on no session (as a recovery pass's scan and takeover, a heartbeat)."""
    [pid] = tx.one("SELECT pg_backend_pid()")
    return int(pid)


async def test_a_write_on_no_session_goes_to_an_idle_lane_at_once(
    pg_url: str, pg_schema: str
) -> None:
    """A write on no session runs alone in any hand-off: on an idle lane it goes to the
    worker at once, not a trio pass later with the lane's pump (a pass a recovery's freshly
    started drains fill). With no pump running at all it completes; a session's write,
    which may share a batch with others started in the same pass, waits for the pump."""
    with opened(PostgresStore(pg_url, schema=pg_schema).engine()) as engine:
        lane = _Lane(engine)
        lane.start()
        try:
            with trio.fail_after(10):
                pid = await lane.submit(Job(pid_of_no_session, ()), "write")
            assert pid == engine.backend_pid
            with trio.move_on_after(0.5) as waited:  # real time: the worker would answer
                await lane.submit(Job(_store.wake, ("s",)), "write")
            assert waited.cancelled_caught
        finally:
            with trio.CancelScope(shield=True):
                await lane.close()


@pytest.mark.parametrize("writers", [-1, 0, 17, 2**63])
def test_a_writer_count_out_of_range_is_refused_naming_the_range(writers: int) -> None:
    """`writers` is 1 to 16 (README), and the error says so at either end - not "1 to
    2**63-1" below the range and "<= 16" above it; not "0 to 2**63-1" below zero."""
    with pytest.raises(ValueError, match=f"^writers must be 1 to 16, got {writers}$"):
        PostgresStore("postgresql://app@127.0.0.1:1/app", writers=writers)


@pytest.mark.parametrize("writers", [True, 2.0, "3"])
def test_a_writer_count_that_is_no_int_is_a_type_error(writers: object) -> None:
    with pytest.raises(TypeError, match=r"^writers must be an int"):
        PostgresStore("postgresql://app@127.0.0.1:1/app", writers=writers)  # type: ignore[arg-type]
