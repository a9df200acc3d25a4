"""The doorbell and the inputs: wake coalesces, submit is idempotent by input id and
refuses a conflicting one, take_inputs turns inputs into user messages in order and sets a
malformed one aside. On both backends, through the sync engine."""

from __future__ import annotations

import pytest
from backends import finish_iteration

from trio_sessions import (
    InputConflict,
    SessionBusy,
    _store,
)
from trio_sessions._decisions import AcquireVerdict

from .common import (
    NOW,
    Db,
)


def test_wake_creates_session_and_coalesces(db: Db) -> None:
    """wake creates the session, sets time_woken once (the first wake) and counts every wake."""
    db.run(_store.wake, "s")
    db.now += 1000
    db.run(_store.wake, "s")
    db.run(_store.wake, "s")
    assert db.doorbell() == (NOW, 3, 0)


def test_submit_stores_input_and_rings(db: Db) -> None:
    """submit creates the session, rings the doorbell and stores inputs with increasing seq."""
    assert db.run(_store.submit, "s", '{"n": 1}', "in-1") == "in-1"
    assert db.run(_store.submit, "s", '{"n": 2}', "in-2") == "in-2"
    assert db.doorbell() == (NOW, 2, 0)
    assert db.rows("SELECT id, session_id, seq, payload FROM session_input ORDER BY seq") == [
        ("in-1", "s", 1, '{"n": 1}'),
        ("in-2", "s", 2, '{"n": 2}'),
    ]


def test_submit_is_idempotent_by_input_id(db: Db) -> None:
    """The same input id and payload for the same session returns the id, writes nothing."""
    db.run(_store.submit, "s", '{"n": 1}', "in-1")
    before = db.snapshot()
    db.now += 5000
    assert db.run(_store.submit, "s", '{"n": 1}', "in-1") == "in-1"
    assert db.snapshot() == before


def test_submit_is_idempotent_after_the_input_was_taken(db: Db) -> None:
    """After the input became a user message, resubmitting it returns the id, writes nothing."""
    db.run(_store.submit, "s", '{"n": 1}', "in-1")
    execution = db.claim()
    db.run(_store.take_inputs, "s", execution, "owner-a")
    assert db.run(finish_iteration, "s", execution, "owner-a") is False
    before = db.snapshot()
    assert db.run(_store.submit, "s", '{"n": 1}', "in-1") == "in-1"
    assert db.snapshot() == before
    assert db.rows("SELECT * FROM session_input") == []


@pytest.mark.parametrize("taken", [False, True], ids=["pending", "taken"])
def test_submit_same_id_other_session_conflicts(db: Db, taken: bool) -> None:
    """An input id stored for another session raises InputConflict and writes nothing."""
    db.run(_store.submit, "s", '{"n": 1}', "in-1")
    if taken:
        execution = db.claim()
        db.run(_store.take_inputs, "s", execution, "owner-a")
    before = db.snapshot()
    with pytest.raises(InputConflict, match="in-1"):
        db.run(_store.submit, "other", '{"n": 1}', "in-1")
    assert db.snapshot() == before


def test_submit_same_id_different_payload_conflicts(db: Db) -> None:
    """The same input id with another payload raises InputConflict, pending or taken; the same
    payload (any key order or spacing) stays idempotent."""
    db.run(_store.submit, "s", '{"a": 1, "b": [2]}', "in-1")
    db.run(_store.submit, "s", '{"n": 2}', "in-2")
    execution = db.claim()
    db.run(_store.submit, "s", '{"n": 3}', "in-3")
    db.run(_store.take_inputs, "s", execution, "owner-a")
    db.run(_store.submit, "s", '{"n": 4}', "in-4")
    before = db.snapshot()
    for input_id, payload in (("in-1", '{"a": 1, "b": [2, 3]}'), ("in-4", '{"n": 4.0}')):
        with pytest.raises(InputConflict, match=input_id):
            db.run(_store.submit, "s", payload, input_id)
    assert db.run(_store.submit, "s", '{"b":[2],"a":1}', "in-1") == "in-1"
    assert db.run(_store.submit, "s", '{"n":4}', "in-4") == "in-4"
    assert db.snapshot() == before


