"""Conversation control (DESIGN §5.1, invariants §6.23-25), on both backends.

`submit(on_busy=...)`, scheduled inputs (`delay=`), `cancel_input`, `pause`/`resume`,
`delete_session`, `purge`, `fork` and `truncate`: each one fenced transaction. Deterministic:
inline store, autojump virtual clock, gates; the runtime clock is tied to virtual time, so a
scheduled input falls due when virtual time reaches it.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from helpers import (
    ExecutorSeam,
    LateReply,
    LooksHeld,
    Raw,
    Recorder,
    SlowToExit,
    WrappedStore,
    build_pg_schema,
    now_ms,
    open_tool_message,
    runtime,
    start_run,
)
from trio.testing import MockClock

import trio_sessions
from trio_sessions import (
    AssistantData,
    DrainContext,
    LeaseLost,
    MalformedRecord,
    Message,
    Outcome,
    SessionBusy,
    Store,
    TextPart,
    TrioSessionsError,
    _store,
)
from trio_sessions._codec import decode_assistant

Clock = Callable[[], float]


RECOVERY_ROWS = "SELECT COUNT(*) FROM session_recovery WHERE session_id = ?"
# Every table holding rows of a session, with the column naming the session.
SESSION_ROWS = (
    "SELECT COUNT(*) FROM session WHERE id = ?",
    "SELECT COUNT(*) FROM session_input WHERE session_id = ?",
    "SELECT COUNT(*) FROM session_input_rejected WHERE session_id = ?",
    "SELECT COUNT(*) FROM session_execution WHERE session_id = ?",
    RECOVERY_ROWS,
    "SELECT COUNT(*) FROM session_message WHERE session_id = ?",
    "SELECT COUNT(*) FROM session_message_rejected WHERE session_id = ?",
    "SELECT COUNT(*) FROM session_message_stream s JOIN session_message m"
    " ON m.id = s.message_id WHERE m.session_id = ?",
    "SELECT COUNT(*) FROM session_message_delta d JOIN session_message m"
    " ON m.id = d.message_id WHERE m.session_id = ?",
)


def rows_of(raw: Raw, session_id: str) -> list[int]:
    return [int(raw.one(sql, (session_id,))[0]) for sql in SESSION_ROWS]


class HoldFirst:
    """A drain that takes its inputs, starts a reply, streams a word and - on its first call
    only - waits on a gate; later calls take their inputs and finish at once."""

    def __init__(self) -> None:
        self.taken: list[list[str]] = []
        self.entered = trio.Event()
        self.gate = trio.Event()
        self.errors: list[BaseException] = []
        self.late_write: trio.Event | None = None

    async def __call__(self, ctx: DrainContext) -> None:
        inputs = await ctx.take_inputs()
        self.taken.append([i.id for i in inputs])
        reply = await ctx.begin_assistant()
        await reply.append_text("thinking")
        if len(self.taken) == 1:
            self.entered.set()
            if self.late_write is not None:
                # Shielded: the drain outlives its interrupt until the test lets it write.
                with trio.CancelScope(shield=True):
                    await self.late_write.wait()
                    try:
                        await reply.append_text(" more")
                    except LeaseLost as exc:
                        self.errors.append(exc)
                return
            await self.gate.wait()
        await reply.finish()


# --- §6.23 on_busy ----------------------------------------------------------------------------


async def test_on_busy_interrupt_stops_the_drain_and_one_successor_takes_every_input(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """on_busy="interrupt": the running drain stops at once (its reply finished
    "interrupted") and exactly one successor takes the queued input and this one."""
    drain = HoldFirst()
    async with runtime(store, drain, clock) as rt, trio.open_nursery() as nursery:
        await rt.submit("s", {"n": 1}, input_id="i1")
        await drain.entered.wait()
        outcomes = start_run(nursery, rt, "s")
        await trio.testing.wait_all_tasks_blocked()
        await rt.submit("s", {"n": 2}, input_id="i2")
        assert await rt.submit("s", {"n": 3}, input_id="i3", on_busy="interrupt") == "i3"
        with trio.fail_after(1):  # at once, not at the next heartbeat (10 s)
            await rt.wait_idle("s")
    assert drain.taken == [["i1"], ["i2", "i3"]]
    assert outcomes and outcomes[0].kind == "interrupted"
    messages = await _transcript(store, clock)
    first_reply = messages[1].data
    assert isinstance(first_reply, AssistantData)
    assert (first_reply.finished, first_reply.error) == (True, "interrupted")
    assert [m.role for m in messages] == ["user", "assistant", "user", "user", "assistant"]
    assert Raw(db_path).rows("SELECT id FROM session_input") == []


async def test_on_busy_interrupt_from_another_runtime_marks_the_claim_cancelling(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """A producer's on_busy="interrupt" marks the owner's claim cancelling in the submit's
    own transaction; the owner stops (here through its heartbeat: the inline store sends
    no signal), and one successor takes every pending input."""
    drain = HoldFirst()
    raw = Raw(db_path)
    async with (
        runtime(store, drain, clock, lease=3) as owner,
        runtime(store, None, clock) as producer,
    ):
        await owner.submit("s", {"n": 1}, input_id="i1")
        await drain.entered.wait()
        await producer.submit("s", {"n": 2}, input_id="i2", on_busy="interrupt")
        claim = raw.claim("s")
        assert claim is not None and claim[2] == "cancelling"
        assert raw.rows("SELECT id FROM session_input ORDER BY seq") == [("i2",)]
        with trio.fail_after(5):
            while len(drain.taken) < 2:
                await trio.sleep(0.01)
        await owner.wait_idle("s")
    assert drain.taken == [["i1"], ["i2"]]


async def test_a_drain_whose_claim_was_marked_cancelling_takes_no_inputs(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """Between another process's on_busy="interrupt" and the owner noticing it, the drain's
    take_inputs() takes nothing: the interrupting input and the ones before it all go to
    the one successor."""
    calls: list[list[str]] = []
    interrupted = trio.Event()
    entered = trio.Event()
    taken = trio.Event()

    async def drain(ctx: DrainContext) -> None:
        if not calls:
            calls.append([])
            entered.set()
            with trio.CancelScope(shield=True):  # still running when the request lands
                await interrupted.wait()
        calls.append([i.id for i in await ctx.take_inputs()])
        taken.set()

    # The owner notices the interrupt only once the drain took: on PostgreSQL its
    # notification could bring a change look that stops the drain before its take.
    wrapped = WrappedStore(store, LooksHeld)
    async with (
        runtime(wrapped, drain, clock, lease=3) as owner,
        runtime(store, None, clock) as producer,
    ):
        assert wrapped.executor is not None
        await owner.wake("s")
        await entered.wait()
        wrapped.executor.until = taken
        await producer.submit("s", {"n": 1}, input_id="i1")
        await producer.submit("s", {"n": 2}, input_id="i2", on_busy="interrupt")
        interrupted.set()
        with trio.fail_after(5):
            while len(calls) < 3:
                await trio.sleep(0.01)
        await owner.wait_idle("s")
    assert calls == [[], [], ["i1", "i2"]]
    assert Raw(db_path).rows("SELECT id FROM session_input") == []


async def test_on_busy_reject_raises_and_stores_nothing_while_a_claim_exists(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """on_busy="reject" raises SessionBusy and stores nothing while a claim is held; a
    retry of an input already stored returns its id; idle again, it is accepted."""
    drain = HoldFirst()
    raw = Raw(db_path)
    async with runtime(store, drain, clock) as rt:
        await rt.submit("s", {"n": 1}, input_id="i1")
        await drain.entered.wait()
        before = raw.rows("SELECT id, time_woken, wakes FROM session")
        with pytest.raises(SessionBusy) as caught:
            await rt.submit("s", {"n": 2}, input_id="i2", on_busy="reject")
        assert isinstance(caught.value, TrioSessionsError)
        assert raw.rows("SELECT id FROM session_input") == []
        assert raw.rows("SELECT id, time_woken, wakes FROM session") == before
        # Already stored (taken, even): the idempotent retry returns its id.
        assert await rt.submit("s", {"n": 1}, input_id="i1", on_busy="reject") == "i1"
        drain.gate.set()
        await rt.wait_idle("s")
        assert await rt.submit("s", {"n": 2}, input_id="i2", on_busy="reject") == "i2"
        await rt.wait_idle("s")
    assert drain.taken == [["i1"], ["i2"]]


async def test_on_busy_reject_counts_untaken_due_inputs_but_not_scheduled_ones(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """Busy also means untaken due inputs are pending (no claim needed); a session whose
    only inputs are scheduled is not busy."""
    raw = Raw(db_path)
    async with runtime(store, None, clock) as producer:
        await producer.submit("later", {"n": 1}, input_id="l1", delay=60)
        assert await producer.submit("later", {"n": 2}, input_id="l2", on_busy="reject") == "l2"
        await producer.submit("now", {"n": 1}, input_id="n1")
        with pytest.raises(SessionBusy):
            await producer.submit("now", {"n": 2}, input_id="n2", on_busy="reject")
    assert raw.rows("SELECT id FROM session_input ORDER BY id") == [("l1",), ("l2",), ("n1",)]


async def test_on_busy_and_delay_are_validated_before_any_write(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """An unknown on_busy is a ValueError, a bad delay a TypeError/ValueError, and neither
    writes anything."""
    async with runtime(store, None, clock) as producer:
        with pytest.raises(ValueError, match="on_busy"):
            await producer.submit("s", {}, on_busy="latest")
        with pytest.raises(ValueError, match="delay"):
            await producer.submit("s", {}, delay=-1)
        with pytest.raises(ValueError, match="delay"):
            await producer.submit("s", {}, delay=float("nan"))
        with pytest.raises(TypeError, match="delay"):
            await producer.submit("s", {}, delay="5")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="on_busy"):
            await producer.submit("s", {}, on_busy="interrupt", delay=5)
    assert Raw(db_path).rows("SELECT id FROM session") == []


# --- §6.23 scheduled inputs -------------------------------------------------------------------


async def test_a_scheduled_input_is_never_taken_before_due_and_wakes_by_itself(
    store: Store, clock: Clock, autojump_clock: MockClock
) -> None:
    """A delayed input is invisible to take_inputs() until due, then starts the drain by
    itself within 100 ms of its due time (no wake, no recovery pass: recovery is hours
    away); take_inputs() returns due inputs only, in seq order."""
    starts: list[tuple[float, list[str]]] = []

    async def drain(ctx: DrainContext) -> None:
        starts.append((trio.current_time(), [i.id for i in await ctx.take_inputs()]))

    async with runtime(store, drain, clock, recovery_interval=3600) as rt:
        t0 = trio.current_time()
        await rt.submit("s", {"n": 1}, input_id="late", delay=10)
        await rt.submit("s", {"n": 2}, input_id="soon", delay=5)
        await rt.submit("s", {"n": 3}, input_id="now")
        await rt.wait_idle("s")
        assert [ids for _, ids in starts] == [["now"]]
        await trio.sleep(12)
        await rt.wait_idle("s")
    assert [ids for _, ids in starts] == [["now"], ["soon"], ["late"]]
    assert 5 <= starts[1][0] - t0 <= 5.1
    assert 10 <= starts[2][0] - t0 <= 10.1


async def test_a_scheduled_input_is_never_lost_across_a_restart(
    store: Store, clock: Clock, autojump_clock: MockClock
) -> None:
    """Scheduled by a producer, due while no runtime drains, or due after a worker
    restarted: it is taken once, at or after its due time, by the runtime that opens."""
    taken: list[tuple[float, str]] = []

    async def drain(ctx: DrainContext) -> None:
        taken.extend((trio.current_time(), i.id) for i in await ctx.take_inputs())

    t0 = trio.current_time()
    async with runtime(store, None, clock) as producer:
        await producer.submit("s", {"n": 1}, input_id="a", delay=5)
        await producer.submit("s", {"n": 2}, input_id="b", delay=20)
    async with runtime(store, drain, clock, recovery_interval=3600) as worker:
        await trio.sleep(1)
        assert taken == []
    await trio.sleep(10)  # "a" falls due while nobody drains
    async with runtime(store, drain, clock, recovery_interval=3600) as worker:
        await worker.wait_idle("s")
        assert [i for _, i in taken] == ["a"]
        await trio.sleep(20)
        await worker.wait_idle("s")
    assert [i for _, i in taken] == ["a", "b"]
    assert 20 <= taken[1][0] - t0 <= 20.1


@pytest.mark.parametrize("backend", ["sqlite", "postgres"], indirect=True)
async def test_a_scheduled_input_from_another_runtime_wakes_the_worker_on_time(
    live_store: Any,
) -> None:
    """Real time, threaded stores: a worker learns of another runtime's scheduled input
    through the change signal (recovery is an hour away) and starts the drain at its due
    time by the store's clock, not before and not a poll later."""
    started: list[float] = []

    async def drain(ctx: DrainContext) -> None:
        if await ctx.take_inputs():
            started.append(trio.current_time())

    async with (
        trio_sessions.open_runtime(live_store, drain, recovery_interval=3600) as worker,
        trio_sessions.open_runtime(live_store, None) as producer,
    ):
        await trio.sleep(0.1)  # the worker's first look is done: only a signal can arm it
        submitted = trio.current_time()
        await producer.submit("s", {"n": 1}, input_id="x", delay=0.5)
        with trio.fail_after(5):
            while not started:
                await trio.sleep(0.005)
        await worker.wait_idle("s")
    late = started[0] - submitted - 0.5
    # The target (p99 <= 100 ms) is a quiet machine's; a shared test machine gets 0.5 s.
    # Missing the signal would be later still: the fallback look comes after 2 s.
    assert -0.01 <= late <= 0.5, late


