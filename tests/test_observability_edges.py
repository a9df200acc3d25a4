"""Observability against the README, at its edges: what `statistics()` and the Prometheus
text count (a quarantine released and resumed), what a drain span records (no exception
text; a lost lease is an interruption), and the `extra` fields of log events (a masked
error, a retry's sqlstate, a file's loss logged for good only). Contract tests run on both
backends; the store-retry one is PostgreSQL's own."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from helpers import JumpingClock, Raw, Recorder, now_ms, opened, records, runtime, terminate_backend
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from test_logging_accuracy import Intercepted
from test_observability import metric_points, spans_named

from trio_sessions import (
    DrainContext,
    LeaseLost,
    Outcome,
    StoreError,
    _metrics,
    _store,
    testing,
)
from trio_sessions import _observe as events
from trio_sessions._errors import OutcomeUnknown, StoreLost
from trio_sessions._postgres import PostgresStore, run_op

Clock = Callable[[], float]
QUIET = {"recovery_interval": 10_000.0}  # passes only when the test asks for one
MALFORMED = '{"parts": [], "finished": "false", "error": null}'
REPAIRED = '{"parts": [], "finished": false, "error": null}'
SECRET = "sk-secret-123"
README = Path(__file__).parent.parent / "README.md"


@pytest.fixture
def otel(
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[tuple[InMemorySpanExporter, InMemoryMetricReader]]:
    """The library's tracer and instruments, for this test only, from SDK providers that
    export to memory (the global providers can be set once per process, and
    test_observability's session fixture owns them)."""
    telemetry = events._telemetry
    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader])
    meter = meter_provider.get_meter("trio_sessions")
    monkeypatch.setattr(telemetry, "_tracer", tracer_provider.get_tracer("trio_sessions"))
    monkeypatch.setattr(telemetry, "tracing", lambda: True)
    monkeypatch.setattr(telemetry, "metering", lambda: True)
    for name in telemetry._histograms:
        monkeypatch.setitem(telemetry._histograms, name, meter.create_histogram(name, unit="s"))
    for name in telemetry._counters:
        monkeypatch.setitem(telemetry._counters, name, meter.create_counter(name))
    for name in telemetry._up_down:
        monkeypatch.setitem(telemetry._up_down, name, meter.create_up_down_counter(name))
    yield exporter, reader
    tracer_provider.shutdown()
    meter_provider.shutdown()


def scraped(text: str, name: str, kind: str) -> float:
    """One `trio_sessions_recovery_total{kind=...}` sample of a Prometheus text."""
    [line] = [
        line
        for line in text.splitlines()
        if line.startswith(name + "{") and f'kind="{kind}"' in line
    ]
    return float(line.rsplit(" ", 1)[1])


# --- statistics and Prometheus ----------------------------------------------------------------


async def test_a_quarantine_released_and_resumed_counts_as_a_resumed_recovery(
    store: Any, db_path: Any, clock: Clock, autojump_clock: trio.testing.MockClock, logs: Any
) -> None:
    """`release_quarantine(resume=True)` takes the repaired execution over (logged as a
    `takeover`, counted by the OTel `trio_sessions.takeovers`): `statistics().recovery` and
    the scrape's `trio_sessions_recovery_total{kind="resumed"}` count it too."""
    raw = Raw(db_path)
    drain = Recorder()
    async with runtime(store, drain, clock, **QUIET) as rt:
        raw.seed_claim("poison", "poison-exec", expires_at=now_ms(clock) - 1)
        raw.seed_assistant("poison", "poison-exec", 1, MALFORMED)
        assert (await rt.recover_once()).quarantined == 1
        raw.write(
            "UPDATE session_message SET data = ? WHERE execution_id = ?",
            (REPAIRED, "poison-exec"),
        )
        await rt.release_quarantine("poison-exec", resume=True)
        await rt.wait_idle("poison")
        assert len(drain.calls) == 1 and drain.calls[0].resumed
        assert len(records(logs, events.TAKEOVER)) == 1
        totals = rt.statistics().recovery
        text = _metrics.render(rt.statistics, owner_id=rt.owner_id).decode()
    assert (totals.quarantined, totals.resumed) == (1, 1)
    assert scraped(text, "trio_sessions_recovery_total", "resumed") == 1.0


# --- spans --------------------------------------------------------------------------------


