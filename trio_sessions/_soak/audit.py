"""The PostgreSQL soak's audit: overlapping drains, and writes from fenced-out owners.

**Overlaps** (DESIGN §6.17). A drain's *effects* are what a lease exists to make exclusive:
the work it does outside the database. The soak's drain performs each effect as an async
call does - a checkpoint first, then the effect - and logs it with `time.monotonic()`
(CLOCK_MONOTONIC, one clock for every process on the host, untouched by the skewed wall
clocks) to a per-worker file with `os.write` (it survives the process being SIGKILLed, and
needs no database, so no fault of the worker's path can lose it). An execution's span runs
from its first effect to its last; two executions of one session whose spans intersect are
an overlap. (A drain stuck inside a store call it cannot abandon is not running code; it
counts again only if it performs an effect afterwards, which self-fencing must prevent.) A
busy step's blocking call (`common`) is running code: it logs its effect itself, from its
thread, when it lands - after the drain was cancelled, if it was; so a takeover that did
not wait for it to land (no takeover grace, or an owner ignoring its lost token) shows as
an overlap. And an execution's span begins when its claim is handed to the worker (the
acquisition hook logs a `claim` effect, after the commit), not at its drain's first effect:
the lease is exclusive from its commit, so an old drain still acting after another
execution's claim committed overlaps it even before the new drain acted (as an owner
ignoring its lost token does until the takeover's signal reaches it).

**Zombie writes** (DESIGN §6.13, §6.4). Triggers that the soak installs in its own schema
(never part of the library) log every write to `session_message` and every change of claim
identity in `session_execution` (insert, delete, the takeover's change of `id`) into
`soak_write`, with the writing transaction's id. Each logged write first bumps a per-session
counter row (`soak_write_order`), whose row lock is held to COMMIT: so the counter values of
one session's writers follow their commit order, exactly. (The library writes these rows
only under its session lock, so for the correct library this lock never waits; for a
broken copy it orders writes without closing the race between a fence read and the write.)
A write of execution E's messages that commits, in that order, after the transaction that
ended or replaced E's claim - or before any claim E existed - is a zombie write. Claim
renewals are checked on their own row: a heartbeat whose update extends a lease that had
already expired at the statement's `now` (`OLD.expires_at <= NEW.heartbeat_at`) revived it,
and is counted as a zombie write too. Commits in doubt need no special case: the log rows are
part of the transaction, so they exist exactly when it committed.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import attrs

TRIGGERS = """
CREATE TABLE soak_write_order(session_id TEXT PRIMARY KEY, n BIGINT NOT NULL);
CREATE TABLE soak_write(
    id BIGSERIAL PRIMARY KEY,
    session_id TEXT NOT NULL,
    n BIGINT,
    txid TEXT NOT NULL,
    kind TEXT NOT NULL,
    execution_id TEXT,
    new_execution_id TEXT
);
CREATE FUNCTION soak_log_write() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    sid TEXT;
    k BIGINT;
    old_id TEXT;
    new_id TEXT;
BEGIN
    IF TG_OP = 'DELETE' THEN sid := OLD.session_id; ELSE sid := NEW.session_id; END IF;
    IF TG_TABLE_NAME = 'session_message' THEN
        IF TG_OP = 'DELETE' THEN old_id := OLD.execution_id; ELSE old_id := NEW.execution_id;
        END IF;
    ELSE
        IF TG_OP <> 'INSERT' THEN old_id := OLD.id; END IF;
        IF TG_OP <> 'DELETE' THEN new_id := NEW.id; END IF;
    END IF;
    INSERT INTO soak_write_order AS o(session_id, n) VALUES (sid, 1)
        ON CONFLICT (session_id) DO UPDATE SET n = o.n + 1 RETURNING o.n INTO k;
    INSERT INTO soak_write(session_id, n, txid, kind, execution_id, new_execution_id)
        VALUES (sid, k, pg_current_xact_id()::text,
                lower(TG_TABLE_NAME || ' ' || TG_OP), old_id, new_id);
    RETURN NULL;
