"""Section `remote`: signals between processes (DESIGN §5.1, §7, §8). Another process - a
real second interpreter, a producer runtime on the same SQLite file or PostgreSQL schema -
submits to idle sessions, schedules inputs on them or interrupts running drains; this
process's runtime records when each drain starts, takes its scheduled input or is
cancelled. Both processes read `time.monotonic()`, which on Linux
is one system-wide clock (CLOCK_MONOTONIC), so latencies need no clock alignment.

Sends are paced 5-15 ms apart (random), so each lands at a random phase of SQLite's
`PRAGMA data_version` poll; latency counts from just before the sender's call (its own
commit included) to the drain starting (or its cancellation reaching the drain's
`finally`). A scheduled input's lateness counts from its due time as the sender sees it
(just before its call, plus the delay) to the drain taking it.
"""

from __future__ import annotations

import random
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import attrs
import trio

from .._backend import StoreBackend
from .._runtime import DrainContext
from .._sqlite import SQLiteStore
from .config import Config
from .report import Report, percentile, progress, verdict
from .tools import PAYLOAD, ids, open_bench_runtime, run_child

if TYPE_CHECKING:
    from .._postgres import PostgresStore
    from .pg import PgSchemas  # psycopg is an optional extra

PAUSE_S = 0.010
ARRIVAL_TIMEOUT_S = 30.0
WAKE_P50_MS = 5.0
WAKE_P99_MS = 50.0
DUE_LATE_P99_MS = 100.0
# Scheduled inputs fall due this long after their submit (random, so their due times land at
# random phases of the receiver's work), well after the submit's commit and its signal.
DELAY_S = (0.2, 0.4)


def store_spec(store: StoreBackend) -> dict[str, Any]:
    """How a child process opens the same store."""
    if isinstance(store, SQLiteStore):
        return {"sqlite": str(store.path)}
    postgres = cast("PostgresStore", store)
    return {"postgres": postgres.url, "schema": postgres.schema}


def store_from_spec(spec: dict[str, Any]) -> StoreBackend:
    if "postgres" in spec:
        from .._postgres import PostgresStore  # psycopg is an optional extra

        return PostgresStore(spec["postgres"], schema=spec["schema"])
    return SQLiteStore(Path(spec["sqlite"]))


async def send_remote(arguments: dict[str, Any]) -> dict[str, list[float]]:
    """The child's side: a producer runtime submits to (or interrupts) each session in
    turn; returns each call's start and return on the monotonic clock."""
    sent: dict[str, list[float]] = {}
    async with open_bench_runtime(store_from_spec(arguments["store"]), None) as rt:
        for session_id in arguments["sessions"]:
            await trio.sleep(PAUSE_S * random.uniform(0.5, 1.5))
            started = time.monotonic()
            if arguments["action"] == "submit":
                await rt.submit(session_id, PAYLOAD)
            elif arguments["action"] == "schedule":
                await rt.submit(session_id, PAYLOAD, delay=arguments["delays"][session_id])
            elif not await rt.interrupt(session_id):
                raise RuntimeError(f"interrupt of {session_id} was refused")
            sent[session_id] = [started, time.monotonic()]
    return sent


@attrs.define(eq=False)
class Arrivals:
    """First monotonic time each expected session reported; `all_in` when all have."""

    expected: int
    at: dict[str, float] = attrs.Factory(dict)
    all_in: trio.Event = attrs.Factory(trio.Event)

    def record(self, session_id: str) -> None:
        if session_id not in self.at:
            self.at[session_id] = time.monotonic()
            if len(self.at) >= self.expected:
                self.all_in.set()


@attrs.frozen
class Latencies:
    to_effect: list[float]  # seconds from the sender's call to the effect here
    call: list[float]  # seconds the sender's call itself took (its commit)


def _latencies(
    sent: dict[str, list[float]],
    arrivals: Arrivals,
    due_after: Mapping[str, float] | None = None,
) -> Latencies:
    """From each call's start (plus its session's `due_after`, seconds: a scheduled input's
    delay) to its effect here, and each call's own length."""
    after = due_after or {}
    return Latencies(
        [arrivals.at[s] - (start + after.get(s, 0.0)) for s, (start, _) in sent.items()],
        [end - start for start, end in sent.values()],
    )


async def remote_submits(store: StoreBackend, n: int) -> Latencies:
    """From another process's `submit()` to the drain starting here."""
    started = Arrivals(n)

    async def drain(ctx: DrainContext) -> None:
        started.record(ctx.session_id)
        await trio.lowlevel.checkpoint()

    sessions = ids("remote", n)
    async with open_bench_runtime(store, drain):
        sent = await run_child(
            "remote", {"store": store_spec(store), "action": "submit", "sessions": sessions}
        )
        with trio.fail_after(ARRIVAL_TIMEOUT_S):
            await started.all_in.wait()
    return _latencies(sent, started)


