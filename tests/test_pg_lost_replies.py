"""Public writes on PostgreSQL when the connection is lost before, during or after their
COMMIT and the server stays unreachable past the engine's read-back bound (DESIGN §4, §5,
§5.1, §6.16, §6.19, §8 "Uncertain commits").

Each test loses the connection at one chosen statement through the engine's
`wrap_connection` seam (`test_pg_faults.Faults`). Past the read-back bound the engine
rightly answers StoreError ("the outcome of a COMMIT is unknown"); these tests check what
follows: the runtime's own reaction leaves a state recovery can finish, a drain's retry of
its write lands once (as on SQLite), and a read-back after a lost reply answers for the
lost call even when another process acted in between.

A lost submit's retry finds its input cancelled in between by the trace a cancel leaves
(`ts_cancel_input`) - a trace naming its own call (`Job.call_id`), never an earlier
call's of the same input id, whatever way the submit stores its input. A drain's own
call after `OutcomeUnknown` reads back what the lost call did (`_drain`);
`test_uncertain_writes` runs every such case on SQLite.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

import attrs
import psycopg
import pytest
import trio
from test_pg_faults import (
    LEASE_MS,
    OWNER,
    Faults,
    Mode,
    Plan,
    control_connection,
    environment,
    outcome_of,
)
from trio.testing import MockClock

from trio_sessions import DrainContext, StoreError, _postgres, _store, open_runtime
from trio_sessions import testing as ts_testing
from trio_sessions._backend import Job
from trio_sessions._postgres import PostgresStore


@attrs.define
class CommitPlan(Plan):
    """Fire at the next COMMIT only (a `match` of "COMMIT" would hit `BEGIN ISOLATION LEVEL
    READ COMMITTED` first)."""

    def hit(self, index: int, text: str) -> bool:
        return text == "COMMIT"


class UnreachableFor(Faults):
    """`Faults` whose `then_unreachable` lasts `for_s` seconds of real time: long enough for
    the engine to give up reading back the COMMIT (`RECONNECT_PATIENCE_S`), then the
    server answers again (as after a short network partition)."""

    def __init__(self, url: str, schema: str, control: psycopg.Connection[Any], for_s: float):
        super().__init__(url, schema, control)
        self.for_s = for_s
        self.until = 0.0

    def wrap(self, conn: psycopg.Connection[Any]) -> Any:
        if self.unreachable and not self.until:
            self.until = time.monotonic() + self.for_s
        if self.unreachable and time.monotonic() >= self.until:
            self.unreachable = False
        return super().wrap(conn)


def lossy_store(pg_url: str, pg_schema: str, faults: Faults) -> PostgresStore:
    """An inline store on the test's schema, without LISTEN, whose connections go through
    `faults`."""
    return PostgresStore(
        pg_url, schema=pg_schema, inline=True, listen=False, wrap_connection=faults.wrap
    )


@pytest.fixture
def short_patience(monkeypatch: pytest.MonkeyPatch) -> float:
    monkeypatch.setattr(_postgres.engine, "RECONNECT_PATIENCE_S", 0.3)
    return 0.3


async def test_uncertain_continue_of_an_iteration_never_strands_the_input_that_rang(
    pg_url: str, migrated_schema: str, autojump_clock: MockClock, short_patience: float
) -> None:
    """DESIGN §1/§6.16/§6.19: a drain returns while an input submitted during it rang the
    doorbell; the iteration's end takes that doorbell to continue (its COMMIT lands) but
    the reply is lost and cannot be read back. The runtime must not then finish the claim
    as failed without the doorbell: the input must still be drained (by a next iteration,
    a successor, or recovery), never left pending with no doorbell and no claim."""
    calls: list[list[str]] = []
    gate = trio.Event()
    entered = trio.Event()

    async def drain(ctx: DrainContext) -> None:
        calls.append([i.id for i in await ctx.take_inputs()])
        entered.set()
        if len(calls) == 1:
            await gate.wait()

    with control_connection(pg_url, migrated_schema) as control:
        faults = UnreachableFor(pg_url, migrated_schema, control, for_s=0.5)
        store = lossy_store(pg_url, migrated_schema, faults)
        async with open_runtime(
            store, drain, clock=ts_testing.trio_clock(), lease=3.0, recovery_interval=0.5
        ) as runtime:

            async def arm(session_id: str) -> None:
                if len(calls) == 1:  # the first iteration's end: it continues
                    faults.arm(CommitPlan(None, Mode.LOST, then_unreachable=True))

            ts_testing.set_seams(runtime, before_finish=arm)
            await runtime.submit("s", {"n": 1}, input_id="i1")
            await entered.wait()
            await runtime.submit("s", {"n": 2}, input_id="i2")  # rings the doorbell
            gate.set()
            await runtime.wait_idle("s")
            assert faults.fired == "COMMIT"
            # Long past the lease and many recovery passes: whoever should take i2 has.
            await trio.sleep(10 * 3.0)
            await runtime.wait_idle("s")
            state = control.execute(
                "SELECT (SELECT count(*) FROM session_input),"
                " (SELECT time_woken IS NOT NULL FROM session WHERE id = 's'),"
                " (SELECT count(*) FROM session_execution)"
            ).fetchone()
        assert calls[0] == ["i1"]
        assert ["i2"] in calls, (calls, "(pending inputs, doorbell set, claims):", state)


@pytest.mark.parametrize("step", ["append_text", "start_tool", "settle_tool", "finish"])
async def test_a_drain_write_retried_after_an_unknown_commit_lands_once(
    pg_url: str, migrated_schema: str, autojump_clock: MockClock, short_patience: float, step: str
) -> None:
    """DESIGN §8 "Uncertain commits" (natural keys and idempotent writes make a retry safe)
    and §6.20 (one contract on both backends): a drain write whose call landed but whose
    reply was lost and could not be read back raises StoreError; the drain retries it once
    the server answers - as `test_faults.test_drain_write_fault_is_atomic_and_the_drain_can_retry`
    does on SQLite - and the write lands once: no doubled append, no refusal of the drain's
    own first write (a duplicate tool start, a DuplicateSettlement, MessageFinished)."""
    errors: list[BaseException] = []
    stored: list[Any] = []  # the message as stored right after the retried write

    async def drain(ctx: DrainContext) -> None:
        await ctx.take_inputs()
        writer = await ctx.begin_assistant()
        if step != "start_tool":
            await writer.start_tool("c1", "echo", {"x": 1})
        call = {
            "append_text": lambda: writer.append_text("thinking"),
            "start_tool": lambda: writer.start_tool("c1", "echo", {"x": 1}),
            "settle_tool": lambda: writer.settle_tool("c1", "ok"),
            "finish": writer.finish,
        }[step]
        if step == "finish":
            await writer.settle_tool("c1", "ok")
        # The write is one call in autocommit: it lands, its reply is lost, and the server
        # cannot be reached to read it back within the bound.
        faults.arm(Plan(1, Mode.LOST, then_unreachable=True))
        try:
            await call()
        except StoreError as exc:
            errors.append(exc)
            faults.unreachable = False  # the server answers again: retry
            await call()
        stored.append((await ctx.transcript())[-1].data)
        if step in ("append_text", "start_tool"):
            await writer.settle_tool("c1", "ok")
        if step != "finish":
            await writer.finish()

    with control_connection(pg_url, migrated_schema) as control:
        faults = Faults(pg_url, migrated_schema, control)
        store = lossy_store(pg_url, migrated_schema, faults)
        async with open_runtime(store, drain, clock=ts_testing.trio_clock(), lease=30.0) as rt:
            await rt.submit("s", {"n": 1}, input_id="i1")
            outcome = await rt.run("s")
            messages = await rt.transcript("s")
    assert len(errors) == 1 and "outcome of a COMMIT is unknown" in str(errors[0])
    assert outcome.kind == "succeeded", outcome
    if step == "append_text":
        assert [p.text for p in stored[0].parts if hasattr(p, "text")] == ["thinking"]
    answer = messages[-1].data
    assert answer.finished and answer.error is None
    assert [(p.call_id, p.status, p.output) for p in answer.parts if hasattr(p, "call_id")] == [
        ("c1", "completed", "ok")
    ]


async def test_take_inputs_retried_after_an_unknown_commit_still_delivers_the_input(
    pg_url: str, migrated_schema: str, autojump_clock: MockClock, short_patience: float
) -> None:
    """DESIGN §1 (signalled work is never lost), §8 "Uncertain commits" and §6.20: take_inputs
    commits (the input is a user message now) but its COMMIT's reply is lost and cannot be
    read back; the drain retries once the server answers, as the SQLite contract test
    `test_drain_write_fault_is_atomic_and_the_drain_can_retry` does - and must get the
    input it took, not [] (which leaves a user message no drain ever saw or answers)."""
    taken: list[list[str]] = []
    errors: list[BaseException] = []

    async def drain(ctx: DrainContext) -> None:
        faults.arm(CommitPlan(None, Mode.LOST, then_unreachable=True))
        try:
            inputs = await ctx.take_inputs()
        except StoreError as exc:
            errors.append(exc)
            faults.unreachable = False  # the server answers again: retry
            inputs = await ctx.take_inputs()
        taken.append([i.id for i in inputs])

    with control_connection(pg_url, migrated_schema) as control:
        faults = Faults(pg_url, migrated_schema, control)
        store = lossy_store(pg_url, migrated_schema, faults)
        async with open_runtime(store, drain, clock=ts_testing.trio_clock(), lease=30.0) as rt:
            await rt.submit("s", {"n": 1}, input_id="i1")
            await rt.wait_idle("s")
            assert faults.fired == "COMMIT"
            users = [m.input_id for m in await rt.transcript("s") if m.role == "user"]
    assert users == ["i1"]  # the lost COMMIT did land
    assert len(errors) == 1 and "outcome of a COMMIT is unknown" in str(errors[0])
    assert taken == [["i1"]], taken


class ThenElsewhere(Faults):
    """`Faults` that, once its planned statement's reply is lost, lets another client act
    (`elsewhere`) before the engine reconnects and calls again: what another process does
    in that window."""

    def __init__(self, url: str, schema: str, control: psycopg.Connection[Any]) -> None:
        super().__init__(url, schema, control)
        self.elsewhere: Any = None

    def statement(self, conn: Any, text: str, params: Any, run: Any) -> Any:
        armed = self.plan is not None
        try:
            return super().statement(conn, text, params, run)
        except psycopg.OperationalError:
            if armed and self.plan is None and self.elsewhere is not None:
                self.elsewhere, elsewhere = None, self.elsewhere
                elsewhere()
            raise


def cancel_elsewhere(
    url: str, schema: str, input_ids: Iterable[str], answers: list[bool]
) -> Callable[[], None]:
    """Another process's `cancel_input` of each of `input_ids`, its answers added to
    `answers` (`ThenElsewhere.elsewhere`)."""

    def cancel() -> None:
        other = PostgresStore(url, schema=schema, listen=False).engine()
        other.open(migrate_schema=False)
        try:
            answers.extend(_postgres.run_op(other, _store.cancel_input, i) for i in input_ids)
        finally:
            other.close()

    return cancel


async def test_an_input_cancelled_while_its_submit_reply_is_lost_is_never_taken(
    pg_url: str, migrated_schema: str, autojump_clock: MockClock
) -> None:
    """DESIGN §6.23 (a cancelled input is never taken) and §5.1 (`cancel_input`: True and the
    input is gone): submit's call lands and its reply is lost; before the engine calls
    again, another process cancels the input (True: it was deleted). The retried call must
    read back that its input landed - not store it a second time, which the drain then
    takes although cancel_input said it was gone."""
    taken: list[str] = []
    cancelled: list[bool] = []

    async def drain(ctx: DrainContext) -> None:
        taken.extend(i.id for i in await ctx.take_inputs())

    with control_connection(pg_url, migrated_schema) as control:
        faults = ThenElsewhere(pg_url, migrated_schema, control)
        store = lossy_store(pg_url, migrated_schema, faults)
        async with open_runtime(store, drain, clock=ts_testing.trio_clock(), lease=30.0) as rt:
            faults.elsewhere = cancel_elsewhere(pg_url, migrated_schema, ["i1"], cancelled)
            # The submit is one call in autocommit (the input and the claim it takes).
            faults.arm(Plan(1, Mode.LOST))
            assert await rt.submit("s", {"n": 1}, input_id="i1") == "i1"
            await rt.wait_idle("s")
            assert faults.fired is not None and "ts_submit_and_acquire(" in faults.fired
            pending = control.execute("SELECT id FROM session_input").fetchall()
    assert cancelled == [True]  # the other process was told the input is gone
    assert taken == [] and pending == [], (taken, pending)


async def test_a_cancels_trace_lasts_ten_minutes_of_the_lease_clock(
    pg_url: str, migrated_schema: str, autojump_clock: MockClock
) -> None:
    """The trace `ts_cancel_input` leaves serves a retry within the engine's patience
    (seconds): the next cancel ten minutes later removes it, so cancels leave no growing
    table."""
    store = PostgresStore(pg_url, schema=migrated_schema, inline=True, listen=False)
    with control_connection(pg_url, migrated_schema) as control:
        async with open_runtime(store, None, clock=ts_testing.trio_clock()) as rt:
            for input_id in ("i1", "i2", "i3"):
                await rt.submit("s", {"n": 1}, input_id=input_id, delay=3600.0)
            assert await rt.cancel_input("i1") is True
            await trio.sleep(300)
            assert await rt.cancel_input("i2") is True
            await trio.sleep(301)
            assert await rt.cancel_input("i3") is True
            traces = control.execute(
                "SELECT id FROM session_input_cancelled ORDER BY id"
            ).fetchall()
    assert traces == [("i2",), ("i3",)]


async def test_a_submit_again_of_a_cancelled_id_whose_call_never_ran_is_stored(
    pg_url: str, migrated_schema: str, autojump_clock: MockClock
) -> None:
    """§5.1: a first submit with a cancelled input's id stores it anew (the cancel's trace
    answers only a retry). When that submit's call never ran - its connection lost while it
    waited for the session's lock, so the engine calls again (`p_retry`) - the retry must
    store it, not read the earlier cancel's trace as this call's landed input: the submit
    returned its id and nothing was stored, the input silently lost."""
    with control_connection(pg_url, migrated_schema) as control:
        faults = Faults(pg_url, migrated_schema, control)
        store = lossy_store(pg_url, migrated_schema, faults)
        async with open_runtime(store, None, clock=ts_testing.trio_clock()) as rt:
            assert await rt.submit("s", {"n": 1}, input_id="i1") == "i1"
            assert await rt.cancel_input("i1") is True
            faults.arm(Plan(1, Mode.BLOCKED))  # killed while waiting: it never ran
            assert await rt.submit("s", {"n": 1}, input_id="i1") == "i1"
            assert faults.fired is not None and "ts_submit(" in faults.fired, faults.fired
            pending = control.execute("SELECT id FROM session_input").fetchall()
    assert pending == [("i1",)]


# Each way a submit stores an input on PostgreSQL, as the engine runs it alone (one call in
# autocommit, read back on `p_retry`): the operation, its arguments after the input's
# session, payload and id, and the function its call names.
SUBMITS = {
    "submit": (_store.submit, (), "ts_submit("),
    "submit_and_acquire": (
        _store.submit_and_acquire,
        ("e1", OWNER, LEASE_MS),
        "ts_submit_and_acquire(",
    ),
    "reject": (_store.submit_controlled, ("reject",), "ts_submit_controlled("),
    "interrupt": (_store.submit_controlled, ("interrupt",), "ts_submit_controlled("),
    "scheduled": (_store.submit_scheduled, (60_000, "queue"), "ts_submit_controlled("),
    **{
        f"{on_busy}_and_acquire": (
            _store.submit_controlled_and_acquire,
            (on_busy, "e1", OWNER, LEASE_MS),
            "ts_submit_controlled_and_acquire(",
        )
        for on_busy in ("reject", "interrupt")
    },
}


@pytest.mark.parametrize("kind", [*SUBMITS, "set-wise"])
def test_no_retry_of_a_first_submit_reads_an_earlier_cancel_as_its_own(
    pg_url: str, migrated_schema: str, kind: str
) -> None:
    """§5.1 and §8 "Uncertain commits", for every way a submit stores an input alone (one
    call in autocommit), and a batch's submits (one set-wise call): an input is stored and
    cancelled; a first submit of the same id and payload then loses its connection while
    its call waits for the session's lock (it never ran), and the engine calls again
    (`p_retry`). That call must store the input: the earlier cancel's trace is not this
    call's landed input."""
    payload = '{"n": 1}'
    with environment(pg_url, migrated_schema) as env:
        for session_id, input_id in (("s", "i1"), ("t", "i2")):
            env.run(_store.submit, session_id, payload, input_id)
            assert env.run(_store.cancel_input, input_id) is True
        env.faults.arm(Plan(1, Mode.BLOCKED))
        if kind == "set-wise":
            jobs = [
                Job(_store.submit, ("s", payload, "i1")),
                Job(_store.submit, ("t", payload, "i2")),
            ]
            env.engine.run_batch(jobs)
            assert outcome_of(jobs) == [("ok", "i1"), ("ok", "i2")]
            called, stored = "ts_submits(", [("i1",), ("i2",)]
        else:
            op, more, called = SUBMITS[kind]
            env.run(op, "s", payload, "i1", *more)
            stored = [("i1",)]
        assert env.faults.fired is not None and called in env.faults.fired, env.faults.fired
        pending = env.control.execute("SELECT id FROM session_input ORDER BY id").fetchall()
    assert pending == stored


