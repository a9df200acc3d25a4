"""The assistant message state machine: pure transitions of `AssistantData`.

Invariants: a tool call settles at most once (`running` -> `completed` | `error`, never
again); a finished message accepts no further change; interrupting or orphaning a message
fails exactly its unsettled tools and finishes it. No I/O: the store applies these inside
its fenced transactions, so the durable row is the state that is checked. Text streamed
onto a message is stored apart and merged by `with_streamed`, which makes of it exactly
what `append_text` would have.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from ._errors import DuplicateSettlement, UnknownToolCall
from ._errors import MessageFinished as MessageFinished  # public in trio_sessions since 0.1
from ._model import (
    OWNER_LOST,
    UNSETTLED_AT_FINISH,
    AssistantData,
    Message,
    Part,
    Step,
    TextPart,
    ToolPart,
)

EMPTY = AssistantData(parts=(), finished=False, error=None)


def _require_open(data: AssistantData) -> None:
    if data.finished:
        raise MessageFinished("the assistant message is already finished")


def append_text(data: AssistantData, text: str) -> AssistantData:
    """Append text, extending the last part when it is text (streamed tokens stay one part)."""
    _require_open(data)
    return _extend_text(data, text)


def with_streamed(data: AssistantData, texts: Sequence[str]) -> AssistantData:
    """The message as readers see it: stored `data` with the texts streamed onto it since
    (in order), exactly what `append_text` of each would have made of it."""
    return _extend_text(data, "".join(texts)) if texts else data


def text_of(data: AssistantData) -> str:
    """The message's text parts, joined: what appends change and nothing else does."""
    return "".join(part.text for part in data.parts if isinstance(part, TextPart))


def _extend_text(data: AssistantData, text: str) -> AssistantData:
    parts = data.parts
    if parts and isinstance(parts[-1], TextPart):
        return attrs.evolve(data, parts=(*parts[:-1], TextPart(parts[-1].text + text)))
    return attrs.evolve(data, parts=(*parts, TextPart(text)))


def start_tool(
    data: AssistantData, call_id: str, name: str, input: dict[str, Any]
) -> AssistantData:
    _require_open(data)
    if _find_tool(data, call_id) is not None:
        raise ValueError(f"tool call {call_id!r} was already started in this message")
    part = ToolPart(call_id, name, input, "running", None, None)
    return attrs.evolve(data, parts=(*data.parts, part))


def settle_tool(
    data: AssistantData, call_id: str, *, output: Any = None, error: str | None = None
) -> AssistantData:
    """Settle a running call: `completed` with `output`, or `error` when `error` is given."""
    _require_open(data)
    index = _find_tool(data, call_id)
    if index is None:
        raise UnknownToolCall(f"tool call {call_id!r} was never started in this message")
    part = data.parts[index]
    assert isinstance(part, ToolPart)
    if part.status != "running":
        raise DuplicateSettlement(f"tool call {call_id!r} is already settled ({part.status})")
    if error is None:
        settled = attrs.evolve(part, status="completed", output=output, error=None)
    else:
        settled = attrs.evolve(part, status="error", output=None, error=error)
    return attrs.evolve(data, parts=_replace(data.parts, index, settled))


def finish(data: AssistantData) -> AssistantData:
    """Finish normally; a tool still running is failed rather than left running forever."""
    _require_open(data)
    return _close(data, tool_error=UNSETTLED_AT_FINISH, message_error=None)


def interrupt(data: AssistantData, reason: str) -> AssistantData:
    """Finish interrupted or orphaned work: running tools fail with `reason`, and so does the
    message. An already finished message is left exactly as it is."""
    if data.finished:
        return data
    return _close(data, tool_error=reason, message_error=reason)


def step(before: AssistantData, after: AssistantData) -> Step | None:
    """The one stream event that turns a client's copy of `before` into `after` (DESIGN
    §5.2): a tool part added after the others or replacing the one with its call id
    ("part"), or the finish alone ("finish"); None when it takes more (an interrupt that
    fails running tools as it finishes): the client gets the whole message."""
    old, new = before.parts, after.parts
    if before.finished:
        return None
    if after.finished:
        return ("finish", {"error": after.error}) if new == old else None
    if after.error != before.error:
        return None
    if len(new) == len(old) + 1 and new[:-1] == old:
        part = new[-1]
        if isinstance(part, ToolPart) and _find_tool(before, part.call_id) is None:
            return "part", part
        return None
    changed = [i for i, (was, now) in enumerate(zip(old, new, strict=False)) if was != now]
    if len(new) != len(old) or len(changed) != 1:
        return None
    was, part = old[changed[0]], new[changed[0]]
    if isinstance(was, ToolPart) and isinstance(part, ToolPart) and was.call_id == part.call_id:
        return "part", part
    return None


def unsettled_calls(data: AssistantData) -> list[str]:
    return [p.call_id for p in data.parts if isinstance(p, ToolPart) and p.status == "running"]


def _close(data: AssistantData, *, tool_error: str, message_error: str | None) -> AssistantData:
    parts = tuple(
        attrs.evolve(p, status="error", error=tool_error)
        if isinstance(p, ToolPart) and p.status == "running"
        else p
        for p in data.parts
    )
    return AssistantData(parts=parts, finished=True, error=message_error)


def tool_part(data: AssistantData, call_id: str) -> ToolPart | None:
    """The message's tool part for `call_id`, if it has one."""
    index = _find_tool(data, call_id)
    part = None if index is None else data.parts[index]
    return part if isinstance(part, ToolPart) else None


def _find_tool(data: AssistantData, call_id: str) -> int | None:
    for index, part in enumerate(data.parts):
        if isinstance(part, ToolPart) and part.call_id == call_id:
            return index
    return None


def _replace(parts: tuple[Part, ...], index: int, part: Part) -> tuple[Part, ...]:
    return (*parts[:index], part, *parts[index + 1 :])


def unanswered(messages: Sequence[Message]) -> list[Message]:
    """The user messages a drain still owes an answer, from a session's transcript: those
    after the last assistant message, looking past answers a dead owner left unfinished
    (recovery closed them as "interrupted: owner lost", after a crash or a graceful
    shutdown alike). An answer cut short by a user interrupt or a failed drain counts as
    given.

    Pass it `await ctx.transcript()`: a resumed drain's inputs were taken by the owner that
    died, so they are found here and never in `take_inputs()`.
    """
    owed: list[Message] = []
    for message in reversed(messages):
        if message.role == "assistant" and not (
            isinstance(message.data, AssistantData) and message.data.error == OWNER_LOST
        ):
            break
        if message.role == "user":
            owed.append(message)
    return owed[::-1]
