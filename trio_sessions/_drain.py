"""What a drain sees: `DrainContext` (one iteration's view of its claim) and `AssistantWriter`.

Every write here is fenced on the live claim, carries the session id the context holds, and
raises `LeaseLost` (writing nothing) once the lease is gone or the iteration's drain returned.
Local watchers and streams get each change from the writer itself, with no store round trip
(watchers get the user messages `take_inputs` appended from it too, before any reply);
a defect of the drain's own making (a tool call settled twice, an unknown call id) fails the
drain even if the drain catches it. No SQL: the writes are `_store` operations run by the
runtime's executor.
"""

from __future__ import annotations

import contextvars
import functools
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal

import attrs
import outcome
import trio

from . import _codec, _store, _transcript, _validate
from ._errors import (
    DuplicateSettlement,
    LeaseLost,
    OutcomeUnknown,
    StaleContext,
    UnknownToolCall,
)
from ._model import AssistantData, Input, Message, TextPart, ToolPart
from ._stream import Offer

if TYPE_CHECKING:
    from ._coordinator import SessionEntry
    from ._verbs import Runtime

Drain = Callable[["DrainContext"], Awaitable[None]]

# The most inputs one `take_inputs()` takes by default (one short transaction and one short
# step of the event loop, whatever the backlog).
TAKE_INPUTS_CHUNK = _store.TAKE_INPUTS_CHUNK


# The (runtime, session id) whose drain the current task runs - also in tasks the drain
# started - so that waiting on that very session fails at once instead of deadlocking.
# Set around each drain call by the busy period's drain loop.
current_drain: contextvars.ContextVar[tuple[Runtime, str] | None] = contextvars.ContextVar(
    "trio_sessions_draining", default=None
)


def refuse_waiting_for_own_drain(runtime: Runtime, session_id: str, what: str) -> None:
    draining = current_drain.get()
    if draining is not None and draining[0] is runtime and draining[1] == session_id:
        raise RuntimeError(
            f"{what}() called from the drain of its own session {session_id!r}: it would wait"
            " for itself (the drain's return ends the execution it waits for)"
        )


