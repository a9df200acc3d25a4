"""What both soaks share: session names, the drain's answer, the workers' life, the model run,
and the conversation controls the producer makes under chaos, with their audit.

A drain answers the numbered inputs it owes with one finished assistant message whose text
is the JSON list of their numbers; an input counts as answered once such a message exists.
A worker process is started with its output in its own log file, and one that exits by
itself (never the chaos's doing) is reported with the log's tail and started again. A rolling
restart SIGTERMs a worker (a graceful shutdown: its drains exit, then their claims are handed
back) and starts its successor at once, while the old process may still be shutting down;
its drains' exits are in the audit like any other, so a claim handed back while its drain
still ran shows as an overlap.

A *busy step* puts a drain where the takeover grace (DESIGN §4 "Owner liveness") is all
that keeps another owner out: the chaos asks a worker for one (`busy.<worker>` in the
control directory), the worker's next drain takes the request, marks the step as begun
(`busy-now.<worker>`) and starts a blocking call whose effect lands `BUSY_BLOCK` seconds
after the step began, whatever happens to the drain (or, on SQLite, to its process)
meanwhile. The chaos then takes the owner's token away at once: on PostgreSQL it kills the
token's connection (the owner lives and must stop its drains), on SQLite it SIGKILLs the
worker (the blocking call runs on in a child process). `BUSY_BLOCK` is shorter than the
default grace, so the correct library takes nothing over before the effect landed, while a
copy that takes over at the first free sighting, or ignores a lost token, overlaps.

*Controls* (`--control-ratio`, `Controls`): the producer makes a share of its submits as
the runtime's conversation controls do, with the same store calls, and records what each
promised; `ControlAudit` checks the promises against the store and the drains' starts.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import trio

from .. import _codec, _store
from .._backend import StoreBackend, Tx
from .._errors import SessionBusy
from .._model import Claim, Message, TextPart
from .._runtime import DrainContext, Runtime, open_runtime

# A pending input with neither a doorbell nor a claim: a lost wake, in one snapshot. (A
# scheduled input, `due_at` set, waits for the due timers, which ring when it falls due.)
STRANDED_SQL = (
    "SELECT COUNT(DISTINCT i.session_id) FROM session_input i JOIN session s"
    " ON s.id = i.session_id WHERE i.due_at IS NULL AND s.time_woken IS NULL AND NOT EXISTS"
    " (SELECT 1 FROM session_execution e WHERE e.session_id = i.session_id)"
)


# Printed once a worker's runtime is open: from then on SIGTERM is a graceful shutdown.
SERVING = "soak worker serving:"

# A busy step's blocking call lands its effect this long after the step began: well inside
# the default takeover grace (0.5 s; the rest is margin for a loaded host), and long enough
# for another owner's first look at the free token (every 0.25 s) and its takeover to fall
# within it. Then (PostgreSQL) this much ordinary, cancellable work follows: well over
# grace + a look + a recovery pass, so an owner that ignores its lost token is still acting
# when it is taken over, also on a loaded machine (1.0 s let a CI run's three busy token
# kills of `ignore-lost-token` all end before the takeover: no overlap for the audit).
BUSY_BLOCK = 0.3
BUSY_WORK = 2.5


def session_name(index: int) -> str:
    return f"s{index:03d}"


def unanswered(transcript: Sequence[Message]) -> list[int]:
    """Input numbers of user messages that no finished, successful answer covers yet."""
    answered: set[int] = set()
    for message in transcript:
        data = message.data
        if message.role == "assistant" and data.finished and data.error is None:
            for part in data.parts:
                if isinstance(part, TextPart):
                    answered.update(json.loads(part.text))
    asked = [int(m.data["n"]) for m in transcript if m.role == "user"]
    return [n for n in asked if n not in answered]


def answered_numbers(assistant_data: Iterable[str]) -> set[int]:
    """The input numbers answered by these stored assistant messages (raw `data` text)."""
    answered: set[int] = set()
    for data in assistant_data:
        message = json.loads(data)
        if message["finished"] and message["error"] is None:
            for part in message["parts"]:
                if part["type"] == "text":
                    answered.update(json.loads(part["text"]))
    return answered


async def answer(
    ctx: DrainContext, todo: list[int], call_id: str, work: Callable[[], Awaitable[None]]
) -> None:
    """Answer inputs `todo`: a `work` tool call around `work()`, then the JSON list of them."""
    writer = await ctx.begin_assistant()
    await writer.start_tool(call_id, "work", {"inputs": todo})
    await work()
    await writer.settle_tool(call_id, {"done": len(todo)})
    await writer.append_text(json.dumps(todo))
    await writer.finish()


@attrs.frozen(kw_only=True)
class WorkerConfig:
    """What every soak worker is told (each backend's worker adds where its store is)."""

    name: str
    control: Path
    sessions: int
    lease: float
    recovery_interval: float
    work_max: float
    interrupt_rate: float


async def serve(
    store: StoreBackend,
    drain: Callable[[DrainContext], Awaitable[None]],
    hook: Callable[[Claim], Awaitable[None]],
    config: WorkerConfig,
    rng: random.Random,
    *,
    opened: Callable[[Runtime], object],
) -> None:
    """Run the worker's runtime (`opened(runtime)` once it is open) and its random wakes
    and interrupts until the control file `stop-wakes` exists; then until SIGTERM, which
    closes the runtime gracefully (as the worker command does) and returns."""
    with trio.open_signal_receiver(signal.SIGTERM) as signals:
        async with open_runtime(
            store,
            drain,
            owner_id=config.name,
            lease=config.lease,
            recovery_interval=config.recovery_interval,
            max_resumes=1_000_000,
            acquisition_hook=hook,
        ) as runtime:
            opened(runtime)
            print(f"{SERVING} {config.name}", flush=True)
            async with trio.open_nursery() as nursery:

                async def stop_on_sigterm() -> None:
                    async for _ in signals:
                        print(f"soak worker {config.name}: SIGTERM, closing", flush=True)
                        nursery.cancel_scope.cancel()

                nursery.start_soon(stop_on_sigterm)
                await wake_and_interrupt(
                    runtime,
                    rng,
                    sessions=config.sessions,
                    interrupt_rate=config.interrupt_rate,
                    stopped=(config.control / "stop-wakes").exists,
                )


async def do_work(rng: random.Random, seconds: float) -> None:
    """A drain's work outside the database: half the time a blocking call in a thread,
    which no cancellation stops (a graceful shutdown must wait for it)."""
    if rng.random() < 0.5:
        await trio.to_thread.run_sync(time.sleep, seconds)
    else:
        await trio.sleep(seconds)


def take_busy_request(control: Path, worker: str) -> bool:
    """Whether the chaos asked `worker` for a busy step (the request is taken: one drain)."""
    try:
        (control / f"busy.{worker}").unlink()
    except FileNotFoundError:
        return False
    return True


def mark_busy(control: Path, worker: str) -> None:
    """Tell the chaos that `worker`'s busy step began (its blocking call runs now)."""
    (control / f"busy-now.{worker}").touch()


@attrs.define
class BusyRequest:
    """The chaos side of a busy step: asked, then whether it began (see the module doc)."""

    control: Path
    worker: str
    deadline: float  # time.monotonic()
    taken: bool = False

    @classmethod
    def ask(cls, control: Path, worker: str, patience: float = 2.0) -> BusyRequest:
        (control / f"busy-now.{worker}").unlink(missing_ok=True)
        (control / f"busy.{worker}").touch()
        return cls(control, worker, time.monotonic() + patience)

    def began(self) -> bool | None:
        """True once the step began, False once it will not (no drain took the request in
        time), None while undecided. A request taken at the last moment is waited for."""
        if (self.control / f"busy-now.{self.worker}").exists():
            (self.control / f"busy-now.{self.worker}").unlink(missing_ok=True)
            return True
        if time.monotonic() < self.deadline:
            return None
        if self.taken:
            return False
        try:
            (self.control / f"busy.{self.worker}").unlink()
        except FileNotFoundError:
            # A drain took it just now: its step begins in a moment.
            self.taken = True
            self.deadline = time.monotonic() + 2.0
            return None
        return False


async def wake_and_interrupt(
    runtime: Runtime,
    rng: random.Random,
    *,
    sessions: int,
    interrupt_rate: float,
    stopped: Callable[[], bool],
) -> None:
    """Wake random sessions, and interrupt random ones (local claims and, through
    phase='cancelling', other workers'), until `stopped()`; runs forever."""

    async def interrupts() -> None:
        while interrupt_rate > 0:
            await trio.sleep(rng.expovariate(interrupt_rate))
            if not stopped():
                await runtime.interrupt(session_name(rng.randrange(sessions)))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(interrupts)
        while True:
            await trio.sleep(rng.uniform(0.02, 0.3))
            if not stopped():
                await runtime.wake(session_name(rng.randrange(sessions)))


def finish_workdir(workdir: Path, *, ok: bool, keep: bool) -> None:
    """A clean run leaves nothing behind (unless asked to); a violation keeps its evidence."""
    if ok and not keep:
        shutil.rmtree(workdir, ignore_errors=True)
    elif not ok:
        print(f"soak: VIOLATION; evidence kept in {workdir}")


def run_model(steps: int) -> int:
    """The stateful model's long run (tests/test_model.py), when the tests are at hand."""
    candidates = [
        Path.cwd() / "tests" / "test_model.py",
        Path(__file__).resolve().parents[2] / "tests" / "test_model.py",
    ]
    model = next((path for path in candidates if path.exists()), None)
    if model is None:
        print("soak: tests/test_model.py not found; skipping the model run")
        return 0
    print(f"soak: stateful model, {steps} steps ({model})", flush=True)
    env = {**os.environ, "TRIO_SESSIONS_MODEL_STEPS": str(steps)}
    completed = subprocess.run(
        [sys.executable, "-m", "pytest", str(model), "-q", "-s", "-p", "no:cacheprovider"],
        env=env,
        check=False,
    )
    return completed.returncode


@attrs.define
class Worker:
    """A worker process of a soak, by its slot (restarted workers reuse theirs)."""

    slot: int
    name: str
    process: subprocess.Popen[bytes]
    log: Path


def start_worker(workdir: Path, slot: int, name: str, argv: list[str], **popen: Any) -> Worker:
    """Start worker `name` (`python -m trio_sessions.soak` + `argv`), logging to its file."""
    log = workdir / f"{name}.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "trio_sessions.soak", *argv],
            stdout=out,
            stderr=subprocess.STDOUT,
            **popen,
        )
    return Worker(slot, name, process, log)


