"""Observability: each operator event is logged once with its stable message and `extra`
fields, and the OpenTelemetry spans and metrics (through the SDK's in-memory exporters).

The log events do not depend on the backend, so these run on the inline SQLite store;
the store retry and reconnect events are PostgreSQL's own.
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
import subprocess
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import trio
import trio.testing
from helpers import (
    JumpingClock,
    Raw,
    Recorder,
    SlowToExit,
    now_ms,
    open_tool_message,
    opened,
    runtime,
    terminate_backend,
)
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from trio.testing import MockClock

import trio_sessions
from trio_sessions import (
    Claim,
    DrainContext,
    DuplicateSettlement,
    LeaseLost,
    MalformedRecord,
    Outcome,
    RecoveryReport,
    Store,
    StoreError,
    _store,
)
from trio_sessions import _observe as events
from trio_sessions._coordinator import SessionEntry
from trio_sessions._postgres import PostgresStore, run_op

Clock = Callable[[], float]
QUIET = {"recovery_interval": 10_000.0}  # passes only when the test asks for one
MALFORMED = '{"parts": [], "finished": "false", "error": null}'


def records(caplog: pytest.LogCaptureFixture, message: str) -> list[Any]:
    """The records of one event (by its stable message), all from the library's logger.
    (Typed `Any`: their `extra` fields are attributes no type declares.)"""
    found = [r for r in caplog.records if r.msg == message]
    assert all(r.name == "trio_sessions" for r in found)
    return found


def store_at(tmp_path: Path, **options: Any) -> Store:
    return Store(tmp_path / "sessions.db", inline=True, **options)


class FailingHeartbeat:
    """An SQLite connection whose heartbeat statement fails while `failing` is set."""

    failing = False

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)

    def execute(self, sql: str, params: Any = ()) -> sqlite3.Cursor:
        if FailingHeartbeat.failing and "heartbeat_at" in sql:
            raise sqlite3.OperationalError("disk I/O error")
        return self._conn.execute(sql, params)


# --- log events ---------------------------------------------------------------------------


async def test_failing_drain_logs_error_with_traceback(
    tmp_path: Path, clock: Clock, autojump_clock: MockClock, logs: pytest.LogCaptureFixture
) -> None:
    """A drain that raises is logged once at ERROR with its traceback and the claim's ids."""
    contexts: list[DrainContext] = []

    async def drain(ctx: DrainContext) -> None:
        contexts.append(ctx)
        raise ValueError("the model said no")

    async with runtime(store_at(tmp_path), drain, clock) as rt:
        outcome = await rt.run("s")
    assert outcome.kind == "failed"
    [record] = records(logs, events.DRAIN_FAILED)
    assert record.levelno == logging.ERROR
    assert record.getMessage() == f"drain failed: session s, execution {contexts[0].execution_id}"
    assert record.exc_info is not None and record.exc_info[1] is outcome.error
    traceback = logging.Formatter().formatException(record.exc_info)
    assert 'raise ValueError("the model said no")' in traceback
    extra = {k: getattr(record, k) for k in ("session_id", "execution_id", "owner_id")}
    assert extra == {
        "session_id": "s",
        "execution_id": contexts[0].execution_id,
        "owner_id": rt.owner_id,
    }
    assert (record.attempt, record.resumed) == (0, False)
    assert record.error == "ValueError('the model said no')"


def test_nothing_is_printed_when_logging_is_unconfigured() -> None:
    """An ERROR event in a program that configured no logging prints nothing."""
    program = (
        "import trio_sessions._observe as o\n"
        "from trio_sessions._coordinator import SessionEntry\n"
        "o.drain_failed(SessionEntry('s', 'e'), 'me', ValueError('x'))\n"
        "o.checkpoint_failed(OSError('disk'))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=60, check=True
    )
    assert (done.stdout, done.stderr) == ("", "")


