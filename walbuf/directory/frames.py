"""The file format of a directory buffer's shards: frames, appended and never rewritten.

A shard is written by one process, which only ever appends to it; any host
reads it at any time, live or not, and never writes it. That is what makes a
directory buffer safe where a cluster filesystem does not give one host's
locks or caches to another (NFS ``nolock``/``local_lock``, Lustre
``localflock``, sshfs, most FUSE filesystems): nothing a reader sees is ever
changed under it, only added to. A reader that sees an older length, or
pages cached before the last append, sees a shorter file, never a different
one (docs/directory-buffers.md).

A frame::

    magic (2 bytes, b"\\xa7\\x1f") | kind (1 byte) | 0 (1 byte) | body length (u32 LE) | CRC-32 (u32 LE) | body

The CRC covers the kind byte and the body, so a frame is taken only whole
and as written: one cut off by a crash or still being written, a page of
zeros, or bytes of another frame fail it. Where bytes hold no whole frame
and a whole frame follows them, the reader says so (:class:`Unread`) and
goes on from that frame, as LevelDB's log reader resynchronises: such bytes
are a page that never reached the disk before a crash (later ones did), or
a page a client's cache holds stale, which a later read may get right; so
a reader keeps their place and reads them again, never passing them for
good. Where nothing whole follows, reading stops there: a write under way,
or a writer killed mid-write.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

from ..store.target import Target

MAGIC = b"\xa7\x1f"
_HEAD = struct.Struct("<2sBBII")
HEAD_SIZE = _HEAD.size  # 12
# A body longer than this is not a frame walbuf writes: a record holds at most
# a history line of 10 MiB and 32 MiB of images.
MAX_BODY = 64 * 2**20
_READ_CHUNK = 1 << 20

# The kinds of frame, one byte each.
PROCESS = ord("P")  # first frame: the process that appends (walbuf.directory.host.Process), as JSON
WRITER = ord("W")  # a writer opened (or continues) in this shard: its local id, run, name, axis, ... as JSON
RECORD = ord("R")  # a record: writer id, step, time (struct), then the metrics JSON
CONFIG = ord("C")  # a writer's config or summary entries, as JSON
CLOSED = ord("X")  # a writer closed, with its exit code, as JSON
ALIVE = ord("A")  # the process is alive at this time (a heartbeat while it logs nothing): a double
END = ord("E")  # the process appends nothing more: the shard is whole, as JSON
KINDS = frozenset({PROCESS, WRITER, RECORD, CONFIG, CLOSED, ALIVE, END})

_RECORD_HEAD = struct.Struct("<Iqd")  # writer's local id, step, time
_ALIVE = struct.Struct("<d")


@dataclass(frozen=True)
class WriterEntry:
    """A writer as its frame names it: what a shard's reader needs to know of the writer of a record."""

    run: str
    name: str
    step_axis: str
    prefix: str
    host: str
    pid: int
    target: Target

    def to_json(self, local: int, now: float) -> dict[str, object]:
        return {
            "id": local,
            "run": self.run,
            "name": self.name,
            "step_axis": self.step_axis,
            "prefix": self.prefix,
            "host": self.host,
            "pid": self.pid,
            "target": [self.target.wandb_id, self.target.project, self.target.entity],
            "time": now,
        }


def frame(kind: int, body: bytes) -> bytes:
    """One frame of ``kind`` holding ``body``."""
    if len(body) > MAX_BODY:
        raise ValueError(f"a frame holds at most {MAX_BODY} bytes, not {len(body)}")
    return _HEAD.pack(MAGIC, kind, 0, len(body), zlib.crc32(body, zlib.crc32(bytes((kind,))))) + body


def json_frame(kind: int, value: dict[str, Any]) -> bytes:
    return frame(kind, json.dumps(value, separators=(",", ":"), allow_nan=False).encode())


def record_frame(writer: int, step: int, time: float, metrics: str) -> bytes:
    return frame(RECORD, _RECORD_HEAD.pack(writer, step, time) + metrics.encode())


def alive_frame(time: float) -> bytes:
    return frame(ALIVE, _ALIVE.pack(time))