END $$;
CREATE FUNCTION soak_log_revival() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO soak_write(session_id, txid, kind, execution_id)
        VALUES (NEW.session_id, pg_current_xact_id()::text, 'revival', NEW.id);
    RETURN NULL;
END $$;
CREATE TRIGGER soak_message_write AFTER INSERT OR UPDATE OR DELETE ON session_message
    FOR EACH ROW EXECUTE FUNCTION soak_log_write();
CREATE TRIGGER soak_claim_identity AFTER INSERT OR DELETE ON session_execution
    FOR EACH ROW EXECUTE FUNCTION soak_log_write();
CREATE TRIGGER soak_claim_takeover AFTER UPDATE ON session_execution
    FOR EACH ROW WHEN (OLD.id IS DISTINCT FROM NEW.id) EXECUTE FUNCTION soak_log_write();
CREATE TRIGGER soak_claim_revival AFTER UPDATE ON session_execution
    FOR EACH ROW WHEN (OLD.id = NEW.id AND NEW.expires_at > OLD.expires_at
                       AND OLD.expires_at <= NEW.heartbeat_at)
    EXECUTE FUNCTION soak_log_revival();
"""

WRITES_SQL = (
    "SELECT session_id, n, txid, kind, execution_id, new_execution_id FROM soak_write"
    " ORDER BY session_id, n NULLS FIRST, id"
)


@attrs.frozen
class Write:
    """One row of `soak_write`."""

    session_id: str
    n: int | None
    txid: str
    kind: str
    execution_id: str | None
    new_execution_id: str | None = None


def zombie_writes(writes: Iterable[Write]) -> list[Write]:
    """The writes that landed for an execution whose claim was not live in commit order
    (see the module docstring), and every lease revival."""
    zombies: list[Write] = []
    by_session: dict[str, list[Write]] = {}
    for write in writes:
        if write.kind == "revival":
            zombies.append(write)
        else:
            by_session.setdefault(write.session_id, []).append(write)
    for session_writes in by_session.values():
        session_writes.sort(key=lambda write: write.n or 0)
        claimed: set[str] = set()
        ended: dict[str, str] = {}  # execution id -> txid of the transaction that ended it
        for write in session_writes:
            if write.kind.startswith("session_execution"):
                if write.execution_id is not None:
                    ended[write.execution_id] = write.txid
                if write.new_execution_id is not None:
                    claimed.add(write.new_execution_id)
                continue
            execution = write.execution_id
            if execution is None:
                continue  # not a drain's write (none in the soak)
            if execution not in claimed or ended.get(execution, write.txid) != write.txid:
                zombies.append(write)
    return zombies


# ---------------------------------------------------------------------------------------------
# Effects


@attrs.frozen
class Effect:
    """One line of a worker's effect log."""

    # claim (the claim handoff: no drain yet) | enter | take | work | block (a busy step's
    # blocking call) - the effects - | exit (not an effect: carries the status)
    kind: str
    drain: str
    worker: str
    session_id: str
    execution_id: str
    t: float
    numbers: tuple[int, ...] = ()
    status: str | None = None


# The drain of a `claim` effect: logged before any drain iteration of the claim ran.
CLAIM_DRAIN = "claim"


def effect_line(effect: Effect) -> bytes:
    return (json.dumps(attrs.asdict(effect)) + "\n").encode()


def read_effects(paths: Iterable[Path]) -> list[Effect]:
    effects = []
    for path in paths:
        for line in path.read_text().splitlines():
            if line.endswith("}"):  # a line cut short by SIGKILL is no effect (never ended)
                fields: dict[str, Any] = json.loads(line)
                fields["numbers"] = tuple(fields["numbers"])
                effects.append(Effect(**fields))
    return effects


