"""A drain's call after one whose outcome is unknown (DESIGN §8 "Uncertain commits": read the
state back before acting; §6.20: one contract on both backends).

`OutcomeUnknown` is the `StoreError` of a call that may or may not have landed (on
PostgreSQL, a COMMIT whose reply was lost and could not be read back; `test_pg_lost_replies`
loses real connections). Here the loss is made at the runtime's store executor - the
operation ran, or did not, then `OutcomeUnknown` - so every case runs on both backends, in
virtual time: the same call again lands once, another call applies to the message as
stored, and `take_inputs` returns what the lost call took, never twice and never what an
earlier call already returned.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from trio.testing import MockClock

from trio_sessions import (
    AssistantWriter,
    DrainContext,
    Input,
    StoreError,
    TextPart,
    ToolPart,
    _store,
    open_runtime,
)
from trio_sessions import testing as ts_testing
from trio_sessions._coordinator import Takes
from trio_sessions._errors import OutcomeUnknown
from trio_sessions._model import UNSETTLED_AT_FINISH


class LostReplies:
    """The runtime's store executor with one planned call answered by `OutcomeUnknown`:
    after it ran (`landed`) or without running it. Everything else goes to the executor."""

    def __init__(self, runtime: Any) -> None:
        self._executor = runtime._db
        self.plan: tuple[Any, bool] | None = None
        runtime._db = self

    def __getattr__(self, name: str) -> Any:
        return getattr(self._executor, name)

    def lose(
        self,
        operation: Any,
        *,
        landed: bool,
        hold: tuple[trio.Event, trio.Event] | None = None,
    ) -> None:
        """Lose the next call of `operation`; with `hold` (ran, release), the lost call sets
        `ran` once it ran (or not) and waits for `release` before raising - the reply on
        its way while other calls go on."""
        self.plan = (operation, landed)
        self.hold = hold

    hold: tuple[trio.Event, trio.Event] | None = None

    async def run(self, operation: Any, *args: Any) -> Any:
        if self.plan is not None and self.plan[0] is operation:
            landed, self.plan = self.plan[1], None
            hold, self.hold = self.hold, None
            if landed:
                await self._executor.run(operation, *args)
            if hold is not None:
                hold[0].set()
                await hold[1].wait()
            raise OutcomeUnknown("the outcome of a COMMIT is unknown (a reply lost, for a test)")
        return await self._executor.run(operation, *args)


Step = Callable[[AssistantWriter], Awaitable[None]]

WRITES: dict[str, tuple[Any, Step]] = {
    "append_text": (_store.append_assistant_text, lambda w: w.append_text(" more")),
    "start_tool": (_store.update_assistant, lambda w: w.start_tool("c2", "echo", {"x": 2})),
    "settle_tool": (_store.update_assistant, lambda w: w.settle_tool("c1", "ok")),
    "fail_tool": (_store.update_assistant, lambda w: w.fail_tool("c1", "broke")),
    "finish": (_store.update_assistant, lambda w: w.finish()),
}


async def run_drain(
    store: Any, drain: Callable[[DrainContext, LostReplies], Awaitable[None]]
) -> Any:
    """Run `drain` once on session 's' with input 'i1'; returns (outcome, transcript)."""
    lost: list[LostReplies] = []

    async def wrapped(ctx: DrainContext) -> None:
        await drain(ctx, lost[0])

    async with open_runtime(store, wrapped, clock=ts_testing.trio_clock(), lease=30.0) as rt:
        lost.append(LostReplies(rt))
        await rt.submit("s", {"n": 1}, input_id="i1")
        outcome = await rt.run("s")
        return outcome, await rt.transcript("s")


async def opened(ctx: DrainContext) -> AssistantWriter:
    """The message every write case starts from: text 'answer' and tool c1 running."""
    await ctx.take_inputs()
    writer = await ctx.begin_assistant()
    await writer.append_text("answer")
    await writer.start_tool("c1", "echo", {"x": 1})
    return writer


@pytest.mark.parametrize("landed", [True, False], ids=["landed", "not-landed"])
@pytest.mark.parametrize("write", list(WRITES))
async def test_the_same_write_again_lands_once(
    store: Any, autojump_clock: MockClock, write: str, landed: bool
) -> None:
    """A write answered `OutcomeUnknown`, called again: the message holds its effect once,
    whether or not the lost call had landed."""
    operation, step = WRITES[write]
    errors: list[BaseException] = []

    async def drain(ctx: DrainContext, lost: LostReplies) -> None:
        writer = await opened(ctx)
        lost.lose(operation, landed=landed)
        try:
            await step(writer)
        except StoreError as exc:
            errors.append(exc)
            await step(writer)
        if write != "finish":
            await writer.finish()

    outcome, messages = await run_drain(store, drain)
    assert outcome.kind == "succeeded", outcome
    assert len(errors) == 1 and isinstance(errors[0], OutcomeUnknown)
    answer = messages[-1].data
    assert answer.finished and answer.error is None
    unsettled = UNSETTLED_AT_FINISH
    c1 = {
        "settle_tool": ToolPart("c1", "echo", {"x": 1}, "completed", "ok", None),
        "fail_tool": ToolPart("c1", "echo", {"x": 1}, "error", None, "broke"),
    }.get(write, ToolPart("c1", "echo", {"x": 1}, "error", None, unsettled))
    expected: list[Any] = [TextPart("answer"), c1]
    if write == "append_text":
        expected.append(TextPart(" more"))
    if write == "start_tool":
        expected.append(ToolPart("c2", "echo", {"x": 2}, "error", None, unsettled))
    assert list(answer.parts) == expected


@pytest.mark.parametrize("landed", [True, False], ids=["landed", "not-landed"])
async def test_another_write_after_an_unknown_one_applies_to_the_message_as_stored(
    store: Any, autojump_clock: MockClock, landed: bool
) -> None:
    """After an append answered `OutcomeUnknown`, the drain moves on (another append, then
    a tool call and the finish): the message is what is stored - the lost text kept if it
    landed, not written over by the writer's older copy."""

    async def drain(ctx: DrainContext, lost: LostReplies) -> None:
        writer = await opened(ctx)
        await writer.settle_tool("c1", "ok")
        lost.lose(_store.append_assistant_text, landed=landed)
        with pytest.raises(OutcomeUnknown):
            await writer.append_text(" lost")
        await writer.append_text(" next")
        await writer.start_tool("c2", "echo", {"x": 2})
        await writer.settle_tool("c2", "ok")
        await writer.finish()

    outcome, messages = await run_drain(store, drain)
    assert outcome.kind == "succeeded", outcome
    parts = messages[-1].data.parts
    assert [p.text for p in parts if isinstance(p, TextPart)] == [
        "answer",
        " lost next" if landed else " next",
    ]
    assert [(p.call_id, p.status) for p in parts if isinstance(p, ToolPart)] == [
        ("c1", "completed"),
        ("c2", "completed"),
    ]


