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
"""
