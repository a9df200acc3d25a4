"""The fenced store operations by family, written once for every backend (synchronous).

Each operation is a function `op(tx, ...)` that a backend runs inside one write transaction
(`_backend.Tx`; several operations may share one transaction: group commit). SQL here is the
subset SQLite and PostgreSQL agree on; where they differ, `tx` offers a named hook
(`lock_session`, `lock_claims`, `savepoint`) or says its `dialect`, and the
dialect's form sits beside the shared one in the family's module.

Families (one module each):
* `common`: the claim and recovery fences, the session's small reads and writes, ids;
* `inputs`: `wake` and `submit` (admission);
* `acquisition`: acquire, and the wake or submit that takes the claim it rings for;
* `claims`: heartbeat, finish, interrupt, hand-back;
* `intake`: taking inputs as user messages (`take_inputs`);
* `transcript`: assistant messages and streamed text, reading;
* `recovery_scan`: the candidates, and the recovery leases taken on them;
* `recovery`: applying the decision to one candidate; `recovery_batch`: to a pass's batch,
  set-wise where it can;
* `operator`: quarantine and rejected inputs, the CLI's status and health reads;
* `changes`: what other processes changed (doorbells, cancellations, watched messages);
* `liveness`: other owners' liveness tokens (free ones, forgetting gone owners).
* `control`: conversation control - `on_busy`, scheduled inputs, cancel, pause and resume,
  delete and purge, fork and truncate (DESIGN §5.1);
* `stream`: what a resumable event stream's client is missing (`runtime.stream()`).

Serialisation: every operation that reads and then writes a session's rows first takes
`tx.lock_session(session_id)` - a no-op on SQLite (its write transaction holds the only
write lock), a lock held to COMMIT on PostgreSQL, whose READ COMMITTED would otherwise let a
takeover commit between a fence read and the write behind it. A drain's operations name
their session (the drain context holds it): they lock it at once, and the claim fence
includes it. `tx.now` is read after the operation's locks, so a fence never
compares against a time from before a lock wait.

PostgreSQL runs the fenced operations as server-side functions (DESIGN §8 "One round trip
per operation"): each family module keeps its functions' SQL in `PG_FUNCTIONS`, beside the
Python twins that call them (`tx.call`) when `tx.dialect == "postgres"`. Conventions: a
drain's function takes the session first, like its twin, and `ts_lock_execution` finds the
claim only if it is that session's; every function takes its locks first (the session's
advisory lock, or the claim rows' row locks in id order), then reads the clock -
`ts_now(p_now)`: the server's `clock_timestamp()`, or the test clock the caller passes -
then checks its fence and writes. A refusal is a
returned verdict (`ok`, `lease_lost`, `held`, ...), never an exception, so a refused call
has written nothing. `p_retry` is true when the caller runs a call again after losing its
reply in autocommit (`_backend.autocommit_when_alone`): such a function first reads back,
by natural key (the input id, the execution id, the message id, the delta's version),
whether the lost call landed, and answers as that call did. A natural key may outlive a
call (a cancelled input's id is submitted again), so a submit's functions also take the
call's own id (`tx.call_id`, `p_call`), stored with the input: a trace the key left is
read as this call's only when it names this call.

Every name the rest of the package (and its tests) uses is re-exported here, so callers
write `_store.submit(...)` whatever module the operation lives in.
"""

from __future__ import annotations

from . import acquisition as _acquisition
from . import changes as _changes
from . import claims as _claims
from . import common as _common
from . import control as _control
from . import inputs as _inputs
from . import intake as _intake
from . import recovery_batch as _recovery_batch
from . import recovery_scan as _recovery_scan
from . import stream as _stream_family
from . import transcript as _transcript_family
from .acquisition import Acquired, acquire, submit_and_acquire, wake_and_acquire
from .changes import (
    REPLAY_CHUNK,
    Changes,
    Followed,
    Snapshot,
    Watched,
    changes,
    newest_message,
    sessions_present,
    watched_changes,
    watched_messages,
)
from .claims import (
    Interrupted,
    cancel_own_claims,
    end_iteration,
    expire_claims,
    finish_failed,
    finish_interrupted,
    heartbeat,
    mark_cancelling,
    messages_left_open,
    request_cancel,
)
from .common import CLAIM_FENCE, RECOVERY_FENCE, new_id
from .control import (
    Due,
    cancel_input,
    delete_session,
    fork,
    next_due,
    pause,
    pause_session,
    promote_due,
    purge_batch,
    resume,
    resume_existing,
    submit_controlled,
    submit_controlled_and_acquire,
    submit_scheduled,
    submit_truncating,
    truncate,
)
from .inputs import submit, wake
from .intake import TAKE_INPUTS_CHUNK, FastTakeRefused, Taken, inputs_taken_by, take_inputs
from .liveness import forget_gone_owners, free_tokens
from .operator import (
    STORE_TABLES,
    drop_quarantined,
    drop_rejected_input,
    lift_quarantine,
    malformed_columns,
    pending_inputs,
    quarantine_page,
    quarantine_report,
    quarantined,
    rejected_inputs,
    session_page,
    session_status,
    status,
    store_counts,
    tables_answer,
)
from .recovery import (
    Recovered,
    _recovery_facts,
    _take_over,
    apply_recovery,
    end_recovery_leases,
    newest_assistant_malformed,
    quarantine,
)
from .recovery_batch import apply_recovery_batch
from .recovery_scan import Candidate
from .stream import (
    MARKS_FROM,
    shown_messages,
    stream_catch_up,
    stream_changes,
    stream_heads,
    stream_marks,
    transcript_tail,
)
from .transcript import (
    Known,
    append_assistant_text,
    begin_assistant,
    message_as_stored,
    read_transcript,
    update_assistant,
)

