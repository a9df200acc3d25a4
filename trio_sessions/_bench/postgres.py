"""Section `postgres`: the cycle and recovery on PostgreSQL against raw psycopg on the same
server in the same run (DESIGN §7: sequential >= 0.5x, 1,000 in flight >= 5x the raw
sequential cycle, recovery >= 0.3x a raw batched reclaim).

Raw baselines, written as a careful psycopg user would (DESIGN §7: autocommit, one round
trip per statement, fsync on; the server's clock inline in the statement). The cycle writes
the rows the library's cycle writes, as SQLite's raw cycle does, in two statements: the
session row, the input and a fenced claim upsert in one (data-modifying CTEs, so they
commit together), then the claim's fenced delete with the session row's update (the
library's release records there which execution it released). Beside it, for comparison
with earlier figures, the earlier baseline: the claim and its removal only, autocommit off
(BEGIN and COMMIT each a round trip of their own, six per cycle). The reclaim does the library's two
writes per claim (DESIGN §7: the takeover *and* the release), `batch` claims per transaction:
one `UPDATE ... WHERE id IN (SELECT ... FOR UPDATE SKIP LOCKED)`, then one fenced DELETE of
the claims it took, as SQLite's raw reclaim does, each statement in autocommit. The
library's round trips are counted on the wire (`roundtrips`), in a short run of their own.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psycopg

from .._backend import Job
from .._decisions import IterationVerdict
from .._postgres import PostgresStore
from .._postgres.engine import PgEngine
from .._store.acquisition import submit_and_acquire
from .._store.claims import end_iteration
from .config import Config
from .pg import PgSchemas
from .recovery import RecoveryTarget, add_recovery_rows, recovery_rounds
from .report import Report, fmt_rate, fmt_ratio, fmt_us, median, progress, verdict
from .roundtrips import TURN_APPENDS, round_trips_per_cycle, turn_round_trips
from .tools import (
    PAYLOAD_JSON,
    concurrent_cycles,
    ids,
    noop_drain,
    open_bench_runtime,
    rotate,
    sequential_cycles,
)

SERVER_MS = "floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint"

RAW_CLAIMS = """
CREATE TABLE IF NOT EXISTS claims(
    session_id TEXT PRIMARY KEY, owner TEXT NOT NULL, fence BIGINT NOT NULL,
    expires_at BIGINT NOT NULL)
"""
RAW_CLAIMS_INDEX = "CREATE INDEX IF NOT EXISTS claims_expires_at ON claims(expires_at)"

RAW_CLAIM = (
    "INSERT INTO claims(session_id, owner, fence, expires_at)"
    f" VALUES (%s, %s, 1, {SERVER_MS} + 30000)"
    " ON CONFLICT (session_id) DO UPDATE SET owner = excluded.owner,"
    " fence = claims.fence + 1, expires_at = excluded.expires_at"
    f" WHERE claims.expires_at < {SERVER_MS} RETURNING fence"
)
RAW_RELEASE = "DELETE FROM claims WHERE session_id = %s AND owner = %s AND fence = %s"
# The rows the library's cycle writes beside the claim (as SQLite's raw cycle's tables).
RAW_ROWS = """
CREATE TABLE IF NOT EXISTS raw_session(
    id TEXT PRIMARY KEY, time_created BIGINT NOT NULL, input_seq BIGINT NOT NULL,
    released_fence BIGINT);
CREATE TABLE IF NOT EXISTS raw_input(
    id TEXT PRIMARY KEY, session_id TEXT NOT NULL, seq BIGINT NOT NULL,
    payload TEXT NOT NULL, time_created BIGINT NOT NULL, UNIQUE(session_id, seq))
