"""`trio_sessions.testing` used as a new user would, to test their own drain (DESIGN §5
"`trio_sessions.testing` (public)", README "Testing your drains"): only the public API
(`trio_sessions`, `trio_sessions.testing`), the inline stores and the virtual clock. Code
after `crash` runs on; a seam's error is the test's; misuse is refused at the call.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from helpers import Raw, Recorder, SlowToExit, answer_ok

import trio_sessions
from trio_sessions import DrainContext, testing

SECRET = "s3cret"
BOUND = 600.0  # virtual seconds: a hang fails the test instead of blocking it
LEASE = 30.0


async def test_crash_leaves_the_code_after_it_running(
    store: Any, clock: Callable[[], float], autojump_clock: trio.testing.MockClock
) -> None:
    """`crash(first)` while a second runtime is open inside first's block: the test goes on
    and sees the second runtime resume the session, instead of every line after the crash
    (the second runtime's block included) being cancelled silently - a vacuous pass."""
    drain = Recorder()
    gate = drain.hold()
    seen: list[list[bool]] = []
    with trio.fail_after(BOUND):
        async with trio_sessions.open_runtime(store, drain, clock=clock, lease=10) as first:
            await first.submit("s", {"n": 1})
            await drain.entered.wait()
            async with trio_sessions.open_runtime(
                store, drain, clock=clock, lease=10, recovery_interval=1
            ) as second:
                testing.crash(first)  # like SIGKILL of the first worker
                gate.set()
                await trio.sleep(15)  # past the lease: recovery in `second` resumes it
                await second.wait_idle("s")
                seen.append([call.resumed for call in drain.calls])
    assert seen == [[False, True]]


@pytest.mark.parametrize(
    "name",
    [f"host=127.0.0.1 dbname=app password={SECRET}", f"postgresql://app:{SECRET}@127.0.0.1:1/app"],
)
def test_inline_store_refuses_a_connection_string(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`inline_store(name)` with a PostgreSQL connection string (how a user would try to test
    on PostgreSQL) is not silently an SQLite file named after it: `ValueError` without the
    password (or a PostgreSQL store), and no file appears."""
    monkeypatch.chdir(tmp_path)
    made: object = None
    refusal = ""
    try:
        made = testing.inline_store(name)
    except ValueError as exc:
        refusal = str(exc)
    assert SECRET not in refusal
    if not refusal:
        assert not isinstance(made, trio_sessions.SQLiteStore), repr(made)
        assert SECRET not in repr(made)
    assert os.listdir(tmp_path) == []


async def test_set_seams_refuses_a_plain_function(
    store: Any, clock: Callable[[], float], autojump_clock: trio.testing.MockClock
) -> None:
    """A seam that is a plain `def` is refused by `set_seams` with `TypeError` (as a plain
    `def` drain is by `open_runtime`), not awaited later and blamed on the drain ("drain
    failed", outcome `failed` with "object NoneType can't be used in 'await' expression")."""
    with trio.fail_after(BOUND):
        async with trio_sessions.open_runtime(store, answer_ok, clock=clock) as rt:
            with pytest.raises(TypeError):
                testing.set_seams(rt, before_finish=lambda session_id: None)  # type: ignore[arg-type,return-value]
            outcome = await rt.run("s")
    assert outcome.kind == "succeeded", outcome


async def test_set_seams_refuses_a_producer(
    store: Any, clock: Callable[[], float], autojump_clock: trio.testing.MockClock
) -> None:
    """Seams installed on a producer (`drain=None`), which never drains or recovers, can never
    run: `set_seams` says so (an error) instead of accepting them, so a test waiting for the
    seam does not wait for ever."""

    async def reached(session_id: str) -> None:
        pass  # pragma: no cover

    async with trio_sessions.open_runtime(store, None, clock=clock) as producer:
        with pytest.raises((TypeError, ValueError, RuntimeError)):
            testing.set_seams(producer, before_finish=reached)


async def test_crash_refuses_a_closed_runtime(
    store: Any, clock: Callable[[], float], autojump_clock: trio.testing.MockClock
) -> None:
    """`crash(runtime)` after its block exited (a kill "too late": it already shut down
    gracefully and handed its claims back) raises instead of silently doing nothing."""
    async with trio_sessions.open_runtime(store, answer_ok, clock=clock) as rt:
        await rt.run("s")
    with pytest.raises(RuntimeError):
        testing.crash(rt)


@pytest.mark.parametrize("seam", ["before_finish", "after_finish"])
async def test_an_exception_in_a_seam_fails_the_test(
    seam: str, store: Any, clock: Callable[[], float], autojump_clock: trio.testing.MockClock
) -> None:
    """A failing assertion in a user's seam escapes the `open_runtime` block (as one in
    `before_recovery_apply` does), instead of becoming the drain's failure: outcome `failed`,
    logged "drain failed" / "claim attempt failed", a transcript without error, and a test
    that passes."""

    async def failing(session_id: str) -> None:
        raise AssertionError("the user's check in a seam")

    outcomes: list[trio_sessions.Outcome] = []
    with pytest.raises(AssertionError, match="the user's check in a seam"):  # noqa: PT012
        with trio.fail_after(BOUND):
            async with trio_sessions.open_runtime(store, answer_ok, clock=clock) as rt:
                seams: dict[str, Any] = {seam: failing}
                testing.set_seams(rt, **seams)
                outcomes.append(await rt.run("s"))
                await trio.sleep(1)
    assert [o.kind for o in outcomes] in ([], ["succeeded"]), outcomes


@pytest.mark.sqlite_only("the nursery restructure is backend-independent")
async def test_crash_ends_a_served_runtime(
    tmp_path: Path, clock: Callable[[], float], autojump_clock: trio.testing.MockClock
) -> None:
    """`crash` of a runtime opened with `nursery.start(serve_runtime, ...)` makes it vanish
    like a killed process: its task ends (its liveness token and store released), so the
    nursery that started it can close. Before 1fa29cc it did (the crash cancelled the block,
    serve_runtime's `sleep_forever`); now the runtime's tasks stop but serve_runtime sleeps on
    for ever - a crashed owner that still holds its token, and a test that never ends."""
    store = testing.inline_store(tmp_path / "sessions.db")
    entered = trio.Event()

    async def hold(ctx: DrainContext) -> None:
        await ctx.take_inputs()
        entered.set()
        await trio.sleep_forever()

    ended: list[bool] = []
    with trio.move_on_after(BOUND):
        async with trio.open_nursery() as nursery:
            rt = await nursery.start(
                lambda task_status: trio_sessions.serve_runtime(
                    store, hold, clock=clock, lease=LEASE, task_status=task_status
                )
            )
            await rt.submit("s", {"n": 1})
            await entered.wait()
            testing.crash(rt)  # like SIGKILL of the worker serving it
        ended.append(True)
    assert ended == [True], "the crashed serve_runtime task never ended"


@pytest.mark.sqlite_only("the crash tool's closing check is backend-independent")
async def test_crash_while_closing_waits_for_a_drain_keeps_its_claim(
    tmp_path: Path, clock: Callable[[], float], autojump_clock: trio.testing.MockClock
) -> None:
    """A worker's second signal "exits at once" (DESIGN §5 worker command) while its graceful
    shutdown still waits for a drain (past `shutdown_grace`, in a shielded cleanup): nothing
    was handed back yet, so `crash` then is the process killed mid-shutdown - its claim stays
    with a live lease. 326113c..ca5904a made every crash of a closing runtime a RuntimeError
    "(its claims handed back)", which is untrue here: the claim is still held by the drain."""
    path = tmp_path / "sessions.db"
    store = testing.inline_store(path)
    slow_to_exit = SlowToExit()  # a cleanup that outlives shutdown_grace
    refused: list[str] = []
    runtime: list[trio_sessions.Runtime] = []

    async def second_signal() -> None:
        await slow_to_exit.exiting.wait()  # the graceful shutdown has begun
        await trio.sleep(5)  # past shutdown_grace: the drain still holds its claim
        try:
            testing.crash(runtime[0])
        except RuntimeError as exc:
            refused.append(str(exc))
        slow_to_exit.may_exit.set()

    with trio.fail_after(BOUND):
        async with (
            trio.open_nursery() as nursery,
            trio_sessions.open_runtime(
                store, slow_to_exit, clock=clock, lease=LEASE, shutdown_grace=1
            ) as rt,
        ):
            runtime.append(rt)
            await rt.submit("s", {"n": 1})
            await slow_to_exit.entered.wait()
            nursery.start_soon(second_signal)
    assert refused == []
    [(expires_at,)] = Raw(path).rows("SELECT expires_at FROM session_execution")
    assert expires_at > clock() * 1000  # kept with its live lease, as a killed owner's


@pytest.mark.sqlite_only("the crash tool is backend-independent")
async def test_a_crashed_runtime_writes_nothing_more(
    tmp_path: Path, clock: Callable[[], float], autojump_clock: trio.testing.MockClock
) -> None:
    """`crash`: "every task stops and nothing more is written" - a killed process writes
    nothing. Since 1fa29cc the code after the crash runs on (to watch the takeover), but the
    crashed runtime's verbs still work: a `submit` through it (a test's slip of `first` for
    `second`) commits an input and a wake as the dead owner, and the test sees a store no
    killed worker could have left. Before, that code was cancelled before it could write;
    now a crashed runtime's verbs should refuse (or at least write nothing)."""
    path = tmp_path / "sessions.db"
    entered = trio.Event()

    async def hold(ctx: DrainContext) -> None:
        await ctx.take_inputs()
        entered.set()
        await trio.sleep_forever()

    with trio.fail_after(BOUND):
        async with trio_sessions.open_runtime(
            testing.inline_store(path), hold, clock=clock, lease=LEASE
        ) as first:
            await first.submit("s", {"n": 1})
            await entered.wait()
            testing.crash(first)
            with pytest.raises(trio_sessions.StoreError, match="crashed"):
                await first.submit("t", {"n": 2})  # the dead owner
    assert Raw(path).rows("SELECT session_id FROM session_input WHERE session_id = 't'") == []


async def test_a_runtime_crashed_in_its_recovery_seam_takes_nothing_over(
    db_path: Any, store: Any, clock: Callable[[], float], autojump_clock: trio.testing.MockClock
) -> None:
    """Killing an owner at a chosen step (DESIGN §5): `crash(second)` called from its own
    `before_recovery_apply` seam, as a test kills the recovery owner between taking its
    recovery leases and applying its decisions. A killed process writes nothing more, so
    the dead first owner's claim must stay as it was (for a later owner to recover once the
    recovery lease runs out). The takeover ran all the same - it is shielded, and only the
    public verbs looked at the crash - so the store showed a new execution of the crashed
    owner, its resume counted, which no killed worker could have left. Found combining the
    two tools as the README's testing section offers them."""
    drain = Recorder()
    drain.hold()
    crashed: list[bool] = []
    with trio.fail_after(BOUND):
        async with trio_sessions.open_runtime(store, drain, clock=clock, lease=10) as first:
            await first.submit("s", {"n": 1})
            await drain.entered.wait()
            [(dead_execution,)] = Raw(db_path).rows("SELECT id FROM session_execution")
            testing.crash(first)  # like SIGKILL of the first worker: its claim stays
            async with trio_sessions.open_runtime(
                store, drain, clock=clock, lease=10, recovery_interval=1
            ) as second:

                async def killed_here(execution_ids: list[str]) -> None:
                    testing.crash(second)  # the recovery owner dies at this step
                    crashed.append(True)

                testing.set_seams(second, before_recovery_apply=killed_here)
                await trio.sleep(15)  # past the lease: a pass of `second` reaches the seam
    assert crashed == [True]
    assert [call.resumed for call in drain.calls] == [False]
    rows = Raw(db_path).rows("SELECT id, owner_id FROM session_execution")
    assert [row[0] for row in rows] == [dead_execution], rows
    [(attempts,)] = Raw(db_path).rows("SELECT wake_attempts FROM session WHERE id = 's'")
    assert attempts == 0


@pytest.mark.sqlite_only("the crash tool is backend-independent")
@pytest.mark.parametrize("follow", ["watch", "stream"])
async def test_a_crash_ends_its_watchers_and_streams(
    tmp_path: Path, clock: Callable[[], float], autojump_clock: trio.testing.MockClock, follow: str
) -> None:
    """A `watch()` or `stream()` open on a runtime that `crash` kills ends, as it does when
    the runtime closes (nothing feeds it any more: its change loop died with the owner).
    Before, it waited for ever - a test that crashed a runtime while a watcher was open hung
    until its `fail_after`. Found by the last audit, crashing a watched owner."""
    drain = Recorder()
    drain.hold()
    ended = trio.Event()
    with trio.fail_after(BOUND):
        async with trio_sessions.open_runtime(
            testing.inline_store(tmp_path / "sessions.db"), drain, clock=clock, lease=LEASE
        ) as first:
            await first.submit("s", {"n": 1})
            await drain.entered.wait()
            following = first.watch("s") if follow == "watch" else first.stream("s")
            async with following as updates, trio.open_nursery() as nursery:

                async def read_to_the_end() -> None:
                    async for _ in updates:
                        pass
                    ended.set()

                nursery.start_soon(read_to_the_end)
                await trio.testing.wait_all_tasks_blocked()
                testing.crash(first)
                with trio.move_on_after(60):  # virtual seconds: far past any delivery
                    await ended.wait()
                nursery.cancel_scope.cancel()
    assert ended.is_set(), f"the {follow} of the crashed runtime waited for ever"


@pytest.mark.sqlite_only("the seams are backend-independent")
async def test_each_set_seams_call_replaces_every_seam(
    tmp_path: Path, clock: Callable[[], float], autojump_clock: trio.testing.MockClock
) -> None:
    """`set_seams` sets all its seams at each call (its docstring and the README say so): a
    second call naming only `after_finish` removes the `before_finish` of the first, which
    then never runs again. Pinned so the documented replacement cannot drift into a merge
    (or back) unnoticed; the last audit found it undocumented."""
    reached: list[str] = []

    async def before(session_id: str) -> None:
        reached.append("before_finish")

    async def after(session_id: str) -> None:
        reached.append("after_finish")

    with trio.fail_after(BOUND):
        async with trio_sessions.open_runtime(
            testing.inline_store(tmp_path / "sessions.db"), answer_ok, clock=clock
        ) as rt:
            testing.set_seams(rt, before_finish=before)
            await rt.run("s")
            testing.set_seams(rt, after_finish=after)
            await rt.run("s")
            testing.set_seams(rt)
            await rt.run("s")
    assert reached == ["before_finish", "after_finish"]
