"""Strict JSON encoding and decoding of durable records.

cattrs coerces by default (`"false"` becomes `True`, `1` becomes `"1"`); this converter does
not. Invariant: a row either decodes to exactly the attrs value that was written, or raises
`MalformedRecord` naming the table, the key and one readable reason per problem. No cattrs
ExceptionGroup and no bare json error ever leaves this module.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any, Literal, NoReturn, get_args, get_origin

import cattrs
from cattrs.errors import IterableValidationNote
from cattrs.v import format_exception

from ._errors import MalformedRecord
from ._model import AssistantData, Part, TextPart, ToolPart


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
    return json.dumps(value, allow_nan=False, separators=(",", ":"))


def loads(text: Any) -> Any:
    """Decode JSON text, rejecting what `dumps` could never write back (NaN, Infinity,
    numbers that overflow a float, nesting beyond Python's recursion limit)."""
    if not isinstance(text, str):
        raise TypeError(f"expected JSON text, got {type(text).__name__}")
    try:
        return _DECODER.decode(text)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


# One decoder for every `loads` (`json.loads` with these options builds a new one per call).
_DECODER = json.JSONDecoder(parse_constant=_reject_constant, parse_float=_finite_float)


# The largest JSON object a caller may store as one record - an input payload or a tool
# input - measured as its compact UTF-8 encoding. Larger data belongs in a blob store, with
# its reference in the payload: every input is read whole by each `take_inputs`.
MAX_PAYLOAD_BYTES = 1024 * 1024  # 1 MiB


def check_json_object(value: Any, what: str) -> str:
    """Validate a caller's JSON object argument and return its encoding (nothing is written).

    `ValueError` naming the size when the encoding exceeds `MAX_PAYLOAD_BYTES`.
    """
    if not isinstance(value, dict):
        raise TypeError(f"{what} must be a JSON object (dict), got {type(value).__name__}")
    text = check_json(value, what)
    size = len(text.encode("utf-8"))
    if size > MAX_PAYLOAD_BYTES:
        raise ValueError(
            f"{what} is {size} bytes encoded as JSON; the limit is {MAX_PAYLOAD_BYTES} bytes"
            " (1 MiB)"
        )
    return text


MAX_DEPTH = 100


def check_json(value: Any, what: str) -> str:
    """Validate that `value` is plain JSON that reads back as itself; return its encoding.

    Refused before anything is written: non-str object keys (JSON would turn `1` into
    `"1"`), NaN and infinities, nesting deeper than `MAX_DEPTH`, non-JSON types.
    """
    _check_plain(value, what, "$", 0)
    try:
        return dumps(value)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{what} is not JSON-serialisable: {exc}") from None


def _check_plain(value: Any, what: str, path: str, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise ValueError(f"{what} is nested deeper than {MAX_DEPTH} levels at {path}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{what} holds a non-finite number at {path}: {value!r}")
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"{what} has a non-str key {key!r} at {path}")
            _check_plain(item, what, f"{path}.{key}", depth + 1)
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            _check_plain(item, what, f"{path}[{index}]", depth + 1)


def encode_assistant(data: AssistantData) -> str:
    return dumps(_converter.unstructure(data))


def decode_assistant(text: Any, *, key: str) -> AssistantData:
    """Decode an assistant message's `data`; `MalformedRecord` with readable reasons otherwise."""
    raw = _decode_json(text, table="session_message", key=key)
    if type(raw) is not dict:
        raise MalformedRecord("session_message", key, [f"expected a JSON object, got {raw!r}"])
    try:
        return _converter.structure(raw, AssistantData)
    except cattrs.BaseValidationError as exc:
        reasons = cattrs.transform_error(exc, format_exception=_format_reason)
        raise MalformedRecord("session_message", key, reasons) from None
    except (TypeError, ValueError, AttributeError) as exc:
        raise MalformedRecord("session_message", key, [str(exc)]) from None


def decode_streamed(texts: Sequence[Any], *, key: str) -> list[str]:
    """The text rows streamed onto a message (`session_message_delta.text`, in order);
    `MalformedRecord` naming the message when one is not text."""
    reasons = [
        f"streamed text #{index} is {type(text).__name__} {text!r}, not text"
        for index, text in enumerate(texts)
        if type(text) is not str
    ]
    if reasons:
        raise MalformedRecord("session_message_delta", key, reasons)
    return list(texts)


def decode_object(text: Any, *, table: str, key: str) -> dict[str, Any]:
    """Decode a JSON object column (input payloads, user messages)."""
    raw = _decode_json(text, table=table, key=key)
    if type(raw) is not dict:
        raise MalformedRecord(table, key, [f"expected a JSON object, got {raw!r}"])
    return raw


def _decode_json(text: Any, *, table: str, key: str) -> Any:
    try:
        return loads(text)
    except (TypeError, ValueError) as exc:
        raise MalformedRecord(table, key, [f"not JSON: {exc}"]) from None
