"""PostgreSQL notifications scale (DESIGN §8 "Notifications scale"): a transaction sends at
most one `pg_notify`, carrying every session it signals, and the listener wakes for each
of them.

A `NOTIFY` in a transaction takes a database-wide lock at COMMIT; one notification per
signalled session also makes every listener of the store read and filter each one. So a
group-commit batch, whose jobs' functions each signal their own session, sends one
notification for the batch: its payload is the sessions, one per line (session ids are
printable: no line breaks), or the empty payload - "look at everything" - when they do not
fit PostgreSQL's 8000-byte payload.

Notifications reach a listener in commit order, so each test commits a sentinel
notification of its own after the transaction it examines and reads up to it: what came
before the sentinel is all the transaction sent, with no waiting for silence.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
import trio
from helpers import ExecutorSeam, WrappedStore, opened
from psycopg import sql
from test_postgres import recording_engine

import trio_sessions
import trio_sessions._loops
from trio_sessions import _store, _transcript
from trio_sessions._backend import Job, Signal, Tx
from trio_sessions._postgres import PostgresStore, channel, run_op
from trio_sessions._postgres.executors import _wanted
from trio_sessions._postgres.listener import PgListener

SENTINEL = "sentinel"
LEASE_MS = 30_000


@contextlib.contextmanager
def listening(url: str, schema: str) -> Iterator[psycopg.Connection[Any]]:
    """A raw autocommit connection LISTENing on the store's channel."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel(schema))))
        yield conn


def received(conn: psycopg.Connection[Any], url: str, schema: str) -> list[str]:
    """The payloads `conn` received before a sentinel committed now (in commit order)."""
    with psycopg.connect(url, autocommit=True) as other:
        other.execute("SELECT pg_notify(%s, %s)", (channel(schema), SENTINEL))
    payloads: list[str] = []
    for notify in conn.notifies(timeout=10):
        if notify.payload == SENTINEL:
            return payloads
        payloads.append(notify.payload)
    pytest.fail(f"the sentinel never arrived (got {payloads!r})")


def signal_sessions(tx: Tx, session_ids: list[str]) -> None:
    """An operation that signals several sessions from the client side (as the operator's
    and conversation control's operations do)."""
    for session_id in session_ids:
        tx.notify(session_id)


def test_a_batch_whose_jobs_signal_many_sessions_sends_one_notification(
    pg_url: str, migrated_schema: str
) -> None:
    """A group-commit batch of wakes and submits to held sessions (each function signals
    its own session) and a client-side signal sends ONE notification, naming every
    signalled session once."""
    with opened(PostgresStore(pg_url, schema=migrated_schema).engine()) as engine:
        # Held sessions: a submit to them rings the doorbell (and signals).
        for n in range(3):
            run_op(engine, _store.wake, f"held{n}")
            run_op(engine, _store.acquire, f"held{n}", f"e{n}", "owner", LEASE_MS)
        with listening(pg_url, migrated_schema) as conn:
            jobs = [Job(_store.wake, (f"w{n}",)) for n in range(10)]
            jobs += [
                Job(_store.submit_and_acquire, (f"held{n}", "{}", f"i{n}", f"x{n}", "me", LEASE_MS))
                for n in range(3)
            ]
            jobs += [Job(_store.submit, ("held0", "{}", "i-alone"))]
            jobs += [Job(signal_sessions, (["w0", "client"],))]
            engine.run_batch(jobs)
            assert [job.error for job in jobs] == [None] * len(jobs)
            assert engine.transactions == 7  # 6 to set up, then the batch in one
            payloads = received(conn, pg_url, migrated_schema)
    assert len(payloads) == 1
    signalled = payloads[0].split("\n")
    assert sorted(signalled) == sorted(
        [f"w{n}" for n in range(10)] + [f"held{n}" for n in range(3)] + ["client"]
    )


def test_a_batch_of_submits_only_sends_one_notification(pg_url: str, migrated_schema: str) -> None:
    """A batch of submits only - one set-wise call in autocommit - sends ONE notification
    for the batch, naming every session it stored an input for once."""
    with (
        opened(PostgresStore(pg_url, schema=migrated_schema).engine()) as engine,
        listening(pg_url, migrated_schema) as conn,
    ):
        jobs = [Job(_store.submit, (f"s{n % 4}", "{}", f"i{n}")) for n in range(8)]
        engine.run_batch(jobs)
        assert [job.unwrap() for job in jobs] == [f"i{n}" for n in range(8)]
        assert engine.transactions == 1
        payloads = received(conn, pg_url, migrated_schema)
    assert [sorted(payload.split("\n")) for payload in payloads] == [[f"s{n}" for n in range(4)]]


