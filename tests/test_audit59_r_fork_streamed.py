"""Forking a conversation whose answer is still open after a long stream (DESIGN §5.1: the
answer is copied finished "interrupted", its streamed text merged; §6.26: one long
transcript never stalls the event loop).

SQLite runs a fork on the event loop when the write lock is free, after charging the
messages it copies to the loop's budget (`_store.common.spend_rows`) - but not the open
answer's streamed text, which it reads row by row (`session_message_delta`, one row per
append) and merges before anything else is charged: 200,000 appends took ~200 ms of the
loop. Truncating or deleting that answer was already charged its rows
(tests/test_audit59_a_long_conversations.py). Real time, bounded; CPU per task step
(`StepMeter`, the garbage collector left out).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import trio
from helpers import Raw

import trio_sessions
from trio_sessions import AssistantData, TextPart
from trio_sessions._bench.load import StepMeter

BOUND = 60.0  # seconds of real time; the machine may be shared and slow
STALL_S = 0.050  # DESIGN §7: no event-loop stall above 50 ms from the library
APPENDS = 200_000


@pytest.mark.serial
async def test_forking_a_long_open_answer_never_stalls_the_loop(tmp_path: Path) -> None:
    """An answer streamed word by word, 200,000 appends, never finished (its owner died):
    the fork holds it finished "interrupted" with every word, and no task step of the
    library takes above 50 ms of CPU."""
    db = tmp_path / "s.db"
    async with trio_sessions.open_runtime(db, None):
        pass
    raw = Raw(db)
    raw.write("INSERT INTO session(id, time_created) VALUES ('long', 0)")
    raw.write(
        "INSERT INTO session_message(id, session_id, role, seq, data, time_created,"
        " time_updated, finished) VALUES ('open', 'long', 'assistant', 1, ?, 0, 0, 0)",
        (json.dumps({"parts": [], "finished": False, "error": None}),),
    )
    raw.write_many(
        "INSERT INTO session_message_delta(message_id, version, text) VALUES ('open', ?, 'w ')",
        [(version,) for version in range(1, APPENDS + 1)],
    )
    with trio.fail_after(BOUND):
        async with trio_sessions.open_runtime(db, None, recovery_interval=3600.0) as rt:
            with StepMeter() as meter:
                await rt.fork("long", "branch")
            [copied] = await rt.transcript("branch")
    assert copied.seq == 1
    assert copied.data == AssistantData((TextPart("w " * APPENDS),), True, "interrupted")
    assert meter.longest_cpu < STALL_S, meter.longest_cpu
