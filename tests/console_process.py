"""Start `python -m trio_sessions console` (and workers) as real processes for the console
and browser tests (a helper, not a test file). Readiness is the console's log line; every
wait is bounded."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import attrs

DEADLINE = 20.0
TESTS = Path(__file__).resolve().parent
EXAMPLES = TESTS.parent / "examples"


@attrs.define
class Process:
    process: subprocess.Popen[bytes]
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=DEADLINE)
            except subprocess.TimeoutExpired:
                self.process.kill()
        return self.process.wait()


def environment(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRIO_SESSIONS_")}
    paths = [str(TESTS), str(EXAMPLES), env.get("PYTHONPATH")]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
    env.update(extra)
    return env


def spawn(argv: list[str], log: Path, **env: str) -> Process:
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, *argv],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=environment(**env),
        )
    return Process(process, log)


def wait_for_line(process: Process, pattern: str) -> re.Match[str]:
    deadline = time.monotonic() + DEADLINE
    while time.monotonic() < deadline:
        if (match := re.search(pattern, process.output())) is not None:
            return match
        if process.process.poll() is not None:
            break
        time.sleep(0.05)
    raise AssertionError(f"no line {pattern!r} in:\n{process.output()}")


@contextmanager
def console(store: str, log_dir: Path, *args: str, **env: str) -> Iterator[tuple[str, Process]]:
    """A console on a free loopback port; yields its base URL."""
    process = spawn(
        ["-m", "trio_sessions", "console", "--store", store, "--bind", "127.0.0.1:0", *args],
        log_dir / "console.log",
        **env,
    )
    try:
        match = wait_for_line(process, r"console listening on (http://\S+)")
        yield match.group(1), process
    finally:
        process.stop()


@contextmanager
def worker(store: str, log_dir: Path, drain: str, name: str, *args: str) -> Iterator[Process]:
    process = spawn(
        ["-m", "trio_sessions", "worker", drain, "--store", store, "--owner", name, *args],
        log_dir / f"worker-{name}.log",
    )
    try:
        wait_for_line(process, "worker started")
        yield process
    finally:
        process.stop()
