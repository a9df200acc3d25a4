"""`python -m trio_sessions console`: the operator console in the browser.

An ASGI app on hypercorn's trio worker over a *producer* runtime (it never drains): the
sessions list and the quarantine table (each searched or paged in the store, rendered on the
server), a session page with the newest page of its transcript, live, the operator's actions,
store-wide figures and `/metrics`. Plain HTML with a little JavaScript, served from here: no
build step, no CDN. Every page costs a page, however large the store or the transcript: a
session page's event stream starts at the stream position of what the page rendered, read
in the same snapshot (no gap, no duplicate), and each SSE event carries its cursor as `id:`
so an EventSource reconnect resumes from Last-Event-ID.

Security rules (kept by `Guard`, checked on every request, the event stream included):
* bound to a non-loopback address, it refuses to start without a token;
* with a token, a request carries it as `Authorization: Bearer TOKEN` (scripts, scrapers)
  or in an HttpOnly cookie that a browser gets by opening `/?token=TOKEN` once; compared in
  constant time. The cookie holds an HMAC of the token, never the token (cookies are not
  kept apart by port: every service on the host name receives it), under a name derived
  from the token too, so two consoles on one host keep their own logins;
* every action is a POST with a CSRF field derived from a secret the page holds (a
  request authorised by a bearer header needs none: no browser sends one cross-site);
* `read_only` hides every action and refuses every POST;
* the store is shown with its password masked; a password never reaches a page.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import hashlib
import hmac
import ipaddress
import json
import logging
import re
import secrets
import signal
import sys
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

import attrs
import trio

from . import _metrics, _store
from ._console_html import (
    SESSION_SCRIPT,
    PageFeed,
    html_page,
    message_html,
    readable_json,
    sse_blocks,
    state,
)
from ._console_html import escape as _e  # short: they stand in f-strings dozens of times
from ._console_html import quote as _q
from ._console_html import unquote as _unquote
from ._errors import MalformedRecord, StoreError, TrioSessionsError
from ._model import Message
from ._naming import display_name, mask_password
from ._runtime import Runtime, make_owner_id
from ._store.operator import PageKey
from ._store.stream import Held, Position, Shown, Tail, Whole, message_tag
from ._stream import EventStream, decode_cursor, encode_cursor, session_tag
from ._validate import MAX_INT64, validate_session_id
from ._worker import ENV_SCHEMA, LOG_LEVELS

logger = logging.getLogger("trio_sessions.console")

Scope = Mapping[str, Any]
Receive = Callable[[], Awaitable[Mapping[str, Any]]]
Send = Callable[[Any], Awaitable[None]]
E = TypeVar("E", bound=BaseException)  # an exception kind `_only` looks for

PAGE_SIZE = 50
# Quarantined executions a list page shows (keyset-paged by execution id).
QUARANTINE_PAGE_SIZE = 100
# Messages a session page shows: the newest ones, with a link to the earlier ones (keyset
# by seq). One stream read's worth of new messages (`_store.stream.NEW_MESSAGES_PER_READ`):
# a page costs the same for 20 messages or 20,000.
TRANSCRIPT_PAGE_SIZE = 200
# The most message ids an event stream reads for the page it serves (`_store.shown_messages`):
# a page that followed its stream for long shows more than it rendered.
FOLLOWED_IDS = 1_000
MAX_FORM = 16 * 1024
# An idle event stream sends an SSE comment this often (seconds): proxies cut a response
# that is silent for a minute or so (nginx: 60 s), and a browser gone without closing is
# only noticed by a write - until then it holds its task and its stream.
KEEP_ALIVE = 15.0
SSE = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
# When the store does not answer: a 503's Retry-After (seconds), and what an event stream
# says before it ends (an EventSource reconnects after this many milliseconds).
RETRY_AFTER = b"5"
RETRY_LATER = b"retry: 5000\n\n"
COOKIE_PREFIX = "trio_sessions_console_"
# The cookie of earlier versions, which held the raw token: expired at every login, so a
# browser that kept it stops sending the token to every service on the host name.
LEGACY_COOKIE = "trio_sessions_console"


class HTTPError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@attrs.frozen
class Guard:
    """Who may read and act: the token (None: loopback only, no login) and the CSRF secret."""

    token: str | None
    read_only: bool
    csrf_secret: bytes = attrs.field(factory=lambda: secrets.token_bytes(32))

    def csrf(self) -> str:
        return hmac.new(self.csrf_secret, b"console-csrf", hashlib.sha256).hexdigest()

    def cookie_name(self) -> str:
        """The login cookie's name: this console's own (another console on the host, on
        another port, has another token and so another name: its login leaves ours be)."""
        return COOKIE_PREFIX + self._derived(b"console-cookie-name")[:16]

    def cookie_value(self) -> str:
        """The login cookie's value: an HMAC of the token, which proves the login to this
        console and tells nothing of the token to whatever else the browser sends it to."""
        return self._derived(b"console-login")

    def _derived(self, purpose: bytes) -> str:
        if self.token is None:
            raise ValueError("a console without a token has no login")
        return hmac.new(self.token.encode(), purpose, hashlib.sha256).hexdigest()

    def authorised(self, headers: Mapping[str, str], cookies: Mapping[str, str]) -> str | None:
        """How the request proved itself: "bearer", "cookie", "open" (no token), or None."""
        if self.token is None:
            return "open"
        bearer = headers.get("authorization", "")
        if bearer.startswith("Bearer ") and _same(bearer[7:], self.token):
            return "bearer"
        if _same(cookies.get(self.cookie_name(), ""), self.cookie_value()):
            return "cookie"
        return None

    def check_action(self, how: str, form: Mapping[str, str]) -> None:
        if self.read_only:
            raise HTTPError(403, "this console is read-only")
        if how != "bearer" and not _same(form.get("csrf", ""), self.csrf()):
            raise HTTPError(403, "missing or wrong CSRF token: reload the page")


def _same(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode(), expected.encode())


def check_keep_alive(keep_alive: float) -> float:
    """`keep_alive` as a period: 0 (or less) would write a comment after each comment,
    without end, and NaN would never write one (`inf`: never)."""
    if not keep_alive > 0:
        raise ValueError(f"keep_alive must be a positive number of seconds, got {keep_alive}")
    return keep_alive


@attrs.define
class Console:
    """The console's ASGI app over a producer runtime; an idle event stream writes an SSE
    comment every `keep_alive` seconds."""

    runtime: Runtime
    store_name: str  # masked
    guard: Guard
    keep_alive: float = attrs.field(default=KEEP_ALIVE, kw_only=True, converter=check_keep_alive)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        try:
            await self.route(scope, receive, send)
        except HTTPError as exc:
            await _respond(send, exc.status, html_page("Error", f"<p>{_e(str(exc))}</p>"))
        except StoreError as exc:
            # The store did not answer: the service is down for now, not the request wrong -
            # a client may retry it. Which error is said (the console is the operator's),
            # any password in it masked; its traceback is not a page's.
            logger.warning("store error on %s %s: %s", scope["method"], scope["path"], exc)
            said = f"{type(exc).__name__}: {mask_password(str(exc))}"
            page = html_page("Error", f"<p>store error: {_e(said)}</p>")
            await _respond(send, 503, page, extra=((b"retry-after", RETRY_AFTER),))
        except (ValueError, TypeError, TrioSessionsError) as exc:
            await _respond(send, 400, html_page("Error", f"<p>{_e(str(exc))}</p>"))

    async def route(self, scope: Scope, receive: Receive, send: Send) -> None:
        method = scope["method"]
        segments = _segments(scope)
        headers = _headers(scope)
        query = _query(scope)
        if segments == [] and "token" in query and method == "GET":
            await self.log_in(query["token"], send)
            return
        host = headers.get("host")
        if self.guard.token is None and host is not None and not is_loopback(_host_name(host)):
            # Only a loopback name: a web page that rebinds its own name to 127.0.0.1 must
            # not read or act through a console that asks for no token. (A browser always
            # sends the name; a request without one is no browser's.)
            raise HTTPError(403, "without a token this console answers only to a loopback host")
        how = self.guard.authorised(headers, _cookies(headers))
        if how is None:
            raise HTTPError(401, "a token is needed: open /?token=TOKEN once, or send a bearer")
        if method == "POST":
            form = _parse_form(await _read_body(receive))
            self.guard.check_action(how, form)
            target = await self.act(segments, form)
            await _redirect(send, target)
            return
        if method != "GET":
            raise HTTPError(405, f"{method} is not allowed")
        if segments == []:
            await _respond(send, 200, await self.sessions_page(query))
        elif segments == ["metrics"]:
            body = _metrics.render(self.runtime.statistics, owner_id=self.runtime.owner_id)
            await _respond(send, 200, body, content_type=_metrics.CONTENT_TYPE)
        elif len(segments) == 2 and segments[0] == "sessions":
            await _respond(send, 200, await self.session_page(segments[1], query))
        elif len(segments) == 3 and segments[0] == "sessions" and segments[2] == "events":
            await self.events(segments[1], query, headers.get("last-event-id"), receive, send)
        else:
            raise HTTPError(404, "no such page")

    async def log_in(self, token: str, send: Send) -> None:
        if self.guard.token is None or not _same(token, self.guard.token):
            raise HTTPError(401, "wrong token")
        cookie = (
            f"{self.guard.cookie_name()}={self.guard.cookie_value()};"
            " HttpOnly; SameSite=Strict; Path=/"
        )
        legacy = f"{LEGACY_COOKIE}=; Max-Age=0; HttpOnly; SameSite=Strict; Path=/"
        cookies = ((b"set-cookie", cookie.encode()), (b"set-cookie", legacy.encode()))
        await _redirect(send, "/", extra=cookies)

    # -- pages ------------------------------------------------------------------------------

    async def sessions_page(self, query: Mapping[str, str]) -> bytes:
        search = query.get("q", "")
        if "\x00" in search:  # PostgreSQL refuses it in any text
            raise HTTPError(400, "no session id holds a NUL character")
        after = _page_start(query, "after")
        quarantine_after = _page_start(query, "quarantine_after")
        page = await self.runtime._db.read(_store.session_page, search, after, PAGE_SIZE)
        counts = await self.runtime._db.read(_store.store_counts)
        quarantine = await self.runtime._db.read(
            _store.quarantine_page, quarantine_after, QUARANTINE_PAGE_SIZE
        )
        rows = "".join(self._session_row(session) for session in page["sessions"])
        more = ""
        if _pages_on(page, after):
            next_query = _list_query(search, page["last"], quarantine_after)
            more = f'<p><a id="next" href="/?{next_query}">next page</a></p>'
        figures = " · ".join(f"{_e(k.replace('_', ' '))} <b>{v}</b>" for k, v in counts.items())
        body = f"""
