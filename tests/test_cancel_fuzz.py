"""Review findings: the runtime under interrupts and cancellation at awkward points.

Deterministic: inline store, autojump virtual clock, gates (a drain whose cleanup awaits in a
shielded `finally` holds the busy period in its stopping state while the test acts).
"""

from __future__ import annotations

from collections.abc import Callable

import trio
import trio.testing
from helpers import runtime, start_run
from trio.testing import MockClock

from trio_sessions import DrainContext, Store

Clock = Callable[[], float]


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
