"""A stateful model of the durable protocol, checked step by step against the real store.

Hypothesis drives the synchronous store operations (`trio_sessions._store`, and the
runtime's recovery batch) for several owners on one SQLite database, with wall-clock jumps,
wakes, submits, acquisitions, heartbeats, drain writes, finishes, interrupts, crashes,
recovery passes split into their transactions (so other owners act in between), a
malformed assistant row now and then, and operator releases of quarantined executions.

An independent model predicts every result from the contract (DESIGN §4); after every step
the database must equal the model, and the §6 invariants must hold on the database itself:
at most one owner that believes its lease live per session (and that belief is true), no
revived lease, no lost wake, quarantined rows never returned by a scan, cancelled work never
resumed.

`TRIO_SESSIONS_MODEL_STEPS` raises the number of steps (default 10,000; the soak runs many
more: `python -m trio_sessions.soak --model-steps N`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

import attrs
import pytest
from backends import finish_iteration
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from trio_sessions import _codec, _sqlite, _store, _transcript
from trio_sessions._decisions import AcquireVerdict, RecoveryDecision
from trio_sessions._errors import (
    DuplicateSettlement,
    InputConflict,
    LeaseLost,
    MalformedRecord,
    SessionBusy,
    UnknownToolCall,
)
from trio_sessions._model import (
    BUDGET_EXHAUSTED,
    INTERRUPTED,
    OWNER_LOST,
    AssistantData,
    TextPart,
    ToolPart,
)
from trio_sessions._store.recovery_scan import scan_and_lease

LEASE_MS = 3_000
MAX_RESUMES = 2
RECOVERY_BATCH = 2
SESSIONS = ("s1", "s2", "s3")
OWNER_SLOTS = ("a", "b", "c")
STEP_COUNT = 100
TARGET_STEPS = int(os.environ.get("TRIO_SESSIONS_MODEL_STEPS", "10000"))
# A strict decoder rejects "false" for a bool: the row is malformed, not coerced.
MALFORMED = '{"parts":[],"finished":"false","error":null}'
JUMPS = (1, 10, 100, 999, 1_000, 1_001, 2_999, 3_000, 3_001, 7_000)
FAILED = "failed: RuntimeError('drain raised')"


@attrs.define
class ClaimModel:
    execution_id: str
    owner_id: str
    phase: str
    expires_at: int
    anchor_seq: int | None
    handed_back: bool = False  # by a graceful shutdown (resumed without counting) or a Stop


@attrs.define
class MessageModel:
    id: str | None  # user message ids are generated inside the store
    role: str
    seq: int
    execution_id: str | None
    input_id: str | None
    data: AssistantData | str  # assistant data, or the user payload / malformed text


@attrs.define
class SessionModel:
    time_woken: int | None = None
    wakes: int = 0
    wake_attempts: int = 0
    input_seq: int = 0
    pending: list[tuple[str, int, str]] = attrs.Factory(list)  # (input id, seq, payload)
    claim: ClaimModel | None = None
    # Pending inputs left without doorbell or claim by the drain's own choice (it returned
    # without taking them) or by a failed ending; every other strand is a lost wake.
    excused: bool = False
    paused: bool = False  # no claim is ever taken while set (DESIGN §5.1)


@attrs.define
class RecoveryRowModel:
    session_id: str
    owner_id: str
    expires_at: int
    error: str | None = None


@attrs.define
class OwnerModel:
    """One runtime instance as it sees itself: the claims it believes it holds."""

    owner_id: str
    held: dict[str, str] = attrs.Factory(dict)  # session -> execution id
    renewed_at: dict[str, int] = attrs.Factory(dict)  # execution id -> last renewal instant
    open_message: dict[str, str] = attrs.Factory(dict)  # execution id -> message id
    leased: list[_store.Candidate] | None = None

    def forget(self, session_id: str) -> None:
        execution_id = self.held.pop(session_id, None)
        if execution_id is not None:
            self.renewed_at.pop(execution_id, None)
            self.open_message.pop(execution_id, None)


def _is_running_tool(part: object) -> bool:
    return isinstance(part, ToolPart) and part.status == "running"


class ProtocolModel(RuleBasedStateMachine):
    """The store and the decisions under an independent model of owners, leases and wakes."""

    steps = 0

    def __init__(self) -> None:
        super().__init__()
        self.conn = _sqlite.connect(":memory:")
        self.now = 1_000_000
        self.sessions: dict[str, SessionModel] = {}
        self.messages: dict[str, list[MessageModel]] = {}
        self.recovery_rows: dict[str, RecoveryRowModel] = {}
        self.generation = dict.fromkeys(OWNER_SLOTS, 0)
        self.owners = [OwnerModel(self._new_owner_id(slot)) for slot in OWNER_SLOTS]
        self.counter = 0
        self.cancelled: set[str] = set()
        self.gone_executions: set[str] = set()
        # Assistant messages corrupted while open (`finished = 0` stays on the row): an
        # owner's finish cannot close one, and keeps the claim for recovery to quarantine.
        self.corrupted_open: set[str] = set()
        self.expired_at_seen: dict[str, int] = {}
        self.quarantined: set[str] = set()
        self.all_inputs: dict[str, str] = {}  # input id -> session id
        self.due_at: dict[str, int] = {}  # scheduled input id -> due instant, until promoted
        self.payloads: dict[str, str] = {}  # input id -> payload as submitted

    # -- plumbing -----------------------------------------------------------------------------

    def teardown(self) -> None:
        self.conn.close()

    def clock(self) -> float:
        # Half a millisecond above the instant, so float rounding never lands a ms early.
        return (self.now + 0.5) / 1000

    def op(self, operation: Any, *args: Any) -> Any:
        return _sqlite.run_op(self.conn, self.clock, operation, *args)

    def fresh(self, prefix: str) -> str:
        self.counter += 1
        return f"{prefix}{self.counter}"

    def _new_owner_id(self, slot: str) -> str:
        self.generation[slot] += 1
        return f"{slot}#{self.generation[slot]}"

    def step(self) -> None:
        ProtocolModel.steps += 1

    def session(self, session_id: str) -> SessionModel:
        return self.sessions.setdefault(session_id, SessionModel(time_woken=None))

    def newest_seq(self, session_id: str) -> int | None:
        seqs = [m.seq for m in self.messages.get(session_id, [])]
        return max(seqs) if seqs else None

    def next_seq(self, session_id: str) -> int:
        newest = self.newest_seq(session_id)
        return 1 if newest is None else newest + 1

    def live(self, claim: ClaimModel | None, execution_id: str, owner_id: str) -> bool:
        """The claim fence: exact execution, exact owner, live lease."""
        return (
            claim is not None
            and claim.execution_id == execution_id
            and claim.owner_id == owner_id
            and claim.expires_at > self.now
        )

    def held_claim(self, owner: OwnerModel, pick: int) -> tuple[str, str]:
        items = sorted(owner.held.items())
        return items[pick % len(items)]

    def is_due(self, input_id: str) -> bool:
        due_at = self.due_at.get(input_id)
        return due_at is None or due_at <= self.now

    def due_pending(self, session: SessionModel) -> bool:
        """Due inputs wait untaken (a scheduled one not yet due does not count)."""
        return any(self.is_due(input_id) for input_id, _, _ in session.pending)

    def ring(self, session: SessionModel) -> None:
        if session.time_woken is None:
            session.time_woken = self.now
        session.wakes += 1
        session.excused = False

    def assistant_messages(self, execution_id: str) -> list[MessageModel]:
        return [
            m
            for messages in self.messages.values()
            for m in messages
            if m.role == "assistant" and m.execution_id == execution_id
        ]

    def close_open_messages(self, execution_id: str, reason: str) -> None:
        for message in self.assistant_messages(execution_id):
            if isinstance(message.data, AssistantData) and not message.data.finished:
                message.data = _transcript.interrupt(message.data, reason)

    def corrupted_while_open(self, execution_id: str) -> bool:
        return any(
            message.id in self.corrupted_open and message.data == MALFORMED
            for message in self.assistant_messages(execution_id)
        )

    def end_claim(self, session_id: str) -> None:
        session = self.sessions[session_id]
        assert session.claim is not None
        self.gone_executions.add(session.claim.execution_id)
        session.claim = None

    def lose(self, owner: OwnerModel, session_id: str) -> None:
        owner.forget(session_id)

    # -- time, wakes, inputs --------------------------------------------------------------------

    @initialize(holders=st.lists(st.integers(0, 2), min_size=len(SESSIONS), max_size=len(SESSIONS)))
    def busy_start(self, holders: list[int]) -> None:
        """Start where the protocol is interesting: every session has an input and an owner."""
        for session_id, slot in zip(SESSIONS, holders, strict=True):
            self.submit(session_id)
            self._acquire(self.owners[slot], session_id)

    @rule(jump=st.sampled_from(JUMPS))
    def advance_clock(self, jump: int) -> None:
        """Wall-clock jumps, around the lease and heartbeat boundaries."""
        self.step()
        self.now += jump

    @rule(session_id=st.sampled_from(SESSIONS))
    def wake(self, session_id: str) -> None:
        self.step()
        self.op(_store.wake, session_id)
        session = self.sessions.get(session_id)
        if session is None:
            self.sessions[session_id] = SessionModel(time_woken=self.now, wakes=1)
            self.messages[session_id] = []
        else:
            self.ring(session)

    @rule(session_id=st.sampled_from(SESSIONS))
    def submit(self, session_id: str) -> None:
        self.step()
        input_id = self.fresh("in")
        payload = _codec.dumps({"n": self.counter})
        assert self.op(_store.submit, session_id, payload, input_id) == input_id
        self.all_inputs[input_id] = session_id
        self.payloads[input_id] = payload
        session = self.sessions.get(session_id)
        if session is None:
            session = self.sessions[session_id] = SessionModel(time_woken=None)
            self.messages[session_id] = []
        self.ring(session)
        session.input_seq += 1
        session.pending.append((input_id, session.input_seq, payload))

    @precondition(lambda self: self.all_inputs)
    @rule(pick=st.integers(0, 1_000), session_id=st.sampled_from(SESSIONS))
    def resubmit(self, pick: int, session_id: str) -> None:
        """Same id, session and payload: idempotent (also once taken); another session or
        another payload: conflict."""
        self.step()
        input_id = sorted(self.all_inputs)[pick % len(self.all_inputs)]
        payload = self.payloads[input_id]
        if self.all_inputs[input_id] == session_id:
            assert self.op(_store.submit, session_id, payload, input_id) == input_id
            with pytest.raises(InputConflict):
                self.op(_store.submit, session_id, "{}", input_id)
        else:
            with pytest.raises(InputConflict):
                self.op(_store.submit, session_id, payload, input_id)

    # -- acquire and heartbeat ----------------------------------------------------------------

    @rule(slot=st.integers(0, 2), session_id=st.sampled_from(SESSIONS))
    def acquire(self, slot: int, session_id: str) -> None:
        self.step()
        self._acquire(self.owners[slot], session_id)

    def _acquire(self, owner: OwnerModel, session_id: str) -> None:
        if session_id in owner.held:
            return  # the local registry rings its own entry instead (invariant 3)
        execution_id = self.fresh("e")
        result = self.op(_store.acquire, session_id, execution_id, owner.owner_id, LEASE_MS)
        session = self.sessions.get(session_id)
        if session is not None and session.claim is not None:
            assert result.verdict is AcquireVerdict.HELD
            assert result.holder == session.claim.owner_id
            return
        if session is not None and session.paused:
            assert result.verdict is AcquireVerdict.PAUSED
            return
        if session is None or session.time_woken is None:
            assert result.verdict is AcquireVerdict.NO_DOORBELL
            return
        assert result.verdict is AcquireVerdict.CLAIM
        assert result.attempt == session.wake_attempts
        session.claim = ClaimModel(
            execution_id,
            owner.owner_id,
            "running",
            self.now + LEASE_MS,
            self.newest_seq(session_id),
        )
        session.time_woken = None
        session.wakes = 0
        owner.held[session_id] = execution_id
        owner.renewed_at[execution_id] = self.now

    @rule(slot=st.integers(0, 2), session_id=st.sampled_from(SESSIONS), with_input=st.booleans())
    def signal_and_acquire(self, slot: int, session_id: str, with_input: bool) -> None:
        """The fused wake (or submit) and acquire of an idle session, one transaction."""
        self.step()
        owner = self.owners[slot]
        if session_id in owner.held:
            return  # the runtime rings its own entry instead
        execution_id = self.fresh("e")
        session = self.sessions.get(session_id)
        claim = None if session is None else session.claim
        if with_input:
            input_id = self.fresh("in")
            payload = _codec.dumps({"n": self.counter})
            stored, result = self.op(
                _store.submit_and_acquire,
                session_id,
                payload,
                input_id,
                execution_id,
                owner.owner_id,
                LEASE_MS,
            )
            assert stored == input_id
            self.all_inputs[input_id] = session_id
            self.payloads[input_id] = payload
        else:
            _, result = self.op(
                _store.wake_and_acquire, session_id, execution_id, owner.owner_id, LEASE_MS
            )
        if session is None:
            session = self.sessions[session_id] = SessionModel(time_woken=None)
            self.messages[session_id] = []
        if with_input:
            session.input_seq += 1
            session.pending.append((input_id, session.input_seq, payload))
        if claim is not None:
            self.ring(session)
            assert result.verdict is AcquireVerdict.HELD
            assert result.holder == claim.owner_id
            return
        if session.paused:
            self.ring(session)  # kept for `resume`
            assert result.verdict is AcquireVerdict.PAUSED
            return
        assert result.verdict is AcquireVerdict.CLAIM
        assert result.attempt == session.wake_attempts
        session.claim = ClaimModel(
            execution_id,
            owner.owner_id,
            "running",
            self.now + LEASE_MS,
            self.newest_seq(session_id),
        )
        if session.time_woken is not None:
            session.time_woken = None
            session.wakes = 0
        session.excused = False
        owner.held[session_id] = execution_id
        owner.renewed_at[execution_id] = self.now

    @precondition(lambda self: any(o.held for o in self.owners))
    @rule(slot=st.integers(0, 2))
    def heartbeat(self, slot: int) -> None:
        """One transaction for all of an owner's claims; never revives an expired lease."""
        self.step()
        owner = self.owners[slot]
        if not owner.held:
            return
        execution_ids = sorted(owner.held.values())
        phases = self.op(_store.heartbeat, owner.owner_id, execution_ids, LEASE_MS)
        for session_id, execution_id in sorted(owner.held.items()):
            claim = self.sessions[session_id].claim
            if self.live(claim, execution_id, owner.owner_id):
                assert claim is not None
                assert phases[execution_id] == claim.phase
                claim.expires_at = self.now + LEASE_MS
                owner.renewed_at[execution_id] = self.now
            else:
                assert phases[execution_id] is None
                self.lose(owner, session_id)

    # -- what a drain writes --------------------------------------------------------------------

    def fenced(self, owner: OwnerModel, session_id: str, execution_id: str) -> bool:
        live = self.live(self.sessions[session_id].claim, execution_id, owner.owner_id)
        if not live:
            self.lose(owner, session_id)
        return live

    @precondition(lambda self: any(o.held for o in self.owners))
    @rule(slot=st.integers(0, 2), pick=st.integers(0, 100))
    def take_inputs(self, slot: int, pick: int) -> None:
        self.step()
        owner = self.owners[slot]
        if not owner.held:
            return
        session_id, execution_id = self.held_claim(owner, pick)
        if not self.fenced(owner, session_id, execution_id):
            with pytest.raises(LeaseLost):
                self.op(_store.take_inputs, session_id, execution_id, owner.owner_id)
            return
        taken = self.op(_store.take_inputs, session_id, execution_id, owner.owner_id)
        session = self.sessions[session_id]
        claim = session.claim
        assert claim is not None
        if claim.phase == "cancelling":
            # Being interrupted: the inputs are left for the successor (DESIGN §5.1).
            assert taken == []
            return
        due = [p for p in session.pending if self.is_due(p[0])]
        assert [i.id for i in taken] == [input_id for input_id, _, _ in due]
        for input_id, _, payload in due:
            self.messages[session_id].append(
                MessageModel(
                    None, "user", self.next_seq(session_id), execution_id, input_id, payload
                )
            )
            self.due_at.pop(input_id, None)
        session.pending = [p for p in session.pending if p not in due]

    @precondition(lambda self: any(o.held for o in self.owners))
    @rule(slot=st.integers(0, 2), pick=st.integers(0, 100))
    def begin_assistant(self, slot: int, pick: int) -> None:
        self.step()
        owner = self.owners[slot]
        if not owner.held:
            return
        session_id, execution_id = self.held_claim(owner, pick)
        message_id = self.fresh("m")
        if not self.fenced(owner, session_id, execution_id):
            with pytest.raises(LeaseLost):
                self.op(
                    _store.begin_assistant, session_id, execution_id, owner.owner_id, message_id
                )
            return
        self.op(_store.begin_assistant, session_id, execution_id, owner.owner_id, message_id)
        self.messages[session_id].append(
            MessageModel(
                message_id,
                "assistant",
                self.next_seq(session_id),
                execution_id,
                None,
                _transcript.EMPTY,
            )
        )
        owner.open_message[execution_id] = message_id

    @precondition(lambda self: any(o.open_message for o in self.owners))
    @rule(
        slot=st.integers(0, 2),
        pick=st.integers(0, 100),
        action=st.sampled_from(["text", "start", "settle", "fail", "finish", "unknown"]),
        call=st.integers(0, 2),
    )
    def assistant_write(self, slot: int, pick: int, action: str, call: int) -> None:
        """Every assistant write is fenced; a tool call settles at most once."""
        self.step()
        owner = self.owners[slot]
        if not owner.open_message:
            return
        execution_id, message_id = sorted(owner.open_message.items())[
            pick % len(owner.open_message)
        ]
        session_id = next(s for s, e in owner.held.items() if e == execution_id)
        call_id = f"call{call}"
        transitions: dict[str, Callable[[AssistantData], AssistantData]] = {
            "text": lambda d: _transcript.append_text(d, "x"),
            "start": lambda d: _transcript.start_tool(d, call_id, "tool", {"k": call}),
            "settle": lambda d: _transcript.settle_tool(d, call_id, output=call),
            "fail": lambda d: _transcript.settle_tool(d, call_id, error="boom"),
            "finish": _transcript.finish,
            "unknown": lambda d: _transcript.settle_tool(d, "nope", output=None),
        }
        transition = transitions[action]
        # Text streams (a delta row); every other change rewrites the message.
        operation: tuple[Any, ...] = (
            (
                _store.append_assistant_text,
                session_id,
                execution_id,
                owner.owner_id,
                message_id,
                "x",
            )
            if action == "text"
            else (
                _store.update_assistant,
                session_id,
                execution_id,
                owner.owner_id,
                message_id,
                transition,
            )
        )
        if not self.fenced(owner, session_id, execution_id):
            with pytest.raises(LeaseLost):
                self.op(*operation)
            return
        message = next(m for m in self.messages[session_id] if m.id == message_id)
        if not isinstance(message.data, AssistantData):
            streaming = self.conn.execute(
                "SELECT 1 FROM session_message_stream WHERE message_id = ? AND execution_id = ?",
                (message_id, execution_id),
            ).fetchone()
            if action == "text" and streaming is not None:
                # An append never reads the message: its delta lands beside the corrupt row.
                assert self.op(*operation)[0] is None
                return
            with pytest.raises(MalformedRecord):
                self.op(*operation)
            return
        try:
            expected = transition(message.data)
        except (DuplicateSettlement, UnknownToolCall, ValueError) as exc:
            with pytest.raises(type(exc)):
                self.op(*operation)
            return
        written = self.op(*operation)[0]
        assert written == expected or (action == "text" and written is None)
        message.data = expected

    @precondition(lambda self: any(o.held for o in self.owners))
    @rule(slot=st.integers(0, 2), pick=st.integers(0, 100))
    def finish_iteration(self, slot: int, pick: int) -> None:
        """A set doorbell continues the claim - unless it was marked cancelling: then the
        doorbell stays for a successor, and is rung for due inputs still pending; otherwise
        it is released. Either way the drain's open messages are finished ('interrupted')."""
        self.step()
        owner = self.owners[slot]
        if not owner.held:
            return
        session_id, execution_id = self.held_claim(owner, pick)
        if not self.fenced(owner, session_id, execution_id):
            with pytest.raises(LeaseLost):
                self.op(finish_iteration, session_id, execution_id, owner.owner_id)
            return
        if self.corrupted_while_open(execution_id):
            # Nothing written: the claim stays for recovery to quarantine once it expires.
            with pytest.raises(MalformedRecord):
                self.op(finish_iteration, session_id, execution_id, owner.owner_id)
            return
        continued = self.op(finish_iteration, session_id, execution_id, owner.owner_id)
        self.close_open_messages(execution_id, INTERRUPTED)
        session = self.sessions[session_id]
        claim = session.claim
        assert claim is not None
        assert continued == (
            session.time_woken is not None and claim.phase == "running" and not session.paused
        )
        if continued:
            session.time_woken = None
            session.wakes = 0
            return
        cancelling = claim.phase == "cancelling"
        self.end_claim(session_id)
        session.wake_attempts = 0
        unrung = session.time_woken is None and not session.paused
        if cancelling and unrung and self.due_pending(session):
            # Marked cancelling, its drain was given no inputs: rung for them, as an
            # interrupt's cleanup rings (a set doorbell is left as it is).
            self.ring(session)
        else:
            session.excused = bool(session.pending)  # it returned without taking them
        owner.forget(session_id)

    @precondition(lambda self: any(o.held for o in self.owners))
    @rule(slot=st.integers(0, 2), pick=st.integers(0, 100))
    def finish_failed(self, slot: int, pick: int) -> None:
        """A failed drain closes its messages and its claim; untaken inputs are not re-armed."""
        self.step()
        owner = self.owners[slot]
        if not owner.held:
            return
        session_id, execution_id = self.held_claim(owner, pick)
        if not self.fenced(owner, session_id, execution_id):
            with pytest.raises(LeaseLost):
                self.op(_store.finish_failed, session_id, execution_id, owner.owner_id, FAILED)
            return
        if self.corrupted_while_open(execution_id):
            # Nothing written: the claim stays for recovery to quarantine once it expires.
            with pytest.raises(MalformedRecord):
                self.op(_store.finish_failed, session_id, execution_id, owner.owner_id, FAILED)
            return
        doorbell = self.op(_store.finish_failed, session_id, execution_id, owner.owner_id, FAILED)
        session = self.sessions[session_id]
        assert doorbell == (session.time_woken is not None)
        self.close_open_messages(execution_id, FAILED)
        self.end_claim(session_id)
        session.wake_attempts = 0
        session.excused = bool(session.pending) and session.time_woken is None
        owner.forget(session_id)

    # -- interrupts -----------------------------------------------------------------------------

    @precondition(lambda self: any(o.held for o in self.owners))
    @rule(slot=st.integers(0, 2), pick=st.integers(0, 100), cleanup_finishes=st.booleans())
    def interrupt_local(self, slot: int, pick: int, cleanup_finishes: bool) -> None:
        """mark_cancelling, then (unless the cleanup is cancelled) finish_interrupted."""
        self.step()
        owner = self.owners[slot]
        if not owner.held:
            return
        session_id, execution_id = self.held_claim(owner, pick)
        session = self.sessions[session_id]
        if not self.fenced(owner, session_id, execution_id):
            with pytest.raises(LeaseLost):
                self.op(_store.mark_cancelling, session_id, execution_id, owner.owner_id)
            return
        self.op(_store.mark_cancelling, session_id, execution_id, owner.owner_id)
        assert session.claim is not None
        session.claim.phase = "cancelling"
        self.cancelled.add(execution_id)
        if not cleanup_finishes:
            # The cleanup was cancelled: the claim stays 'cancelling'; the owner moves on.
            owner.forget(session_id)
            return
        ended = self.op(_store.finish_interrupted, session_id, execution_id, owner.owner_id)
        self.close_open_messages(execution_id, INTERRUPTED)
        self.end_claim(session_id)
        session.wake_attempts = 0
        if self.due_pending(session):
            self.ring(session)
        assert ended.doorbell == (session.time_woken is not None)
        owner.forget(session_id)

    def stop(self, claim: ClaimModel) -> None:
        """A user's Stop of another owner's claim: cancelling, and handed back when its
        lease ran out (no drain of it runs; every runtime's change look brings a pass)."""
        claim.phase = "cancelling"
        claim.handed_back = claim.handed_back or claim.expires_at <= self.now
        self.cancelled.add(claim.execution_id)

    @rule(session_id=st.sampled_from(SESSIONS))
    def request_cancel(self, session_id: str) -> None:
        """An interrupt from a process that does not hold the claim: marks a running one,
        live or expired (then recovery finishes it as cancelled), unless quarantined."""
        self.step()
        accepted = self.op(_store.request_cancel, session_id)
        session = self.sessions.get(session_id)
        claim = None if session is None else session.claim
        expected = (
            claim is not None
            and claim.phase == "running"
            and claim.execution_id not in self.quarantined
        )
        assert accepted == expected
        if expected:
            assert claim is not None
            self.stop(claim)

    # -- conversation control (DESIGN §5.1) ------------------------------------------------------

    @rule(session_id=st.sampled_from(SESSIONS))
    def pause(self, session_id: str) -> None:
        """Created if absent; idempotent. Nothing else changes: a running claim ends at its
        next iteration boundary, a dead one is finished by recovery."""
        self.step()
        self.op(_store.pause, session_id)
        if session_id not in self.sessions:
            self.sessions[session_id] = SessionModel(time_woken=None)
            self.messages[session_id] = []
        self.sessions[session_id].paused = True

    @rule(session_id=st.sampled_from(SESSIONS))
    def resume(self, session_id: str) -> None:
        """Lifts the pause; pending work rings the doorbell (once: a set one stays as is).
        A session that is not paused is left as it is."""
        self.step()
        pending = self.op(_store.resume, session_id)
        session = self.sessions.get(session_id)
        if session is None or not session.paused:
            assert pending is False
            return
        session.paused = False
        if session.time_woken is not None:
            assert pending is True
        elif self.due_pending(session):
            assert pending is True
            self.ring(session)
        else:
            assert pending is False

    @rule(session_id=st.sampled_from(SESSIONS), delay=st.sampled_from((1, 1_000, 5_000)))
    def submit_scheduled(self, session_id: str, delay: int) -> None:
        """Stored now, due `delay` ms later; it rings no doorbell (the due timer will)."""
        self.step()
        input_id = self.fresh("in")
        payload = _codec.dumps({"n": self.counter})
        stored = self.op(_store.submit_scheduled, session_id, payload, input_id, delay, "queue")
        assert stored == input_id
        self.all_inputs[input_id] = session_id
        self.payloads[input_id] = payload
        if session_id not in self.sessions:
            self.sessions[session_id] = SessionModel(time_woken=None)
            self.messages[session_id] = []
        session = self.sessions[session_id]
        session.input_seq += 1
        session.pending.append((input_id, session.input_seq, payload))
        self.due_at[input_id] = self.now + delay

    @rule()
    def promote_due(self) -> None:
        """The due timer fires: every scheduled input now due rings its session's doorbell;
        it reports when the next one falls due."""
        self.step()
        due = self.op(_store.promote_due, 100)
        rung = []
        for session_id, session in sorted(self.sessions.items()):
            promoted = [p[0] for p in session.pending if p[0] in self.due_at and self.is_due(p[0])]
            for input_id in promoted:
                del self.due_at[input_id]
            if promoted:
                self.ring(session)
                rung.append(session_id)
        assert due.sessions == rung
        expected_next = min(self.due_at.values(), default=None)
        assert due.next_due_ms == (None if expected_next is None else expected_next - self.now)

    @rule(session_id=st.sampled_from(SESSIONS), on_busy=st.sampled_from(("reject", "interrupt")))
    def submit_controlled(self, session_id: str, on_busy: str) -> None:
        """ "reject" stores nothing while busy (a claim, or due inputs untaken); "interrupt"
        stores and marks a running claim cancelling in the same transaction."""
        self.step()
        input_id = self.fresh("in")
        payload = _codec.dumps({"n": self.counter})
        session = self.sessions.get(session_id)
        claim = None if session is None else session.claim
        busy = claim is not None or (session is not None and self.due_pending(session))
        if on_busy == "reject" and busy:
            with pytest.raises(SessionBusy):
                self.op(_store.submit_controlled, session_id, payload, input_id, on_busy)
            return
        stored, marked = self.op(_store.submit_controlled, session_id, payload, input_id, on_busy)
        assert stored == input_id
        self.all_inputs[input_id] = session_id
        self.payloads[input_id] = payload
        if session is None:
            session = self.sessions[session_id] = SessionModel(time_woken=None)
            self.messages[session_id] = []
        self.ring(session)
        session.input_seq += 1
        session.pending.append((input_id, session.input_seq, payload))
        # A quarantined claim is left to the quarantine's actions (`_NOT_QUARANTINED`).
        interrupts = (
            on_busy == "interrupt"
            and claim is not None
            and claim.phase == "running"
            and claim.execution_id not in self.quarantined
        )
        # It names the claim it marked cancelling (its owner stops that drain, no other).
        assert marked == (claim.execution_id if interrupts and claim is not None else None)
        if interrupts:
            assert claim is not None
            self.stop(claim)

    @precondition(lambda self: self.all_inputs)
    @rule(pick=st.integers(0, 1_000))
    def cancel_input(self, pick: int) -> None:
        """True and gone while pending; False once taken (or set aside, or deleted)."""
        self.step()
        input_id = sorted(self.all_inputs)[pick % len(self.all_inputs)]
        cancelled = self.op(_store.cancel_input, input_id)
        session = self.sessions.get(self.all_inputs[input_id])
        pending = [] if session is None else [p for p in session.pending if p[0] == input_id]
        assert cancelled == bool(pending)
        if session is not None and pending:
            session.pending.remove(pending[0])
            self.due_at.pop(input_id, None)
            del self.all_inputs[input_id]  # forgotten: a later submit of it stores it anew
            del self.payloads[input_id]

    @rule(session_id=st.sampled_from(SESSIONS))
    def delete_session(self, session_id: str) -> None:
        """Every row of the session goes, claims and recovery rows included. Its owner hears
        of it through the signal and stops holding it (its later writes would fail the
        claim fence); recovery never sees the claim again."""
        self.step()
        existed, removed = self.op(_store.delete_session, session_id)
        session = self.sessions.pop(session_id, None)
        assert existed == (session is not None)
        claim = None if session is None else session.claim
        assert removed == (None if claim is None else claim.execution_id)
        if session is None:
            return
        if session.claim is not None:
            self.gone_executions.add(session.claim.execution_id)
        self.messages.pop(session_id)
        for execution_id, row in list(self.recovery_rows.items()):
            if row.session_id == session_id:
                del self.recovery_rows[execution_id]
                self.quarantined.discard(execution_id)
        for input_id in [i for i, s in self.all_inputs.items() if s == session_id]:
            del self.all_inputs[input_id]  # a retry of it would store a new input
            del self.payloads[input_id]
            self.due_at.pop(input_id, None)
        for owner in self.owners:
            owner.forget(session_id)
            if owner.leased is not None:
                owner.leased[:] = [c for c in owner.leased if c.session_id != session_id]

    # -- owners disappear -----------------------------------------------------------------------

    @rule(slot=st.integers(0, 2))
    def crash(self, slot: int) -> None:
        """The owner vanishes: its claims and recovery leases simply stay."""
        self.step()
        self.owners[slot] = OwnerModel(self._new_owner_id(OWNER_SLOTS[slot]))

    @precondition(lambda self: any(o.held for o in self.owners))
    @rule(slot=st.integers(0, 2))
    def shutdown(self, slot: int) -> None:
        """Closing runtime: claims kept, leases ended now (fenced), then the owner is gone."""
        self.step()
        owner = self.owners[slot]
        execution_ids = sorted(owner.held.values())
        expired = self.op(_store.expire_claims, owner.owner_id, execution_ids)
        expected = 0
        for session_id, execution_id in owner.held.items():
            claim = self.sessions[session_id].claim
            if self.live(claim, execution_id, owner.owner_id):
                assert claim is not None
                claim.expires_at = self.now
                claim.handed_back = True
                expected += 1
        assert expired == expected
        self.owners[slot] = OwnerModel(self._new_owner_id(OWNER_SLOTS[slot]))

    # -- recovery, in two transactions and the doorbells' acquisitions -----------------------

    @rule(slot=st.integers(0, 2))
    def recovery_pass(self, slot: int) -> None:
        """One whole pass, as `recover_once` runs it: scan and lease, apply, acquire
        doorbells."""
        self.step()
        owner = self.owners[slot]
        self._scan_and_lease(owner)
        self._apply_leased(owner)

    @rule(slot=st.integers(0, 2))
    def recovery_scan(self, slot: int) -> None:
        """Candidates: expired claims by expiry, then unclaimed doorbells; exclusions in SQL.
        Recovery leases on the expired claims, in the same transaction (`scan_and_lease`):
        only if absent, expired or ours, never on a quarantined row."""
        self.step()
        self._scan_and_lease(self.owners[slot])

    def _scan_and_lease(self, owner: OwnerModel) -> None:
        candidates, _, leased, _ = self.op(
            scan_and_lease, owner.owner_id, RECOVERY_BATCH, sorted(owner.held), [], LEASE_MS
        )
        for candidate in candidates:
            assert candidate.execution_id not in self.quarantined
        assert candidates == self.expected_candidates(owner)
        expired = [c for c in candidates if c.execution_id is not None]
        for candidate in expired:
            assert candidate.execution_id is not None
            row = self.recovery_rows.get(candidate.execution_id)
            if row is None:
                self.recovery_rows[candidate.execution_id] = RecoveryRowModel(
                    candidate.session_id, owner.owner_id, self.now + LEASE_MS
                )
            else:  # the scan found it: no quarantine, and ours or expired
                row.owner_id = owner.owner_id
                row.expires_at = self.now + LEASE_MS
        assert leased == expired
        owner.leased = candidates

    def expected_candidates(self, owner: OwnerModel) -> list[_store.Candidate]:
        expired = []
        for session_id, session in self.sessions.items():
            claim = session.claim
            if claim is None or claim.expires_at > self.now or session_id in owner.held:
                continue
            row = self.recovery_rows.get(claim.execution_id)
            if row is not None and (
                row.error is not None
                or (row.owner_id != owner.owner_id and row.expires_at > self.now)
            ):
                continue
            expired.append((claim.expires_at, claim.execution_id, session_id))
        expired.sort()
        result = [_store.Candidate(s, e) for _, e, s in expired[:RECOVERY_BATCH]]
        doorbells = sorted(
            (session.time_woken, session_id)
            for session_id, session in self.sessions.items()
            if session.time_woken is not None
            and session.claim is None
            and not session.paused
            and session_id not in owner.held
        )
        result += [_store.Candidate(s, None) for _, s in doorbells]
        return result[:RECOVERY_BATCH]

    @precondition(lambda self: any(o.leased is not None for o in self.owners))
    @rule(pick=st.integers(0, 2))
    def recovery_apply(self, pick: int) -> None:
        """Apply the decisions (exact fences), then acquire the unclaimed doorbells."""
        self.step()
        leasing = [o for o in self.owners if o.leased is not None]
        self._apply_leased(leasing[pick % len(leasing)])

    def _apply_leased(self, owner: OwnerModel) -> None:
        if owner.leased is None:
            return
        leased, owner.leased = owner.leased, None
        items = [
            (c, self.fresh("e"))
            for c in leased
            if c.execution_id is not None and c.session_id not in owner.held
        ]
        self.apply(owner, items)
        for candidate in leased:
            if candidate.execution_id is None:
                self._acquire(owner, candidate.session_id)

    def apply(self, owner: OwnerModel, items: list[tuple[_store.Candidate, str]]) -> None:
        results = self.op(_store.apply_recovery_batch, owner.owner_id, items, LEASE_MS, MAX_RESUMES)
        for (candidate, new_execution_id), result in zip(items, results, strict=True):
            decision, fence_lost = self.predict_recovery(owner, candidate, new_execution_id)
            assert result.fence_lost == fence_lost, candidate
            if fence_lost:
                # Nothing was ours to act on: whichever fence noticed, nothing is touched
                # (the database comparison after this step proves it) and nothing counts.
                assert result.decision in (RecoveryDecision.GONE, RecoveryDecision.QUARANTINE)
            else:
                assert result.decision == decision, candidate
            if decision is RecoveryDecision.RESUME:
                assert candidate.execution_id not in self.cancelled
                assert result.new_execution_id == new_execution_id
                assert result.attempt == self.sessions[candidate.session_id].wake_attempts

    def predict_recovery(
        self, owner: OwnerModel, candidate: _store.Candidate, new_execution_id: str
    ) -> tuple[RecoveryDecision, bool]:
        """The contract's recovery rules, applied to the model (DESIGN §4, recovery pass)."""
        execution_id = candidate.execution_id
        assert execution_id is not None
        row = self.recovery_rows.get(execution_id)
        if (
            row is None
            or row.owner_id != owner.owner_id
            or row.expires_at <= self.now
            or row.error is not None
        ):
            return RecoveryDecision.GONE, True
        session_id = candidate.session_id
        session = self.sessions[session_id]
        claim = session.claim
        if claim is None or claim.execution_id != execution_id:
            del self.recovery_rows[execution_id]
            return RecoveryDecision.GONE, False
        if claim.expires_at > self.now:
            del self.recovery_rows[execution_id]
            return RecoveryDecision.SKIP_LIVE, False
        superseded = any(
            m.role == "assistant"
            and m.execution_id != execution_id
            and (claim.anchor_seq is None or m.seq > claim.anchor_seq)
            for m in self.messages[session_id]
        )
        own = sorted(self.assistant_messages(execution_id), key=lambda m: m.seq)
        # The newest message, or an older one corrupted while open: a takeover could not
        # close that one (nor could the owner's finish), so it is quarantined too.
        malformed = (
            bool(own) and not isinstance(own[-1].data, AssistantData)
        ) or self.corrupted_while_open(execution_id)
        if claim.phase == "cancelling" or superseded:
            decision = (
                RecoveryDecision.FINISH_CANCELLED
                if claim.phase == "cancelling"
                else RecoveryDecision.DROP_SUPERSEDED
            )
            reason = INTERRUPTED if claim.phase == "cancelling" else OWNER_LOST
            self.close_open_messages(execution_id, reason)
            self.end_claim(session_id)
            if self.due_pending(session):
                self.ring(session)
            del self.recovery_rows[execution_id]
            return decision, False
        if malformed:
            row.error = "malformed"
            self.quarantined.add(execution_id)
            return RecoveryDecision.QUARANTINE, False
        if session.paused:
            # Never resumed: finished as owner-lost and rung, so `resume` drains again.
            self.close_open_messages(execution_id, OWNER_LOST)
            self.end_claim(session_id)
            self.ring(session)
            del self.recovery_rows[execution_id]
            return RecoveryDecision.FINISH_PAUSED, False
        if not claim.handed_back and session.wake_attempts >= MAX_RESUMES:
            self.close_open_messages(execution_id, BUDGET_EXHAUSTED)
            self.end_claim(session_id)
            session.wake_attempts = 0
            session.excused = bool(session.pending) and session.time_woken is None
            del self.recovery_rows[execution_id]
            return RecoveryDecision.EXHAUSTED, False
        self.close_open_messages(execution_id, OWNER_LOST)
        self.gone_executions.add(execution_id)
        session.claim = ClaimModel(
            new_execution_id,
            owner.owner_id,
            "running",
            self.now + LEASE_MS,
            self.newest_seq(session_id),
        )
        if not claim.handed_back:
            session.wake_attempts += 1
        session.time_woken = None
        session.wakes = 0
        del self.recovery_rows[execution_id]
        owner.held[session_id] = new_execution_id
        owner.renewed_at[new_execution_id] = self.now
        return RecoveryDecision.RESUME, False

    # -- bad records and operators --------------------------------------------------------------

    @precondition(lambda self: any(s.claim for s in self.sessions.values()))
    @rule(pick=st.integers(0, 100))
    def corrupt_assistant(self, pick: int) -> None:
        """A malformed assistant row for a claimed execution: recovery must quarantine it."""
        self.step()
        claimed = sorted(s for s, m in self.sessions.items() if m.claim is not None)
        session_id = claimed[pick % len(claimed)]
        claim = self.sessions[session_id].claim
        assert claim is not None
        own = sorted(self.assistant_messages(claim.execution_id), key=lambda m: m.seq)
        if own:
            newest = own[-1]
            assert newest.id is not None
            if isinstance(newest.data, AssistantData) and not newest.data.finished:
                self.corrupted_open.add(newest.id)  # (corrupted again: as open as it was)
            self.conn.execute(
                "UPDATE session_message SET data = ? WHERE id = ?", (MALFORMED, newest.id)
            )
            newest.data = MALFORMED
            return
        message_id = self.fresh("bad")
        seq = self.next_seq(session_id)
        self.conn.execute(
            "INSERT INTO session_message(id, session_id, execution_id, role, seq, data,"
            " time_created, time_updated) VALUES (?, ?, ?, 'assistant', ?, ?, 0, 0)",
            (message_id, session_id, claim.execution_id, seq, MALFORMED),
        )
        self.messages[session_id].append(
            MessageModel(message_id, "assistant", seq, claim.execution_id, None, MALFORMED)
        )
        self.corrupted_open.add(message_id)  # inserted with `finished = 0`

    @precondition(lambda self: self.sessions)
    @rule(session_id=st.sampled_from(SESSIONS))
    def foreign_assistant(self, session_id: str) -> None:
        """An assistant message written by no execution: supersedes an older claim."""
        self.step()
        if session_id not in self.sessions:
            return
        message_id = self.fresh("op")
        seq = self.next_seq(session_id)
        data = AssistantData((TextPart("operator"),), True, None)
        self.conn.execute(
            "INSERT INTO session_message(id, session_id, execution_id, role, seq, data,"
            " time_created, time_updated) VALUES (?, ?, NULL, 'assistant', ?, ?, 0, 0)",
            (message_id, session_id, seq, _codec.encode_assistant(data)),
        )
        self.messages[session_id].append(
            MessageModel(message_id, "assistant", seq, None, None, data)
        )

    @precondition(lambda self: any(r.error for r in self.recovery_rows.values()))
    @rule(
        slot=st.integers(0, 2),
        pick=st.integers(0, 100),
        resume=st.booleans(),
        repair=st.booleans(),
    )
    def release_quarantine(self, slot: int, pick: int, resume: bool, repair: bool) -> None:
        """Operator: drop (finish as owner-lost, re-arm) or resume (after an optional repair)."""
        self.step()
        owner = self.owners[slot]
        rows = sorted(e for e, r in self.recovery_rows.items() if r.error is not None)
        execution_id = rows[pick % len(rows)]
        row = self.recovery_rows[execution_id]
        session = self.sessions[row.session_id]
        if not resume:
            self.op(_store.drop_quarantined, execution_id)
            # Its malformed messages are set aside: the transcript reads again.
            self.messages[row.session_id] = [
                m
                for m in self.messages[row.session_id]
                if not (
                    m.execution_id == execution_id
                    and m.role == "assistant"
                    and not isinstance(m.data, AssistantData)
                )
            ]
            self.close_open_messages(execution_id, OWNER_LOST)
            if session.claim is not None and session.claim.execution_id == execution_id:
                self.end_claim(row.session_id)
            session.wake_attempts = 0
            if self.due_pending(session):
                self.ring(session)
            del self.recovery_rows[execution_id]
            self.quarantined.discard(execution_id)
            return
        if repair:
            for message in self.assistant_messages(execution_id):
                if not isinstance(message.data, AssistantData):
                    # The operator writes the whole message: text streamed onto the
                    # corrupt one goes with it.
                    self.conn.execute(
                        "UPDATE session_message SET data = ? WHERE id = ?",
                        (_codec.encode_assistant(_transcript.EMPTY), message.id),
                    )
                    self.conn.execute(
                        "DELETE FROM session_message_delta WHERE message_id = ?", (message.id,)
                    )
                    message.data = _transcript.EMPTY
                    self.corrupted_open.discard(str(message.id))
        candidate = self.op(_store.lift_quarantine, execution_id, owner.owner_id, LEASE_MS)
        assert candidate == _store.Candidate(row.session_id, execution_id)
        row.error = None
        row.owner_id = owner.owner_id
        row.expires_at = self.now + LEASE_MS
        self.quarantined.discard(execution_id)
        if row.session_id in owner.held:
            return  # the runtime would skip it: this owner's own claim rules apply
        self.apply(owner, [(candidate, self.fresh("e"))])

    # -- invariants -----------------------------------------------------------------------------

    @invariant()
    def database_equals_model(self) -> None:
        """Every table holds exactly what the contract predicts."""
        sessions = {
            row[0]: row[1:]
            for row in self.conn.execute(
                "SELECT id, time_woken, wakes, wake_attempts, time_paused IS NOT NULL FROM session"
            )
        }
        assert sessions == {
            s: (m.time_woken, m.wakes, m.wake_attempts, int(m.paused))
            for s, m in self.sessions.items()
        }
        claims = {
            row[0]: row[1:]
            for row in self.conn.execute(
                "SELECT session_id, id, owner_id, phase, expires_at, anchor_seq"
                " FROM session_execution"
            )
        }
        assert claims == {
            s: (c.execution_id, c.owner_id, c.phase, c.expires_at, c.anchor_seq)
            for s, m in self.sessions.items()
            if (c := m.claim) is not None
        }
        pending = sorted(
            self.conn.execute("SELECT session_id, id, seq, payload, due_at FROM session_input")
        )
        assert pending == sorted(
            (s, *p, self.due_at.get(p[0])) for s, m in self.sessions.items() for p in m.pending
        )
        recovery = {
            row[0]: (row[1], row[2], row[3], row[4] is not None)
            for row in self.conn.execute(
                "SELECT execution_id, session_id, owner_id, expires_at, recovery_error"
                " FROM session_recovery"
            )
        }
        assert recovery == {
            e: (r.session_id, r.owner_id, r.expires_at, r.error is not None)
            for e, r in self.recovery_rows.items()
        }
        stored = self.conn.execute(
            "SELECT session_id, id, role, seq, execution_id, input_id, data"
            " FROM session_message ORDER BY session_id, seq"
        ).fetchall()
        expected = [
            (s, m)
            for s in sorted(self.messages)
            for m in sorted(self.messages[s], key=lambda m: m.seq)
        ]
        assert len(stored) == len(expected)
        for (session_id, message_id, role, seq, execution_id, input_id, data), (s, m) in zip(
            stored, expected, strict=True
        ):
            assert (session_id, role, seq, execution_id, input_id) == (
                s,
                m.role,
                m.seq,
                m.execution_id,
                m.input_id,
            )
            if m.id is not None:
                assert message_id == m.id
            streamed = [
                row[0]
                for row in self.conn.execute(
                    "SELECT text FROM session_message_delta WHERE message_id = ? ORDER BY version",
                    (message_id,),
                )
            ]
            if isinstance(m.data, AssistantData):
                # Readers merge the text streamed since data was written; a finished
                # message holds all of it in data.
                stored_data = _codec.decode_assistant(data, key=message_id)
                assert _transcript.with_streamed(stored_data, streamed) == m.data
                assert not (m.data.finished and streamed)
            else:
                assert data == m.data

    @invariant()
    def one_live_owner(self) -> None:
        """An owner that believes its lease live really holds it: never two live owners."""
        live_owners: dict[str, list[str]] = {}
        claims = {
            row[0]: row[1:]
            for row in self.conn.execute(
                "SELECT session_id, id, owner_id, expires_at FROM session_execution"
            )
        }
        for owner in self.owners:
            for session_id, execution_id in owner.held.items():
                if self.now - owner.renewed_at[execution_id] >= LEASE_MS:
                    continue  # its own watchdog already treats this lease as lost
                assert claims[session_id][:2] == (execution_id, owner.owner_id)
                assert claims[session_id][2] > self.now
                live_owners.setdefault(session_id, []).append(owner.owner_id)
        assert all(len(owners) == 1 for owners in live_owners.values())

    @invariant()
    def no_revived_lease(self) -> None:
        """Once a claim was seen expired its expiry never grows, and a gone claim never returns."""
        for execution_id, expires_at in self.conn.execute(
            "SELECT id, expires_at FROM session_execution"
        ):
            assert execution_id not in self.gone_executions
            seen = self.expired_at_seen.get(execution_id)
            if seen is not None:
                assert expires_at <= seen
            if expires_at <= self.now:
                self.expired_at_seen[execution_id] = min(expires_at, seen or expires_at)

    @invariant()
    def no_lost_wake(self) -> None:
        """Every pending input has a set doorbell or a claim (unless its drain chose so)."""
        stranded = {
            row[0]
            for row in self.conn.execute(
                "SELECT DISTINCT i.session_id FROM session_input i JOIN session s"
                " ON s.id = i.session_id WHERE i.due_at IS NULL AND s.time_woken IS NULL"
                " AND NOT EXISTS"
                " (SELECT 1 FROM session_execution e WHERE e.session_id = i.session_id)"
            )
        }
        assert stranded == {s for s in stranded if self.sessions[s].excused}

    @invariant()
    def cancellation_is_durable(self) -> None:
        """A claim that was asked to cancel stays 'cancelling' until it is finished."""
        for execution_id, phase in self.conn.execute("SELECT id, phase FROM session_execution"):
            if execution_id in self.cancelled:
                assert phase == "cancelling"