<p class="figures">{figures}</p>
<p class="figures">this console: {_e(self._own_figures())}</p>
<form method="get" action="/"><input name="q" value="{_e(search)}" placeholder="session id
contains"> <button>search</button></form>
<table id="sessions"><thead><tr><th>session</th><th>state</th><th>owner</th>
<th>pending inputs</th><th>messages</th><th></th></tr></thead><tbody>{rows}</tbody></table>
{more}
<h2>Quarantine</h2>
{self._quarantine_table(quarantine["quarantined"])}
{_quarantine_more(quarantine, search, after, quarantine_after)}"""
        return html_page("Sessions", body, store=self.store_name, read_only=self.guard.read_only)

    def _own_figures(self) -> str:
        stats = self.runtime.statistics()
        return (
            f"backend {stats.store.backend}, {stats.store.transactions} transactions,"
            f" {stats.store.retries} retries, {stats.remote_signals} remote signals"
        )

    def _session_row(self, session: Mapping[str, Any]) -> str:
        session_id = session["id"]
        claim = session["claim"]
        owner = claim["owner_id"] if claim else ""
        if not _nameable(session):
            # Shown by its bytes only: an action by the shown name (replacement characters)
            # would act on another session, or make one.
            return f"<tr><td>{_e(session_id)}</td><td>{_e(state(session))}</td></tr>"
        if not _acceptable(session_id):
            # Another tool's id the runtime refuses (a tab in it): its page and actions
            # would all answer 400. Listed, to be repaired or deleted with the store's tools.
            refused = "an id the runtime refuses: no page, no action"
            return (
                f"<tr><td>{_e(session_id)}</td><td>{_e(state(session))}</td>"
                f'<td colspan="4"><i class="error">{refused}</i></td></tr>'
            )
        link = f"/sessions/{_q(session_id)}"
        actions = self._actions(session)
        return (
            f'<tr data-session="{_e(session_id)}"><td><a href="{link}">{_e(session_id)}</a></td>'
            f"<td>{_e(state(session))}</td><td>{_e(owner)}</td>"
            f"<td>{session['pending_inputs']}</td><td>{session['messages']}</td>"
            f"<td>{actions}</td></tr>"
        )

    def _actions(self, session: Mapping[str, Any], *, page: bool = False) -> str:
        """The buttons for one session: interrupt while a claim runs (`_interruptible`),
        pause or resume, and on its own page delete (confirmed)."""
        if self.guard.read_only:
            return ""
        base = f"/sessions/{_q(session['id'])}"
        buttons = []
        if _interruptible(session["claim"]):
            buttons.append(self._button(f"{base}/interrupt", "interrupt"))
        if not session["paused"]:
            buttons.append(self._button(f"{base}/pause", "pause"))
        else:
            buttons.append(self._button(f"{base}/resume", "resume"))
        if page:
            confirm = "Delete this session and every row of it?"
            buttons.append(self._button(f"{base}/delete", "delete", confirm=confirm))
        return "".join(buttons)

    def _button(
        self, action: str, label: str, *, confirm: str | None = None, back: str | None = None
    ) -> str:
        onsubmit = f' onsubmit="return confirm({_e(json.dumps(confirm))})"' if confirm else ""
        after = f'<input type="hidden" name="back" value="{_e(back)}">' if back else ""
        # autocomplete="off": Firefox restores a control's state - the `disabled` the page
        # gives a posted form's button - on a page shown again (Back, a reload).
        return (
            f'<form method="post" action="{_e(action)}" class="action" autocomplete="off"'
            f"{onsubmit}>{after}"
            f'<input type="hidden" name="csrf" value="{self.guard.csrf()}">'
            f'<button name="do" value="{_e(label)}">{_e(label)}</button></form>'
        )

    def _quarantine_table(self, rows: Sequence[Mapping[str, Any]]) -> str:
        if not rows:
            return "<p>Nothing is quarantined.</p>"
        body = ""
        for row in rows:
            execution = row["execution_id"]
            if not _nameable(row, "session_recovery.execution_id", "session_recovery.session_id"):
                # Shown by its bytes only: a link or an action by the shown name would miss.
                body += f"<tr><td>{_e(execution)}</td><td>{_e(row['session_id'])}</td>"
                body += f"<td>{_e('; '.join(row['malformed']))}</td><td></td></tr>"
                continue
            actions = ""
            if execution == "":
                # No button: a URL's empty segment names nothing (its POST would be a 404),
                # and the CLI refuses the id too: repaired or deleted with the store's tools.
                actions = '<i class="error">an empty id: no action</i>'
            elif not self.guard.read_only:
                actions = self._button(
                    f"/quarantine/{_q(execution)}/resume", "resume"
                ) + self._button(
                    f"/quarantine/{_q(execution)}/drop", "drop", confirm="Drop this execution?"
                )
            session = _e(row["session_id"])
            if _acceptable(row["session_id"]):
                session = f'<a href="/sessions/{_q(row["session_id"])}">{session}</a>'
            body += (
                f'<tr data-execution="{_e(execution)}"><td>{_e(execution)}</td>'
                f"<td>{session}</td><td>{_e(str(row['recovery_error']))}</td>"
                f"<td>{actions}</td></tr>"
            )
        return (
            '<table id="quarantine"><thead><tr><th>execution</th><th>session</th><th>why</th>'
            f"<th></th></tr></thead><tbody>{body}</tbody></table>"
        )

    async def session_page(self, session_id: str, query: Mapping[str, str]) -> bytes:
        session = None
        if "\x00" not in session_id:  # no session id holds one (PostgreSQL refuses it)
            session = await self.runtime._db.read(_store.session_status, session_id)
        if session is None:
            raise HTTPError(404, f"no session {session_id!r}")
        validate_session_id(session_id)  # its actions would refuse it: 400, as they would
        before = _seq_parameter(query, "before")
        tail = await self.runtime._db.read(
            _store.transcript_tail, session_id, before, TRANSCRIPT_PAGE_SIZE
        )
        inputs_after = _seq_parameter(query, "inputs_after")
        inputs = await self.runtime._db.read(
            _store.pending_inputs, session_id, inputs_after, PAGE_SIZE
        )
        # This page, as a cancel button's way back: the same inputs and transcript pages.
        here = _session_query(session_id, before=before, inputs_after=inputs_after)
        body = f"""
