"""Group commit: the writer processes of one SQLite buffer take turns, and whoever has the turn commits every
record waiting, its own and the others', in one transaction.

Why: with more writer processes than cores, SQLite's own wait for its write
lock (sleeps of 1, 2, 5, 10 ... ms between attempts) lets a writer that
runs take the lock again and again while one that sleeps waits on: one
log() in a thousand waited twice as long as the scheduler alone makes a
call wait. Here a waiting writer's record goes in with the next commit,
whoever makes it, and a waiter gives its CPU to the others (figures in
docs/performance.md).

Everything is in one file, ``group-commit-1`` in the buffer's owner-only
locks folder (its name carries the layout's version: a walbuf with another
layout uses another file, and its writers wait for these in SQLite only).
Every writer process maps it shared:

- byte 0: the turn, an open-file-description lock (OFD: it is the
  descriptor's, so two writers of one process exclude each other, and the
  kernel drops it when its holder dies); byte HELD says it is taken, so
  that waiters need not ask the kernel;
- bytes WRITTEN..WRITTEN+8: about how many pages the WAL holds, in
  1/1024ths of a page: SQLite's count at the last checkpoint, and an
  estimate of what the commits after it added (see checkpoints below);
- bytes STATES..STATES+SLOTS: each slot's state; a writer holds an OFD lock
  on its slot's byte for as long as it is open (writers beyond SLOTS
  commit their own records; a record too big for a slot its writer
  commits with the turn held);
- from SLOT_BYTES on, slot i at SLOT_BYTES * (i + 1): the record its writer
  logs (length, crc32, writer, step, time, then the record's id once a
  transaction inserted it, then the metrics' text).

A slot's state moves FREE/DONE -> WAITING only by its writer, after it
wrote the record; on from WAITING only under the turn: to TAKEN by the
turn's holder, whose transaction inserts it, then to DONE once that
committed. When the transaction fails, its records wait again, and each
writer takes the turn itself and learns its own error; except that where
the holder waited out the busy timeout for SQLite's write lock, the
records that waited before it began are marked BUSY, and their writers
raise BufferBusyError at once rather than each wait as long again (a
log() waits at most about twice the busy timeout). A holder that dies
leaves TAKEN slots, and the next holder asks the database: a TAKEN record
whose id holds exactly it was committed. So each record is committed
once, and a log() returns only after its record was.

A record whose writer died waiting (no one holds its slot) is never
committed: its log() did not return, and another process may open its
writer id again and go on from its last step. The holder looks inside its
transaction, so a writer that dies after the look had its record
committed before that reopening's write transaction could begin. A
writer's own error (an interruption, say) withdraws its record in the
same way, under the turn.

A writer that stops while it has the turn (SIGSTOP, a debugger) holds the
others up until it goes on, as it would holding SQLite's write lock,
except that they wait without the busy timeout's bound: the turn is a
kernel lock, and a wait for it bounded by a clock would leave a record
behind that a later holder could commit after its log() raised.

Neither a commit nor its checkpoint makes the others wait in SQLite's
sleeps. A writer that finds no one committing or waiting inserts its
record at once, without SQLite's busy wait: if another connection has
the write lock (a racing writer, a sync), the record waits in its slot
instead. Checkpoints: SQLite checkpoints the WAL inside the COMMIT that
takes it past its limit, and a turn's holder would make every waiter wait
for that. So the writers' connections checkpoint only by hand: each
commit adds its estimate of the pages it wrote to WRITTEN, and the writer
that finds it past the connection's limit once its log() committed and
the turn is given up runs a passive checkpoint (which takes no lock a
writer waits for), then copies what was committed meanwhile with the turn
held, and puts SQLite's count of the WAL's pages in WRITTEN (see
_checkpoint).

The file is made whole (every byte written) before any writer maps it: a
mapped page needs no room on the disk later, so a full disk never kills a
writer (a shared map of a hole would, with SIGBUS). Where the file cannot
be made or is not whole, writers commit their own records, as before.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import sqlite3
import struct
import sys
import time
import weakref
import zlib
from collections.abc import Callable
from pathlib import Path

from ..errors import StorageError
from .trust import Owner

NAME = "group-commit-1"
SLOTS = 64
SLOT_BYTES = 4096
HELD = 1  # byte: 1 while a writer has the turn
WRITTEN = 8  # 8 bytes: the WAL's pages, about, in UNITs
UNIT = 1024  # WRITTEN's unit: a 1/1024th of a page
COUNT_EVERY = 64 * UNIT  # what a writer committing alone counts before it adds it to WRITTEN
STATES = 64  # SLOTS bytes: each slot's state
SIZE = SLOT_BYTES * (SLOTS + 1)
FREE, WAITING, TAKEN, DONE, BUSY = 0, 1, 2, 3, 4
RECORD = struct.Struct("<IIqqdq")  # a slot's header: length, crc32, writer, step, time, id
_ID = struct.Struct("<q")
_COUNT = struct.Struct("<Q")
_ID_AT = RECORD.size - _ID.size
ROOM = SLOT_BYTES - RECORD.size  # bytes of metrics text a slot holds
# How long a waiter yields the CPU between looks before it sleeps in the
# kernel's wait for the turn instead: past what a commit takes, short of
# what a stuck holder (a sync's long transaction ahead of it) would burn.
SPIN_SECONDS = 0.05

_INSERT = "INSERT INTO records (writer_id, step, time, metrics) VALUES (?, ?, ?, ?)"
_COMMITTED = "SELECT writer_id, step, time, metrics FROM records WHERE id = ?"
Row = tuple[int, int, float, str]


def _all(states: bytes, state: int) -> list[int]:
    """The slots in ``state``."""
    found, slot = [], states.find(state)
    while slot >= 0:
        found.append(slot)
        slot = states.find(state, slot + 1)
    return found


def _busy(exc: BaseException | None) -> bool:
    """Whether ``exc`` is SQLite's "the write lock stayed taken past the busy timeout"."""
    code = getattr(exc, "sqlite_errorcode", None)
    return (
        isinstance(exc, sqlite3.Error)
        and code is not None
        and code & 0xFF in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)
    )


