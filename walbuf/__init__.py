"""walbuf: a local write-ahead-log buffer for experiment metrics, with offline sync into W&B.

Public API::

    w = walbuf.init("runs/exp1.db", writer="eval-3", step_axis="eval_step", run="exp1")
    w.log({"eval/accuracy": 0.91})
    walbuf.log({...})                      # the writer walbuf.init made in this process
    @walbuf.logged("runs/exp1.db", writer="eval", step_axis="eval_step")
    def evaluate(checkpoint) -> dict: ...
    for record in walbuf.read("runs/exp1.db"): ...
    walbuf.sync("runs/exp1.db")            # what `walbuf sync` does
    walbuf.status("runs/exp1.db")          # what `walbuf status` shows
"""

from .decorator import logged
from .errors import (
    ConfigError,
    BufferBusyError,
    BufferCorruptError,
    BufferFullError,
    BufferNotFoundError,
    BufferNotWritableError,
    BufferUnavailableError,
    MetricTypeError,
    MetricValueError,
    NoWriterError,
    SchemaTooNewError,
    StepOrderError,
    StorageError,
    SyncLockedError,
    TargetConflictError,
    UploadError,
    WalbufError,
    WriterClosedError,
    WriterConflictError,
)
from .record import Record, Value
from .status import BufferStatus, RunStatus, SyncStatus, WriterStatus, status
from .storage import read
from .syncer import RunSync, SyncResult, sync
from .writer import Writer, default_writer_id, init, log

__version__ = "0.1.0"

__all__ = [
    "init",
    "log",
    "logged",
    "read",
    "sync",
    "status",
    "SyncResult",
    "RunSync",
    "BufferStatus",
    "RunStatus",
    "WriterStatus",
    "SyncStatus",
    "Writer",
    "Record",
    "Value",
    "default_writer_id",
    "WalbufError",
    "ConfigError",
    "StorageError",
    "BufferNotFoundError",
    "BufferUnavailableError",
    "BufferNotWritableError",
    "BufferCorruptError",
    "BufferBusyError",
    "BufferFullError",
    "SchemaTooNewError",
    "MetricTypeError",
    "MetricValueError",
    "StepOrderError",
    "WriterConflictError",
    "TargetConflictError",
    "SyncLockedError",
    "UploadError",
    "WriterClosedError",
    "NoWriterError",
]
