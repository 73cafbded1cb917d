"""Planning a sync: which runs, their W&B target, and the extent of each upload.

A plan fixes, in one write transaction behind the fence (see
walbuf.store.backend), the run's pending records up to the newest one at
that moment (and at most the budget's records), stores a generated W&B run
id before anything is sent (so that a retry goes to the same run), closes
the entries of uploads a dead syncer left "running" (counting what they may
have delivered), and notes the new upload as running.
"""

from __future__ import annotations

import functools
import os
import secrets
import socket
import string
import time
from dataclasses import asdict, astuple, dataclass, replace

import sqlalchemy as sa

from ..errors import ConfigError, TargetRefusedError
from ..store import Storage, Target
from ..store.claims import wandb_key
from ..store.schema import config_entries, cursors, inserted_id, pending, records, runs, syncs, writers
from ..store.target import merge_target, read_target, set_target
from .budget import Budget
from .results import RunSync, SyncMode


def generate_run_id() -> str:
    """A new W&B run id: 8 random base-36 digits, as wandb makes them."""
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


@dataclass(frozen=True)
class PlanWriter:
    id: int
    name: str
    step_axis: str
    synced_id: int
    prefix: str  # what its keys and axis are prefixed with in W&B ("": none)

    def key(self, key: str) -> str:
        """The W&B history key of one of its keys."""
        return wandb_key(self.prefix, key)

    @functools.cached_property
    def axis(self) -> str:
        """The W&B history key of its step axis."""
        return wandb_key(self.prefix, self.step_axis)

    @functools.cached_property
    def key_prefix(self) -> str:
        """What its keys are prefixed with in W&B: "prefix/", or "" for none."""
        return wandb_key(self.prefix, "")


@dataclass(frozen=True)
class Plan:
    """One run's upload: its writers' records with ids in (low, high] past their cursors."""

    run_id: int
    report: RunSync
    writers: dict[int, PlanWriter]
    low: int  # every pending record of the run has an id above this
    high: int  # ... and at most this (the newest record when the sync began)
    sync_id: int  # its entry in the syncs table (0 in a dry run)
    new_run: bool  # no upload of the run has succeeded yet: the W&B run is made now
    started: float  # when the run's first writer opened: its records' _runtime counts from here


def runs_to_sync(storage: Storage, run: str | None, run_id: str | None, *, missing_ok: bool = False) -> list[str]:
    """The names of the runs to sync: ``run``, or all of them. A ``run`` not in the buffer: ConfigError, or none if
    ``missing_ok``."""
    with storage.begin_read() as conn:
        names = list(conn.scalars(sa.select(runs.c.name).order_by(runs.c.id)))
    if run is not None:
        if run not in names and missing_ok:
            return []
        if run not in names:
            known = ", ".join(repr(n) for n in names) or "none"
            raise ConfigError(f"no run {run!r} in {storage.location} (runs: {known})")
        return [run]
    if run_id is not None and len(names) > 1:
        raise ConfigError(
            f"--run-id names one W&B run, but {storage.location} holds {len(names)} runs; choose one with --run NAME"
        )
    return names


def plan(
    storage: Storage,
    name: str,
    overrides: Target,
    mode: SyncMode,
    budget: Budget,
    *,
    dry_run: bool,
    finishing: bool = False,
) -> Plan | None:
    """Fix the run's target and the extent of its upload; None if nothing is pending.

    ``finishing``: an upload even with nothing pending, to finish the W&B run
    (it sends the run's config, definitions and summary again, whole).
    """
    if dry_run:
        with storage.begin_read() as conn:
            survey = _survey(conn, name, budget, None, finishing)
            return None if survey is None else _settle(conn, survey, name, overrides, mode, dry_run=True)
    # The fence makes the newest id a sound upper bound: no record at or
    # below it can still appear (see walbuf.store.backend).
    with storage.begin_write(fence=True) as conn:
        high = conn.scalar(sa.select(sa.func.max(records.c.id))) or 0
    # Counting what is pending reads every pending record: in a read snapshot,
    # never while holding the write lock that writers wait for; the writes
    # follow once it has ended (a rollback-journal database, the hub, lets no
    # write commit while a read is open). Writers only add records above
    # ``high`` meanwhile, and this syncer holds the sync lock.
    with storage.begin_read() as conn:
        survey = _survey(conn, name, budget, high, finishing)
    if survey is None:
        return None
    # An upload whose confirmation found no room would be sent again whole
    # by the next sync: refuse it here, before anything is sent or written.
    storage.keep_room()
    with storage.begin_write() as conn:
        return _settle(conn, survey, name, overrides, mode, dry_run=False)


