"""The worker command, `python -m trio_sessions worker MODULE:DRAIN`, and `Message.to_json`.

End-to-end tests run the worker as a real subprocess on an SQLite file, with the drains of
`tests/worker_drain.py` importable through PYTHONPATH, and a producer runtime in the test
feeding it. They wait for the subprocess by polling its durable state or its log with a
bounded deadline; nothing sleeps "to let things settle".
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import trio
import worker_drain
from conftest import query

import trio_sessions
from trio_sessions import _cli, _naming, _worker
from trio_sessions._codec import encode_assistant
from trio_sessions._model import AssistantData, Message, TextPart, ToolPart

TESTS = Path(__file__).parent
DEADLINE = 20.0  # seconds a subprocess gets to reach an expected state (generous for CI)
POLL = 0.05
HELD_CLAIM = "SELECT owner_id, expires_at FROM session_execution WHERE session_id = 'held'"


def worker_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRIO_SESSIONS_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")]))
    return {**env, **extra}


class Worker:
    """A worker subprocess with its stderr (the log) in a file."""

    def __init__(self, process: trio.Process, log: Path) -> None:
        self.process = process
        self.log = log

    def output(self) -> str:
        return self.log.read_text()

    def alive(self) -> None:
        if self.process.poll() is not None:
            pytest.fail(f"worker exited early ({self.process.returncode}):\n{self.output()}")

    async def exit_status(self) -> int:
        with trio.move_on_after(DEADLINE):
            return await self.process.wait()
        pytest.fail(f"worker still running after {DEADLINE}s:\n{self.output()}")

    async def until_logged(self, text: str) -> None:
        await until(lambda: _async(text in self.output()), f"log line {text!r}", self)


async def _async(value: bool) -> bool:
    return value


async def until(check: Callable[[], Awaitable[bool]], what: str, worker: Worker) -> None:
    """Poll `check` until it holds, failing with the worker's log after `DEADLINE`."""
    with trio.move_on_after(DEADLINE):
        while not await check():
            worker.alive()
            await trio.sleep(POLL)
        return
    pytest.fail(f"timed out waiting for {what}; worker log:\n{worker.output()}")


# A worker whose reply bound (`_postgres.connections.REPLY_BOUND_S`) is this short, for the
# tests of a server that stops answering: each waits out the bound, and the suite's time
# counts (the bound's own figure is the README's, not these tests').
SHORT_REPLY_BOUND_S = 4.0
_SHORT_BOUND_MAIN = (
    "import sys; from trio_sessions._postgres import connections;"
    " connections.REPLY_BOUND_S = float(sys.argv[1]);"
    " from trio_sessions._cli import main; sys.exit(main(sys.argv[2:]))"
)


