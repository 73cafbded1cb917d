"""The exit codes of the `walbuf` command, defined once: the CLI's help, README and `walbuf-cron` use this table.

The codes follow sysexits.h where one fits. ``retry`` marks what a later
attempt can fix by itself (an outage, a busy lock): `walbuf-cron` logs those
and exits 0; anything else keeps its code so that cron mails it.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass

from .errors import (
    BufferCorruptError,
    BufferFullError,
    BufferNotFoundError,
    BufferNotWritableError,
    BufferUnavailableError,
    ConfigError,
    NotABufferError,
    SchemaOutdatedError,
    SchemaTooNewError,
    SyncLockedError,
    TargetConflictError,
    UntrustedPathError,
    UploadError,
    WalbufError,
)


@dataclass(frozen=True)
class ExitCode:
    code: int
    meaning: str
    retry: bool = False  # a later attempt may succeed without a person


OK = ExitCode(0, "success, or nothing to sync")
ERROR = ExitCode(1, "other walbuf error (the message says what to do); for `doctor`: something needs a person")
USAGE = ExitCode(2, "bad command-line usage")
QUARANTINED = ExitCode(
    3,
    "`sync` (or a `--follow` at its end) sent the rest, but W&B refuses some records or settings for good: they"
    " are quarantined (`walbuf records --quarantined` shows them); or a shard of a directory buffer is damaged or holds"
    " what walbuf never writes, and what could be read of it was taken in (`walbuf doctor` says what to do)",
)
LOCKED = ExitCode(11, "another `walbuf sync` of this buffer is running", retry=True)
DATAERR = ExitCode(
    65, "the buffer is corrupt, not a walbuf buffer, or at a schema this walbuf cannot read without changing it"
)
NOINPUT = ExitCode(66, "the buffer does not exist")
UNAVAILABLE = ExitCode(
    69,
    "the buffer's PostgreSQL server cannot be reached, or had no connection to spare; or a directory buffer's"
    " hub was being written by a sync (maybe on another host) as it was read; retry later",
    retry=True,
)
FULL = ExitCode(
    74,
    "a disk the buffer is on is full (or a quota is reached): nothing written is damaged, and a sync sends"
    " nothing it could not mark synced; free space (`walbuf prune` removes synced records), then run it again",
)
TEMPFAIL = ExitCode(75, "W&B unreachable or failed: nothing was marked synced; retry later", retry=True)
NOPERM = ExitCode(
    77,
    "this process may not write the buffer (`records`, `status` and `doctor` still read it), or the buffer"
    " holds a file or folder walbuf does not trust: another account's, a symbolic link, or one others may"
    " write (the message names it; see docs/security.md)",
)
SIGINT = ExitCode(130, "interrupted by Ctrl-C (SIGINT): nothing the cut-off upload sent is marked synced")
SIGTERM = ExitCode(143, "stopped by SIGTERM: nothing the cut-off upload sent is marked synced")
CONFIG = ExitCode(
    78,
    "an unusable setting, missing or refused W&B credentials, a setting that conflicts with what the buffer holds,"
    " or a directory buffer that another host syncs (where locks do not span hosts: `walbuf sync --take-over`) or that"
    " holds an older walbuf's live shards a sync on their host must take in first (the message says which)",
)

EXIT_CODES: tuple[ExitCode, ...] = (
    OK,
    ERROR,
    USAGE,
    QUARANTINED,
    LOCKED,
    DATAERR,
    NOINPUT,
    UNAVAILABLE,
    FULL,
    TEMPFAIL,
    NOPERM,
    CONFIG,
    SIGINT,
    SIGTERM,
)

# What a command that does not sync can end with (records, status, doctor,
# prune): never a sync's lock, quarantine or W&B.
NOT_SYNCING: tuple[ExitCode, ...] = tuple(c for c in EXIT_CODES if c not in (QUARANTINED, LOCKED, TEMPFAIL))

# Most specific first: the first class an error is an instance of decides.
_FOR_ERROR: tuple[tuple[type[WalbufError], ExitCode], ...] = (
    (SyncLockedError, LOCKED),
    (UploadError, TEMPFAIL),
    (BufferNotFoundError, NOINPUT),
    (BufferUnavailableError, UNAVAILABLE),
    (BufferNotWritableError, NOPERM),
    (UntrustedPathError, NOPERM),
    (BufferFullError, FULL),
    (BufferCorruptError, DATAERR),
    (NotABufferError, DATAERR),
    (SchemaTooNewError, DATAERR),
    (SchemaOutdatedError, DATAERR),
    (ConfigError, CONFIG),
    (TargetConflictError, CONFIG),
    (WalbufError, ERROR),
)


def for_error(exc: WalbufError) -> ExitCode:
    """The exit code the CLI ends with for ``exc``."""
    return next(code for kind, code in _FOR_ERROR if isinstance(exc, kind))


def help_text(codes: tuple[ExitCode, ...] = EXIT_CODES) -> str:
    """The table (or the ``codes`` a command can end with) as the CLI's --help shows it."""
    lines = ["\b", "Exit codes:"]
    for c in codes:
        lines += textwrap.wrap(c.meaning, 72, initial_indent=f"  {c.code:<3} ", subsequent_indent=" " * 6)
    return "\n".join(lines) + "\n"


def markdown_table() -> str:
    """The table as README shows it (a test keeps the two the same)."""
    lines = ["| code | meaning |", "|---|---|"]
    lines += [f"| {c.code} | {c.meaning} |" for c in EXIT_CODES]
    return "\n".join(lines) + "\n"
