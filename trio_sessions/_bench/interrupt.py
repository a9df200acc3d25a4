"""Section `interrupt`: `interrupt()` in the owner's process to the drain's cancellation
and to the claim deleted, beside trio's own cancel latency and a raw two-transaction cycle."""

from __future__ import annotations

import time
from pathlib import Path

import attrs
import trio

from .._runtime import DrainContext
from .config import Config
from .report import Report, fmt_us, median, percentile, progress
from .tools import RAW_CLAIMS, ids, open_bench_runtime, raw_cycles, raw_db


@attrs.define(eq=False)
class InterruptibleDrains:
    entered: dict[str, trio.Event] = attrs.Factory(dict)
    cancelled_at: dict[str, float] = attrs.Factory(dict)

    async def drain(self, ctx: DrainContext) -> None:
        self.entered.setdefault(ctx.session_id, trio.Event()).set()
        try:
            await trio.sleep_forever()
        finally:
            self.cancelled_at[ctx.session_id] = time.perf_counter()


async def _held_in_scope(
    scope: trio.CancelScope, running: trio.Event, finished: list[float]
) -> None:
    with scope:
        try:
            running.set()
            await trio.sleep_forever()
        finally:
            finished.append(time.perf_counter())


async def trio_cancel_floor(n: int) -> list[float]:
    """Baseline: cancel a plain task's scope and time until its `finally` runs."""
    latencies = []
    for _ in range(n):
        scope, running = trio.CancelScope(), trio.Event()
        finished: list[float] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_held_in_scope, scope, running, finished)
            await running.wait()
            started = time.perf_counter()
            scope.cancel()
        latencies.append(finished[0] - started)
    return latencies


async def bench_interrupt(config: Config, folder: Path, report: Report) -> None:
    k = config.interrupts
    progress(f"interrupt: {k} interrupts per store")
    floor = await trio_cancel_floor(k)
    with raw_db(folder / "interrupt-raw.db") as raw:
        raw.executescript(RAW_CLAIMS)
        raw_cycles(raw, ids("warm", k))
        raw_seconds = raw_cycles(raw, ids("i", k)) / k
    for inline in (False, True):
        name = "inline" if inline else "default"
        drains = InterruptibleDrains()
        path = folder / f"interrupt-{name}.db"
        cancel, deleted = [], []
        async with open_bench_runtime(path, drains.drain, inline=inline) as rt:
            for session_id in ids("i", k):
                drains.entered[session_id] = trio.Event()
                await rt.wake(session_id)
                await drains.entered[session_id].wait()
                started = time.perf_counter()
                accepted = await rt.interrupt(session_id)
                await rt.wait_idle(session_id)
                finished = time.perf_counter()
                if not accepted:
                    raise RuntimeError(f"interrupt of {session_id} was refused")
                cancel.append(drains.cancelled_at[session_id] - started)
                deleted.append(finished - started)
        with raw_db(path) as conn:
            left = conn.execute("SELECT COUNT(*) FROM session_execution").fetchone()[0]
        if left:
            raise RuntimeError(f"{left} claims left after interrupts")
        report.add(
            "interrupt",
            f"{name} store: to drain cancelled, median / p99",
            f"{fmt_us(median(cancel))} / {fmt_us(percentile(cancel, 99))}",
            f"{fmt_us(median(floor))} / {fmt_us(percentile(floor, 99))} (trio cancel)",
        )
        report.add(
            "interrupt",
            f"{name} store: to claim deleted, median / p99",
            f"{fmt_us(median(deleted))} / {fmt_us(percentile(deleted, 99))}",
            f"{fmt_us(raw_seconds)} (raw 2 write tx)",
        )
