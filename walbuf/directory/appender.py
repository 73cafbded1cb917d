"""This process's live shard of a directory buffer: the one file every writer of the process appends its frames to.

A process (per buffer and host name) appends to one file of its own,
``live/HOST/GEN.log`` (see walbuf.directory.frames), and nothing else ever
writes it: no lock is needed, on any filesystem, and any host may read it
while it grows. Its first frame names the process (walbuf.directory.host),
then each writer that opens there, then records, config entries and closes
as they are logged.

- Committed on return: a frame is one ``write()`` (``fsync`` too with
  ``durability="fsync"``). A write that fails is cut back off the file, so
  nothing half-written stays before the next frame; where even that fails,
  the process goes on in a new file and the old one ends at the cut-off
  frame, which readers take for its end. Only what lies past the last
  whole frame is ever cut: once a frame is whole in the file a sync on this
  host may have read it, so a failed fsync leaves it (the record is stored,
  and RecordNotDurableError says it may not survive a power loss; the next
  frame goes to a new file, and the old one is left as it is, never sealed
  by this process, so that a power loss can cost it its tail, never a frame
  between two whole ones). A write an interruption
  (Ctrl-C) cut short is settled before the next frame: kept if it is
  whole, else cut back.
- Rotation: a file older than the rotation age (WALBUF_ROTATE_SECONDS) is
  replaced by a new one at the next frame; the writers still open are noted
  in the new file first, then the old one is sealed.
- Sealing, by this process only: an END frame (the file is whole), then a
  rename into ``sealed/``. It happens at rotation and when the last writer
  of the process closes (or the decorator lets go of its hold). A process
  that dies leaves its file live and readable; a sync on its machine seals
  it (walbuf.directory.sealing), one elsewhere only reads it. A file that
  is not known whole (a failed fsync, a failed write that could not be cut
  back) is left so too, closed without END: a sync on this machine seals
  it once the process has ended.
- While writers are open and nothing else is appended, the process appends
  a heartbeat every HEARTBEAT seconds from its expiry thread, so that other
  machines can tell it still runs (walbuf.directory.host).
- After fork, a child never touches its parent's file: it opens its own.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import threading
import time
from pathlib import Path

from .. import expiry
from ..errors import (
    NOTHING_STORED_ERRORS,
    BufferFullError,
    BufferNotWritableError,
    ConfigError,
    RecordNotDurableError,
    StorageError,
)
from ..store.claims import Claims, Conflict
from ..store.trust import fsync
from . import frames
from .frames import WriterEntry
from .host import HEARTBEAT, Process, judged_running
from .layout import ENV_HOST, Layout, rotate_seconds
from .shard import ShardError, ShardGone, first_process

_log = logging.getLogger(__name__)


class ProcessShard:
    """The live shard this process appends to, for one buffer and host name; shared by the process's writers.

    Made by :func:`process_shard`. Held while a writer of the process is
    open (or the decorator keeps it): :meth:`hold` and :meth:`let_go`. Safe
    to use from several threads.
    """

    def __init__(self, layout: Layout, host: str) -> None:
        self.layout, self.host = layout, host
        self.pid = os.getpid()
        self._lock = threading.Lock()
        self._holds = 0
        self._fd = -1
        self._path: Path | None = None
        self._size = 0  # where the last whole frame ends in the file
        # The length of the frame being written: until it is known whole or
        # cut back off, the file may hold part of it past _size.
        self._pending = 0
        # The file is not known whole (a failed write could not be cut back off, or an fsync failed): the next frame
        # goes to a new file, and this process never seals this one (see _rotate).
        self._broken = False
        self._expires = 0.0
        self._last_write = 0.0
        self._beating = False  # a heartbeat is scheduled
        self._ids = itertools.count(1)
        self._writers: dict[int, WriterEntry] = {}  # local id -> the writers open here
        self._last_steps: dict[tuple[str, str], int] = {}  # (run, writer) -> its last step logged in this process
        self._claims: dict[tuple[str, str], tuple[str | None, str]] = {}  # (run, W&B key) -> (axis, writer)

    @property
    def path(self) -> Path | None:
        """The live file now (None before the first hold)."""
        return self._path

    def hold(self) -> None:
        """Keep the shard (opened now if it is not) until a matching :meth:`let_go`."""
        with self._lock:
            if self._fd < 0:
                self._open_new(first=True)
            if not self._beating:
                self._beating = True
                self._heartbeat_later()
            self._holds += 1

    def let_go(self) -> None:
        """End a hold; the last one seals the file. A seal that fails is logged: the file stays live until a sync on
        this machine finds its process ended and seals it."""
        with self._lock:
            self._holds -= 1
            if self._holds > 0 or self._fd < 0:
                return
            try:
                if self._pending:
                    self._settle()
                self._seal_current()
            except (OSError, StorageError) as exc:
                _log.warning("could not seal shard %s: %s; a sync on this machine seals it later", self._path, exc)

    def register(self, entry: WriterEntry, durable: bool) -> tuple[int, int | None]:
        """Note a writer open here; (its local id, its last step logged in this process, if any)."""
        with self._lock:
            local = next(self._ids)
            self._append(frames.json_frame(frames.WRITER, entry.to_json(local, time.time())), durable)
            self._writers[local] = entry
            return local, self._last_steps.get((entry.run, entry.name))

    def claim(self, local: int, wanted: Claims) -> Conflict | None:
        """Claim W&B keys for a writer's axis among the writers of this process (see walbuf.store.claims).

        Writers of other processes are not asked here: the sync finds what
        conflicts between them and quarantines it, as between hosts.
        """
        with self._lock:
            entry = self._writers[local]
            for key, axis in wanted.items():
                held = self._claims.get((entry.run, key))
                if held is not None and held[0] != axis:
                    return Conflict(key, held[0], held[1])
            for key, axis in wanted.items():
                self._claims.setdefault((entry.run, key), (axis, entry.name))
            return None

    def append_record(self, local: int, step: int, now: float, metrics: str, durable: bool) -> None:
        with self._lock:
            entry = self._writers[local]
            key = (entry.run, entry.name)
            before = self._last_steps.get(key)
            # Spent before the append, as the writer spends it (see walbuf.writer.Writer.log): a writer opened
            # again in this process goes on after it.
            self._last_steps[key] = step
            try:
                self._append(frames.record_frame(local, step, now, metrics), durable)
            except NOTHING_STORED_ERRORS:
                if before is None:
                    del self._last_steps[key]
                else:
                    self._last_steps[key] = before
                raise

    def add_config(self, local: int, encoded: dict[str, str], kind: str, durable: bool) -> None:
        if not encoded:
            return
        with self._lock:
            value = {"writer": local, "kind": kind, "time": time.time(), "entries": encoded}
            self._append(frames.json_frame(frames.CONFIG, value), durable)

    def close_writer(self, local: int, exit_code: int) -> None:
        """Note that the writer closed, with ``exit_code``; it is not noted in later files of the process."""
        with self._lock:
            try:
                value = {"writer": local, "exit": exit_code, "time": time.time()}
                self._append(frames.json_frame(frames.CLOSED, value), durable=False)
            finally:
                del self._writers[local]

    def flush(self) -> None:
        """Make every frame appended so far durable against power loss."""
        with self._lock:
            if self._fd >= 0:
                try:
                    os.fsync(self._fd)
                except OSError as exc:
                    raise self._not_durable(exc, "every record logged so far was") from exc

    # -- the file ---------------------------------------------------------------

    def _append(self, data: bytes, durable: bool) -> None:
        """Append a frame to the live file, a new one first if this one expired or could not be written whole."""
        if self._fd < 0:
            raise StorageError("this process's shard is not held: a writer holds it while open")
        if self._pending:
            self._settle()
        if self._broken or time.time() >= self._expires:
            self._rotate()
        self._write(data, durable)

    def _write(self, data: bytes, durable: bool) -> None:
        """Write a frame whole at the end of the file, and fsync it if ``durable``.

        Raises what the write or fsync raised, as walbuf's: a write that
        failed wrote nothing that stays (it is cut back); a failed fsync
        leaves the frame whole (RecordNotDurableError). An interruption
        leaves the frame pending: the next append settles it.
        """
        fd = self._fd
        self._pending = len(data)
        try:
            frames.write_whole(fd, data)
        except OSError as exc:
            self._cut_back()
            raise self._error(exc, "was not written (every earlier record is intact)") from exc
        self._size += len(data)
        self._pending = 0
        self._last_write = time.time()
        if durable:
            try:
                os.fsync(fd)
            except OSError as exc:
                raise self._not_durable(exc, "the record was") from exc

    def _settle(self) -> None:
        """After a write that was cut short (an interruption, or a cut back that failed): keep its frame if it is
        whole in the file, else take what it wrote off the file, so that the next frame follows a whole one."""
        try:
            end = os.fstat(self._fd).st_size
        except OSError:
            self._broken = True  # nothing here is known: go on in a new file, cutting nothing
            return
        if end == self._size + self._pending:
            self._size = end  # whole: a sync may have read it, and it stays
        elif self._size < end < self._size + self._pending:
            self._cut_back()  # part of it: never read as a record
            return
        elif end != self._size:
            self._broken = True  # not what this process wrote: go on in a new file, cutting nothing
            return
        self._pending = 0

    def _cut_back(self) -> None:
        """After a failed write: take what it wrote past the last whole frame off the file again, so that the next
        frame follows a whole one."""
        try:
            os.ftruncate(self._fd, self._size)
        except OSError:
            self._broken = True  # readers stop at the cut-off frame, which ends the file; go on in a new one
            return
        self._pending = 0

    def _not_durable(self, exc: OSError, what: str) -> RecordNotDurableError:
        """After a failed fsync: the frames stay, and the next goes to a new file (see the module docstring).

        The file is broken, not just expired: sealing it would append an END
        frame and fsync again, and Linux reports a writeback error to one
        fsync only, so that one would succeed over a page that never reached
        the disk; a power loss could then take that page from the middle of
        a shard marked whole. Left without END, the page lost can only be
        its tail.
        """
        self._broken = True
        return RecordNotDurableError(
            f"{self._path}: {what} written, and a sync sends it, but it could not be made durable against a power"
            f" loss ({exc.strerror or exc}): check the disk or the filesystem's server; walbuf goes on in a new file"
        )

    def _error(self, exc: OSError, what: str, where: Path | None = None) -> StorageError:
        """``exc`` as walbuf's error, of the file ``where`` (by default the live one)."""
        where = where or self._path
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return BufferFullError(
                f"{where}: the disk is full ({exc.strerror}); the record {what}: free space"
                " (walbuf prune removes synced records), then log again"
            )
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            return BufferNotWritableError(f"{where} is not writable here ({exc.strerror}): the record {what}")
        return StorageError(f"{where}: {exc.strerror or exc}; the record {what}")

    def _open_new(self, *, first: bool = False) -> None:
        """Start a new live file, named by its creation time, and note the process and its open writers there.

        The file server's clock minus this process's is noted with the
        process (the mtime it gave the file made now against this clock
        then): the hub orders opens and closes across hosts by it. On the
        ``first`` file of the process, another machine appending under this
        host name is refused first (ConfigError), the new file removed.
        """
        folder = self.layout.live(self.host)
        try:
            owner = self.layout.make()
            owner.folder(self.layout.root / "live", make=True, private=True)
            owner.folder(folder, make=True, private=True)
        except OSError as exc:
            # As walbuf's error, as that of the open below: a caller catches StorageError (the heartbeat, which a
            # raw OSError would end for good, leaving an idle process to be taken for dead).
            raise self._error(exc, "was not written", folder) from exc
        gen = time.time_ns()
        while True:
            path = folder / f"{gen:020d}.log"
            try:
                before = time.time()
                fd = owner.open(path, os.O_WRONLY | os.O_APPEND | os.O_EXCL, create=True)
                made = os.fstat(fd).st_mtime
                clock = made - (before + time.time()) / 2
                break
            except FileExistsError:
                gen += 1  # another process of this host started one in the same nanosecond
            except OSError as exc:
                raise self._error(exc, "was not written", path) from exc
        if first:
            try:
                _check_host_name(self.layout, self.host, made, path)
            except BaseException:
                os.close(fd)
                path.unlink()
                raise
        # Its first frames are written before the process goes on in it. Where
        # they could not be written whole it stays in the file it had, and the
        # new one goes: nothing whole is in it, so no reader took anything from
        # it, and a file without its process's frame could never be sealed.
        now = time.time()
        process = {"format": 1, "process": Process.this(self.host).to_json(), "time": now, "clock": clock}
        head = frames.json_frame(frames.PROCESS, process) + b"".join(
            frames.json_frame(frames.WRITER, entry.to_json(local, now)) for local, entry in self._writers.items()
        )
        try:
            frames.write_whole(fd, head)
        except BaseException as exc:
            if not _holds(fd, len(head)):
                os.close(fd)
                path.unlink()
                if isinstance(exc, OSError):
                    raise self._error(exc, "was not written (every earlier record is intact)", path) from exc
                raise
            self._go_on_in(fd, path, len(head), gen)  # an interruption after the head was written whole
            raise
        self._go_on_in(fd, path, len(head), gen)

    def _go_on_in(self, fd: int, path: Path, size: int, gen: int) -> None:
        self._fd, self._path, self._size, self._pending, self._broken = fd, path, size, 0, False
        self._expires = gen / 1e9 + rotate_seconds()
        self._last_write = time.time()

    def _rotate(self) -> None:
        """Go on in a new file; seal the old one, unless it could not be written whole (then it is left live, ended
        by its cut-off frame, and a sync on this machine seals it once this process has ended)."""
        fd, path, broken = self._fd, self._path, self._broken
        try:
            self._open_new()
        finally:
            if self._fd != fd:  # in the new file (an interruption may have come once it was)
                self._let_go_of(fd, path, broken)

    def _let_go_of(self, fd: int, path: Path | None, broken: bool) -> None:
        """The file the process wrote before it went on in a new one: sealed, unless it was broken."""
        if broken:
            os.close(fd)
            return
        try:
            self._seal(fd, path)
        except (OSError, StorageError) as exc:
            _log.warning("could not seal shard %s: %s; a sync on this machine seals it later", path, exc)

    def _seal_current(self) -> None:
        fd, path = self._fd, self._path
        self._fd, self._path = -1, None
        if self._broken:
            os.close(fd)
            return
        self._seal(fd, path)

    def _seal(self, fd: int, path: Path | None) -> None:
        """Note the file whole, make it durable, and move it into sealed/; closes ``fd``."""
        assert path is not None
        try:
            os.write(fd, frames.json_frame(frames.END, {"time": time.time()}))
            os.fsync(fd)
        finally:
            os.close(fd)
        owner = self.layout.own()
        owner.folder(self.layout.sealed, make=True)
        os.replace(path, self.layout.sealed / f"{self.host}.{int(path.stem)}.log")
        fsync(self.layout.sealed, folder=True)

    # -- heartbeat ----------------------------------------------------------------

    def _heartbeat_later(self) -> None:
        expiry.call_after(HEARTBEAT, self._heartbeat)

    def _heartbeat(self) -> None:
        """In the expiry thread: append a heartbeat if nothing was appended for a while; again later while held."""
        with self._lock:
            if self.pid != os.getpid() or self._fd < 0 or self._holds <= 0:
                self._beating = False  # sealed (the next hold starts it again), or the parent's (forked)
                return
            if time.time() - self._last_write >= HEARTBEAT / 2:
                try:
                    self._append(frames.alive_frame(time.time()), durable=False)
                except StorageError as exc:
                    _log.warning("could not note in shard %s that this process runs: %s", self._path, exc)
            self._heartbeat_later()


