"""The layout of a directory buffer: its marker, folders and shard files, what is trusted there, and this host's name.

    BUFFER/
      walbuf.buffer        the marker: this directory is a walbuf directory buffer
      live/HOST/GEN.log    the shard a process of HOST appends to (walbuf.directory.frames)
      sealed/HOST.GEN.log  a shard its process is done with (or that died on the machine of a sync)
      ingested/...         sealed shards whose records the hub holds (prune removes them)
      quarantine/...       SQLite shards a sync set aside (damaged, or refused), each with
                           HOST.GEN.db.why saying why: a person looks (see walbuf doctor)
      hub.db               what `walbuf sync` uploads from (rollback journal)
      sync-host            the one host that syncs it, where locks do not span hosts
      locks/               writer ids and the syncer; room kept for a sync (walbuf.store.space)

GEN is the shard's creation time in nanoseconds, HOST a name of letters,
digits, ".", "_" and "-". Shards named .db (live/HOST/GEN.db, sealed and
ingested HOST.GEN.db) are SQLite files an older walbuf wrote; they are still
read, and sealed on their own host.

Everything in a buffer is walbuf's, and belongs to the buffer's owner (see
walbuf.store.trust). A listing (:meth:`Layout.scan`) sorts what a folder
holds into shards, which walbuf may open, and :class:`Stranger` entries,
which it never opens: a name walbuf does not give there, a symbolic link, a
file of another account (or a shard one of whose -wal, -shm or -journal is).
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Literal

from ..arguments import env_seconds
from ..errors import ConfigError, UntrustedPathError
from ..store.backend import holding
from ..store.flock import FileLock
from ..store.space import RESERVE_NAME
from ..store.sqlite import SQLiteBackend
from ..store.trust import Owner, make_folders, shown

ENV_HOST = "WALBUF_HOST"
ENV_ROTATE = "WALBUF_ROTATE_SECONDS"
DEFAULT_ROTATE_SECONDS = 300.0
ROTATE_WAIT = 60.0  # seconds a process waits for its host's rotate.lock before it says who holds it
WHY_LIMIT = 4096  # bytes of a quarantined shard's note that are read

MARKER = "walbuf.buffer"
MARKER_TEXT = "walbuf directory buffer, format 1\n"
# What a directory buffer made before the marker existed holds: it is one too.
_UNMARKED_LAYOUT = ("hub.db", "live", "sealed", "ingested")

HOST = r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}"
_HOST = re.compile(HOST)
_GEN = r"\d{1,20}"
_LIVE = re.compile(rf"({_GEN})\.(db|log)")
_LIVE_COMPANION = re.compile(rf"({_GEN})\.db(-wal|-shm|-journal|\.inuse)")
_FILED = re.compile(rf"({HOST})\.({_GEN})\.(db|log)")  # in sealed/, ingested/
_QUARANTINED = re.compile(rf"({HOST})\.({_GEN})\.db")
_QUARANTINE_COMPANION = re.compile(rf"({HOST})\.({_GEN})\.db(-wal|-shm|\.why)")
_LOCK = re.compile(rf"(?:sync|migrate|writer-[0-9a-f]{{24}})\.lock|{RESERVE_NAME}")
_ROOT = frozenset(
    {
        MARKER,
        "hub.db",
        "hub.db-journal",
        "hub.db.wandb",
        "live",
        "sealed",
        "ingested",
        "quarantine",
        "locks",
        "sync-host",  # walbuf.directory.sync_host
        "sync-host.new",
    }
)
# What an NFS client (.nfsXXXX) or a FUSE filesystem (.fuse_hiddenXXXX, sshfs
# say) names a file removed while a process had it open: gone when it closes it.
_REMOVED_WHILE_OPEN = re.compile(r"\.nfs[0-9A-Fa-f]+|\.fuse_hidden[0-9A-Fa-f]+")

ShardState = Literal["live", "sealed", "ingested"]
ShardFormat = Literal["log", "sqlite"]


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
        """Stable across sealing: the hub's ingest cursors are keyed by it."""
        return f"{self.host}.{self.gen}"

    @property
    def format(self) -> ShardFormat:
        """ "log": frames appended by one process (walbuf.directory.frames); "sqlite": an older walbuf's database."""
        return "log" if self.path.suffix == ".log" else "sqlite"

    def filed(self, folder: Path) -> Path:
        """Its path in sealed/, ingested/ or quarantine/ (``folder``)."""
        return folder / f"{self.id}{self.path.suffix}"


@dataclass(frozen=True)
class Stranger:
    """Something in a buffer that walbuf does not open, and why."""

    path: Path
    why: str


