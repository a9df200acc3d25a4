"""SQLite's change signal does not react to the runtime's own commits (issue 24 item 2):
its own work is handled where it is done, so a look (`_store.changes`) after each of its
commits reads nothing new. Another connection's commit is still a look; an own commit to a
session a local watcher follows offers the watcher its change itself, or has the change loop
look (the store closing an answer left open); a scheduled input submitted here still starts
on time (the runtime arms its due timer itself).

These run on the threaded store in real time, bounded by `fail_after`; the fallback poll and
recovery are an hour away, so only the change signal (or the local path) can be what acts.
The last test checks the reader's decision itself, deterministically, on raw connections.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trio.testing

import trio_sessions
from trio_sessions import AssistantData, DrainContext, _loops, _store, testing
from trio_sessions._backend import Job
from trio_sessions._sqlite.changes import ChangeReader
from trio_sessions._sqlite.connections import connect, connect_nonblocking
from trio_sessions._sqlite.engine import run_batch, try_run_batch

NO_RECOVERY: dict[str, Any] = {"recovery_interval": 3600.0}
BOUND = 10.0  # seconds of real time; the machine may be shared and slow
CYCLES = 200


@attrs.define
class Looks:
    """The change loops' looks (`_store.changes` reads), counted; `next()` waits for one."""

    count: int = 0
    _done: trio.Event = attrs.Factory(trio.Event)

    def looked(self) -> None:
        self.count += 1
        self._done.set()
        self._done = trio.Event()

    async def next(self) -> None:
        """Return after the next look (a read runs whole in one step of the event loop, so
        it sees every commit made before this call)."""
        await self._done.wait()


@pytest.fixture
def looks(monkeypatch: pytest.MonkeyPatch) -> Looks:
    """Counts looks; no fallback poll."""
    monkeypatch.setattr(_loops, "CHANGE_FALLBACK_POLL", 3600.0)
    return counted_looks(monkeypatch)


def counted_looks(monkeypatch: pytest.MonkeyPatch) -> Looks:
    """Counts looks (`_store.changes` reads)."""
    counted = Looks()
    changes = _store.changes

    def counted_changes(tx: Any, *args: Any) -> Any:
        try:
            return changes(tx, *args)
        finally:
            counted.looked()

    monkeypatch.setattr(_store, "changes", counted_changes)
    return counted


async def test_own_cycles_cause_no_look(tmp_path: Path, looks: Looks) -> None:
    """200 sequential submit / drain / release cycles of this runtime's own: at most the
    start-up look, none per commit."""

    async def drain(ctx: DrainContext) -> None:
        await ctx.take_inputs()

    with trio.fail_after(BOUND):
        async with trio_sessions.open_runtime(tmp_path / "s.db", drain, **NO_RECOVERY) as rt:
            for n in range(CYCLES):
                await rt.submit("s", {"n": n})
                await rt.wait_idle("s")
    assert looks.count <= 1, looks


async def test_another_runtimes_commit_is_still_a_look(tmp_path: Path, looks: Looks) -> None:
    """Between own cycles, a submit from another runtime on the file (its own connections:
    another process as far as SQLite knows) starts the drain here, by a look."""
    db = tmp_path / "s.db"
    started = trio.Event()

    async def drain(ctx: DrainContext) -> None:
        for taken in await ctx.take_inputs():
            if taken.payload == {"from": "producer"}:
                started.set()

    with trio.fail_after(BOUND):
        async with (
            trio_sessions.open_runtime(db, drain, **NO_RECOVERY) as worker,
            trio_sessions.open_runtime(db, None) as producer,
        ):
            for n in range(20):
                await worker.submit("own", {"n": n})
                await worker.wait_idle("own")
            before = looks.count
            await producer.submit("remote", {"from": "producer"})
            await started.wait()
            assert looks.count > before
            assert worker.statistics().remote_signals == 1


async def test_a_local_watcher_sees_an_answer_closed_by_the_end_of_its_drain(
    tmp_path: Path, looks: Looks
) -> None:
    """A drain that returns with its answer open: the commit that ends the iteration closes
    it `interrupted`, and a local watcher of the session sees that final state. Its
    writes offered the watcher their snapshots themselves; the close, the store's, is an
    own commit that offers nothing, so the change loop looks for it (the runtime's own
    signals are no look: `BackgroundLoops.changed_here`)."""
    seen = trio.Event()

    async def drain(ctx: DrainContext) -> None:
        await ctx.take_inputs()
        writer = await ctx.begin_assistant()
        await writer.append_text("partial")
        await seen.wait()  # the watcher has the open answer: the close is a change of its own

    with trio.fail_after(BOUND):
        async with (
            trio_sessions.open_runtime(tmp_path / "s.db", drain, **NO_RECOVERY) as rt,
            rt.watch("s") as updates,
        ):
            await rt.submit("s", {"text": "q"})
            async for message in updates:
                if not isinstance(message.data, AssistantData):
                    continue
                if message.data.finished:
                    break
                if message.data.parts:
                    seen.set()
    assert seen.is_set()
    assert message.data.error == "interrupted"
    assert message.data.parts[0].text == "partial"


