"""An edit (`submit(truncate_after=)`) racing other writers of its session on PostgreSQL.

On PostgreSQL the edit is statement by statement in one READ COMMITTED transaction: the
session lock, its checks (input id, claim, due inputs), `ts_truncate`, the input's insert.
Every other writer of the session takes the same lock (an acquire from a doorbell tries it
and answers 'busy'), so nothing can land between the edit's checks and its writes. Each
test holds the edit on a gate right after its checks - in a thread, on an engine of its
own - while a rival on another engine runs, then lets it go: the rival waits (or answers
busy, writing nothing) and its outcome is the one it has after the edit committed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import trio
from backends import finish_iteration
from helpers import pg_engine_at as engine_at
from helpers import pg_raw as raw
from test_pg_lock_signals import wait_after_it_ended

from trio_sessions import SessionBusy, _store
from trio_sessions._backend import Job
from trio_sessions._decisions import AcquireVerdict
from trio_sessions._loops import CHANGE_FALLBACK_POLL
from trio_sessions._postgres import PgEngine, run_op
from trio_sessions._store import common, control, inputs

WAIT_S = 30.0  # a bound on each gate, never reached when the test passes
LEASE_MS = 30_000
EDIT = ("s", '{"text": "edited"}', "edit-a", 1)
EDITING = (_store.submit_truncating, EDIT)
FORKING = (_store.fork, ("s", "branch", None))


def answered(engine: PgEngine) -> None:
    """An idle session: seq 1 the user's question, seq 2 its answer."""
    run_op(engine, _store.submit, "s", '{"text": "q"}', "q1")
    run_op(engine, _store.acquire, "s", "e1", "owner", LEASE_MS)
    run_op(engine, _store.take_inputs, "s", "e1", "owner")
    run_op(engine, _store.begin_assistant, "s", "e1", "owner", "a1")
    run_op(engine, finish_iteration, "s", "e1", "owner")


@contextmanager
def edit_held_after_its_checks(
    engine: PgEngine, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[threading.Event, Callable[[], Job]]]:
    """Run the edit in a thread, held between its checks and its truncate (the session lock
    held); yields (the gate to open, a call that waits for the edit's job)."""
    checked, go = threading.Event(), threading.Event()
    truncate = control.truncate

    def gated(tx: Any, session_id: str, after_seq: int) -> int:
        if not checked.is_set():
            checked.set()
            assert go.wait(WAIT_S), "the gate was never opened"
        return truncate(tx, session_id, after_seq)

    monkeypatch.setattr(control, "truncate", gated)
    job = Job(_store.submit_truncating, EDIT)
    thread = threading.Thread(target=engine.run_batch, args=([job],), daemon=True)
    thread.start()
    assert checked.wait(WAIT_S), "the edit never reached its truncate"

    def finished() -> Job:
        thread.join(WAIT_S)
        assert not thread.is_alive()
        return job

    try:
        yield go, finished
    finally:
        go.set()
        thread.join(WAIT_S)


def waits_for_a_lock(url: str, pid: int | None) -> None:
    deadline = time.monotonic() + WAIT_S
    with raw(url, "public") as conn:
        while True:
            row = conn.execute(
                "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (pid,)
            ).fetchone()
            if row is not None and row[0] == "Lock":
                return
            assert time.monotonic() < deadline, f"backend {pid} never waited for a lock"
            time.sleep(0.001)


def run_in_thread(engine: PgEngine, op: Any, *args: Any) -> tuple[threading.Thread, Job]:
    job = Job(op, args)
    thread = threading.Thread(target=engine.run_batch, args=([job],), daemon=True)
    thread.start()
    return thread, job


def rows(url: str, schema: str, statement: str) -> list[tuple[Any, ...]]:
    with raw(url, schema) as conn:
        return conn.execute(statement).fetchall()


MESSAGES = "SELECT seq, role, input_id FROM session_message ORDER BY seq"
INPUTS = "SELECT id FROM session_input ORDER BY seq"


