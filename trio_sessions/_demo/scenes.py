"""The demo's five scenes, what they observe, and the raw SQL they read and write.

Responsibility: each scene drives the runtime through one behaviour and prints what happens
(`SCENES`, in order); `Facts` records what the scenes observed that the final database
cannot show by itself, for the checks. Invariants: a scene waits on the agent's events and
the runtime's `wait_idle`, never on a sleep; the database is read as an operator would,
on a separate connection off the event loop, never through the runtime under test; the
only raw write is scene 5's corrupt record, committed in one transaction.
"""

from __future__ import annotations

import functools
import json
import sqlite3
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import trio

# Only public names: the demo is also a worked example of the API.
from .. import Claim, Runtime
from .agent import ScriptedAgent, ask, tool
from .output import Clock, Log, describe

# Scene 4's worker: a lease long enough that a takeover before it ends is owner liveness.
WORKER_LEASE = 10.0
TAKEOVER_GRACE = 0.5  # open_runtime's default


# ---------------------------------------------------------------------------------------------
# Reading the database as an operator would (separate connection, off the event loop)


def _query(db: Path, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
    conn = sqlite3.connect(db)
    try:
        return conn.execute(sql, params).fetchall()
    finally:
        conn.close()


async def query(db: Path, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
    return await trio.to_thread.run_sync(_query, db, sql, params)


async def claim_row(db: Path, session_id: str) -> tuple[Any, ...] | None:
    rows = await query(
        db,
        "SELECT id, owner_id, phase, expires_at, time_created FROM session_execution"
        " WHERE session_id = ?",
        (session_id,),
    )
    return rows[0] if rows else None


# ---------------------------------------------------------------------------------------------
# Scenes


@attrs.define
class Facts:
    """What the scenes observed that the final database cannot show by itself."""

    wakes_during_turn: int = -1
    interrupt_accepted: bool = False
    worker_owner: str | None = None
    worker_claim_owner: str | None = None
    worker_exit: int | None = None
    worker_lease_end_ms: int | None = None
    worker_killed_ms: int | None = None
    takeover_owner: str | None = None
    takeover_ms: int | None = None
    demo_owner: str = ""


@attrs.define(eq=False)
class Stage:
    """Everything a scene needs."""

    runtime: Runtime
    agent: ScriptedAgent
    clock: Clock
    db: Path
    facts: Facts

    def log(self, who: str, text: str) -> None:
        self.clock.log(who, text)

    async def show(self, session_id: str) -> None:
        for message in await self.runtime.transcript(session_id):
            self.log(session_id, "  " + describe(message))


async def scene_normal_turn(stage: Stage) -> None:
    stage.clock.scene("1. A normal turn with tool calls")
    question = ask(
        "What's the weather in Paris and Rome?",
        tool("weather", city="Paris"),
        tool("weather", city="Rome"),
        reply="Paris is sunny at 21 C; Rome is clear at 26 C.",
    )
    stage.log("chat-1", f"user: {question['text']!r}")
    await stage.runtime.submit("chat-1", question)
    await stage.runtime.wait_idle("chat-1")
    stage.log("chat-1", "transcript:")
    await stage.show("chat-1")


async def scene_coalescing(stage: Stage) -> None:
    stage.clock.scene("2. Wakes during a turn coalesce into one more turn")
    runtime, agent = stage.runtime, stage.agent
    tool_started = agent.expect("tool", "chat-2")
    await runtime.submit(
        "chat-2", ask("Find notes on trio.", tool("search", 0.8, query="trio"), reply="Found them.")
    )
    await tool_started.wait()
    for text in ("Also on SQLite?", "And on leases?", "Thanks!"):
        stage.log("chat-2", f"user (while the agent works): {text!r}")
        await runtime.submit("chat-2", ask(text, reply=f"Noted: {text}"))
    for _ in range(2):
        stage.log("chat-2", "wake (no new input)")
        await runtime.wake("chat-2")
    rows = await query(stage.db, "SELECT wakes FROM session WHERE id = 'chat-2'")
    stage.facts.wakes_during_turn = int(rows[0][0])
    stage.log("chat-2", f"database: one doorbell, {rows[0][0]} wakes coalesced into it")
    await runtime.wait_idle("chat-2")
    stage.log("chat-2", "transcript:")
    await stage.show("chat-2")


async def scene_interrupt(stage: Stage) -> None:
    stage.clock.scene("3. A user interrupt mid tool call, with more input queued")
    runtime, agent = stage.runtime, stage.agent
    tool_started = agent.expect("tool", "chat-3")
    await runtime.submit(
        "chat-3",
        ask(
            "Research every trio release ever.",
            tool("search", 30.0, query="all trio releases"),
            reply="Here is the full history.",
        ),
    )
    await tool_started.wait()
    stage.log("chat-3", "user (queued): 'Never mind - just the latest release.'")
    await runtime.submit(
        "chat-3",
        ask(
            "Never mind - just the latest release.",
            tool("search", query="latest trio release"),
            reply="The latest release is listed above.",
        ),
    )
    stage.facts.interrupt_accepted = await runtime.interrupt("chat-3")
    stage.log("chat-3", f"user: INTERRUPT (accepted: {stage.facts.interrupt_accepted})")
    await runtime.wait_idle("chat-3")
    stage.log("chat-3", "transcript:")
    await stage.show("chat-3")


async def scene_worker_crash(stage: Stage) -> None:
    stage.clock.scene("4. A worker process is SIGKILLed mid-turn; another owner recovers")
    turn_ended = stage.agent.expect("turn", "chat-4")
    command = [
        *(sys.executable, "-m", "trio_sessions.demo", "--worker"),
        *("--db", str(stage.db), "--session", "chat-4", "--lease", str(WORKER_LEASE)),
    ]
    # A process group of its own: a terminal's Ctrl-C reaches only the demo, which stops
    # the worker; a worker interrupted while its interpreter starts would die loudly.
    run_worker = functools.partial(
        trio.run_process, command, stdout=subprocess.PIPE, check=False, process_group=0
    )
    async with trio.open_nursery() as nursery:
        process: trio.Process = await nursery.start(run_worker)
        stage.log("demo", f"started worker process pid {process.pid}")
        ready = trio.Event()
        nursery.start_soon(_relay_worker, stage, process, ready)
        await ready.wait()
        if stage.facts.worker_owner is None:
            stage.log("demo", "the worker process ended before its turn began")
            return
        await _kill_worker(stage, process)
    stage.log(
        "chat-4",
        f"its liveness token went with it: after the {TAKEOVER_GRACE} s grace another owner"
        f" may take over (its {WORKER_LEASE} s lease would be much longer)",
    )
    await turn_ended.wait()
    await stage.runtime.wait_idle("chat-4")
    stage.log("chat-4", "transcript:")
    await stage.show("chat-4")


async def _relay_worker(stage: Stage, process: trio.Process, ready: trio.Event) -> None:
    """Print the worker's lines with our timestamps; set `ready` once it is mid-tool-call
    (or gone: then `facts.worker_owner` stays None)."""
    assert process.stdout is not None
    buffer = b""
    async for chunk in process.stdout:
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            text = line.decode(errors="replace")
            if text.startswith("READY "):
                stage.facts.worker_owner = text.split(" ", 1)[1]
                ready.set()
            else:
                who, _, said = text.partition("|")
                stage.log(who, f"[worker pid {process.pid}] {said}")
    ready.set()


async def _kill_worker(stage: Stage, process: trio.Process) -> None:
    claim = await claim_row(stage.db, "chat-4")
    assert claim is not None, "the worker reported a running tool call without a claim"
    stage.facts.worker_claim_owner = claim[1]
    stage.log("chat-4", f"database: claimed by {claim[1]}, phase {claim[2]}")
    stage.facts.worker_killed_ms = int(time.time() * 1000)
    process.kill()  # SIGKILL: no cleanup, no last write; the claim stays behind
    stage.facts.worker_exit = await process.wait()
    stage.log("demo", f"worker pid {process.pid} KILLED (exit status {process.returncode})")
    claim = await claim_row(stage.db, "chat-4")
    if claim is not None:
        stage.facts.worker_lease_end_ms = claim[3]
        left = claim[3] / 1000 - time.time()
        stage.log(
            "chat-4", f"database: the dead worker's claim remains; lease ends in {left:.1f} s"
        )


async def scene_quarantine(stage: Stage) -> None:
    stage.clock.scene("5. A corrupt record is quarantined while other sessions carry on")
    runtime, agent = stage.runtime, stage.agent
    asked = agent.expect("tool", "chat-6")
    booking = ask(
        "Book a table at Chez Trio.",
        tool("ask_user", question="Book Chez Trio for two at 8?"),
        tool("book_table", place="Chez Trio"),
        reply="Booked.",
    )
    await runtime.submit("chat-6", booking)
    await asked.wait()
    execution = await trio.to_thread.run_sync(write_corrupt_session, stage.db)
    stage.log("chat-5", f"raw SQL: a dead owner's expired claim {execution} with a malformed")
    stage.log("chat-5", "         assistant message (unknown tool status, 'finished' not a bool)")
    await runtime.submit(
        "chat-7", ask("Weather in Oslo?", tool("weather", city="Oslo"), reply="Oslo: rain, 9 C.")
    )
    # When this pass returns the row has been examined, by this pass or the periodic one.
    await runtime.recover_once()
    await _show_quarantine(stage, execution)
    stage.log("chat-6", "user answers the agent's question: yes")
    agent.approve("chat-6")
    await runtime.wait_idle("chat-7")
    await runtime.wait_idle("chat-6")
    for session_id in ("chat-6", "chat-7"):
        stage.log(session_id, "transcript:")
        await stage.show(session_id)


async def _show_quarantine(stage: Stage, execution: str) -> None:
    rows = await query(
        stage.db,
        "SELECT recovery_error FROM session_recovery WHERE execution_id = ?"
        " AND recovery_error IS NOT NULL",
        (execution,),
    )
    if not rows:
        stage.log("chat-5", "NOT quarantined (the summary will fail)")
        return
    stage.log("chat-5", "QUARANTINED; recovery skips it until an operator acts:")
    for reason in str(rows[0][0]).split("; "):
        stage.log("chat-5", f"  {reason}")
    stage.log("chat-5", "(see: python -m trio_sessions quarantine list DB)")


GHOST_OWNER = "ghost@lost-host:4242:0badc0ffee00"
GHOST_EXECUTION = "ghost-execution-0001"
MALFORMED = json.dumps(
    {
        "parts": [
            {
                **{"type": "tool", "call_id": "call-0", "name": "search"},
                **{"input": {"query": "x"}, "status": "exploded", "output": None, "error": None},
            }
        ],
        "finished": "no",
        "error": None,
    }
)


def write_corrupt_session(db: Path) -> str:
    """What a buggy old owner might have left: an expired claim whose assistant message
    does not decode. Written with raw SQL, in one transaction."""
    now = int(time.time() * 1000)
    conn = sqlite3.connect(db, isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("INSERT INTO session(id, time_created) VALUES ('chat-5', ?)", (now - 60_000,))
        conn.execute(
            "INSERT INTO session_message(id, session_id, role, seq, data, time_created,"
            " time_updated) VALUES ('ghost-user', 'chat-5', 'user', 1, ?, ?, ?)",
            (json.dumps({"text": "Summarise my inbox."}), now - 60_000, now - 60_000),
        )
        conn.execute(
            "INSERT INTO session_execution(id, session_id, owner_id, phase, anchor_seq,"
            " time_created, heartbeat_at, expires_at) VALUES (?, 'chat-5', ?, 'running', 1,"
            " ?, ?, ?)",
            (GHOST_EXECUTION, GHOST_OWNER, now - 60_000, now - 40_000, now - 10_000),
        )
        conn.execute(
            "INSERT INTO session_message(id, session_id, execution_id, role, seq, data,"
            " time_created, time_updated) VALUES ('ghost-reply', 'chat-5', ?, 'assistant', 2,"
            " ?, ?, ?)",
            (GHOST_EXECUTION, MALFORMED, now - 50_000, now - 50_000),
        )
        conn.execute("COMMIT")
    finally:
        conn.close()
    return GHOST_EXECUTION


SCENES: tuple[Callable[[Stage], Awaitable[None]], ...] = (
    scene_normal_turn,
    scene_coalescing,
    scene_interrupt,
    scene_worker_crash,
    scene_quarantine,
)


def claim_hook(db: Path, facts: Facts, log: Log) -> Callable[[Claim], Awaitable[None]]:
    """Note who takes over a recovered claim and when, read back from the database."""

    async def on_claim(claim: Claim) -> None:
        if not claim.resumed:
            return
        row = await claim_row(db, claim.session_id)
        if row is not None and row[0] == claim.execution_id:
            facts.takeover_owner, facts.takeover_ms = row[1], row[4]
            log(claim.session_id, f"recovery: expired claim taken over by {row[1]}")

    return on_claim
