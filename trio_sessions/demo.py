"""`python -m trio_sessions.demo`: watch trio_sessions keep agent sessions safe, in seconds.

Responsibility: one self-contained, network-free scenario on a fresh SQLite file (temporary
unless `--db PATH`). A scripted fake agent - text and tool calls with small delays - drives
several sessions through five scenes, each line timestamped:

1. a normal turn with tool calls;
2. wakes arriving during a turn coalesce into exactly one more turn;
3. a user interrupts a tool call while more input is queued: the call fails as
   `interrupted` and exactly one successor turn takes the queued input;
4. a worker *process* is SIGKILLed mid-turn; its liveness token is released with it, and
   after the takeover grace - long before its lease runs out - another owner recovers the
   session and finishes the turn;
5. a corrupt record left by a dead owner is quarantined while other sessions carry on.

The summary at the end is computed from the database, never printed unconditionally: the
exit status is 0 only if every check holds. Ctrl-C stops the demo cleanly (exit 130): the
runtime shuts down, expiring its leases so nothing is left claimed for long.

`--worker` is the entry point of scene 4's worker process, not meant to be run by hand.

The body lives in the private package `trio_sessions._demo` (its `__init__` gives the
module map); this module is the entry and re-exports what the tests read.
"""

from __future__ import annotations

import sys

from ._demo.checks import CHECKS as CHECKS
from ._demo.checks import Check as Check
from ._demo.checks import verify as verify
from ._demo.run import main as main
from ._demo.scenes import GHOST_EXECUTION as GHOST_EXECUTION
from ._demo.scenes import Facts as Facts

if __name__ == "__main__":
    sys.exit(main())