<p><a href="/">all sessions</a></p>
<p>state <b id="state">{_e(state(session))}</b> · pending inputs {session["pending_inputs"]}
(scheduled {session["scheduled_inputs"]}) {self._actions(session, page=True)}</p>
{self._inputs_table(inputs["inputs"], here)}
{_inputs_more(session_id, session["pending_inputs"], inputs, before, inputs_after)}
{_transcript_html(session_id, tail, before=before, inputs_after=inputs_after)}
<script>{SESSION_SCRIPT}</script>"""
        return html_page(
            f"Session {session_id}", body, store=self.store_name, read_only=self.guard.read_only
        )

    def _inputs_table(self, inputs: Sequence[Mapping[str, Any]], back: str) -> str:
        if not inputs:
            return ""
        rows = ""
        for item in inputs:
            due = "now" if item["due_at"] is None else f"at {_utc_time(item['due_at'])}"
            cancel = ""
            # No button for an id shown replaced (not UTF-8): it would cancel nothing.
            if not self.guard.read_only and _nameable(item, "session_input.id"):
                cancel = self._button(f"/inputs/{_q(item['id'])}/cancel", "cancel", back=back)
            seq, payload = _e(str(item["seq"])), _e(readable_json(item["payload"]))
            if item["malformed"]:
                payload += f' <i class="error">(malformed: {_e("; ".join(item["malformed"]))})</i>'
            rows += (
                f'<tr data-input="{_e(item["id"])}"><td>{seq}</td><td>{_e(due)}</td>'
                f"<td>{payload}</td><td>{cancel}</td></tr>"
            )
        return (
            '<table id="inputs"><thead><tr><th>seq</th><th>due</th><th>pending input</th>'
            f"<th></th></tr></thead><tbody>{rows}</tbody></table>"
        )

    async def events(
        self,
        session_id: str,
        query: Mapping[str, str],
        last_event_id: str | None,
        receive: Receive,
        send: Send,
    ) -> None:
        """Server-sent events from `runtime.stream()` for a page (`PageFeed`), until the
        client leaves. The stream opens at the position the page shows - its `cursor`, or
        the `id:` of the last event a reconnecting EventSource applied (Last-Event-ID) -
        so the page gets what changed since it was read, once; without either, every
        message (a client other than a page)."""
        async with contextlib.AsyncExitStack() as opened:
            try:
                feed, first, stream = await self._open_events(
                    session_id, query, last_event_id, opened
                )
            except StoreError as exc:
                # Not a 503: an EventSource fails for good on any status but 200, and the
                # page would stop following the session, silently, until reloaded.
                logger.warning("store error opening %r's event stream: %s", session_id, exc)
                await send({"type": "http.response.start", "status": 200, "headers": SSE})
                await send({"type": "http.response.body", "body": RETRY_LATER})
                return
            await send({"type": "http.response.start", "status": 200, "headers": SSE})
            writes = _Writes(send, self.keep_alive)
            lost = False
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_cancel_on_disconnect, receive, nursery.cancel_scope)
                nursery.start_soon(writes.keep_alive)
                if first:
                    await writes.write("".join(first))

                async def send_held_back() -> None:
                    if feed.pending:
                        await writes.write(feed.feed([], settled=True))

                stream.on_settled = send_held_back
                try:
                    async for event in stream:
                        # With the events ready after it: one write for a burst.
                        events = [event, *stream.take_ready()]
                        text = feed.feed(events, settled=not stream.left_out)
                        if text:
                            await writes.write(text)
                except MalformedRecord as exc:
                    # A comment (the page ignores it), then nothing until the client leaves:
                    # an ended stream would have the browser reconnect into the same row.
                    await writes.write(f": malformed record: {_one_line(str(exc))}\n\n")
                    await trio.sleep_forever()
                except StoreError as exc:
                    # The store did not answer: the stream says when to reconnect and ends;
                    # the EventSource comes back from its last event (Last-Event-ID).
                    logger.warning("store error in %r's event stream: %s", session_id, exc)
                    await writes.write(RETRY_LATER.decode())
                    lost = True
                    nursery.cancel_scope.cancel()
            if lost:
                await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _open_events(
        self,
        session_id: str,
        query: Mapping[str, str],
        last_event_id: str | None,
        opened: contextlib.AsyncExitStack,
    ) -> tuple[PageFeed, list[str], EventStream]:
        """The page's feed, the update that brings it up to the stream, and the stream
        (entered in `opened`), for `events`."""
        cursor = last_event_id or query.get("cursor") or None
        feed = PageFeed(session_id, 0, {}, {})
        first: list[str] = []
        if cursor is not None:
            # The page's open messages and its message ids, read when the stream opens
            # (`_followed`); a change since the page's read arrives as the update `first`.
            position = decode_cursor(session_id, cursor)
            if len(position.open) > FOLLOWED_IDS:  # a client's own: no page follows that many
                raise HTTPError(400, f"a cursor names at most {FOLLOWED_IDS} open messages")
            shown_from = _seq_parameter(query, "from") or position.top + 1
            if position.top < shown_from:
                # The stream holds nothing the page rendered (a page's cursor names its
                # newest message): a rewrite emptied the page, whose feed then showed every
                # message from seq 1 on (`PageFeed._end_check`). An EventSource reconnects
                # with the page's URL, so its `from` is not what the page shows now.
                shown_from = 1
            shown = await self.runtime._db.read(
                _store.shown_messages, session_id, shown_from, position, FOLLOWED_IDS
            )
            feed, position, first = _followed(session_id, shown_from, position, shown)
            cursor = encode_cursor(session_tag(session_id), position)
        stream = await opened.enter_async_context(self.runtime.stream(session_id, cursor=cursor))
        return feed, first, stream

    # -- actions ----------------------------------------------------------------------------

    async def act(self, segments: list[str], form: Mapping[str, str]) -> str:
        """Run one action; returns where to send the browser next."""
        match segments:
            case ["sessions", session_id, "interrupt"]:
                # A quarantined claim (it may hold a live lease: a dead owner's, found by
                # its free liveness token) is left to the quarantine's own actions:
                # `interrupt` marks nothing and returns False for it, and this 409 says
                # where to act instead of "runs no claim now".
                session_id = validate_session_id(session_id)
                session = await self.runtime._db.read(_store.session_status, session_id)
                if session is not None and session["claim"] and session["claim"]["quarantined"]:
                    raise HTTPError(
                        409,
                        f"nothing was interrupted: session {session_id!r}'s claim is"
                        " quarantined (resume or drop it in the quarantine table)",
                    )
                # False: no claim runs now (a page from before it stopped or ended).
                # Said, not a redirect that looks as if it had acted.
                if not await self.runtime.interrupt(session_id):
                    raise HTTPError(
                        409,
                        f"nothing was interrupted: session {session_id!r} runs no claim now"
                        " (none, or already stopping)",
                    )
                return f"/sessions/{_q(session_id)}"
            case ["sessions", session_id, "pause"]:
                # False: no such session (deleted since the page was read): a pause would
                # make it again, empty and paused.
                session_id = validate_session_id(session_id)
                if not await self.runtime._db.run(_store.pause_session, session_id, False):
                    raise HTTPError(404, f"nothing was paused: no session {session_id!r}")
                return f"/sessions/{_q(session_id)}"
            case ["sessions", session_id, "resume"]:
                await self.runtime.resume(session_id)
                return f"/sessions/{_q(session_id)}"
            case ["sessions", session_id, "delete"]:
                # False: no such session (deleted meanwhile, from another page or the CLI).
                if not await self.runtime.delete_session(session_id):
                    raise HTTPError(404, f"nothing was deleted: no session {session_id!r}")
                return "/"
            case ["inputs", input_id, "cancel"]:
                # False: a drain took it since the page was read (it is being answered), or
                # it is unknown. Said, as the interrupt says it, not a redirect back.
                if not await self.runtime.cancel_input(input_id):
                    raise HTTPError(
                        409,
                        f"nothing was cancelled: input {input_id!r} is not pending (a drain"
                        " already took it, or it is unknown)",
                    )
                # Only a page of this console, never another site (an open redirect).
                return _own_page(form.get("back", "/"))
            case ["quarantine", execution_id, ("resume" | "drop") as what]:
                owner = make_owner_id("console")
                if what == "resume":
                    # The console drains nothing: clear the quarantine and end the recovery
                    # lease at once, so the next recovery pass of any worker examines it.
                    await self.runtime._db.run(_store.lift_quarantine, execution_id, owner, 0)
                else:
                    await self.runtime._db.run(_store.drop_quarantined, execution_id)
                return "/"
        raise HTTPError(404, "no such action")


def _interruptible(claim: Mapping[str, Any] | None) -> bool:
    """Whether the console interrupts a session holding `claim`: one not already stopping
    and not quarantined. An expired one is (a crashed owner's, or one a rolling restart
    handed back): marked, recovery finishes it as cancelled instead of resuming it. A
    quarantined one's own actions decide it (`act`)."""
    return claim is not None and not claim["quarantined"] and claim["phase"] != "cancelling"


