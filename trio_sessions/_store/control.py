"""Conversation control (DESIGN §5.1): what a chat product does around a running agent.

`submit` with `on_busy` and `delay`, scheduled inputs falling due, `cancel_input`, `pause`
and `resume`, `delete_session`, `purge`, `fork` and `truncate` - each one transaction,
written once for both dialects, each taking the session lock first (sorted, when it takes
several) so that on PostgreSQL nothing about the session moves before COMMIT. On
PostgreSQL `submit` with `on_busy` or `delay` (`submit_controlled`, `submit_scheduled`) is
one call of `ts_submit_controlled` - with the claim it rings for, when the runtime sends
one (`submit_controlled_and_acquire`), of `ts_submit_controlled_and_acquire` - alone in
autocommit: one round trip, read back by input id and execution id after a lost reply.

Invariants kept here:
* `on_busy="reject"` stores nothing when the session is busy (a claim exists, or due inputs
  wait untaken); `"interrupt"` stores the input and marks a running claim `cancelling` in
  the same transaction, so the claim's cleanup finds the input pending and re-arms the
  doorbell for exactly one successor;
* a scheduled input (`due_at` set) rings no doorbell and is invisible to `take_inputs`
  until due by the lease clock; promotion (`promote_due`) clears `due_at` and rings the
  doorbell in one transaction, so a due input is always either rung or still scheduled
  (the due timer and the recovery pass find it), never stranded;
* a paused session (`time_paused` set) keeps every input, wake and interrupt; the claim
  paths in `claims` refuse it and the doorbell scans skip it;
* `delete_session` removes every row of the session in one transaction, so a write of its
  old drain finds no claim (`LeaseLost`) - the claim fence is the only fence it needs;
* `fork` and `truncate` are single transactions: never half-copied, never half-truncated;
  `truncate` refuses while a claim is held (`SessionBusy`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from .. import _codec, _decisions, _transcript
from .._backend import FALLBACK, Tx, autocommit_when_alone, caller_yields_next
from .._decisions import SubmitVerdict
from .._errors import SessionBusy
from .._model import INTERRUPTED
from .acquisition import Acquired, _insert_claim, _pg_acquired, acquire
from .claims import _NOT_QUARANTINED, STOPPED_AFTER_EXPIRY
from .common import (
    _claim_row,
    _has_pending_inputs,
    _in_list,
    _paused,
    _ring,
    _ring_all,
    _written,
    as_stored,
    bumped_input_seq,
    counted_input_seq,
    new_id,
    readable,
    spend_rows,
)
from .inputs import _insert_input, _known_input
from .transcript import OPEN_ASSISTANT, _assistant_data

# ---------------------------------------------------------------------------------------------
# on_busy


def _busy_error(session_id: str) -> SessionBusy:
    return SessionBusy(f"session {session_id!r} is busy (a claim is held or inputs are pending)")


def _busy_verdict(tx: Tx, session_id: str, on_busy: str) -> SubmitVerdict:
    """What `on_busy` does here now (the session lock held); `SessionBusy` for a reject."""
    claim = _claim_row(tx, session_id)
    verdict = _decisions.submit_verdict(
        on_busy,
        claim_phase=None if claim is None else claim.phase,
        due_inputs_pending=claim is None and _has_pending_inputs(tx, session_id),
    )
    if verdict is SubmitVerdict.REJECT:
        raise _busy_error(session_id)
    return verdict


@autocommit_when_alone
def submit_controlled(
    tx: Tx, session_id: str, payload: str, input_id: str, on_busy: str
) -> tuple[str, str | None]:
    """`submit` with `on_busy` "reject" or "interrupt"; returns (input id, the execution id
    of the running claim it marked cancelling, if any: the caller stops that claim's drain
    if it is its own, and no other). A retry of an input already stored returns its id and
    writes nothing, busy or not."""
    if tx.dialect == "postgres":
        stored = _pg_submit_controlled(tx, session_id, payload, input_id, on_busy, 0)
        if stored is not None:
            return stored
    tx.lock_session(session_id)
    if _known_input(tx, session_id, input_id, payload):
        return input_id, None
    verdict = _busy_verdict(tx, session_id, on_busy)
    _insert_input(tx, session_id, payload, input_id, ring=True)
    if verdict is not SubmitVerdict.INTERRUPT:
        return input_id, None
    # Live or expired: an expired one is then finished by recovery as cancelled at once,
    # never resumed (`STOPPED_AFTER_EXPIRY`). Not a quarantined one: the quarantine's
    # actions decide it, as for `request_cancel`. The input's own notify signals the owner.
    row = tx.one(
        "UPDATE session_execution SET phase = 'cancelling',"
        f" handed_back = {STOPPED_AFTER_EXPIRY.format(now=':now')}"
        f" WHERE session_id = :session AND phase = 'running' AND {_NOT_QUARANTINED}"
        " RETURNING id",
        {"session": session_id, "now": tx.now},
    )
    return input_id, None if row is None else str(row[0])


@caller_yields_next
@autocommit_when_alone
def submit_controlled_and_acquire(
    tx: Tx,
    session_id: str,
    payload: str,
    input_id: str,
    on_busy: str,
    execution_id: str,
    owner_id: str,
    lease_ms: int,
) -> tuple[tuple[str, str | None], Acquired]:
    """`submit_controlled` and the acquire it rings for, in one transaction: with no claim
    and no due input pending, the claim takes the input's wake at once."""
    if tx.dialect == "postgres":
        args = (session_id, payload, input_id, on_busy, execution_id, owner_id, lease_ms)
        [row] = tx.call("ts_submit_controlled_and_acquire", *args, tx.call_id)
        result = _pg_controlled_and_acquired(session_id, input_id, row)
        if result is not FALLBACK:
            return result  # type: ignore[no-any-return]
        # Another session's id, or another payload text: nothing was written; the path
        # below decides (in a transaction).
    tx.lock_session(session_id)
    if (
        _claim_row(tx, session_id) is not None
        or _known_input(tx, session_id, input_id, payload)
        or _paused(tx, session_id)
        or _has_pending_inputs(tx, session_id)
    ):
        stored = submit_controlled(tx, session_id, payload, input_id, on_busy)
        return stored, acquire(tx, session_id, execution_id, owner_id, lease_ms)
    session = _insert_input(tx, session_id, payload, input_id, ring=False)
    return (input_id, None), _insert_claim(
        tx, session_id, execution_id, owner_id, lease_ms, session
    )


