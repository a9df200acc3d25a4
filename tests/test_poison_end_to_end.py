"""Rows another tool wrote by hand, followed end to end through a running runtime (DESIGN
§3, §4, §6.11): each surfaces as `MalformedRecord`, is quarantined or set aside, or is
worked through - never a session stuck for ever behind it, never the others held up."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from helpers import Raw, Recorder, runtime
from test_poison_records import first_of
from trio.testing import MockClock

from trio_sessions import MalformedRecord, Store

QUIET = {"recovery_interval": 10_000.0}  # passes only when the test asks for one


@pytest.mark.parametrize("expires_at", ["soon", b"\x01", 9e300], ids=["text", "blob", "huge"])
async def test_an_expired_claim_under_a_recovery_lease_whose_expiry_is_no_time_is_recovered(
    tmp_path: Path, clock: Any, autojump_clock: MockClock, expires_at: Any
) -> None:
    """§4 (a recovery lease is taken if absent or expired) on SQLite, which keeps whatever
    another tool writes (PostgreSQL's column is typed): a dead owner's expired claim whose
    `session_recovery` row - another recoverer's lease, not quarantined - has an
    `expires_at` that is no time. Text and blobs sort after every number, so the lease
    looked live for ever: every pass excluded the claim (examined 0), nothing quarantined
    it, and the session stayed stuck with its claim until an operator deleted rows by
    hand (found by the poison audit). A lease that is no time is no live lease: the pass
    takes it over and resumes the claim, as for an expired one."""
    db_path = tmp_path / "sessions.db"
    raw = Raw(db_path)
    drain = Recorder()
    async with runtime(Store(db_path, inline=True), drain, clock, **QUIET) as rt:
        raw.seed_claim("s", "e-s", expires_at=1)
        raw.write(
            "INSERT INTO session_recovery(execution_id, session_id, owner_id, expires_at,"
            " time_created) VALUES ('e-s', 's', 'other-recoverer', ?, 0)",
            (expires_at,),
        )
        report = await rt.recover_once()
        await rt.wait_idle("s")
    assert (report.examined, report.resumed, report.quarantined) == (1, 1, 0), report
    assert [(call.session_id, call.resumed) for call in drain.calls] == [("s", True)]
    assert raw.rows("SELECT execution_id FROM session_recovery") == []


@pytest.mark.parametrize("anchor_seq", ["abc", b"\x01", 2.5], ids=["text", "blob", "real"])
async def test_an_expired_claim_whose_anchor_is_no_seq_is_quarantined_not_resumed(
    tmp_path: Path, clock: Any, autojump_clock: MockClock, anchor_seq: Any
) -> None:
    """§6.5 (recovery never resumes a superseded execution) and §6.11 on SQLite
    (PostgreSQL's column is typed): a dead owner's expired claim whose `anchor_seq` another
    tool wrote as no whole number, in a session where another execution wrote an assistant
    message since. Whether that message came after the claim's anchor cannot be told -
    `seq > 'abc'` is false for every number - so recovery resumed the claim (resumed 1),
    a drain on a transcript another execution had moved on from. Expected: the claim is
    quarantined with a reason naming `anchor_seq`, as a claim whose expiry is no time, and
    the valid claim beside it resumes in the same pass."""
    db_path = tmp_path / "sessions.db"
    raw = Raw(db_path)
    drain = Recorder()
    async with runtime(Store(db_path, inline=True), drain, clock, **QUIET) as rt:
        raw.seed_claim("s", "e-s", expires_at=1)
        raw.write("UPDATE session_execution SET anchor_seq = ? WHERE id = 'e-s'", (anchor_seq,))
        raw.seed_assistant("s", "e-other", 1, '{"parts": [], "finished": true, "error": null}')
        raw.seed_claim("valid", "e-valid", expires_at=1)
        report = await rt.recover_once()
        await rt.wait_idle("valid")
        [(execution_id, why)] = raw.rows(
            "SELECT execution_id, recovery_error FROM session_recovery"
        )
        # The operator drops it; the session works again.
        await rt.release_quarantine("e-s", resume=False)
        await rt.submit("s", {"n": 1})
        await rt.wait_idle("s")
    assert (report.resumed, report.quarantined) == (1, 1), report
    assert [call.session_id for call in drain.calls] == ["valid", "s"]
    assert execution_id == "e-s"
    assert "anchor_seq" in why, why


@pytest.mark.parametrize("how", ["drained", "scheduled", "producer"])
@pytest.mark.parametrize("input_seq", ["abc", b"\x01"], ids=["text", "blob"])
async def test_a_submit_to_a_session_whose_input_count_is_no_count_stores_nothing(
    tmp_path: Path, clock: Any, autojump_clock: MockClock, input_seq: Any, how: str
) -> None:
    """§4 (inputs are taken in the order they were stored) and §5 (a malformed row raises
    `MalformedRecord`) on SQLite (PostgreSQL's column is typed): a session with a pending
    input at seq 2, whose `input_seq` another tool wrote as text or a blob. SQLite counts
    `'abc' + 1` as 1, so the next input was stored at seq 1 - ahead of the input already
    waiting, which the next drain then took second - and with an input at seq 1 still
    pending the submit failed with a bare "UNIQUE constraint failed" `StoreError`.
    Expected: every submit path refuses it with `MalformedRecord` naming the session and
    its `input_seq`, storing nothing."""
    db_path = tmp_path / "sessions.db"
    raw = Raw(db_path)
    drain = None if how == "producer" else Recorder()
    async with runtime(Store(db_path, inline=True), drain, clock, **QUIET) as rt:
        raw.write(
            "INSERT INTO session(id, time_created, input_seq) VALUES ('s', 0, ?)", (input_seq,)
        )
        raw.write(
            "INSERT INTO session_input(id, session_id, seq, payload, time_created)"
            " VALUES ('waiting', 's', 2, '{}', 0)"
        )
        with pytest.raises(MalformedRecord) as raised:
            await rt.submit("s", {"n": 1}, delay=5 if how == "scheduled" else None)
    assert (raised.value.table, raised.value.key) == ("session", "s")
    assert "input_seq" in str(raised.value)
    assert raw.rows("SELECT id, seq FROM session_input") == [("waiting", 2)]


@pytest.mark.parametrize("how", ["drained", "scheduled", "producer"])
async def test_a_submit_to_a_session_whose_input_count_is_negative_stores_nothing_on_both(
    store: Any,
    db_path: Any,
    clock: Any,
    autojump_clock: MockClock,
    how: str,
) -> None:
    """§6.20: as above, on both backends - PostgreSQL's BIGINT column keeps a negative
    count as well. There `ts_insert_input` (and the other server-side submits) counted on
    from it and stored the input at seq -2, ahead of the one waiting; now they answer
    'malformed', writing nothing, and the path in Python refuses it (schema 26)."""
    raw = Raw(db_path)
    drain = None if how == "producer" else Recorder()
    async with runtime(store, drain, clock, **QUIET) as rt:
        raw.write("INSERT INTO session(id, time_created, input_seq) VALUES ('s', 0, -3)")
        raw.write(
            "INSERT INTO session_input(id, session_id, seq, payload, time_created)"
            " VALUES ('waiting', 's', 2, '{}', 0)"
        )
        with pytest.raises(MalformedRecord):
            await rt.submit("s", {"n": 1}, delay=5 if how == "scheduled" else None)
    assert raw.rows("SELECT id, seq FROM session_input") == [("waiting", 2)]


@pytest.mark.parametrize("where", ["message", "delta"])
async def test_a_quarantine_for_an_open_message_at_the_largest_version_can_be_dropped(
    store: Any, db_path: Any, clock: Any, autojump_clock: MockClock, where: str
) -> None:
    """§4 (`release_quarantine(resume=False)` finishes the open transcript, deletes the
    claim; dropping a quarantine sets the malformed message aside, so the session reads
    again), on both backends: a crashed claim whose open assistant message another tool
    left at `version` 2**63 - 1 (or a text streamed onto it at that version). No write can
    bump it (SQLite computes a REAL, PostgreSQL refuses 'bigint out of range'), so
    recovery quarantines the claim - but the drop tried to finish that message too and
    failed the same way, every time: the operator could neither drop nor resume it (no way
    out but SQL). Expected: the drop sets the message aside (raw text and why kept in
    `session_message_rejected`), and the session works again."""
    raw = Raw(db_path)
    drain = Recorder()
    async with runtime(store, drain, clock, **QUIET) as rt:
        raw.seed_claim("s", "e-s", expires_at=1)
        message_id = raw.seed_assistant(
            "s", "e-s", 1, '{"parts": [], "finished": false, "error": null}'
        )
        if where == "message":
            raw.write(
                "UPDATE session_message SET version = ? WHERE id = ?", (2**63 - 1, message_id)
            )
        else:
            raw.write(
                "INSERT INTO session_message_delta(message_id, version, text) VALUES (?, ?, 'x')",
                (message_id, 2**63 - 1),
            )
        report = await rt.recover_once()
        assert report.quarantined == 1, report
        await rt.release_quarantine("e-s", resume=False)
        [(rejected, why)] = raw.rows("SELECT id, reason FROM session_message_rejected")
        assert await rt.transcript("s") == []
        await rt.submit("s", {"n": 1})
        await rt.wait_idle("s")
    assert rejected == message_id
    assert "version out of range" in why, why
    assert [call.session_id for call in drain.calls] == ["s"]
    assert raw.rows("SELECT execution_id FROM session_recovery") == []


@pytest.mark.parametrize("where", ["message", "delta"])
async def test_watch_shows_a_message_whose_version_is_negative(
    store: Any, db_path: Any, clock: Any, autojump_clock: MockClock, where: str
) -> None:
    """§5 (`watch`: first every message as stored now; never skips a message's latest
    snapshot), on both backends (a BIGINT keeps a negative number as well): a message
    another tool wrote at `version` -5 (or an open one with a text streamed onto it at
    -5). `transcript()` and `stream()` show it, but `watch()` gave nothing: a watcher
    takes a snapshot only if its version is above the newest it has seen of the message,
    counted from -1 for one never seen - so the message never reached it, with no error.
    Expected: the watcher's first snapshot is that message, as `transcript()` reads it."""
    raw = Raw(db_path)
    async with runtime(store, Recorder(), clock, **QUIET) as rt:
        if where == "message":
            raw.seed_user_message("s", "m", 1)
            raw.write("UPDATE session_message SET version = -5 WHERE id = 'm'")
        else:
            raw.seed_claim("s", "e", expires_at=2**62)
            message_id = raw.seed_assistant(
                "s", "e", 1, '{"parts": [], "finished": false, "error": null}'
            )
            raw.write(
                "INSERT INTO session_message_delta(message_id, version, text) VALUES (?, -5, 'a')",
                (message_id,),
            )
        [stored] = await rt.transcript("s")
        watched = await first_of(rt.watch("s"))
    assert watched == stored


@pytest.mark.parametrize("resume", [False, True])
async def test_a_quarantine_whose_row_names_another_session_is_released_for_its_claims_session(
    store: Any, db_path: Any, clock: Any, autojump_clock: MockClock, resume: bool
) -> None:
    """§4 (`release_quarantine`), on both backends: a quarantined execution whose
    `session_recovery.session_id` another tool changed to a session that has no row. The
    release read its session from that row, so the drop set the malformed message aside
    under a session that does not exist and failed with a bare "FOREIGN KEY constraint
    failed" `StoreError`, every time; the resume looked for the claim in that session.
    Expected: the claim's own session is the one released - the message set aside (drop)
    or the claim quarantined again with `MalformedRecord` (resume: it still does not
    decode) - and after the drop the session works again."""
    raw = Raw(db_path)
    drain = Recorder()
    async with runtime(store, drain, clock, **QUIET) as rt:
        raw.seed_claim("s", "e-s", expires_at=1)
        raw.seed_assistant("s", "e-s", 1, '{"parts": 5}')
        assert (await rt.recover_once()).quarantined == 1
        raw.write("UPDATE session_recovery SET session_id = 'elsewhere'")
        if resume:
            with pytest.raises(MalformedRecord):
                await rt.release_quarantine("e-s", resume=True)
            assert raw.rows("SELECT session_id FROM session_recovery") == [("s",)]
            return
        await rt.release_quarantine("e-s", resume=False)
        assert raw.rows("SELECT session_id FROM session_message_rejected") == [("s",)]
        await rt.submit("s", {"n": 1})
        await rt.wait_idle("s")
    assert [call.session_id for call in drain.calls] == ["s"]


@pytest.mark.parametrize("version", ["x", b"\x01"], ids=["text", "blob"])
async def test_a_stream_resumed_on_an_open_message_whose_version_is_no_number_does_not_crash(
    tmp_path: Path, clock: Any, autojump_clock: MockClock, version: Any
) -> None:
    """§5.2 (iterating a stream raises `MalformedRecord` for a row that does not decode,
    `StoreError` when a read fails) on SQLite (PostgreSQL's column is typed): a client
    resumes a stream with the cursor of an open message, whose `version` another tool then
    wrote as text or a blob. The read compared that version with the cursor's in Python
    and raised a bare `TypeError` ("'>' not supported between instances of 'str' and
    'int'") out of the stream, every time the client reconnected. `transcript()` reads the
    message; a version that is no number goes last in a stream's order (`placed`), as for
    a REAL, so the client gets the message whole."""
    db_path = tmp_path / "sessions.db"
    raw = Raw(db_path)
    async with runtime(Store(db_path, inline=True), Recorder(), clock, **QUIET) as rt:
        raw.write("INSERT INTO session(id, time_created) VALUES ('s', 0)")
        raw.seed_assistant(
            "s",
            "e",
            1,
            '{"parts": [{"type": "text", "text": "a"}], "finished": false, "error": null}',
        )
        first = await first_of(rt.stream("s"))
        raw.write("UPDATE session_message SET version = ?", (version,))
        resumed = await first_of(rt.stream("s", cursor=first.cursor))
        [stored] = await rt.transcript("s")
    assert (resumed.kind, resumed.seq, resumed.data) == ("message", 1, stored.data)


async def test_a_quarantine_resumed_with_its_budget_spent_ends_failed_and_keeps_its_inputs(
    store: Any, db_path: Any, clock: Any, autojump_clock: MockClock
) -> None:
    """§4 (`release_quarantine(resume=True)` recovers under the normal rules, "budget
    counts"; a failed ending does not re-arm the doorbell), on both backends: a dead
    owner's claim quarantined with its resume budget spent (the malformed check comes
    before the budget's), repaired, then released with `resume=True`. It is finished as
    failed - "resume budget exhausted", no drain - and its untaken input stays pending with
    no doorbell and no claim, as after any failed drain, until the next wake takes it with
    a fresh budget. (The README and the CLI's help said such a resume resumes the work
    once its records decode: the operator who wants the work retried drops the quarantine
    instead - which resets the budget and rings the doorbell.)"""
    raw = Raw(db_path)
    drain = Recorder()
    async with runtime(store, drain, clock, max_resumes=3, **QUIET) as rt:
        raw.seed_claim("s", "e-s", expires_at=1, wake_attempts=3)
        raw.seed_assistant("s", "e-s", 1, '{"parts": [], "finished": "no", "error": null}')
        raw.write(
            "INSERT INTO session_input(id, session_id, seq, payload, time_created)"
            " VALUES ('i1', 's', 1, '{}', 0)"
        )
        assert (await rt.recover_once()).quarantined == 1
        raw.write(
            "UPDATE session_message SET data = ? WHERE id = 'm-e-s-1'",
            ('{"parts": [], "finished": false, "error": null}',),
        )
        await rt.release_quarantine("e-s", resume=True)
        await rt.wait_idle("s")
        (reply,) = await rt.transcript("s")
        assert (reply.data.finished, reply.data.error) == (True, "resume budget exhausted")
        assert drain.calls == []
        assert raw.rows("SELECT id FROM session_execution") == []
        assert raw.rows("SELECT time_woken, wake_attempts FROM session") == [(None, 0)]
        assert raw.rows("SELECT id FROM session_input") == [("i1",)]
        await rt.wake("s")
        await rt.wait_idle("s")
    assert [(call.resumed, call.attempt) for call in drain.calls] == [(False, 0)]
    assert raw.rows("SELECT id FROM session_input") == []
