"""The assistant message a drain writes: begin_assistant, then update_assistant's
transitions. On both backends, through the sync engine."""

from __future__ import annotations

import functools
import json
import threading
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

from trio_sessions import (
    DuplicateSettlement,
    MalformedRecord,
    TextPart,
    ToolPart,
    TrioSessionsError,
    _codec,
    _sqlite,
    _store,
    _transcript,
)
from trio_sessions._store import transcript as transcript_family

from .common import (
    LEASE,
    Db,
)


def test_begin_and_update_assistant(db: Db) -> None:
    """begin_assistant appends an empty open message at the next seq; update_assistant applies
    a transition to the stored row and returns the new value, its version, its stream
    step, recorded beside it when there is one, and on PostgreSQL the data as stored (the
    writer's next `Known.text`)."""
    db.run(_store.submit, "s", '{"n": 1}', "in-1")
    execution = db.claim()
    db.run(_store.take_inputs, "s", execution, "owner-a")
    db.run(_store.begin_assistant, "s", execution, "owner-a", "m-1")
    assert db.rows("SELECT role, seq, execution_id FROM session_message WHERE id = 'm-1'") == [
        ("assistant", 2, execution)
    ]
    assert db.message("m-1") == _transcript.EMPTY

    def update(transition: Any) -> Any:
        return db.run(_store.update_assistant, "s", execution, "owner-a", "m-1", transition)

    def stored() -> str | None:
        [(data,)] = db.rows("SELECT data FROM session_message WHERE id = 'm-1'")
        return str(data) if db.dialect == "postgres" else None

    result, version, step, text = update(lambda d: _transcript.append_text(d, "hi"))
    assert version == 1
    assert result == db.message("m-1") == _transcript.append_text(_transcript.EMPTY, "hi")
    assert step is None  # text changed: no "part" or "finish" event makes it
    assert text == stored()
    assert db.rows("SELECT * FROM session_message_change") == []
    result, version, step, text = update(lambda d: _transcript.start_tool(d, "c1", "look", {}))
    assert version == 2 and step == ("part", result.parts[-1])
    assert text == stored()
    [(recorded, kind, data)] = db.rows("SELECT version, kind, data FROM session_message_change")
    assert (recorded, kind, json.loads(data)) == (2, "part", result.parts[-1].to_json())


@pytest.mark.parametrize("edit", ["malformed", "redacted"])
def test_a_write_from_what_the_writer_holds_never_undoes_another_tools_edit_of_the_message(
    db: Db, edit: str
) -> None:
    """DESIGN §6.20 (a backend difference is a bug) and `update_assistant`'s contract: the
    transition runs on the message as stored, not on what the writer remembers. Another
    tool rewrites an open message's data by hand (an operator redacting a secret, a bad
    write), leaving its version as it was; the writer's next tool change, from its `Known`
    view, then works on the stored message: a malformed one raises `MalformedRecord` and
    stays as stored, a redaction stays. SQLite compares the view with the row and does so.
    Found by the differential test (a drain's `finish()` after its open message was
    corrupted: `MalformedRecord` on SQLite, `None` on PostgreSQL). PostgreSQL's fast path
    (`ts_update_message`) trusted the view at the row's version alone and wrote it over
    the edit: the stored redaction was undone, the malformed row silently replaced."""
    execution = db.claim()
    db.run(_store.begin_assistant, "s", execution, "owner-a", "m-1")

    def update(transition: Any, known: _store.Known | None = None) -> Any:
        return db.run(_store.update_assistant, "s", execution, "owner-a", "m-1", transition, known)

    update(lambda d: _transcript.append_text(d, "the secret"))
    data, version, _, text = update(lambda d: _transcript.start_tool(d, "c1", "look", {}))
    known = _store.Known(data, (), version, text)
    if edit == "malformed":
        stored = "{bad"
    else:
        stored = _codec.encode_assistant(
            attrs.evolve(data, parts=(TextPart("[redacted]"), *data.parts[1:]))
        )
    db.write("UPDATE session_message SET data = ? WHERE id = 'm-1'", (stored,))
    settle = functools.partial(_transcript.settle_tool, call_id="c1", output=1)
    if edit == "malformed":
        with pytest.raises(MalformedRecord):
            update(settle, known)
        assert db.rows("SELECT data FROM session_message WHERE id = 'm-1'") == [(stored,)]
        return
    after, _, _, _ = update(settle, known)
    assert after.parts[0] == TextPart("[redacted]")
    assert db.message("m-1") == after


@pytest.mark.parametrize("write", ["append", "update"])
def test_a_version_at_the_top_of_its_range_refuses_the_write(db: Db, write: str) -> None:
    """A message whose version another tool set to 2**63 - 1 has no next version: a write
    to it is refused with nothing written, on both backends. SQLite computed a REAL
    version and stored it (PostgreSQL refused with 'bigint out of range')."""
    db.run(_store.submit, "s", '{"n": 1}', "in-1")
    execution = db.claim()
    db.run(_store.take_inputs, "s", execution, "owner-a")
    db.run(_store.begin_assistant, "s", execution, "owner-a", "m-1")
    db.write("UPDATE session_message SET version = ? WHERE id = 'm-1'", (2**63 - 1,))
    db.write("UPDATE session_message_stream SET version = ? WHERE message_id = 'm-1'", (2**63 - 1,))
    if write == "append":
        args: tuple[Any, ...] = (_store.append_assistant_text, "hi")
    else:
        args = (_store.update_assistant, lambda d: _transcript.append_text(d, "hi"))
    op, last = args
    before = db.snapshot()
    with pytest.raises(TrioSessionsError, match="out of range"):
        db.run(op, "s", execution, "owner-a", "m-1", last)
    assert db.snapshot() == before


