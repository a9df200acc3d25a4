"""The recovery scan: which expired claims and unclaimed doorbells a recovery pass looks at,
and the recovery leases it takes on them before `recovery` applies its decision. A pass does
both, and its look at the next due input, in one transaction (`scan_and_lease`; on SQLite
the expired claims are leased by the statement that finds them).

Invariants kept here:
* quarantined executions, executions under another owner's live recovery lease, sessions
  held locally and paused sessions' doorbells are excluded in the scan itself, so they
  never use up its limit. The recovery lease of an owner found gone (its liveness token
  free for the grace: it died, or closed after withdrawing its takeover, between its scan
  and its takeover) is no live one: it would hold the claim out for a whole lease;
* on PostgreSQL the scan skips claim rows another transaction holds locked instead of
  waiting for them (DESIGN §8); SQLite's single writer has nothing to skip;
* a recovery lease is taken only if absent, expired, already ours or a gone owner's, never
  on a quarantined row (the takeover is fenced on our lease, `recovery._holds_recovery_lease`:
  a gone owner that comes back finds its lease moved and acts on nothing). A pass's scan
  and its leases share one transaction (`scan_and_lease`): under SQLite's only write lock,
  or PostgreSQL's row locks on the claims scanned (one autocommit call,
  `ts_recovery_scan`), no claim the scan read can go before its lease is written, so no
  lease is ever taken on a claim that is gone.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import attrs

from .._backend import Tx, autocommit_when_alone
from .._liveness import _HELD as _TOKEN_HELD
from .._validate import MAX_INT64
from .common import not_in, readable, whole_number
from .control import next_due


@attrs.frozen
class Candidate:
    """A recovery candidate: an expired claim (`execution_id` set) or an unclaimed doorbell."""

    session_id: str
    execution_id: str | None


def _expired_scans(
    tx: Tx,
    owner_id: str,
    limit: int,
    local_sessions: Sequence[str],
    gone_owners: Sequence[str],
    found: list[Candidate],
) -> Iterator[tuple[str, dict[str, Any]]]:
    """The scan for expired claims, then the one for claims whose expiry is no time, each
    for the room the claims `found` so far (the caller's list, grown between them) left."""
    for no_time in (False, True):
        room = limit - len(found)
        if room <= 0:
            return
        yield _expired_claims(tx, owner_id, room, local_sessions, gone_owners, no_time)


def _expired_claims(
    tx: Tx,
    owner_id: str,
    limit: int,
    local_sessions: Sequence[str],
    gone_owners: Sequence[str],
    no_time: bool = False,
) -> tuple[str, dict[str, Any]]:
    """The FROM ... LIMIT of SQLite's scan for expired claims, which leases them
    (`_lease_expired_claims`), and its parameters.

    `no_time`: instead, the claims whose expiry is no time - text, a blob or a number past
    any 64-bit time, which SQLite keeps when another tool writes it (text sorts after every
    number): they would look live for ever, and recovery quarantines them. A scan of their
    own, after the expired claims': an OR in one scan walks the whole index in order.

    Another owner's recovery lease whose expiry is no time (SQLite again) is no live lease:
    it would hold its claim out of every pass for ever, so the scan takes it as expired, and
    so do the lease upserts. Nor is the lease of a gone owner (`gone_owners`): it died or
    closed between its scan and its takeover, and its lease would hold the claim out for a
    whole lease; the scan's lease upsert (`_take_lease`) takes it over."""
    not_local, local = not_in(tx, "e.session_id", local_sessions)
    gone = _gone_params(gone_owners)
    if no_time:  # a gone owner's claims were found by the scan before, whatever their expiry
        due = "e.expires_at > :latest" + _not_gone("e.owner_id", gone)
    else:
        due = "(e.expires_at <= :now" + _or_gone("e.owner_id", gone) + ")"
    scan = (
        " FROM session_execution e"
        f" WHERE {due} AND {not_local}"
        f" AND {readable(tx, 'e.id')} AND {readable(tx, 'e.session_id')}"
        " AND NOT EXISTS (SELECT 1 FROM session_recovery r WHERE r.execution_id = e.id"
        "   AND (r.recovery_error IS NOT NULL OR (r.owner_id != :me AND r.expires_at > :now"
        f"     AND r.expires_at <= :latest{_not_gone('r.owner_id', gone)})))"
        " ORDER BY e.expires_at, e.id LIMIT :limit"
    )
    return scan, {
        "now": tx.now,
        "latest": MAX_INT64,
        "excluded": local,
        "me": owner_id,
        "limit": limit,
        **gone,
    }


def _gone_params(gone_owners: Sequence[str]) -> dict[str, str]:
    """The named parameters of the owners found gone (`gone0`, ...)."""
    return {f"gone{index}": owner for index, owner in enumerate(gone_owners)}


def _not_gone(column: str, gone: dict[str, str]) -> str:
    """A condition's tail (empty for no gone owner): `column` names none of them."""
    return "".join(f" AND {column} != :{name}" for name in gone)


def _or_gone(column: str, gone: dict[str, str]) -> str:
    """A disjunction's tail (empty for no gone owner): or `column` names one of them."""
    return "".join(f" OR {column} = :{name}" for name in gone)


def handed_back_condition(
    tx: Tx, owner_id: str, local_sessions: Sequence[str]
) -> tuple[str, dict[str, Any]]:
    """A condition (and its parameters): a claim handed back by a graceful shutdown, or
    stopped by a user after its lease ran out (`handed_back`: its lease ended, no drain of
    it runs), waits for a takeover that a recovery pass of this owner
    would make - one lookup in the partial index of such claims
    (`session_execution_handed_back`). With no clock read: the claim is not held here, its
    keys are readable, and it has no recovery row but an unquarantined one of ours - a row
    of another owner's, live or not (one that crashed in its pass), leaves it to the next
    pass, which tells those apart with the clock (`_expired_claims`)."""
    not_local, local = not_in(tx, "e.session_id", local_sessions)
    condition = (
        "EXISTS (SELECT 1 FROM session_execution e WHERE e.handed_back = 1"
        f" AND {not_local} AND {readable(tx, 'e.id')} AND {readable(tx, 'e.session_id')}"
        " AND NOT EXISTS (SELECT 1 FROM session_recovery r WHERE r.execution_id = e.id"
        "   AND (r.recovery_error IS NOT NULL OR r.owner_id != :me)))"
    )
    return condition, {"excluded": local, "me": owner_id}


def _doorbells_left(tx: Tx, local_sessions: Sequence[str], room: int) -> list[Candidate]:
    """The unclaimed doorbells that fit in the `room` the expired claims left."""
    if room <= 0:
        return []
    return [
        Candidate(session_id, None) for session_id in _unclaimed_doorbells(tx, local_sessions, room)
    ]


def _unclaimed_doorbells(tx: Tx, local_sessions: Sequence[str], limit: int) -> list[str]:
    """Sessions with a set doorbell and no claim row, oldest wake first, except those held
    locally (a crash between wake and acquire, or a wake from another process), paused
    ones (their doorbell waits for `resume`) and malformed ones (`readable`,
    `whole_number`)."""
    not_local, local = not_in(tx, "s.id", local_sessions)
    rows = tx.execute(
        "SELECT s.id FROM session s WHERE s.time_woken IS NOT NULL AND s.time_paused IS NULL"
        " AND NOT EXISTS (SELECT 1 FROM session_execution e WHERE e.session_id = s.id)"
        f" AND {not_local} AND {readable(tx, 's.id')} AND {whole_number(tx, 's.wake_attempts')}"
        " ORDER BY s.time_woken, s.id LIMIT :limit",
        {"excluded": local, "limit": limit},
    ).fetchall()
    return [str(row[0]) for row in rows]


@autocommit_when_alone
def scan_and_lease(
    tx: Tx,
    owner_id: str,
    limit: int,
    local_sessions: Sequence[str],
    gone_owners: Sequence[str],
    lease_ms: int,
) -> tuple[list[Candidate], set[str], list[Candidate], int | None]:
    """A recovery pass's scan (the expired claims, and every claim of `gone_owners`, oldest
    expiry first, then unclaimed doorbells oldest wake first, `limit` in all), every owner
    whose liveness token is free now, the recovery leases on the expired claims found, and
    when the next scheduled input falls due (`control.next_due`), in one transaction:
    (candidates, free owners, leased candidates, ms until due or None).

    No claim the scan read can be taken over or removed before its lease is written - the
    scan holds SQLite's only write lock, or on PostgreSQL the claim rows it returns locked
    (FOR NO KEY UPDATE, to COMMIT; a row another transaction holds locked is skipped, not
    waited for: DESIGN §8) - so no lease is taken on a claim that is gone. On PostgreSQL
    one call of `ts_recovery_scan` (alone: in autocommit, durable when it returns; a retry
    after a lost reply takes our own leases again)."""
    if tx.dialect == "postgres":
        return _pg_scan_and_lease(tx, owner_id, limit, local_sessions, gone_owners, lease_ms)
    leased = _lease_expired_claims(tx, owner_id, limit, local_sessions, gone_owners, lease_ms)
    free = tx.free_tokens(None)
    doorbells = _doorbells_left(tx, local_sessions, limit - len(leased))
    return leased + doorbells, free, leased, next_due(tx)


def _take_lease(gone: dict[str, str]) -> str:
    """The recovery lease's upsert tail: it takes a row over only when it is no quarantine
    and the lease is ours, expired or of an owner found gone (`gone`, named parameters:
    `_gone_params`) - or its expiry is no time (another tool's text, blob or huge value,
    which would look live for ever)."""
    return (
        " ON CONFLICT(execution_id) DO UPDATE SET owner_id = excluded.owner_id,"
        " expires_at = excluded.expires_at"
        " WHERE session_recovery.recovery_error IS NULL"
        " AND (session_recovery.owner_id = excluded.owner_id"
        "   OR session_recovery.expires_at <= excluded.time_created"
        f"   OR NOT session_recovery.expires_at <= {MAX_INT64}"
        + _or_gone("session_recovery.owner_id", gone)
        + ")"
    )


def _lease_expired_claims(
    tx: Tx,
    owner_id: str,
    limit: int,
    local_sessions: Sequence[str],
    gone_owners: Sequence[str],
    lease_ms: int,
) -> list[Candidate]:
    """SQLite: the scan for expired claims and their recovery leases in one statement (the
    lease upsert, `_take_lease`, fed by the scan), in the order the scan returns them.
    Every claim the scan finds is leased: it excludes the rows the upsert would refuse (a
    quarantined one, another owner's live lease), and the write lock holds them still."""
    leased: list[Candidate] = []
    for scan, params in _expired_scans(tx, owner_id, limit, local_sessions, gone_owners, leased):
        rows = tx.execute(
            "INSERT INTO session_recovery(execution_id, session_id, owner_id, expires_at,"
            " time_created) SELECT e.id, e.session_id, :me, :expires, :now"
            + scan
            + _take_lease(_gone_params(gone_owners))
            + " RETURNING session_id, execution_id",
            {**params, "expires": tx.now + lease_ms},
        ).fetchall()
        leased += [Candidate(session_id, execution_id) for session_id, execution_id in rows]
    return leased


def _pg_scan_and_lease(
    tx: Tx,
    owner_id: str,
    limit: int,
    local_sessions: Sequence[str],
    gone_owners: Sequence[str],
    lease_ms: int,
) -> tuple[list[Candidate], set[str], list[Candidate], int | None]:
    """`scan_and_lease` on PostgreSQL: one `ts_recovery_scan` call. Its rows are the
    candidates in scan order - kind `leased` (an expired claim whose lease we hold now),
    `lost` (an expired claim whose lease another owner holds), `doorbell` - then one row of
    kind `free` per owner whose token is free (the owner in the session column), then one
    of kind `due` (ms until the next scheduled input falls due, or NULL)."""
    rows = tx.call(
        "ts_recovery_scan", owner_id, limit, list(local_sessions), list(gone_owners), lease_ms
    )
    candidates: list[Candidate] = []
    leased: list[Candidate] = []
    free: set[str] = set()
    due: int | None = None
    for kind, session_id, execution_id, due_in in rows:
        if kind == "due":
            due = None if due_in is None else int(due_in)
            continue
        if kind == "free":
            free.add(str(session_id))
            continue
        candidate = Candidate(str(session_id), execution_id)
        candidates.append(candidate)
        if kind == "leased":
            leased.append(candidate)
    return candidates, free, leased, due


# ---------------------------------------------------------------------------------------------
# PostgreSQL: this family's server-side functions (created by `_schema`'s migrations; see
# `_store.pg_functions` for their conventions)

PG_FUNCTIONS = (
    r"""
-- `ts_recovery_scan`'s scan (an older process in a rolling upgrade may call it alone):
-- the expired claims (and every claim of the owners found gone) oldest first - not under
-- another owner's live recovery lease, unless that owner is found gone too - skipping
-- claim rows another transaction holds locked, then the unclaimed doorbells of unpaused
-- sessions while the limit leaves room. A session held locally (p_local) is neither. Rows
-- (session_id, execution_id NULL for a doorbell).
CREATE OR REPLACE FUNCTION ts_recovery_candidates(p_owner text, p_limit bigint,
    p_local text[], p_gone text[], p_now bigint, p_retry boolean)
RETURNS TABLE(candidate_session text, candidate_execution text)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_now bigint; v_found bigint;
BEGIN
    v_now := ts_now(p_now);
    -- Two spellings, so the usual one (no gone owner) walks the expires_at index in order.
    IF cardinality(p_gone) = 0 THEN
        RETURN QUERY SELECT e.session_id, e.id FROM session_execution e
            WHERE e.expires_at <= v_now AND NOT (e.session_id = ANY(p_local))
            AND NOT EXISTS (SELECT 1 FROM session_recovery r WHERE r.execution_id = e.id
                AND (r.recovery_error IS NOT NULL
                     OR (r.owner_id <> p_owner AND r.expires_at > v_now)))
            ORDER BY e.expires_at, e.id LIMIT p_limit FOR NO KEY UPDATE OF e SKIP LOCKED;
    ELSE
        RETURN QUERY SELECT e.session_id, e.id FROM session_execution e
            WHERE (e.expires_at <= v_now OR e.owner_id = ANY(p_gone))
            AND NOT (e.session_id = ANY(p_local))
            AND NOT EXISTS (SELECT 1 FROM session_recovery r WHERE r.execution_id = e.id
                AND (r.recovery_error IS NOT NULL
                     OR (r.owner_id <> p_owner AND r.expires_at > v_now
                         AND NOT (r.owner_id = ANY(p_gone)))))
            ORDER BY e.expires_at, e.id LIMIT p_limit FOR NO KEY UPDATE OF e SKIP LOCKED;
    END IF;
    GET DIAGNOSTICS v_found = ROW_COUNT;
    IF v_found < p_limit THEN
        RETURN QUERY SELECT s.id, NULL::text FROM session s
            WHERE s.time_woken IS NOT NULL AND s.time_paused IS NULL
            AND NOT EXISTS (SELECT 1 FROM session_execution e WHERE e.session_id = s.id)
            AND NOT (s.id = ANY(p_local))
            ORDER BY s.time_woken, s.id LIMIT p_limit - v_found;
    END IF;
END $$;

-- Recovery leases taken apart from the scan: the upsert (absent, expired or ours, never a
-- quarantined row), then the leases just taken on claims that are gone undone - a
-- statement of its own, so its snapshot sees a takeover that committed while the upsert
-- waited on a lease row. The execution ids whose lease we hold. Idempotent: a retry after
-- a lost reply takes our own leases again. This version no longer calls it (a pass's scan
-- and leases are one call, `ts_recovery_scan`); it stays for an older process that may
-- still call it during a rolling upgrade.
CREATE OR REPLACE FUNCTION ts_take_recovery_leases(p_owner text, p_execs text[],
    p_sessions text[], p_lease bigint, p_now bigint, p_retry boolean)
RETURNS TABLE(leased_id text)
LANGUAGE plpgsql VOLATILE
@GENERIC_PLAN@ AS $$
DECLARE
    v_now bigint; v_taken text[];
BEGIN
    v_now := ts_now(p_now);
    WITH leased AS (
        INSERT INTO session_recovery AS r (execution_id, session_id, owner_id, expires_at,
            time_created)
        SELECT DISTINCT ON (u.e) u.e, u.s, p_owner, v_now + p_lease, v_now
            FROM unnest(p_execs, p_sessions) AS u(e, s) ORDER BY u.e
        ON CONFLICT (execution_id) DO UPDATE SET owner_id = excluded.owner_id,
            expires_at = excluded.expires_at
        WHERE r.recovery_error IS NULL
            AND (r.owner_id = excluded.owner_id OR r.expires_at <= excluded.time_created)
        RETURNING r.execution_id)
    SELECT array_agg(l.execution_id) INTO v_taken FROM leased l;
    RETURN QUERY
    WITH dropped AS (
        DELETE FROM session_recovery r WHERE r.owner_id = p_owner
            AND r.recovery_error IS NULL AND r.execution_id = ANY(v_taken)
            AND NOT EXISTS (SELECT 1 FROM session_execution e WHERE e.id = r.execution_id)
        RETURNING r.execution_id)
    SELECT t.e FROM unnest(v_taken) AS t(e)
    WHERE NOT EXISTS (SELECT 1 FROM dropped d WHERE d.execution_id = t.e);
END $$;

-- `scan_and_lease` in one call (a recovery pass's scan and leases, DESIGN §8): the
-- candidates of `ts_recovery_candidates` - whose claim rows stay locked (FOR NO KEY
-- UPDATE) until this call commits, so none is taken over or removed before its lease is
-- written: nothing to undo - the leases upserted on the expired ones (absent, expired,
-- ours or a gone owner's, never a quarantined row), then the owners whose liveness token
-- is free now and when the next scheduled input falls due (`next_due`). Rows (kind,
-- session, execution, due) in scan order: `leased`, `lost` (another owner's lease),
-- `doorbell`; then `free` (the owner in the session column); then one `due` (ms from now,
-- NULL for none). Idempotent: a retry after a lost reply takes our own leases again. No
-- generic plan (@GENERIC_PLAN@): the setting would reach the scan's own statements, whose
-- index walk needs the limit and the clock.
CREATE OR REPLACE FUNCTION ts_recovery_scan(p_owner text, p_limit bigint, p_local text[],
    p_gone text[], p_lease bigint, p_now bigint, p_retry boolean)
RETURNS TABLE(scan_kind text, scan_session text, scan_execution text, scan_due bigint)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_now bigint;
BEGIN
    v_now := ts_now(p_now);
    RETURN QUERY
    WITH found AS MATERIALIZED (
        SELECT c.s, c.e, c.n FROM ts_recovery_candidates(p_owner, p_limit, p_local, p_gone,
            v_now, p_retry) WITH ORDINALITY AS c(s, e, n)),
    leased AS (
        INSERT INTO session_recovery AS r (execution_id, session_id, owner_id, expires_at,
            time_created)
        SELECT f.e, f.s, p_owner, v_now + p_lease, v_now FROM found f WHERE f.e IS NOT NULL
        ON CONFLICT (execution_id) DO UPDATE SET owner_id = excluded.owner_id,
            expires_at = excluded.expires_at
        WHERE r.recovery_error IS NULL
            AND (r.owner_id = excluded.owner_id OR r.expires_at <= excluded.time_created
                 OR r.owner_id = ANY(p_gone))
        RETURNING r.execution_id)
    SELECT CASE WHEN f.e IS NULL THEN 'doorbell'
                WHEN l.execution_id IS NOT NULL THEN 'leased' ELSE 'lost' END, f.s, f.e,
        NULL::bigint
    FROM found f LEFT JOIN leased l ON l.execution_id = f.e
    ORDER BY f.n;
    RETURN QUERY SELECT 'free'::text, o.owner_id, NULL::text, NULL::bigint
        FROM session_owner o WHERE NOT """
    + _TOKEN_HELD
    + r""";
    RETURN QUERY SELECT 'due'::text, NULL::text, NULL::text, MIN(i.due_at) - v_now
        FROM session_input i WHERE i.due_at IS NOT NULL;
    -- A pass runs periodically anyway: cancels' traces past their ten minutes go here too,
    -- not only in a later cancel, which a quiet store never runs.
    PERFORM ts_forget_cancelled(v_now);
END $$;
"""
)
