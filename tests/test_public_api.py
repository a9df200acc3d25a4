"""The public surface as a new user meets it (issue 21, item 12): exactly the curated names,
each object under one name, the documented names present, errors that name the right
argument, what a drain's KeyboardInterrupt/SystemExit does, the `examples` extra, and the
README's trial PostgreSQL server recipe run as written."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tomllib
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from helpers import runtime

import trio_sessions
from trio_sessions import DrainContext, testing

ROOT = Path(__file__).parent.parent
README = (ROOT / "README.md").read_text()
Clock = Callable[[], float]

PUBLIC = {
    "AssistantData",
    "AssistantWriter",
    "Claim",
    "DrainContext",
    "DuplicateSettlement",
    "Input",
    "InputConflict",
    "LeaseLost",
    "MalformedRecord",
    "Message",
    "MessageFinished",
    "Outcome",
    "OutcomeUnknown",
    "PostgresStore",
    "RecoveryReport",
    "Runtime",
    "RuntimeStatistics",
    "SQLiteStore",
    "SchemaTooNew",
    "SessionBusy",
    "Store",
    "StoreError",
    "StreamEvent",
    "TextPart",
    "ToolPart",
    "TrioSessionsError",
    "UnknownToolCall",
    "open_runtime",
    "serve_runtime",
    "unanswered",
}
# The 0.1 name of SQLiteStore, kept through 0.x: the one object with two public names.
ALIASES = {"Store": "SQLiteStore"}


def public_names() -> set[str]:
    """What `dir(trio_sessions)` offers a user, public submodules (`testing`, ...) aside:
    which of those were imported depends on the program, not on the package."""
    return {
        name
        for name in dir(trio_sessions)
        if not name.startswith("_")
        and not isinstance(getattr(trio_sessions, name), types.ModuleType)
    }


def test_the_public_names_are_exactly_the_curated_list() -> None:
    """`dir(trio_sessions)` shows the curated names - `PostgresStore` (imported on first use)
    and `RuntimeStatistics` included, nothing like `TYPE_CHECKING` - and each resolves."""
    assert public_names() == PUBLIC
    assert "TYPE_CHECKING" not in dir(trio_sessions)
    for name in PUBLIC:
        assert getattr(trio_sessions, name) is not None
    stats = trio_sessions.RuntimeStatistics
    assert stats.__module__.startswith("trio_sessions.")
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        trio_sessions.Nope  # noqa: B018


def test_each_public_object_is_exported_once() -> None:
    """No object has two public names, except the documented alias `Store`."""
    names_of: dict[int, set[str]] = {}
    for name in PUBLIC:
        names_of.setdefault(id(getattr(trio_sessions, name)), set()).add(name)
    shared = sorted(sorted(names) for names in names_of.values() if len(names) > 1)
    assert shared == [sorted({alias, target}) for alias, target in ALIASES.items()]


async def test_runtime_statistics_is_what_statistics_returns(
    tmp_path: Path, clock: Clock, autojump_clock: trio.testing.MockClock
) -> None:
    """`runtime.statistics()` returns the documented `trio_sessions.RuntimeStatistics`."""
    store = testing.inline_store(tmp_path / "db")
    async with trio_sessions.open_runtime(store, None, clock=clock) as rt:
        assert isinstance(rt.statistics(), trio_sessions.RuntimeStatistics)


async def test_an_empty_owner_id_is_refused_as_an_owner_id(tmp_path: Path) -> None:
    """The error for a bad owner id names the owner id, not a session id."""
    for bad in ("", "a\nb"):
        with pytest.raises(ValueError, match=r"^owner id") as caught:
            async with trio_sessions.open_runtime(tmp_path / "db", None, owner_id=bad):
                pass  # pragma: no cover - refused before opening
        assert "session" not in str(caught.value)
    with pytest.raises(TypeError, match=r"^owner id"):
        async with trio_sessions.open_runtime(tmp_path / "db", None, owner_id=3):  # type: ignore[arg-type]
            pass  # pragma: no cover


@pytest.mark.parametrize("stop", [KeyboardInterrupt, SystemExit])
async def test_a_drain_raising_keyboardinterrupt_or_systemexit_ends_the_runtime(
    store: Any,
    clock: Clock,
    autojump_clock: trio.testing.MockClock,
    stop: type[BaseException],
) -> None:
    """Not an outcome: as in any trio program, the exception ends the whole runtime and
    escapes the `open_runtime` block, unwrapped (documented in its docstring and README)."""

    async def drain(ctx: DrainContext) -> None:
        raise stop()

    async def use_runtime() -> None:
        async with runtime(store, drain, clock) as rt:
            await rt.run("s")
            await trio.sleep_forever()  # cancelled: the runtime is ending

    with pytest.raises(stop):
        await use_runtime()
    assert "KeyboardInterrupt" in (trio_sessions.open_runtime.__doc__ or "")
    assert "`KeyboardInterrupt` or `SystemExit`" in README


# --- documentation that a new user follows ------------------------------------------------------


def test_the_examples_extra_installs_what_the_chat_example_needs() -> None:
    """`pip install '.[examples,postgres]'` (the README's line) brings hypercorn's trio worker
    and httpx: the chat example runs after it."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extras = pyproject["project"]["optional-dependencies"]
    assert extras["examples"] == pyproject["dependency-groups"]["examples"]
    assert {re.split(r"[<>=]", requirement)[0] for requirement in extras["examples"]} == {
        "hypercorn[trio]",
        "httpx",
    }
    assert "pip install '.[examples,postgres]'" in README


def test_the_readme_states_one_sqlite_change_signal() -> None:
    """The README describes SQLite's change detection once, as the code does it: an inotify
    watch on the WAL file (Linux), else a 5 ms `PRAGMA data_version` poll."""
    assert "every 5 ms (`PRAGMA data_version` on SQLite" not in README
    assert README.count("inotify") >= 2  # the configuration section and the performance notes


def run_trial_server() -> None:
    """The README's recipe: start the trial server, use its URL, stop it with SIGTERM."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRIO_SESSIONS_")}
    env["PYTHONPATH"] = str(ROOT)
    with subprocess.Popen(
        [sys.executable, "-m", "trio_sessions", "pg-trial-server"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        env=env,
        cwd="/",
        text=True,
    ) as server:
        assert server.stdout is not None and server.stderr is not None
        try:
            line = server.stdout.readline()  # printed once the server accepts connections
            assert line.startswith("postgresql://"), line
            url = line.strip()

            async def use() -> list[Any]:
                async with trio_sessions.open_runtime(url, None) as producer:
                    await producer.submit("trial", {"text": "hello"})
                    return await producer.transcript("trial")

            assert trio.run(use) == []  # stored as an input; no drain took it
            server.send_signal(signal.SIGTERM)
            assert server.wait(30) == 0
            assert "trial PostgreSQL server stopped" in server.stderr.read()
        finally:
            if server.poll() is None:
                server.kill()
                server.wait()


@pytest.mark.slow
def test_the_trial_postgresql_server_recipe_works() -> None:
    """`python -m trio_sessions pg-trial-server` prints a URL a runtime can use, and exits 0
    on SIGTERM (as root it runs the server as an unprivileged user)."""
    assert "python -m trio_sessions pg-trial-server" in README
    run_trial_server()


def test_the_readme_names_every_public_name_and_method() -> None:
    """README.md documents the public surface: each public name, and each public method and
    attribute of `Runtime`, `DrainContext` and `AssistantWriter`, is named in it (the error
    classes, `Outcome`, `run`, `recover_once` and `is_active` were missing)."""
    missing = [name for name in sorted(PUBLIC) if not re.search(rf"\b{name}\b", README)]
    members = {
        trio_sessions.Runtime: set(dir(trio_sessions.Runtime)),
        trio_sessions.DrainContext: set(dir(trio_sessions.DrainContext))
        | {"session_id", "execution_id", "owner_id", "attempt", "resumed"},
        trio_sessions.AssistantWriter: set(dir(trio_sessions.AssistantWriter)),
    }
    missing += [
        f"{cls.__name__}.{name}"
        for cls, names in members.items()
        for name in sorted(names)
        if not name.startswith("_") and not re.search(rf"[.`]{name}\b", README)
    ]
    assert missing == []


def test_every_log_event_is_in_the_readmes_logging_table() -> None:
    """Each stable log message of `_observe` (new ones included: `claim attempt failed`,
    the WAL and database file events) is documented in the README."""
    from trio_sessions import _observe

    messages = {
        name: value
        for name, value in vars(_observe).items()
        if name.isupper() and isinstance(value, str) and not value.startswith("trio_sessions.")
    }
    assert {"CLAIM_ATTEMPT_FAILED", "WAL_NOT_CHECKPOINTED", "DATABASE_FILE_LOST"} <= set(messages)
    assert [name for name, message in messages.items() if f"`{message}`" not in README] == []
