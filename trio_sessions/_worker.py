"""`python -m trio_sessions worker MODULE:DRAIN`: run an application's drain as a worker.

Settings come from flags, else from the environment (`TRIO_SESSIONS_STORE`,
`TRIO_SESSIONS_SCHEMA`, `TRIO_SESSIONS_MAX_ACTIVE`, `TRIO_SESSIONS_OWNER`,
`TRIO_SESSIONS_LOG_LEVEL`), else from `open_runtime`'s defaults. Logging goes to stderr at
the chosen level. Once the runtime is open the worker freezes its start-up heap
(`gc.freeze()`): full collections no longer walk the modules and classes start-up made.
`--metrics-bind` binds its port before the runtime opens: a port that cannot be served
fails the worker before it may claim a session.

Signals: the first SIGTERM or SIGINT is a graceful shutdown - the runtime's block is left,
which cancels the drains, waits until each has exited and only then expires its lease, so
any other runtime's next recovery pass resumes it at once (never while it still runs) - and
the worker exits 0. A second signal while that runs exits at once (130 after SIGINT, 1 after
SIGTERM), leaving the remaining leases to run out.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import attrs
import trio

from . import _metrics, _validate
from ._errors import StoreError
from ._model import RuntimeStatistics
from ._naming import (
    check_file_store,
    check_schema,
    check_sqlite_path,
    display_name,
    mask_password,
    secrets_of,
    store_kind,
)
from ._observe import MaskTracebacks
from ._runtime import Runtime, open_runtime, postgres_store

logger = logging.getLogger("trio_sessions.worker")
logger.addFilter(MaskTracebacks())

ENV_STORE = "TRIO_SESSIONS_STORE"
ENV_SCHEMA = "TRIO_SESSIONS_SCHEMA"
ENV_MAX_ACTIVE = "TRIO_SESSIONS_MAX_ACTIVE"
ENV_OWNER = "TRIO_SESSIONS_OWNER"
ENV_LOG_LEVEL = "TRIO_SESSIONS_LOG_LEVEL"
ENV_METRICS_BIND = "TRIO_SESSIONS_METRICS_BIND"

EXIT_OK = 0
EXIT_FAILED = 1  # the drain could not be loaded, or the runtime failed to open or crashed
EXIT_USAGE = 2
EXIT_SIGINT = 128 + signal.SIGINT
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class UsageError(Exception):
    """A setting is missing or malformed (exit 2)."""


class DrainLoadError(Exception):
    """`MODULE:DRAIN` does not name an async drain (exit 1)."""


@attrs.frozen
class WorkerSettings:
    """The worker's settings once flags and environment are merged and validated."""

    drain: str
    store: str
    max_active: int | None = None
    owner: str | None = None
    log_level: str = "INFO"
    lease: float | None = None
    recovery_interval: float | None = None
    schema: str | None = None
    metrics_bind: str | None = None


def add_parser(commands: Any) -> None:
    """Register the `worker` command on the CLI's subparsers."""
    parser = commands.add_parser(
        "worker",
        help="run MODULE:DRAIN as a long-lived worker until SIGTERM/SIGINT",
        description="Run an async drain as a worker. Settings not given as flags come from "
        f"{ENV_STORE}, {ENV_SCHEMA}, {ENV_MAX_ACTIVE}, {ENV_OWNER}, {ENV_LOG_LEVEL} and "
        f"{ENV_METRICS_BIND}. "
        "The first SIGTERM or SIGINT shuts down gracefully (each claim handed back once "
        "its drain exited, exit 0); a second one exits at once.",
    )
    parser.add_argument("drain", metavar="MODULE:DRAIN", help="the drain, e.g. myapp.agent:drain")
    parser.add_argument(
        "--store",
        metavar="PATH_OR_URL",
        help=f"SQLite path or postgresql:// URL (env {ENV_STORE})",
    )
    parser.add_argument(
        "--schema",
        metavar="S",
        help=f"PostgreSQL schema of the store (env {ENV_SCHEMA}; default public; URL only)",
    )
    parser.add_argument(
        "--max-active",
        metavar="N",
        help=f"sessions drained at once by this worker (env {ENV_MAX_ACTIVE}; default unlimited)",
    )
    parser.add_argument(
        "--owner", metavar="NAME", help=f"name prefixed to the owner id (env {ENV_OWNER})"
    )
    parser.add_argument(
        "--log-level",
        metavar="LEVEL",
        help=f"{', '.join(LOG_LEVELS)} (env {ENV_LOG_LEVEL}; default INFO)",
    )
    parser.add_argument("--lease", metavar="S", help="lease in seconds (default 30)")
    parser.add_argument(
        "--metrics-bind",
        metavar="HOST:PORT",
        help=f"serve Prometheus metrics at http://HOST:PORT/metrics (env {ENV_METRICS_BIND};"
        " needs the 'metrics' extra)",
    )
    parser.add_argument(
        "--recovery-interval",
        metavar="S",
        help="seconds between recovery passes: how soon a dead worker's sessions are taken"
        " over once their leases ran out (default 5)",
    )


