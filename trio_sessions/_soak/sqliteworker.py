"""The SQLite soak's worker process: a runtime on the soak's file, its drains in the audit.

`python -m trio_sessions.soak --worker NAME`, spawned by the parent (`sqlite`), runs
`open_runtime` on the soak's SQLite file. Its drain answers numbered inputs
(`common.answer`) and records each iteration in the audit tables of the same file through
its own connection (`Audit`): a `soak_drain` row on entry and its exit time and status on
the way out, the inputs it took (`soak_processed`); a busy step's blocking call runs in a
child process that outlives a SIGKILL and lands a `soak_child` row.

Invariants: a drain's entry row is written before its first durable effect and its exit is
written last, shielded from cancellation; the audit connection is used by one thread at a
time; the acquisition hook holds the claim handoff only when the parent asked
(`pause.NAME` in the control directory), says so with `paused.NAME`, and then waits for its
SIGKILL.
"""

from __future__ import annotations

import argparse
import functools
import random
import sqlite3
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import trio

from .._errors import LeaseLost
from .._model import Claim
from .._runtime import DrainContext, Runtime
from .._sqlite import SQLiteStore as Store
from . import common

HANDOFF_PAUSE = 60.0  # seconds a paused acquisition_hook waits for its SIGKILL

# A busy step's blocking call, run in a child process (`common` explains busy steps): it
# survives its worker's SIGKILL, lands its effect - a row of `soak_child`, the drain's last
# act - BUSY_BLOCK after it began, and exits (a cancelled drain terminates it first).
BLOCKING_CALL = """
import sqlite3, sys, time
db, drain_id, block, marker = sys.argv[1:]
began = time.time()
open(marker, "w").close()
time.sleep(max(0.0, began + float(block) - time.time()))
t = time.time()
sqlite3.connect(db, timeout=60.0, isolation_level=None).execute(
    "INSERT INTO soak_child(drain_id, t) VALUES (?, ?)", (int(drain_id), t)
)
"""


class Audit:
    """The drain's own connection to the audit tables (autocommit, one writer thread)."""

    def __init__(self, path: Path) -> None:
        self._conn = sqlite3.connect(
            path, timeout=60.0, isolation_level=None, check_same_thread=False
        )
        self._limiter = trio.CapacityLimiter(1)

    async def write(self, sql: str, params: Sequence[Any]) -> int:
        def run() -> int:
            return int(self._conn.execute(sql, params).lastrowid or 0)

        return await trio.to_thread.run_sync(run, limiter=self._limiter)

    async def write_many(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        def run() -> None:
            self._conn.executemany(sql, rows)

        await trio.to_thread.run_sync(run, limiter=self._limiter)


@attrs.frozen(kw_only=True)
class WorkerConfig(common.WorkerConfig):
    db: Path


async def run_worker(config: WorkerConfig) -> None:
    """One worker process: a runtime whose drain answers numbered inputs, plus random wakes."""
    audit = Audit(config.db)
    rng = random.Random()
    pause_flag = config.control / f"pause.{config.name}"
    paused_marker = config.control / f"paused.{config.name}"
    runtimes: list[Runtime] = []

    async def hook(claim: Claim) -> None:
        # Inside the claim handoff: committed, drain not started. The chaos loop asked for a
        # kill right here, so wait for it.
        if pause_flag.exists():
            paused_marker.write_text(claim.session_id)
            await trio.sleep(HANDOFF_PAUSE)

    async def work(row: int) -> None:
        if common.take_busy_request(config.control, config.name):
            marker = config.control / f"busy-now.{config.name}"
            block = str(common.BUSY_BLOCK)
            await trio.run_process(
                [sys.executable, "-c", BLOCKING_CALL, str(config.db), str(row), block, str(marker)]
            )
            return
        await common.do_work(rng, rng.uniform(0.0, config.work_max))

    async def drain(ctx: DrainContext) -> None:
        row = await audit.write(
            "INSERT INTO soak_drain(session_id, execution_id, worker, resumed, t_enter)"
            " VALUES (?, ?, ?, ?, ?)",
            (ctx.session_id, ctx.execution_id, config.name, int(ctx.resumed), time.time()),
        )
        status = "cancelled"
        try:
            await ctx.take_inputs()
            todo = common.unanswered(await runtimes[0].transcript(ctx.session_id))
            if todo:
                await audit.write_many(
                    "INSERT INTO soak_processed(n, drain_id, execution_id) VALUES (?, ?, ?)",
                    [(n, row, ctx.execution_id) for n in todo],
                )
                await common.answer(ctx, todo, f"work-{row}", functools.partial(work, row))
            status = "ok"
        except LeaseLost:
            status = "lease_lost"
            raise
        finally:
            t_exit = time.time()
            with trio.CancelScope(shield=True):  # the exit row is the audit's evidence
                await audit.write(
                    "UPDATE soak_drain SET t_exit = ?, status = ? WHERE id = ?",
                    (t_exit, status, row),
                )

    await common.serve(Store(config.db), drain, hook, config, rng, opened=runtimes.append)


def worker_main(args: argparse.Namespace) -> None:
    """The `--worker` side of `python -m trio_sessions.soak`."""
    config = WorkerConfig(
        name=args.worker,
        db=Path(args.db),
        control=Path(args.control),
        sessions=args.sessions,
        lease=args.lease,
        recovery_interval=args.recovery_interval,
        work_max=args.work_max,
        interrupt_rate=args.interrupt_rate,
    )
    trio.run(run_worker, config)