run_as_test: Any = run_state_machine_as_test


def test_protocol_model() -> None:
    """The store matches the contract's model and keeps the §6 invariants for ≥10k steps."""
    ProtocolModel.steps = 0
    while ProtocolModel.steps < TARGET_STEPS:
        # Examples end early now and then, so run until the step budget is really spent.
        remaining = TARGET_STEPS - ProtocolModel.steps
        run_as_test(  # typed in newer hypothesis releases, untyped in older ones
            ProtocolModel,
            settings=settings(
                max_examples=math.ceil(remaining / STEP_COUNT * 1.5),
                stateful_step_count=STEP_COUNT,
                deadline=None,
                database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
            ),
        )
    print(f"model steps: {ProtocolModel.steps}")
    assert ProtocolModel.steps >= TARGET_STEPS


# -- shrunk examples, replayed step by step --------------------------------------------------


def replay(*steps: tuple[str, dict[str, Any]]) -> ProtocolModel:
    """Run rules of the model in order, checking every invariant after each step, as
    Hypothesis does: a shrunk failing example stays a deterministic test once it is fixed."""
    machine = ProtocolModel()
    try:
        for name, arguments in steps:
            getattr(machine, name)(**arguments)
            for invariant in machine.invariants:
                invariant.function(machine)
    except BaseException:
        machine.teardown()
        raise
    return machine


