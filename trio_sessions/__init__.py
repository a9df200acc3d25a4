"""Durable, exclusive, interruptible and crash-recoverable work per session, for trio.

The public surface: everything else lives in private modules.
"""

from ._errors import DuplicateSettlement as DuplicateSettlement
from ._errors import InputConflict as InputConflict
from ._errors import LeaseLost as LeaseLost
from ._errors import MalformedRecord as MalformedRecord
from ._errors import MessageFinished as MessageFinished
from ._errors import SchemaTooNew as SchemaTooNew
from ._errors import StoreError as StoreError
from ._errors import TrioSessionsError as TrioSessionsError
from ._errors import UnknownToolCall as UnknownToolCall
from ._model import AssistantData as AssistantData
from ._model import Claim as Claim
from ._model import Input as Input
from ._model import Message as Message
from ._model import Outcome as Outcome
from ._model import RecoveryReport as RecoveryReport
from ._model import TextPart as TextPart
from ._model import ToolPart as ToolPart
from ._runtime import AssistantWriter as AssistantWriter
from ._runtime import DrainContext as DrainContext
from ._runtime import Runtime as Runtime
from ._runtime import open_runtime as open_runtime
from ._runtime import serve_runtime as serve_runtime
from ._sqlite import SQLiteStore as SQLiteStore

__version__ = "0.1.0"

# The 0.1 name of `SQLiteStore`, kept through 0.x.
Store = SQLiteStore
