"""Streaming transcript writes (DESIGN §8, §7): an append is one small fenced write whatever
the message's size, every reader sees the merged message, an acknowledged append survives a
SIGKILL, and finishing a drain reads only the messages that may still be open."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trio.testing
from backends import Location, PgLocation
from helpers import JumpingClock, Raw, run_and_jump, runtime, start_run, write_as_zombie
from trio.testing import MockClock

import trio_sessions
from trio_sessions import (
    AssistantData,
    DrainContext,
    Outcome,
    TextPart,
    ToolPart,
    _codec,
)

Clock = Callable[[], float]
REAL_TIME_BOUND = 10.0


def text_of(data: AssistantData) -> str:
    return "".join(part.text for part in data.parts if isinstance(part, TextPart))


def big_output(size: int = 200 * 1024) -> dict[str, str]:
    """An incompressible tool result (PostgreSQL would shrink a repetitive one to nothing)."""
    chunks: list[str] = []
    seed = b"seed"
    while len(chunks) * 64 < size:
        seed = hashlib.sha256(seed).digest()
        chunks.append(seed.hex())
    return {"result": "".join(chunks)[:size]}


def deltas(location: Location) -> int:
    return int(Raw(location).one("SELECT COUNT(*) FROM session_message_delta")[0])


def real_store(location: Location) -> Any:
    """The production store (threaded, real time) for the same data."""
    if isinstance(location, PgLocation):
        from trio_sessions._postgres import PostgresStore

        return PostgresStore(location.url, schema=location.schema)
    return str(location)


# ---------------------------------------------------------------------------------------------
# Bytes written per append


@attrs.define
class WriteMeter:
    """Bytes the store has written so far: the WAL's size on SQLite (the runtime's writer
    never checkpoints here), the WAL insert position on PostgreSQL."""

    location: Location

    def bytes(self) -> int:
        if isinstance(self.location, PgLocation):
            row = Raw(self.location).one(
                "SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '0/0')::bigint"
            )
            return int(row[0])
        return os.path.getsize(f"{self.location}-wal")


def _no_autocheckpoint(conn: Any) -> Any:
    conn.execute("PRAGMA wal_autocheckpoint = 0")
    return conn


async def test_bytes_written_per_append_do_not_grow_with_the_message(
    store: Any, clock: Clock, db_path: Location, autojump_clock: MockClock
) -> None:
    """After a 200 KB tool result, an append writes no more than 1.5x what it writes in an
    empty message; the message's data row is not rewritten by appends at all."""
    if not isinstance(db_path, PgLocation):
        store = attrs.evolve(store, wrap_connection=_no_autocheckpoint)
    meter = WriteMeter(db_path)
    appends, windows = 20, 3
    per_append: dict[str, float] = {}
    stored: dict[str, Any] = {}

    async def measure(writer: trio_sessions.AssistantWriter, name: str) -> None:
        # The least of a few windows: PostgreSQL's WAL position is the server's, which
        # other writers move too (autovacuum, a checkpoint's full-page images, another
        # client) - they only ever add bytes to a window, and the appends' own bytes are
        # the same in each.
        await writer.append_text("warm")
        seen = []
        for _ in range(windows):
            before = meter.bytes()
            for _ in range(appends):
                await writer.append_text("abcd")
            seen.append((meter.bytes() - before) / appends)
        per_append[name] = min(seen)

    async def drain(ctx: DrainContext) -> None:
        empty = await ctx.begin_assistant()
        await measure(empty, "empty")
        await empty.finish()
        big = await ctx.begin_assistant()
        await big.start_tool("c1", "fetch", {"url": "x"})
        await big.settle_tool("c1", big_output())
        stored["before"] = Raw(db_path).one(
            "SELECT data, version FROM session_message WHERE id = ?", (big.message_id,)
        )
        await measure(big, "after_tool")
        stored["after"] = Raw(db_path).one(
            "SELECT data, version FROM session_message WHERE id = ?", (big.message_id,)
        )
        await big.finish()

    async with runtime(store, drain, clock) as rt:
        assert await rt.run("s") == Outcome("succeeded")
        messages = await rt.transcript("s")
    assert per_append["empty"] > 0
    assert per_append["after_tool"] <= 1.5 * per_append["empty"], per_append
    assert stored["after"] == stored["before"]
    assert text_of(messages[-1].data) == "warm" + "abcd" * appends * windows
    assert deltas(db_path) == 0


