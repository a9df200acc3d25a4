"""The console's page updates from stream events (`_console_html.apply_event`, `PageFeed`):
pure, so tried directly - the browser test drives the same updates on a live page."""

from __future__ import annotations

import json
from typing import Any

import pytest

from trio_sessions import StreamEvent
from trio_sessions._console_html import (
    PageFeed,
    _data_html,
    apply_event,
    quote,
    readable_json,
    unquote,
)
from trio_sessions._model import AssistantData, TextPart
from trio_sessions._store.stream import Held, Position, message_tag
from trio_sessions._stream import EventKind, encode_cursor, session_tag


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


def resent(seq: int, message_id: str) -> StreamEvent:
    """A user message a stream sends whole after a "truncate" (its cursor names it top)."""
    cursor = encode_cursor(session_tag("s"), Position(seq, message_tag(message_id)))
    return StreamEvent(cursor, seq, "user", "message", {"text": message_id})


def updates(text: str) -> list[Any]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]


def feed_of(shown: range) -> PageFeed:
    return PageFeed("s", shown.start, {seq: message_tag(f"m{seq}") for seq in shown}, {})


def test_a_rewrite_drops_only_what_the_page_shows_that_changed() -> None:
    """After a "truncate", the messages sent again that the page shows as they are (same id
    at the same seq) are held back: one drop after the last of them, then the message
    that differs - or, once the stream has sent all it read, just the drop."""
    truncate = StreamEvent(encode_cursor(session_tag("s"), Position()), 0, "", "truncate", None)
    feed = feed_of(range(1, 10))
    kept = [resent(seq, f"m{seq}") for seq in range(1, 5)]
    text = feed.feed([truncate, *kept, resent(5, "new")], settled=True)
    assert [update.get("drop_after", update.get("seq")) for update in updates(text)] == [4, 5]
    assert f"id: {kept[-1].cursor}\ndata: " in text  # a reconnect resumes after message 4
    feed = feed_of(range(1, 10))
    assert updates(feed.feed([truncate, *kept], settled=False)) == []
    assert updates(feed.feed([], settled=True)) == [{"drop_after": 4}]


def test_a_rewrite_before_the_page_reloads_it() -> None:
    """A rewrite that cuts before the first message the page shows, while earlier ones
    remain, reloads the page (its tail moved); one that leaves none is a drop of all."""
    truncate = StreamEvent(encode_cursor(session_tag("s"), Position()), 0, "", "truncate", None)
    feed = feed_of(range(10, 20))
    assert updates(feed.feed([truncate, resent(3, "m3")], settled=True)) == [{"reload": True}]
    feed = feed_of(range(10, 20))
    assert updates(feed.feed([truncate], settled=True)) == [{"drop_after": 0}]


def test_an_open_message_before_the_page_is_not_followed_after_a_rewrite() -> None:
    """A page shows seqs 10 to 19; an open assistant message at seq 3 is before it. After a
    rewrite the stream sends every message again and follows the open ones - seq 3 too.
    PageFeed holds seq 3's "message" back (not shown) without keeping a copy, so its next
    append is a change to a message it holds no copy of: a reload of the page (a "message"
    event for it would put message 3 at the bottom of the page), where the page should
    ignore a message it does not show."""
    held = Held(3, message_tag("open3"), 1)

    def cursor(top: int, top_id: str) -> str:
        return encode_cursor(session_tag("s"), Position(top, message_tag(top_id), (held,)))

    truncate = StreamEvent(encode_cursor(session_tag("s"), Position()), 0, "", "truncate", None)
    parts = {"parts": [{"type": "text", "text": "he"}], "finished": False, "error": None}
    open3 = StreamEvent(cursor(3, "open3"), 3, "assistant", "message", parts)
    resent = [
        StreamEvent(cursor(seq, f"m{seq}"), seq, "user", "message", {"text": "x"})
        for seq in range(10, 20)
    ]
    feed = PageFeed("s", 10, {seq: message_tag(f"m{seq}") for seq in range(10, 20)}, {})
    assert "drop_after" in feed.feed([truncate, open3, *resent], settled=True)
    held2 = Held(3, message_tag("open3"), 2)
    append = StreamEvent(
        encode_cursor(session_tag("s"), Position(19, message_tag("m19"), (held2,))),
        3,
        "assistant",
        "append",
        "llo",
    )
    text = feed.feed([append], settled=True)
    assert text == "", f"an append to a message the page does not show sent {text!r}"


