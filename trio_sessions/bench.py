"""`python -m trio_sessions.bench`: the DESIGN §7 figures, each beside its raw-SQLite baseline.

One process run, one SQLite setting for every figure (WAL, `synchronous=NORMAL`, files in a
temporary folder on local disk), six sections:

1. cycle - submit -> acquire -> no-op drain -> release, one session after another and 1,000
   in flight, with the default (threaded, group-commit) store and the inline store, against
   raw `sqlite3` doing the same two write transactions;
2. coalescing - wakes on one active session -> drain iterations, µs per wake;
3. heartbeat - write transactions and worker hand-offs per tick with many active drains;
4. recovery - expired claims of a dead owner recovered to completion against a raw batched
   reclaim of the same rows;
5. memory - RSS growth for idle sessions and per active drain (measured in fresh child
   processes, so one section's freed heap does not hide another's growth);
6. interrupt latency - `interrupt()` to the drain's cancellation and to the claim deleted.

Method, as in `reference/perf-baseline.md`: figures that have a raw baseline are measured
in interleaved rounds (variant order rotates, a warm-up round is discarded) and a ratio is the
median of per-round ratios against the raw figure of the same round, so host drift cancels.
Ratios are "library rate / raw rate": higher is better, 1.0 is raw speed.

Prints a table and ends with one machine-readable line:
`cycle_ratio=… concurrent_ratio=… recovery_ratio=… heartbeat_tx_per_tick=… wakes_per_iteration=…`
(cycle ratios are the default store's). Timings are reported, never asserted.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import os
import platform
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import AbstractAsyncContextManager, contextmanager
from pathlib import Path
from typing import Any

import attrs
import trio
import trio.testing

from . import __version__, _sqlite
from ._backend import Tx
from ._runtime import DrainContext, Runtime, open_runtime
from ._sqlite import SQLiteStore as Store

SECTIONS = ("cycle", "coalescing", "heartbeat", "recovery", "memory", "interrupt")
MACHINE_KEYS = (
    "cycle_ratio",
    "concurrent_ratio",
    "recovery_ratio",
    "heartbeat_tx_per_tick",
    "wakes_per_iteration",
)
# Long enough that no background heartbeat or recovery pass lands inside a timed section:
# the bench calls both itself where it measures them.
QUIET = 3600.0
PAYLOAD: dict[str, Any] = {"text": "hello"}
PAYLOAD_JSON = json.dumps(PAYLOAD)


# ---------------------------------------------------------------------------------------------
# Configuration


@attrs.frozen
class Config:
    rounds: int
    cycles: int
    concurrent: int
    wakes: int
    heartbeat_drains: tuple[int, ...]
    heartbeat_ticks: int
    recovery: int
    recovery_rounds: int
    recovery_batch: int
    idle: int
    active: int
    interrupts: int
    sections: tuple[str, ...]
    folder: Path | None


FULL = {
    "rounds": 10,
    "cycles": 7000,
    "concurrent": 1000,
    "wakes": 10_000,
    "heartbeat_drains": "1000,10000",
    "heartbeat_ticks": 5,
    "recovery": 10_000,
    "recovery_rounds": 3,
    "recovery_batch": 100,
    "idle": 100_000,
    "active": 10_000,
    "interrupts": 300,
}
QUICK = {
    "rounds": 3,
    "cycles": 600,
    "concurrent": 200,
    "wakes": 1000,
    "heartbeat_drains": "100,1000",
    "heartbeat_ticks": 3,
    "recovery": 1000,
    "recovery_rounds": 2,
    "recovery_batch": 100,
    "idle": 10_000,
    "active": 1000,
    "interrupts": 50,
}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m trio_sessions.bench",
        description="trio_sessions performance figures against raw SQLite, in one run.",
    )
    parser.add_argument("--quick", action="store_true", help="small N everywhere (~20 s)")
    parser.add_argument("--rounds", type=int, help="cycle rounds after one warm-up (full: 10)")
    parser.add_argument(
        "--cycles", type=int, help="sequential cycles per variant, over all rounds (full: 7000)"
    )
    parser.add_argument("--concurrent", type=int, help="sessions in flight (full: 1000)")
    parser.add_argument("--wakes", type=int, help="wakes on one active session (full: 10000)")
    parser.add_argument(
        "--heartbeat-drains", help="comma-separated active drain counts (full: 1000,10000)"
    )
    parser.add_argument("--heartbeat-ticks", type=int, help="ticks timed per count (full: 5)")
    parser.add_argument("--recovery", type=int, help="expired claims to recover (full: 10000)")
    parser.add_argument("--recovery-rounds", type=int, help="paired recovery rounds (full: 3)")
    parser.add_argument("--recovery-batch", type=int, help="claims per recovery pass (100)")
    parser.add_argument("--idle", type=int, help="idle sessions with inputs (full: 100000)")
    parser.add_argument("--active", type=int, help="active drains for memory (full: 10000)")
    parser.add_argument("--interrupts", type=int, help="interrupts timed per store (full: 300)")
    parser.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help=f"comma-separated subset of {','.join(SECTIONS)}",
    )
    parser.add_argument(
        "--dir", type=Path, help="folder for the database files (default: a temp dir)"
    )
    # Internal: one memory measurement in a fresh process (see `_memory_child`).
    parser.add_argument(
        "--memory-child", nargs=3, metavar=("MODE", "DB", "N"), help=argparse.SUPPRESS
    )
    return parser.parse_args(argv)


def make_config(args: argparse.Namespace) -> Config:
    defaults = QUICK if args.quick else FULL
    values: dict[str, Any] = {}
    for key, default in defaults.items():
        given = getattr(args, key)
        values[key] = default if given is None else given
    drains = tuple(int(n) for n in str(values.pop("heartbeat_drains")).split(",") if n.strip())
    sections = tuple(s.strip() for s in args.sections.split(",") if s.strip())
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        raise SystemExit(f"unknown sections: {', '.join(sorted(unknown))}")
    for key, value in values.items():
        if int(value) < 1:
            raise SystemExit(f"--{key.replace('_', '-')} must be >= 1")
    return Config(heartbeat_drains=drains, sections=sections, folder=args.dir, **values)


# ---------------------------------------------------------------------------------------------
# Small tools


def rss_kib() -> int:
    """Resident set size of this process, KiB (Linux /proc)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("VmRSS not found in /proc/self/status")


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def rotate(items: Sequence[str], shift: int) -> list[str]:
    shift %= len(items)
    return [*items[shift:], *items[:shift]]


