"""An HTTP chat service: one web process and any number of workers on one store.

Run it (SQLite here; a `postgresql://` URL works the same, across hosts, with `--schema` or
`TRIO_SESSIONS_SCHEMA` naming a schema as for the workers):

    python examples/chat_service.py --store chat.db --bind 127.0.0.1:8000
    PYTHONPATH=examples python -m trio_sessions worker chat_service:drain --store chat.db
    PYTHONPATH=examples python -m trio_sessions worker chat_service:drain --store chat.db

    J='content-type: application/json'               # every POST says its body is JSON
    curl -H "$J" localhost:8000/sessions/s1/messages -d '{"text": "hello there"}'
    curl -N localhost:8000/sessions/s1/events        # resumable events (server-sent events)
    curl localhost:8000/sessions/s1/transcript
    curl -H "$J" localhost:8000/sessions/s1/stop -d '{"input_id": "..."}'
    curl -H "$J" localhost:8000/sessions/s1/edit -d '{"seq": 1, "text": "hello again"}'
    curl -X DELETE localhost:8000/sessions/s1

* The web process (`serve_web`) is an ASGI app on hypercorn's trio worker. It opens a
  *producer* runtime (`drain=None`): posting a message is a durable `submit` (the 202 means
  the message is stored), the transcript and the event stream read the store, and an
  interrupt marks the worker's claim `cancelling` - the worker cancels its drain within
  milliseconds. It never drains, so a web process can restart at any time.
* The conversation controls a chat UI needs: a message sent while an answer streams says
  what to do with it (`"on_busy"`: `queue`, `interrupt` the answer, or `reject` with 409);
  *Stop* withdraws the user's message if no worker picked it up yet and interrupts the
  answer otherwise; *edit* replaces a user message and regenerates from there (one
  `submit(truncate_after=...)`; 409 while an answer runs or a message waits unanswered);
  `DELETE` erases the conversation. Every POST sends `Content-Type: application/json`
  (415 otherwise, an empty body too), so a page of another site cannot drive a
  conversation with a form or a no-cors fetch, which the browser sends without asking.
* `GET /events` is server-sent events from `runtime.stream()`: each event's `id:` is its
  cursor, so a browser's `EventSource` that loses its connection reconnects with
  `Last-Event-ID` and continues with exactly the events it missed (`?cursor=` does the same
  for clients that cannot set the header). Each `data:` is one `StreamEvent` as JSON: apply
  it to your copy of message `seq` (see DESIGN §5.2's table). While the store does not
  answer, a request is a JSON 503 with `Retry-After`, and an event stream sends `retry:`
  and ends (an EventSource gives up for good on a 503, and reconnects after an end).
* Workers run `drain` with the worker command. The drain streams its answer a word at a
  time (a stand-in for an LLM's tokens), so an interrupt or a dead worker can land
  mid-answer. Killed mid-answer, a worker's session is resumed by another worker about a
  second later (its liveness token goes with the process), and stopped by SIGTERM (a
  rolling restart) within milliseconds; the resumed drain finds the question it still owes
  in the transcript and goes on from the words the cut answer streamed (the page shows
  the resumed answer in the cut one's place: no word twice).
* `GET /` is a small chat page (`chat_page.html`, vanilla JavaScript on `EventSource`):
  send, stop, edit and regenerate, delete, and a live answer that survives a dropped
  connection (`/?session=ID` opens a conversation). A session id is one path segment,
  percent-encoded (`/sessions/a%2Fb/...` is session `a/b`); `.` and `..` cannot be one,
  since clients resolve them as a path's dots before sending.
* `GET /health` is a readiness probe: 200 while the store answers, a JSON 503 with
  `Retry-After` while it does not (an error, or no answer within `HEALTH_TIMEOUT`), so a
  load balancer sends no chats to a process that cannot store them; `HEAD /health` (how
  many balancers probe) answers the same without the body. A web process holds
  no liveness token, and its runtime keeps no verdict on the store: a probe has one small
  read made (`StoreProbe`: the probes waiting at once share one, and a probe arriving
  mid-read takes the answer of the read in flight). A read begun is never
  abandoned: while a PostgreSQL server hangs it stays in flight until the engine's 25 s
  reply bound, and a SIGTERM's exit waits for it, as for any store call. `GET /metrics` is the
  runtime's `statistics()` as JSON.

`CHAT_WORD_DELAY` (seconds, default 0.05) sets the pause between streamed words;
`CHAT_KEEP_ALIVE` (seconds, default 15) how long an event stream stays silent before it
sends an SSE comment (`: keep-alive`), so proxies keep it open (`inf`: never).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import hashlib
import json
import logging
import os
import re
import signal
import sys
import urllib.parse
import uuid
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import hypercorn.config
import hypercorn.trio
import trio

import trio_sessions

logger = logging.getLogger("chat_service")

WORD_DELAY = float(os.environ.get("CHAT_WORD_DELAY", "0.05"))
# An idle event stream sends an SSE comment this often: proxies cut a response that is
# silent for a minute or so (nginx: 60 s), and a client gone without closing is only
# noticed by a write.
KEEP_ALIVE = float(os.environ.get("CHAT_KEEP_ALIVE", "15"))
CHAT_PAGE = (Path(__file__).resolve().parent / "chat_page.html").read_bytes()
MAX_BODY = 64 * 1024
MALFORMED = "the conversation holds a record that cannot be read: see the service's log"
STORE_DOWN = "the store did not answer: try again shortly"
RETRY_AFTER = b"5"  # seconds
HEALTH_TIMEOUT = 2.0  # seconds a /health probe waits for the store
# The conversation a /health probe reads: one nobody has (a read of nothing, not of a
# user's transcript, whatever its size).
HEALTH_SESSION = f"health-probe-{uuid.uuid4().hex}"
SSE = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]

# ---------------------------------------------------------------------------------------------
# The drain (run by the workers)


def compose(questions: list[trio_sessions.Message]) -> list[str]:
    """The stand-in for a model: the answer's words, echoing the user's."""
    words = [word for message in questions for word in str(message.data["text"]).split()]
    return ["You", "said:", *words]


# How the takeover closes an answer whose worker stopped (SIGTERM) or died mid-answer.
OWNER_LOST = "interrupted: owner lost"


def streamed(messages: list[trio_sessions.Message], words: list[str]) -> int:
    """How many of the answer's `words` a cut answer already streamed: the newest message,
    if the takeover closed it as owner lost and it holds the first words of this answer
    (a model would be given them to go on from)."""
    cut = messages[-1] if messages else None
    if cut is None or not isinstance(cut.data, trio_sessions.AssistantData):
        return 0
    if cut.data.error != OWNER_LOST:
        return 0
    text = "".join(p.text for p in cut.data.parts if isinstance(p, trio_sessions.TextPart))
    done = text.split()
    return len(done) if done == words[: len(done)] else 0


async def drain(ctx: trio_sessions.DrainContext) -> None:
    """Answer the session's unanswered user messages, streaming one word at a time."""
    await ctx.take_inputs()  # pending inputs become user messages, atomically
    messages = await ctx.transcript()
    questions = trio_sessions.unanswered(messages)
    if not questions:
        return  # a wake with nothing left to answer
    words = compose(questions)
    # Resumed after a rolling restart or a crash cut the answer: it goes on from the words
    # the user already saw (in one write), not from its first word again - the chat page
    # shows this answer in place of the cut one.
    done = streamed(messages, words)
    reply = await ctx.begin_assistant()
    if done:
        await reply.append_text(" ".join(words[:done]))
    for n, word in enumerate(words[done:], start=done):
        # Each append is durable and reaches every watcher; an interrupt or a shutdown
        # cancels the drain at the sleep, and the runtime closes the message.
        await reply.append_text(word if n == 0 else f" {word}")
        await trio.sleep(WORD_DELAY)
    await reply.finish()