def overlaps(effects: Sequence[Effect]) -> list[str]:
    """Executions of one session whose effect spans intersect, described."""
    spans: dict[str, tuple[str, float, float]] = {}
    for effect in effects:
        if effect.kind == "exit":
            continue
        session_id, start, end = spans.get(effect.execution_id, (effect.session_id, effect.t, 0))
        spans[effect.execution_id] = (session_id, min(start, effect.t), max(end, effect.t))
    by_session: dict[str, list[tuple[float, float, str]]] = {}
    for execution_id, (session_id, start, end) in spans.items():
        by_session.setdefault(session_id, []).append((start, end, execution_id))
    found = []
    for session_id, session_spans in sorted(by_session.items()):
        session_spans.sort()
        latest_end, latest_id = float("-inf"), ""
        for start, end, execution_id in session_spans:
            if start <= latest_end:
                found.append(
                    f"{session_id}: {execution_id} acted at {start:.3f} while {latest_id}"
                    f" acted until {latest_end:.3f}"
                )
            if end > latest_end:
                latest_end, latest_id = end, execution_id
    return found


@attrs.frozen
class Repeats:
    """Inputs a drain took up again after an earlier drain had started on them."""

    after_kill: int
    after_cancel: int
    after_failure: int
    unexpected: int


def repeats(effects: Sequence[Effect], killed_workers: set[str]) -> Repeats:
    """Repeats are allowed only after the earlier drain was killed (its process SIGKILLed
    before it logged its exit), cancelled (interrupted, lease lost, self-fenced) or failed
    (a `StoreError` past the store's bound): its answer never landed, and the session's next
    drain owes it (DESIGN §4)."""
    exits = {effect.drain: effect.status for effect in effects if effect.kind == "exit"}
    takes: dict[int, list[Effect]] = {}
    for effect in sorted(effects, key=lambda effect: effect.t):
        if effect.kind == "take":
            for n in effect.numbers:
                takes.setdefault(n, []).append(effect)
    after_kill = after_cancel = after_failure = unexpected = 0
    for drains in takes.values():
        for earlier in drains[:-1]:
            status = exits.get(earlier.drain)
            if status is None and earlier.worker in killed_workers:
                after_kill += 1
            elif status in ("cancelled", "lease_lost"):
                after_cancel += 1
            elif status == "failed":
                after_failure += 1
            else:
                unexpected += 1
    return Repeats(after_kill, after_cancel, after_failure, unexpected)


def takeover_seconds(
    kills: dict[str, float], spans: Iterable[tuple[str, str, str, float, bool]]
) -> list[float]:
    """Per drain a SIGKILL cut short - (session, execution, worker, start, exited) with its
    worker in `kills` (worker -> kill time) and no exit - the seconds from the kill to the
    first other execution of that session starting after it: how long a dead owner's
    session waited (about the takeover grace with owner liveness, not the lease)."""
    by_session: dict[str, list[tuple[float, str]]] = {}
    cut: dict[str, tuple[str, float]] = {}
    for session_id, execution_id, worker, start, exited in spans:
        by_session.setdefault(session_id, []).append((start, execution_id))
        if not exited and worker in kills:
            cut[execution_id] = (session_id, kills[worker])
    waits = []
    for execution_id, (session_id, killed) in cut.items():
        later = [
            start
            for start, other in by_session[session_id]
            if other != execution_id and start >= killed
        ]
        if later:
            waits.append(min(later) - killed)
    return sorted(waits)


def takeover_summary(waits: Sequence[float]) -> str:
    """The soak's takeover line: how many, p50 and max in ms."""
    if not waits:
        return "takeovers=0"
    p50 = waits[len(waits) // 2] * 1000
    every = ",".join(f"{wait * 1000:.0f}" for wait in waits)
    return (
        f"takeovers={len(waits)} takeover_p50_ms={p50:.0f}"
        f" takeover_max_ms={waits[-1] * 1000:.0f} (each, ms: {every})"
    )