def restart_exited(workers: dict[int, Worker], spawn: Callable[[int], None]) -> int:
    """Report and restart the workers that exited by themselves; how many did."""
    exited = 0
    for worker in list(workers.values()):
        if worker.process.poll() is not None:
            exited += 1
            tail = worker.log.read_text(errors="replace")[-2000:]
            print(
                f"soak: worker {worker.name} exited by itself"
                f" (status {worker.process.returncode}):\n{tail}",
                file=sys.stderr,
            )
            del workers[worker.slot]
            spawn(worker.slot)
    return exited


@attrs.define
class Retiring:
    """Workers SIGTERMed by a rolling restart, until they exited (0 expected)."""

    bound: float
    workers: list[tuple[Worker, float]] = attrs.Factory(list)
    restarts: int = 0
    bad_exits: int = 0

    @staticmethod
    def serving(worker: Worker) -> bool:
        """Whether `worker` opened its runtime (before that, SIGTERM just ends the process)."""
        return SERVING in worker.log.read_text(errors="replace")

    def retire(self, worker: Worker) -> None:
        """SIGTERM `worker`; its successor is started by the caller at once."""
        worker.process.send_signal(signal.SIGTERM)
        self.workers.append((worker, time.monotonic() + self.bound))
        self.restarts += 1

    def reap(self, on_overdue: Callable[[Worker], None]) -> None:
        """Collect exited workers; SIGKILL (and report through `on_overdue`, which records
        it as a kill) one still shutting down after the bound."""
        still = []
        for worker, deadline in self.workers:
            status = worker.process.poll()
            if status is None and time.monotonic() < deadline:
                still.append((worker, deadline))
            elif status is None:
                print(f"soak: {worker.name} did not exit after SIGTERM; killing it")
                on_overdue(worker)
            elif status != 0:
                self.bad_exits += 1
                tail = worker.log.read_text(errors="replace")[-2000:]
                print(f"soak: {worker.name} exited {status} after SIGTERM:\n{tail}")
        self.workers = still

    def wait(self, on_overdue: Callable[[Worker], None]) -> None:
        """Until every retiring worker has exited (or was killed past its bound)."""
        while self.workers:
            self.reap(on_overdue)
            time.sleep(0.02)


