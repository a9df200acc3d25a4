"""Round trips to PostgreSQL, counted on the wire (DESIGN §7, §8 "One round trip per
operation"): a sequential cycle costs at most 3, a chat turn (take inputs, begin, 40 appends,
finish) at most 50, on every connection the runtime opens. Counted by the bench's relay
(`trio_sessions._bench.roundtrips`), so the count does not trust the library's bookkeeping."""

from __future__ import annotations

import psycopg
import trio

from trio_sessions._bench.roundtrips import (
    counting_url,
    round_trips_per_cycle,
    turn_round_trips,
)


def test_relay_counts_one_round_trip_per_wait_for_the_server(pg_url: str) -> None:
    """The counter itself: a statement in autocommit is one round trip, a psycopg
    transaction with one statement is three (BEGIN, the statement, COMMIT)."""
    with counting_url(pg_url) as (url, proxy), psycopg.connect(url, autocommit=True) as conn:
        before = proxy.round_trips
        conn.execute("SELECT 1").fetchone()
        assert proxy.round_trips - before == 1
        conn.autocommit = False
        before = proxy.round_trips
        conn.execute("SELECT 1").fetchone()
        conn.commit()
        assert proxy.round_trips - before == 3


def test_sequential_cycle_is_at_most_three_round_trips(pg_url: str, pg_schema: str) -> None:
    assert trio.run(round_trips_per_cycle, pg_url, pg_schema, 5) <= 3


def test_chat_turn_is_at_most_fifty_round_trips(pg_url: str, pg_schema: str) -> None:
    assert trio.run(turn_round_trips, pg_url, pg_schema, 1) <= 50
