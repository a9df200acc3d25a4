"""Claims: acquire never overwrites a claim row and needs the doorbell; the fenced drain
writes' positive cases (finish_iteration, finish_failed, mark_cancelling,
finish_interrupted), heartbeat and expire_claims, and the resume that restarts a paused
session whose failed drain left its input pending. On both backends, through the sync
engine."""

from __future__ import annotations

from typing import Any

import pytest
from backends import finish_iteration

from trio_sessions import (
    _sqlite,
    _store,
)
from trio_sessions._decisions import AcquireVerdict, IterationVerdict
from trio_sessions._errors import InputConflict, LeaseLost, MalformedRecord
from trio_sessions._model import INTERRUPTED

from .common import (
    LEASE,
    Db,
    busy_claim,
    tools,
)


@pytest.mark.parametrize("expired", [False, True], ids=["live", "expired"])
@pytest.mark.parametrize("owner", ["owner-a", "owner-b"], ids=["own", "foreign"])
def test_acquire_never_overwrites_a_claim_row(db: Db, expired: bool, owner: str) -> None:
    """Invariant 2: a claim row (live or expired, own or foreign) is never overwritten; the
    doorbell stays set for the holder or recovery."""
    db.claim(owner="owner-a", execution="exec-1")
    db.run(_store.wake, "s")
    if expired:
        db.expire()
        db.now += 60_000
    before = db.snapshot()
    acquired = db.run(_store.acquire, "s", "exec-new", owner, LEASE)
    assert acquired.verdict is AcquireVerdict.HELD
    assert acquired.holder == "owner-a"
    assert db.snapshot() == before


@pytest.mark.parametrize("expired", [False, True], ids=["live", "expired"])
@pytest.mark.parametrize("verb", ["wake_and_acquire", "submit_and_acquire"])
def test_a_wake_or_submit_that_acquires_never_overwrites_a_claim_row(
    db: Db, expired: bool, verb: str
) -> None:
    """Invariant 2 on the paths `wake`/`run` and `submit` take in a runtime that drains:
    the claim row (live, or expired - only recovery replaces it, with its own rules) stays
    as it was; the doorbell is rung for the holder or recovery."""
    db.claim(owner="owner-a", execution="exec-1")
    if expired:
        db.expire()
        db.now += 60_000
    claim = db.snapshot(["session_execution"])
    if verb == "wake_and_acquire":
        _, acquired = db.run(_store.wake_and_acquire, "s", "exec-new", "owner-b", LEASE)
    else:
        _, acquired = db.run(
            _store.submit_and_acquire, "s", '{"n": 1}', "in-1", "exec-new", "owner-b", LEASE
        )
    assert acquired.verdict is AcquireVerdict.HELD
    assert acquired.holder == "owner-a"
    assert db.snapshot(["session_execution"]) == claim
    assert db.doorbell()[0] is not None


@pytest.mark.parametrize("expired", [False, True], ids=["live", "expired"])
@pytest.mark.parametrize(
    "verb", ["acquire", "wake_and_acquire", "submit_and_acquire", "submit_controlled"]
)
def test_an_acquire_never_reenters_an_own_claim_under_another_execution(
    db: Db, expired: bool, verb: str
) -> None:
    """Invariants 2, 3 and 19: the owner's own claim row (a claim its registry no longer
    holds: one whose commit's reply was lost, say) is never re-entered by an acquisition
    under a new execution id, live or expired, on any acquiring path - only a retry of the
    very execution that landed is its own. Found by mutation: PostgreSQL's
    ts_acquire_locked answering 'claim' for any claim of the same owner broke no test (the
    tests above acquire as another owner)."""
    db.claim(owner="owner-a", execution="exec-1")
    db.run(_store.wake, "s")
    if expired:
        db.expire()
        db.now += 60_000
    claim = db.snapshot(["session_execution"])
    mine = ("exec-new", "owner-a", LEASE)
    if verb == "acquire":
        acquired = db.run(_store.acquire, "s", *mine)
    elif verb == "wake_and_acquire":
        _, acquired = db.run(_store.wake_and_acquire, "s", *mine)
    elif verb == "submit_and_acquire":
        _, acquired = db.run(_store.submit_and_acquire, "s", '{"n": 1}', "in-1", *mine)
    else:
        _, acquired = db.run(
            _store.submit_controlled_and_acquire, "s", '{"n": 1}', "in-1", "queue", *mine
        )
    assert acquired.verdict is AcquireVerdict.HELD
    assert acquired.holder == "owner-a"
    assert db.snapshot(["session_execution"]) == claim
    assert db.doorbell()[0] is not None