# ---------------------------------------------------------------------------------------------
# Readers see the merged message


OPEN_REPLY = AssistantData(
    parts=(
        TextPart("Let me look. "),
        ToolPart("c1", "search", {"q": "x"}, "completed", {"hits": 1}, None),
        TextPart("Found it"),
    ),
    finished=False,
    error=None,
)


async def test_every_reader_sees_the_streamed_text(
    store: Any, clock: Clock, db_path: Location, autojump_clock: MockClock
) -> None:
    """While text is streaming (pending deltas), transcript(), ctx.transcript(), another
    runtime's transcript() and watch() replay all see the merged message; once finished,
    session_message.data alone holds all of it."""
    streamed, release = trio.Event(), trio.Event()
    seen_by_drain: list[Any] = []

    async def drain(ctx: DrainContext) -> None:
        writer = await ctx.begin_assistant()
        await writer.append_text("Let me ")
        await writer.append_text("look. ")
        await writer.start_tool("c1", "search", {"q": "x"})
        await writer.settle_tool("c1", {"hits": 1})
        await writer.append_text("Found")
        await writer.append_text(" it")
        seen_by_drain.append((await ctx.transcript())[-1].data)
        streamed.set()
        await release.wait()
        await writer.finish()

    async with (
        runtime(store, drain, clock) as rt,
        trio_sessions.open_runtime(store, None, clock=clock) as producer,
        trio.open_nursery() as nursery,
    ):
        outcomes = start_run(nursery, rt, "s")
        await streamed.wait()
        assert deltas(db_path) == 2  # "Found", " it": not yet folded into data
        assert seen_by_drain == [OPEN_REPLY]
        assert (await rt.transcript("s"))[-1].data == OPEN_REPLY
        assert (await producer.transcript("s"))[-1].data == OPEN_REPLY
        async with producer.watch("s") as updates:
            assert (await updates.__anext__()).data == OPEN_REPLY
        release.set()
        await rt.wait_idle("s")
    assert outcomes == [Outcome("succeeded")]
    data, finished = Raw(db_path).one(
        "SELECT data, finished FROM session_message WHERE role = 'assistant'"
    )
    assert _codec.decode_assistant(data, key="m") == attrs.evolve(OPEN_REPLY, finished=True)
    assert finished == 1
    assert deltas(db_path) == 0
    assert Raw(db_path).rows("SELECT * FROM session_message_stream") == []


@pytest.mark.parametrize("ending", ["finish", "return", "interrupt", "fail"])
async def test_every_ending_folds_the_streamed_text_into_data(
    store: Any, clock: Clock, db_path: Location, autojump_clock: MockClock, ending: str
) -> None:
    """However the message ends - finish(), the drain returning or raising, an interrupt -
    its streamed text is in session_message.data and no delta is left behind."""
    streaming = trio.Event()

    async def drain(ctx: DrainContext) -> None:
        writer = await ctx.begin_assistant()
        await writer.start_tool("c1", "search", {})
        await writer.append_text("a")
        await writer.append_text("b")
        if ending == "finish":
            await writer.finish()
        elif ending == "interrupt":
            streaming.set()
            await trio.sleep_forever()
        elif ending == "fail":
            raise RuntimeError("boom")

    async with runtime(store, drain, clock) as rt, trio.open_nursery() as nursery:
        start_run(nursery, rt, "s")
        if ending == "interrupt":
            await streaming.wait()
            assert await rt.interrupt("s") is True
        await rt.wait_idle("s")
    [(data, finished)] = Raw(db_path).rows(
        "SELECT data, finished FROM session_message WHERE role = 'assistant'"
    )
    decoded = _codec.decode_assistant(data, key="m")
    assert decoded.finished and finished == 1
    assert decoded.parts[1:] == (TextPart("ab"),)
    assert deltas(db_path) == 0


