"""`testing.crash` while a store call of a verb or a background path is in flight: its reply,
answered after the crash, makes the crashed runtime write nothing more, start nothing, keep
no entry, and its caller gets an answer (a verb: `StoreError`, as a crashed runtime's verbs
raise) - never trio's "Nursery is closed to new arrivals" or a wait for ever."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from helpers import LateReply, Raw, Recorder, WrappedStore, now_ms, runtime
from trio.testing import MockClock

from trio_sessions import Store, StoreError, _codec, _store, _verbs, testing
from trio_sessions._store.recovery_scan import scan_and_lease

Clock = Callable[[], float]
TABLES = ("session", "session_input", "session_execution", "session_message", "session_recovery")


def snapshot(raw: Raw) -> dict[str, list[str]]:
    """Every row of the tables a runtime writes, for a before/after comparison."""
    return {table: sorted(map(repr, raw.rows(f"SELECT * FROM {table}"))) for table in TABLES}


async def call_after_crash(
    rt: Any, raw: Raw, held: ArmedReply, call: Callable[[], Any]
) -> list[BaseException]:
    """Start `call`, crash the runtime once `held`'s operation committed, then answer it:
    what the call raised (it must end), once the rows are checked as the crash left them."""
    raised: list[BaseException] = []
    held.armed = True
    async with trio.open_nursery() as nursery:

        async def calling() -> None:
            try:
                await call()
            except Exception as exc:
                raised.append(exc)

        nursery.start_soon(calling)
        await held.committed.wait()
        testing.crash(rt)
        await trio.testing.wait_all_tasks_blocked()
        left = snapshot(raw)
        held.answer.set()
    await trio.testing.wait_all_tasks_blocked()
    assert snapshot(raw) == left  # the crashed runtime wrote nothing more
    assert not rt.active_sessions()
    return raised


class ArmedReply(LateReply):
    """`LateReply` holding its operation's reply only once the test armed it (the runtime's
    opening runs the same operations: a recovery pass)."""

    armed = False

    async def run(self, op: Any, *args: Any) -> Any:
        if not (self.armed and op is self._op):
            return await self._inner.run(op, *args)
        self.armed = False
        return await super().run(op, *args)

    async def run_nowait(self, op: Any, *args: Any) -> Any:
        """A close's write (a hand-back, a joined wake) held alike."""
        result = await self._inner.run_nowait(op, *args)
        if self.armed and op is self._op:
            self.armed = False
            self.committed.set()
            with trio.CancelScope(shield=self._shield):
                await self.answer.wait()
        return result

    async def read(self, op: Any, *args: Any) -> Any:
        """A read's reply held alike (a watch's replay, a stream's first read)."""
        result = await self._inner.read(op, *args)
        if self.armed and op is self._op:
            self.armed = False
            self.committed.set()
            with trio.CancelScope(shield=self._shield):
                await self.answer.wait()
        return result


def holding(store: Store, op: Any) -> WrappedStore[ArmedReply]:
    return WrappedStore(store, lambda executor: ArmedReply(executor, op, shield=True))


QUIET = {"recovery_interval": 10_000.0}


