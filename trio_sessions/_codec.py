"""Strict JSON encoding and decoding of durable records.

cattrs coerces by default (`"false"` becomes `True`, `1` becomes `"1"`); this converter does
not. Invariant: a row either decodes to exactly the attrs value that was written, or raises
`MalformedRecord` naming the table, the key and one readable reason per problem. No cattrs
ExceptionGroup and no bare json error ever leaves this module.

It also validates what callers hand over before anything is written (`check_json`,
`check_json_object`, `check_text`): plain JSON that reads back as itself, no NUL character
(one backend cannot store it, so none does: DESIGN §8), no lone surrogate (no UTF-8 for
it), at most `MAX_PAYLOAD_BYTES` (1 MiB) per value; `is_small` tells a caller on the event
loop whether the check is cheap enough to run there (§6.26).

And it keeps the event loop's thread to a budget (`loop_budget`): where a block sets one,
`loads` and the encoding of an assistant message or step spend their size from it first, and
raise `OffTheLoop` - before doing the work - when it would be overspent, for the caller to
run the whole operation again in a worker thread. Invariant: no budget is set anywhere but
inside such a block, on the thread that set it, and only around synchronous code (a task
switch at an `await` would hand it to another task).
"""

from __future__ import annotations

import json
import math
import re
import threading
from collections.abc import Callable, Sequence
from typing import Any, Literal, NoReturn, get_args, get_origin

import attrs
import cattrs
from cattrs.errors import IterableValidationNote
from cattrs.v import format_exception

from ._errors import MalformedRecord
from ._model import AssistantData, Part, Step, TextPart, ToolPart


def _strict(expected: type) -> Any:
    def structure(value: Any, _: type) -> Any:
        if type(value) is not expected:
            raise TypeError(f"expected {expected.__name__}, got {type(value).__name__} {value!r}")
        return value

    return structure


def _structure_object(value: Any, _: type) -> dict[str, Any]:
    if type(value) is not dict:
        raise TypeError(f"expected a JSON object, got {type(value).__name__} {value!r}")
    return value


def _structure_parts(value: Any, type_: type) -> tuple[Part, ...]:
    if type(value) is not list:
        raise TypeError(f"expected a list of parts, got {type(value).__name__} {value!r}")
    parts: list[Part] = []
    errors: list[Exception] = []
    for index, item in enumerate(value):
        try:
            parts.append(_converter.structure(item, Part))  # type: ignore[arg-type]
        except Exception as exc:
            # The note gives the reason its list index: "@ $.parts[2].status".
            exc.__notes__ = [*getattr(exc, "__notes__", []), _index_note(index, type_)]
            errors.append(exc)
    if errors:
        raise cattrs.IterableValidationError("invalid parts", errors, type_)
    return tuple(parts)


def _index_note(index: int, type_: type) -> IterableValidationNote:
    return IterableValidationNote(f"Structuring {type_} @ index {index}", index, Part)


def _structure_part(value: Any, _: type) -> Part:
    if type(value) is not dict:
        raise TypeError(f"expected a part object, got {type(value).__name__} {value!r}")
    kind = value.get("type")
    if kind == "text":
        return _converter.structure(value, TextPart)
    if kind == "tool":
        return _converter.structure(value, ToolPart)
    raise ValueError(f"unknown part type {kind!r}")


_converter = cattrs.Converter(forbid_extra_keys=True, detailed_validation=True)
for _type in (str, int, bool):
    _converter.register_structure_hook(_type, _strict(_type))
_converter.register_structure_hook_func(lambda t: t == dict[str, Any], _structure_object)
_converter.register_structure_hook_func(lambda t: t == tuple[Part, ...], _structure_parts)
_converter.register_structure_hook_func(lambda t: t == Part, _structure_part)


