"""The due timer: one trio deadline on the earliest due time of a scheduled input.

A scheduled input (`submit(..., delay=)`) rings no doorbell when stored. Each runtime that
drains keeps one deadline - the earliest `due_at` in the whole store, as the store reports
it (the change scan after every signal, the recovery pass, a local scheduled submit, its
own firing) - and when it passes, runs the store's promotion (due inputs ring their
sessions' doorbells, in one transaction) and re-arms from what that reports. No poll of
every session, no task per input: one sleeping task per runtime.

Invariants: the deadline only ever comes from the store's clock (the lease clock: the
server's on PostgreSQL) as a delay, turned into trio time when it arrives, so host clocks
never decide due-ness; a firing that finds nothing due (clock rounding) re-arms at least a
millisecond later, never spins; a failed firing is retried after `RETRY`.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import NoReturn

import trio

from ._errors import StoreError

# Seconds before a firing whose transaction failed is tried again.
RETRY = 0.1
# The shortest re-arm: the store's clock has millisecond resolution.
MIN_DELAY = 0.001


class DueTimer:
    """Sleeps until the earliest due time the store reported, then fires."""

    def __init__(self) -> None:
        self._deadline = math.inf
        self._changed = trio.Event()

    @property
    def deadline(self) -> float:
        """When it fires next (trio clock; `inf` when nothing is scheduled)."""
        return self._deadline

    def arm(self, delay_ms: int | None) -> None:
        """The store says the earliest scheduled input falls due in `delay_ms` (None: none).

        Only ever moves the deadline earlier: a read that began before a scheduled submit
        committed must not hide it. A deadline that turns out early (the input was taken or
        cancelled meanwhile) costs one firing that finds nothing; the firing's own answer,
        read under the write lock, then replaces it.
        """
        if delay_ms is not None:
            self._set(min(self._deadline, _deadline_in(delay_ms / 1000)))

    def _set(self, deadline: float) -> None:
        if deadline != self._deadline:
            self._deadline = deadline
            self._changed.set()

    async def run(self, fire: Callable[[], Awaitable[int | None]]) -> NoReturn:
        """Fire at each deadline; `fire()` promotes what is due and returns the next delay
        (ms, None for none), which re-arms the timer."""
        while True:
            self._changed = trio.Event()
            with trio.move_on_at(self._deadline):
                await self._changed.wait()
                continue  # re-armed: sleep towards the new deadline
            self._deadline = math.inf
            try:
                delay_ms = await fire()
            except StoreError:
                self.arm(int(RETRY * 1000))
                continue
            if delay_ms is not None:
                self.arm(max(delay_ms, int(MIN_DELAY * 1000)))


def _deadline_in(seconds: float) -> float:
    return trio.current_time() + max(seconds, 0.0)
