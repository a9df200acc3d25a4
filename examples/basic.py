"""The smallest trio_sessions program: submit inputs, let a drain answer, read the transcript.

Run it: `python examples/basic.py`. It uses a temporary SQLite file; pass a path to keep it
(or a `postgresql://` URL, with the `postgres` extra installed: the store is named as
`open_runtime` takes it).

The drain is an async function taking a `DrainContext`. It takes the session's pending
inputs (each becomes a user message, atomically), then answers the user messages still owed
an answer with one assistant message. It finds them in the transcript rather than among the
inputs it took: after a crash the runtime resumes the drain (`ctx.resumed`), but the dead
owner had already taken the inputs, so `take_inputs()` returns nothing for them. Its
unfinished answer was closed as "interrupted: owner lost", so `trio_sessions.unanswered`
looks past it.

`submit` is durable when it returns: had this process died right after it, the next runtime
opened on the same file would have found the input and drained it.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import trio

import trio_sessions


async def echo(ctx: trio_sessions.DrainContext) -> None:
    """Answer the session's unanswered user messages with one assistant message."""
    await ctx.take_inputs()  # pending inputs become user messages, atomically
    questions = trio_sessions.unanswered(await ctx.transcript())
    if not questions:
        return  # a wake with nothing left to answer
    reply = await ctx.begin_assistant()
    await reply.append_text("You said: " + " / ".join(m.data["text"] for m in questions))
    await reply.finish()


def show(message: trio_sessions.Message) -> str:
    if message.role == "user":
        return f"{message.seq}. user: {message.data['text']}"
    text = "".join(p.text for p in message.data.parts if isinstance(p, trio_sessions.TextPart))
    return f"{message.seq}. assistant: {text}"


async def main(db: str | Path) -> None:
    async with trio_sessions.open_runtime(db, echo) as runtime:
        for text in ("hello", "how are you?"):
            # Durable when it returns; the drain starts at once, in the runtime's nursery.
            await runtime.submit("greeting", {"text": text})
            # Returns when the session is idle again, whatever drained it.
            await runtime.wait_idle("greeting")
        for message in await runtime.transcript("greeting"):
            print(show(message))


if __name__ == "__main__":
    if len(sys.argv) > 1:
        # The text as given, never a `Path`: one folds "postgresql://" into "postgresql:/",
        # a file name. A store that cannot be used says why in one line.
        try:
            trio.run(main, sys.argv[1])
        except (trio_sessions.StoreError, ValueError) as exc:
            sys.exit(f"error: {exc}")
    else:
        with tempfile.TemporaryDirectory() as tmp:
            trio.run(main, Path(tmp) / "sessions.db")
