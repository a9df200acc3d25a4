"""A change look reads the messages it offers in one statement per chunk, not one or two each
(DESIGN §6.26: work per change proportional to the change). A catch-up look of
`NEW_PER_LOOK` new messages read each one by its id, and the text streamed onto each
assistant message by one more: ~150 statements, each a round trip on PostgreSQL inside the
look's read transaction. Counted by a wrapper of the look's `Tx`, on both backends; what the
look offers is compared with the one-by-one read (`_snapshot`)."""

from __future__ import annotations

import importlib
import json
from typing import Any

import pytest
from backends import EngineDb, write_many

from trio_sessions import AssistantData, TextPart, _codec
from trio_sessions._backend import Tx
from trio_sessions._errors import MalformedRecord
from trio_sessions._store.changes import (
    NEW_PER_LOOK,
    Followed,
    Snapshot,
    Watched,
    watched_changes,
)
from trio_sessions._store.common import ROW_UNITS

ANSWER = {"parts": [{"type": "text", "text": "an answer " * 16}], "finished": True, "error": None}
QUESTION = {"text": "a question " * 16}
INSERT_MESSAGE = (
    "INSERT INTO session_message(id, session_id, role, seq, data, time_created, time_updated,"
    " version, finished) VALUES (?, ?, ?, ?, ?, 0, 0, ?, ?)"
)
# The module (`_store.changes` is also the name of its function, which `_store` exports).
changes = importlib.import_module("trio_sessions._store.changes")
INSERT_DELTA = "INSERT INTO session_message_delta(message_id, version, text) VALUES (?, ?, ?)"


class Counted:
    """A look's `Tx`, every statement it runs recorded."""

    def __init__(self, tx: Tx) -> None:
        self._tx = tx
        self.statements: list[str] = []

    def execute(self, sql: str, params: Any = ()) -> Any:
        self.statements.append(sql)
        return self._tx.execute(sql, params)

    def one(self, sql: str, params: Any = ()) -> Any:
        self.statements.append(sql)
        return self._tx.one(sql, params)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tx, name)


def _seed(engine: EngineDb, session_id: str, count: int) -> None:
    """Messages 1..count, questions and finished answers in turn (~200 bytes each)."""
    engine.write("INSERT INTO session(id, time_created) VALUES (?, 0)", (session_id,))
    write_many(
        engine.location,
        INSERT_MESSAGE,
        [
            (
                f"{session_id}-{seq}",
                session_id,
                "user" if seq % 2 else "assistant",
                seq,
                json.dumps(QUESTION if seq % 2 else ANSWER),
                seq,
                1,
            )
            for seq in range(1, count + 1)
        ],
    )


def _counted_look(tx: Tx, watched: dict[str, Followed]) -> tuple[list[str], Watched]:
    counted = Counted(tx)
    found = watched_changes(counted, watched)
    return counted.statements, found


def test_a_catch_up_look_reads_its_new_messages_in_one_statement(engine: EngineDb) -> None:
    """A session `NEW_PER_LOOK` messages past its covered one: the look offers every one,
    in seq order and decoded, in two statements - the rows' ids, then the messages whole.
    It ran one statement per message and one more per answer (151)."""
    _seed(engine, "s", NEW_PER_LOOK + 1)
    statements, found = engine.engine.read(_counted_look, {"s": Followed(1, "s-1", {}, {})})
    assert [m.seq for m in found.messages] == list(range(2, NEW_PER_LOOK + 2))
    for snapshot in found.messages:
        assert not isinstance(snapshot.message, MalformedRecord), snapshot
        assert not snapshot.open and snapshot.version == snapshot.row_version == snapshot.seq
        if snapshot.seq % 2:
            assert snapshot.message.data == QUESTION
        else:
            assert snapshot.message.data == AssistantData(
                (TextPart("an answer " * 16),), True, None
            )
    assert found.heads == {"s": (NEW_PER_LOOK + 1, f"s-{NEW_PER_LOOK + 1}")}
    assert len(statements) == 2, statements


def _shown(snapshot: Snapshot) -> Any:
    """A snapshot comparable by value (a `MalformedRecord` is compared by its reasons)."""
    message = snapshot.message
    if isinstance(message, MalformedRecord):
        return (snapshot, message.table, message.key, message.reasons)
    return snapshot


def _one_by_one(tx: Tx, ids: list[Any]) -> list[Any]:
    return [_shown(changes._snapshot(tx, message_id)) for message_id in ids]


def _batched(tx: Tx, ids: list[Any]) -> tuple[list[Any], list[str]]:
    counted = Counted(tx)
    read = changes._snapshots(counted, [(message_id, None) for message_id in ids])
    return [_shown(snapshot) for snapshot in read], counted.statements


def _replace(snapshot: Any) -> Any:
    """`_shown` with its `MalformedRecord` instance left out (compared by its fields)."""
    if isinstance(snapshot, tuple):
        return (snapshot[0].session_id, snapshot[0].message_id, snapshot[0].seq, *snapshot[1:])
    return snapshot


