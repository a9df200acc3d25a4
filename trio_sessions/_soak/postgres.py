"""The PostgreSQL soak: worker processes as hosts, faults on every path, and an audit.

`python -m trio_sessions.soak --backend postgres` starts N worker processes (default 3),
each running `open_runtime` on one PostgreSQL schema with a short lease, each treated as a
host with its own path to the database: an in-process fault proxy (`proxy.FaultProxy`)
that this process runs. This process is also the producer: it submits numbered inputs to M
sessions (default 20) the way a process that runs no drains does. Workers wake and
interrupt random sessions, as in the SQLite soak. Some workers run with their wall clock
offset by `--skew-ms` (more than a lease, both ways; `time.time` patched in the process):
the PostgreSQL runtime judges leases by the server's clock, so nothing may change (§6.18).

The chaos, one host fault at a time on a random worker, in rotation:
* SIGKILL (restarted after a moment) - some inside the claim handoff, where the
  `acquisition_hook` holds on request;
* SIGSTOP for 1.1-1.5 leases, then SIGCONT - some inside the claim handoff;
* a partition (the proxy blackholes the host's connections) for 1.1-1.5 leases, then
  healed - some started inside a transaction, between its fence read and its COMMIT;
* and between them now and then (`--busy-ratio`), a busy token kill: a drain of the host
  is asked into a busy step (`common`: a blocking call that lands its effect 0.3 s
  later whatever happens), and the host's liveness token connection is killed as soon as
  the step began - the others must wait out the grace, the host must cancel the drain;
and alongside, every `--conn-kill-gap` seconds, `pg_terminate_backend` of one of the
workers' server connections (writer, listener or liveness token - and, on purpose, a
token's: a live owner losing its token), or of the one that just sent a COMMIT
(the proxy withholds the server's answer, and sometimes the COMMIT itself), or a reset of
every connection of one host at its proxy. Halfway
through, the server is restarted once (fast shutdown, same data directory and port) when
the soak started it itself.

The audit (`audit` explains the zombie-write triggers and the overlap clock):
* `overlaps`: executions of one session whose effects interleave on CLOCK_MONOTONIC;
* `lost`: submitted inputs never answered, samples of a pending input with neither a
  doorbell nor a claim, doorbells left at the end, and inputs answered twice outside the
  documented rules (a repeat only after the first drain was killed, cancelled or failed);
* `orphaned`: claims seen expired, with no live recovery lease on them (a recoverer that
  took one and was then killed or paused holds it for a lease, which the others must let
  run out), for longer than lease + one recovery interval (+ 1 s of scheduling slack on a
  loaded machine), and any claim or recovery row left at the end.
  Not judged while the server restarts, nor while a paused or partitioned host may hold
  the session locks of its open transaction (other hosts' recovery waits for them: the
  server ends such a transaction only after `idle_in_transaction_session_timeout`), nor
  within the same window after it let go (the peers whose writer connection waited behind
  those locks resume their recovery passes then);
* `zombie_writes`: writes that landed after the claim they were fenced on had ended, in
  commit order, and heartbeats that revived an expired lease.
The last line gives the faults actually injected and these four figures; the exit status is
non-zero on any violation (or, in a default-length run, when a fault kind ran fewer than 3
times).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import logging
import os
import random
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import attrs
import psycopg
import psycopg.conninfo
import psycopg.sql
import trio

from .. import _backend, _codec, _postgres, _store
from .._backend import Engine
from .._errors import LeaseLost, StoreError
from .._model import Claim
from .._postgres import PostgresStore
from .._runtime import DrainContext, Runtime
from . import audit, broken, common
from .proxy import FaultProxy, Link

T = TypeVar("T")

HANDOFF_KILL_HOLD = 60.0  # seconds a hook held for a SIGKILL waits for it
HANDOFF_STOP_HOLD = 0.5  # seconds a hook held for a SIGSTOP waits (it returns after SIGCONT)
ORPHAN_SLACK = 1.0  # seconds of scheduling slack before an expired claim counts as orphaned
STARTUP = 2.0  # seconds the workers get to boot before the first host fault
MIN_FAULTS = 3  # each fault kind, in a run at least as long as the default
WORK_STEP = 0.05  # seconds between two effects of a drain's work

# How long each claim has been expired with nobody on it: since the later of its own expiry
# and that of the recovery lease a recoverer took on it (negative: not expired).
EXPIRED_SQL = (
    "SELECT e.id, floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint"
    " - GREATEST(e.expires_at, COALESCE(r.expires_at, e.expires_at))"
    " FROM session_execution e LEFT JOIN session_recovery r ON r.execution_id = e.id"
)
# Recovery rows of executions that no longer have a claim are counted apart (see
# `stale_recovery_rows`): nothing can ever act on them; they count as orphaned.
LEFT_SQL = (
    "SELECT (SELECT COUNT(*) FROM session_input), (SELECT COUNT(*) FROM session"
    " WHERE time_woken IS NOT NULL), (SELECT COUNT(*) FROM session_execution),"
    " (SELECT COUNT(*) FROM session_recovery r WHERE EXISTS"
    "   (SELECT 1 FROM session_execution e WHERE e.id = r.execution_id)),"
    " (SELECT COUNT(*) FROM session_recovery r WHERE NOT EXISTS"
    "   (SELECT 1 FROM session_execution e WHERE e.id = r.execution_id))"
)


# ---------------------------------------------------------------------------------------------
# Worker process


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


# ---------------------------------------------------------------------------------------------
# The parent: proxies, producer, chaos, audit


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
    # before it applied; `_store.take_recovery_leases` undoes such leases since the soak
    # found them): counted apart, and as orphaned.
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


class Soak:
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
        self.rng = random.Random(args.seed)
        self.generation = 0
        self.workers: dict[int, common.Worker] = {}
        self.killed: set[str] = set()
        self.kill_times: dict[str, float] = {}  # SIGKILLs of the chaos, CLOCK_MONOTONIC
        # A graceful shutdown waits for drains blocked in a thread (a step at most).
        self.retiring = common.Retiring(bound=10 * (args.lease + args.work_max))
        self.proxies: list[FaultProxy] = []
        self.result = Result(skew_ms=args.skew_ms)
        self.submitted: dict[int, str] = {}
        self.orphans: set[str] = set()
        self.sampling_paused_until = 0.0
        self.hosts_held = 0
        self.held_until = 0.0
        self.started = time.monotonic()
        self.server_down = False
        self.admin = Admin(url, self.schema)
        self.producer: Engine | None = None  # opened (and the schema migrated) at install
        self._producer_limiter = trio.CapacityLimiter(1)
        self.worker_path: str | None = None
        if args.broken:
            self.worker_path = str(broken.make_copy(args.broken, workdir / "broken"))

    # -- setup ----------------------------------------------------------------------------------

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
        env = dict(os.environ)
        if self.worker_path is not None:
            # First on the path; and the worker's cwd (which `-m` puts before it) holds no
            # package, so the broken copy is the one imported.
            env["PYTHONPATH"] = os.pathsep.join(
                filter(None, [self.worker_path, env.get("PYTHONPATH")])
            )
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

    # -- host faults ----------------------------------------------------------------------------

    def hold_time(self) -> float:
        return self.rng.uniform(1.1, 1.5) * float(self.args.lease)

    async def held_in_handoff(self, worker: common.Worker, flag: str) -> bool:
        """Ask `worker`'s hook to hold the next claim handoff; whether it did within 2 s."""
        request = self.control / f"{flag}.{worker.name}"
        marker = self.control / f"held.{worker.name}"
        request.touch()
        try:
            with trio.move_on_after(2.0):
                # Another process writes the marker: polled, there is no event to await.
                while not marker.exists():  # noqa: ASYNC110
                    await trio.sleep(0.005)
                return True
            return False
        finally:
            request.unlink(missing_ok=True)

    async def kill(self, worker: common.Worker, nursery: trio.Nursery) -> None:
        in_handoff = False
        if self.rng.random() < self.args.handoff_ratio:
            in_handoff = await self.held_in_handoff(worker, "kill")
        worker.process.kill()
        worker.process.wait()  # a SIGKILLed process is reaped at once
        (self.control / f"held.{worker.name}").unlink(missing_ok=True)
        self.killed.add(worker.name)
        self.kill_times[worker.name] = time.monotonic()
        del self.workers[worker.slot]
        self.result.kills += 1
        self.result.handoff_kills += in_handoff

        async def restart() -> None:
            await trio.sleep(self.rng.uniform(0.0, 0.5))
            self.spawn(worker.slot)

        nursery.start_soon(restart)

    async def pause(self, worker: common.Worker) -> None:
        in_handoff = False
        if self.rng.random() < self.args.handoff_ratio:
            in_handoff = await self.held_in_handoff(worker, "stop")
        worker.process.send_signal(signal.SIGSTOP)
        try:
            with self.holding_locks():
                await trio.sleep(self.hold_time())
        finally:
            worker.process.send_signal(signal.SIGCONT)
            (self.control / f"held.{worker.name}").unlink(missing_ok=True)
        self.result.pauses += 1
        self.result.handoff_pauses += in_handoff

    async def partition(self, worker: common.Worker) -> None:
        proxy = self.proxies[worker.slot]
        in_tx = False
        if self.rng.random() < 0.7:
            # BEGIN, then a drain's write reads its execution's session, locks it, reads the
            # clock and the fence: a cut after the 3rd to 6th message lands around the fence.
            tripped = proxy.arm_partition(self.rng.randint(3, 6))
            with trio.move_on_after(2.0):
                await tripped.wait()
            in_tx = tripped.is_set()
        proxy.blackhole()
        try:
            with self.holding_locks():
                await trio.sleep(self.hold_time())
        finally:
            proxy.heal()
        self.result.partitions += 1
        self.result.partitions_in_tx += in_tx

    @contextlib.contextmanager
    def holding_locks(self) -> Iterator[None]:
        """A paused or partitioned host keeps the locks of its open transaction (its
        sessions cannot be recovered meanwhile): orphans are judged only after it let go."""
        self.hosts_held += 1
        try:
            yield
        finally:
            self.hosts_held -= 1
            self.held_until = time.monotonic()

    async def busy_token_kill(self, worker: common.Worker) -> None:
        """Kill `worker`'s liveness token connection while one of its drains is in a busy
        step (`common`): a live owner losing its token with a drain that cannot stop at
        once. The others must wait out the grace; the step is over before this returns."""
        request = common.BusyRequest.ask(self.control, worker.name)
        # Another process writes the marker: polled, there is no event to await.
        while (began := request.began()) is None:  # noqa: ASYNC110
            await trio.sleep(0.002)
        if not began:
            return
        killed = await self.terminate(
            "application_name = %s AND pid IN (SELECT pid FROM pg_locks"
            " WHERE locktype = 'advisory' AND objsubid = 2 AND granted"
            " AND classid = (hashtext('trio_sessions.owner:' || %s)::bigint"
            " & 4294967295)::oid)",
            f"{self.schema}-{worker.name}",
            self.schema,
        )
        self.result.busy_token_kills += killed
        # No other host fault (a pause would hold the blocking call past the grace) until
        # the step's blocking call is over.
        await trio.sleep(common.BUSY_BLOCK + 0.2)

    async def host_faults(self, nursery: trio.Nursery) -> None:
        """One host fault at a time, kinds in shuffled rounds, on a random live worker. A
        share of them (`--busy-ratio`) are busy token kills, in addition: the round's next
        kind waits for the next fault (so every kind still runs as often per round, and a
        ratio of 1 makes every fault a busy token kill)."""
        await trio.sleep(STARTUP)  # the workers boot first
        while True:
            kinds = ["kill", "pause", "partition", "restart"]
            self.rng.shuffle(kinds)
            while kinds:
                await trio.sleep(self.rng.uniform(*self.args.kill_gap))
                if not self.workers:
                    continue
                worker = self.rng.choice(list(self.workers.values()))
                # Only a host that serves has drains to ask into a busy step.
                busy = self.rng.random() < self.args.busy_ratio and self.retiring.serving(worker)
                kind = "busy token kill" if busy else kinds.pop()
                print(f"soak: {kind} {worker.name} at {self.elapsed():.1f} s")
                if busy:
                    await self.busy_token_kill(worker)
                elif kind == "restart":
                    if self.retiring.serving(worker):  # else SIGTERM just ends a starting one
                        self.rolling_restart(worker)
                elif kind == "kill":
                    await self.kill(worker, nursery)
                elif kind == "pause":
                    await self.pause(worker)
                else:
                    await self.partition(worker)

    # -- connection kills and the restart --------------------------------------------------------

    async def terminate(self, condition: str, *params: Any) -> bool:
        try:
            rows = await self.admin.rows(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                f" WHERE application_name LIKE %s AND {condition} ORDER BY random() LIMIT 1",
                f"{self.schema}-%",
                *params,
            )
        except (psycopg.Error, StoreError):
            return False
        return bool(rows and rows[0][0])

    async def conn_kills(self) -> None:
        """`pg_terminate_backend` of a random worker connection, or of one at its COMMIT."""
        while True:
            await trio.sleep(self.rng.uniform(*self.args.conn_kill_gap))
            if self.server_down:
                continue
            proxy = self.rng.choice(self.proxies)
            kind = self.rng.random()
            if kind < 0.3:
                self.result.conn_kills += await self.terminate("true")
            elif kind < 0.5:
                # A liveness token's connection (a live owner loses its token: it must stop
                # its drains before the others' grace runs out, DESIGN §4).
                killed = await self.terminate(
                    "pid IN (SELECT pid FROM pg_locks WHERE locktype = 'advisory'"
                    " AND objsubid = 2 AND granted"
                    " AND classid = (hashtext('trio_sessions.owner:' || %s)::bigint"
                    " & 4294967295)::oid)",
                    self.schema,
                )
                self.result.conn_kills += killed
                self.result.token_kills += killed
            elif kind < 0.8:
                proxy.arm_commit_trap(forward=self.rng.random() < 0.5)
                with trio.move_on_after(2.0):
                    await self.kill_at_commit(await proxy.trapped.receive())
                proxy.disarm()
                await self.release_trapped(proxy)
            else:
                proxy.reset()
                self.result.resets += 1

    async def release_trapped(self, proxy: FaultProxy) -> None:
        """A COMMIT trapped after the chaos stopped waiting: kill it all the same (a frozen
        link would hang its client forever)."""
        while True:
            try:
                link = proxy.trapped.receive_nowait()
            except trio.WouldBlock:
                return
            await self.kill_at_commit(link)

    async def kill_at_commit(self, link: Link) -> None:
        if link.scope.cancel_called:
            return  # the proxy gave up waiting and ended it: its port may be reused
        try:
            killed = await self.terminate("client_port = %s", link.upstream_port)
        finally:
            link.scope.cancel()  # the client sees its connection end, never the answer
        self.result.conn_kills += killed
        self.result.commit_kills += killed

    async def restart_once(self) -> None:
        if self.restart_server is None:
            return
        await trio.sleep(self.args.duration / 2)
        self.server_down = True
        print(f"soak: restarting the server at {time.monotonic() - self.started:.1f} s")
        try:
            await trio.to_thread.run_sync(self.restart_server)
        finally:
            self.server_down = False
            print(f"soak: server back at {time.monotonic() - self.started:.1f} s")
            # Nobody could recover while the server was down: give recovery its window.
            self.sampling_paused_until = time.monotonic() + self.orphan_grace()
        self.result.restarts += 1

    # -- producer and sampling -------------------------------------------------------------------

    async def produce(self) -> None:
        next_at = trio.current_time()
        n = 0
        while True:
            await trio.sleep_until(next_at)
            next_at = max(next_at + 1.0 / self.args.rate, trio.current_time() - 1.0)
            n += 1
            await self.submit(n, common.session_name(self.rng.randrange(self.args.sessions)))

    async def submit(self, n: int, session_id: str) -> None:
        """Submit input `n` until it is stored (the same id again after a StoreError: a
        retried submit stores one input, even after a COMMIT in doubt)."""
        payload = _codec.dumps({"n": n})
        while True:
            try:
                # Shielded (bounded by the store's patience): a stored input is always counted.
                with trio.CancelScope(shield=True):
                    await self.db(_store.submit, session_id, payload, f"in-{n}")
            except StoreError:
                await trio.sleep(0.1)
                continue
            self.submitted[n] = session_id
            self.result.inputs += 1
            return

    async def db(self, op: Callable[..., T], *args: Any) -> T:
        assert self.producer is not None, "install_schema() opens the producer"
        return await trio.to_thread.run_sync(
            functools.partial(self.producer.run, op, *args),
            limiter=self._producer_limiter,
        )

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def orphan_grace(self) -> float:
        """How long a claim may stay expired with nobody on it: a lease and the next scan
        (whose recoverer, should it be killed or paused before it acted, holds the recovery
        lease for another lease), plus slack."""
        return float(self.args.lease + self.args.recovery_interval + ORPHAN_SLACK)

    async def sample(self) -> None:
        try:
            [(stranded,)] = await self.admin.rows(common.STRANDED_SQL)
            expired = await self.admin.rows(EXPIRED_SQL)
        except (psycopg.Error, StoreError):
            return  # the server restarts
        if stranded:
            print(f"soak: {stranded} session(s) with a pending input, no doorbell, no claim")
        self.result.stranded_observations += stranded
        now = time.monotonic()
        if (
            self.server_down
            or now < self.sampling_paused_until
            or self.hosts_held
            or now < self.held_until + self.orphan_grace()
        ):
            return
        grace_ms = self.orphan_grace() * 1000
        new = [
            execution_id
            for execution_id, expired_for_ms in expired
            if expired_for_ms > grace_ms and execution_id not in self.orphans
        ]
        if new:
            self.orphans.update(new)
            print(f"soak: ORPHANS at {time.monotonic() - self.started:.1f} s: {new}")
            await self.explain_orphans(new)

    async def explain_orphans(self, execution_ids: list[str]) -> None:
        """Evidence for the report: the claims, their recovery rows, the workers' backends."""
        with contextlib.suppress(psycopg.Error, StoreError):
            for row in await self.admin.rows(
                "SELECT e.id, e.session_id, e.owner_id, e.phase, r.owner_id, r.expires_at"
                " - floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint,"
                " r.recovery_error FROM session_execution e"
                " LEFT JOIN session_recovery r ON r.execution_id = e.id WHERE e.id = ANY(%s)",
                execution_ids,
            ):
                print(f"soak:   claim {row}")
            for row in await self.admin.rows(
                "SELECT application_name, state, wait_event_type, wait_event,"
                " round(extract(epoch FROM clock_timestamp() - xact_start)::numeric, 2),"
                " left(query, 80) FROM pg_stat_activity WHERE application_name LIKE %s",
                f"{self.schema}-%",
            ):
                print(f"soak:   backend {row}")

    def check_exits(self) -> None:
        self.result.unexpected_exits += common.restart_exited(self.workers, self.spawn)
        self.retiring.reap(self.kill_overdue)

    def kill_overdue(self, worker: common.Worker) -> None:
        """A SIGTERMed worker still shutting down past its bound: killed, and audited so."""
        worker.process.kill()
        worker.process.wait()
        self.killed.add(worker.name)
        self.result.kills += 1

    def rolling_restart(self, worker: common.Worker) -> None:
        """SIGTERM `worker` and start its successor in the same slot at once."""
        del self.workers[worker.slot]
        self.retiring.retire(worker)
        self.result.rolling_restarts += 1
        self.spawn(worker.slot)

    async def watch(self) -> None:
        while True:
            await self.sample()
            self.check_exits()
            await trio.sleep(0.25)

    # -- phases ---------------------------------------------------------------------------------

    async def chaos(self) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.produce)
            nursery.start_soon(self.host_faults, nursery)
            nursery.start_soon(self.conn_kills)
            nursery.start_soon(self.restart_once)
            await trio.sleep(self.args.duration)
            nursery.cancel_scope.cancel()
        # Faults end with the chaos: heal every path, resume every host.
        for proxy in self.proxies:
            proxy.disarm()
            proxy.heal()
            await self.release_trapped(proxy)
        for worker in self.workers.values():
            worker.process.send_signal(signal.SIGCONT)
        for path in self.control.glob("held.*"):
            path.unlink()
        for slot in range(self.args.workers):
            if slot not in self.workers:
                self.spawn(slot)
        while self.retiring.workers:
            self.retiring.reap(self.kill_overdue)
            await trio.sleep(0.02)
        self.result.unexpected_exits += self.retiring.bad_exits

    async def settle(self) -> None:
        """No more chaos or wakes: give the survivors the lease plus scans to finish."""
        (self.control / "stop-wakes").touch()
        args = self.args
        await trio.sleep(0.5)
        for index in range(args.sessions):
            # Inputs taken by a cancelled drain are answered by the session's next drain;
            # one wake per session brings it (lost wakes are still caught by the sampling).
            with contextlib.suppress(StoreError):
                await self.db(_store.wake, common.session_name(index))
        earliest = time.monotonic() + args.lease + args.recovery_interval
        with trio.move_on_after(args.settle_timeout):
            while True:
                if time.monotonic() >= earliest and await self.quiescent():
                    self.result.settled = True
                    return
                await trio.sleep(0.25)

    async def quiescent(self) -> bool:
        try:
            [left] = await self.admin.rows(LEFT_SQL)
            return tuple(left[:4]) == (0, 0, 0, 0) and not await self.unanswered_inputs()
        except (psycopg.Error, StoreError):
            return False

    async def unanswered_inputs(self) -> set[int]:
        rows = await self.admin.rows("SELECT data FROM session_message WHERE role = 'assistant'")
        answered = common.answered_numbers(data for (data,) in rows)
        return set(self.submitted) - answered

    async def audit(self) -> None:
        result = self.result
        result.unanswered = len(await self.unanswered_inputs())
        [left] = await self.admin.rows(LEFT_SQL)
        (
            result.pending_left,
            result.doorbells_left,
            result.claims_left,
            result.recovery_rows_left,
            result.stale_recovery_rows,
        ) = left
        result.orphans_seen = len(self.orphans)
        for row in await self.admin.rows(
            "SELECT r.execution_id, r.owner_id, r.recovery_error, r.expires_at, e.id IS NOT NULL"
            " FROM session_recovery r LEFT JOIN session_execution e ON e.id = r.execution_id"
        ):
            print(f"soak: RECOVERY ROW LEFT (execution, owner, error, expires, claim?) {row}")
        effects = audit.read_effects(sorted(self.workdir.glob("effects.*.jsonl")))
        found = audit.overlaps(effects)
        for line in found:
            print(f"soak: OVERLAP {line}")
        result.overlaps = len(found)
        result.repeats = audit.repeats(effects, self.killed)
        starts: dict[str, tuple[str, str, str, float]] = {}  # per drain iteration
        for effect in effects:
            if effect.kind not in ("exit", "claim") and effect.drain not in starts:
                starts[effect.drain] = (
                    effect.session_id,
                    effect.execution_id,
                    effect.worker,
                    effect.t,
                )
        ended = {effect.drain for effect in effects if effect.kind == "exit"}
        result.takeovers = audit.takeover_seconds(
            self.kill_times, ((*start, drain in ended) for drain, start in starts.items())
        )
        for effect in effects:
            if effect.kind == "exit":
                status = effect.status or "?"
                result.statuses[status] = result.statuses.get(status, 0) + 1
        entered = {effect.drain for effect in effects if effect.kind not in ("exit", "claim")}
        exited = {effect.drain for effect in effects if effect.kind == "exit"}
        result.statuses["killed"] = len(entered - exited)
        result.drains = len(entered | exited)
        result.executions = len({effect.execution_id for effect in effects})
        writes = [audit.Write(*row) for row in await self.admin.rows(audit.WRITES_SQL)]
        result.writes_logged = len(writes)
        zombies = audit.zombie_writes(writes)
        for write in zombies[:20]:
            print(f"soak: ZOMBIE WRITE {write}")
        result.zombie_writes = len(zombies)

    async def run(self) -> None:
        await trio.to_thread.run_sync(self.install_schema)
        server_port = int(psycopg.conninfo.conninfo_to_dict(self.url).get("port") or 5432)
        async with trio.open_nursery() as nursery:
            for _ in range(self.args.workers):
                proxy = FaultProxy(server_port)
                await nursery.start(proxy.serve)
                self.proxies.append(proxy)
            try:
                for slot in range(self.args.workers):
                    self.spawn(slot)
                watcher = trio.CancelScope()

                async def watch() -> None:
                    with watcher:
                        await self.watch()

                nursery.start_soon(watch)
                await self.chaos()
                await self.settle()
                watcher.cancel()
                await self.audit()
            finally:
                self.stop()
                nursery.cancel_scope.cancel()

    def stop(self) -> None:
        common.stop_workers(self.workers)

    def close(self) -> None:
        self.admin.close()
        if self.producer is not None:
            self.producer.close()


