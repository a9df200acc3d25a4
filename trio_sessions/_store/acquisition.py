"""Acquisition: taking a session's claim (`acquire`), and the writes that ring a doorbell and
take the claim it rings for in one transaction (`wake_and_acquire`, `submit_and_acquire`).

Invariants kept here:
* the acquire path inserts a claim only when no `session_execution` row exists for the
  session (never an overwrite, live or expired, own or foreign), the session is not paused
  and the doorbell is set; it takes the doorbell in the same transaction, under the session
  lock;
* a claim taken in the transaction that rang the doorbell takes it at once, so the doorbell
  is never written; a write that cannot take the claim (held, paused) leaves it rung;
* on PostgreSQL each operation is one call of its server-side function (`PG_FUNCTIONS`
  below); a claim row carrying the caller's own execution id is that call's, landed before
  a lost reply;
* on SQLite a `submit_and_acquire` alone asks whether its session is free (no claim row,
  not paused) and its input id new in one read, and writes at once when so; anything else
  is read again one question at a time (`_known_input` answers a stored id, so a retry
  after an unknown COMMIT outcome lands once);
* on SQLite a group commit's jobs of one kind run set-wise (`sqlite_batched`: one read,
  then one statement per table) for the sessions free to claim, under the same rules; a
  job the read does not settle writes nothing there and runs alone after;
* on PostgreSQL a group commit's jobs of one kind are one call (`*_many`): every session
  lock first, in sorted order, then the clock; the first job of each session free to
  claim (and, for a submit, whose input id is new and named once) is settled by one
  statement for the whole batch, and every other job goes through the row function after
  it, in the lock order - none of them touches what the statement wrote.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import attrs

from .. import _decisions
from .._backend import (
    FALLBACK,
    Tx,
    autocommit_when_alone,
    caller_yields_next,
    pg_batched,
    skips_a_busy_session,
    sqlite_batched,
)
from .._decisions import AcquireVerdict
from .common import _claim_row, _paused, _take_doorbell, wake_attempts_of
from .inputs import _ensure_session, _insert_input, _known_input, submit, wake


@attrs.frozen
class Acquired:
    """The result of the acquire transaction."""

    verdict: AcquireVerdict
    attempt: int = 0
    holder: str | None = None
    # HELD by another transaction's lock on the session (PostgreSQL), with no claim seen:
    # asking again before that transaction ends gets the same answer.
    locked: bool = False


def _insert_claims(tx: Tx, claims: Sequence[tuple[Any, ...]], rung: Sequence[str]) -> None:
    """`_insert_claim` set-wise: claims (session, execution, owner, lease) for sessions known
    to have no claim row, in one statement; the doorbells of `rung` (those set) taken."""
    tx.execute(
        "INSERT INTO session_execution"
        "(id, session_id, owner_id, phase, anchor_seq, time_created, heartbeat_at, expires_at)"
        " SELECT json_extract(j.value, '$[1]'), json_extract(j.value, '$[0]'),"
        " json_extract(j.value, '$[2]'), 'running',"
        " (SELECT MAX(m.seq) FROM session_message m"
        " WHERE m.session_id = json_extract(j.value, '$[0]')),"
        " :now, NULL, :now + json_extract(j.value, '$[3]') FROM json_each(:claims) j",
        {"now": tx.now, "claims": json.dumps(claims)},
    )
    if rung:
        _take_doorbells(tx, rung)


def _take_doorbells(tx: Tx, session_ids: Sequence[str]) -> None:
    """`_take_doorbell` set-wise."""
    tx.execute(
        "UPDATE session SET time_woken = NULL, wakes = 0"
        " WHERE id IN (SELECT value FROM json_each(?))",
        (json.dumps(session_ids),),
    )


# A set-wise read's session (LEFT JOINed as `s`: none yet, or one) whose resume count is an
# integer: a job whose session holds anything else is left to run alone.
_NO_SESSION_OR_WHOLE_ATTEMPTS = "typeof(s.wake_attempts) IN ('null', 'integer')"
# A session whose input count has a seq left (SQLite would count on past the largest
# integer as a REAL) and not below 0 (another tool's write: the input would go ahead of
# those waiting): any other goes one by one, where `counted_input_seq` refuses it.
_NO_SESSION_OR_INPUT_SEQ_LEFT = (
    "(s.id IS NULL OR (typeof(s.input_seq) = 'integer'"
    " AND s.input_seq BETWEEN 0 AND 9223372036854775806))"
)


# A set-wise submit's input id, in its job row (`json_each`'s `j`).
_JOB_INPUT_ID = "json_extract(j.value, '$[1]')"


def _claimable(
    tx: Tx, rows: Sequence[tuple[Any, ...]], *, doorbell: bool
) -> list[tuple[int, int | None, int]]:
    """The set-wise acquisitions' one read: of the rows (session first) - the first of each
    session only - those whose session has no claim row and is not paused (and, with
    `doorbell`, whose doorbell is set): (index, time_woken, wake_attempts) each. A session
    whose `wake_attempts` is no integer is left out: its job runs alone, where its
    `MalformedRecord` fails its caller only, not the whole batch."""
    firsts: dict[str, int] = {}
    for index, row in enumerate(rows):
        firsts.setdefault(row[0], index)
    indexes = list(firsts.values())
    found = tx.execute(
        "SELECT j.key, s.time_woken, s.wake_attempts FROM json_each(?) j"
        " LEFT JOIN session s ON s.id = j.value WHERE s.time_paused IS NULL"
        f" AND {_NO_SESSION_OR_WHOLE_ATTEMPTS}"
        + (" AND s.time_woken IS NOT NULL" if doorbell else "")
        + " AND NOT EXISTS (SELECT 1 FROM session_execution c WHERE c.session_id = j.value)",
        (json.dumps(list(firsts)),),
    ).fetchall()
    return [
        (indexes[key], time_woken, wake_attempts_of(rows[indexes[key]][0], attempts))
        for key, time_woken, attempts in found
    ]


def _acquire_many(tx: Tx, rows: Sequence[tuple[Any, ...]]) -> list[Any]:
    """SQLite group commit, set-wise: the batch's `acquire` jobs that take their claim (no
    claim row, not paused, doorbell set) in two statements; every other job is `FALLBACK`
    (it writes nothing but its verdict's reads: it runs alone after these)."""
    results: list[Any] = [FALLBACK] * len(rows)
    claimable = _claimable(tx, rows, doorbell=True)
    if claimable:
        for index, _, attempts in claimable:
            results[index] = Acquired(AcquireVerdict.CLAIM, attempt=attempts)
        _insert_claims(
            tx, [rows[index] for index, _, _ in claimable], [rows[i][0] for i, _, _ in claimable]
        )
    return results


def _wake_and_acquire_many(tx: Tx, rows: Sequence[tuple[Any, ...]]) -> list[Any]:
    """SQLite group commit, set-wise: the batch's `wake_and_acquire` jobs that take their
    claim (no claim row, not paused): the session rows ensured, the claims inserted and a
    doorbell already set taken, in a few statements; a held or paused session's job (whose
    wake is recorded) is `FALLBACK`, with nothing written for it: it runs alone after."""
    results: list[Any] = [FALLBACK] * len(rows)
    claimable = _claimable(tx, rows, doorbell=False)
    if claimable:
        sessions = [rows[index][0] for index, _, _ in claimable]
        tx.execute(
            "INSERT INTO session(id, time_created) SELECT value, ? FROM json_each(?) WHERE true"
            " ON CONFLICT(id) DO NOTHING",
            (tx.now, json.dumps(sessions)),
        )
        for index, _, attempts in claimable:
            results[index] = (None, Acquired(AcquireVerdict.CLAIM, attempt=attempts))
        _insert_claims(
            tx,
            [rows[index] for index, _, _ in claimable],
            [rows[i][0] for i, woken, _ in claimable if woken is not None],
        )
    return results


def _pg_acquired_row(args: tuple[Any, ...], row: tuple[Any, ...]) -> Acquired:
    return _pg_acquired(args[0], *row)


def _pg_woken_and_acquired(args: tuple[Any, ...], row: tuple[Any, ...]) -> tuple[None, Acquired]:
    return None, _pg_acquired(args[0], *row)


@caller_yields_next
@autocommit_when_alone
@skips_a_busy_session
@pg_batched("ts_acquire_many", _pg_acquired_row)
@sqlite_batched(_acquire_many)
def acquire(tx: Tx, session_id: str, execution_id: str, owner_id: str, lease_ms: int) -> Acquired:
    """Insert the claim only if no claim row exists, the session is not paused and the
    doorbell is set; take the doorbell. PostgreSQL: held, at once and with nothing written,
    when another transaction holds the session's lock (it claims the session, or signals
    it again once committed: a look then acquires)."""
    if tx.dialect == "postgres":
        args = (session_id, execution_id, owner_id, lease_ms)
        [row] = tx.call("ts_acquire", *args)
        return _pg_acquired_row(args, row)
    tx.lock_session(session_id)
    session = tx.one("SELECT time_woken, time_paused FROM session WHERE id = ?", (session_id,))
    claim = _claim_row(tx, session_id)
    verdict = _decisions.acquire_verdict(
        doorbell_set=session is not None and session[0] is not None,
        claim_row=claim,
        paused=session is not None and session[1] is not None,
    )
    if verdict is not AcquireVerdict.CLAIM:
        return Acquired(verdict, holder=None if claim is None else claim.owner_id)
    return _insert_claim(tx, session_id, execution_id, owner_id, lease_ms)


@caller_yields_next
@pg_batched("ts_wake_and_acquire_many", _pg_woken_and_acquired)
@sqlite_batched(_wake_and_acquire_many)
def wake_and_acquire(
    tx: Tx, session_id: str, execution_id: str, owner_id: str, lease_ms: int
) -> tuple[None, Acquired]:
    """`wake` and the acquire it rings for, in one transaction.

    When the claim is taken here, the doorbell is rung and taken at once, so it is never
    written: the same durable result with fewer pages per commit.
    """
    if tx.dialect == "postgres":
        args = (session_id, execution_id, owner_id, lease_ms)
        [row] = tx.call("ts_wake_and_acquire", *args, idempotent=False)
        return _pg_woken_and_acquired(args, row)
    tx.lock_session(session_id)
    claim = _claim_row(tx, session_id)
    if claim is not None:
        wake(tx, session_id)
        return None, Acquired(AcquireVerdict.HELD, holder=claim.owner_id)
    if _paused(tx, session_id):
        wake(tx, session_id)  # kept for `resume`
        return None, Acquired(AcquireVerdict.PAUSED)
    _ensure_session(tx, session_id)
    return None, _insert_claim(tx, session_id, execution_id, owner_id, lease_ms)


def _pg_submitted_and_acquired(args: tuple[Any, ...], row: tuple[Any, ...]) -> Any:
    """`ts_submit_and_acquire`'s row as `submit_and_acquire` answers; `FALLBACK` for an
    input id stored with another session or payload text, or a malformed input count
    (nothing was written)."""
    input_verdict, *acquired = row
    if input_verdict not in ("stored", "known"):
        return FALLBACK
    return args[2], _pg_acquired(args[0], *acquired)


def _submit_and_acquire_many(tx: Tx, rows: Sequence[tuple[Any, ...]]) -> list[Any]:
    """SQLite group commit, set-wise: the batch's `submit_and_acquire` jobs in a few
    statements.

    One read finds the sessions free to claim - no claim row, not paused - whose input id
    is new (pending, taken or set aside: none); for those, one statement of each kind
    writes the session rows, the inputs and the claims, and takes a doorbell that was
    already set, as the single path does with `ring=False`. Every other job - a held or
    paused session, a known or conflicting input id, a session or input id named twice -
    is `FALLBACK`, with nothing written for it: it runs on its own (`submit_and_acquire`)
    after these, under the same write lock, and sees their writes.
    """
    results: list[Any] = [FALLBACK] * len(rows)
    sessions: set[str] = set()
    input_ids: set[str] = set()
    candidates: list[int] = []
    for index, (session_id, _, input_id, _, _, _) in enumerate(rows):
        if session_id not in sessions and input_id not in input_ids:
            candidates.append(index)
        sessions.add(session_id)
        input_ids.add(input_id)
    free = tx.execute(
        "SELECT j.key, s.time_woken, s.wake_attempts FROM json_each(?) j"
        " LEFT JOIN session s ON s.id = json_extract(j.value, '$[0]')"
        f" WHERE s.time_paused IS NULL AND {_NO_SESSION_OR_WHOLE_ATTEMPTS}"
        f" AND {_NO_SESSION_OR_INPUT_SEQ_LEFT} AND NOT EXISTS"
        " (SELECT 1 FROM session_execution c WHERE c.session_id = json_extract(j.value, '$[0]'))"
        f" AND NOT {_input_id_stored(_JOB_INPUT_ID)}",
        (json.dumps([(rows[index][0], rows[index][2]) for index in candidates]),),
    ).fetchall()
    if not free:
        return results
    claims = []
    rung = []
    for key, time_woken, attempts in free:
        index = candidates[key]
        session_id, payload, input_id, execution_id, owner_id, lease_ms = rows[index]
        claims.append((session_id, payload, input_id, execution_id, owner_id, lease_ms))
        if time_woken is not None:
            rung.append(session_id)
        attempt = wake_attempts_of(session_id, attempts)
        results[index] = (input_id, Acquired(AcquireVerdict.CLAIM, attempt=attempt))
    claimed = json.dumps(claims)
    # The session row (created, or its input count bumped; the doorbell untouched), then
    # the input at that count, as `_insert_input(ring=False)` does one by one.
    tx.execute(
        "INSERT INTO session(id, time_created, time_woken, wakes, input_seq)"
        " SELECT json_extract(value, '$[0]'), ?, NULL, 0, 1 FROM json_each(?) WHERE true"
        " ON CONFLICT(id) DO UPDATE SET input_seq = session.input_seq + 1",
        (tx.now, claimed),
    )
    tx.execute(
        "INSERT INTO session_input(id, session_id, seq, payload, time_created)"
        " SELECT json_extract(j.value, '$[2]'), s.id, s.input_seq,"
        " json_extract(j.value, '$[1]'), ? FROM json_each(?) j"
        " JOIN session s ON s.id = json_extract(j.value, '$[0]')",
        (tx.now, claimed),
    )
    _insert_claims(tx, [(row[0], *row[3:]) for row in claims], rung)
    return results


@caller_yields_next
@autocommit_when_alone
@pg_batched("ts_submit_and_acquire_many", _pg_submitted_and_acquired, call_ids=True)
@sqlite_batched(_submit_and_acquire_many)
def submit_and_acquire(
    tx: Tx,
    session_id: str,
    payload: str,
    input_id: str,
    execution_id: str,
    owner_id: str,
    lease_ms: int,
) -> tuple[str, Acquired]:
    """`submit` and the acquire it rings for, in one transaction (see `wake_and_acquire`)."""
    if tx.dialect == "postgres":
        args = (session_id, payload, input_id, execution_id, owner_id, lease_ms)
        [row] = tx.call("ts_submit_and_acquire", *args, tx.call_id)
        result = _pg_submitted_and_acquired(args, row)
        if result is not FALLBACK:
            return result  # type: ignore[no-any-return]
        # Another session's id, or another payload text: nothing was written; the path
        # below decides (in a transaction).
    tx.lock_session(session_id)
    # SQLite: the common case in one read; anything else is read again, one question at a
    # time, where a known input id gets its answer (`_known_input`: also a retry's).
    if (tx.dialect == "sqlite" and _free_and_new(tx, session_id, input_id)) or (
        _claim_row(tx, session_id) is None
        and not _known_input(tx, session_id, input_id, payload)
        and not _paused(tx, session_id)
    ):
        session = _insert_input(tx, session_id, payload, input_id, ring=False)
        return input_id, _insert_claim(tx, session_id, execution_id, owner_id, lease_ms, session)
    stored = submit(tx, session_id, payload, input_id)
    return stored, acquire(tx, session_id, execution_id, owner_id, lease_ms)


def _free_and_new(tx: Tx, session_id: str, input_id: str) -> bool:
    """Whether the session has no claim row and is not paused, and the input id is stored
    nowhere (pending, taken or set aside): the three reads of `submit_and_acquire`'s
    careful path in one statement, which reads no stored text. False says only that one of
    them is not so: that path reads them again and answers."""
    [(busy,)] = tx.execute(
        "SELECT EXISTS (SELECT 1 FROM session_execution WHERE session_id = :session)"
        " OR EXISTS (SELECT 1 FROM session WHERE id = :session AND time_paused IS NOT NULL)"
        f" OR {_input_id_stored(':input')}",
        {"session": session_id, "input": input_id},
    ).fetchall()
    return not busy


def _input_id_stored(input_id: str) -> str:
    """SQL: whether the input id `input_id` (an SQL expression) is stored anywhere -
    pending, taken as a user message or set aside - the tables `_known_input` reads."""
    return (
        f"(EXISTS (SELECT 1 FROM session_input WHERE id = {input_id})"
        f" OR EXISTS (SELECT 1 FROM session_message WHERE input_id = {input_id})"
        f" OR EXISTS (SELECT 1 FROM session_input_rejected WHERE id = {input_id}))"
    )


def _pg_acquired(
    session_id: str, verdict: str, attempt: int | None, holder: str | None
) -> Acquired:
    """A PostgreSQL acquire verdict (`ts_acquire_locked`) as `Acquired`: 'busy' (another
    transaction holds the session: it claims it, or signals it again) as held."""
    if verdict == "busy":
        return Acquired(AcquireVerdict.HELD, locked=True)
    attempts = wake_attempts_of(session_id, attempt)
    return Acquired(AcquireVerdict(verdict), attempt=attempts, holder=holder)


def _insert_claim(
    tx: Tx,
    session_id: str,
    execution_id: str,
    owner_id: str,
    lease_ms: int,
    session: tuple[int | None, Any] | None = None,
) -> Acquired:
    """Insert the claim for a session known to have no claim row; take a set doorbell.

    `session` is the session's (time_woken, wake_attempts) when this transaction already
    read them; `anchor_seq` is the newest message seq, read in the insert itself."""
    if session is None:
        session = tx.one(
            "SELECT time_woken, wake_attempts FROM session WHERE id = ?", (session_id,)
        )
    time_woken, attempts = session
    tx.execute(
        "INSERT INTO session_execution"
        "(id, session_id, owner_id, phase, anchor_seq, time_created, heartbeat_at, expires_at)"
        " VALUES (?, ?, ?, 'running',"
        " (SELECT MAX(seq) FROM session_message WHERE session_id = ?), ?, NULL, ?)",
        (execution_id, session_id, owner_id, session_id, tx.now, tx.now + lease_ms),
    )
    if time_woken is not None:
        _take_doorbell(tx, session_id)
    return Acquired(AcquireVerdict.CLAIM, attempt=wake_attempts_of(session_id, attempts))


def _pg_acquire_many(
    name: str, single: str, what: str, ready: str, create: str, *, skip_busy: bool
) -> str:
    """The DDL of `name`, the set-wise form of `single` (an acquire of one session, taking
    (session, exec, owner, lease)): the first job of each session whose session is free to
    claim (no claim row, not paused) and `ready` (SQL on the session row `s`) takes its
    claim in one statement, `create` (CTEs on `free`) first; every other job goes through
    `single` one by one after it, in the lock order (none touches a session the statement
    wrote). `skip_busy`: a session whose lock another transaction holds is answered 'busy'
    at once (as `single` answers it), not waited for."""
    if skip_busy:
        # Not an f-string: braces are written once here (`'{}'`), escaped in the one below.
        locks = """    -- Held by another execution: answered without the lock (as if run just
    -- before whatever moves that claim). A lock another transaction holds is never
    -- waited for: its holder claims the session or signals it again.
    SELECT COALESCE(array_agg(u.n), '{}'), array_agg(c.owner_id) INTO v_skip, v_holders
        FROM unnest(p_sessions, p_execs) WITH ORDINALITY AS u(s, e, n)
        JOIN session_execution c ON c.session_id = u.s AND c.id <> u.e;
    RETURN QUERY SELECT h.n, 'held', NULL::bigint, h.o FROM unnest(v_skip, v_holders) AS h(n, o);
    v_busy := ARRAY(SELECT DISTINCT u.s FROM unnest(p_sessions) WITH ORDINALITY AS u(s, n)
                    -- CASE: the lock is tried only for a session not answered above.
                    WHERE CASE WHEN u.n = ANY(v_skip) THEN false
                               ELSE NOT ts_try_lock(u.s) END);
    v_busy_jobs := ARRAY(SELECT u.n FROM unnest(p_sessions) WITH ORDINALITY AS u(s, n)
                         WHERE u.s = ANY(v_busy) AND NOT u.n = ANY(v_skip));
    RETURN QUERY SELECT b, 'busy', NULL::bigint, NULL::text FROM unnest(v_busy_jobs) AS b;
    v_skip := v_skip || v_busy_jobs;"""
        lock_order = (
            "a session another execution holds answered held at once, then each session's"
            "\n-- lock if free (a busy one answered at once)"
        )
    else:
        locks = "    PERFORM ts_lock_all(p_sessions);"
        lock_order = "every session lock first, in the functions' order (ts_lock_key, id)"
    return f"""
-- Group commit, set-wise: one call for a batch's {single} jobs, each answered as {single}
-- answers it: {lock_order}, then the clock. The first job of each session free to claim
-- (no claim row, not paused) is settled for the whole batch by one statement - {what};
-- every other job (a held, paused or unrung session, a session's later jobs) goes through
-- {single} one by one after it, in the lock order.
CREATE OR REPLACE FUNCTION {name}(p_sessions text[], p_execs text[], p_owners text[],
    p_leases bigint[], p_now bigint, p_retry boolean)
RETURNS TABLE(ord bigint, verdict text, attempt bigint, holder text)
LANGUAGE plpgsql VOLATILE
@GENERIC_PLAN@ AS $$
DECLARE
    v_now bigint; v_ords bigint[]; v_attempts bigint[]; r record; v_busy text[];
    v_skip bigint[] := '{{}}'; v_holders text[]; v_busy_jobs bigint[];
BEGIN
{locks}
    v_now := ts_now(p_now);
    WITH job AS (
        SELECT u.s, u.e, u.o, u.l, u.n,
            row_number() OVER (PARTITION BY u.s ORDER BY u.n) AS nth
        FROM unnest(p_sessions, p_execs, p_owners, p_leases)
            WITH ORDINALITY AS u(s, e, o, l, n)
        WHERE NOT u.n = ANY(v_skip)),
    free AS MATERIALIZED (
        SELECT j.s, j.e, j.o, j.l, j.n, s.id IS NULL AS absent, s.time_woken,
            COALESCE(s.wake_attempts, 0) AS wake_attempts
        FROM job j LEFT JOIN session s ON s.id = j.s
        WHERE j.nth = 1 AND s.time_paused IS NULL AND {ready}
            AND NOT EXISTS (SELECT 1 FROM session_execution c WHERE c.session_id = j.s)),
{create}    taken AS (
        UPDATE session s SET time_woken = NULL, wakes = 0 FROM free f
        WHERE s.id = f.s AND f.time_woken IS NOT NULL),
    claims AS (
        INSERT INTO session_execution(id, session_id, owner_id, phase, anchor_seq,
                time_created, heartbeat_at, expires_at)
            SELECT f.e, f.s, f.o, 'running',
                (SELECT MAX(m.seq) FROM session_message m WHERE m.session_id = f.s),
                v_now, NULL, v_now + f.l
            FROM free f)
    SELECT array_agg(f.n), array_agg(f.wake_attempts) INTO v_ords, v_attempts FROM free f;
    RETURN QUERY SELECT u.n, 'claim', u.a, NULL::text FROM unnest(v_ords, v_attempts) AS u(n, a);
    FOR r IN SELECT u.s, u.e, u.o, u.l, u.n
             FROM unnest(p_sessions, p_execs, p_owners, p_leases)
                 WITH ORDINALITY AS u(s, e, o, l, n)
             WHERE NOT u.n = ANY(COALESCE(v_ords, '{{}}')) AND NOT u.n = ANY(v_skip)
             ORDER BY ts_lock_key(u.s), u.s, u.n LOOP
        SELECT r.n, f.verdict, f.attempt, f.holder INTO ord, verdict, attempt, holder
            FROM {single}(r.s, r.e, r.o, r.l, p_now, p_retry) f;
        RETURN NEXT;
    END LOOP;
END $$;
"""


# ---------------------------------------------------------------------------------------------
# PostgreSQL: this family's server-side functions (created by `_schema`'s migrations; see
# `_store.pg_functions` for their conventions)

PG_FUNCTIONS = (
    r"""
-- Under the session lock: insert the claim only if no claim row exists for the session
-- (never an overwrite), the session is not paused and the doorbell is set (p_doorbell: the
-- caller rang it in this same call), and take the doorbell. Verdicts: claim (attempt),
-- held (holder), paused, no_doorbell. A
-- claim row carrying this very execution id is this call's own, landed before a lost reply.
CREATE OR REPLACE FUNCTION ts_acquire_locked(p_session text, p_exec text, p_owner text,
    p_lease bigint, p_at bigint, p_doorbell boolean,
    OUT verdict text, OUT attempt bigint, OUT holder text)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_claim text; v_woken bigint; v_paused bigint;
BEGIN
    SELECT c.id, c.owner_id INTO v_claim, holder FROM session_execution c
        WHERE c.session_id = p_session;
    IF FOUND THEN
        IF v_claim = p_exec THEN
            verdict := 'claim';
            holder := NULL;
            SELECT s.wake_attempts INTO attempt FROM session s WHERE s.id = p_session;
        ELSE
            verdict := 'held';
        END IF;
        RETURN;
    END IF;
    SELECT s.time_woken, s.wake_attempts, s.time_paused INTO v_woken, attempt, v_paused
        FROM session s WHERE s.id = p_session;
    IF FOUND AND v_paused IS NOT NULL THEN
        verdict := 'paused';  -- the doorbell stays set for resume
        attempt := NULL;
        RETURN;
    END IF;
    IF NOT FOUND OR (v_woken IS NULL AND NOT p_doorbell) THEN
        verdict := 'no_doorbell';
        attempt := NULL;
        RETURN;
    END IF;
    INSERT INTO session_execution(id, session_id, owner_id, phase, anchor_seq, time_created,
            heartbeat_at, expires_at)
        VALUES (p_exec, p_session, p_owner, 'running',
            (SELECT MAX(m.seq) FROM session_message m WHERE m.session_id = p_session),
            p_at, NULL, p_at + p_lease);
    IF v_woken IS NOT NULL THEN
        UPDATE session SET time_woken = NULL, wakes = 0 WHERE id = p_session;
    END IF;
    verdict := 'claim';
END $$;

-- acquire (see ts_acquire_locked); 'held' without the lock when another execution holds
-- the session, and 'busy' (nothing written) when another transaction holds its lock: that
-- one claims the session, or signals it again once committed.
-- Idempotent by execution id.
CREATE OR REPLACE FUNCTION ts_acquire(p_session text, p_exec text, p_owner text,
    p_lease bigint, p_now bigint, p_retry boolean,
    OUT verdict text, OUT attempt bigint, OUT holder text)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_now bigint;
BEGIN
    -- Held by another execution: answered without the lock (as if this ran just before
    -- whatever moves that claim). A busy lock: never waited for.
    SELECT c.owner_id INTO holder FROM session_execution c
        WHERE c.session_id = p_session AND c.id <> p_exec;
    IF FOUND THEN
        verdict := 'held';
        RETURN;
    END IF;
    IF NOT ts_try_lock(p_session) THEN
        verdict := 'busy';
        RETURN;
    END IF;
    v_now := ts_now(p_now);
    SELECT a.verdict, a.attempt, a.holder INTO verdict, attempt, holder
        FROM ts_acquire_locked(p_session, p_exec, p_owner, p_lease, v_now, false) a;
END $$;

-- submit and the acquire it rings for, in one call: when the claim is taken here the
-- doorbell is rung and taken at once, so it is never written. Input verdicts as ts_submit
-- (other_*, malformed: nothing written, no acquire); then the acquire's. Idempotent by input id and
-- execution id; p_call: the call's own id (ts_known_input).
CREATE OR REPLACE FUNCTION ts_submit_and_acquire(p_session text, p_payload text,
    p_input text, p_exec text, p_owner text, p_lease bigint, p_call text, p_now bigint,
    p_retry boolean,
    OUT input_verdict text, OUT verdict text, OUT attempt bigint, OUT holder text)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_now bigint; v_held boolean;
BEGIN
    v_now := ts_lock_now(p_session, p_now);
    input_verdict := ts_known_input(p_session, p_input, p_payload, p_call, p_retry);
    IF input_verdict IN ('other_session', 'other_payload') THEN
        RETURN;
    END IF;
    v_held := EXISTS (SELECT 1 FROM session_execution c WHERE c.session_id = p_session)
        OR EXISTS (SELECT 1 FROM session s WHERE s.id = p_session
                   AND s.time_paused IS NOT NULL);
    IF input_verdict IS NULL THEN
        -- Rung only if a claim already holds the session (or it is paused: kept for
        -- resume): else the claim below takes it. Another session's input of this id,
        -- stored meanwhile: answered as above, nothing written.
        input_verdict := ts_insert_input(p_session, p_payload, p_input, p_call, v_held, NULL,
            v_now, p_retry);
        IF input_verdict IN ('other_session', 'other_payload', 'malformed') THEN
            RETURN;
        END IF;
    END IF;
    SELECT a.verdict, a.attempt, a.holder INTO verdict, attempt, holder
        FROM ts_acquire_locked(p_session, p_exec, p_owner, p_lease, v_now,
                               input_verdict = 'stored') a;
END $$;

-- wake and the acquire it rings for: a claim taken here takes the wake at once.
CREATE OR REPLACE FUNCTION ts_wake_and_acquire(p_session text, p_exec text, p_owner text,
    p_lease bigint, p_now bigint, p_retry boolean,
    OUT verdict text, OUT attempt bigint, OUT holder text)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_now bigint;
BEGIN
    v_now := ts_lock_now(p_session, p_now);
    IF EXISTS (SELECT 1 FROM session_execution c WHERE c.session_id = p_session
               AND c.id <> p_exec)
            OR EXISTS (SELECT 1 FROM session s WHERE s.id = p_session
                       AND s.time_paused IS NOT NULL) THEN
        -- Held by another claim, or paused (kept for resume): the wake is recorded.
        PERFORM ts_signal(p_session);
        INSERT INTO session AS s (id, time_created, time_woken, wakes)
            VALUES (p_session, v_now, v_now, 1)
            ON CONFLICT (id) DO UPDATE SET time_woken = COALESCE(s.time_woken, v_now),
                wakes = s.wakes + 1;
    ELSE
        INSERT INTO session(id, time_created) VALUES (p_session, v_now)
            ON CONFLICT (id) DO NOTHING;
    END IF;
    SELECT a.verdict, a.attempt, a.holder INTO verdict, attempt, holder
        FROM ts_acquire_locked(p_session, p_exec, p_owner, p_lease, v_now, true) a;
END $$;

"""
    + _pg_acquire_many(
        "ts_acquire_many",
        "ts_acquire",
        "acquire: its doorbell set, so the claim takes it",
        "s.id IS NOT NULL AND s.time_woken IS NOT NULL",
        "",
        skip_busy=True,
    )
    + _pg_acquire_many(
        "ts_wake_and_acquire_many",
        "ts_wake_and_acquire",
        "wake_and_acquire: the session row created if absent, and a doorbell already set\n"
        "-- taken by the claim (the wake itself is never written)",
        "true",
        """    created AS (
        INSERT INTO session(id, time_created) SELECT f.s, v_now FROM free f
            WHERE f.absent ON CONFLICT (id) DO NOTHING),
""",
        skip_busy=False,
    )
    + r"""
-- Group commit, set-wise: one call for a batch's submit_and_acquire jobs, each answered as
-- ts_submit_and_acquire answers it. Every session lock first, in the functions' order
-- (ts_lock_key, id), then the clock. The common job - the first of its session in the batch,
-- its input id new (pending, taken or set aside: none) and named once in the batch, the
-- session free to claim (no claim row, not paused), its input count from 0 - is settled for
-- the whole batch by one statement, as ts_submit_and_acquire settles it: the session row
-- written (created, or its input count bumped), the input stored unrung, the claim
-- inserted and a doorbell already set taken. Every other job (a held or paused session, a
-- known or conflicting input id, a session's later jobs, an input id named twice, an input
-- count below 0: ts_insert_input refuses it) goes through ts_submit_and_acquire one by
-- one after it, in the lock order: none of them touches a session or input id the
-- statement wrote, so each sees what it would have seen run after it alone.
CREATE OR REPLACE FUNCTION ts_submit_and_acquire_many(p_sessions text[], p_payloads text[],
    p_inputs text[], p_execs text[], p_owners text[], p_leases bigint[], p_calls text[],
    p_now bigint, p_retry boolean)
RETURNS TABLE(ord bigint, input_verdict text, verdict text, attempt bigint, holder text)
LANGUAGE plpgsql VOLATILE
@GENERIC_PLAN@ AS $$
DECLARE
    v_now bigint; v_ords bigint[]; v_attempts bigint[]; r record;
BEGIN
    PERFORM ts_lock_all(p_sessions);
    v_now := ts_now(p_now);
    WITH job AS (
        SELECT u.s, u.p, u.i, u.e, u.o, u.l, u.c, u.n,
            row_number() OVER (PARTITION BY u.s ORDER BY u.n) AS nth,
            count(*) OVER (PARTITION BY u.i) AS named
        FROM unnest(p_sessions, p_payloads, p_inputs, p_execs, p_owners, p_leases, p_calls)
            WITH ORDINALITY AS u(s, p, i, e, o, l, c, n)),
    free AS MATERIALIZED (
        SELECT j.s, j.p, j.i, j.e, j.o, j.l, j.c, j.n, s.time_woken,
            COALESCE(s.wake_attempts, 0) AS wake_attempts,
            COALESCE(s.input_seq, 0) + 1 AS input_seq
        FROM job j LEFT JOIN session s ON s.id = j.s
        WHERE j.nth = 1 AND j.named = 1 AND s.time_paused IS NULL
            AND COALESCE(s.input_seq, 0) >= 0
            AND NOT EXISTS (SELECT 1 FROM session_execution c WHERE c.session_id = j.s)
            AND NOT EXISTS (SELECT 1 FROM session_input i WHERE i.id = j.i)
            AND NOT EXISTS (SELECT 1 FROM session_message m WHERE m.input_id = j.i)
            AND NOT EXISTS (SELECT 1 FROM session_input_rejected x WHERE x.id = j.i)),
    -- As ts_insert_input(..., p_ring => false), then the claim's taking of a set doorbell.
    -- The input's seq is the session's count as read above plus one: the session lock
    -- keeps it from moving meanwhile (every writer of a session row holds it). The inputs
    -- go first, and only those stored write their session and claim: another session's
    -- input of the same id, uncommitted when read above, is waited for by the primary key
    -- alone, and its job goes through ts_submit_and_acquire (nothing written here).
    inputs AS (
        INSERT INTO session_input(id, session_id, seq, payload, time_created, call_id)
            SELECT f.i, f.s, f.input_seq, f.p, v_now, f.c FROM free f
            ON CONFLICT (id) DO NOTHING
            RETURNING id),
    stored AS (SELECT f.* FROM free f JOIN inputs i ON i.id = f.i),
    sessions AS (
        INSERT INTO session AS s (id, time_created, time_woken, wakes, input_seq)
            SELECT f.s, v_now, NULL, 0, 1 FROM stored f
            ON CONFLICT (id) DO UPDATE SET input_seq = s.input_seq + 1, time_woken = NULL,
                wakes = CASE WHEN s.time_woken IS NULL THEN s.wakes ELSE 0 END),
    claims AS (
        INSERT INTO session_execution(id, session_id, owner_id, phase, anchor_seq,
                time_created, heartbeat_at, expires_at)
            SELECT f.e, f.s, f.o, 'running',
                (SELECT MAX(m.seq) FROM session_message m WHERE m.session_id = f.s),
                v_now, NULL, v_now + f.l
            FROM stored f)
    SELECT array_agg(f.n), array_agg(f.wake_attempts) INTO v_ords, v_attempts FROM stored f;
    RETURN QUERY SELECT u.n, 'stored', 'claim', u.a, NULL::text
        FROM unnest(v_ords, v_attempts) AS u(n, a);
    FOR r IN SELECT u.s, u.p, u.i, u.e, u.o, u.l, u.c, u.n
             FROM unnest(p_sessions, p_payloads, p_inputs, p_execs, p_owners, p_leases,
                         p_calls) WITH ORDINALITY AS u(s, p, i, e, o, l, c, n)
             WHERE NOT u.n = ANY(COALESCE(v_ords, '{}'))
             ORDER BY ts_lock_key(u.s), u.s, u.n LOOP
        SELECT r.n, f.input_verdict, f.verdict, f.attempt, f.holder
            INTO ord, input_verdict, verdict, attempt, holder
            FROM ts_submit_and_acquire(r.s, r.p, r.i, r.e, r.o, r.l, r.c, p_now, p_retry) f;
        RETURN NEXT;
    END LOOP;
END $$;
"""
)
