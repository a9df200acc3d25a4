"""The throwaway PostgreSQL server the test suite, the soak and the bench start
(`trio_sessions._soak.pgserver`): a free port chosen, then taken by another process before
the server bound it, is no failure - the server starts on another free port. CI lost a
whole soak so: "could not bind IPv4 address ... Address already in use", the server
exited, and the soak with it (its parallel soaks each start a server)."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import psycopg
import pytest

from trio_sessions._soak import pgserver


def test_a_free_port_taken_before_the_server_bound_it_is_chosen_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    free_port = pgserver._free_port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        taken_port = taken.getsockname()[1]
        ports: Iterator[int] = iter([taken_port])
        # The first choice is a port another process holds by the time the server binds.
        monkeypatch.setattr(pgserver, "_free_port", lambda: next(ports, None) or free_port())
        with pgserver.throwaway_server() as server:
            assert server.port != taken_port
            with psycopg.connect(server.url, connect_timeout=5) as conn:
                assert conn.execute("SELECT 1").fetchone() == (1,)


def test_a_port_given_and_taken_still_fails_naming_the_log() -> None:
    """A port the caller chose is never silently replaced: its server's failure says why."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with (
            pytest.raises(pgserver.ServerDidNotStart, match="could not"),
            pgserver.throwaway_server(port=port),
        ):
            pass
