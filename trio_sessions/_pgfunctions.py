"""PostgreSQL server-side functions: each fenced operation as one call (DESIGN §8 "One round
trip per operation").

Every function takes its locks first (the session's advisory lock, or the claim rows' row
locks in id order), then reads the clock - `ts_now(p_now)`: the server's
`clock_timestamp()`, or the test clock the caller passes - then checks its fence and writes.
A refusal is a returned verdict (`ok`, `lease_lost`, ...), never an exception, so a refused
call has written nothing and others in the same transaction stand.

`p_retry` is true when the caller runs the call again after losing its reply in autocommit:
such a function first reads back, by natural key (the message id, the delta's version, the
execution id), whether the lost call landed, and answers as that call did.

Created by the migrations (`_postgres._MIGRATIONS`), in the store's schema, with the
schema's notification channel written in (`ts_signal`).
"""

from __future__ import annotations


def functions(channel: str, lock_namespace: int) -> str:
    """The functions' DDL for a schema whose notification channel is `channel`, with its
    session locks in `lock_namespace` (`pg_advisory_xact_lock(namespace, hashtext(id))`)."""
    literal = "'" + channel.replace("'", "''") + "'"
    return _FUNCTIONS.replace("@LOCK@", str(int(lock_namespace))).replace("@CHANNEL@", literal)


