"""Recovery applied to a pass's batch (`apply_recovery_batch`): set-wise where no transcript
needs decoding, `recovery.apply_recovery` in a savepoint for every other candidate; on
SQLite the set-wise part is one prepared takeover statement run once per claim, on
PostgreSQL one call (`ts_recover`).

Invariants kept here (and in `recovery`, whose fences and single-row rules this applies):
* a claim is taken over only under the recovery fence on its exact old execution id still
  being expired, or its owner gone with its token re-checked free after the session locks;
* only candidates whose recovery lease we hold are acted on; another owner's row is left;
* the set-wise takeover writes only a claim `decide_recovery` resumes with nothing to
  close - every condition is in its WHERE - and nothing for any other, which the row path
  then decides;
* one row's failure never undoes another's recovery, and a row recovery cannot process is
  quarantined (`recovery.quarantine`), never retried forever;
* a claim handed back by a graceful shutdown resumes without counting a resume.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence

from .._backend import NEEDS_TRANSACTION, Tx, autocommit_when_alone
from .._decisions import RecoveryDecision
from .._errors import LeaseLost, MalformedRecord
from .._liveness import _HELD as _TOKEN_HELD
from .common import _chunks, _in_list
from .recovery import (
    Recovered,
    _delete_recovery_rows,
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

    SQLite: every claim that resumes with nothing to close (its execution wrote no
    assistant message) is taken over by one prepared statement run once per claim
    (`_take_over_plain`), which carries every resume condition in its WHERE; SQLite's only
    write lock already serialises every session. A claim it refuses - nothing written for
    it - goes through `apply_recovery` in a savepoint, which decides it. PostgreSQL: the
    set-wise part is one call (`_pg_apply_recovery_batch`); alone, that call is the whole
    operation in autocommit (one round trip), unless a candidate needs the row-by-row path:
    then the server refuses it whole and it runs in a transaction.
    """
    if tx.dialect == "postgres":
        return _pg_apply_recovery_batch(tx, owner_id, items, lease_ms, max_resumes, gone_owners)
    # Re-checked here, in the applying transaction: an owner is gone only if its token is
    # free now.
    gone = frozenset(tx.free_tokens(gone_owners)) if gone_owners else frozenset()
    attempts = _take_over_plain(tx, owner_id, items, lease_ms, max_resumes, gone)
    results: list[Recovered] = []
    for index, (candidate, new_execution_id) in enumerate(items):
        attempt = attempts.get(index)
        if attempt is None:
            results.append(
                _apply_one(tx, owner_id, candidate, new_execution_id, lease_ms, max_resumes, gone)
            )
        else:
            results.append(
                Recovered(
                    RecoveryDecision.RESUME, new_execution_id=new_execution_id, attempt=attempt
                )
            )
    return results


def _apply_one(
    tx: Tx,
    owner_id: str,
    candidate: Candidate,
    new_execution_id: str,
    lease_ms: int,
    max_resumes: int,
    gone: frozenset[str],
) -> Recovered:
    def apply() -> Recovered:
        return apply_recovery(
            tx, owner_id, candidate, new_execution_id, lease_ms, max_resumes, gone
        )

    try:
        with tx.savepoint():
            return apply()
    except LeaseLost:
        return Recovered(RecoveryDecision.GONE, fence_lost=True)
    except (MalformedRecord, ValueError, TypeError, RecursionError) as exc:
        # A row recovery cannot process is poison: quarantine it (exact fence) rather
        # than fail the pass, so it never starves the rows behind it.
        return quarantine(tx, owner_id, candidate, f"recovery failed: {exc!r}")
    except Exception as exc:
        refused = tx.refused_value(exc)
        if refused is None:
            raise
        ended = _ended_over_stored_bytes(tx, apply)
        if isinstance(ended, Recovered):
            return ended
        return quarantine(tx, owner_id, candidate, ended or f"recovery failed: {refused}")


class _Undone(Exception):
    """`_ended_over_stored_bytes`: what the second run did is not kept (and the reason it
    quarantined the row for, if it did)."""

    def __init__(self, reason: str | None) -> None:
        super().__init__(reason)
        self.reason = reason


def _ended_over_stored_bytes(tx: Tx, apply: Callable[[], Recovered]) -> Recovered | str | None:
    """SQLite, whose driver refused a read of text another tool wrote that is not UTF-8:
    `apply` (`apply_recovery`) once more, such text read as its bytes
    (`SQLiteTx.stored_bytes`).
    Kept only when it finishes a cancelled claim or drops a superseded one - DESIGN §4
    decides those before the malformed check, and the message that does not decode is
    left open and said so, as for any other such message; a claim left quarantined
    would hold its session until an operator acted. Anything else is undone: the row is
    quarantined for its bytes, as before, for the reason the second run found - which
    names the row (table, key) as every other malformed reason does, where the driver's
    error names only a column - when it found one (else None)."""
    stored_bytes = getattr(tx, "stored_bytes", None)
    if stored_bytes is None:
        return None
    try:
        with tx.savepoint(), stored_bytes():
            result = apply()
            ends = (RecoveryDecision.FINISH_CANCELLED, RecoveryDecision.DROP_SUPERSEDED)
            if result.fence_lost or result.decision not in ends:
                quarantined = result.decision is RecoveryDecision.QUARANTINE
                raise _Undone(result.reason if quarantined else None)
            return result
    except _Undone as undone:
        return undone.reason
    except MalformedRecord as exc:
        return f"recovery failed: {exc!r}"  # as `_apply_one` words one
    except (LeaseLost, ValueError, TypeError, RecursionError):
        return None


