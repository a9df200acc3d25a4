"""Signals between processes: prompt pickup of other runtimes' wakes, remote interrupts within
milliseconds, and `watch()` for live transcripts (DESIGN §5, §8).

Two runtimes on one SQLite file, each with its own connections, stand for two processes:
`PRAGMA data_version` sees the other's commits exactly as it sees another process's. One
test uses a real producer process. These run on the threaded store in real time, bounded by
`fail_after`; `recovery_interval=3600` makes sure recovery is never what picks the work up.
"""

from __future__ import annotations

import importlib
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
import trio
from backends import PgLocation
from helpers import ExecutorSeam, HoldsBusy, Raw, pg_raw, runtime
from hypothesis import given, settings
from hypothesis import strategies as st
from trio.testing import MockClock

import trio_sessions
from trio_sessions import (
    AssistantData,
    DrainContext,
    MalformedRecord,
    Message,
    Outcome,
    _filewatch,
    _loops,
    _store,
)
from trio_sessions._signals import Watcher

NO_RECOVERY: dict[str, Any] = {"recovery_interval": 3600.0}
BOUND = 2.0  # seconds; the change signal's p99 target is 50 ms


async def test_a_submit_from_another_runtime_starts_the_drain_without_recovery(
    tmp_path: Path,
) -> None:
    """A producer's submit starts the worker's drain via the change signal, not recovery."""
    db = tmp_path / "s.db"
    started = trio.Event()

    async def drain(ctx: DrainContext) -> None:
        await ctx.take_inputs()
        started.set()

    async with (
        trio_sessions.open_runtime(db, drain, **NO_RECOVERY) as worker,
        trio_sessions.open_runtime(db, None) as producer,
    ):
        await producer.submit("s", {"text": "hi"})
        with trio.fail_after(BOUND):
            await started.wait()
        assert worker.statistics().remote_signals >= 1


