"""Bad arguments to the public API raise ValueError/TypeError before any write: the database
file (main file and WAL) is byte-for-byte unchanged, and `open_runtime` refuses bad
configuration before it creates anything.

Project rule: every public call validates its arguments before writing anything and raises
a clear ValueError/TypeError or a TrioSessionsError subclass naming the bad value; the same
on both backends. The tests after "Review of argument validation" came from that review:
each failed on the code it was written against, for the reason its docstring gives.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from backends import PgLocation, finish_iteration
from conftest import query
from helpers import runtime
from trio.testing import MockClock

import trio_sessions
from trio_sessions import (
    AssistantWriter,
    DrainContext,
    Runtime,
    _cli,
    _metrics,
    _sqlite,
    _store,
    _validate,
    _worker,
    testing,
)

Call = Callable[[Runtime], Awaitable[Any]]
Clock = Callable[[], float]
TESTS = str(Path(__file__).parent)


async def idle_drain(ctx: DrainContext) -> None:
    raise AssertionError("no drain may start from a rejected call")


def file_bytes(path: Path) -> tuple[bytes, bytes | None]:
    wal = path.with_name(path.name + "-wal")
    return path.read_bytes(), (wal.read_bytes() if wal.exists() else None)


def populate(path: Path) -> None:
    """An idle session with history (a taken input and a finished claim): nothing pending,
    so opening a runtime on it starts no work."""
    conn = _sqlite.connect(path)
    try:
        _sqlite.run_op(conn, time.time, _store.submit, "existing", '{"n": 1}', "in-1")
        _sqlite.run_op(conn, time.time, _store.acquire, "existing", "exec-1", "owner", 30_000)
        _sqlite.run_op(conn, time.time, _store.take_inputs, "existing", "exec-1", "owner")
        assert (
            _sqlite.run_op(conn, time.time, finish_iteration, "existing", "exec-1", "owner")
            is False
        )
    finally:
        conn.close()


class NotJson:
    pass


def nested(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for _ in range(depth):
        value = {"a": value}
    return value


LONG_ID = "x" * 201
BAD_IDS: list[Any] = [
    pytest.param("", ValueError, id="empty"),
    pytest.param(LONG_ID, ValueError, id="201-chars"),
    pytest.param("a\x00b", ValueError, id="nul"),
    pytest.param("line\nbreak", ValueError, id="newline"),
    pytest.param("tab\t", ValueError, id="tab"),
    pytest.param(42, TypeError, id="int"),
    pytest.param(None, TypeError, id="none"),
    pytest.param(b"bytes", TypeError, id="bytes"),
]

SESSION_METHODS: dict[str, Callable[[Runtime, Any], Awaitable[Any]]] = {
    "submit": lambda rt, s: rt.submit(s, {"n": 1}),
    "wake": lambda rt, s: rt.wake(s),
    "run": lambda rt, s: rt.run(s),
    "interrupt": lambda rt, s: rt.interrupt(s),
    "transcript": lambda rt, s: rt.transcript(s),
    "wait_idle": lambda rt, s: rt.wait_idle(s),
}

BAD_CALLS: list[Any] = [
    pytest.param(lambda rt: rt.submit("s", ["not", "a", "dict"]), TypeError, id="payload-list"),
    pytest.param(lambda rt: rt.submit("s", "text"), TypeError, id="payload-str"),
    pytest.param(lambda rt: rt.submit("s", None), TypeError, id="payload-none"),
    pytest.param(lambda rt: rt.submit("s", {"a": {1, 2}}), TypeError, id="payload-set"),
    pytest.param(
        lambda rt: rt.submit("s", {"a": float("nan")}), (TypeError, ValueError), id="payload-nan"
    ),
    pytest.param(
        lambda rt: rt.submit("s", {"a": float("inf")}), (TypeError, ValueError), id="payload-inf"
    ),
    pytest.param(lambda rt: rt.submit("s", {"a": NotJson()}), TypeError, id="payload-object"),
    pytest.param(lambda rt: rt.submit("s", {("t",): 1}), TypeError, id="payload-tuple-key"),
    pytest.param(
        lambda rt: rt.submit("existing", {}, input_id=""), ValueError, id="input-id-empty"
    ),
    pytest.param(
        lambda rt: rt.submit("existing", {}, input_id=LONG_ID), ValueError, id="input-id-long"
    ),
    pytest.param(
        lambda rt: rt.submit("existing", {}, input_id="a\nb"), ValueError, id="input-id-newline"
    ),
    pytest.param(lambda rt: rt.submit("existing", {}, input_id=7), TypeError, id="input-id-int"),
    pytest.param(
        lambda rt: rt.interrupt("existing", reason="lease_lost"), ValueError, id="reason-lease-lost"
    ),
    pytest.param(
        lambda rt: rt.interrupt("existing", reason="bogus"), ValueError, id="reason-bogus"
    ),
    pytest.param(lambda rt: rt.interrupt("existing", reason=None), ValueError, id="reason-none"),
    pytest.param(
        lambda rt: rt.submit("existing", {}, delay=1e16), ValueError, id="delay-past-1e9-s"
    ),
    pytest.param(lambda rt: rt.purge(idle_for=1e16), ValueError, id="purge-idle-past-1e9-s"),
    # A seq past 64 bits: OverflowError from SQLite, an undefined function (numeric) from
    # PostgreSQL's truncate, before.
    pytest.param(
        lambda rt: rt.truncate("existing", after_seq=2**63), ValueError, id="after-seq-past-64-bits"
    ),
    pytest.param(
        lambda rt: rt.fork("existing", "fork", through_seq=2**64),
        ValueError,
        id="through-seq-past-64-bits",
    ),
    pytest.param(lambda rt: rt.release_quarantine(5, resume=True), TypeError, id="release-int-id"),
    pytest.param(
        lambda rt: rt.release_quarantine("exec-1", resume="yes"), TypeError, id="release-str-resume"
    ),
    pytest.param(
        lambda rt: rt.release_quarantine("exec-1", resume=False),
        ValueError,
        id="release-not-quarantined",
    ),
]


async def assert_rejected_without_writes(
    db_path: Path,
    call: Call,
    error: type[BaseException] | tuple[type[BaseException], ...],
    match: str | None = None,
) -> None:
    populate(db_path)
    async with trio_sessions.open_runtime(testing.inline_store(db_path), idle_drain) as runtime:
        before = file_bytes(db_path)
        with pytest.raises(error, match=match):
            await call(runtime)
        assert file_bytes(db_path) == before
        assert runtime.active_sessions() == frozenset()


@pytest.mark.parametrize(("session_id", "error"), BAD_IDS)
@pytest.mark.parametrize("method", sorted(SESSION_METHODS))
async def test_bad_session_id_is_rejected_before_any_write(
    db_path: Path, method: str, session_id: Any, error: type[BaseException]
) -> None:
    """Every session-taking method rejects an empty, too long, non-printable or non-str id with
    ValueError/TypeError, and the database file bytes do not change."""
    await assert_rejected_without_writes(
        db_path, lambda rt: SESSION_METHODS[method](rt, session_id), error
    )


# The verbs that take an input's or an execution's id, and the name their error gives it.
ID_VERBS: dict[str, tuple[Callable[[Runtime, Any], Awaitable[Any]], str]] = {
    "cancel_input": (lambda rt, bad: rt.cancel_input(bad), "input_id"),
    "release_quarantine": (
        lambda rt, bad: rt.release_quarantine(bad, resume=False),
        "execution_id",
    ),
}


@pytest.mark.parametrize(("bad_id", "error"), BAD_IDS)
@pytest.mark.parametrize("verb", sorted(ID_VERBS))
async def test_bad_input_or_execution_id_is_rejected_before_any_write(
    db_path: Path, verb: str, bad_id: Any, error: type[BaseException]
) -> None:
    """An id no input or execution can have (empty, too long, non-printable, NUL, not a
    str) is refused as a bad argument naming it - the same on both backends, where the
    store's answer differed (False on SQLite, a StoreError for a NUL on PostgreSQL)."""
    call, what = ID_VERBS[verb]
    await assert_rejected_without_writes(db_path, lambda rt: call(rt, bad_id), error, match=what)


