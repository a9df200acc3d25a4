"""Naming the store (DESIGN §8, §6.27): the store a caller names is the store used.

A path is an SQLite file and a postgresql:// or postgres:// URL a PostgreSQL database;
anything else that looks like a connection string is a `ValueError` naming the accepted
forms, from `open_runtime`, the worker command and every CLI command alike - never a file
named after it. PostgreSQL schema names are validated when the store is named, so two
different names never share tables.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

import trio_sessions
from trio_sessions import _cli, _worker

SECRET = "Zq7SECRETpw"
ACCEPTED = "a path (SQLite), a postgresql:// or postgres:// URL (PostgreSQL), or a store object"

# Each is a connection string in another form than the two URLs we accept.
LOOKALIKES = [
    f"host=127.0.0.1 port=1 dbname=app user=app password={SECRET}",
    f"  dbname=app password={SECRET}",
    f"user=app password='{SECRET}' host=127.0.0.1",
    f"postgresql+psycopg://app:{SECRET}@127.0.0.1:1/app",
    f"postgresql+asyncpg://app:{SECRET}@127.0.0.1:1/app",
    f"mysql://app:{SECRET}@127.0.0.1:1/app",
    "sqlite:///var/lib/app/sessions.db",
    f"HTTP://app:{SECRET}@127.0.0.1:1/app",
    # JDBC URLs (Java's form, common in shared configuration): no scheme of RFC 3986, so
    # they were taken for paths - a file created, or a "no such file" error quoting the
    # password.
    f"jdbc:postgresql://127.0.0.1:1/app?user=app&password={SECRET}",
    f"jdbc:postgresql://app:{SECRET}@127.0.0.1:1/app",
    "jdbc:postgresql:app",
    "JDBC:sqlite:/var/lib/app/sessions.db",
    # SQLite's own URI form: where sqlite3 is built with SQLITE_USE_URI (Debian's is) the
    # driver opened `sessions.db` while the library created and watched `file:sessions.db`.
    "file:sessions.db",
    "file:sessions.db?mode=rwc",
    # A URL with its quotes kept (docker's --env-file keeps them): a path whose "no such
    # file" error quoted the password.
    f'"postgresql://app:{SECRET}@127.0.0.1:1/app"',
    f"'postgres://app:{SECRET}@127.0.0.1:1/app'",
    f'"jdbc:postgresql://app:{SECRET}@127.0.0.1:1/app"',
    # A libpq DSN with its quotes kept likewise (review revB53): an SQLite file named after
    # it, password and all, was created in the working directory.
    f'"host=127.0.0.1 port=1 dbname=app user=app password={SECRET}"',
]


async def drain(ctx: trio_sessions.DrainContext) -> None:
    await ctx.take_inputs()


@pytest.fixture
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The test's working directory, empty: where a misnamed SQLite file would appear."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def created(directory: Path) -> list[str]:
    return sorted(os.listdir(directory))


@pytest.mark.parametrize("name", LOOKALIKES)
async def test_open_runtime_refuses_a_connection_string_and_creates_nothing(
    name: str, in_tmp: Path
) -> None:
    """`open_runtime("host=... password=...")` (and other non-URL forms) raises ValueError
    naming the accepted forms, without the password, and no file appears."""
    with pytest.raises(ValueError, match="a store is") as raised:
        async with trio_sessions.open_runtime(name, drain):
            pytest.fail("the runtime opened")  # pragma: no cover
    assert ACCEPTED in str(raised.value)
    assert SECRET not in str(raised.value)
    assert created(in_tmp) == []


@pytest.mark.parametrize("name", LOOKALIKES[:2])
async def test_open_runtime_refuses_a_connection_string_given_as_a_path_object(
    name: str, in_tmp: Path
) -> None:
    """A DSN wrapped in a PathLike is still a DSN, not a file name."""
    with pytest.raises(ValueError, match=re.escape(ACCEPTED)):
        async with trio_sessions.open_runtime(Path(name.strip()), drain):
            pytest.fail("the runtime opened")  # pragma: no cover
    assert created(in_tmp) == []


@pytest.mark.parametrize("name", ["host=x.db", "jdbc:x.db", "file:x.db"])
async def test_a_path_object_named_like_a_connection_string_gets_advice_a_path_can_follow(
    name: str, in_tmp: Path
) -> None:
    """`Path("./host=x.db")` is `Path("host=x.db")` (pathlib drops the `./`), so the
    advice to write the name as `./host=...` cannot be followed with a path object: the
    error says how (its absolute form), and that form opens the file (§6.27 still refuses
    the name itself: a DSN wrapped in a path object stays a DSN). Found by an audit."""
    with pytest.raises(ValueError, match=re.escape(".absolute()")):
        async with trio_sessions.open_runtime(Path("./" + name), None):
            pytest.fail("the runtime opened")  # pragma: no cover
    assert created(in_tmp) == []
    async with trio_sessions.open_runtime(in_tmp / name, None) as producer:  # absolute
        await producer.submit("s", {"text": "hi"})
    assert created(in_tmp) == [name]


async def test_open_runtime_still_takes_paths_and_store_objects(in_tmp: Path) -> None:
    """Relative and absolute paths (also ones holding '=' past their start), a PathLike and
    a store object open SQLite files as before."""
    names: list[str | Path] = ["plain.db", str(in_tmp / "abs=1.db"), "./dbname=x.db", Path("p.db")]
    for name in names:
        async with trio_sessions.open_runtime(name, None) as runtime:
            await runtime.submit("s", {"text": "hi"})
    store = trio_sessions.SQLiteStore(in_tmp / "object.db")
    async with trio_sessions.open_runtime(store, None) as runtime:
        await runtime.submit("s", {"text": "hi"})
    files = set(created(in_tmp))
    assert {"plain.db", "abs=1.db", "dbname=x.db", "p.db", "object.db"} <= files
    assert all(name.endswith((".db", "-wal", "-shm")) for name in files)


def test_open_runtime_refuses_a_store_of_another_type() -> None:
    """Neither a name nor a store object: TypeError naming the accepted forms."""
    with pytest.raises(TypeError, match="a path"):
        trio.run(_open, 42)


async def _open(store: Any) -> None:
    async with trio_sessions.open_runtime(store, drain):
        pass  # pragma: no cover


def parse(*argv: str) -> Any:
    return _cli.build_parser().parse_args(["worker", "m:drain", *argv])


@pytest.mark.parametrize("name", LOOKALIKES)
def test_worker_refuses_a_connection_string_as_a_usage_error(
    name: str, in_tmp: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`worker --store "host=..."` (or from TRIO_SESSIONS_STORE) exits 2 naming the
    accepted forms, without the password, before loading the drain or creating a file."""
    assert _worker.run(parse("--store", name), {}) == 2
    err = capsys.readouterr().err
    assert ACCEPTED in err and SECRET not in err
    assert _worker.run(parse(), {_worker.ENV_STORE: name}) == 2
    err = capsys.readouterr().err
    assert ACCEPTED in err and SECRET not in err
    with pytest.raises(_worker.UsageError, match=re.escape(ACCEPTED)):
        _worker.settings_from(parse("--store", name), {})
    assert created(in_tmp) == []


