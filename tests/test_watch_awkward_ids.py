"""Sessions whose ids hold what an array literal or an SQL string quotes - `"`, `\\`, `,`,
braces, `'`, the word NULL, edge spaces, non-ASCII - watched from another runtime: a look
binds the watched sessions (and the open messages it follows) as arrays on PostgreSQL
(`_store.changes._new_messages`, `watched_changes`, `_extended`), lists on SQLite. Every
watcher sees its own session's reply append by append."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import trio
from backends import Location, PgLocation

import trio_sessions
from trio_sessions import DrainContext

REAL_TIME_BOUND = 10.0
AWKWARD = ['q"uote', "back\\slash", "a,b", "{br}", "NULL", " lead", "trail ", "it's", "ünï €"]


def real_store(location: Location) -> Any:
    """The production store (threaded, real time) for the same data."""
    if isinstance(location, PgLocation):
        from trio_sessions._postgres import PostgresStore

        return PostgresStore(location.url, schema=location.schema)
    return str(location)


def _text(data: Any) -> str:
    return "".join(getattr(part, "text", "") for part in data.parts)


@pytest.mark.parametrize("backend", ["sqlite", "postgres"], indirect=True)
async def test_watchers_of_sessions_with_awkward_ids_see_every_append(db_path: Location) -> None:
    """Each session's drain appends "a", waits until that session's watcher saw it, then
    appends "b" and finishes: the watchers in another runtime (one look for them all) see
    ["a", "ab"], each in its own session - an id mangled by the arrays' binding would
    leave a watcher without its reply (or `watched_changes` without the session)."""
    seen_a = {session_id: trio.Event() for session_id in AWKWARD}

    async def drain(ctx: DrainContext) -> None:
        await ctx.take_inputs()
        writer = await ctx.begin_assistant()
        await writer.append_text("a")
        await seen_a[ctx.session_id].wait()
        await writer.append_text("b")
        await writer.finish()

    texts: dict[str, list[str]] = {session_id: [] for session_id in AWKWARD}

    async def follow(updates: Any, session_id: str) -> None:
        async for message in updates:
            assert message.session_id == session_id
            if message.role != "assistant":
                continue
            text = _text(message.data)
            if text and (not texts[session_id] or text != texts[session_id][-1]):
                texts[session_id].append(text)
                if text == "a":
                    seen_a[session_id].set()
            if message.data.finished:
                return

    with trio.fail_after(REAL_TIME_BOUND):
        async with (
            trio_sessions.open_runtime(real_store(db_path), drain, recovery_interval=60),
            trio_sessions.open_runtime(real_store(db_path), None) as watcher_side,
            contextlib.AsyncExitStack() as stack,
            trio.open_nursery() as nursery,
        ):
            for session_id in AWKWARD:
                updates = await stack.enter_async_context(watcher_side.watch(session_id))
                nursery.start_soon(follow, updates, session_id)
            for session_id in AWKWARD:
                await watcher_side.submit(session_id, {"q": session_id})
    assert texts == {session_id: ["a", "ab"] for session_id in AWKWARD}
