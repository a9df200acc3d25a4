"""PostgreSQL: an operation that held a session's lock and ended without claiming or
signalling the session still lets a worker's acquire that met the lock claim at once.

An acquire from a doorbell that meets a session lock answers 'busy' (`ts_acquire`) and its
runtime passes over that doorbell until a signal names the session: the lock's holder was to
claim it or signal it once done. Each test holds one such operation - its locks held, in a
thread, on an engine of its own: in its transaction once it ran, or inside its call, after
its locks - while a worker opens, finds the session's doorbell and answers busy; then lets
it end, and the worker's drain must start at once, not at its fallback poll (2 s; DESIGN
§7: p99 50 ms)."""

from __future__ import annotations

import contextlib
import threading
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import psycopg
import pytest
import trio
from helpers import pg_engine_at as engine_at
from helpers import pg_raw as raw

from trio_sessions import LeaseLost, SessionBusy, _codec, _store, _transcript, open_runtime
from trio_sessions._backend import Job
from trio_sessions._loops import CHANGE_FALLBACK_POLL
from trio_sessions._postgres import PgEngine, PostgresStore, run_op
from trio_sessions._store import control
from trio_sessions._store.transcript import Known

WAIT_S = 30.0  # a bound on each gate, never reached when the test passes
QUESTION = '{"text": "q"}'


def waiting(engine: PgEngine, pg_url: str, pg_schema: str) -> None:
    """A message waiting for a worker: input q1, the doorbell set, no claim."""
    run_op(engine, _store.submit, "s", QUESTION, "q1")


def waiting_beside_a_rejected_input(engine: PgEngine, pg_url: str, pg_schema: str) -> None:
    waiting(engine, pg_url, pg_schema)
    with raw(pg_url, pg_schema) as conn:
        conn.execute(
            "INSERT INTO session_input_rejected(id, session_id, seq, payload, reason,"
            " time_created) VALUES ('bad', 's', 7, 'not json', 'malformed', 0)"
        )


def idle(engine: PgEngine, pg_url: str, pg_schema: str) -> None:
    """An idle session (no input, no doorbell) a purge will find - and then find busy."""
    with raw(pg_url, pg_schema) as conn:
        conn.execute("INSERT INTO session(id, time_created) VALUES ('s', 0)")


def zombie_left_behind(engine: PgEngine, pg_url: str, pg_schema: str) -> None:
    """Execution z of owner `zombie` claimed the session and began message m; its claim
    is gone since (deleted here, as recovery's release of it leaves it); a new message
    waits for a worker: the doorbell set, no claim."""
    waiting(engine, pg_url, pg_schema)
    run_op(engine, _store.acquire, "s", "z", "zombie", 60_000)
    run_op(engine, _store.begin_assistant, "s", "z", "zombie", "m")
    with raw(pg_url, pg_schema) as conn:
        conn.execute("DELETE FROM session_execution WHERE id = 'z'")
    run_op(engine, _store.submit, "s", '{"text": "q2"}', "q2")


OPERATIONS = [
    # A client's retried POST of a message already stored: 'known', nothing written.
    pytest.param(waiting, _store.submit, ("s", QUESTION, "q1"), "q1", id="retried-submit"),
    # submit(on_busy="reject") refused for the message waiting untaken.
    pytest.param(
        waiting,
        _store.submit_controlled,
        ("s", '{"text": "r"}', "q2", "reject"),
        SessionBusy,
        id="rejected-submit",
    ),
    # resume of a session that is not paused: left as it is.
    pytest.param(waiting, _store.resume, ("s",), False, id="resume-not-paused"),
    # An operator drops another input of the session, one set aside earlier.
    pytest.param(
        waiting_beside_a_rejected_input,
        _store.drop_rejected_input,
        ("bad",),
        "s",
        id="drop-rejected-input",
    ),
    # A truncate with nothing after the seq to delete (the question is an input still).
    pytest.param(waiting, _store.truncate, ("s", 5), 0, id="truncate-nothing"),
    # A purge that found the session idle, then - under its lock - an input it got meanwhile.
    pytest.param(idle, _store.purge_batch, (0, "", 10), ([], None), id="purge-skips"),
    # A zombie's read-back under its claim fence, refused (LeaseLost): its statement's lock
    # (`tx.lock_session`) is signalled by the engine's refusal.
    pytest.param(
        zombie_left_behind,
        _store.inputs_taken_by,
        ("s", "z", "zombie", 0),
        LeaseLost,
        id="zombie-read-back",
    ),
]


