"""Tools shared by the sections: raw SQLite connections with the library's settings, the
runtime as the bench opens it, drains that count or hold, seeding, child processes.

The bench opens every runtime with lease and recovery intervals far longer than a run
(`QUIET`), so no background heartbeat or recovery pass lands inside a timed section: the
bench calls both itself where it measures them.
"""

from __future__ import annotations

import json
import os
import sqlite3
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import AbstractAsyncContextManager, contextmanager
from pathlib import Path
from typing import Any

import attrs
import trio

from .. import _sqlite
from .._backend import StoreBackend
from .._runtime import DrainContext, Runtime, open_runtime
from .._sqlite import SQLiteStore

QUIET = 3600.0
PAYLOAD: dict[str, Any] = {"text": "hello"}
PAYLOAD_JSON = json.dumps(PAYLOAD)
CHILD_TIMEOUT_S = 600

# The raw baseline's tables. The like-for-like cycle (DESIGN §7: baselines do the same
# durable work) writes the rows the library's cycle writes - the session row (inserted, or
# its input count bumped), the input, the claim, and the claim's removal - in tables of the
# library's shape (WITHOUT ROWID, the same keys and unique constraints), no fence reads.
RAW_CLAIMS = """
CREATE TABLE IF NOT EXISTS claims(
    session_id TEXT PRIMARY KEY, owner TEXT NOT NULL, fence INTEGER NOT NULL,
    expires_at INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS claims_expires_at ON claims(expires_at);
CREATE TABLE IF NOT EXISTS raw_session(
    id TEXT PRIMARY KEY, time_created INTEGER NOT NULL, input_seq INTEGER NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS raw_input(
    id TEXT PRIMARY KEY, session_id TEXT NOT NULL, seq INTEGER NOT NULL,
    payload TEXT NOT NULL, time_created INTEGER NOT NULL, UNIQUE(session_id, seq)
) WITHOUT ROWID;
"""


def rss_kib() -> int:
    """Resident set size of this process, KiB (Linux /proc)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("VmRSS not found in /proc/self/status")


def rotate(items: Sequence[str], shift: int) -> list[str]:
    shift %= len(items)
    return [*items[shift:], *items[:shift]]


def now_ms() -> int:
    return int(time.time() * 1000)


def ids(prefix: str, n: int) -> list[str]:
    return [f"{prefix}-{i}" for i in range(n)]


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


def raw_cycles(conn: sqlite3.Connection, session_ids: Sequence[str]) -> float:
    """The like-for-like baseline, sequential; returns elapsed seconds."""
    started = time.perf_counter()
    for session_id in session_ids:
        raw_release(conn, session_id, raw_submit(conn, session_id))
    return time.perf_counter() - started


def raw_light_cycles(conn: sqlite3.Connection, session_ids: Sequence[str]) -> float:
    """The earlier, lighter baseline: only the claim and its removal (two transactions)."""
    started = time.perf_counter()
    for session_id in session_ids:
        fence = _raw_claim(conn, session_id, now_ms())
        conn.execute("COMMIT")
        raw_release(conn, session_id, fence)
    return time.perf_counter() - started


def raw_submit(conn: sqlite3.Connection, session_id: str) -> int:
    """Transaction 1: the session row, the input and the claim; returns the claim's fence."""
    now = now_ms()
    conn.execute("BEGIN IMMEDIATE")
    seq = conn.execute(
        "INSERT INTO raw_session(id, time_created, input_seq) VALUES (?, ?, 1)"
        " ON CONFLICT(id) DO UPDATE SET input_seq = raw_session.input_seq + 1"
        " RETURNING input_seq",
        (session_id, now),
    ).fetchone()[0]
    conn.execute(
        "INSERT INTO raw_input(id, session_id, seq, payload, time_created) VALUES (?, ?, ?, ?, ?)",
        (uuid.uuid4().hex, session_id, seq, PAYLOAD_JSON, now),
    )
    fence = _raw_claim(conn, session_id, now, begin=False)
    conn.execute("COMMIT")
    return fence


