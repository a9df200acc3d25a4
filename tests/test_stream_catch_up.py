"""Many streams following answers another runtime writes (DESIGN §5.2, §6.26, §7 chat load):
the change scan catches every stream behind up in one read for all of them
(`stream_catch_up`), so a web process holding a stream per chat does not read once per
stream per word. Real time, bounded: the answers' words are gated by events."""

from __future__ import annotations

from typing import Any

import pytest
import trio
from test_stream import real_store

import trio_sessions
from trio_sessions import DrainContext, StreamEvent, _store
from trio_sessions._stream import StreamHub

CHATS = 12
WORDS = 5
BOUND = 30.0


@pytest.mark.parametrize("backend", ["sqlite", "postgres"], indirect=True)
async def test_streams_behind_on_appends_are_caught_up_without_reads_of_their_own(
    db_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """12 chats each stream an answer from another runtime, one word at a time for all of
    them together: once each stream holds its open answer, no stream reads by itself
    (`stream_changes`) until the answers finish - each word reaches every stream through
    the change scan's shared read - and every stream ends with the full answer."""
    own_reads: list[str] = []  # the sessions of the reads streams make by themselves
    hub_open = StreamHub.open

    def open_counted(hub: StreamHub, session_id: str, position: Any, read: Any) -> Any:
        async def counted(op: Any, *args: Any) -> Any:
            if op is _store.stream_changes:
                own_reads.append(args[0])
            return await read(op, *args)

        return hub_open(hub, session_id, position, counted)

    monkeypatch.setattr(StreamHub, "open", open_counted)
    words = [trio.Event() for _ in range(WORDS)]
    finish = trio.Event()

    async def drain(ctx: DrainContext) -> None:
        await ctx.take_inputs()
        writer = await ctx.begin_assistant()
        for index, gate in enumerate(words):
            await gate.wait()
            await writer.append_text(f"w{index} ")
        await finish.wait()
        await writer.finish()

    sessions = [f"c{index}" for index in range(CHATS)]
    holding: set[str] = set()  # streams holding their (open) answer
    texts = dict.fromkeys(sessions, "")
    done: set[str] = set()
    progress = trio.Event()

    async def follow(rt: trio_sessions.Runtime, session: str, entered: trio.Event) -> None:
        async with rt.stream(session) as events:
            entered.set()
            async for event in events:
                apply(event, session)
                progress.set()
                if session in done:
                    return

    def apply(event: StreamEvent, session: str) -> None:
        if event.kind == "message" and event.role == "assistant":
            holding.add(session)
            texts[session] = "".join(getattr(p, "text", "") for p in event.data.parts)
            if event.data.finished:
                done.add(session)
        elif event.kind == "append":
            texts[session] += event.data
        elif event.kind == "finish":
            done.add(session)

    async def until(condition: Any) -> None:
        nonlocal progress
        while not condition():
            await progress.wait()
            progress = trio.Event()

    with trio.fail_after(BOUND):
        async with (
            trio_sessions.open_runtime(real_store(db_path), drain, recovery_interval=60),
            trio_sessions.open_runtime(real_store(db_path), None) as web,
            trio.open_nursery() as nursery,
        ):
            for session in sessions:
                entered = trio.Event()
                nursery.start_soon(follow, web, session, entered)
                await entered.wait()
                await web.submit(session, {"text": "hi"})
            await until(lambda: len(holding) == CHATS)
            own_reads.clear()
            for index, gate in enumerate(words):
                gate.set()
                await until(lambda n=index + 1: all(t.count(" ") >= n for t in texts.values()))
            assert own_reads == []
            finish.set()
            await until(lambda: len(done) == CHATS)
    expected = "".join(f"w{index} " for index in range(WORDS))
    assert texts == dict.fromkeys(sessions, expected)


@pytest.mark.parametrize("backend", ["postgres"], indirect=True)
async def test_a_signal_naming_one_session_looks_only_at_its_streams(
    db_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL's signals name the sessions that changed: the change scan after one
    looks for the streams of those sessions only, not for every stream the web process
    holds (under the chat load, a scan of 200 streams' heads per append batch)."""
    from trio_sessions import _loops

    monkeypatch.setattr(_loops, "CHANGE_FALLBACK_POLL", 60.0)  # no look but the signals'
    looked: list[set[str]] = []
    heads = _store.stream_heads

    def recorded(tx: Any, tops: dict[str, int], message_ids: Any) -> Any:
        looked.append(set(tops))
        return heads(tx, tops, message_ids)

    monkeypatch.setattr(_store, "stream_heads", recorded)
    sessions = [f"c{index}" for index in range(6)]
    go = {session: trio.Event() for session in sessions}
    finish = trio.Event()

    async def drain(ctx: DrainContext) -> None:
        await ctx.take_inputs()
        writer = await ctx.begin_assistant()
        await go[ctx.session_id].wait()
        await writer.append_text("word")
        await finish.wait()
        await writer.finish()

    holding: set[str] = set()
    texts = dict.fromkeys(sessions, "")
    progress = trio.Event()

    async def follow(rt: trio_sessions.Runtime, session: str, entered: trio.Event) -> None:
        nonlocal progress
        async with rt.stream(session) as events:
            entered.set()
            async for event in events:
                if event.kind == "message" and event.role == "assistant":
                    holding.add(session)
                elif event.kind == "append":
                    texts[session] += event.data
                progress.set()

    async def until(condition: Any) -> None:
        nonlocal progress
        while not condition():
            await progress.wait()
            progress = trio.Event()

    with trio.fail_after(BOUND):
        async with (
            trio_sessions.open_runtime(real_store(db_path), drain, recovery_interval=60),
            trio_sessions.open_runtime(real_store(db_path), None) as web,
            trio.open_nursery() as nursery,
        ):
            for session in sessions:
                entered = trio.Event()
                nursery.start_soon(follow, web, session, entered)
                await entered.wait()
                await web.submit(session, {"text": "hi"})
            await until(lambda: holding == set(sessions))
            looked.clear()
            go["c3"].set()
            await until(lambda: texts["c3"] == "word")
            finish.set()
            for event in go.values():
                event.set()
            nursery.cancel_scope.cancel()
    assert looked and looked[0] == {"c3"}, looked
