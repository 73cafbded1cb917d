"""The exceptions walbuf raises.

Every error walbuf raises on purpose is a :class:`WalbufError`. Errors about
the caller's input also derive from the built-in class a caller would expect
(``TypeError`` for a value of the wrong kind, ``ValueError`` for a step that
goes backwards), so ``except ValueError`` keeps working.
"""

from __future__ import annotations


class WalbufError(Exception):
    """Base class of every error walbuf raises on purpose."""


NOTHING_WRITTEN = "nothing was written"
NOTHING_STORED = "nothing was stored"


class _Refusal(WalbufError):
    """What was given to be stored is refused: ``problem`` says what is wrong with it, ``outcome`` what happened.

    The message is the problem with the outcome after it in brackets ("...
    (nothing was written)"); a caller that reports the problem elsewhere
    (the syncer, quarantining a record an older walbuf stored) reads
    ``problem``.
    """

    def __init__(self, problem: str, outcome: str | None = None) -> None:
        super().__init__(problem, outcome)  # both in args: the error pickles (a pool worker raises it)
        self.problem, self.outcome = problem, outcome

    def __str__(self) -> str:
        return self.problem if self.outcome is None else f"{self.problem} ({self.outcome})"


class MetricTypeError(_Refusal, TypeError):
    """A metric value or key is of a kind walbuf does not store. Nothing was written."""


class MetricValueError(_Refusal, ValueError):
    """A metric key is unusable (empty, duplicated by flattening, reserved). Nothing was written."""


class KeyConflictError(MetricValueError):
    """Another writer of the run plots the same W&B key against another step axis (see walbuf.store.claims).

    Nothing was written. Give one of the writers a prefix.
    """


class ArgumentTypeError(WalbufError, TypeError):
    """An argument of the wrong type: a step that is not an int, a setting walbuf does not know. Nothing was written."""


class StepOrderError(WalbufError, ValueError):
    """An explicit step is smaller than the writer's last step. Nothing was written."""


class StorageError(WalbufError):
    """Base class of errors about the buffer itself (not found, unreadable, too new)."""


class BufferNotFoundError(StorageError):
    """Reading a buffer that does not exist (reading never creates one)."""


class BufferUnavailableError(StorageError):
    """The buffer cannot be read or written now, and a later attempt can: its PostgreSQL server cannot be reached,
    or (a directory buffer's hub) another host's sync is changing it. Nothing was written."""


class BufferNotWritableError(StorageError):
    """This process may not write the buffer (its file, directory or lock files). Nothing was written."""


class UntrustedPathError(StorageError):
    """A file or folder in a buffer that walbuf does not trust: another account's, a link, or one others may write.

    walbuf never opens, follows or writes it (see docs/security.md); the
    message names it, its owner and what to do.
    """


class ConfigError(WalbufError, ValueError):
    """A missing or unusable setting: no buffer given, a bad URL, an empty writer id, ..."""


class BufferCorruptError(StorageError):
    """The buffer's file is damaged, or is not a database at all."""


class NotABufferError(StorageError):
    """The location holds something else: a database of another application, a directory that is not a directory buffer.

    Nothing there was changed.
    """


class SchemaTooNewError(StorageError):
    """The buffer was written by a newer walbuf; this one will not touch it."""


class SchemaOutdatedError(StorageError):
    """The buffer has an older schema, and reading it may not upgrade it: write it once (walbuf sync, a writer)."""


class BufferFullError(StorageError):
    """The disk (or SQLite's page limit) is full. The record was not written; earlier ones are intact."""


class BufferBusyError(StorageError):
    """The database stayed locked by other processes for longer than the busy timeout. Nothing was written."""


class RecordNotDurableError(StorageError):
    """The record was written, and a sync sends it, but it could not be made durable against a power loss (its fsync
    failed: the disk or the filesystem's server may be failing). Its step is spent."""


class WriterConflictError(WalbufError):
    """Another live writer already uses this writer id in this run, or uses it with another step axis; or a
    PostgreSQL writer's lease on its id was taken over. Nothing was written."""


# The errors a log() raises only where nothing of its record was stored: it gives its step back (see
# walbuf.writer.Writer.log). Any other error, an interruption above all, may come after the record was stored.
NOTHING_STORED_ERRORS = (
    BufferBusyError,
    BufferFullError,
    BufferNotWritableError,
    BufferUnavailableError,
    WriterConflictError,
)


class TargetConflictError(WalbufError, ValueError):
    """A W&B run id, project or entity that differs from what the buffer holds for the run."""


class TargetRefusedError(ConfigError):
    """W&B refused the run's target: no such entity or project, no permission there, a deleted run's id.

    The run stays blocked until a sync gives another target (--project, --entity, --run-id).
    """


class SyncLockedError(WalbufError):
    """Another syncer of the same buffer is running."""


class SyncHostError(ConfigError):
    """A directory buffer on a filesystem whose locks do not span hosts is synced from another host. Nothing was
    changed."""


class OlderShardsError(ConfigError):
    """A directory buffer holds live shards of an older walbuf that only a sync on their own host can take in; the
    hub was not upgraded, and nothing was sent."""


class UploadError(WalbufError):
    """W&B could not be reached or did not confirm the upload; nothing was marked synced."""


class WriterClosedError(WalbufError):
    """log() on a writer that was closed."""


class NoWriterError(WalbufError):
    """walbuf.log() was called in a process where walbuf.init() was not."""


class MissingExtraError(WalbufError, ImportError):
    """A feature needs a package that is not installed; the message names the extra that brings it."""


__all__ = [
    "WalbufError",
    "MetricTypeError",
    "MetricValueError",
    "ArgumentTypeError",
    "StepOrderError",
    "StorageError",
    "BufferNotFoundError",
    "BufferUnavailableError",
    "BufferNotWritableError",
    "UntrustedPathError",
    "ConfigError",
    "BufferCorruptError",
    "NotABufferError",
    "SchemaTooNewError",
    "SchemaOutdatedError",
    "BufferBusyError",
    "BufferFullError",
    "WriterConflictError",
    "TargetConflictError",
    "TargetRefusedError",
    "SyncLockedError",
    "UploadError",
    "WriterClosedError",
    "NoWriterError",
    "MissingExtraError",
]