def _raw_claim(conn: sqlite3.Connection, session_id: str, now: int, *, begin: bool = True) -> int:
    if begin:
        conn.execute("BEGIN IMMEDIATE")
    fence: int = conn.execute(
        "INSERT INTO claims(session_id, owner, fence, expires_at) VALUES (?, ?, 1, ?)"
        " ON CONFLICT(session_id) DO UPDATE SET owner = excluded.owner,"
        " fence = claims.fence + 1, expires_at = excluded.expires_at"
        " WHERE claims.expires_at < ? RETURNING fence",
        (session_id, RAW_OWNER, now + 30_000, now),
    ).fetchone()[0]
    return fence


def raw_release(conn: sqlite3.Connection, session_id: str, fence: int) -> None:
    """Transaction 2: the claim's removal, fenced (the library's release of this cycle
    writes no session row either: its resume count is already 0)."""
    conn.execute("BEGIN IMMEDIATE")
    conn.execute(
        "DELETE FROM claims WHERE session_id = ? AND owner = ? AND fence = ?",
        (session_id, RAW_OWNER, fence),
    )
    conn.execute("COMMIT")


RAW_OWNER = "raw-owner"


async def trio_floor_cycles(
    conn: sqlite3.Connection, session_ids: Sequence[str], *, in_flight: bool
) -> float:
    """The trio floor (DESIGN §7): the like-for-like raw SQL driven from trio as a library
    must drive it - the caller's transaction, one task per busy period (a no-op drain: one
    checkpoint, then the release transaction), an Event back to the waiting caller - and
    nothing else (no registry, lease, watcher or group commit). No trio library beats it.
    `in_flight`: every session's caller at once, else one after another."""

    async def busy_period(session_id: str, fence: int, done: trio.Event) -> None:
        with trio.CancelScope():
            await trio.lowlevel.checkpoint()  # the no-op drain
        raw_release(conn, session_id, fence)
        done.set()

    async def cycle(nursery: trio.Nursery, session_id: str) -> None:
        fence = raw_submit(conn, session_id)
        done = trio.Event()
        nursery.start_soon(busy_period, session_id, fence, done)
        await done.wait()

    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for session_id in session_ids:
            if in_flight:
                nursery.start_soon(cycle, nursery, session_id)
            else:
                await cycle(nursery, session_id)
    return time.perf_counter() - started


async def noop_drain(ctx: DrainContext) -> None:
    """The trivial drain of the baseline's trio variant: one checkpoint."""
    await trio.lowlevel.checkpoint()


def open_bench_runtime(
    store: Path | StoreBackend,
    drain: Callable[[DrainContext], Awaitable[None]] | None,
    *,
    inline: bool = False,
    wrap: Callable[[sqlite3.Connection], Any] | None = None,
) -> AbstractAsyncContextManager[Runtime]:
    """A runtime on `store` (a path: SQLite with `inline`/`wrap`) with quiet background
    intervals."""
    backend = (
        SQLiteStore(store, inline=inline, wrap_connection=wrap)
        if isinstance(store, Path)
        else store
    )
    return open_runtime(backend, drain, lease=QUIET, recovery_interval=QUIET, recovery_batch=100)


async def wait_all_idle(runtime: Runtime) -> None:
    while active := runtime.active_sessions():
        for session_id in active:
            await runtime.wait_idle(session_id)


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


def child_command(kind: str, arguments: dict[str, Any]) -> list[str]:
    """The command line of one measurement in a fresh interpreter (`children.run_child`)."""
    return [sys.executable, "-m", "trio_sessions.bench", "--child", kind, json.dumps(arguments)]


def child_env(first: str | None = None) -> dict[str, str]:
    """This process's environment, with this package first on the child's path - after
    `first` when given (a soak's broken copy, which must be the one imported) - so a child
    started from any folder runs the same code, from a checkout too."""
    package_root = str(Path(__file__).resolve().parent.parent.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [first, package_root, env.get("PYTHONPATH")]))
    return env


async def run_child(kind: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """Run one child measurement to its end; returns the JSON of its last output line."""
    with trio.fail_after(CHILD_TIMEOUT_S):
        done = await trio.run_process(
            child_command(kind, arguments),
            capture_stdout=True,
            capture_stderr=True,
            env=child_env(),
            check=False,
        )
    if done.returncode != 0:
        raise RuntimeError(f"bench child {kind} failed:\n{done.stderr.decode(errors='replace')}")
    result: dict[str, Any] = json.loads(done.stdout.decode().strip().splitlines()[-1])
    return result
