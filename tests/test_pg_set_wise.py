"""PostgreSQL's set-wise group commit of `submit_and_acquire` (`ts_submit_and_acquire_many`,
DESIGN §8 "One round trip per operation"): a batch's common jobs - the first of their
session, a new input id named once, a session free to claim - are settled by one statement
without the row function (`ts_submit_and_acquire`), each as that function answers it; the
rest go through the row function in the lock order; and a whole batch (every set-wise kind
mixed, and a chat worker's appends) ends as the same jobs run alone, one by one, in the
order the batch ran them.
Exact clocks (`fixed`), the engine's own transactions; the SQLite twin is
tests/store/test_set_wise.py.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from helpers import fixed
from helpers import pg_engine_at as engine_at
from helpers import pg_raw as raw

from trio_sessions import MalformedRecord, _backend, _store
from trio_sessions._decisions import AcquireVerdict
from trio_sessions._postgres import PgEngine, PgTx, connect, run_op

LEASE_MS = 30_000
ME, OTHER = "owner-a", "owner-b"
TABLES = (
    "session",
    "session_input",
    "session_execution",
    "session_message",
    "session_input_rejected",
    "session_recovery",
)


def test_a_batch_of_submits_is_settled_without_the_row_function(
    pg_url: str, pg_schema: str
) -> None:
    """`ts_submit_and_acquire_many` settles the common submits - a new session, an idle one
    whose doorbell is set (taken by the claim), one with resumes counted - in one statement,
    each as `ts_submit_and_acquire` answers it, and calls the row function only for what the
    set leaves to it: a held session, a paused one, a known input id, another session's
    input id, a session's second job, an input id named twice."""
    with engine_at(pg_url, pg_schema, 1.0) as engine:
        run_op(engine, _store.submit, "rung", '{"k": 1}', "in-rung")  # doorbell set, no claim
        run_op(engine, _store.submit, "idle", '{"k": 1}', "in-idle")
        run_op(engine, _store.acquire, "idle", "e-idle", ME, LEASE_MS)
        run_op(engine, _store.take_inputs, "idle", "e-idle", ME)
        run_op(engine, _store.end_iteration, "idle", "e-idle", ME)
        run_op(engine, _store.wake, "held")
        run_op(engine, _store.acquire, "held", "e-held", OTHER, LEASE_MS)
        run_op(engine, _store.submit, "paused", '{"k": 1}', "in-paused")
        run_op(engine, _store.pause, "paused")
        run_op(engine, _store.submit, "known", '{"k": 1}', "in-known")
    with raw(pg_url, pg_schema) as conn:
        conn.execute("UPDATE session SET wake_attempts = 2 WHERE id = 'idle'")
    jobs = [
        ("new", '{"n": 1}', "in-new", "x-new", ME, LEASE_MS),
        ("rung", '{"n": 1}', "in-rung-2", "x-rung", ME, LEASE_MS),
        ("idle", '{"n": 1}', "in-idle-2", "x-idle", ME, LEASE_MS),
        ("held", '{"n": 1}', "in-held", "x-held", ME, LEASE_MS),
        ("paused", '{"n": 1}', "in-paused-2", "x-paused", ME, LEASE_MS),
        ("known", '{"k": 1}', "in-known", "x-known", ME, LEASE_MS),
        ("elsewhere", '{"k": 1}', "in-known", "x-elsewhere", ME, LEASE_MS),
        ("twice", '{"n": 1}', "in-twice-1", "x-twice-1", ME, LEASE_MS),
        ("twice", '{"n": 2}', "in-twice-2", "x-twice-2", ME, LEASE_MS),
        ("dup-a", '{"n": 1}', "in-dup", "x-dup-a", ME, LEASE_MS),
        ("dup-b", '{"n": 1}', "in-dup", "x-dup-b", ME, LEASE_MS),
    ]
    conn = connect(pg_url, pg_schema)
    try:
        conn.execute("SET track_functions = 'pl'")
        tx = PgTx(conn, fixed(2.0))
        calls = [f"call-{n}" for n, _ in enumerate(jobs)]  # each job's own (`Job.call_id`)
        rows = tx.call(
            "ts_submit_and_acquire_many",
            *(list(column) for column in zip(*jobs, strict=True)),
            calls,
        )
        row_calls = conn.execute(
            "SELECT COALESCE(sum(calls), 0) FROM pg_stat_xact_user_functions"
            " WHERE funcname = 'ts_submit_and_acquire'"
        ).fetchone()
        conn.commit()
    finally:
        conn.close()
    # The two jobs naming one input id run in the lock order: the first stores it.
    with raw(pg_url, pg_schema) as check:
        [(a_first,)] = check.execute(
            "SELECT (ts_lock_key('dup-a'), 'dup-a') < (ts_lock_key('dup-b'), 'dup-b')"
        ).fetchall()
    stored, other = ("stored", "claim", 0, None), ("other_session", None, None, None)
    assert sorted(rows, key=lambda row: row[0]) == [
        (1, "stored", "claim", 0, None),
        (2, "stored", "claim", 0, None),
        (3, "stored", "claim", 2, None),
        (4, "stored", "held", None, OTHER),
        (5, "stored", "paused", None, None),
        (6, "known", "claim", 0, None),  # its doorbell still set: this call takes it
        (7, "other_session", None, None, None),
        (8, "stored", "claim", 0, None),
        (9, "stored", "held", None, ME),  # the session's second job: its first claimed it
        (10, *(stored if a_first else other)),
        (11, *(other if a_first else stored)),
    ]
    # held, paused, known, elsewhere, the second of twice, both of the input named twice
    assert row_calls == (7,)
    with raw(pg_url, pg_schema) as check:
        assert check.execute(
            "SELECT session_id, id, owner_id, expires_at, time_created FROM session_execution"
            " WHERE id LIKE 'x-%' ORDER BY session_id"
        ).fetchall() == [
            (session_id, f"x-{name}", ME, 2000 + LEASE_MS, 2000)
            for session_id, name in [
                ("dup-a" if a_first else "dup-b", "dup-a" if a_first else "dup-b"),
                ("idle", "idle"),
                ("known", "known"),
                ("new", "new"),
                ("rung", "rung"),
                ("twice", "twice-1"),
            ]
        ]
        assert check.execute(
            "SELECT id, time_woken IS NOT NULL, wakes, input_seq, wake_attempts FROM session"
            " WHERE id IN ('new', 'rung', 'idle', 'twice', 'held', 'paused') ORDER BY id"
        ).fetchall() == [
            ("held", True, 1, 1, 0),  # its doorbell taken by the claim, rung by the submit
            ("idle", False, 0, 2, 2),
            ("new", False, 0, 1, 0),
            ("paused", True, 2, 2, 0),
            ("rung", False, 0, 2, 0),  # the claim took the doorbell
            ("twice", True, 1, 2, 0),  # the second input rang the claimed session
        ]
        assert check.execute(
            "SELECT id, session_id, seq, payload, time_created FROM session_input"
            " WHERE id IN ('in-new', 'in-rung-2', 'in-idle-2') ORDER BY id"
        ).fetchall() == [
            ("in-idle-2", "idle", 2, '{"n": 1}', 2000),
            ("in-new", "new", 1, '{"n": 1}', 2000),
            ("in-rung-2", "rung", 2, '{"n": 1}', 2000),
        ]