COMMANDS = [
    ["status"],
    ["quarantine", "list"],
    ["quarantine", "release", "{db}", "exec-1", "--drop"],
    ["inputs", "list"],
    ["inputs", "drop", "{db}", "input-1"],
    ["health"],
    ["health", "--json"],
]


def argv(command: list[str], db: str) -> list[str]:
    if "{db}" in command:
        return [db if part == "{db}" else part for part in command]
    return (
        [*command[:2], db, *command[2:]]
        if command[0] in ("quarantine", "inputs")
        else [
            command[0],
            db,
            *command[1:],
        ]
    )


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c))
@pytest.mark.parametrize("name", LOOKALIKES[:1] + LOOKALIKES[3:5])
def test_every_cli_command_refuses_a_connection_string(
    command: list[str], name: str, in_tmp: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each operator command given a DSN or a foreign URL is a usage error (exit 2) naming
    the accepted forms; the password is not printed and nothing is created."""
    with pytest.raises(SystemExit) as exited:
        _cli.main(argv(command, name))
    assert exited.value.code == 2
    out, err = capsys.readouterr()
    assert ACCEPTED in err
    assert SECRET not in out + err
    assert created(in_tmp) == []


# ---------------------------------------------------------------------------------------------
# Schema names


BAD_SCHEMAS: list[tuple[object, type[Exception], str]] = [
    (123, TypeError, "schema must be a str"),
    (None, TypeError, "schema must be a str"),
    (b"tenant", TypeError, "schema must be a str"),
    ("", ValueError, "1-63 bytes"),
    ("a" * 64, ValueError, "1-63 bytes"),
    ("é" * 32, ValueError, "1-63 bytes"),  # 32 characters, 64 bytes in UTF-8
    ("1tenant", ValueError, "identifier"),
    ("ten-ant", ValueError, "identifier"),
    ("ten ant", ValueError, "identifier"),
    ('ten"ant', ValueError, "identifier"),
    ("tenant;drop", ValueError, "identifier"),
    ("pg_catalog", ValueError, "reserved"),
    ("pg_temp", ValueError, "reserved"),
    ("pg_tenant", ValueError, "reserved"),
    ("PG_tenant", ValueError, "reserved"),
    ("information_schema", ValueError, "reserved"),
    ("Information_Schema", ValueError, "reserved"),
]


@pytest.mark.parametrize(("schema", "error", "reason"), BAD_SCHEMAS)
def test_a_bad_schema_name_is_refused_when_the_store_is_named(
    schema: object, error: type[Exception], reason: str
) -> None:
    """PostgresStore(schema=...) refuses a non-str (TypeError) and an empty, too long (over
    63 bytes in UTF-8), non-identifier or reserved name (ValueError), before connecting."""
    from trio_sessions._postgres import PostgresStore

    with pytest.raises(error, match=reason):
        PostgresStore("postgresql://app@127.0.0.1:1/app", schema=schema)  # type: ignore[arg-type]


@pytest.mark.parametrize("schema", ["public", "tenant_1", "Tenant", "_x", "a" * 63, "é" * 31])
def test_a_valid_schema_name_is_accepted(schema: str) -> None:
    """1-63 bytes, an identifier, not reserved: accepted as given."""
    from trio_sessions._postgres import PostgresStore

    assert PostgresStore("postgresql://app@127.0.0.1:1/app", schema=schema).schema == schema


@pytest.mark.parametrize("schema", ["", "a" * 64, "1x", "pg_x", "information_schema"])
def test_cli_and_worker_refuse_a_bad_schema_as_a_usage_error(
    schema: str, in_tmp: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--schema` of the operator CLI and of the worker (and TRIO_SESSIONS_SCHEMA) is
    validated as PostgresStore validates it: exit 2, nothing contacted."""
    url = "postgresql://app@127.0.0.1:1/app"
    with pytest.raises(SystemExit) as exited:
        _cli.main(["status", url, "--schema", schema])
    assert exited.value.code == 2
    assert "schema" in capsys.readouterr().err
    assert _worker.run(parse("--store", url, "--schema", schema), {}) == 2
    assert "schema" in capsys.readouterr().err
    if schema:  # an empty variable means "not set"
        assert _worker.run(parse("--store", url), {_worker.ENV_SCHEMA: schema}) == 2
        assert "schema" in capsys.readouterr().err
    assert created(in_tmp) == []


@pytest.fixture
def schema_names(pg_url: str) -> Iterator[list[str]]:
    """Distinct valid schema names that a 63-byte truncation or case folding would merge;
    dropped after the test."""
    import psycopg
    from psycopg import sql

    stem = f"t{uuid.uuid4().hex[:10]}"
    long = stem + "x" * (62 - len(stem))
    names = [long + "a", long + "b", stem + "Case", stem + "case", stem + "é" * 20]
    assert all(len(name.encode()) <= 63 for name in names)
    yield names
    with psycopg.connect(pg_url, autocommit=True) as conn:
        for name in names:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))


