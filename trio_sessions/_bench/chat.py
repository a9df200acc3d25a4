"""Section `chat`: the user-visible chat-load figure (DESIGN §7), SQLite and PostgreSQL.

A web process - this one: a producer runtime (`drain=None`) holding one `stream()` per
chat, as an SSE endpoint would - and two worker processes (real interpreters, each a runtime
whose drain streams an answer). N chats each submit one message, at random moments spread
over the first second; each drain takes its input and streams `--chat-words` words
`--chat-pace` seconds apart (the first at once; word i is due at i x pace, as a model's
stream would deliver it), then finishes. Per chat, on this process's
monotonic clock (one system-wide clock on Linux):

* `ttfw` - from just before `submit()` to the first word seen by the chat's stream;
* `slowdown` - from just before `submit()` to the finished answer seen by the stream,
  divided by the model's own pace ((words - 1) x pace);
* `submit` - how long `submit()` itself took;
* errors - a chat whose answer did not arrive complete, in order, within the timeout.

Keys (N = `--chat-sessions`): `chat_ttfw_p99_ms`, `chat_slowdown_p50`, `chat_slowdown_p99`,
`chat_submit_p99_ms`, `chat_errors`, and the same with a `pg_` prefix.
"""

from __future__ import annotations

import math
import random
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import trio

from .._backend import StoreBackend
from .._model import TextPart
from .._runtime import DrainContext
from .._sqlite import SQLiteStore
from .config import Config
from .remote import store_from_spec, store_spec
from .report import Report, percentile, progress, verdict
from .tools import child_command, child_env, open_bench_runtime

if TYPE_CHECKING:
    from .pg import PgSchemas  # psycopg is an optional extra

WORKERS = 2
SPREAD_S = 1.0  # submits land at random moments over this long
ANSWER_TIMEOUT_S = 60.0
TTFW_P99_MS = 100.0
SLOWDOWN_P50 = 1.1
SLOWDOWN_P99 = 1.5
SUBMIT_P99_MS = 20.0


def word(index: int) -> str:
    return f"w{index} "


async def serve_chat_worker(arguments: dict[str, Any]) -> dict[str, Any]:
    """A worker process: drains stream `words` words `pace` seconds apart, until stdin
    closes; prints "ready" once its runtime is open."""
    words, pace = int(arguments["words"]), float(arguments["pace"])
    answered = 0

    async def drain(ctx: DrainContext) -> None:
        nonlocal answered
        await ctx.take_inputs()
        writer = await ctx.begin_assistant()
        # The model emits word i at start + i x pace whatever our writes cost (a real
        # model's stream buffers in its socket meanwhile): pacing on deadlines, not on
        # sleeps after each write, keeps the write latency out of the model's own pace and
        # in the measured slowdown only where it really delays the answer.
        start = trio.current_time()
        for index in range(words):
            await trio.sleep_until(start + index * pace)
            await writer.append_text(word(index))
        await writer.finish()
        answered += 1

    async with open_bench_runtime(store_from_spec(arguments["store"]), drain):
        print("ready", flush=True)
        await trio.to_thread.run_sync(sys.stdin.read, abandon_on_cancel=True)
    return {"answered": answered}


@attrs.define
class Chat:
    session_id: str
    started: float = math.nan
    submitted: float = math.nan
    first_word: float = math.nan
    finished: float = math.nan
    error: str | None = None


async def follow(rt: Any, chat: Chat, words: int, go: trio.Event) -> None:
    """One chat: stream, submit at a random moment, follow the answer to its end (as an SSE
    endpoint would: `stream()` events applied in order)."""
    expected = "".join(word(index) for index in range(words))
    texts: dict[int, str] = {}  # the assistant messages' text, by seq
    try:
        with trio.fail_after(ANSWER_TIMEOUT_S):
            async with rt.stream(chat.session_id) as events:
                await go.wait()
                await trio.sleep(random.uniform(0, SPREAD_S))
                chat.started = time.monotonic()
                await rt.submit(chat.session_id, {"text": "tell me a story"})
                chat.submitted = time.monotonic()
                async for event in events:
                    if event.role != "assistant":
                        continue
                    finished = False
                    if event.kind == "message":
                        data = event.data
                        texts[event.seq] = "".join(
                            p.text for p in data.parts if isinstance(p, TextPart)
                        )
                        finished = data.finished
                    elif event.kind == "append":
                        texts[event.seq] = texts.get(event.seq, "") + event.data
                    elif event.kind == "finish":
                        finished = True
                    text = texts.get(event.seq, "")
                    if text and math.isnan(chat.first_word):
                        chat.first_word = time.monotonic()
                    if not expected.startswith(text):
                        chat.error = f"text out of order: {text[-40:]!r}"
                        return
                    if finished:
                        chat.finished = time.monotonic()
                        if text != expected:
                            chat.error = f"answer incomplete: {len(text)} of {len(expected)}"
                        return
    except trio.TooSlowError:
        chat.error = "timed out"


