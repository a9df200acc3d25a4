"""The pure claim, lease and recovery decisions, and the store's SQL fences that implement them.

The first half checks each decision in `_decisions` over generated (row, now, owner) values;
the second half writes the same generated rows into a real store (an SQLite file and a
PostgreSQL schema, through the sync `engine` fixture), runs the store's fenced operation at
the same fixed instant and checks that SQL and the pure predicate agree.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from backends import EngineDb, finish_iteration
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from trio_sessions import LeaseLost, _backend, _codec, _sqlite, _store, _transcript
from trio_sessions._backend import Tx
from trio_sessions._decisions import (
    ON_BUSY,
    AcquireVerdict,
    ClaimRow,
    IterationVerdict,
    RecoveryDecision,
    RecoveryFacts,
    RecoveryLeaseRow,
    SubmitVerdict,
    acquire_verdict,
    decide_recovery,
    holds_live_claim,
    iteration_verdict,
    lease_is_live,
    may_take_recovery_lease,
    owes_a_drain,
    rearms_doorbell,
    renewed_expiry,
    rings_after_recovery,
    submit_verdict,
)
from trio_sessions._store.recovery_scan import scan_and_lease

SETTINGS = settings(max_examples=200, deadline=None)
DB_SETTINGS = settings(
    max_examples=75, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)

OWNERS = ("owner-a", "owner-b")
EXECUTIONS = ("exec-1", "exec-2")
PHASES = ("running", "cancelling")
LEASE_MS = 30_000

# Instants are whole seconds expressed in ms plus a small offset in ms, kept where a float
# clock in seconds converts back to the same integer millisecond (see `fixed_clock`).
nows = st.integers(min_value=1_000_000, max_value=4_000_000_000).map(lambda s: s * 1000)
offsets = st.integers(min_value=-3, max_value=3) | st.integers(
    min_value=-100_000, max_value=100_000
)
owners = st.sampled_from(OWNERS)
executions = st.sampled_from(EXECUTIONS)
phases = st.sampled_from(PHASES)


def claim_rows(now: int) -> st.SearchStrategy[ClaimRow | None]:
    return st.none() | st.builds(
        ClaimRow,
        execution_id=executions,
        owner_id=owners,
        phase=phases,
        expires_at=offsets.map(lambda d: now + d),
    )


@st.composite
def fence_cases(draw: st.DrawFn) -> tuple[int, ClaimRow | None, str, str]:
    """(now, claim row or None, execution id asking, owner asking)."""
    now = draw(nows)
    return now, draw(claim_rows(now)), draw(executions), draw(owners)


def fixed_clock(now: int) -> Callable[[], float]:
    """A clock in seconds that the store turns back into exactly `now` milliseconds."""
    clock = lambda: now / 1000  # noqa: E731
    assert _backend.now_ms(clock) == now
    return clock


# ---------------------------------------------------------------------------------------------
# Pure decisions


@SETTINGS
@given(expires_at=st.integers(), now=st.integers())
@example(expires_at=10, now=10)
@example(expires_at=11, now=10)
@example(expires_at=9, now=10)
def test_lease_is_live_strictly_before_expiry(expires_at: int, now: int) -> None:
    """A lease is live exactly when its expiry instant is still in the future (not at it)."""
    assert lease_is_live(expires_at, now) is (expires_at > now)


def test_lease_boundary_instant_is_expired() -> None:
    """At the expiry instant itself the lease is already dead; one ms earlier it is live."""
    assert not lease_is_live(1_000, 1_000)
    assert lease_is_live(1_000, 999)


@SETTINGS
@given(fence_cases())
def test_holds_live_claim_needs_exact_execution_owner_and_live_lease(
    case: tuple[int, ClaimRow | None, str, str],
) -> None:
    """The claim fence passes only for the exact execution and owner of a live row."""
    now, row, execution_id, owner_id = case
    held = holds_live_claim(row, execution_id, owner_id, now)
    if row is None:
        assert not held
        return
    assert held is (
        row.execution_id == execution_id and row.owner_id == owner_id and row.expires_at > now
    )


@SETTINGS
@given(fence_cases())
def test_holds_live_claim_ignores_phase(case: tuple[int, ClaimRow | None, str, str]) -> None:
    """A cancelling claim is still held by its owner until the lease ends (cleanup is fenced)."""
    now, row, execution_id, owner_id = case
    if row is None:
        return
    for phase in PHASES:
        other = ClaimRow(row.execution_id, row.owner_id, phase, row.expires_at)
        assert holds_live_claim(other, execution_id, owner_id, now) is holds_live_claim(
            row, execution_id, owner_id, now
        )


@SETTINGS
@given(fence_cases(), st.integers(min_value=1, max_value=10**7))
def test_renewed_expiry_never_revives(
    case: tuple[int, ClaimRow | None, str, str], lease_ms: int
) -> None:
    """A heartbeat renews only a held live lease; an expired or foreign one gets None."""
    now, row, execution_id, owner_id = case
    renewed = renewed_expiry(row, execution_id, owner_id, now, lease_ms)
    if row is None or row.expires_at <= now:
        assert renewed is None
    if holds_live_claim(row, execution_id, owner_id, now):
        assert renewed == now + lease_ms
        assert renewed > now
    else:
        assert renewed is None


@SETTINGS
@given(doorbell_set=st.booleans(), paused=st.booleans(), case=fence_cases())
def test_acquire_verdict_never_overwrites(
    doorbell_set: bool, paused: bool, case: tuple[int, ClaimRow | None, str, str]
) -> None:
    """Any claim row (live or expired, own or foreign) means HELD; a paused session is never
    claimed; else the doorbell decides."""
    _, row, _, _ = case
    verdict = acquire_verdict(doorbell_set=doorbell_set, claim_row=row, paused=paused)
    if row is not None:
        assert verdict is AcquireVerdict.HELD
    elif paused:
        assert verdict is AcquireVerdict.PAUSED
    elif doorbell_set:
        assert verdict is AcquireVerdict.CLAIM
    else:
        assert verdict is AcquireVerdict.NO_DOORBELL


def recovery_lease_rows(now: int) -> st.SearchStrategy[RecoveryLeaseRow | None]:
    return st.none() | st.builds(
        RecoveryLeaseRow,
        owner_id=owners,
        expires_at=offsets.map(lambda d: now + d),
        quarantined=st.booleans(),
    )


@st.composite
def recovery_lease_cases(draw: st.DrawFn) -> tuple[int, RecoveryLeaseRow | None, str]:
    now = draw(nows)
    return now, draw(recovery_lease_rows(now)), draw(owners)


@SETTINGS
@given(recovery_lease_cases())
def test_may_take_recovery_lease(case: tuple[int, RecoveryLeaseRow | None, str]) -> None:
    """Absent, own or expired recovery leases may be taken; quarantined or foreign live never."""
    now, row, owner_id = case
    allowed = may_take_recovery_lease(row, owner_id, now)
    if row is None:
        assert allowed
    elif row.quarantined or (row.owner_id != owner_id and row.expires_at > now):
        assert not allowed
    else:
        assert allowed


@st.composite
def recovery_cases(draw: st.DrawFn) -> tuple[RecoveryFacts, str, int, int]:
    now = draw(nows)
    facts = RecoveryFacts(
        claim=draw(claim_rows(now)),
        superseded=draw(st.booleans()),
        newest_assistant_malformed=draw(st.booleans()),
        wake_attempts=draw(st.integers(min_value=0, max_value=6)),
        paused=draw(st.booleans()),
    )
    return facts, draw(executions), now, draw(st.integers(min_value=0, max_value=6))


def expected_recovery(
    facts: RecoveryFacts, execution_id: str, now: int, max_resumes: int
) -> RecoveryDecision:
    """The contract's order, written as a table: the first rule that applies wins."""
    claim = facts.claim
    if claim is None or claim.execution_id != execution_id:
        return RecoveryDecision.GONE
    rules = [
        (claim.expires_at > now, RecoveryDecision.SKIP_LIVE),
        (claim.phase == "cancelling", RecoveryDecision.FINISH_CANCELLED),
        (facts.superseded, RecoveryDecision.DROP_SUPERSEDED),
        (facts.newest_assistant_malformed, RecoveryDecision.QUARANTINE),
        (facts.paused, RecoveryDecision.FINISH_PAUSED),
        (facts.wake_attempts >= max_resumes, RecoveryDecision.EXHAUSTED),
    ]
    return next((decision for applies, decision in rules if applies), RecoveryDecision.RESUME)


