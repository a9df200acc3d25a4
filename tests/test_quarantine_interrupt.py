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

import trio.testing
from helpers import Raw, now_ms, runtime


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
