"""What both soaks share: session names, the drain's answer, the workers' life, the model run.

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
from collections.abc import Awaitable, Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import attrs
import trio

from .._backend import StoreBackend
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
