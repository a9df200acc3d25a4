"""The chat service example over real HTTP: a web process and two workers on one SQLite file.

The processes run as a user would start them (`examples/chat_service.py` behind hypercorn,
and `python -m trio_sessions worker chat_service:drain`), with a short lease so a killed
worker's session is taken over within seconds. Readiness is polled (the log line, then
`/health`); every wait is bounded. The tests share the processes (started once for the
module); each uses its own sessions, and the last one kills a worker.
"""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio
from conftest import query
from helpers import apply_event
from test_examples import load_example

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
DEADLINE = 15.0  # seconds any one expected state may take (generous for a loaded CI host)
POLL = 0.05
WORDS = 100  # a long question: its streamed answer takes ~2 s, room to land mid-answer
JSON = {"content-type": "application/json"}  # what the service takes a POST's body as

pytestmark = pytest.mark.slow


@attrs.define
class Service:
    """The web process and the workers (by owner name), with their logs."""

    url: str
    db: Path
    web: subprocess.Popen[bytes]
    workers: dict[str, subprocess.Popen[bytes]]
    logs: Path

    def output(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()}" for p in sorted(self.logs.iterdir()))


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRIO_SESSIONS_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(EXAMPLES), env.get("PYTHONPATH")]))
    env["CHAT_WORD_DELAY"] = "0.02"
    env["CHAT_KEEP_ALIVE"] = "0.2"
    return env


def _spawn(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=_env())


def _wait_for(check: Any, what: str, logs: Path) -> Any:
    deadline = time.monotonic() + DEADLINE
    while time.monotonic() < deadline:
        if (found := check()) is not None:
            return found
        time.sleep(POLL)
    output = "\n".join(p.read_text() for p in sorted(logs.iterdir()))
    pytest.fail(f"timed out waiting for {what}:\n{output}")


def _listening(log: Path) -> str | None:
    match = re.search(r"chat service listening on (http://\S+)", log.read_text())
    return None if match is None else match.group(1)


def _healthy(url: str) -> bool | None:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200 or None
    except httpx.TransportError:
        return None


def _started(log: Path) -> bool | None:
    return "worker started" in log.read_text() or None


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    root = tmp_path_factory.mktemp("chat")
    logs = root / "logs"
    logs.mkdir()
    db = root / "chat.db"
    web = _spawn(
        [sys.executable, str(EXAMPLES / "chat_service.py"), "--store", str(db), "--bind",
         "127.0.0.1:0"],
        logs / "web.log",
    )  # fmt: skip
    workers = {
        name: _spawn(
            [sys.executable, "-m", "trio_sessions", "worker", "chat_service:drain",
             "--store", str(db), "--owner", name, "--lease", "2", "--recovery-interval", "0.3"],
            logs / f"{name}.log",
        )
        for name in ("chat-a", "chat-b")
    }  # fmt: skip
    processes = [web, *workers.values()]
    stopped: list[subprocess.Popen[bytes]] = []
    try:
        url = _wait_for(lambda: _listening(logs / "web.log"), "the web process to listen", logs)
        _wait_for(lambda: _healthy(url), "/health", logs)
        for name in workers:
            _wait_for(functools.partial(_started, logs / f"{name}.log"), name, logs)
        yield Service(url, db, web, workers, logs)
    finally:
        for process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                stopped.append(process)
        for process in processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    # A graceful stop: every process still running was stopped by SIGTERM with status 0.
    output = "\n".join(f"--- {p.name}\n{p.read_text()}" for p in sorted(logs.iterdir()))
    assert [process.returncode for process in stopped] == [0] * len(stopped), output


