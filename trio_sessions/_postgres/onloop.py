"""A lone autocommit call on the trio thread: an idle lane's connection (`executors._Lane`)
driven without blocking, its reply awaited as trio I/O, with no hand-off to the lane's
worker thread.

Why: on the sequential cycle, a hand-off's thread wake-ups (trio to the worker, the worker
back to trio) cost more than the server's work for the call itself; a call on the loop
pays one wait for its socket instead. It is taken only when the lane is idle (nothing
queued, nothing in flight) and no other task is runnable - operations started together
still queue into one batch - for an operation marked `autocommit_when_alone` whose
earlier attempts (if any) left nothing unknown.

How: the operation runs twice, synchronously, around one awaited statement. First on a
`_Recording` transaction, which stops it at its first statement, nothing sent
(`_Recorded`); that statement is sent on the lane's connection by psycopg's own generator
of a cursor's execute, driven by trio's waits for the socket (psycopg drives it with
blocking waits, and asyncio's); then the operation runs again on a `_Replaying`
transaction, whose first statement answers with that reply (or raises its error) and whose
second raises `NeedsTransaction`, as in autocommit. So the operation sees what
`PgEngine._autocommit` would show it, and its outcome is the one that call would have had.

What the loop does not settle goes to the worker (`engine.autocommit_failure`):
* refused whole by the server, or the operation needs a second statement: nothing
  written - the worker runs it in a transaction (`Job.autocommit_refused`);
* refused in a way that is retried (a lock timeout, a serialisation failure): nothing
  written - the worker runs it again, within its own bounds;
* the connection lost: a write's call may have landed (`Job.reply_lost`) - the worker
  re-opens the connection and calls again with `retry`, reading back whether it did;
  but a wait the reply watchdog cut (the server stopped answering) fails then, as the
  worker's call fails in its hand-off (`OutcomeUnknown` for a write);
* a reply holding more than the loop may fetch and decode (`_codec.OffTheLoop`, DESIGN
  §6.26; its values charged up front, `CELL_UNITS` each): the worker calls again - a
  write's call with `retry`, reading back what it did.
The operation's own refusal, or a database error, is the caller's.

Invariants:
* the lane counts as in flight from before the statement is sent until its reply was read:
  what queues meanwhile waits for it (a session's operations keep their order, on one
  connection) and the lane's worker never touches the connection at the same time;
* an operation that has begun is never abandoned: a caller cancelled while its statement is
  unanswered waits for the reply (shielded) - only a statement still unanswered
  `CANCEL_AFTER_S` after it was sent is cancelled, as `engine.Withdrawals` does, and the
  operation is withdrawn when the server answers that cancel (57014: nothing written);
  any other reply is its outcome, the cancellation delivered at the caller's next
  checkpoint;
* the connection never carries a statement half-read into the worker's next batch: a wait
  ended any other way (KeyboardInterrupt) closes it, and the worker re-opens it.
"""

from __future__ import annotations

import inspect
import select
import time
from collections.abc import Generator, Iterator
from typing import Any

import psycopg
import trio
from psycopg.waiting import Ready, Wait

from .. import _codec
from .._backend import Job, NeedsTransaction, Params, driver_error
from .engine import (
    CANCEL_AFTER_S,
    CANCEL_TIMEOUT_S,
    PgEngine,
    _store_error,
    _unknown_outcome,
    autocommit_failure,
)
from .transactions import PgTx, binds_server_side

# What fetching one value of a reply on the loop costs its budget (`_codec.loop_budget`),
# beyond what `loads` charges for its text: the row's conversion and what the operation
# makes of it (a message's checks and object). Measured: a transcript of short messages
# costs the loop 5-6 µs a row of 7 values (1,800 rows: 10 ms), where `loads` charged each
# row its text's 15 characters; the budget's 256 Ki units are 15-20 ms of decoding.
CELL_UNITS = 16


def _drivable() -> bool:
    """Whether psycopg has the generator of a cursor's execute that its sync and async
    cursors share (3.0 to 3.3, at least), as we call it: private, so with another shape
    every call goes to the worker, as before."""
    execute = getattr(psycopg.Cursor, "_execute_gen", None)
    if execute is None:
        return False
    try:
        inspect.signature(execute).bind(None, "query", (), prepare=None, binary=None)
    except TypeError:
        return False
    return True


_DRIVABLE = _drivable()


class _Recorded(Exception):
    """The operation's first statement, not sent."""

    def __init__(self, statement: str, params: Params) -> None:
        self.statement = statement
        self.params = params


class _Recording(PgTx):
    def _sent(self, statement: str, params: Params) -> psycopg.Cursor[Any]:
        raise _Recorded(statement, params)


class _Diverged(Exception):
    """The operation's second run did not send first what its first run sent."""


