"""The operator console over a store in production's states."""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
import pytest
from backends import Location
from console_process import DEADLINE, MALFORMED
from helpers import Raw
from test_console import BOTH, console_on, csrf_of, seed_ids

pytestmark = pytest.mark.slow


@BOTH
def test_interrupt_is_not_offered_on_a_quarantined_claim_whose_lease_is_live(
    db_path: Location, tmp_path: Path
) -> None:
    """A SIGKILLed worker's claim is taken over by its free liveness token, long before its
    lease runs out: recovery quarantines it (its message does not decode) with the dead
    owner's lease still live for up to a lease. The console offered `interrupt` on it (a
    quarantined claim was taken to be expired) and a POST answered 303 as if it had acted,
    while it marked the quarantined claim `cancelling`: the operator's later "resume" then
    finished it as cancelled, the malformed message left open, instead of quarantining it
    again. Found by SIGKILLing a worker and clicking through the console. README: interrupt
    is never offered for a quarantined claim, and a POST is a 409."""
    store = db_path
    seed_ids(store, "poisoned")
    now = int(time.time() * 1000)
    raw = Raw(store)
    raw.seed_claim("poisoned", "e-poisoned", expires_at=now + 600_000)
    raw.seed_assistant("poisoned", "e-poisoned", 2, MALFORMED)
    raw.write(
        "INSERT INTO session_recovery(execution_id, session_id, owner_id, expires_at,"
        " recovery_error, time_created, time_quarantined) VALUES (?, ?, ?, ?, ?, ?, ?)",
        ("e-poisoned", "poisoned", "recovery", now + 600_000, "malformed", now, now),
    )
    with (
        console_on(store, tmp_path) as (url, _),
        httpx.Client(base_url=url, timeout=DEADLINE) as client,
    ):
        listing = client.get("/").text
        assert re.findall(r'action="/sessions/([^/"]+)/interrupt"', listing) == []
        page = client.get("/sessions/poisoned").text
        assert "quarantined" in page and 'value="interrupt"' not in page
        answer = client.post("/sessions/poisoned/interrupt", data={"csrf": csrf_of(listing)})
        assert answer.status_code == 409 and "quarantined" in answer.text
    assert raw.rows("SELECT id, phase FROM session_execution") == [("e-poisoned", "running")]