def _pg_controlled_and_acquired(session_id: str, input_id: str, row: tuple[Any, ...]) -> Any:
    """`ts_submit_controlled_and_acquire`'s row as `submit_controlled_and_acquire` answers
    (its input verdict as `_controlled_stored` reads it); `FALLBACK` for an input id stored
    with another session or payload text (nothing was written)."""
    verdict, *acquired = row
    stored = _controlled_stored(session_id, input_id, verdict)
    if stored is None:
        return FALLBACK
    return stored, _pg_acquired(session_id, *acquired)


# ---------------------------------------------------------------------------------------------
# Scheduled inputs


@autocommit_when_alone
def submit_scheduled(
    tx: Tx, session_id: str, payload: str, input_id: str, delay_ms: int, on_busy: str
) -> str:
    """Store an input due `delay_ms` from now by the lease clock; it rings no doorbell (the
    due timer promotes it). Idempotent by `input_id`; "reject" refuses a busy session."""
    if tx.dialect == "postgres" and (
        _pg_submit_controlled(tx, session_id, payload, input_id, on_busy, delay_ms) is not None
    ):
        return input_id
    tx.lock_session(session_id)
    if _known_input(tx, session_id, input_id, payload):
        return input_id
    if on_busy == "reject":
        _busy_verdict(tx, session_id, on_busy)
    # The signal lets every runtime re-arm its due timer from the store.
    tx.notify(session_id)
    row = tx.one(
        "INSERT INTO session(id, time_created, input_seq) VALUES (?, ?, 1)"
        f" ON CONFLICT(id) DO UPDATE SET input_seq = {bumped_input_seq(tx)}"
        " RETURNING input_seq",
        (session_id, tx.now),
    )
    tx.execute(
        "INSERT INTO session_input(id, session_id, seq, payload, time_created, due_at)"
        " VALUES (?, ?, ?, ?, ?, ?)",
        (
            input_id,
            session_id,
            counted_input_seq(session_id, row[0]),
            payload,
            tx.now,
            tx.now + delay_ms,
        ),
    )
    return input_id


def _pg_submit_controlled(
    tx: Tx, session_id: str, payload: str, input_id: str, on_busy: str, delay_ms: int
) -> tuple[str, str | None] | None:
    """`ts_submit_controlled`, its verdict as `_controlled_stored` reads it."""
    [(verdict,)] = tx.call(
        "ts_submit_controlled", session_id, payload, input_id, on_busy, delay_ms, tx.call_id
    )
    return _controlled_stored(session_id, input_id, str(verdict))


def _controlled_stored(
    session_id: str, input_id: str, verdict: str
) -> tuple[str, str | None] | None:
    """`ts_submit_controlled`'s verdict - "stored", "interrupted:<the execution id it
    marked>" or "known" (the input is stored) - as `submit_controlled` answers: (input id,
    the execution id it marked cancelling, if any); `SessionBusy` for a refusal; None when
    the input id is stored for another session or with another payload text, or the
    session's input count is below 0 (nothing was written: the statements decide, in a
    transaction, comparing the payloads as JSON values - or refuse the count)."""
    if verdict == "busy":
        raise _busy_error(session_id)
    if verdict in ("other_session", "other_payload", "malformed"):
        return None
    said, _, marked = verdict.partition(":")
    return input_id, marked if said == "interrupted" else None


def next_due(tx: Tx) -> int | None:
    """Milliseconds until the earliest scheduled input falls due (<= 0: due already), or
    None when none is scheduled. One lookup in a partial index. A due time that is no
    integer (text another tool wrote: SQLite sorts it after every number) never falls
    due, and times nothing; nor does an input `promote_due` passes over (its session id
    is not UTF-8 text), which would otherwise count as due at every look."""
    row = tx.one(earliest_due(tx))
    return due_in(tx, None if row is None else row[0])


def earliest_due(tx: Tx) -> str:
    """The statement reading the earliest scheduled input's due time (`next_due`)."""
    return (
        "SELECT due_at FROM session_input WHERE due_at IS NOT NULL"
        f" AND {readable(tx, 'session_id')} ORDER BY due_at LIMIT 1"
    )


def due_in(tx: Tx, due_at: Any) -> int | None:
    """`next_due` of the due time `earliest_due` read."""
    return due_at - tx.now if type(due_at) is int else None


