"""Fault injection on PostgreSQL: the connection is lost at every statement of every write
operation, and at its COMMIT; the durable state is exactly the committed one.

Each write operation of `_store` (and two group-commit batches) is a row of `OPERATIONS`:
a setup that builds its pre-state, and the call. `test_every_statement_of_every_operation`
first runs the call cleanly, recording its statements (through the engine's
`wrap_connection` seam) and the committed post-state; then, on the same pre-state restored
row for row, it loses the connection at statement k, for every k and every fault point:

* `before`: the backend is terminated (`pg_terminate_backend` from a control connection)
  before the statement is sent. Terminating right *after* statement k is the same event
  as `before` statement k+1, so it needs no mode of its own;
* `blocked`: for a statement that waits for a lock (the session lock, the claim rows'
  lock), the test holds that lock and terminates the backend during the wait - a kill in
  the middle of a statement the server is running;
* `lost`: the statement runs, the backend is terminated, its reply never arrives (at
  COMMIT: the COMMIT landed and the client cannot know);
* at COMMIT also `farewell` (terminated first; the client reads only the server's 57P01)
  and `after` (it landed and was answered, then the backend is terminated).

(Shutting the client socket's read side after sending is no deterministic "during": Linux
still returns a reply that arrived before the read.)

Whatever the fault, the operation reports what its clean run reported, the durable state
(read by a connection of its own) equals the clean post-state - never the pre-state of an
operation that reported success, never half of it, never twice - a landed COMMIT is read
back instead of re-applied, and the next operation succeeds on one re-opened connection.
A new statement or operation is swept by the recording, without a table of statements to
edit. Tests of their own: StoreError only once the whole bound has passed; an uncertain
claim never treated as owned (DESIGN §6.19); the runtime on the group-commit executor
carrying on; and the listener's loss (§8: reconnect, re-LISTEN, rescan the doorbells).
"""

from __future__ import annotations

import contextlib
import enum
import functools
import operator
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import attrs
import psycopg
import pytest
import trio
from backends import finish_iteration
from helpers import terminate_on
from psycopg import sql
from trio.testing import MockClock

from trio_sessions import DrainContext, StoreError, _postgres, _store, _transcript, open_runtime
from trio_sessions import testing as ts_testing
from trio_sessions._backend import Job
from trio_sessions._codec import encode_assistant
from trio_sessions._errors import OutcomeUnknown
from trio_sessions._loops import CHANGE_FALLBACK_POLL
from trio_sessions._postgres import PgEngine, PostgresStore, run_op
from trio_sessions._store.recovery_scan import scan_and_lease
from trio_sessions._store.stream import Position, message_tag

T0 = 1_800_000_000.0
LEASE_MS = 30_000
OWNER = "owner"
RESCUER = "rescuer"
# `session` first: the other tables refer to it (restored in this order).
TABLES = (
    "session",
    "session_input",
    "session_execution",
    "session_recovery",
    "session_message",
    "session_input_rejected",
    "session_message_rejected",
    "session_message_stream",
    "session_message_delta",
)


class Mode(enum.Enum):
    BEFORE = "before"  # killed before the statement is sent
    BLOCKED = "blocked"  # killed while the statement waits for a lock on the server
    LOST = "lost"  # the statement ran; killed before its reply was read
    AFTER = "after"  # COMMIT only: it landed and was answered, then killed
    FAREWELL = "farewell"  # COMMIT only: killed first; the client read the server's 57P01
    # (terminating connection) but not yet the connection's end
    REFUSED = "refused"  # the server refuses it with `Plan.sqlstate` (a retryable error),
    # aborting the transaction it is in; the connection stays


# After these the COMMIT has landed: its outcome is read back, never re-applied.
LANDED = {Mode.LOST, Mode.AFTER}


# The locks a statement can wait for, as the test takes them first (in a transaction of its
# own, released by rolling it back): the session lock, and the claim rows' lock - and the
# same locks a server-side function takes, from its arguments: (lock, the parameters
# of the statement it needs).
SESSION_LOCK = "SELECT ts_lock(%s)"
EXECUTION_LOCK = "SELECT ts_lock(session_id) FROM session_execution WHERE id = %s"
CLAIMS_LOCK = "SELECT 1 FROM session_execution WHERE id = ANY(%s) FOR UPDATE"
INPUT_LOCK = "SELECT ts_lock(session_id) FROM session_input WHERE id = %s"
Pick = Callable[[Any], Any]
FIRST: Pick = operator.itemgetter(slice(0, 1))
SECOND: Pick = operator.itemgetter(slice(1, 2))
SAME: Pick = lambda params: params  # noqa: E731
BLOCKERS: dict[str, tuple[str, Pick]] = {
    "pg_advisory_xact_lock": (SESSION_LOCK, SAME),
    "FOR NO KEY UPDATE": (CLAIMS_LOCK, SAME),
    **{
        f"{function}(": (SESSION_LOCK, FIRST)
        for function in (
            "ts_submit",
            "ts_submit_and_acquire",
            "ts_wake",
            "ts_submit_controlled",
            "ts_submit_controlled_and_acquire",
            "ts_request_cancel",
            "ts_pause",
            "ts_resume",
            "ts_delete_session",
            "ts_truncate",
        )
    },
    "ts_wake_and_acquire(": (SESSION_LOCK, FIRST),
    "ts_cancel_input(": (INPUT_LOCK, FIRST),
    **{
        f"{function}(": (EXECUTION_LOCK, FIRST)
        for function in (
            "ts_append_text",
            "ts_begin_assistant",
            "ts_mark_cancelling",
            "ts_finish",
            "ts_read_message",
            "ts_update_message",
            "ts_take_inputs",
        )
    },
    **{f"{function}(": (CLAIMS_LOCK, SECOND) for function in ("ts_heartbeat", "ts_expire_claims")},
    # Recovery's set-wise call takes its sessions' locks first (p_sessions: the 4th).
    "ts_recover(": (SESSION_LOCK, lambda params: (first_of(params[3]),)),
    # So do a batch's set-wise submits and wakes with acquires (p_sessions: the 1st), and
    # a batch's submits take each one's lock in turn (the first session in the 1st). An
    # acquire (`ts_acquire`, `ts_acquire_many`) waits for no session's lock: it answers
    # 'busy' instead (tests/test_pg_batch_locks.py).
    **{
        f"{function}(": (SESSION_LOCK, lambda params: (first_of(params[0]),))
        for function in ("ts_submit_and_acquire_many", "ts_wake_and_acquire_many", "ts_submits")
    },
}


def first_of(array: Any) -> Any:
    """The first element of a call's array argument, as bound (`transactions.bound`: a
    list of text is sent as one literal, its elements double-quoted)."""
    if isinstance(array, list):
        return array[0]
    found = re.match(r'\{"((?:[^"\\]|\\.)*)"', array)
    assert found is not None, array
    return re.sub(r"\\(.)", r"\1", found.group(1))


# How the seam labels a statement that commits on its own (an autocommit function call):
# it is its own COMMIT.
AUTOCOMMIT = "autocommit: "


def blocker(statement: str) -> tuple[str, Pick] | None:
    return next((lock for key, lock in BLOCKERS.items() if key in statement), None)


def modes_for(statement: str) -> list[Mode]:
    if statement == "COMMIT":
        return [Mode.BEFORE, Mode.FAREWELL, Mode.LOST, Mode.AFTER]
    if blocker(statement) is not None:
        return [Mode.BEFORE, Mode.BLOCKED, Mode.LOST]
    return [Mode.BEFORE, Mode.LOST]