def test_one_operation_signalling_many_sessions_sends_one_notification(
    pg_url: str, migrated_schema: str
) -> None:
    """A transaction that signals several sessions from the client side sends one
    notification naming them all."""
    sessions = [f"s{n}" for n in range(5)]
    with (
        opened(PostgresStore(pg_url, schema=migrated_schema).engine()) as engine,
        listening(pg_url, migrated_schema) as conn,
    ):
        run_op(engine, signal_sessions, sessions)
        payloads = received(conn, pg_url, migrated_schema)
    assert [sorted(payload.split("\n")) for payload in payloads] == [sessions]


def test_an_autocommit_call_and_a_lone_wake_send_one_notification_each(
    pg_url: str, migrated_schema: str
) -> None:
    """Alone, a submit (one autocommit call) and a wake (one transaction) each send one
    notification: their session's id."""
    with (
        opened(PostgresStore(pg_url, schema=migrated_schema).engine()) as engine,
        listening(pg_url, migrated_schema) as conn,
    ):
        run_op(engine, _store.submit, "a", "{}", "i1")
        run_op(engine, _store.wake, "b")
        payloads = received(conn, pg_url, migrated_schema)
    assert payloads == ["a", "b"]


def test_sessions_that_do_not_fit_one_payload_send_look_at_everything(
    pg_url: str, migrated_schema: str
) -> None:
    """A batch signalling more sessions than 8000 bytes of payload hold sends one
    notification with the empty payload (look at everything), not an error and not one
    per session."""
    long_ids = [f"{n:03d}-" + "x" * 196 for n in range(60)]  # 12,000 bytes joined
    with (
        opened(PostgresStore(pg_url, schema=migrated_schema).engine()) as engine,
        listening(pg_url, migrated_schema) as conn,
    ):
        jobs = [Job(_store.wake, (session_id,)) for session_id in long_ids[:30]]
        jobs += [Job(signal_sessions, (long_ids[30:],))]
        engine.run_batch(jobs)
        assert [job.error for job in jobs] == [None] * len(jobs)
        payloads = received(conn, pg_url, migrated_schema)
    assert payloads == [""]


async def test_the_listener_looks_at_each_session_a_notification_names(
    pg_url: str, migrated_schema: str
) -> None:
    """The listener asks `wanted` about each session of a notification; the empty payload
    (look at everything) wakes it whatever `wanted` says of any session."""
    listener = PgListener(pg_url, migrated_schema, inline=True)
    await listener.open()
    asked: list[str] = []

    def wanted(pid: int, session_id: str, watchers_only: bool) -> bool:
        asked.append(session_id)
        return session_id == "c"  # only the last one: each is asked about

    try:
        with psycopg.connect(pg_url, autocommit=True) as other:
            other.execute("SELECT pg_notify(%s, %s)", (channel(migrated_schema), "a\nb\nc"))
            with trio.fail_after(10):
                signal = await listener.wait(trio.Event(), 60, wanted)
            assert asked == ["a", "b", "c"]
            assert signal == Signal(frozenset({"c"}), transcripts_only=False)
            asked.clear()
            other.execute("SELECT pg_notify(%s, %s)", (channel(migrated_schema), ""))
            with trio.fail_after(10):
                signal = await listener.wait(
                    trio.Event(), 60, lambda pid, session_id, watchers_only: False
                )
            assert signal is None  # anything may have changed
    finally:
        listener.close()


def test_transcript_writes_signal_the_sessions_watchers_only(
    pg_url: str, migrated_schema: str
) -> None:
    """A drain's transcript writes (taking inputs, beginning, appending, settling a message)
    signal `\\t<session>`: a change only the session's watchers and streams need. Wakes,
    submits and claim endings signal the bare id, which every runtime may need (a doorbell).
    So a worker with no watcher ignores another worker's streamed tokens."""
    with (
        opened(PostgresStore(pg_url, schema=migrated_schema).engine()) as engine,
        listening(pg_url, migrated_schema) as conn,
    ):
        run_op(engine, _store.submit_and_acquire, "s", "{}", "i1", "e1", "me", LEASE_MS)
        run_op(engine, _store.take_inputs, "s", "e1", "me")
        run_op(engine, _store.begin_assistant, "s", "e1", "me", "m1")
        run_op(engine, _store.append_assistant_text, "s", "e1", "me", "m1", "hi", 0)
        run_op(engine, _store.append_assistant_text, "s", "e1", "me", "m1", "!", None)
        run_op(engine, _store.update_assistant, "s", "e1", "me", "m1", _transcript.finish)
        run_op(engine, _store.wake, "s")
        engine.run_batch(
            [
                Job(_store.append_assistant_text, ("s", "e1", "me", "m1", "late", None)),
                Job(_store.wake, ("t",)),
            ]
        )
        payloads = received(conn, pg_url, migrated_schema)
    # take_inputs, begin, two appends, finish; then the wake; then the batch, re-run job by
    # job as its late append raised: the append wrote nothing, the wake signals.
    assert payloads == ["\ts"] * 5 + ["s", "t"]