async def test_claim_lost_by_heartbeat_and_by_write_each_log_once(
    tmp_path: Path, clock: Clock, autojump_clock: MockClock, logs: pytest.LogCaptureFixture
) -> None:
    """The heartbeat finding a claim gone logs `claim lost` (cause heartbeat) once; a drain's
    fenced write finding it gone logs it with cause write."""
    jumping = JumpingClock(clock)
    drain = Recorder()
    drain.hold()
    async with runtime(store_at(tmp_path), drain, jumping, lease=9.0) as rt:
        await rt.wake("held")
        await drain.entered.wait()
        jumping.offset += 60.0
        await rt.wait_idle("held")
    [record] = records(logs, events.CLAIM_LOST)
    assert record.levelno == logging.WARNING
    assert (record.session_id, record.cause, record.owner_id) == ("held", "heartbeat", rt.owner_id)
    assert record.execution_id == drain.calls[0].execution_id
    assert records(logs, events.SELF_FENCED) == []

    logs.clear()
    jumped = trio.Event()

    async def writer(ctx: DrainContext) -> None:
        await jumped.wait()
        with trio.CancelScope(shield=True):  # the write lands before the heartbeat sees it
            await ctx.begin_assistant()

    jumping = JumpingClock(clock)
    async with runtime(store_at(tmp_path), writer, jumping, lease=9.0) as rt:
        await rt.wake("writes")
        await trio.testing.wait_all_tasks_blocked()
        jumping.offset += 60.0
        jumped.set()
        await rt.wait_idle("writes")
    [record] = records(logs, events.CLAIM_LOST)
    assert (record.session_id, record.cause) == ("writes", "write")


async def test_a_claim_taken_over_while_its_owner_lives_is_logged_lost_once(
    tmp_path: Path, clock: Clock, logs: pytest.LogCaptureFixture
) -> None:
    """An owner that learns from the store's changes that its claim is gone (taken over
    after its lease ran out, here by another runtime's recovery) logs `claim lost` with
    cause `gone` once, before its heartbeat could: the operator sees why the drain stopped.
    On the threaded store in real time (the other runtime's commit reaches the owner
    through the file's change signal), with the lease's expiry jumped."""
    jumping = JumpingClock(clock)
    drain = Recorder()
    drain.hold()
    database = tmp_path / "sessions.db"
    async with (
        runtime(Store(database), drain, jumping, lease=9.0) as owner,
        runtime(Store(database), Recorder(), jumping, lease=9.0) as other,
    ):
        await owner.wake("s")
        await drain.entered.wait()
        jumping.offset += 60.0
        assert (await other.recover_once()).resumed == 1
        with trio.fail_after(1):  # well within the heartbeat's 3 s
            await owner.wait_idle("s")
    [record] = records(logs, events.CLAIM_LOST)
    assert record.levelno == logging.WARNING
    assert (record.session_id, record.cause, record.owner_id) == ("s", "gone", owner.owner_id)
    assert record.execution_id == drain.calls[0].execution_id


async def test_self_fence_and_failed_heartbeats_are_logged(
    tmp_path: Path, clock: Clock, autojump_clock: MockClock, logs: pytest.LogCaptureFixture
) -> None:
    """Heartbeats failing log `heartbeat failed`; the drain stopped at its local deadline
    logs `self-fenced` (and no `claim lost`: the store never said so)."""
    drain = Recorder()
    drain.hold()
    store = store_at(tmp_path, wrap_connection=FailingHeartbeat)
    try:
        async with runtime(store, drain, clock, lease=9.0) as rt:
            outcomes: list[Outcome] = []
            async with trio.open_nursery() as nursery:

                async def run() -> None:
                    outcomes.append(await rt.run("s"))

                nursery.start_soon(run)
                await drain.entered.wait()
                FailingHeartbeat.failing = True
    finally:
        FailingHeartbeat.failing = False
    assert outcomes == [Outcome("interrupted", "lease_lost")]
    [fenced] = records(logs, events.SELF_FENCED)
    assert fenced.levelno == logging.WARNING
    assert (fenced.session_id, fenced.owner_id) == ("s", rt.owner_id)
    assert fenced.execution_id == drain.calls[0].execution_id
    failed = records(logs, events.HEARTBEAT_FAILED)
    assert failed and all(r.claims == 1 and "disk I/O error" in r.error for r in failed)
    assert records(logs, events.CLAIM_LOST) == []