async def test_a_failed_drains_span_keeps_its_text_out(
    store: Any,
    clock: Clock,
    autojump_clock: trio.testing.MockClock,
    otel: tuple[InMemorySpanExporter, InMemoryMetricReader],
    logs: Any,
) -> None:
    """A drain raising `KeyError('api_key=sk-secret-123')`: its text and traceback are in the
    `drain failed` log event only; the drain span records the failure (ERROR status, an
    exception event naming the type) without the text that may hold the secret."""
    exporter, _ = otel

    async def drain(ctx: DrainContext) -> None:
        await ctx.take_inputs()
        raise KeyError(f"api_key={SECRET}")

    async with runtime(store, drain, clock, **QUIET) as rt:
        assert (await rt.run("s")).kind == "failed"
    [logged] = records(logs, events.DRAIN_FAILED)
    assert SECRET in logged.error  # the log has it, as documented
    [span] = spans_named(exporter, events.DRAIN_SPAN)
    assert span.status.status_code is StatusCode.ERROR
    [event] = span.events
    assert event.name == "exception" and event.attributes is not None
    assert event.attributes["exception.type"] == "KeyError"
    shown = repr((dict(span.attributes or {}), span.status.description, dict(event.attributes)))
    assert SECRET not in shown


async def test_a_drain_ended_by_a_lost_lease_is_interrupted_in_its_span_and_metrics(
    store: Any,
    clock: Clock,
    autojump_clock: trio.testing.MockClock,
    otel: tuple[InMemorySpanExporter, InMemoryMetricReader],
    logs: Any,
) -> None:
    """A drain whose fenced write raised `LeaseLost` (its lease ran out; it lets the error
    propagate, as the README asks) ends `interrupted`/`lease_lost` and is logged as a `claim
    lost`, not a `drain failed`: its span and its `drain.duration` outcome say
    `interrupted` too, with no ERROR status."""
    exporter, reader = otel
    jumping = JumpingClock(clock)
    jumped = trio.Event()

    async def writer(ctx: DrainContext) -> None:
        await jumped.wait()
        with trio.CancelScope(shield=True):  # the write lands before the heartbeat sees it
            await ctx.begin_assistant()

    outcomes: list[Outcome] = []
    async with (
        runtime(store, writer, jumping, lease=9.0, **QUIET) as rt,
        trio.open_nursery() as nursery,
    ):

        async def run() -> None:
            outcomes.append(await rt.run("s"))

        nursery.start_soon(run)
        await trio.testing.wait_all_tasks_blocked()
        jumping.offset += 60.0
        jumped.set()
    [outcome] = outcomes
    assert (outcome.kind, outcome.reason) == ("interrupted", "lease_lost")
    assert isinstance(outcome.error, LeaseLost)
    assert [r.cause for r in records(logs, events.CLAIM_LOST)] == ["write"]
    assert records(logs, events.DRAIN_FAILED) == []
    [span] = spans_named(exporter, events.DRAIN_SPAN)
    assert (span.attributes or {})["trio_sessions.outcome"] == "interrupted"
    assert span.status.status_code is not StatusCode.ERROR
    [duration] = metric_points(reader)[events.DRAIN_DURATION]
    assert (duration.count, duration.attributes) == (1, {"outcome": "interrupted"})


async def test_every_claims_lost_cause_the_metric_carries_is_one_the_readme_lists(
    store: Any,
    clock: Clock,
    autojump_clock: trio.testing.MockClock,
    otel: tuple[InMemorySpanExporter, InMemoryMetricReader],
    logs: Any,
) -> None:
    """A drain whose iteration end's outcome is unknown (`OutcomeUnknown`: a PostgreSQL
    reply lost past the engine's bound) is a lost claim of cause `store`, in the log and in
    the `trio_sessions.claims_lost` counter alike; the README's OpenTelemetry table listed
    only `heartbeat`, `write`, `gone` and `self_fenced`, so an alert written from it on
    that attribute missed these claims. Found reading `_observe.claim_lost` beside it."""
    _, reader = otel
    row = next(
        line for line in README.read_text().splitlines() if f"`{events.CLAIMS_LOST}`" in line
    )
    documented = set(re.findall(r"`([a-z_]+)`", row.split("attribute `cause`", 1)[1]))

    async def lost_reply(op: Any, *args: Any) -> Any:
        await healthy.run(op, *args)  # it landed; its reply did not come back
        raise OutcomeUnknown("the outcome of a COMMIT is unknown")

    async with runtime(store, Recorder(), clock, **QUIET) as rt:
        healthy = rt._db
        rt._db = Intercepted(healthy, {_store.end_iteration: lost_reply})  # type: ignore[assignment]
        await rt.run("s")
        rt._db = healthy
    assert [r.cause for r in records(logs, events.CLAIM_LOST)] == ["store"]
    causes = {p.attributes["cause"] for p in metric_points(reader)[events.CLAIMS_LOST]}
    assert causes == {"store"}
    assert causes <= documented, (causes, documented)