@pytest.mark.parametrize(("session_id", "error"), BAD_IDS)
async def test_is_active_rejects_a_bad_session_id(
    db_path: Path, session_id: Any, error: type[BaseException]
) -> None:
    """`is_active` checks its id as every other session verb does, instead of answering
    False for an id no session can have."""
    async with trio_sessions.open_runtime(testing.inline_store(db_path), idle_drain) as runtime:
        with pytest.raises(error):
            runtime.is_active(session_id)


@pytest.mark.parametrize(("call", "error"), BAD_CALLS)
async def test_bad_argument_is_rejected_before_any_write(
    db_path: Path, call: Call, error: type[BaseException]
) -> None:
    """Non-dict or non-JSON payloads, bad input ids, bad interrupt reasons and bad quarantine
    arguments raise ValueError/TypeError and leave the database file bytes unchanged."""
    await assert_rejected_without_writes(db_path, call, error)


async def test_session_id_of_200_printable_chars_is_accepted(db_path: Path) -> None:
    """The boundary is inclusive: a 200-character printable id (non-ASCII too) is a valid key."""

    async def leave_inputs(ctx: DrainContext) -> None:
        pass

    populate(db_path)
    async with trio_sessions.open_runtime(testing.inline_store(db_path), leave_inputs) as runtime:
        session_id = "é" * 200
        assert await runtime.submit(session_id, {"n": 1}, input_id="i" * 200) == "i" * 200
        await runtime.wait_idle(session_id)
    conn = _sqlite.connect(db_path)
    try:
        assert conn.execute("SELECT id FROM session_input").fetchall() == [("i" * 200,)]
    finally:
        conn.close()


def test_deeply_nested_payload_is_a_value_or_type_error(db_path: Path) -> None:
    """A payload too deep to encode is rejected as a bad argument, not with RecursionError."""
    # trio.run directly (not pytest-trio) so an escaping exception is not wrapped in a group.
    trio.run(
        assert_rejected_without_writes,
        db_path,
        lambda rt: rt.submit("s", nested(100_000)),
        (TypeError, ValueError),
    )


def test_non_string_payload_key_is_rejected(db_path: Path) -> None:
    """A payload whose keys are not strings is not a JSON object and is rejected."""
    trio.run(
        assert_rejected_without_writes, db_path, lambda rt: rt.submit("s", {1: "a"}), TypeError
    )


# ---------------------------------------------------------------------------------------------
# open_runtime configuration