# ---------------------------------------------------------------------------------------------
# The web process: a small hand-written ASGI app

Scope = Mapping[str, Any]
Receive = Callable[[], Awaitable[Mapping[str, Any]]]
Send = Callable[[Any], Awaitable[None]]

ROUTE = re.compile(
    r"^/sessions/(?P<session>[^/]+)(?:/(?P<action>messages|transcript|interrupt|stop|edit|events))?$"
)
# The method each action takes (no action: the conversation itself).
METHODS = {
    "messages": "POST",
    "transcript": "GET",
    "interrupt": "POST",
    "stop": "POST",
    "edit": "POST",
    "events": "GET",
    None: "DELETE",
}


class HTTPError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _segment(encoded: str) -> str:
    """A path segment's text: its percent-escapes decoded as UTF-8 (400 for bytes that are
    not - every such id would read as the same replacement character)."""
    try:
        return urllib.parse.unquote(encoded, errors="strict")
    except UnicodeDecodeError:
        raise HTTPError(400, f"session id {encoded!r} is not UTF-8") from None


@attrs.define
class ChatApp:
    """POST messages, GET the transcript, POST stop/interrupt/edit, GET events (SSE), DELETE
    a conversation, over a runtime."""

    runtime: trio_sessions.Runtime
    probe: StoreProbe = attrs.field()

    @probe.default
    def _probe(self) -> StoreProbe:
        return StoreProbe(self.runtime)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        try:
            await self.route(scope, receive, send)
        except HTTPError as exc:
            await _respond(send, exc.status, {"error": str(exc)})
        except trio_sessions.SessionBusy as exc:
            await _respond(send, 409, {"error": str(exc)})
        except (ValueError, TypeError, trio_sessions.InputConflict) as exc:
            await _respond(send, 400, {"error": str(exc)})
        except trio_sessions.MalformedRecord as exc:
            # A row the store cannot read (another tool's write): logged for the operator,
            # whose tools repair it, and said - not a bare 500 and a traceback.
            logger.error("malformed record: %s", exc)
            await _respond(send, 500, {"error": MALFORMED})
        except trio_sessions.StoreError as exc:
            # The store did not answer: the service is down for now, not the request wrong -
            # a client may retry it. The reason is the operator's (it may name the server).
            logger.warning("store error on %s %s: %s", scope["method"], scope["path"], exc)
            await _respond(send, 503, {"error": STORE_DOWN}, extra=((b"retry-after", RETRY_AFTER),))

    async def route(self, scope: Scope, receive: Receive, send: Send) -> None:
        method, path = scope["method"], scope["path"]
        if path == "/" and method == "GET":
            await _respond_page(send, CHAT_PAGE)
            return
        if path == "/health" and method in ("GET", "HEAD"):  # load balancers probe with HEAD
            await self.health(send, head=method == "HEAD")
            return
        if path == "/metrics" and method == "GET":
            await _respond(send, 200, attrs.asdict(self.runtime.statistics()))
            return
        # Routed on the path as sent: a session id is one percent-encoded segment, and an
        # id holding a '/' must not split into two once decoded.
        raw_path = scope.get("raw_path") or urllib.parse.quote(path).encode()  # optional in ASGI
        match = ROUTE.match(raw_path.decode("latin-1"))
        if match is None:
            raise HTTPError(404, f"no such resource: {path}")
        session_id, action = _segment(match["session"]), match["action"]
        expected = METHODS[action]
        if method != expected:
            raise HTTPError(405, f"{action or 'a conversation'} takes {expected}")
        if method == "POST" and not _is_json(_header(scope, b"content-type")):
            # What a page of another site can POST without the browser asking first (a
            # form's text/plain, urlencoded or multipart body, or a no-cors fetch with no
            # type) is refused: it cannot post, stop, edit or interrupt a conversation.
            raise HTTPError(415, "a POST takes a JSON body: send Content-Type: application/json")
        if action == "messages":
            await self.post_message(session_id, scope, receive, send)
        elif action == "transcript":
            messages = await self.runtime.transcript(session_id)
            await _respond(send, 200, [message.to_json() for message in messages])
        elif action == "interrupt":
            accepted = await self.runtime.interrupt(session_id)
            await _respond(send, 200, {"accepted": accepted})
        elif action == "stop":
            await self.stop(session_id, receive, send)
        elif action == "edit":
            await self.edit(session_id, scope, receive, send)
        elif action is None:
            deleted = await self.runtime.delete_session(session_id)
            await _respond(send, 200, {"deleted": deleted})
        else:
            await self.stream_events(session_id, scope, receive, send)

    async def health(self, send: Send, *, head: bool = False) -> None:
        """200 while the store answers a read, else a JSON 503 with Retry-After: the
        process cannot serve a chat now. (It answered 200 whatever the store did.) `head`:
        the same answer without its body."""
        error = await self.probe.check()
        if error is None:
            await _respond(send, 200, {"ok": True, "owner_id": self.runtime.owner_id}, head=head)
            return
        retry = ((b"retry-after", RETRY_AFTER),)
        await _respond(send, 503, {"ok": False, "error": error}, extra=retry, head=head)

    async def post_message(
        self, session_id: str, scope: Scope, receive: Receive, send: Send
    ) -> None:
        """Store the user's message; `"on_busy"` says what it does to an answer that is
        still streaming: `queue` (default) it, `interrupt` the answer, or `reject` (409)."""
        payload = await _read_json(receive)
        if not isinstance(payload.get("text"), str):
            raise HTTPError(400, 'the body must be {"text": "...", "on_busy": "queue"}')
        on_busy = payload.get("on_busy", "queue")
        if on_busy not in ("queue", "interrupt", "reject"):
            raise HTTPError(400, 'on_busy must be "queue", "interrupt" or "reject"')
        # A client retrying after a timeout sends the same key: stored once.
        input_id = await self.runtime.submit(
            session_id,
            {"text": payload["text"]},
            input_id=_input_id(session_id, _header(scope, b"idempotency-key")),
            on_busy=on_busy,
        )
        await _respond(send, 202, {"input_id": input_id})

    async def stop(self, session_id: str, receive: Receive, send: Send) -> None:
        """The UI's Stop button for the user's last message (`input_id`, from the POST): if
        no worker picked it up yet it is withdrawn and never answered; otherwise the answer
        that is streaming is interrupted."""
        payload = await _read_json(receive)
        input_id = payload.get("input_id")
        if input_id is not None:
            if not _of_session(str(input_id), session_id):
                raise HTTPError(400, "input_id is not a message of this conversation")
            if await self.runtime.cancel_input(str(input_id)):
                await _respond(send, 200, {"stopped": "withdrawn"})
                return
        interrupted = await self.runtime.interrupt(session_id)
        await _respond(send, 200, {"stopped": "interrupted" if interrupted else None})

    async def edit(self, session_id: str, scope: Scope, receive: Receive, send: Send) -> None:
        """Edit and regenerate: replace user message `seq` with `text`, dropping everything
        after it, and answer it again. 404 unless `seq` is a user message; 409 while an
        answer is running or a message waits unanswered (stop it first: the waiting one
        came after the edited message, and answered before the edit it would reorder the
        conversation), or when the Idempotency-Key names an earlier message. A retry (the
        same Idempotency-Key) is the edit already made - also before its input was
        answered, when `seq` is the slot just past the last message: its input is stored
        once. The truncate and the input are one transaction
        (`submit(truncate_after=...)`): an edit refused - its key names a message still
        pending, say - or a web process dying midway deletes nothing."""
        payload = await _read_json(receive)
        seq, text = payload.get("seq"), payload.get("text")
        if type(seq) is not int or seq < 1 or not isinstance(text, str):
            raise HTTPError(400, 'the body must be {"seq": <a user message\'s seq>, "text": "..."}')
        key = _header(scope, b"idempotency-key")
        input_id = _input_id(session_id, key)
        messages = await self.runtime.transcript(session_id)
        edited = next((m for m in messages if m.seq == seq), None)
        if edited is None:
            newest = messages[-1].seq if messages else 0
            if key is None or newest != seq - 1:
                raise HTTPError(404, f"no user message at seq {seq}")
            # As an edit (it truncates nothing): a retry returns its input, another key
            # while an input waits - another edit of this slot - is SessionBusy, not a
            # message stored after the one waiting.
            input_id = await self.runtime.submit(
                session_id, {"text": text}, input_id=input_id, truncate_after=seq - 1
            )
        elif edited.role != "user":
            raise HTTPError(404, f"no user message at seq {seq}")
        elif edited.input_id != input_id:  # else a retry of this edit, already answered
            kept = next((m for m in messages if m.input_id == input_id and m.seq < seq), None)
            if kept is not None:
                # The submit would take the edit for a retry of that message's input (the
                # same text: 202, nothing edited) or raise InputConflict (a 400 that hides
                # why): the client reused a key, say so.
                raise HTTPError(409, f"the Idempotency-Key names message {kept.seq} already")
            input_id = await self.runtime.submit(
                session_id, {"text": text}, input_id=input_id, truncate_after=seq - 1
            )
        await _respond(send, 202, {"input_id": input_id})

    async def stream_events(
        self, session_id: str, scope: Scope, receive: Receive, send: Send
    ) -> None:
        """Server-sent events from `runtime.stream()`, until the client leaves: `id:` is the
        event's cursor, `data:` the event as JSON. A reconnecting `EventSource` sends the
        last id it saw as `Last-Event-ID` and gets exactly the events after it."""
        cursor = _header(scope, b"last-event-id") or _query(scope).get("cursor") or None
        async with contextlib.AsyncExitStack() as opened:
            try:
                # Entered before the response starts: a bad session id or cursor is a 400.
                events = await opened.enter_async_context(
                    self.runtime.stream(session_id, cursor=cursor)
                )
            except trio_sessions.StoreError as exc:
                # Not a 503: an EventSource fails for good on any status but 200. An event
                # stream that says when to reconnect, and ends, has it come back.
                logger.warning("store error opening %r's event stream: %s", session_id, exc)
                await send({"type": "http.response.start", "status": 200, "headers": SSE})
                await send({"type": "http.response.body", "body": _retry_later()})
                return
            await send({"type": "http.response.start", "status": 200, "headers": SSE})
            disconnected = trio.Event()
            writes = _Writes(send)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(
                    _cancel_on_disconnect, receive, nursery.cancel_scope, disconnected
                )
                nursery.start_soon(writes.keep_alive)
                try:
                    async for event in events:
                        # With it, the events already here (a stream that fell behind): one
                        # write for all, not one each - a write is most of an event's cost.
                        await writes.write("".join(map(_sse, [event, *events.take_ready()])))
                except trio_sessions.MalformedRecord as exc:
                    # A comment (a client ignores it), then nothing until the client leaves:
                    # an ended stream would have an EventSource reconnect into the same row
                    # every few seconds, without end.
                    logger.error("malformed record in %r's event stream: %s", session_id, exc)
                    await writes.write(f": malformed record: {MALFORMED}\n\n")
                    await trio.sleep_forever()
                except trio_sessions.StoreError as exc:
                    # The store did not answer: the stream ends, and says when to reconnect
                    # (an EventSource does, from its last event's id) - one log line.
                    logger.warning("store error in %r's event stream: %s", session_id, exc)
                    await writes.write(_retry_later().decode())
                nursery.cancel_scope.cancel()  # the runtime closed: end the stream
        if not disconnected.is_set():
            await send({"type": "http.response.body", "body": b"", "more_body": False})


