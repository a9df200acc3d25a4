"""The chat example's ASGI app (examples/chat_service.py) called in process, as hypercorn
would call it, over a producer runtime: what its handlers answer to input no client should
send, without starting the service's processes (`test_chat_service` does that)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
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


@pytest.mark.parametrize(
    "body",
    [b"[" * 5000 + b"]" * 5000, b'{"text": "\xff"}'],
    ids=["deeply-nested", "not-utf8"],
)
async def test_a_body_json_cannot_read_is_a_400_not_a_server_error(
    tmp_path: Path, body: bytes
) -> None:
    """A body of nested arrays (10 KB, well under MAX_BODY), or of bytes that are no UTF-8,
    is malformed input like any other: 400 with a JSON error, nothing stored - json.loads
    raises RecursionError or UnicodeDecodeError, which the app did not catch, so the
    request ended as a 500 with a traceback in the log."""
    async with trio_sessions.open_runtime(str(tmp_path / "chat.db"), None) as rt:
        app = chat.ChatApp(rt)
        for action in ("messages", "edit", "stop"):
            status, answer = await _call(app, "POST", f"/sessions/s/{action}", body)
            assert status == 400, (action, status, answer)
            assert b"the body must be JSON" in answer, answer
        assert await rt.transcript("s") == []