def _segments(scope: Scope) -> list[str]:
    # The raw path, so a session id holding "/" (percent-encoded) stays one segment; bytes
    # that are not UTF-8 are a ValueError (400), never a replacement character's id.
    raw = bytes(scope.get("raw_path") or scope["path"].encode()).decode("latin-1")
    parts = raw.split("?")[0].split("/")
    return [_unquote(part) for part in parts if part]


def _host_name(host: str) -> str:
    """The name in a Host header, without its port (an IPv6 address without brackets), in
    lower case and without a trailing dot."""
    if host.startswith("["):
        return host[1:].partition("]")[0]
    name = host.rpartition(":")[0] if host.count(":") == 1 else host
    return name.lower().rstrip(".")


# A page of this console: a path of URL characters only, never another site's (`//host`,
# `/\host`: browsers read both as one) and never a header's line break.
_OWN_PAGE = re.compile(r"/(?![/\\])[A-Za-z0-9._~%/?=&+-]*")


def _own_page(back: str) -> str:
    return back if _OWN_PAGE.fullmatch(back) else "/"


def _one_line(text: str) -> str:
    return " ".join(text.split())


@attrs.define
class _Writes:
    """An event stream's body writes, one at a time: the events', and a comment whenever
    none was written for `keep_alive` seconds."""

    send: Send
    period: float  # the console's `keep_alive`
    _lock: trio.Lock = attrs.field(factory=trio.Lock)
    _written_at: float = attrs.field(factory=trio.current_time)

    async def write(self, text: str) -> None:
        async with self._lock:
            await self.send(
                {"type": "http.response.body", "body": text.encode(), "more_body": True}
            )
            self._written_at = trio.current_time()

    async def keep_alive(self) -> None:
        while True:
            await trio.sleep_until(self._written_at + self.period)
            if trio.current_time() >= self._written_at + self.period:
                await self.write(": keep-alive\n\n")


