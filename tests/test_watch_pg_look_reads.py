"""A change look on PostgreSQL reads the watched rows it keeps, not every row past a
session's covered seq (DESIGN §6.26: work per change proportional to the change). Counted
by the server's own statistics of the look's transaction (`pg_stat_xact_user_tables`), so
the count does not trust the library's bookkeeping."""

from __future__ import annotations

from helpers import pg_raw

from trio_sessions._backend import Tx
from trio_sessions._postgres import open_engine
from trio_sessions._store.changes import NEW_PER_LOOK, Followed, Watched, watched_changes

BEHIND = 20 * NEW_PER_LOOK
# Rows of session_message fetched by index, in the transaction so far (its pending counts:
# read before and after, the difference is what the statements between fetched).
_FETCHED = "SELECT idx_tup_fetch FROM pg_stat_xact_user_tables WHERE relname = 'session_message'"


def _counted_look(tx: Tx, watched: dict[str, Followed]) -> tuple[int, Watched]:
    [before] = tx.one(_FETCHED)
    found = watched_changes(tx, watched)
    [after] = tx.one(_FETCHED)
    return int(after) - int(before), found


def test_a_look_at_a_session_far_behind_fetches_the_rows_it_keeps(
    pg_url: str, migrated_schema: str
) -> None:
    """A watched session `BEHIND` messages past its covered seq, beside one up to date: the
    look offers the first `NEW_PER_LOOK` new ones and fetches about twice that many rows
    (the rows it keeps, then each offered message read whole), not the `BEHIND` past the
    covered seq a window over the session read on every look (a catch-up cost the server
    O(n^2 / NEW_PER_LOOK))."""
    with pg_raw(pg_url, migrated_schema) as conn:
        conn.execute("INSERT INTO session(id, time_created) VALUES ('far', 0), ('near', 0)")
        conn.execute(
            "INSERT INTO session_message(id, session_id, role, seq, data, time_created,"
            " time_updated, finished) SELECT s || '-' || n, s, 'user', n, '{\"n\": 0}', 0, 0, 1"
            " FROM (VALUES ('far', %s), ('near', 3)) AS w(s, last), generate_series(1, last) n",
            (BEHIND + 1,),
        )
        conn.execute("ANALYZE session_message")
    engine = open_engine(pg_url, schema=migrated_schema)
    try:
        watched = {
            "far": Followed(1, "far-1", {}, {}),
            "near": Followed(3, "near-3", {}, {}),
        }
        fetched, found = engine.read(_counted_look, watched)
    finally:
        engine.close()
    assert [m.seq for m in found.messages] == list(range(2, NEW_PER_LOOK + 2))
    assert found.heads == {"far": (NEW_PER_LOOK + 1, f"far-{NEW_PER_LOOK + 1}")}
    assert found.behind == {"far"}
    assert fetched <= 2 * NEW_PER_LOOK + 3, fetched
