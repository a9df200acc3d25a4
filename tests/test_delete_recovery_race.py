"""`delete_session` racing another runtime's recovery pass on PostgreSQL (DESIGN §5.1,
§6.25: "after delete_session returns, no row of the session remains").

A recovery pass's scan (`ts_recovery_scan`) locks the expired claims it found (`FOR NO KEY
UPDATE`) and inserts their recovery leases in one statement, committed when the call
ends. A delete arriving in between runs `ts_delete_rows` statement by statement in READ
COMMITTED: its `DELETE FROM session_recovery` does not see the uncommitted lease, then its
`DELETE FROM session_execution` waits for the scan's row lock - and once the scan
committed, the lease row is left behind, naming a session that no longer exists (until
the scanning runtime's apply finds the claim gone and drops it, if it still runs).
"""

from __future__ import annotations

from helpers import pg_engine_at as engine_at
from helpers import pg_raw as raw
from test_pg_edit_races import WAIT_S, run_in_thread, waits_for_a_lock

from trio_sessions import _store

RECOVERY_ROWS = "SELECT execution_id, owner_id FROM session_recovery WHERE session_id = 's'"


def test_a_delete_racing_a_recovery_scan_leaves_no_recovery_row(
    pg_url: str, pg_schema: str
) -> None:
    """The scan's statement is played by hand on a connection of its own: the expired
    claim locked as `ts_recovery_candidates` locks it, the lease inserted as
    `ts_recovery_scan` inserts it, not yet committed. The delete, in a thread, waits for
    the claim's row lock; the scan commits; the delete returns - and must have removed the
    lease as every other row of the session."""
    with engine_at(pg_url, pg_schema, 1_000.0) as engine:
        with raw(pg_url, pg_schema) as conn:
            conn.execute("INSERT INTO session(id, time_created) VALUES ('s', 0)")
            conn.execute(
                "INSERT INTO session_execution(id, session_id, owner_id, phase,"
                " time_created, expires_at) VALUES ('e', 's', 'dead', 'running', 0, 1)"
            )
        with raw(pg_url, pg_schema) as scan:
            scan.autocommit = False
            scan.execute("SELECT id FROM session_execution WHERE id = 'e' FOR NO KEY UPDATE")
            scan.execute(
                "INSERT INTO session_recovery(execution_id, session_id, owner_id, expires_at,"
                " time_created) VALUES ('e', 's', 'recoverer', 9000000000000, 0)"
            )
            thread, deleting = run_in_thread(engine, _store.delete_session, "s")
            waits_for_a_lock(pg_url, engine.backend_pid)
            scan.commit()
            thread.join(WAIT_S)
        assert deleting.unwrap() == (True, "e")
        with raw(pg_url, pg_schema) as conn:
            left = conn.execute(RECOVERY_ROWS).fetchall()
            claims = conn.execute("SELECT id FROM session_execution").fetchall()
    assert claims == []
    assert left == []
