"""walbuf: a local write-ahead-log buffer for experiment metrics, with offline sync into W&B.

Public API::

    w = walbuf.init("runs/exp1.db", writer="eval-3", step_axis="eval_step", run="exp1")
    w.log({"eval/accuracy": 0.91})
    w.log({"weights": walbuf.Histogram(layer.weight)})   # bins and counts, made now
    w.log({"samples": walbuf.Image(array, caption="val")})   # PNG, kept in the record
    walbuf.log({...})                      # the writer walbuf.init made in this process
    @walbuf.logged("runs/exp1.db", writer="eval", step_axis="eval_step")
    def evaluate(checkpoint) -> dict: ...
    for record in walbuf.read("runs/exp1.db"): ...
    walbuf.sync("runs/exp1.db")            # `walbuf sync`
    walbuf.follow("runs/exp1.db")          # `walbuf sync --follow`
    walbuf.status("runs/exp1.db")          # `walbuf status`
    walbuf.prune("runs/exp1.db", older_than=7 * 86400)   # `walbuf prune`
    walbuf.doctor("runs/exp1.db")          # `walbuf doctor`

Every function that takes a buffer takes a path, a URL, or a Buffer that
:func:`open_buffer` resolved.
"""

from .buffer import Buffer, DatabaseBuffer, Location, open_buffer, read
from .decorator import logged
from .directory import DirectoryBuffer
from .errors import (
    ArgumentTypeError,
    BufferBusyError,
    BufferCorruptError,
    BufferFullError,
    BufferNotFoundError,
    BufferNotWritableError,
    BufferUnavailableError,
    ConfigError,
    KeyConflictError,
    MetricTypeError,
    MetricValueError,
    MissingExtraError,
    NotABufferError,
    NoWriterError,
    OlderShardsError,
    RecordNotDurableError,
    SchemaOutdatedError,
    SchemaTooNewError,
    StepOrderError,
    StorageError,
    SyncHostError,
    SyncLockedError,
    TargetConflictError,
    TargetRefusedError,
    UntrustedPathError,
    UploadError,
    WalbufError,
    WriterClosedError,
    WriterConflictError,
)
from .histogram import Histogram
from .image import Image
from .ops import (
    BufferStatus,
    DoctorReport,
    Finding,
    PruneResult,
    RunStatus,
    ShardStatus,
    SyncStatus,
    WriterStatus,
    doctor,
    prune,
    status,
)
from .record import Record, Value
from .settings import WriterSettings, default_writer_id
from .store import Durability, Target
from .syncer import ConfigChange, FollowResult, RunSync, SyncMode, SyncResult, follow, sync
from .writer import Writer, init, log

__version__ = "0.1.0"

__all__ = [
    # writing
    "init",
    "log",
    "logged",
    "Writer",
    "Histogram",
    "Image",
    "WriterSettings",
    "Durability",
    "default_writer_id",
    # reading and operations
    "open_buffer",
    "Buffer",
    "DatabaseBuffer",
    "DirectoryBuffer",
    "Location",
    "read",
    "Record",
    "Value",
    "sync",
    "follow",
    "FollowResult",
    "SyncMode",
    "SyncResult",
    "RunSync",
    "ConfigChange",
    "Target",
    "status",
    "BufferStatus",
    "RunStatus",
    "WriterStatus",
    "SyncStatus",
    "ShardStatus",
    "prune",
    "PruneResult",
    "doctor",
    "DoctorReport",
    "Finding",
    # errors
    "WalbufError",
    "ConfigError",
    "KeyConflictError",
    "ArgumentTypeError",
    "StorageError",
    "BufferNotFoundError",
    "NotABufferError",
    "BufferUnavailableError",
    "BufferNotWritableError",
    "UntrustedPathError",
    "BufferCorruptError",
    "BufferBusyError",
    "BufferFullError",
    "RecordNotDurableError",
    "SchemaTooNewError",
    "SchemaOutdatedError",
    "MetricTypeError",
    "MetricValueError",
    "MissingExtraError",
    "StepOrderError",
    "WriterConflictError",
    "TargetConflictError",
    "SyncLockedError",
    "OlderShardsError",
    "SyncHostError",
    "TargetRefusedError",
    "UploadError",
    "WriterClosedError",
    "NoWriterError",
]
