"""Owner liveness (DESIGN §4 "Owner liveness", §6.22): a dead owner's sessions resume in about
`takeover_grace`, not after the lease; a live, paused or partitioned owner keeps its claims
until its lease runs out; an owner that loses its token while alive stops its drains at once.

Real processes killed with SIGKILL or stopped with SIGSTOP, on a real SQLite file and a real
PostgreSQL server, at the default 30 s lease: bounded in real time (a few seconds each). The
in-process tests use the inline stores and the virtual clock.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trio.testing
from backends import PgLocation, rows
from helpers import (
    LosableToken,
    LosableTokenExecutor,
    Raw,
    Recorder,
    SlowToExit,
    WrappedStore,
    now_ms,
    runtime,
    terminate_backend,
)

import trio_sessions
from trio_sessions import DrainContext, _liveness, _store, testing
from trio_sessions._model import AssistantData

GRACE = 0.5

WORKER = """
import sys, trio, trio_sessions

async def drain(ctx):
    await ctx.take_inputs()
    writer = await ctx.begin_assistant()
    await writer.append_text("working")
    print("CLAIMED", ctx.session_id, flush=True)
    await trio.sleep_forever()

async def main(store, sessions):
    async with trio_sessions.open_runtime(store, drain, recovery_interval=3600) as runtime:
        for index in range(sessions):
            await runtime.submit(f"s{index}", {"n": index})
        await trio.sleep_forever()

target, schema, sessions = sys.argv[1], sys.argv[2], int(sys.argv[3])
if schema:
    from trio_sessions._postgres import PostgresStore
    store = PostgresStore(target, schema=schema)
else:
    store = target
trio.run(main, store, sessions)
"""


def target_of(location: Path | PgLocation) -> tuple[str, str]:
    if isinstance(location, PgLocation):
        return location.url, location.schema
    return str(location), ""


def threaded_store(location: Path | PgLocation) -> Any:
    """The production store (worker threads, change signal, liveness poll), real time."""
    if isinstance(location, PgLocation):
        from trio_sessions._postgres import PostgresStore

        return PostgresStore(location.url, schema=location.schema)
    return str(location)


@contextmanager
def owner_process(
    location: Path | PgLocation, tmp_path: Path, sessions: int
) -> Iterator[subprocess.Popen[str]]:
    """A worker process holding `sessions` claims at the default 30 s lease; killed after."""
    script = tmp_path / "owner.py"
    script.write_text(WORKER)
    process = subprocess.Popen(
        [sys.executable, str(script), *target_of(location), str(sessions)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        claimed: set[str] = set()
        while len(claimed) < sessions:  # blocks until every drain holds its claim
            line = process.stdout.readline()
            assert line.startswith("CLAIMED"), line
            claimed.add(line.split()[1])
        yield process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGCONT)
            process.kill()
        process.wait(timeout=10)
        if process.stdout is not None:
            process.stdout.close()


@pytest.fixture(params=["sqlite", "postgres"])
def location(request: pytest.FixtureRequest, tmp_path: Path) -> Path | PgLocation:
    if request.param == "postgres":
        return PgLocation(request.getfixturevalue("pg_url"), request.getfixturevalue("pg_schema"))
    return tmp_path / "live.db"


class Resumes:
    """A drain recording when each resumed session started (monotonic) and finishing it."""

    def __init__(self) -> None:
        self.started: dict[str, float] = {}
        self.all = trio.Event()
        self.expected = 0

    async def __call__(self, ctx: DrainContext) -> None:
        self.started.setdefault(ctx.session_id, time.monotonic())
        assert ctx.resumed
        writer = await ctx.begin_assistant()
        await writer.append_text("resumed")
        await writer.finish()
        if len(self.started) >= self.expected:
            self.all.set()


@pytest.mark.serial
@pytest.mark.slow
async def test_sigkilled_owner_is_resumed_after_the_grace_not_the_lease(
    location: Path | PgLocation, tmp_path: Path
) -> None:
    """SIGKILL an owner holding 5 claims at the default 30 s lease: another runtime, which
    left them alone while the owner lived, resumes every one within grace + about a second."""
    resumes = Resumes()
    resumes.expected = 5
    with owner_process(location, tmp_path, 5) as process:
        async with trio_sessions.open_runtime(
            threaded_store(location), resumes, takeover_grace=GRACE
        ) as runtime:
            await trio.sleep(1.5)  # the owner lives: its claims are never taken over
            assert resumes.started == {}
            assert runtime.statistics().recovery.resumed == 0
            killed = time.monotonic()
            process.send_signal(signal.SIGKILL)
            with trio.fail_after(10):
                await resumes.all.wait()
            for session_id in resumes.started:
                await runtime.wait_idle(session_id)
    takeover = max(resumes.started.values()) - killed
    assert GRACE <= takeover < GRACE + 1.5, takeover
    assert sorted(resumes.started) == [f"s{i}" for i in range(5)]
    assert rows(location, "SELECT COUNT(*) FROM session_execution") == [(0,)]


@pytest.mark.serial
@pytest.mark.slow
async def test_sigstopped_owner_is_taken_over_only_at_lease_expiry(
    location: Path | PgLocation, tmp_path: Path
) -> None:
    """A paused owner (SIGSTOP) still holds its token: its claim is taken over only once the
    lease ran out (the new claim is created at or after the old expiry), never at the grace."""
    with owner_process(location, tmp_path, 1) as process:
        [(old_expiry,)] = rows(location, "SELECT expires_at FROM session_execution")
        process.send_signal(signal.SIGSTOP)
        # Shorten the stopped owner's lease (as if it stopped 27 s ago) to keep this bounded.
        write_expiry = old_expiry - 27_000
        _write(location, "UPDATE session_execution SET expires_at = ?", (write_expiry,))
        await resumed_by_another_runtime(location, "s0")
        [(created,)] = rows(
            location,
            "SELECT MIN(time_created) FROM session_message WHERE role = 'assistant'"
            " AND data LIKE '%resumed%'",
        )
    assert created >= write_expiry


def _write(location: Path | PgLocation, sql: str, params: tuple[Any, ...]) -> None:
    from backends import write

    write(location, sql, params)


async def resumed_by_another_runtime(location: Path | PgLocation, session_id: str) -> None:
    """A runtime of the production store resumes the one claim left (`Resumes`) and
    finishes it."""
    resumes = Resumes()
    resumes.expected = 1
    async with trio_sessions.open_runtime(
        threaded_store(location), resumes, takeover_grace=GRACE, recovery_interval=0.2
    ) as runtime:
        with trio.fail_after(10):
            await resumes.all.wait()
        await runtime.wait_idle(session_id)


async def token_held_again(location: PgLocation, owner_id: str) -> None:
    """Until the owner's token is held again (it noticed its loss and took it again)."""
    with trio.fail_after(10):
        while not rows(
            location,
            "SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 2"
            " AND granted AND objid = (hashtext(?)::bigint & 4294967295)::oid",
            (owner_id,),
        ):
            await trio.sleep(0.01)