@pytest.mark.parametrize("where", ["pending", "taken", "set_aside"])
@pytest.mark.parametrize("session", ["s", "other"], ids=["same", "another"])
def test_submit_and_acquire_answers_a_stored_input_id_as_submit_does(
    db: Db, where: str, session: str
) -> None:
    """An input id already stored - pending, taken, or set aside - on a session free to
    claim: `submit_and_acquire` stores nothing for it (a retry after a lost COMMIT outcome
    lands once) and claims only if the doorbell is set; for another session it raises
    `InputConflict` with nothing written. The check `submit_and_acquire` starts with must
    see the id in every table it can be in, not only the session's claim and pause."""
    payload = '{"n": 1}' if where != "set_aside" else "[1]"  # not an object: set aside
    db.run(_store.submit, "s", payload, "in-1")
    if where != "pending":
        execution = db.claim()
        db.run(_store.take_inputs, "s", execution, "owner-a")
        db.run(finish_iteration, "s", execution, "owner-a")
    assert db.claim_row("s") is None
    before = db.snapshot()
    args = (payload, "in-1", "exec-2", "owner-b", LEASE)
    if session == "other":
        with pytest.raises(InputConflict, match="in-1"):
            db.run(_store.submit_and_acquire, session, *args)
        assert db.snapshot() == before
        return
    inputs = ["session_input", "session_message", "session_input_rejected"]
    inputs_before = db.snapshot(inputs)
    stored, acquired = db.run(_store.submit_and_acquire, session, *args)
    assert stored == "in-1"
    assert db.snapshot(inputs) == inputs_before
    if where == "pending":  # its doorbell still set: the claim takes it
        assert acquired.verdict is AcquireVerdict.CLAIM
        assert db.claim_row("s") is not None
    else:
        assert acquired.verdict is AcquireVerdict.NO_DOORBELL
        assert db.snapshot() == before


def test_acquire_needs_the_doorbell(db: Db) -> None:
    """Without a set doorbell nothing is claimed, for an idle session or an unknown one."""
    execution = db.claim()
    db.run(finish_iteration, "s", execution, "owner-a")
    before = db.snapshot()
    assert db.run(_store.acquire, "s", "exec-2", "owner-a", LEASE).verdict is (
        AcquireVerdict.NO_DOORBELL
    )
    assert db.run(_store.acquire, "ghost", "exec-3", "owner-a", LEASE).verdict is (
        AcquireVerdict.NO_DOORBELL
    )
    assert db.snapshot() == before


def test_acquire_takes_doorbell_and_anchors_at_newest_seq(db: Db) -> None:
    """acquire inserts a running claim with anchor_seq = newest message seq and takes the
    doorbell; it reports the session's wake_attempts."""
    db.run(_store.submit, "s", '{"n": 1}', "in-1")
    db.run(_store.submit, "s", '{"n": 2}', "in-2")
    first = db.claim(execution="exec-1")
    db.run(_store.take_inputs, "s", first, "owner-a")
    db.run(_store.begin_assistant, "s", first, "owner-a", "m-1")
    assert db.run(finish_iteration, "s", first, "owner-a") is False
    db.write("UPDATE session SET wake_attempts = 4")
    db.now += 1000
    db.run(_store.wake, "s")
    db.run(_store.wake, "s")
    acquired = db.run(_store.acquire, "s", "exec-2", "owner-b", LEASE)
    assert acquired.verdict is AcquireVerdict.CLAIM
    assert acquired.attempt == 4
    assert db.claim_row() == ("exec-2", "owner-b", "running", 3, db.now, None, db.now + LEASE)
    assert db.doorbell() == (None, 0, 4)


def test_acquire_on_empty_session_has_null_anchor(db: Db) -> None:
    """With no messages yet, the claim's anchor_seq is NULL."""
    db.claim()
    claim = db.claim_row()
    assert claim is not None
    assert claim[3] is None