def _format_reason(exc: BaseException, type_: type | None) -> str:
    # Our own hooks raise with readable messages; nested validation errors from those hooks
    # would otherwise be reported as one opaque "invalid value" at the parent's path.
    if isinstance(exc, cattrs.BaseValidationError):
        return "; ".join(cattrs.transform_error(exc, format_exception=_format_reason))
    if isinstance(exc, TypeError | ValueError) and not isinstance(exc, KeyError):
        return str(exc)
    if " not in literal " in str(exc) and get_origin(type_) is Literal:
        # cattrs says "x not in literal typing.Literal[...]"; say what was allowed.
        got = str(exc).split(" not in literal", 1)[0]
        allowed = ", ".join(repr(option) for option in get_args(type_))
        return f"expected one of {allowed}, got {got!r}"
    return format_exception(exc, type_)


def _reject_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text} does not fit a float")
    return value


def dumps(value: Any) -> str:
    """Encode `value` as compact JSON; `ValueError`/`TypeError` for anything JSON cannot hold."""
    return _ENCODER.encode(value)


# One encoder for every `dumps` (`json.dumps` with these options builds a new one per call).
_ENCODER = json.JSONEncoder(allow_nan=False, separators=(",", ":"))


def loads(text: Any) -> Any:
    """Decode JSON text, rejecting what `dumps` could never write back (NaN, Infinity,
    numbers that overflow a float, nesting beyond Python's recursion limit). Spends the
    text's length of the thread's loop budget first (`OffTheLoop`), if one is set."""
    if not isinstance(text, str):
        raise TypeError(f"expected JSON text, got {type(text).__name__}")
    spend(len(text))
    return _decoded_whole(text)


def _decoded_whole(text: str) -> Any:
    try:
        return _DECODER.decode(text)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


# How `encode_assistant` begins a message's text.
_PARTS_OPEN = '{"parts":['


def loads_message(text: Any) -> Any:
    """`loads` of an assistant message's text, a part per decoder call when the text is as
    `encode_assistant` writes it (else whole): the same value either way. The C decoder
    holds the GIL for as long as one call runs, and in a worker thread the event loop's
    thread waits that long for it - a message of several large tool results was one call
    of its whole size; a part is at most a tool's input and output of 1 MiB each."""
    if not (isinstance(text, str) and text.startswith(_PARTS_OPEN)):
        return loads(text)
    spend(len(text))
    try:
        value = _decoded_by_part(text)
    except (ValueError, RecursionError):
        value = None  # whatever is wrong, the whole decode says it as it always did
    return _decoded_whole(text) if value is None else value


def _decoded_by_part(text: str) -> dict[str, Any] | None:
    """`{"parts": [...], ...}` decoded a part per call; None for a text of another shape
    (space between the parts, a second "parts" key, anything after the object)."""
    parts: list[Any] = []
    end = len(_PARTS_OPEN)
    if not text.startswith("]", end):
        while True:
            part, end = _DECODER.raw_decode(text, end)
            parts.append(part)
            if not text.startswith(",", end):
                break
            end += 1
        if not text.startswith("]", end):
            return None
    tail = text[end + 1 :]
    if tail == "}":
        return {"parts": parts}
    if not tail.startswith(',"'):
        return None  # `,}` would decode as `{}`: the whole decode refuses it
    rest = _DECODER.decode("{" + tail[1:])
    if "parts" in rest:
        return None  # the last of two keys wins: the whole decode tells which
    return {"parts": parts, **rest}


# One decoder for every `loads` (`json.loads` with these options builds a new one per call).
_DECODER = json.JSONDecoder(parse_constant=_reject_constant, parse_float=_finite_float)


# The largest value a caller may store as one record - an input payload, a tool's input,
# output or error, one appended text - measured as its stored compact JSON encoding (ASCII:
# a character outside it counts as its \uXXXX escape), or as UTF-8 for text. Larger data
# belongs in a blob store, with its reference in the record: every input is read whole by
# each `take_inputs`, every message by each `transcript`.
MAX_PAYLOAD_BYTES = 1024 * 1024  # 1 MiB

