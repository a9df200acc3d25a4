"""Durable, exclusive, interruptible and crash-recoverable work per session, for trio.

The public surface: everything else lives in private modules.
"""

# Layering, bottom up (imports only point down, type-only ones aside; nothing below the
# runtime knows of it):
#
# * _errors, _model: exceptions and frozen attrs records - no behaviour.
# * _codec, _decisions, _transcript: pure. The strict JSON codec; the claim, lease and
#   recovery rules as functions of (row, now, owner); the assistant message state machine.
#   No I/O and no clock: tests run them exhaustively.
# * _store: every fenced operation, written once as a synchronous transaction script
#   `op(tx, *args)` in the SQL both dialects share. It decides nothing the pure layer
#   decides, and knows no driver.
# * _backend (the Tx/Executor/StoreBackend protocols), _handoff (the one group-commit queue),
#   _sqlite and _postgres: the engines that run those operations off the event loop, one
#   writer path each, with the lease clock read after the operation's locks.
# * _coordinator, _lease, _recovery, _signals, _stream: the trio state - the per-session
#   registry, heartbeats and self-fencing, the recovery pass, and watchers and event streams
#   fed by local writes and the change signal.
# * The runtime - no SQL, no driver import: _validate (argument checks), _drain (what a drain
#   sees: DrainContext, AssistantWriter), _busy (the choreography: claim handoff, drain loop,
#   finalizer, local registry), _loops (the change, recovery, owner and due-input loops),
#   _verbs (`Runtime`: the public verbs, shared state, token keeping and shutdown), and
#   _runtime on top (`open_runtime`/`serve_runtime`: a runtime's life from open to close).
# * Entry points on top: _worker and _cli (`python -m trio_sessions`), testing (public
#   helpers for users' tests), demo, bench and soak.

# Imported under a private name: `dir(trio_sessions)` shows the public surface only.
import typing as _typing

from ._drain import AssistantWriter as AssistantWriter
from ._drain import DrainContext as DrainContext
from ._errors import DuplicateSettlement as DuplicateSettlement
from ._errors import InputConflict as InputConflict
from ._errors import LeaseLost as LeaseLost
from ._errors import MalformedRecord as MalformedRecord
from ._errors import MessageFinished as MessageFinished
from ._errors import OutcomeUnknown as OutcomeUnknown
from ._errors import SchemaTooNew as SchemaTooNew
from ._errors import SessionBusy as SessionBusy
from ._errors import StoreError as StoreError
from ._errors import TrioSessionsError as TrioSessionsError
from ._errors import UnknownToolCall as UnknownToolCall
from ._model import AssistantData as AssistantData
from ._model import Claim as Claim
from ._model import Input as Input
from ._model import Message as Message
from ._model import Outcome as Outcome
from ._model import RecoveryReport as RecoveryReport
from ._model import RuntimeStatistics as RuntimeStatistics
from ._model import TextPart as TextPart
from ._model import ToolPart as ToolPart
from ._runtime import Runtime as Runtime
from ._runtime import open_runtime as open_runtime
from ._runtime import serve_runtime as serve_runtime
from ._sqlite import SQLiteStore as SQLiteStore
from ._stream import StreamEvent as StreamEvent
from ._transcript import unanswered as unanswered

if _typing.TYPE_CHECKING:
    from ._postgres import PostgresStore as PostgresStore

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # psycopg is an optional extra: `PostgresStore` imports it only when it is asked for.
    if name == "PostgresStore":
        from ._postgres import PostgresStore

        return PostgresStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    # `PostgresStore` is public though it is imported on first use only.
    return sorted({*globals(), "PostgresStore"})


# The 0.1 name of `SQLiteStore`, kept through 0.x.
Store = SQLiteStore