async def test_a_local_stream_sees_every_own_write(tmp_path: Path, looks: Looks) -> None:
    """A local `stream()` of a session this runtime writes gets every word and the end."""

    async def drain(ctx: DrainContext) -> None:
        await ctx.take_inputs()
        writer = await ctx.begin_assistant()
        for word in ("a", "b", "c"):
            await writer.append_text(word)
        await writer.finish()

    text = ""
    with trio.fail_after(BOUND):
        async with trio_sessions.open_runtime(tmp_path / "s.db", drain, **NO_RECOVERY) as rt:
            await rt.submit("s", {"text": "q"})
            async with rt.stream("s") as events:
                async for event in events:
                    if event.role != "assistant":
                        continue
                    if event.kind == "append":
                        text += event.data
                    elif event.kind == "message":
                        text = "".join(part.text for part in event.data.parts)
                    elif event.kind == "finish":
                        break
    assert text == "abc"


async def test_an_own_scheduled_input_starts_on_time(tmp_path: Path, looks: Looks) -> None:
    """A scheduled input this runtime submitted starts its drain once due, by the due timer
    it armed itself (no look reports it)."""
    started = trio.Event()
    submitted = 0.0
    took: list[float] = []

    async def drain(ctx: DrainContext) -> None:
        if await ctx.take_inputs():
            took.append(trio.current_time() - submitted)
            started.set()

    with trio.fail_after(BOUND):
        async with trio_sessions.open_runtime(tmp_path / "s.db", drain, **NO_RECOVERY) as rt:
            submitted = trio.current_time()
            await rt.submit("s", {"text": "later"}, delay=0.2)
            await started.wait()
    assert took[0] >= 0.2


def _write(tx: Any) -> None:
    tx.execute("INSERT INTO scratch VALUES (1)")
    tx.notify("s")  # a no-op on SQLite: no own commit is a change, signalled or not


def test_the_signal_skips_own_commits(tmp_path: Path) -> None:
    """`ChangeReader._changed` on the loop's writer connection: another connection's commit
    is a change; the loop's own commits (signalling a session or not) are none."""
    db = tmp_path / "s.db"
    with (
        contextlib.closing(connect(db)) as other,
        contextlib.closing(connect_nonblocking(db)) as loop_conn,
        contextlib.closing(connect_nonblocking(db)) as reader_conn,
    ):
        other.execute("CREATE TABLE scratch(x)")
        reader = ChangeReader(reader_conn, time.time, 0.005, None, loop_conn)
        reader._changed()  # the first check: nothing to compare with yet
        assert not reader._changed()
        jobs = [Job(_write, ()), Job(_write, ())]  # a group commit on the loop
        assert try_run_batch(loop_conn, time.time, jobs)
        for job in jobs:
            job.unwrap()
        assert not reader._changed()
        run_batch(other, time.time, [Job(_write, ())])
        assert reader._changed()
        assert not reader._changed()  # looked at: forgotten


async def test_a_runtime_alone_on_the_inline_store_looks_at_no_fallback_poll(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock
) -> None:
    """The inline SQLite store looks at its fallback poll only when another connection
    committed meanwhile (another runtime on the store: `InlineExecutor.wait_for_change`): a
    runtime alone, after cycles of its own commits, spends 30 fallback polls of virtual time
    with no look - its own commits are no change, as on the threaded store. Pinned by
    review (revE53): no test failed when the inline executor looked at every fallback poll."""
    looks = counted_looks(monkeypatch)

    async def drain(ctx: DrainContext) -> None:
        await ctx.take_inputs()

    store = testing.inline_store(tmp_path / "s.db")
    with trio.fail_after(600):
        async with trio_sessions.open_runtime(
            store, drain, clock=testing.trio_clock(), **NO_RECOVERY
        ) as rt:
            for n in range(5):
                await rt.submit("s", {"n": n})
                await rt.wait_idle("s")
            before = looks.count
            await trio.sleep(30 * _loops.CHANGE_FALLBACK_POLL)  # virtual time
            assert looks.count == before, looks