@pytest.mark.parametrize("backend", ["postgres"], indirect=True)
async def test_a_message_begun_while_a_look_reads_is_not_taken_for_gone(
    live_store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL reads run on a worker thread, on the snapshot their first statement took:
    a reply a local drain begins while the change loop's look is reading is not in that
    snapshot, and the look must not report it gone - the watchers' hub goes on following
    it. (SQLite reads run on the trio thread: nothing changes under them.)"""
    changes = importlib.import_module("trio_sessions._store.changes")
    watched_changes = changes.watched_changes
    holding, reading, resume = [False], threading.Event(), threading.Event()

    def held_look(tx: Any, watched: Any) -> Any:
        if holding[0]:
            holding[0] = False
            tx.execute("SELECT 1")  # the read's snapshot, as its earlier statements take it
            reading.set()
            resume.wait(BOUND)
        return watched_changes(tx, watched)

    monkeypatch.setattr(changes, "watched_changes", held_look)
    entered, go, began, finish = trio.Event(), trio.Event(), trio.Event(), trio.Event()

    async def drain(ctx: DrainContext) -> None:
        if not await ctx.take_inputs():
            return
        entered.set()
        await go.wait()
        writer = await ctx.begin_assistant()
        await writer.append_text("a")
        began.set()
        await finish.wait()
        await writer.finish()

    async with (
        trio_sessions.open_runtime(live_store, drain, **NO_RECOVERY) as rt,
        rt.watch("s"),
    ):
        hub = rt._watchers
        looked = trio.Event()
        apply = hub.apply

        def applied(found: Any) -> None:
            apply(found)
            if resume.is_set():
                looked.set()

        monkeypatch.setattr(hub, "apply", applied)
        # The reply's writes go to another writer lane than the one the look reads on, as
        # under load: the lanes' batches run in parallel.
        monkeypatch.setattr(rt._db, "spill_at", 0)
        with trio.fail_after(BOUND):
            await rt.submit("s", {"text": "q"})
            await entered.wait()
            holding[0] = True
            rt._kick.set()
            await trio.to_thread.run_sync(reading.wait, BOUND)  # the look is reading
            go.set()
            await began.wait()  # the reply is stored, and published to the hub
            [reply] = hub._sessions["s"].open
            resume.set()
            await looked.wait()
        assert reply in hub._sessions["s"].open
        finish.set()
        await rt.wait_idle("s")


async def test_a_real_producer_process_wakes_the_worker(tmp_path: Path) -> None:
    """A submit from another OS process starts the drain within the bound."""
    db = tmp_path / "s.db"
    started = trio.Event()

    async def drain(ctx: DrainContext) -> None:
        await ctx.take_inputs()
        started.set()

    script = textwrap.dedent(
        f"""
        import trio, trio_sessions
        async def main():
            async with trio_sessions.open_runtime({str(db)!r}, None) as producer:
                await producer.submit("s", {{"text": "hi"}})
        trio.run(main)
        """
    )
    async with trio_sessions.open_runtime(db, drain, **NO_RECOVERY):
        completed = await trio.run_process([sys.executable, "-c", script], check=False)
        assert completed.returncode == 0
        with trio.fail_after(BOUND):
            await started.wait()


async def test_a_remote_interrupt_stops_the_owner_long_before_its_heartbeat(
    tmp_path: Path,
) -> None:
    """interrupt() from a producer cancels the owner's drain through the signal, with the
    default heartbeat (lease/3 = 10 s) far away."""
    db = tmp_path / "s.db"
    entered = trio.Event()

    async def drain(ctx: DrainContext) -> None:
        await ctx.take_inputs()
        entered.set()
        await trio.sleep_forever()

    async with (
        trio_sessions.open_runtime(db, drain, **NO_RECOVERY) as worker,
        trio_sessions.open_runtime(db, None) as producer,
        trio.open_nursery() as nursery,
    ):
        outcomes: list[Outcome] = []

        async def run() -> None:
            outcomes.append(await worker.run("s"))

        nursery.start_soon(run)
        await entered.wait()
        assert await producer.interrupt("s") is True
        with trio.fail_after(BOUND):
            await worker.wait_idle("s")
        assert outcomes == [Outcome("interrupted", "user")]


class CountedLooks:
    """The change loop's looks counted as they start and end (all runtimes' together, and
    each runtime's), and no fallback poll."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from trio_sessions import _loops

        self.started = self.ended = 0
        self.of_runtime: dict[int, list[int]] = {}  # id(runtime): [started, ended]
        scan = _loops.BackgroundLoops._scan_changes

        async def counted_scan(loops: _loops.BackgroundLoops) -> None:
            counts = self.of_runtime.setdefault(id(loops._runtime), [0, 0])
            self.started += 1
            counts[0] += 1
            try:
                await scan(loops)
            finally:
                self.ended += 1
                counts[1] += 1

        monkeypatch.setattr(_loops, "CHANGE_FALLBACK_POLL", 3600.0)
        monkeypatch.setattr(_loops.BackgroundLoops, "_scan_changes", counted_scan)

    async def one_started_now(self, of: object | None = None) -> None:
        """Return once a look that started after this call has ended (`of`: a look of that
        runtime - another's, a producer's, sees the write too but acts on nothing of it):
        every look that could see a write made before it has passed over it (or acted on
        it)."""
        if of is None:
            started = self.started
            while self.ended <= started:
                await trio.sleep(0.01)
            return
        counts = self.of_runtime.setdefault(id(of), [0, 0])
        started = counts[0]
        while counts[1] <= started:
            await trio.sleep(0.01)

    async def one_looked_after(self, runtime: Any) -> None:
        """`one_started_now(of=runtime)` after an `await` that wrote (another runtime's
        submit): the look that write's signal causes may have started and ended before
        this call - on a loaded host, while the writer's reply came back - and no other
        comes (no fallback poll). So kick one, which sees every write made before it."""
        runtime._kick.set()  # its look starts no sooner than our next checkpoint
        await self.one_started_now(of=runtime)


async def test_a_submit_while_a_remotely_deleted_sessions_drain_stops_starts_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A producer deletes a session the worker is draining, then submits to it again while
    the worker's old drain still cleans up. The worker's look passed over the new doorbell
    (the session was still its own then); once the old drain exited, the worker starts the
    new one at once - not at its next fallback poll or recovery pass (both far away here)."""
    looks = CountedLooks(monkeypatch)
    db = tmp_path / "s.db"
    cleaning, let_go = trio.Event(), trio.Event()
    taken: list[list[str]] = []

    async def drain(ctx: DrainContext) -> None:
        taken.append([item.id for item in await ctx.take_inputs()])
        if len(taken) > 1:
            return
        try:
            await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True):
                cleaning.set()
                await let_go.wait()

    async with (
        trio_sessions.open_runtime(db, drain, **NO_RECOVERY) as worker,
        trio_sessions.open_runtime(db, None) as producer,
    ):
        await producer.submit("s", {"n": 1}, input_id="i1")
        with trio.fail_after(BOUND):
            while not taken:
                await trio.sleep(0.01)
            assert await producer.delete_session("s") is True
            await cleaning.wait()
            await producer.submit("s", {"n": 2}, input_id="i2")
            await looks.one_looked_after(worker)  # passed the new doorbell over: still held
        assert worker.is_active("s")
        let_go.set()
        with trio.fail_after(BOUND):
            while len(taken) < 2:
                await trio.sleep(0.01)
        assert taken == [["i1"], ["i2"]]


async def test_a_submit_after_a_remote_delete_during_the_owners_finish_starts_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A producer deletes a session while the worker's drain has returned and its finish
    transaction is about to run (`deciding`: the change scan leaves the entry alone), then
    submits to it again. The finish finds the claim gone (LeaseLost) and the entry is
    released - but nothing looks for the doorbell the change scan passed over while the
    session was held: the drain starts only at the next fallback poll or recovery pass
    (DESIGN §7: a submit from another process starts the drain in p99 <= 50 ms; §5.1)."""
    from trio_sessions import testing

    looks = CountedLooks(monkeypatch)
    db = tmp_path / "s.db"
    finishing, let_go = trio.Event(), trio.Event()
    taken: list[list[str]] = []

    async def drain(ctx: DrainContext) -> None:
        taken.append([item.id for item in await ctx.take_inputs()])

    async def before_finish(session_id: str) -> None:
        if not let_go.is_set():
            finishing.set()
            await let_go.wait()

    async with (
        trio_sessions.open_runtime(db, drain, **NO_RECOVERY) as worker,
        trio_sessions.open_runtime(db, None) as producer,
    ):
        testing.set_seams(worker, before_finish=before_finish)
        await producer.submit("s", {"n": 1}, input_id="i1")
        with trio.fail_after(BOUND):
            await finishing.wait()
            assert await producer.delete_session("s") is True
            await producer.submit("s", {"n": 2}, input_id="i2")
            await looks.one_looked_after(worker)  # passed the new doorbell over: still held
        assert worker.is_active("s")
        let_go.set()
        with trio.fail_after(BOUND):
            while len(taken) < 2:
                await trio.sleep(0.01)
        assert taken == [["i1"], ["i2"]]


async def test_a_lost_signal_is_made_good_by_the_fallback_poll(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the data_version signal blinded, the slow fallback poll still starts the drain."""
    from trio_sessions import _loops, _sqlite

    monkeypatch.setattr(_sqlite.executors, "CHANGE_POLL", 3600.0)  # the signal never fires in time
    monkeypatch.setattr(_sqlite.executors, "open_watch", lambda path: None)
    monkeypatch.setattr(_loops, "CHANGE_FALLBACK_POLL", 0.2)
    db = tmp_path / "s.db"
    started = trio.Event()

    async def drain(ctx: DrainContext) -> None:
        started.set()

    async with (
        trio_sessions.open_runtime(db, drain, **NO_RECOVERY) as worker,
        trio_sessions.open_runtime(db, None) as producer,
    ):
        await producer.wake("s")
        with trio.fail_after(BOUND):
            await started.wait()
        assert worker.statistics().remote_signals == 1  # taken by a look, not by recovery
        assert worker.statistics().recovery.doorbells_started == 0


async def test_a_commit_in_another_process_wakes_a_watching_reader_without_polling(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the WAL file can be watched (Linux inotify), another process's commit is the
    signal: with every poll an hour away the drain still starts within the bound. (The
    worker is asleep long before the producer process has even imported trio.)"""
    from trio_sessions import _loops, _sqlite

    if _filewatch.open_watch(__file__) is None:
        pytest.fail("inotify is unavailable here, so the change signal is a 5 ms poll")
    monkeypatch.setattr(_sqlite.executors, "CHANGE_POLL", 3600.0)
    monkeypatch.setattr(_loops, "CHANGE_FALLBACK_POLL", 3600.0)
    db = tmp_path / "s.db"
    started = trio.Event()

    async def drain(ctx: DrainContext) -> None:
        started.set()

    script = textwrap.dedent(
        f"""
        import trio, trio_sessions
        async def main():
            async with trio_sessions.open_runtime({str(db)!r}, None) as producer:
                await producer.wake("s")
        trio.run(main)
        """
    )
    async with trio_sessions.open_runtime(db, drain, **NO_RECOVERY) as worker:
        completed = await trio.run_process([sys.executable, "-c", script], check=False)
        assert completed.returncode == 0
        with trio.fail_after(BOUND):
            await started.wait()
        assert worker.statistics().remote_signals == 1


async def test_max_active_bounds_drains_and_the_rest_complete_without_recovery(
    tmp_path: Path,
) -> None:
    """max_active=2: never more than two drains at once; all ten sessions still drain, taken
    as capacity frees (no recovery pass)."""
    db = tmp_path / "s.db"
    running = 0
    peak = 0
    done: set[str] = set()

    async def drain(ctx: DrainContext) -> None:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await trio.sleep(0.01)
        running -= 1
        done.add(ctx.session_id)

    async with (
        trio_sessions.open_runtime(db, drain, max_active=2, **NO_RECOVERY),
        trio_sessions.open_runtime(db, None) as producer,
    ):
        for n in range(10):
            await producer.wake(f"s{n}")
        with trio.fail_after(BOUND * 3):
            while len(done) < 10:
                await trio.sleep(0.01)
    assert peak <= 2


async def test_watch_replays_then_follows_local_writes_in_order(tmp_path: Path) -> None:
    """A watcher gets the stored messages after `after_seq`, then every local snapshot of
    the reply growing to its final state."""
    db = tmp_path / "s.db"
    gate = trio.Event()

    async def drain(ctx: DrainContext) -> None:
        await ctx.take_inputs()
        await gate.wait()
        writer = await ctx.begin_assistant()
        for word in ("a", "b", "c"):
            await writer.append_text(word)
        await writer.finish()

    async with trio_sessions.open_runtime(db, drain, **NO_RECOVERY) as rt:
        await rt.submit("s", {"text": "q"})
        async with rt.watch("s") as updates:
            first = await updates.__anext__()
            assert (first.role, first.seq, first.data) == ("user", 1, {"text": "q"})
            gate.set()
            texts = []
            with trio.fail_after(BOUND):
                async for message in updates:
                    assert message.seq == 2
                    assert isinstance(message.data, AssistantData)
                    texts.append("".join(p.text for p in message.data.parts))  # type: ignore[union-attr]
                    if message.data.finished:
                        break
        assert texts[-1] == "abc"
        assert texts == sorted(texts, key=len)  # never an older state after a newer one
        async with rt.watch("s", after_seq=1) as replay:
            again = await replay.__anext__()
        assert again.seq == 2 and again.data.finished


async def test_a_watcher_gets_the_stored_history_before_the_reply_being_written(
    store: Any, clock: Any, autojump_clock: MockClock
) -> None:
    """Found by an audit. DESIGN §5: `watch(s)` yields "first every message with seq > n as
    stored now, then a snapshot of each message whenever it is created or changed". A
    watcher entering while the drain streams its reply (seq 301) after a 300-message
    history: the replay reads the history in chunks, each read a schedule point, and the
    writer's snapshots of the reply are offered to the entering watcher meanwhile. They
    were queued ahead of the history not read yet (the half-written reply came before
    message 1); now what is offered past the replay's reach waits until the replay
    reached it, so the watcher's messages come in seq order."""
    history = 300
    go, begun, stop = trio.Event(), trio.Event(), trio.Event()

    async def drain(ctx: DrainContext) -> None:
        await go.wait()
        while await ctx.take_inputs():
            pass
        writer = await ctx.begin_assistant()
        begun.set()
        while not stop.is_set():
            await writer.append_text("w")
        await writer.finish()

    async with runtime(store, drain, clock) as rt:
        for n in range(history):
            await rt.submit("s", {"n": n})
        go.set()
        await begun.wait()
        order: list[int] = []
        async with rt.watch("s") as updates:
            stop.set()
            async for message in updates:
                if message.seq not in order:
                    order.append(message.seq)
                if len(order) == history + 1:
                    break
        await rt.wait_idle("s")
    assert order == sorted(order), order[:5]


@pytest.mark.parametrize("backend", ["sqlite", "postgres"], indirect=True)
async def test_a_watcher_gets_the_users_message_before_the_reply_to_it(
    live_store: Any, backend: str
) -> None:
    """Found by an audit. DESIGN §5: after its history, a watcher gets "a snapshot of each
    message whenever it is created or changed". In the plainest chat turn - submit, the
    drain takes the input and streams its reply - a watcher got the reply (seq 2) before
    the user's message (seq 1) on both backends: the reply's writer offers local watchers
    its snapshots at once, while `take_inputs` offered none, so the user message reached
    the watcher only through the change loop's next look, milliseconds later. Now
    `take_inputs` offers the user messages it appended at once too. (The gate holds that
    look until the reply was begun, as its few milliseconds' delay did every time it was
    tried, so the test is deterministic.)"""
    begun = trio.Event()

    async def drain(ctx: DrainContext) -> None:
        await ctx.take_inputs()
        writer = await ctx.begin_assistant()
        begun.set()
        await writer.append_text("hi")
        await writer.finish()

    order: list[int] = []
    with trio.fail_after(10):
        async with trio_sessions.open_runtime(live_store, drain, recovery_interval=60) as rt:
            look = rt._loops._look_at_changes

            async def look_once_the_reply_began(signal: Any) -> None:
                await begun.wait()
                await look(signal)

            rt._loops._look_at_changes = look_once_the_reply_began  # type: ignore[method-assign]
            async with rt.watch("s") as updates:
                await rt.submit("s", {"text": "q"})
                async for message in updates:
                    if message.seq not in order:
                        order.append(message.seq)
                    if len(order) == 2:
                        break
    assert order == [1, 2]


async def test_a_producer_watcher_sees_another_runtimes_reply(tmp_path: Path) -> None:
    """watch() in a producer runtime follows a reply written by a worker runtime."""
    db = tmp_path / "s.db"

    async def drain(ctx: DrainContext) -> None:
        await ctx.take_inputs()
        writer = await ctx.begin_assistant()
        await writer.append_text("answer")
        await writer.finish()

    async with (
        trio_sessions.open_runtime(db, drain, **NO_RECOVERY),
        trio_sessions.open_runtime(db, None) as producer,
        producer.watch("s") as updates,
    ):
        await producer.submit("s", {"text": "q"})
        with trio.fail_after(BOUND):
            async for message in updates:
                if message.role == "assistant" and message.data.finished:
                    assert message.data.parts[0].text == "answer"
                    break


async def test_local_snapshots_cost_no_store_round_trip(tmp_path: Path) -> None:
    """Three watchers of a streaming reply add no write transaction: the writer's own
    results fan out locally."""

    async def drain(ctx: DrainContext) -> None:
        writer = await ctx.begin_assistant()
        for _ in range(5):
            await writer.append_text("x")
        await writer.finish()

    async def transactions(db: Path, watchers: int) -> int:
        async with trio_sessions.open_runtime(db, drain, **NO_RECOVERY) as rt:
            async with trio.open_nursery() as nursery:
                for _ in range(watchers):
                    nursery.start_soon(_follow_until_finished, rt)
                await trio.sleep(0.05)  # the watchers are registered before the run
                before = rt.statistics().store.transactions
                await rt.run("s")
            return rt.statistics().store.transactions - before

    assert await transactions(tmp_path / "a.db", 3) == await transactions(tmp_path / "b.db", 0)


async def _follow_until_finished(rt: trio_sessions.Runtime) -> None:
    async with rt.watch("s") as updates:
        async for message in updates:
            if message.role == "assistant" and message.data.finished:
                return


async def test_a_malformed_row_raises_in_its_watcher_only(tmp_path: Path) -> None:
    """A row that does not decode raises MalformedRecord in the watcher of that session;
    another session's watcher carries on."""
    import sqlite3

    db = tmp_path / "s.db"
    async with trio_sessions.open_runtime(db, None) as rt:
        await rt.submit("bad", {"n": 1})
        await rt.submit("good", {"n": 1})
        conn = sqlite3.connect(db)
        with conn:
            conn.execute(
                "INSERT INTO session_message(id, session_id, role, seq, data, time_created,"
                " time_updated) VALUES ('m-bad', 'bad', 'assistant', 1, '{oops', 0, 0)"
            )
        conn.close()
        async with rt.watch("bad") as bad, rt.watch("good") as good:
            with pytest.raises(MalformedRecord):
                await bad.__anext__()
            conn = sqlite3.connect(db)
            with conn:
                conn.execute(
                    "INSERT INTO session_message(id, session_id, role, seq, data, time_created,"
                    " time_updated) VALUES ('m-good', 'good', 'system', 1, '{\"ok\": 1}', 0, 0)"
                )
            conn.close()
            with trio.fail_after(BOUND):
                message = await good.__anext__()
            assert (message.id, message.data) == ("m-good", {"ok": 1})


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 3), st.integers(0, 20), st.booleans()), max_size=40),
    st.integers(0, 40),
)
def test_a_slow_watcher_gets_the_latest_snapshot_and_never_an_older_one(
    offers: list[tuple[int, int, bool]], replayed: int
) -> None:
    """Offers in any order, read at any moments, its replay (of nothing) over at any of
    them: per message the versions delivered only grow, and the last delivered is the
    newest offered."""
    watcher = Watcher("s", after_seq=0)
    delivered: dict[str, list[int]] = {}

    def drain_ready() -> None:
        while watcher._pending:
            message_id = next(iter(watcher._pending))
            _, version = watcher._pending.pop(message_id)
            watcher._seen[message_id] = version
            delivered.setdefault(message_id, []).append(version)

    newest: dict[str, int] = {}
    for n, (message, version, read_now) in enumerate(offers):
        if n == replayed:
            watcher.replay_over()
        message_id = f"m{message}"
        snapshot = Message(message_id, "s", "user", message + 1, {"v": version}, None, None)
        watcher.offer(message_id, message + 1, snapshot, version)
        newest[message_id] = max(newest.get(message_id, -1), version)
        if read_now:
            drain_ready()
    watcher.replay_over()
    drain_ready()
    for message_id, versions in delivered.items():
        assert versions == sorted(set(versions))
        assert versions[-1] == newest[message_id]
    assert set(delivered) == set(newest)