async def start_worker(
    tmp_path: Path, *args: str, reply_bound: float | None = None, **env: str
) -> Worker:
    log = tmp_path / "worker.log"
    command = ["-m", "trio_sessions"]
    if reply_bound is not None:
        command = ["-c", _SHORT_BOUND_MAIN, str(reply_bound)]
    with log.open("wb") as handle:
        process = await trio.lowlevel.open_process(
            [sys.executable, *command, "worker", *args],
            cwd=tmp_path,
            env=worker_env(**env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=handle,
        )
    return Worker(process, log)


async def stop(worker: Worker) -> None:
    if worker.process.returncode is None:
        worker.process.kill()
        await worker.process.wait()


def texts(message: Message) -> list[str]:
    return [p.text for p in message.data.parts if isinstance(p, TextPart)]


# ---------------------------------------------------------------------------------------------
# End to end


async def test_worker_replies_and_a_sigterm_hands_the_running_claim_back(
    db_path: Path, tmp_path: Path
) -> None:
    """The worker drains a producer's inputs; SIGTERM exits 0 and expires the running claim,
    so another runtime resumes it at once, long before its 30 s lease would run out."""
    async with trio_sessions.open_runtime(db_path, None) as producer:
        await producer.submit("echo", {"text": "hi"}, input_id="in-echo")
        await producer.submit("held", {"hold": True}, input_id="in-held")
        worker = await start_worker(
            tmp_path,
            "worker_drain:reply",
            *("--store", str(db_path), "--max-active", "2"),
            TRIO_SESSIONS_OWNER="env-worker",
        )
        try:

            async def replied() -> bool:
                echo = await producer.transcript("echo")
                held = await producer.transcript("held")
                answered = len(echo) == 2 and echo[1].data.finished
                return answered and len(held) == 2 and texts(held[1]) == [worker_drain.HOLDING]

            await until(replied, "the echo reply and the held drain", worker)
            [(claim_owner, expires_before)] = query(db_path, HELD_CLAIM)
            assert isinstance(claim_owner, str)
            assert isinstance(expires_before, int)
            assert claim_owner.startswith("env-worker@")
            assert expires_before > time.time() * 1000 + 20_000
            worker.process.send_signal(signal.SIGTERM)
            assert await worker.exit_status() == 0, worker.output()
        finally:
            await stop(worker)
        user, assistant = await producer.transcript("echo")

    [(owner_after, expires_at)] = query(db_path, HELD_CLAIM)
    assert owner_after == claim_owner  # kept, not finished: the work is still owed
    assert isinstance(expires_at, int)
    assert expires_at <= time.time() * 1000
    log = worker.output()
    assert f"worker started: owner {claim_owner}, store {db_path}" in log
    assert "worker stopping on SIGTERM" in log
    assert f"worker stopped: owner {claim_owner}" in log

    resumed: list[tuple[str, bool]] = []

    async def finish(ctx: trio_sessions.DrainContext) -> None:
        resumed.append((ctx.session_id, ctx.resumed))

    with trio.fail_after(DEADLINE):
        async with trio_sessions.open_runtime(db_path, finish, recovery_interval=60) as other:
            report = await other.recover_once()
            await other.wait_idle("held")
            totals = other.statistics().recovery
    # The pass that runs while open_runtime opens already found it; the explicit one has
    # nothing left to do.
    assert resumed == [("held", True)]
    assert (totals.resumed, report.resumed) == (1, 0)

    assert json.loads(json.dumps([user.to_json(), assistant.to_json()])) == [
        {
            "id": user.id,
            "session_id": "echo",
            "role": "user",
            "seq": user.seq,
            "data": {"text": "hi"},
            "execution_id": user.execution_id,
            "input_id": "in-echo",
        },
        {
            "id": assistant.id,
            "session_id": "echo",
            "role": "assistant",
            "seq": user.seq + 1,
            "data": {
                "parts": [
                    {
                        **{"type": "tool", "call_id": "call-1", "name": "echo"},
                        **{"input": {"text": "hi"}, "status": "completed"},
                        **{"output": {"echo": "hi"}, "error": None},
                    },
                    {"type": "text", "text": "echo: hi"},
                ],
                "finished": True,
                "error": None,
            },
            "execution_id": user.execution_id,
            "input_id": None,
        },
    ]


async def test_the_worker_freezes_its_start_up_heap(db_path: Path, tmp_path: Path) -> None:
    """Once its runtime is open, the worker moves what start-up made (modules, classes) out
    of the collector's reach: with 1,000 sessions in flight, full collections walking it
    were about 15 % of the CPU per session."""
    async with trio_sessions.open_runtime(db_path, None) as producer:
        worker = await start_worker(tmp_path, "worker_drain:frozen", "--store", str(db_path))
        try:
            await worker.until_logged("worker started")
            await producer.submit("gc", {}, input_id="in-gc")

            async def answered() -> bool:
                transcript = await producer.transcript("gc")
                return len(transcript) == 2 and transcript[1].data.finished

            await until(answered, "the frozen count", worker)
            [_, answer] = await producer.transcript("gc")
            assert int(texts(answer)[0]) > 10_000, worker.output()
        finally:
            await stop(worker)


@pytest.mark.parametrize(
    ("second", "status"), [(signal.SIGTERM, 1), (signal.SIGINT, 130)], ids=["TERM", "INT"]
)
async def test_a_second_signal_exits_at_once_while_a_drain_stalls_shutdown(
    db_path: Path, tmp_path: Path, second: signal.Signals, status: int
) -> None:
    """A drain that ignores cancellation stalls the graceful shutdown forever; a second
    signal ends the process at once (1 after SIGTERM, 130 after SIGINT)."""
    async with trio_sessions.open_runtime(db_path, None) as producer:
        await producer.submit("stuck", {"stubborn": True})
        worker = await start_worker(
            tmp_path, "worker_drain:reply", TRIO_SESSIONS_STORE=str(db_path)
        )
        try:

            async def stalled() -> bool:
                held = await producer.transcript("stuck")
                return len(held) == 2 and texts(held[1]) == [worker_drain.STUBBORN]

            await until(stalled, "the stubborn drain", worker)
            worker.process.send_signal(signal.SIGTERM)
            await worker.until_logged("worker stopping on SIGTERM")
            worker.alive()  # still waiting for the drain
            worker.process.send_signal(second)
            assert await worker.exit_status() == status, worker.output()
        finally:
            await stop(worker)
    assert f"worker exiting at once on a second {second.name}" in worker.output()
    assert "worker stopped" not in worker.output()


async def test_a_bad_drain_exits_1_with_a_clear_message_before_touching_the_store(
    db_path: Path, tmp_path: Path
) -> None:
    """An unimportable MODULE:DRAIN: exit 1, the reason on stderr, no database created."""
    worker = await start_worker(tmp_path, "no_such_module_here:drain", "--store", str(db_path))
    try:
        assert await worker.exit_status() == 1
    finally:
        await stop(worker)
    assert "error: cannot import module 'no_such_module_here'" in worker.output()
    assert "ModuleNotFoundError" in worker.output()
    assert not db_path.exists()  # noqa: ASYNC240 - one stat, after the process ended


async def test_a_store_that_cannot_open_exits_1_and_logs_why(tmp_path: Path) -> None:
    """A store path in a missing directory: the runtime fails to open, the worker logs the
    error and exits 1 instead of hanging."""
    worker = await start_worker(
        tmp_path, "worker_drain:reply", "--store", str(tmp_path / "missing" / "w.db")
    )
    try:
        assert await worker.exit_status() == 1
    finally:
        await stop(worker)
    assert "worker failed: StoreError" in worker.output()


class HangingProxy:
    """A TCP proxy to the PostgreSQL server that can make it hang: once stalled it forwards
    nothing more either way but keeps every connection open - a server that hangs (a frozen
    backend, a stuck pooler) while its host's kernel still acknowledges. `stall()` stalls it
    now, `stall_on(text)` the moment a client sends `text`; `drop(text)` closes the
    connections whose client sent `text` (the server or a network between lost them).
    `held`: how many connections have a client message it kept from the server since it
    stalled (calls in flight)."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.stalled = False
        self._holding: set[int] = set()
        self.port = 0
        self.trigger: bytes | None = None
        self._connections: list[tuple[trio.CancelScope, bytearray]] = []

    @classmethod
    def to(cls, url: str) -> HangingProxy:
        target = urllib.parse.urlsplit(url)
        return cls((target.hostname or "127.0.0.1", target.port or 5432))

    def url(self, url: str) -> str:
        """`url` through this proxy (it must serve first)."""
        parts = urllib.parse.urlsplit(url)
        userinfo = parts.netloc.rpartition("@")[0]
        netloc = f"{userinfo}@127.0.0.1:{self.port}" if userinfo else f"127.0.0.1:{self.port}"
        return urllib.parse.urlunsplit(parts._replace(netloc=netloc))

    @property
    def held(self) -> int:
        return len(self._holding)

    def stall(self) -> None:
        self.stalled = True

    def stall_on(self, text: bytes) -> None:
        self.trigger = text

    def drop(self, text: bytes) -> int:
        dropped = 0
        for scope, sent in self._connections:
            if text in sent and not scope.cancel_called:
                scope.cancel()
                dropped += 1
        return dropped

    async def _forward(
        self,
        source: trio.SocketStream,
        sink: trio.SocketStream,
        sent: bytearray,
        *,
        from_client: bool,
    ) -> None:
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            while data := await source.receive_some(65536):
                sent += data
                if self.trigger is not None and self.trigger in data:
                    self.stalled = True
                if self.stalled:
                    if from_client:
                        self._holding.add(id(sent))
                    await trio.sleep_forever()
                await sink.send_all(data)

    async def _handle(self, client: trio.SocketStream) -> None:
        if self.stalled:
            await trio.sleep_forever()
        server = await trio.open_tcp_stream(*self.target)
        scope, sent = trio.CancelScope(), bytearray()
        self._connections.append((scope, sent))
        with scope:
            async with client, server, trio.open_nursery() as nursery:
                forward = functools.partial(self._forward, from_client=True)
                nursery.start_soon(forward, client, server, sent)
                backward = functools.partial(self._forward, from_client=False)
                nursery.start_soon(backward, server, client, bytearray())

    async def serve(self, nursery: trio.Nursery) -> None:
        serve = functools.partial(trio.serve_tcp, host="127.0.0.1")
        [listener] = await nursery.start(serve, self._handle, 0)
        self.port = listener.socket.getsockname()[1]


# How long a worker may take to exit after SIGTERM once its server hangs: its reply bound
# (SHORT_REPLY_BOUND_S) and the shutdown, with a wide margin for a loaded machine.
EXIT_AFTER_SIGTERM_S = 30


async def _exit_status_after_sigterm_on_a_hung_server(
    pg_url: str,
    pg_schema: str,
    tmp_path: Path,
    hang: Callable[[HangingProxy, Worker], Awaitable[None]],
) -> tuple[int | None, str]:
    """Start a worker through a `HangingProxy`, `hang` the server, send SIGTERM: the exit
    status (None: still running `EXIT_AFTER_SIGTERM_S` later) and the worker's log."""
    proxy = HangingProxy.to(pg_url)
    async with trio.open_nursery() as nursery:
        await proxy.serve(nursery)
        worker = await start_worker(
            tmp_path, "worker_drain:reply", "--store", proxy.url(pg_url), "--schema",
            pg_schema, "--lease", "3", "--recovery-interval", "0.5",
            reply_bound=SHORT_REPLY_BOUND_S,
        )  # fmt: skip
        try:
            await worker.until_logged("worker started")
            await hang(proxy, worker)
            with trio.move_on_after(DEADLINE):
                while proxy.held < 2:  # store calls of the worker's in flight on two connections
                    await trio.sleep(POLL)
            assert proxy.held >= 2, worker.output()
            worker.process.send_signal(signal.SIGTERM)
            await worker.until_logged("worker stopping on SIGTERM")
            with trio.move_on_after(EXIT_AFTER_SIGTERM_S):
                await worker.process.wait()
            exited = worker.process.returncode
        finally:
            await stop(worker)
            nursery.cancel_scope.cancel()
    return exited, worker.output()


async def test_sigterm_while_the_postgres_server_hangs_still_exits(
    pg_url: str, pg_schema: str, tmp_path: Path
) -> None:
    """README "Running workers": the first SIGTERM is a graceful shutdown, then the process
    exits 0 (only a drain that does not stop may hold it up, and none runs here); DESIGN §8:
    `StoreError` reaches a caller "only after a bound". An idle worker whose PostgreSQL
    server stops answering while its TCP connections stay up never exited: each store thread
    waits in psycopg for a reply with no client-side bound (statement_timeout is the
    server's, TCP_USER_TIMEOUT and keepalives are satisfied by the kernel's ACKs), and the
    shutdown waits for those threads - until a second signal or SIGKILL."""

    async def stall(proxy: HangingProxy, worker: Worker) -> None:
        proxy.stall()

    exited, output = await _exit_status_after_sigterm_on_a_hung_server(
        pg_url, pg_schema, tmp_path, stall
    )
    assert exited is not None, f"still running after SIGTERM:\n{output}"


def _hang_as_a_reconnect_sends(sent: bytes) -> Callable[[HangingProxy, Worker], Awaitable[None]]:
    """The worker's connection that sent `sent` is lost; the server hangs just as its
    replacement sends `sent` again."""

    async def hang(proxy: HangingProxy, worker: Worker) -> None:
        proxy.stall_on(sent)
        assert proxy.drop(sent) == 1
        with trio.move_on_after(DEADLINE):
            while not proxy.stalled:  # the replacement's statement reached the proxy
                await trio.sleep(POLL)
        assert proxy.stalled, worker.output()

    return hang


async def test_sigterm_while_the_listener_reconnects_to_a_hanging_server_still_exits(
    pg_url: str, pg_schema: str, tmp_path: Path
) -> None:
    """DESIGN §8 ("`StoreError` reaches a caller only after a bound"; re-`LISTEN` after every
    reconnect), README "Running workers" (SIGTERM: graceful shutdown, then exit). The
    listening connection is lost, and the server stops answering (its TCP connections stay
    up) while the listener's reconnect waits for its LISTEN's reply: that wait had no bound
    (the listener's connection was not watched), its thread never returned, and the worker
    never exited on SIGTERM."""
    exited, output = await _exit_status_after_sigterm_on_a_hung_server(
        pg_url, pg_schema, tmp_path, _hang_as_a_reconnect_sends(b"LISTEN ")
    )
    assert exited is not None, f"still running after SIGTERM:\n{output}"


async def test_sigterm_while_the_liveness_token_is_retaken_on_a_hanging_server_still_exits(
    pg_url: str, pg_schema: str, tmp_path: Path
) -> None:
    """As above, for the liveness token's connection: lost, and the server stops answering
    while `retake` waits for `pg_try_advisory_lock`'s reply - no bound (not watched), the
    thread never returned, and the worker never exited on SIGTERM."""
    exited, output = await _exit_status_after_sigterm_on_a_hung_server(
        pg_url, pg_schema, tmp_path, _hang_as_a_reconnect_sends(b"pg_try_advisory_lock")
    )
    assert exited is not None, f"still running after SIGTERM:\n{output}"


def logged_time(log: str, line: str) -> float:
    """The wall time a worker_drain line was printed at (the first such line)."""
    match = re.search(re.escape(line) + r" at ([0-9.]+)", log)
    assert match is not None, f"{line!r} not in:\n{log}"
    return float(match.group(1))


async def test_a_rolling_restart_never_runs_a_session_twice(db_path: Path, tmp_path: Path) -> None:
    """SIGTERM while a drain is blocked in a thread, and a successor worker started at once
    (a rolling restart): the successor resumes the session only after the old drain's
    thread returned - never two drains of it at once - and the old worker exits 0."""
    (old_dir := tmp_path / "old").mkdir()
    (new_dir := tmp_path / "new").mkdir()
    store = ("--store", str(db_path))
    async with trio_sessions.open_runtime(db_path, None) as producer:
        await producer.submit("slow", {"thread": 3.0}, input_id="in-slow")
        old = await start_worker(old_dir, "worker_drain:reply", *store)
        new = None
        try:

            async def in_thread() -> bool:
                held = await producer.transcript("slow")
                return len(held) == 2 and texts(held[1]) == [worker_drain.IN_THREAD]

            await until(in_thread, "the drain blocked in its thread", old)
            old.process.send_signal(signal.SIGTERM)
            new = await start_worker(new_dir, "worker_drain:reply", *store)
            assert await old.exit_status() == 0, old.output()
            await new.until_logged("drain enter slow resumed=True")
        finally:
            await stop(old)
            if new is not None:
                await stop(new)
        [_, answer] = await producer.transcript("slow")
    thread_done = logged_time(old.output(), "thread done slow")
    resumed_at = logged_time(new.output(), "drain enter slow resumed=True")
    assert resumed_at > thread_done, (old.output(), new.output())
    # Cancelled once its thread returned: the old drain wrote nothing more, and the open
    # message was closed when the successor took the claim over.
    assert texts(answer) == [worker_drain.IN_THREAD]
    assert (answer.data.finished, answer.data.error) == (True, "interrupted: owner lost")


# ---------------------------------------------------------------------------------------------
# Loading the drain


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        ("worker_drain", "must be given as MODULE:DRAIN"),
        ("worker_drain:", "must be given as MODULE:DRAIN"),
        ("no_such_module_here:reply", "cannot import module 'no_such_module_here'"),
        ("worker_drain:missing", "'worker_drain' has no attribute 'missing'"),
        ("worker_drain:NOT_CALLABLE", "is not callable: int"),
        ("worker_drain:not_async", "must be an async function taking a DrainContext"),
    ],
)
def test_load_drain_refuses_what_is_not_an_async_drain(spec: str, reason: str) -> None:
    """Each way MODULE:DRAIN can be wrong gives a message that says which."""
    with pytest.raises(_worker.DrainLoadError, match=reason):
        _worker.load_drain(spec)


