"""Naming the store (DESIGN §8, §6.27): which backend a name means, how a name is shown,
and which PostgreSQL schema names are allowed. Pure: no I/O, no driver import.

Invariants:
* `store_kind` is the one decision between a path and a URL, for `open_runtime`, the worker
  command and the operator CLI: a `postgresql://` or `postgres://` URL is PostgreSQL, any
  other path is SQLite, and anything else that looks like a connection string (a libpq
  `key=value` DSN, `postgresql+psycopg://`, another `scheme://`, a JDBC URL, an SQLite
  `file:` URI) is a `ValueError` - never a file named after it;
* `mask_password` is the one way a store name, or any text that may hold one (a driver's
  error), is shown: the password is gone whatever the form (`user:pw@`, `?password=`,
  percent-encoded, a DSN's `password=`), and a URL that libpq would read differently from
  what its writer meant (an unquoted `@` or `/` in the password) is refused by
  `check_postgres_name`, so no piece of a password ever reaches the driver as a host, a
  port or a database name that an error would quote;
* `check_schema` accepts exactly the names the server keeps as given (1-63 bytes in UTF-8,
  an identifier, not reserved), so two different names are always two different schemas.
"""

from __future__ import annotations

import os
import re
import urllib.parse
from typing import Literal

POSTGRES_SCHEMES = ("postgresql://", "postgres://")
ACCEPTED_FORMS = (
    "a path (SQLite), a postgresql:// or postgres:// URL (PostgreSQL), or a store object"
)
MASK = "***"

# `scheme://` at the start of a name: a URL (RFC 3986 scheme characters).
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
# A libpq connection string starts with `keyword=` (`host=... dbname=...`).
_DSN = re.compile(r"\s*[A-Za-z_][A-Za-z0-9_]*\s*=")
# A JDBC URL (`jdbc:postgresql://host/db`, `jdbc:postgresql:db`): Java's connection string,
# common in shared configuration. Its `jdbc:` prefix is no scheme `_URL` sees, so it would
# name a file (created, or a "no such file" error quoting its password).
_JDBC = re.compile(r"\s*jdbc:", re.IGNORECASE)
# An SQLite URI (`file:sessions.db?mode=ro`): SQLite reads a name that starts with `file:`
# as one where it is built with SQLITE_USE_URI, and as a file of that name elsewhere.
_SQLITE_URI = re.compile(r"file:")
# What may be left around a URL pasted from a configuration file: quotes, angle brackets.
_AROUND = "'\"`<>"


def store_kind(store: str | os.PathLike[str]) -> Literal["sqlite", "postgres"]:
    """Which backend a store name means; `ValueError` naming the accepted forms for a
    connection string of any other form (the name is shown with its password masked).

    A path that starts with `word=` reads as a DSN, one that starts with `jdbc:` or `file:`
    as a JDBC URL or an SQLite URI: write it `./word=...`, `./jdbc:...`, `./file:...` (a
    `Path`, which drops the `./`, in its absolute form).
    """
    if not isinstance(store, str | os.PathLike):
        raise TypeError(f"store must be {ACCEPTED_FORMS}, got {type(store).__name__}")
    name = os.fspath(store)
    if not isinstance(name, str):
        raise TypeError(f"store must be {ACCEPTED_FORMS}, got bytes")
    # A URL with space or quotes around it (an environment file's quotes kept as text) is
    # still a connection string, whose "no such file" error would quote its password.
    bare = name.strip().strip(_AROUND)
    if bare != name and (_URL.match(bare) or _JDBC.match(bare)):
        raise ValueError(
            f"store {display_name(name)!r} is a URL with quotes or space around it; a store"
            f" is {ACCEPTED_FORMS}"
        )
    if name.startswith(POSTGRES_SCHEMES):
        check_postgres_name(name)
        return "postgres"
    if _URL.match(name):
        scheme = name.split("://", 1)[0]
        raise ValueError(
            f"store {display_name(name)!r} is a {scheme}:// URL; a store is {ACCEPTED_FORMS}"
        )
    if _JDBC.match(name):
        raise ValueError(
            f"store {display_name(name)!r} is a JDBC URL; a store is {ACCEPTED_FORMS}"
            + _written_as("jdbc:")
        )
    if _SQLITE_URI.match(name):
        raise ValueError(
            f"store {display_name(name)!r} is an SQLite URI; a store is {ACCEPTED_FORMS}"
            + _written_as("file:")
        )
    if _DSN.match(bare):  # quotes kept around one as well: a file named after it otherwise
        raise ValueError(  # not shown: where a malformed one's password ends is unknown
            "store looks like a libpq connection string (key=value);"
            f" a store is {ACCEPTED_FORMS}" + _written_as("word=")
        )
    return "sqlite"


def _written_as(start: str) -> str:
    """How to name a file whose name starts like a connection string: pathlib drops a
    leading `./`, so a `Path` can say it only in its absolute form."""
    return (
        f" - write a file whose name starts with {start!r} as './{start}...'"
        " (a pathlib.Path drops the './': pass Path(...).absolute())"
    )