@dataclass(frozen=True)
class _Survey:
    """What an upload of a run covers, as read: before its target is fixed and its log entry written."""

    run_id: int
    writers: dict[int, PlanWriter]
    low: int
    high: int
    counts: dict[int, int]  # writer id -> pending records
    possibly_duplicated: int
    new_run: bool  # no upload of the run was confirmed yet
    started: float


def _survey(conn: sa.Connection, name: str, budget: Budget, high: int | None, finishing: bool) -> _Survey | None:
    """Read what an upload of the run covers, up to ``high`` (None: the newest record); None if nothing is pending."""
    run_id, started = conn.execute(sa.select(runs.c.id, runs.c.created_at).where(runs.c.name == name)).one()
    found = {
        row.id: PlanWriter(row.id, row.name, row.step_axis, row.synced_id, row.prefix)
        for row in conn.execute(
            sa.select(
                writers.c.id,
                writers.c.name,
                writers.c.step_axis,
                writers.c.synced_id,
                sa.func.coalesce(writers.c.prefix, writers.c.name).label("prefix"),
            ).where(writers.c.run_id == run_id)
        )
    }
    if not found:
        return None
    low = min(w.synced_id for w in found.values())
    if high is None:
        high = conn.scalar(sa.select(sa.func.max(records.c.id))) or 0
    counts = _pending_counts(conn, found, low, high)
    config_id = conn.scalar(sa.select(runs.c.config_id).where(runs.c.id == run_id))
    new_config = conn.scalar(
        sa.select(sa.func.count())
        .select_from(config_entries)
        .where(config_entries.c.writer_id.in_(list(found)), config_entries.c.id > config_id)
    )
    if sum(counts.values()) == 0 and not new_config and not finishing:
        return None
    if budget.remaining is not None and sum(counts.values()) > budget.remaining:
        high = _id_of_nth_pending(conn, found, low, budget.remaining)
        counts = _pending_counts(conn, found, low, high)
    new_run = (
        conn.scalar(
            sa.select(sa.func.count()).select_from(syncs).where(syncs.c.run_id == run_id, syncs.c.status == "ok")
        )
        == 0
    )
    possibly_duplicated = _possibly_delivered(conn, run_id, found, low, high)
    return _Survey(run_id, found, low, high, counts, possibly_duplicated, new_run, started)


def _settle(
    conn: sa.Connection, survey: _Survey, name: str, overrides: Target, mode: SyncMode, *, dry_run: bool
) -> Plan:
    """Fix the run's target and (unless ``dry_run``) write the upload's log entry; the plan."""
    target, new_target = _target(conn, survey.run_id, name, overrides, mode, dry_run)
    counts = survey.counts
    report = RunSync(
        run=name,
        target=target,
        mode=mode,
        records=sum(counts.values()),
        per_writer={survey.writers[w].name: n for w, n in counts.items() if n},
        possibly_duplicated=survey.possibly_duplicated,
    )
    sync_id = 0
    if not dry_run:
        _close_dead_syncs(conn, survey.run_id)
        sync_id = inserted_id(
            conn.execute(
                syncs.insert().values(
                    run_id=survey.run_id,
                    mode=mode,
                    status="running",
                    started_at=time.time(),
                    last_id=survey.high,
                    records=report.records,
                    host=socket.gethostname(),
                    pid=os.getpid(),
                )
            )
        )
    new_run = new_target or survey.new_run
    return Plan(survey.run_id, report, survey.writers, survey.low, survey.high, sync_id, new_run, survey.started)


def pending_filter(found: dict[int, PlanWriter], low: int, high: int) -> sa.ColumnElement[bool]:
    """Records of these writers past their cursors, with low < id <= high."""
    return sa.and_(
        records.c.id > low,
        records.c.id <= high,
        records.c.writer_id.in_(list(found)),
        pending(cursors({w.id: w.synced_id for w in found.values()})),
    )


def _pending_counts(conn: sa.Connection, found: dict[int, PlanWriter], low: int, high: int) -> dict[int, int]:
    query = (
        sa.select(records.c.writer_id, sa.func.count())
        .where(pending_filter(found, low, high))
        .group_by(records.c.writer_id)
    )
    return {writer_id: n for writer_id, n in conn.execute(query)}