async def test_a_message_deleted_while_held_for_the_replay_is_never_delivered_last() -> None:
    """A live snapshot of message 2 is held while the replay reaches it; the transcript is
    then truncated and a new message takes seq 2. The held snapshot of the deleted message
    was released after the replay, after the new one - a deleted message shown last (a
    review's find). Forgetting a message drops what was held of it."""
    watcher = Watcher("s", after_seq=0)
    watcher.replaying_to(1)

    def message(message_id: str, seq: int) -> Message:
        return Message(message_id, "s", "user", seq, {"id": message_id}, None, None)

    watcher.offer("old", 2, message("old", 2), 1)  # live, past the replay: held
    watcher.offer("m1", 1, message("m1", 1), 1)  # the replay
    watcher.forget("old")  # truncated
    watcher.replaying_to(2)
    watcher.offer("new", 2, message("new", 2), 1)
    watcher.replay_over()
    watcher.close()
    assert [m.id async for m in watcher] == ["m1", "new"]


@pytest.mark.parametrize("reader", ["transcript", "watch", "stream"])
@pytest.mark.parametrize(
    ("role", "seq", "data", "reason"),
    [
        ("system", 1, "CAST(X'7B226E223A2280FF227D' AS TEXT), NULL", "not UTF-8 text: byte 0x80"),
        ("<img src=x onerror=alert(1)>", 1, "'{}', NULL", "role '<img src=x onerror=alert(1)>'"),
        ("system", "<script>", "'{}', NULL", "seq '<script>' is no whole number"),
        ("system", 1, "'{}', CAST(X'69FF' AS TEXT)", "input_id b'i\\xff' is not UTF-8 text"),
    ],
    ids=["not-utf8", "unknown-role", "text-seq", "input-id-not-utf8"],
)
async def test_a_message_no_store_writes_is_a_malformed_record_for_its_readers(
    tmp_path: Path, reader: str, role: str, seq: object, data: str, reason: str
) -> None:
    """SQLite keeps whatever another tool writes: bytes that are not UTF-8 as TEXT (in the
    data, or an input id), a role past the CHECK (`ignore_check_constraints`), text in the
    INTEGER seq. Such a message is
    a MalformedRecord naming its row and what is wrong, for `transcript()`, a watcher and a
    stream alike, as a message that is not JSON is; another session reads on. Before, the
    driver's decode error reached them as a StoreError naming neither row nor session, the
    role and the seq came back as a message's (the console wrote that role into its page as
    markup), a watcher or a stream raised ValueError placing the text seq, and the input
    id came back as bytes in a message's str field."""
    import sqlite3

    db = tmp_path / "s.db"
    async with trio_sessions.open_runtime(db, None) as rt:
        await rt.submit("bad", {"n": 1})
        await rt.submit("good", {"n": 1})
        conn = sqlite3.connect(db)
        with conn:
            conn.execute("PRAGMA ignore_check_constraints = ON")
            conn.execute(
                "INSERT INTO session_message(id, session_id, role, seq, data, input_id,"
                f" time_created, time_updated) VALUES ('m-bad', 'bad', ?, ?, {data}, 0, 0)",
                (role, seq),
            )
        conn.close()

        async def read() -> None:
            if reader == "transcript":
                await rt.transcript("bad")
                return
            opened = rt.watch("bad") if reader == "watch" else rt.stream("bad")
            async with opened as first:
                await first.__anext__()

        with pytest.raises(MalformedRecord) as caught, trio.fail_after(BOUND):
            await read()
        assert (caught.value.table, caught.value.key) == ("session_message", "m-bad")
        assert reason in caught.value.reasons[0]
        assert await rt.transcript("good") == []


