"""The W&B run an upload sends into: its settings, its life (open, rows, summary, finish), what confirms it."""

from __future__ import annotations

import collections
import contextlib
import hashlib
import importlib
import io
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ...errors import ConfigError, MetricValueError, UploadError
from ...image import TYPE as IMAGE
from ...image import png_of
from ...store import Target
from ..results import SyncMode
from .confirmation import Account
from .failures import LOGIN, REINSTALL, describe, failure, init_failure, init_log, settings_problem, upload_failure
from .handover import PLAIN, Batcher
from .media import histograms, pillow
from .service import core_connection, own_service_only, restart_wandb

# Batches the sender may be behind a time-bounded sync (keep_pace): a few
# keep wandb-core's stages busy while Python prepares the next, and are
# sent in well under a second when the finish begins.
PACE_AHEAD = 4
FILE_STREAM_INTERVAL = 2.0  # seconds between wandb-core's history posts (whole seconds: wandb-core truncates)
# How often settle() reads wandb-core's account (a few lines each time), and
# how long it waits for W&B without any answer before it gives up: longer
# than wandb-core's own retries of one post (retry_settings).
SETTLE_POLL = 0.05
SETTLE_PATIENCE = 90.0
# What wandb.init imports before it returns, whatever the run (wandb_run.py,
# Run._detect_and_apply_job_inputs): a third of a second here, most of it
# pydantic reading the source of each launch model for its docstrings. A
# sync has no launch inputs; it only pays for the import.
LAUNCH_INPUTS = "wandb.sdk.launch.inputs.internal"


