"""A store's password is never shown (DESIGN §8 "Naming the store"), whatever the form of
the name: `user:pw@`, `?password=`, percent-encoded characters that need quoting, a libpq
DSN given to `PostgresStore`. Each form is tried in each place a store is shown: the store's
repr, the worker's log lines, exception texts (also built from the driver's errors), the
operator CLI's output and errors, the library's log events and OpenTelemetry spans.
"""

from __future__ import annotations

import logging
import traceback
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
import trio

import trio_sessions
from trio_sessions import _cli, _naming, _observe, _worker
from trio_sessions._postgres import PostgresStore

# Two parts, so that a password split by a parser (at '/', '@' or ':') is caught too.
PASSWORD = "Qx9SECRET/kW3TAIL@z:q?#%"
PARTS = ("Qx9SECRET", "kW3TAIL")
ENCODED = urllib.parse.quote(PASSWORD, safe="")
PLAIN = "Qx9SECRETkW3TAIL"


def leaked(text: str) -> list[str]:
    """Which pieces of a password (raw, decoded or encoded) appear in `text`."""
    return [piece for piece in (*PARTS, PLAIN, ENCODED) if piece in text]


def url_forms(base: str) -> dict[str, str]:
    """`base` (postgresql://user@host:port/db, no password) with a password in each form
    a user may write; every one is a URL libpq reads as intended."""
    scheme, rest = base.split("://", 1)
    user, host = rest.split("@", 1)
    return {
        "userinfo": f"{scheme}://{user}:{PLAIN}@{host}",
        "userinfo-quoted": f"{scheme}://{user}:{ENCODED}@{host}",
        "query": f"{scheme}://{user}@{host}?password={PLAIN}",
        "query-quoted": f"{scheme}://{user}@{host}?sslmode=prefer&password={ENCODED}",
        "postgres-scheme": f"postgres://{user}:{PLAIN}@{host}",
        # Quotes, which end a URL in free text, unencoded: libpq takes them as part of the
        # password.
        "userinfo-quotes": f"{scheme}://{user}:{PARTS[0]}'\"{PARTS[1]}@{host}",
        "query-quotes": f'{scheme}://{user}@{host}?password={PARTS[0]}"{PARTS[1]}',
        # libpq decodes a parameter's name too: this is the password.
        "query-encoded-name": f"{scheme}://{user}@{host}?pass%77ord={PLAIN}",
    }


def dsn_forms(base: str) -> dict[str, str]:
    """The libpq key=value forms of `base` with a password (`PostgresStore` takes them)."""
    parts = urllib.parse.urlsplit(base)
    common = f"host={parts.hostname} port={parts.port} user={parts.username}"
    return {
        "dsn": f"{common} dbname={parts.path[1:]} password={PLAIN}",
        "dsn-quoted": f"{common} password='{PLAIN} x\\'y' dbname={parts.path[1:]}",
        "dsn-password-first": f"password={PLAIN} {common} dbname={parts.path[1:]}",
    }


CLOSED = "postgresql://app@127.0.0.1:1/app"  # nothing listens on port 1
ALL_FORMS = {**url_forms(CLOSED), **dsn_forms(CLOSED)}


@pytest.mark.parametrize("form", sorted(ALL_FORMS))
def test_the_store_repr_hides_the_password(form: str) -> None:
    """`repr(PostgresStore(...))` shows the store without its password, in every form."""
    store = PostgresStore(ALL_FORMS[form], schema="tenant")
    assert leaked(repr(store)) == []
    assert "127.0.0.1" in repr(store) and "tenant" in repr(store)


@pytest.mark.parametrize("form", sorted(ALL_FORMS))
async def test_a_connection_error_hides_the_password(form: str) -> None:
    """The StoreError of a store that cannot be reached, its formatted traceback included,
    holds no piece of the password."""
    store = PostgresStore(ALL_FORMS[form])
    with pytest.raises(trio_sessions.StoreError) as raised:
        async with trio_sessions.open_runtime(store, None):
            pytest.fail("connected to port 1")  # pragma: no cover
    assert leaked("".join(traceback.format_exception(raised.value))) == []


