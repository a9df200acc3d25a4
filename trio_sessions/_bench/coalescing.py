"""Section `coalescing`: many wakes on one active session become at most two drain
iterations and no new task (DESIGN §7), beside a raw autocommit doorbell UPDATE per wake."""

from __future__ import annotations

import time
from pathlib import Path

import trio

from .._runtime import Runtime
from .config import Config
from .report import Report, fmt_us, progress, verdict
from .tools import HeldDrains, library_schema, now_ms, open_bench_runtime, raw_db


def raw_wakes(path: Path, session_id: str, n: int) -> float:
    """Baseline: one autocommit doorbell write per wake."""
    with raw_db(path) as conn:
        conn.execute("INSERT INTO session(id, time_created) VALUES (?, ?)", (session_id, now_ms()))
        started = time.perf_counter()
        for _ in range(n):
            conn.execute(
                "UPDATE session SET time_woken = COALESCE(time_woken, ?), wakes = wakes + 1"
                " WHERE id = ?",
                (now_ms(), session_id),
            )
        return time.perf_counter() - started


class SpawnCounter(trio.abc.Instrument):
    """Counts tasks spawned into one nursery (the runtime's) while installed."""

    def __init__(self, nursery: trio.Nursery) -> None:
        self.nursery = nursery
        self.spawned = 0

    def task_spawned(self, task: trio.lowlevel.Task) -> None:
        if task.parent_nursery is self.nursery:
            self.spawned += 1


async def coalesce_run(
    runtime: Runtime, held: HeldDrains, session_id: str, n: int, *, burst: bool
) -> tuple[float, int, int]:
    """Wakes on one active session; returns (seconds, drain iterations, tasks started)."""
    held.reset(1)
    await runtime.wake(session_id)
    await held.all_entered.wait()
    spawns = SpawnCounter(runtime._nursery)
    trio.lowlevel.add_instrument(spawns)
    try:
        started = time.perf_counter()
        if burst:
            async with trio.open_nursery() as nursery:
                for _ in range(n):
                    nursery.start_soon(runtime.wake, session_id)
        else:
            for _ in range(n):
                await runtime.wake(session_id)
        elapsed = time.perf_counter() - started
    finally:
        trio.lowlevel.remove_instrument(spawns)
    held.gate.set()
    await runtime.wait_idle(session_id)
    return elapsed, held.iterations, spawns.spawned


async def bench_coalescing(config: Config, folder: Path, report: Report) -> None:
    n = config.wakes
    progress(f"coalescing: {n} wakes on one active session")
    library_schema(folder / "wake-raw.db")
    raw_seconds = raw_wakes(folder / "wake-raw.db", "s", n)
    report.add(
        "coalescing", "raw autocommit doorbell UPDATE (baseline)", fmt_us(raw_seconds / n) + "/wake"
    )
    worst = 0
    for inline, modes in ((False, (False, True)), (True, (False,))):
        held = HeldDrains()
        name = "inline" if inline else "default"
        async with open_bench_runtime(folder / f"wake-{name}.db", held.drain, inline=inline) as rt:
            for burst in modes:
                seconds, iterations, tasks = await coalesce_run(
                    rt, held, f"s-{burst}", n, burst=burst
                )
                worst = max(worst, iterations)
                how = f"{n} concurrent" if burst else f"{n} sequential"
                report.add(
                    "coalescing",
                    f"{name} store, {how}: drain iterations",
                    f"{iterations} ({n / iterations:,.0f} wakes/iteration, {tasks} new tasks)",
                    "",
                    "",
                    "<= 2, 0 tasks",
                    verdict(iterations <= 2 and tasks == 0),
                )
                report.add(
                    "coalescing",
                    f"{name} store, {how}: time per wake",
                    fmt_us(seconds / n),
                    fmt_us(raw_seconds / n),
                    f"{raw_seconds / seconds:.2f}x",
                )
    report.machine["wakes_per_iteration"] = n / worst