def test_a_drain_module_that_exits_while_importing_is_refused_not_a_silent_exit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A module calling `sys.exit(0)` at import made the worker exit 0 with no word (only
    `Exception` was caught). Found by an audit. It is a drain that cannot load: refused,
    saying so, and the worker exits 1 as for any other."""
    (tmp_path / "exits_at_import.py").write_text("import sys\nsys.exit(0)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(_worker.DrainLoadError, match=r"cannot import module 'exits_at_import'"):
        _worker.load_drain("exits_at_import:drain")


def test_load_drain_returns_the_named_async_function() -> None:
    """MODULE:DRAIN resolves to the drain itself (DRAIN may be a dotted path)."""
    assert _worker.load_drain("worker_drain:reply") is worker_drain.reply
    assert _worker.load_drain("worker_drain:trio.sleep") is trio.sleep


# ---------------------------------------------------------------------------------------------
# Settings


def parse(*argv: str) -> Any:
    return _cli.build_parser().parse_args(["worker", "m:drain", *argv])


async def test_a_worker_on_a_postgres_url_drains_the_schema_it_is_given(
    pg_url: str, pg_schema: str, tmp_path: Path
) -> None:
    """`--store postgresql://... --schema S`: the worker drains that schema's sessions (and
    SIGTERM still exits 0), and its `worker started` line names the schema: two workers on
    one server, different schemas, logged the same store line (found by an audit)."""
    from trio_sessions._postgres import PostgresStore

    store = PostgresStore(pg_url, schema=pg_schema)
    async with trio_sessions.open_runtime(store, None) as producer:
        await producer.submit("echo", {"text": "hi"})
        worker = await start_worker(
            tmp_path, "worker_drain:reply", "--store", pg_url, "--schema", pg_schema
        )
        try:

            async def replied() -> bool:
                messages = await producer.transcript("echo")
                return len(messages) == 2 and messages[1].data.finished

            await until(replied, "the echo reply", worker)
            worker.process.send_signal(signal.SIGTERM)
            assert await worker.exit_status() == 0, worker.output()
        finally:
            await stop(worker)
        _, answer = await producer.transcript("echo")
    assert texts(answer) == ["echo: hi"]
    shown = _naming.display_name(pg_url)
    assert f", store {shown} (schema {pg_schema})" in worker.output()


ENVIRONMENT = {
    "TRIO_SESSIONS_STORE": "env.db",
    "TRIO_SESSIONS_MAX_ACTIVE": "4",
    "TRIO_SESSIONS_OWNER": "env-owner",
    "TRIO_SESSIONS_LOG_LEVEL": "debug",
}


def test_settings_come_from_the_environment_and_flags_win() -> None:
    """Every setting can come from its TRIO_SESSIONS_* variable; a flag overrides it."""
    assert _worker.settings_from(parse(), ENVIRONMENT) == _worker.WorkerSettings(
        drain="m:drain", store="env.db", max_active=4, owner="env-owner", log_level="DEBUG"
    )
    flags = parse(
        *("--store", "flag.db", "--max-active", "2", "--owner", "flag-owner"),
        *("--log-level", "warning", "--lease", "7.5", "--recovery-interval", "0.5"),
    )
    assert _worker.settings_from(flags, ENVIRONMENT) == _worker.WorkerSettings(
        drain="m:drain",
        store="flag.db",
        max_active=2,
        owner="flag-owner",
        log_level="WARNING",
        lease=7.5,
        recovery_interval=0.5,
    )


def test_open_runtime_gets_only_the_options_that_were_set() -> None:
    """Unset max_active, lease and recovery interval are left out, so open_runtime's
    defaults apply."""
    bare = _worker.settings_from(parse("--store", "a.db"), {})
    assert _worker.runtime_options(bare) == {"owner_id": None}
    full = _worker.settings_from(parse(), {**ENVIRONMENT, "TRIO_SESSIONS_MAX_ACTIVE": "3"})
    assert _worker.runtime_options(full) == {"owner_id": "env-owner", "max_active": 3}
    timed = _worker.settings_from(parse("--lease", "2", "--recovery-interval", "0.5"), ENVIRONMENT)
    assert _worker.runtime_options(timed) == {
        "owner_id": "env-owner",
        "max_active": 4,
        "lease": 2.0,
        "recovery_interval": 0.5,
    }


@pytest.mark.parametrize(
    ("argv", "environ", "message"),
    [
        ([], {}, "no store: pass --store PATH_OR_URL or set TRIO_SESSIONS_STORE"),
        (["--max-active", "0"], ENVIRONMENT, "max-active must be at least 1, got 0"),
        ([], {**ENVIRONMENT, "TRIO_SESSIONS_MAX_ACTIVE": "many"}, "must be a whole number"),
        (["--log-level", "loud"], ENVIRONMENT, "log level must be one of DEBUG"),
        (["--lease", "0"], ENVIRONMENT, "lease must be 0.003 to 1e+09 seconds"),
        (["--lease", "inf"], ENVIRONMENT, "lease must be 0.003 to 1e+09 seconds"),
        (["--lease", "0.0001"], ENVIRONMENT, "lease must be 0.003 to 1e+09 seconds"),
        (["--recovery-interval", "soon"], ENVIRONMENT, "recovery-interval must be a number"),
        (["--recovery-interval", "inf"], ENVIRONMENT, "recovery-interval must be 0.001 to"),
        (["--owner", ""], ENVIRONMENT, "owner must be 1-200 characters"),
        (["--owner", "o" * 250], ENVIRONMENT, "owner must be 1-200 characters"),
        (["--schema", "s1"], ENVIRONMENT, "a schema needs a postgresql:// URL as the store"),
    ],
)
def test_bad_settings_exit_2_with_a_message(
    argv: list[str], environ: dict[str, str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A missing store or a malformed value is a usage error (exit 2) naming the setting -
    also a value `open_runtime` refuses (an infinite lease, an owner id no store holds),
    which failed the worker with a traceback and exit 1."""
    assert _worker.run(parse(*argv), environ) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("store", ["", ":memory:"], ids=["empty", "memory"])
