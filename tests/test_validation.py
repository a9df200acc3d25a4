"""Bad arguments to the public API raise ValueError/TypeError before any write: the database
file (main file and WAL) is byte-for-byte unchanged, and `open_runtime` refuses bad
configuration before it creates anything.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import trio

import trio_sessions
from trio_sessions import DrainContext, Runtime, _sqlite, _store, testing

Call = Callable[[Runtime], Awaitable[Any]]


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
            _sqlite.run_op(conn, time.time, _store.finish_iteration, "existing", "exec-1", "owner")
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