async def test_two_distinct_schema_names_never_share_tables(
    pg_url: str, schema_names: list[str]
) -> None:
    """Each valid name is its own store with its own signal channel: a session submitted
    under one is not seen under any other (names equal in their first 62 bytes, names
    differing in case, non-ASCII names)."""
    from trio_sessions._postgres import PostgresStore, channel

    assert len({channel(name) for name in schema_names}) == len(schema_names)
    for index, name in enumerate(schema_names):
        async with trio_sessions.open_runtime(PostgresStore(pg_url, schema=name), None) as rt:
            await rt.submit(f"s{index}", {"text": name})
    for index, name in enumerate(schema_names):
        assert sessions_in(pg_url, name) == [f"s{index}"]


def sessions_in(pg_url: str, schema: str) -> list[str]:
    import psycopg
    from psycopg import sql

    statement = sql.SQL("SELECT id FROM {}.session ORDER BY id").format(sql.Identifier(schema))
    with psycopg.connect(pg_url) as conn:
        return [row[0] for row in conn.execute(statement).fetchall()]


def test_names_the_server_would_truncate_are_refused() -> None:
    """Two names equal in their first 63 bytes would share tables: both are refused."""
    from trio_sessions._postgres import PostgresStore

    for name in ("x" * 63 + "a", "x" * 63 + "b", "é" * 31 + "ab"):
        with pytest.raises(ValueError, match="1-63 bytes"):
            PostgresStore("postgresql://app@127.0.0.1:1/app", schema=name)


@pytest.mark.parametrize(
    "url", [f"postgresql+psycopg://app:{SECRET}@127.0.0.1:1/app", "mysql://a@b/c", "sessions.db"]
)
def test_postgres_store_refuses_what_is_neither_a_url_nor_a_dsn(url: str) -> None:
    """PostgresStore takes a postgresql:// or postgres:// URL or a libpq key=value string
    (or "" for libpq's environment defaults); anything else is a ValueError without the
    password."""
    from trio_sessions._postgres import PostgresStore

    with pytest.raises(ValueError, match="not a postgresql:// or postgres:// URL") as raised:
        PostgresStore(url)
    assert SECRET not in str(raised.value)


