"""The demo's terminal output: timestamped lines, scene titles, readable transcript messages.

Responsibility: how a line looks, and nothing else - no database, no runtime. Invariants:
every line is printed with `flush=True`, so the order a reader (or the parent of scene 4's
worker process) sees is the order of events; a worker's line is `who|text` on its stdout
and gets its timestamp from the parent that relays it, so all timestamps share one clock.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import attrs

# Only public names: the demo is also a worked example of the API.
from .. import Message, ToolPart

Log = Callable[[str, str], None]


@attrs.define
class Clock:
    """Seconds since the demo started, for the timestamp of every line."""

    start: float = attrs.field(factory=time.monotonic)

    def log(self, who: str, text: str) -> None:
        print(f"[{time.monotonic() - self.start:6.2f}s] {who:<8} {text}", flush=True)

    def scene(self, title: str) -> None:
        print(f"\n-- {title} " + "-" * max(4, 76 - len(title)), flush=True)


def relay_log(who: str, text: str) -> None:
    """The worker's log: its parent adds the timestamps when it relays the line."""
    print(f"{who}|{text}", flush=True)


def short(identifier: str) -> str:
    """An id's last 8 characters: a new id begins with its millisecond, which every id
    made in the same stretch of the run shares, and ends with its random bits."""
    return identifier[-8:]


def describe(message: Message) -> str:
    """One readable line for a transcript message."""
    if message.role != "assistant":
        return f"#{message.seq} {message.role}: {message.data.get('text', message.data)!r}"
    parts = []
    for part in message.data.parts:
        if isinstance(part, ToolPart):
            settled = part.error if part.status == "error" else part.output
            parts.append(f"[{part.name} -> {part.status}: {settled}]")
        else:
            parts.append(repr(part.text))
    ending = "finished" if message.data.finished else "open"
    if message.data.error is not None:
        ending += f", error={message.data.error!r}"
    return f"#{message.seq} assistant ({ending}): " + " ".join(parts)
