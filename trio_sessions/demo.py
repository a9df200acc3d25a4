"""`python -m trio_sessions.demo`: watch trio_sessions keep agent sessions safe, in seconds.

Responsibility: one self-contained, network-free scenario on a fresh SQLite file (temporary
unless `--db PATH`). A scripted fake agent - text and tool calls with small delays - drives
several sessions through five scenes, each line timestamped:

1. a normal turn with tool calls;
2. wakes arriving during a turn coalesce into exactly one more turn;
3. a user interrupts a tool call while more input is queued: the call fails as
   `interrupted` and exactly one successor turn takes the queued input;
4. a worker *process* is SIGKILLed mid-turn; its liveness token is released with it, and
   after the takeover grace - long before its lease runs out - another owner recovers the
   session and finishes the turn;
5. a corrupt record left by a dead owner is quarantined while other sessions carry on.

The summary at the end is computed from the database, never printed unconditionally: the
exit status is 0 only if every check holds. Ctrl-C stops the demo cleanly (exit 130): the
runtime shuts down, expiring its leases so nothing is left claimed for long.

`--worker` is the entry point of scene 4's worker process, not meant to be run by hand.
"""

from __future__ import annotations

import argparse
import functools
import json
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import trio

# Only public names: the demo is also a worked example of the API.
from . import (
    AssistantWriter,
    Claim,
    DrainContext,
    Input,
    Message,
    Runtime,
    ToolPart,
    open_runtime,
)

LEASE = 1.5  # short, so a killed worker's session is recovered within the demo
RECOVERY_INTERVAL = 0.5
RETRY_SECONDS = 0.3  # a retried tool call is quick: the slow service warmed up
SCENE_TIMEOUT = 20.0  # a scene that hangs fails the demo instead of hanging it
# Scene 4's worker: a lease long enough that a takeover before it ends is owner liveness.
WORKER_LEASE = 10.0
TAKEOVER_GRACE = 0.5  # open_runtime's default
WORKER_LIFETIME = 30.0  # a worker whose parent vanished stops by itself
EXIT_INTERRUPTED = 130

Log = Callable[[str, str], None]


# ---------------------------------------------------------------------------------------------
# Output


@attrs.define
class Clock:
    """Seconds since the demo started, for the timestamp of every line."""

    start: float = attrs.field(factory=time.monotonic)

    def log(self, who: str, text: str) -> None:
        print(f"[{time.monotonic() - self.start:6.2f}s] {who:<8} {text}", flush=True)

    def scene(self, title: str) -> None:
        print(f"\n-- {title} " + "-" * max(4, 76 - len(title)), flush=True)


def relay_log(who: str, text: str) -> None:
    """The worker's log: its parent adds the timestamps when it relays the line."""
    print(f"{who}|{text}", flush=True)


def short(identifier: str) -> str:
    return identifier[:8]


def describe(message: Message) -> str:
    """One readable line for a transcript message."""
    if message.role != "assistant":
        return f"#{message.seq} {message.role}: {message.data.get('text', message.data)!r}"
    parts = []
    for part in message.data.parts:
        if isinstance(part, ToolPart):
            settled = part.error if part.status == "error" else part.output
            parts.append(f"[{part.name} -> {part.status}: {settled}]")
        else:
            parts.append(repr(part.text))
    ending = "finished" if message.data.finished else "open"
    if message.data.error is not None:
        ending += f", error={message.data.error!r}"
    return f"#{message.seq} assistant ({ending}): " + " ".join(parts)


# ---------------------------------------------------------------------------------------------
# The scripted fake agent


FORECASTS = {"Paris": "sunny, 21 C", "Rome": "clear, 26 C", "Oslo": "rain, 9 C"}

FAKE_TOOLS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "weather": lambda args: {"city": args["city"], "forecast": FORECASTS[args["city"]]},
    "search": lambda args: {"hits": 3, "best": f"notes on {args['query']}"},
    "compile_report": lambda args: {"title": args["topic"], "pages": 12},
    "ask_user": lambda args: {"answer": "yes, book it"},
    "book_table": lambda args: {"confirmed": True, "at": args["place"]},
}


def tool(name: str, seconds: float = 0.2, **args: Any) -> dict[str, Any]:
    return {"name": name, "args": args, "seconds": seconds}


def ask(text: str, *tools: dict[str, Any], reply: str) -> dict[str, Any]:
    """A user input; the fake agent follows its script: these tool calls, then this reply."""
    return {"text": text, "tools": list(tools), "reply": reply}