@attrs.define
class _StoreRead:
    """One read of `StoreProbe`'s task, shared by every probe waiting for it: its answer
    is kept with it, so a probe woken late reads its own read's, never a later one's."""

    answered: trio.Event = attrs.field(factory=trio.Event)
    error: str | None = None


@attrs.define
class StoreProbe:
    """Whether the store answers, for `/health`: its task (`run`, beside the server) reads
    the store when a probe asks, one read at a time for every probe waiting. A probe
    takes the answer of the read in flight when it comes (that answer comes after the
    probe did: fresh evidence - waiting for the next read instead, a store whose reads
    take over half of `HEALTH_TIMEOUT` read as down to a probe arriving mid-read), else
    asks for a new read. A probe waits at most `HEALTH_TIMEOUT` for the answer: a store
    call that has begun is never abandoned (a hung server holds it until the
    connection's reply bound, 25 s), so the read is the task's, not the request's."""

    runtime: trio_sessions.Runtime
    _wanted: trio.Event = attrs.field(factory=trio.Event)
    _next: _StoreRead = attrs.field(factory=_StoreRead)
    _in_flight: _StoreRead | None = None

    async def run(self) -> None:
        while True:
            await self._wanted.wait()
            self._wanted = trio.Event()
            read, self._next = self._next, _StoreRead()  # later asks: this read or the next
            self._in_flight = read
            try:
                await self.runtime.transcript(HEALTH_SESSION)
            except trio_sessions.StoreError as exc:
                logger.warning("health probe: store error: %s", exc)
                read.error = STORE_DOWN
            finally:
                self._in_flight = None
            read.answered.set()

    async def check(self) -> str | None:
        """None when the store answered a read that answered after this call; else why not."""
        read = self._in_flight
        if read is None:
            read = self._next
            self._wanted.set()
        with trio.move_on_after(HEALTH_TIMEOUT):
            await read.answered.wait()
            return read.error
        logger.warning("health probe: the store did not answer in %g s", HEALTH_TIMEOUT)
        return f"{STORE_DOWN} (no answer within {HEALTH_TIMEOUT:g} s)"