BAD_CONFIG: list[Any] = [
    pytest.param({"lease": 0}, ValueError, id="lease-zero"),
    pytest.param({"lease": -1.0}, ValueError, id="lease-negative"),
    pytest.param({"lease": float("nan")}, ValueError, id="lease-nan"),
    pytest.param({"lease": float("inf")}, ValueError, id="lease-inf"),
    pytest.param({"lease": "30"}, TypeError, id="lease-str"),
    pytest.param({"lease": True}, TypeError, id="lease-bool"),
    pytest.param({"lease": 1e16}, ValueError, id="lease-past-1e9-s"),
    pytest.param({"lease": 10.0, "heartbeat_interval": 10.0}, ValueError, id="heartbeat-equal"),
    pytest.param({"lease": 10.0, "heartbeat_interval": 11.0}, ValueError, id="heartbeat-longer"),
    pytest.param({"heartbeat_interval": 0}, ValueError, id="heartbeat-zero"),
    pytest.param({"heartbeat_interval": -5}, ValueError, id="heartbeat-negative"),
    pytest.param({"recovery_interval": 0}, ValueError, id="recovery-interval-zero"),
    pytest.param({"recovery_interval": None}, TypeError, id="recovery-interval-none"),
    pytest.param({"recovery_batch": 0}, ValueError, id="recovery-batch-zero"),
    pytest.param({"recovery_batch": -1}, ValueError, id="recovery-batch-negative"),
    pytest.param({"recovery_batch": 1.5}, TypeError, id="recovery-batch-float"),
    pytest.param({"recovery_batch": True}, TypeError, id="recovery-batch-bool"),
    pytest.param({"recovery_batch": 2**63}, ValueError, id="recovery-batch-past-64-bits"),
    pytest.param({"max_active": 2**63}, ValueError, id="max-active-past-64-bits"),
    pytest.param({"max_resumes": 2**63}, ValueError, id="max-resumes-past-64-bits"),
    pytest.param({"max_resumes": -1}, ValueError, id="max-resumes-negative"),
    pytest.param({"max_resumes": "3"}, TypeError, id="max-resumes-str"),
    pytest.param({"owner_id": ""}, ValueError, id="owner-empty"),
    pytest.param({"owner_id": "a\nb"}, ValueError, id="owner-newline"),
    pytest.param({"owner_id": 3}, TypeError, id="owner-int"),
    pytest.param({"clock": 1.0}, TypeError, id="clock-not-callable"),
    pytest.param({"acquisition_hook": "hook"}, TypeError, id="hook-not-callable"),
]


def created_files(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in tmp_path.iterdir())


@pytest.mark.parametrize(("options", "error"), BAD_CONFIG)
async def test_open_runtime_rejects_bad_configuration_before_creating_anything(
    tmp_path: Path, options: dict[str, Any], error: type[BaseException]
) -> None:
    """lease <= 0, heartbeat >= lease, bad intervals, batch sizes, budgets, owner ids, clocks
    or hooks raise ValueError/TypeError and no database file is created."""
    path = tmp_path / "never.db"
    with pytest.raises(error):
        async with trio_sessions.open_runtime(testing.inline_store(path), idle_drain, **options):
            pytest.fail("the runtime must not open")
    assert created_files(tmp_path) == []


