"""Drains the worker tests run as `python -m trio_sessions worker worker_drain:...`.

`reply` answers each input by its payload:
* `{"text": T}` - a settled `echo` tool call, then the text `echo: T`, finished;
* `{"hold": true}` - the text `holding`, then waits until cancelled (a claim still running
  when the worker is told to stop);
* `{"stubborn": true}` - the text `stubborn`, then waits shielded from cancellation (a
  drain that never lets a graceful shutdown finish).
"""

from __future__ import annotations

import trio

from trio_sessions import DrainContext

HOLDING = "holding"
STUBBORN = "stubborn"


async def reply(ctx: DrainContext) -> None:
    for item in await ctx.take_inputs():
        writer = await ctx.begin_assistant()
        if item.payload.get("hold"):
            await writer.append_text(HOLDING)
            await trio.sleep_forever()
        if item.payload.get("stubborn"):
            await writer.append_text(STUBBORN)
            with trio.CancelScope(shield=True):
                await trio.sleep_forever()
        text = item.payload["text"]
        await writer.start_tool("call-1", "echo", {"text": text})
        await writer.settle_tool("call-1", {"echo": text})
        await writer.append_text(f"echo: {text}")
        await writer.finish()


def not_async(ctx: DrainContext) -> None:
    """A plain function: the worker refuses it."""


NOT_CALLABLE = 42
