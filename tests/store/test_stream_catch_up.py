"""`stream_catch_up`: the change scan's one read for many streams behind (DESIGN §5.2,
§6.26). For each position it answers exactly what that stream's own read
(`stream_changes`) would, or None - "read it yourself" - never anything else; streams that
only miss appends to the open messages they follow (a chat's answer, word after word) are
always answered, and on SQLite those cost the same few statements however many there are.
A stream's own read fetches rows in proportion to what it missed, not to the transcript.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

import attrs
import pytest

from trio_sessions import _sqlite, _store, _transcript
from trio_sessions._bench.load import seed_transcript
from trio_sessions._store import stream as stream_family
from trio_sessions._store.stream import (
    Appended,
    Held,
    Position,
    Stepped,
    message_tag,
    stream_catch_up,
    stream_changes_by_statements,
)

from .common import Db


def following(db: Db, index: int, words: int = 1) -> tuple[str, Position]:
    """Session `s<index>` with an open answer; the position of a stream holding the user
    message and the answer's first `words` words, after which "more " was appended."""
    session, execution, message = f"s{index}", f"e{index}", f"m{index}"
    db.run(_store.submit, session, '{"n": 1}', f"in-{index}")
    db.run(_store.acquire, session, execution, "me", 60_000)
    db.run(_store.take_inputs, session, execution, "me")
    seq = db.run(_store.begin_assistant, session, execution, "me", message)
    for n in range(words):
        db.run(_store.append_assistant_text, session, execution, "me", message, f"w{n} ")
    version = db.engine.read(_store.stream_changes, session, Position()).changes[-1].version
    db.run(_store.append_assistant_text, session, execution, "me", message, "more ")
    tag = message_tag(message)
    return session, Position(seq, tag, (Held(seq, tag, version),))


def test_a_catch_up_answers_each_stream_as_its_own_read_would(db: Db) -> None:
    """Appends missed (one, or several words behind), nothing missed, two streams of one
    session at different versions: answered, and equal to each stream's own read. A
    finished answer (sent whole), a new message past the top, a rewritten transcript:
    None or that same answer - and a rewritten transcript always None."""
    reads = [following(db, index, words=index + 1) for index in range(3)]
    session, position = reads[0]
    held = position.open[0]
    reads.append((session, attrs.evolve(position, open=(attrs.evolve(held, version=0),))))
    newest = db.engine.read(stream_changes_by_statements, *reads[1]).changes[-1].version
    up_to_date = attrs.evolve(reads[1][1].open[0], version=newest)
    reads.append((reads[1][0], attrs.evolve(reads[1][1], open=(up_to_date,))))
    appends_only = len(reads)
    # Finished since: the answer is folded and goes whole.
    finished_session, finished_at = following(db, 3)
    db.run(
        _store.update_assistant,
        finished_session,
        "e3",
        "me",
        "m3",
        lambda data: attrs.evolve(data, finished=True),
    )
    reads.append((finished_session, finished_at))
    # A new message past the top: the stream holds only the user message.
    reads.append((reads[2][0], Position(1, db.engine.read(_first_tag, reads[2][0]))))
    # Rewritten: the top message is gone.
    reads.append(("s0", Position(7, message_tag("gone"))))

    answers = db.engine.read(stream_catch_up, reads)

    assert len(answers) == len(reads)
    for index, ((session, position), answer) in enumerate(zip(reads, answers, strict=True)):
        own = db.engine.read(stream_changes_by_statements, session, position)
        if index < appends_only:
            assert answer == own, index
        else:
            assert answer is None or answer == own, index
    assert answers[-1] is None
    texts = [
        [change.text for change in answer.changes if isinstance(change, Appended)]
        for answer in answers[:appends_only]
        if answer is not None
    ]
    assert texts == [["more "], ["more "], ["more "], ["w0 ", "more "], []]


