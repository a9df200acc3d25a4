"""Every program in examples/ runs as written, within bounds, and prints what it promises."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TIMEOUT = 60


def run_example(name: str) -> str:
    run = subprocess.run(
        [sys.executable, str(EXAMPLES / name)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        cwd=EXAMPLES.parent,
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
    """workers.py: worker processes on one file pack all 12 orders, each exactly once."""
    out = run_example("workers.py")
    assert out.splitlines()[-1].startswith("producer: 12/12 orders packed, by {'worker-")
    packed = [
        int(order)
        for line in out.splitlines()
        if line.startswith("worker-")
        for order in line.split("[", 1)[1].rstrip("]").split(", ")
    ]
    assert sorted(packed) == list(range(1, 13))