def _row_calls(conn: psycopg.Connection[Any], function: str) -> Any:
    return conn.execute(
        "SELECT COALESCE(sum(calls), 0) FROM pg_stat_xact_user_functions WHERE funcname = %s",
        (function,),
    ).fetchone()


def test_a_batch_of_acquires_is_settled_without_the_row_function(
    pg_url: str, pg_schema: str
) -> None:
    """`ts_acquire_many` and `ts_wake_and_acquire_many` take the claims of the first job of
    each session free to claim in one statement (acquire: its doorbell set; wake and
    acquire: the session created if absent), each as the row function answers it, and call
    the row function only for the rest: a held, paused or unrung session, a session's
    second job."""
    with engine_at(pg_url, pg_schema, 1.0) as engine:
        for session_id in ("rung", "twice", "unrung", "held", "paused", "idle", "w-held"):
            run_op(engine, _store.submit, session_id, '{"k": 1}', f"in-{session_id}")
        for session_id in ("unrung", "held", "w-held"):
            run_op(engine, _store.acquire, session_id, f"e-{session_id}", OTHER, LEASE_MS)
        run_op(engine, _store.end_iteration, "unrung", "e-unrung", OTHER)
        run_op(engine, _store.pause, "paused")
    with raw(pg_url, pg_schema) as conn:
        conn.execute("UPDATE session SET wake_attempts = 3 WHERE id = 'rung'")
    acquires = [
        ("rung", "x-rung", ME, LEASE_MS),
        ("twice", "x-twice-1", ME, LEASE_MS),
        ("twice", "x-twice-2", ME, LEASE_MS),
        ("unrung", "x-unrung", ME, LEASE_MS),
        ("held", "x-held", ME, LEASE_MS),
        ("paused", "x-paused", ME, LEASE_MS),
        ("missing", "x-missing", ME, LEASE_MS),
    ]
    wakes = [
        ("new", "x-new", ME, LEASE_MS),
        ("idle", "x-idle", ME, LEASE_MS),
        ("w-held", "x-w-held", ME, LEASE_MS),
    ]
    conn = connect(pg_url, pg_schema)
    try:
        conn.execute("SET track_functions = 'pl'")
        tx = PgTx(conn, fixed(2.0))
        acquired = tx.call("ts_acquire_many", *(list(c) for c in zip(*acquires, strict=True)))
        woken = tx.call("ts_wake_and_acquire_many", *(list(c) for c in zip(*wakes, strict=True)))
        calls = (_row_calls(conn, "ts_acquire"), _row_calls(conn, "ts_wake_and_acquire"))
        conn.commit()
    finally:
        conn.close()
    assert sorted(acquired) == [
        (1, "claim", 3, None),
        (2, "claim", 0, None),
        (3, "held", None, ME),
        (4, "no_doorbell", None, None),
        (5, "held", None, OTHER),
        (6, "paused", None, None),
        (7, "no_doorbell", None, None),
    ]
    assert sorted(woken) == [(1, "claim", 0, None), (2, "claim", 0, None), (3, "held", None, OTHER)]
    # twice's second, unrung, paused, missing; w-held (an acquire's session held by another
    # execution is answered before any lock, by the set-wise call itself)
    assert calls == ((4,), (1,))
    with raw(pg_url, pg_schema) as check:
        assert check.execute(
            "SELECT session_id, id, expires_at FROM session_execution WHERE owner_id = %s"
            " ORDER BY session_id",
            (ME,),
        ).fetchall() == [
            (session_id, f"x-{name}", 2000 + LEASE_MS)
            for session_id, name in (
                ("idle", "idle"),
                ("new", "new"),
                ("rung", "rung"),
                ("twice", "twice-1"),
            )
        ]
        assert check.execute(
            "SELECT id, time_woken IS NOT NULL, wakes, time_created FROM session"
            " WHERE id IN ('rung', 'twice', 'idle', 'new', 'w-held') ORDER BY id"
        ).fetchall() == [
            ("idle", False, 0, 1000),  # the claim took its doorbell
            ("new", False, 0, 2000),  # created, the wake taken at once
            ("rung", False, 0, 1000),
            ("twice", False, 0, 1000),
            ("w-held", True, 1, 1000),  # held elsewhere: the wake is recorded
        ]


