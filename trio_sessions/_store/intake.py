"""Taking inputs: the oldest due pending inputs of the claim's session become user messages of
its execution (`take_inputs`), one chunk per transaction.

Invariants kept here:
* under the claim fence (`_require_claim_session`): an execution that lost its claim takes
  nothing, and `LeaseLost` says so with nothing written; a claim marked cancelling takes
  nothing either (its successor will);
* an input is either pending in `session_input` or a user message, never both, never none:
  the messages are written and the inputs deleted in one transaction, in seq order;
* an input that does not decode to a JSON object never blocks those behind it: it is set
  aside in `session_input_rejected`, raw text and reason kept;
* scheduled inputs not yet due stay pending, unseen; when more due inputs remain than one
  chunk takes, the doorbell is rung, so none is stranded;
* a take returns the user messages it appended (`Taken`: id, seq, data as stored), so the
  runtime offers them to its local watchers before any reply to them (DESIGN §5).
"""

from __future__ import annotations

import itertools
from typing import Any

import attrs

from .. import _codec
from .._backend import Tx
from .._errors import MalformedRecord
from .._model import Input
from .._validate import MAX_INT64
from .common import (
    _IN_CHUNK,
    DUE,
    _lease_lost,
    _next_message_seq,
    _require_claim_session,
    _ring,
    as_stored,
    new_id,
)

# The most inputs one `take_inputs` takes unless told: one transaction of a few ms on the
# event loop however large the backlog (DESIGN §6.26); a drain calls again for the rest.
TAKE_INPUTS_CHUNK = 200


@attrs.frozen
class Taken(Input):
    """An input taken, and the user message it became (`text`: its data as stored). Two
    takes are equal when they took the same inputs into the same places: a message's id
    is random."""

    message_id: str = attrs.field(eq=False)
    seq: int
    text: str


class FastTakeRefused(Exception):
    """PostgreSQL's fast take (`ts_take_inputs`) took an input whose payload the codec
    refuses though the server's JSON check passed it (a lone surrogate escape): raised
    inside the operation, so its transaction - the inputs moved - is rolled back; the
    caller takes again with `fast=False`, the library's own path, which sets that input
    aside. Deliberately no `MalformedRecord`: nothing is wrong with what stays stored."""