def test_the_batch_reads_what_the_one_by_one_read_does(engine: EngineDb) -> None:
    """Messages of every kind a look meets, read in one batch and one by one: the same
    snapshots, in the order asked (a repeated id too). An open answer's streamed text is
    merged in version order, and only the answers with streamed text cost a read of it."""
    engine.write("INSERT INTO session(id, time_created) VALUES ('s', 0)")
    finished = json.dumps(ANSWER)
    opened = json.dumps({"parts": [], "finished": False, "error": None})
    rows = [
        ("q", "user", 1, json.dumps(QUESTION), 1, 1),
        ("a", "assistant", 2, finished, 2, 1),
        ("open", "assistant", 3, opened, 3, 0),
        ("bare", "assistant", 4, opened, 4, 0),  # open, nothing streamed yet
        ("bad", "assistant", 5, "{not json", 5, 1),
        ("open2", "assistant", 6, opened, 6, 0),
    ]
    write_many(engine.location, INSERT_MESSAGE, [("" + r[0], "s", *r[1:]) for r in rows])
    # Written out of version order: the merge follows the version, not the insert.
    write_many(
        engine.location,
        INSERT_DELTA,
        [("open", 9, "c"), ("open", 7, "a"), ("open", 8, "b"), ("open2", 10, "x")],
    )
    ids = ["open", "q", "a", "bare", "bad", "open2", "q"]
    one = engine.engine.read(_one_by_one, ids)
    batch, statements = engine.engine.read(_batched, ids)
    assert [_replace(s) for s in batch] == [_replace(s) for s in one]
    by_id = {s.message_id: s for s in batch if not isinstance(s, tuple)}
    assert by_id["open"].message.data.parts == (TextPart("abc"),)
    assert by_id["open"].version == 9 and by_id["open"].row_version == 3
    assert by_id["open"].open and not by_id["a"].open
    assert by_id["open2"].message.data.parts == (TextPart("x"),)
    # The messages whole, then the text streamed onto the two answers that have some.
    assert len(statements) == 2, statements


@pytest.mark.sqlite_only("SQLite keeps what another tool writes; PostgreSQL's types refuse it")
def test_a_malformed_streamed_text_is_reported_as_the_one_by_one_read_does(
    engine: EngineDb,
) -> None:
    """SQLite keeps what another tool writes: a delta that is a BLOB, or whose version is
    no whole number, makes the batch read that message's texts row by row and report it
    as `_snapshot` does (a `MalformedRecord` naming the delta); the others stay merged."""
    engine.write("INSERT INTO session(id, time_created) VALUES ('s', 0)")
    opened = json.dumps({"parts": [], "finished": False, "error": None})
    write_many(
        engine.location,
        INSERT_MESSAGE,
        [(f"m{seq}", "s", "assistant", seq, opened, seq, 0) for seq in range(1, 4)],
    )
    engine.write(
        "INSERT INTO session_message_delta(message_id, version, text)"
        " VALUES ('m1', 5, 'fine'), ('m2', 6, CAST('x' AS BLOB)), ('m3', 'late', 'y'),"
        " ('m3', 7, 'z')"
    )
    ids = ["m1", "m2", "m3"]
    one = engine.engine.read(_one_by_one, ids)
    batch, _ = engine.engine.read(_batched, ids)
    assert [_replace(s) for s in batch] == [_replace(s) for s in one]
    assert batch[0].message.data.parts == (TextPart("fine"),)
    assert [s[1] for s in batch[1:]] == ["session_message_delta"] * 2
    assert "is bytes" in batch[1][3][0] and "no whole number" in batch[2][3][0]


@pytest.mark.sqlite_only("the loop's budget: SQLite's executor runs a look on the event loop")
def test_a_look_over_the_loop_budget_stops_before_it_reads_a_message(
    engine: EngineDb,
) -> None:
    """On the event loop (a budget set: SQLite's executor), a look meeting more messages
    than the budget allows raises `OffTheLoop` - to run again in the worker thread - having
    charged their rows and sizes first, before it read any of them whole. It read them one
    by one until decoding one overspent."""
    _seed(engine, "s", NEW_PER_LOOK + 1)

    def look(tx: Tx) -> list[str]:
        counted = Counted(tx)
        with _codec.loop_budget(ROW_UNITS * NEW_PER_LOOK // 2), pytest.raises(_codec.OffTheLoop):
            watched_changes(counted, {"s": Followed(1, "s-1", {}, {})})
        return counted.statements

    statements = engine.engine.read(look)
    whole = [sql for sql in statements if "m.data" in sql and "length(m.data)" not in sql]
    assert whole == [], statements


@pytest.mark.sqlite_only("SQLite's query plan")
def test_the_batch_joins_each_messages_texts_by_the_primary_key(engine: EngineDb) -> None:
    """SQLite joins the texts streamed onto several messages in one `GROUP BY` statement,
    in the order it reads their rows: the plan is the one-message join's (the primary key
    (message_id, version), no sorter), so each message's texts join in version order."""
    plan = engine.rows(f"EXPLAIN QUERY PLAN {changes._join_streamed_of(3)}", ("a", "b", "c"))
    assert [row[3] for row in plan] == [
        "SEARCH session_message_delta USING PRIMARY KEY (message_id=?)"
    ], plan