# What libpq cannot read as written: it stops at a NUL (the rest ignored, or a password's
# start read as the port and quoted in its error) and takes no text that is not UTF-8.
UNREADABLE_URLS = [
    f"postgresql://app:{SECRET}\x00rest@127.0.0.1:1/app",
    "postgresql://app@127.0.0.1:1/app\x00ignored",
    f"host=127.0.0.1 port=1 password={SECRET}\x00rest",
    f"postgresql://app:{SECRET}@127.0.0.1:1/app\udcff",
    f"host=127.0.0.1 port=1 dbname=\udcff password={SECRET}",
]


@pytest.mark.parametrize("url", UNREADABLE_URLS)
def test_postgres_store_refuses_a_url_libpq_cannot_read_as_written(url: str) -> None:
    """A NUL character or a lone surrogate (bytes that are not UTF-8) in a URL or DSN is a
    ValueError when the store is named, naming the character and not the password."""
    from trio_sessions._postgres import PostgresStore

    with pytest.raises(ValueError, match=r"NUL character|lone surrogate") as raised:
        PostgresStore(url)
    assert SECRET not in str(raised.value)


@pytest.mark.parametrize("url", UNREADABLE_URLS[::3])
@pytest.mark.parametrize("command", [["status"], ["health"]], ids=lambda c: " ".join(c))
def test_cli_refuses_a_url_libpq_cannot_read_as_written(
    command: list[str], url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The operator commands report such a URL as a usage error (exit 2), not a traceback,
    and print no password."""
    with pytest.raises(SystemExit) as exited:
        _cli.main(argv(command, url))
    assert exited.value.code == 2
    out, err = capsys.readouterr()
    assert "NUL character" in err or "lone surrogate" in err
    assert "Traceback" not in err
    assert SECRET not in out + err


@pytest.mark.parametrize(
    "url", ["postgres://app@127.0.0.1:1/app", "host=127.0.0.1 port=1 dbname=app", ""]
)
def test_postgres_store_takes_urls_dsns_and_the_environment(url: str) -> None:
    """The forms psycopg itself takes are accepted as given."""
    from trio_sessions._postgres import PostgresStore

    assert PostgresStore(url).url == url


def test_an_sqlite_store_takes_a_pathlike_whose_name_has_an_equals_sign(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`SQLiteStore(path)` says SQLite explicitly, and an `os.PathLike` is a file system path
    by definition: `Path("run=1.db")` (a `key=value` run directory, as Hydra names them) is a
    file. d04bcb6's `check_sqlite_path` runs `store_kind` on it and refuses it as "a libpq
    connection string", whose advice - write it `./run=1.db` - pathlib cannot follow
    (`Path("./run=1.db")` is `run=1.db` again). It opened before; only `open_runtime(str)`
    has to guess."""
    monkeypatch.chdir(tmp_path)
    assert str(Path("./run=1.db")) == "run=1.db"
    store = trio_sessions.SQLiteStore(Path("./run=1.db"))
    assert Path(store.path) == Path("run=1.db")


@pytest.mark.parametrize(
    "url", [f"postgresql://app:{SECRET}@127.0.0.1:1/app", f"postgres://app:{SECRET}@db/app"]
)
def test_an_sqlite_store_refuses_a_postgres_url_and_creates_nothing(url: str, in_tmp: Path) -> None:
    """§6.27: a PostgreSQL URL given to `SQLiteStore` - the wrong class - is a `ValueError`
    that names the right one, with the password masked; never a store whose open creates an
    SQLite file named after the URL (the application would run on an empty local file, its
    password in the name)."""
    with pytest.raises(ValueError, match="is a PostgreSQL URL, no SQLite file") as raised:
        trio_sessions.SQLiteStore(url)
    assert SECRET not in str(raised.value)
    assert created(in_tmp) == []


async def test_an_sqlite_store_named_like_an_sqlite_uri_by_a_pathlike_is_that_file(
    in_tmp: Path,
) -> None:
    """§6.27 for a path object, which names a file whatever its name holds: the file
    `file:x.db` (pathlib turns `./file:x.db` back into `file:x.db`) is the store, and the
    only one. The library created `file:x.db` 0600 and watched it, while every driver
    connection - where sqlite3 reads `file:` names as URIs, as Debian's does - opened
    `x.db`, a second database, created 0644: writes and the file checks went to two
    different files."""
    store = trio_sessions.SQLiteStore(Path("./file:x.db"))
    async with trio_sessions.open_runtime(store, None) as producer:
        await producer.submit("s", {"text": "hi"})
    assert created(in_tmp) == ["file:x.db"]
    assert (in_tmp / "file:x.db").stat().st_mode & 0o777 == 0o600
    async with trio_sessions.open_runtime(trio_sessions.SQLiteStore(Path("file:x.db")), None):
        pass
    assert created(in_tmp) == ["file:x.db"]