@pytest.mark.parametrize(
    ("store", "drain", "error"),
    [
        pytest.param(42, idle_drain, TypeError, id="store-int"),
        pytest.param(None, idle_drain, TypeError, id="store-none"),
        pytest.param("unused.db", "not callable", TypeError, id="drain-not-callable"),
    ],
)
async def test_open_runtime_rejects_bad_store_or_drain(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    store: Any,
    drain: Any,
    error: type[BaseException],
) -> None:
    """A store that is neither a path nor a Store, or a drain that is not callable, is refused
    before anything is created."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(error):
        async with trio_sessions.open_runtime(store, drain):
            pytest.fail("the runtime must not open")
    assert created_files(tmp_path) == []


async def test_bad_configuration_leaves_an_existing_file_unchanged(db_path: Path) -> None:
    """Refusing a configuration never touches an existing database."""
    populate(db_path)
    before = file_bytes(db_path)
    with pytest.raises(ValueError, match="heartbeat"):
        async with trio_sessions.open_runtime(
            testing.inline_store(db_path), idle_drain, lease=5.0, heartbeat_interval=6.0
        ):
            pytest.fail("the runtime must not open")
    assert file_bytes(db_path) == before


def test_lease_below_one_millisecond_is_rejected(tmp_path: Path) -> None:
    """A lease that truncates to 0 ms is as unusable as lease=0 and is rejected the same way."""

    async def main() -> None:
        with pytest.raises(ValueError, match="lease"):
            async with trio_sessions.open_runtime(
                testing.inline_store(tmp_path / "x.db"), idle_drain, lease=0.0004
            ):
                pass

    trio.run(main)


@pytest.mark.parametrize("lease", [0.0004, 0.001, 0.002, 0.0029])
async def test_a_lease_no_heartbeat_can_keep_is_refused_naming_it(
    tmp_path: Path, lease: float
) -> None:
    """A lease shorter than `MIN_LEASE` (3 ms) is refused before anything is created,
    naming the value and why. Found by the audit (audU53): `lease=0.001` (also the worker's
    `--lease 0.001`) opened, and every drain stopped at once as `lease_lost` - its default
    heartbeat (lease/3, shorter than the 1 ms an explicit `heartbeat_interval` may be) could
    not renew it before its local deadline at 90% of it."""
    refused = rf"lease must be 0.003 to 1e\+09 seconds, got {lease}: its default heartbeat"
    with pytest.raises(ValueError, match=refused):
        async with trio_sessions.open_runtime(
            testing.inline_store(tmp_path / "x.db"), idle_drain, lease=lease
        ):
            pytest.fail("the runtime must not open")
    assert created_files(tmp_path) == []
    flags = _cli.build_parser().parse_args(["worker", "m:drain", "--lease", str(lease)])
    with pytest.raises(_worker.UsageError, match=refused):
        _worker.settings_from(flags, {"TRIO_SESSIONS_STORE": "env.db"})


@pytest.mark.parametrize("lease", [0, -1, float("nan")])
def test_a_lease_that_is_no_duration_is_refused_without_the_heartbeats_reason(
    lease: float,
) -> None:
    """The heartbeat's reason fits a lease above 0 and below `MIN_LEASE` only: a zero,
    negative or NaN lease is refused naming the range alone (found by the review revE53:
    -1 was told a heartbeat could not renew "a shorter one")."""
    with pytest.raises(ValueError, match=r"lease must be 0.003 to 1e\+09 seconds, got") as info:
        _validate.lease(lease)
    assert "heartbeat" not in str(info.value)


@pytest.mark.parametrize("lease", [_validate.MIN_LEASE, 0.1])
async def test_the_shortest_lease_drains(
    tmp_path: Path, clock: Any, autojump_clock: MockClock, lease: float
) -> None:
    """`lease=MIN_LEASE` opens and its drain runs to completion, renewed by heartbeats; so
    does a short lease a test under a virtual clock takes (DESIGN §5 refuses `lease <= 0`
    only: an earlier bound of 0.5 s refused it)."""

    async def slow(ctx: DrainContext) -> None:
        await trio.sleep(10 * lease)

    async with runtime(testing.inline_store(tmp_path / "x.db"), slow, clock, lease=lease) as rt:
        assert await rt.run("s") == trio_sessions.Outcome("succeeded")


def sync_drain(ctx: DrainContext) -> None:
    pass


class SyncCallable:
    def __call__(self, ctx: DrainContext) -> None:
        pass


class AsyncCallable:
    async def __call__(self, ctx: DrainContext) -> None:
        pass


@pytest.mark.parametrize(
    "drain",
    [
        pytest.param(sync_drain, id="def"),
        pytest.param(lambda ctx: None, id="lambda"),
        pytest.param(SyncCallable(), id="sync-callable-object"),
    ],
)
async def test_open_runtime_refuses_a_drain_that_is_not_async(tmp_path: Path, drain: Any) -> None:
    """A plain def drain (function, lambda or object with a sync __call__) is refused with
    TypeError before anything is created."""
    with pytest.raises(TypeError, match="async"):
        async with trio_sessions.open_runtime(testing.inline_store(tmp_path / "db"), drain):
            pytest.fail("the runtime must not open")
    assert created_files(tmp_path) == []


async def test_open_runtime_accepts_an_object_with_an_async_call(tmp_path: Path) -> None:
    """A callable object whose __call__ is async is a valid drain."""
    async with trio_sessions.open_runtime(
        testing.inline_store(tmp_path / "db"), AsyncCallable()
    ) as runtime:
        assert await runtime.run("s") == trio_sessions.Outcome("succeeded")


@pytest.mark.parametrize(
    ("value", "error"),
    [
        pytest.param("full", ValueError, id="lowercase"),
        pytest.param("OFF", ValueError, id="off"),
        pytest.param("", ValueError, id="empty"),
        pytest.param(2, TypeError, id="int"),
    ],
)
def test_sqlite_store_rejects_a_bad_synchronous_setting(
    tmp_path: Path, value: Any, error: type[BaseException]
) -> None:
    """SQLiteStore(synchronous=...) accepts only 'NORMAL' or 'FULL', refused at construction."""
    with pytest.raises(error, match="synchronous"):
        trio_sessions.SQLiteStore(tmp_path / "db", synchronous=value)
    assert trio_sessions.SQLiteStore(tmp_path / "db").synchronous == "NORMAL"
    assert created_files(tmp_path) == []


async def test_payload_over_the_size_limit_is_refused_naming_its_size(db_path: Path) -> None:
    """A payload whose encoding exceeds MAX_PAYLOAD_BYTES (1 MiB) raises ValueError naming its
    size and the limit, before any write; one exactly at the limit is stored."""
    from trio_sessions._codec import MAX_PAYLOAD_BYTES

    assert MAX_PAYLOAD_BYTES == 1024 * 1024
    at_limit = {"x": "a" * (MAX_PAYLOAD_BYTES - len('{"x":""}'))}
    too_big = {"x": "a" * (MAX_PAYLOAD_BYTES - len('{"x":""}') + 1)}
    await assert_rejected_without_writes(db_path, lambda rt: rt.submit("s", too_big), ValueError)
    async with trio_sessions.open_runtime(testing.inline_store(db_path), None) as producer:
        with pytest.raises(ValueError, match=f"{MAX_PAYLOAD_BYTES + 1} bytes.*{MAX_PAYLOAD_BYTES}"):
            await producer.submit("s", too_big)
        assert await producer.submit("s", at_limit, input_id="big") == "big"


# =============================================================================================
# Review of argument validation


async def take_all(ctx: DrainContext) -> None:
    await ctx.take_inputs()


def store_created(db_path: Any) -> bool:
    """Whether opening created the store: the SQLite file, or tables in the PostgreSQL
    schema (the fixture creates the schema itself, empty)."""
    if isinstance(db_path, PgLocation):
        return query(
            db_path,
            "SELECT COUNT(*) FROM information_schema.tables WHERE table_schema = ?",
            (db_path.schema,),
        ) != [(0,)]
    return Path(db_path).exists()


# ---------------------------------------------------------------------------------------------
# AssistantWriter.settle_tool / fail_tool: the call id


SETTLEMENTS: dict[str, Callable[[AssistantWriter, Any], Awaitable[None]]] = {
    "settle_tool": lambda writer, call_id: writer.settle_tool(call_id, {"r": 1}),
    "fail_tool": lambda writer, call_id: writer.fail_tool(call_id, "boom"),
}
BAD_CALL_IDS: list[Any] = [
    pytest.param(0, id="int"),
    pytest.param(None, id="none"),
    pytest.param(b"c1", id="bytes"),
    pytest.param("", id="empty"),
    pytest.param("c1\x00", id="nul"),
]


@pytest.mark.parametrize("call_id", BAD_CALL_IDS)
@pytest.mark.parametrize("verb", sorted(SETTLEMENTS))
async def test_settling_with_a_call_id_no_tool_can_have_is_a_bad_argument(
    store: Any,
    db_path: Any,
    clock: Clock,
    autojump_clock: MockClock,
    verb: str,
    call_id: Any,
) -> None:
    """settle_tool/fail_tool check their call id as start_tool does: a non-str, empty or
    NUL-holding id is a TypeError/ValueError naming `call_id`, nothing is written and the
    drain goes on - not an UnknownToolCall that fails the drain even though it caught it."""
    raised: list[Exception] = []
    rows: list[Any] = []

    async def drain(ctx: DrainContext) -> None:
        await ctx.take_inputs()
        writer = await ctx.begin_assistant()
        await writer.start_tool("c1", "search", {"q": "x"})
        rows.append(query(db_path, "SELECT data, version FROM session_message"))
        try:
            await SETTLEMENTS[verb](writer, call_id)
        except Exception as exc:
            raised.append(exc)
        rows.append(query(db_path, "SELECT data, version FROM session_message"))
        await writer.settle_tool("c1", {"r": "fine"})
        await writer.finish()

    async with runtime(store, drain, clock) as rt:
        await rt.submit("s", {"t": "hi"})
        outcome = await rt.run("s")
    [error] = raised
    assert isinstance(error, TypeError | ValueError), repr(error)
    assert "call_id" in str(error)
    assert rows[0] == rows[1]
    assert outcome.kind == "succeeded", outcome


# ---------------------------------------------------------------------------------------------
# open_runtime(acquisition_hook=...): an async callable, as the drain


def sync_hook(claim: trio_sessions.Claim) -> None:
    pass


class SyncHook:
    def __call__(self, claim: trio_sessions.Claim) -> None:
        pass


@pytest.mark.pg_unmigrated  # asserts that nothing was created
@pytest.mark.parametrize(
    "hook",
    [
        pytest.param(sync_hook, id="def"),
        pytest.param(lambda claim: None, id="lambda"),
        pytest.param(SyncHook(), id="sync-callable-object"),
    ],
)
async def test_open_runtime_refuses_a_hook_that_is_not_async(
    store: Any, db_path: Any, hook: Any
) -> None:
    """A plain def acquisition_hook is refused with TypeError before the store is created,
    as a plain def drain is - not accepted, to fail every claim later with "object NoneType
    can't be used in 'await' expression" (its drain never runs)."""
    with pytest.raises(TypeError, match="acquisition_hook"):
        async with trio_sessions.open_runtime(store, take_all, acquisition_hook=hook) as rt:
            pytest.fail(f"the runtime opened with a sync hook; a run ended {await rt.run('s')}")
    assert not store_created(db_path)


