"""Edit and regenerate in one transaction: `submit(..., truncate_after=n)`, on both backends.

A chat product's edit deletes the messages after the edited one and stores the edited text as
a new input. Done as two calls (`truncate`, then `submit`), a submit refused after the
truncate (its input id names another input: `InputConflict`) or a process dying between them
leaves the transcript cut with nothing stored. Here both happen in one transaction, and
everything that refuses the edit is checked before anything is deleted. Deterministic: inline
store, autojump virtual clock, gates.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import trio
from helpers import Raw, runtime
from trio.testing import MockClock

from trio_sessions import (
    DrainContext,
    InputConflict,
    MalformedRecord,
    SessionBusy,
    StoreError,
)

Clock = Callable[[], float]
QUIET = {"recovery_interval": 3600}


class Answer:
    """A drain that answers each input it takes with "re: <text>"; while `hold` is set, it
    waits on `gate` after its answer began (a claim held)."""

    def __init__(self) -> None:
        self.hold = False
        self.entered, self.gate = trio.Event(), trio.Event()

    async def __call__(self, ctx: DrainContext) -> None:
        for item in await ctx.take_inputs():
            writer = await ctx.begin_assistant()
            await writer.append_text(f"re: {item.payload['text']}")
            if self.hold:
                self.entered.set()
                await self.gate.wait()
            await writer.finish()


def texts(messages: list[Any]) -> list[tuple[int, str, str]]:
    """(seq, role, text) of each message: a user message's payload text, an assistant's
    text parts."""
    shown = []
    for message in messages:
        if message.role == "user":
            text = message.data["text"]
        else:
            text = "".join(part.text for part in message.data.parts)
        shown.append((message.seq, message.role, text))
    return shown


async def two_turns(rt: Any) -> None:
    for question in ("one", "two"):
        await rt.submit("s", {"text": question})
        await rt.wait_idle("s")


async def test_an_edit_deletes_what_follows_and_is_answered(
    store: Any, clock: Clock, autojump_clock: MockClock
) -> None:
    """The messages after `truncate_after` go and the edited text is the next input, taken
    and answered as any; the call returns its input id."""
    async with runtime(store, Answer(), clock, **QUIET) as rt:
        await two_turns(rt)
        stored = await rt.submit("s", {"text": "two, edited"}, input_id="e1", truncate_after=2)
        await rt.wait_idle("s")
        messages = await rt.transcript("s")
    assert stored == "e1"
    assert texts(messages) == [
        (1, "user", "one"),
        (2, "assistant", "re: one"),
        (3, "user", "two, edited"),
        (4, "assistant", "re: two, edited"),
    ]


async def test_a_retry_of_an_edit_deletes_nothing(
    store: Any, clock: Clock, autojump_clock: MockClock
) -> None:
    """Idempotent by input id, as `submit`: a retry (the same id and payload: a client that
    lost the reply) returns the id and deletes nothing - also once the edit was answered,
    whatever `truncate_after` it names."""
    async with runtime(store, Answer(), clock, **QUIET) as rt:
        await two_turns(rt)
        await rt.submit("s", {"text": "two, edited"}, input_id="e1", truncate_after=2)
        await rt.wait_idle("s")
        answered = await rt.transcript("s")
        for after in (2, 0):
            again = await rt.submit(
                "s", {"text": "two, edited"}, input_id="e1", truncate_after=after
            )
            assert again == "e1"
        await rt.wait_idle("s")
        assert await rt.transcript("s") == answered


@pytest.mark.parametrize("names", ["a pending input", "another session's input"])
async def test_an_edit_whose_input_id_names_another_input_deletes_nothing(
    store: Any, clock: Clock, autojump_clock: MockClock, names: str
) -> None:
    """`InputConflict` before anything is deleted, when the id names a pending input of the
    session with another payload (a client numbering its keys again after a reload) or an
    input of another session; the input it names stays as it was."""
    async with runtime(store, Answer(), clock, **QUIET) as rt:
        await two_turns(rt)
    async with runtime(store, None, clock, **QUIET) as web:  # no drain: inputs stay pending
        session = "s" if names == "a pending input" else "other"
        await web.submit(session, {"text": "three"}, input_id="k7")
        before = await web.transcript("s")
        with pytest.raises(InputConflict):
            await web.submit("s", {"text": "edited"}, input_id="k7", truncate_after=0)
        assert await web.transcript("s") == before
        assert await web.cancel_input("k7")  # still pending, as it was


async def test_an_edit_while_a_claim_is_held_writes_nothing(
    store: Any, clock: Clock, db_path: Any, autojump_clock: MockClock
) -> None:
    """`SessionBusy` while a drain holds the session (stop it first), as `truncate`: nothing
    deleted, nothing stored."""
    drain = Answer()
    raw = Raw(db_path)
    async with runtime(store, drain, clock, **QUIET) as rt:
        await two_turns(rt)
        drain.hold = True
        await rt.submit("s", {"text": "three"})
        await drain.entered.wait()
        before = await rt.transcript("s")
        with pytest.raises(SessionBusy):
            await rt.submit("s", {"text": "edited"}, input_id="e1", truncate_after=2)
        assert await rt.transcript("s") == before
        assert raw.rows("SELECT id FROM session_input WHERE id = 'e1'") == []
        drain.gate.set()
        await rt.wait_idle("s")


@pytest.mark.parametrize("on_busy", ["queue", "reject"])
async def test_an_edit_while_inputs_wait_untaken_writes_nothing(
    store: Any, clock: Clock, db_path: Any, autojump_clock: MockClock, on_busy: str
) -> None:
    """`SessionBusy`, whatever `on_busy`, while due inputs wait untaken: they came after the
    edited message, and stored after them the edit would be answered after them - the
    conversation reordered. Nothing deleted, nothing stored; once they are withdrawn the
    edit goes through. Found by the review: with "queue" the edit was stored behind them."""
    raw = Raw(db_path)
    async with runtime(store, Answer(), clock, **QUIET) as rt:
        await two_turns(rt)
    async with runtime(store, None, clock, **QUIET) as web:
        await web.submit("s", {"text": "three"}, input_id="k3")
        with pytest.raises(SessionBusy):
            await web.submit(
                "s", {"text": "edited"}, input_id="e1", truncate_after=2, on_busy=on_busy
            )
        assert len(await web.transcript("s")) == 4
        assert raw.rows("SELECT id FROM session_input ORDER BY seq") == [("k3",)]
        assert await web.cancel_input("k3")
        await web.submit("s", {"text": "edited"}, input_id="e1", truncate_after=2, on_busy=on_busy)
        assert len(await web.transcript("s")) == 2
        assert raw.rows("SELECT id FROM session_input ORDER BY seq") == [("e1",)]


async def test_an_edit_beside_a_scheduled_input_goes_through(
    store: Any, clock: Clock, db_path: Any, autojump_clock: MockClock
) -> None:
    """A scheduled input not yet due leaves the session idle (§5.1): the edit goes through,
    and the scheduled one waits for its time."""
    raw = Raw(db_path)
    async with runtime(store, Answer(), clock, **QUIET) as rt:
        await two_turns(rt)
    async with runtime(store, None, clock, **QUIET) as web:
        await web.submit("s", {"text": "later"}, input_id="k9", delay=3600)
        await web.submit("s", {"text": "edited"}, input_id="e1", truncate_after=2)
        assert len(await web.transcript("s")) == 2
        assert raw.rows("SELECT id FROM session_input ORDER BY seq") == [("k9",), ("e1",)]


async def test_an_edit_whose_input_cannot_be_stored_deletes_nothing(
    store: Any, clock: Clock, db_path: Any, autojump_clock: MockClock
) -> None:
    """All or nothing: when storing the input fails after the truncate ran (here: another
    tool left the session no input seq - PostgreSQL refuses the count, SQLite's check
    does), the truncate is rolled back with it."""
    raw = Raw(db_path)
    async with runtime(store, Answer(), clock, **QUIET) as rt:
        await two_turns(rt)
        before = await rt.transcript("s")
        raw.write("UPDATE session SET input_seq = ? WHERE id = 's'", (2**63 - 1,))
        with pytest.raises((StoreError, MalformedRecord)):
            await rt.submit("s", {"text": "edited"}, input_id="e1", truncate_after=0)
        assert await rt.transcript("s") == before
    assert raw.rows("SELECT id FROM session_input WHERE id = 'e1'") == []


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"truncate_after": -1}, ValueError),
        ({"truncate_after": 2**63}, ValueError),
        ({"truncate_after": 1.0}, TypeError),
        ({"truncate_after": True}, TypeError),
        ({"truncate_after": 0, "delay": 5}, ValueError),
        ({"truncate_after": 0, "on_busy": "interrupt"}, ValueError),
    ],
)
async def test_an_edit_with_bad_arguments_writes_nothing(
    store: Any,
    clock: Clock,
    db_path: Any,
    autojump_clock: MockClock,
    options: dict[str, Any],
    error: type[Exception],
) -> None:
    """Refused before anything is written: a `truncate_after` that is no seq (negative, past
    64 bits, no int), or an edit that cannot be one - scheduled for later (it would delete
    now what a later input answers) or interrupting (an edit needs the session idle)."""
    raw = Raw(db_path)
    async with runtime(store, Answer(), clock, **QUIET) as rt:
        await two_turns(rt)
        with pytest.raises(error, match="truncate_after"):
            await rt.submit("s", {"text": "edited"}, input_id="e1", **options)
        assert len(await rt.transcript("s")) == 4
    assert raw.rows("SELECT id FROM session_input WHERE id = 'e1'") == []