# `is_small`'s budget: a value costing at most this many units (one per character of text,
# NODE_UNITS per JSON node) is checked and encoded on the event loop in well under a
# millisecond or so; a larger one goes to a worker thread (§6.26: no loop stall > 50 ms).
INLINE_CHECK_UNITS = 256 * 1024
NODE_UNITS = 32

NUL = "\x00"


def check_text(value: Any, what: str, *, limit: int = MAX_PAYLOAD_BYTES) -> str:
    """Validate a caller's text argument (nothing is written): `TypeError` unless a str;
    `ValueError` over `limit` bytes in UTF-8 or holding a NUL character (PostgreSQL cannot
    store one, so neither backend does). Costs no more for a huge text than for a small
    one once it is over the limit."""
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str, got {type(value).__name__}")
    # A str's length is known at once; its UTF-8 size is at least that and at most 4x.
    if len(value) > limit:
        size = len(value) if value.isascii() else None
        _too_large(what, size, limit, "in UTF-8")
    if 4 * len(value) > limit:
        size = len(value.encode("utf-8", "surrogatepass"))
        if size > limit:
            _too_large(what, size, limit, "in UTF-8")
    if (index := _unstorable(value)) is not None:
        _refuse(what, value[index], f"index {index}")
    return value


def check_json_object(value: Any, what: str) -> str:
    """Validate a caller's JSON object argument and return its encoding (nothing is written).

    As `check_json` with `limit=MAX_PAYLOAD_BYTES`, and `TypeError` unless a dict.
    """
    if not isinstance(value, dict):
        raise TypeError(f"{what} must be a JSON object (dict), got {type(value).__name__}")
    return check_json(value, what, limit=MAX_PAYLOAD_BYTES)


MAX_DEPTH = 100


def check_json(value: Any, what: str, *, limit: int | None = None) -> str:
    """Validate that `value` is plain JSON that reads back as itself; return its encoding.

    Refused before anything is written: non-str object keys (JSON would turn `1` into
    `"1"`), NaN and infinities, nesting deeper than `MAX_DEPTH`, non-JSON types, a NUL
    character in any string or key (`ValueError`, as `check_text`), and an encoding over
    `limit` bytes (`ValueError` naming the size and the limit). A value whose encoding
    must exceed `limit` is refused without encoding it, as soon as that is certain, so a
    huge value costs little more than a small one. Otherwise it costs time in proportion
    to the value: a caller on the event loop runs it in a thread unless `is_small(value)`.
    """
    _check_plain(value, what, None, 0, _Bound(limit))
    try:
        text = dumps(value)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{what} is not JSON-serialisable: {exc}") from None
    if limit is not None:
        size = len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
        if size > limit:
            _too_large(what, size, limit, "encoded as JSON")
    return text


