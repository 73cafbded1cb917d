"""SQLite buffers: one file, in WAL mode for the processes of one host."""

from __future__ import annotations

import errno
import os
import sqlite3
import time
from pathlib import Path
from typing import Any, Literal
from urllib.parse import quote

import sqlalchemy as sa

from ..errors import (
    BufferBusyError,
    BufferCorruptError,
    BufferFullError,
    BufferNotWritableError,
    BufferUnavailableError,
    ConfigError,
    StorageError,
)
from .backend import INSERT_COLUMNS, YIELD_TO_WRITERS, Access, Appender, Backend, Durability, holding
from .flock import FileLock, held, read_note
from .space import RESERVE_NAME, Reserve, full, is_full, room
from .trust import Owner, fsync, make_folders

# Each commit appends the pages it changed to the WAL; a record is far smaller
# than a page, so smaller pages mean less to write per log() and a shorter
# hold of the write lock. Measured with 16 writer processes (scripts/
# bench_writer.py): 1 KiB pages and a checkpoint every 10,000 pages (10 MiB
# of WAL) gave about 1.2x the records/s of SQLite's defaults (4 KiB, 1,000).
PAGE_SIZE = 1024  # takes effect only when the database file is created
WAL_AUTOCHECKPOINT = 10_000  # pages
RECLAIM_STEP = 1000  # pages a step of prune's reclaim gives back (see SQLiteBackend.reclaim)
_AUTO_VACUUM_INCREMENTAL = 2  # PRAGMA auto_vacuum's answer
_INITIALIZE_WAIT = 60.0  # seconds a new buffer's maker waits for another one making it

Journal = str  # "wal" or "delete"

# The SQLite files of a database besides itself, which SQLite opens by name
# (following links): each is checked first (see SQLiteBackend.check_files).
COMPANIONS = ("-wal", "-shm", "-journal")


def harden(conn: sqlite3.Connection) -> None:
    """Make a connection treat the database as data, never code (every connection walbuf opens).

    trusted_schema=OFF keeps triggers and views from calling functions with
    side effects and from using virtual tables; SQLite's defensive mode
    (where Python offers it, 3.12+) refuses writes that corrupt the file on
    purpose. walbuf also refuses a database that holds any trigger or view
    (walbuf.store.schema.foreign_objects), which trusted_schema alone would
    still run.
    """
    conn.execute("PRAGMA trusted_schema=OFF")
    defensive = getattr(sqlite3, "SQLITE_DBCONFIG_DEFENSIVE", None)
    if defensive is not None:
        conn.setconfig(defensive, True)  # type: ignore[attr-defined,unused-ignore]


