"""Two runtimes on one inline store (DESIGN §5 "`trio_sessions.testing`", README "Testing
your drains"): a producer runtime and a worker runtime in one test, as a user tests a web
process beside its workers. What the worker writes reaches the producer's `watch()` and
`stream()`, on both backends (§6.20), deterministically under the virtual clock.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import trio
import trio.testing
from helpers import SlowToExit, answer_ok

import trio_sessions

BOUND = 600.0  # virtual seconds: a hang fails the test instead of blocking it


async def test_a_producer_watches_what_another_runtime_writes(
    store: Any, clock: Callable[[], float], autojump_clock: trio.testing.MockClock
) -> None:
    """A producer submits and watches; a worker runtime on the same inline store answers.
    Before, on SQLite the producer's watcher never saw the worker's messages: the inline
    executor's change wait heeded only its own runtime's kick (PostgreSQL's saw them)."""
    seen: list[tuple[int, str]] = []
    with trio.fail_after(BOUND):
        async with (
            trio_sessions.open_runtime(store, None, clock=clock) as producer,
            trio_sessions.open_runtime(store, answer_ok, clock=clock) as worker,
            producer.watch("s") as updates,
        ):
            await producer.submit("s", {"text": "hi"})
            with trio.move_on_after(60):  # virtual seconds: far past any delivery
                async for message in updates:
                    seen.append((message.seq, message.role))
                    if message.role == "assistant" and message.data.finished:
                        break
            await worker.wait_idle("s")
    assert (2, "assistant") in seen, seen


async def test_a_producer_streams_what_another_runtime_writes(
    store: Any, clock: Callable[[], float], autojump_clock: trio.testing.MockClock
) -> None:
    """As above, for `stream()`: the producer's stream ends with the worker's finish."""
    kinds: list[tuple[int, str]] = []
    with trio.fail_after(BOUND):
        async with (
            trio_sessions.open_runtime(store, None, clock=clock) as producer,
            trio_sessions.open_runtime(store, answer_ok, clock=clock) as worker,
            producer.stream("s") as events,
        ):
            await producer.submit("s", {"text": "hi"})
            with trio.move_on_after(60):
                async for event in events:
                    kinds.append((event.seq, event.kind))
                    finished = event.kind == "message" and getattr(event.data, "finished", False)
                    if event.seq == 2 and (event.kind == "finish" or finished):
                        break
            await worker.wait_idle("s")
    assert any(seq == 2 for seq, _ in kinds), kinds


async def test_another_runtimes_interrupt_and_doorbell_arrive_within_a_fallback_look(
    store: Any, clock: Callable[[], float], autojump_clock: trio.testing.MockClock
) -> None:
    """The README's promise for runtimes on one inline store: a producer's submit starts
    the worker's drain, and its interrupt stops it, within 2 s of virtual time (the change
    loop's fallback look) - on SQLite before, only at the next recovery pass (5 s) and the
    next heartbeat (lease/3: 10 s)."""
    held = SlowToExit()
    held.may_exit.set()  # not slow: it exits as soon as it is cancelled

    with trio.fail_after(BOUND):
        async with (
            trio_sessions.open_runtime(store, None, clock=clock) as producer,
            trio_sessions.open_runtime(store, held, clock=clock, lease=30) as worker,
        ):
            await trio.sleep(1)  # clear of the worker's opening
            submitted = trio.current_time()
            await producer.submit("s", {"text": "hi"})
            await held.entered.wait()
            started_after = trio.current_time() - submitted
            interrupted = trio.current_time()
            assert await producer.interrupt("s")
            await held.exiting.wait()
            stopped_after = trio.current_time() - interrupted
            await worker.wait_idle("s")
    assert started_after <= 2.0, started_after
    assert stopped_after <= 2.0, stopped_after