class _Bound:
    """A lower bound on a value's compact JSON size, added up during the check: each
    string's characters and quotes, one byte per other value and per separator."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.size = 0

    def add(self, size: int, what: str) -> None:
        self.size += size
        if self.limit is not None and self.size > self.limit:
            _too_large(what, None, self.limit, "encoded as JSON", at_least=self.size)


def is_small(value: Any, budget: int = INLINE_CHECK_UNITS) -> bool:
    """Whether `check_json(value)` is cheap enough for the event loop: at most `budget`
    units (`json_units`)."""
    return json_units(value, budget) <= budget


def json_units(value: Any, limit: int) -> int:
    """What encoding or checking `value` costs, in units (a character of text or of a key
    is one, a JSON node `NODE_UNITS`): the exact count while it stays within `limit`, else
    some count over `limit`, returned as soon as it is certain. So it costs at most about
    `limit / NODE_UNITS` steps, whatever the value's size: a container is refused on its
    length before any of its items is looked at."""
    units = 0
    stack = [value]
    while stack:
        item = stack.pop()
        units += NODE_UNITS
        if isinstance(item, str):
            units += len(item)
        elif isinstance(item, dict | list | tuple):
            if units + len(item) * NODE_UNITS > limit:
                return units + len(item) * NODE_UNITS
            if isinstance(item, dict):
                units += sum(len(key) for key in item if isinstance(key, str))
                stack.extend(item.values())
            else:
                stack.extend(item)
        if units > limit:
            return units
    return units


class OffTheLoop(Exception):
    """An operation met more data than the event loop may decode or encode in one step
    (`loop_budget`): run it again in a worker thread. Raised before that work is done; the
    executor that set the budget rolls the operation's writes back and re-runs it, so no
    caller ever sees it. Deliberately no `ValueError`, `TypeError`, `RuntimeError` or
    `TrioSessionsError`: operations catch those as refusals or malformed rows."""


# The loop's budget in units (`json_units`; `loads` spends a character as one). Measured on
# this machine (CPython 3.11, 2 vCPU), what a batch may do on the loop within it, garbage
# collector excluded as `StepMeter` excludes it: decode a message of 256 KiB holding floats
# (`[0.5,...]`, our float hook per number) 15-17 ms, nested lists (`[[[[]]]],...`) 13 ms,
# `[[],...]` 6 ms, empty text parts (only another tool writes those) 20 ms; encode at most
# ~3 ms. Well inside DESIGN §7's 50 ms for the whole step, while a message of up to ~100 KB
# still round-trips on the loop, where a thread hand-off would cost more than the work.
LOOP_BUDGET_UNITS = 256 * 1024


class _LoopBudget(threading.local):
    """The units the running block may still spend on this thread; None: no budget."""

    units: int | None = None


_BUDGET = _LoopBudget()


def loop_budget(units: int | None = LOOP_BUDGET_UNITS) -> _Budget:
    """Hold this thread to `units` (None: no budget) for a synchronous block (`with`):
    `spend`, `loads` and the encoding of assistant messages raise `OffTheLoop` rather than
    overspend it. The budget before the block is back when it exits, by an error too.
    Never around an `await`: another task would run on the same thread with what is left."""
    return _Budget(units)


class _Budget:
    """`loop_budget`'s context manager: a class, not a generator - it wraps every batch on
    the loop, and a generator-based one cost 3 µs each."""

    __slots__ = ("_previous", "_units")

    def __init__(self, units: int | None) -> None:
        self._units = units
        self._previous: int | None = None

    def __enter__(self) -> None:
        self._previous, _BUDGET.units = _BUDGET.units, self._units

    def __exit__(self, *exc_info: object) -> None:
        _BUDGET.units = self._previous


def budget_left() -> int | None:
    """The units this thread's block may still spend (None: no budget)."""
    return _BUDGET.units


def spend(units: int) -> None:
    """Take `units` from this thread's budget, if one is set: `OffTheLoop`, with the budget
    left as it was, when fewer remain - an operation of the same batch that fits may still
    run."""
    left = _BUDGET.units
    if left is None:
        return
    if units > left:
        raise OffTheLoop(f"{units} units of data; the event loop's budget has {left} left")
    _BUDGET.units = left - units


def _spend_parts(parts: Sequence[Part]) -> None:
    """Spend what encoding `parts` costs (`json_units` of each text and each tool part's
    input and output), counted no further than the budget left: only where one is set."""
    if _BUDGET.units is None:
        return  # no walk at all off the loop (worker threads, PostgreSQL, tests' store)
    for part in parts:
        left = _BUDGET.units
        if isinstance(part, TextPart):
            spend(NODE_UNITS + len(part.text))
            continue
        units = NODE_UNITS + len(part.error or "") + json_units(part.input, left)
        spend(units + json_units(part.output, max(0, left - units)))


def _too_large(
    what: str, size: int | None, limit: int, unit: str, *, at_least: int | None = None
) -> NoReturn:
    if size is not None:
        shown = f"{size} bytes"
    elif at_least is not None:
        shown = f"at least {at_least} bytes"
    else:
        shown = f"more than {limit} bytes"
    mib = f" ({limit // (1024 * 1024)} MiB)" if limit % (1024 * 1024) == 0 else ""
    raise ValueError(f"{what} is {shown} {unit}; the limit is {limit} bytes{mib}")