@attrs.frozen
class Due:
    """What one promotion did: the sessions whose doorbells it rang, and when the next
    scheduled input falls due (ms from now; None for none)."""

    sessions: list[str]
    next_due_ms: int | None


def promote_due(tx: Tx, limit: int) -> Due:
    """Scheduled inputs now due become plain pending inputs and ring their sessions'
    doorbells, at most `limit` sessions per call (the rest: `next_due_ms <= 0`). Several
    runtimes may fire at once: whoever commits first promotes, the others find nothing."""
    rows = tx.execute(
        "SELECT session_id FROM session_input WHERE due_at IS NOT NULL AND due_at <= ?"
        f" AND {readable(tx, 'session_id')} ORDER BY due_at LIMIT ?",
        (tx.now, limit),
    ).fetchall()
    due = sorted({str(row[0]) for row in rows})
    if not due:
        return Due([], next_due(tx))
    tx.lock_sessions(due)  # in the lock order: two promoters never deadlock
    # Set-wise, whatever the number of sessions (reminders set for the same instant): a
    # statement per session cost PostgreSQL two round trips each, and the last of 500
    # due together started ~0.7 s late.
    promoted = {
        str(row[0])
        for row in tx.execute(
            f"UPDATE session_input SET due_at = NULL WHERE session_id IN {_in_list(due)}"
            " AND due_at IS NOT NULL AND due_at <= ? RETURNING session_id",
            (*due, tx.now),
        ).fetchall()
    }
    rung = [session_id for session_id in due if session_id in promoted]
    if rung:
        _ring_all(tx, rung)
    return Due(rung, next_due(tx))


def cancel_input(tx: Tx, input_id: str) -> bool:
    """Withdraw a pending input (due or scheduled): True when it was deleted here; False
    when it was taken (a user message now), set aside, or is unknown."""
    if tx.dialect == "postgres":
        return _pg_removed(tx, "ts_cancel_input", input_id)
    row = tx.one("SELECT session_id FROM session_input WHERE id = ?", (input_id,))
    if row is None:
        return False
    tx.lock_session(str(row[0]))
    # Under the lock: a drain may have taken it since the lookup (then nothing is deleted).
    deleted = tx.execute("DELETE FROM session_input WHERE id = ?", (input_id,)).rowcount
    if deleted:
        _written(tx, str(row[0]))
        tx.notify(str(row[0]))
    return deleted == 1


# ---------------------------------------------------------------------------------------------
# Pause and resume


@autocommit_when_alone
def pause(tx: Tx, session_id: str) -> None:
    """Mark the session paused (created if absent); idempotent: the first pause's time
    stays."""
    if tx.dialect == "postgres":
        tx.call("ts_pause", session_id)
        return
    tx.lock_session(session_id)
    tx.notify(session_id)
    tx.execute(
        "INSERT INTO session(id, time_created, time_paused) VALUES (?, ?, ?)"
        " ON CONFLICT(id) DO UPDATE SET"
        " time_paused = COALESCE(session.time_paused, excluded.time_paused)",
        (session_id, tx.now, tx.now),
    )


def pause_session(tx: Tx, session_id: str, create: bool) -> bool:
    """`pause` for an operator, who must hear of a mistyped id: returns whether the session
    existed. An unknown one is made paused only when `create` (the CLI, which says so);
    else nothing is written (the console's button on a page of a session deleted since).
    The session lock holds a delete off between the look and the pause."""
    tx.lock_session(session_id)
    existed = _session_exists(tx, session_id)
    if existed or create:
        pause(tx, session_id)
    return existed


def resume_existing(tx: Tx, session_id: str) -> bool | None:
    """`resume` for an operator: None, writing nothing, for an unknown session (a mistyped
    id), else whether pending work rang the doorbell."""
    tx.lock_session(session_id)
    if not _session_exists(tx, session_id):
        return None
    return resume(tx, session_id)


def _session_exists(tx: Tx, session_id: str) -> bool:
    return tx.one("SELECT 1 FROM session WHERE id = ?", (session_id,)) is not None


@autocommit_when_alone
def resume(tx: Tx, session_id: str) -> bool:
    """Lift the pause; when due inputs or a wake are pending, make sure the doorbell is set
    (signalled). Returns whether work is pending (the caller rings its local registry).
    A session that is not paused is left as it is (inputs a drain chose not to take wait
    for the next wake, §6.16), so a second call does nothing."""
    if tx.dialect == "postgres":
        [(pending,)] = tx.call("ts_resume", session_id)
        return bool(pending)
    tx.lock_session(session_id)
    row = tx.one("SELECT time_woken FROM session WHERE id = ?", (session_id,))
    if row is None:
        return False
    lifted = tx.execute(
        "UPDATE session SET time_paused = NULL, time_written = ?"
        " WHERE id = ? AND time_paused IS NOT NULL",
        (tx.now, session_id),
    ).rowcount
    if not lifted:
        return False
    if row[0] is not None:
        tx.notify(session_id)  # the doorbell is already set: only the signal is missing
        return True
    if _has_pending_inputs(tx, session_id):
        _ring(tx, session_id)
        return True
    return False


# ---------------------------------------------------------------------------------------------
# Delete and purge

# Messages of the sessions a purge batch examines at most, beyond its first session's (a
# session goes whole): about what fits the event loop's budget (`common.ROW_UNITS`).
PURGE_ROWS = 2_000