def test_take_inputs_turns_inputs_into_user_messages_in_order(db: Db) -> None:
    """take_inputs returns pending inputs in seq order and moves each into a user message."""
    db.run(_store.submit, "s", '{"n": 1}', "in-1")
    db.run(_store.submit, "s", '{"n": 2}', "in-2")
    execution = db.claim()
    taken = db.run(_store.take_inputs, "s", execution, "owner-a")
    assert [(i.id, i.payload) for i in taken] == [("in-1", {"n": 1}), ("in-2", {"n": 2})]
    assert db.rows("SELECT * FROM session_input") == []
    assert db.rows(
        "SELECT input_id, role, seq, data, execution_id FROM session_message ORDER BY seq"
    ) == [
        ("in-1", "user", 1, '{"n": 1}', execution),
        ("in-2", "user", 2, '{"n": 2}', execution),
    ]
    assert db.run(_store.take_inputs, "s", execution, "owner-a") == []


def test_take_inputs_sets_a_malformed_input_aside(db: Db) -> None:
    """An input that is not a JSON object moves to session_input_rejected with its reason;
    the valid inputs around it are delivered in order and nothing stays pending."""
    db.run(_store.submit, "s", '{"n": 1}', "in-1")
    db.run(_store.submit, "s", "[1]", "in-bad")
    db.run(_store.submit, "s", '{"n": 3}', "in-3")
    execution = db.claim()
    taken = db.run(_store.take_inputs, "s", execution, "owner-a")
    assert [(i.id, i.payload) for i in taken] == [("in-1", {"n": 1}), ("in-3", {"n": 3})]
    assert db.rows("SELECT * FROM session_input") == []
    [(input_id, session_id, seq, payload, reason, created)] = db.rows(
        "SELECT id, session_id, seq, payload, reason, time_created FROM session_input_rejected"
    )
    assert (input_id, session_id, seq, payload, created) == ("in-bad", "s", 2, "[1]", NOW)
    assert "in-bad" in reason and "JSON object" in reason
    assert db.rows("SELECT input_id, seq FROM session_message ORDER BY seq") == [
        ("in-1", 1),
        ("in-3", 2),
    ]
    assert db.run(_store.take_inputs, "s", execution, "owner-a") == []
    assert [r["id"] for r in db.run(_store.rejected_inputs, None)] == ["in-bad"]
    assert db.run(_store.drop_rejected_input, "in-bad") == "s"
    assert db.rows("SELECT * FROM session_input_rejected") == []
    with pytest.raises(ValueError, match="in-bad"):
        db.run(_store.drop_rejected_input, "in-bad")


