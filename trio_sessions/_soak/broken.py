"""Broken copies of the package: one deliberate defect each, to check the soak's audit.

`python -m trio_sessions.soak --backend postgres --broken NAME` copies the package to the
work directory, applies the defect NAME (a textual patch that must match exactly once, so a
defect never silently stops applying when the code moves) and runs the workers on the copy
(`PYTHONPATH`, from a working directory that holds no other copy); the producer and the
audit keep the real package. The README's "Reliability" section lists which audit figure
each defect turned non-zero in a default-length run.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import attrs

PACKAGE = Path(__file__).resolve().parent.parent


@attrs.frozen
class Edit:
    path: str  # inside the package
    old: str
    new: str


@attrs.frozen
class Defect:
    what: str
    edits: tuple[Edit, ...]


DEFECTS = {
    "fence-key-share": Defect(
        "the session lock is a FOR KEY SHARE row lock on the session (a takeover's updates"
        " do not conflict with it)",
        (
            Edit(
                "_postgres/transactions.py",
                '" (SELECT pg_advisory_xact_lock(ts_lock_key(%s)))"',
                '" (SELECT count(*) FROM (SELECT 1 FROM session WHERE id = %s"'
                '" FOR KEY SHARE) AS k)"',
            ),
        ),
    ),
    "no-session-lock": Defect(
        "fences are read without any session lock (READ COMMITTED alone)",
        (
            Edit(
                "_postgres/transactions.py",
                "    def _lock(self, statement: str, argument: Any,"
                " session_ids: list[str]) -> None:\n",
                "    def _lock(self, statement: str, argument: Any,"
                " session_ids: list[str]) -> None:\n"
                "        return\n",
            ),
        ),
    ),
    "unlocked-write-fence": Defect(
        "a drain's writes check the claim fence without the session lock (acquire and"
        " recovery keep it): a takeover can commit between the check and the write",
        (
            Edit(
                "_store/common.py",
                "    tx.lock_session(session_id)\n    exists = (\n",
                "    exists = (\n",
            ),
        ),
    ),
    "no-self-fence": Defect(
        "no local lease deadline: a drain runs until the store says its lease is lost",
        (
            Edit(
                "_lease.py",
                "    return sent_at + lease * (1 - SELF_FENCE_MARGIN)",
                '    return float("inf")',
            ),
        ),
    ),
    "no-margin": Defect(
        "the self-fencing deadline has no margin (exactly one lease after the renewal was sent)",
        (
            Edit(
                "_lease.py",
                "SELF_FENCE_MARGIN = 0.1",
                "SELF_FENCE_MARGIN = 0.0",
            ),
        ),
    ),
    "late-self-fence": Defect(
        "the self-fencing deadline falls half a lease after the durable expiry",
        (
            Edit(
                "_lease.py",
                "SELF_FENCE_MARGIN = 0.1",
                "SELF_FENCE_MARGIN = -0.5",
            ),
        ),
    ),
    "heartbeat-revives": Defect(
        "the heartbeat renews a claim of this owner even after its lease expired",
        (
            Edit(
                "_store/claims.py",
                '        " AND expires_at > :now RETURNING id, phase",',
                '        " RETURNING id, phase",',
            ),
        ),
    ),
    "no-expired-recovery": Defect(
        "the recovery scan never selects expired claims (only unclaimed doorbells)",
        (
            Edit(
                "_store/recovery_scan.py",
                '        f" WHERE {due} AND {not_local}"',
                '        f" WHERE {due} AND {not_local} AND 1 = 0"',
            ),
        ),
    ),
    "interrupt-no-rearm": Defect(
        "an interrupt's cleanup does not re-arm the doorbell for inputs still pending",
        (
            Edit(
                "_store/claims.py",
                "    _reset_attempts(tx, session_id)\n"
                "    if _has_pending_inputs(tx, session_id):\n"
                "        _ring(tx, session_id)\n"
                "    return Interrupted(_doorbell_set(tx, session_id), left_open)\n",
                "    _reset_attempts(tx, session_id)\n"
                "    return Interrupted(_doorbell_set(tx, session_id), left_open)\n",
            ),
        ),
    ),
    "ignore-pause": Defect(
        "a pause neither stops a busy period at its iteration boundary nor refuses an"
        " acquire (SQLite: on PostgreSQL these decisions run in the server's functions,"
        " which the producer's real package installs)",
        (
            Edit("_decisions.py", "    if paused:\n        return AcquireVerdict.PAUSED\n", ""),
            Edit("_decisions.py", "    if paused:\n        return IterationVerdict.PAUSE\n", ""),
        ),
    ),
    "early-hand-back": Defect(
        "a graceful shutdown hands the claims back before their drains exited (a drain"
        " blocked in a thread still runs while another worker resumes the session)",
        (
            Edit(
                "_verbs.py",
                "        for entry in list(self._entries.values()):\n"
                '            entry.interrupt("shutdown")\n',
                "        for entry in list(self._entries.values()):\n"
                '            entry.interrupt("shutdown")\n'
                "        await self._db.run_nowait(\n"
                "            _store.expire_claims,\n"
                "            self._owner_id,\n"
                "            [e.execution_id for e in self._entries.values() if e.owned],\n"
                "        )\n",
            ),
        ),
    ),
    "no-takeover-grace": Defect(
        "an owner whose liveness token is seen free once counts as gone at once (no grace"
        " for an owner that lost its token while alive to stop its drains)",
        (
            Edit(
                "_decisions.py",
                "    return free_since is not None and now - free_since >= grace",
                "    return free_since is not None",
            ),
        ),
    ),
    "ignore-lost-token": Defect(
        "an owner whose liveness token is lost while it lives (its connection broke) goes"
        " on draining and never takes the token again; a drain of its that is taken over"
        " stops at the heartbeat that finds the claim gone, not at the takeover's change"
        " signal (which narrows the overlap to milliseconds, too short for the audit to"
        " see it every time, without closing it)",
        (
            Edit(
                "_verbs.py",
                "            await token.wait_lost()\n            self._token_lost = True\n",
                "            await trio.sleep_forever()\n            self._token_lost = True\n",
            ),
            Edit(
                "_loops.py",
                "            elif entry.owned and not entry.deciding"
                " and entry.execution_id in gone:\n",
                "            elif False:\n",
            ),
        ),
    ),
}


def patched(edit: Edit, text: str) -> str:
    """`text` with the edit applied (`ValueError` unless its `old` occurs once there)."""
    if text.count(edit.old) != 1:
        raise ValueError(f"{edit.path}: the text to break must occur exactly once")
    return text.replace(edit.old, edit.new)


def make_copy(name: str, dest: Path) -> Path:
    """A copy of the package with defect `name` under `dest`; returns the import root."""
    if name not in DEFECTS:
        raise SystemExit(f"unknown defect {name!r}; known: {', '.join(DEFECTS)}")
    target = dest / PACKAGE.name
    shutil.copytree(PACKAGE, target, ignore=shutil.ignore_patterns("__pycache__"))
    for edit in DEFECTS[name].edits:  # in order: two edits of one file see each other
        path = target / edit.path
        path.write_text(patched(edit, path.read_text()))
    return dest


def print_list() -> None:
    for name, defect in DEFECTS.items():
        print(f"{name}: {defect.what}")
