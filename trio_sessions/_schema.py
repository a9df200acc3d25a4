"""Both dialects' schemas: the versioned migrations of SQLite and of PostgreSQL, side by side.

The two describe one schema: the same tables, columns, names and named CHECKs, so every
store operation (`_store`) runs unchanged on both. They differ in what each engine does
best: SQLite's hot tables are WITHOUT ROWID and its integers are INTEGER; PostgreSQL's
times are BIGINT and its claim table leaves room for heartbeats' row versions.

Versions do not line up: PostgreSQL's first version is SQLite's versions 1-3 (no
PostgreSQL store predates them), PostgreSQL's version 2 is SQLite's version 4 (streaming),
its version 3 is owner liveness (SQLite keeps that record as a lock file), its version 4
is SQLite's version 5 (conversation control), and its version 5 creates the server-side
functions (PostgreSQL only). A change of the schema adds one version to each dict, in the
same commit.

Invariants: a version, once released, is never edited (stores in the field are at it);
the engines (`_sqlite.migrate`, `_postgres.migrate`) apply versions in order in one
transaction and refuse a store newer than they understand.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import _codec

# ---------------------------------------------------------------------------------------------
# SQLite

SQLITE_SCHEMA_VERSION = 9

# The small, hot tables are WITHOUT ROWID: keyed by their text primary key directly, each
# write touches one b-tree less (fewer WAL pages per commit). Messages keep a rowid: their
# rows are large.
# One index, both backends (SQLite version 7, PostgreSQL version 22).
HANDED_BACK_INDEX = """
CREATE INDEX session_execution_handed_back ON session_execution(expires_at)
    WHERE handed_back = 1;
"""

# One index again, both backends (SQLite version 9, PostgreSQL version 29): an execution's
# maybe-open messages, as every ending reads them (`_store.transcript.MAYBE_OPEN`): not marked
# 1, where it was `finished = 0`, which passed over a mark another tool set to 2 or to text.
MAYBE_OPEN_INDEX = """
DROP INDEX IF EXISTS session_message_open;
CREATE INDEX session_message_open ON session_message(execution_id) WHERE finished <> 1;
"""

SQLITE_MIGRATIONS: dict[int, str] = {
    1: """
CREATE TABLE session(
    id TEXT PRIMARY KEY,
    time_created INTEGER NOT NULL,
    time_woken INTEGER,
    wakes INTEGER NOT NULL DEFAULT 0,
    wake_attempts INTEGER NOT NULL DEFAULT 0
        CONSTRAINT session_wake_attempts_check CHECK (wake_attempts >= 0),
    input_seq INTEGER NOT NULL DEFAULT 0
) WITHOUT ROWID;
CREATE INDEX session_time_woken ON session(time_woken) WHERE time_woken IS NOT NULL;
CREATE TABLE session_input(
    id TEXT PRIMARY KEY,
    session_id TEXT NOT NULL REFERENCES session(id) ON DELETE CASCADE,
    seq INTEGER NOT NULL,
    payload TEXT NOT NULL,
    time_created INTEGER NOT NULL,
    UNIQUE(session_id, seq)
) WITHOUT ROWID;
CREATE TABLE session_execution(
    id TEXT PRIMARY KEY,
    session_id TEXT NOT NULL UNIQUE REFERENCES session(id) ON DELETE CASCADE,
    owner_id TEXT NOT NULL,
    phase TEXT NOT NULL
        CONSTRAINT session_execution_phase_check CHECK (phase IN ('running', 'cancelling')),
    anchor_seq INTEGER,
    time_created INTEGER NOT NULL,
    heartbeat_at INTEGER,
    expires_at INTEGER NOT NULL
) WITHOUT ROWID;
CREATE INDEX session_execution_expires_at ON session_execution(expires_at);
CREATE TABLE session_recovery(
    execution_id TEXT PRIMARY KEY,
    session_id TEXT NOT NULL,
    owner_id TEXT NOT NULL,
    expires_at INTEGER NOT NULL,
    recovery_error TEXT,
    time_created INTEGER NOT NULL,
    time_quarantined INTEGER
) WITHOUT ROWID;
CREATE TABLE session_message(
    id TEXT PRIMARY KEY,
    session_id TEXT NOT NULL REFERENCES session(id) ON DELETE CASCADE,
    execution_id TEXT,
    input_id TEXT UNIQUE,
    role TEXT NOT NULL CONSTRAINT session_message_role_check
        CHECK (role IN ('user', 'assistant', 'system')),
    seq INTEGER NOT NULL,
    data TEXT NOT NULL,
    time_created INTEGER NOT NULL,
    time_updated INTEGER NOT NULL,
    UNIQUE(session_id, seq)
);
CREATE INDEX session_message_execution ON session_message(execution_id)
    WHERE execution_id IS NOT NULL;
