"""The chat service through restarts and crashes while its chats stream, as an operator
runs it: one web process and two workers (`examples/chat_service.py`, `python -m
trio_sessions worker`), on an SQLite file and on PostgreSQL, twenty chats each holding an
event stream (SSE) while a worker streams its answer - then one worker is stopped
(SIGTERM: its claims handed back), killed (SIGKILL), the web process restarted (the
clients reconnect with `Last-Event-ID`), or both workers restarted one after the other.

Per chat: the answer completes; what the client assembled from its stream, reconnects
included, is the stored transcript, with no event twice and no word twice or missing in an
answer; no two drains of a session ran at once and none started but for a takeover; the
takeover came from the hand-back (SIGTERM) or the liveness token (SIGKILL), far within the
30 s lease; nothing is left claimed, woken or pending; the web process answered POSTs
throughout; no log holds a traceback, an error or a warning.

Real processes killed for real; every wait is for an observable condition, with a
deadline. The drain is the example's, wrapped to log each start and end (a line each).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio
from backends import PgLocation, rows
from helpers import apply_event

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
CHATS = 20
WORD_DELAY = 0.05
DEADLINE = 60.0  # seconds for a whole scenario's answers (a loaded 2-core host)
LEASE = 30.0  # the workers' default: every takeover here comes long before it
PROBE = '''
"""chat_service.drain, logging each drain's start and end as a JSON line."""
import json, os, time
import chat_service

def _log(**fields):
    with open(os.environ["CHAT_PROBE_LOG"], "a") as out:
        out.write(json.dumps(fields) + "\\n")

async def drain(ctx):
    ids = dict(session=ctx.session_id, execution=ctx.execution_id, pid=os.getpid())
    _log(event="start", t=time.time(), resumed=ctx.resumed, attempt=ctx.attempt, **ids)
    try:
        await chat_service.drain(ctx)
    finally:
        _log(event="end", t=time.time(), **ids)