class SQLiteBackend(Backend):
    """A SQLite file, in WAL mode for the processes of one host.

    ``locks`` is where its lock files go (default: ``<file>.locks/`` beside
    it); the shards of a directory buffer share the directory's. ``journal``
    "delete" is for a database that processes on several hosts open in turn
    (a directory buffer's hub): WAL's index is shared memory of one host.
    ``owner`` is the account its files must belong to (a directory buffer's
    owner); by default the file's own (see walbuf.store.trust).
    """

    name = "sqlite"
    path: Path

    def __init__(
        self,
        path: Path,
        *,
        locks: Path | None = None,
        journal: Journal = "wal",
        owner: Owner | None = None,
        written_by: str | None = None,
    ) -> None:
        self.path = path
        # The host whose syncs write this database, where that is another host
        # whose locks and caches this one cannot trust: what is read here may
        # be torn by its writes, and a retry reads it whole.
        self.written_by = written_by
        self.url = sa.URL.create("sqlite", database=str(path))
        self.location = str(path)
        self.locks = locks if locks is not None else path.with_name(path.name + ".locks")
        self.journal = journal
        self.owner = owner

    def exists(self) -> bool:
        return os.path.lexists(self.path)

    def _owner(self, *, write: bool) -> Owner:
        if self.owner is None:
            return Owner.of(self.path, write=write)
        if write:
            self.owner.require_mine(self.path)
        return self.owner

    def check_files(self, access: Access) -> None:
        """Raise unless the file and its companions (-wal, -shm, -journal) are the owner's files, none a link, in a
        folder where no other account may make files.

        SQLite opens them by name, anew at each connection: a link or
        another account's file there would be read, or written, as the
        buffer. For writing, the owner must be this process's account
        (BufferNotWritableError).
        """
        owner = self._owner(write=access != "read")
        owner.shelter(self.path.parent, self.path)
        for suffix in ("", *COMPANIONS):
            owner.entry(Path(f"{self.path}{suffix}"))

    def prepare(self) -> None:
        """Make the file owner-only (and its missing folders), before SQLite opens it.

        SQLite makes its -wal, -shm and -journal with the file's mode. A
        database of a directory buffer (the hub) gets the read bits its
        owner granted (see walbuf.store.trust).
        """
        make_folders(self.path.parent)
        owner = self._owner(write=True)
        owner.shelter(self.path.parent, self.path)
        try:
            fd = owner.open(self.path, os.O_WRONLY | os.O_EXCL, create=True)
        except FileExistsError:
            return  # another process made it first: checked like any other
        except OSError as exc:
            raise self._os_error(exc) from exc
        os.close(fd)

    def engine(
        self, durability: Durability, busy_timeout: float, access: Access, *, immutable: bool = False
    ) -> sa.Engine:
        synchronous = {"normal": "NORMAL", "fsync": "FULL"}[durability]
        busy_ms = int(busy_timeout * 1000)

        def on_connect(dbapi_connection: sqlite3.Connection, _record: Any) -> None:
            # Autocommit at the driver: the "begin" event below emits BEGIN.
            dbapi_connection.isolation_level = None
            harden(dbapi_connection)
            cursor = dbapi_connection.cursor()
            try:
                cursor.execute(f"PRAGMA busy_timeout={busy_ms}")
                if access == "read" or immutable:
                    return  # a reader sets nothing that lasts in the file
                if access == "create" and _unmade(cursor):
                    self._initialize(cursor)
                cursor.execute(f"PRAGMA synchronous={synchronous}")
                cursor.execute(f"PRAGMA wal_autocheckpoint={WAL_AUTOCHECKPOINT}")
            finally:
                cursor.close()

        def on_begin(conn: sa.Connection) -> None:
            # BEGIN IMMEDIATE takes the write lock at once: a transaction that
            # writes never fails half-way with SQLITE_BUSY.
            write = conn.get_execution_options().get("walbuf_write")
            conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")

        url = self.url
        if immutable:
            url = sa.URL.create(
                "sqlite",
                database=f"file:{quote(str(self.path))}",
                query={"mode": "ro", "immutable": "1", "uri": "true"},
            )
        elif access == "read" and self.journal != "wal":
            # Read-only at SQLite's level: it never rolls back a journal it
            # finds (a transaction under way on another host, whose lock this
            # host may not see, is not "hot"), nor writes anything else. (In
            # WAL mode a read-only reader would leave a -wal and -shm behind.)
            url = sa.URL.create("sqlite", database=f"file:{quote(str(self.path))}", query={"mode": "ro", "uri": "true"})
        engine = sa.create_engine(url, connect_args={"check_same_thread": False}, poolclass=sa.pool.NullPool)
        sa.event.listen(engine, "connect", on_connect)
        sa.event.listen(engine, "begin", on_begin)
        return engine

    def _initialize(self, cursor: sqlite3.Cursor) -> None:
        """Page size and journal mode of a new file (no table yet); a buffer's file is never switched.

        Switching to WAL can fail with SQLITE_BUSY at once, without the busy
        handler, while another process switches the same new file: take
        turns. WAL stays set in the file, so later openers skip this.
        """
        if cursor.execute("PRAGMA journal_mode").fetchone()[0].lower() == self.journal:
            cursor.execute("PRAGMA auto_vacuum=INCREMENTAL")
            return  # a rollback journal is SQLite's default: nothing else to set
        lock = self.lock("migrate")
        waiting = f"{lock.path}: another process is making the buffer {self.path}"
        busy = f"{waiting}, and held the lock for {_INITIALIZE_WAIT:g}s; find it with `fuser {lock.path}`, or try again"
        with holding(lock, _INITIALIZE_WAIT, waiting, busy):
            mode = cursor.execute("PRAGMA journal_mode").fetchone()[0]
            if mode.lower() == self.journal:
                return
            cursor.execute(f"PRAGMA page_size={PAGE_SIZE}")
            # Before any table exists (later it changes nothing), and after the
            # page size: prune gives space back a step at a time (see reclaim).
            cursor.execute("PRAGMA auto_vacuum=INCREMENTAL")
            mode = cursor.execute(f"PRAGMA journal_mode={self.journal}").fetchone()[0]
        if mode.lower() != self.journal:
            raise ConfigError(
                f"{self.path}: SQLite could not switch the buffer to {self.journal} mode"
                f" (it stays in {mode!r}); put the buffer on a local filesystem"
            )

    def readable_immutable(self) -> bool:
        """Whether the file alone holds the whole buffer: no -wal (so no writer has it open), or an empty one.

        A process that may not write the buffer's directory cannot create the
        -shm file SQLite needs to read a WAL database; such a buffer it can
        still read as an immutable file.
        """
        try:
            return os.stat(f"{self.path}-wal").st_size == 0  # left by a reader that met a full disk, say
        except FileNotFoundError:
            return True

    def immutable_engine(self, durability: Durability, busy_timeout: float, access: Access) -> sa.Engine:
        return self.engine(durability, busy_timeout, access, immutable=True)

    def file_state(self) -> tuple[int, int, int]:
        """What changes when a checkpoint writes the file (see Storage.begin_read)."""
        st = self.path.stat()
        return st.st_ino, st.st_size, st.st_mtime_ns

    def full(self, detail: str) -> BufferFullError:
        return BufferFullError(
            f"{self.path}: the disk is full ({detail}, {room(self.path.parent)} bytes left); what was being written"
            " was not, and everything written before is intact: free space (walbuf prune removes synced"
            " records), then try again"
        )

    def not_writable(self, detail: str) -> BufferNotWritableError:
        return BufferNotWritableError(
            f"{self.path} is not writable by this process ({detail}): logging, sync and prune"
            f" need write access to the file, its -wal and -shm, its directory and"
            f" {self.locks}/; use a buffer of your own, or ask its owner for write access"
        )

    def lock(self, name: str) -> FileLock:
        """The lock ``name`` of this buffer, in its lock folder (made owner-only if missing)."""
        return _FileLock(self, *self._lock_file(name))

    def _lock_file(self, name: str) -> tuple[Path, Owner]:
        owner = self._owner(write=True)
        try:
            owner.folder(self.locks, make=True, private=True)
        except OSError as exc:
            raise self._os_error(exc) from exc
        return self._lock_path(name), owner

    def _lock_path(self, name: str) -> Path:
        """Where lock ``name`` is: a file of its own in the locks folder."""
        return self.locks / f"{name}.lock"

    def reserve(self) -> Reserve:
        """In the locks folder: the folder of the buffer's own that is on its disk."""
        owner = self._lock_file(RESERVE_NAME)[1]  # makes the folder, as for a lock
        return Reserve(self.locks / RESERVE_NAME, owner)

    def lock_held(self, name: str) -> bool:
        owner = self._owner(write=False)
        if not owner.folder(self.locks):
            return False
        return held(self._lock_path(name), owner)

    def writer_lock(self, name: str, appender: Appender | None = None) -> _WriterFileLock:
        return _WriterFileLock(self, *self._lock_file(name))

    def writer_close_note(self, name: str) -> int | None:
        owner = self._owner(write=False)
        if not owner.folder(self.locks):
            return None
        return _close_note(read_note(self._lock_path(name), owner))

    def _os_error(self, exc: OSError) -> Exception:
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            return self.not_writable(f"{exc.filename}: {exc.strerror}")
        if is_full(exc):
            return self.full(f"{exc.filename}: {exc.strerror}")
        return exc

    def appender(self, engine: sa.Engine) -> Appender:
        return _SQLiteAppender(self, engine)

    def damage(self, engine: sa.Engine) -> str | None:
        # quick_check reads every page (86 MB, a million records: a quarter
        # of a second here) and finds what a read of some records would not.
        with engine.connect() as conn:
            found = [row[0] for row in conn.exec_driver_sql("PRAGMA quick_check").fetchall()]
        return None if found == ["ok"] else "; ".join(found[:3])

    def reclaim(self, engine: sa.Engine) -> None:
        # A step at a time, each its own short write transaction, so a writer
        # never waits for more than one: incremental_vacuum moves pages from
        # the end of the file into free ones and cuts the end off. A buffer
        # made before walbuf set auto_vacuum=INCREMENTAL is switched by one
        # whole VACUUM, which writers wait for, once.
        raw = engine.raw_connection()
        try:
            driver = raw.driver_connection
            assert isinstance(driver, sqlite3.Connection)
            if driver.execute("PRAGMA auto_vacuum").fetchone()[0] != _AUTO_VACUUM_INCREMENTAL:
                driver.execute("PRAGMA auto_vacuum=INCREMENTAL")
                driver.execute("VACUUM")
            free = driver.execute("PRAGMA freelist_count").fetchone()[0]
            for _ in range(0, free, RECLAIM_STEP):
                # executescript steps the statement to its end; execute() would
                # step it once, and each step frees one page.
                driver.executescript(f"PRAGMA incremental_vacuum({RECLAIM_STEP})")
                _checkpoint_and_yield(driver)
            # The WAL back to nothing: first what can be copied while writers go
            # on, then the rest, a short stop at the end.
            driver.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
            driver.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
        except sqlite3.Error as exc:
            raise self.error(exc) from exc
        finally:
            raw.close()

    def yield_to_writers(self, engine: sa.Engine) -> None:
        raw = engine.raw_connection()
        try:
            driver = raw.driver_connection
            assert isinstance(driver, sqlite3.Connection)
            _checkpoint_and_yield(driver)
        except sqlite3.Error as exc:
            raise self.error(exc) from exc
        finally:
            raw.close()

    def size(self, engine: sa.Engine) -> int:
        files = (self.path, Path(f"{self.path}-wal"))
        return sum(p.stat().st_size for p in files if p.exists())

    def error(self, exc: BaseException | None) -> StorageError:
        path, message, kind = self.path, str(exc), failure(exc)
        if self.written_by is not None and kind in ("busy", "corrupt", "read-only"):
            return BufferUnavailableError(
                f"{path} could not be read whole here ({message}): host {self.written_by}'s syncs write it, and"
                " this filesystem's locks and caches do not span hosts, so a read here may meet a write under"
                f" way there; retry, or run this on {self.written_by}"
            )
        if kind == "busy":
            return BufferBusyError(
                f"{path}: the database stayed locked past the busy timeout ({message});"
                " another process holds a transaction on it, reading or writing (a sync, a writer, or a reader"
                f" such as walbuf status or the sqlite3 shell): find it with `fuser {path}`, then retry"
            )
        if kind == "read-only":
            if getattr(exc, "sqlite_errorcode", None) == _SQLITE_READONLY_ROLLBACK:
                return BufferUnavailableError(
                    f"{path} holds the journal of a transaction under way or cut off (a sync, maybe on another"
                    " host); reading changes nothing, so it was not rolled back: retry once that sync has"
                    " ended (the next walbuf sync completes it or rolls it back)"
                )
            if getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_READONLY_DIRECTORY:
                return self.not_writable(
                    f"{message}: SQLite cannot create {path.name}-shm in {path.parent},"
                    " which it needs to open a WAL database"
                )
            return self.not_writable(message)
        if kind == "cannot open" and self.path.exists() and not os.access(self.path.parent, os.W_OK):
            # a -wal without its -shm, say
            return self.not_writable(f"{message}: SQLite cannot create its files in {path.parent}")
        if kind == "full" or (kind == "i/o" and full(path.parent)):
            # SQLite words some failures for lack of room as a bare I/O error
            # (a -shm it cannot size, a short write): the filesystem says.
            return self.full(message)
        if kind == "corrupt":
            return BufferCorruptError(f"{path} is not a readable walbuf buffer ({message})")
        return StorageError(f"{path}: {message}")


