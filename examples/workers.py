"""Several worker processes share one SQLite file; one producer process feeds them.

Run it: `python examples/workers.py [--workers 3] [--orders 12]`. It stops by itself once
every order is answered, and exits non-zero if that does not happen within a deadline.

* The producer (this process) runs no drains: it only records inputs and their wakes.
* Each worker process opens a runtime on the same file. Its recovery task starts, every
  `recovery_interval`, the sessions whose doorbell is set but which nobody claims; the
  claim guarantees that exactly one worker drains a session at a time, and inputs arriving
  while a worker drains a session coalesce into that worker's next drain iteration.
* A worker stops when its standard input closes: the producer closes it when done (and the
  operating system closes it if the producer dies), so no worker outlives the example.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio

import trio_sessions
from trio_sessions import _store

SESSIONS = ("kitchen", "bar", "terrace", "delivery")
DEADLINE = 30.0  # seconds for the whole run, workers' start-up included


# ---------------------------------------------------------------------------------------------
# Worker processes


async def work(name: str, db: Path) -> None:
    async def pack_orders(ctx: trio_sessions.DrainContext) -> None:
        inputs = await ctx.take_inputs()
        if not inputs:
            return
        orders = [item.payload["order"] for item in inputs]
        reply = await ctx.begin_assistant()
        await reply.start_tool("pack", "pack_orders", {"orders": orders})
        await trio.sleep(0.1 * len(orders))  # the work itself
        await reply.settle_tool("pack", {"packed": len(orders)})
        await reply.append_text(f"{name} packed {orders}")
        await reply.finish()
        print(f"{name}: {ctx.session_id:<8} packed order(s) {orders}", flush=True)

    async with trio_sessions.open_runtime(
        db, pack_orders, owner_id=name, lease=5.0, recovery_interval=0.2
    ):
        # Serve until the producer closes our standard input.
        await trio.to_thread.run_sync(sys.stdin.read, abandon_on_cancel=True)


def run_worker(name: str, db: Path) -> None:
    try:
        trio.run(work, name, db)
    except* KeyboardInterrupt:
        pass  # Ctrl-C reaches every process of the group; the producer reports


# ---------------------------------------------------------------------------------------------
# The producer


def submit_without_draining(conn: sqlite3.Connection, session_id: str, order: int) -> None:
    """Record an input and ring the session's doorbell, without draining it here.

    trio_sessions has no public submit-only handle yet: this runs the very transaction
    `Runtime.submit` runs, minus the local drain `Runtime.submit` would start.
    """
    payload = json.dumps({"order": order})
    _store.run_op(conn, time.time, _store.submit, session_id, payload, _store.new_id())


def all_answered(conn: sqlite3.Connection, orders: int) -> bool:
    """Every order taken, no claim held, no doorbell set: the workers are done."""
    taken, claims, doorbells = conn.execute(
        "SELECT (SELECT COUNT(DISTINCT input_id) FROM session_message WHERE role = 'user'),"
        " (SELECT COUNT(*) FROM session_execution),"
        " (SELECT COUNT(*) FROM session WHERE time_woken IS NOT NULL)"
    ).fetchone()
    return bool(taken == orders and claims == 0 and doorbells == 0)


def packed_by(conn: sqlite3.Connection) -> dict[str, int]:
    """How many orders each worker packed, read back from the transcripts."""
    counts: dict[str, int] = {}
    for (data,) in conn.execute("SELECT data FROM session_message WHERE role = 'assistant'"):
        message = json.loads(data)
        pack = next(p for p in message["parts"] if p["type"] == "tool")
        worker = message["parts"][-1]["text"].split()[0]
        counts[worker] = counts.get(worker, 0) + pack["output"]["packed"]
    return dict(sorted(counts.items()))


def produce(db: Path, workers: int, orders: int) -> bool:
    conn = _store.connect(db)  # creates the schema
    command = [sys.executable, __file__, "--worker"]
    processes = [
        subprocess.Popen([*command, f"worker-{n}", str(db)], stdin=subprocess.PIPE)
        for n in range(1, workers + 1)
    ]
    deadline = time.monotonic() + DEADLINE
    try:
        for order in range(1, orders + 1):
            session_id = SESSIONS[order % len(SESSIONS)]
            submit_without_draining(conn, session_id, order)
            print(f"producer: order {order} -> {session_id}", flush=True)
            time.sleep(0.15)  # a trickle, so every worker gets a share
        while not (done := all_answered(conn, orders)) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        for process in processes:
            assert process.stdin is not None
            process.stdin.close()
        for process in processes:
            process.wait(timeout=DEADLINE)
    counts = packed_by(conn)
    conn.close()
    print(f"producer: {sum(counts.values())}/{orders} orders packed, by {counts}")
    return done and sum(counts.values()) == orders


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--orders", type=int, default=12)
    parser.add_argument("--worker", nargs=2, metavar=("NAME", "DB"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        run_worker(args.worker[0], Path(args.worker[1]))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        return 0 if produce(Path(tmp) / "orders.db", args.workers, args.orders) else 1


if __name__ == "__main__":
    sys.exit(main())
