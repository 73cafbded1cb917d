"""Leases and sealing: which live shard the processes of a host write, and when it becomes sealed.

The writers of a host share its newest live shard while it is younger than
the rotation age (WALBUF_ROTATE_SECONDS, default 300); after that, each
writer moves to a new one at its next log(). A shard nobody uses any more
(its processes moved on, closed, or died) is sealed: checkpointed, switched
out of WAL, renamed into sealed/. From then on it is immutable, and any host
reads it with SQLite's ``immutable=1``.

Each process using a live shard holds a shared flock on ``GEN.db.inuse``;
sealing takes it exclusively, so a shard is never sealed under a process
that uses it. Choosing a shard and sealing one take turns on the host's
``live/HOST/rotate.lock``.
"""

from __future__ import annotations

import fcntl
import os
import sqlite3
import time
from pathlib import Path

from ..store.sqlite import flock_held
from .layout import Layout, rotate_seconds


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
    """Whether a process holds the live shard at ``path`` (its shared flock). Needs only read access."""
    return flock_held(Path(f"{path}.inuse"))


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
