"""Several worker processes share one SQLite file; one producer process feeds them.

Run it: `python examples/workers.py [--workers 3] [--orders 12]`. It stops by itself once
every order is answered, and exits non-zero if that does not happen within a deadline.

* The producer (this process) opens its runtime with `drain=None`: it only records inputs
  and their wakes, durably, and never claims a session.
* Each worker process opens a runtime on the same file. It notices the producer's commits
  within milliseconds and starts the sessions whose doorbell is set but which nobody
  claims; the claim guarantees that exactly one worker drains a session at a time, and
  inputs arriving while a worker drains a session coalesce into that worker's next drain
  iteration. A worker that dies mid-answer is resumed by another about a second later: the
  drain finds the orders still owed in the transcript (`trio_sessions.unanswered`).
* A worker stops when its standard input closes: the producer closes it when done or
  interrupted (and the operating system closes it if the producer dies), so no worker
  outlives the example. Workers run in process groups of their own, so Ctrl-C reaches only
  the producer: a worker interrupted while its interpreter starts would die loudly. The
  producer turns Ctrl-C into a cancellation of its run (`trio.open_signal_receiver`), so
  no KeyboardInterrupt lands halfway through the runtime's own code, and it still stops
  its workers and waits for them before their file is removed.
"""

from __future__ import annotations

import argparse
import json
import signal
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path

import trio

import trio_sessions

SESSIONS = ("kitchen", "bar", "terrace", "delivery")
DEADLINE = 30.0  # seconds for the whole run, workers' start-up included


def say(line: str) -> None:
    """Print a line in one write: the producer and its workers share one standard output,
    and print() writes the text and its newline apart - with unbuffered output
    (PYTHONUNBUFFERED=1) another process's line could land in between."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


# ---------------------------------------------------------------------------------------------
# Worker processes


async def work(name: str, db: Path) -> None:
    async def pack_orders(ctx: trio_sessions.DrainContext) -> None:
        await ctx.take_inputs()  # pending inputs become user messages, atomically
        # From the transcript, not the inputs: a drain resumed after its worker died finds
        # there the orders the dead worker had taken but not packed.
        questions = trio_sessions.unanswered(await ctx.transcript())
        if not questions:
            return
        orders = [message.data["order"] for message in questions]
        reply = await ctx.begin_assistant()
        await reply.start_tool("pack", "pack_orders", {"orders": orders})
        await trio.sleep(0.1 * len(orders))  # the work itself
        await reply.settle_tool("pack", {"packed": len(orders)})
        await reply.append_text(f"{name} packed {orders}")
        await reply.finish()
        say(f"{name}: {ctx.session_id:<8} packed order(s) {orders}")

    async with trio_sessions.open_runtime(
        db, pack_orders, owner_id=name, lease=5.0, recovery_interval=0.2
    ):
        # Serve until the producer closes our standard input.
        await trio.to_thread.run_sync(sys.stdin.read, abandon_on_cancel=True)


# ---------------------------------------------------------------------------------------------
# The producer


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
        if message["error"] is not None:
            continue  # cut off (a worker died): its orders were packed by a resumed drain
        pack = next(p for p in message["parts"] if p["type"] == "tool")
        worker = message["parts"][-1]["text"].split()[0]
        counts[worker] = counts.get(worker, 0) + pack["output"]["packed"]
    return dict(sorted(counts.items()))


async def produce(db: Path, workers: int, orders: int) -> bool:
    # drain=None: a producer records inputs and their wakes durably but never drains.
    async with trio_sessions.open_runtime(db, None) as producer:  # creates the schema
        command = [sys.executable, __file__, "--worker"]
        processes = [
            await trio.lowlevel.open_process(
                [*command, f"worker-{n}", str(db)], stdin=subprocess.PIPE, process_group=0
            )
            for n in range(1, workers + 1)
        ]
        conn = sqlite3.connect(db)
        done = False
        try:
            with trio.move_on_after(DEADLINE):
                for order in range(1, orders + 1):
                    session_id = SESSIONS[order % len(SESSIONS)]
                    await producer.submit(session_id, {"order": order})
                    say(f"producer: order {order} -> {session_id}")
                    await trio.sleep(0.15)  # a trickle, so every worker gets a share
                # The workers are other processes: poll the shared file for their progress.
                while not (done := all_answered(conn, orders)):  # noqa: ASYNC110
                    await trio.sleep(0.1)
        finally:
            # Shielded: after a Ctrl-C this body is cancelled, yet the workers must still be
            # told to stop and be waited for, or the temporary directory goes away under a
            # worker still opening the file (a traceback from it).
            with trio.CancelScope(shield=True), trio.fail_after(DEADLINE):
                for process in processes:
                    assert process.stdin is not None
                    await process.stdin.aclose()
                for process in processes:
                    await process.wait()
        counts = packed_by(conn)
        conn.close()
    say(f"producer: {sum(counts.values())}/{orders} orders packed, by {counts}")
    return done and sum(counts.values()) == orders


async def produce_until_interrupted(db: Path, workers: int, orders: int) -> bool | None:
    """`produce`'s result, or None once Ctrl-C arrived: SIGINT cancels the run."""
    result: bool | None = None
    with trio.open_signal_receiver(signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:

            async def interrupt() -> None:
                async for _ in signals:
                    nursery.cancel_scope.cancel()

            async def run() -> None:
                nonlocal result
                result = await produce(db, workers, orders)
                nursery.cancel_scope.cancel()

            nursery.start_soon(interrupt)
            nursery.start_soon(run)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--orders", type=int, default=12)
    parser.add_argument("--worker", nargs=2, metavar=("NAME", "DB"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    for flag, value in (("--workers", args.workers), ("--orders", args.orders)):
        if value < 1:
            parser.error(f"{flag} must be at least 1, not {value}")
    if args.worker is not None:
        trio.run(work, args.worker[0], Path(args.worker[1]))
        return 0
    ok: bool | None = False
    with tempfile.TemporaryDirectory() as tmp:
        try:
            ok = trio.run(
                produce_until_interrupted, Path(tmp) / "orders.db", args.workers, args.orders
            )
        except* KeyboardInterrupt:
            ok = None  # Ctrl-C before the run could take it over: no worker started yet
    if ok is None:
        print("producer: interrupted", file=sys.stderr)
        return 130
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