# ---------------------------------------------------------------------------------------------
# open_runtime(clock=...): what the clock returns


@pytest.mark.pg_unmigrated  # asserts that nothing was created
@pytest.mark.parametrize(
    "reading",
    [
        pytest.param(math.nan, id="nan"),
        pytest.param(math.inf, id="inf"),
        pytest.param(1e20, id="past-64-bit-ms"),
        pytest.param("1800000000", id="str"),
        pytest.param(None, id="none"),
    ],
)
async def test_a_clock_that_gives_no_usable_time_is_refused_before_the_store_is_created(
    store: Any, db_path: Any, reading: Any
) -> None:
    """A clock returning NaN, infinity, a time past 64-bit milliseconds or a non-number is
    refused by open_runtime with a TypeError/ValueError naming the clock, before the store is
    created, the same on both backends. Before: the store was created and migrated, then
    the first transaction raised a bare ValueError, OverflowError or TypeError that does
    not name the clock (a str reading became a 10,000-digit number), and on PostgreSQL a
    time past 64 bits a StoreError (UndefinedFunction: ts_recovery_scan(..., numeric))."""
    with pytest.raises((TypeError, ValueError), match="clock") as raised:
        async with trio_sessions.open_runtime(store, take_all, clock=lambda: reading):
            pytest.fail("the runtime opened with a clock that gives no time")
    assert not isinstance(raised.value, trio_sessions.StoreError)
    assert not store_created(db_path)


def _clock_needing_an_argument(now: float) -> float:
    return now


def _clock_that_raises() -> float:
    readings: dict[str, float] = {}
    return readings["now"]


