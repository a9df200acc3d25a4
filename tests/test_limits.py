"""What a store can hold, the same on both backends (DESIGN §5 errors, §8, §6.26).

* Text PostgreSQL cannot store (a NUL character) is refused on both backends with the same
  `ValueError`, before any write: payloads, streamed text, tool call ids, names, inputs,
  outputs and errors, session ids and input ids.
* Each value a caller hands over - an input payload, an appended text, a tool's input,
  output or error - is capped at `MAX_PAYLOAD_BYTES` (1 MiB, UTF-8/JSON-encoded) with a
  `ValueError` that names the size and the limit.
* Checking a large value never stalls the event loop: a value over the cap is refused at
  a cost that does not grow with it, and the JSON work for a large value within the cap
  runs in a worker thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from conftest import query
from helpers import Raw, runtime
from trio.testing import MockClock

import trio_sessions
from trio_sessions import AssistantData, DrainContext, TextPart, ToolPart, _codec

Clock = Callable[[], float]
NUL = "a\x00b"
MAX = _codec.MAX_PAYLOAD_BYTES
NUL_REFUSED = "holds a NUL character"
# A lone surrogate is a Python str but no Unicode text: UTF-8 (both backends' text) has no
# encoding for it. A character each backend refuses, and what the refusal says.
UNSTORABLE = {
    "nul": ("\x00", NUL_REFUSED),
    "lone-surrogate": ("\ud800", "holds a lone surrogate"),
}


def producer(store: Any, clock: Clock) -> Any:
    return trio_sessions.open_runtime(store, None, clock=clock)


async def test_nul_in_a_submit_is_refused_before_any_write(
    store: Any, db_path: Any, clock: Clock, autojump_clock: MockClock
) -> None:
    """A NUL anywhere in a payload (a value, a key, deep inside), a session id or an input
    id is a ValueError on both backends, and nothing is stored."""
    async with producer(store, clock) as rt:
        for payload in ({"t": NUL}, {NUL: 1}, {"t": [{"deep": ["x", NUL]}]}):
            with pytest.raises(ValueError, match=NUL_REFUSED):
                await rt.submit("s", payload)
        with pytest.raises(ValueError, match=NUL_REFUSED):
            await rt.submit("s\x00", {"t": "x"})
        with pytest.raises(ValueError, match=NUL_REFUSED):
            await rt.submit("s", {"t": "x"}, input_id="i\x00")
    assert query(db_path, "SELECT COUNT(*) FROM session_input") == [(0,)]
    assert query(db_path, "SELECT COUNT(*) FROM session") == [(0,)]


async def test_a_lone_surrogate_in_a_payload_is_refused_before_any_write(
    store: Any, db_path: Any, clock: Clock, autojump_clock: MockClock
) -> None:
    """A payload string or key that is no Unicode text (a lone surrogate) is a ValueError
    naming where it is, and nothing is stored - not an input that fails the drain that
    echoes it, at its first write."""
    async with producer(store, clock) as rt:
        for payload in ({"t": "a\ud800b"}, {"\udfff": 1}, {"t": [{"deep": ["x", "\ud83d"]}]}):
            with pytest.raises(ValueError, match=r"payload holds a lone surrogate \(\\ud.*\$"):
                await rt.submit("s", payload)
    assert query(db_path, "SELECT COUNT(*) FROM session_input") == [(0,)]
    assert query(db_path, "SELECT COUNT(*) FROM session") == [(0,)]


@pytest.mark.parametrize(
    ("stored", "shown", "why"),
    [
        ("CAST(X'7B226E223A2280FF227D' AS TEXT)", '{"n":"\ufffd\ufffd"}', "not UTF-8"),
        ("X'7B226E223A327D'", '{"n":2}', "got bytes"),
    ],
    ids=["text-not-utf8", "blob"],
)
async def test_an_input_whose_payload_is_not_utf8_is_set_aside(
    tmp_path: Any, clock: Clock, autojump_clock: MockClock, stored: str, shown: str, why: str
) -> None:
    """SQLite keeps whatever bytes another tool wrote as TEXT: an input whose payload is not
    UTF-8 is set aside with its reason (the bytes shown with replacement characters) and
    the valid inputs around it are delivered - the driver's decode error failed every
    take_inputs of the session, so nothing behind it was ever answered. A BLOB is no JSON
    text, whatever its bytes, as everywhere else the store reads JSON."""
    db_path = tmp_path / "sessions.db"
    taken: list[Any] = []

    async def drain(ctx: DrainContext) -> None:
        taken.extend(item.payload for item in await ctx.take_inputs())

    async with producer(trio_sessions.Store(db_path, inline=True), clock) as rt:
        for n in (1, 2, 3):
            await rt.submit("s", {"n": n}, input_id=f"in-{n}")
    Raw(db_path).write(f"UPDATE session_input SET payload = {stored} WHERE id = 'in-2'")
    async with runtime(trio_sessions.Store(db_path, inline=True), drain, clock) as rt:
        outcome = await rt.run("s")
    assert outcome.kind == "succeeded", outcome
    assert taken == [{"n": 1}, {"n": 3}]
    [(input_id, payload, reason)] = query(
        db_path, "SELECT id, payload, reason FROM session_input_rejected"
    )
    assert (input_id, payload) == ("in-2", shown)
    assert why in str(reason)
    assert query(db_path, "SELECT COUNT(*) FROM session_input") == [(0,)]


Attempt = Callable[[trio_sessions.AssistantWriter], Awaitable[None]]


def before_start(bad: str) -> dict[str, Attempt]:
    text = f"a{bad}b"
    return {
        "append_text": lambda w: w.append_text(text),
        "start_tool call_id": lambda w: w.start_tool(f"c{bad}", "search", {}),
        "start_tool name": lambda w: w.start_tool("c1", f"se{bad}arch", {}),
        "start_tool input": lambda w: w.start_tool("c1", "search", {"q": text}),
        "start_tool input key": lambda w: w.start_tool("c1", "search", {text: "q"}),
    }


def after_start(bad: str) -> dict[str, Attempt]:
    text = f"a{bad}b"
    return {
        "settle_tool output": lambda w: w.settle_tool("c1", {"r": text}),
        "settle_tool output text": lambda w: w.settle_tool("c1", text),
        "fail_tool error": lambda w: w.fail_tool("c1", text),
    }


async def attempt_each(
    writer: trio_sessions.AssistantWriter, attempts: dict[str, Attempt], errors: dict[str, str]
) -> None:
    for what, attempt in attempts.items():
        try:
            await attempt(writer)
        except ValueError as exc:
            errors[what] = str(exc)


@pytest.mark.parametrize("unstorable", UNSTORABLE, ids=list(UNSTORABLE))
async def test_unstorable_text_in_assistant_writes_is_refused_on_both_backends(
    store: Any, clock: Clock, autojump_clock: MockClock, unstorable: str
) -> None:
    """append_text, start_tool (call id, name, input), settle_tool and fail_tool refuse a
    NUL or a lone surrogate with a ValueError saying so, before writing: the drain goes on
    and its message is intact."""
    bad, refused = UNSTORABLE[unstorable]
    BEFORE_START, AFTER_START = before_start(bad), after_start(bad)
    errors: dict[str, str] = {}

    async def drain(ctx: DrainContext) -> None:
        await ctx.take_inputs()
        writer = await ctx.begin_assistant()
        await writer.append_text("ok ")
        await attempt_each(writer, BEFORE_START, errors)
        await writer.start_tool("c1", "search", {"q": "x"})
        await attempt_each(writer, AFTER_START, errors)
        await writer.settle_tool("c1", {"r": "fine"})
        await writer.finish()

    async with runtime(store, drain, clock) as rt:
        async with producer(store, clock) as p:
            await p.submit("s", {"t": "hi"})
        outcome = await rt.run("s")
        messages = await rt.transcript("s")
    assert outcome.kind == "succeeded", outcome
    assert sorted(errors) == sorted([*BEFORE_START, *AFTER_START])
    assert all(refused in error for error in errors.values()), errors
    assert messages[-1].data == AssistantData(
        parts=(
            TextPart("ok "),
            ToolPart("c1", "search", {"q": "x"}, "completed", {"r": "fine"}, None),
        ),
        finished=True,
        error=None,
    )


def over(size: int) -> str:
    return f"{size} bytes.*the limit is {MAX} bytes"


async def test_each_write_over_the_size_cap_is_refused_with_a_clear_error(
    store: Any, clock: Clock, autojump_clock: MockClock
) -> None:
    """append_text, a tool's call id, name, input, output and error are capped at 1 MiB
    (UTF-8 bytes, JSON for objects): over it a ValueError naming both sizes; at the cap
    the value is stored."""
    big = "x" * (MAX + 1)
    wide = "é" * (MAX // 2 + 1)  # fewer characters than the cap, more bytes
    refused: dict[str, str] = {}
    attempts: dict[str, Attempt] = {
        "append_text": lambda w: w.append_text(big),
        "append_text wide": lambda w: w.append_text(wide),
        "start_tool call_id": lambda w: w.start_tool(big, "search", {}),
        "start_tool name": lambda w: w.start_tool("c1", big, {}),
        "start_tool input": lambda w: w.start_tool("c1", "search", {"q": big}),
    }
    settle_attempts: dict[str, Attempt] = {
        "settle_tool output": lambda w: w.settle_tool("c1", big),
        "settle_tool output object": lambda w: w.settle_tool("c1", {"r": [big]}),
        "fail_tool error": lambda w: w.fail_tool("c1", big),
    }

    async def drain(ctx: DrainContext) -> None:
        await ctx.take_inputs()
        writer = await ctx.begin_assistant()
        await attempt_each(writer, attempts, refused)
        await writer.append_text("y" * MAX)
        await writer.start_tool("c1", "search", {})
        await attempt_each(writer, settle_attempts, refused)
        await writer.settle_tool("c1", "done")
        await writer.finish()

    async with runtime(store, drain, clock) as rt:
        async with producer(store, clock) as p:
            await p.submit("s", {"t": "hi"})
            with pytest.raises(ValueError, match=over(MAX + 7)):  # {"t":"..."}
                await p.submit("s", {"t": big[:-2]})
        outcome = await rt.run("s")
        messages = await rt.transcript("s")
    assert outcome.kind == "succeeded", outcome
    assert sorted(refused) == sorted([*attempts, *settle_attempts])
    assert all("the limit is 1048576 bytes" in error for error in refused.values()), refused
    assert "1048577 bytes" in refused["append_text"]
    assert "1048578 bytes" in refused["append_text wide"]
    assert messages[-1].data == AssistantData(
        parts=(TextPart("y" * MAX), ToolPart("c1", "search", {}, "completed", "done", None)),
        finished=True,
        error=None,
    )


HUGE = 50 * 1024 * 1024
LOOP_BUDGET = 0.05  # seconds of event-loop CPU one call may take (§6.26: no stall > 50 ms)


async def test_a_huge_value_is_refused_without_stalling_the_event_loop(store: Any) -> None:
    """A 50 MB text, object or a value of a million nodes given to append_text,
    start_tool, settle_tool, fail_tool or submit is refused while the event loop's thread
    spends under 50 ms of CPU on it (the JSON work runs in a worker thread, and stops as
    soon as the value is certain to be over the cap). Real clock: a worker thread lets a
    virtual clock jump past the lease."""
    clock = time.time
    text = "x" * HUGE
    wide = {"q": text}
    many = {"items": list(range(1_000_000))}
    cpu: dict[str, float] = {}

    async def timed(what: str, call: Awaitable[object]) -> None:
        start = time.thread_time()
        with pytest.raises(ValueError, match="the limit is"):
            await call
        cpu[what] = time.thread_time() - start

    async def drain(ctx: DrainContext) -> None:
        await ctx.take_inputs()
        writer = await ctx.begin_assistant()
        await timed("append_text", writer.append_text(text))
        await timed("start_tool wide", writer.start_tool("c1", "n", wide))
        await timed("start_tool many", writer.start_tool("c1", "n", many))
        await writer.start_tool("c1", "n", {})
        await timed("settle_tool wide", writer.settle_tool("c1", wide))
        await timed("settle_tool many", writer.settle_tool("c1", many))
        await timed("fail_tool", writer.fail_tool("c1", text))
        await writer.finish()

    async with runtime(store, drain, clock) as rt:
        async with producer(store, clock) as p:
            await p.submit("s", {"t": "hi"})
            await timed("submit wide", p.submit("s", wide))
            await timed("submit many", p.submit("s", many))
        outcome = await rt.run("s")
    assert outcome.kind == "succeeded", outcome
    assert len(cpu) == 8
    assert max(cpu.values()) < LOOP_BUDGET, cpu


async def test_a_large_value_within_the_cap_is_checked_in_a_worker_thread(
    store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The JSON check of a node-heavy value under the cap runs off the event loop's thread;
    a small value's check stays on it (a thread hand-off would cost more than the check).
    Real clock, as above."""
    clock = time.time
    threads: list[tuple[str, bool]] = []
    check_json = _codec.check_json

    def recording(value: Any, what: str, **options: Any) -> str:
        threads.append((what, threading.current_thread() is threading.main_thread()))
        return check_json(value, what, **options)

    monkeypatch.setattr(_codec, "check_json", recording)
    many = {"items": list(range(100_000))}  # about 600 KB of JSON

    async def drain(ctx: DrainContext) -> None:
        await ctx.take_inputs()
        writer = await ctx.begin_assistant()
        await writer.start_tool("c1", "n", many)
        await writer.settle_tool("c1", many)
        await writer.start_tool("c2", "n", {"q": 1})
        await writer.settle_tool("c2", {"r": 1})
        await writer.finish()

    async with producer(store, clock) as p:
        await p.submit("s", many)
        await p.submit("s", {"t": "small"})
    async with runtime(store, drain, clock) as rt:
        outcome = await rt.run("s")
    assert outcome.kind == "succeeded", outcome
    assert threads == [
        ("payload", False),
        ("payload", True),
        ("tool input", False),
        ("tool output", False),
        ("tool input", True),
        ("tool output", True),
    ]