async def wait_after_it_ended(
    pg_url: str,
    pg_schema: str,
    end: Callable[[], None],
    running: threading.Thread,
    job: Job,
    answer: Any,
) -> float:
    """How long after the operation `running` holds (its locks taken, the session's
    message waiting) ended a worker's drain started: the worker opens, its acquire meets
    the lock and answers busy (the doorbell passed over); then `end` lets the operation
    end, which answers `answer` (a value, or the type of its error)."""
    started = trio.Event()

    async def drain(ctx: Any) -> None:
        started.set()
        await ctx.take_inputs()

    store = PostgresStore(pg_url, schema=pg_schema)
    async with open_runtime(store, drain, recovery_interval=3600) as worker:
        with trio.fail_after(WAIT_S):
            while "s" not in worker._passed_over:  # its acquire answered busy
                await trio.sleep(0.001)
        assert not started.is_set()
        end()
        await trio.to_thread.run_sync(running.join, WAIT_S)
        if isinstance(answer, type):
            assert isinstance(job.error, answer), job.error
        else:
            assert job.unwrap() == answer
        ended_at = trio.current_time()
        with trio.fail_after(WAIT_S):
            await started.wait()
        waited = trio.current_time() - ended_at
        await worker.wait_idle("s")
    return waited


@pytest.mark.parametrize(("prepare", "op", "args", "answer"), OPERATIONS)
async def test_an_acquire_that_met_an_operation_holding_the_lock_claims_once_it_ended(
    pg_url: str,
    pg_schema: str,
    monkeypatch: pytest.MonkeyPatch,
    prepare: Callable[[PgEngine, str, str], None],
    op: Callable[..., Any],
    args: tuple[Any, ...],
    answer: Any,
) -> None:
    """Each of these held the session lock and ended with no claim and no signal of the
    session (a retried submit answered 'known', a reject answered 'busy', a resume found
    nothing paused, a truncate nothing to delete, a drop and a skipping purge wrote nothing
    of the session's doorbell),
    so the worker whose acquire met the lock passed the doorbell over until its fallback
    poll: the user's message waited 2 s for its answer to start. Each is held here in a
    transaction once it ran - a server-side function's lock is then held to the COMMIT
    too; alone, the same function runs in autocommit and holds it for its call."""
    ran, go = threading.Event(), threading.Event()
    looked, submitted = threading.Event(), threading.Event()

    def held(tx: Any, *arguments: Any) -> Any:
        try:
            return op(tx, *arguments)
        finally:
            ran.set()
            assert go.wait(WAIT_S), "the gate was never opened"

    idle_sessions = control._idle_sessions

    def looking(tx: Any, session_ids: Any, cutoff: int) -> list[str]:
        found = idle_sessions(tx, session_ids, cutoff)
        if not looked.is_set():  # its first look, before its locks: an input arrives
            looked.set()
            assert submitted.wait(WAIT_S), "the input was never submitted"
        return found

    monkeypatch.setattr(control, "_idle_sessions", looking)
    with engine_at(pg_url, pg_schema, 1.0) as operator, engine_at(pg_url, pg_schema, 1.0) as web:
        prepare(web, pg_url, pg_schema)
        job = Job(held, args)
        running = threading.Thread(target=operator.run_batch, args=([job],), daemon=True)
        running.start()
        try:
            if op is _store.purge_batch:
                await trio.to_thread.run_sync(looked.wait, WAIT_S)
                waiting(web, pg_url, pg_schema)
                submitted.set()
            await trio.to_thread.run_sync(ran.wait, WAIT_S)
            waited = await wait_after_it_ended(pg_url, pg_schema, go.set, running, job, answer)
        finally:
            go.set()
            submitted.set()
            running.join(WAIT_S)
    assert waited < CHANGE_FALLBACK_POLL / 4, f"the drain started {waited:.2f} s after it ended"


