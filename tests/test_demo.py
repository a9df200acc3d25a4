"""`python -m trio_sessions.demo`: a bounded real run, its refusals, Ctrl-C, and its checks.

The demo spawns and SIGKILLs a worker process and waits out a real takeover grace, so these
tests run real processes (marked `slow`, bounded by timeouts).
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import query

from trio_sessions import _sqlite, _store, demo
from trio_sessions._demo import output

DEMO = [sys.executable, "-m", "trio_sessions.demo"]
TIMEOUT = 60  # the demo itself takes about 5 s; the issue allows 30


@pytest.mark.slow
def test_demo_runs_every_scene_and_every_check_passes(tmp_path: Path) -> None:
    """The demo exits 0 with every summary check PASS, and its kept database agrees."""
    db = tmp_path / "demo.db"
    run = subprocess.run([*DEMO, "--db", str(db)], capture_output=True, text=True, timeout=TIMEOUT)
    assert run.returncode == 0, run.stdout + run.stderr
    summary = run.stdout.split("-- Summary", 1)[1]
    verdicts = [line.split()[0] for line in summary.splitlines() if line.startswith("  ")]
    verdicts = [v for v in verdicts if v in ("PASS", "FAIL")]
    assert verdicts == ["PASS"] * len(demo.CHECKS)
    for check in (
        "normal turn",
        "coalescing",
        "interrupt: chat-3's running tool call failed",
        "exactly one successor turn",
        "SIGKILLed",
        "after the grace, before the lease expired",
        "quarantine",
        "carry on",
        "no stranded work",
    ):
        assert check in summary
    assert f"{len(demo.CHECKS)}/{len(demo.CHECKS)} checks passed" in run.stdout
    assert "KILLED (exit status" in run.stdout
    assert "RESUMED" in run.stdout
    # Kept for the operator CLI: the quarantined record is really there.
    assert query(
        db, "SELECT execution_id FROM session_recovery WHERE recovery_error IS NOT NULL"
    ) == [(demo.GHOST_EXECUTION,)]


def test_checks_are_computed_not_printed(tmp_path: Path) -> None:
    """On a database where nothing happened, every check fails (they read the database)."""
    db = tmp_path / "empty.db"
    _sqlite.connect(db).close()
    checks = demo.verify(db, demo.Facts())
    assert len(checks) == len(demo.CHECKS)
    assert [check.name for check in checks if check.passed] == []


def test_demo_refuses_an_existing_database(tmp_path: Path) -> None:
    """--db naming an existing file: exit 2 and the file is left alone."""
    db = tmp_path / "precious.db"
    db.write_bytes(b"keep me")
    run = subprocess.run([*DEMO, "--db", str(db)], capture_output=True, text=True, timeout=TIMEOUT)
    assert run.returncode == 2
    assert "needs a fresh database" in run.stderr
    assert db.read_bytes() == b"keep me"


@pytest.mark.parametrize(
    "db",
    [
        "postgresql://app:sekrit@127.0.0.1:1/postgres",
        "postgres://app@127.0.0.1:1/postgres?password=sekrit",
        "mysql://app:sekrit@127.0.0.1/app",
        "host=127.0.0.1 password=sekrit",
    ],
    ids=["postgresql-url", "postgres-url-query", "other-scheme", "libpq-dsn"],
)
def test_the_demo_refuses_a_postgres_url_as_its_database_and_never_prints_its_password(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    db: str,
) -> None:
    """DESIGN §6.27 (a connection string is never taken for a file name) and §8 (a password
    never appears in an error or CLI output). `--db` was parsed as a `Path`, which folds
    `postgresql://` into `postgresql:/`, so store naming no longer saw a URL: the demo
    printed `database postgresql:/app:sekrit@...`, then a traceback quoting it, or - where
    a directory of that name existed - ran on an SQLite file named after the URL. Found by
    an audit. Any connection string is a usage error (exit 2, argparse's form) before
    anything runs, its password masked, nothing created."""
    monkeypatch.chdir(tmp_path)
    outcome = demo.main(["--db", db])
    printed = capsys.readouterr()
    assert outcome == 2, printed.out + printed.err
    assert "sekrit" not in printed.out + printed.err, printed.out + printed.err
    assert printed.out == ""
    assert "error: argument --db: " in printed.err and "usage: " in printed.err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("where", ["missing-directory", "a-file"])
def test_the_demo_refuses_a_database_in_no_directory_without_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str
) -> None:
    """README: "Add `--db demo.db` to keep the database". A path whose directory does not
    exist (a typo) or is a file printed 'database ...', then a 40-line exception-group
    traceback ending in `StoreError: cannot open ...`, exit 1. Found following the README.
    It is refused as the other unusable paths are: one usage line, exit 2, nothing made."""
    parent = tmp_path / "no-such-dir" if where == "missing-directory" else tmp_path / "file"
    if where == "a-file":
        parent.write_text("not a directory")
    outcome = demo.main(["--db", str(parent / "demo.db")])
    printed = capsys.readouterr()
    assert outcome == 2, printed.out + printed.err
    assert "Traceback" not in printed.err and printed.out == "", printed.out + printed.err
    assert "error: argument --db: " in printed.err and str(parent) in printed.err, printed.err
    assert sorted(p.name for p in tmp_path.iterdir()) == ([] if where != "a-file" else ["file"])


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="POSIX signals")
@pytest.mark.parametrize("group", [False, True], ids=["demo", "terminal"])
def test_ctrl_c_stops_the_demo_cleanly_and_its_worker_too(tmp_path: Path, group: bool) -> None:
    """SIGINT while the worker process is mid-turn, to the demo alone or (a terminal's
    Ctrl-C) to its whole process group: one line, exit 130, no traceback, no worker left
    running."""
    process = subprocess.Popen(
        [*DEMO, "--db", str(tmp_path / "demo.db")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        worker_pid = _wait_for_worker_mid_turn(process)
        if group:
            os.killpg(process.pid, signal.SIGINT)
        else:
            process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=TIMEOUT)
    finally:
        process.kill()
        process.wait(timeout=TIMEOUT)
    assert process.returncode == 130
    assert err.strip() == "Stopped by Ctrl-C; the runtime shut down cleanly."
    with pytest.raises(ProcessLookupError):
        os.kill(worker_pid, 0)


def _wait_for_worker_mid_turn(process: subprocess.Popen[str]) -> int:
    """Read the demo's lines until its worker process reports a running tool call."""
    assert process.stdout is not None
    worker_pid = None
    for line in process.stdout:
        if "started worker process pid" in line:
            worker_pid = int(line.rsplit(" ", 1)[1])
        if worker_pid is not None and "compile_report(" in line:
            return worker_pid
    raise AssertionError("the demo ended before its worker started a tool call")


def test_the_demo_tells_executions_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """The demo's short execution ids differ for executions begun in the same moment. Found
    by the audit (audY55): it showed an id's first 8 hex digits - its time, to about a
    minute - so every turn of a run read "execution 01a24f10", the resumed one too
    ("RESUMED as execution 01a24f10", the killed worker's own id as far as a reader saw)."""
    frozen = 1_800_000_000_000_000_000
    monkeypatch.setattr(_store.common, "time", type("Frozen", (), {"time_ns": lambda: frozen}))
    ids = {_store.new_id() for _ in range(20)}
    assert len({output.short(i) for i in ids}) == len(ids)


@pytest.mark.slow
def test_the_demo_keeps_a_database_written_dot_slash_word_equals(tmp_path: Path) -> None:
    """README: "a file whose name starts with `word=` ... is written `./word=...`". The demo
    accepted `--db ./host=x.db`, then folded it into a `Path` ("host=x.db"), which the
    runtime read as a libpq string: an exception-group traceback, exit 1. Found by the
    audit (audY55). Now it runs, and the command it prints to look at the file works."""
    run = subprocess.run(
        [*DEMO, "--db", "./host=x.db"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Traceback" not in run.stderr
    hint = shlex.split(run.stdout.rstrip().splitlines()[-1].split("Try: ", 1)[1])
    assert hint[:4] == ["python", "-m", "trio_sessions", "status"]
    status = subprocess.run(
        [sys.executable, *hint[1:]], capture_output=True, text=True, timeout=TIMEOUT, cwd=tmp_path
    )
    assert status.returncode == 0, status.stderr
    assert "chat-1" in status.stdout
    assert (tmp_path / "host=x.db").exists()


def test_the_demo_refuses_a_database_it_cannot_create_without_a_traceback(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A `--db` in a directory where no file can be made (no write permission; /proc even
    for root) is refused as the other unusable paths are - one usage line, exit 2. Found by
    the audit (audY55): the demo printed its first lines, then an exception-group
    traceback ending in `StoreError: cannot open ...`, exit 1."""
    outcome = demo.main(["--db", "/proc/trio-sessions-demo.db"])
    printed = capsys.readouterr()
    assert outcome == 2, printed.out + printed.err
    assert "Traceback" not in printed.err and printed.out == "", printed.out + printed.err
    assert "error: argument --db: /proc/trio-sessions-demo.db: cannot create it" in printed.err
