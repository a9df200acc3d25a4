"""Recovery applied to a pass's batch (`apply_recovery_batch`): set-wise where no transcript
needs decoding, `recovery.apply_recovery` in a savepoint for every other candidate; on
PostgreSQL the set-wise part is one call (`ts_recover`).

Invariants kept here (and in `recovery`, whose fences and single-row rules this applies):
* a claim is taken over only under the recovery fence on its exact old execution id still
  being expired, or its owner gone with its token re-checked free after the session locks;
* only candidates whose recovery lease we hold are acted on; another owner's row is left;
* one row's failure never undoes another's recovery, and a row recovery cannot process is
  quarantined (`recovery.quarantine`), never retried forever;
* a claim handed back by a graceful shutdown resumes without counting a resume.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from .. import _decisions
from .._backend import NEEDS_TRANSACTION, Tx, autocommit_when_alone
from .._decisions import ClaimRow, RecoveryDecision, RecoveryFacts
from .._errors import LeaseLost, MalformedRecord
from .._liveness import _HELD as _TOKEN_HELD
from .common import _chunks, _in_list
from .recovery import (
    Recovered,
    _count_resumes,
    _delete_recovery_rows,
    _gone_owner,
    _replace_claim,
    _superseded,
    apply_recovery,
    quarantine,
)
from .recovery_scan import Candidate


@autocommit_when_alone
def apply_recovery_batch(
    tx: Tx,
    owner_id: str,
    items: list[tuple[Candidate, str]],
    lease_ms: int,
    max_resumes: int,
    gone_owners: Sequence[str] = (),
) -> list[Recovered]:
    """`apply_recovery` for each (candidate, new execution id); one row's failure never
    undoes another's recovery.

    Set-wise where no transcript needs decoding: the facts of every candidate come from one
    statement, and a claim whose execution wrote no assistant message is taken over (or
    skipped) with the same fences, row by row in SQL but with no savepoint, since its first
    write is its fence. Every other candidate goes through `apply_recovery` in a savepoint.
    PostgreSQL: the set-wise part is one call (`_pg_apply_recovery_batch`); alone, that
    call is the whole operation in autocommit (one round trip), unless a candidate needs
    the row-by-row path: then the server refuses it whole and it runs in a transaction.
    """
    if tx.dialect == "postgres":
        return _pg_apply_recovery_batch(tx, owner_id, items, lease_ms, max_resumes, gone_owners)
    results: dict[int, Recovered] = {}
    plain: list[_PlainItem] = []
    sessions = sorted({candidate.session_id for candidate, _ in items})
    for session_id in sessions:
        tx.lock_session(session_id)
    # Re-checked here, after the locks: an owner is gone only if its token is free now.
    gone = frozenset(tx.free_tokens(gone_owners)) if gone_owners else frozenset()
    facts_of = _plain_recovery_facts(tx, owner_id, [c for c, _ in items], gone)
    for index, (candidate, new_execution_id) in enumerate(items):
        known = facts_of.get(candidate.execution_id or "")
        decision: RecoveryDecision | None = None
        if known is not None:
            facts, newest_seq, leased = known
            decision = _decisions.decide_recovery(
                facts, candidate.execution_id or "", tx.now, max_resumes
            )
        if known is None or decision not in _PLAIN_DECISIONS:
            results[index] = _apply_one(
                tx, owner_id, candidate, new_execution_id, lease_ms, max_resumes, gone
            )
        elif not leased:
            # Another recovery owner holds this row now: act on nothing of theirs.
            results[index] = Recovered(RecoveryDecision.GONE, fence_lost=True)
        else:
            plain.append(
                _PlainItem(index, candidate, new_execution_id, facts, newest_seq, decision)
            )
    results.update(_apply_plain(tx, owner_id, plain, lease_ms))
    return [results[index] for index in range(len(items))]


@attrs.frozen
class _PlainItem:
    """A candidate `apply_recovery_batch` acts on set-wise, with what it read about it."""

    position: int
    candidate: Candidate
    new_execution_id: str
    facts: RecoveryFacts
    newest_seq: int | None
    decision: RecoveryDecision


# Decisions `apply_recovery_batch` applies set-wise to a claim with no assistant message
# (no transcript to close); a superseded, cancelled or exhausted claim goes row by row.
_PLAIN_DECISIONS = (RecoveryDecision.RESUME, RecoveryDecision.SKIP_LIVE, RecoveryDecision.GONE)


def _apply_one(
    tx: Tx,
    owner_id: str,
    candidate: Candidate,
    new_execution_id: str,
    lease_ms: int,
    max_resumes: int,
    gone: frozenset[str],
) -> Recovered:
    try:
        with tx.savepoint():
            return apply_recovery(
                tx, owner_id, candidate, new_execution_id, lease_ms, max_resumes, gone
            )
    except LeaseLost:
        return Recovered(RecoveryDecision.GONE, fence_lost=True)
    except (MalformedRecord, ValueError, TypeError, RecursionError) as exc:
        # A row recovery cannot process is poison: quarantine it (exact fence) rather
        # than fail the pass, so it never starves the rows behind it.
        return quarantine(tx, owner_id, candidate, f"recovery failed: {exc!r}")


def _plain_recovery_facts(
    tx: Tx, owner_id: str, candidates: Sequence[Candidate], gone: frozenset[str]
) -> dict[str, tuple[RecoveryFacts, int | None, bool]]:
    """For each candidate claim (still present) whose execution wrote no assistant message:
    its recovery facts, the session's newest message seq, and whether we hold its recovery
    lease. Read under the session locks, after which `tx.now` is read."""
    execution_ids = [c.execution_id for c in candidates if c.execution_id is not None]
    found: dict[str, tuple[RecoveryFacts, int | None, bool]] = {}
    for chunk in _chunks(execution_ids):
        rows = tx.execute(
            "SELECT e.id, e.owner_id, e.phase, e.expires_at, e.handed_back, s.wake_attempts,"
            " (SELECT MAX(m.seq) FROM session_message m WHERE m.session_id = e.session_id),"
            f" {_superseded(session='e.session_id', execution='e.id', anchor='e.anchor_seq')},"
            " EXISTS (SELECT 1 FROM session_recovery r WHERE r.execution_id = e.id"
            "   AND r.owner_id = ? AND r.expires_at > ? AND r.recovery_error IS NULL),"
            " s.time_paused"
            " FROM session_execution e JOIN session s ON s.id = e.session_id"
            f" WHERE e.id IN {_in_list(chunk)} AND NOT EXISTS (SELECT 1 FROM session_message m"
            "   WHERE m.execution_id = e.id AND m.role = 'assistant')",
            (owner_id, tx.now, *chunk),
        ).fetchall()
        for row in rows:
            execution_id, owner, phase, expires_at, handed_back, attempts = row[:6]
            facts = RecoveryFacts(
                claim=ClaimRow(execution_id, owner, phase, expires_at),
                superseded=bool(row[7]),
                newest_assistant_malformed=False,
                wake_attempts=int(attempts),
                handed_back=bool(handed_back),
                owner_gone=owner in gone,
                paused=row[9] is not None,
            )
            found[execution_id] = (facts, None if row[6] is None else int(row[6]), bool(row[8]))
    return found


def _apply_plain(
    tx: Tx,
    owner_id: str,
    plain: list[_PlainItem],
    lease_ms: int,
) -> dict[int, Recovered]:
    """Take over (RESUME) or let go (SKIP_LIVE, GONE) of claims whose recovery lease we
    hold and whose execution wrote no assistant message: nothing to close or decode."""
    results: dict[int, Recovered] = {}
    done: list[str] = []  # recovery rows of ours to delete
    counted: dict[bool, list[str]] = {True: [], False: []}
    # The recovery fence comes first: a claim it matched nothing for has nothing written.
    replaced = _replace_claims(
        tx,
        [
            (
                item.candidate.execution_id or "",
                item.new_execution_id,
                item.newest_seq,
                _gone_owner(item.facts),
            )
            for item in plain
            if item.decision is RecoveryDecision.RESUME
        ],
        owner_id,
        lease_ms,
    )
    for item in plain:
        index, candidate, facts, decision = item.position, item.candidate, item.facts, item.decision
        old = candidate.execution_id
        assert old is not None
        if decision is not RecoveryDecision.RESUME:
            done.append(old)
            results[index] = Recovered(decision)
            continue
        if old not in replaced:
            results[index] = Recovered(RecoveryDecision.GONE, fence_lost=True)
            continue
        # A claim handed back by a graceful shutdown resumes without counting.
        counts = not facts.handed_back
        counted[counts].append(candidate.session_id)
        done.append(old)
        results[index] = Recovered(
            RecoveryDecision.RESUME,
            new_execution_id=item.new_execution_id,
            attempt=facts.wake_attempts + int(counts),
        )
    for counts, session_ids in counted.items():
        _count_resumes(tx, counts, session_ids)
    _delete_recovery_rows(tx, owner_id, done)
    return results


def _replace_claims(
    tx: Tx,
    claims: Sequence[tuple[str, str, int | None, str | None]],
    owner_id: str,
    lease_ms: int,
) -> set[str]:
    """`_replace_claim` for each (old execution id, new execution id, anchor seq, gone
    owner); the old ids it replaced (SQLite: PostgreSQL's set-wise path is `ts_recover`)."""
    return {
        old
        for old, new, anchor, gone_owner in claims
        if _replace_claim(tx, old, new, owner_id, anchor, lease_ms, gone_owner)
    }


# ---------------------------------------------------------------------------------------------
# PostgreSQL: recovery applied set-wise in one call (DESIGN §8: the takeover of a batch in
# one statement, FOR UPDATE ... SKIP LOCKED)


def _pg_apply_recovery_batch(
    tx: Tx,
    owner_id: str,
    items: list[tuple[Candidate, str]],
    lease_ms: int,
    max_resumes: int,
    gone_owners: Sequence[str],
) -> list[Recovered]:
    """PostgreSQL's `apply_recovery_batch`: one `ts_recover` call takes every session lock,
    re-checks the gone owners' tokens, and takes over (or lets go of) set-wise every claim
    whose execution wrote no assistant message. It writes nothing for the rest - a
    transcript to close or decode; a cancelled, superseded, paused, exhausted or vanished
    claim - which then go through `apply_recovery` one by one in savepoints, under the
    locks the call took.

    In autocommit (`tx.autocommit`: the operation ran alone) the call is the whole
    operation: it refuses the batch whole (`NEEDS_TRANSACTION`, nothing written) if a
    claim needs the row-by-row path, and the engine runs it again in a transaction. A
    retry after a lost reply reads back the claims the lost call took over, by their new
    execution ids."""
    if not items:
        return []
    rows = tx.call(
        "ts_recover",
        owner_id,
        [candidate.execution_id or "" for candidate, _ in items],
        [new_execution_id for _, new_execution_id in items],
        [candidate.session_id for candidate, _ in items],
        list(gone_owners),
        lease_ms,
        max_resumes,
        tx.autocommit,
    )
    results: dict[int, Recovered] = {}
    row_by_row: list[int] = []
    for ordinal, verdict, attempt in rows:
        index = int(ordinal) - 1
        if verdict == "resumed":
            results[index] = Recovered(
                RecoveryDecision.RESUME, new_execution_id=items[index][1], attempt=int(attempt)
            )
        elif verdict == "skipped_live":
            results[index] = Recovered(RecoveryDecision.SKIP_LIVE)
        elif verdict == "fence_lost":
            # Another recovery owner holds the row, the fence matched nothing, or another
            # transaction holds the claim row locked (skipped): nothing was written; a
            # lease of ours stays, and a later pass looks again.
            results[index] = Recovered(RecoveryDecision.GONE, fence_lost=True)
        else:
            row_by_row.append(index)
    if row_by_row:
        # Re-checked here too, under the locks the call took: gone only if still free now.
        gone = frozenset(tx.free_tokens(gone_owners)) if gone_owners else frozenset()
        for index in row_by_row:
            candidate, new_execution_id = items[index]
            results[index] = _apply_one(
                tx, owner_id, candidate, new_execution_id, lease_ms, max_resumes, gone
            )
    return [results[index] for index in range(len(items))]


# The set-wise recovery (`_pg_apply_recovery_batch`). Verdicts per (claim, new execution):
# `resumed` (taken over: attempt is the session's resume count now), `skipped_live` (its
# lease is live again; our recovery row deleted), `fence_lost` (nothing written: another
# recovery owner's row, the recovery fence matched nothing, or the claim row was locked
# by another transaction and skipped), `row_by_row` (nothing written: the caller's row path
# decides). `p_whole` (the call is the whole operation, in autocommit): a `row_by_row`
# claim raises `NEEDS_TRANSACTION` instead, which undoes the whole call. `p_retry` (a
# retry after a lost reply): a claim already ours under its new execution id was taken
# over by the lost call (`resumed`, its attempt the session's resume count), and a live
# claim with no recovery row left but ours was let go by it (`skipped_live`). The steps
# are `apply_recovery`'s for a claim with no assistant message: the session locks in the
# functions' order, the clock after them, the gone owners' tokens re-checked, the decision
# in `_decisions.decide_recovery`'s order, the takeover under the recovery fence
# (`RECOVERY_FENCE`), a resume counted unless handed back, our recovery rows deleted. It
# signals nothing: a resumed claim's own runtime drains it.
PG_FUNCTIONS = (
    r"""
CREATE OR REPLACE FUNCTION ts_needs_transaction() RETURNS text
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    RAISE EXCEPTION 'a claim of this batch needs the row-by-row path'
        USING ERRCODE = '"""
    + NEEDS_TRANSACTION
    + r"""';
END $$;

CREATE OR REPLACE FUNCTION ts_recover(p_owner text, p_execs text[], p_news text[],
    p_sessions text[], p_gone text[], p_lease bigint, p_max_resumes bigint, p_whole boolean,
    p_now bigint, p_retry boolean)
RETURNS TABLE(ord bigint, verdict text, attempt bigint)
LANGUAGE plpgsql VOLATILE
@GENERIC_PLAN@ AS $$
DECLARE
    v_now bigint; v_gone text[];
BEGIN
    PERFORM ts_lock_all(p_sessions);
    v_now := ts_now(p_now);
    -- Owners found gone count as such only while their token is still free, after the locks.
    v_gone := ARRAY(SELECT o.owner_id FROM session_owner o
                    WHERE o.owner_id = ANY(p_gone) AND NOT """
    + _TOKEN_HELD
    + r""");
    RETURN QUERY
    WITH job AS (
        SELECT u.e, u.new, u.s, u.n, count(*) OVER (PARTITION BY u.e) AS copies
        FROM unnest(p_execs, p_news, p_sessions) WITH ORDINALITY AS u(e, new, s, n)),
    -- A retry: the claims the lost call took over are ours under their new ids.
    landed AS MATERIALIZED (
        SELECT j.n, s.wake_attempts FROM job j
        JOIN session_execution c ON c.id = j.new AND c.session_id = j.s
            AND c.owner_id = p_owner
        JOIN session s ON s.id = j.s
        WHERE p_retry),
    -- The claims decided here: present, of the session named, once in the batch, and no
    -- assistant message of theirs (nothing to close or decode). NULL: the row path decides
    -- (cancelled, superseded, paused, budget exhausted).
    fact AS MATERIALIZED (
        SELECT j.n, j.e, j.new, c.session_id, c.handed_back, s.wake_attempts,
            CASE WHEN c.expires_at > v_now AND NOT c.owner_id = ANY(v_gone) THEN 'skipped_live'
                 WHEN c.phase = 'cancelling' OR """
    + _superseded(session="c.session_id", execution="c.id", anchor="c.anchor_seq")
    + r"""
                      OR s.time_paused IS NOT NULL
                      OR (c.handed_back = 0 AND s.wake_attempts >= p_max_resumes) THEN NULL
                 ELSE 'resume' END AS decision,
            EXISTS (SELECT 1 FROM session_recovery r WHERE r.execution_id = j.e
                    AND r.owner_id = p_owner AND r.expires_at > v_now
                    AND r.recovery_error IS NULL) AS leased,
            -- A retry's `skipped_live` read-back: no recovery row but ours is left.
            p_retry AND NOT EXISTS (SELECT 1 FROM session_recovery r
                    WHERE r.execution_id = j.e AND r.owner_id <> p_owner) AS let_go
        FROM job j
        JOIN session_execution c ON c.id = j.e AND c.session_id = j.s
        JOIN session s ON s.id = c.session_id
        WHERE j.copies = 1 AND NOT EXISTS (SELECT 1 FROM session_message m
            WHERE m.execution_id = j.e AND m.role = 'assistant')),
    -- The recovery fence, on the claim rows no other transaction holds locked.
    takeable AS MATERIALIZED (
        SELECT c.id, f.n, f.new, f.session_id, f.handed_back, f.wake_attempts
        FROM fact f JOIN session_execution c ON c.id = f.e
        WHERE f.decision = 'resume' AND f.leased
            AND (c.expires_at <= v_now OR c.owner_id = ANY(v_gone))
        FOR UPDATE OF c SKIP LOCKED),
    taken AS (
        UPDATE session_execution c SET id = t.new, owner_id = p_owner, phase = 'running',
            anchor_seq = (SELECT MAX(m.seq) FROM session_message m
                          WHERE m.session_id = t.session_id),
            time_created = v_now, heartbeat_at = NULL, expires_at = v_now + p_lease,
            handed_back = 0
        FROM takeable t
        WHERE c.id = t.id AND (c.expires_at <= v_now OR c.owner_id = ANY(v_gone))
        RETURNING t.n, t.id AS e, t.session_id, t.handed_back, t.wake_attempts),
    -- A claim handed back by a graceful shutdown resumes without counting.
    counted AS (
        UPDATE session s SET wake_attempts = s.wake_attempts
                + CASE WHEN t.handed_back = 0 THEN 1 ELSE 0 END,
            time_woken = NULL, wakes = 0
        FROM taken t WHERE s.id = t.session_id),
    -- Only our own recovery rows: another owner's lease or quarantine is not ours to touch.
    let_go AS (
        DELETE FROM session_recovery r
        WHERE r.owner_id = p_owner AND r.recovery_error IS NULL
            AND r.execution_id = ANY(ARRAY(SELECT t.e FROM taken t UNION ALL
                SELECT f.e FROM fact f WHERE f.decision = 'skipped_live' AND f.leased)))
    SELECT j.n,
        CASE WHEN l.n IS NOT NULL OR t.e IS NOT NULL THEN 'resumed'
             WHEN f.decision = 'skipped_live' AND (f.leased OR f.let_go) THEN 'skipped_live'
             WHEN f.decision IS NOT NULL THEN 'fence_lost'
             WHEN p_whole THEN ts_needs_transaction()
             ELSE 'row_by_row' END,
        COALESCE(l.wake_attempts,
                 t.wake_attempts + CASE WHEN t.handed_back = 0 THEN 1 ELSE 0 END)
    FROM job j LEFT JOIN landed l ON l.n = j.n LEFT JOIN fact f ON f.n = j.n
        LEFT JOIN taken t ON t.n = j.n
    ORDER BY j.n;
END $$;
"""
)
