"""The databases a buffer can live in: SQLite (a file) and PostgreSQL (a server).

Everything that differs between the two is here: how a URL is checked, how
connections are configured, locks (kernel file locks beside a SQLite file,
advisory locks in PostgreSQL), the writer's hot path, the fence that makes
record ids safe to use as sync cursors, reclaiming space, and the driver's
errors turned into walbuf's. :mod:`walbuf.storage` holds what is the same:
the tables, the schema, the queries.

The one guarantee both give the syncer: after :meth:`Backend.fence` in a
transaction, every record with an id at or below the largest visible id is
committed, and every record committed later gets a larger id. SQLite has it
by construction (one writer at a time, a new row gets the largest id plus
one). PostgreSQL's sequence hands out ids before commit, so the fence takes a
SHARE lock on the records table: it waits for the inserts in flight to
commit, and those that start later draw larger ids.
"""

from __future__ import annotations

import errno
import hashlib
import os
import sqlite3
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import quote

import sqlalchemy as sa
from filelock import FileLock, Timeout

from .errors import (
    BufferBusyError,
    BufferCorruptError,
    BufferFullError,
    BufferNotFoundError,
    BufferNotWritableError,
    BufferUnavailableError,
    ConfigError,
    StorageError,
)

DURABILITY_LEVELS = ("normal", "fsync")

# Each commit appends the pages it changed to the WAL; a record is far smaller
# than a page, so smaller pages mean less to write per log() and a shorter
# hold of the write lock. Measured with 16 writer processes (scripts/
# bench_writer.py): 1 KiB pages and a checkpoint every 10,000 pages (10 MiB
# of WAL) gave about 1.2x the records/s of SQLite's defaults (4 KiB, 1,000).
PAGE_SIZE = 1024  # takes effect only when the database file is created
WAL_AUTOCHECKPOINT = 10_000  # pages

INSERT_COLUMNS = "(writer_id, step, time, metrics)"


class Lock(Protocol):
    """A named lock of one buffer, held by this process until released or its death."""

    def acquire(self, timeout: float) -> bool:
        """Take the lock, waiting up to ``timeout`` seconds; False if it stayed taken."""

    def release(self) -> None: ...


class Appender(Protocol):
    """A writer's own connection: appends its records, each committed on return."""

    def append(self, params: tuple[int, int, float, str]) -> None: ...

    def flush(self, writer_pk: int) -> None:
        """Make every record committed so far durable against power loss."""

    def abandon(self) -> None:
        """In a forked child: make sure nothing done here reaches the parent's connection."""

    def close(self) -> None: ...


class Backend:
    """What walbuf needs of a database; one subclass per kind."""

    name: str
    url: sa.URL
    location: str  # for messages: a path, or the URL without its password

    def engine(self, durability: str, busy_timeout: float) -> sa.Engine:
        raise NotImplementedError

    def exists(self) -> bool:
        """Whether there is a database to open (a buffer may still have to be made in it)."""
        raise NotImplementedError

    def prepare(self) -> None:
        """Before the first connection of a buffer that may be new."""

    def lock(self, name: str) -> Lock:
        raise NotImplementedError

    def writer_lock(self, name: str, appender: Appender) -> Lock:
        """The lock that makes a writer the owner of its id, held while its appender lives."""
        return self.lock(name)

    def appender(self, engine: sa.Engine) -> Appender:
        raise NotImplementedError

    def serialize(self, conn: sa.Connection) -> None:
        """At the start of a write transaction: wait for the others to end (SQLite's BEGIN IMMEDIATE)."""

    def fence(self, conn: sa.Connection) -> None:
        """In a write transaction: see the module docstring."""

    def reclaim(self, engine: sa.Engine) -> None:
        """Give the space of deleted records back (to the filesystem where the kind can)."""
        raise NotImplementedError

    def size(self, engine: sa.Engine) -> int:
        """Bytes the buffer takes."""
        raise NotImplementedError

    def error(self, exc: BaseException | None) -> StorageError:
        raise NotImplementedError