def test_a_message_that_finishes_live_is_held_back_by_a_rewrite_that_keeps_it() -> None:
    """An open message the page follows is known once it finishes (its tag kept from its
    cursor while open): a rewrite that keeps it sends it no more, only the drop after it."""
    open_20 = Held(20, message_tag("a20"), 0)
    feed = PageFeed("s", 10, {seq: message_tag(f"m{seq}") for seq in range(10, 20)}, {})
    parts = {"parts": [], "finished": False, "error": None}
    begun = StreamEvent(
        encode_cursor(session_tag("s"), Position(20, message_tag("a20"), (open_20,))),
        20,
        "assistant",
        "message",
        parts,
    )
    finished_at = Position(20, message_tag("a20"))
    finish = StreamEvent(
        encode_cursor(session_tag("s"), finished_at), 20, "assistant", "finish", {"error": None}
    )
    assert [u["seq"] for u in updates(feed.feed([begun, finish], settled=True))] == [20, 20]
    assert feed.known[20] == message_tag("a20") and 20 not in feed.copies
    truncate = StreamEvent(encode_cursor(session_tag("s"), Position()), 0, "", "truncate", None)
    kept = [resent(seq, f"m{seq}") for seq in range(10, 20)]
    again = StreamEvent(
        encode_cursor(session_tag("s"), finished_at),
        20,
        "assistant",
        "message",
        {"parts": [], "finished": True, "error": None},
    )
    text = feed.feed([truncate, *kept, again], settled=True)
    assert updates(text) == [{"drop_after": 20}]


def test_messages_after_a_rewrite_that_emptied_the_page_are_shown() -> None:
    """A page shows seqs 10 to 19 (1 to 9 on its earlier page). The transcript is emptied
    (`delete_session`, or `truncate(after_seq=0)`): the page is told to drop everything
    (`drop_after` 0, no earlier message remains, so no reload) and shows nothing. The
    conversation goes on: new messages 1, 2, ... - all below the page's first seq
    (`shown_from` stays 10), which `PageFeed` now ignores as "not on the page". The page
    stays empty while the transcript grows, until seq 10, then shows 10 on without 1 to
    9: a gap. (Before 51dc1d7 such a message was added to the page.) Expected: a new
    message after the page was emptied is an update (or a reload), never nothing."""
    feed = PageFeed("s", 10, {seq: message_tag(f"m{seq}") for seq in range(10, 20)}, {})
    truncate = StreamEvent(encode_cursor(session_tag("s"), Position()), 0, "", "truncate", None)
    assert '"drop_after": 0' in feed.feed([truncate], settled=True)
    new = StreamEvent(
        encode_cursor(session_tag("s"), Position(1, message_tag("new1"))),
        1,
        "user",
        "message",
        {"text": "a new conversation"},
    )
    text = feed.feed([new], settled=True)
    assert "a new conversation" in text or '"reload": true' in text, (
        f"a message stored after the page was emptied sent {text!r}"
    )


@pytest.mark.parametrize("text", ["~", "~~", "~.", "~..", "~foo", ".", "..", "a/b", "é"])
def test_a_quoted_id_is_one_segment_that_unquotes_to_itself(text: str) -> None:
    """`quote` makes one path segment that is no dot segment and starts with one "~" only
    for "." and ".." (an id's own leading "~" is doubled); `unquote` reverses it."""
    segment = quote(text)
    assert "/" not in segment and segment not in (".", "..")
    assert unquote(segment) == text
    if segment.startswith("~") and not segment.startswith("~~"):
        assert text in (".", "..")


@pytest.mark.parametrize("segment", ["~foo", "~", "~%2E%2E%2E", "~a.", "%7Ex"])
def test_a_segment_quote_never_makes_is_refused(segment: str) -> None:
    """One "~" before anything but "." or "..": no id (it named another text than it
    spells: earlier consoles linked session "~foo" as "~foo")."""
    with pytest.raises(ValueError, match="doubled"):
        unquote(segment)


def test_a_user_message_in_any_script_reads_as_its_text() -> None:
    """A user message's JSON reaches the page with its text as written, not as `\\uXXXX`
    escapes (`json.dumps`'s default: an operator read "h\\u00e9llo \\u65e5\\u672c" for
    "héllo 日本" - every message in a script but Latin's unreadable); HTML in it is still
    escaped."""
    html = _data_html(1, "user", {"text": "héllo 日本 😀 <b>"})
    assert "héllo 日本 😀 &lt;b&gt;" in html
    assert "\\u" not in html