# Every table holding rows of a session, children first; `{ids}` is the IN list of sessions.
_SESSION_ROWS = (
    "DELETE FROM session_message_delta WHERE message_id IN"
    " (SELECT id FROM session_message WHERE session_id IN {ids})",
    "DELETE FROM session_message_stream WHERE message_id IN"
    " (SELECT id FROM session_message WHERE session_id IN {ids})",
    "DELETE FROM session_message_change WHERE message_id IN"
    " (SELECT id FROM session_message WHERE session_id IN {ids})",
    "DELETE FROM session_message WHERE session_id IN {ids}",
    "DELETE FROM session_message_rejected WHERE session_id IN {ids}",
    "DELETE FROM session_input WHERE session_id IN {ids}",
    "DELETE FROM session_input_rejected WHERE session_id IN {ids}",
    # The claims before their recovery leases: on PostgreSQL a recovery scan holding a
    # claim's row lock may insert its lease uncommitted; the claim's delete waits for that
    # lock, so the leases' delete, a statement after it, sees the committed lease.
    "DELETE FROM session_execution WHERE session_id IN {ids}",
    "DELETE FROM session_recovery WHERE session_id IN {ids}",
    "DELETE FROM session WHERE id IN {ids}",
)


def _delete_rows(tx: Tx, session_ids: Sequence[str]) -> None:
    """Delete every row of these sessions (locked by the caller)."""
    if tx.dialect == "postgres":
        tx.call("ts_delete_rows", list(session_ids))
        return
    ids = _in_list(session_ids)
    for statement in _SESSION_ROWS:
        tx.execute(statement.format(ids=ids), list(session_ids))


def delete_session(tx: Tx, session_id: str) -> tuple[bool, str | None]:
    """Erase the session and every row of it; whether it existed, and the execution id of
    the claim it removed, if any (its owner stops that claim's drain, and no other).

    A claim held by another owner goes with it, and the signal tells that owner: its change
    scan finds its execution gone and stops the drain (writing nothing); any write it still
    attempts fails the claim fence (`LeaseLost`). Marking the claim `cancelling` first would
    be deleted in the same transaction, so the claim's absence is the message.
    """
    if tx.dialect == "postgres":
        [(existed, removed)] = tx.call("ts_delete_session", session_id, idempotent=False)
        return bool(existed), removed
    tx.lock_session(session_id)
    if tx.one("SELECT 1 FROM session WHERE id = ?", (session_id,)) is None:
        return False, None
    spend_rows(
        tx,
        {"session": session_id},
        "length(data) FROM session_message WHERE session_id = :session",
        "length(payload) FROM session_input WHERE session_id = :session",
        # An open answer's streamed text: one row per append, tens of thousands in a long one.
        "length(text) FROM session_message_delta WHERE message_id IN"
        " (SELECT id FROM session_message WHERE session_id = :session)",
    )
    tx.notify(session_id)
    claim = tx.one("SELECT id FROM session_execution WHERE session_id = ?", (session_id,))
    _delete_rows(tx, [session_id])
    return True, None if claim is None else str(claim[0])


# A session is idle when it has no claim, no pending input (due or scheduled), no pending
# wake, and nothing of it was written after :cutoff.
_IDLE = (
    "s.time_woken IS NULL AND s.time_created <= :cutoff"
    " AND (s.time_paused IS NULL OR s.time_paused <= :cutoff)"
    " AND (s.time_written IS NULL OR s.time_written <= :cutoff)"
    " AND NOT EXISTS (SELECT 1 FROM session_execution e WHERE e.session_id = s.id)"
    " AND NOT EXISTS (SELECT 1 FROM session_input i WHERE i.session_id = s.id)"
    " AND NOT EXISTS (SELECT 1 FROM session_message m WHERE m.session_id = s.id"
    "   AND m.time_updated > :cutoff)"
    " AND NOT EXISTS (SELECT 1 FROM session_input_rejected r WHERE r.session_id = s.id"
    "   AND r.time_created > :cutoff)"
)


def purge_batch(tx: Tx, idle_ms: int, after: str, limit: int) -> tuple[list[str], str | None]:
    """Delete the idle sessions among the next `limit` sessions in id order after `after`;
    returns (the sessions deleted, where the next batch starts or None when done).

    Bounded: one batch examines at most `limit` sessions, and no more of them than hold
    `PURGE_ROWS` messages beyond its first session's (the idle check reads each one's
    messages, the delete removes them), so its transaction is short and no drain waits
    long behind it - 200 long conversations in one transaction held SQLite's write lock
    for most of a second. Each candidate is checked again under its session lock (sorted),
    so a session that became busy meanwhile is kept.
    """
    window = [
        str(row[0])
        for row in tx.execute(
            f"SELECT id FROM session WHERE id > ? AND {readable(tx, 'id')} ORDER BY id LIMIT ?",
            (after, limit),
        ).fetchall()
    ]
    if not window:
        return [], None
    more = len(window) == limit  # sessions may follow the window
    cut = _within_purge_rows(tx, window)
    if cut < len(window):  # the next batch goes on after the last session examined
        window, more = window[:cut], True
    cutoff = tx.now - idle_ms
    idle = _idle_sessions(tx, window, cutoff)
    if idle:
        tx.lock_sessions(idle)
        idle = _idle_sessions(tx, idle, tx.now - idle_ms)
        if idle:  # idle: no input left, so their messages are what the delete touches
            spend_rows(
                tx, idle, f"length(data) FROM session_message WHERE session_id IN {_in_list(idle)}"
            )
            for session_id in idle:
                tx.notify(session_id)
            _delete_rows(tx, idle)
    return idle, (window[-1] if more else None)


