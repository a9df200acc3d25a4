"""Recovery: the sibling pass, its exclusions, quarantine without starvation, the resume
budget, unclaimed doorbells and release_quarantine. Rows from "dead" owners are seeded raw.
"""

from __future__ import annotations

import functools
import math
import sqlite3
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import trio
from helpers import Raw, Recorder, now_ms, open_tool_message, runtime
from trio.testing import MockClock

from trio_sessions import (
    DrainContext,
    MalformedRecord,
    RecoveryReport,
    Runtime,
    Store,
    StoreError,
    _cli,
    _loops,
    _store,
    testing,
)
from trio_sessions._codec import decode_assistant

Clock = Callable[[], float]
QUIET = {"recovery_interval": 10_000.0}  # passes only when the test asks for one
MALFORMED = '{"parts": [], "finished": "false", "error": null}'


def expired(clock: Clock, by_ms: int = 1) -> int:
    return now_ms(clock) - by_ms


async def test_resumes_expired_claim_of_dead_owner(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """An expired claim is taken over once: new execution, resumed=True, attempt 1, the
    dead owner's running tool failed as owner-lost and its message finished."""
    drain = Recorder()
    raw = Raw(db_path)
    async with runtime(store, drain, clock, **QUIET) as rt:
        raw.seed_claim("s", "dead-exec", expires_at=expired(clock))
        message_id = raw.seed_assistant("s", "dead-exec", 1, open_tool_message())
        report = await rt.recover_once()
        await rt.wait_idle("s")
    assert report == RecoveryReport(examined=1, resumed=1)
    assert len(drain.calls) == 1
    ctx = drain.calls[0]
    assert ctx.resumed is True and ctx.attempt == 1 and ctx.execution_id != "dead-exec"
    old = decode_assistant(
        raw.one("SELECT data FROM session_message WHERE id=?", (message_id,))[0], key="m"
    )
    assert old.finished is True and old.error == "interrupted: owner lost"
    assert old.parts[0].status == "error"  # type: ignore[union-attr]
    assert old.parts[0].error == "interrupted: owner lost"  # type: ignore[union-attr]
    assert raw.claim("s") is None
    assert raw.rows("SELECT * FROM session_recovery") == []
    assert raw.one("SELECT wake_attempts FROM session WHERE id='s'") == (0,)


async def test_first_pass_runs_while_opening(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """open_runtime returns only after its first recovery pass took over expired claims."""
    raw = Raw(db_path)
    async with runtime(store, Recorder(), clock, **QUIET):
        pass  # create the schema
    raw.seed_claim("s", "dead-exec", expires_at=expired(clock))
    drain = Recorder()
    drain.hold()
    async with runtime(store, drain, clock, **QUIET) as rt:
        claim = raw.claim("s")
        assert claim is not None and claim[0] != "dead-exec" and claim[1] == rt.owner_id


async def test_recovery_runs_every_interval(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """The sibling recovery task picks up an expired claim within one recovery_interval."""
    drain = Recorder()
    async with runtime(store, drain, clock, recovery_interval=2.0) as rt:
        Raw(db_path).seed_claim("s", "dead-exec", expires_at=expired(clock))
        await trio.sleep(2.5)
        await rt.wait_idle("s")
    assert len(drain.calls) == 1 and drain.calls[0].resumed


async def test_open_fails_when_first_pass_hits_store_error(
    db_path: Path, clock: Clock, autojump_clock: MockClock
) -> None:
    """A store error in the first recovery pass fails open_runtime with StoreError."""

    class Broken:
        def __init__(self, conn: sqlite3.Connection) -> None:
            self.conn = conn

        @property
        def in_transaction(self) -> bool:
            return self.conn.in_transaction

        def execute(self, sql: str, params: Any = ()) -> sqlite3.Cursor:
            if "json_each" in sql:
                raise sqlite3.OperationalError("disk I/O error")
            return self.conn.execute(sql, params)

        def executemany(self, sql: str, rows: Any) -> sqlite3.Cursor:
            return self.conn.executemany(sql, rows)

    with pytest.raises(StoreError, match="disk I/O error"):
        async with runtime(Store(db_path, inline=True, wrap_connection=Broken), Recorder(), clock):
            pytest.fail("the runtime must not open")


async def test_never_recovers_a_live_lease(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """A live claim is not a candidate, and one renewed between scan and apply is skipped
    untouched (invariant 5)."""
    drain = Recorder()
    raw = Raw(db_path)
    async with runtime(store, drain, clock, **QUIET) as rt:
        raw.seed_claim("live", "live-exec", expires_at=now_ms(clock) + 60_000)
        assert (await rt.recover_once()).examined == 0
        raw.seed_claim("renewed", "renewed-exec", expires_at=expired(clock))

        async def renew(execution_ids: list[str]) -> None:
            raw.write(
                "UPDATE session_execution SET expires_at = ? WHERE id = 'renewed-exec'",
                (now_ms(clock) + 60_000,),
            )

        testing.set_seams(rt, before_recovery_apply=renew)
        report = await rt.recover_once()
    assert report == RecoveryReport(examined=1, skipped_live=1)
    assert drain.calls == []
    assert raw.claim("renewed")[0] == "renewed-exec"
    assert raw.claim("live")[0] == "live-exec"


def untaken_input(raw: Raw, input_id: str) -> None:
    """An input of session s (seeded with its claim) that no drain took."""
    raw.write(
        "INSERT INTO session_input(id, session_id, seq, payload, time_created)"
        " VALUES (?, 's', 1, '{}', 0)",
        (input_id,),
    )


async def test_expired_cancellation_claim_is_finished_not_resumed(
    store: Store,
    clock: Clock,
    db_path: Path,
    autojump_clock: MockClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """phase='cancelling' + expired: finished as cancelled (transcript interrupted, claim
    deleted, inputs re-armed), never resumed (invariant 5). The re-armed doorbell starts a
    fresh drain here at once, with no second pass: the pass's own commit is no change
    signal, so the runtime looks for the doorbells its endings re-armed."""
    monkeypatch.setattr(_loops, "CHANGE_FALLBACK_POLL", 3600.0)  # no fallback look either
    raw = Raw(db_path)
    drain = Recorder()
    gate = drain.hold()
    async with runtime(store, drain, clock, **QUIET) as rt:
        raw.seed_claim("s", "dead-exec", expires_at=expired(clock), phase="cancelling")
        message_id = raw.seed_assistant("s", "dead-exec", 1, open_tool_message())
        untaken_input(raw, "left")
        report = await rt.recover_once()
        assert report == RecoveryReport(examined=1, finished_cancelled=1)
        assert raw.one("SELECT COUNT(*) FROM session_execution WHERE id = 'dead-exec'") == (0,)
        data = decode_assistant(
            raw.one("SELECT data FROM session_message WHERE id=?", (message_id,))[0], key="m"
        )
        assert data.finished and data.error == "interrupted"
        with trio.fail_after(60):  # virtual time: the next recovery pass is 10,000 s away
            await drain.entered.wait()
        assert drain.taken == ["left"] and drain.calls[0].resumed is False
        gate.set()


async def test_wait_idle_right_after_open_waits_for_the_successor_the_first_pass_owes(
    store: Store,
    clock: Clock,
    db_path: Path,
    autojump_clock: MockClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A dead owner's cancelling claim with an untaken input: the opening pass finishes it
    and re-arms the doorbell, and this runtime owes the successor. `wait_idle` right after
    `open_runtime` returns waits for that successor (DESIGN §5: "includes successors"), as
    it would had the input been submitted here - not only once the change loop took it."""
    monkeypatch.setattr(_loops, "CHANGE_FALLBACK_POLL", 3600.0)
    raw = Raw(db_path)
    async with runtime(store, None, clock, **QUIET):
        pass  # the schema, migrated
    raw.seed_claim("s", "dead-exec", expires_at=expired(clock), phase="cancelling")
    untaken_input(raw, "left")
    drain = Recorder()
    async with runtime(store, drain, clock, **QUIET) as rt:
        await rt.wait_idle("s")
        assert drain.taken == ["left"]
        assert raw.claim("s") is None


async def test_superseded_execution_is_dropped_not_resumed(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """An assistant message from another execution newer than the claim's anchor drops the
    claim without resuming it (invariant 5)."""
    drain = Recorder()
    raw = Raw(db_path)
    async with runtime(store, drain, clock, **QUIET) as rt:
        raw.seed_claim("s", "old-exec", expires_at=expired(clock), anchor_seq=1)
        raw.seed_assistant("s", "other-exec", 2, open_tool_message())
        report = await rt.recover_once()
        await rt.wait_idle("s")
    assert report == RecoveryReport(examined=1, dropped_superseded=1)
    assert drain.calls == []
    assert raw.claim("s") is None


async def test_not_superseded_by_older_message(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """A message from another execution at or before the anchor does not supersede."""
    drain = Recorder()
    raw = Raw(db_path)
    async with runtime(store, drain, clock, **QUIET) as rt:
        raw.seed_claim("s", "old-exec", expires_at=expired(clock), anchor_seq=1)
        raw.seed_assistant("s", "other-exec", 1, open_tool_message())
        report = await rt.recover_once()
        await rt.wait_idle("s")
    assert report == RecoveryReport(examined=1, resumed=1)


async def test_malformed_projection_is_quarantined_and_never_rescanned(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """A claim whose newest assistant message does not decode is quarantined with a
    readable reason, and later passes never examine it again."""
    raw = Raw(db_path)
    async with runtime(store, Recorder(), clock, **QUIET) as rt:
        raw.seed_claim("s", "poison", expires_at=expired(clock))
        raw.seed_assistant("s", "poison", 1, MALFORMED)
        assert await rt.recover_once() == RecoveryReport(examined=1, quarantined=1)
        row = raw.one("SELECT recovery_error, time_quarantined FROM session_recovery")
        assert "expected bool" in row[0] and row[1] == now_ms(clock)
        await trio.sleep(100)
        assert (await rt.recover_once()).examined == 0
        assert raw.claim("s")[0] == "poison"


async def quarantined_beside_a_resumed_claim(
    rt: Runtime, raw: Raw, clock: Clock, drain: Recorder
) -> str:
    """Seed a valid expired claim beside the bad one the test seeded, run one recovery
    pass, and assert the bad claim is quarantined and the valid one resumes (§6.11): the
    quarantine's reason."""
    raw.seed_claim("good", "good-exec", expires_at=expired(clock))
    report = await rt.recover_once()
    await rt.wait_idle("good")
    assert report == RecoveryReport(examined=2, resumed=1, quarantined=1)
    assert [call.session_id for call in drain.calls] == ["good"]
    [(reason,)] = raw.rows("SELECT recovery_error FROM session_recovery")
    return str(reason)


def crashed_with_an_open_message(
    raw: Raw, clock: Clock, data: str = '{"parts": [], "finished": false, "error": null}'
) -> str:
    """Session 'bad': an expired claim 'bad-exec' whose assistant message is open (`data`);
    returns the message's id."""
    raw.seed_claim("bad", "bad-exec", expires_at=expired(clock, 10))
    return raw.seed_assistant("bad", "bad-exec", 1, data)


def write_text_that_is_not_utf8(raw: Raw, message: str, where: str) -> None:
    """Another tool's write into the open message `message`: its data, a word streamed
    into it, or its id becomes text that is not UTF-8."""
    if where == "message":
        raw.write(
            "UPDATE session_message SET data = CAST(X'7B2274223A2280FF227D' AS TEXT) WHERE id = ?",
            (message,),
        )
    elif where == "delta":
        raw.write(
            "INSERT INTO session_message_delta(message_id, version, text)"
            " SELECT id, version + 1, CAST(X'80FF' AS TEXT) FROM session_message"
            " WHERE id = ?",
            (message,),
        )
    else:
        raw.write("UPDATE session_message SET id = CAST(X'6DFF' AS TEXT) WHERE id = ?", (message,))


@pytest.mark.parametrize("where", ["message", "delta", "message id"])
async def test_text_that_is_not_utf8_is_quarantined_and_the_claims_behind_it_resume(
    tmp_path: Path, clock: Clock, autojump_clock: MockClock, where: str
) -> None:
    """SQLite keeps whatever bytes another tool wrote as TEXT. A crashed claim whose open
    message (a word streamed into it, its id) is not UTF-8 is quarantined with a readable
    reason, and the valid claim beside it resumes (§6.11): the driver's decode error failed
    every pass, and with it every `open_runtime` on the file."""
    db_path = tmp_path / "sessions.db"
    raw = Raw(db_path)
    drain = Recorder()
    async with runtime(Store(db_path, inline=True), drain, clock, **QUIET) as rt:
        message = crashed_with_an_open_message(raw, clock)
        write_text_that_is_not_utf8(raw, message, where)
        reason = await quarantined_beside_a_resumed_claim(rt, raw, clock, drain)
    assert "not UTF-8" in reason
    # The operator's way out: the drop sets the message aside (its bytes kept as they
    # were, the reason naming it) and the transcript reads again. The driver's decode
    # error failed the drop, so the quarantine could not be released.
    assert _cli.main(["quarantine", "release", str(db_path), "bad-exec", "--drop"]) == 0
    [(rejected, kept, why)] = raw.rows("SELECT id, data, reason FROM session_message_rejected")
    assert rejected == (bytes.fromhex("6DFF") if where == "message id" else message)
    assert "not UTF-8" in why
    if where == "message":  # the bytes as stored, nothing replaced
        assert kept == bytes.fromhex("7B2274223A2280FF227D")
    elif where == "delta":
        assert "streamed since: [b'\\x80\\xff']" in why
    async with runtime(Store(db_path, inline=True), drain, clock, **QUIET) as rt:
        assert await rt.transcript("bad") == []


@pytest.mark.parametrize(
    ("where", "row"),
    [
        ("message", "session_message row 'm-bad-exec-1'"),
        ("delta", "session_message_delta row 'm-bad-exec-1'"),
        ("message id", "session_message row 'm\ufffd'"),
    ],
    ids=["message", "delta", "message id"],
)
async def test_a_quarantine_for_text_that_is_not_utf8_names_the_row(
    tmp_path: Path, clock: Clock, autojump_clock: MockClock, where: str, row: str
) -> None:
    """The quarantine reason for text that is not UTF-8 names the row it is in (table,
    key), as every other malformed reason does (`MalformedRecord`), so an operator knows
    which row to look at. It was the driver's error, which names only a column ("a row's
    text is not UTF-8: Could not decode to UTF-8 column 'data' ..."). Found by an audit."""
    db_path = tmp_path / "sessions.db"
    raw = Raw(db_path)
    drain = Recorder()
    async with runtime(Store(db_path, inline=True), drain, clock, **QUIET) as rt:
        write_text_that_is_not_utf8(raw, crashed_with_an_open_message(raw, clock), where)
        reason = await quarantined_beside_a_resumed_claim(rt, raw, clock, drain)
    assert f"malformed {row}: " in reason, reason
    assert "not UTF-8" in reason, reason


async def test_a_message_with_no_id_is_quarantined_readably_and_dropped(
    tmp_path: Path, clock: Clock, autojump_clock: MockClock
) -> None:
    """SQLite's `id TEXT PRIMARY KEY` of a rowid table takes the NULL another tool writes.
    A crashed claim whose open message has no id is quarantined saying so (§6.11: the claim
    beside it resumes), and the operator's drop sets that message aside so the transcript
    reads again. Before, the takeover's close of the message raised a TypeError (its
    `UPDATE ... WHERE id = NULL` found no row), quarantined as "recovery failed:
    TypeError(...)", and every drop failed with that TypeError: no way out but SQL."""
    db_path = tmp_path / "sessions.db"
    raw = Raw(db_path)
    drain = Recorder()
    async with runtime(Store(db_path, inline=True), drain, clock, **QUIET) as rt:
        message = crashed_with_an_open_message(raw, clock)
        raw.write("UPDATE session_message SET id = NULL WHERE id = ?", (message,))
        reason = await quarantined_beside_a_resumed_claim(rt, raw, clock, drain)
        assert "id is NULL" in reason, reason
        await rt.release_quarantine("bad-exec", resume=False)
        [(rejected, why)] = raw.rows("SELECT id, reason FROM session_message_rejected")
        assert rejected is None and "id is NULL" in why
        assert await rt.transcript("bad") == []
        assert raw.rows("SELECT id FROM session_execution WHERE session_id = 'bad'") == []


@pytest.mark.parametrize("which", ["doorbell", "session_id", "execution_id"])
async def test_a_row_whose_id_is_not_utf8_never_stops_recovery_of_the_others(
    tmp_path: Path, clock: Clock, autojump_clock: MockClock, which: str
) -> None:
    """§6.11 on SQLite, which keeps whatever bytes another tool writes as TEXT: a session
    whose id is not UTF-8 with its doorbell set, or an expired claim whose session id or
    execution id is not, is passed over by every recovery pass (no id of it can be named
    from Python; `status` lists it as malformed), and the valid work beside it resumes.
    The driver's decode error failed every pass, and with it every `open_runtime` on the
    file: no crashed session was resumed and no worker could start."""
    db_path = tmp_path / "sessions.db"
    raw = Raw(db_path)
    drain = Recorder()
    async with runtime(Store(db_path, inline=True), drain, clock, **QUIET) as rt:
        bad = "CAST(X'62ff' AS TEXT)"  # 'b' and a byte no UTF-8 text holds
        if which == "doorbell":
            raw.write(
                f"INSERT INTO session(id, time_created, time_woken, wakes) VALUES ({bad}, 0, 1, 1)"
            )
        else:
            session = bad if which == "session_id" else "'bad'"
            execution = bad if which == "execution_id" else "'bad-exec'"
            raw.write(f"INSERT INTO session(id, time_created) VALUES ({session}, 0)")
            raw.write(
                "INSERT INTO session_execution(id, session_id, owner_id, phase, time_created,"
                f" expires_at) VALUES ({execution}, {session}, 'dead', 'running', 0, 1)"
            )
        raw.seed_claim("good", "good-exec", expires_at=expired(clock))
        raw.write(
            "INSERT INTO session(id, time_created, time_woken, wakes) VALUES ('woken', 0, 1, 1)"
        )
        report = await rt.recover_once()
        await rt.wait_idle("good")
        await rt.wait_idle("woken")
    assert report == RecoveryReport(examined=2, resumed=1, doorbells_started=1)
    assert sorted(call.session_id for call in drain.calls) == ["good", "woken"]


async def test_a_session_id_that_is_not_utf8_never_stops_promotion_or_purge_of_others(
    tmp_path: Path, clock: Clock, autojump_clock: MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """§6.11 on SQLite: a scheduled input, or an idle session, whose session id is not
    UTF-8 (another tool's write) is passed over, and the other sessions' scheduled inputs
    still fall due and their idle sessions are still purged. The driver's decode error
    failed every promotion (no scheduled input of any session was delivered) and every
    purge. Passed over by the promotion, such an input must not count as due either: the
    timer then fired every millisecond, promoting nothing."""
    promotions = []
    promote_due = _store.promote_due

    def counted(tx: Any, limit: int) -> Any:
        promotions.append(limit)
        return promote_due(tx, limit)

    monkeypatch.setattr(_store, "promote_due", counted)
    db_path = tmp_path / "sessions.db"
    raw = Raw(db_path)
    drain = Recorder()
    async with runtime(Store(db_path, inline=True), drain, clock, **QUIET) as rt:
        bad = "CAST(X'62ff' AS TEXT)"
        raw.write(f"INSERT INTO session(id, time_created) VALUES ({bad}, 0)")
        raw.write(
            "INSERT INTO session_input(id, session_id, seq, payload, time_created, due_at)"
            f" VALUES ('in-bad', {bad}, 1, '{{}}', 0, 1)"
        )
        raw.write(f"INSERT INTO session(id, time_created) VALUES ({bad} || 'idle', 0)")
        raw.write("INSERT INTO session(id, time_created) VALUES ('idle', 0)")
        await rt.submit("later", {"n": 1}, delay=5)
        with trio.fail_after(60):
            await trio.sleep(6)
            await rt.wait_idle("later")
        assert [call.session_id for call in drain.calls] == ["later"]
        assert len(promotions) <= 3  # "later" falling due, and a look or two around it
        assert await rt.purge(idle_for=3) == 1  # "later" answered within the last 3 s
    assert raw.rows("SELECT id FROM session WHERE id = 'idle'") == []
    assert raw.rows("SELECT COUNT(*) FROM session") == [(3,)]  # the two bad ones, "later"


async def test_a_claim_whose_session_row_is_gone_is_quarantined_not_resumed(
    tmp_path: Path, clock: Clock, autojump_clock: MockClock
) -> None:
    """§6.11 on SQLite: a claim whose session row another tool deleted with foreign keys
    off is quarantined with a reason naming the missing row, and its drain never runs. It
    was resumed: the drain ran for a session that does not exist and lost its claim at
    once (the claim was left live), and so again after every lease."""
    db_path = tmp_path / "sessions.db"
    raw = Raw(db_path)
    drain = Recorder()
    async with runtime(Store(db_path, inline=True), drain, clock, **QUIET) as rt:
        raw.seed_claim("orphan", "orphan-exec", expires_at=expired(clock, 10))
        conn = sqlite3.connect(db_path)
        with conn:
            conn.execute("PRAGMA foreign_keys = OFF")
            conn.execute("DELETE FROM session WHERE id = 'orphan'")
        conn.close()
        reason = await quarantined_beside_a_resumed_claim(rt, raw, clock, drain)
    assert "its session 'orphan' has no row" in reason


async def test_a_nul_in_a_malformed_message_is_quarantined_readably_and_dropped(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """§6.11: a crashed claim whose open message has an extra key holding a NUL character
    (the JSON escape \\u0000, plain text that PostgreSQL's TEXT holds; another tool's
    write) is quarantined with the NUL escaped in its reason, the valid claim beside it
    resumes, and the drop sets the message aside. The reason quoted the key raw: on
    PostgreSQL the driver refused the quarantine write, failing the whole pass - every
    pass, and every open_runtime on the store - and the drop's set-aside reason alike."""
    raw = Raw(db_path)
    drain = Recorder()
    async with runtime(store, drain, clock, **QUIET) as rt:
        crashed_with_an_open_message(
            raw, clock, r'{"parts": [], "finished": false, "error": null, "\u0000": 1}'
        )
        reason = await quarantined_beside_a_resumed_claim(rt, raw, clock, drain)
        assert "extra fields found (\\x00)" in reason, reason
        await rt.release_quarantine("bad-exec", resume=False)
        assert await rt.transcript("bad") == []
    [(why,)] = raw.rows("SELECT reason FROM session_message_rejected")
    assert "\\x00" in why and "\x00" not in why


async def test_a_hand_back_mark_other_than_1_never_fails_the_pass(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """§6.11: a crashed claim whose `handed_back` another tool set to 2 resumes uncounted,
    as the row-by-row path and PostgreSQL read any mark but 0, and the claim beside it
    resumes. SQLite's set-wise count subtracted the mark itself (0 + 1 - 2): the CHECK
    `wake_attempts >= 0` failed the whole pass - every pass, and every open_runtime on the
    file - outside any row's savepoint."""
    raw = Raw(db_path)
    drain = Recorder()
    async with runtime(store, drain, clock, **QUIET) as rt:
        raw.seed_claim("marked", "marked-exec", expires_at=expired(clock, 10))
        raw.write("UPDATE session_execution SET handed_back = 2")
        raw.seed_claim("good", "good-exec", expires_at=expired(clock))
        report = await rt.recover_once()
        await rt.wait_idle("marked")
        await rt.wait_idle("good")
    assert report == RecoveryReport(examined=2, resumed=2)
    assert sorted(call.session_id for call in drain.calls) == ["good", "marked"]
    assert [call.attempt for call in sorted(drain.calls, key=lambda c: c.session_id)] == [1, 0]


async def test_quarantine_fence_lost_touches_nothing(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """Another recovery owner takes the row before our quarantine write: zero rows, no
    quarantine counted, the successor's recovery lease and the claim untouched
    (invariant 10)."""
    raw = Raw(db_path)
    async with runtime(store, Recorder(), clock, **QUIET) as rt:
        raw.seed_claim("s", "poison", expires_at=expired(clock))
        raw.seed_assistant("s", "poison", 1, MALFORMED)
        successor_lease = now_ms(clock) + 60_000

        async def steal(execution_ids: list[str]) -> None:
            raw.write(
                "UPDATE session_recovery SET owner_id = 'successor', expires_at = ?",
                (successor_lease,),
            )

        testing.set_seams(rt, before_recovery_apply=steal)
        report = await rt.recover_once()
    assert report == RecoveryReport(examined=1, fence_lost=1)
    assert raw.rows("SELECT owner_id, expires_at, recovery_error FROM session_recovery") == [
        ("successor", successor_lease, None)
    ]
    assert raw.claim("s")[0] == "poison"


async def test_resume_budget_exhaustion_finishes_as_failed(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """wake_attempts >= max_resumes: finished as failed, attempts reset, no resume, and
    untaken inputs do not re-arm the doorbell."""
    drain = Recorder()
    raw = Raw(db_path)
    async with runtime(store, drain, clock, max_resumes=3, **QUIET) as rt:
        raw.seed_claim("s", "tired", expires_at=expired(clock), wake_attempts=3)
        message_id = raw.seed_assistant("s", "tired", 1, open_tool_message())
        untaken_input(raw, "left")
        report = await rt.recover_once()
        await rt.wait_idle("s")
    assert report == RecoveryReport(examined=1, exhausted=1)
    assert drain.calls == []
    assert raw.claim("s") is None
    assert raw.one("SELECT wake_attempts, time_woken FROM session WHERE id='s'") == (0, None)
    data = decode_assistant(
        raw.one("SELECT data FROM session_message WHERE id=?", (message_id,))[0], key="m"
    )
    assert data.error == "resume budget exhausted"


async def test_a_message_sent_while_an_exhausted_claim_was_held_is_answered_at_once(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """A claim whose resume budget ran out is finished as failed without re-arming the
    doorbell - but a message the user sent while that claim was held rang it already: it
    is a new wake, taken as soon as the claim is gone. The pass's own commit is no change
    signal here, and the other endings that leave a doorbell set look for it at once; this
    one did not, so the message waited for the fallback poll (2 s on PostgreSQL; never on
    the inline store, which has no background look)."""
    raw = Raw(db_path)
    started = trio.Event()

    async def drain(ctx: DrainContext) -> None:
        started.set()
        await ctx.take_inputs()

    async with runtime(store, drain, clock, max_resumes=3, **QUIET) as rt:
        raw.seed_claim("s", "tired", expires_at=expired(clock), wake_attempts=3)
        await rt.submit("s", {"text": "are you there?"})  # rings: the claim holds it
        report = await rt.recover_once()
        assert report == RecoveryReport(examined=1, exhausted=1)
        ended_at = trio.current_time()
        with trio.fail_after(10 * _loops.CHANGE_FALLBACK_POLL):
            await started.wait()
        waited = trio.current_time() - ended_at
        await rt.wait_idle("s")
    assert waited < _loops.CHANGE_FALLBACK_POLL / 4, f"the drain started {waited:.2f} s late"


async def test_an_exhausted_ending_costs_one_acquisition_not_a_loop(
    store: Store,
    clock: Clock,
    db_path: Path,
    autojump_clock: MockClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The ring after an exhausted ending (`_decisions.rings_after_recovery`) brings one
    acquisition (no doorbell: it claims nothing), never a look or a recovery pass: no pass,
    so no exhausted ending and no ring again. With no fallback poll and no timed pass, a
    minute after the pass the runtime has acquired once, looked never and run no other pass.
    Pinned by review (revE53), which asked whether the kick (now a ring) could loop."""
    monkeypatch.setattr(_loops, "CHANGE_FALLBACK_POLL", 3600.0)
    looks, passes, acquisitions = [0], [0], [0]
    changes, recovery_pass = _store.changes, _loops.BackgroundLoops.recovery_pass
    acquire = _store.acquire

    def counted_changes(tx: Any, *args: Any) -> Any:
        looks[0] += 1
        return changes(tx, *args)

    def counted_acquire(tx: Any, *args: Any) -> Any:
        acquisitions[0] += 1
        return acquire(tx, *args)

    async def counted_pass(self: _loops.BackgroundLoops) -> RecoveryReport:
        passes[0] += 1
        return await recovery_pass(self)

    monkeypatch.setattr(_store, "changes", counted_changes)
    monkeypatch.setattr(_store, "acquire", counted_acquire)
    monkeypatch.setattr(_loops.BackgroundLoops, "recovery_pass", counted_pass)
    raw = Raw(db_path)
    async with runtime(store, Recorder(), clock, max_resumes=3, **QUIET) as rt:
        await rt.wait_idle("s")  # the opening look and pass are done
        raw.seed_claim("s", "tired", expires_at=expired(clock), wake_attempts=3)
        looked, passed, acquired = looks[0], passes[0], acquisitions[0]
        assert await rt.recover_once() == RecoveryReport(examined=1, exhausted=1)
        await trio.sleep(60)  # virtual: what the ring brings, and nothing after it
        assert (looks[0] - looked, passes[0] - passed) == (0, 1)
        assert acquisitions[0] - acquired == 1


@pytest.mark.parametrize("max_active", [None, 1])
@pytest.mark.parametrize("inputs", [[], ["left"]], ids=["no-input", "an-input"])
async def test_a_cancelled_ending_rings_its_session_once_with_or_without_room(
    store: Store,
    clock: Clock,
    db_path: Path,
    autojump_clock: MockClock,
    monkeypatch: pytest.MonkeyPatch,
    max_active: int | None,
    inputs: list[str],
) -> None:
    """The ring after an ending that may leave a doorbell (a dead owner's cancelling claim)
    is one acquisition, whether the doorbell is set (an untaken input: its successor takes
    it) or not (it claims nothing), with `max_active` too - where the acquisition's end
    frees a place and kicks the change scan: that look rings nothing again, so no loop
    and no second acquisition. Asked by review (revA54) of the ring that replaced a kick."""
    monkeypatch.setattr(_loops, "CHANGE_FALLBACK_POLL", 3600.0)
    acquisitions = [0]
    acquire = _store.acquire

    def counted_acquire(tx: Any, *args: Any) -> Any:
        acquisitions[0] += 1
        return acquire(tx, *args)

    monkeypatch.setattr(_store, "acquire", counted_acquire)
    raw = Raw(db_path)
    drain = Recorder()
    async with runtime(store, drain, clock, max_active=max_active, **QUIET) as rt:
        await rt.wait_idle("s")  # the opening look and pass are done
        raw.seed_claim("s", "dead-exec", expires_at=expired(clock), phase="cancelling")
        for input_id in inputs:
            untaken_input(raw, input_id)
        acquired = acquisitions[0]
        report = await rt.recover_once()
        await rt.wait_idle("s")
        await trio.sleep(60)  # virtual: what the ring brings, and nothing after it
        assert report == RecoveryReport(examined=1, finished_cancelled=1)
        assert acquisitions[0] - acquired == 1
        assert drain.taken == inputs
        assert raw.claim("s") is None


async def test_resumes_count_toward_the_budget(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """Each takeover adds one to wake_attempts; a normal finish resets it."""
    raw = Raw(db_path)
    seen: list[int] = []
    stop = trio.Event()

    async def drain(ctx: DrainContext) -> None:
        seen.append(ctx.attempt)
        await stop.wait()

    async with runtime(store, drain, clock, **QUIET) as rt:
        raw.seed_claim("s", "dead", expires_at=expired(clock), wake_attempts=1)
        await rt.recover_once()
        await trio.testing.wait_all_tasks_blocked()
        assert raw.one("SELECT wake_attempts FROM session WHERE id='s'") == (2,)
        stop.set()
        await rt.wait_idle("s")
    assert seen == [2]
    assert raw.one("SELECT wake_attempts FROM session WHERE id='s'") == (0,)


async def test_unclaimed_doorbell_is_acquired(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """A doorbell set with no claim (a crash between wake and acquire) starts a drain."""
    drain = Recorder()
    raw = Raw(db_path)
    async with runtime(store, drain, clock, **QUIET) as rt:
        raw.write("INSERT INTO session(id, time_created, time_woken, wakes) VALUES ('s', 0, 5, 1)")
        raw.write(
            "INSERT INTO session_input(id, session_id, seq, payload, time_created)"
            " VALUES ('in', 's', 1, '{\"a\": 1}', 0)"
        )
        report = await rt.recover_once()
        await rt.wait_idle("s")
    assert report == RecoveryReport(examined=1, doorbells_started=1)
    assert drain.taken == ["in"] and drain.calls[0].resumed is False


async def test_a_pass_fires_due_inputs_also_with_no_room_to_scan(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """A scheduled input that fell due unseen (written by another process, no signal) is
    promoted by the next pass - its due look travels with the scan, and still happens
    when max_active leaves no room for a scan."""
    busy, gate = trio.Event(), trio.Event()
    started: list[str] = []

    async def drain(ctx: DrainContext) -> None:
        started.append(ctx.session_id)
        if ctx.session_id == "busy":
            busy.set()
            await gate.wait()
        await ctx.take_inputs()

    raw = Raw(db_path)
    async with runtime(store, drain, clock, max_active=1, **QUIET) as rt:
        await rt.submit("busy", {"n": 1})
        await busy.wait()
        raw.write("INSERT INTO session(id, time_created) VALUES ('s', 0)")
        raw.write(
            "INSERT INTO session_input(id, session_id, seq, payload, time_created, due_at)"
            " VALUES ('in', 's', 1, '{\"a\": 1}', 0, 1)"
        )
        report = await rt.recover_once()
        assert report.examined == 0  # no room: no scan
        assert raw.rows("SELECT due_at FROM session_input WHERE id = 'in'") == [(None,)]
        assert raw.rows("SELECT time_woken IS NOT NULL FROM session WHERE id = 's'") == [(1,)]
        gate.set()
        await rt.wait_idle("busy")
        await rt.recover_once()  # room now: the pass finds the doorbell the due look rang
        await rt.wait_idle("s")
    assert started == ["busy", "s"]


async def test_exclusions_never_use_the_budget(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """Quarantined rows, rows under another owner's live recovery lease and sessions held
    locally are excluded in SQL: with a budget of one, the valid row behind them is
    examined."""
    raw = Raw(db_path)
    drain = Recorder()
    local_gate = trio.Event()

    async def gated(ctx: DrainContext) -> None:
        if ctx.session_id == "local":
            await local_gate.wait()
        else:
            await drain(ctx)

    async with runtime(store, gated, clock, recovery_batch=1, **QUIET) as rt:
        oldest = expired(clock, 10_000)
        raw.seed_claim("quarantined", "q-exec", expires_at=oldest)
        raw.write(
            "INSERT INTO session_recovery(execution_id, session_id, owner_id, expires_at,"
            " recovery_error, time_created, time_quarantined)"
            " VALUES ('q-exec', 'quarantined', 'x', 0, 'bad', 0, 0)"
        )
        raw.seed_claim("leased", "l-exec", expires_at=oldest + 1)
        raw.write(
            "INSERT INTO session_recovery(execution_id, session_id, owner_id, expires_at,"
            " time_created) VALUES ('l-exec', 'leased', 'other-recoverer', ?, 0)",
            (now_ms(clock) + 60_000,),
        )
        await rt.wake("local")
        await trio.testing.wait_all_tasks_blocked()
        raw.write(
            "UPDATE session_execution SET expires_at = ? WHERE session_id = 'local'", (oldest + 2,)
        )
        raw.seed_claim("valid", "v-exec", expires_at=oldest + 3)
        report = await rt.recover_once()
        await rt.wait_idle("valid")
        local_gate.set()
    assert report == RecoveryReport(examined=1, resumed=1)
    assert [c.session_id for c in drain.calls] == ["valid"]


async def test_poison_rows_do_not_starve_valid_work(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """300 older malformed projections are quarantined across three passes of 100; after
    one scan interval the valid claim 301 progresses on the fourth pass (invariant 11)."""
    raw = Raw(db_path)
    drain = Recorder()
    async with runtime(store, drain, clock, **QUIET) as rt:
        base = expired(clock, 100_000)
        poison = range(300)
        raw.write_many(
            "INSERT INTO session(id, time_created) VALUES (?, 0)", [(f"p{i}",) for i in poison]
        )
        raw.write_many(
            "INSERT INTO session_execution(id, session_id, owner_id, phase,"
            " time_created, expires_at) VALUES (?, ?, 'dead', 'running', 0, ?)",
            [(f"pe{i}", f"p{i}", base + i) for i in poison],
        )
        raw.write_many(
            "INSERT INTO session_message(id, session_id, execution_id, role, seq,"
            " data, time_created, time_updated) VALUES (?, ?, ?, 'assistant', 1, ?, 0, 0)",
            [(f"pm{i}", f"p{i}", f"pe{i}", MALFORMED) for i in poison],
        )
        raw.seed_claim("valid", "v-exec", expires_at=base + 300)
        reports = []
        for _ in range(4):
            reports.append(await rt.recover_once())
            await trio.sleep(5.0)
        await rt.wait_idle("valid")
    assert [r.quarantined for r in reports] == [100, 100, 100, 0]
    assert reports[3] == RecoveryReport(examined=1, resumed=1)
    assert [c.session_id for c in drain.calls] == ["valid"]


async def test_two_runtimes_recover_each_claim_exactly_once(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """Two runtimes recovering the same 30 expired claims at once resume each exactly once."""
    raw = Raw(db_path)
    resumed: list[str] = []

    async def drain(ctx: DrainContext) -> None:
        if ctx.resumed:
            resumed.append(ctx.session_id)
        await trio.sleep(1)

    async with (
        runtime(store, drain, clock, **QUIET) as a,
        runtime(store, drain, clock, **QUIET) as b,
    ):
        for index in range(30):
            raw.seed_claim(f"s{index}", f"e{index}", expires_at=expired(clock, 1000 - index))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(a.recover_once)
            nursery.start_soon(b.recover_once)
            nursery.start_soon(a.recover_once)
            nursery.start_soon(b.recover_once)
        for index in range(30):
            await a.wait_idle(f"s{index}")
            await b.wait_idle(f"s{index}")
    assert sorted(resumed) == sorted(f"s{index}" for index in range(30))


async def test_release_quarantine_drop(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """resume=False finishes the transcript as owner-lost where it can, deletes the claim,
    resets attempts and re-arms the doorbell for remaining inputs - and starts that drain
    here, as `resume` does: its own commit is no change signal for this runtime (on either
    backend), so no recovery pass is needed."""
    raw = Raw(db_path)
    drain = Recorder()
    async with runtime(store, drain, clock, **QUIET) as rt:
        raw.seed_claim("s", "poison", expires_at=expired(clock), wake_attempts=2)
        raw.seed_assistant("s", "poison", 1, MALFORMED)
        untaken_input(raw, "left")
        await rt.recover_once()
        with pytest.raises(ValueError, match="not quarantined"):
            await rt.release_quarantine("no-such-execution", resume=False)
        await rt.release_quarantine("poison", resume=False)
        assert raw.claim("s") is None
        assert raw.rows("SELECT * FROM session_recovery") == []
        assert raw.one("SELECT wake_attempts, time_woken IS NOT NULL FROM session") == (0, 1)
        await rt.wait_idle("s")
        assert drain.taken == ["left"]
        report = await rt.recover_once()
    assert report.doorbells_started == 0


async def quarantined_then_repaired(raw: Raw, rt: Any, clock: Clock) -> None:
    """Session 's': an expired claim 'poison' whose message does not decode, quarantined by
    `rt`'s recovery pass, then repaired by hand (the documented way out)."""
    raw.seed_claim("s", "poison", expires_at=expired(clock))
    message_id = raw.seed_assistant("s", "poison", 1, MALFORMED)
    await rt.recover_once()
    raw.write(
        "UPDATE session_message SET data = ? WHERE id = ?",
        ('{"parts": [], "finished": false, "error": null}', message_id),
    )


async def test_release_quarantine_resume_after_repair(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """resume=True on a repaired row recovers it at once, counting toward the budget."""
    raw = Raw(db_path)
    drain = Recorder()
    async with runtime(store, drain, clock, **QUIET) as rt:
        await quarantined_then_repaired(raw, rt, clock)
        await rt.release_quarantine("poison", resume=True)
        await rt.wait_idle("s")
    assert len(drain.calls) == 1 and drain.calls[0].resumed and drain.calls[0].attempt == 1


async def test_release_quarantine_resume_still_malformed(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """resume=True on a row that is still malformed quarantines it again and raises the
    message's `MalformedRecord`, as a read of it does: its table, its key, its reasons."""
    raw = Raw(db_path)
    drain = Recorder()
    async with runtime(store, drain, clock, **QUIET) as rt:
        raw.seed_claim("s", "poison", expires_at=expired(clock))
        message_id = raw.seed_assistant("s", "poison", 1, MALFORMED)
        await rt.recover_once()
        with pytest.raises(MalformedRecord) as read:
            await rt.transcript("s")
        with pytest.raises(MalformedRecord) as caught:
            await rt.release_quarantine("poison", resume=True)
        assert "expected bool" in str(caught.value)
        assert not isinstance(caught.value, BaseExceptionGroup)
        error = caught.value
        assert (error.table, error.key) == ("session_message", message_id)
        assert (error.reasons, str(error)) == (read.value.reasons, str(read.value))
    assert drain.calls == []
    assert raw.one("SELECT recovery_error IS NOT NULL FROM session_recovery") == (1,)


async def test_release_quarantine_resume_from_a_producer_leaves_the_drain_to_a_worker(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """resume=True called on a producer (drain=None: it never claims or recovers, DESIGN
    §5) lifts the quarantine for a worker to resume - it must not take the claim over
    itself and then fail it for want of a drain ('failed: AssertionError' in the
    transcript, the claim released, the work never resumed)."""
    raw = Raw(db_path)
    drain = Recorder()
    async with (
        runtime(store, drain, clock, **QUIET) as worker,
        runtime(store, None, clock) as producer,
    ):
        await quarantined_then_repaired(raw, worker, clock)
        await producer.release_quarantine("poison", resume=True)
        await worker.recover_once()  # at once: the release kept no recovery lease
        await worker.wait_idle("s")
        errors = [m.data.error for m in await worker.transcript("s") if m.role == "assistant"]
    assert "failed: AssertionError" not in errors
    assert len(drain.calls) == 1 and drain.calls[0].resumed


class OnePlaceTaken:
    """The drain of a runtime with `max_active=1`: session 'busy' holds the one place until
    `let_go`; any other session's drain records when it started (`resumed`)."""

    def __init__(self) -> None:
        self.let_go = trio.Event()
        self.resumed: list[float] = []

    async def __call__(self, ctx: DrainContext) -> None:
        if ctx.session_id == "busy":
            await self.let_go.wait()
        else:
            self.resumed.append(trio.current_time())

    async def seconds_to_resume_elsewhere(
        self, store: Store, clock: Clock, act: Callable[[], Awaitable[object]]
    ) -> float:
        """Open a worker with room (a recovery pass every second), `act`, and wait (60 s at
        most) for the first resume: the seconds from `act` to it (inf: none)."""
        async with runtime(store, self, clock, recovery_interval=1.0):
            acted_at = trio.current_time()
            await act()
            with trio.move_on_after(60):
                while not self.resumed:
                    await trio.sleep(0.1)
            self.let_go.set()
        return self.resumed[0] - acted_at if self.resumed else math.inf


async def test_release_quarantine_resume_without_room_leaves_no_unused_recovery_lease(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """resume=True on a runtime whose max_active is used up: the release returns without
    a takeover here and without MalformedRecord, yet keeps the recovery lease it took to
    lift the quarantine - so a worker with room cannot resume the claim for a whole lease
    (30 s) although nothing runs it (DESIGN §4: resume=True recovers it at once; a lease
    this runtime will not act on must not keep the row from the others)."""
    raw = Raw(db_path)
    drain = OnePlaceTaken()
    async with runtime(store, drain, clock, max_active=1, **QUIET) as full:
        await quarantined_then_repaired(raw, full, clock)
        await full.submit("busy", {})  # takes the one place
        await trio.testing.wait_all_tasks_blocked()
        released = functools.partial(full.release_quarantine, "poison", resume=True)
        assert await drain.seconds_to_resume_elsewhere(store, clock, released) < 5


async def test_a_leased_claim_dropped_for_want_of_room_is_not_kept_from_other_workers(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """A pass leases an expired claim with room for it, but a submit takes the last place
    (max_active) before the takeover is applied: the pass drops the claim and keeps its
    recovery lease, so a worker with room cannot resume it for a whole lease (30 s)
    although nobody runs it (the scan takes leases only on what there is room for, since
    a lease not acted on keeps the row from every other runtime)."""
    raw = Raw(db_path)
    drain = OnePlaceTaken()

    async def take_the_last_place(execution_ids: list[str]) -> None:
        await full.submit("busy", {})

    async with runtime(store, drain, clock, max_active=1, **QUIET) as full:
        raw.seed_claim("s", "dead-exec", expires_at=expired(clock))
        testing.set_seams(full, before_recovery_apply=take_the_last_place)
        assert (await full.recover_once()).resumed == 0
        testing.set_seams(full)
        assert await drain.seconds_to_resume_elsewhere(store, clock, trio.lowlevel.checkpoint) < 5


async def test_shutdown_claim_is_resumed_by_next_owner(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """A claim kept at shutdown (lease expired at once) is resumed by the next runtime's
    first pass, and the resume of a handed-back claim does not count toward wake_attempts."""
    first = Recorder()
    first.hold()
    async with runtime(store, first, clock, **QUIET) as rt:
        await rt.wake("s")
        await first.entered.wait()
    second = Recorder()
    async with runtime(store, second, clock, **QUIET) as rt:
        await rt.wait_idle("s")
    assert len(second.calls) == 1 and second.calls[0].resumed and second.calls[0].attempt == 0


async def test_recovery_takes_plain_claims_over_set_wise(
    tmp_path: Path, clock: Clock, autojump_clock: MockClock
) -> None:
    """Expired claims whose execution wrote no assistant message are taken over with about
    one statement each (the fenced replace), not a savepoint and a dozen reads per claim;
    a claim with a transcript to close still goes row by row, and both end the same way."""
    statements: list[str] = []

    class Counting:
        def __init__(self, conn: sqlite3.Connection) -> None:
            self._conn = conn

        def execute(self, sql: str, params: Any = ()) -> sqlite3.Cursor:
            statements.append(sql)
            return self._conn.execute(sql, params)

        def executemany(self, sql: str, rows: Any) -> sqlite3.Cursor:
            rows = list(rows)
            statements.extend([sql] * len(rows))  # one run of the statement per row
            return self._conn.executemany(sql, rows)

        def __getattr__(self, name: str) -> Any:
            return getattr(self._conn, name)

    path = tmp_path / "db"
    raw = Raw(path)
    plain = [f"s{i}" for i in range(60)]
    resumed: list[DrainContext] = []
    all_entered, gate = trio.Event(), trio.Event()

    async def drain(ctx: DrainContext) -> None:
        resumed.append(ctx)
        if len(resumed) == len(plain) + 1:
            all_entered.set()
        await gate.wait()

    store = Store(path, inline=True, wrap_connection=Counting)
    async with runtime(store, drain, clock, **QUIET) as rt:
        for session_id in plain:
            raw.seed_claim(session_id, f"dead-{session_id}", expires_at=expired(clock))
        raw.seed_claim("t", "dead-t", expires_at=expired(clock))
        message_id = raw.seed_assistant("t", "dead-t", 1, open_tool_message())
        statements.clear()
        report = await rt.recover_once()
        counted = len(statements)
        assert report == RecoveryReport(examined=61, resumed=61)
        await all_entered.wait()
        assert {ctx.session_id for ctx in resumed} == {*plain, "t"}
        assert all(ctx.resumed and ctx.attempt == 1 for ctx in resumed)
        for session_id in plain:
            assert raw.claim(session_id)[1] == rt.owner_id
            assert raw.one("SELECT wake_attempts FROM session WHERE id=?", (session_id,)) == (1,)
        assert raw.rows("SELECT * FROM session_recovery") == []
        old = decode_assistant(
            raw.one("SELECT data FROM session_message WHERE id=?", (message_id,))[0], key="m"
        )
        assert old.finished is True and old.error == "interrupted: owner lost"
        gate.set()
    # Scan, leases and apply: 3 transactions; 60 takeovers; the transcript row by row.
    assert counted <= len(plain) + 30, counted
