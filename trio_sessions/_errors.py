"""The one error hierarchy of trio_sessions.

Every error the library raises on purpose derives from `TrioSessionsError`, except bad
arguments, which raise the builtin `ValueError`/`TypeError` before anything is written.
None of these is an ExceptionGroup: trio code can catch each one by name.
"""

from __future__ import annotations

from collections.abc import Sequence


class TrioSessionsError(Exception):
    """Root of every error trio_sessions raises on purpose."""


class StoreError(TrioSessionsError):
    """The durable store failed (I/O error, a schema we cannot use, a lock that never cleared).

    The failed transaction was rolled back: durable state is as it was before the call.
    """


class StoreLost(StoreError):
    """The store can never be written again by this runtime (its SQLite file was deleted or
    replaced under it): the runtime ends with it rather than failing every call for ever."""


class OutcomeUnknown(StoreError):
    """Whether the call's write landed is unknown (a PostgreSQL COMMIT whose reply was lost
    and could not be read back within the engine's bound): durable state is as it was
    before the call, or as the call left it."""


class SchemaTooNew(StoreError):
    """The database was written by a newer trio_sessions; it is left untouched."""


class LeaseLost(TrioSessionsError):
    """A fenced write found its claim gone, taken over or expired; nothing was written."""


class StaleContext(LeaseLost):
    """A `DrainContext` (or its writer) used after its drain returned: a `LeaseLost` to the
    drain, as DESIGN §5 words it, but the drain's own defect - its claim is not lost, and a
    drain that fails with it ends `failed`. Private: not in the public surface."""


class InputConflict(TrioSessionsError):
    """An input id that is already stored belongs to a different session, or was stored with
    a different payload."""


class SessionBusy(TrioSessionsError):
    """The session is busy - a claim is held, or inputs that are due wait untaken - and the
    call refuses to act on a busy session (`submit(on_busy="reject")`, `truncate`).
    Nothing was written."""


class DuplicateSettlement(TrioSessionsError):
    """A tool call was settled a second time; the transcript keeps the first settlement."""


class MessageFinished(TrioSessionsError, ValueError):
    """A write to an assistant message that was already finished; nothing was written.

    Also a `ValueError`, as it was before it became public.
    """


class UnknownToolCall(TrioSessionsError):
    """A settlement named a tool call id that the assistant message never started."""


class MalformedRecord(TrioSessionsError):
    """A durable row could not be decoded.

    Carries the `table`, the row's `key` and the readable `reasons` (one line each).
    """

    def __init__(self, table: str, key: str, reasons: Sequence[str]) -> None:
        self.table = table
        self.key = key
        self.reasons = tuple(_one_line(reason) for reason in reasons)
        super().__init__(f"malformed {table} row {key!r}: " + "; ".join(self.reasons))


def _one_line(reason: str) -> str:
    """A reason as one readable line: a character that prints nothing (a NUL, a newline -
    quoted from the bad record itself, e.g. an unknown key) is shown escaped, as `repr`
    shows it. The reasons are stored (a quarantine, a message or input set aside), and
    PostgreSQL's TEXT holds no NUL: the driver refused the whole write."""
    if reason.isprintable():
        return reason
    return "".join(char if char.isprintable() else repr(char)[1:-1] for char in reason)
