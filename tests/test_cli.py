"""The operator CLI (`python -m trio_sessions`) against a seeded database.

The database is seeded through the store's own operations at chosen instants, so every state
an operator meets is present: an idle session, a doorbell with pending inputs, a live claim,
an expired claim of a dead owner and a quarantined execution.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import backends
import pytest
import trio
from backends import PgLocation, finish_iteration
from conftest import query
from console_process import seed_quarantine

import trio_sessions
from trio_sessions import _cli, _sqlite, _store
from trio_sessions._decisions import RecoveryDecision
from trio_sessions._store.recovery_scan import scan_and_lease

LIVE_LEASE_MS = 600_000
DEAD_FOR = 100  # the dead owner took its claims this many seconds ago, with a 10 s lease
MALFORMED = '{"parts": [], "finished": "no", "error": null}'


def _op(conn: sqlite3.Connection, at: float, op: Any, *args: Any) -> Any:
    return _sqlite.run_op(conn, lambda: at, op, *args)


# Seeding runs store operations at chosen instants (`Op`) plus an operator's raw statement
# (`Execute`), so one seed serves the SQLite file and the PostgreSQL schema.
Op = Callable[..., Any]  # op(at, store_operation, *args)
Execute = Callable[[str, tuple[Any, ...]], None]


def _seed_quarantined(op: Op, execute: Execute, now: float) -> None:
    """A dead owner's expired claim whose assistant message no longer decodes, with an
    untaken input and no doorbell (taken by the owner's last finish), quarantined."""
    dead_at = now - DEAD_FOR
    op(dead_at, _store.submit, "poison", '{"text": "first"}', "in-poison-1")
    op(dead_at, _store.acquire, "poison", "exec-poison", "owner-dead", 10_000)
    op(dead_at, _store.take_inputs, "poison", "exec-poison", "owner-dead")
    op(dead_at, _store.begin_assistant, "poison", "exec-poison", "owner-dead", "msg-poison")
    op(dead_at, _store.submit, "poison", '{"text": "second"}', "in-poison-2")
    execute("UPDATE session SET time_woken = NULL, wakes = 0 WHERE id = 'poison'", ())
    execute("UPDATE session_message SET data = ? WHERE id = 'msg-poison'", (MALFORMED,))
    candidate = _store.Candidate("poison", "exec-poison")
    _, _, leased, _ = op(now, scan_and_lease, "owner-rec", 10, [], [], 30_000)
    assert leased == [candidate]
    result = op(now, _store.apply_recovery, "owner-rec", candidate, "new", 30_000, 10)
    assert result.decision is RecoveryDecision.QUARANTINE


def seed_operations(op: Op, execute: Execute) -> None:
    """Seed relative to the wall clock now: the CLI reads leases against the wall clock (or
    the PostgreSQL server's, on this same host)."""
    now = time.time()
    dead_at = now - DEAD_FOR
    op(now - 50, _store.submit, "idle", '{"text": "hi"}', "in-idle")
    op(now - 50, _store.acquire, "idle", "exec-idle", "owner-a", 60_000)
    op(now - 50, _store.take_inputs, "idle", "exec-idle", "owner-a")
    op(now - 50, finish_iteration, "idle", "exec-idle", "owner-a")
    op(now - 5, _store.submit, "pending", '{"text": "1"}', "in-pending-1")
    op(now - 4, _store.submit, "pending", '{"text": "2"}', "in-pending-2")
    op(now - 3, _store.submit, "live", '{"text": "go"}', "in-live")
    op(now - 3, _store.acquire, "live", "exec-live", "owner-live", LIVE_LEASE_MS)
    op(now - 2, _store.heartbeat, "owner-live", ["exec-live"], LIVE_LEASE_MS)
    _seed_quarantined(op, execute, now)  # its recovery pass finds no other expired claim
    op(dead_at, _store.submit, "expired", '{"text": "x"}', "in-expired")
    op(dead_at, _store.acquire, "expired", "exec-expired", "owner-dead", 10_000)


def seed(path: Path) -> None:
    conn = _sqlite.connect(path)

    def execute(sql: str, params: tuple[Any, ...]) -> None:
        conn.execute(sql, params)

    try:
        seed_operations(lambda at, op, *args: _op(conn, at, op, *args), execute)
    finally:
        conn.close()


def seed_postgres(location: PgLocation) -> None:
    from trio_sessions import _postgres

    engine = _postgres.PostgresStore(location.url, schema=location.schema).engine()
    engine.open()

    def op(at: float, operation: Any, *args: Any) -> Any:
        engine.clock = lambda: at
        return _postgres.run_op(engine, operation, *args)

    try:
        seed_operations(op, lambda sql, params: backends.write(location, sql, params))
    finally:
        engine.close()


@pytest.fixture
def seeded(tmp_path: Path) -> Path:
    path = tmp_path / "seeded.db"
    seed(path)
    return path


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = _cli.main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def cli_json(capsys: pytest.CaptureFixture[str], *argv: str) -> Any:
    code, out, err = cli(capsys, *argv, "--json")
    assert code == 0, err
    return json.loads(out)


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---------------------------------------------------------------------------------------------
# status


def test_status_json_reports_claims_leases_doorbells_and_inputs(
    seeded: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`status --json` gives each session's claim, lease, heartbeat, doorbell and inputs."""
    status = cli_json(capsys, "status", str(seeded))
    sessions = {s["id"]: s for s in status["sessions"]}
    assert sorted(sessions) == ["expired", "idle", "live", "pending", "poison"]
    assert sessions["idle"]["claim"] is None
    assert sessions["idle"]["doorbell"] is None
    assert sessions["pending"]["pending_inputs"] == 2
    assert sessions["pending"]["doorbell"]["wakes"] == 2
    live = sessions["live"]["claim"]
    assert live["owner_id"] == "owner-live"
    assert live["phase"] == "running"
    assert not live["expired"]
    assert 500 < live["lease_remaining_s"] <= 600
    assert 1.5 < live["heartbeat_age_s"] < 60
    expired = sessions["expired"]["claim"]
    assert expired["expired"]
    assert 80 < expired["expired_since_s"] < 200
    assert expired["heartbeat_age_s"] is None
    assert not expired["quarantined"]
    assert sessions["poison"]["claim"]["quarantined"]
    assert status["summary"] == {
        **{"sessions": 5, "claims": 3, "live_claims": 1, "expired_claims": 1},
        **{"quarantined": 1, "doorbells": 1, "pending_inputs": 5},
    }


def test_status_text_is_a_readable_table(seeded: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The text listing shows owners, lease remaining or expired since, heartbeat age."""
    code, out, _ = cli(capsys, "status", str(seeded))
    assert code == 0
    lines = {line.split()[0]: line for line in out.splitlines()[3:]}
    assert "owner-live" in lines["live"]
    assert "s left" in lines["live"]
    assert "s ago" in lines["live"].split("left", 1)[1]  # heartbeat age
    assert "expired" in lines["expired"]
    assert "never" in lines["expired"]
    assert "QUARANTINED" in lines["poison"]
    assert "set" in lines["pending"]
    assert "(2 wakes)" in lines["pending"]
    assert "idle" in lines["idle"]
    assert out.startswith("5 sessions; claims: 1 live, 1 expired, 1 quarantined")


def test_listings_show_a_row_with_no_number_where_one_belongs_as_malformed(
    seeded: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """SQLite keeps whatever another tool writes in any column. `status` and `quarantine
    list` show a row with no whole number in an INTEGER column, or no UTF-8 text in a TEXT
    one, as malformed, saying which column holds what, and list every other row as before
    (text and JSON). Before, one text time failed the whole listing with a TypeError, a
    text that is not UTF-8 with the driver's decode error, and a BLOB the JSON output."""
    raw = sqlite3.connect(seeded)
    with raw:
        raw.execute(
            "UPDATE session SET time_woken = 'yesterday', wakes = X'FF' WHERE id = 'pending'"
        )
        raw.execute("UPDATE session_execution SET expires_at = 'soon' WHERE id = 'exec-live'")
        raw.execute("UPDATE session_recovery SET time_quarantined = 'then'")
        raw.execute(
            "UPDATE session_execution SET owner_id = CAST(X'6FFF' AS TEXT), expires_at = 1000.5"
            " WHERE id = 'exec-expired'"
        )
        raw.execute("UPDATE session_recovery SET recovery_error = X'626164'")
    raw.close()
    status = cli_json(capsys, "status", str(seeded))
    sessions = {session["id"]: session for session in status["sessions"]}
    assert sorted(sessions) == ["expired", "idle", "live", "pending", "poison"]
    assert sessions["pending"]["malformed"] == [
        "session.time_woken is 'yesterday', not a whole number",
        "session.wakes is '\ufffd', not a whole number",
    ]
    assert sessions["pending"]["doorbell"] == {"time_woken": None, "wakes": None, "age_s": None}
    assert sessions["live"]["malformed"] == [
        "session_execution.expires_at is 'soon', not a whole number"
    ]
    assert sessions["live"]["claim"]["expired"] is False  # what the store does with it
    assert sessions["expired"]["malformed"] == [
        "session_execution.owner_id is not UTF-8 text (X'6FFF')",
        "session_execution.expires_at is 1000.5, not a whole number",
    ]
    assert sessions["expired"]["claim"]["expired"] is True  # recovery takes it, as a number
    assert sessions["expired"]["claim"]["owner_id"] == "o\ufffd"
    assert sessions["idle"]["malformed"] == []
    code, out, _ = cli(capsys, "status", str(seeded))
    assert code == 0
    lines = {line.split()[0]: line for line in out.splitlines()[3:]}
    assert "MALFORMED: session.time_woken is 'yesterday'" in lines["pending"]
    assert "MALFORMED: session_execution.expires_at is 'soon'" in lines["live"]
    assert "MALFORMED" not in lines["idle"]
    [row] = cli_json(capsys, "quarantine", "list", str(seeded))
    assert row["execution_id"] == "exec-poison"
    assert row["quarantined_for_s"] is None
    assert row["recovery_error"] == "bad"
    assert row["malformed"] == [
        "session_recovery.recovery_error is not UTF-8 text (X'626164')",
        "session_recovery.time_quarantined is 'then', not a whole number",
    ]
    code, out, _ = cli(capsys, "quarantine", "list", str(seeded))
    assert code == 0
    assert "  quarantined ? by owner-rec" in out
    assert "  MALFORMED: session_recovery.time_quarantined is 'then'" in out


def test_a_time_that_is_no_whole_number_is_shown_null_as_every_malformed_time(
    seeded: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """README: a malformed row is listed "its times `null`". A REAL time (another tool's
    12.5; SQLite only: PostgreSQL's columns hold integers) was said malformed yet used: a
    doorbell "set 1796574351.6s ago", a lease 1000.5 ms after the epoch expired "since"
    56 years. Found by an audit. Only `expired` still follows the number, as recovery does."""
    raw = sqlite3.connect(seeded)
    with raw:
        raw.execute("UPDATE session SET time_woken = 12.5, wakes = 2.5 WHERE id = 'pending'")
        raw.execute("UPDATE session_execution SET expires_at = 1000.5 WHERE id = 'exec-expired'")
        raw.execute("UPDATE session_recovery SET time_quarantined = 7.5")
        raw.execute("UPDATE session SET time_paused = 3.5 WHERE id = 'idle'")
    raw.close()
    sessions = {s["id"]: s for s in cli_json(capsys, "status", str(seeded))["sessions"]}
    assert sessions["pending"]["malformed"] == [
        "session.time_woken is 12.5, not a whole number",
        "session.wakes is 2.5, not a whole number",
    ]
    assert sessions["pending"]["doorbell"] == {"time_woken": None, "wakes": None, "age_s": None}
    # Paused as the store sees it (time_paused IS NOT NULL), with no time to show.
    assert (sessions["idle"]["paused"], sessions["idle"]["paused_since"]) == (True, None)
    claim = sessions["expired"]["claim"]
    assert (claim["expires_at"], claim["expired_since_s"], claim["lease_remaining_s"]) == (
        None,
        None,
        None,
    )
    assert claim["expired"] is True
    code, out, _ = cli(capsys, "status", str(seeded))
    assert code == 0
    lines = {line.split()[0]: line for line in out.splitlines()[3:]}
    assert "set ? ago" not in lines["pending"] and "set ? (? wakes)" in lines["pending"]
    assert "expired ?" in lines["expired"]
    [row] = cli_json(capsys, "quarantine", "list", str(seeded))
    assert (row["time_quarantined"], row["quarantined_for_s"]) == (None, None)
    assert row["malformed"] == ["session_recovery.time_quarantined is 7.5, not a whole number"]


def test_listings_do_not_modify_the_database(
    seeded: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """status and quarantine list only read: the file is byte-for-byte unchanged."""
    before = digest(seeded)
    for argv in (["status"], ["quarantine", "list"]):
        for extra in ([], ["--json"]):
            assert cli(capsys, *argv, str(seeded), *extra)[0] == 0
    assert digest(seeded) == before
    assert sorted(p.name for p in seeded.parent.iterdir()) == ["seeded.db"]


@pytest.mark.parametrize(
    ("state", "expected"),
    [
        ("idle", ["idle"]),
        ("woken", ["pending"]),
        ("active", ["live"]),
        ("expired", ["expired"]),
        ("quarantined", ["poison"]),
        ("paused", []),
    ],
)
def test_status_state_filter_keeps_only_sessions_in_that_state(
    seeded: Path, capsys: pytest.CaptureFixture[str], state: str, expected: list[str]
) -> None:
    """`--state` lists the matching sessions; the summary still counts the whole database."""
    status = cli_json(capsys, "status", str(seeded), "--state", state)
    assert [s["id"] for s in status["sessions"]] == expected
    assert status["matched"] == len(expected)
    assert status["summary"]["sessions"] == 5
    code, out, _ = cli(capsys, "status", str(seeded), "--state", state)
    assert code == 0
    assert f"showing {len(expected)} of {len(expected)} matching sessions" in out
    assert [line.split()[0] for line in out.splitlines()[4:]] == expected


def test_status_session_filter_and_limit(seeded: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--session` (repeatable) picks sessions by id; `--limit` keeps the first N in id order
    and `matched` says how many there were before it."""
    picked = cli_json(capsys, "status", str(seeded), "--session", "live", "--session", "idle")
    assert [s["id"] for s in picked["sessions"]] == ["idle", "live"]
    assert picked["sessions"][1]["claim"]["owner_id"] == "owner-live"
    limited = cli_json(capsys, "status", str(seeded), "--limit", "2")
    assert [s["id"] for s in limited["sessions"]] == ["expired", "idle"]
    assert limited["matched"] == 5
    both = cli_json(capsys, "status", str(seeded), "--state", "expired", "--session", "idle")
    assert (both["sessions"], both["matched"]) == ([], 0)
    code, out, _ = cli(capsys, "status", str(seeded), "--session", "nobody")
    assert code == 0
    assert out.splitlines()[1:] == ["showing 0 of 0 matching sessions"]


@pytest.mark.parametrize(
    ("command", "flags"),
    [
        (["status"], ["--limit", "0"]),
        (["status"], ["--limit", "x"]),
        (["status"], ["--state", "busy"]),
        (["status"], ["--session", ""]),
        (["status"], ["--session", "a\nb"]),
        (["quarantine", "list"], ["--session", ""]),
        (["inputs", "list"], ["--session", "a\x00b"]),
    ],
)
def test_listings_refuse_bad_filters_as_usage_errors(
    seeded: Path, capsys: pytest.CaptureFixture[str], command: list[str], flags: list[str]
) -> None:
    """A non-positive limit, an unknown state or a session id no session can have (empty,
    not printable: the API refuses it, and the README says so) is a usage error (exit 2).
    The listings took such an id and answered that nothing matched."""
    with pytest.raises(SystemExit) as exit_info:
        _cli.main([*command, str(seeded), *flags])
    assert exit_info.value.code == 2
    assert "usage:" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("command", "flags"),
    [
        (["status"], []),
        (["status"], ["--state", "active", "--limit", "1"]),
        (["quarantine", "list"], []),
        (["health"], []),
    ],
    ids=["status", "status filtered", "quarantine list", "health"],
)
def test_every_listing_prints_one_json_document_with_json(
    seeded: Path, capsys: pytest.CaptureFixture[str], command: list[str], flags: list[str]
) -> None:
    """With `--json`, stdout is exactly one JSON document and nothing goes to stderr."""
    code, out, err = cli(capsys, *command, str(seeded), *flags, "--json")
    assert (code, err) == (0, "")
    json.loads(out)  # raises on trailing text or a second document


# ---------------------------------------------------------------------------------------------
# health


def test_health_of_a_current_database_exits_0(
    seeded: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`health` on a database with the current schema: exit 0, one line, file untouched."""
    before = digest(seeded)
    code, out, err = cli(capsys, "health", str(seeded))
    assert (code, err) == (0, "")
    assert out == f"ok: {seeded} (schema version {_sqlite.SCHEMA_VERSION})\n"
    assert cli_json(capsys, "health", str(seeded)) == {
        "ok": True,
        "db": str(seeded),
        "schema_version": _sqlite.SCHEMA_VERSION,
        "expected_schema_version": _sqlite.SCHEMA_VERSION,
        "reason": None,
    }
    assert digest(seeded) == before
    assert sorted(p.name for p in seeded.parent.iterdir()) == ["seeded.db"]


def _set_version(path: Path, version: int) -> None:
    conn = sqlite3.connect(path)
    conn.execute(f"PRAGMA user_version = {version}")
    conn.close()


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        ("missing", "no database at"),
        ("not sqlite", "is not an SQLite database"),
        ("older schema", f"schema version 0 is not the current {_sqlite.SCHEMA_VERSION}"),
        ("newer schema", "is newer than this trio_sessions understands"),
    ],
)
def test_health_fails_with_a_one_line_reason(
    seeded: Path, capsys: pytest.CaptureFixture[str], damage: str, reason: str
) -> None:
    """`health` exits 1 with one line saying why: missing file, not SQLite, an old schema
    (not yet migrated) or a newer one; and it never creates or migrates the file."""
    path = seeded
    if damage == "missing":
        path = seeded.parent / "missing.db"
    elif damage == "not sqlite":
        seeded.write_text("not a database\n" * 100)
    else:
        _set_version(seeded, 0 if damage == "older schema" else _sqlite.SCHEMA_VERSION + 1)
    code, out, err = cli(capsys, "health", str(path))
    assert (code, out) == (1, "")
    assert err.startswith("unhealthy: ")
    assert reason in err
    assert err.count("\n") == 1
    health = cli_json_failing(capsys, "health", str(path))
    assert health["ok"] is False
    assert reason in health["reason"]
    assert not (seeded.parent / "missing.db").exists()
    if damage == "older schema":
        assert query(seeded, "PRAGMA user_version") == [(0,)]


def test_health_of_an_unreachable_postgres_server_is_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """README "Running workers": `health` exits 1 "with a one-line reason". A server that
    refuses the connection gave two lines: libpq's error text holds a newline and a tab
    ("... Connection refused\n\tIs the server running on that host ...") and the reason
    was printed as it came. The password stays masked."""
    import socket

    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"postgresql://app:s3cret-pw@127.0.0.1:{port}/sessions"
    code, out, err = cli(capsys, "health", url)
    assert (code, out) == (1, "")
    assert err.startswith("unhealthy: ")
    assert "s3cret-pw" not in err
    assert err.count("\n") == 1, err


def test_status_of_an_older_schema_is_listed_or_refused_by_its_version(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An SQLite store written by an older release and not migrated yet (schema version 4:
    before `time_paused`) - the CLI never migrates it. `status` must list it, or refuse it
    saying which schema version it found (it refuses: an older schema lacks what the
    commands read and call); it failed with the driver's raw error, "OperationalError: no
    such column: s.time_paused"."""
    path = tmp_path / "old.db"
    conn = sqlite3.connect(path)
    for version in range(1, 5):
        conn.executescript(_sqlite._MIGRATIONS[version])
    conn.execute("PRAGMA user_version = 4")
    conn.execute("INSERT INTO session(id, time_created) VALUES ('s', 0)")
    conn.commit()
    conn.close()
    code, out, err = cli(capsys, "status", str(path))
    assert "OperationalError" not in err and "no such column" not in err, err
    assert code == 0 or "schema version 4" in err, (code, out, err)


def cli_json_failing(capsys: pytest.CaptureFixture[str], *argv: str) -> Any:
    code, out, _ = cli(capsys, *argv, "--json")
    assert code == 1
    return json.loads(out)


# ---------------------------------------------------------------------------------------------
# quarantine


def test_quarantine_list_names_the_execution_and_why(
    seeded: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`quarantine list` shows the quarantined execution, its claim owner and the reason."""
    rows = cli_json(capsys, "quarantine", "list", str(seeded))
    assert [(r["execution_id"], r["session_id"]) for r in rows] == [("exec-poison", "poison")]
    assert rows[0]["claim_owner_id"] == "owner-dead"
    assert rows[0]["recovery_owner"] == "owner-rec"
    assert "finished" in rows[0]["recovery_error"]
    code, out, _ = cli(capsys, "quarantine", "list", str(seeded))
    assert code == 0
    assert "execution exec-poison  session poison" in out
    assert "claim owner: owner-dead (running)" in out


def test_release_drop_deletes_the_claim_and_rearms_the_doorbell(
    seeded: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--drop deletes the claim and the quarantine, resets attempts, re-arms pending inputs."""
    result = cli_json(capsys, "quarantine", "release", str(seeded), "exec-poison", "--drop")
    assert result == {"execution_id": "exec-poison", "session_id": "poison", "action": "drop"}
    assert query(seeded, "SELECT * FROM session_execution WHERE id = 'exec-poison'") == []
    assert query(seeded, "SELECT * FROM session_recovery") == []
    [(woken, attempts)] = query(
        seeded, "SELECT time_woken, wake_attempts FROM session WHERE id = 'poison'"
    )
    assert woken is not None
    assert attempts == 0
    assert cli_json(capsys, "quarantine", "list", str(seeded)) == []


def test_release_resume_lets_the_next_recovery_pass_resume_a_repaired_record(
    seeded: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--resume clears the quarantine at once; a runtime's next pass resumes the execution."""
    conn = sqlite3.connect(seeded)
    with conn:  # the operator repairs the record first
        conn.execute(
            "UPDATE session_message SET data = ? WHERE id = 'msg-poison'",
            ('{"parts": [], "finished": false, "error": null}',),
        )
    conn.close()
    code, out, _ = cli(capsys, "quarantine", "release", str(seeded), "exec-poison", "--resume")
    assert code == 0
    assert "lifted the quarantine on execution exec-poison" in out
    [(error, expires)] = query(seeded, "SELECT recovery_error, expires_at FROM session_recovery")
    assert error is None
    assert isinstance(expires, int)
    assert expires <= time.time() * 1000
    assert _resumed_sessions(seeded) == {"poison", "expired"}


def test_release_resume_of_a_still_malformed_record_quarantines_it_again(
    seeded: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--resume without a repair: the next recovery pass quarantines the execution again."""
    assert cli(capsys, "quarantine", "release", str(seeded), "exec-poison", "--resume")[0] == 0
    assert cli_json(capsys, "quarantine", "list", str(seeded)) == []
    assert _resumed_sessions(seeded) == {"expired"}
    rows = cli_json(capsys, "quarantine", "list", str(seeded))
    assert [r["execution_id"] for r in rows] == ["exec-poison"]


def _resumed_sessions(path: Path) -> set[str]:
    """Open a runtime (its first recovery pass runs during the open); the sessions it
    resumed."""
    resumed: set[str] = set()

    async def drain(ctx: trio_sessions.DrainContext) -> None:
        if ctx.resumed:
            resumed.add(ctx.session_id)
        await ctx.take_inputs()

    async def main() -> None:
        async with trio_sessions.open_runtime(path, drain, recovery_interval=60) as runtime:
            for session_id in ("poison", "expired", "pending"):
                await runtime.wait_idle(session_id)

    trio.run(main)
    return resumed


def test_release_of_an_execution_that_is_not_quarantined_fails(
    seeded: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Releasing a live or unknown execution is refused with exit 1 and changes nothing."""
    before = digest(seeded)
    for execution_id in ("exec-live", "no-such-execution"):
        code, out, err = cli(capsys, "quarantine", "release", str(seeded), execution_id, "--drop")
        assert code == 1
        assert out == ""
        assert f"{execution_id!r} is not quarantined" in err
    assert digest(seeded) == before


def test_release_needs_exactly_one_of_resume_and_drop(
    seeded: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without --resume or --drop, or with both, argparse refuses with exit 2."""
    for flags in ([], ["--resume", "--drop"]):
        with pytest.raises(SystemExit) as exit_info:
            _cli.main(["quarantine", "release", str(seeded), "exec-poison", *flags])
        assert exit_info.value.code == 2
    assert "one of the arguments --resume --drop is required" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# Refusals: never create or touch a database that is not ours

COMMANDS = (
    ["status"],
    ["quarantine", "list"],
    ["quarantine", "release", "--drop"],
    ["quarantine", "release", "--resume"],
)


def _argv(command: list[str], path: Path) -> list[str]:
    if command[:2] == ["quarantine", "release"]:
        return [*command[:2], str(path), "exec-poison", command[2]]
    return [*command, str(path)]


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_a_missing_file_is_refused_and_not_created(
    command: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A missing path: clear error, exit 1, and no file is created."""
    path = tmp_path / "missing.db"
    code, out, err = cli(capsys, *_argv(command, path))
    assert code == 1
    assert out == ""
    assert err.startswith("error:")
    assert "no database" in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_a_file_that_is_not_sqlite_is_refused_and_untouched(
    command: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A non-SQLite file: clear error, exit 1, its bytes and mtime unchanged."""
    path = tmp_path / "notes.txt"
    path.write_text("these are my notes, not a database\n" * 20)
    before = (digest(path), path.stat().st_mtime_ns)
    code, out, err = cli(capsys, *_argv(command, path))
    assert code == 1
    assert out == ""
    assert "not an SQLite database" in err
    assert str(path) in err
    assert (digest(path), path.stat().st_mtime_ns) == before
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_an_sqlite_file_that_is_not_ours_is_refused_and_untouched(
    command: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Someone else's SQLite database: clear error, exit 1, no table added, bytes unchanged."""
    path = tmp_path / "other.db"
    conn = sqlite3.connect(path)
    with conn:
        conn.execute("CREATE TABLE session(id TEXT PRIMARY KEY, note TEXT)")
        conn.execute("INSERT INTO session VALUES ('a', 'theirs')")
    conn.close()
    before = (digest(path), path.stat().st_mtime_ns)
    code, out, err = cli(capsys, *_argv(command, path))
    assert code == 1
    assert out == ""
    assert "is not a trio_sessions database" in err
    assert (digest(path), path.stat().st_mtime_ns) == before
    assert query(path, "SELECT name FROM sqlite_master") == [
        ("session",),
        ("sqlite_autoindex_session_1",),
    ]


# ---------------------------------------------------------------------------------------------
# The entry point


def test_python_dash_m_runs_the_cli(seeded: Path) -> None:
    """`python -m trio_sessions` is the CLI: JSON on stdout, exit 0; usage errors exit 2."""
    run = subprocess.run(
        [sys.executable, "-m", "trio_sessions", "status", str(seeded), "--json"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["summary"]["sessions"] == 5
    usage = subprocess.run(
        [sys.executable, "-m", "trio_sessions"], capture_output=True, text=True, timeout=30
    )
    assert usage.returncode == 2
    assert "usage: python -m trio_sessions" in usage.stderr


# ---------------------------------------------------------------------------------------------
# Rejected inputs


def test_inputs_list_and_drop_a_rejected_input(
    seeded: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`inputs list` shows an input set aside as malformed (session, payload, reason), filtered
    by --session, and what in its row is malformed itself; `inputs drop` deletes it; an
    unknown id exits 1 and changes nothing."""
    conn = _sqlite.connect(seeded)
    try:
        now = time.time()
        _op(conn, now, _store.submit, "badin", '{"n": 1}', "in-ok")
        _op(conn, now, _store.submit, "badin", "[1]", "in-bad")
        _op(conn, now, _store.acquire, "badin", "exec-badin", "owner-a", 60_000)
        taken = _op(conn, now, _store.take_inputs, "badin", "exec-badin", "owner-a")
        assert [i.id for i in taken] == ["in-ok"]
        _op(conn, now, finish_iteration, "badin", "exec-badin", "owner-a")
    finally:
        conn.close()
    rows = cli_json(capsys, "inputs", "list", str(seeded))
    assert [(r["id"], r["session_id"], r["payload"]) for r in rows] == [("in-bad", "badin", "[1]")]
    assert "JSON object" in rows[0]["reason"]
    assert cli_json(capsys, "inputs", "list", str(seeded), "--session", "other") == []
    code, out, _ = cli(capsys, "inputs", "list", str(seeded))
    assert code == 0
    assert "in-bad" in out and "badin" in out
    # Another tool's bytes (SQLite keeps them): the row is listed as malformed, text and
    # JSON. A payload that is not UTF-8 failed the listing (a TypeError with --json).
    raw = sqlite3.connect(seeded)
    with raw:
        raw.execute(
            "UPDATE session_input_rejected"
            " SET payload = CAST(X'5B80' AS TEXT), time_created = X'00'"
        )
    raw.close()
    [row] = cli_json(capsys, "inputs", "list", str(seeded))
    assert (row["payload"], row["time_created"]) == ("[\ufffd", None)
    assert row["malformed"] == [
        "session_input_rejected.payload is not UTF-8 text (X'5B80')",
        r"session_input_rejected.time_created is '\x00', not a whole number",
    ]
    code, out, _ = cli(capsys, "inputs", "list", str(seeded))
    assert code == 0
    assert "  MALFORMED: session_input_rejected.payload is not UTF-8 text (X'5B80')" in out
    before = digest(seeded)
    code, _, err = cli(capsys, "inputs", "drop", str(seeded), "no-such-input")
    assert code == 1
    assert "'no-such-input' is not a rejected input" in err
    assert digest(seeded) == before
    result = cli_json(capsys, "inputs", "drop", str(seeded), "in-bad")
    assert result == {"input_id": "in-bad", "session_id": "badin", "action": "drop"}
    assert query(seeded, "SELECT * FROM session_input_rejected") == []
    assert cli_json(capsys, "inputs", "list", str(seeded)) == []


# ---------------------------------------------------------------------------------------------
# PostgreSQL: the same commands on a URL


def test_every_command_takes_a_postgres_url(
    pg_url: str, pg_schema: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """status, health, quarantine and inputs work on a postgresql:// URL (with --schema) as
    on a file: the same sessions, leases read against the server's clock, the same release."""
    location = PgLocation(pg_url, pg_schema)
    seed_postgres(location)
    db = (pg_url, "--schema", pg_schema)
    status = cli_json(capsys, "status", *db)
    sessions = {s["id"]: s for s in status["sessions"]}
    assert sorted(sessions) == ["expired", "idle", "live", "pending", "poison"]
    assert sessions["live"]["claim"]["expired"] is False
    assert sessions["live"]["claim"]["lease_remaining_s"] > 500
    assert sessions["expired"]["claim"]["expired_since_s"] > 80
    assert sessions["pending"]["pending_inputs"] == 2
    assert sessions["poison"]["claim"]["quarantined"] is True
    expired = cli_json(capsys, "status", *db, "--state", "expired")
    assert [s["id"] for s in expired["sessions"]] == ["expired"]
    code, out, _ = cli(capsys, "status", *db)
    assert code == 0 and "owner-live" in out
    health = cli_json(capsys, "health", *db)
    assert health["ok"] is True and health["schema_version"] == health["expected_schema_version"]
    rows = cli_json(capsys, "quarantine", "list", *db)
    assert [(r["execution_id"], r["claim_owner_id"]) for r in rows] == [
        ("exec-poison", "owner-dead")
    ]
    assert cli_json(capsys, "inputs", "list", *db) == []
    code, _, err = cli(capsys, "inputs", "drop", *db, "no-such-input")
    assert code == 1 and "'no-such-input' is not a rejected input" in err
    result = cli_json(capsys, "quarantine", "release", *db, "exec-poison", "--drop")
    assert result == {"execution_id": "exec-poison", "session_id": "poison", "action": "drop"}
    assert query(location, "SELECT id FROM session_execution WHERE id = 'exec-poison'") == []
    assert cli_json(capsys, "quarantine", "list", *db) == []


def test_a_postgres_schema_that_is_not_ours_is_refused_and_not_migrated(
    pg_url: str, pg_schema: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A reachable database whose schema holds no store: every command exits 1 saying so,
    health included, and nothing is created in it."""
    code, _, err = cli(capsys, "status", pg_url, "--schema", pg_schema)
    assert code == 1 and "is not a trio_sessions store" in err
    code, out, err = cli(capsys, "health", pg_url, "--schema", pg_schema)
    assert (code, out) == (1, "")
    assert err.startswith("unhealthy: ") and "schema version 0 is not the current" in err
    tables = query(
        PgLocation(pg_url, pg_schema),
        "SELECT table_name FROM information_schema.tables WHERE table_schema = ?",
        (pg_schema,),
    )
    assert tables == []


def test_health_of_a_newer_postgres_schema_says_it_is_newer(
    pg_url: str, pg_schema: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """README "Running workers": `health` fails with the reason "schema older or newer than
    this library" (SQLite: "is newer than this trio_sessions understands"). On PostgreSQL a
    newer schema was reported as "schema version N is not the current M; opening it with a
    runtime of this library migrates it" - wrong advice: a runtime refuses it
    (SchemaTooNew, nothing modified), as `status` says ("upgrade trio_sessions")."""
    location = PgLocation(pg_url, pg_schema)
    seed_postgres(location)
    db = (pg_url, "--schema", pg_schema)
    expected = cli_json(capsys, "health", *db)["expected_schema_version"]
    backends.write(location, "UPDATE schema_version SET version = ?", (expected + 1,))
    code, out, err = cli(capsys, "health", *db)
    assert (code, out) == (1, "")
    assert "migrates it" not in err, err
    assert "newer than this trio_sessions" in err, err


def test_schema_needs_a_url(seeded: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--schema with an SQLite path is a usage error (exit 2)."""
    with pytest.raises(SystemExit) as exited:
        _cli.main(["status", str(seeded), "--schema", "other"])
    assert exited.value.code == 2
    assert "--schema needs a postgresql:// URL" in capsys.readouterr().err


def test_the_health_probe_the_readme_deploys_reads_the_schema_the_processes_use(
    pg_url: str,
    migrated_schema: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """README "Several hosts" exports `TRIO_SESSIONS_SCHEMA` ("both kinds of process read
    it") and deploys `health "$TRIO_SESSIONS_STORE"` as the readiness probe, but the CLI
    never read the variable: the probe looked at `public`, found no store and failed for
    ever while the worker and the web process ran fine on the schema. Found by an audit.
    Every command that takes a store reads it, as the worker does; `--schema` wins over it.
    (Asserted through a schema with no store too: `public` may hold one on a shared server.)"""
    monkeypatch.setenv("TRIO_SESSIONS_SCHEMA", migrated_schema)
    code, _, err = cli(capsys, "health", pg_url)
    assert code == 0, err
    monkeypatch.setenv("TRIO_SESSIONS_SCHEMA", "no_store_here")
    code, _, err = cli(capsys, "health", pg_url)
    assert code == 1 and "'no_store_here'" in err, err
    code, _, err = cli(capsys, "status", pg_url)
    assert code == 1 and "schema 'no_store_here' is not a trio_sessions store" in err, err
    code, _, err = cli(capsys, "health", pg_url, "--schema", migrated_schema)
    assert code == 0, err


def test_a_schema_from_the_environment_is_checked_as_the_flag_is(
    seeded: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`TRIO_SESSIONS_SCHEMA` with an SQLite path, or naming no valid schema, is a usage
    error (exit 2) naming the variable, as the worker refuses it."""
    monkeypatch.setenv("TRIO_SESSIONS_SCHEMA", "chat")
    with pytest.raises(SystemExit) as exited:
        _cli.main(["status", str(seeded)])
    assert exited.value.code == 2
    assert "TRIO_SESSIONS_SCHEMA needs a postgresql:// URL" in capsys.readouterr().err
    monkeypatch.setenv("TRIO_SESSIONS_SCHEMA", "pg_catalog")
    with pytest.raises(SystemExit) as exited:
        _cli.main(["health", "postgresql://postgres@127.0.0.1:1/postgres"])
    assert exited.value.code == 2
    assert "TRIO_SESSIONS_SCHEMA: schema 'pg_catalog' is reserved" in capsys.readouterr().err


@pytest.mark.parametrize(
    "db",
    ["postgresql+psycopg://u:s3cret@h/db", "host=h password=s3cret", "postgresql://u:p@ss@h/db"],
)
def test_a_bad_store_name_is_not_blamed_on_the_schema_variable(
    db: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A DB argument of no accepted form is a usage error about DB. It was reported as
    `TRIO_SESSIONS_SCHEMA: store ...` whenever `--schema` was not given, the variable unset
    too, sending the operator after a setting they never made. Found following the README:
    `status 'postgresql+psycopg://...'` in a shell with no TRIO_SESSIONS_ variable."""
    monkeypatch.delenv("TRIO_SESSIONS_SCHEMA", raising=False)
    for command in (["status", db], ["health", db], ["pause", db, "s1"]):
        with pytest.raises(SystemExit) as exited:
            _cli.main(command)
        assert exited.value.code == 2
        err = capsys.readouterr().err
        assert "error: " in err and "TRIO_SESSIONS_SCHEMA" not in err, err
        assert "s3cret" not in err, err
    # With the variable set, the error about DB still names DB, not the variable.
    monkeypatch.setenv("TRIO_SESSIONS_SCHEMA", "chat")
    with pytest.raises(SystemExit) as exited:
        _cli.main(["status", db])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "TRIO_SESSIONS_SCHEMA" not in err, err


def test_status_columns_line_up_for_wide_and_combining_characters(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Session ids are any printable text, and a table padded by `len` put every column
    after an id of CJK characters or an emoji (two terminal cells each) one cell late per
    character, and after a combining accent (no cell) one early: found listing sessions
    named in Japanese. Each column now starts at the same terminal cell on every row."""
    import unicodedata

    db = tmp_path / "wide.db"
    ids = ["plain", "日本語セッション", "emoji😀", "e\u0301te"]

    async def seed() -> None:
        async with trio_sessions.open_runtime(db, None) as producer:
            for session_id in ids:
                await producer.submit(session_id, {"text": "hi"})

    trio.run(seed)
    code, out, err = cli(capsys, "status", str(db))
    assert code == 0, err

    def cells(text: str) -> int:
        return sum(
            0 if unicodedata.combining(c) else 2 if unicodedata.east_asian_width(c) in "WF" else 1
            for c in text
        )

    rows = [line for line in out.splitlines() if line.startswith(("SESSION", *ids))]
    assert len(rows) == len(ids) + 1, out
    # Where the second column (DOORBELL: "set ..." or the header) starts, in cells.
    starts = {
        cells(row[: row.index("set ") if "set " in row else row.index("DOORBELL")]) for row in rows
    }
    assert len(starts) == 1, out


def test_an_unhealthy_postgres_schema_is_named_in_the_reason(pg_url: str) -> None:
    """`health URL --schema S` on a schema with no store said "schema version 0 is not the
    current N; opening it with a runtime of this library migrates it": which schema it
    looked at was nowhere in the line (the listings' refusal names it). Found by an audit.
    The reason names the schema."""
    health = _cli.check_health(pg_url, "no_store_here")
    assert not health["ok"]
    assert "no_store_here" in health["reason"], health["reason"]


# ---------------------------------------------------------------------------------------------
# Conversation control verbs (DESIGN §5.1), on both backends


@pytest.fixture(params=["sqlite", "postgres"])
def seeded_store(
    request: pytest.FixtureRequest, tmp_path: Path
) -> tuple[list[str], backends.Location]:
    """The seeded store as the CLI names it (argv) and as `query` reads it."""
    if request.param == "sqlite":
        path = tmp_path / "seeded.db"
        seed(path)
        return [str(path)], path
    location = PgLocation(request.getfixturevalue("pg_url"), request.getfixturevalue("pg_schema"))
    seed_postgres(location)
    return [location.url, "--schema", location.schema], location


def _tables_of(location: backends.Location) -> set[str]:
    if isinstance(location, PgLocation):
        rows = query(
            location,
            "SELECT table_name FROM information_schema.tables WHERE table_schema = ?",
            (location.schema,),
        )
    else:
        rows = query(location, "SELECT name FROM sqlite_master WHERE type = 'table'")
    return {str(name) for (name,) in rows} - {"schema_version"}  # PostgreSQL's version row


def test_the_health_probe_reads_every_table_of_a_store(
    seeded_store: tuple[list[str], backends.Location],
) -> None:
    """`health` reads each of the library's tables (`_store.STORE_TABLES`): the list is
    every table a current store has, on each backend."""
    _, location = seeded_store
    dialect = "postgres" if isinstance(location, PgLocation) else "sqlite"
    assert set(_store.STORE_TABLES[dialect]) == _tables_of(location)


@pytest.mark.parametrize("table", ["session_message_delta", "session_input_rejected"])
def test_health_is_ok_only_while_every_table_answers(
    seeded_store: tuple[list[str], backends.Location],
    capsys: pytest.CaptureFixture[str],
    table: str,
) -> None:
    """A store at the current version whose `table` is gone (another tool's drop): `health`
    said ok, reading only the session table - and counting every row of it, each probe.
    Now it reads at most one row of each table, in one statement, and names the one that
    does not answer."""
    argv, location = seeded_store
    assert cli(capsys, "health", *argv)[0] == 0
    drop = f"DROP TABLE {table}" + (" CASCADE" if isinstance(location, PgLocation) else "")
    backends.write(location, drop)
    code, out, err = cli(capsys, "health", *argv)
    assert (code, out) == (1, "")
    assert err.startswith("unhealthy: ") and "cannot read" in err and table in err, err


def _rows_of(location: backends.Location, session_id: str) -> list[Any]:
    return [
        query(location, f"SELECT COUNT(*) FROM {table} WHERE {column} = ?", (session_id,))[0][0]
        for table, column in (
            ("session", "id"),
            ("session_input", "session_id"),
            ("session_execution", "session_id"),
            ("session_message", "session_id"),
            ("session_recovery", "session_id"),
        )
    ]


def test_control_verbs_pause_resume_cancel_delete_and_purge(
    seeded_store: tuple[list[str], backends.Location], capsys: pytest.CaptureFixture[str]
) -> None:
    """pause, resume, inputs cancel, delete and purge --idle-for write through the store's
    operations on a file and on a URL alike, each with --json; a verb that finds nothing to
    act on exits 1 saying why."""
    db, location = seeded_store
    assert cli_json(capsys, "pause", *db, "pending") == {
        "session_id": "pending",
        "action": "pause",
        "created": False,
    }
    paused = "SELECT COUNT(*) FROM session WHERE id = 'pending' AND time_paused IS NOT NULL"
    assert query(location, paused) == [(1,)]
    status = cli_json(capsys, "status", *db, "--session", "pending")
    [pending] = status["sessions"]
    assert pending["paused_since"] is not None and pending["scheduled_inputs"] == 0
    assert cli_json(capsys, "inputs", "cancel", *db, "in-pending-2") == {
        "input_id": "in-pending-2",
        "action": "cancel",
    }
    code, out, err = cli(capsys, "inputs", "cancel", *db, "in-pending-2")
    assert (code, out) == (1, "") and "'in-pending-2' is not pending" in err
    code, out, _ = cli(capsys, "resume", *db, "pending")
    assert code == 0 and out.startswith("resumed pending (pending work rang its doorbell)")
    assert query(location, paused) == [(0,)]
    assert query(location, "SELECT id FROM session_input WHERE session_id = 'pending'") == [
        ("in-pending-1",)
    ]
    assert cli_json(capsys, "delete", *db, "expired") == {
        "session_id": "expired",
        "action": "delete",
    }
    assert _rows_of(location, "expired") == [0, 0, 0, 0, 0]
    code, _, err = cli(capsys, "delete", *db, "expired")
    assert code == 1 and "no session 'expired'" in err
    # "idle" was last written 50 s ago and holds nothing pending; every other session holds
    # a claim or inputs.
    assert cli_json(capsys, "purge", *db, "--idle-for", "40") == {
        "action": "purge",
        "idle_for_s": 40.0,
        "purged": 1,
    }
    assert _rows_of(location, "idle") == [0, 0, 0, 0, 0]
    remaining = [row[0] for row in query(location, "SELECT id FROM session ORDER BY id")]
    assert remaining == ["live", "pending", "poison"]
    with pytest.raises(SystemExit) as exited:
        _cli.main(["purge", *db, "--idle-for", "-1"])
    assert exited.value.code == 2


def test_pause_of_an_unknown_session_says_it_created_one_and_resume_refuses_it(
    seeded_store: tuple[list[str], backends.Location], capsys: pytest.CaptureFixture[str]
) -> None:
    """`pause DB <typo>` creates a paused session (as `runtime.pause` does: a session can be
    held before its first message) - the CLI says so, in its text and its JSON, instead of
    "paused <typo>" as if a session had been found; `resume DB <typo>` exits 1 naming the
    missing session, as `delete` does, instead of "resumed <typo> (no doorbell rung)". Found
    by the last audit: a mistyped id silently left a paused session behind."""
    db, location = seeded_store
    code, out, err = cli(capsys, "pause", *db, "pendign")
    assert code == 0, err
    assert out.startswith("paused pendign (no such session existed: created it, paused")
    created = "SELECT COUNT(*) FROM session WHERE id = 'pendign' AND time_paused IS NOT NULL"
    assert query(location, created) == [(1,)]
    assert cli_json(capsys, "pause", *db, "pendign") == {
        "session_id": "pendign",
        "action": "pause",
        "created": False,
    }
    assert cli_json(capsys, "pause", *db, "nosuch")["created"] is True
    code, out, err = cli(capsys, "pause", *db, "pending")
    assert (code, out) == (0, "paused pending\n"), err
    code, out, err = cli(capsys, "resume", *db, "resumetypo")
    assert (code, out) == (1, "") and "no session 'resumetypo'" in err
    assert query(location, "SELECT COUNT(*) FROM session WHERE id = 'resumetypo'") == [(0,)]


def test_status_shows_a_paused_session_as_paused(
    seeded_store: tuple[list[str], backends.Location], capsys: pytest.CaptureFixture[str]
) -> None:
    """A paused session says `paused` in the NOTE column and `--state paused` lists it. Found
    by an audit: only `--json` had `paused_since`; the text listed a paused session with a
    pending input as a plain doorbell, as if a worker with room would start it."""
    db, _ = seeded_store
    cli_json(capsys, "pause", *db, "pending")
    paused = cli_json(capsys, "status", *db, "--state", "paused")
    assert [(s["id"], s["paused"]) for s in paused["sessions"]] == [("pending", True)]
    assert paused["matched"] == 1
    code, out, _ = cli(capsys, "status", *db)
    assert code == 0
    lines = {line.split()[0]: line for line in out.splitlines()[3:]}
    assert lines["pending"].endswith("  paused")
    assert [name for name, line in lines.items() if "paused" in line] == ["pending"]
    code, out, _ = cli(capsys, "status", *db, "--state", "quarantined")
    assert code == 0 and "paused" not in out


def test_status_shows_a_scheduled_input_as_scheduled(
    seeded_store: tuple[list[str], backends.Location], capsys: pytest.CaptureFixture[str]
) -> None:
    """A session whose only input is scheduled (`submit(..., delay=)`, not due yet) says so
    in the NOTE column. Found by an audit: only `--json` had `scheduled_inputs`; the text
    listed it as a pending input with no doorbell and no claim - how a stranded input
    (DESIGN §6.16) looks - though its due timer will ring it."""
    db, _ = seeded_store
    database = _cli.open_database(db[0], db[2] if len(db) > 1 else None)
    try:
        database.run(
            _store.submit_scheduled, "later", '{"text": "soon"}', "in-later", 3_600_000, "queue"
        )
    finally:
        database.close()
    [later] = cli_json(capsys, "status", *db, "--session", "later")["sessions"]
    assert (later["doorbell"], later["claim"], later["pending_inputs"]) == (None, None, 1)
    assert later["scheduled_inputs"] == 1
    code, out, _ = cli(capsys, "status", *db)
    assert code == 0
    lines = {line.split()[0]: line for line in out.splitlines()[3:]}
    assert lines["later"].endswith("  1 scheduled"), lines["later"]
    assert [name for name, line in lines.items() if "scheduled" in line] == ["later"]


# ---------------------------------------------------------------------------------------------
# Bad arguments: a usage error (exit 2) before anything is written, never a traceback

BAD_ID_ARGUMENTS = {
    "empty": "",
    "newline": "bad\nid",
    "201-chars": "x" * 201,
}


@pytest.mark.parametrize("bad", sorted(BAD_ID_ARGUMENTS))
@pytest.mark.parametrize(
    ("command", "flags"),
    [
        (["pause"], []),
        (["resume"], []),
        (["delete"], []),
        (["inputs", "drop"], []),
        (["inputs", "cancel"], []),
        (["quarantine", "release"], ["--drop"]),
    ],
    ids=["pause", "resume", "delete", "inputs-drop", "inputs-cancel", "release"],
)
def test_an_id_the_api_refuses_is_a_usage_error_and_writes_nothing(
    seeded: Path,
    capsys: pytest.CaptureFixture[str],
    command: list[str],
    flags: list[str],
    bad: str,
) -> None:
    """A session, input or execution id no store can hold (empty, non-printable, over 200
    characters) is refused as the API refuses it - a usage error naming it - and the file is
    unchanged (`pause ""` created a paused session only the CLI could remove)."""
    before = digest(seeded)
    with pytest.raises(SystemExit) as exit_info:
        _cli.main([*command, str(seeded), BAD_ID_ARGUMENTS[bad], *flags])
    assert exit_info.value.code == 2
    assert "must be" in capsys.readouterr().err
    assert digest(seeded) == before


@pytest.mark.parametrize("seconds", ["1e16", "inf", "-0.5"])
def test_purge_refuses_an_idle_time_out_of_range_as_a_usage_error(
    seeded: Path, capsys: pytest.CaptureFixture[str], seconds: str
) -> None:
    """`--idle-for` beyond about 31 years (1e9 s: whole milliseconds beside epoch times in
    64 bits) is a usage error, as a negative or infinite one - not an OverflowError's
    traceback (SQLite) nor "purged 0" (PostgreSQL)."""
    with pytest.raises(SystemExit) as exit_info:
        _cli.main(["purge", str(seeded), f"--idle-for={seconds}"])
    assert exit_info.value.code == 2
    assert "seconds" in capsys.readouterr().err


@pytest.mark.parametrize("port", ["70000", "65536", "0", "-1", "x"])
def test_pg_trial_server_refuses_a_port_no_server_can_listen_on_as_a_usage_error(
    capsys: pytest.CaptureFixture[str], port: str
) -> None:
    """`pg-trial-server --port 70000` passed the parser (any whole number from 1) and failed
    only after initdb, with PostgreSQL's own FATAL and `pg_ctl`'s dump (exit 1), where
    every other setting of the CLI is a usage error before anything runs (README: "a bad
    setting exits 2"). Found by an audit. A port outside 1-65535 is one, at parse time (0
    too: without `--port` the server already takes a free port)."""
    with pytest.raises(SystemExit) as exited:
        _cli.build_parser().parse_args(["pg-trial-server", f"--port={port}"])
    assert exited.value.code == 2
    assert "argument --port: " in capsys.readouterr().err
    assert _cli.build_parser().parse_args(["pg-trial-server", "--port", "65535"]).port == 65535


def test_pg_trial_server_on_a_port_another_server_holds_fails_and_names_no_url(
    pg_url: str,
) -> None:
    """`pg-trial-server --port P` where another PostgreSQL server already listens exits 1
    saying why, and prints no URL. Found by the audit (audY55): its readiness check
    connected to the *other* server (trusting local connections, as the suite's does), so
    it printed that server's URL as "trial PostgreSQL server on 127.0.0.1:P ... deleted when
    it stops" while its own server had failed to bind - `--port 5432` beside a real
    server would send a user's trial writes into it."""
    address = urllib.parse.urlsplit(pg_url)
    if address.hostname not in ("127.0.0.1", "localhost") or address.port is None:
        pytest.skip("needs the suite's server on this host")
    run = subprocess.run(
        [sys.executable, "-m", "trio_sessions", "pg-trial-server", "--port", str(address.port)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 1, run.stdout + run.stderr
    assert run.stdout == ""
    assert run.stderr.startswith("error: ") and "Address already in use" in run.stderr


def test_quarantine_and_inputs_listings_filter_by_session_and_limit(
    seeded: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """DESIGN §5: the listings filter by session and limit (`status` also by state)."""
    rows = cli_json(capsys, "quarantine", "list", str(seeded), "--session", "poison")
    assert [row["session_id"] for row in rows] == ["poison"]
    assert cli_json(capsys, "quarantine", "list", str(seeded), "--session", "other") == []
    assert len(cli_json(capsys, "quarantine", "list", str(seeded), "--limit", "1")) == 1
    assert cli_json(capsys, "inputs", "list", str(seeded), "--limit", "1") == []


def test_a_limited_listing_says_how_many_it_shows_of_how_many(
    seeded: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`quarantine list` and `inputs list` with `--limit` say "showing N of M" as `status`
    does. Found by an audit: they printed the page size as the count ("1 quarantined
    execution(s):" of 3)."""
    for n in (1, 2):
        seed_quarantine(seeded, f"q{n}", f"exec-q{n}")
    raw = sqlite3.connect(seeded)
    with raw:
        raw.executemany(
            "INSERT INTO session_input_rejected(id, session_id, seq, payload, reason,"
            " time_created) VALUES (?, 'idle', ?, '{bad', 'not JSON', 0)",
            [(f"bad{n}", 10 + n) for n in range(3)],
        )
    raw.close()
    code, out, _ = cli(capsys, "quarantine", "list", str(seeded), "--limit", "1")
    assert code == 0
    assert out.splitlines()[0] == "showing 1 of 3 quarantined execution(s):"
    assert out.count("\nexecution ") == 1
    code, out, _ = cli(capsys, "inputs", "list", str(seeded), "--limit", "2")
    assert code == 0
    assert out.splitlines()[0] == "showing 2 of 3 rejected input(s):"
    assert out.count("\ninput ") == 2
    code, out, _ = cli(capsys, "inputs", "list", str(seeded), "--limit", "3")
    assert code == 0
    assert out.splitlines()[0] == "3 rejected input(s):"
    code, out, _ = cli(capsys, "quarantine", "list", str(seeded), "--session", "q1")
    assert code == 0
    assert out.splitlines()[0] == "1 quarantined execution(s):"


def test_text_listings_escape_what_a_terminal_would_act_on(
    seeded: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Another tool's ids and reasons holding a newline, a NUL or an ANSI escape are printed
    escaped as `repr` shows them, in every text listing; JSON keeps them as stored. Found by
    an audit: `status` printed them raw - a newline split a row, the escape reached the
    terminal. (SQLite and PostgreSQL format alike; SQLite alone also keeps a NUL.)"""
    for session_id, execution_id in (
        ("new\nline", "exec-new\nline"),
        ("nul\x00x", "exec-nul"),
        ("ansi\x1b[31mRED", "exec-ansi"),
    ):
        seed_quarantine(seeded, session_id, execution_id)
    raw = sqlite3.connect(seeded)
    with raw:
        raw.execute(
            "UPDATE session_recovery SET owner_id = 'rec\rowner', recovery_error = 'bad\nrow'"
            " WHERE session_id = 'new\nline'"
        )
        raw.execute(
            "UPDATE session_execution SET owner_id = ? WHERE session_id = ?",
            ("own\ter\x07", "new\nline"),
        )
        raw.executemany(
            "INSERT INTO session_input_rejected(id, session_id, seq, payload, reason,"
            " time_created) VALUES (?, ?, ?, ?, ?, 0)",
            [
                ("in\nput", "nul\x00x", 1, "{\n\x1b[2J", "not\x1bJSON"),
                ("in-ok", "nul\x00x", 2, "[]", "not an object"),
            ],
        )
    raw.close()
    code, status, _ = cli(capsys, "status", str(seeded))
    assert code == 0
    rows = status.splitlines()[3:]
    assert len(rows) == 8  # one line per session: the 5 seeded and 3 new
    assert [row.split()[0] for row in rows[:3]] == [r"ansi\x1b[31mRED", "expired", "idle"]
    assert r"new\nline  " in status and r"nul\x00x  " in status
    assert r"own\ter\x07  running  " in status
    code, quarantine, _ = cli(capsys, "quarantine", "list", str(seeded))
    assert code == 0
    assert r"execution exec-new\nline  session new\nline" in quarantine
    assert r"  claim owner: own\ter\x07 (running)" in quarantine
    assert r"by rec\rowner" in quarantine and r"  - bad\nrow" in quarantine
    code, inputs, _ = cli(capsys, "inputs", "list", str(seeded))
    assert code == 0
    assert r"input in\nput  session nul\x00x  seq 1" in inputs
    assert r"  payload: {\n\x1b[2J" in inputs and r"  - not\x1bJSON" in inputs
    for out in (status, quarantine, inputs):
        assert not {"\x00", "\x07", "\x1b", "\r", "\t"} & set(out), out
    row = cli_json(capsys, "inputs", "list", str(seeded))[0]
    assert (row["id"], row["payload"]) == ("in\nput", "{\n\x1b[2J")
    code, out, _ = cli(capsys, "inputs", "drop", str(seeded), "in-ok")
    assert (code, out) == (0, "dropped rejected input in-ok of session nul\\x00x\n")
    code, out, _ = cli(capsys, "quarantine", "release", str(seeded), "exec-ansi", "--resume")
    assert code == 0 and r"of session ansi\x1b[31mRED: the next" in out
    sessions = [s["id"] for s in cli_json(capsys, "status", str(seeded))["sessions"]]
    assert "nul\x00x" in sessions and "ansi\x1b[31mRED" in sessions


def test_a_time_ahead_of_the_clock_reads_as_ahead_not_as_a_negative_age(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A doorbell or heartbeat stamped after the clock the CLI reads (another runtime's
    `clock=`, a host clock stepped back) is shown ahead of now. Found by the audit
    (audY55): `status` printed "set -3600.0s ago" and a heartbeat "-3600.0s ago"."""
    path = tmp_path / "ahead.db"
    conn = _sqlite.connect(path)
    try:
        ahead = time.time() + 3600
        _op(conn, ahead, _store.submit, "ahead", '{"text": "hi"}', "in-ahead")
        _op(conn, ahead, _store.acquire, "ahead", "exec-ahead", "owner-ahead", LIVE_LEASE_MS)
        _op(conn, ahead, _store.heartbeat, "owner-ahead", ["exec-ahead"], LIVE_LEASE_MS)
        _op(conn, ahead, _store.wake, "ahead")
    finally:
        conn.close()
    code, out, err = cli(capsys, "status", str(path))
    assert code == 0, err
    row = out.splitlines()[-1]
    assert "-" not in row.replace("owner-ahead", "").replace("exec-ahead", ""), row
    assert row.count("s ahead") == 2, row