def stop_workers(workers: dict[int, Worker]) -> None:
    """SIGKILL and reap every worker."""
    for worker in workers.values():
        worker.process.kill()
        worker.process.wait()
    workers.clear()


# ---------------------------------------------------------------------------------------------
# Conversation controls under chaos (`--control-ratio`)

# What a control submit may be, drawn evenly (DESIGN §5.1): a double text that interrupts
# the running drain, a submit refused while the session is busy, a scheduled input, a
# pause of the session (with a queued input for it to hold) resumed a moment later, and an
# input withdrawn at once (`cancel_input`; half of them queued, racing the drain's take,
# half scheduled, not due yet).
CONTROL_KINDS = ("interrupt", "reject", "scheduled", "pause", "cancel")
SCHEDULE_DELAY = (0.2, 2.0)  # seconds
PAUSE_LENGTH = (0.1, 1.0)  # seconds
# A queued input's cancel follows its submit after this long (seconds): sometimes before a
# drain takes it, sometimes after.
CANCEL_AFTER = (0.0, 0.03)
# Two reads of the lease clock in milliseconds (the producer's before its submit, the take's
# transaction later): integer truncation, and on SQLite two processes' reads of the wall clock.
DUE_TOLERANCE_MS = 5
# A drain start logged this long after a pause (or an interrupting submit's mark of its
# claim) committed is one that must not have started: the start's log follows the
# transaction that decided it (an iteration boundary or a claim before the pause or the
# mark), through a thread and, on SQLite, the audit's own write. Without any slack, runs
# of 30 s (SQLite) and 45 s (PostgreSQL) saw one such start, 1 ms after its pause.
START_SLACK = 0.2
# A scheduled input taken this late is named in the output (not judged: see `late_ms`).
LATE_SHOWN_MS = 5000
# Every input id the store holds, pending or taken (the producer's ids are `in-<n>`).
STORED_INPUT_IDS_SQL = (
    "SELECT id FROM session_input UNION ALL"
    " SELECT input_id FROM session_message WHERE input_id IS NOT NULL UNION ALL"
    " SELECT id FROM session_input_rejected"
)
# When each input was taken: its user message is written by the take, at the take's `now`.
TAKEN_SQL = (
    "SELECT input_id, time_created FROM session_message"
    " WHERE role = 'user' AND input_id IS NOT NULL"
)


