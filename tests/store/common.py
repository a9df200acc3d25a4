"""What the store tests share: `Db` (the sync engine at a hand-moved clock, with the rows
the tests look at), a busy claim, the fenced writes and the ways a fence refuses."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
from backends import EngineDb, finish_iteration

from trio_sessions import AssistantData, ToolPart, _codec, _sqlite, _store, _transcript
from trio_sessions._decisions import AcquireVerdict
from trio_sessions._store.recovery_scan import scan_and_lease

NOW = 1_800_000_000_000
LEASE = 30_000
ME = "recoverer"


@attrs.define(eq=False)
class Db(EngineDb):
    """The store at a fixed instant (`now`, integer ms) that tests move by hand."""

    def snapshot(self, tables: Any = _sqlite.OUR_TABLES) -> dict[str, list[tuple[Any, ...]]]:
        return super().snapshot(tables)

    @property
    def conn(self) -> sqlite3.Connection:
        """The SQLite connection (tests of an SQLite-only seam)."""
        return self.sqlite_conn

    @property
    def path(self) -> Path:
        assert isinstance(self.location, Path)
        return self.location

    def claim(
        self, session_id: str = "s", owner: str = "owner-a", execution: str = "exec-1"
    ) -> str:
        self.run(_store.wake, session_id)
        acquired = self.run(_store.acquire, session_id, execution, owner, LEASE)
        assert acquired.verdict is AcquireVerdict.CLAIM
        return execution

    def claim_row(self, session_id: str = "s") -> tuple[Any, ...] | None:
        found = self.rows(
            "SELECT id, owner_id, phase, anchor_seq, time_created, heartbeat_at, expires_at"
            " FROM session_execution WHERE session_id = ?",
            (session_id,),
        )
        return found[0] if found else None

    def doorbell(self, session_id: str = "s") -> tuple[Any, ...]:
        """(time_woken, wakes, wake_attempts)"""
        [row] = self.rows(
            "SELECT time_woken, wakes, wake_attempts FROM session WHERE id = ?", (session_id,)
        )
        return row

    def message(self, message_id: str) -> AssistantData:
        [(text,)] = self.rows("SELECT data FROM session_message WHERE id = ?", (message_id,))
        return _codec.decode_assistant(text, key=message_id)

    def put_message(
        self,
        message_id: str,
        execution_id: str | None,
        seq: int,
        data: str,
        role: str = "assistant",
    ) -> None:
        self.write(
            "INSERT INTO session_message(id, session_id, execution_id, role, seq, data,"
            " time_created, time_updated) VALUES (?, 's', ?, ?, ?, ?, 0, 0)",
            (message_id, execution_id, role, seq, data),
        )

    def expire(self, session_id: str = "s") -> None:
        """Move the clock to the claim's expiry instant: the lease is no longer live."""
        row = self.claim_row(session_id)
        assert row is not None
        self.now = row[6]


NOW = 1_800_000_000_000


LEASE = 30_000


ME = "recoverer"


def busy_claim(db: Db) -> str:
    """A live claim of owner-a on session 's' with a pending input, a taken input, an open
    assistant message (one running tool, one completed tool, text) and a set doorbell."""
    db.run(_store.submit, "s", '{"n": 1}', "in-taken")
    execution = db.claim()
    db.run(_store.take_inputs, "s", execution, "owner-a")
    db.run(_store.begin_assistant, "s", execution, "owner-a", "m-1")

    def build(data: AssistantData) -> AssistantData:
        data = _transcript.append_text(data, "thinking")
        data = _transcript.start_tool(data, "running", "search", {"q": 1})
        data = _transcript.start_tool(data, "done", "search", {"q": 2})
        return _transcript.settle_tool(data, "done", output=[1, 2])

    db.run(_store.update_assistant, "s", execution, "owner-a", "m-1", build)
    db.run(_store.submit, "s", '{"n": 2}', "in-pending")
    return execution


def tools(data: AssistantData) -> dict[str, tuple[str, str | None]]:
    return {p.call_id: (p.status, p.error) for p in data.parts if isinstance(p, ToolPart)}


REFUSALS = ["wrong_owner", "wrong_execution", "expired", "expired_long_ago"]


# Each fenced drain write as (db, execution, owner), in session "s" unless `s=` names another.
FENCED: dict[str, Callable[..., Any]] = {
    "finish_iteration": lambda db, e, o, s="s": db.run(finish_iteration, s, e, o),
    "finish_failed": lambda db, e, o, s="s": db.run(_store.finish_failed, s, e, o, "failed"),
    "mark_cancelling": lambda db, e, o, s="s": db.run(_store.mark_cancelling, s, e, o),
    "finish_interrupted": lambda db, e, o, s="s": db.run(_store.finish_interrupted, s, e, o),
    "take_inputs": lambda db, e, o, s="s": db.run(_store.take_inputs, s, e, o),
    "begin_assistant": lambda db, e, o, s="s": db.run(_store.begin_assistant, s, e, o, "m-new"),
    "update_assistant": lambda db, e, o, s="s": db.run(
        _store.update_assistant, s, e, o, "m-1", lambda d: _transcript.append_text(d, "x")
    ),
}


def refuse(db: Db, how: str, execution: str) -> tuple[str, str]:
    if how == "wrong_owner":
        return execution, "owner-b"
    if how == "wrong_execution":
        return "exec-other", "owner-a"
    db.expire()
    if how == "expired_long_ago":
        db.now += 3_600_000
    return execution, "owner-a"


def expired_claim(db: Db, session_id: str, expires_at: int, owner: str = "dead") -> str:
    execution = db.claim(session_id, owner=owner, execution="exec-" + session_id)
    db.write("UPDATE session_execution SET expires_at = ? WHERE id = ?", (expires_at, execution))
    return execution


def woken_at(db: Db, session_id: str, at: int) -> None:
    now, db.now = db.now, at
    db.run(_store.wake, session_id)
    db.now = now


def put_recovery(
    db: Db,
    execution: str,
    owner: str,
    expires_at: int,
    error: str | None = None,
    *,
    session_id: str | None = None,
) -> None:
    """A session_recovery row; its session defaults to the one `expired_claim` named."""
    session_id = session_id or execution.removeprefix("exec-")
    db.write(
        "INSERT INTO session_recovery(execution_id, session_id, owner_id, expires_at,"
        " recovery_error, time_created, time_quarantined) VALUES (?, ?, ?, ?, ?, 0, ?)",
        (execution, session_id, owner, expires_at, error, None if error is None else 0),
    )


def names(candidates: list[_store.Candidate]) -> list[tuple[str, str | None]]:
    return [(c.session_id, c.execution_id) for c in candidates]


def lease(db: Db, *candidates: _store.Candidate, owner: str = ME) -> list[_store.Candidate]:
    """A recovery pass's scan and leases now (`scan_and_lease`, as the runtime takes them):
    the expired claims it leased, which must be exactly `candidates` (in any order)."""
    leased: list[_store.Candidate] = db.run(scan_and_lease, owner, 1000, [], [], LEASE)[2]
    assert sorted(names(leased)) == sorted(names(list(candidates))), leased
    return leased


def recover(db: Db, execution: str, *, max_resumes: int = 10, take: bool = True) -> Any:
    candidate = _store.Candidate("s", execution)
    if take:
        lease(db, candidate)
    return db.run(_store.apply_recovery, ME, candidate, "exec-new", LEASE, max_resumes)