class DrainContext:
    """One drain iteration's view of its claim. Every write is fenced on the live claim and
    raises `LeaseLost` (writing nothing) once the lease is gone - and so does every call
    once this iteration's drain returned, even during the claim's next iteration.

    Attributes:
        session_id: the session being drained.
        execution_id: this claim's id (`session_execution.id`); messages written here carry
            it. A takeover by recovery gets a new one.
        owner_id: the runtime that holds the claim (`Runtime.owner_id`).
        attempt: `session.wake_attempts` - automatic resumes after crashes since the session
            last finished normally (0 on a fresh claim; a graceful hand-back does not count).
        resumed: `True` when recovery took this claim over from a dead or stopped owner; its
            inputs were taken by that owner, so find what is owed in `transcript()`.

    Writes are durable when they return and cancellation behaves as for `Runtime`'s calls
    (queued: nothing written; started: completes, cancellation at the next checkpoint). An
    interrupt, a lost lease or the runtime closing reaches the drain as `trio.Cancelled`:
    let it propagate - the runtime finishes the open messages (nothing at all for a lost
    lease).
    """

    def __init__(self, runtime: Runtime, entry: SessionEntry) -> None:
        self._runtime = runtime
        self.session_id = entry.session_id
        self.execution_id = entry.execution_id
        self.owner_id = runtime.owner_id
        self.attempt = entry.attempt
        self.resumed = entry.resumed
        self._defect: BaseException | None = None
        self._returned = False
        self._entry = entry
        # The message of a `begin_assistant` whose outcome is unknown, read back next.
        self._lost_message: str | None = None
        # The writers of this iteration's messages not yet finished by their writer: each
        # lets go of what it holds when the drain returns (`_let_go`).
        self._open_writers: dict[str, AssistantWriter] = {}

    @property
    def _claim(self) -> tuple[str, str, str]:
        """The claim every write of this context names."""
        return (self.session_id, self.execution_id, self.owner_id)

    def _let_go(self) -> None:
        """The drain returned: its writers let go of the messages they hold."""
        for writer in self._open_writers.values():
            writer._let_go()
        self._open_writers.clear()

    def _check_live(self) -> None:
        self._runtime._check_run()
        if self._returned:
            raise StaleContext(
                f"this DrainContext of execution {self.execution_id!r} is stale: its drain"
                " already returned"
            )
        if self._entry.self_fenced():
            # Known lost here first (the liveness token, a heartbeat, or its local deadline
            # passed - a write in a shielded cleanup): the store may still hold the lease
            # for a moment, but nothing more is written for this claim.
            raise LeaseLost(f"execution {self.execution_id!r} lost its claim")

    async def take_inputs(self, *, limit: int | None = None) -> list[Input]:
        """Consume the oldest pending inputs in seq order, at most `limit` of them
        (default `TAKE_INPUTS_CHUNK`); each becomes a user message, atomically.

        Durable when it returns: in one fenced transaction the inputs left `session_input`
        and were appended as `role='user'` messages. Only inputs that are due: a scheduled
        one (`submit(delay=)`) stays unseen until its time. A bounded chunk keeps each call
        one short transaction and one short step of the event loop, whatever the backlog:
        to drain everything, call again until it returns `[]`; a drain that returns instead
        gets the rest in its busy period's next iteration (the doorbell stays set while due
        inputs are pending). None once this claim was asked to stop (another process's
        interrupt on its way): a successor takes them. An input whose payload does not
        decode is set aside for the operator, never returned and never blocking the others.
        Raises `TypeError`/`ValueError` for a bad `limit`, `LeaseLost` (nothing taken) when
        the claim is gone or this context is stale, `StoreError`. A `StoreError` whose
        outcome is unknown (PostgreSQL: the COMMIT's reply lost and not read back) may have
        taken inputs: the next calls return those, if it did (each input once, at most
        `limit` per call; a drain that returns first is called once more for them).
        Cancellation: nothing taken if the transaction had not started, else the inputs
        are taken (they are user messages now, found again by `transcript()`).
        """
        limit = TAKE_INPUTS_CHUNK if limit is None else _validate.count(limit, "limit", 1)
        self._check_live()
        claim, takes = self._claim, self._entry.takes
        self._lost_message = None  # its read-back is for the very next call only
        taken: Sequence[Input] = []
        sent_at = takes.start()
        try:
            if (offset := takes.unsure_from) is not None:
                # A call's outcome is unknown: what it took, if it landed, is this drain's
                # to see (user messages now, no longer inputs), once.
                mine = await self._runtime._db.run(_store.inputs_taken_by, *claim, offset)
                taken = [
                    Input(key, _codec.decode_object(data, table="session_message", key=key))
                    for key, data in takes.untold(offset, mine, limit)
                ]
            if not taken:
                try:
                    taken = await self._runtime._db.run(_store.take_inputs, *claim, limit)
                except _store.FastTakeRefused:
                    # Rolled back: the library's own path sets the refused input aside.
                    taken = await self._runtime._db.run(_store.take_inputs, *claim, limit, False)
        except OutcomeUnknown:
            takes.unsure(sent_at)
            self._look_if_watched()
            raise
        finally:
            takes.running -= 1
        taken = takes.gave(taken)
        self._runtime._streams.touch(self.session_id)  # new user messages: streams read them
        self._publish_taken(taken)
        return [Input(item.id, item.payload) for item in taken]

    def _publish_taken(self, taken: Sequence[Input]) -> None:
        """Local watchers get the new user messages now, before any reply to them (DESIGN
        §5: as created). Those a read-back found (a lost call's, known by input only) a
        look offers."""
        runtime = self._runtime
        if not taken or not runtime._watchers.watching(self.session_id):
            return
        for item in taken:
            if not isinstance(item, _store.Taken):
                self._look_if_watched()
                continue
            # Decoded again: the drain owns the payload it was given, and may change it.
            data = _codec.decode_object(item.text, table="session_message", key=item.message_id)
            message = Message(
                item.message_id, self.session_id, "user", item.seq, data, self.execution_id, item.id
            )
            # Version 0: a user message's as inserted, never changed (a look that finds it
            # offers nothing more).
            snapshot = _store.Snapshot(
                self.session_id, item.message_id, item.seq, message, 0, None, False
            )
            runtime._watchers.publish(snapshot)

    def _look_if_watched(self) -> None:
        """A write of this claim may have changed the session unoffered (its outcome is
        unknown, or a read-back found it): local watchers get it from a look, now - the
        runtime's own commits' signals are no look."""
        self._runtime._loops.look_for_watchers(self.session_id)

    async def transcript(self) -> list[Message]:
        """The session's messages in seq order (`MalformedRecord` for a row that does not
        decode): a resumed drain finds here the user message it still owes an answer to.

        Reads one consistent snapshot and writes nothing. Raises `LeaseLost` when this
        context is stale, `StoreError`. Cancellation drops the read.
        """
        self._check_live()
        return await self._runtime._db.read(_store.read_transcript, self.session_id)

    async def begin_assistant(self) -> AssistantWriter:
        """Start an assistant message (unfinished, no parts) and return its writer.

        Durable when it returns (one fenced transaction); local watchers see it at once.
        Raises `LeaseLost`, `StoreError`; after a `StoreError` whose outcome is unknown,
        the very next call of this context, if it is this one, returns the writer of the
        message that call began, if it did. A message left open when the drain ends is
        finished by the runtime, its running tools failed the same way: with the drain's
        error when it raised, else `interrupted` - a drain that returned, an interrupt, the
        runtime closing (recovery's after a lost lease: "interrupted: owner lost").
        """
        self._check_live()
        claim = self._claim
        lost, self._lost_message = self._lost_message, None  # one task reads it back
        if lost is not None:
            # The last call's outcome is unknown: if it landed, its message is this one.
            try:
                stored = await self._runtime._db.run(_store.message_as_stored, *claim, lost)
            except BaseException:
                self._lost_message = self._lost_message or lost  # still to read back
                raise
            if stored is not None:
                data, version, seq = stored
                return AssistantWriter(self, lost, seq, data=data, version=version)
        message_id = _store.new_id()
        try:
            with self._runtime._streams.writing(self.session_id):
                seq = await self._runtime._db.run(_store.begin_assistant, *claim, message_id)
        except OutcomeUnknown:
            self._lost_message = message_id
            self._look_if_watched()
            raise
        return AssistantWriter(self, message_id, seq)


