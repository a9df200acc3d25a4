"""Keeping leases: the heartbeat, and self-fencing on trio's monotonic clock.

The heartbeat renews every claim this runtime owns in one transaction per tick (fenced per
claim, so an expired lease is never revived) and reads each claim's phase: a claim another
process marked `cancelling` is interrupted (the fallback of the cross-process signal).

Self-fencing (DESIGN §6.17): each owned claim has a local deadline on trio's clock -
monotonic, and virtual under `MockClock` - taken *before* the renewal that succeeded was
sent, so it always trails the durable expiry, which the store set later. The deadline is
the drain's cancel scope deadline: trio cancels the drain at it, whether the store is
slow, unreachable or the process was paused (after a pause, trio sees the deadline passed
before it runs the drain again, so the drain is cancelled at its next checkpoint and writes
nothing). `SELF_FENCE_MARGIN` of the lease is kept between the local deadline and the
durable expiry, so another owner can never start while this drain still runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import trio

from . import _observe
from ._backend import Executor
from ._coordinator import SessionEntry
from ._errors import StoreError
from ._store import heartbeat

# The drain stops this fraction of a lease before the durable expiry (covers clock-rate
# differences between this host and the lease clock, and a drain's time to its next
# checkpoint).
SELF_FENCE_MARGIN = 0.1


def self_fence_deadline(sent_at: float, lease: float) -> float:
    """The local deadline of a claim whose renewal (or acquisition) was sent at `sent_at`."""
    return sent_at + lease * (1 - SELF_FENCE_MARGIN)


class LeaseKeeper:
    """Renews this runtime's claims every `interval` seconds; one transaction per tick."""

    def __init__(
        self,
        executor: Executor,
        owned: Callable[[], Iterable[SessionEntry]],
        *,
        owner_id: str,
        lease: float,
        interval: float,
    ) -> None:
        self._db = executor
        self._owned = owned
        self._owner_id = owner_id
        self._lease = lease
        self._interval = interval
        self.transactions = 0

    async def run(self) -> None:
        while True:
            await trio.sleep(self._interval)
            await self.renew_once()

    async def renew_once(self) -> None:
        """Renew every owned claim; a claim whose fence matched nothing loses its lease now.

        A failed transaction is retried at the next tick; meanwhile each drain's own
        deadline still stops it in time.
        """
        claims = {entry.execution_id: entry for entry in self._owned()}
        if not claims:
            return
        sent_at = trio.current_time()
        self.transactions += 1
        try:
            phases = await self._db.run(
                heartbeat, self._owner_id, list(claims), int(self._lease * 1000)
            )
        except StoreError as exc:
            _observe.heartbeat_failed(self._owner_id, len(claims), exc)
            return
        for execution_id, phase in phases.items():
            entry = claims[execution_id]
            if not entry.owned or entry.execution_id != execution_id:
                continue  # finished or replaced while the heartbeat was in flight
            if phase is None:
                if entry.finishing():
                    # A release (a finish transaction) ran while this renewal was in flight
                    # and took the claim away on purpose; its own result says how the claim
                    # ended, and a fenced finish that found it lost reports that itself.
                    continue
                if entry.reason not in ("shutdown", "lease_lost"):  # on purpose, or known
                    _observe.claim_lost(entry, self._owner_id, cause="heartbeat")
                entry.lose_lease()
                continue
            if entry.self_fenced():
                # Its local deadline passed (checked now: the renewal may have been in
                # flight): lost here whatever the store says - its drain was stopped at its
                # next checkpoint and writes nothing more (§6.17). The store's lease is kept
                # all the same until the drain exits (a shielded cleanup, a thread), so no
                # other owner's drain overlaps it (§6.21); then it runs out for recovery.
                continue
            entry.renewed(self_fence_deadline(sent_at, self._lease))
            if phase == "cancelling":
                entry.interrupt("user")  # written by another process