async def test_a_drain_stopped_by_its_deadline_after_a_stall_is_logged_self_fenced(
    tmp_path: Path, clock: Clock, autojump_clock: MockClock, logs: pytest.LogCaptureFixture
) -> None:
    """The process stalls past the drain's local deadline while the store still answers:
    the heartbeat that runs then and the drain's own write notice the passed deadline
    first. The loss is logged `self-fenced` once all the same - it was not, once noticing
    it there took it for a loss the heartbeat had logged (a review's finding)."""
    lease = 9.0

    async def drain(ctx: DrainContext) -> None:
        await ctx.take_inputs()
        writer = await ctx.begin_assistant()
        autojump_clock.jump(lease * 0.95)  # the whole thread blocked
        try:
            await trio.lowlevel.checkpoint()
        finally:
            with trio.CancelScope(shield=True):
                await trio.sleep(0.05)  # the heartbeat runs meanwhile
                with contextlib.suppress(LeaseLost):
                    await writer.append_text("cleaning up")

    async with runtime(store_at(tmp_path), drain, clock, lease=lease) as rt:
        await rt.submit("s", {"n": 1})
        outcome = await rt.run("s")
    assert outcome == Outcome("interrupted", "lease_lost")
    [fenced] = records(logs, events.SELF_FENCED)
    assert (fenced.session_id, fenced.owner_id) == ("s", rt.owner_id)
    assert records(logs, events.CLAIM_LOST) == []


async def test_recovery_events_and_shutdown_hand_back(
    tmp_path: Path, clock: Clock, autojump_clock: MockClock, logs: pytest.LogCaptureFixture
) -> None:
    """Takeover (INFO), quarantine (WARNING, with why), an exhausted resume budget
    (WARNING), the pass summary (INFO when it found work, else DEBUG, with the report's
    counts), the operator's lift and drop, and the shutdown hand-back are each logged."""
    raw = Raw(tmp_path / "sessions.db")
    drain = Recorder()
    drain.hold()
    async with runtime(store_at(tmp_path), drain, clock, max_resumes=5, **QUIET) as rt:
        raw.seed_claim("dead", "dead-exec", expires_at=now_ms(clock) - 1, wake_attempts=2)
        raw.seed_claim("poison", "poison-exec", expires_at=now_ms(clock) - 1)
        raw.seed_assistant("poison", "poison-exec", 1, MALFORMED)
        raw.seed_claim("tired", "tired-exec", expires_at=now_ms(clock) - 1, wake_attempts=5)
        logs.clear()
        report = await rt.recover_once()
        assert report == RecoveryReport(examined=3, resumed=1, quarantined=1, exhausted=1)
        await drain.entered.wait()
        assert await rt.recover_once() == RecoveryReport()
        with pytest.raises(MalformedRecord):
            await rt.release_quarantine("poison-exec", resume=True)  # still malformed
        await rt.release_quarantine("poison-exec", resume=False)

    [takeover] = records(logs, events.TAKEOVER)
    assert takeover.levelno == logging.INFO
    assert (takeover.session_id, takeover.previous_execution_id, takeover.attempt) == (
        "dead",
        "dead-exec",
        3,
    )
    assert takeover.execution_id == drain.calls[0].execution_id != "dead-exec"
    quarantined = records(logs, events.QUARANTINED)  # by the pass, then by the lift
    assert [(r.levelno, r.session_id, r.execution_id) for r in quarantined] == [
        (logging.WARNING, "poison", "poison-exec")
    ] * 2
    assert all("expected bool" in r.reason for r in quarantined)
    [tired] = records(logs, events.RESUMES_EXHAUSTED)
    assert (tired.levelno, tired.session_id, tired.execution_id) == (
        logging.WARNING,
        "tired",
        "tired-exec",
    )
    [summary, idle] = records(logs, events.RECOVERY_PASS)
    assert summary.levelno == logging.INFO  # it found work: an operator sees it
    assert idle.levelno == logging.DEBUG  # nothing to do: no line at the usual level
    assert idle.getMessage() == "recovery pass: examined 0, resumed 0, quarantined 0"
    assert summary.getMessage() == "recovery pass: examined 3, resumed 1, quarantined 1"
    counts = ("examined", "resumed", "quarantined", "exhausted", "skipped_live")
    assert [getattr(summary, key) for key in counts] == [3, 1, 1, 1, 0]
    assert summary.owner_id == rt.owner_id
    for message in (events.QUARANTINE_LIFTED, events.QUARANTINE_DROPPED):
        [released] = records(logs, message)
        assert (released.levelno, released.execution_id) == (logging.INFO, "poison-exec")
    [handed] = records(logs, events.HANDED_BACK)
    assert handed.levelno == logging.INFO
    assert (handed.claims, handed.execution_ids) == (1, [drain.calls[0].execution_id])