def test_a_stale_known_view_never_settles_a_tool_twice(db: Db) -> None:
    """Invariant 12: a writer whose `Known` view of its message is a version behind the
    stored row (it saw the tool running; the row has it settled) cannot settle the tool
    again - the store reads the row and the transition refuses a second settlement - and
    the stored settlement stays. PostgreSQL's fast path trusts a view only at the row's
    exact version: trusting one that is merely not newer would write a second settlement
    over the first (a failure after a success)."""
    execution = db.claim()
    db.run(_store.begin_assistant, "s", execution, "owner-a", "m-1")
    start = functools.partial(_transcript.start_tool, call_id="c1", name="echo", input={"x": 1})
    written = db.run(_store.update_assistant, "s", execution, "owner-a", "m-1", start)
    data, version, _, text = written
    known = _store.Known(data, (), version, text)  # the tool running, at version 2
    settle = functools.partial(_transcript.settle_tool, call_id="c1", output={"ok": 1})
    db.run(_store.update_assistant, "s", execution, "owner-a", "m-1", settle, known)
    settled = db.message("m-1")
    fail = functools.partial(_transcript.settle_tool, call_id="c1", error="boom")
    with pytest.raises(DuplicateSettlement):
        db.run(_store.update_assistant, "s", execution, "owner-a", "m-1", fail, known)
    assert db.message("m-1") == settled
    [part] = settled.parts
    assert isinstance(part, ToolPart)
    assert (part.status, part.output, part.error) == ("completed", {"ok": 1}, None)


def test_a_write_from_what_the_writer_holds_shares_its_objects_while_they_encode_as_stored(
    db: Db,
) -> None:
    """Given what the writer stored last (`Known`), update_assistant runs the transition on
    the writer's very data while that encodes as stored (SQLite compares it with the row,
    PostgreSQL with `Known.text`): the new message shares its unchanged tool parts with it,
    so no decoded copy of a large result is made, nor dropped on the event loop. Once a
    reader edited those objects into something encoding otherwise (`1` made `True`, equal
    in Python), the stored message is read and the edit is never written."""
    db.run(_store.submit, "s", '{"n": 1}', "in-1")
    execution = db.claim()
    db.run(_store.take_inputs, "s", execution, "owner-a")
    db.run(_store.begin_assistant, "s", execution, "owner-a", "m-1")

    def update(transition: Any, known: _store.Known | None) -> Any:
        return db.run(_store.update_assistant, "s", execution, "owner-a", "m-1", transition, known)

    data, version, _, text = update(lambda d: _transcript.start_tool(d, "c1", "look", {}), None)
    data, version, _, text = update(
        lambda d: _transcript.settle_tool(d, "c1", output={"hits": [1]}), None
    )
    known = _store.Known(data, (), version, text)
    after, version, _, text = update(lambda d: _transcript.start_tool(d, "c2", "look", {}), known)
    assert after.parts[0] is data.parts[0]
    assert after == db.message("m-1")
    after.parts[0].output["hits"][0] = True  # a reader's edit: == 1, encodes as `true`
    known = _store.Known(after, (), version, text)
    final, _, _, _ = update(lambda d: _transcript.settle_tool(d, "c2", output=2), known)
    assert final.parts[0] is not after.parts[0]
    assert type(final.parts[0].output["hits"][0]) is int
    assert db.message("m-1") == final
    [(stored,)] = db.rows("SELECT data FROM session_message WHERE id = 'm-1'")
    assert '"hits":[1]' in str(stored)


async def test_a_readers_edit_while_a_write_runs_in_the_worker_thread_is_never_stored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SQLite writes from the writer's held data while it encodes as the row stores it. In
    the worker thread (a large message, or another process holding the lock) the SQL after
    that check releases the GIL, and a reader on the loop may edit the objects it was shown:
    the edit was written to the store (a review's find). The held data is checked again
    once the new message is encoded, as on PostgreSQL: the stored message is used then."""
    loop = threading.get_ident()
    async with _sqlite.SQLiteStore(tmp_path / "s.db").open_executor(None) as executor:
        await executor.run(_store.submit, "s", '{"n": 1}', "in-1")
        await executor.run(_store.acquire, "s", "e1", "o", LEASE)
        await executor.run(_store.take_inputs, "s", "e1", "o")
        await executor.run(_store.begin_assistant, "s", "e1", "o", "m")

        async def update(transition: Any, known: Any) -> Any:
            return await executor.run(
                _store.update_assistant, "s", "e1", "o", "m", transition, known
            )

        result = {"hits": ["x" * 30 for _ in range(10_000)], "flag": "as returned"}
        await update(lambda data: _transcript.start_tool(data, "c1", "look", {}), None)
        data, version, _, _ = await update(
            lambda data: _transcript.settle_tool(data, "c1", output=result), None
        )
        shown = data.parts[0].output  # what a local reader is shown: the writer's objects
        streamed_texts = transcript_family._streamed_texts

        def edited_meanwhile(tx: Any, message_id: str) -> Any:
            if threading.get_ident() != loop:  # in the worker thread: a reader runs now
                trio.from_thread.run_sync(shown.__setitem__, "flag", "a reader's edit")
            return streamed_texts(tx, message_id)

        monkeypatch.setattr(transcript_family, "_streamed_texts", edited_meanwhile)
        await update(
            lambda data: _transcript.start_tool(data, "c2", "look", {}),
            _store.Known(data, (), version, None),
        )
        assert executor.statistics().handoffs >= 1  # the write ran in the worker thread
        [(stored,)] = executor.conn.execute(
            "SELECT data FROM session_message WHERE id = 'm'"
        ).fetchall()
    assert "a reader's edit" not in stored
    assert json.loads(stored)["parts"][0]["output"]["flag"] == "as returned"
