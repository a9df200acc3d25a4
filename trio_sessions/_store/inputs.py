"""Admission: the durable doorbell (`wake`) and idempotent inputs (`submit`).

Invariants kept here:
* an input id is stored once: the same id and payload for the same session writes nothing
  (pending, taken or set aside); another session or another payload is `InputConflict` -
  also for a submit racing another session's of the same id, answered once that one ends
  (session locks do not order them: the input's primary key does);
* an input is either pending in `session_input` or a user message, never both, never none
  (`intake.take_inputs` moves it);
* every write here takes the session lock first, and rings the change signal.
"""

from __future__ import annotations

import json
from typing import Any

from .. import _codec
from .._backend import FALLBACK, Tx, autocommit_when_alone, pg_batched
from .._errors import InputConflict
from .common import bumped_input_seq, counted_input_seq, pg_set_wise


def wake(tx: Tx, session_id: str) -> None:
    """Durable doorbell: create the session if absent, set `time_woken` (if unset), count it."""
    if tx.dialect == "postgres":
        tx.call("ts_wake", session_id, idempotent=False)
        return
    tx.lock_session(session_id)
    tx.notify(session_id)
    tx.execute(
        "INSERT INTO session(id, time_created, time_woken, wakes) VALUES (?, ?, ?, 1)"
        " ON CONFLICT(id) DO UPDATE SET time_woken = COALESCE(session.time_woken, ?),"
        " wakes = session.wakes + 1",
        (session_id, tx.now, tx.now, tx.now),
    )


def _pg_submitted(args: tuple[Any, ...], row: tuple[Any, ...]) -> Any:
    """`ts_submit`'s verdict as `submit` answers; `FALLBACK` for another session's input id,
    another payload text or a malformed input count (nothing was written: the path in
    Python decides, or refuses it)."""
    (verdict,) = row
    return args[2] if verdict in ("stored", "known") else FALLBACK


@autocommit_when_alone
@pg_batched("ts_submits", _pg_submitted, autocommit=True, call_ids=True)
def submit(tx: Tx, session_id: str, payload: str, input_id: str) -> str:
    """Admit an input and ring the doorbell, idempotently by `input_id`.

    The same id and payload for the same session returns the stored id and writes nothing,
    also after the input was taken; the same id for another session, or with another
    payload, raises `InputConflict`.
    """
    if tx.dialect == "postgres":
        [row] = tx.call("ts_submit", session_id, payload, input_id, tx.call_id)
        if _pg_submitted((session_id, payload, input_id), row) is not FALLBACK:
            return input_id
        # Another session's id, or another payload text (maybe the same JSON value):
        # nothing was written; the path below decides (in a transaction).
    tx.lock_session(session_id)
    if not _known_input(tx, session_id, input_id, payload):
        _insert_input(tx, session_id, payload, input_id, ring=True)
    return input_id


def _known_input(tx: Tx, session_id: str, input_id: str, payload: str) -> bool:
    """Whether the input id is stored (pending, taken or set aside); `InputConflict` for
    another session or another payload (compared as JSON values, not as text)."""
    known = tx.one(
        "SELECT session_id, payload FROM session_input WHERE id = ?"
        " UNION ALL SELECT session_id, data FROM session_message WHERE input_id = ?"
        " UNION ALL SELECT session_id, payload FROM session_input_rejected WHERE id = ?"
        " LIMIT 1",
        (input_id, input_id, input_id),
    )
    if known is None:
        return False
    if known[0] != session_id:
        raise InputConflict(
            f"input id {input_id!r} belongs to session {known[0]!r}, not {session_id!r}"
        )
    if known[1] != payload and _canonical(known[1]) != _canonical(payload):
        raise InputConflict(
            f"input id {input_id!r} of session {session_id!r} was stored with another payload"
        )
    return True


def _canonical(text: str) -> str | None:
    """One spelling per JSON value (key order and spacing ignored; 1 and 1.0 differ)."""
    try:
        return json.dumps(_codec.loads(text), sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError):
        return None  # malformed: equal to nothing


