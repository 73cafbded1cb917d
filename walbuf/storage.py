"""The storage: the tables of a buffer, its schema, and the queries on them.

A buffer is a SQLite database in WAL mode (a file) or a PostgreSQL database
(a server, for writers on many hosts); :mod:`walbuf.backends` holds what
differs between the two. Transactions that write take their locks at BEGIN
(SQLite: BEGIN IMMEDIATE), so a writer never fails half-way through.

The schema belongs to the Alembic migrations in migrations/ (installed as
walbuf.migrations). Opening a buffer applies them; when the schema is already
current the check is one SELECT and Alembic is not imported.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import sqlalchemy as sa

from .backends import DURABILITY_LEVELS, Appender, Backend, Lock, SQLiteBackend, backend_for
from .errors import (
    BufferBusyError,
    BufferNotFoundError,
    BufferNotWritableError,
    ConfigError,
    SchemaTooNewError,
    TargetConflictError,
    WriterConflictError,
)
from .record import Record, decode

# Every revision in migrations/versions, oldest first. The newest is the schema
# this code reads and writes; tests check this list against Alembic's own.
KNOWN_REVISIONS: tuple[str, ...] = ("0001", "0002", "0003", "0004", "0005")
HEAD_REVISION = KNOWN_REVISIONS[-1]

DEFAULT_BUSY_TIMEOUT = 60.0  # seconds; a writer waits this long for the write lock

# Record ids are sync cursors. 64-bit in PostgreSQL; in SQLite the column
# must be INTEGER to be the rowid (which is 64-bit already).
RecordId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")

metadata = sa.MetaData()

runs = sa.Table(
    "runs",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("name", sa.Text, nullable=False, unique=True),
    sa.Column("created_at", sa.Float, nullable=False),
    # The W&B run this run syncs into; set by walbuf.init or the first sync.
    sa.Column("wandb_id", sa.Text),
    sa.Column("project", sa.Text),
    sa.Column("entity", sa.Text),
    # Rows written to offline run directories so far: the next one's first _step.
    sa.Column("offline_step", sa.BigInteger, nullable=False, server_default="0"),
    # The newest config entry of the run that a sync has sent.
    sa.Column("config_id", RecordId, nullable=False, server_default="0"),
)

writers = sa.Table(
    "writers",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("run_id", sa.Integer, sa.ForeignKey("runs.id"), nullable=False),
    sa.Column("name", sa.Text, nullable=False),
    sa.Column("step_axis", sa.Text, nullable=False),
    # Who opened the writer last: for messages and status, not for locking.
    sa.Column("host", sa.Text, nullable=False),
    sa.Column("pid", sa.Integer, nullable=False),
    sa.Column("opened_at", sa.Float, nullable=False),
    # The sync cursor: every record of this writer with id <= synced_id has
    # been uploaded (W&B confirmed it). Advanced only after confirmation.
    sa.Column("synced_id", RecordId, nullable=False, server_default="0"),
    # The step of the newest record of this writer that prune deleted: the
    # writer continues after it even when none of its records remain.
    sa.Column("pruned_step", sa.BigInteger),
    sa.UniqueConstraint("run_id", "name", name="uq_writers_run_name"),
)

records = sa.Table(
    "records",
    metadata,
    sa.Column("id", RecordId, primary_key=True),
    sa.Column("writer_id", sa.Integer, sa.ForeignKey("writers.id"), nullable=False),
    sa.Column("step", sa.BigInteger, nullable=False),
    sa.Column("time", sa.Float, nullable=False),
    sa.Column("metrics", sa.Text, nullable=False),
    # No secondary index and no AUTOINCREMENT: each costs about a third more
    # per log(). Ids still only grow, as SQLite gives a new row the largest
    # id plus one, as long as the row with the largest id is never deleted
    # (pruning must keep it). PostgreSQL's sequence never reuses an id.
    # Readers scan by id: a writer's last step is found scanning back from
    # the newest row.
)


syncs = sa.Table(
    "syncs",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("run_id", sa.Integer, sa.ForeignKey("runs.id"), nullable=False),
    sa.Column("mode", sa.Text, nullable=False),  # "online" or "offline"
    # "running" until it ends: "ok", "failed", or "interrupted" (its syncer died).
    sa.Column("status", sa.Text, nullable=False),
    sa.Column("started_at", sa.Float, nullable=False),
    sa.Column("finished_at", sa.Float),
    # The upload covers the run's pending records with id <= last_id.
    sa.Column("last_id", RecordId, nullable=False),
    sa.Column("records", sa.Integer, nullable=False),
    sa.Column("message", sa.Text),
    sa.Column("host", sa.Text, nullable=False),
    sa.Column("pid", sa.Integer, nullable=False),
)


# Every metric key a writer's synced records hold. A sync's config carries only
# the metric definitions made in that sync, and W&B may keep only the latest
# config's, so each sync declares all of the run's metrics again.
metric_keys = sa.Table(
    "metric_keys",
    metadata,
    sa.Column("writer_id", sa.Integer, sa.ForeignKey("writers.id"), primary_key=True),
    sa.Column("key", sa.Text, primary_key=True),
)


# Run config and summary, as writers set them (Writer.config, Writer.summary):
# one row per key and call; at sync, each key's latest value (by id) wins.
config_entries = sa.Table(
    "config_entries",
    metadata,
    sa.Column("id", RecordId, primary_key=True),
    sa.Column("writer_id", sa.Integer, sa.ForeignKey("writers.id"), nullable=False),
    sa.Column("kind", sa.Text, nullable=False, server_default="config"),  # or "summary"
    sa.Column("key", sa.Text, nullable=False),
    sa.Column("value", sa.Text, nullable=False),  # JSON
    sa.Column("time", sa.Float, nullable=False),
)

# In the hub of a directory buffer (walbuf.shards): for each shard, run and
# writer, the shard's id of the last record copied into the hub.
shard_cursors = sa.Table(
    "shard_cursors",
    metadata,
    sa.Column("shard", sa.Text, primary_key=True),
    sa.Column("run", sa.Text, primary_key=True),
    sa.Column("writer", sa.Text, primary_key=True),
    sa.Column("last_id", sa.BigInteger, nullable=False),
    # ... and of the last config entry copied.
    sa.Column("config_id", sa.BigInteger, nullable=False, server_default="0"),
)


def resolve_url(buffer: str | os.PathLike[str]) -> sa.URL:
    """Turn a path or SQLAlchemy URL into an absolute SQLite or PostgreSQL URL, or raise ConfigError."""
    return backend_for(buffer).url


class Storage:
    """An open buffer: engine, schema check, and the queries writers and readers need.

    Not shared across processes: after a fork, the child must make its own
    (see :meth:`abandon`).
    """

    def __init__(
        self,
        buffer: str | os.PathLike[str] | sa.URL,
        *,
        durability: str = "normal",
        create: bool = True,
        busy_timeout: float = DEFAULT_BUSY_TIMEOUT,
        locks: Path | None = None,
        journal: str = "wal",
    ) -> None:
        """``locks`` and ``journal``: see SQLiteBackend (used by directory buffers)."""
        if durability not in DURABILITY_LEVELS:
            raise ConfigError(
                f"durability must be one of {sorted(DURABILITY_LEVELS)}, not {durability!r}"
            )
        self.backend: Backend = backend_for(buffer)
        if isinstance(self.backend, SQLiteBackend) and (locks is not None or journal != "wal"):
            self.backend = SQLiteBackend(self.backend.url, locks=locks, journal=journal)
        self.url = self.backend.url
        self.location = self.backend.location
        # The file of a SQLite buffer; None in PostgreSQL.
        self.path: Path | None = self.backend.path if isinstance(self.backend, SQLiteBackend) else None
        if not self.backend.exists():
            if not create:
                raise BufferNotFoundError(f"no buffer at {self.location}")
            self.backend.prepare()
        self.durability = durability
        # Set when the buffer is read as an immutable file: its state then.
        self._immutable_state: tuple[int, int, int] | None = None
        self.engine = self.backend.engine(durability, busy_timeout)
        try:
            with self.translate_errors():
                ensure_schema(self, create)
        except BufferNotWritableError:
            self.engine.dispose()
            # A reader that may not write the buffer's directory: SQLite cannot
            # make the -shm it needs. With no -wal, every record is in the
            # file: read it as immutable (see begin_read for a writer that
            # starts meanwhile).
            if create or not isinstance(self.backend, SQLiteBackend) or not self.backend.readable_immutable():
                raise
            self._immutable_state = self.backend.file_state()
            self.engine = self.backend.engine(durability, busy_timeout, immutable=True)
            try:
                with self.translate_errors():
                    ensure_schema(self, create)
            except BaseException:
                self.engine.dispose()
                raise
        except BaseException:
            self.engine.dispose()
            raise

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
        committed, and later records get larger ids (see walbuf.backends).
        """
        with self.translate_errors():
            with self.engine.connect().execution_options(walbuf_write=True) as conn:
                with conn.begin():
                    self.backend.serialize(conn)
                    if fence:
                        self.backend.fence(conn)
                    yield conn

    @contextmanager
    def begin_read(self) -> Iterator[sa.Connection]:
        """A read transaction: one consistent snapshot of the buffer."""
        with self.translate_errors():
            with self.engine.connect() as conn:
                if self.path is None:
                    # PostgreSQL's default gives each statement its own snapshot.
                    conn = conn.execution_options(isolation_level="REPEATABLE READ")
                with conn.begin():
                    yield conn
        if self._immutable_state is not None and self.backend.file_state() != self._immutable_state:  # type: ignore[attr-defined]
            # An immutable read takes no lock: a writer that opened the buffer
            # meanwhile and checkpointed into the file may have torn what was read.
            raise BufferBusyError(
                f"{self.location} changed while it was read (a writer opened it); read it again"
            )

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

    def reclaim(self) -> None:
        with self.translate_errors():
            self.backend.reclaim(self.engine)

    def dispose(self) -> None:
        """Close the engine's connections (in the process that opened them)."""
        self.engine.dispose()

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
        host: str,
        pid: int,
        target: Target | None = None,
    ) -> tuple[int, int | None]:
        """Create the run and writer if new; return (writer row id, last step or None).

        ``target`` (W&B id, project, entity) is stored for the run where it
        holds none yet. Raises WriterConflictError if the writer exists with
        another step axis, TargetConflictError if the run has another target.
        """
        now = time.time()
        with self.begin_write() as conn:
            run_id = self._run_id(conn, run, now)
            if target is not None:
                set_target(conn, run_id, run, target)
            row = conn.execute(
                sa.select(writers.c.id, writers.c.step_axis, writers.c.pruned_step).where(
                    writers.c.run_id == run_id, writers.c.name == writer
                )
            ).first()
            values = {"host": host, "pid": pid, "opened_at": now}
            if row is None:
                # A new writer has no records at or below the newest id, so its
                # cursor starts there: syncs never rescan older records for it.
                newest = conn.scalar(sa.select(sa.func.coalesce(sa.func.max(records.c.id), 0)))
                writer_id = conn.execute(
                    writers.insert().values(
                        run_id=run_id, name=writer, step_axis=step_axis, synced_id=newest, **values
                    )
                ).inserted_primary_key[0]
                return writer_id, None
            if row.step_axis != step_axis:
                raise WriterConflictError(
                    f"writer {writer!r} of run {run!r} logs on step axis {row.step_axis!r},"
                    f" not {step_axis!r}; use that axis, or another writer id for a new axis"
                )
            conn.execute(writers.update().where(writers.c.id == row.id).values(**values))
            last_step = conn.scalar(
                sa.select(records.c.step)
                .where(records.c.writer_id == row.id)
                .order_by(records.c.id.desc())
                .limit(1)
            )
            return row.id, last_step if last_step is not None else row.pruned_step

    def add_config(self, writer_pk: int, encoded: dict[str, str], kind: str = "config") -> None:
        """Store config or summary entries (key -> JSON text) of a writer, in one transaction."""
        if not encoded:
            return
        now = time.time()
        with self.begin_write() as conn:
            conn.execute(
                config_entries.insert(),
                [{"writer_id": writer_pk, "kind": kind, "key": k, "value": v, "time": now} for k, v in encoded.items()],
            )

    @staticmethod
    def _run_id(conn: sa.Connection, run: str, now: float) -> int:
        run_id = conn.scalar(sa.select(runs.c.id).where(runs.c.name == run))
        if run_id is None:
            run_id = conn.execute(runs.insert().values(name=run, created_at=now)).inserted_primary_key[0]
        return run_id

    def read(self, run: str | None = None, writer: str | None = None) -> Iterator[Record]:
        """Every record (of one run / writer if given), in the order they were logged."""
        query = (
            sa.select(runs.c.name, writers.c.name, records.c.step, records.c.time, records.c.metrics)
            .select_from(records.join(writers).join(runs))
            .order_by(records.c.id)
        )
        if run is not None:
            query = query.where(runs.c.name == run)
        if writer is not None:
            query = query.where(writers.c.name == writer)
        with self.begin_read() as conn:
            for row in conn.execution_options(yield_per=1000).execute(query):
                yield Record(row[0], row[1], row[2], row[3], decode(row[4]))


