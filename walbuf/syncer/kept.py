"""The W&B runs a follow keeps open between its passes: one wandb.init and one file_stream per run, not per pass.

A pass of ``sync --follow`` that opened a run for its upload leaves it open
once W&B is seen to have taken every row (WandbRun.settle), and marks them
synced; the next pass of that run hands its rows to the same run. wandb-core
then sends them on the one file_stream it keeps (a post at most every
FILE_STREAM_INTERVAL seconds, a heartbeat while idle), and upserts the run
only for what changed: W&B hears a few requests a minute instead of an
upsert, its definitions and a file_stream opened and closed at every pass.

A kept run is closed (finished as a pass finishes it, its job going on)
before its run's config changes, before the upload that finishes it in W&B,
before wandb's service is renewed, and when the follow ends. Whatever fails
a kept run's pass ends wandb's service (abandon), so every run kept in it is
forgotten: the next pass opens them again.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, Protocol, TypeVar

from ..store import Target


class Keepable(Protocol):
    """What keeping needs of a run (WandbRun)."""

    @property
    def target(self) -> Target: ...

    def finish(self, exit_code: int | None = None) -> None: ...

    def abandon(self) -> None: ...


R = TypeVar("R", bound=Keepable)


@dataclass
class _Kept(Generic[R]):
    run: R
    config_id: int  # the newest config entry the run was opened with
    folder: Path


class KeptRuns(Generic[R]):
    """The runs kept open in this process, by walbuf run name; their files under ``folder`` (the follow's)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._runs: dict[str, _Kept[R]] = {}
        self._made = 0

    def take(self, name: str, wandb_id: str | None, config_id: int) -> tuple[R, Path] | None:
        """The run kept for ``name`` and its folder, if it serves an upload of this W&B id and config; else None
        (a kept run that does not is closed first: raises what :meth:`close` raises)."""
        kept = self._runs.get(name)
        if kept is None:
            return None
        if kept.config_id != config_id or (wandb_id is not None and kept.run.target.wandb_id != wandb_id):
            # wandb sends a run's config with wandb.init: a new config is a new init.
            self.close(name)
            return None
        del self._runs[name]  # until the upload keeps it again
        return kept.run, kept.folder

    def new_folder(self) -> Path:
        """A folder of its own for a run about to be opened (wandb writes its files and its log there)."""
        self._made += 1
        return self.folder / str(self._made)

    def keep(self, name: str, run: R, config_id: int, folder: Path) -> None:
        """Keep ``run``, opened in ``folder`` with the config up to entry ``config_id``, open for the next pass."""
        self._runs[name] = _Kept(run, config_id, folder)

    def close(self, name: str) -> None:
        """Finish the run kept for ``name``, if any, as a pass finishes its run (the job's state left alone).

        Its rows were confirmed when they were marked synced. Raises what
        WandbRun.finish raises; the run is then abandoned, and so is every
        other run kept in wandb's service.
        """
        kept = self._runs.pop(name, None)
        if kept is None:
            return
        try:
            kept.run.finish()
        except BaseException:
            kept.run.abandon()
            self.forget()
            raise
        finally:
            shutil.rmtree(kept.folder, ignore_errors=True)  # our own folder, under the follow's

    def close_all(self) -> None:
        """Finish every kept run (see :meth:`close`)."""
        for name in list(self._runs):
            self.close(name)

    def forget(self) -> None:
        """Drop every kept run: wandb's service was ended (abandon, restart_wandb), and they with it."""
        for kept in self._runs.values():
            shutil.rmtree(kept.folder, ignore_errors=True)
        self._runs.clear()

    def done_with(self, folder: Path) -> None:
        """Remove the folder of a run opened here that was not kept (finished, or failed)."""
        if all(kept.folder != folder for kept in self._runs.values()):
            shutil.rmtree(folder, ignore_errors=True)


__all__ = ["Keepable", "KeptRuns"]
