"""Work proportional to the change (DESIGN §6.26): a watched long transcript, many watchers
and a large input backlog never make the library read the whole transcript per change nor
block the event loop for more than 50 ms.

The counts are timing-independent: SQLite's own instruction counter (a progress handler on
the connection a scan runs on) and the CPU time of each trio task step on the event loop's
thread (`time.thread_time`, so another process taking the CPU does not count). The real-time
parts are bounded by `fail_after`.
"""

from __future__ import annotations

import gc
import json
import sqlite3
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from helpers import runtime
from trio.testing import MockClock

import trio_sessions
from trio_sessions import (
    AssistantData,
    AssistantWriter,
    DrainContext,
    Message,
    Outcome,
    Store,
    TextPart,
    _store,
)
from trio_sessions._bench.load import StepMeter, seed_backlog, seed_transcript
from trio_sessions._bench.tools import library_schema
from trio_sessions._runtime import TAKE_INPUTS_CHUNK

NO_RECOVERY: dict[str, Any] = {"recovery_interval": 3600.0}
BOUND = 60.0  # seconds of real time; the machine may be shared and slow
STALL_S = 0.050  # DESIGN §7: no event-loop stall above 50 ms from the library
TRANSCRIPT = 20_000
BACKLOG = 200_000
VM_STEP = 100  # SQLite instructions per progress-handler call


async def make_schema(db: Path) -> None:
    async with trio_sessions.open_runtime(db, None):
        pass


def text_of(data: Any) -> str:
    assert isinstance(data, AssistantData)
    return "".join(part.text for part in data.parts if isinstance(part, TextPart))