def settings_from(args: argparse.Namespace, environ: Mapping[str, str]) -> WorkerSettings:
    """Merge flags over the environment and validate; `UsageError` with a clear message."""

    def pick(flag: str | None, env: str) -> str | None:
        if flag is not None:
            return flag
        return environ.get(env) or None

    store = pick(args.store, ENV_STORE)
    if not store:  # also `--store ''`: an unset shell variable
        raise UsageError(f"no store: pass --store PATH_OR_URL or set {ENV_STORE}")
    try:
        kind = store_kind(store)
        if kind == "sqlite":
            check_sqlite_path(store)
            check_file_store(store)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    schema = schema_setting(args.schema, environ)
    if schema is not None and kind != "postgres":
        raise UsageError("a schema needs a postgresql:// URL as the store")
    if schema is not None:
        try:
            check_schema(schema)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    max_active = pick(args.max_active, ENV_MAX_ACTIVE)
    owner = pick(args.owner, ENV_OWNER)
    if owner is not None:
        try:
            _validate.validate_id(owner, "owner")
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    log_level = (pick(args.log_level, ENV_LOG_LEVEL) or "INFO").upper()
    metrics_bind = pick(args.metrics_bind, ENV_METRICS_BIND)
    if metrics_bind is not None:
        try:
            _metrics.parse_bind(metrics_bind)
            _metrics.import_client()  # before the store is opened, not once it holds claims
        except ValueError as exc:
            raise UsageError(f"metrics-bind: {exc}") from None
        except RuntimeError as exc:
            raise UsageError(str(exc)) from None
    if log_level not in LOG_LEVELS:
        raise UsageError(f"log level must be one of {', '.join(LOG_LEVELS)}, got {log_level!r}")
    return WorkerSettings(
        drain=args.drain,
        store=store,
        max_active=None if max_active is None else _positive_int(max_active, "max-active"),
        owner=owner,
        log_level=log_level,
        lease=None if args.lease is None else _seconds(args.lease, "lease", _validate.lease),
        recovery_interval=None
        if args.recovery_interval is None
        else _seconds(args.recovery_interval, "recovery-interval"),
        schema=schema,
        metrics_bind=metrics_bind,
    )


def _positive_int(text: str, what: str) -> int:
    """A count as `open_runtime` takes it (`_validate.count`: 1 to 2**63-1)."""
    try:
        value = int(text)
    except ValueError:
        raise UsageError(f"{what} must be a whole number, got {text!r}") from None
    if value < 1:
        raise UsageError(f"{what} must be at least 1, got {value}")
    try:
        return _validate.count(value, what, 1)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _seconds(text: str, what: str, check: Callable[[float], float] | None = None) -> float:
    """A duration as `open_runtime` takes it (`_validate.seconds`, or `check`: a lease's)."""
    try:
        value = float(text)
    except ValueError:
        raise UsageError(f"{what} must be a number of seconds, got {text!r}") from None
    try:
        return _validate.seconds(value, what) if check is None else check(value)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def load_drain(spec: str) -> Any:
    """Import `MODULE:DRAIN` (DRAIN may be dotted) and check it is an async callable."""
    module_name, colon, attribute = spec.partition(":")
    if not colon or not module_name or not attribute:
        raise DrainLoadError(f"drain must be given as MODULE:DRAIN, got {spec!r}")
    try:
        target: Any = importlib.import_module(module_name)
    # Whatever the module raises while importing - also SystemExit, which would end the
    # worker with no word of why (KeyboardInterrupt stays the user's).
    except (Exception, SystemExit) as exc:
        reason = f"{type(exc).__name__}: {exc}"
        raise DrainLoadError(f"cannot import module {module_name!r}: {reason}") from exc
    for name in attribute.split("."):
        try:
            target = getattr(target, name)
        except AttributeError:
            raise DrainLoadError(
                f"{spec!r}: {module_name!r} has no attribute {attribute!r}"
            ) from None
    if not callable(target):
        raise DrainLoadError(f"{spec!r} is not callable: {type(target).__name__}")
    if not _validate.is_async_callable(target):
        raise DrainLoadError(f"{spec!r} must be an async function taking a DrainContext")
    return target


