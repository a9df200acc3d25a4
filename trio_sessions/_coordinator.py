"""The in-process registry of sessions this runtime is busy with (pure trio, no SQL).

One `SessionEntry` per busy session: it exists from the moment a wake or recovery decides to
acquire (the *prospective* claim, registered before any I/O) until the busy period ends,
including successor executions started from the same entry. Idle sessions have no entry, no
task and no memory here.

Invariants:
* at most one entry - hence one execution - per session in this runtime;
* a ring that reaches an entry while a deciding transaction (acquire or finish) is in flight
  is honoured by a successor acquisition from the same entry, so no wake is lost between the
  durable doorbell and the local registry; rings before that are covered by the transaction;
* every joiner is resolved exactly once with the outcome of the execution it joined, and a
  cancelled joiner never cancels the execution;
* an entry is always removed when its busy period ends, whatever ended it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import trio

from ._errors import OutcomeUnknown, StoreError
from ._model import Input, InterruptReason, Outcome

# A user message as the read-back finds it: (input id, its data as stored).
Item = tuple[str, Any]


@attrs.define(eq=False)
class Execution:
    """One claim's busy period, as its joiners see it."""

    outcome: Outcome | None = None
    error: BaseException | None = None  # `fail`: the joiners raise a StoreError from it
    forward: Execution | None = None
    settled: bool = False
    # Made by the first joiner that waits: most busy periods have none, and then cost no
    # Event (nor, at their end, its wake-up).
    _done: trio.Event | None = None

    def resolve(self, outcome: Outcome) -> None:
        if not self.settled:
            self.outcome = outcome
            self._settle()

    def fail(self, error: BaseException) -> None:
        """No outcome to give: the joiners' wake was never recorded (`error` is why)."""
        if not self.settled:
            self.error = error
            self._settle()

    def merge_into(self, other: Execution) -> None:
        """This would-be successor turned out unnecessary: its joiners follow `other`."""
        self.forward = other
        self._settle()

    def _settle(self) -> None:
        self.settled = True
        if self._done is not None:
            self._done.set()

    def waited_for(self) -> bool:
        """Whether a joiner waited (or waits) for this execution."""
        return self._done is not None

    async def wait(self) -> Outcome:
        execution = self
        while True:
            if execution._done is None:
                execution._done = trio.Event()
                if execution.settled:
                    execution._done.set()
            await execution._done.wait()
            if execution.error is not None:
                # One exception per waiter: several may raise it at once. A lost reply
                # may have landed - the wake, or the claim that would have served it.
                if isinstance(execution.error, OutcomeUnknown):
                    raise OutcomeUnknown(
                        f"whether the write for this run landed is unknown: {execution.error}"
                    ) from execution.error
                raise StoreError(
                    f"the wake could not be recorded: {execution.error}"
                ) from execution.error
            if execution.forward is None:
                assert execution.outcome is not None
                return execution.outcome
            execution = execution.forward


@attrs.define(eq=False)
class Takes:
    """What one execution's `take_inputs` calls gave its drains, kept so that a call whose
    outcome is unknown (DESIGN §8 "Uncertain commits") can be read back: its inputs, if it
    landed, are among the execution's user messages from position `unsure_from` on (the
    count given when it was sent), less those other calls gave since (`given_meanwhile`).
    A count unless calls overlap or one is unsure: ids are kept only then."""

    given: int = 0
    running: int = 0
    unsure_from: int | None = None
    rang: bool = False  # for the unsure window: the busy period goes on once for it
    given_meanwhile: frozenset[str] = frozenset()  # an empty one costs no memory per entry

    def start(self) -> int:
        """A call begins; returns the count it was sent at."""
        self.running += 1
        return self.given

    def unsure(self, sent_at: int) -> None:
        """The call sent at `sent_at` ended with its outcome unknown."""
        self.unsure_from = sent_at if self.unsure_from is None else min(self.unsure_from, sent_at)

    def untold(self, offset: int, mine: Sequence[Item], limit: int) -> list[Item]:
        """Of this execution's user messages from position `offset` on (seq order, read
        when the read-back began: `unsure_from` then), at most `limit` that an unsure call
        may have taken and no call gave; the read-back is over once none are left. Nothing
        when another call's read-back ended it meanwhile, or a call lost since reaches
        further back (the next call reads from there)."""
        if self.unsure_from is None or self.unsure_from < offset:
            return []
        untold = [item for item in mine if item[0] not in self.given_meanwhile]
        if len(untold) <= limit:
            self.unsure_from, self.rang = None, False
        return untold[:limit]

    def gave(self, taken: Sequence[Input]) -> list[Input]:
        """A call returns `taken` (its `running` ended): less what another call's read-back
        gave already (calls at once), counted."""
        fresh = [item for item in taken if item.id not in self.given_meanwhile]
        self.given += len(fresh)
        if self.running or self.unsure_from is not None:
            self.given_meanwhile |= {item.id for item in fresh}
        elif self.given_meanwhile:
            self.given_meanwhile = frozenset()
        return fresh


