"""Section `takeover`: a SIGKILLed owner's sessions resumed by another runtime (DESIGN §7,
§4 "Owner liveness"): p50 <= 1 s, p99 <= 2 s at the default 30 s lease, per backend; and a
rolling restart's, the owner stopped gracefully (SIGTERM: its drains cancelled, their
claims handed back), which another runtime takes over at the hand-back's signal - before
the takeover grace a dead owner's claims wait out.

Each round starts an owner process (a fresh interpreter running a runtime with the default
lease and takeover grace) that claims N sessions and holds them in drains that never return;
this process runs another runtime, also with the library's defaults, on the same store. Once
every claim is held, the owner gets SIGKILL (or SIGTERM, and closes its runtime); a figure
is the time from just before the signal to a resumed drain starting here, one per session.
Both processes read `time.monotonic()` (CLOCK_MONOTONIC, system-wide on Linux).
"""

from __future__ import annotations

import inspect
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from .._backend import StoreBackend
from .._runtime import DrainContext, open_runtime
from .._sqlite import SQLiteStore
from .config import Config
from .remote import store_from_spec, store_spec
from .report import Report, percentile, progress, verdict
from .tools import child_command, child_env, ids

if TYPE_CHECKING:
    from .pg import PgSchemas  # psycopg is an optional extra

CLAIMS = 20
TAKEOVER_P50_MS = 1_000.0
TAKEOVER_P99_MS = 2_000.0
# The default takeover grace, which a hand-back need not wait out.
GRACE_MS = 1000 * inspect.signature(open_runtime).parameters["takeover_grace"].default
READY = "takeover-owner ready"
ROUND_TIMEOUT_S = 20.0


async def hold_claims(arguments: dict[str, Any]) -> None:
    """The owner's side (a child process): claim every session, hold each in a drain that
    never returns, say so on stdout, and wait to be killed - or, at SIGTERM, close the
    runtime (a graceful shutdown, as the worker command's)."""
    sessions: list[str] = arguments["sessions"]
    held = 0
    all_held = trio.Event()

    async def drain(ctx: DrainContext) -> None:
        nonlocal held
        held += 1
        if held == len(sessions):
            all_held.set()
        await trio.sleep_forever()

    with trio.open_signal_receiver(signal.SIGTERM) as stop:
        async with open_runtime(store_from_spec(arguments["store"]), drain) as runtime:
            async with trio.open_nursery() as nursery:
                for session_id in sessions:
                    nursery.start_soon(runtime.wake, session_id)
            await all_held.wait()
            print(READY, flush=True)
            async for _ in stop:
                break


async def takeover_round(
    store: StoreBackend, sessions: list[str], stop: signal.Signals = signal.SIGKILL
) -> list[float]:
    """One owner killed (or stopped: SIGTERM); seconds from the signal to each of its
    sessions resumed here."""
    started: dict[str, float] = {}
    all_in = trio.Event()

    async def drain(ctx: DrainContext) -> None:
        if ctx.resumed and ctx.session_id not in started:
            started[ctx.session_id] = time.monotonic()
            if len(started) == len(sessions):
                all_in.set()
        await trio.lowlevel.checkpoint()

    arguments = {"store": store_spec(store), "sessions": sessions}
    async with open_runtime(store, drain) as runtime:
        process = await trio.lowlevel.open_process(
            child_command("takeover", arguments), stdout=-1, env=child_env()
        )
        try:
            assert process.stdout is not None
            with trio.fail_after(ROUND_TIMEOUT_S):
                output = b""
                while READY.encode() not in output:
                    chunk = await process.stdout.receive_some()
                    if not chunk:
                        raise RuntimeError("the takeover owner exited before holding its claims")
                    output += chunk
            killed = time.monotonic()
            process.send_signal(stop)
            with trio.fail_after(ROUND_TIMEOUT_S):
                await all_in.wait()
        finally:
            if process.returncode is None:
                process.kill()
            with trio.CancelScope(shield=True):
                await process.wait()
                if process.stdout is not None:
                    await process.stdout.aclose()
        for session_id in sessions:
            await runtime.wait_idle(session_id)
    return [started[s] - killed for s in sessions]


async def _rounds(
    rounds: int, make_store: Callable[[int], StoreBackend], prefix: str, stop: signal.Signals
) -> tuple[float, float, float]:
    """`rounds` owners stopped by `stop`: p50, p99 and the longest of the takeovers, ms."""
    seconds: list[float] = []
    for index in range(rounds):
        seconds += await takeover_round(make_store(index), ids(f"{prefix}{index}", CLAIMS), stop)
    return percentile(seconds, 50) * 1000, percentile(seconds, 99) * 1000, max(seconds) * 1000


async def bench_takeover(
    config: Config, folder: Path, report: Report, schemas: PgSchemas | None
) -> None:
    progress(
        f"takeover: {config.takeover_rounds} owners x {CLAIMS} claims SIGKILLed, as many"
        " stopped gracefully, per backend"
    )
    stores: list[tuple[str, str, Any]] = [
        ("sqlite", "", lambda index: SQLiteStore(folder / f"takeover-{index}.db"))
    ]
    if schemas is not None:
        stores.append(("postgres", "pg_", lambda index: schemas.store(f"takeover_{index}")))
    for name, key, make_store in stores:
        p50, p99, worst = await _rounds(config.takeover_rounds, make_store, "t", signal.SIGKILL)
        report.add(
            "takeover",
            f"{name}: SIGKILLed owner -> its sessions resumed elsewhere (lease 30 s)",
            f"p50 {p50:.0f} ms / p99 {p99:.0f} ms (max {worst:.0f})",
            "the lease alone: ~30,000 ms",
            "",
            f"p50 <= {TAKEOVER_P50_MS:,.0f} ms, p99 <= {TAKEOVER_P99_MS:,.0f} ms",
            verdict(p50 <= TAKEOVER_P50_MS and p99 <= TAKEOVER_P99_MS),
        )
        report.machine[f"{key}takeover_p50_ms"] = p50
        report.machine[f"{key}takeover_p99_ms"] = p99
        p50, p99, worst = await _rounds(config.takeover_rounds, make_store, "r", signal.SIGTERM)
        report.add(
            "takeover",
            f"{name}: owner stopped gracefully (SIGTERM) -> its sessions resumed elsewhere",
            f"p50 {p50:.0f} ms / p99 {p99:.0f} ms (max {worst:.0f})",
            f"the takeover grace: {GRACE_MS:,.0f} ms",
            "",
            f"p99 < {GRACE_MS:,.0f} ms (at the signal)",
            verdict(p99 < GRACE_MS),
        )
        report.machine[f"{key}restart_p99_ms"] = p99
    report.notes.append(
        "takeover: defaults everywhere (lease 30 s, takeover_grace 0.5 s, recovery interval "
        "5 s); the resuming runtime notices the dead owner's released liveness token (a "
        "flock on SQLite, an advisory lock on PostgreSQL) by its liveness poll, waits the "
        "grace, and takes the claims over. A gracefully stopped owner (SIGTERM) hands its "
        "claims back once its drains exited; the hand-back's signal brings the resuming "
        "runtime's recovery pass at once (a rolling restart)."
    )
