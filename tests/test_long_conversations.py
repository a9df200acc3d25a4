"""Conversation control on a long conversation (DESIGN §5.1, §6.26, §7): `fork`, `truncate`,
`delete_session` and `purge` of a session holding thousands of messages.

A chat product branches, edits and erases long conversations while others stream. Their
work is the copy or the delete itself - but on PostgreSQL a fork that sends a statement per
message holds the source's session lock for as many round trips (its live answer's every
append waits behind them), and on SQLite an operation the executor runs on the event loop
must not take it for longer than the 50 ms the library may (§7): a long one goes to the
worker thread, as a large message's write does (`_codec.loop_budget`).

Round trips are counted on the wire (`_bench.roundtrips`); loop steps by CPU time on the
event loop's thread (`StepMeter`, as tests/test_work_per_change.py), real time bounded.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio
from helpers import Raw, pg_raw, runtime
from trio.testing import MockClock

import trio_sessions
from trio_sessions import AssistantData, Store, TextPart, _store
from trio_sessions._bench.load import StepMeter
from trio_sessions._bench.roundtrips import counting_url
from trio_sessions._postgres import open_engine
from trio_sessions._postgres.engine import PgSyncEngine
from trio_sessions._store.control import PURGE_ROWS

BOUND = 60.0  # seconds of real time; the machine may be shared and slow
STALL_S = 0.050  # DESIGN §7: no event-loop stall above 50 ms from the library
LONG = 20_000  # DESIGN §7's long transcript
REPLY = json.dumps(
    {"parts": [{"type": "text", "text": "an answer " * 8}], "finished": True, "error": None}
)


def conversation(session_id: str, count: int) -> list[tuple[Any, ...]]:
    """`count` finished messages, questions and answers in turn, as rows to insert."""
    return [
        (
            f"{session_id}-{seq}",
            session_id,
            "user" if seq % 2 else "assistant",
            seq,
            json.dumps({"text": f"question {seq}"}) if seq % 2 else REPLY,
        )
        for seq in range(1, count + 1)
    ]


INSERT_MESSAGE = (
    "INSERT INTO session_message(id, session_id, role, seq, data, time_created,"
    " time_updated, finished) VALUES (%s, %s, %s, %s, %s, 0, 0, 1)"
)


def round_trips_of(proxy: Any, engine: PgSyncEngine, op: Any, *args: Any) -> int:
    before = proxy.round_trips
    engine.run(op, *args)
    return int(proxy.round_trips - before)


def test_a_fork_costs_the_same_round_trips_however_long_the_conversation(
    pg_url: str, migrated_schema: str
) -> None:
    """On PostgreSQL a fork sent one INSERT per message copied, in the transaction that holds
    the source's session lock: forking a 20,000-message conversation took ~5 s here, and
    the answer being streamed into it waited that long at its next append. The copy is
    one statement (only a still-open answer, which is merged and closed, is copied row by
    row): the same round trips for 2 messages as for 300."""
    with pg_raw(pg_url, migrated_schema) as conn:
        for session_id, count in (("short", 2), ("long", 300)):
            conn.execute("INSERT INTO session(id, time_created) VALUES (%s, 0)", (session_id,))
            with conn.cursor() as cursor:
                cursor.executemany(INSERT_MESSAGE, conversation(session_id, count))
    with counting_url(pg_url) as (url, proxy):
        engine = open_engine(url, schema=migrated_schema)
        try:
            counted = functools.partial(round_trips_of, proxy, engine)
            short = counted(_store.fork, "short", "short-branch", None)
            long = counted(_store.fork, "long", "long-branch", None)
            assert long == short, (short, long)
            copied = engine.run(_store.read_transcript, "long-branch")
        finally:
            engine.close()
    assert [(m.seq, m.role) for m in copied] == [
        (seq, "user" if seq % 2 else "assistant") for seq in range(1, 301)
    ]
    assert copied[1].data == AssistantData((TextPart("an answer " * 8),), True, None)
    assert copied[0].data == {"text": "question 1"}


def seed_sqlite(db: Path, session_id: str, count: int) -> None:
    Raw(db).write("INSERT INTO session(id, time_created) VALUES (?, 0)", (session_id,))
    Raw(db).write_many(INSERT_MESSAGE.replace("%s", "?"), conversation(session_id, count))


@pytest.mark.serial
@pytest.mark.parametrize("operation", ["fork", "truncate", "delete_session", "purge"])
async def test_control_of_a_long_conversation_never_stalls_the_loop(
    tmp_path: Path, operation: str
) -> None:
    """SQLite runs an operation on the event loop when the write lock is free: forking,
    truncating, deleting or purging a 20,000-message conversation took 90-400 ms of the
    loop's CPU here, every other chat's stream frozen meanwhile. Such an operation goes
    to the worker thread; what it did is the same. Real time, bounded."""
    db = tmp_path / "s.db"
    async with trio_sessions.open_runtime(db, None):
        pass
    seed_sqlite(db, "long", LONG)
    calls = {
        "fork": lambda rt: rt.fork("long", "branch"),
        "truncate": lambda rt: rt.truncate("long", after_seq=2),
        "delete_session": lambda rt: rt.delete_session("long"),
        "purge": lambda rt: rt.purge(idle_for=0),
    }
    with trio.fail_after(BOUND):
        async with trio_sessions.open_runtime(db, None) as rt:
            with StepMeter() as meter:
                result = await calls[operation](rt)
            left = {
                session_id: len(await rt.transcript(session_id))
                for session_id in ("long", "branch")
            }
    want = {
        "fork": (None, {"long": LONG, "branch": LONG}),
        "truncate": (LONG - 2, {"long": 2, "branch": 0}),
        "delete_session": (True, {"long": 0, "branch": 0}),
        "purge": (1, {"long": 0, "branch": 0}),
    }
    assert (result, left) == want[operation]
    assert meter.longest_cpu < STALL_S, meter.longest_cpu


APPENDS = 200_000  # a long answer streamed word by word: one delta row per append


@pytest.mark.serial
@pytest.mark.parametrize("operation", ["fork", "truncate", "delete_session"])
async def test_control_of_a_long_streamed_answer_never_stalls_the_loop(
    tmp_path: Path, operation: str
) -> None:
    """As above, for an open answer's streamed text: one row per append, 200,000 of them in
    one message never finished (its owner died). A fork reads and merges them (the copy is
    finished "interrupted" with every word), a truncate or a delete deletes them: each
    goes to the worker thread, no task step of the library above 50 ms of CPU (a fork took
    ~200 ms of the loop, truncate and delete 146-244 ms)."""
    db = tmp_path / "s.db"
    async with trio_sessions.open_runtime(db, None):
        pass
    raw = Raw(db)
    raw.write("INSERT INTO session(id, time_created) VALUES ('long', 0)")
    raw.write(
        "INSERT INTO session_message(id, session_id, role, seq, data, time_created,"
        " time_updated, finished) VALUES ('open', 'long', 'assistant', 1, ?, 0, 0, 0)",
        (json.dumps({"parts": [], "finished": False, "error": None}),),
    )
    raw.write_many(
        "INSERT INTO session_message_delta(message_id, version, text) VALUES ('open', ?, 'w ')",
        [(version,) for version in range(1, APPENDS + 1)],
    )
    with trio.fail_after(BOUND):
        async with trio_sessions.open_runtime(db, None, recovery_interval=3600.0) as rt:
            with StepMeter() as meter:
                if operation == "fork":
                    await rt.fork("long", "branch")
                elif operation == "truncate":
                    assert await rt.truncate("long", after_seq=0) == 1
                else:
                    assert await rt.delete_session("long")
            if operation == "fork":
                [copied] = await rt.transcript("branch")
                interrupted = AssistantData((TextPart("w " * APPENDS),), True, "interrupted")
                assert (copied.seq, copied.data) == (1, interrupted)
            else:
                assert await rt.transcript("long") == []
                assert raw.rows("SELECT COUNT(*) FROM session_message_delta") == [(0,)]
    assert meter.longest_cpu < STALL_S, meter.longest_cpu


async def test_a_purge_batch_deletes_a_bounded_number_of_messages(
    store: Store,
    clock: Callable[[], float],
    db_path: Any,
    autojump_clock: MockClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`purge` runs "in short transactions that never hold up a drain" - but a batch was
    bounded by sessions alone (200): purging 200 old conversations of 500 messages each
    on SQLite held the write lock ~0.7 s in one transaction, and a live answer's append
    waited that long. A batch also stops once the messages it deletes pass
    `PURGE_ROWS` (one long session alone still goes whole: a session is deleted at
    once), and the next batch goes on after the last session it deleted."""
    raw = Raw(db_path)
    sizes = {f"old-{index}": 1_500 for index in range(4)} | {"old-4": 30, "old-5": 2}
    batches: list[int] = []
    real = _store.purge_batch

    def counted(tx: Any, *args: Any) -> Any:
        before = dict(
            tx.execute("SELECT session_id, COUNT(*) FROM session_message GROUP BY session_id")
        )
        deleted, after = real(tx, *args)
        batches.append(sum(before.get(session_id, 0) for session_id in deleted))
        return deleted, after

    monkeypatch.setattr(_store, "purge_batch", counted)
    async with runtime(store, None, clock) as rt:
        for session_id, count in sizes.items():
            raw.write("INSERT INTO session(id, time_created) VALUES (?, 0)", (session_id,))
            raw.write_many(INSERT_MESSAGE.replace("%s", "?"), conversation(session_id, count))
        await rt.submit("recent", {"n": 1})
        await trio.sleep(100)
        await rt.submit("recent", {"n": 2})
        assert await rt.purge(idle_for=50) == len(sizes)
    assert sum(batches) == sum(sizes.values())
    assert max(batches) <= PURGE_ROWS + 1_500, batches
    assert [row[0] for row in raw.rows("SELECT id FROM session")] == ["recent"]
