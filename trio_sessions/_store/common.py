"""What every family of store operations shares: the fences, the session's small reads and
writes, ids and IN lists.

Invariants kept here:
* the *claim fence* (`CLAIM_FENCE`) is the exact execution, held by this owner, on a live
  lease; `_require_claim` checks it, with the session the drain names (`SESSION_FENCE`),
  under that session's lock, held to COMMIT, so nothing can move the claim before the
  writes that follow commit; a fence that matches nothing raises `LeaseLost` with nothing
  written;
* the *recovery fence* (`RECOVERY_FENCE`) is the exact old execution, still expired - or
  held by an owner found gone (liveness token free) in the same transaction;
* `tx.now` is read after the operation's locks (`_fence` reads it when called);
* an IN list never carries more than `_IN_CHUNK` parameters (below both dialects' limits).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

import attrs

from .. import _codec
from .._backend import RANDOM_BITS, Cursor, Tx
from .._decisions import ClaimRow
from .._errors import LeaseLost, MalformedRecord
from .._validate import MAX_INT64

# The claim fence: the exact execution, held by this owner, on a live lease. Every write a
# drain makes carries it - in the WHERE clause of the write, or checked by `_require_claim`
# under the session lock before the writes that follow.
_CLAIM_FENCE_OF = "{t}id = :execution AND {t}owner_id = :owner AND {t}expires_at > :now"
CLAIM_FENCE = _CLAIM_FENCE_OF.format(t="")
# A drain's writes name their session (the drain context holds it): the lock is taken on it
# at once, and the claim must be that session's, with no read to look it up first.
SESSION_FENCE = "{t}session_id = :session AND " + _CLAIM_FENCE_OF
# The recovery fence: the exact old execution, still expired - or held by an owner found
# gone in this very transaction (its liveness token free: `tx.free_tokens`).
RECOVERY_FENCE = "id = :execution AND (expires_at <= :now OR owner_id = :gone_owner)"


def _fence(
    tx: Tx, execution_id: str, owner_id: str | None = None, gone_owner: str | None = None
) -> dict[str, Any]:
    return {"execution": execution_id, "owner": owner_id, "now": tx.now, "gone_owner": gone_owner}


def _session_fence(tx: Tx, session_id: str, execution_id: str, owner_id: str) -> dict[str, Any]:
    return {**_fence(tx, execution_id, owner_id), "session": session_id}


def _lease_lost(execution_id: str) -> LeaseLost:
    return LeaseLost(f"execution {execution_id!r} no longer holds a live claim")


def _no_longer_expired(execution_id: str) -> LeaseLost:
    return LeaseLost(f"execution {execution_id!r} is no longer an expired claim")


def new_id() -> str:
    """32 hex digits: the wall-clock millisecond (48 bits), then 80 random bits.

    Ids made later sort later, so new rows keyed by them land on the rightmost pages of
    their b-trees instead of on random ones: a commit writes a few pages, not one per row
    (a recovery pass replacing 100 claims commits in half the time). Unique as a random
    id: 80 random bits within each millisecond.
    """
    # As f"{ms:012x}{bits:020x}", in half the time (an id or two per claim).
    bits = (time.time_ns() // 1_000_000 << 80) | RANDOM_BITS.getrandbits(80)
    return bits.to_bytes(16, "big").hex()


# Parameters per IN list: well below SQLite's and PostgreSQL's limits.
_IN_CHUNK = 500

T = TypeVar("T")


def _chunks(values: Sequence[T]) -> Iterable[Sequence[T]]:
    for start in range(0, len(values), _IN_CHUNK):
        yield values[start : start + _IN_CHUNK]


def streamed_texts_of(tx: Tx, message_ids: Sequence[str]) -> dict[Any, list[Any]]:
    """The texts streamed onto each of these messages, in version order, keyed by the
    message id as the store returns it: one statement per `_IN_CHUNK` of them."""
    streamed: dict[Any, list[Any]] = {}
    for chunk in _chunks(message_ids):
        for message_id, version, text in tx.execute(
            "SELECT message_id, version, text FROM session_message_delta"
            f" WHERE message_id IN {_in_list(chunk)} ORDER BY message_id, version",
            tuple(chunk),
        ).fetchall():
            streamed.setdefault(message_id, []).append(_codec.streamed_text(version, text))
    return streamed


def leading_rows(rows: Cursor, *, count: int, size_bytes: int) -> tuple[list[Sequence[Any]], bool]:
    """`leading` of a cursor's rows, the cursor then closed, so no statement stays open on
    the connection. From a lazy cursor (SQLite's) no row after the first one left out is
    fetched."""
    try:
        return leading(rows, count=count, size_bytes=size_bytes)
    finally:
        rows.close()


def leading(
    rows: Iterable[Sequence[Any]], *, count: int, size_bytes: int
) -> tuple[list[Sequence[Any]], bool]:
    """The leading rows of `rows` - each ending in its size, which is dropped - up to
    `count` of them and about `size_bytes` (at least one), and whether any were left. A
    read whose result is decoded on the event loop stays one short step that way, however
    large its messages."""
    kept: list[Sequence[Any]] = []
    size = 0
    for row in rows:
        size += int(row[-1] or 0)
        if len(kept) == count or (kept and size > size_bytes):
            return kept, True
        kept.append(row[:-1])
    return kept, False


# What fetching, copying or deleting one message or input costs the event loop's budget
# (`_codec.loop_budget`). Measured here: SQLite reads, copies or deletes a message with its
# index entries (and its streamed text's rows) in 5-9 us, so the budget's 256 Ki units -
# 15-20 ms of decoding - take about 2,000 rows on the loop; a longer conversation goes to
# the worker thread.
ROW_UNITS = 128
# And the text a copied or deleted row holds, a unit per this many characters: SQLite
# copied 20 MB of messages in ~90 ms here (4.4 ns a byte; a delete ~2.5 ns), and a unit
# is ~65 ns - a margin for characters of several bytes. A conversation of 150 answers of
# 200 KB each is 150 rows, but ~140 ms of the loop to fork.
CHARS_PER_UNIT = 4


def spend_rows(tx: Tx, params: Any, *rows: str) -> None:
    """On the event loop (a budget set: SQLite's executor runs a batch there when the write
    lock is free), spend what the rows the operation will touch cost, before it touches
    any: the copy or delete of a long conversation, or of one holding large messages,
    raises `_codec.OffTheLoop`, and the executor runs it again in its worker thread
    (§6.26: no loop step over 50 ms). `rows`: each `length(column) FROM ... WHERE ...` -
    the rows and the stored text each holds - charged `ROW_UNITS` a row and a unit per
    `CHARS_PER_UNIT` characters, in turn and no further than the budget reaches (a
    200,000-input backlog costs no full count on the loop; no row is read after the one
    that overspends it), and not at all once the ones before filled it: a later one's
    read may cost more than its limit - an open answer's streamed text, `message_id IN
    (SELECT id ...)`, gathers every message id of the session first (200,000 of them:
    ~130 ms). Anywhere else (a worker thread, PostgreSQL's functions) nothing is
    counted."""
    left = _codec.budget_left()
    if left is None:
        return
    spent = 0
    for sized in rows:
        cursor = tx.execute(f"SELECT {sized} LIMIT {(left - spent) // ROW_UNITS + 1}", params)
        try:
            for (size,) in cursor:
                spent += ROW_UNITS + (size if type(size) is int else 0) // CHARS_PER_UNIT
                if spent > left:
                    break
        finally:
            cursor.close()
        if spent > left:
            break
    _codec.spend(spent)


def fetched_on_budget(rows: Cursor) -> list[Any]:
    """Every row of `rows`, each charged `ROW_UNITS` of the loop's budget as it is fetched,
    where one is set: a read of many short messages raises `_codec.OffTheLoop` (nothing to
    roll back) and runs again in the worker thread, however little text they hold. The
    cursor is closed, so no statement stays open on the connection."""
    if _codec.budget_left() is None:
        return rows.fetchall()
    fetched = []
    try:
        for row in rows:
            _codec.spend(ROW_UNITS)
            fetched.append(row)
    finally:
        rows.close()
    return fetched


def _in_list(values: Sequence[Any]) -> str:
    return "(" + ", ".join("?" * len(values)) + ")"


def _claim_row(tx: Tx, session_id: str) -> ClaimRow | None:
    row = tx.one(
        "SELECT id, owner_id, phase, expires_at FROM session_execution WHERE session_id = ?",
        (session_id,),
    )
    return None if row is None else ClaimRow(*row)


def _require_claim(tx: Tx, session_id: str, execution_id: str, owner_id: str) -> None:
    """The claim fence (of this session) for writes to other tables.

    Checked under the session lock, held to COMMIT, so nobody can move the claim before the
    writes that follow commit.
    """
    _require_claim_session(tx, session_id, execution_id, owner_id)


@attrs.frozen
class _ClaimedSession:
    """What the claim fence read about the claim's session, under the session lock (a wake
    serialises on that lock, so none of it can move before COMMIT)."""

    session_id: str
    doorbell: bool
    wake_attempts: int
    phase: str = "running"  # the claim's: 'cancelling' once an interrupt was requested
    paused: bool = False
    # Whether the execution has a message meeting the caller's `open_messages` condition
    # (True when none was asked: the caller reads them itself).
    open_messages: bool = True


PHASES = ("running", "cancelling")


def unknown_phase(execution_id: str, phase: Any) -> MalformedRecord | None:
    """The claim's `MalformedRecord` when its phase is neither of `PHASES`: past the CHECK
    (SQLite, `PRAGMA ignore_check_constraints`), another tool's write. Whether a
    cancellation was asked for cannot be told, so neither recovery (it never resumes such a
    claim) nor a drain's end (it never continues one) decides on it."""
    if phase in PHASES:
        return None
    reasons = [f"phase is {phase!r:.60}, not 'running' or 'cancelling'"]
    return MalformedRecord("session_execution", str(execution_id), reasons)


def _require_claim_session(
    tx: Tx, session_id: str, execution_id: str, owner_id: str, open_messages: str = ""
) -> _ClaimedSession:
    """`_require_claim`, reading the session's doorbell, resume count and pause, and the
    claim's phase, in the same statement - and with `open_messages` (a condition on
    `session_message` columns: an ending's `OPEN_ASSISTANT`), whether any message of the
    execution meets it, so an ending with none open reads them no further."""
    tx.lock_session(session_id)
    exists = (
        f", EXISTS (SELECT 1 FROM session_message WHERE execution_id = c.id AND {open_messages})"
        if open_messages
        else ", TRUE"
    )
    row = tx.one(
        f"SELECT s.time_woken, s.wake_attempts, c.phase, s.time_paused{exists}"
        " FROM session_execution c"
        f" JOIN session s ON s.id = c.session_id WHERE {SESSION_FENCE.format(t='c.')}",
        _session_fence(tx, session_id, execution_id, owner_id),
    )
    if row is None:
        raise _lease_lost(execution_id)
    return _ClaimedSession(
        session_id,
        row[0] is not None,
        wake_attempts_of(session_id, row[1]),
        str(row[2]),
        row[3] is not None,
        bool(row[4]),
    )


def wake_attempts_of(session_id: str, stored: Any) -> int:
    """A session's `wake_attempts` as read (None, from a session with no row yet: 0). One
    that is no integer - SQLite keeps the text another tool writes, and its CHECK
    `wake_attempts >= 0` holds for text - raises `MalformedRecord` naming the session, not
    a bare `ValueError` from `int()` (§5) nor a silent truncation of a REAL."""
    if stored is None:
        return 0
    if type(stored) is not int:
        reasons = [f"wake_attempts is {stored!r}, not an integer"]
        raise MalformedRecord("session", session_id, reasons)
    return stored


def whole_number(tx: Tx, column: str) -> str:
    """A condition that passes over a row whose integer `column` holds anything else (SQLite
    keeps whatever another tool writes; PostgreSQL's column is typed), for the scans over
    every session: each such row would fail its claim attempt (`wake_attempts_of`) on every
    pass and use up the pass's budget. `status` lists such a row as malformed."""
    return f"typeof({column}) = 'integer'" if tx.dialect == "sqlite" else "TRUE"


def _newest_seq(tx: Tx, session_id: str) -> int | None:
    """The session's newest message seq (None: no message), or `MalformedRecord` naming the
    message when it is no integer (SQLite keeps the text or REAL another tool writes, and
    its MAX puts text after every number): `int()` of it was a bare `ValueError`, or a REAL
    cut down to a seq that may clash or go back."""
    [(newest,)] = tx.execute(
        "SELECT MAX(seq) FROM session_message WHERE session_id = ?", (session_id,)
    ).fetchall()
    if newest is None or type(newest) is int:
        return newest
    key = _message_at(tx, session_id, newest)
    raise MalformedRecord("session_message", key, [f"seq {newest!r} is no whole number"])


def _next_message_seq(tx: Tx, session_id: str, count: int = 1) -> int:
    """The seq of the session's next message - the first of the next `count` - or
    `MalformedRecord` naming the newest message when it, written by another tool, leaves no
    room for them below the largest 64-bit integer: PostgreSQL refuses such a seq ('bigint
    out of range', a `StoreError`), SQLite's driver with a bare `OverflowError` (§6.20)."""
    newest = _newest_seq(tx, session_id) or 0
    if newest > MAX_INT64 - count:
        reasons = [f"seq out of range: no room for {count} more after {newest}"]
        raise MalformedRecord("session_message", _message_at(tx, session_id, newest), reasons)
    return newest + 1


def bumped_input_seq(tx: Tx) -> str:
    """The upsert's new `input_seq` of a session row (`session.input_seq + 1`), read back by
    `counted_input_seq`. SQLite adds 1 to text or a blob as to 0 (`'abc' + 1` is 1), which
    would store the next input at seq 1 - ahead of the inputs already waiting, or clashing
    with one: a count that is no integer is kept as it is, for `counted_input_seq` to
    refuse. PostgreSQL's column is typed."""
    if tx.dialect == "sqlite":
        return (
            "CASE WHEN typeof(session.input_seq) = 'integer' THEN session.input_seq + 1"
            " ELSE session.input_seq END"
        )
    return "session.input_seq + 1"


def counted_input_seq(session_id: str, counted: Any) -> int:
    """The seq a new input takes: the session's `input_seq` as its count just bumped it
    (`RETURNING`, `bumped_input_seq`). SQLite turns a count past the largest 64-bit integer
    into a REAL (9.223372036854776e+18: every later input at that seq, their order lost) and
    keeps whatever another tool writes; PostgreSQL refuses the bump ('bigint out of range', a
    `StoreError`). Anything but an integer from 1 is `MalformedRecord` naming the session
    (the first input takes seq 1: a count below it, written by another tool, would store
    the input ahead of those waiting), raised inside the operation, so its writes are
    rolled back with it (§6.20)."""
    if type(counted) is int and counted >= 1:
        return counted
    if type(counted) is int:
        reason = f"input_seq is {counted - 1}, below 0: the next input would take seq {counted}"
    elif isinstance(counted, float) and counted > MAX_INT64:
        reason = f"input_seq out of range: no seq is left for another input after {MAX_INT64}"
    else:
        reason = f"input_seq is {counted!r:.60}, no whole number"
    raise MalformedRecord("session", session_id, [reason])


def _message_at(tx: Tx, session_id: str, seq: Any) -> str:
    """The id of the session's message at `seq` (as stored), to name it in a
    `MalformedRecord`; "?" if it went meanwhile."""
    row = tx.one(
        "SELECT id FROM session_message WHERE session_id = ? AND seq = ?", (session_id, seq)
    )
    return "?" if row is None else str(row[0])


# An input `take_inputs` may take now: due (scheduled ones once their time has come).
DUE = "(due_at IS NULL OR due_at <= :now)"


def _has_pending_inputs(tx: Tx, session_id: str) -> bool:
    """Whether due inputs wait untaken (scheduled ones not yet due do not count: the due
    timer rings for them)."""
    return (
        tx.one(
            f"SELECT 1 FROM session_input WHERE session_id = :session AND {DUE} LIMIT 1",
            {"session": session_id, "now": tx.now},
        )
        is not None
    )


def _paused(tx: Tx, session_id: str) -> bool:
    row = tx.one("SELECT time_paused FROM session WHERE id = ?", (session_id,))
    return row is not None and row[0] is not None


def _doorbell_set(tx: Tx, session_id: str) -> bool:
    row = tx.one("SELECT time_woken FROM session WHERE id = ?", (session_id,))
    return row is not None and row[0] is not None


def _ring(tx: Tx, session_id: str) -> None:
    _ring_all(tx, [session_id])


def _ring_all(tx: Tx, session_ids: Sequence[str]) -> None:
    """Ring these sessions' doorbells in one statement (signalled each)."""
    for session_id in session_ids:
        tx.notify(session_id)
    tx.execute(
        "UPDATE session SET time_woken = COALESCE(time_woken, ?), wakes = wakes + 1"
        f" WHERE id IN {_in_list(session_ids)}",
        (tx.now, *session_ids),
    )


def _written(tx: Tx, session_id: str) -> None:
    """A write that leaves no newer row or time of its own (messages truncated or set
    aside, an input withdrawn, the pause lifted): `purge` counts it (`time_written`)."""
    tx.execute("UPDATE session SET time_written = ? WHERE id = ?", (tx.now, session_id))


def _take_doorbell(tx: Tx, session_id: str) -> None:
    tx.execute("UPDATE session SET time_woken = NULL, wakes = 0 WHERE id = ?", (session_id,))


def _reset_attempts(tx: Tx, session_id: str) -> None:
    # Conditional, so the common case (already 0) dirties no page.
    tx.execute(
        "UPDATE session SET wake_attempts = 0 WHERE id = ? AND wake_attempts != 0", (session_id,)
    )


def readable(tx: Tx, column: str) -> str:
    """A condition that passes over a row whose `column` is not UTF-8 text, for the scans
    over every session: no Python str names such an id (another tool's write: SQLite
    keeps whatever bytes it is given as TEXT), and the driver would refuse the scan's
    whole read. `status` lists such a row as malformed. PostgreSQL keeps no such text."""
    return f"ts_utf8(CAST({column} AS BLOB))" if tx.dialect == "sqlite" else "TRUE"


def placed(number: Any) -> int:
    """A message's seq or version, read to place it in a watcher's or a stream's order. One
    that is no whole number (SQLite keeps what another tool writes) goes last, where
    SQLite's ORDER BY puts text (a REAL it orders by value; placed last too): its message
    is taken as the newest, which `transcript._decode_message` refuses, so the reader
    raises `MalformedRecord`, not a `ValueError` while placing it."""
    return number if type(number) is int else MAX_INT64


def as_stored(tx: Tx, column: str) -> str:
    """A text column as two: its type and its value, on SQLite as bytes (SQLite keeps
    whatever bytes another tool wrote as TEXT, and its driver refuses the whole read of a
    row that is not UTF-8; `_codec.stored_text` decodes them or names the row malformed)."""
    if tx.dialect == "sqlite":
        return f"typeof({column}), CAST({column} AS BLOB)"
    return f"'text', {column}"


def not_in(tx: Tx, column: str, values: Sequence[str]) -> tuple[str, Any]:
    """A `column NOT IN (values)` condition for one named parameter: returns the SQL
    fragment (naming `:excluded`) and the parameter's value, in the transaction's dialect
    (one parameter whatever the list's length: no IN list to chunk)."""
    if tx.dialect == "postgres":
        return f"NOT ({column} = ANY(:excluded))", list(values)
    return f"{column} NOT IN (SELECT value FROM json_each(:excluded))", json.dumps(list(values))


def pg_set_wise(
    name: str,
    single: str,
    params: Sequence[tuple[str, str]],
    returns: Sequence[tuple[str, str]],
    *,
    constants: str = "",
) -> str:
    """The DDL of `name`, group commit's set-wise form of the function `single`: one call for
    a batch's jobs of one kind, one array per parameter (`params`: name and element type, the
    session first, as `single` takes them; `constants` follow them in each call, then
    `p_now, p_retry`). Rows (ord, `returns`: names and types for `single`'s result columns,
    in its order - one for a function returning one value), taken in the sessions' lock
    order - (ts_lock_key, id), arrival order among equals - so two writers never deadlock on
    them and one session's jobs run in the order they were made. Called where no
    transaction defers the signals (in autocommit), it defers its rows' and sends them as
    one notification itself (`ts_flush_signals`)."""
    arrays = ", ".join(f"p_{param}s {kind}[]" for param, kind in params)
    columns = ", ".join(f"{column} {kind}" for column, kind in returns)
    fields = [f"u.a{index}" for index in range(len(params))]
    aliases = ", ".join(f"a{index}" for index in range(len(params)))
    values = [f"r.a{index}" for index in range(len(params))]
    call = ", ".join([*values, constants] if constants else values)
    outputs = ", ".join(column for column, _ in returns)
    return f"""
-- Group commit, set-wise: one call for a batch's {single} jobs (pg_set_wise).
CREATE OR REPLACE FUNCTION {name}({arrays}, p_now bigint, p_retry boolean)
RETURNS TABLE(ord bigint, {columns})
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    r record;
    v_flush boolean := current_setting('trio_sessions.defer_signals', true)
        IS DISTINCT FROM 'on';
BEGIN
    IF v_flush THEN
        PERFORM set_config('trio_sessions.defer_signals', 'on', true);
    END IF;
    FOR r IN SELECT {", ".join(fields)}, u.n
             FROM unnest({", ".join(f"p_{param}s" for param, _ in params)})
                 WITH ORDINALITY AS u({aliases}, n)
             ORDER BY ts_lock_key(u.a0), u.a0, u.n LOOP
        SELECT r.n, {", ".join(f"f.{column}" for column, _ in returns)} INTO ord, {outputs}
            FROM {single}({call}, p_now, p_retry) AS f({outputs});
        RETURN NEXT;
    END LOOP;
    IF v_flush THEN
        PERFORM ts_flush_signals('{{}}');
        PERFORM set_config('trio_sessions.defer_signals', 'off', true);
    END IF;
END $$;
"""


# ---------------------------------------------------------------------------------------------
# PostgreSQL: this family's server-side functions (created by `_schema`'s migrations; see
# `_store.pg_functions` for their conventions)

PG_FUNCTIONS = r"""
CREATE OR REPLACE FUNCTION ts_now(p_now bigint) RETURNS bigint
LANGUAGE sql VOLATILE AS $$
    SELECT COALESCE(p_now, floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint)
$$;

-- A session's lock key: 64 bits of a hash of its id, seeded with the library's namespace.
-- (A 32-bit key, hashtext's, was one lock for two ids among some 1e5, and two unrelated
-- sessions blocked each other; 64 bits make that one pair among some 5e9 ids.) Locks are
-- taken in this key's order, so two sessions sharing one never deadlock either.
CREATE OR REPLACE FUNCTION ts_lock_key(p_session text) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$ SELECT hashtextextended(p_session, @LOCK@) $$;

CREATE OR REPLACE FUNCTION ts_lock(p_session text) RETURNS void
LANGUAGE sql VOLATILE AS $$ SELECT pg_advisory_xact_lock(ts_lock_key(p_session)) $$;

-- The session lock if no other transaction holds it (never waits): an acquire from a
-- doorbell leaves a session another transaction is working on to that one, which claims it
-- or, once committed, signals it again.
CREATE OR REPLACE FUNCTION ts_try_lock(p_session text) RETURNS boolean
LANGUAGE sql VOLATILE AS $$ SELECT pg_try_advisory_xact_lock(ts_lock_key(p_session)) $$;

-- The session lock, then the clock read after it (the wait may have been long): an
-- operation's `now`.
CREATE OR REPLACE FUNCTION ts_lock_now(p_session text, p_now bigint) RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM ts_lock(p_session);
    RETURN ts_now(p_now);
END $$;

-- Whether due inputs wait untaken in the session - scheduled ones once their time has come
-- (`_has_pending_inputs`).
CREATE OR REPLACE FUNCTION ts_due_inputs(p_session text, p_now bigint) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT EXISTS (SELECT 1 FROM session_input i WHERE i.session_id = p_session
                   AND (i.due_at IS NULL OR i.due_at <= p_now))
$$;

-- Ring the session's doorbell, signalled (`_ring`).
CREATE OR REPLACE FUNCTION ts_ring(p_session text, p_now bigint) RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM ts_signal(p_session);
    UPDATE session SET time_woken = COALESCE(time_woken, p_now), wakes = wakes + 1
        WHERE id = p_session;
END $$;

-- Every session of a set-wise batch locked, in the order all functions take several
-- session locks in (their key, then the id), so two batches sharing sessions never deadlock.
CREATE OR REPLACE FUNCTION ts_lock_all(p_sessions text[]) RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM ts_lock(l.s) FROM (SELECT DISTINCT u.s FROM unnest(p_sessions) AS u(s)) l
        ORDER BY ts_lock_key(l.s), l.s;
END $$;

-- Signal a session's change to the other runtimes (DESIGN §8 "Notifications scale"): at
-- most one pg_notify per transaction. In autocommit a function notifies at once, with its
-- own session as the payload (an operation's calls signal the session it names:
-- duplicates within a transaction are dropped by the server). In a write transaction the
-- engine sets trio_sessions.defer_signals with its BEGIN: the session is added to the
-- transaction-local list trio_sessions.signals, one per line, which each call's reply
-- reads, and the engine sends the whole list in one notification once the transaction
-- committed, in a transaction of its own (ts_flush_signals). A set-wise function called in
-- autocommit defers its rows' signals the same way and sends them itself, in one
-- notification at its end (pg_set_wise).
CREATE OR REPLACE FUNCTION ts_signal(p_session text) RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_pending text;
BEGIN
    IF current_setting('trio_sessions.defer_signals', true) IS DISTINCT FROM 'on' THEN
        PERFORM pg_notify(@CHANNEL@, p_session);
        RETURN;
    END IF;
    v_pending := COALESCE(current_setting('trio_sessions.signals', true), '');
    IF position(E'\n' || p_session || E'\n' IN E'\n' || v_pending) = 0 THEN
        PERFORM set_config('trio_sessions.signals', v_pending || p_session || E'\n', true);
    END IF;
END $$;

-- Those of these sessions an acquire waits for: the doorbell set, no claim, not paused. An
-- acquire that met one's lock answered 'busy' (ts_acquire), and its runtime passes over that
-- doorbell until a signal names the session; an operation that took the lock and ends
-- without claiming or signalling it signals these (ts_signal_waiting here; the engine,
-- after a transaction, for the locks its own statements took: `SIGNAL_WAITING`).
CREATE OR REPLACE FUNCTION ts_waiting(p_sessions text[]) RETURNS text[]
LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN ARRAY(SELECT s.id FROM session s WHERE s.id = ANY(p_sessions)
        AND s.time_woken IS NOT NULL AND s.time_paused IS NULL
        AND NOT EXISTS (SELECT 1 FROM session_execution e WHERE e.session_id = s.id));
END $$;

CREATE OR REPLACE FUNCTION ts_signal_waiting(p_session text) RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    IF cardinality(ts_waiting(ARRAY[p_session])) > 0 THEN
        PERFORM ts_signal(p_session);
    END IF;
END $$;

-- A change only the session's watchers and streams need (its transcript): the session
-- behind a tab (ids are printable: never one of their characters), so a runtime that
-- follows no such session - a worker streaming another worker's tokens past it - skips
-- the look a doorbell would cost it.
CREATE OR REPLACE FUNCTION ts_signal_watchers(p_session text) RETURNS void
LANGUAGE sql VOLATILE AS $$ SELECT ts_signal(E'\t' || p_session) $$;

-- The one notification of a transaction: the sessions deferred by ts_signal (before its
-- COMMIT) or passed in (p_sessions: after it), each once, one per line - or the empty
-- payload, "look at everything" (as after a listener's reconnect), when they do not fit
-- a payload (under 8000 bytes). Nothing when there is nothing to signal. Returns how many
-- notifications it sent (0 or 1).
CREATE OR REPLACE FUNCTION ts_flush_signals(p_sessions text[]) RETURNS integer
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_sessions text[]; v_payload text;
BEGIN
    v_sessions := ARRAY(
        SELECT DISTINCT s FROM unnest(p_sessions || string_to_array(
            COALESCE(current_setting('trio_sessions.signals', true), ''), E'\n')) AS s
        WHERE s <> '');
    PERFORM set_config('trio_sessions.signals', '', true);
    IF cardinality(v_sessions) = 0 THEN
        RETURN 0;
    END IF;
    v_payload := array_to_string(v_sessions, E'\n');
    IF octet_length(v_payload) >= 8000 THEN
        v_payload := '';
    END IF;
    PERFORM pg_notify(@CHANNEL@, v_payload);
    RETURN 1;
END $$;

-- The session lock a drain's write names, taken at once, and the clock read after it;
-- session_id is that session when the execution's claim is of it, NULL otherwise (no claim
-- row carries this id, or it is another session's: the fence includes the session).
-- Every drain's function takes its lock here, and one whose claim is gone - a zombie's
-- write, answered lease_lost - signals the session when an acquire waits for it
-- (ts_signal_waiting): one that met this lock answered 'busy' and passed the doorbell over
-- until a signal. A claim row still there (expired, or another owner's) is a claim: no
-- acquire waits for its session. Nothing on the path of a write that holds its claim.
CREATE OR REPLACE FUNCTION ts_lock_execution(p_session text, p_exec text, p_now bigint,
    OUT session_id text, OUT now bigint)
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM ts_lock(p_session);
    SELECT c.session_id INTO ts_lock_execution.session_id
        FROM session_execution c WHERE c.id = p_exec AND c.session_id = p_session;
    now := ts_now(p_now);
    IF ts_lock_execution.session_id IS NULL THEN
        PERFORM ts_signal_waiting(p_session);
    END IF;
END $$;

-- The claim fence under the session lock: the exact execution, this owner, a live lease.
CREATE OR REPLACE FUNCTION ts_holds(p_exec text, p_owner text, p_now bigint) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT EXISTS (SELECT 1 FROM session_execution
                   WHERE id = p_exec AND owner_id = p_owner AND expires_at > p_now)
$$;
"""