def test_finish_iteration_releases_and_resets_attempts(db: Db) -> None:
    """With no doorbell, finish_iteration deletes the claim and resets wake_attempts."""
    execution = db.claim()
    db.write("UPDATE session SET wake_attempts = 3")
    assert db.run(finish_iteration, "s", execution, "owner-a") is False
    assert db.claim_row() is None
    assert db.doorbell() == (None, 0, 0)


def test_wake_during_claim_makes_finish_continue(db: Db) -> None:
    """Invariant 9: a wake committed while the claim exists is taken by finish_iteration
    (continue) instead of the claim being deleted; the next finish then releases."""
    execution = db.claim()
    claim = db.claim_row()
    db.run(_store.wake, "s")
    db.run(_store.wake, "s")
    assert db.run(finish_iteration, "s", execution, "owner-a") is True
    assert db.claim_row() == claim
    assert db.doorbell()[:2] == (None, 0)
    assert db.run(finish_iteration, "s", execution, "owner-a") is False
    assert db.claim_row() is None


def test_wake_after_release_finds_no_claim_and_acquires(db: Db) -> None:
    """The other order of the serialisation: a wake after the finish leaves a doorbell that
    a fresh acquire takes."""
    execution = db.claim()
    assert db.run(finish_iteration, "s", execution, "owner-a") is False
    db.run(_store.wake, "s")
    assert db.run(_store.acquire, "s", "exec-2", "owner-b", LEASE).verdict is AcquireVerdict.CLAIM


def test_finish_iteration_closes_open_messages(db: Db) -> None:
    """A drain that returned without finish(): finish_iteration finishes its open message and
    fails its running tools ('interrupted'), whether the claim continues or is released."""
    execution = busy_claim(db)
    db.run(_store.wake, "s")
    assert db.run(finish_iteration, "s", execution, "owner-a") is True
    message = db.message("m-1")
    assert (message.finished, message.error) == (True, INTERRUPTED)
    assert tools(message) == {"running": ("error", INTERRUPTED), "done": ("completed", None)}
    db.run(_store.begin_assistant, "s", execution, "owner-a", "m-2")
    assert db.run(finish_iteration, "s", execution, "owner-a") is False
    assert (db.message("m-2").finished, db.message("m-2").error) == (True, INTERRUPTED)


@pytest.mark.sqlite_only
def test_an_ending_over_a_second_open_message_not_utf8_writes_nothing(db: Db) -> None:
    """An execution with two open messages, the second's streamed text made bytes that are
    not UTF-8 by another tool (SQLite keeps them as TEXT): the drain's ending names that
    message malformed and writes nothing - the first message stays open, the claim stays
    for quarantine. The first message would be closed before the second is read: its
    write must be undone with the ending, never committed beside a refusal."""
    execution = busy_claim(db)
    [(data,)] = db.rows("SELECT data FROM session_message WHERE id = 'm-1'")
    db.put_message("m-2", execution, 10, data)
    db.write(
        "INSERT INTO session_message_delta(message_id, version, text)"
        " VALUES ('m-2', 5, CAST(X'ff' AS TEXT))"
    )
    before = db.snapshot()
    with pytest.raises(MalformedRecord) as raised:
        db.run(_store.end_iteration, "s", execution, "owner-a")
    assert (raised.value.table, raised.value.key) == ("session_message_delta", "m-2")
    assert db.snapshot() == before


_ENDINGS: dict[str, Any] = {
    "plain": IterationVerdict.RELEASE,
    "attempts": IterationVerdict.RELEASE,
    "rung": IterationVerdict.CONTINUE,
    "paused": IterationVerdict.PAUSE,
    "cancelling": IterationVerdict.RELEASE,
    "cancelling_rung": IterationVerdict.HAND_OVER,
    "cancelling_inputs": IterationVerdict.HAND_OVER,
    "open": IterationVerdict.RELEASE,
    "wrong_owner": LeaseLost,
    "expired": LeaseLost,
}


