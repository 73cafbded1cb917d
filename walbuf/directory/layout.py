"""The layout of a directory buffer: its marker, folders and shard files, and this host's name.

    BUFFER/
      walbuf.buffer        the marker: this directory is a walbuf directory buffer
      live/HOST/GEN.db     HOST's live shard (WAL): only processes on HOST open it
      sealed/HOST.GEN.db   a sealed shard: rollback journal, never written again
      ingested/...         sealed shards whose records the hub holds (prune removes them)
      quarantine/...       shards a sync found damaged, each with HOST.GEN.db.why saying
                           why: a person recovers them (see walbuf doctor)
      hub.db               what `walbuf sync` uploads from (rollback journal)
      locks/               writer ids and the syncer, for every host

GEN is the shard's creation time in nanoseconds.
"""

from __future__ import annotations

import os
import socket
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from filelock import FileLock

from ..errors import ConfigError

ENV_HOST = "WALBUF_HOST"
ENV_ROTATE = "WALBUF_ROTATE_SECONDS"
DEFAULT_ROTATE_SECONDS = 300.0

MARKER = "walbuf.buffer"
MARKER_TEXT = "walbuf directory buffer, format 1\n"
# What a directory buffer made before the marker existed holds: it is one too.
_UNMARKED_LAYOUT = ("hub.db", "live", "sealed", "ingested")

ShardState = Literal["live", "sealed", "ingested"]


def host_name() -> str:
    """The name this host's shards go under: $WALBUF_HOST, else the hostname."""
    name = os.environ.get(ENV_HOST) or socket.gethostname()
    if not name or "/" in name or name.startswith("."):
        raise ConfigError(f"host name {name!r} cannot name a shard; set {ENV_HOST} to a plain name")
    return name


def rotate_seconds() -> float:
    """How long the writers of a host share one live shard: $WALBUF_ROTATE_SECONDS, else 300."""
    text = os.environ.get(ENV_ROTATE)
    if not text:
        return DEFAULT_ROTATE_SECONDS
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:  # NaN too
        raise ConfigError(f"{ENV_ROTATE} must be a positive number of seconds, not {text!r}")
    return value


@dataclass(frozen=True)
class Shard:
    """One shard file of a directory buffer."""

    host: str
    gen: int  # creation time, ns
    path: Path
    state: ShardState

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

    def __init__(self, root: Path) -> None:
        self.root = root
        self.marker = root / MARKER
        self.locks = root / "locks"
        self.hub = root / "hub.db"
        self.sealed = root / "sealed"
        self.ingested = root / "ingested"
        self.quarantine = root / "quarantine"

    def is_buffer(self) -> bool:
        """Whether the directory is a directory buffer: it has the marker, or (older) the layout."""
        return self.marker.is_file() or any((self.root / name).exists() for name in _UNMARKED_LAYOUT)

    def live(self, host: str) -> Path:
        return self.root / "live" / host

    def make(self) -> None:
        """Make the folders and the marker (an existing buffer keeps what it has)."""
        for directory in (self.locks, self.sealed, self.ingested, self.root / "live"):
            directory.mkdir(parents=True, exist_ok=True)
        if not self.marker.exists():
            self.marker.write_text(MARKER_TEXT)

    def shards(self, state: ShardState | None = None, host: str | None = None) -> list[Shard]:
        """The shards (of one state / host if given), oldest first."""
        found: list[Shard] = []
        if state in (None, "live"):
            hosts = [host] if host else [p.name for p in _dirs(self.root / "live")]
            for name in hosts:
                for path in _files(self.live(name), ".db"):
                    if path.stem.isdigit():  # anything else there is not walbuf's
                        found.append(Shard(name, int(path.stem), path, "live"))
        kinds: tuple[tuple[ShardState, Path], ...] = (("sealed", self.sealed), ("ingested", self.ingested))
        for kind, directory in kinds:
            if state in (None, kind):
                for path in _files(directory, ".db"):
                    name, _, gen = path.stem.rpartition(".")
                    if name and gen.isdigit() and host in (None, name):
                        found.append(Shard(name, int(gen), path, kind))
        return sorted(found, key=lambda s: (s.gen, s.host))

    def quarantined(self) -> list[tuple[Path, str]]:
        """The shards set aside as damaged, each with why, oldest first."""
        found = []
        for path in _files(self.quarantine, ".db"):
            why = path.with_name(path.name + ".why")
            found.append((path, why.read_text().strip() if why.exists() else "no reason was noted"))
        return found

    def set_aside(self, shard: Shard, why: str) -> str:
        """Move a damaged shard (nobody uses it) into quarantine/ with a note of why; a message that says so."""
        self.quarantine.mkdir(exist_ok=True)
        target = self.quarantine / f"{shard.id}.db"
        target.with_name(target.name + ".why").write_text(why + "\n")
        os.replace(shard.path, target)
        for leftover in (f"{shard.path}-wal", f"{shard.path}-shm"):
            if os.path.exists(leftover):
                os.replace(leftover, f"{target}{leftover[len(str(shard.path)):]}")
        return (
            f"shard {shard.id} is damaged ({why}) and was moved to {target}: its records are not sent;"
            " `walbuf doctor` says how to recover it"
        )

    def readable_shards(self, host: str) -> list[Shard]:
        """The shards ``host`` may read: every sealed one, and its own live ones; oldest first."""
        return [
            shard
            for shard in self.shards()
            if shard.state == "sealed" or (shard.state == "live" and shard.host == host)
        ]

    def rotate_lock(self, host: str) -> FileLock:
        self.live(host).mkdir(parents=True, exist_ok=True)
        return FileLock(self.live(host) / "rotate.lock", thread_local=False)


def _dirs(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.is_dir()) if path.is_dir() else []


def _files(path: Path, suffix: str) -> list[Path]:
    if not path.is_dir():
        return []
    return sorted(p for p in path.iterdir() if p.suffix == suffix)
