"""The chat example's ASGI app (examples/chat_service.py) called in process, as hypercorn
would call it, over a producer runtime: what its handlers answer to input no client should
send, without starting the service's processes (`test_chat_service` does that)."""

from __future__ import annotations

import contextlib
import json
import urllib.parse
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trio.testing
from test_examples import load_example

import trio_sessions

chat = load_example("chat_service")


def _scope(
    method: str, path: str, headers: list[Any], *, raw_path: bytes | None = b""
) -> dict[str, Any]:
    """A request's ASGI scope as hypercorn builds it: `path` percent-decoded, `raw_path` as
    the client sent it (by default `path` itself; None from a server that sends none)."""
    return {
        "type": "http",
        "method": method,
        "path": urllib.parse.unquote(path),
        "raw_path": path.encode("ascii") if raw_path == b"" else raw_path,
        "headers": headers,
        "query_string": b"",
    }


async def _call(
    app: Any,
    method: str,
    path: str,
    body: bytes = b"",
    headers: list[Any] | None = None,
    *,
    raw_path: bytes | None = b"",
    content_type: bytes | None = b"application/json",
) -> tuple[int | None, bytes]:
    """One request: its status and body (the app's exceptions propagate, as to hypercorn,
    which answers 500). `raw_path`: the path as the client sent it, percent-encoded (by
    default `path` itself), or None from a server that sends none. A POST says its body is
    `content_type` (None: it sends no Content-Type), as the chat page does."""
    sent: list[Any] = []
    headers = list(headers or [])
    if method == "POST" and content_type is not None:
        headers.append((b"content-type", content_type))
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await trio.sleep_forever()
        raise AssertionError  # pragma: no cover

    async def send(message: Any) -> None:
        sent.append(message)

    await app(_scope(method, path, headers, raw_path=raw_path), receive, send)
    status = next((m["status"] for m in sent if m["type"] == "http.response.start"), None)
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


@pytest.mark.parametrize(
    "body",
    [b"[" * 5000 + b"]" * 5000, b'{"text": "\xff"}'],
    ids=["deeply-nested", "not-utf8"],
)
async def test_a_body_json_cannot_read_is_a_400_not_a_server_error(
    tmp_path: Path, body: bytes
) -> None:
    """A body of nested arrays (10 KB, well under MAX_BODY), or of bytes that are no UTF-8,
    is malformed input like any other: 400 with a JSON error, nothing stored - json.loads
    raises RecursionError or UnicodeDecodeError, which the app did not catch, so the
    request ended as a 500 with a traceback in the log."""
    async with trio_sessions.open_runtime(str(tmp_path / "chat.db"), None) as rt:
        app = chat.ChatApp(rt)
        for action in ("messages", "edit", "stop"):
            status, answer = await _call(app, "POST", f"/sessions/s/{action}", body)
            assert status == 400, (action, status, answer)
            assert b"the body must be JSON" in answer, answer
        assert await rt.transcript("s") == []


async def _asked_and_answered(
    app: Any, rt: trio_sessions.Runtime, questions: list[tuple[str, Any]]
) -> None:
    """Each (question, headers) POSTed to session `s` in turn (a 202), and answered."""
    for question, headers in questions:
        body = json.dumps({"text": question}).encode()
        status, _ = await _call(app, "POST", "/sessions/s/messages", body, headers)
        assert status == 202
        await rt.wait_idle("s")


async def _answer(ctx: trio_sessions.DrainContext) -> None:
    for item in await ctx.take_inputs():
        reply = await ctx.begin_assistant()
        await reply.append_text(f"You said: {item.payload['text']}")
        await reply.finish()