@contextmanager
def control_connection(url: str, schema: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(url, autocommit=True, options=f"-c search_path={schema}") as conn:
        yield conn


def wait_for_lock(control: psycopg.Connection[Any], pid: int) -> None:
    deadline = time.monotonic() + 10
    while True:
        row = control.execute(
            "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (pid,)
        ).fetchone()
        if row is not None and row[0] == "Lock":
            return
        assert time.monotonic() < deadline, f"backend {pid} never waited for the lock"
        time.sleep(0.001)


@attrs.define
class Plan:
    index: int | None  # the k-th statement after arming (COMMIT counts); None: `match`
    mode: Mode
    match: str | None = None
    then_unreachable: bool = False  # after firing, every reconnect fails
    every: int = 0  # instead: every `every`-th statement, `times` times, `mode` then `LOST`
    times: int = 1
    sqlstate: str = "40001"  # Mode.REFUSED's

    def hit(self, index: int, text: str) -> bool:
        if self.every:
            return index % self.every == 0
        return self.index == index if self.match is None else self.match in text


class Faults:
    """The seam (`PostgresStore(wrap_connection=...)`): records statements, and loses the
    connection at a planned one."""

    def __init__(self, url: str, schema: str, control: psycopg.Connection[Any]) -> None:
        self.url = url
        self.schema = schema
        self.control = control
        self.plan: Plan | None = None
        self.index = 0
        self.recorded: list[str] | None = None
        self.fired: str | None = None
        self.firings = 0
        self.unreachable = False
        self._sqlstate = "40001"

    def wrap(self, conn: psycopg.Connection[Any]) -> FaultyConnection:
        if self.unreachable:
            conn.close()
            raise StoreError("cannot connect: server unreachable (injected)")
        return FaultyConnection(conn, self)

    def arm(self, plan: Plan) -> None:
        self.plan = plan
        self.index = 0
        self.firings = 0
        self.fired = None

    def statement(
        self, conn: psycopg.Connection[Any], text: str, params: Any, run: Callable[[], Any]
    ) -> Any:
        if self.recorded is not None:
            self.recorded.append(text)
        plan = self.plan
        if plan is None:
            return run()
        self.index += 1
        if not plan.hit(self.index, text):
            return run()
        mode = (plan.mode, Mode.LOST)[self.firings % 2]
        self._sqlstate = plan.sqlstate
        self.firings += 1
        if self.firings >= plan.times:
            self.plan = None
        self.fired = text
        try:
            return self._fire(conn, mode, text, params, run)
        finally:
            self.unreachable = plan.then_unreachable

    def _fire(
        self,
        conn: psycopg.Connection[Any],
        mode: Mode,
        text: str,
        params: Any,
        run: Callable[[], Any],
    ) -> Any:
        pid = conn.info.backend_pid
        if mode is Mode.REFUSED:
            # Refused by the server where the statement would run: in the transaction its
            # BEGIN opened (aborted now), or alone. The statement itself is never sent.
            assert self.plan is None or self.plan.every == 0
            conn.execute(
                "DO $$ BEGIN RAISE EXCEPTION 'injected' USING ERRCODE = '"
                + self._sqlstate
                + "'; END $$"
            )
            raise AssertionError("the injected refusal was not raised")
        if mode is Mode.BEFORE:
            terminate_on(self.control, pid)
            return run()
        if mode is Mode.FAREWELL:
            terminate_on(self.control, pid)
            raise psycopg.errors.AdminShutdown("terminating connection (injected)")
        if mode is Mode.BLOCKED:
            found = blocker(text)
            assert found is not None
            lock, pick = found
            with psycopg.connect(
                self.url, options=f"-c search_path={self.schema} -c lock_timeout=300"
            ) as holder:
                if self._locked(holder, lock, pick(params)):
                    return self._killed_while_blocked(holder, pid, run)
            # Nothing to wait for: the lock is this transaction's already (a function
            # before it took it), or there is no such row. Killed after it instead.
            mode = Mode.LOST
        try:
            result = run()
        except psycopg.Error as refused:
            # The server refused the statement (`ts_recover` refusing a batch whole in
            # autocommit): its error reply is lost like any other reply.
            if mode is not Mode.LOST:
                raise
            result = refused
        terminate_on(self.control, pid)
        if mode is Mode.LOST:
            # As when the reply never came: the client has found the connection gone (the
            # first statement may only read the server's 57P01 farewell, the next its end;
            # on a loaded host the end can come a little later).
            deadline = time.monotonic() + 5
            while not conn.broken and time.monotonic() < deadline:
                with contextlib.suppress(psycopg.OperationalError):
                    conn.execute("SELECT 1")
                # A farewell read without the end after it leaves libpq busy: it refuses the
                # next statement ("another command is already in progress") without reading
                # the socket again, so read what has come (the end marks it broken).
                with contextlib.suppress(psycopg.OperationalError):
                    conn.pgconn.consume_input()
                    while not conn.pgconn.is_busy() and conn.pgconn.get_result() is not None:
                        pass
            assert conn.broken
            raise psycopg.OperationalError("server closed the connection (injected)")
        return result

    @staticmethod
    def _locked(holder: psycopg.Connection[Any], lock: str, params: Any) -> bool:
        """Take the lock the statement will wait for; False if there is none to take."""
        try:
            return bool(holder.execute(lock, params).fetchall())
        except psycopg.errors.LockNotAvailable:
            holder.rollback()
            return False

    def _killed_while_blocked(
        self, holder: psycopg.Connection[Any], pid: int, run: Callable[[], Any]
    ) -> Any:
        """The statement waits on the server for a lock the test holds (in `holder`); the
        backend is killed during that wait."""
        outcome: list[Any] = []

        def statement() -> None:
            try:
                outcome.append(run())
            except BaseException as exc:
                outcome.append(exc)

        thread = threading.Thread(target=statement, daemon=True)
        thread.start()
        wait_for_lock(self.control, pid)
        terminate_on(self.control, pid)
        thread.join(10)
        holder.rollback()
        assert outcome and isinstance(outcome[0], psycopg.Error), outcome
        raise outcome[0]


class FaultyConnection:
    """A connection proxy: the engine uses `execute`, `commit`, `rollback` and state."""

    def __init__(self, conn: psycopg.Connection[Any], faults: Faults) -> None:
        self._conn = conn
        self._faults = faults

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)

    def execute(self, query: Any, params: Any = None) -> Any:
        text = str(query)
        if text.startswith("COMMIT;"):
            # The engine's COMMIT with its signals' own transaction after it, one message.
            text = "COMMIT"
        elif (
            self._conn.autocommit
            and self._conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
            and not text.startswith("BEGIN")
        ):
            text = AUTOCOMMIT + text
        return self._faults.statement(
            self._conn, text, params, lambda: self._conn.execute(query, params)
        )

    def commit(self) -> None:
        self._faults.statement(self._conn, "COMMIT", None, self._conn.commit)


@attrs.define
class ManualClock:
    """The lease clock (epoch seconds), moved by the setups: every `now` is exact."""

    now: float = T0

    def __call__(self) -> float:
        return self.now


Step = Callable[["Env"], object]


@attrs.define
class Env:
    engine: PgEngine
    faults: Faults
    clock: ManualClock
    control: psycopg.Connection[Any]

    def run(self, op: Callable[..., Any], *args: Any) -> Any:
        return run_op(self.engine, op, *args)

    def raw(self, statement: str, params: Sequence[Any] = ()) -> None:
        self.control.execute(statement, params)

    def reset(self) -> None:
        self.control.execute("DELETE FROM session_recovery; DELETE FROM session")
        self.clock.now = T0


@contextmanager
def environment(url: str, schema: str) -> Iterator[Env]:
    with control_connection(url, schema) as control:
        faults = Faults(url, schema, control)
        clock = ManualClock()
        engine = PostgresStore(url, schema=schema, wrap_connection=faults.wrap).engine(clock)
        engine.open()
        try:
            yield Env(engine, faults, clock, control)
        finally:
            engine.close()


def snapshot(control: psycopg.Connection[Any]) -> dict[str, list[tuple[Any, ...]]]:
    """Every committed row of every table. User messages' and forked copies' ids are random
    (`new_id`), and so is the id of the call that stored an input (`Job.call_id`, one per
    call: a clean run's is not a faulted run's), so they are left out; everything else must
    match exactly."""
    state = {}
    for table in TABLES:
        cursor = control.execute(sql.SQL("SELECT * FROM {}").format(sql.Identifier(table)))
        names = [column.name for column in cursor.description or ()]
        rows = [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]
        for row in rows:
            # Random too: a user message's id, and a forked copy's (no execution wrote it).
            if table == "session_message" and (
                row["role"] == "user" or row["execution_id"] is None
            ):
                row["id"] = None
            if table == "session_input":
                row["call_id"] = None
        state[table] = sorted((tuple(row.items()) for row in rows), key=repr)
    return state


def outcome_of(jobs: Sequence[Job]) -> list[tuple[str, Any]]:
    return [
        ("ok", job.result) if job.error is None else (type(job.error).__name__, str(job.error))
        for job in jobs
    ]


# ---------------------------------------------------------------------------------------------
# Pre-states


def claimed(env: Env, session_id: str = "s", execution_id: str = "e1", owner: str = OWNER) -> None:
    env.run(_store.submit, session_id, '{"n": 1}', f"{session_id}-i1")
    env.run(_store.acquire, session_id, execution_id, owner, LEASE_MS)


def drained(env: Env) -> None:
    """A claim that took its inputs (one of them malformed) and is mid-answer: an open
    assistant message with text and a running tool."""
    env.run(_store.submit, "s", '{"n": 1}', "i1")
    env.run(_store.submit, "s", "[1]", "i2")  # not an object: set aside by take_inputs
    env.run(_store.acquire, "s", "e1", OWNER, LEASE_MS)
    env.run(_store.take_inputs, "s", "e1", OWNER)
    env.run(_store.begin_assistant, "s", "e1", OWNER, "m1")
    env.run(_store.update_assistant, "s", "e1", OWNER, "m1", APPEND)
    env.run(_store.update_assistant, "s", "e1", OWNER, "m1", START_TOOL)


APPEND = functools.partial(_transcript.append_text, text="hello")
START_TOOL = functools.partial(_transcript.start_tool, call_id="c1", name="echo", input={"x": 1})
SETTLE_TOOL = functools.partial(_transcript.settle_tool, call_id="c1", output={"ok": 1})
# What the writer of `drained`'s message stored last: its version 2 (begun at 0, two
# updates) - and a stale view of it, one version behind.
KNOWN_DATA = START_TOOL(APPEND(_transcript.EMPTY))
STALE_DATA = APPEND(_transcript.EMPTY)
KNOWN = _store.Known(KNOWN_DATA, (), 2, encode_assistant(KNOWN_DATA))
STALE = _store.Known(STALE_DATA, (), 1, encode_assistant(STALE_DATA))


def expired(env: Env, *, cancelling: bool = False) -> None:
    """The drained claim's owner died: its lease ran out."""
    drained(env)
    if cancelling:
        env.run(_store.mark_cancelling, "s", "e1", OWNER)
    lapse(env)


def lapse(env: Env) -> None:
    env.clock.now += 2 * LEASE_MS / 1000


def recovery_leased(env: Env, *, cancelling: bool = False) -> None:
    expired(env, cancelling=cancelling)
    lease(env)


def lease(env: Env) -> None:
    """A recovery pass's scan and leases (`scan_and_lease`): every expired claim leased."""
    env.run(scan_and_lease, RESCUER, 10, [], [], LEASE_MS)