def test_no_server_function_holds_an_empty_array_literal_that_postgresql_16_refuses(
    pg_url: str, migrated_schema: str
) -> None:
    """Found by an audit. The server-side functions must run on every server the store
    supports. `ts_acquire_many` (the set-wise acquire of a batch) held `'{{}}'` - a Python
    `{{}}` escape in a piece of DDL that is no f-string, interpolated into one - which only
    PostgreSQL 17+ reads as an empty array: on 14-16 every call raised `malformed array
    literal: "{{}}"`, so each batch holding two acquires failed whole and all its jobs ran
    again one transaction each (group commit lost; seen on 15.18 by the acquire test above
    and `test_postgres.py::test_a_batch_of_claims_and_of_new_replies_is_one_call_each`).
    Now the literal is `'{}'`, and no function's source holds the escape."""
    with psycopg.connect(pg_url, autocommit=True) as conn:
        holders = conn.execute(
            "SELECT p.proname FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace"
            " WHERE n.nspname = %s AND p.prosrc LIKE %s ORDER BY 1",
            (migrated_schema, "%'{{}}'%"),
        ).fetchall()
    assert holders == []


def test_a_set_wise_iteration_end_takes_every_wake_at_once(pg_url: str, pg_schema: str) -> None:
    """§6.8 and §6.9 on `ts_finish_iterations` (the twin of tests/store/test_set_wise.py's):
    drains rung once and three times during their iteration end it set-wise, with no row
    call, as `continue` - each doorbell taken with no wake left, the claim kept - so the
    next end releases the claim. Ended as `release` instead, the wakes would sit on an
    unclaimed doorbell until a recovery pass found it."""
    with engine_at(pg_url, pg_schema, 1.0) as engine:
        for session_id, rings in (("w1", 1), ("w3", 3)):
            run_op(engine, _store.submit, session_id, '{"k": 1}', f"in-{session_id}")
            run_op(engine, _store.acquire, session_id, f"e-{session_id}", ME, LEASE_MS)
            for _ in range(rings):
                run_op(engine, _store.wake, session_id)
    ends = (["w1", "w3"], ["e-w1", "e-w3"], [ME, ME])
    conn = connect(pg_url, pg_schema)
    try:
        conn.execute("SET track_functions = 'pl'")
        tx = PgTx(conn, fixed(2.0))
        first = tx.call("ts_finish_iterations", *ends)
        calls = _row_calls(conn, "ts_finish")
        conn.commit()
        second = PgTx(conn, fixed(3.0)).call("ts_finish_iterations", *ends)
        conn.commit()
    finally:
        conn.close()
    assert sorted(first) == [(1, "continue", False), (2, "continue", False)]
    assert calls == (0,)
    assert sorted(second) == [(1, "release", False), (2, "release", False)]
    with raw(pg_url, pg_schema) as check:
        assert check.execute(
            "SELECT id, time_woken, wakes FROM session ORDER BY id"
        ).fetchall() == [("w1", None, 0), ("w3", None, 0)]
        assert check.execute("SELECT count(*) FROM session_execution").fetchone() == (0,)