def _headers(scope: Scope) -> dict[str, str]:
    return {
        bytes(k).decode("latin-1").lower(): bytes(v).decode("latin-1") for k, v in scope["headers"]
    }


def _cookies(headers: Mapping[str, str]) -> dict[str, str]:
    pairs = (item.strip().partition("=") for item in headers.get("cookie", "").split(";"))
    return {key: value for key, _, value in pairs if key}


def _page_start(query: Mapping[str, str], name: str) -> PageKey | None:
    """Where a table's page starts (`_store.session_page`, `_store.quarantine_page`): at the first
    id (None) without a field, else after the id `name` a user may type, or after an id as
    stored that a next link names by the hex digits of its bytes (`_list_query`): `name_hex` for
    text - not UTF-8, or holding a NUL (SQLite keeps another tool's) - and `name_blob` for a
    BLOB, which SQLite orders after all text."""
    for kind, blob in (("hex", False), ("blob", True)):
        hex_digits = query.get(f"{name}_{kind}")
        if hex_digits is None:
            continue
        # Only hex digits: `bytes.fromhex` would take spaces too, and one id two ways.
        if not _HEX_DIGITS.fullmatch(hex_digits):
            raise HTTPError(400, f"{name}_{kind} must be hex digits, two a byte")
        key = bytes.fromhex(hex_digits)
        if blob:
            return PageKey(key, blob=True)
        try:
            return PageKey(key.decode("utf-8"))
        except UnicodeDecodeError:
            return PageKey(key)
    text = query.get(name)
    if text is None:
        return None
    if "\x00" in text:  # PostgreSQL refuses it in any text; a stored one pages by its hex
        raise HTTPError(400, "no session id holds a NUL character")
    return PageKey(text)