async def test_a_session_id_is_one_path_segment_whatever_it_holds(tmp_path: Path) -> None:
    """The page sends a session id percent-encoded (`encodeURIComponent`): an id holding a
    `/` is one segment, its conversation like any other - not a 404 for a path the decoded
    slash split. A segment whose bytes are not UTF-8 names no session: a 400 - not the
    replacement character, which made every such id one conversation."""
    async with trio_sessions.open_runtime(str(tmp_path / "chat.db"), _answer) as rt:
        app = chat.ChatApp(rt)
        status, answer = await _call(app, "POST", "/sessions/a%2Fb/messages", b'{"text": "hi"}')
        assert status == 202, answer
        await rt.wait_idle("a/b")
        status, answer = await _call(app, "GET", "/sessions/a%2Fb/transcript")
        assert status == 200, answer
        assert [m["role"] for m in json.loads(answer)] == ["user", "assistant"]
        for segment in ("%FF", "%FE"):
            status, answer = await _call(app, "POST", f"/sessions/{segment}/messages", b"{}")
            assert status == 400, answer
            assert b"not UTF-8" in answer, answer
        assert await rt.transcript("\ufffd") == []
        # A server that sends no raw_path (ASGI lets it): routed on the path, encoded again
        # (a '%' in an id decoded once, as the client encoded it once).
        status, answer = await _call(app, "POST", "/sessions/a%2525b/messages", b'{"text": "%"}')
        assert status == 202, answer
        await rt.wait_idle("a%25b")
        status, answer = await _call(app, "GET", "/sessions/a%2525b/transcript", raw_path=None)
        assert status == 200, answer
        assert [m["role"] for m in json.loads(answer)] == ["user", "assistant"]


async def test_edit_names_a_user_message_and_a_retried_edit_keeps_it(tmp_path: Path) -> None:
    """POST /edit replaces the user message at `seq`: a seq that names no message, or an
    assistant's, is a 404 that drops nothing (before, the first appended the text as a new
    message and the second dropped the answer for a second user message in a row). A
    retried edit (same Idempotency-Key, e.g. after a timeout) is the edit already made: a
    202, and the edited message and its answer stay (before, the retry dropped them and its
    input, stored once, was never stored again: the edit was lost)."""
    async with trio_sessions.open_runtime(str(tmp_path / "chat.db"), _answer) as rt:
        app = chat.ChatApp(rt)
        status, _ = await _call(app, "POST", "/sessions/s/messages", b'{"text": "one"}')
        assert status == 202
        await rt.wait_idle("s")
        before = await rt.transcript("s")
        assert [m.role for m in before] == ["user", "assistant"]
        for seq in (2, 50):
            body = json.dumps({"seq": seq, "text": "x"}).encode()
            status, answer = await _call(app, "POST", "/sessions/s/edit", body)
            assert status == 404, (seq, status, answer)
        assert await rt.transcript("s") == before
        key = [(b"idempotency-key", b"edit-1")]
        edit = b'{"seq": 1, "text": "two"}'
        for _ in range(2):
            status, answer = await _call(app, "POST", "/sessions/s/edit", edit, key)
            assert status == 202, answer
            await rt.wait_idle("s")
        after = await rt.transcript("s")
        assert [(m.seq, m.role) for m in after] == [(1, "user"), (2, "assistant")]
        assert after[0].data == {"text": "two"}


async def test_an_edit_retried_before_its_input_was_answered_is_stored_once(
    tmp_path: Path,
) -> None:
    """The web process edits and its client retries before any worker took the edited
    input (the truncated slot is still empty): a 202 again, and the worker then answers the
    edit once."""
    db = str(tmp_path / "chat.db")
    async with trio_sessions.open_runtime(db, _answer) as worker:
        await worker.submit("s", {"text": "one"})
        await worker.wait_idle("s")
    key = [(b"idempotency-key", b"edit-1")]
    async with trio_sessions.open_runtime(db, None) as web:
        app = chat.ChatApp(web)
        for _ in range(2):
            status, answer = await _call(
                app, "POST", "/sessions/s/edit", b'{"seq": 1, "text": "two"}', key
            )
            assert status == 202, answer
        assert await web.transcript("s") == []
    async with trio_sessions.open_runtime(db, _answer) as worker:
        await worker.wait_idle("s")
        messages = await worker.transcript("s")
    assert [(m.seq, m.role, m.data) for m in messages][:1] == [(1, "user", {"text": "two"})]
    assert len(messages) == 2


