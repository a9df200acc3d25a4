"""The transcript through the runtime: take_inputs, the fenced assistant writer, at-most-once
tool settlement as a drain defect, zombie writes and interrupt effects."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from helpers import (
    JumpingClock,
    LateReply,
    Raw,
    WrappedStore,
    run_and_jump,
    runtime,
    start_run,
    write_as_zombie,
)
from trio.testing import MockClock

import trio_sessions
from trio_sessions import (
    AssistantData,
    DrainContext,
    DuplicateSettlement,
    MalformedRecord,
    Message,
    Outcome,
    Store,
    TextPart,
    ToolPart,
    UnknownToolCall,
    _store,
)

Clock = Callable[[], float]


async def test_inputs_become_user_messages_in_order(
    store: Store, clock: Clock, autojump_clock: MockClock
) -> None:
    """take_inputs returns pending inputs in seq order and appends each as a user message;
    the assistant reply follows them in the transcript."""
    seen: list[list[str]] = []

    async def drain(ctx: DrainContext) -> None:
        inputs = await ctx.take_inputs()
        seen.append([i.id for i in inputs])
        writer = await ctx.begin_assistant()
        await writer.append_text("a")
        await writer.append_text("b")
        await writer.start_tool("c1", "search", {"q": "x"})
        await writer.settle_tool("c1", {"hits": 2})
        await writer.finish()

    async with runtime(store, drain, clock) as rt:
        async with trio_sessions_producer(store, clock) as producer:
            await producer.submit("s", {"n": 1}, input_id="i1")
            await producer.submit("s", {"n": 2}, input_id="i2")
        await rt.run("s")
        messages = await rt.transcript("s")
    assert seen == [["i1", "i2"]]
    assert [(m.role, m.seq, m.input_id) for m in messages] == [
        ("user", 1, "i1"),
        ("user", 2, "i2"),
        ("assistant", 3, None),
    ]
    assert messages[0].data == {"n": 1}
    assert messages[2].data == AssistantData(
        parts=(
            TextPart("ab"),
            ToolPart("c1", "search", {"q": "x"}, "completed", {"hits": 2}, None),
        ),
        finished=True,
        error=None,
    )


def trio_sessions_producer(store: Store, clock: Clock) -> Any:
    """A producer runtime: it records inputs but never drains them."""
    return trio_sessions.open_runtime(store, None, clock=clock)


SETTLE_TWICE: list[tuple[str, str]] = [
    ("settle", "settle"),
    ("settle", "fail"),
    ("fail", "fail"),
    ("fail", "settle"),
]


@pytest.mark.parametrize(("first", "second"), SETTLE_TWICE)
async def test_second_settlement_fails_the_drain_and_keeps_the_first(
    store: Store, clock: Clock, autojump_clock: MockClock, first: str, second: str
) -> None:
    """Every double settlement raises DuplicateSettlement, fails the drain even if the
    drain swallows it, and the transcript keeps exactly the first settlement (inv. 12)."""

    async def settle(writer: Any, how: str, value: str) -> None:
        if how == "settle":
            await writer.settle_tool("c1", value)
        else:
            await writer.fail_tool("c1", value)

    async def drain(ctx: DrainContext) -> None:
        writer = await ctx.begin_assistant()
        await writer.start_tool("c1", "run", {})
        await settle(writer, first, "first")
        with pytest.raises(DuplicateSettlement):
            await settle(writer, second, "second")
        await writer.finish()  # a drain that carries on is still failed

    async with runtime(store, drain, clock) as rt:
        outcome = await rt.run("s")
        [message] = await rt.transcript("s")
    assert outcome.kind == "failed"
    assert isinstance(outcome.error, DuplicateSettlement)
    [part] = message.data.parts
    if first == "settle":
        assert (part.status, part.output, part.error) == ("completed", "first", None)
    else:
        assert (part.status, part.output, part.error) == ("error", None, "first")


async def test_settling_an_unknown_call_fails_the_drain(
    store: Store, clock: Clock, autojump_clock: MockClock
) -> None:
    """Settling a call id the message never started raises UnknownToolCall and fails it."""

    async def drain(ctx: DrainContext) -> None:
        writer = await ctx.begin_assistant()
        await writer.settle_tool("nope", 1)

    async with runtime(store, drain, clock) as rt:
        outcome = await rt.run("s")
    assert outcome.kind == "failed"
    assert isinstance(outcome.error, UnknownToolCall)


@pytest.mark.parametrize(
    "write",
    [
        lambda ctx, w: w.append_text("late"),
        lambda ctx, w: w.start_tool("c2", "late", {}),
        lambda ctx, w: w.settle_tool("c1", "late"),
        lambda ctx, w: w.finish(),
        lambda ctx, w: ctx.take_inputs(),
        lambda ctx, w: ctx.begin_assistant(),
    ],
    ids=["append_text", "start_tool", "settle_tool", "finish", "take_inputs", "begin_assistant"],
)
async def test_zombie_write_raises_lease_lost_and_stores_nothing(
    store: Store,
    clock: Clock,
    db_path: Path,
    autojump_clock: MockClock,
    write: Callable[[DrainContext, Any], Awaitable[object]],
) -> None:
    """The wall clock passes the lease: the next write of every kind raises LeaseLost and
    nothing is stored (invariant 13)."""
    jumping = JumpingClock(clock)
    jumped = trio.Event()
    errors: list[BaseException] = []

    async def drain(ctx: DrainContext) -> None:
        writer = await ctx.begin_assistant()
        await writer.start_tool("c1", "search", {})
        await write_as_zombie(jumped, lambda: write(ctx, writer), errors)

    def messages() -> list[Any]:
        return Raw(db_path).rows("SELECT id, seq, data FROM session_message ORDER BY seq")

    async with runtime(store, drain, jumping, lease=9.0) as rt:
        before = await run_and_jump(rt, jumping, jumped, messages)
        after = messages()
    assert len(errors) == 1
    assert after == before


async def test_interrupt_during_running_tool(
    store: Store, clock: Clock, autojump_clock: MockClock
) -> None:
    """A user interrupt while a tool runs: that tool ends as error 'interrupted', the
    message finished with error 'interrupted'; a settled tool keeps its settlement."""
    in_tool = trio.Event()

    async def drain(ctx: DrainContext) -> None:
        writer = await ctx.begin_assistant()
        await writer.append_text("checking")
        await writer.start_tool("done", "search", {})
        await writer.settle_tool("done", [1])
        await writer.start_tool("slow", "fetch", {"url": "x"})
        in_tool.set()
        await trio.sleep_forever()

    async with runtime(store, drain, clock) as rt, trio.open_nursery() as nursery:
        outcomes = start_run(nursery, rt, "s")
        await in_tool.wait()
        assert await rt.interrupt("s") is True
        await rt.wait_idle("s")
        [message] = await rt.transcript("s")
    assert outcomes == [Outcome("interrupted", "user")]
    data = message.data
    assert (data.finished, data.error) == (True, "interrupted")
    done, slow = data.parts[1], data.parts[2]
    assert (done.status, done.output) == ("completed", [1])
    assert (slow.status, slow.error) == ("error", "interrupted")


async def test_malformed_row_reported_without_breaking_other_sessions(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """transcript() raises MalformedRecord (not a group) for a corrupt row, and another
    session's transcript still reads."""

    async def drain(ctx: DrainContext) -> None:
        writer = await ctx.begin_assistant()
        await writer.finish()

    async with runtime(store, drain, clock) as rt:
        await rt.run("good")
        await rt.run("bad")
        Raw(db_path).write(
            "UPDATE session_message SET data = '{\"parts\": 3}' WHERE session_id = 'bad'"
        )
        with pytest.raises(MalformedRecord) as caught:
            await rt.transcript("bad")
        assert caught.value.table == "session_message"
        assert any("parts" in reason for reason in caught.value.reasons)
        assert len(await rt.transcript("good")) == 1


