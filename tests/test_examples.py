"""Every program in examples/ runs as written, within bounds, and prints what it promises."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import trio

import trio_sessions

TESTS = Path(__file__).resolve().parent
EXAMPLES = TESTS.parent / "examples"
TIMEOUT = 60
DEADLINE = 20.0  # seconds a real process gets to reach an expected state


def run_example(name: str, env: dict[str, str] | None = None) -> str:
    run = subprocess.run(
        [sys.executable, str(EXAMPLES / name)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        cwd=EXAMPLES.parent,
        env=None if env is None else {**os.environ, **env},
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Traceback" not in run.stderr
    return run.stdout


def test_basic_answers_each_input_in_order() -> None:
    """basic.py: each submitted input is answered by the drain, in transcript order."""
    assert run_example("basic.py").splitlines() == [
        "1. user: hello",
        "2. assistant: You said: hello",
        "3. user: how are you?",
        "4. assistant: You said: how are you?",
    ]


@pytest.mark.parametrize(
    "store",
    ["postgresql://app:sekrit@127.0.0.1:1/app", "host=127.0.0.1 password=sekrit"],
    ids=["postgres-url", "libpq-dsn"],
)
def test_basic_never_takes_a_connection_string_for_a_file_name(tmp_path: Path, store: str) -> None:
    """basic.py's "pass a path to keep it": a connection string given instead is the store
    it names (here one that refuses), never a file named after it, and its password is
    never printed (DESIGN §6.27, §8). Found by the audit (audY55): the argument went through
    `Path`, which folds "postgresql://" into "postgresql:/", and the run ended in a
    traceback quoting "cannot open 'postgresql:/app:sekrit@...'". Refused now with one
    line, exit 1."""
    run = subprocess.run(
        [sys.executable, str(EXAMPLES / "basic.py"), store],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        cwd=tmp_path,
    )
    assert run.returncode == 1, run.stdout + run.stderr
    assert "sekrit" not in run.stdout + run.stderr
    assert "Traceback" not in run.stderr and run.stderr.startswith("error: "), run.stderr
    assert list(tmp_path.iterdir()) == []


def load_example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def until_transcript(runtime: trio_sessions.Runtime, session: str, length: int) -> None:
    with trio.fail_after(DEADLINE):
        while len(await runtime.transcript(session)) < length:
            await trio.sleep(0.05)


@pytest.mark.slow
async def test_basic_answers_the_question_a_sigkilled_owner_left_owed(tmp_path: Path) -> None:
    """basic.py's drain, resumed after the owner that took the input was SIGKILLed mid-answer,
    finds the question in the transcript and answers it (take_inputs returns nothing)."""
    echo = load_example("basic").echo
    db = tmp_path / "sessions.db"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRIO_SESSIONS_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")]))
    async with trio_sessions.open_runtime(db, None) as producer:
        await producer.submit("greeting", {"text": "hello", "hold": True})
        # worker_drain:reply takes the input, writes "holding" and waits: killed there.
        owner = await trio.lowlevel.open_process(
            [
                sys.executable,
                "-m",
                "trio_sessions",
                "worker",
                "worker_drain:reply",
                "--store",
                str(db),
                "--lease",
                "1",
            ],
            env=env,
            stderr=subprocess.DEVNULL,
        )
        try:
            await until_transcript(producer, "greeting", 2)
        finally:
            owner.kill()
            await owner.wait()
    async with trio_sessions.open_runtime(db, echo, lease=1, recovery_interval=0.1) as runtime:
        await until_transcript(runtime, "greeting", 3)
        await runtime.wait_idle("greeting")
        user, cut, answer = await runtime.transcript("greeting")
    assert user.data == {"text": "hello", "hold": True}
    assert cut.data.finished and cut.data.error == "interrupted: owner lost"
    assert answer.data.error is None
    assert [part.text for part in answer.data.parts] == ["You said: hello"]


def test_agent_loop_records_tools_and_the_interrupt() -> None:
    """agent_loop.py: tool calls complete, the interrupted one fails as 'interrupted', and
    the session serves the next question normally."""
    out = run_example("agent_loop.py")
    assert "interrupt accepted: True" in out
    messages = {line.split(".")[0].strip(): line for line in out.splitlines() if ". " in line}
    assert messages["2"].count("completed") == 2
    assert "archive_search" in messages["4"]
    assert "error: interrupted" in messages["4"]
    assert "<error: interrupted>" in messages["4"]
    assert "weather({'city': 'Oslo'}) completed" in messages["6"]
    assert "<error" not in messages["6"]


@pytest.mark.slow
def test_workers_share_one_file_and_pack_every_order_once() -> None:
    """workers.py: worker processes on one file pack all 12 orders, each exactly once. With
    unbuffered output (`PYTHONUNBUFFERED=1`, as many containers and CI runners set it), where
    every write reaches the shared pipe at once: no process's line is cut by another's."""
    out = run_example("workers.py", env={"PYTHONUNBUFFERED": "1"})
    assert out.splitlines()[-1].startswith("producer: 12/12 orders packed, by {'worker-")
    packed = [
        int(order)
        for line in out.splitlines()
        if line.startswith("worker-")
        for order in line.split("[", 1)[1].rstrip("]").split(", ")
    ]
    assert sorted(packed) == list(range(1, 13))


def test_workers_write_each_line_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """workers.py's processes share one standard output: each line, its newline included,
    goes out in one write, so that lines of two processes never interleave (print() writes
    the text and its end separately, which unbuffered output sends as two writes)."""
    workers = load_example("workers")
    writes: list[str] = []

    class Recorder(io.StringIO):
        def write(self, text: str) -> int:
            writes.append(text)
            return len(text)

    monkeypatch.setattr(sys, "stdout", Recorder())
    workers.say("worker-1: s1       packed order(s) [1, 3]")
    assert writes == ["worker-1: s1       packed order(s) [1, 3]\n"]


@contextlib.contextmanager
def as_from_a_terminal() -> Iterator[None]:
    """Processes started here begin with SIGINT at its default action, as a terminal's
    foreground job does. A test run started in the background by a non-interactive shell
    (`&`) has SIGINT ignored, and a child inherits that: Ctrl-C would do nothing."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize(
    "after",
    [
        pytest.param("producer: order 1 ", id="workers-still-starting"),
        pytest.param("worker-", id="workers-packing"),
    ],
)
def test_ctrl_c_stops_the_workers_example_quietly(after: str) -> None:
    """workers.py: Ctrl-C (SIGINT to the terminal's foreground process group) stops the
    producer and its workers with status 130 and one line saying so - no traceback from any
    of them, no process left behind - whether the workers are still starting (importing:
    a KeyboardInterrupt there is a traceback) or already packing orders."""
    with as_from_a_terminal():
        process = subprocess.Popen(
            [sys.executable, str(EXAMPLES / "workers.py")],
            cwd=EXAMPLES.parent,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
    try:
        assert process.stdout is not None
        for line in process.stdout:
            if line.startswith(after):
                break
        os.killpg(process.pid, signal.SIGINT)
        _, err = process.communicate(timeout=DEADLINE)
        left = subprocess.run(["pgrep", "-s", str(process.pid)], capture_output=True, text=True)
    finally:
        # The whole session: a worker may run in a process group of its own.
        subprocess.run(["pkill", "-KILL", "-s", str(process.pid)], check=False)
        process.wait()
    assert process.returncode == 130, err
    assert err.splitlines() == ["producer: interrupted"]
    assert left.stdout == ""


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        pytest.param(["--url", "nonsense"], "nonsense", id="url-no-scheme"),
        pytest.param(["--url", "ftp://127.0.0.1:21"], "ftp://", id="url-not-http"),
        pytest.param(["--spread", "-1"], "--spread", id="spread-negative"),
        pytest.param(["--spread", "nan"], "--spread", id="spread-nan"),
        pytest.param(["--timeout", "0"], "--timeout", id="timeout-zero"),
        pytest.param(["--timeout", "-5"], "--timeout", id="timeout-negative"),
    ],
)
def test_chat_load_refuses_a_bad_setting_naming_it(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """chat_load.py: a URL it cannot use, or a spread or timeout that is no duration, is a
    usage error naming it (exit 2) before any connection. Found by the audit (audY55): a
    URL with no host escaped as a bare AssertionError, and a negative or NaN spread or
    timeout as trio's ValueError, each with a traceback."""
    chat_load = load_example("chat_load")
    with pytest.raises(SystemExit) as exited:
        chat_load.main([*argv, "--chats", "1"])
    assert exited.value.code == 2
    assert named in capsys.readouterr().err


def test_chat_load_without_a_service_says_so_and_exits_1(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """chat_load.py pointed at a port nobody serves counts each chat as an error, says why
    and exits 1 - not an ExceptionGroup traceback out of its stream task, as it did before
    (found by the audit, audY55). An http URL without a port means port 80."""
    chat_load = load_example("chat_load")
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    # Closed on leaving the block: nothing listens there now.
    assert chat_load.main(["--url", f"http://127.0.0.1:{port}", "--chats", "2"]) == 1
    out = capsys.readouterr().out
    assert "errors=2" in out.splitlines()[-1]
    assert "cannot connect" in out
    assert chat_load.address_of("http://example.test") == ("example.test", 80)


@pytest.mark.parametrize(
    "argv",
    [["--workers", "0"], ["--workers", "-2"], ["--orders", "0"], ["--orders", "-1"]],
    ids=["no-workers", "negative-workers", "no-orders", "negative-orders"],
)
def test_workers_refuses_a_count_it_cannot_run_naming_it(argv: list[str]) -> None:
    """workers.py: no workers, or no orders, is a usage error naming the flag (exit 2) at
    once. Found by the audit (audY55): `--workers 0` submitted every order, waited out the
    whole 30 s deadline for workers that never came, then failed; `--orders -1` did the
    same; `--orders 0` started the workers for nothing and "passed"."""
    run = subprocess.run(
        [sys.executable, str(EXAMPLES / "workers.py"), *argv],
        capture_output=True,
        text=True,
        timeout=DEADLINE,
        cwd=EXAMPLES.parent,
    )
    assert run.returncode == 2, run.stdout + run.stderr
    assert argv[0] in run.stderr and "Traceback" not in run.stderr
    assert run.stdout == ""
