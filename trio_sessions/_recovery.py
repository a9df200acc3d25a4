"""Recovery's conversation with the store: scan, recovery leases, decisions applied, reports.

A pass examines at most `batch` candidates, oldest first: expired claims, then unclaimed
doorbells, one shared budget. Quarantined executions, executions under another owner's live
recovery lease (not of an owner found gone) and sessions this runtime holds are excluded in
SQL, so poison rows never use up the budget (300 poison rows cost three passes; row 301
progresses on the fourth).

This module knows nothing of the local registry: the runtime registers the prospective
claims before `apply` and starts the resumed drains after it (`_loops.py`, through the busy
periods of `_busy.py`: the claim handoff stays in one place). Passes never overlap: the
runtime holds `lock` around each.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import trio

from . import _store
from ._backend import Executor
from ._decisions import RecoveryDecision
from ._errors import MalformedRecord
from ._model import RecoveryReport
from ._store import Candidate, Recovered
from ._store.recovery_scan import scan_and_lease

_REPORT_KEYS = {
    RecoveryDecision.RESUME: "resumed",
    RecoveryDecision.FINISH_CANCELLED: "finished_cancelled",
    RecoveryDecision.DROP_SUPERSEDED: "dropped_superseded",
    RecoveryDecision.QUARANTINE: "quarantined",
    RecoveryDecision.EXHAUSTED: "exhausted",
    RecoveryDecision.FINISH_PAUSED: "finished_paused",
    RecoveryDecision.SKIP_LIVE: "skipped_live",
}


@attrs.frozen
class Scan:
    """One pass's candidates: expired claims whose recovery lease we took, and doorbells;
    and when the next scheduled input falls due (ms from now, None for none)."""

    examined: int
    leased: list[Candidate]
    fence_lost: int
    doorbells: list[Candidate]
    next_due: int | None
    # Owners whose liveness token the scan's transaction found free (None: no scan ran).
    free_owners: set[str] | None = None


class Recovery:
    """The store side of recovery for one runtime."""

    def __init__(
        self, executor: Executor, *, owner_id: str, lease_ms: int, batch: int, max_resumes: int
    ) -> None:
        self._db = executor
        self._owner_id = owner_id
        self._lease_ms = lease_ms
        self.batch = batch
        self._max_resumes = max_resumes
        self.lock = trio.Lock()
        self.totals = RecoveryReport()

    async def scan(
        self, local_sessions: Sequence[str], limit: int, gone: frozenset[str] = frozenset()
    ) -> Scan:
        """Find at most `limit` candidates (at most `batch`) and take a recovery lease on
        each expired claim, counting the claims of `gone` owners, and their recovery leases,
        as expired; and read when the next scheduled input falls due."""
        if limit == 0:
            return Scan(0, [], 0, [], await self._db.read(_store.next_due))
        limit = min(limit, self.batch)
        # One transaction: the scan, the leases on what it found (SQLite: under its only
        # write lock; PostgreSQL: one autocommit call, the claim rows locked to its COMMIT)
        # and the due-input look (no hand-off of its own).
        candidates, free_owners, leased, next_due = await self._db.run(
            scan_and_lease, self._owner_id, limit, local_sessions, sorted(gone), self._lease_ms
        )
        expired = [c for c in candidates if c.execution_id is not None]
        doorbells = [c for c in candidates if c.execution_id is None]
        return Scan(
            len(candidates), leased, len(expired) - len(leased), doorbells, next_due, free_owners
        )

    async def apply(
        self, items: list[tuple[Candidate, str]], gone: frozenset[str] = frozenset()
    ) -> list[Recovered]:
        """Decide and act on each (leased candidate, new execution id) in one transaction;
        a claim of a `gone` owner counts as expired if its token is still free then."""
        return await self._db.run(
            _store.apply_recovery_batch,
            self._owner_id,
            items,
            self._lease_ms,
            self._max_resumes,
            sorted(gone),
        )

    async def lift_quarantine(self, execution_id: str, *, for_anyone: bool = False) -> Candidate:
        """Clear the quarantine, keeping its recovery lease for this runtime's takeover - or,
        `for_anyone`, with that lease already run out, for any runtime's next pass."""
        lease_ms = 0 if for_anyone else self._lease_ms
        return await self._db.run(_store.lift_quarantine, execution_id, self._owner_id, lease_ms)

    async def drop_quarantine(self, execution_id: str) -> tuple[str, bool]:
        """`_store.drop_quarantined`: its session, and whether its doorbell is set."""
        return await self._db.run(_store.drop_quarantined, execution_id)

    async def quarantine_error(self, execution_id: str) -> MalformedRecord:
        """The `MalformedRecord` an operator sees for an execution quarantined again: its
        newest assistant message's, which does not decode - or, quarantined for another
        reason, the execution's with the quarantine's reason."""
        malformed = await self._db.read(_store.newest_assistant_malformed, execution_id)
        if malformed is not None:
            return malformed
        rows = await self._db.run(_store.quarantined)
        why = [r["recovery_error"] for r in rows if r["execution_id"] == execution_id]
        return MalformedRecord("session_execution", execution_id, why or ["malformed"])

    def record(self, report: RecoveryReport) -> None:
        self.totals = RecoveryReport(
            **{
                field.name: getattr(self.totals, field.name) + getattr(report, field.name)
                for field in attrs.fields(RecoveryReport)
            }
        )


def report_of(results: Sequence[Recovered]) -> RecoveryReport:
    """Count what applying recovery did (a replaced claim, GONE, counts nothing)."""
    counts: dict[str, int] = {}
    for result in results:
        key = "fence_lost" if result.fence_lost else _REPORT_KEYS.get(result.decision)
        if key is not None:
            counts[key] = counts.get(key, 0) + 1
    return RecoveryReport(**counts)
