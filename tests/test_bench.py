"""Smoke run of `python -m trio_sessions.bench` with tiny N: every section's code path runs,
PostgreSQL included (the suite's server), and the machine-readable last line parses.
Timings are never asserted (DESIGN §7: speed is measured by the benchmark, not by timed
tests)."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from trio_sessions import bench
from trio_sessions._bench.recovery import (
    RecoveryTimes,
    add_recovery_rows,
    raw_contract_reclaim,
    seed_recovery,
    trio_floor_recovery,
)
from trio_sessions._bench.report import Report
from trio_sessions._bench.tools import raw_db

TINY = [
    "--rounds", "1",
    "--cycles", "6",
    "--concurrent", "5",
    "--wakes", "20",
    "--heartbeat-drains", "3,7",
    "--heartbeat-ticks", "2",
    "--recovery", "12",
    "--recovery-rounds", "1",
    "--recovery-batch", "5",
    "--idle", "50",
    "--active", "10",
    "--interrupts", "4",
    "--appends", "3",
    "--append-rounds", "1",
    "--remote", "3",
    "--idle-seconds", "0.2",
    "--takeover-rounds", "1",
    "--pg-rounds", "1",
    "--pg-cycles", "4",
    "--pg-concurrent", "5",
    "--pg-recovery", "12",
    "--watched-cycles", "3",
    "--watched-messages", "300",
    "--backlog", "450",
    "--chat-sessions", "3",
    "--chat-words", "3",
    "--chat-pace", "0.01",
    "--console-sessions", "600",
]  # fmt: skip


def test_smoke_run_prints_table_and_machine_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], pg_url: str
) -> None:
    """A tiny full run prints the table and ends with one parseable key=value line with
    every key, whose counts (not timings) are the ones the design promises."""
    assert bench.main([*TINY, "--dir", str(tmp_path), "--pg-url", pg_url]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    for section in ("cycle", "memory", "append", "remote", "idle", "postgres", "load", "chat"):
        assert any(line.startswith(f"| {section} ") for line in lines), section
    values = bench.parse_machine_line(lines[-1])
    assert list(values) == list(bench.MACHINE_KEYS)
    assert all(math.isfinite(v) and v >= 0 for v in values.values()), values
    zero_allowed = {"idle_cpu_pct", "chat_errors", "pg_chat_errors"}
    assert all(v > 0 for key, v in values.items() if key not in zero_allowed), values
    assert values["chat_errors"] == values["pg_chat_errors"] == 0
    assert values["heartbeat_tx_per_tick"] == 1
    assert values["wakes_per_iteration"] == 20 / 2


def test_sections_subset_leaves_other_figures_nan(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--sections` runs only the named sections; figures of the others print as nan, and
    `--no-pg` starts no server."""
    assert bench.main([*TINY, "--sections", "coalescing", "--no-pg", "--dir", str(tmp_path)]) == 0
    values = bench.parse_machine_line(capsys.readouterr().out.strip().splitlines()[-1])
    assert values["wakes_per_iteration"] == 10
    assert math.isnan(values["cycle_ratio"])
    assert math.isnan(values["pg_cycle_ratio"])


def test_a_run_in_a_used_folder_starts_from_fresh_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--dir` given twice: each run writes a new run-* folder inside it, so the second
    run's chats are not answered by the first run's transcripts (an answer is never seen
    sooner than the model's own pace)."""
    args = [*TINY, "--sections", "chat", "--no-pg", "--dir", str(tmp_path)]
    for _ in range(2):
        assert bench.main(args) == 0
        values = bench.parse_machine_line(capsys.readouterr().out.strip().splitlines()[-1])
        assert values["chat_errors"] == 0
        assert values["chat_slowdown_p50"] >= 1.0, values
    assert len(list(tmp_path.glob("run-*/chat.db"))) == 2


def test_rejects_unknown_section() -> None:
    """An unknown section name is a usage error, not a silent no-op."""
    with pytest.raises(SystemExit):
        bench.main(["--sections", "cycle,nonsense"])


def test_rejects_pg_url_with_no_pg() -> None:
    """`--no-pg` with `--pg-url` contradicts itself: a usage error before anything runs."""
    with pytest.raises(SystemExit):
        bench.main(["--no-pg", "--pg-url", "postgresql://nowhere/db"])


def test_runs_without_psycopg_given_no_pg(tmp_path: Path) -> None:
    """psycopg is an optional extra: where it cannot be imported, `--no-pg` still runs."""
    code = (
        "import sys; sys.modules['psycopg'] = None; from trio_sessions import bench; "
        "sys.exit(bench.main(sys.argv[1:]))"
    )
    args = [*TINY, "--sections", "coalescing", "--no-pg", "--dir", str(tmp_path)]
    done = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert (
        bench.parse_machine_line(done.stdout.strip().splitlines()[-1])["wakes_per_iteration"] == 10
    )


def test_a_recovery_row_is_judged_against_its_own_target() -> None:
    """PostgreSQL's recovery row (>= 0.3x) is met at 0.31x; SQLite's (>= 0.5x) is not."""
    report = Report()
    times = RecoveryTimes(
        {"raw": [1.0], "threaded": [3.2], "inline": [3.2], "takeover": [2.0]},
        {"threaded": [0.31], "inline": [0.31], "takeover": [0.5]},
        10,
    )
    rows = (("threaded", "pg", 0.3), ("inline", "sqlite", 0.5), ("takeover", "held", None))
    add_recovery_rows(report, "s", 100, 10, times, rows)
    assert [(row.target, row.verdict) for row in report.rows[1:]] == [
        (">= 0.3x", "ok"),
        (">= 0.5x", "MISSED"),
        ("", ""),
    ]


@pytest.mark.parametrize("kind", ["contract", "floor"])
def test_the_recovery_baselines_do_the_contracts_writes(tmp_path: Path, kind: str) -> None:
    """The recovery section's contract writes (raw SQL) and trio floor take over and release
    every expired claim, leave no recovery lease and reset every resume count, and leave
    the live claims of another owner alone - the work the library's recovery does."""
    path = tmp_path / "floor.db"
    seed_recovery(path, 23)
    if kind == "contract":
        _, reclaimed = raw_contract_reclaim(path, 5)
    else:
        _, reclaimed = trio.run(trio_floor_recovery, path, 5)
    assert reclaimed == 23
    with raw_db(path) as conn:
        owners = conn.execute("SELECT owner_id, COUNT(*) FROM session_execution GROUP BY 1")
        assert dict(owners.fetchall()) == {"alive": 23}
        assert conn.execute("SELECT COUNT(*) FROM session_recovery").fetchone() == (0,)
        assert conn.execute("SELECT SUM(wake_attempts) FROM session").fetchone() == (0,)
