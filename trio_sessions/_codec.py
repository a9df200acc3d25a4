"""Strict JSON encoding and decoding of durable records.

cattrs coerces by default (`"false"` becomes `True`, `1` becomes `"1"`); this converter does
not. Invariant: a row either decodes to exactly the attrs value that was written, or raises
`MalformedRecord` naming the table, the key and one readable reason per problem. No cattrs
ExceptionGroup and no bare json error ever leaves this module.
"""

from __future__ import annotations

import json
import math
from typing import Any, NoReturn

import cattrs
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


def _structure_parts(value: Any, _: type) -> tuple[Part, ...]:
    if type(value) is not list:
        raise TypeError(f"expected a list of parts, got {type(value).__name__} {value!r}")
    return tuple(_converter.structure(item, Part) for item in value)  # type: ignore[arg-type]


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
    return format_exception(exc, type_)


def _reject_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not JSON")


def dumps(value: Any) -> str:
    """Encode `value` as compact JSON; `ValueError`/`TypeError` for anything JSON cannot hold."""
    return json.dumps(value, allow_nan=False, separators=(",", ":"))


def loads(text: Any) -> Any:
    """Decode JSON text, rejecting NaN/Infinity, which `dumps` never writes."""
    if not isinstance(text, str):
        raise TypeError(f"expected JSON text, got {type(text).__name__}")
    return json.loads(text, parse_constant=_reject_constant)


def check_json_object(value: Any, what: str) -> str:
    """Validate a caller's JSON object argument and return its encoding (nothing is written)."""
    if not isinstance(value, dict):
        raise TypeError(f"{what} must be a JSON object (dict), got {type(value).__name__}")
    return check_json(value, what)


def check_json(value: Any, what: str) -> str:
    """Validate that `value` is plain JSON and return its encoding."""
    try:
        text = dumps(value)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{what} is not JSON-serialisable: {exc}") from None
    if _contains_non_finite(value):  # pragma: no cover - dumps(allow_nan=False) already refuses
        raise ValueError(f"{what} contains a non-finite number")
    return text


def _contains_non_finite(value: Any) -> bool:
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, dict):
        return any(_contains_non_finite(v) for v in value.values())
    if isinstance(value, list | tuple):
        return any(_contains_non_finite(v) for v in value)
    return False


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
