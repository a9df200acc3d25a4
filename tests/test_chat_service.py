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

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
DEADLINE = 15.0  # seconds any one expected state may take (generous for a loaded CI host)
POLL = 0.05
WORDS = 100  # a long question: its streamed answer takes ~2 s, room to land mid-answer

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


async def read_events(
    url: str, session: str, responded: trio.Event
) -> tuple[bytes, list[dict[str, Any]]]:
    """GET /events on a plain TCP stream (an SSE client is a socket reader): the response
    head (`responded` is set when it arrives) and every snapshot up to the first finished
    assistant message."""
    address = httpx.URL(url)
    assert address.host and address.port
    stream = await trio.open_tcp_stream(address.host, address.port)
    async with stream:
        request = f"GET /sessions/{session}/events HTTP/1.1\r\nHost: {address.host}\r\n\r\n"
        await stream.send_all(request.encode())
        received = b""
        while True:
            chunk = await stream.receive_some()
            assert chunk, f"the event stream ended early: {received!r}"
            received += chunk
            head, blank, body = received.partition(b"\r\n\r\n")
            if blank:
                responded.set()
            snapshots = [json.loads(data) for data in re.findall(rb"data: (.*)\n\n", body)]
            if any(s["role"] == "assistant" and s["data"]["finished"] for s in snapshots):
                return head, snapshots


async def test_the_event_stream_delivers_growing_snapshots(service: Service) -> None:
    """GET /events streams the user message, then snapshots of the streamed answer in write
    order, up to the finished one."""
    question = long_question("s", 30)
    expected = f"You said: {question}"
    responded = trio.Event()
    result: list[tuple[bytes, list[dict[str, Any]]]] = []

    async def listen() -> None:
        result.append(await read_events(service.url, "sse", responded))

    with trio.fail_after(DEADLINE):
        async with (
            httpx.AsyncClient(base_url=service.url, timeout=5) as client,
            trio.open_nursery() as nursery,
        ):
            nursery.start_soon(listen)
            await responded.wait()
            await post(client, "sse", question)
    [(head, snapshots)] = result
    assert head.startswith(b"HTTP/1.1 200") and b"text/event-stream" in head
    assert snapshots[0]["role"] == "user" and snapshots[0]["data"] == {"text": question}
    texts = [text_of(s) for s in snapshots[1:]]
    assert len(texts) >= 2, texts  # streamed: at least one unfinished snapshot before the end
    assert all(expected.startswith(text) for text in texts), texts
    assert [len(t) for t in texts] == sorted(len(t) for t in texts)  # never an older state
    assert texts[-1] == expected


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
            response = await client.post(path, content=body)
            assert response.status_code == 400, response.text
            assert "error" in response.json()
        assert (await client.get(f"/sessions/{long_id}/events")).status_code == 400
        assert (await client.get("/sessions/bad/nothing")).status_code == 404
        assert (await client.get("/sessions/bad/messages")).status_code == 405
        assert await transcript(client, "bad") == []


async def test_an_interrupt_mid_answer_ends_that_answer_interrupted(service: Service) -> None:
    """POST /interrupt while a worker streams an answer: the answer ends 'interrupted' after
    a few words, and the session answers the next message normally (not the cut one)."""
    async with httpx.AsyncClient(base_url=service.url, timeout=5) as client:
        await post(client, "stop", long_question("w"))
        await until_answers(client, service, "stop", 0, started=True)
        response = await client.post("/sessions/stop/interrupt")
        assert response.json() == {"accepted": True}
        messages = await until_answers(client, service, "stop", 1)
        cut = messages[-1]["data"]
        assert cut["finished"] and cut["error"] == "interrupted"
        assert len(text_of(messages[-1]).split()) < WORDS
        await post(client, "stop", "and now?")
        messages = await until_answers(client, service, "stop", 2)
        assert text_of(messages[-1]) == "You said: and now?"
        assert messages[-1]["data"]["error"] is None


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
