"""The SQLite file (DESIGN §8, issue 21 items 8-10): created readable by its owner only, a
file deleted or replaced under a running runtime is noticed at the next write batch, and a
WAL that cannot be checkpointed is logged once it passes a bound.

SQLite-only by nature. Real time, on the production (threaded) store unless a test says
otherwise: the checks live in the executors' write paths.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from helpers import records

import trio_sessions
from trio_sessions import Store, StoreError, _sqlite, testing
from trio_sessions import _observe as events
from trio_sessions._errors import StoreLost

TESTS = Path(__file__).parent
DEADLINE = 20.0  # seconds a subprocess gets to reach an expected state


@pytest.fixture
def permissive_umask() -> Iterator[None]:
    """umask 000: a file's mode is what its creator asked for, nothing masked away."""
    previous = os.umask(0)
    try:
        yield
    finally:
        os.umask(previous)


def modes(path: Path) -> dict[str, str]:
    """The permission bits of the database and of its -wal and -shm files."""
    found = {}
    for suffix in ("", "-wal", "-shm"):
        file = Path(f"{path}{suffix}")
        assert file.exists(), f"{file} does not exist: its mode would prove nothing"
        found[suffix or "db"] = oct(stat.S_IMODE(file.stat().st_mode))
    return found


OWNER_ONLY = {"db": "0o600", "-wal": "0o600", "-shm": "0o600"}


# --- item 9: 0600 -------------------------------------------------------------------------------


@pytest.mark.parametrize("inline", [False, True], ids=["threaded", "inline"])
async def test_the_database_and_its_wal_and_shm_are_created_owner_only(
    tmp_path: Path, permissive_umask: None, inline: bool
) -> None:
    """With umask 000, the file a runtime creates and its -wal/-shm are 0600."""
    path = tmp_path / "sessions.db"
    async with trio_sessions.open_runtime(Store(path, inline=inline), None) as rt:
        await rt.submit("s", {"text": "private"})
        assert modes(path) == OWNER_ONLY


async def test_a_database_created_through_a_provisioned_symlink_is_owner_only(
    tmp_path: Path, permissive_umask: None
) -> None:
    """A deployment's symlink provisioned before the first run (`chat.db -> data/chat.db`,
    its target not yet there): the file created at the target is 0600 too. Creating with
    O_EXCL on the link failed (a symlink exists), so SQLite created it 0644."""
    (tmp_path / "data").mkdir()
    link = tmp_path / "chat.db"
    link.symlink_to(tmp_path / "data" / "chat.db")
    async with trio_sessions.open_runtime(link, None) as rt:
        await rt.submit("s", {"text": "private"})
        assert modes(tmp_path / "data" / "chat.db") == OWNER_ONLY


async def test_an_existing_files_mode_is_left_as_the_user_set_it(tmp_path: Path) -> None:
    """A database file that exists already keeps its mode (the operator chose it)."""
    path = tmp_path / "sessions.db"
    path.touch()
    path.chmod(0o640)
    async with trio_sessions.open_runtime(path, None) as rt:
        await rt.submit("s", {"text": "shared with the group"})
    assert oct(stat.S_IMODE(path.stat().st_mode)) == "0o640"


def test_the_worker_command_creates_the_database_owner_only(
    tmp_path: Path, permissive_umask: None
) -> None:
    """The file `python -m trio_sessions worker` creates, and its -wal/-shm, are 0600."""
    path = tmp_path / "worker.db"
    log = tmp_path / "worker.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRIO_SESSIONS_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "trio_sessions", "worker", "worker_drain:reply"]
    with log.open("wb") as out:
        worker = subprocess.Popen(
            [*command, "--store", str(path)],
            cwd=tmp_path,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=out,
        )
    try:
        deadline = time.monotonic() + DEADLINE
        while "worker started" not in log.read_text():
            assert worker.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)  # a real process: poll its log, bounded
        assert modes(path) == OWNER_ONLY
    finally:
        worker.terminate()
        worker.wait(DEADLINE)


# --- item 8: a deleted or replaced file ---------------------------------------------------------


def replace_with_other_database(path: Path) -> None:
    """Put another (valid, empty) SQLite database where `path` was."""
    other = path.with_name("other.db")
    sqlite3.connect(other).close()
    os.replace(other, path)


def delete(path: Path) -> None:
    path.unlink()