@attrs.frozen
class ChatFigures:
    ttfw_ms: list[float]
    slowdown: list[float]
    submit_ms: list[float]
    errors: int


async def chat_load(store: StoreBackend, n: int, words: int, pace: float) -> ChatFigures:
    spec = {"store": store_spec(store), "words": words, "pace": pace}
    chats = [Chat(f"chat-{index:04d}") for index in range(n)]
    go = trio.Event()
    async with open_bench_runtime(store, None) as rt, trio.open_nursery() as nursery:
        workers = []
        for _ in range(WORKERS):
            worker = await trio.lowlevel.open_process(
                child_command("chat-worker", spec),
                stdin=-1,  # subprocess.PIPE: closing it stops the worker
                stdout=-1,
                env=child_env(),
            )
            workers.append(worker)
        try:
            for worker in workers:
                assert worker.stdout is not None
                with trio.fail_after(60):
                    line = await worker.stdout.receive_some(64)
                if not line.startswith(b"ready"):
                    raise RuntimeError(f"chat worker did not start: {line!r}")
            async with trio.open_nursery() as chats_nursery:
                for chat in chats:
                    chats_nursery.start_soon(follow, rt, chat, words, go)
                await trio.sleep(0.2)  # every stream entered before the first submit
                go.set()
        finally:
            for worker in workers:
                assert worker.stdin is not None
                await worker.stdin.aclose()
            with trio.move_on_after(30):
                for worker in workers:
                    await worker.wait()
            for worker in workers:
                if worker.returncode is None:
                    worker.kill()
        nursery.cancel_scope.cancel()
    model = (words - 1) * pace
    done = [chat for chat in chats if chat.error is None]
    return ChatFigures(
        [(chat.first_word - chat.started) * 1000 for chat in done],
        [(chat.finished - chat.started) / model for chat in done],
        [(chat.submitted - chat.started) * 1000 for chat in chats if chat.submitted > 0],
        n - len(done),
    )


async def bench_chat(
    config: Config, folder: Path, report: Report, schemas: PgSchemas | None
) -> None:
    n, words, pace = config.chat_sessions, config.chat_words, config.chat_pace
    progress(
        f"chat: {n} chats, a web process streaming each and {WORKERS} worker processes; "
        f"{words} words {pace * 1000:g} ms apart per answer, per backend"
    )
    backends: list[tuple[str, str, StoreBackend]] = [
        ("sqlite", "", SQLiteStore(folder / "chat.db"))
    ]
    if schemas is not None:
        backends.append(("postgres", "pg_", schemas.store("chat")))
    for name, key, store in backends:
        figures = await chat_load(store, n, words, pace)
        ttfw = percentile(figures.ttfw_ms, 99) if figures.ttfw_ms else math.nan
        slow50 = percentile(figures.slowdown, 50) if figures.slowdown else math.nan
        slow99 = percentile(figures.slowdown, 99) if figures.slowdown else math.nan
        submit = percentile(figures.submit_ms, 99) if figures.submit_ms else math.nan
        report.add(
            "chat",
            f"{name}: submit -> first word seen, {n} chats",
            f"p50 {percentile(figures.ttfw_ms, 50):.1f} ms / p99 {ttfw:.1f} ms",
            "",
            "",
            f"p99 <= {TTFW_P99_MS:g} ms",
            verdict(ttfw <= TTFW_P99_MS),
        )
        report.add(
            "chat",
            f"{name}: answer seen / model's pace ({(words - 1) * pace:g} s)",
            f"p50 {slow50:.3f}x / p99 {slow99:.3f}x",
            "",
            "",
            f"p50 <= {SLOWDOWN_P50}x, p99 <= {SLOWDOWN_P99}x",
            verdict(slow50 <= SLOWDOWN_P50 and slow99 <= SLOWDOWN_P99),
        )
        report.add(
            "chat",
            f"{name}: submit() in the web process; errors",
            f"p50 {percentile(figures.submit_ms, 50):.1f} ms / p99 {submit:.1f} ms;"
            f" {figures.errors} errors",
            "",
            "",
            f"p99 <= {SUBMIT_P99_MS:g} ms, 0 errors",
            verdict(submit <= SUBMIT_P99_MS and figures.errors == 0),
        )
        report.machine[f"{key}chat_ttfw_p99_ms"] = ttfw
        report.machine[f"{key}chat_slowdown_p50"] = slow50
        report.machine[f"{key}chat_slowdown_p99"] = slow99
        report.machine[f"{key}chat_submit_p99_ms"] = submit
        report.machine[f"{key}chat_errors"] = figures.errors
    report.notes.append(
        "chat: the web process is the bench's own (one producer runtime, one stream() per "
        "chat, as an SSE endpoint holds one stream per chat); two worker processes drain. "
        "Submits land at random moments over the first second; the slowdown counts from "
        "just before submit() to the finished answer seen by the stream."
    )