CANDIDATE = _store.Candidate("s", "e1")


def superseded(env: Env) -> None:
    recovery_leased(env)
    env.raw(
        "INSERT INTO session_message(id, session_id, execution_id, role, seq, data,"
        " time_created, time_updated) VALUES ('m9', 's', 'other', 'assistant', 99, %s, 0, 0)",
        (encode_assistant(_transcript.EMPTY),),
    )


def malformed(env: Env) -> None:
    recovery_leased(env)
    env.raw("UPDATE session_message SET data = '{' WHERE id = 'm1'")


def exhausted(env: Env) -> None:
    recovery_leased(env)
    env.raw("UPDATE session SET wake_attempts = 10")


def quarantined(env: Env) -> None:
    malformed(env)
    env.run(_store.apply_recovery_batch, RESCUER, [(CANDIDATE, "e2")], LEASE_MS, 10)


def live_again(env: Env) -> None:
    """Claim `f1`'s lease is live again (its owner renewed it after our recovery lease)."""
    env.raw(
        "UPDATE session_execution SET expires_at = expires_at + %s WHERE id = 'f1'", (4 * LEASE_MS,)
    )


def empty(env: Env) -> None:
    pass


def two_claims(env: Env) -> None:
    claimed(env, "s1", "e1")
    claimed(env, "s2", "e2")
    env.clock.now += 1.0


def idle_answered(env: Env) -> None:
    """An idle session that was answered: `drained`'s claim finished (seq 1 the user's
    message, seq 2 the open answer, finished)."""
    drained(env)
    env.run(finish_iteration, "s", "e1", OWNER)


# An edit of `idle_answered`: drop what follows seq 1, store the edited text.
EDIT = ("s", '{"n": 2}', "edit", 1)


def surrogate_claimed(env: Env) -> None:
    """A claim whose first input holds a lone surrogate (the server's JSON check passes it,
    the codec refuses it), the second a plain object."""
    env.run(_store.submit, "s", '{"t": "\\ud800"}', "i1")
    env.run(_store.submit, "s", '{"n": 2}', "i2")
    env.run(_store.acquire, "s", "e1", OWNER, LEASE_MS)


def _seed_message(env: Env, message_id: str, seq: int) -> None:
    env.raw(
        "INSERT INTO session_message(id, session_id, execution_id, role, seq, data,"
        " time_created, time_updated, finished)"
        " VALUES (%s, 's', 'x', 'assistant', %s, %s, 0, 0, 1)",
        (message_id, seq, encode_assistant(_transcript.EMPTY)),
    )


def rewritten(env: Env) -> None:
    """Messages r1-r4 a stream held (`REWRITTEN_POSITION`), truncated after seq 2, then one
    new message at seq 3."""
    env.run(_store.wake, "s")
    for seq in range(1, 5):
        _seed_message(env, f"r{seq}", seq)
    env.run(_store.truncate, "s", 2)
    _seed_message(env, "n3", 3)


def set_aside_below(env: Env) -> None:
    """A message below the stream's marks set aside from the middle (as a quarantine drop
    does): only the marks below it hold."""
    env.raw("DELETE FROM session_message WHERE id = 'r2'")
    env.raw(
        "INSERT INTO session_message_rejected(id, session_id, execution_id, seq, data, reason,"
        " time_created) VALUES ('r2', 's', 'x', 2, '{', 'bad', 0)"
    )


REWRITTEN_POSITION = Position(
    4, message_tag("r4"), (), marks=((1, message_tag("r1")), (2, message_tag("r2")))
)


# ---------------------------------------------------------------------------------------------
# The operations


@attrs.frozen
class Operation:
    name: str
    setup: Step
    jobs: Callable[[], list[Job]]  # more than one: a group-commit batch
    mode: _postgres.Mode = "write"
    writes: bool = True  # False: an idempotent repeat or a refusal, post-state == pre-state

    def call(self, env: Env) -> list[tuple[str, Any]]:
        jobs = self.jobs()
        if len(jobs) == 1:
            env.engine.run_alone(jobs[0], self.mode)
        else:
            env.engine.run_batch(jobs)
        return outcome_of(jobs)


def do(op: Callable[..., Any], *args: Any) -> Step:
    """A setup step: run `op` in a transaction of its own."""
    return lambda env: env.run(op, *args)


def steps(*parts: Step) -> Step:
    def run(env: Env) -> None:
        for part in parts:
            part(env)

    return run


def one(op: Callable[..., Any], *args: Any) -> Callable[[], list[Job]]:
    return lambda: [Job(op, args)]


def recover(*items: tuple[_store.Candidate, str]) -> Callable[[], list[Job]]:
    return one(_store.apply_recovery_batch, RESCUER, list(items), LEASE_MS, 10)