async def test_a_retried_append_lands_once_though_another_tasks_tool_call_came_between(
    store: Any, autojump_clock: MockClock
) -> None:
    """A task's append answers `OutcomeUnknown` but landed; another task settles a tool
    (which reads the message back); the first task retries its append. It was stored twice:
    any call that went on to write made the writer forget the landed append (a review's
    find). Only another append does: text streams in order from one task."""

    async def drain(ctx: DrainContext, lost: LostReplies) -> None:
        writer = await opened(ctx)
        lost.lose(_store.append_assistant_text, landed=True)
        with pytest.raises(OutcomeUnknown):
            await writer.append_text(" x")
        await writer.settle_tool("c1", "ok")  # another task's settlement in between
        await writer.append_text(" x")  # the first task's retry
        await writer.finish()

    outcome, messages = await run_drain(store, drain)
    assert outcome.kind == "succeeded", outcome
    texts = [part.text for part in messages[-1].data.parts if isinstance(part, TextPart)]
    assert texts == ["answer", " x"], texts


async def test_an_append_found_landed_is_not_swallowed_when_the_same_text_comes_later(
    store: Any, autojump_clock: MockClock
) -> None:
    """Found by an audit. An append answered `OutcomeUnknown` that did land, after which the
    drain moves on (it never calls that append again): the next call reads the message back
    and writes, and a later append of the same text - a common token such as " the" - is a
    new write, stored. It was taken for the lost call's retry (the landed call was kept
    until an identical one came, however much later) and silently dropped."""

    async def drain(ctx: DrainContext, lost: LostReplies) -> None:
        writer = await opened(ctx)
        await writer.settle_tool("c1", "ok")
        lost.lose(_store.append_assistant_text, landed=True)
        with pytest.raises(OutcomeUnknown):
            await writer.append_text(" the")
        await writer.append_text(" cat sat on")  # another call: reads the message back
        await writer.append_text(" the")  # a new token that happens to repeat the lost one
        await writer.append_text(" mat")
        await writer.finish()

    outcome, messages = await run_drain(store, drain)
    assert outcome.kind == "succeeded", outcome
    texts = [p.text for p in messages[-1].data.parts if isinstance(p, TextPart)]
    assert texts == ["answer", " the cat sat on the mat"]