# ---------------------------------------------------------------------------------------------
# The same outcome as one by one: random batches over sessions in every state the batched
# kinds tell apart, against the same jobs run alone in another schema, in the order the
# batch ran them.


def _setup(
    engine: PgEngine, conn: psycopg.Connection[Any], *, seed: int, sessions: list[str]
) -> None:
    rng = random.Random(seed)
    for s in sessions:
        state = rng.choice(
            ["none", "idle", "woken", "paused", "mine", "other", "expired", "cancelling", "open"]
        )
        if state == "none":
            continue
        run_op(engine, _store.submit, s, '{"k": 1}', f"in-known-{s}")
        if state == "woken":
            continue
        owner = OTHER if state == "other" else ME
        run_op(engine, _store.acquire, s, f"exec-{s}", owner, LEASE_MS)
        if state == "idle":
            run_op(engine, _store.take_inputs, s, f"exec-{s}", ME)
            run_op(engine, _store.end_iteration, s, f"exec-{s}", ME)
            continue
        if state == "paused":
            run_op(engine, _store.pause, s)
        if state == "expired":
            conn.execute(
                "UPDATE session_execution SET expires_at = 2000 WHERE id = %s", (f"exec-{s}",)
            )
        if state == "cancelling":
            run_op(engine, _store.mark_cancelling, s, f"exec-{s}", ME)
        if state == "open":
            run_op(engine, _store.begin_assistant, s, f"exec-{s}", ME, f"m-{s}")
        if rng.random() < 0.4:
            run_op(engine, _store.wake, s)
        if rng.random() < 0.3:
            conn.execute("UPDATE session SET wake_attempts = 2 WHERE id = %s", (s,))