def write_whole(fd: int, data: bytes) -> None:
    """Write ``data`` whole at the file's offset (its end, for a file opened O_APPEND): a short write goes on from
    where it stopped. Raises the write's OSError, having written part of it, or none."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


@dataclass(frozen=True)
class Frame:
    """One whole frame as read: where it starts and where the next one does."""

    offset: int
    end: int
    kind: int
    body: bytes

    def json(self) -> dict[str, Any]:
        """The body of a JSON frame; ValueError if it is not a JSON object."""
        value = json.loads(self.body)
        if not isinstance(value, dict):
            raise ValueError("not a JSON object")
        return value

    def record(self) -> tuple[int, int, float, str]:
        """(writer, step, time, metrics) of a record frame; ValueError if it is not one."""
        if len(self.body) < _RECORD_HEAD.size:
            raise ValueError("a record frame shorter than its fixed part")
        writer, step, time = _RECORD_HEAD.unpack_from(self.body)
        return writer, step, time, self.body[_RECORD_HEAD.size :].decode()

    def alive(self) -> float:
        (time,) = _ALIVE.unpack(self.body)
        return float(time)


Stop = Literal["end", "cut off", "damaged"]
"""Why reading stopped: at the end of the file (or of the range read) after a
whole frame; at bytes with nothing whole after them that a frame being
written could be (the start of a frame, or zeros: a write under way, a
writer killed mid-write, or pages a reader cached before the last append);
at bytes with nothing whole after them that no frame starts with ("damaged")."""


@dataclass(frozen=True)
class Unread:
    """Bytes ``start`` to ``end`` (exclusive) that hold no whole frame, with a whole frame at ``end``."""

    start: int
    end: int


class FrameReader:
    """Reads the whole frames of a file from ``offset`` on (up to ``end``, if given); never writes.

    Iterate for the frames, and an :class:`Unread` for each run of bytes that
    holds no whole frame but is followed by one (reading goes on from that
    frame). Afterwards :attr:`offset` is where the next unread frame starts
    and :attr:`stop` says why reading ended there. With ``end``, only frames
    that end by ``end`` are read, and bytes before ``end`` that hold none are
    Unread: the range is read whole. ``fd`` stays the caller's (not closed
    here).
    """

    def __init__(self, fd: int, offset: int = 0, end: int | None = None) -> None:
        self._fd = fd
        self._end = end
        self.offset = offset
        self.stop: Stop = "end"

    def __iter__(self) -> Iterator[Frame | Unread]:
        while True:
            yield from self._run()
            if self._end is not None and self.offset >= self._end:
                return
            limit = self._end if self._end is not None else os.fstat(self._fd).st_size
            if self.offset >= limit:
                return
            if _whole_frame_at(self._fd, self.offset, limit):
                continue  # the frame there was being written, and is whole now
            found = _next_whole(self._fd, self.offset, limit)
            if found is None:
                if self._end is not None:
                    yield Unread(self.offset, self._end)
                    self.offset, self.stop = self._end, "end"
                else:
                    self.stop = self._why_unreadable()
                return
            yield Unread(self.offset, found)
            self.offset = found
            self.stop = "end"

    def _run(self) -> Iterator[Frame]:
        """The whole frames from :attr:`offset` on, up to bytes that hold none (or the end); sets :attr:`stop`."""
        buffer = b""
        start = self.offset  # the file offset of buffer[0]
        at_eof = False
        while True:
            pos = self.offset - start
            need = HEAD_SIZE
            head = buffer[pos : pos + HEAD_SIZE]
            if len(head) == HEAD_SIZE:
                magic, kind, zero, length, crc = _HEAD.unpack(head)
                if magic != MAGIC or kind not in KINDS or zero or length > MAX_BODY:
                    self.stop = "cut off"
                    return
                need = HEAD_SIZE + length
                if self._end is not None and self.offset + need > self._end:
                    self.stop = "cut off"
                    return
                if len(buffer) - pos >= need:
                    body = buffer[pos + HEAD_SIZE : pos + need]
                    if zlib.crc32(body, zlib.crc32(bytes((kind,)))) != crc:
                        self.stop = "cut off"
                        return
                    yield Frame(self.offset, self.offset + need, kind, body)
                    self.offset += need
                    continue
            if at_eof or (self._end is not None and self.offset >= self._end):
                self.stop = "end" if pos == len(buffer) else "cut off"
                return
            # Keep what is not read yet, and read on.
            buffer = buffer[pos:]
            start = self.offset
            size = max(_READ_CHUNK, need - len(buffer))
            if self._end is not None:
                size = min(size, self._end - start - len(buffer))
            more = os.pread(self._fd, size, start + len(buffer)) if size > 0 else b""
            at_eof = not more
            buffer += more

    def _why_unreadable(self) -> Stop:
        """Of the bytes from :attr:`offset` to the end, which hold no whole frame: "cut off" or "damaged" (see Stop).

        Cut off where they start as a frame does, or with a zero: a frame
        written in pages of which a later one reached the file (or this
        host's cache) before the first, as NFS write-back may.
        """
        start = os.pread(self._fd, len(MAGIC), self.offset)
        if MAGIC.startswith(start) or start[0] == 0:
            return "cut off"
        return "damaged"


def _next_whole(fd: int, offset: int, limit: int) -> int | None:
    """Where the first whole frame after ``offset`` that ends by ``limit`` starts; None if there is none."""
    position = offset + 1
    while position < limit:
        data = os.pread(fd, min(_READ_CHUNK + HEAD_SIZE, limit - position), position)
        if not data:
            return None
        found = data.find(MAGIC)
        while found >= 0:
            if _whole_frame_at(fd, position + found, limit):
                return position + found
            found = data.find(MAGIC, found + 1)
        position += _READ_CHUNK
    return None


def _whole_frame_at(fd: int, offset: int, limit: int) -> bool:
    head = os.pread(fd, HEAD_SIZE, offset)
    if len(head) < HEAD_SIZE:
        return False
    magic, kind, zero, length, crc = _HEAD.unpack(head)
    if magic != MAGIC or kind not in KINDS or zero or length > MAX_BODY or offset + HEAD_SIZE + length > limit:
        return False
    body = os.pread(fd, length, offset + HEAD_SIZE)
    return len(body) == length and zlib.crc32(body, zlib.crc32(bytes((kind,)))) == int(crc)
