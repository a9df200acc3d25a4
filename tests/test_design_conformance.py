"""DESIGN.md §5's public names checked from the outside, as an independent checker reads them:
the exact signatures (parameter names, which are keyword-only, defaults), the fields of the
public records and the error hierarchy. Other tests call these names; none pinned their
shape: `fork`'s `through_seq` made positional (no longer keyword-only) passed every test."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import attrs
import pytest

import trio_sessions
from trio_sessions import Runtime

EMPTY = inspect.Parameter.empty
POSITIONAL = inspect.Parameter.POSITIONAL_OR_KEYWORD
KEYWORD = inspect.Parameter.KEYWORD_ONLY


def shape(function: Callable[..., Any]) -> list[tuple[str, Any, Any]]:
    """(name, kind, default) of each parameter but `self`."""
    return [
        (name, parameter.kind, parameter.default)
        for name, parameter in inspect.signature(function).parameters.items()
        if name != "self"
    ]


def test_open_runtime_has_designs_parameters_and_defaults() -> None:
    """§5: `open_runtime(store, drain, *, owner_id=None, lease=30.0, heartbeat_interval=None,
    recovery_interval=5.0, recovery_batch=100, max_resumes=10, max_active=None, clock=None,
    acquisition_hook=None, shutdown_grace=None, takeover_grace=0.5)`."""
    assert shape(trio_sessions.open_runtime) == [
        ("store", POSITIONAL, EMPTY),
        ("drain", POSITIONAL, EMPTY),
        ("owner_id", KEYWORD, None),
        ("lease", KEYWORD, 30.0),
        ("heartbeat_interval", KEYWORD, None),
        ("recovery_interval", KEYWORD, 5.0),
        ("recovery_batch", KEYWORD, 100),
        ("max_resumes", KEYWORD, 10),
        ("max_active", KEYWORD, None),
        ("clock", KEYWORD, None),
        ("acquisition_hook", KEYWORD, None),
        ("shutdown_grace", KEYWORD, None),
        ("takeover_grace", KEYWORD, 0.5),
    ]


# Each verb of §5 and §5.1 as DESIGN writes it: its positional parameters, then its
# keyword-only ones with their defaults (EMPTY: required).
VERBS: dict[str, list[tuple[str, Any, Any]]] = {
    "submit": [
        ("session_id", POSITIONAL, EMPTY),
        ("payload", POSITIONAL, EMPTY),
        ("input_id", KEYWORD, None),
        ("on_busy", KEYWORD, "queue"),
        ("delay", KEYWORD, None),
        # Stop 52's extension (edit and regenerate in one transaction): keyword-only, and
        # off by default, so every call DESIGN describes means what it did.
        ("truncate_after", KEYWORD, None),
    ],
    "wake": [("session_id", POSITIONAL, EMPTY)],
    "interrupt": [("session_id", POSITIONAL, EMPTY), ("reason", KEYWORD, "user")],
    "run": [("session_id", POSITIONAL, EMPTY)],
    "wait_idle": [("session_id", POSITIONAL, EMPTY)],
    "is_active": [("session_id", POSITIONAL, EMPTY)],
    "active_sessions": [],
    "recover_once": [],
    "transcript": [("session_id", POSITIONAL, EMPTY)],
    "release_quarantine": [("execution_id", POSITIONAL, EMPTY), ("resume", KEYWORD, EMPTY)],
    "watch": [("session_id", POSITIONAL, EMPTY), ("after_seq", KEYWORD, 0)],
    "statistics": [],
    "cancel_input": [("input_id", POSITIONAL, EMPTY)],
    "pause": [("session_id", POSITIONAL, EMPTY)],
    "resume": [("session_id", POSITIONAL, EMPTY)],
    "delete_session": [("session_id", POSITIONAL, EMPTY)],
    "purge": [("idle_for", KEYWORD, EMPTY)],
    "fork": [
        ("session_id", POSITIONAL, EMPTY),
        ("new_session_id", POSITIONAL, EMPTY),
        ("through_seq", KEYWORD, None),
    ],
    "truncate": [("session_id", POSITIONAL, EMPTY), ("after_seq", KEYWORD, EMPTY)],
    "stream": [("session_id", POSITIONAL, EMPTY), ("cursor", KEYWORD, None)],
}


@pytest.mark.parametrize("verb", sorted(VERBS))
def test_each_runtime_verb_has_designs_parameters(verb: str) -> None:
    """§5/§5.1: each `Runtime` verb takes DESIGN's parameter names, keyword-only where
    DESIGN writes them after `*`, with DESIGN's defaults."""
    assert shape(getattr(Runtime, verb)) == VERBS[verb]


