"""Owner liveness tokens (DESIGN §4 "Owner liveness"): telling a dead owner from a slow one.

Every runtime that drains holds a *token* for its whole life, released by the operating
system or the database server when its process dies. Recovery treats the live-leased claims
of an owner whose token stayed free for `takeover_grace` as expired (`_decisions.token_gone`;
`GoneOwners` keeps the sightings), so a SIGKILLed owner's sessions resume in about a second.
A paused or partitioned owner still holds its token: the lease stays the backstop there.

SQLite (one host): `<database>.owners/<sha256 of the owner id>.lock`, directory 0700, file
0600. The owner holds an exclusive `flock` on it and writes its owner id into it. `flock`,
never POSIX `lockf`/`fcntl`: those belong to the process and are dropped when it closes *any*
descriptor of the file - which its own probes would do. A probe takes a shared lock without
waiting; granted means the owner's descriptor is closed, i.e. its process is gone. A missing
or empty file is no evidence: such an owner (a row a test seeded, an older library) is judged
by its lease alone. Whoever finds a token free while its owner holds no live claim removes
the file, under the probe's lock; an owner checks after taking its lock that its path still
names the file it locked.

PostgreSQL (many hosts): a session-level advisory lock, class `hashtext('trio_sessions.owner:'
|| schema)` (two schemas never share tokens), key `hashtext(owner id)`, on a dedicated direct
connection (never through a transaction pooler) that is autocommit and never has anything in
flight. The server drops it within seconds of a host's death (short server-side keepalives,
`client_connection_check_interval`); the client's keepalives are shorter still, so a
partitioned owner notices its loss before the server frees the token. Its socket is awaited by
trio, so a broken connection is noticed in milliseconds; a drain about to start looks at it
first (`looks_lost`): after a pause, the loss may be there before the watch has run. (A drain
starting moments after a look that found it whole skips its own, `TOKEN_LOOK_GAP`: no pause
since can have let another owner take a claim over, every owner's grace being far longer.) The
evidence that an owner holds a token is its `session_owner` row, written after the lock is
taken and removed, like a file, by whoever finds the token free and the owner without live
claims.

Invariants: a token is taken before the runtime's first claim and released after its last
drain exited; a probe never reports a held token as free (a hash collision between two owners
only ever makes a free one look held: the lease then decides); an owner that lost its token
takes it again only through `retake`, at once, after the runtime told the drains of the old
one to stop: they write nothing more, and their claims look held until they exited.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import math
import os
import select
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio

from . import _observe
from ._decisions import token_free_since, token_gone
from ._errors import StoreError

# How often a runtime that drains looks at other owners' tokens (real time). With the grace
# a SIGKILLed owner is taken over within grace + 2 polls; each look costs a few syscalls on
# SQLite, one small query on PostgreSQL.
LIVENESS_POLL = 0.25
# How long taking a token waits for a probe that holds its file's lock for a moment.
TAKE_PATIENCE_S = 5.0
# How long opening a runtime tries to take its PostgreSQL token (a connection of its own,
# refused or its lock still held) before `StoreError` with the last refusal.
PG_TAKE_PATIENCE_S = 4 * TAKE_PATIENCE_S
# A drain starting this soon after a look found its runtime's token whole skips its own
# (`_busy`): within it no pause can have let another owner take a claim over, which takes
# the token free for the whole grace - hence the grace's floor, on every runtime alike. A
# look on PostgreSQL gives up the GIL (a syscall), and with the store's threads busy,
# getting it back cost 25 us a drain call.
TOKEN_LOOK_GAP = 0.005
MIN_TAKEOVER_GRACE = 4 * TOKEN_LOOK_GAP
_OWNER_ID_LIMIT = 65_536


# Linux's clock that counts the time the host was suspended (None elsewhere).
_BOOT_CLOCK: int | None = getattr(time, "CLOCK_BOOTTIME", None)


def since_boot() -> float:
    """Seconds on a clock that also counts the time the host was suspended (trio's does not:
    a suspended host's process sees no pause on it). Linux's boot time; elsewhere the wall
    clock."""
    if _BOOT_CLOCK is None:
        return time.time()
    return time.clock_gettime(_BOOT_CLOCK)


# ---------------------------------------------------------------------------------------------
# Sightings (pure bookkeeping: no I/O, `now` is a parameter)


@attrs.define
class GoneOwners:
    """When each other owner's token was first seen free in its current free run."""

    grace: float
    _free_since: dict[str, float] = attrs.Factory(dict)

    def observe(self, free: Iterable[str], now: float) -> frozenset[str]:
        """Record one look (`free`: the owners whose token is free now); the owners gone now.

        An owner not in `free` was seen held (or has no token on record): its run restarts.
        """
        free = set(free)
        self._free_since = {
            owner: since
            for owner in free
            if (since := token_free_since(self._free_since.get(owner), True, now)) is not None
        }
        return self.gone(now)

    def gone(self, now: float) -> frozenset[str]:
        return frozenset(
            owner for owner, since in self._free_since.items() if token_gone(since, now, self.grace)
        )

    def forget(self, owners: Iterable[str]) -> None:
        for owner in owners:
            self._free_since.pop(owner, None)


# ---------------------------------------------------------------------------------------------
# SQLite: a flock on a file beside the database


def owners_directory(database: str | os.PathLike[str]) -> str:
    return f"{os.fspath(database)}.owners"


def token_path(directory: str, owner_id: str) -> str:
    digest = hashlib.sha256(owner_id.encode()).hexdigest()[:32]
    return os.path.join(directory, f"{digest}.lock")


def take_file_token(database: str | os.PathLike[str], owner_id: str) -> int:
    """Create and lock this owner's token file; returns the descriptor to keep open."""
    directory = owners_directory(database)
    path = token_path(directory, owner_id)
    deadline = time.monotonic() + TAKE_PATIENCE_S
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                # A probe holds it for a few microseconds (it found the file before we
                # wrote our id in it).
                os.close(fd)
                if time.monotonic() > deadline:
                    raise StoreError(f"cannot lock the liveness token {path!r}") from None
                time.sleep(0.001)
                continue
            if _names(path, fd):
                os.ftruncate(fd, 0)
                os.write(fd, owner_id.encode())
                return fd
            # A cleaner removed the file between our open and our lock: lock a fresh one.
            os.close(fd)
    except OSError as exc:
        raise StoreError(f"cannot take the liveness token {path!r}: {exc}") from exc


def _names(path: str, fd: int) -> bool:
    try:
        on_disk = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (on_disk.st_dev, on_disk.st_ino) == (held.st_dev, held.st_ino)


def free_file_tokens(database: str | os.PathLike[str], owner_ids: Sequence[str] | None) -> set[str]:
    """The owners (of `owner_ids`; None: every token file) whose token file names them and is
    not locked. Never a held token, never an owner without a file."""
    directory = owners_directory(database)
    if owner_ids is None:
        try:
            paths = [
                os.path.join(directory, n) for n in os.listdir(directory) if n.endswith(".lock")
            ]
        except FileNotFoundError:
            return set()
    else:
        paths = [token_path(directory, owner) for owner in owner_ids]
    free = set()
    for path in paths:
        owner = _probe(path)
        if owner is not None and (owner_ids is None or owner in owner_ids):
            free.add(owner)
    return free


def forget_file_tokens(database: str | os.PathLike[str], owner_ids: Sequence[str]) -> None:
    """Remove the token files of these owners that are still free (their owners are gone)."""
    directory = owners_directory(database)
    for owner in owner_ids:
        _probe(token_path(directory, owner), remove_if=owner)


def _probe(path: str, *, remove_if: str | None = None) -> str | None:
    """The owner id in a free token file (None: held, missing or empty); with `remove_if`,
    that owner's free file is removed under the probe's lock."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return None  # its owner holds it
        owner = os.read(fd, _OWNER_ID_LIMIT).decode(errors="replace") or None
        if owner is not None and owner == remove_if:
            with contextlib.suppress(FileNotFoundError):  # another cleaner was first
                os.unlink(path)
        return owner
    finally:
        os.close(fd)


@attrs.define(eq=False)
class FileToken:
    """A held SQLite token. The process holds the lock until it dies or closes the runtime;
    nothing else can take it away, so it is never lost."""

    fd: int
    poll_interval: float | None

    async def wait_lost(self) -> None:
        await trio.sleep_forever()

    def looks_lost(self) -> bool:
        return False

    async def retake(self) -> None:
        await trio.lowlevel.checkpoint()


@asynccontextmanager
async def hold_file_token(
    database: str | os.PathLike[str], owner_id: str, *, inline: bool
) -> AsyncIterator[FileToken]:
    if inline:
        fd = take_file_token(database, owner_id)
    else:
        fd = await trio.to_thread.run_sync(take_file_token, database, owner_id)
    try:
        # Inline stores are for deterministic tests: no look in the background, only at
        # recovery passes.
        yield FileToken(fd, None if inline else LIVENESS_POLL)
    finally:
        # Closing the descriptor releases the lock; the file stays for a cleaner (a claim
        # the hand-back missed is then taken over after the grace, not the lease).
        os.close(fd)


# ---------------------------------------------------------------------------------------------
# PostgreSQL: a session-level advisory lock on a connection of its own

# The token's class and key, computed by the server from the schema and the owner id, so
# every host agrees without sharing code.
_TOKEN_CLASS = "hashtext('trio_sessions.owner:' || current_schema())"
_TAKE = f"SELECT pg_try_advisory_lock({_TOKEN_CLASS}, hashtext(%s))"
# pg_locks shows a two-key advisory lock as (classid, objid, objsubid=2), as unsigned oids.
_HELD = (
    "EXISTS (SELECT 1 FROM pg_locks l WHERE l.locktype = 'advisory' AND l.granted"
    " AND l.objsubid = 2"
    " AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
    f" AND l.classid = ({_TOKEN_CLASS}::bigint & 4294967295)::oid"
    " AND l.objid = (hashtext(o.owner_id)::bigint & 4294967295)::oid)"
)
FREE_PG_TOKENS = (
    "SELECT o.owner_id FROM session_owner o"
    f" WHERE (%(all)s OR o.owner_id = ANY(%(owners)s)) AND NOT {_HELD}"
)
FORGET_PG_TOKENS = f"DELETE FROM session_owner o WHERE o.owner_id = ANY(%s) AND NOT {_HELD}"
_REGISTER = (
    "INSERT INTO session_owner(owner_id, time_created)"
    " VALUES (%s, floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint)"
    " ON CONFLICT (owner_id) DO NOTHING"
)
# Backoff while the token cannot be taken (the server still holds the old connection's
# lock until it notices that connection is gone).
_RETAKE_PAUSES = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0)


@attrs.define(eq=False)
class PgToken:
    """A held PostgreSQL token and its connection; `wait_lost` watches the socket."""

    connect: Callable[[], Any]  # a new token connection (autocommit), or StoreError
    owner_id: str
    inline: bool
    poll_interval: float | None
    conn: Any = None
    # `looks_lost`'s poll object, and the descriptor it watches (a new connection's may be
    # another).
    _poller: Any = None
    _polled: int = -1

    def _take_sync(self) -> bool:
        import psycopg  # the optional extra: only a PostgreSQL store gets here

        conn = self.connect()
        try:
            taken = bool(conn.execute(_TAKE, (self.owner_id,)).fetchone()[0])
            if taken:
                # The evidence follows the lock: whoever sees the row and a free lock knows
                # the owner is gone.
                conn.execute(_REGISTER, (self.owner_id,))
        except psycopg.Error as exc:
            conn.close()
            raise StoreError(f"cannot take the liveness token: {exc}") from exc
        if not taken:
            conn.close()
            return False
        self.conn = conn
        return True

    async def take(self, *, patience: float = math.inf) -> None:
        """Connect and take the lock, retrying until it is ours (a store error or a lock
        still held by our broken connection's server side), each refusal logged; past
        `patience` seconds (trio's clock), `StoreError` with the last refusal."""
        deadline = trio.current_time() + patience
        logged = None  # the refusal last logged: a server down for an hour logs it once
        for attempt in range(1_000_000):
            try:
                taken = (
                    self._take_sync()
                    if self.inline
                    else await trio.to_thread.run_sync(self._take_sync)
                )
            except StoreError as exc:
                refusal = exc  # its text masks the URL's password (`connect`)
            else:
                if taken:
                    return
                refusal = StoreError(
                    "the liveness token is held by another connection (the server has not"
                    " yet closed this owner's lost one, or another process uses its owner id)"
                )
            if str(refusal) != logged:
                logged = str(refusal)
                _observe.token_take_failed(self.owner_id, refusal)
            remaining = deadline - trio.current_time()
            if remaining <= 0:
                raise StoreError(
                    f"cannot take the liveness token within {patience:g} s: {refusal}"
                ) from refusal
            pause = _RETAKE_PAUSES[min(attempt, len(_RETAKE_PAUSES) - 1)]
            await trio.sleep(min(pause, remaining))

    async def wait_lost(self) -> None:
        """Return when the token's connection broke (the server frees the lock with it)."""
        import psycopg

        conn = self.conn
        if conn is None:
            return
        pgconn = conn.pgconn
        while not _ended(conn):
            await trio.lowlevel.wait_readable(pgconn.socket)
            try:
                pgconn.consume_input()
            except psycopg.OperationalError:
                return  # the connection is gone, and the lock with it
            while pgconn.notifies() is not None:
                pass  # nothing listens here; keep the buffer empty

    def looks_lost(self) -> bool:
        """Whether the connection's end may be on its socket already (the server's error
        message, its close, a reset), seen without waiting and without reading: only
        `wait_lost` reads this socket, and decides. Nothing else arrives on an idle token
        connection but notices; under TLS a record's first byte cannot tell a notice from
        the farewell, so anything there looks like a loss."""
        import psycopg

        conn = self.conn
        if conn is None or _ended(conn):
            return True
        try:
            fd = conn.pgconn.socket
        except psycopg.OperationalError:
            return True
        if self._polled != fd:  # poll(), not select(): descriptors may pass 1024
            self._poller, self._polled = select.poll(), fd
            self._poller.register(fd, select.POLLIN)
        if not self._poller.poll(0):
            return False
        sock = socket.socket(fileno=fd)
        try:
            first = sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False
        except OSError:
            return True  # reset
        finally:
            sock.detach()  # the connection's descriptor, not ours to close
        # The end of the stream, or an ErrorResponse: unasked, always fatal.
        return first in (b"", b"E") or bool(conn.pgconn.ssl_in_use)

    async def retake(self) -> None:
        self.close()
        await self.take()

    def close(self) -> None:
        import psycopg

        conn, self.conn = self.conn, None
        if conn is None:
            return
        if not conn.closed:
            with contextlib.suppress(OSError, psycopg.Error):  # a socket already gone
                trio.lowlevel.notify_closing(conn.pgconn.socket)
        with contextlib.suppress(psycopg.Error):  # closing a broken connection may complain
            conn.close()


def _ended(conn: Any) -> bool:
    """Whether a token's connection is over, and the lock with it: closed, broken, or so
    its last read left it (`wait_lost` reads it; `looks_lost` asks between reads)."""
    import psycopg

    return bool(conn.closed or conn.broken or conn.pgconn.status != psycopg.pq.ConnStatus.OK)


@asynccontextmanager
async def hold_pg_token(
    connect: Callable[[], Any], owner_id: str, *, inline: bool
) -> AsyncIterator[PgToken]:
    token = PgToken(connect, owner_id, inline, None if inline else LIVENESS_POLL)
    first = token._take_sync if inline else None
    if first is not None:
        if not first():
            raise StoreError("the liveness token of a new owner id is held by another owner")
    else:
        await token.take(patience=PG_TAKE_PATIENCE_S)
    try:
        yield token
    finally:
        token.close()
