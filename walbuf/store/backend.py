"""What walbuf needs of a database, and the two ways to open one.

A backend is one database (a SQLite file, or a PostgreSQL database or schema)
and everything about it that differs between the kinds: how connections are
configured, locks (kernel file locks beside a SQLite file, advisory locks in
PostgreSQL), the writer's hot path, the fence that makes record ids safe to
use as sync cursors, reclaiming space, and the driver's errors turned into
walbuf's. :mod:`walbuf.store.storage` holds what is the same: the queries.
Which backend a location is, :func:`walbuf.open_buffer` decides.

The one guarantee both give the syncer: after :meth:`Backend.fence` in a
transaction, every record with an id at or below the largest visible id is
committed, and every record committed later gets a larger id. SQLite has it
by construction (one writer at a time, a new row gets the largest id plus
one). PostgreSQL's sequence hands out ids before commit, so the fence takes a
SHARE lock on the records table: it waits for the inserts in flight to
commit, and those that start later draw larger ids.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal, Protocol

import sqlalchemy as sa

from ..errors import BufferBusyError, StorageError
from .space import Reserve

Durability = Literal["normal", "fsync"]
"""How far a committed record is safe: "normal" against the writer's death, "fsync" against power loss."""

DURABILITY_LEVELS: tuple[Durability, ...] = ("normal", "fsync")

Access = Literal["read", "write", "create"]
"""How a Storage opens its database.

- "read": it must exist and be a walbuf buffer at this walbuf's schema;
  nothing is written (no schema upgrade, no journal mode switch, no lock files).
- "write": it must exist and be a walbuf buffer; an older schema is upgraded.
- "create": as "write", and a missing database is made.
"""

INSERT_COLUMNS = "(writer_id, step, time, metrics)"


class Lock(Protocol):
    """A named lock of one buffer, held by this process until released or its death."""

    def acquire(self, timeout: float) -> bool:
        """Take the lock, waiting up to ``timeout`` seconds; False if it stayed taken."""

    def release(self) -> None: ...


class WriterLock(Lock, Protocol):
    """The lock that makes a writer the owner of its id; the kind may keep a note of its close beside it.

    A writer's close is noted in the database; where that fails (a full
    disk), the note kept with the lock still tells the syncer the writer
    closed rather than died (see Backend.writer_close_note).
    """

    def note_open(self) -> None:
        """Just after acquire: the writer may log. Raises OSError."""

    def note_closed(self, exit_code: int, last_step: int | None) -> None:
        """Before release: the writer closed with ``exit_code``, at ``last_step``. Raises OSError."""

    @property
    def noted_step(self) -> int | None:
        """After note_open: the last step the previous holder noted as it closed (None: none noted, or it died)."""

    @property
    def opened_before(self) -> bool:
        """After note_open: whether the id may have been opened before (False only where the kind knows it never
        was: a lock file made just now)."""

    @property
    def renew_every(self) -> float | None:
        """Seconds between the calls to renew() the owner must make while it holds the lock; None: no calls needed."""

    def renew(self) -> None:
        """Keep holding the lock a while longer; the kind may let an idle connection go here.

        Called from another thread than the writer's, while it may be
        logging; waits for nothing (a renewal that cannot be made at once is
        left for the next).

        Raises StorageError if the buffer could not be reached (the lock may
        lapse unless a later renew() succeeds), WriterConflictError if
        another process took the lock after it lapsed.
        """


# Between the short write transactions of housekeeping (prune's batches, its
# reclaim steps): SQLite's busy handler has a waiting writer retry 1, 3, 8, 18
# and 33 ms after it first found the lock taken, so a pause this long after
# each transaction lets in every writer that waited during it; without one, a
# loop of transactions takes the lock back before the writer's next retry,
# again and again (measured: a writer stalled 330 ms during one prune).
YIELD_TO_WRITERS = 0.025  # seconds


_log = logging.getLogger(__name__)


@contextmanager
def holding(lock: Lock, seconds: float, waiting: str, busy: str) -> Iterator[None]:
    """Hold ``lock`` for the block, waiting up to ``seconds`` for another process to let go of it.

    While it waits, walbuf's log says ``waiting``; if the lock stays taken,
    BufferBusyError says ``busy`` (what holds it, how to find it).
    """
    if not lock.acquire(timeout=0):
        _log.info("waiting up to %gs for %s", seconds, waiting)
        if not lock.acquire(timeout=seconds):
            raise BufferBusyError(busy)
    try:
        yield
    finally:
        lock.release()


