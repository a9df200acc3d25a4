"""A PostgreSQL server for the test suite (a helper, not a test file).

The server starter lives in the package (`trio_sessions._soak.pgserver`), because the soak
starts one too; see there for how it is found, started and stopped.
"""

from __future__ import annotations

from trio_sessions._soak.pgserver import URL_ENV, ServerDidNotStart, postgres_url

__all__ = ["URL_ENV", "ServerDidNotStart", "postgres_url"]