@dataclass(frozen=True)
class Target:
    """Where a run syncs to in W&B. None: not chosen (yet)."""

    wandb_id: str | None = None
    project: str | None = None
    entity: str | None = None


def read_target(conn: sa.Connection, run_id: int) -> Target:
    row = conn.execute(
        sa.select(runs.c.wandb_id, runs.c.project, runs.c.entity).where(runs.c.id == run_id)
    ).one()
    return Target(*row)


def merge_target(stored: Target, given: Target, run: str) -> Target:
    """``stored`` with the parts it lacks taken from ``given``.

    A part that both hold with different values raises TargetConflictError.
    """
    merged = {}
    for part, option in (("wandb_id", "run id"), ("project", "project"), ("entity", "entity")):
        new, old = getattr(given, part), getattr(stored, part)
        if new is not None and old is not None and new != old:
            raise TargetConflictError(
                f"run {run!r} of this buffer syncs to W&B {option} {old!r}, not {new!r};"
                f" leave the {option} out to use {old!r}, or log to another walbuf run"
            )
        merged[part] = old if old is not None else new
    return Target(**merged)


def set_target(conn: sa.Connection, run_id: int, run: str, given: Target) -> Target:
    """Store the parts of ``given`` the run lacks (see merge_target); return the run's target."""
    stored = read_target(conn, run_id)
    merged = merge_target(stored, given, run)
    if merged != stored:
        conn.execute(runs.update().where(runs.c.id == run_id).values(**merged.__dict__))
    return merged


