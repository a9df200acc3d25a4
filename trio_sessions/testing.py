"""Helpers for testing drains deterministically (public API, like `trio.testing`).

* `trio_clock()`: a runtime clock tied to trio's (virtual) clock, so `MockClock` jumps drive
  lease expiry; callable from any thread.
* `inline_store(path)`: a `Store` whose SQLite work runs on the trio thread, so autojump
  never advances virtual time while a worker thread blocks.
* `set_seams(runtime, ...)`: pause an owner at a named step (before its finish transaction,
  before recovery applies its decisions) - each call replaces every seam; `crash(runtime)`:
  make an owner vanish like a killed process - no further durable write, claims left to
  expire.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable

import trio

from . import _validate
from ._backend import StoreBackend
from ._naming import store_kind
from ._runtime import Runtime, Seams, postgres_store
from ._sqlite import SQLiteStore as Store

DEFAULT_EPOCH = 1_800_000_000.0


def trio_clock(epoch: float = DEFAULT_EPOCH) -> Callable[[], float]:
    """A clock returning `epoch + trio time`. Call it inside `trio.run`; use it anywhere.
    `TypeError`/`ValueError` for an epoch that is no number of epoch seconds (0 to 1e11)."""
    epoch = _validate.epoch(epoch)
    clock = trio.lowlevel.current_clock()

    def now() -> float:
        return epoch + clock.current_time()

    return now


def inline_store(path: str | os.PathLike[str]) -> StoreBackend:
    """A store whose operations run inline on the trio thread (deterministic tests): an
    SQLite file, or for a postgresql:// URL `PostgresStore(url, inline=True)` (psycopg, the
    `postgres` extra). Another connection string is a `ValueError`, its password masked."""
    if store_kind(path) == "postgres":
        return postgres_store(os.fspath(path), inline=True)
    return Store(path, inline=True)


def set_seams(
    runtime: Runtime,
    *,
    before_finish: Callable[[str], Awaitable[None]] | None = None,
    after_finish: Callable[[str], Awaitable[None]] | None = None,
    before_recovery_apply: Callable[[list[str]], Awaitable[None]] | None = None,
) -> None:
    """Install test seams: `before_finish(session_id)` runs before a drain's finish
    transaction and `after_finish(session_id)` after one that released the claim, while the
    registry entry is still held; `before_recovery_apply(execution_ids)` runs between
    taking recovery leases and applying recovery's decisions. Each is awaited: a plain
    `def` is a `TypeError` naming it. Each call sets all three: a seam it does not name is
    removed (one installed by an earlier call included), and `set_seams(runtime)` removes
    them all - pass every seam a test needs in one call."""
    _check_runtime(runtime, "set_seams")
    seams = {
        "before_finish": before_finish,
        "after_finish": after_finish,
        "before_recovery_apply": before_recovery_apply,
    }
    if runtime._drain is None and any(seam is not None for seam in seams.values()):
        raise ValueError(
            "set_seams: this runtime is a producer (drain=None): it never drains or"
            " recovers, so no seam of it would ever run"
        )
    for what, seam in seams.items():
        if seam is not None:
            _validate.async_callable(seam, what, "its step's argument")
    runtime._seams = Seams(
        before_finish=before_finish,
        after_finish=after_finish,
        before_recovery_apply=before_recovery_apply,
    )


def crash(runtime: Runtime) -> None:
    """Make the owner vanish as if its process was killed: every task stops and nothing more
    is written; its claims stay with live leases. Its liveness token is released when its
    `open_runtime` block exits (as a dead process's is): from then on other runtimes take
    the claims over once it stayed free for `takeover_grace` - at their next look at the
    owners' tokens, which on an inline store is only a recovery pass (every
    `recovery_interval`: no look in the background) - else when the leases run out. Only the
    runtime's tasks stop: the code after the call (a test going on to watch the takeover)
    runs on, and a call to the crashed runtime raises `StoreError`; its open `watch()` and
    `stream()` iterators end, as when a runtime closes (nothing feeds them any more). During
    a graceful shutdown it stops the shutdown too (a second signal to a worker); once the
    runtime closed it is a `RuntimeError` (too late: its claims were handed back)."""
    _check_runtime(runtime, "crash")
    if runtime._closed:
        raise RuntimeError(
            "crash: the runtime is closed (its claims handed back): crash it inside its"
            " open_runtime block"
        )
    runtime._crashed_event.set()
    runtime._closing = True
    runtime._heartbeat_scope.cancel()
    runtime._token_scope.cancel()
    runtime._nursery.cancel_scope.cancel()
    # Their feed (the change loop) stops with the tasks: left open they would wait for ever.
    runtime._watchers.close()
    runtime._streams.close()


def _check_runtime(runtime: object, what: str) -> None:
    """`TypeError` naming the argument unless `runtime` is one (the seams and the crash
    reach into it)."""
    if not isinstance(runtime, Runtime):
        raise TypeError(
            f"{what}: runtime must be the Runtime open_runtime yielded, got {runtime!r:.80}"
        )