@pytest.mark.parametrize("landed", [True, False], ids=["landed", "not-landed"])
async def test_begin_assistant_again_after_an_unknown_one_begins_one_message(
    store: Any, autojump_clock: MockClock, landed: bool
) -> None:
    """`begin_assistant` answered `OutcomeUnknown`, called again: one assistant message -
    the lost call's, if it landed - written through the writer it returns, and no empty
    message left behind for the runtime to close."""
    begun: list[str] = []

    async def drain(ctx: DrainContext, lost: LostReplies) -> None:
        await ctx.take_inputs()
        lost.lose(_store.begin_assistant, landed=landed)
        with pytest.raises(OutcomeUnknown):
            await ctx.begin_assistant()
        writer = await ctx.begin_assistant()
        begun.append(writer.message_id)
        await writer.append_text("hello")
        await writer.finish()

    outcome, messages = await run_drain(store, drain)
    assert outcome.kind == "succeeded", outcome
    assert [(m.role, m.id) for m in messages] == [("user", messages[0].id), ("assistant", begun[0])]
    assert messages[1].data.parts == (TextPart("hello"),) and messages[1].data.error is None


@pytest.mark.parametrize("landed", [True, False], ids=["landed", "not-landed"])
async def test_take_inputs_after_an_unknown_one_returns_what_it_took_once(
    store: Any, autojump_clock: MockClock, landed: bool
) -> None:
    """A second iteration's `take_inputs` answered `OutcomeUnknown`: the next call returns
    the input the lost call took (or takes it, if that call did not land) - not the first
    iteration's input again, and not nothing - and the call after returns []."""
    taken: list[list[str]] = []
    second = trio.Event()

    async def drain(ctx: DrainContext, lost: LostReplies) -> None:
        if not taken:
            taken.append([i.id for i in await ctx.take_inputs()])
            await ctx._runtime.submit("s", {"n": 2}, input_id="i2")  # a next iteration
            return
        lost.lose(_store.take_inputs, landed=landed)
        with pytest.raises(OutcomeUnknown):
            await ctx.take_inputs()
        taken.append([i.id for i in await ctx.take_inputs()])
        taken.append([i.id for i in await ctx.take_inputs()])
        second.set()

    outcome, messages = await run_drain(store, drain)
    assert second.is_set()
    assert outcome.kind == "succeeded", outcome
    assert taken == [["i1"], ["i2"], []]
    assert [m.input_id for m in messages if m.role == "user"] == ["i1", "i2"]


async def test_inputs_taken_by_reads_only_this_claims_user_messages(
    store: Any, autojump_clock: MockClock
) -> None:
    """The read-back itself: this execution's user messages from a position on, in seq
    order, as stored - not an earlier execution's of the same session."""
    seen: list[list[tuple[str, Any]]] = []

    async def drain(ctx: DrainContext) -> None:
        await ctx.take_inputs()
        claim = (ctx.session_id, ctx.execution_id, ctx.owner_id)
        seen.append(await ctx._runtime._db.run(_store.inputs_taken_by, *claim, 0))
        seen.append(await ctx._runtime._db.run(_store.inputs_taken_by, *claim, 1))

    async with open_runtime(store, drain, clock=ts_testing.trio_clock(), lease=30.0) as rt:
        for n in (1, 2):
            await rt.submit("s", {"n": n}, input_id=f"i{n}")
            assert (await rt.run("s")).kind == "succeeded"
    assert [[(key, json.loads(data)) for key, data in read] for read in seen] == [
        [("i1", {"n": 1})],
        [],
        [("i2", {"n": 2})],
        [],
    ]


def assert_both_settled(outcome: Any, messages: list[Any]) -> None:
    """The drain succeeded, tools c1 and c2 completed once each."""
    assert outcome.kind == "succeeded", outcome
    parts = messages[-1].data.parts
    assert [(p.call_id, p.status, p.output) for p in parts if isinstance(p, ToolPart)] == [
        ("c1", "completed", "ok"),
        ("c2", "completed", "ok2"),
    ]


async def test_a_settlement_lost_while_another_task_settles_then_called_again_lands_once(
    store: Any, autojump_clock: MockClock
) -> None:
    """Two tool calls settled from two tasks (tools run in parallel): c1's settlement is
    answered `OutcomeUnknown` after it landed, c2's lands meanwhile; c1's again is a
    no-op - the drain succeeds with both completed, not failed by `DuplicateSettlement`."""
    errors: list[BaseException] = []

    async def drain(ctx: DrainContext, lost: LostReplies) -> None:
        writer = await opened(ctx)
        await writer.start_tool("c2", "echo", {"x": 2})
        ran, release = trio.Event(), trio.Event()
        lost.lose(_store.update_assistant, landed=True, hold=(ran, release))

        async def settle_c1() -> None:
            try:
                await writer.settle_tool("c1", "ok")
            except OutcomeUnknown as exc:
                errors.append(exc)
                await writer.settle_tool("c1", "ok")

        async def settle_c2() -> None:
            await ran.wait()
            try:
                await writer.settle_tool("c2", "ok2")
            finally:
                release.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(settle_c1)
            nursery.start_soon(settle_c2)
        await writer.finish()

    outcome, messages = await run_drain(store, drain)
    assert len(errors) == 1
    assert_both_settled(outcome, messages)


