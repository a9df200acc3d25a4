"""The PostgreSQL soak parent's shared state: the run's figures, its admin connection, workers.

`Result` holds every figure the run reports and judges it (`clean`); `Admin` is the
parent's own direct connection (no proxy) for sampling and fault injection; `SoakBase`
holds what every part of the parent shares - arguments, schema, control directory, workers
and their proxies, the producer's engine, the windows in which orphans are not judged -
and the primitives on it: installing the schema, spawning a worker behind its proxy,
reaping and restarting exited workers, the producer's store calls. The faults (`pgchaos`)
and the command's phases (`postgres`) build on it.

Invariants: one `Result` per run, updated only from the parent's trio thread; the admin
connection and the producer's engine are each used by one thread at a time; the worker in
slot i always reaches the server through proxy i; a worker the soak killed is in `killed`
(its unfinished drains' repeats are allowed) before the audit reads the effects.
"""

from __future__ import annotations

import argparse
import functools
import random
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import attrs
import psycopg
import psycopg.conninfo
import trio

from .. import _backend, _postgres
from .._backend import Engine
from .._bench.tools import child_env
from . import audit, broken, common
from .proxy import FaultProxy

T = TypeVar("T")

ORPHAN_SLACK = 1.0  # seconds of scheduling slack before an expired claim counts as orphaned


@attrs.define
class Result:
    kills: int = 0
    handoff_kills: int = 0
    pauses: int = 0
    handoff_pauses: int = 0
    partitions: int = 0
    partitions_in_tx: int = 0
    conn_kills: int = 0
    commit_kills: int = 0
    token_kills: int = 0
    busy_token_kills: int = 0  # a token killed while its owner's drain was in a busy step
    host_turns: int = 0  # turns of the host fault kinds (`Chaos.host_faults`), in rounds
    resets: int = 0
    restarts: int = 0
    skew_ms: int = 0
    inputs: int = 0
    unanswered: int = 0
    stranded_observations: int = 0
    doorbells_left: int = 0
    pending_left: int = 0
    orphans_seen: int = 0
    claims_left: int = 0
    recovery_rows_left: int = 0
    # A recovery lease left on a claim that is gone (a stale candidate of a recoverer killed
    # before it applied; since the soak found them a pass's scan and its leases share one
    # transaction, `_store.recovery_scan.scan_and_lease`): counted apart, and as orphaned.
    stale_recovery_rows: int = 0
    overlaps: int = 0
    zombie_writes: int = 0
    repeats: audit.Repeats = attrs.Factory(lambda: audit.Repeats(0, 0, 0, 0))
    unexpected_exits: int = 0
    rolling_restarts: int = 0
    drains: int = 0
    executions: int = 0
    writes_logged: int = 0
    statuses: dict[str, int] = attrs.Factory(dict)
    takeovers: list[float] = attrs.Factory(list)  # seconds from a SIGKILL to the takeover
    controls: common.ControlAudit = attrs.Factory(common.ControlAudit)
    settled: bool = False

    @property
    def lost(self) -> int:
        return (
            self.unanswered
            + self.stranded_observations
            + self.doorbells_left
            + self.repeats.unexpected
        )

    @property
    def orphaned(self) -> int:
        return (
            self.orphans_seen
            + self.claims_left
            + self.recovery_rows_left
            + self.stale_recovery_rows
        )

    def fault_counts(self) -> dict[str, int]:
        return {
            "kills": self.kills,
            "pauses": self.pauses,
            "partitions": self.partitions,
            "conn_kills": self.conn_kills,
            "rolling_restarts": self.rolling_restarts,
        }

    @property
    def clean(self) -> bool:
        return (
            self.settled
            and self.lost == 0
            and self.overlaps == 0
            and self.orphaned == 0
            and self.zombie_writes == 0
            and self.pending_left == 0
            and self.unexpected_exits == 0
            and self.controls.violations == 0
        )