@SETTINGS
@given(recovery_cases())
def test_decide_recovery_order(case: tuple[RecoveryFacts, str, int, int]) -> None:
    """live > cancelling > superseded > malformed > paused > exhausted > resume, first match
    wins."""
    facts, execution_id, now, max_resumes = case
    assert decide_recovery(facts, execution_id, now, max_resumes) is expected_recovery(
        facts, execution_id, now, max_resumes
    )


@SETTINGS
@given(recovery_cases())
def test_decide_recovery_never_resumes_live_cancelling_or_superseded(
    case: tuple[RecoveryFacts, str, int, int],
) -> None:
    """Invariant 5: a live lease, a cancellation claim or a superseded execution never resumes."""
    facts, execution_id, now, max_resumes = case
    decision = decide_recovery(facts, execution_id, now, max_resumes)
    claim = facts.claim
    if decision is RecoveryDecision.RESUME:
        assert claim is not None
        assert claim.execution_id == execution_id
        assert claim.expires_at <= now
        assert claim.phase == "running"
        assert not facts.superseded
        assert not facts.newest_assistant_malformed
        assert not facts.paused
        assert facts.wake_attempts < max_resumes
    if claim is not None and claim.execution_id == execution_id and claim.expires_at > now:
        assert decision is RecoveryDecision.SKIP_LIVE