@attrs.define(eq=False)
class ScriptedAgent:
    """A drain that behaves like an agent: for the inputs it takes, one assistant message
    with text, the scripted tool calls (each a small delay) and a reply.

    Resumed after its owner was lost, it retries the tool calls the lost owner left
    failed. Scenes wait on its events instead of sleeping.
    """

    log: Log
    runtime: Runtime | None = None
    _events: dict[tuple[str, str], trio.Event] = attrs.field(factory=dict)
    _approvals: dict[str, trio.Event] = attrs.field(factory=dict)

    def expect(self, what: str, session_id: str) -> trio.Event:
        """An event set when `what` ('tool' started, 'turn' ended) next happens."""
        return self._events.setdefault((what, session_id), trio.Event())

    def approve(self, session_id: str) -> None:
        """Answer the session's pending `ask_user` tool call."""
        self._approvals.setdefault(session_id, trio.Event()).set()

    def _happened(self, what: str, session_id: str) -> None:
        event = self._events.pop((what, session_id), None)
        if event is not None:
            event.set()

    async def __call__(self, ctx: DrainContext) -> None:
        inputs = await ctx.take_inputs()
        if inputs:
            await self._answer(ctx, inputs)
        elif ctx.resumed:
            await self._resume(ctx)
        else:
            self.log(ctx.session_id, "agent: woken, but nothing new to answer")
        self._happened("turn", ctx.session_id)

    async def _answer(self, ctx: DrainContext, inputs: list[Input]) -> None:
        who = ctx.session_id
        texts = ", ".join(repr(item.payload["text"]) for item in inputs)
        self.log(who, f"agent: turn starts (execution {short(ctx.execution_id)}), reads {texts}")
        reply = await ctx.begin_assistant()
        await reply.append_text("Let me check. ")
        steps = [step for item in inputs for step in item.payload.get("tools", [])]
        for n, step in enumerate(steps):
            await self._call_tool(ctx, reply, f"call-{n}", step)
        closing = " ".join(str(item.payload["reply"]) for item in inputs)
        await reply.append_text(closing)
        await reply.finish()
        self.log(who, f"agent: {closing!r} (turn finished)")

    async def _resume(self, ctx: DrainContext) -> None:
        who = ctx.session_id
        self.log(
            who,
            f"agent: RESUMED as execution {short(ctx.execution_id)} (attempt {ctx.attempt}) "
            "- the previous owner died mid-turn",
        )
        lost = await self._lost_tool_calls(who)
        reply = await ctx.begin_assistant()
        await reply.append_text("Picking up where the lost worker stopped. ")
        for n, part in enumerate(lost):
            step = tool(part.name, RETRY_SECONDS, **part.input)
            await self._call_tool(ctx, reply, f"retry-{n}", step)
        await reply.append_text("Here is your report.")
        await reply.finish()
        self.log(who, "agent: recovered turn finished")

    async def _lost_tool_calls(self, session_id: str) -> list[ToolPart]:
        """Tool calls that recovery failed as `interrupted: owner lost`, newest message."""
        assert self.runtime is not None
        transcript = await self.runtime.transcript(session_id)
        for message in reversed(transcript):
            if message.role == "assistant":
                return [
                    p
                    for p in message.data.parts
                    if isinstance(p, ToolPart) and (p.error or "").startswith("interrupted")
                ]
        return []

    async def _call_tool(
        self, ctx: DrainContext, reply: AssistantWriter, call_id: str, step: dict[str, Any]
    ) -> None:
        name, args = step["name"], step["args"]
        await reply.start_tool(call_id, name, args)
        self.log(ctx.session_id, f"agent: -> {name}({_args(args)}) ...")
        self._happened("tool", ctx.session_id)
        if name == "ask_user":
            await self._approvals.setdefault(ctx.session_id, trio.Event()).wait()
        else:
            await trio.sleep(step["seconds"])  # the tool's work: an interrupt lands here
        output = FAKE_TOOLS[name](args)
        await reply.settle_tool(call_id, output)
        self.log(ctx.session_id, f"agent: <- {name}: {output}")


def _args(args: dict[str, Any]) -> str:
    return ", ".join(f"{key}={value!r}" for key, value in args.items())


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
    async with trio.open_nursery() as nursery:
        process: trio.Process = await nursery.start(
            functools.partial(trio.run_process, command, stdout=subprocess.PIPE, check=False)
        )
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


# ---------------------------------------------------------------------------------------------
# The summary: every check reads the database


