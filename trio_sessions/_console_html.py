"""The HTML of the operator console's pages (`_console`): the page frame, a session's state in
words, transcript messages, and the updates a stream event makes to a message on the page.

Pure functions of store rows and stream events, no I/O. Invariant: every text that comes from
the store or a request reaches HTML through `escape` (attribute-safe), and every id in a URL
through `quote` (one path segment: an id holding "/" stays one segment, and none is a dot
segment a client would resolve away); the routes read segments back with `unquote`.
"""

from __future__ import annotations

import html
import json
import re
import urllib.parse
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from ._model import Message
from ._stream import StreamEvent, decode_cursor


def state(session: Mapping[str, Any]) -> str:
    """A session's state in words, from its `_store.session_status` row."""
    paused = "paused, " if session["paused"] else ""
    malformed = "; ".join(session["malformed"])
    return paused + _claim_state(session) + (f" (malformed row: {malformed})" if malformed else "")


def _claim_state(session: Mapping[str, Any]) -> str:
    claim = session["claim"]
    if claim is not None:
        if claim["quarantined"]:
            return "quarantined"
        if claim["expired"]:
            return "claim expired (awaiting recovery)"
        if claim["phase"] == "cancelling":
            return f"stopping ({claim['owner_id']})"
        return f"running ({claim['owner_id']})"
    if session["doorbell"] is not None:
        return "waiting"
    return "idle"


def message_html(message: Message) -> str:
    """One transcript message as HTML."""
    return _data_html(message.seq, message.role, message.to_json()["data"])


def _data_html(seq: int, role: str, data: Any) -> str:
    """One message as HTML, from its JSON data (as `transcript()` and streams show it)."""
    if role == "assistant":
        parts = []
        for part in data["parts"]:
            if part["type"] == "text":
                parts.append(f'<span class="text">{escape(readable_text(part["text"]))}</span>')
            else:
                error = f": {escape(readable_text(part['error']))}" if part["error"] else ""
                name, status = escape(readable_text(part["name"])), escape(part["status"])
                parts.append(f'<span class="tool">[{name} {status}{error}]</span>')
        status = "" if data["finished"] else ' <i class="open">…</i>'
        if data["error"]:
            status = f' <i class="error">({escape(readable_text(data["error"]))})</i>'
        content = "".join(parts) + status
    else:
        content = escape(readable_json(json.dumps(data)))  # a lone surrogate stays escaped
    role, at = escape(role), escape(str(seq))
    return f'<div class="message {role}" data-seq="{at}"><b>{role}</b> {content}</div>'


def apply_event(copies: dict[int, tuple[str, Any]], event: StreamEvent) -> list[dict[str, Any]]:
    """Apply one stream event (DESIGN §5.2) to the console's copies of the messages; the
    updates for the page: the text an append adds to the message's last text part (its
    size is the append's, not the message's), a message's new HTML, or the seqs to drop."""
    seq, kind, value = event.seq, event.kind, event.to_json()["data"]  # a copy, as JSON
    if kind == "truncate":
        for held in [held for held in copies if held > seq]:
            del copies[held]
        return [{"drop_after": seq}]
    if kind == "message":
        copies[seq] = (event.role, value)
    else:
        data = copies[seq][1]
        parts = data["parts"]
        if kind == "append":
            if parts and parts[-1]["type"] == "text":
                parts[-1]["text"] += value
                # Shown as the full render shows it (each control is one character: the
                # appends' escapes add up to the whole text's).
                return [{"seq": seq, "append": readable_text(value)}]
            parts.append({"type": "text", "text": value})
        elif kind == "part":
            same = [i for i, part in enumerate(parts) if part.get("call_id") == value["call_id"]]
            if same:
                parts[same[0]] = value
            else:
                parts.append(value)
        elif kind == "finish":
            data["finished"], data["error"] = True, value["error"]
    role, data = copies[seq]
    return [{"seq": seq, "html": _data_html(seq, role, data)}]


