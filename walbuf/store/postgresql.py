"""PostgreSQL buffers: one database (or schema), for writers on many hosts."""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import sqlalchemy as sa

from ..errors import (
    BufferBusyError,
    BufferFullError,
    BufferNotFoundError,
    BufferUnavailableError,
    ConfigError,
    StorageError,
    UntrustedPathError,
    WriterConflictError,
)
from . import machine
from .backend import INSERT_COLUMNS, Access, Appender, Backend, Durability, Lock, WriterLock
from .interrupts import run_whole

# SQLSTATE codes (PostgreSQL's appendix A) walbuf tells apart.
_PG_LOCK_NOT_AVAILABLE = "55P03"
_PG_DISK_FULL = "53100"
_PG_UNKNOWN_DATABASE = "3D000"
_IDLE = 0  # libpq's PQTRANS_IDLE: a connection in no statement and no transaction

# A server with no connection to spare refuses a new one with SQLSTATE 53300,
# but libpq hands a refusal at connection start over as text only (psycopg's
# OperationalError then has no sqlstate): these are the server's messages
# for it (PostgreSQL's postinit.c and proc.c; the server's lc_messages
# decides their language, and English is the default).
_NO_CONNECTION_TO_SPARE = (
    "too many clients already",
    "too many connections for",  # ... role "x" / database "x"
    "remaining connection slots are reserved",
)
# Seconds a connection waits for the server to have one to spare. A job's
# start queues for them: 300 writer processes on a server of 40 connections
# (2 cores) waited up to 165 s, and a writer that gives up loses its records
# while its turn would have come. A server with none to spare for 10
# minutes needs a person.
CONNECT_WAIT = 600.0
# A writer owns its id by a lease row (see _WriterLease): it lasts LEASE_SECONDS
# unless renewed, and the writer renews it every RENEW_EVERY seconds. A
# writer that logged nothing for IDLE_SECONDS lets its connection go at its
# next renewal, so open writers may outnumber the server's connections.
LEASE_SECONDS = 60.0
RENEW_EVERY = 10.0
IDLE_SECONDS = 10.0
_CONNECT_POLL_FIRST, _CONNECT_POLL_MAX = 0.05, 1.0  # seconds between attempts, doubling up to the max

_log = logging.getLogger(__name__)
_T = TypeVar("_T")