def _within_purge_rows(tx: Tx, sessions: list[str]) -> int:
    """How many of `sessions` (in the store's id order) one batch examines: the first ones
    whose messages stay within `PURGE_ROWS`, and always the first one. One look at no
    more than `PURGE_ROWS + 1` entries of the messages' (session, seq) index, in the same
    order: the session where it stops may have more messages after them."""
    rows = tx.execute(
        f"SELECT session_id FROM session_message WHERE session_id IN {_in_list(sessions)}"
        " ORDER BY session_id LIMIT ?",
        (*sessions, PURGE_ROWS + 1),
    ).fetchall()
    if len(rows) <= PURGE_ROWS:
        return len(sessions)
    return max(1, sessions.index(str(rows[-1][0])))


def _idle_sessions(tx: Tx, session_ids: Sequence[str], cutoff: int) -> list[str]:
    params: dict[str, Any] = {"cutoff": cutoff}
    names = []
    for index, session_id in enumerate(session_ids):
        params[f"s{index}"] = session_id
        names.append(f":s{index}")
    rows = tx.execute(
        f"SELECT s.id FROM session s WHERE s.id IN ({', '.join(names)}) AND {_IDLE} ORDER BY s.id",
        params,
    ).fetchall()
    return [str(row[0]) for row in rows]


# ---------------------------------------------------------------------------------------------
# Fork and truncate


def fork(tx: Tx, session_id: str, new_session_id: str, through_seq: int | None) -> int:
    """Copy the session's messages with seq <= through_seq (all when None) into a new
    session: same seq, role and data (streamed text merged); an unfinished assistant
    message is copied finished "interrupted". Returns how many were copied. `ValueError`
    when the new session exists or the source does not."""
    tx.lock_sessions((session_id, new_session_id))
    if tx.one("SELECT 1 FROM session WHERE id = ?", (new_session_id,)) is not None:
        raise ValueError(f"session {new_session_id!r} exists already")
    if tx.one("SELECT 1 FROM session WHERE id = ?", (session_id,)) is None:
        raise ValueError(f"session {session_id!r} does not exist")
    limit = "" if through_seq is None else " AND seq <= :through"
    params = {"session": session_id, "through": through_seq}
    spend_rows(
        tx,
        params,
        f"length(data) FROM session_message WHERE session_id = :session{limit}",
        # A maybe-open answer's streamed text, read and merged row by row: one per append.
        "length(text) FROM session_message_delta WHERE message_id IN (SELECT id"
        f" FROM session_message WHERE session_id = :session{limit} AND {OPEN_ASSISTANT})",
    )
    tx.execute("INSERT INTO session(id, time_created) VALUES (?, ?)", (new_session_id, tx.now))
    # Every message but a maybe-open answer in one statement, however long the transcript
    # (a statement per message held the source's session lock for as many round trips on
    # PostgreSQL, its live answer's appends waiting behind them). The data as stored: a
    # message that does not decode or is not UTF-8 is copied as it is (its copy as
    # malformed as it). A copy's id is this fork's own id and its row's number (not its
    # seq, which another tool's write may have made something no id can hold).
    copied = tx.execute(
        "INSERT INTO session_message(id, session_id, role, seq, data, time_created,"
        " time_updated, finished)"
        " SELECT CAST(:base AS TEXT) || '-' || CAST(row_number() OVER (ORDER BY seq) AS TEXT),"
        " :new, role, seq, data, time_created, :now, 1"
        f" FROM session_message WHERE session_id = :session{limit}"
        f" AND NOT ({OPEN_ASSISTANT})",
        {**params, "base": new_id(), "new": new_session_id, "now": tx.now},
    ).rowcount
    # Maybe open - also a mark another tool broke, as every ending reads it: its streamed
    # text merged, closed as an interrupted answer (one per execution at most: a few).
    rows = tx.execute(
        f"SELECT id, seq, {as_stored(tx, 'data')}, time_created FROM session_message"
        f" WHERE session_id = :session{limit} AND {OPEN_ASSISTANT} ORDER BY seq",
        params,
    ).fetchall()
    for message_id, seq, kind, data, time_created in rows:
        text = _codec.stored_text(kind, data, table="session_message", key=message_id)
        merged = _assistant_data(tx, message_id, text)
        tx.execute(
            "INSERT INTO session_message(id, session_id, role, seq, data, time_created,"
            " time_updated, finished) VALUES (:id, :session, 'assistant', :seq, :data,"
            " :created, :now, 1)",
            {
                "id": new_id(),
                "session": new_session_id,
                "seq": seq,
                "data": _codec.encode_assistant(_transcript.interrupt(merged, INTERRUPTED)),
                "created": time_created,
                "now": tx.now,
            },
        )
    # On PostgreSQL a worker's acquire of the source that met its lock answered 'busy' and
    # waits for a signal of it: the engine sends it after the COMMIT (`SIGNAL_WAITING`).
    tx.notify(new_session_id)
    return int(copied) + len(rows)


