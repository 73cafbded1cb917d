"""The writer: appends one process's metric records to a buffer.

A writer id names one stream of records in one run, with its own step axis.
While a Writer is open it owns its id: it holds an OS file lock beside the
buffer (released by the kernel if the process dies, kill -9 included), so a
second live writer with the same id fails at once instead of interleaving
two streams.

Settings resolve in this order: the argument, the environment (WALBUF_BUFFER,
WALBUF_WRITER, WALBUF_RUN, WALBUF_STEP_AXIS), a default. The buffer is
resolved once, to an absolute path, when the Writer is made; the writer id and
step axis are resolved in each process that logs, from that process's own
environment, so a Writer sent to a worker (pickled, or inherited by fork)
becomes that worker's writer: rank-N under a launcher that sets RANK,
host-pid otherwise. A Writer given an explicit id keeps it everywhere, and a
second process that logs with it while the first is open gets
WriterConflictError.
"""

from __future__ import annotations

import atexit
import hashlib
import operator
import os
import socket
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from .errors import (
    ConfigError,
    NoWriterError,
    StepOrderError,
    WriterClosedError,
    WriterConflictError,
)
from .record import encode, encode_config, flatten
from .backends import DURABILITY_LEVELS, Appender, Lock
from . import shards
from .storage import Storage, Target, resolve_url, writers

ENV_BUFFER = "WALBUF_BUFFER"
ENV_WRITER = "WALBUF_WRITER"
ENV_RUN = "WALBUF_RUN"
ENV_STEP_AXIS = "WALBUF_STEP_AXIS"
DEFAULT_RUN = "default"
DEFAULT_STEP_AXIS = "step"
MAX_STEP = 2**63 - 1


def default_writer_id() -> str:
    """The writer id of this process when none is given: rank-based under a launcher, else host-pid."""
    rank = os.environ.get("RANK")
    if rank:
        return f"rank-{rank}"
    host = socket.gethostname()
    local_rank = os.environ.get("LOCAL_RANK")
    if local_rank:
        return f"{host}-rank-{local_rank}"
    return f"{host}-{os.getpid()}"


def _setting(name: str, value: Any, env: str, default: str | None) -> str:
    if value is None:
        value = os.environ.get(env) or default
    if not isinstance(value, str):
        raise ConfigError(f"{name} must be a str, not {type(value).__qualname__}")
    if not value:
        raise ConfigError(f"{name} must not be empty (give it, or set {env})")
    return value


