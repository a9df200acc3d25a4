"""The operator's store operations: dropping a quarantined execution sets its malformed
message aside. On both backends, through the sync engine."""

from __future__ import annotations

from trio_sessions import (
    _store,
)
from trio_sessions._decisions import RecoveryDecision

from .common import (
    Db,
    busy_claim,
    recover,
)


def test_drop_quarantined_sets_the_malformed_message_aside(db: Db) -> None:
    """Dropping a quarantine moves the malformed message (raw text kept) to
    session_message_rejected, so the session's transcript reads again."""
    execution = busy_claim(db)
    db.write("UPDATE session_message SET data = '{\"parts\": 1}' WHERE id = 'm-1'")
    db.expire()
    assert recover(db, execution).decision is RecoveryDecision.QUARANTINE
    db.run(_store.drop_quarantined, execution)
    [row] = db.rows(
        "SELECT id, session_id, execution_id, seq, data, reason, time_created"
        " FROM session_message_rejected"
    )
    assert row[:5] == ("m-1", "s", execution, 2, '{"parts": 1}')
    assert "parts" in row[5]
    assert row[6] == db.now
    messages = db.run(_store.read_transcript, "s")
    assert [(m.role, m.input_id) for m in messages] == [("user", "in-taken")]