def _unstorable(text: str) -> int | None:
    """Where `text` holds a character no backend stores, if it does: a NUL, else a lone
    surrogate (a str, but no Unicode text: UTF-8 has no encoding for it)."""
    if NUL in text:
        return text.index(NUL)
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None


def _refuse(what: str, char: str, where: str) -> NoReturn:
    """The `ValueError` for a character `_unstorable` found."""
    if char == NUL:
        raise ValueError(
            f"{what} holds a NUL character (\\x00) at {where}: PostgreSQL cannot store it,"
            " so no backend does"
        )
    raise ValueError(
        f"{what} holds a lone surrogate (\\u{ord(char):04x}) at {where}: it is no Unicode"
        " text, and UTF-8 - what every backend stores - has no encoding for it"
    )


def _check_string(text: str, what: str, path: _Path, *, key: bool = False) -> None:
    """A string (or, `key`, a key) of a JSON value at `path`: nothing `_unstorable`."""
    if (index := _unstorable(text)) is not None:
        where = _format_path(path)
        _refuse(what, text[index], f"a key of {where}" if key else where)


# Where a problem is, as a chain of (parent, key or index) built as the check descends and
# formatted only for an error message ("$.a[3]").
_Path = tuple[Any, str | int] | None


def _format_path(path: _Path) -> str:
    segments: list[str] = []
    while path is not None:
        path, segment = path
        segments.append(f"[{segment}]" if isinstance(segment, int) else f".{segment}")
    return "$" + "".join(reversed(segments))


def _check_plain(value: Any, what: str, path: _Path, depth: int, bound: _Bound) -> None:
    if depth > MAX_DEPTH:
        raise ValueError(f"{what} is nested deeper than {MAX_DEPTH} levels at {_format_path(path)}")
    kind = type(value)
    if kind is dict or (kind is not list and isinstance(value, dict)):
        bound.add(2 + max(0, 2 * len(value) - 1), what)  # braces, colons and commas
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"{what} has a non-str key {key!r} at {_format_path(path)}")
            bound.add(len(key) + 2, what)
            _check_string(key, what, path, key=True)
            _check_plain(item, what, (path, key), depth + 1, bound)
    elif kind is list or isinstance(value, list | tuple):
        bound.add(2 + max(0, len(value) - 1), what)  # brackets and commas
        # Scalars are checked here, without a call each: a long list of numbers is common.
        pending = 0
        for index, item in enumerate(value):
            item_kind = type(item)
            if item_kind is int or item_kind is bool or item is None:
                pending += 1
            elif item_kind is str:
                pending += len(item) + 2
                if pending > _BATCH:
                    bound.add(pending, what)  # a string too large to store is not scanned
                    pending = 0
                _check_string(item, what, (path, index))
            elif item_kind is float and math.isfinite(item):
                pending += 1
            else:
                _check_plain(item, what, (path, index), depth + 1, bound)
            if pending > _BATCH:
                bound.add(pending, what)
                pending = 0
        bound.add(pending, what)
    elif isinstance(value, str):
        bound.add(len(value) + 2, what)  # the size first: a string too large is not scanned
        _check_string(value, what, path)
    elif isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{what} holds a non-finite number at {_format_path(path)}: {value!r}")
    else:
        bound.add(1, what)


_BATCH = 4096


def encode_assistant(data: AssistantData) -> str:
    """An assistant message as stored; spends its parts' size from the thread's loop
    budget first (`OffTheLoop`), if one is set. Encoded a part at a time, as `dumps` of
    the whole writes it: the C encoder holds the GIL for as long as one call runs, and in
    a worker thread the event loop's thread waits that long for it - a message of four
    tool results of ~1 MiB was one call of up to 100-170 ms, a stall of the loop in wall
    time; a part is at most a tool's input and output of 1 MiB each."""
    _spend_parts(data.parts)
    parts = ",".join(dumps(_part_json(part)) for part in data.parts)
    return f'{{"parts":[{parts}],"finished":{dumps(data.finished)},"error":{dumps(data.error)}}}'


