"""The soaks' instruments: the PostgreSQL audit and the controls' audit (both soaks) find
what they claim to find, the fault proxy does what its modes say, and every broken copy
still applies to the current code."""

from __future__ import annotations

import contextlib
import functools
import os
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import trio
import trio.testing

from trio_sessions import _store, soak
from trio_sessions._soak import audit, broken, common, postgres
from trio_sessions._soak.proxy import FaultProxy
from trio_sessions._sqlite import open_engine as sqlite_engine


def claim(session: str, n: int, txid: str, old: str | None, new: str | None) -> audit.Write:
    change = "insert" if old is None else "delete" if new is None else "update"
    kind = f"session_execution {change}"
    return audit.Write(session, n, txid, kind, old, new)


def message(session: str, n: int, txid: str, execution: str) -> audit.Write:
    return audit.Write(session, n, txid, "session_message update", execution)


def test_zombie_write_after_takeover_in_commit_order() -> None:
    """A write of execution E ordered after the takeover that replaced E is a zombie write;
    the takeover's own cleanup of E's messages, and E's writes before it, are not."""
    writes = [
        claim("s", 1, "t1", None, "E"),
        message("s", 2, "t2", "E"),
        message("s", 3, "t3", "E"),  # the takeover closes E's open message...
        claim("s", 4, "t3", "E", "F"),  # ...and replaces the claim, in one transaction
        message("s", 5, "t4", "F"),
        message("s", 6, "t5", "E"),  # E's write landed after: a zombie
    ]
    assert audit.zombie_writes(writes) == [writes[5]]
    assert audit.zombie_writes(writes[:5]) == []


def test_zombie_write_after_delete_or_without_claim_and_revivals() -> None:
    """Writes after a claim was deleted, writes of an execution that never held a claim, and
    heartbeats that revived an expired lease all count."""
    writes = [
        claim("s", 1, "t1", None, "E"),
        claim("s", 2, "t2", "E", None),
        message("s", 3, "t3", "E"),
        message("r", 1, "t4", "X"),
        audit.Write("q", None, "t5", "revival", "Q"),
    ]
    assert audit.zombie_writes(writes) == [writes[4], writes[2], writes[3]]


def effect(kind: str, drain: str, execution: str, t: float, **fields: object) -> audit.Effect:
    return audit.Effect(kind, drain, drain.split(":")[0], "s", execution, t, **fields)  # type: ignore[arg-type]


def test_overlaps_compare_effect_spans_of_executions() -> None:
    """Executions of one session overlap when one acts inside the other's span; an exit
    record (not an effect) never extends a span."""
    clean = [
        effect("enter", "w1:1", "E", 1.0),
        effect("work", "w1:1", "E", 2.0),
        effect("exit", "w1:1", "E", 9.0, status="cancelled"),
        effect("enter", "w2:1", "F", 3.0),
    ]
    assert audit.overlaps(clean) == []
    late = [*clean, effect("work", "w1:1", "E", 3.5)]
    assert len(audit.overlaps(late)) == 1


def test_repeats_are_allowed_only_after_a_kill_a_cancel_or_a_failure() -> None:
    """A repeated input counts by how the first drain ended; after a clean exit it is a
    violation."""
    effects = [
        effect("take", "w1:1", "E", 1.0, numbers=(1, 2)),  # killed: no exit
        effect("take", "w2:1", "F", 2.0, numbers=(1,)),
        effect("exit", "w2:1", "F", 2.5, status="cancelled"),
        effect("take", "w2:2", "G", 3.0, numbers=(1, 2)),
        effect("exit", "w2:2", "G", 3.5, status="ok"),
        effect("take", "w2:3", "H", 4.0, numbers=(2,)),
    ]
    repeats = audit.repeats(effects, killed_workers={"w1"})
    assert repeats == audit.Repeats(after_kill=2, after_cancel=1, after_failure=0, unexpected=1)