class WandbRun:
    """One upload into the W&B run ``target`` (the syncer's only view of wandb).

    wandb writes its files (the run folder, its logs) under ``directory``:
    the offline run directory, or a working folder the syncer removes.
    """

    def __init__(
        self,
        target: Target,
        name: str | None,
        mode: SyncMode,
        directory: Path,
        *,
        config: dict[str, Any] | None = None,
        init_timeout: float = 90.0,
        finish_state: bool = False,
    ) -> None:
        import wandb

        own_service_only()
        self.mode = mode
        shared = mode == "online"
        settings = wandb.Settings(
            mode="shared" if shared else "offline",
            # Not the run's primary writer: this host's metadata, requirements
            # and config files are not the job's. And the run's state is the
            # job's: a sync leaves it alone unless it is to finish the run
            # (walbuf.syncer.finish). W&B docs, "distributed training".
            x_primary=not shared,
            x_update_finish_state=finish_state or not shared,
            x_label=f"walbuf-sync-{socket.gethostname()}-{os.getpid()}",
            console="off",
            x_disable_stats=True,
            x_disable_machine_info=True,
            x_save_requirements=False,  # the syncer's packages, not the job's (and listing them takes 0.1-0.2 s)
            save_code=False,
            disable_git=True,
            disable_job_creation=True,
            silent=True,
            init_timeout=init_timeout,
            # History goes out every 2 s, not every 15 s (wandb's default): with
            # a long backlog, wandb-core's work per row grows with the rows
            # waiting for the next post, and a sync outpaced it by seconds that
            # run.finish() then waited (docs/performance.md). One post per 2 s is
            # a quarter of W&B's default limit of 2 requests/s per run (W&B docs, rate limits).
            x_file_stream_transmit_interval=FILE_STREAM_INTERVAL,
            # The file_stream's account of its requests, which confirms an
            # upload (confirmation.Account), is logged at INFO: never at a level above it.
            x_log_level=logging.INFO,
            **retry_settings(),
        )
        directory.mkdir(parents=True, exist_ok=True)
        self._images = directory / "walbuf-images"  # each image's PNG, until wandb has copied it
        self._batcher: Batcher | None = None  # while in batched()
        self._marks: collections.deque[Any] = collections.deque()  # keep_pace()'s, oldest first
        self._rows = 0  # history rows handed to wandb: what W&B must be seen to have taken
        self._finishing = finish_state and shared  # its last file_stream request must carry the finish
        self._declared: set[tuple[str, str]] = set()  # definitions wandb-core has: declaring one again upserts the run
        self._images_logged = False
        _import_in_background(LAUNCH_INPUTS)
        try:
            self._run = _init(target, name, directory, settings, config)
        except BaseException:
            # A wandb.init that failed or was cut off (the time bound, a
            # signal) may leave wandb's service holding the run, or a
            # wandb-core it started and never heard from, which outlives this
            # process if it cannot notice its end (stopped, or stuck in I/O).
            # Ended as abandon() ends them: the next upload starts afresh.
            restart_wandb()
            raise
        # Made once for the run (it resolves wandb's internals it relies on);
        # None with a wandb it was not checked against.
        self._handover = Batcher.of(self._run)
        self._account = Account(Path(self._run.settings.log_internal))

    @property
    def target(self) -> Target:
        """The run's target as wandb resolved it (its default project and entity filled in)."""
        return Target(self._run.id, self._run.project or None, self._run.entity or None)

    @property
    def offline_dir(self) -> str | None:
        """The offline run directory (what `wandb sync` takes), in offline mode."""
        if self.mode != "offline":
            return None
        return str(Path(self._run.dir).parent)

    def define_metric(self, key: str, step_metric: str) -> None:
        """Declare ``key`` to be plotted against ``step_metric`` (both history keys, as logged).

        Raises RowRefused if wandb refuses the name.
        """
        import wandb

        if (key, step_metric) in self._declared:
            # A run kept open across passes (walbuf.syncer.kept) has it: each
            # declaration marks the run's config changed, and wandb-core
            # upserts the run for it (core runupserter.go UpdateMetrics).
            return
        try:
            with core_connection("declaring metrics"):
                self._run.define_metric(_escape(key), step_metric=_escape(step_metric))
        except (ValueError, TypeError, wandb.errors.Error) as exc:  # local: about the name, not the network
            raise RowRefused(f"wandb refused to declare metric {key!r}: {describe(exc)}") from exc
        self._declared.add((key, step_metric))

    def update_summary(self, summary: dict[str, Any]) -> None:
        """Set the run's summary (after the rows: a row would replace a key it also holds).

        Histograms in their stored form are sent as wandb.Histogram; an
        image's reference as W&B keeps it (what :meth:`log` returned) as it is.
        """
        with core_connection("sending the summary"):
            self._run.summary.update(histograms(summary))

    def log(self, row: dict[str, Any], step: int | None = None) -> dict[str, Any]:
        """Send one history row (histograms and images in their stored form); RowRefused if wandb refuses its data.

        Returns the row's images as W&B holds them in the row: key -> the
        reference to the image's file, which wandb uploads with the run.
        """
        if dict not in map(type, row.values()):  # the common case: no histogram, no image
            self._log(row, step)
            return {}
        row = histograms(row)
        files: list[Path] = []
        try:
            images = self._wandb_images(row, files)
            self._log({**row, **images}, step)
        finally:
            for file in files:
                file.unlink(missing_ok=True)
        self._images_logged = self._images_logged or bool(images)
        # wandb copied each file into its run folder while logging (Media.bind_to_run).
        return {key: image.to_json(self._run) for key, image in images.items()}

    @contextlib.contextmanager
    def batched(self) -> Iterator[None]:
        """Rows and definitions sent in the block reach wandb-core together, in order, when it ends.

        wandb hands each record to its asyncio thread and waits for that
        thread to write it (interface_sock.py: _publish -> asyncer.run), one
        wake-up per row, most of a row's time in a sync. In the block, the
        records wandb would publish one by one are kept, then handed over in
        one call. Anything that waits for wandb-core's answer first hands
        over what is kept. An exception leaving the block drops what is kept
        (the upload fails; nothing is marked synced). With a wandb this was
        not checked against (see Batcher.of), each record goes as before.
        """
        batcher = self._handover
        if batcher is None:
            yield
            return
        with batcher.installed():
            self._batcher = batcher
            try:
                yield
                with core_connection("sending history"):
                    batcher.flush()
            finally:
                self._batcher = None

    def keep_pace(self) -> None:
        """Mark the rows handed over so far; wait until wandb-core's sender has taken in those of all but the last
        PACE_AHEAD calls.

        Under a time bound rows handed over faster than wandb-core sends them
        would wait in it for run.finish(), past the time the bound keeps for
        that. The sender, not the handler, is what falls behind (offline,
        wandb-core parks the rows in the run's file meanwhile: "flowcontrol:
        backed up"), so each call is marked by a request the sender answers in
        order with the rows before it (Batcher.mark), and a later call waits
        for its answer: Python prepares batches while wandb-core sends the
        ones before. With a wandb the batched hand-over was not checked against
        (Batcher.of), rows go one by one and nothing is waited for.
        """
        if self._handover is None:
            return
        with core_connection("sending history"):
            self._marks.append(self._handover.mark())
            if len(self._marks) > PACE_AHEAD:
                self._marks.popleft().wait_or(timeout=None)

    def _log(self, row: dict[str, Any], step: int | None) -> None:
        try:
            if self._batcher is not None and step is None and PLAIN.issuperset(map(type, row.values())):
                self._batcher.log(self._run, row)  # kept for the batch's hand-over: nothing goes to wandb-core yet
            else:
                with core_connection("sending history"):
                    self._run.log(row, step=step)  # wandb.log copies the row
        except (ValueError, TypeError) as exc:
            raise RowRefused(f"wandb refused the row: {describe(exc)}") from exc
        self._rows += 1

    def _wandb_images(self, row: dict[str, Any], files: list[Path]) -> dict[str, Any]:
        """The stored images of ``row`` as wandb.Image objects of files in the working folder (added to ``files``)."""
        import wandb

        pil = pillow()
        images = {}
        for key, value in row.items():
            if type(value) is not dict or value.get("_type") != IMAGE:
                continue
            try:
                png = png_of(value)
                with pil.open(io.BytesIO(png)) as decoded:  # in memory: what fails is the data
                    # open() read the header only. What the buffer says of the
                    # image bounds what decoding it takes: no more than log() let in.
                    if decoded.size != (value["width"], value["height"]):
                        raise RowRefused(
                            f"image {key!r} is stored as {value['width']}x{value['height']} pixels, but its PNG"
                            f" is {decoded.width}x{decoded.height}: walbuf does not write such an image"
                        )
                    decoded.load()
            except (MetricValueError, OSError, SyntaxError, ValueError, pil.DecompressionBombError) as exc:
                raise RowRefused(f"image {key!r} cannot be read: {describe(exc)}") from exc
            self._images.mkdir(exist_ok=True)
            path = self._images / f"{hashlib.sha256(png).hexdigest()}.png"
            files.append(path)
            path.write_bytes(png)
            images[key] = wandb.Image(str(path), caption=value["caption"])
        return images

    def mark_preempting(self) -> None:
        """Tell W&B the run will send more later (wandb-core's "preempting" signal on the file_stream).

        W&B marks a run crashed after about 5 minutes without a heartbeat
        (W&B docs, sweeps "signal handling"); a run marked preempting is
        shown preempting, then preempted, instead: "the run isn't dead and
        [will] send more updates later" (core filestream/filestreamrequest.go).
        """
        with core_connection("marking the run preempting"):
            self._run.mark_preempting()

    def finish(self, exit_code: int | None = None) -> None:
        """End the upload; raise UploadError or ConfigError unless wandb confirms everything was uploaded.

        ``exit_code`` is the job's, sent as the run's state when the run was
        opened with ``finish_state``.
        """
        import wandb

        with contextlib.suppress(FileNotFoundError):
            self._images.rmdir()  # empty: each image's file goes once wandb has copied it
        try:
            with core_connection("finishing the upload"):
                self._run.finish(exit_code=exit_code)
        except wandb.errors.Error as exc:
            raise failure(str(exc), "finishing the upload") from exc
        problem, refused_files = upload_failure(self._run)
        if problem is not None:
            raise failure(problem, "uploading")
        if self.mode == "online":
            self._account.read()
            missing = self._account.missing(self._rows, self._finishing)
            if missing is not None:
                raise UploadError(
                    f"W&B did not confirm the upload: {missing}; so nothing was marked synced, and the next"
                    " sync sends it again (retry later)"
                )
        if refused_files:
            # A per-file refusal of W&B's storage (an upload URL that expired, a
            # bucket policy) says nothing of the run's target: retry later.
            refused = list(dict.fromkeys(refused_files))  # one line per try of a file
            names = ", ".join(refused[:3]) + (f" and {len(refused) - 3} more" if len(refused) > 3 else "")
            raise UploadError(
                f"W&B's file storage refused the upload of {names}, so nothing was marked synced; retry later"
                " (storage refuses an upload URL that expired; the next sync asks W&B for new ones)"
            )

    @property
    def keepable(self) -> bool:
        """Whether the run may be kept open for the next pass (:meth:`settle` confirms all it sent).

        Only an online run that sent no image: an image's file is uploaded
        apart from the history, and only finish() confirms it.
        """
        return self.mode == "online" and not self._images_logged

    def settle(self) -> None:
        """Wait until W&B is seen to have taken every history row handed over so far; the run stays open.

        For a run a follow keeps open across its passes (walbuf.syncer.kept).
        The evidence is finish()'s (confirmation.Account: W&B's answers to
        wandb-core's file_stream posts), read as wandb-core writes it; the
        posts go every FILE_STREAM_INTERVAL seconds. Raises UploadError when
        wandb-core logs an error, or when W&B takes nothing more for
        SETTLE_PATIENCE seconds: then none of the rows may be marked synced.
        """
        waited_since = time.monotonic()
        taken = -1
        while True:
            self._account.read()
            if self._account.errors:
                problem, _ = upload_failure(self._run)
                raise failure(problem or "wandb-core logged an error", "uploading")
            if self._account.started:
                now_taken = self._account.taken()
                if now_taken >= self._rows:
                    return
                if now_taken > taken:
                    taken, waited_since = now_taken, time.monotonic()
            if time.monotonic() - waited_since > SETTLE_PATIENCE:
                missing = self._account.missing(self._rows, finishing=False)
                raise UploadError(
                    f"W&B did not confirm the upload within {SETTLE_PATIENCE:g}s: {missing}; so nothing was marked"
                    " synced, and the next pass sends it again (retry later)"
                )
            time.sleep(SETTLE_POLL)  # wandb-core's log is the event: nothing else tells of W&B's answers

    def abandon(self) -> None:
        """End the upload unfinished: nothing more of it is sent, and the next upload may open the run again.

        For an upload cut off in this process (an exception before or in finish(): a signal or the time
        bound in finish() leaves wandb-core sending); none of it is marked synced, and the service ends as
        restart_wandb() ends it.
        """
        # The run's own threads (wandb's network status checker) end first:
        # left running, they ask the service that is gone and print a traceback.
        checker = getattr(self._run, "_run_status_checker", None)
        if checker is not None:
            checker.join()
        restart_wandb()