async def test_failed_recovery_pass_is_logged(
    tmp_path: Path, clock: Clock, autojump_clock: MockClock, logs: pytest.LogCaptureFixture
) -> None:
    """A recovery pass failing on a store error logs `recovery pass failed` with its
    traceback (the loop retries it silently otherwise)."""

    class Broken:
        def __init__(self, conn: sqlite3.Connection) -> None:
            self._conn = conn

        def __getattr__(self, name: str) -> Any:
            return getattr(self._conn, name)

        def execute(self, sql: str, params: Any = ()) -> sqlite3.Cursor:
            if "json_each" in sql:  # the candidates' scan
                raise sqlite3.OperationalError("disk I/O error")
            return self._conn.execute(sql, params)

    with pytest.raises(StoreError):
        async with runtime(store_at(tmp_path, wrap_connection=Broken), Recorder(), clock):
            pytest.fail("the runtime must not open")
    [failed] = records(logs, events.RECOVERY_PASS_FAILED)
    assert failed.levelno == logging.WARNING and "disk I/O error" in failed.error
    assert failed.exc_info is not None and isinstance(failed.exc_info[1], StoreError)
    assert records(logs, events.RECOVERY_PASS) == []


def test_postgres_retry_and_reconnect_are_logged(
    pg_url: str, pg_schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A serialisation failure logs `store transaction retried: 40001`; a killed backend
    logs `store reconnected`."""
    caplog.set_level(logging.INFO, logger="trio_sessions")
    wrapped: list[FailOnce] = []

    def wrap(conn: psycopg.Connection[Any]) -> FailOnce:
        wrapped.append(FailOnce(conn))
        return wrapped[-1]

    with opened(PostgresStore(pg_url, schema=pg_schema, wrap_connection=wrap).engine()) as engine:
        wrapped[-1].armed = True
        run_op(engine, _store.wake, "s")
        [retry] = records(caplog, events.STORE_RETRY)
        assert retry.getMessage() == "store transaction retried: 40001"
        assert (retry.backend, retry.sqlstate, retry.retry) == ("postgres", "40001", 1)
        terminate_backend(pg_url, engine.conn.info.backend_pid)
        run_op(engine, _store.wake, "s")
    [reconnected] = records(caplog, events.STORE_RECONNECTED)
    assert (reconnected.levelno, reconnected.backend) == (logging.WARNING, "postgres")


class FailOnce:
    """A PostgreSQL connection whose next statement fails with a serialisation failure."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self._conn = conn
        self.armed = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)

    def execute(self, *args: Any, **kwargs: Any) -> Any:
        if self.armed:
            self.armed = False
            raise psycopg.errors.SerializationFailure("could not serialize access (injected)")
        return self._conn.execute(*args, **kwargs)


# --- OpenTelemetry ------------------------------------------------------------------------


@pytest.fixture(scope="session")
def otel() -> Iterator[tuple[InMemorySpanExporter, InMemoryMetricReader]]:
    """The global OTel providers, configured once per process as an application would,
    exporting to memory. Shut down afterwards, so later tests record nothing into them."""
    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader])
    trace.set_tracer_provider(tracer_provider)
    metrics.set_meter_provider(meter_provider)
    yield exporter, reader
    tracer_provider.shutdown()
    meter_provider.shutdown()


def metric_points(reader: InMemoryMetricReader) -> dict[str, list[Any]]:
    """The library's metrics by name: their data points (cumulative)."""
    data = reader.get_metrics_data()
    assert data is not None
    return {
        metric.name: list(metric.data.data_points)
        for resource in data.resource_metrics
        for scope in resource.scope_metrics
        if scope.scope.name == "trio_sessions"
        for metric in scope.metrics
    }