def current_revision(conn: sa.Connection) -> str | None:
    """The schema revision stored in the buffer, or None for an empty database."""
    if not sa.inspect(conn).has_table("alembic_version"):
        return None
    return conn.exec_driver_sql("SELECT version_num FROM alembic_version").scalar()


def _check_known(storage: Storage, revision: str | None) -> None:
    if revision is not None and revision not in KNOWN_REVISIONS:
        raise SchemaTooNewError(
            f"{storage.location} has schema revision {revision!r}, newer than this walbuf knows"
            f" (up to {HEAD_REVISION!r}); upgrade walbuf to read or write it"
        )


def ensure_schema(storage: Storage, create: bool = True) -> None:
    """Bring the buffer's schema to HEAD_REVISION, or raise SchemaTooNewError.

    Concurrent openers of a new buffer take turns on a lock; each one
    re-checks after taking it, so only the first runs the migrations. With
    ``create`` false, a database without walbuf's tables raises
    BufferNotFoundError (a SQLite file that is missing is caught earlier).
    """
    with storage.engine.connect() as conn:
        revision = current_revision(conn)
        conn.rollback()
    if revision == HEAD_REVISION:
        return
    if revision is None and not create and storage.path is None:
        raise BufferNotFoundError(f"no walbuf buffer in {storage.location}")
    _check_known(storage, revision)
    lock = storage.lock("migrate")
    if not lock.acquire(timeout=DEFAULT_BUSY_TIMEOUT):
        raise BufferBusyError(
            f"{storage.location}: another process kept upgrading the schema for"
            f" {DEFAULT_BUSY_TIMEOUT:g}s; find it, or try again"
        )
    try:
        with storage.begin_write() as conn:
            revision = current_revision(conn)
            if revision == HEAD_REVISION:
                return
            _check_known(storage, revision)
            upgrade(conn)
    finally:
        lock.release()