def test_a_store_no_worker_can_drain_is_a_usage_error(tmp_path: Path, store: str) -> None:
    """README "Running workers": "a bad setting exits 2". `--store ''` (an unset shell
    variable: `--store "$DB"`) is taken as given, while an empty TRIO_SESSIONS_STORE is
    "no store" (exit 2); it - like `:memory:` - reaches open_runtime as an in-memory
    database, which a draining runtime cannot use: the worker logged "worker failed:
    StoreError: an in-memory database cannot hold liveness tokens" with a traceback and
    exited 1."""
    done = subprocess.run(
        [sys.executable, "-m", "trio_sessions", "worker", "worker_drain:reply", "--store", store],
        cwd=tmp_path,
        env=worker_env(),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=DEADLINE,
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert "store" in done.stderr


def test_metrics_without_their_client_are_a_usage_error_before_the_store_is_opened(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--metrics-bind` without prometheus_client (the 'metrics' extra) was found only once
    the runtime had opened - and maybe claimed sessions - then failed the worker (exit 1,
    a traceback). Found by an audit. A usage error now (exit 2), saying what to install."""
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import fails
    argv = parse("--metrics-bind", "127.0.0.1:0")
    assert _worker.run(argv, ENVIRONMENT) == 2
    assert "metrics need prometheus_client" in capsys.readouterr().err


async def test_a_metrics_port_in_use_fails_the_worker_before_the_store_is_opened(
    db_path: Path, tmp_path: Path
) -> None:
    """`--metrics-bind` on a port another process holds was found only once the runtime had
    opened (and maybe claimed sessions, which the closing runtime then handed back). The
    port is bound first now: exit 1, the reason logged, no database created."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        worker = await start_worker(
            tmp_path,
            "worker_drain:reply",
            "--store",
            str(db_path),
            "--metrics-bind",
            f"127.0.0.1:{port}",
        )
        try:
            assert await worker.exit_status() == 1, worker.output()
        finally:
            await stop(worker)
    assert f"cannot serve metrics on 127.0.0.1:{port}" in worker.output()
    assert "worker started" not in worker.output()
    assert not db_path.exists()  # noqa: ASYNC240 - one stat, after the process ended


def test_a_metrics_url_names_an_ipv6_host_in_brackets() -> None:
    """The logged `worker metrics on URL` is a URL for an IPv6 host too: in brackets."""
    assert _worker.metrics_url("::1", 9464) == "http://[::1]:9464/metrics"
    assert _worker.metrics_url("127.0.0.1", 9464) == "http://127.0.0.1:9464/metrics"


def test_a_postgres_password_is_not_logged() -> None:
    """The store shown in the log line hides a URL's password."""
    url = "postgresql://app:s3cret@db.example:5432/sessions"
    assert _naming.display_name(url) == "postgresql://app:***@db.example:5432/sessions"
    assert _naming.display_name("/var/lib/app/sessions.db") == "/var/lib/app/sessions.db"


# ---------------------------------------------------------------------------------------------
# Message.to_json


def test_message_to_json_is_the_stored_projection_and_a_copy() -> None:
    """An assistant message's `to_json()["data"]` is exactly what the store writes (DESIGN
    §3), and mutating the dict leaves the frozen message unchanged."""
    data = AssistantData(
        parts=(
            TextPart("thinking"),
            ToolPart("c1", "search", {"q": ["a"]}, "error", None, "interrupted"),
            ToolPart("c2", "fetch", {}, "completed", {"rows": [1, 2]}, None),
        ),
        finished=True,
        error="interrupted: owner lost",
    )
    message = Message("m1", "s1", "assistant", 3, data, "e1", None)
    as_json = message.to_json()
    assert as_json["data"] == json.loads(encode_assistant(data))
    assert {k: v for k, v in as_json.items() if k != "data"} == {
        **{"id": "m1", "session_id": "s1", "role": "assistant", "seq": 3},
        **{"execution_id": "e1", "input_id": None},
    }
    as_json["data"]["parts"][1]["input"]["q"].append("b")
    assert data.parts[1] == ToolPart("c1", "search", {"q": ["a"]}, "error", None, "interrupted")
    user = Message("m0", "s1", "user", 2, {"text": ["hi"]}, "e1", "in-1")
    user.to_json()["data"]["text"].append("there")
    assert user.data == {"text": ["hi"]}


async def test_a_signal_while_the_runtime_opens_logs_no_owner_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """SIGTERM before the runtime opened (a PostgreSQL liveness token still held elsewhere
    keeps an open waiting up to 20 s) stops the worker with status 0, and its last line says
    the runtime never opened. Found by the last audit: it logged "worker stopped: owner
    None", an owner that does not exist."""
    opening = trio.Event()

    @contextlib.asynccontextmanager
    async def never_opens(*args: Any, **options: Any) -> Any:
        opening.set()
        await trio.sleep_forever()
        yield  # pragma: no cover

    monkeypatch.setattr(_worker, "open_runtime", never_opens)
    caplog.set_level(logging.INFO, logger="trio_sessions")
    settings = _worker.WorkerSettings(drain="m:d", store=str(tmp_path / "w.db"))
    status: list[int] = []
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:

            async def serve() -> None:
                status.append(await _worker.serve(settings, worker_drain.reply))

            nursery.start_soon(serve)
            await opening.wait()
            os.kill(os.getpid(), signal.SIGTERM)
    messages = [record.getMessage() for record in caplog.records]
    assert status == [_worker.EXIT_OK]
    assert "worker stopping on SIGTERM" in messages
    assert messages[-1] == "worker stopped: its runtime never opened", messages
    assert not any("None" in message for message in messages), messages


async def test_a_store_error_at_opening_is_one_log_line_without_a_traceback(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker started on a store it cannot use - a newer schema (an old worker left over
    from an upgrade, which the README tells to avoid), a path in a missing directory, a
    server that refuses - logged `worker failed: ...` and then a 30-line traceback through
    `open_runtime` and trio's threads: noise for an operator, where the line says all (the
    library logs a `StoreError` without one elsewhere too: `claim attempt failed`). Found
    following the README. A `StoreError` is now the line alone; any other error keeps its
    traceback (it is a bug to report)."""
    newer = tmp_path / "newer.db"
    with contextlib.closing(sqlite3.connect(newer)) as conn:
        conn.execute("PRAGMA user_version = 999")
        conn.commit()
    for store in (str(newer), str(tmp_path / "missing" / "w.db")):
        caplog.clear()
        settings = _worker.WorkerSettings(drain="m:d", store=store)
        with caplog.at_level(logging.ERROR, logger="trio_sessions.worker"):
            assert await _worker.serve(settings, worker_drain.reply) == _worker.EXIT_FAILED
        [record] = [r for r in caplog.records if r.getMessage().startswith("worker failed")]
        assert "StoreError" in record.getMessage() or "SchemaTooNew" in record.getMessage()
        assert record.exc_info is None, record.getMessage()