OPERATIONS = [
    Operation("wake", empty, one(_store.wake, "s")),
    Operation("submit", empty, one(_store.submit, "s", '{"n": 1}', "i1")),
    Operation(
        "submit-retried",
        do(_store.submit, "s", '{"n": 1}', "i1"),
        one(_store.submit, "s", '{"n": 1}', "i1"),
        writes=False,
    ),
    Operation(
        "acquire",
        do(_store.wake, "s"),
        one(_store.acquire, "s", "e1", OWNER, LEASE_MS),
    ),
    Operation("wake_and_acquire", empty, one(_store.wake_and_acquire, "s", "e1", OWNER, LEASE_MS)),
    Operation(
        "submit_and_acquire",
        empty,
        one(_store.submit_and_acquire, "s", '{"n": 1}', "i1", "e1", OWNER, LEASE_MS),
    ),
    Operation(
        "take_inputs",
        steps(
            do(_store.submit, "s", '{"n": 1}', "i1"),
            do(_store.submit, "s", "[1]", "i2"),
            do(_store.acquire, "s", "e1", OWNER, LEASE_MS),
        ),
        one(_store.take_inputs, "s", "e1", OWNER),
    ),
    Operation(
        "take_inputs-lease-lost",
        steps(claimed, lapse),
        one(_store.take_inputs, "s", "e1", OWNER),
        writes=False,
    ),
    Operation(
        "begin_assistant",
        steps(claimed, do(_store.take_inputs, "s", "e1", OWNER)),
        one(_store.begin_assistant, "s", "e1", OWNER, "m1"),
    ),
    Operation(
        "update_assistant", drained, one(_store.update_assistant, "s", "e1", OWNER, "m1", APPEND)
    ),
    # The writer's view of the message is current: one autocommit call.
    Operation(
        "update_assistant-known",
        drained,
        one(_store.update_assistant, "s", "e1", OWNER, "m1", SETTLE_TOOL, KNOWN),
    ),
    # Stale: the call writes nothing, and the message is read and written in a transaction.
    Operation(
        "update_assistant-known-moved",
        drained,
        one(_store.update_assistant, "s", "e1", OWNER, "m1", SETTLE_TOOL, STALE),
    ),
    # The writer knows the version (2: begun at 0, two updates): one autocommit call.
    Operation(
        "append_assistant_text",
        drained,
        one(_store.append_assistant_text, "s", "e1", OWNER, "m1", " more", 2),
    ),
    Operation(
        "append_assistant_text-unknown-version",
        drained,
        one(_store.append_assistant_text, "s", "e1", OWNER, "m1", " more"),
    ),
    Operation(
        "append_assistant_text-lease-lost",
        steps(drained, lapse),
        one(_store.append_assistant_text, "s", "e1", OWNER, "m1", " more", 2),
        writes=False,
    ),
    Operation(
        "take_inputs-plain",
        steps(
            do(_store.submit, "s", '{"n": 1}', "i1"),
            do(_store.submit, "s", '{"n": 2}', "i2"),
            do(_store.acquire, "s", "e1", OWNER, LEASE_MS),
        ),
        one(_store.take_inputs, "s", "e1", OWNER),
    ),
    Operation("finish_iteration-plain-release", claimed, one(finish_iteration, "s", "e1", OWNER)),
    Operation(
        "finish_iteration-plain-continue",
        steps(claimed, do(_store.wake, "s")),
        one(finish_iteration, "s", "e1", OWNER),
    ),
    # An iteration's end alone is one call in autocommit: a lost reply's retry reads back
    # the release its lost call left on the session row; a continue is refused by that call
    # (nothing written) and runs in a transaction.
    *(
        Operation(f"end_iteration-{name}", setup, one(_store.end_iteration, "s", "e1", OWNER))
        for name, setup in (
            ("plain-release", claimed),
            ("plain-continue", steps(claimed, do(_store.wake, "s"))),
            ("plain-paused", steps(claimed, do(_store.pause, "s"))),
            ("ring-over", steps(claimed, do(_store.request_cancel, "s"))),
        )
    ),
    # The retry finds the claim lapsed and no release of its own on the session row.
    Operation(
        "end_iteration-lease-lost",
        steps(claimed, lapse),
        one(_store.end_iteration, "s", "e1", OWNER),
        writes=False,
    ),
    Operation(
        "finish_failed-plain",
        steps(claimed, do(_store.wake, "s")),
        one(_store.finish_failed, "s", "e1", OWNER, "boom"),
    ),
    Operation(
        "finish_interrupted-plain",
        steps(claimed, do(_store.submit, "s", '{"n": 3}', "i3")),
        one(_store.finish_interrupted, "s", "e1", OWNER),
    ),
    Operation(
        "acquire-held",
        steps(lambda env: claimed(env, owner="other"), do(_store.wake, "s")),
        one(_store.acquire, "s", "e2", OWNER, LEASE_MS),
        writes=False,
    ),
    Operation(
        "submit_and_acquire-held",
        lambda env: claimed(env, owner="other"),
        one(_store.submit_and_acquire, "s", '{"n": 2}', "i2", "e2", OWNER, LEASE_MS),
    ),
    Operation("finish_iteration-release", drained, one(finish_iteration, "s", "e1", OWNER)),
    Operation(
        "finish_iteration-continue",
        steps(drained, do(_store.wake, "s")),
        one(finish_iteration, "s", "e1", OWNER),
    ),
    Operation(
        "finish_iteration-ring-over",
        steps(
            do(_store.submit, "s", '{"n": 1}', "i1"),
            do(_store.acquire, "s", "e1", OWNER, LEASE_MS),
            do(_store.request_cancel, "s"),
        ),
        one(finish_iteration, "s", "e1", OWNER),
    ),
    Operation(
        "finish_failed",
        steps(drained, do(_store.submit, "s", '{"n": 3}', "i3")),
        one(_store.finish_failed, "s", "e1", OWNER, "boom"),
    ),
    Operation("mark_cancelling", drained, one(_store.mark_cancelling, "s", "e1", OWNER)),
    Operation(
        "mark_cancelling-nowait",
        drained,
        one(_store.mark_cancelling, "s", "e1", OWNER),
        mode="nowait",
    ),
    Operation(
        "finish_interrupted",
        steps(
            drained,
            do(_store.mark_cancelling, "s", "e1", OWNER),
            do(_store.submit, "s", '{"n": 3}', "i3"),
        ),
        one(_store.finish_interrupted, "s", "e1", OWNER),
    ),
    Operation(
        "request_cancel", lambda env: claimed(env, owner="other"), one(_store.request_cancel, "s")
    ),
    Operation("heartbeat", two_claims, one(_store.heartbeat, OWNER, ["e1", "e2"], LEASE_MS)),
    Operation(
        "expire_claims-nowait",
        two_claims,
        one(_store.expire_claims, OWNER, ["e1", "e2"]),
        mode="nowait",
    ),
    Operation("recovery-takeover", recovery_leased, recover((CANDIDATE, "e2"))),
    Operation(
        "recovery-finish-cancelled",
        functools.partial(recovery_leased, cancelling=True),
        recover((CANDIDATE, "e2")),
    ),
    Operation("recovery-drop-superseded", superseded, recover((CANDIDATE, "e2"))),
    Operation("recovery-exhausted", exhausted, recover((CANDIDATE, "e2"))),
    Operation("recovery-quarantine", malformed, recover((CANDIDATE, "e2"))),
    Operation(
        "recovery-two-rows",
        steps(
            functools.partial(claimed, session_id="t", execution_id="f1"),
            do(_store.mark_cancelling, "t", "f1", OWNER),
            recovery_leased,  # both expired claims leased
        ),
        recover((CANDIDATE, "e2"), (_store.Candidate("t", "f1"), "f2")),
    ),
    # Set-wise (`ts_recover`): claims whose execution wrote no assistant message, one
    # counted, one handed back by a graceful shutdown.
    Operation(
        "recovery-takeover-set-wise",
        steps(
            functools.partial(claimed, session_id="t", execution_id="f1"),
            do(_store.expire_claims, OWNER, ["f1"]),
            claimed,
            lapse,
            lease,
        ),
        recover((CANDIDATE, "e2"), (_store.Candidate("t", "f1"), "f2")),
    ),
    # Alone in autocommit, one call: one claim taken over, one live again and let go (a
    # retry after a lost reply reads both back).
    Operation(
        "recovery-set-wise-skipped-live",
        steps(
            functools.partial(claimed, session_id="t", execution_id="f1"),
            claimed,
            lapse,
            lease,
            live_again,
        ),
        recover((CANDIDATE, "e2"), (_store.Candidate("t", "f1"), "f2")),
    ),
    # A recovery pass's scan and its leases in one autocommit call (`ts_recovery_scan`).
    Operation(
        "recovery-scan-and-lease",
        steps(claimed, lapse),
        one(scan_and_lease, RESCUER, 10, [], [], LEASE_MS),
    ),
    Operation("lift_quarantine", quarantined, one(_store.lift_quarantine, "e1", RESCUER, LEASE_MS)),
    Operation("drop_quarantined", quarantined, one(_store.drop_quarantined, "e1")),
    Operation("drop_rejected_input", drained, one(_store.drop_rejected_input, "i2")),
    # Conversation control (DESIGN §5.1)
    Operation(
        "submit_controlled-interrupt",
        lambda env: claimed(env, owner="other"),
        one(_store.submit_controlled, "s", '{"n": 2}', "i9", "interrupt"),
    ),
    Operation(
        "submit_controlled-reject-refused",
        claimed,
        one(_store.submit_controlled, "s", '{"n": 2}', "i9", "reject"),
        writes=False,
    ),
    Operation(
        "submit_controlled_and_acquire",
        empty,
        one(
            _store.submit_controlled_and_acquire,
            "s",
            '{"n": 1}',
            "i1",
            "reject",
            "e1",
            OWNER,
            LEASE_MS,
        ),
    ),
    Operation(
        "submit_controlled_and_acquire-interrupt-held",
        lambda env: claimed(env, owner="other"),
        one(
            _store.submit_controlled_and_acquire,
            "s",
            '{"n": 2}',
            "i9",
            "interrupt",
            "e2",
            OWNER,
            LEASE_MS,
        ),
    ),
    Operation(
        "submit_scheduled",
        empty,
        one(_store.submit_scheduled, "s", '{"n": 1}', "i1", 5_000, "queue"),
    ),
    Operation(
        "promote_due",
        steps(do(_store.submit_scheduled, "s", '{"n": 1}', "i1", 1_000, "queue"), lapse),
        one(_store.promote_due, 100),
    ),
    Operation(
        "cancel_input", do(_store.submit, "s", '{"n": 1}', "i1"), one(_store.cancel_input, "i1")
    ),
    Operation("pause", empty, one(_store.pause, "s")),
    Operation(
        "resume",
        steps(
            do(_store.pause, "s"),
            do(_store.submit_scheduled, "s", '{"n": 1}', "i1", 1, "queue"),
            lapse,
        ),
        one(_store.resume, "s"),
    ),
    Operation(
        "end_iteration-hand-over",
        steps(drained, do(_store.mark_cancelling, "s", "e1", OWNER), do(_store.wake, "s")),
        one(_store.end_iteration, "s", "e1", OWNER),
    ),
    Operation(
        "end_iteration-paused",
        steps(drained, do(_store.pause, "s"), do(_store.wake, "s")),
        one(_store.end_iteration, "s", "e1", OWNER),
    ),
    Operation("delete_session", drained, one(_store.delete_session, "s")),
    Operation(
        "purge_batch",
        steps(drained, do(finish_iteration, "s", "e1", OWNER), lapse),
        one(_store.purge_batch, 1_000, "", 200),
    ),
    Operation("fork", drained, one(_store.fork, "s", "f", None)),
    Operation(
        "truncate",
        steps(drained, do(finish_iteration, "s", "e1", OWNER)),
        one(_store.truncate, "s", 1),
    ),
    # This stop's paths: an edit (`submit(truncate_after=)`, statement by statement around
    # `ts_truncate`), its retry and its refusals; the operator's pause and resume; the fast
    # take refused by the codec and the library's take after it; a stream's read after a
    # rewrite (its marks, and the set-aside seqs).
    Operation("submit_truncating", idle_answered, one(_store.submit_truncating, *EDIT)),
    Operation(
        "submit_truncating-retried",
        steps(idle_answered, do(_store.submit_truncating, *EDIT)),
        one(_store.submit_truncating, *EDIT),
        writes=False,
    ),
    Operation(
        "submit_truncating-taken-retried",
        steps(
            idle_answered,
            do(_store.submit_truncating, *EDIT),
            do(_store.acquire, "s", "e2", OWNER, LEASE_MS),
            do(_store.take_inputs, "s", "e2", OWNER),
            do(finish_iteration, "s", "e2", OWNER),
        ),
        one(_store.submit_truncating, *EDIT),
        writes=False,
    ),
    Operation(
        "submit_truncating-held",
        claimed,
        one(_store.submit_truncating, *EDIT),
        writes=False,
    ),
    Operation(
        "submit_truncating-pending",
        steps(idle_answered, do(_store.submit, "s", '{"n": 3}', "i3")),
        one(_store.submit_truncating, *EDIT),
        writes=False,
    ),
    Operation(
        "submit_truncating-conflict",
        steps(idle_answered, do(_store.submit, "t", '{"n": 3}', "edit")),
        one(_store.submit_truncating, *EDIT),
        writes=False,
    ),
    Operation("pause_session", drained, one(_store.pause_session, "s", False)),
    Operation("pause_session-create", empty, one(_store.pause_session, "s", True)),
    Operation("pause_session-unknown", empty, one(_store.pause_session, "s", False), writes=False),
    Operation(
        "resume_existing",
        steps(
            do(_store.pause, "s"),
            do(_store.submit_scheduled, "s", '{"n": 1}', "i1", 1, "queue"),
            lapse,
        ),
        one(_store.resume_existing, "s"),
    ),
    Operation("resume_existing-unknown", empty, one(_store.resume_existing, "s"), writes=False),
    Operation(
        "take_inputs-fast-refused",
        surrogate_claimed,
        one(_store.take_inputs, "s", "e1", OWNER),
        writes=False,
    ),
    Operation(
        "take_inputs-after-fast-refused",
        surrogate_claimed,
        one(_store.take_inputs, "s", "e1", OWNER, 200, False),
    ),
    Operation(
        "stream_changes-rewritten",
        rewritten,
        one(_store.stream_changes, "s", REWRITTEN_POSITION),
        mode="read",
        writes=False,
    ),
    Operation(
        "stream_changes-rewritten-set-aside",
        steps(rewritten, set_aside_below),
        one(_store.stream_changes, "s", REWRITTEN_POSITION),
        mode="read",
        writes=False,
    ),
    Operation(
        "group-commit",
        empty,
        lambda: [
            Job(_store.submit, ("s1", '{"n": 1}', "i1")),
            Job(_store.wake, ("s2",)),
            Job(_store.submit, ("s3", '{"n": 3}', "i3")),
        ],
    ),
    # A web process's submits queued together: one set-wise call (`ts_submits`) in
    # autocommit for a new input, a known one and one session's second input.
    Operation(
        "group-commit-set-wise-plain-submits",
        steps(empty, do(_store.submit, "s2", '{"n": 2}', "i2")),
        lambda: [
            Job(_store.submit, ("s1", '{"n": 1}', "i1")),
            Job(_store.submit, ("s2", '{"n": 2}', "i2")),
            Job(_store.submit, ("s1", '{"n": 4}', "i4")),
        ],
    ),
    # Known payloads in another spelling: the call's FALLBACK (nothing written by it), then
    # each submit on its own, through the path that compares JSON values.
    Operation(
        "group-commit-set-wise-submits-row-path",
        steps(
            empty, do(_store.submit, "s1", '{"n": 1}', "i1"), do(_store.submit, "s2", "[2]", "i2")
        ),
        lambda: [
            Job(_store.submit, ("s1", '{"n":  1}', "i1")),
            Job(_store.submit, ("s2", "[ 2 ]", "i2")),
        ],
        writes=False,
    ),
    # Set-wise: two kinds, two jobs each, one call per kind (`pg_batched`).
    Operation(
        "group-commit-set-wise",
        steps(two_claims, do(_store.wake, "s2")),
        lambda: [
            Job(_store.end_iteration, ("s1", "e1", OWNER)),
            Job(_store.submit_and_acquire, ("s3", '{"n": 3}', "i3", "e3", OWNER, LEASE_MS)),
            Job(_store.end_iteration, ("s2", "e2", OWNER)),
            Job(_store.submit_and_acquire, ("s4", '{"n": 4}', "i4", "e4", OWNER, LEASE_MS)),
        ],
    ),
    # Set-wise submits the one statement settles (new sessions, an idle one whose doorbell
    # it takes) beside those it leaves to the row function in the same call (a held
    # session, a session's second job).
    Operation(
        "group-commit-set-wise-submits",
        steps(two_claims, do(_store.submit, "s5", '{"n": 5}', "i5")),
        lambda: [
            Job(_store.submit_and_acquire, ("s3", '{"n": 3}', "i3", "e3", OWNER, LEASE_MS)),
            Job(_store.submit_and_acquire, ("s1", '{"n": 1}', "i1b", "e1b", OWNER, LEASE_MS)),
            Job(_store.submit_and_acquire, ("s3", '{"n": 4}', "i4", "e4", OWNER, LEASE_MS)),
            Job(_store.submit_and_acquire, ("s5", '{"n": 6}', "i6", "e5", OWNER, LEASE_MS)),
        ],
    ),
    # Set-wise acquires, wakes and acquires: the claims the one statement takes (a rung
    # session, a new one) beside rows left to the row functions (held, a second job).
    Operation(
        "group-commit-set-wise-acquires",
        steps(two_claims, do(_store.wake, "s3"), do(_store.wake, "s4")),
        lambda: [
            Job(_store.acquire, ("s3", "e3", OWNER, LEASE_MS)),
            Job(_store.wake_and_acquire, ("s5", "e5", OWNER, LEASE_MS)),
            Job(_store.acquire, ("s1", "e1b", OWNER, LEASE_MS)),
            Job(_store.acquire, ("s4", "e4", OWNER, LEASE_MS)),
            Job(_store.wake_and_acquire, ("s2", "e2b", OWNER, LEASE_MS)),
            Job(_store.acquire, ("s3", "e3b", OWNER, LEASE_MS)),
        ],
    ),
    # The change scan (a read): one call in autocommit, read again after a lost reply.
    Operation(
        "changes",
        steps(
            two_claims,
            do(_store.mark_cancelling, "s2", "e2", OWNER),
            do(_store.submit, "s3", '{"n": 3}', "i3"),
        ),
        one(_store.changes, OWNER, [], ["e1", "e2", "e-gone"], 10, {}),
        mode="read",
        writes=False,
    ),
    Operation(
        "group-commit-with-a-refusal",
        empty,
        lambda: [
            Job(_store.submit, ("s1", '{"n": 1}', "i1")),
            Job(_store.take_inputs, ("s", "no-such-execution", OWNER)),
            Job(_store.wake, ("s2",)),
        ],
    ),
]