def _part_json(part: Part) -> dict[str, Any]:
    """A part as `dumps` writes it: cattrs' unstructuring, key order included, by hand. A
    tool's input and output go as they are - plain JSON already (checked on entry, or read
    back as such) - where the converter walked every node of them (a 1 MiB result of
    300,000 nodes: 325 ms, on SQLite on the event loop). Shared, not copied: `dumps`
    reads them at once."""
    if isinstance(part, TextPart):
        return {"text": part.text, "type": part.type}
    return {
        "call_id": part.call_id,
        "name": part.name,
        "input": part.input,
        "status": part.status,
        "output": part.output,
        "error": part.error,
        "type": part.type,
    }


def decode_assistant(text: Any, *, key: str) -> AssistantData:
    """Decode an assistant message's `data`; `MalformedRecord` with readable reasons otherwise."""
    raw = _decode_json(text, table="session_message", key=key, nul=False, decode=loads_message)
    if type(raw) is not dict:
        raise MalformedRecord("session_message", key, [f"expected a JSON object, got {raw!r}"])
    # A NUL is one more problem beside any of the shape's: each gets its own reason.
    nul = _nul_reasons(text, raw)
    try:
        data = _converter.structure(raw, AssistantData)
    except cattrs.BaseValidationError as exc:
        reasons = cattrs.transform_error(exc, format_exception=_format_reason)
        raise MalformedRecord("session_message", key, [*reasons, *nul]) from None
    except (TypeError, ValueError, AttributeError) as exc:
        raise MalformedRecord("session_message", key, [str(exc), *nul]) from None
    if reasons := [*nul, *_repeated_calls(data.parts)]:
        raise MalformedRecord("session_message", key, reasons)
    return data


def _repeated_calls(parts: Sequence[Part]) -> list[str]:
    """A reason per tool call id held by more than one part: `start_tool` refuses a call
    id already in the message and a call settles at most once (§6.12), so no writer leaves
    two parts of one call - nor could a stream client, which replaces a part by its id."""
    first: dict[str, int] = {}
    reasons = []
    for index, part in enumerate(parts):
        if not isinstance(part, ToolPart):
            continue
        if part.call_id in first:
            reasons.append(
                f"tool call {part.call_id!r} is held by parts {first[part.call_id]} and"
                f" {index}: a call is started once and settles at most once"
            )
        else:
            first[part.call_id] = index
    return reasons


@attrs.frozen
class Misplaced:
    """A streamed text whose `version` is no whole number: SQLite's INTEGER column keeps
    the text or REAL another tool writes there (no writer does; PostgreSQL's BIGINT cannot
    hold it), and its ORDER BY then puts the text after, or between, the others. Its place
    in the message is unknown, so `decode_streamed` refuses the message instead of showing
    its text reordered. A reader puts it in place of the text (`streamed_text`)."""

    version: Any
    text: Any


def streamed_text(version: Any, text: Any) -> Any:
    """A delta row as a reader passes it to `decode_streamed`: its text, or `Misplaced`
    when its version is no whole number (one type check per row: the fast path stays)."""
    return text if type(version) is int else Misplaced(version, text)


def _streamed_reason(index: int, text: Any) -> str:
    if type(text) is Misplaced:
        return (
            f"streamed text #{index} has version {text.version!r:.60}, no whole number: its"
            " place among the message's texts is unknown"
        )
    if type(text) is bytes:  # SQLite: a BLOB, or text read as its bytes (`stored_bytes`)
        return f"streamed text #{index} is bytes {text!r} (a BLOB, or not UTF-8), not text"
    if type(text) is not str:
        return f"streamed text #{index} is {type(text).__name__} {text!r}, not text"
    return f"streamed text #{index} holds a NUL character (\\x00), which no writer stores"


