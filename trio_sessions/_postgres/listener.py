"""The two PostgreSQL connections that hold session state, and so connect directly to the
server (never through a transaction-mode pooler): the LISTEN connection (`PgListener`) and
the liveness token's connection (`token_connection`, used by `_liveness`).

The listener: one autocommit LISTEN connection per executor on the schema's channel,
awaited trio-natively on libpq's socket. A notification's payload is the sessions one
transaction signalled, one per line (session ids are printable: no line breaks), or empty
when they did not fit a payload: look at everything. A line is a bare session id (a change
any runtime may need: a doorbell, a claim's state) or the id behind a tab (`WATCHERS_ONLY`:
only its transcript changed). The `wanted` filter decides per session (and per sending
backend, and kind) whether it is worth a look.

Invariants:
* nothing is ever in flight on the listener, so waiting is cancellable at any instant;
* notifications are lost while it is disconnected (the server queues nothing for a
  listener that is gone): after every reconnect it reports a change, so the runtime
  rescans. The doorbell stays the truth; this only cuts latency;
* the token's connection has keepalives shorter than every other connection's, so a
  partitioned owner has stopped its drains before others can see its token free.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import psycopg
import psycopg.pq
import trio
from psycopg import sql

from .. import _observe
from .._backend import Signal, driver_error
from .._errors import StoreError
from .connections import WATCHERS_ONLY, channel, connect

# The payload of a transaction whose signalled sessions did not fit one (`ts_flush_signals`):
# every session may have changed.
LOOK_AT_EVERYTHING = ""
# Whether a notification is worth a look: (sender's backend pid, session id, watchers only).
Wanted = Callable[[int, str, bool], bool]


# ---------------------------------------------------------------------------------------------
# Signals between processes


class PgListener:
    """The LISTEN connection (autocommit), awaited trio-natively on libpq's socket: nothing
    is ever in flight on it, so waiting is cancellable at any instant.

    Notifications are lost while it is disconnected (the server queues nothing for a
    listener that is gone): after every reconnect it reports a change, so the runtime
    rescans. The doorbell stays the truth; this only cuts latency.
    """

    def __init__(self, url: str, schema: str, *, inline: bool) -> None:
        self.url = url
        self.schema = schema
        self.channel = channel(schema)
        self.inline = inline
        self.conn: psycopg.Connection[Any] | None = None
        self.reconnects = 0

    def _connect(self) -> psycopg.Connection[Any]:
        conn = connect(self.url, self.schema)
        try:
            conn.autocommit = True  # a listener inside a transaction holds the queue back
            conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self.channel)))
        except psycopg.Error as exc:
            conn.close()
            raise driver_error(exc) from exc
        return conn

    async def open(self) -> None:
        self.conn = await self._connect_async()

    async def _connect_async(self) -> psycopg.Connection[Any]:
        if self.inline:
            return self._connect()
        return await trio.to_thread.run_sync(self._connect)

    def close(self) -> None:
        if self.conn is not None:
            with contextlib.suppress(psycopg.Error):
                self.conn.close()
            self.conn = None

    async def wait(
        self,
        kick: trio.Event,
        fallback: float,
        wanted: Wanted | None = None,
    ) -> Signal | None:
        """Return on a notification `wanted(sender's backend pid, session id, watchers
        only)` (default: any) - what the wanted ones named, or None when anything may
        have changed (an empty payload, a reconnect) - when `kick` is set, or after
        `fallback` seconds (both None)."""
        signalled: Signal | None = None
        with trio.move_on_after(fallback):
            async with trio.open_nursery() as nursery:

                async def kicked() -> None:
                    await kick.wait()
                    nursery.cancel_scope.cancel()

                nursery.start_soon(kicked)
                signalled = await self._notified(wanted)
                nursery.cancel_scope.cancel()
        return signalled

    async def _notified(self, wanted: Wanted | None) -> Signal | None:
        if self.conn is None or self.conn.closed or self.conn.broken:
            self.close()
            try:
                self.conn = await self._connect_async()
            except StoreError as exc:
                _observe.listener_reconnect_failed(self.channel, exc)
                await trio.sleep_forever()  # until the fallback poll's timeout
            self.reconnects += 1
            _observe.listener_reconnected(self.channel)
            return None  # notifications sent meanwhile are lost: rescan now
        pgconn = self.conn.pgconn
        while True:
            signalled = self._take_notifications(pgconn, wanted)
            if signalled is None or signalled.sessions:
                return signalled
            await trio.lowlevel.wait_readable(pgconn.socket)
            try:
                pgconn.consume_input()
            except psycopg.OperationalError:
                self.close()
                return None  # reconnect at the next wait; rescan now

    @staticmethod
    def _take_notifications(pgconn: psycopg.pq.abc.PGconn, wanted: Wanted | None) -> Signal | None:
        """What the wanted notifications received so far named (no session: none was
        wanted), or None: one said anything may have changed."""
        sessions: set[str] = set()
        transcripts_only = True
        everything = False
        while (notify := pgconn.notifies()) is not None:
            payload = notify.extra.decode(errors="replace")
            if payload == LOOK_AT_EVERYTHING:
                everything = True  # which sessions changed is unknown, as after a reconnect
                continue
            for line in payload.split("\n"):
                watchers_only = line.startswith(WATCHERS_ONLY)
                session_id = line.removeprefix(WATCHERS_ONLY)
                if wanted is None or wanted(notify.be_pid, session_id, watchers_only):
                    sessions.add(session_id)
                    transcripts_only = transcripts_only and watchers_only
        return None if everything else Signal(frozenset(sessions), transcripts_only)


async def _wait_for_change(
    listener: PgListener | None,
    kick: trio.Event,
    fallback: float,
    wanted: Wanted | None = None,
) -> Signal | None:
    if listener is not None:
        return await listener.wait(kick, fallback, wanted)
    with trio.move_on_after(fallback):  # poll-only (listen=False): e.g. behind PgBouncer
        await kick.wait()
    return None


# ---------------------------------------------------------------------------------------------
# The liveness token's connection

# The liveness token's connection (`_liveness`): the server frees a dead host's token within
# about 5 s (2 + 3 x 1), and the client notices a broken connection sooner (about 3 s:
# 1 + 2 x 1, or 2 s of unacknowledged data), so a partitioned owner has stopped its drains
# before others can see its token free.
TOKEN_SERVER_SETTINGS = {
    "tcp_keepalives_idle": 2,
    "tcp_keepalives_interval": 1,
    "tcp_keepalives_count": 3,
    "client_connection_check_interval": 1_000,
}
TOKEN_CLIENT_KEEPALIVES = {
    "keepalives_idle": 1,
    "keepalives_interval": 1,
    "keepalives_count": 2,
    "tcp_user_timeout": 2_000,
}


def token_connection(url: str, schema: str) -> psycopg.Connection[Any]:
    """A direct, autocommit connection for the liveness token (`_liveness`), with keepalives
    shorter than every other connection's."""
    conn = connect(url, schema, server=TOKEN_SERVER_SETTINGS, client=TOKEN_CLIENT_KEEPALIVES)
    conn.autocommit = True
    return conn