def _skips_transaction_log(settings: Any) -> bool:
    """Whether the run goes without wandb's transaction log: a shared run, unless wandb's own settings
    (WANDB_MODE, a settings file) make runs offline unless told otherwise.

    The log is wandb-core's copy of all a run sends, the run's .wandb file in
    the working folder. The buffer is that copy, and nothing is marked synced
    before W&B confirmed it; with the log, a backlog larger than the room in
    the cache folder (a home quota) failed every sync, and writing it cost a
    20,000-row sync 0.3 s (docs/performance.md). Offline, the file is the run.

    wandb.init merges the run's settings into its environment's one at a
    time, in an order the hash seed sets (wandb_init.py ``maybe_login``:
    ``update_from_settings`` over a set of names), and checks the whole after
    each: skipping the log while ``mode`` still says offline is refused
    (``validate_skip_transaction_log``). The run is shared all the same
    (``mode`` wins); it keeps the log then. Read here are the settings
    wandb.init starts from, its process's wandb singleton's (loading them
    raises what wandb.init would: a malformed WANDB_BASE_URL, say).
    """
    from wandb.sdk import wandb_setup

    return settings.mode == "shared" and wandb_setup.singleton().settings.mode not in ("offline", "dryrun")


def _init(target: Target, name: str | None, directory: Path, settings: Any, config: dict[str, Any] | None) -> Any:
    """wandb.init of the upload's run, its failures as walbuf's errors."""
    import wandb

    try:
        settings.x_skip_transaction_log = _skips_transaction_log(settings)
        return wandb.init(
            id=target.wandb_id,
            project=target.project,
            entity=target.entity,
            name=name,
            config=config or None,
            dir=str(directory),
            settings=settings,
            reinit="create_new",
        )
    except wandb.errors.WandbCoreNotAvailableError as exc:
        raise ConfigError(f"wandb cannot run its upload process: {describe(exc)}; {REINSTALL}") from exc
    except OSError as exc:
        if not str(exc.filename or "").endswith("wandb-core"):
            raise
        # wandb-core is there but cannot be executed (not executable, not a program for this machine).
        raise ConfigError(f"wandb cannot run its upload process: {describe(exc)}; {REINSTALL}") from exc
    except wandb.errors.AuthenticationError as exc:
        raise ConfigError(f"W&B refused the credentials: {describe(exc)}; {LOGIN}") from exc
    except wandb.errors.UsageError as exc:
        if "API key" in str(exc) or "login" in str(exc):  # wandb's own words say `wandb login` already
            raise ConfigError(f"wandb refused to start the upload: no W&B API key was found; {LOGIN}") from exc
        raise ConfigError(f"wandb refused to start the upload: {describe(exc)}; fix the setting it names") from exc
    except wandb.errors.Error as exc:
        doing = f"opening W&B run {target.wandb_id!r}"
        raise init_failure(exc, init_log(directory), doing) from exc
    except ValueError as exc:  # wandb's settings (pydantic) refusing an environment variable
        raise ConfigError(
            f"wandb refused a setting: {settings_problem(exc)}; check WANDB_BASE_URL and the other WANDB_*"
            " variables of this environment"
        ) from exc