"""
# One statement, so one round trip and one commit in autocommit: the session row (its input
# count bumped), the input at that count, and the fenced claim.
RAW_SUBMIT = (
    "WITH counted AS ("
    "INSERT INTO raw_session(id, time_created, input_seq)"
    f" VALUES (%(session)s, {SERVER_MS}, 1) ON CONFLICT (id)"
    " DO UPDATE SET input_seq = raw_session.input_seq + 1 RETURNING input_seq),"
    " stored AS (INSERT INTO raw_input(id, session_id, seq, payload, time_created)"
    f" SELECT %(input)s, %(session)s, counted.input_seq, %(payload)s, {SERVER_MS}"
    " FROM counted)"
    " INSERT INTO claims(session_id, owner, fence, expires_at)"
    f" VALUES (%(session)s, %(owner)s, 1, {SERVER_MS} + 30000)"
    " ON CONFLICT (session_id) DO UPDATE SET owner = excluded.owner,"
    " fence = claims.fence + 1, expires_at = excluded.expires_at"
    f" WHERE claims.expires_at < {SERVER_MS} RETURNING fence"
)
# The claim's fenced removal and, as the library's release on PostgreSQL records on the
# session row which execution it released (read back after a lost reply), the session row's
# update: one statement.
RAW_RELEASE_RECORDED = (
    "WITH released AS (DELETE FROM claims WHERE session_id = %s AND owner = %s AND fence = %s"
    " RETURNING session_id, fence)"
    " UPDATE raw_session s SET released_fence = r.fence FROM released r"
    " WHERE s.id = r.session_id"
)
# The reclaimed claims' release, fenced on their owner (the library's resumed no-op drains
# each delete their claim).
RAW_RELEASE_RECLAIMED = "DELETE FROM session_execution WHERE owner_id = %s AND id = ANY(%s)"
RAW_RECLAIM = (
    f"UPDATE session_execution SET owner_id = %s, expires_at = {SERVER_MS} + 30000,"
    f" heartbeat_at = {SERVER_MS} WHERE id IN (SELECT id FROM session_execution"
    f" WHERE expires_at <= (SELECT {SERVER_MS}) ORDER BY expires_at LIMIT %s"
    " FOR UPDATE SKIP LOCKED) RETURNING id"
)
SEED_SESSIONS = (
    "INSERT INTO session(id, time_created)"
    " SELECT %(owner)s || '-' || g, 0 FROM generate_series(0, %(n)s - 1) AS g"
)
SEED_CLAIMS = (
    "INSERT INTO session_execution(id, session_id, owner_id, phase, time_created,"
    " heartbeat_at, expires_at)"
    " SELECT md5(%(owner)s || g), %(owner)s || '-' || g, %(owner)s, 'running', 0, 0,"
    f" {SERVER_MS} + %(offset)s + g FROM generate_series(0, %(n)s - 1) AS g"
)


def raw_pg_cycles(conn: psycopg.Connection[Any], session_ids: Sequence[str]) -> float:
    """The baseline on an autocommit connection: two statements per session, each its own
    transaction and round trip; returns elapsed seconds."""
    owner = "raw-owner"
    started = time.perf_counter()
    for session_id in session_ids:
        row = conn.execute(
            RAW_SUBMIT,
            {
                "session": session_id,
                "input": uuid.uuid4().hex,
                "payload": PAYLOAD_JSON,
                "owner": owner,
            },
        ).fetchone()
        assert row is not None
        conn.execute(RAW_RELEASE_RECORDED, (session_id, owner, row[0]))
    return time.perf_counter() - started


def library_calls(engine: PgEngine, session_ids: Sequence[str]) -> float:
    """The library's two calls per sequential cycle (`submit_and_acquire`, then the no-op
    drain's `end_iteration`), each alone as the runtime sends it, driven one after another on
    one engine: the library's SQL and driver work without trio or a thread hand-off. Returns
    elapsed seconds."""
    owner = "calls-owner"
    started = time.perf_counter()
    for session_id in session_ids:
        execution_id = uuid.uuid4().hex
        submitted = Job(
            submit_and_acquire,
            (session_id, PAYLOAD_JSON, uuid.uuid4().hex, execution_id, owner, 30_000),
        )
        engine.run_alone(submitted)
        submitted.unwrap()
        ended = Job(end_iteration, (session_id, execution_id, owner))
        engine.run_alone(ended)
        if ended.unwrap() is not IterationVerdict.RELEASE:
            raise RuntimeError(f"the no-op drain's end of {session_id} was {ended.result}")
    return time.perf_counter() - started


def raw_light_pg_cycles(conn: psycopg.Connection[Any], session_ids: Sequence[str]) -> float:
    """The earlier baseline, autocommit off: the claim, then its removal, two transactions
    of three round trips each; returns elapsed seconds."""
    owner = "raw-owner"
    started = time.perf_counter()
    for session_id in session_ids:
        row = conn.execute(RAW_CLAIM, (session_id, owner)).fetchone()
        conn.commit()
        assert row is not None
        conn.execute(RAW_RELEASE, (session_id, owner, row[0]))
        conn.commit()
    return time.perf_counter() - started


def seed_expired(conn: psycopg.Connection[Any], n: int) -> None:
    """`n` expired claims of owner 'dead' and `n` live claims of owner 'alive'."""
    for owner, offset in (("dead", -3_600_000), ("alive", 3_600_000)):
        conn.execute(SEED_SESSIONS, {"owner": owner, "n": n})
        conn.execute(SEED_CLAIMS, {"owner": owner, "n": n, "offset": offset})
    conn.commit()


def raw_pg_reclaim(conn: psycopg.Connection[Any], batch: int) -> tuple[float, int]:
    """Baseline: the library's two writes per claim, `batch` claims per transaction - take
    the expired claims over (one statement), then release them (one fenced statement)."""
    conn.autocommit = True  # each statement its own transaction and round trip
    reclaimed = 0
    started = time.perf_counter()
    while True:
        rows = conn.execute(RAW_RECLAIM, ("raw-owner", batch)).fetchall()
        if not rows:
            return time.perf_counter() - started, reclaimed
        taken = [row[0] for row in rows]
        released = conn.execute(RAW_RELEASE_RECLAIMED, ("raw-owner", taken)).rowcount
        if released != len(taken):
            raise RuntimeError(f"raw release took {released} of {len(taken)}")
        reclaimed += len(taken)


def pg_target(schemas: PgSchemas, label: str) -> RecoveryTarget:
    store = schemas.store(label)

    def seed(n: int) -> None:
        with schemas.connect(store.schema) as conn:
            seed_expired(conn, n)

    def claims_left() -> int:
        with schemas.connect(store.schema) as conn:
            row = conn.execute(
                "SELECT count(*) FROM session_execution WHERE owner_id != 'alive'"
            ).fetchone()
        return int(row[0]) if row else -1

    return RecoveryTarget(store, seed, claims_left)


def migrated(schemas: PgSchemas, label: str) -> str:
    """A fresh schema with the library's tables (for the raw baselines)."""
    store = schemas.store(label)
    engine = store.engine()
    engine.open()
    engine.close()
    return store.schema