@pytest.mark.parametrize(
    ("op", "args", "answer"),
    [
        pytest.param(_store.submit, ("s", QUESTION, "q1"), "q1", id="retried-submit"),
        pytest.param(
            _store.submit_controlled,
            ("s", '{"text": "r"}', "q2", "reject"),
            SessionBusy,
            id="rejected-submit",
        ),
    ],
)
async def test_an_acquire_that_met_a_call_in_autocommit_holding_the_lock_claims_once_it_ended(
    pg_url: str, pg_schema: str, op: Callable[..., Any], args: tuple[Any, ...], answer: Any
) -> None:
    """As above, for the path these take alone: one call in autocommit (`ts_submit`,
    `ts_submit_controlled`), which holds the session lock for the call. It is held inside
    the call, after its lock, by the table its input check reads next
    (`session_input_rejected`, which a worker's look and acquire do not read) locked by
    another transaction."""
    with engine_at(pg_url, pg_schema, 1.0) as web, raw(pg_url, pg_schema) as gate:
        waiting(web, pg_url, pg_schema)
        gate.execute("BEGIN")
        gate.execute("LOCK TABLE session_input_rejected IN ACCESS EXCLUSIVE MODE")
        job = Job(op, args)
        running = threading.Thread(target=web.run_batch, args=([job],), daemon=True)
        running.start()
        try:
            with trio.fail_after(WAIT_S):
                while not gate.execute(  # the call waits for the table, its lock held
                    "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE NOT granted"
                    " AND relation = 'session_input_rejected'::regclass)"
                ).fetchone()[0]:  # type: ignore[index]
                    await trio.sleep(0.001)

            def end() -> None:
                gate.execute("COMMIT")

            waited = await wait_after_it_ended(pg_url, pg_schema, end, running, job, answer)
        finally:
            if gate.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
                gate.execute("COMMIT")
            running.join(WAIT_S)
    assert waited < CHANGE_FALLBACK_POLL / 4, f"the drain started {waited:.2f} s after it ended"


# A zombie: a runtime whose claim ended without it (taken over and released, say) writes
# on. Its functions take the session lock, find no claim of its execution and answer
# lease_lost. The gate holds such a call after its lock, as the functions read the clock
# right after their locks (`ts_now`): the zombie's connections only (application_name).
# Its advisory key is the schema's: xdist workers on one server never share a gate.
_GATED_CLOCK = """
CREATE OR REPLACE FUNCTION ts_now(p_now bigint) RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    IF current_setting('application_name') = 'zombie' THEN
        PERFORM pg_advisory_xact_lock_shared({classid}, {objid});
    END IF;
    RETURN COALESCE(p_now, floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint);
END $$;
"""


@attrs.frozen
class ZombieGate:
    """The gate's connection, which holds the gate; its key; the zombie's thread."""

    conn: psycopg.Connection[Any]
    key: tuple[int, int]
    running: threading.Thread

    async def reached(self) -> None:
        """Until the zombie's call waits for the gate (its own locks held)."""
        with trio.fail_after(WAIT_S):
            while not self.conn.execute(
                "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE NOT granted"
                " AND locktype = 'advisory' AND classid = %s AND objid = %s)",
                self.key,
            ).fetchone()[0]:  # type: ignore[index]
                await trio.sleep(0.001)

    def let_go(self) -> None:
        self.conn.execute("SELECT pg_advisory_unlock(%s, %s)", self.key)


_ZOMBIE = ("s", "z", "zombie")
_KNOWN = Known(_transcript.EMPTY, (), 0, _codec.encode_assistant(_transcript.EMPTY))


def _unchanged(data: Any) -> Any:
    return data


