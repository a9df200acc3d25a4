"""One PostgreSQL transaction as a store operation sees it (`PgTx`, the `_backend.Tx` of
PostgreSQL), and the SQL dialect it speaks.

A transaction begins with its first statement, which carries `BEGIN ...;` in the same
message: no round trip of its own (the engine's connection is in autocommit mode). In
autocommit (`autocommit=True`) a `PgTx` is one function call and nothing else; a second
statement raises `NeedsTransaction` before anything is sent. The shared SQL of `_store`
(SQLite's `?` and `:name` parameters) is translated to psycopg's style here, and a function
call's lists of text or integers are bound as one array literal each (`bound`).

Invariants:
* `tx.now` is the server's `clock_timestamp()` in ms (or the injected test clock), read once
  per operation AFTER its locks: it is reset before each operation and whenever
  `lock_claims` takes a lock, and `lock_session` reads it in the lock's own statement once
  the lock is granted, so a fence never compares with a time from before a lock wait;
* `lock_session` is a transaction-scoped advisory lock, held to COMMIT: the serialisation
  point `_store` relies on under READ COMMITTED; claim rows are locked in sorted order, so
  two lockers of overlapping sets never deadlock;
* the sessions a transaction signals are only collected here (`tx.notified`, and the
  functions' deferred ones as the last call's reply read them, `deferred`); the engine
  sends them in one notification only after the transaction committed.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Literal

import psycopg

from .. import _liveness
from .._backend import BackendName, Job, NeedsTransaction, Params, new_call_id, now_ms
from .connections import WATCHERS_ONLY

# run_nowait: a lock held by another process is not waited for beyond this.
NOWAIT_LOCK_TIMEOUT_MS = 50
_SERVER_MS = "floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint"
_SERVER_NOW = f"SELECT {_SERVER_MS}"
# A session lock and the server's clock read after it is granted: one round trip.
_LOCK_SESSION = (
    "WITH locked AS MATERIALIZED"
    " (SELECT pg_advisory_xact_lock(ts_lock_key(%s)))"
    f" SELECT {_SERVER_MS} FROM locked"
)
_LOCK_SESSION_ANY = _LOCK_SESSION.replace("%s", "?")
# Several, in the order every transaction takes several in (`ts_lock_all`), then the clock.
_LOCK_SESSIONS = (
    f"WITH locked AS MATERIALIZED (SELECT ts_lock_all(?)) SELECT {_SERVER_MS} FROM locked"
)
# How each kind of transaction begins: sent with its first statement, in one message.
_BEGIN = "BEGIN ISOLATION LEVEL READ COMMITTED; "
_BEGIN_READ = "BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY; "
_BEGIN_NOWAIT = f"{_BEGIN}SET LOCAL lock_timeout = {NOWAIT_LOCK_TIMEOUT_MS}; "
# A write transaction (a group-commit batch, or one operation alone): the functions defer
# their signals to the engine's one notification after COMMIT (`ts_signal`,
# `ts_flush_signals`).
_BEGIN_WRITE = f"{_BEGIN}SET LOCAL trio_sessions.defer_signals = on; "


def lock_sessions_first(begin: str, sessions: Collection[str]) -> str:
    """`begin` followed by one statement taking every session lock of `sessions` in the
    order all functions take several (`ts_lock_all`: their key, then the id).

    A batch's operations each lock their own session as they run, in the order they were
    queued; two processes' batches naming two sessions in opposite orders would deadlock,
    and the server finds that out only after `deadlock_timeout` (a second, with every
    operation behind either batch's locks stalled). Taken first, in one order, the locks
    make a batch wait for another instead; re-taking a lock later costs nothing (advisory
    transaction locks are re-entrant). Sent with the batch's first statement, whose
    parameters psycopg binds client-side: a `%` in a session id is doubled."""
    literal = "'" + bound(sorted(set(sessions))).replace("'", "''").replace("%", "%%") + "'"
    return f"{begin}SELECT ts_lock_all({literal}::text[]); "


# The sessions the functions deferred so far (one per line), read in a call's reply.
_DEFERRED_SIGNALS = "COALESCE(current_setting('trio_sessions.signals', true), '')"

# How a transaction runs: `write` (retried, group-committed), `nowait` (alone, a short
# lock_timeout, lock waits not retried), `read` (alone, one REPEATABLE READ snapshot).
Mode = Literal["write", "nowait", "read"]


# ---------------------------------------------------------------------------------------------
# SQL dialect: `?` and `:name` parameters become psycopg's `%s` and `%(name)s`

# A quoted string or a `::` cast is kept as it is; a bare `%` is escaped for psycopg.
_TOKEN = re.compile(r"'(?:[^']|'')*'|::|\?|:([A-Za-z_][A-Za-z0-9_]*)|%")


def _token(match: re.Match[str]) -> str:
    token = match.group(0)
    if token == "?":
        return "%s"
    if token == "%":
        return "%%"
    if match.group(1) is not None:
        return f"%({match.group(1)})s"
    return token


@functools.lru_cache(maxsize=2048)
def translate(statement: str) -> str:
    """The shared SQL of `_store` (SQLite's parameter styles) in psycopg's style."""
    return _TOKEN.sub(_token, statement)


# A quoted string (kept as it is), a positional `IN` list, or any other positional parameter.
# In any case and spacing: a `NOT` not taken with its `IN` would be left standing before
# `= ANY(?)`, which is no SQL.
_IN_LIST = re.compile(
    r"'(?:[^']|'')*'|\b(NOT\s+)?IN\s*\((\s*\?\s*(?:,\s*\?\s*)*)\)|\?", re.IGNORECASE
)


@functools.lru_cache(maxsize=2048)
def in_lists_as_arrays(statement: str) -> tuple[str, tuple[tuple[int, int], ...]]:
    """`statement` with each positional `IN (?, ...)` list as one array parameter (`x IN
    (?, ?)` as `x = ANY(?)`, `NOT IN` as `<> ALL(?)`: the same condition, which the server
    plans as it plans the list), and where each list's parameters are: (index, count).

    The `_store` SQL shared with SQLite spells a set of ids as a list of up to 500
    parameters; psycopg parses a statement of more than 50 anew on every execute (its
    query cache's limit: 3 ms of CPU for 250 ids), and every list length is another
    statement text. `grouped` binds each list as one array literal (`bound`)."""
    runs: list[tuple[int, int]] = []
    index = 0

    def rewrite(match: re.Match[str]) -> str:
        nonlocal index
        token = match.group(0)
        if token.startswith("'"):
            return token
        if match.group(2) is None:  # a lone `?`
            index += 1
            return token
        count = match.group(2).count("?")
        runs.append((index, count))
        index += count
        return "<> ALL(?)" if match.group(1) else "= ANY(?)"

    return _IN_LIST.sub(rewrite, statement), tuple(runs)


def grouped(params: Params, runs: Sequence[tuple[int, int]]) -> Params:
    """Positional `params` with each of `runs` (`in_lists_as_arrays`) as one list, bound
    as one array literal."""
    if not runs or isinstance(params, Mapping):
        return params
    values = list(params)
    out: list[Any] = []
    start = 0
    for index, count in runs:
        out += values[start:index]
        out.append(bound(values[index : index + count]))
        start = index + count
    return (*out, *values[start:])


# ---------------------------------------------------------------------------------------------
# Arrays: a function call's lists bound as one literal


def _quoted(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def bound(value: Any) -> Any:
    """`value` as a function call binds it: a list of text or of integers (with None as
    NULL) becomes one array literal - text elements double-quoted with `"` and `\\`
    escaped, NULL unquoted, built in one join - which the server reads as the function's
    array argument; anything else is left as it is, for psycopg to adapt.

    psycopg adapts a list element by element in Python (about 2 µs each, client-side
    binding): a recovery pass's arrays of ids cost it milliseconds per call."""
    if type(value) is not list:
        return value
    kinds = {type(item) for item in value} - {type(None)}
    if kinds == {str}:
        return "{" + ",".join("NULL" if item is None else _quoted(item) for item in value) + "}"
    if kinds <= {int}:  # integers, or nothing but NULLs
        return "{" + ",".join("NULL" if item is None else str(item) for item in value) + "}"
    return value


# A function call's statement (`PgTx.call`) begins so; bound server-side when it is its own
# message (`BindingCursor`).
_CALL = "SELECT f.*, pg_current_xact_id_if_assigned()::text"


class BindingCursor(psycopg.Cursor[Any]):
    """The engine's connections' cursor: a function call that is its own message (alone in
    autocommit, or after a transaction's first statement) is bound server-side - the same
    text each time, so psycopg prepares it once it recurs and the server parses and plans
    it once per connection instead of per call, its arguments typed by the function's
    signature. Anything else is bound client-side, as one text: a statement can then share
    its message with the BEGIN before it or the COMMIT, and each parameter is a literal the
    server types from where it stands."""

    def execute(  # type: ignore[override]
        self,
        query: Any,
        params: Params | None = None,
        *,
        prepare: bool | None = None,
        binary: bool | None = None,
    ) -> psycopg.Cursor[Any]:
        if binds_server_side(query):
            return super().execute(query, params, prepare=prepare, binary=binary)
        client = psycopg.ClientCursor(self.connection)
        return client.execute(query, params, prepare=prepare, binary=binary)


def binds_server_side(query: object) -> bool:
    """Whether `query` is a function call that is its own message (`BindingCursor`)."""
    return isinstance(query, str) and query.startswith(_CALL)


# ---------------------------------------------------------------------------------------------
# Transactions


class PgTx:
    """One open READ COMMITTED transaction, as an operation sees it (`_backend.Tx`), or one
    autocommit call (`autocommit=True`: a single function call and nothing else).

    The connection is in autocommit mode; a transaction begins with the first statement
    sent, which carries `begin` (`BEGIN ...;`) in the same message: no round trip of its
    own. A function call also reads the transaction's id in its reply, so a transaction
    that ends with a call needs no read before COMMIT (DESIGN §8 "Uncertain commits").
    """

    def __init__(
        self,
        conn: Any,
        clock: Callable[[], float] | None,
        *,
        begin: str = _BEGIN,
        autocommit: bool = False,
        retry: bool = False,
        job: Job | None = None,
        guard: AbstractContextManager[None] | None = None,
    ) -> None:
        self.conn = conn
        # Around each statement sent (`Withdrawals.statement`): a caller cancelled while it
        # waits may have it cancelled.
        self._guard = guard
        self._clock = clock
        self._now: int | None = None
        # Sessions to signal once committed (insertion-ordered), in the transaction's one
        # notification (`ts_flush_signals`).
        self.notified: dict[str, None] = {}
        # The sessions the functions deferred (`defers_signals`), one per line, as the
        # last statement's reply read them; None when that statement did not read them.
        self.deferred: str | None = ""
        # Advisory xact locks are re-entrant and held to COMMIT: taking one twice in a
        # transaction (two operations of a batch on one session) costs a round trip only.
        self._locked: set[str] = set()
        # A connection outside autocommit (a test's) begins its transactions itself.
        self._begin: str | None = None if autocommit or not conn.autocommit else begin
        # In a write transaction the functions defer their signals to the transaction's
        # one notification (`ts_signal`): its BEGIN sets `trio_sessions.defer_signals`.
        self.defers_signals = begin.startswith(_BEGIN_WRITE) and self._begin is not None
        self.autocommit = autocommit
        self.retry = retry
        # The operation running now (`call_id`); None in a transaction a test runs by hand,
        # which has an id of its own (`_own_call_id`).
        self._job = job
        self._own_call_id: str | None = None
        self.begun = False  # a statement was sent (a transaction is open unless autocommit)
        self.xid: str | None = None
        self.xid_fresh = False  # `xid` was read by the last statement sent

    @property
    def now(self) -> int:
        if self._now is None:
            if self._clock is not None:
                self._now = now_ms(self._clock)
            else:
                row: Any = self._send(_SERVER_NOW, ()).fetchone()
                self._now = int(row[0])
        return self._now

    @property
    def dialect(self) -> BackendName:
        return "postgres"

    @property
    def call_id(self) -> str:
        if self._job is None:
            if self._own_call_id is None:
                self._own_call_id = new_call_id()
            return self._own_call_id
        return self._job.call_id

    def begin_operation(self, job: Job | None = None) -> None:
        """Each operation reads its own `now`, after its own locks; `job`: the operation
        that runs next (its `call_id`)."""
        self._now = None
        self._job = job

    def _send(self, statement: str, params: Params) -> psycopg.Cursor[Any]:
        if self.autocommit and self.begun:
            raise NeedsTransaction("a second statement needs a transaction")
        if self._guard is None:
            return self._sent(statement, params)
        with self._guard:
            return self._sent(statement, params)

    def _sent(self, statement: str, params: Params) -> psycopg.Cursor[Any]:
        self.begun = True  # from here on, the statement may have reached the server
        self.xid_fresh = False
        if self.defers_signals:
            self.deferred = None
        if self._begin is None:
            cursor: psycopg.Cursor[Any] = self.conn.execute(statement, params)
            return cursor
        statement, self._begin = self._begin + statement, None
        cursor = self.conn.execute(statement, params)
        while cursor.nextset():  # past BEGIN (and SET LOCAL) to the statement's result
            pass
        return cursor

    def execute(self, statement: str, params: Params = ()) -> psycopg.Cursor[Any]:
        if self.autocommit:
            raise NeedsTransaction("only a function call runs alone in autocommit")
        statement, runs = in_lists_as_arrays(statement)
        return self._send(translate(statement), grouped(params, runs))

    def one(self, statement: str, params: Params = ()) -> Any:
        return self.execute(statement, params).fetchone()

    def executemany(self, statement: str, rows: Sequence[Params]) -> psycopg.Cursor[Any]:
        raise NotImplementedError("PostgreSQL batches in server-side functions")

    def call(self, function: str, *args: Any, idempotent: bool = True) -> list[Any]:
        if self.autocommit and not idempotent:
            raise NeedsTransaction(f"{function} cannot be read back after a lost reply")
        fixed_now = None if self._clock is None else now_ms(self._clock)
        params = (*map(bound, args), fixed_now, self.retry)
        placeholders = ", ".join(["%s"] * len(params))
        # The reply's last columns are read after the function ran (its rows are complete
        # before the select list is evaluated): the transaction's id and, where the
        # functions defer their signals, the sessions deferred so far.
        extra = f", {_DEFERRED_SIGNALS}" if self.defers_signals else ""
        rows = self._send(f"{_CALL}{extra} FROM {function}({placeholders}) f", params).fetchall()
        if self.defers_signals:
            # No row: unknown, read before COMMIT.
            self.deferred = rows[-1][-1] if rows else None
            rows = [row[:-1] for row in rows]
        if rows:
            self.xid = rows[-1][-1]
            self.xid_fresh = True
        return [tuple(row[:-1]) for row in rows]

    @property
    def locked(self) -> frozenset[str]:
        """The sessions whose locks this transaction took (`lock_session(s)`)."""
        return frozenset(self._locked)

    def lock_session(self, session_id: str) -> None:
        if session_id not in self._locked:
            self._lock(_LOCK_SESSION_ANY, session_id, [session_id])

    def lock_sessions(self, session_ids: Collection[str]) -> None:
        missing = sorted(set(session_ids) - self._locked)
        if missing:
            self._lock(_LOCK_SESSIONS, missing, missing)

    def _lock(self, statement: str, argument: Any, session_ids: list[str]) -> None:
        # The wait may have been long: the clock is read after it, in the same round trip
        # (the MATERIALIZED CTE runs first).
        row = self.one(statement, (argument,))
        self._locked.update(session_ids)
        self._now = int(row[0]) if self._clock is None else None

    def lock_claims(self, execution_ids: Sequence[str]) -> None:
        if not execution_ids:
            return
        # NO KEY UPDATE (not KEY SHARE): it conflicts with a takeover's UPDATE. Sorted, so
        # two owners locking overlapping sets never deadlock.
        self.execute(
            "SELECT id FROM session_execution WHERE id = ANY(?) ORDER BY id FOR NO KEY UPDATE",
            (sorted(execution_ids),),
        )
        self._now = None

    def notify(self, session_id: str, *, watchers_only: bool = False) -> None:
        # Sent once the transaction committed, with the functions' deferred ones, in one
        # notification (`PgEngine`).
        self.notified[WATCHERS_ONLY + session_id if watchers_only else session_id] = None

    def refused_value(self, exc: BaseException) -> str | None:
        # Class 22 (DataError) from the server: a value out of its type's range, a cast a
        # row's text does not fit. One the driver raises before sending (no SQLSTATE: a
        # NUL in a parameter) is ours, not a row's. The server keeps no text that is not
        # valid in its encoding.
        if isinstance(exc, psycopg.DataError) and exc.sqlstate is not None:
            return f"a row holds a value the database refuses ({exc.sqlstate}): {exc}"
        return None

    # Both are sent as every statement of the operation is (`_send`): in its transaction,
    # and under the statement guard - the forget's DELETE may wait for a row lock, and a
    # cancelled caller's wait is cancelled there, not left to `lock_timeout`.

    def free_tokens(self, owner_ids: Sequence[str] | None) -> set[str]:
        # pg_locks is the lock manager's present state, not a snapshot: read after the
        # operation's own locks, it is the re-check a takeover needs.
        rows = self._send(
            _liveness.FREE_PG_TOKENS,
            {"all": owner_ids is None, "owners": list(owner_ids or ())},
        ).fetchall()
        return {str(row[0]) for row in rows}

    def forget_tokens(self, owner_ids: Sequence[str]) -> None:
        if owner_ids:
            self._send(_liveness.FORGET_PG_TOKENS, (list(owner_ids),))

    @contextlib.contextmanager
    def savepoint(self) -> Iterator[None]:
        locked = set(self._locked)
        self.execute("SAVEPOINT nested")
        try:
            yield
        except BaseException:
            self.execute("ROLLBACK TO SAVEPOINT nested")
            # Locks taken inside a rolled-back subtransaction are released with it.
            self._locked = locked
            raise
        finally:
            self.execute("RELEASE SAVEPOINT nested")