def take_inputs(
    tx: Tx,
    session_id: str,
    execution_id: str,
    owner_id: str,
    limit: int = TAKE_INPUTS_CHUNK,
    fast: bool = True,
) -> list[Taken]:
    """Consume the oldest `limit` due pending inputs in seq order, appending each as a user
    message (claim fence); returns them with their messages. Scheduled inputs not yet due
    by the lease clock stay pending, unseen. When more due ones are pending, the doorbell
    is rung, so the rest are taken by a further call or by the busy period's next
    iteration - never stranded.

    An input whose payload does not decode to a JSON object never blocks the ones behind
    it: it moves to `session_input_rejected` (raw text and reason kept for the operator).
    PostgreSQL's server-side take runs first unless `fast` is False; it leaves such inputs
    to this path, or, for one only the codec refuses, raises `FastTakeRefused`.
    A claim marked cancelling takes nothing: its drain is being interrupted, and the
    inputs are left for the successor its cleanup rings for (DESIGN §5.1, on_busy).
    """
    if tx.dialect == "postgres" and fast:
        found = tx.call(
            "ts_take_inputs", session_id, execution_id, owner_id, limit, idempotent=False
        )
        if found[0][0] == "lease_lost":
            raise _lease_lost(execution_id)
        if found[0][0] == "ok":
            try:
                return [
                    Taken(
                        key,
                        _codec.decode_object(payload, table="session_input", key=key),
                        message_id,
                        seq,
                        payload,
                    )
                    for _, key, payload, message_id, seq in found[1:]
                ]
            except MalformedRecord as exc:
                raise FastTakeRefused(str(exc)) from None
        # mixed: some input of the chunk is not a plain JSON object; nothing was written,
        # the path below sets such inputs aside.
    claimed = _require_claim_session(tx, session_id, execution_id, owner_id)
    if claimed.phase == "cancelling":
        return []
    tx.notify(session_id, watchers_only=True)
    due = {"session": session_id, "now": tx.now}
    # One more than the chunk, to learn whether any are left without counting them (within
    # SQLite's integers: no session holds 2**63-1 inputs). On SQLite the payload is read as
    # bytes: one that is not UTF-8 is set aside below.
    rows = tx.execute(
        f"SELECT id, seq, {as_stored(tx, 'payload')} FROM session_input"
        f" WHERE session_id = :session AND {DUE} ORDER BY seq LIMIT :limit",
        {**due, "limit": min(limit, MAX_INT64 - 1) + 1},
    ).fetchall()
    more = len(rows) > limit
    rows = rows[:limit]
    taken = []
    messages: list[tuple[Any, ...]] = []
    seq = _next_message_seq(tx, session_id, len(rows))
    for input_id, input_seq, kind, stored in rows:
        try:
            text = _codec.stored_text(kind, stored, table="session_input", key=input_id)
            decoded = _codec.decode_object(text, table="session_input", key=input_id)
        except MalformedRecord as exc:
            tx.execute(
                "INSERT INTO session_input_rejected(id, session_id, seq, payload, reason,"
                " time_created) VALUES (?, ?, ?, ?, ?, ?)",
                (input_id, session_id, input_seq, _codec.shown_text(stored), str(exc), tx.now),
            )
            continue
        message_id = new_id()
        taken.append(Taken(input_id, decoded, message_id, seq, text))
        messages.append((message_id, session_id, execution_id, input_id, seq, text, tx.now, tx.now))
        seq += 1
    # A few multi-row statements for the whole chunk, not one per input.
    per_statement = _IN_CHUNK // 8  # eight parameters per row
    for start in range(0, len(messages), per_statement):
        batch = messages[start : start + per_statement]
        tx.execute(
            "INSERT INTO session_message(id, session_id, execution_id, input_id, role, seq, data,"
            " time_created, time_updated, finished) VALUES "
            + ", ".join(["(?, ?, ?, ?, 'user', ?, ?, ?, ?, 1)"] * len(batch)),
            tuple(itertools.chain.from_iterable(batch)),
        )
    if rows:
        # Due ones only: a scheduled input among them stays for its time.
        tx.execute(
            f"DELETE FROM session_input WHERE session_id = :session AND seq <= :last AND {DUE}",
            {**due, "last": rows[-1][1]},
        )
    if more:
        _ring(tx, session_id)
    return taken


def inputs_taken_by(
    tx: Tx, session_id: str, execution_id: str, owner_id: str, offset: int
) -> list[tuple[str, Any]]:
    """This claim's user messages - (input id, data as stored), in seq order - from
    position `offset` on, under the claim fence: among them, what a `take_inputs` whose
    outcome is unknown (`OutcomeUnknown`, DESIGN §8 "Uncertain commits") took if it
    landed, for the drain never given them (the caller decodes those it gives: an earlier
    message that does not decode never blocks the read-back). Only `take_inputs` writes
    user messages of an execution."""
    _require_claim_session(tx, session_id, execution_id, owner_id)
    rows = tx.execute(
        "SELECT input_id, data FROM session_message"
        " WHERE session_id = ? AND execution_id = ? AND role = 'user'"
        " ORDER BY seq LIMIT 9223372036854775807 OFFSET ?",
        (session_id, execution_id, offset),
    ).fetchall()
    return [(str(key), data) for key, data in rows]


# ---------------------------------------------------------------------------------------------
# PostgreSQL: this family's server-side functions (created by `_schema`'s migrations; see
# `_store.pg_functions` for their conventions)

