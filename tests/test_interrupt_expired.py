"""An interrupt of another owner's expired claim (a dead owner's, or one a graceful
shutdown handed back) racing a recovery pass, on both backends: the mark is never
overwritten by a takeover while `interrupt()` returned True - a pass that read the claim
as 'running' before the mark re-reads it under the session lock and finishes it as
cancelled (set-wise path and row path alike), and a mark that lands just after a takeover
stops the resumed drain."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from helpers import Raw, Recorder, now_ms, open_tool_message, runtime

import trio_sessions
from trio_sessions import DrainContext, RecoveryReport, Store, testing
from trio_sessions._codec import decode_assistant
from trio_sessions._loops import CHANGE_FALLBACK_POLL
from trio_sessions._model import INTERRUPTED

Clock = Callable[[], float]
QUIET = {"recovery_interval": 10_000.0}  # passes only when the test asks for one


def seed_expired(raw: Raw, clock: Clock, *, open_reply: bool, handed_back: bool) -> str | None:
    """Session s: another owner's expired running claim, optionally handed back by a
    graceful shutdown, optionally with an open reply (then only the row path decides it),
    and one untaken input."""
    raw.seed_claim("s", "old-e", expires_at=now_ms(clock) - 1)
    if handed_back:
        raw.write("UPDATE session_execution SET handed_back = 1 WHERE id = 'old-e'")
    message_id = raw.seed_assistant("s", "old-e", 1, open_tool_message()) if open_reply else None
    raw.write(
        "INSERT INTO session_input(id, session_id, seq, payload, time_created)"
        " VALUES ('left', 's', 2, '{}', 0)"
    )
    return message_id


def assert_finished_cancelled(raw: Raw, message_id: str | None) -> None:
    """Session s's claim finished as cancelled: gone, no resume counted, and its open reply
    (if seeded) finished `interrupted`."""
    assert raw.claim("s") is None
    assert raw.rows("SELECT wake_attempts FROM session WHERE id = 's'") == [(0,)]
    if message_id is not None:
        [(data,)] = raw.rows("SELECT data FROM session_message WHERE id = ?", (message_id,))
        reply = decode_assistant(data, key=message_id)
        assert (reply.finished, reply.error) == (True, INTERRUPTED)


@pytest.mark.parametrize("handed_back", [False, True], ids=["dead", "handed_back"])
@pytest.mark.parametrize("open_reply", [False, True], ids=["set_wise", "row_path"])
async def test_a_mark_between_a_passs_scan_and_its_takeover_finishes_the_claim_cancelled(
    store: Store,
    clock: Clock,
    db_path: Path,
    autojump_clock: trio.testing.MockClock,
    open_reply: bool,
    handed_back: bool,
) -> None:
    """The pass's scan read the claim as 'running'; the interrupt commits its mark before
    the pass applies (`before_recovery_apply`): accepted, and the pass finishes the claim
    as cancelled - its open reply `interrupted`, no resume counted, the untaken input to
    exactly one fresh successor - never resumes it."""
    raw = Raw(db_path)
    drain = Recorder()
    accepted: list[bool] = []
    async with (
        trio_sessions.open_runtime(store, None, clock=clock) as producer,
        runtime(store, drain, clock, **QUIET) as rt,
    ):
        message_id = seed_expired(raw, clock, open_reply=open_reply, handed_back=handed_back)

        async def stop_it(execution_ids: list[str]) -> None:
            assert execution_ids == ["old-e"]
            accepted.append(await producer.interrupt("s"))

        testing.set_seams(rt, before_recovery_apply=stop_it)
        report = await rt.recover_once()
        testing.set_seams(rt)
        await rt.wait_idle("s")
    assert accepted == [True]
    assert report == RecoveryReport(examined=1, finished_cancelled=1)
    assert [c.resumed for c in drain.calls] == [False]
    assert drain.taken == ["left"]
    assert_finished_cancelled(raw, message_id)


async def test_a_wake_recorded_before_the_mark_of_a_handed_back_claim_gets_one_successor(
    store: Store, clock: Clock, db_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """A rolling restart's handed-back claim; another runtime's `run()` meanwhile is
    deferred (the claim is held elsewhere) with its wake durable, then a user's interrupt
    marks the claim: recovery finishes it as cancelled and the wake - no input behind it -
    still starts exactly one fresh drain (DESIGN §4: wakes recorded before the interrupt
    survive into exactly one successor)."""
    raw = Raw(db_path)
    drain = Recorder()
    async with (
        trio_sessions.open_runtime(store, None, clock=clock) as producer,
        runtime(store, drain, clock, **QUIET) as rt,
    ):
        raw.seed_claim("s", "old-e", expires_at=now_ms(clock) - 1)
        raw.write("UPDATE session_execution SET handed_back = 1 WHERE id = 'old-e'")
        assert (await producer.run("s")).kind == "deferred"
        assert await producer.interrupt("s")
        report = await rt.recover_once()
        await rt.wait_idle("s")
    assert report == RecoveryReport(examined=1, finished_cancelled=1)
    assert [c.resumed for c in drain.calls] == [False]
    assert raw.claim("s") is None
    assert raw.rows("SELECT wake_attempts, time_woken FROM session WHERE id = 's'") == [(0, None)]


@pytest.mark.parametrize("handed_back", [False, True], ids=["dead", "handed_back"])
@pytest.mark.parametrize("open_reply", [False, True], ids=["set_wise", "row_path"])
async def test_a_mark_just_after_a_takeover_stops_the_resumed_drain(
    store: Store,
    clock: Clock,
    db_path: Path,
    autojump_clock: trio.testing.MockClock,
    open_reply: bool,
    handed_back: bool,
) -> None:
    """The other order: the pass took the claim over first (the interrupt waited for the
    session lock) and the mark lands on the new claim right after its commit
    (`acquisition_hook`): accepted, and the resumed drain is stopped - its claim ends,
    nothing keeps running - and the input waiting goes to exactly one successor."""
    raw = Raw(db_path)
    calls: list[DrainContext] = []
    accepted: list[bool] = []
    producer_box: list[Any] = []

    async def drain(ctx: DrainContext) -> None:
        calls.append(ctx)
        if ctx.resumed:
            await trio.sleep_forever()  # only the interrupt ends it
        await ctx.take_inputs()

    async def hook(claim: Any) -> None:
        if claim.resumed:
            accepted.append(await producer_box[0].interrupt("s"))

    async with trio_sessions.open_runtime(store, None, clock=clock) as producer:
        producer_box.append(producer)
        async with runtime(store, drain, clock, acquisition_hook=hook, **QUIET) as rt:
            seed_expired(raw, clock, open_reply=open_reply, handed_back=handed_back)
            report = await rt.recover_once()
            await rt.wait_idle("s")
    assert report.resumed == 1
    assert accepted == [True]
    assert [c.resumed for c in calls][:1] == [True]
    assert all(not c.resumed for c in calls[1:])
    assert raw.claim("s") is None
    assert raw.rows("SELECT id FROM session_input") == []


@pytest.mark.parametrize("stop", ["interrupt", "double_text"])
@pytest.mark.parametrize("by", ["worker", "producer"])
@pytest.mark.parametrize("open_reply", [False, True], ids=["set_wise", "row_path"])
async def test_a_stop_of_a_dead_owners_expired_claim_is_finished_at_once(
    store: Store,
    clock: Clock,
    db_path: Path,
    autojump_clock: trio.testing.MockClock,
    open_reply: bool,
    by: str,
    stop: str,
) -> None:
    """A user's Stop (or a message sent with `on_busy="interrupt"`) of a claim whose dead
    owner's lease ran out: a recovery pass finishes it as cancelled at once - the worker's
    own when the worker took the Stop, and the worker's change look brings one when
    another runtime took it - not at the next pass of
    `recovery_interval` (here 10,000 s; 5 s by default, with the reply open until then).
    The untaken input goes to one fresh drain within the change loop's fallback poll (how
    the deterministic SQLite executor sees another runtime's commit; PostgreSQL's signal
    and a real SQLite reader's come at once)."""
    raw = Raw(db_path)
    drain = Recorder()
    async with (
        trio_sessions.open_runtime(store, None, clock=clock) as producer,
        runtime(store, drain, clock, **QUIET) as rt,
    ):
        message_id = seed_expired(raw, clock, open_reply=open_reply, handed_back=False)
        stopping = rt if by == "worker" else producer
        if stop == "interrupt":
            assert await stopping.interrupt("s")
        else:
            await stopping.submit(
                "s", {"text": "stop, and this"}, input_id="new", on_busy="interrupt"
            )
        with trio.fail_after(CHANGE_FALLBACK_POLL + 1.0):
            await drain.entered.wait()
        await rt.wait_idle("s")
    assert [c.resumed for c in drain.calls] == [False]
    assert sorted(drain.taken) == (["left"] if stop == "interrupt" else ["left", "new"])
    assert_finished_cancelled(raw, message_id)