def _jobs(rng: random.Random, sessions: list[str]) -> list[_backend.Job]:
    """A batch of every set-wise kind; refusals (a lost lease, a conflicting input) are rare,
    as one rolls the whole batch back (its jobs then run alone)."""
    jobs = []
    for n in range(rng.randint(2, 12)):
        s = rng.choice(sessions)
        kind = rng.random()
        if kind < 0.25:
            jobs.append(_backend.Job(_store.acquire, (s, f"x-{n}", ME, LEASE_MS)))
        elif kind < 0.5:
            jobs.append(_backend.Job(_store.wake_and_acquire, (s, f"x-{n}", ME, LEASE_MS)))
        elif kind < 0.9:
            input_id = rng.choice([f"in-{n}", f"in-{n}", f"in-{n}", f"in-known-{s}", "in-twice"])
            payload = '{"k": 2}' if rng.random() < 0.1 else '{"k": 1}'
            if kind < 0.75:
                args: tuple[Any, ...] = (s, payload, input_id, f"x-{n}", ME, LEASE_MS)
                jobs.append(_backend.Job(_store.submit_and_acquire, args))
            else:
                # The index below tells jobs apart by their arguments: a job the batch has
                # already gets another spelling of the same JSON value (a known input id
                # then answers through the row path).
                while (s, payload, input_id) in {job.args for job in jobs}:
                    payload = payload.replace(":", ":  ", 1)
                jobs.append(_backend.Job(_store.submit, (s, payload, input_id)))
        else:
            execution = f"exec-{s}" if rng.random() < 0.8 else "exec-wrong"
            owner = ME if rng.random() < 0.8 else OTHER
            jobs.append(_backend.Job(_store.end_iteration, (s, execution, owner)))
    return jobs


def _recording(op: Callable[..., Any], index: dict[tuple[Any, ...], int], log: list[int]) -> Any:
    """`op`, noting in `log` each job (by its index) as it is settled - answered or refused -
    by its kind's set-wise call (in the order of the rows it returns) or run on its own."""
    function, interpret = op.__dict__["pg_batched"]

    def recorded_interpret(args: tuple[Any, ...], row: tuple[Any, ...]) -> Any:
        try:
            result = interpret(args, row)
        except Exception:
            log.append(index[args])
            raise
        if result is not _backend.FALLBACK:
            log.append(index[args])
        return result

    def alone(tx: Any, *args: Any) -> Any:
        try:
            result = op(tx, *args)
        except _backend.NeedsTransaction:
            raise  # not settled: it runs again, in a transaction
        except Exception:
            log.append(index[args])
            raise
        log.append(index[args])
        return result

    alone.__dict__.update(op.__dict__)
    alone.__dict__["pg_batched"] = (function, recorded_interpret)
    return alone


def _outcome(job: _backend.Job) -> Any:
    return ("error", type(job.error)) if job.error is not None else ("ok", job.result)


def _tables(conn: psycopg.Connection[Any], jobs: list[_backend.Job]) -> dict[str, list[Any]]:
    """Every row of every table - but a user message's id, random on the server, and the
    id of the call that stored an input (`Job.call_id`, random), which is the index of its
    job among `jobs` (or "setup": a call of the setup's)."""
    calls = {job.call_id: index for index, job in enumerate(jobs)}
    tables = {}
    for table in TABLES:
        cursor = conn.execute(
            f"SELECT * FROM {table}"
            if table != "session_message"
            else "SELECT CASE WHEN role = 'user' THEN NULL ELSE id END,"
            " session_id, execution_id, input_id, role, seq, data, finished"
            " FROM session_message"
        )
        rows = cursor.fetchall()
        if table == "session_input":
            column = [c.name for c in cursor.description or ()].index("call_id")
            rows = [
                (*row[:column], calls.get(row[column], "setup"), *row[column + 1 :]) for row in rows
            ]
        tables[table] = sorted(rows, key=repr)
    return tables


# The random cases below compare two migrated, empty schemas (the batch's, `migrated_schema`,
# and the reference): both come from the pool of migrated schemas (`pg_schemas`), as the
# contract tests' do, instead of two fresh schemas migrated per case - that migration was
# three quarters of a case's time, and it builds the same either way (the pool hands out a
# schema only as exactly migrated and empty).