def input_id(n: int) -> str:
    return f"in-{n}"


def store_clock(tx: Tx) -> int:
    """The lease clock (ms) as a store transaction reads it: the clock a due time is set on."""
    return tx.now


def input_state(tx: Tx, input_id: str) -> str:
    """Where an input is: "pending" (or scheduled), "taken" (a user message) or "gone"."""
    for state, table, column in (
        ("pending", "session_input", "id"),
        ("taken", "session_message", "input_id"),
    ):
        if tx.one(f"SELECT 1 FROM {table} WHERE {column} = ?", (input_id,)):
            return state
    return "gone"


@attrs.frozen
class Submit:
    """One producer submit: input `n` of `kind` ("queue" or a control kind) to a session."""

    n: int
    session_id: str
    kind: str
    delay_ms: int = 0  # scheduled
    pause_for: float = 0.0  # pause: seconds until the resume
    cancel_after: float = 0.0  # cancel of a queued input: seconds from its submit

    def call(self) -> tuple[Callable[..., object], tuple[object, ...]]:
        """The store operation and its arguments, as `Runtime.submit` makes them (the
        producer runs no drains, so never the `_and_acquire` forms); a pause's input is
        queued, after the pause."""
        payload = _codec.dumps({"n": self.n})
        stored = (self.session_id, payload, input_id(self.n))
        if self.kind in ("interrupt", "reject"):
            return _store.submit_controlled, (*stored, self.kind)
        if self.delay_ms:  # scheduled, or a cancel of a scheduled input
            return _store.submit_scheduled, (*stored, self.delay_ms, "queue")
        return _store.submit, stored