@contextlib.contextmanager
def database(args: argparse.Namespace) -> Iterator[tuple[str, Callable[[], None] | None]]:
    """The server's URL and how to restart it (None: a server the soak did not start)."""
    if args.pg_url:
        yield args.pg_url, None
        return
    from .pgserver import throwaway_server

    with throwaway_server() as server:
        yield server.url, server.restart


def run_soak(args: argparse.Namespace) -> int:
    workdir = (
        Path(args.dir).resolve() if args.dir else Path(tempfile.mkdtemp(prefix="trio-pgsoak-"))
    )
    workdir.mkdir(parents=True, exist_ok=True)
    print(
        f"soak: backend=postgres workers={args.workers} sessions={args.sessions}"
        f" duration={args.duration}s rate={args.rate}/s lease={args.lease}s"
        f" recovery_interval={args.recovery_interval}s skew_ms=±{args.skew_ms}"
        f" broken={args.broken} seed={args.seed} dir={workdir}",
        flush=True,
    )
    with database(args) as (url, restart):
        soak = Soak(args, workdir, url, restart)
        try:
            trio.run(soak.run)
        finally:
            soak.close()
        if soak.result.clean and not args.keep and args.pg_url:
            # Someone else's server: leave no schema behind (ours is deleted with it).
            with psycopg.connect(url, autocommit=True) as conn:
                conn.execute(
                    psycopg.sql.SQL("DROP SCHEMA {} CASCADE").format(
                        psycopg.sql.Identifier(soak.schema)
                    )
                )
    result = soak.result
    repeats = result.repeats
    print(
        f"soak: settled={result.settled} handoff_kills={result.handoff_kills}"
        f" handoff_pauses={result.handoff_pauses} partitions_in_tx={result.partitions_in_tx}"
        f" commit_kills={result.commit_kills} token_kills={result.token_kills}"
        f" busy_token_kills={result.busy_token_kills}"
        f" resets={result.resets} restarts={result.restarts}"
        f" drains={result.drains} executions={result.executions} statuses={result.statuses}"
        f" writes_logged={result.writes_logged}"
    )
    print(
        f"soak: unanswered={result.unanswered}"
        f" stranded_observations={result.stranded_observations}"
        f" doorbells_left={result.doorbells_left} pending_left={result.pending_left}"
        f" orphans_seen={result.orphans_seen} claims_left={result.claims_left}"
        f" recovery_rows_left={result.recovery_rows_left}"
        f" stale_recovery_rows={result.stale_recovery_rows}"
        f" repeats_after_kill={repeats.after_kill} repeats_after_cancel={repeats.after_cancel}"
        f" repeats_after_failure={repeats.after_failure}"
        f" unexpected_repeats={repeats.unexpected} unexpected_exits={result.unexpected_exits}"
        f" rolling_restarts={result.rolling_restarts}"
    )
    print(f"soak: {audit.takeover_summary(result.takeovers)} (from a SIGKILL, reaped)")
    few = {kind: count for kind, count in result.fault_counts().items() if count < MIN_FAULTS}
    if args.duration >= 60 and (few or (restart is not None and result.restarts != 1)):
        print(f"soak: too few faults injected: {few} restarts={result.restarts}")
        ok = False
    else:
        ok = result.clean
    common.finish_workdir(workdir, ok=ok, keep=args.keep)
    print(
        f"backend=postgres kills={result.kills} pauses={result.pauses}"
        f" partitions={result.partitions} conn_kills={result.conn_kills}"
        f" skew_ms={result.skew_ms} inputs={result.inputs} lost={result.lost}"
        f" overlaps={result.overlaps} orphaned={result.orphaned}"
        f" zombie_writes={result.zombie_writes}",
        flush=True,
    )
    return 0 if ok else 1