class PostgresBackend(Backend):
    """A PostgreSQL database; a buffer is its tables in the connection's current schema."""

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

    def engine(self, durability: Durability, busy_timeout: float, access: Access) -> sa.Engine:
        # "normal": a committed record survives the writer's death, as with
        # SQLite's synchronous=NORMAL; only a crash of the server's host can
        # lose the last commits. "fsync": the commit waits for the WAL flush.
        synchronous_commit = {"normal": "off", "fsync": "on"}[durability]
        lock_ms = int(busy_timeout * 1000)

        def on_connect(dbapi_connection: Any, _record: Any) -> None:
            autocommit = dbapi_connection.autocommit
            dbapi_connection.autocommit = True
            self.secure(dbapi_connection)
            dbapi_connection.execute(f"SET synchronous_commit TO {synchronous_commit}")
            dbapi_connection.execute(f"SET lock_timeout TO {lock_ms}")
            dbapi_connection.autocommit = autocommit

        def do_connect(dialect: Any, _record: Any, cargs: Any, cparams: Any) -> Any:
            return self.connect_waiting(lambda: dialect.connect(*cargs, **cparams), max(busy_timeout, CONNECT_WAIT))

        try:
            engine = sa.create_engine(self.url, poolclass=sa.pool.NullPool)
        except ModuleNotFoundError:
            raise ConfigError(
                f"buffer {self.location} is in PostgreSQL, which needs psycopg: pip install 'walbuf[postgresql]'"
            ) from None
        sa.event.listen(engine, "do_connect", do_connect)
        sa.event.listen(engine, "connect", on_connect)
        return engine

    def secure(self, conn: Any) -> None:
        """On a new psycopg connection (autocommit): refuse a schema another role may create objects in; then look up
        names in pg_catalog and that schema only (the search_path set to it).

        PostgreSQL picks an operator or function by the best match of its
        argument types over every schema of the search_path: a role that may
        create objects in one of them (PUBLIC in ``public`` before
        PostgreSQL 15) could define one that walbuf's queries would run as
        the buffer's owner. Raises UntrustedPathError naming the roles.
        """
        import psycopg
        from psycopg import sql

        try:
            schema = conn.execute("SELECT pg_catalog.current_schema()").fetchone()[0]
            if schema is None:
                return  # no schema of the search_path exists: the buffer's queries say so
            others = [row[0] for row in conn.execute(_OTHERS_CREATING).fetchall()]
            if others:
                raise UntrustedPathError(
                    f"{self.location}: schema {schema!r} lets {', '.join(sorted(set(others)))} create objects in it,"
                    " so another role could define an operator or function that walbuf's queries would run as you;"
                    f" revoke it (REVOKE CREATE ON SCHEMA {schema} FROM PUBLIC), or keep the buffer in a schema only"
                    " your role may create in (CREATE SCHEMA walbuf; then ?options=-csearch_path%3Dwalbuf in the"
                    " URL; see docs/postgresql.md)"
                )
            # Only that schema (pg_catalog, not named, is searched first): what other schemas of the path hold is
            # never picked.
            conn.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(schema)))
        except psycopg.Error as exc:
            raise self.error(exc) from exc

    def connect_waiting(self, connect: Callable[[], _T], seconds: float = CONNECT_WAIT) -> _T:
        """``connect()``; while the server has no connection to spare, again, for up to ``seconds``.

        A job of more writer processes than the server's max_connections
        then waits for others to close instead of failing: each attempt
        that is refused so is free, and the first one waited for is logged
        (a warning). Past ``seconds``, BufferUnavailableError names the limit.
        Every other failure is raised at once.
        """
        import psycopg

        deadline = time.monotonic() + seconds
        pause = _CONNECT_POLL_FIRST
        warned = False
        while True:
            try:
                return connect()
            except psycopg.OperationalError as exc:
                message = str(exc).strip()
                if exc.sqlstate is not None or not any(text in message for text in _NO_CONNECTION_TO_SPARE):
                    raise
                left = deadline - time.monotonic()
                if left <= 0:
                    raise BufferUnavailableError(
                        f"{self.location}: the server had no connection to spare for {seconds:g}s ({message});"
                        " raise its max_connections, put a pooler (PgBouncer) in front of it,"
                        " or run fewer writer processes at once"
                    ) from None
                if not warned:
                    _log.warning(
                        "%s: the server has no connection to spare (%s); waiting up to %gs for one",
                        self.location,
                        message.splitlines()[-1],
                        seconds,
                    )
                    warned = True
                time.sleep(min(pause, left))
                pause = min(pause * 2, _CONNECT_POLL_MAX)

    def session(self, seconds: float = CONNECT_WAIT) -> Any:
        """A psycopg connection of its own, in autocommit (waiting up to ``seconds`` for one to spare). Raises walbuf
        errors."""
        import psycopg

        url = self.url.set(drivername="postgresql").render_as_string(hide_password=False)
        try:
            conn = self.connect_waiting(lambda: psycopg.connect(url, autocommit=True), seconds)
        except psycopg.Error as exc:
            raise self.error(exc) from exc
        try:
            self.secure(conn)
        except BaseException:
            conn.close()
            raise
        return conn

    def exists(self) -> bool:
        return True  # connecting tells; a missing database is reported then

    def lock(self, name: str) -> Lock:
        return _AdvisoryLock(self, name)

    def lock_held(self, name: str) -> bool:
        probe = _AdvisoryLock(self, name)
        if not probe.acquire(timeout=0):
            return True
        probe.release()
        return False

    def read_options(self, conn: sa.Connection) -> sa.Connection:
        # PostgreSQL's default gives each statement its own snapshot.
        return conn.execution_options(isolation_level="REPEATABLE READ")

    def appender(self, engine: sa.Engine) -> Appender:
        return _PostgresAppender(self, engine)

    def writer_lock(self, name: str, appender: Appender | None) -> WriterLock:
        assert isinstance(appender, _PostgresAppender)
        return _WriterLease(self, name, appender)

    def writer_held(self, name: str) -> bool:
        import psycopg

        try:
            with self.session() as conn:
                row = conn.execute(_LEASE_ROW, (name,)).fetchone()
        except psycopg.Error as exc:
            raise self.error(exc) from exc
        return row is not None and not _lapsed(row)

    def serialize(self, conn: sa.Connection) -> None:
        # Write transactions read, then write what they read (a new run or
        # writer, cursors): one at a time, as in SQLite. Appends are not
        # write transactions and never wait for this lock.
        keys = _pg_lock_keys("write transaction")
        if not conn.exec_driver_sql(f"SELECT pg_catalog.pg_try_advisory_xact_lock({_lock_key_sql(keys)})").scalar():
            self.refuse_foreign_holder(conn.exec_driver_sql, keys)  # before a wait it would make last
            conn.exec_driver_sql(f"SELECT pg_catalog.pg_advisory_xact_lock({_lock_key_sql(keys)})")

    def refuse_foreign_holder(self, execute: Callable[[str], Any], keys: tuple[int, int]) -> None:
        """Where a session of another role holds this buffer's advisory lock ``keys``: UntrustedPathError naming it.

        ``execute`` runs a query on a connection secure() set up.

        Advisory locks are the database's, and any role that may connect can
        take one of any key; one of another role that holds a lock of walbuf
        does so to keep the buffer's own role out, and a wait or "retry later"
        would hide it.
        """
        row = execute(_foreign_holder_sql(keys)).fetchone()
        if row is not None:
            role, pid = row
            raise UntrustedPathError(
                f"{self.location}: a lock of walbuf's for this buffer is held by role {role!r} (server process"
                f" {pid}), not by yours: another role keeps your walbufs out; ask the database's owner to end that"
                f" session (SELECT pg_terminate_backend({pid})) and to take that role's CONNECT on this database"
                " away (see docs/postgresql.md)"
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


# The roles other than this one (and superusers) that may create objects in the
# current schema: those granted CREATE (PUBLIC too), and its owner.
_OTHERS_CREATING = """
SELECT CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE r.rolname END
FROM pg_catalog.pg_namespace n
CROSS JOIN LATERAL pg_catalog.aclexplode(COALESCE(n.nspacl, pg_catalog.acldefault('n', n.nspowner))) a
LEFT JOIN pg_catalog.pg_roles r ON r.oid = a.grantee
WHERE n.nspname OPERATOR(pg_catalog.=) pg_catalog.current_schema() AND a.privilege_type OPERATOR(pg_catalog.=) 'CREATE'
  AND (a.grantee OPERATOR(pg_catalog.=) 0 OR NOT (r.rolsuper OR pg_catalog.pg_has_role(a.grantee, 'MEMBER')))
UNION
SELECT r.rolname FROM pg_catalog.pg_namespace n JOIN pg_catalog.pg_roles r ON r.oid OPERATOR(pg_catalog.=) n.nspowner
WHERE n.nspname OPERATOR(pg_catalog.=) pg_catalog.current_schema()
  AND NOT (r.rolsuper OR pg_catalog.pg_has_role(r.oid, 'MEMBER'))
"""


_SCHEMA_KEY = "pg_catalog.hashtext(pg_catalog.textcat('walbuf:'::text, pg_catalog.current_schema()::text))"


def _lock_key_sql(keys: tuple[int, int]) -> str:
    """The two keys of an advisory lock of this buffer, in SQL: the schema tells buffers in one database apart."""
    return f"{_SCHEMA_KEY} OPERATOR(pg_catalog.#) {keys[0]}, {keys[1]}"


def _foreign_holder_sql(keys: tuple[int, int]) -> str:
    """The role and server process of a session of another role that holds the advisory lock ``keys``, if any.

    (Run on a connection whose search_path secure() pinned.) pg_locks shows
    a lock of two int4 keys as classid and objid, oids: the keys' bits.
    """
    first = f"(({_SCHEMA_KEY} # {keys[0]})::int8 & 4294967295)::oid"
    second = f"(({keys[1]})::int8 & 4294967295)::oid"
    return (
        "SELECT a.usename, a.pid FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid"
        f" WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2 AND l.classid = {first}"
        f" AND l.objid = {second} AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        " AND a.usename <> current_user LIMIT 1"
    )


def _pg_lock_keys(name: str) -> tuple[int, int]:
    """Two int4 keys for pg_advisory_lock: the buffer's schema is added in SQL."""
    digest = hashlib.sha256(name.encode()).digest()
    return int.from_bytes(digest[:4], "big", signed=True), int.from_bytes(digest[4:8], "big", signed=True)


class _AdvisoryLock:
    """A session-level advisory lock on a connection of its own.

    PostgreSQL releases it when the session ends: the holder's death closes
    its socket, and the server ends the session.
    """

    def __init__(self, backend: PostgresBackend, name: str) -> None:
        self._backend = backend
        self._keys = _pg_lock_keys(name)
        self._connection: Any = None

    def _key_sql(self) -> str:
        # Locks are per database; the schema tells buffers in one database apart.
        return _lock_key_sql(self._keys)

    def acquire(self, timeout: float) -> bool:
        import psycopg

        if self._connection is None:
            self._connection = self._backend.session()
        conn = self._connection
        try:
            if timeout <= 0:
                if conn.execute(f"SELECT pg_catalog.pg_try_advisory_lock({self._key_sql()})").fetchone()[0]:
                    return True
            else:
                try:
                    # A session-level lock taken in a transaction outlives it; SET
                    # LOCAL leaves the session's own lock_timeout as it was.
                    with conn.transaction():
                        conn.execute(f"SET LOCAL lock_timeout TO {int(timeout * 1000)}")
                        conn.execute(f"SELECT pg_catalog.pg_advisory_lock({self._key_sql()})")
                    return True
                except psycopg.errors.LockNotAvailable:
                    pass
            self._backend.refuse_foreign_holder(conn.execute, self._keys)
        except psycopg.Error as exc:
            raise self._backend.error(exc) from exc
        return False

    def release(self) -> None:
        if self._connection is None:
            return
        self._connection.close()  # ends the session, and with it the lock
        self._connection = None


_NOW = "extract(epoch FROM clock_timestamp())::float8"  # the server's clock: hosts' clocks may disagree
_LEASE_ROW = f"SELECT holder, host, boot_id, pid, started, expires_at < {_NOW} FROM writer_leases WHERE name = %s"


def _started(pid: int) -> str | None:
    """When process ``pid`` started, as the lease row keeps it (text); None if there is no such process."""
    ticks = machine.started(pid)
    return None if ticks is None else str(ticks)


def _lapsed(row: Any) -> bool:
    """Whether the lease ``row`` (_LEASE_ROW's columns) no longer holds: expired, or its holder died on this host."""
    _holder, host, boot_id, pid, started, expired = row
    if expired:
        return True
    # A holder on this host is looked at directly, so a writer killed here
    # is seen dead at once rather than when its lease runs out.
    return bool(host == socket.gethostname() and boot_id == machine.boot_id() != "" and _started(pid) != started)


def _taken_over(backend: PostgresBackend, then: str) -> WriterConflictError:
    """The error of a writer whose lease on its id ran out and was taken by another process."""
    return WriterConflictError(
        f"{backend.location}: this writer's lease on its id ran out and another process took the id over; {then}"
    )


class _WriterLease:
    """A writer's id, owned by a row of writer_leases rather than by a session.

    Ownership then survives the writer letting its connection go while idle,
    and a pooler that hands a session's transactions to different server
    connections (PgBouncer in transaction mode). The lease lasts
    LEASE_SECONDS unless renewed; the writer renews it every RENEW_EVERY
    seconds (walbuf.writer, in the expiry thread). A holder that died on the
    same host is seen dead at once (pid, its start time, the boot id); one
    on another host when its lease runs out. Every record the writer appends
    is inserted only while it still holds the lease (_PostgresAppender), so
    a writer whose lease lapsed and was taken over writes nothing more.

    Its close is noted in the database only: the server that could not take
    the note (its disk full, say) could not take records either, and there
    is no file beside the lease that every host reads.
    """

    @property
    def renew_every(self) -> float | None:
        return RENEW_EVERY

    def __init__(self, backend: PostgresBackend, name: str, appender: _PostgresAppender) -> None:
        self._backend = backend
        self._name = name
        self._appender = appender
        self._holder = uuid.uuid4().hex

    def acquire(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        pause = _CONNECT_POLL_FIRST
        while not self._take():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(pause, left))  # waiting for another process to close: polled
            pause = min(pause * 2, _CONNECT_POLL_MAX)
        self._appender.owned_by(self._name, self._holder)
        return True

    def _take(self) -> bool:
        """Take the lease if nobody holds it; whether this writer holds it now."""
        me = (self._holder, socket.gethostname(), machine.boot_id(), os.getpid(), _started(os.getpid()) or "")
        set_lease = (
            f"holder = %s, host = %s, boot_id = %s, pid = %s, started = %s, expires_at = {_NOW} + {LEASE_SECONDS}"
        )

        def take(conn: Any) -> bool:
            with conn.transaction():
                row = conn.execute(_LEASE_ROW + " FOR UPDATE", (self._name,)).fetchone()
                if row is None:
                    inserted = conn.execute(
                        "INSERT INTO writer_leases (holder, host, boot_id, pid, started, expires_at, name)"
                        f" VALUES (%s, %s, %s, %s, %s, {_NOW} + {LEASE_SECONDS}, %s) ON CONFLICT (name) DO NOTHING",
                        (*me, self._name),
                    )
                    return bool(inserted.rowcount)
                if not _lapsed(row):
                    return False
                conn.execute(f"UPDATE writer_leases SET {set_lease} WHERE name = %s", (*me, self._name))
                return True

        return bool(self._appender.run_briefly(take))

    def renew(self) -> None:
        # Called from the expiry thread while the writer may be logging:
        # nothing here waits, neither for the writer (a log() waiting for a
        # connection would hold the expiry thread, and with it the idle
        # writers that would let theirs go) nor for the server to have a
        # connection to spare. A lease that runs out meanwhile stays this
        # writer's until another process takes the id, and a lease lasts
        # several renewals.
        def renew(conn: Any) -> int:
            return int(
                conn.execute(
                    f"UPDATE writer_leases SET expires_at = {_NOW} + {LEASE_SECONDS} WHERE name = %s AND holder = %s",
                    (self._name, self._holder),
                ).rowcount
            )

        try:
            renewed = self._appender.run_beside(renew, idle=IDLE_SECONDS)
        except BufferUnavailableError as exc:
            _log.info("could not renew a writer's lease, left for the next renewal: %s", exc)
            return
        if renewed is not None and not renewed:
            raise _taken_over(self._backend, "this writer writes nothing more")

    def release(self) -> None:
        def release(conn: Any) -> None:
            conn.execute("DELETE FROM writer_leases WHERE name = %s AND holder = %s", (self._name, self._holder))

        try:
            self._appender.run_briefly(release, last=True)
        except StorageError as exc:
            # Every record is committed; the lease runs out by itself.
            _log.warning("could not give up a writer's lease (it runs out within %gs): %s", LEASE_SECONDS, exc)
        finally:
            self._appender.close()

    noted_step: int | None = None  # the writers table holds each writer's last step
    opened_before = True

    def note_open(self) -> None:
        pass

    def note_closed(self, exit_code: int, last_step: int | None) -> None:
        pass


class _PostgresAppender:
    """A writer's connection, opened when needed and let go while idle (see _WriterLease)."""

    def __init__(self, backend: PostgresBackend, engine: sa.Engine) -> None:
        self._backend = backend
        self._engine = engine
        self._proxy: Any = None  # the pooled connection's proxy, while open
        self._connection: Any = None
        self._last_append = time.monotonic()
        self._sql = f"INSERT INTO records {INSERT_COLUMNS} VALUES (%s, %s, %s, %s)"
        self._lease: tuple[str, str] | None = None
        # The writer uses the appender under its own lock; the lease's renewal
        # (run_beside) comes from the expiry thread, and takes this one only
        # if it is free.
        self._lock = threading.RLock()
        self._done = False  # the lease was given up: renewals change nothing

    def owned_by(self, lease: str, holder: str) -> None:
        """From now on, insert a record only while ``holder`` holds the writer lease ``lease``."""
        self._sql = (
            f"INSERT INTO records {INSERT_COLUMNS} SELECT %s, %s, %s, %s"
            " WHERE EXISTS (SELECT 1 FROM writer_leases WHERE name = %s AND holder = %s)"
        )
        self._lease = (lease, holder)

    @property
    def connection(self) -> Any:
        """The psycopg connection, opened (waiting for the server to have one to spare) if let go or left unusable.
        Under _lock."""
        conn = self._connection
        if conn is not None and (conn.closed or conn.pgconn.transaction_status != _IDLE):
            # Left inside a statement or a transaction (a Ctrl-C there, and
            # another in its clean-up), or its session ended (the server
            # restarted): closed, and so rolled back by the server; a new one.
            self._drop()
            conn = None
        if conn is None:
            try:
                self._proxy = self._engine.raw_connection()
            except sa.exc.DBAPIError as exc:
                raise self._backend.error(exc.orig) from exc
            conn = self._connection = self._proxy.driver_connection
            conn.autocommit = True  # one INSERT, one commit
        return conn

    def _drop(self) -> None:
        """Close the connection without a word to the server: it ends the session, and rolls back what it left open."""
        proxy, self._proxy, self._connection = self._proxy, None, None
        if proxy is not None:
            proxy.invalidate()

    def run(self, work: Callable[[Any], _T]) -> _T:
        """``work(connection)`` on the writer's connection (opened if let go), its driver errors as walbuf's."""
        import psycopg

        with self._lock:
            try:
                return work(self.connection)
            except psycopg.Error as exc:
                raise self._backend.error(exc) from exc

    def run_briefly(self, work: Callable[[Any], _T], wait: float = CONNECT_WAIT, *, last: bool = False) -> _T:
        """``work(connection)`` on the writer's connection if open, else on one of its own, closed after.

        So a writer holds one connection at a time: it opens on one and
        registers on another, and an idle one renews its lease on a
        connection it gives back at once. ``wait``: seconds to wait for the
        server to have a connection to spare. ``work`` runs whole, whatever
        interrupts the caller (see walbuf.store.interrupts).
        """

        def briefly() -> _T:
            with self._lock:
                self._done = self._done or last
                if self._connection is not None:
                    return self.run(work)
                return self._on_session(work, wait)

        return run_whole(briefly)

    def run_beside(self, work: Callable[[Any], _T], *, idle: float) -> _T | None:
        """From another thread, without waiting for anything: ``work(connection)``; None if the lease was given up.

        On the writer's connection if it is open and nobody uses it (then
        closed if nothing was appended for ``idle`` seconds), else on a
        connection of its own if the server has one to spare at once
        (BufferUnavailableError if not).
        """
        if not self._lock.acquire(blocking=False):  # the writer is using it, or waiting for one
            return None if self._done else self._on_session(work, 0)
        try:
            if self._done:
                return None
            result = self.run_briefly(work, 0)
            if time.monotonic() - self._last_append >= idle:
                self.close()
            return result
        finally:
            self._lock.release()

    def _on_session(self, work: Callable[[Any], _T], wait: float) -> _T:
        import psycopg

        try:
            with self._backend.session(wait) as conn:
                return work(conn)
        except psycopg.Error as exc:
            raise self._backend.error(exc) from exc

    def append(self, params: tuple[int, int, float, str]) -> None:
        import psycopg

        self._last_append = time.monotonic()
        with self._lock:
            conn = self.connection
            try:
                inserted = conn.execute(self._sql, params + (self._lease or ()), prepare=True).rowcount
            except psycopg.Error as exc:
                if exc.sqlstate is not None:  # the server refused the INSERT, whose transaction it rolled back
                    raise self._backend.error(exc) from exc
                self._drop()
                raise StorageError(
                    f"{self._backend.location}: the connection failed while the record was on its way ({exc});"
                    " it may have been stored or not, and its step is spent: log on (the next log() connects again)"
                ) from exc
            except BaseException:
                # An interruption while the statement was on its way: the
                # connection may be left inside it. Without its session, the
                # server commits it whole or not at all.
                self._drop()
                raise
        if self._lease is not None and not inserted:
            raise _taken_over(self._backend, "nothing was written; open the writer again once the other one closed")

    def flush(self, writer_pk: int) -> None:
        # A commit that waits for the WAL flush covers every commit before it;
        # it must write something, or PostgreSQL commits it without waiting.
        def flush(conn: Any) -> None:
            with conn.transaction():
                conn.execute("SET LOCAL synchronous_commit TO on")
                conn.execute("UPDATE writers SET pid = pid WHERE id = %s", (writer_pk,))

        run_whole(lambda: self.run(flush))

    def abandon(self) -> None:
        # Closing (or garbage-collecting) a libpq connection sends a Terminate
        # message down its socket, which the child shares with the parent:
        # the parent's session would end. Point the child's descriptor at
        # /dev/null first; the parent's own descriptor is untouched.
        if self._connection is None:
            return
        devnull = os.open(os.devnull, os.O_RDWR)
        try:
            os.dup2(devnull, self._connection.fileno())
        finally:
            os.close(devnull)

    def close(self) -> None:
        with self._lock:
            proxy, self._proxy, self._connection = self._proxy, None, None
            if proxy is not None:
                proxy.close()