def test_the_async_verbs_are_coroutines_and_the_others_are_not() -> None:
    """What §5 writes with `await` is a coroutine function; `is_active`, `active_sessions`
    and `statistics` are plain calls; `watch` and `stream` are `async with` blocks."""
    plain = {"is_active", "active_sessions", "statistics"}
    blocks = {"watch", "stream"}
    for verb in VERBS:
        function = getattr(Runtime, verb)
        assert inspect.iscoroutinefunction(function) is (verb not in plain | blocks), verb
    assert isinstance(inspect.getattr_static(Runtime, "owner_id"), property)


def test_drain_context_and_writer_have_designs_methods() -> None:
    """§5: `DrainContext.take_inputs()`, `begin_assistant()`, `transcript()`; the writer's
    `append_text(text)`, `start_tool(call_id, name, input)`, `settle_tool(call_id,
    output)`, `fail_tool(call_id, error)`, `finish()` - each awaited."""
    writer = {
        "append_text": ["text"],
        "start_tool": ["call_id", "name", "input"],
        "settle_tool": ["call_id", "output"],
        "fail_tool": ["call_id", "error"],
        "finish": [],
    }
    for method, names in writer.items():
        function = getattr(trio_sessions.AssistantWriter, method)
        assert inspect.iscoroutinefunction(function), method
        assert [name for name, kind, _ in shape(function) if kind is POSITIONAL] == names
    for method in ("take_inputs", "begin_assistant", "transcript"):
        function = getattr(trio_sessions.DrainContext, method)
        assert inspect.iscoroutinefunction(function), method
        assert [name for name, kind, _ in shape(function) if kind is POSITIONAL] == []


def field_names(cls: type) -> list[str]:
    return [field.name for field in attrs.fields(cls)]


def test_the_public_records_have_designs_fields_and_are_frozen() -> None:
    """§4/§5/§5.2: `Claim(session_id, execution_id, owner_id, resumed)`, `Outcome(kind,
    reason, error)`, `StreamEvent(cursor, seq, role, kind, data)`, `RecoveryReport`'s nine
    counts (a later count may follow them), `Input.id`/`.payload`, `Message.role`/`.data`
    and `.seq` - frozen attrs classes, as trio's statistics are."""
    assert field_names(trio_sessions.Claim) == ["session_id", "execution_id", "owner_id", "resumed"]
    assert field_names(trio_sessions.Outcome) == ["kind", "reason", "error"]
    assert field_names(trio_sessions.StreamEvent) == ["cursor", "seq", "role", "kind", "data"]
    counts = [
        "examined",
        "resumed",
        "finished_cancelled",
        "dropped_superseded",
        "quarantined",
        "exhausted",
        "skipped_live",
        "fence_lost",
        "doorbells_started",
    ]
    assert field_names(trio_sessions.RecoveryReport)[: len(counts)] == counts
    assert all(value == 0 for value in attrs.astuple(trio_sessions.RecoveryReport()))
    assert {"id", "payload"} <= set(field_names(trio_sessions.Input))
    assert {"seq", "role", "data"} <= set(field_names(trio_sessions.Message))
    records: list[type[Any]] = [
        trio_sessions.Claim,
        trio_sessions.Outcome,
        trio_sessions.StreamEvent,
        trio_sessions.RecoveryReport,
        trio_sessions.RuntimeStatistics,
        trio_sessions.Input,
        trio_sessions.Message,
    ]
    for record in records:
        instance = record(*[None] * len(attrs.fields(record)))
        with pytest.raises(attrs.exceptions.FrozenInstanceError):
            setattr(instance, attrs.fields(record)[0].name, 1)


def test_every_error_of_design_is_a_trio_sessions_error() -> None:
    """§5: root `TrioSessionsError`; `LeaseLost`, `DuplicateSettlement`, `MalformedRecord`
    (carrying table, key and reasons; no ExceptionGroup), `StoreError`, `InputConflict`,
    `SessionBusy` under it, as `Exception`s."""
    root = trio_sessions.TrioSessionsError
    assert issubclass(root, Exception)
    for name in (
        "LeaseLost",
        "DuplicateSettlement",
        "MalformedRecord",
        "StoreError",
        "InputConflict",
        "SessionBusy",
    ):
        assert issubclass(getattr(trio_sessions, name), root), name
    malformed = trio_sessions.MalformedRecord("session_message", "m-1", ["a reason"])
    assert (malformed.table, malformed.key, tuple(malformed.reasons)) == (
        "session_message",
        "m-1",
        ("a reason",),
    )
    assert not isinstance(malformed, BaseExceptionGroup)
