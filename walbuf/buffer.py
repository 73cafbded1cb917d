"""What a buffer location is: the one place that tells a database from a directory buffer.

:func:`open_buffer` turns what a user gives (a path, a ``sqlite:///`` or
``postgresql+psycopg://`` URL, a directory) into a :data:`Buffer`, and says
"there is no buffer here" where there is no file or directory; a database
that turns out empty when opened is said so by the store
(walbuf.store.storage: BufferNotFoundError, which a follow waits out). A Buffer is a resolved
location, cheap to make and picklable; it opens connections only when asked
(:meth:`open_store`, :meth:`open_segment`), and what it opens for reading
never creates or changes anything.

Two kinds:

- :class:`DatabaseBuffer`: one database, a SQLite file (for the processes of
  one host) or PostgreSQL (for writers on many hosts).
- :class:`~walbuf.directory.DirectoryBuffer`: a directory on shared storage
  with a SQLite shard per host, brought together in a hub at sync.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Union

import sqlalchemy as sa

from .directory import DirectoryBuffer
from .directory.buffer import check_directory
from .errors import BufferNotFoundError, ConfigError, NotABufferError, StorageError, UntrustedPathError
from .record import Record
from .store import Access, Durability, Storage
from .store.backend import Backend, Lock, WriterLock
from .store.claims import Claims, Conflict
from .store.postgresql import PostgresBackend
from .store.schema import runs, writers
from .store.source import Backlogs, Hold, SyncSource
from .store.sqlite import SQLiteBackend
from .store.storage import ConfigKind, writer_lock_name
from .store.target import Target
from .store.trust import account, shown

_log = logging.getLogger(__name__)


class Segment(Protocol):
    """Where one writer of this process appends, from its opening to its close: opened by Buffer.open_segment.

    Every call that writes commits before it returns, or raises having
    written nothing (see walbuf.writer.Writer).
    """

    def writer_lock(self, run: str, writer: str) -> WriterLock:
        """The lock that makes this process the owner of the writer id (not taken yet)."""

    def holder(self, run: str, writer: str) -> str | None:
        """Which process holds the writer open, for a message (" by process 12 on node3"), if the buffer knows."""

    def register(
        self, run: str, writer: str, step_axis: str, prefix: str, host: str, pid: int, target: Target | None
    ) -> tuple[int, int | None]:
        """Note the writer open; (its id for the calls below, its last step where this segment knows it)."""

    def last_step_before(self, run: str, writer: str, owner: WriterLock) -> int | None:
        """The writer's last step where :meth:`register` did not know it: what ``owner`` (held) says its previous
        holder noted as it closed, or what the rest of the buffer holds (None: no record)."""

    def claim(self, writer_pk: int, wanted: Claims) -> Conflict | None:
        """Claim W&B keys for the writer's axis (see walbuf.store.claims); the conflict, claiming nothing, if any."""

    def append(self, writer_pk: int, step: int, now: float, payload: str) -> None:
        """Append one record (its metrics as JSON)."""

    def add_config(self, writer_pk: int, encoded: dict[str, str], kind: ConfigKind) -> None:
        """Store config or summary entries (key -> JSON text), all or none."""

    def flush(self, writer_pk: int) -> None:
        """Make every record appended so far durable against power loss."""

    def close(self, writer_pk: int, exit_code: int) -> None:
        """Note the writer closed with ``exit_code``, and let go; a failure to note it is logged (the lock has it)."""

    def release(self) -> None:
        """Let go without noting a close (the writer never opened)."""

    def abandon(self) -> None:
        """In a forked child: let go without touching what the parent still uses."""