@pytest.mark.parametrize("backend", ["sqlite", "postgres"], indirect=True)
async def test_watchers_in_another_runtime_see_every_append(db_path: Location) -> None:
    """Each append bumps the message's version, so a watcher in another runtime on the same
    store (a store scan, not the writer's local fan-out) follows the text append by append,
    in order. Real time, bounded."""
    words = ["a", "b", "c"]
    steps = [trio.Event() for _ in words]

    async def drain(ctx: DrainContext) -> None:
        await ctx.take_inputs()
        writer = await ctx.begin_assistant()
        await writer.start_tool("c1", "search", {})
        await writer.settle_tool("c1", 1)
        for word, step in zip(words, steps, strict=True):
            await writer.append_text(word)
            await step.wait()
        await writer.finish()

    texts: list[str] = []
    with trio.fail_after(REAL_TIME_BOUND):
        async with (
            trio_sessions.open_runtime(real_store(db_path), drain, recovery_interval=60),
            trio_sessions.open_runtime(real_store(db_path), None) as producer,
            producer.watch("s") as updates,
        ):
            await producer.submit("s", {"q": 1})
            async for message in updates:
                if message.role != "assistant":
                    continue
                text = text_of(message.data)
                if text and (not texts or text != texts[-1]):
                    texts.append(text)
                    steps[len(text) - 1].set()
                if message.data.finished:
                    break
    assert texts == ["a", "ab", "abc"]


@pytest.mark.sqlite_only  # PostgreSQL's TEXT column cannot hold anything but text
async def test_a_streamed_row_that_is_not_text_makes_the_message_malformed(
    store: Any, clock: Clock, db_path: Location, autojump_clock: MockClock
) -> None:
    """A delta row corrupted into a blob is reported like a malformed message: transcript()
    raises MalformedRecord naming session_message_delta and the message, never a crash."""
    streamed, release = trio.Event(), trio.Event()

    async def drain(ctx: DrainContext) -> None:
        writer = await ctx.begin_assistant()
        await writer.append_text("a")
        streamed.set()
        await release.wait()

    async with runtime(store, drain, clock) as rt, trio.open_nursery() as nursery:
        start_run(nursery, rt, "s")
        await streamed.wait()
        Raw(db_path).write("UPDATE session_message_delta SET text = X'00'")
        with pytest.raises(trio_sessions.MalformedRecord) as caught:
            await rt.transcript("s")
        release.set()
    [message_id] = [row[0] for row in Raw(db_path).rows("SELECT id FROM session_message")]
    assert (caught.value.table, caught.value.key) == ("session_message_delta", message_id)
    assert "not text" in caught.value.reasons[0]


# ---------------------------------------------------------------------------------------------
# Fences and crashes


async def test_a_zombie_append_is_refused_and_stores_nothing(
    store: Any, clock: Clock, db_path: Location, autojump_clock: MockClock
) -> None:
    """After the lease passed, an append raises LeaseLost and writes no delta: the message
    reads exactly as before."""
    jumping = JumpingClock(clock)
    jumped = trio.Event()
    errors: list[BaseException] = []

    async def drain(ctx: DrainContext) -> None:
        writer = await ctx.begin_assistant()
        await writer.append_text("kept")
        await write_as_zombie(jumped, lambda: writer.append_text(" late"), errors)

    def deltas() -> list[Any]:
        return Raw(db_path).rows(
            "SELECT message_id, version, text FROM session_message_delta ORDER BY version"
        )

    async with runtime(store, drain, jumping, lease=9.0) as rt:
        before = await run_and_jump(rt, jumping, jumped, deltas)
        after = deltas()
        [message] = await rt.transcript("s")
    assert len(errors) == 1
    assert after == before and [row[2] for row in before] == ["kept"]
    assert text_of(message.data) == "kept"


CRASHING_OWNER = """
import os, sys, trio, trio_sessions

async def drain(ctx):
    await ctx.take_inputs()
    writer = await ctx.begin_assistant()
    await writer.start_tool("c1", "search", {"q": "x"})
    await writer.settle_tool("c1", {"hits": 1})
    n = 0
    while True:
        await writer.append_text(f"<{n}>")
        os.write(1, f"ACK {n}\\n".encode())  # one write: a kill never leaves half a line
        n += 1

async def main(store):
    async with trio_sessions.open_runtime(store, drain) as runtime:
        await runtime.submit("s", {"q": 1})
        await trio.sleep_forever()

if len(sys.argv) == 3:
    from trio_sessions._postgres import PostgresStore
    store = PostgresStore(sys.argv[1], schema=sys.argv[2])
else:
    store = sys.argv[1]
trio.run(main, store)
"""