_SQLITE_READONLY_ROLLBACK = 776  # SQLITE_READONLY | (3 << 8): a hot journal a read-only connection may not roll back

SQLiteFailure = Literal["busy", "read-only", "cannot open", "full", "i/o", "corrupt", "too big", "interrupted", "other"]

# SQLite's primary result codes (the low byte of an extended one), by what they mean to walbuf.
_FAILURES: dict[int, SQLiteFailure] = {
    sqlite3.SQLITE_BUSY: "busy",
    sqlite3.SQLITE_LOCKED: "busy",
    sqlite3.SQLITE_READONLY: "read-only",
    sqlite3.SQLITE_CANTOPEN: "cannot open",
    sqlite3.SQLITE_FULL: "full",
    sqlite3.SQLITE_IOERR: "i/o",
    sqlite3.SQLITE_CORRUPT: "corrupt",
    sqlite3.SQLITE_NOTADB: "corrupt",
    sqlite3.SQLITE_TOOBIG: "too big",
    sqlite3.SQLITE_INTERRUPT: "interrupted",
}


def _unmade(cursor: sqlite3.Cursor) -> bool:
    """Whether the file holds no table yet: new, or made by a process killed before it set its journal mode and
    made the schema (its first pages may be written, and a journal of them left, which this read rolls back)."""
    return bool(cursor.execute("SELECT count(*) FROM sqlite_master").fetchone()[0] == 0)


