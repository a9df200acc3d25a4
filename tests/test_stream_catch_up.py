"""Many streams following answers another runtime writes (DESIGN §5.2, §6.26, §7 chat load):
the change scan catches every stream behind up in one read for all of them
(`stream_catch_up`), so a web process holding a stream per chat does not read once per
stream per word. Real time, bounded: the answers' words are gated by events."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import attrs
import pytest
import trio
from test_stream import real_store

import trio_sessions
from trio_sessions import DrainContext, StreamEvent, _store
from trio_sessions._stream import StreamHub

CHATS = 12
WORDS = 5
BOUND = 30.0


@attrs.define
class Chats:
    """Streams held by a web runtime, one per chat, applying each event to the chat's text
    (`texts`); `holding`: the chats whose (open) answer reached their stream."""

    sessions: list[str]
    texts: dict[str, str] = attrs.field(init=False)
    holding: set[str] = attrs.Factory(set)
    done: set[str] = attrs.Factory(set)
    progress: trio.Event = attrs.Factory(trio.Event)

    def __attrs_post_init__(self) -> None:
        self.texts = dict.fromkeys(self.sessions, "")

    async def follow(self, rt: trio_sessions.Runtime, session: str, entered: trio.Event) -> None:
        async with rt.stream(session) as events:
            entered.set()
            async for event in events:
                self.apply(event, session)
                self.progress.set()
                if session in self.done:
                    return

    def apply(self, event: StreamEvent, session: str) -> None:
        if event.kind == "message" and event.role == "assistant":
            self.holding.add(session)
            self.texts[session] = "".join(getattr(p, "text", "") for p in event.data.parts)
            if event.data.finished:
                self.done.add(session)
        elif event.kind == "append":
            self.texts[session] += event.data
        elif event.kind == "finish":
            self.done.add(session)

    async def until(self, condition: Callable[[], bool]) -> None:
        while not condition():
            await self.progress.wait()
            self.progress = trio.Event()


def every_text_has_words(chats: Chats, words: int) -> bool:
    return all(text.count(" ") >= words for text in chats.texts.values())


@asynccontextmanager
async def chatting(
    db_path: Any, drain: Callable[[DrainContext], Awaitable[None]], chats: Chats
) -> AsyncIterator[trio_sessions.Runtime]:
    """A worker runtime draining with `drain` and a web runtime holding one stream per chat,
    each chat submitted once its stream is open; the block runs (given the web runtime) once
    every stream holds its answer."""
    async with (
        trio_sessions.open_runtime(real_store(db_path), drain, recovery_interval=60),
        trio_sessions.open_runtime(real_store(db_path), None) as web,
        trio.open_nursery() as nursery,
    ):
        for session in chats.sessions:
            entered = trio.Event()
            nursery.start_soon(chats.follow, web, session, entered)
            await entered.wait()
            await web.submit(session, {"text": "hi"})
        await chats.until(lambda: chats.holding == set(chats.sessions))
        yield web
        nursery.cancel_scope.cancel()


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

    def open_counted(
        hub: StreamHub, session_id: str, position: Any, read: Any, marks: Any = ()
    ) -> Any:
        async def counted(op: Any, *args: Any) -> Any:
            if op is _store.stream_changes:
                own_reads.append(args[0])
            return await read(op, *args)

        return hub_open(hub, session_id, position, counted, marks)

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

    chats = Chats([f"c{index}" for index in range(CHATS)])
    with trio.fail_after(BOUND):
        async with chatting(db_path, drain, chats):
            own_reads.clear()
            for index, gate in enumerate(words):
                gate.set()
                await chats.until(functools.partial(every_text_has_words, chats, index + 1))
            assert own_reads == []
            finish.set()
            await chats.until(lambda: len(chats.done) == CHATS)
    expected = "".join(f"w{index} " for index in range(WORDS))
    assert chats.texts == dict.fromkeys(chats.sessions, expected)


@pytest.mark.parametrize("backend", ["postgres"], indirect=True)
async def test_a_signal_naming_one_session_catches_up_only_its_streams_in_one_read(
    db_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL's signals name the sessions that changed: the change scan after one
    reads for the streams of those sessions only, not for every stream the web process
    holds (under the chat load, 200 streams per append batch) - and in one read, the
    catch-up itself: no heads read first to learn what the signal already said (a second
    round trip for every streamed word)."""
    from trio_sessions import _loops

    monkeypatch.setattr(_loops, "CHANGE_FALLBACK_POLL", 60.0)  # no look but the signals'
    heads_read: list[set[str]] = []
    caught_up: list[set[str]] = []
    heads, catch_up = _store.stream_heads, _store.stream_catch_up

    def recorded_heads(tx: Any, tops: dict[str, int], message_ids: Any) -> Any:
        heads_read.append(set(tops))
        return heads(tx, tops, message_ids)

    def recorded_catch_up(tx: Any, reads: Any) -> Any:
        caught_up.append({session for session, _ in reads})
        return catch_up(tx, reads)

    monkeypatch.setattr(_store, "stream_heads", recorded_heads)
    monkeypatch.setattr(_store, "stream_catch_up", recorded_catch_up)
    scans: list[str] = []  # the owners of the change scans (doorbells, claims, watchers)
    changes = _store.changes

    def scanned(tx: Any, owner_id: str, *args: Any) -> Any:
        scans.append(owner_id)
        return changes(tx, owner_id, *args)

    monkeypatch.setattr(_store, "changes", scanned)
    chats = Chats([f"c{index}" for index in range(6)])
    go = {session: trio.Event() for session in chats.sessions}

    async def drain(ctx: DrainContext) -> None:
        await ctx.take_inputs()
        writer = await ctx.begin_assistant()
        await go[ctx.session_id].wait()
        await writer.append_text("word")
        await trio.sleep_forever()

    with trio.fail_after(BOUND):
        async with chatting(db_path, drain, chats) as web:
            heads_read.clear()
            caught_up.clear()
            scans.clear()
            go["c3"].set()
            await chats.until(lambda: chats.texts["c3"] == "word")
            web_scans = scans.count(web.owner_id)
    # A transcript-only change needs no scan of doorbells and claims where no watcher
    # follows the session: the web process went straight to its streams.
    assert web_scans == 0
    # The word reached c3's stream through a catch-up read naming c3, with no heads read.
    # (A late signal of an earlier write may name other sessions, in a read of its own or
    # in c3's when the two signals arrived together - never every stream.)
    assert heads_read == []
    assert any("c3" in sessions for sessions in caught_up), caught_up
    assert all(sessions < set(chats.sessions) for sessions in caught_up), caught_up
