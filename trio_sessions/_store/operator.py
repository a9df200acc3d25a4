"""The operator's operations: quarantine (list, lift, drop), rejected inputs (list, drop),
and the reads behind the CLI's `status`, `quarantine list` and `health` (the CLI holds
no SQL: it formats what these return).

Invariants kept here:
* every write takes the session lock of the row it acts on, and acts only on a row that is
  quarantined (or set aside) now: `ValueError` otherwise, with nothing written;
* dropping a quarantined execution sets aside (raw text kept) the messages that do not
  decode, so the transcript reads again; finishes the rest as owner-lost, deletes the
  claim, resets the resume budget and re-arms the doorbell if inputs remain;
* the reads only read: they run on a read snapshot. A row holding what the store never
  writes (no whole number in a time or count, no UTF-8 text in a text column: SQLite keeps
  another tool's writes) is listed with its reasons in `malformed`, never failing the
  listing of the others.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from .. import _codec
from .._backend import Tx, reads_stored_bytes
from .._codec import shown_text, stored_text, stored_value
from .._errors import MalformedRecord
from .._model import OWNER_LOST, AssistantData
from .._validate import MAX_INT64
from .common import (
    _doorbell_set,
    _has_pending_inputs,
    _reset_attempts,
    _ring,
    _written,
    as_stored,
)
from .recovery_scan import Candidate
from .transcript import _close_open_messages, _decode_message


@reads_stored_bytes
def quarantined(tx: Tx) -> list[dict[str, Any]]:
    """Quarantined executions, oldest quarantine first, as plain JSON values (a text that is
    not UTF-8 shown with replacement characters, and said in `malformed`)."""
    rows = tx.execute(
        "SELECT execution_id, session_id, owner_id, recovery_error, time_quarantined"
        " FROM session_recovery WHERE recovery_error IS NOT NULL ORDER BY time_quarantined"
    ).fetchall()
    return [_listed("session_recovery", _QUARANTINED, row) for row in rows]


_QUARANTINED = (
    ("execution_id", "execution_id", False),
    ("session_id", "session_id", False),
    ("recovery_owner", "owner_id", False),
    ("recovery_error", "recovery_error", False),
    ("time_quarantined", "time_quarantined", True),
)


@reads_stored_bytes
def quarantine_page(tx: Tx, after: PageKey | None, limit: int) -> dict[str, Any]:
    """Quarantined executions in execution id order after `after` (None: from the first), at most
    `limit` (`more`: others follow; `last`: the last one's id as stored, the `PageKey` the next
    page starts after), as `quarantined` lists them: the console's table costs one page however
    many the store holds. Keyset paging on the primary key (an index walk; the table holds
    little besides quarantines: recovery leases while a pass runs), not on the quarantine time,
    which no index orders."""
    condition, key = _after(tx, "execution_id", after)
    rows = tx.execute(
        f"SELECT {_is_blob(tx, 'execution_id')}, execution_id, session_id, owner_id,"
        " recovery_error, time_quarantined FROM session_recovery"
        f" WHERE recovery_error IS NOT NULL AND {condition} ORDER BY execution_id LIMIT :limit",
        {"after": key, "limit": limit + 1},
    ).fetchall()
    listed = [_listed("session_recovery", _QUARANTINED, row[1:]) for row in rows[:limit]]
    return {"quarantined": listed, "more": len(rows) > limit, "last": _last_key(rows[:limit])}


@attrs.frozen
class PageKey:
    """Where a keyset page of ids starts: after this id as stored (the first page has
    none: it starts before "", an id another tool may store). `id` is a str for text that
    is UTF-8, else the stored bytes: of text that is not UTF-8, or - `blob` - of a BLOB.
    SQLite keeps either in a TEXT column when another tool writes it, and orders every
    BLOB after all text: a page after a BLOB compares BLOBs, one after text that is not
    UTF-8 compares text by its bytes, never the name it is shown by (replacement
    characters, which sort elsewhere: a page after it skipped rows, or listed itself
    again). PostgreSQL holds UTF-8 text only."""

    id: str | bytes
    blob: bool = False


def _after(tx: Tx, column: str, key: PageKey | None) -> tuple[str, Any]:
    """The condition (naming `:after`) that a row's `column` sorts after `key` - for None,
    that it holds an id at all - and the parameter's value: compared like with like (a
    BLOB's bytes as a BLOB; only text that is not UTF-8 through `CAST(... AS TEXT)`, byte
    order, as SQLite orders the column).
    On PostgreSQL a key that names no storable text (a BLOB, bytes that are not UTF-8, a
    NUL) is a `ValueError`."""
    if key is None:
        # Not `> ''`, which leaves out the id "". A NULL id (SQLite's TEXT PRIMARY KEY
        # takes one from another tool) names no key to page on from: left out, as before.
        return f"{column} IS NOT NULL", None
    if tx.dialect == "postgres":
        text = _pg_text(key)
        if text is None or "\x00" in text:
            raise ValueError("a page key that is no text PostgreSQL holds names no row here")
        return f"{column} > :after", text
    if isinstance(key.id, bytes) and not key.blob:
        return f"{column} > CAST(:after AS TEXT)", key.id
    return f"{column} > :after", key.id  # bytes bind as a BLOB: after it, only BLOBs


def _pg_text(key: PageKey) -> str | None:
    """The text a key names on PostgreSQL (which holds UTF-8 text only), or None."""
    if key.blob:
        return None
    if isinstance(key.id, str):
        return key.id
    try:
        return key.id.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _is_blob(tx: Tx, column: str) -> str:
    """A column saying whether `column` holds a BLOB (SQLite: another tool's)."""
    return f"typeof({column}) = 'blob'" if tx.dialect == "sqlite" else "FALSE"


def _last_key(rows: Sequence[Sequence[Any]]) -> PageKey | None:
    """The `PageKey` of the last of `rows` (each `_is_blob`'s column, then the id)."""
    return PageKey(rows[-1][1], bool(rows[-1][0])) if rows else None


def lift_quarantine(tx: Tx, execution_id: str, owner_id: str, lease_ms: int) -> Candidate:
    """Clear a quarantine and take the recovery lease on it at once (for a resume)."""
    row = _quarantined_row(tx, execution_id)
    # The claim's session, as recovery's fences name it (`_quarantined_row`).
    tx.execute(
        "UPDATE session_recovery SET recovery_error = NULL, time_quarantined = NULL,"
        " owner_id = ?, expires_at = ?, session_id = ? WHERE execution_id = ?",
        (owner_id, tx.now + lease_ms, row[0], execution_id),
    )
    _unmark_finished(tx, execution_id)
    return Candidate(row[0], execution_id)


def _unmark_finished(tx: Tx, execution_id: str) -> None:
    """The operator may have repaired the execution's messages by hand (the documented way
    out of a quarantine), and `finished` does not follow a hand-written `data`: count them
    as maybe open again, so closing the execution reads what they say now - also one
    marked 1 while its data is open, which every finish, reading `MAYBE_OPEN`, would pass
    over, and a mark another tool broke (text, 2: what recovery quarantined it for), which
    every finish would refuse again."""
    tx.execute(
        "UPDATE session_message SET finished = 0"
        " WHERE execution_id = ? AND role = 'assistant' AND finished <> 0",
        (execution_id,),
    )


def drop_quarantined(tx: Tx, execution_id: str) -> tuple[str, bool]:
    """Operator drop: set the execution's messages that do not decode aside (raw text kept
    in `session_message_rejected`), so the transcript reads again; finish the rest of its
    open transcript as owner-lost, delete the claim, reset attempts, re-arm the doorbell if
    inputs remain. Returns its session and whether the doorbell is set afterwards (a drain
    is due: the caller may start it)."""
    session_id = _quarantined_row(tx, execution_id)[0]
    _written(tx, session_id)  # what it sets aside and deletes leaves no newer time behind
    _set_aside_malformed_messages(tx, session_id, execution_id)
    _unmark_finished(tx, execution_id)
    _close_open_messages(tx, execution_id, OWNER_LOST)
    tx.execute("DELETE FROM session_execution WHERE id = ?", (execution_id,))
    _reset_attempts(tx, session_id)
    if _has_pending_inputs(tx, session_id):
        _ring(tx, session_id)
    tx.execute("DELETE FROM session_recovery WHERE execution_id = ?", (execution_id,))
    return session_id, _doorbell_set(tx, session_id)


def _set_aside_malformed_messages(tx: Tx, session_id: str, execution_id: str) -> None:
    # Read as stored: a message whose id, role, data or input id, or a text streamed onto
    # it, is not UTF-8 is one to set aside too (the driver would refuse the whole read).
    # It is matched by its stored bytes (`CAST(? AS TEXT)` of them is the same text).
    columns = ", ".join(as_stored(tx, column) for column in ("id", "role", "data", "input_id"))
    rows = tx.execute(
        f"SELECT seq, {columns} FROM session_message WHERE execution_id = ? ORDER BY seq",
        (execution_id,),
    ).fetchall()
    for seq, *stored in rows:
        message_id, role, data, input_id = (
            stored_value(kind, value) for kind, value in zip(stored[::2], stored[1::2], strict=True)
        )
        deltas = tx.execute(
            f"SELECT version, {as_stored(tx, 'text')} FROM session_message_delta"
            " WHERE message_id = CAST(? AS TEXT) ORDER BY version",
            (message_id,),
        ).fetchall()
        try:
            streamed = [
                _codec.streamed_text(
                    version,
                    stored_text(*text, table="session_message_delta", key=shown_text(message_id)),
                )
                for version, *text in deltas
            ]
            message = _decode_message(
                session_id, (message_id, role, seq, data, execution_id, input_id), streamed
            )
            if isinstance(message.data, AssistantData) and not message.data.finished:
                _check_version_left(tx, message.id)
        except MalformedRecord as exc:
            # The raw data is kept as it was stored (bytes that are not UTF-8 as a BLOB);
            # text streamed onto it since goes into the reason, such bytes as a bytes
            # literal (its rows leave with the message): nothing of it is lost.
            streamed_since = [stored_value(*text) for _, *text in deltas]
            reason = str(exc) + (f"; streamed since: {streamed_since!r}" if deltas else "")
            tx.execute(
                "INSERT INTO session_message_rejected(id, session_id, execution_id, seq, data,"
                " reason, time_created) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (message_id, session_id, execution_id, seq, data, reason, tx.now),
            )
            if message_id is None:  # SQLite, another tool's row: its (execution, seq) names it
                tx.execute(
                    "DELETE FROM session_message WHERE id IS NULL AND execution_id = ? AND seq = ?",
                    (execution_id, seq),
                )
            else:
                tx.execute("DELETE FROM session_message WHERE id = CAST(? AS TEXT)", (message_id,))
            tx.notify(session_id, watchers_only=True)  # gone, for the session's watchers


def _check_version_left(tx: Tx, message_id: str) -> None:
    """`MalformedRecord` for an open message whose version (or a delta's) leaves no next
    one - another tool's write: the largest 64-bit integer, or on SQLite a REAL. Finishing
    it (`_close_open_messages`) bumps the version, which SQLite turns into a REAL
    (`transcript._next_version` refuses it) and PostgreSQL refuses ('bigint out of
    range'): the drop would fail with it every time, where it sets the message aside."""
    [(version,)] = tx.execute(
        "SELECT COALESCE((SELECT MAX(d.version) FROM session_message_delta d"
        " WHERE d.message_id = m.id), m.version) FROM session_message m WHERE m.id = ?",
        (message_id,),
    ).fetchall()
    if isinstance(version, float) or (type(version) is int and version >= MAX_INT64):
        reasons = [f"version out of range: no version after {version!r}"]
        raise MalformedRecord("session_message", message_id, reasons)


def _of_session(column: str) -> str:
    """A condition: `column` is the `:session` parameter's, or that parameter is None."""
    return f"(CAST(:session AS TEXT) IS NULL OR {column} = :session)"


def _matched(tx: Tx, listed: Sequence[Any], limit: int | None, count: str, params: Any) -> int:
    """How many rows a listing's filters match: the rows it read, unless `limit` cut them
    off - then `count` (a `SELECT COUNT(*)` of the same filters) on the same snapshot."""
    if limit is None or len(listed) < limit:
        return len(listed)
    (matched,) = tx.one(count, params)
    return int(matched)


@reads_stored_bytes
def rejected_inputs(
    tx: Tx, session_id: str | None, limit: int | None = None
) -> list[dict[str, Any]]:
    """Inputs set aside by `take_inputs` because they do not decode, oldest first (of one
    session when given, at most `limit`)."""
    page = "" if limit is None else " LIMIT :limit"
    rows = tx.execute(
        "SELECT id, session_id, seq, payload, reason, time_created FROM session_input_rejected"
        f" WHERE {_of_session('session_id')} ORDER BY time_created, session_id, seq{page}",
        {"session": session_id, "limit": limit},
    ).fetchall()
    return [_listed("session_input_rejected", _REJECTED, row) for row in rows]


@reads_stored_bytes
def rejected_input_report(tx: Tx, session_id: str | None, limit: int | None) -> dict[str, Any]:
    """`rejected_inputs` and `matched`: how many match (counted only when `limit` leaves
    some out), on one snapshot - the listing reads the rows it shows, never all of them."""
    listed = rejected_inputs(tx, session_id, limit)
    count = f"SELECT COUNT(*) FROM session_input_rejected WHERE {_of_session('session_id')}"
    return {
        "inputs": listed,
        "matched": _matched(tx, listed, limit, count, {"session": session_id}),
    }


_REJECTED = (
    ("id", "id", False),
    ("session_id", "session_id", False),
    ("seq", "seq", True),
    ("payload", "payload", False),
    ("reason", "reason", False),
    ("time_created", "time_created", True),
)


def is_rejected_input(tx: Tx, input_id: str) -> bool:
    """Whether `input_id` names an input set aside as malformed: one row read, by its key."""
    return tx.one("SELECT 1 FROM session_input_rejected WHERE id = ?", (input_id,)) is not None


def drop_rejected_input(tx: Tx, input_id: str) -> str:
    """Operator drop of a set-aside input; returns its session id, `ValueError` if none."""
    row = tx.one("SELECT session_id FROM session_input_rejected WHERE id = ?", (input_id,))
    if row is None:
        raise ValueError(f"input {input_id!r} is not a rejected input")
    tx.lock_session(str(row[0]))
    tx.execute("DELETE FROM session_input_rejected WHERE id = ?", (input_id,))
    return str(row[0])


def _quarantined_row(tx: Tx, execution_id: str) -> Any:
    """The quarantined row's (session id,), under its session lock; `ValueError` if none.
    The session is its claim's, while the claim is there: the recovery row's own copy is
    one another tool may have changed, and a release under a session that is not the
    claim's failed (a foreign key) or missed the claim."""
    row = tx.one(
        "SELECT COALESCE((SELECT e.session_id FROM session_execution e"
        "   WHERE e.id = r.execution_id), r.session_id)"
        " FROM session_recovery r WHERE r.execution_id = ? AND r.recovery_error IS NOT NULL",
        (execution_id,),
    )
    if row is None:
        raise ValueError(f"execution {execution_id!r} is not quarantined")
    tx.lock_session(str(row[0]))
    return row


# ---------------------------------------------------------------------------------------------
# The CLI's reads (`python -m trio_sessions status | quarantine list | health`)


# A session's row as `_session` reads it, `SELECT {_STATUS_COLUMNS} {_STATUS_FROM} ...`:
# the readers (`status`, the console's `session_page` and `session_status`) each put their
# own WHERE, order and limit after it, and `status` counts its matches FROM the same joins.
_STATUS_COLUMNS = """
s.id, s.time_created, s.time_woken, s.wakes, s.wake_attempts,
       (SELECT COUNT(*) FROM session_input i WHERE i.session_id = s.id),
       (SELECT COUNT(*) FROM session_message m WHERE m.session_id = s.id),
       s.time_paused,
       (SELECT COUNT(*) FROM session_input i WHERE i.session_id = s.id
          AND i.due_at IS NOT NULL),
       e.id, e.owner_id, e.phase, e.time_created, e.heartbeat_at, e.expires_at,
       r.owner_id, r.expires_at, r.recovery_error
"""
_STATUS_FROM = (
    "FROM session s LEFT JOIN session_execution e ON e.session_id = s.id"
    " LEFT JOIN session_recovery r ON r.execution_id = e.id"
)


# A session can be in several states at once: a live claim with a doorbell set is both
# `active` and `woken`; a paused session is whatever else it is too (its doorbell stays
# set: no drain starts). A claim is in one of `active`, `expired` and `quarantined`: a
# quarantined claim is `quarantined` whatever its lease - a liveness takeover quarantines a
# dead owner's claim long before its lease runs out, and no owner works on it meanwhile.
# A lease expired as recovery and `_passed` read it: a number not after now (on SQLite, a
# text or a BLOB another tool wrote sorts after every number: such a claim is live).
_STATES = {
    "idle": "e.id IS NULL AND s.time_woken IS NULL",
    "woken": "s.time_woken IS NOT NULL",
    "active": "e.id IS NOT NULL AND r.recovery_error IS NULL AND e.expires_at > :now",
    "expired": "e.id IS NOT NULL AND r.recovery_error IS NULL AND e.expires_at <= :now",
    "quarantined": "e.id IS NOT NULL AND r.recovery_error IS NOT NULL",
    "paused": "s.time_paused IS NOT NULL",
}
STATES = tuple(_STATES)


@reads_stored_bytes
def status(
    tx: Tx, session_ids: Sequence[str] = (), state: str | None = None, limit: int | None = None
) -> dict[str, Any]:
    """The sessions - all, or those of `session_ids` (read by their keys), in `state` (one
    of `STATES`), the first `limit` of them in id order - each with its doorbell, pending
    inputs and claim, as plain JSON values; `matched` counts the sessions the filters match
    before `limit`, and `summary` the whole store in aggregates. The filters are the read's:
    it reads the sessions it lists, whatever the store holds."""
    conditions = [_STATES[state]] if state is not None else []
    params: dict[str, Any] = {"now": tx.now, "limit": limit}
    if session_ids:
        keys = {f"id{n}": session_id for n, session_id in enumerate(session_ids)}
        conditions.append(f"s.id IN ({', '.join(f':{key}' for key in keys)})")
        params.update(keys)
    where = f"WHERE {' AND '.join(conditions)}" if conditions else ""
    page = "" if limit is None else "LIMIT :limit"
    sql = f"SELECT {_STATUS_COLUMNS} {_STATUS_FROM} {where} ORDER BY s.id {page}"
    sessions = [_session(tx.now, row) for row in tx.execute(sql, params).fetchall()]
    count = f"SELECT COUNT(*) {_STATUS_FROM} {where}"
    return {
        "now": tx.now,
        "summary": _summary(tx),
        "matched": _matched(tx, sessions, limit, count, params),
        "sessions": sessions,
    }


# What the listing of every session shows, counted: the inputs, claims and quarantines of
# sessions that are there (SQLite keeps another tool's rows of a session gone). The claims
# apart, adding up to them: a quarantined claim is quarantined whatever its lease (a
# liveness takeover quarantines one long before it expires), neither live nor expired.
# Expired as `_passed` reads a lease, and recovery: a number not after now (on SQLite a
# text or a BLOB sorts after every number: such a claim is live).
_SUMMARY_SQL = """
SELECT (SELECT COUNT(*) FROM session), (SELECT COUNT(time_woken) FROM session),
       (SELECT COUNT(*) FROM session_input i JOIN session si ON si.id = i.session_id),
       COUNT(e.id), COUNT(r.recovery_error),
       COALESCE(SUM(CASE WHEN r.recovery_error IS NULL AND e.expires_at <= :now
                    THEN 1 ELSE 0 END), 0)
FROM session s
JOIN session_execution e ON e.session_id = s.id
LEFT JOIN session_recovery r ON r.execution_id = e.id
"""


def _summary(tx: Tx) -> dict[str, int]:
    """`status`'s store-wide counts, one row of aggregates (no session is read for them)."""
    (sessions, doorbells, inputs, claims, quarantined, expired) = tx.one(
        _SUMMARY_SQL, {"now": tx.now}
    )
    return {
        "sessions": int(sessions),
        "claims": int(claims),
        "live_claims": int(claims) - int(quarantined) - int(expired),
        "expired_claims": int(expired),
        "quarantined": int(quarantined),
        "doorbells": int(doorbells),
        "pending_inputs": int(inputs),
    }


def _session(now: int, row: Sequence[Any]) -> dict[str, Any]:
    (session_id, created, woken, wakes, attempts, inputs, messages, paused, scheduled, *claim) = row
    rung, held = woken is not None, paused is not None
    problems: list[str] = []
    session_id = _text(problems, "session.id", session_id)
    created, woken, wakes, attempts, paused = (
        _whole(problems, f"session.{column}", value)
        for column, value in zip(
            _SESSION_NUMBERS, (created, woken, wakes, attempts, paused), strict=True
        )
    )
    doorbell = None
    if rung:
        doorbell = {"time_woken": woken, "wakes": wakes, "age_s": _since(now, woken)}
    return {
        "id": session_id,
        "time_created": created,
        "doorbell": doorbell,
        "pending_inputs": inputs,
        "scheduled_inputs": scheduled,  # of the pending ones: not due (or not rung) yet
        # Paused as the store sees it: any time_paused, even one shown None as malformed.
        "paused": held,
        "paused_since": paused,  # lease-clock ms of `pause`; None when not paused
        "messages": messages,
        "wake_attempts": attempts,
        "claim": _claim(now, claim, problems) if claim[0] is not None else None,
        "malformed": problems,
    }


_SESSION_NUMBERS = ("time_created", "time_woken", "wakes", "wake_attempts", "time_paused")
_CLAIM_NUMBERS = ("time_created", "heartbeat_at", "expires_at")


def _claim(now: int, row: Sequence[Any], problems: list[str]) -> dict[str, Any]:
    (execution_id, owner, phase, created, heartbeat, expires, rec_owner, rec_expires, error) = row
    expired = _passed(now, expires)
    execution_id, owner, phase = (
        _text(problems, f"session_execution.{column}", value)
        for column, value in zip(
            ("id", "owner_id", "phase"), (execution_id, owner, phase), strict=True
        )
    )
    created, heartbeat, expires = (
        _whole(problems, f"session_execution.{column}", value)
        for column, value in zip(_CLAIM_NUMBERS, (created, heartbeat, expires), strict=True)
    )
    recovery = None
    if rec_owner is not None:
        rec_owner = _text(problems, "session_recovery.owner_id", rec_owner)
        error = _text(problems, "session_recovery.recovery_error", error)
        rec_expires = _whole(problems, "session_recovery.expires_at", rec_expires)
        recovery = {"owner_id": rec_owner, "expires_at": rec_expires, "recovery_error": error}
    return {
        "execution_id": execution_id,
        "owner_id": owner,
        "phase": phase,
        "time_created": created,
        "expires_at": expires,
        "expired": expired,
        "lease_remaining_s": None if expires is None else _seconds(max(0, expires - now)),
        "expired_since_s": None if expires is None else _seconds(max(0, now - expires)),
        "heartbeat_at": heartbeat,
        "heartbeat_age_s": _since(now, heartbeat),
        "quarantined": error is not None,
        "recovery": recovery,
    }


def _passed(now: int, expires: Any) -> bool:
    """Whether an expiry as stored has passed as the store sees it: a REAL (another tool's)
    compares as the number it is, so recovery takes such a claim; text and blobs never pass
    (SQLite orders them after every number), so the store treats such a claim as live."""
    return type(expires) in (int, float) and expires <= now


def _listed(
    table: str, fields: Sequence[tuple[str, str, bool]], row: Sequence[Any]
) -> dict[str, Any]:
    """A row as plain JSON values under the keys of `fields` - (key, column, whether it is a
    number) per column read - with what the store never writes replaced (`_whole`, `_text`)
    and said in `malformed`."""
    problems: list[str] = []
    listed = {
        key: (_whole if number else _text)(problems, f"{table}.{column}", value)
        for (key, column, number), value in zip(fields, row, strict=True)
    }
    return {**listed, "malformed": problems}


def malformed_columns(row: Mapping[str, Any]) -> set[str]:
    """The columns (`table.column`) whose values a listed row's `malformed` reasons name:
    a time shown None, an id shown replaced."""
    return {problem.split(" ", 1)[0] for problem in row["malformed"]}


def _whole(problems: list[str], column: str, value: Any) -> int | None:
    """A lease-clock time or count as read, or None, with a reason in `problems`, when it
    is no number: SQLite keeps whatever another tool wrote in any column, and one such row
    is shown as malformed, not a failure of the whole listing (a BLOB would not even print
    as JSON). A REAL is None too: no time or count the store wrote (`_passed` still
    compares a REAL expiry, as the store does)."""
    if value is None or type(value) is int:
        return value
    if type(value) is float:
        problems.append(f"{column} is {value!r}, not a whole number")
        return None
    problems.append(f"{column} is {shown_text(value)!r:.60}, not a whole number")
    return None


def _text(problems: list[str], column: str, value: Any) -> Any:
    """A text column as read (the operator's reads run again reading text that is not
    UTF-8 as bytes, `_sqlite.engine.run_read`): bytes - such text, or a BLOB - shown with
    replacement characters, with a reason in `problems`."""
    if not isinstance(value, bytes):
        return value
    shown = value[:_HEX_BYTES].hex().upper() + ("..." if len(value) > _HEX_BYTES else "")
    problems.append(f"{column} is not UTF-8 text (X'{shown}')")
    return shown_text(value)


# A text column's first bytes shown in a reason: the SQL literal an operator repairs by.
_HEX_BYTES = 64


def _since(now: int, then: int | None) -> float | None:
    return None if then is None else _seconds(now - then)


@reads_stored_bytes
def quarantine_report(
    tx: Tx, session_id: str | None = None, limit: int | None = None
) -> dict[str, Any]:
    """Quarantined executions, oldest first, with the claim they hold back - of one session
    (its recovery rows' `session_id`) when given, at most `limit` - and `matched`: how many
    match. One statement reads the rows shown with their claims; a count, only when `limit`
    leaves some out: the filters are the read's, never a read of every quarantine."""
    where = f"r.recovery_error IS NOT NULL AND {_of_session('r.session_id')}"
    params = {"session": session_id, "limit": limit}
    page = "" if limit is None else " LIMIT :limit"
    rows = tx.execute(
        "SELECT r.execution_id, r.session_id, r.owner_id, r.recovery_error, r.time_quarantined,"
        " e.owner_id, e.phase FROM session_recovery r"
        f" LEFT JOIN session_execution e ON e.id = r.execution_id WHERE {where}"
        f" ORDER BY r.time_quarantined, r.execution_id{page}",
        params,
    ).fetchall()
    listed = []
    for *quarantine, owner, phase in rows:
        row = _listed("session_recovery", _QUARANTINED, quarantine)
        row["claim_owner_id"] = _text(row["malformed"], "session_execution.owner_id", owner)
        row["claim_phase"] = _text(row["malformed"], "session_execution.phase", phase)
        row["quarantined_for_s"] = _since(tx.now, row["time_quarantined"])
        listed.append(row)
    count = f"SELECT COUNT(*) FROM session_recovery r WHERE {where}"
    return {"quarantined": listed, "matched": _matched(tx, listed, limit, count, params)}


def _seconds(ms: float) -> float:
    return round(ms / 1000, 3)


# Every table of a current store (PostgreSQL's `schema_version` aside), by dialect.
_COMMON_TABLES = (
    "session",
    "session_input",
    "session_execution",
    "session_recovery",
    "session_message",
    "session_input_rejected",
    "session_message_rejected",
    "session_message_stream",
    "session_message_delta",
    "session_message_change",
)
STORE_TABLES = {
    "sqlite": _COMMON_TABLES,
    "postgres": (*_COMMON_TABLES, "session_owner", "session_input_cancelled"),
}


def tables_answer(tx: Tx) -> None:
    """The health probe's read: at most one row of each of the store's tables, in one
    statement - an error names a table that does not answer, and a probe costs the same
    on any store (it counted every session row, each probe: a scan of millions on a large
    PostgreSQL store)."""
    tables = STORE_TABLES[tx.dialect]
    tx.one("SELECT " + ", ".join(f"(SELECT 1 FROM {table} LIMIT 1)" for table in tables))


# ---------------------------------------------------------------------------------------------
# The console's reads: one page of sessions, and store-wide counts (both bounded work)


def _contains(tx: Tx) -> str:
    # A substring search of the session id; the dialects spell it differently.
    return "strpos(s.id, :q) > 0" if tx.dialect == "postgres" else "instr(s.id, :q) > 0"


@reads_stored_bytes
def session_page(tx: Tx, query: str, after: PageKey | None, limit: int) -> dict[str, Any]:
    """Sessions whose id contains `query`, in id order after `after` (None: from the
    first), at most `limit`: keyset paging on the primary key, so a page costs the same
    with 100,000 sessions. `last`: the last one's id as stored, the `PageKey` the next
    page starts after."""
    condition, key = _after(tx, "s.id", after)
    where = condition + (f" AND {_contains(tx)}" if query else "")
    sql = (
        f"SELECT {_is_blob(tx, 's.id')}, {_STATUS_COLUMNS} {_STATUS_FROM}"
        f" WHERE {where} ORDER BY s.id LIMIT :limit"
    )
    rows = tx.execute(sql, {"after": key, "q": query, "limit": limit + 1}).fetchall()
    sessions = [_session(tx.now, row[1:]) for row in rows[:limit]]
    more = len(rows) > limit
    return {"now": tx.now, "sessions": sessions, "more": more, "last": _last_key(rows[:limit])}


@reads_stored_bytes
def session_status(tx: Tx, session_id: str) -> dict[str, Any] | None:
    """One session as `status` shows it, or None."""
    sql = f"SELECT {_STATUS_COLUMNS} {_STATUS_FROM} WHERE s.id = :session"
    row = tx.one(sql, {"session": session_id})
    return None if row is None else _session(tx.now, row)


def store_counts(tx: Tx) -> dict[str, int]:
    """Store-wide counts for the console's figures, each one aggregate."""
    (sessions, woken) = tx.one("SELECT COUNT(*), COUNT(time_woken) FROM session")
    # A quarantined claim is no live one whatever its lease (a liveness takeover
    # quarantines one long before it expires): it is counted among the quarantined.
    (claims, live) = tx.one(
        "SELECT COUNT(*), COALESCE(SUM(CASE WHEN e.expires_at > :now AND NOT EXISTS"
        " (SELECT 1 FROM session_recovery r WHERE r.execution_id = e.id"
        " AND r.recovery_error IS NOT NULL) THEN 1 ELSE 0 END), 0)"
        " FROM session_execution e",
        {"now": tx.now},
    )
    (quarantined,) = tx.one(
        "SELECT COUNT(*) FROM session_recovery WHERE recovery_error IS NOT NULL"
    )
    (inputs,) = tx.one("SELECT COUNT(*) FROM session_input")
    return {
        "sessions": int(sessions),
        "waiting": int(woken),
        "claims": int(claims),
        "live_claims": int(live),
        "quarantined": int(quarantined),
        "pending_inputs": int(inputs),
    }


@reads_stored_bytes
def pending_inputs(tx: Tx, session_id: str, after_seq: int | None, limit: int) -> dict[str, Any]:
    """A page of a session's untaken inputs in seq order after `after_seq` (None: from the
    first), at most `limit` - id, seq, when due (None: now) and the payload's first 200
    characters, for the console's cancel buttons - and `more`: others follow. Keyset
    paging on the (session, seq) key: a page costs the same however many are pending."""
    after = "" if after_seq is None else " AND seq > :after"
    rows = tx.execute(
        "SELECT id, seq, due_at, substr(payload, 1, 200) FROM session_input"
        f" WHERE session_id = :session{after} ORDER BY seq LIMIT :limit",
        {"session": session_id, "after": after_seq, "limit": limit + 1},
    ).fetchall()
    listed = [_listed("session_input", _PENDING, row) for row in rows[:limit]]
    return {"inputs": listed, "more": len(rows) > limit}


_PENDING = (
    ("id", "id", False),
    ("seq", "seq", True),
    ("due_at", "due_at", True),
    ("payload", "payload", False),
)