def test_the_web_process_names_its_schema_as_the_worker_does(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--schema`, or `TRIO_SESSIONS_SCHEMA` as for the worker command, names the web
    process's PostgreSQL schema (before, the variable was ignored: messages were stored in
    `public` while the workers drained the named schema, and never answered); a schema
    with an SQLite store is a usage error."""
    import trio_sessions

    chat = load_example("chat_service")
    url = "postgresql://app@db.example/chat"
    store, _ = chat.settings(["--store", url, "--schema", "tenant_a"])
    assert isinstance(store, trio_sessions.PostgresStore)
    assert (store.url, store.schema) == (url, "tenant_a")
    monkeypatch.setenv("TRIO_SESSIONS_STORE", url)
    monkeypatch.setenv("TRIO_SESSIONS_SCHEMA", "tenant_b")
    store, bind = chat.settings([])
    assert (store.schema, bind) == ("tenant_b", "127.0.0.1:8000")
    monkeypatch.delenv("TRIO_SESSIONS_SCHEMA")
    assert chat.settings([])[0] == url
    with pytest.raises(SystemExit) as refused:
        chat.settings(["--store", "chat.db", "--schema", "tenant_a"])
    assert refused.value.code == 2
    assert "a schema needs a postgresql:// URL" in capsys.readouterr().err


def test_the_web_process_reads_empty_variables_as_unset_as_the_worker_does(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """README "Several hosts": the web process and the workers read the same variables. The
    worker takes an empty one as unset (`TRIO_SESSIONS_SCHEMA=` from a deployment template:
    `public`); the web process took it as given - a schema named '' refused, or, with an
    SQLite store, "a schema needs a postgresql:// URL" - while the workers ran, and an
    empty `TRIO_SESSIONS_STORE` reached `open_runtime` as an in-memory database: a
    traceback. Found following the README."""
    chat = load_example("chat_service")
    url = "postgresql://app@db.example/chat"
    monkeypatch.setenv("TRIO_SESSIONS_SCHEMA", "")
    monkeypatch.setenv("TRIO_SESSIONS_STORE", url)
    assert chat.settings([])[0] == url
    assert chat.settings(["--store", "chat.db"])[0] == "chat.db"
    monkeypatch.setenv("TRIO_SESSIONS_STORE", "")
    with pytest.raises(SystemExit) as refused:
        chat.settings([])
    assert refused.value.code == 2
    assert "no store" in capsys.readouterr().err


def test_a_store_the_web_process_cannot_open_is_one_line_and_exit_1(tmp_path: Path) -> None:
    """`--store` in a directory that does not exist (or a server that refuses) printed a
    traceback through trio and open_runtime; it is one `error:` line and exit 1, as a bind
    address in use is."""
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "chat_service.py"), "--store",
         str(tmp_path / "missing" / "chat.db"), "--bind", "127.0.0.1:0"],
        capture_output=True, text=True, env=_env(), timeout=DEADLINE,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    [line] = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert "cannot open" in line and "missing" in line, line


def test_a_bind_address_in_use_is_one_line_and_exit_1(tmp_path: Path) -> None:
    """The web process started on a port another process listens on says so in one line
    and exits 1. Found by the last audit: it printed hypercorn's nested exception-group
    traceback (four levels) ending in "OSError: [Errno 98] Address already in use"."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        bind = f"127.0.0.1:{taken.getsockname()[1]}"
        done = subprocess.run(
            [sys.executable, str(EXAMPLES / "chat_service.py"), "--store",
             str(tmp_path / "chat.db"), "--bind", bind],
            capture_output=True, text=True, env=_env(), timeout=DEADLINE,
        )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    [line] = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert line.startswith(f"error: cannot listen on {bind}: ") and "in use" in line, line


async def transcript(client: httpx.AsyncClient, session: str) -> list[dict[str, Any]]:
    response = await client.get(f"/sessions/{session}/transcript")
    assert response.status_code == 200, response.text
    messages: list[dict[str, Any]] = response.json()
    return messages


def text_of(message: dict[str, Any]) -> str:
    return "".join(part["text"] for part in message["data"]["parts"] if part["type"] == "text")


async def until_answers(
    client: httpx.AsyncClient, service: Service, session: str, count: int, *, started: bool = False
) -> list[dict[str, Any]]:
    """The transcript once it holds `count` finished assistant messages (or, `started`, once
    its newest assistant message has a few words)."""
    with trio.move_on_after(DEADLINE):
        while True:
            messages = await transcript(client, session)
            answers = [m for m in messages if m["role"] == "assistant"]
            if started and answers and len(text_of(answers[-1]).split()) >= 4:
                return messages
            if not started and sum(m["data"]["finished"] for m in answers) >= count:
                return messages
            await trio.sleep(POLL)
    pytest.fail(f"session {session}: no answer in {DEADLINE}s\n{service.output()}")


def long_question(tag: str, words: int = WORDS) -> str:
    return " ".join(f"{tag}{n}" for n in range(words))


async def post(client: httpx.AsyncClient, session: str, text: str, **headers: str) -> str:
    response = await client.post(
        f"/sessions/{session}/messages", json={"text": text}, headers=headers
    )
    assert response.status_code == 202, response.text
    input_id: str = response.json()["input_id"]
    return input_id


async def test_concurrent_users_each_get_their_answer(service: Service) -> None:
    """Eight users post at once; each session's transcript ends with its own full answer,
    and a retried post with the same Idempotency-Key is stored once."""

    async def user(client: httpx.AsyncClient, n: int) -> None:
        first = await post(
            client, f"user-{n}", f"question number {n}", **{"Idempotency-Key": f"k{n}"}
        )
        assert (
            await post(client, f"user-{n}", f"question number {n}", **{"Idempotency-Key": f"k{n}"})
            == first
        )
        messages = await until_answers(client, service, f"user-{n}", 1)
        assert [m["role"] for m in messages] == ["user", "assistant"]
        assert messages[1]["data"] == {
            "parts": [{"type": "text", "text": f"You said: question number {n}"}],
            "finished": True,
            "error": None,
        }

    async with (
        httpx.AsyncClient(base_url=service.url, timeout=5) as client,
        trio.open_nursery() as nursery,
    ):
        for n in range(8):
            nursery.start_soon(user, client, n)


Event = dict[str, Any]
View = dict[int, dict[str, Any]]


def view_of(messages: list[dict[str, Any]]) -> View:
    return {m["seq"]: {"role": m["role"], "data": m["data"]} for m in messages}


async def _get_events(
    url: str, session: str, last_event_id: str | None = None
) -> trio.SocketStream:
    """A plain TCP stream (an SSE client is a socket reader) that sent GET /events for
    `session`, with `Last-Event-ID` when given."""
    address = httpx.URL(url)
    assert address.host and address.port
    stream = await trio.open_tcp_stream(address.host, address.port)
    request = f"GET /sessions/{session}/events HTTP/1.1\r\nHost: {address.host}\r\n"
    if last_event_id is not None:
        request += f"Last-Event-ID: {last_event_id}\r\n"
    await stream.send_all((request + "\r\n").encode())
    return stream


async def read_events(
    url: str,
    session: str,
    responded: trio.Event,
    *,
    until: Any,
    last_event_id: str | None = None,
) -> tuple[bytes, list[tuple[str, Event]]]:
    """GET /events on a plain TCP stream (an SSE client is a socket reader), sending
    `Last-Event-ID` when given: the response head (`responded` is set when it arrives) and
    the (id, event) pairs up to the first for which `until(events)` holds; then the
    connection is dropped."""
    async with await _get_events(url, session, last_event_id) as stream:
        received = b""
        while True:
            chunk = await stream.receive_some()
            assert chunk, f"the event stream ended early: {received!r}"
            received += chunk
            head, blank, body = received.partition(b"\r\n\r\n")
            if blank:
                responded.set()
            events = [
                (ident.decode(), json.loads(data))
                for ident, data in re.findall(rb"id: (\S+)\ndata: (.*)\n\n", body)
            ]
            for n in range(1, len(events) + 1):
                if until(events[:n]):
                    return head, events[:n]


def answered(
    events: list[tuple[str, Event]], before: list[tuple[str, Event]] | None = None
) -> bool:
    """Whether the newest assistant message of the events (after `before`) is finished."""
    view: View = {}
    for _, event in (before or []) + events:
        apply_event(view, event)
    answers = [m for m in view.values() if m["role"] == "assistant"]
    return bool(answers) and answers[-1]["data"]["finished"]


async def transcript_now(service: Service, session: str) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(base_url=service.url, timeout=5) as client:
        return await transcript(client, session)


async def test_an_idle_event_stream_sends_a_keep_alive_comment(service: Service) -> None:
    """An event stream with nothing to send writes an SSE comment every `CHAT_KEEP_ALIVE`
    seconds (0.2 here), so a proxy does not cut it as idle (nginx: after 60 s) and a
    client gone without closing is noticed. It was silent (found by an audit)."""
    async with await _get_events(service.url, "idle") as stream:
        received = b""
        with trio.fail_after(5):
            while received.count(b": keep-alive\n\n") < 2:
                chunk = await stream.receive_some()
                assert chunk, f"the event stream ended early: {received!r}"
                received += chunk
    assert b"data:" not in received  # nothing happened in the session: comments only


async def test_the_event_stream_delivers_the_answer_as_resumable_events(service: Service) -> None:
    """GET /events streams the user message, then the answer: the new message, one "append"
    per word, the finish; every event has an `id:` (its cursor), and applying the events
    gives exactly the stored transcript."""
    question = long_question("s", 30)
    responded = trio.Event()
    result: list[tuple[bytes, list[tuple[str, Event]]]] = []

    async def listen() -> None:
        result.append(await read_events(service.url, "sse", responded, until=answered))

    with trio.fail_after(DEADLINE):
        async with (
            httpx.AsyncClient(base_url=service.url, timeout=5) as client,
            trio.open_nursery() as nursery,
        ):
            nursery.start_soon(listen)
            await responded.wait()
            await post(client, "sse", question)
        stored = await transcript_now(service, "sse")
    [(head, events)] = result
    assert head.startswith(b"HTTP/1.1 200") and b"text/event-stream" in head
    first = events[0][1]
    assert (first["kind"], first["role"], first["data"]) == ("message", "user", {"text": question})
    appends = [event for _, event in events if event["kind"] == "append"]
    assert len(appends) >= 2, events  # streamed: word by word, not one snapshot
    # Words appended after the new message's first read, each by itself.
    assert f"You said: {question}".endswith("".join(e["data"] for e in appends))
    assert len({ident for ident, _ in events}) == len(events)
    view: View = {}
    for _, event in events:
        apply_event(view, event)
    assert view == view_of(stored)


async def test_a_dropped_event_stream_resumes_with_last_event_id(service: Service) -> None:
    """An SSE connection dropped mid-answer and reopened with `Last-Event-ID` (what a
    browser's EventSource does) continues with exactly the events after that id - no word
    twice, none lost: the client's copy ends equal to the stored transcript, the answer's
    text exactly the stored text."""
    question = long_question("d", 60)
    responded = trio.Event()
    first: list[tuple[str, Event]] = []

    def some_words(events: list[tuple[str, Event]]) -> bool:
        return sum(1 for _, event in events if event["kind"] == "append") >= 5

    async def listen() -> None:
        first.extend((await read_events(service.url, "drop", responded, until=some_words))[1])

    with trio.fail_after(DEADLINE):
        async with (
            httpx.AsyncClient(base_url=service.url, timeout=5) as client,
            trio.open_nursery() as nursery,
        ):
            nursery.start_soon(listen)
            await responded.wait()
            await post(client, "drop", question)
        # Dropped mid-answer: the worker is still streaming.
        assert not answered(first)
        _, second = await read_events(
            service.url,
            "drop",
            trio.Event(),
            until=functools.partial(answered, before=first),
            last_event_id=first[-1][0],
        )
        stored = await transcript_now(service, "drop")
    assert not {ident for ident, _ in second} & {ident for ident, _ in first}
    view: View = {}
    for _, event in first + second:
        apply_event(view, event)
    assert view == view_of(stored)
    answer = [m for m in stored if m["role"] == "assistant"][-1]
    assert text_of(answer) == f"You said: {question}"
    assert "".join(p["text"] for p in view[answer["seq"]]["data"]["parts"]) == text_of(answer)


async def test_a_message_sent_while_answering_follows_its_on_busy(service: Service) -> None:
    """POST with on_busy: "reject" while an answer streams is a 409 and stores nothing;
    "interrupt" stops that answer ("interrupted") and the next answer is to the new message."""
    async with httpx.AsyncClient(base_url=service.url, timeout=5) as client:
        await post(client, "busy", long_question("b"))
        await until_answers(client, service, "busy", 0, started=True)
        response = await client.post(
            "/sessions/busy/messages", json={"text": "no", "on_busy": "reject"}
        )
        assert response.status_code == 409, response.text
        response = await client.post(
            "/sessions/busy/messages", json={"text": "stop and answer this", "on_busy": "interrupt"}
        )
        assert response.status_code == 202, response.text
        messages = await until_answers(client, service, "busy", 2)
    cut, answer = (m for m in messages if m["role"] == "assistant")
    assert cut["data"]["error"] == "interrupted"
    assert text_of(answer) == "You said: stop and answer this"
    assert [m["data"] for m in messages if m["role"] == "user"][1:] == [
        {"text": "stop and answer this"}
    ]


async def test_stop_withdraws_a_message_not_picked_up_and_interrupts_one_being_answered(
    service: Service,
) -> None:
    """Stop on a message still queued behind a running answer withdraws it (never
    answered, not in the transcript); Stop on the message being answered interrupts the
    answer. Another conversation's Stop cannot withdraw it (the session id is the
    example's only access control), and an Idempotency-Key is one per conversation: the
    same key in another conversation is another message, and no error names this one."""
    async with httpx.AsyncClient(base_url=service.url, timeout=5) as client:
        answering = await post(client, "halt", long_question("h"))
        await until_answers(client, service, "halt", 0, started=True)
        queued = await post(client, "halt", "never mind", **{"Idempotency-Key": "k1"})
        elsewhere = await post(client, "elsewhere", "hi", **{"Idempotency-Key": "k1"})
        assert elsewhere != queued
        response = await client.post("/sessions/elsewhere/stop", json={"input_id": queued})
        assert response.status_code == 400, response.text
        assert "halt" not in response.text
        response = await client.post("/sessions/halt/stop", json={"input_id": queued})
        assert response.json() == {"stopped": "withdrawn"}
        response = await client.post("/sessions/halt/stop", json={"input_id": answering})
        assert response.json() == {"stopped": "interrupted"}
        await until_answers(client, service, "halt", 1)
        await trio.sleep(0.5)  # a withdrawn message would be answered by now
        messages = await transcript(client, "halt")
    assert [m["role"] for m in messages] == ["user", "assistant"]
    assert messages[1]["data"]["error"] == "interrupted"


async def test_edit_regenerates_and_delete_erases_the_conversation(service: Service) -> None:
    """POST /edit replaces a user message and regenerates the answer from there (409 while
    an answer runs); DELETE erases the conversation (then `deleted: false`)."""
    async with httpx.AsyncClient(base_url=service.url, timeout=5) as client:
        await post(client, "edit", "first")
        await until_answers(client, service, "edit", 1)
        await post(client, "edit", long_question("e"))
        await until_answers(client, service, "edit", 1, started=True)
        response = await client.post("/sessions/edit/edit", json={"seq": 1, "text": "x"})
        assert response.status_code == 409, response.text
        await client.post("/sessions/edit/interrupt", json={})
        await until_answers(client, service, "edit", 2)
        response = await client.post("/sessions/edit/edit", json={"seq": 3, "text": "second"})
        assert response.status_code == 202, response.text
        messages = await until_answers(client, service, "edit", 2)
        assert [(m["seq"], m["role"]) for m in messages] == [
            (1, "user"),
            (2, "assistant"),
            (3, "user"),
            (4, "assistant"),
        ]
        assert messages[2]["data"] == {"text": "second"}
        assert text_of(messages[3]) == "You said: second"
        assert (await client.delete("/sessions/edit")).json() == {"deleted": True}
        assert await transcript(client, "edit") == []
        assert (await client.delete("/sessions/edit")).json() == {"deleted": False}


async def test_bad_requests_get_a_4xx_and_store_nothing(service: Service) -> None:
    """A body that is not {"text": ...}, a session id over 200 characters (also for the event
    stream) and an unknown path are refused with a JSON error; nothing is stored."""
    long_id = "x" * 201
    async with httpx.AsyncClient(base_url=service.url, timeout=5) as client:
        for path, body in [
            ("/sessions/bad/messages", b"not json"),
            ("/sessions/bad/messages", b'{"text": 1}'),
            (f"/sessions/{long_id}/messages", b'{"text": "hi"}'),
        ]:
            response = await client.post(path, content=body, headers=JSON)
            assert response.status_code == 400, response.text
            assert "error" in response.json()
        assert (await client.get(f"/sessions/{long_id}/events")).status_code == 400
        assert (await client.get("/sessions/bad/nothing")).status_code == 404
        assert (await client.get("/sessions/bad/messages")).status_code == 405
        assert await transcript(client, "bad") == []


async def test_a_head_probe_of_health_answers_as_get_does_without_a_body(service: Service) -> None:
    """Load balancers probe with HEAD: `HEAD /health` answered 404 (only GET was routed), so
    a balancer probing that way took a healthy process out. It answers as GET does - the
    status and headers, its Content-Length the GET body's - with no body. Found by the
    audit (audM55)."""
    async with httpx.AsyncClient(base_url=service.url, timeout=5) as client:
        got = await client.get("/health")
        head = await client.head("/health")
    assert (got.status_code, head.status_code) == (200, 200), head
    assert head.content == b""
    assert head.headers["content-type"] == got.headers["content-type"] == "application/json"
    assert int(head.headers["content-length"]) == len(got.content)


async def test_an_interrupt_mid_answer_ends_that_answer_interrupted(service: Service) -> None:
    """POST /interrupt while a worker streams an answer: the answer ends 'interrupted' after
    a few words, and the session answers the next message normally (not the cut one)."""
    async with httpx.AsyncClient(base_url=service.url, timeout=5) as client:
        await post(client, "stop", long_question("w"))
        await until_answers(client, service, "stop", 0, started=True)
        response = await client.post("/sessions/stop/interrupt", json={})
        assert response.json() == {"accepted": True}
        messages = await until_answers(client, service, "stop", 1)
        cut = messages[-1]["data"]
        assert cut["finished"] and cut["error"] == "interrupted"
        assert len(text_of(messages[-1]).split()) < WORDS
        await post(client, "stop", "and now?")
        messages = await until_answers(client, service, "stop", 2)
        assert text_of(messages[-1]) == "You said: and now?"
        assert messages[-1]["data"]["error"] is None


LIVE_STREAMS = 50


async def test_fifty_live_event_streams_each_get_their_own_answer(service: Service) -> None:
    """Fifty SSE connections held open on the one web process at once (DESIGN §6.26: many
    live streams), then a message posted to each session: every POST is answered 202 while
    the fifty streams stay open, and every stream delivers exactly its own session's
    question and streamed answer, ending equal to the stored transcript."""
    streams: dict[str, tuple[bytes, list[tuple[str, Event]]]] = {}
    sessions = [f"live-{n}" for n in range(LIVE_STREAMS)]

    async def listen(session: str, responded: trio.Event) -> None:
        streams[session] = await read_events(service.url, session, responded, until=answered)

    with trio.fail_after(DEADLINE * 2):
        async with (
            httpx.AsyncClient(base_url=service.url, timeout=DEADLINE) as client,
            trio.open_nursery() as nursery,
        ):
            for session in sessions:
                responded = trio.Event()
                nursery.start_soon(listen, session, responded)
                await responded.wait()  # every stream is open before the first post
            async with trio.open_nursery() as posts:
                for session in sessions:
                    posts.start_soon(post, client, session, f"hello from {session}")
        stored = {session: await transcript_now(service, session) for session in sessions}
    assert sorted(streams) == sorted(sessions)
    for session, (head, events) in streams.items():
        assert head.startswith(b"HTTP/1.1 200"), head
        view: View = {}
        for _, event in events:
            apply_event(view, event)
        assert view == view_of(stored[session]), session
        question, answer = (view[seq] for seq in sorted(view))
        assert question == {"role": "user", "data": {"text": f"hello from {session}"}}
        assert text_of(answer) == f"You said: hello from {session}"


async def test_the_load_script_sees_every_chat_answered(service: Service) -> None:
    """`examples/chat_load.py` (the 200-stream measurement of the README) against the
    service: each chat's stream opened, its POST answered 202, its first word and its
    finished answer seen, and the summary line says so. Its answers are the issue's trial's
    40 words by default."""
    chat_load = load_example("chat_load")
    everyone = await chat_load.run(service.url, 20, 0.2, DEADLINE)
    assert [chat.error for chat in everyone] == [None] * 20, service.output()
    assert all(chat.answered and chat.first_word_at is not None for chat in everyone)
    assert all(chat.post_ms is not None and chat.post_ms > 0 for chat in everyone)
    assert chat_load.summary(everyone).endswith(" errors=0")
    async with httpx.AsyncClient(base_url=service.url, timeout=5) as client:
        messages = await until_answers(client, service, everyone[0].session, 1)
    answer = next(m for m in messages if m["role"] == "assistant")
    assert len(text_of(answer).split()) == chat_load.ANSWER_WORDS == 40


async def test_a_worker_killed_mid_answer_is_completed_by_the_other(service: Service) -> None:
    """SIGKILL the worker streaming an answer: after its lease, the other worker resumes the
    drain, which finds the question in the transcript and answers it in full."""
    question = long_question("k")
    async with httpx.AsyncClient(base_url=service.url, timeout=5) as client:
        await post(client, "kill", question)
        await until_answers(client, service, "kill", 0, started=True)
        [(owner,)] = query(
            service.db, "SELECT owner_id FROM session_execution WHERE session_id = 'kill'"
        )
        name = str(owner).split("@")[0]
        victim = service.workers[name]
        victim.kill()
        victim.wait(timeout=DEADLINE)
        messages = await until_answers(client, service, "kill", 2)
    cut, answer = (m for m in messages if m["role"] == "assistant")
    assert cut["data"]["error"] == "interrupted: owner lost"
    assert len(text_of(cut).split()) < WORDS + 2
    assert answer["data"]["error"] is None
    assert text_of(answer) == f"You said: {question}"
    assert answer["execution_id"] != cut["execution_id"]
    survivor = next(p for n, p in service.workers.items() if n != name)
    assert survivor.poll() is None, service.output()


async def test_health_is_a_503_while_the_postgresql_store_does_not_answer(
    pg_url: str, pg_schema: str, tmp_path: Path
) -> None:
    """The web process on PostgreSQL, through a proxy that then hangs (a frozen server, a
    stuck pooler: nothing answers, nothing is refused): `/health`, 200 before, is a JSON
    503 with Retry-After within `HEALTH_TIMEOUT` - a load balancer stops sending it chats
    it cannot store - and a post is a 503 too. It answered 200 once the runtime was open,
    whatever the store did. Found by audit (audB54)."""
    from test_worker import HangingProxy

    chat = load_example("chat_service")
    logs = tmp_path / "logs"
    logs.mkdir()
    proxy = HangingProxy.to(pg_url)
    async with trio.open_nursery() as nursery:
        await proxy.serve(nursery)
        web = _spawn(
            [sys.executable, str(EXAMPLES / "chat_service.py"), "--store", proxy.url(pg_url),
             "--schema", pg_schema, "--bind", "127.0.0.1:0"],
            logs / "web.log",
        )  # fmt: skip
        try:
            url = await trio.to_thread.run_sync(
                _wait_for, lambda: _listening(logs / "web.log"), "the web process", logs
            )
            async with httpx.AsyncClient(base_url=url, timeout=DEADLINE) as client:
                assert (await client.get("/health")).status_code == 200
                proxy.stall()
                # Answered at the timeout, not when the hung read gives up (25 s).
                with trio.fail_after(chat.HEALTH_TIMEOUT + 3):
                    health = await client.get("/health")
                assert health.status_code == 503, health.text
                assert int(health.headers["retry-after"]) > 0
                assert health.json()["ok"] is False and "store" in health.json()["error"]
                assert "127.0.0.1" not in health.text  # the server's name is the log's
        finally:
            web.send_signal(signal.SIGKILL)  # its store hangs: no graceful stop to wait for
            await trio.to_thread.run_sync(web.wait)
            nursery.cancel_scope.cancel()
    assert "health probe: the store did not answer" in (logs / "web.log").read_text()