'''

pytestmark = [pytest.mark.slow, pytest.mark.serial]

Event = dict[str, Any]


@pytest.fixture(params=["sqlite", "postgres"])
def location(request: pytest.FixtureRequest, tmp_path: Path) -> Path | PgLocation:
    if request.param == "postgres":
        return PgLocation(request.getfixturevalue("pg_url"), request.getfixturevalue("pg_schema"))
    return tmp_path / "chat.db"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@attrs.define
class Service:
    """The web process (on a fixed port, so a restarted one is where clients reconnect)
    and the workers by name, each with a log per start."""

    location: Path | PgLocation
    root: Path
    port: int = attrs.field(factory=_free_port)
    processes: dict[str, subprocess.Popen[bytes]] = attrs.field(factory=dict)
    stopped: list[subprocess.Popen[bytes]] = attrs.field(factory=list)
    starts: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def probe(self) -> Path:
        return self.root / "drains.jsonl"

    def _store(self) -> list[str]:
        if isinstance(self.location, PgLocation):
            return ["--store", self.location.url, "--schema", self.location.schema]
        return ["--store", str(self.location)]

    def _spawn(self, name: str, args: list[str], ready: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TRIO_SESSIONS_")}
        env["PYTHONPATH"] = os.pathsep.join([str(self.root), str(EXAMPLES)])
        env.update(CHAT_WORD_DELAY=str(WORD_DELAY), CHAT_PROBE_LOG=str(self.probe))
        self.starts += 1
        log = self.root / f"{name}.{self.starts}.log"
        with log.open("wb") as out:
            process = subprocess.Popen(
                [sys.executable, *args], stdout=out, stderr=subprocess.STDOUT, env=env
            )
        self.processes[name] = process
        deadline = time.monotonic() + DEADLINE / 2
        while ready not in log.read_text():
            assert process.poll() is None, self.output()
            assert time.monotonic() < deadline, f"{name} never logged {ready!r}\n{self.output()}"
            time.sleep(0.05)

    def web(self) -> None:
        bind = f"127.0.0.1:{self.port}"
        args = [str(EXAMPLES / "chat_service.py"), *self._store(), "--bind", bind]
        self._spawn("web", args, "chat service listening")

    def worker(self, name: str) -> None:
        args = ["-m", "trio_sessions", "worker", "probe:drain", *self._store(), "--owner", name]
        self._spawn(name, args, "worker started")

    async def stop(self, name: str, how: signal.Signals = signal.SIGTERM) -> int:
        process = self.processes[name]
        process.send_signal(how)
        if how == signal.SIGTERM:
            self.stopped.append(process)
        return await trio.to_thread.run_sync(process.wait)

    def busiest(self) -> str:
        """The worker running the most drains now (the one whose stop cuts most answers)."""
        running: dict[str, int] = {}
        for line in self.drains():
            running[line["execution"]] = line["pid"] if line["event"] == "start" else 0
        pids = [pid for pid in running.values() if pid]
        busiest = max(set(pids), key=pids.count)
        return next(name for name, p in self.processes.items() if p.pid == busiest)

    def drains(self) -> list[dict[str, Any]]:
        if not self.probe.exists():
            return []
        return [json.loads(line) for line in self.probe.read_text().splitlines()]

    def output(self) -> str:
        logs = sorted(self.root.glob("*.log"))
        return "\n".join(f"--- {log.name}\n{log.read_text()}" for log in logs)


@pytest.fixture
def service(location: Path | PgLocation, tmp_path: Path) -> Iterator[Service]:
    (tmp_path / "probe.py").write_text(PROBE)
    started = Service(location, tmp_path)
    try:
        started.web()
        started.worker("wa")
        started.worker("wb")
        yield started
    finally:
        for process in started.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                started.stopped.append(process)
        for process in started.processes.values():
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    # Every process stopped by SIGTERM - in the scenario or here - exited 0.
    assert [process.returncode for process in started.stopped] == [0] * len(started.stopped), (
        started.output()
    )


def text_of(data: dict[str, Any]) -> str:
    return "".join(part["text"] for part in data["parts"] if part["type"] == "text")


@attrs.define
class Chat:
    """One user: the question, and the events its stream delivered (across reconnects)."""

    n: int
    words: int
    events: list[tuple[str, Event]] = attrs.field(factory=list)
    connections: int = 0
    listening: trio.Event = attrs.field(factory=trio.Event)
    answered: trio.Event = attrs.field(factory=trio.Event)

    @property
    def session(self) -> str:
        return f"chat-{self.n}"

    @property
    def question(self) -> str:
        return " ".join(f"q{self.n}w{k}" for k in range(self.words))

    def view(self) -> dict[int, Any]:
        view: dict[int, Any] = {}
        for _, event in self.events:
            apply_event(view, event)
        return view

    def done(self) -> bool:
        answers = [m["data"] for m in self.view().values() if m["role"] == "assistant"]
        return bool(answers) and answers[-1]["finished"] and answers[-1]["error"] is None

    async def follow(self, port: int) -> None:
        """Hold the event stream, as `EventSource` does: on a dropped connection (the web
        process restarting) reconnect with `Last-Event-ID`, retrying while it is down."""
        while not self.answered.is_set():
            try:
                stream = await trio.open_tcp_stream("127.0.0.1", port)
            except OSError:
                await trio.sleep(0.1)  # the client's retry interval, not a settling wait
                continue
            async with stream:
                await self._read(stream)

    async def _read(self, stream: trio.SocketStream) -> None:
        request = f"GET /sessions/{self.session}/events HTTP/1.1\r\nHost: chat\r\n"
        if self.events:
            request += f"Last-Event-ID: {self.events[-1][0]}\r\n"
        try:
            await stream.send_all((request + "\r\n").encode())
            received, body = b"", False
            while chunk := await stream.receive_some():
                received += chunk
                if not body:
                    head, body_starts, rest = received.partition(b"\r\n\r\n")
                    if not body_starts:
                        continue
                    assert head.startswith(b"HTTP/1.1 200"), head
                    received, body = rest, True
                    self.connections += 1
                    self.listening.set()
                # Complete events only (the rest waits for its next bytes); the chunked
                # encoding's size lines and keep-alive comments fall between them.
                end = received.rfind(b"\n\n")
                if end < 0:
                    continue
                for ident, data in re.findall(rb"id: (\S+)\ndata: (.*)\n\n", received[: end + 2]):
                    self.events.append((ident.decode(), json.loads(data)))
                received = received[end + 2 :]
                if self.done():
                    self.answered.set()
                    return
        except (trio.BrokenResourceError, OSError):
            pass  # the web process went away: reconnect


async def post(client: httpx.AsyncClient, session: str, text: str) -> float:
    """POST a message; how long the web process took to answer 202 (seconds)."""
    began = time.monotonic()
    response = await client.post(f"/sessions/{session}/messages", json={"text": text})
    assert response.status_code == 202, response.text
    return time.monotonic() - began


async def ping(url: str, took: list[float]) -> None:
    """Another user posting a short message every 50 ms throughout (not while the web
    process is down): how long each POST took."""
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        for k in range(10**9):
            with contextlib.suppress(httpx.TransportError):  # the web process restarting
                took.append(await post(client, f"ping-{k}", "ping"))
            await trio.sleep(0.05)


Disruption = Callable[[Service], Awaitable[None]]


@attrs.frozen
class Run:
    chats: list[Chat]
    stored: dict[str, list[dict[str, Any]]]
    disrupted_at: float
    posts: list[float]


async def run_chats(service: Service, disrupt: Disruption, words: int) -> Run:
    """Twenty chats streaming; once each answer has streamed a few words, `disrupt`; then
    every answer is awaited (bounded) and the stored transcripts read."""
    chats = [Chat(n, words) for n in range(CHATS)]
    posts: list[float] = []
    with trio.fail_after(DEADLINE):
        async with (
            httpx.AsyncClient(base_url=service.url, timeout=10) as client,
            trio.open_nursery() as nursery,
        ):
            for chat in chats:
                nursery.start_soon(chat.follow, service.port)
                await chat.listening.wait()  # every stream open before the first POST
            async with trio.open_nursery() as posting:
                for chat in chats:
                    posting.start_soon(post, client, chat.session, chat.question)

            def streaming() -> bool:
                return all(
                    sum(event["kind"] == "append" for _, event in chat.events) >= 4
                    for chat in chats
                )

            while not streaming():
                await trio.sleep(0.02)
            nursery.start_soon(ping, service.url, posts)
            disrupted_at = time.time()
            await disrupt(service)
            for chat in chats:
                await chat.answered.wait()
            nursery.cancel_scope.cancel()
        stored = {}
        async with httpx.AsyncClient(base_url=service.url, timeout=10) as client:
            for chat in chats:
                response = await client.get(f"/sessions/{chat.session}/transcript")
                stored[chat.session] = response.json()
    return Run(chats, stored, disrupted_at, posts)


def check_chats(service: Service, run: Run, *, cuts: int, counted: int = 0) -> list[float]:
    """The per-chat checks (the module's docstring); each chat's answer cut at most `cuts`
    times, and each resume counted `counted` (`ctx.attempt`: a crash counts, a hand-back
    does not - a rolling restart is no crash loop). The takeover delays, from the
    disruption to each resumed drain's start."""
    drains = service.drains()
    takeovers = []
    for chat in run.chats:
        stored = run.stored[chat.session]
        assert chat.view() == {m["seq"]: {"role": m["role"], "data": m["data"]} for m in stored}
        ids = [ident for ident, _ in chat.events]
        assert len(set(ids)) == len(ids), chat.session
        answer = f"You said: {chat.question}"
        answers = [m["data"] for m in stored if m["role"] == "assistant"]
        assert text_of(answers[-1]) == answer and answers[-1]["error"] is None, chat.session
        # Every answer cut short is the start of the answer: no word twice or missing.
        for cut in answers[:-1]:
            assert answer.startswith(text_of(cut)), (chat.session, text_of(cut))
            assert cut["error"] == "interrupted: owner lost", cut
        assert len(answers) <= 1 + cuts, (chat.session, answers)
        # A resumed answer goes on from its cut: its first write holds the cut's words,
        # which the user saw once (the chat page shows it in the cut's place).
        seqs = [m["seq"] for m in stored if m["role"] == "assistant"]
        for cut, resumed in itertools.pairwise(seqs):
            # (A cut that held every word: the resumed answer's message, then its finish.)
            first = [
                event
                for _, event in chat.events
                if event["seq"] == resumed and event["kind"] in ("message", "append")
            ][:2]
            shown = "".join(
                text_of(event["data"]) if event["kind"] == "message" else event["data"]
                for event in first
            )
            assert shown.startswith(text_of(chat.view()[cut]["data"])), (chat.session, first)
        # Drains: one per answer, a resumed one per cut, never two at once (a killed
        # drain logs no end: its process was gone before the takeover).
        mine = [line for line in drains if line["session"] == chat.session]
        starts = [line for line in mine if line["event"] == "start"]
        assert len(starts) == len(answers), (chat.session, mine)
        assert [line["resumed"] for line in starts] == [False] + [True] * (len(starts) - 1)
        assert [line["attempt"] for line in starts] == [0] + [counted] * (len(starts) - 1)
        ends = {line["execution"]: line["t"] for line in mine if line["event"] == "end"}
        for before, after in itertools.pairwise(starts):
            assert ends.get(before["execution"], 0.0) <= after["t"], (chat.session, mine)
            takeovers.append(after["t"] - run.disrupted_at)
    # The web process answered other users' POSTs throughout (none held up for long).
    assert run.posts and max(run.posts) < 1.0, sorted(run.posts)[-5:]
    return takeovers


def check_settled(service: Service) -> None:
    """Nothing stays claimed, recovering, woken or pending, and no resume was counted
    against a session once it finished (the pings' answers end soon after the chats')."""
    deadline = time.monotonic() + 15
    settled = (0, 0, 0, 0, 0)
    while (
        found := rows(
            service.location,
            "SELECT (SELECT COUNT(*) FROM session_execution),"
            " (SELECT COUNT(*) FROM session_recovery),"
            " (SELECT COUNT(*) FROM session WHERE time_woken IS NOT NULL),"
            " (SELECT COUNT(*) FROM session_input),"
            " (SELECT COUNT(*) FROM session WHERE wake_attempts > 0)",
        )[0]
    ) != settled:
        assert time.monotonic() < deadline, f"left: {found}\n{service.output()}"
        time.sleep(0.05)
    noise = re.compile(r"Traceback|ERROR|WARNING|CRITICAL")
    assert not noise.search(service.output()), service.output()


# PostgreSQL only: on SQLite the rolling restart below stops a worker as this does.
@pytest.mark.parametrize("location", ["postgres"], indirect=True)
async def test_a_stopped_worker_s_chats_go_on_at_once_on_the_other(service: Service) -> None:
    """SIGTERM the worker streaming the most answers: it exits 0 at once, its claims handed
    back, and the other worker resumes every cut answer within about a signal - well
    inside the takeover grace a dead owner's claims wait out, and the 30 s lease."""

    async def stop(service: Service) -> None:
        assert await service.stop(service.busiest()) == 0

    run = await run_chats(service, stop, 40)
    takeovers = check_chats(service, run, cuts=1)
    assert takeovers and max(takeovers) < 2.0, sorted(takeovers)
    check_settled(service)


# PostgreSQL only: on SQLite test_chat_service kills a worker mid-answer.
@pytest.mark.parametrize("location", ["postgres"], indirect=True)
async def test_a_killed_worker_s_chats_go_on_about_a_second_later(service: Service) -> None:
    """SIGKILL the worker streaming the most answers: the other worker resumes every cut
    answer once the dead one's liveness token stayed free for the grace (about a second),
    not after the 30 s lease; each resume counts against `max_resumes`."""

    async def kill(service: Service) -> None:
        assert await service.stop(service.busiest(), signal.SIGKILL) == -signal.SIGKILL

    run = await run_chats(service, kill, 40)
    takeovers = check_chats(service, run, cuts=1, counted=1)
    assert takeovers and max(takeovers) < LEASE / 6, sorted(takeovers)
    check_settled(service)


# SQLite only: the web process reads either backend through the same stream().
@pytest.mark.parametrize("location", ["sqlite"], indirect=True)
async def test_a_restarted_web_process_s_streams_resume_where_they_were(
    service: Service,
) -> None:
    """Restart the web process while every client holds a stream: the streams are cut
    (after hypercorn's 2 s grace), each client reconnects with `Last-Event-ID` to the new
    process and gets exactly what it missed; no answer is disturbed."""

    async def restart(service: Service) -> None:
        assert await service.stop("web") == 0
        await trio.to_thread.run_sync(service.web)

    run = await run_chats(service, restart, 100)  # answers of 5 s: past the restart
    check_chats(service, run, cuts=0)
    assert all(chat.connections >= 2 for chat in run.chats)
    check_settled(service)


async def test_a_rolling_restart_of_both_workers_goes_unnoticed(service: Service) -> None:
    """Restart the workers one after the other (SIGTERM, start it again, then the next):
    each answer is cut at most twice and resumed each time, with nothing lost."""

    async def rolling(service: Service) -> None:
        for name in ("wa", "wb"):
            assert await service.stop(name) == 0
            await trio.to_thread.run_sync(service.worker, name)

    run = await run_chats(service, rolling, 60)
    check_chats(service, run, cuts=2)
    check_settled(service)