async def test_writes_after_finish_are_refused(
    store: Store, clock: Clock, autojump_clock: MockClock
) -> None:
    """A finished message accepts no further write; the error is a ValueError."""
    errors: list[BaseException] = []

    async def drain(ctx: DrainContext) -> None:
        writer = await ctx.begin_assistant()
        await writer.finish()
        try:
            await writer.append_text("more")
        except ValueError as exc:
            errors.append(exc)

    async with runtime(store, drain, clock) as rt:
        assert await rt.run("s") == Outcome("succeeded")
    assert len(errors) == 1 and "finished" in str(errors[0])


async def test_writes_after_finish_raise_a_public_library_error(
    store: Store, clock: Clock, autojump_clock: MockClock
) -> None:
    """Every write to a finished message raises the public MessageFinished, a
    TrioSessionsError, and leaves the message as finished."""
    errors: list[BaseException] = []

    async def drain(ctx: DrainContext) -> None:
        writer = await ctx.begin_assistant()
        await writer.start_tool("c1", "search", {})
        await writer.settle_tool("c1", 1)
        await writer.finish()
        writes: list[Callable[[], Awaitable[object]]] = [
            lambda: writer.append_text("more"),
            lambda: writer.start_tool("c2", "search", {}),
            lambda: writer.settle_tool("c1", 2),
            lambda: writer.finish(),
        ]
        for write in writes:
            try:
                await write()
            except trio_sessions.TrioSessionsError as exc:
                errors.append(exc)

    async with runtime(store, drain, clock) as rt:
        await rt.run("s")
        [message] = await rt.transcript("s")
    assert len(errors) == 4
    assert all(isinstance(e, trio_sessions.MessageFinished) for e in errors)
    assert message.data.finished and message.data.error is None