@attrs.define
class Controls:
    """The producer's side of the controls: which submit is which, the pauses to resume,
    and what the audit checks of them. `clock` is the clock the backend's drain starts are
    logged on, for the pause windows."""

    ratio: float
    clock: Callable[[], float]
    made: dict[str, int] = attrs.Factory(lambda: dict.fromkeys(("queue", *CONTROL_KINDS), 0))
    rejected: set[int] = attrs.Factory(set)
    # Scheduled input -> its due time's bounds (store ms): the lease clock read before its
    # submit and after it, plus the delay. A submit can wait long for a session lock (a
    # host partitioned inside a transaction holds it until the server ends that), so
    # lateness is measured from the later bound and earliness from the earlier one.
    due: dict[int, tuple[int, int]] = attrs.Factory(dict)
    resume_at: dict[str, float] = attrs.Factory(dict)  # paused session -> time.monotonic()
    paused_since: dict[str, float] = attrs.Factory(dict)  # paused session -> `clock`
    windows: list[tuple[str, float, float]] = attrs.Factory(list)
    marked: dict[str, float] = attrs.Factory(dict)  # claim an interrupt marked -> `clock`
    resumes: int = 0
    while_paused: int = 0  # inputs submitted to a paused session (answered after its resume)
    cancelled: set[int] = attrs.Factory(set)  # inputs a cancel withdrew: never to be taken
    cancel_faults: list[str] = attrs.Factory(list)  # cancels that broke their promise

    def draw(self, rng: random.Random, n: int, session_id: str) -> Submit:
        """Input `n`'s submit. A ratio of 0 draws nothing, so a run keeps the random draws
        of a soak without controls."""
        if self.ratio <= 0 or rng.random() >= self.ratio:
            return Submit(n, session_id, "queue")
        kind = rng.choice(CONTROL_KINDS)
        if kind == "scheduled":
            return Submit(n, session_id, kind, delay_ms=round(rng.uniform(*SCHEDULE_DELAY) * 1000))
        if kind == "pause":
            return Submit(n, session_id, kind, pause_for=rng.uniform(*PAUSE_LENGTH))
        if kind == "cancel" and rng.random() < 0.5:
            return Submit(n, session_id, kind, delay_ms=round(rng.uniform(*SCHEDULE_DELAY) * 1000))
        if kind == "cancel":
            return Submit(n, session_id, kind, cancel_after=rng.uniform(*CANCEL_AFTER))
        return Submit(n, session_id, kind)

    def make(self, submit: Submit, run: Callable[..., Any]) -> bool:
        """Make `submit` through `run(op, *args)` (one store transaction each; a
        `StoreError` retried by `run` itself, with the same input id); whether its input
        was stored (and is owed an answer)."""
        before_ms = run(store_clock) if submit.kind == "scheduled" else None
        if submit.kind == "pause":
            self.pausing(submit)
            run(_store.pause, submit.session_id)
            self.paused(submit)
        op, args = submit.call()
        try:
            stored = run(op, *args)
        except SessionBusy:
            self.refused(submit)
            return False
        if submit.kind == "interrupt" and stored[1] is not None:
            # The running claim it marked cancelling: no drain iteration of it starts now.
            self.marked.setdefault(stored[1], self.clock())
        if submit.kind == "cancel":
            return self.withdraw(submit, run)
        self.stored(submit)
        if before_ms is not None:
            self.due[submit.n] = (before_ms + submit.delay_ms, run(store_clock) + submit.delay_ms)
        return True

    def withdraw(self, submit: Submit, run: Callable[..., Any]) -> bool:
        """Cancel the input `submit` just stored (DESIGN §5.1); whether it is still owed (a
        drain took it first). The store then says where the input is: gone (withdrawn -
        also by a call whose reply was lost, which answers False when made again), taken,
        or waiting. A cancel that answered True for an input still there, or False for one
        still waiting, broke its promise."""
        n = submit.n
        time.sleep(submit.cancel_after)  # the producer's own pace (SQLite: its only thread)
        withdrawn = run(_store.cancel_input, input_id(n))
        state = run(input_state, input_id(n))
        if state == "gone":
            self.made["cancel"] += 1
            self.cancelled.add(n)
            return False
        if withdrawn or state == "pending":
            self.cancel_faults.append(f"input {n}: the cancel answered {withdrawn}, it is {state}")
        self.stored(submit)
        return True

    def resume_due(self, run: Callable[..., Any], *, everything: bool = False) -> None:
        """Resume through `run` the sessions whose pause is over (`everything`: all of
        them, the chaos is over)."""
        for session_id in self.resumes_due(everything=everything):
            self.resuming(session_id)
            run(_store.resume, session_id)
            self.resumed(session_id)

    def pausing(self, submit: Submit) -> None:
        """Before the pause is written: its resume is owed from now on, whatever happens to
        the call (a pause that landed unrecorded would never be resumed)."""
        resume_at = time.monotonic() + submit.pause_for
        self.resume_at[submit.session_id] = max(
            resume_at, self.resume_at.get(submit.session_id, resume_at)
        )

    def paused(self, submit: Submit) -> None:
        """The pause committed: drain starts on the session from now on are violations."""
        self.paused_since.setdefault(submit.session_id, self.clock())

    def stored(self, submit: Submit) -> None:
        """Input `submit.n` is stored (owed)."""
        self.made[submit.kind] += 1
        self.while_paused += submit.session_id in self.resume_at

    def refused(self, submit: Submit) -> None:
        """A reject submit found the session busy: nothing stored, nothing owed."""
        self.made[submit.kind] += 1
        self.rejected.add(submit.n)

    def resumes_due(self, *, everything: bool = False) -> list[str]:
        """The paused sessions whose resume is due (`everything`: all of them, the chaos is
        over). The producer resumes each (`resuming`, the call, `resumed`) before it pauses
        or submits again, so no pause lands between a resume's call and its record."""
        now = time.monotonic()
        return [s for s, at in self.resume_at.items() if everything or at <= now]

    def resuming(self, session_id: str) -> None:
        """The session's pause window closes now, before its resume is written."""
        since = self.paused_since.pop(session_id, None)
        if since is not None:
            self.windows.append((session_id, since, self.clock()))

    def resumed(self, session_id: str) -> None:
        """The resume committed (a call cut short leaves the resume owed: done again)."""
        del self.resume_at[session_id]
        self.resumes += 1

    def summary(self, audit: ControlAudit) -> str:
        made = self.made
        return (
            f"controls queued={made['queue']} interrupts={made['interrupt']}"
            f" rejects={made['reject']} rejected={len(self.rejected)}"
            f" scheduled={made['scheduled']} pauses={made['pause']} resumes={self.resumes}"
            f" while_paused={self.while_paused} marked={len(self.marked)}"
            f" early_takes={len(audit.early_takes)} paused_starts={len(audit.paused_starts)}"
            f" marked_starts={len(audit.marked_starts)}"
            f" rejected_stored={len(audit.rejected_stored)} cancels={made['cancel']}"
            f" cancelled={len(self.cancelled)} cancel_faults={len(audit.cancel_faults)}"
            f" {audit.lateness()}"
        )


