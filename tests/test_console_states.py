"""The console's session states and store-wide figures on both backends, served in process
(the app over a producer runtime, no server): a quarantined claim is quarantined whatever
its lease."""

from __future__ import annotations

import re
import time

import pytest
from backends import Location
from helpers import Raw
from test_console import BOTH, QUARANTINE_ROWS, answered, store_of

import trio_sessions
from trio_sessions._console import Console, Guard

LEASE_MS = 600_000


async def get(console: Console, path: str) -> tuple[int, str]:
    """The status and body the console answers `GET path` with."""
    status, _, body = await answered(console, path)
    return status, body


def figures(page: str) -> dict[str, int]:
    """The store-wide figures a list page shows, by name."""
    return {name.strip(): int(n) for name, n in re.findall(r"([a-z ]+) <b>(\d+)</b>", page)}


def states(page: str) -> dict[str, str]:
    """Each listed session's state, by id."""
    return dict(re.findall(r'<tr data-session="([^"]+)">.*?</td><td>([^<]*)</td>', page))


@BOTH
async def test_a_quarantined_claim_whose_lease_is_live_is_no_live_claim(
    db_path: Location,
) -> None:
    """A liveness takeover quarantines a dead owner's claim long before its lease runs out.
    The console's figures counted such a claim among the live claims (`expires_at > now`
    alone), beside the quarantined ones: one claim counted twice, and a store with no work
    running read as busy. Found reading the console for the CLI's same mistake (stop 60).
    The figures count live claims that are not quarantined; the list shows it quarantined."""
    async with trio_sessions.open_runtime(store_of(db_path), None) as runtime:
        now = int(time.time() * 1000)
        raw = Raw(db_path)
        raw.seed_claim("live", "e-live", expires_at=now + LEASE_MS)
        raw.seed_claim("expired", "e-expired", expires_at=now - 1)
        raw.seed_claim("taken", "e-taken", expires_at=now + LEASE_MS)
        raw.write(
            f"{QUARANTINE_ROWS} VALUES (?, ?, ?, ?, ?, ?, ?)",
            ("e-taken", "taken", "recovery", now + LEASE_MS, "malformed", now, now),
        )
        status, page = await get(Console(runtime, "store", Guard(None, False)), "/")
    assert status == 200, page
    shown = figures(page)
    assert (shown["claims"], shown["live claims"], shown["quarantined"]) == (3, 1, 1), shown
    listed = states(page)
    assert listed["taken"] == "quarantined", listed
    assert listed["live"].startswith("running"), listed


pytestmark = pytest.mark.slow