@attrs.define(eq=False)
class SessionEntry:
    """The local registration of one busy session."""

    session_id: str
    execution_id: str
    current: Execution = attrs.Factory(Execution)
    successor: Execution | None = None
    scope: trio.CancelScope = attrs.Factory(trio.CancelScope)
    owned: bool = False
    # A run joined this acquisition without a wake of its own: if it does not claim, the
    # next acquisition records a wake for that run (it must never be lost or deferred idly).
    needs_wake: bool = False
    resumed: bool = False
    attempt: int = 0
    reason: InterruptReason | None = None
    # A user's interrupt was accepted for this claim: it stays one even when a lost lease
    # or token takes over `reason`, so a claim handed back then is marked cancelling
    # (recovery finishes it) and never resumed.
    stopped_by_user: bool = False
    # The store holds no claim of ours for it any more (`lose_claim`).
    claim_gone: bool = False
    # This runtime's `delete_session` may be removing the session, its claim with it: set
    # from before that commit until it is answered, since the drain's next write, the
    # heartbeat or the change scan may find the claim gone before the reply arrives. Such
    # a loss is on purpose, no `claim lost` news.
    deleting: bool = False
    # Its claim left it durably (`disown`) and its busy period goes on, or ends, from here.
    disowned: bool = False
    deciding: bool = False
    # A change signal named the session while its acquisition was in flight: the look it
    # caused passed it over (held here), so its answer must not pass its doorbell over.
    signalled: bool = False
    rings: int = 0
    rings_seen: int = 0
    # Made by the first task that waits for the busy period's end (`released`).
    _released: trio.Event | None = None
    closed: bool = False
    # Set when the busy period ends: joiners were waiting, and woke with its end.
    joined: bool = False
    # The last finish left its schedule point to the busy period (`caller_yields_next`).
    yield_owed: bool = False
    # The last iteration end took the doorbell to drain again, and no drain call has
    # started since: a wake recorded before an interrupt that ends the busy period now is
    # owed to a successor (invariant 7), so that cleanup rings again.
    wake_taken: bool = False
    # Its lease counts as lost because its local deadline passed (`self_fenced`), which
    # nothing has logged yet, unlike a loss the heartbeat or the token watch found.
    fenced_by_deadline: bool = False
    # When a wake reached this runtime and started the busy period (trio clock), until its
    # first drain call starts: the wake-to-start latency (telemetry only).
    woken_at: float | None = None
    # What this execution's `take_inputs` calls gave (`Takes`): read back after a call
    # whose outcome is unknown.
    takes: Takes = attrs.Factory(Takes)
    # The shield of a claim acquisition in flight whose doorbell is durable already (a
    # plain acquire): the runtime's close lifts it (`withdraw_acquisition`).
    acquisition: trio.CancelScope | None = None
    # The scope of a failed drain's finish in flight: the runtime's close cancels it
    # (`withdraw_failed_finish`).
    failed_finish: trio.CancelScope | None = None

    def ring(self) -> Execution:
        """A wake reached this entry; returns the execution that will take it."""
        self.rings += 1
        # Once a deciding transaction is in flight, or the execution is stopping, only a
        # successor can take this wake.
        if self.deciding or self.reason is not None:
            if self.successor is None:
                self.successor = Execution()
            return self.successor
        return self.current

    def begin_deciding(self) -> None:
        """A transaction that reads the doorbell starts: later rings need a successor."""
        self.deciding = True
        self.rings_seen = self.rings

    def keep_going(self) -> None:
        """The deciding transaction kept the claim (claimed, or took a doorbell): rings during
        it are covered by this claim's next finish, so a would-be successor merges in."""
        self.deciding = False
        self.needs_wake = False
        # A stopping execution ends with its interrupt: rings after it belong to a real
        # successor (started if the doorbell is set after cleanup), not to it.
        if self.successor is not None and self.reason is None:
            self.successor.merge_into(self.current)
            self.successor = None

    def finishing(self) -> bool:
        """A transaction that may release the claim is in flight."""
        return self.deciding and self.owned

    def joinable(self) -> bool:
        """A run may join without recording a wake: nothing is stopping or finishing. (If it
        joins an acquisition that then does not claim, `needs_wake` records one for it.)"""
        return self.reason is None and not self.finishing()

    def rung_since_decision(self) -> bool:
        return self.rings > self.rings_seen

    def interrupt(self, reason: InterruptReason) -> bool:
        """Accept an interrupt: cancel the execution's scope at once. False if already stopping."""
        if self.reason is not None:
            return False
        self.reason = reason
        self.stopped_by_user = reason == "user"
        self.scope.cancel()
        return True

    def withdraw_acquisition(self) -> None:
        """The runtime closes: let its cancellation reach a claim acquisition in flight,
        so one that has not begun (SQLite: its batch waits for another process's write
        lock) is withdrawn unrun instead of holding the close for up to `LOCK_PATIENCE_S`.
        Nothing is lost: its doorbell stays rung for whoever drains next. One that began
        runs to its end as before - the executor never abandons it, and its caller flips
        the registration with no checkpoint between - and its claim is handed back. One a
        user's interrupt was accepted for stays shielded: that stop is owed to whoever
        holds the claim (`_pass_on_interrupt`), and a user's stop finishes its cleanup."""
        if self.acquisition is not None and not self.stopped_by_user:
            self.acquisition.shield = False

    def withdraw_failed_finish(self) -> None:
        """The runtime closes: cancel a failed drain's finish in flight, so one still
        waiting for another process's lock (SQLite's write lock, a PostgreSQL row lock) is
        withdrawn unrun instead of holding the close for up to `LOCK_PATIENCE_S`. As after
        a store error at close, the claim stays durable and recovery takes it over once
        this runtime's liveness token is free. A user's stop finishes its own cleanup:
        one accepted while the finish was in flight keeps it (left, the claim would be
        resumed by recovery - the work the user stopped)."""
        if self.failed_finish is not None and not self.stopped_by_user:
            self.failed_finish.cancel()

    def own(self, *, attempt: int, resumed: bool, deadline: float) -> None:
        """The claim committed: this entry owns it until `deadline` (trio clock) unless
        renewed. The deadline is the drain scope's: trio cancels the drain there."""
        self.owned = True
        self.attempt = attempt
        self.resumed = resumed
        self.wake_taken = False  # a new claim: what the last one took it answered
        self.fenced_by_deadline = False
        # Usually set already, when the scope was made (`BusyPeriods.register`): setting a
        # deadline costs trio more than making a scope with it.
        if self.scope.deadline != deadline:
            self.scope.deadline = deadline
        if trio.current_time() >= deadline:
            # Answered past its local deadline (the process was stopped, or the reply took
            # longer than the lease): another runtime may own it already, so nothing of it
            # may run - trio would cancel the scope only at its next deadline check.
            self.scope.cancel()

    def renewed(self, deadline: float) -> None:
        """A renewal sent before `deadline - lease` succeeded. A renewal that was sent
        earlier but answered later never moves the deadline back."""
        self.scope.deadline = max(self.scope.deadline, deadline)

    def disown(self) -> None:
        """The claim left this entry durably (released, finished, expired on purpose)."""
        self.owned = False
        self.disowned = True

    def ending_claim(self) -> bool:
        """A transaction that may release the claim is in flight, or released it and the
        busy period has not ended yet: a wake committed since finds no claim, and only a
        ring into this entry (a successor) takes it here."""
        return self.deciding and (self.owned or self.disowned)

    def self_fenced(self) -> bool:
        """The drain was stopped by its local lease deadline (nobody interrupted it): the
        lease must be treated as lost, with no durable write."""
        if self.reason is None and self.owned and trio.current_time() >= self.scope.deadline:
            self.reason = "lease_lost"
            self.fenced_by_deadline = True  # noticed, not yet logged: the finalizer logs it
        return self.reason == "lease_lost"

    def lose_lease(self) -> None:
        """The lease is gone: whatever else was happening, write nothing more for this claim.

        A shutdown already ended the lease on purpose; it stays the reason joiners see."""
        if self.reason != "shutdown":
            self.reason = "lease_lost"
        self.scope.cancel()

    def lose_claim(self) -> None:
        """The store holds no claim of ours for it any more: its session was deleted (here,
        or elsewhere), or another owner took it over. Write nothing more for it; nobody
        recovers it from us, so a wake rung here meanwhile is ours to take (`decide_ending`)."""
        self.claim_gone = True
        self.lose_lease()

    def start_successor(self, execution_id: str) -> None:
        """Reuse this entry for a fresh acquisition (new execution id, scope and joiners).

        Joiners of an execution that never settled (an acquisition that did not claim but
        was rung meanwhile) follow the successor instead of waiting forever.
        """
        successor = self.successor or Execution()
        if not self.current.settled:
            self.current.merge_into(successor)
        self.current = successor
        self.successor = None
        self.execution_id = execution_id
        self.scope = trio.CancelScope()
        self.owned = False
        self.resumed = False
        self.reason = None
        self.stopped_by_user = False
        self.claim_gone = False
        self.deleting = False
        self.disowned = False
        self.deciding = False
        self.yield_owed = False
        self.takes = Takes()
        self.acquisition = None

    def woke_waiters(self) -> bool:
        """Whether the busy period's end woke a task (a joiner, or one waiting for it)."""
        return self.joined or self._released is not None

    def close(self, outcome: Outcome) -> None:
        """The busy period is over: resolve every joiner still waiting."""
        self.joined = self.current.waited_for() or (
            self.successor is not None and self.successor.waited_for()
        )
        self.current.resolve(outcome)
        if self.successor is not None:
            self.successor.resolve(Outcome("deferred"))
        self.closed = True
        if self._released is not None:
            self._released.set()

    def released(self) -> trio.Event:
        """Set once the busy period is over (`close`); made for the first task that waits."""
        if self._released is None:
            self._released = trio.Event()
            if self.closed:
                self._released.set()
        return self._released
