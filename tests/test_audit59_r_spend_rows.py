"""What a long conversation's delete or truncate counts before it runs (DESIGN §6.26: one
long transcript never stalls the event loop; `_store.common.spend_rows`).

SQLite runs a delete or a truncate on the event loop when the write lock is free, after
counting - "no further than the budget reaches" - the rows it will touch: a long one goes to
the worker thread. The count of an open answer's streamed text (`session_message_delta`
rows of the session's messages) gathered every message id of the session first, whatever
the limit: for 300,000 messages ~90 ms of the loop before anything was charged. Real time,
bounded; CPU per task step (`StepMeter`, the garbage collector left out).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

import trio_sessions
from trio_sessions._bench.load import StepMeter, seed_transcript

BOUND = 60.0  # seconds of real time; the machine may be shared and slow
STALL_S = 0.050  # DESIGN §7: no event-loop stall above 50 ms from the library
VERY_LONG = 300_000  # fifteen times §7's long transcript


@pytest.mark.serial
@pytest.mark.parametrize("verb", ["delete_session", "truncate"])
async def test_counting_a_very_long_conversations_rows_never_stalls_the_loop(
    tmp_path: Path, verb: str
) -> None:
    """`delete_session()` and `truncate(after_seq=0)` of a 300,000-message conversation:
    every message goes, and no task step of the library takes above 50 ms of CPU."""
    db = tmp_path / "s.db"
    seed_transcript(db, "big", VERY_LONG)
    with trio.fail_after(BOUND):
        async with trio_sessions.open_runtime(db, None, recovery_interval=3600.0) as rt:
            with StepMeter() as meter:
                if verb == "truncate":
                    assert await rt.truncate("big", after_seq=0) == VERY_LONG
                else:
                    assert await rt.delete_session("big")
            assert await rt.transcript("big") == []
    assert meter.longest_cpu < STALL_S, meter.longest_cpu
