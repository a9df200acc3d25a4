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


def test_the_console_pages_list_an_empty_id_first_and_go_on_after_it(db: Db) -> None:
    """Another tool may store a session or a quarantined execution whose id is "" (the CLI's
    `status` lists it); the console's first page asked for ids after "", which leaves it
    out, on either table. Found by an audit. The first page (`after` None) starts before
    every id; a page ending at "" goes on with the ids after it, each listed once."""
    db.write("INSERT INTO session(id, time_created) VALUES ('', 0), ('a', 0), ('b', 0)")
    db.write(
        "INSERT INTO session_recovery(execution_id, session_id, owner_id, expires_at,"
        " recovery_error, time_created, time_quarantined)"
        " VALUES ('', 'a', 'o', 0, 'bad', 0, 0), ('e', 'a', 'o', 0, 'bad', 0, 0)"
    )
    whole = db.engine.read(_store.session_page, "", None, 10)
    assert [s["id"] for s in whole["sessions"]] == ["", "a", "b"] and not whole["more"]
    first = db.engine.read(_store.session_page, "", None, 1)
    assert [s["id"] for s in first["sessions"]] == [""] and first["more"]
    after = db.engine.read(_store.session_page, "", first["last"], 1)
    assert [s["id"] for s in after["sessions"]] == ["a"]
    quarantined = db.engine.read(_store.quarantine_page, None, 1)
    assert [q["execution_id"] for q in quarantined["quarantined"]] == [""]
    rest = db.engine.read(_store.quarantine_page, quarantined["last"], 1)
    assert [q["execution_id"] for q in rest["quarantined"]] == ["e"] and not rest["more"]


def test_sessions_present_names_the_sessions_that_still_have_a_row(db: Db) -> None:
    """`sessions_present` tells a claim deleted with its session (no row left) from one
    taken over (its session still there), on both backends: the change look logs only
    the second as a lost claim."""
    db.write("INSERT INTO session(id, time_created) VALUES ('kept', 0), ('it''s', 0)")
    assert db.engine.read(_store.sessions_present, ["kept", "deleted", "it's"]) == {
        "kept",
        "it's",
    }
    assert db.engine.read(_store.sessions_present, []) == set()