def test_too_few_faults_asks_only_for_the_kinds_the_run_made_room_for() -> None:
    """The PostgreSQL soak fails a long run whose chaos injected too few of a fault kind -
    but not for the host faults that `--busy-ratio 1` documents as made room for by busy
    token kills alone ("1: nothing else"): such a run failed with "too few faults injected"
    although its audit was clean (seed 105)."""
    counts = {"kills": 0, "pauses": 0, "partitions": 0, "conn_kills": 167, "rolling_restarts": 0}
    assert postgres.too_few_faults(counts, host_turns=0) == {}
    assert postgres.too_few_faults({**counts, "conn_kills": 2}, host_turns=0) == {"conn_kills": 2}
    assert postgres.too_few_faults(counts, host_turns=40) == {
        "kills": 0,
        "pauses": 0,
        "partitions": 0,
        "rolling_restarts": 0,
    }


def test_too_few_faults_expects_the_host_faults_a_busy_ratio_leaves_room_for() -> None:
    """A busy ratio below 1 leaves the host faults only the turns it does not take: at 0.9
    a run of 110 s made kills=1 pauses=0 partitions=1 rolling_restarts=1 beside 96 busy
    token kills and failed for too few faults, its audit clean (seed 111); with room for
    twice the minimum each, they are asked for."""
    counts = {"kills": 1, "pauses": 0, "partitions": 1, "conn_kills": 276, "rolling_restarts": 1}
    assert postgres.too_few_faults(counts, host_turns=3) == {}
    assert postgres.too_few_faults(counts, host_turns=23) == {}
    assert postgres.too_few_faults(counts, host_turns=24) == {
        "kills": 1,
        "pauses": 0,
        "partitions": 1,
        "rolling_restarts": 1,
    }


def test_restart_ratio_is_refused_where_the_soak_would_ignore_it() -> None:
    """`--restart-ratio` sets the SQLite soak's share of rolling restarts; the PostgreSQL
    soak's host faults take their four kinds in turn and never read it, so a run asking
    for `--restart-ratio 1` there got a quarter of rolling restarts and no word of it."""
    assert soak.parse_args([]).restart_ratio == 0.25
    assert soak.parse_args(["--restart-ratio", "1"]).restart_ratio == 1.0
    with pytest.raises(SystemExit):
        soak.parse_args(["--backend", "postgres", "--restart-ratio", "1"])
    assert soak.parse_args(["--backend", "postgres"]).restart_ratio is None


@pytest.mark.parametrize("ratio", ["-0.1", "1.5"])
def test_control_ratio_is_a_share(ratio: str) -> None:
    """`--control-ratio` is a share of the submits: 0 (the default) to 1, else refused."""
    assert soak.parse_args([]).control_ratio == 0.0
    assert soak.parse_args(["--control-ratio", "1"]).control_ratio == 1.0
    with pytest.raises(SystemExit):
        soak.parse_args(["--control-ratio", ratio])


@pytest.mark.parametrize(
    "argv",
    [
        ["--workers", "0"],
        ["--sessions", "0"],
        ["--rate", "0"],
        ["--lease", "-1"],
        ["--lease", "0.002"],  # under the shortest lease a worker's open_runtime takes
        ["--recovery-interval", "0"],
        ["--work-max", "-0.1"],
        ["--handoff-ratio", "1.5"],
        ["--busy-ratio", "-0.5"],
        ["--restart-ratio", "2"],
        ["--interrupt-rate", "-1"],
        ["--broken", "no-such-defect"],
        ["--settle-timeout", "0"],
        ["--duration", "-1"],
        ["--kill-gap", "-1", "2"],
        ["--conn-kill-gap", "1", "-1"],
    ],
    ids=lambda argv: " ".join(argv),
)
def test_a_setting_the_soak_cannot_run_is_refused_before_it_starts(argv: list[str]) -> None:
    """A count, time, rate or share the soak cannot run with is a usage error (exit 2)
    before anything starts. Before, `--workers 0` or `--lease -1` ran the whole soak and
    ended in `soak: VIOLATION ... lost=60` - the library blamed for workers that never
    drained (no worker, or every worker refused by `open_runtime`) - `--sessions 0` and
    `--rate 0` in a traceback, a share past 0-1 or a negative rate was taken silently as
    its bound, and `--broken` with an unknown name was refused only after the stateful
    model's 50,000 steps. Found by an audit. A review found `--settle-timeout 0` still
    ending in `soak: VIOLATION ... lost=22` (no time to settle read as inputs lost) and a
    negative `--duration` or kill gap taken to a negative `trio.sleep` (`ValueError`)."""
    with pytest.raises(SystemExit) as refused:
        soak.parse_args(argv)
    assert refused.value.code == 2