async def test_a_large_message_let_go_of_at_its_finish_refuses_writes_and_is_shown_whole(
    store: Store, clock: Clock, autojump_clock: MockClock
) -> None:
    """A message whose tool results are over the loop's budget is let go of when it is
    finished (the writer keeps only its text; `AssistantWriter._let_go`). Tools settled in
    parallel tasks while another task finishes it each land or raise `MessageFinished`;
    every write after the finish raises `MessageFinished` and changes nothing; and a local
    watcher's last snapshot of it is the message as stored - never the writer's
    placeholder."""
    big: list[list[int]] = [[] for _ in range(10_000)]  # over `_codec.LOOP_BUDGET_UNITS`
    refused: list[str] = []

    async def drain(ctx: DrainContext) -> None:
        await ctx.take_inputs()
        writer = await ctx.begin_assistant()
        await writer.append_text("Looking")
        for k in range(3):
            await writer.start_tool(f"c{k}", "search", {"q": k})

        async def settle(k: int) -> None:
            try:
                await writer.settle_tool(f"c{k}", big)
            except trio_sessions.MessageFinished:
                refused.append(f"c{k}")

        await settle(0)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(settle, 1)
            nursery.start_soon(writer.finish)
            nursery.start_soon(settle, 2)
        writes: list[tuple[str, Callable[[], Awaitable[object]]]] = [
            ("append", lambda: writer.append_text(" more")),
            ("start", lambda: writer.start_tool("c9", "search", {})),
            ("settle", lambda: writer.settle_tool("c1", big)),
            ("fail", lambda: writer.fail_tool("c2", "late")),
            ("finish", lambda: writer.finish()),
        ]
        for name, write in writes:
            try:
                await write()
            except trio_sessions.MessageFinished:
                refused.append(name)

    seen: list[Message] = []

    async def follow(watcher: trio_sessions._signals.Watcher) -> None:
        async for message in watcher:
            seen.append(message)

    async with runtime(store, drain, clock) as rt, rt.watch("s") as watcher:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(follow, watcher)
            await rt.submit("s", {"text": "go"})
            await rt.wait_idle("s")
            await trio.testing.wait_all_tasks_blocked()
            nursery.cancel_scope.cancel()
        [_, message] = await rt.transcript("s")
    assert refused[-5:] == ["append", "start", "settle", "fail", "finish"]
    data = message.data
    assert isinstance(data, AssistantData) and data.finished and data.error is None
    assert data.parts[0] == TextPart("Looking")
    settled = {p.call_id: p.status for p in data.parts if isinstance(p, ToolPart)}
    assert sorted(settled) == ["c0", "c1", "c2"]
    for call_id, status in settled.items():
        # Landed before the finish, or refused and failed by it - never both, never lost.
        assert (status == "completed") == (call_id not in refused), (call_id, status, refused)
    assert [m for m in seen if m.id == message.id][-1] == message


async def test_a_writer_begun_as_its_drain_returned_is_not_kept_by_the_drains_context(
    store: Store, clock: Clock, autojump_clock: MockClock
) -> None:
    """A task the drain left running (started in a nursery of the caller's) whose
    `begin_assistant` landed just as the drain returned gets a writer that the drain's
    context does not keep. The context had let go of its writers when the drain returned
    (`DrainContext._let_go`), and it kept this one for as long as the context lived, in a
    reference cycle (context <-> writer) that only the garbage collector could free. The
    writer holds little - a message just begun takes no further write - so what it fixes
    is the cycle, and that every writer is let go by its context or by itself."""
    wrapped = WrappedStore(store, lambda inner: LateReply(inner, _store.begin_assistant))
    contexts: list[DrainContext] = []
    begun = trio.Event()

    async with trio.open_nursery() as outside:

        async def begin(ctx: DrainContext) -> None:
            await ctx.begin_assistant()
            begun.set()

        async def drain(ctx: DrainContext) -> None:
            contexts.append(ctx)
            await ctx.take_inputs()
            outside.start_soon(begin, ctx)
            assert wrapped.executor is not None
            await wrapped.executor.committed.wait()

        async with runtime(wrapped, drain, clock) as rt:
            await rt.submit("s", {"text": "hi"})
            await rt.wait_idle("s")  # the drain returned, and its iteration ended
            assert wrapped.executor is not None
            wrapped.executor.answer.set()
            await begun.wait()
    assert contexts[0]._open_writers == {}