async def test_a_change_scan_reads_the_change_not_the_watched_transcript(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a 20,000-message session watched from another runtime, every change scan
    executes fewer SQLite instructions than the transcript has messages: it reads the new
    message and its new deltas, never the whole transcript. Real time, bounded."""
    db = tmp_path / "s.db"
    await make_schema(db)
    seed_transcript(db, "big", TRANSCRIPT)
    instructions: list[int] = []
    scan = _store.changes

    def counted_scan(tx: Any, *args: Any) -> Any:
        calls = [0]

        def count() -> int:
            calls[0] += 1
            return 0

        tx.conn.set_progress_handler(count, VM_STEP)
        try:
            return scan(tx, *args)
        finally:
            tx.conn.set_progress_handler(None, VM_STEP)
            instructions.append(calls[0] * VM_STEP)

    monkeypatch.setattr(_store, "changes", counted_scan)
    words = ["alpha ", "beta ", "gamma "]
    seen = [trio.Event() for _ in words]

    async def drain(ctx: DrainContext) -> None:
        await ctx.take_inputs()
        writer = await ctx.begin_assistant()
        for word, step in zip(words, seen, strict=True):
            await writer.append_text(word)
            await step.wait()
        await writer.finish()

    texts: list[str] = []
    with trio.fail_after(BOUND):
        async with (
            trio_sessions.open_runtime(db, drain, **NO_RECOVERY),
            trio_sessions.open_runtime(db, None) as producer,
            producer.watch("big", after_seq=TRANSCRIPT) as updates,
        ):
            await producer.submit("big", {"text": "one more"})
            async for message in updates:
                if message.role != "assistant":
                    continue
                text = text_of(message.data)
                if text and (not texts or text != texts[-1]):
                    texts.append(text)
                    seen[len(texts) - 1].set()
                if message.data.finished:
                    break
    assert texts == ["alpha ", "alpha beta ", "alpha beta gamma "]
    assert instructions, "the producer's watcher was fed by change scans"
    assert max(instructions) < TRANSCRIPT, instructions


@pytest.mark.serial
async def test_a_watched_long_transcript_never_stalls_the_loop(tmp_path: Path) -> None:
    """Entering a watch of a 20,000-message session from its start delivers every message,
    then the live reply, without one task step of the library above 50 ms of CPU: the
    history is read and decoded in bounded chunks. Real time, bounded."""
    db = tmp_path / "s.db"
    await make_schema(db)
    seed_transcript(db, "big", TRANSCRIPT)

    async def drain(ctx: DrainContext) -> None:
        await ctx.take_inputs()
        writer = await ctx.begin_assistant()
        await writer.append_text("answer")
        await writer.finish()

    seqs: list[int] = []
    with trio.fail_after(BOUND):
        async with trio_sessions.open_runtime(db, drain, **NO_RECOVERY) as rt:
            with StepMeter() as meter:
                async with rt.watch("big") as updates:
                    async for message in updates:
                        seqs.append(message.seq)
                        if message.seq == TRANSCRIPT:
                            await rt.submit("big", {"text": "one more"})
                        if message.role == "assistant" and message.data.finished:
                            break
    assert sorted(set(seqs))[:TRANSCRIPT] == list(range(1, TRANSCRIPT + 1))
    assert max(seqs) == TRANSCRIPT + 2
    assert meter.longest_cpu < STALL_S, meter.longest_cpu


async def test_take_inputs_takes_a_bounded_chunk_and_the_rest_stays_rung(
    store: Store, clock: Any, autojump_clock: Any
) -> None:
    """`take_inputs(limit=2)` takes at most two inputs, oldest first; a drain that returns
    after one chunk leaves the rest pending with the doorbell set, so the next iteration of
    the same busy period takes them (none stranded, none taken twice)."""
    chunks: list[list[int]] = []

    async def drain(ctx: DrainContext) -> None:
        chunks.append([item.payload["n"] for item in await ctx.take_inputs(limit=2)])

    async with runtime(store, drain, clock) as rt:
        for n in range(5):
            await rt.submit("s", {"n": n})
        await rt.run("s")
        await rt.wait_idle("s")
        transcript = await rt.transcript("s")
    assert [n for chunk in chunks if chunk for n in chunk] == [0, 1, 2, 3, 4]
    assert max(len(chunk) for chunk in chunks) == 2
    assert [m.data["n"] for m in transcript] == [0, 1, 2, 3, 4]


async def test_take_inputs_limit_is_checked(store: Store, clock: Any, autojump_clock: Any) -> None:
    """A limit that is not a positive int of 64 bits is refused before anything is taken."""
    errors: list[BaseException] = []

    async def drain(ctx: DrainContext) -> None:
        for bad in (0, -1, 1.5, "3", 2**63):
            try:
                await ctx.take_inputs(limit=bad)  # type: ignore[arg-type]
            except (TypeError, ValueError) as exc:
                errors.append(exc)
        assert [item.payload for item in await ctx.take_inputs()] == [{"n": 1}]

    async with runtime(store, drain, clock) as rt:
        await rt.submit("s", {"n": 1})
        outcome = await rt.run("s")
    assert outcome.kind == "succeeded"
    assert len(errors) == 5


async def test_take_inputs_takes_the_largest_limit_it_accepts(
    store: Store, clock: Any, autojump_clock: Any
) -> None:
    """The largest limit the check lets through (2**63-1, as its message says) is taken as
    "everything", on both backends: not an SQLite integer overflow failing the drain."""
    taken: list[Any] = []

    async def drain(ctx: DrainContext) -> None:
        taken.extend(item.payload for item in await ctx.take_inputs(limit=2**63 - 1))

    async with runtime(store, drain, clock) as rt:
        await rt.submit("s", {"n": 1})
        await rt.submit("s", {"n": 2})
        outcome = await rt.run("s")
    assert outcome == Outcome("succeeded")
    assert taken == [{"n": 1}, {"n": 2}]


@pytest.mark.serial
@pytest.mark.slow
async def test_a_200k_backlog_is_taken_in_chunks_without_stalling_the_loop(
    tmp_path: Path,
) -> None:
    """A drain calling `take_inputs()` until it returns nothing takes a 200,000-input backlog
    in chunks of at most `TAKE_INPUTS_CHUNK`, every input exactly once, without one task step
    above 50 ms of CPU on the event loop. Real time, bounded."""
    db = tmp_path / "s.db"
    await make_schema(db)
    seed_backlog(db, "backlog", BACKLOG)
    sizes: list[int] = []
    last: list[int] = [0]

    async def drain(ctx: DrainContext) -> None:
        while batch := await ctx.take_inputs():
            sizes.append(len(batch))
            assert batch[0].payload["n"] == last[0] + 1
            last[0] = batch[-1].payload["n"]

    with trio.fail_after(10 * BOUND):
        async with trio_sessions.open_runtime(db, drain, **NO_RECOVERY) as rt:
            with StepMeter() as meter:
                await rt.run("backlog")
                await rt.wait_idle("backlog")
    assert sum(sizes) == BACKLOG and last[0] == BACKLOG
    assert max(sizes) <= TAKE_INPUTS_CHUNK
    assert meter.longest_cpu < STALL_S, meter.longest_cpu


async def test_a_watcher_sees_messages_written_at_reused_seqs(tmp_path: Path) -> None:
    """A watched session truncated and grown again past its old end (seqs reused by new
    messages) still reaches the watcher: a look that finds its covered seq holding another
    message reads the session's versions whole, once. Real time, bounded."""
    db = tmp_path / "s.db"
    await make_schema(db)
    seed_transcript(db, "s", 3)
    seen: list[tuple[int, str]] = []
    with trio.fail_after(BOUND):
        async with (
            trio_sessions.open_runtime(db, None) as rt,
            rt.watch("s") as updates,
        ):
            async for message in updates:
                seen.append((message.seq, message.id))
                if message.seq == 3:
                    break
            conn = sqlite3.connect(db)
            with conn:
                conn.execute("DELETE FROM session_message WHERE session_id = 's' AND seq > 1")
                conn.executemany(
                    "INSERT INTO session_message(id, session_id, role, seq, data,"
                    " time_created, time_updated, finished) VALUES (?, 's', 'user', ?, '{}',"
                    " 0, 0, 1)",
                    [(f"new{seq}", seq) for seq in (2, 3, 4)],
                )
            conn.close()
            async for message in updates:
                seen.append((message.seq, message.id))
                if message.seq == 4:
                    break
    assert seen[3:] == [(2, "new2"), (3, "new3"), (4, "new4")]


async def test_many_watchers_of_one_session_share_one_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """However many watchers follow a session, a look reads its change once: the look that
    finds a new message executes the same SQLite instructions for 25 watchers as for 1,
    and every watcher gets the message. Real time, bounded."""
    looks: list[int] = []
    scan = _store.changes

    def counted_scan(tx: Any, *args: Any) -> Any:
        calls = [0]

        def count() -> int:
            calls[0] += 1
            return 0

        tx.conn.set_progress_handler(count, 1)
        try:
            found = scan(tx, *args)
        finally:
            tx.conn.set_progress_handler(None, 1)
        if found.watched.messages:
            looks.append(calls[0])
        return found

    monkeypatch.setattr(_store, "changes", counted_scan)

    async def first_finding_look(db: Path, watchers: int) -> int:
        await make_schema(db)
        seed_transcript(db, "s", 100)
        received: list[str] = []
        looks.clear()
        with trio.fail_after(BOUND):
            async with trio_sessions.open_runtime(db, None) as rt:

                async def follow(entered: trio.Event) -> None:
                    async with rt.watch("s", after_seq=100) as updates:
                        entered.set()
                        async for message in updates:
                            received.append(message.id)
                            return

                async with trio.open_nursery() as nursery:
                    for _ in range(watchers):
                        entered = trio.Event()
                        nursery.start_soon(follow, entered)
                        await entered.wait()
                    conn = sqlite3.connect(db)
                    with conn:
                        conn.execute(
                            "INSERT INTO session_message(id, session_id, role, seq, data,"
                            " time_created, time_updated, finished)"
                            " VALUES ('new', 's', 'user', 101, '{}', 0, 0, 1)"
                        )
                    conn.close()
        assert received == ["new"] * watchers
        return looks[0]

    one = await first_finding_look(tmp_path / "one.db", 1)
    many = await first_finding_look(tmp_path / "many.db", 25)
    assert many == one, (one, many)


async def _look(rt: trio_sessions.Runtime) -> None:
    """Let `rt`'s change loop look at the store once (the inline store's change loop runs
    only when kicked) and everything settle."""
    await trio.testing.wait_all_tasks_blocked()
    rt._kick.set()
    await trio.testing.wait_all_tasks_blocked()


async def _latest(watcher: Any, into: dict[int, Any]) -> None:
    async for message in watcher:
        into[message.seq] = message.data


# The inline SQLite store looks at other runtimes' commits on a kick only: deterministic.
@pytest.mark.sqlite_only
async def test_a_watcher_entering_before_a_remote_finish_was_looked_at_leaves_others_informed(
    store: Any, clock: Any, autojump_clock: MockClock
) -> None:
    """Two watchers of one session in a web runtime; a worker runtime finishes the reply.
    The second watcher enters after the worker's commit but before the web runtime's change
    loop looked at it: its replay reads the finished message. The first watcher must still
    get the finished message (DESIGN §5: a watcher may skip intermediate snapshots but never
    a message's latest one) - the replay must not record, for every watcher of the session,
    a version only the new watcher was offered."""
    go = trio.Event()

    async def drain(ctx: DrainContext) -> None:
        await ctx.take_inputs()
        writer = await ctx.begin_assistant()
        await writer.append_text("hello")
        await go.wait()
        await writer.append_text(" world")
        await writer.finish()

    first: dict[int, Any] = {}
    second: dict[int, Any] = {}
    async with (
        runtime(store, drain, clock) as worker,
        runtime(store, None, clock) as web,
        web.watch("s") as watcher,
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(_latest, watcher, first)
        await worker.submit("s", {"text": "q"})
        await _look(web)
        assert first[2] == AssistantData((TextPart("hello"),), False, None)
        go.set()
        await worker.wait_idle("s")
        # The web runtime has not looked at the finish yet; a second watcher enters now.
        async with web.watch("s") as late:
            nursery.start_soon(_latest, late, second)
            for _ in range(5):
                await _look(web)
            final = {m.seq: m.data for m in await web.transcript("s")}
            assert second == final
            assert first == final, "the first watcher never got the finished reply"
        nursery.cancel_scope.cancel()


def _seed_tool_heavy_transcript(db: Path, session_id: str, count: int, size: int) -> None:
    """`count` finished assistant messages, each holding one completed tool call whose
    output is about `size` bytes of structured JSON (search results, a fetched page's
    parsed rows: what an agent's transcript holds), written directly."""
    library_schema(db)
    conn = sqlite3.connect(db)
    with conn:
        conn.execute("INSERT INTO session(id, time_created) VALUES (?, 0)", (session_id,))
        for seq in range(1, count + 1):
            output = [{"title": "result", "n": n, "ok": True} for n in range(size // 40)]
            data = {
                "parts": [
                    {
                        "type": "tool",
                        "call_id": "c1",
                        "name": "search",
                        "input": {},
                        "status": "completed",
                        "output": output,
                        "error": None,
                    }
                ],
                "finished": True,
                "error": None,
            }
            conn.execute(
                "INSERT INTO session_message(id, session_id, role, seq, data, time_created,"
                " time_updated, finished) VALUES (?, ?, 'assistant', ?, ?, 0, 0, 1)",
                (f"m{seq:06d}", session_id, seq, json.dumps(data)),
            )
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()


@pytest.mark.serial
async def test_a_stream_of_a_tool_heavy_transcript_never_stalls_the_loop(tmp_path: Path) -> None:
    """Entering `stream()` (cursor=None) on a session of 200 assistant messages with ~100 KB
    tool results each (22 MB) sends every message without one task step of the library
    above 50 ms of CPU (DESIGN §6.26, §7) - as `watch()` does on the same session (its
    replay reads at most `REPLAY_CHUNK_BYTES` per step: ~20 ms here). The stream's read is
    bounded by count only (`NEW_MESSAGES_PER_READ` = 200 messages, whatever their size)
    and runs on the event loop's thread on SQLite: one step of ~200 ms, stalling every other
    task of the process (every other chat's stream, every submit). Real time, bounded."""
    db = tmp_path / "s.db"
    count = 200
    _seed_tool_heavy_transcript(db, "big", count, 100_000)
    received = 0
    with trio.fail_after(60):
        async with trio_sessions.open_runtime(db, None, recovery_interval=3600) as rt:
            with StepMeter() as meter:
                async with rt.stream("big") as events:
                    async for _ in events:
                        received += 1
                        if received == count:
                            break
    assert received == count
    assert meter.longest_cpu < STALL_S, meter.longest_cpu


def _seed_open_reply(db: Path, session_id: str, deltas: int, text: str = "tok ") -> None:
    """An open assistant message at seq 1 with `deltas` streamed words (each `text`) not
    folded yet (a long answer still being written, no tool call yet), as a drain's appends
    leave it."""
    library_schema(db)
    conn = sqlite3.connect(db)
    with conn:
        conn.execute("INSERT INTO session(id, time_created) VALUES (?, 0)", (session_id,))
        conn.execute(
            "INSERT INTO session_message(id, session_id, execution_id, role, seq, data,"
            " time_created, time_updated, finished) VALUES ('reply', ?, 'e1', 'assistant', 1,"
            ' \'{"parts": [], "finished": false, "error": null}\', 0, 0, 0)',
            (session_id,),
        )
        conn.execute(
            "INSERT INTO session_message_stream(message_id, execution_id, version)"
            " VALUES ('reply', 'e1', 0)"
        )
        conn.executemany(
            "INSERT INTO session_message_delta(message_id, version, text) VALUES ('reply', ?, ?)",
            ((version, text) for version in range(1, deltas + 1)),
        )
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()


@pytest.mark.serial
async def test_a_stream_resumed_early_in_a_long_open_reply_never_stalls_the_loop(
    tmp_path: Path,
) -> None:
    """A client reconnects with the cursor of a reply's first event while the reply -
    100,000 streamed words, a 400 KB answer - is still open (or a consumer more than
    `MAX_PENDING_OFFERS` behind reads instead): no task step of the library above 50 ms of
    CPU, and it still gets every word as its own "append", in order. Found by an audit:
    the stream read every delta past the cursor at once and turned them all into events
    (a cursor each) in one step on the event loop's thread (SQLite reads there): ~110 ms.
    Now an open message's deltas come in bounded pages, as new messages do. Real time."""
    from trio_sessions._store.stream import Held, Position, message_tag
    from trio_sessions._stream import encode_cursor, session_tag

    db = tmp_path / "s.db"
    words = 100_000
    _seed_open_reply(db, "s", words)
    tag = message_tag("reply")
    cursor = encode_cursor(session_tag("s"), Position(1, tag, (Held(1, tag, 0),)))
    texts: list[str] = []
    with trio.fail_after(BOUND):
        async with trio_sessions.open_runtime(db, None, **NO_RECOVERY) as rt:
            with StepMeter() as meter:
                async with rt.stream("s", cursor=cursor) as events:
                    async for event in events:
                        assert (event.kind, event.seq) == ("append", 1), event
                        texts.append(event.data)
                        if len(texts) == words:
                            break
    assert texts == ["tok "] * words
    assert meter.longest_cpu < STALL_S, meter.longest_cpu


@pytest.mark.serial
@pytest.mark.parametrize(
    ("appends", "text"),
    [
        # 150,000 streamed words (600 KB): the replay read every delta as a row and merged
        # them in Python in one step (~105 ms), and its chunk budget counted the message
        # row's data only, not the text streamed onto it; then SQLite joined the rows on
        # the loop before their text could be charged (36-64 ms).
        (150_000, "tok "),
        # 25 appends of 2 MB (a document streamed a page at a time): its rows were charged
        # before the join, but not the text each holds - a step of 160 ms here.
        (25, "t" * 2_000_000),
    ],
    ids=["many small appends", "few large appends"],
)
async def test_a_watcher_entering_during_a_long_open_reply_never_stalls_the_loop(
    tmp_path: Path, appends: int, text: str
) -> None:
    """The same for `watch()`: entering it while a long reply is open yields the reply
    whole without a task step of the library above 50 ms of CPU. Found by audits. Now
    the store charges a message's streamed rows and their text to the loop's budget
    before it joins them, and concatenates them itself. Real time."""
    db = tmp_path / "s.db"
    _seed_open_reply(db, "s", appends, text)
    with trio.fail_after(BOUND):
        async with trio_sessions.open_runtime(db, None, **NO_RECOVERY) as rt:
            with StepMeter() as meter:
                async with rt.watch("s") as updates:
                    reply = await updates.__anext__()
    assert reply.seq == 1
    assert text_of(reply.data) == text * appends
    assert meter.longest_cpu < STALL_S, meter.longest_cpu


@pytest.mark.parametrize("backend", ["sqlite", "postgres"], indirect=True)
async def test_a_local_watcher_costs_no_store_read_per_local_append(
    live_store: Any, backend: str
) -> None:
    """Found by an audit. DESIGN §5: "Watching costs no polling per watcher and no store
    round trip per snapshot for local writes." A drain streams 20 words (20 ms apart, a
    model's pace) into a session this runtime watches: the watcher gets each snapshot
    from the writer, yet every append's own notification was taken for a change to look
    at (the change loop's `own` was `WatchHub.watching`), so the change loop read the
    store (`_store.changes`) once per append - 20+ looks where a stream of the same session
    costs none. Now every local write offers its change to local watchers itself (or, for
    the few that cannot - the store closing open messages, a rewrite - has the change loop
    look once), and the runtime's own signals are no look."""
    import collections

    words = 20
    go = trio.Event()

    async def drain(ctx: DrainContext) -> None:
        await ctx.take_inputs()
        writer = await ctx.begin_assistant()
        await go.wait()
        for n in range(words):
            await writer.append_text(f"w{n} ")
            await trio.sleep(0.02)  # the model's pace between words, not a settling wait
        await writer.finish()

    reads: collections.Counter[str] = collections.Counter()
    with trio.fail_after(20):
        async with trio_sessions.open_runtime(live_store, drain, recovery_interval=60) as rt:
            inner = rt._db

            class CountingReads:
                def __getattr__(self, name: str) -> Any:
                    return getattr(inner, name)

                async def read(self, op: Any, *args: Any) -> Any:
                    reads[op.__name__] += 1
                    return await inner.read(op, *args)

            rt._db = CountingReads()  # type: ignore[assignment]
            async with rt.watch("s") as updates:
                await rt.submit("s", {"text": "q"})
                async for message in updates:
                    if message.role != "assistant":
                        continue
                    if not go.is_set():
                        go.set()
                        reads.clear()  # from the first word on
                    if message.data.finished:
                        break
    assert reads["changes"] <= 5, reads


async def test_a_watcher_entering_a_watched_session_costs_its_replay_not_every_watchers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A watcher entering a session that others already watch replays the transcript to
    itself: work proportional to the transcript, whatever the number of watchers (DESIGN
    §6.26: work per change is proportional to the change). `WatchHub.publish` offers every
    replayed snapshot that it remembers - also one whose version the hub already knew and
    had offered to every watcher - to every watcher of the session: 20 watchers entering
    one after another on 300 messages make ~63,000 offers instead of ~6,000 (quadratic in
    the watchers; at a thousand watchers, one replay chunk is a 50 ms step). Real time."""
    from trio_sessions import _signals

    offers = [0]
    offer = _signals.Watcher.offer

    def counted(self: _signals.Watcher, *args: Any) -> None:
        offers[0] += 1
        offer(self, *args)

    monkeypatch.setattr(_signals.Watcher, "offer", counted)
    db = tmp_path / "s.db"
    await make_schema(db)
    messages, watchers = 300, 20
    seed_transcript(db, "s", messages)
    with trio.fail_after(BOUND):
        async with (
            trio_sessions.open_runtime(db, None, **NO_RECOVERY) as rt,
            trio.open_nursery() as nursery,
        ):

            async def follow(replayed: trio.Event) -> None:
                async with rt.watch("s") as updates:
                    count = 0
                    async for _ in updates:
                        count += 1
                        if count == messages:
                            replayed.set()

            for _ in range(watchers):
                replayed = trio.Event()
                nursery.start_soon(follow, replayed)
                await replayed.wait()
            nursery.cancel_scope.cancel()
    assert offers[0] <= 2 * messages * watchers, offers[0]


async def _settle_a_large_result_with_a_stream(store: Any, nodes: int) -> float:
    """Settle a tool result of `nodes` JSON nodes while a stream follows the session; the
    longest task step's CPU seconds."""
    big: list[list[int]] = [[] for _ in range(nodes)]

    async def drain(ctx: DrainContext) -> None:
        await ctx.take_inputs()
        writer = await ctx.begin_assistant()
        await writer.start_tool("c1", "search", {"q": "x"})
        await writer.settle_tool("c1", big)
        await writer.finish()

    settled = False
    with trio.fail_after(BOUND):
        async with (
            trio_sessions.open_runtime(store, drain, **NO_RECOVERY) as rt,
            rt.stream("s") as events,
        ):
            with StepMeter() as meter:
                await rt.submit("s", {"text": "go"})
                async for event in events:
                    settled = settled or (event.kind == "part" and event.data.status == "completed")
                    if event.kind == "finish":
                        break
    assert settled
    return meter.longest_cpu


@pytest.mark.serial
async def test_a_large_tool_result_on_sqlite_never_stalls_the_loop(tmp_path: Path) -> None:
    """SQLite writes on the event loop's thread: settling a tool result of 150,000 JSON
    nodes (and finishing its message) takes no task step above 50 ms of CPU. Encoding it
    through cattrs' unstructuring walked every node: 360 ms at 300,000 (a review's
    measurement), now `dumps` alone. Real time."""
    longest = await _settle_a_large_result_with_a_stream(str(tmp_path / "s.db"), 150_000)
    print("LONGEST", longest)
    assert longest < STALL_S, longest


@pytest.mark.serial
async def test_a_large_tool_result_written_while_a_stream_follows_never_stalls_the_loop(
    pg_url: str, pg_schema: str
) -> None:
    """A tool result of 300,000 JSON nodes (under 1 MiB) settled while a stream follows the
    session: no task step of the library above 50 ms of CPU. Checking and copying the
    caller's value runs in a thread, the write in a writer thread, and the stream is given
    the writer's own part - copying it for readers on the loop took 90-220 ms (a review's
    finding). PostgreSQL's threaded store, where the event loop does no SQL. Real time."""
    from trio_sessions._postgres import PostgresStore

    store = PostgresStore(pg_url, schema=pg_schema)
    longest = await _settle_a_large_result_with_a_stream(store, 300_000)
    print("LONGEST", longest)
    assert longest < STALL_S, longest


RESULTS = 4
RESULT_NODES = 300_000


def _many_large_results_drain(
    results: int,
    nodes: int,
    *,
    finish: bool = True,
    writers: list[weakref.ref[AssistantWriter]] | None = None,
) -> Any:
    """A drain whose one assistant message settles `results` tool results of `nodes` JSON
    nodes each (`[[], [], ...]`: the costliest shape per byte to decode), then finishes it
    (or returns with it open, for the runtime to finish); `writers` gets a weak reference
    to its writer."""
    big: list[list[int]] = [[] for _ in range(nodes)]

    async def drain(ctx: DrainContext) -> None:
        await ctx.take_inputs()
        writer = await ctx.begin_assistant()
        if writers is not None:
            writers.append(weakref.ref(writer))
        for k in range(results):
            await writer.start_tool(f"c{k}", "search", {"q": "x"})
            await writer.settle_tool(f"c{k}", big)
        await writer.append_text("done")
        if finish:
            await writer.finish()

    return drain


@pytest.mark.serial
async def test_several_large_tool_results_in_one_message_never_stall_the_loop(
    tmp_path: Path,
) -> None:
    """A drain settling four tool results of 300,000 JSON nodes each in one assistant
    message, on the threaded SQLite store: no task step above 50 ms of CPU. Each settle
    reads the message back, decodes it and encodes it again with every result so far: on
    the event loop's thread that was one step of 133 ms. The loop now gives up a
    transaction that meets more than its budget (`_codec.loop_budget`), and the worker
    thread runs it. Real time."""
    db = tmp_path / "s.db"
    drain = _many_large_results_drain(RESULTS, RESULT_NODES)
    with trio.fail_after(BOUND):
        async with trio_sessions.open_runtime(db, drain, **NO_RECOVERY) as rt:
            with StepMeter() as meter:
                outcome = await rt.run("s")
            [message] = await rt.transcript("s")
            handoffs = rt.statistics().store.handoffs
    assert outcome == Outcome("succeeded")
    assert meter.longest_cpu < STALL_S, meter.longest_cpu
    assert isinstance(message.data, AssistantData) and message.data.finished
    outputs = [part.output for part in message.data.parts if not isinstance(part, TextPart)]
    assert [len(output) for output in outputs] == [RESULT_NODES] * RESULTS
    assert handoffs >= RESULTS  # every settle went to the worker thread


async def _metered_run_without_gc(
    tmp_path: Path, drain: Any, on_return: Callable[[], None] = lambda: None
) -> tuple[Outcome, StepMeter, Message]:
    """`run("s")` of `drain` on a threaded SQLite store, metered (`StepMeter`) with the
    garbage collector off - a collection, which the meter does not count, must not be what
    frees a large message; `on_return` runs as the run returns. Then the one message."""
    gc.disable()
    try:
        with trio.fail_after(BOUND):
            async with trio_sessions.open_runtime(tmp_path / "s.db", drain, **NO_RECOVERY) as rt:
                with StepMeter() as meter:
                    outcome = await rt.run("s")
                on_return()
                [message] = await rt.transcript("s")
    finally:
        gc.enable()
    return outcome, meter, message


@pytest.mark.serial
@pytest.mark.parametrize("finish", [True, False], ids=["finished", "left-open"])
async def test_letting_go_of_several_large_tool_results_never_stalls_the_loop(
    tmp_path: Path, finish: bool
) -> None:
    """The writer of a message holding four tool results of 300,000 JSON nodes each lets go
    of it when the message is finished, or when the drain returns with it open: no task
    step above 50 ms of CPU. Python frees a value node by node, and freeing those 1.2
    million nodes on the event loop's thread, when the drain's last reference to its
    writer went, was one step of 54-62 ms (a CI run's failure). The garbage collector is
    off, and the writer must be gone when the run returns: freed by its last reference,
    not left in a reference cycle for a collection (which `StepMeter` does not count) to
    free on the loop later. Real time."""
    writers: list[weakref.ref[AssistantWriter]] = []
    drain = _many_large_results_drain(RESULTS, RESULT_NODES, finish=finish, writers=writers)

    def writer_is_gone() -> None:
        [writer] = writers
        assert writer() is None

    outcome, meter, message = await _metered_run_without_gc(tmp_path, drain, writer_is_gone)
    assert outcome == Outcome("succeeded")
    assert meter.longest_cpu < STALL_S, meter.longest_cpu
    assert isinstance(message.data, AssistantData) and message.data.finished
    assert message.data.error == (None if finish else "interrupted")


PARALLEL_RESULTS = 8


@pytest.mark.serial
async def test_large_tool_results_settled_in_parallel_tasks_never_stall_the_loop(
    tmp_path: Path,
) -> None:
    """Eight tool calls of one message run in parallel tasks and each settles a result of
    300,000 JSON nodes. Their replies come back out of order, so the writer reads the
    message whole again (not in step) and drops the copy it held - which shares none of
    its results with the new one: freeing that on the loop was one step of 49 ms with
    three results, and more with each. The writer frees what a message it replaces held
    in a worker thread when large, as it does when it lets go of a finished one: no task
    step above 50 ms of CPU. The garbage collector is off (`StepMeter` does not count a
    collection). Real time."""
    big: list[list[int]] = [[] for _ in range(RESULT_NODES)]

    async def drain(ctx: DrainContext) -> None:
        await ctx.take_inputs()
        writer = await ctx.begin_assistant()
        for k in range(PARALLEL_RESULTS):
            await writer.start_tool(f"c{k}", "search", {"q": "x"})
        async with trio.open_nursery() as nursery:
            for k in range(PARALLEL_RESULTS):
                nursery.start_soon(writer.settle_tool, f"c{k}", big)
        await writer.finish()

    outcome, meter, message = await _metered_run_without_gc(tmp_path, drain)
    assert outcome == Outcome("succeeded")
    assert meter.longest_cpu < STALL_S, meter.longest_cpu
    assert isinstance(message.data, AssistantData) and message.data.finished
    outputs = [part.output for part in message.data.parts if not isinstance(part, TextPart)]
    assert [len(output) for output in outputs] == [RESULT_NODES] * PARALLEL_RESULTS


@pytest.mark.serial
async def test_reading_several_large_tool_results_never_stalls_the_loop(tmp_path: Path) -> None:
    """`transcript()`, a `stream()`'s catch-up and a `watch()`'s catch-up of a session whose
    message holds four tool results of 300,000 JSON nodes each, from a second runtime on
    the threaded SQLite store: no task step of either above 50 ms of CPU. The reads ran
    on the event loop's thread (59, 70 and 76 ms); one that meets more than the loop's
    budget now runs again in the worker thread. Real time."""
    db = tmp_path / "s.db"
    drain = _many_large_results_drain(RESULTS, RESULT_NODES)
    with trio.fail_after(BOUND):
        async with trio_sessions.open_runtime(db, drain, **NO_RECOVERY) as rt:
            assert await rt.run("s") == Outcome("succeeded")
        async with trio_sessions.open_runtime(db, None, **NO_RECOVERY) as rt:
            with StepMeter() as read:
                [message] = await rt.transcript("s")
            with StepMeter() as streamed:
                async with rt.stream("s") as events:
                    async for event in events:
                        if event.role == "assistant":
                            break
            with StepMeter() as watched:
                async with rt.watch("s") as updates:
                    async for update in updates:
                        if update.role == "assistant":
                            break
    assert isinstance(message.data, AssistantData) and message.data.finished
    assert event.kind == "message" and update.data == message.data
    longest = {
        "transcript": read.longest_cpu,
        "stream": streamed.longest_cpu,
        "watch": watched.longest_cpu,
    }
    assert max(longest.values()) < STALL_S, longest
