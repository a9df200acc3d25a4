"""The README's code runs as written: the first program, and the drain tests it shows."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

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


def test_testing_section_examples_pass_under_pytest_as_written(tmp_path: Path) -> None:
    """The tests shown under 'Testing your drains', saved as a file on their own and run by
    pytest with no configuration of ours (pytest-trio installed, as the README says), both
    pass. They failed there: an async test function needs pytest-trio's marker or its
    `trio_mode`, and only this repository's own configuration set it."""
    (tmp_path / "test_shout.py").write_text(python_blocks()[1])
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_shout.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        # This checkout's library, whatever an environment has installed.
        env={**os.environ, "PYTHONPATH": str(README.parent)},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 passed" in result.stdout


def test_testing_section_examples_bound_their_waits_and_say_when_the_takeover_comes() -> None:
    """'Testing your drains' asks to bound each test in time (`trio.fail_after`), yet its own
    tests were unbounded; and its crash test said the session resumed once "the lease runs
    out", where `testing.crash` frees the owner's token: the first recovery pass after
    `takeover_grace` takes the claim over, seconds before the lease (a reader following it
    slept out whole leases). The block itself, run by the test above, now waits for the
    resume under a bound shorter than its lease."""
    block = python_blocks()[1]
    tests = re.split(r"\nasync def (?=test_)", block)[1:]
    assert len(tests) == 2
    assert all("trio.fail_after(" in test for test in tests)
    assert "lease runs out" not in block
    assert "after_its_lease" not in block


def test_the_trial_server_recipe_exports_the_port_it_asks_for() -> None:
    """'A trial PostgreSQL server' ran `pg-trial-server [--port 5433]` and then exported a URL
    on port 5433; but without `--port` the server takes a free port (the tests rely on it),
    so a reader leaving out the optional-looking flag exported a URL nothing listens on."""
    text = README.read_text()
    start = text.index("**A trial PostgreSQL server.**")
    recipe = text[start : text.index("```", text.index("```", start) + 3)]
    exported = re.search(r"export TRIO_SESSIONS_STORE=postgresql://\S+:(\d+)/", recipe)
    assert exported is not None
    assert re.search(rf"pg-trial-server --port {exported.group(1)}\b", recipe)


def test_no_text_says_a_dead_process_waits_for_its_lease() -> None:
    """A dead owner's sessions resume about a second after it died (its liveness token is
    released: README "Crashes, resumes and side effects", `tests/test_liveness.py`), and so
    do those a worker held when a second signal made it exit at once (its exit releases the
    token: "Graceful restarts"). Older text still said they wait for the lease: the first
    program's note, the life-of-a-session diagram, "Running workers" (which contradicted
    "Graceful restarts") and three examples' docstrings - a reader sized timeouts and
    expectations on 30 s where the wait is about one."""
    root = README.parent
    texts = {
        name: " ".join((root / name).read_text().split())
        for name in (
            "README.md",
            "examples/agent_loop.py",
            "examples/chat_service.py",
            "examples/workers.py",
        )
    }
    stale = [
        "the process dies mid-answer, another runtime resumes the drain once the lease runs out",
        "owner dies ------------------+ the lease runs out",
        "the claims it still held are recovered when their leases run out",
        "another runtime resumes the drain after the lease runs out",
        "resumed by another worker once the lease runs out",
        "A worker that dies mid-answer is resumed by another after its lease",
    ]
    assert [(name, s) for name, text in texts.items() for s in stale if s in text] == []


def test_the_worker_flag_table_lists_every_worker_flag() -> None:
    """'Running workers' gives the worker's flags as a table, and `--metrics-bind` (with its
    `TRIO_SESSIONS_METRICS_BIND`) was missing from it: a reader of the table found no way
    to serve metrics, which only 'Logs and metrics' mentions."""
    from trio_sessions import _worker

    commands = argparse.ArgumentParser().add_subparsers()
    _worker.add_parser(commands)
    worker = commands.choices["worker"]
    flags = {o for action in worker._actions for o in action.option_strings} - {"-h", "--help"}
    text = README.read_text()
    section = text[text.index("## Running workers") : text.index("A flag wins over its variable")]
    rows = [line for line in section.splitlines() if line.startswith("| `--")]
    assert (
        sorted(
            flag for flag in flags if not any(f"`{flag} " in r or f"`{flag}`" in r for r in rows)
        )
        == []
    )
    assert "TRIO_SESSIONS_METRICS_BIND" in "".join(rows)
    # The worker's --help names the variables the flags fall back on: that one too.
    assert "TRIO_SESSIONS_METRICS_BIND" in (worker.description or "")


def test_the_testing_section_names_every_seam_and_what_it_is_called_with() -> None:
    """'Testing your drains' showed `set_seams(runtime, before_finish=...,
    before_recovery_apply=...)` and said each call replaces every seam, but never named
    `after_finish` nor said what a seam is: a reader could not write one (an async function,
    given the session id or the execution ids) without reading the source."""
    import inspect

    from trio_sessions import testing

    text = README.read_text()
    section = text[
        text.index("## Testing your drains") : text.index(
            "```python", text.index("## Testing your drains")
        )
    ]
    section = " ".join(section.split())
    seams = [name for name in inspect.signature(testing.set_seams).parameters if name != "runtime"]
    assert [name for name in seams if f"{name}=" not in section] == []
    assert "async" in section[section.index("set_seams(") :]