class ThenRefused(ThenElsewhere):
    """`ThenElsewhere`, and the engine's next statement that names `refused` after the lost
    reply (its call again) fails on the server with an error of its own: a database error,
    not a lost connection."""

    def __init__(self, url: str, schema: str, control: psycopg.Connection[Any]) -> None:
        super().__init__(url, schema, control)
        self.refused: str | None = None

    def statement(self, conn: Any, text: str, params: Any, run: Any) -> Any:
        if self.fired is not None and self.refused is not None and self.refused in text:
            self.refused = None
            conn.execute("SELECT 1 / 0")  # division_by_zero, from the server
        return super().statement(conn, text, params, run)


@pytest.mark.parametrize("kind", [*SUBMITS, "set-wise", "set-wise, refused again"])
def test_every_submit_whose_input_was_cancelled_after_its_lost_reply_reads_it_back(
    pg_url: str, migrated_schema: str, kind: str
) -> None:
    """DESIGN §6.23 and §5.1, for every way a submit stores an input alone and a batch's
    submits (as `test_an_input_cancelled_while_its_submit_reply_is_lost_is_never_taken`
    through a runtime): the call lands and its reply is lost; another process cancels the
    input (True) before the engine calls again. The call again must read back that its
    own call landed - not store the input a second time. "set-wise, refused again": the
    batch's call again is refused whole by a database error, so each submit runs alone -
    as a call again, which reads back, not as a first call, which stored the cancelled
    inputs again."""
    payload = '{"n": 1}'
    set_wise = kind.startswith("set-wise")
    inputs = {"i1": "s", "i2": "t"} if set_wise else {"i1": "s"}
    cancelled: list[bool] = []

    with control_connection(pg_url, migrated_schema) as control:
        faults = ThenRefused(pg_url, migrated_schema, control)
        engine = PostgresStore(pg_url, schema=migrated_schema, wrap_connection=faults.wrap).engine()
        engine.open()
        try:
            faults.elsewhere = cancel_elsewhere(pg_url, migrated_schema, inputs, cancelled)
            if kind == "set-wise, refused again":
                faults.refused = "ts_submits("
            faults.arm(Plan(1, Mode.LOST))
            if set_wise:
                jobs = [Job(_store.submit, (s, payload, i)) for i, s in inputs.items()]
                engine.run_batch(jobs)
                assert outcome_of(jobs) == [("ok", "i1"), ("ok", "i2")]
                called = "ts_submits("
            else:
                op, more, called = SUBMITS[kind]
                _postgres.run_op(engine, op, "s", payload, "i1", *more)
        finally:
            engine.close()
        assert faults.fired is not None and called in faults.fired, faults.fired
        assert faults.refused is None  # a call again to refuse was refused
        pending = control.execute("SELECT id FROM session_input").fetchall()
    assert cancelled == [True] * len(inputs)  # the other process was told they are gone
    assert pending == []


# Draws an id of each kind, forks, and prints the next ids of the child and of the parent
# (the child first): a single-threaded process, as a forking server is.
_FORKED_IDS = """
import os
from trio_sessions._backend import new_call_id
from trio_sessions._store.common import new_id

new_call_id(), new_id()
child = os.fork()
if child == 0:
    print("child", new_call_id(), new_id()[12:], flush=True)
    os._exit(0)
os.waitpid(child, 0)
print("parent", new_call_id(), new_id()[12:], flush=True)
"""


def test_a_forked_child_draws_ids_of_its_own() -> None:
    """A call's id tells its own lost call from any other's (`Job.call_id`), and row ids
    are unique as random ones (`new_id`): a child forked from a process that made some
    draws other bits than its parent's next, though both copies of the generator start
    from the same state."""
    run = subprocess.run(
        [sys.executable, "-c", _FORKED_IDS], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stderr
    child, parent = (line.split() for line in run.stdout.splitlines())
    assert (child[0], parent[0]) == ("child", "parent")
    assert child[1] != parent[1]  # call ids
    assert child[2] != parent[2]  # the random bits of row ids
