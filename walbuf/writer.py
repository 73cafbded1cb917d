"""The writer: appends one process's metric records to a buffer.

A writer id names one stream of records in one run, with its own step axis.
While a Writer is open it owns its id: it holds a lock in the buffer (an OS
file lock, or a PostgreSQL advisory lock, released if the process dies,
kill -9 included), so a second live writer with the same id fails at once
instead of interleaving two streams.

Settings: see :mod:`walbuf.settings`. A Writer sent to another process
(pickled, or inherited by fork) carries its settings, never its connection,
and opens its own there on first use, with that process's writer id.
"""

from __future__ import annotations

import atexit
import functools
import logging
import operator
import os
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from . import expiry
from .buffer import Location, Segment
from .errors import (
    NOTHING_STORED_ERRORS,
    NOTHING_WRITTEN,
    ArgumentTypeError,
    ConfigError,
    KeyConflictError,
    MetricValueError,
    NoWriterError,
    StepOrderError,
    StorageError,
    WriterClosedError,
    WriterConflictError,
)
from .record import Shapes, check_line, encode_config, encode_metrics, flatten, line_room
from .settings import WriterSettings
from .store.backend import WriterLock
from .store.claims import wandb_key
from .store.storage import ConfigKind

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from .settings import WriterOptions

MAX_STEP = 2**63 - 1

_log = logging.getLogger(__name__)


@dataclass
class _Open:
    """What a Writer holds open, in the process that opened it."""

    pid: int
    segment: Segment
    owner: WriterLock
    writer: str
    step_axis: str
    prefix: str
    writer_pk: int
    last_step: int | None
    # Keys this process has claimed for its axis, and whether the axis itself
    # (see walbuf.store.claims): claims are never withdrawn, so each is made
    # once per process.
    claimed: set[str] = field(default_factory=set)
    axis_claimed: bool = False
    # Key sets logged before with plain numbers: the next records of the same
    # keys skip their checks (see record.Shapes).
    shapes: Shapes = field(default_factory=Shapes)

    def claim(self, keys: dict[str, Any]) -> None:
        """Claim the W&B names of ``keys`` (and of the step axis) not claimed yet; KeyConflictError if another writer
        holds one."""
        new = [key for key in keys if key not in self.claimed]
        axis = wandb_key(self.prefix, self.step_axis)
        wanted: dict[str, str | None] = {wandb_key(self.prefix, key): axis for key in new}
        if not self.axis_claimed:
            wanted[axis] = None
        conflict = self.segment.claim(self.writer_pk, wanted)
        if conflict is not None:
            raise KeyConflictError(conflict.explain(self.writer, axis), NOTHING_WRITTEN)
        self.claimed.update(new)
        self.axis_claimed = True

    def close(self, exit_code: int) -> None:
        try:
            try:
                # First beside the lock: that note needs no new space on the
                # disk, so a full disk that refuses the buffer's note still
                # leaves the syncer a writer that closed, not one that died.
                self.owner.note_closed(exit_code, self.last_step)
            except OSError as exc:
                _log.warning("could not note beside its lock that writer %r closed: %s", self.writer, exc)
            self.segment.close(self.writer_pk, exit_code)
        finally:
            self.owner.release()

    def abandon(self) -> None:
        """In a forked child: the handles are the parent's; let go without closing them."""
        self.segment.abandon()


