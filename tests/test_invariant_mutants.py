"""Invariants (DESIGN §6) whose enforcing line no other test pinned down deterministically:
each test here was written after a small mutation of that line survived the tests beside it
(or was caught only under some of trio's scheduling orders), and fails with it."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio
import trio.testing
from helpers import ExecutorSeam, LateReply, Raw, Recorder, WrappedStore, runtime, start_run
from trio.testing import MockClock

import trio_sessions
from trio_sessions import DrainContext, Outcome, Store, _store, testing

Clock = Callable[[], float]
ROOT = Path(__file__).resolve().parent.parent


async def test_a_wake_taken_to_go_on_is_rung_again_by_an_interrupt_answered_with_it(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """Invariant 7: a drain wakes its own session (no input) and returns; its iteration end
    takes that doorbell to go on, and the interrupt is accepted while that end is answered.
    No drain call answers the taken wake, so the interrupt's first step (`mark_cancelling`
    with the wake taken) rings it again and exactly one successor drains it. Without that
    ring the wake is gone: nothing pending re-arms it (the sweep over moments in
    test_runtime hits this window only under some scheduling orders)."""
    calls: list[str] = []

    async def drain(ctx: DrainContext) -> None:
        calls.append(ctx.execution_id)
        if len(calls) == 1:
            await rt.wake(ctx.session_id)

    wrapped = WrappedStore(store, lambda inner: LateReply(inner, _store.end_iteration, shield=True))
    async with runtime(wrapped, drain, clock) as rt:
        await rt.wake("s")
        assert wrapped.executor is not None
        await wrapped.executor.committed.wait()  # the end took the doorbell to go on
        assert Raw(db_path).rows("SELECT time_woken FROM session") == [(None,)]
        assert await rt.interrupt("s")
        wrapped.executor.answer.set()
        await rt.wait_idle("s")
        assert len(calls) == 2
        assert calls[0] != calls[1]  # a successor claim, not the interrupted one
    assert Raw(db_path).rows("SELECT id FROM session WHERE time_woken IS NOT NULL") == []
    assert Raw(db_path).rows("SELECT id FROM session_execution") == []


async def test_a_ring_after_an_interrupts_cleanup_committed_starts_one_successor(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """Invariants 7 and 9 at the interrupt's finish: a wake committed after the interrupt's
    cleanup deleted the claim (no input left, so the cleanup set no doorbell) rings the
    registry entry still held; the entry starts exactly one successor before it is
    released. Without it the durable doorbell waits, unclaimed, for a recovery pass."""
    drain = Recorder(take_inputs=False)
    gate = drain.hold()
    wrapped = WrappedStore(
        store, lambda inner: LateReply(inner, _store.finish_interrupted, shield=True)
    )
    async with runtime(wrapped, drain, clock) as rt:
        await rt.wake("s")
        await drain.entered.wait()
        assert await rt.interrupt("s")
        assert wrapped.executor is not None
        await wrapped.executor.committed.wait()
        assert Raw(db_path).rows("SELECT id FROM session_execution") == []
        drain.gate = None  # the successor's call returns at once
        await rt.wake("s")  # durable, then rings the entry still held
        wrapped.executor.answer.set()
        await rt.wait_idle("s")
        assert len(drain.calls) == 2
        assert Raw(db_path).rows("SELECT time_woken FROM session") == [(None,)]
        assert Raw(db_path).rows("SELECT id FROM session_execution") == []
    gate.set()


async def test_a_ring_after_a_failed_drains_finish_committed_starts_one_successor(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """Invariant 9 at a failed drain's finish: a wake committed after that finish deleted
    the claim rings the registry entry still held, and the entry starts exactly one
    successor before it is released (a failure re-arms nothing for untaken inputs, but this
    wake came after it). Without it the durable doorbell waits for a recovery pass."""
    calls: list[str] = []

    async def drain(ctx: DrainContext) -> None:
        calls.append(ctx.execution_id)
        if len(calls) == 1:
            raise RuntimeError("the first call fails")

    wrapped = WrappedStore(store, lambda inner: LateReply(inner, _store.finish_failed, shield=True))
    async with runtime(wrapped, drain, clock) as rt:
        await rt.wake("s")
        assert wrapped.executor is not None
        await wrapped.executor.committed.wait()
        assert Raw(db_path).rows("SELECT id FROM session_execution") == []
        await rt.wake("s")  # durable, then rings the entry still held
        wrapped.executor.answer.set()
        await rt.wait_idle("s")
        assert len(calls) == 2
        assert Raw(db_path).rows("SELECT time_woken FROM session") == [(None,)]
        assert Raw(db_path).rows("SELECT id FROM session_execution") == []


async def test_a_finished_busy_period_frees_its_registry_entry_and_place(
    store: Store, clock: Clock, autojump_clock: MockClock
) -> None:
    """Invariant 15, fast: once a busy period ends its registry entry is gone, so under
    `max_active=1` the next session runs here instead of being deferred. A leaked entry
    also makes the close wait for it forever (it once showed only as the suite's 300 s
    timeout), so a leak found here crashes the runtime, which closes without waiting."""
    drain = Recorder()
    async with runtime(store, drain, clock, max_active=1) as rt:
        first = await rt.run("a")
        second = await rt.run("b")
        leaked = rt.active_sessions()
        if leaked:
            testing.crash(rt)
    assert (first, second, leaked) == (Outcome("succeeded"), Outcome("succeeded"), frozenset())
    assert [ctx.session_id for ctx in drain.calls] == ["a", "b"]


async def test_resume_by_another_runtime_rings_for_inputs_a_drain_left_before_the_pause(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """Invariant 24 (`resume` starts exactly one busy period when work is pending) across
    runtimes: a drain left its input pending (its own choice, so no doorbell), then the
    session was paused. A producer's `resume` must set the doorbell durably - a signal
    alone names a session whose doorbell the worker's look finds unset, and the input
    would wait for the next wake that nobody sends."""
    calls: list[str] = []
    first, second = trio.Event(), trio.Event()

    async def drain(ctx: DrainContext) -> None:
        calls.append(ctx.execution_id)
        first.set()
        if len(calls) == 2:
            await ctx.take_inputs()
            second.set()

    async with (
        runtime(store, drain, clock) as worker,
        trio_sessions.open_runtime(store, None, clock=clock) as producer,
    ):
        await producer.submit("s", {"text": "later"}, input_id="i1")
        await first.wait()
        await worker.wait_idle("s")  # the first call took nothing
        assert len(calls) == 1
        await producer.pause("s")
        await producer.resume("s")
        assert Raw(db_path).one("SELECT time_woken FROM session")[0] is not None
        await second.wait()
        await worker.wait_idle("s")
    assert len(calls) == 2
    assert Raw(db_path).rows("SELECT id FROM session_input") == []


BACKEND_ID = re.compile(r"(?<=[\[-])(sqlite|postgres)(?=[\]-])")


def test_the_contract_tests_are_collected_on_both_backends() -> None:
    """Invariant 20: every test taking `store` (a contract test) runs on SQLite and on
    PostgreSQL; one marked `sqlite_only` runs once, on SQLite. Two contract files'
    collections must list the same tests under both backends, and the marked ones with
    neither. Found by mutation: a conftest that parametrised over SQLite alone passed the
    whole suite (every PostgreSQL variant silently gone)."""
    files = [ROOT / "tests" / "test_runtime.py", ROOT / "tests" / "test_control.py"]
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
        + [str(path) for path in files],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
    ).stdout
    on: dict[str, set[str]] = {"sqlite": set(), "postgres": set()}
    lines = [line for line in collected.splitlines() if "::" in line]
    for line in lines:
        if found := BACKEND_ID.search(line):
            on[found.group(1)].add(BACKEND_ID.sub("", line))
    marked = {
        f"{path.relative_to(ROOT)}::{node.name}"
        for path in files
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.AsyncFunctionDef | ast.FunctionDef)
        and any("sqlite_only" in ast.unparse(d) for d in node.decorator_list)
    }
    assert len(on["postgres"]) > 80
    assert on["sqlite"] == on["postgres"]
    with_id = {line.split("[")[0] for line in lines if BACKEND_ID.search(line)}
    without_id = {line.split("[")[0] for line in lines if not BACKEND_ID.search(line)}
    assert marked and marked <= without_id and marked.isdisjoint(with_id)


class HeldBeforeSending(ExecutorSeam):
    """The runtime's executor, whose first `op` is sent only once the test says so: a
    deciding transaction in flight (the thread hand-off's window before it runs)."""

    def __init__(self, inner: Any, op: Any) -> None:
        super().__init__(inner)
        self._op = op
        self.reached = trio.Event()
        self.send = trio.Event()

    async def run(self, op: Any, *args: Any) -> Any:
        if op is self._op and not self.reached.is_set():
            self.reached.set()
            await self.send.wait()
        return await self._inner.run(op, *args)


async def test_a_run_rung_while_an_iteration_end_is_in_flight_gets_the_iteration_it_joined(
    store: Store, clock: Clock, autojump_clock: MockClock
) -> None:
    """Invariant 8 for the caller: a `run` during the iteration end's transaction (its
    wake committed first, so that end takes it and continues) waits for a would-be
    successor, which merges into the continuing claim: the run gets that claim's outcome,
    `succeeded`. Unmerged, it was told `deferred` though its wake was drained right here
    (found by mutation of `SessionEntry.keep_going`)."""
    drain = Recorder(take_inputs=False)
    wrapped = WrappedStore(store, lambda inner: HeldBeforeSending(inner, _store.end_iteration))
    async with runtime(wrapped, drain, clock) as rt, trio.open_nursery() as nursery:
        await rt.wake("s")
        assert wrapped.executor is not None
        await wrapped.executor.reached.wait()  # the first call returned; its end waits
        outcomes = start_run(nursery, rt, "s")
        await trio.testing.wait_all_tasks_blocked()  # the run's wake committed and rang
        wrapped.executor.send.set()
        await rt.wait_idle("s")
    assert outcomes == [Outcome("succeeded")]
    assert len(drain.calls) == 2
    assert drain.calls[0].execution_id == drain.calls[1].execution_id