@pytest.mark.pg_unmigrated  # asserts that nothing was created
@pytest.mark.parametrize(
    "bad_clock",
    [
        pytest.param(_clock_needing_an_argument, id="needs-an-argument"),
        pytest.param(_clock_that_raises, id="raises"),
    ],
)
async def test_a_clock_that_cannot_be_read_is_refused_naming_the_clock(
    store: Any, db_path: Any, bad_clock: Any
) -> None:
    """A clock that cannot be called without arguments, or that raises when read, is a
    TypeError naming the clock and what its reading raised, before the store is created -
    not the bare error of the call (`missing 1 required positional argument`,
    `KeyError: 'now'`), which names nothing the caller passed."""
    with pytest.raises(TypeError, match=r"^clock must be a zero-argument callable") as raised:
        async with trio_sessions.open_runtime(store, take_all, clock=bad_clock):
            pytest.fail("the runtime opened with a clock that cannot be read")
    assert isinstance(raised.value.__cause__, TypeError | KeyError)
    assert type(raised.value.__cause__).__name__ in str(raised.value)
    assert not store_created(db_path)


async def test_a_clock_that_goes_bad_later_fails_its_call_naming_the_clock(
    store: Any, db_path: Any, clock: Clock, autojump_clock: MockClock
) -> None:
    """A clock that gave a usable time at open and NaN later fails the call whose transaction
    read it with a ValueError naming the clock, writing nothing, and the runtime goes on once
    the clock gives times again (on SQLite the transaction is rolled back, not left open to
    fail every later one with "cannot start a transaction within a transaction")."""
    broken = [False]

    def flaky() -> float:
        return math.nan if broken[0] else clock()

    async with runtime(store, take_all, flaky) as rt:
        await rt.submit("s", {"t": "one"})
        await rt.wait_idle("s")
        broken[0] = True
        with pytest.raises(ValueError, match="clock"):
            await rt.submit("s", {"t": "two"})
        broken[0] = False
        assert query(db_path, "SELECT COUNT(*) FROM session_input") == [(0,)]
        await rt.submit("s", {"t": "three"})
        await rt.wait_idle("s")
        transcript = await rt.transcript("s")
    assert [m.data for m in transcript] == [{"t": "one"}, {"t": "three"}]


@pytest.mark.parametrize(
    "epoch",
    [
        pytest.param("1800000000", id="str"),
        pytest.param(None, id="none"),
        pytest.param(math.nan, id="nan"),
        pytest.param(True, id="bool"),
    ],
)
async def test_trio_clock_checks_its_epoch(epoch: Any) -> None:
    """testing.trio_clock(epoch) refuses an epoch that is no finite number of seconds when
    called - not a clock that returns NaN, or raises on its first reading deep inside the
    runtime's first transaction."""
    with pytest.raises((TypeError, ValueError), match="epoch"):
        testing.trio_clock(epoch)


# ---------------------------------------------------------------------------------------------
# testing.set_seams: async callables only


@pytest.mark.parametrize("seam", ["before_finish", "after_finish", "before_recovery_apply"])
async def test_set_seams_refuses_a_seam_that_is_not_async(
    store: Any, clock: Clock, autojump_clock: MockClock, seam: str
) -> None:
    """A seam is awaited: a plain def is refused by set_seams with a TypeError naming it,
    instead of failing the next drain at its finish ("object NoneType can't be used in
    'await' expression")."""
    sync_seams: dict[str, Any] = {seam: lambda *args: None}
    async with runtime(store, take_all, clock) as rt:
        with pytest.raises(TypeError, match=seam):
            testing.set_seams(rt, **sync_seams)


@pytest.mark.parametrize(
    ("helper", "bad", "what"),
    [
        pytest.param(testing.crash, None, "runtime", id="crash-none"),
        pytest.param(testing.crash, "rt", "runtime", id="crash-str"),
        pytest.param(testing.set_seams, None, "runtime", id="set-seams-none"),
        pytest.param(testing.inline_store, 5, "store", id="inline-store-int"),
        pytest.param(testing.inline_store, None, "store", id="inline-store-none"),
    ],
)
def test_testing_helpers_refuse_what_is_no_runtime_or_store_naming_it(
    helper: Callable[[Any], Any], bad: Any, what: str
) -> None:
    """The testing helpers check their first argument as the API does: a TypeError naming
    what was expected. Found by the audit (audY55): `crash(None)` and `set_seams(None)`
    raised AttributeError ("'NoneType' object has no attribute '_closed'"), and
    `inline_store(5)` os.fspath's own TypeError, which names no store."""
    with pytest.raises(TypeError, match=what):
        helper(bad)


# ---------------------------------------------------------------------------------------------
# open_runtime: a store name that is no durable SQLite file