def _optional(name: str, value: Any) -> str | None:
    if value is not None and (not isinstance(value, str) or not value):
        raise ConfigError(f"{name} must be a non-empty str or None, not {value!r}")
    return value


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
    - Processes: picklable (its settings travel, never its connection) and
      fork-safe (a child never uses the parent's connection; it opens its own
      on first use). Safe to share between threads of one process.
    """

    def __init__(
        self,
        buffer: str | os.PathLike[str] | None = None,
        *,
        writer: str | None = None,
        step_axis: str | None = None,
        run: str | None = None,
        durability: str = "normal",
        wait: float = 0.0,
        project: str | None = None,
        entity: str | None = None,
        run_id: str | None = None,
    ) -> None:
        if durability not in DURABILITY_LEVELS:
            raise ConfigError(
                f"durability must be one of {sorted(DURABILITY_LEVELS)}, not {durability!r}"
            )
        if buffer is None:
            buffer = os.environ.get(ENV_BUFFER, "")
        # A directory buffer: this host's shard in it (see walbuf.shards).
        self._directory = Path(buffer).expanduser().absolute() if shards.is_directory(buffer) else None
        self._url = None if self._directory else resolve_url(buffer)
        self._run = _setting("run", run, ENV_RUN, DEFAULT_RUN)
        self._writer_arg = writer
        self._step_axis_arg = step_axis
        self._durability = durability
        self._wait = float(wait)
        self._target = Target(
            wandb_id=_optional("run_id", run_id),
            project=_optional("project", project),
            entity=_optional("entity", entity),
        )
        self._init_process_state()
        self._open()

    # -- per-process state -----------------------------------------------------

    def _init_process_state(self) -> None:
        self._pid: int | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._storage: Storage | None = None
        self._appender: Appender | None = None
        self._owner: Lock | None = None
        self._lease: shards.Lease | None = None
        self._orphans: list[object] = []

    def _open(self) -> None:
        writer = _setting("writer", self._writer_arg, ENV_WRITER, default_writer_id())
        if "/" in writer or "*" in writer:
            raise ConfigError(
                f"writer id {writer!r} contains '/' or '*': in W&B a writer's keys are"
                " prefixed with '<writer>/' and '*' is a wildcard, so ids must not contain them"
            )
        step_axis = _setting("step_axis", self._step_axis_arg, ENV_STEP_AXIS, DEFAULT_STEP_AXIS)
        if "*" in step_axis:
            raise ConfigError(f"step_axis {step_axis!r} contains '*', which W&B reads as a wildcard")
        lease = storage = None
        try:
            storage, lease = self._open_storage()
            appender = storage.appender()
            try:
                owner = self._own(storage, appender, writer)
                try:
                    writer_pk, last_step = storage.register_writer(
                        self._run, writer, step_axis, socket.gethostname(), os.getpid(), self._target
                    )
                except BaseException:
                    owner.release()
                    raise
            except BaseException:
                appender.close()
                raise
        except BaseException:
            if storage is not None:
                storage.dispose()
            if lease is not None:
                lease.release()
            raise
        if last_step is None and lease is not None:
            last_step = shards.last_step(lease.layout, lease.host, self._run, writer, before=lease.gen)
        self._storage, self._owner, self._appender, self._lease = storage, owner, appender, lease
        self._writer, self._step_axis, self._writer_pk = writer, step_axis, writer_pk
        self._last_step = last_step
        self._pid = os.getpid()
        atexit.register(self.close)

    def _open_storage(self, host: str | None = None) -> tuple[Storage, shards.Lease | None]:
        if self._directory is None:
            return Storage(self._url, durability=self._durability), None  # type: ignore[arg-type]
        layout = shards.Layout(self._directory)
        lease = shards.Lease(layout, host or shards.host_name())
        try:
            return Storage(lease.path, durability=self._durability, locks=layout.locks), lease
        except BaseException:
            lease.release()
            raise

    def _rotate(self) -> None:
        """Move to the host's next live shard, so that the one expired can be sealed."""
        old_storage, old_appender, old_lease = self._storage, self._appender, self._lease
        storage, lease = self._open_storage(old_lease.host)  # type: ignore[union-attr]
        try:
            appender = storage.appender()
            writer_pk, _ = storage.register_writer(
                self._run, self._writer, self._step_axis, socket.gethostname(), os.getpid(), self._target
            )
        except BaseException:
            storage.dispose()
            lease.release()  # type: ignore[union-attr]
            raise
        self._storage, self._appender, self._lease, self._writer_pk = storage, appender, lease, writer_pk
        old_appender.close()  # type: ignore[union-attr]
        old_storage.dispose()  # type: ignore[union-attr]
        old_lease.release()  # type: ignore[union-attr]

    def _own(self, storage: Storage, appender: Appender, writer: str) -> Lock:
        digest = hashlib.sha256(f"{self._run}\0{writer}".encode()).hexdigest()[:24]
        owner = storage.backend.writer_lock(f"writer-{digest}", appender)
        if not owner.acquire(timeout=self._wait):
            with storage.begin_read() as conn:
                holder = conn.execute(
                    sa.select(writers.c.host, writers.c.pid)
                    .where(writers.c.name == writer)
                    .order_by(writers.c.opened_at.desc())
                ).first()
            where = f" by process {holder.pid} on {holder.host}" if holder else ""
            raise WriterConflictError(
                f"writer {writer!r} of run {self._run!r} is already open{where};"
                " give each process its own writer id (writer=... or WALBUF_WRITER),"
                " or close the other writer first"
            ) from None
        return owner

    def _ensure_own_process(self) -> None:
        """After fork or unpickling: leave the parent's handles alone and open anew."""
        if self._pid == os.getpid():
            return
        storage, appender, lease = self._storage, self._appender, self._lease
        inherited = [storage, appender, self._owner, lease, *self._orphans]
        closed = self._closed
        self._init_process_state()
        # Kept referenced, never closed: closing them here could release the
        # parent's locks or disturb its WAL or database session.
        self._orphans = [obj for obj in inherited if obj is not None]
        if appender is not None:
            appender.abandon()
        if storage is not None:
            storage.abandon()
        if lease is not None:
            lease.abandon()  # the shared flock is the parent's too
        self._closed = closed
        if closed:
            raise WriterClosedError(f"writer {self._writer!r} is closed")
        self._open()

    # -- public ------------------------------------------------------------------

    @property
    def writer(self) -> str:
        """This writer's id in the current process."""
        self._ensure_own_process()
        return self._writer

    @property
    def step_axis(self) -> str:
        """The name of this writer's step axis in the current process."""
        self._ensure_own_process()
        return self._step_axis

    @property
    def run(self) -> str:
        return self._run

    @property
    def buffer(self) -> str:
        """The buffer's SQLAlchemy URL, or the path of a directory buffer."""
        return str(self._directory) if self._directory else self._url.render_as_string()  # type: ignore[union-attr]

    @property
    def last_step(self) -> int | None:
        """The step of the last record of this writer (None if it has none)."""
        self._ensure_own_process()
        return self._last_step

    def log(self, metrics: Mapping[str, Any], step: int | None = None) -> int:
        """Append one record and commit it; return its step.

        Without ``step``, the step is the writer's last step plus one (0 for
        a new writer). With ``step``, it must be >= the last step (equal adds
        another record at that step), else StepOrderError. Invalid metrics
        raise MetricTypeError/MetricValueError. On any error nothing is
        written.
        """
        if self._pid != os.getpid():
            self._ensure_own_process()
        flat = flatten(metrics, self._step_axis)
        payload = encode(flat)
        with self._lock:
            if self._closed:
                raise WriterClosedError(
                    f"writer {self._writer!r} is closed; open a new one with walbuf.init()"
                )
            last = self._last_step
            if step is None:
                step = 0 if last is None else last + 1
            else:
                step = self._check_step(step, last)
            now = time.time()
            if self._lease is not None and now >= self._lease.expires:
                self._rotate()
            self._appender.append((self._writer_pk, step, now, payload))  # type: ignore[union-attr]
            self._last_step = step
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

    def _set(self, kind: str, values: Mapping[str, Any]) -> None:
        if self._pid != os.getpid():
            self._ensure_own_process()
        encoded = encode_config(values)
        with self._lock:
            if self._closed:
                raise WriterClosedError(
                    f"writer {self._writer!r} is closed; open a new one with walbuf.init()"
                )
            self._storage.add_config(self._writer_pk, encoded, kind)  # type: ignore[union-attr]

    def _check_step(self, step: Any, last: int | None) -> int:
        if isinstance(step, bool):
            raise TypeError(f"step must be an int, not bool ({step!r})")
        try:
            value = operator.index(step)
        except TypeError:
            raise TypeError(f"step must be an int, not {type(step).__qualname__}") from None
        if not 0 <= value <= MAX_STEP:
            raise StepOrderError(f"step must be between 0 and 2**63-1, not {value} (nothing was written)")
        if last is not None and value < last:
            raise StepOrderError(
                f"step {value} goes backwards: writer {self._writer!r} is at step {last}"
                " (nothing was written)"
            )
        return value

    def flush(self) -> None:
        """Make every record logged so far durable against power loss and OS crashes.

        log() has already committed each record (safe against the process
        dying); in the default durability SQLite defers the fsync of its WAL
        to checkpoints, and PostgreSQL commits without waiting for its WAL
        flush (synchronous_commit=off); flush() waits for that now.
        """
        if self._pid != os.getpid():
            self._ensure_own_process()
        with self._lock:
            if self._closed:
                return
            self._appender.flush(self._writer_pk)  # type: ignore[union-attr]

    def close(self) -> None:
        """Release the writer id and close the connection. Idempotent; atexit calls it.

        Records already logged are committed; close() adds nothing to their
        durability (use flush() or durability="fsync" for that).
        """
        if self._pid != os.getpid():
            # Another process's handles (fork) or never opened here (unpickled).
            self._closed = True
            return
        with self._lock:
            if self._closed:
                return
            self._closed = True
            atexit.unregister(self.close)
            if self._appender is not None:
                self._appender.close()
            if self._storage is not None:
                self._storage.dispose()
            if self._owner is not None:
                self._owner.release()
            if self._lease is not None:
                self._lease.release()  # and seals the shard if this was its last user

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        return {
            "url": self._url.render_as_string(hide_password=False) if self._url else None,
            "directory": self._directory,
            "run": self._run,
            "writer": self._writer_arg,
            "step_axis": self._step_axis_arg,
            "durability": self._durability,
            "wait": self._wait,
            "target": self._target,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._url = sa.make_url(state["url"]) if state["url"] else None
        self._directory = state["directory"]
        self._run = state["run"]
        self._writer_arg = state["writer"]
        self._step_axis_arg = state["step_axis"]
        self._durability = state["durability"]
        self._wait = state["wait"]
        self._target = state["target"]
        self._init_process_state()
        self._writer = self._writer_arg or "<not yet opened>"

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<walbuf.Writer run={self._run!r} writer={getattr(self, '_writer', None)!r} {state}>"


# The one piece of module state: the writer walbuf.init() made in this process.
_default: Writer | None = None


def init(
    buffer: str | os.PathLike[str] | None = None,
    *,
    writer: str | None = None,
    step_axis: str | None = None,
    run: str | None = None,
    durability: str = "normal",
    wait: float = 0.0,
    project: str | None = None,
    entity: str | None = None,
    run_id: str | None = None,
) -> Writer:
    """Open a Writer and make it this process's default for :func:`walbuf.log`.

    ``buffer`` is a file path or a sqlite:/// URL (default: $WALBUF_BUFFER);
    the file and its directory are created if missing. A directory (existing,
    or a path ending in '/') is a directory buffer for writers on many hosts
    (walbuf.shards), and a postgresql+psycopg:// URL a PostgreSQL buffer. ``writer`` is this
    stream's id (default: $WALBUF_WRITER, else rank-$RANK, else host-pid),
    ``step_axis`` the name its steps are logged under (default:
    $WALBUF_STEP_AXIS, else "step"; in W&B it becomes "<writer>/<step_axis>"),
    ``run`` the run it belongs to (default: $WALBUF_RUN, else "default").
    ``durability`` is "normal" (survives the process dying) or "fsync"
    (survives power loss). ``wait`` is how many seconds to wait for another
    process that holds the same writer id to close it before raising
    WriterConflictError. ``project``, ``entity`` and ``run_id`` choose the
    W&B run that ``walbuf sync`` uploads this run to; they are stored in the
    buffer, and one that differs from what the buffer holds raises
    TargetConflictError (the sync generates a run id when none is given).

    A previous default writer of this process is closed first.
    """
    global _default
    if _default is not None:
        _default.close()
        _default = None
    _default = Writer(
        buffer,
        writer=writer,
        step_axis=step_axis,
        run=run,
        durability=durability,
        wait=wait,
        project=project,
        entity=entity,
        run_id=run_id,
    )
    return _default


def log(metrics: Mapping[str, Any], step: int | None = None) -> int:
    """Log through the writer walbuf.init() made in this process; see :meth:`Writer.log`."""
    if _default is None:
        raise NoWriterError("walbuf.log() needs a writer: call walbuf.init(buffer, ...) first")
    return _default.log(metrics, step=step)