@attrs.define
class PageFeed:
    """One page's event stream, as the console sends it: the stream's events (opened at
    the position the page shows) turned into the page's updates, as SSE text with an
    `id:` line - the event's cursor - after each event's last update, so a reconnecting
    EventSource resumes after what the page applied (Last-Event-ID). A change to a message
    before the page's first one (`shown_from`) is no update: the page does not show it.

    A rewritten transcript reaches a stream as "truncate" (drop everything), then every
    message again from the first: the page would drop and rebuild all it shows. So after
    a "truncate", the messages sent again that the page shows as they are (the same
    message id at the same seq - `known`, the tags of the final messages the page shows,
    those it rendered and those it was sent since - or a message before the page's first
    one, which the page does not show) are held back, and the page is told to drop only
    what follows the last of them: one "drop_after" at the first message that differs,
    or once the stream has sent all it read (`feed(..., settled=True)`). Should that drop
    every message the page shows while earlier ones were sent again, the page reloads
    instead (its tail moved before it); with none sent again, the page shows from the seq
    after the drop on (`shown_from` lowered), so the messages stored next are shown.
    """

    session_id: str
    shown_from: int  # the seq of the first message the page shows
    known: dict[int, str]  # seq -> tag of the message id, for the final messages shown
    copies: dict[int, tuple[str, Any]]  # `apply_event`'s: the open messages shown
    open_tags: dict[int, str] = attrs.field(factory=dict)  # seq -> tag, open ones shown
    confirmed: int | None = None  # after a "truncate": the page is right up to this seq
    below: bool = False  # after a "truncate": messages before the page's first were sent
    held_back: str = ""  # the cursor of the last event held back
    # After a "truncate": the seqs of `known` past it in order (sorted once per rewrite),
    # and the index of the next one a message sent again must match to be held back.
    expected: list[int] = attrs.field(factory=list, init=False)
    next_expected: int = attrs.field(default=0, init=False)

    @property
    def pending(self) -> bool:
        """Whether a drop is held back until the stream has sent all it read."""
        return self.confirmed is not None

    def feed(self, events: Sequence[StreamEvent], *, settled: bool) -> str:
        """The SSE text for `events`; `settled`: the stream has nothing more to send now
        (a check held back since a "truncate" ends there)."""
        blocks: list[str] = []
        for event in events:
            blocks += self._event(event)
        if self.confirmed is not None and settled:
            blocks += self._end_check()
        return "".join(blocks)

    def _event(self, event: StreamEvent) -> list[str]:
        if event.kind == "truncate":
            apply_event(self.copies, event)
            for seq in [seq for seq in self.open_tags if seq > event.seq]:
                del self.open_tags[seq]
            self.confirmed, self.below, self.held_back = event.seq, False, event.cursor
            self.expected = sorted(seq for seq in self.known if seq > event.seq)
            self.next_expected = 0
            return []
        if event.seq < self.shown_from:
            # Not on the page: a message sent again after a rewrite, or a change to an open
            # message before the page that the stream follows since (the page holds no
            # copy of it: a change would be a reload).
            if self.confirmed is not None:
                self.below, self.held_back = True, event.cursor
                if event.kind == "message":
                    self.confirmed = event.seq
            return []
        blocks: list[str] = []
        if self.confirmed is not None:
            if self._as_shown(event):
                self.confirmed, self.held_back = event.seq, event.cursor
                self.next_expected += 1
                return []
            blocks = self._end_check()
        if event.kind != "message" and event.seq not in self.copies:
            # Never expected (the page's open messages are copied when the stream opens):
            # the page cannot apply a change to a message the console holds no copy of.
            return [*blocks, *sse_blocks([{"reload": True}], event.cursor)]
        blocks += sse_blocks(apply_event(self.copies, event), event.cursor)
        self._record(event)
        return blocks

    def _as_shown(self, event: StreamEvent) -> bool:
        """Whether a message sent again after a "truncate" is the next one the page shows,
        unchanged (a pure check: the caller moves on)."""
        if event.kind != "message" or self.next_expected == len(self.expected):
            return False
        if self.expected[self.next_expected] != event.seq:
            return False  # a message the page does not show, or one it shows is gone
        position = decode_cursor(self.session_id, event.cursor)
        held = any(item.seq == event.seq for item in position.open)
        return position.top == event.seq and not held and position.top_tag == self.known[event.seq]

    def _record(self, event: StreamEvent) -> None:
        """Keep `known` what the page shows after an update it was sent: a message that
        is final now (a finished "message", a "finish") is known by its tag - a rewrite
        that keeps it holds it back, as one the page rendered - and an open one is not
        (its tag is kept for when it finishes)."""
        if event.kind == "finish":
            tag = self.open_tags.pop(event.seq, None)
        elif event.kind == "message":
            position = decode_cursor(self.session_id, event.cursor)
            still_open = [held.tag for held in position.open if held.seq == event.seq]
            if still_open:
                self.open_tags[event.seq] = still_open[0]
                self.known.pop(event.seq, None)
                return
            # Final: the newest message (the cursor names it top), or an open one replaced
            # whole now that it finished (its tag from when it was open).
            tag = self.open_tags.pop(event.seq, None)
            if position.top == event.seq:
                tag = position.top_tag
        else:
            return
        self.copies.pop(event.seq, None)  # final: no change follows
        if tag is not None:
            self.known[event.seq] = tag

    def _end_check(self) -> list[str]:
        confirmed, self.confirmed = self.confirmed or 0, None
        self.expected, self.next_expected = [], 0
        # What the page shows after the seq confirmed is not as stored: forget it.
        self.known = {seq: tag for seq, tag in self.known.items() if seq <= confirmed}
        if confirmed < self.shown_from:
            if self.below:
                return sse_blocks([{"reload": True}], self.held_back)
            # The page shows nothing now, and no message before it was sent again: it
            # shows from the seq after the drop on, so the messages stored next (below its
            # old first one) are updates, not ignored.
            self.shown_from = confirmed + 1
        return sse_blocks([{"drop_after": confirmed}], self.held_back)


