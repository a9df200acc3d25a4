"""Review of 68b31fe..248e8cb (the testing toolkit's crash and seams, the runtime's inner task
nursery, argument validation): each test fails on 248e8cb for the reason its docstring says.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

import pytest
import trio
import trio.testing
from helpers import Raw

import trio_sessions
from trio_sessions import DrainContext, testing

BOUND = 600.0  # virtual seconds: a hang fails the test instead of blocking it
LEASE = 30.0


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
    entered, cancelled, release = trio.Event(), trio.Event(), trio.Event()

    async def slow_to_exit(ctx: DrainContext) -> None:
        await ctx.take_inputs()
        entered.set()
        try:
            await trio.sleep_forever()
        finally:
            cancelled.set()
            with trio.CancelScope(shield=True):
                await release.wait()  # a cleanup that outlives shutdown_grace

    refused: list[str] = []
    runtime: list[trio_sessions.Runtime] = []

    async def second_signal() -> None:
        await cancelled.wait()  # the graceful shutdown has begun
        await trio.sleep(5)  # past shutdown_grace: the drain still holds its claim
        try:
            testing.crash(runtime[0])
        except RuntimeError as exc:
            refused.append(str(exc))
        release.set()

    with trio.fail_after(BOUND):
        async with (
            trio.open_nursery() as nursery,
            trio_sessions.open_runtime(
                store, slow_to_exit, clock=clock, lease=LEASE, shutdown_grace=1
            ) as rt,
        ):
            runtime.append(rt)
            await rt.submit("s", {"n": 1})
            await entered.wait()
            nursery.start_soon(second_signal)
    assert refused == []
    [(expires_at,)] = Raw(path).rows("SELECT expires_at FROM session_execution")
    assert expires_at > clock() * 1000  # kept with its live lease, as a killed owner's


@pytest.mark.sqlite_only("the hook check is backend-independent")
async def test_an_acquisition_hook_returning_an_awaitable_is_accepted(
    tmp_path: Path, clock: Callable[[], float], autojump_clock: trio.testing.MockClock
) -> None:
    """`acquisition_hook` is typed `Callable[[Claim], Awaitable[None]]` (`AcquisitionHook`):
    a plain callable that returns a coroutine - a lambda binding an argument, a decorator's
    sync wrapper - is exactly that, and it ran before adc97f4. `_validate.async_callable`
    (`inspect.iscoroutinefunction`) now refuses it with TypeError: only the plain `def`
    returning None, which the commit meant to refuse, should be."""
    seen: list[tuple[str, str]] = []

    async def record(claim: trio_sessions.Claim, tag: str) -> None:
        seen.append((tag, claim.session_id))

    async def take(ctx: DrainContext) -> None:
        await ctx.take_inputs()

    with trio.fail_after(BOUND):
        async with trio_sessions.open_runtime(
            testing.inline_store(tmp_path / "sessions.db"),
            take,
            clock=clock,
            acquisition_hook=lambda claim: record(claim, "traced"),
        ) as rt:
            await rt.submit("s", {"n": 1})
            await rt.wait_idle("s")
    assert seen == [("traced", "s")]


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
            with contextlib.suppress(Exception):  # refusing is one right answer
                await first.submit("t", {"n": 2})  # the dead owner
    assert Raw(path).rows("SELECT session_id FROM session_input WHERE session_id = 't'") == []


def test_an_sqlite_store_takes_a_pathlike_whose_name_has_an_equals_sign(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`SQLiteStore(path)` says SQLite explicitly, and an `os.PathLike` is a file system path
    by definition: `Path("run=1.db")` (a `key=value` run directory, as Hydra names them) is a
    file. d04bcb6's `check_sqlite_path` runs `store_kind` on it and refuses it as "a libpq
    connection string", whose advice - write it `./run=1.db` - pathlib cannot follow
    (`Path("./run=1.db")` is `run=1.db` again). It opened before; only `open_runtime(str)`
    has to guess."""
    monkeypatch.chdir(tmp_path)
    assert str(Path("./run=1.db")) == "run=1.db"
    store = trio_sessions.SQLiteStore(Path("./run=1.db"))
    assert Path(store.path) == Path("run=1.db")
