"""Drains the worker tests run as `python -m trio_sessions worker worker_drain:...`.

`reply` answers each input by its payload:
* `{"text": T}` - a settled `echo` tool call, then the text `echo: T`, finished;
* `{"hold": true}` - the text `holding`, then waits until cancelled (a claim still running
  when the worker is told to stop);
* `{"stubborn": true}` - the text `stubborn`, then waits shielded from cancellation (a
  drain that never lets a graceful shutdown finish);
* `{"thread": S}` - the text `in thread`, then a blocking call of S seconds in a thread
  (no cancellation stops it), then the text `thread done` and the message finished.
Each drain call prints `drain enter SESSION resumed=R at T` and, after a thread, `thread
done SESSION at T` (wall times) on stderr, so a test can order drains across processes.
`frozen` answers with `gc.get_freeze_count()` (the worker freezes its start-up heap).
"""

from __future__ import annotations

import gc
import sys
import time

import trio

from trio_sessions import DrainContext

HOLDING = "holding"
STUBBORN = "stubborn"
IN_THREAD = "in thread"


def say(line: str) -> None:
    print(f"{line} at {time.time():.6f}", file=sys.stderr, flush=True)


async def reply(ctx: DrainContext) -> None:
    say(f"drain enter {ctx.session_id} resumed={ctx.resumed}")
    for item in await ctx.take_inputs():
        writer = await ctx.begin_assistant()
        if item.payload.get("hold"):
            await writer.append_text(HOLDING)
            await trio.sleep_forever()
        if item.payload.get("stubborn"):
            await writer.append_text(STUBBORN)
            with trio.CancelScope(shield=True):
                await trio.sleep_forever()
        if "thread" in item.payload:
            await writer.append_text(IN_THREAD)
            await trio.to_thread.run_sync(time.sleep, float(item.payload["thread"]))
            say(f"thread done {ctx.session_id}")
            await writer.append_text("thread done")
            await writer.finish()
            continue
        text = item.payload["text"]
        await writer.start_tool("call-1", "echo", {"text": text})
        await writer.settle_tool("call-1", {"echo": text})
        await writer.append_text(f"echo: {text}")
        await writer.finish()


def not_async(ctx: DrainContext) -> None:
    """A plain function: the worker refuses it."""


NOT_CALLABLE = 42


async def frozen(ctx: DrainContext) -> None:
    """Answers each input with how many objects the garbage collector holds frozen."""
    for _ in await ctx.take_inputs():
        writer = await ctx.begin_assistant()
        await writer.append_text(str(gc.get_freeze_count()))
        await writer.finish()
