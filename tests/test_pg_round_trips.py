"""Round trips to PostgreSQL, counted on the wire (DESIGN §7, §8 "One round trip per
operation"): a sequential cycle costs at most 3, a chat turn (take inputs, begin, 40 appends,
finish) at most 50, on every connection the runtime opens. Counted by the bench's relay
(`trio_sessions._bench.roundtrips`), so the count does not trust the library's bookkeeping."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any

import psycopg
import pytest
import trio
from backends import finish_iteration
from helpers import pg_raw

from trio_sessions import DrainContext, LeaseLost, SessionBusy, _codec, _store, _transcript
from trio_sessions._backend import Job
from trio_sessions._bench.postgres import seed_expired
from trio_sessions._bench.roundtrips import (
    RoundTripProxy,
    counted_runtime,
    counting_url,
    round_trips_per_cycle,
    turn_round_trips,
)
from trio_sessions._bench.tools import wait_all_idle
from trio_sessions._postgres import open_engine
from trio_sessions._postgres.engine import PgSyncEngine
from trio_sessions._store.changes import NO_CHANGE, Changes, Followed, changes_by_statements
from trio_sessions._store.stream import (
    NEW_MESSAGES_PER_READ,
    Held,
    Position,
    _pg_arguments,
    message_tag,
    stream_changes_by_statements,
)
from trio_sessions._store.transcript import read_transcript_by_statements


def round_trips_of(
    proxy: RoundTripProxy, engine: PgSyncEngine, op: Any, *args: Any
) -> tuple[int, Any]:
    """The round trips `op` alone costs on the wire, and its result - its refusal
    (`SessionBusy`) as the result, if it refused."""
    before = proxy.round_trips
    try:
        result = engine.run(op, *args)
    except SessionBusy as exc:
        result = exc
    return proxy.round_trips - before, result


def test_relay_counts_one_round_trip_per_wait_for_the_server(pg_url: str) -> None:
    """The counter itself: a statement in autocommit is one round trip, a psycopg
    transaction with one statement is three (BEGIN, the statement, COMMIT)."""
    with counting_url(pg_url) as (url, proxy), psycopg.connect(url, autocommit=True) as conn:
        before = proxy.round_trips
        conn.execute("SELECT 1").fetchone()
        assert proxy.round_trips - before == 1
        conn.autocommit = False
        before = proxy.round_trips
        conn.execute("SELECT 1").fetchone()
        conn.commit()
        assert proxy.round_trips - before == 3


def test_sequential_cycle_is_at_most_three_round_trips(pg_url: str, migrated_schema: str) -> None:
    assert trio.run(round_trips_per_cycle, pg_url, migrated_schema, 5) <= 3


def test_chat_turn_is_at_most_fifty_round_trips(pg_url: str, migrated_schema: str) -> None:
    assert trio.run(turn_round_trips, pg_url, migrated_schema, 1) <= 50


def test_an_iteration_end_alone_is_one_round_trip_unless_it_continues(
    pg_url: str, migrated_schema: str
) -> None:
    """An iteration's end alone (`end_iteration`: the sequential cycle's release) is one
    `ts_finish` call in autocommit: one round trip, a release, a pause and a lost lease
    alike. A continue takes the doorbell, which a retry after a lost reply could not tell
    from a doorbell never set: the call refuses it (nothing written) and it runs in a
    transaction - BEGIN with the call, then COMMIT."""
    now = [1_000.0]  # the lease clock (s), moved past "lapsed"'s lease below
    with counting_url(pg_url) as (url, proxy):
        engine = open_engine(url, schema=migrated_schema, clock=lambda: now[0])
        try:

            def ended(session: str, *, lapsed: bool = False) -> tuple[str, int]:
                before = proxy.round_trips
                try:
                    verdict = engine.run(_store.end_iteration, session, f"e-{session}", "me")
                except LeaseLost:
                    return "lease_lost", proxy.round_trips - before
                return verdict.value, proxy.round_trips - before

            for session in ("release", "continue", "pause", "lapsed"):
                engine.run(_store.submit, session, '{"n": 1}', f"in-{session}")
                lease = 10_000 if session == "lapsed" else 60_000
                engine.run(_store.acquire, session, f"e-{session}", "me", lease)
                engine.run(_store.take_inputs, session, f"e-{session}", "me")
            engine.run(_store.wake, "continue")
            engine.run(_store.pause, "pause")
            now[0] += 20.0
            assert ended("release") == ("release", 1)
            assert ended("pause") == ("pause", 1)
            assert ended("lapsed") == ("lease_lost", 1)
            assert ended("continue") == ("continue", 3)
        finally:
            engine.close()


def test_a_batch_of_submits_is_one_round_trip_however_many(
    pg_url: str, migrated_schema: str
) -> None:
    """Submits queued together (a web process's hand-off: one batch) are one set-wise call,
    `ts_submits`, in autocommit: one round trip and one signal for all of them - not a
    round trip per submit (under the chat load, a batch of five submits held the web
    process's lane for 10-15 ms), nor BEGIN with the call and then COMMIT. Each answers as
    it would alone: new inputs are stored and ring their doorbells, a known input id (same
    session, same payload) returns its id again."""
    with counting_url(pg_url) as (url, proxy):
        engine = open_engine(url, schema=migrated_schema)
        try:
            engine.run(_store.submit, "s0", '{"n": 0}', "in-known")
            jobs = [Job(_store.submit, (f"s{n}", f'{{"n": {n}}}', f"in-{n}")) for n in range(1, 6)]
            jobs.append(Job(_store.submit, ("s0", '{"n": 0}', "in-known")))
            before = proxy.round_trips
            engine.engine.run_batch(jobs)
            assert proxy.round_trips - before == 1
            assert [job.unwrap() for job in jobs] == [f"in-{n}" for n in range(1, 6)] + ["in-known"]
        finally:
            engine.close()
    with pg_raw(pg_url, migrated_schema) as conn:
        rows = conn.execute(
            "SELECT s.id, s.wakes, i.id FROM session s JOIN session_input i ON i.session_id = s.id"
            " ORDER BY s.id"
        ).fetchall()
    assert rows == [("s0", 1, "in-known")] + [(f"s{n}", 1, f"in-{n}") for n in range(1, 6)]


def test_a_call_alone_is_parsed_and_planned_once_per_connection(
    pg_url: str, migrated_schema: str
) -> None:
    """A function call that is its own message (alone in autocommit, or after the first
    statement of a transaction) is bound server-side: the same text each time, so the
    driver prepares it once it recurs, and the server no longer parses and plans it per
    call. A statement that shares its message with BEGIN stays bound client-side."""
    engine = open_engine(pg_url, schema=migrated_schema)
    try:
        for index in range(8):
            engine.run(_store.submit, f"s{index}", '{"n": 1}', f"in-{index}")
        conn = engine.engine.conn
        assert conn is not None
        prepared = [
            str(row[0])
            for row in conn.execute("SELECT statement FROM pg_prepared_statements").fetchall()
        ]
        assert [statement for statement in prepared if "ts_submit(" in statement], prepared
    finally:
        engine.close()


def test_a_stream_read_is_one_round_trip(pg_url: str, migrated_schema: str) -> None:
    """A stream's read (`stream_changes`: the ids its position names, the new deltas of the
    open message it follows, the messages past its top) is one call, alone in autocommit:
    one round trip, whatever it finds; the answer is the one statement-by-statement reads
    give."""
    with counting_url(pg_url) as (url, proxy):
        engine = open_engine(url, schema=migrated_schema)
        try:
            engine.run(_store.submit, "s", '{"n": 1}', "in-1")
            assert engine.run(_store.acquire, "s", "e1", "me", 60_000).verdict.value == "claim"
            [taken] = engine.run(_store.take_inputs, "s", "e1", "me")
            assert taken.id == "in-1"
            seq = engine.run(_store.begin_assistant, "s", "e1", "me", "m1")
            engine.run(_store.append_assistant_text, "s", "e1", "me", "m1", "one ")
            first = engine.read(_store.stream_changes, "s", Position())
            top = max(change.seq for change in first.changes)
            held = Held(seq, message_tag("m1"), first.changes[-1].version)
            position = Position(top, message_tag("m1"), (held,))
            engine.run(_store.append_assistant_text, "s", "e1", "me", "m1", "two ")
            before = proxy.round_trips
            changes = engine.read(_store.stream_changes, "s", position)
            assert proxy.round_trips - before == 1
            assert [(c.seq, getattr(c, "text", None)) for c in changes.changes] == [(seq, "two ")]
            assert changes == engine.read(stream_changes_by_statements, "s", position)
        finally:
            engine.close()


def test_the_stream_reads_of_one_hand_off_are_one_round_trip(
    pg_url: str, migrated_schema: str
) -> None:
    """Reads of many streams queued together (`run_reads`, one hand-off) are one set-wise
    call; each read's answer is the one statement-by-statement reads give. A read whose
    position names a message that is not there (a rewritten transcript) runs on its own
    and starts over."""
    with counting_url(pg_url) as (url, proxy):
        engine = open_engine(url, schema=migrated_schema)
        try:
            positions = {f"s{index}": following_position(engine, index) for index in range(3)}
            positions["s3"] = Position(7, message_tag("gone"))
            reads = [Job(_store.stream_changes, (s, p)) for s, p in positions.items()]
            before = proxy.round_trips
            engine.engine.run_reads(reads[:3])
            assert proxy.round_trips - before == 1
            engine.engine.run_reads(reads)
            answers = [job.unwrap() for job in reads]
            assert answers == [
                engine.read(stream_changes_by_statements, s, p) for s, p in positions.items()
            ]
            assert [[getattr(c, "text", None) for c in a.changes] for a in answers[:3]] == [
                ["b "]
            ] * 3
            assert answers[3].rewritten
        finally:
            engine.close()


def test_the_stream_reads_of_one_hand_off_probe_indexes_and_scan_no_table(
    pg_url: str, migrated_schema: str
) -> None:
    """The set-wise stream read (`ts_stream_changes_many`) looks each position's rows up by
    key: it scans neither messages nor deltas whole, however many other sessions there are
    (the planner, guessing a hundred elements in any JSON array, flattened such lookups
    into hash joins over whole tables) - on every path: appends to an open message, a new
    message with its deltas, an open message replaced whole."""
    engine = open_engine(pg_url, schema=migrated_schema)
    try:
        positions = {f"s{index}": following_position(engine, index) for index in range(3)}
        positions["s1"] = Position(1, "")  # holds the user message only: m1 is new
        engine.run(_store.update_assistant, "s2", "e2", "me", "m2", _transcript.finish)
    finally:
        engine.close()
    payload = _codec.dumps(
        [_pg_arguments(s, p, NEW_MESSAGES_PER_READ) for s, p in positions.items()]
    )
    counts = (
        "SELECT COALESCE(SUM(seq_scan), 0) FROM pg_stat_xact_user_tables"
        " WHERE relid IN ('session_message'::regclass, 'session_message_delta'::regclass)"
    )
    with pg_raw(pg_url, migrated_schema) as conn:
        conn.execute(
            "INSERT INTO session(id, time_created) SELECT 'x' || g, 0"
            " FROM generate_series(1, 2000) AS g"
        )
        conn.execute(
            "INSERT INTO session_message(id, session_id, role, seq, data, time_created,"
            " time_updated) SELECT 'x' || g || '-' || n, 'x' || g, 'assistant', n, '{}', 0, 0"
            " FROM generate_series(1, 2000) AS g, generate_series(1, 2) AS n"
        )
        conn.execute(
            "INSERT INTO session_message_delta(message_id, version, text)"
            " SELECT 'x' || g || '-2', v, 'w ' FROM generate_series(1, 2000) AS g,"
            " generate_series(1, 5) AS v"
        )
        conn.execute("ANALYZE session_message")
        conn.execute("ANALYZE session_message_delta")
        with conn.transaction():
            [(before,)] = conn.execute(counts).fetchall()
            rows = conn.execute(
                "SELECT kind, id, text FROM ts_stream_changes_many(%s, NULL, false)", (payload,)
            ).fetchall()
            [(after,)] = conn.execute(counts).fetchall()
    assert sorted((kind, id, text) for kind, id, text in rows if kind != "named") == [
        ("append", "m0", "b "),
        ("delta", "m1", "a "),
        ("delta", "m1", "b "),
        ("new", "m1", None),
        ("whole", "m2", None),
    ]
    assert after - before == 0


def following_position(engine: PgSyncEngine, index: int) -> Position:
    """Session `s<index>` with an open answer "a b "; the position of a stream that holds
    it at "a ", so a read of its changes is the append "b "."""
    session, execution, message = f"s{index}", f"e{index}", f"m{index}"
    engine.run(_store.submit, session, '{"n": 1}', f"in-{index}")
    engine.run(_store.acquire, session, execution, "me", 60_000)
    engine.run(_store.take_inputs, session, execution, "me")
    seq = engine.run(_store.begin_assistant, session, execution, "me", message)
    engine.run(_store.append_assistant_text, session, execution, "me", message, "a ")
    version = engine.read(_store.stream_changes, session, Position()).changes[-1].version
    tag = message_tag(message)
    engine.run(_store.append_assistant_text, session, execution, "me", message, "b ")
    return Position(seq, tag, (Held(seq, tag, version),))


def test_a_recovery_pass_costs_round_trips_per_pass_not_per_claim(
    pg_url: str, migrated_schema: str
) -> None:
    """A recovery pass over expired claims of a dead owner (DESIGN §8: set-wise recovery,
    no per-session round trips): the scan with its recovery leases and the due-input look
    (1: one autocommit call) and the takeover (1: `ts_recover` alone in autocommit, as no
    claim needs the row-by-row path) cost the same round trips for 5 claims as for 60."""
    assert trio.run(recovery_pass_round_trips, pg_url, migrated_schema) == [2, 2]


async def recovery_pass_round_trips(url: str, schema: str) -> list[int]:
    gates: list[trio.Event] = []

    async def held(ctx: DrainContext) -> None:
        await gates[-1].wait()  # the pass is counted alone, before the drains' releases

    counts = []
    async with counted_runtime(url, schema, held) as (runtime, proxy):
        for n in (5, 60):
            gates.append(trio.Event())
            with psycopg.connect(url, options=f"-c search_path={schema}") as conn:
                conn.execute("DELETE FROM session")
                conn.commit()
                seed_expired(conn, n)
            before = proxy.round_trips
            report = await runtime.recover_once()
            counts.append(proxy.round_trips - before)
            assert report.resumed == n
            gates[-1].set()
            await wait_all_idle(runtime)
    return counts


def test_a_change_scan_is_one_round_trip(pg_url: str, migrated_schema: str) -> None:
    """The change scan with no watched session (`changes`: unclaimed doorbells, our claims
    marked cancelling or gone, the next scheduled input, a handed-back claim waiting) is one
    call, alone in autocommit: one round trip; its answer is the one statement-by-statement
    reads give, with few claims of ours (looked up by key) and with many (one scan by
    owner)."""
    clock = lambda: 1_000.0  # noqa: E731 - a lease clock stopped at 1,000 s
    with counting_url(pg_url) as (url, proxy):
        engine = open_engine(url, schema=migrated_schema, clock=clock)
        try:
            for session in ("old", "local", "paused", "held", "new", "mine", "cancel"):
                engine.run(_store.submit, session, '{"n": 1}', f"in-{session}")
            engine.run(_store.pause, "paused")
            engine.run(_store.acquire, "held", "e-held", "them", 60_000)
            engine.run(_store.acquire, "mine", "e-mine", "me", 60_000)
            engine.run(_store.acquire, "cancel", "e-cancel", "me", 60_000)
            engine.run(_store.mark_cancelling, "cancel", "e-cancel", "me")
            engine.run(_store.submit_scheduled, "later", '{"n": 1}', "in-later", 5_000, "queue")
            engine.run(_store.wake, "handed")  # a claim a graceful shutdown handed back
            engine.run(_store.acquire, "handed", "e-handed", "stopped", 60_000)
            engine.run(_store.expire_claims, "stopped", ["e-handed"])
            owned = ["e-mine", "e-cancel", "e-gone", "e-held"]
            many = owned + [f"e-x{index}" for index in range(600)]
            scans: list[tuple[str, list[str], list[str], int, dict[str, Followed]]] = [
                ("me", ["local"], owned, 10, {}),
                ("me", ["local"], owned, 1, {}),
                ("me", [], many, 10, {}),
                ("me", [], [], 0, {}),
            ]
            for arguments in scans:
                before = proxy.round_trips
                found = engine.read(_store.changes, *arguments)
                assert proxy.round_trips - before == 1
                assert found == engine.read(changes_by_statements, *arguments)
            # Oldest wake first, by id among equals (one clock here).
            assert engine.read(_store.changes, "me", ["local"], owned, 10, {}) == Changes(
                ["new", "old"], ["e-cancel"], NO_CHANGE, ["e-gone", "e-held"], 5_000, True
            )
            assert not engine.read(_store.changes, "me", ["handed"], owned, 10, {}).handed_back
        finally:
            engine.close()


def test_the_conversation_controls_are_one_call_each(pg_url: str, migrated_schema: str) -> None:
    """Double-texting (`submit` with `on_busy` "interrupt" or "reject") and a scheduled
    `submit` are one call alone in autocommit: one round trip, a refusal included; a retry
    of a stored input is one too. Another owner's claim interrupted from here
    (`request_cancel`: no natural key to read back by, so a transaction) is one call: BEGIN
    with it, then COMMIT."""
    with counting_url(pg_url) as (url, proxy):
        engine = open_engine(url, schema=migrated_schema)
        try:
            engine.run(_store.submit, "s", '{"n": 1}', "in-1")
            engine.run(_store.acquire, "s", "e1", "other", 60_000)

            counted = functools.partial(round_trips_of, proxy, engine)

            payload = '{"n": 2}'
            assert counted(_store.submit_controlled, "s", payload, "in-2", "interrupt") == (
                1,
                ("in-2", "e1"),  # the claim it marked cancelling
            )
            assert counted(_store.submit_controlled, "s", payload, "in-2", "interrupt") == (
                1,
                ("in-2", None),
            )
            trips, refused = counted(_store.submit_controlled, "s", payload, "in-3", "reject")
            assert (trips, type(refused)) == (1, SessionBusy)
            assert counted(_store.submit_scheduled, "t", payload, "in-4", 60_000, "queue") == (
                1,
                "in-4",
            )
            engine.run(_store.submit, "u", '{"n": 1}', "in-5")
            engine.run(_store.acquire, "u", "e2", "other", 60_000)
            assert counted(_store.request_cancel, "u") == (2, True)
            assert counted(_store.request_cancel, "u") == (2, False)
        finally:
            engine.close()


def test_pause_resume_cancel_delete_and_truncate_are_one_call_each(
    pg_url: str, migrated_schema: str
) -> None:
    """`pause` and `resume` (idempotent: a retry after a lost reply is the same call) are
    one call alone in autocommit: one round trip. `cancel_input`, `delete_session` and
    `truncate` report what they removed, which a retry could not read back: one call in a
    transaction, BEGIN with it, then COMMIT - two."""
    with counting_url(pg_url) as (url, proxy):
        engine = open_engine(url, schema=migrated_schema)
        try:
            engine.run(_store.submit, "s", '{"n": 1}', "in-1")
            engine.run(_store.submit_scheduled, "s", '{"n": 2}', "in-2", 60_000, "queue")
            engine.run(_store.acquire, "s", "e1", "me", 60_000)
            [taken] = engine.run(_store.take_inputs, "s", "e1", "me")
            engine.run(finish_iteration, "s", "e1", "me")
            engine.run(_store.submit, "s", '{"n": 3}', "in-3")

            counted = functools.partial(round_trips_of, proxy, engine)

            assert counted(_store.pause, "s") == (1, None)
            assert counted(_store.resume, "s") == (1, True)
            assert counted(_store.cancel_input, "in-2") == (2, True)
            assert counted(_store.cancel_input, "in-2") == (2, False)
            assert counted(_store.truncate, "s", 0) == (2, 1)
            engine.run(_store.acquire, "s", "e2", "me", 60_000)
            # It names the claim it removed: its owner stops that drain and no other.
            assert counted(_store.delete_session, "s") == (2, (True, "e2"))
            assert counted(_store.delete_session, "s") == (2, (False, None))
            assert taken.id == "in-1"
        finally:
            engine.close()


def test_a_transcript_read_is_one_round_trip(pg_url: str, migrated_schema: str) -> None:
    """`transcript()` (the messages and the text streamed onto the open ones) is one call
    alone in autocommit: one snapshot, one round trip; the messages are the ones the
    statement-by-statement read gives."""
    with counting_url(pg_url) as (url, proxy):
        engine = open_engine(url, schema=migrated_schema)
        try:
            engine.run(_store.submit, "s", '{"n": 1}', "in-1")
            engine.run(_store.acquire, "s", "e1", "me", 60_000)
            engine.run(_store.take_inputs, "s", "e1", "me")
            engine.run(_store.begin_assistant, "s", "e1", "me", "m1")
            for word in ("one ", "two "):
                engine.run(_store.append_assistant_text, "s", "e1", "me", "m1", word)
            before = proxy.round_trips
            transcript = engine.read(_store.read_transcript, "s")
            assert proxy.round_trips - before == 1
            assert [m.role for m in transcript] == ["user", "assistant"]
            assert transcript == engine.read(read_transcript_by_statements, "s")
        finally:
            engine.close()


def test_a_drains_tool_writes_and_finish_are_one_round_trip_each(
    pg_url: str, migrated_schema: str
) -> None:
    """`start_tool`, `settle_tool` and `finish` send the message the writer computed from
    what it wrote, fenced on the version it last stored: one call alone in autocommit, one
    round trip each (before: read the message, write it, COMMIT). The transcript is the
    one the statements would have written."""
    assert trio.run(tool_write_round_trips, pg_url, migrated_schema) == [1, 1, 1]


async def tool_write_round_trips(url: str, schema: str) -> list[int]:
    counts: list[int] = []

    async def drain(ctx: DrainContext) -> None:
        await ctx.take_inputs()
        writer = await ctx.begin_assistant()
        await writer.append_text("calling ")
        proxy = proxies[0]
        steps: list[Callable[[], Awaitable[None]]] = [
            functools.partial(writer.start_tool, "c1", "echo", {"x": 1}),
            functools.partial(writer.settle_tool, "c1", {"ok": True}),
            writer.finish,
        ]
        for step in steps:
            before = proxy.round_trips
            await step()
            counts.append(proxy.round_trips - before)

    proxies: list[RoundTripProxy] = []
    async with counted_runtime(url, schema, drain) as (runtime, proxy):
        proxies.append(proxy)
        await runtime.submit("s", {"n": 1})
        await runtime.wait_idle("s")
        [_, answer] = await runtime.transcript("s")
    assert answer.data.finished
    assert [type(part).__name__ for part in answer.data.parts] == ["TextPart", "ToolPart"]
    return counts


def test_a_controlled_submit_that_claims_is_one_round_trip(
    pg_url: str, migrated_schema: str
) -> None:
    """Double-texting on a session idle here (`submit` with `on_busy`, which the runtime
    sends with the claim it rings for: `submit_controlled_and_acquire`) is one call alone in
    autocommit, whatever it finds: a free session claimed at once, a claim held elsewhere
    (interrupt marks it, reject refuses), a retry of an input already stored. Before, it
    was a transaction of one statement per fence read and write."""
    with counting_url(pg_url) as (url, proxy):
        engine = open_engine(url, schema=migrated_schema)
        try:

            def counted(*args: Any) -> tuple[int, Any]:
                op = _store.submit_controlled_and_acquire
                return round_trips_of(proxy, engine, op, *args, 60_000)

            trips, (stored, acquired) = counted("free", '{"n": 1}', "in-1", "interrupt", "e1", "me")
            assert (trips, stored, acquired.verdict.value) == (1, ("in-1", None), "claim")
            trips, (stored, acquired) = counted("free", '{"n": 1}', "in-1", "interrupt", "e2", "me")
            assert (trips, stored, acquired.verdict.value) == (1, ("in-1", None), "held")
            trips, (stored, acquired) = counted("free", '{"n": 2}', "in-2", "interrupt", "e3", "me")
            assert (trips, stored, acquired.verdict.value) == (1, ("in-2", "e1"), "held")
            trips, refused = counted("free", '{"n": 3}', "in-3", "reject", "e4", "me")
            assert (trips, type(refused)) == (1, SessionBusy)
        finally:
            engine.close()


def test_a_watched_look_with_room_reads_the_handed_back_claims_at_no_extra_round_trips(
    pg_url: str, migrated_schema: str
) -> None:
    """A runtime that drains and watches a session looks statement by statement on every
    change of that session (each streamed word): the handed-back claims' lookup
    (`handed_back_condition`, read in the due time's statement) adds no round trip to that
    look - a look with room costs one more than one without (the doorbells' statement); a
    statement of its own and a read of the server's clock made it two more."""
    with counting_url(pg_url) as (url, proxy):
        engine = open_engine(url, schema=migrated_schema)
        try:
            engine.run(_store.submit, "w", '{"n": 1}', "in-w")
            watched = {"w": Followed(0, None, {}, {})}
            counts = []
            for limit in (0, 10):
                before = proxy.round_trips
                engine.read(changes_by_statements, "me", [], [], limit, watched)
                counts.append(proxy.round_trips - before)
            assert counts[1] - counts[0] <= 1, counts
        finally:
            engine.close()


def test_an_interrupts_mark_and_its_ring_land_together_or_not_at_all(
    pg_url: str, migrated_schema: str, monkeypatch: Any
) -> None:
    """`mark_cancelling(ring=True)` (an interrupt's first step keeping a wake taken to go
    on) runs alone in a transaction, never as the mark in autocommit followed by the ring:
    the mark committed alone, and a ring that then failed (or a crash between) left the
    claim cancelling with the wake gone - recovery finishes it, never resumes it (a
    review's finding). A ring that fails undoes the mark."""
    clock = lambda: 1_000.0  # noqa: E731 - a lease clock stopped at 1,000 s
    engine = open_engine(pg_url, schema=migrated_schema, clock=clock)
    try:
        engine.run(_store.wake, "s")
        engine.run(_store.acquire, "s", "e1", "me", 60_000)  # takes the doorbell
        failing = RuntimeError("the ring fails")

        def ring_fails(tx: Any, session_id: str) -> None:
            raise failing

        monkeypatch.setattr(_store.claims, "_ring", ring_fails)
        with pytest.raises(RuntimeError) as raised:
            engine.run(_store.mark_cancelling, "s", "e1", "me", True)
        assert raised.value is failing
        monkeypatch.undo()
        phase, woken = engine.read(
            lambda tx: tx.one(
                "SELECT e.phase, s.time_woken FROM session_execution e"
                " JOIN session s ON s.id = e.session_id WHERE e.id = 'e1'"
            )
        )
        assert (phase, woken) == ("running", None)
        engine.run(_store.mark_cancelling, "s", "e1", "me", True)
        phase, woken = engine.read(
            lambda tx: tx.one(
                "SELECT e.phase, s.time_woken FROM session_execution e"
                " JOIN session s ON s.id = e.session_id WHERE e.id = 'e1'"
            )
        )
        assert phase == "cancelling" and woken is not None
    finally:
        engine.close()


def test_an_edit_is_statement_by_statement_and_a_retry_stops_after_its_checks(
    pg_url: str, migrated_schema: str
) -> None:
    """`submit(truncate_after=...)` (README's table): a user's rare edit, its checks (the
    input id, the claim, inputs waiting) and the input's insert run statement by statement
    around `ts_truncate` in one transaction - nine round trips; a retry of it is answered
    by its checks - four."""
    with counting_url(pg_url) as (url, proxy):
        engine = open_engine(url, schema=migrated_schema)
        try:
            engine.run(_store.submit, "s", '{"n": 1}', "in-1")
            engine.run(_store.acquire, "s", "e1", "me", 60_000)
            engine.run(_store.take_inputs, "s", "e1", "me")
            engine.run(finish_iteration, "s", "e1", "me")
            counted = functools.partial(round_trips_of, proxy, engine)
            edit = (_store.submit_truncating, "s", '{"n": 2}', "in-2", 0)
            assert counted(*edit) == (9, "in-2")
            assert counted(*edit) == (4, "in-2")
        finally:
            engine.close()


def test_a_streams_marks_at_its_opening_are_one_statement_in_a_read_transaction(
    pg_url: str, migrated_schema: str
) -> None:
    """A stream opened at a cursor past `MARKS_FROM` reads the ids of the few dozen messages
    it may resume at after a truncate: one statement, in a read transaction (README's
    table: two round trips more, once)."""
    with counting_url(pg_url) as (url, proxy):
        engine = open_engine(url, schema=migrated_schema)
        try:
            before = proxy.round_trips
            assert engine.read(_store.stream_marks, "s", 20_000) == ()
            assert proxy.round_trips - before == 2
        finally:
            engine.close()


def test_an_owners_look_is_one_round_trip(pg_url: str, migrated_schema: str) -> None:
    """The look at other owners' liveness tokens (`free_tokens`), which every runtime that
    drains makes every `LIVENESS_POLL` (0.25 s), is one statement alone in autocommit: one
    round trip, no BEGIN and COMMIT around it."""
    with counting_url(pg_url) as (url, proxy):
        engine = open_engine(url, schema=migrated_schema, clock=lambda: 1_000.0)
        try:
            engine.run(_store.free_tokens)  # connected, and the schema checked
            before = proxy.round_trips
            assert engine.read(_store.free_tokens) == set()
            assert proxy.round_trips - before == 1
        finally:
            engine.close()
