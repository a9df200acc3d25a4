"""Section `idle`: the CPU an idle runtime uses (DESIGN §7: <= 1 % of a core), with the
library's default intervals (heartbeat, recovery pass, change signal), per backend.

Measured as this process's CPU time over wall time while nothing else runs in it: the
runtime's change loop (SQLite's `PRAGMA data_version` poll, PostgreSQL's LISTEN socket),
heartbeat and recovery timers are all that wake it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from .._backend import StoreBackend
from .._runtime import open_runtime
from .._sqlite import SQLiteStore
from .config import Config
from .report import Report, progress, verdict
from .tools import noop_drain

if TYPE_CHECKING:
    from .pg import PgSchemas  # psycopg is an optional extra

SETTLE_S = 0.3
TARGET_PCT = 1.0


async def idle_cpu_pct(store: StoreBackend, seconds: float) -> float:
    async with open_runtime(store, noop_drain):
        await trio.sleep(SETTLE_S)
        cpu, wall = time.process_time(), time.perf_counter()
        await trio.sleep(seconds)
        return (time.process_time() - cpu) / (time.perf_counter() - wall) * 100


async def bench_idle(
    config: Config, folder: Path, report: Report, schemas: PgSchemas | None
) -> None:
    progress(f"idle: {config.idle_seconds:g} s of an idle runtime, per backend")
    stores: list[tuple[str, StoreBackend]] = [("sqlite", SQLiteStore(folder / "idle.db"))]
    if schemas is not None:
        stores.append(("postgres", schemas.store("idle")))
    worst = 0.0
    for name, store in stores:
        pct = await idle_cpu_pct(store, config.idle_seconds)
        worst = max(worst, pct)
        report.add(
            "idle",
            f"{name}: idle runtime, CPU over {config.idle_seconds:g} s",
            f"{pct:.2f} % of a core",
            "",
            "",
            f"<= {TARGET_PCT:g} %",
            verdict(pct <= TARGET_PCT),
        )
    report.machine["idle_cpu_pct"] = worst
