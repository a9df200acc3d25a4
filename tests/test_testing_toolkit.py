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
from helpers import Recorder

import trio_sessions
from trio_sessions import DrainContext, testing

SECRET = "s3cret"
BOUND = 600.0  # virtual seconds: a hang fails the test instead of blocking it


async def answer(ctx: DrainContext) -> None:
    await ctx.take_inputs()
    reply = await ctx.begin_assistant()
    await reply.append_text("ok")
    await reply.finish()


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
        async with trio_sessions.open_runtime(store, answer, clock=clock) as rt:
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
    async with trio_sessions.open_runtime(store, answer, clock=clock) as rt:
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
            async with trio_sessions.open_runtime(store, answer, clock=clock) as rt:
                seams: dict[str, Any] = {seam: failing}
                testing.set_seams(rt, **seams)
                outcomes.append(await rt.run("s"))
                await trio.sleep(1)
    assert [o.kind for o in outcomes] in ([], ["succeeded"]), outcomes
