"""What both soaks share: session names, the drain's answer format, the model run.

A drain answers the numbered inputs it owes with one finished assistant message whose text
is the JSON list of their numbers; an input counts as answered once such a message exists.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

import attrs

from .._model import Message, TextPart


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
