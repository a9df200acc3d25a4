"""Resumable event streams (DESIGN §5.2): `runtime.stream()` yields events whose application
reproduces `transcript()`, and the cursor of any event resumes with exactly the events after
it - no gap, no duplicate - in this process or another, also after the message finished."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import pytest
import trio
import trio.testing
from helpers import runtime
from trio.testing import MockClock

import trio_sessions
from trio_sessions import (
    AssistantData,
    DrainContext,
    Runtime,
    StreamEvent,
    TextPart,
    ToolPart,
)

Clock = Callable[[], float]
View = dict[int, tuple[str, Any]]
REAL_TIME_BOUND = 10.0


def apply(view: View, event: StreamEvent) -> None:
    """What a client does with an event (DESIGN §5.2's table), on its copy of the messages."""
    if event.kind == "truncate":
        for seq in [seq for seq in view if seq > event.seq]:
            del view[seq]
        return
    if event.kind == "message":
        view[event.seq] = (event.role, event.data)
        return
    role, data = view[event.seq]
    assert isinstance(data, AssistantData), event
    parts = data.parts
    if event.kind == "append":
        assert isinstance(event.data, str)
        if parts and isinstance(parts[-1], TextPart):
            parts = (*parts[:-1], TextPart(parts[-1].text + event.data))
        else:
            parts = (*parts, TextPart(event.data))
        data = attrs.evolve(data, parts=parts)
    elif event.kind == "part":
        part = event.data
        assert isinstance(part, ToolPart)
        same = [
            i for i, p in enumerate(parts) if isinstance(p, ToolPart) and p.call_id == part.call_id
        ]
        parts = (*parts[: same[0]], part, *parts[same[0] + 1 :]) if same else (*parts, part)
        data = attrs.evolve(data, parts=parts)
    else:
        assert event.kind == "finish", event
        data = attrs.evolve(data, finished=True, error=event.data["error"])
    view[event.seq] = (role, data)


def applied(events: list[StreamEvent], view: View | None = None) -> View:
    view = dict(view or {})
    for event in events:
        apply(view, event)
    return view


async def stored(rt: Runtime, session_id: str = "s") -> View:
    return {m.seq: (m.role, m.data) for m in await rt.transcript(session_id)}


async def caught_up(
    rt: Runtime, session_id: str = "s", cursor: str | None = None
) -> list[StreamEvent]:
    """Every event a stream yields until nothing else can happen (the virtual clock's tasks
    are all blocked), then leave it."""
    got: list[StreamEvent] = []

    async def collect(events: trio_sessions._stream.EventStream) -> None:
        async for event in events:
            got.append(event)

    async with rt.stream(session_id, cursor=cursor) as events, trio.open_nursery() as nursery:
        nursery.start_soon(collect, events)
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    return got


def text_of(data: AssistantData) -> str:
    return "".join(part.text for part in data.parts if isinstance(part, TextPart))


# ---------------------------------------------------------------------------------------------
# Live events and their application


async def test_a_stream_sends_the_stored_messages_then_each_change_as_it_happens(
    store: Any, clock: Clock, autojump_clock: MockClock, backend: str
) -> None:
    """cursor=None: one "message" event per stored message; then the reply's events - the
    new message, each append, the tool part started and settled, the finish - in write order,
    and applying them reproduces transcript()."""
    go = trio.Event()
    calls: list[int] = []

    async def drain(ctx: DrainContext) -> None:
        await ctx.take_inputs()
        calls.append(1)
        if len(calls) > 1:
            await go.wait()
        writer = await ctx.begin_assistant()
        await writer.append_text("Let me ")
        await writer.append_text("look.")
        await writer.start_tool("c1", "search", {"q": "x"})
        await writer.settle_tool("c1", {"hits": 1})
        await writer.append_text("Found it")
        await writer.finish()

    async with runtime(store, drain, clock) as rt:
        await rt.submit("s", {"text": "hello"})
        await rt.wait_idle("s")
        await rt.submit("s", {"text": "again"})
        stored_reply = AssistantData(
            (
                TextPart("Let me look."),
                ToolPart("c1", "search", {"q": "x"}, "completed", {"hits": 1}, None),
                TextPart("Found it"),
            ),
            True,
            None,
        )
        async with rt.stream("s") as events:
            first = [await events.__anext__() for _ in range(3)]
            go.set()
            rest = []
            async for event in events:
                rest.append(event)
                if event.kind == "finish" or event.data == stored_reply:
                    break
        assert [(e.kind, e.seq, e.role) for e in first] == [
            ("message", 1, "user"),
            ("message", 2, "assistant"),
            ("message", 3, "user"),
        ]
        reply = [(e.kind, e.seq, e.data) for e in rest]
        if backend == "postgres" and reply[-1][0] == "message":
            # PostgreSQL's change signal may bring the finished message before the writer's
            # own event for the finish does: then it comes whole.
            reply[-1] = ("finish", 4, {"error": None})
        assert reply == [
            ("message", 4, AssistantData((), False, None)),
            ("append", 4, "Let me "),
            ("append", 4, "look."),
            ("part", 4, ToolPart("c1", "search", {"q": "x"}, "running", None, None)),
            ("part", 4, ToolPart("c1", "search", {"q": "x"}, "completed", {"hits": 1}, None)),
            ("append", 4, "Found it"),
            ("finish", 4, {"error": None}),
        ]
        assert applied(first + rest) == await stored(rt)
        assert len({e.cursor for e in first + rest}) == len(first + rest)


# ---------------------------------------------------------------------------------------------
# Resuming


async def test_resuming_from_every_cursor_gives_exactly_the_events_after_it(
    store: Any, clock: Clock, autojump_clock: MockClock
) -> None:
    """While the reply is open, a stream opened at any cursor - in this runtime or another on
    the same store - yields exactly the live events after it (from the tool part on, where
    the appends are still stored one by one; before it, the message comes whole), and
    applying them to what the cursor's client held reproduces transcript(). After the finish,
    each cursor inside the reply resumes with one "message" event, and the last cursor with
    nothing."""
    words = [f"w{n} " for n in range(6)]
    streamed, release = trio.Event(), trio.Event()

    async def drain(ctx: DrainContext) -> None:
        await ctx.take_inputs()
        writer = await ctx.begin_assistant()
        await writer.append_text("Looking. ")
        await writer.start_tool("c1", "search", {})
        await writer.settle_tool("c1", {"hits": 1})
        for word in words:
            await writer.append_text(word)
        streamed.set()
        await release.wait()
        await writer.finish()

    live: list[StreamEvent] = []

    async def follow(events: trio_sessions._stream.EventStream) -> None:
        async for event in events:
            live.append(event)

    async with (
        runtime(store, drain, clock) as rt,
        trio_sessions.open_runtime(store, None, clock=clock) as other,
        rt.stream("s") as events,
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(follow, events)
        await rt.submit("s", {"text": "q"})
        await streamed.wait()
        await trio.testing.wait_all_tasks_blocked()
        now = await stored(rt)
        assert applied(live) == now
        settled = next(
            i for i, e in enumerate(live) if e.kind == "part" and e.data.status == "completed"
        )
        for i, event in enumerate(live):
            for reader in (rt, other):
                resumed = await caught_up(reader, cursor=event.cursor)
                assert applied(resumed, applied(live[: i + 1])) == now, i
                if i >= settled:
                    assert resumed == live[i + 1 :], i
        release.set()
        await rt.wait_idle("s")
        await trio.testing.wait_all_tasks_blocked()
        final = await stored(rt)
        assert applied(live) == final
        assert live[-1].kind == "finish"
        reply_seq = live[-1].seq
        for i, event in enumerate(live[:-1]):
            resumed = await caught_up(other, cursor=event.cursor)
            assert applied(resumed, applied(live[: i + 1])) == final, i
            if i >= 1:  # inside the reply: the finished message, whole
                assert [(e.kind, e.seq, e.data) for e in resumed] == [
                    ("message", reply_seq, final[reply_seq][1])
                ]
        assert await caught_up(other, cursor=live[-1].cursor) == []
        nursery.cancel_scope.cancel()


async def test_a_malformed_cursor_or_another_sessions_raises_value_error(
    store: Any, clock: Clock, autojump_clock: MockClock
) -> None:
    """stream() refuses, with ValueError and before yielding anything, a cursor that is not
    one it made (garbled, truncated, with a newline, numbers out of order) and the cursor of
    another session; TypeError for a cursor that is not a str."""

    async def drain(ctx: DrainContext) -> None:
        await ctx.take_inputs()
        writer = await ctx.begin_assistant()
        await writer.append_text("hi")

    async with runtime(store, drain, clock) as rt:
        await rt.submit("s", {"text": "q"})
        await rt.submit("t", {"text": "q"})
        await rt.wait_idle("s")
        [*_, last] = await caught_up(rt, "s")
        good = last.cursor
        assert "\n" not in good and "\r" not in good and good.isascii()
        head, _, _ = good.rpartition(".")
        bad = [
            "",
            "nonsense",
            good + "\n",
            good[:-1] + "x",
            good.replace("1.", "2.", 1),
            head + ".9:" + "0" * 12 + ":1",  # an open message above the top one
            head + ".1:" + "0" * 12 + ":1,1:" + "0" * 12 + ":1",  # listed twice
            good + "," * 3,
        ]
        for cursor in bad:
            with pytest.raises(ValueError):
                async with rt.stream("s", cursor=cursor):
                    pytest.fail(f"entered with {cursor!r}")
        with pytest.raises(ValueError, match="another session"):
            async with rt.stream("t", cursor=good):
                pytest.fail("entered with another session's cursor")
        with pytest.raises(TypeError):
            async with rt.stream("s", cursor=b"1."):  # type: ignore[arg-type]
                pytest.fail("entered with bytes")
        assert await caught_up(rt, "s", cursor=good) == []