async def test_an_edit_of_the_slot_a_pending_edit_holds_is_a_409_not_a_second_message(
    tmp_path: Path,
) -> None:
    """An edit made (its input waiting for a worker: the edited slot still empty), then
    another edit of that slot with another key - the user changed the text after a lost
    answer, or a second tab edited the same message: a 409, as for any edit while a message
    waits. (It was taken for a retry of the first and stored as a new message after it:
    both texts then stood in the conversation, answered together.)"""
    db = str(tmp_path / "chat.db")
    async with trio_sessions.open_runtime(db, _answer) as worker:
        await worker.submit("s", {"text": "one"})
        await worker.wait_idle("s")
    async with trio_sessions.open_runtime(db, None) as web:
        app = chat.ChatApp(web)
        status, answer = await _call(
            app,
            "POST",
            "/sessions/s/edit",
            b'{"seq": 1, "text": "two"}',
            [(b"idempotency-key", b"e1")],
        )
        assert status == 202, answer
        status, answer = await _call(
            app,
            "POST",
            "/sessions/s/edit",
            b'{"seq": 1, "text": "three"}',
            [(b"idempotency-key", b"e2")],
        )
        assert status == 409, answer
    async with trio_sessions.open_runtime(db, _answer) as worker:
        await worker.wait_idle("s")
        messages = await worker.transcript("s")
    assert [m.data for m in messages if m.role == "user"] == [{"text": "two"}]


@pytest.mark.parametrize(
    "text", ["oops\\u0000", "half \\ud800 a pair"], ids=["nul", "lone-surrogate"]
)
async def test_an_edit_whose_text_cannot_be_stored_is_a_400_that_drops_nothing(
    tmp_path: Path, text: str
) -> None:
    """POST /edit with a text no store holds (a NUL, a lone surrogate - both valid JSON
    escapes a client may send) is a 400 and the conversation stays as it was. Before, the
    edit truncated first and only then submitted: the submit's 400 came after the edited
    message and every answer after it were deleted, and a retry could not bring them back."""
    async with trio_sessions.open_runtime(str(tmp_path / "chat.db"), _answer) as rt:
        app = chat.ChatApp(rt)
        await _asked_and_answered(app, rt, [("one", None), ("two", None)])
        before = await rt.transcript("s")
        assert [m.role for m in before] == ["user", "assistant", "user", "assistant"]
        edit = b'{"seq": 3, "text": "' + text.encode() + b'"}'
        status, answer = await _call(app, "POST", "/sessions/s/edit", edit)
        assert status == 400, answer
        assert await rt.transcript("s") == before


async def test_an_edit_whose_key_names_an_earlier_message_drops_nothing(tmp_path: Path) -> None:
    """POST /edit with an Idempotency-Key the client already used for an earlier message it
    keeps (a client numbering its keys afresh after a reload) cannot store the edit: a 4xx,
    and the conversation stays as it was. Before, the edit truncated first: its submit then
    raised InputConflict (another text; a 400) or returned the earlier message's input (the
    same text; a 202 answered by nothing) - either way every message from the edited one on
    was deleted and no edit was made."""
    key = [(b"idempotency-key", b"1")]
    async with trio_sessions.open_runtime(str(tmp_path / "chat.db"), _answer) as rt:
        app = chat.ChatApp(rt)
        await _asked_and_answered(app, rt, [("one", key), ("two", None)])
        before = await rt.transcript("s")
        assert [m.role for m in before] == ["user", "assistant", "user", "assistant"]
        for text in ("edited", "one"):
            edit = json.dumps({"seq": 3, "text": text}).encode()
            status, answer = await _call(app, "POST", "/sessions/s/edit", edit, key)
            assert status is not None and 400 <= status < 500, (text, status, answer)
            assert await rt.transcript("s") == before, text


async def test_an_edit_whose_key_names_a_pending_message_drops_nothing(tmp_path: Path) -> None:
    """The same with an Idempotency-Key that names a message not answered yet (its input
    pending: the service stores messages and its workers are busy or down): the edit cannot
    be stored, and nothing is dropped. Found by a review of the check above: it looks for
    the key among the transcript's messages only, so the truncate runs and the submit's
    InputConflict (a 400) comes after seqs 3-4 were deleted."""
    database = str(tmp_path / "chat.db")
    async with trio_sessions.open_runtime(database, _answer) as rt:
        app = chat.ChatApp(rt)
        await _asked_and_answered(app, rt, [("one", None), ("two", None)])
    key = [(b"idempotency-key", b"7")]
    async with trio_sessions.open_runtime(database, None) as web:  # no worker runs now
        app = chat.ChatApp(web)
        body = json.dumps({"text": "three"}).encode()
        status, _ = await _call(app, "POST", "/sessions/s/messages", body, key)
        assert status == 202
        before = await web.transcript("s")
        assert [m.role for m in before] == ["user", "assistant", "user", "assistant"]
        edit = json.dumps({"seq": 3, "text": "edited"}).encode()
        status, answer = await _call(app, "POST", "/sessions/s/edit", edit, key)
        assert status is not None and 400 <= status < 500, (status, answer)
        assert await web.transcript("s") == before