@attrs.frozen
class ControlAudit:
    """What the controls may never do: a scheduled input taken before it was due (§6.23), a
    drain started on a paused session (§6.24), a rejected input stored (§5.1), a drain
    iteration of a claim an interrupting submit marked cancelling (§5.1: it stops at once,
    and a successor takes the inputs), a cancelled input taken or stored again (§6.23), or
    a cancel's answer that the store's state contradicts (`Controls.withdraw`)."""

    early_takes: list[str] = attrs.Factory(list)
    paused_starts: list[str] = attrs.Factory(list)
    rejected_stored: list[int] = attrs.Factory(list)
    marked_starts: list[str] = attrs.Factory(list)
    # Per scheduled input taken, ms from its due time (bounded from below) to its take: not
    # judged (a chaos with every worker dead delays it), shown for a due timer that is late.
    late_ms: list[int] = attrs.Factory(list)
    cancel_faults: list[str] = attrs.Factory(list)

    @property
    def violations(self) -> int:
        return (
            len(self.early_takes)
            + len(self.paused_starts)
            + len(self.rejected_stored)
            + len(self.marked_starts)
            + len(self.cancel_faults)
        )

    @classmethod
    def judge(
        cls,
        controls: Controls,
        *,
        stored_ids: Iterable[str],
        taken: Iterable[tuple[str, int]],
        starts: Iterable[tuple[str, str, str, float]],
        cut_off: Mapping[str, Sequence[tuple[float, float]]] | None = None,
    ) -> ControlAudit:
        """`stored_ids` (`STORED_INPUT_IDS_SQL`), `taken` (`TAKEN_SQL`: input id, take
        time by the lease clock) and the drain iterations' `starts` (session, execution,
        worker, time by `controls.clock`); `cut_off`: per worker, when it was stopped or
        partitioned (`heard_at`)."""
        starts = list(starts)
        windows = cut_off or {}

        def heard_at(worker: str, at: float) -> float:
            """When `worker` could act on a control committed `at`: then, unless it was
            cut off from the change signals at that moment (SIGSTOP, a partition), when
            that ended - a host paused past its lease stops its drains by itself; one
            paused less (cut short by the chaos' end) hears of the control on SIGCONT."""
            for since, until in windows.get(worker, ()):
                if since <= at + START_SLACK and until >= at:
                    at = max(at, until)
            return at

        due = {input_id(n): (n, *bounds) for n, bounds in controls.due.items()}
        scheduled = [(i, at) for i, at in taken if i in due]
        early = [
            f"input {due[i][0]} taken at {at} ms, due at {due[i][1]} ms or later"
            for i, at in scheduled
            if at < due[i][1] - DUE_TOLERANCE_MS
        ]
        late = sorted(at - due[i][2] for i, at in scheduled)
        for i, at in scheduled:
            if at - due[i][2] > LATE_SHOWN_MS:
                print(f"soak: late take of scheduled input {i}: {at - due[i][2]} ms after due")
        by_session: dict[str, list[tuple[float, float]]] = {}
        for session_id, since, until in controls.windows:
            by_session.setdefault(session_id, []).append((since, until))
        paused = [
            f"{session_id}: a drain started at {t:.3f} on {worker}, paused from {since:.3f}"
            f" to {until:.3f}"
            for session_id, _, worker, t in starts
            for since, until in by_session.get(session_id, ())
            if heard_at(worker, since) + START_SLACK <= t < until
        ]
        marked = [
            f"{session_id}: {execution_id} started a drain at {t:.3f} on {worker}, marked"
            f" cancelling at {controls.marked[execution_id]:.3f}"
            for session_id, execution_id, worker, t in starts
            if execution_id in controls.marked
            and t >= heard_at(worker, controls.marked[execution_id]) + START_SLACK
        ]
        stored = set(stored_ids)
        rejected = sorted(n for n in controls.rejected if input_id(n) in stored)
        cancelled = [
            f"input {n}: cancelled, then found stored"
            for n in sorted(controls.cancelled)
            if input_id(n) in stored
        ]
        return cls(early, paused, rejected, marked, late, [*controls.cancel_faults, *cancelled])

    def lateness(self) -> str:
        late = self.late_ms
        if not late:
            return "scheduled_taken=0"
        p99 = late[min(len(late) - 1, len(late) * 99 // 100)]
        return (
            f"scheduled_taken={len(late)} late_p50_ms={late[len(late) // 2]}"
            f" late_p99_ms={p99} late_max_ms={late[-1]}"
        )

    def report(self) -> None:
        for line in self.early_takes[:20]:
            print(f"soak: EARLY TAKE {line}")
        for line in self.paused_starts[:20]:
            print(f"soak: DRAIN OF A PAUSED SESSION {line}")
        for n in self.rejected_stored[:20]:
            print(f"soak: REJECTED INPUT STORED: {n}")
        for line in self.marked_starts[:20]:
            print(f"soak: DRAIN OF A CLAIM MARKED CANCELLING {line}")
        for line in self.cancel_faults[:20]:
            print(f"soak: CANCEL BROKEN {line}")