# Ids another tool can write into SQLite's `session_message.id` (a rowid table's
# `TEXT PRIMARY KEY`; PostgreSQL refuses both): (SQL, the key and reason a reader shows).
_UNREADABLE_IDS = {
    "not-utf8": ("CAST(X'6DFF' AS TEXT)", "m\ufffd", "id b'm\\xff' is not UTF-8 text"),
    "null": ("NULL", "NULL", "id is NULL"),
}


@pytest.mark.parametrize("bad_id", sorted(_UNREADABLE_IDS))
@pytest.mark.parametrize(
    ("reader", "written"),
    [
        ("transcript", "before"),
        ("watch", "before"),
        ("stream", "before"),
        ("watch", "while-open"),
        ("stream", "while-open"),
    ],
)
async def test_a_message_whose_id_is_unreadable_is_a_malformed_record_for_its_readers(
    tmp_path: Path, reader: str, written: str, bad_id: str
) -> None:
    """Another tool writes a message whose id no reader can name - bytes that are not
    UTF-8, or NULL - into a session that is read: `transcript()`, a watcher or a stream,
    opened before it was written or while it is open. The reader raises MalformedRecord
    naming the id; the runtime stays open and serves other sessions (DESIGN §5, §6.20).
    Before, a watch that opened on a non-UTF-8 id raised StoreError (the driver's decode
    error), `transcript()` returned a `Message` whose id was None, and a reader open when
    either was written crashed the change loop, and with it the whole runtime: the row was
    looked up again by an id that names no row."""
    import sqlite3

    id_sql, key, reason = _UNREADABLE_IDS[bad_id]

    def write_bad() -> None:
        conn = sqlite3.connect(db)
        with conn:
            conn.execute(
                "INSERT INTO session_message(id, session_id, role, seq, data, time_created,"
                f" time_updated) VALUES ({id_sql}, 'bad', 'system', 1, '{{}}', 0, 0)"
            )
        conn.close()

    db = tmp_path / "s.db"
    async with trio_sessions.open_runtime(db, None) as rt:
        await rt.submit("bad", {"n": 1})
        if written == "before":
            write_bad()

        async def read() -> None:
            if reader == "transcript":
                await rt.transcript("bad")
                return
            opened = rt.watch("bad") if reader == "watch" else rt.stream("bad")
            async with opened as updates:
                if written == "while-open":
                    write_bad()
                async for _ in updates:
                    pass

        with pytest.raises(MalformedRecord) as caught, trio.fail_after(BOUND):
            await read()
        assert (caught.value.table, caught.value.key) == ("session_message", key)
        assert reason in caught.value.reasons, caught.value.reasons
        await rt.submit("good", {"n": 1})
        assert await rt.transcript("good") == []