async def test_a_purge_batch_answered_after_a_crash_deletes_no_further_batch(
    store: Store,
    clock: Clock,
    db_path: Path,
    autojump_clock: MockClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`purge` runs in batches: one answered after `testing.crash` sends no further batch
    (the crashed runtime deletes nothing more) and the call raises `StoreError`, as a
    crashed runtime's verbs do - not a purge that goes on deleting sessions for a dead
    owner."""
    monkeypatch.setattr(_verbs, "PURGE_BATCH", 1)
    raw = Raw(db_path)
    held = holding(store, _store.purge_batch)
    async with runtime(held, Recorder(), clock, **QUIET) as rt:
        assert held.executor is not None
        for name in ("a", "b", "c"):
            await rt.submit(name, {"n": 1})
            await rt.wait_idle(name)
        await trio.sleep(100)
        raised = await call_after_crash(rt, raw, held.executor, lambda: rt.purge(idle_for=50))
        assert [type(exc) for exc in raised] == [StoreError]
        assert "crashed" in str(raised[0])
    names = [row[0] for row in raw.rows("SELECT id FROM session ORDER BY id")]
    assert names == ["b", "c"]  # the batch answered late, and no other


async def test_a_recovery_scan_answered_after_a_crash_promotes_and_takes_over_nothing(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """`recover_once()` whose scan is answered after `testing.crash`: the pass goes no
    further - no scheduled input found due is promoted, no claim it leased is taken over -
    and the call raises `StoreError`, as a crashed runtime's verbs do (and as the same
    pass does when the crash comes in its `before_recovery_apply` seam), not a report of a
    pass the dead runtime never made."""
    raw = Raw(db_path)
    held = holding(store, scan_and_lease)
    drain = Recorder()
    async with runtime(held, drain, clock, **QUIET) as rt:
        assert held.executor is not None
        await rt.submit("later", {"n": 1}, delay=1_000)
        raw.write("UPDATE session_input SET due_at = ?", (now_ms(clock) - 1,))  # due now
        raw.seed_claim("s", "dead", expires_at=now_ms(clock) - 1_000, owner_id="other")
        raised = await call_after_crash(rt, raw, held.executor, rt.recover_once)
        assert [type(exc) for exc in raised] == [StoreError]
        assert "crashed" in str(raised[0])
        assert raw.one("SELECT due_at FROM session_input")[0] is not None  # not promoted
        assert raw.claim("s")[1] == "other"  # not taken over
    assert drain.calls == []


async def test_a_quarantine_lifted_after_a_crash_raises_and_takes_over_nothing(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """`release_quarantine(resume=True)` whose lift is answered after `testing.crash`: the
    crashed runtime takes nothing over and the call raises `StoreError` - not a normal
    return, which says the takeover was committed and its drain started here."""
    raw = Raw(db_path)
    held = holding(store, _store.lift_quarantine)
    drain = Recorder()
    async with runtime(held, drain, clock, **QUIET) as rt:
        assert held.executor is not None
        raw.seed_claim("q", "poison", expires_at=now_ms(clock) - 1)
        raw.seed_assistant("q", "poison", 1, '{"parts": [], "finished": "no"}')
        assert (await rt.recover_once()).quarantined == 1
        raised = await call_after_crash(
            rt, raw, held.executor, lambda: rt.release_quarantine("poison", resume=True)
        )
        assert [type(exc) for exc in raised] == [StoreError]
        assert "crashed" in str(raised[0])
        assert raw.claim("q")[0] == "poison"  # not taken over
    assert drain.calls == []


async def _idle_session(rt: Any) -> None:
    await rt.submit("s", {"n": 0})
    await rt.wait_idle("s")


VERBS: dict[str, tuple[Any, Callable[[Any], Any]]] = {
    "submit": (_store.submit_and_acquire, lambda rt: rt.submit("s", {"n": 1})),
    "submit-busy": (_store.submit, lambda rt: rt.submit("s", {"n": 1})),
    "submit-interrupt": (
        _store.submit_controlled_and_acquire,
        lambda rt: rt.submit("s", {"n": 1}, on_busy="interrupt"),
    ),
    "submit-reject": (
        _store.submit_controlled_and_acquire,
        lambda rt: rt.submit("s", {"n": 1}, on_busy="reject"),
    ),
    "submit-delay": (_store.submit_scheduled, lambda rt: rt.submit("s", {"n": 1}, delay=5)),
    "submit-truncate": (
        _store.submit_truncating,
        lambda rt: rt.submit("s", {"n": 1}, truncate_after=0),
    ),
    "wake": (_store.wake_and_acquire, lambda rt: rt.wake("s")),
    "run": (_store.wake_and_acquire, lambda rt: rt.run("s")),
    "interrupt-remote": (_store.request_cancel, lambda rt: rt.interrupt("s")),
    "pause": (_store.pause, lambda rt: rt.pause("s")),
    "resume": (_store.resume, lambda rt: rt.resume("s")),
    "delete": (_store.delete_session, lambda rt: rt.delete_session("s")),
    "fork": (_store.fork, lambda rt: rt.fork("s", "t")),
    "truncate": (_store.truncate, lambda rt: rt.truncate("s", after_seq=0)),
    "cancel_input": (_store.cancel_input, lambda rt: rt.cancel_input("nope")),
    "drop-quarantine": (
        _store.drop_quarantined,
        lambda rt: rt.release_quarantine("poison", resume=False),
    ),
}


@pytest.mark.parametrize("verb", sorted(VERBS))
async def test_a_verb_s_write_answered_after_a_crash_is_its_last(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock, verb: str
) -> None:
    """Each one-transaction verb whose reply comes after `testing.crash` (its write landed
    before): it returns what the store said, and the crashed runtime writes, starts and
    registers nothing more for it - no drain, no hand-back, no pass-on, no successor."""
    raw = Raw(db_path)
    op, call = VERBS[verb]
    held = holding(store, op)
    drain = Recorder()
    async with runtime(held, drain, clock, **QUIET) as rt:
        assert held.executor is not None
        await _idle_session(rt)
        if verb == "submit-busy":
            gate = drain.hold()
            await rt.wake("s")
            await drain.entered.wait()
        if verb == "resume":
            await rt.pause("s")
            await rt.submit("s", {"n": 2})
        if verb == "drop-quarantine":  # its doorbell rung: the drop starts no drain
            raw.seed_claim("q", "poison", expires_at=now_ms(clock) - 1)
            raw.seed_assistant("q", "poison", 1, '{"parts": [], "finished": "no"}')
            assert (await rt.recover_once()).quarantined == 1
            raw.write("UPDATE session SET time_woken = 1 WHERE id = 'q'")
        calls = len(drain.calls)
        raised = await call_after_crash(rt, raw, held.executor, lambda: call(rt))
        assert len(drain.calls) == calls
        if verb == "submit-busy":
            gate.set()
    assert raised == []


class _Drain:
    """A drain for the background paths: takes its inputs, writes a message, then fails,
    waits on a gate (an interrupt or a heartbeat comes meanwhile) or returns."""

    def __init__(self) -> None:
        self.entered = trio.Event()
        self.fail = False
        self.gate: trio.Event | None = None

    async def __call__(self, ctx: Any) -> None:
        self.entered.set()
        await ctx.take_inputs()
        reply = await ctx.begin_assistant()
        await reply.append_text("hi")
        if self.gate is not None:
            await self.gate.wait()
        if self.fail:
            raise RuntimeError("drain failed")


BACKGROUND: dict[str, Any] = {
    "acquire": _store.acquire,
    "take_inputs": _store.take_inputs,
    "begin_assistant": _store.begin_assistant,
    "append_text": _store.append_assistant_text,
    "end_iteration": _store.end_iteration,
    "finish_failed": _store.finish_failed,
    "mark_cancelling": _store.mark_cancelling,
    "finish_interrupted": _store.finish_interrupted,
    "heartbeat": _store.heartbeat,
}


@pytest.mark.parametrize("path", sorted(BACKGROUND))
async def test_a_busy_period_s_write_answered_after_a_crash_is_its_last(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock, path: str
) -> None:
    """A busy period's store call (its acquisition, the drain's writes, the iteration's
    end, a failed drain's finish, an interrupt's cleanup, the heartbeat) answered after
    `testing.crash`: nothing more is written - no hand-back, no cleanup, no next
    iteration or successor - no entry stays, and the user's `run()` ends."""
    raw = Raw(db_path)
    held = holding(store, BACKGROUND[path])
    drain = _Drain()
    drain.fail = path == "finish_failed"
    if path in ("mark_cancelling", "finish_interrupted", "heartbeat"):
        drain.gate = trio.Event()
    async with runtime(held, drain, clock, **QUIET) as rt:
        assert held.executor is not None
        await rt.pause("s")
        await rt.submit("s", {"n": 1})  # stored, no drain: the resume starts one (acquire)
        await rt.submit("s", {"n": 2})  # pending: the iteration's end goes on

        async def start() -> None:
            await rt.resume("s")
            if path in ("mark_cancelling", "finish_interrupted"):
                await drain.entered.wait()
                await trio.testing.wait_all_tasks_blocked()  # at its gate
                await rt.interrupt("s")

        raised = await call_after_crash(rt, raw, held.executor, start)
        assert raised == []
        if drain.gate is not None:
            drain.gate.set()
        claim = raw.claim("s")
        if claim is not None:  # a dead owner's claim keeps its lease
            assert claim[3] > now_ms(clock)