@pytest.mark.parametrize("form", sorted(ALL_FORMS))
async def test_a_driver_error_quoting_the_connection_string_is_masked(
    form: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """libpq quotes a connection string it cannot use: the StoreError built from such an
    error (and its traceback) shows it with the password masked."""
    name = ALL_FORMS[form]

    def refuse(cls: type, /, conninfo: str, **_: Any) -> Any:
        raise psycopg.OperationalError(f'cannot use "{conninfo}": {name} is bad')

    # Every connection class's `connect` (the store's connections subclass psycopg's).
    monkeypatch.setattr(psycopg.Connection, "connect", classmethod(refuse))
    with pytest.raises(trio_sessions.StoreError, match="cannot use") as raised:
        async with trio_sessions.open_runtime(PostgresStore(name, inline=True), None):
            pytest.fail("connected")  # pragma: no cover
    assert leaked("".join(traceback.format_exception(raised.value))) == []


UNQUOTED = {
    "at-and-quote": f"postgresql://app:{PARTS[0]}'@{PARTS[1]}@127.0.0.1:1/app",
    "slash": f"postgresql://app:{PARTS[0]}/{PARTS[1]}@127.0.0.1:1/app",
    "at": f"postgresql://app:{PARTS[0]}@{PARTS[1]}@127.0.0.1:1/app",
    "both": f"postgresql://app:{PARTS[0]}/x@{PARTS[1]}@127.0.0.1:1/app",
}


@pytest.mark.parametrize("form", sorted(UNQUOTED))
async def test_a_password_with_unquoted_characters_is_refused_without_showing_it(
    form: str,
) -> None:
    """A password holding an unquoted '/' or '@' would reach libpq as a host, port or
    database (and its errors); it is a ValueError saying to percent-encode it, in
    PostgresStore and open_runtime, and no piece of it is shown."""
    with pytest.raises(ValueError, match="percent-encoded") as raised:
        PostgresStore(UNQUOTED[form])
    assert leaked(str(raised.value)) == []
    with pytest.raises(ValueError, match="percent-encoded") as raised:
        async with trio_sessions.open_runtime(UNQUOTED[form], None):
            pytest.fail("opened")  # pragma: no cover
    assert leaked(str(raised.value)) == []


async def test_a_password_with_a_space_is_not_shown() -> None:
    """A space in a URL's password (psycopg refuses it: "use percent-encoded spaces") is
    masked in the store's repr and in the error of opening it."""
    url = f"postgresql://app:{PARTS[0]} {PARTS[1]}@127.0.0.1:1/app"
    assert leaked(repr(PostgresStore(url))) == []
    with pytest.raises(trio_sessions.StoreError, match="percent-encoded") as raised:
        async with trio_sessions.open_runtime(PostgresStore(url), None):
            pytest.fail("opened")  # pragma: no cover
    assert leaked("".join(traceback.format_exception(raised.value))) == []


@pytest.mark.parametrize("form", sorted(url_forms(CLOSED)))
def test_a_url_with_space_around_it_is_refused_without_showing_it(
    form: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A URL with a space before it is still a connection string, not a file name: a
    ValueError that shows no piece of the password (it was an SQLite path whose error
    quoted the whole URL), and no file is created."""

    async def open_it() -> None:
        async with trio_sessions.open_runtime(" " + url_forms(CLOSED)[form], None):
            pytest.fail("opened")  # pragma: no cover

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="space around it") as raised:
        trio.run(open_it)
    assert leaked(str(raised.value)) == []
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("form", sorted(UNQUOTED))
def test_the_cli_refuses_a_password_with_unquoted_characters_without_showing_it(
    form: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every operator command given such a URL exits 2 and prints no piece of it."""
    for argv in (["status"], ["health"], ["quarantine", "list"], ["inputs", "list"]):
        with pytest.raises(SystemExit) as exited:
            _cli.main([*argv, UNQUOTED[form]])
        assert exited.value.code == 2
        out, err = capsys.readouterr()
        assert "percent-encoded" in err
        assert leaked(out + err) == []


# ---------------------------------------------------------------------------------------------
# On a live server (trust authentication: the password is sent only if asked for)


@pytest.fixture
def live_forms(pg_url: str) -> dict[str, str]:
    parts = urllib.parse.urlsplit(pg_url)
    if parts.password is not None:
        pytest.skip("the test server's URL carries its own password")
    return url_forms(pg_url)


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = _cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out + err


@pytest.mark.parametrize("form", ["userinfo", "userinfo-quoted", "query", "query-quoted"])
async def test_cli_output_hides_the_password(
    form: str,
    live_forms: dict[str, str],
    pg_schema: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """health (text and JSON, healthy and not), status, quarantine list and inputs list -
    their output and their errors - show the store without its password."""
    url = live_forms[form]
    # Not a store yet: each command fails naming the store.
    for argv in (["status"], ["quarantine", "list"], ["inputs", "list"], ["health"]):
        code, output = cli(capsys, *argv, url, "--schema", pg_schema)
        assert code == 1 and "is not" in output
        assert leaked(output) == [], argv
    code, output = cli(capsys, "health", url, "--schema", pg_schema, "--json")
    assert code == 1 and leaked(output) == []
    async with trio_sessions.open_runtime(PostgresStore(url, schema=pg_schema), None) as rt:
        await rt.submit("s", {"text": "hi"})
    for argv in (
        ["health", url],
        ["health", url, "--json"],
        ["status", url],
        ["status", url, "--json"],
        ["quarantine", "list", url],
        ["inputs", "list", url],
        ["inputs", "drop", url, "no-such-input"],
    ):
        code, output = cli(capsys, *argv, "--schema", pg_schema)
        assert leaked(output) == [], argv
        assert code == (1 if "drop" in argv else 0), output
    _, output = cli(capsys, "health", url, "--schema", pg_schema)
    assert output.startswith("ok: postgres")


def capture(caplog: pytest.LogCaptureFixture, *, tracebacks: bool = True) -> Callable[[], str]:
    """Everything logged so far: messages and extra fields, and the tracebacks as a
    handler would format them, as one text."""
    caplog.set_level(logging.INFO, logger="trio_sessions")

    def text() -> str:
        lines = []
        for record in caplog.records:
            fields = {k: v for k, v in record.__dict__.items() if k != "exc_info"}
            lines.append(f"{record.getMessage()} {fields}")
            if tracebacks and record.exc_info:
                lines.append("".join(traceback.format_exception(record.exc_info[1])))
        return "\n".join(lines)

    return text


@pytest.mark.parametrize("form", ["userinfo", "userinfo-quoted", "query", "query-quoted"])
async def test_the_worker_start_line_hides_the_password(
    form: str, live_forms: dict[str, str], pg_schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The worker's "worker started" line shows its store without the password."""
    logged = capture(caplog)
    settings = _worker.WorkerSettings(
        drain="m:d", store=live_forms[form], schema=pg_schema, log_level="INFO"
    )
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_worker.serve, settings, _drain)
        with trio.fail_after(20):
            while "worker started" not in logged():
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    assert "worker started" in logged()
    assert "127.0.0.1" in logged()
    assert leaked(logged()) == []


async def _drain(ctx: trio_sessions.DrainContext) -> None:
    await ctx.take_inputs()


@pytest.mark.parametrize("form", sorted(url_forms(CLOSED)))
async def test_the_worker_failure_line_hides_the_password(
    form: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker whose store cannot be reached logs "worker failed" (its `StoreError` line)
    without any piece of the password."""
    logged = capture(caplog)
    settings = _worker.WorkerSettings(drain="m:d", store=url_forms(CLOSED)[form])
    assert await _worker.serve(settings, _drain) == _worker.EXIT_FAILED
    assert "worker failed: StoreError" in logged()
    assert leaked(logged()) == []


ERROR_TEXTS = {form: f'connection to "{name}" failed: {name}' for form, name in ALL_FORMS.items()}


@pytest.mark.parametrize("form", sorted(ERROR_TEXTS))
def test_log_events_with_an_error_text_hide_the_password(
    form: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The library's log events that carry an error's text in their message or extra fields
    (store retries, listener, heartbeat, hand-back and recovery failures, checkpoints) mask
    a password in it."""
    logged = capture(caplog, tracebacks=False)
    error = psycopg.OperationalError(ERROR_TEXTS[form])
    _observe.store_retry("postgres", error, 1, None)
    _observe.listener_reconnect_failed("trio_sessions", error)
    _observe.checkpoint_failed(error)
    _observe.heartbeat_failed("owner", 1, error)
    _observe.hand_back_failed("owner", ["exec-1"], error)
    with pytest.raises(psycopg.OperationalError), _observe.recovery_pass("owner"):
        raise error
    assert logged().count("connection to") >= 6
    assert leaked(logged()) == []


@pytest.mark.parametrize("form", sorted(ERROR_TEXTS))
def test_opentelemetry_spans_hide_the_password(form: str) -> None:
    """A failure recorded on a span (status description and exception event, its
    stacktrace included) masks a password in the error's text."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    try:
        raise trio_sessions.StoreError(ERROR_TEXTS[form])
    except trio_sessions.StoreError as exc:
        error = exc
    with provider.get_tracer("test").start_as_current_span("drain") as span:
        _observe._telemetry.end_failed(span, error)
    provider.shutdown()
    (finished,) = exporter.get_finished_spans()
    shown = [finished.status.description or ""] + [
        str(value) for event in finished.events for value in (event.attributes or {}).values()
    ]
    assert any("connection to" in text for text in shown)
    assert any(event.name == "exception" for event in finished.events)
    assert leaked("\n".join(shown)) == []


def test_sqlite_paths_are_shown_as_given(tmp_path: Path) -> None:
    """Masking leaves a path alone, also one holding ':' or '@'."""
    path = str(tmp_path / "user:name@host" / "sessions.db")
    assert _naming.display_name(path) == path


def test_a_password_libpq_cannot_parse_is_not_shown_in_its_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """An unencoded '&' in a query's password, or a quote doubled SQL-style in a key=value
    password: libpq cannot parse the name and its error quotes the piece it stopped at -
    the rest of the password. Neither the CLI's error (the name and the driver's text) nor
    the store's error shows a piece of it."""
    ampersand = f"postgresql://app@127.0.0.1:1/app?password={PARTS[0]}&{PARTS[1]}"
    assert _cli.main(["status", ampersand]) == 1
    assert leaked(capsys.readouterr().err) == []
    doubled = f"host=127.0.0.1 port=1 user=app password='{PARTS[0]}''{PARTS[1]}'"
    for name in (ampersand, doubled):

        async def open_it(name: str = name) -> None:
            async with trio_sessions.open_runtime(PostgresStore(name), None):
                pytest.fail("opened")  # pragma: no cover

        with pytest.raises(trio_sessions.StoreError) as raised:
            trio.run(open_it)
        assert leaked("".join(traceback.format_exception(raised.value))) == []


@pytest.mark.parametrize(
    "text",
    [
        "connection to postgresql://127.0.0.1:5432 failed; mail admin@example.com",
        "http://[::1]:8080 then user@host",
        "connection to postgresql://app@127.0.0.1:5432/db failed",
    ],
)
def test_text_without_a_password_is_shown_as_it_is(text: str) -> None:
    """Masking hides passwords, not a host and port followed later on the line by an
    unrelated '@'."""
    assert _naming.mask_password(text) == text