@pytest.fixture
def reference_schema(migrated_schemas: Any) -> Iterator[str]:
    """A second migrated, empty schema, where the batch's jobs run alone."""
    name = migrated_schemas.take()
    try:
        yield name
    finally:
        migrated_schemas.give_back(name)


@pytest.mark.parametrize("seed", range(60))
def test_a_set_wise_batch_ends_as_its_jobs_alone(
    pg_url: str, migrated_schema: str, reference_schema: str, seed: int
) -> None:
    rng = random.Random(seed)
    sessions = [f"s{i}" for i in range(rng.randint(2, 6))]
    jobs = _jobs(random.Random(seed + 1000), sessions)
    setup = functools.partial(_setup, seed=seed, sessions=sessions)
    _ends_as_alone(pg_url, (migrated_schema, reference_schema), jobs, setup)


Setup = Callable[[PgEngine, psycopg.Connection[Any]], None]


def _ends_as_alone(
    pg_url: str, schemas: tuple[str, str], jobs: list[_backend.Job], setup: Setup, *more: str
) -> None:
    """`jobs` run as one batch in the first schema and alone, one by one, in the second, in
    the order the batch ran them (after the same `setup` in each): the same outcomes, and
    the same rows in `TABLES` and the `more` tables."""
    mine, reference = schemas
    index = {job.args: i for i, job in enumerate(jobs)}
    log: list[int] = []
    ops = {op: _recording(op, index, log) for op in {job.op for job in jobs}}
    batch = [_backend.Job(ops[job.op], job.args) for job in jobs]
    with engine_at(pg_url, mine, 1.0) as engine, raw(pg_url, mine) as conn:
        setup(engine, conn)
    with engine_at(pg_url, mine, 3.0) as engine:
        engine.run_batch(batch)
    # Each job settled once, in the order logged - or a batch that raised was rolled back
    # and its jobs ran alone, one by one, in their order (the log has some twice).
    everyone = list(range(len(jobs)))
    order = log if sorted(log) == everyone else everyone

    alone = [_backend.Job(job.op, job.args) for job in jobs]
    with engine_at(pg_url, reference, 1.0) as engine, raw(pg_url, reference) as conn:
        setup(engine, conn)
    with engine_at(pg_url, reference, 3.0) as engine:
        for i in order:
            engine.run_batch([alone[i]])
    assert [_outcome(job) for job in batch] == [_outcome(job) for job in alone]
    with raw(pg_url, mine) as ours, raw(pg_url, reference) as theirs:
        assert _tables(ours, batch) == _tables(theirs, alone)
        for table in more:
            query = f"SELECT * FROM {table} ORDER BY 1, 2"
            assert ours.execute(query).fetchall() == theirs.execute(query).fetchall(), table


@pytest.mark.parametrize("seed", range(20))
def test_a_batch_of_submits_ends_as_its_jobs_alone(
    pg_url: str, migrated_schema: str, reference_schema: str, seed: int
) -> None:
    """A web process's batch of plain submits - one `ts_submits` call in autocommit, then on
    their own the jobs it leaves to the row path (a known payload in another spelling, a
    conflicting input id) - answers and writes what the same submits alone do, in the
    order the batch ran them."""
    rng = random.Random(seed)
    sessions = [f"s{i}" for i in range(rng.randint(1, 5))]
    jobs: list[_backend.Job] = []
    for n in range(rng.randint(2, 10)):
        s = rng.choice(sessions)
        input_id = rng.choice([f"in-{n}", f"in-{n}", f"in-known-{s}", "in-twice"])
        payload = rng.choice(['{"k": 1}', '{"k": 1}', '{"k": 2}'])
        while (s, payload, input_id) in {job.args for job in jobs}:
            payload = payload.replace(":", ":  ", 1)  # the same JSON value, spelt anew
        jobs.append(_backend.Job(_store.submit, (s, payload, input_id)))
    setup = functools.partial(_setup, seed=seed, sessions=sessions)
    _ends_as_alone(pg_url, (migrated_schema, reference_schema), jobs, setup)


