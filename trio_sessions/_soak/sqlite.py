"""The SQLite kill soak: worker processes on one file, SIGKILLed at random, and an audit.

`python -m trio_sessions.soak` (`--backend sqlite`, the default) starts N worker processes
(default 3), each running `open_runtime` on one SQLite file with a short lease, and a
producer (this process) that submits numbered inputs to M sessions (default 20) the way a
process that runs no drains does: durable inputs and doorbells, picked up by the workers'
recovery passes and by their own random wakes. A chaos loop SIGKILLs a random worker at
random moments - some of them inside the claim handoff, where the `acquisition_hook` pauses
on request - and restarts it; or restarts it gracefully (a rolling restart: SIGTERM, and its
successor started at once while its drains - half of them blocked in a thread - still
run); or (`--busy-ratio`) asks it for a busy step (`common`) and SIGKILLs it as soon as the
step's blocking call began in a child process, which lands its effect (a `soak_child` row)
after the worker died, within the takeover grace. The workers also interrupt random
sessions now and then, their own claims or (through `phase='cancelling'`) each other's.
Every drain iteration records its enter and exit (worker, execution id, wall times) in an
audit table of the same file, through its own connection, before its first durable effect
and after its last.

When the chaos stops, the surviving workers get the lease plus recovery passes to settle,
then the audit proves, and the last line says:

* `overlaps=0`: the drain intervals of different executions of one session never overlap
  (an execution killed mid-drain ends when its process was reaped, or when the blocking
  call it left running in a child landed its effect, if later);
* `lost=0`: every submitted input was answered by a finished assistant message, and no
  committed state ever held a pending input without a doorbell or a claim (sampled all
  along), and no doorbell is left;
* `orphaned=0`: no claim and no recovery row is left;
* `duplicates_after_kill`: inputs answered again because the drain that first answered them
  was killed before finishing; repeats after an interrupted drain are counted apart, and any
  other repeat is a violation.

With `--control-ratio R` a share R of the producer's submits are conversation controls
(interrupting and rejected submits, scheduled inputs, pauses resumed a moment later,
inputs cancelled at once) and the line before the last gives what `common.ControlAudit`
checks of them.

The exit status is non-zero on any violation. `--broken NAME` runs the workers on a copy of
the package with one deliberate defect (`broken`). A liveness token here is a `flock` that
only the death of its process releases, so the defect `ignore-lost-token` (a live owner
ignoring the loss of its token) has nothing to act on in this soak.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import attrs

from .. import _sqlite, _store
from .._bench.tools import child_env
from . import audit, broken, common
from .sqliteworker import worker_main as worker_main  # the `--worker` side

AUDIT_SCHEMA = """
CREATE TABLE IF NOT EXISTS soak_drain(
    id INTEGER PRIMARY KEY,
    session_id TEXT NOT NULL,
    execution_id TEXT NOT NULL,
    worker TEXT NOT NULL,
    resumed INTEGER NOT NULL,
    t_enter REAL NOT NULL,
    t_exit REAL,
    status TEXT
);
CREATE TABLE IF NOT EXISTS soak_processed(
    n INTEGER NOT NULL,
    drain_id INTEGER NOT NULL,
    execution_id TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS soak_submitted(
    n INTEGER PRIMARY KEY,
    session_id TEXT NOT NULL,
    t REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS soak_child(
    drain_id INTEGER NOT NULL,
    t REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS soak_kill(
    worker TEXT PRIMARY KEY,
    t REAL NOT NULL,
    in_handoff INTEGER NOT NULL
);
"""


# ---------------------------------------------------------------------------------------------
# The parent: producer, chaos, audit


@attrs.frozen
class Fault:
    """A fault the chaos drew (`Soak.draw_fault`): its kind ("kill", "handoff", "restart"
    or "busy"), the draw that picks its worker among those it may go to (`Soak.place`),
    the seconds until a killed worker's successor starts, and until the next fault."""

    kind: str
    pick: float
    successor: float
    gap: float


@attrs.define
class SoakResult:
    kills: int = 0
    handoff_kills: int = 0
    busy_kills: int = 0
    inputs: int = 0
    duplicates_after_kill: int = 0
    duplicates_after_cancel: int = 0
    unexpected_duplicates: int = 0
    unanswered: int = 0
    stranded_observations: int = 0
    doorbells_left: int = 0
    pending_left: int = 0
    overlaps: int = 0
    claims_left: int = 0
    recovery_rows_left: int = 0
    unexpected_exits: int = 0
    rolling_restarts: int = 0
    drains: int = 0
    executions: int = 0
    resumed: int = 0
    statuses: dict[str, int] = attrs.Factory(dict)
    settled: bool = False
    takeovers: list[float] = attrs.Factory(list)
    controls: common.ControlAudit = attrs.Factory(common.ControlAudit)

    @property
    def lost(self) -> int:
        return self.unanswered + self.stranded_observations + self.doorbells_left

    @property
    def orphaned(self) -> int:
        return self.claims_left + self.recovery_rows_left

    @property
    def ok(self) -> bool:
        return (
            self.settled
            and self.lost == 0
            and self.overlaps == 0
            and self.orphaned == 0
            and self.pending_left == 0
            and self.unexpected_duplicates == 0
            and self.unexpected_exits == 0
            and self.controls.violations == 0
        )


class Soak:
    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args = args
        self.workdir = workdir
        self.db = workdir / "soak.db"
        self.control = workdir / "control"
        self.control.mkdir()
        # The producer's draws and the chaos's, each its own stream of the seed: sharing one,
        # the submits and faults a seed gave depended on how they interleaved in time (a
        # loaded host), and a run's faults on how many draws waiting for a worker took.
        self.rng = random.Random(args.seed)
        self.chaos_rng = random.Random(f"chaos-{args.seed}")
        self.generation = 0
        self.workers: dict[int, common.Worker] = {}
        self.result = SoakResult()
        self.restart_at: dict[int, float] = {}
        # A graceful shutdown waits for drains blocked in a thread (work_max at most).
        self.retiring = common.Retiring(bound=10 * (args.lease + args.work_max))
        self.next_n = 1
        self.controls = common.Controls(args.control_ratio, time.time)
        self.engine = _sqlite.open_engine(self.db, migrate=True)
        # The same connection: the audit's own tables are written beside the store's.
        self.conn = self.engine.conn
        self.conn.executescript(AUDIT_SCHEMA)
        self.worker_path: str | None = None
        if args.broken:
            self.worker_path = str(broken.make_copy(args.broken, workdir / "broken"))

    # -- workers --------------------------------------------------------------------------------

    def spawn(self, slot: int) -> None:
        self.generation += 1
        name = f"w{slot}.{self.generation}"
        argv = [
            "--worker",
            name,
            "--db",
            str(self.db),
            "--control",
            str(self.control),
            "--sessions",
            str(self.args.sessions),
            "--lease",
            str(self.args.lease),
            "--recovery-interval",
            str(self.args.recovery_interval),
            "--work-max",
            str(self.args.work_max),
            "--interrupt-rate",
            str(self.args.interrupt_rate),
        ]
        env = child_env(self.worker_path)
        self.workers[slot] = common.start_worker(
            self.workdir, slot, name, argv, env=env, cwd=self.workdir
        )

    def kill(self, worker: common.Worker, *, in_handoff: bool, busy: bool = False) -> None:
        self.reap_killed(worker, in_handoff=in_handoff)
        del self.workers[worker.slot]
        self.result.busy_kills += busy

    def reap_killed(self, worker: common.Worker, *, in_handoff: bool) -> None:
        worker.process.kill()
        worker.process.wait()
        # Taken after the process was reaped: no drain of it can run later than this.
        self.conn.execute(
            "INSERT INTO soak_kill(worker, t, in_handoff) VALUES (?, ?, ?)",
            (worker.name, time.time(), int(in_handoff)),
        )
        self.result.kills += 1
        self.result.handoff_kills += int(in_handoff)
        for path in (self.control / f"pause.{worker.name}", self.control / f"paused.{worker.name}"):
            path.unlink(missing_ok=True)

    def handoff_owed(self) -> bool:
        """Whether the next kill must try the claim handoff: asked for (`handoff_ratio`) and
        not landed in two kills yet. Random choices alone left a short run with none (seed 3
        on a slow machine: eight kills, none inside a handoff), so the fault it exists to
        inject went untried."""
        return (
            self.args.handoff_ratio > 0 and self.result.kills >= 2 and not self.result.handoff_kills
        )

    def draw_fault(self) -> Fault:
        """The next fault, all of its draws at once: six of the chaos's stream each time,
        whatever the workers are doing, so a seed gives the same faults in the same order
        on any host (but for `handoff_owed`, which a handoff that missed calls for)."""
        args = self.args
        restart, busy, handoff, pick = (self.chaos_rng.random() for _ in range(4))
        successor = self.chaos_rng.uniform(0.0, 0.5)
        gap = self.chaos_rng.uniform(*args.kill_gap)
        kind = "kill"
        if self.handoff_owed():
            kind = "handoff"
        elif restart < args.restart_ratio:
            kind = "restart"
        elif busy < args.busy_ratio:
            kind = "busy"
        elif handoff < args.handoff_ratio:
            kind = "handoff"
        return Fault(kind, pick, successor, gap)

    def place(self, fault: str, pick: float) -> common.Worker | None:
        """The worker `fault` goes to now, or None while it must wait. A handoff, a rolling
        restart or a busy step needs a worker that serves (one still starting has no claims
        to hand off or drains to ask into a busy step); a plain kill takes any. Made a plain
        kill instead when none served, the fault a soak exists to inject went missing on a
        loaded host, where restarted workers boot for seconds - and each such kill of a
        booting worker kept it from serving (ten seconds with no busy kill)."""
        everyone = list(self.workers.values())
        if fault != "kill":
            everyone = [worker for worker in everyone if self.retiring.serving(worker)]
        return everyone[int(pick * len(everyone))] if everyone else None

    def faults_owed(self, overtime: float) -> bool:
        """Whether the chaos goes on past its duration (by `overtime` so far): fewer faults
        than `--min-faults` happened (kills of any kind, rolling restarts), and less than
        twice the duration more has passed. A loaded host boots workers for seconds, and
        faults that wait for a serving one then fit fewer in the duration."""
        done = self.result.kills + self.retiring.restarts
        return done < int(self.args.min_faults) and overtime < 2 * float(self.args.duration)

    def wait_serving(self, bound: float = 60.0) -> None:
        """Before the chaos: until every worker serves (a loaded host boots one for seconds,
        which a short soak's faults would otherwise spend waiting), `bound` at most."""
        start = time.monotonic()
        while time.monotonic() < start + bound:
            self.check_exits()
            if all(self.retiring.serving(worker) for worker in self.workers.values()):
                break
            time.sleep(0.02)
        print(f"soak: workers serving after {time.monotonic() - start:.1f} s", flush=True)

    def check_exits(self) -> None:
        self.result.unexpected_exits += common.restart_exited(self.workers, self.spawn)
        self.retiring.reap(self.kill_overdue)

    def kill_overdue(self, worker: common.Worker) -> None:
        self.reap_killed(worker, in_handoff=False)  # its slot holds its successor already

    def rolling_restart(self, worker: common.Worker) -> None:
        """SIGTERM `worker` and start its successor in the same slot at once."""
        del self.workers[worker.slot]
        self.retiring.retire(worker)
        self.spawn(worker.slot)

    # -- producer and sampling -------------------------------------------------------------------

    def submit_one(self) -> None:
        n = self.next_n
        self.next_n += 1
        session_id = common.session_name(self.rng.randrange(self.args.sessions))
        submit = self.controls.draw(self.rng, n, session_id)
        if not self.controls.make(submit, self.engine.run):
            return  # rejected: nothing stored, nothing owed
        self.conn.execute(
            "INSERT INTO soak_submitted(n, session_id, t) VALUES (?, ?, ?)",
            (n, session_id, time.time()),
        )
        self.result.inputs += 1

    def sample_stranded(self) -> None:
        stranded = int(self.conn.execute(common.STRANDED_SQL).fetchone()[0])
        if stranded:
            print(f"soak: {stranded} session(s) with a pending input, no doorbell, no claim")
        self.result.stranded_observations += stranded

    # -- phases --------------------------------------------------------------------------------

    def chaos(self) -> None:
        """Produce, kill and restart until the duration is over (from when the workers
        serve). A fault drawn waits, if it must, for a worker to take it (`place`)."""
        args = self.args
        self.wait_serving()
        start = time.monotonic()
        end = start + args.duration
        next_submit = start
        next_kill = start + self.chaos_rng.uniform(*args.kill_gap)
        next_sample = start
        handoff: tuple[common.Worker, float, Fault] | None = None
        busy: tuple[common.Worker, common.BusyRequest, Fault] | None = None
        drawn: tuple[Fault, float] | None = None  # a fault waiting for a worker, since
        while (now := time.monotonic()) < end or self.faults_owed(now - end):
            while next_submit <= now:
                self.submit_one()
                next_submit += 1.0 / args.rate
            self.controls.resume_due(self.engine.run)
            if handoff is not None:
                worker, deadline, fault = handoff
                paused = (self.control / f"paused.{worker.name}").exists()
                if paused or now >= deadline:
                    self.kill(worker, in_handoff=paused)
                    self.restart_at[worker.slot] = now + fault.successor
                    handoff = None
                    next_kill = now + fault.gap
            elif busy is not None:
                worker, request, fault = busy
                began = request.began()
                if began:
                    # Begun: SIGKILLed at once, its blocking call running on in its child.
                    self.kill(worker, in_handoff=False, busy=True)
                    self.restart_at[worker.slot] = now + fault.successor
                    busy = None
                    next_kill = now + fault.gap
                elif began is not None:
                    # No drain took the request (it is withdrawn): the step is asked again,
                    # of a serving worker, rather than made a plain kill.
                    busy = None
                    drawn = (fault, now)
            elif (drawn is not None or now >= next_kill) and self.workers:
                if drawn is None:
                    drawn = (self.draw_fault(), now)
                fault, drawn_at = drawn
                placed = self.place(fault.kind, fault.pick)
                if placed is not None:
                    worker, drawn = placed, None
                    if now - drawn_at >= 0.5:
                        waited = now - drawn_at
                        print(f"soak: a {fault.kind} waited {waited:.1f} s for a worker")
                if placed is None:
                    pass  # no worker serves yet: the fault waits for one
                elif fault.kind == "handoff":
                    (self.control / f"pause.{worker.name}").touch()
                    handoff = (worker, now + 2.0, fault)
                elif fault.kind == "restart":
                    self.rolling_restart(worker)
                    next_kill = now + fault.gap
                elif fault.kind == "busy":
                    busy = (worker, common.BusyRequest.ask(self.control, worker.name), fault)
                else:
                    self.kill(worker, in_handoff=False)
                    self.restart_at[worker.slot] = now + fault.successor
                    next_kill = now + fault.gap
            for slot, when in list(self.restart_at.items()):
                if when <= now:
                    del self.restart_at[slot]
                    self.spawn(slot)
            if now >= next_sample:
                self.sample_stranded()
                self.check_exits()
                next_sample = now + 0.25
            time.sleep(0.005)
        if handoff is not None:  # a hook paused for a kill that is due now
            worker, _, _ = handoff
            self.kill(worker, in_handoff=(self.control / f"paused.{worker.name}").exists())
        if drawn is not None:
            print(
                f"soak: a {drawn[0].kind} drawn {time.monotonic() - drawn[1]:.1f} s before the end"
                " found no serving worker"
            )
        if busy is not None:  # a busy step asked for: killed now, begun or not
            worker, request, _ = busy
            (self.control / f"busy.{worker.name}").unlink(missing_ok=True)
            self.kill(worker, in_handoff=False, busy=bool(request.began()))
        for slot in range(args.workers):
            if slot not in self.workers:
                self.spawn(slot)
        self.restart_at.clear()
        self.retiring.wait(self.kill_overdue)
        self.controls.resume_due(self.engine.run, everything=True)
        self.result.rolling_restarts = self.retiring.restarts
        self.result.unexpected_exits += self.retiring.bad_exits

    def settle(self) -> None:
        """No more chaos or wakes: give the survivors the lease plus scans to finish."""
        (self.control / "stop-wakes").touch()
        args = self.args
        if args.interrupt_rate > 0 or args.control_ratio > 0:
            # Inputs taken by an interrupted drain are answered by the session's next drain;
            # one wake per session (as from a process that runs no drains) brings it. Lost
            # wakes are still caught: the stranded-input sampling never stops. (A control
            # ends drains so too: recovery finishes a dead owner's claim of a paused session
            # as owner-lost, its inputs taken, and re-arms the doorbell only for untaken
            # ones - DESIGN §5.1; an interrupting submit's own input brings a successor.)
            time.sleep(0.5)
            for index in range(args.sessions):
                self.engine.run(_store.wake, common.session_name(index))
        earliest = time.monotonic() + args.lease + args.recovery_interval
        deadline = time.monotonic() + args.settle_timeout
        while time.monotonic() < deadline:
            self.sample_stranded()
            self.check_exits()
            if time.monotonic() >= earliest and self.quiescent():
                self.result.settled = True
                return
            time.sleep(0.2)

    def quiescent(self) -> bool:
        left = self.conn.execute(
            "SELECT (SELECT COUNT(*) FROM session_input), (SELECT COUNT(*) FROM session"
            " WHERE time_woken IS NOT NULL), (SELECT COUNT(*) FROM session_execution),"
            " (SELECT COUNT(*) FROM session_recovery)"
        ).fetchone()
        return tuple(left) == (0, 0, 0, 0) and not self.unanswered_inputs()

    def unanswered_inputs(self) -> set[int]:
        answered = common.answered_numbers(
            data
            for (data,) in self.conn.execute(
                "SELECT data FROM session_message WHERE role = 'assistant'"
            )
        )
        submitted = {n for (n,) in self.conn.execute("SELECT n FROM soak_submitted")}
        return submitted - answered

    def audit(self) -> None:
        result = self.result
        result.unanswered = len(self.unanswered_inputs())
        (
            result.pending_left,
            result.doorbells_left,
            result.claims_left,
            result.recovery_rows_left,
        ) = self.conn.execute(
            "SELECT (SELECT COUNT(*) FROM session_input), (SELECT COUNT(*) FROM session"
            " WHERE time_woken IS NOT NULL), (SELECT COUNT(*) FROM session_execution),"
            " (SELECT COUNT(*) FROM session_recovery)"
        ).fetchone()
        kills = dict(self.conn.execute("SELECT worker, t FROM soak_kill"))
        drains = self.conn.execute(
            "SELECT id, session_id, execution_id, worker, resumed, t_enter, t_exit, status"
            " FROM soak_drain ORDER BY id"
        ).fetchall()
        result.drains = len(drains)
        for *_, status in drains:
            key = status or "killed"
            result.statuses[key] = result.statuses.get(key, 0) + 1
        children = dict(
            self.conn.execute("SELECT drain_id, MAX(t) FROM soak_child GROUP BY drain_id")
        )
        result.overlaps = self.count_overlaps(drains, kills, children)
        result.controls = common.ControlAudit.judge(
            self.controls,
            stored_ids=(i for (i,) in self.conn.execute(common.STORED_INPUT_IDS_SQL)),
            taken=self.conn.execute(common.TAKEN_SQL),
            starts=(
                (session_id, execution_id, worker, t_enter)
                for _, session_id, execution_id, worker, _, t_enter, _, _ in drains
            ),
        )
        result.controls.report()
        result.takeovers = audit.takeover_seconds(
            kills,
            (
                (session_id, execution_id, worker, t_enter, t_exit is not None)
                for _, session_id, execution_id, worker, _, t_enter, t_exit, _ in drains
            ),
        )
        killed_drains = {
            drain_id
            for drain_id, _, _, worker, _, _, t_exit, _ in drains
            if t_exit is None and worker in kills
        }
        # Interrupted (or lease-lost) drains end 'cancelled': their inputs are answered again.
        cancelled_drains = {
            drain_id for drain_id, *_, status in drains if status in ("cancelled", "lease_lost")
        }
        processed: dict[int, list[int]] = {}
        for n, drain_id in self.conn.execute(
            "SELECT n, drain_id FROM soak_processed ORDER BY drain_id"
        ):
            processed.setdefault(n, []).append(drain_id)
        for drain_ids in processed.values():
            for earlier in drain_ids[:-1]:
                if earlier in killed_drains:
                    result.duplicates_after_kill += 1
                elif earlier in cancelled_drains:
                    result.duplicates_after_cancel += 1
                else:
                    result.unexpected_duplicates += 1

    def count_overlaps(
        self, drains: list[Any], kills: dict[str, float], children: dict[int, float]
    ) -> int:
        """Intervals of different executions of one session must never overlap. A drain
        ends at its exit, or when its process was reaped - or when the blocking call it
        left running in a child landed its effect, if that came later."""
        executions: dict[str, list[Any]] = {}
        for drain_id, session_id, execution_id, worker, resumed, t_enter, t_exit, _ in drains:
            end = t_exit if t_exit is not None else kills.get(worker, float("inf"))
            end = max(end, children.get(drain_id, end))
            span = executions.setdefault(execution_id, [session_id, t_enter, end])
            span[1] = min(span[1], t_enter)
            span[2] = max(span[2], end)
            self.result.resumed += int(resumed)
        self.result.executions = len(executions)
        by_session: dict[str, list[tuple[float, float, str]]] = {}
        for execution_id, (session_id, start, end) in executions.items():
            by_session.setdefault(session_id, []).append((start, end, execution_id))
        overlaps = 0
        for session_id, spans in by_session.items():
            spans.sort()
            latest_end, latest_id = float("-inf"), ""
            for start, end, execution_id in spans:
                if start < latest_end:
                    overlaps += 1
                    print(
                        f"soak: OVERLAP on {session_id}: {execution_id} entered at {start:.3f}"
                        f" while {latest_id} ran until {latest_end:.3f}"
                    )
                if end > latest_end:
                    latest_end, latest_id = end, execution_id
        return overlaps

    def stop(self) -> None:
        common.stop_workers(self.workers)
        self.conn.close()


def run_soak(args: argparse.Namespace) -> int:
    workdir = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="trio-soak-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(
        f"soak: workers={args.workers} sessions={args.sessions} duration={args.duration}s"
        f" rate={args.rate}/s lease={args.lease}s recovery_interval={args.recovery_interval}s"
        f" broken={args.broken} seed={args.seed} dir={workdir}",
        flush=True,
    )
    soak = Soak(args, workdir)
    try:
        for slot in range(args.workers):
            soak.spawn(slot)
        soak.chaos()
        soak.settle()
        soak.audit()
    finally:
        soak.stop()
    result = soak.result
    print(
        f"soak: settled={result.settled} handoff_kills={result.handoff_kills}"
        f" busy_kills={result.busy_kills} rolling_restarts={result.rolling_restarts}"
        f" drains={result.drains} executions={result.executions} resumed={result.resumed}"
        f" statuses={result.statuses}"
        f" duplicates_after_cancel={result.duplicates_after_cancel}"
    )
    print(f"soak: {audit.takeover_summary(result.takeovers)} (from a SIGKILL, reaped)")
    print(
        f"soak: unanswered={result.unanswered}"
        f" stranded_observations={result.stranded_observations}"
        f" doorbells_left={result.doorbells_left} pending_left={result.pending_left}"
        f" claims_left={result.claims_left} recovery_rows_left={result.recovery_rows_left}"
        f" unexpected_duplicates={result.unexpected_duplicates}"
        f" unexpected_exits={result.unexpected_exits}"
    )
    print(f"soak: {soak.controls.summary(result.controls)}")
    common.finish_workdir(workdir, ok=result.ok, keep=args.keep)
    print(
        f"kills={result.kills} inputs={result.inputs}"
        f" duplicates_after_kill={result.duplicates_after_kill} lost={result.lost}"
        f" overlaps={result.overlaps} orphaned={result.orphaned}",
        flush=True,
    )
    return 0 if result.ok else 1