@pytest.fixture
def killed_mid_stream(db_path: Location, tmp_path: Path) -> int:
    """An owner process streaming appends, SIGKILLed after its 5th acknowledgement; returns
    the highest append it acknowledged before it died."""
    script = tmp_path / "owner.py"
    script.write_text(CRASHING_OWNER)
    where = [db_path.url, db_path.schema] if isinstance(db_path, PgLocation) else [str(db_path)]
    process = subprocess.Popen(
        [sys.executable, str(script), *where], stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None
    with process:
        deadline = time.monotonic() + REAL_TIME_BOUND
        acked = -1
        while acked < 5:
            assert time.monotonic() < deadline, "the owner never streamed"
            line = process.stdout.readline()
            assert line.startswith("ACK"), line
            acked = int(line.split()[1])
        process.send_signal(signal.SIGKILL)
        assert process.wait(timeout=REAL_TIME_BOUND) == -signal.SIGKILL
        rest = process.stdout.read()
        for line in rest.splitlines():  # acknowledged before it died
            assert line.startswith("ACK "), repr(rest)
            acked = int(line.split()[1])
    return acked


@pytest.mark.slow
async def test_acknowledged_appends_survive_a_sigkill_and_the_resume_merges_them(
    store: Any, db_path: Location, killed_mid_stream: int
) -> None:
    """Every append the dead owner acknowledged is in the transcript while its claim is
    still held, and recovery's resume finishes the message with all of it in data."""
    acked = killed_mid_stream
    resumed: list[bool] = []

    def streamed_ok(data: AssistantData) -> bool:
        text = text_of(data)
        # Every acknowledged append, in order; at most one more (committed, not yet printed).
        return text in ("".join(f"<{n}>" for n in range(acked + extra)) for extra in (1, 2))

    async def resume(ctx: DrainContext) -> None:
        resumed.append(ctx.resumed)

    async with trio_sessions.open_runtime(store, None) as producer:
        [_, open_message] = await producer.transcript("s")
    assert not open_message.data.finished and streamed_ok(open_message.data)

    def later() -> float:  # past the dead owner's lease
        return time.time() + 120.0

    with trio.fail_after(REAL_TIME_BOUND):
        async with trio_sessions.open_runtime(store, resume, clock=later) as rt:
            await rt.wait_idle("s")
            [_, message] = await rt.transcript("s")
    assert resumed == [True]
    assert (message.data.finished, message.data.error) == (True, "interrupted: owner lost")
    assert message.data.parts[0] == ToolPart(
        "c1", "search", {"q": "x"}, "completed", {"hits": 1}, None
    )
    assert text_of(message.data) == text_of(open_message.data)
    assert deltas(db_path) == 0


# ---------------------------------------------------------------------------------------------
# Closing open messages reads only those


async def test_finishing_a_drain_decodes_no_finished_message(
    store: Any,
    clock: Clock,
    autojump_clock: MockClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After the drain returns, closing its open messages decodes none of the ten it
    finished: only rows that may still be open are read."""
    decoded: list[str] = []
    counting = False
    decode = _codec.decode_assistant

    def counted(text: Any, *, key: str) -> AssistantData:
        if counting:
            decoded.append(key)
        return decode(text, key=key)

    monkeypatch.setattr(_codec, "decode_assistant", counted)

    async def drain(ctx: DrainContext) -> None:
        nonlocal counting
        for _ in range(10):
            writer = await ctx.begin_assistant()
            await writer.append_text("done")
            await writer.finish()
        left_open = await ctx.begin_assistant()
        await left_open.append_text("open")
        counting = True

    async with runtime(store, drain, clock) as rt:
        assert await rt.run("s") == Outcome("succeeded")
        counting = False
        messages = await rt.transcript("s")
    assert len(decoded) == 1  # the one left open, closed as interrupted
    assert messages[-1].data.error == "interrupted" and text_of(messages[-1].data) == "open"


# ---------------------------------------------------------------------------------------------
# What a drain or a reader holds is its own


async def test_a_drain_changing_its_tool_dicts_after_the_call_changes_nothing_stored(
    store: Any, clock: Clock, autojump_clock: MockClock
) -> None:
    """The dicts a drain gives `start_tool` and `settle_tool` are the caller's: changed
    after the call returned, they change neither the message its later writes store (on
    PostgreSQL those write from what the writer holds) nor what a watcher or a stream was
    shown."""
    shown: list[AssistantData] = []
    parts: list[ToolPart] = []

    async def follow(events: Any) -> None:
        async for event in events:
            if event.kind == "part":
                parts.append(event.data)
            if event.kind == "finish":
                return

    async def drain(ctx: DrainContext) -> None:
        writer = await ctx.begin_assistant()
        filters = ["a"]
        arguments: dict[str, Any] = {"query": "original", "filters": filters}
        await writer.start_tool("c1", "search", arguments)
        arguments["query"] = "changed"
        filters.append("b")
        result = {"hits": [1]}
        await writer.settle_tool("c1", result)
        result["hits"].append(999)
        await writer.append_text("done")
        await writer.finish()

    async with (
        runtime(store, drain, clock) as rt,
        rt.watch("s") as updates,
        rt.stream("s") as events,
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(follow, events)
        await rt.wake("s")
        async for message in updates:
            shown.append(message.data)
            if message.data.finished:
                break
        await rt.wait_idle("s")
        [stored] = await rt.transcript("s")
    arguments = {"query": "original", "filters": ["a"]}
    expected = ToolPart("c1", "search", arguments, "completed", {"hits": [1]}, None)
    assert stored.data.parts == (expected, TextPart("done"))
    assert shown[-1] == stored.data
    assert parts == [attrs.evolve(expected, status="running", output=None), expected]


async def test_a_reader_editing_what_it_was_shown_never_changes_the_drains_message(
    store: Any, clock: Clock, autojump_clock: MockClock
) -> None:
    """A watcher that edits its snapshot (redacting a field for display, say) and a stream
    consumer that edits its event's tool part edit what this runtime's readers of the
    session share (one snapshot for all, as documented), never the drain's message: not
    what its next writes store, nor the snapshot of the message those writes made (the
    writer reads it back: on PostgreSQL the data it held no longer encodes as stored)."""
    edited = trio.Event()
    secret = {"user": "ann", "password": "hunter2"}

    async def drain(ctx: DrainContext) -> None:
        writer = await ctx.begin_assistant()
        await writer.start_tool("c1", "login", dict(secret))
        await edited.wait()
        await writer.settle_tool("c1", {"ok": True})
        await writer.finish()

    async def redact(updates: Any) -> None:
        async for message in updates:
            if message.data.parts:
                message.data.parts[0].input.pop("password")
                return

    async def redact_event(events: Any) -> None:
        async for event in events:
            if event.kind == "part":
                event.data.input["user"] = "someone else"
                return

    async with runtime(store, drain, clock) as rt:
        async with (
            rt.watch("s") as first,
            rt.watch("s") as second,
            rt.stream("s") as events,
            trio.open_nursery() as nursery,
        ):
            nursery.start_soon(redact, first)
            nursery.start_soon(redact_event, events)
            await rt.wake("s")
            await trio.testing.wait_all_tasks_blocked()  # both edits made
            edited.set()
            async for message in second:
                if message.data.finished:
                    break
        await rt.wait_idle("s")
        [stored] = await rt.transcript("s")
    assert stored.data.parts[0].input == secret
    assert message.data.parts[0].input == secret


async def test_a_reader_putting_what_json_cannot_hold_in_its_snapshot_breaks_no_write(
    store: Any, clock: Clock, autojump_clock: MockClock
) -> None:
    """A watcher that puts a set (no JSON value) into a tool input it was shown: the drain's
    next writes still land, as stored - on PostgreSQL the data it holds no longer encodes,
    so the write reads the message instead of failing every later write (a review's
    finding)."""
    shown = trio.Event()
    edited = trio.Event()

    async def drain(ctx: DrainContext) -> None:
        writer = await ctx.begin_assistant()
        await writer.start_tool("c1", "search", {"q": "x"})
        await edited.wait()
        await writer.settle_tool("c1", {"hits": 1})
        await writer.finish()

    async with runtime(store, drain, clock) as rt:
        async with rt.watch("s") as updates, trio.open_nursery() as nursery:
            outcomes = start_run(nursery, rt, "s")
            async for message in updates:
                if message.data.parts and not shown.is_set():
                    shown.set()
                    message.data.parts[0].input["seen"] = {1, 2}
                    edited.set()
                if message.data.finished:
                    break
        await rt.wait_idle("s")
        [stored] = await rt.transcript("s")
    assert outcomes == [Outcome("succeeded")]
    assert stored.data.parts == (
        ToolPart("c1", "search", {"q": "x"}, "completed", {"hits": 1}, None),
    )
