"""Conversation control used together, as a chat product does: a stateful test (DESIGN §5.1,
§5.2, invariants §6.16, §6.23-25).

Hypothesis drives a worker runtime and a producer (another process of the chat product) on
one store with submit (every `on_busy`, due now or scheduled, and idempotent retries),
`cancel_input`, pause/resume, interrupt, delete, fork, truncate, purge, run, drains held on
a gate and released, streams dropped and resumed from their cursor, and time advancing. A model of
what DESIGN says is checked after every step:

* no input lost or duplicated: every accepted input is pending or is exactly one user
  message, and no drain was given one twice; a scheduled input is never taken before due;
  a cancelled or rejected one never;
* no drain starts on a session once its pause returned (until `resume`), nor on a fork;
  a deleted session keeps no row, and no input of its old life comes back;
* forks are independent of their parent: a fork's transcript stays what it was copied as;
* nothing is stranded: a session neither paused nor held has no due input left untaken
  (once the worker had time to see a producer's write);
* a stream resumed from its cursor, applied event by event, equals `transcript()`.

The runtimes live in a trio run of their own on a worker thread, on the inline store and a
virtual clock that only the `advance` rule moves (no autojump), so each step settles
(`wait_all_tasks_blocked`) at a deterministic virtual instant. Derandomized, no example
database: the same examples every run, under 30 s per backend.
"""

from __future__ import annotations

import copy
import functools
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import trio
import trio.testing
from backends import PgLocation, Reader
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import trio_sessions
from trio_sessions import (
    AssistantData,
    DrainContext,
    Message,
    Outcome,
    SessionBusy,
    StreamEvent,
    TextPart,
    ToolPart,
    testing,
)

T = TypeVar("T")
Opened = tuple[Any, Any, Callable[[], None]]  # a store, its location, how to give it back
SESSIONS = ("a", "b")
WORKER, PRODUCER = "worker", "producer"
VIA = st.sampled_from((WORKER, WORKER, PRODUCER))
# Virtual seconds the worker may take to act on a producer's write: the inline SQLite store
# sends no change signal, so its next recovery pass (every 5 s) finds the doorbell.
REMOTE_LATENCY = 6.0
LEASE = 30.0
PENDING = "SELECT id FROM session_input WHERE session_id = ?"
USER_INPUTS = "SELECT input_id FROM session_message WHERE session_id = ? AND input_id IS NOT NULL"
# Both in one statement: one snapshot of the store.
INPUTS = (
    "SELECT 'pending', id FROM session_input WHERE session_id = ? UNION ALL"
    " SELECT 'taken', input_id FROM session_message WHERE session_id = ? AND input_id IS NOT NULL"
)
DUE_PENDING = (
    "SELECT id FROM session_input WHERE session_id = ? AND (due_at IS NULL OR due_at <= ?)"
)
CLAIM = "SELECT COUNT(*) FROM session_execution WHERE session_id = ?"
SESSION_ROW = "SELECT COUNT(*) FROM session WHERE id = ?"


class TrioThread:
    """A trio run on a worker thread holding the open runtimes (a worker and a producer);
    `call` runs a coroutine function in it and returns its result (or raises its error)."""

    def __init__(self, store: Any, drain: Any) -> None:
        self.clock = trio.testing.MockClock()  # no autojump: only `advance` moves time
        self._store = store
        self._drain = drain
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.token: trio.lowlevel.TrioToken | None = None
        self.runtime: trio_sessions.Runtime | None = None
        self.producer: trio_sessions.Runtime | None = None
        self.nursery: trio.Nursery | None = None
        self._stop: trio.Event | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        try:
            trio.run(self._main, clock=self.clock)
        except BaseException as exc:  # reported by `call` / `close`
            self._error = exc
            self._ready.set()

    def now(self) -> float:
        return testing.DEFAULT_EPOCH + self.clock.current_time()

    async def _main(self) -> None:
        self._stop = trio.Event()
        self.token = trio.lowlevel.current_trio_token()
        async with (
            trio_sessions.open_runtime(self._store, None, clock=self.now) as producer,
            trio_sessions.open_runtime(self._store, self._drain, clock=self.now, lease=LEASE) as rt,
            trio.open_nursery() as nursery,
        ):
            self.runtime = rt
            self.producer = producer
            self.nursery = nursery
            self._ready.set()
            await self._stop.wait()
            nursery.cancel_scope.cancel()

    def call(self, fn: Callable[[], Awaitable[T]]) -> T:
        assert self.token is not None
        return trio.from_thread.run(fn, trio_token=self.token)

    def close(self) -> None:
        if self.token is not None and self.thread.is_alive():

            async def stop() -> None:
                assert self._stop is not None
                self._stop.set()

            trio.from_thread.run(stop, trio_token=self.token)
            # Closing hands held drains' claims back: let virtual time run for that.
            self.clock.autojump_threshold = 0
        self.thread.join(60)
        if self._error is not None:
            raise self._error


