"""The PostgreSQL soak's fault injection: host faults, connection kills, the server restart.

`Chaos` adds to `SoakBase` the faults `postgres` describes: one host fault at a time on a
random worker (SIGKILL, SIGSTOP, a partition at its proxy, a rolling restart, and now and
then a busy token kill - of a worker that holds its token, while one serves),
`pg_terminate_backend` of a worker connection (any, a liveness token's, or one at its
COMMIT) or a reset at a proxy, and one restart of a server the soak started itself.

Invariants: a fault is counted in `Result` only when it happened (a terminate that found no
backend counts nothing); a paused host is always resumed and a partition always healed
(`finally`), and `holding_locks` marks the windows in which orphans are not judged; a
COMMIT a proxy trapped is always killed and its link ended, never left frozen; a SIGKILLed
worker is recorded (`killed`, `kill_times`) and its slot restarted.
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import trio

from .._errors import StoreError
from . import common
from .pgstate import SoakBase
from .proxy import FaultProxy, Link

STARTUP = 2.0  # seconds of work before the first host fault (the workers serve by then)
# How long a busy token kill waits while hosts serve but none holds its liveness token: a
# live owner takes its token again within milliseconds (after the server restart, once it
# reconnected); a copy that ignores a lost token (`ignore-lost-token`) never does, and the
# host faults must not stop for it.
TOKEN_PATIENCE = 5.0
# The backends that hold a liveness token of the soak's schema (`_liveness`: one advisory
# lock per owner, keyed by the schema); one parameter, the schema.
_TOKEN_HOLDERS = (
    "pid IN (SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 2"
    " AND granted AND classid = (hashtext('trio_sessions.owner:' || %s)::bigint"
    " & 4294967295)::oid)"
)


class Chaos(SoakBase):
    """The faults: host faults, connection kills and the server restart."""

    # -- host faults ------------------------------------------------------------------------------

    def hold_time(self) -> float:
        return self.chaos_rng.uniform(1.1, 1.5) * float(self.args.lease)

    async def held_in_handoff(self, worker: common.Worker, flag: str) -> bool:
        """Ask `worker`'s hook to hold the next claim handoff; whether it did within 2 s."""
        request = self.control / f"{flag}.{worker.name}"
        marker = self.control / f"held.{worker.name}"
        request.touch()
        try:
            with trio.move_on_after(2.0):
                # Another process writes the marker: polled, there is no event to await.
                while not marker.exists():  # noqa: ASYNC110
                    await trio.sleep(0.005)
                return True
            return False
        finally:
            request.unlink(missing_ok=True)

    async def kill(self, worker: common.Worker, nursery: trio.Nursery) -> None:
        in_handoff = False
        if self.chaos_rng.random() < self.args.handoff_ratio:
            in_handoff = await self.held_in_handoff(worker, "kill")
        worker.process.kill()
        worker.process.wait()  # a SIGKILLed process is reaped at once
        (self.control / f"held.{worker.name}").unlink(missing_ok=True)
        self.killed.add(worker.name)
        self.kill_times[worker.name] = time.monotonic()
        del self.workers[worker.slot]
        self.result.kills += 1
        self.result.handoff_kills += in_handoff
        delay = self.chaos_rng.uniform(0.0, 0.5)  # drawn here: the host faults' turn

        async def restart() -> None:
            await trio.sleep(delay)
            self.spawn(worker.slot)

        nursery.start_soon(restart)

    async def pause(self, worker: common.Worker) -> None:
        in_handoff = False
        if self.chaos_rng.random() < self.args.handoff_ratio:
            in_handoff = await self.held_in_handoff(worker, "stop")
        stopped = time.monotonic()
        worker.process.send_signal(signal.SIGSTOP)
        try:
            with self.holding_locks():
                await trio.sleep(self.hold_time())
        finally:
            worker.process.send_signal(signal.SIGCONT)
            self.cut_off.setdefault(worker.name, []).append((stopped, time.monotonic()))
            (self.control / f"held.{worker.name}").unlink(missing_ok=True)
        self.result.pauses += 1
        self.result.handoff_pauses += in_handoff

    async def partition(self, worker: common.Worker) -> None:
        proxy = self.proxies[worker.slot]
        in_tx = False
        if self.chaos_rng.random() < 0.7:
            # BEGIN, then a drain's write reads its execution's session, locks it, reads the
            # clock and the fence: a cut after the 3rd to 6th message lands around the fence.
            tripped = proxy.arm_partition(self.chaos_rng.randint(3, 6))
            with trio.move_on_after(2.0):
                await tripped.wait()
            in_tx = tripped.is_set()
        cut = time.monotonic()  # the armed cut tripped just now, or the blackhole's starts
        proxy.blackhole()
        try:
            with self.holding_locks():
                await trio.sleep(self.hold_time())
        finally:
            proxy.heal()
            self.cut_off.setdefault(worker.name, []).append((cut, time.monotonic()))
        self.result.partitions += 1
        self.result.partitions_in_tx += in_tx

    @contextlib.contextmanager
    def holding_locks(self) -> Iterator[None]:
        """A paused or partitioned host keeps the locks of its open transaction (its
        sessions cannot be recovered meanwhile): orphans are judged only after it let go."""
        self.hosts_held += 1
        try:
            yield
        finally:
            self.hosts_held -= 1
            self.held_until = time.monotonic()

    async def token_holders(self) -> set[str]:
        """The names of the workers whose liveness token connection holds its lock now."""
        try:
            rows = await self.admin.rows(
                "SELECT DISTINCT application_name FROM pg_stat_activity"
                " WHERE application_name LIKE %s AND " + _TOKEN_HOLDERS,
                f"{self.schema}-%",
                self.schema,
            )
        except (psycopg.Error, StoreError):
            return set()
        prefix = f"{self.schema}-"
        return {str(name).removeprefix(prefix) for (name,) in rows}

    async def serving_worker(self, pick: float, *, holding_token: bool) -> common.Worker | None:
        """The worker `pick` draws among those that serve (with `holding_token`: and hold
        their liveness token - one between losing and taking it again, or for good in a
        copy that ignores a lost token, has none to lose), waiting for one: a loaded host
        boots a worker for seconds. (Made another kind meanwhile, a busy token kill went
        missing: a busy-ratio-1 run made plain kills of booting workers instead, and no
        busy token kill. The chaos's end cancels the wait.) None once hosts served for
        `TOKEN_PATIENCE` with no token among them: waiting on, the host faults stopped for
        good when every host of a copy that ignores a lost token had lost its own."""
        tokenless_since: float | None = None
        while True:
            serving = [w for w in self.workers.values() if self.retiring.serving(w)]
            if serving and holding_token:
                holders = await self.token_holders()
                serving = [worker for worker in serving if worker.name in holders]
                if serving:
                    tokenless_since = None
                elif tokenless_since is None:
                    tokenless_since = trio.current_time()
                elif trio.current_time() - tokenless_since >= TOKEN_PATIENCE:
                    return None
            elif not serving:
                tokenless_since = None  # none serves: a booting host will hold its token
            if serving:
                return serving[int(pick * len(serving))]
            await trio.sleep(0.05)

    async def busy_token_kill(self, worker: common.Worker) -> None:
        """Kill `worker`'s liveness token connection while one of its drains is in a busy
        step (`common`): a live owner losing its token with a drain that cannot stop at
        once. The others must wait out the grace; the step is over before this returns."""
        request = common.BusyRequest.ask(self.control, worker.name)
        # Another process writes the marker: polled, there is no event to await.
        while (began := request.began()) is None:  # noqa: ASYNC110
            await trio.sleep(0.002)
        if not began:
            return
        killed = await self.terminate(
            "application_name = %s AND " + _TOKEN_HOLDERS,
            f"{self.schema}-{worker.name}",
            self.schema,
        )
        self.result.busy_token_kills += killed
        # No other host fault (a pause would hold the blocking call past the grace) until
        # the step's blocking call is over.
        await trio.sleep(common.BUSY_BLOCK + 0.2)

    def rolling_restart(self, worker: common.Worker) -> None:
        """SIGTERM `worker` and start its successor in the same slot at once."""
        del self.workers[worker.slot]
        self.retiring.retire(worker)
        self.result.rolling_restarts += 1
        self.spawn(worker.slot)

    async def host_faults(self, nursery: trio.Nursery) -> None:
        """One host fault at a time, kinds in shuffled rounds, on a random live worker. A
        share of them (`--busy-ratio`) are busy token kills, in addition: the round's next
        kind waits for the next fault (so every kind still runs as often per round, and a
        ratio of 1 makes every fault a busy token kill)."""
        await trio.sleep(STARTUP)  # the producer first
        while True:
            kinds = ["kill", "pause", "partition", "restart"]
            self.chaos_rng.shuffle(kinds)
            while kinds:
                await trio.sleep(self.chaos_rng.uniform(*self.args.kill_gap))
                if not self.workers:
                    continue
                # Two draws each turn, whoever serves: a seed gives the same kinds in order.
                pick, busy_draw = self.chaos_rng.random(), self.chaos_rng.random()
                kind = "busy token kill" if busy_draw < self.args.busy_ratio else kinds.pop()
                drawn_at = time.monotonic()
                if kind in ("busy token kill", "restart"):
                    # Only a host that serves has drains to ask into a busy step, and claims
                    # to hand back (SIGTERM would just end a worker still starting).
                    holding_token = kind == "busy token kill"
                    found = await self.serving_worker(pick, holding_token=holding_token)
                    if found is None:
                        # Nobody has a token to lose: the turn makes nothing (it is in
                        # addition to the round's kinds, which go on).
                        print(f"soak: a {kind} found no serving host holding its token")
                        continue
                    worker = found
                else:
                    everyone = list(self.workers.values())
                    worker = everyone[int(pick * len(everyone))]
                if time.monotonic() - drawn_at >= 0.5:
                    waited = time.monotonic() - drawn_at
                    print(f"soak: a {kind} waited {waited:.1f} s for a serving worker")
                busy = kind == "busy token kill"
                if not busy:
                    self.result.host_turns += 1
                print(f"soak: {kind} {worker.name} at {self.elapsed():.1f} s")
                if busy:
                    await self.busy_token_kill(worker)
                elif kind == "restart":
                    self.rolling_restart(worker)
                elif kind == "kill":
                    await self.kill(worker, nursery)
                elif kind == "pause":
                    await self.pause(worker)
                else:
                    await self.partition(worker)

    # -- connection kills and the restart ---------------------------------------------------------

    async def terminate(self, condition: str, *params: Any) -> bool:
        try:
            rows = await self.admin.rows(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                f" WHERE application_name LIKE %s AND {condition} ORDER BY random() LIMIT 1",
                f"{self.schema}-%",
                *params,
            )
        except (psycopg.Error, StoreError):
            return False
        return bool(rows and rows[0][0])

    async def conn_kills(self) -> None:
        """`pg_terminate_backend` of a random worker connection, or of one at its COMMIT."""
        while True:
            await trio.sleep(self.conn_rng.uniform(*self.args.conn_kill_gap))
            if self.server_down:
                continue
            proxy = self.conn_rng.choice(self.proxies)
            kind = self.conn_rng.random()
            if kind < 0.3:
                self.result.conn_kills += await self.terminate("true")
            elif kind < 0.5:
                # A liveness token's connection (a live owner loses its token: it must stop
                # its drains before the others' grace runs out, DESIGN §4).
                killed = await self.terminate(_TOKEN_HOLDERS, self.schema)
                self.result.conn_kills += killed
                self.result.token_kills += killed
            elif kind < 0.8:
                proxy.arm_commit_trap(forward=self.conn_rng.random() < 0.5)
                with trio.move_on_after(2.0):
                    await self.kill_at_commit(await proxy.trapped.receive())
                proxy.disarm()
                await self.release_trapped(proxy)
            else:
                proxy.reset()
                self.result.resets += 1

    async def release_trapped(self, proxy: FaultProxy) -> None:
        """A COMMIT trapped after the chaos stopped waiting: kill it all the same (a frozen
        link would hang its client forever)."""
        while True:
            try:
                link = proxy.trapped.receive_nowait()
            except trio.WouldBlock:
                return
            await self.kill_at_commit(link)

    async def kill_at_commit(self, link: Link) -> None:
        if link.scope.cancel_called:
            return  # the proxy gave up waiting and ended it: its port may be reused
        try:
            killed = await self.terminate("client_port = %s", link.upstream_port)
        finally:
            link.scope.cancel()  # the client sees its connection end, never the answer
        self.result.conn_kills += killed
        self.result.commit_kills += killed

    async def restart_once(self) -> None:
        if self.restart_server is None:
            return
        await trio.sleep(self.args.duration / 2)
        self.server_down = True
        print(f"soak: restarting the server at {time.monotonic() - self.started:.1f} s")
        try:
            await trio.to_thread.run_sync(self.restart_server)
        finally:
            self.server_down = False
            print(f"soak: server back at {time.monotonic() - self.started:.1f} s")
            # Nobody could recover while the server was down: give recovery its window.
            self.sampling_paused_until = time.monotonic() + self.orphan_grace()
        self.result.restarts += 1