def _token_pid(location: PgLocation, owner_id: str) -> int:
    [(pid,)] = rows(
        location,
        "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 2 AND granted"
        " AND objid = (hashtext(?)::bigint & 4294967295)::oid",
        (owner_id,),
    )
    return int(pid)


@pytest.mark.serial
@pytest.mark.slow
async def test_an_owner_that_loses_its_token_stops_its_drains_at_once(
    pg_url: str, pg_schema: str
) -> None:
    """PostgreSQL: the token's connection is killed under a live owner. Its drain is
    cancelled within milliseconds (well inside the grace), writes nothing more, its claim
    is handed back once the drain exited and is resumed (never while the old drain ran); the
    owner takes its token again and drains new work."""
    location = PgLocation(pg_url, pg_schema)
    events: list[tuple[str, float]] = []
    entered = trio.Event()

    async def drain(ctx: DrainContext) -> None:
        if ctx.resumed or ctx.session_id != "s":
            events.append(("resumed" if ctx.resumed else "fresh", time.monotonic()))
            return
        await ctx.take_inputs()
        writer = await ctx.begin_assistant()
        entered.set()
        try:
            await trio.sleep_forever()
        finally:
            events.append(("old drain exited", time.monotonic()))
            with trio.CancelScope(shield=True):  # a write now must be refused
                try:
                    await writer.append_text("zombie")
                except trio_sessions.LeaseLost:
                    events.append(("refused", time.monotonic()))

    store = threaded_store(location)
    async with trio_sessions.open_runtime(store, drain, takeover_grace=GRACE) as owner:
        await owner.submit("s", {"n": 1})
        await entered.wait()
        killed = time.monotonic()
        terminate_backend(pg_url, _token_pid(location, owner.owner_id))
        with trio.fail_after(10):
            while not any(kind == "resumed" for kind, _ in events):
                await trio.sleep(0.01)
        await owner.wait_idle("s")
        await token_held_again(location, owner.owner_id)
        outcome = await owner.run("fresh")
    kinds = [kind for kind, _ in events]
    times = dict(events)
    assert times["old drain exited"] - killed < 0.2
    assert kinds == ["old drain exited", "refused", "resumed", "fresh"]
    assert rows(location, "SELECT COUNT(*) FROM session_message WHERE data LIKE '%zombie%'") == [
        (0,)
    ]
    assert times["old drain exited"] <= times["resumed"] < killed + 2.0
    assert outcome.kind == "succeeded"


@contextmanager
def limited_role(pg_url: str, schema: str, limit: int) -> Iterator[str]:
    """A login role allowed `limit` connections at once (a DBA's per-role limit), with what
    a runtime needs of the (migrated) schema; the URL that logs in as it (with a password,
    which the server's trust never asks for: it must not show anywhere)."""
    import urllib.parse
    import uuid

    import psycopg

    role = f"limited_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {role} LOGIN CONNECTION LIMIT {limit}")
        conn.execute(f'GRANT USAGE ON SCHEMA "{schema}" TO {role}')
        conn.execute(f'GRANT ALL ON ALL TABLES IN SCHEMA "{schema}" TO {role}')
    try:
        parts = urllib.parse.urlsplit(pg_url)
        host = parts.netloc.rpartition("@")[2]
        yield urllib.parse.urlunsplit(parts._replace(netloc=f"{role}:{SECRET}@{host}"))
    finally:
        with psycopg.connect(pg_url, autocommit=True) as conn:
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s",
                (role,),
            )
            conn.execute(f'REVOKE ALL ON ALL TABLES IN SCHEMA "{schema}" FROM {role}')
            conn.execute(f'REVOKE USAGE ON SCHEMA "{schema}" FROM {role}')
            conn.execute(f"DROP ROLE {role}")


SECRET = "tok3n-s3cret"


async def test_a_liveness_token_that_cannot_be_connected_fails_the_open_with_store_error(
    pg_url: str,
    migrated_schema: str,
    monkeypatch: pytest.MonkeyPatch,
    logs: pytest.LogCaptureFixture,
) -> None:
    """Found by an audit. The store answers the writers and the listener, but the liveness
    token's own connection is refused (here: the role's connection limit, sized for the
    writers and the listener only). Opening a runtime that drains failed after 20 s with
    trio's `TooSlowError` from the token's hidden retry loop, the server's refusal never
    shown nor logged. Now it fails with a `StoreError` that carries the last refusal
    (password masked), as the inline store and SQLite's token say why, and each failed
    attempt is logged. Real time: under a virtual clock the loop's bound would pass during
    the first connect."""
    from helpers import records

    from trio_sessions import StoreError, _observe
    from trio_sessions._postgres import WRITERS, PostgresStore

    monkeypatch.setattr(_liveness, "PG_TAKE_PATIENCE_S", 1.0)  # waited out: short here

    async def drain(ctx: DrainContext) -> None:
        await ctx.take_inputs()

    with limited_role(pg_url, migrated_schema, WRITERS + 1) as url:
        store = PostgresStore(url, schema=migrated_schema)
        started = time.monotonic()
        with pytest.raises(StoreError) as raised:
            async with trio_sessions.open_runtime(store, drain):
                pass
        elapsed = time.monotonic() - started
    assert "too many connections" in str(raised.value)
    assert "liveness token" in str(raised.value)
    assert elapsed < 10
    # Logged once: the same refusal at every attempt (a review found a WARNING per attempt,
    # for as long as a server stays down).
    [failed] = records(logs, _observe.TOKEN_TAKE_FAILED)
    assert "too many connections" in failed.error
    assert SECRET not in logs.text
    assert SECRET not in str(raised.value)


FROZEN_IN_HANDOFF = """
import os, sys, time, trio, trio_sessions
from trio_sessions._postgres import PostgresStore

url, schema, release = sys.argv[1], sys.argv[2], sys.argv[3]

async def hook(claim):
    if claim.session_id == "held":
        print("HELD", claim.execution_id, flush=True)
        # The trio thread stops here, as a SIGSTOPped process's, until the test says.
        deadline = time.monotonic() + 20
        while not os.path.exists(release) and time.monotonic() < deadline:
            time.sleep(0.01)

async def drain(ctx):
    print("ENTERED", ctx.execution_id, flush=True)
    await ctx.take_inputs()

async def main():
    store = PostgresStore(url, schema=schema)
    async with trio_sessions.open_runtime(store, drain, acquisition_hook=hook) as runtime:
        print("OWNER", runtime.owner_id, flush=True)
        await runtime.submit("held", {"n": 1})
        await trio.sleep_forever()

trio.run(main)
"""