def spans_named(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [span for span in exporter.get_finished_spans() if span.name == name]


async def test_otel_spans_and_metrics(
    tmp_path: Path,
    clock: Clock,
    autojump_clock: MockClock,
    otel: tuple[InMemorySpanExporter, InMemoryMetricReader],
) -> None:
    """A span per drain call (ids, attempt, resumed, outcome; a failure recorded) and per
    recovery pass (its counts); active drains, wake-to-start latency, drain duration by
    outcome, takeovers, quarantines and lost claims as metrics."""
    exporter, reader = otel
    exporter.clear()
    raw = Raw(tmp_path / "sessions.db")
    gate, entered, lost = trio.Event(), trio.Event(), trio.Event()
    jumping = JumpingClock(clock)

    async def drain(ctx: DrainContext) -> None:
        await ctx.take_inputs()
        if ctx.session_id == "lost":
            lost.set()
            await trio.sleep_forever()  # until the heartbeat finds the claim gone
        if ctx.session_id == "bad":
            raise ValueError("boom")
        if ctx.session_id == "defect":  # a second settlement, caught: still a failure
            writer = await ctx.begin_assistant()
            await writer.start_tool("c1", "search", {})
            await writer.settle_tool("c1", "first")
            with contextlib.suppress(DuplicateSettlement):
                await writer.settle_tool("c1", "second")
        if ctx.session_id == "held":
            entered.set()
            await gate.wait()
        await trio.sleep(5)

    async def hook(claim: Claim) -> None:
        await trio.sleep(1)  # between the wake and the drain's start

    options: dict[str, Any] = {"acquisition_hook": hook, **QUIET}
    async with runtime(store_at(tmp_path), drain, jumping, **options) as rt:
        assert await rt.run("ok") == Outcome("succeeded")
        assert (await rt.run("bad")).kind == "failed"
        assert (await rt.run("defect")).kind == "failed"
        async with trio_sessions.open_runtime(store_at(tmp_path), None, clock=clock) as producer:
            await producer.submit("remote", {"n": 1})
        # An unclaimed doorbell (another process's wake) found by the pass rings `rt`.
        assert await rt.recover_once() == RecoveryReport(examined=1, doorbells_started=1)
        await rt.wait_idle("remote")
        raw.seed_claim("dead", "dead-exec", expires_at=now_ms(clock) - 1)
        raw.seed_assistant("dead", "dead-exec", 1, open_tool_message())
        raw.seed_claim("poison", "poison-exec", expires_at=now_ms(clock) - 1)
        raw.seed_assistant("poison", "poison-exec", 1, MALFORMED)
        assert await rt.recover_once() == RecoveryReport(examined=2, resumed=1, quarantined=1)
        await rt.wait_idle("dead")
        await rt.wake("held")
        await entered.wait()
        [active] = metric_points(reader)[events.ACTIVE_DRAINS]
        assert active.value == 1
        gate.set()
        await rt.wait_idle("held")
        await rt.wake("lost")
        await lost.wait()
        jumping.offset += 3600.0
        assert await rt.run("lost") == Outcome("interrupted", "lease_lost")

    points = metric_points(reader)
    assert [p.value for p in points[events.ACTIVE_DRAINS]] == [0]
    assert [(p.value, p.attributes) for p in points[events.TAKEOVERS]] == [(1, {})]
    assert [p.value for p in points[events.QUARANTINES]] == [1]
    # Every drain started by a wake (local or remote); not the resumed one.
    [latency] = points[events.WAKE_LATENCY]
    assert (latency.count, latency.sum) == (6, 6.0)
    durations = {p.attributes["outcome"]: (p.count, p.sum) for p in points[events.DRAIN_DURATION]}
    assert durations.pop("interrupted")[0] == 1  # stopped at the next heartbeat
    assert durations == {"succeeded": (4, 20.0), "failed": (2, 5.0)}  # defect: after 5 s
    assert [(p.value, p.attributes) for p in points[events.CLAIMS_LOST]] == [
        (1, {"cause": "heartbeat"})
    ]

    drains = {
        str((s.attributes or {})["trio_sessions.session_id"]): s
        for s in spans_named(exporter, events.DRAIN_SPAN)
    }
    assert sorted(drains) == ["bad", "dead", "defect", "held", "lost", "ok", "remote"]
    assert drains["lost"].attributes["trio_sessions.outcome"] == "interrupted"  # type: ignore[index]
    assert drains["defect"].attributes["trio_sessions.outcome"] == "failed"  # type: ignore[index]
    bad = drains["bad"]
    assert bad.attributes is not None and bad.attributes["trio_sessions.outcome"] == "failed"
    assert bad.status.status_code is StatusCode.ERROR
    assert [e.name for e in bad.events] == ["exception"]
    dead = drains["dead"].attributes
    assert dead is not None
    assert (dead["trio_sessions.resumed"], dead["trio_sessions.attempt"]) == (True, 1)
    assert dead["trio_sessions.outcome"] == "succeeded"
    assert dead["trio_sessions.execution_id"] != "dead-exec"
    assert dead["trio_sessions.owner_id"] == rt.owner_id
    counts = ("examined", "doorbells_started", "resumed", "quarantined")
    passes = [
        tuple((span.attributes or {})[f"trio_sessions.{key}"] for key in counts)
        for span in spans_named(exporter, events.RECOVERY_SPAN)
    ]
    assert passes == [(0, 0, 0, 0), (1, 1, 0, 0), (2, 0, 1, 1)]  # opening, then two asked for


def test_telemetry_absent_is_a_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without opentelemetry-api installed, telemetry is disabled and its calls do nothing."""
    import builtins

    real_import = builtins.__import__

    def no_otel(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.startswith("opentelemetry"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_otel)
    telemetry = events._Telemetry()
    assert telemetry.enabled is False
    telemetry.count(events.TAKEOVERS, {})
    with telemetry.span(events.DRAIN_SPAN, {}) as span:
        assert span is None


def test_drain_metrics_wait_for_a_meter_provider(monkeypatch: pytest.MonkeyPatch) -> None:
    """With no meter provider set, a drain call makes no metric call (the API's proxy
    instruments would record nothing, at a few us per call); a provider set while a call
    runs gets no lone -1 from that call's end, and the next call is metered."""
    telemetry = events._telemetry
    api = types.SimpleNamespace(_METER_PROVIDER=None)
    # raising=False: before, these did not exist and every call was metered.
    monkeypatch.setattr(telemetry, "_metrics_api", api, raising=False)
    monkeypatch.setattr(telemetry, "_meter_provider_unknown", False, raising=False)
    calls: list[tuple[str, float]] = []
    monkeypatch.setattr(telemetry, "add", lambda name, amount: calls.append((name, amount)))
    monkeypatch.setattr(
        telemetry, "record", lambda name, seconds, attributes: calls.append((name, seconds))
    )

    async def two_calls() -> None:
        entry = SessionEntry("s", "e")
        with events.drain_iteration(entry, "owner", None):
            api._METER_PROVIDER = object()  # an application sets one meanwhile
        assert calls == []
        with events.drain_iteration(entry, "owner", None):
            await trio.lowlevel.checkpoint()

    trio.run(two_calls)
    assert [name for name, _ in calls] == [
        events.ACTIVE_DRAINS,
        events.ACTIVE_DRAINS,
        events.DRAIN_DURATION,
    ]
    assert [amount for name, amount in calls if name == events.ACTIVE_DRAINS] == [1, -1]


async def test_a_hand_back_logs_only_the_claims_it_handed_back(
    store: Store, clock: Clock, autojump_clock: MockClock, logs: pytest.LogCaptureFixture
) -> None:
    """Closing waits for a drain slow to exit; meanwhile another runtime deletes the
    session (a user's erasure). The drain's claim is gone, so the hand-back changes no row
    - and `claims handed back` says 0, not 1: an operator reading it must not believe a
    claim is waiting for any runtime to resume it. Found by an audit."""
    drain = SlowToExit()

    async with runtime(store, None, clock) as producer:

        async def delete_while_closing() -> None:
            await drain.exiting.wait()
            assert await producer.delete_session("s")
            drain.may_exit.set()

        await drain.close_during(store, clock, delete_while_closing)
    [handed] = records(logs, events.HANDED_BACK)
    assert (handed.getMessage(), handed.claims) == ("claims handed back: 0", 0)


async def test_a_session_deleted_by_another_runtime_is_no_lost_claim_where_it_drained(
    tmp_path: Path, clock: Clock, logs: pytest.LogCaptureFixture
) -> None:
    """A user's erasure (`delete_session`) from another runtime - a web process - of a
    session whose drain runs in a worker removes the claim on purpose: the worker logs it at
    INFO (`claim ended: session deleted`, with its ids), not as `claim lost` and not in
    `claims_lost`, which tell an operator that a lease ran out or another owner took over
    (as a delete from the draining runtime itself logs nothing). Found by the audit
    (audU53): every chat deleted while it was answered logged a `claim lost` WARNING with
    cause `gone` on its worker. On the threaded store in real time (the delete reaches the
    worker through the file's change signal)."""
    drain = Recorder()
    drain.hold()
    database = tmp_path / "sessions.db"
    async with (
        runtime(Store(database), drain, clock) as worker,
        runtime(Store(database), None, clock) as web,
    ):
        await web.submit("s", {"text": "hi"})
        await drain.entered.wait()
        assert await web.delete_session("s")
        with trio.fail_after(1):  # well within the heartbeat's 10 s
            await worker.wait_idle("s")
    assert records(logs, events.CLAIM_LOST) == []
    [record] = records(logs, events.SESSION_DELETED)
    assert record.levelno == logging.INFO
    assert (record.session_id, record.owner_id) == ("s", worker.owner_id)
    assert record.execution_id == drain.calls[0].execution_id
