"""Section `recovery`: the expired claims of a dead owner recovered to completion, against
a raw batched takeover and release of the same rows (DESIGN §7: >= 0.5x). Beside it, what
the contract's own writes cost as raw SQL (`raw_contract_reclaim`) and the trio floor
(`trio_floor_recovery`: those writes driven from trio, a task per resumed claim): the writes
alone, without the reads the contract's decisions need, so a lower bound for a library that
recovers as DESIGN §5 asks. The library part, the rounds and their
report rows are shared with the PostgreSQL section (`library_recovery`, `recovery_rounds`,
`add_recovery_rows`)."""

from __future__ import annotations

import json
import sqlite3
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path

import attrs
import trio

from .._backend import StoreBackend
from .._runtime import DrainContext, open_runtime
from .._sqlite import SQLiteStore
from .config import Config
from .report import Report, fmt_ms, fmt_rate, fmt_ratio, fmt_us, median, progress, verdict
from .tools import QUIET, ids, library_schema, now_ms, raw_db, rotate, seed_claims, wait_all_idle


def seed_recovery(path: Path, n: int) -> None:
    """`n` expired claims of owner 'dead' and `n` live claims of owner 'alive'."""
    library_schema(path)
    with raw_db(path) as conn:
        seed_claims(conn, "dead", ids("dead", n), now_ms() - 3_600_000)
        seed_claims(conn, "alive", ids("alive", n), now_ms() + 3_600_000)


def raw_reclaim(path: Path, batch: int) -> tuple[float, int]:
    """Baseline: the library's two writes per claim, `batch` claims per transaction - take
    the expired claims over (one statement), then release them (one fenced statement),
    as the library's recovery resumes each one and its no-op drain releases it."""
    reclaimed = 0
    with raw_db(path) as conn:
        started = time.perf_counter()
        while True:
            now = now_ms()
            conn.execute("BEGIN IMMEDIATE")
            rows = conn.execute(
                "UPDATE session_execution SET owner_id = ?, expires_at = ?, heartbeat_at = ?"
                " WHERE id IN (SELECT id FROM session_execution WHERE expires_at <= ?"
                " ORDER BY expires_at LIMIT ?) RETURNING id",
                ("raw-owner", now + 30_000, now, now, batch),
            ).fetchall()
            conn.execute("COMMIT")
            if not rows:
                break
            conn.execute("BEGIN IMMEDIATE")
            released = conn.execute(
                "DELETE FROM session_execution WHERE owner_id = ?"
                " AND id IN (SELECT value FROM json_each(?))",
                ("raw-owner", json.dumps([row[0] for row in rows])),
            ).rowcount
            conn.execute("COMMIT")
            if released != len(rows):
                raise RuntimeError(f"raw release took {released} of {len(rows)}")
            reclaimed += len(rows)
        return time.perf_counter() - started, reclaimed


# The contract's writes per recovered claim as raw SQL, in the library's three transactions
# per pass: recovery's own four (DESIGN §5, the recovery pass: a recovery lease on each
# expired claim; the takeover - a new execution, owner, lease and anchor -, the resume count
# and the lease deleted), then the resumed drain's normal finish (the release, the count
# reset). Each write is fenced on the row it changes (still expired, or still ours); the
# library's statements add the checks its decisions need (superseded, paused, the resume
# budget, our live lease), which these leave out.
_RAW_RECOVERER = "raw-recoverer"
_LEASE_MS = 30_000
_CONTRACT_LEASE = (
    "INSERT INTO session_recovery(execution_id, session_id, owner_id, expires_at,"
    " time_created) SELECT id, session_id, ?, ?, ? FROM session_execution"
    " WHERE expires_at <= ? AND id NOT IN (SELECT execution_id FROM session_recovery)"
    " ORDER BY expires_at LIMIT ? RETURNING session_id, execution_id"
)
_CONTRACT_TAKE_OVER = (
    "UPDATE session_execution SET id = ?, owner_id = ?, phase = 'running', anchor_seq ="
    " (SELECT MAX(m.seq) FROM session_message m WHERE m.session_id = session_execution.session_id),"
    " time_created = ?, heartbeat_at = NULL, expires_at = ? WHERE id = ? AND expires_at <= ?"
)


def _contract_lease(conn: sqlite3.Connection, batch: int) -> list[tuple[str, str]]:
    """Transaction 1: the oldest expired claims under no recovery lease, each leased (one
    statement, as the library's scan)."""
    now = now_ms()
    conn.execute("BEGIN IMMEDIATE")
    rows = conn.execute(_CONTRACT_LEASE, (_RAW_RECOVERER, now + _LEASE_MS, now, now, batch))
    claims = [(str(s), str(e)) for s, e in rows.fetchall()]
    conn.execute("COMMIT")
    return claims


