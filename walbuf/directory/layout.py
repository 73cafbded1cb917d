"""The layout of a directory buffer: its marker, folders and shard files, what is trusted there, and this host's name.

    BUFFER/
      walbuf.buffer        the marker: this directory is a walbuf directory buffer
      live/HOST/GEN.log    the shard a process of HOST appends to (walbuf.directory.frames)
      sealed/HOST.GEN.log  a shard its process is done with (or that died on the machine of a sync)
      ingested/...         sealed shards whose records the hub holds (prune removes them)
      hub.db               what `walbuf sync` uploads from (rollback journal)
      sync-host            the one host that syncs it, where locks do not span hosts
      sync-host.*.new      a sync's temporary of it, while it names its host
      locks/               writer ids and the syncer; room kept for a sync (walbuf.store.space)

GEN is the shard's creation time in nanoseconds, HOST a name of letters,
digits, ".", "_" and "-". An older walbuf wrote SQLite shards (live/HOST/GEN.db
with its -wal, -shm and .inuse, sealed/ and ingested/ HOST.GEN.db, and
quarantine/): a listing names them apart (:class:`Older`), and
walbuf.directory.upgrade takes them in once.

Everything in a buffer is walbuf's, and belongs to the buffer's owner (see
walbuf.store.trust). A listing (:meth:`Layout.scan`) sorts what a folder
holds into shards, which walbuf may open, an older walbuf's files, and
:class:`Stranger` entries, which it never opens: a name walbuf does not give
there, a symbolic link, a file of another account.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Literal

from ..arguments import env_seconds
from ..errors import ConfigError, UntrustedPathError
from ..store.space import RESERVE_NAME
from ..store.sqlite import SQLiteBackend
from ..store.trust import Owner, make_folders, shown

ENV_HOST = "WALBUF_HOST"
ENV_ROTATE = "WALBUF_ROTATE_SECONDS"
DEFAULT_ROTATE_SECONDS = 300.0

MARKER = "walbuf.buffer"
MARKER_TEXT = "walbuf directory buffer, format 1\n"
# What a directory buffer made before the marker existed holds: it is one too.
_UNMARKED_LAYOUT = ("hub.db", "live", "sealed", "ingested")

HOST = r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}"
_HOST = re.compile(HOST)
_GEN = r"\d{1,20}"
_LIVE = re.compile(rf"({_GEN})\.log")
_FILED = re.compile(rf"({HOST})\.({_GEN})\.log")  # in sealed/, ingested/
# An older walbuf's SQLite shards (walbuf.directory.upgrade), and what it kept beside them.
_OLDER_LIVE = re.compile(rf"({_GEN})\.db")
_OLDER_LIVE_COMPANION = re.compile(rf"({_GEN})\.db(-wal|-shm|-journal|\.inuse)")
_OLDER_FILED = re.compile(rf"({HOST})\.({_GEN})\.db")  # in sealed/, ingested/, quarantine/
_OLDER_QUARANTINED = re.compile(rf"({HOST})\.({_GEN})\.db(-wal|-shm|\.why)")
_OLDER_ROTATE_LOCK = "rotate.lock"  # in live/HOST/
_LOCK = re.compile(rf"(?:sync|migrate|writer-[0-9a-f]{{24}})\.lock|{RESERVE_NAME}|upgrade\.part|clock")
_ROOT = frozenset(
    {
        MARKER,
        "hub.db",
        "hub.db-journal",
        "hub.db.wandb",
        "live",
        "sealed",
        "ingested",
        "quarantine",  # an older walbuf's
        "locks",
        "sync-host",  # walbuf.directory.sync_host
        "sync-host.new",  # an older walbuf's temporary of it
    }
)
# A sync's temporary of sync-host: the hash of its host's name, then its own random part (walbuf.directory.sync_host).
SYNC_HOST_TEMPORARY = re.compile(r"sync-host\.([0-9a-f]{16})\.[0-9a-f]{16}\.new")
# What an NFS client (.nfsXXXX) or a FUSE filesystem (.fuse_hiddenXXXX, sshfs
# say) names a file removed while a process had it open: gone when it closes it.
_REMOVED_WHILE_OPEN = re.compile(r"\.nfs[0-9A-Fa-f]+|\.fuse_hidden[0-9A-Fa-f]+")

ShardState = Literal["live", "sealed", "ingested"]
_STATES: tuple[ShardState, ...] = ("live", "sealed", "ingested")  # the order a shard goes through them
OlderState = Literal["live", "sealed", "ingested", "quarantine"]


def host_name() -> str:
    """The name this host's shards go under: $WALBUF_HOST, else the hostname."""
    name = os.environ.get(ENV_HOST) or socket.gethostname()
    if not _HOST.fullmatch(name):
        raise ConfigError(
            f"host name {name!r} cannot name a shard (letters, digits, '.', '_' and '-', starting with a letter"
            f" or digit); set {ENV_HOST} to such a name"
        )
    return name


