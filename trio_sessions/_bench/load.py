"""Section `load`: work proportional to the change (DESIGN §6.26, §7) on SQLite.

* `watched_slowdown`: sequential cycles on other sessions while this runtime watches a
  session of `--watched-messages` messages, against the same cycles with no watch (paired
  rounds, order rotated; the median of per-round ratios, higher is slower);
* `backlog_stall_ms`: the longest event-loop stall - the longest single task step, wall
  clock, garbage collection included - while one session's drain takes a backlog of
  `--backlog` inputs by calling `take_inputs()` until it returns nothing. The same step
  in CPU time less Python's garbage collection is reported beside it (what the library
  itself holds the loop for, whatever else the machine runs).
"""

from __future__ import annotations

import gc
import json
import sqlite3
import time
from pathlib import Path
from typing import Any

import trio

from .._runtime import DrainContext, Runtime
from .config import Config
from .report import Report, median, progress, verdict
from .tools import ids, library_schema, noop_drain, open_bench_runtime, rotate, sequential_cycles

SLOWDOWN_TARGET = 1.2
STALL_TARGET_MS = 50.0


class StepMeter(trio.abc.Instrument):
    """The longest task step on the event loop's thread: wall clock, and CPU time less the
    time Python's cyclic garbage collector ran inside it (a full collection of a process
    holding 20,000 messages takes 20-30 ms here, whoever allocated last: not the library's
    work, and the same with any trio program). Use as a context manager; the bench and
    tests/test_work_per_change.py share it."""

    def __init__(self) -> None:
        self.longest_wall = 0.0
        self.longest_cpu = 0.0
        self._wall = time.perf_counter()
        self._cpu = time.thread_time()
        self._gc_started = 0.0
        self._gc = 0.0

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_started = time.thread_time()
        else:
            self._gc += time.thread_time() - self._gc_started

    def __enter__(self) -> StepMeter:
        gc.callbacks.append(self._on_gc)
        trio.lowlevel.add_instrument(self)
        return self

    def __exit__(self, *exc_info: object) -> None:
        trio.lowlevel.remove_instrument(self)
        gc.callbacks.remove(self._on_gc)

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self._wall = time.perf_counter()
        self._cpu = time.thread_time()
        self._gc = 0.0

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        self.longest_wall = max(self.longest_wall, time.perf_counter() - self._wall)
        self.longest_cpu = max(self.longest_cpu, time.thread_time() - self._cpu - self._gc)


def seed_transcript(path: Path, session_id: str, count: int) -> None:
    """A long conversation: `count` finished user messages, written directly."""
    library_schema(path)
    conn = sqlite3.connect(path)
    with conn:
        conn.execute("INSERT INTO session(id, time_created) VALUES (?, 0)", (session_id,))
        conn.executemany(
            "INSERT INTO session_message(id, session_id, role, seq, data, time_created,"
            " time_updated, finished) VALUES (?, ?, 'user', ?, ?, 0, 0, 1)",
            (
                (f"m{seq:08d}", session_id, seq, json.dumps({"text": f"message {seq}"}))
                for seq in range(1, count + 1)
            ),
        )
    # Copied into the database, as a backlog built up over time would be: the runtime does
    # not start by reading tens of MB of write-ahead log.
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()


def seed_backlog(path: Path, session_id: str, count: int) -> None:
    """`count` pending inputs on one session with its doorbell set (a burst of submits)."""
    library_schema(path)
    conn = sqlite3.connect(path)
    with conn:
        conn.execute(
            "INSERT INTO session(id, time_created, time_woken, wakes, input_seq)"
            " VALUES (?, 0, 1, 1, ?)",
            (session_id, count),
        )
        conn.executemany(
            "INSERT INTO session_input(id, session_id, seq, payload, time_created)"
            " VALUES (?, ?, ?, ?, 0)",
            (
                (f"i{seq:08d}", session_id, seq, json.dumps({"n": seq}))
                for seq in range(1, count + 1)
            ),
        )
    # Copied into the database, as a backlog built up over time would be: the runtime does
    # not start by reading tens of MB of write-ahead log.
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()