@attrs.frozen
class Check:
    name: str
    passed: bool
    detail: str


def _messages(conn: sqlite3.Connection, session_id: str, role: str) -> list[dict[str, Any]]:
    rows = conn.execute(
        "SELECT execution_id, data, time_created, time_updated FROM session_message"
        " WHERE session_id = ? AND role = ? ORDER BY seq",
        (session_id, role),
    ).fetchall()
    keys = ("execution_id", "data", "time_created", "time_updated")
    return [{**dict(zip(keys, row, strict=True)), "data": json.loads(row[1])} for row in rows]


def _tools(message: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in message["data"]["parts"] if p["type"] == "tool"]


def _clean(message: dict[str, Any]) -> bool:
    """Finished without error, every tool call completed."""
    data = message["data"]
    return (
        data["finished"] is True
        and data["error"] is None
        and all(p["status"] == "completed" for p in _tools(message))
    )


def check_normal_turn(conn: sqlite3.Connection, facts: Facts) -> Check:
    replies = _messages(conn, "chat-1", "assistant")
    tools = [p["status"] for m in replies for p in _tools(m)]
    passed = len(replies) == 1 and _clean(replies[0]) and tools == ["completed"] * 2
    return Check(
        "normal turn: chat-1 answered in one turn, 2 tool calls completed",
        passed,
        f"{len(replies)} assistant message(s), tool calls {tools}",
    )


def check_coalescing(conn: sqlite3.Connection, facts: Facts) -> Check:
    replies = _messages(conn, "chat-2", "assistant")
    inputs = _messages(conn, "chat-2", "user")
    passed = (
        facts.wakes_during_turn == 5
        and len(inputs) == 4
        and len(replies) == 2
        and all(_clean(m) for m in replies)
    )
    return Check(
        "coalescing: 5 wakes during a turn caused exactly 1 more turn (chat-2)",
        passed,
        f"wakes counted {facts.wakes_during_turn}, {len(inputs)} inputs, {len(replies)} turns",
    )


def check_interrupted_call(conn: sqlite3.Connection, facts: Facts) -> Check:
    replies = _messages(conn, "chat-3", "assistant")
    first = replies[0] if replies else None
    passed = (
        facts.interrupt_accepted
        and first is not None
        and first["data"]["finished"] is True
        and first["data"]["error"] == "interrupted"
        and [(p["status"], p["error"]) for p in _tools(first)] == [("error", "interrupted")]
    )
    shown = None if first is None else [(p["status"], p["error"]) for p in _tools(first)]
    return Check(
        "interrupt: chat-3's running tool call failed as 'interrupted', message finished",
        passed,
        f"accepted={facts.interrupt_accepted}, tool calls {shown}",
    )


def check_one_successor(conn: sqlite3.Connection, facts: Facts) -> Check:
    replies = _messages(conn, "chat-3", "assistant")
    inputs = _messages(conn, "chat-3", "user")
    executions = {m["execution_id"] for m in replies}
    pending = conn.execute("SELECT COUNT(*) FROM session_input WHERE session_id = 'chat-3'")
    passed = (
        len(replies) == 2
        and len(executions) == 2
        and _clean(replies[1])
        and len(inputs) == 2
        and inputs[1]["execution_id"] == replies[1]["execution_id"]
        and pending.fetchone()[0] == 0
    )
    return Check(
        "interrupt: exactly one successor turn took the queued input (chat-3)",
        passed,
        f"{len(replies)} turns by {len(executions)} executions, {len(inputs)} inputs taken",
    )


def check_worker_killed(conn: sqlite3.Connection, facts: Facts) -> Check:
    killed = facts.worker_exit == -signal.SIGKILL if hasattr(signal, "SIGKILL") else True
    passed = (
        killed
        and facts.worker_owner is not None
        and facts.worker_claim_owner == facts.worker_owner
        and facts.worker_lease_end_ms is not None
    )
    return Check(
        "crash: the worker process held chat-4's claim when it was SIGKILLed",
        passed,
        f"exit status {facts.worker_exit}, claim owner {facts.worker_claim_owner}",
    )


