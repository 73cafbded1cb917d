"""What a buffer holds: runs, writers, record and pending counts, the last sync."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field

import sqlalchemy as sa

from . import ingest, shards
from .errors import BufferNotFoundError
from .storage import Storage, records, runs, syncs, writers


@dataclass
class WriterStatus:
    writer: str
    step_axis: str
    records: int
    pending: int  # records not yet confirmed uploaded
    last_step: int | None
    host: str  # who opened the writer last
    pid: int
    opened_at: float


@dataclass
class SyncStatus:
    status: str  # "running", "ok", "failed" or "interrupted"
    mode: str
    started_at: float
    finished_at: float | None
    records: int
    message: str | None


@dataclass
class RunStatus:
    run: str
    wandb_id: str | None
    project: str | None
    entity: str | None
    records: int
    pending: int
    writers: list[WriterStatus]
    last_sync: SyncStatus | None


@dataclass
class ShardStatus:
    """A shard of a directory buffer that the hub has not taken in whole."""

    shard: str  # HOST.GEN
    host: str
    state: str  # "live" or "sealed"
    created_at: float
    not_in_hub: int | None  # records the next sync copies into the hub; None: another host's live shard


@dataclass
class BufferStatus:
    buffer: str
    runs: list[RunStatus]
    # Of a directory buffer: its shards not yet ingested. Runs are the hub's.
    shards: list[ShardStatus] = field(default_factory=list)

    def to_dict(self) -> dict[str, object]:
        """Plain data for JSON: per run and writer at least ``records`` and ``pending``."""
        return asdict(self)


def status(buffer: str | os.PathLike[str]) -> BufferStatus:
    """Read a buffer's status in one snapshot. Never creates a buffer (BufferNotFoundError).

    Of a directory buffer: the hub's runs, and the shards whose records are
    not all in the hub yet (the next sync on a host that can read them
    copies them in).
    """
    if shards.is_directory(buffer):
        return _directory_status(shards.Layout(buffer))
    storage = Storage(buffer, create=False)
    try:
        with storage.begin_read() as conn:
            return BufferStatus(storage.location, read_runs(conn))
    finally:
        storage.dispose()


def _directory_status(layout: shards.Layout) -> BufferStatus:
    if not layout.root.is_dir():
        raise BufferNotFoundError(f"no buffer at {layout.root}")
    run_status: list[RunStatus] = []
    if layout.hub.exists():
        hub = ingest.open_hub(layout, create=False)
        try:
            with hub.begin_read() as conn:
                run_status = read_runs(conn)
        finally:
            hub.dispose()
    backlog = [
        ShardStatus(shard.id, shard.host, shard.state, shard.gen / 1e9, count)
        for shard, count in ingest.backlog(layout, shards.host_name())
    ]
    return BufferStatus(str(layout.root), run_status, backlog)


def read_runs(conn: sa.Connection) -> list[RunStatus]:
    """The status of every run, read on ``conn`` (in its snapshot)."""
    counts = {
        row.writer_id: row
        for row in conn.execute(
            sa.select(
                records.c.writer_id,
                sa.func.count().label("records"),
                sa.func.sum(sa.case((records.c.id > writers.c.synced_id, 1), else_=0)).label("pending"),
                sa.func.max(records.c.step).label("last_step"),
            )
            .select_from(records.join(writers))
            .group_by(records.c.writer_id)
        )
    }
    per_run: dict[int, list[WriterStatus]] = {}
    for w in conn.execute(sa.select(writers).order_by(writers.c.run_id, writers.c.name)):
        c = counts.get(w.id)
        per_run.setdefault(w.run_id, []).append(
            WriterStatus(
                writer=w.name,
                step_axis=w.step_axis,
                records=c.records if c else 0,
                pending=int(c.pending) if c else 0,
                last_step=c.last_step if c else w.pruned_step,
                host=w.host,
                pid=w.pid,
                opened_at=w.opened_at,
            )
        )
    result = []
    for run in conn.execute(sa.select(runs).order_by(runs.c.id)):
        last = conn.execute(
            sa.select(syncs).where(syncs.c.run_id == run.id).order_by(syncs.c.id.desc()).limit(1)
        ).first()
        members = per_run.get(run.id, [])
        result.append(
            RunStatus(
                run=run.name,
                wandb_id=run.wandb_id,
                project=run.project,
                entity=run.entity,
                records=sum(w.records for w in members),
                pending=sum(w.pending for w in members),
                writers=members,
                last_sync=None
                if last is None
                else SyncStatus(
                    last.status, last.mode, last.started_at, last.finished_at, last.records, last.message
                ),
            )
        )
    return result
