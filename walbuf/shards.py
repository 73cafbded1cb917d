"""Directory buffers: one SQLite shard per host, sealed so that any host may read it.

SQLite's WAL mode works only for processes on one host (its index is shared
memory), and shared storage (NFS, Lustre, GPFS) spans hosts. A directory
buffer gives each host its own shards, and no process ever opens another
host's live shard:

    BUFFER/
      live/HOST/GEN.db     HOST's live shard (WAL): only processes on HOST open it
      sealed/HOST.GEN.db   a sealed shard: rollback journal, never written again
      ingested/...         sealed shards whose records the hub holds (prune removes them)
      hub.db               what `walbuf sync` uploads from (rollback journal)
      locks/               writer ids and the syncer, for every host

GEN is the shard's creation time in nanoseconds. The writers of a host share
its newest live shard while it is younger than the rotation age
(WALBUF_ROTATE_SECONDS, default 300); after that, each writer moves to a new
one at its next log(). A shard nobody uses any more (its processes moved on,
closed, or died) is sealed: checkpointed, switched out of WAL, renamed into
sealed/. From then on it is immutable, and any host reads it with SQLite's
``immutable=1``.

Each process using a live shard holds a shared flock on ``GEN.db.inuse``;
sealing takes it exclusively, so a shard is never sealed under a process
that uses it. Choosing a shard and sealing one take turns on the host's
``live/HOST/rotate.lock``.

`walbuf sync` (see :mod:`walbuf.ingest`) copies the records of every sealed
shard, and of its own host's live shards, into the hub, then uploads the hub
as it would a one-file buffer.
"""

from __future__ import annotations

import fcntl
import os
import socket
import sqlite3
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

from .errors import ConfigError

ENV_HOST = "WALBUF_HOST"
ENV_ROTATE = "WALBUF_ROTATE_SECONDS"
DEFAULT_ROTATE_SECONDS = 300.0


def is_directory(buffer: str | os.PathLike[str]) -> bool:
    """Whether ``buffer`` names a directory buffer: an existing directory, or a path ending in '/'."""
    text = os.fspath(buffer)
    if "://" in text or not text:
        return False
    return text.endswith(os.sep) or Path(text).expanduser().is_dir()


def host_name() -> str:
    """The name this host's shards go under: $WALBUF_HOST, else the hostname."""
    name = os.environ.get(ENV_HOST) or socket.gethostname()
    if not name or "/" in name or name.startswith("."):
        raise ConfigError(f"host name {name!r} cannot name a shard; set {ENV_HOST} to a plain name")
    return name


def rotate_seconds() -> float:
    text = os.environ.get(ENV_ROTATE)
    if not text:
        return DEFAULT_ROTATE_SECONDS
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise ConfigError(f"{ENV_ROTATE} must be a positive number of seconds, not {text!r}")
    return value


@dataclass(frozen=True)
class Shard:
    """One shard file of a directory buffer."""

    host: str
    gen: int  # creation time, ns
    path: Path
    state: str  # "live", "sealed" or "ingested"

    @property
    def id(self) -> str:
        """Stable across sealing: the hub's ingest cursors are keyed by it."""
        return f"{self.host}.{self.gen}"

    def connect(self) -> sqlite3.Connection:
        """A read-only connection: immutable for a sealed shard (safe from any host)."""
        if self.state == "live":
            return sqlite3.connect(f"file:{self.path}?mode=ro", uri=True)
        return sqlite3.connect(f"file:{self.path}?mode=ro&immutable=1", uri=True)


class Layout:
    """The paths of a directory buffer."""

    def __init__(self, buffer: str | os.PathLike[str]) -> None:
        self.root = Path(buffer).expanduser().absolute()
        self.locks = self.root / "locks"
        self.hub = self.root / "hub.db"
        self.sealed = self.root / "sealed"
        self.ingested = self.root / "ingested"

    def live(self, host: str) -> Path:
        return self.root / "live" / host

    def make(self) -> None:
        for directory in (self.locks, self.sealed, self.ingested, self.root / "live"):
            directory.mkdir(parents=True, exist_ok=True)

    def shards(self, state: str | None = None, host: str | None = None) -> list[Shard]:
        """The shards (of one state / host if given), oldest first."""
        found: list[Shard] = []
        if state in (None, "live"):
            hosts = [host] if host else [p.name for p in _dirs(self.root / "live")]
            for name in hosts:
                for path in _files(self.live(name), ".db"):
                    if path.stem.isdigit():  # anything else there is not walbuf's
                        found.append(Shard(name, int(path.stem), path, "live"))
        for kind, directory in (("sealed", self.sealed), ("ingested", self.ingested)):
            if state in (None, kind):
                for path in _files(directory, ".db"):
                    name, _, gen = path.stem.rpartition(".")
                    if name and gen.isdigit() and host in (None, name):
                        found.append(Shard(name, int(gen), path, kind))
        return sorted(found, key=lambda s: (s.gen, s.host))

    def rotate_lock(self, host: str) -> FileLock:
        self.live(host).mkdir(parents=True, exist_ok=True)
        return FileLock(self.live(host) / "rotate.lock", thread_local=False)