""",
    # Every change of a message bumps its version: watchers order snapshots by it.
    2: """
ALTER TABLE session_message ADD COLUMN version INTEGER NOT NULL DEFAULT 0;
""",
    # Records set aside for the operator (an input or message that does not decode), raw
    # text kept; and the mark of a claim handed back by a graceful shutdown (resumed
    # without counting against max_resumes).
    3: """
CREATE TABLE session_input_rejected(
    id TEXT PRIMARY KEY,
    session_id TEXT NOT NULL REFERENCES session(id) ON DELETE CASCADE,
    seq INTEGER NOT NULL,
    payload TEXT NOT NULL,
    reason TEXT NOT NULL,
    time_created INTEGER NOT NULL
);
CREATE INDEX session_input_rejected_session ON session_input_rejected(session_id);
CREATE TABLE session_message_rejected(
    id TEXT PRIMARY KEY,
    session_id TEXT NOT NULL REFERENCES session(id) ON DELETE CASCADE,
    execution_id TEXT,
    seq INTEGER NOT NULL,
    data TEXT NOT NULL,
    reason TEXT NOT NULL,
    time_created INTEGER NOT NULL
);
CREATE INDEX session_message_rejected_session ON session_message_rejected(session_id);
ALTER TABLE session_execution ADD COLUMN handed_back INTEGER NOT NULL DEFAULT 0;
""",
    # Streaming: an append is one small row in session_message_delta (keyed by the message
    # and the version it makes), folded into data at the next tool-part change or finish;
    # session_message_stream holds each open message's base version, so an append never
    # reads or rewrites the wide message row. `finished` mirrors data.finished (1 for
    # messages that are never open); 0 means "maybe open", also for a row written by hand,
    # so closing an execution's open messages reads only the partial index. Existing rows
    # are marked from their JSON; one that does not parse stays 0, as a hand-written one.
    4: """
ALTER TABLE session_message ADD COLUMN finished INTEGER NOT NULL DEFAULT 0;
UPDATE session_message SET finished = 1 WHERE role != 'assistant'
    OR CASE WHEN json_valid(data) THEN json_type(data, '$.finished') = 'true' ELSE 0 END;
CREATE INDEX session_message_open ON session_message(execution_id) WHERE finished = 0;
CREATE TABLE session_message_stream(
    message_id TEXT PRIMARY KEY REFERENCES session_message(id) ON DELETE CASCADE,
    execution_id TEXT NOT NULL,
    version INTEGER NOT NULL
) WITHOUT ROWID;
CREATE TABLE session_message_delta(
    message_id TEXT NOT NULL REFERENCES session_message(id) ON DELETE CASCADE,
    version INTEGER NOT NULL,
    text TEXT NOT NULL,
    PRIMARY KEY (message_id, version)
) WITHOUT ROWID;
""",
    # Conversation control (DESIGN §5.1): a scheduled input's due time (NULL: due, and its
    # doorbell rung), found by the due timer through a partial index of the scheduled ones
    # only; a paused session's pause time (NULL: not paused).
    5: """
ALTER TABLE session_input ADD COLUMN due_at INTEGER;
CREATE INDEX session_input_due ON session_input(due_at) WHERE due_at IS NOT NULL;
ALTER TABLE session ADD COLUMN time_paused INTEGER;
""",
    # A stream's step (DESIGN §5.2): the one event - a tool part, a finish - that made an
    # assistant message's current version, so a stream one version behind gets that event
    # instead of the message whole. One row per message, replaced by each write of its
    # data; none when a write was more than one event (an interrupt failing running tools).
    6: """
