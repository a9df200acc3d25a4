"""The PostgreSQL soak's worker process: one host serving the soak's schema, logging effects.

`python -m trio_sessions.soak --backend postgres --worker NAME`, spawned by the parent
(`postgres`), runs `open_runtime` on the soak's schema through its host's fault proxy, with
its wall clock offset by `--skew-ms`. Its drain answers numbered inputs (`common.answer`)
and logs every effect - the claim handoff, enter, take, each work step, a busy step's
blocking call, exit - as a line of its own effects file (`audit.Effect`): all the parent's
audit knows of the drains.

Invariants: an effect is logged after a checkpoint (a drain past its self-fencing deadline
is cancelled before it acts), except the busy step's blocking call, which lands whatever
happens; each line is one `os.write` to an O_APPEND file (atomic, also from a thread); a
claim's span begins in the acquisition hook, before its drain starts; the hook holds the
handoff only when the parent asked (`kill.NAME` / `stop.NAME` in the control directory) and
says so with `held.NAME`; a host that cannot open yet retries, one that fails after it
opened exits with the error.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import logging
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import attrs
import trio

from .._errors import LeaseLost, StoreError
from .._model import Claim
from .._postgres import PostgresStore
from .._runtime import DrainContext, Runtime
from . import audit, common

HANDOFF_KILL_HOLD = 60.0  # seconds a hook held for a SIGKILL waits for it
HANDOFF_STOP_HOLD = 0.5  # seconds a hook held for a SIGSTOP waits (it returns after SIGCONT)
WORK_STEP = 0.05  # seconds between two effects of a drain's work


@attrs.frozen(kw_only=True)
class WorkerConfig(common.WorkerConfig):
    url: str
    schema: str
    effects: Path
    skew_ms: int


def skew_wall_clock(offset_ms: int) -> None:
    """This process's wall clock runs `offset_ms` off (the host's clock is wrong)."""
    if not offset_ms:
        return
    real_time, real_time_ns = time.time, time.time_ns
    time.time = lambda: real_time() + offset_ms / 1000
    time.time_ns = lambda: real_time_ns() + offset_ms * 1_000_000


async def run_worker(config: WorkerConfig) -> None:
    """One host: a runtime whose drain answers numbered inputs, logging its effects."""
    skew_wall_clock(config.skew_ms)
    effects = os.open(config.effects, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    rng = random.Random()
    drains = itertools.count(1)
    control = config.control

    def log(kind: str, drain_id: str, ctx: DrainContext, **fields: Any) -> None:
        # Also from a busy step's thread: the context's ids are plain attributes, and one
        # os.write of a whole line to an O_APPEND file is atomic.
        now = time.monotonic()
        effect = audit.Effect(
            kind, drain_id, config.name, ctx.session_id, ctx.execution_id, now, **fields
        )
        os.write(effects, audit.effect_line(effect))

    async def effect(kind: str, drain_id: str, ctx: DrainContext, **fields: Any) -> None:
        # As an async side effect does: a checkpoint first, where a passed self-fencing
        # deadline cancels the drain, then the effect.
        await trio.lowlevel.checkpoint()
        log(kind, drain_id, ctx, **fields)

    async def hook(claim: Claim) -> None:
        # Inside the claim handoff: committed, drain not started. From here on the claim is
        # this execution's: its span (the audit's overlaps) begins now, not when its drain
        # first acts - another execution of the session acting later overlaps it.
        now = time.monotonic()
        held = audit.Effect(
            "claim", audit.CLAIM_DRAIN, config.name, claim.session_id, claim.execution_id, now
        )
        os.write(effects, audit.effect_line(held))
        marker = control / f"held.{config.name}"
        if (control / f"kill.{config.name}").exists():
            marker.write_text(claim.session_id)
            await trio.sleep(HANDOFF_KILL_HOLD)
        elif (control / f"stop.{config.name}").exists():
            marker.write_text(claim.session_id)
            await trio.sleep(HANDOFF_STOP_HOLD)

    async def busy_step(drain_id: str, ctx: DrainContext) -> None:
        # The chaos kills our token's connection as soon as the step began (`common`): a
        # blocking call lands its effect BUSY_BLOCK after that whatever we do (a drain
        # cancelled on the lost token exits only after it), then ordinary work follows,
        # which the lost token must have cancelled.
        began = time.monotonic()
        common.mark_busy(control, config.name)

        def blocking_call() -> None:
            time.sleep(max(0.0, began + common.BUSY_BLOCK - time.monotonic()))
            log("block", drain_id, ctx)

        await trio.to_thread.run_sync(blocking_call)
        for _ in range(round(common.BUSY_WORK / WORK_STEP)):
            await trio.sleep(WORK_STEP)
            await effect("work", drain_id, ctx)

    async def work(drain_id: str, ctx: DrainContext) -> None:
        # The work outside the database, in steps (a streamed reply, say): an effect after
        # every step, so a drain that outlives its lease is seen acting.
        if common.take_busy_request(control, config.name):
            await busy_step(drain_id, ctx)
            return
        left = rng.uniform(0.0, config.work_max)
        while left > 0:
            await common.do_work(rng, min(left, WORK_STEP))
            left -= WORK_STEP
            await effect("work", drain_id, ctx)

    async def drain(ctx: DrainContext) -> None:
        drain_id = f"{config.name}:{next(drains)}"
        status = "cancelled"
        try:
            await effect("enter", drain_id, ctx)
            await ctx.take_inputs()
            todo = common.unanswered(await ctx.transcript())
            if todo:
                await effect("take", drain_id, ctx, numbers=tuple(todo))
                await common.answer(
                    ctx, todo, f"work-{drain_id}", functools.partial(work, drain_id, ctx)
                )
            status = "ok"
        except LeaseLost:
            status = "lease_lost"
            raise
        except Exception:
            status = "failed"
            raise
        finally:
            log("exit", drain_id, ctx, status=status)

    store = PostgresStore(config.url, schema=config.schema)
    while True:
        opened: list[Runtime] = []
        try:
            await common.serve(store, drain, hook, config, rng, opened=opened.append)
            return  # SIGTERM: closed gracefully
        except StoreError as exc:
            if opened:
                raise
            # The host cannot reach the database yet (partitioned, or the server restarts):
            # a supervisor would start it again.
            print(f"soak worker {config.name}: cannot open yet: {exc}", flush=True)
            await trio.sleep(0.5)


def worker_main(args: argparse.Namespace) -> None:
    """The `--worker` side of `python -m trio_sessions.soak --backend postgres`."""
    config = WorkerConfig(
        name=args.worker,
        url=args.pg_url,
        schema=args.schema,
        control=Path(args.control),
        effects=Path(args.effects),
        sessions=args.sessions,
        lease=args.lease,
        recovery_interval=args.recovery_interval,
        work_max=args.work_max,
        interrupt_rate=args.interrupt_rate,
        skew_ms=args.skew_ms,
    )
    print(
        f"soak worker {config.name}: trio_sessions from {Path(__file__).parents[1]},"
        f" wall clock offset {config.skew_ms} ms",
        flush=True,
    )
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(EventFormatter(f"%(asctime)s {config.name} %(levelname)s %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    trio.run(run_worker, config)


class EventFormatter(logging.Formatter):
    """The runtime's events with their structured `extra` fields, for the worker's log."""

    STANDARD = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        extra = {k: v for k, v in vars(record).items() if k not in self.STANDARD}
        return f"{super().format(record)} {extra}" if extra else super().format(record)