def _input_id(session_id: str, key: str | None) -> str:
    """A message's input id, which names its conversation (a digest of the session id):
    an Idempotency-Key is one per conversation - another conversation's same key is
    another message, and its InputConflict cannot name this one - and Stop can tell another
    conversation's input from this one's (input ids are one namespace for the store)."""
    suffix = uuid.uuid4().hex if key is None else _digest(key)
    return f"{_digest(session_id)}-{suffix}"


def _of_session(input_id: str, session_id: str) -> bool:
    return input_id.startswith(f"{_digest(session_id)}-")


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def _retry_later() -> bytes:
    """An SSE field telling an EventSource to reconnect after `RETRY_AFTER` seconds."""
    return f"retry: {int(RETRY_AFTER) * 1000}\n\n".encode()


def _sse(event: trio_sessions.StreamEvent) -> str:
    """One server-sent event: a cursor is ASCII without line breaks, safe in an `id:` field."""
    return f"id: {event.cursor}\ndata: {json.dumps(event.to_json())}\n\n"


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        event = await receive()
        if event["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif event["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


@attrs.define
class _Writes:
    """An event stream's body writes, one at a time: the events', and a comment whenever
    none was written for `KEEP_ALIVE` seconds."""

    send: Send
    _lock: trio.Lock = attrs.field(factory=trio.Lock)
    _written_at: float = attrs.field(factory=trio.current_time)

    async def write(self, text: str) -> None:
        async with self._lock:
            await self.send(
                {"type": "http.response.body", "body": text.encode(), "more_body": True}
            )
            self._written_at = trio.current_time()

    async def keep_alive(self) -> None:
        while True:
            await trio.sleep_until(self._written_at + KEEP_ALIVE)
            if trio.current_time() >= self._written_at + KEEP_ALIVE:
                await self.write(": keep-alive\n\n")


async def _cancel_on_disconnect(
    receive: Receive, scope: trio.CancelScope, disconnected: trio.Event
) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    disconnected.set()
    scope.cancel()


async def _read_json(receive: Receive) -> dict[str, Any]:
    """The request body as a JSON object (an empty body is `{}`)."""
    body = await _read_body(receive)
    if not body.strip():
        return {}
    try:
        payload = json.loads(body)
    except ValueError as exc:  # not JSON, or bytes that are no UTF-8
        raise HTTPError(400, f"the body must be JSON: {exc}") from None
    except RecursionError:
        raise HTTPError(400, "the body must be JSON: it is nested too deeply") from None
    if not isinstance(payload, dict):
        raise HTTPError(400, "the body must be a JSON object")
    return payload


async def _read_body(receive: Receive) -> bytes:
    body = b""
    while True:
        event = await receive()
        body += bytes(event.get("body", b""))
        if len(body) > MAX_BODY:
            raise HTTPError(413, f"the body is larger than {MAX_BODY} bytes")
        if not event.get("more_body", False):
            return body


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key.lower() == name:
            return bytes(value).decode("latin-1")
    return None


def _is_json(content_type: str | None) -> bool:
    """Whether a Content-Type names JSON (`application/json`, parameters aside)."""
    if content_type is None:
        return False
    return content_type.partition(";")[0].strip().lower() == "application/json"


def _query(scope: Scope) -> dict[str, str]:
    return dict(urllib.parse.parse_qsl(scope["query_string"].decode("latin-1")))


async def _respond_page(send: Send, body: bytes) -> None:
    headers = [
        (b"content-type", b"text/html; charset=utf-8"),
        (b"content-length", str(len(body)).encode()),
    ]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _respond(
    send: Send,
    status: int,
    value: Any,
    *,
    extra: tuple[tuple[bytes, bytes], ...] = (),
    head: bool = False,
) -> None:
    """`value` as a JSON answer; `head` (a HEAD request): its headers, no body."""
    body = json.dumps(value).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *extra,
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": b"" if head else body})


async def _until_signal() -> None:
    """Hypercorn's shutdown trigger: SIGTERM or SIGINT starts a graceful shutdown."""
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            logger.info("web process stopping on %s", signal.Signals(signum).name)
            return


async def serve_web(store: Any, bind: str) -> None:
    """The web process: a producer runtime behind hypercorn, until SIGTERM or SIGINT."""
    async with trio_sessions.open_runtime(store, None, owner_id="web") as runtime:
        config = hypercorn.config.Config()
        config.bind = [bind]
        config.errorlog = logging.getLogger("hypercorn.error")  # through our handler, once
        config.graceful_timeout = 2.0  # event streams are cut after this on shutdown
        app = ChatApp(runtime)
        serve = functools.partial(hypercorn.trio.serve, app, config, shutdown_trigger=_until_signal)
        listening = False
        try:
            async with trio.open_nursery() as probing:
                probing.start_soon(app.probe.run)
                async with trio.open_nursery() as nursery:
                    binds = await nursery.start(serve)
                    listening = True
                    # What start-up made (modules, classes, functions: most of the heap)
                    # stays: a full collection no longer walks it - with 200 live streams
                    # it paused the event loop for 13-18 ms, every request then in flight.
                    gc.freeze()
                    logger.info("chat service listening on %s", " ".join(binds))
                probing.cancel_scope.cancel()  # served: /health's probe ends with it
        except BaseExceptionGroup as group:
            # Hypercorn's nurseries wrap the bind's error in groups, one per nursery.
            refused = None if listening else _only_error(group)
            if not isinstance(refused, OSError):
                raise
            reason = refused.strerror or str(refused)
            raise CannotListen(f"cannot listen on {bind}: {reason}") from None


class CannotListen(Exception):
    """The bind address cannot be listened on (in use, not this host's): the operator
    reads one line, not a traceback."""


def _only_error(group: BaseExceptionGroup[Any]) -> BaseException:
    """The one exception a group wraps (through nested groups), else the group itself."""
    error: BaseException = group
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return error


def settings(argv: list[str] | None = None) -> tuple[Any, str]:
    """The store (a path, a URL, or a `PostgresStore` in a named schema) and the bind
    address, from the command line and the worker command's environment variables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--store",
        # Empty is unset, as for the worker command (a deployment template's `VAR=`).
        default=os.environ.get("TRIO_SESSIONS_STORE") or None,
        help="SQLite path or postgresql:// URL (env TRIO_SESSIONS_STORE)",
    )
    parser.add_argument(
        "--schema",
        default=os.environ.get("TRIO_SESSIONS_SCHEMA") or None,
        help="PostgreSQL schema, as the workers' (env TRIO_SESSIONS_SCHEMA; default public)",
    )
    parser.add_argument("--bind", default="127.0.0.1:8000", help="HOST:PORT (port 0: any free)")
    args = parser.parse_args(argv)
    if not KEEP_ALIVE > 0:  # 0 (or less) wrote a comment after every comment, without end
        parser.error(f"CHAT_KEEP_ALIVE must be a positive number of seconds, got {KEEP_ALIVE}")
    if args.store is None:
        parser.error("no store: pass --store or set TRIO_SESSIONS_STORE")
    if args.schema is None:
        return args.store, args.bind
    if not args.store.startswith(("postgresql://", "postgres://")):
        parser.error("a schema needs a postgresql:// URL as the store")
    try:
        return trio_sessions.PostgresStore(args.store, schema=args.schema), args.bind
    except ValueError as exc:  # a schema name PostgreSQL would not take
        parser.error(str(exc))


def main() -> int:
    store, bind = settings()
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        trio.run(serve_web, store, bind)
    except (CannotListen, trio_sessions.StoreError) as exc:
        # A port in use, or a store that cannot be opened: the line says it all.
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