async def test_take_inputs_lost_while_another_task_takes_returns_each_input_once(
    store: Any, autojump_clock: MockClock
) -> None:
    """Two tasks take inputs one at a time: the first's call is answered `OutcomeUnknown`
    after it took i2, the second's takes i3 meanwhile; the first's next call returns i2 -
    each input returned once, none never."""
    taken: list[str] = []
    done: list[bool] = []

    async def drain(ctx: DrainContext, lost: LostReplies) -> None:
        if done:
            taken.extend(i.id for i in await ctx.take_inputs())
            return
        done.append(True)
        taken.extend(i.id for i in await ctx.take_inputs())
        await ctx._runtime.submit("s", {"n": 2}, input_id="i2")
        await ctx._runtime.submit("s", {"n": 3}, input_id="i3")
        ran, release = trio.Event(), trio.Event()
        lost.lose(_store.take_inputs, landed=True, hold=(ran, release))

        async def first() -> None:
            with pytest.raises(OutcomeUnknown):
                await ctx.take_inputs(limit=1)
            taken.extend(i.id for i in await ctx.take_inputs(limit=1))

        async def second() -> None:
            await ran.wait()
            try:
                taken.extend(i.id for i in await ctx.take_inputs(limit=1))
            finally:
                release.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(first)
            nursery.start_soon(second)
        taken.extend(i.id for i in await ctx.take_inputs())

    outcome, messages = await run_drain(store, drain)
    assert outcome.kind == "succeeded", outcome
    assert [m.input_id for m in messages if m.role == "user"] == ["i1", "i2", "i3"]
    assert sorted(taken) == ["i1", "i2", "i3"]


async def test_take_inputs_after_an_unknown_one_returns_at_most_its_limit(
    store: Any, autojump_clock: MockClock
) -> None:
    """A `take_inputs()` that took three inputs is answered `OutcomeUnknown`; the next call,
    `take_inputs(limit=1)`, returns at most one of them - the rest come with the calls
    after, each once."""
    calls: list[list[str]] = []
    done: list[bool] = []

    async def drain(ctx: DrainContext, lost: LostReplies) -> None:
        if done:
            return
        done.append(True)
        await ctx.take_inputs()
        for n in (2, 3, 4):
            await ctx._runtime.submit("s", {"n": n}, input_id=f"i{n}")
        lost.lose(_store.take_inputs, landed=True)
        with pytest.raises(OutcomeUnknown):
            await ctx.take_inputs()
        while batch := await ctx.take_inputs(limit=1):
            calls.append([i.id for i in batch])

    outcome, _ = await run_drain(store, drain)
    assert outcome.kind == "succeeded", outcome
    assert calls == [["i2"], ["i3"], ["i4"]]


async def test_begin_assistant_after_an_unknown_one_and_a_take_answers_after_the_input(
    store: Any, autojump_clock: MockClock
) -> None:
    """`begin_assistant` answered `OutcomeUnknown` after it landed, then the drain takes a
    newer input and begins its answer: the message it writes comes after that input in the
    transcript, not before the input it answers."""
    done: list[bool] = []

    async def drain(ctx: DrainContext, lost: LostReplies) -> None:
        if done:
            return
        done.append(True)
        await ctx.take_inputs()
        await ctx._runtime.submit("s", {"n": 2}, input_id="i2")
        lost.lose(_store.begin_assistant, landed=True)
        with pytest.raises(OutcomeUnknown):
            await ctx.begin_assistant()
        assert [i.id for i in await ctx.take_inputs()] == ["i2"]
        writer = await ctx.begin_assistant()
        await writer.append_text("answer to i2")
        await writer.finish()

    outcome, messages = await run_drain(store, drain)
    assert outcome.kind == "succeeded", outcome
    i2 = next(m.seq for m in messages if m.input_id == "i2")
    answer = next(m for m in messages if m.role == "assistant" and m.data.parts)
    assert answer.data.parts == (TextPart("answer to i2"),)
    assert answer.seq > i2, [(m.seq, m.role, m.input_id) for m in messages]


