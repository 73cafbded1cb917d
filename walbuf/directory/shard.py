"""Reading a shard (frames one process appended, see walbuf.directory.frames), as untrusted input.

Any host reads any shard, live or not, and never writes it: the file is
opened read-only, never through a link, and must be the buffer owner's.
What a frame holds is checked before it is used: a writer, run, step axis,
prefix and W&B target of the types walbuf writes, records and config entries
of a writer the shard named before them. A frame that fails a check is
:class:`BadFrame` (a sync reports the shard and reads nothing past it); a
frame cut off with nothing whole after it ends the shard for now (its
process may be writing it, or died writing it). Bytes that hold no whole
frame but have one after them are :class:`Unread`, and so are the frames
after them of a writer the shard may have named in such bytes
(:class:`Unnamed`): the reader goes on past them, and its caller keeps their
place to read them again.
"""

from __future__ import annotations

import errno
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..errors import BufferCorruptError, ConfigError, StorageError
from ..store import Target
from ..store.target import check_target
from . import frames
from .frames import Frame, FrameReader, Stop, Unread, WriterEntry
from .host import Process
from .layout import Layout, Shard


class ShardError(BufferCorruptError):
    """A shard (never the hub) holds what walbuf would not write: a sync reports it, and goes on with the others."""


class ShardGone(StorageError):
    """The shard is no longer where it was found: sealed (renamed into sealed/) or taken in meanwhile."""


class ReadStopped(Exception):
    """The caller's stop condition (a sync's time bound) held while a shard was read; nothing half-read is used."""


class BadFrame(ShardError):
    """A whole frame of a shard that walbuf would not have written; nothing past it is read."""


@dataclass(frozen=True)
class Opened:
    """A writer opened (or goes on) in the shard under ``local``."""

    local: int
    entry: WriterEntry
    time: float


@dataclass(frozen=True)
class Logged:
    local: int
    step: int
    time: float
    metrics: str  # JSON text, as the writer encoded it (checked again when it is sent)


@dataclass(frozen=True)
class ConfigSet:
    local: int
    kind: str  # "config" or "summary"
    time: float
    entries: dict[str, str]  # key -> JSON text


@dataclass(frozen=True)
class Closed:
    local: int
    exit: int
    time: float


@dataclass(frozen=True)
class Heard:
    """A frame that says only that the process ran at ``time``: a heartbeat, or the shard's end (``end``)."""

    time: float
    end: bool = False


@dataclass(frozen=True)
class Unnamed:
    """A whole frame of writer ``local``, which the shard did not name before it: its naming frame may lie in bytes
    not read yet (an :class:`Unread` before it). Read it again once they are."""

    local: int


@dataclass(frozen=True)
class Started:
    """The shard's first frame: the process that appends it, and the file server's clock minus the process's, as it
    measured them making the shard (0 from an older walbuf)."""

    process: Process
    time: float
    clock: float = 0.0


Event = Started | Opened | Logged | ConfigSet | Closed | Heard | Unnamed
Item = tuple[Frame, Event] | Unread
"""What reading a shard yields: a whole frame with what it says, or bytes to read again later."""


# What reading an open shard gives where another host renamed it (sealed, taken in): a client that reaches an open
# file by its name (FUSE, sshfs) or by a handle the server let go (NFS) has lost it.
_MOVED = frozenset({errno.ENOENT, errno.ESTALE})