CREATE TABLE session_message_change(
    message_id TEXT PRIMARY KEY REFERENCES session_message(id) ON DELETE CASCADE,
    version INTEGER NOT NULL,
    kind TEXT NOT NULL CONSTRAINT session_message_change_kind CHECK (kind IN ('part', 'finish')),
    data TEXT NOT NULL
) WITHOUT ROWID;
""",
    # Claims handed back by a graceful shutdown, found by the change look of every runtime
    # that drains (a rolling restart's sessions are taken over at the signal, not after the
    # grace): a partial index of those claims only.
    7: HANDED_BACK_INDEX,
    # The time of the last write to a session that left no newer row or time of its own -
    # messages truncated or set aside, an input withdrawn, the pause lifted - which `purge`
    # counts as a write, as it counts a message's `time_updated`.
    8: "ALTER TABLE session ADD COLUMN time_written INTEGER;",
    # Every ending reads an execution's maybe-open messages as `finished <> 1`, so a mark
    # another tool broke (2, text) is read and refused as recovery refuses it, not passed
    # over with the claim deleted: the partial index covers those rows.
    9: MAYBE_OPEN_INDEX,
}

# The tables whose presence makes an SQLite file ours.
SQLITE_OUR_TABLES = frozenset(
    {"session", "session_input", "session_execution", "session_recovery", "session_message"}
)


# ---------------------------------------------------------------------------------------------
# PostgreSQL

POSTGRES_SCHEMA_VERSION = 32

# Same names, meanings and named CHECKs as the SQLite schema (`SQLITE_MIGRATIONS`, whose
# versions 1-3 are PostgreSQL's first: no PostgreSQL store predates them); times
# are BIGINT milliseconds; JSON stays TEXT so a malformed row is stored byte for byte for the
# operator. Heartbeats rewrite the indexed `expires_at`, so claim updates are never HOT:
# fillfactor leaves room on each page for the new row versions.
POSTGRES_MIGRATIONS: dict[int, str] = {
    1: """
CREATE TABLE session(
    id TEXT PRIMARY KEY,
    time_created BIGINT NOT NULL,
    time_woken BIGINT,
    wakes BIGINT NOT NULL DEFAULT 0,
    wake_attempts BIGINT NOT NULL DEFAULT 0
        CONSTRAINT session_wake_attempts_check CHECK (wake_attempts >= 0),
    input_seq BIGINT NOT NULL DEFAULT 0
);
CREATE INDEX session_time_woken ON session(time_woken) WHERE time_woken IS NOT NULL;
CREATE TABLE session_input(
    id TEXT PRIMARY KEY,
    session_id TEXT NOT NULL REFERENCES session(id) ON DELETE CASCADE,
    seq BIGINT NOT NULL,
    payload TEXT NOT NULL,
    time_created BIGINT NOT NULL,
    UNIQUE(session_id, seq)
);
CREATE TABLE session_execution(
    id TEXT PRIMARY KEY,
    session_id TEXT NOT NULL UNIQUE REFERENCES session(id) ON DELETE CASCADE,
    owner_id TEXT NOT NULL,
    phase TEXT NOT NULL
        CONSTRAINT session_execution_phase_check CHECK (phase IN ('running', 'cancelling')),
    anchor_seq BIGINT,
    time_created BIGINT NOT NULL,
    heartbeat_at BIGINT,
    expires_at BIGINT NOT NULL,
    handed_back INTEGER NOT NULL DEFAULT 0
) WITH (fillfactor = 80);
CREATE INDEX session_execution_expires_at ON session_execution(expires_at);
CREATE TABLE session_recovery(
    execution_id TEXT PRIMARY KEY,
    session_id TEXT NOT NULL,
    owner_id TEXT NOT NULL,
    expires_at BIGINT NOT NULL,
    recovery_error TEXT,
    time_created BIGINT NOT NULL,
    time_quarantined BIGINT
);
CREATE TABLE session_message(
    id TEXT PRIMARY KEY,
    session_id TEXT NOT NULL REFERENCES session(id) ON DELETE CASCADE,
    execution_id TEXT,
    input_id TEXT UNIQUE,
    role TEXT NOT NULL CONSTRAINT session_message_role_check
        CHECK (role IN ('user', 'assistant', 'system')),
    seq BIGINT NOT NULL,
    data TEXT NOT NULL,
    time_created BIGINT NOT NULL,
    time_updated BIGINT NOT NULL,
    version BIGINT NOT NULL DEFAULT 0,
    UNIQUE(session_id, seq)
);
CREATE INDEX session_message_execution ON session_message(execution_id)
    WHERE execution_id IS NOT NULL;