class TrioRaw:
    """Reads (as an operator's, on a connection of their own) run on the runtime's trio
    thread, blocking it: no task of the runtime (a drain woken by a change signal that
    arrived after the step settled) moves between a read and the model's bookkeeping."""

    def __init__(self, raw: Reader, thread: TrioThread) -> None:
        self._raw = raw
        self._thread = thread

    def rows(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        if threading.current_thread() is self._thread.thread:
            return self._raw.rows(sql, params)

        async def read() -> list[tuple[Any, ...]]:
            return self._raw.rows(sql, params)

        return self._thread.call(read)

    def one(self, sql: str, params: tuple[Any, ...] = ()) -> Any:
        rows = self.rows(sql, params)
        return rows[0] if rows else None


class Follower:
    """A client of `runtime.stream()`: applies each event to its copy of the transcript and
    keeps the last cursor, to reconnect from it."""

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
        self.cursor: str | None = None
        self.copy: dict[int, tuple[str, Any]] = {}
        self.scope: trio.CancelScope | None = None
        self.events = 0

    async def follow(self, rt: trio_sessions.Runtime, task_status: Any) -> None:
        with trio.CancelScope() as self.scope:
            async with rt.stream(self.session_id, cursor=self.cursor) as events:
                task_status.started()
                async for event in events:
                    self.apply(event)

    def apply(self, event: StreamEvent) -> None:
        self.events += 1
        self.cursor = event.cursor
        if event.kind == "truncate":
            self.copy = {s: m for s, m in self.copy.items() if s <= event.seq}
        elif event.kind == "message":
            self.copy[event.seq] = (event.role, copy.deepcopy(event.data))
        else:
            role, data = self.copy[event.seq]
            assert isinstance(data, AssistantData), event
            parts = list(data.parts)  # a tuple in what the store returns
            if event.kind == "append":
                if parts and isinstance(parts[-1], TextPart):
                    parts[-1] = TextPart(parts[-1].text + event.data)
                else:
                    parts.append(TextPart(event.data))
                data = AssistantData(tuple(parts), data.finished, data.error)
            elif event.kind == "part":
                assert isinstance(event.data, ToolPart)
                same = [
                    i
                    for i, p in enumerate(parts)
                    if getattr(p, "call_id", None) == event.data.call_id
                ]
                if same:
                    parts[same[0]] = event.data
                else:
                    parts.append(event.data)
                data = AssistantData(tuple(parts), data.finished, data.error)
            else:
                data = AssistantData(tuple(parts), True, event.data["error"])
            self.copy[event.seq] = (role, data)


class ControlMachine(RuleBasedStateMachine):
    """A worker and a producer, sessions "a" and "b" (and their forks), against a model of
    §5.1."""

    # Set by each test: a fresh store, where it lives, and what gives it back afterwards.
    make: Callable[[], Opened]

    def __init__(self) -> None:
        super().__init__()
        store, location, self._done = type(self).make()
        self.n = 0
        self.violations: list[str] = []
        # Model.
        self.paused: set[str] = set()
        self.held: set[str] = set()  # drains of these sessions wait on their gate
        self.gates: dict[str, trio.Event] = {}
        self.accepted: dict[str, tuple[str, dict[str, Any], float]] = {}  # id -> (s, payload, due)
        self.given: list[str] = []  # every input id a drain was given, in order
        self.forks: dict[str, list[tuple[int, str, Any]]] = {}  # fork -> its copied transcript
        self.outcomes: list[Outcome] = []  # of the `run` calls
        self.remote_until = 0.0
        self.remote_written = False  # since the streams were last compared
        self.thread = TrioThread(store, self.drain)
        self.reader = Reader(location)
        self.raw = TrioRaw(self.reader, self.thread)
        self.followers = {s: Follower(s) for s in SESSIONS}
        for follower in self.followers.values():
            self._start_following(follower)

    # -- the application's drain ----------------------------------------------------------------

    async def drain(self, ctx: DrainContext) -> None:
        session_id = ctx.session_id
        if session_id in self.paused:
            self.violations.append(f"a drain started on paused session {session_id!r}")
        if session_id in self.forks:
            self.violations.append(f"a drain started on fork {session_id!r}")
        now = self.thread.now()
        inputs = await ctx.take_inputs()
        for taken in inputs:
            self.given.append(taken.id)
            _, _, due = self.accepted.get(taken.id, (None, None, 0.0))
            if due > now + 1e-6:
                self.violations.append(f"input {taken.id} taken at {now}, due at {due}")
            if taken.id not in self.accepted:
                self.violations.append(f"input {taken.id} given but never accepted (or gone)")
        reply = await ctx.begin_assistant()
        await reply.append_text("got " + ",".join(i.id for i in inputs))
        if session_id in self.held:
            await self.gates.setdefault(session_id, trio.Event()).wait()
            await reply.append_text(" after the gate")
        await reply.finish()

    # -- plumbing ----------------------------------------------------------------------------

    def _start_following(self, follower: Follower) -> None:
        async def start() -> None:
            assert self.thread.nursery is not None and self.thread.runtime is not None
            await self.thread.nursery.start(follower.follow, self.thread.runtime)

        self.thread.call(start)

    def act(self, fn: Callable[[trio_sessions.Runtime], Awaitable[T]], via: str = WORKER) -> T:
        """Run one call on the worker (or the producer: another process of the chat
        product), then let everything it started settle."""
        if via == PRODUCER:
            # The worker learns of it through the store (`REMOTE_LATENCY`).
            self.remote_until = self.thread.now() + REMOTE_LATENCY
            self.remote_written = True

        async def step() -> T:
            rt = self.thread.runtime if via == WORKER else self.thread.producer
            assert rt is not None
            result = await fn(rt)
            await trio.testing.wait_all_tasks_blocked()
            return result

        return self.thread.call(step)

    def settle(self) -> None:
        async def noop(_: Any) -> None:
            return None

        self.act(noop)

    def teardown(self) -> None:
        try:
            for gate in list(self.gates.values()):
                self.thread.call(_set(gate))
            self.thread.close()
        finally:
            self.reader.close()
            self._done()

    def new_id(self) -> str:
        self.n += 1
        return f"i{self.n}"

    # -- rules -------------------------------------------------------------------------------

    @rule(
        session_id=st.sampled_from(SESSIONS),
        on_busy=st.sampled_from(("queue", "queue", "interrupt", "reject")),
        delay=st.sampled_from((None, None, None, 1.0, 2.5)),
        via=VIA,
    )
    def submit(self, session_id: str, on_busy: str, delay: float | None, via: str) -> None:
        if on_busy == "interrupt":
            delay = None
        input_id = self.new_id()
        payload = {"text": input_id}
        busy = False

        async def submit(rt: trio_sessions.Runtime) -> str:
            nonlocal busy  # read right before the submit, with no checkpoint between
            now_ms = int(self.thread.now() * 1000)
            busy = bool(self.raw.one(CLAIM, (session_id,))[0]) or bool(
                self.raw.rows(DUE_PENDING, (session_id, now_ms))
            )
            return await rt.submit(
                session_id, payload, input_id=input_id, on_busy=on_busy, delay=delay
            )

        # Accepted before the call returns: its drain may start (and take it) within it.
        self.accepted[input_id] = (session_id, payload, self.thread.now() + (delay or 0.0))
        try:
            got = self.act(submit, via)
        except SessionBusy:
            del self.accepted[input_id]
            assert on_busy == "reject" and busy, "SessionBusy for a session that is not busy"
            return
        assert got == input_id
        assert not (on_busy == "reject" and busy), "reject stored an input on a busy session"

    @precondition(lambda self: self.accepted)
    @rule(data=st.data())
    def resubmit(self, data: st.DataObject) -> None:
        """An idempotent retry (a client whose reply was lost): same id, same payload."""
        input_id = data.draw(st.sampled_from(sorted(self.accepted)))
        session_id, payload, _ = self.accepted[input_id]
        on_busy = data.draw(st.sampled_from(("queue", "reject", "interrupt")))
        got = self.act(
            lambda rt: rt.submit(session_id, payload, input_id=input_id, on_busy=on_busy),
            data.draw(VIA),
        )
        assert got == input_id

    @precondition(lambda self: self.accepted)
    @rule(data=st.data())
    def cancel_input(self, data: st.DataObject) -> None:
        input_id = data.draw(st.sampled_from(sorted(self.accepted)))
        was_pending = False

        async def cancel(rt: trio_sessions.Runtime) -> bool:
            nonlocal was_pending
            pending = self.raw.rows("SELECT id FROM session_input")
            was_pending = (input_id,) in pending
            return await rt.cancel_input(input_id)

        cancelled = self.act(cancel, data.draw(VIA))
        assert cancelled == was_pending
        if cancelled:
            del self.accepted[input_id]

    @rule(session_id=st.sampled_from(SESSIONS), via=VIA)
    def pause(self, session_id: str, via: str) -> None:
        self.act(lambda rt: rt.pause(session_id), via)
        self.paused.add(session_id)

    @rule(session_id=st.sampled_from(SESSIONS), via=VIA)
    def resume(self, session_id: str, via: str) -> None:
        self.paused.discard(session_id)
        self.act(lambda rt: rt.resume(session_id), via)

    @rule(session_id=st.sampled_from(SESSIONS), via=VIA)
    def interrupt(self, session_id: str, via: str) -> None:
        self.act(lambda rt: rt.interrupt(session_id), via)

    @rule(session_id=st.sampled_from(SESSIONS))
    def hold(self, session_id: str) -> None:
        """The session's next drain calls wait (a model streaming a long answer)."""
        if session_id not in self.held:
            self.held.add(session_id)
            self.gates[session_id] = trio.Event()

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        session_id = data.draw(st.sampled_from(sorted(self.held)))
        self.held.discard(session_id)
        gate = self.gates.pop(session_id)
        self.act(lambda rt: _set(gate)())

    @rule(session_id=st.sampled_from(SESSIONS), via=VIA)
    def delete(self, session_id: str, via: str) -> None:
        self.act(lambda rt: rt.delete_session(session_id), via)
        for input_id, (s, _, _) in list(self.accepted.items()):
            if s == session_id:
                del self.accepted[input_id]
        self.paused.discard(session_id)
        for sql in (PENDING, USER_INPUTS, CLAIM, SESSION_ROW):
            rows = self.raw.rows(sql, (session_id,))
            assert rows in ([], [(0,)]), f"{sql}: {rows} after delete_session"

    @rule(
        session_id=st.sampled_from(SESSIONS),
        through=st.sampled_from((None, None, 1, 2, 3)),
        via=VIA,
    )
    def fork(self, session_id: str, through: int | None, via: str) -> None:
        new = f"{session_id}-fork{self.n}"
        self.n += 1
        before = self.raw.one(SESSION_ROW, (session_id,))[0]
        try:
            self.act(lambda rt: rt.fork(session_id, new, through_seq=through), via)
        except ValueError:
            assert not before, "fork refused for a session that exists"
            return
        source = [
            m
            for m in self.act(lambda rt: rt.transcript(session_id))
            if through is None or m.seq <= through
        ]
        copied = self.act(lambda rt: rt.transcript(new))
        assert [(m.seq, m.role) for m in copied] == [(m.seq, m.role) for m in source]
        for original, forked in zip(source, copied, strict=True):
            if isinstance(original.data, AssistantData) and not original.data.finished:
                assert isinstance(forked.data, AssistantData)
                assert (forked.data.finished, forked.data.error) == (True, "interrupted")
                assert forked.data.parts == original.data.parts
            else:
                assert forked.data == original.data
        self.forks[new] = [(m.seq, m.role, m.data) for m in copied]

    @rule(session_id=st.sampled_from(SESSIONS), after=st.sampled_from((0, 1, 2, 3)), via=VIA)
    def truncate(self, session_id: str, after: int, via: str) -> None:
        """Edit and regenerate: the messages past `after` go, unless a claim is held."""
        doomed: list[tuple[int, str | None]] = []
        held = False

        async def truncate(rt: trio_sessions.Runtime) -> int:
            nonlocal doomed, held  # read right before it, with no checkpoint between
            held = bool(self.raw.one(CLAIM, (session_id,))[0])
            doomed = [
                (int(seq), input_id)
                for seq, input_id in self.raw.rows(
                    "SELECT seq, input_id FROM session_message WHERE session_id = ? AND seq > ?",
                    (session_id, after),
                )
            ]
            return await rt.truncate(session_id, after_seq=after)

        try:
            deleted = self.act(truncate, via)
        except SessionBusy:
            assert held, "truncate refused as busy though no claim was held"
            return
        assert not held, "truncate went ahead while a claim was held"
        assert deleted == len(doomed)
        # A taken input's user message truncated: that input is gone with it.
        for _, input_id in doomed:
            if input_id is not None:
                self.accepted.pop(input_id, None)
        left = self.raw.rows(
            "SELECT COUNT(*) FROM session_message WHERE session_id = ? AND seq > ?",
            (session_id, after),
        )
        assert left == [(0,)], f"{left} messages past {after} after truncate"

    @rule(via=VIA)
    def purge(self, via: str) -> None:
        """Every idle session goes (no claim, no pending input, nothing written since):
        with `idle_for=0`, any session idle now - a fork too."""
        existed = {s for s in (*SESSIONS, *self.forks) if self.raw.one(SESSION_ROW, (s,))[0]}
        busy: dict[str, tuple[Any, ...]] = {}

        async def purge(rt: trio_sessions.Runtime) -> int:
            # Read right before it, with no checkpoint between (the clock moves only by
            # `advance`): what made each session not idle - a claim, pending inputs, a wake.
            for s in existed:
                claim = self.raw.one(CLAIM, (s,))[0]
                pending = self.raw.rows(PENDING, (s,))
                woken = self.raw.one("SELECT time_woken FROM session WHERE id = ?", (s,))[0]
                busy[s] = (claim, pending, woken)
            return await rt.purge(idle_for=0)

        purged = self.act(purge, via)
        gone = {s for s in existed if not self.raw.one(SESSION_ROW, (s,))[0]}
        assert purged == len(gone), (purged, gone)
        for session_id in existed:
            claim, pending, woken = busy[session_id]
            if session_id in gone:
                assert claim == 0 and pending == [], f"{session_id} purged: {busy[session_id]}"
            else:
                assert (claim, pending, woken) != (0, [], None), f"idle {session_id} kept"
        for session_id in gone:
            for input_id, (s, _, _) in list(self.accepted.items()):
                if s == session_id:  # none pending (above): taken, its user message went
                    del self.accepted[input_id]
            self.paused.discard(session_id)
            self.forks.pop(session_id, None)

    @rule(session_id=st.sampled_from(SESSIONS))
    def run(self, session_id: str) -> None:
        async def start(rt: trio_sessions.Runtime) -> None:
            assert self.thread.nursery is not None

            async def run() -> None:
                self.outcomes.append(await rt.run(session_id))

            self.thread.nursery.start_soon(run)

        self.act(start)

    @rule(session_id=st.sampled_from(SESSIONS))
    def reconnect(self, session_id: str) -> None:
        """A browser reloads: the stream is dropped and opened again at its cursor."""
        follower = self.followers[session_id]
        assert follower.scope is not None
        self.thread.call(_cancel(follower.scope))
        self.settle()
        self._start_following(follower)
        self.settle()

    @rule(seconds=st.sampled_from((0.5, 1.0, 3.0)))
    def advance(self, seconds: float) -> None:
        """Virtual time passes, in half-second steps (heartbeats keep their pace)."""
        for _ in range(int(seconds * 2)):
            self.thread.clock.jump(0.5)
            self.settle()

    # -- what must hold after every step -----------------------------------------------------

    @invariant()
    def no_violation_seen_by_the_drain(self) -> None:
        assert self.violations == []

    @invariant()
    def no_run_failed(self) -> None:
        """The drain never raises: a `failed` outcome is the library's own error."""
        assert [o for o in self.outcomes if o.kind == "failed"] == []

    @invariant()
    def no_input_lost_or_duplicated(self) -> None:
        assert len(self.given) == len(set(self.given)), f"an input given twice: {self.given}"
        for session_id in SESSIONS:
            rows = self.raw.rows(INPUTS, (session_id, session_id))
            pending = [i for kind, i in rows if kind == "pending"]
            taken = [i for kind, i in rows if kind == "taken"]
            assert len(taken) == len(set(taken))
            assert not set(pending) & set(taken)
            mine = {i for i, (s, _, _) in self.accepted.items() if s == session_id}
            assert set(pending) | set(taken) == mine, (session_id, pending, taken, mine)
            assert not (set(taken) - set(self.given)), "a user message no drain was given"

    @invariant()
    def nothing_is_stranded(self) -> None:
        """A session neither paused nor held has taken every due input (§6.16, §6.24)."""
        if self.thread.now() < self.remote_until:
            return  # the worker has not looked at the producer's write yet
        now_ms = int(self.thread.now() * 1000)
        for session_id in SESSIONS:
            if session_id in self.paused or session_id in self.held:
                continue
            due = self.raw.rows(DUE_PENDING, (session_id, now_ms))
            assert due == [], f"{session_id}: due inputs {due} left untaken"

    @invariant()
    def forks_are_independent(self) -> None:
        for fork, copied in self.forks.items():
            now = self.act(functools.partial(_transcript, session_id=fork))
            assert [(m.seq, m.role, m.data) for m in now] == copied, fork

    @invariant()
    def streams_reproduce_the_transcript(self) -> None:
        if self.remote_written:
            # The inline SQLite store signals no other runtime's write to an open stream:
            # reconnecting from its cursor reads them (as a browser's reload does).
            self.remote_written = False
            for session_id in SESSIONS:
                self.reconnect(session_id)
        for session_id, follower in self.followers.items():
            messages = self.act(functools.partial(_transcript, session_id=session_id))
            want = {m.seq: (m.role, m.data) for m in messages}
            assert follower.copy == want, session_id


async def _transcript(rt: trio_sessions.Runtime, session_id: str) -> list[Message]:
    return await rt.transcript(session_id)


def _set(event: trio.Event) -> Callable[[], Awaitable[None]]:
    async def set_it() -> None:
        event.set()

    return set_it


def _cancel(scope: trio.CancelScope) -> Callable[[], Awaitable[None]]:
    async def cancel() -> None:
        scope.cancel()

    return cancel


def _run(machine: type[ControlMachine], examples: int, steps: int) -> None:
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=examples,
            stateful_step_count=steps,
            deadline=None,
            database=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        ),
    )


def test_conversation_control_model_on_sqlite(tmp_path: Any) -> None:
    """Every control used together keeps the model's promises on SQLite (inline store)."""
    counter = iter(range(1_000_000))

    class OnSqlite(ControlMachine):
        @staticmethod
        def make() -> Opened:
            path = tmp_path / f"model-{next(counter)}.db"
            return testing.inline_store(path), path, lambda: None

    _run(OnSqlite, examples=70, steps=50)


def test_conversation_control_model_on_postgres(migrated_schemas: Any, pg_url: str) -> None:
    """The same model on PostgreSQL (inline store), with fewer examples."""
    from trio_sessions._postgres import PostgresStore

    class OnPostgres(ControlMachine):
        @staticmethod
        def make() -> Opened:
            schema = migrated_schemas.take()
            # No listener: a notification arriving on its real socket could wake the worker
            # between an invariant's reads - the model steps on virtual time alone, and
            # the worker finds a producer's write by its fallback poll, as on SQLite.
            store = PostgresStore(pg_url, schema=schema, inline=True, listen=False)
            return store, PgLocation(pg_url, schema), lambda: migrated_schemas.give_back(schema)

    _run(OnPostgres, examples=15, steps=30)