def reruns(operation: Operation, statements: list[str], k: int, mode: Mode) -> int:
    """How many transactions a fault at statement k must run again: one, unless its COMMIT
    landed, which is read back and never applied again."""
    if _postgres.engine.SIGNAL_WAITING in statements[k - 1]:
        return 0  # after a refusal rolled back: a signal, best effort, nothing to run again
    if statements[k - 1] != "COMMIT" or mode not in LANDED:
        return 1
    if mode is Mode.AFTER:
        # Answered: nothing to read back; the operation's next transaction, if any, finds
        # the connection gone before it sent anything.
        return int(k < len(statements))
    # A transaction that wrote nothing has no id to read back: it runs again, harmlessly.
    return int(not operation.writes)


def prepare(env: Env, operation: Operation) -> dict[str, list[tuple[Any, ...]]]:
    env.reset()
    operation.setup(env)
    return snapshot(env.control)


@attrs.frozen
class Saved:
    """A pre-state as rows, restored in one transaction (cheaper than its setup)."""

    tables: dict[str, tuple[list[str], list[tuple[Any, ...]]]]
    now: float

    @classmethod
    def take(cls, env: Env) -> Saved:
        tables = {}
        for table in TABLES:
            cursor = env.control.execute(sql.SQL("SELECT * FROM {}").format(sql.Identifier(table)))
            tables[table] = (
                [column.name for column in cursor.description or ()],
                cursor.fetchall(),
            )
        return cls(tables, env.clock.now)

    def restore(self, env: Env) -> None:
        with env.control.transaction(), env.control.cursor() as cursor:
            cursor.execute("DELETE FROM session_recovery; DELETE FROM session")
            for table, (columns, rows) in self.tables.items():  # `session` first
                if rows:
                    cursor.executemany(
                        sql.SQL("INSERT INTO {} ({}) VALUES ({})").format(
                            sql.Identifier(table),
                            sql.SQL(", ").join(map(sql.Identifier, columns)),
                            sql.SQL(", ").join(sql.Placeholder() * len(columns)),
                        ),
                        rows,
                    )
        env.clock.now = self.now


@attrs.frozen
class CleanRun:
    """An operation run once without faults, from its prepared state: the state before
    (`pre`, and `saved` to restore it), what it reported, the statements it sent, the
    transactions it took and the state after - what every faulted run must match."""

    pre: dict[str, list[tuple[Any, ...]]]
    saved: Saved
    expected: Any
    statements: list[str]
    transactions: int
    post: dict[str, list[tuple[Any, ...]]]

    @classmethod
    def of(cls, env: Env, operation: Operation) -> CleanRun:
        pre = prepare(env, operation)
        saved = Saved.take(env)
        env.faults.recorded = []
        transactions = env.engine.transactions
        expected = operation.call(env)
        statements, env.faults.recorded = env.faults.recorded, None
        transactions = env.engine.transactions - transactions
        post = snapshot(env.control)
        assert (post != pre) == operation.writes, "the clean run did not do what it should"
        return cls(pre, saved, expected, statements, transactions, post)


@pytest.mark.parametrize("operation", OPERATIONS, ids=[op.name for op in OPERATIONS])
def test_every_statement_of_every_operation(
    pg_url: str, migrated_schema: str, operation: Operation
) -> None:
    """The connection lost before, while and after each statement and its COMMIT: the
    operation reports what its clean run reported, the durable state is exactly the clean
    post-state (a landed COMMIT read back, not re-applied), and the engine carries on."""
    # A schema migrated already (the pool's): faults are armed only after the setup, so the
    # migration a fresh schema needed was never under test here, only paid for per case.
    with environment(pg_url, migrated_schema) as env:
        clean = CleanRun.of(env, operation)
        statements = clean.statements
        # Committed by a COMMIT, or by a function call in autocommit (its own COMMIT).
        committed = "COMMIT" in statements or any(s.startswith(AUTOCOMMIT) for s in statements)
        assert committed or not operation.writes
        fired = 0
        for k, statement in enumerate(statements, 1):
            for mode in modes_for(statement):
                where = f"statement {k} ({statement[:60]!r}), {mode.value}"
                clean.saved.restore(env)
                assert snapshot(env.control) == clean.pre, (
                    f"{where}: the pre-state was not restored"
                )
                transactions = env.engine.transactions
                reconnects = env.engine.reconnects
                env.faults.arm(Plan(k, mode))
                got = operation.call(env)
                assert env.faults.fired == statement, f"{where}: another statement ran"
                assert got == clean.expected, where
                assert snapshot(env.control) == clean.post, where
                extra = env.engine.transactions - transactions - clean.transactions
                assert extra == reruns(operation, statements, k, mode), where
                # The next operation succeeds, on the one re-opened connection.
                env.run(_store.wake, "probe")
                assert env.engine.reconnects == reconnects + 1, where
                fired += 1
        assert fired >= 2 * len(statements)


