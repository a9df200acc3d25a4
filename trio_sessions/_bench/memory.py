"""Section `memory`: RSS growth for idle sessions and per active drain, each measured in a
fresh child process, so one measurement's freed heap does not hide another's growth."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import trio
import trio.testing

from .config import Config
from .report import Report, progress, verdict
from .tools import (
    PAYLOAD_JSON,
    HeldDrains,
    ids,
    library_schema,
    now_ms,
    open_bench_runtime,
    raw_db,
    rss_kib,
    run_child,
    start_held_drains,
    wait_all_idle,
)


def seed_idle(path: Path, n: int) -> None:
    """`n` idle sessions (no doorbell, no claim) with one pending input each."""
    library_schema(path)
    now = now_ms()
    with raw_db(path) as conn:
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany(
            "INSERT INTO session(id, time_created, input_seq) VALUES (?, ?, 1)",
            ((f"idle-{i}", now) for i in range(n)),
        )
        conn.executemany(
            "INSERT INTO session_input(id, session_id, seq, payload, time_created)"
            " VALUES (?, ?, 1, ?, ?)",
            ((f"in-{i}", f"idle-{i}", PAYLOAD_JSON, now) for i in range(n)),
        )
        conn.execute("COMMIT")


async def measure_memory(mode: str, path: Path, n: int) -> dict[str, Any]:
    """One measurement; prints nothing itself. Modes: idle, active, bare."""
    gc.collect()
    if mode == "bare":
        # Baseline for a drain: a plain trio task blocked on an Event.
        gate = trio.Event()
        async with trio.open_nursery() as nursery:
            for _ in range(100):
                nursery.start_soon(gate.wait)
            await trio.lowlevel.checkpoint()
            gate.set()
        gate = trio.Event()
        gc.collect()
        before = rss_kib()
        async with trio.open_nursery() as nursery:
            for _ in range(n):
                nursery.start_soon(gate.wait)
            await trio.testing.wait_all_tasks_blocked()
            gc.collect()
            after = rss_kib()
            gate.set()
        return {"kib": after - before}
    held = HeldDrains()
    if mode == "idle":
        before = rss_kib()
        async with open_bench_runtime(path, held.drain, inline=False) as rt:
            await rt.recover_once()
            await rt._lease_keeper.renew_once()
            gc.collect()
            after = rss_kib()
            return {
                "kib": after - before,
                "active": len(rt.active_sessions()),
                "tasks": rt.statistics().tasks,
            }
    if mode == "active":
        async with open_bench_runtime(path, held.drain, inline=False) as rt:
            # Warm-up: threads, statement cache, first allocations.
            await start_held_drains(rt, held, ids("warm", 100))
            held.gate.set()
            await wait_all_idle(rt)
            gc.collect()
            before = rss_kib()
            await start_held_drains(rt, held, ids("active", n))
            gc.collect()
            after = rss_kib()
            tasks = rt.statistics().tasks
            held.gate.set()
            await wait_all_idle(rt)
            return {"kib": after - before, "tasks": tasks, "active": n}
    raise ValueError(f"unknown memory mode {mode!r}")


async def memory_child(mode: str, path: Path, n: int) -> dict[str, Any]:
    """Run `measure_memory` in a fresh interpreter; returns its JSON result."""
    return await run_child("memory", {"mode": mode, "path": str(path), "n": n})


async def bench_memory(config: Config, folder: Path, report: Report) -> None:
    progress(
        f"memory: {config.idle} idle sessions, {config.active} active drains (child processes)"
    )
    empty = folder / "memory-empty.db"
    library_schema(empty)
    idle_db = folder / "memory-idle.db"
    seed_idle(idle_db, config.idle)
    size_mib = idle_db.stat().st_size / 2**20
    base = await memory_child("idle", empty, 0)
    idle = await memory_child("idle", idle_db, config.idle)
    growth = idle["kib"] - base["kib"]
    report.add(
        "memory",
        f"open runtime over {config.idle:,} idle sessions + inputs",
        f"+{idle['kib'] / 1024:.1f} MiB ({idle['active']} active, {idle['tasks']} tasks)",
        f"+{base['kib'] / 1024:.1f} MiB over an empty store",
        f"{growth / 1024:+.1f} MiB",
        "≈ 0",
        verdict(growth < 4096 and idle["active"] == 0 and idle["tasks"] == base["tasks"]),
    )
    active = await memory_child("active", empty, config.active)
    bare = await memory_child("bare", empty, config.active)
    per_drain = active["kib"] * 1024 / config.active
    per_task = bare["kib"] * 1024 / config.active
    report.add(
        "memory",
        f"per active drain at {config.active:,} drains",
        f"{per_drain / 1024:.1f} KiB ({active['kib'] / 1024:.1f} MiB total)",
        f"{per_task / 1024:.1f} KiB (bare trio task)",
        f"{per_drain / max(per_task, 1):.1f}x",
    )
    report.notes.append(
        f"memory: idle store file {size_mib:.1f} MiB; SQLite's page cache is bounded "
        "(default 2 MiB per connection); growth = RSS after opening a runtime, one recovery "
        "pass and one heartbeat tick, minus the same over an empty store. Idle sessions have "
        "no doorbell, so recovery does not start them."
    )
