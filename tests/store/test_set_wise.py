"""SQLite's set-wise group commit (`_backend.sqlite_batched`): a batch's `submit_and_acquire`,
`acquire`, `wake_and_acquire` and `end_iteration` jobs share a few statements whatever their
number; a job the set-wise run cannot settle (a refusal, a held or paused session, an open
message, a repeated session) runs alone after it with nothing written for it by the
set-wise run; and the whole batch ends as the same jobs run one by one, in that order,
would end it. SQLite only: these drive the SQLite executor's batch on its connection
(PostgreSQL's set-wise batches are its server-side functions: tests/test_postgres.py)."""

from __future__ import annotations

import random
import re
import sqlite3
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from trio_sessions import (
    InputConflict,
    LeaseLost,
    MalformedRecord,
    StoreError,
    _backend,
    _sqlite,
    _store,
)
from trio_sessions._decisions import AcquireVerdict, IterationVerdict

from .common import LEASE, Db

pytestmark = pytest.mark.sqlite_only


class Counting:
    """A connection that counts the statements sent through it (by their first words)."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn
        self.statements: Counter[str] = Counter()

    def execute(self, sql: str, params: Any = ()) -> sqlite3.Cursor:
        self.statements[re.sub(r"\s+", " ", sql)] += 1
        return self._conn.execute(sql, params)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)

    def total(self) -> int:
        return sum(self.statements.values())

    def count(self, prefix: str) -> int:
        return sum(n for sql, n in self.statements.items() if sql.startswith(prefix))


def run_counted(db: Db, jobs: list[_backend.Job]) -> Counting:
    counting = Counting(db.conn)
    _sqlite.run_batch(counting, db.clock, jobs)  # type: ignore[arg-type]
    assert not db.conn.in_transaction
    return counting


def submits(sessions: list[str], tag: str) -> list[_backend.Job]:
    return [
        _backend.Job(
            _store.submit_and_acquire,
            (s, '{"n": 1}', f"in-{tag}-{s}", f"exec-{tag}-{s}", "owner-a", LEASE),
        )
        for s in sessions
    ]


def ends(sessions: list[str], tag: str) -> list[_backend.Job]:
    return [_backend.Job(_store.end_iteration, (s, f"exec-{tag}-{s}", "owner-a")) for s in sessions]


# The fence read of `end_iteration`'s own path, and the input-id read of
# `submit_and_acquire`'s: each runs once per job that runs alone.
SINGLE_FENCE = "SELECT s.time_woken, s.wake_attempts, c.phase"
SINGLE_KNOWN_INPUT = "SELECT session_id, payload FROM session_input WHERE id = ?"


def test_a_grouped_ending_over_a_resume_count_not_an_integer_refuses_it_as_alone(
    db: Db,
) -> None:
    """Two drains end in one group commit, one session's resume count text another tool
    wrote: that ending gets `MalformedRecord` with its claim kept for quarantine and the
    count left as stored, as it does run alone - never a release that resets the count to
    0 in silence. The other ends set-wise."""
    for s in ("s1", "s2"):
        db.claim(s, execution=f"exec-a-{s}")
    db.write("UPDATE session SET wake_attempts = 'abc' WHERE id = 's1'")
    ending = ends(["s1", "s2"], "a")
    run_counted(db, ending)
    assert isinstance(ending[0].error, MalformedRecord)
    assert ending[1].unwrap() is IterationVerdict.RELEASE
    assert db.rows("SELECT id FROM session_execution") == [("exec-a-s1",)]
    assert db.rows("SELECT id, wake_attempts FROM session ORDER BY id") == [
        ("s1", "abc"),
        ("s2", 0),
    ]


def test_grouped_cycle_statements_do_not_grow_with_the_batch(db: Db) -> None:
    """A grouped cycle's two batches - submits that take their claims, then the ends of
    those iterations - send as many statements for 100 sessions as for 2."""
    counts = {}
    for n in (2, 100):
        sessions = [f"s{n}-{i}" for i in range(n)]
        acquiring = submits(sessions, "a")
        submitted = run_counted(db, acquiring)
        assert [job.unwrap() for job in acquiring] == [
            (f"in-a-{s}", _store.Acquired(AcquireVerdict.CLAIM)) for s in sessions
        ]
        ending = ends(sessions, "a")
        ended = run_counted(db, ending)
        assert [job.unwrap() for job in ending] == [IterationVerdict.RELEASE] * n
        counts[n] = (submitted.total(), ended.total())
        assert db.rows("SELECT COUNT(*) FROM session_execution") == [(0,)]
        assert db.rows(
            "SELECT COUNT(*) FROM session_input WHERE session_id LIKE ?", (f"s{n}-%",)
        ) == [(n,)]
    # BEGIN, SAVEPOINT, one read, session + input + claim inserts, RELEASE, COMMIT; then
    # BEGIN, SAVEPOINT, one read, one delete, RELEASE, COMMIT.
    assert counts[100] == counts[2] == (8, 6)


def test_a_refusal_in_a_set_wise_group_runs_alone(db: Db) -> None:
    """One `end_iteration` whose fence fails gets `LeaseLost`, alone; the group's others end
    set-wise and commit. One `submit_and_acquire` whose input id conflicts gets
    `InputConflict`, alone; the others take their claims set-wise."""
    for s in ("s1", "s2", "s3"):
        db.claim(s, execution=f"exec-a-{s}")
    ending = ends(["s1", "s2", "s3"], "a")
    ending[1].args = ("s2", "exec-a-s2", "owner-b")  # not s2's owner
    counted = run_counted(db, ending)
    assert ending[0].unwrap() is ending[2].unwrap() is IterationVerdict.RELEASE
    assert isinstance(ending[1].error, LeaseLost)
    assert counted.count(SINGLE_FENCE) == 1  # only the refused job ran alone
    assert counted.count("DELETE FROM session_execution WHERE id IN") == 1
    assert db.rows("SELECT id FROM session_execution") == [("exec-a-s2",)]

    db.run(_store.submit, "t0", '{"n": 0}', "in-used")
    acquiring = submits(["t1", "t2", "t3"], "b")
    acquiring[1].args = ("t2", '{"n": 2}', "in-used", "exec-b-t2", "owner-a", LEASE)
    counted = run_counted(db, acquiring)
    assert isinstance(acquiring[1].error, InputConflict)
    assert [acquiring[i].unwrap()[1].verdict for i in (0, 2)] == [AcquireVerdict.CLAIM] * 2
    assert counted.count(SINGLE_KNOWN_INPUT) == 1
    assert db.rows("SELECT session_id FROM session_execution ORDER BY 1") == [
        ("s2",),
        ("t1",),
        ("t3",),
    ]
    assert db.rows("SELECT COUNT(*) FROM session WHERE id = 't2'") == [(0,)]


def test_a_set_wise_run_that_raises_runs_its_jobs_alone(db: Db) -> None:
    """A database error in the set-wise statements (here an execution id already taken)
    rolls back the whole set-wise run: each job then runs alone, and only the one at fault
    fails."""
    db.claim("s0", execution="exec-b-s2")
    acquiring = submits(["s1", "s2", "s3"], "b")
    run_counted(db, acquiring)
    assert isinstance(acquiring[1].error, StoreError)
    assert isinstance(acquiring[1].error.__cause__, sqlite3.IntegrityError)
    assert [acquiring[i].unwrap()[1].verdict for i in (0, 2)] == [AcquireVerdict.CLAIM] * 2
    assert db.rows("SELECT COUNT(*) FROM session_input") == [(2,)]
    assert db.rows("SELECT COUNT(*) FROM session WHERE id = 's2'") == [(0,)]


def test_a_set_wise_iteration_end_takes_every_wake_at_once(db: Db) -> None:
    """§6.8: drains rung once and three times end their iterations set-wise as CONTINUE,
    each doorbell cleared with no wake left - one more iteration each, not one per wake -
    so the next end releases the claim."""
    for s, rings in (("w1", 1), ("w3", 3)):
        db.claim(s, execution=f"exec-a-{s}")
        for _ in range(rings):
            db.run(_store.wake, s)
    assert db.doorbell("w3")[1] == 3
    ending = ends(["w1", "w3"], "a")
    counted = run_counted(db, ending)
    assert [job.unwrap() for job in ending] == [IterationVerdict.CONTINUE] * 2
    assert counted.count(SINGLE_FENCE) == 0  # both ended set-wise
    assert db.doorbell("w1") == db.doorbell("w3") == (None, 0, 0)
    ending = ends(["w1", "w3"], "a")
    run_counted(db, ending)
    assert [job.unwrap() for job in ending] == [IterationVerdict.RELEASE] * 2


# ---------------------------------------------------------------------------------------------
# The same outcome as one by one: random batches over sessions in every state these two
# operations tell apart, against the same jobs run alone in the order the batch ran them.


def _setup(db: Db, rng: random.Random, sessions: list[str]) -> None:
    for s in sessions:
        state = rng.choice(
            [
                *("none", "idle", "woken", "paused", "paused-waiting", "mine", "other"),
                *("expired", "cancelling", "open"),
            ]
        )
        if state == "none":
            continue
        db.run(_store.submit, s, '{"k": 1}', f"in-known-{s}")
        if state == "woken":
            continue  # an input waits, its doorbell rung, no claim
        if state == "paused-waiting":
            db.run(_store.pause, s)  # an input waits, its doorbell rung, no claim: §6.24
            continue
        db.run(_store.acquire, s, f"exec-{s}", "owner-b" if state == "other" else "owner-a", LEASE)
        if state == "idle":
            db.run(_store.take_inputs, s, f"exec-{s}", "owner-a")
            db.run(_store.end_iteration, s, f"exec-{s}", "owner-a")
            continue
        if state == "paused":
            db.run(_store.pause, s)
        if state == "expired":
            db.write(
                "UPDATE session_execution SET expires_at = ? WHERE id = ?", (db.now, f"exec-{s}")
            )
        if state == "cancelling":
            db.run(_store.mark_cancelling, s, f"exec-{s}", "owner-a")
        if state == "open":
            db.run(_store.begin_assistant, s, f"exec-{s}", "owner-a", f"m-{s}")
        # Rung during the drain, up to three times: its iteration end takes every wake at
        # once (§6.8: N wakes -> one more iteration).
        for _ in range(rng.choice((0, 0, 0, 1, 2, 3))):
            db.run(_store.wake, s)
        if rng.random() < 0.3:
            db.write("UPDATE session SET wake_attempts = 2 WHERE id = ?", (s,))


def _jobs(rng: random.Random, sessions: list[str]) -> list[_backend.Job]:
    jobs = []
    for n in range(rng.randint(2, 9)):
        s = rng.choice(sessions)
        kind = rng.random()
        if kind < 0.15:
            jobs.append(_backend.Job(_store.acquire, (s, f"x-{n}", "owner-a", LEASE)))
        elif kind < 0.3:
            jobs.append(_backend.Job(_store.wake_and_acquire, (s, f"x-{n}", "owner-a", LEASE)))
        elif kind < 0.65:
            input_id = rng.choice([f"in-{n}", f"in-{n}", f"in-known-{s}", "in-twice"])
            payload = rng.choice(['{"k": 1}', '{"k": 2}'])
            jobs.append(
                _backend.Job(
                    _store.submit_and_acquire,
                    (s, payload, input_id, f"x-{n}", "owner-a", LEASE),
                )
            )
        else:
            execution = rng.choice([f"exec-{s}", f"exec-{s}", "exec-wrong"])
            owner = rng.choice(["owner-a", "owner-a", "owner-b"])
            jobs.append(_backend.Job(_store.end_iteration, (s, execution, owner)))
    return jobs


def _recording(op: Callable[..., Any], log: list[tuple[Any, list[bool]]]) -> Callable[..., Any]:
    """`op`, whose set-wise runs note which of their jobs they settled."""
    many = op.__dict__["sqlite_batched"]

    def recorded_many(tx: Any, rows: Any) -> list[Any]:
        results: list[Any] = many(tx, rows)
        log.append((op, [result is not _backend.FALLBACK for result in results]))
        return results

    def alone(tx: Any, *args: Any) -> Any:
        return op(tx, *args)

    alone.__dict__["sqlite_batched"] = recorded_many
    alone.__dict__["wrapped"] = op
    return alone


def _outcome(job: _backend.Job) -> Any:
    return ("error", type(job.error)) if job.error is not None else ("ok", job.result)


@pytest.mark.parametrize("seed", range(100))
def test_a_set_wise_batch_ends_as_its_jobs_one_by_one(db: Db, tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    sessions = [f"s{i}" for i in range(rng.randint(2, 5))]
    _setup(db, rng, sessions)
    reference = _sqlite.connect(tmp_path / "reference.db")
    db.conn.backup(reference)
    log: list[tuple[Any, list[bool]]] = []
    kinds = (
        _store.submit_and_acquire,
        _store.end_iteration,
        _store.acquire,
        _store.wake_and_acquire,
    )
    ops = {op: _recording(op, log) for op in kinds}
    jobs = _jobs(rng, sessions)
    batch = [_backend.Job(ops[job.op], job.args) for job in jobs]
    _sqlite.run_batch(db.conn, db.clock, batch)

    # The order the batch ran them in: each set-wise kind's settled jobs, then the rest.
    order: list[int] = []
    for op, settled in log:
        of_kind = [i for i, job in enumerate(jobs) if job.op is op]
        order += [i for i, done in zip(of_kind, settled, strict=True) if done]
    order += [i for i in range(len(jobs)) if i not in order]
    alone = [_backend.Job(job.op, job.args) for job in jobs]
    for i in order:
        _sqlite.run_batch(reference, db.clock, [alone[i]])
    assert [_outcome(job) for job in batch] == [_outcome(job) for job in alone]
    for table in sorted(_sqlite.OUR_TABLES):
        mine = sorted(db.conn.execute(f"SELECT * FROM {table}").fetchall(), key=repr)
        theirs = sorted(reference.execute(f"SELECT * FROM {table}").fetchall(), key=repr)
        assert mine == theirs, table
    reference.close()


def test_a_heartbeat_renews_every_claim_in_one_statement(db: Db) -> None:
    """One statement renews all the owner's claims, each on its fence: an expired claim or
    another owner's is not renewed (None), whatever the number of claims."""
    for n in (3, 60):
        sessions = [f"h{n}-{i}" for i in range(n)]
        for s in sessions:
            db.claim(s, execution=f"exec-{s}", owner="owner-b" if s.endswith("-1") else "owner-a")
        db.write(
            "UPDATE session_execution SET expires_at = ? WHERE id = ?", (db.now, f"exec-h{n}-2")
        )
        db.now += 1
        job = _backend.Job(_store.heartbeat, ("owner-a", [f"exec-{s}" for s in sessions], LEASE))
        counted = run_counted(db, [job])
        renewed: dict[str, str | None] = {f"exec-{s}": "running" for s in sessions}
        renewed[f"exec-h{n}-1"] = renewed[f"exec-h{n}-2"] = None
        assert job.unwrap() == renewed
        assert counted.total() == 3  # BEGIN IMMEDIATE, the update, COMMIT
        assert db.rows(
            "SELECT COUNT(*) FROM session_execution WHERE expires_at = ?", (db.now + LEASE,)
        ) == [(n - 2,)]
        db.write("DELETE FROM session_execution")


def test_a_set_wise_submit_to_a_session_whose_input_count_is_negative_runs_alone(db: Db) -> None:
    """The set-wise `submit_and_acquire` stores each input at its session's `input_seq`
    plus one, as `_insert_input` does, and leaves a session whose count has no seq left to
    run alone (`counted_input_seq` refuses it). A count another tool wrote below 0 passed
    its check, so the batch stored the input at seq -2, ahead of the input already waiting
    at seq 2. Expected: that job runs alone and fails with `MalformedRecord`, storing
    nothing; the other session's job is settled set-wise."""
    db.write("INSERT INTO session(id, time_created, input_seq) VALUES ('bad', 0, -3)")
    db.write(
        "INSERT INTO session_input(id, session_id, seq, payload, time_created)"
        " VALUES ('waiting', 'bad', 2, '{}', 0)"
    )
    jobs = submits(["bad", "good"], "a")
    run_counted(db, jobs)
    with pytest.raises(MalformedRecord, match="input_seq"):
        jobs[0].unwrap()
    assert jobs[1].unwrap() == ("in-a-good", _store.Acquired(AcquireVerdict.CLAIM))
    assert db.rows("SELECT id, seq FROM session_input WHERE session_id = 'bad'") == [("waiting", 2)]