class Appender(Protocol):
    """A writer's own connection: appends its records, each committed on return."""

    def append(self, params: tuple[int, int, float, str]) -> None: ...

    def flush(self, writer_pk: int) -> None:
        """Make every record committed so far durable against power loss."""

    def abandon(self) -> None:
        """In a forked child: make sure nothing done here reaches the parent's connection."""

    def close(self) -> None: ...


class Backend(ABC):
    """One database a buffer lives in; one subclass per kind.

    A kind must give every abstract method (Python refuses to make a kind
    that lacks one); the others are hooks whose default fits a kind with no
    files, no write lock of its own, or no immutable reading.
    """

    name: str
    url: sa.URL
    location: str  # for messages: a path, or the URL without its password
    path: Path | None = None  # the database's file, for a kind that keeps it in one (SQLite)

    @abstractmethod
    def engine(self, durability: Durability, busy_timeout: float, access: Access) -> sa.Engine:
        raise NotImplementedError

    @abstractmethod
    def exists(self) -> bool:
        """Whether there is a database to open (it may still hold no buffer)."""
        raise NotImplementedError

    def readable_immutable(self) -> bool:
        """Whether a reader that may not write the buffer can still read it whole, as an immutable file."""
        return False

    def immutable_engine(self, durability: Durability, busy_timeout: float, access: Access) -> sa.Engine:
        """An engine that reads the database as an immutable file (only where :meth:`readable_immutable`)."""
        raise NotImplementedError

    def file_state(self) -> tuple[int, int, int] | None:
        """What changes when the database's file is written (None: the kind has no such file)."""
        return None

    def prepare(self) -> None:  # noqa: B027 (a hook: by default nothing to do)
        """Before the first connection of a buffer that is to be made."""

    def reserve(self) -> Reserve | None:
        """Room kept aside on the buffer's disk for a sync's confirmation (see walbuf.store.space); None where the
        kind's disk is not this host's to manage (a server's)."""
        return None

    def check_files(self, access: Access) -> None:  # noqa: B027 (a kind with no files has nothing to check)
        """Before connecting: raise unless the files of the buffer are its owner's (see walbuf.store.trust)."""

    @abstractmethod
    def lock(self, name: str) -> Lock:
        raise NotImplementedError

    @abstractmethod
    def lock_held(self, name: str) -> bool:
        """Whether some process holds the lock ``name`` now. Changes nothing (a lock never taken is not held)."""
        raise NotImplementedError

    def writer_held(self, name: str) -> bool:
        """Whether some process holds writer lock ``name`` now. Changes nothing."""
        return self.lock_held(name)

    @abstractmethod
    def writer_lock(self, name: str, appender: Appender | None) -> WriterLock:
        """The lock that makes a writer the owner of its id, held while its appender lives (None: a directory
        buffer's writer, which appends to no database of this kind)."""
        raise NotImplementedError

    def writer_close_note(self, name: str) -> int | None:
        """The exit code the last holder of writer lock ``name`` noted beside it as it closed; None if none did. Reads
        only."""
        return None

    @abstractmethod
    def appender(self, engine: sa.Engine) -> Appender:
        raise NotImplementedError

    def serialize(self, conn: sa.Connection) -> None:  # noqa: B027 (a hook: by default nothing to do)
        """At the start of a write transaction: wait for the others to end (SQLite's BEGIN IMMEDIATE)."""

    def fence(self, conn: sa.Connection) -> None:  # noqa: B027 (a hook: by default nothing to do)
        """In a write transaction: see the module docstring."""

    def read_options(self, conn: sa.Connection) -> sa.Connection:
        """``conn`` set up for one consistent snapshot across statements."""
        return conn

    def damage(self, engine: sa.Engine) -> str | None:
        """What a quick check of the whole database finds wrong (None: nothing). Reads only."""
        return None  # PostgreSQL checks its own pages (and checksums) as it reads them

    @abstractmethod
    def reclaim(self, engine: sa.Engine) -> None:
        """Give the space of deleted records back (to the filesystem where the kind can)."""
        raise NotImplementedError

    def yield_to_writers(self, engine: sa.Engine) -> None:
        """Between two write transactions of housekeeping: let the writers waiting meanwhile in.

        Not for correctness (see YIELD_TO_WRITERS); a kind may also settle
        here what a writer would otherwise pay for in its next log().
        """
        time.sleep(YIELD_TO_WRITERS)

    @abstractmethod
    def size(self, engine: sa.Engine) -> int:
        """Bytes the buffer takes."""
        raise NotImplementedError

    @abstractmethod
    def error(self, exc: BaseException | None) -> StorageError:
        """The walbuf error for a driver's exception."""
        raise NotImplementedError
