"""Owner liveness (DESIGN §4): what the runtime asks the store about other owners' tokens.

The tokens themselves live outside the tables (`_liveness`: a lock file on SQLite, an
advisory lock and its `session_owner` record on PostgreSQL); `tx.free_tokens` and
`tx.forget_tokens` are each dialect's form, so these operations are written once.

Invariants: a token record is removed only while its token is free and its owner holds no
live claim recovery may take and no live recovery lease on a claim (quarantined ones wait for
the operator, whatever the record);
an owner with no record is never reported free.
"""

from __future__ import annotations

from collections.abc import Sequence

from .._backend import Tx, autocommit_when_alone, runs_off_the_loop
from .common import _in_list


@autocommit_when_alone
@runs_off_the_loop
def free_tokens(tx: Tx) -> set[str]:
    """Every owner on record whose liveness token is free now (read-only): one statement,
    which PostgreSQL runs alone in autocommit (one round trip: no BEGIN, no COMMIT, as a
    function call's), every runtime that drains looking every `LIVENESS_POLL`. SQLite's
    form probes lock files, in a worker thread (`runs_off_the_loop`)."""
    return tx.free_tokens(None)


def forget_gone_owners(tx: Tx, owner_ids: Sequence[str]) -> list[str]:
    """Of these gone owners, those still holding live claims (a quarantined one too: lifted,
    it is taken over at once only while its owner is seen gone, not after its lease), or
    live recovery leases on claims (not quarantined); the token records of the others are
    removed where still free. A gone owner's recovery lease is
    no live one only while the owner is seen gone (`recovery_scan`): with its record
    removed it is never seen free again, and the lease - one a pass could not take over
    yet (no room, a claim row locked) - would hold the claim out for a whole lease."""
    if not owner_ids:
        return []
    rows = tx.execute(
        "SELECT e.owner_id FROM session_execution e"
        f" WHERE e.owner_id IN {_in_list(owner_ids)} AND e.expires_at > ?"
        " UNION SELECT r.owner_id FROM session_recovery r"
        f" WHERE r.owner_id IN {_in_list(owner_ids)} AND r.expires_at > ?"
        " AND r.recovery_error IS NULL"
        " AND EXISTS (SELECT 1 FROM session_execution e WHERE e.id = r.execution_id)",
        (*owner_ids, tx.now, *owner_ids, tx.now),
    ).fetchall()
    left = sorted(str(row[0]) for row in rows)
    tx.forget_tokens([owner for owner in owner_ids if owner not in left])
    return left
