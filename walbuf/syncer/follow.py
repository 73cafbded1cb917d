"""`walbuf sync --follow`: one process that streams a job's records into W&B while it runs.

A follow is a sequence of passes, each what one `walbuf sync` does (take in,
plan, upload, confirm, and finish a run whose writers all closed), in one
process that holds the buffer's sync lock throughout: a cron sync meanwhile
exits 11 ("will retry"). The passes follow each other ``interval`` seconds
apart, so a record reaches W&B within about ``interval`` plus one upload.
A run whose job goes on is kept open from one pass to the next (see
walbuf.syncer.kept): W&B hears one wandb.init and one file_stream, not one
per pass.
While passes go on, the W&B run shows "running" (each pass is heard from
well within W&B's 5 minutes; none marks it preempting).

Guarantees are those of sync: a record is marked synced only once W&B
confirmed it, and a pass that fails changes nothing. A pass that W&B or the
network fails (UploadError: "retry later") is reported and the follow goes
on: records wait in the buffer until a pass gets through. Anything else (a
refusal, a damaged buffer) ends the follow with its error.

The follow ends by itself once every run it follows has been finished in W&B
(every writer closed or died, everything delivered), and never before a
writer has opened. It may start before the job makes the buffer: it waits
for it. SIGTERM or Ctrl-C end it as they end a sync.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import sqlalchemy as sa

from ..arguments import count, seconds
from ..buffer import Buffer, Location, open_buffer
from ..errors import BufferNotFoundError, UploadError
from ..store import Storage, Target
from ..store.schema import runs
from ..store.target import check_target
from .kept import KeptRuns
from .plan import runs_to_sync
from .results import SyncResult
from .syncer import PassChoices, holding_sync_lock, sync_pass, working_folder
from .upload import RunSink
from .wandb import check_wandb, renew_wandb, restart_wandb

_log = logging.getLogger(__name__)

# Seconds between passes. A pass that finds nothing new sends nothing, and
# the run stays open between passes (walbuf.syncer.kept), so short passes
# cost W&B no more requests: wandb-core posts at most every 2 s
# (FILE_STREAM_INTERVAL). A pass that starts within 2 s of the last post has
# its rows wait for the next one and go in one post; a record reaches W&B
# in about 2 s (scripts/bench_follow_requests.py, docs/performance.md).
DEFAULT_INTERVAL = 1.0
# wandb-core keeps about 120 KiB for each run it served, finished or not
# (measured with wandb 0.31: 100 runs of one process, 33.8 -> 45.9 MiB); a
# follow of days must not keep one wandb-core, so it is renewed after every
# RENEW_EVERY passes that uploaded (the runs kept open are closed first).
RENEW_EVERY = 100  # uploading passes between restarts of wandb's service


@dataclass(frozen=True)
class FollowResult:
    """What a follow did: its passes, the records they synced, and the runs it finished in W&B.

    ``quarantined``: records its passes quarantined (W&B refuses them for
    good); ``needs_a_person``: whether any pass left part of the buffer
    unsent for good, as :attr:`SyncResult.needs_a_person` says of one.
    """

    passes: int
    records: int
    finished: tuple[str, ...]
    quarantined: int = 0
    needs_a_person: bool = False


def follow(
    buffer: Location,
    *,
    run: str | None = None,
    project: str | None = None,
    entity: str | None = None,
    run_id: str | None = None,
    interval: float = DEFAULT_INTERVAL,
    stop: threading.Event | None = None,
    on_pass: Callable[[SyncResult], None] | None = None,
    on_retry: Callable[[UploadError], None] | None = None,
    renew_every: int = RENEW_EVERY,
) -> FollowResult:
    """Sync ``buffer`` (``run`` of it, or all its runs) pass after pass until its job is done; see the module docstring.

    ``project``, ``entity`` and ``run_id`` are those of :func:`walbuf.sync`.
    ``stop`` ends the follow between passes once set. ``on_pass`` gets what
    each pass that synced something did; ``on_retry`` each UploadError a pass
    met (the follow goes on). After every ``renew_every`` passes that
    uploaded, wandb's service is ended between passes (the next starts it
    afresh), which bounds wandb-core's memory (see RENEW_EVERY). Raises
    SyncLockedError if another syncer holds the buffer, and what a sync
    raises but UploadError.
    """
    interval = seconds("interval", interval, positive=True)
    renew_every = count("renew_every", renew_every)
    overrides = check_target(Target(run_id, project, entity))
    check_wandb()
    waiting = stop if stop is not None else threading.Event()
    located = None
    said = False
    while located is None:
        try:
            located = open_buffer(buffer)
        except BufferNotFoundError:
            if not said:
                _log.warning("%s", _waiting_for(buffer, interval))
                said = True
            if waiting.wait(interval):  # the job has not made it yet
                return FollowResult(0, 0, ())
    passes = records = uploads = quarantined = 0
    finished: list[str] = []
    made = needs_a_person = False
    with holding_sync_lock(located, 0), working_folder() as folder:
        keeper: KeptRuns[RunSink] = KeptRuns(folder)
        try:
            while not waiting.is_set():
                try:
                    done = _pass(located, run, overrides, keeper, check=not made, on_retry=on_retry)
                except BufferNotFoundError:
                    if made:
                        raise
                    waiting.wait(interval)  # its first writer is making it (an empty database, so far)
                    continue
                made = True
                passes += 1
                if done is not None:
                    records += done.records
                    quarantined += done.quarantined
                    needs_a_person = needs_a_person or done.needs_a_person
                    finished += [r.run for r in done.runs if r.finished is not None]
                    if done.runs:
                        uploads += 1
                        if uploads % renew_every == 0:
                            keeper.close_all()
                            renew_wandb()
                    if on_pass is not None and done.runs:
                        on_pass(done)
                    if _all_finished(located, run, run_id):
                        break
                waiting.wait(interval)
            keeper.close_all()
        except BaseException:
            # Its rows are marked synced, so nothing is lost: a run kept open
            # is ended with wandb's service, not finished (the server may be
            # what stopped the follow, and finishing would wait for it).
            restart_wandb()
            keeper.forget()
            raise
    return FollowResult(passes, records, tuple(dict.fromkeys(finished)), quarantined, needs_a_person)


def _waiting_for(buffer: Location, interval: float) -> str:
    """What the follow waits for, where the buffer is not there yet: its full path, and whether even its folder is
    missing (a path mistyped is waited for in vain)."""
    if not isinstance(buffer, (str, os.PathLike)) or "://" in os.fspath(buffer):
        return f"waiting for a writer to make {buffer} (looking again every {interval:g}s)"
    path = Path(os.fspath(buffer)).expanduser().absolute()
    missing = "" if path.parent.is_dir() else f"; not even its folder {path.parent} exists yet: is the path right?"
    return f"waiting for a writer to make {path} (looking again every {interval:g}s){missing}"


def _pass(
    located: Buffer,
    run: str | None,
    overrides: Target,
    keeper: KeptRuns[RunSink],
    *,
    check: bool,
    on_retry: Callable[[UploadError], None] | None,
) -> SyncResult | None:
    """One sync of every run in scope, under the follow's lock; None if W&B or the network failed it."""
    try:
        choices = PassChoices(run, overrides, check=check, more_soon=True, missing_ok=True, keeper=keeper)
        return sync_pass(located, choices)
    except UploadError as exc:
        restart_wandb()
        keeper.forget()
        if on_retry is not None:
            on_retry(exc)
        return None


def _all_finished(located: Buffer, run: str | None, run_id: str | None) -> bool:
    """Whether every run in scope (at least one) is finished in W&B now."""
    storage: Storage | None = located.open_store("read")
    if storage is None:
        return False
    with storage:
        names = runs_to_sync(storage, run, run_id, missing_ok=True)
        if not names:
            return False
        with storage.begin_read() as conn:
            states = conn.execute(sa.select(runs.c.finished_exit).where(runs.c.name.in_(names))).scalars().all()
    return bool(states) and all(state is not None for state in states)


__all__ = ["DEFAULT_INTERVAL", "RENEW_EVERY", "FollowResult", "follow"]
