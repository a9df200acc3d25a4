"""An agent-style drain: text and tool calls, and a user interrupt in the middle of one.

Run it: `python examples/agent_loop.py`.

The drain is what an LLM agent loop looks like with trio_sessions: take the new user
messages, open an assistant message, and for each tool call the model asks for, record it
(`start_tool`), run it, and record its result (`settle_tool`). Every write is fenced on the
session's claim, so a drain that lost its lease can never write again.

An interrupt cancels the drain wherever it is - here inside a slow tool call. The runtime
then finishes the open assistant message with `error="interrupted"` and fails the running
tool call the same way; the drain needs no cleanup code of its own.

Resume: if the process dies mid-answer, another runtime resumes the drain about a second
later, when the dead process's liveness token is free (`ctx.resumed`). The dead owner had
already taken the inputs, so the drain finds the question it still owes an answer to in the
transcript (`trio_sessions.unanswered`), not among the inputs.
Recovery closed the dead owner's answer as "interrupted: owner lost", failing its running
tool calls the same way: such a call may or may not have happened. A tool with side effects
(a payment, an e-mail) must not simply run again: give it an idempotency key that is the same
on every attempt (here the call id, made from the user message's id) and let it check
whether that key already happened before doing it again.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import trio

import trio_sessions

# A stand-in for the model: which tool calls it makes for a question, and how long each
# takes. A real drain would call an LLM here and loop until the model stops asking for tools.
SLOW_QUESTION = "Summarise every forecast ever recorded."


def plan(question: str) -> list[tuple[str, dict[str, Any], float]]:
    if question == SLOW_QUESTION:
        return [("archive_search", {"query": "all forecasts"}, 30.0)]
    cities = [city for city in ("Oslo", "Lima") if city in question]
    return [("weather", {"city": city}, 0.2) for city in cities]


def run_tool(name: str, args: dict[str, Any]) -> Any:
    return {"city": args.get("city"), "forecast": "mild"} if name == "weather" else []


async def agent(ctx: trio_sessions.DrainContext) -> None:
    await ctx.take_inputs()  # pending inputs become user messages, atomically
    questions = trio_sessions.unanswered(await ctx.transcript())
    if not questions:
        return  # a wake with nothing left to answer
    question = " ".join(str(message.data["text"]) for message in questions)
    reply = await ctx.begin_assistant()
    await reply.append_text("Looking into it. ")
    for n, (name, args, seconds) in enumerate(plan(question)):
        # The same id on every attempt at this turn: a side-effecting tool uses it as its
        # idempotency key (a resumed drain runs the plan again).
        call_id = f"{questions[-1].id}-{n}"
        await reply.start_tool(call_id, name, args)
        await trio.sleep(seconds)  # the tool's work; an interrupt cancels it right here
        await reply.settle_tool(call_id, run_tool(name, args))
    await reply.append_text("Here is what I found.")
    await reply.finish()


def show(message: trio_sessions.Message) -> str:
    if message.role == "user":
        return f"  {message.seq}. user: {message.data['text']}"
    pieces = []
    for part in message.data.parts:
        if isinstance(part, trio_sessions.ToolPart):
            result = part.error if part.status == "error" else part.output
            pieces.append(f"[{part.name}({part.input}) {part.status}: {result}]")
        else:
            pieces.append(part.text)
    error = "" if message.data.error is None else f"  <error: {message.data.error}>"
    return f"  {message.seq}. assistant: {' '.join(pieces)}{error}"


async def wait_for_running_tool(runtime: trio_sessions.Runtime, session_id: str) -> None:
    """Poll the transcript until a tool call is running (the transcript is live)."""
    with trio.fail_after(10):
        while True:
            for message in await runtime.transcript(session_id):
                if message.role == "assistant" and any(
                    isinstance(p, trio_sessions.ToolPart) and p.status == "running"
                    for p in message.data.parts
                ):
                    return
            await trio.sleep(0.05)


async def main(db: Path) -> None:
    async with trio_sessions.open_runtime(db, agent) as runtime:
        print("A turn with two tool calls:")
        await runtime.submit("research", {"text": "Weather in Oslo and Lima?"})
        await runtime.wait_idle("research")

        print("A slow tool call, interrupted by the user:")
        await runtime.submit("research", {"text": SLOW_QUESTION})
        await wait_for_running_tool(runtime, "research")
        accepted = await runtime.interrupt("research")
        print(f"  interrupt accepted: {accepted}")
        await runtime.wait_idle("research")

        print("The session is free again; the next question gets a normal turn.")
        await runtime.submit("research", {"text": "Just Oslo, then?"})
        await runtime.wait_idle("research")

        print("Transcript:")
        for message in await runtime.transcript("research"):
            print(show(message))


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        trio.run(main, Path(tmp) / "sessions.db")