@pytest.mark.parametrize("inline", [False, True], ids=["threaded", "inline"])
@pytest.mark.parametrize("swap", [delete, replace_with_other_database], ids=["deleted", "replaced"])
async def test_a_deleted_or_replaced_database_file_fails_the_next_write(
    tmp_path: Path, logs: pytest.LogCaptureFixture, inline: bool, swap: Any
) -> None:
    """After the file is deleted or replaced under a running runtime, the next write (alone,
    or grouped with others) raises `StoreError` instead of committing into the orphaned
    inode, and the event is logged once."""
    path = tmp_path / "sessions.db"
    async with trio_sessions.open_runtime(Store(path, inline=inline), None) as rt:
        await rt.submit("s", {"n": 0})
        swap(path)
        with pytest.raises(StoreError, match=r"sessions\.db.*(deleted|replaced)"):
            await rt.submit("s", {"n": 1})
        errors: list[BaseException] = []

        async def submit(n: int) -> None:
            try:
                await rt.submit("s", {"n": n})
            except StoreError as exc:
                errors.append(exc)

        async with trio.open_nursery() as nursery:  # a group commit, on the threaded store
            for n in range(2, 6):
                nursery.start_soon(submit, n)
        assert len(errors) == 4
    [record] = records(logs, events.DATABASE_FILE_LOST)
    assert record.levelno == logging.ERROR
    assert record.path == str(path.absolute())
    assert record.problem in ("deleted", "replaced")
    if path.exists():  # the replacement was never written to
        with sqlite3.connect(path) as conn:
            assert conn.execute("SELECT count(*) FROM sqlite_master").fetchone() == (0,)


def overwrite_in_place(path: Path) -> None:
    """Garbage over the file's first pages, same inode (a disk fault, a `dd` gone wrong),
    once every commit was copied out of the WAL: SQLite now reads "not a database"."""
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    with path.open("r+b") as file:
        file.write(b"garbage!" * 1024)


async def test_a_write_to_a_file_that_is_no_database_now_raises_store_error(
    tmp_path: Path,
) -> None:
    """A file damaged in place (the identity check cannot see it) fails each write with
    `StoreError`, alone or grouped: never the driver's bare `DatabaseError` out of the
    event loop's non-waiting BEGIN, and never a grouped caller told it succeeded while the
    pump that was to run its write died."""
    path = tmp_path / "sessions.db"
    errors: list[BaseException] = []
    results: list[object] = []

    async def submit(n: int) -> None:
        try:
            results.append(await rt.submit("s", {"n": n}))
        except StoreError as exc:
            errors.append(exc)

    with trio.fail_after(DEADLINE):
        async with trio_sessions.open_runtime(path, None) as rt:
            await rt.submit("s", {"n": 0})
            overwrite_in_place(path)
            async with trio.open_nursery() as nursery:  # a group commit through the pump
                for n in range(1, 5):
                    nursery.start_soon(submit, n)
            await submit(5)  # a lone caller, on the loop
            assert (results, len(errors)) == ([], 5)
            assert all("not a database" in str(error) for error in errors)