def decode_streamed(texts: Sequence[Any], *, key: str) -> list[str]:
    """The text rows streamed onto a message (`session_message_delta.text`, in order);
    `MalformedRecord` naming the message when one is not text, or is `Misplaced` (its
    version no whole number: the order read is not the order written)."""
    reasons = [
        _streamed_reason(index, text)
        for index, text in enumerate(texts)
        if type(text) is not str or NUL in text
    ]
    if reasons:
        raise MalformedRecord("session_message_delta", key, reasons)
    return list(texts)


def encode_step(step: Step) -> str:
    """A stream's step (`session_message_change.data`): the tool part, or the finish's
    `{"error": ...}`. A tool part spends its size from the thread's loop budget first, as
    `encode_assistant`."""
    kind, value = step
    if kind == "part":
        _spend_parts((value,))
    return dumps(_part_json(value) if kind == "part" else value)


def decode_step(kind: Any, text: Any, *, key: str) -> Step:
    """A stream's step from its row (`kind`, `data`); `MalformedRecord` otherwise."""
    raw = _decode_json(text, table="session_message_change", key=key)
    if kind == "part" and type(raw) is dict:
        try:
            return "part", _converter.structure(raw, ToolPart)
        except cattrs.BaseValidationError as exc:
            reasons = cattrs.transform_error(exc, format_exception=_format_reason)
            raise MalformedRecord("session_message_change", key, reasons) from None
    finish = type(raw) is dict and raw.keys() == {"error"}
    if kind == "finish" and finish and (raw["error"] is None or type(raw["error"]) is str):
        return "finish", raw
    reasons = [f"expected a tool part or a finish's error, got {kind!r}: {raw!r:.200}"]
    raise MalformedRecord("session_message_change", key, reasons)


def utf8_or_bytes(stored: bytes) -> str | bytes:
    """Bytes SQLite kept as TEXT (whatever bytes another tool wrote: its driver refuses the
    whole read of a row that is not UTF-8): their text, or the bytes themselves when they
    are no UTF-8."""
    try:
        return stored.decode("utf-8")
    except UnicodeDecodeError:
        return stored


def stored_value(kind: str, value: Any) -> Any:
    """A column read as `_store.common.as_stored` reads it - its type and, on SQLite, its
    bytes - as it was stored: text stored as text when its bytes are UTF-8; anything else
    (such bytes, a BLOB, a number) as it is."""
    return utf8_or_bytes(value) if kind == "text" and isinstance(value, bytes) else value


def stored_text(kind: str, value: Any, *, table: str, key: str) -> Any:
    """`stored_value`, or `MalformedRecord` naming the first byte that is no UTF-8 when text
    was stored whose bytes are not. Any other value (a BLOB, a number) is returned as it
    is, for the decoding that follows to refuse."""
    if kind != "text" or not isinstance(value, bytes):
        return value
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError as exc:
        reason = f"not UTF-8 text: byte {value[exc.start]:#04x} at {exc.start}"
        raise MalformedRecord(table, key, [reason]) from None


def shown_text(value: Any) -> Any:
    """A stored value as an operator reads it: bytes that are not UTF-8 shown with
    replacement characters."""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def decode_object(text: Any, *, table: str, key: str) -> dict[str, Any]:
    """Decode a JSON object column (input payloads, user messages)."""
    raw = _decode_json(text, table=table, key=key)
    if type(raw) is not dict:
        raise MalformedRecord(table, key, [f"expected a JSON object, got {raw!r}"])
    return raw


def _decode_json(
    text: Any, *, table: str, key: str, nul: bool = True, decode: Callable[[Any], Any] = loads
) -> Any:
    """`decode` (`loads`), or `MalformedRecord`: not JSON, a lone surrogate, or (unless
    `nul` is False: the caller reports `_nul_reasons` itself) a NUL character."""
    try:
        raw = decode(text)
    except (TypeError, ValueError) as exc:
        if isinstance(text, bytes):  # text that is not UTF-8, read as its bytes: say so
            stored_text("text", text, table=table, key=key)
        raise MalformedRecord(table, key, [f"not JSON: {exc}"]) from None
    if "\\" not in text:
        return raw  # no escape at all (a memchr): neither check below can find one
    if _SURROGATE_ESCAPE.search(text) is not None:
        spend(len(text))  # the check below encodes the value once more
        _refuse_lone_surrogates(raw, table=table, key=key)
    if nul and (reasons := _nul_reasons(text, raw)):
        raise MalformedRecord(table, key, reasons)
    return raw