def raw_connect(path: Path) -> sqlite3.Connection:
    """A raw connection with the library's settings: WAL, synchronous=NORMAL, busy timeout."""
    conn = sqlite3.connect(path, isolation_level=None, timeout=_sqlite.BUSY_TIMEOUT_MS / 1000)
    conn.execute(f"PRAGMA busy_timeout = {_sqlite.BUSY_TIMEOUT_MS}")
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA synchronous = NORMAL")
    return conn


@contextmanager
def raw_db(path: Path) -> Iterator[sqlite3.Connection]:
    conn = raw_connect(path)
    try:
        yield conn
    finally:
        conn.close()


def library_schema(path: Path) -> None:
    """Create the library's schema in `path` (what `open_runtime` would create)."""
    _sqlite.connect(path).close()


def now_ms() -> int:
    return int(time.time() * 1000)


def ids(prefix: str, n: int) -> list[str]:
    return [f"{prefix}-{i}" for i in range(n)]


async def noop_drain(ctx: DrainContext) -> None:
    """The trivial drain of the baseline's trio variant: one checkpoint."""
    await trio.lowlevel.checkpoint()


def open_bench_runtime(
    path: Path,
    drain: Callable[[DrainContext], Awaitable[None]],
    *,
    inline: bool,
    wrap: Callable[[sqlite3.Connection], Any] | None = None,
) -> AbstractAsyncContextManager[Runtime]:
    return open_runtime(
        Store(path, inline=inline, wrap_connection=wrap),
        drain,
        lease=QUIET,
        recovery_interval=QUIET,
        recovery_batch=100,
    )


async def wait_all_idle(runtime: Runtime) -> None:
    while active := runtime.active_sessions():
        for session_id in active:
            await runtime.wait_idle(session_id)


def handoffs(runtime: Runtime) -> int | None:
    """Worker hand-offs plus lone-caller transactions run inline: each is one transaction."""
    store = runtime.statistics().store
    if store.handoffs == 0 and store.inline_runs == 0 and store.transactions:
        return None  # the inline test executor: no hand-offs to count
    return store.handoffs + store.inline_runs


