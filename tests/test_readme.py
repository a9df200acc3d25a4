"""The README's code runs as written: the first program, and the drain tests it shows."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio
from trio.testing import MockClock

README = Path(__file__).parent.parent / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)


def test_first_program_runs(tmp_path: Path) -> None:
    """The 'A first program' block prints the user message and the echoed reply."""
    program = tmp_path / "first.py"
    program.write_text(python_blocks()[0])
    result = subprocess.run(
        [sys.executable, str(program)], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "user {'text': 'hello'}" in result.stdout
    assert "You said: hello" in result.stdout


@pytest.mark.parametrize(
    "name", ["test_shout_answers_in_capitals", "test_a_crashed_owner_is_resumed_after_its_lease"]
)
def test_testing_section_examples_pass(tmp_path: Path, name: str) -> None:
    """Each test shown under 'Testing your drains' passes under an autojump clock."""
    namespace: dict[str, Any] = {}
    exec(compile(python_blocks()[1], str(README), "exec"), namespace)
    clock = MockClock(autojump_threshold=0)
    trio.run(namespace[name], tmp_path, clock, clock=clock)
