"""The PostgreSQL engine: schema and migrations, the isolation races of
reference/postgres.md §4.1 as two-connection regression tests, group commit, uncertain
commits, and a runtime end to end.

The races run on raw connections, each transaction held open by the test, with an injected
lease clock so "expired" and "live" are exact. A waiting transaction runs in a thread; the
test sees it wait in `pg_stat_activity` (no sleeping) before letting the other side commit.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest
import trio
from backends import PgLocation
from helpers import (
    Raw,
    build_pg_schema,
    check_pre_streaming_upgrade,
    opened,
    seed_pre_streaming,
    terminate_backend,
)
from psycopg import sql
from trio.testing import MockClock

from trio_sessions import (
    DrainContext,
    LeaseLost,
    MessageFinished,
    SchemaTooNew,
    StoreError,
    _liveness,
    _postgres,
    _store,
    _transcript,
    open_runtime,
    testing,
)
from trio_sessions._backend import Job, Tx
from trio_sessions._decisions import AcquireVerdict, IterationVerdict, RecoveryDecision
from trio_sessions._handoff import HandoffQueue, Queued, pumping
from trio_sessions._model import AssistantData, Message, TextPart
from trio_sessions._postgres import (
    SCHEMA_VERSION,
    PgEngine,
    PgTx,
    PostgresStore,
    connect,
    run_op,
)
from trio_sessions._store.recovery_scan import scan_and_lease

REPO = Path(__file__).resolve().parent.parent
LEASE_MS = 30_000


def fixed(seconds: float) -> Callable[[], float]:
    """A lease clock stopped at `seconds` (ms = seconds * 1000)."""
    return lambda: seconds


@contextmanager
def raw(url: str, schema: str) -> Iterator[psycopg.Connection[Any]]:
    """An operator's autocommit connection to the test schema."""
    with psycopg.connect(url, autocommit=True, options=f"-c search_path={schema}") as conn:
        yield conn


@contextmanager
def open_tx(
    url: str, schema: str, clock: Callable[[], float] | None
) -> Iterator[tuple[psycopg.Connection[Any], PgTx]]:
    """A store transaction the test holds open (rolled back unless the test commits)."""
    conn = connect(url, schema)
    try:
        yield conn, PgTx(conn, clock)
    finally:
        conn.rollback()
        conn.close()


def wait_until_blocked(url: str, pid: int) -> None:
    """Return once backend `pid` waits for a lock; fail after 10 s."""
    deadline = time.monotonic() + 10
    with psycopg.connect(url, autocommit=True) as conn:
        while time.monotonic() < deadline:
            row = conn.execute(
                "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (pid,)
            ).fetchone()
            if row is not None and row[0] == "Lock":
                return
            time.sleep(0.005)
    pytest.fail(f"backend {pid} never waited for a lock")


class Background:
    """Run a blocking call in a thread; `result()` joins it and returns or raises."""

    def __init__(self, call: Callable[[], Any]) -> None:
        self._call = call
        self._outcome: list[Any] = []
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._outcome.append(("ok", self._call()))
        except BaseException as exc:
            self._outcome.append(("error", exc))

    def result(self) -> Any:
        self._thread.join(30)
        assert self._outcome, "the background call did not finish"
        kind, value = self._outcome[0]
        if kind == "error":
            raise value
        return value


def claim(engine: PgEngine, session_id: str, execution_id: str, owner: str, lease_ms: int) -> None:
    run_op(engine, _store.wake, session_id)
    acquired = run_op(engine, _store.acquire, session_id, execution_id, owner, lease_ms)
    assert acquired.verdict is AcquireVerdict.CLAIM


# ---------------------------------------------------------------------------------------------
# Schema and migrations


def test_migration_creates_the_named_checks(pg_url: str, pg_schema: str) -> None:
    """An insert with phase='invalid' fails naming session_execution_phase_check."""
    with opened(PostgresStore(pg_url, schema=pg_schema).engine()) as engine:
        run_op(engine, _store.wake, "s")
    with raw(pg_url, pg_schema) as conn:
        with pytest.raises(psycopg.errors.CheckViolation, match="session_execution_phase_check"):
            conn.execute(
                "INSERT INTO session_execution(id, session_id, owner_id, phase, time_created,"
                " expires_at) VALUES ('bad', 's', 'owner', 'invalid', 0, 1)"
            )
        names = {
            row[0]
            for row in conn.execute(
                "SELECT conname FROM pg_constraint WHERE connamespace = %s::regnamespace",
                (pg_schema,),
            )
        }
        assert {
            "session_execution_phase_check",
            "session_wake_attempts_check",
            "session_message_role_check",
        } <= names
        fillfactor = conn.execute(
            "SELECT reloptions FROM pg_class WHERE oid = 'session_execution'::regclass"
        ).fetchone()
        assert fillfactor == (["fillfactor=80"],)


_MIGRATE_CHILD = """
import os, sys, time
from trio_sessions._postgres import PostgresStore
url, schema, ready, go = sys.argv[1:]
open(ready, "w").close()
while not os.path.exists(go):
    time.sleep(0.001)
engine = PostgresStore(url, schema=schema).engine()
engine.open()
engine.close()
"""


def test_concurrent_migrations_of_an_empty_schema_all_succeed(
    pg_url: str, pg_schema: str, tmp_path: Path
) -> None:
    """Four processes migrating an empty schema at once all succeed; one schema_version row."""
    go = tmp_path / "go"
    ready = [tmp_path / f"ready-{n}" for n in range(4)]
    children = [
        subprocess.Popen(
            [sys.executable, "-c", _MIGRATE_CHILD, pg_url, pg_schema, str(flag), str(go)],
            cwd=REPO,
            stderr=subprocess.PIPE,
        )
        for flag in ready
    ]
    deadline = time.monotonic() + 60
    while not all(flag.exists() for flag in ready):  # every child imported: a fair start
        assert time.monotonic() < deadline, "a migrating child never reached the start line"
        time.sleep(0.005)
    go.touch()
    errors = [child.communicate(timeout=60)[1] for child in children]
    assert [child.returncode for child in children] == [0, 0, 0, 0], errors
    with raw(pg_url, pg_schema) as conn:
        assert conn.execute("SELECT version FROM schema_version").fetchall() == [(SCHEMA_VERSION,)]


@contextmanager
def migrating(pg_url: str, schema: str) -> Iterator[psycopg.Connection[Any]]:
    """Another process migrating `schema`: its transaction holds the schema's migration lock
    until the test commits it (or leaves)."""
    from trio_sessions._postgres import MIGRATION_LOCK_NAMESPACE

    with raw(pg_url, "public") as holder:
        holder.execute("BEGIN")
        holder.execute(
            "SELECT pg_advisory_xact_lock(%s, hashtext(%s))", (MIGRATION_LOCK_NAMESPACE, schema)
        )
        yield holder


def wait_for_the_migration_lock(pg_url: str, schema: str, opener: Background) -> None:
    """Return once `opener` waits for `schema`'s migration lock (or has ended)."""
    deadline = time.monotonic() + 10
    with psycopg.connect(pg_url, autocommit=True) as look:
        while (
            opener._thread.is_alive()
            and not look.execute(
                "SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
                " AND objid = (hashtext(%s)::bigint & 4294967295)::oid",
                (schema,),
            ).fetchone()
        ):
            assert time.monotonic() < deadline, "the opener never asked for the lock"
            time.sleep(0.005)


