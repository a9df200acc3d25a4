"""The soaks in short configurations: real worker processes under chaos, and their audits."""

from __future__ import annotations

import functools
import re
import subprocess
import sys
from pathlib import Path

import pytest
import trio
import trio.testing

from trio_sessions._soak import common
from trio_sessions._soak.pgchaos import Chaos
from trio_sessions._soak.sqlite import Soak
from trio_sessions.soak import parse_args

ROOT = Path(__file__).resolve().parent.parent
LAST_LINE = re.compile(
    r"^kills=(?P<kills>\d+) inputs=(?P<inputs>\d+)"
    r" duplicates_after_kill=(?P<duplicates>\d+)"
    r" lost=(?P<lost>\d+) overlaps=(?P<overlaps>\d+) orphaned=(?P<orphaned>\d+)$"
)


def start_soak(directory: Path, *args: str) -> subprocess.Popen[str]:
    """Start `python -m trio_sessions.soak` with `args`, its files in `directory`. The soaks
    wait more than they compute (about half a core each): a test runs two side by side."""
    return subprocess.Popen(
        [sys.executable, "-m", "trio_sessions.soak", *args, f"--dir={directory}"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def soak_result(
    process: subprocess.Popen[str], last_line: re.Pattern[str], *, violation: bool = False
) -> tuple[dict[str, int], str, str]:
    """Wait for a soak to a clean exit (with `violation`: to the exit status of a
    violation); the figures of its last line (which must match `last_line`), its stdout,
    and its stdout and stderr. Past 90 s it raises, and `run_soaks` stops it."""
    stdout, stderr = process.communicate(timeout=90)
    output = stdout + stderr
    assert process.returncode == (1 if violation else 0), output
    match = last_line.match(stdout.strip().splitlines()[-1])
    assert match is not None, output
    figures = {key: int(value) for key, value in match.groupdict().items()}
    return figures, stdout, output


def run_soaks(
    tmp_path: Path, last_line: re.Pattern[str], runs: dict[str, tuple[list[str], bool]]
) -> dict[str, tuple[dict[str, int], str, str]]:
    """Run soaks side by side (name: its arguments and whether it must end in a
    violation); each one's `soak_result`, every one stopped whatever happens."""
    processes: dict[str, subprocess.Popen[str]] = {}
    try:
        for name, (args, _) in runs.items():
            processes[name] = start_soak(tmp_path / name, *args)
        return {
            name: soak_result(processes[name], last_line, violation=violation)
            for name, (_, violation) in runs.items()
        }
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.kill()
                process.communicate()


KILL_SOAK_ARGS = ["--workers=3", "--rate=15", "--kill-gap", "0.4", "1.5", "--model-steps=0"]
# The two soaks of `test_short_kill_soaks_audits_are_clean`. Each goes on past its duration
# until its first four faults happened, which cover what the test checks of it (a seed
# draws the same faults in the same order on any host, pinned by
# `test_the_kill_soaks_seeds_draw_the_faults_their_test_checks`).
PLAIN_KILL_SOAK = [
    *KILL_SOAK_ARGS,
    "--sessions=6",
    "--duration=12",
    "--handoff-ratio=0.5",
    "--restart-ratio=0.5",
    "--work-max=0.6",
    "--settle-timeout=12",
    "--min-faults=4",
    "--seed=6",
]
CONTROLS_KILL_SOAK = [
    *KILL_SOAK_ARGS,
    "--sessions=4",
    "--duration=12",
    "--handoff-ratio=0.3",
    "--restart-ratio=0.3",
    "--interrupt-rate=0",
    "--control-ratio=0.5",
    "--settle-timeout=12",
    "--min-faults=4",
    "--seed=4",
]


@pytest.mark.serial
@pytest.mark.slow
def test_short_kill_soaks_audits_are_clean(tmp_path: Path) -> None:
    """Two kill soaks side by side. In `plain`, workers killed at random (also inside the
    claim handoff) or restarted gracefully (SIGTERM, successor at once, drains blocked in
    threads) lose no input, never overlap on a session and leave no orphaned claim; the
    soak prints its figures last. In `controls`, half the producer's submits are
    conversation controls - double texts that interrupt the running drain, submits
    rejected while busy, scheduled inputs, pauses resumed a moment later - under the same
    faults: every stored input is answered once, none scheduled is taken early, no drain
    starts on a paused session, nothing rejected is stored."""
    soaks = run_soaks(
        tmp_path,
        LAST_LINE,
        {"plain": (PLAIN_KILL_SOAK, False), "controls": (CONTROLS_KILL_SOAK, False)},
    )
    figures, stdout, output = soaks["plain"]
    assert (figures["lost"], figures["overlaps"], figures["orphaned"]) == (0, 0, 0), output
    assert figures["kills"] >= 3, output
    assert figures["inputs"] >= 100, output
    handoff = re.search(r"handoff_kills=(\d+)", stdout)
    assert handoff is not None and int(handoff.group(1)) >= 1, output
    restarts = re.search(r"rolling_restarts=(\d+)", stdout)
    assert restarts is not None and int(restarts.group(1)) >= 1, output
    figures, stdout, output = soaks["controls"]
    assert (figures["lost"], figures["overlaps"], figures["orphaned"]) == (0, 0, 0), output
    assert figures["kills"] >= 2, output
    check_controls(stdout, output, figures["inputs"])


@pytest.mark.serial
@pytest.mark.slow
def test_kill_soak_busy_kills_overlap_only_without_the_grace(tmp_path: Path) -> None:
    """Workers SIGKILLed while a drain's blocking call runs on in a child process for less
    than the takeover grace, two soaks side by side: the real package never overlaps; a
    copy that takes a dead owner's claims over at the first sighting of its free token
    (`no-takeover-grace`) does, and the audit sees it. (On SQLite a token is free only once
    its process died, so `ignore-lost-token` has nothing to act on there.)"""
    args = [
        "--workers=3",
        "--sessions=6",
        # A busy step waits for a serving worker (a loaded host boots one for seconds), and
        # the chaos for two busy kills (6 s without waiting gave one in CI once).
        "--duration=10",
        "--min-faults=2",
        "--rate=15",
        "--kill-gap",
        "0.3",
        "0.8",
        "--busy-ratio=1",
        "--restart-ratio=0",
        "--settle-timeout=8",
        "--seed=5",
        "--model-steps=0",
    ]
    soaks = run_soaks(
        tmp_path,
        LAST_LINE,
        {"real": (args, False), "broken": ([*args, "--broken=no-takeover-grace"], True)},
    )
    for name, (figures, stdout, output) in soaks.items():
        assert (figures["lost"], figures["orphaned"]) == (0, 0), output
        if name == "real":
            assert figures["overlaps"] == 0, output
        else:
            assert figures["overlaps"] >= 1, output
        busy = re.search(r"busy_kills=(\d+)", stdout)
        assert busy is not None and int(busy.group(1)) >= 2, output


# The line before the last: the conversation controls the producer made, and their audit.
CONTROLS_LINE = re.compile(
    r"^soak: controls queued=(?P<queued>\d+) interrupts=(?P<interrupts>\d+)"
    r" rejects=(?P<rejects>\d+) rejected=(?P<rejected>\d+) scheduled=(?P<scheduled>\d+)"
    r" pauses=(?P<pauses>\d+) resumes=(?P<resumes>\d+) while_paused=(?P<while_paused>\d+)"
    r" marked=(?P<marked>\d+) early_takes=(?P<early_takes>\d+)"
    r" paused_starts=(?P<paused_starts>\d+) marked_starts=(?P<marked_starts>\d+)"
    r" rejected_stored=(?P<rejected_stored>\d+) cancels=(?P<cancels>\d+)"
    r" cancelled=(?P<cancelled>\d+) cancel_faults=(?P<cancel_faults>\d+)"
    r" scheduled_taken=(?P<scheduled_taken>\d+)"
    r" late_p50_ms=-?\d+ late_p99_ms=-?\d+ late_max_ms=-?\d+$",
    re.MULTILINE,
)


def check_controls(stdout: str, output: str, inputs: int) -> None:
    """Every control kind was made (a reject also refused, an interrupt also marking a
    running claim, a cancel also withdrawing an input), every pause resumed, none of them
    broke its promise, and the inputs owed are the ones stored (neither a refusal nor a
    withdrawn input is)."""
    match = CONTROLS_LINE.search(stdout)
    assert match is not None, output
    made = {key: int(value) for key, value in match.groupdict().items()}
    made_kinds = ("queued", "interrupts", "rejects", "scheduled", "cancels")
    for kind in (*made_kinds, "marked", "rejected", "pauses", "cancelled"):
        assert made[kind] >= 1, output
    assert 1 <= made["resumes"] <= made["pauses"], output
    assert made["while_paused"] >= made["pauses"], output
    assert made["scheduled_taken"] == made["scheduled"], output
    violations = ("early_takes", "paused_starts", "marked_starts", "rejected_stored")
    assert [made[key] for key in (*violations, "cancel_faults")] == [0] * 5, output
    made_inputs = sum(made[kind] for kind in made_kinds)
    withdrawn = made["rejected"] + made["cancelled"]
    assert inputs == made_inputs + made["pauses"] - withdrawn, output


@pytest.mark.parametrize("seed", range(20))
def test_a_busy_step_goes_to_a_serving_worker_and_waits_for_one(tmp_path: Path, seed: int) -> None:
    """With `--busy-ratio=1`, the fault is a busy step whichever worker the draw favours:
    it goes to a worker that serves, while two just restarted do not serve yet. (A worker
    chosen before the fault turned the busy step into a plain kill when it was a starting
    one: one busy kill in ten seconds on a loaded host.) With none serving, it waits for
    one - never a plain kill (which kept booting workers from ever serving: no busy kill
    at all in a loaded run) - while a plain kill takes any worker."""
    args = parse_args(
        ["--busy-ratio=1", "--restart-ratio=0", "--handoff-ratio=0", f"--seed={seed}"]
    )
    soak = Soak(args, tmp_path)
    try:
        logs = {"w0.4": "", "w1.5": "", "w2.3": f"{common.SERVING} w2.3\n"}
        for slot, (name, text) in enumerate(logs.items()):
            (tmp_path / f"{name}.log").write_text(text)
            process: subprocess.Popen[bytes] = None  # type: ignore[assignment]  # not run
            soak.workers[slot] = common.Worker(slot, name, process, tmp_path / f"{name}.log")
        fault = soak.draw_fault()
        assert fault.kind == "busy"
        worker = soak.place(fault.kind, fault.pick)
        assert worker is not None and worker.name == "w2.3"
        (tmp_path / "w2.3.log").write_text("")
        assert soak.place(fault.kind, fault.pick) is None
        assert soak.place("kill", fault.pick) is not None
    finally:
        soak.conn.close()  # (no worker process to stop)


def test_a_seed_draws_the_same_faults_however_the_producer_and_the_workers_fare(
    tmp_path: Path,
) -> None:
    """The chaos draws its faults from a stream of its own, a fixed number of draws per
    fault: the kinds a seed gives do not depend on how many inputs the producer submitted
    between them, nor on which workers served (a shared stream made a seed's faults and
    submits depend on their timing, so a loaded host ran other faults than the seed was
    chosen for)."""
    args = parse_args(["--restart-ratio=0.4", "--busy-ratio=0.3", "--seed=3"])
    kinds = []
    for run, submits in enumerate((0, 3)):
        (tmp_path / str(run)).mkdir()
        soak = Soak(args, tmp_path / str(run))
        try:
            drawn = []
            for _ in range(30):
                for _ in range(submits):
                    soak.submit_one()
                drawn.append(soak.draw_fault())
            kinds.append(drawn)
        finally:
            soak.conn.close()
    assert kinds[0] == kinds[1]
    assert {fault.kind for fault in kinds[0]} >= {"restart", "busy", "kill"}


@pytest.mark.parametrize(
    ("argv", "first_faults"),
    [
        (PLAIN_KILL_SOAK, ["handoff", "busy", "kill", "restart"]),
        (CONTROLS_KILL_SOAK, ["restart", "handoff", "busy", "handoff"]),
    ],
)
def test_the_kill_soaks_seeds_draw_the_faults_their_test_checks(
    tmp_path: Path, argv: list[str], first_faults: list[str]
) -> None:
    """The faults `--min-faults=4` waits for in `test_short_kill_soaks_audits_are_clean`:
    in `plain`, three kills (one in a handoff) and a rolling restart; in `controls`, two
    kills. (A handoff that missed its hook is a kill, and the next kill makes up for it:
    `Soak.handoff_owed`.)"""
    soak = Soak(parse_args(argv), tmp_path)
    try:
        soak.chaos_rng.uniform(*soak.args.kill_gap)  # the chaos's first: its first gap
        assert [soak.draw_fault().kind for _ in first_faults] == first_faults
    finally:
        soak.conn.close()


async def test_a_busy_token_kill_waits_for_a_serving_host_that_holds_its_token(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL: a busy token kill drawn while no host both serves and holds its token
    waits for one (a loaded host boots a worker for seconds) - before, it became another
    host fault kind, of a booting worker (a busy-ratio-1 run made plain kills and pauses
    and too few busy token kills); a restart waits for a host that serves."""
    args = parse_args(["--backend=postgres", "--busy-ratio=1", "--seed=1"])
    chaos = Chaos(args, tmp_path, "postgresql://unused", None)
    holders = {"w1.2"}

    async def token_holders() -> set[str]:
        return set(holders)

    monkeypatch.setattr(chaos, "token_holders", token_holders)
    logs = {"w0.1": "", "w1.2": f"{common.SERVING} w1.2\n", "w2.3": ""}
    for slot, name in enumerate(logs):
        (tmp_path / f"{name}.log").write_text(logs[name])
        process: subprocess.Popen[bytes] = None  # type: ignore[assignment]  # not run
        chaos.workers[slot] = common.Worker(slot, name, process, tmp_path / f"{name}.log")
    restart = await chaos.serving_worker(0.9, holding_token=False)
    assert restart is not None and restart.name == "w1.2"
    holders.clear()  # w1.2 lost its token: nobody has one to lose

    async def w2_serves_later() -> None:
        await trio.sleep(3)
        (tmp_path / "w2.3.log").write_text(f"{common.SERVING} w2.3\n")
        holders.add("w2.3")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(w2_serves_later)
        busy = await chaos.serving_worker(0.0, holding_token=True)
    assert busy is not None and busy.name == "w2.3"
    assert trio.current_time() >= 3


async def test_host_faults_go_on_while_the_serving_hosts_hold_no_token(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL: a busy token kill drawn while hosts serve but none holds its token - for
    good in a copy that ignores a lost token (`ignore-lost-token`: it never takes one
    again, and the server restart and the token kills take every host's) - gives its turn
    up after a while, and the other host faults go on. Waiting for a holder without end,
    the first such draw stopped every host fault for the rest of the chaos: a run of that
    copy at the default `--busy-ratio` made no kill, pause, partition or restart after
    it (here: one partition in a virtual minute, then nothing)."""
    args = parse_args(
        ["--backend=postgres", "--busy-ratio=0.5", "--kill-gap", "0.3", "0.5", "--seed=1"]
    )
    chaos = Chaos(args, tmp_path, "postgresql://unused", None)

    async def token_holders() -> set[str]:
        return set()  # every host lost its token, and takes none again

    done: list[str] = []

    async def fault(kind: str, worker: common.Worker, *_: object) -> None:
        done.append(kind)

    monkeypatch.setattr(chaos, "token_holders", token_holders)
    for kind in ("kill", "pause", "partition", "busy_token_kill"):
        monkeypatch.setattr(chaos, kind, functools.partial(fault, kind))
    monkeypatch.setattr(chaos, "rolling_restart", lambda worker: done.append("restart"))
    for slot in range(3):
        name = f"w{slot}.{slot + 1}"
        (tmp_path / f"{name}.log").write_text(f"{common.SERVING} {name}\n")
        process: subprocess.Popen[bytes] = None  # type: ignore[assignment]  # not run
        chaos.workers[slot] = common.Worker(slot, name, process, tmp_path / f"{name}.log")
    with trio.move_on_after(60):
        async with trio.open_nursery() as nursery:
            await chaos.host_faults(nursery)
    assert "busy_token_kill" not in done  # nobody had a token to lose
    assert len(done) >= 8, done
    assert set(done) == {"kill", "pause", "partition", "restart"}, done


PG_LAST_LINE = re.compile(
    r"^backend=postgres kills=(?P<kills>\d+) pauses=(?P<pauses>\d+)"
    r" partitions=(?P<partitions>\d+) conn_kills=(?P<conn_kills>\d+) skew_ms=(?P<skew_ms>\d+)"
    r" inputs=(?P<inputs>\d+) lost=(?P<lost>\d+) overlaps=(?P<overlaps>\d+)"
    r" orphaned=(?P<orphaned>\d+) zombie_writes=(?P<zombie_writes>\d+)$"
)


PG_SOAK_ARGS = ["--backend=postgres", "--workers=3", "--rate=10", "--lease=1.5", "--model-steps=0"]
PG_AUDIT = ("lost", "overlaps", "orphaned", "zombie_writes")


@pytest.mark.serial
@pytest.mark.slow
def test_short_postgres_soaks_audits_are_clean(tmp_path: Path) -> None:
    """Two PostgreSQL soaks side by side, each with its own server. In `plain`, hosts each
    behind its own fault proxy, killed, paused and partitioned past the lease, restarted
    gracefully (SIGTERM, successor at once, drains blocked in threads), their connections
    killed (COMMITs included), clocks skewed by more than a lease and the server restarted
    once: no input lost, no overlap, no orphan, no zombie write; every fault kind was
    injected. In `controls`, half the producer's submits are conversation controls under
    those faults: as the kill soak, no input lost, nothing scheduled taken early, no drain
    of a paused session, nothing rejected stored - and no overlap, orphan or zombie
    write."""
    soaks = run_soaks(
        tmp_path,
        PG_LAST_LINE,
        {
            "plain": (
                [
                    *PG_SOAK_ARGS,
                    "--sessions=6",
                    "--duration=16",
                    "--kill-gap",
                    "0.2",
                    "0.8",
                    "--conn-kill-gap",
                    "0.5",
                    "1.5",
                    "--handoff-ratio=0.5",
                    "--settle-timeout=15",
                    "--seed=8",
                ],
                False,
            ),
            "controls": (
                [
                    *PG_SOAK_ARGS,
                    "--sessions=4",
                    "--duration=14",
                    "--kill-gap",
                    "0.3",
                    "1.0",
                    "--conn-kill-gap",
                    "0.5",
                    "1.5",
                    "--interrupt-rate=0",
                    "--control-ratio=0.5",
                    "--settle-timeout=15",
                    "--seed=4",
                ],
                False,
            ),
        },
    )
    figures, stdout, output = soaks["plain"]
    assert [figures[key] for key in PG_AUDIT] == [0, 0, 0, 0], output
    for fault in ("kills", "pauses", "partitions", "conn_kills"):
        assert figures[fault] >= 1, output
    assert figures["skew_ms"] > 1500, output  # more than a lease
    restarts = re.search(r"rolling_restarts=(\d+)", stdout)
    assert restarts is not None and int(restarts.group(1)) >= 1, output
    assert figures["inputs"] >= 50, output
    assert re.search(r" restarts=1 ", stdout) is not None, output
    figures, stdout, output = soaks["controls"]
    assert [figures[key] for key in PG_AUDIT] == [0, 0, 0, 0], output
    check_controls(stdout, output, figures["inputs"])


@pytest.mark.serial
@pytest.mark.slow
def test_postgres_soak_busy_token_kills_overlap_only_on_a_broken_liveness_copy(
    tmp_path: Path,
) -> None:
    """Hosts whose liveness token connections are killed while a drain is in a blocking call
    shorter than the grace, followed by more work, two soaks side by side: the real package
    never overlaps (nor loses, orphans or writes as a zombie); a copy that goes on draining
    after losing its token (`ignore-lost-token`) does, and the audit sees the drains
    overlap. Only busy token kills among the host faults, and no interrupts (they would
    cancel a busy drain before the grace ran out); the copy that ignores its lost token
    never takes it again, so each host loses it once - and every host at the server
    restart halfway through - which leaves a few busy token kills that count. (A copy
    without the takeover grace no longer overlaps here: the owner takes its token again
    within milliseconds, too soon for a poll to see it free. The kill soak shows that
    defect.)"""
    args = [
        *PG_SOAK_ARGS,
        "--sessions=6",
        "--duration=12",
        "--kill-gap",
        "0.2",
        "0.5",
        "--busy-ratio=1",
        "--interrupt-rate=0",
        "--conn-kill-gap",
        "5",
        "10",
        "--settle-timeout=8",
        "--seed=8",
    ]
    soaks = run_soaks(
        tmp_path,
        PG_LAST_LINE,
        {
            # Busy token kills wait for a serving host that holds its token; the chaos for
            # three of them (the broken copy's hosts lose their token once: one will do).
            "real": ([*args, "--min-faults=3"], False),
            "broken": ([*args, "--min-faults=1", "--broken=ignore-lost-token"], True),
        },
    )
    figures, stdout, output = soaks["real"]
    assert [figures[key] for key in PG_AUDIT] == [0, 0, 0, 0], output
    busy = re.search(r"busy_token_kills=(\d+)", stdout)
    assert busy is not None and int(busy.group(1)) >= 3, output
    figures, stdout, output = soaks["broken"]
    assert figures["overlaps"] >= 1, output
    busy = re.search(r"busy_token_kills=(\d+)", stdout)
    # A host ignoring its lost token has none left to kill after the first time (the chaos
    # aims a busy kill at a host that holds its token, while one serves).
    assert busy is not None and int(busy.group(1)) >= 1, output