def _id_of_nth_pending(conn: sa.Connection, found: dict[int, PlanWriter], low: int, n: int) -> int:
    query = (
        sa.select(records.c.id).where(pending_filter(found, low, 2**62)).order_by(records.c.id).offset(n - 1).limit(1)
    )
    return int(conn.scalar(query) or low)


def _target(
    conn: sa.Connection, run_id: int, name: str, overrides: Target, mode: SyncMode, dry_run: bool
) -> tuple[Target, bool]:
    """The run's W&B target, with ``overrides`` filling what it lacks, a run id generated if none; whether it is a new
    W&B run.

    A target W&B refused (runs.target_refused) is not used again: overrides
    replace it, and without any the run raises TargetRefusedError. A W&B
    run takes one mode (:func:`_check_mode`): another mode needs another
    W&B run id, which then replaces the stored one.
    """
    stored = read_target(conn, run_id)
    refused, stored_mode = conn.execute(sa.select(runs.c.target_refused, runs.c.mode).where(runs.c.id == run_id)).one()
    switching = _check_mode(name, stored, stored_mode, mode, overrides)
    replacing = switching or refused is not None  # what is given replaces what is stored
    if refused is not None and not switching and overrides == Target():
        raise TargetRefusedError(
            f"run {name!r} is not sent: W&B refused its target ({stored.shown()}) at an earlier sync:"
            f" {refused}; give another with --project, --entity or --run-id"
        )
    if replacing:
        target = Target(*(given or old for given, old in zip(astuple(overrides), astuple(stored), strict=True)))
    else:
        target = merge_target(stored, overrides, name)
    if dry_run:
        return target, switching
    if target.wandb_id is None:
        # Stored before the upload, so that a retry goes to the same W&B run.
        target = replace(target, wandb_id=generate_run_id())
    if not replacing:
        return set_target(conn, run_id, name, target), False
    # A new W&B run for another mode numbers its offline rows from 0.
    anew = {"mode": None, "offline_step": 0} if switching else {}
    conn.execute(runs.update().where(runs.c.id == run_id).values(**asdict(target), **anew))
    return target, switching


def _check_mode(name: str, stored: Target, stored_mode: str | None, mode: SyncMode, overrides: Target) -> bool:
    """Whether the run moves to a new W&B run for another mode; ConfigError if it would mix modes in one.

    W&B takes one mode per run: a shared-mode writer (an online sync) on a
    run whose history a non-shared writer made (`wandb sync` of an offline
    run) is refused or displaces rows, and the other way round as well
    (W&B calls it unsupported: wandb issue 12269; ../shared notes, "mixing
    modes").
    """
    if stored_mode is None or stored_mode == mode:
        return False
    if overrides.wandb_id is not None and overrides.wandb_id != stored.wandb_id:
        return True
    why = (
        "`wandb sync` of an offline run writes a non-shared history, and W&B refuses or displaces"
        " shared-mode writers on such a run"
        if stored_mode == "offline"
        else "its history was written in shared mode, and `wandb sync` of an offline run into it would displace rows"
    )
    raise ConfigError(
        f"run {name!r} was synced {stored_mode} into W&B run {stored.wandb_id!r}, and W&B does not take"
        f" {mode} uploads into that run as well ({why}); keep --mode {stored_mode} for this run, or send"
        f" what is not synced yet to a new W&B run with --mode {mode} --run-id NEW_ID"
    )


def _possibly_delivered(conn: sa.Connection, run_id: int, found: dict[int, PlanWriter], low: int, high: int) -> int:
    """Pending records that an earlier upload of this run may have delivered.

    An upload that was cut off (its syncer died: still "running"; or it was
    interrupted) or failed may have delivered some of its records before it
    ended: those are sent again, and W&B may then hold them twice. A failed
    or interrupted upload's entry reaches as far as it handed records to
    wandb; a dead syncer's, as far as it planned.
    """
    unconfirmed = sa.and_(
        syncs.c.run_id == run_id, syncs.c.status.in_(("running", "interrupted", "failed", "unreachable"))
    )
    reach = conn.scalar(sa.select(sa.func.max(syncs.c.last_id)).where(unconfirmed))
    if reach is None:
        return 0
    return sum(_pending_counts(conn, found, low, min(reach, high)).values())


def _close_dead_syncs(conn: sa.Connection, run_id: int) -> None:
    """Mark the entries of syncers that died during an upload of the run (still "running") interrupted."""
    dead = sa.and_(syncs.c.run_id == run_id, syncs.c.status == "running")
    conn.execute(syncs.update().where(dead).values(status="interrupted", message="the syncer died during the upload"))