class RowRefused(Exception):
    """wandb refused one row's data: the same row would be refused again. Caught by the syncer."""


def _escape(key: str) -> str:
    # wandb-core reads "." in define_metric names as nesting ("a.b" is b inside
    # a) unless escaped; history keys are flat, so every dot is literal.
    return key.replace(".", "\\.")


def retry_settings() -> dict[str, Any]:
    """Bounded retries: a W&B server that stays unreachable fails the sync in well under a minute.

    The next sync (cron's next run) is the real retry; these only ride out
    a blip.
    """
    return {
        "x_graphql_retry_max": 3,
        "x_graphql_retry_wait_min_seconds": 1,
        "x_graphql_retry_wait_max_seconds": 5,
        "x_file_stream_retry_max": 3,
        "x_file_stream_retry_wait_min_seconds": 1,
        "x_file_stream_retry_wait_max_seconds": 5,
        "x_file_transfer_retry_max": 3,
        "x_file_transfer_retry_wait_min_seconds": 1,
        "x_file_transfer_retry_wait_max_seconds": 5,
    }


def _import_in_background(module: str) -> None:
    """Start importing ``module`` in a thread of its own, and return.

    wandb.init spends most of its time waiting (for wandb-core to start, for
    W&B's answer), and an import started just before it runs in those waits:
    a 20,000-row sync took 0.3 s less (docs/performance.md). When wandb.init
    comes to the import itself, Python's import lock has it wait for this
    one to end (or do it again, had it failed). The two imports share no
    module that imports the other (checked with wandb 0.31.0), so their
    locks cannot deadlock.
    """

    def load() -> None:
        # A failure here changes nothing: wandb.init imports the module
        # again and handles what fails there its own way (it logs it).
        with contextlib.suppress(Exception):
            importlib.import_module(module)

    threading.Thread(target=load, name=f"walbuf-import-{module}", daemon=True).start()