class CountingConnection:
    """Counts write transactions (`BEGIN IMMEDIATE`) on the connection it wraps."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn
        self.begins = 0

    def execute(self, sql: str, params: Any = ()) -> sqlite3.Cursor:
        if sql == "BEGIN IMMEDIATE":
            self.begins += 1
        return self._conn.execute(sql, params)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


def counting_connection(made: list[CountingConnection], conn: sqlite3.Connection) -> Any:
    """`Store.wrap_connection` hook: wrap in a `CountingConnection` and remember it."""
    made.append(CountingConnection(conn))
    return made[-1]


# ---------------------------------------------------------------------------------------------
# The report


@attrs.define
class Row:
    section: str
    figure: str
    value: str
    baseline: str = ""
    ratio: str = ""
    target: str = ""
    verdict: str = ""


@attrs.define
class Report:
    rows: list[Row] = attrs.Factory(list)
    machine: dict[str, float] = attrs.Factory(dict)
    notes: list[str] = attrs.Factory(list)

    def add(
        self,
        section: str,
        figure: str,
        value: str,
        baseline: str = "",
        ratio: str = "",
        target: str = "",
        verdict: str = "",
    ) -> None:
        self.rows.append(Row(section, figure, value, baseline, ratio, target, verdict))
        progress(f"  {section:<10} {figure:<44} {value}")


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def verdict(ok: bool) -> str:
    return "ok" if ok else "MISSED"


def fmt_rate(per_s: float) -> str:
    return f"{per_s / 1000:,.1f}k/s" if per_s >= 1000 else f"{per_s:,.0f}/s"


def fmt_us(seconds: float) -> str:
    return f"{seconds * 1e6:,.1f} µs"


def fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f} ms"


def fmt_ratio(values: Sequence[float]) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.2f}x"
    return f"{median(values):.2f}x ({min(values):.2f}-{max(values):.2f})"


def render(report: Report, header: list[str]) -> str:
    titles = Row("section", "figure", "value", "baseline", "ratio (min-max)", "target", "")
    rows = [titles, *report.rows]
    fields = [f.name for f in attrs.fields(Row)]
    widths = {f: max(len(getattr(r, f)) for r in rows) for f in fields}
    lines = [*header, ""]
    for index, row in enumerate(rows):
        cells = [getattr(row, f).ljust(widths[f]) for f in fields]
        lines.append("| " + " | ".join(cells) + " |")
        if index == 0:
            lines.append("|" + "|".join("-" * (widths[f] + 2) for f in fields) + "|")
    if report.notes:
        lines.append("")
        lines.extend(f"* {note}" for note in report.notes)
    return "\n".join(lines)


def machine_line(values: dict[str, float]) -> str:
    def show(value: float) -> str:
        if math.isnan(value):
            return "nan"
        return f"{value:g}" if float(value).is_integer() else f"{value:.3f}"

    return " ".join(f"{key}={show(values.get(key, math.nan))}" for key in MACHINE_KEYS)


def parse_machine_line(line: str) -> dict[str, float]:
    """Parse the last line back into numbers (used by the smoke test and by tooling)."""
    values = {}
    for item in line.split():
        key, _, value = item.partition("=")
        values[key] = float(value)
    return values


def source_revision() -> str:
    """The git commit the package runs from (+ "dirty" with local changes), if it is a checkout."""
    root = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "not a git checkout"
    return f"git {commit}{' + local changes' if dirty else ''}"


def machine_header(folder: Path) -> list[str]:
    cpu = "unknown cpu"
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return [
        f"trio_sessions {__version__} bench ({source_revision()}): WAL, synchronous=NORMAL, "
        f"files under {folder}",
        f"machine: {os.cpu_count()} vCPU {cpu}; {platform.system()} {platform.release()}",
        f"python {platform.python_version()}, SQLite {sqlite3.sqlite_version}, "
        f"trio {trio.__version__}",
    ]


# ---------------------------------------------------------------------------------------------
# 1. cycle

RAW_CLAIMS = """
CREATE TABLE IF NOT EXISTS claims(
    session_id TEXT PRIMARY KEY, owner TEXT NOT NULL, fence INTEGER NOT NULL,
    expires_at INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS claims_expires_at ON claims(expires_at);
"""


def raw_cycles(conn: sqlite3.Connection, session_ids: Sequence[str]) -> float:
    """The baseline's two write transactions per session; returns elapsed seconds."""
    owner = "raw-owner"
    started = time.perf_counter()
    for session_id in session_ids:
        now = now_ms()
        conn.execute("BEGIN IMMEDIATE")
        fence = conn.execute(
            "INSERT INTO claims(session_id, owner, fence, expires_at) VALUES (?, ?, 1, ?)"
            " ON CONFLICT(session_id) DO UPDATE SET owner = excluded.owner,"
            " fence = claims.fence + 1, expires_at = excluded.expires_at"
            " WHERE claims.expires_at < ? RETURNING fence",
            (session_id, owner, now + 30_000, now),
        ).fetchone()[0]
        conn.execute("COMMIT")
        conn.execute("BEGIN IMMEDIATE")
        conn.execute(
            "DELETE FROM claims WHERE session_id = ? AND owner = ? AND fence = ?",
            (session_id, owner, fence),
        )
        conn.execute("COMMIT")
    return time.perf_counter() - started


async def sequential_cycles(runtime: Runtime, session_ids: Sequence[str]) -> float:
    started = time.perf_counter()
    for session_id in session_ids:
        await runtime.submit(session_id, PAYLOAD)
        await runtime.wait_idle(session_id)
    return time.perf_counter() - started


async def concurrent_cycles(runtime: Runtime, session_ids: Sequence[str]) -> float:
    async def one(session_id: str) -> None:
        await runtime.submit(session_id, PAYLOAD)
        await runtime.wait_idle(session_id)

    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for session_id in session_ids:
            nursery.start_soon(one, session_id)
    return time.perf_counter() - started


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


async def bench_cycle(config: Config, folder: Path, report: Report) -> None:
    per_round = max(1, config.cycles // config.rounds)
    progress(
        f"cycle: {config.rounds} rounds + warm-up, {per_round} sequential per variant "
        f"per round, {config.concurrent} in flight"
    )
    rates: dict[str, list[float]] = {}
    ratios: dict[str, list[float]] = {}
    variants = ["raw", "threaded", "inline", "threaded_concurrent", "inline_concurrent"]
    with raw_db(folder / "cycle-raw.db") as raw:
        raw.executescript(RAW_CLAIMS)
        async with (
            open_bench_runtime(folder / "cycle-threaded.db", noop_drain, inline=False) as thr,
            open_bench_runtime(folder / "cycle-inline.db", noop_drain, inline=True) as inl,
        ):
            for round_ in range(config.rounds + 1):
                seconds: dict[str, float] = {}
                for variant in rotate(variants, round_):
                    tag = f"{variant}-{round_}"
                    if variant == "raw":
                        seconds[variant] = raw_cycles(raw, ids(tag, per_round))
                    elif variant == "threaded":
                        seconds[variant] = await sequential_cycles(thr, ids(tag, per_round))
                    elif variant == "inline":
                        seconds[variant] = await sequential_cycles(inl, ids(tag, per_round))
                    else:
                        runtime = thr if variant.startswith("threaded") else inl
                        seconds[variant] = await concurrent_cycles(
                            runtime, ids(tag, config.concurrent)
                        )
                if round_ == 0:
                    continue  # warm-up
                counts = {
                    v: (per_round if "concurrent" not in v else config.concurrent) for v in variants
                }
                round_rates = {v: counts[v] / seconds[v] for v in variants}
                for variant, rate in round_rates.items():
                    rates.setdefault(variant, []).append(rate)
                    ratios.setdefault(variant, []).append(rate / round_rates["raw"])
            if thr.active_sessions() or inl.active_sessions():
                raise RuntimeError("cycles left active sessions behind")
            hop = {name: await empty_operation(rt) for name, rt in (("thr", thr), ("inl", inl))}
    raw_rate = median(rates["raw"])
    report.add(
        "cycle",
        "raw sqlite3, 2 write tx (baseline)",
        f"{fmt_rate(raw_rate)} = {fmt_us(1 / raw_rate)}",
    )
    labels = {
        "threaded": ("default store, sequential", 0.5),
        "inline": ("inline store, sequential", 0.5),
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
    report.add(
        "cycle",
        "default store: one empty operation (hand-off)",
        fmt_us(hop["thr"]),
        fmt_us(hop["inl"]) + " (inline store)",
    )
    report.machine["cycle_ratio"] = median(ratios["threaded"])
    report.machine["concurrent_ratio"] = median(ratios["threaded_concurrent"])
    report.notes.append(
        "cycle: the library's cycle is 3 write transactions (submit, acquire, finish) against "
        "the raw 2 (claim, release); sequential = `await submit(); await wait_idle()` per "
        "session; the drain does one checkpoint and takes no input. 'one empty operation' "
        "is a store round trip with nothing written: for the default store, the trio -> "
        "worker thread hand-off."
    )


# ---------------------------------------------------------------------------------------------
# 2. coalescing


@attrs.define(eq=False)
class HeldDrains:
    """Drains that count their iterations and hold the first one on `gate`."""

    gate: trio.Event = attrs.Factory(trio.Event)
    target: int = 1
    entered: int = 0
    all_entered: trio.Event = attrs.Factory(trio.Event)
    iterations: int = 0

    async def drain(self, ctx: DrainContext) -> None:
        self.iterations += 1
        if ctx.resumed or self.gate.is_set():
            await trio.lowlevel.checkpoint()
            return
        self.entered += 1
        if self.entered == self.target:
            self.all_entered.set()
        await self.gate.wait()

    def reset(self, target: int) -> None:
        self.gate = trio.Event()
        self.target = target
        self.entered = 0
        self.all_entered = trio.Event()
        self.iterations = 0


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


# ---------------------------------------------------------------------------------------------
# 3. heartbeat


async def start_held_drains(runtime: Runtime, held: HeldDrains, session_ids: Sequence[str]) -> None:
    """Wake the sessions (in chunks, group-committed) and wait until every drain is held."""
    held.reset(len(session_ids))
    for chunk in range(0, len(session_ids), 1000):
        async with trio.open_nursery() as nursery:
            for session_id in session_ids[chunk : chunk + 1000]:
                nursery.start_soon(runtime.wake, session_id)
    await held.all_entered.wait()


def seed_claims(
    conn: sqlite3.Connection, owner: str, session_ids: Sequence[str], expires: int
) -> list[str]:
    """Session rows plus one running claim each, in one transaction; returns execution ids."""
    now = now_ms()
    executions = [uuid.uuid4().hex for _ in session_ids]
    conn.execute("BEGIN IMMEDIATE")
    conn.executemany(
        "INSERT INTO session(id, time_created) VALUES (?, ?)", [(s, now) for s in session_ids]
    )
    conn.executemany(
        "INSERT INTO session_execution(id, session_id, owner_id, phase, anchor_seq,"
        " time_created, heartbeat_at, expires_at) VALUES (?, ?, ?, 'running', NULL, ?, ?, ?)",
        [
            (e, s, owner, now, now, expires + i)
            for i, (e, s) in enumerate(zip(executions, session_ids, strict=True))
        ],
    )
    conn.execute("COMMIT")
    return executions


def raw_heartbeat(conn: sqlite3.Connection, owner: str, executions: Sequence[str]) -> float:
    """Baseline: the same fenced UPDATE per claim, all in one transaction."""
    started = time.perf_counter()
    now = now_ms()
    conn.execute("BEGIN IMMEDIATE")
    for execution_id in executions:
        conn.execute(
            "UPDATE session_execution SET expires_at = ?, heartbeat_at = ?"
            " WHERE id = ? AND owner_id = ? AND expires_at > ? RETURNING phase",
            (now + 30_000, now, execution_id, owner, now),
        ).fetchone()
    conn.execute("COMMIT")
    return time.perf_counter() - started


async def bench_heartbeat(config: Config, folder: Path, report: Report) -> None:
    worst = 0
    for n in config.heartbeat_drains:
        progress(f"heartbeat: {n} active drains, {config.heartbeat_ticks} ticks")
        raw_path = folder / f"heartbeat-raw-{n}.db"
        library_schema(raw_path)
        with raw_db(raw_path) as raw:
            executions = seed_claims(raw, "raw-owner", ids("h", n), now_ms() + 3_600_000)
            raw_ticks = [
                raw_heartbeat(raw, "raw-owner", executions)
                for _ in range(config.heartbeat_ticks + 1)
            ][1:]
        counting: list[CountingConnection] = []
        wrap = functools.partial(counting_connection, counting)
        held = HeldDrains()
        async with open_bench_runtime(
            folder / f"heartbeat-{n}.db", held.drain, inline=False, wrap=wrap
        ) as rt:
            await start_held_drains(rt, held, ids("h", n))
            walls, txs, hops, begins = [], [], [], []
            for _ in range(config.heartbeat_ticks):
                # Every connection the runtime opened (worker and inline) is counted.
                begin0 = sum(c.begins for c in counting)
                tx0, hop0 = rt.statistics().heartbeat_transactions, handoffs(rt)
                started = time.perf_counter()
                await rt._lease_keeper.renew_once()
                walls.append(time.perf_counter() - started)
                txs.append(rt.statistics().heartbeat_transactions - tx0)
                hops.append((handoffs(rt) or 0) - (hop0 or 0))
                begins.append(sum(c.begins for c in counting) - begin0)
            lost = n - len(rt.active_sessions())
            held.gate.set()
            await wait_all_idle(rt)
        worst = max(worst, *begins, *txs)
        report.add(
            "heartbeat",
            f"{n} active drains: write tx / hand-offs per tick",
            f"{max(begins)} BEGIN / {max(txs)} counted / {max(hops)} hand-offs"
            + (f" ({lost} drains lost)" if lost else ""),
            "",
            "",
            "1 tx",
            verdict(max(begins) <= 1 and max(txs) <= 1 and not lost),
        )
        report.add(
            "heartbeat",
            f"{n} active drains: tick wall time",
            f"{fmt_ms(median(walls))} ({fmt_us(median(walls) / n)}/claim)",
            fmt_ms(median(raw_ticks)) + " (raw: same UPDATEs, 1 tx)",
            f"{median(raw_ticks) / median(walls):.2f}x",
        )
    report.machine["heartbeat_tx_per_tick"] = worst
    report.notes.append(
        "heartbeat: write transactions are counted at the connection (each `BEGIN IMMEDIATE` "
        "the runtime issues during the tick), beside the runtime's own counter and the "
        "executor's hand-offs; the counting wrapper adds well under 1 µs per statement."
    )


# ---------------------------------------------------------------------------------------------
# 4. recovery


def seed_recovery(path: Path, n: int) -> None:
    """`n` expired claims of owner 'dead' and `n` live claims of owner 'alive'."""
    library_schema(path)
    with raw_db(path) as conn:
        seed_claims(conn, "dead", ids("dead", n), now_ms() - 3_600_000)
        seed_claims(conn, "alive", ids("alive", n), now_ms() + 3_600_000)


def raw_reclaim(path: Path, batch: int) -> tuple[float, int]:
    """Baseline: reclaim the expired claims, `batch` per transaction, one statement each."""
    reclaimed = 0
    with raw_db(path) as conn:
        started = time.perf_counter()
        while True:
            now = now_ms()
            conn.execute("BEGIN IMMEDIATE")
            rows = conn.execute(
                "UPDATE session_execution SET owner_id = ?, expires_at = ?, heartbeat_at = ?"
                " WHERE id IN (SELECT id FROM session_execution WHERE expires_at <= ?"
                " ORDER BY expires_at LIMIT ?) RETURNING id",
                ("raw-owner", now + 30_000, now, now, batch),
            ).fetchall()
            conn.execute("COMMIT")
            reclaimed += len(rows)
            if not rows:
                break
        return time.perf_counter() - started, reclaimed


@attrs.frozen
class Recovery:
    takeover: float  # seconds until every expired claim was taken over (passes done)
    total: float  # seconds until every resumed drain released its claim
    passes: int


async def library_recovery(path: Path, n: int, batch: int, *, inline: bool, hold: bool) -> Recovery:
    """Recover every expired claim to completion. `hold` keeps every resumed drain waiting
    until the passes are done, which splits the takeover from the drains and releases."""
    gate = trio.Event()
    if not hold:
        gate.set()

    async def drain(ctx: DrainContext) -> None:
        await gate.wait()

    library_schema(path)
    async with open_runtime(
        Store(path, inline=inline),
        drain,
        lease=QUIET,
        recovery_interval=QUIET,
        recovery_batch=batch,
    ) as rt:
        with raw_db(path) as conn:
            seed_claims(conn, "dead", ids("dead", n), now_ms() - 3_600_000)
            seed_claims(conn, "alive", ids("alive", n), now_ms() + 3_600_000)
        passes = resumed = 0
        started = time.perf_counter()
        while True:
            outcome = await rt.recover_once()
            passes += 1
            resumed += outcome.resumed
            if outcome.examined == 0:
                break
        takeover = time.perf_counter() - started
        gate.set()
        await wait_all_idle(rt)
        total = time.perf_counter() - started
    with raw_db(path) as conn:
        left = conn.execute(
            "SELECT COUNT(*) FROM session_execution WHERE owner_id != 'alive'"
        ).fetchone()[0]
    if left or resumed != n:
        raise RuntimeError(f"recovery resumed {resumed} of {n} and left {left} claims")
    return Recovery(takeover, total, passes)


async def bench_recovery(config: Config, folder: Path, report: Report) -> None:
    n, batch = config.recovery, config.recovery_batch
    progress(
        f"recovery: {n} expired claims, passes of {batch}, "
        f"{config.recovery_rounds} rounds + warm-up"
    )
    secs: dict[str, list[float]] = {}
    ratios: dict[str, list[float]] = {}
    passes = 0
    variants = ["raw", "threaded", "inline", "held"]
    for round_ in range(config.recovery_rounds + 1):
        seconds: dict[str, float] = {}
        for variant in rotate(variants, round_):
            path = folder / f"recovery-{variant}-{round_}.db"
            if variant == "raw":
                seed_recovery(path, n)
                seconds[variant], reclaimed = raw_reclaim(path, batch)
                if reclaimed != n:
                    raise RuntimeError(f"raw reclaim took {reclaimed} of {n}")
                continue
            done = await library_recovery(
                path, n, batch, inline=variant == "inline", hold=variant == "held"
            )
            passes = done.passes
            seconds[variant] = done.total
            if variant == "held":
                seconds["takeover"] = done.takeover
        if round_ == 0:
            continue
        for variant, taken in seconds.items():
            secs.setdefault(variant, []).append(taken)
            ratios.setdefault(variant, []).append(seconds["raw"] / taken)
    raw = median(secs["raw"])
    report.add(
        "recovery",
        f"raw batched reclaim of {n}, {batch}/tx (baseline)",
        f"{fmt_ms(raw)} ({fmt_us(raw / n)}/claim, {fmt_rate(n / raw)})",
    )
    rows = (
        ("threaded", f"default store: {n} to completion, {passes} passes", ">= 0.5x"),
        ("inline", f"inline store: {n} to completion, {passes} passes", ">= 0.5x"),
        ("takeover", "default store, drains held: takeover only", ""),
        ("held", "default store, drains held: to completion", ""),
    )
    for variant, label, target in rows:
        taken = median(secs[variant])
        report.add(
            "recovery",
            label,
            f"{fmt_ms(taken)} ({fmt_us(taken / n)}/claim, {fmt_rate(n / taken)})",
            fmt_rate(n / raw),
            fmt_ratio(ratios[variant]),
            target,
            verdict(median(ratios[variant]) >= 0.5) if target else "",
        )
    report.machine["recovery_ratio"] = median(ratios["threaded"])
    report.notes.append(
        f"recovery: {n} live claims of another owner are present too (as in the baseline). "
        "The library takes each expired claim over, runs its no-op drain and releases it; "
        "the raw baseline only re-leases the rows. 'drains held' keeps every resumed drain "
        "waiting until the passes are done, so 'takeover only' is the part comparable to the "
        "baseline (its passes also exclude the growing set of local sessions)."
    )


# ---------------------------------------------------------------------------------------------
# 5. memory (each measurement in a fresh child process)


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


async def _memory_child(mode: str, path: Path, n: int) -> dict[str, Any]:
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


def memory_child(mode: str, path: Path, n: int) -> dict[str, Any]:
    """Run `_memory_child` in a fresh interpreter; returns its JSON result."""
    package_root = Path(__file__).resolve().parent.parent
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(package_root), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-m", "trio_sessions.bench", "--memory-child", mode, str(path), str(n)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        timeout=600,
    )
    if done.returncode != 0:
        raise RuntimeError(f"memory child {mode} failed:\n{done.stderr}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


async def bench_memory(config: Config, folder: Path, report: Report) -> None:
    progress(
        f"memory: {config.idle} idle sessions, {config.active} active drains (child processes)"
    )
    empty = folder / "memory-empty.db"
    library_schema(empty)
    idle_db = folder / "memory-idle.db"
    seed_idle(idle_db, config.idle)
    size_mib = idle_db.stat().st_size / 2**20
    run = trio.to_thread.run_sync
    base = await run(memory_child, "idle", empty, 0)
    idle = await run(memory_child, "idle", idle_db, config.idle)
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
    active = await run(memory_child, "active", empty, config.active)
    bare = await run(memory_child, "bare", empty, config.active)
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


# ---------------------------------------------------------------------------------------------
# 6. interrupt latency


@attrs.define(eq=False)
class InterruptibleDrains:
    entered: dict[str, trio.Event] = attrs.Factory(dict)
    cancelled_at: dict[str, float] = attrs.Factory(dict)

    async def drain(self, ctx: DrainContext) -> None:
        self.entered.setdefault(ctx.session_id, trio.Event()).set()
        try:
            await trio.sleep_forever()
        finally:
            self.cancelled_at[ctx.session_id] = time.perf_counter()


async def _held_in_scope(
    scope: trio.CancelScope, running: trio.Event, finished: list[float]
) -> None:
    with scope:
        try:
            running.set()
            await trio.sleep_forever()
        finally:
            finished.append(time.perf_counter())


async def trio_cancel_floor(n: int) -> list[float]:
    """Baseline: cancel a plain task's scope and time until its `finally` runs."""
    latencies = []
    for _ in range(n):
        scope, running = trio.CancelScope(), trio.Event()
        finished: list[float] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_held_in_scope, scope, running, finished)
            await running.wait()
            started = time.perf_counter()
            scope.cancel()
        latencies.append(finished[0] - started)
    return latencies


async def bench_interrupt(config: Config, folder: Path, report: Report) -> None:
    k = config.interrupts
    progress(f"interrupt: {k} interrupts per store")
    floor = await trio_cancel_floor(k)
    with raw_db(folder / "interrupt-raw.db") as raw:
        raw.executescript(RAW_CLAIMS)
        raw_cycles(raw, ids("warm", k))
        raw_seconds = raw_cycles(raw, ids("i", k)) / k
    for inline in (False, True):
        name = "inline" if inline else "default"
        drains = InterruptibleDrains()
        path = folder / f"interrupt-{name}.db"
        cancel, deleted = [], []
        async with open_bench_runtime(path, drains.drain, inline=inline) as rt:
            for session_id in ids("i", k):
                drains.entered[session_id] = trio.Event()
                await rt.wake(session_id)
                await drains.entered[session_id].wait()
                started = time.perf_counter()
                accepted = await rt.interrupt(session_id)
                await rt.wait_idle(session_id)
                finished = time.perf_counter()
                if not accepted:
                    raise RuntimeError(f"interrupt of {session_id} was refused")
                cancel.append(drains.cancelled_at[session_id] - started)
                deleted.append(finished - started)
        with raw_db(path) as conn:
            left = conn.execute("SELECT COUNT(*) FROM session_execution").fetchone()[0]
        if left:
            raise RuntimeError(f"{left} claims left after interrupts")
        report.add(
            "interrupt",
            f"{name} store: to drain cancelled, median / p99",
            f"{fmt_us(median(cancel))} / {fmt_us(percentile(cancel, 99))}",
            f"{fmt_us(median(floor))} / {fmt_us(percentile(floor, 99))} (trio cancel)",
        )
        report.add(
            "interrupt",
            f"{name} store: to claim deleted, median / p99",
            f"{fmt_us(median(deleted))} / {fmt_us(percentile(deleted, 99))}",
            f"{fmt_us(raw_seconds)} (raw 2 write tx)",
        )


# ---------------------------------------------------------------------------------------------
# Main

BENCHES = {
    "cycle": bench_cycle,
    "coalescing": bench_coalescing,
    "heartbeat": bench_heartbeat,
    "recovery": bench_recovery,
    "memory": bench_memory,
    "interrupt": bench_interrupt,
}


async def run_all(config: Config, folder: Path) -> Report:
    report = Report()
    for section in SECTIONS:
        if section in config.sections:
            started = time.perf_counter()
            await BENCHES[section](config, folder, report)
            progress(f"  ({section}: {time.perf_counter() - started:.1f} s)")
    return report


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.memory_child is not None:
        mode, path, n = args.memory_child
        result = trio.run(_memory_child, mode, Path(path), int(n))
        print(json.dumps(result))
        return 0
    config = make_config(args)
    own_folder = config.folder is None
    folder = Path(tempfile.mkdtemp(prefix="trio-sessions-bench-")) if own_folder else config.folder
    assert folder is not None
    folder.mkdir(parents=True, exist_ok=True)
    try:
        started = time.perf_counter()
        report = trio.run(run_all, config, folder)
        header = machine_header(folder)
        header.append(f"total bench time {time.perf_counter() - started:.1f} s")
        print(render(report, header))
        print(machine_line(report.machine), flush=True)
    finally:
        if own_folder:
            shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
