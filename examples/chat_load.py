"""Load for the chat service: N live event streams held open on one web process, then one
message posted to each conversation; prints how long each POST took and how long each
stream waited for its first streamed word.

Start the service as `chat_service.py` says (one web process, two workers), then:

    python examples/chat_load.py --url http://127.0.0.1:8000 --chats 200

Every stream is open before the first POST, and the POSTs land at random moments over
`--spread` seconds (as users would), so each POST is answered while all N streams are live.
Each message has `--words` words (38 by default), so each answer streams 40 words: at the
example's pace of a word per 50 ms, the 2-second answer of the issue's trial.
A POST that is not 202, a stream that ends early or misses its answer, counts as an error.
The client is raw HTTP/1.1 on trio sockets (the POSTs on keep-alive connections, as a
browser's): on a 2-core machine an httpx client spent as much CPU as the web process it
measured, and its own busy loop showed up in the figures; it prints its CPU time.
The last line is machine-readable: `chats= post_p50_ms= post_p99_ms= ttfw_p99_ms= errors=`.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import random
import time
from collections.abc import Sequence
from typing import Any

import attrs
import httpx
import trio

# The trial: a 40-word answer, a word every 50 ms (the example's default pace) - a
# 2-second answer, as a model streams it.
ANSWER_WORDS = 40


@attrs.define
class Chat:
    """One conversation's figures: the POST's duration, and when its first word arrived."""

    session: str
    post_ms: float | None = None
    posted_at: float | None = None
    first_word_at: float | None = None
    answered: bool = False
    error: str | None = None


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return math.nan  # e.g. no stream saw a word: the errors say why
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def follow(address: tuple[str, int], chat: Chat, opened: trio.Event) -> None:
    """Hold the session's event stream (plain HTTP/1.1 on a socket: the client's own cost
    stays small beside the server's) until its assistant message is finished. A short
    answer may arrive whole in one "message" event, so a message counts as well as an
    "append" for the first word, and its `finished` as well as a "finish" event."""
    host, port = address
    try:
        stream = await trio.open_tcp_stream(host, port)
    except OSError as exc:  # no service there: this chat's error, not a traceback
        chat.error = f"events: cannot connect to {host}:{port}: {exc}"
        opened.set()
        return
    async with stream:
        request = f"GET /sessions/{chat.session}/events HTTP/1.1\r\nHost: {host}\r\n\r\n"
        await stream.send_all(request.encode())
        buffer = b""
        while chunk := await stream.receive_some():
            if not opened.is_set():
                opened.set()
                if not chunk.startswith(b"HTTP/1.1 200"):
                    chat.error = f"events: {chunk.splitlines()[0]!r}"
                    return
            buffer += chunk
            *events, buffer = buffer.split(b"\n\n")
            for raw in events:
                _, found, data = raw.partition(b"data: ")
                if found and _answer_event(chat, json.loads(data)):
                    return
    opened.set()
    chat.error = "the event stream ended before the answer finished"


def _answer_event(chat: Chat, event: dict[str, Any]) -> bool:
    """Note the first word of the assistant's answer; whether the answer is finished."""
    if event["kind"] == "message" and event["role"] == "assistant":
        if event["data"]["parts"] and chat.first_word_at is None:
            chat.first_word_at = time.perf_counter()
        chat.answered = event["data"]["finished"]
    elif event["kind"] == "append" and chat.first_word_at is None:
        chat.first_word_at = time.perf_counter()
    elif event["kind"] == "finish":
        chat.answered = True
    return chat.answered


@attrs.define
class Connections:
    """Keep-alive connections for the POSTs, as a browser's (or httpx's) pool keeps them: a
    POST takes an idle one or opens one, and gives it back after a whole response."""

    address: tuple[str, int]
    idle: list[trio.SocketStream] = attrs.Factory(list)

    async def request(self, request: bytes) -> bytes:
        if self.idle:
            stream = self.idle.pop()
        else:
            stream = await trio.open_tcp_stream(*self.address)
        try:
            await stream.send_all(request)
            response = b""
            while b"\r\n\r\n" not in response or len(response) < _response_length(response):
                chunk = await stream.receive_some()
                if not chunk:
                    raise trio.BrokenResourceError("the server closed the connection")
                response += chunk
        except BaseException:
            await trio.aclose_forcefully(stream)
            raise
        self.idle.append(stream)
        return response

    async def aclose(self) -> None:
        for stream in self.idle:
            await trio.aclose_forcefully(stream)


def question(chat: Chat, words: int) -> str:
    """The chat's message: `words` words (at least its three naming words), which the
    example's drain answers with two more, streamed a word at a time."""
    return " ".join([f"hello from {chat.session}", *["word"] * (words - 3)])