async def _watch(rt: Any, seen: list[Any]) -> None:
    async with rt.watch("s") as watcher:
        async for message in watcher:
            seen.append(message)


async def _stream(rt: Any, seen: list[Any]) -> None:
    async with rt.stream("s") as events:
        async for event in events:
            seen.append(event)


FOLLOWERS: dict[str, Any] = {
    "watch-head": _store.newest_message,
    "watch-replay": _store.watched_messages,
    "stream": _store.stream_changes,
}


@pytest.mark.parametrize("what", sorted(FOLLOWERS))
async def test_a_follower_s_read_answered_after_a_crash_ends_it(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock, what: str
) -> None:
    """A `watch()` or `stream()` whose first read is answered after `testing.crash` gives
    what that read found, then ends (nothing feeds it any more), as one open at the crash
    does - it neither raises nor waits for ever."""
    raw = Raw(db_path)
    held = holding(store, FOLLOWERS[what])
    async with runtime(held, Recorder(), clock, **QUIET) as rt:
        assert held.executor is not None
        await rt.submit("s", {"n": 1})
        await rt.wait_idle("s")
        seen: list[Any] = []
        follow = _stream if what == "stream" else _watch
        raised = await call_after_crash(rt, raw, held.executor, lambda: follow(rt, seen))
        assert raised == []
        assert [item.data for item in seen] == [{"n": 1}]


