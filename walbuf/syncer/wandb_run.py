"""The wandb adapter: the one module that imports wandb, and what the syncer needs of it.

It opens one wandb run (shared mode online, wandb's offline mode otherwise)
with settings for a headless uploader: no console capture, no system metrics,
no code or git snapshot, bounded retries so that an unreachable server fails
the sync instead of hanging it. Any failure of wandb's becomes UploadError.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

from ..errors import ConfigError, UploadError
from ..store import Target
from .results import SyncMode


class WandbRun:
    """One upload into the W&B run ``target`` (the syncer's only view of wandb).

    wandb writes its files (the run folder, its logs) under ``directory``:
    the offline run directory, or a working folder the syncer removes.
    """

    def __init__(self, target: Target, name: str, mode: SyncMode, directory: Path) -> None:
        import wandb

        _own_service_only()
        self.mode = mode
        shared = mode == "online"
        settings = wandb.Settings(
            mode="shared" if shared else "offline",
            x_label=f"walbuf-sync-{socket.gethostname()}-{os.getpid()}",
            console="off",
            x_disable_stats=True,
            x_disable_machine_info=True,
            save_code=False,
            disable_git=True,
            disable_job_creation=True,
            silent=True,
            **_retry_settings(),
        )
        directory.mkdir(parents=True, exist_ok=True)
        try:
            self._run = wandb.init(
                id=target.wandb_id,
                project=target.project,
                entity=target.entity,
                name=name,
                dir=str(directory),
                settings=settings,
                reinit="create_new",
            )
        except (wandb.errors.UsageError, wandb.errors.AuthenticationError) as exc:
            # Not a passing outage: retrying from cron would fail the same way forever.
            raise ConfigError(
                f"W&B refused the credentials: {_describe(exc)}; run `wandb login`"
                " or set WANDB_API_KEY (and WANDB_BASE_URL for a private server)"
            ) from exc
        except Exception as exc:  # wandb raises many kinds; each means the upload cannot start
            raise UploadError(f"W&B did not open run {target.wandb_id!r}: {_describe(exc)}") from exc

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
        """Declare ``key`` to be plotted against ``step_metric`` (both history keys, as logged)."""
        try:
            self._run.define_metric(_escape(key), step_metric=_escape(step_metric))
        except Exception as exc:  # the upload cannot go on; the records stay pending
            raise UploadError(f"wandb refused to declare metric {key!r}: {_describe(exc)}") from exc

    def update_config(self, config: dict[str, Any]) -> None:
        """Set the run's config keys (the latest value of each, as the buffer holds them)."""
        try:
            self._run.config.update(config, allow_val_change=True)
        except Exception as exc:  # the upload cannot go on; the records stay pending
            raise UploadError(f"wandb refused the run config: {_describe(exc)}") from exc

    def update_summary(self, summary: dict[str, Any]) -> None:
        """Set run summary keys (after the rows: a row would replace a key it also holds)."""
        try:
            self._run.summary.update(summary)
        except Exception as exc:  # the upload cannot go on; the records stay pending
            raise UploadError(f"wandb refused the run summary: {_describe(exc)}") from exc

    def log(self, row: dict[str, Any], step: int | None = None) -> None:
        try:
            self._run.log(row, step=step)
        except Exception as exc:  # the upload cannot go on; the records stay pending
            raise UploadError(f"wandb refused a row: {_describe(exc)}") from exc

    def finish(self) -> None:
        """Finish the run; raise UploadError unless wandb confirms everything was uploaded."""
        try:
            self._run.finish()
        except Exception as exc:
            raise UploadError(f"W&B did not accept the upload: {_describe(exc)}") from exc
        failure = _upload_failure(self._run)
        if failure is not None:
            raise UploadError(f"W&B did not accept the upload: {failure}")


def _own_service_only() -> None:
    """Never join a wandb service that another process started.

    A wandb-using process passes its service down to its children in
    WANDB_SERVICE (its token names the process that started it). A sync
    that joined a parent's service and was then killed would leave its run
    open in that service, and every later sync of the run would fail with
    "run ID is in use". So a sync in a process that did not start the
    service named there forgets it, and wandb starts one of its own. (In
    a process that already uses wandb itself, wandb keeps the service it
    has; this only matters for one that has not.)
    """
    token = os.environ.get("WANDB_SERVICE")
    if token is None:
        return
    parts = token.split("-")
    if len(parts) < 2 or parts[1] != str(os.getpid()):
        del os.environ["WANDB_SERVICE"]


def _escape(key: str) -> str:
    # wandb-core reads "." in define_metric names as nesting ("a.b" is b inside
    # a) unless escaped; history keys are flat, so every dot is literal.
    return key.replace(".", "\\.")


def _retry_settings() -> dict[str, Any]:
    """Bounded retries: a W&B server that stays unreachable fails the sync in well under a minute.

    The next sync (cron's next run) is the real retry; these only ride out
    a blip.
    """
    return {
        "init_timeout": 90,
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


def _upload_failure(run: Any) -> str | None:
    """The first error wandb-core logged for this run, or None.

    run.finish() returns normally even when wandb-core gave up on the upload
    (seen with wandb 0.31: the file_stream failing with HTTP 500, or the
    server gone, after retries). What wandb-core does report is an ERROR
    record in the run's internal log (JSON lines, settings.log_internal);
    each sync is its own wandb process and run directory, so every line there
    is about this upload. Any error counts: the records stay pending and are
    sent again, at worst twice, never lost.
    """
    path = Path(run.settings.log_internal)
    if not path.exists():
        return "wandb wrote no internal log, so the upload cannot be confirmed"
    with path.open(encoding="utf-8", errors="replace") as log:
        for line in log:
            if '"level":"ERROR' not in line:
                continue
            try:
                message = json.loads(line).get("msg", line)
            except json.JSONDecodeError:
                message = line
            return str(message).splitlines()[0][:300]
    return None


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")