def test_decide_recovery_cancelling_beats_every_later_rule() -> None:
    """An expired cancellation claim is finished as cancelled even if superseded, malformed
    and out of budget."""
    facts = RecoveryFacts(
        claim=ClaimRow("e", "o", "cancelling", 5),
        superseded=True,
        newest_assistant_malformed=True,
        wake_attempts=99,
    )
    assert decide_recovery(facts, "e", 10, 1) is RecoveryDecision.FINISH_CANCELLED


def test_rearms_doorbell_only_for_cancelled_superseded_and_paused() -> None:
    """Cancelled, superseded and paused endings re-arm for untaken inputs (a paused one for
    `resume`); a failed (exhausted) or any other ending does not."""
    rearming = {d for d in RecoveryDecision if rearms_doorbell(d)}
    assert rearming == {
        RecoveryDecision.FINISH_CANCELLED,
        RecoveryDecision.DROP_SUPERSEDED,
        RecoveryDecision.FINISH_PAUSED,
    }


def test_endings_rung_after_recovery_are_the_rearming_ones_and_exhausted_but_paused() -> None:
    """The endings the recovering runtime rings at once: those that re-arm, and an
    exhausted one (a message rung while its claim was held), but a paused session's (its
    doorbell waits for `resume`); a resume keeps the claim, and the others end nothing of
    the session's."""
    rung = {d for d in RecoveryDecision if rings_after_recovery(d)}
    assert rung == {
        RecoveryDecision.FINISH_CANCELLED,
        RecoveryDecision.DROP_SUPERSEDED,
        RecoveryDecision.EXHAUSTED,
    }