def test_an_open_waits_for_another_processs_migration_longer_than_the_lock_timeout(
    pg_url: str, pg_schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by an audit. Processes starting together wait for the first one's migration
    and then find nothing to do (`_postgres.migrate`), however long that migration takes
    (a large store's backfill or index). The wait for the migration lock is no fence's lock
    wait, but it was bounded by the connections' `lock_timeout` (5 s; 0.2 s here, so the
    test is quick): the second opener failed with `StoreError: cannot migrate schema ...:
    canceling statement due to lock timeout` while the first was still migrating. Now it
    waits up to `MIGRATION_WAIT_S` (20 s) for the lock, and opens once the first is done."""
    from trio_sessions._postgres import connections, open_engine

    monkeypatch.setattr(connections, "LOCK_TIMEOUT_MS", 200)
    with migrating(pg_url, pg_schema) as holder:

        def open_second() -> None:
            open_engine(pg_url, schema=pg_schema).close()

        second = Background(open_second)
        wait_for_the_migration_lock(pg_url, pg_schema, second)
        second._thread.join(1.0)  # the first migration takes longer than the lock timeout...
        holder.execute("COMMIT")  # ... and then ends (here: it had nothing to write)
        second.result()  # opened, the schema migrated by whoever came
    with raw(pg_url, pg_schema) as conn:
        assert conn.execute("SELECT version FROM schema_version").fetchall() == [(SCHEMA_VERSION,)]


def test_an_open_gives_up_on_another_processs_migration_after_its_bound(
    pg_url: str, pg_schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by an audit (see above). A migration that holds its lock past
    `MIGRATION_WAIT_S` (0.5 s here) fails the other openers with a `StoreError` that says
    another process is migrating the schema - not the server's lock timeout - with nothing
    written."""
    from trio_sessions._postgres import connections, open_engine

    monkeypatch.setattr(connections, "MIGRATION_WAIT_S", 0.5)
    with migrating(pg_url, pg_schema):
        started = time.monotonic()
        with pytest.raises(StoreError, match="another process is migrating") as raised:
            open_engine(pg_url, schema=pg_schema)
        assert time.monotonic() - started < 5
    assert "lock timeout" not in str(raised.value)
    with raw(pg_url, "public") as conn:
        assert conn.execute(
            "SELECT count(*) FROM pg_tables WHERE schemaname = %s", (pg_schema,)
        ).fetchall() == [(0,)]


async def test_upgrade_of_a_version_1_schema_adds_streaming(pg_url: str, pg_schema: str) -> None:
    """A version-1 schema is upgraded on open (to the newest version; streaming came with
    version 2), as SQLite's version 3 file is: messages marked finished from their JSON (a
    malformed one kept as it is), stream and delta tables added, an open reply from before
    still closed by recovery."""
    with raw(pg_url, pg_schema) as conn:
        conn.execute("CREATE TABLE schema_version(version INTEGER NOT NULL)")
        conn.execute("INSERT INTO schema_version VALUES (1)")
        for statement in _postgres._MIGRATIONS[1].split(";"):
            if statement.strip():
                conn.execute(statement)
    location = Raw(PgLocation(pg_url, pg_schema))
    seed_pre_streaming(location)
    with opened(PostgresStore(pg_url, schema=pg_schema).engine()):
        pass
    assert location.rows("SELECT version FROM schema_version") == [(SCHEMA_VERSION,)]
    # 2: streaming; 3: owner liveness; 4: conversation control; 5: the server-side functions;
    # 6: one notification per transaction, the set-wise append, watchers-only signals
    # 7: a cancelling claim's iteration end rings for untaken inputs;
    # 8: a stream's read in one call; 9: set-wise recovery and iteration ends;
    # 10: set-wise submits and acquires, the change scan and a recovery pass's scan and
    # leases each in one call; 11: a batch's session locks through one function;
    # 12: the conversation controls, a transcript read, a tool change each in one call;
    # recovery's takeover alone in autocommit; 13: an acquire never waits for a busy session;
    # 14: an iteration's end alone in autocommit, its release read back by execution id
    # 15: a batch's submits in one call, many streams' reads set-wise;
    # 16: a session's lock key of 64 bits; 17: seeded with its schema;
    # 18: an interrupting submit and a delete name the claim they stop;
    # 19: a cancelled input's trace for a lost submit's retry;
    # 20: that trace answers only the retry of the call that stored the input;
    # 21: a double-texting submit with the claim it rings for in one call;
    # 22: a hand-back signals its sessions, the change look finds handed-back claims;
    # 23: a session's last write that left no newer row or time (purge counts it);
    # 24: a submit racing another session's submit of its input id is answered after it;
    #     a take of inputs returns the user messages it appended;
    # 25: a writer's write from what it stored last checks the stored text too;
    # 26: an operation that took a session's lock and ends without claiming or signalling it
    #     signals it when an acquire waits for it; an input count below 0 is refused;
    # 27: so does a drain's write whose claim is gone (a zombie's, answered lease_lost)
    # 28: a cancel's trace keeps no payload and goes after ten minutes in a recovery pass;
    # 29: the endings read an execution's maybe-open messages as `finished <> 1`;
    # 30: a stream's read of the messages it missed sends about NEW_BYTES_PER_READ of them;
    #     a delete's lease-row delete follows its claim's (a racing scan's lease goes too);
    #     an interrupt (or a submit that interrupts) leaves a quarantined claim as it is
    # 31: an interrupt marks another owner's claim whether or not its lease ran out
    #     and a stream's read sends at most 1,000 appends
    # 32: it marks one whose lease ran out handed back too (a pass finishes it at once)
    assert SCHEMA_VERSION == 32
    await check_pre_streaming_upgrade(location, PostgresStore(pg_url, schema=pg_schema))


# `ts_delete_session` as schemas 12-17 created it (it answered a boolean).
_DELETE_SESSION_BEFORE_18 = """
CREATE OR REPLACE FUNCTION ts_delete_session(p_session text, p_now bigint, p_retry boolean)
RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM ts_lock(p_session);
    IF NOT EXISTS (SELECT 1 FROM session WHERE id = p_session) THEN
        RETURN false;
    END IF;
    PERFORM ts_signal(p_session);
    PERFORM ts_delete_rows(ARRAY[p_session], p_now, p_retry);
    RETURN true;
END $$
"""


def test_upgrade_of_a_version_16_schema_replaces_the_old_delete_function(
    pg_url: str, pg_schema: str
) -> None:
    """A version-16 schema (functions since 5, `ts_delete_session` answering a boolean since
    12) is upgraded on open to the newest version, and its delete answers (existed,
    claim): the functions each version's step creates again must not collide with the
    old return type before version 18's step drops it."""
    from trio_sessions._postgres import open_engine
    from trio_sessions._schema import _create_functions

    with raw(pg_url, pg_schema) as conn:
        build_pg_schema(conn, 16)
        _create_functions(conn)
        # What a version-16 store holds: the delete function of before version 18.
        conn.execute("DROP FUNCTION ts_delete_session(text, bigint, boolean)")
        conn.execute(_DELETE_SESSION_BEFORE_18)
    engine = open_engine(pg_url, schema=pg_schema)
    try:
        engine.run(_store.submit, "s", "{}", "in-1")
        assert engine.run(_store.delete_session, "s") == (True, None)
    finally:
        engine.close()
    location = Raw(PgLocation(pg_url, pg_schema))
    assert location.rows("SELECT version FROM schema_version") == [(SCHEMA_VERSION,)]


# The submit functions as schemas up to 19 named them: version 20 gives each a call's own id
# (`p_call`; `p_calls` for the set-wise ones).
_SUBMIT_FUNCTIONS_BEFORE_20 = {
    "ts_known_input": "text, text, text, boolean",
    "ts_insert_input": "text, text, text, boolean, bigint",
    "ts_submit": "text, text, text, bigint, boolean",
    "ts_submits": "text[], text[], text[], bigint, boolean",
    "ts_submit_and_acquire": "text, text, text, text, text, bigint, bigint, boolean",
    "ts_submit_and_acquire_many": (
        "text[], text[], text[], text[], text[], bigint[], bigint, boolean"
    ),
    "ts_submit_controlled": "text, text, text, text, bigint, bigint, boolean",
}


def test_upgrade_of_a_version_19_schema_keeps_its_inputs_and_replaces_the_submit_functions(
    pg_url: str, pg_schema: str
) -> None:
    """A version-19 schema is upgraded in place on open to the newest version: its pending
    input and its cancel's trace are kept (with no call id: that trace answers no call's
    retry), each submit function of before (no `p_call`) is gone - one function of each
    name is left, the new one - and submits and cancels work on what was there."""
    from trio_sessions._postgres import open_engine
    from trio_sessions._schema import _create_functions

    with raw(pg_url, pg_schema) as conn:
        build_pg_schema(conn, 19)
        _create_functions(conn)
        # What a version-19 store holds beside: the submit functions' argument lists of
        # before (their bodies do not matter here: version 20's step must drop them).
        for name, arguments in _SUBMIT_FUNCTIONS_BEFORE_20.items():
            conn.execute(
                f"CREATE FUNCTION {name}({arguments}) RETURNS void LANGUAGE plpgsql AS 'BEGIN END'"
            )
        conn.execute("INSERT INTO session(id, time_created, input_seq) VALUES ('s', 0, 1)")
        conn.execute(
            "INSERT INTO session_input(id, session_id, seq, payload, time_created)"
            " VALUES ('old', 's', 1, '{}', 0)"
        )
        conn.execute(
            "INSERT INTO session_input_cancelled(id, session_id, payload, time_cancelled)"
            " VALUES ('gone', 's', '{}', 0)"
        )
    engine = open_engine(pg_url, schema=pg_schema)
    try:
        assert engine.run(_store.submit, "s", "{}", "old") == "old"  # known: kept
        assert engine.run(_store.submit, "s", "{}", "gone") == "gone"  # a first call: stored
        assert engine.run(_store.cancel_input, "old") is True
        assert engine.run(_store.cancel_input, "gone") is True
    finally:
        engine.close()
    location = Raw(PgLocation(pg_url, pg_schema))
    assert location.rows("SELECT version FROM schema_version") == [(SCHEMA_VERSION,)]
    # The trace of the input from before names no call; the one stored since, its call.
    assert location.rows(
        "SELECT id, call_id IS NOT NULL FROM session_input_cancelled ORDER BY id"
    ) == [("gone", True), ("old", False)]
    functions = location.rows(
        "SELECT p.proname, pg_get_function_identity_arguments(p.oid) FROM pg_proc p"
        " JOIN pg_namespace n ON n.oid = p.pronamespace"
        " WHERE n.nspname = current_schema() AND p.proname = ANY(?) ORDER BY p.proname",
        (list(_SUBMIT_FUNCTIONS_BEFORE_20),),
    )
    assert sorted(name for name, _ in functions) == sorted(_SUBMIT_FUNCTIONS_BEFORE_20)
    assert all(" p_call" in arguments for _, arguments in functions), functions


def test_upgrade_of_a_version_27_schema_forgets_cancelled_payloads_and_old_traces(
    pg_url: str, pg_schema: str
) -> None:
    """A version-27 schema's cancel traces held the withdrawn messages' payloads, and one
    older than ten minutes stayed until a later cancel. Version 28's step deletes those old
    ones and drops the payloads; a trace within its ten minutes still answers the retry of
    the call that stored its input (known: not stored again), and only that call's."""
    from trio_sessions._postgres import open_engine
    from trio_sessions._schema import _create_functions

    with raw(pg_url, pg_schema) as conn:
        build_pg_schema(conn, 27)
        _create_functions(conn)
        conn.execute("INSERT INTO session(id, time_created, input_seq) VALUES ('s', 0, 1)")
        conn.execute(
            "INSERT INTO session_input_cancelled(id, session_id, payload, time_cancelled,"
            " call_id) VALUES ('old', 's', '{\"card\": 4111}', 0, 'c0'),"
            " ('recent', 's', '{\"card\": 4111}',"
            " floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint - 60000, 'c1')"
        )
    open_engine(pg_url, schema=pg_schema).close()
    location = Raw(PgLocation(pg_url, pg_schema))
    assert location.rows("SELECT version FROM schema_version") == [(SCHEMA_VERSION,)]
    assert location.rows("SELECT id, call_id FROM session_input_cancelled") == [("recent", "c1")]
    assert location.rows(
        "SELECT column_name FROM information_schema.columns WHERE table_schema ="
        " current_schema() AND table_name = 'session_input_cancelled' ORDER BY column_name"
    ) == [("call_id",), ("id",), ("session_id",), ("time_cancelled",)]
    known = "SELECT ts_submit('s', '{\"card\": 4111}', 'recent', ?, NULL, true)"
    assert location.rows(known, ("c1",)) == [("known",)]
    assert location.rows("SELECT id FROM session_input") == []
    assert location.rows(known, ("c2",)) == [("stored",)]  # another call's: stored


def test_upgrade_of_a_version_28_schema_indexes_every_message_an_ending_reads_as_open(
    pg_url: str, pg_schema: str
) -> None:
    """Every ending (`ts_finish`, `ts_finish_iterations`, the transcript rules' own path)
    reads an execution's maybe-open messages as `finished <> 1` since version 29, so a mark
    another tool set to 2 is read and refused, not passed over; version 29's step makes the
    partial index cover those rows, and the read stays one index lookup on it (the plan,
    with the sequential scan the planner prefers on a few rows ruled out)."""
    from trio_sessions._postgres import open_engine
    from trio_sessions._schema import _create_functions
    from trio_sessions._store.transcript import MAYBE_OPEN

    with raw(pg_url, pg_schema) as conn:
        build_pg_schema(conn, 28)
        _create_functions(conn)
        conn.execute("INSERT INTO session(id, time_created) VALUES ('s', 0)")
        for seq, finished in ((1, 1), (2, 2), (3, 0)):
            conn.execute(
                "INSERT INTO session_message(id, session_id, execution_id, role, seq, data,"
                " time_created, time_updated, finished)"
                " VALUES (%s, 's', 'e', 'assistant', %s, '{}', 0, 0, %s)",
                (f"m{seq}", seq, finished),
            )
    open_engine(pg_url, schema=pg_schema).close()
    with raw(pg_url, pg_schema) as conn:
        assert conn.execute("SELECT version FROM schema_version").fetchall() == [(32,)]
        [(definition,)] = conn.execute(
            "SELECT indexdef FROM pg_indexes WHERE schemaname = current_schema()"
            " AND indexname = 'session_message_open'"
        ).fetchall()
        assert definition.endswith("WHERE (finished <> 1)"), definition
        query = (
            "SELECT id FROM session_message m"
            f" WHERE m.execution_id = 'e' AND m.{MAYBE_OPEN} AND m.role = 'assistant'"
        )
        assert conn.execute(query + " ORDER BY id").fetchall() == [("m2",), ("m3",)]
        conn.execute("ANALYZE session_message")
        conn.execute("SET enable_seqscan = off")
        plan = "\n".join(row[0] for row in conn.execute("EXPLAIN " + query))
    assert "session_message_open" in plan, plan


@pytest.mark.parametrize(
    ("columns", "rows", "why"),
    [
        (  # Flyway's of old: versions such as '1.2' in a varchar
            "installed_rank INTEGER PRIMARY KEY, version VARCHAR(50), description VARCHAR(200)",
            "(1, '1.1', 'init'), (2, '1.2', 'more')",
            "another tool's",
        ),
        ("version INTEGER NOT NULL, applied TEXT", "(3, 'x')", "no session table"),
    ],
    ids=["text-versions", "integer-versions"],
)
def test_a_foreign_schema_version_table_is_refused_as_not_ours(
    pg_url: str, pg_schema: str, columns: str, rows: str, why: str
) -> None:
    """A schema whose `schema_version` table is another tool's is refused with a StoreError
    (not a ValueError traceback, nor read as a version and migrated from, failing on a
    missing table of ours), and its table is left as it was."""
    with psycopg.connect(pg_url, autocommit=True) as conn:
        table = sql.Identifier(pg_schema, "schema_version")
        conn.execute(sql.SQL(f"CREATE TABLE {{}}({columns})").format(table))
        conn.execute(sql.SQL(f"INSERT INTO {{}} VALUES {rows}").format(table))
    engine = PostgresStore(pg_url, schema=pg_schema).engine()
    with pytest.raises(StoreError, match=f"not a trio_sessions store: .*{why}"):
        engine.open()
    with psycopg.connect(pg_url, autocommit=True) as conn:
        tables = conn.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = %s", (pg_schema,)
        ).fetchall()
    assert tables == [("schema_version",)]