class Writer:
    """Appends metric records of one writer id to a buffer.

    Guarantees:

    - Durability: :meth:`log` commits before it returns. The record survives
      kill -9 of the process; with ``durability="fsync"`` it also survives a
      power loss or OS crash (SQLite synchronous=FULL), and :meth:`flush`
      gives that to every record logged so far in the default mode.
    - Order: records of one writer are read back in the order logged, each
      with its step. Steps never decrease.
    - Errors: invalid metrics or a step that goes backwards raise before
      anything is written.
    - Interruptions: a :meth:`log` that a Ctrl-C interrupts stores its
      record once or not at all, its step is never taken again by a later
      log() without ``step``, and no transaction is left open (see log()).
    - Processes: picklable (its settings travel, never its connection) and
      fork-safe (a child never uses the parent's connection; it opens its own
      on first use). Safe to share between threads of one process.
    - Directory buffers: a sync on any host reads what the writer logged
      as soon as it is committed, whether the writer logs on or sits idle
      (see walbuf.directory.appender).

    Settings: see :meth:`walbuf.settings.WriterSettings.resolve`.
    """

    def __init__(self, buffer: Location | None = None, **options: Unpack[WriterOptions]) -> None:
        self._start(WriterSettings.resolve(buffer, **options))

    @classmethod
    def from_settings(cls, settings: WriterSettings) -> Writer:
        """A Writer with settings resolved already (as the decorator and integrations hold them)."""
        writer = cls.__new__(cls)
        writer._start(settings)
        return writer

    def _start(self, settings: WriterSettings) -> None:
        self.settings = settings
        self._lock = threading.Lock()
        self._closed = False
        self._open: _Open | None = None
        # Handles inherited across fork: kept referenced, never closed (closing
        # them could release the parent's locks or disturb its WAL or session).
        self._orphans: list[_Open] = []
        self._opened_here()

    # -- per-process state -----------------------------------------------------

    def _opened_here(self) -> _Open:
        """This process's open state: opened now after fork or unpickling, leaving the parent's alone."""
        state = self._open
        if state is not None and state.pid == os.getpid():
            return state
        if state is not None:
            # Forked: another thread of the parent may have held the lock.
            self._lock = threading.Lock()
            state.abandon()
            self._orphans.append(state)
            self._open = None
        if self._closed:
            raise WriterClosedError(f"writer {self.settings.writer or '(this process)'!r} is closed")
        self._open = self._connect()
        atexit.register(self.close)
        return self._open

    def _connect(self) -> _Open:
        settings = self.settings
        writer, step_axis = settings.writer_id(), settings.axis()
        prefix = settings.key_prefix(writer)
        segment = settings.buffer.open_segment(settings.durability)
        try:
            owner = self._own(segment, writer)
            try:
                writer_pk, last_step = segment.register(
                    settings.run, writer, step_axis, prefix, socket.gethostname(), os.getpid(), settings.target
                )
                if last_step is None:
                    last_step = segment.last_step_before(settings.run, writer, owner)
            except BaseException:
                owner.release()
                raise
        except BaseException:
            segment.release()
            raise
        state = _Open(os.getpid(), segment, owner, writer, step_axis, prefix, writer_pk, last_step)
        self._renew_later(state)
        return state

    def _renew_later(self, state: _Open) -> None:
        """Have the expiry thread renew the writer's ownership of its id when due, as long as it stays open."""
        every = state.owner.renew_every
        if every is not None:
            expiry.call_after(every, functools.partial(self._renew, state))

    def _renew(self, state: _Open) -> None:
        """In the expiry thread: renew the ownership (a PostgreSQL writer's lease), then schedule the next renewal.

        Without the writer's lock, which a log() waiting for the buffer may
        hold for long: the expiry thread serves every writer of the process
        (the owner's renew() waits for nothing and is safe beside a log()).
        """
        if self._closed or self._open is not state or state.pid != os.getpid():
            return
        try:
            state.owner.renew()
        except (StorageError, WriterConflictError) as exc:
            # The next log() meets the same fault, where the caller sees it;
            # a lease that lapses meanwhile lets that log() write nothing.
            _log.warning("writer %r could not renew its ownership of its id: %s", state.writer, exc)
        self._renew_later(state)

    def _own(self, segment: Segment, writer: str) -> WriterLock:
        run, wait = self.settings.run, self.settings.wait
        owner = segment.writer_lock(run, writer)
        acquired = owner.acquire(timeout=0)
        if not acquired and wait > 0:
            _log.info("writer %r of run %r is open elsewhere; waiting up to %gs for it to close", writer, run, wait)
            acquired = owner.acquire(timeout=wait)
        if not acquired:
            where = segment.holder(run, writer) or ""
            waited = f" and was not closed within {self.settings.wait:g}s" if self.settings.wait else ""
            raise WriterConflictError(
                f"writer {writer!r} of run {run!r} is already open{where}{waited};"
                " give each process its own writer id (writer=... or WALBUF_WRITER),"
                " or close the other writer first"
            ) from None
        try:
            owner.note_open()
        except BaseException:
            owner.release()
            raise
        return owner

    # -- public ------------------------------------------------------------------

    @property
    def writer(self) -> str:
        """This writer's id in the current process."""
        return self._opened_here().writer

    @property
    def step_axis(self) -> str:
        """The name of this writer's step axis in the current process."""
        return self._opened_here().step_axis

    @property
    def run(self) -> str:
        return self.settings.run

    @property
    def buffer(self) -> str:
        """Where the buffer is: a file's or directory's path, or a URL without its password."""
        return self.settings.buffer.location

    @property
    def last_step(self) -> int | None:
        """The step of the last record of this writer (None if it has none); after a log() that was interrupted,
        the step it spent, whether its record was stored or not (see :meth:`log`)."""
        return self._opened_here().last_step

    def log(self, metrics: Mapping[str, Any], step: int | None = None, *, axis: int | None = None) -> int:
        """Append one record and commit it; return its step.

        Without ``step``, the step is the writer's last step plus one (0 for
        a new writer). With ``step``, it must be >= the last step (equal adds
        another record at that step), else StepOrderError; a step that is
        not an int raises ArgumentTypeError. Invalid metrics raise
        MetricTypeError/MetricValueError (a record of no metric too); a key that another writer of the
        run plots against another step axis in W&B (same name after their
        prefixes), KeyConflictError. On these errors nothing is written.

        A log() that raises stores its record once or not at all, never
        twice. An error that says nothing was stored (BufferBusyError,
        BufferFullError, BufferNotWritableError, BufferUnavailableError,
        WriterConflictError, and the refusals above) leaves the step to the
        next log(). Any other, an interruption above all (KeyboardInterrupt,
        or what a signal handler raises, which can land just after the
        record was stored), leaves the step spent: whether or not the record
        was stored, the next log() without ``step`` takes the step after it,
        so no two records share an auto step (at worst a step has none). So
        a cell retried after Ctrl-C logs its record again at a new step,
        beside the first one if that was stored; with an explicit ``step``,
        the retry logs at that step, and where the first was stored there
        are two records at it, as two log() calls with one step make by
        design. RecordNotDurableError (``durability="fsync"``): the record
        was stored and a sync sends it, but it may not survive a power loss.
        No interruption leaves the buffer inside a transaction of this
        writer's.

        ``axis`` is the record's value on the step axis in W&B when that is
        not its step: a framework's own step (a trainer's global step),
        which may go back, after a job resumed from a checkpoint, or repeat.
        The step still orders the writer's records; the record keeps
        ``axis`` under the step axis's name (and reads back so), and W&B
        plots it there, as W&B's own framework loggers plot their step
        metric. An int >= 0, else ArgumentTypeError or StepOrderError.
        """
        state = self._opened_here()
        payload = state.shapes.encode(metrics) if axis is None else None
        flat = None
        if payload is None:
            flat = flatten(metrics, state.step_axis)
            if not flat:
                # It would take a step of its own and give W&B a row of nothing.
                raise MetricValueError("a record needs at least one metric: log({}) has none", NOTHING_WRITTEN)
            stored = flat
            if axis is not None:
                stored = {**flat, state.step_axis: _checked_step(axis, None, state.writer, "axis")}
            payload = encode_metrics(stored)
            check_line(payload, stored, state.prefix + "/")
        with self._lock:
            self._check_open(state)
            last = state.last_step
            if step is None:
                step = 0 if last is None else last + 1
            else:
                step = _checked_step(step, last, state.writer)
            if flat is not None and (not state.axis_claimed or not state.claimed.issuperset(flat)):
                state.claim(flat)
            # The step is spent before the append, and given back only where
            # nothing was stored: an interruption can land after the record
            # was (see the docstring), and the next log() must not take its
            # step again.
            state.last_step = step
            try:
                state.segment.append(state.writer_pk, step, time.time(), payload)
            except NOTHING_STORED_ERRORS:
                state.last_step = last
                raise
            if flat is not None and axis is None:
                state.shapes.learn(flat, line_room(len(flat), state.prefix + "/"))
            return step

    def config(self, values: Mapping[str, Any]) -> None:
        """Record run config (hyperparameters) in the buffer; committed on return.

        At sync, the run's W&B config is each key's latest value across the
        run's writers: a key set again (by this writer or another) takes the
        later value, and the syncer reports values that changed that way.
        Values: int, float, bool, str, None, numpy/torch scalars, and lists
        and str-keyed dicts of those; anything else raises before anything
        is stored.
        """
        self._set("config", values)

    def summary(self, values: Mapping[str, Any]) -> None:
        """Record run summary values (final or best metrics, say) in the buffer; committed on return.

        At sync they are set in the W&B run's summary, each key's latest value
        across the run's writers. Keys are as given (not prefixed with the
        writer id). Values as for :meth:`config`.
        """
        self._set("summary", values)

    def _set(self, kind: ConfigKind, values: Mapping[str, Any]) -> None:
        state = self._opened_here()
        encoded = encode_config(values, kind)
        with self._lock:
            self._check_open(state)
            state.segment.add_config(state.writer_pk, encoded, kind)

    def _check_open(self, state: _Open) -> None:
        if self._closed:
            raise WriterClosedError(
                f"writer {state.writer!r} of run {self.settings.run!r} is closed; open it again"
                " (walbuf.Writer(...), or walbuf.init(...) for walbuf.log)"
            )

    def flush(self) -> None:
        """Make every record logged so far durable against power loss and OS crashes.

        log() has already committed each record (safe against the process
        dying); in the default durability SQLite defers the fsync of its WAL
        to checkpoints, PostgreSQL commits without waiting for its WAL flush
        (synchronous_commit=off), and a directory buffer's shard is written
        without fsync; flush() waits for that now.
        """
        state = self._opened_here()
        with self._lock:
            if not self._closed:
                state.segment.flush(state.writer_pk)

    def close(self, *, failed: bool = False) -> None:
        """Release the writer id and close the connection. Idempotent; atexit calls it.

        Records already logged are committed; close() adds nothing to their
        durability (use flush() or durability="fsync" for that). ``failed``:
        the job failed; once every writer of the run has closed, a sync
        finishes the W&B run as failed (exit code 1) rather than finished.
        Leaving a ``with`` block by an exception closes with ``failed=True``,
        as ``with wandb.init()`` does.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            state = self._open
            if state is None or state.pid != os.getpid():
                return  # another process's handles (fork), or never opened here (unpickled)
            atexit.unregister(self.close)
            state.close(1 if failed else 0)

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc_info: object) -> None:
        self.close(failed=exc_type is not None)

    def __getstate__(self) -> dict[str, Any]:
        return {"settings": self.settings}

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Opened on first use in the receiving process, as a writer of its own
        # (whether or not the sender's was still open).
        self.settings = state["settings"]
        self._lock = threading.Lock()
        self._closed = False
        self._open = None
        self._orphans = []

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        writer = self._open.writer if self._open is not None else self.settings.writer
        return f"<walbuf.Writer run={self.settings.run!r} writer={writer!r} {state}>"


def _checked_step(step: Any, last: int | None, writer: str, what: str = "step") -> int:
    if isinstance(step, bool):
        raise ArgumentTypeError(f"{what} must be an int, not bool ({step!r})")
    try:
        value = operator.index(step)
    except TypeError:
        raise ArgumentTypeError(f"{what} must be an int, not {type(step).__qualname__}") from None
    if not 0 <= value <= MAX_STEP:
        raise StepOrderError(f"{what} must be between 0 and 2**63-1, not {value} (nothing was written)")
    if last is not None and value < last:
        raise StepOrderError(f"step {value} goes backwards: writer {writer!r} is at step {last} (nothing was written)")
    return value


# The one piece of module state: the writer walbuf.init() made in this process.
_default: Writer | None = None


def init(buffer: Location | None = None, **options: Unpack[WriterOptions]) -> Writer:
    """Open a Writer and make it this process's default for :func:`walbuf.log`.

    The arguments are those of :class:`Writer` (see
    :meth:`walbuf.settings.WriterSettings.resolve`). ``buffer`` is a file
    path or a sqlite:/// URL (the file and its directory are made if
    missing), a directory (a directory buffer, for writers on many hosts),
    or a postgresql+psycopg:// URL.

    One default writer per process: calling init again for the same writer
    (same buffer, run and writer id; a notebook cell run twice) closes the
    first and opens it anew, but while it is open, init for another writer
    raises ConfigError. For several writers in one process, open each with
    :class:`Writer` (walbuf.log logs through the one init opened).
    """
    global _default
    settings = WriterSettings.resolve(buffer, **options)
    if _default is not None and not _default.closed:
        current = _default.settings
        same = (current.buffer.location, current.run, _default.writer) == (
            settings.buffer.location,
            settings.run,
            settings.writer_id(),
        )
        if not same:
            raise ConfigError(
                f"walbuf.init() already opened writer {_default.writer!r} of run {current.run!r} in this"
                f" process, and walbuf.log() logs through it; to log as {settings.writer_id()!r} as well,"
                " open it with walbuf.Writer(...) (a process may hold several), or close the first"
                " writer before calling walbuf.init() again"
            )
        _default.close()
    _default = Writer.from_settings(settings)
    return _default


def log(metrics: Mapping[str, Any], step: int | None = None, *, axis: int | None = None) -> int:
    """Log through the writer walbuf.init() made in this process; see :meth:`Writer.log`."""
    if _default is None:
        raise NoWriterError("walbuf.log() needs a writer: call walbuf.init(buffer, ...) first")
    return _default.log(metrics, step=step, axis=axis)
