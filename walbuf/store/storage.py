"""The storage: an open buffer database and every query on it that writers, syncers and readers share.

Transactions that write take their locks at BEGIN (SQLite: BEGIN IMMEDIATE),
so a writer never fails half-way through. :mod:`walbuf.store.backend` holds
what differs between SQLite and PostgreSQL; :mod:`walbuf.store.schema` the
tables.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import sqlalchemy as sa

from ..errors import (
    BufferBusyError,
    BufferCorruptError,
    BufferFullError,
    BufferNotFoundError,
    BufferNotWritableError,
    ConfigError,
    SchemaOutdatedError,
    StorageError,
    WriterConflictError,
)
from ..record import Record, Value, read_metrics
from .backend import DURABILITY_LEVELS, Access, Appender, Backend, Durability, Lock
from .claims import Claims, Conflict, claim
from .interrupts import run_whole
from .schema import (
    HEAD_REVISION,
    buffer_revision,
    check_known,
    config_entries,
    inserted_id,
    quarantine,
    records,
    runs,
    syncs,
    upgrade,
    writers,
)
from .space import is_full, room
from .target import Target, set_target

_log = logging.getLogger(__name__)
_T = TypeVar("_T")

DEFAULT_BUSY_TIMEOUT = 60.0  # seconds; a writer waits this long for the write lock


READ_BATCH = 1000  # records per read transaction of Storage.read


def stored_metrics(text: str, writer: str, step: int, quarantined: str | None, location: str) -> dict[str, Value]:
    """A record's metrics as read back (see record.read_metrics); BufferCorruptError for what walbuf does not store.

    A quarantined record (the reason says why a sync set it aside) that
    cannot be read comes back with no metrics.
    """
    try:
        return read_metrics(text)
    except ValueError as exc:
        if quarantined is not None:
            return {}
        raise BufferCorruptError(
            f"{location}: the record of writer {writer!r} at step {step} is not what walbuf stores ({exc});"
            " the next walbuf sync quarantines it"
        ) from None


def writer_lock_name(run: str, writer: str) -> str:
    """The name of the lock an open writer holds: it owns its id (and the syncer sees it alive)."""
    return "writer-" + hashlib.sha256(f"{run}\0{writer}".encode()).hexdigest()[:24]


ConfigKind = Literal["config", "summary"]


def find_writer(
    conn: sa.Connection,
    run: str,
    writer: str,
    step_axis: str,
    prefix: str,
    host: str,
    pid: int,
    target: Target | None,
    now: float,
) -> tuple[int, bool]:
    """In a write transaction: (the id of ``writer`` of ``run``, whether it is new), made if new (open since ``now``).

    The run is made if new; ``target`` is stored for it where it holds none
    yet. Raises WriterConflictError if the writer exists with another step
    axis or prefix, TargetConflictError if the run has another target.
    """
    run_id = conn.scalar(sa.select(runs.c.id).where(runs.c.name == run))
    if run_id is None:
        run_id = inserted_id(conn.execute(runs.insert().values(name=run, created_at=now)))
    if target is not None:
        set_target(conn, run_id, run, target)
    row = conn.execute(
        sa.select(writers.c.id, writers.c.step_axis, writers.c.prefix).where(
            writers.c.run_id == run_id, writers.c.name == writer
        )
    ).first()
    if row is None:
        # A new writer has no records at or below the newest id, so its
        # cursor starts there: syncs never rescan older records for it.
        newest = conn.scalar(sa.select(sa.func.coalesce(sa.func.max(records.c.id), 0)))
        values = {"step_axis": step_axis, "prefix": prefix, "synced_id": newest, "host": host, "pid": pid}
        created = conn.execute(writers.insert().values(run_id=run_id, name=writer, opened_at=now, **values))
        return inserted_id(created), True
    if row.step_axis != step_axis:
        raise WriterConflictError(
            f"writer {writer!r} of run {run!r} logs on step axis {row.step_axis!r},"
            f" not {step_axis!r}; use that axis, or another writer id for a new axis"
        )
    if (row.prefix if row.prefix is not None else writer) != prefix:
        raise WriterConflictError(
            f"writer {writer!r} of run {run!r} logs with the prefix {row.prefix!r}, not {prefix!r},"
            " and a writer's keys keep their W&B names; use that prefix, or another writer id"
        )
    return int(row.id), False


@dataclass(frozen=True)
class Confirmed:
    """What W&B confirmed of one upload of a run, for :meth:`Storage.confirm_upload`."""

    run_id: int
    sync_id: int  # the upload's entry in syncs
    writer_ids: tuple[int, ...]  # the run's writers the upload covered
    last_handled: int  # the id of the last record sent or quarantined: the cursors' new place
    quarantined: tuple[tuple[int, str], ...]  # (record id, reason) of each record set aside
    sent: int  # records sent
    run_name: str
    target: Target  # as wandb resolved it
    config_id: int  # the newest config entry the upload sent
    finished_exit: int | None  # the exit code the upload finished the W&B run with, if it did
    mode: str  # "online" or "offline"


class Storage:
    """An open buffer: engine, schema check, and the queries writers and readers need.

    A context manager: leaving it closes the connections. Not shared across
    processes: after a fork, the child must make its own (see :meth:`abandon`).

    ``access`` (see :data:`walbuf.store.backend.Access`): with "read" nothing
    is written to the database, not even a schema upgrade. A database that
    holds other tables than a walbuf buffer's raises NotABufferError, one
    with no tables BufferNotFoundError (unless ``access`` is "create"), and
    in neither case is anything changed.
    """

    def __init__(
        self,
        backend: Backend,
        *,
        access: Access = "write",
        durability: Durability = "normal",
        busy_timeout: float = DEFAULT_BUSY_TIMEOUT,
    ) -> None:
        if durability not in DURABILITY_LEVELS:
            raise ConfigError(f"durability must be one of {', '.join(DURABILITY_LEVELS)}, not {durability!r}")
        self.backend = backend
        self.location = backend.location
        if not backend.exists():
            if access != "create":
                raise BufferNotFoundError(f"no buffer at {self.location}")
            backend.prepare()
        backend.check_files(access)
        # Set when the buffer is read as an immutable file: its state then.
        self._immutable_state: tuple[int, int, int] | None = None
        self.engine = backend.engine(durability, busy_timeout, access)
        try:
            with self.translate_errors():
                self._ensure_schema(access)
        except (BufferNotWritableError, BufferFullError):
            self.engine.dispose()
            # A reader that may not write the buffer's directory, or finds its
            # disk full: SQLite cannot make the -shm it needs. With no -wal,
            # every record is in the file: read it as immutable (see
            # begin_read for a writer that starts meanwhile).
            if access != "read" or not backend.readable_immutable():
                raise
            self._immutable_state = backend.file_state()
            self.engine = backend.immutable_engine(durability, busy_timeout, access)
            try:
                with self.translate_errors():
                    self._ensure_schema(access)
            except BaseException:
                self.engine.dispose()
                raise
        except BaseException:
            self.engine.dispose()
            raise

    def _ensure_schema(self, access: Access) -> None:
        """Check the schema, and bring it to HEAD_REVISION where ``access`` allows.

        Concurrent openers of a new buffer take turns in a write transaction;
        each one checks again in it, so only the first runs the migrations.
        When the schema is current the check is one query and Alembic is not
        imported.
        """
        with self.engine.connect() as conn:
            revision = buffer_revision(conn, self.location)
            conn.rollback()
        if revision == HEAD_REVISION:
            return
        check_known(revision, self.location)
        if revision is None and access != "create":
            raise BufferNotFoundError(f"no walbuf buffer in {self.location}: it is an empty database")
        if access == "read":
            raise SchemaOutdatedError(
                f"{self.location} has schema revision {revision}, older than this walbuf's"
                f" {HEAD_REVISION}, and reading changes nothing: write it once to upgrade it"
                " (walbuf sync, or a writer), then read it again"
            )
        # The write transaction alone makes openers take turns (SQLite's
        # write lock; PostgreSQL's advisory lock of write transactions), on
        # the one connection each: a lock of its own, on a second connection,
        # let a hundred processes opening a new PostgreSQL buffer at once
        # take every connection the server had while they waited, and starve
        # the one upgrading it.
        with self.begin_write() as conn:
            revision = buffer_revision(conn, self.location)
            if revision != HEAD_REVISION:
                check_known(revision, self.location)
                upgrade(conn)

    # -- connections ---------------------------------------------------------

    @contextmanager
    def translate_errors(self) -> Iterator[None]:
        """Turn the driver's errors into walbuf's own (see Backend.error)."""
        try:
            yield
        except sa.exc.DBAPIError as exc:
            raise self.backend.error(exc.orig) from exc

    @contextmanager
    def begin_write(self, *, fence: bool = False) -> Iterator[sa.Connection]:
        """A transaction that takes its write lock at BEGIN.

        With ``fence``, every record id up to the largest visible one is
        committed, and later records get larger ids (see walbuf.store.backend).
        """
        with self.translate_errors():
            with self.engine.connect().execution_options(walbuf_write=True) as conn:
                with conn.begin():
                    self.backend.serialize(conn)
                    if fence:
                        self.backend.fence(conn)
                    yield conn

    def write(self, work: Callable[[sa.Connection], _T]) -> _T:
        """``work(conn)`` in a write transaction (see :meth:`begin_write`) that no interruption of the caller leaves
        open: committed if work returns, else rolled back, whatever a Ctrl-C meanwhile does (see
        walbuf.store.interrupts). For a writer's transactions, which a notebook user may interrupt."""

        def whole() -> _T:
            with self.begin_write() as conn:
                return work(conn)

        return run_whole(whole)

    @contextmanager
    def begin_read(self) -> Iterator[sa.Connection]:
        """A read transaction: one consistent snapshot of the buffer."""
        with self.translate_errors():
            with self.engine.connect() as conn:
                conn = self.backend.read_options(conn)
                with conn.begin():
                    yield conn
        self._check_untorn()

    @contextmanager
    def reads(self) -> Iterator[Callable[[sa.Select[Any]], Sequence[Any]]]:
        """A function that runs a query in a snapshot of its own and returns its rows, all on one connection.

        For a long scan in parts: a snapshot per part lets the WAL checkpoint
        between parts, and one connection spares a connect per part.
        """
        with self.translate_errors():
            with self.engine.connect() as conn:
                conn = self.backend.read_options(conn)

                def read(query: sa.Select[Any]) -> Sequence[Any]:
                    with self.translate_errors():
                        with conn.begin():
                            rows = conn.execute(query).all()
                    self._check_untorn()
                    return rows

                yield read

    def _check_untorn(self) -> None:
        if self._immutable_state is not None and self.backend.file_state() != self._immutable_state:
            # An immutable read takes no lock: a writer that opened the buffer
            # meanwhile and checkpointed into the file may have torn what was read.
            raise BufferBusyError(f"{self.location} changed while it was read (a writer opened it); read it again")

    def appender(self) -> Appender:
        """A dedicated connection for one writer's hot path."""
        with self.translate_errors():
            return self.backend.appender(self.engine)

    def lock(self, name: str) -> Lock:
        """A named lock of this buffer (sync, migrate, a writer id)."""
        return self.backend.lock(name)

    def size(self) -> int:
        with self.translate_errors():
            return self.backend.size(self.engine)

    def check_integrity(self) -> None:
        """Raise BufferCorruptError if the database is damaged anywhere (not only where a read looks)."""
        with self.translate_errors():
            damage = self.backend.damage(self.engine)
        if damage is not None:
            raise BufferCorruptError(
                f"{self.location} is damaged ({damage}), so nothing is sent from it: run walbuf doctor,"
                " then copy it aside and recover it with `sqlite3 FILE .recover`"
            )

    def reclaim(self) -> None:
        with self.translate_errors():
            self.backend.reclaim(self.engine)

    def yield_to_writers(self) -> None:
        """Between two write transactions of housekeeping (see Backend.yield_to_writers)."""
        with self.translate_errors():
            self.backend.yield_to_writers(self.engine)

    def close(self) -> None:
        """Close the engine's connections (in the process that opened them)."""
        self.engine.dispose()

    def __enter__(self) -> Storage:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def abandon(self) -> None:
        """Forget the engine without closing its connections: what a forked child must do.

        Closing a connection inherited across fork can disturb the parent's
        locks, WAL or session; SQLAlchemy's pool is told to let go without
        touching them.
        """
        self.engine.dispose(close=False)

    # -- queries -------------------------------------------------------------

    def register_writer(
        self,
        run: str,
        writer: str,
        step_axis: str,
        prefix: str,
        host: str,
        pid: int,
        target: Target | None = None,
        closed_at: float | None = None,
        close_exit: int = 0,
    ) -> tuple[int, int | None]:
        """Create the run and writer if new, and note it open; return (writer row id, last step or None).

        ``target`` (W&B id, project, entity) is stored for the run where it
        holds none yet. A writer that opens (``closed_at`` None: it may log)
        makes the run running again; ``closed_at`` and ``close_exit`` copy a
        writer closed elsewhere (a directory buffer's shard, into the hub). Raises
        WriterConflictError if the writer exists with another step axis or
        prefix, TargetConflictError if the run has another target.
        """
        now = time.time()

        def register(conn: sa.Connection) -> tuple[int, int | None]:
            writer_id, new = find_writer(conn, run, writer, step_axis, prefix, host, pid, target, now)
            values = {"host": host, "pid": pid, "opened_at": now, "closed_at": closed_at, "close_exit": close_exit}
            if closed_at is None:
                conn.execute(
                    runs.update()
                    .where(runs.c.id == sa.select(writers.c.run_id).where(writers.c.id == writer_id).scalar_subquery())
                    .values(finished_exit=None)
                )
            conn.execute(writers.update().where(writers.c.id == writer_id).values(**values))
            if new:
                return writer_id, None
            row = conn.execute(sa.select(writers.c.pruned_step).where(writers.c.id == writer_id)).one()
            last_step = conn.scalar(
                sa.select(records.c.step).where(records.c.writer_id == writer_id).order_by(records.c.id.desc()).limit(1)
            )
            return writer_id, last_step if last_step is not None else row.pruned_step

        return self.write(register)

    def keep_room(self) -> None:
        """Before an upload: make sure the room its confirmation needs is kept aside (see walbuf.store.space).

        Raises BufferFullError where the disk has no room for it: then
        nothing is to be uploaded, for nothing could be confirmed.
        """
        reserve = self.backend.reserve()
        if reserve is None:
            return
        try:
            reserve.keep()
        except OSError as exc:
            if not is_full(exc):
                raise StorageError(f"{reserve.path}: {exc.strerror or exc}") from exc
            raise BufferFullError(
                f"{self.location}: its disk is full ({room(reserve.path.parent)} bytes left), and a sync uploads"
                " only what it has room to mark synced: nothing was sent or changed; free space (walbuf prune"
                " removes synced records), then sync again"
            ) from exc

    def confirm_upload(self, done: Confirmed, also: Callable[[sa.Connection], None]) -> None:
        """Record an upload W&B confirmed, in one transaction: the cursors advance, never back.

        The writers' cursors move to ``done.last_handled`` (one ahead of it
        already stays), quarantined records are noted, the run keeps its
        target, config position, mode and finish, and the upload's entry is
        marked ok; ``also(conn)`` adds what the caller keeps in the same
        transaction (the run's metrics). Nothing of it happens unless all does.

        Where the disk filled during the upload, the room :meth:`keep_room`
        kept aside is given up for it, and it is tried once more.
        """
        try:
            self._confirm(done, also)
        except BufferFullError:
            reserve = self.backend.reserve()
            if reserve is None or not reserve.give_up():
                raise
            _log.warning("%s: the disk filled during the upload; its confirmation takes the room kept", self.location)
            self._confirm(done, also)

    def _confirm(self, done: Confirmed, also: Callable[[sa.Connection], None]) -> None:
        now = time.time()
        with self.begin_write() as conn:
            conn.execute(
                writers.update()
                .where(writers.c.id.in_(done.writer_ids), writers.c.synced_id < done.last_handled)
                .values(synced_id=done.last_handled)
            )
            if done.quarantined:
                conn.execute(
                    quarantine.insert(),
                    [{"record_id": rid, "reason": reason, "time": now} for rid, reason in done.quarantined],
                )
            also(conn)
            set_target(conn, done.run_id, done.run_name, done.target)
            # An offline run numbers its rows on from where this upload ended.
            offline = {"offline_step": runs.c.offline_step + done.sent} if done.mode == "offline" else {}
            conn.execute(
                runs.update()
                .where(runs.c.id == done.run_id)
                .values(
                    config_id=done.config_id,
                    target_refused=None,
                    finished_exit=done.finished_exit,
                    mode=done.mode,
                    **offline,
                )
            )
            conn.execute(
                syncs.update()
                .where(syncs.c.id == done.sync_id)
                .values(status="ok", finished_at=now, records=done.sent, last_id=done.last_handled)
            )

    def claim_keys(self, writer_pk: int, wanted: Claims) -> Conflict | None:
        """Claim W&B keys for the writer's step axis (see walbuf.store.claims); the conflict, claiming nothing, if
        any."""
        return self.write(lambda conn: claim(conn, writer_pk, wanted))

    def mark_closed(self, writer_pk: int, exit_code: int = 0) -> None:
        """Note that the writer closed (it logs nothing more until it opens again), with ``exit_code`` (1: failed)."""
        now = time.time()
        self.write(
            lambda conn: conn.execute(
                writers.update().where(writers.c.id == writer_pk).values(closed_at=now, close_exit=exit_code)
            )
        )

    def add_config(self, writer_pk: int, encoded: dict[str, str], kind: ConfigKind = "config") -> None:
        """Store config or summary entries (key -> JSON text) of a writer, in one transaction."""
        if not encoded:
            return
        now = time.time()
        rows = [{"writer_id": writer_pk, "kind": kind, "key": k, "value": v, "time": now} for k, v in encoded.items()]
        self.write(lambda conn: conn.execute(config_entries.insert(), rows))

    def read(
        self, run: str | None = None, writer: str | None = None, *, quarantined: bool = False, up_to: int | None = None
    ) -> Iterator[Record]:
        """Every record (of one run / writer if given) with an id up to ``up_to`` (else the newest when reading
        starts), in the order they were logged.

        Read in short transactions of READ_BATCH records, none held while the
        caller looks at them: a reader that stops to look (``walbuf records |
        less``) never holds the database from a writer or a sync. Records
        committed after reading starts are not read; one pruned meanwhile is
        not either. With ``quarantined``, only the records a sync quarantined
        (each with its reason).
        """
        joined = records.join(writers).join(runs)
        joined = joined.join(quarantine, isouter=not quarantined)
        query = sa.select(
            records.c.id,
            runs.c.name,
            writers.c.name,
            records.c.step,
            records.c.time,
            records.c.metrics,
            quarantine.c.reason,
        ).select_from(joined)
        if run is not None:
            query = query.where(runs.c.name == run)
        if writer is not None:
            query = query.where(writers.c.name == writer)
        if up_to is None:
            with self.begin_read() as conn:
                up_to = conn.scalar(sa.select(sa.func.coalesce(sa.func.max(records.c.id), 0)))
        after = 0
        while True:
            with self.begin_read() as conn:
                rows = conn.execute(
                    query.where(records.c.id > after, records.c.id <= up_to).order_by(records.c.id).limit(READ_BATCH)
                ).all()
            for row in rows:
                metrics = stored_metrics(row[5], row[2], row[3], row[6], self.location)
                yield Record(row[1], row[2], row[3], row[4], metrics, row[6])
            if len(rows) < READ_BATCH:
                return
            after = rows[-1][0]