def test_a_read_far_behind_in_an_open_answer_sends_its_appends_in_pages(
    db: Db, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A position many words behind in an open answer: each read sends at most
    `DELTAS_PER_READ` appends, in order, with `more` while others are left (the new message
    after them waits for the last page), and reading on from each page's end gives every
    word exactly once - on either backend (PostgreSQL's one-call read pages what its
    function returns). The change scan's catch-up answers such a stream as its own read
    would, or None on SQLite (it reads by itself). Found by an audit: every missed delta
    came in one read, turned into events in one step of the event loop (~110 ms for
    100,000 words)."""
    monkeypatch.setattr(stream_family, "DELTAS_PER_READ", 3)
    session, position = following(db, 0, words=1)
    for n in range(1, 8):
        db.run(_store.append_assistant_text, session, "e0", "me", "m0", f"x{n} ")
    [caught] = db.engine.read(stream_catch_up, [(session, position)])
    assert caught in (None, db.engine.read(_store.stream_changes, session, position))
    db.run(_store.submit, session, '{"n": 2}', "in-next")
    db.run(_store.take_inputs, session, "e0", "me")
    pages: list[list[str]] = []
    while True:
        answer = db.engine.read(_store.stream_changes, session, position)
        assert answer == db.engine.read(stream_changes_by_statements, session, position)
        appended = [change for change in answer.changes if isinstance(change, Appended)]
        pages.append([change.text for change in appended])
        assert len(appended) <= 3
        if not answer.more:
            break
        assert len(answer.changes) == len(appended)  # nothing new before the last page
        held = attrs.evolve(position.open[0], version=appended[-1].version)
        position = attrs.evolve(position, open=(held,))
    assert pages == [["more ", "x1 ", "x2 "], ["x3 ", "x4 ", "x5 "], ["x6 ", "x7 "]]
    assert [type(change).__name__ for change in answer.changes[2:]] == ["Whole"]


def test_a_read_far_behind_fetches_one_page_of_appends_not_every_missed_one(db: Db) -> None:
    """A stream 6,000 words behind in an open answer: each read fetches one page of
    appends and one more (to say `more`), not every missed delta - PostgreSQL's one-call
    read returned them all and cut the page in Python, so a reader far behind fetched the
    rest again at every page (a transfer growing with the square of the backlog)."""
    session, position = following(db, 0, words=1)
    [(newest,)] = db.rows("SELECT MAX(version) FROM session_message_delta")
    for start in range(0, 6_000, 1_000):  # the words, written straight into the table
        db.write(
            "INSERT INTO session_message_delta(message_id, version, text) VALUES "
            + ", ".join(f"('m0', {newest + 1 + n}, 'x ')" for n in range(start, start + 1_000))
        )
    answer = db.engine.read(_store.stream_changes, session, position)
    appended = [change for change in answer.changes if isinstance(change, Appended)]
    assert answer.more and len(appended) == stream_family.DELTAS_PER_READ
    if db.dialect == "postgres":
        rows = db.engine.read(
            lambda tx: tx.call(
                "ts_stream_changes", *stream_family._pg_arguments(session, position, 1).values()
            )
        )
        assert sum(row[0] == "append" for row in rows) == stream_family.DELTAS_PER_READ + 1


def test_a_catch_up_sends_one_reads_worth_of_appends_in_all(
    db: Db, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Streams each many words behind, caught up together: at most `DELTAS_PER_READ`
    appends for them all, the others left to read by themselves (None). A stream makes the
    events of every answer in one step of the event loop: ten streams 4,000 words behind
    took 155 ms (a review's find); a stream's own reads page them, a step each."""
    monkeypatch.setattr(stream_family, "DELTAS_PER_READ", 4)
    reads = [following(db, index) for index in range(3)]
    for index, (session, _) in enumerate(reads):
        for _ in range(2):  # three words behind each, with "more "
            db.run(_store.append_assistant_text, session, f"e{index}", "me", f"m{index}", "x ")
    answers = db.engine.read(stream_catch_up, reads)
    assert answers[1:] == [None, None]
    assert answers[0] is not None
    appended = [change for change in answers[0].changes if isinstance(change, Appended)]
    assert [change.text for change in appended] == ["more ", "x ", "x "]


@pytest.mark.sqlite_only("SQLite's query plan")
def test_the_streamed_texts_join_in_version_order_by_the_primary_key(db: Db) -> None:
    """SQLite joins a message's streamed texts with `group_concat`, in the order the rows
    are read: by the primary key (message_id, version). An index that covered `text` would
    read them in text order (a review measured "z0 z1 z10 ...") - this pins the plan, and
    the order it gives."""
    [(_, _, _, plan)] = db.rows(f"EXPLAIN QUERY PLAN {stream_family.JOIN_STREAMED}", ("m0",))
    assert "USING PRIMARY KEY (message_id=?)" in plan, plan
    following(db, 0, words=12)
    [(_, joined)] = db.rows(stream_family.JOIN_STREAMED, ("m0",))
    assert joined == "".join(f"w{n} " for n in range(12)) + "more "


def test_a_position_naming_one_seq_under_two_tags_reads_as_rewritten_everywhere(
    db: Db,
) -> None:
    """A position whose open message is its top one under another tag (no stream makes
    one: `decode_cursor` refuses it) names a message that is not there: every read answers
    from scratch - the statements, PostgreSQL's one call, the catch-up - the same on both
    backends. Found by an audit: PostgreSQL's one call kept one tag per seq (the open
    message's) and carried on from the bogus position."""
    session, position = following(db, 0)
    forged = attrs.evolve(position, top_tag="0" * 12)
    for read in (_store.stream_changes, stream_changes_by_statements):
        assert db.engine.read(read, session, forged).rewritten, read
    assert db.engine.read(stream_catch_up, [(session, forged)]) == [None]


def _first_tag(tx: Any, session_id: str) -> str:
    [(message_id,)] = tx.execute(
        "SELECT id FROM session_message WHERE session_id = ? AND seq = 1", (session_id,)
    ).fetchall()
    return message_tag(str(message_id))


class Counting:
    """A connection that counts the statements sent through it."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn
        self.statements: Counter[str] = Counter()

    def execute(self, sql: str, params: Any = ()) -> Any:
        self.statements[re.sub(r"\s+", " ", sql)] += 1
        return self._conn.execute(sql, params)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


@pytest.mark.sqlite_only("counts SQLite statements")
def test_catching_up_many_streams_costs_the_statements_of_one(db: Db) -> None:
    """SQLite: the streams that only miss appends are caught up set-wise - the same
    statements for 30 streams as for 2, not a read per stream."""

    def statements(reads: list[tuple[str, Position]]) -> int:
        counting: list[Counting] = []

        def counted(tx: Any, reads: list[tuple[str, Position]]) -> Any:
            conn = Counting(tx.conn)
            counting.append(conn)
            answers = stream_catch_up(_sqlite.SQLiteTx(conn, tx.now), reads)  # type: ignore[arg-type]
            assert all(answer is not None for answer in answers)
            return answers

        db.engine.read(counted, reads)
        return sum(counting[0].statements.values())

    reads = [following(db, index) for index in range(30)]
    assert statements(reads[:2]) == statements(reads)


def test_the_one_step_missed_is_sent_and_an_unreadable_one_sends_the_message_whole(
    db: Db,
) -> None:
    """A stream one version behind a tool change gets the recorded step ("part") and the
    appends after it, from its own read and from a catch-up (the same answer, or None).
    A step row that does not decode costs that message only: the message whole, never
    a rewritten transcript (which would send every message again)."""
    session, position = following(db, 0)
    held = position.open[0]
    behind = db.engine.read(stream_changes_by_statements, session, position).changes[-1].version
    at = attrs.evolve(position, open=(attrs.evolve(held, version=behind),))
    db.run(
        _store.update_assistant,
        session,
        "e0",
        "me",
        "m0",
        lambda data: _transcript.start_tool(data, "c1", "look", {}),
    )
    db.run(_store.append_assistant_text, session, "e0", "me", "m0", "after ")
    own = db.engine.read(_store.stream_changes, session, at)
    stepped, appended = own.changes
    assert isinstance(stepped, Stepped) and isinstance(appended, Appended)
    assert stepped.step[0] == "part" and stepped.step[1].call_id == "c1"
    assert db.engine.read(stream_changes_by_statements, session, at) == own
    [caught] = db.engine.read(stream_catch_up, [(session, at)])
    assert caught in (None, own)
    db.write("UPDATE session_message_change SET data = 'not json'")
    for read in (_store.stream_changes, stream_changes_by_statements):
        answer = db.engine.read(read, session, at)
        assert not answer.rewritten
        assert [type(change).__name__ for change in answer.changes] == ["Whole"]


class Fetching:
    """A connection that counts the rows its statements hand back."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn
        self.rows = 0

    def execute(self, sql: str, params: Any = ()) -> Any:
        return _FetchingCursor(self._conn.execute(sql, params), self)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


class _FetchingCursor:
    def __init__(self, cursor: Any, counter: Fetching) -> None:
        self._cursor = cursor
        self._counter = counter

    def fetchone(self) -> Any:
        row = self._cursor.fetchone()
        self._counter.rows += row is not None
        return row

    def fetchall(self) -> list[Any]:
        rows = self._cursor.fetchall()
        self._counter.rows += len(rows)
        return list(rows)

    def __iter__(self) -> Any:
        for row in self._cursor:
            self._counter.rows += 1
            yield row

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cursor, name)


