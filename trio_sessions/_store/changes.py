"""Changes made by other processes (read-only): what the change signal points at.

Invariants kept here:
* these operations only read;
* a watched message's snapshot carries its version (the newest of its row's and its
  deltas') and the complete message, its streamed text merged; a message whose version
  is not newer than the one the watcher saw is not read;
* work per look is proportional to the change, never to a watched transcript (DESIGN
  §6.26): a look reads a watched session's messages past the newest seq it already covered
  and the messages it follows because they may still change (`finished <> 1`, as every
  ending reads them: `transcript.MAYBE_OPEN`, also a mark another tool broke) - for one
  whose row is unchanged, only the deltas streamed since. A finished message does not
  change (`MessageFinished`), so it is never read again; a session found rewritten (its
  covered message gone: truncated, deleted) is read from the top down to the newest
  message the runtime remembers, and the remembered ones are looked up by id;
* a look reads about `NEW_PER_LOOK` new messages of a session, and as many whole in all:
  a session that gained thousands at once (a fork into it) is read over several looks,
  and the next look visits first the first session a full one read nothing of
  (`Watched.crowded`): no session gaining that much before every look starves another;
* a look reads the messages it offers whole at its end, in one statement per `_IN_CHUNK`
  of them (and one more for the text streamed onto those with some), not one or two each
  (`_snapshots`); on the event loop their rows and texts are charged before they are read;
* the history a new watcher replays is read in bounded chunks, each its own short read;
* on PostgreSQL a look with no watched session is one call (`ts_changes`), alone in
  autocommit: one round trip, one snapshot.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeAlias

import attrs

from .. import _codec, _transcript
from .._backend import Tx, autocommit_when_alone, reads_stored_bytes
from .._errors import MalformedRecord
from .._model import AssistantData, Message
from .._validate import MAX_INT64
from .common import (
    _IN_CHUNK,
    _chunks,
    _in_list,
    leading_rows,
    placed,
    spend_rows,
    streamed_texts_of,
)
from .control import due_in, earliest_due, next_due
from .recovery_scan import _unclaimed_doorbells, handed_back_condition
from .stream import JOINED_COLUMNS, streamed_joined, streamed_onto, text_bytes
from .transcript import _decode_message, maybe_open


@attrs.frozen
class Snapshot:
    """One message as stored at `version`, for watchers."""

    session_id: str
    message_id: str
    seq: int
    message: Message | MalformedRecord
    version: int  # the newest of the row's and its deltas' versions: orders snapshots
    # The row's own version when `message` was read from the store: deltas above it extend
    # `message` without reading the row again. None when not known (a local write).
    row_version: int | None
    open: bool  # `finished <> 1` (`MAYBE_OPEN`): it may still change, so a look follows it


@attrs.frozen
class Followed:
    """What the watchers of one session were offered so far (the runtime's `WatchHub`)."""

    high_seq: int  # every message up to this seq is covered; newer ones are looked for
    high_id: str | None  # the message at `high_seq` (None: none yet), to notice a reused seq
    open: Mapping[str, Snapshot]  # messages that may still change, newest snapshot offered
    known: Mapping[str, int]  # every offered message's newest version (reused seq only)
    # The lowest `after_seq` of the session's watchers, as it is when the look reads: no
    # watcher takes a message at or below it, so a rewritten session is not read that far
    # (`_rewritten_news`).
    floor: Callable[[], int] = lambda: 0


@attrs.frozen
class Watched:
    """What a look found for watched sessions."""

    messages: list[Snapshot]
    heads: dict[str, tuple[int, str | None]]  # per session: its new (high_seq, high_id)
    gone: list[str]  # followed open messages that no longer exist
    # Per session the look read whole - its transcript was rewritten (truncated, deleted),
    # or no look had covered a message of it yet - the keys of its messages now: the
    # runtime forgets the messages it remembered before the look that are not among them
    # (ids are never reused), so a watcher kept open across many edits holds none of them.
    present: dict[str, frozenset[str]] = attrs.Factory(dict)
    # The sessions whose new messages past their head this look left for the next one
    # (`NEW_PER_LOOK`): the runtime looks again at once.
    behind: set[str] = attrs.Factory(set)
    # Those of them it read none of, other sessions' news having filled it, in the order it
    # visited them: the next look visits the first of them first (`WatchHub.followed`).
    # Visited in one order every time, a session gaining a look's worth before every look
    # starved the sessions after it.
    crowded: list[str] = attrs.Factory(list)


NO_CHANGE = Watched([], {}, [])

# A message a look offers, in the look's order: a snapshot it made already (`_extended`), or
# one to read whole (`_snapshots`) - its id as stored, and its (session, seq) for a row with
# no id (None: looked for by id only).
_Wanted: TypeAlias = "Snapshot | tuple[Any, tuple[Any, Any] | None]"


@attrs.frozen
class Changes:
    """What another process (or this one) may have changed since the last look."""

    doorbells: list[str]  # unclaimed sessions with a set doorbell, oldest first
    cancelling: list[str]  # execution ids of our claims another process marked cancelling
    watched: Watched  # of watched sessions only
    # Our claims whose row is gone (their session deleted by another process); looked up
    # only while we hold at most `_IN_CHUNK` claims (else the heartbeat finds them).
    gone: list[str] = attrs.Factory(list)
    next_due_ms: int | None = None  # when the earliest scheduled input falls due
    # A claim handed back by a graceful shutdown waits for the takeover a recovery pass
    # here would make (looked for with the doorbells: only while this runtime has room).
    handed_back: bool = False


@autocommit_when_alone
@reads_stored_bytes
def changes(
    tx: Tx,
    owner_id: str,
    local_sessions: Sequence[str],
    owned_executions: Sequence[str],
    doorbell_limit: int,
    watched: Mapping[str, Followed],
) -> Changes:
    """Read what the change signal points at: doorbells this runtime may take and whether a
    handed-back claim waits for a takeover (both only with `doorbell_limit` room),
    cancellations of its claims (`owned_executions`) and those of them that are gone, what
    changed in watched sessions since what their watchers were offered
    (`watched_changes`), and when the earliest scheduled input falls due.

    On PostgreSQL a look with no watched session is one call (`ts_changes`: one statement,
    alone in autocommit, one snapshot); with watched sessions it is the statements below,
    in one read transaction."""
    if tx.dialect == "postgres" and not watched:
        return _pg_changes(tx, owner_id, local_sessions, owned_executions, doorbell_limit)
    return changes_by_statements(
        tx, owner_id, local_sessions, owned_executions, doorbell_limit, watched
    )


def changes_by_statements(
    tx: Tx,
    owner_id: str,
    local_sessions: Sequence[str],
    owned_executions: Sequence[str],
    doorbell_limit: int,
    watched: Mapping[str, Followed],
) -> Changes:
    """`changes` statement by statement (SQLite; PostgreSQL with watched sessions)."""
    doorbells = _unclaimed_doorbells(tx, local_sessions, doorbell_limit) if doorbell_limit else []
    rows: list[Any] = []  # no claim of ours: none to be cancelled
    gone: list[str] = []
    if 0 < len(owned_executions) <= _IN_CHUNK:
        # A few claims of ours: looked up by key, no scan of every owner's claims.
        found = tx.execute(
            f"SELECT id, phase FROM session_execution WHERE id IN {_in_list(owned_executions)}"
            " AND owner_id = ?",
            (*owned_executions, owner_id),
        ).fetchall()
        rows = [row for row in found if row[1] == "cancelling"]
        present = {str(row[0]) for row in found}
        gone = [e for e in owned_executions if e not in present]
    elif owned_executions:
        # Many: one scan costs less than as many lookups.
        rows = tx.execute(
            "SELECT id FROM session_execution WHERE owner_id = ? AND phase = 'cancelling'",
            (owner_id,),
        ).fetchall()
    cancelling = [str(row[0]) for row in rows]
    watched_found = watched_changes(tx, watched) if watched else NO_CHANGE
    if not doorbell_limit:
        return Changes(doorbells, cancelling, watched_found, gone, next_due(tx))
    # With room, whether a handed-back claim waits: in the due time's statement, so a look
    # costs no round trip more for it on PostgreSQL.
    handed_back, params = handed_back_condition(tx, owner_id, local_sessions)
    due_at, waiting = tx.one(f"SELECT ({earliest_due(tx)}), {handed_back}", params)
    return Changes(doorbells, cancelling, watched_found, gone, due_in(tx, due_at), bool(waiting))


def _pg_changes(
    tx: Tx,
    owner_id: str,
    local_sessions: Sequence[str],
    owned_executions: Sequence[str],
    doorbell_limit: int,
) -> Changes:
    """`changes` without watched sessions, in one call of `ts_changes` (as the statements
    of `changes` read it: gone claims looked up only while we hold at most `_IN_CHUNK`)."""
    rows = tx.call(
        "ts_changes",
        owner_id,
        list(local_sessions),
        list(owned_executions),
        len(owned_executions) > _IN_CHUNK,
        doorbell_limit,
    )
    found: dict[str, list[str]] = {"doorbell": [], "cancelling": [], "gone": []}
    next_due_ms = None
    handed_back = False
    for kind, key, due_ms in rows:
        if kind == "due":
            next_due_ms = None if due_ms is None else int(due_ms)
        elif kind == "handed_back":
            handed_back = True
        else:
            found[kind].append(str(key))
    return Changes(
        found["doorbell"],
        found["cancelling"],
        NO_CHANGE,
        found["gone"],
        next_due_ms,
        handed_back,
    )


def watched_changes(tx: Tx, watched: Mapping[str, Followed]) -> Watched:
    """What changed in watched sessions beyond what their watchers were offered: messages
    past each session's covered seq, and followed open messages whose version grew (for
    one whose row is unchanged, only the deltas streamed since are read)."""
    found = Watched([], {}, [])
    wanted: list[_Wanted] = []  # what the look offers, in order: read whole at its end
    sessions = list(watched)
    for start in range(0, len(sessions), _IN_CHUNK // 2):
        some = {s: watched[s] for s in sessions[start : start + _IN_CHUNK // 2]}
        _new_messages(tx, some, found, wanted)
    open_ids = [message_id for followed in watched.values() for message_id in followed.open]
    step = _IN_CHUNK // 2  # the deltas' statement takes two parameters per message
    for chunk in (open_ids[start : start + step] for start in range(0, len(open_ids), step)):
        # PostgreSQL gets the list as one array (`PgTx.execute`).
        rows = tx.execute(
            f"SELECT m.id, m.session_id, m.version, {_VERSION}, m.finished"
            f" FROM session_message m WHERE m.id IN {_in_list(chunk)}",
            tuple(chunk),
        ).fetchall()
        present = {str(row[0]) for row in rows}
        found.gone.extend(message_id for message_id in chunk if message_id not in present)
        grown: list[tuple[Snapshot, int, bool]] = []  # only deltas were added
        for message_id, session_id, row_version, version, finished in rows:
            held = watched[str(session_id)].open[str(message_id)]
            if placed(version) <= held.version:
                continue
            if held.row_version == placed(row_version) and _extensible(held):
                grown.append((held, placed(version), maybe_open(finished)))
            else:
                wanted.append((str(message_id), None))
        wanted.extend(_extended(tx, grown))
    found.messages.extend(_snapshots(tx, wanted))
    return found


def _new_messages(
    tx: Tx, watched: Mapping[str, Followed], found: Watched, wanted: list[_Wanted]
) -> None:
    """Messages of each session from its covered seq on, the covered one included to see
    it is still the same message, about `NEW_PER_LOOK` past it (the rest: the next look):
    one statement for many sessions, each reading only the rows it keeps by index seeks of
    `(session_id, seq)`. SQLite: the seqs up to `NEW_PER_LOOK` past the covered one, and
    the first message past those (a gap in the seqs - a set-aside, another tool's write -
    never stops a session). PostgreSQL: the first `NEW_PER_LOOK + 1` rows of each session,
    a `LIMIT` per session (`LATERAL`) over the sessions and their covered seqs bound as two
    arrays. An OR of per-session terms made its planner a subquery per term (47 ms for 250
    sessions); a window over them read every row past a covered seq (20,001 for the 101
    kept of a session 20,000 behind: a catch-up cost O(n^2 / NEW_PER_LOOK)), and its 500
    parameters made a statement psycopg parses anew each time (past 50: 7 ms of CPU)."""
    upper = {s: min(f.high_seq + NEW_PER_LOOK, MAX_INT64) for s, f in watched.items()}
    if tx.dialect == "postgres":
        params: tuple[Any, ...] = (
            list(watched),
            [f.high_seq for f in watched.values()],
            NEW_PER_LOOK + 1,
        )
        sql = (
            f"SELECT w.s, m.id, m.seq, {_VERSION}"
            " FROM unnest(?::text[], ?::bigint[]) AS w(s, h) CROSS JOIN LATERAL"
            " (SELECT x.id, x.seq, x.version FROM session_message x"
            " WHERE x.session_id = w.s AND x.seq >= w.h ORDER BY x.seq LIMIT ?) m"
            " ORDER BY w.s, m.seq"
        )
    else:
        term = (
            "(m.session_id = ? AND m.seq >= ? AND m.seq <= ?) OR (m.session_id = ? AND"
            " m.seq = (SELECT MIN(x.seq) FROM session_message x WHERE x.session_id = ?"
            " AND x.seq > ?))"
        )
        params = ()
        for session_id, f in watched.items():
            params += (session_id, f.high_seq, upper[session_id])  # the seqs up to `upper`
            params += (session_id, session_id, upper[session_id])  # the first one past them
        sql = (
            f"SELECT m.session_id, m.id, m.seq, {_VERSION} FROM session_message m"
            f" WHERE {' OR '.join([term] * len(watched))} ORDER BY m.session_id, m.seq"
        )
    by_session: dict[str, list[Any]] = {}
    for session_id, *row in tx.execute(sql, params).fetchall():
        by_session.setdefault(str(session_id), []).append(row)
    for session_id, followed in watched.items():
        rows = by_session.get(session_id, [])
        # More may follow: a row past the seqs read (SQLite), or a full LIMIT (PostgreSQL).
        limited = len(rows) > NEW_PER_LOOK or any(
            placed(row[1]) > upper[session_id] for row in rows
        )
        _session_news(tx, session_id, followed, rows, found, wanted, limited=limited)


def _session_news(
    tx: Tx,
    session_id: str,
    followed: Followed,
    rows: list[Any],
    found: Watched,
    wanted: list[_Wanted],
    *,
    limited: bool,
) -> None:
    """One session's rows from its covered seq on, (id, seq, version) in seq order - about
    `NEW_PER_LOOK` past it (`_new_messages`; `limited`: more may follow, which the next
    look reads)."""
    if followed.high_id is not None:
        if not rows or (message_key(rows[0][0]), rows[0][1]) != (
            followed.high_id,
            followed.high_seq,
        ):
            # Truncated (and maybe grown again): seqs up to the old head may name new
            # messages (`_rewritten_news`).
            _rewritten_news(tx, session_id, followed, found, wanted)
            return
        rows = rows[1:]
    elif followed.high_seq == 0 and followed.known and not limited:
        # Nothing covered yet, yet messages offered (by local writes): these rows are the
        # whole transcript, so they tell which of those still exist.
        found.present[session_id] = frozenset(message_key(row[0]) for row in rows)
    for index, (message_id, seq, version) in enumerate(rows):
        if len(wanted) >= NEW_PER_LOOK:
            rows = rows[:index]  # other sessions' news filled this look: the next reads on
            limited = True
            if not index:
                found.crowded.append(session_id)
            break
        key = message_key(message_id)
        held = followed.open.get(key)
        seen = held.version if held is not None else followed.known.get(key, -1)
        if placed(version) > seen:
            wanted.append((message_id, (session_id, seq)))
    if rows:
        found.heads[session_id] = (placed(rows[-1][1]), message_key(rows[-1][0]))
    if limited:
        # A session grown by thousands at once (a fork into it, another process's batch):
        # the rest comes with the next look, at once. One look read them all - 20,000 held
        # the event loop 130 ms on SQLite (a review measured).
        found.behind.add(session_id)


def _rewritten_news(
    tx: Tx, session_id: str, followed: Followed, found: Watched, wanted: list[_Wanted]
) -> None:
    """The messages of a session whose covered message is gone (a truncate, a delete, a
    quarantine's set-aside of the newest) that its watchers were not offered: those above
    the newest one whose version the hub remembers (`known`), read from the top down. A
    truncate deletes a suffix, and ids are never reused: that message and every one below
    it are as they were - an edit of a long conversation reads what it changed, where the
    look read every message whose version the hub did not remember, those below every
    watcher's `after_seq` too (a review: 1,980 read whole for a truncate of ten). With no
    remembered message left (the session deleted and made again) every message is new.
    Never below the watchers' `floor`: none takes a message there, and the hub remembers
    none (a watcher of the last messages, all truncated, read the transcript whole - a
    review's find). The known messages still stored are looked up by id
    (`Watched.present`). As `_session_news`, it reads about `NEW_PER_LOOK` of them whole,
    the oldest first; the next look reads on from the last (a conversation forked into a
    watched session deleted before was read whole in one look - a review's find)."""
    newer: list[tuple[Any, Any]] = []
    stop: tuple[Any, Any] | None = None  # the newest message remembered, if one is left
    floor = followed.floor()
    below: int | None = None  # the seq the next page of rows ends before (None: the top)
    while True:
        page = tx.execute(
            "SELECT id, seq FROM session_message WHERE session_id = ? AND seq > ?"
            + ("" if below is None else " AND seq < ?")
            + " ORDER BY seq DESC LIMIT ?",
            (session_id, floor, NEW_PER_LOOK)
            if below is None
            else (session_id, floor, below, NEW_PER_LOOK),
        ).fetchall()
        kept = next(
            (i for i, row in enumerate(page) if message_key(row[0]) in followed.known), None
        )
        newer += page if kept is None else page[:kept]
        stop = None if kept is None else page[kept]
        if kept is not None or len(page) < NEW_PER_LOOK or type(page[-1][1]) is not int:
            break
        below = page[-1][1]
    present = {message_key(message_id) for message_id, _ in newer}
    for chunk in _chunks(sorted(followed.known)):
        rows = tx.execute(
            f"SELECT id FROM session_message WHERE id IN {_in_list(chunk)}", tuple(chunk)
        )
        present.update(message_key(row[0]) for row in rows.fetchall())
    newer.reverse()  # in seq order
    offered = newer[: max(0, NEW_PER_LOOK - len(wanted))]
    if newer and not offered:
        found.crowded.append(session_id)
    wanted.extend((message_id, (session_id, seq)) for message_id, seq in offered)
    found.present[session_id] = frozenset(present)
    if len(offered) == len(newer):
        found.heads[session_id] = _newest(tx, session_id)
        return
    # The rest: the next look reads on past the last message offered (or the newest one
    # remembered, or the floor), as it reads a session grown by many (`_session_news`).
    head = offered[-1] if offered else stop
    found.heads[session_id] = (
        (floor, None) if head is None else (placed(head[1]), message_key(head[0]))
    )
    found.behind.add(session_id)


def _extensible(held: Snapshot) -> bool:
    """Whether deltas can extend the held snapshot (a decoded assistant message)."""
    return isinstance(held.message, Message) and isinstance(held.message.data, AssistantData)


def _extended(tx: Tx, grown: Sequence[tuple[Snapshot, int, bool]]) -> list[Snapshot]:
    """Each held snapshot (its row unchanged since it was read) with the deltas streamed
    onto it since, read in one statement: one primary-key range per message (PostgreSQL:
    the messages and their versions as two arrays, joined - an OR of 250 terms was 500
    parameters psycopg parsed anew on every look, 7.5 ms of CPU, and 1 ms of planning)."""
    if not grown:
        return []
    if tx.dialect == "postgres":
        sql = (
            "SELECT d.message_id, d.version, d.text FROM unnest(?::text[], ?::bigint[])"
            " AS g(id, v) JOIN session_message_delta d ON d.message_id = g.id"
            " AND d.version > g.v ORDER BY d.message_id, d.version"
        )
        params: tuple[Any, ...] = (
            [held.message_id for held, _, _ in grown],
            [held.version for held, _, _ in grown],
        )
    else:
        terms = " OR ".join(["(message_id = ? AND version > ?)"] * len(grown))
        sql = (
            f"SELECT message_id, version, text FROM session_message_delta WHERE {terms}"
            " ORDER BY message_id, version"
        )
        params = tuple(value for held, _, _ in grown for value in (held.message_id, held.version))
    texts: dict[str, list[Any]] = {}
    for message_id, version, text in tx.execute(sql, params).fetchall():
        texts.setdefault(str(message_id), []).append(_codec.streamed_text(version, text))
    snapshots = []
    for held, version, still_open in grown:
        message = held.message
        assert isinstance(message, Message) and isinstance(message.data, AssistantData)
        try:
            streamed = _codec.decode_streamed(texts.get(held.message_id, []), key=held.message_id)
        except MalformedRecord as exc:
            snapshots.append(attrs.evolve(held, message=exc, version=version, open=still_open))
            continue
        data = _transcript.with_streamed(message.data, streamed)
        snapshots.append(
            attrs.evolve(
                held, message=attrs.evolve(message, data=data), version=version, open=still_open
            )
        )
    return snapshots


def sessions_present(tx: Tx, session_ids: Sequence[str]) -> set[str]:
    """Which of `session_ids` still have a session row. A claim of ours `changes` found gone
    whose session is gone too was deleted with it (`delete_session` elsewhere, a user's
    erasure), not taken over: the runtime then reports no lost claim. Looked up only for
    claims found gone - rare - by key."""
    present: set[str] = set()
    for chunk in _chunks(session_ids):
        rows = tx.execute(f"SELECT id FROM session WHERE id IN {_in_list(chunk)}", tuple(chunk))
        present.update(str(row[0]) for row in rows.fetchall())
    return present


@reads_stored_bytes
def newest_message(tx: Tx, session_id: str) -> tuple[int, str | None]:
    """The session's newest message as (seq, id); (0, None) when it has none."""
    return _newest(tx, session_id)


def _newest(tx: Tx, session_id: str) -> tuple[int, str | None]:
    row = tx.one(
        "SELECT seq, id FROM session_message WHERE session_id = ? ORDER BY seq DESC LIMIT 1",
        (session_id,),
    )
    return (0, None) if row is None else (placed(row[0]), message_key(row[1]))


# A replay reads at most this many messages, or about this many bytes of message data and
# text streamed onto them, per read: each read is one short step on the event loop,
# whatever the transcript's length.
REPLAY_CHUNK = 100
REPLAY_CHUNK_BYTES = 1 << 20
# A change look reads at most about this many watched messages whole (`_session_news`): as
# a replay's read, one short step however many messages a session gained since the last.
NEW_PER_LOOK = REPLAY_CHUNK


@reads_stored_bytes
def watched_messages(
    tx: Tx, session_id: str, after_seq: int, through_seq: int, limit: int = REPLAY_CHUNK
) -> list[Snapshot]:
    """The session's stored messages with `after_seq < seq <= through_seq`, in seq order,
    at most `limit` of them and about `REPLAY_CHUNK_BYTES` of data and streamed text (at
    least one; the text streamed onto an open reply joined by the store): the
    caller continues after the last seq returned. A `through_seq` of `MAX_INT64` sets no
    upper bound: it is where `placed` puts a newest seq that is no integer (SQLite keeps
    the text another tool writes and sorts it after every number), so that message is read
    too and raises `MalformedRecord` in the watcher, as it does in `transcript()`."""
    through = "" if through_seq >= MAX_INT64 else " AND m.seq <= :through"
    rows = tx.execute(
        f"SELECT {_SNAPSHOT_COLUMNS}, length(m.data) FROM session_message m"
        f" WHERE m.session_id = :session AND m.seq > :after{through} ORDER BY m.seq LIMIT :limit",
        {"session": session_id, "after": after_seq, "through": through_seq, "limit": limit},
    )
    kept, _ = leading_rows(rows, count=limit, size_bytes=REPLAY_CHUNK_BYTES)
    streamed = _streamed_onto_rows(tx, kept)
    snapshots: list[Snapshot] = []
    size = 0
    for row in kept:
        texts = streamed.get(row[1], [])
        size += text_bytes([row[4], *texts])
        if snapshots and size > REPLAY_CHUNK_BYTES:
            break  # the text streamed onto it filled the chunk: the caller reads on from here
        snapshots.append(_snapshot_of(row, texts))
    return snapshots


def _streamed_onto_rows(tx: Tx, rows: Sequence[Sequence[Any]]) -> dict[Any, list[Any]]:
    """The texts streamed onto the assistant messages of these `_SNAPSHOT_COLUMNS` rows: of
    those with a delta newer than their row (an open reply, mostly one), joined by the
    store (`streamed_onto`); of the others (any delta older than the row, which only
    another tool writes) in one statement per `_IN_CHUNK`, as before."""
    assistant = [row for row in rows if row[2] == "assistant"]
    newer = {row[1] for row in assistant if placed(row[8]) > placed(row[7])}  # versions
    streamed = streamed_texts_of(tx, [str(row[1]) for row in assistant if row[1] not in newer])
    for message_id in newer:
        streamed[message_id] = streamed_onto(tx, str(message_id))
    return streamed


def message_key(stored_id: Any) -> str:
    """A message's id as watchers key it: its text, or for bytes that are no UTF-8 (SQLite
    keeps what another tool writes, and a read marked `reads_stored_bytes` returns them) the
    bytes shown with replacement characters - a key only, naming no row: such a message is
    read by its stored bytes (`_snapshot`) and decodes as a `MalformedRecord`."""
    return str(_codec.shown_text(stored_id))


def _snapshot(
    tx: Tx, stored_id: str | bytes | None, *, at: tuple[Any, Any] | None = None
) -> Snapshot:
    """One message read whole, by its id as stored: its row and every delta streamed onto
    it since. A row with no id is read `at` its (session, seq)."""
    if stored_id is None:
        # SQLite: a rowid table's `id TEXT PRIMARY KEY` takes the NULL another tool writes,
        # which no `m.id = ?` finds; (session_id, seq) is unique too. Malformed
        # (`_shape_reasons`): its deltas are never merged.
        assert at is not None, "a message with no id is read at its (session, seq)"
        row = tx.one(
            f"SELECT {_SNAPSHOT_COLUMNS} FROM session_message m"
            " WHERE m.session_id = ? AND m.seq = ?",
            at,
        )
        return _snapshot_of(row, [])
    if isinstance(stored_id, bytes):  # SQLite: text whose bytes are no UTF-8
        row = tx.one(
            f"SELECT {_SNAPSHOT_COLUMNS} FROM session_message m WHERE m.id = CAST(? AS TEXT)",
            (stored_id,),
        )
        return _snapshot_of(row, [])  # malformed: its deltas are never merged
    row = tx.one(f"SELECT {_SNAPSHOT_COLUMNS} FROM session_message m WHERE m.id = ?", (stored_id,))
    return _snapshot_of(row, streamed_onto(tx, stored_id) if row[2] == "assistant" else [])


def _snapshots(tx: Tx, wanted: Sequence[_Wanted]) -> list[Snapshot]:
    """What a look offers, in the order given: the messages whose id is text read whole in
    one statement per `_IN_CHUNK` (`_read_whole`), the others (no id; SQLite's text that is
    no UTF-8) one by one (`_snapshot`). A catch-up look of `NEW_PER_LOOK` messages read
    each by its id and each answer's streamed text by one more: ~150 statements, each a
    round trip on PostgreSQL inside the look's read transaction."""
    ids = list(
        dict.fromkeys(w[0] for w in wanted if not isinstance(w, Snapshot) and type(w[0]) is str)
    )
    read: dict[Any, Snapshot] = {}
    for chunk in _chunks(ids):
        read.update(_read_whole(tx, chunk))
    snapshots: list[Snapshot] = []
    for w in wanted:
        if isinstance(w, Snapshot):
            snapshots.append(w)
        else:
            stored_id, at = w
            held = read.get(stored_id) if type(stored_id) is str else None
            snapshots.append(_snapshot(tx, stored_id, at=at) if held is None else held)
    return snapshots


def _read_whole(tx: Tx, ids: Sequence[str]) -> dict[Any, Snapshot]:
    """These messages read whole (`_snapshot`), by their id as stored: their rows in one
    statement, and the texts streamed onto those of them that are answers with a delta (an
    `EXISTS` of the row: whatever its versions say) in one more. On the event loop
    (SQLite) their rows and texts are charged first (`spend_rows`): a look meeting more
    than the loop's budget goes to the worker thread before it reads any. (PostgreSQL
    gets each id list as one array: `PgTx.execute`.)"""
    among, params = f"IN {_in_list(ids)}", tuple(ids)
    spend_rows(
        tx,
        params + params,
        f"length(m.data) FROM session_message m WHERE m.id {among} UNION ALL"
        f" SELECT length(d.text) FROM session_message_delta d WHERE d.message_id {among}",
    )
    rows = tx.execute(
        f"SELECT {_SNAPSHOT_COLUMNS}, EXISTS(SELECT 1 FROM session_message_delta x"
        f" WHERE x.message_id = m.id) FROM session_message m WHERE m.id {among}",
        params,
    ).fetchall()
    streamed = _streamed_onto_each(
        tx, [row[1] for row in rows if row[2] == "assistant" and row[-1]]
    )
    return {row[1]: _snapshot_of(row[:-1], streamed.get(row[1], [])) for row in rows}


def _streamed_onto_each(tx: Tx, ids: Sequence[str]) -> dict[Any, list[Any]]:
    """`streamed_onto` of each of these messages, in one statement: SQLite joins each one's
    texts (a text that is no text, or a version no whole number: that message's read again
    row by row, `streamed_joined`); PostgreSQL sends them in order (`streamed_texts_of`)."""
    if not ids:
        return {}
    if tx.dialect == "postgres":
        return streamed_texts_of(tx, ids)
    rows = tx.execute(_join_streamed_of(len(ids)), tuple(ids)).fetchall()
    return {
        message_id: streamed_joined(tx, message_id, not_text, joined)
        for message_id, not_text, joined in rows
    }


def _join_streamed_of(count: int) -> str:
    """SQLite: `JOIN_STREAMED` of `count` messages, one row each - read, as that one's, by
    the primary key (message_id, version): each message's texts in version order."""
    return (
        f"SELECT message_id, {JOINED_COLUMNS} FROM session_message_delta"
        f" WHERE message_id IN {_in_list(range(count))} GROUP BY message_id"
    )


def _snapshot_of(row: Sequence[Any], streamed: Sequence[Any]) -> Snapshot:
    """A snapshot from a row of `_SNAPSHOT_COLUMNS` and the texts streamed onto it."""
    session_id, *message, row_version, version, finished = row
    snapshot: Message | MalformedRecord
    try:
        snapshot = _decode_message(session_id, message, streamed)
    except MalformedRecord as exc:
        snapshot = exc
    return Snapshot(
        str(session_id),
        message_key(message[0]),
        placed(message[2]),
        snapshot,
        placed(version),
        placed(row_version),
        # Maybe open as every ending reads it: a mark another tool broke (2, text) is
        # followed too - an ending refuses it, and the operator's release of the
        # quarantine closes it later, which a watcher must see.
        maybe_open(finished),
    )


# A message's version as watchers order it (for `session_message m`).
_VERSION = (
    "COALESCE((SELECT MAX(d.version) FROM session_message_delta d WHERE d.message_id = m.id),"
    " m.version)"
)
# A snapshot's row: the message row as `_decode_message` takes it, then its versions.
_SNAPSHOT_COLUMNS = (
    "m.session_id, m.id, m.role, m.seq, m.data, m.execution_id, m.input_id, m.version,"
    f" {_VERSION}, m.finished"
)


# ---------------------------------------------------------------------------------------------
# PostgreSQL: this family's server-side functions (created by `_schema`'s migrations; see
# `_store.pg_functions` for their conventions)

PG_FUNCTIONS = r"""
-- The change scan without watched sessions (`changes`), in one call: STABLE, so its
-- statements read the one snapshot of the calling statement. Rows (kind, id, due_ms), in
-- this order: 'doorbell' for each session with a set doorbell and no claim row, not paused
-- and not in p_local, oldest wake first, at most p_limit; 'cancelling' for each claim of
-- this owner marked cancelling - among p_owned, or (p_scan) among all of the owner's;
-- 'gone' for each of p_owned with no claim row of this owner (not with p_scan); last one
-- 'due' row: ms until the earliest scheduled input falls due (<= 0: due; NULL: none).
CREATE OR REPLACE FUNCTION ts_changes(p_owner text, p_local text[], p_owned text[],
    p_scan boolean, p_limit bigint, p_now bigint, p_retry boolean)
RETURNS TABLE(kind text, id text, due_ms bigint)
LANGUAGE plpgsql STABLE AS $$
BEGIN
    IF p_limit > 0 THEN
        RETURN QUERY SELECT 'doorbell', s.id, NULL::bigint FROM session s
            WHERE s.time_woken IS NOT NULL AND s.time_paused IS NULL
            AND NOT EXISTS (SELECT 1 FROM session_execution e WHERE e.session_id = s.id)
            AND NOT (s.id = ANY(p_local))
            ORDER BY s.time_woken, s.id LIMIT p_limit;
        -- A claim handed back by a graceful shutdown that a recovery pass here would take
        -- over (the partial index of handed-back claims; `handed_back_condition`).
        RETURN QUERY SELECT 'handed_back', NULL::text, NULL::bigint
            WHERE EXISTS (SELECT 1 FROM session_execution e
                WHERE e.handed_back = 1 AND NOT (e.session_id = ANY(p_local))
                AND NOT EXISTS (SELECT 1 FROM session_recovery r WHERE r.execution_id = e.id
                    AND (r.recovery_error IS NOT NULL OR r.owner_id <> p_owner)));
    END IF;
    IF p_scan THEN
        RETURN QUERY SELECT 'cancelling', c.id, NULL::bigint FROM session_execution c
            WHERE c.owner_id = p_owner AND c.phase = 'cancelling';
    ELSIF cardinality(p_owned) > 0 THEN
        RETURN QUERY SELECT 'cancelling', c.id, NULL::bigint FROM session_execution c
            WHERE c.id = ANY(p_owned) AND c.owner_id = p_owner AND c.phase = 'cancelling';
        RETURN QUERY SELECT 'gone', o.e, NULL::bigint FROM unnest(p_owned) AS o(e)
            WHERE NOT EXISTS (SELECT 1 FROM session_execution c
                              WHERE c.id = o.e AND c.owner_id = p_owner);
    END IF;
    RETURN QUERY SELECT 'due', NULL::text,
        (SELECT MIN(i.due_at) FROM session_input i WHERE i.due_at IS NOT NULL) - ts_now(p_now);
END $$;
"""