def upgrade(conn: sa.Connection, target: str = "head") -> None:
    """Run the Alembic migrations on ``conn`` (in its transaction)."""
    from alembic import command
    from alembic.config import Config

    from . import migrations

    config = Config()
    config.set_main_option("script_location", os.path.dirname(migrations.__file__))
    config.attributes["connection"] = conn
    command.upgrade(config, target)


def read(
    buffer: str | os.PathLike[str], *, run: str | None = None, writer: str | None = None
) -> Iterator[Record]:
    """Yield the records in a buffer (of one run / writer if given), in the order logged.

    Reads one consistent snapshot: records committed after the first one is
    yielded are not included. Never creates a buffer: a missing one raises
    BufferNotFoundError. Of a directory buffer: the records of its hub, then
    those of each shard this host can read (every sealed one, its own live
    ones) that the hub lacks; another host's live shard is not read.
    """
    from . import ingest, shards  # here: both build on this module

    if shards.is_directory(buffer):
        layout = shards.Layout(buffer)
        if not layout.root.is_dir():
            raise BufferNotFoundError(f"no buffer at {layout.root}")
        yield from ingest.read_directory(layout, shards.host_name(), run, writer)
        return
    storage = Storage(buffer, create=False)
    try:
        yield from storage.read(run=run, writer=writer)
    finally:
        storage.dispose()