def _insert_input(
    tx: Tx, session_id: str, payload: str, input_id: str, *, ring: bool
) -> tuple[int | None, Any]:
    """Insert a pending input; `ring=False` when a claim inserted in this same transaction
    takes the wake at once (so the doorbell is never written). Returns the session's
    doorbell and resume count as they are now and as stored (for the claim that may follow,
    which reads the count: `wake_attempts_of`; a submit that takes no claim stores its input
    whatever the count holds)."""
    doorbell = tx.now if ring else None
    if ring:
        tx.notify(session_id)
    row = tx.one(
        "INSERT INTO session(id, time_created, time_woken, wakes, input_seq)"
        " VALUES (?, ?, ?, ?, 1)"
        " ON CONFLICT(id) DO UPDATE SET time_woken = COALESCE(session.time_woken, ?),"
        f" wakes = session.wakes + ?, input_seq = {bumped_input_seq(tx)}"
        " RETURNING input_seq, time_woken, wake_attempts",
        (session_id, tx.now, doorbell, int(ring), doorbell, int(ring)),
    )
    seq = counted_input_seq(session_id, row[0])
    # PostgreSQL: the caller's check under its session lock cannot see another session's
    # uncommitted input of this id (ids are unique across sessions, locks are per session);
    # only the primary key makes this insert wait for it. Once that one committed, its
    # verdict is read back: `InputConflict`, which rolls this transaction back whole.
    while not tx.execute(
        "INSERT INTO session_input(id, session_id, seq, payload, time_created)"
        " VALUES (?, ?, ?, ?, ?) ON CONFLICT(id) DO NOTHING",
        (input_id, session_id, seq, payload, tx.now),
    ).rowcount:
        if _known_input(tx, session_id, input_id, payload):
            break  # stored for this session, with this payload, after all
        # Gone again before the read (withdrawn, its session deleted): insert it now.
    return row[1], row[2]


def _ensure_session(tx: Tx, session_id: str) -> None:
    tx.execute(
        "INSERT INTO session(id, time_created) VALUES (?, ?) ON CONFLICT(id) DO NOTHING",
        (session_id, tx.now),
    )


# ---------------------------------------------------------------------------------------------
# PostgreSQL: this family's server-side functions (created by `_schema`'s migrations; see
# `_store.pg_functions` for their conventions)