def test_recovery_quarantines_an_older_open_message_corrupted_under_a_newer_one() -> None:
    """A crashed drain left a corrupted open message (`bad7`) behind a newer open one: the
    takeover could not close it, so recovery quarantines the claim rather than resume it -
    the rule the owner's own finish follows (it refuses to end the busy period over it)."""
    machine = replay(
        ("busy_start", {"holders": [0, 1, 0]}),
        ("finish_failed", {"pick": 0, "slot": 0}),
        ("corrupt_assistant", {"pick": 0}),  # s2's claim e4 (owner b#1): bad7, open
        ("begin_assistant", {"pick": 0, "slot": 1}),  # e4 opens m8 after it
        ("advance_clock", {"jump": 3_000}),
        ("recovery_pass", {"slot": 0}),
    )
    try:
        assert machine.quarantined == {"e4"}
        reason = machine.conn.execute(
            "SELECT recovery_error FROM session_recovery WHERE execution_id = 'e4'"
        ).fetchone()[0]
        assert "'bad7'" in reason
    finally:
        machine.teardown()


def test_an_interrupting_submit_leaves_a_quarantined_claim_as_it_is() -> None:
    """Found by the model run (the rule expected the mark): recovery quarantined s2's claim
    (`e4`, its reply corrupted), then a submit with `on_busy="interrupt"` stores its input
    and marks nothing - the quarantine's own actions decide that claim."""
    machine = replay(
        ("busy_start", {"holders": [0, 0, 0]}),
        ("advance_clock", {"jump": 3_000}),
        ("corrupt_assistant", {"pick": 1}),
        ("recovery_pass", {"slot": 1}),
        ("submit_controlled", {"on_busy": "interrupt", "session_id": "s2"}),
    )
    try:
        assert machine.quarantined == {"e4"}
        phase = machine.conn.execute(
            "SELECT phase FROM session_execution WHERE id = 'e4'"
        ).fetchone()[0]
        assert phase == "running"
    finally:
        machine.teardown()