CREATE TABLE session_input_rejected(
    id TEXT PRIMARY KEY,
    session_id TEXT NOT NULL REFERENCES session(id) ON DELETE CASCADE,
    seq BIGINT NOT NULL,
    payload TEXT NOT NULL,
    reason TEXT NOT NULL,
    time_created BIGINT NOT NULL
);
CREATE INDEX session_input_rejected_session ON session_input_rejected(session_id);
CREATE TABLE session_message_rejected(
    id TEXT PRIMARY KEY,
    session_id TEXT NOT NULL REFERENCES session(id) ON DELETE CASCADE,
    execution_id TEXT,
    seq BIGINT NOT NULL,
    data TEXT NOT NULL,
    reason TEXT NOT NULL,
    time_created BIGINT NOT NULL
);
CREATE INDEX session_message_rejected_session ON session_message_rejected(session_id);
""",
    # Streaming, as SQLite's version 4 (see there). Existing assistant rows are marked
    # finished from their JSON by `_mark_finished_messages` (a row that does not parse
    # stays 0, "maybe open", as a hand-written one).
    2: """
ALTER TABLE session_message ADD COLUMN finished INTEGER NOT NULL DEFAULT 0;
UPDATE session_message SET finished = 1 WHERE role <> 'assistant';
CREATE INDEX session_message_open ON session_message(execution_id) WHERE finished = 0;
CREATE TABLE session_message_stream(
    message_id TEXT PRIMARY KEY REFERENCES session_message(id) ON DELETE CASCADE,
    execution_id TEXT NOT NULL,
    version BIGINT NOT NULL
);
CREATE TABLE session_message_delta(
    message_id TEXT NOT NULL REFERENCES session_message(id) ON DELETE CASCADE,
    version BIGINT NOT NULL,
    text TEXT NOT NULL,
    PRIMARY KEY (message_id, version)
);
""",
    # Owner liveness (DESIGN §4): an owner that holds a liveness token (a session-level
    # advisory lock, `_liveness`) is on record here, so a claim of an owner that never held
    # one is judged by its lease alone. Removed by whoever finds the token free and the owner
    # without live claims. (SQLite keeps the same record as a lock file beside the database.)
    3: """
CREATE TABLE session_owner(
    owner_id TEXT PRIMARY KEY,
    time_created BIGINT NOT NULL
);
""",
    # Conversation control, as SQLite's version 5 (see there).
    4: """
ALTER TABLE session_input ADD COLUMN due_at BIGINT;
CREATE INDEX session_input_due ON session_input(due_at) WHERE due_at IS NOT NULL;
ALTER TABLE session ADD COLUMN time_paused BIGINT;
""",
    # The server-side functions (`_create_functions`); no table changes.
    5: "",
    # The functions again, no table changes: at most one notification per transaction
    # (`ts_signal` defers in a batch, `ts_flush_signals`), signals for watchers only
    # (`ts_signal_watchers`), a batch's appends in one call (`ts_append_texts`).
    6: "",
    # The functions again, no table changes: a cancelling claim's iteration end rings for
    # the due inputs its drain was not given (`ts_finish`).
    7: "",
    # The functions again, no table changes: a stream's read in one call
    # (`ts_stream_changes`).
    8: "",
    # The functions again, no table changes: recovery set-wise in one call (`ts_recover`,
    # `ts_take_recovery_leases`), a batch's iteration ends set-wise (`ts_finish_iterations`).
    9: "",
    # The functions again, no table changes: a batch's submit_and_acquire, acquire and
    # wake_and_acquire jobs set-wise in one statement (`ts_submit_and_acquire_many`,
    # `ts_acquire_many`, `ts_wake_and_acquire_many`), the change scan in one call
    # (`ts_changes`), a recovery pass's scan and leases in one call (`ts_recovery_scan`).
    10: "",
    # The functions again, no table changes: the set-wise functions lock their batch's
    # sessions through one function (`ts_lock_all`).
    11: "",
    # The functions again: double-texting and scheduled submits (`ts_submit_controlled`),
    # another owner's claim interrupted (`ts_request_cancel`), pause, resume,
    # cancel_input, delete_session and truncate (`ts_pause`, `ts_resume`,
    # `ts_cancel_input`, `ts_delete_session`, `ts_truncate`, purge's `ts_delete_rows`) and
    # a transcript read (`ts_read_transcript`), each in one call; a writer's tool change or
    # finish from what it stored last, in one call (`ts_update_message`). `ts_recover`
    # gains `p_whole` (alone in autocommit, it refuses a batch that needs the row-by-row
    # path: `ts_needs_transaction`) and reads back a lost call's takeovers on `p_retry`. A
    # new argument list is a new function: the old one goes.
    12: """