def truncate(tx: Tx, session_id: str, after_seq: int) -> int:
    """Delete the session's messages with seq > after_seq (and their streamed text);
    returns how many. `SessionBusy` while a claim is held: a drain's messages never vanish
    under it."""
    if tx.dialect == "postgres":
        [(deleted,)] = tx.call("ts_truncate", session_id, after_seq, idempotent=False)
        if deleted is None:
            raise _truncate_busy(session_id)
        return int(deleted)
    tx.lock_session(session_id)
    if _claim_row(tx, session_id) is not None:
        raise _truncate_busy(session_id)
    params = {"session": session_id, "after": after_seq}
    doomed = "SELECT id FROM session_message WHERE session_id = :session AND seq > :after"
    spend_rows(
        tx,
        params,
        "length(data) FROM session_message WHERE session_id = :session AND seq > :after",
        f"length(text) FROM session_message_delta WHERE message_id IN ({doomed})",
    )
    tx.execute(f"DELETE FROM session_message_delta WHERE message_id IN ({doomed})", params)
    tx.execute(f"DELETE FROM session_message_stream WHERE message_id IN ({doomed})", params)
    tx.execute(f"DELETE FROM session_message_change WHERE message_id IN ({doomed})", params)
    deleted = tx.execute(
        "DELETE FROM session_message WHERE session_id = :session AND seq > :after", params
    ).rowcount
    if deleted:
        _written(tx, session_id)
        tx.notify(session_id)
    return int(deleted)


def submit_truncating(tx: Tx, session_id: str, payload: str, input_id: str, after_seq: int) -> str:
    """Edit and regenerate: `truncate`, then admit the input and ring the doorbell, in one
    transaction - never a transcript cut with the edit not stored. Checked first, under the
    session lock: a retry of this input (stored, taken or set aside: same session and
    payload) returns its id and deletes nothing; `InputConflict` for another session's id
    or another payload; `SessionBusy` while a claim is held or due inputs wait (they came
    after the edited message: answered before the edit, they would reorder the
    conversation). A failure after the truncate (the input's seq) rolls it back."""
    tx.lock_session(session_id)
    if _known_input(tx, session_id, input_id, payload):
        # A retry comes right after the edit committed, when workers acquire: on PostgreSQL
        # one that met this lock answered 'busy' and waits for a signal of the session,
        # which the engine sends after the COMMIT (`SIGNAL_WAITING`): no round trip.
        return input_id
    if _claim_row(tx, session_id) is not None:
        raise _truncate_busy(session_id)
    if _has_pending_inputs(tx, session_id):
        raise _busy_error(session_id)
    truncate(tx, session_id, after_seq)
    _insert_input(tx, session_id, payload, input_id, ring=True)
    return input_id


def _truncate_busy(session_id: str) -> SessionBusy:
    return SessionBusy(f"session {session_id!r} has a claim: truncate it once it is idle")


def _pg_removed(tx: Tx, function: str, key: str) -> bool:
    """One call of a function that removes what `key` names and says whether it did: in a
    transaction, since a retry after a lost reply would find it gone either way."""
    [(removed,)] = tx.call(function, key, idempotent=False)
    return bool(removed)


# ---------------------------------------------------------------------------------------------
# PostgreSQL: this family's server-side functions (created by `_schema`'s migrations; see
# `_store.pg_functions` for their conventions)