def test_two_edits_with_different_input_ids_one_waits_and_is_refused(
    pg_url: str, pg_schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two web processes edit one session at once with different input ids: the second
    waits for the first's session lock, then finds the first's input waiting and raises
    `SessionBusy` - one edit lands, whole, and nothing of the other."""
    with engine_at(pg_url, pg_schema, 1.0) as one, engine_at(pg_url, pg_schema, 1.0) as two:
        answered(one)
        with edit_held_after_its_checks(one, monkeypatch) as (go, finished):
            thread, rival = run_in_thread(
                two, _store.submit_truncating, "s", '{"text": "other"}', "edit-b", 0
            )
            waits_for_a_lock(pg_url, two.backend_pid)
            go.set()
            assert finished().unwrap() == "edit-a"
            thread.join(WAIT_S)
        assert isinstance(rival.error, SessionBusy), rival.error
    assert rows(pg_url, pg_schema, MESSAGES) == [(1, "user", "q1")]
    assert rows(pg_url, pg_schema, INPUTS) == [("edit-a",)]


def test_an_acquire_during_an_edit_answers_busy_and_claims_after_it(
    pg_url: str, pg_schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker's acquire from a doorbell (a wake rung before the edit) while the edit is
    between its checks and its insert: it answers at once, writing nothing (no claim
    between the edit's check and its truncate); after the edit it claims the session, its
    anchor the truncated transcript's newest seq, and takes the edited input."""
    with engine_at(pg_url, pg_schema, 1.0) as one, engine_at(pg_url, pg_schema, 1.0) as two:
        answered(one)
        run_op(one, _store.wake, "s")
        with edit_held_after_its_checks(one, monkeypatch) as (go, finished):
            acquired = run_op(two, _store.acquire, "s", "e2", "worker", LEASE_MS)
            assert acquired.verdict is AcquireVerdict.HELD and acquired.locked
            assert rows(pg_url, pg_schema, "SELECT id FROM session_execution") == []
            go.set()
            assert finished().unwrap() == "edit-a"
        acquired = run_op(two, _store.acquire, "s", "e2", "worker", LEASE_MS)
        assert acquired.verdict is AcquireVerdict.CLAIM
        assert rows(pg_url, pg_schema, "SELECT anchor_seq FROM session_execution") == [(1,)]
        taken = run_op(two, _store.take_inputs, "s", "e2", "worker")
        assert [(item.id, item.seq) for item in taken] == [("edit-a", 2)]


@pytest.mark.parametrize("rival", ["submit_and_acquire", "wake_and_acquire"])
def test_a_claim_that_waits_for_the_edit_lands_after_it(
    pg_url: str, pg_schema: str, monkeypatch: pytest.MonkeyPatch, rival: str
) -> None:
    """A claim taken with its own wake or input waits for the edit's lock, and is taken
    after the edit committed: anchored on the truncated transcript, never on a message the
    edit deleted."""
    with engine_at(pg_url, pg_schema, 1.0) as one, engine_at(pg_url, pg_schema, 1.0) as two:
        answered(one)
        with edit_held_after_its_checks(one, monkeypatch) as (go, finished):
            if rival == "submit_and_acquire":
                args: tuple[Any, ...] = ("s", '{"text": "more"}', "more", "e2", "w", LEASE_MS)
            else:
                args = ("s", "e2", "w", LEASE_MS)
            thread, job = run_in_thread(two, getattr(_store, rival), *args)
            waits_for_a_lock(pg_url, two.backend_pid)
            assert rows(pg_url, pg_schema, "SELECT id FROM session_execution") == []
            go.set()
            assert finished().unwrap() == "edit-a"
            thread.join(WAIT_S)
        _, acquired = job.unwrap()
        assert acquired.verdict is AcquireVerdict.CLAIM
    assert rows(pg_url, pg_schema, "SELECT anchor_seq FROM session_execution") == [(1,)]
    assert rows(pg_url, pg_schema, MESSAGES) == [(1, "user", "q1")]
    assert rows(pg_url, pg_schema, INPUTS)[0] == ("edit-a",)


def test_a_delete_during_an_edit_waits_and_removes_it_whole(
    pg_url: str, pg_schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`delete_session` while the edit holds the session: it waits for the edit's lock,
    then removes the session with the edit's input - no row of the session is left, and
    the edit's caller got its id (the edit committed first)."""
    with engine_at(pg_url, pg_schema, 1.0) as one, engine_at(pg_url, pg_schema, 1.0) as two:
        answered(one)
        with edit_held_after_its_checks(one, monkeypatch) as (go, finished):
            thread, job = run_in_thread(two, _store.delete_session, "s")
            waits_for_a_lock(pg_url, two.backend_pid)
            go.set()
            assert finished().unwrap() == "edit-a"
            thread.join(WAIT_S)
        assert job.error is None, job.error
    for table in ("session", "session_input", "session_message", "session_execution"):
        assert rows(pg_url, pg_schema, f"SELECT * FROM {table}") == [], table


@pytest.mark.parametrize(
    ("waiting", "gate", "operation", "answer"),
    [
        # Refused: SessionBusy for the input waiting, the very input the worker came for.
        (("q1", '{"text": "q"}'), "_has_pending_inputs", EDITING, SessionBusy),
        # A retry of the edit, already stored: it returns its id and writes nothing.
        (("edit-a", EDIT[1]), "_known_input", EDITING, "edit-a"),
        # A fork of the session (held at its read of the messages): it writes and signals
        # the new session; the question is an input still, so it copies no message.
        (("q1", '{"text": "q"}'), "as_stored", FORKING, 0),
    ],
    ids=["refused", "retried", "forked"],
)
async def test_an_acquire_that_met_an_edit_or_a_fork_claims_once_it_ended_without_the_poll(
    pg_url: str,
    pg_schema: str,
    monkeypatch: pytest.MonkeyPatch,
    waiting: tuple[str, str],
    gate: str,
    operation: tuple[Any, tuple[Any, ...]],
    answer: Any,
) -> None:
    """A worker's acquire answered 'busy' because an edit held the session's lock passes
    over that doorbell "until the lock's holder is done: it claims the session, or signals
    it again once committed" (`ts_acquire`). An edit refused (`SessionBusy` for the input
    waiting, the very input the worker came for) rolled back and signalled nothing, and a
    retry of an edit stored already (a client's retried POST, which comes right after the
    first edit's commit, when workers acquire) committed nothing to signal: the worker
    passed the doorbell over until its fallback poll, and the user's message waited 2 s
    for its answer to start (DESIGN §7: p99 50 ms). The same for a fork, which takes the
    source's lock too and signalled only the new session. Now each signals the session
    once it ended: the worker claims at once."""
    checking, go = threading.Event(), threading.Event()
    checked = getattr(inputs if gate == "_known_input" else common, gate)

    def gated(tx: Any, *args: Any) -> Any:
        checking.set()
        assert go.wait(WAIT_S), "the gate was never opened"
        return checked(tx, *args)

    with engine_at(pg_url, pg_schema, 1.0) as web:
        input_id, payload = waiting
        run_op(web, _store.submit, "s", payload, input_id)  # waiting for a worker
        monkeypatch.setattr(control, gate, gated)
        edit = Job(*operation)
        editing = threading.Thread(target=web.run_batch, args=([edit],), daemon=True)
        editing.start()
        try:
            await trio.to_thread.run_sync(checking.wait, WAIT_S)
            waited = await wait_after_it_ended(pg_url, pg_schema, go.set, editing, edit, answer)
        finally:
            go.set()
            editing.join(WAIT_S)
    assert waited < CHANGE_FALLBACK_POLL / 4, f"the drain started {waited:.2f} s after the edit"
