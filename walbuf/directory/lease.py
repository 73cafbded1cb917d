"""Leases and sealing: which live shard the processes of a host write, and when it becomes sealed.

The writers of a host share its newest live shard while it is younger than
the rotation age (WALBUF_ROTATE_SECONDS, default 300); after that, each
writer moves to a new one at its next log(). A shard nobody uses any more
(its processes moved on, closed, or died) is sealed: checkpointed, switched
out of WAL, renamed into sealed/. From then on it is immutable, and any host
reads it with SQLite's ``immutable=1``. A sync on any host seals the shards
nobody uses, its own host's and every other's (:func:`seal_unused`): so
the records of a host that died, or whose writers were killed, arrive too.

Each process using a live shard holds a shared flock on ``GEN.db.inuse``;
sealing takes it exclusively, so a shard is never sealed under a process
that uses it. Choosing a shard and sealing one take turns on the host's
``live/HOST/rotate.lock``.
"""

from __future__ import annotations

import fcntl
import logging
import os
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import StorageError
from ..store.flock import held
from ..store.sqlite import COMPANIONS, failure, harden
from ..store.trust import Owner, fsync
from .layout import Layout, Shard, rotate_seconds

_log = logging.getLogger(__name__)


class Lease:
    """This process's use of a live shard of its host: a shared flock, held until released.

    The shard is the host's newest one if it is younger than the rotation
    age, else a new one. :attr:`expires` is when a writer should move on.
    """

    def __init__(self, layout: Layout, host: str) -> None:
        self.layout, self.host = layout, host
        age = rotate_seconds()
        owner = layout.make()
        with layout.rotate_lock(host):
            now = time.time_ns()
            newest = next(reversed(layout.shards("live", host)), None)
            if newest is not None and now < newest.gen + age * 1e9:
                gen = newest.gen
            else:
                gen = max(now, newest.gen + 1 if newest else 0)
            self.path = layout.live(host) / f"{gen:020d}.db"
            # Made now (owner-only), under the lock, so that the next process joins it.
            os.close(owner.open(self.path, os.O_WRONLY, create=True))
            self._fd = owner.open(Path(f"{self.path}.inuse"), os.O_RDWR, create=True, private=True)
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
            outcome = seal_if_unused(self.layout, self.host, self.path)
            if outcome.set_aside is not None:
                _log.warning("%s", outcome.set_aside)

    def abandon(self) -> None:
        """In a forked child: the flock is the parent's (it shares the open file)."""
        self._fd = -1


@dataclass(frozen=True)
class SealOutcome:
    """What :func:`seal_if_unused` did with one shard: sealed it, set it aside (why), or left it (in use, gone)."""

    sealed: bool = False
    set_aside: str | None = None  # damaged: moved to quarantine/, this message says so


_LEFT = SealOutcome()


@dataclass(frozen=True)
class Sealing:
    """What :func:`seal_unused` did."""

    sealed: list[Path]  # the sealed shards' new paths
    set_aside: list[str]  # damaged shards moved to quarantine/, a message each


def seal_if_unused(layout: Layout, host: str, path: Path, *, here: str | None = None) -> SealOutcome:
    """Seal ``host``'s live shard at ``path`` unless a process uses it.

    Left as it is if a process uses it (or holds SQLite's lock on it past
    the busy timeout, or it is gone); set aside in quarantine/, with a
    message, if it was damaged. ``here`` is
    the host this process runs on (default: ``host``): another host's shard
    is opened in SQLite's exclusive locking mode, which keeps the WAL index
    in this process's memory instead of the shared memory of that host, and
    which no process anywhere can hold the file open against. Raises
    StorageError if the shard cannot be read or written.
    """
    owner = layout.own()
    with layout.rotate_lock(host):
        if owner.entry(path) is None:
            return _LEFT
        fd = owner.open(Path(f"{path}.inuse"), os.O_RDWR, create=True, private=True)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return _LEFT
            _log.info("sealing shard %s.%d of host %s: no process uses it", host, int(path.stem), host)
            try:
                damage = _seal(layout, owner, host, path, foreign=here not in (None, host))
            except _Busy:
                return _LEFT  # a reader holds it (walbuf status on its host, say): the next sync seals it
            outcome = SealOutcome(sealed=True)
            if damage is not None:
                outcome = SealOutcome(set_aside=layout.set_aside(Shard(host, int(path.stem), path, "live"), damage))
            os.unlink(f"{path}.inuse")
            return outcome
        finally:
            os.close(fd)


def in_use(layout: Layout, path: Path) -> bool:
    """Whether a process holds the live shard at ``path`` (its shared flock).

    Needs only read access to the lock file (PermissionError without it).
    """
    return held(Path(f"{path}.inuse"), layout.owner)


def seal_unused(layout: Layout, here: str) -> Sealing:
    """Seal the live shards of every host that nobody uses (their writers closed, or died with their host).

    A shard whose processes died is sealed by the first sync on any host,
    so that the records of a host that never runs walbuf again still arrive.
    """
    done = Sealing([], [])
    for shard in layout.shards("live"):
        outcome = seal_if_unused(layout, shard.host, shard.path, here=here)
        if outcome.sealed:
            done.sealed.append(layout.sealed / f"{shard.host}.{shard.gen}.db")
        elif outcome.set_aside is not None:
            done.set_aside.append(outcome.set_aside)
    return done


def _seal(layout: Layout, owner: Owner, host: str, path: Path, *, foreign: bool) -> str | None:
    """Seal the shard (the caller holds it exclusively); what SQLite finds damaged instead, if anything."""
    # SQLite opens the companions by name: each must be the owner's file.
    for suffix in COMPANIONS:
        owner.entry(Path(f"{path}{suffix}"))
    # Every committed record moves from the WAL into the file, and the file
    # leaves WAL mode: from now on it needs no -wal or -shm, so it can be read
    # from any host, and nothing writes it again.
    try:
        conn = sqlite3.connect(path, isolation_level=None)
        try:
            harden(conn)
            conn.execute("PRAGMA busy_timeout=10000")
            if foreign:
                # Before the first access: no shared memory (the WAL index is
                # rebuilt from the WAL in this process), and an exclusive lock.
                conn.execute("PRAGMA locking_mode=EXCLUSIVE")
            if conn.execute("PRAGMA quick_check").fetchone() != ("ok",):
                return "SQLite's quick_check finds it damaged"
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            conn.execute("PRAGMA journal_mode=DELETE")
        finally:
            conn.close()
    except sqlite3.DatabaseError as exc:
        message, kind = str(exc), failure(exc)
        if kind == "corrupt":
            return message
        if kind == "busy":
            raise _Busy from exc
        raise StorageError(f"shard {path} could not be sealed ({message}); nothing was changed") from exc
    fd = owner.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    gen = int(path.stem)
    owner.folder(layout.sealed, make=True)
    os.replace(path, layout.sealed / f"{host}.{gen}.db")
    for leftover in (f"{path}-wal", f"{path}-shm"):
        if os.path.exists(leftover):
            os.unlink(leftover)
    fsync(layout.sealed, folder=True)
    return None


class _Busy(Exception):
    """Another connection held SQLite's lock on the shard past the busy timeout."""
