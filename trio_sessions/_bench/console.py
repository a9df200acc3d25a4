"""Section `console`: one page of the operator console with 100,000 sessions in the store
(`--console-sessions`), SQLite and PostgreSQL (`console_page_ms`, `pg_console_page_ms`: the
slowest median of the first page, a page deep in the list and a search that matches nothing -
the whole render, the store's reads included)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from .. import _store
from .._console import PAGE_SIZE, Console, Guard
from .._runtime import Runtime
from .config import Config
from .report import Report, median, percentile, progress
from .tools import open_bench_runtime

REPEATS = 15
TARGET_MS = 200.0


def _seed_rows(n: int) -> list[tuple[Any, ...]]:
    return [(f"chat-{index:06d}", index, index if index % 7 == 0 else None) for index in range(n)]


async def _seed(runtime: Runtime, n: int) -> None:
    rows = _seed_rows(n)

    def insert(tx: Any) -> None:
        for start in range(0, len(rows), 5_000):
            for row in rows[start : start + 5_000]:
                tx.execute(
                    "INSERT INTO session(id, time_created, time_woken) VALUES (?, ?, ?)", row
                )

    await runtime._db.run(insert)
    count = await runtime._db.read(_store.store_counts)
    if count["sessions"] != n:
        raise RuntimeError(f"seeded {count['sessions']} sessions, wanted {n}")


async def _time_pages(console: Console, n: int) -> dict[str, list[float]]:
    queries = {
        "first page": {},
        "deep page": {"after": f"chat-{n * 9 // 10:06d}"},
        "search, no match": {"q": "no-such-session"},
    }
    timings: dict[str, list[float]] = {name: [] for name in queries}
    for _ in range(REPEATS):
        for name, query in queries.items():
            started = time.perf_counter()
            page = await console.sessions_page(query)
            timings[name].append((time.perf_counter() - started) * 1000)
            if name != "search, no match" and page.count(b"<tr data-session=") != PAGE_SIZE:
                raise RuntimeError(f"{name}: a page of {PAGE_SIZE} sessions was expected")
    return timings


async def _one_backend(store: Any, label: str, key: str, report: Report, n: int) -> None:
    async with open_bench_runtime(store, None) as runtime:
        started = time.perf_counter()
        await _seed(runtime, n)
        seconds = time.perf_counter() - started
        progress(f"console: {label}: {n} sessions seeded in {seconds:.1f} s")
        console = Console(runtime, label, Guard(None, read_only=False))
        timings = await _time_pages(console, n)
    worst = 0.0
    for name, values in timings.items():
        worst = max(worst, median(values))
        report.add(
            "console",
            f"{label}, {n} sessions: {name}, median / p99",
            f"{median(values):.1f} / {percentile(values, 99):.1f} ms",
            target=f"<= {TARGET_MS:.0f} ms",
            verdict="ok" if median(values) <= TARGET_MS else "MISSED",
        )
    report.machine[key] = round(worst, 2)


async def bench_console(config: Config, folder: Path, report: Report, schemas: Any) -> None:
    n = config.console_sessions
    progress(f"console: one page with {n} sessions, {REPEATS} times each")
    await _one_backend(folder / "console.db", "sqlite", "console_page_ms", report, n)
    if schemas is None:
        progress("console: PostgreSQL skipped (--no-pg)")
        return
    await _one_backend(schemas.store("console"), "postgres", "pg_console_page_ms", report, n)