@pytest.mark.parametrize("state", list(_ENDINGS))
def test_end_iteration_of_a_lone_claim_in_each_state(db: Db, state: str) -> None:
    """`end_iteration` run alone (no group commit), in every state its verdict turns on:
    the verdict, and what it leaves - the claim deleted on any ending but `CONTINUE`, the
    resume count reset, an open message closed; a refusal writes nothing. Pins the common
    ending's shortcut on SQLite (a running, unrung, unpaused claim with nothing open,
    deleted in one statement) against the fence read's path."""
    execution = db.claim()
    owner = "owner-b" if state == "wrong_owner" else "owner-a"
    if state == "attempts":
        db.write("UPDATE session SET wake_attempts = 2")
    if state in ("rung", "cancelling_rung"):
        db.run(_store.wake, "s")
    if state == "paused":
        db.run(_store.pause, "s")
    if state == "cancelling_inputs":  # an input waits, its ring taken: handed over
        db.run(_store.submit, "s", '{"n": 1}', "in-1")
        db.write("UPDATE session SET time_woken = NULL, wakes = 0")
    if state.startswith("cancelling"):
        db.run(_store.mark_cancelling, "s", execution, "owner-a")
    if state == "open":
        db.run(_store.begin_assistant, "s", execution, "owner-a", "m-1")
    if state == "expired":
        db.expire()
    expected = _ENDINGS[state]
    if not isinstance(expected, IterationVerdict):
        before = db.snapshot()
        with pytest.raises(expected):
            db.run(_store.end_iteration, "s", execution, owner)
        assert db.snapshot() == before
        return
    assert db.run(_store.end_iteration, "s", execution, owner) is expected
    continues = expected is IterationVerdict.CONTINUE
    assert (db.claim_row() is not None) == continues
    assert db.doorbell()[2] == 0
    if state == "open":
        assert db.message("m-1").finished


@pytest.mark.sqlite_only  # PostgreSQL's column is typed
def test_end_iteration_of_a_lone_claim_over_a_text_resume_count_writes_nothing(db: Db) -> None:
    """As `test_end_iteration_of_a_lone_claim_in_each_state`, the session's resume count
    text another tool wrote: refused (`MalformedRecord`), nothing written - never released
    by the common ending's shortcut."""
    execution = db.claim()
    db.write("UPDATE session SET wake_attempts = 'abc'")
    before = db.snapshot()
    with pytest.raises(MalformedRecord):
        db.run(_store.end_iteration, "s", execution, "owner-a")
    assert db.snapshot() == before


@pytest.mark.sqlite_only
def test_an_ending_over_a_resume_count_not_utf8_names_it_malformed(db: Db) -> None:
    """A running claim whose session's resume count another tool set to bytes that are
    not UTF-8 (SQLite keeps them as TEXT), nothing else in the way of a release: the
    drain's ending names the session malformed (`MalformedRecord`, for quarantine) and
    writes nothing - never a `StoreError`, which a finalizer retries for ever over the
    same bytes. The ending that deletes the claim at once reads the count back from its
    DELETE: the refused read comes after a write, so it must be read again over bytes."""
    execution = db.claim()
    db.write("UPDATE session SET wake_attempts = CAST(X'ff' AS TEXT)")
    # The session row read as bytes (the driver refuses it as text), every other whole.
    session = "SELECT id, time_woken, wakes, CAST(wake_attempts AS BLOB) FROM session"
    before = (db.snapshot(set(_sqlite.OUR_TABLES) - {"session"}), db.rows(session))
    with pytest.raises(MalformedRecord) as raised:
        db.run(_store.end_iteration, "s", execution, "owner-a")
    assert (raised.value.table, raised.value.key) == ("session", "s")
    assert (db.snapshot(set(_sqlite.OUR_TABLES) - {"session"}), db.rows(session)) == before
    assert db.claim_row() is not None


def test_finish_failed_closes_message_and_does_not_rearm(db: Db) -> None:
    """finish_failed fails the open message and its running tools, deletes the claim, resets
    attempts, and leaves untaken inputs without re-arming the doorbell."""
    execution = busy_claim(db)
    db.write("UPDATE session SET time_woken = NULL, wakes = 0")  # taken mid-drain
    db.write("UPDATE session SET wake_attempts = 2")
    assert db.run(_store.finish_failed, "s", execution, "owner-a", "failed: boom") is False
    assert db.claim_row() is None
    message = db.message("m-1")
    assert message.finished
    assert message.error == "failed: boom"
    assert tools(message) == {"running": ("error", "failed: boom"), "done": ("completed", None)}
    assert db.doorbell() == (None, 0, 0)
    assert db.rows("SELECT id FROM session_input") == [("in-pending",)]