# A new message's stored encoding: the first `Known` of a writer that began it.
_EMPTY_TEXT = _codec.encode_assistant(_transcript.EMPTY)


class AssistantWriter:
    """Writes one assistant message; each call is one fenced transaction.

    Every method is durable when it returns (an acknowledged append survives a crash) and
    reaches local watchers without a store round trip. Each raises `TypeError`/`ValueError`
    for a bad argument before writing, `MessageFinished` once the message is finished,
    `LeaseLost` (nothing written) once the claim is gone or the drain returned, and
    `StoreError`. Cancellation: nothing written if the transaction had not started, else
    the change is stored and the cancellation arrives at the next checkpoint.

    A second settlement of a tool call raises `DuplicateSettlement` (an unknown call id,
    `UnknownToolCall`): a defect that fails the drain even if the drain catches it.

    A write may end in a `StoreError` whose outcome is unknown (PostgreSQL: the COMMIT's
    reply lost and not read back). The writer's next call reads the message back first:
    the same call again lands once (a no-op if the lost one landed), and any other call
    applies to the message as stored.
    """

    def __init__(
        self,
        context: DrainContext,
        message_id: str,
        seq: int,
        *,
        data: AssistantData = _transcript.EMPTY,
        version: int = 0,
    ) -> None:
        """The writer of a message as stored (`data` at `version`); local watchers and
        streams get it at once."""
        self._context = context
        self.message_id = message_id
        self._seq = seq
        # The message as stored: `_data` (its encoding `_text`, when known: `_store.Known`)
        # plus the texts streamed onto it since, merged into `_view` only when a local
        # watcher needs a snapshot (an append costs the same on any message).
        self._data = self._view = _transcript.EMPTY
        self._adopt(data, _EMPTY_TEXT if data is _transcript.EMPTY else None)
        self._version = version  # as stored, so a retried append can tell whether it landed
        # Calls, as (method, arguments), whose outcome is unknown (read back by the next
        # call, of any task) - each with the message's text as this writer held it then,
        # for an append (`_shows`) - and those the read-back found landed: each of these,
        # called again, is a no-op once (an append only as the very next call: `_retried`).
        self._unsure: list[tuple[tuple[Any, ...], str | None]] = []
        self._landed: list[tuple[Any, ...]] = []
        # Whether `_data` is the message as stored at `_version` (PostgreSQL's tool calls
        # and finishes then write from it without reading); False after replies of tasks
        # writing at once arrived out of order.
        self._in_step = True
        self._publish(version)
        self._offer(version, "message", data)
        if context._returned:
            # Begun by a task the drain left running, as the drain returned: the context
            # let go of its writers then, and no write of this one follows. Registered, it
            # would stay in a cycle with the context that only the collector frees.
            self._let_go()
        else:
            context._open_writers[message_id] = self

    def _adopt(self, data: AssistantData, text: str | None) -> None:
        """Take `data` as the message as stored (`text`: its stored encoding, if known).
        The tool inputs and outputs of the message held before that `data` does not share
        (a message read whole, after replies out of order or a lost reply; `_let_go`'s
        placeholder) are freed in a worker thread when large (`_free_in_thread`): freeing
        three results of 300,000 JSON nodes, read again by tools settled in parallel tasks,
        was one step of 49 ms on the loop."""
        dropped = _unshared_payloads((self._data, self._view), (data,))
        self._data, self._text = data, text
        self._streamed: list[str] = []
        self._view, self._view_upto = data, 0  # `_data` with `_streamed[:_view_upto]`
        _free_if_large(dropped)

    def _unkept(self, data: AssistantData | None) -> list[Any]:
        """The tool inputs and outputs of `data`, a message a store call returned, that this
        writer does not hold: what dropping it frees (`_free_if_large` them once the
        caller's own references are gone)."""
        return [] if data is None else _unshared_payloads((data,), (self._data, self._view))

    async def append_text(self, text: str) -> None:
        """Stream text onto the message: one small durable write whatever the message's size;
        consecutive appends extend one text part (streamed tokens). `ValueError` for a text
        over 1 MiB in UTF-8 (`MAX_PAYLOAD_BYTES`; stream a long text in pieces) or holding a
        NUL character."""
        _codec.check_text(text, "text")
        context = self._context
        context._check_live()
        if (self._unsure or self._landed) and await self._landed_before(("append_text", text)):
            return
        data, version = await self._write(
            ("append_text", text), _store.append_assistant_text, text, self._version
        )
        if version != self._version + 1:
            # Another task's write came between (replies out of order): what this writer
            # holds may not be the message as stored; its next change reads it first.
            self._in_step = False
        if version < self._version:
            # Overtaken by a newer state, which local watchers already have.
            unkept = self._unkept(data)
            del data
            _free_if_large(unkept)
            return
        self._version = version
        if data is None:
            self._streamed.append(text)
            self._offer(version, "append", text)
        else:
            self._adopt(data, None)
            self._offer(version, "message", data)
        self._publish(version)

    async def start_tool(self, call_id: str, name: str, input: dict[str, Any]) -> None:
        """Record a tool call as `running`, before running it. `ValueError` if `call_id` was
        already started in this message, `input` is not a JSON object of at most 1 MiB
        (`MAX_PAYLOAD_BYTES`, encoded), or a NUL character is in `call_id`, `name` or
        `input`. If the owner dies before it settles, recovery fails it with "interrupted:
        owner lost": the call may or may not have happened. The message keeps a copy of
        `input` (and `settle_tool` of `output`): the caller may change its own afterwards."""
        call_id = _validate.tool_key(call_id, "call_id")
        name = _validate.tool_key(name, "name")
        input = await _validate.owned_json(_codec.check_json_object, input, "tool input")
        await self._update(
            ("start_tool", call_id, name, input),
            lambda data: _transcript.start_tool(data, call_id, name, input),
        )

    async def settle_tool(self, call_id: str, output: Any) -> None:
        """Record a running tool call as `completed` with its JSON `output`: at most 1 MiB
        encoded (`MAX_PAYLOAD_BYTES`) and no NUL character in it (`ValueError`); a
        `call_id` that no started call can have (as `start_tool` checks it) is a
        `TypeError`/`ValueError` like any bad argument, not an `UnknownToolCall`."""
        call_id = _validate.tool_key(call_id, "call_id")
        output = await _validate.owned_json(
            _codec.check_json, output, "tool output", limit=_codec.MAX_PAYLOAD_BYTES
        )
        await self._update(
            ("settle_tool", call_id, output),
            lambda data: _transcript.settle_tool(data, call_id, output=output),
        )

    async def fail_tool(self, call_id: str, error: str) -> None:
        """Record a running tool call as `error` with the reason `error`: at most 1 MiB in
        UTF-8 (`MAX_PAYLOAD_BYTES`) and no NUL character (`ValueError`); `call_id` is
        checked as `settle_tool` checks it."""
        call_id = _validate.tool_key(call_id, "call_id")
        _codec.check_text(error, "error")
        await self._update(
            ("fail_tool", call_id, error),
            lambda data: _transcript.settle_tool(data, call_id, error=error),
        )

    async def finish(self) -> None:
        """Finish the message normally; a tool call still running is failed, not left
        running forever. No further change is accepted."""
        await self._update(("finish",), _transcript.finish)
        self._context._open_writers.pop(self.message_id, None)
        self._let_go()

    async def _update(
        self, call: tuple[Any, ...], transition: Callable[[AssistantData], AssistantData]
    ) -> None:
        """Apply a transition; streams get its step (a part, a finish), or the message whole
        when it was more (a finish that failed running tools)."""
        context = self._context
        context._check_live()
        if (self._unsure or self._landed) and await self._landed_before(call):
            return
        try:
            data, version, step, text = await self._write(
                call,
                _store.update_assistant,
                transition,
                _store.Known(self._data, tuple(self._streamed), self._version, self._text)
                if self._in_step
                else None,
            )
        except (DuplicateSettlement, UnknownToolCall) as exc:
            context._defect = context._defect or exc
            raise
        if version < self._version:
            # Overtaken by a newer state (another task's reply, a read-back): that one may
            # not hold this change; the next change reads the message first.
            self._in_step = False
            unkept = self._unkept(data)
            del data, step
            _free_if_large(unkept)
            return
        # Read from the store when not in step, or one past what this writer held.
        self._in_step = True
        self._adopt(data, text)
        self._version = version
        if step is None:
            self._offer(version, "message", data)
        else:
            self._offer(version, *step)
        self._publish(version)

    def _let_go(self) -> None:
        """Stop holding the message's tool inputs and outputs once no further change is
        accepted (a later call reads the message from the store), and free them in a worker
        thread when large: Python frees a value node by node, and four tool results of
        300,000 JSON nodes took one step of 54-62 ms when the drain's last reference to
        this writer went. The text stays, for a lost append's read-back (`_landed_before`)."""
        data = self._data
        if _codec.is_small(_unshared_payloads((data, self._view), ()), _codec.LOOP_BUDGET_UNITS):
            return
        text = _transcript.text_of(data) + "".join(self._streamed)
        kept = attrs.evolve(data, parts=(TextPart(text),) if text else ())
        del data  # the worker thread must drop the last references, not this frame
        self._adopt(kept, None)
        self._in_step = False

    @property
    def _claim(self) -> tuple[str, str, str, str]:
        """The claim and message every write of this writer names."""
        return (*self._context._claim, self.message_id)

    async def _write(self, call: tuple[Any, ...], operation: Any, *args: Any) -> Any:
        """Run one write of `call`, remembering the call when its outcome is unknown (the
        next call reads it back)."""
        context = self._context
        try:
            with context._runtime._streams.writing(context.session_id):
                return await context._runtime._db.run(operation, *self._claim, *args)
        except OutcomeUnknown:
            text_before = None
            if call[0] == "append_text":
                text_before = _transcript.text_of(self._data) + "".join(self._streamed)
            self._unsure.append((call, text_before))
            context._look_if_watched()
            raise

    async def _landed_before(self, call: tuple[Any, ...]) -> bool:
        """After calls whose outcome is unknown: read the message back (DESIGN §8
        "Uncertain commits"), take it as stored, and note which of them landed. Whether
        `call` is one that landed (then it is done: a no-op, `_retried`). Callers skip it
        while no call is unsure or landed, so a plain write awaits nothing more."""
        if self._unsure:
            unsure = list(self._unsure)
            runtime = self._context._runtime
            stored = await runtime._db.run(_store.message_as_stored, *self._claim)
            self._unsure = [c for c in self._unsure if c not in unsure]
            if stored is not None:  # else it was never ours to write: the write says so
                data, version, _ = stored
                moved = version > self._version  # a lost call, or another task's write
                if moved:
                    self._adopt(data, None)
                    self._version = version
                    self._in_step = True  # as just read
                    self._offer(version, "message", data)
                    self._publish(version)
                self._landed += [
                    lost for lost, text_before in unsure if _shows(data, lost, moved, text_before)
                ]
                unkept = self._unkept(data)
                del stored, data
                _free_if_large(unkept)
        return self._retried(call)

    def _retried(self, call: tuple[Any, ...]) -> bool:
        """Whether `call` is the retry of a landed one (taken off: the next is a new call).
        A landed append stays only until another append goes on to write: text streams in
        order, from one task, so only the very next append can be its retry - the same
        text after another is a new token (" the", again), which must be stored. A tool
        call or a finish of another task in between changes nothing (a review found such
        a retry stored twice). A landed tool change or finish stays until called again:
        whenever it comes, a second one can only be its retry (else a defect: a tool
        settled or started twice, a message finished twice), and tools run in parallel
        tasks. What cannot be told apart: a drain that gives up on a lost append, calls a
        tool, then appends the same text as a new token - that append is taken for the
        retry."""
        if call in self._landed:
            self._landed.remove(call)
            return True
        if call[0] == "append_text":
            self._landed = [landed for landed in self._landed if landed[0] != "append_text"]
        return False

    def _offer(
        self, version: int, kind: Literal["message", "append", "part", "finish"], data: Any
    ) -> None:
        """Local streams get the change now, as the event it makes (no store round trip)."""
        context = self._context
        streams = context._runtime._streams
        if streams.watching(context.session_id):
            is_open = not (isinstance(data, AssistantData) and data.finished) and kind != "finish"
            offer = Offer(self.message_id, self._seq, version, kind, data, is_open)
            streams.offer(context.session_id, offer)

    def _publish(self, version: int) -> None:
        """Local watchers get the snapshot now, with no store round trip."""
        context = self._context
        if not context._runtime._watchers.watching(context.session_id):
            return
        if self._view_upto < len(self._streamed):
            # Only the texts streamed since the last snapshot are merged: a snapshot per
            # append costs the same on any message. `_data` stays as stored (`Known`).
            self._view = _transcript.with_streamed(self._view, self._streamed[self._view_upto :])
            self._view_upto = len(self._streamed)
        message = Message(
            self.message_id,
            context.session_id,
            "assistant",
            self._seq,
            self._view,
            context.execution_id,
            None,
        )
        context._runtime._watchers.publish(
            _store.Snapshot(
                context.session_id,
                self.message_id,
                self._seq,
                message,
                version,
                None,  # the row's version is not known here: a look reads it whole
                not self._view.finished,
            )
        )


