"""The storage: where a buffer lives, its engine and pragmas, its tables, its schema.

A buffer is a SQLite database in WAL mode. Every connection gets a busy
timeout, WAL journaling and the synchronous level of the chosen durability;
the driver runs in autocommit and walbuf emits BEGIN itself (BEGIN IMMEDIATE
for transactions that write), which is what SQLite needs for transactional DDL
and for writers that never fail with SQLITE_BUSY half-way through.

The schema belongs to the Alembic migrations in migrations/ (installed as
walbuf.migrations). Opening a buffer applies them; when the schema is already
current the check is one SELECT and Alembic is not imported.
"""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from filelock import FileLock

from .errors import (
    BufferBusyError,
    BufferCorruptError,
    BufferFullError,
    ConfigError,
    BufferNotFoundError,
    SchemaTooNewError,
    StorageError,
    TargetConflictError,
    WriterConflictError,
)
from .record import Record, decode

# Every revision in migrations/versions, oldest first. The newest is the schema
# this code reads and writes; tests check this list against Alembic's own.
KNOWN_REVISIONS: tuple[str, ...] = ("0001", "0002", "0003")
HEAD_REVISION = KNOWN_REVISIONS[-1]

DURABILITY_LEVELS = {"normal": "NORMAL", "fsync": "FULL"}
DEFAULT_BUSY_TIMEOUT = 60.0  # seconds; a writer waits this long for the write lock
# Each commit appends the pages it changed to the WAL; a record is far smaller
# than a page, so smaller pages mean less to write per log() and a shorter
# hold of the write lock. Measured with 16 writer processes (scripts/
# bench_writer.py): 1 KiB pages and a checkpoint every 10,000 pages (10 MiB
# of WAL) gave about 1.2x the records/s of SQLite's defaults (4 KiB, 1,000).
PAGE_SIZE = 1024  # takes effect only when the database file is created
WAL_AUTOCHECKPOINT = 10_000  # pages

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
    sa.Column("synced_id", sa.Integer, nullable=False, server_default="0"),
    # The step of the newest record of this writer that prune deleted: the
    # writer continues after it even when none of its records remain.
    sa.Column("pruned_step", sa.BigInteger),
    sa.UniqueConstraint("run_id", "name", name="uq_writers_run_name"),
)