DROP FUNCTION IF EXISTS ts_recover(text, text[], text[], text[], text[], bigint, bigint, bigint,
    boolean);
""",
    # The functions again, no table changes: an acquire from a doorbell never waits for a
    # session another transaction holds (`ts_try_lock`; `ts_acquire` and
    # `ts_acquire_many` answer 'busy').
    13: "",
    # An iteration's end alone is one call in autocommit (`ts_finish` gains `p_whole`): an
    # ending that deletes the claim leaves its execution and verdict on the session row,
    # read back by a retry after a lost reply. A new argument list is a new function: the
    # old one goes.
    14: """
ALTER TABLE session ADD COLUMN released_execution TEXT;
ALTER TABLE session ADD COLUMN released_verdict TEXT;
DROP FUNCTION IF EXISTS ts_finish(text, text, text, text, bigint, boolean);
""",
    # The functions again, no table changes: a batch's submits in one call (`ts_submits`),
    # many streams' reads set-wise (`ts_stream_changes_many`).
    15: "",
    # A session's lock key is 64 bits (`ts_lock_key`), where two sessions' 32-bit keys could
    # be one lock. A stream's step, as SQLite's version 6: a message's writes record it
    # (`ts_write_message`, `ts_update_message`: a new argument list is a new function, the
    # old one goes), and a stream's read sends it (`ts_stream_changes_many`).
    16: """
CREATE TABLE session_message_change(
    message_id TEXT PRIMARY KEY REFERENCES session_message(id) ON DELETE CASCADE,
    version BIGINT NOT NULL,
    kind TEXT NOT NULL CONSTRAINT session_message_change_kind CHECK (kind IN ('part', 'finish')),
    data TEXT NOT NULL
);
DROP FUNCTION IF EXISTS ts_write_message(text, text, text, boolean, bigint, boolean, bigint,
    boolean);
DROP FUNCTION IF EXISTS ts_update_message(text, text, text, text, bigint, text, boolean, bigint,
    boolean);
""",
    # The functions again, no table changes: a session's lock key is seeded with its
    # schema (`ts_lock_key`), where one session id in two stores of a database was one lock.
    17: "",
    # The functions again, no table changes: an interrupting submit names the claim it
    # marked cancelling (`ts_submit_controlled`), and a delete the claim it removed
    # (`ts_delete_session`, a new return type: `_create_functions` drops the old one), so
    # the caller stops that claim's drain and no other.
    18: "",
    # A cancelled input leaves a trace for a few minutes (`ts_cancel_input`), PostgreSQL's
    # alone: a submit whose reply was lost, called again (`p_retry`), finds that its lost
    # call landed although the input was cancelled in between (`ts_known_input` gains
    # `p_retry`: a new argument list is a new function, the old one goes). SQLite's calls run
    # in process and lose no reply.
    19: """
CREATE TABLE session_input_cancelled(
    id TEXT PRIMARY KEY,
    session_id TEXT NOT NULL REFERENCES session(id) ON DELETE CASCADE,
    payload TEXT NOT NULL,
    time_cancelled BIGINT NOT NULL
);
CREATE INDEX session_input_cancelled_time ON session_input_cancelled(time_cancelled);
CREATE INDEX session_input_cancelled_session ON session_input_cancelled(session_id);
DROP FUNCTION IF EXISTS ts_known_input(text, text, text);
""",
    # A cancel's trace answers only the retry of the call that stored the input: an input
    # keeps the id of the submit call that stored it (`call_id`, `Job.call_id`, the same
    # in every attempt of the call), its trace copies it, and a retry reads the trace as
    # its own landed input only when it names this call - not the retry of a later submit
    # of the same id whose call never ran (`ts_known_input`). The submit functions gain
    # `p_call` (a new argument list is a new function: the old ones go). Rows of before
    # have none: their traces answer no retry. PostgreSQL's alone, as version 19.
    20: """