def test_every_broken_copy_applies_exactly_once() -> None:
    """Each defect's text to break occurs once in the current package (so the broken-copy
    checks cannot silently test the real code)."""
    for defect in broken.DEFECTS.values():
        for edit in defect.edits:
            text = (broken.PACKAGE / edit.path).read_text()
            assert broken.patched(edit, text) != text


async def echo(stream: trio.SocketStream) -> None:
    async with stream:
        while data := await stream.receive_some(1024):
            await stream.send_all(data)


async def test_proxy_passes_holds_while_blackholed_and_resets() -> None:
    """Pass forwards bytes unchanged; a blackhole holds them (also a new connection) until
    healed, then delivers them in order; a reset aborts every connection."""
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(
            functools.partial(trio.serve_tcp, host="127.0.0.1"), echo, 0
        )
        listener = listeners[0]
        proxy = FaultProxy(listener.socket.getsockname()[1])
        port = await nursery.start(proxy.serve)
        client = await trio.open_tcp_stream("127.0.0.1", port)
        await client.send_all(b"ping")
        assert await client.receive_some(1024) == b"ping"

        proxy.blackhole()
        await client.send_all(b"held")
        await trio.testing.wait_all_tasks_blocked(0.05)
        with trio.move_on_after(0.05):
            await client.receive_some(1024)
            raise AssertionError("a blackholed proxy answered")
        proxy.heal()
        received = b""
        while len(received) < 4:
            received += await client.receive_some(1024)
        assert received == b"held"

        proxy.reset()
        with contextlib.suppress(trio.BrokenResourceError):  # RST: the abortive close
            assert await client.receive_some(1024) == b""
        await client.aclose()
        nursery.cancel_scope.cancel()


def test_a_worker_finds_the_package_it_was_started_from(tmp_path: Path) -> None:
    """A soak started from a checkout (the package importable only from its cwd) starts
    workers in their own folder: their path must lead to the same package - and a broken
    copy, when asked for, comes first."""
    import trio_sessions
    from trio_sessions._bench.tools import child_env

    root = str(Path(trio_sessions.__file__).resolve().parent.parent)
    assert child_env(None)["PYTHONPATH"].split(os.pathsep)[0] == root
    paths = child_env(str(tmp_path))["PYTHONPATH"].split(os.pathsep)
    assert paths[:2] == [str(tmp_path), root]


# ---------------------------------------------------------------------------------------------
# The conversation controls (`--control-ratio`), shared by both soaks


def control_clock(*readings: float) -> Callable[[], float]:
    return iter(readings).__next__


def test_no_control_ratio_draws_nothing_and_every_submit_is_queued() -> None:
    """`--control-ratio 0` leaves the producer's random draws as they were without it."""
    controls = common.Controls(0.0, control_clock())
    rng, untouched = random.Random(7), random.Random(7)
    assert [controls.draw(rng, n, "s").kind for n in range(50)] == ["queue"] * 50
    assert rng.random() == untouched.random()


def test_control_draws_make_every_kind_and_their_store_calls() -> None:
    """A ratio of 1 makes only controls, each kind, each with its store operation."""
    controls = common.Controls(1.0, control_clock())
    rng = random.Random(1)
    drawn = [controls.draw(rng, n, "s") for n in range(200)]
    assert {submit.kind for submit in drawn} == set(common.CONTROL_KINDS)
    calls = {submit.kind: submit.call() for submit in drawn}
    assert calls["interrupt"][0] is _store.submit_controlled
    assert calls["interrupt"][1][-1] == "interrupt"
    assert calls["reject"][0] is _store.submit_controlled
    assert calls["reject"][1][-1] == "reject"
    assert calls["scheduled"][0] is _store.submit_scheduled
    assert calls["pause"][0] is _store.submit
    cancels = [submit for submit in drawn if submit.kind == "cancel"]
    assert {submit.call()[0] for submit in cancels} == {_store.submit, _store.submit_scheduled}
    for submit in drawn:
        if submit.kind == "scheduled" or (submit.kind == "cancel" and submit.delay_ms):
            assert 200 <= submit.delay_ms <= 2000
        if submit.kind == "pause":
            assert 0.1 <= submit.pause_for <= 1.0