def test_take_inputs_takes_a_chunk_of_due_inputs_and_rings_for_the_rest(db: Db) -> None:
    """With a limit, take_inputs takes the oldest due inputs only: a scheduled input not yet
    due keeps its place whatever its seq (never deleted with the chunk before it), the
    doorbell is rung while due inputs remain and only then, and a malformed input set
    aside counts towards the chunk (both backends: PostgreSQL's one-call path and the
    library's own path agree)."""
    db.run(_store.submit, "s", '{"n": 1}', "in-1")
    db.run(_store.submit_scheduled, "s", '{"n": 2}', "in-later", 20_000, "queue")
    db.run(_store.submit, "s", '{"n": 3}', "in-3")
    db.run(_store.submit, "s", '{"n": 4}', "in-4")
    execution = db.claim()
    assert db.doorbell()[:2] == (None, 0)

    taken = db.run(_store.take_inputs, "s", execution, "owner-a", 2)
    assert [i.id for i in taken] == ["in-1", "in-3"]
    assert db.rows("SELECT id FROM session_input ORDER BY seq") == [("in-later",), ("in-4",)]
    assert db.doorbell()[:2] == (NOW, 1)  # in-4 is due and left: rung once

    assert [i.id for i in db.run(_store.take_inputs, "s", execution, "owner-a", 2)] == ["in-4"]
    assert db.rows("SELECT id FROM session_input") == [("in-later",)]
    assert db.doorbell()[:2] == (NOW, 1)  # nothing due is left: not rung again
    assert db.run(_store.take_inputs, "s", execution, "owner-a", 2) == []
    assert db.rows("SELECT input_id, seq FROM session_message ORDER BY seq") == [
        ("in-1", 1),
        ("in-3", 2),
        ("in-4", 3),
    ]

    db.run(_store.submit, "s", "[5]", "in-bad")
    db.run(_store.submit, "s", '{"n": 6}', "in-6")
    db.run(_store.submit, "s", '{"n": 7}', "in-7")
    db.now += 20_000  # in-later falls due (the lease, 30 s, still live): oldest of the due ones
    wakes = db.doorbell()[1]  # each submit rang too
    taken = db.run(_store.take_inputs, "s", execution, "owner-a", 2)
    assert [i.id for i in taken] == ["in-later"]  # in-bad, set aside, was the chunk's second
    assert db.rows("SELECT id FROM session_input_rejected") == [("in-bad",)]
    assert db.rows("SELECT id FROM session_input ORDER BY seq") == [("in-6",), ("in-7",)]
    assert db.doorbell()[:2] == (NOW, wakes + 1)
    taken = db.run(_store.take_inputs, "s", execution, "owner-a", 2)
    assert [i.id for i in taken] == ["in-6", "in-7"]
    assert db.rows("SELECT id FROM session_input") == []
    assert db.doorbell()[:2] == (NOW, wakes + 1)


@pytest.mark.parametrize("busy", ["claim", "due_input"])
def test_a_scheduled_submit_that_rejects_a_busy_session_stores_nothing(db: Db, busy: str) -> None:
    """§6.23 for scheduled inputs: `submit(delay=..., on_busy="reject")` on a busy session (a
    claim exists, or a due input waits untaken) raises `SessionBusy` and stores nothing; a
    session whose only input is scheduled is not busy, so the next one is stored. Found by
    mutation: dropping the reject check from SQLite's `submit_scheduled` broke no test."""
    if busy == "claim":
        db.claim()
    else:
        db.run(_store.submit, "s", '{"n": 1}', "in-due")
    before = db.snapshot()
    with pytest.raises(SessionBusy):
        db.run(_store.submit_scheduled, "s", '{"n": 2}', "in-later", 20_000, "reject")
    assert db.snapshot() == before

    db.run(_store.submit_scheduled, "idle", '{"n": 1}', "in-a", 20_000, "reject")
    db.run(_store.submit_scheduled, "idle", '{"n": 2}', "in-b", 20_000, "reject")
    assert db.rows("SELECT id FROM session_input WHERE session_id = 'idle' ORDER BY seq") == [
        ("in-a",),
        ("in-b",),
    ]


@pytest.mark.parametrize("on_busy", ["reject", "interrupt"])
def test_a_controlled_submit_that_acquires_sees_due_inputs_waiting_as_busy(
    db: Db, on_busy: str
) -> None:
    """§6.23 on the path a draining runtime takes (`submit_controlled_and_acquire`): with
    no claim but a due input waiting untaken, the session is busy - "reject" raises
    `SessionBusy` and stores nothing; "interrupt" (no claim to stop) queues the input and
    takes the claim for both. Found by mutation: dropping the pending-input check before
    the one-transaction claim broke no test."""
    db.run(_store.submit, "s", '{"n": 1}', "in-due")
    args = ("s", '{"n": 2}', "in-new", on_busy, "exec-new", "owner-a", 30_000)
    if on_busy == "reject":
        before = db.snapshot()
        with pytest.raises(SessionBusy):
            db.run(_store.submit_controlled_and_acquire, *args)
        assert db.snapshot() == before
        return
    (stored, stopped), acquired = db.run(_store.submit_controlled_and_acquire, *args)
    assert (stored, stopped) == ("in-new", None)
    assert acquired.verdict is AcquireVerdict.CLAIM
    assert db.rows("SELECT id FROM session_input ORDER BY seq") == [("in-due",), ("in-new",)]
    assert db.doorbell()[:2] == (None, 0)  # taken with the claim