def run(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> int:
    """The `worker` command: returns the exit status (the second signal exits directly)."""
    try:
        settings = settings_from(args, os.environ if environ is None else environ)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    logging.basicConfig(level=settings.log_level, stream=sys.stderr, format=LOG_FORMAT)
    try:
        drain = load_drain(settings.drain)
    except DrainLoadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    return trio.run(serve, settings, drain)


def runtime_options(settings: WorkerSettings) -> dict[str, Any]:
    """`open_runtime`'s keyword arguments: only the ones the operator set, so the
    runtime's own defaults apply otherwise (`max_active` unlimited, `lease` 30 s,
    `recovery_interval` 5 s)."""
    options: dict[str, Any] = {"owner_id": settings.owner}
    if settings.max_active is not None:
        options["max_active"] = settings.max_active
    if settings.lease is not None:
        options["lease"] = settings.lease
    if settings.recovery_interval is not None:
        options["recovery_interval"] = settings.recovery_interval
    return options


def schema_setting(flag: str | None, environ: Mapping[str, str]) -> str | None:
    """The PostgreSQL schema a command that opens a store uses: `--schema` when given,
    else `TRIO_SESSIONS_SCHEMA` (unset or empty: None, the default `public`). One rule for
    the worker, the console and the CLI, so a probe looks where the processes work."""
    if flag is not None:
        return flag
    return environ.get(ENV_SCHEMA) or None


def store_of(settings: WorkerSettings) -> Any:
    """The store `open_runtime` gets (see `store_of_url`)."""
    return store_of_url(settings.store, settings.schema)


def store_of_url(store: str, schema: str | None) -> Any:
    """The path or URL itself, or a `PostgresStore` when a schema other than the default was
    chosen (`ValueError` for a store name of no accepted form, a bad schema name, or a
    schema without a URL)."""
    if store_kind(store) == "sqlite" and schema is not None:
        raise ValueError("a schema needs a postgresql:// URL as the store")
    if schema is None:
        return store
    check_schema(schema)
    return postgres_store(store, schema=schema)


async def serve(settings: WorkerSettings, drain: Any) -> int:
    """Run the runtime until the first signal, then leave its block; returns the status."""
    runtime_scope = trio.CancelScope()
    status = EXIT_OK
    opened: Runtime | None = None

    def read_metrics() -> tuple[str, RuntimeStatistics] | None:
        return None if opened is None else (opened.owner_id, opened.statistics())

    def on_open(runtime: Runtime) -> None:
        nonlocal opened
        opened = runtime

    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_watch_signals, signals, runtime_scope)
            # The port first: one taken is found before the runtime may claim sessions.
            if settings.metrics_bind is not None and not await _serve_metrics(
                nursery, settings.metrics_bind, read_metrics
            ):
                status = EXIT_FAILED
            else:
                with runtime_scope:
                    status = await _run_runtime(settings, drain, on_open=on_open)
            nursery.cancel_scope.cancel()
    if status == EXIT_OK and opened is None:
        # Stopped while `open_runtime` still waited (a liveness token held elsewhere): no
        # owner id was made, so none is named.
        logger.info("worker stopped: its runtime never opened")
    elif status == EXIT_OK and opened is not None:
        owner = opened.owner_id
        logger.info("worker stopped: owner %s", owner, extra={"owner_id": owner})
    return status


async def _run_runtime(
    settings: WorkerSettings, drain: Any, *, on_open: Callable[[Runtime], None]
) -> int:
    """Hold the runtime open until cancelled (the first signal); EXIT_FAILED when it fails."""
    try:
        async with open_runtime(store_of(settings), drain, **runtime_options(settings)) as runtime:
            on_open(runtime)
            # What start-up made (modules, classes, functions: most of the heap) stays for
            # the process's life: out of the collector's reach, full collections stop
            # walking it - with 1,000 sessions in flight they were about 15 % of the CPU
            # per session.
            gc.freeze()
            store = display_name(settings.store)
            if settings.schema is not None:
                # Workers on one server in different schemas drain different stores.
                store = f"{store} (schema {settings.schema})"
            logger.info(
                "worker started: owner %s, store %s",
                runtime.owner_id,
                store,
                extra={"owner_id": runtime.owner_id, "store": store},
            )
            await trio.sleep_forever()
    except Exception as exc:
        reason = mask_password(str(exc), secrets=secrets_of(settings.store))
        # A store the worker cannot use (unreachable, a newer schema, a bad path) says all
        # in its line; any other error is a bug, reported with its traceback.
        traceback = None if isinstance(exc, StoreError) else exc
        logger.error("worker failed: %s: %s", type(exc).__name__, reason, exc_info=traceback)
        return EXIT_FAILED


async def _serve_metrics(nursery: trio.Nursery, bind: str, read: _metrics.Reading) -> bool:
    """Start serving metrics; False (and the reason logged) when `bind` cannot be served."""
    try:
        host, port = await nursery.start(_metrics.serve_metrics, bind, read)
    except OSError as exc:
        logger.error(
            "cannot serve metrics on %s: %s", bind, exc, extra={"bind": bind, "error": str(exc)}
        )
        return False
    url = metrics_url(host, port)
    logger.info("worker metrics on %s", url, extra={"url": url})
    return True


def metrics_url(host: str, port: int) -> str:
    """Where a scrape reaches the worker's metrics (an IPv6 host in brackets)."""
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/metrics"


async def _watch_signals(signals: AsyncIterator[int], runtime_scope: trio.CancelScope) -> None:
    """First signal: leave the runtime's block. Second: exit the process at once."""
    async for signum in signals:
        name = signal.Signals(signum).name
        if not runtime_scope.cancel_called:
            logger.info("worker stopping on %s", name, extra={"signal": name})
            runtime_scope.cancel()
            continue
        logger.warning("worker exiting at once on a second %s", name, extra={"signal": name})
        sys.stderr.flush()
        # The runtime's shutdown is shielded; only leaving the process skips it. Leases the
        # shutdown did not expire yet run out on their own.
        os._exit(EXIT_SIGINT if signum == signal.SIGINT else EXIT_FAILED)
