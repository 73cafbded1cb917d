"""What a buffer holds: runs, writers, record and pending counts, the last sync."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

import sqlalchemy as sa

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
class BufferStatus:
    buffer: str
    runs: list[RunStatus]

    def to_dict(self) -> dict[str, object]:
        """Plain data for JSON: per run and writer at least ``records`` and ``pending``."""
        return asdict(self)


def status(buffer: str | os.PathLike[str]) -> BufferStatus:
    """Read a buffer's status in one snapshot. Never creates a buffer (BufferNotFoundError)."""
    storage = Storage(buffer, create=False)
    try:
        with storage.begin_read() as conn:
            return BufferStatus(storage.location, read_runs(conn))
    finally:
        storage.dispose()


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