def _added(text_bytes: int, records: int) -> int:
    """About how many WAL pages (in UNITs) a commit of ``records`` adds, their metrics ``text_bytes`` long.

    Records go in at the right edge of the table's B-tree: a commit writes
    its last leaf again, and each 1 KiB page of rows (a row: its text and
    about 32 bytes) a new leaf, a change to its parent, and the database's
    first page, whose header counts the pages (over-counted for larger
    pages: the checkpoint comes early).
    """
    return UNIT + 3 * (text_bytes + 32 * records)


def _lock(fd: int, kind: int, byte: int, wait: bool) -> bool:
    """An OFD lock (F_WRLCK) or unlock (F_UNLCK) of one byte; False if another holds it and ``wait`` is not set."""
    request = struct.pack("hhqqi4x", kind, os.SEEK_SET, byte, 1, 0)
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLKW if wait else fcntl.F_OFD_SETLK, request)
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


class GroupCommit:
    """A writer's slot in the group commit of one SQLite buffer; see the module docstring.

    ``commit(row)`` returns once the row is committed, by this writer or
    another; on error (the transaction failed, an interruption) it raises,
    and the row is not written unless the error came after its commit.
    """

    def __init__(self, path: Path, fd: int, view: mmap.mmap, cursor: sqlite3.Cursor) -> None:
        self._path = path
        self._fd = fd
        self._view = view
        self._cursor = cursor
        self._slot = -1
        self._state = -1
        # The connection's own busy timeout and checkpoint limit: a turn's
        # holder waits for SQLite's write lock that long, and the group
        # checkpoints at that limit (see the module docstring).
        self._busy_ms: int = cursor.execute("PRAGMA busy_timeout").fetchone()[0]
        self._limit: int = cursor.execute("PRAGMA wal_autocheckpoint").fetchone()[0]
        self._due = False  # this writer's commit took the WAL past the limit: it checkpoints, the turn given up
        self._tuned = False  # the connection waits for no lock and checkpoints by hand: it joined
        self._unshared = 0  # what this writer's commits alone added (UNITs), not yet in WRITTEN

    @classmethod
    def join(cls, path: Path, owner: Owner, cursor: sqlite3.Cursor) -> GroupCommit | None:
        """This writer's slot in the group file ``path`` (made if missing); None where there is none to have.

        None: no OFD locks here (not Linux), no room to make the file, a
        file another process is still making, or every slot taken. Raises
        UntrustedPathError for a link or another account's file there, and
        sqlite3.Error where a record a writer that died left needs the
        database's word and cannot have it.
        """
        if not hasattr(fcntl, "F_OFD_SETLK"):
            return None
        try:
            fd = _open_whole(path, owner)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                return None
            raise
        if fd is None:
            return None
        try:
            view = mmap.mmap(fd, SIZE)
        except BaseException:
            os.close(fd)
            raise
        group = cls(path, fd, view, cursor)
        try:
            group._with_turn(group._claim)
        except BaseException:
            group.leave()
            raise
        if group._slot < 0:
            group.leave()
            return None
        _joined.add(group)
        cursor.execute("PRAGMA busy_timeout=0")
        cursor.execute("PRAGMA wal_autocheckpoint=0")
        group._tuned = True
        return group

    def _claim(self) -> None:
        """With the turn (so no holder looks at the slots meanwhile): the first slot no writer holds, emptied."""
        for slot in range(SLOTS):
            if _lock(self._fd, fcntl.F_WRLCK, STATES + slot, wait=False):
                self._slot, self._state = slot, STATES + slot
                # What a writer that died left here: its log() never returned.
                self._withdraw()
                return

    def commit(self, row: Row, metrics: bytes) -> None:
        """Commit ``row`` (``metrics``: its text, encoded, at most ROOM bytes) with the group's next transaction."""
        self._ready()
        view, state = self._view, self._state
        if view[HELD] == 0:
            if WAITING not in view[STATES : STATES + SLOTS]:
                # No one commits or waits: this record alone, as without a
                # group. HELD marks the turn taken without the kernel's lock
                # (two syscalls, a third of an uncontended log()): one that
                # comes meanwhile waits in a slot. Two that race here both go
                # to SQLite, whose write lock, with no busy wait on this
                # connection, one of them finds taken: its record waits in
                # its slot then, as does one that meets a sync's transaction.
                view[HELD] = 1
                try:
                    self._cursor.execute(_INSERT, row)
                    alone = True
                except sqlite3.OperationalError as exc:
                    if not _busy(exc):
                        raise
                    alone = False
                finally:
                    view[HELD] = 0
                if alone:
                    # Counted here, told the group every COUNT_EVERY pages:
                    # a shared count costs a twentieth of a log().
                    self._unshared += _added(len(metrics), 1)
                    if self._unshared >= COUNT_EVERY and self._wrote(0):
                        self._checkpoint()
                    return
            elif _lock(self._fd, fcntl.F_WRLCK, 0, wait=False):
                self._holding(lambda: self._commit_all(row))
                if self._due:
                    self._checkpoint()
                return
        start = SLOT_BYTES * (self._slot + 1)
        writer, step, now, _ = row
        RECORD.pack_into(view, start, len(metrics), zlib.crc32(metrics), writer, step, now, 0)
        view[start + RECORD.size : start + RECORD.size + len(metrics)] = metrics
        view[state] = WAITING  # last: the record is whole before anyone takes it
        try:
            self._wait()
        except BaseException:
            # An error (an interruption, say) reaches the caller: its record
            # must not be committed after that, if it is not yet.
            if view[state] != DONE:
                self._with_turn(self._withdraw)
            raise
        if self._due:
            self._checkpoint()

    def commit_unslotted(self, row: Row) -> None:
        """Commit ``row``, too big for a slot, with the turn held: with the records waiting, and waiting for
        SQLite's write lock as long as the connection's busy timeout says (this connection waits for none
        outside the turn)."""
        self._ready()
        self._with_turn(lambda: self._commit_all(row))
        if self._due:
            self._checkpoint()

    def _ready(self) -> None:
        """Before a commit: the slot is this process's, and holds nothing a wait cut off left there."""
        if self._fd < 0:
            raise RuntimeError(f"{self._path}: this group commit slot was left (or inherited by a forked process)")
        if self._view[self._state] not in (FREE, DONE):
            self._with_turn(self._withdraw)  # left by a wait cut off

    def _wrote(self, added: int) -> bool:
        """Count what a commit ``added`` to the WAL (UNITs), and what was not yet counted; whether the WAL is now
        past the limit.

        Outside the turn, a count may be lost to a race: the checkpoint comes a little later.
        """
        written: int = _COUNT.unpack_from(self._view, WRITTEN)[0] + added + self._unshared
        self._unshared = 0
        _COUNT.pack_into(self._view, WRITTEN, written)
        return written >= self._limit * UNIT > 0

    def _checkpoint(self) -> None:
        """Checkpoint the WAL, the turn given up; then, with the turn, what was committed meanwhile.

        A passive checkpoint takes no lock a writer waits for, and copies
        the WAL as it was when it began. The WAL starts over only at a
        write that finds all of it copied and no one reading it, so while
        writers commit during each checkpoint it would grow without end:
        the rest, small, is copied with the turn held, where no group
        commit comes between, by a RESTART checkpoint that does not wait
        (it gives up on a reader at once). The count is then SQLite's: 0
        where it left no reader on the WAL (the next commit starts it
        over), else the pages the WAL holds, past the limit, and the next
        commit tries again, as SQLite's automatic checkpoint does (a sync
        may read the WAL for long).

        A checkpoint that fails is left to the next commit, as SQLite
        leaves its own: the record it follows is committed, and a log()
        that raised would be logged again, at a step of its own.
        """
        self._due = False
        _, pages, copied = self._copy_wal("PASSIVE")
        if pages < 0:
            return  # another's checkpoint runs, or this one failed: the count stays past the limit
        if copied == pages:
            self._with_turn(self._finish_checkpoint)
        else:  # a reader holds on to what is not copied
            _COUNT.pack_into(self._view, WRITTEN, pages * UNIT)

    def _finish_checkpoint(self) -> None:
        """With the turn: copy what was committed during the checkpoint, and see that no reader is left on the
        WAL, without waiting; so that the next commit starts the WAL over."""
        self._cursor.execute("PRAGMA busy_timeout=0")
        busy, pages, copied = self._copy_wal("RESTART")
        whole = not busy and pages >= 0 and copied == pages
        _COUNT.pack_into(self._view, WRITTEN, 0 if whole else max(pages, self._limit) * UNIT)

    def _copy_wal(self, mode: str) -> tuple[int, int, int]:
        """A checkpoint: whether it was kept from its end, the WAL's pages, and how many are copied (-1, -1: none
        ran)."""
        try:
            busy, pages, copied = self._cursor.execute(f"PRAGMA wal_checkpoint({mode})").fetchone()
        except sqlite3.Error:  # the disk full, say: no harm to the WAL, which the next commit checkpoints
            return 1, -1, -1
        return busy, pages, copied

    def _wait(self) -> None:
        """Until this writer's record is DONE: yield the CPU to whoever has the turn, or take it when it is free."""
        view, state = self._view, self._state
        deadline = None
        while view[state] != DONE:
            if view[state] == BUSY:
                # A holder's transaction waited the busy timeout for the write
                # lock, after this record was waiting: it would wait as long.
                busy = sqlite3.OperationalError("database is locked (the group's commit waited for it)")
                busy.sqlite_errorcode = sqlite3.SQLITE_BUSY
                raise busy
            if view[HELD] == 0 and _lock(self._fd, fcntl.F_WRLCK, 0, wait=False):
                self._holding(lambda: self._commit_all(None))
            elif deadline is None or time.monotonic() < deadline:
                deadline = deadline or time.monotonic() + SPIN_SECONDS
                os.sched_yield()
                continue
            else:  # the holder takes long (its transaction waits for a sync's, say): sleep till it is done
                self._with_turn(lambda: self._commit_all(None))
            if view[state] == WAITING:  # after its own turn: it did not read back whole
                raise StorageError(
                    f"{self._path}: the record this writer put in its slot {self._slot} changed under it"
                    " (another process wrote the file); it was not written: log it again"
                )

    def _with_turn(self, work: Callable[[], None]) -> None:
        _lock(self._fd, fcntl.F_WRLCK, 0, wait=True)
        self._holding(work)

    def _holding(self, work: Callable[[], None]) -> None:
        self._view[HELD] = 1
        try:
            # The turn's holder waits for SQLite's write lock, as long as the
            # connection would; without the turn it never does (see commit).
            # (Before the connection joined, it waits as it would anyway.)
            if not self._tuned:
                work()
                return
            self._cursor.execute(f"PRAGMA busy_timeout={self._busy_ms}")
            try:
                work()
            finally:
                self._cursor.execute("PRAGMA busy_timeout=0")
        finally:
            self._view[HELD] = 0
            _lock(self._fd, fcntl.F_UNLCK, 0, wait=False)

    def _commit_all(self, own: Row | None) -> None:
        """With the turn: commit every record waiting, and ``own`` (this writer's, not in its slot), in one
        transaction."""
        view, cursor = self._view, self._cursor
        if own is None and view[self._state] != WAITING:
            return  # committed already, or failed: nothing for this writer to wait for
        states = view[STATES : STATES + SLOTS]
        if own is not None and WAITING not in states and TAKEN not in states:
            cursor.execute(_INSERT, own)  # no one else waits: as without a group
            self._due = self._wrote(_added(len(own[3]), 1)) or self._due
            return
        before = _all(states, WAITING)
        taken: list[int] = []
        try:
            cursor.execute("BEGIN IMMEDIATE")
            # In the transaction: a writer that dies after this look has its
            # record committed before any other process can open its writer
            # id again (that needs a write transaction), never after.
            self._settle_taken()
            rows = []
            for slot in _all(view[STATES : STATES + SLOTS], WAITING):
                row = self._read(slot)
                if slot != self._slot and not self._held(slot):
                    view[STATES + slot] = FREE  # its writer died: its log() never returned
                elif row is not None:  # else not whole yet: its writer commits it itself
                    taken.append(slot)
                    rows.append(row)
            if own is not None:
                rows.append(own)
            if rows:
                # With no AUTOINCREMENT, SQLite gives a row the largest id + 1:
                # the ids this transaction's rows get, noted in their slots for
                # a next holder that finds them TAKEN after this one died.
                first = (cursor.execute("SELECT max(id) FROM records").fetchone()[0] or 0) + 1
                for offset, slot in enumerate(taken):
                    _ID.pack_into(view, SLOT_BYTES * (slot + 1) + _ID_AT, first + offset)
                    view[STATES + slot] = TAKEN
                cursor.executemany(_INSERT, rows)
            cursor.execute("COMMIT")
            self._due = self._wrote(_added(sum(len(r[3]) for r in rows), len(rows))) or self._due
        except BaseException:
            # Committed or not, the database says (an interruption may land
            # after COMMIT returned): never guess, which could commit twice.
            if cursor.connection.in_transaction:
                cursor.execute("ROLLBACK")
            self._settle_taken()
            if _busy(sys.exc_info()[1]):
                # Whoever waited before this transaction waited as long as it
                # did: each learns so now, rather than each wait in turn.
                for slot in before:
                    if slot != self._slot and view[STATES + slot] == WAITING:
                        view[STATES + slot] = BUSY
            raise
        for slot in taken:
            view[STATES + slot] = DONE

    def _withdraw(self) -> None:
        """With the turn: this writer's record, if not committed yet, never will be."""
        self._settle_taken()
        if self._view[self._state] in (WAITING, BUSY):
            self._view[self._state] = FREE

    def _settle_taken(self) -> None:
        """With the turn: records a holder left TAKEN (it died, or its transaction failed) are DONE if they were
        committed, else WAITING again."""
        view = self._view
        for slot in _all(view[STATES : STATES + SLOTS], TAKEN):
            row = self._read(slot)
            record_id = _ID.unpack_from(view, SLOT_BYTES * (slot + 1) + _ID_AT)[0]
            found = self._cursor.execute(_COMMITTED, (record_id,)).fetchone() if record_id else None
            view[STATES + slot] = DONE if row is not None and found == row else WAITING

    def _held(self, slot: int) -> bool:
        """Whether a writer holds ``slot`` (its lock's holder is alive)."""
        request = struct.pack("hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET, STATES + slot, 1, 0)
        answer = fcntl.fcntl(self._fd, fcntl.F_OFD_GETLK, request)
        kind: int = struct.unpack("hhqqi4x", answer)[0]
        return kind != fcntl.F_UNLCK

    def _read(self, slot: int) -> Row | None:
        """The record in ``slot``; None if it does not read whole (its crc32 does not match)."""
        start = SLOT_BYTES * (slot + 1)
        length, crc, writer, step, now, _ = RECORD.unpack_from(self._view, start)
        if length > ROOM:
            return None
        text = self._view[start + RECORD.size : start + RECORD.size + length]
        if zlib.crc32(text) != crc:
            return None
        try:
            return writer, step, now, text.decode()
        except UnicodeDecodeError:
            return None

    def leave(self) -> None:
        """Give the slot up (closing the descriptor drops its locks), and give the connection its settings back."""
        _joined.discard(self)
        if self._fd >= 0:
            self._view.close()
            os.close(self._fd)
            self._fd = -1
        if self._tuned:
            self._tuned = False
            self._cursor.execute(f"PRAGMA busy_timeout={self._busy_ms}")
            self._cursor.execute(f"PRAGMA wal_autocheckpoint={self._limit}")

    def _forget(self) -> None:
        # In a forked child: its copy of the descriptor shares the parent's
        # open file description, and so its locks. Closed here, the parent
        # keeps them; kept, they would outlive a parent that dies (the turn
        # taken for good, if the fork came while it was held). The map holds
        # a descriptor of its own (mmap dups it).
        _joined.discard(self)
        self._tuned = False  # its connection is the parent's too: leave() must not touch it
        if self._fd >= 0:
            self._view.close()
            os.close(self._fd)
            self._fd = -1


_joined: weakref.WeakSet[GroupCommit] = weakref.WeakSet()


def _forget_in_child() -> None:
    for group in list(_joined):
        group._forget()


os.register_at_fork(after_in_child=_forget_in_child)


def _open_whole(path: Path, owner: Owner) -> int | None:
    """A read-write descriptor of the group file, made whole if missing; None while another process makes it."""
    try:
        fd = owner.open(path, os.O_RDWR | os.O_EXCL, create=True, private=True)
    except FileExistsError:
        fd = owner.open(path, os.O_RDWR)
        if os.fstat(fd).st_size != SIZE:
            os.close(fd)
            return None
        return fd
    try:
        written = os.pwrite(fd, bytes(SIZE), 0)
        if written != SIZE:
            raise OSError(errno.ENOSPC, "short write", str(path))
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    return fd
