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
times). With `--control-ratio R` a share R of the producer's submits are conversation
controls, as in the SQLite soak (`common.Controls`; the line before the last has their
figures, and a broken promise of theirs is a violation too).

This module is the command: `Soak` produces, samples, runs the phases (chaos, settle,
audit) and `run_soak` reports. The worker process is `pgworker`, the faults `pgchaos`, the
shared state and the figures `pgstate`.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import signal
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import psycopg
import psycopg.conninfo
import psycopg.sql
import trio

from .. import _store
from .._errors import StoreError
from . import audit, common
from .pgchaos import Chaos
from .pgworker import worker_main as worker_main  # the `--worker` side
from .proxy import FaultProxy

T = TypeVar("T")

MIN_FAULTS = 3  # each fault kind, in a run at least as long as the default
# The host faults that take turns with busy token kills (`pgchaos.Chaos.host_faults`): a
# busy ratio of 1 gives them none, as `--busy-ratio` says ("1: nothing else").
HOST_FAULTS = frozenset({"kills", "pauses", "partitions", "rolling_restarts"})

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


class Soak(Chaos):
    """One run of the PostgreSQL soak: the producer, the sampling and the phases."""

    # -- producer and sampling --------------------------------------------------------------------

    async def produce(self) -> None:
        next_at = trio.current_time()
        n = 0
        while True:
            await trio.sleep_until(next_at)
            next_at = max(next_at + 1.0 / self.args.rate, trio.current_time() - 1.0)
            n += 1
            if self.controls.resumes_due():
                await self.resume_due()
            session_id = common.session_name(self.rng.randrange(self.args.sessions))
            await self.submit(self.controls.draw(self.rng, n, session_id))

    def run_until_done(self, op: Callable[..., T], *args: Any) -> T:
        """Run a producer's store operation (in a thread) until it is done: the same call
        again after a StoreError (a retried submit stores one input, even after a COMMIT in
        doubt; a pause and a resume are idempotent)."""
        assert self.producer is not None, "install_schema() opens the producer"
        while True:
            try:
                return self.producer.run(op, *args)
            except StoreError:
                time.sleep(0.1)

    async def submit(self, submit: common.Submit) -> None:
        """Make `submit` (`common.Controls`) until its input is stored or, a reject,
        refused. In a thread, which no cancellation abandons: a stored input or a pause is
        always recorded (a pause to be resumed)."""
        stored = await trio.to_thread.run_sync(
            self.controls.make, submit, self.run_until_done, limiter=self.producer_limiter
        )
        if stored:
            self.submitted[submit.n] = submit.session_id
            self.result.inputs += 1

    async def resume_due(self, *, everything: bool = False) -> None:
        """Resume the sessions whose pause is over (`everything`: all, before settling)."""
        resume = functools.partial(
            self.controls.resume_due, self.run_until_done, everything=everything
        )
        await trio.to_thread.run_sync(resume, limiter=self.producer_limiter)

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

    async def watch(self) -> None:
        while True:
            await self.sample()
            self.check_exits()
            await trio.sleep(0.25)

    # -- phases -----------------------------------------------------------------------------------

    def faults_done(self) -> int:
        """Host faults and busy token kills that happened (`--min-faults`)."""
        return self.result.host_turns + self.result.busy_token_kills

    async def wait_serving(self, bound: float = 60.0) -> None:
        """Until every worker serves (a loaded host boots one for seconds, which a short
        soak's chaos would otherwise spend waiting), `bound` at most."""
        start = time.monotonic()
        while time.monotonic() < start + bound:  # (`watch` restarts a worker that exits)
            if all(self.retiring.serving(worker) for worker in self.workers.values()):
                break
            await trio.sleep(0.02)
        print(f"soak: workers serving after {time.monotonic() - start:.1f} s", flush=True)

    async def chaos(self) -> None:
        """The producer and the faults for the duration, from when the workers serve."""
        await self.wait_serving()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.produce)
            nursery.start_soon(self.host_faults, nursery)
            nursery.start_soon(self.conn_kills)
            nursery.start_soon(self.restart_once)
            await trio.sleep(self.args.duration)
            with trio.move_on_after(2 * self.args.duration):
                # `--min-faults`: faults that wait for a serving worker fit fewer in the
                # duration on a loaded host, which boots a worker for seconds. (Counts the
                # chaos tasks keep: polled, there is no event to await.)
                while self.faults_done() < self.args.min_faults:  # noqa: ASYNC110
                    await trio.sleep(0.05)
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
        await self.resume_due(everything=True)
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
        result.controls = common.ControlAudit.judge(
            self.controls,
            stored_ids=(i for (i,) in await self.admin.rows(common.STORED_INPUT_IDS_SQL)),
            taken=[(i, t) for i, t in await self.admin.rows(common.TAKEN_SQL)],
            # An iteration's `enter` follows a checkpoint, where self-fencing cancels a
            # drain whose host was stopped past its lease (the handoff's `claim` does not).
            starts=(
                (effect.session_id, effect.execution_id, effect.worker, effect.t)
                for effect in effects
                if effect.kind == "enter"
            ),
            cut_off=self.cut_off,
        )
        result.controls.report()
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


@contextlib.contextmanager
def database(args: argparse.Namespace) -> Iterator[tuple[str, Callable[[], None] | None]]:
    """The server's URL and how to restart it (None: a server the soak did not start)."""
    if args.pg_url:
        yield args.pg_url, None
        return
    from .pgserver import throwaway_server

    with throwaway_server() as server:
        yield server.url, server.restart


def too_few_faults(counts: Mapping[str, int], *, host_turns: int) -> dict[str, int]:
    """The fault kinds injected fewer than `MIN_FAULTS` times although the run made room for
    them: a harness that stopped injecting one would pass its audit unchallenged.

    The host fault kinds share their turns with the busy token kills (`pgchaos`), and take
    the turns left to them in shuffled rounds: they are asked for only when those turns
    give each twice the minimum (`--busy-ratio` near 1 leaves few or none)."""
    host_asked = host_turns >= 2 * MIN_FAULTS * len(HOST_FAULTS)
    return {
        kind: count
        for kind, count in counts.items()
        if count < MIN_FAULTS and (host_asked or kind not in HOST_FAULTS)
    }


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
    few = too_few_faults(result.fault_counts(), host_turns=result.host_turns)
    if args.duration >= 60 and (few or (restart is not None and result.restarts != 1)):
        print(f"soak: too few faults injected: {few} restarts={result.restarts}")
        ok = False
    else:
        ok = result.clean
    print(f"soak: {soak.controls.summary(result.controls)}")
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