PG_FUNCTIONS = r"""
-- Under the session lock: is the input id stored (pending, taken or set aside)? NULL: no;
-- known (same session, same payload text); other_session; other_payload (the caller
-- compares the payloads as JSON values). A call again after a lost reply (p_retry) also
-- finds its lost call's input cancelled since (`ts_cancel_input`'s trace): known. A
-- first call never does - a cancelled id is forgotten, and a submit with it stores anew -
-- and nor does a call again whose lost call never ran: the trace must name this call
-- (p_call, `Job.call_id`), not an earlier submit's of the same id and payload. The trace
-- keeps no payload (the text a user took back): a call again carries its call's payload.
CREATE OR REPLACE FUNCTION ts_known_input(p_session text, p_input text, p_payload text,
    p_call text, p_retry boolean)
RETURNS text
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_session text; v_payload text;
BEGIN
    SELECT k.session_id, k.payload INTO v_session, v_payload FROM (
        SELECT i.session_id, i.payload FROM session_input i WHERE i.id = p_input
        UNION ALL SELECT m.session_id, m.data FROM session_message m WHERE m.input_id = p_input
        UNION ALL SELECT r.session_id, r.payload FROM session_input_rejected r
            WHERE r.id = p_input
        LIMIT 1) k;
    IF NOT FOUND THEN
        RETURN CASE WHEN p_retry AND EXISTS (SELECT 1 FROM session_input_cancelled c
            WHERE c.id = p_input AND c.session_id = p_session AND c.call_id = p_call)
            THEN 'known' END;
    END IF;
    RETURN CASE WHEN v_session <> p_session THEN 'other_session'
                WHEN v_payload = p_payload THEN 'known' ELSE 'other_payload' END;
END $$;

-- Store a pending input of the call p_call, under its session's lock; p_ring: set the
-- doorbell and count the wake (false when a claim inserted in the same call takes the wake
-- at once); p_due: when a scheduled input is due (NULL: now; it rings nothing, and its signal
-- lets every runtime re-arm its due timer). Verdicts: stored; or, nothing written, the
-- verdict of ts_known_input on the input another transaction stored meanwhile, or
-- malformed: the session's input count is below 0 (another tool's write), so the input
-- would be stored ahead of those waiting - the caller's path in Python then refuses it with
-- `MalformedRecord` naming the session (`counted_input_seq`), as on SQLite. The caller's
-- check under its session lock cannot see another session's uncommitted input of this id
-- (ids are unique across sessions, locks are per session): only the primary key makes this
-- insert wait for it. So the input goes first, ON CONFLICT DO NOTHING, and the session row
-- only after it, in the same statement (the input's foreign key is checked at its end); a
-- conflict reads the committed input back (a statement of its own: a new snapshot) and
-- answers as a call run after that one.
CREATE OR REPLACE FUNCTION ts_insert_input(p_session text, p_payload text, p_input text,
    p_call text, p_ring boolean, p_due bigint, p_at bigint, p_retry boolean)
RETURNS text
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_seq bigint; v_doorbell bigint := CASE WHEN p_ring THEN p_at END; v_known text;
BEGIN
    -- The session lock keeps its input count from moving meanwhile.
    SELECT COALESCE(max(s.input_seq), 0) + 1 INTO v_seq FROM session s WHERE s.id = p_session;
    IF v_seq < 1 THEN
        RETURN 'malformed';
    END IF;
    LOOP
        WITH input AS (
            INSERT INTO session_input(id, session_id, seq, payload, time_created, due_at,
                    call_id)
                VALUES (p_input, p_session, v_seq, p_payload, p_at, p_due, p_call)
                ON CONFLICT (id) DO NOTHING
                RETURNING session_id)
        INSERT INTO session AS s (id, time_created, time_woken, wakes, input_seq)
            SELECT i.session_id, p_at, v_doorbell, p_ring::int, v_seq FROM input i
            ON CONFLICT (id) DO UPDATE SET time_woken = COALESCE(s.time_woken, v_doorbell),
                wakes = s.wakes + p_ring::int, input_seq = EXCLUDED.input_seq;
        IF FOUND THEN
            IF p_ring OR p_due IS NOT NULL THEN
                PERFORM ts_signal(p_session);
            END IF;
            RETURN 'stored';
        END IF;
        v_known := ts_known_input(p_session, p_input, p_payload, p_call, p_retry);
        IF v_known IS NOT NULL THEN
            RETURN v_known;
        END IF;
        -- Gone again before the read (withdrawn, its session deleted): insert it now.
    END LOOP;
END $$;

-- submit: store the input and ring the doorbell, idempotently by input id. Verdicts:
-- stored, known, other_session, other_payload (ts_known_input; nothing written). p_call:
-- the call's own id, the same in each attempt (ts_known_input). Nothing stored (a client's
-- retry of its POST, which comes when workers acquire): the session signalled if an
-- acquire waits for it (ts_signal_waiting).
CREATE OR REPLACE FUNCTION ts_submit(p_session text, p_payload text, p_input text,
    p_call text, p_now bigint, p_retry boolean)
RETURNS text
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_now bigint; v_known text;
BEGIN
    v_now := ts_lock_now(p_session, p_now);
    v_known := ts_known_input(p_session, p_input, p_payload, p_call, p_retry);
    IF v_known IS NULL THEN
        v_known := ts_insert_input(p_session, p_payload, p_input, p_call, true, NULL, v_now,
            p_retry);
    END IF;
    IF v_known <> 'stored' THEN
        PERFORM ts_signal_waiting(p_session);
    END IF;
    RETURN v_known;
END $$;

-- wake: the durable doorbell (create the session if absent, set time_woken, count it).
CREATE OR REPLACE FUNCTION ts_wake(p_session text, p_now bigint, p_retry boolean)
RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_now bigint;
BEGIN
    v_now := ts_lock_now(p_session, p_now);
    PERFORM ts_signal(p_session);
    INSERT INTO session AS s (id, time_created, time_woken, wakes)
        VALUES (p_session, v_now, v_now, 1)
        ON CONFLICT (id) DO UPDATE SET time_woken = COALESCE(s.time_woken, v_now),
            wakes = s.wakes + 1;
END $$;
""" + pg_set_wise(
    "ts_submits",
    "ts_submit",
    [("session", "text"), ("payload", "text"), ("input", "text"), ("call", "text")],
    [("verdict", "text")],
)
