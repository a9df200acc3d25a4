"""Conversation control's promises over time (DESIGN §5.1, §6.23): what a call leaves in the
store once the window it promises has passed. Deterministic: inline store, autojump clock
tied to the runtime's lease clock."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import trio
from helpers import Raw, Recorder, runtime
from trio.testing import MockClock

from trio_sessions import DrainContext, Store

Clock = Callable[[], float]


@pytest.mark.parametrize("backend", ["postgres"], indirect=True)
async def test_a_cancelled_inputs_trace_goes_after_ten_minutes(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """README: on PostgreSQL "a cancel leaves a trace for ten minutes". It was deleted only
    by a later `cancel_input` anywhere in the store: a quiet store kept it for ever (with
    the withdrawn message's payload, until schema 28). A recovery pass, which runs
    periodically anyway in a worker, deletes it once its ten minutes are over (scheduled
    inputs: none is taken before its cancel). Found by an audit (reading
    `ts_cancel_input`)."""
    raw = Raw(db_path)
    async with runtime(store, Recorder(), clock) as worker:
        await worker.submit("s", {"text": "my card is 4111..."}, input_id="oops", delay=3600.0)
        assert await worker.cancel_input("oops") is True
        assert raw.rows("SELECT id FROM session_input_cancelled") == [("oops",)]
        await trio.sleep(11 * 60)
        await worker.submit("s", {"text": "hello"}, input_id="next", delay=3600.0)
        await worker.recover_once()
    assert raw.rows("SELECT id FROM session_input_cancelled") == []


@pytest.mark.parametrize("backend", ["postgres"], indirect=True)
async def test_a_cancelled_inputs_trace_keeps_no_payload_and_lasts_its_ten_minutes(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """The trace a cancel leaves on PostgreSQL answers a lost submit's retry by its input id
    and call id (`ts_known_input`), so it keeps nothing of the text a user took back - and a
    recovery pass within its ten minutes leaves it for that retry."""
    raw = Raw(db_path)
    async with runtime(store, Recorder(), clock) as worker:
        await worker.submit("s", {"text": "my card is 4111 1111"}, input_id="oops", delay=60.0)
        assert await worker.cancel_input("oops") is True
        await trio.sleep(9 * 60)
        await worker.recover_once()
    traces = raw.rows("SELECT row_to_json(c)::text FROM session_input_cancelled c")
    assert len(traces) == 1 and '"oops"' in traces[0][0], traces
    assert "4111" not in traces[0][0], traces
    payload_columns = raw.rows(
        "SELECT column_name FROM information_schema.columns WHERE table_schema ="
        " current_schema() AND table_name = 'session_input_cancelled' AND column_name = 'payload'"
    )
    assert payload_columns == []


@pytest.mark.parametrize("backend", ["postgres"], indirect=True)
async def test_a_cancelled_inputs_trace_goes_after_ten_minutes_on_a_busy_worker(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """As above, but the only worker is at its `max_active`: a chat service at capacity
    for as long as it is busy. Its recovery passes run, with no room - and the trace the
    cancel left outlives its ten minutes for as long as that lasts (README: "a cancel
    leaves a trace ... for ten minutes"). Found by review (revB55)."""
    raw = Raw(db_path)
    busy = trio.Event()

    async def drain(ctx: DrainContext) -> None:
        busy.set()
        await trio.sleep_forever()

    async with runtime(store, drain, clock, max_active=1, recovery_interval=60.0) as worker:
        await worker.wake("held")
        await busy.wait()
        await worker.submit("s", {"text": "my card is 4111..."}, input_id="oops", delay=3600.0)
        assert await worker.cancel_input("oops") is True
        await trio.sleep(11 * 60)  # eleven recovery passes
        await worker.recover_once()
        traces = raw.rows("SELECT id FROM session_input_cancelled")
        await worker.interrupt("held")
    assert traces == [], "the trace outlived its ten minutes"