_FUNCTIONS = r"""
CREATE OR REPLACE FUNCTION ts_now(p_now bigint) RETURNS bigint
LANGUAGE sql VOLATILE AS $$
    SELECT COALESCE(p_now, floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint)
$$;

CREATE OR REPLACE FUNCTION ts_lock(p_session text) RETURNS void
LANGUAGE sql VOLATILE AS $$ SELECT pg_advisory_xact_lock(@LOCK@, hashtext(p_session)) $$;

CREATE OR REPLACE FUNCTION ts_signal(p_session text) RETURNS void
LANGUAGE sql VOLATILE AS $$ SELECT pg_notify(@CHANNEL@, p_session) $$;

-- The session lock of an execution's claim (NULL: no claim row carries this id), and the
-- clock read after it.
CREATE OR REPLACE FUNCTION ts_lock_execution(p_exec text, p_now bigint,
    OUT session_id text, OUT now bigint)
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    SELECT c.session_id INTO ts_lock_execution.session_id
        FROM session_execution c WHERE c.id = p_exec;
    IF ts_lock_execution.session_id IS NOT NULL THEN
        PERFORM ts_lock(ts_lock_execution.session_id);
    END IF;
    now := ts_now(p_now);
END $$;

-- The claim fence under the session lock: the exact execution, this owner, a live lease.
CREATE OR REPLACE FUNCTION ts_holds(p_exec text, p_owner text, p_now bigint) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT EXISTS (SELECT 1 FROM session_execution
                   WHERE id = p_exec AND owner_id = p_owner AND expires_at > p_now)
$$;

-- Streamed text onto an open message: one delta row. Verdicts: ok (version), lease_lost,
-- not_streaming (no stream row of this execution: the caller's whole-row path).
CREATE OR REPLACE FUNCTION ts_append_text(p_exec text, p_owner text, p_message text,
    p_text text, p_after bigint, p_now bigint, p_retry boolean,
    OUT verdict text, OUT version bigint)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_session text; v_now bigint; v_base bigint;
BEGIN
    SELECT l.session_id, l.now INTO v_session, v_now FROM ts_lock_execution(p_exec, p_now) l;
    IF v_session IS NULL OR NOT ts_holds(p_exec, p_owner, v_now) THEN
        verdict := 'lease_lost';
        RETURN;
    END IF;
    SELECT s.version INTO v_base FROM session_message_stream s
        WHERE s.message_id = p_message AND s.execution_id = p_exec;
    IF NOT FOUND THEN
        verdict := 'not_streaming';
        RETURN;
    END IF;
    -- A lost reply: the delta after the writer's version, with this text, is this append.
    IF p_retry AND p_after IS NOT NULL AND EXISTS (
            SELECT 1 FROM session_message_delta d WHERE d.message_id = p_message
            AND d.version = p_after + 1 AND d.text = p_text) THEN
        verdict := 'ok';
        version := p_after + 1;
        RETURN;
    END IF;
    INSERT INTO session_message_delta(message_id, version, text)
        SELECT p_message, COALESCE(MAX(d.version), v_base) + 1, p_text
        FROM session_message_delta d WHERE d.message_id = p_message
        RETURNING session_message_delta.version INTO version;
    PERFORM ts_signal(v_session);
    verdict := 'ok';
END $$;

-- An empty, unfinished assistant message open for streaming. Verdicts: ok (seq),
-- lease_lost. Idempotent by message id (a lost reply's retry finds it).
CREATE OR REPLACE FUNCTION ts_begin_assistant(p_exec text, p_owner text, p_message text,
    p_data text, p_now bigint, p_retry boolean, OUT verdict text, OUT seq bigint)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_session text; v_now bigint;
BEGIN
    SELECT l.session_id, l.now INTO v_session, v_now FROM ts_lock_execution(p_exec, p_now) l;
    IF v_session IS NULL OR NOT ts_holds(p_exec, p_owner, v_now) THEN
        verdict := 'lease_lost';
        RETURN;
    END IF;
    verdict := 'ok';
    IF p_retry THEN
        SELECT m.seq INTO seq FROM session_message m
            WHERE m.id = p_message AND m.execution_id = p_exec;
        IF FOUND THEN
            RETURN;
        END IF;
    END IF;
    INSERT INTO session_message(id, session_id, execution_id, role, seq, data, time_created,
            time_updated)
        SELECT p_message, v_session, p_exec, 'assistant', COALESCE(MAX(m.seq), 0) + 1, p_data,
            v_now, v_now
        FROM session_message m WHERE m.session_id = v_session
        RETURNING session_message.seq INTO seq;
    INSERT INTO session_message_stream(message_id, execution_id, version)
        VALUES (p_message, p_exec, 0);
    PERFORM ts_signal(v_session);
END $$;

-- Renew every listed claim of this owner that is still live; the others are lost (phase
-- NULL): an expired lease is never revived. Row locks in id order, then the clock.
CREATE OR REPLACE FUNCTION ts_heartbeat(p_owner text, p_execs text[], p_lease bigint,
    p_now bigint, p_retry boolean)
RETURNS TABLE(execution_id text, phase text)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_now bigint;
BEGIN
    PERFORM 1 FROM session_execution c WHERE c.id = ANY(p_execs)
        ORDER BY c.id FOR NO KEY UPDATE;
    v_now := ts_now(p_now);
    RETURN QUERY
    WITH renewed AS (
        UPDATE session_execution c SET expires_at = v_now + p_lease, heartbeat_at = v_now
        WHERE c.id = ANY(p_execs) AND c.owner_id = p_owner AND c.expires_at > v_now
        RETURNING c.id, c.phase)
    SELECT e.id, r.phase FROM unnest(p_execs) AS e(id) LEFT JOIN renewed r ON r.id = e.id;
END $$;

-- Shutdown: end these claims' leases now (fenced), handed back. Returns how many.
CREATE OR REPLACE FUNCTION ts_expire_claims(p_owner text, p_execs text[], p_now bigint,
    p_retry boolean)
RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_now bigint; v_count bigint;
BEGIN
    PERFORM 1 FROM session_execution c WHERE c.id = ANY(p_execs)
        ORDER BY c.id FOR NO KEY UPDATE;
    v_now := ts_now(p_now);
    UPDATE session_execution c SET expires_at = v_now, handed_back = 1
        WHERE c.id = ANY(p_execs) AND c.owner_id = p_owner AND c.expires_at > v_now;
    GET DIAGNOSTICS v_count = ROW_COUNT;
    RETURN v_count;
END $$;

-- The cancellation made durable (claim fence). Verdicts: ok, lease_lost. Idempotent.
CREATE OR REPLACE FUNCTION ts_mark_cancelling(p_exec text, p_owner text, p_now bigint,
    p_retry boolean)
RETURNS text
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_session text; v_now bigint;
BEGIN
    SELECT l.session_id, l.now INTO v_session, v_now FROM ts_lock_execution(p_exec, p_now) l;
    UPDATE session_execution SET phase = 'cancelling'
        WHERE id = p_exec AND owner_id = p_owner AND expires_at > v_now;
    RETURN CASE WHEN FOUND THEN 'ok' ELSE 'lease_lost' END;
END $$;

-- The end of a busy period or iteration, under the claim fence. p_kind: 'iteration' (take
-- a set doorbell and continue, else release), 'failed' (release; untaken inputs do not
-- re-arm the doorbell) or 'interrupted' (release; re-arm the doorbell if inputs remain).
-- Verdicts: continue, released (doorbell: whether it is set afterwards), lease_lost, or
-- open_messages when the execution left a message open: closing it needs the transcript
-- rules, so the caller takes its own path (nothing was written here).
CREATE OR REPLACE FUNCTION ts_finish(p_exec text, p_owner text, p_kind text, p_now bigint,
    p_retry boolean, OUT verdict text, OUT doorbell boolean)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_session text; v_now bigint; v_woken bigint; v_attempts bigint;
BEGIN
    SELECT l.session_id, l.now INTO v_session, v_now FROM ts_lock_execution(p_exec, p_now) l;
    SELECT s.time_woken, s.wake_attempts INTO v_woken, v_attempts
        FROM session_execution c JOIN session s ON s.id = c.session_id
        WHERE c.id = p_exec AND c.owner_id = p_owner AND c.expires_at > v_now;
    IF NOT FOUND THEN
        verdict := 'lease_lost';
        RETURN;
    END IF;
    IF EXISTS (SELECT 1 FROM session_message m WHERE m.execution_id = p_exec
               AND m.finished = 0 AND m.role = 'assistant') THEN
        verdict := 'open_messages';
        RETURN;
    END IF;
    IF p_kind = 'iteration' AND v_woken IS NOT NULL THEN
        UPDATE session SET time_woken = NULL, wakes = 0 WHERE id = v_session;
        verdict := 'continue';
        doorbell := false;
        RETURN;
    END IF;
    DELETE FROM session_execution WHERE id = p_exec;
    IF v_attempts <> 0 THEN
        UPDATE session SET wake_attempts = 0 WHERE id = v_session;
    END IF;
    IF p_kind = 'interrupted'
            AND EXISTS (SELECT 1 FROM session_input i WHERE i.session_id = v_session) THEN
        PERFORM ts_signal(v_session);
        UPDATE session SET time_woken = COALESCE(time_woken, v_now), wakes = wakes + 1
            WHERE id = v_session;
        v_woken := v_now;
    END IF;
    verdict := 'released';
    doorbell := v_woken IS NOT NULL;
END $$;

-- update_assistant, first half: the message as stored (data, and the texts streamed onto it
-- since, in order) under the claim fence, and the clock read after the lock. Verdicts: ok,
-- lease_lost, not_owned (no such message of this execution).
CREATE OR REPLACE FUNCTION ts_read_message(p_exec text, p_owner text, p_message text,
    p_now bigint, p_retry boolean,
    OUT verdict text, OUT data text, OUT streamed text[], OUT now bigint)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_session text;
BEGIN
    SELECT l.session_id, l.now INTO v_session, now FROM ts_lock_execution(p_exec, p_now) l;
    IF v_session IS NULL OR NOT ts_holds(p_exec, p_owner, now) THEN
        verdict := 'lease_lost';
        RETURN;
    END IF;
    SELECT m.data INTO data FROM session_message m
        WHERE m.id = p_message AND m.execution_id = p_exec;
    IF NOT FOUND THEN
        verdict := 'not_owned';
        RETURN;
    END IF;
    SELECT COALESCE(array_agg(d.text ORDER BY d.version), '{}') INTO streamed
        FROM session_message_delta d WHERE d.message_id = p_message;
    verdict := 'ok';
END $$;

-- update_assistant, second half (and closing an open message): store the complete message,
-- its deltas folded in and dropped, at the next version; an open message keeps its stream
-- row at that version, a finished one loses it. Run after ts_read_message in the same
-- transaction (its lock and its clock `p_at`). Returns the new version.
CREATE OR REPLACE FUNCTION ts_write_message(p_exec text, p_message text, p_data text,
    p_finished boolean, p_at bigint, p_signal boolean, p_now bigint, p_retry boolean)
RETURNS bigint
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_version bigint; v_session text;
BEGIN
    UPDATE session_message m SET data = p_data, finished = p_finished::int, time_updated = p_at,
        version = COALESCE((SELECT MAX(d.version) FROM session_message_delta d
                            WHERE d.message_id = p_message), m.version) + 1
        WHERE m.id = p_message RETURNING m.version, m.session_id INTO v_version, v_session;
    DELETE FROM session_message_delta WHERE message_id = p_message;
    IF p_finished THEN
        DELETE FROM session_message_stream WHERE message_id = p_message;
    ELSE
        INSERT INTO session_message_stream(message_id, execution_id, version)
            VALUES (p_message, p_exec, v_version)
            ON CONFLICT (message_id) DO UPDATE SET version = excluded.version;
    END IF;
    IF p_signal THEN
        PERFORM ts_signal(v_session);
    END IF;
    RETURN v_version;
END $$;

-- Whether an input's payload is certainly a JSON object the library's codec accepts: the
-- fast path of ts_take_inputs takes only such inputs, and leaves every other case (not
-- JSON, not an object, and the few JSON texts Python's codec refuses: floats beyond the
-- double range, nesting deeper than its recursion limit) to the library's own path.
CREATE OR REPLACE FUNCTION ts_json_object(p_payload text) RETURNS boolean
LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    RETURN json_typeof(p_payload::json) = 'object';
EXCEPTION WHEN invalid_text_representation THEN
    RETURN false;
END $$;

CREATE OR REPLACE FUNCTION ts_plain_object(p_payload text) RETURNS boolean
LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    IF p_payload ~ '[0-9][eE]\+?[0-9]{3}' OR p_payload ~ '[0-9]{255}'
            OR length(p_payload) - length(translate(p_payload, '[{', '')) > 500 THEN
        RETURN false;
    END IF;
    IF current_setting('server_version_num')::int < 160000 THEN
        RETURN ts_json_object(p_payload);  -- a subtransaction per input: older servers only
    END IF;
    RETURN pg_input_is_valid(p_payload, 'json') AND json_typeof(p_payload::json) = 'object';
END $$;

-- take_inputs' fast path: every pending input of the claim's session becomes a user message
-- of this execution, in seq order, if each is a plain JSON object (ts_plain_object).
-- Rows: first (verdict, NULL, NULL) - ok, lease_lost, or mixed (nothing written: the
-- caller's own path sets the others aside) - then (NULL, input id, payload) per input
-- taken. Not idempotent: a lost reply is read back by the transaction's id.
CREATE OR REPLACE FUNCTION ts_take_inputs(p_exec text, p_owner text, p_now bigint,
    p_retry boolean)
RETURNS TABLE(verdict text, input_id text, payload text)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_session text; v_now bigint; v_seq bigint;
BEGIN
    SELECT l.session_id, l.now INTO v_session, v_now FROM ts_lock_execution(p_exec, p_now) l;
    IF v_session IS NULL OR NOT ts_holds(p_exec, p_owner, v_now) THEN
        RETURN QUERY SELECT 'lease_lost', NULL::text, NULL::text;
        RETURN;
    END IF;
    IF EXISTS (SELECT 1 FROM session_input i WHERE i.session_id = v_session
               AND NOT ts_plain_object(i.payload)) THEN
        RETURN QUERY SELECT 'mixed', NULL::text, NULL::text;
        RETURN;
    END IF;
    SELECT COALESCE(MAX(m.seq), 0) INTO v_seq FROM session_message m
        WHERE m.session_id = v_session;
    RETURN QUERY SELECT 'ok', NULL::text, NULL::text;
    RETURN QUERY
    WITH taken AS (
        DELETE FROM session_input i WHERE i.session_id = v_session
        RETURNING i.id, i.seq, i.payload),
    ordered AS (
        SELECT t.id, t.payload, v_seq + row_number() OVER (ORDER BY t.seq) AS seq FROM taken t),
    added AS (
        INSERT INTO session_message(id, session_id, execution_id, input_id, role, seq, data,
                time_created, time_updated, finished)
            SELECT lpad(to_hex(v_now), 12, '0')
                    || substr(md5(random()::text || clock_timestamp()::text || o.id), 1, 20),
                v_session, p_exec, o.id, 'user', o.seq, o.payload, v_now, v_now, 1
            FROM ordered o
            RETURNING session_message.input_id, session_message.data, session_message.seq)
    SELECT NULL::text, a.input_id, a.data FROM added a ORDER BY a.seq;
    IF FOUND THEN
        PERFORM ts_signal(v_session);
    END IF;
END $$;

-- Under the session lock: is the input id stored (pending, taken or set aside)? NULL: no;
-- known (same session, same payload text); other_session; other_payload (the caller
-- compares the payloads as JSON values).
CREATE OR REPLACE FUNCTION ts_known_input(p_session text, p_input text, p_payload text)
RETURNS text
LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_session text; v_payload text;
BEGIN
    SELECT k.session_id, k.payload INTO v_session, v_payload FROM (
        SELECT i.session_id, i.payload FROM session_input i WHERE i.id = p_input
        UNION ALL SELECT m.session_id, m.data FROM session_message m WHERE m.input_id = p_input
        UNION ALL SELECT r.session_id, r.payload FROM session_input_rejected r
            WHERE r.id = p_input
        LIMIT 1) k;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    RETURN CASE WHEN v_session <> p_session THEN 'other_session'
                WHEN v_payload = p_payload THEN 'known' ELSE 'other_payload' END;
END $$;

-- Store a pending input; p_ring: set the doorbell and count the wake (false when a claim
-- inserted in the same call takes the wake at once). Returns the session's doorbell and
-- resume count as they are now.
CREATE OR REPLACE FUNCTION ts_insert_input(p_session text, p_payload text, p_input text,
    p_ring boolean, p_at bigint, OUT time_woken bigint, OUT wake_attempts bigint)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_seq bigint; v_doorbell bigint := CASE WHEN p_ring THEN p_at END;
BEGIN
    IF p_ring THEN
        PERFORM ts_signal(p_session);
    END IF;
    INSERT INTO session AS s (id, time_created, time_woken, wakes, input_seq)
        VALUES (p_session, p_at, v_doorbell, p_ring::int, 1)
        ON CONFLICT (id) DO UPDATE SET time_woken = COALESCE(s.time_woken, v_doorbell),
            wakes = s.wakes + p_ring::int, input_seq = s.input_seq + 1
        RETURNING s.input_seq, s.time_woken, s.wake_attempts
        INTO v_seq, ts_insert_input.time_woken, ts_insert_input.wake_attempts;
    INSERT INTO session_input(id, session_id, seq, payload, time_created)
        VALUES (p_input, p_session, v_seq, p_payload, p_at);
END $$;

-- Under the session lock: insert the claim only if no claim row exists for the session
-- (never an overwrite) and the doorbell is set (p_doorbell: the caller rang it in this same
-- call), and take the doorbell. Verdicts: claim (attempt), held (holder), no_doorbell. A
-- claim row carrying this very execution id is this call's own, landed before a lost reply.
CREATE OR REPLACE FUNCTION ts_acquire_locked(p_session text, p_exec text, p_owner text,
    p_lease bigint, p_at bigint, p_doorbell boolean,
    OUT verdict text, OUT attempt bigint, OUT holder text)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_claim text; v_woken bigint;
BEGIN
    SELECT c.id, c.owner_id INTO v_claim, holder FROM session_execution c
        WHERE c.session_id = p_session;
    IF FOUND THEN
        IF v_claim = p_exec THEN
            verdict := 'claim';
            holder := NULL;
            SELECT s.wake_attempts INTO attempt FROM session s WHERE s.id = p_session;
        ELSE
            verdict := 'held';
        END IF;
        RETURN;
    END IF;
    SELECT s.time_woken, s.wake_attempts INTO v_woken, attempt FROM session s
        WHERE s.id = p_session;
    IF NOT FOUND OR (v_woken IS NULL AND NOT p_doorbell) THEN
        verdict := 'no_doorbell';
        attempt := NULL;
        RETURN;
    END IF;
    INSERT INTO session_execution(id, session_id, owner_id, phase, anchor_seq, time_created,
            heartbeat_at, expires_at)
        VALUES (p_exec, p_session, p_owner, 'running',
            (SELECT MAX(m.seq) FROM session_message m WHERE m.session_id = p_session),
            p_at, NULL, p_at + p_lease);
    IF v_woken IS NOT NULL THEN
        UPDATE session SET time_woken = NULL, wakes = 0 WHERE id = p_session;
    END IF;
    verdict := 'claim';
END $$;

-- submit: store the input and ring the doorbell, idempotently by input id. Verdicts:
-- stored, known, other_session, other_payload (ts_known_input; nothing written).
CREATE OR REPLACE FUNCTION ts_submit(p_session text, p_payload text, p_input text,
    p_now bigint, p_retry boolean)
RETURNS text
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_now bigint; v_known text;
BEGIN
    PERFORM ts_lock(p_session);
    v_now := ts_now(p_now);
    v_known := ts_known_input(p_session, p_input, p_payload);
    IF v_known IS NOT NULL THEN
        RETURN v_known;
    END IF;
    PERFORM ts_insert_input(p_session, p_payload, p_input, true, v_now);
    RETURN 'stored';
END $$;

-- acquire (see ts_acquire_locked). Idempotent by execution id.
CREATE OR REPLACE FUNCTION ts_acquire(p_session text, p_exec text, p_owner text,
    p_lease bigint, p_now bigint, p_retry boolean,
    OUT verdict text, OUT attempt bigint, OUT holder text)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_now bigint;
BEGIN
    PERFORM ts_lock(p_session);
    v_now := ts_now(p_now);
    SELECT a.verdict, a.attempt, a.holder INTO verdict, attempt, holder
        FROM ts_acquire_locked(p_session, p_exec, p_owner, p_lease, v_now, false) a;
END $$;

-- submit and the acquire it rings for, in one call: when the claim is taken here the
-- doorbell is rung and taken at once, so it is never written. Input verdicts as ts_submit
-- (other_*: nothing written, no acquire); then the acquire's. Idempotent by input id and
-- execution id.
CREATE OR REPLACE FUNCTION ts_submit_and_acquire(p_session text, p_payload text,
    p_input text, p_exec text, p_owner text, p_lease bigint, p_now bigint, p_retry boolean,
    OUT input_verdict text, OUT verdict text, OUT attempt bigint, OUT holder text)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_now bigint; v_held boolean;
BEGIN
    PERFORM ts_lock(p_session);
    v_now := ts_now(p_now);
    input_verdict := ts_known_input(p_session, p_input, p_payload);
    IF input_verdict IN ('other_session', 'other_payload') THEN
        RETURN;
    END IF;
    v_held := EXISTS (SELECT 1 FROM session_execution c WHERE c.session_id = p_session);
    IF input_verdict IS NULL THEN
        -- Rung only if a claim already holds the session: else the claim below takes it.
        PERFORM ts_insert_input(p_session, p_payload, p_input, v_held, v_now);
        input_verdict := 'stored';
    END IF;
    SELECT a.verdict, a.attempt, a.holder INTO verdict, attempt, holder
        FROM ts_acquire_locked(p_session, p_exec, p_owner, p_lease, v_now,
                               input_verdict = 'stored') a;
END $$;

-- wake: the durable doorbell (create the session if absent, set time_woken, count it).
CREATE OR REPLACE FUNCTION ts_wake(p_session text, p_now bigint, p_retry boolean)
RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_now bigint;
BEGIN
    PERFORM ts_lock(p_session);
    v_now := ts_now(p_now);
    PERFORM ts_signal(p_session);
    INSERT INTO session AS s (id, time_created, time_woken, wakes)
        VALUES (p_session, v_now, v_now, 1)
        ON CONFLICT (id) DO UPDATE SET time_woken = COALESCE(s.time_woken, v_now),
            wakes = s.wakes + 1;
END $$;

-- wake and the acquire it rings for: a claim taken here takes the wake at once.
CREATE OR REPLACE FUNCTION ts_wake_and_acquire(p_session text, p_exec text, p_owner text,
    p_lease bigint, p_now bigint, p_retry boolean,
    OUT verdict text, OUT attempt bigint, OUT holder text)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    v_now bigint;
BEGIN
    PERFORM ts_lock(p_session);
    v_now := ts_now(p_now);
    IF EXISTS (SELECT 1 FROM session_execution c WHERE c.session_id = p_session
               AND c.id <> p_exec) THEN
        PERFORM ts_signal(p_session);
        INSERT INTO session AS s (id, time_created, time_woken, wakes)
            VALUES (p_session, v_now, v_now, 1)
            ON CONFLICT (id) DO UPDATE SET time_woken = COALESCE(s.time_woken, v_now),
                wakes = s.wakes + 1;
    ELSE
        INSERT INTO session(id, time_created) VALUES (p_session, v_now)
            ON CONFLICT (id) DO NOTHING;
    END IF;
    SELECT a.verdict, a.attempt, a.holder INTO verdict, attempt, holder
        FROM ts_acquire_locked(p_session, p_exec, p_owner, p_lease, v_now, true) a;
END $$;
"""