@pytest.mark.parametrize("backend", ["sqlite", "postgres"], indirect=True)
async def test_delete_session_from_another_process_stops_the_owner_through_the_signal(
    live_store: Any, db_path: Any
) -> None:
    """Real time, threaded stores, default lease (heartbeat 10 s away): a producer's
    delete_session stops the owner's drain within the signal's bound, and no row of the
    session remains."""
    drain = SlowToExit()
    drain.may_exit.set()  # not slow: it exits as soon as it is cancelled

    async with (
        trio_sessions.open_runtime(live_store, drain, recovery_interval=3600) as owner,
        trio_sessions.open_runtime(live_store, None) as producer,
    ):
        await owner.submit("s", {"n": 1})
        with trio.fail_after(5):
            await drain.entered.wait()
        assert await producer.delete_session("s") is True
        with trio.fail_after(2):
            await drain.exiting.wait()
            await owner.wait_idle("s")
    assert rows_of(Raw(db_path), "s") == [0] * len(SESSION_ROWS)


# --- §6.23 cancel_input -----------------------------------------------------------------------


async def test_a_cancelled_input_is_never_taken(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """cancel_input: True and gone while pending (also scheduled); False once taken (a user
    message now) and for an unknown id; a cancelled input is never taken."""
    drain = Recorder()
    async with runtime(store, None, clock) as producer:
        await producer.submit("s", {"n": 1}, input_id="keep")
        await producer.submit("s", {"n": 2}, input_id="stop")
        await producer.submit("s", {"n": 3}, input_id="reminder", delay=5)
        assert await producer.cancel_input("stop") is True
        assert await producer.cancel_input("reminder") is True
        assert await producer.cancel_input("stop") is False
        assert await producer.cancel_input("nobody") is False
    async with runtime(store, drain, clock) as worker:
        await worker.wait_idle("s")
        await trio.sleep(10)
        await worker.wait_idle("s")
        assert await worker.cancel_input("keep") is False
    assert drain.taken == ["keep"]
    assert Raw(db_path).rows("SELECT id FROM session_input") == []
    with pytest.raises(TypeError):
        async with runtime(store, None, clock) as producer:
            await producer.cancel_input(5)  # type: ignore[arg-type]


async def test_a_cancelled_inputs_id_is_forgotten_and_a_new_submit_with_it_is_taken(
    store: Store, clock: Clock, autojump_clock: MockClock
) -> None:
    """`cancel_input`'s documented promise: the id is forgotten, so a later `submit` with it
    (the same payload: a user sending the message again) stores a new input, which a drain
    takes - the trace a cancel leaves on PostgreSQL answers only a lost call's retry."""
    drain = Recorder()
    async with runtime(store, None, clock) as producer:
        await producer.submit("s", {"n": 1}, input_id="again")
        assert await producer.cancel_input("again") is True
        assert await producer.submit("s", {"n": 1}, input_id="again") == "again"
    async with runtime(store, drain, clock) as worker:
        await worker.wait_idle("s")
    assert drain.taken == ["again"]


# --- §6.24 pause / resume ---------------------------------------------------------------------


async def test_a_paused_session_never_starts_a_drain_and_resume_starts_one(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """Paused: inputs and wakes are stored but no drain starts (submit, wake, run,
    recovery, a scheduled input falling due); resume starts exactly one busy period that
    takes everything."""
    drain = Recorder()
    raw = Raw(db_path)
    async with runtime(store, drain, clock) as rt:
        await rt.pause("s")
        await rt.pause("s")  # idempotent
        await rt.submit("s", {"n": 1}, input_id="i1")
        await rt.submit("s", {"n": 2}, input_id="i2", delay=1)
        await rt.wake("s")
        assert await rt.run("s") == Outcome("deferred")
        await rt.recover_once()
        await trio.sleep(5)
        await rt.recover_once()
        assert drain.calls == []
        assert raw.rows("SELECT id FROM session_input ORDER BY seq") == [("i1",), ("i2",)]
        assert raw.one("SELECT time_woken FROM session")[0] is not None
        await rt.resume("s")
        await rt.resume("s")  # idempotent
        await rt.wait_idle("s")
        assert len(drain.calls) == 1
        assert drain.taken == ["i1", "i2"]
        await rt.resume("s")  # nothing pending: nothing starts
        await rt.wait_idle("s")
    assert len(drain.calls) == 1


async def test_pause_ends_a_running_busy_period_at_its_next_iteration_boundary(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """Paused while its drain runs: the drain call finishes normally, no further iteration
    starts although an input arrived, the doorbell stays set; resume drains it."""
    drain = Recorder()
    gate = drain.hold()
    raw = Raw(db_path)
    async with runtime(store, drain, clock) as rt, trio.open_nursery() as nursery:
        outcomes = start_run(nursery, rt, "s")
        await drain.entered.wait()
        await rt.pause("s")
        await rt.submit("s", {"n": 1}, input_id="i1")
        gate.set()
        await rt.wait_idle("s")
        assert outcomes == [Outcome("succeeded")]
        assert len(drain.calls) == 1
        assert raw.claim("s") is None
        assert raw.one("SELECT time_woken FROM session")[0] is not None
        drain.gate = None
        await rt.resume("s")
        await rt.wait_idle("s")
    assert len(drain.calls) == 2
    assert drain.taken == ["i1"]


@pytest.mark.xfail(
    strict=True,
    reason="A5: a pause committed between the claim's commit and its drain's start does not"
    " stop that drain; honouring it needs the store's take (or a read before the drain"
    " starts) to see the pause - a change to ts_take_inputs, i.e. a schema change",
)
async def test_a_pause_between_the_claims_commit_and_the_drains_start_starts_no_drain(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """Another process pauses the session right after this runtime's claim committed and
    before its drain starts (the acquisition hook's window: the thread hand-off's reply on
    its way). `pause` has returned, so no drain may start on the session (§5.1, §6.24) and
    the input waits for `resume`; instead the drain starts and answers it."""
    drain = Recorder()
    raw = Raw(db_path)
    paused: list[str] = []

    async with runtime(store, None, clock) as producer:

        async def hook(claim: Any) -> None:
            if not paused:
                paused.append(claim.session_id)
                await producer.pause(claim.session_id)

        async with runtime(store, drain, clock, acquisition_hook=hook) as rt:
            await rt.submit("s", {"n": 1}, input_id="i1")
            await rt.wait_idle("s")
            assert paused == ["s"]
            assert drain.calls == [], "a drain started on a session whose pause had returned"
            assert raw.rows("SELECT id FROM session_input") == [("i1",)]
            await rt.resume("s")
            await rt.wait_idle("s")
    assert drain.taken == ["i1"]


async def test_recovery_finishes_a_paused_sessions_dead_claim_as_owner_lost(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """A dead owner's expired claim on a paused session is finished as owner-lost (its
    open reply closed), never resumed; pending inputs keep the doorbell set for resume."""
    raw = Raw(db_path)
    drain = Recorder()
    async with runtime(store, None, clock) as producer:
        raw.seed_claim("s", "dead-e", expires_at=now_ms(clock) - 1)
        message_id = raw.seed_assistant("s", "dead-e", 1, open_tool_message())
        await producer.pause("s")
        await producer.submit("s", {"n": 1}, input_id="i1")
    async with runtime(store, drain, clock) as rt:
        report = rt.statistics().recovery
        assert report.resumed == 0
        assert report.finished_paused == 1
        assert drain.calls == []
        # Later passes never even try to start it: its doorbell is skipped while paused.
        assert (await rt.recover_once()).doorbells_started == 0
        assert raw.claim("s") is None
        data = decode_assistant(
            raw.one("SELECT data FROM session_message WHERE id = ?", (message_id,))[0],
            key=message_id,
        )
        assert (data.finished, data.error) == (True, "interrupted: owner lost")
        assert raw.one("SELECT time_woken FROM session")[0] is not None
        await rt.resume("s")
        await rt.wait_idle("s")
    assert drain.taken == ["i1"]
    assert [c.resumed for c in drain.calls] == [False]


async def test_resume_of_a_session_that_is_not_paused_leaves_it_as_it_is(
    store: Store, clock: Clock, autojump_clock: MockClock
) -> None:
    """`Runtime.resume`'s docstring: "an unknown or unpaused session is left as it is", and
    DESIGN §6.16: a drain that returns without taking its inputs leaves them pending "for
    the next wake - its own choice". `resume` of a session that was never paused rang its
    doorbell for those inputs and started another drain: a wake nobody sent (the CLI's
    `resume` on such a session said "pending work rang its doorbell" too). Found by an
    audit."""
    calls: list[str] = []

    async def leaves_its_inputs(ctx: DrainContext) -> None:
        calls.append(ctx.execution_id)  # takes nothing: its own choice

    async with runtime(store, leaves_its_inputs, clock) as rt:
        await rt.submit("s", {"text": "later"})
        await rt.wait_idle("s")
        assert len(calls) == 1
        await rt.resume("s")  # never paused
        await rt.wait_idle("s")
    assert len(calls) == 1, f"{len(calls)} drains: resume of an unpaused session woke it"


async def test_resume_drains_again_after_a_paused_sessions_claim_was_cut_short(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """A paused session's claim cut short mid-answer (its owner restarted or died), with
    every input already taken: recovery finishes it as owner-lost and rings its doorbell, so
    `resume` starts one drain, which finds the question still unanswered - no message of
    the conversation is left owed for good."""
    raw = Raw(db_path)
    drain = Recorder()
    async with runtime(store, None, clock) as producer:
        raw.seed_user_message("s", "question", 1)  # its input taken by the claim below
        raw.seed_claim("s", "dead-e", expires_at=now_ms(clock) - 1, anchor_seq=1)
        raw.seed_assistant("s", "dead-e", 2, open_tool_message())
        await producer.pause("s")
    async with runtime(store, drain, clock) as rt:
        assert rt.statistics().recovery.finished_paused == 1
        assert raw.one("SELECT time_woken FROM session")[0] is not None
        await rt.resume("s")
        await rt.wait_idle("s")
    assert [c.resumed for c in drain.calls] == [False]


# --- §6.25 delete, purge, fork, truncate ------------------------------------------------------


async def test_delete_session_removes_every_row_and_no_write_of_the_old_drain_lands(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """delete_session interrupts the running drain and removes every row of the session in
    one transaction; the old drain's later write raises LeaseLost; a later submit starts a
    fresh, empty session."""
    raw = Raw(db_path)
    drain = HoldFirst()
    drain.late_write = trio.Event()
    async with runtime(store, drain, clock) as rt:
        await rt.submit("s", {"n": 1}, input_id="i1")
        await rt.submit("s", {"n": 2}, input_id="i2", delay=50)
        await drain.entered.wait()
        assert rows_of(raw, "s")[0] == 1
        assert await rt.delete_session("s") is True
        assert rows_of(raw, "s") == [0] * len(SESSION_ROWS)
        drain.late_write.set()
        await rt.wait_idle("s")
        assert [type(e) for e in drain.errors] == [LeaseLost]
        assert rows_of(raw, "s") == [0] * len(SESSION_ROWS)
        assert await rt.delete_session("s") is False
        await trio.sleep(60)  # the deleted scheduled input never comes back
        await rt.wait_idle("s")
        assert rows_of(raw, "s") == [0] * len(SESSION_ROWS)
        await rt.submit("s", {"n": 3}, input_id="i3")
        await rt.wait_idle("s")
        messages = await rt.transcript("s")
    assert [(m.role, m.input_id) for m in messages] == [("user", "i3"), ("assistant", None)]
    assert drain.taken == [["i1"], ["i3"]]


async def test_a_due_time_that_is_not_a_number_stops_nothing_else(
    tmp_path: Path, clock: Clock, autojump_clock: MockClock
) -> None:
    """SQLite keeps text in an INTEGER column another tool wrote: a scheduled input whose
    due time is such text never falls due, and a draining runtime still opens and drains
    the other sessions (the due timer's lookup raised a bare ValueError from int() in
    every recovery pass, the first one in open_runtime)."""
    db_path = tmp_path / "sessions.db"
    drain = Recorder()
    async with runtime(Store(db_path, inline=True), None, clock) as producer:
        await producer.submit("bad", {"n": 1}, delay=3600)
    Raw(db_path).write("UPDATE session_input SET due_at = 'x' WHERE session_id = 'bad'")
    async with runtime(Store(db_path, inline=True), drain, clock) as rt:
        await rt.submit("good", {"n": 2})
        await rt.wait_idle("good")
        assert (await rt.recover_once()).examined == 0
    assert [call.session_id for call in drain.calls] == ["good"]


async def test_delete_session_removes_a_quarantined_sessions_recovery_row(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """§6.25 for a session recovery set aside: its quarantine record (`session_recovery`,
    no foreign key to the session) goes with it - else a deleted conversation would still
    be listed as quarantined, and a new one of the same id inherit the record."""
    raw = Raw(db_path)
    async with runtime(store, Recorder(), clock, recovery_interval=3600) as rt:
        raw.seed_claim("poison", "poison-exec", expires_at=now_ms(clock) - 1)
        raw.seed_assistant("poison", "poison-exec", 1, '{"parts": [], "finished": "no"}')
        assert (await rt.recover_once()).quarantined == 1
        assert rows_of(raw, "poison")[SESSION_ROWS.index(RECOVERY_ROWS)] == 1
        assert await rt.delete_session("poison") is True
    assert rows_of(raw, "poison") == [0] * len(SESSION_ROWS)


async def test_delete_session_from_another_runtime_stops_the_owner(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """A producer's delete_session removes the session's rows; the owner's drain is stopped
    (here by its heartbeat: the inline store sends no signal) and writes nothing more."""
    raw = Raw(db_path)
    stopped = trio.Event()
    errors: list[BaseException] = []

    async def drain(ctx: DrainContext) -> None:
        await ctx.take_inputs()
        reply = await ctx.begin_assistant()
        await reply.append_text("x")
        try:
            await trio.sleep_forever()
        finally:
            stopped.set()
            try:
                with trio.CancelScope(shield=True):
                    await reply.append_text("late")
            except LeaseLost as exc:
                errors.append(exc)

    async with (
        runtime(store, drain, clock, lease=3, recovery_interval=3600) as owner,
        runtime(store, None, clock) as producer,
    ):
        await owner.submit("s", {"n": 1})
        await trio.testing.wait_all_tasks_blocked()
        assert await producer.delete_session("s") is True
        with trio.fail_after(3):
            await stopped.wait()
            await owner.wait_idle("s")
    assert [type(e) for e in errors] == [LeaseLost]
    assert rows_of(raw, "s") == [0] * len(SESSION_ROWS)


class SlowToStop:
    """The first call blocks until cancelled, then cleans up (shielded) until `let_go`."""

    def __init__(self) -> None:
        self.calls: list[DrainContext] = []
        self.taken: list[list[str]] = []
        self.started: list[float] = []
        self.entered = trio.Event()
        self.cleaning = trio.Event()
        self.let_go = trio.Event()

    async def __call__(self, ctx: DrainContext) -> None:
        self.calls.append(ctx)
        self.started.append(trio.current_time())
        self.taken.append([i.id for i in await ctx.take_inputs()])
        if len(self.calls) > 1:
            return
        self.entered.set()
        try:
            await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True):  # a `finally` that awaits (trio allows it)
                self.cleaning.set()
                await self.let_go.wait()


async def test_a_run_during_a_deleted_sessions_stop_is_not_deferred(
    store: Store, clock: Clock, autojump_clock: MockClock
) -> None:
    """delete_session stops the running drain; a `run()` made while that drain still cleans
    up rings the stopping entry, whose successor must take the wake: nobody else holds
    the session, so the run must not come back `deferred` with no drain (the entry is
    released with the ring unhonoured, and the wake waits for the next recovery pass)."""
    drain = SlowToStop()
    async with runtime(store, drain, clock, recovery_interval=5.0) as rt:
        await rt.submit("s", {"n": 1}, input_id="i1")
        await drain.entered.wait()
        assert await rt.delete_session("s") is True
        await drain.cleaning.wait()
        async with trio.open_nursery() as nursery:
            outcomes = start_run(nursery, rt, "s")
            await trio.testing.wait_all_tasks_blocked()
            drain.let_go.set()
        assert [o.kind for o in outcomes] == ["succeeded"]
        assert len(drain.calls) == 2


async def test_a_submit_during_a_deleted_sessions_stop_starts_its_drain_at_once(
    store: Store, clock: Clock, autojump_clock: MockClock
) -> None:
    """A submit while the deleted session's old drain still cleans up (a fresh, empty
    session, §5.1) starts its drain as soon as the old one exited - not one recovery
    interval later, when a recovery pass happens to find the doorbell."""
    drain = SlowToStop()
    async with runtime(store, drain, clock, recovery_interval=5.0) as rt:
        await rt.submit("s", {"n": 1}, input_id="i1")
        await drain.entered.wait()
        assert await rt.delete_session("s") is True
        await drain.cleaning.wait()
        await rt.submit("s", {"n": 2}, input_id="i2")
        released_at = trio.current_time()
        drain.let_go.set()
        with trio.move_on_after(4.0):
            while len(drain.calls) < 2:
                await trio.sleep(0.01)
        assert drain.taken == [["i1"], ["i2"]]
        assert drain.started[1] - released_at < 1.0


async def test_a_submit_after_a_delete_during_an_interrupts_cleanup_starts_at_once(
    store: Store, clock: Clock, autojump_clock: MockClock
) -> None:
    """A user presses Stop, then deletes the chat while the interrupt's cleanup is between
    its two transactions (the cancelling mark committed, its reply on its way), then starts
    a fresh chat under the same id. The cleanup's finish finds the claim gone (`LeaseLost`)
    and used to end the busy period with the fresh submit's ring unanswered: its drain
    started only at the next recovery pass (5 s) or fallback poll (2 s), not at once."""
    taken: list[list[str]] = []
    started: list[float] = []

    async def drain(ctx: DrainContext) -> None:
        started.append(trio.current_time())
        taken.append([i.id for i in await ctx.take_inputs()])
        if len(taken) == 1:
            await trio.sleep_forever()

    async with runtime(store, drain, clock, recovery_interval=5.0) as rt:
        await rt.submit("s", {"n": 1}, input_id="i1")
        await trio.testing.wait_all_tasks_blocked()
        with late_reply(rt, _store.mark_cancelling, shield=True) as late:
            assert await rt.interrupt("s") is True
            await late.committed.wait()
            assert await rt.delete_session("s") is True
            await rt.submit("s", {"n": 2}, input_id="i2")
            submitted_at = trio.current_time()
            late.answer.set()
        with trio.move_on_after(10.0):
            while len(taken) < 2:
                await trio.sleep(0.01)
    assert taken == [["i1"], ["i2"]]
    assert started[1] - submitted_at < 1.0


@pytest.mark.sqlite_only("the inline SQLite store sends no change signal: the delete is unseen")
async def test_a_submit_after_a_remote_delete_while_the_drain_fails_starts_at_once(
    store: Store, clock: Clock, autojump_clock: MockClock
) -> None:
    """Another process deletes the session while its drain here runs, and a fresh chat is
    submitted here under the same id before the delete's signal arrived (it rings the old
    entry); then the old drain fails (its model call raised). Its failed finish finds the
    claim gone (`LeaseLost`) and used to end the busy period with that ring unanswered:
    the fresh input waited for the next recovery pass (5 s) instead of draining at once."""
    taken: list[list[str]] = []
    started: list[float] = []
    gate = trio.Event()

    async def drain(ctx: DrainContext) -> None:
        started.append(trio.current_time())
        taken.append([i.id for i in await ctx.take_inputs()])
        if len(taken) == 1:
            await gate.wait()
            raise RuntimeError("the model call failed")

    async with (
        runtime(store, drain, clock, recovery_interval=5.0) as rt,
        runtime(store, None, clock) as producer,
    ):
        await rt.submit("s", {"n": 1}, input_id="i1")
        await trio.testing.wait_all_tasks_blocked()
        assert await producer.delete_session("s") is True
        await rt.submit("s", {"n": 2}, input_id="i2")
        submitted_at = trio.current_time()
        gate.set()
        with trio.move_on_after(10.0):
            while len(taken) < 2:
                await trio.sleep(0.01)
    assert taken == [["i1"], ["i2"]]
    assert started[1] - submitted_at < 1.0


@contextlib.contextmanager
def late_reply(rt: Any, op: Any, *, shield: bool = False) -> Iterator[LateReply]:
    """`rt`'s executor a `LateReply` for `op` while the block runs."""
    late = LateReply(rt._db, op, shield=shield)
    rt._db = late
    try:
        yield late
    finally:
        rt._db = late._inner


async def slow_reply(ctx: DrainContext) -> None:
    """A drain that takes its inputs and answers slowly (5 s), its reply open meanwhile."""
    await ctx.take_inputs()
    reply = await ctx.begin_assistant()
    await reply.append_text("thinking")
    await trio.sleep(5)
    await reply.finish()


def reply_errors(messages: list[Message]) -> list[str | None]:
    """Each assistant reply's error, in order."""
    return [m.data.error for m in messages if isinstance(m.data, AssistantData)]


async def test_a_submit_committed_after_a_delete_is_not_stopped_by_it(
    store: Store, clock: Clock, autojump_clock: MockClock
) -> None:
    """delete_session and a submit to the same session race in one runtime: the delete's
    transaction commits first, then the submit's (which starts a fresh session and claims
    it here, §5.1), and the delete's caller resumes only after the submit's did (both ran in
    one group commit). The delete must not stop the fresh session's drain: its claim is not
    gone - it was taken after the delete. Instead `delete_session` calls `lose_claim` on
    whatever entry the session has now: the new drain never starts, and its live claim is
    left with nobody heartbeating it (orphaned, DESIGN §1, §6.15), until its lease runs out
    and recovery resumes it - the user's message waits a whole lease."""

    drain = Recorder()
    deleted = trio.Event()
    late: LateReply | None = None

    async def hook(claim: Any) -> None:
        if late is not None and late.committed.is_set():  # the fresh session's claim: its
            await deleted.wait()  # drain starts once the delete returned

    async with runtime(
        store, drain, clock, recovery_interval=1.0, lease=30.0, acquisition_hook=hook
    ) as rt:
        await rt.submit("s", {"n": 1}, input_id="i1")
        await rt.wait_idle("s")

        async def submit_after_the_delete_committed(late: LateReply) -> None:
            await late.committed.wait()
            await rt.submit("s", {"n": 2}, input_id="i2")
            late.answer.set()  # the executor woke the submit's caller first

        async def delete() -> None:
            await rt.delete_session("s")
            deleted.set()

        with late_reply(rt, _store.delete_session) as late:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(delete)
                nursery.start_soon(submit_after_the_delete_committed, late)
        with trio.move_on_after(5.0):
            while drain.taken != ["i1", "i2"]:
                await trio.sleep(0.1)
        assert drain.taken == ["i1", "i2"], "the fresh session's drain never started"


async def test_delete_session_never_stops_the_fresh_sessions_drain_started_after_it(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """A submit that lands after delete_session committed starts a fresh session (§5.1)
    and its drain; delete_session, once it runs again, must not take that new claim for
    the deleted one. It calls lose_claim on whatever entry the session has *now*: the
    fresh drain is cancelled as lease_lost and its live claim is left in the store with
    no drain and no heartbeat (orphaned, §1/§6.15) - the session is held for a whole lease
    and its input is only answered by recovery."""
    raw = Raw(db_path)
    finished: list[str] = []

    async def drain(ctx: DrainContext) -> None:
        inputs = await ctx.take_inputs()
        await trio.sleep(1)
        finished.extend(i.id for i in inputs)

    async with runtime(store, drain, clock, recovery_interval=3600) as rt:
        await rt.submit("s", {"n": 0}, input_id="i0")
        await rt.wait_idle("s")
        with late_reply(rt, _store.delete_session) as late:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(rt.delete_session, "s")
                await late.committed.wait()
                await rt.submit("s", {"n": 1}, input_id="i1")  # the fresh session's drain
                await trio.testing.wait_all_tasks_blocked()
                late.answer.set()
        await rt.wait_idle("s")
        assert raw.claim("s") is None
    assert finished == ["i0", "i1"]


async def test_on_busy_interrupt_never_stops_the_successor_that_took_its_input(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """submit(on_busy="interrupt") marks the running claim cancelling; if the owner acts on
    that before the submit's reply reaches it (here its heartbeat reads the phase; a
    thread hand-off leaves that window), the successor already took the interrupting
    input when the submit interrupts "the" local entry - the successor itself. Its answer
    to the new message is finished "interrupted" and nothing answers it (§6.23: exactly
    one successor takes every pending input - and answers it)."""

    async with runtime(store, slow_reply, clock, lease=3, recovery_interval=3600) as rt:
        await rt.submit("s", {"n": 1}, input_id="i1")
        await trio.testing.wait_all_tasks_blocked()
        with late_reply(rt, _store.submit_controlled) as late:
            async with trio.open_nursery() as nursery:
                interrupting = functools.partial(rt.submit, "s", {"n": 2}, on_busy="interrupt")
                nursery.start_soon(functools.partial(interrupting, input_id="i2"))
                await late.committed.wait()
                await trio.sleep(2)  # the heartbeat (1 s) stopped the drain; a successor took i2
                late.answer.set()
        await rt.wait_idle("s")
        messages = await rt.transcript("s")
    assert reply_errors(messages) == ["interrupted", None]


async def test_purge_deletes_only_idle_sessions_in_bounded_batches(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """purge(idle_for=) deletes every session with no claim, no pending input and no write
    for that long, however many (more than one batch), and keeps the others."""
    raw = Raw(db_path)
    gate = trio.Event()

    async def drain(ctx: DrainContext) -> None:
        await ctx.take_inputs()
        reply = await ctx.begin_assistant()
        if ctx.session_id == "busy":
            await gate.wait()
        await reply.finish()

    async with runtime(store, drain, clock) as rt:
        for index in range(250):
            await rt.submit(f"old-{index:03}", {"n": index})
        await rt.submit("scheduled", {"n": 1}, delay=10_000)
        await rt.submit("busy", {"n": 1})  # its drain holds a claim, writing nothing more
        for index in range(250):
            await rt.wait_idle(f"old-{index:03}")
        await trio.sleep(100)
        await rt.submit("recent", {"n": 1})
        await rt.wait_idle("recent")
        with pytest.raises(ValueError, match="idle_for"):
            await rt.purge(idle_for=-1)
        assert await rt.purge(idle_for=50) == 250
        assert await rt.purge(idle_for=50) == 0
        gate.set()
    names = [row[0] for row in raw.rows("SELECT id FROM session ORDER BY id")]
    assert names == ["busy", "recent", "scheduled"]


async def test_purge_keeps_a_session_whose_last_write_left_no_row_behind(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """A truncate ("edit and regenerate", its submit to follow), an input withdrawn, a
    resume and a quarantine dropped (its malformed message set aside, kept for the
    operator) are writes to an old session that leave no newer row or time behind: purge
    must count them, or it deletes the session - and what the user or operator just kept -
    before the next write lands."""
    raw = Raw(db_path)
    async with runtime(store, Recorder(), clock) as rt:
        for name in ("truncated", "truncated", "withdrawn", "resumed", "idle"):
            await rt.submit(name, {"n": 1})
            await rt.wait_idle(name)
        await rt.pause("resumed")
        reminder = await rt.submit("withdrawn", {"n": 2}, delay=1000)
        raw.seed_claim("dropped", "poison", expires_at=now_ms(clock) - 1)
        raw.seed_assistant("dropped", "poison", 1, '{"parts": [], "finished": "no"}')
        assert (await rt.recover_once()).quarantined == 1
        await trio.sleep(100)
        assert await rt.truncate("truncated", after_seq=1) == 1
        assert await rt.cancel_input(reminder)
        await rt.resume("resumed")
        await rt.release_quarantine("poison", resume=False)
        assert await rt.purge(idle_for=50) == 1
    names = [row[0] for row in raw.rows("SELECT id FROM session ORDER BY id")]
    assert names == ["dropped", "resumed", "truncated", "withdrawn"]


async def test_fork_copies_the_transcript_and_closes_an_unfinished_reply(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """fork copies messages seq <= through_seq (all when None) with the same seq, role and
    data; an unfinished reply is copied finished "interrupted"; ValueError when the new
    session exists; the source is untouched."""
    drain = HoldFirst()
    async with runtime(store, drain, clock) as rt:
        await rt.submit("s", {"text": "hi"})
        await drain.entered.wait()
        await rt.fork("s", "all")
        await rt.fork("s", "first", through_seq=1)
        with pytest.raises(ValueError, match="exists"):
            await rt.fork("s", "first")
        with pytest.raises(ValueError, match="does not exist"):
            await rt.fork("missing", "other")
        source = await rt.transcript("s")
        forked = await rt.transcript("all")
        first = await rt.transcript("first")
        drain.gate.set()
        await rt.wait_idle("s")
    assert [(m.seq, m.role) for m in forked] == [(1, "user"), (2, "assistant")]
    assert forked[0].data == source[0].data == {"text": "hi"}
    assert forked[1].data == AssistantData((TextPart("thinking"),), True, "interrupted")
    assert source[1].data == AssistantData((TextPart("thinking"),), False, None)
    assert [(m.seq, m.role, m.data) for m in first] == [(1, "user", {"text": "hi"})]


@pytest.mark.sqlite_only  # PostgreSQL's TEXT column cannot hold anything but text
@pytest.mark.parametrize("finished", [True, False], ids=["finished", "open"])
async def test_fork_of_a_message_that_is_not_utf8(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock, finished: bool
) -> None:
    """SQLite keeps whatever bytes another tool wrote as TEXT. fork copies a finished
    message that is not UTF-8 as it copies one that does not decode: the same bytes, so
    the fork's transcript names it malformed as the source's does. An open one, which fork
    must decode to close, is a MalformedRecord with nothing copied, as an open message
    that does not decode is. Both raised the driver's StoreError, naming no row."""
    drain = Recorder()
    async with runtime(store, drain, clock) as rt:
        await rt.submit("s", {"text": "hi"})
        await rt.wait_idle("s")
    raw = Raw(db_path)
    bad = "CAST(X'7B2274223A2280FF227D' AS TEXT)"
    raw.write(
        "INSERT INTO session_message(id, session_id, execution_id, role, seq, data,"
        f" finished, time_created, time_updated) VALUES ('m-bad', 's', 'e', 'assistant', 2,"
        f" {bad}, ?, 0, 0)",
        (int(finished),),
    )
    async with runtime(store, drain, clock) as rt:
        if finished:
            await rt.fork("s", "copy")
            for session in ("s", "copy"):
                with pytest.raises(MalformedRecord, match="not UTF-8 text"):
                    await rt.transcript(session)
        else:
            with pytest.raises(MalformedRecord, match="not UTF-8 text") as caught:
                await rt.fork("s", "copy")
            assert caught.value.key == "m-bad"
    stored = raw.rows("SELECT CAST(data AS BLOB) FROM session_message WHERE seq = 2")
    expected = [bytes.fromhex("7B2274223A2280FF227D")] * (2 if finished else 1)
    assert [row[0] for row in stored] == expected
    assert raw.rows("SELECT COUNT(*) FROM session WHERE id = 'copy'") == [(int(finished),)]


async def test_a_watcher_open_across_edits_and_deletes_keeps_nothing_of_messages_gone(
    store: Store, clock: Clock, autojump_clock: MockClock
) -> None:
    """A watcher left open while the conversation is edited again and again (truncate,
    regenerate) and finally deleted: it still gets each new reply, and it and its session's
    record in the runtime hold no entry for a message that no longer exists - their memory
    follows the transcript, not every message the watcher ever saw."""

    async def drain(ctx: DrainContext) -> None:
        for taken in await ctx.take_inputs():
            writer = await ctx.begin_assistant()
            await writer.append_text(f"re: {taken.payload['turn']}")
            await writer.finish()

    seen: list[Message] = []

    async def follow(watcher: trio_sessions._signals.Watcher) -> None:
        async for message in watcher:
            seen.append(message)

    async with runtime(store, drain, clock) as rt, rt.watch("s") as watcher:
        hub = rt._watchers._sessions["s"]
        for turn in range(20):
            if turn:
                assert await rt.truncate("s", after_seq=0) == 2  # edit and regenerate
            await rt.submit("s", {"turn": turn})
            await rt.wait_idle("s")
            rt._kick.set()  # the change loop's look, which finds the rewrite, now
            await trio.testing.wait_all_tasks_blocked()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(follow, watcher)
                await trio.testing.wait_all_tasks_blocked()
                nursery.cancel_scope.cancel()
            stored = await rt.transcript("s")
            present = {m.id for m in stored}
            reply = AssistantData((TextPart(f"re: {turn}"),), True, None)
            assert [m.id for m in seen if m.data == reply] == [stored[-1].id]
            assert set(hub.known) <= present and set(watcher._seen) <= present
        assert await rt.delete_session("s")
        rt._kick.set()  # the look that finds the transcript gone
        await trio.testing.wait_all_tasks_blocked()
        assert hub.known == {} and hub.open == {}
        assert watcher._seen == {}


class _HeldReplay(ExecutorSeam):
    """An executor whose replay reads (`watched_messages`) wait at `gate` once read."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.holding = False
        self.read_done = trio.Event()
        self.gate = trio.Event()

    async def read(self, op: Any, *args: Any) -> Any:
        result = await self._inner.read(op, *args)
        if op is _store.watched_messages and self.holding:
            self.holding = False
            self.read_done.set()
            await self.gate.wait()
        return result


async def test_a_replay_read_before_an_edit_offers_the_messages_gone_to_no_other_watcher(
    store: Store, clock: Clock, autojump_clock: MockClock
) -> None:
    """A watcher entering reads its history; the transcript is edited (regenerated at the
    same seqs) and the runtime forgets the messages removed before that read's answer is
    offered: those messages go to the entering watcher only (as they always did), never
    again to the watcher that had them already."""

    async def drain(ctx: DrainContext) -> None:
        for taken in await ctx.take_inputs():
            writer = await ctx.begin_assistant()
            await writer.append_text(f"re: {taken.payload['turn']}")
            await writer.finish()

    held = WrappedStore(store, _HeldReplay)
    got: list[Message] = []

    async def follow(watcher: trio_sessions._signals.Watcher) -> None:
        async for message in watcher:
            got.append(message)

    async def enter(rt: trio_sessions.Runtime) -> None:
        async with rt.watch("s"):
            pass

    async with runtime(held, drain, clock) as rt, rt.watch("s") as first:
        assert held.executor is not None
        await rt.submit("s", {"turn": 0})
        await rt.wait_idle("s")
        rt._kick.set()
        await trio.testing.wait_all_tasks_blocked()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(follow, first)
            await trio.testing.wait_all_tasks_blocked()
            held.executor.holding = True
            nursery.start_soon(enter, rt)
            await held.executor.read_done.wait()  # the second watcher's replay was read
            assert await rt.truncate("s", after_seq=0) == 2
            await rt.submit("s", {"turn": 1})  # regenerated, at the same seqs
            await rt.wait_idle("s")
            rt._kick.set()  # the look that finds the edit, and forgets the messages gone
            await trio.testing.wait_all_tasks_blocked()
            held.executor.gate.set()
            await trio.testing.wait_all_tasks_blocked()
            nursery.cancel_scope.cancel()
        turn_0 = AssistantData((TextPart("re: 0"),), True, None)
        assert [m.data for m in got].count(turn_0) == 1
        assert AssistantData((TextPart("re: 1"),), True, None) in [m.data for m in got]


async def test_truncate_deletes_after_seq_and_refuses_while_a_claim_is_held(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """truncate deletes the messages with seq > after_seq and returns how many; SessionBusy
    (nothing deleted) while a claim is held; then edit-and-regenerate works."""
    drain = HoldFirst()
    async with runtime(store, drain, clock) as rt:
        await rt.submit("s", {"text": "one"})
        await drain.entered.wait()
        with pytest.raises(SessionBusy):
            await rt.truncate("s", after_seq=0)
        assert len(await rt.transcript("s")) == 2
        drain.gate.set()
        await rt.wait_idle("s")
        await rt.submit("s", {"text": "two"})
        await rt.wait_idle("s")
        assert len(await rt.transcript("s")) == 4
        assert await rt.truncate("s", after_seq=2) == 2
        assert await rt.truncate("s", after_seq=2) == 0
        await rt.submit("s", {"text": "two, edited"})
        await rt.wait_idle("s")
        messages = await rt.transcript("s")
    assert [(m.seq, m.role) for m in messages] == [
        (1, "user"),
        (2, "assistant"),
        (3, "user"),
        (4, "assistant"),
    ]
    assert messages[2].data == {"text": "two, edited"}


async def test_control_calls_validate_their_arguments_before_any_write(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """Bad arguments raise TypeError/ValueError and write nothing."""
    async with runtime(store, None, clock) as rt:
        for call in (
            lambda: rt.pause(""),
            lambda: rt.resume(""),
            lambda: rt.delete_session(""),
            lambda: rt.fork("s", ""),
            lambda: rt.fork("s", "s"),
            lambda: rt.fork("s", "t", through_seq=-1),
            lambda: rt.truncate("s", after_seq=-1),
            lambda: rt.purge(idle_for=float("inf")),
        ):
            with pytest.raises(ValueError, match=r"session id|itself|_seq|idle_for"):
                await call()
        for bad in (
            lambda: rt.truncate("s", after_seq="1"),  # type: ignore[arg-type]
            lambda: rt.fork("s", "t", through_seq=1.5),  # type: ignore[arg-type]
            lambda: rt.purge(idle_for="1"),  # type: ignore[arg-type]
        ):
            with pytest.raises(TypeError):
                await bad()
    assert Raw(db_path).rows("SELECT id FROM session") == []


async def _transcript(store: Store, clock: Clock) -> list[Any]:
    async with trio_sessions.open_runtime(store, None, clock=clock) as reader:
        return await reader.transcript("s")


# --- migrations -------------------------------------------------------------------------------


async def test_upgrade_of_a_version_4_sqlite_file_keeps_pending_inputs_due(
    tmp_path: Path, autojump_clock: MockClock
) -> None:
    """A version-4 file (before conversation control) is upgraded on open: its pending
    input is due at once (due_at NULL) and its session not paused, so a drain takes it."""
    import sqlite3

    from trio_sessions import _sqlite

    path = tmp_path / "v4.db"
    old = sqlite3.connect(path)
    for version in (1, 2, 3, 4):
        old.executescript(_sqlite._MIGRATIONS[version])
    old.execute("PRAGMA user_version = 4")
    old.execute(
        "INSERT INTO session(id, time_created, time_woken, input_seq) VALUES ('s', 0, 0, 1)"
    )
    old.execute(
        "INSERT INTO session_input(id, session_id, seq, payload, time_created)"
        " VALUES ('old', 's', 1, '{}', 0)"
    )
    old.commit()
    old.close()
    drain = Recorder()
    async with trio_sessions.open_runtime(trio_sessions.testing.inline_store(path), drain) as rt:
        await rt.wait_idle("s")
    raw = Raw(path)
    assert raw.rows("PRAGMA user_version") == [(_sqlite.SCHEMA_VERSION,)] == [(9,)]
    assert drain.taken == ["old"]
    assert raw.rows("SELECT time_paused FROM session") == [(None,)]


async def test_upgrade_of_a_version_2_postgres_schema_keeps_pending_inputs_due(
    pg_url: str, pg_schema: str
) -> None:
    """A version-2 PostgreSQL schema is upgraded on open: its pending input is due at once
    and its session not paused, so a drain takes it."""
    import psycopg
    from backends import PgLocation

    from trio_sessions import _postgres

    with psycopg.connect(pg_url, autocommit=True, options=f"-c search_path={pg_schema}") as conn:
        build_pg_schema(conn, 2)
        conn.execute(
            "INSERT INTO session(id, time_created, time_woken, input_seq) VALUES ('s', 0, 0, 1)"
        )
        conn.execute(
            "INSERT INTO session_input(id, session_id, seq, payload, time_created)"
            " VALUES ('old', 's', 1, '{}', 0)"
        )
    drain = Recorder()
    store = _postgres.PostgresStore(pg_url, schema=pg_schema)
    with trio.fail_after(30):
        async with trio_sessions.open_runtime(store, drain) as rt:
            await rt.wait_idle("s")
    raw = Raw(PgLocation(pg_url, pg_schema))
    assert raw.rows("SELECT version FROM schema_version") == [(_postgres.SCHEMA_VERSION,)]
    # 3: owner liveness; 4: conversation control; 5: the server-side functions; 6: one
    # notification per transaction, the set-wise append, watchers-only signals
    # 7: a cancelling claim's iteration end rings for untaken inputs;
    # 8: a stream's read in one call; 9: set-wise recovery and iteration ends;
    # 10: set-wise submits and acquires, the change scan and a recovery pass's scan and
    # leases each in one call; 11: a batch's session locks through one function;
    # 12: the conversation controls, a transcript read, a tool change each in one call;
    # recovery's takeover alone in autocommit; 13: an acquire never waits for a busy session;
    # 14: an iteration's end alone in autocommit, its release read back by execution id
    # 15: a batch's submits in one call, many streams' reads set-wise;
    # 16: a session's lock key of 64 bits; 17: seeded with its schema;
    # 18: an interrupting submit and a delete name the claim they stop;
    # 19: a cancelled input's trace for a lost submit's retry;
    # 20: that trace answers only the retry of the call that stored the input;
    # 21: a double-texting submit with the claim it rings for in one call;
    # 22: a hand-back signals its sessions, the change look finds handed-back claims;
    # 23: a session's last write that left no newer row or time (purge counts it);
    # 24: a submit racing another session's submit of its input id is answered after it;
    #     a take of inputs returns the user messages it appended;
    # 25: a writer's write from what it stored last checks the stored text too;
    # 26: an operation that took a session's lock and ends without claiming or signalling it
    #     signals it when an acquire waits for it; an input count below 0 is refused;
    # 27: so does a drain's write whose claim is gone (a zombie's, answered lease_lost)
    # 28: a cancel's trace keeps no payload and goes after ten minutes in a recovery pass;
    # 29: the endings read an execution's maybe-open messages as `finished <> 1`;
    # 30: a stream's read of the messages it missed sends about NEW_BYTES_PER_READ of them;
    #     a delete's lease-row delete follows its claim's (a racing scan's lease goes too);
    #     an interrupt (or a submit that interrupts) leaves a quarantined claim as it is
    # 31: an interrupt marks another owner's claim whether or not its lease ran out
    #     and a stream's read sends at most 1,000 appends
    # 32: it marks one whose lease ran out handed back too (a pass finishes it at once)
    assert _postgres.SCHEMA_VERSION == 32
    assert drain.taken == ["old"]
    assert raw.rows("SELECT time_paused FROM session") == [(None,)]


async def test_on_busy_interrupt_never_passes_on_to_the_successor_through_an_acquisition(
    store: Store, clock: Clock, autojump_clock: MockClock
) -> None:
    """Another runtime holds the session; here an acquisition of it is in flight (a wake's,
    answered late: the thread hand-off's window) when submit(on_busy="interrupt") marks the
    holder's claim cancelling. The submit then interrupts "the entry it saw before its
    transaction" - the acquisition, whose claim it never marked (it held none). That
    acquisition turns out not to claim and passes the interrupt on to whatever claim the
    session has by then: the holder's successor, which already took the interrupting input.
    Its answer is finished "interrupted" and nothing answers the input (§6.23: exactly one
    successor takes every pending input)."""

    async with (
        runtime(store, slow_reply, clock, lease=3, recovery_interval=3600) as holder,
        runtime(store, slow_reply, clock, lease=3, recovery_interval=3600) as rt,
    ):
        await holder.submit("s", {"n": 1}, input_id="i1")
        await trio.testing.wait_all_tasks_blocked()
        with late_reply(rt, _store.wake_and_acquire) as late:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(rt.wake, "s")  # does not claim: the holder's row is there
                await late.committed.wait()
                await rt.submit("s", {"n": 2}, input_id="i2", on_busy="interrupt")
                await trio.sleep(2)  # the holder's heartbeat stopped it; its successor took i2
                late.answer.set()
        await trio.sleep(10)
        await holder.wait_idle("s")
        await rt.wait_idle("s")
        messages = await holder.transcript("s")
    assert reply_errors(messages) == ["interrupted", None]


async def test_delete_session_stops_the_drain_of_a_claim_it_removed_while_acquiring(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """A submit's acquisition is sent (and commits: it claims) before delete_session is
    sent, and its reply reaches the submit's caller late (the thread hand-off's window).
    The delete removes that claim, yet it leaves the entry alone - it was not owned yet
    when the delete was sent - so the drain of the deleted claim starts after
    delete_session returned and runs its side effects (an external call) until the change
    scan's fallback poll (2 s) or its first fenced write notices (DESIGN §5.1: the delete
    interrupts the running drain; §6.25)."""
    raw = Raw(db_path)
    side_effects: list[str] = []

    async def drain(ctx: DrainContext) -> None:
        await trio.sleep(1)  # an external call (a model, a webhook) before any write
        side_effects.append(ctx.execution_id)
        await ctx.take_inputs()

    async with runtime(store, drain, clock, recovery_interval=3600) as rt:
        with late_reply(rt, _store.submit_and_acquire) as late:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(functools.partial(rt.submit, "s", {"n": 1}, input_id="i1"))
                await late.committed.wait()  # claimed; the reply is on its way
                assert await rt.delete_session("s") is True
                assert raw.claim("s") is None
                late.answer.set()
        await rt.wait_idle("s")
    assert side_effects == []