# A serialisation failure, a deadlock, a statement timeout: the whole transaction runs again.
REFUSALS = ("40001", "40P01", "57014")


@pytest.mark.parametrize(
    "operation",
    [op for op in OPERATIONS if len(op.jobs()) == 1 and op.mode != "nowait"],
    ids=lambda op: op.name,
)
def test_every_statement_of_every_operation_refused_with_a_retryable_error(
    pg_url: str, migrated_schema: str, operation: Operation
) -> None:
    """DESIGN §8: serialisation failures, deadlocks (and timeouts) are retried inside the
    store. The server refuses each statement in turn with each of them, aborting the
    transaction it is in: the operation reports what its clean run reported, the durable
    state is exactly the clean post-state (nothing of the refused attempt, nothing twice),
    on the same connection, with exactly one transaction run again."""
    with environment(pg_url, migrated_schema) as env:
        clean = CleanRun.of(env, operation)
        fired = 0
        for k, statement in enumerate(clean.statements, 1):
            if statement == "COMMIT" or _postgres.engine.SIGNAL_WAITING in statement:
                # READ COMMITTED refuses no COMMIT with these; the signal after a refusal
                # is best effort, nothing to run again.
                continue
            for sqlstate in REFUSALS:
                where = f"statement {k} ({statement[:60]!r}), {sqlstate}"
                clean.saved.restore(env)
                transactions = env.engine.transactions
                reconnects = env.engine.reconnects
                env.faults.arm(Plan(k, Mode.REFUSED, sqlstate=sqlstate))
                got = operation.call(env)
                assert env.faults.fired == statement, f"{where}: another statement ran"
                assert got == clean.expected, where
                assert snapshot(env.control) == clean.post, where
                assert env.engine.transactions - transactions - clean.transactions == 1, where
                assert env.engine.reconnects == reconnects, where
                fired += 1
        assert fired >= len(REFUSALS)


def test_a_recovery_takeover_alone_is_one_autocommit_call_unless_a_row_needs_its_path(
    pg_url: str, pg_schema: str
) -> None:
    """Alone, a set-wise takeover is one `ts_recover` call in autocommit (no BEGIN, no
    COMMIT); a batch with a claim that needs the row-by-row path is refused whole by that
    call (nothing written) and runs again in a transaction."""
    with environment(pg_url, pg_schema) as env:
        for name, expected in (
            ("recovery-takeover-set-wise", ["ts_recover"]),
            ("recovery-two-rows", ["ts_recover", "BEGIN", "COMMIT"]),
        ):
            op = operation(name)
            prepare(env, op)
            env.faults.recorded = []
            [(status, _)] = op.call(env)
            statements, env.faults.recorded = env.faults.recorded, None
            assert status == "ok"
            assert statements[0].startswith(AUTOCOMMIT) and "ts_recover(" in statements[0]
            shape = ["ts_recover"] + [
                kind for kind in ("BEGIN", "COMMIT") if any(kind in s for s in statements)
            ]
            assert shape == expected, name


# ---------------------------------------------------------------------------------------------
# Bounds: StoreError only once the server stayed unreachable


@pytest.fixture
def short_patience(monkeypatch: pytest.MonkeyPatch) -> float:
    monkeypatch.setattr(_postgres.engine, "RECONNECT_PATIENCE_S", 0.3)
    return 0.3


def operation(name: str) -> Operation:
    return next(op for op in OPERATIONS if op.name == name)


@pytest.mark.parametrize(
    ("name", "k", "mode", "error"),
    [
        # A transaction: lost before its write, or its write's reply lost before COMMIT.
        ("update_assistant", 2, Mode.BEFORE, "StoreError"),
        ("update_assistant", 2, Mode.LOST, "StoreError"),
        # One call in autocommit, lost before it was sent: the engine cannot tell that from
        # a call whose reply was lost, so its outcome is unknown to it.
        ("submit", 1, Mode.BEFORE, "OutcomeUnknown"),
    ],
)
def test_unreachable_server_fails_the_operation_after_the_bound_with_nothing_written(
    pg_url: str,
    pg_schema: str,
    short_patience: float,
    name: str,
    k: int,
    mode: Mode,
    error: str,
) -> None:
    """The connection is lost before the operation committed and the server stays
    unreachable: StoreError (`OutcomeUnknown` where the engine cannot know) once the bound
    has passed, nothing of the operation is durable, and once the server is back the same
    operation succeeds."""
    with environment(pg_url, pg_schema) as env:
        pre = prepare(env, operation(name))
        env.faults.arm(Plan(k, mode, then_unreachable=True))
        started = time.monotonic()
        [(kind, message)] = operation(name).call(env)
        assert kind == error, message
        assert time.monotonic() - started >= short_patience
        assert snapshot(env.control) == pre
        env.faults.unreachable = False
        [(kind, _)] = operation(name).call(env)
        assert kind == "ok"
        assert snapshot(env.control) != pre
        if name == "submit":
            assert env.control.execute("SELECT id FROM session_input").fetchall() == [("i1",)]


@pytest.mark.parametrize("then", ["retried", "taken-and-answered-then-retried"])
def test_an_edit_whose_commit_stays_unknown_is_retried_by_its_input_id_deleting_nothing_more(
    pg_url: str, pg_schema: str, short_patience: float, then: str
) -> None:
    """DESIGN §6.19 for an edit (`submit_truncating`): its COMMIT lands, the reply is lost
    and the server cannot be asked within the bound - `OutcomeUnknown`, the edit durable.
    The caller's retry with the same input id, once the server is back (also after a
    worker took the edited input and answered it), returns the id, deletes nothing more
    and stores nothing: the state is the landed edit's (and the answer's)."""
    with environment(pg_url, pg_schema) as env:
        idle_answered(env)
        saved = Saved.take(env)
        env.faults.recorded = []
        env.run(_store.submit_truncating, *EDIT)  # a clean run: where its COMMIT comes
        k = env.faults.recorded.index("COMMIT") + 1
        env.faults.recorded = None
        saved.restore(env)
        env.faults.arm(Plan(k, Mode.LOST, then_unreachable=True))
        job = Job(_store.submit_truncating, EDIT)
        env.engine.run_alone(job)
        [(kind, message)] = outcome_of([job])
        assert env.faults.fired == "COMMIT"
        assert kind == "OutcomeUnknown", message
        env.faults.unreachable = False
        if then != "retried":
            env.run(_store.acquire, "s", "e2", OWNER, LEASE_MS)
            env.run(_store.take_inputs, "s", "e2", OWNER)
            env.run(_store.begin_assistant, "s", "e2", OWNER, "m2")
            env.run(finish_iteration, "s", "e2", OWNER)
        landed = snapshot(env.control)
        assert env.run(_store.submit_truncating, *EDIT) == "edit"
        assert snapshot(env.control) == landed
        edited = "SELECT seq, role, input_id FROM session_message ORDER BY seq"
        pending = "SELECT id FROM session_input"
        if then == "retried":
            assert env.control.execute(edited).fetchall() == [(1, "user", "i1")]
            assert env.control.execute(pending).fetchall() == [("edit",)]
        else:
            assert env.control.execute(edited).fetchall() == [
                (1, "user", "i1"),
                (2, "user", "edit"),
                (3, "assistant", None),
            ]
            assert env.control.execute(pending).fetchall() == []


def test_a_transaction_reading_back_a_lost_call_reports_its_outcome_unknown(
    pg_url: str, pg_schema: str, short_patience: float
) -> None:
    """A call in autocommit lost its reply and its retry needs a transaction (`retry`: it
    reads back whether the lost call landed); when that transaction cannot run within the
    bound (the server unreachable), the lost call's outcome is still unknown: the job
    fails with OutcomeUnknown, not a plain StoreError that callers take as "nothing
    written" (an iteration's end would then be finished as failed, stranding an input)."""
    with environment(pg_url, pg_schema) as env:
        env.run(_store.wake, "s")
        env.faults.unreachable = True
        env.engine.close()  # the next connection is a new one, which cannot be made
        job = Job(_store.acquire, ("s", "e1", OWNER, LEASE_MS))
        with pytest.raises(OutcomeUnknown, match="outcome of a COMMIT is unknown"):
            env.engine._transaction([job], "write", alone=True, retry=True)
        with pytest.raises(StoreError) as plain:  # the same without a lost call before it
            env.engine._transaction([job], "write", alone=True, retry=False)
        assert not isinstance(plain.value, OutcomeUnknown)


@pytest.mark.parametrize("mode", [Mode.BEFORE, Mode.LOST])
@pytest.mark.parametrize("set_wise", [False, True], ids=["alone", "set-wise"])
def test_a_read_whose_connection_is_lost_while_the_server_is_gone_is_no_unknown_commit(
    pg_url: str, pg_schema: str, short_patience: float, mode: Mode, set_wise: bool
) -> None:
    """Found by an audit. A read (a transcript's, one call in autocommit; or a hand-off's
    stream reads, one set-wise call) whose connection is lost, the server gone until the
    engine's bound passed, failed with `OutcomeUnknown` - "the outcome of a COMMIT is
    unknown", which tells the caller a write may have landed: the engine took the lost
    reply of any call in autocommit for a write's. A read commits nothing (DESIGN §8
    "Uncertain commits" are a write's): now it fails with a plain `StoreError` once the
    bound has passed, and reads again once the server is back."""
    with environment(pg_url, pg_schema) as env:
        env.run(_store.submit, "s", '{"n": 1}', "i1")
        if set_wise:
            jobs = [Job(_store.stream_changes, (s, Position())) for s in ("s", "t")]
        else:
            jobs = [Job(_store.read_transcript, ("s",))]
        env.faults.arm(Plan(1, mode, then_unreachable=True))
        started = time.monotonic()
        env.engine.run_reads(jobs)
        assert time.monotonic() - started >= short_patience
        for job in jobs:
            assert isinstance(job.error, StoreError), job.error
            assert not isinstance(job.error, OutcomeUnknown), job.error
        env.faults.unreachable = False
        again = [Job(job.op, job.args) for job in jobs]
        env.engine.run_reads(again)
        assert [job.error for job in again] == [None] * len(again)