def check_recovered(conn: sqlite3.Connection, facts: Facts) -> Check:
    replies = _messages(conn, "chat-4", "assistant")
    lost = replies[0] if replies else None
    passed = (
        len(replies) == 2
        and lost is not None
        and lost["data"]["finished"] is True
        and [p["error"] for p in _tools(lost)] == ["interrupted: owner lost"]
        and replies[1]["execution_id"] != lost["execution_id"]
        and _clean(replies[1])
        and facts.takeover_owner == facts.demo_owner
        and facts.takeover_ms is not None
        and facts.worker_lease_end_ms is not None
        and facts.worker_killed_ms is not None
        and facts.worker_killed_ms + TAKEOVER_GRACE * 1000
        <= facts.takeover_ms
        < facts.worker_lease_end_ms
    )
    waited = (
        None
        if facts.takeover_ms is None or facts.worker_killed_ms is None
        else f"{(facts.takeover_ms - facts.worker_killed_ms) / 1000:.2f} s"
    )
    return Check(
        "recovery: another owner resumed chat-4 after the grace, before the lease expired",
        passed,
        f"taken over by {facts.takeover_owner} {waited} after the kill; {len(replies)} messages",
    )


def check_quarantined(conn: sqlite3.Connection, facts: Facts) -> Check:
    rows = conn.execute(
        "SELECT r.recovery_error, e.id FROM session_recovery r"
        " LEFT JOIN session_execution e ON e.id = r.execution_id"
        " WHERE r.execution_id = ? AND r.recovery_error IS NOT NULL",
        (GHOST_EXECUTION,),
    ).fetchall()
    passed = len(rows) == 1 and rows[0][1] == GHOST_EXECUTION
    return Check(
        "quarantine: chat-5's corrupt record is quarantined, its claim kept for an operator",
        passed,
        f"reason: {rows[0][0] if rows else None}",
    )


def check_carried_on(conn: sqlite3.Connection, facts: Facts) -> Check:
    quarantined_at = conn.execute(
        "SELECT time_quarantined FROM session_recovery WHERE execution_id = ?",
        (GHOST_EXECUTION,),
    ).fetchone()
    booking = _messages(conn, "chat-6", "assistant")
    weather = _messages(conn, "chat-7", "assistant")
    at = None if quarantined_at is None else quarantined_at[0]
    passed = (
        at is not None
        and len(booking) == 1
        and len(weather) == 1
        and _clean(booking[0])
        and _clean(weather[0])
        and booking[0]["time_created"] <= at <= booking[0]["time_updated"]
    )
    return Check(
        "carry on: chat-6 (mid-turn across the quarantine) and chat-7 finished normally",
        passed,
        f"{len(booking)} + {len(weather)} clean turns",
    )


def check_nothing_stranded(conn: sqlite3.Connection, facts: Facts) -> Check:
    stranded = conn.execute(
        "SELECT COUNT(DISTINCT i.session_id) FROM session_input i JOIN session s"
        " ON s.id = i.session_id WHERE s.time_woken IS NULL AND NOT EXISTS"
        " (SELECT 1 FROM session_execution e WHERE e.session_id = s.id)"
    ).fetchone()[0]
    claims = [row[0] for row in conn.execute("SELECT id FROM session_execution")]
    passed = stranded == 0 and claims == [GHOST_EXECUTION]
    return Check(
        "no stranded work: no input without a doorbell or claim; only the quarantined claim left",
        passed,
        f"{stranded} session(s) with stranded inputs, claims left {claims}",
    )


CHECKS = (
    check_normal_turn,
    check_coalescing,
    check_interrupted_call,
    check_one_successor,
    check_worker_killed,
    check_recovered,
    check_quarantined,
    check_carried_on,
    check_nothing_stranded,
)


def verify(db: Path, facts: Facts) -> list[Check]:
    conn = sqlite3.connect(db)
    try:
        return [_safely(check, conn, facts) for check in CHECKS]
    finally:
        conn.close()


def _safely(
    check: Callable[[sqlite3.Connection, Facts], Check], conn: sqlite3.Connection, facts: Facts
) -> Check:
    """A check that cannot even read what it expects fails; it does not crash the summary."""
    try:
        return check(conn, facts)
    except (LookupError, TypeError, ValueError, sqlite3.Error) as exc:
        return Check(check.__name__, False, f"could not evaluate: {exc!r}")


def print_summary(checks: list[Check], elapsed: float) -> None:
    print("\n-- Summary: checks computed from the database " + "-" * 32, flush=True)
    for check in checks:
        print(f"  {'PASS' if check.passed else 'FAIL'}  {check.name}")
        print(f"        {check.detail}")
    passed = sum(check.passed for check in checks)
    print(f"\n{passed}/{len(checks)} checks passed in {elapsed:.1f} s.", flush=True)


# ---------------------------------------------------------------------------------------------
# Entry points