# The JSON escape of a NUL, after an even number of backslashes (an escaped backslash
# before `u0000` is text).
_NUL_ESCAPE = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")


def _nul_reasons(text: str, raw: Any) -> list[str]:
    """The reason, if the decoded value holds a NUL character - which every writer refuses
    (`check_text`, `check_json`: PostgreSQL cannot store one), so a reader does too. A NUL
    is stored only as its escape (JSON text holds no raw control character): a substring
    search at C speed, then the escape told from text that only reads as one."""
    if "\\" not in text or "\\u0000" not in text or _NUL_ESCAPE.search(text) is None:
        return []
    spend(len(text))  # the walk below visits the value once more
    return [f"holds a NUL character (\\x00) at {_where_nul(raw)}, which no writer stores"]


def _where_nul(raw: Any) -> str:
    found = _first_string(raw, lambda text: NUL in text)
    return "$" if found is None else found[1]


def _first_string(raw: Any, holds: Callable[[str], bool]) -> tuple[str, str] | None:
    """The first key or string in a decoded value that `holds`, and where it is (a JSON
    path, or "a key of" one): the walk that names where a reader found what no writer
    stores."""
    stack: list[tuple[Any, _Path]] = [(raw, None)]
    while stack:
        value, path = stack.pop()
        if isinstance(value, dict):
            for name, item in value.items():
                if holds(name):
                    return name, f"a key of {_format_path(path)}"
                stack.append((item, (path, name)))
        elif isinstance(value, list):
            stack.extend((item, (path, index)) for index, item in enumerate(value))
        elif isinstance(value, str) and holds(value):
            return value, _format_path(path)
    return None


# A JSON escape of a lone surrogate (`\ud800`): the only way stored text holds one, since
# both backends keep text as UTF-8, which has none. A pair - an emoji, as `dumps` escapes
# every one - is one character once decoded, and passes: a high escape followed by a low
# one, a low one preceded by a high one that no backslash escapes. It may find text that
# only reads as an escape (an escaped backslash before `ud800`), never miss a lone one;
# found, the decoded value is checked whole. Each branch begins `\uD`: a fast scan.
_SURROGATE_ESCAPE = re.compile(
    r"\\u[dD](?:[89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F])"
    r"|(?<![^\\]\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD])[c-fC-F])"
)

# Encodes decoded values back as text (not escaped): UTF-8 then refuses a lone surrogate.
_TEXT_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


def _refuse_lone_surrogates(raw: Any, *, table: str, key: str) -> None:
    """`MalformedRecord` when a decoded value holds a lone surrogate - a str no UTF-8
    encoder takes, which every writer refuses (`check_text`, `check_json`), so a reader
    does too. The check is one encoding of the value (C speed); the path to the
    offending string is looked for only when there is one."""
    try:
        _TEXT_ENCODER.encode(raw).encode("utf-8")
    except UnicodeEncodeError:
        pass
    else:
        return
    found = _first_string(raw, lambda text: _lone_surrogate(text) is not None)
    if found is not None:
        text, where = found
        index = _lone_surrogate(text)
        assert index is not None  # the walk found the string so
        _malformed_surrogate(table, key, text[index], where)


def _lone_surrogate(text: str) -> int | None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None


def _malformed_surrogate(table: str, key: str, char: str, where: str) -> NoReturn:
    reason = (
        f"holds a lone surrogate (\\u{ord(char):04x}) at {where}: no Unicode text, which"
        " no writer stores"
    )
    raise MalformedRecord(table, key, [reason])