async def test_take_inputs_lost_as_the_execution_ends_is_given_to_the_next_drain(
    store: Any, autojump_clock: MockClock
) -> None:
    """A drain whose `take_inputs` is answered `OutcomeUnknown` after it took i2 catches it
    and returns. A review found i2 then never given to a drain (the busy period ended and
    its read-back with it; the next wake's drain got only i3). Now the busy period goes on
    once for it: the next iteration, in the same execution, is given i2, and the next
    wake's drain i3 - each input given once."""
    handed: list[tuple[int, str]] = []  # (drain call, input id)
    lost: list[LostReplies] = []
    drains: list[str] = []

    async def drain(ctx: DrainContext) -> None:
        drains.append(ctx.execution_id)
        if len(drains) == 1:
            handed.extend((1, i.id) for i in await ctx.take_inputs())
            await ctx._runtime.submit("s", {"n": 2}, input_id="i2")  # the next iteration
            return
        if len(drains) == 2:
            lost[0].lose(_store.take_inputs, landed=True)
            with pytest.raises(OutcomeUnknown):
                await ctx.take_inputs()
            return  # nothing rang meanwhile
        while batch := await ctx.take_inputs():
            handed.extend((len(drains), i.id) for i in batch)

    async with open_runtime(store, drain, clock=ts_testing.trio_clock(), lease=30.0) as rt:
        lost.append(LostReplies(rt))
        await rt.submit("s", {"n": 1}, input_id="i1")
        assert (await rt.run("s")).kind == "succeeded"
        await rt.submit("s", {"n": 3}, input_id="i3")
        assert (await rt.run("s")).kind == "succeeded"
        messages = await rt.transcript("s")
    assert len(drains) == 4 and drains[0] == drains[1] == drains[2] != drains[3]
    assert [m.input_id for m in messages if m.role == "user"] == ["i1", "i2", "i3"]
    assert handed == [(1, "i1"), (3, "i2"), (4, "i3")]


async def test_a_drain_that_never_takes_again_after_an_unknown_take_is_called_once_more(
    store: Any, autojump_clock: MockClock
) -> None:
    """The busy period goes on once for an unsure take, not for ever: a drain that returns
    again without calling `take_inputs` ends it (the input stays a user message, found in
    `transcript()`)."""
    lost: list[LostReplies] = []
    calls: list[str] = []

    async def drain(ctx: DrainContext) -> None:
        calls.append(ctx.execution_id)
        if len(calls) == 1:
            lost[0].lose(_store.take_inputs, landed=True)
            with pytest.raises(OutcomeUnknown):
                await ctx.take_inputs()

    async with open_runtime(store, drain, clock=ts_testing.trio_clock(), lease=30.0) as rt:
        lost.append(LostReplies(rt))
        await rt.submit("s", {"n": 1}, input_id="i1")
        assert (await rt.run("s")).kind == "succeeded"
        messages = await rt.transcript("s")
    assert len(calls) == 2 and calls[0] == calls[1]
    assert [m.input_id for m in messages if m.role == "user"] == ["i1"]


# ---------------------------------------------------------------------------------------------
# `Takes`, the pure bookkeeping behind take_inputs' read-back: calls at once, in any order


@settings(max_examples=300, deadline=None, database=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["start", "land", "lose-landed", "lose-unlanded"]),
            st.integers(0, 3),  # which running call
            st.integers(1, 3),  # its limit
        ),
        max_size=30,
    )
)
def test_takes_gives_every_taken_input_once_whatever_the_interleaving(
    steps: list[tuple[str, int, int]],
) -> None:
    """Calls of `take_inputs` start, land (the store takes up to `limit` new inputs as user
    messages) or are lost (landed or not) in any interleaving; read-backs follow every
    loss. Once every call ended and the read-backs ran dry, each user message was given
    exactly once."""
    messages: list[str] = []  # this execution's user messages, in seq order
    pending = iter(f"i{n}" for n in range(1000))
    handed: list[str] = []
    takes = Takes()
    running: list[tuple[int, int]] = []  # (sent_at, limit) per call in flight

    def store_take(limit: int) -> list[Input]:
        taken = [Input(next(pending), {}) for _ in range(limit)]
        messages.extend(item.id for item in taken)
        return taken

    def call(limit: int) -> tuple[int, int]:
        return takes.start(), limit

    def finish(taken: list[Input]) -> None:
        takes.running -= 1
        handed.extend(item.id for item in takes.gave(taken))

    def read_back_or_take(limit: int) -> None:
        takes.start()
        taken: list[Input] = []
        if (offset := takes.unsure_from) is not None:
            mine = [(m, "{}") for m in messages[offset:]]
            taken = [Input(key, {}) for key, _ in takes.untold(offset, mine, limit)]
        finish(taken or store_take(limit))

    for action, which, limit in steps:
        if action == "start" or not running:
            running.append(call(limit))
            continue
        sent_at, its_limit = running.pop(which % len(running))
        if action == "land":
            finish(store_take(its_limit))
            continue
        if action == "lose-landed":
            store_take(its_limit)
        takes.running -= 1
        takes.unsure(sent_at)
    for _, its_limit in running:  # the calls still in flight land
        finish(store_take(its_limit))
    for _ in range(len(messages) + 1):  # a read-back that never ends fails, not hangs
        if takes.unsure_from is None:
            break
        read_back_or_take(1)
    assert takes.unsure_from is None
    assert sorted(handed) == sorted(messages), (handed, messages)
    assert len(handed) == len(set(handed))
    assert takes.running == 0 and takes.given == len(messages)


# ---------------------------------------------------------------------------------------------
# Second review round: failing tests for defects found in the read-backs