_HEX_DIGITS = re.compile(r"(?:[0-9A-Fa-f]{2})*")


def _pages_on(page: Mapping[str, Any], after: PageKey | None) -> bool:
    """Whether a table's page links a next one: more rows follow, past this page's own
    start (a page never links itself, were the store to order its keys unlike SQL does)."""
    return bool(page["more"]) and page["last"] is not None and page["last"] != after


def _list_query(search: str, after: PageKey | None, quarantine_after: PageKey | None) -> str:
    """A list page's query: the search, and where each of its two tables starts (an id a
    user could not type - a BLOB, text that is not UTF-8 or holds a NUL - as the hex of its
    stored bytes: `_page_start`). The id "" sorts before every other: a page of more than
    one row never ends at it, and a key of it is written as the first page's (no field)."""
    fields = {"q": search}
    for name, key in (("after", after), ("quarantine_after", quarantine_after)):
        if key is None:
            continue
        if key.blob:
            fields[f"{name}_blob"] = _as_bytes(key.id).hex()
        elif isinstance(key.id, bytes) or "\x00" in key.id:
            fields[f"{name}_hex"] = _as_bytes(key.id).hex()
        elif key.id:
            fields[name] = key.id
    return urllib.parse.urlencode({key: value for key, value in fields.items() if value})


def _as_bytes(stored: str | bytes) -> bytes:
    return stored if isinstance(stored, bytes) else stored.encode("utf-8")


def _quarantine_more(
    page: Mapping[str, Any],
    search: str,
    after: PageKey | None,
    quarantine_after: PageKey | None,
) -> str:
    """The link to the next page of quarantined executions (the sessions' page kept)."""
    if not _pages_on(page, quarantine_after):
        return ""
    query = _list_query(search, after, page["last"])
    return f'<p><a id="quarantine-next" href="/?{query}">next quarantined executions</a></p>'


def _session_query(session_id: str, *, before: int | None, inputs_after: int | None) -> str:
    """A session page's URL: where its transcript ends (`before`) and its pending inputs
    start (`inputs_after`), each left out for the newest messages and the first inputs."""
    fields = {"before": before, "inputs_after": inputs_after}
    query = urllib.parse.urlencode({k: v for k, v in fields.items() if v is not None})
    return f"/sessions/{_q(session_id)}" + (f"?{query}" if query else "")


def _inputs_more(
    session_id: str,
    pending: int,
    page: Mapping[str, Any],
    before: int | None,
    inputs_after: int | None,
) -> str:
    """Under a page of pending inputs that is not all of them: how many it shows of how
    many, a link to the next page (keyset by seq) and one back to the first."""
    if not page["more"] and inputs_after is None:
        return ""
    shown = len(page["inputs"])
    note = f"{shown} of {pending} pending inputs shown"
    if inputs_after is not None:
        first = _session_query(session_id, before=before, inputs_after=None)
        note += f' (after seq {inputs_after}) · <a id="inputs-first" href="{_e(first)}">first</a>'
    last = page["inputs"][-1]["seq"] if page["inputs"] else None
    # Only a seq a link can name (from 1): another tool may have stored one below 1, or
    # text (SQLite keeps it; listed as malformed): the note still says what is not shown.
    if page["more"] and type(last) is int and last > 0:
        following = _session_query(session_id, before=before, inputs_after=last)
        note += f' · <a id="inputs-next" href="{_e(following)}">next pending inputs</a>'
    return f'<p class="figures">{note}</p>'


def _acceptable(session_id: str) -> bool:
    """Whether the runtime takes this stored id (another tool may have written one it
    refuses: a tab in it), so a page and actions by it can work."""
    try:
        validate_session_id(session_id)
    except (TypeError, ValueError):
        return False
    return True


def _seq_parameter(query: Mapping[str, str], name: str) -> int | None:
    """A seq in the query (a page's `before`, a stream's `from`), or None when absent."""
    text = query.get(name)
    if text is None:
        return None
    if not (text.isascii() and text.isdigit() and 0 < int(text) <= MAX_INT64):
        raise HTTPError(400, f"{name} must be a seq (a whole number from 1)")
    return int(text)


def _transcript_html(
    session_id: str, tail: Tail, *, before: int | None, inputs_after: int | None
) -> str:
    """A page of the transcript (the newest when `before` is None), with a link to the
    earlier messages, each link keeping the pending inputs' page; the newest page carries
    the event stream's URL with the cursor of what it shows (none when the newest row names
    no position: the page is static then)."""
    newest = before is None
    base = f"/sessions/{_q(session_id)}"
    links = ""
    if tail.earlier and tail.messages:
        earlier = _session_query(session_id, before=tail.messages[0].seq, inputs_after=inputs_after)
        links += f'<p><a id="earlier" href="{_e(earlier)}">earlier messages</a></p>'
    if not newest:
        latest = _session_query(session_id, before=None, inputs_after=inputs_after)
        links += f'<p><a id="newest" href="{_e(latest)}">newest messages</a></p>'
    events = ""
    if newest and tail.position is not None:
        shown_from = tail.messages[0].seq if tail.messages else tail.position.top + 1
        follow = urllib.parse.urlencode(
            {
                "cursor": encode_cursor(session_tag(session_id), tail.position),
                "from": shown_from,
            }
        )
        events = f' data-events="{_e(f"{base}/events?{follow}")}"'
    rendered = "".join(_whole_html(whole) for whole in tail.messages)
    return f'{links}<div id="transcript"{events}>{rendered}</div>'


