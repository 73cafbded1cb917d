"""Sealing: a shard becomes sealed once nothing will be appended to it, and only a process that knows it says so.

A log shard (walbuf.directory.appender) is sealed by its own process: an
END frame, then a rename into sealed/. A process that died leaves its
shard live; a sync on the same machine (where it can tell for sure that
the process ended, see walbuf.directory.host) renames it into sealed/
(:func:`seal_ended`), with no END frame. A sync on another machine never
does: it reads the shard as it is, and changes nothing of it.

SQLite shards of an older walbuf (live/HOST/GEN.db, shared by the
processes of HOST in WAL mode, each holding a shared flock on
GEN.db.inuse) are sealed as that walbuf did, but only by a sync on their
own host (:func:`seal_unused`): the flock tells nothing across hosts whose
locks do not span them, and SQLite's WAL index is memory of that host.
Sealing one checkpoints its WAL, switches it out of WAL mode and moves it
to sealed/.
"""

from __future__ import annotations

import fcntl
import logging
import os
import sqlite3
from dataclasses import dataclass
from pathlib import Path

from ..errors import StorageError
from ..store.flock import held
from ..store.sqlite import COMPANIONS, failure, harden
from ..store.trust import Owner, fsync
from .layout import Layout, Shard
from .log_shard import first_process
from .shard import ShardError, ShardGone

_log = logging.getLogger(__name__)


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


def seal_if_unused(layout: Layout, host: str, path: Path) -> SealOutcome:
    """Seal ``host``'s live shard at ``path`` unless a process uses it.

    Left as it is if a process uses it (or holds SQLite's lock on it past
    the busy timeout, or it is gone); set aside in quarantine/, with a
    message, if it was damaged. Raises StorageError if the shard cannot be
    read or written.
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
                damage = _seal(layout, owner, host, path)
            except _Busy:
                return _LEFT  # a reader holds it (walbuf status on its host, say): the next sync seals it
            outcome = SealOutcome(sealed=True)
            if damage is not None:
                outcome = SealOutcome(set_aside=layout.set_aside(Shard(host, int(path.stem), path, "live"), damage))
            os.unlink(f"{path}.inuse")
            return outcome
        finally:
            os.close(fd)


def seal_ended(layout: Layout) -> list[Path]:
    """Seal the live log shards whose process ended on this machine (it is sure of that alone); their new paths.

    Such a shard ends at its last whole frame (a frame its process was
    writing as it died is cut off). One that is not a shard walbuf wrote is
    left where it is: ingest reports it.
    """
    sealed = []
    for shard in layout.shards("live"):
        if shard.format != "log":
            continue
        try:
            process = first_process(layout, shard)
        except (ShardGone, ShardError):
            continue
        if process is None or process.running() is not False:
            continue  # it runs, or its machine is another: not this sync's to judge
        owner = layout.own()
        owner.folder(layout.sealed, make=True)
        target = shard.filed(layout.sealed)
        os.replace(shard.path, target)
        sealed.append(target)
    if sealed:
        fsync(layout.sealed, folder=True)
    return sealed


def in_use(layout: Layout, path: Path) -> bool:
    """Whether a process holds the live shard at ``path`` (its shared flock).

    Needs only read access to the lock file (PermissionError without it).
    """
    return held(Path(f"{path}.inuse"), layout.owner)


def seal_unused(layout: Layout, here: str) -> Sealing:
    """Seal the live SQLite shards (an older walbuf's) of host ``here`` that no process uses any more."""
    done = Sealing([], [])
    for shard in layout.shards("live", here):
        if shard.format != "sqlite":
            continue
        outcome = seal_if_unused(layout, shard.host, shard.path)
        if outcome.sealed:
            done.sealed.append(layout.sealed / f"{shard.host}.{shard.gen}.db")
        elif outcome.set_aside is not None:
            done.set_aside.append(outcome.set_aside)
    return done


def _seal(layout: Layout, owner: Owner, host: str, path: Path) -> str | None:
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