@pytest.mark.parametrize(
    ("stored", "shown"),
    [
        ('{"text":"h\\u00e9llo \\u65e5\\u672c \\ud83d\\ude00"}', '{"text":"héllo 日本 😀"}'),
        # Cut at 200 characters by the store, mid-text: what is there still reads.
        ('{"text":"f\\u00fcr \\u65e5', '{"text":"für 日'),
        # An escaped backslash before "u00e9" is text, not an escape; a control character,
        # a quote, a lone surrogate, a cut escape stay escaped (the JSON still reads so).
        ('{"a":"\\\\u00e9 \\u0007 \\u0022 \\ud83d x \\u00',) * 2,
        # Controls that reorder or split what the operator reads stay escaped: bidi
        # overrides, embeddings and isolates, the marks, the line and paragraph separators
        # (a payload holding "\u202e" showed its text reversed). Other format characters
        # (a zero-width joiner inside an emoji) are written.
        (
            '{"t":"a\\u202eb \\u2066c\\u2069 \\u200f \\u2028 \\u2029 '
            '\\ud83d\\udc69\\u200d\\ud83d\\udcbb"}',
            '{"t":"a\\u202eb \\u2066c\\u2069 \\u200f \\u2028 \\u2029 \U0001f469\u200d\U0001f4bb"}',
        ),
        # Another tool's row may hold them raw (valid JSON, not ASCII-only): escaped too,
        # so such a payload cannot show reversed or split either. Found by review (revE53).
        ('{"t":"a\u202eb\u2028c \u00e9"}', '{"t":"a\\u202eb\\u2028c \u00e9"}'),
    ],
)
def test_a_stored_payload_reads_as_its_text(stored: str, shown: str) -> None:
    """A pending input's payload, stored as JSON with `\\uXXXX` escapes (and cut at 200
    characters: it may not parse), is shown with those characters as written."""
    assert readable_json(stored) == shown


def test_an_assistant_message_shows_bidi_controls_escaped_whole_and_appended() -> None:
    """A model's text holding a bidi override (or an isolate, a mark, a line separator) is
    shown with it escaped, as a payload and a user message are: it showed the answer
    reversed to the operator. The whole message and each streamed append alike, and a tool
    part's name and error and the message's error. Found by audit (audB54)."""
    tool: dict[str, Any] = {
        "type": "tool",
        "call_id": "c1",
        "name": "lo\u202eok",
        "input": {},
        "status": "error",
        "output": None,
        "error": "bad\u2067x\u2069",
    }
    data = {"parts": [{"type": "text", "text": "a\u202eb\u2028c"}, tool], "finished": True}
    html = _data_html(2, "assistant", {**data, "error": "e\u200f"})
    assert "a\\u202eb\\u2028c" in html and "lo\\u202eok" in html, html
    assert "bad\\u2067x\\u2069" in html and "e\\u200f" in html, html
    assert not {"\u202e", "\u2028", "\u2067", "\u2069", "\u200f"} & set(html), html
    copies: dict[int, tuple[str, Any]] = {}
    opened = AssistantData(parts=(TextPart("ok "),), finished=False, error=None)
    apply_event(copies, event("message", opened))
    [update] = apply_event(copies, event("append", "\u202edesrever"))
    assert update == {"seq": 2, "append": "\\u202edesrever"}
    # The console's copy keeps the text as stored (a later render escapes it once).
    assert copies[2][1]["parts"][-1]["text"] == "ok \u202edesrever"


def test_an_answer_holding_a_literal_escape_reads_apart_from_the_control_it_spells() -> None:
    """The console writes a bidi control as `\\u202e`; an answer that holds those six
    characters as typed (a model explaining escapes) read exactly the same, so the operator
    could not tell which the answer held. A backslash is escaped too (`\\\\`), in the whole
    render and in each streamed append alike. Found by the audit (audM55)."""
    typed = {"parts": [{"type": "text", "text": "a\\u202eb"}], "finished": True, "error": None}
    control = {"parts": [{"type": "text", "text": "a\u202eb"}], "finished": True, "error": None}
    assert ">a\\\\u202eb</span>" in _data_html(2, "assistant", typed)
    assert ">a\\u202eb</span>" in _data_html(2, "assistant", control)
    copies: dict[int, tuple[str, Any]] = {}
    opened = AssistantData(parts=(TextPart("ok "),), finished=False, error=None)
    apply_event(copies, event("message", opened))
    updates = [apply_event(copies, event("append", text)) for text in ("x\\", "u202e", "\u202e")]
    assert updates == [
        [{"seq": 2, "append": "x\\\\"}],
        [{"seq": 2, "append": "u202e"}],
        [{"seq": 2, "append": "\\u202e"}],
    ]
    # The appends add up to the whole render of the text they built.
    whole = _data_html(2, "assistant", copies[2][1])
    assert ">ok x\\\\u202e\\u202e</span>" in whole, whole
