"""Review of argument validation (project rule: every public call validates its arguments
before writing anything and raises a clear ValueError/TypeError or a TrioSessionsError
subclass naming the bad value; the same on both backends).

Each test here fails on the code it was written against, for the reason its docstring gives.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from backends import PgLocation
from conftest import query
from helpers import runtime
from trio.testing import MockClock

import trio_sessions
from trio_sessions import AssistantWriter, DrainContext, testing

Clock = Callable[[], float]
TESTS = str(Path(__file__).parent)


async def take_all(ctx: DrainContext) -> None:
    await ctx.take_inputs()


def created_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


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
