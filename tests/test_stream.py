"""Resumable event streams (DESIGN §5.2): `runtime.stream()` yields events whose application
reproduces `transcript()`, and the cursor of any event resumes with exactly the events after
it - no gap, no duplicate - in this process or another, also after the message finished."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import attrs
import pytest
import trio
import trio.testing
from backends import PgLocation
from helpers import VIRTUAL_TIME_LIMIT, runtime
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from trio.testing import MockClock

import trio_sessions
from trio_sessions import (
    AssistantData,
    DrainContext,
    Runtime,
    StreamEvent,
    TextPart,
    ToolPart,
    testing,
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


def real_store(location: Any) -> Any:
    """The production store (threaded, real time) for the same data."""
    if isinstance(location, PgLocation):
        from trio_sessions._postgres import PostgresStore

        return PostgresStore(location.url, schema=location.schema)
    return str(location)


@contextlib.asynccontextmanager
async def streamed_from_another_runtime(
    location: Any, drain: Callable[[DrainContext], Awaitable[None]]
) -> AsyncIterator[tuple[Runtime, trio_sessions._stream.EventStream]]:
    """A runtime draining with `drain`, and another's stream of session "s" (the change
    signal, not local offers, brings it the writes), once a message was submitted."""
    async with (
        trio_sessions.open_runtime(real_store(location), drain, recovery_interval=60),
        trio_sessions.open_runtime(real_store(location), None) as web,
        web.stream("s") as stream,
    ):
        await web.submit("s", {"q": 1})
        yield web, stream


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


async def test_take_ready_hands_over_the_events_already_here_without_waiting(
    store: Any, clock: Clock, autojump_clock: MockClock
) -> None:
    """After one event, `take_ready()` returns the events that follow it at once - the
    offers of writes made meanwhile - in the order iteration would yield them, so a
    consumer can write them in one go (the chat example's SSE); it never waits or reads,
    and iteration goes on after them."""
    go, written = trio.Event(), trio.Event()

    async def drain(ctx: DrainContext) -> None:
        await ctx.take_inputs()
        writer = await ctx.begin_assistant()
        await go.wait()
        for word in ("one", " two", " three"):
            await writer.append_text(word)
        await writer.finish()
        written.set()

    async with runtime(store, drain, clock) as rt, rt.stream("s") as events:
        await rt.submit("s", {"text": "hello"})
        before: list[StreamEvent] = []
        while not (before and before[-1].seq == 2):
            before.append(await events.__anext__())
        assert events.take_ready() == []  # nothing more yet: no wait, no read
        go.set()
        await written.wait()
        first = await events.__anext__()
        more = events.take_ready()
        assert [(e.kind, e.data) for e in [first, *more]] == [
            ("append", "one"),
            ("append", " two"),
            ("append", " three"),
            ("finish", {"error": None}),
        ]
        assert applied([*before, first, *more]) == await stored(rt)
        with trio.move_on_after(1):
            extra = await events.__anext__()
            raise AssertionError(f"an event after the finish: {extra}")


# ---------------------------------------------------------------------------------------------
# Resuming


async def test_resuming_from_every_cursor_gives_exactly_the_events_after_it(
    store: Any, clock: Clock, autojump_clock: MockClock
) -> None:
    """While the reply is open, a stream opened at any cursor - in this runtime or another on
    the same store - yields exactly the live events after it (from the tool part on, where
    the appends are still stored one by one; before it, the message comes whole), and
    applying them to what the cursor's client held reproduces transcript(). After the finish,
    the cursor just before it resumes with the "finish" alone, each earlier cursor inside
    the reply with one "message" event, and the last cursor with nothing."""
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
            if i == len(live) - 2:  # one step behind: the finish alone
                assert [(e.kind, e.seq, e.data) for e in resumed] == [
                    ("finish", reply_seq, {"error": None})
                ]
            elif i >= 1:  # further inside the reply: the finished message, whole
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
            with pytest.raises(ValueError, match="malformed stream cursor"):
                async with rt.stream("s", cursor=cursor):
                    pytest.fail(f"entered with {cursor!r}")
        with pytest.raises(ValueError, match="another session"):
            async with rt.stream("t", cursor=good):
                pytest.fail("entered with another session's cursor")
        with pytest.raises(TypeError):
            async with rt.stream("s", cursor=b"1."):  # type: ignore[arg-type]
                pytest.fail("entered with bytes")
        assert await caught_up(rt, "s", cursor=good) == []


async def test_a_cursor_naming_its_top_message_with_two_tags_is_malformed(
    store: Any, clock: Clock, autojump_clock: MockClock
) -> None:
    """A cursor whose open message is its top one (the same seq) under another tag than the
    top's names two messages at one seq: no stream makes it, and stream() refuses it with
    ValueError. Found by an audit: it was accepted, and the backends disagreed on it
    (DESIGN §6.20) - SQLite read it as a rewritten transcript (a "truncate" event, then
    every message again), PostgreSQL carried on as if it were sound (its read kept one
    tag per seq, the open message's)."""
    release = trio.Event()

    async def drain(ctx: DrainContext) -> None:
        await ctx.take_inputs()
        writer = await ctx.begin_assistant()
        await writer.append_text("hi")
        await release.wait()
        await writer.finish()

    async with runtime(store, drain, clock) as rt:
        await rt.submit("s", {"text": "q"})
        await trio.testing.wait_all_tasks_blocked()
        [*_, last] = await caught_up(rt, "s")
        head, top, top_tag, held = last.cursor.rsplit(".", 3)
        seq, tag, _ = held.split(":")
        assert seq == top and tag == top_tag  # the open reply is the top message
        for forged in (
            f"{head}.{top}.{'0' * 12}.{held}",
            f"{head}.{top}.{top_tag}.{seq}:{'0' * 12}:1",
        ):
            with pytest.raises(ValueError, match="malformed stream cursor"):
                async with rt.stream("s", cursor=forged):
                    pytest.fail(f"entered with {forged!r}")
        release.set()


# ---------------------------------------------------------------------------------------------
# The property: over random histories, every stream's events reproduce transcript()

# Histories checked per test run, per backend (several per example; the soak runs more:
# TRIO_SESSIONS_STREAM_EXAMPLES). PostgreSQL pays a round trip per statement: fewer there.
EXAMPLES = int(os.environ.get("TRIO_SESSIONS_STREAM_EXAMPLES", "0")) or None

Op = tuple[Any, ...]
_text = st.text(alphabet="ab \n✓", max_size=4)
_op = st.one_of(
    st.just(("submit",)),
    st.just(("take",)),
    st.just(("begin",)),
    st.tuples(st.just("append"), st.integers(0, 3), _text),
    st.tuples(st.just("append"), st.integers(0, 3), _text),
    st.tuples(st.just("start"), st.integers(0, 3)),
    st.tuples(st.just("settle"), st.integers(0, 3), st.integers(0, 3)),
    st.tuples(st.just("fail"), st.integers(0, 3), st.integers(0, 3)),
    st.tuples(st.just("finish"), st.integers(0, 3)),
    st.just(("catch_up",)),
    st.tuples(st.just("resume"), st.integers(0, 3), st.integers(0, 40)),
)


@attrs.frozen
class History:
    """A drain's writes (ops), how it ends, and how far behind a consumer may fall."""

    ops: list[Op]
    ending: str
    max_pending: int


_history = st.builds(
    History,
    ops=st.lists(_op, max_size=24),
    ending=st.sampled_from(["return", "raise", "interrupt"]),
    max_pending=st.sampled_from([1, 3, 1_000]),
)


@attrs.define
class Consumer:
    """A client following a stream: what it holds and the cursors it was given."""

    view: View
    seen: list[tuple[str, View]] = attrs.Factory(list)


@attrs.define
class Player:
    """Plays one history on its own session of a shared runtime (the drain dispatches by
    session), with live consumers, some resumed mid-way from another's cursor."""

    session_id: str
    history: History
    nursery: trio.Nursery
    rt: Runtime | None = None
    consumers: list[Consumer] = attrs.Factory(list)
    writers: list[trio_sessions.AssistantWriter] = attrs.Factory(list)
    tools: dict[int, list[str]] = attrs.Factory(dict)
    calls: int = 0

    async def consume(self, cursor: str | None, view: View) -> None:
        assert self.rt is not None
        consumer = Consumer(dict(view))
        self.consumers.append(consumer)
        async with self.rt.stream(self.session_id, cursor=cursor) as events:
            async for event in events:
                apply(consumer.view, event)
                consumer.seen.append((event.cursor, dict(consumer.view)))

    async def drain(self, ctx: DrainContext) -> None:
        assert self.rt is not None
        self.calls += 1
        if self.calls > 1:  # woken again by its own submits: take them, nothing more
            await ctx.take_inputs()
            return
        for op in self.history.ops:
            await self.step(ctx, op)
        if self.history.ending == "raise":
            raise RuntimeError("the drain failed")
        if self.history.ending == "interrupt":
            await self.rt.interrupt(self.session_id)
            await trio.sleep_forever()

    async def step(self, ctx: DrainContext, op: Op) -> None:
        assert self.rt is not None
        kind, writers = op[0], self.writers
        if len(op) > 1 and not writers and kind != "resume":
            writers.append(await ctx.begin_assistant())  # writer ops need a message
        writer = writers[op[1] % len(writers)] if len(op) > 1 and writers else None
        running = self.tools.get(id(writer), [])
        if kind == "submit":
            await self.rt.submit(self.session_id, {"n": len(self.consumers)})
        elif kind == "take":
            await ctx.take_inputs()
        elif kind == "begin":
            writers.append(await ctx.begin_assistant())
        elif kind == "catch_up":
            await trio.testing.wait_all_tasks_blocked()
        elif kind == "resume":
            # From any cursor another consumer saw so far, while messages are still open.
            source = self.consumers[op[1] % len(self.consumers)]
            cursor, view = source.seen[op[2] % len(source.seen)] if source.seen else (None, {})
            self.nursery.start_soon(self.consume, cursor, view)
        elif writer is None:
            return
        else:
            with contextlib.suppress(trio_sessions.MessageFinished):
                if kind == "append":
                    await writer.append_text(op[2])
                elif kind == "start":
                    call_id = f"c{sum(map(len, self.tools.values()))}"
                    await writer.start_tool(call_id, "tool", {"n": 1})
                    self.tools.setdefault(id(writer), []).append(call_id)
                elif kind in ("settle", "fail") and running:
                    call_id = running.pop(op[2] % len(running))
                    if kind == "settle":
                        await writer.settle_tool(call_id, {"out": op[2]})
                    else:
                        await writer.fail_tool(call_id, "broken")
                elif kind == "finish":
                    await writer.finish()

    async def check(self) -> None:
        """Every consumer holds transcript(); a resume from any cursor one saw brings that
        client's copy to transcript()."""
        assert self.rt is not None
        final = await stored(self.rt, self.session_id)
        for consumer in self.consumers:
            assert consumer.view == final
        for consumer in self.consumers:
            for cursor, view in consumer.seen:
                resumed = await caught_up(self.rt, self.session_id, cursor=cursor)
                assert applied(resumed, view) == final


async def play(store: Any, histories: list[tuple[str, History]]) -> None:
    """Play the histories one after another on one runtime, then check each."""
    limit = trio_sessions._stream.MAX_PENDING_OFFERS
    players: dict[str, Player] = {}

    async def drain(ctx: DrainContext) -> None:
        await players[ctx.session_id].drain(ctx)

    try:
        async with (
            trio.open_nursery() as nursery,
            trio_sessions.open_runtime(store, drain, clock=testing.trio_clock()) as rt,
        ):
            for session_id, history in histories:
                player = players[session_id] = Player(session_id, history, nursery, rt)
                trio_sessions._stream.MAX_PENDING_OFFERS = history.max_pending
                nursery.start_soon(player.consume, None, {})
                await trio.testing.wait_all_tasks_blocked()
                await rt.submit(session_id, {"n": 0})
                await rt.wait_idle(session_id)
                await trio.testing.wait_all_tasks_blocked()
                await player.check()
            nursery.cancel_scope.cancel()
    finally:
        trio_sessions._stream.MAX_PENDING_OFFERS = limit


@pytest.mark.slow
def test_over_random_histories_every_stream_reproduces_the_transcript(
    store: Any, backend: str
) -> None:
    """Random appends (empty ones too), tool starts, settlements and failures, finishes,
    new messages, several open messages, drains that return, fail or are interrupted,
    consumers that fall behind (offers dropped) and consumers resumed mid-way from another's
    cursor: every consumer ends holding exactly transcript(), and a stream resumed from any
    cursor any of them saw brings that client's copy to exactly transcript()."""
    sessions = itertools.count()
    examples = EXAMPLES or (200 if backend == "sqlite" else 25)

    @settings(
        max_examples=examples,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        database=None,
    )
    @given(st.lists(_history, min_size=1, max_size=6))
    def check(histories: list[History]) -> None:
        async def main() -> None:
            with trio.fail_after(VIRTUAL_TIME_LIMIT):  # a hang fails the example
                await play(store, [(f"h{next(sessions)}", history) for history in histories])

        trio.run(main, clock=MockClock(autojump_threshold=0))

    check()


# ---------------------------------------------------------------------------------------------
# Rewrites, other processes, bytes


async def test_a_stream_of_a_purged_session_learns_it_at_once(
    store: Any, clock: Clock, autojump_clock: MockClock
) -> None:
    """`purge` deletes sessions as `delete_session` does, but told no stream of this
    runtime, so a stream open here on a purged conversation showed its messages until the
    change loop's fallback poll (2 s on the threaded stores), and on the inline SQLite store
    never. Found by an audit. It now sends "truncate" at once, as after `delete_session`
    (the control half)."""

    async def drain(ctx: DrainContext) -> None:
        if await ctx.take_inputs():
            reply = await ctx.begin_assistant()
            await reply.append_text("re")
            await reply.finish()

    async def last_kind_after(rt: Any, session_id: str, erase: Any) -> str:
        kinds: list[str] = []
        async with rt.stream(session_id) as events:

            async def follow() -> None:
                async for event in events:
                    kinds.append(event.kind)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(follow)
                await trio.testing.wait_all_tasks_blocked()
                assert kinds == ["message", "message"]
                await erase()
                with trio.move_on_after(0.5):  # well before the fallback poll (2 s)
                    while kinds[-1] != "truncate":
                        await trio.sleep(0.01)
                nursery.cancel_scope.cancel()
        return kinds[-1]

    async with runtime(store, drain, clock) as rt:
        for session_id in ("deleted", "purged"):
            await rt.submit(session_id, {"n": 1})
            await rt.wait_idle(session_id)
        await trio.sleep(100)
        deleted = await last_kind_after(rt, "deleted", lambda: rt.delete_session("deleted"))
        purged = await last_kind_after(rt, "purged", lambda: rt.purge(idle_for=50))
        assert await rt.transcript("purged") == []
    assert deleted == "truncate"
    assert purged == "truncate"


async def test_a_truncated_or_deleted_transcript_reaches_live_and_resumed_streams(
    store: Any, clock: Clock, autojump_clock: MockClock
) -> None:
    """truncate() and delete_session() rewrite what a client holds: a live stream, and one
    resumed from a cursor of before, send "truncate" and then the messages as they are now,
    so the client's copy is transcript() again."""

    async def drain(ctx: DrainContext) -> None:
        for taken in await ctx.take_inputs():
            writer = await ctx.begin_assistant()
            await writer.append_text(f"re: {taken.payload['text']}")
            await writer.finish()

    async with runtime(store, drain, clock) as rt:
        for text in ("one", "two", "three"):
            await rt.submit("s", {"text": text})
            await rt.wait_idle("s")
        before = await caught_up(rt)
        assert applied(before) == await stored(rt)
        for rewrite in ("truncate", "delete"):
            async with rt.stream("s", cursor=before[-1].cursor) as events:
                if rewrite == "truncate":
                    assert await rt.truncate("s", after_seq=2) == 4
                    await rt.submit("s", {"text": "edited"})
                else:
                    assert await rt.delete_session("s")
                await rt.wait_idle("s")
                await trio.testing.wait_all_tasks_blocked()
                now = await stored(rt)
                live: list[StreamEvent] = []
                while applied(live, applied(before)) != now:
                    live.append(await events.__anext__())
            assert live[0].kind == "truncate"
            resumed = await caught_up(rt, cursor=before[-1].cursor)
            assert resumed[0].kind == "truncate"
            assert applied(resumed, applied(before)) == now
            before = await caught_up(rt)
        assert applied(before) == {}


async def test_a_stream_open_for_a_long_conversation_keeps_nothing_per_finished_reply(
    store: Any, clock: Clock, autojump_clock: MockClock
) -> None:
    """A chat page's stream stays open for a whole conversation while its consumer reads
    each reply only once it finished (its offers found the stream due to read first): the
    stream still reproduces transcript(), and once every reply finished it holds nothing
    per reply - its memory follows the open messages, not the messages ever streamed."""

    async def drain(ctx: DrainContext) -> None:
        for taken in await ctx.take_inputs():
            writer = await ctx.begin_assistant()
            await writer.append_text(f"re: {taken.payload['turn']}")
            await writer.append_text(".")
            await writer.finish()

    got: list[StreamEvent] = []

    async def collect(events: trio_sessions._stream.EventStream) -> None:
        async for event in events:
            got.append(event)

    async with runtime(store, drain, clock) as rt, rt.stream("s") as events:
        for turn in range(25):
            await rt.submit("s", {"turn": turn})
            await rt.wait_idle("s")
            async with trio.open_nursery() as nursery:  # the consumer, one reply behind
                nursery.start_soon(collect, events)
                await trio.testing.wait_all_tasks_blocked()
                nursery.cancel_scope.cancel()
        assert applied(got) == await stored(rt)
        assert len(got) >= 50
        assert events._open == {}
        assert events._offered == {}


@pytest.mark.parametrize("backend", ["sqlite", "postgres"], indirect=True)
async def test_a_stream_follows_another_runtimes_writes_one_append_at_a_time(
    db_path: Any,
) -> None:
    """Another runtime on the same store (the change signal, not local offers) streams a
    reply after a 200 KB tool result: the stream's "append" events carry exactly the
    appended words (a few dozen bytes each, not the message), and a third runtime resumed
    from a cursor in the middle ends with transcript(). Real time, bounded."""
    words = [f"word{n} " for n in range(10)]
    big = {"result": "x" * 200_000}
    steps = [trio.Event() for _ in range(len(words) + 1)]  # the last one: the finish

    async def drain(ctx: DrainContext) -> None:
        await ctx.take_inputs()
        writer = await ctx.begin_assistant()
        await writer.start_tool("c1", "fetch", {})
        await writer.settle_tool("c1", big)
        for word, step in zip(words, steps, strict=False):
            await step.wait()
            await writer.append_text(word)
        await steps[-1].wait()
        await writer.finish()

    events: list[StreamEvent] = []
    with trio.fail_after(REAL_TIME_BOUND):
        async with streamed_from_another_runtime(db_path, drain) as (web, stream):
            async for event in stream:
                events.append(event)
                if event.kind == "finish":
                    break
                tool = event.data if event.kind == "part" else None
                if event.kind == "message" and event.role == "assistant" and event.data.parts:
                    tool = event.data.parts[-1]
                if isinstance(tool, ToolPart) and tool.status == "completed":
                    steps[0].set()  # the tool result is seen: now the words, one by one
                if event.kind == "append":
                    seen = sum(e.kind == "append" for e in events)
                    if seen < len(steps):
                        steps[seen].set()
            final = await stored(web)
            assert applied(events) == final
        appends = [event for event in events if event.kind == "append"]
        assert "".join(event.data for event in appends) == "".join(words)
        assert len(appends) == len(words)  # each one seen by itself, none sent whole
        for event in appends:
            assert len(json.dumps(event.to_json())) < 200 + len(event.cursor)
        middle = appends[len(appends) // 2]
        async with (
            trio_sessions.open_runtime(real_store(db_path), None) as third,
            third.stream("s", cursor=middle.cursor) as resumed,
        ):
            view = applied(events[: events.index(middle) + 1])
            while view != final:
                apply(view, await resumed.__anext__())


@pytest.mark.parametrize("backend", ["sqlite", "postgres"], indirect=True)
async def test_another_runtimes_tool_changes_and_finish_reach_a_stream_as_part_and_finish(
    db_path: Any,
) -> None:
    """DESIGN §5.2: a tool change is one "part" event and a finish one "finish" event, for a
    stream in another runtime too - not the whole message again (after a 200 KB tool
    result, each would be 200 KB: a message with k tool calls sent some 2k times). A stream
    resumed from the cursor just before the finish gets the same "finish". Real time,
    bounded."""
    big = {"result": "x" * 200_000}
    steps = [trio.Event() for _ in range(4)]

    async def drain(ctx: DrainContext) -> None:
        await ctx.take_inputs()
        writer = await ctx.begin_assistant()
        await writer.start_tool("c1", "fetch", {})
        await writer.settle_tool("c1", big)
        await steps[0].wait()
        await writer.start_tool("c2", "look", {"q": 1})
        await steps[1].wait()
        await writer.settle_tool("c2", {"ok": True})
        await steps[2].wait()
        await writer.append_text("done")
        await steps[3].wait()
        await writer.finish()

    def reached(view: View) -> int:
        """How many of the drain's gated steps the client's copy shows done."""
        assistant = [data for role, data in view.values() if role == "assistant"]
        if not assistant:
            return 0
        data = assistant[-1]
        status = {p.call_id: p.status for p in data.parts if isinstance(p, ToolPart)}
        return sum(
            [
                status.get("c1") == "completed",
                "c2" in status,
                status.get("c2") == "completed",
                text_of(data) == "done",
            ]
        )

    events: list[StreamEvent] = []
    with trio.fail_after(REAL_TIME_BOUND):
        async with streamed_from_another_runtime(db_path, drain) as (web, stream):
            view: View = {}
            gated = first_gated = 0
            async for event in stream:
                events.append(event)
                apply(view, event)
                if event.kind == "finish" or (
                    event.kind == "message" and getattr(event.data, "finished", False)
                ):
                    break
                while gated < len(steps) and reached(view) > gated:
                    steps[gated].set()
                    gated += 1
                    if gated == 1:
                        first_gated = len(events)
            final = await stored(web)
        assert applied(events) == final
        later = events[first_gated:]
        assert [event.kind for event in later] == ["part", "part", "append", "finish"]
        for event in later:
            assert len(json.dumps(event.to_json())) < 300 + len(event.cursor), event
        async with (
            trio_sessions.open_runtime(real_store(db_path), None) as third,
            third.stream("s", cursor=later[-2].cursor) as resumed,
        ):
            last = await resumed.__anext__()
        assert last.kind == "finish"
        assert applied([last], applied(events[:-1])) == final


async def test_a_stream_or_watch_of_a_closed_runtime_raises_store_error(
    store: Any, clock: Clock, autojump_clock: MockClock
) -> None:
    """A `stream()` or `watch()` entered once the runtime closed - a web handler's
    reconnect loop, say - raises `StoreError` at once, as a write would, on both backends:
    it hung (nothing feeds a stream of a closed runtime) or raised the driver's
    ProgrammingError. A transcript read raises it too."""
    async with runtime(store, None, clock) as rt:
        await rt.submit("s", {"n": 1})
    with trio.fail_after(5):
        with pytest.raises(trio_sessions.StoreError, match="closed"):
            async with rt.stream("s"):
                pass  # pragma: no cover
        with pytest.raises(trio_sessions.StoreError, match="closed"):
            async with rt.watch("s"):
                pass  # pragma: no cover
        with pytest.raises(trio_sessions.StoreError, match="closed"):
            await rt.transcript("s")


@pytest.mark.parametrize("seq", [2**62, 2**63 - 1])
async def test_a_cursor_naming_a_message_at_a_19_digit_seq_resumes(
    store: Any, db_path: Any, clock: Clock, autojump_clock: MockClock, seq: int
) -> None:
    """DESIGN §5.2: "with the cursor of any event it earlier yielded it continues with
    exactly the events after that one". A message another tool wrote at a 19-digit seq is
    streamed, but the cursor grammar took at most 18 digits: the cursor of its event was
    refused by the very stream that made it ("malformed stream cursor", ValueError - an
    SSE client's reconnect gets a 400). (A review's test; its seq -2**62 case is now a
    malformed row, refused by both `transcript()` and `stream()`.)"""
    from helpers import Raw, Recorder

    raw = Raw(db_path)
    async with runtime(store, Recorder(), clock, recovery_interval=10_000.0) as rt:
        raw.seed_user_message("s", "far", seq)
        first = await caught_up(rt)
        assert [event.seq for event in first] == [seq]
        assert await caught_up(rt, cursor=first[-1].cursor) == []


def test_a_cursor_past_64_bits_is_refused() -> None:
    """A 19-digit number above the largest 64-bit integer is no seq or version."""
    tag = trio_sessions._stream.session_tag("s")
    with pytest.raises(ValueError, match="malformed stream cursor"):
        trio_sessions._stream.decode_cursor("s", f"1.{tag}.{2**63}.{'0' * 12}.")
    assert trio_sessions._stream.decode_cursor("s", f"1.{tag}.{2**63 - 1}.{'0' * 12}.").top == (
        2**63 - 1
    )