class _Replaying(PgTx):
    def __init__(self, conn: Any, engine: PgEngine, job: Job, reply: _Reply) -> None:
        super().__init__(conn, engine.clock, autocommit=True, job=job)
        self._reply = reply

    def _sent(self, statement: str, params: Params) -> psycopg.Cursor[Any]:
        if statement != self._reply.statement:
            raise _Diverged
        self.begun = True
        return self._reply.cursor()


def may_run(engine: PgEngine, job: Job, mode: str) -> bool:
    """Whether `job` may run as one call on the loop now (its lane being idle)."""
    conn = engine.conn
    return (
        _DRIVABLE
        and mode != "nowait"
        and engine.wrap_connection is None  # a test's wrapper sees every statement
        and conn is not None
        and not conn.closed
        and not conn.broken
        and job.op.__dict__.get("autocommit_when_alone", False)
        and not job.reply_lost
        and not job.autocommit_refused
        # The operation runs twice, its call's reply awaited between, so it must decide
        # alike both times: an argument read only once would be empty the second time
        # (`_Replaying` would answer what the reply did not ask), and an operation marked
        # `never_replayed` decides from data other tasks may change meanwhile (a tool
        # settled twice: the second run went to the worker, onto the first run's write).
        and not job.op.__dict__.get("never_replayed", False)
        and not any(isinstance(argument, Iterator) for argument in job.args)
        and trio.lowlevel.current_statistics().tasks_runnable == 0
    )


async def run_on_the_loop(engine: PgEngine, job: Job, *, read: bool) -> bool:
    """Run `job` as one autocommit call on the engine's connection, from the trio thread:
    True when it settled (`job.result` or `job.error`), False when the worker is to run it
    (`Job.autocommit_refused`, `Job.reply_lost`, or a retry). Cancelled when its caller
    was, and it was withdrawn (nothing written)."""
    conn = engine.conn
    try:
        with _codec.loop_budget():
            job.op(_Recording(conn, engine.clock, autocommit=True, job=job), *job.args)
    except _Recorded as recorded:
        statement, params = recorded.statement, recorded.params
    except Exception:  # more to encode than the loop may (`OffTheLoop`), or a refusal
        return False  # nothing sent: the worker runs it as it always did
    else:
        return False
    engine.transactions += 1
    engine.loop_calls += 1
    reply = _Reply(conn, statement, params)
    try:
        await reply.answered()
    except psycopg.Error as exc:
        reply.error = exc
    except OSError as exc:
        reply.error = _socket_closed(exc)
    except BaseException:
        if not reply.done:  # the connection still carries the statement
            engine.close()
        raise
    return _replayed(engine, job, reply, read=read)


def _replayed(engine: PgEngine, job: Job, reply: _Reply, *, read: bool) -> bool:
    """The operation's second run, on the reply: `run_on_the_loop`'s verdict."""
    conn = engine.conn
    replaying = _Replaying(conn, engine, job, reply)
    try:
        with _codec.loop_budget():
            # Charged up front: a long reply (many small messages) is not fetched here.
            _codec.spend(reply.cells() * CELL_UNITS)
            result = job.op(replaying, *job.args)
    except (_codec.OffTheLoop, _Diverged):
        return _read_back(engine, job, reply, read=read)
    except NeedsTransaction:
        if not replaying.begun:
            return _read_back(engine, job, reply, read=read)
        job.autocommit_refused = True
        return False
    except Exception as exc:
        if not replaying.begun:
            return _read_back(engine, job, reply, read=read)
        failure = autocommit_failure(conn, exc)
        if failure is None:
            job.error = _store_error(exc)
            return True
        if failure == "refused":
            job.autocommit_refused = True
            return False
        if failure == "lost":
            # Cut by the reply watchdog: the server stopped answering. The call fails now,
            # as in the worker's hand-off (nothing more tried there), not after the worker
            # re-opened the connection for up to `RECONNECT_PATIENCE_S` more.
            silent = getattr(conn, "cut", False)
            engine.close()  # the worker re-opens it
            job.reply_lost = not read  # a read's lost reply leaves nothing unknown
            if silent:
                error = driver_error(exc)
                job.error = _unknown_outcome(exc, error) if job.reply_lost else error
                return True
        # The worker's call is this one's retry, as `PgEngine._autocommit` counts its own.
        engine.count_retry(exc, 1)
        return False
    if not replaying.begun:
        return _read_back(engine, job, reply, read=read)
    job.result = result
    return True


def _read_back(engine: PgEngine, job: Job, reply: _Reply, *, read: bool) -> bool:
    """The call ran, but its reply cannot be read through the operation here: more to
    fetch and decode than the loop may (`OffTheLoop`, DESIGN §6.26), or a second run that
    did not send first what the first run sent (`_Diverged`). The worker calls again - a
    write's call with `retry`, which reads back what this one did, as after a lost reply;
    but as a first call when the server answered with an error (nothing written)."""
    error = reply.error
    if error is not None:
        if autocommit_failure(engine.conn, error) != "lost":
            return False
        engine.close()  # it may still carry the statement, half-read: the worker re-opens it
    job.reply_lost = not read
    return False


