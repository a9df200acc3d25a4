"""Checking what callers pass in - ids, durations, counts, JSON values - before anything is
written; and the runtime's owner id.

Each check returns the value as the runtime uses it or raises `TypeError`/`ValueError` naming
the argument. None touches the store, and none stalls the event loop: a large JSON value is
checked in a worker thread. The one that reads a clock is `clock`: it reads the caller's
runtime clock once.
"""

from __future__ import annotations

import functools
import inspect
import math
import os
import socket
from collections.abc import Callable
from typing import Any, TypeVar

import attrs
import trio

from . import _backend, _codec, _store

MAX_ID_LENGTH = 200

T = TypeVar("T")


def plain_str(value: str) -> str:
    """`value` as a plain str: a subclass's text without its own `==`, hash, `len` or
    `isprintable` - the store keys by the text alone, so the runtime's dicts must too."""
    return value if type(value) is str else str.__str__(value)


def validate_id(value: object, what: str) -> str:
    """A valid key - a session's, an input's, an execution's, an owner's id: a str of 1-200
    printable characters (`what` names it in the error), returned as a plain str
    (`plain_str`): callers use the returned value, never their argument."""
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str, got {type(value).__name__}")
    value = plain_str(value)
    _codec.check_text(value[: MAX_ID_LENGTH + 1], what)
    if not 1 <= len(value) <= MAX_ID_LENGTH:
        raise ValueError(
            f"{what} must be 1-{MAX_ID_LENGTH} characters, got {len(value)}: {value[:40]!r}"
        )
    if not value.isprintable():
        raise ValueError(f"{what} must be printable, got {value!r}")
    return value


def tool_key(value: object, what: str) -> str:
    """A tool call's id or name (`what`): a non-empty str with no NUL character, as a plain
    str (`plain_str`: the message's calls are told apart by their text)."""
    text = plain_str(value) if isinstance(value, str) else None
    if not text:
        raise TypeError(f"{what} must be a non-empty str, got {value!r:.80}")
    return _codec.check_text(text, what)


def validate_session_id(session_id: object) -> str:
    return validate_id(session_id, "session id")


def validate_input_id(input_id: object) -> str:
    """The caller's input id, or a new one for None."""
    if input_id is None:
        return _store.new_id()
    if not isinstance(input_id, str):
        raise TypeError(f"input_id must be a str or None, got {type(input_id).__name__}")
    return validate_id(input_id, "input_id")


def is_async_callable(value: object) -> bool:
    """An `async def` function (also bound or wrapped in `functools.partial`), or an object
    whose `__call__` is one."""
    return inspect.iscoroutinefunction(value) or (
        callable(value) and inspect.iscoroutinefunction(type(value).__call__)
    )


def async_callable(value: object, what: str, takes: str) -> None:
    """`TypeError` naming `what` unless `value` is `is_async_callable` (what is awaited
    must be: a plain def would fail only when first awaited, far from its cause)."""
    if not is_async_callable(value):
        raise TypeError(
            f"{what} must be an async function (or an object with an async __call__)"
            f" taking {takes}; got {value!r:.200}"
        )


def make_owner_id(name: str | None) -> str:
    """name + host + pid + a random nonce: unique per runtime instance, never reused.

    The nonce is 48 random bits: runtimes of one process opened in the same millisecond get
    their own ids (a new id's first digits are its millisecond, not random)."""
    nonce = f"{_backend.RANDOM_BITS.getrandbits(48):012x}"
    base = f"{socket.gethostname()}:{os.getpid()}:{nonce}"
    return base if name is None else f"{name}@{base}"


# Durations are whole milliseconds added to epoch times in 64-bit integers: none is longer
# than this (about 31 years), so no sum overflows and a typo's 1e16 is refused, not stored.
MAX_SECONDS = 1e9