# SQLite's takeover of a claim that resumes with nothing to close, run once per claim
# (`_take_over_plain`). Its WHERE is `decide_recovery` reaching RESUME, the recovery fence
# first (`RECOVERY_FENCE`, an owner found gone in `:gone`), then: of the session named,
# running, no assistant message of the claim's own (nothing to close or decode), not
# superseded, not paused, the resume budget left (or handed back), our live recovery lease.
# It leaves `handed_back` for `_count_plain_resumes` to read, which clears it.
_TAKE_OVER_PLAIN = (
    "UPDATE session_execution SET id = :new, owner_id = :me, phase = 'running',"
    " anchor_seq = (SELECT MAX(m.seq) FROM session_message m WHERE m.session_id = :session),"
    " time_created = :now, heartbeat_at = NULL, expires_at = :expires"
    " WHERE id = :execution AND (expires_at <= :now"
    "   OR owner_id IN (SELECT value FROM json_each(:gone)))"
    # An expiry another tool wrote as no integer: the row path quarantines it.
    " AND typeof(expires_at) = 'integer'"
    # So is an anchor (superseded or not cannot be told).
    " AND typeof(anchor_seq) IN ('integer', 'null')"
    # A phase past the CHECK (`PRAGMA ignore_check_constraints`): the row path too.
    " AND session_id = :session AND phase = 'running'"
    " AND NOT EXISTS (SELECT 1 FROM session_message m WHERE m.execution_id = :execution"
    "   AND m.role = 'assistant')"
    " AND NOT "
    + _superseded(session=":session", execution=":execution", anchor="session_execution.anchor_seq")
    + " AND EXISTS (SELECT 1 FROM session s WHERE s.id = :session AND s.time_paused IS NULL"
    # A count another tool wrote as no integer: the row path quarantines it.
    "   AND typeof(s.wake_attempts) = 'integer'"
    "   AND (session_execution.handed_back != 0 OR s.wake_attempts < :max_resumes))"
    " AND EXISTS (SELECT 1 FROM session_recovery r WHERE r.execution_id = :execution"
    "   AND r.owner_id = :me AND r.expires_at > :now AND r.recovery_error IS NULL)"
)


def _take_over_plain(
    tx: Tx,
    owner_id: str,
    items: Sequence[tuple[Candidate, str]],
    lease_ms: int,
    max_resumes: int,
    gone: frozenset[str],
) -> dict[int, int]:
    """Take over every claim of `items` that resumes with nothing to close; count its
    resume (unless handed back) and delete our recovery lease. Returns {position in
    `items`: the session's resume count now} for the claims taken over; nothing is written
    for the others."""
    claims = [
        (index, candidate.session_id, candidate.execution_id, new)
        for index, (candidate, new) in enumerate(items)
        if candidate.execution_id is not None
    ]
    if not claims:
        return {}
    constants = {
        "me": owner_id,
        "now": tx.now,
        "expires": tx.now + lease_ms,
        "max_resumes": max_resumes,
        "gone": json.dumps(sorted(gone)),
    }
    changed = tx.executemany(
        _TAKE_OVER_PLAIN,
        [
            {**constants, "session": session_id, "execution": old, "new": new}
            for _, session_id, old, new in claims
        ],
    ).rowcount
    if changed != len(claims):
        # Some were refused (the rowcount is the batch's): the new ids present were taken.
        taken: set[str] = set()
        for chunk in _chunks([new for *_, new in claims]):
            found = tx.execute(
                f"SELECT id FROM session_execution WHERE id IN {_in_list(chunk)}", chunk
            ).fetchall()
            taken.update(str(row[0]) for row in found)
        claims = [claim for claim in claims if claim[3] in taken]
    if not claims:
        return {}
    attempts = _count_plain_resumes(tx, [session_id for _, session_id, _, _ in claims])
    _delete_recovery_rows(tx, owner_id, [old for _, _, old, _ in claims])
    return {index: attempts[session_id] for index, session_id, _, _ in claims}


def _count_plain_resumes(tx: Tx, session_ids: Sequence[str]) -> dict[str, int]:
    """After `_take_over_plain`: take each session's doorbell and count a resume unless
    its claim was handed back by a graceful shutdown, then clear that mark. Returns each
    session's resume count now."""
    # Any mark but 0 is a hand-back (as the row path's `bool` and PostgreSQL read it): one
    # another tool set to 2 must not count -1 (the CHECK would fail the whole pass).
    handed_back = (
        "(SELECT e.handed_back != 0 FROM session_execution e WHERE e.session_id = session.id)"
    )
    attempts: dict[str, int] = {}
    uncounted: list[str] = []
    for chunk in _chunks(session_ids):
        rows = tx.execute(
            f"UPDATE session SET wake_attempts = wake_attempts + 1 - {handed_back},"
            f" time_woken = NULL, wakes = 0 WHERE id IN {_in_list(chunk)}"
            f" RETURNING id, wake_attempts, {handed_back}",
            chunk,
        ).fetchall()
        for session_id, count, back in rows:
            attempts[str(session_id)] = int(count)
            if back:
                uncounted.append(str(session_id))
    for chunk in _chunks(uncounted):
        tx.execute(
            f"UPDATE session_execution SET handed_back = 0 WHERE session_id IN {_in_list(chunk)}",
            chunk,
        )
    return attempts


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
