"""The operator CLI over a store another tool wrote to."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
from helpers import Raw

import trio_sessions
from trio_sessions import _cli


def _store_with_a_session(tmp_path: Path) -> Path:
    """A SQLite store holding session 's' with one input, as a producer made it."""
    store = tmp_path / "sessions.db"

    async def make() -> None:
        async with trio_sessions.open_runtime(store, None) as producer:
            await producer.submit("s", {"text": "hello"})

    trio.run(make)
    return store


def test_a_quarantine_whose_claim_is_gone_says_so_not_none(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A quarantined execution whose claim row another tool deleted was listed as
    `claim owner: None (None)` - Python's None, which no operator reads as "no claim".
    Found by deleting a quarantined claim with sqlite3 and listing. It says the claim is
    gone (and `--json` keeps null)."""
    store = _store_with_a_session(tmp_path)
    Raw(store).write(
        "INSERT INTO session_recovery(execution_id, session_id, owner_id, expires_at,"
        " recovery_error, time_created, time_quarantined)"
        " VALUES ('e-gone', 's', 'recoverer', 0, 'malformed', 0, 0)"
    )
    assert _cli.main(["quarantine", "list", str(store)]) == 0
    listed = capsys.readouterr().out
    assert "None" not in listed
    assert "claim: none (the claim row is gone)" in listed
    assert _cli.main(["quarantine", "list", str(store), "--json"]) == 0
    assert '"claim_owner_id": null' in capsys.readouterr().out


def test_cancelling_a_rejected_input_points_at_inputs_drop(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`inputs list` shows an input set aside as malformed; `inputs cancel` of that id said
    "not pending (already taken, or unknown)" - neither, and no word of the verb that
    removes it. Found by running the listed verbs on a store with a corrupt input. The
    error names it set aside and `inputs drop`; nothing is written."""
    store = _store_with_a_session(tmp_path)
    Raw(store).write(
        "INSERT INTO session_input_rejected(id, session_id, seq, payload, reason, time_created)"
        " VALUES ('bad', 's', 9, '[1,2', 'not JSON', 0)"
    )
    assert _cli.main(["inputs", "cancel", str(store), "bad"]) == _cli.EXIT_FAILED
    error = capsys.readouterr().err
    assert "set aside as malformed" in error and "inputs drop" in error
    assert Raw(store).rows("SELECT id FROM session_input_rejected") == [("bad",)]
