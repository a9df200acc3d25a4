"""Section `append`: streaming - the cost of one `append_text` after a 200 KB tool result in
the same message, against the same call in an empty message (DESIGN §7: <= 1.5x, i.e. the
bytes written per append do not grow with the message).

Each round streams one message of each kind, in alternating order, from a drain on the
default store; the figure is the median of per-round ratios of the median append time.
"""

from __future__ import annotations

import time
from pathlib import Path

import attrs
import trio

from .._runtime import DrainContext
from .config import Config
from .report import Report, fmt_ratio, fmt_us, median, progress, verdict
from .tools import open_bench_runtime, rotate

TOOL_RESULT_BYTES = 200_000
WARM_APPENDS = 5
TOKEN = "token "


@attrs.define(eq=False)
class StreamingDrains:
    """Each session's drain streams one assistant message; sessions named `big-*` first
    settle a tool call with a 200 KB result. Per-append seconds land in `timings`."""

    appends: int
    timings: dict[str, list[float]] = attrs.Factory(dict)

    async def drain(self, ctx: DrainContext) -> None:
        writer = await ctx.begin_assistant()
        if ctx.session_id.startswith("big-"):
            await writer.start_tool("call-1", "fetch", {"url": "https://example.com"})
            await writer.settle_tool("call-1", "x" * TOOL_RESULT_BYTES)
        for _ in range(WARM_APPENDS):
            await writer.append_text(TOKEN)
        timings = []
        for _ in range(self.appends):
            started = time.perf_counter()
            await writer.append_text(TOKEN)
            timings.append(time.perf_counter() - started)
        await writer.finish()
        self.timings[ctx.session_id] = timings


async def bench_append(config: Config, folder: Path, report: Report) -> None:
    progress(
        f"append: {config.appends} appends per message, {config.append_rounds} rounds + warm-up"
    )
    drains = StreamingDrains(config.appends)
    empty: list[float] = []
    big: list[float] = []
    ratios: list[float] = []
    async with open_bench_runtime(folder / "append.db", drains.drain) as rt:
        for round_ in range(config.append_rounds + 1):
            for kind in rotate(["empty", "big"], round_):
                session_id = f"{kind}-{round_}"
                await rt.wake(session_id)
                await rt.wait_idle(session_id)
                await trio.lowlevel.checkpoint()
            if round_ == 0:
                continue  # warm-up
            per_empty = median(drains.timings[f"empty-{round_}"])
            per_big = median(drains.timings[f"big-{round_}"])
            empty.append(per_empty)
            big.append(per_big)
            ratios.append(per_big / per_empty)
    growth = median(ratios)
    report.add(
        "append",
        "append_text after a 200 KB tool result",
        fmt_us(median(big)) + "/append",
        fmt_us(median(empty)) + " (empty message)",
        fmt_ratio(ratios),
        "<= 1.5x",
        verdict(growth <= 1.5),
    )
    report.machine["append_growth"] = growth
