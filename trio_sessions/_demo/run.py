"""The demo's entry points: the command line, the run of every scene, Ctrl-C, the worker.

Responsibility: `main` (behind `python -m trio_sessions.demo`) parses the command line,
refuses an existing database, runs the scenes against one runtime and then the summary, and
turns the outcome into the exit status; `run_worker` is the body of scene 4's worker
process (`--worker`). Invariants: the exit status is 0 only if every check passed, 1 if one
failed, 2 for a refused database, 130 after Ctrl-C; `--db` is read as the text it is, and
anything but the path of a new SQLite file - any connection string, a PostgreSQL URL
included - is refused before anything runs, shown with its password masked (a `Path` would
fold `postgresql://` into a file name); Ctrl-C cancels the scenes only, so the
runtime still closes the ordinary way (its leases expired, the worker process killed); a
scene that hangs is cut off after `SCENE_TIMEOUT` and fails the summary instead.
"""

from __future__ import annotations

import argparse
import functools
import os
import shlex
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import trio

# Only public names: the demo is also a worked example of the API.
from .. import open_runtime

# The command line's, not the API's: the library's one rule for what a store name means and
# how it is shown.
from .._naming import IN_MEMORY_NAMES, check_sqlite_path, display_name, store_kind
from .agent import ScriptedAgent, ask, tool
from .checks import print_summary, verify
from .output import Clock, relay_log
from .scenes import SCENES, Facts, Stage, claim_hook

LEASE = 1.5  # short, so a killed worker's session is recovered within the demo
RECOVERY_INTERVAL = 0.5
SCENE_TIMEOUT = 20.0  # a scene that hangs fails the demo instead of hanging it
WORKER_LIFETIME = 30.0  # a worker whose parent vanished stops by itself
EXIT_INTERRUPTED = 130


async def run_demo(db: Path, stop: trio.CancelScope) -> bool | None:
    """All scenes against one runtime, then the summary. True if every check passed; None
    when `stop` was cancelled (Ctrl-C)."""
    clock = Clock()
    facts = Facts()
    agent = ScriptedAgent(clock.log)
    clock.log("demo", f"database {db}")
    async with open_runtime(
        db,
        agent,
        owner_id="demo",
        lease=LEASE,
        recovery_interval=RECOVERY_INTERVAL,
        acquisition_hook=claim_hook(db, facts, clock.log),
    ) as runtime:
        agent.runtime = runtime
        facts.demo_owner = runtime.owner_id
        clock.log("demo", f"runtime open as owner {runtime.owner_id} (lease {LEASE} s)")
        stage = Stage(runtime, agent, clock, db, facts)
        # Ctrl-C cancels the scenes only: the runtime then closes the ordinary way, ending
        # its drains and expiring their leases, and a worker process is killed.
        with stop:
            for scene in SCENES:
                with trio.move_on_after(SCENE_TIMEOUT) as timeout:
                    await scene(stage)
                if timeout.cancelled_caught:
                    clock.log("demo", f"{scene.__name__} timed out; the summary will say why")
    if stop.cancelled_caught:
        return None
    checks = await trio.to_thread.run_sync(verify, db, facts)
    print_summary(checks, time.monotonic() - clock.start)
    return all(check.passed for check in checks)