def rows_fetched(db: Db, session_id: str, position: Position) -> tuple[int, Any]:
    """The rows a stream's own read (`stream_changes`, SQLite) fetches, and its answer."""
    fetching: list[Fetching] = []

    def counted(tx: Any, session_id: str, position: Position) -> Any:
        conn = Fetching(tx.conn)
        fetching.append(conn)
        return _store.stream_changes(_sqlite.SQLiteTx(conn, tx.now), session_id, position)  # type: ignore[arg-type]

    answer = db.engine.read(counted, session_id, position)
    return fetching[0].rows, answer


@pytest.mark.sqlite_only("counts the rows SQLite hands back")
def test_a_read_near_the_end_of_a_long_transcript_fetches_only_the_new_message(db: Db) -> None:
    """DESIGN §6.26: a stream one message behind at the end of a 2,000-message transcript
    is caught up by fetching a few rows (its top message's id, the new message), not the
    transcript: the new messages are selected by seq in SQL, not filtered in Python."""
    seed_transcript(db.path, "long", 2_000)
    [(top_id,)] = db.rows("SELECT id FROM session_message WHERE seq = 1999")
    fetched, answer = rows_fetched(db, "long", Position(1999, message_tag(str(top_id))))
    assert [change.seq for change in answer.changes] == [2000] and not answer.rewritten
    assert fetched <= 3, fetched


@pytest.mark.sqlite_only("counts the rows SQLite hands back")
def test_a_read_of_an_answer_with_many_deltas_fetches_only_the_missed_one(db: Db) -> None:
    """DESIGN §6.26: a stream one word behind on an open answer of 500 streamed words gets
    that word by fetching a few rows (the message's id and version, the one new delta),
    not every delta of the answer: the deltas are selected by version in SQL."""
    session, position = following(db, 0, words=500)
    fetched, answer = rows_fetched(db, session, position)
    assert [change.text for change in answer.changes] == ["more "]
    assert fetched <= 4, fetched