def failure(exc: BaseException | None) -> SQLiteFailure:
    """What an sqlite3 error means, by SQLite's result code: the one place walbuf sorts SQLite's errors.

    Never by the message's text, which SQLite words differently across
    versions. An error without a code (one the sqlite3 module raises
    itself, a closed connection say) is "other".
    """
    code = getattr(exc, "sqlite_errorcode", None)
    return "other" if code is None else _FAILURES.get(code & 0xFF, "other")


def _checkpoint_and_yield(driver: sqlite3.Connection) -> None:
    """After a write transaction of housekeeping: copy the WAL into the database, then pause.

    The connection whose commit makes the WAL longer than WAL_AUTOCHECKPOINT
    pages copies it back, fsync included, before its commit returns; left to
    the autocheckpoint, a writer's log() paid for what prune had written
    (measured: one log() of 234 ms while 3,000,000 records were pruned). A
    passive checkpoint here takes no lock a writer waits for, and keeps the
    WAL short, so the work stays with the housekeeper. Then the pause of
    YIELD_TO_WRITERS.
    """
    driver.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
    time.sleep(YIELD_TO_WRITERS)


class _FileLock(FileLock):
    """A lock of the buffer whose failures to open are walbuf's errors (no permission: BufferNotWritableError)."""

    def __init__(self, backend: SQLiteBackend, path: Path, owner: Owner) -> None:
        super().__init__(path, owner)
        self._backend = backend

    def acquire(self, timeout: float) -> bool:
        try:
            return super().acquire(timeout)
        except OSError as exc:  # a lock file this process may not open for writing
            raise self._backend._os_error(exc) from exc