async def test_two_tasks_taking_after_an_unknown_take_each_get_their_inputs_once(
    store: Any, autojump_clock: MockClock
) -> None:
    """A `take_inputs` is answered `OutcomeUnknown` after it took i2; then two tasks call
    `take_inputs` at once (consumers in parallel). Both read back; the one whose read-back
    ends first gives i2 and ends the read-back - the other must then take normally (i3),
    not fail with an AssertionError from `Takes.untold`."""
    taken: list[str] = []
    errors: list[BaseException] = []
    done: list[bool] = []

    async def drain(ctx: DrainContext, lost: LostReplies) -> None:
        if done:
            return
        done.append(True)
        taken.extend(i.id for i in await ctx.take_inputs())
        await ctx._runtime.submit("s", {"n": 2}, input_id="i2")
        lost.lose(_store.take_inputs, landed=True)
        with pytest.raises(OutcomeUnknown):
            await ctx.take_inputs(limit=1)
        await ctx._runtime.submit("s", {"n": 3}, input_id="i3")

        async def consumer() -> None:
            try:
                taken.extend(i.id for i in await ctx.take_inputs(limit=1))
            except Exception as exc:
                errors.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(consumer)
            nursery.start_soon(consumer)
        taken.extend(i.id for i in await ctx.take_inputs())

    outcome, messages = await run_drain(store, drain)
    assert errors == [], errors
    assert outcome.kind == "succeeded", outcome
    assert [m.input_id for m in messages if m.role == "user"] == ["i1", "i2", "i3"]
    assert sorted(taken) == ["i1", "i2", "i3"]


async def test_a_settlement_lost_then_another_tasks_settlement_then_called_again_lands_once(
    store: Any, autojump_clock: MockClock
) -> None:
    """c1's settlement is answered `OutcomeUnknown` after it landed; before its task calls
    it again, another task settles c2 (tools run in parallel: that call reads the message
    back, c1 completed in it). c1's settlement again is the same write again: a no-op, as
    the README says ("tools settled from parallel tasks are fine") - not a
    `DuplicateSettlement` that fails the drain."""
    errors: list[BaseException] = []

    async def drain(ctx: DrainContext, lost: LostReplies) -> None:
        writer = await opened(ctx)
        await writer.start_tool("c2", "echo", {"x": 2})
        c1_lost, c2_settled = trio.Event(), trio.Event()
        lost.lose(_store.update_assistant, landed=True)

        async def settle_c1() -> None:
            try:
                await writer.settle_tool("c1", "ok")
            except OutcomeUnknown as exc:
                errors.append(exc)
                c1_lost.set()
                await c2_settled.wait()  # the retry comes a little later (a backoff)
                await writer.settle_tool("c1", "ok")

        async def settle_c2() -> None:
            await c1_lost.wait()
            await writer.settle_tool("c2", "ok2")
            c2_settled.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(settle_c1)
            nursery.start_soon(settle_c2)
        await writer.finish()

    outcome, messages = await run_drain(store, drain)
    assert len(errors) == 1
    assert_both_settled(outcome, messages)


class HeldReply:
    """The runtime's store executor with the reply of one planned call held: it runs (and
    lands), sets `ran`, and returns only once `release` is set."""

    def __init__(self, runtime: Any) -> None:
        self._executor = runtime._db
        self.plan: Any = None
        self.ran, self.release = trio.Event(), trio.Event()
        runtime._db = self

    def __getattr__(self, name: str) -> Any:
        return getattr(self._executor, name)

    async def run(self, operation: Any, *args: Any) -> Any:
        result = await self._executor.run(operation, *args)
        if self.plan is operation:
            self.plan = None
            self.ran.set()
            await self.release.wait()
        return result


@pytest.mark.parametrize("landed", [True, False], ids=["landed", "not-landed"])
async def test_an_append_lost_called_again_while_another_tasks_settlement_is_replied(
    store: Any, autojump_clock: MockClock, landed: bool
) -> None:
    """An append is answered `OutcomeUnknown`, landed or not; meanwhile another task settles
    tool c1 (tools run in parallel), its write stored but its reply not yet back. The
    append again lands once: its text is in the message once. The version moved by the
    settlement alone cannot tell (unlanded, the text was silently dropped); the text can -
    only appends from parallel tasks are beyond the read-back, as the README says."""
    held: list[HeldReply] = []

    async def drain(ctx: DrainContext, lost: LostReplies) -> None:
        writer = await opened(ctx)
        ran, release = trio.Event(), trio.Event()
        lost.lose(_store.append_assistant_text, landed=landed, hold=(ran, release))
        hold = HeldReply(ctx._runtime)
        held.append(hold)

        async def append() -> None:
            with pytest.raises(OutcomeUnknown):
                await writer.append_text(" lost")
            await writer.append_text(" lost")  # the same call again

        async def settle_c1() -> None:
            await ran.wait()  # the append's reply is on its way
            hold.plan = _store.update_assistant
            await writer.settle_tool("c1", "ok")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(append)
            nursery.start_soon(settle_c1)
            await hold.ran.wait()  # c1's settlement stored, its reply not back yet
            release.set()  # the append's OutcomeUnknown: it is called again meanwhile
            await trio.testing.wait_all_tasks_blocked()
            hold.release.set()
        await writer.finish()

    outcome, messages = await run_drain(store, drain)
    assert held and held[0].ran.is_set()
    assert outcome.kind == "succeeded", outcome
    parts = messages[-1].data.parts
    assert [(type(p).__name__, getattr(p, "text", None)) for p in parts] == [
        ("TextPart", "answer"),
        ("ToolPart", None),
        ("TextPart", " lost"),
    ]
    assert [(p.call_id, p.status) for p in parts if isinstance(p, ToolPart)] == [
        ("c1", "completed")
    ]


