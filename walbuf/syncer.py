"""The syncer: replays what writers appended into W&B, each record once where it can be.

For each run with pending records, one sync:

1. takes the buffer's sync lock (one syncer per buffer; a lock file beside it),
2. fixes the run's W&B target (a run id is generated and stored the first
   time) and the upload's extent: the run's pending records up to the newest
   one at that moment (and at most ``max_records``); what writers append
   meanwhile waits for the next sync,
3. notes the upload in the ``syncs`` table as running,
4. replays the records in the order they were committed into one wandb run in
   shared mode, through :mod:`walbuf.wandb_adapter`,
5. and only when wandb confirms the upload, advances the writers' cursors and
   marks the sync done, in one transaction.

A failed upload changes nothing but the sync's own log entry. A syncer killed
between 3 and 5 leaves a running entry: the next sync marks it interrupted,
sends those records again (at-least-once: W&B may then hold them twice) and
reports how many that may be.

The key scheme (README): writer ``w``'s metric ``k`` is logged as ``w/k`` and
its step as ``w/<step_axis>``, declared with
``define_metric("w/k", step_metric="w/<step_axis>")``; writers never share a
key, so two ranks' ``loss`` stay apart.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import string
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import sqlalchemy as sa
from . import ingest, shards
from .errors import BufferNotFoundError, ConfigError, SyncLockedError, UploadError
from .record import decode
from .storage import (
    Storage,
    config_entries,
    Target,
    merge_target,
    metric_keys,
    read_target,
    records,
    runs,
    set_target,
    syncs,
    writers,
)

MODES = ("online", "offline")
READ_CHUNK = 2000  # records per read transaction: short snapshots let the WAL checkpoint


def generate_run_id() -> str:
    """A new W&B run id: 8 random base-36 digits, as wandb makes them."""
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


@dataclass
class RunSync:
    """What one sync of one run did (or, with ``dry_run``, would do)."""

    run: str
    target: Target
    mode: str
    records: int = 0
    per_writer: dict[str, int] = field(default_factory=dict)
    # Records a cut-off earlier upload may already have delivered: sent again, maybe twice.
    possibly_duplicated: int = 0
    offline_dir: str | None = None
    # Config keys whose value a later Writer.config() replaced, since the last sync.
    config_changes: list[ConfigChange] = field(default_factory=list)


@dataclass
class ConfigChange:
    """A run config key set again with another value: the later one is what W&B gets."""

    key: str
    old_writer: str
    old_value: object
    new_writer: str
    new_value: object


@dataclass
class SyncResult:
    """What a sync of a buffer did, run by run. ``records`` is the total sent."""

    runs: list[RunSync]
    dry_run: bool = False
    # A dry run of a directory buffer: records in shards not yet copied into
    # the hub, which a real sync copies in first (not counted in ``records``),
    # and other hosts' live shards, which it cannot read yet.
    not_in_hub: int = 0
    unreadable_shards: int = 0

    @property
    def records(self) -> int:
        return sum(r.records for r in self.runs)


@dataclass
class _Writer:
    id: int
    name: str
    step_axis: str
    synced_id: int


def sync(
    buffer: str | os.PathLike[str],
    *,
    run: str | None = None,
    project: str | None = None,
    entity: str | None = None,
    run_id: str | None = None,
    mode: str = "online",
    directory: str | os.PathLike[str] | None = None,
    max_records: int | None = None,
    max_seconds: float | None = None,
    wait: float = 0.0,
    dry_run: bool = False,
    progress: Callable[[int], None] | None = None,
    on_run: Callable[[RunSync], None] | None = None,
) -> SyncResult:
    """Upload every record not yet synced, run by run; see the module docstring.

    ``run`` limits the sync to one run. ``project``, ``entity`` and ``run_id``
    set the W&B target where the buffer holds none and must agree with it
    where it does (else TargetConflictError, nothing sent); ``run_id`` needs
    ``run`` when the buffer has several runs. ``mode="offline"`` writes a wandb
    offline run directory under ``directory`` (default: beside the buffer)
    for ``wandb sync`` to upload later. ``max_records`` and ``max_seconds``
    bound the invocation; the rest waits for the next one. ``wait`` is how
    long to wait for another syncer of this buffer to finish before raising
    SyncLockedError. ``progress`` is called with the number of records sent
    since its last call; ``on_run`` before each run's upload starts.

    Raises UploadError when W&B cannot be reached or fails: that run's
    records stay pending (runs synced before it in this call stay synced).

    A directory buffer (see walbuf.shards) is first brought into its hub:
    this host's live shards that nobody uses are sealed, and the records of
    every sealed shard and of this host's live ones are copied in; then the
    hub is synced. ``dry_run`` copies nothing: it counts what the hub holds
    per run, and the shards' records not yet in it as ``not_in_hub``.

    wandb reads its own settings (WANDB_BASE_URL, credentials) once per
    process: syncs in one process all talk to the server the first one did.
    """
    if mode not in MODES:
        raise ConfigError(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
    for name, value in (("max_records", max_records), ("max_seconds", max_seconds)):
        if value is not None and value <= 0:
            raise ConfigError(f"{name} must be positive, not {value!r}")
    layout = shards.Layout(buffer) if shards.is_directory(buffer) else None
    if layout is not None:
        if not layout.root.is_dir():
            raise BufferNotFoundError(f"no buffer at {layout.root}")
        storage = ingest.open_hub(layout)
    else:
        storage = Storage(buffer, create=False)
    try:
        lock = storage.lock("sync")
        if not lock.acquire(timeout=wait):
            raise SyncLockedError(_locked_message(storage, wait))
        try:
            if layout is not None and not dry_run:
                host = shards.host_name()
                shards.seal_idle(layout, host)
                ingest.ingest(layout, storage, host)
            syncer = _Syncer(storage, mode, directory, max_records, max_seconds, progress)
            chosen = syncer.runs_to_sync(run, run_id)
            result = SyncResult(runs=[], dry_run=dry_run)
            if layout is not None and dry_run:
                counts = [n for _, n in ingest.backlog(layout, shards.host_name())]
                result.not_in_hub = sum(n for n in counts if n is not None)
                result.unreadable_shards = counts.count(None)
            for name in chosen:
                if syncer.out_of_budget():
                    break
                plan = syncer.plan(name, Target(run_id, project, entity), dry_run)
                if plan is None:
                    continue
                if on_run is not None:
                    on_run(plan.report)
                if not dry_run:
                    syncer.upload(plan)
                result.runs.append(plan.report)
            return result
        finally:
            lock.release()
    finally:
        storage.dispose()


def _locked_message(storage: Storage, wait: float) -> str:
    with storage.begin_read() as conn:
        holder = conn.execute(
            sa.select(syncs.c.host, syncs.c.pid, syncs.c.started_at)
            .where(syncs.c.status == "running")
            .order_by(syncs.c.id.desc())
        ).first()
    who = ""
    if holder is not None:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.started_at))
        who = f" (process {holder.pid} on {holder.host}, since {started})"
    waited = f" and did not finish within {wait:g}s" if wait else ""
    return (
        f"another walbuf sync of {storage.location} is running{who}{waited};"
        " let it finish, or pass --wait SECONDS to wait for it"
    )


@dataclass
class _Plan:
    run_id: int
    report: RunSync
    writers: dict[int, _Writer]
    low: int  # every pending record of the run has an id above this
    high: int  # ... and at most this (the newest record when the sync began)
    sync_id: int = 0


class _Syncer:
    def __init__(
        self,
        storage: Storage,
        mode: str,
        directory: str | os.PathLike[str] | None,
        max_records: int | None,
        max_seconds: float | None,
        progress: Callable[[int], None] | None,
    ) -> None:
        self.storage = storage
        self.mode = mode
        # Only offline mode writes there.
        self.directory = Path.cwd()
        if directory is not None:
            self.directory = Path(directory)
        elif storage.path is not None:
            self.directory = storage.path.with_name(storage.path.name + ".wandb")
        elif mode == "offline":
            raise ConfigError(
                f"{storage.location} is not a file, so there is no folder beside it for the"
                " offline run: give one with --dir"
            )
        self.remaining = max_records
        self.deadline = None if max_seconds is None else time.monotonic() + max_seconds
        self.progress = progress

    def out_of_budget(self) -> bool:
        return (self.remaining is not None and self.remaining <= 0) or (
            self.deadline is not None and time.monotonic() >= self.deadline
        )

    def runs_to_sync(self, run: str | None, run_id: str | None) -> list[str]:
        with self.storage.begin_read() as conn:
            names = list(conn.scalars(sa.select(runs.c.name).order_by(runs.c.id)))
        if run is not None:
            if run not in names:
                known = ", ".join(repr(n) for n in names) or "none"
                raise ConfigError(f"no run {run!r} in {self.storage.location} (runs: {known})")
            return [run]
        if run_id is not None and len(names) > 1:
            raise ConfigError(
                f"--run-id names one W&B run, but {self.storage.location} holds {len(names)} runs;"
                " choose one with --run NAME"
            )
        return names

    def plan(self, name: str, overrides: Target, dry_run: bool) -> _Plan | None:
        """Fix the run's target and the extent of its upload; None if nothing is pending."""
        # The fence makes the newest id a sound upper bound: no record at or
        # below it can still appear (see walbuf.backends).
        write = self.storage.begin_read() if dry_run else self.storage.begin_write(fence=True)
        with write as conn:
            run_id = conn.scalar(sa.select(runs.c.id).where(runs.c.name == name))
            found = {
                row.id: _Writer(row.id, row.name, row.step_axis, row.synced_id)
                for row in conn.execute(
                    sa.select(writers.c.id, writers.c.name, writers.c.step_axis, writers.c.synced_id)
                    .where(writers.c.run_id == run_id)
                )
            }
            if not found:
                return None
            low = min(w.synced_id for w in found.values())
            high = conn.scalar(sa.select(sa.func.max(records.c.id))) or 0
            counts = self._pending_counts(conn, found, low, high)
            pending = sum(counts.values())
            config_id = conn.scalar(sa.select(runs.c.config_id).where(runs.c.id == run_id))
            new_config = conn.scalar(
                sa.select(sa.func.count())
                .select_from(config_entries)
                .where(config_entries.c.writer_id.in_(list(found)), config_entries.c.id > config_id)
            )
            if pending == 0 and not new_config:
                return None
            target = self._target(conn, run_id, name, overrides, dry_run)
            report = RunSync(run=name, target=target, mode=self.mode)
            if self.remaining is not None and pending > self.remaining:
                high = self._id_of_nth_pending(conn, found, low, self.remaining)
                counts = self._pending_counts(conn, found, low, high)
            report.per_writer = {found[w].name: n for w, n in counts.items() if n}
            report.records = sum(counts.values())
            report.possibly_duplicated = self._interrupted(conn, run_id, found, low, high, dry_run)
            plan = _Plan(run_id, report, found, low, high)
            if not dry_run:
                plan.sync_id = conn.execute(
                    syncs.insert().values(
                        run_id=run_id,
                        mode=self.mode,
                        status="running",
                        started_at=time.time(),
                        last_id=high,
                        records=report.records,
                        host=socket.gethostname(),
                        pid=os.getpid(),
                    )
                ).inserted_primary_key[0]
            return plan

    @staticmethod
    def _pending_filter(found: dict[int, _Writer], low: int, high: int) -> sa.ColumnElement[bool]:
        """Records of these writers past their cursors, with low < id <= high."""
        cursor = sa.case({w.id: w.synced_id for w in found.values()}, value=records.c.writer_id)
        return sa.and_(
            records.c.id > low,
            records.c.id <= high,
            records.c.writer_id.in_(list(found)),
            records.c.id > cursor,
        )

    def _pending_counts(self, conn: sa.Connection, found: dict[int, _Writer], low: int, high: int) -> dict[int, int]:
        query = (
            sa.select(records.c.writer_id, sa.func.count())
            .where(self._pending_filter(found, low, high))
            .group_by(records.c.writer_id)
        )
        return {writer_id: n for writer_id, n in conn.execute(query)}

    def _id_of_nth_pending(self, conn: sa.Connection, found: dict[int, _Writer], low: int, n: int) -> int:
        query = (
            sa.select(records.c.id)
            .where(self._pending_filter(found, low, 2**62))
            .order_by(records.c.id)
            .offset(n - 1)
            .limit(1)
        )
        return conn.scalar(query)

    def _target(self, conn: sa.Connection, run_id: int, name: str, overrides: Target, dry_run: bool) -> Target:
        target = merge_target(read_target(conn, run_id), overrides, name)
        if dry_run:
            return target
        if target.wandb_id is None:
            # Stored before the upload, so that a retry goes to the same W&B run.
            target = replace(target, wandb_id=generate_run_id())
        return set_target(conn, run_id, name, target)

    def _interrupted(
        self, conn: sa.Connection, run_id: int, found: dict[int, _Writer], low: int, high: int, dry_run: bool
    ) -> int:
        """Close the entries of syncs of this run that died mid-upload; count what they may have sent."""
        cut_off = sa.and_(syncs.c.run_id == run_id, syncs.c.status == "running")
        reach = conn.scalar(sa.select(sa.func.max(syncs.c.last_id)).where(cut_off))
        if reach is None:
            return 0
        if not dry_run:
            conn.execute(
                syncs.update()
                .where(cut_off)
                .values(status="interrupted", message="the syncer died during the upload")
            )
        return sum(self._pending_counts(conn, found, low, min(reach, high)).values())

    def _pending(self, plan: _Plan) -> Iterator[tuple[_Writer, int, int, float, str]]:
        """The plan's records in id order, read in short snapshots."""
        after = plan.low
        while True:
            query = (
                sa.select(records.c.id, records.c.writer_id, records.c.step, records.c.time, records.c.metrics)
                .where(self._pending_filter(plan.writers, after, plan.high))
                .order_by(records.c.id)
                .limit(READ_CHUNK)
            )
            with self.storage.begin_read() as conn:
                chunk = conn.execute(query).all()
            if not chunk:
                return
            for row in chunk:
                yield plan.writers[row.writer_id], row.id, row.step, row.time, row.metrics
            after = chunk[-1].id

    def _config(self, plan: _Plan) -> tuple[dict[str, dict[str, object]], list[ConfigChange], int]:
        """The run's config and summary (kind -> each key's latest value), config changed since the last sync, the newest entry's id."""
        with self.storage.begin_read() as conn:
            synced = conn.scalar(sa.select(runs.c.config_id).where(runs.c.id == plan.run_id))
            entries = conn.execute(
                sa.select(
                    config_entries.c.id,
                    config_entries.c.writer_id,
                    config_entries.c.kind,
                    config_entries.c.key,
                    config_entries.c.value,
                )
                .where(config_entries.c.writer_id.in_(list(plan.writers)))
                .order_by(config_entries.c.id)
            ).all()
        merged: dict[str, dict[str, object]] = {"config": {}, "summary": {}}
        setter: dict[str, str] = {}
        changes = []
        for entry_id, writer_id, kind, key, text in entries:
            value, writer, values = json.loads(text), plan.writers[writer_id].name, merged[kind]
            if kind == "config" and key in values and values[key] != value and entry_id > synced:
                changes.append(ConfigChange(key, setter[key], values[key], writer, value))
            values[key] = value
            if kind == "config":
                setter[key] = writer
        return merged, changes, entries[-1].id if entries else synced

    def upload(self, plan: _Plan) -> None:
        from .wandb_adapter import WandbRun

        report = plan.report
        merged, report.config_changes, config_id = self._config(plan)
        with self.storage.begin_read() as conn:
            offline_step = conn.scalar(sa.select(runs.c.offline_step).where(runs.c.id == plan.run_id))
        known = self._known_keys(plan)
        new_keys: set[tuple[int, str]] = set()
        try:
            wandb_run = WandbRun(report.target, report.run, self.mode, self.directory)
            if merged["config"]:
                # All of it, every time: W&B keeps the config of the latest update.
                wandb_run.update_config(merged["config"])
            for writer_id, key in sorted(known):
                writer = plan.writers[writer_id]
                wandb_run.define_metric(f"{writer.name}/{key}", f"{writer.name}/{writer.step_axis}")
            sent, last_sent, unreported = 0, plan.low, 0
            counts: dict[str, int] = {}
            for writer, record_id, step, wall_time, metrics in self._pending(plan):
                if self.out_of_budget():
                    break
                prefix = writer.name + "/"
                axis = prefix + writer.step_axis
                values = decode(metrics)
                for key in values:
                    if (writer.id, key) not in known:
                        wandb_run.define_metric(prefix + key, axis)
                        known.add((writer.id, key))
                        new_keys.add((writer.id, key))
                row: dict[str, object] = {prefix + key: value for key, value in values.items()}
                row[axis] = step
                # W&B's wall-clock axis shows when the record was logged, not synced.
                row["_timestamp"] = wall_time
                wandb_run.log(row, step=offline_step + sent if self.mode == "offline" else None)
                sent += 1
                last_sent = record_id
                counts[writer.name] = counts.get(writer.name, 0) + 1
                if self.remaining is not None:
                    self.remaining -= 1
                if self.progress is not None:
                    unreported += 1
                    if unreported >= 100:
                        self.progress(unreported)
                        unreported = 0
            if merged["summary"]:
                wandb_run.update_summary(merged["summary"])
            wandb_run.finish()
        except (UploadError, ConfigError) as exc:
            self._close_entry(plan, "failed", str(exc))
            raise
        if self.progress is not None and unreported:
            self.progress(unreported)
        report.records, report.per_writer = sent, counts
        report.target = wandb_run.target
        report.offline_dir = wandb_run.offline_dir
        with self.storage.begin_write() as conn:
            conn.execute(
                writers.update()
                .where(writers.c.id.in_(list(plan.writers)), writers.c.synced_id < last_sent)
                .values(synced_id=last_sent)
            )
            if new_keys:
                conn.execute(
                    metric_keys.insert(), [{"writer_id": w, "key": k} for w, k in sorted(new_keys)]
                )
            set_target(conn, plan.run_id, report.run, wandb_run.target)
            conn.execute(runs.update().where(runs.c.id == plan.run_id).values(config_id=config_id))
            if self.mode == "offline":
                conn.execute(
                    runs.update().where(runs.c.id == plan.run_id).values(offline_step=runs.c.offline_step + sent)
                )
            conn.execute(
                syncs.update()
                .where(syncs.c.id == plan.sync_id)
                .values(status="ok", finished_at=time.time(), records=sent, last_id=last_sent)
            )

    def _known_keys(self, plan: _Plan) -> set[tuple[int, str]]:
        with self.storage.begin_read() as conn:
            rows = conn.execute(
                sa.select(metric_keys.c.writer_id, metric_keys.c.key).where(
                    metric_keys.c.writer_id.in_(list(plan.writers))
                )
            )
            return {(w, k) for w, k in rows}

    def _close_entry(self, plan: _Plan, status: str, message: str) -> None:
        with self.storage.begin_write() as conn:
            conn.execute(
                syncs.update()
                .where(syncs.c.id == plan.sync_id)
                .values(status=status, finished_at=time.time(), message=message)
            )
