"""A real owner process killed with SIGKILL mid-drain, on a real SQLite file: after its lease
expires another runtime resumes the session exactly once and fails the dead tool call.
Real time, bounded (a 1 s lease)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import trio
from helpers import Raw

import trio_sessions
from trio_sessions import DrainContext, ToolPart

LEASE = 1.0

WORKER = """
import sys, trio, trio_sessions

async def drain(ctx):
    await ctx.take_inputs()
    writer = await ctx.begin_assistant()
    await writer.start_tool("call-1", "slow_search", {"q": "trio"})
    print("IN_TOOL", ctx.execution_id, flush=True)
    await trio.sleep_forever()

async def main(path):
    async with trio_sessions.open_runtime(path, drain, lease=LEASE) as runtime:
        await runtime.submit("chat", {"text": "find trio"})
        await trio.sleep_forever()

trio.run(main, sys.argv[1])
""".replace("LEASE", repr(LEASE))


def start_worker(path: Path, tmp_path: Path) -> tuple[subprocess.Popen[str], str]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    process = subprocess.Popen(
        [sys.executable, str(script), str(path)], stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None
    line = process.stdout.readline()  # blocks until the drain is inside its tool call
    assert line.startswith("IN_TOOL"), line
    return process, line.split()[1]


@pytest.mark.slow
def test_sigkilled_owner_is_resumed_once(tmp_path: Path) -> None:
    """SIGKILL mid tool call: the claim survives the process; once the lease expires the
    next runtime resumes it once with resumed=True, and the dead tool call is failed."""
    path = tmp_path / "crash.db"
    process, dead_execution = start_worker(path, tmp_path)
    with process:  # closes the pipe
        process.send_signal(signal.SIGKILL)
        assert process.wait(timeout=10) == -signal.SIGKILL
    raw = Raw(path)
    claim = raw.claim("chat")
    assert claim is not None and claim[0] == dead_execution and claim[2] == "running"

    resumed: list[tuple[bool, int, str]] = []

    async def resume(ctx: DrainContext) -> None:
        resumed.append((ctx.resumed, ctx.attempt, ctx.execution_id))
        writer = await ctx.begin_assistant()
        await writer.append_text("resumed")
        await writer.finish()

    async def main() -> None:
        with trio.fail_after(20):
            async with trio_sessions.open_runtime(
                path, resume, lease=LEASE, recovery_interval=0.2
            ) as runtime:
                while not resumed:
                    await trio.sleep(0.05)
                await runtime.wait_idle("chat")
                await trio.sleep(3 * 0.2)  # more passes: none may resume it again
                messages = await runtime.transcript("chat")
        dead = next(
            m for m in messages if m.execution_id == dead_execution and m.role == "assistant"
        )
        [tool] = dead.data.parts
        assert isinstance(tool, ToolPart)
        assert (tool.status, tool.error) == ("error", "interrupted: owner lost")
        assert dead.data.finished

    trio.run(main)
    assert len(resumed) == 1
    was_resumed, attempt, execution_id = resumed[0]
    assert was_resumed and attempt == 1 and execution_id != dead_execution
    assert raw.claim("chat") is None
    assert raw.one("SELECT wake_attempts FROM session WHERE id = 'chat'") == (0,)


@pytest.mark.slow
def test_close_does_not_wait_for_another_process_lock(tmp_path: Path) -> None:
    """Closing while another process holds the write lock finishes within the shutdown
    grace: expiring leases is best effort and never waits for that lock (the leases run
    out instead)."""
    import sqlite3

    path = tmp_path / "locked.db"
    entered = trio.Event()

    async def drain(ctx: DrainContext) -> None:
        entered.set()
        await trio.sleep_forever()

    async def main() -> None:
        async with trio_sessions.open_runtime(path, drain, lease=LEASE) as runtime:
            await runtime.wake("s")
            await entered.wait()
            other = sqlite3.connect(path, isolation_level=None)
            other.execute("BEGIN IMMEDIATE")  # another process's long write transaction
            closing_started = trio.current_time()
        closed_after = trio.current_time() - closing_started
        other.execute("ROLLBACK")
        other.close()
        assert closed_after < 2.0  # SHUTDOWN_GRACE is 5 s; lock patience is 120 s

    trio.run(main)
    claim = Raw(path).claim("s")
    assert claim is not None and claim[2] == "running"  # kept; its lease runs out
