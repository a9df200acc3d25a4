"""Lifting the quarantine of a SIGKILLed owner's claim.

A worker killed mid-answer is taken over through its free liveness token long before its
lease ends; a claim whose message does not decode is quarantined then, with the dead
owner's lease still live for up to a lease (30 s by default)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import pytest
import trio
import trio.testing
from backends import PgLocation, rows
from helpers import Raw
from test_liveness import GRACE, _wait_released

import trio_sessions
from trio_sessions import DrainContext, _cli, _liveness, testing

BOTH = pytest.mark.parametrize("backend", ["sqlite", "postgres"], indirect=True)
OPEN = '{"parts": [], "finished": false, "error": null}'


class _Holding:
    """A drain killed mid-answer: it takes its inputs, opens an answer, streams a word and
    holds (`entered` once it did)."""

    def __init__(self) -> None:
        self.entered = trio.Event()

    async def __call__(self, ctx: DrainContext) -> None:
        await ctx.take_inputs()
        writer = await ctx.begin_assistant()
        await writer.append_text("working")
        self.entered.set()
        await trio.sleep_forever()


@BOTH
async def test_a_resume_of_a_dead_owners_quarantined_claim_takes_it_over_at_once(
    store: Any, db_path: Any, clock: Callable[[], float], autojump_clock: trio.testing.MockClock
) -> None:
    """`release_quarantine(e, resume=True)` on a SIGKILLed owner's quarantined claim, its
    message repaired, returned normally and took nothing over: its takeover counted no
    owner as gone, so the dead owner's live lease (quarantined 0.5 s after the kill, most
    of 30 s left) was a live lease to skip, and the session waited for the lease to run out
    and a later pass. DESIGN §4: resume=True "recovers e at once" (durable when it
    returns: the takeover committed and its drain started here). Found by SIGKILLing a
    worker on a poisoned answer, then releasing the quarantine."""
    holding = _Holding()

    resumed: list[bool] = []

    async def resume(ctx: DrainContext) -> None:
        resumed.append(ctx.resumed)

    quiet: dict[str, Any] = {"clock": clock, "recovery_interval": 1e6, "takeover_grace": GRACE}
    raw = Raw(db_path)
    async with trio_sessions.open_runtime(store, resume, **quiet) as other:
        async with trio_sessions.open_runtime(store, holding, **quiet) as owner:
            await owner.submit("s", {"n": 1})
            await holding.entered.wait()
            raw.write("UPDATE session_message SET data = '{bad json' WHERE role = 'assistant'")
            testing.crash(owner)
        _wait_released(db_path, owner.owner_id)
        [(execution_id, expires_at)] = rows(db_path, "SELECT id, expires_at FROM session_execution")
        quarantined = 0
        for _ in range(3):  # seen free, then gone after the grace
            quarantined += (await other.recover_once()).quarantined
            await trio.sleep(GRACE / 2)
        assert quarantined == 1
        assert clock() * 1000 < expires_at - 20_000  # the dead owner's lease is live
        raw.write("UPDATE session_message SET data = ? WHERE role = 'assistant'", (OPEN,))
        await other.release_quarantine(execution_id, resume=True)
        [(owner_id,)] = rows(db_path, "SELECT owner_id FROM session_execution")
        assert owner_id == other.owner_id
        await other.wait_idle("s")
    assert resumed == [True]


def _token_recorded(db_path: Any, owner_id: str) -> bool:
    """Whether the owner's liveness token is on record: its lock file beside the SQLite
    file, or its `session_owner` row."""
    if isinstance(db_path, PgLocation):
        return bool(rows(db_path, "SELECT 1 FROM session_owner WHERE owner_id = ?", (owner_id,)))
    return os.path.exists(_liveness.token_path(_liveness.owners_directory(db_path), owner_id))


def _release_argv(db_path: Any, execution_id: str) -> list[str]:
    if isinstance(db_path, PgLocation):
        where = [db_path.url, "--schema", db_path.schema]
    else:
        where = [str(db_path)]
    return ["quarantine", "release", *where, execution_id, "--resume"]


@pytest.mark.slow
@BOTH
async def test_the_cli_resume_of_a_dead_owners_quarantined_claim_is_taken_at_the_next_pass(
    live_store: Any, db_path: Any
) -> None:
    """`quarantine release --resume` of a SIGKILLed worker's quarantined claim, its message
    repaired: README, "the next recovery pass of any runtime on this file examines the
    execution". The worker beside it, passing every 0.25 s, resumed it only once the dead
    owner's 30 s lease ran out: the pass that quarantined it had forgotten the dead owner
    (its only live claim was quarantined), so nothing counted that lease as a gone owner's
    any more. Found by SIGKILLing a worker on a poisoned answer and releasing the
    quarantine with the CLI."""
    holding = _Holding()

    resumed = trio.Event()
    resumes: list[tuple[str, bool, float]] = []

    async def resume(ctx: DrainContext) -> None:
        resumes.append((ctx.owner_id, ctx.resumed, time.time() * 1000))
        resumed.set()

    raw = Raw(db_path)
    options: dict[str, Any] = {"takeover_grace": GRACE, "recovery_interval": 0.25}
    async with trio_sessions.open_runtime(live_store, resume, **options) as other:
        with trio.fail_after(10):
            async with trio_sessions.open_runtime(live_store, holding, **options) as owner:
                await owner.submit("s", {"n": 1})
                await holding.entered.wait()
                raw.write("UPDATE session_message SET data = '{bad json' WHERE role = 'assistant'")
                testing.crash(owner)
            while not raw.rows("SELECT 1 FROM session_recovery WHERE recovery_error IS NOT NULL"):
                await trio.sleep(0.05)
        # The look after that pass forgot the dead owner (its token's record removed): what
        # the lift then met. (With the fix the record stays while the quarantined claim's
        # lease lives: the wait ends at its bound, long before that lease.)
        with trio.move_on_after(5):
            while _token_recorded(db_path, owner.owner_id):
                await trio.sleep(0.05)
        [(execution_id, expires_at)] = rows(db_path, "SELECT id, expires_at FROM session_execution")
        raw.write("UPDATE session_message SET data = ? WHERE role = 'assistant'", (OPEN,))
        status = await trio.to_thread.run_sync(_cli.main, _release_argv(db_path, execution_id))
        assert status == 0
        with trio.fail_after(10):  # the dead owner's lease has 25 s or more left
            await resumed.wait()
        [(owner_id, was_resumed, at)] = resumes
        assert (owner_id, was_resumed) == (other.owner_id, True)
        assert at < expires_at