async def test_the_listener_tells_a_watchers_only_change_from_a_doorbell(
    pg_url: str, migrated_schema: str
) -> None:
    """`wanted` is asked whether each session's change is for its watchers only; the
    signal says whether every wanted one was (only then can a look skip the change scan)."""
    listener = PgListener(pg_url, migrated_schema, inline=True)
    await listener.open()
    asked: list[tuple[str, bool]] = []

    def wanted(pid: int, session_id: str, watchers_only: bool) -> bool:
        asked.append((session_id, watchers_only))
        return session_id == "c"

    try:
        with psycopg.connect(pg_url, autocommit=True) as other:
            other.execute("SELECT pg_notify(%s, %s)", (channel(migrated_schema), "\ta\nb\n\tc"))
            with trio.fail_after(10):
                signal = await listener.wait(trio.Event(), 60, wanted)
            assert asked == [("a", True), ("b", False), ("c", True)]
            assert signal == Signal(frozenset({"c"}), transcripts_only=True)
            other.execute("SELECT pg_notify(%s, %s)", (channel(migrated_schema), "\tc\nc"))
            with trio.fail_after(10):
                signal = await listener.wait(trio.Event(), 60, wanted)
            assert signal == Signal(frozenset({"c"}), transcripts_only=False)
    finally:
        listener.close()


def test_a_watchers_only_change_is_wanted_only_where_the_session_is_followed() -> None:
    """The executors' filter: another process's doorbell is always worth a look; a
    watchers-only change only where a watcher or stream follows the session; our own
    writers' changes (any of them) never."""

    class Engine:
        def __init__(self, backend_pid: int) -> None:
            self.backend_pid = backend_pid

    engines = [Engine(7), Engine(9)]
    wanted = _wanted(engines, lambda s: s == "followed")  # type: ignore[arg-type]
    assert wanted(8, "any", False)
    assert not wanted(8, "any", True)
    assert wanted(8, "followed", True)
    for ours in (7, 9):
        assert not wanted(ours, "any", False)
        assert not wanted(ours, "followed", False)
        assert not wanted(ours, "followed", True)
    engines[1].backend_pid = 10  # the second writer reconnected
    assert wanted(9, "any", False)
    assert not wanted(10, "any", False)


def test_signals_go_in_a_transaction_of_their_own_after_the_commit(
    pg_url: str, migrated_schema: str
) -> None:
    """A notification holds a database-wide lock from its transaction's COMMIT to the end
    of that COMMIT's WAL flush: a batch's signals are sent after its COMMIT, in the same
    message, by a transaction of their own with nothing to flush (synchronous_commit off) -
    so a batch is not queued behind every other notifying transaction's flush."""
    with (
        recording_engine(pg_url, migrated_schema) as (engine, made),
        listening(pg_url, migrated_schema) as conn,
    ):
        sent_before = len(made[-1].statements)
        jobs = [Job(_store.wake, (f"w{n}",)) for n in range(3)]
        engine.run_batch(jobs)
        assert [job.error for job in jobs] == [None] * 3
        sent = made[-1].statements[sent_before:]
        payloads = received(conn, pg_url, migrated_schema)
    assert [sorted(payload.split("\n")) for payload in payloads] == [["w0", "w1", "w2"]]
    *before, last = sent
    assert not any("ts_flush_signals" in statement for statement in before), before
    assert last.startswith("COMMIT; ") and "synchronous_commit', 'off'" in last
    assert "ts_flush_signals" in last


