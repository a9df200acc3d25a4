"""Immutable values that cross the public API and the store boundary.

Every class is a frozen attrs class: values are compared by content and never mutated, so a
record handed to a drain, a joiner or a test cannot change under it.
"""

from __future__ import annotations

import copy
from typing import Any, Literal

import attrs

from ._backend import StoreStatistics

OutcomeKind = Literal["succeeded", "failed", "interrupted", "deferred"]
InterruptReason = Literal["user", "shutdown", "lease_lost"]
Role = Literal["user", "assistant", "system"]
ToolStatus = Literal["running", "completed", "error"]

INTERRUPTED = "interrupted"
OWNER_LOST = "interrupted: owner lost"
BUDGET_EXHAUSTED = "resume budget exhausted"
UNSETTLED_AT_FINISH = "unsettled when the message finished"


@attrs.frozen
class Outcome:
    """The one terminal result of a busy period (or `deferred` when another owner holds it)."""

    kind: OutcomeKind
    reason: InterruptReason | None = None
    error: BaseException | None = None


@attrs.frozen
class Claim:
    """A committed claim, as handed to `acquisition_hook`."""

    session_id: str
    execution_id: str
    owner_id: str
    resumed: bool


@attrs.frozen
class Input:
    """A pending input taken by `DrainContext.take_inputs`."""

    id: str
    payload: dict[str, Any]


@attrs.frozen
class TextPart:
    text: str
    type: Literal["text"] = "text"

    def to_json(self) -> dict[str, Any]:
        """The part as stored (DESIGN §3): `{"type": "text", "text": ...}`."""
        return {"type": self.type, "text": self.text}


@attrs.frozen
class ToolPart:
    call_id: str
    name: str
    input: dict[str, Any]
    status: ToolStatus
    output: Any
    error: str | None
    type: Literal["tool"] = "tool"

    def to_json(self) -> dict[str, Any]:
        """The part as stored (DESIGN §3); `input` and `output` are copies."""
        return {
            "type": self.type,
            "call_id": self.call_id,
            "name": self.name,
            "input": copy.deepcopy(self.input),
            "status": self.status,
            "output": copy.deepcopy(self.output),
            "error": self.error,
        }


Part = TextPart | ToolPart

# The one stream event (DESIGN §5.2) a write of an assistant message makes, when it is one:
# ("part", the tool part added or replaced) or ("finish", {"error": str | None}).
Step = tuple[Literal["part", "finish"], Any]


@attrs.frozen
class AssistantData:
    """The JSON projection stored in an assistant message's `data` column."""

    parts: tuple[Part, ...]
    finished: bool
    error: str | None

    def to_json(self) -> dict[str, Any]:
        """The dict stored in the `data` column (DESIGN §3), ready for `json.dumps`."""
        return {
            "parts": [part.to_json() for part in self.parts],
            "finished": self.finished,
            "error": self.error,
        }


@attrs.frozen
class Message:
    """One transcript row. `data` is `AssistantData` for assistants, the input payload for users."""

    id: str
    session_id: str
    role: Role
    seq: int
    data: Any
    execution_id: str | None
    input_id: str | None

    def to_json(self) -> dict[str, Any]:
        """The message as a JSON-ready dict; `data` is the stored dict (a copy), for an
        assistant message the DESIGN §3 projection."""
        if isinstance(self.data, AssistantData):
            data = self.data.to_json()
        else:
            data = copy.deepcopy(self.data)
        return {
            "id": self.id,
            "session_id": self.session_id,
            "role": self.role,
            "seq": self.seq,
            "data": data,
            "execution_id": self.execution_id,
            "input_id": self.input_id,
        }


@attrs.frozen
class RecoveryReport:
    """What one recovery pass did; every field counts rows."""

    examined: int = 0
    resumed: int = 0
    finished_cancelled: int = 0
    dropped_superseded: int = 0
    quarantined: int = 0
    exhausted: int = 0
    skipped_live: int = 0
    fence_lost: int = 0
    doorbells_started: int = 0
    finished_paused: int = 0  # dead owners' claims of paused sessions, closed as owner-lost


@attrs.frozen
class RuntimeStatistics:
    """A snapshot of what one runtime is doing, for graphs and health checks (trio-style:
    a frozen record, never live counters)."""

    active_sessions: int
    owned_claims: int
    drains_running: int
    tasks: int
    heartbeat_transactions: int
    recovery: RecoveryReport
    # Wakes and interrupts picked up from the store's changes: other processes', and with
    # `max_active` this runtime's own wakes that waited for room.
    remote_signals: int
    store: StoreStatistics
