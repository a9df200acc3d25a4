"""Section `cycle`: submit -> acquire -> no-op drain -> release against raw sqlite3.

Variants, interleaved per round: raw sqlite3 doing the library's durable writes in two
transactions (the like-for-like baseline of DESIGN §7: session row, input and claim, then
the claim's removal); the earlier, lighter raw cycle (claim and removal only), for
comparison; the trio floor - the same raw SQL driven from trio with one task per busy
period - one after another and with N in flight; the default (threaded, group-commit) and
inline stores one session after another and with N sessions in flight; and `serial` - one
task awaiting `submit()` in a loop while the drains it starts run (no `wait_idle` between
submits), whose rate is compared with the default store's sequential cycle of the same
round (DESIGN §7: no cliff when the loop is busy).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

from .._backend import Tx
from .._runtime import Runtime
from .config import Config
from .report import Report, fmt_rate, fmt_ratio, fmt_us, median, progress, verdict
from .tools import (
    PAYLOAD,
    RAW_CLAIMS,
    concurrent_cycles,
    ids,
    noop_drain,
    open_bench_runtime,
    raw_cycles,
    raw_db,
    raw_light_cycles,
    rotate,
    sequential_cycles,
    trio_floor_cycles,
    wait_all_idle,
)


async def serial_submits(runtime: Runtime, session_ids: Sequence[str]) -> tuple[float, float]:
    """One task submits to each session in turn without waiting for its drain; returns
    (seconds until the last submit returned, seconds until every drain released)."""
    started = time.perf_counter()
    for session_id in session_ids:
        await runtime.submit(session_id, PAYLOAD)
    submitted = time.perf_counter() - started
    await wait_all_idle(runtime)
    return submitted, time.perf_counter() - started


def _empty(tx: Tx) -> None:
    return None


async def empty_operation(runtime: Runtime, n: int = 500) -> float:
    """Median seconds of one empty store operation (BEGIN/COMMIT, nothing written): what
    reaching SQLite costs before any SQL, i.e. the hand-off for the threaded store."""
    rounds = []
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(n):
            await runtime._db.run(_empty)
        rounds.append((time.perf_counter() - started) / n)
    return median(rounds)


VARIANTS = [
    "raw",
    "raw_light",
    "floor",
    "floor_concurrent",
    "threaded",
    "inline",
    "threaded_concurrent",
    "inline_concurrent",
    "serial",
]


async def bench_cycle(config: Config, folder: Path, report: Report) -> None:
    per_round = max(1, config.cycles // config.rounds)
    progress(
        f"cycle: {config.rounds} rounds + warm-up, {per_round} sequential per variant "
        f"per round, {config.concurrent} in flight"
    )
    rates: dict[str, list[float]] = {}
    ratios: dict[str, list[float]] = {}
    serial_ratios: list[float] = []
    serial_to_idle: list[float] = []
    with raw_db(folder / "cycle-raw.db") as raw:
        raw.executescript(RAW_CLAIMS)
        async with (
            open_bench_runtime(folder / "cycle-threaded.db", noop_drain) as thr,
            open_bench_runtime(folder / "cycle-inline.db", noop_drain, inline=True) as inl,
        ):
            for round_ in range(config.rounds + 1):
                seconds: dict[str, float] = {}
                idle = 0.0
                for variant in rotate(VARIANTS, round_):
                    tag = f"{variant}-{round_}"
                    if variant == "raw":
                        seconds[variant] = raw_cycles(raw, ids(tag, per_round))
                    elif variant == "raw_light":
                        seconds[variant] = raw_light_cycles(raw, ids(tag, per_round))
                    elif variant == "floor":
                        seconds[variant] = await trio_floor_cycles(
                            raw, ids(tag, per_round), in_flight=False
                        )
                    elif variant == "floor_concurrent":
                        seconds[variant] = await trio_floor_cycles(
                            raw, ids(tag, config.concurrent), in_flight=True
                        )
                    elif variant == "threaded":
                        seconds[variant] = await sequential_cycles(thr, ids(tag, per_round))
                    elif variant == "inline":
                        seconds[variant] = await sequential_cycles(inl, ids(tag, per_round))
                    elif variant == "serial":
                        seconds[variant], idle = await serial_submits(thr, ids(tag, per_round))
                    else:
                        runtime = thr if variant.startswith("threaded") else inl
                        seconds[variant] = await concurrent_cycles(
                            runtime, ids(tag, config.concurrent)
                        )
                if round_ == 0:
                    continue  # warm-up
                counts = {
                    v: config.concurrent if "concurrent" in v else per_round for v in VARIANTS
                }
                round_rates = {v: counts[v] / seconds[v] for v in VARIANTS}
                for variant, rate in round_rates.items():
                    rates.setdefault(variant, []).append(rate)
                    ratios.setdefault(variant, []).append(rate / round_rates["raw"])
                serial_ratios.append(round_rates["serial"] / round_rates["threaded"])
                serial_to_idle.append(per_round / idle)
            if thr.active_sessions() or inl.active_sessions():
                raise RuntimeError("cycles left active sessions behind")
            hop = {name: await empty_operation(rt) for name, rt in (("thr", thr), ("inl", inl))}
    raw_rate = median(rates["raw"])
    report.add(
        "cycle",
        "raw sqlite3, the library's writes in 2 tx (baseline)",
        f"{fmt_rate(raw_rate)} = {fmt_us(1 / raw_rate)}",
    )
    light = median(rates["raw_light"])
    report.add(
        "cycle",
        "raw sqlite3, claim + removal only (earlier baseline)",
        f"{fmt_rate(light)} = {fmt_us(1 / light)}",
        fmt_rate(raw_rate),
        fmt_ratio(ratios["raw_light"]),
    )
    for variant, label in (
        ("floor", "trio floor: raw SQL from trio, a task per busy period, sequential"),
        ("floor_concurrent", f"trio floor, {config.concurrent} in flight"),
    ):
        rate = median(rates[variant])
        report.add(
            "cycle",
            label,
            f"{fmt_rate(rate)} = {fmt_us(1 / rate)}",
            fmt_rate(raw_rate),
            fmt_ratio(ratios[variant]),
            "no trio library beats it",
        )
    labels = {
        "threaded": ("default store, sequential", 0.4),
        "inline": ("inline store, sequential", 0.4),
        "threaded_concurrent": (f"default store, {config.concurrent} in flight", 1.0),
        "inline_concurrent": (f"inline store, {config.concurrent} in flight", 1.0),
    }
    for variant, (label, target) in labels.items():
        rate = median(rates[variant])
        ratio = median(ratios[variant])
        report.add(
            "cycle",
            label,
            f"{fmt_rate(rate)} = {fmt_us(1 / rate)}",
            fmt_rate(raw_rate),
            fmt_ratio(ratios[variant]),
            f">= {target}x",
            verdict(ratio >= target),
        )
    serial = median(rates["serial"])
    report.add(
        "cycle",
        "default store, one task submitting in a loop",
        f"{fmt_rate(serial)} submits ({fmt_rate(median(serial_to_idle))} to all released)",
        fmt_rate(median(rates["threaded"])) + " (sequential cycle)",
        fmt_ratio(serial_ratios),
        ">= 1.0x",
        verdict(median(serial_ratios) >= 1.0),
    )
    report.add(
        "cycle",
        "default store: one empty operation (hand-off)",
        fmt_us(hop["thr"]),
        fmt_us(hop["inl"]) + " (inline store)",
    )
    report.machine["raw_cycle_us"] = 1e6 / raw_rate
    report.machine["trio_floor_ratio"] = median(ratios["floor"])
    report.machine["trio_floor_concurrent_ratio"] = median(ratios["floor_concurrent"])
    report.machine["cycle_ratio"] = median(ratios["threaded"])
    report.machine["concurrent_ratio"] = median(ratios["threaded_concurrent"])
    report.machine["serial_ratio"] = median(serial_ratios)
    report.notes.append(
        "cycle: the library's cycle is 2 write transactions (submit with its claim, then "
        "finish); the raw baseline writes the same rows in 2 (session row, input and claim; "
        "the claim's removal) without fence reads; the trio floor runs that raw SQL from "
        "trio with one task per busy period and an Event back to the caller; sequential "
        "= `await submit(); await wait_idle()` per session; the drain does one checkpoint "
        "and takes no input. 'one task submitting in a loop' awaits `submit()` per session "
        "while the drains it started run; its ratio is against the default store's "
        "sequential cycle of the same round. 'one empty operation' is a store round trip "
        "with nothing written: for the default store, the trio -> worker thread hand-off."
    )
