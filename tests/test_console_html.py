"""The console's page updates from stream events (`_console_html.apply_event`): pure, so
tried directly - the browser test drives the same updates on a live page."""

from __future__ import annotations

import json
from typing import Any

from trio_sessions import StreamEvent
from trio_sessions._console_html import _data_html, apply_event
from trio_sessions._model import AssistantData, TextPart
from trio_sessions._stream import EventKind


def event(kind: EventKind, data: Any, seq: int = 2) -> StreamEvent:
    return StreamEvent("cursor", seq, "assistant", kind, data)


def test_an_append_to_a_long_message_sends_only_its_text() -> None:
    """Each append to the message's last text part is an update of the appended text alone
    (it was the whole message's HTML: a live answer cost the square of its length); an
    append after a tool part, which starts a new text part, sends the message's HTML."""
    copies: dict[int, tuple[str, Any]] = {}
    long_text = AssistantData(parts=(TextPart("x" * 10_000),), finished=False, error=None)
    [whole] = apply_event(copies, event("message", long_text))
    assert len(whole["html"]) > 10_000
    sizes = []
    for word in ["<b>one</b> ", "two ", "three"]:
        [update] = apply_event(copies, event("append", word))
        assert update == {"seq": 2, "append": word}
        sizes.append(len(json.dumps(update)))
    assert max(sizes) < 100
    assert copies[2][1]["parts"][-1]["text"] == "x" * 10_000 + "<b>one</b> two three"
    tool: dict[str, Any] = {
        "type": "tool",
        "call_id": "c1",
        "name": "look",
        "input": {},
        "status": "running",
        "output": None,
        "error": None,
    }
    apply_event(copies, event("part", tool))
    [after_tool] = apply_event(copies, event("append", "again"))
    assert "html" in after_tool and "again" in after_tool["html"]


def test_every_value_from_a_row_is_escaped_in_a_message() -> None:
    """A message's role and seq reach the page escaped, as its text does (the store refuses
    an unknown role, `test_signals`; this is the page's own guarantee)."""
    html = _data_html("<s>", "<img src=x onerror=alert(1)>", {"x": 1})  # type: ignore[arg-type]
    assert "<img" not in html
    assert "<s>" not in html
    assert "&lt;img src=x onerror=alert(1)&gt;" in html