PG_FUNCTIONS = r"""
-- Whether an input's payload is certainly a JSON object the library's codec accepts: the
-- fast path of ts_take_inputs takes only such inputs, and leaves every other case (not
-- JSON, not an object, and the few JSON texts Python's codec refuses: floats beyond the
-- double range, nesting deeper than its recursion limit) to the library's own path.
CREATE OR REPLACE FUNCTION ts_json_object(p_payload text) RETURNS boolean
LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    RETURN json_typeof(p_payload::json) = 'object';
EXCEPTION WHEN invalid_text_representation THEN
    RETURN false;
END $$;

CREATE OR REPLACE FUNCTION ts_plain_object(p_payload text) RETURNS boolean
LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    IF p_payload ~ '[0-9][eE]\+?[0-9]{3}' OR p_payload ~ '[0-9]{255}'
            OR length(p_payload) - length(translate(p_payload, '[{', '')) > 500 THEN
        RETURN false;
    END IF;
    IF current_setting('server_version_num')::int < 160000 THEN
        RETURN ts_json_object(p_payload);  -- a subtransaction per input: older servers only
    END IF;
    RETURN pg_input_is_valid(p_payload, 'json') AND json_typeof(p_payload::json) = 'object';
END $$;

-- take_inputs' fast path: the oldest p_limit due inputs of the claim's session become user
-- messages of this execution, in seq order, if each is a plain JSON object
-- (ts_plain_object); when more due inputs remain, the doorbell is rung (as `_ring`), so
-- they are never stranded. Rows: first (verdict, NULL, NULL) - ok, lease_lost, or mixed
-- (nothing written: the caller's own path sets the others aside) - then (NULL, input id,
-- payload, message id, seq) per input taken, the user message it became. Not idempotent:
-- a lost reply is read back by the transaction's id.
CREATE OR REPLACE FUNCTION ts_take_inputs(p_session text, p_exec text, p_owner text,
    p_limit bigint, p_now bigint, p_retry boolean)
RETURNS TABLE(verdict text, input_id text, payload text, message_id text, seq bigint)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_session text; v_now bigint; v_seq bigint; v_more boolean;
BEGIN
    SELECT l.session_id, l.now INTO v_session, v_now
        FROM ts_lock_execution(p_session, p_exec, p_now) l;
    IF v_session IS NULL OR NOT ts_holds(p_exec, p_owner, v_now) THEN
        RETURN QUERY SELECT 'lease_lost', NULL::text, NULL::text, NULL::text, NULL::bigint;
        RETURN;
    END IF;
    -- A claim marked cancelling takes nothing: its successor does.
    IF EXISTS (SELECT 1 FROM session_execution c WHERE c.id = p_exec
               AND c.phase = 'cancelling') THEN
        RETURN QUERY SELECT 'ok', NULL::text, NULL::text, NULL::text, NULL::bigint;
        RETURN;
    END IF;
    -- Only due inputs (scheduled ones once their time has come), the oldest p_limit.
    IF EXISTS (SELECT 1 FROM (SELECT i.payload FROM session_input i
                              WHERE i.session_id = v_session
                              AND (i.due_at IS NULL OR i.due_at <= v_now)
                              ORDER BY i.seq LIMIT p_limit) c
               WHERE NOT ts_plain_object(c.payload)) THEN
        RETURN QUERY SELECT 'mixed', NULL::text, NULL::text, NULL::text, NULL::bigint;
        RETURN;
    END IF;
    v_more := EXISTS (SELECT 1 FROM session_input i WHERE i.session_id = v_session
                      AND (i.due_at IS NULL OR i.due_at <= v_now)
                      ORDER BY i.seq OFFSET p_limit LIMIT 1);
    SELECT COALESCE(MAX(m.seq), 0) INTO v_seq FROM session_message m
        WHERE m.session_id = v_session;
    RETURN QUERY SELECT 'ok', NULL::text, NULL::text, NULL::text, NULL::bigint;
    RETURN QUERY
    WITH chunk AS (
        SELECT i.seq FROM session_input i WHERE i.session_id = v_session
            AND (i.due_at IS NULL OR i.due_at <= v_now)
            ORDER BY i.seq LIMIT p_limit),
    taken AS (
        DELETE FROM session_input i USING chunk k
            WHERE i.session_id = v_session AND i.seq = k.seq
        RETURNING i.id, i.seq, i.payload),
    ordered AS (
        SELECT t.id, t.payload, v_seq + row_number() OVER (ORDER BY t.seq) AS seq FROM taken t),
    added AS (
        INSERT INTO session_message(id, session_id, execution_id, input_id, role, seq, data,
                time_created, time_updated, finished)
            SELECT lpad(to_hex(v_now), 12, '0')
                    || substr(md5(random()::text || clock_timestamp()::text || o.id), 1, 20),
                v_session, p_exec, o.id, 'user', o.seq, o.payload, v_now, v_now, 1
            FROM ordered o
            RETURNING session_message.input_id, session_message.data, session_message.id,
                session_message.seq)
    SELECT NULL::text, a.input_id, a.data, a.id, a.seq FROM added a ORDER BY a.seq;
    IF FOUND THEN
        PERFORM ts_signal_watchers(v_session);
    END IF;
    IF v_more THEN
        PERFORM ts_ring(v_session, v_now);
    END IF;
END $$;
"""
