"""The schema of a buffer: its tables, its revisions, and bringing a database up to date.

The schema belongs to the Alembic migrations in migrations/ (installed as
walbuf.migrations); the tables here must match them (a test compares the
two). Storage applies them when it opens a buffer for writing (see
walbuf.store.storage).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterable, Mapping

import sqlalchemy as sa

from ..errors import NotABufferError, SchemaTooNewError

# Every revision in migrations/versions, oldest first. The newest is the schema
# this code reads and writes; tests check this list against Alembic's own.
KNOWN_REVISIONS: tuple[str, ...] = (
    "0001", "0002", "0003", "0004", "0005", "0006", "0007", "0008", "0009", "0010", "0011",
    "0012",
)  # fmt: skip
HEAD_REVISION = KNOWN_REVISIONS[-1]

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
    # Why W&B refused the stored target (no such project, a deleted run...):
    # until a sync gives another, the run is not sent. None: not refused.
    sa.Column("target_refused", sa.Text),
    # The exit code a sync finished the W&B run with (0: every writer closed;
    # 1: one died); None while it is running, or since a writer opened again.
    sa.Column("finished_exit", sa.Integer),
    # "online" or "offline": the mode its W&B run was written in (W&B does not
    # take both in one run). None until a sync succeeds.
    sa.Column("mode", sa.Text),
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
    # When the writer was closed; None while it is open, or if it died.
    sa.Column("closed_at", sa.Float),
    # The exit code the writer closed with, as wandb's ``with wandb.init()``
    # gives it: 1 when an exception escaped its ``with`` block, else 0 (NULL
    # too: a writer closed before revision 0009). Meaningful once closed_at is set.
    sa.Column("close_exit", sa.Integer),
    # What its keys and step axis are prefixed with in W&B ("" for none: keys
    # as logged). Set for every writer (revision 0008 copied the name, the
    # prefix every writer had before).
    sa.Column("prefix", sa.Text),
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
    # "running" until it ends: "ok", "failed", "unreachable" (failed as a retry
    # fixes: W&B unreachable or failing), or "interrupted" (its syncer died).
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


# Which step axis each W&B key of a run is plotted against (W&B plots a key
# against one axis): claimed by the first writer that logs the key, at log()
# in its database, or at sync for what reaches the hub of a directory buffer.
# A step axis's own key claims None. Writers whose keys would be the same W&B
# key on another axis are refused (walbuf.store.claims).
key_claims = sa.Table(
    "key_claims",
    metadata,
    sa.Column("run_id", sa.Integer, sa.ForeignKey("runs.id"), primary_key=True),
    sa.Column("key", sa.Text, primary_key=True),
    sa.Column("step_axis", sa.Text),
    sa.Column("writer_id", sa.Integer, sa.ForeignKey("writers.id"), nullable=False),
)

# Each W&B key's last value that a sync sent (JSON): every sync sends the run's
# whole summary, and the records may be pruned by then.
last_values = sa.Table(
    "last_values",
    metadata,
    sa.Column("run_id", sa.Integer, sa.ForeignKey("runs.id"), primary_key=True),
    sa.Column("key", sa.Text, primary_key=True),
    sa.Column("value", sa.Text, nullable=False),
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

# In the hub of a directory buffer: how far each shard (of frames, see
# walbuf.directory.frames) is taken in: the offset of its first frame not
# taken in, whether its END frame was, the process that appends it (JSON;
# NULL before its first frame is taken in), its mtime when a sync last read
# it (the file server's clock: when its process last appended), why the last sync stopped reading it
# there, if it did (a frame walbuf would not write, a writer the hub
# refuses), and the file server's clock minus its process's (revision 0012).
log_cursors = sa.Table(
    "log_cursors",
    metadata,
    sa.Column("shard", sa.Text, primary_key=True),
    sa.Column("offset", sa.BigInteger, nullable=False),
    sa.Column("ended", sa.Boolean, nullable=False),
    sa.Column("process", sa.Text),
    sa.Column("seen", sa.Float, nullable=False),
    sa.Column("refused", sa.Text),
    sa.Column("clock", sa.Float, nullable=False, server_default="0"),
)

# ... and the byte ranges before a shard's offset the hub could not take in
# yet (no whole frame there when read, or frames of a writer named only
# there): every sync reads them again (walbuf.directory.ingest).
log_gaps = sa.Table(
    "log_gaps",
    metadata,
    sa.Column("shard", sa.Text, primary_key=True),
    sa.Column("start", sa.BigInteger, primary_key=True),
    sa.Column("until", sa.BigInteger, nullable=False),
)

# ... and each writer a log shard names: its id there, the hub's writer, and
# whether it is open there (no CLOSED frame of it taken in yet).
log_writers = sa.Table(
    "log_writers",
    metadata,
    sa.Column("shard", sa.Text, primary_key=True),
    sa.Column("local_id", sa.Integer, primary_key=True),
    sa.Column("writer_id", sa.Integer, sa.ForeignKey("writers.id"), nullable=False),
    sa.Column("open", sa.Boolean, nullable=False),
)


# Records that W&B refuses for a reason a retry cannot fix (a key or value it
# cannot take): never sent, kept with the reason until prune removes them
# with the synced records. Their writer's cursor passes them.
quarantine = sa.Table(
    "quarantine",
    metadata,
    sa.Column("record_id", RecordId, sa.ForeignKey("records.id"), primary_key=True),
    sa.Column("reason", sa.Text, nullable=False),
    sa.Column("time", sa.Float, nullable=False),
)


# Which process owns a writer id of a PostgreSQL buffer (revision 0010; see
# walbuf.store.postgresql): the row's holder, until expires_at (the
# server's clock, epoch seconds) unless renewed. host, boot_id, pid and
# started (the process's start time in clock ticks since boot) let a process
# on the same host see at once that the holder died. SQLite buffers leave it
# empty: their writers own ids through lock files.
writer_leases = sa.Table(
    "writer_leases",
    metadata,
    sa.Column("name", sa.Text, primary_key=True),
    sa.Column("holder", sa.Text, nullable=False),
    sa.Column("host", sa.Text, nullable=False),
    sa.Column("boot_id", sa.Text, nullable=False),
    sa.Column("pid", sa.Integer, nullable=False),
    sa.Column("started", sa.Text, nullable=False),
    sa.Column("expires_at", sa.Float, nullable=False),
)


# The tables every revision has had: a database that has them all is a walbuf buffer.
_ALWAYS = frozenset({"alembic_version", "runs", "writers", "records"})
# Every table walbuf makes, of any revision: metric_keys was made by 0002 and dropped by 0008, shard_cursors made by
# 0004 and dropped by 0012.
WALBUF_TABLES = frozenset(metadata.tables) | {"alembic_version", "metric_keys", "shard_cursors"}


def pending(cursor: sa.ColumnElement[int] | None = None) -> sa.ColumnElement[bool]:
    """Whether a record is pending, not yet confirmed by W&B: its id is above its writer's sync cursor.

    The one definition. ``cursor`` is the writer's cursor as the query has
    it: by default writers.synced_id (the query joins writers), else
    :func:`cursors` of the writers read beforehand.
    """
    return records.c.id > (writers.c.synced_id if cursor is None else cursor)


def cursors(synced_ids: Mapping[int, int]) -> sa.ColumnElement[int]:
    """Each record's writer's cursor, from ``synced_ids`` (writer id -> synced_id), for :func:`pending` without a
    join."""
    return sa.case(dict(synced_ids), value=records.c.writer_id)


def foreign_objects(objects: Iterable[tuple[str, str, str]]) -> list[str]:
    """What a SQLite schema holds that walbuf never makes: a trigger, a view, another table or index.

    ``objects`` are (type, name, table) rows of sqlite_master. Besides
    walbuf's tables, their indexes for UNIQUE and PRIMARY KEY constraints
    (``sqlite_autoindex_...``) and SQLite's statistics tables (data that
    ANALYZE writes) are walbuf's.
    """
    found = []
    for kind, name, table in objects:
        if kind == "table" and (name in WALBUF_TABLES or name.startswith("sqlite_stat")):
            continue
        if kind == "index" and table in WALBUF_TABLES and name.startswith(f"sqlite_autoindex_{table}_"):
            continue
        found.append(f"{kind} {name!r}")
    return found


def buffer_revision(conn: sa.Connection, location: str) -> str | None:
    """The walbuf schema revision of the database on ``conn``; None for a database with no tables.

    Reads only. Raises NotABufferError for a database that holds tables but
    not a walbuf buffer's, and for a SQLite buffer of a revision this walbuf
    knows that holds anything walbuf never makes (a trigger or a view runs
    code in whoever opens the file: a buffer is data, never code).
    """
    objects: list[tuple[str, str, str]] = []
    if conn.dialect.name == "sqlite":
        objects = [tuple(row) for row in conn.exec_driver_sql("SELECT type, name, tbl_name FROM sqlite_master")]
        tables = sorted(name for kind, name, _ in objects if kind == "table")
    else:
        tables = sorted(sa.inspect(conn).get_table_names())
    if _ALWAYS.issubset(tables):
        revision = conn.exec_driver_sql("SELECT version_num FROM alembic_version").scalar()
        if revision is not None:
            if revision in KNOWN_REVISIONS:
                found = foreign_objects(objects) if conn.dialect.name == "sqlite" else _postgres_code(conn)
                check_objects(found, location)
            return str(revision)
    if not tables:
        check_objects(foreign_objects(objects), location)
        return None
    shown = ", ".join(tables[:8]) + (", ..." if len(tables) > 8 else "")
    raise NotABufferError(
        f"{location} is a database, but not a walbuf buffer (its tables: {shown});"
        " give the path of a walbuf buffer, or a new path for a new one (nothing was changed)"
    )


def _postgres_code(conn: sa.Connection) -> list[str]:
    """The triggers and rules on walbuf's tables in the current PostgreSQL schema: code that would run in walbuf's
    sessions.

    (Another application's tables may share the schema; only walbuf's own are looked at.)
    """
    tables = sorted(WALBUF_TABLES)
    triggers = conn.execute(
        sa.text(
            "SELECT t.tgname FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid"
            " JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE n.nspname = current_schema() AND NOT t.tgisinternal AND c.relname = ANY(:tables)"
        ),
        {"tables": tables},
    ).scalars()
    rules = conn.execute(
        sa.text("SELECT rulename FROM pg_rules WHERE schemaname = current_schema() AND tablename = ANY(:tables)"),
        {"tables": tables},
    ).scalars()
    return [f"trigger {name!r}" for name in triggers] + [f"rule {name!r}" for name in rules]


def check_objects(found: list[str], location: str) -> None:
    """Raise NotABufferError naming what :func:`foreign_objects` found, if anything."""
    if found:
        shown = ", ".join(found[:5]) + (", ..." if len(found) > 5 else "")
        raise NotABufferError(
            f"{location} holds {shown}, which walbuf never makes: walbuf refuses a buffer that holds code"
            " (a trigger or a view runs in every process that uses it); if nobody you trust added it, another"
            " account wrote to the buffer (see docs/security.md); nothing was changed"
        )


def inserted_id(result: sa.CursorResult[object]) -> int:
    """The primary key of the row an INSERT made."""
    key = result.inserted_primary_key
    assert key is not None, "not the result of a single-row INSERT"
    return int(key[0])


def check_known(revision: str | None, location: str) -> None:
    """Raise SchemaTooNewError for a revision newer than this walbuf's."""
    if revision is not None and revision not in KNOWN_REVISIONS:
        raise SchemaTooNewError(
            f"{location} has schema revision {revision!r}, newer than this walbuf knows"
            f" (up to {HEAD_REVISION!r}); upgrade walbuf to read or write it"
        )


def upgrade(conn: sa.Connection, target: str = "head") -> None:
    """Run the Alembic migrations on ``conn`` (in its transaction)."""
    from alembic import command
    from alembic.config import Config

    # Installed as walbuf.migrations (from migrations/ of the checkout: see pyproject.toml).
    migrations = importlib.util.find_spec("walbuf.migrations")
    assert migrations is not None and migrations.origin is not None

    config = Config()
    config.set_main_option("script_location", os.path.dirname(migrations.origin))
    config.attributes["connection"] = conn
    command.upgrade(config, target)