def duration(value: object, what: str, *, minimum: float = 0.0) -> float:
    """A number of seconds from `minimum` to `MAX_SECONDS`."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{what} must be a number of seconds, got {type(value).__name__}")
    if not math.isfinite(value) or not minimum <= value <= MAX_SECONDS:
        raise ValueError(f"{what} must be {minimum:g} to {MAX_SECONDS:g} seconds, got {value!r}")
    return float(value)


def seconds(value: object, what: str) -> float:
    # Durable times are whole milliseconds: anything shorter would round to nothing.
    return duration(value, what, minimum=0.001)


# The shortest lease: its default heartbeat, a third of it, is the shortest
# `heartbeat_interval` (1 ms, the store's unit of time). A shorter one (a typo's 0.001) was
# accepted and every drain stopped as lease_lost at once. DESIGN §5 refuses `lease <= 0`
# only, so nothing a heartbeat can renew is refused: a lease of 0.1 s is a test's under a
# virtual clock, and on a loaded host the caller's to choose.
MIN_LEASE = 0.003


def lease(value: object) -> float:
    """A lease in seconds, from `MIN_LEASE` to `MAX_SECONDS`."""
    try:
        return duration(value, "lease", minimum=MIN_LEASE)
    except ValueError as exc:
        if isinstance(value, int | float) and 0 < value < MIN_LEASE:
            raise ValueError(
                f"{exc}: its default heartbeat, a third of it, would be under the 1 ms a"
                " heartbeat_interval may be, so every drain would stop as lease_lost"
            ) from None
        raise


def flag(value: object, what: str) -> bool:
    """A bool, and nothing that merely tests true (the string "no" would)."""
    if not isinstance(value, bool):
        raise TypeError(f"{what} must be a bool, got {type(value).__name__}: {value!r:.80}")
    return value


def check_flag(_instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    """`flag` as an attrs validator, naming the attribute (a store's `inline`, `listen`)."""
    flag(value, attribute.name)


# Counts and seqs are stored and compared as signed 64-bit integers on both backends.
MAX_INT64 = 2**63 - 1


def count(value: object, what: str, minimum: int) -> int:
    """An int from `minimum` to `MAX_INT64`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int, got {type(value).__name__}")
    if not minimum <= value <= MAX_INT64:
        raise ValueError(f"{what} must be {minimum} to {MAX_INT64}, got {value}")
    return value


def clock(value: object) -> Callable[[], float]:
    """A runtime clock: a zero-argument callable returning epoch seconds, read once here, so
    that one giving no usable time (`_backend.epoch_seconds`) is refused before anything is
    opened; a later bad reading fails its transaction, naming the clock, as `now_ms` finds it.
    """
    if not callable(value):
        raise TypeError(
            f"clock must be a zero-argument callable returning epoch seconds, got {value!r:.80}"
        )
    try:
        reading = value()
    except Exception as exc:  # whatever the caller's callable raises, it is no clock
        raise TypeError(
            "clock must be a zero-argument callable returning epoch seconds; reading"
            f" {value!r:.80} raised {exc!r:.200}"
        ) from exc
    _backend.epoch_seconds(reading, "the runtime's clock reading")
    return value


def epoch(value: object) -> float:
    """A test clock's epoch: epoch seconds, as a clock's reading (`_backend.epoch_seconds`)."""
    return _backend.epoch_seconds(value, "epoch")


def delay_ms(delay: object) -> int:
    """A scheduled input's delay in whole milliseconds, rounded up (never due early)."""
    if delay is None:
        return 0
    return math.ceil(duration(delay, "delay") * 1000)


async def checked_json(check: Callable[..., str], value: Any, what: str, **options: Any) -> str:
    """A `_codec` JSON check of a caller's value, in a worker thread when the value is large
    (§6.26: checking and encoding a 1 MiB value, or refusing a 50 MB one, must not stall the
    event loop). The thread is not abandoned on cancellation: it ends with the check."""
    return await _off_the_loop_if_large(value, functools.partial(check, value, what, **options))


async def owned_json(check: Callable[..., str], value: Any, what: str, **options: Any) -> Any:
    """`checked_json`, returning the value decoded from its checked encoding: an equal value
    of the library's own, which nothing the caller does to `value` afterwards changes."""

    def checked_copy() -> Any:
        return _codec.loads(check(value, what, **options))

    return await _off_the_loop_if_large(value, checked_copy)


async def _off_the_loop_if_large(value: Any, work: Callable[[], T]) -> T:
    if _codec.is_small(value):
        return work()
    return await trio.to_thread.run_sync(work)