def test_newer_schema_version_is_refused_untouched(pg_url: str, pg_schema: str) -> None:
    """A schema written by a newer library raises SchemaTooNew and nothing is written."""
    with raw(pg_url, pg_schema) as conn:
        conn.execute("CREATE TABLE schema_version(version INTEGER NOT NULL)")
        conn.execute("INSERT INTO schema_version VALUES (%s)", (SCHEMA_VERSION + 1,))
    with pytest.raises(SchemaTooNew):
        PostgresStore(pg_url, schema=pg_schema).engine().open()
    with raw(pg_url, pg_schema) as conn:
        tables = conn.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = %s", (pg_schema,)
        ).fetchall()
        assert tables == [("schema_version",)]
        assert conn.execute("SELECT version FROM schema_version").fetchall() == [
            (SCHEMA_VERSION + 1,)
        ]


def test_schema_is_created_when_missing(pg_url: str) -> None:
    """A store names a schema that does not exist yet: it is created and migrated."""
    schema = f"missing_{os.getpid()}_{time.monotonic_ns()}"
    try:
        with opened(PostgresStore(pg_url, schema=schema).engine()) as engine:
            run_op(engine, _store.wake, "s")
        with raw(pg_url, schema) as conn:
            assert conn.execute("SELECT wakes FROM session").fetchall() == [(1,)]
    finally:
        with psycopg.connect(pg_url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


# ---------------------------------------------------------------------------------------------
# Isolation: reference/postgres.md §4.1 as regression tests


@contextmanager
def renewed_under_session_lock(
    pg_url: str, pg_schema: str
) -> Iterator[tuple[psycopg.Connection[Any], PgTx]]:
    """Owner tx at t=1.2 s: session lock, lease renewed to 31.2 s, left open."""
    with open_tx(pg_url, pg_schema, fixed(1.2)) as (conn, tx):
        tx.lock_session("s")
        assert _store.heartbeat(tx, "owner", ["e1"], LEASE_MS) == {"e1": "running"}
        yield conn, tx


def test_takeover_waits_for_the_owners_renewal_then_finds_nothing(
    pg_url: str, migrated_schema: str
) -> None:
    """Recovery (apply_recovery) waits for an open owner tx that renewed the lease, then
    skips the claim as live instead of taking it over."""
    with opened(PostgresStore(pg_url, schema=migrated_schema).engine(fixed(1.0))) as engine:
        claim(engine, "s", "e1", "owner", 500)  # expires at 1.5 s
    candidate = _store.Candidate("s", "e1")
    with opened(PostgresStore(pg_url, schema=migrated_schema).engine(fixed(2.0))) as rescuer:
        _, _, taken, _ = run_op(rescuer, scan_and_lease, "rescuer", 10, [], [], LEASE_MS)
        assert taken == [candidate]
    with (
        renewed_under_session_lock(pg_url, migrated_schema) as (owner, _),
        open_tx(pg_url, migrated_schema, fixed(2.0)) as (recovery, recovery_tx),
    ):

        def take_over() -> _store.Recovered:
            result = _store.apply_recovery(
                recovery_tx, "rescuer", candidate, "e2", LEASE_MS, max_resumes=10
            )
            recovery.commit()
            return result

        waiting = Background(take_over)
        wait_until_blocked(pg_url, recovery.info.backend_pid)
        owner.commit()
        recovered = waiting.result()
    assert recovered.decision is RecoveryDecision.SKIP_LIVE
    with raw(pg_url, migrated_schema) as conn:
        assert conn.execute(
            "SELECT id, owner_id, expires_at FROM session_execution"
        ).fetchall() == [("e1", "owner", 1200 + LEASE_MS)]


def test_raw_takeover_update_waits_for_the_owners_renewal_then_matches_nothing(
    pg_url: str, migrated_schema: str
) -> None:
    """The recovery-fenced UPDATE waits for the owner's open renewal, re-checks the new row
    version after its COMMIT and updates 0 rows."""
    with opened(PostgresStore(pg_url, schema=migrated_schema).engine(fixed(1.0))) as engine:
        claim(engine, "s", "e1", "owner", 500)
    with (
        renewed_under_session_lock(pg_url, migrated_schema) as (owner, _),
        open_tx(pg_url, migrated_schema, fixed(2.0)) as (recovery, recovery_tx),
    ):

        def take_over() -> int:
            updated = recovery_tx.execute(
                "UPDATE session_execution SET id = :new, owner_id = 'thief'"
                f" WHERE {_store.RECOVERY_FENCE}",
                # No owner found gone: the fence is the expiry alone.
                {"new": "e2", "execution": "e1", "now": 2000, "gone_owner": None},
            ).rowcount
            recovery.commit()
            return updated

        waiting = Background(take_over)
        wait_until_blocked(pg_url, recovery.info.backend_pid)
        owner.commit()
        assert waiting.result() == 0
    with raw(pg_url, migrated_schema) as conn:
        assert conn.execute("SELECT id, owner_id FROM session_execution").fetchall() == [
            ("e1", "owner")
        ]


def test_failed_claim_does_not_block_the_owners_heartbeat(
    pg_url: str, migrated_schema: str
) -> None:
    """An acquire that answered HELD, its transaction still open, does not delay the
    owner's heartbeat (no row lock on the live claim)."""
    with opened(PostgresStore(pg_url, schema=migrated_schema).engine(fixed(1.0))) as engine:
        claim(engine, "s", "e1", "owner", LEASE_MS)
    with (
        open_tx(pg_url, migrated_schema, fixed(2.0)) as (_, claimant),
        open_tx(pg_url, migrated_schema, fixed(2.0)) as (owner, owner_tx),
    ):
        acquired = _store.acquire(claimant, "s", "e2", "other", LEASE_MS)
        assert acquired.verdict is AcquireVerdict.HELD
        owner.execute("SET lock_timeout = 500")  # blocked would raise LockNotAvailable
        started = time.monotonic()
        assert _store.heartbeat(owner_tx, "owner", ["e1"], LEASE_MS) == {"e1": "running"}
        owner.commit()
        assert time.monotonic() - started < 0.5
    with raw(pg_url, migrated_schema) as conn:
        assert conn.execute("SELECT expires_at FROM session_execution").fetchall() == [
            (2000 + LEASE_MS,)
        ]


class CountingStatements:
    """A connection that counts the statements sent on it (one round trip each)."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self._conn = conn
        self.statements = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)

    def execute(self, *args: Any, **kwargs: Any) -> Any:
        self.statements += 1
        return self._conn.execute(*args, **kwargs)


def test_server_now_is_read_after_the_session_lock_is_granted(
    pg_url: str, migrated_schema: str
) -> None:
    """On the server's clock, `tx.now` after a waited-for `lock_session` is no earlier than
    the moment the lock's previous holder let go, and costs no round trip of its own."""
    with opened(PostgresStore(pg_url, schema=migrated_schema).engine()):
        pass  # the schema's functions: the lock's key is one of them
    with (
        open_tx(pg_url, migrated_schema, None) as (holder, holder_tx),
        open_tx(pg_url, migrated_schema, None) as (waiter, _),
    ):
        holder_tx.lock_session("s")
        counted = CountingStatements(waiter)
        waiter_tx = PgTx(counted, None)

        def lock_then_now() -> int:
            waiter_tx.lock_session("s")
            return waiter_tx.now

        waiting = Background(lock_then_now)
        wait_until_blocked(pg_url, waiter.info.backend_pid)
        released = holder.execute(
            "SELECT floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint"
        ).fetchone()
        assert released is not None
        holder.commit()
        assert waiting.result() >= released[0]
        assert counted.statements == 1


SERVER_MS = "SELECT floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint"


def server_ms(conn: psycopg.Connection[Any]) -> int:
    """The server's clock now, in integer ms (the lease clock on PostgreSQL)."""
    row = conn.execute(SERVER_MS).fetchone()
    assert row is not None
    return int(row[0])


def test_a_host_clock_an_hour_ahead_decides_nothing(
    pg_url: str, migrated_schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DESIGN §6.18: on the server's clock (no clock given), this host's clock an hour ahead
    changes nothing: an acquire's and a heartbeat's expiry are a lease after the server's
    clock, and an input scheduled a minute out is a minute from due. Were the host's clock
    sent to the functions (the claim would be live an hour too long) or read as the Python
    operations' `now` (the input would be due an hour ago), skew would decide fences."""
    with (
        opened(PostgresStore(pg_url, schema=migrated_schema).engine()) as engine,
        raw(pg_url, migrated_schema) as conn,
    ):
        host_time = time.time
        monkeypatch.setattr(time, "time", lambda: host_time() + 3_600.0)

        def expiry_is_a_lease_from_the_server_clock(write: Callable[[], object]) -> None:
            before = server_ms(conn)
            write()
            after = server_ms(conn)
            row = conn.execute("SELECT expires_at FROM session_execution").fetchone()
            assert row is not None and before + LEASE_MS <= row[0] <= after + LEASE_MS

        expiry_is_a_lease_from_the_server_clock(lambda: claim(engine, "s", "e1", "owner", LEASE_MS))
        expiry_is_a_lease_from_the_server_clock(
            lambda: run_op(engine, _store.heartbeat, "owner", ["e1"], LEASE_MS)
        )
        before = server_ms(conn)
        run_op(engine, _store.submit_scheduled, "later", "{}", "i1", 60_000, "reject")
        due_in = run_op(engine, _store.next_due)
        after = server_ms(conn)
        assert due_in is not None and 60_000 - (after - before) <= due_in <= 60_000


def test_a_clock_read_after_a_session_lock_is_the_servers_not_the_hosts(
    pg_url: str, migrated_schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DESIGN §6.18 on the operations written in Python: the lease clock a transaction reads
    again once its session locks are granted (`promote_due` takes them after its scan) is
    the server's. With this host's clock an hour ahead, one input due now is promoted and
    its neighbour, due in a minute, stays scheduled; read from the host after the lock, the
    neighbour would be taken an hour early (found by mutation: the host-clock test above
    calls only server-side functions)."""
    with (
        opened(PostgresStore(pg_url, schema=migrated_schema).engine()) as engine,
        raw(pg_url, migrated_schema) as conn,
    ):
        host_time = time.time
        monkeypatch.setattr(time, "time", lambda: host_time() + 3_600.0)
        run_op(engine, _store.submit_scheduled, "s", "{}", "now", 60_000, "reject")
        run_op(engine, _store.submit_scheduled, "s", "{}", "later", 60_000, "reject")
        conn.execute("UPDATE session_input SET due_at = %s WHERE id = 'now'", (server_ms(conn),))
        due = run_op(engine, _store.promote_due, 10)
        assert due.sessions == ["s"]
        rows = conn.execute("SELECT id, due_at IS NULL FROM session_input ORDER BY id").fetchall()
        assert rows == [("later", False), ("now", True)]


def test_a_function_reads_the_server_clock_after_the_session_lock_is_granted(
    pg_url: str, migrated_schema: str
) -> None:
    """DESIGN §8, §6.18: a server-side function's `now` (ts_now) is the server's clock read
    after the session lock it waited for, no earlier than the moment the lock's previous
    holder let go - not now(), the start of its transaction, which is older by the whole
    wait (a fence would judge a lease by a time before its last renewal)."""
    with (
        opened(PostgresStore(pg_url, schema=migrated_schema).engine()) as engine,
        raw(pg_url, migrated_schema) as holder,
    ):
        assert engine.backend_pid is not None
        holder.execute("BEGIN")
        holder.execute("SELECT ts_lock('s')")
        waiting = Background(lambda: run_op(engine, _store.wake, "s"))
        wait_until_blocked(pg_url, engine.backend_pid)
        # The wait lasts (by the server's clock) past the waiter's transaction start, so
        # the two times differ in integer ms.
        aged = (
            "SELECT clock_timestamp() - xact_start >= interval '2 ms'"
            " FROM pg_stat_activity WHERE pid = %s"
        )
        deadline = time.monotonic() + 10
        while holder.execute(aged, (engine.backend_pid,)).fetchone() != (True,):
            assert time.monotonic() < deadline, "the waiter's transaction never aged"
            time.sleep(0.001)  # a poll, not a spin on shared cores
        released = server_ms(holder)
        holder.execute("COMMIT")
        waiting.result()
        row = holder.execute("SELECT time_woken FROM session WHERE id = 's'").fetchone()
    assert row is not None and row[0] >= released


def test_session_lock_is_retaken_after_a_savepoint_rolled_back(
    pg_url: str, migrated_schema: str
) -> None:
    """A session lock taken inside a savepoint that rolled back (and so was released) is
    taken again by the next lock_session of the same transaction."""
    with opened(PostgresStore(pg_url, schema=migrated_schema).engine()):
        pass
    with (
        open_tx(pg_url, migrated_schema, None) as (conn, tx),
        raw(pg_url, migrated_schema) as observer,
    ):

        def advisory_locks() -> int:
            row = observer.execute(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = %s",
                (conn.info.backend_pid,),
            ).fetchone()
            assert row is not None
            return int(row[0])

        def lock_then_fail() -> None:
            with tx.savepoint():
                tx.lock_session("s")
                assert advisory_locks() == 1
                raise RuntimeError

        with pytest.raises(RuntimeError):
            lock_then_fail()
        assert advisory_locks() == 0
        tx.lock_session("s")
        assert advisory_locks() == 1


# One input id submitted to another session while its first submit is uncommitted: every
# operation that stores an input, alone and in a set-wise batch (with a second job of its
# kind, on a session of its own, that must still land).
_SHARED = ("in-shared", '{"n": 2}')
RACING_SUBMITS: dict[str, Callable[[str], tuple[Callable[..., Any], tuple[Any, ...]]]] = {
    "submit": lambda s: (_store.submit, (s, _SHARED[1], _SHARED[0])),
    "submit_and_acquire": lambda s: (
        _store.submit_and_acquire,
        (s, _SHARED[1], _SHARED[0], f"e-{s}", "owner", LEASE_MS),
    ),
    "submit_controlled": lambda s: (
        _store.submit_controlled,
        (s, _SHARED[1], _SHARED[0], "interrupt"),
    ),
    "submit_scheduled": lambda s: (
        _store.submit_scheduled,
        (s, _SHARED[1], _SHARED[0], 60_000, "interrupt"),
    ),
    "submit_controlled_and_acquire": lambda s: (
        _store.submit_controlled_and_acquire,
        (s, _SHARED[1], _SHARED[0], "interrupt", f"e-{s}", "owner", LEASE_MS),
    ),
}


@pytest.mark.parametrize("set_wise", [False, True], ids=["alone", "set-wise"])
@pytest.mark.parametrize("operation", sorted(RACING_SUBMITS))
def test_a_submit_racing_another_sessions_submit_of_its_input_id_is_an_input_conflict(
    pg_url: str, migrated_schema: str, operation: str, set_wise: bool
) -> None:
    """Found by an audit. Two submits of one input id to two sessions at once (two clients
    whose ids collide): the session locks are two, so neither sees the other's uncommitted
    input, and the second waited on the input's primary key, then failed with `StoreError`
    (the server's unique violation) once the first committed. DESIGN §4: another session's
    id raises `InputConflict`, as SQLite (one writer) raises it; §8: `StoreError` never
    for a race. Now the second finds the id taken after that wait, reads the first's input
    back and is refused as it would be run after it - nothing written for its session - and
    a job beside it in the same set-wise call still lands."""
    from trio_sessions import InputConflict

    op, args = RACING_SUBMITS[operation]("s2")
    jobs = [Job(op, args)]
    if set_wise:
        beside, beside_args = RACING_SUBMITS[operation]("s3")
        jobs.append(Job(beside, (*beside_args[:2], "in-s3", *beside_args[3:])))
    with (
        opened(PostgresStore(pg_url, schema=migrated_schema).engine()) as engine,
        open_tx(pg_url, migrated_schema, None) as (first, first_tx),
    ):
        assert _store.submit(first_tx, "s1", '{"n": 1}', "in-shared") == "in-shared"
        second = Background(lambda: engine.run_batch(jobs))
        assert engine.backend_pid is not None
        wait_until_blocked(pg_url, engine.backend_pid)
        first.commit()
        second.result()
    with pytest.raises(InputConflict, match="in-shared"):
        jobs[0].unwrap()
    if set_wise:
        jobs[1].unwrap()
    with raw(pg_url, migrated_schema) as conn:
        inputs = conn.execute("SELECT id, session_id FROM session_input ORDER BY id").fetchall()
        sessions = conn.execute("SELECT id FROM session ORDER BY id").fetchall()
    assert inputs == sorted([("in-shared", "s1"), *([("in-s3", "s3")] if set_wise else [])])
    assert sessions == [("s1",), *([("s3",)] if set_wise else [])]


@pytest.mark.parametrize(
    ("function", "args", "answer"),
    [
        ("ts_submits", [["s2", "s3"], ["{}", "{}"], ["in-shared", "in-s3"]], ["other_session"]),
        (
            "ts_submit_and_acquire_many",
            [
                ["s2", "s3"],
                ["{}", "{}"],
                ["in-shared", "in-s3"],
                ["e2", "e3"],
                ["o", "o"],
                [LEASE_MS, LEASE_MS],
            ],
            ["other_session", None, None, None],
        ),
    ],
    ids=["submits", "submit_and_acquire"],
)
def test_a_set_wise_call_racing_another_sessions_input_id_answers_that_row_alone(
    pg_url: str, migrated_schema: str, function: str, args: list[Any], answer: list[Any]
) -> None:
    """Found by an audit. A set-wise call of a batch's submits whose row stores an input id
    another session's open transaction stores too waited on the primary key, then failed
    whole with the server's unique violation (every job of the batch then ran alone). Now
    that row answers `other_session` with nothing written for it, and the other rows of the
    call land."""
    with opened(PostgresStore(pg_url, schema=migrated_schema).engine()):
        pass
    with (
        open_tx(pg_url, migrated_schema, None) as (first, first_tx),
        open_tx(pg_url, migrated_schema, None) as (second, second_tx),
    ):
        assert _store.submit(first_tx, "s1", '{"n": 1}', "in-shared") == "in-shared"

        def call() -> list[Any]:
            rows = second_tx.call(function, *args, ["c2", "c3"])
            second.commit()
            return rows

        waiting = Background(call)
        wait_until_blocked(pg_url, second.info.backend_pid)
        first.commit()
        rows = {row[0]: list(row[1:]) for row in waiting.result()}
    assert rows[1] == answer
    assert rows[2][0] == "stored"
    with raw(pg_url, migrated_schema) as conn:
        assert conn.execute("SELECT id, session_id FROM session_input ORDER BY id").fetchall() == [
            ("in-s3", "s3"),
            ("in-shared", "s1"),
        ]
        assert conn.execute("SELECT id FROM session ORDER BY id").fetchall() == [("s1",), ("s3",)]


def test_the_row_path_insert_racing_another_sessions_input_id_is_an_input_conflict(
    pg_url: str, migrated_schema: str
) -> None:
    """Found by an audit. The path in Python (run when a server function leaves the job to
    it) checks the input id under its session's lock, then inserts: another session's
    uncommitted input of that id was unseen, and the insert failed with the server's
    unique violation once that one committed. Now the insert finds the id taken, reads it
    back and raises `InputConflict`; its transaction rolls back whole."""
    from trio_sessions import InputConflict
    from trio_sessions._store import inputs

    def insert_second() -> None:
        with open_tx(pg_url, migrated_schema, None) as (_, second_tx):
            second_tx.lock_session("s2")
            inputs._insert_input(second_tx, "s2", '{"n": 2}', "in-shared", ring=True)

    with opened(PostgresStore(pg_url, schema=migrated_schema).engine()):
        pass
    with open_tx(pg_url, migrated_schema, None) as (first, first_tx):
        assert _store.submit(first_tx, "s1", '{"n": 1}', "in-shared") == "in-shared"
        with raw(pg_url, migrated_schema) as observer:
            second = Background(insert_second)
            row = None
            deadline = time.monotonic() + 10
            while row is None and time.monotonic() < deadline:
                # Blocked by the first transaction: not another test's backend, when
                # xdist workers share one server.
                row = observer.execute(
                    "SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                    " AND query LIKE %s AND %s = ANY(pg_blocking_pids(pid))",
                    ("%INSERT INTO session_input%", first.info.backend_pid),
                ).fetchone()
            assert row is not None, "the second insert never waited"
        first.commit()
        with pytest.raises(InputConflict, match="in-shared"):
            second.result()


def test_a_submit_racing_its_own_retry_stores_one_input_and_answers_both(
    pg_url: str, migrated_schema: str
) -> None:
    """The same (session, input id, payload) submitted twice at once (a client retrying
    before the first reply): the second waits for the session lock, then finds the first's
    input and returns its id; one input is stored."""
    with (
        opened(PostgresStore(pg_url, schema=migrated_schema).engine()) as engine,
        open_tx(pg_url, migrated_schema, None) as (first, first_tx),
    ):
        assert _store.submit(first_tx, "s1", '{"n": 1}', "in-1") == "in-1"
        second = Background(lambda: run_op(engine, _store.submit, "s1", '{"n": 1}', "in-1"))
        assert engine.backend_pid is not None
        wait_until_blocked(pg_url, engine.backend_pid)
        first.commit()
        assert second.result() == "in-1"
    with raw(pg_url, migrated_schema) as conn:
        assert conn.execute("SELECT id, session_id, seq FROM session_input").fetchall() == [
            ("in-1", "s1", 1)
        ]


# ---------------------------------------------------------------------------------------------
# Group commit


def broken_statement(tx: Tx) -> None:
    tx.execute("SELECT * FROM no_such_table")


def test_group_commit_batch_with_a_refusal_commits_the_others(
    pg_url: str, migrated_schema: str
) -> None:
    """One job of a batch raises LeaseLost, another a database error: both get their error,
    nothing of theirs is written, and the other jobs still commit."""
    with opened(PostgresStore(pg_url, schema=migrated_schema).engine()) as engine:
        jobs = [
            Job(_store.wake, ("s1",)),
            Job(_store.take_inputs, ("s", "no-such-execution", "owner")),
            Job(_store.wake, ("s2",)),
            Job(broken_statement, ()),
            Job(_store.wake, ("s1",)),
        ]
        engine.run_batch(jobs)
        # One batch, rolled back, then each job alone.
        assert engine.transactions == 1 + len(jobs)
    assert isinstance(jobs[1].error, LeaseLost)
    assert isinstance(jobs[3].error, StoreError)
    assert [job.error for job in jobs[::2]] == [None, None, None]
    with raw(pg_url, migrated_schema) as conn:
        rows = conn.execute("SELECT id, wakes FROM session ORDER BY id").fetchall()
        assert rows == [("s1", 2), ("s2", 1)]


def test_group_commit_batch_runs_in_one_transaction(pg_url: str, migrated_schema: str) -> None:
    """A batch whose jobs all succeed is one transaction, and every job gets its result."""
    with opened(PostgresStore(pg_url, schema=migrated_schema).engine()) as engine:
        jobs = [Job(_store.submit, (f"s{i}", '{"n": 1}', f"in-{i}")) for i in range(10)]
        engine.run_batch(jobs)
        assert engine.transactions == 1
    assert [job.unwrap() for job in jobs] == [f"in-{i}" for i in range(10)]


@pytest.mark.parametrize(
    "jobs",
    [
        pytest.param(
            [Job(_store.submit, ("s1", "{}", "in-1")), Job(_store.submit, ("s2", "{}", "in\x002"))],
            id="set-wise-autocommit",
        ),
        pytest.param([Job(_store.wake, ("s1",)), Job(_store.wake, ("s\x002",))], id="transaction"),
    ],
)
def test_an_argument_the_driver_refuses_fails_its_own_job_only(
    pg_url: str, migrated_schema: str, jobs: list[Job]
) -> None:
    """A NUL in one job's argument (the driver refuses it before sending anything) fails
    that job with a plain StoreError - no connection was lost, no outcome is unknown - and
    the other job of its batch commits, with no reconnect."""
    with opened(PostgresStore(pg_url, schema=migrated_schema).engine()) as engine:
        engine.run_batch(jobs)
        assert engine.reconnects == 0
    assert jobs[0].error is None
    assert type(jobs[1].error) is StoreError
    assert "NUL" in str(jobs[1].error)
    with raw(pg_url, migrated_schema) as conn:
        assert conn.execute("SELECT id FROM session").fetchall() == [("s1",)]


async def test_an_admins_idle_session_timeout_never_ends_a_connection_idle_by_design(
    pg_url: str, migrated_schema: str
) -> None:
    """A server-side `idle_session_timeout` (an admin's; here the URL's options set it, as a
    role default would) never ends the connections that are idle by design: the liveness
    token's (its loss stops every drain of the runtime) and the listener's."""
    url = pg_url + ("&" if "?" in pg_url else "?") + "options=-c%20idle_session_timeout%3D100"
    token = _liveness.PgToken(
        lambda: _postgres.token_connection(url, migrated_schema), "owner", False, None
    )
    await token.take()
    listener = _postgres.PgListener(url, migrated_schema, inline=False)
    await listener.open()
    assert listener.conn is not None and token.conn is not None
    pids = [listener.conn.info.backend_pid, token.conn.info.backend_pid]
    try:
        with trio.move_on_after(1.0) as idle:  # ten times the timeout (real time)
            await token.wait_lost()
        assert idle.cancelled_caught
        with raw(pg_url, migrated_schema) as conn:
            alive = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE pid = ANY(%s)", (pids,)
            ).fetchone()
        assert alive == (2,)
    finally:
        listener.close()
        token.close()


async def test_a_token_killed_by_the_server_looks_lost_before_its_watch_reads_it(
    pg_url: str, migrated_schema: str
) -> None:
    """`looks_lost` sees a token connection the server ended (its error and close on the
    socket) without reading it: the watch, `wait_lost`, still finds the end afterwards
    rather than waiting forever on a socket someone else drained. A live token never
    looks lost."""
    token = _liveness.PgToken(
        lambda: _postgres.token_connection(pg_url, migrated_schema), "owner", False, None
    )
    await token.take()
    assert token.conn is not None
    try:
        assert not token.looks_lost()
        fd = token.conn.pgconn.socket
        terminate_backend(pg_url, token.conn.info.backend_pid)
        readable, _, _ = select.select([fd], [], [], 10.0)  # the server's end arrives
        assert readable
        assert token.looks_lost()
        assert token.looks_lost()  # nothing was read
        with trio.fail_after(10):
            await token.wait_lost()
    finally:
        token.close()
    assert token.looks_lost()  # closed: no token held


# ---------------------------------------------------------------------------------------------
# Writer lanes: several writer connections, one session's operations on one of them


def record_order(tx: Tx, session_id: str, ticket: int, seen: list[tuple[str, int, int]]) -> int:
    """An operation on one session: notes (session, ticket, backend) in the order run."""
    [pid] = tx.one("SELECT pg_backend_pid()")
    seen.append((session_id, ticket, int(pid)))
    return int(pid)


async def test_one_sessions_operations_stay_on_one_writer_in_order(
    pg_url: str, migrated_schema: str
) -> None:
    """With three writer connections, 30 operations on each of 12 sessions, queued at once
    from as many tasks: each session's ran on one connection, in the order they were
    queued, and the sessions were spread over all three connections."""
    store = PostgresStore(pg_url, schema=migrated_schema, writers=3, listen=False)
    sessions = [f"s{n}" for n in range(12)]
    seen: list[tuple[str, int, int]] = []
    tickets = iter(range(10_000))
    with trio.fail_after(60):
        async with store.open_executor(None) as executor:
            assert isinstance(executor, _postgres.PgThreadExecutor)
            executor.spill_at = 1  # spread the sessions (`tests/test_pg_lanes.py`)
            pids = {engine.backend_pid for engine in executor.engines}

            async def one(session_id: str) -> None:
                # The ticket is taken in the step that queues the operation.
                await executor.run(record_order, session_id, next(tickets), seen)

            async with trio.open_nursery() as nursery:
                for _ in range(30):
                    for session_id in sessions:
                        nursery.start_soon(one, session_id)
                    await trio.lowlevel.checkpoint()
            transactions = executor.statistics().transactions
    assert len(pids) == 3
    assert len(seen) == 30 * len(sessions)
    for session_id in sessions:
        mine = [(ticket, pid) for s, ticket, pid in seen if s == session_id]
        assert [ticket for ticket, _ in mine] == sorted(ticket for ticket, _ in mine)
        assert len({pid for _, pid in mine}) == 1
    assert {pid for _, _, pid in seen} == pids
    assert transactions < len(seen)  # grouped, not one transaction each


def held_open(tx: Tx, session_id: str, gate: threading.Event) -> int:
    """An operation on one session that keeps its writer busy until `gate` is set."""
    [pid] = tx.one("SELECT pg_backend_pid()")
    assert gate.wait(timeout=20)
    return int(pid)


def on_no_session(tx: Tx, owner_id: str, seen: list[tuple[str, int, int]]) -> int:
    """An operation on no session (a recovery pass's kind): notes its backend and whether
    a transaction was already open on it."""
    [pid, xid] = tx.one("SELECT pg_backend_pid(), pg_current_xact_id_if_assigned()")
    seen.append((owner_id, xid is not None, int(pid)))
    tx.execute("SELECT pg_current_xact_id()")  # it writes: a transaction of its own
    return int(pid)


async def test_an_operation_on_no_session_goes_to_an_idle_writer(
    pg_url: str, migrated_schema: str
) -> None:
    """With three writers, two busy (held by operations on their sessions), an operation
    on no session runs on the idle one at once, not queued behind a busy one."""
    store = PostgresStore(pg_url, schema=migrated_schema, writers=3, listen=False)
    gate = threading.Event()
    busy = ["s0", "s1"]
    seen: list[tuple[str, int, int]] = []
    with trio.fail_after(30):
        async with store.open_executor(None) as executor:
            assert isinstance(executor, _postgres.PgThreadExecutor)
            executor.spill_at = 1  # the two busy sessions on the first two lanes
            idle_pid = executor.engines[2].backend_pid
            async with trio.open_nursery() as nursery:
                for session_id in busy:
                    nursery.start_soon(executor.run, held_open, session_id, gate)
                await trio.sleep(0.1)  # both held lanes took their operation
                try:
                    assert await executor.run(on_no_session, "me", seen) == idle_pid
                finally:
                    gate.set()


async def test_an_operation_on_no_session_runs_first_in_its_own_transaction(
    pg_url: str, migrated_schema: str
) -> None:
    """Queued in one hand-off with operations on sessions, an operation on no session (a
    recovery pass's scan or takeover) runs first, in a transaction of its own - alone, it
    can be one autocommit call - and the others still share one transaction. The three
    queue while the lane's worker is busy, so they share the next hand-off whichever
    task queues first (queued first on an idle lane, the one on no session would go at
    once, alone: trio runs the three tasks in a random order)."""
    store = PostgresStore(pg_url, schema=migrated_schema, writers=1, listen=False)
    seen: list[tuple[str, int, int]] = []  # in the order run
    running, release = threading.Event(), threading.Event()
    with trio.fail_after(30):
        async with store.open_executor(None) as executor, trio.open_nursery() as nursery:
            before = executor.statistics()
            nursery.start_soon(executor.run, held, running, release)
            await trio.to_thread.run_sync(running.wait)
            nursery.start_soon(executor.run, record_order, "a", 1, seen)
            nursery.start_soon(executor.run, on_no_session, "me", seen)
            nursery.start_soon(executor.run, record_order, "b", 2, seen)
            await trio.testing.wait_all_tasks_blocked()
            release.set()
        statistics = executor.statistics()
    assert statistics.handoffs - before.handoffs == 2  # the busy one's, then the three's
    assert seen[0][:2] == ("me", False)  # first, and no transaction open before it
    assert sorted(s for s, _, _ in seen[1:]) == ["a", "b"]
    # the busy one's, then its own, then one for both others
    assert statistics.transactions - before.transactions == 3


def lock_both(
    tx: Tx, session_id: str, other: str, barrier: threading.Barrier, calls: list[str]
) -> str:
    """Take `session_id`'s lock, then `other`'s; on the first call, only once the other
    writer holds its first lock too (a lock-order cycle between two connections)."""
    calls.append(session_id)
    tx.lock_session(session_id)
    if calls.count(session_id) == 1:
        barrier.wait(timeout=20)
    tx.lock_session(other)
    return session_id


@pytest.mark.parametrize("batched", [False, True], ids=["alone", "in-batches"])
async def test_a_deadlock_between_two_writers_is_retried_inside_the_store(
    pg_url: str, migrated_schema: str, batched: bool
) -> None:
    """Two writer connections lock two sessions in opposite orders at once - each operation
    alone, or each in a batch with another operation on its session: the server breaks the
    deadlock (40P01), the victim's work runs again, and every caller gets its result (no
    error)."""
    store = PostgresStore(pg_url, schema=migrated_schema, writers=2, listen=False)
    first, other = "a", "b"
    barrier = threading.Barrier(2)
    calls: list[str] = []
    results: list[str] = []
    seen: list[tuple[str, int, int]] = []
    with trio.fail_after(60):
        async with store.open_executor(None) as executor:
            assert isinstance(executor, _postgres.PgThreadExecutor)
            executor.spill_at = 1  # the two sessions, started together, on two lanes

            async def one(session_id: str, then: str) -> None:
                results.append(await executor.run(lock_both, session_id, then, barrier, calls))

            async def companion(session_id: str) -> None:
                await executor.run(record_order, session_id, 0, seen)

            # Started together: every operation is queued before the lanes' pumps run, so
            # each lane's hand-off holds its lock_both (and companion) in one batch.
            async with trio.open_nursery() as nursery:
                nursery.start_soon(one, first, other)
                nursery.start_soon(one, other, first)
                if batched:
                    nursery.start_soon(companion, first)
                    nursery.start_soon(companion, other)
            statistics = executor.statistics()
    assert sorted(results) == sorted([first, other])
    assert len(calls) == 3  # the victim ran twice
    if batched:
        # Each companion ran (the victim's may have run once more: in its rolled-back batch).
        assert {s for s, _, _ in seen} == {first, other}
        # Two batches, one per lane; the victim's rolled back and its two jobs ran alone.
        assert (statistics.handoffs, statistics.transactions) == (2, 4)
    else:
        assert statistics.retries >= 1


async def test_a_lane_hands_off_at_most_its_limit_and_each_batchs_callers_go_on(
    autojump_clock: MockClock,
) -> None:
    """Five operations queued at once on a queue limited to two per hand-off: handed off as
    2, 2, 1 in the order queued, and the first two callers have their results while the
    second hand-off is still running (not after the whole queue)."""
    queue = HandoffQueue(limit=2)
    batches: list[list[int]] = []
    queued_order: list[int] = []
    second_running = trio.Event()
    release_second = trio.Event()
    returned: list[int] = []

    async def hand_off(batch: list[Queued]) -> None:
        batches.append([queued.job.args[0] for queued in batch])
        for queued in batch:
            queued.job.result = queued.job.args[0]
        if len(batches) == 2:
            second_running.set()
            await release_second.wait()

    async def one(n: int) -> None:
        queued_order.append(n)  # in the step that queues it
        returned.append(await queue.submit(Job(str, (n,))))

    async with pumping(queue, hand_off), trio.open_nursery() as nursery:
        try:
            for n in range(5):
                nursery.start_soon(one, n)
            await second_running.wait()
            await trio.testing.wait_all_tasks_blocked()
            assert sorted(returned) == sorted(batches[0])
        finally:
            release_second.set()
    assert batches == [queued_order[:2], queued_order[2:4], queued_order[4:]]
    assert sorted(returned) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize(
    ("writers", "error"), [(0, ValueError), (17, ValueError), (True, TypeError), (2.0, TypeError)]
)
def test_writers_must_be_a_small_positive_int(pg_url: str, writers: Any, error: type) -> None:
    assert PostgresStore(pg_url, writers=16).writers == 16
    with pytest.raises(error, match="writers must be"):
        PostgresStore(pg_url, writers=writers)


# ---------------------------------------------------------------------------------------------
# Uncertain commits


class BreakAtCommit:
    """A connection whose next COMMIT loses its connection: the backend is killed before
    the COMMIT reaches it (`land=False`: the transaction aborts) or right after it
    committed (`land=True`: the answer is lost). A function call in autocommit is its own
    COMMIT, and so is a COMMIT sent with the signals' transaction after it."""

    def __init__(self, conn: psycopg.Connection[Any], url: str, *, land: bool) -> None:
        self._conn = conn
        self._url = url
        self._land = land
        self.armed = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)

    def execute(self, query: Any, params: Any = None) -> Any:
        autocommit = (
            self._conn.autocommit
            and self._conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
            and not str(query).startswith("BEGIN")
        )
        # The engine's COMMIT with its signals' own transaction after it, one message.
        commits = autocommit or str(query).startswith("COMMIT;")
        if not (self.armed and commits):
            return self._conn.execute(query, params)
        self.armed = False
        if self._land:
            self._conn.execute(query, params)
        terminate_backend(self._url, self._conn.info.backend_pid)
        if self._land:
            raise psycopg.OperationalError("server closed the connection (injected)")
        return self._conn.execute(query, params)  # on a dead connection: raises

    def commit(self) -> None:
        if not self.armed:
            self._conn.commit()
            return
        self.armed = False
        if self._land:
            self._conn.commit()
        terminate_backend(self._url, self._conn.info.backend_pid)
        if self._land:
            raise psycopg.OperationalError("server closed the connection (injected)")
        self._conn.commit()  # on a dead connection: raises


@pytest.mark.parametrize("land", [True, False], ids=["committed", "aborted"])
def test_uncertain_commit_is_read_back(pg_url: str, migrated_schema: str, land: bool) -> None:
    """The writer's connection dies at COMMIT: the outcome is read back from the server, so
    a submit is stored once and an acquire is reported as a claim exactly once. A wake (a
    transaction) is read back by its transaction id; submit and acquire (one autocommit
    call each) are called again, and the call reads back by input id / execution id."""
    wrapped: list[BreakAtCommit] = []

    def wrap(conn: psycopg.Connection[Any]) -> BreakAtCommit:
        wrapped.append(BreakAtCommit(conn, pg_url, land=land))
        return wrapped[-1]

    store = PostgresStore(pg_url, schema=migrated_schema, wrap_connection=wrap)
    with opened(store.engine()) as engine:
        wrapped[-1].armed = True
        run_op(engine, _store.wake, "s")
        # Committed: read back, not re-applied. Aborted: run again on a new connection.
        assert (engine.reconnects, engine.transactions) == (1, 1 if land else 2)

        wrapped[-1].armed = True
        transactions = engine.transactions
        assert run_op(engine, _store.submit, "s", '{"n": 1}', "in-1") == "in-1"
        # Called again either way: the call finds the input it stored, or stores it.
        assert (engine.reconnects, engine.transactions - transactions) == (2, 2)

        wrapped[-1].armed = True
        acquired = run_op(engine, _store.acquire, "s", "e1", "owner", LEASE_MS)
        assert acquired.verdict is AcquireVerdict.CLAIM
        assert engine.reconnects == 3
        again = run_op(engine, _store.acquire, "s", "e2", "owner", LEASE_MS)
        assert again.verdict is not AcquireVerdict.CLAIM
    with raw(pg_url, migrated_schema) as conn:
        assert conn.execute("SELECT id, seq FROM session_input").fetchall() == [("in-1", 1)]
        assert conn.execute("SELECT wakes, input_seq FROM session").fetchall() == [(0, 1)]
        assert conn.execute("SELECT time_woken IS NULL FROM session").fetchall() == [(True,)]
        assert conn.execute("SELECT id FROM session_execution").fetchall() == [("e1",)]


def test_lost_connection_before_commit_reruns(pg_url: str, migrated_schema: str) -> None:
    """The writer's backend is killed between transactions: the next operation reconnects
    and runs once."""
    with opened(PostgresStore(pg_url, schema=migrated_schema).engine()) as engine:
        run_op(engine, _store.wake, "s")
        terminate_backend(pg_url, engine.conn.info.backend_pid)
        run_op(engine, _store.wake, "s")
        assert engine.reconnects == 1
    with raw(pg_url, migrated_schema) as conn:
        assert conn.execute("SELECT wakes FROM session").fetchall() == [(2,)]


# ---------------------------------------------------------------------------------------------
# The runtime end to end


async def echo(ctx: DrainContext) -> None:
    for item in await ctx.take_inputs():
        writer = await ctx.begin_assistant()
        await writer.append_text(f"echo {item.payload['text']}")
        await writer.finish()


async def test_runtime_drains_on_the_inline_store(
    pg_url: str, migrated_schema: str, autojump_clock: MockClock
) -> None:
    """open_runtime on an inline PostgresStore with a virtual clock drains end to end."""
    store = PostgresStore(pg_url, schema=migrated_schema, inline=True)
    async with open_runtime(store, echo, clock=testing.trio_clock()) as rt:
        await rt.submit("s", {"text": "hi"})
        await rt.wait_idle("s")
        messages = await rt.transcript("s")
        assert rt.statistics().store.backend == "postgres"
    assert [m.role for m in messages] == ["user", "assistant"]
    assert messages[0].data == {"text": "hi"}
    assert messages[1].data.parts[0].text == "echo hi"
    with raw(pg_url, migrated_schema) as conn:
        assert conn.execute("SELECT count(*) FROM session_execution").fetchone() == (0,)


async def test_runtime_drains_on_the_thread_executor_with_the_server_clock(
    pg_url: str, migrated_schema: str
) -> None:
    """The default (threaded, group-commit) executor on the server's clock drains 20
    sessions submitted concurrently."""
    store = PostgresStore(pg_url, schema=migrated_schema)
    with trio.fail_after(60):
        async with open_runtime(store, echo) as rt:
            async with trio.open_nursery() as nursery:
                for i in range(20):
                    nursery.start_soon(rt.submit, f"s{i}", {"text": str(i)})
            for i in range(20):
                await rt.wait_idle(f"s{i}")
            transcripts = [await rt.transcript(f"s{i}") for i in range(20)]
            stats = rt.statistics().store
    assert all(len(messages) == 2 for messages in transcripts)
    assert stats.backend == "postgres"
    assert 0 < stats.handoffs <= stats.transactions


# ---------------------------------------------------------------------------------------------
# Group commit, set-wise


def assistant_text(messages: list[Message]) -> str:
    """The text of a transcript's last message, an assistant's."""
    data = messages[-1].data
    assert isinstance(data, AssistantData)
    return "".join(part.text for part in data.parts if isinstance(part, TextPart))


class RecordingStatements:
    """Counts the statements (and COMMITs) an engine's connection sends."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self._conn = conn
        self.statements: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)

    def execute(self, query: Any, params: Any = None) -> Any:
        self.statements.append(str(query))
        return self._conn.execute(query, params)

    def commit(self) -> None:
        self.statements.append("COMMIT")
        self._conn.commit()


@contextmanager
def recording_engine(
    pg_url: str, pg_schema: str
) -> Iterator[tuple[Any, list[RecordingStatements]]]:
    """An engine whose connections count what they send (`made[-1]`: the current one's)."""
    made: list[RecordingStatements] = []

    def wrap(conn: psycopg.Connection[Any]) -> RecordingStatements:
        made.append(RecordingStatements(conn))
        return made[-1]

    with opened(PostgresStore(pg_url, schema=pg_schema, wrap_connection=wrap).engine()) as engine:
        yield engine, made


def test_batch_runs_each_batched_kind_as_one_call(pg_url: str, migrated_schema: str) -> None:
    """A group-commit batch of 8 submit_and_acquire and then 8 end_iteration jobs is one
    statement per kind and a COMMIT, and answers each job as it would alone: claims, then
    releases, with every input stored once."""
    with recording_engine(pg_url, migrated_schema) as (engine, made):
        submits = [
            Job(
                _store.submit_and_acquire,
                (f"s{n}", f'{{"n": {n}}}', f"i{n}", f"e{n}", "me", 30_000),
            )
            for n in range(8)
        ]
        engine.run_batch(submits)
        assert [job.unwrap()[1].verdict for job in submits] == [AcquireVerdict.CLAIM] * 8
        assert [job.unwrap()[0] for job in submits] == [f"i{n}" for n in range(8)]
        assert len(made[-1].statements) == 2  # BEGIN + the call, COMMIT
        finishes = [Job(_store.end_iteration, (f"s{n}", f"e{n}", "me")) for n in range(8)]
        engine.run_batch(finishes)
        assert [job.unwrap() for job in finishes] == [IterationVerdict.RELEASE] * 8
        assert len(made[-1].statements) == 4
    with raw(pg_url, migrated_schema) as conn:
        assert conn.execute("SELECT count(*) FROM session_input").fetchall() == [(8,)]
        assert conn.execute("SELECT count(*) FROM session_execution").fetchall() == [(0,)]


def test_a_batch_of_claims_and_of_new_replies_is_one_call_each(
    pg_url: str, migrated_schema: str
) -> None:
    """A worker's group-commit batch of acquires (a burst of chats rung at once), of wake-
    and-acquires, and then of the drains' `begin_assistant`s is one set-wise call per kind,
    each job answered as alone: a held session's acquire is HELD, a lost claim's begin
    raises `LeaseLost` for that job only."""
    with recording_engine(pg_url, migrated_schema) as (engine, made):
        for n in range(6):
            run_op(engine, _store.wake, f"s{n}")
        run_op(engine, _store.acquire, "s5", "held", "other", 30_000)
        sent = len(made[-1].statements)
        acquires = [Job(_store.acquire, (f"s{n}", f"e{n}", "me", 30_000)) for n in range(6)]
        joins = [Job(_store.wake_and_acquire, (f"w{n}", f"x{n}", "me", 30_000)) for n in range(3)]
        engine.run_batch(acquires + joins)
        verdicts = [job.unwrap().verdict for job in acquires]
        assert verdicts == [AcquireVerdict.CLAIM] * 5 + [AcquireVerdict.HELD]
        assert [job.unwrap()[1].verdict for job in joins] == [AcquireVerdict.CLAIM] * 3
        batch = made[-1].statements[sent:]
        assert "ts_acquire_many(" in batch[0] and "ts_wake_and_acquire_many(" in batch[1]
        assert len(batch) == 3  # the two calls and COMMIT (each claim took its wake: no signal)

        run_op(engine, _store.expire_claims, "me", ["e4"])
        sent = len(made[-1].statements)
        begins = [Job(_store.begin_assistant, (f"s{n}", f"e{n}", "me", f"m{n}")) for n in range(5)]
        engine.run_batch(begins)
        assert [job.unwrap() for job in begins[:4]] == [1, 1, 1, 1]
        with pytest.raises(LeaseLost):
            begins[4].unwrap()
        after = made[-1].statements[sent:]
        assert "ts_begin_assistants(" in after[0]  # then re-run alone, as it raised
        begun = [run_op(engine, _store.read_transcript, f"s{n}") for n in range(4)]
    assert [assistant_text(messages) for messages in begun] == [""] * 4


def test_a_batch_of_streamed_appends_is_one_call_in_order_and_fenced(
    pg_url: str, migrated_schema: str
) -> None:
    """A chat worker's group-commit batch of appends (two per message, 8 messages) is one
    set-wise call: each append gets the version it would alone, in arrival order per
    message; an append on a finished message still raises `MessageFinished` (the whole-row
    path, in the same batch) and a lost claim's append raises `LeaseLost` without taking
    the others' appends with it."""
    with recording_engine(pg_url, migrated_schema) as (engine, made):
        for n in range(8):
            run_op(engine, _store.submit_and_acquire, f"s{n}", "{}", f"i{n}", f"e{n}", "me", 30_000)
            run_op(engine, _store.begin_assistant, f"s{n}", f"e{n}", "me", f"m{n}")
        appends = [
            Job(
                _store.append_assistant_text, (f"s{n}", f"e{n}", "me", f"m{n}", f"{n}{word}", after)
            )
            for after, word in enumerate("ab")
            for n in range(8)
        ]
        sent = len(made[-1].statements)
        engine.run_batch(appends)
        assert [job.unwrap()[1] for job in appends] == [1] * 8 + [2] * 8
        # The one call (BEGIN goes with it), then COMMIT with the transaction's one
        # notification after it, in its own transaction.
        batch = made[-1].statements[sent:]
        assert len(batch) == 2
        assert "ts_append_texts(" in batch[0] and "ts_flush_signals(" not in batch[0]
        assert batch[1].startswith("COMMIT; ") and "ts_flush_signals(" in batch[1]

        run_op(engine, _store.update_assistant, "s0", "e0", "me", "m0", _transcript.finish)
        run_op(engine, _store.expire_claims, "me", ["e1"])
        mixed = [
            Job(_store.append_assistant_text, ("s0", "e0", "me", "m0", "late", 2)),
            Job(_store.append_assistant_text, ("s1", "e1", "me", "m1", "lost", 2)),
            Job(_store.append_assistant_text, ("s2", "e2", "me", "m2", "2c", 2)),
            Job(_store.append_assistant_text, ("s3", "e3", "me", "m3", "3c", 2)),
        ]
        engine.run_batch(mixed)
        with pytest.raises(MessageFinished):
            mixed[0].unwrap()
        with pytest.raises(LeaseLost):
            mixed[1].unwrap()
        assert [job.unwrap()[1] for job in mixed[2:]] == [3, 3]
        texts = {
            n: assistant_text(run_op(engine, _store.read_transcript, f"s{n}")) for n in range(8)
        }
    assert texts == {n: f"{n}a{n}b" + (f"{n}c" if n in (2, 3) else "") for n in range(8)}


def echo_op(tx: Tx, n: int) -> int:
    """An operation that sends nothing (no statement, no COMMIT)."""
    return n


def echo_in_session(tx: Tx, session_id: str, n: int) -> int:
    """`echo_op` on a session: an operation that may share a hand-off with others."""
    return n


def held(tx: Tx, started: threading.Event, release: threading.Event) -> str:
    started.set()
    assert release.wait(timeout=20)
    return "held"


async def test_a_writer_lane_hands_batches_to_its_own_thread_without_to_thread(
    pg_url: str, migrated_schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lane's worker is a thread of its own: no `trio.to_thread` call per batch (its cost
    dominated the sequential cycle). Operations on sessions started together still share
    a hand-off (at most `HANDOFF_LIMIT` each), and one after another each gets its own.
    (A write on no session that finds the lane idle goes alone at once: test_pg_lanes.)"""
    store = PostgresStore(pg_url, schema=migrated_schema, writers=1, listen=False)
    calls: list[object] = []
    run_sync = trio.to_thread.run_sync

    async def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(args[0])
        return await run_sync(*args, **kwargs)

    results: list[int] = []
    async with store.open_executor(None) as executor:
        monkeypatch.setattr(trio.to_thread, "run_sync", counting)
        for n in range(10):
            assert await executor.run(echo_in_session, f"s{n}", n) == n
        assert executor.statistics().handoffs == 10

        async def one(n: int) -> None:
            results.append(await executor.run(echo_in_session, f"s{n}", n))

        async with trio.open_nursery() as nursery:
            for n in range(100):
                nursery.start_soon(one, n)
        assert executor.statistics().handoffs == 12  # 64, then the 36 queued meanwhile
        monkeypatch.undo()
    assert calls == []
    assert sorted(results) == list(range(100))


async def test_closing_an_executor_fails_what_is_queued_and_waits_for_the_batch_running(
    pg_url: str, migrated_schema: str
) -> None:
    """An operation still queued on a lane when its executor closes gets `StoreError`
    (never run); the batch the worker is running is waited for, and its caller gets the
    result."""
    store = PostgresStore(pg_url, schema=migrated_schema, writers=1, listen=False)
    started, release = threading.Event(), threading.Event()
    outcomes: dict[str, object] = {}

    async def call(name: str, op: Callable[..., object], *args: object) -> None:
        try:
            outcomes[name] = await executor.run(op, *args)
        except StoreError as exc:
            outcomes[name] = exc

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery, store.open_executor(None) as executor:
            nursery.start_soon(call, "running", held, started, release)
            await trio.to_thread.run_sync(started.wait)
            nursery.start_soon(call, "queued", echo_op, 1)
            await trio.testing.wait_all_tasks_blocked()
            # Closing begins before the worker's completion can be delivered.
            release.set()
    assert outcomes["running"] == "held"
    assert isinstance(outcomes["queued"], StoreError)
    assert "closed before this ran" in str(outcomes["queued"])


async def test_a_lane_still_runs_shielded_cleanup_once_its_surrounding_scope_is_cancelled(
    pg_url: str, migrated_schema: str
) -> None:
    """The runtime's cleanup runs shielded after it was cancelled from outside: the lanes'
    pumps are shielded too, so an idle lane still hands the cleanup's operations over."""
    store = PostgresStore(pg_url, schema=migrated_schema, writers=1, listen=False)
    with trio.fail_after(30), trio.CancelScope() as outer:
        async with store.open_executor(None) as executor:
            outer.cancel()
            with trio.CancelScope(shield=True), trio.fail_after(10):
                await trio.testing.wait_all_tasks_blocked()  # the cancellation has landed
                assert await executor.run(echo_op, 7) == 7


def test_only_the_servers_refusal_of_a_stored_value_names_a_row_malformed() -> None:
    """Recovery quarantines a claim whose rows the server refuses as data (SQLSTATE class
    22, e.g. a version at the top of its range: `test_recovery`'s top-of-range test). A
    `DataError` raised by the driver itself before sending (no SQLSTATE: a NUL in one of
    our own parameters) is no row's fault and must fail the pass as it is, not quarantine
    a claim with a misleading reason; the server's reason names its SQLSTATE."""
    tx = object.__new__(PgTx)  # refused_value reads only the exception
    refused = tx.refused_value(psycopg.errors.NumericValueOutOfRange("bigint out of range"))
    assert refused == "a row holds a value the database refuses (22003): bigint out of range"
    assert tx.refused_value(psycopg.DataError("PostgreSQL text fields cannot contain NUL")) is None
    assert tx.refused_value(psycopg.OperationalError("server closed the connection")) is None


def test_no_message_is_stored_without_an_id(pg_url: str, migrated_schema: str) -> None:
    """An owner's finish passes over an open assistant message with no id
    (`transcript._close_open_messages`: no write can name it), which SQLite's rowid table
    takes from another tool. PostgreSQL's primary key refuses the NULL, so there no such
    message is left open: another tool's write of one is refused whole."""
    with raw(pg_url, migrated_schema) as conn, pytest.raises(psycopg.errors.NotNullViolation):
        conn.execute(
            "INSERT INTO session_message(id, session_id, role, seq, data, time_created,"
            " time_updated, finished) VALUES (NULL, 's', 'assistant', 1, '{}', 0, 0, 0)"
        )
