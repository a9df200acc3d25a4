"""Test policy for trio_sessions.

* Concurrency tests are deterministic: pytest-trio's `autojump_clock`, a runtime clock tied
  to trio's virtual time (`trio_sessions.testing.trio_clock`), the inline store (SQLite on
  the trio thread, so virtual time never jumps while a worker thread blocks), gates made of
  `trio.Event`, the `acquisition_hook` and the seams in `trio_sessions.testing`.
  No sleeping "to let things settle".
* Crash tests use real processes killed with SIGKILL against a real SQLite file, bounded in
  time and count (marked `slow`, still part of the regular run).
* Every test has a one-line docstring saying what it proves, and fails when that breaks.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path

import pytest
import trio

from trio_sessions import Store, testing


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "sessions.db"


@pytest.fixture
def store(db_path: Path) -> Store:
    return testing.inline_store(db_path)


@pytest.fixture
def clock(autojump_clock: trio.testing.MockClock) -> Callable[[], float]:
    """A runtime clock (epoch seconds) tied to the autojump virtual clock.

    pytest-trio hands a clock to `trio.run` only when the test itself takes it as an
    argument, so a test using this fixture must also take `autojump_clock` directly.
    """

    def now() -> float:
        return testing.DEFAULT_EPOCH + autojump_clock.current_time()

    return now


def query(db_path: Path, sql: str, params: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
    """Read the database as an operator would, on a separate connection."""
    conn = sqlite3.connect(db_path)
    try:
        return conn.execute(sql, params).fetchall()
    finally:
        conn.close()