def _corrupt_user_message(tx: Any, input_id: str) -> None:
    """Another tool wrote text that is not JSON over a user message's data."""
    tx.execute("UPDATE session_message SET data = 'not json' WHERE input_id = ?", (input_id,))


async def test_take_inputs_after_an_unknown_one_is_not_blocked_by_a_malformed_earlier_message(
    store: Any, autojump_clock: MockClock
) -> None:
    """i1, given to the drain long ago, is a malformed row now (another tool wrote text over
    its user message); a later `take_inputs` is answered `OutcomeUnknown` after it took i2.
    The next call returns i2, the one after i3: not `MalformedRecord` from every call for
    the rest of the execution because the read-back decodes every user message of the
    execution, even those before the unsure call (a poison row never blocks the others)."""
    calls: list[Any] = []
    done: list[bool] = []

    async def drain(ctx: DrainContext, lost: LostReplies) -> None:
        if done:
            return
        done.append(True)
        await ctx.take_inputs()
        await ctx._runtime._db.run(_corrupt_user_message, "i1")
        await ctx._runtime.submit("s", {"n": 2}, input_id="i2")
        lost.lose(_store.take_inputs, landed=True)
        with pytest.raises(OutcomeUnknown):
            await ctx.take_inputs()
        await ctx._runtime.submit("s", {"n": 3}, input_id="i3")
        for _ in range(2):
            try:
                calls.append([i.id for i in await ctx.take_inputs()])
            except Exception as exc:
                calls.append(type(exc).__name__)

    lost: list[LostReplies] = []

    async def wrapped(ctx: DrainContext) -> None:
        await drain(ctx, lost[0])

    async with open_runtime(store, wrapped, clock=ts_testing.trio_clock(), lease=30.0) as rt:
        lost.append(LostReplies(rt))
        await rt.submit("s", {"n": 1}, input_id="i1")
        outcome = await rt.run("s")
    assert calls == [["i2"], ["i3"]]
    assert outcome.kind == "succeeded", outcome


async def test_a_reply_arriving_after_a_read_back_does_not_take_the_writer_back(
    store: Any, autojump_clock: MockClock
) -> None:
    """An append is answered `OutcomeUnknown` (not landed) while another task's settlement of
    c1 is stored, its reply not back yet. The drain appends " y": the read-back takes the
    message as stored (c1 completed), " y" lands after it. Then the settlement's reply
    arrives and sets the writer back to the settlement's version; the next append, " y"
    again (a repeated token), must land too - on PostgreSQL it is taken for a retry of the
    first (`after_version` from the stale version) and dropped. (The same happens with no
    lost call: any reply of a concurrent task arriving late sets the writer's version
    back; the read-back is one more way to get there.)"""

    async def drain(ctx: DrainContext, lost: LostReplies) -> None:
        writer = await opened(ctx)
        ran, release = trio.Event(), trio.Event()
        lost.lose(_store.append_assistant_text, landed=False, hold=(ran, release))
        hold = HeldReply(ctx._runtime)
        settled = trio.Event()

        async def append() -> None:
            with pytest.raises(OutcomeUnknown):
                await writer.append_text(" x")
            await writer.append_text(" y")  # another call: the read-back, then " y"
            hold.release.set()  # the settlement's reply arrives now
            await settled.wait()
            await writer.append_text(" y")

        async def settle_c1() -> None:
            await ran.wait()
            hold.plan = _store.update_assistant
            await writer.settle_tool("c1", "ok")
            settled.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(append)
            nursery.start_soon(settle_c1)
            await hold.ran.wait()
            release.set()
        await writer.finish()

    outcome, messages = await run_drain(store, drain)
    assert outcome.kind == "succeeded", outcome
    parts = messages[-1].data.parts
    assert [p.text for p in parts if isinstance(p, TextPart)] == ["answer", " y y"]