@dataclass
class Scan:
    """What a listing of a buffer's folders found: its shards (oldest first), and what walbuf does not open."""

    shards: list[Shard] = field(default_factory=list)
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
        # Lock files live in locks/ and live/HOST/: those stay owner-only.
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
        """The shards (of one state / host if given), and what the folders listed hold that walbuf does not open.

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
        found.shards.sort(key=lambda s: (s.gen, s.host))
        return found

    def shards(self, state: ShardState | None = None, host: str | None = None) -> list[Shard]:
        """The shards walbuf may open (of one state / host if given), oldest first; see :meth:`scan`."""
        return self.scan(state, host).shards

    def strangers(self) -> list[Stranger]:
        """Everything in the buffer that walbuf does not open: in its root, shard folders, quarantine/ and locks/."""
        found = self.scan().strangers
        for name, path in _names(self.root):
            if name not in _ROOT:
                found.append(Stranger(path, _unknown(path)))
        if self.owner.folder(self.locks):
            for name, path in self._private_names(self.locks):
                self._check(found, path, _LOCK.fullmatch(name) is not None)
        self.quarantined(found)
        return sorted(found, key=lambda s: str(s.path))

    def quarantined(self, strangers: list[Stranger] | None = None) -> list[tuple[Path, str]]:
        """The shards a sync set aside in quarantine/, each with why, oldest first.

        What is there but not trusted is added to ``strangers``.
        """
        if not self.owner.folder(self.quarantine):
            return []
        shards, notes = [], {}
        for name, path in _names(self.quarantine):
            match, companion = _QUARANTINED.fullmatch(name), _QUARANTINE_COMPANION.fullmatch(name)
            trusted = self._check(strangers, path, match is not None or companion is not None)
            if match and trusted:
                shards.append((int(match[2]), path))
            elif companion and trusted and companion[3] == ".why":
                notes[name[: -len(".why")]] = path
        out = []
        for _, path in sorted(shards):
            note = notes.get(path.name)
            text = self.owner.read(note, WHY_LIMIT) if note is not None else None
            out.append((path, text.decode("utf-8", "replace").strip() if text else "no reason was noted"))
        return out

    def set_aside(self, shard: Shard, why: str) -> str:
        """Move a shard nobody uses into quarantine/ with a note of why; a message that says so."""
        owner = self.own()
        owner.folder(self.quarantine, make=True)
        target = self.quarantine / f"{shard.id}.db"
        owner.entry(target)  # one there before is replaced, if it is the owner's own
        owner.create(target.with_name(target.name + ".why"), (why + "\n").encode())
        # Renames never follow a link; both folders are the owner's.
        os.replace(shard.path, target)
        for suffix in ("-wal", "-shm"):
            if owner.entry(Path(f"{shard.path}{suffix}")) is not None:
                os.replace(f"{shard.path}{suffix}", f"{target}{suffix}")
        return (
            f"shard {shard.id} was moved to {target} ({why}): its records are not sent; `walbuf doctor` says what to do"
        )

    def sealed_as(self, shard: Shard) -> Shard | None:
        """The sealed shard a live one became (its writers let go since it was listed), if it did; None for any
        other."""
        if shard.state != "live":
            return None
        return next(
            (s for s in self.shards("sealed", shard.host) if s.id == shard.id and s.format == shard.format), None
        )

    def readable_shards(self, host: str) -> list[Shard]:
        """The shards ``host`` may read, oldest first: every sealed one, every live log (appended only, so any host
        reads it as it grows), and its own live SQLite shards (an older walbuf's, in WAL mode)."""
        return [
            shard
            for shard in self.shards()
            if shard.state == "sealed" or (shard.state == "live" and (shard.format == "log" or shard.host == host))
        ]

    @contextmanager
    def rotate_lock(self, host: str) -> Iterator[None]:
        """Hold ``host``'s rotate.lock: choosing a shard and sealing one take turns on it.

        Waits up to ROTATE_WAIT seconds, then raises BufferBusyError naming
        the lock: a process that holds it longer hangs.
        """
        owner = self.own()
        owner.folder(self.root / "live", make=True, private=True)
        owner.folder(self.live(host), make=True, private=True)
        lock = FileLock(self.live(host) / "rotate.lock", owner)
        waiting = f"{lock.path}: another process is choosing or sealing a shard of {host}"
        busy = (
            f"{lock.path} stayed held for {ROTATE_WAIT:g}s: a process that chooses or seals a shard of"
            f" host {host} does not let go; find it with `fuser {lock.path}` on {host}"
        )
        with holding(lock, ROTATE_WAIT, waiting, busy):
            yield

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
        shards: list[Shard] = []
        refused: dict[int, Path] = {}  # an older walbuf's SQLite shard by its GEN -> a companion not trusted
        companions: dict[int, Path] = {}
        for name, path in self._private_names(folder):
            shard, companion = _LIVE.fullmatch(name), _LIVE_COMPANION.fullmatch(name)
            if name == "rotate.lock":
                self._check(found.strangers, path, True)
            elif not self._check(found.strangers, path, bool(shard or companion)):
                if companion:
                    refused[int(companion[1])] = path
            elif shard:
                shards.append(Shard(host, int(shard[1]), path, "live"))
            elif companion and companion[2] in ("-wal", "-journal"):
                companions[int(companion[1])] = path
        self._keep(found, shards, refused)
        databases = {s.gen for s in shards if s.format == "sqlite"}
        for gen, path in companions.items():
            if gen not in databases:
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
            match = _FILED.fullmatch(name)
            if self._check(found.strangers, path, match is not None) and match and host in (None, match[1]):
                found.shards.append(Shard(match[1], int(match[2]), path, kind))

    def _keep(self, found: Scan, shards: list[Shard], refused: dict[int, Path]) -> None:
        """Add ``shards`` to ``found``, but for SQLite ones one of whose companions is not trusted (SQLite would open
        it)."""
        for shard in shards:
            if shard.format == "sqlite" and shard.gen in refused:
                found.strangers.append(
                    Stranger(
                        shard.path,
                        f"{shard.path} is not opened, as its companion {shown(refused[shard.gen])} is not trusted",
                    )
                )
            else:
                found.shards.append(shard)

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