class ShardReader:
    """One log shard, open for reading. A context manager; the file is never written.

    Raises ShardGone if it is not where it was listed (sealed or taken in
    meanwhile), UntrustedPathError for a link or another account's file,
    StorageError for any other failure to open it.
    """

    def __init__(self, layout: Layout, shard: Shard) -> None:
        self.shard = shard
        self.path: Path = shard.path
        try:
            self._fd = layout.owner.open(shard.path, os.O_RDONLY)
        except FileNotFoundError:
            raise ShardGone(f"shard {shard.path} is gone (sealed or taken in meanwhile)") from None
        except OSError as exc:
            raise StorageError(
                f"shard {shard.path} could not be opened ({exc.strerror}); nothing was taken from it"
            ) from exc
        # Pages of it this machine read before may be older than what another
        # host appended since (a client without close-to-open consistency):
        # read it as it is now.
        try:
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass  # advice only: where it is refused, reading is as the filesystem gives it
        self.offset = 0
        self.stop: Stop = "end"

    def close(self) -> None:
        os.close(self._fd)

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def size(self) -> int:
        return os.fstat(self._fd).st_size

    def stat(self) -> tuple[int, float]:
        """Its size and mtime now (the mtime the file server gave its last append)."""
        st = os.fstat(self._fd)
        return st.st_size, st.st_mtime

    def events(self, offset: int, known: set[int], *, end: int | None = None, unread: bool = False) -> Iterator[Item]:
        """What the shard holds from ``offset`` on (up to ``end``, if given), checked: each whole frame with its event,
        and :class:`Unread` bytes.

        ``known`` holds the local ids of the writers the shard named before
        ``offset``; those it names from there on are added. A frame of a
        writer not named before is :class:`Unnamed` once bytes before it
        were unread (here, or before ``offset``: ``unread``), else BadFrame.
        Afterwards :attr:`offset` is where reading stopped and :attr:`stop`
        why. Raises BadFrame at a frame walbuf would not have written
        (:attr:`offset` is then that frame's), StorageError if the file cannot
        be read.
        """
        reader = FrameReader(self._fd, offset, end)
        self.offset = offset
        try:
            for item in reader:
                if isinstance(item, Unread):
                    unread = True
                    yield item
                    self.offset = item.end
                    continue
                event = self._event(item, known, unread)
                if isinstance(event, Opened):
                    known.add(event.local)
                yield item, event
                self.offset = item.end
        except OSError as exc:
            if exc.errno in _MOVED:
                raise ShardGone(f"shard {self.path} moved while it was read; nothing more was taken here") from exc
            raise StorageError(f"shard {self.path} could not be read ({exc.strerror}); nothing more was taken") from exc
        self.stop = reader.stop

    def _event(self, frame: Frame, known: set[int], unread: bool) -> Event:
        try:
            local = _writer_of(frame)
            if local is not None and local not in known:
                if unread:
                    return Unnamed(local)
                raise ValueError(f"writer {local}, which the shard did not name before")
            if (frame.offset == 0) != (frame.kind == frames.PROCESS):
                raise ValueError("a shard starts with the frame of its process, and has only one")
            if frame.kind == frames.RECORD:
                local, step, time, metrics = frame.record()
                if step < 0 or not math.isfinite(time):
                    raise ValueError("a record with a negative step or a time that is not a number")
                return Logged(local, step, time, metrics)
            if frame.kind == frames.ALIVE:
                return Heard(_time(frame.alive()))
            value = frame.json()
            time = _time(value.get("time"))
            if frame.kind == frames.PROCESS:
                if value.get("format") != 1:
                    raise ValueError(f"a shard of format {value.get('format')!r}, which this walbuf does not know")
                clock = value.get("clock", 0.0)
                return Started(Process.from_json(value.get("process")), time, _time(clock))
            if frame.kind == frames.WRITER:
                return Opened(_local(value.get("id")), _writer(value), time)
            if frame.kind == frames.CONFIG:
                local, kind, entries = _local(value.get("writer")), value.get("kind"), value.get("entries")
                if kind not in ("config", "summary") or not isinstance(entries, dict):
                    raise ValueError("a config frame of another kind or without entries")
                if not all(type(k) is str and type(v) is str for k, v in entries.items()):
                    raise ValueError("config entries that are not text")
                return ConfigSet(local, kind, time, entries)
            if frame.kind == frames.CLOSED:
                local, code = _local(value.get("writer")), value.get("exit")
                if code not in (0, 1) or type(code) is not int:
                    raise ValueError("an exit code walbuf never writes")
                return Closed(local, code, time)
            return Heard(time, end=True)  # frames.END
        except (ValueError, UnicodeDecodeError) as exc:
            raise BadFrame(
                f"shard {self.path}: the frame at byte {frame.offset} is not one walbuf writes ({exc});"
                " nothing past it is read"
            ) from None


def _time(value: object) -> float:
    if type(value) not in (int, float) or not math.isfinite(value):  # type: ignore[arg-type]
        raise ValueError("a time that is not a number")
    return float(value)  # type: ignore[arg-type]


def _local(value: object) -> int:
    if type(value) is not int or not 0 < value < 2**32:
        raise ValueError("a writer id that is not a positive int")
    return value


def _writer_of(frame: Frame) -> int | None:
    """The writer a record, config or close frame is of (None for other kinds); ValueError if it names none."""
    if frame.kind == frames.RECORD:
        return frame.record()[0]
    if frame.kind in (frames.CONFIG, frames.CLOSED):
        return _local(frame.json().get("writer"))
    return None


def _writer(value: dict[str, object]) -> WriterEntry:
    names = [value.get(k) for k in ("run", "name", "step_axis", "host")]
    prefix, pid, target = value.get("prefix"), value.get("pid"), value.get("target")
    if not all(type(v) is str and v for v in names) or type(prefix) is not str:
        raise ValueError("a writer whose names are not text")
    if type(pid) is not int or not isinstance(target, list) or len(target) != 3:
        raise ValueError("a writer whose pid or W&B target is of a wrong type")
    if not all(v is None or type(v) is str for v in target):
        raise ValueError("a W&B target that is not text")
    wandb_target = Target(*target)
    try:
        check_target(wandb_target)
    except ConfigError as exc:
        raise ValueError(str(exc)) from None
    run, name, axis, host = (str(v) for v in names)
    return WriterEntry(run, name, axis, prefix, host, pid, wandb_target)


def open_where_now(layout: Layout, shard: Shard) -> ShardReader | None:
    """A reader of ``shard`` where it is now: where it was listed, or sealed or taken in since; None if it is gone
    (pruned). Raises what ShardReader raises, ShardGone aside."""
    for _ in range(3):  # live, sealed, ingested: each move goes one way
        try:
            return ShardReader(layout, shard)
        except ShardGone:
            moved = layout.moved(shard)
            if moved is None:
                return None
            shard = moved
    return None


def first_process(layout: Layout, shard: Shard) -> Process | None:
    """The process a log shard names in its first frame; None if that frame is not whole yet (just made, or cut off).

    Raises ShardGone, BadFrame for a first frame walbuf would not write.
    """
    with ShardReader(layout, shard) as log:
        for item in log.events(0, set()):
            if isinstance(item, Unread) or item[0].offset != 0:
                return None  # its first frame cannot be read
            event = item[1]
            assert isinstance(event, Started)  # events() checks that a shard starts so
            return event.process
    return None