async def test_an_edit_while_a_later_message_waits_unanswered_drops_nothing(
    tmp_path: Path,
) -> None:
    """POST /edit of an earlier message while a later one waits unanswered (workers busy
    or down) is a 409, as while an answer runs (Stop withdraws the waiting one): the edit
    drops everything after the edited message, and a waiting message is after it. Before,
    the edit queued behind it: the messages between were deleted, the waiting one stayed
    and was answered first - the conversation read "three", then the edited "one". Found
    by a review of `submit(truncate_after=...)`, whose "queue" stores the edit after the
    inputs waiting."""
    database = str(tmp_path / "chat.db")
    async with trio_sessions.open_runtime(database, _answer) as rt:
        app = chat.ChatApp(rt)
        await _asked_and_answered(app, rt, [("one", None), ("two", None)])
    async with trio_sessions.open_runtime(database, None) as web:  # no worker runs now
        app = chat.ChatApp(web)
        body = json.dumps({"text": "three"}).encode()
        status, _ = await _call(app, "POST", "/sessions/s/messages", body)
        assert status == 202
        before = await web.transcript("s")
        edit = json.dumps({"seq": 1, "text": "one, edited"}).encode()
        status, answer = await _call(app, "POST", "/sessions/s/edit", edit)
        assert status == 409, (status, answer)
        assert await web.transcript("s") == before
    async with trio_sessions.open_runtime(database, _answer) as rt:
        await rt.run("s")
        texts = [m.data.get("text") for m in await rt.transcript("s") if m.role == "user"]
    assert texts == ["one", "two", "three"]


@pytest.mark.parametrize("keep_alive", [0.0, -1.0, float("nan")])
def test_a_keep_alive_period_that_is_no_positive_time_is_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], keep_alive: float
) -> None:
    """`CHAT_KEEP_ALIVE=0` (say, to turn the comments off) made every event stream write
    `: keep-alive` after each one, without end - a flood per client - and NaN failed each
    stream at its first wait (found by the review). The service refuses it at start;
    `inf` turns the comments off."""
    monkeypatch.setattr(chat, "KEEP_ALIVE", keep_alive)
    with pytest.raises(SystemExit):
        chat.settings(["--store", "chat.db"])
    assert "CHAT_KEEP_ALIVE must be a positive number of seconds" in capsys.readouterr().err


async def test_a_conversation_holding_a_malformed_record_is_said_not_a_500_loop(
    tmp_path: Path,
) -> None:
    """A message row the store cannot read (another tool's write): GET /transcript answers
    a JSON error saying so, not a bare 500 with a traceback, and the event stream says it
    in a comment and stays open until the client leaves. (The stream's MalformedRecord
    ended the response: a browser's EventSource reconnected into the same row every few
    seconds, forever, each time a traceback in the log.)"""
    from helpers import Raw

    path = tmp_path / "chat.db"
    async with trio_sessions.open_runtime(str(path), None) as rt:
        await rt.submit("s", {"text": "hello"})
        Raw(path).write(
            "INSERT INTO session_message(id, session_id, role, seq, data, time_created,"
            " time_updated) VALUES ('m1', 's', 'user', 1, 'not json', 0, 0)"
        )
        app = chat.ChatApp(rt)
        status, answer = await _call(app, "GET", "/sessions/s/transcript")
        assert status == 500
        assert "cannot be read" in json.loads(answer)["error"]

        sent: list[Any] = []
        said = trio.Event()

        async def receive() -> dict[str, Any]:
            await said.wait()  # the client leaves once the stream said it
            return {"type": "http.disconnect"}

        async def send(message: Any) -> None:
            sent.append(message)
            if b": malformed record" in message.get("body", b""):
                said.set()

        with trio.fail_after(10):
            await app(_scope("GET", "/sessions/s/events", []), receive, send)
        assert sent[0] == {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")],
        }
        assert said.is_set()
        assert not any(m.get("more_body") is False for m in sent)  # never ended by the app