def test_the_caps_are_documented() -> None:
    """The writer's and submit's docstrings state the cap (users read them)."""
    for method in (
        trio_sessions.AssistantWriter.append_text,
        trio_sessions.AssistantWriter.start_tool,
        trio_sessions.AssistantWriter.settle_tool,
        trio_sessions.AssistantWriter.fail_tool,
        trio_sessions.Runtime.submit,
    ):
        assert "1 MiB" in (method.__doc__ or ""), method.__qualname__
        assert "NUL" in (method.__doc__ or ""), method.__qualname__


def test_check_json_refuses_nul_and_large_values_itself() -> None:
    """The codec is the one place: check_json / check_json_object / check_text refuse a NUL
    with the same message and take a size limit."""
    checks: list[Callable[[], str]] = [
        lambda: _codec.check_json({"a": NUL}, "value"),
        lambda: _codec.check_json_object({"a": [NUL]}, "value"),
        lambda: _codec.check_text(NUL, "value"),
    ]
    for check in checks:
        with pytest.raises(ValueError, match="value holds a NUL character"):
            check()
    with pytest.raises(ValueError, match=over(MAX + 1)):
        _codec.check_text("x" * (MAX + 1), "value")
    with pytest.raises(ValueError, match=over(MAX + 3)):
        _codec.check_json("x" * (MAX + 1), "value", limit=MAX)
    assert _codec.check_text("x" * MAX, "value") == "x" * MAX
    with pytest.raises(TypeError, match="value must be a str"):
        _codec.check_text(b"x", "value")
