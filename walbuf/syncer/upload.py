"""Uploading one planned run: replay its records into wandb, then advance the cursors.

The records are replayed in the order they were committed, each as one
history row of the W&B run (see the key scheme in walbuf.syncer), with the
run's whole config first and its summary last. Only when wandb confirms the
upload are the writers' cursors advanced and the sync marked done, in one
transaction; a failed upload changes nothing but the sync's own log entry.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import sqlalchemy as sa

from ..errors import ConfigError, UploadError
from ..record import decode
from ..store import Storage
from ..store.schema import config_entries, metric_keys, records, runs, syncs, writers
from ..store.target import set_target
from .plan import Budget, Plan, PlanWriter, pending_filter
from .results import ConfigChange, RunSync, SyncMode

READ_CHUNK = 2000  # records per read transaction: short snapshots let the WAL checkpoint
PROGRESS_EVERY = 100  # records between calls of the progress callback


def upload(
    storage: Storage,
    plan: Plan,
    mode: SyncMode,
    directory: Path,
    budget: Budget,
    progress: Callable[[int], None] | None,
) -> RunSync:
    """Send the plan's records, within the budget; what was sent, once wandb confirmed it.

    Raises UploadError (W&B unreachable or failing) or ConfigError (refused
    credentials or settings) with nothing advanced; the sync's entry is
    marked failed.
    """
    from .wandb_run import WandbRun  # wandb is imported only when something is sent

    merged, changes, config_id = _config(storage, plan)
    with storage.begin_read() as conn:
        offline_step = conn.scalar(sa.select(runs.c.offline_step).where(runs.c.id == plan.run_id)) or 0
    known = _known_keys(storage, plan)
    new_keys: set[tuple[int, str]] = set()
    sent, last_sent, unreported = 0, plan.low, 0
    counts: dict[str, int] = {}
    try:
        wandb_run = WandbRun(plan.report.target, plan.report.run, mode, directory)
        if merged["config"]:
            # All of it, every time: W&B keeps the config of the latest update.
            wandb_run.update_config(merged["config"])
        for writer_id, key in sorted(known):
            writer = plan.writers[writer_id]
            wandb_run.define_metric(f"{writer.name}/{key}", f"{writer.name}/{writer.step_axis}")
        for writer, record_id, step, wall_time, metrics in _pending(storage, plan):
            if budget.spent():
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
            wandb_run.log(row, step=offline_step + sent if mode == "offline" else None)
            sent += 1
            last_sent = record_id
            counts[writer.name] = counts.get(writer.name, 0) + 1
            budget.take()
            if progress is not None:
                unreported += 1
                if unreported >= PROGRESS_EVERY:
                    progress(unreported)
                    unreported = 0
        if merged["summary"]:
            wandb_run.update_summary(merged["summary"])
        wandb_run.finish()
    except (UploadError, ConfigError) as exc:
        _close_entry(storage, plan, "failed", str(exc))
        raise
    if progress is not None and unreported:
        progress(unreported)
    with storage.begin_write() as conn:
        conn.execute(
            writers.update()
            .where(writers.c.id.in_(list(plan.writers)), writers.c.synced_id < last_sent)
            .values(synced_id=last_sent)
        )
        if new_keys:
            conn.execute(metric_keys.insert(), [{"writer_id": w, "key": k} for w, k in sorted(new_keys)])
        set_target(conn, plan.run_id, plan.report.run, wandb_run.target)
        conn.execute(runs.update().where(runs.c.id == plan.run_id).values(config_id=config_id))
        if mode == "offline":
            conn.execute(
                runs.update().where(runs.c.id == plan.run_id).values(offline_step=runs.c.offline_step + sent)
            )
        conn.execute(
            syncs.update()
            .where(syncs.c.id == plan.sync_id)
            .values(status="ok", finished_at=time.time(), records=sent, last_id=last_sent)
        )
    return replace(
        plan.report,
        records=sent,
        per_writer=counts,
        target=wandb_run.target,
        offline_dir=wandb_run.offline_dir,
        config_changes=tuple(changes),
    )


def _pending(storage: Storage, plan: Plan) -> Iterator[tuple[PlanWriter, int, int, float, str]]:
    """The plan's records in id order, read in short snapshots."""
    after = plan.low
    while True:
        query = (
            sa.select(records.c.id, records.c.writer_id, records.c.step, records.c.time, records.c.metrics)
            .where(pending_filter(plan.writers, after, plan.high))
            .order_by(records.c.id)
            .limit(READ_CHUNK)
        )
        with storage.begin_read() as conn:
            chunk = conn.execute(query).all()
        if not chunk:
            return
        for row in chunk:
            yield plan.writers[row.writer_id], row.id, row.step, row.time, row.metrics
        after = chunk[-1].id


def _config(storage: Storage, plan: Plan) -> tuple[dict[str, dict[str, object]], list[ConfigChange], int]:
    """The run's config and summary (kind -> each key's latest value), config changed since the last sync, the newest entry's id."""
    with storage.begin_read() as conn:
        synced = conn.scalar(sa.select(runs.c.config_id).where(runs.c.id == plan.run_id)) or 0
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


def _known_keys(storage: Storage, plan: Plan) -> set[tuple[int, str]]:
    with storage.begin_read() as conn:
        rows = conn.execute(
            sa.select(metric_keys.c.writer_id, metric_keys.c.key).where(metric_keys.c.writer_id.in_(list(plan.writers)))
        )
        return {(w, k) for w, k in rows}


def _close_entry(storage: Storage, plan: Plan, status: str, message: str) -> None:
    with storage.begin_write() as conn:
        conn.execute(
            syncs.update()
            .where(syncs.c.id == plan.sync_id)
            .values(status=status, finished_at=time.time(), message=message)
        )
