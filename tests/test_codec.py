"""The strict codec: valid assistant records round-trip exactly (also through a real SQLite
row), every malformed shape raises `MalformedRecord` with readable reasons, and arbitrary
JSON either decodes or raises `MalformedRecord` - never anything else.
"""

from __future__ import annotations

import copy
import json
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trio_sessions import (
    AssistantData,
    MalformedRecord,
    TextPart,
    ToolPart,
    TrioSessionsError,
    _codec,
    _sqlite,
    _store,
)

SETTINGS = settings(max_examples=200, deadline=None)
# Whole assistant records are costly to generate; fewer examples keep the file fast.
RECORD_SETTINGS = settings(max_examples=100, deadline=None)


def storable_text(max_size: int) -> st.SearchStrategy[str]:
    """Text a writer stores: UTF-8 without a NUL (§8: every writer refuses one, and so does
    a reader)."""
    return st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=max_size)


json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | storable_text(20)
)
json_values = st.recursive(
    json_scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(storable_text(8), children, max_size=4)
    ),
    max_leaves=8,
)
json_objects = st.dictionaries(storable_text(8), json_values, max_size=4)

text_parts = st.builds(TextPart, text=storable_text(30))
tool_parts = st.builds(
    ToolPart,
    call_id=storable_text(10),
    name=storable_text(10),
    input=json_objects,
    status=st.sampled_from(["running", "completed", "error"]),
    output=json_values,
    error=st.none() | storable_text(20),
)


def one_part_per_call(parts: list[Any]) -> tuple[Any, ...]:
    """`parts` without a tool part whose call id an earlier one holds: no writer stores two
    (`start_tool` refuses the id), and a reader refuses them (`_codec._repeated_calls`)."""
    calls = {part.call_id: part for part in reversed(parts) if isinstance(part, ToolPart)}
    return tuple(p for p in parts if not isinstance(p, ToolPart) or calls[p.call_id] is p)


assistant_data = st.builds(
    AssistantData,
    parts=st.lists(text_parts | tool_parts, max_size=4).map(one_part_per_call),
    finished=st.booleans(),
    error=st.none() | storable_text(20),
)


@RECORD_SETTINGS
@given(assistant_data)
def test_round_trip_is_identity(data: AssistantData) -> None:
    """encode -> decode returns exactly the value written, and re-encodes to the same text."""
    text = _codec.encode_assistant(data)
    decoded = _codec.decode_assistant(text, key="m")
    assert decoded == data
    assert _codec.encode_assistant(decoded) == text


@RECORD_SETTINGS
@given(assistant_data, tool_parts)
def test_the_encoding_is_the_converters_byte_for_byte(data: AssistantData, part: ToolPart) -> None:
    """The hand-written encoding of a message and of a stream step (a tool part, a finish)
    writes exactly what cattrs' unstructuring did, key order included: rows written before
    it and after it read alike, and a writer's known encoding compares equal."""
    converter = _codec._converter
    assert _codec.encode_assistant(data) == _codec.dumps(converter.unstructure(data))
    assert _codec.encode_step(("part", part)) == _codec.dumps(converter.unstructure(part))
    error = {"error": data.error}
    assert _codec.encode_step(("finish", error)) == _codec.dumps(converter.unstructure(error))


def test_a_message_is_encoded_a_part_per_encoder_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """The C encoder holds the GIL for a whole call, so in a worker thread the event loop's
    thread waits for as long as one call runs: a message of four large tool results is
    encoded in calls of at most one part each, not one call for the whole message (the
    same text: `test_the_encoding_is_the_converters_byte_for_byte`)."""
    result: list[list[int]] = [[] for _ in range(10_000)]
    data = AssistantData(
        parts=tuple(
            ToolPart(f"c{k}", "search", {"q": k}, "completed", result, None) for k in range(4)
        ),
        finished=True,
        error=None,
    )
    encoded: list[int] = []
    encoder = _codec._ENCODER

    class Counting(json.JSONEncoder):
        def encode(self, o: Any) -> str:
            text = encoder.encode(o)
            encoded.append(len(text))
            return text

    monkeypatch.setattr(_codec, "_ENCODER", Counting())
    text = _codec.encode_assistant(data)
    part = len(_codec.encode_step(("part", data.parts[0])))
    assert encoded[:-1] and max(encoded) <= part < len(text) // 4
    assert text == _codec.dumps(_codec._converter.unstructure(data))