def _dirs(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.is_dir()) if path.is_dir() else []


def _files(path: Path, suffix: str) -> list[Path]:
    if not path.is_dir():
        return []
    return sorted(p for p in path.iterdir() if p.suffix == suffix)


class Lease:
    """This process's use of a live shard of its host: a shared flock, held until released.

    The shard is the host's newest one if it is younger than the rotation
    age, else a new one. :attr:`expires` is when a writer should move on.
    """

    def __init__(self, layout: Layout, host: str) -> None:
        self.layout, self.host = layout, host
        age = rotate_seconds()
        layout.make()
        with layout.rotate_lock(host):
            now = time.time_ns()
            newest = next(reversed(layout.shards("live", host)), None)
            if newest is not None and now < newest.gen + age * 1e9:
                gen = newest.gen
            else:
                gen = max(now, newest.gen + 1 if newest else 0)
            self.path = layout.live(host) / f"{gen:020d}.db"
            # Made now, under the lock, so that the next process joins it.
            self.path.touch()
            self._fd = os.open(f"{self.path}.inuse", os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(self._fd, fcntl.LOCK_SH)
        self.gen = gen
        self.expires = gen / 1e9 + age

    def release(self, seal: bool = True) -> None:
        """Stop using the shard; then seal it if nobody else uses it (and ``seal``)."""
        if self._fd < 0:
            return
        os.close(self._fd)  # drops the flock
        self._fd = -1
        if seal:
            seal_if_unused(self.layout, self.host, self.path)

    def abandon(self) -> None:
        """In a forked child: the flock is the parent's (it shares the open file)."""
        self._fd = -1


def seal_if_unused(layout: Layout, host: str, path: Path) -> bool:
    """Seal the live shard at ``path`` unless a process uses it; True if it was sealed."""
    with layout.rotate_lock(host):
        if not path.exists():
            return False
        fd = os.open(f"{path}.inuse", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            _seal(layout, host, path)
            os.unlink(f"{path}.inuse")
            return True
        finally:
            os.close(fd)


def in_use(path: Path) -> bool:
    """Whether a process holds the live shard at ``path`` (its shared flock)."""
    try:
        fd = os.open(f"{path}.inuse", os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # and with it the probe's lock
    return False


def seal_idle(layout: Layout, host: str) -> list[Path]:
    """Seal this host's live shards that nobody uses (writers gone, or dead); the new paths."""
    sealed = []
    for shard in layout.shards("live", host):
        if seal_if_unused(layout, host, shard.path):
            sealed.append(layout.sealed / f"{host}.{shard.gen}.db")
    return sealed


def _seal(layout: Layout, host: str, path: Path) -> None:
    # Every committed record moves from the WAL into the file, and the file
    # leaves WAL mode: from now on it needs no -wal or -shm, so it can be read
    # from any host, and nothing writes it again.
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("PRAGMA busy_timeout=60000")
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        conn.execute("PRAGMA journal_mode=DELETE")
    finally:
        conn.close()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    gen = int(path.stem)
    os.replace(path, layout.sealed / f"{host}.{gen}.db")
    for leftover in (f"{path}-wal", f"{path}-shm"):
        if os.path.exists(leftover):
            os.unlink(leftover)
    _fsync_dir(layout.sealed)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def last_step(layout: Layout, host: str, run: str, writer: str, *, before: int) -> int | None:
    """The last step ``writer`` of ``run`` logged in this host's shards older than ``before``, or in the hub."""
    candidates = [s for s in layout.shards(host=host) if s.gen < before]
    for shard in reversed(candidates):
        step = _last_step_in(shard.connect, run, writer)
        if step is not None:
            return step
    if layout.hub.exists():
        return _last_step_in(lambda: sqlite3.connect(f"file:{layout.hub}?mode=ro", uri=True), run, writer)
    return None


def _last_step_in(connect, run: str, writer: str) -> int | None:  # type: ignore[no-untyped-def]
    conn = connect()
    try:
        row = conn.execute(
            "SELECT w.id, w.pruned_step FROM writers w JOIN runs r ON r.id = w.run_id"
            " WHERE r.name = ? AND w.name = ?",
            (run, writer),
        ).fetchone()
        if row is None:
            return None
        step = conn.execute(
            "SELECT step FROM records WHERE writer_id = ? ORDER BY id DESC LIMIT 1", (row[0],)
        ).fetchone()
        return step[0] if step is not None else row[1]
    except sqlite3.OperationalError:
        return None  # a shard made before its tables were (a writer died at once)
    finally:
        conn.close()


def iter_shards_readable(layout: Layout, host: str) -> Iterator[Shard]:
    """The shards this host may read: every sealed one, and its own live ones; oldest first."""
    for shard in layout.shards():
        if shard.state == "sealed" or (shard.state == "live" and shard.host == host):
            yield shard