def test_commit_whose_outcome_stays_unknown_is_reported_as_store_error(
    pg_url: str, pg_schema: str, short_patience: float
) -> None:
    """The acquire's COMMIT lands, its reply is lost and the server cannot be asked: the
    acquire reports OutcomeUnknown, a StoreError (never a claim), though the claim row is
    durable."""
    with environment(pg_url, pg_schema) as env:
        env.run(_store.wake, "s")
        # Alone, an acquire is one call in autocommit: its own COMMIT.
        env.faults.arm(Plan(None, Mode.LOST, match="ts_acquire(", then_unreachable=True))
        job = Job(_store.acquire, ("s", "e1", OWNER, LEASE_MS))
        env.engine.run_alone(job)
        [(kind, message)] = outcome_of([job])
        assert kind == "OutcomeUnknown"
        assert "outcome of a COMMIT is unknown" in message
        env.faults.unreachable = False
        assert env.control.execute("SELECT id, owner_id FROM session_execution").fetchall() == [
            ("e1", OWNER)
        ]


def test_commit_still_in_progress_past_the_bound_is_reported_as_store_error(
    pg_url: str, pg_schema: str, short_patience: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DESIGN §6.19: a batch's COMMIT (an acquire beside a submit) lands, its reply is lost,
    and the server, asked again and again, still calls the transaction 'in progress' (it
    has not noticed the broken connection) until the bound: every job reports StoreError,
    never a claim - an outcome not known is not taken as committed - though the claim row
    is durable."""
    asked: list[str] = []

    def in_progress(conn: Any, xid: str) -> str:
        asked.append(xid)
        return "in progress"

    def batch(n: int) -> list[Job]:
        return [
            Job(_store.acquire, (f"s{n}", f"e{n}", OWNER, LEASE_MS)),
            Job(_store.submit, (f"t{n}", "{}", f"i{n}")),
        ]

    with environment(pg_url, pg_schema) as env:
        for n in (0, 1):
            env.run(_store.wake, f"s{n}")
        env.faults.recorded = []
        env.engine.run_batch(batch(0))  # a clean run: where its COMMIT comes
        k = env.faults.recorded.index("COMMIT") + 1
        env.faults.recorded = None
        monkeypatch.setattr(_postgres.engine, "_xact_status", in_progress)
        env.faults.arm(Plan(k, Mode.LOST))
        jobs = batch(1)
        started = time.monotonic()
        env.engine.run_batch(jobs)
        assert env.faults.fired == "COMMIT"
        outcome = outcome_of(jobs)
        assert [kind for kind, _ in outcome] == ["OutcomeUnknown", "OutcomeUnknown"], outcome
        assert "is still 'in progress'" in outcome[0][1]
        assert time.monotonic() - started >= short_patience
        assert len(asked) > 1  # polled until the bound, not given up at the first answer
        claims = "SELECT id, owner_id FROM session_execution WHERE session_id = 's1'"
        assert env.control.execute(claims).fetchall() == [("e1", OWNER)]


# ---------------------------------------------------------------------------------------------
# The runtime: an uncertain claim is never treated as owned (DESIGN §6.19)


async def test_uncertain_claim_is_never_owned_and_recovery_takes_it(
    pg_url: str, pg_schema: str, autojump_clock: MockClock, short_patience: float
) -> None:
    """submit's claim COMMIT lands but its outcome cannot be read back: submit raises
    StoreError and no drain starts; the retried submit (same input id) stores one input and
    does not re-enter the claim; once the lease ran out, recovery takes the claim over and
    the input is drained exactly once."""
    calls: list[tuple[str, bool]] = []

    async def drain(ctx: DrainContext) -> None:
        calls.append((ctx.session_id, ctx.resumed))
        await ctx.take_inputs()

    with control_connection(pg_url, pg_schema) as control:
        faults = Faults(pg_url, pg_schema, control)
        store = PostgresStore(
            pg_url, schema=pg_schema, inline=True, listen=False, wrap_connection=faults.wrap
        )
        async with open_runtime(
            store, drain, clock=ts_testing.trio_clock(), lease=3.0, recovery_interval=0.5
        ) as runtime:
            # The claim commits with the call itself (autocommit), its reply is lost.
            faults.arm(Plan(None, Mode.LOST, match="ts_submit_and_acquire(", then_unreachable=True))
            with pytest.raises(StoreError, match="outcome of a COMMIT is unknown"):
                await runtime.submit("s", {"n": 1}, input_id="i1")
            faults.unreachable = False
            claim = control.execute("SELECT id, owner_id FROM session_execution").fetchall()
            assert [owner for _, owner in claim] == [runtime.owner_id]  # it did land
            assert not runtime.is_active("s")
            assert await runtime.submit("s", {"n": 1}, input_id="i1") == "i1"
            assert not runtime.is_active("s")  # its own claim row: not re-entered
            await trio.sleep(1.0)
            assert calls == []
            await trio.sleep(3.0)  # the lease runs out; a recovery pass takes the claim over
            await runtime.wait_idle("s")
        assert calls == [("s", True)]
        assert control.execute("SELECT input_id FROM session_message").fetchall() == [("i1",)]
        assert control.execute("SELECT count(*) FROM session_input").fetchall() == [(0,)]
        assert control.execute("SELECT count(*) FROM session_execution").fetchall() == [(0,)]


# ---------------------------------------------------------------------------------------------
# The listener: lost, re-LISTENed, and the doorbells rescanned


async def test_wake_sent_while_the_listener_is_down_is_taken_without_waiting_for_the_poll(
    pg_url: str, pg_schema: str, autojump_clock: MockClock
) -> None:
    """The LISTEN connection's backend is terminated and a wake commits from another process
    before the listener noticed (its notification is lost): the listener reconnects and the
    runtime rescans the doorbells, so the drain starts long before the fallback poll."""
    entered = trio.Event()

    async def drain(ctx: DrainContext) -> None:
        entered.set()
        await ctx.take_inputs()

    store = PostgresStore(pg_url, schema=pg_schema, inline=True)
    producer = PostgresStore(pg_url, schema=pg_schema, listen=False).engine()
    channel = _postgres.channel(pg_schema)
    with control_connection(pg_url, pg_schema) as control:
        async with open_runtime(
            store, drain, clock=ts_testing.trio_clock(), recovery_interval=1_000.0
        ) as runtime:
            await trio.testing.wait_all_tasks_blocked()
            [(listener,)] = control.execute(
                "SELECT pid FROM pg_stat_activity WHERE query = %s",
                (sql.SQL("LISTEN {}").format(sql.Identifier(channel)).as_string(control),),
            ).fetchall()
            reconnects = runtime.statistics().store.reconnects
            started = trio.current_time()
            # Both on the trio thread: the listener cannot see anything in between.
            terminate_on(control, listener)
            producer.open()
            try:
                run_op(producer, _store.submit, "s", '{"n": 1}', "i1")
            finally:
                producer.close()
            with trio.fail_after(CHANGE_FALLBACK_POLL / 4):
                await entered.wait()
                await runtime.wait_idle("s")
            assert trio.current_time() - started < CHANGE_FALLBACK_POLL / 4
            await trio.testing.wait_all_tasks_blocked()
            assert runtime.statistics().store.reconnects == reconnects + 1
            [(relistening,)] = control.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE query = %s AND pid != %s",
                (
                    sql.SQL("LISTEN {}").format(sql.Identifier(channel)).as_string(control),
                    listener,
                ),
            ).fetchall()
            assert relistening == 1


# ---------------------------------------------------------------------------------------------
# The runtime on the group-commit executor carries on


async def test_group_commit_runtime_carries_on_while_its_connection_keeps_dying(
    pg_url: str, pg_schema: str
) -> None:
    """The threaded executor (group commit, the server's clock) drains 20 sessions submitted
    at once while its writers' connections are lost five times (fewer than a transaction's
    attempts), at every 15th statement of either writer (before it is sent, or with its
    reply lost, COMMITs included; the run sends about 90 without faults): every submit
    returns, every input is drained exactly once and answered once, and no claim is left."""
    answered: list[str] = []

    async def drain(ctx: DrainContext) -> None:
        for item in await ctx.take_inputs():
            writer = await ctx.begin_assistant()
            await writer.append_text(f"echo {item.payload['n']}")
            await writer.finish()
            answered.append(item.id)

    with control_connection(pg_url, pg_schema) as control:
        faults = Faults(pg_url, pg_schema, control)
        store = PostgresStore(pg_url, schema=pg_schema, listen=False, wrap_connection=faults.wrap)
        with trio.fail_after(60):
            async with open_runtime(store, drain) as runtime:
                faults.arm(Plan(None, Mode.BEFORE, every=15, times=5))
                async with trio.open_nursery() as nursery:
                    for n in range(20):
                        nursery.start_soon(
                            functools.partial(runtime.submit, input_id=f"i{n}"), f"s{n}", {"n": n}
                        )
                for n in range(20):
                    await runtime.wait_idle(f"s{n}")
                assert faults.firings == 5
                assert runtime.statistics().store.reconnects >= 5
        assert sorted(answered) == sorted(f"i{n}" for n in range(20))
        rows = control.execute(
            "SELECT session_id, role, input_id FROM session_message ORDER BY session_id, seq"
        ).fetchall()
        assert rows == [
            row
            for n in sorted(range(20), key=str)
            for row in ((f"s{n}", "user", f"i{n}"), (f"s{n}", "assistant", None))
        ]
        assert control.execute("SELECT count(*) FROM session_input").fetchall() == [(0,)]
        assert control.execute("SELECT count(*) FROM session_execution").fetchall() == [(0,)]


async def test_reads_of_one_hand_off_reach_store_error_within_a_bound_when_the_server_hangs(
    pg_url: str, pg_schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """README ("A server ... that stops answering while the connection stays up is given
    15 s per reply: then the writer's connection counts as lost, and the call fails with
    `StoreError`"), DESIGN §8. Three reads share a lane's hand-off (run each alone; the
    lane wakes their callers once `run_reads` returns) when the server stops answering:
    the first is cut after REPLY_BOUND_S, and then each of the others re-opens the
    connection for its own RECONNECT_PATIENCE_S (a connect_timeout per attempt, the server
    accepting TCP but never answering), one after the other - every caller of the hand-off
    waits REPLY_BOUND_S + (reads - 1) x RECONNECT_PATIENCE_S (about 36 s here, and
    640 s for a hand-off of 64), not one bound."""
    from test_worker import HangingProxy

    from trio_sessions._postgres import connections
    from trio_sessions._postgres import engine as pg_engine

    monkeypatch.setattr(connections, "REPLY_BOUND_S", 4.0)  # waited out: short here

    def read(tx: Any, session_id: str) -> Any:
        return tx.one("SELECT ?::text", (session_id,))

    proxy = HangingProxy.to(pg_url)
    async with trio.open_nursery() as nursery:
        await proxy.serve(nursery)
        engine = PostgresStore(proxy.url(pg_url), schema=pg_schema).engine()
        await trio.to_thread.run_sync(engine.open)
        try:
            jobs = [Job(read, (f"r{index}",)) for index in range(3)]
            await trio.to_thread.run_sync(engine.run_reads, jobs[:1])
            assert jobs[0].result == ("r0",)
            proxy.stall()
            jobs = [Job(read, (f"r{index}",)) for index in range(3)]
            started = time.monotonic()
            await trio.to_thread.run_sync(engine.run_reads, jobs)
            elapsed = time.monotonic() - started
        finally:
            await trio.to_thread.run_sync(engine.close)
            nursery.cancel_scope.cancel()
    assert all(isinstance(job.error, StoreError) for job in jobs), [j.error for j in jobs]
    bound = connections.REPLY_BOUND_S + 1 + pg_engine.RECONNECT_PATIENCE_S + 2
    assert elapsed <= bound, f"the hand-off's callers got StoreError after {elapsed:.1f} s"


async def open_while_the_server_hangs(
    pg_url: str, schema: str, stall_on: bytes, *, wait: float, **options: Any
) -> tuple[bool, list[BaseException | None], float]:
    """Open an engine through a proxy to the server that hangs once `stall_on` passes (it
    forwards nothing more, keeps every connection open), in a thread - which trio could not
    cancel. Whether the proxy stalled, how `open(**options)` ended (nothing, when it had not
    within `wait` seconds: the proxy then closes its connections, so the thread ends), and
    after how long."""
    from test_worker import HangingProxy

    proxy = HangingProxy.to(pg_url)
    outcome: list[BaseException | None] = []
    async with trio.open_nursery() as nursery:
        await proxy.serve(nursery)
        engine = PostgresStore(proxy.url(pg_url), schema=schema).engine()
        proxy.stall_on(stall_on)

        def open_it() -> None:
            try:
                engine.open(**options)
            except BaseException as exc:
                outcome.append(exc)
            else:
                outcome.append(None)

        runner = threading.Thread(target=open_it, daemon=True)
        runner.start()
        started = time.monotonic()
        while not outcome and time.monotonic() - started < wait:
            await trio.sleep(0.1)
        elapsed = time.monotonic() - started
        ended = list(outcome)
        nursery.cancel_scope.cancel()
    runner.join(10)
    engine.close()
    return proxy.stalled, ended, elapsed


async def test_opening_an_engine_on_a_server_that_hangs_during_the_migration_is_bounded(
    pg_url: str, pg_schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DESIGN §8 (`StoreError` after a bound), README (15 s per reply). The server stops
    answering once the engine's first connection sent its migration's first statement: the
    migration's waits are not watched (`watch_replies` comes after it, "a migration may wait
    for another process's" - but that wait is the advisory lock's, which `MIGRATION_WAIT_S`
    ends within 20 s, below the reply bound), so `open` - `open_runtime`, a worker's start,
    every CLI command - waits for ever, in a thread trio cannot cancel."""
    from trio_sessions._postgres import connections

    monkeypatch.setattr(connections, "REPLY_BOUND_S", 4.0)  # waited out: short here
    stalled, ended, elapsed = await open_while_the_server_hangs(
        pg_url, pg_schema, b"pg_advisory_xact_lock(", wait=40
    )
    assert stalled
    assert ended, f"engine.open still waiting {elapsed:.0f} s after the server hung"
    assert isinstance(ended[0], StoreError), ended


async def test_a_connection_whose_server_hangs_right_after_it_logged_in_is_bounded(
    pg_url: str, migrated_schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by an audit. DESIGN §8: `StoreError` "only after a bound"; every wait for a
    reply is bounded (`_ReplyWatchdog`). `connect` sent `SET idle_session_timeout = 0` (and
    its COMMIT) after the login but before the watchdog watched the new connection: a
    server that hung right then - frozen, failing over, a stuck proxy, while its kernel
    still acknowledges - held the connect for ever (keepalives are answered,
    `connect_timeout` is over, `tcp_user_timeout` sees its data acknowledged). Every
    connection passes there: an engine's open and each reconnect, the listener's reconnect
    (in a thread trio cannot cancel, so the runtime could not even close) and the liveness
    token's. Now the connection is watched from its login on: that wait is cut at the bound
    and the connect fails with `StoreError`."""

    from trio_sessions._postgres import connections

    monkeypatch.setattr(connections, "REPLY_BOUND_S", 2.0)  # waited out: short here
    # The bound: the watchdog's 2 s and a tick, with room for a loaded machine.
    stalled, ended, elapsed = await open_while_the_server_hangs(
        pg_url, migrated_schema, b"SET idle_session_timeout", wait=15, migrate_schema=False
    )
    assert stalled
    assert ended, f"connect still waiting {elapsed:.0f} s after the server hung"
    assert isinstance(ended[0], StoreError), ended


# ---------------------------------------------------------------------------------------------
# Edits under faults: a stream converges to transcript()


async def test_edits_while_the_connection_keeps_dying_store_each_once_and_a_stream_converges(
    pg_url: str, pg_schema: str, autojump_clock: MockClock
) -> None:
    """A conversation with a stream open is edited three times (`submit(truncate_after=)`,
    each answered) while the runtime's connection is lost at every 11th statement (more
    than an edit's transaction sends) - before it is sent, or with its reply lost, COMMITs
    and stream reads included: each edit
    returns its id, its input is stored and answered once, the messages after the edited
    one are gone, and the stream's client holds exactly transcript()."""
    from test_stream import applied, stored

    async def drain(ctx: DrainContext) -> None:
        for item in await ctx.take_inputs():
            writer = await ctx.begin_assistant()
            await writer.append_text(f"re {item.payload['n']}")
            await writer.finish()

    with control_connection(pg_url, pg_schema) as control:
        faults = Faults(pg_url, pg_schema, control)
        store = PostgresStore(
            pg_url, schema=pg_schema, inline=True, listen=False, wrap_connection=faults.wrap
        )
        async with open_runtime(store, drain, clock=ts_testing.trio_clock()) as runtime:
            for n in range(3):
                await runtime.submit("s", {"n": n}, input_id=f"q{n}")
                await runtime.wait_idle("s")
            got: list[Any] = []
            async with trio.open_nursery() as nursery, runtime.stream("s") as events:

                async def collect() -> None:
                    async for event in events:
                        got.append(event)

                nursery.start_soon(collect)
                await trio.testing.wait_all_tasks_blocked()
                faults.arm(Plan(None, Mode.BEFORE, every=11, times=1_000))
                for n, after in ((10, 4), (11, 2), (12, 4)):
                    edit = {"n": n}
                    stored_id = await runtime.submit(
                        "s", edit, input_id=f"e{n}", truncate_after=after
                    )
                    assert stored_id == f"e{n}"
                    await runtime.wait_idle("s")
                fired, faults.plan = faults.firings, None
                await trio.testing.wait_all_tasks_blocked()
                assert applied(got) == await stored(runtime)
                nursery.cancel_scope.cancel()
            assert fired >= 5
            assert runtime.statistics().store.reconnects >= 5
        rows = control.execute(
            "SELECT seq, role, input_id FROM session_message ORDER BY seq"
        ).fetchall()
        assert rows == [
            (1, "user", "q0"),
            (2, "assistant", None),
            (3, "user", "e11"),
            (4, "assistant", None),
            (5, "user", "e12"),
            (6, "assistant", None),
        ]
        assert control.execute("SELECT count(*) FROM session_input").fetchall() == [(0,)]
