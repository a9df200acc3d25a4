"""Prometheus metrics from `Runtime.statistics()`: the worker's `--metrics-bind` endpoint and
the console's `/metrics`.

One collector turns a statistics snapshot into metric families at scrape time, so a scrape
always shows one consistent snapshot and the runtime keeps no live counters for it. The
exposition format itself is `prometheus_client`'s (escaping, types, `# HELP` lines): the
`metrics` extra, imported only here.

Invariants kept here: a scrape never blocks the event loop for more than a snapshot (the
worker's HTTP server runs in its own thread and takes the snapshot on the trio thread);
nothing from the store's URL ever reaches a label.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import attrs
import trio

from ._model import RuntimeStatistics

if TYPE_CHECKING:
    from prometheus_client.registry import Collector

PREFIX = "trio_sessions"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# (field of RuntimeStatistics, metric name, kind, help)
RUNTIME_FIGURES = (
    ("active_sessions", "active_sessions", "gauge", "sessions this runtime holds or acquires"),
    ("owned_claims", "owned_claims", "gauge", "claims this runtime owns (live leases)"),
    ("drains_running", "drains_running", "gauge", "drain calls running now"),
    ("tasks", "tasks", "gauge", "tasks in the runtime's nursery"),
    (
        "heartbeat_transactions",
        "heartbeat_transactions",
        "counter",
        "heartbeat transactions (one per tick for all claims)",
    ),
    ("remote_signals", "remote_signals", "counter", "wakes and interrupts from other processes"),
)
STORE_FIGURES = (
    ("transactions", "store_transactions", "store write transactions"),
    ("handoffs", "store_handoffs", "store batches handed to a worker thread"),
    ("inline_runs", "store_inline_runs", "store batches run on the trio thread"),
    ("retries", "store_retries", "store transactions retried (locks, serialisation, faults)"),
    ("reconnects", "store_reconnects", "store connections re-opened"),
)


def import_client() -> Any:
    try:
        import prometheus_client
    except ImportError as exc:  # an optional extra
        raise RuntimeError(
            "metrics need prometheus_client: pip install 'trio-sessions[metrics]'"
        ) from exc
    return prometheus_client


# What a scrape reads: the runtime's owner id and one statistics snapshot, or None while
# there is no runtime to read (the worker binds its port before it opens the runtime).
Reading = Callable[[], "tuple[str, RuntimeStatistics] | None"]


def collector(read: Reading) -> Collector:
    """A collector that takes one snapshot per scrape (no families while `read()` is None)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    class RuntimeCollector:
        def collect(self) -> Iterator[Any]:
            reading = read()
            if reading is None:
                return
            owner_id, snapshot = reading
            labels = {"owner_id": owner_id, "backend": snapshot.store.backend}
            names, values = list(labels), list(labels.values())
            for field, name, kind, help_text in RUNTIME_FIGURES:
                family = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
                metric = family(f"{PREFIX}_{name}", help_text, labels=names)
                metric.add_metric(values, getattr(snapshot, field))
                yield metric
            recovery = CounterMetricFamily(
                f"{PREFIX}_recovery",
                "recovery outcomes since the runtime opened, by kind",
                labels=[*names, "kind"],
            )
            for kind, count in attrs.asdict(snapshot.recovery).items():
                recovery.add_metric([*values, kind], count)
            yield recovery
            for field, name, help_text in STORE_FIGURES:
                metric = CounterMetricFamily(f"{PREFIX}_{name}", help_text, labels=names)
                metric.add_metric(values, getattr(snapshot.store, field))
                yield metric

    return RuntimeCollector()


def render(statistics: Callable[[], RuntimeStatistics], *, owner_id: str) -> bytes:
    """The Prometheus text format of one snapshot (the console's `/metrics`)."""
    client = import_client()
    registry = client.CollectorRegistry(auto_describe=False)
    registry.register(collector(lambda: (owner_id, statistics())))
    return bytes(client.generate_latest(registry))


def parse_bind(bind: str) -> tuple[str, int]:
    """`HOST:PORT` (`[::1]:PORT` for IPv6) -> (host, port); `ValueError` naming the value."""
    host, sep, port = bind.rpartition(":")
    # ASCII digits, at most 5: `isdigit` also counts a superscript, which `int` refuses.
    digits = port.isascii() and port.isdigit() and len(port) <= 5
    if not sep or not host or not digits or not 0 <= int(port) <= 65535:
        raise ValueError(f"expected HOST:PORT, got {bind!r}")
    return host.strip("[]"), int(port)


async def serve_metrics(
    bind: str,
    read: Reading,
    *,
    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve `/metrics` on `bind` until cancelled; `task_status.started((host, port))` once
    the port is bound (`OSError` before that when it cannot be).

    prometheus_client's threaded HTTP server answers scrapes; each scrape calls `read` on the
    trio thread (`trio.from_thread.run_sync`), so the runtime is only ever read there.
    """
    client = import_client()
    host, port = parse_bind(bind)
    token = trio.lowlevel.current_trio_token()

    def read_on_the_trio_thread() -> tuple[str, RuntimeStatistics] | None:
        return trio.from_thread.run_sync(read, trio_token=token)

    registry = client.CollectorRegistry(auto_describe=False)
    registry.register(collector(read_on_the_trio_thread))
    server, thread = client.start_http_server(port, addr=host, registry=registry)
    try:
        task_status.started((host, server.server_port))
        await trio.sleep_forever()
    finally:
        # Bounded: the server's loop notices a shutdown within its 0.5 s poll.
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(server.shutdown)
        server.server_close()
        thread.join(timeout=1.0)