def test_encoding_a_large_tool_result_walks_no_converter(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tool result of 300,000 JSON nodes is encoded by `dumps` alone: cattrs' unstructuring
    walked every node (325 ms on the event loop with SQLite), where the value is plain JSON
    already (checked on entry, or read back as such). Counted, not timed: a converter that
    notes every list it is asked to unstructure is never asked about the result."""
    data = AssistantData(
        parts=(
            ToolPart("c1", "search", {"q": []}, "completed", [[] for _ in range(300_000)], None),
        ),
        finished=True,
        error=None,
    )
    asked: list[Any] = []

    def noted(value: list[Any]) -> list[Any]:
        asked.append(value)
        return list(value)

    counting = _codec._converter.copy()
    counting.register_unstructure_hook(list, noted)
    monkeypatch.setattr(_codec, "_converter", counting)
    text = _codec.encode_assistant(data)
    _codec.encode_step(("part", data.parts[0]))
    assert asked == []
    monkeypatch.undo()
    assert _codec.decode_assistant(text, key="m") == data


class Db:
    """A real SQLite file where each example gets its own session, claim and message."""

    def __init__(self, path: Path) -> None:
        self.conn = _sqlite.connect(path)

    def clock(self) -> float:
        return 1_800_000_000.0

    def run(self, op: Callable[..., Any], *args: Any) -> Any:
        return _sqlite.run_op(self.conn, self.clock, op, *args)

    def write_assistant(self, data: AssistantData) -> str:
        """Write `data` as a fresh assistant message through the fenced store operations."""
        session_id = uuid.uuid4().hex
        self.run(_store.wake, session_id)
        self.run(_store.acquire, session_id, "exec-" + session_id, "owner", 30_000)
        self.run(
            _store.begin_assistant, session_id, "exec-" + session_id, "owner", "m-" + session_id
        )
        self.run(
            _store.update_assistant,
            session_id,
            "exec-" + session_id,
            "owner",
            "m-" + session_id,
            lambda _: data,
        )
        return session_id


@pytest.fixture
def db(tmp_path: Path) -> Iterator[Db]:
    database = Db(tmp_path / "codec.db")
    try:
        yield database
    finally:
        database.conn.close()


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=assistant_data)
def test_round_trip_through_sqlite_row(db: Db, data: AssistantData) -> None:
    """begin_assistant + update_assistant, then read_transcript, returns the value written."""
    session_id = db.write_assistant(data)
    [message] = db.run(_store.read_transcript, session_id)
    assert message.role == "assistant"
    assert message.data == data


# ---------------------------------------------------------------------------------------------
# Malformed shapes

VALID: dict[str, Any] = {
    "parts": [
        {
            "type": "tool",
            "call_id": "c1",
            "name": "search",
            "input": {"q": "x"},
            "status": "running",
            "output": None,
            "error": None,
        },
        {"type": "text", "text": "hello"},
    ],
    "finished": False,
    "error": None,
}


def mutated(change: Callable[[dict[str, Any]], object]) -> str:
    record = copy.deepcopy(VALID)
    change(record)
    return json.dumps(record)


def tool_part(record: dict[str, Any]) -> dict[str, Any]:
    part: dict[str, Any] = record["parts"][0]
    return part


def text_part(record: dict[str, Any]) -> dict[str, Any]:
    part: dict[str, Any] = record["parts"][1]
    return part


NAN_OUTPUT = json.dumps(VALID).replace('"output": null', '"output": NaN')
INFINITY_ERROR = json.dumps(VALID).replace(
    '"finished": false, "error": null', '"finished": false, "error": Infinity'
)
MINUS_INFINITY = json.dumps(VALID).replace('"output": null', '"output": -Infinity')
assert "NaN" in NAN_OUTPUT
assert "Infinity" in INFINITY_ERROR
assert "-Infinity" in MINUS_INFINITY

MALFORMED: list[Any] = [
    pytest.param("{", ["not JSON"], id="not-json"),
    pytest.param("", ["not JSON"], id="empty-text"),
    pytest.param(b'{"parts": []}', ["not JSON", "bytes"], id="blob-not-text"),
    pytest.param(None, ["not JSON", "NoneType"], id="sql-null"),
    pytest.param("[]", ["expected a JSON object"], id="top-level-list"),
    pytest.param('"finished"', ["expected a JSON object"], id="top-level-string"),
    pytest.param(
        mutated(lambda r: r.pop("error")), ["required field missing", "error"], id="missing-key"
    ),
    pytest.param(mutated(lambda r: r.update(extra=1)), ["extra fields", "extra"], id="extra-key"),
    pytest.param(
        mutated(lambda r: r.update(finished="false")),
        ["expected bool", "'false'", "finished"],
        id="string-boolean",
    ),
    pytest.param(
        mutated(lambda r: r.update(finished=0)), ["expected bool", "int"], id="int-boolean"
    ),
    pytest.param(
        mutated(lambda r: text_part(r).update(type="image")),
        ["unknown part type", "image"],
        id="wrong-part-type",
    ),
    pytest.param(
        mutated(lambda r: text_part(r).pop("type")), ["unknown part type"], id="part-without-type"
    ),
    pytest.param(
        mutated(lambda r: tool_part(r).update(status="pending")),
        ["pending", "status"],
        id="unknown-status",
    ),
    pytest.param(
        mutated(lambda r: tool_part(r).update(input=[1, 2])),
        ["expected a JSON object", "input"],
        id="non-object-tool-input",
    ),
    pytest.param(
        mutated(lambda r: tool_part(r).update(input="{}")),
        ["expected a JSON object", "input"],
        id="string-tool-input",
    ),
    pytest.param(mutated(lambda r: r.update(parts=None)), ["list of parts"], id="null-parts"),
    pytest.param(
        mutated(lambda r: r.update(finished=None)),
        ["expected bool", "NoneType"],
        id="null-finished",
    ),
    pytest.param(
        mutated(lambda r: text_part(r).update(text=None)), ["expected str", "text"], id="null-text"
    ),
    pytest.param(
        mutated(lambda r: tool_part(r).update(call_id=None)),
        ["expected str", "call_id"],
        id="null-call-id",
    ),
    pytest.param(
        mutated(lambda r: tool_part(r).update(name=5)),
        ["expected str, got int 5", "name"],
        id="nested-wrong-type",
    ),
    pytest.param(
        mutated(lambda r: tool_part(r).update(error=["x"])),
        ["expected str", "error"],
        id="nested-error-list",
    ),
    pytest.param(mutated(lambda r: r.update(error=3)), ["expected str, got int 3"], id="error-int"),
    pytest.param(mutated(lambda r: r.update(parts={})), ["list of parts"], id="parts-object"),
    pytest.param(
        mutated(lambda r: r.update(parts=["hi"])), ["expected a part object"], id="part-str"
    ),
    pytest.param(
        mutated(lambda r: tool_part(r).pop("output")),
        ["required field missing", "output"],
        id="part-missing-key",
    ),
    pytest.param(
        mutated(lambda r: text_part(r).update(bold=True)),
        ["extra fields", "bold"],
        id="part-extra-key",
    ),
    pytest.param(
        mutated(lambda r: r["parts"].append(copy.deepcopy(tool_part(r)))),
        ["tool call 'c1' is held by parts 0 and 2", "settles at most once"],
        id="one-call-twice",
    ),
    pytest.param(
        mutated(lambda r: text_part(r).update(text="a\ud800b")),
        ["lone surrogate (\\ud800) at $.parts[1].text"],
        id="lone-high-surrogate",
    ),
    pytest.param(
        mutated(lambda r: tool_part(r).update(output={"k\udfff": 1})),
        ["lone surrogate (\\udfff) at a key of $.parts[0].output"],
        id="lone-low-surrogate-in-a-key",
    ),
    pytest.param(NAN_OUTPUT, ["NaN is not JSON"], id="nan-literal"),
    pytest.param(INFINITY_ERROR, ["Infinity is not JSON"], id="infinity-literal"),
    pytest.param(MINUS_INFINITY, ["-Infinity is not JSON"], id="minus-infinity-literal"),
]


@pytest.mark.parametrize(("text", "fragments"), MALFORMED)
def test_malformed_shape_is_rejected_with_readable_reason(text: Any, fragments: list[str]) -> None:
    """Each malformed shape raises MalformedRecord naming table and key, with a one-line reason
    that says what is wrong."""
    with pytest.raises(MalformedRecord) as caught:
        _codec.decode_assistant(text, key="msg-1")
    error = caught.value
    assert type(error) is MalformedRecord
    assert (error.table, error.key) == ("session_message", "msg-1")
    assert error.reasons
    for reason in error.reasons:
        assert isinstance(reason, str)
        assert reason
        assert "\n" not in reason
        assert "ExceptionGroup" not in reason
        assert "Traceback" not in reason
    joined = " | ".join(error.reasons)
    for fragment in fragments:
        assert fragment in joined
    assert "msg-1" in str(error)


def test_every_problem_gets_its_own_reason() -> None:
    """Two independent problems are reported as two readable reasons, not one opaque error."""
    text = mutated(lambda r: r.update(finished="yes", error=7))
    with pytest.raises(MalformedRecord) as caught:
        _codec.decode_assistant(text, key="k")
    reasons = caught.value.reasons
    assert len(reasons) == 2
    assert any("finished" in r for r in reasons)
    assert any("$.error" in r for r in reasons)


def test_malformed_record_is_not_an_exception_group() -> None:
    """MalformedRecord is a plain TrioSessionsError, caught by name, not an ExceptionGroup."""
    with pytest.raises(MalformedRecord) as caught:
        _codec.decode_assistant(mutated(lambda r: r.update(finished="false")), key="k")
    assert not isinstance(caught.value, BaseExceptionGroup)
    assert isinstance(caught.value, TrioSessionsError)
    assert caught.value.__cause__ is None


def test_number_overflowing_to_infinity_is_malformed() -> None:
    """A number too large for a float (decoded as inf) is rejected like the Infinity literal."""
    text = json.dumps(VALID).replace('"output": null', '"output": 1e400')
    with pytest.raises(MalformedRecord):
        _codec.decode_assistant(text, key="k")


def test_deeply_nested_json_is_malformed_not_recursion_error() -> None:
    """A pathologically nested row is reported as MalformedRecord, never as RecursionError."""
    depth = 100_000
    text = '{"parts": [], "finished": false, "error": null, "x": ' + "[" * depth + "]" * depth + "}"
    with pytest.raises(MalformedRecord):
        _codec.decode_assistant(text, key="k")


def test_malformed_stored_row_raises_from_read_transcript(db: Db) -> None:
    """A malformed assistant row in SQLite surfaces as MalformedRecord keyed by its message id."""
    session_id = db.write_assistant(AssistantData(parts=(), finished=False, error=None))
    db.conn.execute(
        "UPDATE session_message SET data = ? WHERE session_id = ?",
        ('{"parts": [], "finished": "false", "error": null}', session_id),
    )
    with pytest.raises(MalformedRecord) as caught:
        db.run(_store.read_transcript, session_id)
    assert caught.value.key == "m-" + session_id
    assert any("finished" in r for r in caught.value.reasons)


def test_user_payload_must_be_an_object() -> None:
    """decode_object rejects a stored payload that is JSON but not an object."""
    assert _codec.decode_object('{"a": [1]}', table="session_input", key="i") == {"a": [1]}
    with pytest.raises(MalformedRecord) as caught:
        _codec.decode_object("[1]", table="session_input", key="i")
    assert caught.value.table == "session_input"
    assert "expected a JSON object" in caught.value.reasons[0]


# ---------------------------------------------------------------------------------------------
# Arbitrary input: decode or MalformedRecord, nothing else


def decodes_or_malformed(text: Any) -> AssistantData | None:
    try:
        return _codec.decode_assistant(text, key="k")
    except MalformedRecord as exc:
        reasons = exc.reasons
    assert reasons
    assert all(isinstance(r, str) and r for r in reasons)
    return None


@SETTINGS
@given(json_values)
def test_random_json_decodes_or_raises_malformed(value: Any) -> None:
    """Any JSON value either decodes to AssistantData or raises MalformedRecord."""
    decoded = decodes_or_malformed(json.dumps(value))
    if decoded is not None:
        assert _codec.decode_assistant(_codec.encode_assistant(decoded), key="k") == decoded


@SETTINGS
@given(st.text(max_size=60))
def test_random_text_decodes_or_raises_malformed(text: str) -> None:
    """Any text (mostly not JSON) either decodes or raises MalformedRecord."""
    decodes_or_malformed(text)


@st.composite
def corrupted_records(draw: st.DrawFn) -> str:
    """A valid record with one node (anywhere in the tree) replaced by an arbitrary JSON value."""
    record: Any = json.loads(_codec.encode_assistant(draw(assistant_data)))
    container: Any = None
    key: Any = None
    node = record
    while isinstance(node, dict | list) and node and draw(st.booleans()):
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        key = draw(st.sampled_from(keys))
        container, node = node, node[key]
    replacement = draw(json_values)
    if container is None:
        return json.dumps(replacement)
    container[key] = replacement
    return json.dumps(record)


@RECORD_SETTINGS
@given(corrupted_records())
def test_corrupted_records_decode_or_raise_malformed(text: str) -> None:
    """A valid record with any one node replaced decodes (and then round-trips) or raises
    MalformedRecord - never a cattrs ExceptionGroup, KeyError or TypeError."""
    decoded = decodes_or_malformed(text)
    if decoded is not None:
        assert _codec.decode_assistant(_codec.encode_assistant(decoded), key="k") == decoded


def test_dumps_refuses_what_loads_would_refuse() -> None:
    """The encoder never writes NaN or Infinity, so everything it writes decodes again."""
    for value in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(ValueError, match="not JSON compliant"):
            _codec.dumps({"x": value})


def test_the_loop_budget_is_unset_by_default_and_per_thread() -> None:
    """No budget anywhere unless a block sets one (worker threads, PostgreSQL, the inline
    test store, the CLI's engine), and a block sets it for its own thread only: a worker
    thread decodes whatever size while the loop's thread is held to its budget."""
    assert _codec.budget_left() is None
    big = _codec.dumps([[] for _ in range(1000)])
    seen: list[Any] = []

    def worker() -> None:
        seen.append(_codec.budget_left())
        seen.append(len(_codec.loads(big)))

    with _codec.loop_budget(10):
        thread = threading.Thread(target=worker)
        thread.start()
        thread.join()
        assert _codec.budget_left() == 10
        with pytest.raises(_codec.OffTheLoop):
            _codec.loads(big)
    assert seen == [None, 1000]
    assert _codec.budget_left() is None


def test_the_loop_budget_is_restored_after_the_block_even_on_error() -> None:
    """The budget a block set is gone once it exits, by an error too (its own `OffTheLoop`
    included), and an enclosing block's budget is back as it was."""
    with pytest.raises(_codec.OffTheLoop), _codec.loop_budget(5):
        _codec.spend(6)
    assert _codec.budget_left() is None
    with _codec.loop_budget(100):
        _codec.spend(40)
        with pytest.raises(KeyError), _codec.loop_budget(7):
            raise KeyError("x")
        assert _codec.budget_left() == 60
    assert _codec.budget_left() is None


def test_off_the_loop_is_raised_exactly_when_the_budget_is_spent() -> None:
    """Spending what remains is allowed, one unit more raises `OffTheLoop` before any of
    that work is done - and leaves the budget as it was, for a smaller operation of the
    same batch. `loads` spends its text's length."""
    with _codec.loop_budget(10):
        _codec.spend(4)
        _codec.spend(6)
        assert _codec.budget_left() == 0
        with pytest.raises(_codec.OffTheLoop):
            _codec.spend(1)
        assert _codec.budget_left() == 0
        _codec.spend(0)
    with _codec.loop_budget(len("[[],[]]")):
        assert _codec.loads("[[],[]]") == [[], []]
    with _codec.loop_budget(len("[[],[]]") - 1), pytest.raises(_codec.OffTheLoop):
        _codec.loads("[[],[]]")


def test_off_the_loop_is_no_error_an_operation_would_catch() -> None:
    """Operations catch `ValueError`, `TypeError`, `RuntimeError` and the library's own
    errors as refusals or malformed rows: `OffTheLoop` is none of them, so it always
    reaches the executor, which runs the operation again in its worker thread."""
    for caught in (ValueError, TypeError, RuntimeError, TrioSessionsError, MalformedRecord):
        assert not issubclass(_codec.OffTheLoop, caught)
    assert issubclass(_codec.OffTheLoop, Exception)


def test_encoding_on_the_loop_spends_the_tool_parts_sizes() -> None:
    """Encoding an assistant message or a step under a budget spends its tool parts' input
    and output (a node `NODE_UNITS`, a character one) and its text: a large result raises
    `OffTheLoop`, a small message encodes as without a budget."""
    big = ToolPart("c1", "search", {"q": "x"}, "completed", [[] for _ in range(10_000)], None)
    small = AssistantData(parts=(TextPart("hi"),), finished=True, error=None)
    large = AssistantData(parts=(TextPart("hi"), big), finished=True, error=None)
    with _codec.loop_budget(_codec.NODE_UNITS * 1000):
        assert _codec.encode_assistant(small) == _codec.dumps(
            {"parts": [{"text": "hi", "type": "text"}], "finished": True, "error": None}
        )
        with pytest.raises(_codec.OffTheLoop):
            _codec.encode_assistant(large)
        with pytest.raises(_codec.OffTheLoop):
            _codec.encode_step(("part", big))
        assert _codec.encode_step(("finish", {"error": None})) == '{"error":null}'
    assert _codec.decode_assistant(_codec.encode_assistant(large), key="m") == large


def test_the_units_walk_stops_once_past_its_limit() -> None:
    """`json_units` counts a value's units (a node `NODE_UNITS`, a character one) exactly
    up to its limit and stops as soon as the count passes it, so a huge value costs the
    walk no more than a small one."""
    value = {"a": ["xyz", [1, 2]], "b": None}
    exact = _codec.json_units(value, 10**9)
    # 7 nodes, the keys' and the string's characters.
    assert exact == 7 * _codec.NODE_UNITS + len("a") + len("b") + len("xyz")
    assert _codec.json_units(value, exact) == exact
    assert _codec.json_units(value, exact - 1) > exact - 1
    assert _codec.is_small(value, exact) and not _codec.is_small(value, exact - 1)

    class Counted(list[Any]):
        """A list that counts how often the walk iterated over it."""

        iterated = 0

        def __iter__(self) -> Iterator[Any]:
            Counted.iterated += 1
            return super().__iter__()

    huge = Counted([Counted([]) for _ in range(100_000)])
    assert _codec.json_units(huge, 1000) > 1000
    assert Counted.iterated == 0  # refused on its length, before a child was visited


def test_a_surrogate_pair_costs_one_decoding_as_any_text() -> None:
    """An emoji is stored as a pair of surrogate escapes (`dumps` escapes everything past
    ASCII): its message decodes within the loop budget its text's length buys, as one
    without it does. Before, any surrogate escape - a pair too - had the decoded value
    encoded once more to look for a lone one: twice the budget spent (a message from half
    the budget on went off the loop) and three to four times the time (200 KB: 0.7 ms ->
    2.6 ms); found measuring a 200 KB message's decode."""
    for text in ("a smile \U0001f600 and a flag \U0001f1eb\U0001f1f7", "\U0001f600" * 1000):
        stored = _codec.dumps({"text": text})
        assert "\\ud83d\\ude00" in stored or "\\ud83c\\uddeb" in stored
        with _codec.loop_budget(len(stored)):
            assert _codec.decode_object(stored, table="session_input", key="i") == {"text": text}


@pytest.mark.parametrize(
    "stored",
    [
        r'{"t": "\\\ud800"}',  # an escaped backslash, then a lone high surrogate
        r'{"t": "\ud83d\\ude00"}',  # a high surrogate, then an escaped backslash
        r'{"t": "\\ud83d\ude00"}',  # text that reads as a high escape, then a lone low one
        r'{"t": "\\\\\udc00"}',  # two escaped backslashes, then a lone low surrogate
        r'{"t": "\ud800\ud800\udc00"}',  # a lone high one before a pair
        r'{"t": "\uDBFF"}',  # upper case
        r'{"t\udfff": 1}',  # in a key
    ],
)
def test_a_lone_surrogate_escape_is_found_beside_backslashes_and_pairs(stored: str) -> None:
    """The look for a lone surrogate escape tells a pair from two lone halves and an
    escape from text that only reads as one (an escaped backslash before `ud800`): each
    of these holds a lone surrogate once decoded, and is malformed."""
    with pytest.raises(MalformedRecord, match="lone surrogate"):
        _codec.decode_object(stored, table="session_input", key="i")


@pytest.mark.parametrize(
    "stored",
    [r'{"t": "\ud83d\ude00"}', r'{"t": "\\ud800"}', r'{"t": "\\\ud83d\uDE00 \\\\ud800"}'],
)
def test_a_pair_or_text_that_reads_as_an_escape_is_no_lone_surrogate(stored: str) -> None:
    """A pair is one character once decoded, and `\\ud800` after an escaped backslash is
    text: both decode."""
    assert set(_codec.decode_object(stored, table="session_input", key="i")) == {"t"}


@pytest.mark.parametrize(
    ("stored", "where"),
    [
        (r'{"t": "a\u0000b"}', "$.t"),
        (r'{"t": ["x", "\\\u0000"]}', "$.t[1]"),  # an escaped backslash, then a NUL
        (r'{"t": {"k\u0000": 1}}', "a key of $.t"),
    ],
)
def test_a_nul_escape_is_malformed_naming_where_it_is(stored: str, where: str) -> None:
    """Every writer refuses a NUL (§8: PostgreSQL cannot store one), so a reader does too,
    naming where it is - as for a lone surrogate. Found by the audit (audU53): a stored
    `\\u0000` decoded."""
    with pytest.raises(MalformedRecord) as caught:
        _codec.decode_object(stored, table="session_input", key="i")
    [reason] = caught.value.reasons
    assert f"NUL character (\\x00) at {where}," in reason


def test_text_that_only_reads_as_a_nul_escape_decodes() -> None:
    """An escaped backslash before `u0000` is text, not a NUL."""
    stored = r'{"t": "\\u0000 and \\\\\\u0000"}'
    assert _codec.decode_object(stored, table="session_input", key="i") == {
        "t": "\\u0000 and \\\\\\u0000"
    }


def test_a_streamed_text_holding_a_nul_is_malformed() -> None:
    """A streamed text row (SQLite keeps a raw NUL another tool wrote) is refused as the
    message's other text is: no writer stores one."""
    with pytest.raises(MalformedRecord, match=r"streamed text #1 holds a NUL"):
        _codec.decode_streamed(["fine", "a\x00b"], key="m")


def _whole_or_error(text: str) -> Any:
    try:
        return ("value", _codec.loads(text))
    except ValueError as exc:
        return ("error", type(exc))


# Texts shaped like a message, and near misses of that shape a part-wise decode must not
# read differently from the whole decode.
_MESSAGE_LIKE = st.builds(
    lambda parts, sep, tail: '{"parts":[' + sep.join(parts) + "]" + tail,
    st.lists(
        st.sampled_from(
            [
                '{"text":"a","type":"text"}',
                "[]",
                "1",
                '"x"',
                "[[],[[]]]",
                "{}",
                "",
                " 1",
                "NaN",
                "1e999",
                '{"a":1',
                "[1,]",
            ]
        ),
        max_size=4,
    ),
    st.sampled_from([",", ", ", " ,"]),
    st.sampled_from(
        [
            "}",
            ',"finished":true,"error":null}',
            ',"finished":false}',
            ",}",
            ', "finished":true}',
            ',"parts":[2]}',
            "}x",
            "} ",
            ',"finished":true,"error":"e"} ',
            ',"error":null',
            "]}",
            "",
        ]
    ),
)


@RECORD_SETTINGS
@given(_MESSAGE_LIKE)
def test_a_message_decoded_by_part_reads_as_the_whole_decode_does(text: str) -> None:
    """`loads_message` gives the value `loads` gives, or refuses what it refuses, for texts
    of the message's shape and the near misses around it (space between parts, `,}`, a
    second "parts" key, text after the object, a broken part)."""
    try:
        got: Any = ("value", _codec.loads_message(text))
    except ValueError as exc:
        got = ("error", type(exc))
    assert got == _whole_or_error(text)


@RECORD_SETTINGS
@given(assistant_data)
def test_a_stored_message_is_decoded_a_part_per_decoder_call(data: AssistantData) -> None:
    """A message's text as stored decodes to the same value a part per call: no call of
    the C decoder reads more than one part (it holds the GIL for the whole call)."""
    text = _codec.encode_assistant(data)
    whole = _codec.loads(text)
    read: list[int] = []
    decoder = _codec._DECODER

    class Counting(json.JSONDecoder):
        def raw_decode(self, s: str, idx: int = 0) -> tuple[Any, int]:
            value, end = decoder.raw_decode(s, idx)
            read.append(end - idx)
            return value, end

        def decode(self, s: str, _w: Any = None) -> Any:
            read.append(len(s))
            return decoder.decode(s)

    _codec._DECODER = Counting()
    try:
        by_part = _codec.loads_message(text)
    finally:
        _codec._DECODER = decoder
    assert by_part == whole
    longest_part = max((len(_codec.encode_step(("part", p))) for p in data.parts), default=0)
    assert max(read) <= max(
        longest_part, len(text) - len(",".join(_codec.encode_step(("part", p)) for p in data.parts))
    )