@pytest.mark.parametrize("waiting", ["recover_once", "release_quarantine"])
async def test_a_verb_waiting_for_the_recovery_lock_at_a_crash_writes_nothing(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock, waiting: str
) -> None:
    """A `recover_once()` or `release_quarantine()` called before `testing.crash`, waiting
    for the recovery lock (a pass in flight holds it): the crashed runtime's pass ends,
    and the waiting call then writes nothing - no recovery lease (the scan is a write), no
    quarantine dropped - and raises `StoreError`, as a crashed runtime's verbs do."""
    raw = Raw(db_path)
    held = holding(store, scan_and_lease)
    async with runtime(held, Recorder(), clock, **QUIET) as rt:
        assert held.executor is not None
        raw.seed_claim("q", "poison", expires_at=now_ms(clock) - 1)
        raw.seed_assistant("q", "poison", 1, '{"parts": [], "finished": "no"}')
        assert (await rt.recover_once()).quarantined == 1
        raised: list[BaseException] = []

        async def call(verb: Callable[[], Any]) -> None:
            try:
                await verb()
            except Exception as exc:
                raised.append(exc)

        second = {
            "recover_once": rt.recover_once,
            "release_quarantine": lambda: rt.release_quarantine("poison", resume=False),
        }[waiting]
        async with trio.open_nursery() as nursery:
            held.executor.armed = True
            nursery.start_soon(call, rt.recover_once)
            await held.executor.committed.wait()  # the first pass's scan; the reply waits
            nursery.start_soon(call, second)
            await trio.testing.wait_all_tasks_blocked()  # the second waits for the lock
            raw.seed_claim("s", "dead", expires_at=now_ms(clock) - 1_000, owner_id="other")
            testing.crash(rt)
            await trio.testing.wait_all_tasks_blocked()
            left = snapshot(raw)
            held.executor.answer.set()
        assert snapshot(raw) == left  # no recovery lease, the quarantine kept
        assert [type(exc) for exc in raised] == [StoreError, StoreError]