def test_control_audit_finds_early_takes_paused_starts_and_stored_rejects() -> None:
    """A scheduled input taken before its due time (beyond the clock tolerance), a drain
    started inside a pause window (past the slack), a rejected input found stored and a
    drain iteration of a claim an interrupting submit marked (past the slack) are each a
    violation; a take at the due time, a start within the slack or after the resume, a
    stored input that was accepted and the marked claim's iterations before are not."""
    controls = common.Controls(1.0, control_clock(100.0, 102.0, 200.0))
    # The lease clock before and after each scheduled submit: the first one waited 300 ms.
    clock_reads = iter([10_000, 10_300, 20_000, 20_000])

    def run_scheduled(op: Callable[..., object], *args: object) -> object:
        return next(clock_reads) if op is common.store_clock else args[2]

    for n in (1, 2):
        assert controls.make(common.Submit(n, "s", "scheduled", delay_ms=500), run_scheduled)
    assert controls.due == {1: (10_500, 10_800), 2: (20_500, 20_500)}
    pause = common.Submit(3, "p", "pause", pause_for=0.0)
    controls.pausing(pause)
    controls.paused(pause)  # paused at 100.0
    controls.stored(pause)
    controls.refused(common.Submit(4, "s", "reject"))
    controls.refused(common.Submit(5, "s", "reject"))
    assert controls.resumes_due() == ["p"]
    controls.resuming("p")  # resumed at 102.0
    controls.resumed("p")
    assert controls.resume_at == {}
    stored = iter([("in-6", "E"), ("in-7", None)])
    for n in (6, 7):  # the first marks E at 200.0, the second finds no running claim
        assert controls.make(common.Submit(n, "m", "interrupt"), lambda *_: next(stored))
    assert controls.marked == {"E": 200.0}
    judged = common.ControlAudit.judge(
        controls,
        stored_ids=["in-1", "in-2", "in-3", "in-4"],
        taken=[("in-1", 10_500 - common.DUE_TOLERANCE_MS), ("in-2", 20_500 - 6), ("in-3", 0)],
        starts=[
            ("p", "P", "w", 100.0 + common.START_SLACK - 0.01),  # within the slack
            ("p", "P", "w", 101.0),  # paused: a violation
            ("s", "S", "w", 101.0),  # another session
            ("p", "P", "w", 102.0),  # resumed
            ("m", "E", "w", 199.0),  # before the mark
            ("m", "E", "w", 200.0 + common.START_SLACK - 0.01),  # within the slack
            ("m", "E", "w", 201.0),  # marked: a violation
            ("m", "F", "w", 201.0),  # the successor
        ],
    )
    assert len(judged.early_takes) == 1 and "input 2 " in judged.early_takes[0]
    assert len(judged.paused_starts) == 1 and "at 101.000" in judged.paused_starts[0]
    assert judged.rejected_stored == [4]
    assert len(judged.marked_starts) == 1 and "at 201.000" in judged.marked_starts[0]
    assert judged.violations == 4
    assert judged.late_ms == [-305, -6]  # from the later bound
    summary = controls.summary(judged)
    assert "interrupts=2 " in summary and "while_paused=1 marked=1 early_takes=1" in summary
    assert summary.endswith("scheduled_taken=2 late_p50_ms=-6 late_p99_ms=-6 late_max_ms=-6")


@pytest.mark.parametrize(
    ("answer", "state", "owed", "faults"),
    [
        (True, "gone", False, 0),  # withdrawn
        (False, "gone", False, 0),  # withdrawn by a call whose reply was lost
        (False, "taken", True, 0),  # a drain took it first
        (True, "taken", True, 1),  # "withdrawn", yet a user message
        (True, "pending", True, 1),  # "withdrawn", yet waiting
        (False, "pending", True, 1),  # refused, while it waits
    ],
)
def test_a_cancel_is_judged_by_where_the_store_keeps_its_input(
    answer: bool, state: str, owed: bool, faults: int
) -> None:
    """A cancel control submits, cancels and looks where the input is: gone means
    withdrawn (not owed, and never to be found stored); taken means owed; an answer the
    state contradicts is a violation. A withdrawn input found stored at the audit is one
    too."""
    controls = common.Controls(1.0, control_clock())
    answers = {_store.submit: ("in-1", None), _store.cancel_input: answer}

    def run(op: Callable[..., object], *args: object) -> object:
        return state if op is common.input_state else answers[op]

    assert controls.make(common.Submit(1, "s", "cancel"), run) is owed
    assert controls.cancelled == (set() if owed else {1})
    assert controls.made["cancel"] == 1
    judged = common.ControlAudit.judge(controls, stored_ids=["in-1"], taken=[], starts=[])
    assert judged.violations == (faults if owed else 1)  # gone, yet stored: a violation
    clean = common.ControlAudit.judge(controls, stored_ids=[], taken=[], starts=[])
    assert clean.violations == faults
    assert f"cancels=1 cancelled={int(not owed)} cancel_faults={faults} " in controls.summary(clean)