def _shows(
    data: AssistantData, call: tuple[Any, ...], moved: bool, text_before: str | None
) -> bool:
    """Whether the stored message shows the writer's `call` landed. Each is told by its
    effect, which no other call of the message makes - whatever other tasks wrote
    meanwhile (tools settled in parallel): a tool call or a finish by its part, an append by
    the text (`text_before` it, or with it). Only appends from several tasks at once make
    a text that is neither; the version having moved then decides, as best it can."""
    kind, *args = call
    if kind == "append_text":
        stored, with_it = _transcript.text_of(data), f"{text_before}{args[0]}"
        if text_before is not None and stored in (text_before, with_it):
            return stored == with_it
        return moved
    if kind == "finish":
        return data.finished
    part = _transcript.tool_part(data, args[0])
    if part is None:
        return False
    if kind == "start_tool":
        return (part.name, part.input) == (args[1], args[2])
    if kind == "settle_tool":
        return part.status == "completed" and part.output == args[1]
    return part.status == "error" and part.error == args[1]  # fail_tool


def _unshared_payloads(
    dropped: Sequence[AssistantData], kept: Sequence[AssistantData]
) -> list[Any]:
    """The tool inputs and outputs (JSON containers) of the messages `dropped` that no
    message `kept` holds, each once: what dropping them frees."""
    held = {
        id(value)
        for data in kept
        for part in data.parts
        if isinstance(part, ToolPart)
        for value in (part.input, part.output)
    }
    unshared: dict[int, Any] = {}
    for data in dropped:
        for part in data.parts:
            if isinstance(part, ToolPart):
                for value in (part.input, part.output):
                    if isinstance(value, dict | list) and id(value) not in held:
                        unshared[id(value)] = value
    return list(unshared.values())