def _whole_html(whole: Whole) -> str:
    if isinstance(whole.message, MalformedRecord):  # its quarantine waits for the operator
        return (
            f'<div class="malformed" data-seq="{whole.seq}">the transcript holds a malformed'
            f" record: {_e(str(whole.message))}</div>"
        )
    return message_html(whole.message)


def _followed(
    session_id: str, shown_from: int, position: Position, shown: Shown
) -> tuple[PageFeed, Position, list[str]]:
    """A page's feed, complete, from what its stream read when it opened
    (`_store.shown_messages`), the position the stream opens at, and the first updates.

    The feed knows the tags of the final messages the page shows (when the newest is
    still the page's: no rewrite since) and holds copies of the open messages it follows.
    An open message that changed since the page's read is sent whole now (the first
    updates): one final now is known from then on, as one the page rendered final (a
    rewrite that keeps it holds it back); one still open is followed from its version now.
    One before the page's first (`shown_from`: a cursor from after a rewrite may follow
    one) is not shown: left at the cursor's version, its changes are no update."""
    known: dict[int, str] = {}
    top_id = shown.ids.get(position.top)
    if position.top and top_id is not None and message_tag(top_id) == position.top_tag:
        open_seqs = {held.seq for held in position.open}
        known = {
            seq: message_tag(message_id)
            for seq, message_id in shown.ids.items()
            if seq not in open_seqs
        }
    copies: dict[int, tuple[str, Any]] = {}
    first: list[dict[str, Any]] = []
    versions = {held.seq: held.version for held in position.open}
    held: list[Held] = []
    followed: set[int] = set()
    for whole in shown.held:
        if not isinstance(whole.message, Message) or whole.seq < shown_from:
            continue  # the stream's own read says why; not on the page
        followed.add(whole.seq)
        if whole.version != versions[whole.seq]:
            first.append({"seq": whole.seq, "html": message_html(whole.message)})
        tag = message_tag(whole.message_id)
        if whole.open:
            copies[whole.seq] = (whole.message.role, whole.message.to_json()["data"])
            held.append(Held(whole.seq, tag, whole.version))
        else:
            # Final now, and the page shows it as stored (sent whole above: its version
            # moved when it finished): no change follows, no copy.
            known[whole.seq] = tag
    held += [item for item in position.open if item.seq not in followed]
    moved = Position(position.top, position.top_tag, tuple(sorted(held, key=lambda h: h.seq)))
    open_tags = {item.seq: item.tag for item in moved.open if item.seq >= shown_from}
    feed = PageFeed(session_id, shown_from, known, copies, open_tags)
    return feed, moved, sse_blocks(first, encode_cursor(session_tag(session_id), moved))


def _nameable(row: Mapping[str, Any], *columns: str) -> bool:
    """Whether a listed row's ids (`columns`; a session's own by default) are the ones
    stored: one that is not UTF-8 text is shown replaced, and `malformed` says so."""
    return _store.malformed_columns(row).isdisjoint(columns or ("session.id",))


def _query(scope: Scope) -> dict[str, str]:
    return _fields(bytes(scope["query_string"]), "query")


def _parse_form(body: bytes) -> dict[str, str]:
    return _fields(body, "form")


def _fields(encoded: bytes, what: str) -> dict[str, str]:
    """A query's or a form's fields, decoded strictly: bytes that are not percent-encoded
    UTF-8 are a 400 saying so, never replacement characters searched for, paged after or
    acted on. A raw byte past ASCII is refused too: a browser percent-encodes every one."""
    try:
        text = encoded.decode("ascii")
    except UnicodeDecodeError:
        raise HTTPError(400, f"the {what} is not percent-encoded UTF-8: a raw byte") from None
    try:
        return dict(urllib.parse.parse_qsl(text, encoding="utf-8", errors="strict"))
    except UnicodeDecodeError:
        raise HTTPError(400, f"the {what} is not UTF-8 text (percent-encoded)") from None


async def _read_body(receive: Receive) -> bytes:
    body = b""
    while True:
        event = await receive()
        body += bytes(event.get("body", b""))
        if len(body) > MAX_FORM:
            raise HTTPError(413, "the form is too large")
        if not event.get("more_body", False):
            return body