@dataclass(frozen=True)
class DatabaseBuffer:
    """A buffer that is one database: a SQLite file, or a PostgreSQL database (or schema)."""

    backend: Backend

    @property
    def location(self) -> str:
        """For messages: the file's path, or the URL without its password."""
        return self.backend.location

    @property
    def path(self) -> Path | None:
        """The SQLite file; None for PostgreSQL."""
        return self.backend.path

    def open_store(self, access: Access) -> Storage:
        """The database, opened with ``access`` (see walbuf.store.backend.Access)."""
        return Storage(self.backend, access=access)

    def sync_lock(self) -> Lock:
        """The lock only one syncer of the buffer holds (taken by the caller)."""
        return self.backend.lock("sync")

    def sync_running(self) -> bool:
        """Whether a syncer holds the sync lock now. Changes nothing."""
        return self.backend.lock_held("sync")

    def take_over_sync(self) -> None:
        pass  # every host that reaches the database may sync it

    def writer_alive(self, run: str, writer: str) -> bool:
        """Whether a process holds ``writer`` of ``run`` open now. Changes nothing."""
        return self.backend.writer_held(writer_lock_name(run, writer))

    def writer_close_note(self, run: str, writer: str) -> int | None:
        """The exit code ``writer`` of ``run`` noted beside its lock as it last closed; None if it did not. Changes
        nothing."""
        return self.backend.writer_close_note(writer_lock_name(run, writer))

    def open_for_sync(self, stop: Callable[[], bool] | None = None, *, check: bool = True) -> SyncSource:
        """The database sync uploads from, checked whole for damage (unless ``check`` is off). The caller holds the sync
        lock."""
        storage = Storage(self.backend, access="write")
        try:
            if check:
                storage.check_integrity()
        except BaseException:
            storage.close()
            raise
        return SyncSource(storage)

    def records(
        self, run: str | None = None, writer: str | None = None, *, quarantined: bool = False
    ) -> Iterator[Record]:
        """Every record (of one run / writer if given; only the quarantined ones), in the order logged, from one
        snapshot."""
        with self.open_store("read") as storage:
            yield from storage.read(run=run, writer=writer, quarantined=quarantined)

    def size(self) -> int:
        """Bytes the buffer takes."""
        with self.open_store("read") as storage:
            return storage.size()

    def open_segment(self, durability: Durability) -> DatabaseSegment:
        return DatabaseSegment(Storage(self.backend, access="create", durability=durability))

    # A database holds every record itself: it has no shards waiting, damaged
    # or to remove, and nothing in it walbuf does not open.

    def backlog(self) -> Backlogs:
        return Backlogs()

    def damaged(self) -> list[tuple[str, str]]:
        return []

    def not_opened(self) -> list[str]:
        return []

    def all_in_store(self) -> bool:
        return True

    def remove_ingested(self, older_than: float, hub: Storage | None) -> tuple[int, list[str]]:
        return 0, []

    def hold_shard(self) -> None:
        return None


class DatabaseSegment:
    """A writer's segment of a database buffer: the whole database, through a connection of its own."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        try:
            self.appender = storage.appender()
        except BaseException:
            storage.close()
            raise

    def writer_lock(self, run: str, writer: str) -> WriterLock:
        return self.storage.backend.writer_lock(writer_lock_name(run, writer), self.appender)

    def holder(self, run: str, writer: str) -> str | None:
        with self.storage.begin_read() as conn:
            row = conn.execute(
                sa.select(writers.c.host, writers.c.pid)
                .join(runs, runs.c.id == writers.c.run_id)
                .where(runs.c.name == run, writers.c.name == writer)
                .order_by(writers.c.opened_at.desc())
            ).first()
        return f" by process {row.pid} on {row.host}" if row else None

    def register(
        self, run: str, writer: str, step_axis: str, prefix: str, host: str, pid: int, target: Target | None
    ) -> tuple[int, int | None]:
        return self.storage.register_writer(run, writer, step_axis, prefix, host, pid, target)

    def last_step_before(self, run: str, writer: str, owner: WriterLock) -> int | None:
        return None  # the database holds every record of the writer: register() knew its last step

    def claim(self, writer_pk: int, wanted: Claims) -> Conflict | None:
        return self.storage.claim_keys(writer_pk, wanted)

    def append(self, writer_pk: int, step: int, now: float, payload: str) -> None:
        self.appender.append((writer_pk, step, now, payload))

    def add_config(self, writer_pk: int, encoded: dict[str, str], kind: ConfigKind) -> None:
        self.storage.add_config(writer_pk, encoded, kind)

    def flush(self, writer_pk: int) -> None:
        self.appender.flush(writer_pk)

    def close(self, writer_pk: int, exit_code: int) -> None:
        try:
            self.appender.close()
            try:
                self.storage.mark_closed(writer_pk, exit_code)
            except StorageError as exc:
                # Every record is committed already, and the note beside the
                # writer's lock tells the syncer it closed.
                _log.warning("could not note in the buffer that a writer closed: %s", exc)
        finally:
            self.storage.close()

    def release(self) -> None:
        try:
            self.appender.close()
        finally:
            self.storage.close()

    def abandon(self) -> None:
        # The inherited objects stay referenced and are never closed (closing
        # could drop the parent's POSIX locks or disturb its session).
        self.appender.abandon()
        self.storage.abandon()


class Buffer(Protocol):
    """A buffer location, as :func:`open_buffer` resolved it: what every kind provides, and all that callers ask.

    Implemented by :class:`DatabaseBuffer` (SQLite, PostgreSQL) and
    :class:`~walbuf.directory.DirectoryBuffer`; tests/test_buffer_kinds.py is
    the conformance test each passes. Nothing here creates or changes a
    buffer unless it says so.
    """

    @property
    def location(self) -> str:
        """For messages: a path, or a URL without its password."""
        ...

    def open_store(self, access: Access) -> Storage | None:
        """The database sync uploads from, opened with ``access``; None if none is made yet (a directory buffer's hub
        before its first sync; "create" makes it)."""
        ...

    def open_segment(self, durability: Durability) -> Segment:
        """Where the writers of this process append now."""
        ...

    def open_for_sync(self, stop: Callable[[], bool] | None = None, *, check: bool = True) -> SyncSource:
        """Everything brought into the store sync uploads from (shards taken in), checked for damage unless ``check``
        is off; the caller holds the sync lock."""
        ...

    def sync_lock(self) -> Lock:
        """The lock only one syncer of the buffer holds (taken by the caller)."""
        ...

    def take_over_sync(self) -> None:
        """Make this host the one that syncs the buffer, where only one host may (a directory buffer on a filesystem
        whose locks do not span hosts); nothing for other buffers. The caller holds the sync lock."""
        ...

    def sync_running(self) -> bool:
        """Whether a syncer holds the sync lock now (True too where that cannot be seen from here)."""
        ...

    def writer_alive(self, run: str, writer: str) -> bool:
        """Whether a process holds ``writer`` of ``run`` open now."""
        ...

    def writer_close_note(self, run: str, writer: str) -> int | None:
        """The exit code ``writer`` of ``run`` noted as it last closed; None if it did not."""
        ...

    def records(
        self, run: str | None = None, writer: str | None = None, *, quarantined: bool = False
    ) -> Iterator[Record]:
        """Every record this host can see (of one run / writer; only the quarantined ones), in the order logged."""
        ...

    def size(self) -> int:
        """Bytes the buffer takes."""
        ...

    def backlog(self) -> Backlogs:
        """Each part whose records the store does not hold yet (a database: none), counted against one read of the
        store, which is let go before the parts are read."""
        ...

    def damaged(self) -> list[tuple[str, str]]:
        """(name, why) of each part of the buffer a person must look at, never taken in (a database: none)."""
        ...

    def not_opened(self) -> list[str]:
        """Why walbuf does not open each thing there it does not trust or name, a message each (a database: none)."""
        ...

    def all_in_store(self) -> bool:
        """Whether the store holds every record there is (a database: always)."""
        ...

    def remove_ingested(self, older_than: float, hub: Storage | None) -> tuple[int, list[str]]:
        """Delete the shards the store ``hub`` holds whole, sealed over ``older_than`` seconds ago: how many, and a
        message for each kept (a database: none). Changes the buffer."""
        ...

    def hold_shard(self) -> Hold | None:
        """Keep this process's live shard until the hold is let go (a database: nothing to hold, None)."""
        ...


