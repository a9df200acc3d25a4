"""The demo's scripted fake agent: a drain that answers like an agent, with fake tools.

Responsibility: `ScriptedAgent`, the drain the demo's runtimes run, and the scripts it
follows (`ask`, `tool`, `FAKE_TOOLS`). Invariants: it needs no network and no model - a
turn's tool calls and reply are the ones its inputs carry; a tool call's work is a small
`trio.sleep` (or, for `ask_user`, an approval event), so an interrupt lands there; resumed
after its owner was lost, it retries exactly the tool calls recovery failed as
`interrupted`; scenes wait on its events (`expect`) instead of sleeping.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import trio

# Only public names: the demo is also a worked example of the API.
from .. import AssistantWriter, DrainContext, Input, Runtime, ToolPart
from .output import Log, short

RETRY_SECONDS = 0.3  # a retried tool call is quick: the slow service warmed up


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