# The names SQLite opens as a private in-memory database: no file, nothing that another
# connection - let alone another process - can share.
IN_MEMORY_NAMES = ("", ":memory:")


def check_sqlite_path(path: object) -> str | os.PathLike[str]:
    """An SQLite store's path as `SQLiteStore` takes it: a str or an `os.PathLike` of one
    (`TypeError` else), no connection string (`ValueError`, its password masked: a file
    named after it would be created), holding no NUL and no lone surrogate (`ValueError`:
    SQLite gives a database's file name back as UTF-8 text, and a name whose bytes are not
    UTF-8 - how Python spells such a one - would be created, then fail the first read)."""
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"store path must be a str or an os.PathLike, got {type(path).__name__}")
    name = os.fspath(path)
    if not isinstance(name, str):
        raise TypeError(f"store path must be a str or an os.PathLike, got {type(name).__name__}")
    # A str may be a connection string given to the wrong class (and a ValueError for one
    # of another form); a PathLike names a file, whatever its name holds ("run=1.db").
    if isinstance(path, str) and store_kind(name) == "postgres":
        raise ValueError(
            f"store path {display_name(name)!r} is a PostgreSQL URL, no SQLite file: pass it"
            " to PostgresStore (or to open_runtime as it is)"
        )
    _refuse_nul_or_surrogate(
        name,
        f"store path {name!r}",
        ": SQLite names its database files in UTF-8, so it cannot be a store; rename the file",
    )
    return path


def _refuse_nul_or_surrogate(name: str, shown: str, surrogate_note: str = "") -> None:
    """`ValueError` naming `shown` for a NUL character or a lone surrogate (bytes that are
    not UTF-8, as Python spells them) in `name`: no store name can hold either."""
    if "\x00" in name:
        raise ValueError(f"{shown} holds a NUL character")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(
            f"{shown} holds a lone surrogate (bytes that are not UTF-8){surrogate_note}"
        ) from None


def check_file_store(path: str | os.PathLike[str]) -> None:
    """`ValueError` for a name SQLite opens as a private in-memory database (`""`,
    `":memory:"`): it lives in one connection, while a runtime opens several and other
    processes share its store; the one rule of `open_runtime` and the worker command."""
    if os.fspath(path) in IN_MEMORY_NAMES:
        raise ValueError(
            f"store {os.fspath(path)!r} is an in-memory SQLite database, private to one"
            " connection: no runtime or worker can share it; pass a file path or a URL"
        )


def check_postgres_name(name: str) -> str:
    """A PostgreSQL URL or libpq DSN as `PostgresStore` takes it; `ValueError` for another
    URL scheme, for a URL whose user name or password holds an unquoted `@` or `/` (libpq
    would take part of the password for the host or the database), and for a NUL character
    or a lone surrogate (libpq reads a name only up to a NUL - the rest ignored, or the
    start of a password read as the port and quoted in its error - and only UTF-8)."""
    if not isinstance(name, str):
        raise TypeError(f"url must be a str, got {type(name).__name__}")
    _refuse_nul_or_surrogate(name, f"url {display_name(name)!r}")
    if not name.strip():
        return name  # libpq's defaults: PGHOST, PGDATABASE, ... from the environment
    if not name.startswith(POSTGRES_SCHEMES):
        if _URL.match(name) or not _DSN.match(name):
            raise ValueError(
                f"url {display_name(name)!r} is not a postgresql:// or postgres:// URL"
                " nor a libpq key=value connection string"
            )
        return name
    rest = name.split("://", 1)[1]
    # libpq reads the user name and password up to the first '@' before any '/'; what
    # follows up to '?' is host, port and database, where an '@' can only be a password's.
    cut = re.search(r"[@/]", rest)
    after = rest[cut.end() :] if cut is not None and cut.group() == "@" else rest
    if "@" in after.split("?", 1)[0]:
        raise ValueError(
            f"url {display_name(name)!r}: a user name or password holding '@' or '/' must be"
            " percent-encoded (urllib.parse.quote(password, safe=''))"
        )
    return name


def mask_password(text: str, *, secrets: tuple[str, ...] = ()) -> str:
    """`text` with every password in it replaced by `***`: in any URL (`user:pw@`, also
    with a `/`, `@` or `:` in the password, and `?password=`/`&password=`), in libpq
    `password=...` pairs (quoted or not), and each of `secrets` (a password known to be
    in play, raw and percent-decoded) wherever it appears. Masks too much rather than too
    little: a URL whose query holds an '@' may lose its host from view."""
    for secret in _secrets(secrets):
        text = text.replace(secret, MASK)
    text = _USERINFO_IN_TEXT.sub(lambda m: f"{m.group(1)}{MASK}@", text)
    text = _URL_IN_TEXT.sub(_mask_url, text)
    return _PARAMETER.sub(_mask_parameter, text)


def display_name(name: str) -> str:
    """A store name as it may be shown: `mask_password` with the name's own password."""
    return mask_password(name, secrets=secrets_of(name))