Location = Union[str, "os.PathLike[str]", DatabaseBuffer, DirectoryBuffer]
"""What walbuf's functions take as a buffer: a path, a URL, or a Buffer."""


def open_buffer(location: Location, *, create: bool = False) -> Buffer:
    """Resolve ``location`` into a Buffer; nothing is created or changed.

    - A ``postgresql+psycopg://`` URL: a PostgreSQL buffer.
    - A ``sqlite:///`` URL, or a path that is not a directory: a SQLite file.
    - An existing directory, or a path ending in "/": a directory buffer.

    A path is resolved to the buffer's real path (symbolic links in it
    followed), so every name of one buffer shares its locks.

    Without ``create`` (reading, syncing, pruning) the buffer must exist:
    a missing path raises BufferNotFoundError, a directory that is not a
    directory buffer NotABufferError naming what it holds. With ``create``
    (a writer), a missing path is fine (the writer makes it) and so is an
    empty directory. Whether a database holds a walbuf buffer is checked
    when it is opened (NotABufferError then too). A bad URL or an empty
    location raises ConfigError.
    """
    if isinstance(location, (DatabaseBuffer, DirectoryBuffer)):
        return location
    text = os.fspath(location)
    if not isinstance(text, str) or not text:
        raise ConfigError("no buffer given: pass a path or set WALBUF_BUFFER")
    if "://" in text:
        return _from_url(text, create)
    path = _real(text)
    if text.endswith(os.sep) or path.is_dir():
        check_directory(path, create=create)
        return DirectoryBuffer(path)
    return _sqlite_file(path, create)


