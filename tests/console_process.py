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
def chat_service(store: str, log_dir: Path, **env: str) -> Iterator[str]:
    """The chat example's web process (examples/chat_service.py) on a free loopback port;
    yields its base URL. `env` sets e.g. CHAT_WORD_DELAY, how fast an answer streams."""
    process = spawn(
        [str(EXAMPLES / "chat_service.py"), "--store", store, "--bind", "127.0.0.1:0"],
        log_dir / "web.log",
        **env,
    )
    try:
        yield wait_for_line(process, r"chat service listening on (http://\S+)").group(1)
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


def seed_quarantine(path: Path, session_id: str, execution_id: str, seq: int = 1) -> None:
    """A quarantined execution as recovery leaves one: an expired claim whose assistant
    message does not decode, and its recovery row with the reason."""
    import time

    from helpers import Raw

    raw = Raw(path)
    now = int(time.time() * 1000)
    raw.seed_claim(session_id, execution_id, expires_at=now - 1)
    raw.seed_assistant(session_id, execution_id, seq, MALFORMED)
    raw.write(
        "INSERT INTO session_recovery(execution_id, session_id, owner_id, expires_at,"
        " recovery_error, time_created, time_quarantined) VALUES (?, ?, ?, ?, ?, ?, ?)",
        (
            execution_id,
            session_id,
            "recovery",
            now + 60_000,
            "data.finished: expected bool",
            now,
            now,
        ),
    )


MALFORMED = '{"parts": [], "finished": "false", "error": null}'
