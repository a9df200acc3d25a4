"""The operator CLI's verbs on one row read that row, not the whole set it belongs to, on
both backends: the rows each verb's reads return are counted (`CountingEngine`), with a
set of hundreds beside the one row acted on."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import pytest
from backends import EngineDb

from trio_sessions import _cli
from trio_sessions._backend import Engine, Tx

MANY = 300  # rows in the set beside the one a verb acts on
FEW = 5  # the most rows a keyed verb may read back


@attrs.define
class Counter:
    rows: int = 0


@attrs.define
class CountingCursor:
    """A cursor whose rows read back are counted."""

    inner: Any
    counter: Counter

    @property
    def rowcount(self) -> int:
        return int(self.inner.rowcount)

    def fetchone(self) -> Any:
        row = self.inner.fetchone()
        self.counter.rows += row is not None
        return row

    def fetchall(self) -> list[Any]:
        rows = list(self.inner.fetchall())
        self.counter.rows += len(rows)
        return rows

    def __iter__(self) -> Iterator[Any]:
        for row in self.inner:
            self.counter.rows += 1
            yield row

    def close(self) -> None:
        self.inner.close()


@attrs.define
class CountingTx:
    """A transaction whose statements' rows read back are counted (PostgreSQL's function
    calls' rows too); everything else is the transaction's own."""

    inner: Tx
    counter: Counter

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def execute(self, sql: str, params: Any = ()) -> CountingCursor:
        return CountingCursor(self.inner.execute(sql, params), self.counter)

    def one(self, sql: str, params: Any = ()) -> Any:
        row = self.inner.one(sql, params)
        self.counter.rows += row is not None
        return row

    def call(self, function: str, *args: Any, **options: Any) -> list[Any]:
        rows = self.inner.call(function, *args, **options)
        self.counter.rows += len(rows)
        return rows


@attrs.define
class CountingEngine:
    """The test's engine, counting the rows every operation run on it reads back."""

    inner: Engine
    counter: Counter = attrs.field(factory=Counter)

    @property
    def dialect(self) -> Any:
        return self.inner.dialect

    def _counted(self, op: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(op)  # keeps the operation's marks (`reads_stored_bytes`, ...)
        def counted(tx: Tx, *args: Any) -> Any:
            return op(CountingTx(tx, self.counter), *args)

        return counted

    def run(self, op: Callable[..., Any], *args: Any) -> Any:
        return self.inner.run(self._counted(op), *args)

    def read(self, op: Callable[..., Any], *args: Any) -> Any:
        return self.inner.read(self._counted(op), *args)

    def schema_version(self) -> int:
        return self.inner.schema_version()

    def close(self) -> None:
        self.inner.close()


def seed_rejected_inputs(engine: EngineDb, session_id: str, count: int) -> None:
    """`count` inputs of `session_id` set aside as malformed, ids bad-1 ... bad-count."""
    engine.write(
        "INSERT INTO session(id, time_created) VALUES (?, 0) ON CONFLICT(id) DO NOTHING",
        (session_id,),
    )
    engine.write(
        "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?)"
        " INSERT INTO session_input_rejected(id, session_id, seq, payload, reason,"
        " time_created) SELECT 'bad-' || i, ?, i, '{bad', 'not JSON', 0 FROM n",
        (count, session_id),
    )


def test_cancelling_a_set_aside_input_reads_that_input_not_every_set_aside_one(
    engine: EngineDb,
) -> None:
    """`inputs cancel` of an id that is no pending input looks whether it was set aside as
    malformed, to name `inputs drop`: it read every set-aside input of the store to find
    that one id (the reviewers of stop 59). It reads that id only; the errors are as
    before."""
    seed_rejected_inputs(engine, "s", MANY)
    counting = CountingEngine(engine.engine)
    with pytest.raises(ValueError, match=r"set aside as malformed.*inputs drop"):
        _cli.cancel_input(counting, f"bad-{MANY // 2}")  # type: ignore[arg-type]
    assert counting.counter.rows <= FEW, counting.counter
    counting.counter.rows = 0
    with pytest.raises(ValueError, match="is not pending"):
        _cli.cancel_input(counting, "unknown")  # type: ignore[arg-type]
    assert counting.counter.rows <= FEW, counting.counter


def seed_quarantines(engine: EngineDb, count: int) -> None:
    """`count` quarantined executions q-1 ... q-count of sessions qs-1 ... (recovery rows
    whose claims another tool deleted: the listing shows each as such)."""
    engine.write(
        "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?)"
        " INSERT INTO session_recovery(execution_id, session_id, owner_id, expires_at,"
        " recovery_error, time_created, time_quarantined)"
        " SELECT 'q-' || i, 'qs-' || i, 'recovery', 0, 'malformed', 0, i FROM n",
        (count,),
    )


def seed_quarantined_claim(engine: EngineDb, session_id: str, execution_id: str) -> None:
    """An expired claim of `session_id` that recovery quarantined, quarantined last."""
    engine.write("INSERT INTO session(id, time_created) VALUES (?, 0)", (session_id,))
    engine.write(
        "INSERT INTO session_execution(id, session_id, owner_id, phase, time_created,"
        " expires_at) VALUES (?, ?, 'owner-gone', 'running', 0, 1)",
        (execution_id, session_id),
    )
    engine.write(
        "INSERT INTO session_recovery(execution_id, session_id, owner_id, expires_at,"
        " recovery_error, time_created, time_quarantined)"
        " VALUES (?, ?, 'recovery', 0, 'malformed', 0, ?)",
        (execution_id, session_id, engine.now),
    )


def command(counting: CountingEngine, verb: str, *argv: str) -> Any:
    """The JSON value of the CLI command `verb` (one or two words) with `argv` after its DB
    argument, run on the counting engine."""
    args = _cli.build_parser().parse_args([*verb.split(), "db", *argv, "--json"])
    value, _ = _cli.run_command(args, counting)  # type: ignore[arg-type]
    return value


def test_dropping_a_quarantined_execution_reads_that_execution_not_every_quarantine(
    engine: EngineDb,
) -> None:
    """`quarantine release --drop` read every quarantined execution of the store to name the
    dropped one's session, before the drop read that execution again by its key (found
    reading the operator paths for the class of stop 59's defect). It reads that execution
    only, and names the session the drop acted on."""
    seed_quarantines(engine, MANY)
    seed_quarantined_claim(engine, "s", "exec-s")
    counting = CountingEngine(engine.engine)
    released = command(counting, "quarantine release", "exec-s", "--drop")
    assert released == {"execution_id": "exec-s", "session_id": "s", "action": "drop"}
    assert counting.counter.rows <= FEW, counting.counter
    assert engine.rows("SELECT id FROM session_execution") == []
    with pytest.raises(ValueError, match="is not quarantined"):
        command(counting, "quarantine release", "exec-s", "--drop")


def test_quarantine_list_of_one_session_reads_that_sessions_quarantines(
    engine: EngineDb,
) -> None:
    """`quarantine list --session S` read every quarantined execution of the store, and each
    one's claim with a query of its own, then kept S's in Python; `--limit N` read them all
    too, to show N (found reading the operator paths for the class of stop 59's defect). The
    filters are the read's: it reads S's rows (and the first N), with their claims in the
    same statement, and counts the others it does not show."""
    seed_quarantines(engine, MANY)
    seed_quarantined_claim(engine, "s", "exec-s")
    counting = CountingEngine(engine.engine)
    [listed] = command(counting, "quarantine list", "--session", "s")
    assert (listed["execution_id"], listed["claim_owner_id"]) == ("exec-s", "owner-gone")
    assert counting.counter.rows <= FEW, counting.counter
    counting.counter.rows = 0
    args = _cli.build_parser().parse_args(["quarantine", "list", "db", "--limit", "2"])
    shown, text = _cli.run_command(args, counting)  # type: ignore[arg-type]
    assert [row["execution_id"] for row in shown] == ["q-1", "q-2"]
    assert [row["claim_owner_id"] for row in shown] == [None, None]
    assert text.splitlines()[0] == f"showing 2 of {MANY + 1} quarantined execution(s):"
    assert counting.counter.rows <= FEW, counting.counter
    assert command(counting, "quarantine list", "--session", "nobody") == []


def test_status_of_one_session_reads_that_session_and_counts_the_rest(
    engine: EngineDb,
) -> None:
    """`status --session S` read every session of the store - each with its claim, counts
    of its inputs and messages - to keep S in Python (found reading the operator paths for
    the class of stop 59's defect). It reads the named sessions by their keys; the summary,
    which still counts the whole store, is aggregates (one row each), as the console's."""
    engine.write(
        "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?)"
        " INSERT INTO session(id, time_created) SELECT 'other-' || i, 0 FROM n",
        (MANY,),
    )
    seed_quarantined_claim(engine, "s", "exec-s")
    seed_rejected_inputs(engine, "t", 1)
    counting = CountingEngine(engine.engine)
    status = command(counting, "status", "--session", "s", "--session", "t")
    assert [session["id"] for session in status["sessions"]] == ["s", "t"]
    assert status["sessions"][0]["claim"]["quarantined"] is True
    assert status["summary"] == {
        **{"sessions": MANY + 2, "claims": 1, "live_claims": 0, "expired_claims": 0},
        **{"quarantined": 1, "doorbells": 0, "pending_inputs": 0},
    }
    assert counting.counter.rows <= FEW, counting.counter


def test_status_of_one_state_or_a_limit_reads_the_sessions_it_lists(engine: EngineDb) -> None:
    """`status --state STATE` and `--limit N` read every session of the store - each with its
    claim and counts - to keep the few in that state, or the first N, in Python (found
    reading the operator paths for the class of stop 59's defect). The state and the limit
    are the read's: it reads the sessions it lists, and counts the others it matched."""
    engine.write(
        "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < ?)"
        " INSERT INTO session(id, time_created) SELECT 'other-' || i, 0 FROM n",
        (MANY,),
    )
    seed_quarantined_claim(engine, "s", "exec-s")
    counting = CountingEngine(engine.engine)
    status = command(counting, "status", "--state", "quarantined")
    assert ([s["id"] for s in status["sessions"]], status["matched"]) == (["s"], 1)
    assert counting.counter.rows <= FEW, counting.counter
    counting.counter.rows = 0
    status = command(counting, "status", "--state", "idle", "--limit", "2")
    assert [s["id"] for s in status["sessions"]] == ["other-1", "other-10"]
    assert (status["matched"], status["summary"]["sessions"]) == (MANY, MANY + 1)
    assert counting.counter.rows <= FEW, counting.counter


def test_inputs_list_with_a_limit_reads_the_inputs_it_shows(engine: EngineDb) -> None:
    """`inputs list --limit N` read every set-aside input of the store (of the session,
    with `--session`) to show the first N (found reading the operator paths for the class
    of stop 59's defect). The limit is the read's: it reads N and counts the others."""
    seed_rejected_inputs(engine, "s", MANY)
    counting = CountingEngine(engine.engine)
    args = _cli.build_parser().parse_args(["inputs", "list", "db", "--limit", "2"])
    shown, text = _cli.run_command(args, counting)  # type: ignore[arg-type]
    assert [row["id"] for row in shown] == ["bad-1", "bad-2"]
    assert text.splitlines()[0] == f"showing 2 of {MANY} rejected input(s):"
    assert counting.counter.rows <= FEW, counting.counter
    assert len(command(counting, "inputs list", "--session", "s")) == MANY
    assert command(counting, "inputs list", "--session", "t", "--limit", "1") == []
