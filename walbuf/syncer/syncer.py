"""`walbuf sync`: replays what writers appended into W&B, each record once where it can be.

For each run with pending records, one sync:

1. takes the buffer's sync lock (one syncer per buffer),
2. brings everything into the database it uploads from (a directory
   buffer's shards into its hub; see walbuf.directory),
3. plans the run's upload (:mod:`.plan`): its W&B target, and its extent,
   the pending records up to the newest one at that moment; what writers
   append meanwhile waits for the next sync,
4. replays the records into one wandb run in shared mode (:mod:`.upload`,
   through :mod:`.wandb`, the only package that imports wandb),
5. and only when wandb confirms the upload, advances the writers' cursors and
   marks the sync done, in one transaction.

A failed upload changes nothing but the sync's own log entry. A syncer killed
between 3 and 5 leaves a running entry: the next sync marks it interrupted,
sends those records again (at-least-once: W&B may then hold them twice) and
reports how many that may be.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import sqlalchemy as sa

from ..arguments import count, seconds
from ..buffer import Buffer, Location, open_buffer
from ..errors import ConfigError, SyncLockedError, UploadError
from ..store import Storage, Target, machine
from ..store.schema import syncs
from ..store.target import check_target
from ..store.trust import Owner, make_folders
from .budget import Budget, OutOfTime
from .finish import outcome
from .kept import KeptRuns
from .plan import plan, runs_to_sync
from .results import SYNC_MODES, RunSync, SyncMode, SyncResult
from .upload import OpenRun, RunSink, upload
from .wandb import WandbRun, check_wandb

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PassChoices:
    """What one sync pass was asked to do: built once by :func:`sync` or walbuf.follow, passed down whole.

    ``run``: one run, or every run (None). ``overrides``: the W&B target
    given (see :func:`sync`). ``directory``: where an offline run directory
    goes. ``budget``: what the pass may spend. ``progress`` and ``on_run``:
    as for :func:`sync`. ``check``: check the database whole for damage
    first. ``more_soon``: the caller syncs again soon (walbuf.follow), so a
    run whose job goes on is left running, not marked preempting.
    ``missing_ok``: a ``run`` no writer has made yet is nothing to sync, not
    an error. ``open_run``: what opens each upload's run (tests pass a
    stand-in for wandb). ``keeper``: where a run whose job goes on is kept
    open for the next pass (walbuf.follow's; see walbuf.syncer.kept).
    """

    run: str | None = None
    overrides: Target = field(default_factory=Target)
    mode: SyncMode = "online"
    directory: str | os.PathLike[str] | None = None
    budget: Budget = field(default_factory=lambda: Budget(None, None))
    progress: Callable[[int], None] | None = None
    on_run: Callable[[RunSync], None] | None = None
    check: bool = True
    more_soon: bool = False
    missing_ok: bool = False
    open_run: OpenRun = WandbRun
    keeper: KeptRuns[RunSink] | None = None


def sync(
    buffer: Location,
    *,
    run: str | None = None,
    project: str | None = None,
    entity: str | None = None,
    run_id: str | None = None,
    mode: SyncMode = "online",
    directory: str | os.PathLike[str] | None = None,
    max_records: int | None = None,
    max_seconds: float | None = None,
    wait: float = 0.0,
    dry_run: bool = False,
    take_over: bool = False,
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
    since its last call; ``on_run`` with a run's plan once W&B has opened
    that run for its upload (credentials and target accepted), before any of
    its records is sent.

    A directory buffer on a filesystem whose locks do not span hosts is
    synced from one host (walbuf.directory.sync_host): elsewhere this
    raises SyncHostError, unless ``take_over`` makes this host that one
    (say so only once the other host syncs it no more).

    Raises UploadError when W&B cannot be reached or fails: that run's
    records stay pending (runs synced before it in this call stay synced).

    ``dry_run`` sends nothing and changes nothing (it takes no lock either):
    it counts what would be sent per run, and of a directory buffer the
    shards' records not yet in the hub as ``not_in_hub``.

    wandb reads its own settings (WANDB_BASE_URL, credentials) once per
    process: syncs in one process all talk to the server the first one did.
    """
    if mode not in SYNC_MODES:
        raise ConfigError(f"mode must be one of {', '.join(SYNC_MODES)}, not {mode!r}")
    budget = Budget(
        None if max_records is None else count("max_records", max_records),
        None if max_seconds is None else seconds("max_seconds", max_seconds, positive=True),
    )
    wait = seconds("wait", wait)
    overrides = check_target(Target(run_id, project, entity))
    located = open_buffer(buffer)
    choices = PassChoices(run, overrides, mode, directory, budget, progress, on_run)
    if dry_run:
        return _dry_run(located, choices)
    check_wandb()
    with holding_sync_lock(located, wait):
        if take_over:
            located.take_over_sync()
        return sync_pass(located, choices)


@contextmanager
def holding_sync_lock(located: Buffer, wait: float) -> Iterator[None]:
    """Hold the buffer's sync lock for the block; SyncLockedError if another syncer keeps it past ``wait`` seconds."""
    lock = located.sync_lock()
    acquired = lock.acquire(timeout=0)
    if not acquired and wait > 0:
        _log.info("another walbuf sync of %s is running; waiting up to %gs for it to finish", located.location, wait)
        acquired = lock.acquire(timeout=wait)
    if not acquired:
        raise SyncLockedError(_locked_message(located, wait))
    try:
        yield
    finally:
        lock.release()


def sync_pass(located: Buffer, choices: PassChoices) -> SyncResult:
    """One sync pass under the sync lock the caller holds: take in, then upload and finish each run in scope.

    Raises what :func:`sync` raises.
    """
    budget = choices.budget
    source = located.open_for_sync(budget.spent, check=choices.check)
    storage = source.storage
    with storage, _wandb_folder(storage, choices.directory, choices.mode) as folder:
        done = []
        stopped = source.stopped
        names = runs_to_sync(storage, choices.run, choices.overrides.wandb_id, missing_ok=choices.missing_ok)
        for name in names if not stopped else ():
            if budget.spent():
                stopped = True
                break
            report = _sync_run(storage, located, name, folder, choices)
            if report is not None:
                done.append(report)
                stopped = stopped or report.cut_short
        return SyncResult(runs=tuple(done), stopped_early=stopped, refused=source.refused)


def _sync_run(storage: Storage, buffer: Buffer, name: str, folder: Path, choices: PassChoices) -> RunSync | None:
    """Upload one run's pending records, then finish its W&B run if its job is done; what was done, if anything.

    The finishing is an upload of its own, of no records (it sends the run's
    config and definitions again, whole): an upload that also finished the
    run would, if killed, leave the run finished by wandb's service before
    its last records arrived.
    """
    report = _upload(storage, name, folder, choices, None)
    if report is not None and report.cut_short:
        return report
    if choices.mode != "online" or choices.budget.spent():
        return report
    done = outcome(storage, buffer, name)
    if done is None:
        return report
    code, failed = done
    if choices.keeper is not None:
        choices.keeper.close(name)  # the finishing upload opens the run with its state to set
    final = _upload(storage, name, folder, replace(choices, progress=None, on_run=None), code)
    assert final is not None
    if final.finished is not None:
        final = replace(final, failed_writers=failed)
    return final if report is None else replace(report, finished=final.finished, failed_writers=final.failed_writers)


def _upload(storage: Storage, name: str, folder: Path, choices: PassChoices, finish_code: int | None) -> RunSync | None:
    """Plan and send one upload of the run; with ``finish_code``, one that finishes it (even with nothing pending)."""
    budget = choices.budget
    finishing = finish_code is not None
    planned = plan(storage, name, choices.overrides, choices.mode, budget, dry_run=False, finishing=finishing)
    if planned is None:
        return None
    try:
        return upload(
            storage,
            planned,
            choices.mode,
            folder,
            budget,
            choices.progress,
            on_open=choices.on_run,
            finish_code=finish_code,
            more_soon=choices.more_soon,
            open_run=choices.open_run,
            keeper=choices.keeper,
        )
    except OutOfTime as exc:
        raise UploadError(
            f"{exc} before W&B confirmed the upload of run {name!r}, so nothing of it is marked"
            " synced; the next sync sends it again (give it more time with --max-seconds)"
        ) from None


def _dry_run(buffer: Buffer, choices: PassChoices) -> SyncResult:
    """What a sync would send; opens everything for reading only."""
    planned: list[RunSync] = []
    storage = buffer.open_store("read")
    if storage is not None:
        with storage:
            storage.check_integrity()
            for name in runs_to_sync(storage, choices.run, choices.overrides.wandb_id):
                found = plan(storage, name, choices.overrides, choices.mode, choices.budget, dry_run=True)
                if found is not None:
                    planned.append(found.report)
    backlog = buffer.backlog()
    not_in_hub = sum(e.not_in_hub for e in backlog if e.not_in_hub is not None)
    unreadable = sum(1 for e in backlog if e.not_in_hub is None and e.refused is None)
    refused = (
        *(f"shard {e.name} is not taken in whole: {e.refused}" for e in backlog if e.refused is not None),
        *buffer.not_opened(),
    )
    return SyncResult(
        runs=tuple(planned), dry_run=True, not_in_hub=not_in_hub, unreadable_shards=unreadable, refused=refused
    )


@contextmanager
def _wandb_folder(storage: Storage, directory: str | os.PathLike[str] | None, mode: SyncMode) -> Iterator[Path]:
    """Where wandb writes its files: the offline run directory, or a working folder removed afterwards.

    Offline: ``directory``, else ``BUFFER.wandb/`` beside the buffer's file;
    kept, for `wandb sync`. Online: a fresh folder under walbuf's cache
    folder ($XDG_CACHE_HOME/walbuf/sync, else ~/.cache/walbuf/sync), never
    the current directory, removed when the sync ends (its internal log has
    been read by then).
    """
    if mode == "offline":
        if directory is not None:
            yield Path(directory)
        elif storage.backend.path is not None:
            # Beside the buffer's file (in a directory buffer: inside it), so the
            # buffer's owner's, and owner-only: never a link, never another account's.
            path = storage.backend.path
            folder = path.with_name(path.name + ".wandb")
            Owner.of(path, write=True).folder(folder, make=True)
            yield folder
        else:
            raise ConfigError(
                f"{storage.location} is not a file, so there is no folder beside it for the"
                " offline run: give one with --dir"
            )
        return
    with working_folder() as folder:
        yield folder


@contextmanager
def working_folder() -> Iterator[Path]:
    """A fresh folder for wandb's files of online uploads, under walbuf's cache folder ($XDG_CACHE_HOME/walbuf/sync,
    else ~/.cache/walbuf/sync), removed when the block ends (or, if this process is killed, by the next sync here)."""
    cache = _cache_folder()
    _remove_folders_of_killed_syncers(cache)
    folder = Path(tempfile.mkdtemp(prefix=f"{_this_process()}-", dir=cache))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _this_process() -> str:
    """This syncer, as its working folder is named: which folders are of syncers that ended, only it can tell.

    A home folder on shared storage holds the folders of syncers of several
    hosts, and containers of one machine that share it have PID namespaces
    of their own: a pid names a process only with the machine's boot and
    the namespace, and a reused pid is told apart by its start time.
    """
    pid = os.getpid()
    return f"{socket.gethostname()}-{_namespace()}-{pid}-{machine.started(pid) or 0}"


def _namespace() -> str:
    """This boot and PID namespace, short: a folder of a syncer elsewhere never matches it."""
    return hashlib.sha256(f"{machine.boot_id()}\0{machine.pid_namespace()}".encode()).hexdigest()[:12]


def _remove_folders_of_killed_syncers(cache: str) -> None:
    """Remove the working folders that syncers killed with -9 could not: of this machine's boot and PID namespace,
    whose process has ended for sure. Another's (another host, container or boot) is left alone."""
    mine = f"{socket.gethostname()}-{_namespace()}-"
    for entry in os.scandir(cache):
        if not entry.name.startswith(mine):
            continue
        pid, _, rest = entry.name[len(mine) :].partition("-")
        start = rest.partition("-")[0]
        if pid.isdigit() and start.isdigit() and not machine.running(int(pid), int(start)):
            if entry.is_dir(follow_symlinks=False) and entry.stat(follow_symlinks=False).st_uid == os.geteuid():
                shutil.rmtree(entry.path, ignore_errors=True)  # our own: rmtree follows no link


def _cache_folder() -> str:
    """walbuf's folder for a sync's working files, made owner-only if missing.

    Its folders (walbuf/ and walbuf/sync/) must be this account's and no
    link (UntrustedPathError): wandb writes the run's data there.
    """
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    folder = Path(base, "walbuf", "sync")
    try:
        make_folders(folder)
    except OSError:
        return tempfile.gettempdir()  # no home to write to (a bare cron environment, say); mkdtemp is owner-only
    me = Owner(os.geteuid())
    for path in (folder.parent, folder):
        me.folder(path)
    return str(folder)


def _locked_message(buffer: Buffer, wait: float) -> str:
    who = ""
    storage = buffer.open_store("read")
    if storage is not None:
        with storage, storage.begin_read() as conn:
            holder = conn.execute(
                sa.select(syncs.c.host, syncs.c.pid, syncs.c.started_at)
                .where(syncs.c.status == "running")
                .order_by(syncs.c.id.desc())
            ).first()
        if holder is not None:
            started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.started_at))
            who = f" (process {holder.pid} on {holder.host}, since {started})"
    waited = f" and did not finish within {wait:g}s" if wait else ""
    return (
        f"another walbuf sync of {buffer.location} is running{who}{waited};"
        " let it finish, or pass --wait SECONDS to wait for it"
    )