def backend_for(buffer: str | os.PathLike[str] | sa.URL) -> Backend:
    """The backend of a path, sqlite:/// URL or postgresql:// URL; ConfigError otherwise."""
    if isinstance(buffer, sa.URL):
        url = buffer
    else:
        text = os.fspath(buffer)
        if not text:
            raise ConfigError("no buffer given: pass a path or set WALBUF_BUFFER")
        if "://" not in text:
            return SQLiteBackend(sa.URL.create("sqlite", database=text))
        try:
            url = sa.make_url(text)
        except sa.exc.ArgumentError as exc:
            raise ConfigError(f"buffer {text!r} is not a valid SQLAlchemy URL: {exc}") from None
    kind = url.get_backend_name()
    if kind == "sqlite":
        return SQLiteBackend(url)
    if kind == "postgresql":
        return PostgresBackend(url)
    raise ConfigError(
        f"buffer {url.render_as_string()!r}: walbuf stores buffers in SQLite or PostgreSQL;"
        " give a file path, a sqlite:/// URL or a postgresql+psycopg:// URL"
    )


# -- SQLite ---------------------------------------------------------------------


class SQLiteBackend(Backend):
    """A SQLite file, in WAL mode for the processes of one host.

    ``locks`` is where its lock files go (default: ``<file>.locks/`` beside
    it); the shards of a directory buffer share the directory's. ``journal``
    "delete" is for a database that processes on several hosts open in turn
    (a directory buffer's hub): WAL's index is shared memory of one host.
    """

    name = "sqlite"

    def __init__(self, url: sa.URL, *, locks: Path | None = None, journal: str = "wal") -> None:
        if url.database in (None, "", ":memory:") or url.query.get("mode") == "memory":
            raise ConfigError(
                f"buffer {url.render_as_string()!r} is an in-memory database, which other"
                " processes cannot see; give a file path"
            )
        self.path = Path(url.database).expanduser().absolute()
        self.url = url.set(database=str(self.path))
        self.location = str(self.path)
        self.locks = locks if locks is not None else self.path.with_name(self.path.name + ".locks")
        self.journal = journal

    def exists(self) -> bool:
        return self.path.exists()

    def prepare(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def engine(self, durability: str, busy_timeout: float, *, immutable: bool = False) -> sa.Engine:
        synchronous = {"normal": "NORMAL", "fsync": "FULL"}[durability]
        busy_ms = int(busy_timeout * 1000)

        def on_connect(dbapi_connection: sqlite3.Connection, _record: Any) -> None:
            # Autocommit at the driver: the "begin" event below emits BEGIN.
            dbapi_connection.isolation_level = None
            cursor = dbapi_connection.cursor()
            try:
                cursor.execute(f"PRAGMA busy_timeout={busy_ms}")
                if immutable:
                    return  # read-only: no journal mode to set, nothing to sync
                mode = cursor.execute("PRAGMA journal_mode").fetchone()[0]
                if mode.lower() != self.journal:
                    # Only a new buffer gets here. Switching to WAL can fail with
                    # SQLITE_BUSY at once, without the busy handler, while another
                    # process switches the same new file: take turns. WAL stays
                    # set in the file, so later openers skip this.
                    with FileLock(self.lock_path("migrate.lock"), thread_local=False):
                        cursor.execute(f"PRAGMA page_size={PAGE_SIZE}")
                        mode = cursor.execute(f"PRAGMA journal_mode={self.journal}").fetchone()[0]
                if mode.lower() != self.journal:
                    raise ConfigError(
                        f"{self.path}: SQLite could not switch the buffer to {self.journal} mode"
                        f" (it stays in {mode!r}); put the buffer on a local filesystem"
                    )
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
        engine = sa.create_engine(url, connect_args={"check_same_thread": False}, poolclass=sa.pool.NullPool)
        sa.event.listen(engine, "connect", on_connect)
        sa.event.listen(engine, "begin", on_begin)
        return engine

    def readable_immutable(self) -> bool:
        """Whether the file alone holds the whole buffer: no -wal, so no writer has it open.

        A process that may not write the buffer's directory cannot create the
        -shm file SQLite needs to read a WAL database; such a buffer it can
        still read as an immutable file.
        """
        return not Path(f"{self.path}-wal").exists()

    def file_state(self) -> tuple[int, int, int]:
        """What changes when a checkpoint writes the file (see Storage.begin_read)."""
        st = self.path.stat()
        return st.st_ino, st.st_size, st.st_mtime_ns

    def not_writable(self, detail: str) -> BufferNotWritableError:
        return BufferNotWritableError(
            f"{self.path} is not writable by this process ({detail}): logging, sync and prune"
            f" need write access to the file, its -wal and -shm, its directory and"
            f" {self.locks}/; use a buffer of your own, or ask its owner for write access"
        )

    def lock_path(self, name: str) -> Path:
        """The lock file ``name`` of this buffer (its directory is made if missing)."""
        try:
            self.locks.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise self._os_error(exc) from exc
        return self.locks / name

    def lock(self, name: str) -> Lock:
        return _FileLock(FileLock(self.lock_path(f"{name}.lock"), thread_local=False), self)

    def _os_error(self, exc: OSError) -> Exception:
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            return self.not_writable(f"{exc.filename}: {exc.strerror}")
        return exc

    def appender(self, engine: sa.Engine) -> Appender:
        return _SQLiteAppender(self, engine)

    def reclaim(self, engine: sa.Engine) -> None:
        # On the driver connection: VACUUM cannot run inside a transaction.
        raw = engine.raw_connection()
        try:
            raw.driver_connection.execute("VACUUM")  # type: ignore[union-attr]
            raw.driver_connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # type: ignore[union-attr]
        except sqlite3.Error as exc:
            raise self.error(exc) from exc
        finally:
            raw.close()

    def size(self, engine: sa.Engine) -> int:
        files = (self.path, Path(f"{self.path}-wal"))
        return sum(p.stat().st_size for p in files if p.exists())

    def error(self, exc: BaseException | None) -> StorageError:
        path, message = self.path, str(exc)
        if isinstance(exc, sqlite3.OperationalError) and "locked" in message:
            return BufferBusyError(
                f"{path}: the database stayed locked past the busy timeout ({message});"
                f" another process holds a long write transaction: find it with `fuser {path}`"
            )
        if isinstance(exc, sqlite3.OperationalError) and "readonly" in message:
            if getattr(exc, "sqlite_errorname", "") == "SQLITE_READONLY_DIRECTORY":
                return self.not_writable(
                    f"{message}: SQLite cannot create {path.name}-shm in {path.parent},"
                    " which it needs to open a WAL database"
                )
            return self.not_writable(message)
        if isinstance(exc, sqlite3.OperationalError) and "unable to open" in message and self.path.exists():
            if not os.access(self.path.parent, os.W_OK):  # a -wal without its -shm, say
                return self.not_writable(f"{message}: SQLite cannot create its files in {path.parent}")
        if isinstance(exc, sqlite3.OperationalError) and "full" in message:
            return BufferFullError(
                f"{path}: the disk is full ({message}); the record was not written and every"
                " earlier one is intact: free space (walbuf prune removes synced records), then log again"
            )
        if isinstance(exc, sqlite3.DatabaseError) and (
            "not a database" in message or "malformed" in message
        ):
            return BufferCorruptError(f"{path} is not a readable walbuf buffer ({message})")
        return StorageError(f"{path}: {message}")


class _FileLock:
    def __init__(self, lock: FileLock, backend: SQLiteBackend) -> None:
        self._lock = lock
        self._backend = backend

    def acquire(self, timeout: float) -> bool:
        try:
            self._lock.acquire(timeout=timeout)
        except Timeout:
            return False
        except OSError as exc:  # a lock file this process may not open for writing
            raise self._backend._os_error(exc) from exc
        return True

    def release(self) -> None:
        self._lock.release()


class _SQLiteAppender:
    def __init__(self, backend: SQLiteBackend, engine: sa.Engine) -> None:
        self._backend = backend
        # The proxy must stay referenced: dropping it closes the connection.
        self._proxy = engine.raw_connection()
        self._cursor = self._proxy.driver_connection.cursor()  # type: ignore[union-attr]
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
                fd = os.open(name, os.O_RDONLY)
            except FileNotFoundError:
                continue  # no WAL: everything is checkpointed into the database
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def abandon(self) -> None:
        # Nothing to do: the Writer keeps the inherited objects referenced and
        # never closes them (closing could drop the parent's POSIX locks).
        pass

    def close(self) -> None:
        self._cursor.close()
        self._proxy.close()


# -- PostgreSQL -----------------------------------------------------------------

# SQLSTATE codes (PostgreSQL's appendix A) walbuf tells apart.
_PG_LOCK_NOT_AVAILABLE = "55P03"
_PG_DISK_FULL = "53100"
_PG_UNKNOWN_DATABASE = "3D000"


class PostgresBackend(Backend):
    name = "postgresql"

    def __init__(self, url: sa.URL) -> None:
        driver = url.get_driver_name()
        if "+" not in url.drivername:
            url = url.set(drivername="postgresql+psycopg")
        elif driver != "psycopg":
            raise ConfigError(
                f"buffer {url.render_as_string()!r}: walbuf talks to PostgreSQL through psycopg 3;"
                " write the URL as postgresql+psycopg://... (pip install 'walbuf[postgresql]')"
            )
        if not url.database:
            raise ConfigError(f"buffer {url.render_as_string()!r} names no database: add /DBNAME")
        self.url = url
        self.location = url.render_as_string(hide_password=True)

    def engine(self, durability: str, busy_timeout: float) -> sa.Engine:
        # "normal": a committed record survives the writer's death, as with
        # SQLite's synchronous=NORMAL; only a crash of the server's host can
        # lose the last commits. "fsync": the commit waits for the WAL flush.
        synchronous_commit = {"normal": "off", "fsync": "on"}[durability]
        lock_ms = int(busy_timeout * 1000)

        def on_connect(dbapi_connection: Any, _record: Any) -> None:
            autocommit = dbapi_connection.autocommit
            dbapi_connection.autocommit = True
            dbapi_connection.execute(f"SET synchronous_commit TO {synchronous_commit}")
            dbapi_connection.execute(f"SET lock_timeout TO {lock_ms}")
            dbapi_connection.autocommit = autocommit

        try:
            engine = sa.create_engine(self.url, poolclass=sa.pool.NullPool)
        except ModuleNotFoundError:
            raise ConfigError(
                f"buffer {self.location} is in PostgreSQL, which needs psycopg:"
                " pip install 'walbuf[postgresql]'"
            ) from None
        sa.event.listen(engine, "connect", on_connect)
        return engine

    def exists(self) -> bool:
        return True  # connecting tells; a missing database is reported then

    def lock(self, name: str) -> Lock:
        return _AdvisoryLock(self, name)

    def appender(self, engine: sa.Engine) -> Appender:
        return _PostgresAppender(self, engine)

    def writer_lock(self, name: str, appender: Appender) -> Lock:
        # On the appender's own session: one connection per writer, not two.
        assert isinstance(appender, _PostgresAppender)
        return _AdvisoryLock(self, name, connection=appender.connection)

    def serialize(self, conn: sa.Connection) -> None:
        # Write transactions read, then write what they read (a new run or
        # writer, cursors): one at a time, as in SQLite. Appends are not
        # write transactions and never wait for this lock.
        keys = _pg_lock_keys("write transaction")
        conn.exec_driver_sql(
            f"SELECT pg_advisory_xact_lock(hashtext('walbuf:' || current_schema()) # {keys[0]}, {keys[1]})"
        )

    def fence(self, conn: sa.Connection) -> None:
        # SHARE conflicts with the ROW EXCLUSIVE lock every INSERT holds until
        # it commits, and with nothing readers take. Sequence values are
        # drawn while that lock is held, and the sequence caches none (CACHE
        # 1, the default), so later inserts draw larger ids.
        conn.exec_driver_sql("LOCK TABLE records IN SHARE MODE")

    def reclaim(self, engine: sa.Engine) -> None:
        # Plain VACUUM: the space of deleted rows is reused by new ones, and
        # writers keep logging meanwhile. (VACUUM FULL would give it back to
        # the filesystem, but locks every writer out while it rewrites.)
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.exec_driver_sql("VACUUM records")

    def size(self, engine: sa.Engine) -> int:
        with engine.connect() as conn:
            return int(
                conn.exec_driver_sql(
                    "SELECT sum(pg_total_relation_size(c.oid)) FROM pg_class c"
                    " JOIN pg_namespace n ON n.oid = c.relnamespace"
                    " WHERE n.nspname = current_schema() AND c.relkind = 'r'"
                ).scalar()
                or 0
            )

    def error(self, exc: BaseException | None) -> StorageError:
        where, message = self.location, str(exc).strip()
        state = getattr(exc, "sqlstate", None)
        if state == _PG_LOCK_NOT_AVAILABLE:
            return BufferBusyError(
                f"{where}: a lock stayed taken past the busy timeout ({message});"
                " another session holds a long transaction: look at pg_stat_activity"
            )
        if state == _PG_DISK_FULL:
            return BufferFullError(
                f"{where}: the server's disk is full ({message}); the record was not written and"
                " every earlier one is intact: free space (walbuf prune removes synced records)"
            )
        if state == _PG_UNKNOWN_DATABASE:
            return BufferNotFoundError(f"{where}: {message}; create it first (createdb)")
        if state is None and type(exc).__name__ == "OperationalError":
            return BufferUnavailableError(
                f"cannot reach the buffer's PostgreSQL server at {where} ({message});"
                " check the URL and that the server runs, then try again"
            )
        return StorageError(f"{where}: {message}")


def _pg_lock_keys(name: str) -> tuple[int, int]:
    """Two int4 keys for pg_advisory_lock: the buffer's schema is added in SQL."""
    digest = hashlib.sha256(name.encode()).digest()
    return int.from_bytes(digest[:4], "big", signed=True), int.from_bytes(digest[4:8], "big", signed=True)


class _AdvisoryLock:
    """A session-level advisory lock on a connection of its own.

    PostgreSQL releases it when the session ends: the holder's death closes
    its socket, and the server ends the session.
    """

    def __init__(self, backend: PostgresBackend, name: str, connection: Any = None) -> None:
        self._backend = backend
        self._keys = _pg_lock_keys(name)
        self._connection = connection
        self._own_connection = connection is None

    def _key_sql(self) -> str:
        # Locks are per database; the schema tells buffers in one database apart.
        return f"hashtext('walbuf:' || current_schema()) # {self._keys[0]}, {self._keys[1]}"

    def acquire(self, timeout: float) -> bool:
        import psycopg

        if self._connection is None:
            try:
                self._connection = psycopg.connect(
                    self._backend.url.set(drivername="postgresql").render_as_string(hide_password=False),
                    autocommit=True,
                )
            except psycopg.Error as exc:
                raise self._backend.error(exc) from exc
        conn = self._connection
        if timeout <= 0:
            return bool(conn.execute(f"SELECT pg_try_advisory_lock({self._key_sql()})").fetchone()[0])
        try:
            # A session-level lock taken in a transaction outlives it; SET
            # LOCAL leaves the session's own lock_timeout as it was.
            with conn.transaction():
                conn.execute(f"SET LOCAL lock_timeout TO {int(timeout * 1000)}")
                conn.execute(f"SELECT pg_advisory_lock({self._key_sql()})")
        except psycopg.errors.LockNotAvailable:
            return False
        except psycopg.Error as exc:
            raise self._backend.error(exc) from exc
        return True

    def release(self) -> None:
        if self._connection is None:
            return
        if self._own_connection:
            self._connection.close()  # ends the session, and with it the lock
            self._connection = None
        elif not self._connection.closed:
            self._connection.execute(f"SELECT pg_advisory_unlock({self._key_sql()})")


class _PostgresAppender:
    def __init__(self, backend: PostgresBackend, engine: sa.Engine) -> None:
        self._backend = backend
        self._proxy = engine.raw_connection()
        self.connection = self._proxy.driver_connection  # a psycopg.Connection
        self.connection.autocommit = True  # one INSERT, one commit
        self._sql = f"INSERT INTO records {INSERT_COLUMNS} VALUES (%s, %s, %s, %s)"

    def append(self, params: tuple[int, int, float, str]) -> None:
        import psycopg

        try:
            self.connection.execute(self._sql, params, prepare=True)
        except psycopg.Error as exc:
            raise self._backend.error(exc) from exc

    def flush(self, writer_pk: int) -> None:
        import psycopg

        # A commit that waits for the WAL flush covers every commit before it;
        # it must write something, or PostgreSQL commits it without waiting.
        try:
            with self.connection.transaction():
                self.connection.execute("SET LOCAL synchronous_commit TO on")
                self.connection.execute("UPDATE writers SET pid = pid WHERE id = %s", (writer_pk,))
        except psycopg.Error as exc:
            raise self._backend.error(exc) from exc

    def abandon(self) -> None:
        # Closing (or garbage-collecting) a libpq connection sends a Terminate
        # message down its socket, which the child shares with the parent:
        # the parent's session would end. Point the child's descriptor at
        # /dev/null first; the parent's own descriptor is untouched.
        devnull = os.open(os.devnull, os.O_RDWR)
        try:
            os.dup2(devnull, self.connection.fileno())
        finally:
            os.close(devnull)

    def close(self) -> None:
        self._proxy.close()