async def _respond(
    send: Send,
    status: int,
    body: bytes,
    *,
    content_type: str = "text/html; charset=utf-8",
    extra: tuple[tuple[bytes, bytes], ...] = (),
) -> None:
    headers = [
        (b"content-type", content_type.encode()),
        (b"content-length", str(len(body)).encode()),
        (b"x-frame-options", b"DENY"),
        (b"content-security-policy", b"default-src 'self' 'unsafe-inline'"),
        *extra,
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _redirect(
    send: Send, location: str, *, extra: tuple[tuple[bytes, bytes], ...] = ()
) -> None:
    headers = [(b"location", location.encode()), (b"content-length", b"0"), *extra]
    await send({"type": "http.response.start", "status": 303, "headers": headers})
    await send({"type": "http.response.body", "body": b""})


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        event = await receive()
        if event["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif event["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def _cancel_on_disconnect(receive: Receive, scope: trio.CancelScope) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


async def _until_signal() -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for _ in signals:
            return


# ---------------------------------------------------------------------------------------------
# The command


class UsageError(Exception):
    """A console setting the operator must change (exit 2)."""


def check_settings(bind: str, token: str | None, keep_alive: float = KEEP_ALIVE) -> tuple[str, int]:
    host, port = _metrics.parse_bind(bind)
    if token is not None and len(token) < 16:
        raise UsageError("the token must be at least 16 characters")
    if not keep_alive > 0:  # `check_keep_alive`, said as the flag's
        raise UsageError(f"--keep-alive must be a positive number of seconds, got {keep_alive}")
    if token is None and not is_loopback(host):
        raise UsageError(
            f"refusing to serve the console on {host!r} without a token: pass --token or"
            " set TRIO_SESSIONS_CONSOLE_TOKEN (or bind to 127.0.0.1)"
        )
    return host, port


async def serve_console(
    store: Any,
    *,
    store_name: str,
    bind: str,
    token: str | None,
    read_only: bool,
    keep_alive: float = KEEP_ALIVE,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the console until SIGTERM/SIGINT or cancellation; `task_status.started(urls)`.
    An idle event stream writes an SSE comment every `keep_alive` seconds (`inf`: never)."""
    import hypercorn.config  # the `console` extra
    import hypercorn.trio

    from ._runtime import open_runtime

    check_settings(bind, token, keep_alive)
    async with open_runtime(store, None, owner_id="console") as runtime:
        config = hypercorn.config.Config()
        config.bind = [bind]
        config.errorlog = logging.getLogger("hypercorn.error")
        config.accesslog = None
        config.graceful_timeout = 1.0
        app = Console(runtime, store_name, Guard(token, read_only), keep_alive=keep_alive)

        async def serve(task_status: trio.TaskStatus[list[str]]) -> None:
            await hypercorn.trio.serve(
                app,
                config,
                shutdown_trigger=_until_signal,
                task_status=task_status,
            )

        async with trio.open_nursery() as nursery:
            try:
                urls: list[str] = await nursery.start(serve)
            except (OSError, BaseExceptionGroup) as exc:  # hypercorn's nursery: in a group
                refused = _only(exc, OSError)  # the address is in use, or not this host's
                if refused is None:
                    raise
                reason = refused.strerror or str(refused)
                raise UsageError(f"cannot listen on {bind}: {reason}") from None
            logger.info("console listening on %s", " ".join(urls), extra={"urls": urls})
            task_status.started(urls)


ENV_TOKEN = "TRIO_SESSIONS_CONSOLE_TOKEN"


def add_parser(commands: Any) -> None:
    """Register the `console` command on the CLI's subparsers."""
    parser = commands.add_parser(
        "console",
        help="serve the operator console in the browser",
        description="Serve the operator console (needs the 'console' extra). On a non-loopback"
        f" address a token is required (--token or {ENV_TOKEN}).",
    )
    parser.add_argument("--store", required=True, metavar="PATH_OR_URL")
    parser.add_argument(
        "--schema",
        metavar="S",
        help=f"PostgreSQL schema of the store (env {ENV_SCHEMA}; default public; URL only)",
    )
    parser.add_argument("--bind", default="127.0.0.1:8080", metavar="HOST:PORT")
    parser.add_argument("--token", default=None, help=f"access token (env {ENV_TOKEN})")
    parser.add_argument("--read-only", action="store_true", help="hide and refuse every action")
    parser.add_argument(
        "--keep-alive",
        default=KEEP_ALIVE,
        type=float,
        metavar="SECONDS",
        help="an idle event stream sends a comment this often, so proxies keep it open"
        f" (default {KEEP_ALIVE:g}; inf: never)",
    )
    parser.add_argument(
        "--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS, metavar="LEVEL"
    )


def run(
    args: Any, environ: Mapping[str, str], *, check_store: Callable[[str, str | None], int]
) -> int:
    """The `console` command: returns the exit status (2 for a setting to change; else
    `check_store`'s when it refuses the store: the console never creates or migrates one)."""
    from ._worker import schema_setting, store_of_url

    token = args.token if args.token is not None else environ.get(ENV_TOKEN) or None
    schema = schema_setting(args.schema, environ)
    try:
        check_settings(args.bind, token, args.keep_alive)
        store = store_of_url(args.store, schema)
    except (UsageError, ValueError) as exc:
        print(f"error: {exc}", flush=True, file=sys.stderr)
        return 2
    if refused := check_store(args.store, schema):
        return refused
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    serve = functools.partial(
        serve_console,
        store,
        store_name=display_name(args.store),
        bind=args.bind,
        token=token,
        read_only=args.read_only,
        keep_alive=args.keep_alive,
    )
    try:
        trio.run(serve)
    except (UsageError, BaseExceptionGroup) as exc:
        # Raised through the runtime's and the server's nurseries: perhaps in a group.
        usage = _only(exc, UsageError)
        if usage is None:
            raise
        print(f"error: {usage}", flush=True, file=sys.stderr)
        return 2
    return 0


def _only(exc: BaseException, kind: type[E]) -> E | None:
    """`exc` when it is a `kind`, or the one exception of exception groups holding nothing
    else (trio's nurseries group what they raise), else None."""
    if isinstance(exc, kind):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        matched, rest = exc.split(kind)
        if matched is not None and rest is None and len(matched.exceptions) == 1:
            return _only(matched.exceptions[0], kind)
    return None


def _utc_time(epoch_ms: Any) -> str:
    """A store time (epoch milliseconds) as a UTC time to the millisecond; a value that is
    not one (another tool's write) as it is, with its unit."""
    try:
        moment = datetime.datetime.fromtimestamp(epoch_ms / 1000, tz=datetime.UTC)
    except (TypeError, ValueError, OverflowError, OSError):
        return f"{epoch_ms} ms"
    return moment.strftime("%Y-%m-%d %H:%M:%S.") + f"{moment.microsecond // 1000:03d} UTC"