def _contract_take_over(conn: sqlite3.Connection, claims: Sequence[tuple[str, str]]) -> list[str]:
    """Transaction 2: each claim replaced by a new execution of ours, its session's resume
    counted, the recovery leases deleted; returns the new execution ids."""
    now = now_ms()
    news = [uuid.uuid4().hex for _ in claims]
    conn.execute("BEGIN IMMEDIATE")
    taken = conn.executemany(
        _CONTRACT_TAKE_OVER,
        [
            (new, _RAW_RECOVERER, now, now + _LEASE_MS, e, now)
            for (_, e), new in zip(claims, news, strict=True)
        ],
    ).rowcount
    conn.execute(
        "UPDATE session SET wake_attempts = wake_attempts + 1, time_woken = NULL, wakes = 0"
        " WHERE id IN (SELECT value FROM json_each(?))",
        (json.dumps([s for s, _ in claims]),),
    )
    conn.execute(
        "DELETE FROM session_recovery WHERE owner_id = ?"
        " AND execution_id IN (SELECT value FROM json_each(?))",
        (_RAW_RECOVERER, json.dumps([e for _, e in claims])),
    )
    conn.execute("COMMIT")
    if taken != len(claims):
        raise RuntimeError(f"raw takeover took {taken} of {len(claims)}")
    return news


def _contract_release(conn: sqlite3.Connection, resumed: Sequence[tuple[str, str]]) -> None:
    """Transaction 3: the resumed claims (session, execution) released, fenced on our
    ownership, and their sessions' resume counts reset."""
    conn.execute("BEGIN IMMEDIATE")
    released = conn.execute(
        "DELETE FROM session_execution WHERE owner_id = ?"
        " AND id IN (SELECT value FROM json_each(?))",
        (_RAW_RECOVERER, json.dumps([e for _, e in resumed])),
    ).rowcount
    conn.execute(
        "UPDATE session SET wake_attempts = 0 WHERE id IN (SELECT value FROM json_each(?))",
        (json.dumps([s for s, _ in resumed]),),
    )
    conn.execute("COMMIT")
    if released != len(resumed):
        raise RuntimeError(f"raw release took {released} of {len(resumed)}")


def raw_contract_reclaim(path: Path, batch: int) -> tuple[float, int]:
    """The contract's writes per claim as raw SQL, no trio: `batch` claims per pass, each
    pass's three transactions in turn (seconds, claims reclaimed)."""
    reclaimed = 0
    with raw_db(path) as conn:
        started = time.perf_counter()
        while claims := _contract_lease(conn, batch):
            news = _contract_take_over(conn, claims)
            _contract_release(conn, [(s, new) for (s, _), new in zip(claims, news, strict=True)])
            reclaimed += len(claims)
        return time.perf_counter() - started, reclaimed


async def trio_floor_recovery(path: Path, batch: int) -> tuple[float, int]:
    """The recovery's trio floor: the contract's writes (`raw_contract_reclaim`'s SQL) on
    the trio thread, driven as a library would drive them - a task per resumed claim (a
    scope with its lease's deadline, one checkpoint as its no-op drain, a wait for its
    release) and the releases of one scheduler round in one transaction, whose waiters
    share one Event - and nothing else (no reads for decisions, no registry, group commit
    or observability): the least a library that recovers as the contract asks plausibly
    does."""
    pending: list[tuple[str, str]] = []
    rung = trio.Event()  # a claim waits for the next release round
    committed = trio.Event()  # the next release round's commit
    released = trio.Event()
    reclaimed = done = 0
    passes_over = False

    async def resumed(session_id: str, execution_id: str) -> None:
        with trio.CancelScope(deadline=trio.current_time() + _LEASE_MS / 1000):
            await trio.lowlevel.checkpoint()  # the no-op drain
        pending.append((session_id, execution_id))
        its_round = committed  # swapped with `pending`, no checkpoint between
        rung.set()
        await its_round.wait()

    async def release_rounds(conn: sqlite3.Connection) -> None:
        nonlocal rung, pending, committed, done
        while True:
            await rung.wait()
            rung = trio.Event()
            taken, pending = pending, []
            its_round, committed = committed, trio.Event()
            _contract_release(conn, taken)
            its_round.set()
            done += len(taken)
            if passes_over and done == reclaimed:
                released.set()

    with raw_db(path) as conn:
        started = time.perf_counter()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(release_rounds, conn)
            while claims := _contract_lease(conn, batch):
                news = _contract_take_over(conn, claims)
                for (session_id, _), new in zip(claims, news, strict=True):
                    nursery.start_soon(resumed, session_id, new)
                reclaimed += len(claims)
                await trio.lowlevel.checkpoint()  # the next pass, as recover_once yields
            passes_over = True
            if done < reclaimed:
                await released.wait()
            nursery.cancel_scope.cancel()
        return time.perf_counter() - started, reclaimed