@pytest.mark.parametrize(
    "make_store",
    [
        pytest.param(lambda: "", id="empty-path"),
        pytest.param(lambda: ":memory:", id="memory-path"),
        pytest.param(lambda: trio_sessions.SQLiteStore(""), id="store-empty"),
        pytest.param(lambda: testing.inline_store(":memory:"), id="inline-store-memory"),
    ],
)
async def test_open_runtime_refuses_an_in_memory_sqlite_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, make_store: Callable[[], Any]
) -> None:
    """The store names "" and ":memory:" are no file SQLite keeps: a producer on one is
    refused with a ValueError naming the store (as the worker refuses them), not opened on
    a private temporary database where calls then fail with StoreError "no such table"
    (inline, `submit` even returns an id, "durable", for an input nobody will see)."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"store|memory"):
        async with trio_sessions.open_runtime(make_store(), None) as producer:
            pytest.fail(f"opened; submit returned {await producer.submit('s', {'t': 'hi'})!r}")
    assert created_files(tmp_path) == []


# ---------------------------------------------------------------------------------------------
# Store flags

NOT_A_BOOL: Any = "no"
NOT_A_PATH: list[Any] = [42, None]


@pytest.mark.parametrize(
    "make_store",
    [
        pytest.param(
            lambda url: trio_sessions.SQLiteStore("x.db", inline=NOT_A_BOOL), id="sqlite-inline"
        ),
        pytest.param(
            lambda url: trio_sessions.PostgresStore(url, inline=NOT_A_BOOL), id="postgres-inline"
        ),
        pytest.param(
            lambda url: trio_sessions.PostgresStore(url, listen=NOT_A_BOOL), id="postgres-listen"
        ),
        pytest.param(lambda url: trio_sessions.SQLiteStore(NOT_A_PATH[0]), id="sqlite-path-int"),
        pytest.param(lambda url: trio_sessions.SQLiteStore(NOT_A_PATH[1]), id="sqlite-path-none"),
    ],
)
def test_store_constructors_check_their_arguments(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, make_store: Callable[[str], Any]
) -> None:
    """SQLiteStore/PostgresStore refuse a non-bool `inline`/`listen` (the string "no" turned
    both on) and a path that is no path, at construction with a TypeError naming the
    argument - as they already do for `synchronous`, `schema` and `writers`."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TypeError, match=r"inline|listen|path"):
        make_store("postgresql://user@localhost/db")
    assert created_files(tmp_path) == []


# ---------------------------------------------------------------------------------------------
# Calls from another trio run


async def test_a_call_from_another_trio_run_is_refused_before_any_write(
    store: Any, db_path: Any
) -> None:
    """A runtime lives in the trio run that opened it: awaiting its verbs in another run (a
    worker thread running trio.run) raises RuntimeError before anything is written - not
    commit the input and then start its drain in the other run's nursery, which ends that
    run with TrioInternalError (inline stores; with the default thread executors the
    runtime's own run hangs)."""
    async with trio_sessions.open_runtime(store, take_all) as rt:

        def submit_from_another_run() -> BaseException | None:
            try:
                trio.run(rt.submit, "elsewhere", {"t": "hi"})
            except BaseException as exc:  # what the other run ended with
                return exc
            return None

        error = await trio.to_thread.run_sync(submit_from_another_run)
        assert isinstance(error, RuntimeError), repr(error)
        assert query(db_path, "SELECT COUNT(*) FROM session") == [(0,)]


# ---------------------------------------------------------------------------------------------
# Ids that are str subclasses


class CaseFolded(str):
    """A str whose == and hash ignore case (such classes exist for headers, user names)."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, str) and self.casefold() == other.casefold()

    def __hash__(self) -> int:
        return hash(self.casefold())


async def test_a_str_subclass_session_id_names_the_session_of_its_text(
    store: Any, db_path: Any, clock: Clock, autojump_clock: MockClock
) -> None:
    """The store keys sessions by their exact text, so the runtime must too: with "abc"
    running, `CaseFolded("ABC")` is another session - not active here, and `run` on it
    records its own wake and runs its own drain. Before, the id went into the runtime's
    registry as given: its __eq__/__hash__ made it "abc", so is_active said True and run
    joined abc's execution, recording nothing for "ABC"."""
    gate = trio.Event()
    entered = trio.Event()
    drained: list[str] = []

    async def drain(ctx: DrainContext) -> None:
        await ctx.take_inputs()
        drained.append(ctx.session_id)
        if ctx.session_id == "abc":
            entered.set()
            await gate.wait()

    async with runtime(store, drain, clock) as rt:
        await rt.submit("abc", {"t": "hi"})
        await entered.wait()
        other = CaseFolded("ABC")
        active = rt.is_active(other)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(rt.run, other)
            await trio.testing.wait_all_tasks_blocked()
            gate.set()
        await rt.wait_idle("abc")
    assert active is False
    assert sorted(drained) == ["ABC", "abc"]
    assert sorted(query(db_path, "SELECT id FROM session")) == [("ABC",), ("abc",)]


# ---------------------------------------------------------------------------------------------
# A store path that is no UTF-8 text


async def test_a_store_path_with_a_lone_surrogate_opens_or_is_refused_before_creating_it(
    tmp_path: Path,
) -> None:
    """A path holding a lone surrogate (how Python spells a file name whose bytes are not
    UTF-8) either works as a store, or is refused as a bad argument naming the store before
    anything is created - as every other lone surrogate a caller passes is. Before: the
    file was created and migrated, then taking the liveness token read `PRAGMA
    database_list` and a bare sqlite3.OperationalError ("Could not decode to UTF-8 column
    'file'") escaped, outside the library's errors, leaving the file behind."""
    path = tmp_path / "\udcff.db"
    refused: Exception | None = None
    try:
        async with trio_sessions.open_runtime(path, take_all) as rt:
            await rt.submit("s", {"t": "hi"})
            await rt.wait_idle("s")
            assert [m.role for m in await rt.transcript("s")] == ["user"]
    except (TypeError, ValueError) as exc:
        refused = exc
    if refused is not None:
        assert "store" in str(refused)
        assert created_files(tmp_path) == []


# ---------------------------------------------------------------------------------------------
# The worker command: a setting open_runtime refuses is a usage error


