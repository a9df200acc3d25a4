"""The kill soak in a short configuration: real worker processes, SIGKILLed and restarted."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAST_LINE = re.compile(
    r"^kills=(?P<kills>\d+) inputs=(?P<inputs>\d+)"
    r" duplicates_after_kill=(?P<duplicates>\d+)"
    r" lost=(?P<lost>\d+) overlaps=(?P<overlaps>\d+) orphaned=(?P<orphaned>\d+)$"
)


@pytest.mark.slow
def test_short_kill_soak_audit_is_clean(tmp_path: Path) -> None:
    """Workers killed at random (also inside the claim handoff) lose no input, never overlap
    on a session and leave no orphaned claim; the soak prints its figures last."""
    completed = subprocess.run(
        [
            sys.executable,
            "-m",
            "trio_sessions.soak",
            "--workers=3",
            "--sessions=6",
            "--duration=12",
            "--rate=15",
            "--kill-gap",
            "0.4",
            "1.5",
            "--handoff-ratio=0.5",
            "--settle-timeout=12",
            "--seed=8",
            "--model-steps=0",
            f"--dir={tmp_path / 'soak'}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    output = completed.stdout + completed.stderr
    assert completed.returncode == 0, output
    lines = completed.stdout.strip().splitlines()
    match = LAST_LINE.match(lines[-1])
    assert match is not None, output
    figures = {key: int(value) for key, value in match.groupdict().items()}
    assert (figures["lost"], figures["overlaps"], figures["orphaned"]) == (0, 0, 0), output
    assert figures["kills"] >= 3, output
    assert figures["inputs"] >= 100, output
    handoff = re.search(r"handoff_kills=(\d+)", completed.stdout)
    assert handoff is not None and int(handoff.group(1)) >= 1, output