@attrs.frozen
class Recovery:
    takeover: float  # seconds until every expired claim was taken over (passes done)
    total: float  # seconds until every resumed drain released its claim
    passes: int


@attrs.frozen
class RecoveryTarget:
    """Where a recovery measurement runs: the store, how to seed it (after the runtime's
    own first pass, so the timed passes find the rows) and how to count what is left."""

    store: StoreBackend
    seed: Callable[[int], None]  # n expired claims of 'dead', n live ones of 'alive'
    claims_left: Callable[[], int]  # claims not of owner 'alive'


async def library_recovery(target: RecoveryTarget, n: int, batch: int, *, hold: bool) -> Recovery:
    """Recover every expired claim to completion. `hold` keeps every resumed drain waiting
    until the passes are done, which splits the takeover from the drains and releases."""
    gate = trio.Event()
    if not hold:
        gate.set()

    async def drain(ctx: DrainContext) -> None:
        await gate.wait()

    async with open_runtime(
        target.store, drain, lease=QUIET, recovery_interval=QUIET, recovery_batch=batch
    ) as rt:
        await trio.to_thread.run_sync(target.seed, n)
        passes = resumed = 0
        started = time.perf_counter()
        while True:
            outcome = await rt.recover_once()
            passes += 1
            resumed += outcome.resumed
            if outcome.examined == 0:
                break
        takeover = time.perf_counter() - started
        gate.set()
        await wait_all_idle(rt)
        total = time.perf_counter() - started
    left = await trio.to_thread.run_sync(target.claims_left)
    if left or resumed != n:
        raise RuntimeError(f"recovery resumed {resumed} of {n} and left {left} claims")
    return Recovery(takeover, total, passes)


def sqlite_target(path: Path, *, inline: bool) -> RecoveryTarget:
    def seed(n: int) -> None:
        with raw_db(path) as conn:
            seed_claims(conn, "dead", ids("dead", n), now_ms() - 3_600_000)
            seed_claims(conn, "alive", ids("alive", n), now_ms() + 3_600_000)

    def claims_left() -> int:
        with raw_db(path) as conn:
            row = conn.execute(
                "SELECT COUNT(*) FROM session_execution WHERE owner_id != 'alive'"
            ).fetchone()
        return int(row[0])

    library_schema(path)
    return RecoveryTarget(SQLiteStore(path, inline=inline), seed, claims_left)


@attrs.frozen
class RecoveryTimes:
    """Seconds per variant over the measured rounds (plus 'takeover' from 'held'), each
    round's ratio raw / variant, and the passes a library recovery took."""

    secs: dict[str, list[float]]
    ratios: dict[str, list[float]]
    passes: int


async def recovery_rounds(
    variants: Sequence[str],
    rounds: int,
    n: int,
    batch: int,
    *,
    raw: Callable[[int], tuple[float, int]],
    target: Callable[[str, int], RecoveryTarget],
    baselines: Mapping[str, Callable[[int], Awaitable[tuple[float, int]]]] | None = None,
) -> RecoveryTimes:
    """`rounds` measured rounds after a warm-up, variants rotated: 'raw' is `raw(round_)`
    (seconds, claims reclaimed), a variant of `baselines` is measured the same way, any
    other recovers `target(variant, round_)`, 'held' with its drains held."""
    secs: dict[str, list[float]] = {}
    ratios: dict[str, list[float]] = {}
    passes = 0
    baselines = baselines or {}
    if clash := {"raw", "held", "takeover"} & baselines.keys():
        raise ValueError(f"baselines named as the built-in variants: {sorted(clash)}")
    for round_ in range(rounds + 1):
        seconds: dict[str, float] = {}
        for variant in rotate(list(variants), round_):
            baseline = baselines.get(variant)
            if variant == "raw" or baseline is not None:
                seconds[variant], reclaimed = (
                    raw(round_) if baseline is None else await baseline(round_)
                )
                if reclaimed != n:
                    raise RuntimeError(f"{variant} reclaim took {reclaimed} of {n}")
                continue
            where = target(variant, round_)
            done = await library_recovery(where, n, batch, hold=variant == "held")
            passes = done.passes
            seconds[variant] = done.total
            if variant == "held":
                seconds["takeover"] = done.takeover
        if round_ == 0:
            continue
        for variant, taken in seconds.items():
            secs.setdefault(variant, []).append(taken)
            ratios.setdefault(variant, []).append(seconds["raw"] / taken)
    return RecoveryTimes(secs, ratios, passes)