records = sa.Table(
    "records",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("writer_id", sa.Integer, sa.ForeignKey("writers.id"), nullable=False),
    sa.Column("step", sa.BigInteger, nullable=False),
    sa.Column("time", sa.Float, nullable=False),
    sa.Column("metrics", sa.Text, nullable=False),
    # No secondary index and no AUTOINCREMENT: each costs about a third more
    # per log(). Ids still only grow, as SQLite gives a new row the largest
    # id plus one, as long as the row with the largest id is never deleted
    # (pruning must keep it). Readers scan by id: a writer's last step is
    # found scanning back from the newest row.
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
    sa.Column("last_id", sa.Integer, nullable=False),
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


def resolve_url(buffer: str | os.PathLike[str]) -> sa.URL:
    """Turn a path or SQLAlchemy URL into an absolute SQLite URL, or raise ConfigError."""
    text = os.fspath(buffer)
    if not text:
        raise ConfigError("no buffer given: pass a path or set WALBUF_BUFFER")
    if "://" not in text:
        return sa.URL.create("sqlite", database=str(Path(text).expanduser().absolute()))
    try:
        url = sa.make_url(text)
    except sa.exc.ArgumentError as exc:
        raise ConfigError(f"buffer {text!r} is not a valid SQLAlchemy URL: {exc}") from None
    if url.get_backend_name() != "sqlite":
        raise ConfigError(
            f"buffer {text!r}: walbuf stores buffers in SQLite; give a file path or a sqlite:/// URL"
        )
    if url.database in (None, "", ":memory:") or url.query.get("mode") == "memory":
        raise ConfigError(
            f"buffer {text!r} is an in-memory database, which other processes cannot see;"
            " give a file path"
        )
    return url.set(database=str(Path(url.database).expanduser().absolute()))


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
    ) -> None:
        if durability not in DURABILITY_LEVELS:
            raise ConfigError(
                f"durability must be one of {sorted(DURABILITY_LEVELS)}, not {durability!r}"
            )
        self.url = buffer if isinstance(buffer, sa.URL) else resolve_url(buffer)
        assert self.url.database is not None
        self.path = Path(self.url.database)
        if not self.path.exists():
            if not create:
                raise BufferNotFoundError(f"no buffer at {self.path}")
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self.durability = durability
        self._synchronous = DURABILITY_LEVELS[durability]
        self._busy_ms = int(busy_timeout * 1000)
        self.engine = sa.create_engine(
            self.url,
            connect_args={"check_same_thread": False},
            poolclass=sa.pool.NullPool,
        )
        sa.event.listen(self.engine, "connect", self._on_connect)
        sa.event.listen(self.engine, "begin", _on_begin)
        try:
            with translate_errors(self.path):
                ensure_schema(self)
        except BaseException:
            self.engine.dispose()
            raise

    # -- connections ---------------------------------------------------------

    def _on_connect(self, dbapi_connection: sqlite3.Connection, _record: Any) -> None:
        # Autocommit at the driver: SQLAlchemy's "begin" event emits BEGIN.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(f"PRAGMA busy_timeout={self._busy_ms}")
            mode = cursor.execute("PRAGMA journal_mode").fetchone()[0]
            if mode.lower() != "wal":
                # Only a new buffer gets here. Switching to WAL can fail with
                # SQLITE_BUSY at once, without the busy handler, while another
                # process switches the same new file: take turns. WAL stays
                # set in the file, so later openers skip this.
                with FileLock(self.lock_path("migrate.lock"), thread_local=False):
                    cursor.execute(f"PRAGMA page_size={PAGE_SIZE}")
                    mode = cursor.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if mode.lower() != "wal":
                raise ConfigError(
                    f"{self.path}: SQLite could not switch the buffer to WAL mode"
                    f" (it stays in {mode!r}); put the buffer on a local filesystem"
                )
            cursor.execute(f"PRAGMA synchronous={self._synchronous}")
            cursor.execute(f"PRAGMA wal_autocheckpoint={WAL_AUTOCHECKPOINT}")
        finally:
            cursor.close()

    @contextmanager
    def begin_write(self) -> Iterator[sa.Connection]:
        """A transaction that takes SQLite's write lock at BEGIN (no mid-transaction SQLITE_BUSY)."""
        with translate_errors(self.path):
            with self.engine.connect().execution_options(walbuf_write=True) as conn:
                with conn.begin():
                    yield conn

    @contextmanager
    def begin_read(self) -> Iterator[sa.Connection]:
        """A read transaction: one consistent snapshot of the buffer."""
        with translate_errors(self.path):
            with self.engine.connect() as conn:
                with conn.begin():
                    yield conn

    def raw_connection(self) -> sa.PoolProxiedConnection:
        """A dedicated connection, configured like every other, for the writer's hot path.

        The caller keeps the returned proxy for as long as it uses
        ``.driver_connection`` (the sqlite3 connection): dropping the proxy
        closes it.
        """
        with translate_errors(self.path):
            return self.engine.raw_connection()

    def lock_path(self, name: str) -> Path:
        """Where lock files of this buffer live: a directory beside the database."""
        directory = self.path.with_name(self.path.name + ".locks")
        directory.mkdir(exist_ok=True)
        return directory / name

    def dispose(self) -> None:
        """Close the engine's connections (in the process that opened them)."""
        self.engine.dispose()

    def abandon(self) -> None:
        """Forget the engine without closing its connections: what a forked child must do.

        Closing a SQLite connection inherited across fork can disturb the
        parent's locks and WAL; SQLAlchemy's pool is told to let go without
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

    @staticmethod
    def _run_id(conn: sa.Connection, run: str, now: float) -> int:
        run_id = conn.scalar(sa.select(runs.c.id).where(runs.c.name == run))
        if run_id is None:
            run_id = conn.execute(runs.insert().values(name=run, created_at=now)).inserted_primary_key[0]
        return run_id

    def insert_sql(self) -> str:
        """The compiled INSERT of one record: (writer_id, step, time, metrics), positional."""
        stmt = records.insert().values(
            writer_id=sa.bindparam("w"),
            step=sa.bindparam("s"),
            time=sa.bindparam("t"),
            metrics=sa.bindparam("m"),
        )
        compiled = stmt.compile(dialect=self.engine.dialect)
        assert compiled.positiontup == ["w", "s", "t", "m"], compiled.positiontup
        return str(compiled)

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


def _on_begin(conn: sa.Connection) -> None:
    conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.get_execution_options().get("walbuf_write") else "BEGIN")


@contextmanager
def translate_errors(path: Path) -> Iterator[None]:
    """Turn the driver's errors about the database file into walbuf's own."""
    try:
        yield
    except sa.exc.DBAPIError as exc:
        raise storage_error(path, exc.orig) from exc
    except sqlite3.Error as exc:
        raise storage_error(path, exc) from exc


def storage_error(path: Path, exc: BaseException | None) -> StorageError:
    message = str(exc)
    if isinstance(exc, sqlite3.OperationalError) and "locked" in message:
        return BufferBusyError(
            f"{path}: the database stayed locked past the busy timeout ({message});"
            f" another process holds a long write transaction: find it with `fuser {path}`"
        )
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


def current_revision(conn: sa.Connection) -> str | None:
    """The schema revision stored in the buffer, or None for an empty database."""
    if not sa.inspect(conn).has_table("alembic_version"):
        return None
    return conn.exec_driver_sql("SELECT version_num FROM alembic_version").scalar()


def _check_known(storage: Storage, revision: str | None) -> None:
    if revision is not None and revision not in KNOWN_REVISIONS:
        raise SchemaTooNewError(
            f"{storage.path} has schema revision {revision!r}, newer than this walbuf knows"
            f" (up to {HEAD_REVISION!r}); upgrade walbuf to read or write it"
        )


def ensure_schema(storage: Storage) -> None:
    """Bring the buffer's schema to HEAD_REVISION, or raise SchemaTooNewError.

    Concurrent openers of a new buffer serialise on a lock file; each one
    re-checks after taking it, so only the first runs the migrations.
    """
    with storage.engine.connect() as conn:
        revision = current_revision(conn)
        conn.rollback()
    if revision == HEAD_REVISION:
        return
    _check_known(storage, revision)
    with FileLock(storage.lock_path("migrate.lock"), thread_local=False):
        with storage.begin_write() as conn:
            revision = current_revision(conn)
            if revision == HEAD_REVISION:
                return
            _check_known(storage, revision)
            upgrade(conn)


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
    BufferNotFoundError.
    """
    storage = Storage(buffer, create=False)
    try:
        yield from storage.read(run=run, writer=writer)
    finally:
        storage.dispose()
