"""Round trips to PostgreSQL, counted on the wire (bench keys `pg_round_trips_per_cycle` and
`pg_turn_round_trips`; the test suite's helper of the same name).

`RoundTripProxy` is a TCP relay between the library and the server that counts, per
connection, every time the client starts sending after the server has answered (or for the
first time): one wait for the server, whatever the client's driver packs into its messages.
Bytes the server sends unasked (a notification to a listener) start no round trip. So the
count is protocol round trips on every connection the runtime opens - writer, listener and
change reads alike - not statements, and it does not trust the library's own bookkeeping.

The relay adds latency, so the bench counts in a short run of its own, never in a timed one.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import psycopg.conninfo
import trio

from .. import _liveness, _loops
from .._postgres import PostgresStore
from .._runtime import DrainContext, Runtime, open_runtime

TURN_APPENDS = 40
PAYLOAD = {"text": "hello"}
QUIET = 3600.0


class RoundTripProxy:
    """A counting TCP relay to `(host, port)`, on 127.0.0.1 (a thread; `close()` stops it)."""

    def __init__(self, host: str, port: int) -> None:
        self._target = (host, port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._round_trips = 0
        self._stop = threading.Event()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._thread = threading.Thread(target=self._serve, name="round-trip-proxy", daemon=True)
        self._thread.start()

    @property
    def round_trips(self) -> int:
        with self._lock:
            return self._round_trips

    def _serve(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._selector.select(timeout=0.05):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                if sock is self._listener:
                    client, _ = self._listener.accept()
                    server = socket.create_connection(self._target)
                    for end in (client, server):
                        end.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    # The state is shared by both directions of one connection.
                    state = [True]  # the client's first bytes start a round trip
                    self._selector.register(client, selectors.EVENT_READ, (server, state, True))
                    self._selector.register(server, selectors.EVENT_READ, (client, state, False))
                    continue
                peer, state, from_client = key.data
                try:
                    data = sock.recv(65536)
                except OSError:
                    data = b""
                if not data:
                    for end in (sock, peer):
                        with contextlib.suppress(KeyError, ValueError):
                            self._selector.unregister(end)
                        end.close()
                    continue
                if from_client:
                    if state[0]:
                        with self._lock:
                            self._round_trips += 1
                    state[0] = False
                else:
                    state[0] = True
                with contextlib.suppress(OSError):
                    peer.sendall(data)
        for key in list(self._selector.get_map().values()):
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            sock.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


@contextlib.contextmanager
def counting_url(url: str) -> Iterator[tuple[str, RoundTripProxy]]:
    """`url` rewritten to go through a `RoundTripProxy` (TCP servers only)."""
    given = psycopg.conninfo.conninfo_to_dict(url)
    host = str(given.get("host") or "127.0.0.1")
    port = int(str(given.get("port") or 5432))
    proxy = RoundTripProxy(host, port)
    try:
        yield psycopg.conninfo.make_conninfo(url, host="127.0.0.1", port=proxy.port), proxy
    finally:
        proxy.close()


@contextlib.asynccontextmanager
async def counted_runtime(
    url: str, schema: str, drain: Any
) -> AsyncIterator[tuple[Runtime, RoundTripProxy]]:
    """A runtime on `schema` whose every connection is counted; quiet background work:
    heartbeats, recovery passes, the look at other owners' liveness tokens (one small
    query every `_liveness.LIVENESS_POLL`) and the change scan's fallback poll (every
    `_loops.CHANGE_FALLBACK_POLL`) - costs of idle time, not of an operation - all wait an
    hour, so the count is the operations' own."""
    with counting_url(url) as (proxied, proxy):
        store = PostgresStore(proxied, schema=schema)
        poll, _liveness.LIVENESS_POLL = _liveness.LIVENESS_POLL, QUIET
        fallback, _loops.CHANGE_FALLBACK_POLL = _loops.CHANGE_FALLBACK_POLL, QUIET
        try:
            async with open_runtime(
                store, drain, lease=QUIET, recovery_interval=QUIET, recovery_batch=100
            ) as runtime:
                _liveness.LIVENESS_POLL = poll  # read when the token was taken
                yield runtime, proxy
        finally:
            _liveness.LIVENESS_POLL = poll
            _loops.CHANGE_FALLBACK_POLL = fallback


async def _settle() -> None:
    # Let the runtime's own change reads (its listener hears its own notifications) land.
    await trio.sleep(0.2)


async def round_trips_per_cycle(url: str, schema: str, cycles: int = 20) -> float:
    """Round trips per sequential cycle (submit -> acquire -> no-op drain -> release)."""

    async def noop(ctx: DrainContext) -> None:
        pass

    async with counted_runtime(url, schema, noop) as (runtime, proxy):
        for n in range(3):  # warm-up: prepared statements, first reads
            await runtime.submit(f"warm-{n}", PAYLOAD)
            await runtime.wait_idle(f"warm-{n}")
        await _settle()
        before = proxy.round_trips
        for n in range(cycles):
            await runtime.submit(f"cycle-{n}", PAYLOAD)
            await runtime.wait_idle(f"cycle-{n}")
        await _settle()
        return (proxy.round_trips - before) / cycles


async def turn_round_trips(url: str, schema: str, turns: int = 3) -> float:
    """Round trips per chat turn inside a drain: take the inputs, begin an assistant
    message, append `TURN_APPENDS` words, finish it (and whatever the runtime's own change
    reads add meanwhile); the claim's submit and release are the cycle's."""
    counts: list[int] = []
    proxy_box: list[RoundTripProxy] = []

    async def turn(ctx: DrainContext) -> None:
        if not ctx.session_id.startswith("turn-"):
            await ctx.take_inputs()
            return
        await _settle()
        before = proxy_box[0].round_trips
        await ctx.take_inputs()
        writer = await ctx.begin_assistant()
        for n in range(TURN_APPENDS):
            await writer.append_text(f"word{n} ")
        await writer.finish()
        await _settle()
        counts.append(proxy_box[0].round_trips - before)

    async with counted_runtime(url, schema, turn) as (runtime, proxy):
        proxy_box.append(proxy)
        for n in range(2):
            await runtime.submit(f"warm-{n}", PAYLOAD)
            await runtime.wait_idle(f"warm-{n}")
        for n in range(turns + 1):  # the first turn warms up
            await runtime.submit(f"turn-{n}", PAYLOAD)
            await runtime.wait_idle(f"turn-{n}")
    if len(counts) != turns + 1:
        raise RuntimeError(f"{turns + 1 - len(counts)} chat turns failed (see the log)")
    return sum(counts[1:]) / turns
