"""`python -m trio_sessions.bench`: the DESIGN §7 performance figures, each beside its raw
baseline (raw `sqlite3`, raw psycopg) measured in the same run.

`--quick` for a short run, `--sections` for a subset, `--pg-url URL` (or
`$TRIO_SESSIONS_PG_URL`) for the PostgreSQL server to measure - by default a throwaway one
is started - and `--no-pg` to skip PostgreSQL. Prints a table, then one machine-readable
`key=value` line (`MACHINE_KEYS`; `parse_machine_line` reads it back). The body lives in
the private package `trio_sessions._bench`.
"""

from __future__ import annotations

import sys

from ._bench import MACHINE_KEYS as MACHINE_KEYS
from ._bench import SECTIONS as SECTIONS
from ._bench import main as main
from ._bench import parse_machine_line as parse_machine_line

if __name__ == "__main__":
    sys.exit(main())