def test_finish_failed_reports_an_already_set_doorbell(db: Db) -> None:
    """A doorbell set before the failure stays set and is reported (one follow-up)."""
    execution = busy_claim(db)
    assert db.run(_store.finish_failed, "s", execution, "owner-a", "failed") is True
    assert db.doorbell()[0] is not None


def test_resume_rings_for_inputs_a_failed_drain_left_without_a_doorbell(db: Db) -> None:
    """§6.24: a session paused while its drain ran, which then failed - a failure does not
    re-arm the doorbell - keeps its untaken input pending with no doorbell. Work is
    pending, so resume rings the doorbell (and says so): exactly one busy period takes the
    input. Without the ring nothing would ever start it, as no wake is coming."""
    db.run(_store.submit, "s", '{"n": 1}', "in-1")
    assert db.run(_store.acquire, "s", "exec-1", "owner-a", LEASE).verdict is AcquireVerdict.CLAIM
    db.run(_store.pause, "s")
    assert db.run(_store.finish_failed, "s", "exec-1", "owner-a", "failed: boom") is False
    assert db.doorbell()[0] is None
    assert db.rows("SELECT id FROM session_input") == [("in-1",)]
    assert db.run(_store.resume, "s") is True
    assert db.doorbell()[:2] == (db.now, 1)
    # No longer paused: left as it is (it was signalled again, which rang the local
    # registry for a session that was never paused - an audit's find).
    assert db.run(_store.resume, "s") is False
    assert db.doorbell()[:2] == (db.now, 1)
    assert db.run(_store.acquire, "s", "exec-2", "owner-a", LEASE).verdict is AcquireVerdict.CLAIM


@pytest.mark.parametrize("marked_before", [False, True], ids=["running", "marked-elsewhere"])
def test_cancel_own_claims_leaves_a_stop_to_recovery_at_once_with_its_taken_wake(
    db: Db, marked_before: bool
) -> None:
    """A claim a user stopped whose own cleanup cannot run (closing, token lost): marked
    cancelling, its lease ended now, and a wake it had taken to go on rung again - also
    when another runtime's interrupt had marked it already (a review found such a claim
    skipped: its lease ran on and the taken wake was lost). Another owner's claim, or an
    execution it does not hold, is untouched."""
    execution = db.claim()
    assert db.doorbell()[0] is None  # the claim took the doorbell
    if marked_before:
        assert db.run(_store.request_cancel, "s") is True
    assert db.run(_store.cancel_own_claims, "owner-b", [(execution, "s", True)]) == 0
    before = db.claim_row()
    assert before is not None and before[2] == ("cancelling" if marked_before else "running")
    assert db.run(_store.cancel_own_claims, "owner-a", [(execution, "s", True)]) == 1
    after = db.claim_row()
    assert after is not None and (after[2], after[6]) == ("cancelling", db.now)
    assert db.doorbell()[0] == db.now


def test_mark_cancelling_changes_only_the_phase(db: Db) -> None:
    """mark_cancelling makes the cancellation durable and touches nothing else."""
    execution = busy_claim(db)
    before = db.snapshot()
    db.run(_store.mark_cancelling, "s", execution, "owner-a")
    after = db.snapshot()
    assert after["session_execution"] == [
        tuple("cancelling" if v == "running" else v for v in row)
        for row in before["session_execution"]
    ]
    assert {k: v for k, v in after.items() if k != "session_execution"} == {
        k: v for k, v in before.items() if k != "session_execution"
    }