async def test_a_change_look_that_fails_is_a_lost_signal_not_the_runtimes_end(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """The change signal's `PRAGMA data_version` on a file damaged in place (or an I/O
    error) raised the driver's error out of the change loop, ending the runtime with a bare
    `DatabaseError`; it is a lost signal instead, and the fallback poll still returns."""
    path = tmp_path / "sessions.db"
    _sqlite.connect(path).close()
    conn = _sqlite.connect_nonblocking(path)
    try:
        reader = _sqlite.ChangeReader(conn, time.time, _sqlite.CHANGE_POLL)
        overwrite_in_place(path)
        started = trio.current_time()
        with trio.fail_after(5):
            await reader.wait_for_change(trio.Event(), 1.0)
        # No change seen: it returned at the fallback poll, which then looks at the store.
        assert trio.current_time() - started >= 1.0
    finally:
        conn.close()


@pytest.mark.parametrize("swap", [delete, replace_with_other_database], ids=["deleted", "replaced"])
async def test_a_runtime_whose_file_is_gone_ends_instead_of_failing_for_ever(
    tmp_path: Path, swap: Any
) -> None:
    """Once the file is deleted or replaced, a runtime that drains can never write again:
    its next recovery pass ends its block with the `StoreError` (a worker exits and its
    supervisor restarts it on the right file) instead of failing and logging every pass
    for ever."""
    path = tmp_path / "sessions.db"

    async def take(ctx: trio_sessions.DrainContext) -> None:
        await ctx.take_inputs()

    async def serve_until_it_ends() -> None:
        async with trio_sessions.open_runtime(path, take, recovery_interval=0.05):
            swap(path)
            await trio.sleep_forever()

    with (
        trio.fail_after(DEADLINE),
        pytest.raises(StoreLost, match=r"sessions\.db.*(deleted|replaced)"),
    ):
        await serve_until_it_ends()


async def test_a_relative_path_still_names_the_same_file_after_a_chdir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The identity check follows the file the runtime opened, not the working directory."""
    monkeypatch.chdir(tmp_path)
    async with trio_sessions.open_runtime("sessions.db", None) as rt:
        elsewhere = tmp_path / "elsewhere"
        elsewhere.mkdir()
        monkeypatch.chdir(elsewhere)
        await rt.submit("s", {"text": "still the same file"})
    assert not (elsewhere / "sessions.db").exists()


# --- item 10: a WAL that cannot be checkpointed ------------------------------------------------


async def test_a_wal_held_by_a_reader_that_never_ends_is_logged_once_past_the_bound(
    tmp_path: Path, logs: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader on another connection that never ends its transaction keeps the WAL from
    restarting: once the WAL passes the bound, one WARNING says so with its size, however
    many checkpoints follow; after the reader ends and the WAL restarts, a new crossing is
    logged again."""
    bound = 256 * 1024
    monkeypatch.setattr(_sqlite.executors, "WAL_WARN_BYTES", bound)
    monkeypatch.setattr(_sqlite.executors, "CHECKPOINT_EVERY", 10)
    monkeypatch.setattr(_sqlite.executors, "WAL_RESTART_FRAMES", 20)
    path = tmp_path / "sessions.db"
    payload = {"text": "x" * 2000}

    async def grow_until_warned(rt: trio_sessions.Runtime, warnings: int) -> None:
        with trio.fail_after(DEADLINE):
            while len(records(logs, events.WAL_NOT_CHECKPOINTED)) < warnings:
                await rt.submit("s", payload)
                await trio.lowlevel.checkpoint()  # let the checkpoint task report

    async with trio_sessions.open_runtime(Store(path), None) as rt:
        reader = sqlite3.connect(path)
        try:
            reader.execute("BEGIN")
            reader.execute("SELECT count(*) FROM session").fetchone()  # holds its snapshot
            await grow_until_warned(rt, 1)
            for _ in range(200):  # many more checkpoints, the reader still holding
                await rt.submit("s", payload)
                await trio.lowlevel.checkpoint()
            [record] = records(logs, events.WAL_NOT_CHECKPOINTED)
        finally:
            reader.close()
        assert record.levelno == logging.WARNING
        assert record.wal_bytes >= bound and record.wal_frames > 0
        assert record.bound_bytes == bound
        assert record.path == str(path.absolute())
        with trio.fail_after(DEADLINE):  # the reader is gone: the WAL restarts
            executor: Any = rt._db
            while executor._wal_warned:
                await rt.submit("s", {"text": "small"})
                await trio.lowlevel.checkpoint()
        reader = sqlite3.connect(path)
        try:
            reader.execute("BEGIN")
            reader.execute("SELECT count(*) FROM session").fetchone()
            await grow_until_warned(rt, 2)
        finally:
            reader.close()


async def test_a_file_another_connection_holds_exclusively_is_named_locked_not_foreign(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another connection in exclusive locking mode keeps even readers out: opening the
    store fails after the busy timeout with a `StoreError` that says the file is locked by
    another connection - not that it "is not an SQLite database" (an operator told that
    might delete a healthy file) - and leaves it unchanged."""
    from trio_sessions._sqlite import connections

    path = tmp_path / "sessions.db"
    async with trio_sessions.open_runtime(Store(path), None) as producer:
        await producer.submit("s", {"n": 1})
    monkeypatch.setattr(connections, "BUSY_TIMEOUT_MS", 100)
    holder = sqlite3.connect(path, isolation_level=None)
    try:
        holder.execute("PRAGMA locking_mode = EXCLUSIVE")
        holder.execute("BEGIN EXCLUSIVE")
        holder.execute("COMMIT")  # the exclusive locking mode keeps the lock
        with pytest.raises(StoreError) as refused:
            async with trio_sessions.open_runtime(Store(path), None):
                pass  # pragma: no cover
    finally:
        holder.close()
    message = str(refused.value)
    assert "locked by another connection" in message, message
    assert "not an SQLite database" not in message
    with sqlite3.connect(path) as check:
        assert check.execute("SELECT session_id FROM session_input").fetchall() == [("s",)]


# --- a file that is not ours ----------------------------------------------------------------


async def test_a_failed_migration_leaves_a_foreign_sqlite_file_as_it_was(tmp_path: Path) -> None:
    """An SQLite file of another application (its own `session` table, rollback journal)
    is refused with a StoreError, and the refused migration leaves the file as it was: still
    in its journal mode, not switched to WAL."""
    path = tmp_path / "app.db"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE session(token TEXT PRIMARY KEY, user_id INTEGER)")
    conn.execute("INSERT INTO session VALUES ('abc', 1)")
    conn.commit()
    assert conn.execute("PRAGMA journal_mode").fetchone() == ("delete",)
    conn.close()
    with pytest.raises(StoreError, match="session already exists"):
        async with trio_sessions.open_runtime(path, None):
            pass  # pragma: no cover
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("delete",)
        assert conn.execute("SELECT * FROM session").fetchall() == [("abc", 1)]
    finally:
        conn.close()


# --- a file named through a symlink --------------------------------------------------------------


async def test_a_dead_owner_is_taken_over_after_the_grace_through_a_symlinked_name(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """Deployments often name the database through a symlink (`/srv/app/chat.db` ->
    `/data/chat.db`). SQLite opens the file the link names, and the liveness tokens sit
    beside that file; recovery must look for a dead owner's token there too, or a SIGKILLed
    owner's sessions wait for the whole lease instead of the grace (§6.22)."""
    real = tmp_path / "data"
    real.mkdir()
    link = tmp_path / "chat.db"
    link.symlink_to(real / "chat.db")
    store = testing.inline_store(link)
    clock = testing.trio_clock()
    entered = trio.Event()

    async def holding(ctx: trio_sessions.DrainContext) -> None:
        await ctx.take_inputs()
        entered.set()
        await trio.sleep_forever()

    resumed: list[str] = []

    async def resume(ctx: trio_sessions.DrainContext) -> None:
        resumed.append(ctx.session_id)

    quiet: dict[str, Any] = {"clock": clock, "recovery_interval": 1e6, "takeover_grace": 0.5}
    async with trio_sessions.open_runtime(store, resume, **quiet) as other:
        async with trio_sessions.open_runtime(store, holding, **quiet) as owner:
            await owner.submit("s", {"n": 1})
            await entered.wait()
            testing.crash(owner)
        assert (await other.recover_once()).resumed == 0  # seen free once: not yet gone
        await trio.sleep(1.0)  # past the grace, long before the 30 s lease runs out
        assert (await other.recover_once()).resumed == 1
        await other.wait_idle("s")
    assert resumed == ["s"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the WAL watch is inotify")
async def test_a_store_named_through_a_symlink_watches_its_wal_instead_of_polling(
    tmp_path: Path,
) -> None:
    """SQLite keeps the WAL beside the file a symlinked name resolves to, not beside the
    link: the change signal must watch that WAL. Watching `<link>-wal` (no such file) fell
    back to the 5 ms poll: an idle runtime used ~4% of a core instead of ~0.3% (§7: <= 1%)."""
    real = tmp_path / "data"
    real.mkdir()
    link = tmp_path / "chat.db"
    link.symlink_to(real / "chat.db")
    async with _sqlite.SQLiteStore(link).open_executor(None) as executor:
        assert isinstance(executor, _sqlite.ThreadExecutor)
        assert executor.reader.watch is not None


async def test_a_wal_grown_past_the_bound_shrinks_back_once_it_restarts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader holding a snapshot (or several processes writing at once, whose checkpoints
    race each other's commits) keeps the WAL from restarting while it grows; once it
    restarts, its file is cut back to the bound (`journal_size_limit`). Before, the file
    kept its largest size for good - a disk high-water mark that only grew (104 MB over a
    22 MB database after 40 s of three processes writing at once)."""
    bound = 256 * 1024
    monkeypatch.setattr(_sqlite.connections, "WAL_SIZE_LIMIT", bound)
    monkeypatch.setattr(_sqlite.executors, "CHECKPOINT_EVERY", 10)
    monkeypatch.setattr(_sqlite.executors, "WAL_RESTART_FRAMES", 20)
    path = tmp_path / "sessions.db"
    wal = trio.Path(f"{path}-wal")
    async with trio_sessions.open_runtime(Store(path), None) as rt:
        reader = sqlite3.connect(path)
        try:
            reader.execute("BEGIN")
            reader.execute("SELECT count(*) FROM session").fetchone()  # holds its snapshot
            for _ in range(200):
                await rt.submit("s", {"text": "x" * 2000})
            grown = (await wal.stat()).st_size
        finally:
            reader.close()
        with trio.fail_after(DEADLINE):  # the reader is gone: the WAL restarts, cut back
            while (await wal.stat()).st_size > bound:
                await rt.submit("s", {"text": "small"})
                await trio.sleep(0.001)
    assert grown > 2 * bound