def _holds(fd: int, size: int) -> bool:
    """Whether the file of ``fd`` is ``size`` bytes long."""
    try:
        return os.fstat(fd).st_size == size
    except OSError:
        return False


def _check_host_name(layout: Layout, host: str, now: float, made: Path) -> None:
    """Raise ConfigError, before anything is written to ``made`` (this process's new shard), if another machine
    appends to shards under ``host`` now: heard of within WALBUF_DEAD_AFTER by the file server's clock (``now`` is
    the mtime it gave ``made``).

    Two machines given one host name (a copied job script, containers that
    share a hostname) would each take the other's shards for their own
    machine's; their records would stay apart (each process has a shard of
    its own), but what status and doctor say of that host would mix them.
    """
    for shard in layout.shards("live", host):
        if shard.path == made:
            continue
        try:
            other = first_process(layout, shard)
            heard = os.lstat(shard.path).st_mtime
        except (ShardGone, FileNotFoundError, ShardError):
            continue  # sealed meanwhile, or not a shard walbuf wrote: not a machine's
        if other is None or other.on_this_machine() or not judged_running(other, max(heard, 0.0), now):
            continue  # this machine's (any container of it), or ended
        raise ConfigError(
            f"host name {host!r} is in use by another machine: process {other.pid} there appended to"
            f" {shard.path} {max(0.0, now - heard):.0f}s ago; give each machine (or container) its own"
            f" {ENV_HOST}, e.g. {ENV_HOST}={host}-2 (nothing was written)"
        )


_shards: dict[tuple[Path, str], ProcessShard] = {}
_shards_lock = threading.Lock()


def process_shard(layout: Layout, host: str) -> ProcessShard:
    """This process's shard of the buffer at ``layout`` under ``host`` (a new one in a forked child)."""
    with _shards_lock:
        key = (layout.root, host)
        shard = _shards.get(key)
        if shard is None or shard.pid != os.getpid():
            shard = _shards[key] = ProcessShard(layout, host)
        return shard


def _after_fork_in_child() -> None:
    global _shards_lock
    _shards_lock = threading.Lock()  # another thread of the parent may have held it
    _shards.clear()  # the parent's files: never appended to from here


os.register_at_fork(after_in_child=_after_fork_in_child)
