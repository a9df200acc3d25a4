"""Immutable values that cross the public API and the store boundary.

Every class is a frozen attrs class: values are compared by content and never mutated, so a
record handed to a drain, a joiner or a test cannot change under it.
"""

from __future__ import annotations

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


@attrs.frozen
class ToolPart:
    call_id: str
    name: str
    input: dict[str, Any]
    status: ToolStatus
    output: Any
    error: str | None
    type: Literal["tool"] = "tool"


Part = TextPart | ToolPart


@attrs.frozen
class AssistantData:
    """The JSON projection stored in an assistant message's `data` column."""

    parts: tuple[Part, ...]
    finished: bool
    error: str | None


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
    remote_signals: int
    store: StoreStatistics