def rotate_seconds() -> float:
    """How long a process appends to one shard before it moves to a new one: $WALBUF_ROTATE_SECONDS, else 300."""
    return env_seconds(ENV_ROTATE, DEFAULT_ROTATE_SECONDS)


@dataclass(frozen=True)
class Shard:
    """One shard file of a directory buffer, of a name walbuf gives and a file of the buffer's owner."""

    host: str
    gen: int  # creation time, ns
    path: Path
    state: ShardState

    @property
    def id(self) -> str:
        """Stable across sealing: the hub's cursors are keyed by it."""
        return f"{self.host}.{self.gen}"

    def filed(self, folder: Path) -> Path:
        """Its path in sealed/ or ingested/ (``folder``)."""
        return folder / f"{self.id}.log"


@dataclass(frozen=True)
class Older:
    """A SQLite shard an older walbuf wrote (see walbuf.directory.upgrade); its companions are the owner's files."""

    host: str
    gen: int
    path: Path
    state: OlderState

    @property
    def id(self) -> str:
        return f"{self.host}.{self.gen}"


@dataclass(frozen=True)
class Stranger:
    """Something in a buffer that walbuf does not open, and why."""

    path: Path
    why: str


@dataclass
class Scan:
    """What a listing of a buffer's folders found: its shards (oldest first), an older walbuf's, and what walbuf
    does not open."""

    shards: list[Shard] = field(default_factory=list)
    older: list[Older] = field(default_factory=list)
    strangers: list[Stranger] = field(default_factory=list)


