"""Operations on a buffer besides writing and syncing: status, prune, doctor.

Each takes a buffer location (or a Buffer) and returns a frozen result; the
CLI only formats it.
"""

from .doctor import DoctorReport, Finding, doctor
from .prune import PruneResult, parse_age, prune
from .status import BufferStatus, RunStatus, ShardStatus, SyncStatus, WriterStatus, status

__all__ = [
    "BufferStatus",
    "DoctorReport",
    "Finding",
    "PruneResult",
    "RunStatus",
    "ShardStatus",
    "SyncStatus",
    "WriterStatus",
    "doctor",
    "parse_age",
    "prune",
    "status",
]