async def watched_cycles(rt: Runtime, session_ids: list[str], watched: int) -> float:
    async with rt.watch("big", after_seq=watched):
        return await sequential_cycles(rt, session_ids)


async def bench_load(config: Config, folder: Path, report: Report) -> None:
    n, messages = config.watched_cycles, config.watched_messages
    progress(
        f"load: {n} cycles with and without a watched {messages}-message session, "
        f"{config.rounds} rounds; a {config.backlog}-input backlog"
    )
    path = folder / "load-watched.db"
    seed_transcript(path, "big", messages)
    ratios: list[float] = []
    plain: list[float] = []
    async with open_bench_runtime(path, noop_drain) as rt:
        for round_ in range(config.rounds + 1):
            seconds: dict[str, float] = {}
            for variant in rotate(["plain", "watched"], round_):
                tag = f"{variant}-{round_}"
                if variant == "plain":
                    seconds[variant] = await sequential_cycles(rt, ids(tag, n))
                else:
                    seconds[variant] = await watched_cycles(rt, ids(tag, n), messages)
            if round_:
                ratios.append(seconds["watched"] / seconds["plain"])
                plain.append(seconds["plain"] / n)
        with StepMeter() as replay:
            async with rt.watch("big") as updates:
                async for message in updates:
                    if message.seq == messages:
                        break
    slowdown = median(ratios)
    report.add(
        "load",
        f"cycles on other sessions, a {messages}-message session watched",
        f"{slowdown:.2f}x the time ({median(plain) * 1e6:.0f} us/cycle unwatched)",
        "same cycles, no watch",
        f"{slowdown:.2f}x slower",
        f"<= {SLOWDOWN_TARGET}x",
        verdict(slowdown <= SLOWDOWN_TARGET),
    )
    report.add(
        "load",
        f"watch() replaying the {messages} messages: longest loop step",
        f"{replay.longest_wall * 1000:.1f} ms wall ({replay.longest_cpu * 1000:.1f} ms CPU"
        " less GC)",
        "",
        "",
        f"<= {STALL_TARGET_MS:g} ms",
        verdict(replay.longest_wall * 1000 <= STALL_TARGET_MS),
    )
    report.machine["watched_slowdown"] = slowdown
    stall, cpu, taken, seconds_taken = await backlog_stall(folder, config.backlog)
    report.add(
        "load",
        f"a {config.backlog}-input backlog taken: longest loop step",
        f"{stall * 1000:.1f} ms wall ({cpu * 1000:.1f} ms CPU less GC)",
        f"{taken} take_inputs() calls, {seconds_taken:.1f} s",
        "",
        f"<= {STALL_TARGET_MS:g} ms",
        verdict(stall * 1000 <= STALL_TARGET_MS),
    )
    report.machine["backlog_stall_ms"] = stall * 1000
    report.notes.append(
        "load: the watch is held by the runtime doing the cycles (its own commits to other "
        "sessions wake its change signal but are no look, as in production); a loop step is "
        "one task's run between two checkpoints, wall clock (GC pauses and other processes "
        "taking the CPU included), beside the same step's CPU time less garbage collection."
    )


async def backlog_stall(folder: Path, backlog: int) -> tuple[float, float, int, float]:
    """(longest step wall, longest step CPU less GC, take_inputs calls, seconds)."""
    path = folder / "load-backlog.db"
    seed_backlog(path, "backlog", backlog)
    calls = 0
    taken = 0

    async def drain(ctx: DrainContext) -> None:
        nonlocal calls, taken
        while batch := await ctx.take_inputs():
            calls += 1
            taken += len(batch)

    async with open_bench_runtime(path, drain) as rt:
        started = time.perf_counter()
        with StepMeter() as meter:
            await rt.run("backlog")
            await rt.wait_idle("backlog")
        seconds = time.perf_counter() - started
    if taken != backlog:
        raise RuntimeError(f"the backlog drain took {taken} of {backlog} inputs")
    return meter.longest_wall, meter.longest_cpu, calls, seconds