class _WriterFileLock(_FileLock):
    """A writer's id lock; its note says whether the writer is open or closed (see walbuf.store.flock)."""

    noted_step: int | None = None
    opened_before = True

    def note_open(self) -> None:
        # What the previous holder noted as it closed: its last step, so that
        # the writer goes on from there without reading every shard.
        self.noted_step = _closed_step(self.current_note())
        self.opened_before = os.fstat(self._fd).st_size > 0  # a lock file made just now holds nothing
        # Over a "closed" note a previous holder left: a writer of this id
        # that dies now must not be taken for one that closed.
        try:
            self.note("open")
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise BufferFullError(
                    f"{self.path}: the disk is full ({exc.strerror}); nothing was written:"
                    " free space (walbuf prune removes synced records), then open the writer again"
                ) from exc
            raise StorageError(f"{self.path}: cannot note that the writer is open ({exc.strerror})") from exc

    def note_closed(self, exit_code: int, last_step: int | None) -> None:
        self.note(f"closed {exit_code} {'-' if last_step is None else last_step}")

    renew_every: float | None = None  # the kernel releases a flock when its holder dies

    def renew(self) -> None:
        pass


def _close_note(text: str | None) -> int | None:
    """The exit code in a writer lock's note "closed N [STEP]"; None for any other note."""
    if text is None or not text.startswith("closed "):
        return None
    code = text.removeprefix("closed ").split(" ")[0]
    return int(code) if code.isdecimal() and len(code) < 4 else None


def _closed_step(text: str | None) -> int | None:
    """The last step in a writer lock's note "closed N STEP"; None for any other note (or "-": no record)."""
    if _close_note(text) is None:
        return None
    assert text is not None
    parts = text.split(" ")
    step = parts[2] if len(parts) == 3 else ""
    return int(step) if step.isdecimal() and len(step) < 20 else None


class _SQLiteAppender:
    def __init__(self, backend: SQLiteBackend, engine: sa.Engine) -> None:
        self._backend = backend
        # The proxy must stay referenced: dropping it closes the connection.
        self._proxy = engine.raw_connection()
        driver = self._proxy.driver_connection
        assert isinstance(driver, sqlite3.Connection)
        self._cursor = driver.cursor()
        self._sql = f"INSERT INTO records {INSERT_COLUMNS} VALUES (?, ?, ?, ?)"

    def append(self, params: tuple[int, int, float, str]) -> None:
        try:
            self._cursor.execute(self._sql, params)
        except sqlite3.Error as exc:
            raise self._backend.error(exc) from exc

    def flush(self, writer_pk: int) -> None:
        # In the default durability SQLite defers the fsync of its WAL to
        # checkpoints; fsync both files now.
        path = self._backend.path
        for name in (f"{path}-wal", str(path)):
            try:
                fsync(name)
            except FileNotFoundError:
                continue  # no WAL: everything is checkpointed into the database

    def abandon(self) -> None:
        # Nothing to do: the Writer keeps the inherited objects referenced and
        # never closes them (closing could drop the parent's POSIX locks).
        pass

    def close(self) -> None:
        self._cursor.close()
        self._proxy.close()