# --- log events' extra fields ---------------------------------------------------------------


async def test_a_failed_drains_error_field_masks_a_password(
    store: Any, clock: Clock, autojump_clock: trio.testing.MockClock, logs: Any
) -> None:
    """A drain error quoting a connection string: the `drain failed` record's traceback is
    masked (`MaskTracebacks`), and so is its `error` field, which a structured handler
    writes out as it is (README: the password is masked in every log line)."""

    async def drain(ctx: DrainContext) -> None:
        await ctx.take_inputs()
        raise ConnectionError("cannot reach postgresql://app:hunter2@db.internal/app")

    async with runtime(store, drain, clock, **QUIET) as rt:
        assert (await rt.run("s")).kind == "failed"
    [record] = records(logs, events.DRAIN_FAILED)
    formatted = logging.Formatter().format(record)
    assert "hunter2" not in formatted  # the traceback is masked ...
    assert "db.internal" in record.error
    assert "hunter2" not in record.error  # ... and so must its `error` field be


def test_a_retry_after_a_terminated_connection_reports_it_as_a_lost_connection(
    pg_url: str, pg_schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A connection the server terminated (`pg_terminate_backend`, as a failover or restart
    does) is retried and logged as `store transaction retried: connection lost` with
    `sqlstate` None, as the README documents for a connection lost before COMMIT - not with
    the server's farewell code 57P01, which is none of the documented ones."""
    caplog.set_level(logging.INFO, logger="trio_sessions")
    with opened(PostgresStore(pg_url, schema=pg_schema).engine()) as engine:
        run_op(engine, _store.wake, "s")
        terminate_backend(pg_url, engine.conn.info.backend_pid)
        run_op(engine, _store.wake, "s")
    [reconnected] = records(caplog, events.STORE_RECONNECTED)
    assert reconnected.backend == "postgres"
    [retry] = records(caplog, events.STORE_RETRY)
    assert retry.sqlstate in (None, "40001", "40P01", "55P03", "57014"), retry.sqlstate
    assert retry.getMessage() == "store transaction retried: connection lost"


@pytest.mark.sqlite_only("the SQLite file's own event")
async def test_a_file_inaccessible_for_a_moment_does_not_silence_its_later_deletion(
    tmp_path: Any,
    clock: Clock,
    autojump_clock: trio.testing.MockClock,
    logs: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A directory permission changed for a moment fails the writes meanwhile with
    `StoreError` and the runtime goes on; deleting the file afterwards must still log
    `database file %s: deleted` (ERROR) - the event documented with `problem` `deleted` or
    `replaced` only, meaning every write fails from then on. (Run as root, a real chmod
    would not deny the look, so `os.stat` of the file is refused by hand.)"""
    path = tmp_path / "sessions.db"
    denied = False
    real_stat = os.stat

    def stat(name: Any, *args: Any, **kwargs: Any) -> Any:
        if denied and str(name) == str(path):
            raise PermissionError(13, "Permission denied", str(name))
        return real_stat(name, *args, **kwargs)

    monkeypatch.setattr(os, "stat", stat)  # the module calls os.stat at each look
    async with runtime(testing.inline_store(path), None, clock) as producer:
        denied = True
        with pytest.raises(StoreError) as refused:
            await producer.submit("s", {"n": 1})
        assert not isinstance(refused.value, StoreLost)  # for a moment only
        denied = False
        await producer.submit("s", {"n": 2})  # the runtime goes on
        path.unlink()
        with pytest.raises(StoreLost):
            await producer.submit("s", {"n": 3})
    problems = [r.problem for r in records(logs, events.DATABASE_FILE_LOST)]
    assert "deleted" in problems, problems
    assert set(problems) <= {"deleted", "replaced"}, problems