def sse_blocks(updates: Sequence[Mapping[str, Any]], cursor: str) -> list[str]:
    """One SSE event per update, the last one with the `id:` a reconnect resumes from."""
    blocks = [f"data: {json.dumps(update)}\n\n" for update in updates]
    if blocks:
        blocks[-1] = f"id: {cursor}\n{blocks[-1]}"
    return blocks


SESSION_SCRIPT = """
const box = document.getElementById("transcript");
const source = box.dataset.events ? new EventSource(box.dataset.events) : null;
if (source) source.onmessage = (event) => {
  const update = JSON.parse(event.data);
  if ("reload" in update) { source.close(); location.reload(); return; }
  if ("drop_after" in update) {
    for (const node of box.querySelectorAll("[data-seq]")) {
      if (Number(node.dataset.seq) > update.drop_after) { node.remove(); }
    }
    return;
  }
  if ("append" in update) {
    const last = box.querySelector(`[data-seq="${update.seq}"] > span:last-of-type`);
    if (last && last.classList.contains("text")) { last.textContent += update.append; }
    else { location.reload(); }  // never expected: the page and the stream disagree
    return;
  }
  const holder = document.createElement("div");
  holder.innerHTML = update.html;
  const fresh = holder.firstElementChild;
  const old = box.querySelector(`[data-seq="${update.seq}"]`);
  if (old) { old.replaceWith(fresh); } else { box.appendChild(fresh); }
};
"""

# On every page: an action's form posts once. A second click landing before the answer (a
# double click, a slow store) posted again and acted on what the first had changed: a 409
# or 404 contradicting it ("nothing was interrupted", "no session"). A document listener
# runs after the form's own onsubmit, so a confirm() dismissed (the submit prevented)
# leaves the button as it was. Without JavaScript the forms are plain forms, as before.
FORMS_SCRIPT = """
document.addEventListener("submit", (event) => {
  const form = event.target;
  if (!form.classList.contains("action")) return;
  if (form.dataset.sent) { event.preventDefault(); return; }
  if (event.defaultPrevented) return;
  form.dataset.sent = "yes";
  for (const button of form.querySelectorAll("button")) button.disabled = true;
});
// The page shown again by Back (from the back/forward cache): its forms post again.
addEventListener("pageshow", (event) => {
  if (!event.persisted) return;
  for (const form of document.querySelectorAll("form.action[data-sent]")) {
    delete form.dataset.sent;
    for (const button of form.querySelectorAll("button")) button.disabled = false;
  }
});
"""

STYLE = """
body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}
table{border-collapse:collapse}td,th{border-bottom:1px solid #ddd;padding:.3em .6em;text-align:left}
.figures{color:#555}.action{display:inline;margin-right:.3em}
.message{margin:.4em 0}.tool{color:#666}.error{color:#a00}.readonly{color:#a60}
"""


def html_page(title: str, body: str, *, store: str = "", read_only: bool = False) -> bytes:
    """A whole page around `body` (already HTML); `title` and `store` are escaped here."""
    badge = ' <span class="readonly">read-only</span>' if read_only else ""
    where = f"<p>store {escape(store)}{badge}</p>" if store else ""
    return (
        f'<!doctype html><html><head><meta charset="utf-8"><title>{escape(title)}</title>'
        f"<style>{STYLE}</style></head><body><h1>{escape(title)}</h1>{where}{body}"
        f"<script>{FORMS_SCRIPT}</script></body></html>"
    ).encode()


