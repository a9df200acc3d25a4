"""The report: table rows, notes, the machine-readable last line and the run's header.

The last line lists every key of `MACHINE_KEYS` in that order; a figure whose section did
not run (or was skipped, e.g. `--no-pg`) prints as `nan`.
"""

from __future__ import annotations

import math
import os
import platform
import sqlite3
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import attrs
import trio

from .. import __version__

MACHINE_KEYS = (
    "cycle_ratio",
    "concurrent_ratio",
    "trio_floor_ratio",
    "trio_floor_concurrent_ratio",
    "raw_cycle_us",
    "recovery_ratio",
    "recovery_floor_ratio",
    "raw_recovery_us",
    "heartbeat_tx_per_tick",
    "wakes_per_iteration",
    "serial_ratio",
    "append_growth",
    "wake_p50_ms",
    "wake_p99_ms",
    "pg_wake_p50_ms",
    "pg_wake_p99_ms",
    "remote_interrupt_p50_ms",
    "due_late_p99_ms",
    "pg_due_late_p99_ms",
    "idle_cpu_pct",
    "takeover_p50_ms",
    "takeover_p99_ms",
    "pg_takeover_p50_ms",
    "pg_takeover_p99_ms",
    "restart_p99_ms",
    "pg_restart_p99_ms",
    "pg_cycle_ratio",
    "pg_concurrent_ratio",
    "pg_raw_cycle_us",
    "pg_calls_ratio",
    "pg_recovery_ratio",
    "pg_raw_recovery_us",
    "watched_slowdown",
    "backlog_stall_ms",
    "chat_ttfw_p99_ms",
    "chat_slowdown_p50",
    "chat_slowdown_p99",
    "chat_submit_p99_ms",
    "chat_errors",
    "pg_chat_ttfw_p99_ms",
    "pg_chat_slowdown_p50",
    "pg_chat_slowdown_p99",
    "pg_chat_submit_p99_ms",
    "pg_chat_errors",
    "console_page_ms",
    "pg_console_page_ms",
    "pg_round_trips_per_cycle",
    "pg_turn_round_trips",
)


@attrs.define
class Row:
    section: str
    figure: str
    value: str
    baseline: str = ""
    ratio: str = ""
    target: str = ""
    verdict: str = ""


@attrs.define
class Report:
    rows: list[Row] = attrs.Factory(list)
    machine: dict[str, float] = attrs.Factory(dict)
    notes: list[str] = attrs.Factory(list)
    header: list[str] = attrs.Factory(list)

    def add(
        self,
        section: str,
        figure: str,
        value: str,
        baseline: str = "",
        ratio: str = "",
        target: str = "",
        verdict: str = "",
    ) -> None:
        self.rows.append(Row(section, figure, value, baseline, ratio, target, verdict))
        progress(f"  {section:<10} {figure:<44} {value}")


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def verdict(ok: bool) -> str:
    return "ok" if ok else "MISSED"


def fmt_rate(per_s: float) -> str:
    return f"{per_s / 1000:,.1f}k/s" if per_s >= 1000 else f"{per_s:,.0f}/s"


def fmt_us(seconds: float) -> str:
    return f"{seconds * 1e6:,.1f} µs"


def fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f} ms"


def fmt_ratio(values: Sequence[float]) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.2f}x"
    return f"{median(values):.2f}x ({min(values):.2f}-{max(values):.2f})"


def render(report: Report) -> str:
    titles = Row("section", "figure", "value", "baseline", "ratio (min-max)", "target", "")
    rows = [titles, *report.rows]
    fields = [f.name for f in attrs.fields(Row)]
    widths = {f: max(len(getattr(r, f)) for r in rows) for f in fields}
    lines = [*report.header, ""]
    for index, row in enumerate(rows):
        cells = [getattr(row, f).ljust(widths[f]) for f in fields]
        lines.append("| " + " | ".join(cells) + " |")
        if index == 0:
            lines.append("|" + "|".join("-" * (widths[f] + 2) for f in fields) + "|")
    if report.notes:
        lines.append("")
        lines.extend(f"* {note}" for note in report.notes)
    return "\n".join(lines)


def machine_line(values: dict[str, float]) -> str:
    def show(value: float) -> str:
        if math.isnan(value):
            return "nan"
        return f"{value:g}" if float(value).is_integer() else f"{value:.3f}"

    return " ".join(f"{key}={show(values.get(key, math.nan))}" for key in MACHINE_KEYS)


def parse_machine_line(line: str) -> dict[str, float]:
    """Parse the last line back into numbers (used by the smoke test and by tooling)."""
    values = {}
    for item in line.split():
        key, _, value = item.partition("=")
        values[key] = float(value)
    return values


def source_revision() -> str:
    """The git commit the package runs from (+ "dirty" with local changes), if it is a checkout."""
    root = Path(__file__).resolve().parent.parent.parent
    try:
        commit = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "not a git checkout"
    return f"git {commit}{' + local changes' if dirty else ''}"


def machine_header(folder: Path) -> list[str]:
    cpu = "unknown cpu"
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        load = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        load = "unknown"
    return [
        f"trio_sessions {__version__} bench ({source_revision()}): SQLite WAL, "
        f"synchronous=NORMAL, files under {folder}",
        f"machine: {os.cpu_count()} vCPU {cpu}; {platform.system()} {platform.release()}; "
        f"load average at start {load}",
        f"python {platform.python_version()}, SQLite {sqlite3.sqlite_version}, "
        f"trio {trio.__version__}; start-up heap frozen (gc.freeze(), as the worker command)",
    ]