ALTER TABLE session_input ADD COLUMN call_id TEXT;
ALTER TABLE session_input_cancelled ADD COLUMN call_id TEXT;
DROP FUNCTION IF EXISTS ts_known_input(text, text, text, boolean);
DROP FUNCTION IF EXISTS ts_insert_input(text, text, text, boolean, bigint);
DROP FUNCTION IF EXISTS ts_submit(text, text, text, bigint, boolean);
DROP FUNCTION IF EXISTS ts_submits(text[], text[], text[], bigint, boolean);
DROP FUNCTION IF EXISTS ts_submit_and_acquire(text, text, text, text, text, bigint, bigint,
    boolean);
DROP FUNCTION IF EXISTS ts_submit_and_acquire_many(text[], text[], text[], text[], text[],
    bigint[], bigint, boolean);
DROP FUNCTION IF EXISTS ts_submit_controlled(text, text, text, text, bigint, bigint, boolean);
""",
    # The functions again, no table changes: a double-texting submit with the claim it rings
    # for in one call (`ts_submit_controlled_and_acquire`), where it was a transaction of a
    # statement per fence read and write (ten round trips).
    21: "",
    # A hand-back signals its sessions (`ts_expire_claims`) and the change look reports the
    # claims handed back and waiting for a takeover (`ts_changes`), through the index SQLite
    # gains in its version 7.
    22: HANDED_BACK_INDEX,
    # As SQLite's version 8: `session.time_written`, set by the writes that leave no newer
    # row or time of their own (`ts_truncate`, `ts_cancel_input`, `ts_resume`, and a
    # quarantine's drop, which runs the shared SQL).
    23: "ALTER TABLE session ADD COLUMN time_written BIGINT;",
    # The functions again, no table changes: a submit racing another session's submit of
    # its input id - unseen under its own session lock, waited for by the primary key - is
    # answered as if run after it (`ts_insert_input` stores the input first, ON CONFLICT DO
    # NOTHING, and reads a conflict back: it gains `p_due` and `p_retry` and returns a
    # verdict; a new argument list is a new function, the old one goes); `ts_acquire_many`
    # reads on every supported server (its `'{{}}'`, an empty array to PostgreSQL 17+ only,
    # is `'{}'`); a take of inputs returns the user messages it appended (`ts_take_inputs`,
    # a new return type: `_create_functions` drops the old one), so the drain offers them
    # to local watchers before its reply to them; `ts_resume` leaves a session that is not
    # paused as it is; a stream's read fetches one page of a long answer's appends.
    24: """
DROP FUNCTION IF EXISTS ts_insert_input(text, text, text, text, boolean, bigint);
""",
    # The functions again, no table changes: a writer's tool change or finish from what it
    # stored last is written only while the stored data is still that text
    # (`ts_update_message` gains `p_known_digest`), so another tool's edit of an open
    # message - which leaves its version as it was - is never undone. A new argument list
    # is a new function: the old one goes.
    25: """
DROP FUNCTION IF EXISTS ts_update_message(text, text, text, text, bigint, text, boolean, text,
    text, bigint, boolean);
""",
    # The functions again, no table changes: an operation that took a session's lock and
    # ends without claiming or signalling it - a retried submit (`ts_submit`: known), a
    # submit refused or known (`ts_submit_controlled`), a resume of a session not paused
    # (`ts_resume`), a truncate that deleted nothing (`ts_truncate`) - signals it when an
    # acquire waits for it (`ts_signal_waiting`): one that met the lock answered 'busy' and
    # passed the doorbell over until a signal. A session's input count below 0 (another
    # tool's write) is refused, not counted on from (`ts_insert_input` answers 'malformed',
    # the set-wise submit leaves it to the row path), as SQLite refuses it.
    26: "",
    # The functions again, no table changes: a drain's write whose claim is gone (a
    # zombie's, answered lease_lost) took the session's lock and ended without a signal;
    # it signals the session when an acquire waits for it (`ts_lock_execution`, through
    # which every drain's function takes its lock), as version 26's operations do.
    27: "",
    # A cancel's trace keeps no payload: it holds the text a user took back (a pasted card
    # number), and the call id it names already tells its call's retry - which carries the
    # same payload - from any other submit (`ts_known_input` compares it no more). And it
    # lasts its ten minutes whether or not another cancel follows: a recovery pass, which
    # every worker runs periodically, deletes the older ones too (`ts_forget_cancelled`,
    # from `ts_recovery_scan` and `ts_cancel_input`), as this step does now (by the server's
    # clock, the lease clock's). PostgreSQL's alone, as version 19.
    28: """