def _free_if_large(values: list[Any]) -> None:
    """Free `values` - the last references to them, the caller holding no other - in a
    worker thread when freeing them would cost the loop's step more than its budget
    (`_free_in_thread`); else here, with the list."""
    if values and not _codec.is_small(values, _codec.LOOP_BUDGET_UNITS):
        _free_in_thread(values)


def _free_in_thread(values: list[Any]) -> None:
    """Free `values` in a worker thread (`_take_apart`), which holds their last
    references: the caller holds none once it returns. Python frees a value node by node,
    and a message of four tool results of 300,000 nodes took one step of 54-62 ms on the
    loop. `start_thread_soon`, not `trio.to_thread`: nothing waits for it (called where no
    await can be: a finally, a writer's bookkeeping), and no thread limiter's slot is taken
    from the store's writes."""
    trio.lowlevel.start_thread_soon(functools.partial(_take_apart, values), _ignore)


# The most leaves and empty containers a freeing thread frees in one C call (`_take_apart`).
FREE_SLICE = 1024


def _take_apart(values: list[Any]) -> None:
    """A worker thread's: drop `values`, a slice at a time. CPython frees a value in C and
    holds the GIL throughout, so the event loop's thread, waiting for the GIL, stalls for
    as long as one free takes - a stall in wall-clock time that its CPU time (`StepMeter`)
    does not show: 60-65 ms for four results of 300,000 JSON nodes freed at once, and one
    such result alone 14-22 ms. A list or dict that no one else holds (`_count_of_last`
    reads what `_alone_count` found for one its list alone holds) is taken apart: its
    children are moved out `FREE_SLICE` at a time, those that hold more (a non-empty list
    or dict) to be taken apart in turn, the rest freed with their slice. Between slices the
    loop takes the GIL back at the interpreter's switch interval. A value another holder
    still sees (a watcher's snapshot, a stream's offer) is never changed: only this
    reference goes."""
    alone = _alone_count()
    stack = values
    while stack:
        if alone is None or type(stack[-1]) not in (list, dict) or _count_of_last(stack) > alone:
            del stack[-1]  # another holder's (or a leaf): only this reference goes
            continue
        item = stack.pop()
        if type(item) is dict:
            # Its keys and values moved into lists of ours: clearing it frees none of them.
            stack += [list(item), list(item.values())]
            item.clear()
            continue
        while item:
            piece = item[-FREE_SLICE:]
            del item[-FREE_SLICE:]
            stack += [child for child in piece if type(child) in (list, dict) and child]
            del piece  # frees the leaves and empty containers in it


def _count_of_last(stack: list[Any]) -> int:
    """`sys.getrefcount` of the last item of `stack`, passed as a subscript's result: a
    reference of its own on every CPython, where a local variable's may be borrowed and
    not counted (3.14's LOAD_FAST_BORROW: a list held once more would read as held once)."""
    return sys.getrefcount(stack[-1])


def _alone_count() -> int | None:
    """What `_count_of_last` reads for an item its list alone holds, measured here; None
    when one another holder sees too does not read exactly one more (an interpreter that
    counts otherwise): then nothing is taken apart, each value is only let go of."""
    elsewhere: list[Any] = []
    counts = {(_count_of_last([[]]), _count_of_last([elsewhere])) for _ in range(8)}
    if len(counts) != 1:
        return None
    [(alone, held)] = counts
    return alone if held == alone + 1 else None


def _ignore(result: outcome.Outcome[None]) -> None:
    """A freeing thread's end: nothing waits for it, and freeing cannot fail."""