async def run_demo(db: Path, stop: trio.CancelScope) -> bool | None:
    """All scenes against one runtime, then the summary. True if every check passed; None
    when `stop` was cancelled (Ctrl-C)."""
    clock = Clock()
    facts = Facts()
    agent = ScriptedAgent(clock.log)
    clock.log("demo", f"database {db}")
    async with open_runtime(
        db,
        agent,
        owner_id="demo",
        lease=LEASE,
        recovery_interval=RECOVERY_INTERVAL,
        acquisition_hook=claim_hook(db, facts, clock.log),
    ) as runtime:
        agent.runtime = runtime
        facts.demo_owner = runtime.owner_id
        clock.log("demo", f"runtime open as owner {runtime.owner_id} (lease {LEASE} s)")
        stage = Stage(runtime, agent, clock, db, facts)
        # Ctrl-C cancels the scenes only: the runtime then closes the ordinary way, ending
        # its drains and expiring their leases, and a worker process is killed.
        with stop:
            for scene in SCENES:
                with trio.move_on_after(SCENE_TIMEOUT) as timeout:
                    await scene(stage)
                if timeout.cancelled_caught:
                    clock.log("demo", f"{scene.__name__} timed out; the summary will say why")
    if stop.cancelled_caught:
        return None
    checks = await trio.to_thread.run_sync(verify, db, facts)
    print_summary(checks, time.monotonic() - clock.start)
    return all(check.passed for check in checks)


async def until_ctrl_c(work: Callable[[trio.CancelScope], Awaitable[bool | None]]) -> bool | None:
    """Run `work(stop)`; the first Ctrl-C cancels `stop`, which `work` honours gracefully."""
    stop = trio.CancelScope()
    with trio.open_signal_receiver(signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                async for _ in signals:
                    stop.cancel()
                    return

            nursery.start_soon(watch)
            result = await work(stop)
            nursery.cancel_scope.cancel()
    return result


async def run_worker(db: Path, session_id: str, lease: float) -> None:
    """Scene 4's worker process: start a slow turn, report READY, wait to be killed."""
    agent = ScriptedAgent(relay_log)
    with trio.move_on_after(WORKER_LIFETIME):
        # A long recovery interval: this worker exists to be killed, not to recover others.
        async with open_runtime(
            db, agent, owner_id="worker", lease=lease, recovery_interval=WORKER_LIFETIME
        ) as runtime:
            agent.runtime = runtime
            tool_started = agent.expect("tool", session_id)
            relay_log(session_id, f"user: 'Compile the Q3 report.' (owner {runtime.owner_id})")
            report = tool("compile_report", 60.0, topic="Q3 sales")
            await runtime.submit(session_id, ask("Compile the Q3 report.", report, reply="Done."))
            await tool_started.wait()
            print(f"READY {runtime.owner_id}", flush=True)
            await trio.sleep_forever()


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m trio_sessions.demo",
        description="Watch trio_sessions drive a scripted agent through turns, interrupts, "
        "a killed worker process and a quarantined record. Network-free; ~10 s.",
    )
    parser.add_argument(
        "--db", type=Path, help="keep the database at this new path (default: a temporary file)"
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--session", default="chat-4", help=argparse.SUPPRESS)
    parser.add_argument("--lease", type=float, default=LEASE, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return _worker_main(args)
    if args.db is not None and args.db.exists():
        print(f"error: {args.db} exists; the demo needs a fresh database path", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="trio-sessions-demo-") as tmp:
        db = args.db if args.db is not None else Path(tmp) / "demo.db"
        outcome = _run_guarded(db)
    if outcome is None:
        print("\nStopped by Ctrl-C; the runtime shut down cleanly.", file=sys.stderr)
        return EXIT_INTERRUPTED
    if args.db is not None:
        print(f"The database is kept at {db}. Try: python -m trio_sessions status {db}")
    return 0 if outcome else 1


def _run_guarded(db: Path) -> bool | None:
    """`run_demo` under trio; None when stopped by Ctrl-C (also one that arrives before the
    signal receiver is installed: trio raises it inside an exception group)."""
    outcome: bool | None = None
    try:
        outcome = trio.run(until_ctrl_c, functools.partial(run_demo, db))
    except* KeyboardInterrupt:
        outcome = None
    return outcome


def _worker_main(args: argparse.Namespace) -> int:
    try:
        trio.run(run_worker, args.db, args.session, args.lease)
    except* KeyboardInterrupt:
        pass  # the parent stops too; nothing to report
    return 0


if __name__ == "__main__":
    sys.exit(main())
