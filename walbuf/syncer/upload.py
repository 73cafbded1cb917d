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

from ..errors import (
    ConfigError,
    MetricTypeError,
    MetricValueError,
    TargetRefusedError,
    UploadError,
    WalbufError,
)
from ..record import Value, check_line, decode, encode_config, flatten
from ..store import Storage
from ..store.schema import config_entries, metric_keys, quarantine, records, runs, syncs, writers
from ..store.target import set_target
from .plan import Budget, Plan, PlanWriter, pending_filter
from .results import ConfigChange, Quarantined, RefusedSetting, RunSync, SyncMode

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

    A record W&B would refuse for good (it breaks walbuf's rules for what
    W&B takes, as an older walbuf let in, or wandb refuses its data) is
    quarantined: not sent, kept in the buffer with the reason, passed by its
    writer's cursor. The records after it go on.

    Raises UploadError (W&B unreachable or failing: retry later) or
    ConfigError (what a retry cannot fix) with nothing advanced and nothing
    quarantined; the sync's entry is marked failed, as far as records were
    handed to wandb. A TargetRefusedError also marks the run's target
    refused, so that no later sync uses it again.
    """
    from .wandb_run import RowRefused, WandbRun  # wandb is imported only when something is sent

    merged, changes, refused_settings, config_id = _config(storage, plan)
    with storage.begin_read() as conn:
        offline_step = conn.scalar(sa.select(runs.c.offline_step).where(runs.c.id == plan.run_id)) or 0
    known = _known_keys(storage, plan)
    new_keys: set[tuple[int, str]] = set()
    quarantined: list[tuple[int, Quarantined]] = []
    sent, last_handled, unreported = 0, plan.low, 0
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
            problem = _breaks_the_rules(values, metrics, writer)
            if problem is None:
                new = [key for key in values if (writer.id, key) not in known]
                try:
                    for key in new:
                        wandb_run.define_metric(prefix + key, axis)
                    row: dict[str, object] = {prefix + key: value for key, value in values.items()}
                    row[axis] = step
                    # W&B's wall-clock axis shows when the record was logged, not synced.
                    row["_timestamp"] = wall_time
                    wandb_run.log(row, step=offline_step + sent if mode == "offline" else None)
                except RowRefused as exc:
                    problem = str(exc)
                else:
                    known.update((writer.id, key) for key in new)
                    new_keys.update((writer.id, key) for key in new)
                    sent += 1
                    counts[writer.name] = counts.get(writer.name, 0) + 1
            if problem is not None:
                quarantined.append((record_id, Quarantined(writer.name, step, problem)))
            last_handled = record_id
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
        _failed(storage, plan, exc, last_handled)
        raise
    if progress is not None and unreported:
        progress(unreported)
    now = time.time()
    with storage.begin_write() as conn:
        conn.execute(
            writers.update()
            .where(writers.c.id.in_(list(plan.writers)), writers.c.synced_id < last_handled)
            .values(synced_id=last_handled)
        )
        if new_keys:
            conn.execute(metric_keys.insert(), [{"writer_id": w, "key": k} for w, k in sorted(new_keys)])
        if quarantined:
            conn.execute(
                quarantine.insert(), [{"record_id": rid, "reason": q.reason, "time": now} for rid, q in quarantined]
            )
        set_target(conn, plan.run_id, plan.report.run, wandb_run.target)
        conn.execute(runs.update().where(runs.c.id == plan.run_id).values(config_id=config_id, target_refused=None))
        if mode == "offline":
            conn.execute(
                runs.update().where(runs.c.id == plan.run_id).values(offline_step=runs.c.offline_step + sent)
            )
        conn.execute(
            syncs.update()
            .where(syncs.c.id == plan.sync_id)
            .values(status="ok", finished_at=now, records=sent, last_id=last_handled)
        )
    return replace(
        plan.report,
        records=sent,
        per_writer=counts,
        target=wandb_run.target,
        offline_dir=wandb_run.offline_dir,
        config_changes=tuple(changes),
        quarantined=tuple(q for _, q in quarantined),
        refused_settings=tuple(refused_settings),
    )


def _breaks_the_rules(values: dict[str, Value], metrics: str, writer: PlanWriter) -> str | None:
    """Why W&B would refuse a stored record for good (what log() refuses today), or None.

    A buffer may hold records an older walbuf let in: they are checked
    again here, with the same rules.
    """
    try:
        flatten(values, writer.step_axis)
        check_line(metrics, len(values), writer.name + "/")
    except (MetricTypeError, MetricValueError) as exc:
        return str(exc).replace(" (nothing was written)", "")
    return None


def _failed(storage: Storage, plan: Plan, exc: WalbufError, last_handled: int) -> None:
    """Mark the sync's entry failed, reaching as far as records were handed to wandb; a refused target too."""
    with storage.begin_write() as conn:
        conn.execute(
            syncs.update()
            .where(syncs.c.id == plan.sync_id)
            .values(status="failed", finished_at=time.time(), message=str(exc), last_id=last_handled)
        )
        if isinstance(exc, TargetRefusedError):
            conn.execute(runs.update().where(runs.c.id == plan.run_id).values(target_refused=str(exc)))


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


def _config(
    storage: Storage, plan: Plan
) -> tuple[dict[str, dict[str, object]], list[ConfigChange], list[RefusedSetting], int]:
    """The run's config and summary (kind -> each key's latest value), what changed or was refused since the last sync, the newest entry's id.

    An entry W&B would refuse (what Writer.config() refuses today; an older
    walbuf let it in) is left out.
    """
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
    refused = []
    for entry_id, writer_id, kind, key, text in entries:
        value, writer, values = json.loads(text), plan.writers[writer_id].name, merged[kind]
        try:
            encode_config({key: value}, kind)
        except (MetricTypeError, MetricValueError) as exc:
            if entry_id > synced:
                refused.append(RefusedSetting(kind, key, writer, str(exc).replace(" (nothing was stored)", "")))
            continue
        if kind == "config" and key in values and values[key] != value and entry_id > synced:
            changes.append(ConfigChange(key, setter[key], values[key], writer, value))
        values[key] = value
        if kind == "config":
            setter[key] = writer
    return merged, changes, refused, entries[-1].id if entries else synced


def _known_keys(storage: Storage, plan: Plan) -> set[tuple[int, str]]:
    with storage.begin_read() as conn:
        rows = conn.execute(
            sa.select(metric_keys.c.writer_id, metric_keys.c.key).where(metric_keys.c.writer_id.in_(list(plan.writers)))
        )
        return {(w, k) for w, k in rows}