def test_postgres_set_wise_recovery_reads_a_mark_that_committed_while_it_waited(
    pg_url: str, migrated_schema: str
) -> None:
    """PostgreSQL: the interrupt's transaction holds the session lock with its mark not yet
    committed while `ts_recover` (a claim with nothing to close: the set-wise path) waits for
    that lock. Its decision reads the claim in a snapshot taken after the lock, so it finds
    the mark and leaves the claim to the row path, which finishes it as cancelled - a
    snapshot from before the lock would read 'running' and its takeover would write
    'running' over the mark of an interrupt that returned True."""
    import threading

    from helpers import pg_engine_at, pg_raw

    from trio_sessions import _backend, _store
    from trio_sessions._decisions import RecoveryDecision
    from trio_sessions._store.recovery_scan import scan_and_lease

    with pg_raw(pg_url, migrated_schema) as conn:
        conn.execute("INSERT INTO session(id, time_created) VALUES ('s', 0)")
        conn.execute(
            "INSERT INTO session_execution(id, session_id, owner_id, phase, time_created,"
            " expires_at) VALUES ('old-e', 's', 'dead-owner', 'running', 0, 500)"
        )
    with pg_engine_at(pg_url, migrated_schema, 1.0) as engine:
        scan = _backend.Job(scan_and_lease, ("rec", 10, [], [], 30_000))
        engine.run_batch([scan])
        _, _, leased, _ = scan.unwrap()
        assert [(c.session_id, c.execution_id) for c in leased] == [("s", "old-e")]
        with pg_raw(pg_url, migrated_schema) as holder:
            holder.execute("BEGIN")
            holder.execute("SELECT ts_lock('s')")  # as ts_request_cancel: the lock first
            holder.execute("UPDATE session_execution SET phase = 'cancelling' WHERE id = 'old-e'")
            apply = _backend.Job(
                _store.apply_recovery_batch, ("rec", [(leased[0], "new-e")], 30_000, 3)
            )
            runner = threading.Thread(target=engine.run_batch, args=([apply],))
            runner.start()
            with pg_raw(pg_url, migrated_schema) as watcher:
                # Until the recovery's backend waits for the session lock the holder holds
                # (not merely started): only then is the mark committed during its wait.
                waiting = (
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
                )
                deadline = time.monotonic() + 30.0
                while watcher.execute(waiting).fetchall() == [(0,)]:
                    assert time.monotonic() < deadline, "the recovery never waited for the lock"
                    assert runner.is_alive(), "the recovery ended without waiting for the lock"
                    time.sleep(0.01)
            holder.execute("COMMIT")
            runner.join(30.0)
            assert not runner.is_alive()
        [result] = apply.unwrap()
    assert result.decision is RecoveryDecision.FINISH_CANCELLED
    with pg_raw(pg_url, migrated_schema) as conn:
        assert conn.execute("SELECT id FROM session_execution").fetchall() == []