async def post(connections: Connections, chat: Chat, delay: float, words: int) -> None:
    """POST the chat's message as a raw HTTP/1.1 request (as `follow` reads): httpx's pool
    cost the client more CPU per request than the server spends on it (its pool scans every
    connection per request), and on 2 cores the client's busy loop then delayed the very
    responses it measured."""
    body = json.dumps({"text": question(chat, words)}).encode()
    request = (
        f"POST /sessions/{chat.session}/messages HTTP/1.1\r\nHost: {connections.address[0]}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    await trio.sleep(delay)
    chat.posted_at = started = time.perf_counter()
    try:
        response = await connections.request(request)
    except (OSError, trio.BrokenResourceError) as exc:
        chat.error = f"post: {exc!r}"
        return
    chat.post_ms = (time.perf_counter() - started) * 1000
    if not response.startswith(b"HTTP/1.1 202"):
        status = response.partition(b"\r\n")[0]
        chat.error = f"post: {status!r}"


def _response_length(response: bytes) -> int:
    """The length of a whole response whose head `response` holds (head and body)."""
    head, _, _ = response.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(head) + 4 + int(value)
    return len(head) + 4


async def run(
    url: str, chats: int, spread: float, give_up_after: float, *, words: int = ANSWER_WORDS - 2
) -> list[Chat]:
    tag = f"load-{random.randrange(16**6):06x}"
    everyone = [Chat(f"{tag}-{n}") for n in range(chats)]
    address = address_of(url)
    connections = Connections(address)
    with trio.move_on_after(give_up_after):
        async with trio.open_nursery() as nursery:
            for chat in everyone:
                opened = trio.Event()
                nursery.start_soon(follow, address, chat, opened)
                await opened.wait()
            for chat in everyone:
                if chat.error is None:  # a chat whose stream failed posts nothing
                    nursery.start_soon(post, connections, chat, random.uniform(0, spread), words)
    await connections.aclose()
    return everyone


def address_of(url: str) -> tuple[str, int]:
    """The host and port of the service's `http://HOST[:PORT]` URL (port 80 when it names
    none); `ValueError` naming the URL for anything else."""
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as exc:
        raise ValueError(f"--url must be http://HOST[:PORT], got {url!r}: {exc}") from None
    if parsed.scheme != "http" or not parsed.host:
        raise ValueError(f"--url must be http://HOST[:PORT], got {url!r}")
    return parsed.host, parsed.port or 80


def summary(everyone: list[Chat]) -> str:
    posts = [chat.post_ms for chat in everyone if chat.post_ms is not None]
    waits = [
        (chat.first_word_at - chat.posted_at) * 1000
        for chat in everyone
        if chat.first_word_at is not None and chat.posted_at is not None
    ]
    errors = sum(chat.error is not None or not chat.answered for chat in everyone)
    return (
        f"chats={len(everyone)} post_p50_ms={percentile(posts, 50):.1f}"
        f" post_p99_ms={percentile(posts, 99):.1f} ttfw_p99_ms={percentile(waits, 99):.1f}"
        f" errors={errors}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--chats", type=int, default=200)
    parser.add_argument("--spread", type=float, default=1.0, help="seconds the POSTs span")
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument(
        "--words",
        type=int,
        default=ANSWER_WORDS - 2,
        help="words per message (the answer streams two more)",
    )
    args = parser.parse_args(argv)
    if args.chats < 1:
        parser.error(f"--chats must be at least 1, not {args.chats}")
    if args.words < 3:
        parser.error(f"--words must be at least 3, not {args.words}")
    if not 0 <= args.spread < math.inf:
        parser.error(f"--spread must be a number of seconds, at least 0, not {args.spread}")
    if not 0 < args.timeout <= math.inf:
        parser.error(f"--timeout must be a number of seconds above 0, not {args.timeout}")
    try:
        address_of(args.url)
    except ValueError as exc:
        parser.error(str(exc))
    started = time.perf_counter()
    everyone = trio.run(
        functools.partial(run, words=args.words), args.url, args.chats, args.spread, args.timeout
    )
    # On a small machine the client shares the cores with the server: its own CPU says
    # whether it could have slowed down what it measured.
    wall = time.perf_counter() - started
    print(f"client: {time.process_time():.2f} s CPU over {wall:.2f} s")
    for chat in everyone:
        if chat.error is not None or not chat.answered:
            print(f"{chat.session}: {chat.error or 'no finished answer in time'}")
    print(summary(everyone))
    return 0 if all(chat.error is None and chat.answered for chat in everyone) else 1


if __name__ == "__main__":
    raise SystemExit(main())
