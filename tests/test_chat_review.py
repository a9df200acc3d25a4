"""Review of the chat example (examples/chat_service.py), in process: its ASGI app over a
producer runtime, called as hypercorn would call it. Each test fails on the code it was
written against."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import trio
from test_examples import load_example

import trio_sessions

chat = load_example("chat_service")


async def _call(
    app: Any, method: str, path: str, body: bytes = b"", headers: list[Any] | None = None
) -> tuple[int | None, bytes]:
    """One request: its status and body (the app's exceptions propagate, as to hypercorn,
    which answers 500)."""
    sent: list[Any] = []
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await trio.sleep_forever()
        raise AssertionError  # pragma: no cover

    async def send(message: Any) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "headers": headers or [],
        "query_string": b"",
    }
    await app(scope, receive, send)
    status = next((m["status"] for m in sent if m["type"] == "http.response.start"), None)
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


async def test_a_deeply_nested_json_body_is_a_400_not_a_server_error(tmp_path: Path) -> None:
    """A body of nested arrays (10 KB, well under MAX_BODY) is malformed input like any
    other: 400 with a JSON error, nothing stored - json.loads raises RecursionError, which
    the app did not catch, so the request ended as a 500 with a traceback in the log."""
    nested = b"[" * 5000 + b"]" * 5000
    async with trio_sessions.open_runtime(str(tmp_path / "chat.db"), None) as rt:
        app = chat.ChatApp(rt)
        for action in ("messages", "edit", "stop"):
            status, body = await _call(app, "POST", f"/sessions/s/{action}", nested)
            assert status == 400, (action, status, body)
        assert await rt.transcript("s") == []