def test_finish_interrupted_cleans_and_rearms_for_pending_inputs(db: Db) -> None:
    """finish_interrupted finishes the message as interrupted, fails running tools, deletes
    the claim and re-arms the doorbell because an input is still pending."""
    execution = busy_claim(db)
    db.run(finish_iteration, "s", execution, "owner-a")  # doorbell taken
    assert db.doorbell()[0] is None
    db.run(_store.mark_cancelling, "s", execution, "owner-a")
    assert db.run(_store.finish_interrupted, "s", execution, "owner-a") == _store.Interrupted(True)
    assert db.claim_row() is None
    message = db.message("m-1")
    assert message.finished
    assert message.error == INTERRUPTED
    assert tools(message) == {"running": ("error", INTERRUPTED), "done": ("completed", None)}
    assert db.doorbell()[0] == db.now


def test_finish_interrupted_without_inputs_leaves_no_doorbell(db: Db) -> None:
    """With nothing pending and no wake, an interrupt leaves no doorbell: no successor."""
    execution = db.claim()
    assert db.run(_store.finish_interrupted, "s", execution, "owner-a") == _store.Interrupted(False)
    assert db.doorbell()[:2] == (None, 0)
    assert db.claim_row() is None


@pytest.mark.parametrize("how", ["request_cancel", "mark_cancelling"])
def test_a_cancelling_claim_released_at_its_iteration_end_rearms_for_untaken_inputs(
    db: Db, how: str
) -> None:
    """A claim marked cancelling before its drain took the inputs takes none, and its drain
    returns: the iteration end releases it - and, like an interrupt's cleanup, rings for the
    inputs still pending, so its successor takes them (no stranded input)."""
    db.run(_store.submit, "s", '{"n": 1}', "in-1")
    execution = db.claim()  # the doorbell is taken; the input is pending
    if how == "request_cancel":
        assert db.run(_store.request_cancel, "s") is True  # from another process
    else:
        db.run(_store.mark_cancelling, "s", execution, "owner-a")
    assert db.run(_store.take_inputs, "s", execution, "owner-a") == []
    assert db.run(finish_iteration, "s", execution, "owner-a") is False
    assert db.claim_row() is None
    assert db.doorbell()[0] == db.now
    assert db.run(_store.acquire, "s", "exec-2", "owner-b", LEASE).verdict is (AcquireVerdict.CLAIM)
    [taken] = db.run(_store.take_inputs, "s", "exec-2", "owner-b")
    assert taken.id == "in-1"


def test_a_cancelling_claim_without_pending_inputs_rings_nothing(db: Db) -> None:
    """Released at its iteration end with nothing pending: no doorbell, no successor."""
    execution = db.claim()
    assert db.run(_store.request_cancel, "s") is True
    assert db.run(finish_iteration, "s", execution, "owner-a") is False
    assert db.claim_row() is None
    assert db.doorbell()[0] is None


def test_heartbeat_renews_all_claims_in_one_transaction(db: Db) -> None:
    """heartbeat renews each held live claim to now+lease, records heartbeat_at and reports
    each phase (cancelling too); a lost one reports None."""
    a = db.claim("a", execution="exec-a")
    b = db.claim("b", execution="exec-b")
    db.run(_store.mark_cancelling, "b", b, "owner-a")
    db.now += 10_000
    phases = db.run(_store.heartbeat, "owner-a", [a, b, "exec-gone"], LEASE)
    assert phases == {a: "running", b: "cancelling", "exec-gone": None}
    for session in ("a", "b"):
        row = db.claim_row(session)
        assert row is not None
        assert (row[5], row[6]) == (db.now, db.now + LEASE)


def test_expire_claims_counts_only_own_live_claims(db: Db) -> None:
    """Shutdown expiry ends own live leases (phase kept) and returns how many it ended."""
    a = db.claim("a", execution="exec-a")
    b = db.claim("b", execution="exec-b")
    db.run(_store.mark_cancelling, "b", b, "owner-a")
    db.claim("c", owner="owner-b", execution="exec-c")
    foreign = db.claim_row("c")
    assert db.run(_store.expire_claims, "owner-a", [a, b, "exec-c", "exec-none"]) == 2
    row_a, row_b = db.claim_row("a"), db.claim_row("b")
    assert row_a is not None
    assert (row_a[2], row_a[6]) == ("running", db.now)
    assert row_b is not None
    assert (row_b[2], row_b[6]) == ("cancelling", db.now)
    assert db.claim_row("c") == foreign
    assert db.run(_store.expire_claims, "owner-a", [a, b]) == 0