ZOMBIE_WRITES = [
    # Alone, each of these is one call in autocommit:
    pytest.param(_store.append_assistant_text, (*_ZOMBIE, "m", "tok", 0), id="append"),
    pytest.param(_store.begin_assistant, (*_ZOMBIE, "m2"), id="begin-assistant"),
    pytest.param(
        _store.update_assistant, (*_ZOMBIE, "m", _unchanged, _KNOWN), id="update-from-known"
    ),
    pytest.param(_store.end_iteration, _ZOMBIE, id="end-iteration"),
    pytest.param(_store.mark_cancelling, _ZOMBIE, id="mark-cancelling"),
    # ... and these a call in a transaction, which is rolled back:
    pytest.param(_store.append_assistant_text, (*_ZOMBIE, "m", "tok"), id="append-unversioned"),
    pytest.param(_store.update_assistant, (*_ZOMBIE, "m", _unchanged), id="update-read"),
    pytest.param(_store.take_inputs, _ZOMBIE, id="take-inputs"),
    pytest.param(_store.finish_failed, (*_ZOMBIE, "boom"), id="finish-failed"),
    pytest.param(_store.finish_interrupted, _ZOMBIE, id="finish-interrupted"),
]


@contextlib.contextmanager
def zombie_held_at_the_gate(pg_url: str, pg_schema: str, job: Job) -> Iterator[ZombieGate]:
    """The zombie left behind (`zombie_left_behind`), its `job` running in a thread as its
    engine runs it alone, held by the gate after its locks (`_GATED_CLOCK`). On exit the
    gate lets go and the thread is joined."""
    zombie_url = psycopg.conninfo.make_conninfo(pg_url, application_name="zombie")
    key = (54, zlib.crc32(pg_schema.encode()) & 0x7FFFFFFF)
    with (
        engine_at(pg_url, pg_schema, 1.0) as web,
        engine_at(zombie_url, pg_schema, 1.0) as zombie,
        raw(pg_url, pg_schema) as conn,
    ):
        zombie_left_behind(web, pg_url, pg_schema)
        conn.execute(_GATED_CLOCK.format(classid=key[0], objid=key[1]))
        conn.execute("SELECT pg_advisory_lock(%s, %s)", key)
        running = threading.Thread(target=zombie.run_batch, args=([job],), daemon=True)
        running.start()
        try:
            yield ZombieGate(conn, key, running)
        finally:
            conn.execute("SELECT pg_advisory_unlock_all()")
            running.join(WAIT_S)


@pytest.mark.parametrize(("op", "args"), ZOMBIE_WRITES)
async def test_an_acquire_that_met_a_zombies_write_claims_once_it_was_refused(
    pg_url: str, pg_schema: str, op: Callable[..., Any], args: tuple[Any, ...]
) -> None:
    """A zombie's write took the session lock, found its claim gone and answered
    lease_lost - and signalled nothing, so the worker whose acquire met the lock passed the
    doorbell over until its fallback poll: the waiting message's answer started 2 s late.
    Each write runs as the engine runs it alone (one call in autocommit, or a transaction
    rolled back on its LeaseLost), held by the gate after its lock."""
    job = Job(op, args)
    with zombie_held_at_the_gate(pg_url, pg_schema, job) as gate:
        await gate.reached()
        waited = await wait_after_it_ended(
            pg_url, pg_schema, gate.let_go, gate.running, job, LeaseLost
        )
    assert waited < CHANGE_FALLBACK_POLL / 4, f"the drain started {waited:.2f} s after it ended"


async def test_a_zombies_heartbeat_holds_no_lock_an_acquire_meets(
    pg_url: str, pg_schema: str
) -> None:
    """A heartbeat locks its claims' rows, never a session's lock (`ts_heartbeat`): a
    zombie's, its claim gone, holds nothing a worker's acquire meets, so nothing is owed a
    signal - the worker claims while the heartbeat is still held after its locks."""
    started = trio.Event()

    async def drain(ctx: Any) -> None:
        started.set()
        await ctx.take_inputs()

    job = Job(_store.heartbeat, ("zombie", ["z"], 60_000))
    with zombie_held_at_the_gate(pg_url, pg_schema, job) as gate:
        await gate.reached()
        store = PostgresStore(pg_url, schema=pg_schema)
        async with open_runtime(store, drain, recovery_interval=3600) as worker:
            with trio.fail_after(WAIT_S):
                await started.wait()
            assert "s" not in worker._passed_over
            assert gate.running.is_alive()  # still held
            await worker.wait_idle("s")
        gate.let_go()
        await trio.to_thread.run_sync(gate.running.join, WAIT_S)
        assert job.unwrap() == {"z": None}  # lost