@pytest.mark.parametrize(
    ("argv", "environ"),
    [
        pytest.param(["--max-active", str(2**63)], {}, id="flag-past-64-bits"),
        pytest.param([], {"TRIO_SESSIONS_MAX_ACTIVE": str(2**63)}, id="env-past-64-bits"),
    ],
)
def test_a_max_active_past_64_bits_is_a_usage_error(
    tmp_path: Path, argv: list[str], environ: dict[str, str]
) -> None:
    """The worker checks --max-active as open_runtime does (1 to 2**63-1): one past 64 bits
    exits 2 naming max-active, as --max-active 0 does - not passed on to open_runtime,
    whose ValueError the worker logged as "worker failed" with a traceback, exit 1."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRIO_SESSIONS_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [TESTS, env.get("PYTHONPATH")]))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "trio_sessions",
            "worker",
            "worker_drain:reply",
            "--store=x.db",
            *argv,
        ],
        cwd=tmp_path,
        env={**env, **environ},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert "max-active" in done.stderr
    assert "Traceback" not in done.stderr
    assert created_files(tmp_path) == []


@pytest.mark.parametrize(
    "bind", ["host:\u00b2", "host:\u0668\u0660", "host:" + "9" * 5000, "host:", ":80", "h:65536"]
)
def test_a_metrics_bind_that_names_no_port_is_refused_naming_it(bind: str) -> None:
    """`--metrics-bind HOST:PORT` takes an ASCII port of 0-65535; anything else is a
    `ValueError` naming the value. Found by the audit (audU53): a superscript digit (which
    `str.isdigit` counts) or a port of 5,000 digits escaped as int()'s own error
    ("invalid literal for int()", "Exceeds the limit"), and Arabic-Indic digits bound
    port 80."""
    with pytest.raises(ValueError, match="expected HOST:PORT, got"):
        _metrics.parse_bind(bind)
    assert _metrics.parse_bind("[::1]:9464") == ("::1", 9464)


# ---------------------------------------------------------------------------------------------
# The owner id


async def test_runtimes_opened_in_one_millisecond_get_their_own_owner_ids(
    store: Any, clock: Clock, autojump_clock: MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An owner id is "name + host + pid + random nonce, unique per runtime instance": two
    runtimes of one process opened in the same millisecond (a nursery starting several)
    still get two ids, and both drain. Found by the audit (audY55): the nonce was the first
    12 hex digits of a new id - its millisecond, not its random bits - so 1,000 ids made in
    a row held 2 distinct values, and the second runtime's open waited for the first's
    liveness token (the same file or advisory lock), then failed with StoreError."""
    frozen = time.time_ns()
    monkeypatch.setattr(_store.common, "time", type("Frozen", (), {"time_ns": lambda: frozen}))
    async with runtime(store, take_all, clock) as first, runtime(store, take_all, clock) as second:
        assert first.owner_id != second.owner_id
        assert await second.run("s") == trio_sessions.Outcome(kind="succeeded")
    assert len({_validate.make_owner_id(None) for _ in range(100)}) == 100


# ---------------------------------------------------------------------------------------------
# A postgresql:// URL without the `postgres` extra installed

NO_EXTRA_URL = "postgresql://app:sekrit@127.0.0.1:1/app"


@pytest.fixture
def without_psycopg(monkeypatch: pytest.MonkeyPatch) -> None:
    """As after `pip install trio-sessions` without `[postgres]`: psycopg cannot be
    imported, and the PostgreSQL backend was never imported in this process."""
    monkeypatch.setitem(sys.modules, "psycopg", None)
    for name in list(sys.modules):
        if name == "trio_sessions._postgres" or name.startswith("trio_sessions._postgres."):
            monkeypatch.delitem(sys.modules, name)


@pytest.mark.usefixtures("without_psycopg")
@pytest.mark.parametrize(
    "open_store",
    [
        pytest.param(lambda: trio_sessions.open_runtime(NO_EXTRA_URL, take_all), id="open-runtime"),
        pytest.param(
            lambda: trio_sessions.open_runtime(testing.inline_store(NO_EXTRA_URL), take_all),
            id="inline-store",
        ),
    ],
)
async def test_a_postgres_url_without_the_extra_says_how_to_install_it(
    open_store: Callable[[], Any],
) -> None:
    """DESIGN §8: PostgreSQL is an optional extra. Without it, a postgresql:// URL raises a
    StoreError saying to `pip install 'trio-sessions[postgres]'` (as the operator CLI
    already did), password masked. Found by the audit (audY55): `open_runtime` and
    `testing.inline_store` raised psycopg's bare ModuleNotFoundError, and the worker command
    logged it as a bug, with a traceback."""
    with pytest.raises(trio_sessions.StoreError, match=r"trio-sessions\[postgres\]") as raised:
        async with open_store():
            pass
    assert "sekrit" not in str(raised.value)


@pytest.mark.usefixtures("without_psycopg")
@pytest.mark.parametrize("schema", [[], ["--schema", "chat"]], ids=["public", "schema"])
def test_the_worker_without_the_postgres_extra_says_how_to_install_it(
    caplog: pytest.LogCaptureFixture, schema: list[str]
) -> None:
    """The worker command given a postgresql:// URL without psycopg logs one line naming the
    extra and exits 1 - no traceback, as for any store it cannot use."""
    with caplog.at_level("ERROR", logger="trio_sessions.worker"):
        status = _cli.main(["worker", "worker_drain:reply", "--store", NO_EXTRA_URL, *schema])
    assert status == 1
    [failed] = [r for r in caplog.records if r.getMessage().startswith("worker failed")]
    assert "trio-sessions[postgres]" in failed.getMessage()
    assert failed.exc_info is None
    assert "sekrit" not in failed.getMessage()
