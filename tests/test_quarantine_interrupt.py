"""An interrupt of a quarantined claim (DESIGN §4, §5): the quarantine's own actions decide
it, so `interrupt()` leaves it as it is and answers that nothing runs.

A SIGKILLed worker's claim is taken over through its free liveness token long before its
lease ends, so a claim whose message does not decode is quarantined with the dead owner's
lease still live. Marked `cancelling` by an interrupt, the operator's later resume finished
it as cancelled - its malformed message left open, the session's quarantine gone, so no
`--drop` could set that message aside - instead of quarantining it again."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import trio.testing
from helpers import Raw, Recorder, now_ms, runtime


async def test_an_interrupt_of_a_quarantined_claim_with_a_live_lease_marks_nothing(
    store: Any, db_path: Any, clock: Callable[[], float], autojump_clock: trio.testing.MockClock
) -> None:
    raw = Raw(db_path)
    async with runtime(store, None, clock) as producer:
        live = now_ms(clock) + 3_600_000  # its dead owner's lease: most of it left
        raw.seed_claim("s", "dead-e", expires_at=live)
        raw.write(
            "INSERT INTO session_recovery(execution_id, session_id, owner_id, expires_at,"
            " recovery_error, time_quarantined, time_created)"
            " VALUES ('dead-e', 's', 'a-recoverer', 0, 'message m does not decode', 0, 0)"
        )
        assert await producer.interrupt("s") is False
    assert raw.claim("s") == ("dead-e", "dead-owner", "running", live)


@pytest.mark.parametrize("lease_left_ms", [3_600_000, -1_000], ids=["live", "expired"])
async def test_a_submit_that_interrupts_stores_its_input_and_leaves_a_quarantined_claim(
    store: Any,
    db_path: Any,
    clock: Callable[[], float],
    autojump_clock: trio.testing.MockClock,
    lease_left_ms: int,
) -> None:
    """`on_busy="interrupt"` marks the running claim as `interrupt()` does - live or
    expired - so a quarantined one is left to the quarantine's actions there too."""
    raw = Raw(db_path)
    async with runtime(store, None, clock) as producer:
        expires_at = now_ms(clock) + lease_left_ms
        raw.seed_claim("s", "dead-e", expires_at=expires_at)
        raw.write(
            "INSERT INTO session_recovery(execution_id, session_id, owner_id, expires_at,"
            " recovery_error, time_quarantined, time_created)"
            " VALUES ('dead-e', 's', 'a-recoverer', 0, 'message m does not decode', 0, 0)"
        )
        stored = await producer.submit("s", {"text": "next"}, input_id="i", on_busy="interrupt")
    assert stored == "i"
    assert raw.claim("s") == ("dead-e", "dead-owner", "running", expires_at)
    assert raw.rows("SELECT id FROM session_input WHERE session_id = 's'") == [("i",)]


async def test_an_interrupt_accepted_while_acquiring_passes_nothing_to_a_quarantined_claim(
    store: Any, db_path: Any, clock: Callable[[], float], autojump_clock: trio.testing.MockClock
) -> None:
    """An interrupt accepted while this runtime was still acquiring, the acquire finding
    another owner's claim: that claim is marked `cancelling` (`request_cancel`) - not a
    quarantined one."""
    raw = Raw(db_path)
    async with runtime(store, Recorder(), clock, recovery_interval=10_000.0) as rt:
        live = now_ms(clock) + 3_600_000
        raw.write("INSERT INTO session(id, time_created, time_woken) VALUES ('s', 0, 1)")
        await rt.recover_once()  # registers a prospective acquisition for 's'
        assert rt.is_active("s")
        raw.seed_claim("s", "dead-e", expires_at=live)
        raw.write(
            "INSERT INTO session_recovery(execution_id, session_id, owner_id, expires_at,"
            " recovery_error, time_quarantined, time_created)"
            " VALUES ('dead-e', 's', 'a-recoverer', 0, 'message m does not decode', 0, 0)"
        )
        assert await rt.interrupt("s") is True  # accepted for this runtime's acquisition
        await rt.wait_idle("s")
    assert raw.claim("s") == ("dead-e", "dead-owner", "running", live)