@attrs.define
class _Resumed:
    """The drain's view of a session whose answer a stopped or killed worker left cut
    (closed "interrupted: owner lost" by the takeover): its transcript, and the resumed
    answer's writes as the drain makes them."""

    messages: list[trio_sessions.Message]
    writes: list[str] = attrs.field(factory=list)
    finished: bool = False

    async def take_inputs(self) -> list[trio_sessions.Input]:
        return []  # the dead owner took them: the question is in the transcript

    async def transcript(self) -> list[trio_sessions.Message]:
        return self.messages

    async def begin_assistant(self) -> _Resumed:
        return self

    async def append_text(self, text: str) -> None:
        self.writes.append(text)

    async def finish(self) -> None:
        self.finished = True


def _message(seq: int, role: Any, data: Any) -> trio_sessions.Message:
    return trio_sessions.Message(f"m{seq}", "s", role, seq, data, f"e{seq}", None)


def _cut_or_given(text: str, error: str | None) -> trio_sessions.AssistantData:
    return trio_sessions.AssistantData((trio_sessions.TextPart(text),), True, error)


async def test_a_resumed_answer_goes_on_from_the_words_already_streamed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A rolling restart (SIGTERM) or a crash cuts an answer mid-stream; the worker that
    resumes it started the answer over, so the chat showed the words already streamed
    twice - the cut answer, then the new one from its first word - and streamed them again
    at the model's pace. The resumed answer starts with the cut one's words, in one write,
    and streams the rest (found by running the chat service through rolling restarts)."""
    resumed = _Resumed(
        [
            _message(1, "user", {"text": "one two three four"}),
            _message(2, "assistant", _cut_or_given("You said: one", "interrupted: owner lost")),
        ]
    )
    await chat.drain(resumed)  # the drain's part of a DrainContext
    assert resumed.writes == ["You said: one", " two", " three", " four"]
    assert resumed.finished
    # A cut that is no prefix of this answer (the drain composes another), an answer cut
    # by the user (it counts as given) or none at all: the answer from its first word.
    for cut in [
        _cut_or_given("You said: two", "interrupted: owner lost"),
        _cut_or_given("x", None),
    ]:
        other = _Resumed([_message(1, "user", {"text": "one two"}), _message(2, "assistant", cut)])
        await chat.drain(other)
        assert other.writes == (["You", " said:", " one", " two"] if cut.error else []), cut


async def test_a_store_that_does_not_answer_is_a_json_503_with_retry_after(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The store unreachable (a StoreError: PostgreSQL down, a lock that never cleared) is
    said as the service being down for now - a JSON 503 with a Retry-After, its reason in
    one log line and not in the answer (it may name the server) - as the console says it.
    (It escaped the app: hypercorn answered a bare 500, not JSON, with a traceback.)"""
    async with trio_sessions.open_runtime(str(tmp_path / "chat.db"), None) as rt:

        async def unreachable(*args: Any, **kwargs: Any) -> Any:
            raise trio_sessions.StoreError("connection refused: password=secret")

        rt.transcript = unreachable  # type: ignore[method-assign]
        rt.submit = unreachable  # type: ignore[method-assign]
        app = chat.ChatApp(rt)
        sent: list[Any] = []

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b'{"text": "hi"}', "more_body": False}

        async def send(message: Any) -> None:
            sent.append(message)

        for method, path in [("GET", "/sessions/s/transcript"), ("POST", "/sessions/s/messages")]:
            sent.clear()
            caplog.clear()
            headers = [(b"content-type", b"application/json")]
            await app(_scope(method, path, headers), receive, send)
            start = sent[0]
            assert start["status"] == 503, (path, sent)
            answer = dict(start["headers"])
            assert answer[b"content-type"] == b"application/json"
            assert int(answer[b"retry-after"]) > 0
            body = json.loads(b"".join(m.get("body", b"") for m in sent[1:]))
            assert "store" in body["error"] and "secret" not in body["error"], body
            assert [r.levelname for r in caplog.records] == ["WARNING"], caplog.records
            assert "connection refused" in caplog.records[0].getMessage()

        # Lost while an event stream is open (its 200 sent): one log line, and the stream
        # ends, an SSE `retry:` saying when to reconnect - not a traceback, a cut response.
        class Events:
            def __aiter__(self) -> Events:
                return self

            async def __anext__(self) -> Any:
                raise trio_sessions.StoreError("connection refused: password=secret")

        @contextlib.asynccontextmanager
        async def stream(*args: Any, **kwargs: Any) -> AsyncIterator[Events]:
            yield Events()

        rt.stream = stream  # type: ignore[assignment]
        sent.clear()
        caplog.clear()

        async def stays() -> dict[str, Any]:
            await trio.sleep_forever()
            raise AssertionError  # pragma: no cover

        with trio.fail_after(10):
            await app(_scope("GET", "/sessions/s/events", []), stays, send)
        assert sent[0]["status"] == 200
        assert sent[1]["body"] == b"retry: 5000\n\n" and sent[1]["more_body"] is True
        assert sent[2:] == [{"type": "http.response.body", "body": b"", "more_body": False}]
        assert [r.levelname for r in caplog.records] == ["WARNING"], caplog.records