def secrets_of(name: str) -> tuple[str, ...]:
    """The passwords a store name carries (as written), if any: `mask_password`'s
    `secrets` for text that may quote any of them (a driver's error about that store)."""
    found: list[str] = []
    if _URL.match(name.strip()):
        rest = name.strip().split("://", 1)[1]
        userinfo = _userinfo(rest)
        if userinfo is not None and ":" in userinfo:
            found.append(userinfo.split(":", 1)[1])
        query = rest.split("?", 1)[1] if "?" in rest else ""
        in_password = False
        for pair in query.split("&"):
            key, equals, value = pair.partition("=")
            if not equals and in_password:  # an unencoded '&' in the password: all of it
                found += [pair, f"{found[-1]}&{pair}"]
                continue
            in_password = urllib.parse.unquote(key).strip().lower() == "password"
            if in_password:
                found.append(value)
    for parameter in _PARAMETER.finditer(name):
        if _is_password(parameter.group(1)):
            found.append(parameter.group(2).strip("'"))
    return tuple(value for value in found if value)


# A URL inside free text ends at whitespace or a quote (drivers quote what they echo); its
# scheme starts where no scheme character precedes it (so a long run of letters is read
# once, not from each of its letters).
_SCHEME = r"(?<![A-Za-z0-9+.-])[A-Za-z][A-Za-z0-9+.-]*://"
_URL_IN_TEXT = re.compile(_SCHEME + r"[^\s'\"]*")
# A URL's `user:password@` inside free text, whatever the password holds but a '/' (one
# would have to be percent-encoded: `check_postgres_name`) or whitespace - also the
# quotes that end a URL in `_URL_IN_TEXT`. Group 1 is what is kept.
_USERINFO_IN_TEXT = re.compile("(" + _SCHEME + r"[^\s/@:'\"]*:)[^/\s]*?@")
# `key=value` as a libpq pair (`password = 'it''s'`, backslash escapes) or a URL query
# parameter (up to the next `&` or space; a quote does not end it); the key may be
# percent-encoded (libpq decodes it). Group 1 is everything before the value, group 2 the
# value; `_is_password` says whether the key is a password's.
_PARAMETER = re.compile(
    r"((?<![A-Za-z0-9_%])(?:[A-Za-z_]|%[0-9A-Fa-f]{2})+\s*=\s*)"
    r"('(?:\\.|''|[^'\\])*'?|[^\s&]*)"
)


def _is_password(key: str) -> bool:
    return urllib.parse.unquote(key.rstrip("= \t")).strip().lower() == "password"


def _mask_parameter(match: re.Match[str]) -> str:
    return f"{match.group(1)}{MASK}" if _is_password(match.group(1)) else match.group()


def _userinfo(rest: str) -> str | None:
    """The user name and password of a URL's text after `://`, read generously: up to the
    last '@' before the query, or the last '@' at all when the password holds a '?'."""
    query = rest.find("?")
    head = rest if query < 0 else rest[:query]
    at = head.rfind("@")
    if at < 0:
        at = rest.rfind("@")
    return None if at < 0 else rest[:at]


def _mask_url(match: re.Match[str]) -> str:
    url = match.group()
    scheme, rest = url.split("://", 1)
    userinfo = _userinfo(rest)
    if userinfo is not None and ":" in userinfo:
        user = userinfo.split(":", 1)[0]
        rest = f"{user}:{MASK}@{rest[len(userinfo) + 1 :]}"
    return f"{scheme}://{rest}"


def _secrets(secrets: tuple[str, ...]) -> list[str]:
    # Longest first, so a password is never half-replaced by one of its own substrings.
    # Very short values would mangle every message they occur in and hide nothing.
    found = {form for secret in secrets for form in (secret, urllib.parse.unquote(secret))}
    return sorted((s for s in found if len(s) >= 4), key=len, reverse=True)


# -- PostgreSQL schema names -----------------------------------------------------------------

NAMEDATALEN = 63  # the server truncates longer identifiers, merging different names


def check_schema(schema: object) -> str:
    """A PostgreSQL schema name the server keeps as given: 1-63 bytes in UTF-8, an
    identifier (letters, digits, underscores; not starting with a digit), neither `pg_*`
    nor `information_schema` (any case). `TypeError` for a non-str, `ValueError` else."""
    if not isinstance(schema, str):
        raise TypeError(f"schema must be a str, got {type(schema).__name__}")
    size = len(schema.encode("utf-8", "surrogatepass"))
    if not 1 <= size <= NAMEDATALEN:
        raise ValueError(
            f"schema must be 1-{NAMEDATALEN} bytes in UTF-8 (the server truncates longer"
            f" names, so two of them would share tables), got {size}: {schema[:80]!r}"
        )
    if not schema.isidentifier() or not schema.isprintable():
        raise ValueError(
            f"schema must be an identifier (letters, digits and underscores, not starting"
            f" with a digit), got {schema!r}"
        )
    if schema.lower().startswith("pg_") or schema.lower() == "information_schema":
        raise ValueError(f"schema {schema!r} is reserved for the server (pg_*, information_schema)")
    return schema