class Admin:
    """This process's own connection (direct, no proxy) for sampling and fault injection,
    used from one thread at a time; re-opened after the server restarted."""

    def __init__(self, url: str, schema: str) -> None:
        self.url = url
        self.schema = schema
        self._conn: psycopg.Connection[Any] | None = None
        self._limiter = trio.CapacityLimiter(1)

    def _run(self, statement: str, params: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        if self._conn is None or self._conn.closed or self._conn.broken:
            self._conn = _postgres.connect(self.url, self.schema)
            self._conn.autocommit = True
        try:
            return self._conn.execute(statement, params).fetchall()
        except psycopg.OperationalError:
            self._conn.close()
            raise

    async def rows(self, statement: str, *params: Any) -> list[tuple[Any, ...]]:
        """The rows, or `psycopg.Error` / `StoreError` (e.g. while the server restarts)."""
        return await trio.to_thread.run_sync(self._run, statement, params, limiter=self._limiter)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()


class SoakBase:
    """The parent's state and the primitives every part of the soak uses."""

    def __init__(
        self, args: argparse.Namespace, workdir: Path, url: str, restart: Callable[[], None] | None
    ) -> None:
        self.args = args
        self.workdir = workdir
        self.url = url
        self.restart_server = restart
        self.schema = f"soak_{uuid.uuid4().hex[:10]}"
        self.control = workdir / "control"
        self.control.mkdir()
        # The producer's draws, the host faults' and the connection kills', each its own
        # stream of the seed: sharing one, what a seed gave depended on how the three
        # interleaved in time (a loaded host), and on how long a fault waited for a worker.
        self.rng = random.Random(args.seed)
        self.chaos_rng = random.Random(f"chaos-{args.seed}")
        self.conn_rng = random.Random(f"conn-{args.seed}")
        self.generation = 0
        self.workers: dict[int, common.Worker] = {}
        self.killed: set[str] = set()
        self.kill_times: dict[str, float] = {}  # SIGKILLs of the chaos, CLOCK_MONOTONIC
        # Per worker, when it was SIGSTOPped or partitioned (CLOCK_MONOTONIC): cut off from
        # every change signal, it hears of a control made meanwhile only afterwards.
        self.cut_off: dict[str, list[tuple[float, float]]] = {}
        # A graceful shutdown waits for drains blocked in a thread (a step at most).
        self.retiring = common.Retiring(bound=10 * (args.lease + args.work_max))
        self.proxies: list[FaultProxy] = []
        self.result = Result(skew_ms=args.skew_ms)
        self.submitted: dict[int, str] = {}
        self.controls = common.Controls(args.control_ratio, time.monotonic)
        self.orphans: set[str] = set()
        self.sampling_paused_until = 0.0
        self.hosts_held = 0
        self.held_until = 0.0
        self.started = time.monotonic()
        self.server_down = False
        self.admin = Admin(url, self.schema)
        self.producer: Engine | None = None  # opened (and the schema migrated) at install
        self.producer_limiter = trio.CapacityLimiter(1)
        self.worker_path: str | None = None
        if args.broken:
            self.worker_path = str(broken.make_copy(args.broken, workdir / "broken"))

    # -- setup ------------------------------------------------------------------------------------

    def install_schema(self) -> None:
        """Migrate the soak's schema and add the audit's triggers to it (never the library)."""
        self.producer = _backend.open_engine(self.url, schema=self.schema, migrate=True)
        conn = _postgres.connect(self.url, self.schema)
        with conn:
            conn.execute(audit.TRIGGERS)

    def worker_url(self, proxy: FaultProxy, name: str) -> str:
        given = psycopg.conninfo.conninfo_to_dict(self.url)
        given.update(
            host="127.0.0.1", port=str(proxy.port), application_name=f"{self.schema}-{name}"
        )
        return psycopg.conninfo.make_conninfo(**{k: str(v) for k, v in given.items()})

    def skew_of(self, slot: int) -> int:
        return (0, self.args.skew_ms, -self.args.skew_ms)[slot % 3]

    def spawn(self, slot: int) -> None:
        self.generation += 1
        name = f"w{slot}.{self.generation}"
        args = self.args
        env = child_env(self.worker_path)
        argv = [
            "--backend=postgres",
            f"--worker={name}",
            f"--pg-url={self.worker_url(self.proxies[slot], name)}",
            f"--schema={self.schema}",
            f"--control={self.control}",
            f"--effects={self.workdir / f'effects.{name}.jsonl'}",
            f"--sessions={args.sessions}",
            f"--lease={args.lease}",
            f"--recovery-interval={args.recovery_interval}",
            f"--work-max={args.work_max}",
            f"--interrupt-rate={args.interrupt_rate}",
            f"--skew-ms={self.skew_of(slot)}",
        ]
        self.workers[slot] = common.start_worker(
            self.workdir, slot, name, argv, env=env, cwd=self.workdir
        )

    # -- workers, producer, clocks ----------------------------------------------------------------

    def check_exits(self) -> None:
        self.result.unexpected_exits += common.restart_exited(self.workers, self.spawn)
        self.retiring.reap(self.kill_overdue)

    def kill_overdue(self, worker: common.Worker) -> None:
        """A SIGTERMed worker still shutting down past its bound: killed, and audited so."""
        worker.process.kill()
        worker.process.wait()
        self.killed.add(worker.name)
        self.result.kills += 1

    def stop(self) -> None:
        common.stop_workers(self.workers)

    def close(self) -> None:
        self.admin.close()
        if self.producer is not None:
            self.producer.close()

    async def db(self, op: Callable[..., T], *args: Any) -> T:
        assert self.producer is not None, "install_schema() opens the producer"
        return await trio.to_thread.run_sync(
            functools.partial(self.producer.run, op, *args),
            limiter=self.producer_limiter,
        )

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def orphan_grace(self) -> float:
        """How long a claim may stay expired with nobody on it: a lease and the next scan
        (whose recoverer, should it be killed or paused before it acted, holds the recovery
        lease for another lease), plus slack."""
        return float(self.args.lease + self.args.recovery_interval + ORPHAN_SLACK)
