"""What reaches a runtime from outside a local call: other processes' commits (the change
loop), claims left by dead or stopped owners (recovery), owners whose liveness token is free,
and scheduled inputs falling due.

Each loop only finds work and hands it to the busy periods (`_busy.BusyPeriods`): a remote
doorbell or a due input rings the local registry, a remote interrupt or delete stops the
local claim, a recovered claim is registered and owned exactly as a local acquisition is; a
claim handed back elsewhere (a graceful shutdown, or a user's Stop after its lease ran out)
brings the recovery pass at once.
A lost signal costs latency only: the fallback poll and the recovery pass still find the
work. A store error in a loop is retried at its next turn, never raised out of it.

`BackgroundLoops` holds no state: the registry, the hubs and the executor are the
`Runtime`'s.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import attrs
import trio

from . import _observe, _store
from ._backend import Signal
from ._coordinator import SessionEntry
from ._decisions import RecoveryDecision, rings_after_recovery
from ._errors import StoreError, StoreLost
from ._model import RecoveryReport
from ._recovery import report_of

if TYPE_CHECKING:
    from ._verbs import Runtime

# The change loop looks at the store at least this often, signal or not.
CHANGE_FALLBACK_POLL = 2.0
# Durable wakes taken per look (the rest at the next one).
CHANGE_BATCH = 100


class BackgroundLoops:
    """The runtime's background loops and the recovery pass they (and `recover_once`) run."""

    def __init__(self, runtime: Runtime) -> None:
        self._runtime = runtime

    # -- signals between processes ------------------------------------------------------------

    async def change_loop(self) -> None:
        """React to other processes' commits: take durable wakes that no runtime holds,
        honour remote interrupts of our claims at once, feed watchers. A lost signal costs
        latency only: the fallback poll and recovery still find the work."""
        runtime = self._runtime
        while True:
            waited_from = trio.current_time()
            # This runtime's own commits are no look, not even for a session a local
            # watcher follows - each local write offers its change to local watchers
            # itself, or has this loop look at once (`changed_here`).
            signal = await runtime._db.wait_for_change(
                runtime._kick, CHANGE_FALLBACK_POLL, follows=runtime._busy.followed
            )
            kicked, runtime._kick = runtime._kick.is_set(), trio.Event()
            # A look at everything is the fallback poll's: SQLite's signal (another
            # process's commit) names nothing either, and comes at every such commit.
            polled = trio.current_time() - waited_from >= CHANGE_FALLBACK_POLL
            everything = signal is None and not kicked and polled
            self._look_again_at_passed_over(signal, everything=everything)
            with contextlib.suppress(StoreError):  # looked at again at the next signal
                await self._look_at_changes(signal)

    def changed_here(self, session_id: str) -> None:
        """This runtime changed the session's messages without offering the change to its
        local watchers and streams (the store closed open messages, rewrote or copied the
        transcript): streams read it by themselves, and for watchers this loop looks now
        (its own commits' signals are no look)."""
        self._runtime._streams.touch(session_id)
        self.look_for_watchers(session_id)

    def look_for_watchers(self, session_id: str) -> None:
        """The session may have changed unoffered to local watchers (a write whose outcome
        is unknown, a read-back): if one follows it, this loop looks now."""
        runtime = self._runtime
        if runtime._watchers.watching(session_id):
            runtime._kick.set()

    def pass_over(self, session_id: str) -> None:
        """An acquire found the session locked by another transaction (PostgreSQL answers
        at once, claiming nothing), or failed: the change scan passes over its doorbell
        until a signal names it, or a fallback poll's time at most. With max_active the
        acquisition's end frees a place and kicks the scan, which would otherwise pick this
        oldest doorbell again at once - a hot loop for as long as the lock is held or the
        store fails, every other waiting session held back."""
        limit = trio.current_time() + CHANGE_FALLBACK_POLL
        self._runtime._passed_over.setdefault(session_id, limit)

    def _look_again_at_passed_over(self, signal: Signal | None, *, everything: bool) -> None:
        """Forget the doorbells passed over that `signal` names, or all on a look at
        `everything` (the fallback poll: not our own kick, nor an unnamed signal), or whose
        time is up; and mark the acquisitions in flight that `signal` names (`signalled`):
        the look it causes passes them over, so their answer must not pass their doorbell
        over."""
        passed, entries = self._runtime._passed_over, self._runtime._entries
        named = frozenset() if signal is None else signal.sessions
        for session_id in named:
            entry = entries.get(session_id)
            if entry is not None:
                entry.signalled = True  # an answer in flight: the signal came already
        if passed:
            now = trio.current_time()
            for session_id, limit in list(passed.items()):
                if everything or session_id in named or limit <= now:
                    del passed[session_id]

    async def _look_at_changes(self, signal: Signal | None) -> None:
        runtime = self._runtime
        if signal is None or self._needs_scan(signal):
            await self._scan_changes()
        await runtime._streams.look(runtime._db.read, None if signal is None else signal.sessions)

    def _needs_scan(self, signal: Signal) -> bool:
        """Whether a signal may have moved a doorbell, a claim, an input or what a watcher
        follows: a change to transcripts only, of sessions no watcher follows, only concerns
        streams (the web process of a chat load reads no doorbells per streamed word)."""
        watchers = self._runtime._watchers
        return not signal.transcripts_only or any(map(watchers.watching, signal.sessions))

    async def _scan_changes(self) -> None:
        runtime = self._runtime
        takes_wakes = runtime._drain is not None and not runtime._closing
        limit = runtime._busy.capacity_left(CHANGE_BATCH) if takes_wakes else 0
        # Entries whose claim is ending are looked at too: one whose finish released the
        # claim stays registered until its reply is handled, and a wake committed
        # meanwhile has nobody else here to ring it. A doorbell with no claim is rung into
        # such an entry, which honours it with a successor. (An acquisition in flight is
        # left out: it takes the doorbell it was rung for.)
        ending = {s: entry for s, entry in runtime._entries.items() if entry.ending_claim()}
        owned = {entry.execution_id for entry in runtime._busy.owned_entries()}
        # The claims being taken here are looked up too (their ids are known before they
        # commit): one marked cancelling by another process just after its commit, before
        # its reply reached us, is interrupted now - before its drain starts - not at the
        # fallback poll. Only a claim owned when the look began can be gone from it.
        changes = await runtime._db.read(
            _store.changes,
            runtime._owner_id,
            [
                *(session_id for session_id in runtime._entries if session_id not in ending),
                *runtime._passed_over,
            ],
            [entry.execution_id for entry in runtime._entries.values()],
            limit,
            runtime._watchers.followed(),
        )
        started = 0
        for session_id in changes.doorbells:
            entry = runtime._entries.get(session_id)
            if entry is not None and entry is not ending.get(session_id):
                continue
            if entry is None and changes.handed_back:
                # A claim handed back (a graceful shutdown; a Stop after its lease ran out)
                # waits: the pass this look triggers takes it before doorbells, from the
                # same room (§4's order), so an answer a rolling restart cut goes on before
                # newer chats take its place.
                continue
            if runtime._busy.ring(session_id) is not None:
                runtime._remote_signals += 1
                if entry is None:
                    started += 1
        if started and len(changes.doorbells) >= limit:
            # A full batch: more doorbells may wait, and the signal that rang them all came
            # once. Look again now (past the sessions just taken), not at the fallback poll.
            # (Not when it only rang entries whose claim is ending: the next look would find
            # them again until their busy periods end.)
            runtime._kick.set()
        cancelling, gone = set(changes.cancelling), set(changes.gone) & owned
        lost: list[_observe.ClaimSeen] = []
        for entry in list(runtime._entries.values()):
            if entry.execution_id in cancelling and entry.interrupt("user"):
                runtime._remote_signals += 1
            elif entry.owned and not entry.deciding and entry.execution_id in gone:
                # Taken over after its lease ran out, or deleted by another process
                # (`delete_session`): nothing is left to write. (A transaction of our own
                # that may delete it sets `deciding` first.)
                # Not for a loss already known - the heartbeat or the token's watch said
                # so, and a passed deadline is the finalizer's to log - nor a hand-back.
                if entry.reason not in ("shutdown", "lease_lost"):
                    lost.append(_observe.ClaimSeen.of(entry))
                if not entry.deleting:  # our own delete is no signal from elsewhere
                    runtime._remote_signals += 1
                entry.lose_claim()
        runtime._due.arm(changes.next_due_ms)
        runtime._watchers.apply(changes.watched)
        if changes.watched.behind:
            runtime._kick.set()  # the rest of what those sessions gained: in the next look
        if changes.handed_back:
            # Claims were handed back elsewhere - by a graceful shutdown (their drains
            # exited), or by a user's Stop after their lease ran out (no drain runs past
            # its lease): the pass takes them over now - the grace a dead owner's live
            # claims wait out guards against a drain that may still run, which neither
            # leaves.
            runtime._recover_now.set()
        if lost:
            await self._report_gone(lost)

    async def _report_gone(self, lost: list[_observe.ClaimSeen]) -> None:
        """Log the claims the change look found gone (their drains already stopped): with
        their session, deleted on purpose (`delete_session` elsewhere: a user's erasure, no
        lost claim an operator is alerted to); else lost - taken over. A failed look for
        the sessions logs them lost, as before it was made."""
        runtime = self._runtime
        try:
            present = await runtime._db.read(
                _store.sessions_present, [entry.session_id for entry in lost]
            )
        except StoreError:
            present = {entry.session_id for entry in lost}
        for entry in lost:
            if entry.session_id in present:
                _observe.claim_lost(entry, runtime._owner_id, cause="gone")
            else:
                _observe.session_deleted(entry, runtime._owner_id)

    # -- recovery -----------------------------------------------------------------------------

    async def recovery_loop(self) -> None:
        """A pass every recovery interval, or at once when the change look found claims
        handed back elsewhere (and again at once while such a pass is full); a pass that
        failed is retried by the next (leases keep the rows), except on a store that can
        never be written again (`StoreLost`), which ends the runtime."""
        runtime = self._runtime
        while True:
            with trio.move_on_after(runtime._recovery_interval):
                await runtime._recover_now.wait()
            handed_back, runtime._recover_now = runtime._recover_now.is_set(), trio.Event()
            try:
                full = await self._full_recovery_pass()
            except StoreLost:
                raise
            except StoreError:
                continue
            if handed_back and full:
                # More handed-back claims may wait, and the signals that named them came
                # already. The next pass at once (it takes what the room left by this one
                # allows: none, and it ends the chain).
                runtime._recover_now.set()

    async def _full_recovery_pass(self) -> bool:
        """A recovery pass; whether it was full - it examined all it had room for, so more
        candidates may wait (each one it examined is excluded from the next: resumed or
        started here, finished, or another's)."""
        runtime = self._runtime
        budget = runtime._busy.capacity_left(runtime._recovery.batch)
        report = await runtime.recover_once()
        return bool(budget) and report.examined >= budget

    async def recovery_pass(self) -> RecoveryReport:
        runtime = self._runtime
        # Owners whose liveness token stayed free for the grace, as last seen: their live
        # claims count as expired (re-checked in the takeover's own transaction).
        gone = runtime._gone_owners.gone(trio.current_time())
        # With max_active, take recovery leases only on what this runtime has room for: a
        # lease it would not act on keeps the row from every other runtime for a lease.
        budget = runtime._busy.capacity_left(runtime._recovery.batch)
        scan = await runtime._recovery.scan(list(runtime._entries), budget, gone)
        # Answered after `testing.crash`: a dead process goes no further (no promotion, no
        # takeover); the pass's task is cancelled with the others, a caller's call raises.
        await _refuse_if_crashed(runtime)
        # Scheduled inputs that fell due while no timer ran (a restart) ring their doorbells
        # (the scan's transaction looked), so this very pass starts them; the timer is armed
        # for the rest.
        next_due = scan.next_due
        if next_due is not None and next_due <= 0:
            next_due = await self.fire_due()
        runtime._due.arm(next_due)
        if scan.free_owners is not None:  # sightings for the next pass (no extra look)
            runtime._gone_owners.observe(
                scan.free_owners - {runtime._owner_id}, trio.current_time()
            )
        applied = await self.apply_recovery(scan.leased, gone) if scan.leased else RecoveryReport()
        report = attrs.evolve(
            applied, examined=scan.examined, fence_lost=applied.fence_lost + scan.fence_lost
        )
        started = 0
        for candidate in scan.doorbells:
            if (
                candidate.session_id not in runtime._entries
                and runtime._busy.ring(candidate.session_id) is not None
            ):
                started += 1
        if scan.doorbells and scan.examined >= min(budget, runtime._recovery.batch):
            # The budget ran out among the doorbells: more may wait (wakes whose signals
            # went nowhere, as before this runtime opened). The change loop takes them in
            # full batches now, not at its fallback poll or the next pass.
            runtime._kick.set()
        return attrs.evolve(report, doorbells_started=started)

    async def apply_recovery(
        self, leased: list[_store.Candidate], gone: frozenset[str] = frozenset()
    ) -> RecoveryReport:
        """Apply recovery to claims whose recovery lease we hold, then start resumed drains."""
        runtime = self._runtime
        if runtime._seams.before_recovery_apply is not None:
            await runtime._seams.before_recovery_apply([c.execution_id or "" for c in leased])
        # Killed before this step (`testing.crash` from the seam, or while the scan or a
        # quarantine's lift was answered): a dead process applies nothing.
        await _refuse_if_crashed(runtime)
        entries: list[tuple[_store.Candidate, SessionEntry]] = []
        unacted: list[str] = []  # leased, but no room any more, or busy here since the scan
        sent_at = trio.current_time()  # no checkpoint before the takeover is sent
        room = runtime._busy.capacity_left(len(leased))
        for candidate in leased:
            if len(entries) == room or candidate.session_id in runtime._entries:
                unacted.append(str(candidate.execution_id))
                continue
            entries.append(
                (candidate, runtime._busy.register(candidate.session_id, sent_at=sent_at))
            )
        resumed: list[SessionEntry] = []
        # Shielded: the takeover commit and the registration flips happen together. The
        # runtime's close cancels it (`Runtime._takeover`): one that has not begun (its
        # transaction waits for another process's lock) is then withdrawn unrun, not
        # waited for up to LOCK_PATIENCE_S - the claims stay expired under our recovery
        # leases, which run out - and the close never begins one.
        takeover = runtime._takeover = trio.CancelScope(shield=True)
        if runtime._closing:
            takeover.cancel()
        try:
            with takeover:
                results = await runtime._recovery.apply(
                    [(c, e.execution_id) for c, e in entries], gone
                )
                for (candidate, entry), result in zip(entries, results, strict=True):
                    _observe.recovered(candidate, entry.execution_id, result, runtime._owner_id)
                    if result.decision is RecoveryDecision.RESUME and not result.fence_lost:
                        runtime._busy.own(
                            entry, attempt=result.attempt, resumed=True, sent_at=sent_at
                        )
                        entry.keep_going()
                        resumed.append(entry)
        finally:
            runtime._takeover = None
            for candidate, entry in entries:
                # Open messages closed - also when the reply was lost after the commit.
                self.changed_here(candidate.session_id)
                if not entry.owned:
                    runtime._busy.settle_unclaimed(entry)
        if takeover.cancelled_caught:
            return RecoveryReport()  # withdrawn by the close: nothing of it committed
        if runtime._crashed:
            # Answered after `testing.crash`: a killed process starts no drain (its nursery
            # is closed once its tasks ended); what it took over keeps its live lease.
            for entry in resumed:
                runtime._busy.abandon(entry)
        runtime._refuse_if_crashed()
        for entry in resumed:
            # Closing meanwhile: the busy period starts already interrupted (shutdown), so
            # the takeover is kept with an expired lease, never drained.
            if runtime._closing:
                entry.interrupt("shutdown")
            runtime._nursery.start_soon(runtime._busy.busy_period, entry)
        for (candidate, _), result in zip(entries, results, strict=True):
            if rings_after_recovery(result.decision):
                # As the scan's doorbells are rung: the opening pass's successors too are
                # registered before `open_runtime` returns.
                runtime._busy.ring(candidate.session_id)
        if unacted:
            # Else their leases keep the rows from every runtime with room until they run
            # out (best effort: that is all a failure costs).
            with contextlib.suppress(StoreError):
                await runtime._db.run(_store.end_recovery_leases, runtime._owner_id, unacted)
        return report_of(results)

    # -- owner liveness and due inputs --------------------------------------------------------

    async def _look_at_owners(self) -> frozenset[str]:
        """Look at other owners' liveness tokens; the owners gone now (free for the grace)."""
        runtime = self._runtime
        free = await runtime._db.read(_store.free_tokens)
        free.discard(runtime._owner_id)
        return runtime._gone_owners.observe(free, trio.current_time())

    async def watch_owners(self, poll: float) -> None:
        """Notice a released token within a poll, not a recovery interval: once an owner is
        gone, a recovery pass takes its claims over; owners gone without live claims are
        forgotten (their token's record removed)."""
        runtime = self._runtime
        while True:
            await trio.sleep(poll)
            with contextlib.suppress(StoreError):  # looked at again at the next poll
                gone = await self._look_at_owners()
                if gone and not runtime._token_lost:
                    # Pass after pass while they come back full: a gone owner's claims
                    # beyond one pass waited a poll each (300 claims: three polls).
                    while await self._full_recovery_pass():
                        pass
                    left = await runtime._db.run(_store.forget_gone_owners, sorted(gone))
                    runtime._gone_owners.forget(gone - set(left))

    async def fire_due(self) -> int | None:
        """Promote the scheduled inputs now due (their doorbells rung, one transaction) and
        start their drains here; returns when the next one falls due (ms, None for none)."""
        due = await self._runtime._db.run(_store.promote_due, CHANGE_BATCH)
        for session_id in due.sessions:
            self._runtime._busy.ring(session_id)
        return due.next_due_ms


async def _refuse_if_crashed(runtime: Runtime) -> None:
    """After `testing.crash`, before a recovery step that writes: the runtime's own task
    (cancelled with the others) stops; a caller's call raises `StoreError`, as a verb does."""
    if runtime._crashed:
        await trio.lowlevel.checkpoint_if_cancelled()
    runtime._refuse_if_crashed()
