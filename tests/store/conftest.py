"""The store tests' `db`: the `engine` fixture (both backends) at the fixed instant `NOW`."""

from __future__ import annotations

import pytest
from backends import EngineDb

from .common import NOW, Db


@pytest.fixture
def db(engine: EngineDb) -> Db:
    """The store through the sync engine (SQLite file or PostgreSQL schema) at `NOW`."""
    engine.now = NOW
    return Db(engine.engine, engine.location, engine.clock)