@pytest.mark.parametrize("backend", ["sqlite", "postgres"], indirect=True)
async def test_more_remote_doorbells_than_one_look_takes_all_start_without_a_poll(
    db_path: Any, live_store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One commit of another process rings more doorbells than one look takes
    (`CHANGE_BATCH`): the look that took a full batch looks again at once, so every one
    starts within the signal's bound - not 100 now and the rest at the fallback poll (or
    the recovery pass) seconds later."""
    monkeypatch.setattr(_loops, "CHANGE_FALLBACK_POLL", 3600.0)  # no look but the signal's
    count = _loops.CHANGE_BATCH + 50
    started: set[str] = set()

    async def drain(ctx: DrainContext) -> None:
        started.add(ctx.session_id)

    async with trio_sessions.open_runtime(live_store, drain, **NO_RECOVERY):
        await trio.sleep(0.2)  # the worker's first look is done: only the signal is left
        ids = [f"s{n:03}" for n in range(count)]
        # One transaction rings them all: one signal (another process's, or an operator's).
        Raw(db_path).write(
            "INSERT INTO session(id, time_created, time_woken, wakes) VALUES "
            + ", ".join("(?, 1, 1, 1)" for _ in ids),
            tuple(ids),
        )
        if isinstance(db_path, PgLocation):
            from trio_sessions._postgres import channel

            with pg_raw(db_path.url, db_path.schema) as conn:
                conn.execute("SELECT pg_notify(%s, '')", (channel(db_path.schema),))
        with trio.move_on_after(BOUND * 2):
            while len(started) < count:
                await trio.sleep(0.01)
    assert len(started) == count


@pytest.mark.parametrize("backend", ["sqlite", "postgres"], indirect=True)
async def test_a_remote_wake_just_after_the_owners_finish_released_starts_at_once(
    db_path: Any, live_store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process wakes a session just after the worker's finish transaction released
    its claim, while the worker still holds the registry entry (its busy period ending).
    The wake found no claim, so it is the worker's to take by the signal - but the look the
    signal caused passed the session over (held here): once the entry is released, the
    drain starts at once, not at the fallback poll or recovery pass (DESIGN §7, §6.9)."""
    from trio_sessions import testing

    looks = CountedLooks(monkeypatch)
    released, let_go = trio.Event(), trio.Event()
    calls = 0

    async def drain(ctx: DrainContext) -> None:
        nonlocal calls
        calls += 1

    async def after_finish(session_id: str) -> None:
        if not let_go.is_set():
            released.set()
            await let_go.wait()

    async with trio_sessions.open_runtime(live_store, drain, **NO_RECOVERY) as worker:
        testing.set_seams(worker, after_finish=after_finish)
        await worker.wake("s")
        with trio.fail_after(BOUND):
            await released.wait()
            # Another process's wake (durable, and no claim: the worker's to take), written
            # on the trio thread: every look that starts from here on can see it.
            Raw(db_path).write("UPDATE session SET time_woken = 1, wakes = 1 WHERE id = 's'")
            if isinstance(db_path, PgLocation):
                from trio_sessions._postgres import channel

                with pg_raw(db_path.url, db_path.schema) as conn:
                    conn.execute("SELECT pg_notify(%s, 's')", (channel(db_path.schema),))
            await looks.one_started_now()  # passed it over: still held here
        assert worker.is_active("s")
        let_go.set()
        with trio.move_on_after(BOUND):
            while calls < 2:
                await trio.sleep(0.01)
    assert calls == 2