class Layout:
    """The paths of a directory buffer, and what walbuf trusts there (its owner's files; see walbuf.store.trust)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.marker = root / MARKER
        self.locks = root / "locks"
        self.hub = root / "hub.db"
        self.sealed = root / "sealed"
        self.ingested = root / "ingested"
        self.quarantine = root / "quarantine"

    @cached_property
    def owner(self) -> Owner:
        """The buffer's owner (UntrustedPathError for a root that is a link, or that others may write)."""
        return Owner.of(self.root, write=False)

    def own(self) -> Owner:
        """The owner, which must be this process's account: before anything is written (else BufferNotWritableError)."""
        return Owner.of(self.root, write=True)

    def is_buffer(self) -> bool:
        """Whether the directory is a directory buffer: it has the marker, or (older) the layout."""
        return any(os.path.lexists(self.root / name) for name in (MARKER, *_UNMARKED_LAYOUT))

    def live(self, host: str) -> Path:
        return self.root / "live" / host

    def make(self) -> Owner:
        """Make the buffer's folders and marker, owner-only (an existing buffer keeps what it has); its owner."""
        if not os.path.lexists(self.root):
            make_folders(self.root)
        owner = self.own()
        # Lock files live in locks/: it stays owner-only, and so does live/.
        for folder in (self.locks, self.root / "live"):
            owner.folder(folder, make=True, private=True)
        for folder in (self.sealed, self.ingested):
            owner.folder(folder, make=True)
        if not os.path.lexists(self.marker):
            try:
                owner.create(self.marker, MARKER_TEXT.encode())
            except FileExistsError:
                pass  # another process made it meanwhile
        return owner

    def scan(self, state: ShardState | None = None, host: str | None = None) -> Scan:
        """The shards (of one state / host if given), an older walbuf's, and what the folders listed hold that walbuf
        does not open.

        Listing reads names and lstat()s what it finds; it opens nothing.
        Raises UntrustedPathError if one of the buffer's own folders (live/,
        sealed/, ...) is a link, another account's, or writable by others.
        """
        found = Scan()
        if state in (None, "live"):
            if host is not None:
                self._scan_live(found, host, self.live(host))
            elif self.owner.folder(self.root / "live"):
                for name, path in self._private_names(self.root / "live"):
                    if not _HOST.fullmatch(name):
                        found.strangers.append(Stranger(path, _unknown(path)))
                        continue
                    self._scan_live(found, name, path)
        kinds: tuple[tuple[ShardState, Path], ...] = (("sealed", self.sealed), ("ingested", self.ingested))
        for kind, folder in kinds:
            if state in (None, kind) and self.owner.folder(folder):
                self._scan_filed(found, kind, folder, host)
        if state is None and self.owner.folder(self.quarantine):
            self._scan_quarantine(found, host)
        # The folders are listed in the order shards move through them: one moved between two listings is in
        # both, and is where it went.
        furthest: dict[str, Shard] = {}
        for shard in found.shards:
            if shard.id not in furthest or _STATES.index(shard.state) > _STATES.index(furthest[shard.id].state):
                furthest[shard.id] = shard
        found.shards = sorted(furthest.values(), key=lambda s: (s.gen, s.host))
        found.older.sort(key=lambda s: (s.gen, s.host))
        return found

    def shards(self, state: ShardState | None = None, host: str | None = None) -> list[Shard]:
        """The shards walbuf may open (of one state / host if given), oldest first; see :meth:`scan`."""
        return self.scan(state, host).shards

    def strangers(self) -> list[Stranger]:
        """Everything in the buffer that walbuf does not open: in its root, shard folders and locks/."""
        found = self.scan().strangers
        for name, path in _names(self.root):
            if name not in _ROOT and not SYNC_HOST_TEMPORARY.fullmatch(name):
                found.append(Stranger(path, _unknown(path)))
        if self.owner.folder(self.locks):
            for name, path in self._private_names(self.locks):
                self._check(found, path, _LOCK.fullmatch(name) is not None)
        return sorted(found, key=lambda s: str(s.path))

    def sealed_as(self, shard: Shard) -> Shard | None:
        """The sealed shard a live one became (its process sealed it since it was listed), if it did; None for any
        other."""
        if shard.state != "live":
            return None
        return next((s for s in self.shards("sealed", shard.host) if s.id == shard.id), None)

    def moved(self, shard: Shard) -> Shard | None:
        """Where a shard is now that is no longer where it was listed: sealed or ingested since (or back in sealed/,
        where prune found records of an ingested one the hub lacks); None if gone."""
        later = {"live": ("sealed", "ingested"), "sealed": ("ingested",), "ingested": ("sealed",)}[shard.state]
        return next((s for s in self.shards(host=shard.host) if s.id == shard.id and s.state in later), None)

    def _private_names(self, folder: Path) -> list[tuple[str, Path]]:
        """The names in one of the owner-only folders (live/, live/HOST/, locks/): none for another account.

        Another account granted read access to the buffer reads its hub and
        sealed shards; its live shards and locks stay the owner's.
        """
        try:
            return _names(folder)
        except PermissionError:
            if self.owner.uid == os.geteuid():
                raise
            return []

    def _scan_live(self, found: Scan, host: str, folder: Path) -> None:
        try:
            if not self.owner.folder(folder):
                return
        except UntrustedPathError as exc:
            found.strangers.append(Stranger(folder, str(exc)))
            return
        older: dict[int, Path] = {}
        refused: dict[int, Path] = {}  # an older shard's GEN -> a companion of it that is not trusted
        companions: dict[int, Path] = {}
        for name, path in self._private_names(folder):
            shard, old, companion = (
                _LIVE.fullmatch(name),
                _OLDER_LIVE.fullmatch(name),
                _OLDER_LIVE_COMPANION.fullmatch(name),
            )
            known = bool(shard or old or companion) or name == _OLDER_ROTATE_LOCK
            if not self._check(found.strangers, path, known):
                if companion:
                    refused[int(companion[1])] = path
            elif shard:
                found.shards.append(Shard(host, int(shard[1]), path, "live"))
            elif old:
                older[int(old[1])] = path
            elif companion and companion[2] in ("-wal", "-journal"):
                companions[int(companion[1])] = path
        for gen, path in older.items():
            if gen in refused:
                why = f"{path} is not opened, as its companion {shown(refused[gen])} is not trusted"
                found.strangers.append(Stranger(path, why))
            else:
                found.older.append(Older(host, gen, path, "live"))
        for gen, path in companions.items():
            if gen not in older:
                # What an older walbuf left where a sync of another host sealed a shard under its writers:
                # records committed after that may be in it, and no sync reads them.
                found.strangers.append(
                    Stranger(
                        path,
                        f"{shown(path)} is left without its shard (an older walbuf sealed the shard while a"
                        " process still wrote it): records in it reach no sync; keep it for a person, who can"
                        " recover them with the shard from sealed/ or ingested/ (docs/directory-buffers.md)",
                    )
                )

    def _scan_filed(self, found: Scan, kind: ShardState, folder: Path, host: str | None) -> None:
        for name, path in _names(folder):
            match, old = _FILED.fullmatch(name), _OLDER_FILED.fullmatch(name)
            if not self._check(found.strangers, path, bool(match or old)):
                continue
            if match and host in (None, match[1]):
                found.shards.append(Shard(match[1], int(match[2]), path, kind))
            elif old and host in (None, old[1]):
                found.older.append(Older(old[1], int(old[2]), path, kind))

    def _scan_quarantine(self, found: Scan, host: str | None) -> None:
        for name, path in _names(self.quarantine):
            old = _OLDER_FILED.fullmatch(name)
            known = bool(old or _OLDER_QUARANTINED.fullmatch(name))
            if self._check(found.strangers, path, known) and old and host in (None, old[1]):
                found.older.append(Older(old[1], int(old[2]), path, "quarantine"))

    def _check(self, strangers: list[Stranger] | None, path: Path, named: bool) -> bool:
        """Whether ``path`` is a trusted file of a name walbuf gives there; if not, a Stranger in ``strangers``."""
        if not named:
            why = _unknown(path)
        else:
            try:
                self.owner.entry(path)
                return True
            except UntrustedPathError as exc:
                why = str(exc)
        if strangers is not None:
            strangers.append(Stranger(path, why))
        return False


def _names(folder: Path) -> list[tuple[str, Path]]:
    """The names in ``folder`` (a checked folder), each with its path; NFS's and FUSE's transient names left out."""
    return [(name, folder / name) for name in sorted(os.listdir(folder)) if not _REMOVED_WHILE_OPEN.fullmatch(name)]


def _unknown(path: Path) -> str:
    return (
        f"{shown(path)} is not a name walbuf gives there, so walbuf does not open it;"
        " find out who put it there, then remove it (see docs/security.md)"
    )


def hub_backend(layout: Layout) -> SQLiteBackend:
    """The hub's database, and the buffer's locks beside it (in locks/)."""
    # Opened by one host at a time, never shared live between hosts: a rollback journal, not WAL.
    return SQLiteBackend(layout.hub, locks=layout.locks, journal="delete", owner=layout.owner)