@pytest.mark.parametrize(
    "content_type",
    [None, b"text/plain", b"application/x-www-form-urlencoded", b"multipart/form-data; b=x"],
)
async def test_a_post_that_is_not_json_by_its_content_type_is_a_415_that_does_nothing(
    tmp_path: Path, content_type: bytes | None
) -> None:
    """A POST whose Content-Type is not application/json - what a cross-site form (or a
    no-cors fetch) can send without the browser asking the service first - is refused with
    415, and does nothing: another site's page cannot post, stop or edit a conversation.
    (The app read any body as JSON: a `text/plain` form holding `{"text": ...}` posted a
    message, and an empty POST to /stop or /interrupt interrupted the answer.)"""
    from helpers import Raw

    async with trio_sessions.open_runtime(str(tmp_path / "chat.db"), None) as rt:
        app = chat.ChatApp(rt)
        await rt.submit("s", {"text": "first"})
        requests = [
            ("messages", b'{"text": "from another site"}'),
            ("edit", b'{"seq": 1, "text": "from another site"}'),
            ("stop", b""),
            ("interrupt", b""),
        ]
        for action, body in requests:
            status, answer = await _call(
                app, "POST", f"/sessions/s/{action}", body, content_type=content_type
            )
            assert status == 415, (action, status, answer)
            assert "application/json" in json.loads(answer)["error"], answer
        status, answer = await _call(
            app,
            "POST",
            "/sessions/s/messages",
            b'{"text": "from the page"}',
            content_type=b"Application/JSON; charset=utf-8",
        )
        assert status == 202, answer
        stored = Raw(tmp_path / "chat.db").rows("SELECT payload FROM session_input ORDER BY seq")
        assert [json.loads(payload)["text"] for (payload,) in stored] == ["first", "from the page"]


