"""Uploading one planned run: replay its records into wandb, then advance the cursors.

The records are replayed in the order they were committed, each as one
history row of the W&B run (keys and step axis under the writer's prefix),
with the run's whole config and metric definitions first and its whole
summary last (see walbuf.syncer.metrics). Only when wandb confirms the
upload are the writers' cursors advanced and the sync marked done, in one
transaction; a failed upload changes nothing but the sync's own log entry.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import sqlalchemy as sa

from ..errors import (
    MetricTypeError,
    MetricValueError,
    StorageError,
    TargetRefusedError,
    UploadError,
)
from ..record import (
    LINE_OVERHEAD,
    MAX_LINE_BYTES,
    PLAIN_TYPES,
    Stored,
    check_line,
    decode,
    encode,
    encode_config,
    flatten,
    line_room,
)
from ..store import Storage, Target
from ..store.schema import config_entries, records, runs, syncs
from ..store.storage import Confirmed
from .budget import Budget, OutOfTime
from .kept import KeptRuns
from .metrics import RunMetrics
from .plan import Plan, PlanWriter, pending_filter
from .results import ConfigChange, Quarantined, RefusedSetting, RunSync, SyncMode
from .wandb import RowRefused, WandbRun  # it imports wandb itself, when a run is opened

READ_CHUNK = 2000  # records per read transaction: short snapshots let the WAL checkpoint
_KNOWN_MAX = 10_000  # record shapes remembered per upload
BATCH = 500  # records made ready at a time; the progress callback is called after each batch


class _Ready(NamedTuple):
    """A record made ready to send: its history row, the definitions it newly needs, or why W&B would refuse it."""

    row: dict[str, object]
    needed: Sequence[tuple[str, str]]
    problem: str | None  # None: fine to send


class _Shape(NamedTuple):
    """What a record of known keys found fine before becomes (see _Replay._prepare's shortcut)."""

    keys: tuple[str, ...]  # its row's keys, then the step axis, _timestamp and _runtime
    room: int  # the longest stored payload of those keys that fits a history line


class RunSink(Protocol):
    """What an upload needs of the W&B run it sends into: walbuf.syncer.wandb.WandbRun, or a test's stand-in.

    Each method raises what WandbRun's raises: RowRefused for one row wandb
    refuses, UploadError, ConfigError or TargetRefusedError for the upload.
    Opening one that fails leaves nothing open: WandbRun ends wandb's
    service, and with it every run kept open there.
    """

    @property
    def target(self) -> Target: ...

    @property
    def offline_dir(self) -> str | None: ...

    def define_metric(self, key: str, step_metric: str) -> None: ...

    def update_summary(self, summary: dict[str, Any]) -> None: ...

    def log(self, row: dict[str, Any], step: int | None = None) -> dict[str, Any]: ...

    def batched(self) -> AbstractContextManager[None]: ...

    def keep_pace(self) -> None: ...

    def mark_preempting(self) -> None: ...

    @property
    def keepable(self) -> bool: ...

    def settle(self) -> None: ...

    def finish(self, exit_code: int | None = None) -> None: ...

    def abandon(self) -> None: ...


class OpenRun(Protocol):
    """Opens the run an upload sends into (WandbRun's constructor; see it for the arguments)."""

    def __call__(
        self,
        target: Target,
        name: str | None,
        mode: SyncMode,
        directory: Path,
        *,
        config: dict[str, Any] | None = None,
        init_timeout: float = 90.0,
        finish_state: bool = False,
    ) -> RunSink: ...


def upload(
    storage: Storage,
    plan: Plan,
    mode: SyncMode,
    directory: Path,
    budget: Budget,
    progress: Callable[[int], None] | None,
    *,
    on_open: Callable[[RunSync], None] | None = None,
    finish_code: int | None = None,
    more_soon: bool = False,
    open_run: OpenRun = WandbRun,
    keeper: KeptRuns[RunSink] | None = None,
) -> RunSync:
    """Send the plan's records, within the budget, into the run ``open_run`` opens; what was sent, once wandb confirmed
    it.

    With ``finish_code``, the upload also finishes the W&B run with that exit
    code (its job is done: see walbuf.syncer.finish), unless the budget cut
    it short; else it leaves the run's state alone, but for marking it
    preempting (the job goes on; see walbuf.syncer.finish) unless
    ``more_soon``: another upload follows within seconds (``sync --follow``),
    and W&B shows the run running meanwhile. ``on_open`` is called with the
    plan's report once wandb has opened the run (credentials and target
    accepted), before any record is handed over.

    A record W&B would refuse for good (it breaks walbuf's rules for what
    W&B takes, as an older walbuf let in, or wandb refuses its data) is
    quarantined: not sent, kept in the buffer with the reason, passed by its
    writer's cursor. The records after it go on.

    Raises UploadError (W&B unreachable or failing: retry later),
    ConfigError (what a retry cannot fix), OutOfTime (the budget's hard
    stop) or KeyboardInterrupt with nothing advanced and nothing
    quarantined; the sync's entry is closed as failed or interrupted, as far
    as records were handed to wandb. A TargetRefusedError also marks the
    run's target refused, so that no later sync uses it again.
    """
    merged, changes, refused_settings, config_id = _config(storage, plan)
    replay = _Replay(storage, plan, mode, budget, progress)
    name = plan.report.run
    # A follow's run whose job goes on is kept open for its next pass (walbuf.syncer.kept).
    keeping = keeper if finish_code is None and mode == "online" else None
    own_folder: Path | None = None  # the run's folder under the keeper's, whenever keeping
    try:
        with budget.hard_stop():
            taken = keeping.take(name, plan.report.target.wandb_id, config_id) if keeping is not None else None
            if taken is not None:
                wandb_run, own_folder = taken
            else:
                if keeping is not None:
                    own_folder = directory = keeping.new_folder()
                try:
                    wandb_run = open_run(
                        plan.report.target,
                        # The display name is given once, when the W&B run is made: a
                        # later sync would undo a rename made in W&B.
                        name if plan.new_run else None,
                        mode,
                        directory,
                        # The whole config from the start: W&B keeps the latest update's.
                        config=merged["config"],
                        init_timeout=budget.init_timeout(),
                        finish_state=finish_code is not None,
                    )
                except BaseException:
                    if keeper is not None:
                        keeper.forget()  # a run that failed to open ended wandb's service, and every run kept in it
                    raise
            try:
                if on_open is not None:
                    on_open(plan.report)
                replay.into(wandb_run, merged)
                if finish_code is None and mode == "online" and not more_soon:
                    # The job goes on: say so, or W&B marks the run crashed once
                    # it has heard nothing for 5 minutes (walbuf.syncer.finish).
                    wandb_run.mark_preempting()
                if keeping is not None and own_folder is not None and wandb_run.keepable:
                    wandb_run.settle()
                    keeping.keep(name, wandb_run, config_id, own_folder)
                else:
                    wandb_run.finish(exit_code=finish_code)
            except BaseException:
                # Left open, wandb's service would keep the run in this process
                # ("run ID ... is in use" to the next upload of it); cut off in
                # finish() (Ctrl-C, SIGTERM, the budget's hard stop), it would
                # still be sending, and wandb's exit hook would wait for it.
                wandb_run.abandon()
                if keeper is not None:
                    keeper.forget()  # abandon() ended wandb's service, and every run kept in it
                raise
    except BaseException as exc:
        _close_failed(storage, plan, replay, exc)
        raise
    finally:
        if keeping is not None and own_folder is not None:
            keeping.done_with(own_folder)  # removed unless the run was kept
    return _confirm(storage, plan, replay, wandb_run, config_id, finish_code, mode, tuple(changes), refused_settings)


def _close_failed(storage: Storage, plan: Plan, replay: _Replay, exc: BaseException) -> None:
    """Close the sync's entry of an upload that ``exc`` ended, as far as records were handed to wandb (unless the
    buffer itself is what failed).

    Ctrl-C, or SIGTERM as the command turns it into a KeyboardInterrupt, is
    an interruption; what a retry fixes by itself (exit 75) is
    "unreachable": no person is needed.
    """
    interrupted = isinstance(exc, KeyboardInterrupt)
    why = f"interrupted ({str(exc) or 'Ctrl-C'})" if interrupted else str(exc) or type(exc).__name__
    with contextlib.suppress(StorageError):
        reached = max(replay.last_handled, replay.handed)
        retry = isinstance(exc, (UploadError, OutOfTime))
        _failed(storage, plan, "interrupted" if interrupted else "unreachable" if retry else "failed", why, reached)
        if isinstance(exc, TargetRefusedError):
            _refuse_target(storage, plan, str(exc))


def _confirm(
    storage: Storage,
    plan: Plan,
    replay: _Replay,
    wandb_run: RunSink,
    config_id: int,
    finish_code: int | None,
    mode: SyncMode,
    changes: tuple[ConfigChange, ...],
    refused_settings: Sequence[RefusedSetting],
) -> RunSync:
    """Mark what wandb confirmed synced, in one transaction; the upload's report."""
    replay.report_progress()
    storage.confirm_upload(
        Confirmed(
            run_id=plan.run_id,
            sync_id=plan.sync_id,
            writer_ids=tuple(plan.writers),
            last_handled=replay.last_handled,
            quarantined=tuple((rid, q.reason) for rid, q in replay.quarantined),
            sent=replay.sent,
            run_name=plan.report.run,
            target=wandb_run.target,
            config_id=config_id,
            finished_exit=finish_code,
            mode=mode,
        ),
        also=replay.metrics.save,
    )
    return replace(
        plan.report,
        records=replay.sent,
        per_writer=replay.counts,
        target=wandb_run.target,
        offline_dir=wandb_run.offline_dir,
        config_changes=changes,
        quarantined=tuple(q for _, q in replay.quarantined),
        refused_settings=(*refused_settings, *replay.summary_left_out),
        cut_short=replay.sent + len(replay.quarantined) < plan.report.records,
        finished=finish_code,
    )


class _Replay:
    """The replay of one plan's records into a wandb run, and what it did so far."""

    def __init__(
        self, storage: Storage, plan: Plan, mode: SyncMode, budget: Budget, progress: Callable[[int], None] | None
    ) -> None:
        self.storage, self.plan, self.mode, self.budget, self.progress = storage, plan, mode, budget, progress
        with storage.begin_read() as conn:
            self.offline_step = conn.scalar(sa.select(runs.c.offline_step).where(runs.c.id == plan.run_id)) or 0
            self.metrics = RunMetrics(conn, plan.run_id, plan.writers.values())
        self.quarantined: list[tuple[int, Quarantined]] = []
        self.summary_left_out: list[RefusedSetting] = []
        self.counts: dict[str, int] = {}
        self.sent = 0
        self.last_handled = plan.low  # the id of the last record sent or quarantined
        self.handed = plan.low  # the id of the last record handed to wandb (its log() may not have returned)
        self.unreported = 0
        # (writer id, *a record's keys) -> its shape, for records found fine that hold plain values only
        self._known: dict[tuple[object, ...], _Shape] = {}

    def into(self, wandb_run: RunSink, merged: dict[str, dict[str, object]]) -> None:
        """The metric definitions the run has (its config went with wandb.init), the records, the whole summary."""
        for name, step_metric in self.metrics.definitions():
            # All of them, every time, before the first row: W&B keeps the
            # latest config's definitions (see walbuf.syncer.metrics).
            wandb_run.define_metric(name, step_metric)
        after = self.plan.low
        # Each chunk in a snapshot of its own (short snapshots let the WAL
        # checkpoint), all on one connection.
        with self.storage.reads() as read:
            while not self.budget.spent():
                chunk = read(_pending(self.plan, after, self.budget.at_most(READ_CHUNK)))
                if not chunk:
                    break
                for start in range(0, len(chunk), BATCH):
                    if not self._send_batch(wandb_run, chunk[start : start + BATCH]):
                        break
                after = chunk[-1].id
        summary = self._fitting(self.metrics.summary(merged["summary"]))
        if summary:
            wandb_run.update_summary(summary)

    def _fitting(self, summary: dict[str, object]) -> dict[str, object]:
        """``summary`` less its largest values, until it fits one line (a person is told of each left out).

        wandb-core sends the whole summary as one line of wandb-summary.json
        and skips a line over its limit with only a WARN in its own log
        (core/internal/filestream/filestreamstate.go): the summary would not
        change at all, and nobody would know.
        """
        sizes = {key: len(encode({key: value})) for key, value in summary.items()}
        room = MAX_LINE_BYTES - LINE_OVERHEAD
        total = sum(sizes.values())
        for key in sorted(sizes, key=sizes.__getitem__, reverse=True):
            if total <= room:
                break
            total -= sizes[key]
            del summary[key]
            self.summary_left_out.append(
                RefusedSetting(
                    "summary",
                    key,
                    "the run",
                    f"the summary would pass W&B's line limit of {MAX_LINE_BYTES:,} bytes, and this value takes"
                    f" {sizes[key]:,} of them: W&B would skip the whole summary",
                )
            )
        return summary

    def _send_batch(self, wandb_run: RunSink, batch: Sequence[sa.Row[tuple[int, int, int, float, str]]]) -> bool:
        """Send (or quarantine) the records of ``batch`` in order, within the budget; whether they all were handled."""
        # The batch's rows are all made ready before the first goes to wandb,
        # so that the wandb.log calls come back to back: each one waits for
        # wandb's own thread, and work done between two calls makes that wait
        # longer (docs/performance.md).
        ready = [
            self._prepare(record.id, record.writer_id, record.step, record.time, record.metrics) for record in batch
        ]
        handled_all = True
        # And wandb gets them in one hand-off (WandbRun.batched).
        with wandb_run.batched():
            for record, prepared in zip(batch, ready, strict=True):
                if self.budget.spent():
                    handled_all = False
                    break
                writer = self.plan.writers[record.writer_id]
                problem = prepared.problem
                if problem is None:
                    self.handed = record.id  # from here on W&B may hold it, whatever ends the upload
                    problem = self._send(wandb_run, writer, prepared.row, prepared.needed)
                if problem is not None:
                    self.quarantined.append((record.id, Quarantined(writer.name, record.step, problem)))
                self.last_handled = record.id
                self.budget.take()
                self.unreported += 1
        if self.budget.deadline is not None:
            # Handed over faster than wandb-core takes them in, rows would
            # wait in it for run.finish(), past the reserve the bound keeps.
            wandb_run.keep_pace()
        self.report_progress()
        return handled_all

    def _prepare(self, record_id: int, writer_id: int, step: int, wall_time: float, metrics: str) -> _Ready:
        """One record as a history row, the definitions it newly needs, why W&B would refuse it for good (or None).

        Claims its keys for its writer's axis (see walbuf.syncer.metrics).
        """
        try:
            values = decode(metrics)
        except (ValueError, RecursionError) as exc:  # a buffer is untrusted input: what a writer cannot have written
            return _Ready({}, (), f"its stored metrics are not JSON walbuf writes ({type(exc).__name__}: {exc})")
        if type(values) is not dict:
            return _Ready({}, (), "its stored metrics are not a JSON object")
        writer = self.plan.writers[writer_id]
        # A record logged with an axis value (Writer.log's ``axis``) holds it
        # under the step axis's name: W&B plots it there instead of the step.
        at = values.pop(writer.step_axis, step)
        if type(at) is not int or at < 0:
            return _Ready({}, (), f"its value on the step axis {writer.step_axis!r} is not an int >= 0")
        shape = (writer_id, *values)
        known = self._known.get(shape)
        if known is not None and len(metrics) <= known.room and PLAIN_TYPES.issuperset(map(type, values.values())):
            # The common case: the keys of a record of this writer found fine
            # before, plain values, and a payload that fits the line. Every
            # check would pass as it did then.
            timing = (wall_time, self._runtime(wall_time))
            return _Ready(dict(zip(known.keys, (*values.values(), at, *timing), strict=True)), (), None)
        problem = _breaks_the_rules(values, metrics, writer)
        if problem is not None:
            return _Ready({}, (), problem)
        problem, needed = self.metrics.check(writer, values)
        if problem is not None:
            return _Ready({}, (), problem)
        prefix = writer.key_prefix
        # Without a prefix the decoded record (a dict of its own) is the row.
        row: dict[str, object] = {prefix + key: value for key, value in values.items()} if prefix else values
        if PLAIN_TYPES.issuperset(map(type, values.values())) and len(self._known) < _KNOWN_MAX:
            self._known[shape] = _Shape(
                (*row, writer.axis, "_timestamp", "_runtime"), line_room(len(values) + 1, writer.prefix + "/")
            )
        row[writer.axis] = at
        # W&B's wall-clock axis shows when the record was logged, not synced.
        row["_timestamp"] = wall_time
        # And W&B's runtime, the job's: how long after the run began (a
        # whole row goes past wandb-core's handler, which would write the
        # uploader's; see Batcher.log).
        row["_runtime"] = self._runtime(wall_time)
        return _Ready(row, needed, None)

    def _runtime(self, wall_time: float) -> float:
        """Seconds from the run's start to ``wall_time`` (0 for a record of a clock behind the first writer's)."""
        return max(0.0, wall_time - self.plan.started)

    def _send(
        self, wandb_run: RunSink, writer: PlanWriter, row: dict[str, object], needed: Sequence[tuple[str, str]]
    ) -> str | None:
        """Send one prepared row; why wandb refused it, if it did (then nothing was sent)."""
        try:
            for name, step_metric in needed:
                wandb_run.define_metric(name, step_metric)
            images = wandb_run.log(row, step=self.offline_step + self.sent if self.mode == "offline" else None)
        except RowRefused as exc:
            return str(exc)
        self.metrics.sent.update(row)
        if images:
            self.metrics.sent.update(images)  # the summary refers to the files uploaded, not the PNGs again
        self.sent += 1
        self.counts[writer.name] = self.counts.get(writer.name, 0) + 1
        return None

    def report_progress(self) -> None:
        if self.progress is not None and self.unreported:
            self.progress(self.unreported)
        self.unreported = 0


def _breaks_the_rules(values: dict[str, Stored], metrics: str, writer: PlanWriter) -> str | None:
    """Why W&B would refuse a stored record for good (what log() refuses today), or None.

    A buffer may hold records an older walbuf let in: they are checked
    again here, with the same rules.
    """
    try:
        flatten(values, writer.step_axis)
        check_line(metrics, values, writer.prefix + "/")
    except (MetricTypeError, MetricValueError) as exc:
        return exc.problem
    return None


def _failed(storage: Storage, plan: Plan, status: str, message: str, last_handled: int) -> None:
    """Close the sync's entry as ``status``, reaching as far as records were handed to wandb.

    The next sync counts the pending records up to there as possibly
    delivered (W&B may then hold them twice).
    """
    with storage.begin_write() as conn:
        conn.execute(
            syncs.update()
            .where(syncs.c.id == plan.sync_id)
            .values(status=status, finished_at=time.time(), message=message, last_id=last_handled)
        )


def _refuse_target(storage: Storage, plan: Plan, message: str) -> None:
    """No later sync uses the run's target again, until one gives another (see plan._target)."""
    with storage.begin_write() as conn:
        conn.execute(runs.update().where(runs.c.id == plan.run_id).values(target_refused=message))


def _pending(plan: Plan, after: int, limit: int) -> sa.Select[tuple[int, int, int, float, str]]:
    """The query of the next ``limit`` records of the plan past id ``after``, in id order: (id, writer id, step, time,
    metrics)."""
    return (
        sa.select(records.c.id, records.c.writer_id, records.c.step, records.c.time, records.c.metrics)
        .where(pending_filter(plan.writers, after, plan.high))
        .order_by(records.c.id)
        .limit(limit)
    )


def _config(
    storage: Storage, plan: Plan
) -> tuple[dict[str, dict[str, object]], list[ConfigChange], list[RefusedSetting], int]:
    """The run's config and summary (kind -> each key's latest value), what changed or was refused since the last sync,
    the newest entry's id.

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
        writer, values = plan.writers[writer_id].name, merged[kind]
        try:
            value = json.loads(text)
        except (ValueError, RecursionError) as exc:  # untrusted input, as a record's metrics
            if entry_id > synced:
                refused.append(RefusedSetting(kind, key, writer, f"its stored value is not JSON walbuf writes ({exc})"))
            continue
        try:
            encode_config({key: value}, kind)
        except (MetricTypeError, MetricValueError) as exc:
            if entry_id > synced:
                refused.append(RefusedSetting(kind, key, writer, exc.problem))
            continue
        if kind == "config" and key in values and values[key] != value and entry_id > synced:
            changes.append(ConfigChange(key, setter[key], values[key], writer, value))
        values[key] = value
        if kind == "config":
            setter[key] = writer
    return merged, changes, refused, entries[-1].id if entries else synced
