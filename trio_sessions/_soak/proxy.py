"""A fault proxy: one host's path to the database, as an in-process trio TCP proxy.

Each soak worker ("host") connects to PostgreSQL through its own `FaultProxy`, which the
soak's chaos loop drives:

* pass - bytes flow both ways;
* `blackhole()` - a partition: nothing is forwarded either way and new connections are held
  unanswered, while the sockets stay open (the peers' kernels still ACK, so neither side
  sees an error; what was sent waits in the proxy and flows again on `heal()`, like a
  healed network - a transaction caught in the middle resumes where it stopped);
* `reset()` - every current connection is aborted (RST to the client, EOF to the server);
* `arm_partition(after)` - blackhole right after the `after`-th client message that follows
  a `BEGIN` on any connection: a partition inside a transaction, between its fence read and
  its COMMIT;
* `arm_commit_trap()` - the next `COMMIT` a client sends freezes its connection (the COMMIT
  is forwarded or withheld, the server's answer never delivered) and the link is handed to
  the chaos loop, which kills the server backend (`pg_terminate_backend`): a connection
  lost during COMMIT, whose outcome the client cannot know.

Invariant: the proxy never changes, reorders or invents bytes; it only delays them, drops
them together with their connection, or forwards them.
"""

from __future__ import annotations

import contextlib
import socket
import struct

import attrs
import trio

# psycopg sends these as simple Query messages ('Q', int32 length, text, NUL); its BEGIN may
# carry an isolation level.
COMMIT = b"Q\x00\x00\x00\x0bCOMMIT\x00"
CHUNK = 65536
TRAP_PATIENCE = 1.0  # seconds a trapped COMMIT's link waits for the chaos loop


@attrs.define(eq=False)
class Link:
    """One proxied connection."""

    client: trio.SocketStream
    scope: trio.CancelScope = attrs.Factory(trio.CancelScope)
    # Local port of the proxy's connection to the server: pg_stat_activity.client_port.
    upstream_port: int = 0
    in_transaction: bool = False
    statements: int = 0
    frozen: bool = False
    # For a COMMIT trap: whether the COMMIT reached the server before the kill.
    commit_forwarded: bool = False

    def abort(self) -> None:
        """RST to the client (SO_LINGER 0 makes close() abortive), EOF to the server."""
        with contextlib.suppress(OSError):  # already closed: nothing left to abort
            self.client.socket.setsockopt(
                socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
            )
        self.scope.cancel()


class FaultProxy:
    """Forwards 127.0.0.1:`port` to the database's port, with faults on request."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = 0
        self.links: set[Link] = set()
        self._open = trio.Event()
        self._open.set()
        self._partition_after: int | None = None
        self._commit_trap: bool | None = None  # None: disarmed; else forward the COMMIT?
        self.tripped = trio.Event()
        self._trapped_send, self.trapped = trio.open_memory_channel[Link](float("inf"))

    @property
    def blackholed(self) -> bool:
        return not self._open.is_set()

    def blackhole(self) -> None:
        if self._open.is_set():
            self._open = trio.Event()

    def heal(self) -> None:
        self._partition_after = None
        self._open.set()

    def reset(self) -> None:
        for link in list(self.links):
            link.abort()

    def arm_partition(self, after: int) -> trio.Event:
        """Blackhole after the `after`-th client message inside a transaction; the returned
        event is set when it happened."""
        self._partition_after = after
        self.tripped = trio.Event()
        return self.tripped

    def arm_commit_trap(self, *, forward: bool) -> None:
        self._commit_trap = forward

    def disarm(self) -> None:
        self._partition_after = None
        self._commit_trap = None

    async def serve(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started(self.port)
        await trio.serve_listeners(self._handle, listeners)

    async def _passable(self) -> None:
        while not self._open.is_set():
            await self._open.wait()

    async def _handle(self, client: trio.SocketStream) -> None:
        link = Link(client)
        self.links.add(link)
        try:
            async with client:
                with link.scope:
                    await self._passable()  # a partitioned host's connect hangs
                    try:
                        upstream = await trio.open_tcp_stream("127.0.0.1", self.upstream_port)
                    except OSError:
                        return  # the server is down: the client sees its connection close
                    link.upstream_port = upstream.socket.getsockname()[1]
                    async with upstream, trio.open_nursery() as nursery:
                        nursery.start_soon(self._pump, client, upstream, link, True)
                        nursery.start_soon(self._pump, upstream, client, link, False)
        finally:
            self.links.discard(link)

    async def _pump(
        self,
        source: trio.SocketStream,
        sink: trio.SocketStream,
        link: Link,
        from_client: bool,
    ) -> None:
        try:
            while data := await source.receive_some(CHUNK):
                await self._passable()
                if link.frozen:
                    await trio.sleep_forever()  # the chaos loop ends this link
                if from_client and self._commit_trap is not None and COMMIT in data:
                    await self._trap_commit(sink, data, link)
                await sink.send_all(data)
                if from_client:
                    self._count_statement(link, data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # a peer went away: so does this connection
        link.scope.cancel()  # EOF or an error one way: close both

    async def _trap_commit(self, sink: trio.SocketStream, data: bytes, link: Link) -> None:
        forward, self._commit_trap = self._commit_trap, None
        link.frozen = True
        if forward:
            await sink.send_all(data)
            link.commit_forwarded = True
        self._trapped_send.send_nowait(link)
        # The chaos loop kills the backend and ends the link. Should it have stopped
        # waiting, end the link anyway: a frozen link must never hang its client.
        await trio.sleep(TRAP_PATIENCE)
        link.scope.cancel()
        await trio.sleep_forever()

    def _count_statement(self, link: Link, data: bytes) -> None:
        if data[:1] == b"Q" and data[5:10] == b"BEGIN":
            link.in_transaction = True
            link.statements = 0
            return
        if COMMIT in data:
            link.in_transaction = False
            return
        if link.in_transaction and self._partition_after is not None:
            link.statements += 1
            if link.statements >= self._partition_after:
                self._partition_after = None
                self.blackhole()
                self.tripped.set()
