"""Scheduled inputs falling due together (DESIGN §5.1, §7, §8): reminders a chat product
sets for the same instant ("every user's stand-up at 9:00").

"the drain starts within p99 <= 100 ms of the due time": the promotion that rings their
doorbells must not cost a round trip per session on PostgreSQL - 500 reminders due at
once took ~0.1 s per hundred sessions to ring, the last ones started ~0.7 s late. Counted
on the wire (`_bench.roundtrips`), as tests/test_pg_round_trips.py counts.
"""

from __future__ import annotations

from helpers import pg_raw

from trio_sessions import _store
from trio_sessions._bench.roundtrips import counting_url
from trio_sessions._postgres import open_engine


def seed_due(url: str, schema: str, sessions: list[str]) -> None:
    """One input per session, scheduled and due long ago (not yet promoted)."""
    with pg_raw(url, schema) as conn:
        for session_id in sessions:
            conn.execute(
                "INSERT INTO session(id, time_created, input_seq) VALUES (%s, 0, 1)",
                (session_id,),
            )
            conn.execute(
                "INSERT INTO session_input(id, session_id, seq, payload, time_created, due_at)"
                " VALUES (%s, %s, 1, '{}', 0, 1)",
                (f"{session_id}-reminder", session_id),
            )


def test_promoting_due_inputs_costs_the_same_round_trips_however_many_sessions(
    pg_url: str, migrated_schema: str
) -> None:
    """One promotion of 2 sessions' due inputs and one of 60 cost the same round trips, and
    each rings exactly its sessions' doorbells (their inputs due now)."""
    few = [f"few-{index}" for index in range(2)]
    many = [f"many-{index:02}" for index in range(60)]
    with counting_url(pg_url) as (url, proxy):
        engine = open_engine(url, schema=migrated_schema)
        try:
            trips = []
            rung = []
            for sessions in (few, many):
                seed_due(pg_url, migrated_schema, sessions)
                before = proxy.round_trips
                due = engine.run(_store.promote_due, 100)
                trips.append(proxy.round_trips - before)
                rung.append(due.sessions)
        finally:
            engine.close()
        with pg_raw(pg_url, migrated_schema) as conn:
            left = conn.execute(
                "SELECT COUNT(*) FROM session_input WHERE due_at IS NOT NULL"
            ).fetchone()
            woken = conn.execute(
                "SELECT id, wakes FROM session WHERE time_woken IS NOT NULL ORDER BY id"
            ).fetchall()
    assert rung == [few, many]
    assert left == (0,)
    assert woken == [(session_id, 1) for session_id in sorted(few + many)]
    assert trips[1] == trips[0], trips