__all__ = [
    "CLAIM_FENCE",
    "MARKS_FROM",
    "RECOVERY_FENCE",
    "REPLAY_CHUNK",
    "STORE_TABLES",
    "TAKE_INPUTS_CHUNK",
    "Acquired",
    "Candidate",
    "Changes",
    "Due",
    "FastTakeRefused",
    "Followed",
    "Interrupted",
    "Known",
    "Recovered",
    "Snapshot",
    "Taken",
    "Watched",
    "_recovery_facts",
    "_take_over",
    "acquire",
    "append_assistant_text",
    "apply_recovery",
    "apply_recovery_batch",
    "begin_assistant",
    "cancel_input",
    "cancel_own_claims",
    "changes",
    "delete_session",
    "drop_quarantined",
    "drop_rejected_input",
    "end_iteration",
    "end_recovery_leases",
    "expire_claims",
    "finish_failed",
    "finish_interrupted",
    "forget_gone_owners",
    "fork",
    "free_tokens",
    "heartbeat",
    "inputs_taken_by",
    "lift_quarantine",
    "malformed_columns",
    "mark_cancelling",
    "message_as_stored",
    "messages_left_open",
    "new_id",
    "newest_assistant_malformed",
    "newest_message",
    "next_due",
    "pause",
    "pause_session",
    "pending_inputs",
    "pg_functions",
    "promote_due",
    "purge_batch",
    "quarantine",
    "quarantine_page",
    "quarantine_report",
    "quarantined",
    "read_transcript",
    "rejected_inputs",
    "request_cancel",
    "resume",
    "resume_existing",
    "session_page",
    "session_status",
    "sessions_present",
    "shown_messages",
    "status",
    "store_counts",
    "stream_catch_up",
    "stream_changes",
    "stream_heads",
    "stream_marks",
    "submit",
    "submit_and_acquire",
    "submit_controlled",
    "submit_controlled_and_acquire",
    "submit_scheduled",
    "submit_truncating",
    "tables_answer",
    "take_inputs",
    "transcript_tail",
    "truncate",
    "update_assistant",
    "wake",
    "wake_and_acquire",
    "watched_changes",
    "watched_messages",
]


def pg_functions(channel: str, lock_namespace: int) -> str:
    """Every family's server-side functions (DDL), for a schema whose notification channel
    is `channel`, with session locks in `lock_namespace` (`@LOCK@`, `@CHANNEL@` and
    `@GENERIC_PLAN@` in their text)."""
    literal = "'" + channel.replace("'", "''") + "'"
    text = "\n".join(
        module.PG_FUNCTIONS
        for module in (
            _common,
            _inputs,
            _intake,
            _transcript_family,
            _claims,
            _acquisition,
            _control,
            _stream_family,
            _changes,
            _recovery_scan,
            _recovery_batch,
        )
    )
    return (
        text.replace("@LOCK@", str(int(lock_namespace)))
        .replace("@CHANNEL@", literal)
        .replace("@GENERIC_PLAN@", _GENERIC_PLAN)
    )


# A set-wise function's setting (written `@GENERIC_PLAN@` before its body): one generic plan
# per connection - planning its statements for each call's arrays cost more than running
# them (ts_recover: 5.4 -> 3.1 ms, ts_finish_iterations: 5.5 -> 1.7 ms per 100 claims).
_GENERIC_PLAN = "SET plan_cache_mode = force_generic_plan"