def readable_json(text: str) -> str:
    """A stored JSON text (perhaps cut short: a pending input's first 200 characters) with
    its `\\uXXXX` escapes of characters that print written as those characters: the store
    writes JSON ASCII-only, and an operator reads "héllo", not "h\\u00e9llo". A control
    character, a quote or a backslash, a bidi or line-separating control, a lone surrogate
    and an escape cut short stay escaped: the text still reads as the same JSON. Those
    controls stored raw (another tool's row, not ASCII-only) are escaped too."""
    return _RAW_KEPT.sub(_escaped, _UNICODE_ESCAPE.sub(_unescaped, text))


# A `\uXXXX` escape (a surrogate pair as one) after an even run of backslashes: after an
# odd one, its backslash is an escaped backslash's and "uXXXX" is text.
_UNICODE_ESCAPE = re.compile(
    r"(?<!\\)((?:\\\\)*)\\u([dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}"
    r"|[0-9a-fA-F]{4})"
)


def _unescaped(match: re.Match[str]) -> str:
    code = match.group(2)
    if len(code) > 4:  # a surrogate pair: one character past the BMP
        high, low = int(code[:4], 16), int(code[6:], 16)
        return match.group(1) + chr(0x10000 + ((high - 0xD800) << 10) + (low - 0xDC00))
    point = int(code, 16)
    if (
        point < 0x20
        or 0x7F <= point < 0xA0
        or 0xD800 <= point < 0xE000
        or chr(point) in _KEPT_ESCAPED
    ):
        return match.group(0)
    return match.group(1) + chr(point)


# Kept as escapes: a quote and a backslash (the JSON reads so), and what would reorder or
# split the text the operator reads - the bidi marks, embeddings, overrides and isolates
# ("\u202e" showed a payload reversed) and the line and paragraph separators.
_KEPT_ESCAPED = frozenset(
    '"\\\u061c\u200e\u200f\u2028\u2029\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069'
)


# The controls of `_KEPT_ESCAPED` (all but the quote and backslash), as stored raw.
_RAW_KEPT = re.compile("[" + "".join(sorted(_KEPT_ESCAPED - frozenset('"\\'))) + "]")
# What `readable_text` escapes in a plain text: those controls, and the backslash.
_TEXT_KEPT = re.compile("[" + re.escape("".join(sorted(_KEPT_ESCAPED - frozenset('"')))) + "]")


def readable_text(text: str) -> str:
    """A model's text as the operator reads it: the controls `readable_json` keeps escaped
    (bidi overrides, embeddings, isolates, marks; line and paragraph separators) written as
    `\\uXXXX`, so an answer holding "\\u202e" does not show reversed - and a backslash as
    `\\\\`, so the six characters `\\u202e` typed in an answer never read as that escape.
    Character by character: a streamed append's escapes add up to the whole text's."""
    return _TEXT_KEPT.sub(_escaped, text)


def _escaped(match: re.Match[str]) -> str:
    if match.group() == "\\":
        return "\\\\"
    return f"\\u{ord(match.group()):04x}"


def escape(text: str) -> str:
    """`text` safe in HTML, quotes included (attribute values)."""
    return html.escape(text, quote=True)


def quote(text: str) -> str:
    """`text` as one URL path segment ("/" encoded too) that is never a dot segment: every
    client resolves "." and ".." (RFC 3986 §5.2.4; browsers "%2E" too) away before the
    request is sent. The mark is a leading "~": "." and ".." are written "~." and "~..",
    and a text that starts with "~" has its "~" doubled ("~x" is "~~x"), so a segment
    starting with one "~" is only ever "~." or "~.." (`unquote` refuses any other)."""
    quoted = urllib.parse.quote(text, safe="")
    return "~" + quoted if text in (".", "..") or text.startswith("~") else quoted


def unquote(segment: str) -> str:
    """The text `quote` made a path segment of. `ValueError` for a segment `quote` never
    makes (one "~" before anything but "." or "..": it would name another text than it
    spells), `UnicodeDecodeError` for one whose bytes are not UTF-8 (never a replacement
    character's text)."""
    text = urllib.parse.unquote(segment, errors="strict")
    if not text.startswith("~"):
        return text
    if text.startswith("~~") or text in ("~.", "~.."):
        return text[1:]
    raise ValueError(
        f"{segment!r} is no console URL's segment: an id starting with '~' is written with"
        " its '~' doubled"
    )