def _socket_closed(exc: OSError) -> psycopg.Error:
    error = psycopg.OperationalError(f"connection socket closed: {exc}")
    error.__cause__ = exc
    return error


class _Reply:
    """One statement sent on `conn` (the engine's connection as connected, watched by the
    reply watchdog: `connections._WatchedConnection`) and its reply read, by psycopg's
    generator of a cursor's execute, driven from the trio thread."""

    def __init__(self, conn: Any, statement: str, params: Params) -> None:
        self.statement = statement
        self._cursor: psycopg.Cursor[Any] = (
            conn.cursor() if binds_server_side(statement) else psycopg.ClientCursor(conn)
        )
        self._conn = conn
        self._fileno: int = conn.pgconn.socket
        self._steps: Generator[Any, Any, None] = self._cursor._execute_gen(statement, params)
        self._wait: Wait | None = None
        self._sent_at = 0.0
        self.done = False
        self.error: psycopg.Error | None = None

    def cursor(self) -> psycopg.Cursor[Any]:
        if self.error is not None:
            raise self.error
        return self._cursor

    def cells(self) -> int:
        """The values of the reply (rows by columns); none for an error."""
        result = self._cursor.pgresult
        if self.error is not None or result is None:
            return 0
        return result.ntuples * result.nfields

    def _advance(self, ready: Ready | None) -> None:
        try:
            self._wait = next(self._steps) if ready is None else self._steps.send(ready)
        except StopIteration:
            self.done = True
        except BaseException:
            self.done = True  # the generator ended with its error
            raise

    async def answered(self) -> None:
        """Until the reply was read. A caller cancelled meanwhile waits on (shielded), and
        the statement is cancelled if still unanswered `CANCEL_AFTER_S` after it was sent:
        the server's 57014 for it then ends the wait in the caller's cancellation. Bounded
        as the worker's waits are: past `REPLY_BOUND_S` the reply watchdog shuts the
        connection's socket down, and the wait ends as a lost connection."""
        conn = self._conn
        self._sent_at = conn.waiting_since = time.monotonic()
        try:
            self._advance(None)  # sends it, as far as the socket takes it now
            if await self._answered_unless_cancelled():
                return
            with trio.CancelScope(shield=True):
                withdrawn = await self._answered_or_cancelled()
        finally:
            conn.waiting_since = None
        if withdrawn:
            await trio.lowlevel.checkpoint()  # raises the caller's Cancelled

    async def _answered_unless_cancelled(self) -> bool:
        """Read the reply; False when the caller was cancelled first."""
        try:
            while not self.done:
                self._advance(await self._ready())
        except trio.Cancelled:
            return False
        return True

    async def _ready(self) -> Ready:
        wait = self._wait
        if wait == Wait.R:
            await trio.lowlevel.wait_readable(self._fileno)
            return Ready.R
        # Sending: the socket nearly always takes it at once.
        if ready := _ready_now(self._fileno, wait):
            return ready
        await trio.lowlevel.wait_writable(self._fileno)
        return Ready.W

    async def _answered_or_cancelled(self) -> bool:
        """Shielded, for a cancelled caller: read the reply, cancelling the statement if it
        is still unanswered `CANCEL_AFTER_S` after it was sent. Whether the server answered
        our cancel (the operation withdrawn, nothing written)."""
        while not self.done:
            remaining = self._sent_at + CANCEL_AFTER_S - time.monotonic()
            if remaining <= 0:
                break
            # In a thread, on real time: the runtime's clock may be a test's virtual one.
            fileno, wait = self._fileno, self._wait
            ready = await trio.to_thread.run_sync(_ready_within, fileno, wait, remaining)
            if ready:
                self._advance(ready)
        if self.done:
            return False
        await trio.to_thread.run_sync(_cancel, self._conn)
        try:
            while not self.done:
                self._advance(await self._ready())
        except psycopg.Error as exc:
            if exc.sqlstate == "57014":
                return True
            raise
        return False


def _ready_now(fileno: int, wait: Wait | None) -> Ready:
    return _ready_within(fileno, wait, 0.0)


def _ready_within(fileno: int, wait: Wait | None, timeout: float) -> Ready:
    poll = select.poll()
    mask = (select.POLLIN if wait != Wait.W else 0) | (select.POLLOUT if wait != Wait.R else 0)
    poll.register(fileno, mask)
    events = 0
    for _, event in poll.poll(timeout * 1000):
        events |= event
    failed = select.POLLERR | select.POLLHUP
    readable = Ready.R if events & (select.POLLIN | failed) else Ready.NONE
    writable = Ready.W if events & (select.POLLOUT | failed) else Ready.NONE
    return Ready(readable | writable)


def _cancel(conn: Any) -> None:
    try:
        conn.cancel_safe(timeout=CANCEL_TIMEOUT_S)
    except Exception:  # a connection gone: its statement ended
        return