def _open_answers(engine: PgEngine, conn: psycopg.Connection[Any], *, seed: int, n: int) -> None:
    """`n` sessions each streaming an answer (`m-s<i>`, a few words in), most claimed by ME
    with a live lease; with `seed`, now and then one whose lease lapsed or that OTHER owns."""
    rng = random.Random(seed)
    for i in range(n):
        s = f"s{i}"
        owner = OTHER if rng.random() < 0.05 else ME
        run_op(engine, _store.submit, s, '{"k": 1}', f"in-{s}")
        run_op(engine, _store.acquire, s, f"exec-{s}", owner, LEASE_MS)
        run_op(engine, _store.take_inputs, s, f"exec-{s}", owner)
        run_op(engine, _store.begin_assistant, s, f"exec-{s}", owner, f"m-{s}")
        for w in range(rng.randint(0, 3)):
            run_op(engine, _store.append_assistant_text, s, f"exec-{s}", owner, f"m-{s}", f"w{w} ")
        if rng.random() < 0.05:
            conn.execute(
                "UPDATE session_execution SET expires_at = 2000 WHERE id = %s", (f"exec-{s}",)
            )


@pytest.mark.parametrize("seed", range(30))
def test_a_batch_of_appends_ends_as_its_jobs_alone(
    pg_url: str, migrated_schema: str, reference_schema: str, seed: int
) -> None:
    """A chat worker's batch of appends (several to one message, interleaved with other
    messages') - one call (`ts_append_texts`) - answers and writes what the same appends
    alone write, in the order the batch ran them: the same versions, deltas and stream rows;
    a lapsed or foreign claim's append refuses the batch, whose jobs then run alone."""
    rng = random.Random(seed)
    n = rng.randint(1, 6)
    jobs = [
        _backend.Job(
            _store.append_assistant_text,
            (f"s{i}", f"exec-s{i}", ME, f"m-s{i}", f"t{k} ", None),
        )
        for k, i in enumerate(rng.choices(range(n), k=rng.randint(2, 16)))
    ]
    setup = functools.partial(_open_answers, seed=seed, n=n)
    tables = ("session_message_delta", "session_message_stream")
    _ends_as_alone(pg_url, (migrated_schema, reference_schema), jobs, setup, *tables)


@pytest.mark.parametrize("kind", ["submit_and_acquire", "submit"])
def test_a_set_wise_submit_to_a_session_whose_input_count_is_negative_stores_nothing(
    pg_url: str, pg_schema: str, kind: str
) -> None:
    """§4 (inputs are taken in the order they were stored), §5 (a malformed row raises
    `MalformedRecord`) and §6.20 (a backend difference is a bug): a session whose
    `input_seq` another tool set below 0, an input waiting at seq 2. The set-wise
    statement (`ts_submit_and_acquire_many`) and the row functions (`ts_insert_input`)
    counted on from it and stored the batch's input at seq -2, ahead of the one waiting;
    SQLite refuses it (tests/store/test_set_wise.py). Expected: that job fails with
    `MalformedRecord` naming the count, storing nothing; the other session's job is
    settled as usual."""
    if kind == "submit":
        jobs = [_backend.Job(_store.submit, (s, '{"k": 1}', f"in-{s}")) for s in ("bad", "good")]
        good: Any = "in-good"
    else:
        jobs = [
            _backend.Job(
                _store.submit_and_acquire, (s, '{"k": 1}', f"in-{s}", f"e-{s}", ME, LEASE_MS)
            )
            for s in ("bad", "good")
        ]
        good = ("in-good", _store.Acquired(AcquireVerdict.CLAIM))
    with engine_at(pg_url, pg_schema, 1.0) as engine, raw(pg_url, pg_schema) as conn:
        conn.execute("INSERT INTO session(id, time_created, input_seq) VALUES ('bad', 0, -3)")
        conn.execute(
            "INSERT INTO session_input(id, session_id, seq, payload, time_created)"
            " VALUES ('waiting', 'bad', 2, '{}', 0)"
        )
        engine.run_batch(jobs)
    with pytest.raises(MalformedRecord, match="input_seq"):
        jobs[0].unwrap()
    assert jobs[1].unwrap() == good
    with raw(pg_url, pg_schema) as conn:
        stored = conn.execute(
            "SELECT id, seq FROM session_input WHERE session_id = 'bad'"
        ).fetchall()
    assert stored == [("waiting", 2)]
