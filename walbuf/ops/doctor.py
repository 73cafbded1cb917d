"""`walbuf doctor`: check a buffer and say what, if anything, needs a person.

Checks a SQLite file's integrity (SQLite's integrity_check) and journal mode,
or that a PostgreSQL server answers; then the schema revision, what is
pending, and the log of syncs: an upload that a dead syncer left "running"
(its records will be sent again, maybe twice), or a last sync that failed.
Of a directory buffer, also each shard not yet in the hub. Writer and sync
locks are kernel file locks (in PostgreSQL, advisory locks of a session),
released when their process dies, so they cannot go stale.

Doctor changes nothing; it needs only read access.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..buffer import DatabaseBuffer, Location, open_buffer
from ..directory import DirectoryBuffer
from .doctor_database import examine_database
from .doctor_directory import examine_directory
from .findings import Finding

__all__ = ["DoctorReport", "Finding", "doctor"]


@dataclass(frozen=True)
class DoctorReport:
    buffer: str
    findings: tuple[Finding, ...]

    @property
    def healthy(self) -> bool:
        """True when nothing needs a person."""
        return all(f.ok for f in self.findings)


def doctor(buffer: Location) -> DoctorReport:
    """Examine ``buffer``; what needs a person is a finding that is not ok.

    Raises BufferNotFoundError if there is no buffer, NotABufferError if
    the location holds something else (a database of another application,
    a directory that is not a directory buffer).
    """
    located = open_buffer(buffer)
    findings: list[Finding] = []
    # The one caller that looks at the kind: doctor examines what each keeps
    # on disk or on its server (files and their owners, shards, a server's
    # settings), which is the kind's own, in its own module.
    if isinstance(located, DirectoryBuffer):
        examine_directory(findings, located)
    elif isinstance(located, DatabaseBuffer):
        examine_database(findings, located)
    else:
        raise TypeError(f"doctor does not know buffers of kind {type(located).__name__}")
    return DoctorReport(located.location, tuple(findings))