def add_recovery_rows(
    report: Report,
    section: str,
    n: int,
    batch: int,
    times: RecoveryTimes,
    rows: Sequence[tuple[str, str, float | None]],
    *,
    raw_work: str = "reclaim",
) -> None:
    """The raw baseline's row, then one per (variant, label, target ratio or None) against
    it, each judged against its own target."""
    raw = median(times.secs["raw"])
    report.add(
        section,
        f"raw batched {raw_work} of {n}, {batch}/tx (baseline)",
        f"{fmt_ms(raw)} ({fmt_us(raw / n)}/claim, {fmt_rate(n / raw)})",
    )
    for variant, label, target in rows:
        taken = median(times.secs[variant])
        report.add(
            section,
            label,
            f"{fmt_ms(taken)} ({fmt_us(taken / n)}/claim, {fmt_rate(n / taken)})",
            fmt_rate(n / raw),
            fmt_ratio(times.ratios[variant]),
            "" if target is None else f">= {target}x",
            "" if target is None else verdict(median(times.ratios[variant]) >= target),
        )


async def bench_recovery(config: Config, folder: Path, report: Report) -> None:
    n, batch = config.recovery, config.recovery_batch
    progress(
        f"recovery: {n} expired claims, passes of {batch}, "
        f"{config.recovery_rounds} rounds + warm-up"
    )

    def path(variant: str, round_: int) -> Path:
        return folder / f"recovery-{variant}-{round_}.db"

    def raw(round_: int) -> tuple[float, int]:
        seed_recovery(path("raw", round_), n)
        return raw_reclaim(path("raw", round_), batch)

    def target(variant: str, round_: int) -> RecoveryTarget:
        return sqlite_target(path(variant, round_), inline=variant == "inline")

    async def contract(round_: int) -> tuple[float, int]:
        seed_recovery(path("contract", round_), n)
        return raw_contract_reclaim(path("contract", round_), batch)

    async def floor(round_: int) -> tuple[float, int]:
        seed_recovery(path("floor", round_), n)
        return await trio_floor_recovery(path("floor", round_), batch)

    times = await recovery_rounds(
        ["raw", "contract", "floor", "threaded", "inline", "held"],
        config.recovery_rounds,
        n,
        batch,
        raw=raw,
        target=target,
        baselines={"contract": contract, "floor": floor},
    )
    passes = times.passes
    rows = (
        ("contract", "raw SQL, the contract's writes per claim (no trio)", None),
        ("floor", "trio floor: those writes from trio, a task per claim", None),
        ("threaded", f"default store: {n} to completion, {passes} passes", 0.5),
        ("inline", f"inline store: {n} to completion, {passes} passes", 0.5),
        ("takeover", "default store, drains held: takeover only", None),
        ("held", "default store, drains held: to completion", None),
    )
    add_recovery_rows(report, "recovery", n, batch, times, rows, raw_work="takeover + release")
    report.machine["recovery_ratio"] = median(times.ratios["threaded"])
    report.machine["recovery_floor_ratio"] = median(times.ratios["floor"])
    report.machine["raw_recovery_us"] = median(times.secs["raw"]) / n * 1e6
    report.notes.append(
        f"recovery: {n} live claims of another owner are present too (as in the baseline). "
        "The library takes each expired claim over, runs its no-op drain and releases it; "
        "the raw baseline does the same two writes per claim, 100 per transaction (the "
        "takeover, then the release). The contract's writes (DESIGN §5) are six per claim "
        "in three transactions per pass of 100: a recovery lease in; the takeover with a "
        "new execution, the resume count and the lease out; the release and the count "
        "reset. 'raw SQL' runs them alone; the trio floor runs them on the trio thread with "
        "a task per resumed claim (a scope, a checkpoint, a wait for its release, the "
        "releases of one scheduler round in one transaction) and nothing else: no library "
        "doing recovery as the contract asks beats it. 'drains held' keeps every resumed "
        "drain waiting until the passes are done ('takeover only' is half the baseline's "
        "work; its passes also exclude the growing set of local sessions)."
    )