async def test_a_large_submit_checked_across_a_crash_stores_nothing(
    store: Store,
    clock: Clock,
    db_path: Path,
    autojump_clock: MockClock,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A `submit()` of a large payload, called before `testing.crash` and checked in a
    worker thread across it: the crashed runtime stores nothing - no input, no wake - and
    the call raises `StoreError`, as a crashed runtime's verbs do."""
    raw = Raw(db_path)
    checking = trio.Event()
    go_on = threading.Event()
    check = _codec.check_json_object

    def blocking_check(value: Any, what: str) -> str:
        trio.from_thread.run_sync(checking.set)
        go_on.wait(timeout=60)
        return check(value, what)

    monkeypatch.setattr(_codec, "check_json_object", blocking_check)
    payload = {"items": list(range(50_000))}
    assert not _codec.is_small(payload)
    raised: list[BaseException] = []
    async with runtime(store, Recorder(), clock, **QUIET) as rt:
        left = snapshot(raw)

        async def submit() -> None:
            try:
                await rt.submit("s", payload)
            except Exception as exc:
                raised.append(exc)

        # Virtual time stands still while the worker thread runs (real time).
        autojump_clock.autojump_threshold = math.inf
        async with trio.open_nursery() as nursery:
            nursery.start_soon(submit)
            await checking.wait()  # in the worker thread
            testing.crash(rt)
            go_on.set()
        autojump_clock.autojump_threshold = 0
        assert snapshot(raw) == left
        assert [type(exc) for exc in raised] == [StoreError]


async def test_a_close_s_hand_back_answered_after_a_crash_is_its_last_write(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """`testing.crash` during a graceful close, while its hand-back (expire_claims) is on
    its way: answered, nothing more is written, no entry stays and the close ends."""
    raw = Raw(db_path)
    held = holding(store, _store.expire_claims)
    drain = Recorder()
    gate = drain.hold()
    left: dict[str, list[str]] = {}
    async with trio.open_nursery() as nursery:

        async def crash_in_the_close(rt: Any) -> None:
            await held.executor.committed.wait()  # type: ignore[union-attr]
            testing.crash(rt)
            await trio.testing.wait_all_tasks_blocked()
            left.update(snapshot(raw))
            held.executor.answer.set()  # type: ignore[union-attr]

        async with runtime(held, drain, clock, **QUIET) as rt:
            assert held.executor is not None
            await rt.submit("s", {"n": 1})
            await drain.entered.wait()
            await rt.submit("s", {"n": 2})  # pending: a successor would be due
            held.executor.armed = True
            nursery.start_soon(crash_in_the_close, rt)
    assert snapshot(raw) == left
    assert not rt.active_sessions()
    assert raw.claim("s")[3] <= now_ms(clock)  # handed back before the crash
    assert len(drain.calls) == 1
    gate.set()


@pytest.mark.parametrize("then", ["append", "finish", "return", "raise"])
async def test_a_crash_from_inside_a_drain_is_its_last_write(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock, then: str
) -> None:
    """A drain that calls `testing.crash` on its own runtime (a test simulating a kill
    mid-reply) and goes on - a write, its finish, a return or an error: nothing more is
    written (its write raises `StoreError`), its claim keeps its live lease, no entry
    stays and the `run()` waiting for it ends."""
    raw = Raw(db_path)
    left: dict[str, list[str]] = {}
    errors: list[BaseException] = []
    outcomes: list[Any] = []

    async def drain(ctx: Any) -> None:
        await ctx.take_inputs()
        reply = await ctx.begin_assistant()
        testing.crash(ctx._runtime)
        left.update(snapshot(raw))
        try:
            if then == "append":
                await reply.append_text("more")
            elif then == "finish":
                await reply.finish()
        except StoreError as exc:
            errors.append(exc)
        if then == "raise":
            raise RuntimeError("after the crash")

    async with runtime(store, drain, clock, **QUIET) as rt:
        await rt.submit("s", {"n": 1})
        await rt.submit("s", {"n": 2})
        outcomes.append(await rt.run("s"))
        await trio.testing.wait_all_tasks_blocked()
        assert snapshot(raw) == left
        assert not rt.active_sessions()
        assert raw.claim("s")[3] > now_ms(clock)  # live, as the dead owner left it
    assert len(errors) == (then in ("append", "finish"))
    assert outcomes and outcomes[0].kind == "interrupted"


async def test_a_stream_whose_marks_are_read_across_a_crash_says_the_runtime_crashed(
    store: Store, clock: Clock, db_path: Path, autojump_clock: MockClock
) -> None:
    """`stream()` at a cursor deep in a transcript reads its marks first: answered after
    `testing.crash`, the stream does not start and the `StoreError` says the runtime
    crashed, as every call to it does - not that it "is closed", which a test reading the
    error would take for a close it never made."""
    raw = Raw(db_path)
    held = holding(store, _store.stream_marks)
    async with runtime(held, Recorder(), clock, **QUIET) as rt:
        assert held.executor is not None
        for index in range(_store.MARKS_FROM):
            await rt.submit("s", {"n": index})
        await rt.wait_idle("s")
        async with rt.stream("s") as events:
            cursor = ""
            for _ in range(_store.MARKS_FROM):
                cursor = (await events.__anext__()).cursor

        async def follow() -> None:
            async with rt.stream("s", cursor=cursor):
                pass

        raised = await call_after_crash(rt, raw, held.executor, follow)
        assert [type(exc) for exc in raised] == [StoreError]
        assert "crashed" in str(raised[0])