def _from_url(text: str, create: bool) -> Buffer:
    try:
        url = sa.make_url(text)
    except sa.exc.ArgumentError as exc:
        raise ConfigError(f"buffer {text!r} is not a valid SQLAlchemy URL: {exc}") from None
    kind = url.get_backend_name()
    if kind == "postgresql":
        return DatabaseBuffer(PostgresBackend(url))
    if kind != "sqlite":
        raise ConfigError(
            f"buffer {url.render_as_string()!r}: walbuf stores buffers in SQLite or PostgreSQL;"
            " give a file path, a directory, a sqlite:/// URL or a postgresql+psycopg:// URL"
        )
    if url.database in (None, "", ":memory:") or url.query.get("mode") == "memory":
        raise ConfigError(
            f"buffer {url.render_as_string()!r} is an in-memory database, which other"
            " processes cannot see; give a file path"
        )
    path = _real(url.database)
    if path.is_dir():
        raise NotABufferError(f"buffer {text!r} names a directory; give it as a path for a directory buffer")
    return _sqlite_file(path, create)


def _real(text: str) -> Path:
    """The buffer's real path: symbolic links in what the user gave are followed here, once, if they are safe to.

    Its locks are keyed by it, so that two names of one buffer (a link to
    it) share them; inside the buffer nothing is a link (walbuf.store.trust).
    A link on the way that another account made raises UntrustedPathError
    (this account's and root's are followed): in a folder others may write
    (sticky scratch) it could lead walbuf to a buffer of that account's
    choosing, or the owner's own private buffer to where that account reads.
    """
    given = Path(text).expanduser()
    pending = list((given if given.is_absolute() else Path(os.getcwd()) / given).parts)
    path, hops = Path(pending.pop(0)), 0
    while pending:
        part = pending.pop(0)
        if part == "..":
            path = path.parent  # ``path`` is real: its parent is where ".." leads
            continue
        candidate = path / part
        try:
            st = os.lstat(candidate)
        except (FileNotFoundError, NotADirectoryError):
            return Path(os.path.normpath(candidate.joinpath(*pending)))  # not there yet: a writer makes it
        if not stat.S_ISLNK(st.st_mode):
            path = candidate
            continue
        if st.st_uid not in (os.geteuid(), 0):
            raise UntrustedPathError(
                f"{shown(candidate)} is a symbolic link of {account(st.st_uid)}: walbuf follows a link to a"
                " buffer only where this account or root made it, as another account's could lead it anywhere;"
                " give the buffer's real path (see docs/security.md)"
            )
        hops += 1
        if hops > 40:
            raise ConfigError(f"{shown(text)}: too many symbolic links on the way to the buffer")
        target = list(Path(os.readlink(candidate)).parts)
        if target and Path(target[0]).is_absolute():
            path = Path(target.pop(0))
        pending = [*target, *pending]
    return path


def _sqlite_file(path: Path, create: bool) -> DatabaseBuffer:
    if not create and not path.exists():
        raise BufferNotFoundError(f"no buffer at {path}")
    return DatabaseBuffer(SQLiteBackend(path))


def read(
    buffer: Location, *, run: str | None = None, writer: str | None = None, quarantined: bool = False
) -> Iterator[Record]:
    """Yield the records in a buffer (of one run / writer if given), in the order logged.

    With ``quarantined``, only those a sync quarantined, each with the reason
    (Record.quarantined): W&B refuses them for good, so they are never sent.

    Reads one consistent snapshot: records committed after the first one is
    yielded are not included. Never creates or changes anything: a missing
    buffer raises BufferNotFoundError, something that is not a walbuf buffer
    NotABufferError. Of a directory buffer: the records of its hub, then
    those of each shard this host can read (every sealed one, its own live
    ones) that the hub lacks; another host's live shard is not read.
    """
    yield from open_buffer(buffer).records(run=run, writer=writer, quarantined=quarantined)


def check_names(buffer: Location, run: str | None, writer: str | None) -> None:
    """ConfigError, naming those it knows, if the buffer's database knows no ``run`` or no ``writer`` (of ``run``
    if given): a typo, most likely. Reads only."""
    located = open_buffer(buffer)
    storage = located.open_store("read")
    known_runs: list[str] = []
    known_writers: list[str] = []
    if storage is not None:
        with storage, storage.begin_read() as conn:
            known_runs = list(conn.scalars(sa.select(runs.c.name).order_by(runs.c.id)))
            query = sa.select(writers.c.name).join(runs, runs.c.id == writers.c.run_id).order_by(writers.c.id)
            if run is not None:
                query = query.where(runs.c.name == run)
            known_writers = list(dict.fromkeys(conn.scalars(query)))
    where = located.location
    if isinstance(located, DirectoryBuffer):
        where += " (its hub, which holds what syncs took in)"
    if run is not None and run not in known_runs:
        raise ConfigError(f"no run {run!r} in {where}; runs: {', '.join(map(repr, known_runs)) or 'none'}")
    if writer is not None and writer not in known_writers:
        of = f" of run {run!r}" if run is not None else ""
        raise ConfigError(
            f"no writer {writer!r}{of} in {where}; writers: {', '.join(map(repr, known_writers)) or 'none'}"
        )