VARIANTS = ["raw", "raw_light", "calls", "sequential", "concurrent"]


async def bench_pg_cycle(config: Config, schemas: PgSchemas, report: Report) -> None:
    per_round = max(1, config.pg_cycles // config.pg_rounds)
    progress(
        f"postgres cycle: {config.pg_rounds} rounds + warm-up, {per_round} sequential per "
        f"variant per round, {config.pg_concurrent} in flight"
    )
    rates: dict[str, list[float]] = {}
    ratios: dict[str, list[float]] = {}
    store: PostgresStore = schemas.store("cycle")
    raw_schema = schemas.name("cycle_raw")
    calls = schemas.store("cycle_calls").engine()
    calls.open()
    with (
        contextlib.closing(calls),
        schemas.connect(raw_schema) as raw,
        schemas.connect(raw_schema) as light,
    ):
        raw.execute(RAW_CLAIMS)
        raw.execute(RAW_CLAIMS_INDEX)
        raw.execute(RAW_ROWS)
        raw.commit()
        raw.autocommit = True
        async with open_bench_runtime(store, noop_drain) as rt:
            for round_ in range(config.pg_rounds + 1):
                seconds: dict[str, float] = {}
                for variant in rotate(VARIANTS, round_):
                    tag = f"{variant}-{round_}"
                    if variant == "raw":
                        seconds[variant] = raw_pg_cycles(raw, ids(tag, per_round))
                    elif variant == "raw_light":
                        seconds[variant] = raw_light_pg_cycles(light, ids(tag, per_round))
                    elif variant == "calls":
                        seconds[variant] = library_calls(calls, ids(tag, per_round))
                    elif variant == "sequential":
                        seconds[variant] = await sequential_cycles(rt, ids(tag, per_round))
                    else:
                        seconds[variant] = await concurrent_cycles(
                            rt, ids(tag, config.pg_concurrent)
                        )
                if round_ == 0:
                    continue
                round_rates = {
                    "raw": per_round / seconds["raw"],
                    "raw_light": per_round / seconds["raw_light"],
                    "calls": per_round / seconds["calls"],
                    "sequential": per_round / seconds["sequential"],
                    "concurrent": config.pg_concurrent / seconds["concurrent"],
                }
                for variant, rate in round_rates.items():
                    rates.setdefault(variant, []).append(rate)
                    ratios.setdefault(variant, []).append(rate / round_rates["raw"])
            transactions = rt.statistics().store.transactions
    raw_rate = median(rates["raw"])
    report.add(
        "postgres",
        "raw psycopg, the library's writes, autocommit (baseline)",
        f"{fmt_rate(raw_rate)} = {fmt_us(1 / raw_rate)}, 2 round trips",
    )
    light_rate = median(rates["raw_light"])
    report.add(
        "postgres",
        "raw psycopg, claim + removal only, autocommit off (earlier baseline)",
        f"{fmt_rate(light_rate)} = {fmt_us(1 / light_rate)}, 6 round trips",
        fmt_rate(raw_rate),
        fmt_ratio(ratios["raw_light"]),
    )
    calls_rate = median(rates["calls"])
    report.add(
        "postgres",
        "the library's 2 calls per cycle, no trio (its SQL and driver alone)",
        f"{fmt_rate(calls_rate)} = {fmt_us(1 / calls_rate)}",
        fmt_rate(raw_rate),
        fmt_ratio(ratios["calls"]),
    )
    report.machine["pg_calls_ratio"] = median(ratios["calls"])
    for variant, label, target in (
        ("sequential", "default store, sequential", 0.5),
        ("concurrent", f"default store, {config.pg_concurrent} in flight", 5.0),
    ):
        rate = median(rates[variant])
        report.add(
            "postgres",
            label,
            f"{fmt_rate(rate)} = {fmt_us(1 / rate)}",
            fmt_rate(raw_rate),
            fmt_ratio(ratios[variant]),
            f">= {target}x",
            verdict(median(ratios[variant]) >= target),
        )
    report.machine["pg_raw_cycle_us"] = 1e6 / raw_rate
    report.machine["pg_cycle_ratio"] = median(ratios["sequential"])
    report.machine["pg_concurrent_ratio"] = median(ratios["concurrent"])
    report.notes.append(
        f"postgres: the library ran {transactions} transactions over the section; its round "
        "trips are counted on the wire in a run of their own (every connection). The raw "
        "baseline writes the rows the library's cycle writes (the session row and its input "
        "count, the input, the fenced claim; then the claim's fenced removal and the "
        "session row's update) in two autocommit statements, one round trip each (DESIGN "
        "§7); the earlier baseline wrote the claim and its removal only, autocommit off "
        "(BEGIN, the statement and COMMIT per transaction)."
    )


async def bench_pg_recovery(config: Config, schemas: PgSchemas, report: Report) -> None:
    n, batch = config.pg_recovery, config.recovery_batch
    progress(f"postgres recovery: {n} expired claims, {config.pg_rounds} rounds + warm-up")

    def raw(round_: int) -> tuple[float, int]:
        with schemas.connect(migrated(schemas, f"recovery_raw_{round_}")) as conn:
            seed_expired(conn, n)
            return raw_pg_reclaim(conn, batch)

    def target(variant: str, round_: int) -> RecoveryTarget:
        return pg_target(schemas, f"recovery_{variant}_{round_}")

    times = await recovery_rounds(
        ["raw", "threaded", "held"], config.pg_rounds, n, batch, raw=raw, target=target
    )
    rows = (
        ("threaded", f"default store: {n} to completion, {times.passes} passes", 0.3),
        ("takeover", "default store, drains held: takeover only", None),
    )
    add_recovery_rows(report, "postgres", n, batch, times, rows)
    report.machine["pg_recovery_ratio"] = median(times.ratios["threaded"])
    report.machine["pg_raw_recovery_us"] = median(times.secs["raw"]) / n * 1e6


async def bench_pg_round_trips(schemas: PgSchemas, report: Report) -> None:
    """Round trips counted on the wire (`roundtrips.RoundTripProxy`), in a run of their own."""
    progress("postgres round trips: counted through a relay")
    cycle = await round_trips_per_cycle(schemas.url, schemas.name("trips_cycle"))
    turn = await turn_round_trips(schemas.url, schemas.name("trips_turn"))
    report.add(
        "postgres",
        "round trips per sequential cycle (counted on the wire, every connection)",
        f"{cycle:.1f}",
        "",
        "",
        "<= 3",
        verdict(cycle <= 3),
    )
    report.add(
        "postgres",
        f"round trips per chat turn (take inputs, begin, {TURN_APPENDS} appends, finish)",
        f"{turn:.1f}",
        "",
        "",
        "<= 50",
        verdict(turn <= 50),
    )
    report.machine["pg_round_trips_per_cycle"] = cycle
    report.machine["pg_turn_round_trips"] = turn


async def bench_postgres(config: Config, folder: Path, report: Report, schemas: PgSchemas) -> None:
    await bench_pg_round_trips(schemas, report)
    await bench_pg_cycle(config, schemas, report)
    await bench_pg_recovery(config, schemas, report)