def test_only_a_paused_sessions_claim_cut_short_rings_with_nothing_pending() -> None:
    """The one ending owed a drain whatever is pending: a paused session's (the drain
    `resume` then starts answers what the claim was cut short answering)."""
    owing = {d for d in RecoveryDecision if owes_a_drain(d)}
    assert owing == {RecoveryDecision.FINISH_PAUSED}


# ---------------------------------------------------------------------------------------------
# The store's SQL fences agree with the pure predicates


# Rows a streamed append writes (beside the tables every store has had).
STREAMING_TABLES = frozenset(
    {"session_message_stream", "session_message_delta", "session_message_change"}
)


def _empty(tx: Tx) -> None:
    """Every row gone, in one transaction."""
    for table in (
        "session_message",
        "session_input",
        "session_execution",
        "session_recovery",
        "session",
    ):
        tx.execute(f"DELETE FROM {table}")


class Db:
    """The sync engine (`engine` fixture, both backends) reused across hypothesis examples;
    `reset` empties it, `run` runs an operation at the example's instant."""

    def __init__(self, engine: EngineDb) -> None:
        self.engine = engine

    def run(self, now: int, op: Callable[..., Any], *args: Any) -> Any:
        self.engine.now = now
        return self.engine.run(op, *args)

    def reset(self) -> None:
        self.engine.engine.run(_empty)

    def rows(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        return self.engine.rows(sql, params)

    def write(self, sql: str, params: tuple[Any, ...] = ()) -> None:
        self.engine.write(sql, params)

    def snapshot(self) -> dict[str, list[tuple[Any, ...]]]:
        return self.engine.snapshot(_sqlite.OUR_TABLES | STREAMING_TABLES)

    def put_session(self, *, doorbell: bool, wake_attempts: int = 0) -> None:
        self.write(
            "INSERT INTO session(id, time_created, time_woken, wakes, wake_attempts)"
            " VALUES ('s', 0, ?, ?, ?)",
            (1 if doorbell else None, 1 if doorbell else 0, wake_attempts),
        )

    def put_claim(self, row: ClaimRow, anchor_seq: int | None = None) -> None:
        self.write(
            "INSERT INTO session_execution(id, session_id, owner_id, phase, anchor_seq,"
            " time_created, heartbeat_at, expires_at) VALUES (?, 's', ?, ?, ?, 0, NULL, ?)",
            (row.execution_id, row.owner_id, row.phase, anchor_seq, row.expires_at),
        )

    def claim(self) -> ClaimRow | None:
        found = self.rows(
            "SELECT id, owner_id, phase, expires_at FROM session_execution WHERE session_id = 's'"
        )
        return None if not found else ClaimRow(*found[0])


@pytest.fixture
def db(engine: EngineDb) -> Db:
    """The SQL half's store: SQLite file or PostgreSQL schema, through the sync engine."""
    return Db(engine)


@DB_SETTINGS
@given(case=fence_cases())
def test_heartbeat_sql_agrees_with_renewed_expiry(
    db: Db, case: tuple[int, ClaimRow | None, str, str]
) -> None:
    """`_store.heartbeat` renews exactly when `renewed_expiry` does, to the same instant, and
    leaves every other row untouched."""
    db.reset()
    now, row, execution_id, owner_id = case
    db.put_session(doorbell=False)
    if row is not None:
        db.put_claim(row)
    phases = db.run(now, _store.heartbeat, owner_id, [execution_id], LEASE_MS)
    expected = renewed_expiry(row, execution_id, owner_id, now, LEASE_MS)
    after = db.rows("SELECT expires_at, heartbeat_at FROM session_execution")
    if expected is None:
        assert phases == {execution_id: None}
        assert after == ([] if row is None else [(row.expires_at, None)])
    else:
        assert row is not None
        assert phases == {execution_id: row.phase}
        assert after == [(expected, now)]


@DB_SETTINGS
@given(case=fence_cases(), doorbell_set=st.booleans(), session_exists=st.booleans())
def test_acquire_sql_agrees_with_acquire_verdict(
    db: Db, case: tuple[int, ClaimRow | None, str, str], doorbell_set: bool, session_exists: bool
) -> None:
    """`_store.acquire` inserts a claim exactly when `acquire_verdict` says CLAIM, and never
    touches an existing claim row."""
    db.reset()
    now, row, _, owner_id = case
    if row is not None or session_exists or doorbell_set:
        db.put_session(doorbell=doorbell_set)
    if row is not None:
        db.put_claim(row)
    before = db.snapshot()
    acquired = db.run(now, _store.acquire, "s", "exec-new", owner_id, LEASE_MS)
    expected = acquire_verdict(doorbell_set=doorbell_set, claim_row=row)
    assert acquired.verdict is expected
    if expected is AcquireVerdict.CLAIM:
        assert db.claim() == ClaimRow("exec-new", owner_id, "running", now + LEASE_MS)
        assert db.rows("SELECT time_woken, wakes FROM session") == [(None, 0)]
    else:
        assert db.snapshot() == before


def _put_pending_input(db: Db) -> None:
    db.write(
        "INSERT INTO session_input(id, session_id, seq, payload, time_created)"
        " VALUES ('in-1', 's', 1, '{\"n\": 1}', 0)"
    )


FENCED_OPS: dict[str, Callable[[Db, int, str, str], Any]] = {
    "append_assistant_text": lambda db, now, e, o: db.run(
        now, _store.append_assistant_text, "s", e, o, "m-1", "x"
    ),
    "mark_cancelling": lambda db, now, e, o: db.run(now, _store.mark_cancelling, "s", e, o),
    "take_inputs": lambda db, now, e, o: db.run(now, _store.take_inputs, "s", e, o),
    "finish_iteration": lambda db, now, e, o: db.run(now, finish_iteration, "s", e, o),
    "finish_interrupted": lambda db, now, e, o: db.run(now, _store.finish_interrupted, "s", e, o),
    "finish_failed": lambda db, now, e, o: db.run(
        now, _store.finish_failed, "s", e, o, "failed: x"
    ),
    "begin_assistant": lambda db, now, e, o: db.run(
        now, _store.begin_assistant, "s", e, o, "m-new"
    ),
    "update_assistant": lambda db, now, e, o: db.run(
        now, _store.update_assistant, "s", e, o, "m-1", lambda d: _transcript.append_text(d, "x")
    ),
}


@pytest.mark.parametrize("op_name", sorted(FENCED_OPS))
@DB_SETTINGS
@given(case=fence_cases())
def test_fenced_writes_agree_with_holds_live_claim(
    db: Db, op_name: str, case: tuple[int, ClaimRow | None, str, str]
) -> None:
    """Each fenced drain write succeeds exactly when `holds_live_claim` holds; otherwise it
    raises LeaseLost and the database is unchanged."""
    db.reset()
    now, row, execution_id, owner_id = case
    db.put_session(doorbell=True)
    _put_pending_input(db)
    if row is not None:
        db.put_claim(row)
        db.write(
            "INSERT INTO session_message(id, session_id, execution_id, role, seq, data,"
            " time_created, time_updated) VALUES ('m-1', 's', ?, 'assistant', 1, ?, 0, 0)",
            (row.execution_id, _codec.encode_assistant(_transcript.EMPTY)),
        )
        # Open for streaming, as begin_assistant leaves it.
        db.write(
            "INSERT INTO session_message_stream(message_id, execution_id, version)"
            " VALUES ('m-1', ?, 0)",
            (row.execution_id,),
        )
    before = db.snapshot()
    held = holds_live_claim(row, execution_id, owner_id, now)
    if held:
        FENCED_OPS[op_name](db, now, execution_id, owner_id)
    else:
        with pytest.raises(LeaseLost):
            FENCED_OPS[op_name](db, now, execution_id, owner_id)
        assert db.snapshot() == before


@DB_SETTINGS
@given(case=fence_cases())
def test_expire_claims_sql_agrees_with_holds_live_claim(
    db: Db, case: tuple[int, ClaimRow | None, str, str]
) -> None:
    """Shutdown's expiry counts and ends only a held live lease, keeping the phase."""
    db.reset()
    now, row, execution_id, owner_id = case
    db.put_session(doorbell=False)
    if row is not None:
        db.put_claim(row)
    before = db.snapshot()
    count = db.run(now, _store.expire_claims, owner_id, [execution_id])
    if holds_live_claim(row, execution_id, owner_id, now):
        assert row is not None
        assert count == 1
        assert db.claim() == ClaimRow(row.execution_id, row.owner_id, row.phase, now)
        assert not lease_is_live(now, now)
    else:
        assert count == 0
        assert db.snapshot() == before


@DB_SETTINGS
@given(case=recovery_lease_cases())
def test_recovery_lease_sql_agrees_with_may_take(
    db: Db, case: tuple[int, RecoveryLeaseRow | None, str]
) -> None:
    """A recovery pass (`scan_and_lease`) takes (and writes) a recovery lease on an expired
    claim exactly when `may_take_recovery_lease` allows it; a refused row is unchanged."""
    db.reset()
    now, row, owner_id = case
    db.put_session(doorbell=False)
    db.put_claim(ClaimRow("exec-1", "dead-owner", "running", now - 1))
    if row is not None:
        db.write(
            "INSERT INTO session_recovery(execution_id, session_id, owner_id, expires_at,"
            " recovery_error, time_created, time_quarantined)"
            " VALUES ('exec-1', 's', ?, ?, ?, 0, ?)",
            (
                row.owner_id,
                row.expires_at,
                "bad" if row.quarantined else None,
                0 if row.quarantined else None,
            ),
        )
    before = db.snapshot()
    candidate = _store.Candidate("s", "exec-1")
    _, _, taken, _ = db.run(now, scan_and_lease, owner_id, 10, [], [], LEASE_MS)
    if may_take_recovery_lease(row, owner_id, now):
        assert taken == [candidate]
        assert db.rows("SELECT owner_id, expires_at, recovery_error FROM session_recovery") == [
            (owner_id, now + LEASE_MS, None)
        ]
    else:
        assert taken == []
        assert db.snapshot() == before


VALID_ASSISTANT = _codec.encode_assistant(_transcript.EMPTY)
MALFORMED_ASSISTANT = '{"parts": [], "finished": "false", "error": null}'


@DB_SETTINGS
@given(
    now=nows,
    claim_execution=executions,
    phase=phases,
    offset=offsets,
    superseded=st.booleans(),
    malformed=st.booleans(),
    wake_attempts=st.integers(min_value=0, max_value=4),
    max_resumes=st.integers(min_value=0, max_value=4),
)
def test_apply_recovery_sql_agrees_with_decide_recovery(
    db: Db,
    now: int,
    claim_execution: str,
    phase: str,
    offset: int,
    superseded: bool,
    malformed: bool,
    wake_attempts: int,
    max_resumes: int,
) -> None:
    """`apply_recovery`, reading the facts from SQL, reaches the same decision as
    `decide_recovery` on those facts, and leaves the claim and recovery rows accordingly."""
    db.reset()
    claim = ClaimRow(claim_execution, "dead-owner", phase, now + offset)
    db.put_session(doorbell=False, wake_attempts=wake_attempts)
    db.put_claim(claim, anchor_seq=1)
    db.write(
        "INSERT INTO session_message(id, session_id, execution_id, role, seq, data,"
        " time_created, time_updated) VALUES ('m-1', 's', 'exec-1', 'assistant', 1, ?, 0, 0)",
        (MALFORMED_ASSISTANT if malformed else VALID_ASSISTANT,),
    )
    if superseded:
        db.write(
            "INSERT INTO session_message(id, session_id, execution_id, role, seq, data,"
            " time_created, time_updated) VALUES ('m-2', 's', 'exec-x', 'assistant', 2, ?, 0, 0)",
            (VALID_ASSISTANT,),
        )
    db.write(
        "INSERT INTO session_recovery(execution_id, session_id, owner_id, expires_at,"
        " time_created) VALUES ('exec-1', 's', 'me', ?, 0)",
        (now + LEASE_MS,),
    )
    facts = RecoveryFacts(claim, superseded, malformed, wake_attempts)
    expected = decide_recovery(facts, "exec-1", now, max_resumes)
    recovered = db.run(
        now,
        _store.apply_recovery,
        "me",
        _store.Candidate("s", "exec-1"),
        "exec-new",
        LEASE_MS,
        max_resumes,
    )
    assert recovered.decision is expected
    assert not recovered.fence_lost
    after = db.claim()
    recovery_rows = db.rows("SELECT recovery_error FROM session_recovery")
    if expected is RecoveryDecision.RESUME:
        assert after == ClaimRow("exec-new", "me", "running", now + LEASE_MS)
    elif expected in (
        RecoveryDecision.GONE,
        RecoveryDecision.SKIP_LIVE,
        RecoveryDecision.QUARANTINE,
    ):
        assert after == claim
    else:
        assert after is None
    if expected is RecoveryDecision.QUARANTINE:
        assert len(recovery_rows) == 1
        assert recovery_rows[0][0] is not None
    else:
        assert recovery_rows == []


def test_db_helper_clock_is_exact() -> None:
    """The fixed clock used above converts back to the very millisecond it was built from."""
    for now in (1_000_000_000, 1_800_000_000_000, 4_000_000_000_000):
        assert _backend.now_ms(fixed_clock(now)) == now


@pytest.mark.parametrize("doorbell_set", [False, True])
@pytest.mark.parametrize("phase", ["running", "cancelling"])
@pytest.mark.parametrize("paused", [False, True])
@pytest.mark.parametrize("untaken_inputs", [False, True])
def test_iteration_verdict(
    doorbell_set: bool, phase: str, paused: bool, untaken_inputs: bool
) -> None:
    """After a normal return: paused ends the busy period (doorbell kept), a cancelling claim
    never continues (a set doorbell, or due inputs its drain was not given, go to a
    successor), else a set doorbell continues and none releases (a running claim's untaken
    inputs were its drain's choice)."""
    verdict = iteration_verdict(
        doorbell_set=doorbell_set, phase=phase, paused=paused, untaken_inputs=untaken_inputs
    )
    if paused:
        assert verdict is IterationVerdict.PAUSE
    elif phase == "cancelling":
        handed_over = doorbell_set or untaken_inputs
        expected = IterationVerdict.HAND_OVER if handed_over else IterationVerdict.RELEASE
        assert verdict is expected
    else:
        expected = IterationVerdict.CONTINUE if doorbell_set else IterationVerdict.RELEASE
        assert verdict is expected


@pytest.mark.parametrize("on_busy", ON_BUSY)
@pytest.mark.parametrize("claim_phase", [None, "running", "cancelling"])
@pytest.mark.parametrize("due_inputs_pending", [False, True])
def test_submit_verdict(on_busy: str, claim_phase: str | None, due_inputs_pending: bool) -> None:
    """reject refuses exactly a busy session (a claim, or due inputs untaken); interrupt marks
    exactly a running claim; everything else queues."""
    verdict = submit_verdict(
        on_busy, claim_phase=claim_phase, due_inputs_pending=due_inputs_pending
    )
    busy = claim_phase is not None or due_inputs_pending
    if on_busy == "reject" and busy:
        assert verdict is SubmitVerdict.REJECT
    elif on_busy == "interrupt" and claim_phase == "running":
        assert verdict is SubmitVerdict.INTERRUPT
    else:
        assert verdict is SubmitVerdict.QUEUE