async def test_a_remote_interrupt_just_after_the_claim_committed_stops_it_before_its_drain(
    pg_url: str, pg_schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process marks a claim cancelling (and signals it) just after the owner's
    acquire committed, before the owner heard back: the owner's look must find it - the
    claim's id is known before it commits - so the drain never starts, and the claim is
    finished as interrupted. (The look asked only about claims already owned when it
    began: the drain ran until the heartbeat read the phase, a third of a lease later.)

    The reply is held on the runtime's side of its executor (`HeldReply`), and the look
    waited for is the worker's: holding it in the writer's thread after its COMMIT kept
    that lane busy, and a look's read placed on it waited there until the hold gave up;
    and the producer's own look, ending first on a loaded host, let the reply go before
    the worker looked (half the runs failed under load, either way)."""
    from trio_sessions._postgres import PostgresStore, channel

    looks = CountedLooks(monkeypatch)
    started = trio.Event()

    async def drain(ctx: DrainContext) -> None:
        started.set()
        await trio.sleep_forever()

    location = PgLocation(pg_url, pg_schema)
    store = PostgresStore(pg_url, schema=pg_schema)
    async with (
        trio_sessions.open_runtime(store, drain, lease=60, **NO_RECOVERY) as worker,
        trio_sessions.open_runtime(PostgresStore(pg_url, schema=pg_schema), None) as producer,
    ):
        held = HeldReply(worker._db, "s")
        worker._db = held  # type: ignore[assignment]
        await producer.wake("s")
        with trio.fail_after(BOUND):
            await held.answered.wait()  # committed: the claim is in the store
            # What `interrupt` from another process writes, on the trio thread: every look
            # from here on can see it.
            Raw(location).write("UPDATE session_execution SET phase = 'cancelling'")
            with pg_raw(pg_url, pg_schema) as conn:
                conn.execute("SELECT pg_notify(%s, 's')", (channel(pg_schema),))
            await looks.one_started_now(of=worker)
        held.go.set()
        with trio.move_on_after(BOUND):
            await worker.wait_idle("s")
        assert not started.is_set()
        assert not worker.is_active("s")
    assert Raw(location).rows("SELECT id FROM session_execution") == []


@pytest.mark.parametrize("backend", ["sqlite", "postgres"], indirect=True)
async def test_more_doorbells_than_the_first_pass_takes_all_start_when_a_worker_opens(
    db_path: Any, live_store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Wakes rung while no worker ran (their signals went nowhere), more than the opening
    recovery pass takes (`recovery_batch`): the worker's change loop looks for the rest at
    once, on both backends - not at its fallback poll or the next recovery pass."""
    looks = CountedLooks(monkeypatch)  # and no fallback poll
    count = 150
    started: set[str] = set()

    async def drain(ctx: DrainContext) -> None:
        started.add(ctx.session_id)

    async with trio_sessions.open_runtime(live_store, None):
        pass  # the schema
    ids = [f"s{n:03}" for n in range(count)]
    Raw(db_path).write(
        "INSERT INTO session(id, time_created, time_woken, wakes) VALUES "
        + ", ".join("(?, 1, 1, 1)" for _ in ids),
        tuple(ids),
    )
    async with trio_sessions.open_runtime(live_store, drain, recovery_batch=100, **NO_RECOVERY):
        with trio.move_on_after(BOUND * 2):
            while len(started) < count:
                await trio.sleep(0.01)
    assert len(started) == count, (looks.started, looks.ended)


class HeldReply(ExecutorSeam):
    """The runtime's executor, with the first `acquire` of `session_id` run at once but its
    reply held until `go` (the server answered; the runtime has not heard yet)."""

    def __init__(self, inner: Any, session_id: str) -> None:
        super().__init__(inner)
        self._session_id = session_id
        self.answered, self.go = trio.Event(), trio.Event()

    async def run(self, op: Any, *args: Any) -> Any:
        result = await self._inner.run(op, *args)
        if op is _store.acquire and args[0] == self._session_id and not self.answered.is_set():
            self.answered.set()
            await self.go.wait()
        return result


@pytest.mark.parametrize("backend", ["postgres"], indirect=True)
async def test_a_locked_doorbell_whose_holder_signalled_during_its_acquire_starts_at_once(
    db_path: Any, live_store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """max_active=1: the oldest waiting session's acquire finds it locked by another
    transaction ('busy'), which commits - signalling the session - before that answer
    reaches the runtime. The look that signal caused passed the session over (its
    acquisition in flight here); the answer then passes its doorbell over 'until a signal
    names it' - the signal that did came already. It must start at once (as it did before
    the pass-over: the place the acquisition freed kicked a look that took it), not at the
    fallback poll."""
    looks = CountedLooks(monkeypatch)  # and no fallback poll
    named = trio.Event()
    begun = 0  # looks started when the signal naming it was taken: its own is the next
    look_again = _loops.BackgroundLoops._look_again_at_passed_over

    def noting(loops: _loops.BackgroundLoops, signal: Any, *, everything: bool) -> None:
        nonlocal begun
        if signal is not None and "locked" in signal.sessions and not named.is_set():
            begun = looks.started
            named.set()
        look_again(loops, signal, everything=everything)

    monkeypatch.setattr(_loops.BackgroundLoops, "_look_again_at_passed_over", noting)
    drain = HoldsBusy()
    let_go, started = drain.let_go, drain.started

    with pg_raw(db_path.url, db_path.schema) as holder:
        async with trio_sessions.open_runtime(live_store, drain, max_active=1, **NO_RECOVERY) as rt:
            await rt.wake("busy")
            await rt.wake("locked")  # no room: it waits, durable
            held = HeldReply(rt._db, "locked")
            rt._db = held  # type: ignore[assignment]
            holder.execute("BEGIN")
            holder.execute("SELECT ts_lock(%s)", ("locked",))
            let_go.set()
            try:
                with trio.fail_after(BOUND):
                    await held.answered.wait()  # 'busy': the holder has the lock
                    holder.execute("SELECT ts_signal(%s)", ("locked",))
                    holder.execute("COMMIT")
                    await named.wait()
                    while looks.ended <= begun:
                        await trio.sleep(0.01)
                assert rt.is_active("locked")  # that look passed it over: held here
            finally:
                held.go.set()
            with trio.move_on_after(BOUND):
                while "locked" not in started:
                    await trio.sleep(0.01)
    assert started == ["busy", "locked"]