def test_a_worker_cut_off_at_a_control_is_judged_from_when_it_could_hear_of_it() -> None:
    """A worker SIGSTOPped or partitioned when a pause or an interrupt's mark committed
    hears of it only when that ended (the PostgreSQL soak, seed 31: a host stopped in a
    claim handoff, resumed after 1.1 s by the chaos' end, started the claim's drain 0.4 s
    after an interrupt marked it, and stopped it 10 ms later): its starts are judged from
    then. A worker cut off at another time, or another worker, is judged as before."""
    controls = common.Controls(1.0, control_clock(100.0, 110.0, 200.0))
    pause = common.Submit(1, "p", "pause", pause_for=0.0)
    controls.pausing(pause)
    controls.paused(pause)  # paused at 100.0
    controls.resuming("p")  # resumed at 110.0
    controls.resumed("p")
    marked = iter([("in-2", "E")])
    assert controls.make(common.Submit(2, "m", "interrupt"), lambda *_: next(marked))
    slack = common.START_SLACK
    judged = common.ControlAudit.judge(
        controls,
        stored_ids=[],
        taken=[],
        starts=[
            ("p", "P", "stopped", 101.0 + slack - 0.01),  # heard at 101.0: within the slack
            ("p", "P", "stopped", 101.0 + slack),  # a violation
            ("p", "P", "other", 100.5),  # not cut off: a violation
            ("m", "E", "stopped", 201.0),  # heard at 201.0 (a second window)
            ("m", "E", "elsewhere", 201.0),  # cut off, but long before the mark
        ],
        cut_off={
            "stopped": [(99.0, 101.0), (150.0, 151.0), (200.0, 201.0)],
            "elsewhere": [(10.0, 20.0)],
        },
    )
    assert [line.split(" on ")[1].split(",")[0] for line in judged.paused_starts] == [
        "stopped",
        "other",
    ]
    assert len(judged.marked_starts) == 1 and "on elsewhere" in judged.marked_starts[0]


def test_a_pause_that_lands_again_keeps_the_later_resume() -> None:
    """A session paused again before its resume is resumed once, at the later time, and its
    window runs from the first pause."""
    controls = common.Controls(1.0, control_clock(5.0, 6.0, 9.0))
    first = common.Submit(1, "p", "pause", pause_for=0.0)
    second = common.Submit(2, "p", "pause", pause_for=60.0)
    for submit in (first, second):
        controls.pausing(submit)
        controls.paused(submit)
    assert controls.resumes_due() == []
    assert controls.resumes_due(everything=True) == ["p"]
    controls.resuming("p")
    controls.resumed("p")
    assert controls.windows == [("p", 5.0, 9.0)]


def test_stranded_sampling_spares_paused_and_scheduled_inputs(tmp_path: Path) -> None:
    """A paused session's pending inputs wait behind a set doorbell with no claim - held,
    not stranded - and a scheduled input waits for its due time: the sampling counts
    neither, and counts a pending input with no doorbell and no claim, paused or not."""
    engine = sqlite_engine(tmp_path / "soak.db", migrate=True)
    try:
        engine.run(_store.pause, "paused")
        for submit in (
            common.Submit(1, "paused", "pause"),
            common.Submit(2, "later", "scheduled", delay_ms=60_000),
        ):
            op, args = submit.call()
            engine.run(op, *args)
        [(stranded,)] = engine.conn.execute(common.STRANDED_SQL).fetchall()
        assert stranded == 0
        engine.conn.execute("UPDATE session SET time_woken = NULL WHERE id = 'paused'")
        [(stranded,)] = engine.conn.execute(common.STRANDED_SQL).fetchall()
        assert stranded == 1
    finally:
        engine.close()