PG_FUNCTIONS = r"""
-- submit with on_busy 'reject' or 'interrupt' (double-texting), or scheduled (p_delay > 0: due
-- p_delay ms from now by the lease clock; it rings no doorbell, and its signal lets every runtime
-- re-arm its due timer). Busy: a claim exists, or due inputs wait untaken
-- (`_decisions.submit_verdict`). Verdicts: stored; interrupted:<its execution id> (stored, and the
-- running claim - live or expired: recovery then finishes it as cancelled, at once
-- (STOPPED_AFTER_EXPIRY); not a quarantined one (_NOT_QUARANTINED) - marked cancelling); busy
-- (reject: nothing written); ts_known_input's, or ts_insert_input's malformed (nothing written).
-- With nothing written, the session is signalled if an acquire waits for it. Read back after a lost
-- reply (p_retry) by input id: known, or interrupted when the session's claim is cancelling (the
-- lost call's, or a cancellation already under way). p_call: the call's own id, the same in each
-- attempt (ts_known_input).
CREATE OR REPLACE FUNCTION ts_submit_controlled(p_session text, p_payload text, p_input text,
    p_on_busy text, p_delay bigint, p_call text, p_now bigint, p_retry boolean)
RETURNS text
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_now bigint; v_known text; v_phase text; v_claim text;
BEGIN
    v_now := ts_lock_now(p_session, p_now);
    v_known := ts_known_input(p_session, p_input, p_payload, p_call, p_retry);
    SELECT e.phase, e.id INTO v_phase, v_claim FROM session_execution e
        WHERE e.session_id = p_session;
    IF v_known IS NOT NULL THEN
        PERFORM ts_signal_waiting(p_session);
        RETURN CASE WHEN v_known = 'known' AND p_retry AND v_phase = 'cancelling'
                    THEN 'interrupted:' || v_claim ELSE v_known END;
    END IF;
    IF p_on_busy = 'reject' AND (v_phase IS NOT NULL OR ts_due_inputs(p_session, v_now)) THEN
        -- Refused for the inputs waiting: a worker may have come for them.
        PERFORM ts_signal_waiting(p_session);
        RETURN 'busy';
    END IF;
    IF p_delay > 0 THEN
        RETURN ts_insert_input(p_session, p_payload, p_input, p_call, false, v_now + p_delay,
            v_now, p_retry);
    END IF;
    v_known := ts_insert_input(p_session, p_payload, p_input, p_call, true, NULL, v_now,
        p_retry);
    IF v_known <> 'stored' THEN
        PERFORM ts_signal_waiting(p_session);
        RETURN v_known;  -- another session's input of this id, stored meanwhile
    END IF;
    IF p_on_busy = 'interrupt' AND v_phase = 'running' THEN
        UPDATE session_execution SET phase = 'cancelling', handed_back = {stopped_after_expiry}
            WHERE session_id = p_session AND phase = 'running' AND {not_quarantined};
        IF FOUND THEN
            RETURN 'interrupted:' || v_claim;
        END IF;
    END IF;
    RETURN 'stored';
END $$;

-- submit_controlled and the acquire it rings for, in one call: a session with no claim, no
-- due input waiting, not paused, whose input id is new, stores the input and is claimed at
-- once, the claim taking the input's wake (the doorbell is never written); any other goes
-- through ts_submit_controlled - a refusal (busy), an input id stored with another
-- session or payload text (other_*) or a malformed input count answers that alone, nothing
-- written, no acquire - then the acquire its doorbell rings for. Verdicts:
-- ts_submit_controlled's, then ts_acquire_locked's. One `now` for both. Idempotent by
-- input id and execution id: called again after a lost reply (p_retry), it finds the input
-- known and the claim its own, and answers as the lost call did.
CREATE OR REPLACE FUNCTION ts_submit_controlled_and_acquire(p_session text, p_payload text,
    p_input text, p_on_busy text, p_exec text, p_owner text, p_lease bigint, p_call text,
    p_now bigint, p_retry boolean,
    OUT input_verdict text, OUT verdict text, OUT attempt bigint, OUT holder text)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_now bigint; v_free boolean;
BEGIN
    v_now := ts_lock_now(p_session, p_now);
    v_free := NOT EXISTS (SELECT 1 FROM session_execution c WHERE c.session_id = p_session)
        AND ts_known_input(p_session, p_input, p_payload, p_call, p_retry) IS NULL
        AND NOT EXISTS (SELECT 1 FROM session s WHERE s.id = p_session
                        AND s.time_paused IS NOT NULL)
        AND NOT ts_due_inputs(p_session, v_now);
    IF v_free THEN
        input_verdict := ts_insert_input(p_session, p_payload, p_input, p_call, false, NULL,
            v_now, p_retry);
        IF input_verdict IN ('other_session', 'other_payload', 'malformed') THEN
            RETURN;  -- another session's input of this id, stored meanwhile; a bad count
        END IF;
        v_free := input_verdict = 'stored';
    ELSE
        input_verdict := ts_submit_controlled(p_session, p_payload, p_input, p_on_busy, 0,
            p_call, v_now, p_retry);
        IF input_verdict IN ('busy', 'other_session', 'other_payload', 'malformed') THEN
            RETURN;
        END IF;
    END IF;
    SELECT a.verdict, a.attempt, a.holder INTO verdict, attempt, holder
        FROM ts_acquire_locked(p_session, p_exec, p_owner, p_lease, v_now, v_free) a;
END $$;

-- cancel_input: withdraw a pending input (due or scheduled) under its session's lock;
-- whether it was deleted here (not when taken meanwhile, set aside, or unknown). It leaves
-- a trace for ts_known_input: a submit of it whose reply was lost, called again, answers
-- for its lost call (landed) instead of storing the input again - the trace names the call
-- that stored the input (call_id), so only that call's retry reads it; it keeps no
-- payload (the text a user took back), which that retry carries again. A retry happens
-- within the engine's patience (seconds), so traces older than ten minutes go
-- (`ts_forget_cancelled`, here and in every recovery pass).
CREATE OR REPLACE FUNCTION ts_cancel_input(p_input text, p_now bigint, p_retry boolean)
RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_session text; v_call text; v_now bigint;
BEGIN
    SELECT i.session_id INTO v_session FROM session_input i WHERE i.id = p_input;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    v_now := ts_lock_now(v_session, p_now);
    -- Under the lock: a drain may have taken it since the lookup.
    DELETE FROM session_input WHERE id = p_input RETURNING call_id INTO v_call;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    UPDATE session SET time_written = v_now WHERE id = v_session;
    PERFORM ts_signal(v_session);
    PERFORM ts_forget_cancelled(v_now);
    INSERT INTO session_input_cancelled(id, session_id, time_cancelled, call_id)
        VALUES (p_input, v_session, v_now, v_call)
        ON CONFLICT (id) DO UPDATE SET session_id = excluded.session_id,
            time_cancelled = excluded.time_cancelled, call_id = excluded.call_id;
    RETURN true;
END $$;

-- Delete the cancels' traces older than ten minutes (`ts_cancel_input`), from a cancel and
-- from every recovery pass (`ts_recovery_scan`): a store where no cancel follows forgets
-- them too. A trace another transaction holds is skipped, never waited for (two sweeps
-- deleting the same rows in different orders would deadlock): the next sweep takes it.
CREATE OR REPLACE FUNCTION ts_forget_cancelled(p_now bigint)
RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    DELETE FROM session_input_cancelled WHERE id IN (
        SELECT c.id FROM session_input_cancelled c WHERE c.time_cancelled < p_now - 600000
        FOR UPDATE SKIP LOCKED);
END $$;

-- pause: mark the session paused (created if absent); the first pause's time stays.
CREATE OR REPLACE FUNCTION ts_pause(p_session text, p_now bigint, p_retry boolean)
RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_now bigint;
BEGIN
    v_now := ts_lock_now(p_session, p_now);
    PERFORM ts_signal(p_session);
    INSERT INTO session AS s (id, time_created, time_paused) VALUES (p_session, v_now, v_now)
        ON CONFLICT (id) DO UPDATE SET time_paused = COALESCE(s.time_paused, excluded.time_paused);
END $$;

-- resume: lift the pause; whether work is pending - a set doorbell (signalled again), or
-- due inputs waiting (the doorbell rung). A second call finds the doorbell set.
CREATE OR REPLACE FUNCTION ts_resume(p_session text, p_now bigint, p_retry boolean)
RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_now bigint; v_woken bigint;
BEGIN
    v_now := ts_lock_now(p_session, p_now);
    SELECT s.time_woken INTO v_woken FROM session s WHERE s.id = p_session;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    UPDATE session SET time_paused = NULL, time_written = v_now
        WHERE id = p_session AND time_paused IS NOT NULL;
    -- Not paused: left as it is (signalled if an acquire waits for it: one that met the
    -- lock answered 'busy'). A retry after a lost reply cannot tell whether its first call
    -- lifted the pause: it answers (and signals) as that call did.
    IF NOT FOUND AND NOT p_retry THEN
        PERFORM ts_signal_waiting(p_session);
        RETURN false;
    END IF;
    IF v_woken IS NOT NULL THEN
        PERFORM ts_signal(p_session);
        RETURN true;
    END IF;
    IF ts_due_inputs(p_session, v_now) THEN
        PERFORM ts_ring(p_session, v_now);
        RETURN true;
    END IF;
    RETURN false;
END $$;

-- Every row of these sessions, children first (their locks held by the caller).
CREATE OR REPLACE FUNCTION ts_delete_rows(p_sessions text[], p_now bigint, p_retry boolean)
RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    DELETE FROM session_message_delta WHERE message_id IN
        (SELECT id FROM session_message WHERE session_id = ANY(p_sessions));
    DELETE FROM session_message_stream WHERE message_id IN
        (SELECT id FROM session_message WHERE session_id = ANY(p_sessions));
    DELETE FROM session_message_change WHERE message_id IN
        (SELECT id FROM session_message WHERE session_id = ANY(p_sessions));
    DELETE FROM session_message WHERE session_id = ANY(p_sessions);
    DELETE FROM session_message_rejected WHERE session_id = ANY(p_sessions);
    DELETE FROM session_input WHERE session_id = ANY(p_sessions);
    DELETE FROM session_input_rejected WHERE session_id = ANY(p_sessions);
    -- The claims first (as _SESSION_ROWS): a scan's lease inserted under a claim's row lock
    -- has committed once that claim's delete got the lock.
    DELETE FROM session_execution WHERE session_id = ANY(p_sessions);
    DELETE FROM session_recovery WHERE session_id = ANY(p_sessions);
    DELETE FROM session WHERE id = ANY(p_sessions);
END $$;

-- delete_session: erase the session and every row of it, its owner signalled (a claim's
-- absence stops its drain); whether it existed, and the execution id of the claim removed.
CREATE OR REPLACE FUNCTION ts_delete_session(p_session text, p_now bigint, p_retry boolean)
RETURNS TABLE(existed boolean, claim text)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_claim text;
BEGIN
    PERFORM ts_lock(p_session);
    IF NOT EXISTS (SELECT 1 FROM session WHERE id = p_session) THEN
        RETURN QUERY SELECT false, NULL::text;
        RETURN;
    END IF;
    PERFORM ts_signal(p_session);
    SELECT e.id INTO v_claim FROM session_execution e WHERE e.session_id = p_session;
    PERFORM ts_delete_rows(ARRAY[p_session], p_now, p_retry);
    RETURN QUERY SELECT true, v_claim;
END $$;

-- truncate: delete the session's messages with seq > p_after and their streamed text; how
-- many (NULL, nothing written: a claim is held).
CREATE OR REPLACE FUNCTION ts_truncate(p_session text, p_after bigint, p_now bigint,
    p_retry boolean)
RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_count bigint; v_now bigint;
BEGIN
    v_now := ts_lock_now(p_session, p_now);
    IF EXISTS (SELECT 1 FROM session_execution e WHERE e.session_id = p_session) THEN
        RETURN NULL;
    END IF;
    DELETE FROM session_message_delta WHERE message_id IN
        (SELECT id FROM session_message WHERE session_id = p_session AND seq > p_after);
    DELETE FROM session_message_stream WHERE message_id IN
        (SELECT id FROM session_message WHERE session_id = p_session AND seq > p_after);
    DELETE FROM session_message_change WHERE message_id IN
        (SELECT id FROM session_message WHERE session_id = p_session AND seq > p_after);
    DELETE FROM session_message WHERE session_id = p_session AND seq > p_after;
    GET DIAGNOSTICS v_count = ROW_COUNT;
    IF v_count > 0 THEN
        UPDATE session SET time_written = v_now WHERE id = p_session;
        PERFORM ts_signal(p_session);
    ELSE
        PERFORM ts_signal_waiting(p_session);  -- an acquire that met the lock: 'busy'
    END IF;
    RETURN v_count;
END $$;
""".replace("{not_quarantined}", _NOT_QUARANTINED).replace(
    "{stopped_after_expiry}", STOPPED_AFTER_EXPIRY.format(now="v_now")
)