async def test_an_event_stream_opened_while_the_store_does_not_answer_says_when_to_retry(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """GET /events while the store is down answers an event stream holding an SSE `retry:`
    and ending it, which a browser's EventSource follows: it reconnects from its last event
    a few seconds later. (It was a 503: an EventSource fails for good on any status but
    200, so a chat page reconnecting during a store outage stopped showing answers, and
    said nothing, until it was reloaded.)"""
    async with trio_sessions.open_runtime(str(tmp_path / "chat.db"), None) as rt:

        @contextlib.asynccontextmanager
        async def stream(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
            raise trio_sessions.StoreError("connection refused: password=secret")
            yield  # pragma: no cover

        rt.stream = stream  # type: ignore[method-assign]
        app = chat.ChatApp(rt)
        status, answer = await _call(app, "GET", "/sessions/s/events")
        assert status == 200
        assert answer == b"retry: 5000\n\n"
        assert [r.levelname for r in caplog.records] == ["WARNING"], caplog.records
        assert "secret" in caplog.records[0].getMessage()  # the operator's, not the client's


HUNG = 25.0  # seconds a hung PostgreSQL server holds a store call (its reply bound)


async def test_health_is_a_503_while_the_store_does_not_answer(
    tmp_path: Path,
    autojump_clock: trio.testing.MockClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`/health` says whether the process can serve a chat: 200 while the store answers, a
    JSON 503 with Retry-After while it raises StoreError or does not answer within
    `HEALTH_TIMEOUT` - then 200 again once it does. It answered 200 whatever the store did
    (once the runtime was open), so a load balancer kept sending chats to a process that
    could store none. The reason in the answer is no server's (it may name one): that goes
    to the log. Found by audit (audB54)."""
    async with (
        trio_sessions.open_runtime(str(tmp_path / "chat.db"), None) as rt,
        trio.open_nursery() as nursery,
    ):
        app = chat.ChatApp(rt)
        nursery.start_soon(app.probe.run)  # as the web process runs it, beside the server
        status, answer = await _call(app, "GET", "/health")
        assert (status, json.loads(answer)) == (200, {"ok": True, "owner_id": rt.owner_id})
        served = rt.transcript

        async def refused(*args: Any, **kwargs: Any) -> Any:
            raise trio_sessions.StoreError("connection refused: password=secret")

        async def hangs(*args: Any, **kwargs: Any) -> Any:
            await trio.sleep(HUNG)  # a hung server: a reply bound ends the call
            raise trio_sessions.StoreError("no reply")

        for down in [refused, hangs]:
            rt.transcript = down  # type: ignore[method-assign]
            sent: list[Any] = []

            async def send(message: Any, sent: list[Any] = sent) -> None:
                sent.append(message)

            async def receive() -> dict[str, Any]:
                return {"type": "http.request", "body": b"", "more_body": False}

            started = trio.current_time()
            await app(_scope("GET", "/health", []), receive, send)
            assert sent[0]["status"] == 503, (down, sent)
            assert trio.current_time() - started <= chat.HEALTH_TIMEOUT
            headers = dict(sent[0]["headers"])
            assert headers[b"content-type"] == b"application/json"
            assert int(headers[b"retry-after"]) > 0
            body = json.loads(b"".join(m.get("body", b"") for m in sent[1:]))
            assert body["ok"] is False and "store" in body["error"], body
            assert "secret" not in body["error"]
        rt.transcript = served  # type: ignore[method-assign]
        await trio.sleep(HUNG)  # the hung read ended: the next probe reads the store again
        status, answer = await _call(app, "GET", "/health")
        assert (status, json.loads(answer)["ok"]) == (200, True)
        nursery.cancel_scope.cancel()
    assert any("secret" in r.getMessage() for r in caplog.records), caplog.records


async def test_health_takes_the_answer_of_a_slow_read_in_flight(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """A probe that arrives while the store's read is in flight takes that read's answer:
    the read answers after the probe came, so it is fresh evidence. It waited for the next
    read instead, so with reads of 1.5 s a probe arriving mid-read waited 3 s against its
    2 s bound and a slow store that answers every read read as down - a 503 that made a
    load balancer take the process out. One read at a time still serves every probe
    waiting. Found by review (H54)."""
    async with (
        trio_sessions.open_runtime(str(tmp_path / "chat.db"), None) as rt,
        trio.open_nursery() as nursery,
    ):
        app = chat.ChatApp(rt)
        nursery.start_soon(app.probe.run)
        reads: list[float] = []
        in_flight = 0

        async def slow(*args: Any, **kwargs: Any) -> Any:
            nonlocal in_flight
            in_flight += 1
            assert in_flight == 1, "two reads at once"
            reads.append(trio.current_time())
            await trio.sleep(1.5)  # a slow store, answering every read
            in_flight -= 1
            return []  # the probe's session has no messages (no thread: the clock jumps)

        rt.transcript = slow  # type: ignore[method-assign]
        answers: list[tuple[str, int | None, float]] = []

        async def probe(name: str) -> None:
            status, _ = await _call(app, "GET", "/health")
            answers.append((name, status, trio.current_time()))

        started = trio.current_time()
        async with trio.open_nursery() as probes:
            probes.start_soon(probe, "first")
            await trio.sleep(0.5)  # the first probe's read is in flight
            probes.start_soon(probe, "mid-read")
        assert sorted(answers) == [("first", 200, started + 1.5), ("mid-read", 200, started + 1.5)]
        assert reads == [started]  # one read answered both
        await probe("after")  # no read in flight: a new read
        assert answers[-1] == ("after", 200, started + 3.0)
        assert reads == [started, started + 1.5]
        nursery.cancel_scope.cancel()