@attrs.define
class FrozenOwner:
    """An owner process (`FROZEN_IN_HANDOFF`) whose trio thread stopped in the handoff of
    its claim `held`; touching `release` lets it run on. `output`: its stdout, once it was
    killed."""

    owner_id: str
    held: str
    release: Path
    output: str = ""


@contextmanager
def frozen_owner(location: PgLocation, tmp_path: Path) -> Iterator[FrozenOwner]:
    script, release = tmp_path / "frozen.py", tmp_path / "release"
    script.write_text(FROZEN_IN_HANDOFF)
    process = subprocess.Popen(
        [sys.executable, str(script), location.url, location.schema, str(release)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        owner_id = process.stdout.readline().split()[1]
        held = process.stdout.readline().split()  # the trio thread stops after this
        assert held[0] == "HELD", held
        frozen = FrozenOwner(owner_id, held[1], release)
        yield frozen
    finally:
        process.kill()
        output, _ = process.communicate(timeout=10)
    frozen.output = output


@pytest.mark.serial
@pytest.mark.slow
async def test_an_owner_frozen_in_a_claims_handoff_never_starts_it_after_losing_its_token(
    pg_url: str, pg_schema: str, tmp_path: Path
) -> None:
    """PostgreSQL, a real owner process whose trio thread stops in a claim's handoff
    (committed, drain not started), as a paused host's: the server drops its token's
    connection, another runtime takes the claim over after the grace, and then the owner
    runs on. Its drain must not start on that claim: the farewell on the token's socket
    makes it let the token's watch run first, which stops it (the controls soak's seed 15
    overlap: the drain started 4 ms before the owner noticed the loss)."""
    location = PgLocation(pg_url, pg_schema)
    with frozen_owner(location, tmp_path) as owner:
        terminate_backend(pg_url, _token_pid(location, owner.owner_id))
        await resumed_by_another_runtime(location, "held")
        owner.release.touch()  # it runs on, its loss on the token's socket
        await token_held_again(location, owner.owner_id)  # it noticed the loss
    assert f"ENTERED {owner.held}" not in owner.output, owner.output


async def test_a_live_owner_keeps_its_claim_and_a_dead_ones_goes_after_the_grace(
    store: Any, db_path: Any, clock: Callable[[], float], autojump_clock: trio.testing.MockClock
) -> None:
    """Two runtimes, one store: while the owner lives (token held, lease live) no recovery
    pass takes its claim; once it is gone (its token released) the claim is taken over after
    the grace - the first sighting alone is not enough - long before the lease runs out."""
    entered = trio.Event()

    async def holding(ctx: DrainContext) -> None:
        await ctx.take_inputs()
        entered.set()
        await trio.sleep_forever()

    resumed: list[tuple[str, bool]] = []

    async def resume(ctx: DrainContext) -> None:
        resumed.append((ctx.session_id, ctx.resumed))

    quiet: dict[str, Any] = {"clock": clock, "recovery_interval": 1e6, "takeover_grace": GRACE}
    async with trio_sessions.open_runtime(store, resume, **quiet) as other:
        async with trio_sessions.open_runtime(store, holding, **quiet) as owner:
            await owner.submit("s", {"n": 1})
            await entered.wait()
            for _ in range(25):  # 25 s of a 30 s lease, renewed meanwhile
                await trio.sleep(1.0)
                assert (await other.recover_once()).resumed == 0
            testing.crash(owner)
        dead_owner = owner.owner_id
        _wait_released(db_path, dead_owner)
        [(expires_at,)] = rows(db_path, "SELECT expires_at FROM session_execution")
        assert (await other.recover_once()).resumed == 0  # seen free once: not yet gone
        await trio.sleep(GRACE / 2)
        assert (await other.recover_once()).resumed == 0
        await trio.sleep(GRACE / 2)
        assert (await other.recover_once()).resumed == 1
        taken_at = clock() * 1000
        await other.wait_idle("s")
    assert resumed == [("s", True)]
    assert taken_at < expires_at - 20_000


def _wait_released(location: Path | PgLocation, owner_id: str) -> None:
    """A closed PostgreSQL connection's locks go a moment later: wait for that in real time
    (bounded), so the virtual-time steps of the test see the token free."""
    if not isinstance(location, PgLocation):
        return
    deadline = time.monotonic() + 10
    while rows(
        location,
        "SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 2 AND granted"
        " AND objid = (hashtext(?)::bigint & 4294967295)::oid",
        (owner_id,),
    ):
        assert time.monotonic() < deadline, "the token was never released"
        time.sleep(0.001)


def test_token_files_are_private_and_removed_once_free(tmp_path: Path) -> None:
    """SQLite: the token file is created 0600 in a 0700 directory beside the database; a
    probe sees it held while the owner's descriptor is open, free once closed, and removing
    a free owner's file leaves a held one alone."""
    from trio_sessions import _liveness

    database = tmp_path / "db"
    held = _liveness.take_file_token(database, "alive")
    gone = _liveness.take_file_token(database, "gone")
    directory = _liveness.owners_directory(database)
    assert os.stat(directory).st_mode & 0o777 == 0o700
    assert os.stat(_liveness.token_path(directory, "alive")).st_mode & 0o777 == 0o600
    assert _liveness.free_file_tokens(database, None) == set()
    os.close(gone)
    assert _liveness.free_file_tokens(database, None) == {"gone"}
    assert _liveness.free_file_tokens(database, ["alive", "gone", "unknown"]) == {"gone"}
    _liveness.forget_file_tokens(database, ["alive", "gone"])
    assert sorted(os.listdir(directory)) == [
        os.path.basename(_liveness.token_path(directory, "alive"))
    ]
    os.close(held)


async def test_the_watch_for_gone_owners_probes_their_token_files_off_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SQLite: the watch for gone owners probes the token files in a worker thread, not on
    the event loop's. Each probe's system call gives up the GIL, and taking it back waits
    for whatever C call another thread is in - a settle's encode of one part, 10-30 ms -
    so a probe of a few files on the loop held it for 60-100 ms of wall time for 2 ms of
    work: the longest loop steps while a drain settled four 300,000-node tool results."""
    loop = threading.get_ident()
    probed_on: list[int] = []
    probed = trio.Event()
    trio_token = trio.lowlevel.current_trio_token()
    probe = _liveness.free_file_tokens

    def noting_the_thread(database: Any, owner_ids: Any) -> set[str]:
        probed_on.append(threading.get_ident())
        trio_token.run_sync_soon(probed.set)
        return probe(database, owner_ids)

    async def drain(ctx: DrainContext) -> None:
        await ctx.take_inputs()

    async with trio_sessions.open_runtime(tmp_path / "db", drain, recovery_interval=3600):
        # After the open's recovery pass, which probes inside its transaction.
        monkeypatch.setattr(_liveness, "free_file_tokens", noting_the_thread)
        with trio.fail_after(10):  # the watch looks every LIVENESS_POLL (0.25 s)
            await probed.wait()
    assert probed_on and loop not in probed_on


async def test_takeover_grace_is_validated_and_a_producer_holds_no_token(tmp_path: Path) -> None:
    """`takeover_grace` must be a number of seconds (>= 20 ms: a drain starting within 5 ms
    of a look that found its token whole skips its own) before anything opens; a producer
    (`drain=None`) never takes a liveness token, a runtime that drains does."""
    from trio_sessions import _liveness

    database = tmp_path / "v.db"

    async def drain(ctx: DrainContext) -> None:
        await trio.lowlevel.checkpoint()

    bad_values: list[tuple[Any, type[Exception]]] = [
        (0, ValueError),
        (-1.0, ValueError),
        (0.019, ValueError),
        ("1", TypeError),
        (True, TypeError),
    ]
    for bad, error in bad_values:
        with pytest.raises(error, match="takeover_grace"):
            async with trio_sessions.open_runtime(database, drain, takeover_grace=bad):
                pass  # pragma: no cover
    assert _token_files(database) is None  # nothing opened, not even the database
    async with trio_sessions.open_runtime(database, None):
        assert not _token_files(database)
    async with trio_sessions.open_runtime(database, drain) as runtime:
        assert _liveness.free_file_tokens(database, [runtime.owner_id]) == set()
        assert len(_token_files(database) or []) == 1
    assert _liveness.free_file_tokens(database, [runtime.owner_id]) == {runtime.owner_id}


def _token_files(database: Path) -> list[str] | None:
    """The token files beside `database` (None: neither the database nor its directory)."""
    from trio_sessions import _liveness

    if not database.exists():
        return None
    directory = _liveness.owners_directory(database)
    return sorted(os.listdir(directory)) if os.path.isdir(directory) else []


class Spans:
    """A drain recording each execution's span in real time (monotonic start and end): a
    resumed one returns at once; the first takes the input, then waits to be cancelled and
    takes `exit_s` in a thread (a blocking call) to exit. `entered`, `exiting` (its
    cancellation came) and `resumed` mark the steps. With the input taken, the resumed
    execution leaves nothing to do: once it released its claim (`wait_idle` on every
    runtime) exactly two executions ran - a test closing before that may see a third, the
    close handing the resumed claim back to the other runtime."""

    def __init__(self, exit_s: float) -> None:
        self.exit_s = exit_s
        self.spans: dict[str, list[float]] = {}
        self.entered, self.exiting, self.resumed = trio.Event(), trio.Event(), trio.Event()

    async def __call__(self, ctx: DrainContext) -> None:
        started = time.monotonic()
        if ctx.resumed:
            self.spans[ctx.execution_id] = [started, started]
            self.resumed.set()
            return
        self.spans[ctx.execution_id] = [started, math.inf]
        await ctx.take_inputs()
        self.entered.set()
        try:
            await trio.sleep_forever()
        finally:
            self.exiting.set()
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(time.sleep, self.exit_s)
            self.spans[ctx.execution_id][1] = time.monotonic()

    def end_and_resumed_start(self) -> tuple[float, float]:
        """When the first drain ended and the resumed one started (exactly two ran)."""
        (_, old_end), (new_start, _) = sorted(self.spans.values())
        return old_end, new_start


@pytest.mark.slow
@pytest.mark.parametrize(
    ("exit_s", "grace_s"), [(0.3, 1.0), (1.5, 0.3)], ids=["within-the-grace", "past-the-grace"]
)
async def test_a_drain_still_exiting_after_its_token_was_lost_keeps_its_claim(
    pg_url: str, pg_schema: str, exit_s: float, grace_s: float
) -> None:
    """PostgreSQL, DESIGN §6.21: an owner's token connection is killed while its drain needs
    `exit_s` to exit (a blocking call in a thread). Another runtime may see the token free
    for a moment, but takes nothing over: the owner takes its token again at once, and
    hands the claim back once its drain exited - also when that takes longer than the
    grace (then the token was free for good until the drain exited: the two drains
    overlapped)."""
    location = PgLocation(pg_url, pg_schema)
    drain = Spans(exit_s)
    store = threaded_store(location)
    options: dict[str, Any] = {"takeover_grace": grace_s, "recovery_interval": 0.25}
    async with (
        trio_sessions.open_runtime(store, drain, **options) as owner,
        trio_sessions.open_runtime(store, drain, **options) as other,
    ):
        await owner.submit("s", {"n": 1})
        with trio.fail_after(10):
            await drain.entered.wait()
        terminate_backend(pg_url, _token_pid(location, owner.owner_id))
        with trio.fail_after(10):
            await drain.resumed.wait()
            await owner.wait_idle("s")
            await other.wait_idle("s")
    old_end, new_start = drain.end_and_resumed_start()
    assert old_end <= new_start


@pytest.mark.serial
@pytest.mark.slow
async def test_a_token_lost_while_a_graceful_close_waits_for_a_drain_is_taken_again(
    pg_url: str, pg_schema: str
) -> None:
    """PostgreSQL, DESIGN §6.21: the owner is closing (a worker's SIGTERM) and waits for a
    drain that needs a while to exit (a blocking call in a thread) when the server drops
    its token's connection. The owner takes its token again at once, so the claim still
    looks held, and hands it back once the drain exited: the other runtime resumes it only
    then. Before, the token's watch was cancelled with the runtime's other tasks as the
    close began, so nothing took the token again: the other runtime found it free for the
    grace and resumed the session while the old drain still ran. Found by an audit: a real
    rolling restart of two workers, the closing one's token backend terminated."""
    location = PgLocation(pg_url, pg_schema)
    drain = Spans(1.5)
    store = threaded_store(location)
    options: dict[str, Any] = {"takeover_grace": 0.3, "recovery_interval": 0.25}

    async def drop_the_token_once_closing(owner_id: str) -> None:
        await drain.exiting.wait()
        await trio.to_thread.run_sync(
            lambda: terminate_backend(pg_url, _token_pid(location, owner_id))
        )

    async with (
        trio_sessions.open_runtime(store, drain, **options) as other,
        trio.open_nursery() as helpers,
    ):
        async with trio.open_nursery() as nursery:
            owner = await nursery.start(
                functools.partial(trio_sessions.serve_runtime, store, drain, **options)
            )
            helpers.start_soon(drop_the_token_once_closing, owner.owner_id)
            await owner.submit("s", {"n": 1})
            with trio.fail_after(10):
                await drain.entered.wait()
            nursery.cancel_scope.cancel()  # the owner closes: its drain takes 1.5 s to exit
        with trio.fail_after(10):
            await drain.resumed.wait()
            await other.wait_idle("s")
    old_end, new_start = drain.end_and_resumed_start()
    assert old_end <= new_start


async def test_closing_takes_a_lost_token_again_while_it_waits_for_a_drain(
    store: Any, clock: Callable[[], float], autojump_clock: trio.testing.MockClock
) -> None:
    """The same in virtual time, on both backends: a token lost while closing waits for a
    drain to exit is taken again before the drain exited (the watch outlives the close's
    cancellation, as the heartbeat does), and the claim is handed back once it did."""
    wrapped = WrappedStore(store, LosableTokenExecutor)
    retaken_before_exit: list[bool] = []
    drain = SlowToExit(lambda: retaken_before_exit.append(_token_of(wrapped).retaken.is_set()))

    async def lose_the_token_while_closing() -> None:
        await drain.exiting.wait()
        token = _token_of(wrapped)
        token.lose()
        with trio.move_on_after(1.0):
            await token.retaken.wait()
        drain.may_exit.set()

    await drain.close_during(wrapped, clock, lose_the_token_while_closing, recovery_interval=3600)
    assert retaken_before_exit == [True]


@pytest.mark.parametrize("lost", ["before the close", "while the close waits"])
async def test_a_claim_whose_token_was_lost_is_handed_back_when_the_close_ends(
    store: Any,
    db_path: Any,
    clock: Callable[[], float],
    autojump_clock: trio.testing.MockClock,
    lost: str,
) -> None:
    """The token is lost while a drain takes a while to exit, and the runtime closes (a
    worker's SIGTERM) before that drain exited. The claim is handed back once it did, as
    a token loss without a close hands it back: its lease ended, no resume counted. The
    close cancelled the task that would hand it back, so it kept its lease until the
    process went, and another runtime resumed it after the grace as an owner lost -
    counting a resume against its budget (found by an audit)."""
    wrapped = WrappedStore(store, LosableTokenExecutor)
    drain = SlowToExit()

    async def lose_the_token() -> None:
        _token_of(wrapped).lose()
        await drain.exiting.wait()

    async def exit_later() -> None:
        if lost == "while the close waits":
            await drain.exiting.wait()
            _token_of(wrapped).lose()
        await trio.sleep(1.0)
        drain.may_exit.set()

    before_close = lose_the_token if lost == "before the close" else None
    await drain.close_during(
        wrapped, clock, exit_later, before_close=before_close, recovery_interval=3600
    )
    claim = Raw(db_path).claim("s")
    assert claim is not None and claim[3] <= now_ms(clock), claim  # its lease ended
    [(attempts,)] = rows(db_path, "SELECT wake_attempts FROM session WHERE id = 's'")
    assert attempts == 0


async def _token_taken_again(worker: Any, sessions: list[str]) -> None:
    """The runtime holds its token again and looks: wait until these sessions drained."""
    worker._token_lost = False
    worker._kick.set()
    await trio.testing.wait_all_tasks_blocked()
    for session_id in sessions:
        await worker.wait_idle(session_id)


async def test_an_owner_whose_token_is_lost_takes_no_new_wakes(
    store: trio_sessions.Store, clock: Any, db_path: Any, autojump_clock: trio.testing.MockClock
) -> None:
    """While this runtime's liveness token is lost (taken again within milliseconds, or a
    partition), a claim it makes is handed straight back, so a look at the store takes no
    wakes then: before, each such claim's lost-lease ending kicked another look, which rang
    the next doorbell - a walk through every waiting session of the store, each claimed
    and handed back. Once the token is held again, the waiting sessions drain."""
    raw = Raw(db_path)
    drain = Recorder()
    async with (
        runtime(store, drain, clock, recovery_interval=3600) as worker,
        runtime(store, None, clock) as producer,
    ):
        worker._token_lost = True
        for n in range(5):
            await producer.submit(f"s{n}", {"n": n})
        worker._kick.set()
        await trio.testing.wait_all_tasks_blocked()
        assert [raw.claim(f"s{n}") for n in range(5)] == [None] * 5
        await _token_taken_again(worker, [f"s{n}" for n in range(5)])
    assert sorted(ctx.session_id for ctx in drain.calls) == [f"s{n}" for n in range(5)]


async def test_an_owner_whose_token_is_lost_takes_no_due_scheduled_inputs(
    store: trio_sessions.Store, clock: Any, db_path: Any, autojump_clock: trio.testing.MockClock
) -> None:
    """While this runtime's liveness token is lost, a look or a recovery pass takes no
    sessions (a claim made then is handed straight back) - nor does the due timer: the
    scheduled inputs falling due then are promoted (their doorbells rung for any runtime
    with its token) but not claimed here. Their claims, handed back at once, would wait for
    a recovery pass anywhere (a doorbell-taking look passes over an expired claim) and
    resume as `resumed` drains that never ran (§5.1: due inputs start within 100 ms in
    any runtime that drains)."""
    raw = Raw(db_path)
    drain = Recorder()
    async with runtime(store, drain, clock, recovery_interval=3600) as worker:
        for n in range(3):
            await worker.submit(f"s{n}", {"n": n}, delay=1.0)
        worker._token_lost = True
        await trio.sleep(2.0)  # due: the due timer fires while the token is lost
        await trio.testing.wait_all_tasks_blocked()
        assert [raw.claim(f"s{n}") for n in range(3)] == [None] * 3
        await _token_taken_again(worker, [f"s{n}" for n in range(3)])
    assert sorted(ctx.session_id for ctx in drain.calls) == [f"s{n}" for n in range(3)]
    assert not any(ctx.resumed for ctx in drain.calls)


class _RetakenOnCue(LosableToken):
    """A lost token taken again only once the test says so (`may_retake`): a partition."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.may_retake = trio.Event()

    async def retake(self) -> None:
        await self.may_retake.wait()
        await super().retake()


class _RetakenOnCueExecutor(LosableTokenExecutor):
    @contextlib.asynccontextmanager
    async def hold_token(self, owner_id: str) -> Any:
        async with self._inner.hold_token(owner_id) as inner:
            self.token = _RetakenOnCue(inner)
            yield self.token


async def test_a_run_while_the_token_is_really_lost_is_deferred_and_drains_once_retaken(
    store: Any, clock: Callable[[], float], db_path: Any, autojump_clock: trio.testing.MockClock
) -> None:
    """§6.22 through the token's watch itself (the tests above set the lost flag by hand):
    while our token is lost and not yet taken again, `run` on an idle session claims
    nothing and is deferred - a drain started then would run with its claim looking free
    to the others, who take it over after the grace. Once the token is taken again, the
    durable wake drains here. Found by mutation: a watch that did not flag the loss
    survived every test."""
    wrapped = WrappedStore(store, _RetakenOnCueExecutor)
    drain = Recorder()
    async with runtime(wrapped, drain, clock, recovery_interval=3600) as worker:
        assert wrapped.executor is not None
        token = wrapped.executor.token
        assert isinstance(token, _RetakenOnCue)
        token.lose()
        await trio.testing.wait_all_tasks_blocked()  # the watch noticed, waits to retake
        assert await worker.run("s") == trio_sessions.Outcome("deferred")
        assert drain.calls == []
        assert Raw(db_path).claim("s") is None
        token.may_retake.set()
        await token.retaken.wait()
        await trio.testing.wait_all_tasks_blocked()
        await worker.wait_idle("s")
    assert [ctx.session_id for ctx in drain.calls] == ["s"]


def _token_of(wrapped: WrappedStore[LosableTokenExecutor]) -> LosableToken:
    """The liveness token of the runtime open on `wrapped`."""
    assert wrapped.executor is not None and wrapped.executor.token is not None
    return wrapped.executor.token


async def test_a_token_lost_again_while_the_last_loss_is_handed_back_stops_the_new_drains(
    store: Any, clock: Callable[[], float], autojump_clock: trio.testing.MockClock
) -> None:
    """The token is lost, taken again at once, and lost again while the first loss's claim
    is not yet handed back (its drain takes long to exit, §6.21). A drain started between
    the two losses is stopped at the second at once, as any drain is: its claim looks free
    to the others from then on, who take it over after the grace. Before, the runtime
    looked at its token again only once the first loss's claims were handed back (and a
    recovery pass ran), so that drain ran on, unwatched, beside the owner that took its
    session over (the PostgreSQL soak's overlap, busy token kills of seed 105)."""
    wrapped = WrappedStore(store, LosableTokenExecutor)
    slow_entered, slow_may_exit = trio.Event(), trio.Event()
    new_entered = trio.Event()
    events: list[str] = []

    async def drain(ctx: DrainContext) -> None:
        await ctx.take_inputs()
        if ctx.session_id == "slow":
            slow_entered.set()
            try:
                await trio.sleep_forever()
            finally:
                with trio.CancelScope(shield=True):  # a blocking call that lands later
                    await slow_may_exit.wait()
        new_entered.set()
        try:
            await trio.sleep_forever()
        finally:
            events.append(f"{ctx.session_id} stopped")

    async with runtime(wrapped, drain, clock, recovery_interval=3600) as owner:
        token = _token_of(wrapped)
        await owner.submit("slow", {"n": 1})
        await slow_entered.wait()
        token.lose()
        await token.retaken.wait()
        await owner.submit("new", {"n": 2})
        await new_entered.wait()
        token.lose()  # "slow" has not exited: its claim is not handed back yet
        await trio.testing.wait_all_tasks_blocked()
        stopped_before_slow_exited = list(events)
        slow_may_exit.set()
    assert stopped_before_slow_exited == ["new stopped"]


async def test_a_drain_never_starts_on_a_claim_whose_token_is_seen_lost(
    store: Any, clock: Callable[[], float], autojump_clock: trio.testing.MockClock
) -> None:
    """The owner was paused in the claim handoff (committed, drain not started) while the
    server dropped its token's connection. On resuming, the loss is on the token's socket,
    and the task about to start the drain may run before the one that watches the token -
    while the others take the claim over once the token stayed free for the grace. The
    drain must not start: it lets the watch run first, whose loss stops it, and the claim
    is handed back with the others and resumed (the PostgreSQL controls soak, seed 15: a
    drain entered 4 ms before its owner noticed the loss, beside the owner that had taken
    its session over)."""
    wrapped = WrappedStore(store, LosableTokenExecutor)
    first_claims: list[str] = []
    drained: list[tuple[str, bool]] = []
    resumed = trio.Event()

    async def hook(claim: trio_sessions.Claim) -> None:
        if not first_claims:
            first_claims.append(claim.execution_id)
            _token_of(wrapped).lose()  # and no schedule point: the watch has not run yet

    async def drain(ctx: DrainContext) -> None:
        drained.append((ctx.execution_id, ctx.resumed))
        await ctx.take_inputs()
        resumed.set()

    async with runtime(
        wrapped, drain, clock, recovery_interval=3600, acquisition_hook=hook
    ) as owner:
        await owner.submit("s", {"n": 1})
        await _token_of(wrapped).retaken.wait()
        await resumed.wait()
    [first] = first_claims
    assert [resumed_flag for _, resumed_flag in drained] == [True]
    assert first not in [execution_id for execution_id, _ in drained]


class _BootClock:
    """`_liveness.since_boot` as the test says: it stands still but for `advance`."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.mark.parametrize("paused", ["process", "host"])
async def test_a_pause_just_after_the_tokens_last_look_makes_the_next_drain_look_again(
    store: Any,
    clock: Callable[[], float],
    autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
    paused: str,
) -> None:
    """Drains that start within moments of a look at the token skip their own (the look
    costs a GIL hand-off on PostgreSQL); a pause does not count as a moment. A drain ran
    (its look found the token whole), then the owner stood still in the next claim's
    handoff for the takeover grace while the server dropped its token's connection, with
    no schedule point between the last look and the next drain. That drain must look, and
    not start - whether the process was stopped (trio's clock saw the pause) or its whole
    host was suspended (only a clock that counts suspended time saw it)."""
    boot = _BootClock()
    monkeypatch.setattr(_liveness, "since_boot", boot)
    wrapped = WrappedStore(store, LosableTokenExecutor)
    paused_claims: list[str] = []
    drained: list[tuple[str, str]] = []
    resumed = trio.Event()

    async def hook(claim: trio_sessions.Claim) -> None:
        if claim.session_id == "paused" and not paused_claims:
            paused_claims.append(claim.execution_id)
            _token_of(wrapped).lose()
            # The owner stood still for the grace: time passed, nothing ran.
            if paused == "process":
                autojump_clock.jump(0.5)
                boot.advance(0.5)
            else:
                boot.advance(0.5)

    async def drain(ctx: DrainContext) -> None:
        drained.append((ctx.session_id, ctx.execution_id))
        await ctx.take_inputs()
        if ctx.session_id == "paused":
            resumed.set()

    async with runtime(
        wrapped, drain, clock, recovery_interval=3600, takeover_grace=0.5, acquisition_hook=hook
    ) as owner:
        await owner.submit("first", {"n": 1})
        await owner.wait_idle("first")
        looks_before = _token_of(wrapped).looks
        await owner.submit("paused", {"n": 2})
        await resumed.wait()
    [paused] = paused_claims
    assert looks_before >= 1
    assert ("paused", paused) not in drained
    assert [session for session, _ in drained] == ["first", "paused"]


async def test_drains_starting_together_look_at_the_token_once(
    store: Any,
    clock: Callable[[], float],
    autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A look at the token on PostgreSQL is a syscall that gives up the GIL, and with the
    store's threads busy getting it back cost 25 us a drain call (1,000 sessions in
    flight). Drains that start within moments of a look (no pause can have let another
    owner take their claims over since) skip theirs: twenty starting at one instant look
    once. (The clock that counts a suspended host's time stands still here: on a loaded
    machine twenty drains may take more than the gap in real time.)"""
    monkeypatch.setattr(_liveness, "since_boot", _BootClock())
    wrapped = WrappedStore(store, LosableTokenExecutor)
    sessions = [f"s{i}" for i in range(20)]
    started: list[str] = []

    async def drain(ctx: DrainContext) -> None:
        started.append(ctx.session_id)
        await ctx.take_inputs()

    async with runtime(wrapped, drain, clock, recovery_interval=3600) as owner:
        async with trio.open_nursery() as nursery:
            for session_id in sessions:
                nursery.start_soon(owner.submit, session_id, {"n": 1})
        for session_id in sessions:
            await owner.wait_idle(session_id)
        looks = _token_of(wrapped).looks
    assert sorted(started) == sorted(sessions)
    assert looks == 1


async def test_a_token_that_only_looked_lost_lets_the_drain_start(
    store: Any, clock: Callable[[], float], autojump_clock: trio.testing.MockClock
) -> None:
    """A notice on the token's socket as the drain is about to start (`looks_lost` cannot
    tell it from the server's farewell under TLS): the watch reads it and sees no loss,
    and the drain starts on its claim - no hand-back, no takeover."""
    wrapped = WrappedStore(store, LosableTokenExecutor)
    first_claims: list[str] = []
    drained: list[tuple[str, bool]] = []

    async def hook(claim: trio_sessions.Claim) -> None:
        if not first_claims:
            first_claims.append(claim.execution_id)
            _token_of(wrapped).notice_arrives()

    async def drain(ctx: DrainContext) -> None:
        drained.append((ctx.execution_id, ctx.resumed))
        await ctx.take_inputs()

    async with runtime(
        wrapped, drain, clock, recovery_interval=3600, acquisition_hook=hook
    ) as owner:
        await owner.submit("s", {"n": 1})
        await owner.wait_idle("s")
    assert drained == [(first_claims[0], False)]


class _HandToken:
    """An owner's liveness token taken and released by hand, with no runtime behind it: the
    owner whose claim a test seeds (on SQLite its lock file, on PostgreSQL its advisory lock
    and `session_owner` row, as a runtime takes them)."""

    def __init__(self, location: Path | PgLocation, owner_id: str) -> None:
        self._location = location
        self._owner_id = owner_id
        self._held: Any = None

    def take(self) -> None:
        if isinstance(self._location, PgLocation):
            import psycopg

            conn = psycopg.connect(
                self._location.url,
                autocommit=True,
                options=f"-c search_path={self._location.schema}",
            )
            assert conn.execute(_liveness._TAKE, (self._owner_id,)).fetchone() == (True,)
            conn.execute(_liveness._REGISTER, (self._owner_id,))
            self._held = conn
        else:
            self._held = _liveness.take_file_token(self._location, self._owner_id)

    def release(self) -> None:
        if self._held is None:
            return
        if isinstance(self._location, PgLocation):
            self._held.close()
            _wait_released(self._location, self._owner_id)
        else:
            os.close(self._held)
        self._held = None


@pytest.mark.parametrize("written", [False, True], ids=["plain", "with-a-message"])
async def test_a_takeover_rechecks_the_token_of_an_owner_found_gone(
    store: Any,
    db_path: Any,
    clock: Callable[[], float],
    autojump_clock: trio.testing.MockClock,
    written: bool,
) -> None:
    """§6.22: a recovery pass finds an owner gone (its token free for the grace), and the
    owner takes its token again before the takeover's transaction (a connection that broke
    and came back): that transaction re-checks the token, under its locks, so the owner's
    live claim stays its own. Trusting the pass's earlier sighting would take over a claim
    whose owner is alive and whose lease is live, beside its running drain. Both takeover
    paths: a plain claim (set-wise) and one whose drain wrote a message (row by row)."""
    ghost = _HandToken(db_path, "ghost-owner")
    ghost.take()
    ghost.release()  # registered, then free: the owner's connection broke
    raw = Raw(db_path)
    live_until = int(clock() * 1000) + 60_000
    resumed: list[str] = []

    async def resume(ctx: DrainContext) -> None:
        resumed.append(ctx.session_id)

    async def token_retaken(execution_ids: list[str]) -> None:
        ghost.take()

    quiet: dict[str, Any] = {"clock": clock, "recovery_interval": 1e6, "takeover_grace": GRACE}
    try:
        async with trio_sessions.open_runtime(store, resume, **quiet) as other:
            raw.seed_claim("s", "ghost-exec", expires_at=live_until, owner_id="ghost-owner")
            if written:
                raw.seed_assistant("s", "ghost-exec", 1, AssistantData((), False, None))
            assert (await other.recover_once()).resumed == 0  # seen free: not yet gone
            await trio.sleep(GRACE)
            testing.set_seams(other, before_recovery_apply=token_retaken)
            report = await other.recover_once()
    finally:
        ghost.release()
    assert report.examined == 1  # found gone: its live claim was a candidate
    assert report.resumed == 0
    assert resumed == []
    assert tuple(raw.claim("s")) == ("ghost-exec", "ghost-owner", "running", live_until)


async def test_a_gone_owners_claims_beyond_a_pass_are_taken_over_in_one_look(
    location: Path | PgLocation, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A killed owner held more claims than a recovery pass takes. Once its token stayed
    free for the grace, the passes follow each other at once until its claims are taken:
    the look at the owners that found it gone finds it with no claim left. One pass per
    look (every 0.25 s) made 300 claims wait three looks - found by an audit: a SIGKILLed
    worker's 300 chats resumed at p50 1.8 s on PostgreSQL (DESIGN §7: p50 <= 1 s). Real
    time, threaded stores."""
    entered = {f"s{index}": trio.Event() for index in range(5)}
    left_at_looks: list[list[str]] = []
    forget = _store.forget_gone_owners

    def recording(tx: Any, owner_ids: Any) -> list[str]:
        left = forget(tx, owner_ids)
        left_at_looks.append(left)
        return left

    monkeypatch.setattr(_store, "forget_gone_owners", recording)

    async def holding(ctx: DrainContext) -> None:
        await ctx.take_inputs()
        entered[ctx.session_id].set()
        await trio.sleep_forever()

    resumes = Resumes()
    resumes.expected = len(entered)
    quiet: dict[str, Any] = {"recovery_interval": 3600, "takeover_grace": 0.3}
    async with trio_sessions.open_runtime(
        threaded_store(location), resumes, recovery_batch=2, **quiet
    ) as other:
        async with trio_sessions.open_runtime(threaded_store(location), holding, **quiet) as owner:
            for session_id, claimed in entered.items():
                await owner.submit(session_id, {"n": 1})
                await claimed.wait()
            testing.crash(owner)  # as SIGKILL: its claims stay, their leases live
        with trio.fail_after(10):
            await resumes.all.wait()
            while not left_at_looks:
                await trio.sleep(0.01)
        for session_id in entered:
            await other.wait_idle(session_id)
    assert left_at_looks[0] == []
    assert rows(location, "SELECT COUNT(*) FROM session_execution") == [(0,)]


@pytest.mark.serial
@pytest.mark.parametrize("watching", [False, True])
async def test_a_claim_handed_back_by_a_graceful_close_is_taken_over_at_once(
    location: Path | PgLocation, watching: bool
) -> None:
    """A rolling restart: an owner closes gracefully (its drains exit, their claims are
    handed back with ended leases) while another runtime on the store runs. That runtime
    resumes them through the change signal, within milliseconds - not once the closed
    owner's token has stayed free for the grace (or at its next recovery pass): the grace
    guards against a dead owner's drain that may still run, and a hand-back comes only
    after the drains exited (DESIGN §6.21); more than a pass takes, pass after pass. Real
    time, threaded stores. `watching`: the runtime also watches a session, so its look
    reads statement by statement (on PostgreSQL, not the one call of `ts_changes`)."""
    entered = {f"s{index}": trio.Event() for index in range(5)}

    async def holding(ctx: DrainContext) -> None:
        await ctx.take_inputs()
        entered[ctx.session_id].set()
        await trio.sleep_forever()

    resumes = Resumes()
    resumes.expected = len(entered)
    grace = 2.0  # far longer than a signal and a pass take, on a loaded machine too
    quiet: dict[str, Any] = {"recovery_interval": 3600, "takeover_grace": grace}
    # More claims than a pass takes: the passes follow each other while claims wait.
    other_store = threaded_store(location)
    async with (
        trio_sessions.open_runtime(other_store, resumes, recovery_batch=2, **quiet) as other,
        other.watch("watched") if watching else contextlib.nullcontext(),
    ):
        async with trio_sessions.open_runtime(threaded_store(location), holding, **quiet) as owner:
            for session_id, claimed in entered.items():
                await owner.submit(session_id, {"n": 1})
                await claimed.wait()
            closing = time.monotonic()
        with trio.fail_after(10):
            await resumes.all.wait()
        for session_id in entered:
            await other.wait_idle(session_id)
    takeover = max(resumes.started.values()) - closing
    assert takeover < grace / 2, takeover
    assert rows(location, "SELECT COUNT(*) FROM session_execution") == [(0,)]


@pytest.mark.parametrize("recoverer", ["gone", "alive"])
async def test_a_gone_recoverers_recovery_lease_holds_the_claim_out_only_for_the_grace(
    store: Any,
    db_path: Any,
    clock: Callable[[], float],
    autojump_clock: trio.testing.MockClock,
    recoverer: str,
) -> None:
    """A runtime leased an expired claim for its takeover (a `session_recovery` row for a
    whole lease) and then died - SIGKILL, or a close that withdrew the waiting takeover -
    before taking it over. Its token is free: once it stayed free for the grace, the lease
    is no live one, and another runtime's pass resumes the claim then, not after the lease
    (DESIGN §4: a SIGKILLed owner's sessions resume in about a second). Every pass excluded
    it as "another owner's live recovery lease", whoever held it - found by an audit. A
    live recoverer's lease (its token held) still holds the claim out."""
    hand = _HandToken(db_path, "dead-recoverer")
    hand.take()
    if recoverer == "gone":
        hand.release()
    raw = Raw(db_path)
    expired_at = int(clock() * 1000) - 1
    lease_until = expired_at + 30_000
    resumed: list[str] = []

    async def resume(ctx: DrainContext) -> None:
        resumed.append(ctx.session_id)

    quiet: dict[str, Any] = {"clock": clock, "recovery_interval": 1e6, "takeover_grace": GRACE}
    try:
        async with trio_sessions.open_runtime(store, resume, **quiet) as other:
            raw.seed_claim("s", "dead-exec", expires_at=expired_at)
            raw.write(
                "INSERT INTO session_recovery(execution_id, session_id, owner_id, expires_at,"
                " time_created) VALUES ('dead-exec', 's', 'dead-recoverer', ?, 0)",
                (lease_until,),
            )
            first = await other.recover_once()  # seen free once (if free): not yet gone
            await trio.sleep(GRACE)
            report = await other.recover_once()
            if recoverer == "gone":
                await other.wait_idle("s")
    finally:
        hand.release()
    assert (first.examined, first.resumed) == (0, 0)
    assert clock() * 1000 < lease_until - 20_000
    if recoverer == "gone":
        assert (report.examined, report.resumed) == (1, 1)
        assert resumed == ["s"]
        assert raw.rows("SELECT * FROM session_recovery") == []
    else:
        assert (report.examined, report.resumed) == (0, 0)
        assert resumed == []
        assert tuple(raw.claim("s")) == ("dead-exec", "dead-owner", "running", expired_at)
        assert raw.rows("SELECT owner_id, expires_at FROM session_recovery") == [
            ("dead-recoverer", lease_until)
        ]


async def test_a_gone_recoverers_token_record_stays_while_its_recovery_lease_holds_a_claim(
    store: Any, db_path: Any, clock: Callable[[], float], autojump_clock: trio.testing.MockClock
) -> None:
    """A gone owner's recovery lease is no live one only while the owner is seen gone (its
    token free on record). The look at the owners forgets those gone with no live claims
    after its passes; one whose lease a pass could not take over yet (no room, a claim row
    locked) must stay on record, or it is never seen free again and its lease holds the
    claim out for a whole lease. Its lease on a claim that is gone, an expired one and a
    quarantine keep nobody."""
    raw = Raw(db_path)
    now = int(clock() * 1000)
    owners = ["leasing", "no-claim", "expired", "quarantined"]
    for owner in owners:
        hand = _HandToken(db_path, owner)
        hand.take()
        hand.release()
    async with trio_sessions.open_runtime(store, Recorder(), clock=clock) as other:
        for name in ("leasing", "expired", "quarantined"):
            raw.seed_claim(name, f"exec-{name}", expires_at=now - 1)
        for name, expires_at, error in [
            ("leasing", now + 30_000, None),
            ("no-claim", now + 30_000, None),
            ("expired", now - 1, None),
            ("quarantined", now + 30_000, "malformed"),
        ]:
            raw.write(
                "INSERT INTO session_recovery(execution_id, session_id, owner_id, expires_at,"
                " recovery_error, time_created) VALUES (?, ?, ?, ?, ?, 0)",
                (f"exec-{name}", name, name, expires_at, error),
            )
        left = await other._db.run(_store.forget_gone_owners, owners)
        free = await other._db.read(_store.free_tokens)
    assert left == ["leasing"]
    assert free == {"leasing"}