async def until_ctrl_c(work: Callable[[trio.CancelScope], Awaitable[bool | None]]) -> bool | None:
    """Run `work(stop)`; the first Ctrl-C cancels `stop`, which `work` honours gracefully."""
    stop = trio.CancelScope()
    with trio.open_signal_receiver(signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                async for _ in signals:
                    stop.cancel()
                    return

            nursery.start_soon(watch)
            result = await work(stop)
            nursery.cancel_scope.cancel()
    return result


async def run_worker(db: Path, session_id: str, lease: float) -> None:
    """Scene 4's worker process: start a slow turn, report READY, wait to be killed."""
    agent = ScriptedAgent(relay_log)
    with trio.move_on_after(WORKER_LIFETIME):
        # A long recovery interval: this worker exists to be killed, not to recover others.
        async with open_runtime(
            db, agent, owner_id="worker", lease=lease, recovery_interval=WORKER_LIFETIME
        ) as runtime:
            agent.runtime = runtime
            tool_started = agent.expect("tool", session_id)
            relay_log(session_id, f"user: 'Compile the Q3 report.' (owner {runtime.owner_id})")
            report = tool("compile_report", 60.0, topic="Q3 sales")
            await runtime.submit(session_id, ask("Compile the Q3 report.", report, reply="Done."))
            await tool_started.wait()
            print(f"READY {runtime.owner_id}", flush=True)
            await trio.sleep_forever()


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m trio_sessions.demo",
        description="Watch trio_sessions drive a scripted agent through turns, interrupts, "
        "a killed worker process and a quarantined record. Network-free; ~10 s.",
    )
    parser.add_argument(
        "--db",
        metavar="PATH",
        help="keep the SQLite database at this new path (default: a temporary file)",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--session", default="chat-4", help=argparse.SUPPRESS)
    parser.add_argument("--lease", type=float, default=LEASE, help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.worker:
        return _worker_main(args)
    kept = None
    if args.db is not None:
        try:
            kept = fresh_database(args.db)
        except ValueError as exc:
            # As argparse words a bad argument, but returned: `main` gives every exit status.
            parser.print_usage(sys.stderr)
            print(f"{parser.prog}: error: argument --db: {exc}", file=sys.stderr)
            return 2
    with tempfile.TemporaryDirectory(prefix="trio-sessions-demo-") as tmp:
        db = kept if kept is not None else Path(tmp) / "demo.db"
        outcome = _run_guarded(db)
    if outcome is None:
        print("\nStopped by Ctrl-C; the runtime shut down cleanly.", file=sys.stderr)
        return EXIT_INTERRUPTED
    if kept is not None:
        print(
            f"The database is kept at {db}."
            f" Try: python -m trio_sessions status {shlex.quote(str(db))}"
        )
    return 0 if outcome else 1


def fresh_database(text: str) -> Path:
    """`--db` as the demo uses it: the path of an SQLite file that does not exist yet.
    `ValueError`, its message showing no password, for any connection string (scene 4's
    worker process and the summary's reads open an SQLite file: a PostgreSQL URL is refused
    too), an in-memory name, a name no file can have, a path that exists, or one whose
    directory does not."""
    if store_kind(text) == "postgres":  # a ValueError for a connection string of another form
        raise ValueError(
            f"{display_name(text)!r} is a PostgreSQL URL; the demo runs on a new SQLite file:"
            " pass its path, or no --db for a temporary one"
        )
    check_sqlite_path(text)  # a NUL, or bytes that are not UTF-8
    if text in IN_MEMORY_NAMES:
        raise ValueError(f"{text!r} names no file; scene 4's worker process opens the same one")
    path = Path(text)
    if path.exists():
        raise ValueError(f"{text} exists; the demo needs a fresh database path")
    # Else opening the runtime fails deep inside the scenes' nursery: a traceback.
    if not path.parent.is_dir():
        raise ValueError(f"{text}: no directory {str(path.parent)!r} to create it in")
    # Made and removed at once: a directory without write permission (or /proc) is
    # refused here, not as a traceback out of the scenes' nursery.
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except OSError as exc:
        raise ValueError(f"{text}: cannot create it: {exc.strerror}") from None
    path.unlink()
    # Absolute: a `Path` drops the "./" of "./host=x.db", and "host=x.db" reads as a libpq
    # string to the runtime, the worker process and the command the demo prints at the end.
    return path.absolute()


def _run_guarded(db: Path) -> bool | None:
    """`run_demo` under trio; None when stopped by Ctrl-C (also one that arrives before the
    signal receiver is installed: trio raises it inside an exception group)."""
    outcome: bool | None = None
    try:
        outcome = trio.run(until_ctrl_c, functools.partial(run_demo, db))
    except* KeyboardInterrupt:
        outcome = None
    return outcome


def _worker_main(args: argparse.Namespace) -> int:
    try:
        trio.run(run_worker, Path(args.db), args.session, args.lease)
    except* KeyboardInterrupt:
        pass  # the parent stops too; nothing to report
    return 0
