"""What a client does with a long conversation - read it, edit it, branch it, erase it -
never holds the event loop above 50 ms (DESIGN §6.26: one long transcript never stalls the
event loop). Real time, bounded; CPU per task step (`StepMeter`, the garbage collector
left out). 50,000 messages: at §7's 20,000 the steps measured 56, 81, 79 and 192 ms,
too close to the bound for a strict expectation of the first three."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

import trio_sessions
from trio_sessions._bench.load import StepMeter, seed_transcript

BOUND = 60.0  # seconds of real time; the machine may be shared and slow
STALL_S = 0.050
TRANSCRIPT = 50_000


async def _longest_step(db: Path, verb: str) -> float:
    async with trio_sessions.open_runtime(db, None, recovery_interval=3600.0) as rt:
        with StepMeter() as meter:
            if verb == "transcript":
                assert len(await rt.transcript("big")) == TRANSCRIPT
            elif verb == "truncate":
                assert await rt.truncate("big", after_seq=0) == TRANSCRIPT
            elif verb == "delete_session":
                assert await rt.delete_session("big")
            else:
                await rt.fork("big", "branch")
                assert len(await rt.transcript("branch")) == TRANSCRIPT
    return meter.longest_cpu


@pytest.mark.serial
@pytest.mark.parametrize("verb", ["transcript", "truncate", "delete_session", "fork"])
async def test_a_verb_over_a_long_transcript_never_stalls_the_loop(
    tmp_path: Path, verb: str
) -> None:
    """`transcript()`, `truncate()`, `delete_session()` and `fork()` of a 50,000-message
    session on the threaded SQLite store: no task step of the library above 50 ms of CPU."""
    db = tmp_path / "s.db"
    seed_transcript(db, "big", TRANSCRIPT)
    with trio.fail_after(BOUND):
        longest = await _longest_step(db, verb)
    assert longest < STALL_S, longest
