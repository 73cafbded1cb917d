"""`walbuf status`: what a buffer holds: runs, writers, record and pending counts, the last sync."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any, Literal, cast

import sqlalchemy as sa

from ..buffer import Buffer, Location, open_buffer
from ..errors import UntrustedPathError
from ..store.schema import pending, quarantine, records, runs, syncs, writers

# "died": left running by a syncer that no longer runs (killed, or failed
# where it could not note so); the next sync sends its records again.
# "unreachable": failed as a retry can fix (W&B unreachable or failing: exit 75).
SyncState = Literal["running", "ok", "failed", "unreachable", "interrupted", "died"]


@dataclass(frozen=True)
class WriterStatus:
    writer: str
    step_axis: str
    records: int
    pending: int  # records not yet confirmed uploaded
    last_step: int | None
    host: str  # who opened the writer last
    pid: int
    opened_at: float
    quarantined: int = 0  # records a sync quarantined: W&B refuses them for good, never sent


@dataclass(frozen=True)
class SyncStatus:
    status: SyncState
    mode: str
    started_at: float
    finished_at: float | None
    records: int
    message: str | None


@dataclass(frozen=True)
class RunStatus:
    run: str
    wandb_id: str | None
    project: str | None
    entity: str | None
    records: int
    pending: int
    writers: tuple[WriterStatus, ...]
    last_sync: SyncStatus | None
    quarantined: int = 0
    # Why W&B refused the run's target (it is not sent until a sync gives another); None if it did not.
    target_refused: str | None = None
    # The exit code a sync finished the W&B run with (its job was done); None: running.
    finished_exit: int | None = None


@dataclass(frozen=True)
class ShardStatus:
    """A shard of a directory buffer that the hub has not taken in whole."""

    shard: str  # HOST.GEN
    host: str
    state: Literal["live", "sealed"]
    created_at: float
    not_in_hub: int | None  # records the next sync copies into the hub; None: another host's live shard, or refused
    # Why it is not taken in whole: damaged, holding what walbuf never writes, an older walbuf's waiting for a step.
    refused: str | None = None


@dataclass(frozen=True)
class BufferStatus:
    buffer: str
    runs: tuple[RunStatus, ...]
    # Of a directory buffer: its shards not yet ingested. Runs are the hub's.
    shards: tuple[ShardStatus, ...] = ()
    # Of a directory buffer: shards an older walbuf set aside in quarantine/ ("HOST.GEN: why").
    damaged_shards: tuple[str, ...] = ()
    # Of a directory buffer: what walbuf does not open there (another account's
    # file, a symbolic link, a name walbuf does not give), a message each.
    not_opened: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """Plain data for JSON (dicts, lists, str, numbers, None): per run and writer at least ``records`` and
        ``pending``."""
        return cast(dict[str, Any], _plain(asdict(self)))


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def status(buffer: Location) -> BufferStatus:
    """Read a buffer's status in one snapshot. Never creates or changes anything.

    Of a directory buffer: the hub's runs (none before its first sync), and
    the shards whose records are not all in the hub yet (the next sync on a
    host that can read them copies them in).
    """
    located = open_buffer(buffer)
    run_status: list[RunStatus] = []
    # The shards first, against one read of the hub; then the hub's records up to its newest one in that read: a
    # record a sync takes in meanwhile is counted once, in its shard.
    backlog = located.backlog()
    storage = located.open_store("read")
    if storage is not None:
        with storage, storage.begin_read() as conn:
            run_status = read_runs(conn, backlog.store_top)
    if any(r.last_sync is not None and r.last_sync.status == "running" for r in run_status):
        run_status = _dead_syncs_told(located, run_status)
    shard_status = [
        ShardStatus(e.name, e.host, "live" if e.live else "sealed", e.created_at, e.not_in_hub, e.refused)
        for e in backlog
    ]
    damaged = [f"{shard}: {why}" for shard, why in located.damaged()]
    strangers = located.not_opened()
    return BufferStatus(located.location, tuple(run_status), tuple(shard_status), tuple(damaged), tuple(strangers))


def read_runs(conn: sa.Connection, up_to: int | None = None) -> list[RunStatus]:
    """The status of every run, read on ``conn`` (in its snapshot), of its records with ids up to ``up_to`` if given."""
    counted = records.c.id <= up_to if up_to is not None else sa.true()
    counts = {
        row.writer_id: row
        for row in conn.execute(
            sa.select(
                records.c.writer_id,
                sa.func.count().label("records"),
                sa.func.sum(sa.case((pending(), 1), else_=0)).label("pending"),
                sa.func.max(records.c.step).label("last_step"),
            )
            .select_from(records.join(writers))
            .where(counted)
            .group_by(records.c.writer_id)
        )
    }
    held_back = {
        writer_id: n
        for writer_id, n in conn.execute(
            sa.select(records.c.writer_id, sa.func.count())
            .select_from(quarantine.join(records))
            .where(counted)
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
                quarantined=held_back.get(w.id, 0),
            )
        )
    result = []
    for run in conn.execute(sa.select(runs).order_by(runs.c.id)):
        members = per_run.get(run.id, [])
        result.append(
            RunStatus(
                run=run.name,
                wandb_id=run.wandb_id,
                project=run.project,
                entity=run.entity,
                records=sum(w.records for w in members),
                pending=sum(w.pending for w in members),
                writers=tuple(members),
                quarantined=sum(w.quarantined for w in members),
                target_refused=run.target_refused,
                finished_exit=run.finished_exit,
                last_sync=_last_sync(conn, run.id),
            )
        )
    return result


def _last_sync(conn: sa.Connection, run_id: int) -> SyncStatus | None:
    """The run's last sync: the uploads of the last invocation (one process), together.

    A sync that finishes a W&B run does so in an upload of its own, of no
    records, after the upload that sent them, and a ``sync --follow`` makes
    one upload per pass: each is one sync here, its records the sum of its
    uploads'.
    """
    of_run = syncs.c.run_id == run_id
    last = conn.execute(sa.select(syncs).where(of_run).order_by(syncs.c.id.desc()).limit(1)).first()
    if last is None:
        return None
    other = sa.or_(syncs.c.host != last.host, syncs.c.pid != last.pid)
    before = conn.scalar(sa.select(sa.func.max(syncs.c.id)).where(of_run, other)) or 0
    same = sa.and_(of_run, syncs.c.id > before)
    extent = sa.select(sa.func.min(syncs.c.started_at), sa.func.sum(syncs.c.records)).where(same)
    started, total = conn.execute(extent).one()
    message = conn.scalar(
        sa.select(syncs.c.message).where(same, syncs.c.message.is_not(None)).order_by(syncs.c.id.desc()).limit(1)
    )
    return SyncStatus(last.status, last.mode, started, last.finished_at, int(total), message)


def _dead_syncs_told(located: Buffer, runs_read: list[RunStatus]) -> list[RunStatus]:
    """A last sync left "running" while no syncer runs (none holds the sync lock) is "died"."""
    try:
        if located.sync_running():
            return runs_read
    except (PermissionError, UntrustedPathError):
        return runs_read  # cannot tell from here: as the buffer says
    told = []
    for run in runs_read:
        last = run.last_sync
        if last is not None and last.status == "running":
            last = replace(
                last,
                status="died",
                message="its syncer ended during the upload without confirming it: the next walbuf sync sends"
                f" those {last.records} records again, and W&B may then hold some of them twice",
            )
        told.append(replace(run, last_sync=last))
    return told