async def test_two_tasks_beginning_after_an_unknown_begin_get_two_messages(
    store: Any, autojump_clock: MockClock
) -> None:
    """`begin_assistant` is answered `OutcomeUnknown` after it landed; then two tasks each
    begin a message at once (answers written in parallel). One gets the lost call's message,
    the other a message of its own - not both the writer of the same message, their texts
    mixed in one."""
    ids: list[str] = []

    async def drain(ctx: DrainContext, lost: LostReplies) -> None:
        await ctx.take_inputs()
        lost.lose(_store.begin_assistant, landed=True)
        with pytest.raises(OutcomeUnknown):
            await ctx.begin_assistant()

        async def answer(text: str) -> None:
            writer = await ctx.begin_assistant()
            ids.append(writer.message_id)
            await writer.append_text(text)
            await writer.finish()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(answer, "one")
            nursery.start_soon(answer, "two")

    outcome, messages = await run_drain(store, drain)
    assert outcome.kind == "succeeded", outcome
    assert len(set(ids)) == 2, ids
    texts = sorted(
        "".join(p.text for p in m.data.parts if isinstance(p, TextPart))
        for m in messages
        if m.role == "assistant"
    )
    assert texts == ["one", "two"]


@pytest.mark.parametrize("late", ["settle_tool", "append_text"])
async def test_replies_of_two_tasks_out_of_order_never_lose_a_write(
    store: Any, autojump_clock: MockClock, late: str
) -> None:
    """No reply lost at all: two tasks write one message at once and the first one's reply
    comes back after the second's. The message as stored keeps both writes, and the finish
    after them loses neither - the writer's own copy, overtaken, is not written back over
    the stored message (on PostgreSQL a tool call or finish writes from that copy when it
    is in step)."""
    operation = {
        "settle_tool": _store.update_assistant,
        "append_text": _store.append_assistant_text,
    }

    async def drain(ctx: DrainContext, lost: LostReplies) -> None:
        writer = await opened(ctx)
        held = HeldReply(ctx._runtime)
        held.plan = operation[late]

        async def first() -> None:
            if late == "settle_tool":
                await writer.settle_tool("c1", "ok")
            else:
                await writer.append_text(" first")

        async def second() -> None:
            await held.ran.wait()
            if late == "settle_tool":
                await writer.append_text(" second")
            else:
                await writer.settle_tool("c1", "ok")
            held.release.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(first)
            nursery.start_soon(second)
        await writer.append_text(" last")
        await writer.finish()

    outcome, messages = await run_drain(store, drain)
    assert outcome.kind == "succeeded", outcome
    parts = messages[-1].data.parts
    texts = "".join(p.text for p in parts if isinstance(p, TextPart))
    written = " second" if late == "settle_tool" else " first"
    assert texts == f"answer{written} last", parts
    tools = [(p.call_id, p.status, p.output) for p in parts if isinstance(p, ToolPart)]
    assert tools == [("c1", "completed", "ok")]


@pytest.mark.parametrize("verb", ["fork", "truncate", "delete_session", "purge_batch"])
async def test_a_rewrite_whose_reply_was_lost_still_reaches_local_readers_at_once(
    store: Any, autojump_clock: MockClock, verb: str
) -> None:
    """A fork, truncate, delete or purge of this runtime whose COMMIT landed but whose reply
    was lost: a local watcher of the fork, or a local stream of the rewritten session, heard of
    it only at the change loop's fallback poll (2 s; on the inline store never), since this
    runtime's own commits are no look - the look was asked for only after a reply (a
    review's find). It is asked for whatever the reply. Virtual time: "at once" is no time
    passing at all."""

    async def drain(ctx: DrainContext) -> None:
        await ctx.take_inputs()
        writer = await ctx.begin_assistant()
        await writer.append_text("hi")
        await writer.finish()

    calls = {
        "fork": lambda rt: rt.fork("s", "f"),
        "truncate": lambda rt: rt.truncate("s", after_seq=1),
        "delete_session": lambda rt: rt.delete_session("s"),
        "purge_batch": lambda rt: rt.purge(idle_for=50),
    }
    async with open_runtime(store, drain, clock=ts_testing.trio_clock()) as rt:
        await rt.submit("s", {"n": 1})
        await rt.run("s")
        await trio.sleep(100)  # idle: a purge takes it
        lost = LostReplies(rt)
        async with rt.watch("f") as forked, rt.stream("s") as events:
            assert [(await events.__anext__()).kind for _ in range(2)] == ["message"] * 2
            lost.lose(getattr(_store, verb), landed=True)
            with pytest.raises(OutcomeUnknown):
                await calls[verb](rt)
            started = trio.current_time()
            with trio.fail_after(10):  # the inline store never polls: no look, no news
                if verb == "fork":
                    assert (await forked.__anext__()).session_id == "f"
                else:
                    assert (await events.__anext__()).kind == "truncate"
            assert trio.current_time() == started