def test_a_commit_that_landed_stands_when_its_signals_fail(
    pg_url: str, migrated_schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The signals' transaction after a COMMIT fails (a full notification queue, say): the
    batch committed, its results stand (never re-run), and listeners are told to look at
    everything instead."""
    from trio_sessions._postgres import engine as engine_module

    monkeypatch.setattr(engine_module, "_FLUSH", "SELECT 1 / 0, %s")
    with opened(PostgresStore(pg_url, schema=migrated_schema).engine()) as engine:
        with listening(pg_url, migrated_schema) as conn:
            jobs = [Job(_store.wake, (f"w{n}",)) for n in range(3)]
            engine.run_batch(jobs)
            assert [job.error for job in jobs] == [None] * 3
            assert engine.transactions == 1  # not re-run alone
            payloads = received(conn, pg_url, migrated_schema)
        wakes = engine.conn.execute("SELECT id, wakes FROM session ORDER BY id").fetchall()
    assert payloads == [""]
    assert wakes == [("w0", 1), ("w1", 1), ("w2", 1)]


@pytest.mark.parametrize("mode", ["batch", "nowait"])
def test_a_hand_back_of_many_claims_sends_one_notification(
    pg_url: str, migrated_schema: str, mode: str
) -> None:
    """A hand-back (a graceful shutdown's, in a batch's transaction or alone with no wait
    as the runtime runs it) sends one notification naming every session whose claim it
    handed back - other runtimes take them over at that signal - and none for a claim it
    did not hand back (another owner's)."""
    with opened(PostgresStore(pg_url, schema=migrated_schema).engine()) as engine:
        for session_id, execution_id, owner in [
            *((f"s{n}", f"e{n}", "owner") for n in range(3)),
            ("other", "e-other", "someone else"),
        ]:
            run_op(engine, _store.wake, session_id)
            run_op(engine, _store.acquire, session_id, execution_id, owner, LEASE_MS)
        with listening(pg_url, migrated_schema) as conn:
            job = Job(_store.expire_claims, ("owner", ["e0", "e1", "e2", "e-other"]))
            if mode == "batch":
                engine.run_batch([job])
            else:
                engine.run_alone(job, "nowait")
            assert job.unwrap() == 3
            payloads = received(conn, pg_url, migrated_schema)
    assert [sorted(payload.split("\n")) for payload in payloads] == [["s0", "s1", "s2"]]


async def test_a_streamed_word_costs_a_followers_read_not_a_doorbell_scan(
    pg_url: str, migrated_schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DESIGN §6.26 in a chat's web process (a producer following a session with a stream,
    no watcher): another worker's streamed words are watchers-only changes, so each costs
    the stream's read and never the change scan over doorbells and claims. Found by
    mutation: a `_needs_scan` that always scanned survived every test, the listener's
    filter being pinned only on its own. Real time, bounded; the fallback poll (a scan of
    everything) is moved out of the way."""
    monkeypatch.setattr(trio_sessions._loops, "CHANGE_FALLBACK_POLL", 3_600.0)
    scans: list[object] = []

    class CountingScans(ExecutorSeam):
        async def read(self, op: Any, *args: Any) -> Any:
            if op is _store.changes:
                scans.append(args)
            return await self._inner.read(op, *args)

    store = WrappedStore(PostgresStore(pg_url, schema=migrated_schema), CountingScans)
    words = [f"w{i} " for i in range(5)]
    with opened(PostgresStore(pg_url, schema=migrated_schema).engine()) as engine:
        run_op(engine, _store.submit_and_acquire, "s", "{}", "i1", "e1", "me", 30_000)
        run_op(engine, _store.take_inputs, "s", "e1", "me")
        run_op(engine, _store.begin_assistant, "s", "e1", "me", "m1")
        with trio.fail_after(30):
            async with (
                trio_sessions.open_runtime(store, None) as producer,
                producer.stream("s") as events,
            ):
                kinds = [(await events.__anext__()).kind for _ in range(2)]
                assert kinds == ["message", "message"]  # the question, the open reply
                scanned = len(scans)
                for word in words:
                    append = (_store.append_assistant_text, "s", "e1", "me", "m1", word, None)
                    await trio.to_thread.run_sync(run_op, engine, *append)
                    assert (await events.__anext__()).kind == "append"
                assert len(scans) == scanned, f"{len(scans) - scanned} scans for 5 words"


def test_a_fork_of_a_session_whose_message_waits_sends_one_notification(
    pg_url: str, migrated_schema: str
) -> None:
    """A fork signals its copy (client-side) and, after its COMMIT, its source when an
    acquire waits for it (locked, not signalled: `SIGNAL_WAITING`) - one notification
    naming both, not one for each: every listener of the store reads and looks at each
    notification, and §8 allows one per transaction. (The source's signal travelled as a
    second `pg_notify` beside the copy's flush.)"""
    with opened(PostgresStore(pg_url, schema=migrated_schema).engine()) as engine:
        run_op(engine, _store.submit, "s", "{}", "q1")  # waits: doorbell set, no claim
        with listening(pg_url, migrated_schema) as conn:
            assert run_op(engine, _store.fork, "s", "f", None) == 0
            payloads = received(conn, pg_url, migrated_schema)
    assert [sorted(payload.split("\n")) for payload in payloads] == [["f", "s"]]
