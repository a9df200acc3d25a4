"""The assistant message state machine: a tool call settles at most once, a finished message
accepts nothing, interrupting or finishing fails exactly the running tools.

The pure transitions are checked directly and over generated operation sequences; the
durable variant runs the same transitions through `_store.update_assistant` and checks the
stored row keeps the first settlement.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trio_sessions import (
    AssistantData,
    DuplicateSettlement,
    Message,
    TextPart,
    ToolPart,
    TrioSessionsError,
    UnknownToolCall,
    _sqlite,
    _store,
    _transcript,
    unanswered,
)
from trio_sessions._model import INTERRUPTED, OWNER_LOST, UNSETTLED_AT_FINISH
from trio_sessions._transcript import EMPTY, MessageFinished

Settle = Callable[[AssistantData], AssistantData]


def settle(call_id: str, output: Any = "ok") -> Settle:
    return lambda data: _transcript.settle_tool(data, call_id, output=output)


def fail(call_id: str, error: str = "boom") -> Settle:
    return lambda data: _transcript.settle_tool(data, call_id, error=error)


def tool(data: AssistantData, call_id: str) -> ToolPart:
    found = [p for p in data.parts if isinstance(p, ToolPart) and p.call_id == call_id]
    assert len(found) == 1, f"{call_id!r} appears {len(found)} times"
    return found[0]


def with_tools(*call_ids: str) -> AssistantData:
    data = EMPTY
    for call_id in call_ids:
        data = _transcript.start_tool(data, call_id, "search", {"q": call_id})
    return data


SETTLEMENT_PAIRS = [
    pytest.param(settle("c", 1), settle("c", 2), id="settle+settle"),
    pytest.param(settle("c", 1), fail("c"), id="settle+fail"),
    pytest.param(fail("c", "first"), fail("c", "second"), id="fail+fail"),
    pytest.param(fail("c", "first"), settle("c", 2), id="fail+settle"),
]


@pytest.mark.parametrize(("first", "second"), SETTLEMENT_PAIRS)
def test_second_settlement_raises_and_first_is_kept(first: Settle, second: Settle) -> None:
    """Each duplicate-settlement variant raises DuplicateSettlement; the first one stands."""
    settled = first(with_tools("c"))
    with pytest.raises(DuplicateSettlement, match="'c'"):
        second(settled)
    assert tool(settled, "c") == tool(first(with_tools("c")), "c")
    assert tool(settled, "c").status in ("completed", "error")


def test_settle_completes_with_output_and_fail_errors_without_output() -> None:
    """settle -> completed with the output; fail -> error with the message and no output."""
    data = with_tools("a", "b")
    data = _transcript.settle_tool(data, "a", output={"hits": [1, 2]})
    data = _transcript.settle_tool(data, "b", error="timeout")
    assert tool(data, "a") == ToolPart(
        "a", "search", {"q": "a"}, "completed", {"hits": [1, 2]}, None
    )
    assert tool(data, "b") == ToolPart("b", "search", {"q": "b"}, "error", None, "timeout")


@pytest.mark.parametrize("transition", [settle("nope"), fail("nope")], ids=["settle", "fail"])
def test_unknown_call_id_raises_unknown_tool_call(transition: Settle) -> None:
    """Settling a call id the message never started raises UnknownToolCall."""
    with pytest.raises(UnknownToolCall, match="'nope'"):
        transition(with_tools("c"))


def test_text_part_with_call_id_text_is_not_a_tool() -> None:
    """A text part is never mistaken for a tool call, even when its text equals a call id."""
    data = _transcript.append_text(EMPTY, "c")
    with pytest.raises(UnknownToolCall):
        _transcript.settle_tool(data, "c", output=None)


def test_starting_a_call_id_twice_is_refused() -> None:
    """One call id names one tool part: a second start is rejected, the message unchanged."""
    data = with_tools("c")
    with pytest.raises(ValueError, match="already started"):
        _transcript.start_tool(data, "c", "other", {})
    assert len(data.parts) == 1


WRITES_AFTER_FINISH: list[Any] = [
    pytest.param(lambda d: _transcript.append_text(d, "more"), id="append_text"),
    pytest.param(lambda d: _transcript.start_tool(d, "new", "t", {}), id="start_tool"),
    pytest.param(settle("running"), id="settle_tool"),
    pytest.param(fail("running"), id="fail_tool"),
    pytest.param(_transcript.finish, id="finish"),
]


@pytest.mark.parametrize("write", WRITES_AFTER_FINISH)
@pytest.mark.parametrize(
    "close", [_transcript.finish, lambda d: _transcript.interrupt(d, INTERRUPTED)]
)
def test_writes_after_finish_raise(write: Settle, close: Settle) -> None:
    """A finished (or interrupted) message refuses every further write with MessageFinished."""
    closed = close(with_tools("running"))
    assert closed.finished
    with pytest.raises(MessageFinished):
        write(closed)
    assert issubclass(MessageFinished, ValueError)


def test_interrupt_fails_exactly_the_running_tools_and_finishes() -> None:
    """interrupt() turns only running tools into errors with the reason and finishes the message;
    settled tools and text are untouched."""
    data = _transcript.append_text(with_tools("done", "failed", "running1", "running2"), "hi")
    data = _transcript.settle_tool(data, "done", output=42)
    data = _transcript.settle_tool(data, "failed", error="own error")
    interrupted = _transcript.interrupt(data, INTERRUPTED)
    assert interrupted.finished
    assert interrupted.error == INTERRUPTED
    assert tool(interrupted, "done") == tool(data, "done")
    assert tool(interrupted, "failed") == tool(data, "failed")
    for call_id in ("running1", "running2"):
        part = tool(interrupted, call_id)
        assert (part.status, part.error, part.output) == ("error", INTERRUPTED, None)
    assert interrupted.parts[-1] == TextPart("hi")
    assert _transcript.unsettled_calls(interrupted) == []


def test_interrupt_of_finished_message_changes_nothing() -> None:
    """An already finished message is left exactly as it is by a later interrupt."""
    finished = _transcript.finish(with_tools("c"))
    assert _transcript.interrupt(finished, OWNER_LOST) == finished


def test_finish_fails_still_running_tools() -> None:
    """finish() never leaves a tool running: unsettled calls fail, the message has no error."""
    data = _transcript.settle_tool(with_tools("a", "b"), "a", output="x")
    finished = _transcript.finish(data)
    assert finished.finished
    assert finished.error is None
    assert tool(finished, "a") == tool(data, "a")
    assert (tool(finished, "b").status, tool(finished, "b").error) == ("error", UNSETTLED_AT_FINISH)


def test_append_text_extends_the_last_text_part() -> None:
    """Streamed text stays one part until a tool part interrupts it."""
    data = _transcript.append_text(_transcript.append_text(EMPTY, "he"), "llo")
    assert data.parts == (TextPart("hello"),)
    data = _transcript.append_text(_transcript.start_tool(data, "c", "t", {}), "!")
    assert data.parts[0] == TextPart("hello")
    assert data.parts[-1] == TextPart("!")
    assert len(data.parts) == 3


# ---------------------------------------------------------------------------------------------
# Generated operation sequences

CALL_IDS = ("a", "b", "c")
operations = st.lists(
    st.one_of(
        st.tuples(st.just("start"), st.sampled_from(CALL_IDS)),
        st.tuples(st.just("settle"), st.sampled_from(CALL_IDS)),
        st.tuples(st.just("fail"), st.sampled_from(CALL_IDS)),
        st.tuples(st.just("text"), st.sampled_from(("x", "yz"))),
        st.tuples(st.just("finish"), st.just("")),
        st.tuples(st.just("interrupt"), st.just("")),
    ),
    max_size=25,
)


def apply(data: AssistantData, op: str, arg: str) -> AssistantData:
    if op == "start":
        return _transcript.start_tool(data, arg, "tool", {})
    if op == "settle":
        return _transcript.settle_tool(data, arg, output=arg)
    if op == "fail":
        return _transcript.settle_tool(data, arg, error="failed " + arg)
    if op == "text":
        return _transcript.append_text(data, arg)
    if op == "finish":
        return _transcript.finish(data)
    return _transcript.interrupt(data, INTERRUPTED)


@settings(max_examples=200, deadline=None)
@given(operations)
def test_random_sequences_never_settle_a_tool_twice(ops: list[tuple[str, str]]) -> None:
    """Over any operation sequence: each call id has one part, a settled tool never changes
    again, a refused operation raises the error the model predicts and changes nothing."""
    data = EMPTY
    settled: dict[str, ToolPart] = {}
    for op, arg in ops:
        started = {p.call_id for p in data.parts if isinstance(p, ToolPart)}
        expected_error: type[Exception] | None = None
        if data.finished and op != "interrupt":
            expected_error = MessageFinished
        elif op == "start" and arg in started:
            expected_error = ValueError
        elif op in ("settle", "fail") and arg not in started:
            expected_error = UnknownToolCall
        elif op in ("settle", "fail") and arg in settled:
            expected_error = DuplicateSettlement
        if expected_error is not None:
            with pytest.raises(expected_error):
                apply(data, op, arg)
            continue
        new = apply(data, op, arg)
        for call_id, part in settled.items():
            assert tool(new, call_id) == part, "a settled tool changed"
        for new_part in new.parts:
            if isinstance(new_part, ToolPart) and new_part.status != "running":
                settled.setdefault(new_part.call_id, new_part)
        if data.finished:
            assert new == data
        data = new
    tool_ids = [p.call_id for p in data.parts if isinstance(p, ToolPart)]
    assert len(tool_ids) == len(set(tool_ids))
    if data.finished:
        assert _transcript.unsettled_calls(data) == []


# ---------------------------------------------------------------------------------------------
# The durable row keeps the first settlement

NOW_MS = 1_800_000_000_000


class Claimed:
    """A real SQLite file holding one live claim with one open assistant message."""

    def __init__(self, path: Path) -> None:
        self.conn = _sqlite.connect(path)
        self.execution_id = "exec-1"
        self.run(_store.wake, "s")
        acquired = self.run(_store.acquire, "s", self.execution_id, "owner", 30_000)
        assert acquired.verdict.value == "claim"
        self.run(_store.begin_assistant, "s", self.execution_id, "owner", "m-1")

    def clock(self) -> float:
        return NOW_MS / 1000

    def run(self, op: Callable[..., Any], *args: Any) -> Any:
        return _sqlite.run_op(self.conn, self.clock, op, *args)

    def update(self, transition: Settle) -> AssistantData:
        result: AssistantData = self.run(
            _store.update_assistant, "s", self.execution_id, "owner", "m-1", transition
        )[0]
        return result

    def stored(self) -> AssistantData:
        [message] = self.run(_store.read_transcript, "s")
        assert isinstance(message.data, AssistantData)
        return message.data


@pytest.fixture
def claimed(tmp_path: Path) -> Iterator[Claimed]:
    claimed = Claimed(tmp_path / "transcript.db")
    try:
        yield claimed
    finally:
        claimed.conn.close()


@pytest.mark.parametrize(("first", "second"), SETTLEMENT_PAIRS)
def test_durable_second_settlement_is_refused_and_row_keeps_first(
    claimed: Claimed, first: Settle, second: Settle
) -> None:
    """Through the store, a second settlement raises DuplicateSettlement and the stored row
    still holds the first settlement."""
    claimed.update(lambda d: _transcript.start_tool(d, "c", "search", {}))
    after_first = claimed.update(first)
    with pytest.raises(DuplicateSettlement):
        claimed.update(second)
    assert claimed.stored() == after_first
    assert tool(claimed.stored(), "c").status != "running"


def test_durable_unknown_call_id_writes_nothing(claimed: Claimed) -> None:
    """Through the store, an unknown call id raises UnknownToolCall and the row is unchanged."""
    before = claimed.stored()
    with pytest.raises(UnknownToolCall):
        claimed.update(settle("ghost"))
    assert claimed.stored() == before


def _user(seq: int) -> Message:
    return Message(f"u{seq}", "s", "user", seq, {"text": str(seq)}, None, f"i{seq}")


def _answer(seq: int, error: str | None) -> Message:
    data = AssistantData(parts=(), finished=True, error=error)
    return Message(f"a{seq}", "s", "assistant", seq, data, "e", None)


@pytest.mark.parametrize(
    ("transcript", "owed"),
    [
        ([], []),
        ([_user(1)], [1]),
        ([_user(1), _user(2)], [1, 2]),
        ([_user(1), _answer(2, None)], []),
        ([_user(1), _answer(2, None), _user(3)], [3]),
        # A dead owner's unfinished answer is looked past: its question is still owed.
        ([_user(1), _answer(2, OWNER_LOST)], [1]),
        ([_user(1), _answer(2, OWNER_LOST), _user(3), _answer(4, OWNER_LOST)], [1, 3]),
        ([_user(1), _answer(2, None), _user(3), _answer(4, OWNER_LOST)], [3]),
        # An answer cut by a user interrupt or a failure counts as given.
        ([_user(1), _answer(2, INTERRUPTED)], []),
        ([_user(1), _answer(2, "failed: KeyError('x')")], []),
    ],
)
def test_unanswered_finds_the_questions_still_owed(
    transcript: list[Message], owed: list[int]
) -> None:
    assert [message.seq for message in unanswered(transcript)] == owed


def applied_step(data: AssistantData, step: Any) -> AssistantData:
    """What a stream's client does with a "part" or "finish" event (DESIGN §5.2's table)."""
    kind, value = step
    if kind == "finish":
        return AssistantData(parts=data.parts, finished=True, error=value["error"])
    same = [
        i
        for i, p in enumerate(data.parts)
        if isinstance(p, ToolPart) and p.call_id == value.call_id
    ]
    parts = (
        (*data.parts[: same[0]], value, *data.parts[same[0] + 1 :])
        if same
        else (*data.parts, value)
    )
    return AssistantData(parts=parts, finished=data.finished, error=data.error)


@settings(max_examples=300, deadline=None)
@given(operations)
def test_a_write_is_one_stream_step_exactly_when_the_event_reproduces_it(
    ops: list[tuple[str, str]],
) -> None:
    """`_transcript.step(before, after)`: the "part" or "finish" event a write makes, which a
    stream sends instead of the message whole - applied to `before`, it gives `after`. A tool
    start or settlement is always one "part", a finish or an interrupt with no running tool
    one "finish"; text, and a finish that fails running tools, are never one step."""
    data = EMPTY
    for op, arg in ops:
        try:
            new = apply(data, op, arg)
        except (ValueError, TrioSessionsError):
            continue
        step = _transcript.step(data, new)
        if step is not None:
            assert applied_step(data, step) == new
        running = bool(_transcript.unsettled_calls(data))
        if data.finished or op == "text" or (op in ("finish", "interrupt") and running):
            assert step is None
        elif op in ("start", "settle", "fail"):
            assert step is not None and step[0] == "part" and step[1].call_id == arg
        else:
            error = None if op == "finish" else INTERRUPTED
            assert step == ("finish", {"error": error})
        data = new