async def remote_scheduled(store: StoreBackend, n: int) -> Latencies:
    """From a scheduled input's due time (another process's `submit(..., delay=)`) to the
    drain here taking it: `to_effect` is the lateness."""
    taken = Arrivals(n)

    async def drain(ctx: DrainContext) -> None:
        if await ctx.take_inputs():
            taken.record(ctx.session_id)

    sessions = ids("due", n)
    delays = {session_id: random.uniform(*DELAY_S) for session_id in sessions}
    async with open_bench_runtime(store, drain):
        sent = await run_child(
            "remote",
            {
                "store": store_spec(store),
                "action": "schedule",
                "sessions": sessions,
                "delays": delays,
            },
        )
        with trio.fail_after(ARRIVAL_TIMEOUT_S):
            await taken.all_in.wait()
    return _latencies(sent, taken, delays)


async def remote_interrupts(store: StoreBackend, n: int) -> Latencies:
    """From another process's `interrupt()` to the owner's drain cancelled."""
    entered = Arrivals(n)
    cancelled = Arrivals(n)

    async def drain(ctx: DrainContext) -> None:
        entered.record(ctx.session_id)
        try:
            await trio.sleep_forever()
        finally:
            cancelled.record(ctx.session_id)

    sessions = ids("held", n)
    async with open_bench_runtime(store, drain) as rt:
        async with trio.open_nursery() as nursery:
            for session_id in sessions:
                nursery.start_soon(rt.wake, session_id)
        await entered.all_in.wait()
        sent = await run_child(
            "remote", {"store": store_spec(store), "action": "interrupt", "sessions": sessions}
        )
        with trio.fail_after(ARRIVAL_TIMEOUT_S):
            await cancelled.all_in.wait()
    return _latencies(sent, cancelled)


def _ms(values: list[float], q: float) -> float:
    return percentile(values, q) * 1000


async def bench_remote(
    config: Config, folder: Path, report: Report, schemas: PgSchemas | None
) -> None:
    n = config.remote
    progress(
        f"remote: {n} submits, {n} scheduled inputs and {n} interrupts from another process,"
        " per backend"
    )
    backends: list[tuple[str, str, StoreBackend, StoreBackend]] = [
        (
            "sqlite",
            "",
            SQLiteStore(folder / "remote-wake.db"),
            SQLiteStore(folder / "remote-int.db"),
        )
    ]
    if schemas is not None:
        backends.append(
            ("postgres", "pg_", schemas.store("remote_wake"), schemas.store("remote_int"))
        )
    for name, key, wake_store, interrupt_store in backends:
        wakes = await remote_submits(wake_store, n)
        p50, p99 = _ms(wakes.to_effect, 50), _ms(wakes.to_effect, 99)
        report.add(
            "remote",
            f"{name}: submit in another process -> drain starts",
            f"p50 {p50:.1f} ms / p99 {p99:.1f} ms (max {max(wakes.to_effect) * 1000:.1f})",
            f"the submit call itself: p50 {_ms(wakes.call, 50):.1f} ms",
            "",
            f"p50 <= {WAKE_P50_MS:g} ms, p99 <= {WAKE_P99_MS:g} ms",
            verdict(p50 <= WAKE_P50_MS and p99 <= WAKE_P99_MS),
        )
        report.machine[f"{key}wake_p50_ms"] = p50
        report.machine[f"{key}wake_p99_ms"] = p99
        due = await remote_scheduled(wake_store, n)
        late_p50, late_p99 = _ms(due.to_effect, 50), _ms(due.to_effect, 99)
        report.add(
            "remote",
            f"{name}: input scheduled in another process -> taken, after its due time",
            f"p50 {late_p50:.1f} ms / p99 {late_p99:.1f} ms late"
            f" (max {max(due.to_effect) * 1000:.1f})",
            f"due {DELAY_S[0]:g}-{DELAY_S[1]:g} s after the call",
            "",
            f"p99 <= {DUE_LATE_P99_MS:g} ms",
            verdict(late_p99 <= DUE_LATE_P99_MS),
        )
        report.machine[f"{key}due_late_p99_ms"] = late_p99
        interrupts = await remote_interrupts(interrupt_store, n)
        report.add(
            "remote",
            f"{name}: interrupt in another process -> drain cancelled",
            f"p50 {_ms(interrupts.to_effect, 50):.1f} ms / "
            f"p99 {_ms(interrupts.to_effect, 99):.1f} ms",
            f"the interrupt call itself: p50 {_ms(interrupts.call, 50):.1f} ms",
            "",
            "milliseconds, not a heartbeat",
            verdict(_ms(interrupts.to_effect, 50) <= WAKE_P50_MS),
        )
        if name == "sqlite":
            report.machine["remote_interrupt_p50_ms"] = _ms(interrupts.to_effect, 50)
    report.notes.append(
        "remote: the sender is a second interpreter with a producer runtime (`drain=None`) "
        "on the same store; the receiver's recovery pass never runs during the section "
        "(interval of an hour), so every pickup is the change signal's: SQLite polls "
        "`PRAGMA data_version`, PostgreSQL LISTENs."
    )
