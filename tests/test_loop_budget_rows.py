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

import json
from pathlib import Path

import pytest
import trio
from helpers import Raw

import trio_sessions
from trio_sessions import AssistantData, TextPart
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


LARGE = 150  # answers of 200 KB each, as large as README's tool result
ANSWER = "x" * 200_000


@pytest.mark.serial
@pytest.mark.parametrize("verb", ["fork", "truncate", "delete_session"])
async def test_a_conversation_of_large_answers_never_stalls_the_loop(
    tmp_path: Path, verb: str
) -> None:
    """`fork()`, `truncate(after_seq=0)` and `delete_session()` of 150 answers of 200 KB
    each (30 MB, as a tool-heavy conversation holds): what each copies or deletes was
    charged by its rows alone - 150 rows fit the loop's budget many times over - and
    the copy took ~130 ms of one loop step, the deletes ~60-85 ms. Each goes to the worker
    thread, and does what it did."""
    db = tmp_path / "s.db"
    async with trio_sessions.open_runtime(db, None):
        pass
    data = json.dumps(
        {"parts": [{"type": "text", "text": ANSWER}], "finished": True, "error": None}
    )
    raw = Raw(db)
    raw.write("INSERT INTO session(id, time_created) VALUES ('big', 0)")
    raw.write_many(
        "INSERT INTO session_message(id, session_id, role, seq, data, time_created,"
        " time_updated, finished) VALUES (?, 'big', 'assistant', ?, ?, 0, 0, 1)",
        [(f"m{seq}", seq, data) for seq in range(1, LARGE + 1)],
    )
    calls = {
        "fork": lambda rt: rt.fork("big", "branch"),
        "truncate": lambda rt: rt.truncate("big", after_seq=0),
        "delete_session": lambda rt: rt.delete_session("big"),
    }
    with trio.fail_after(BOUND):
        async with trio_sessions.open_runtime(db, None, recovery_interval=3600.0) as rt:
            with StepMeter() as meter:
                result = await calls[verb](rt)
            left = {session_id: await rt.transcript(session_id) for session_id in ("big", "branch")}
    want = {"fork": (None, LARGE), "truncate": (LARGE, 0), "delete_session": (True, 0)}
    assert (result, len(left["big"])) == want[verb]
    assert len(left["branch"]) == (LARGE if verb == "fork" else 0)
    if verb == "fork":
        assert left["branch"][-1].data == AssistantData((TextPart(ANSWER),), True, None)
    assert meter.longest_cpu < STALL_S, meter.longest_cpu