DELETE FROM session_input_cancelled
    WHERE time_cancelled < floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint - 600000;
ALTER TABLE session_input_cancelled DROP COLUMN payload;
""",
    # As SQLite's version 9: the endings (`ts_finish`, `ts_finish_iterations`) read an
    # execution's maybe-open messages as `finished <> 1`, through the partial index again.
    29: MAYBE_OPEN_INDEX,
    # The functions again, no table changes: a stream's read of the messages it missed
    # (`ts_stream_changes_many`) sends about `NEW_BYTES_PER_READ` of their data and
    # streamed text, not 200 messages whatever their size, as SQLite's read pages them; a
    # delete or purge (`ts_delete_rows`) deletes the claims before their recovery leases,
    # so a lease a recovery scan inserted meanwhile goes too; an interrupt
    # (`ts_request_cancel`), or a submit that interrupts (`ts_submit_controlled`), leaves a
    # quarantined claim to the quarantine's actions.
    30: "",
    # The functions again, no table changes: an interrupt of another owner's claim
    # (`ts_request_cancel`) marks it whether or not its lease ran out (a dead owner's, or one
    # a rolling restart's shutdown handed back), so recovery finishes it as cancelled; a
    # stream's read (`ts_stream_changes_many`) sends at most 1,000 appends, not 5,000.
    31: "",
    # The functions again, no table changes: an interrupt (`ts_request_cancel`), or a submit
    # that interrupts (`ts_submit_controlled`), marks a claim whose lease ran out handed
    # back as well, so every runtime's change look brings the pass that finishes it at once.
    32: "",
}


def _mark_finished_messages(conn: Any) -> None:
    """Version 2: `finished = 1` on the assistant rows whose JSON says so. In Python, as
    `data::jsonb` would abort the migration on a malformed row (kept byte for byte)."""
    finished = []
    with conn.cursor(name="trio_sessions_migrate_finished") as rows:
        rows.execute("SELECT id, data FROM session_message WHERE role = 'assistant'")
        for message_id, data in rows:
            try:
                decoded = _codec.loads(data)
            except (TypeError, ValueError):
                continue
            if isinstance(decoded, dict) and decoded.get("finished") is True:
                finished.append(message_id)
    conn.execute("UPDATE session_message SET finished = 1 WHERE id = ANY(%s)", (finished,))


def _create_functions(conn: Any) -> None:
    """Version 5: the fenced operations as server-side functions (`_store.pg_functions`), in
    the store's schema. A later change to a function is a new version that runs this again
    (CREATE OR REPLACE)."""
    from ._postgres import channel, session_lock_namespace
    from ._store import pg_functions

    schema = conn.execute("SELECT current_schema()").fetchone()[0]
    conn.execute(_RETYPED_FUNCTIONS)
    conn.execute(pg_functions(channel(schema), session_lock_namespace(schema)))


# Functions whose return type changed since a version that created them: every step from 5
# on creates today's functions again, and CREATE OR REPLACE cannot change a return type,
# so the function goes first (and is created again with the others), from any older step.
_RETYPED_FUNCTIONS = """
DROP FUNCTION IF EXISTS ts_delete_session(text, bigint, boolean);
DROP FUNCTION IF EXISTS ts_take_inputs(text, text, text, bigint, bigint, boolean);
"""


# Python steps that follow a PostgreSQL version's SQL, in the same transaction.
POSTGRES_BACKFILLS: dict[int, Callable[[Any], None]] = {
    2: _mark_finished_messages,
    5: _create_functions,
    6: _create_functions,
    7: _create_functions,
    8: _create_functions,
    9: _create_functions,
    10: _create_functions,
    11: _create_functions,
    12: _create_functions,
    13: _create_functions,
    14: _create_functions,
    15: _create_functions,
    16: _create_functions,
    17: _create_functions,
    18: _create_functions,
    19: _create_functions,
    20: _create_functions,
    21: _create_functions,
    22: _create_functions,
    23: _create_functions,
    24: _create_functions,
    25: _create_functions,
    26: _create_functions,
    27: _create_functions,
    28: _create_functions,
    29: _create_functions,
    30: _create_functions,
    31: _create_functions,
    32: _create_functions,
}
