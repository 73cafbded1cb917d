"""An Accelerate tracker that writes to a walbuf buffer: ``Accelerator(log_with=WalbufTracker())``.

    from accelerate import Accelerator
    from walbuf.integrations.accelerate import WalbufTracker

    tracker = WalbufTracker("runs/exp1.db", run="exp1")  # or WALBUF_BUFFER, WALBUF_RUN, ...
    accelerator = Accelerator(log_with=tracker)
    accelerator.init_trackers("exp1", config={"lr": 1e-3})   # the config, stored once
    accelerator.log({"loss": loss}, step=step)               # the main process
    tracker.log({"loss": local_loss}, step=step)             # any process, each a writer of its own
    accelerator.end_training()

It never imports wandb: each process appends to the buffer (a local
commit), and `walbuf sync` uploads later. Accelerate runs ``init_trackers``,
``log`` and ``end_training`` on the main process only; to log from every
process, call the tracker's own ``log`` (each process is then a writer of
its own, rank-$RANK by default) and ``finish`` (or let the process exit:
a writer is closed then).

Needs the extra: pip install 'walbuf[accelerate]'.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from accelerate.state import PartialState  # type: ignore[import-untyped]
from accelerate.tracking import GeneralTracker  # type: ignore[import-untyped]

from ..buffer import Location
from ..settings import WriterOptions, WriterSettings
from ..writer import Writer
from .values import plain_config, plain_metric

if TYPE_CHECKING:
    from typing_extensions import Unpack


class WalbufTracker(GeneralTracker):
    """An Accelerate ``GeneralTracker`` whose run is a walbuf writer.

    ``buffer`` and ``options`` are the settings of :func:`walbuf.init`
    (``run``, ``writer``, ``prefix``, ``step_axis``, ``durability``,
    ``project``, ``entity``, ``run_id``), each defaulting from the
    environment as there: the writer id is rank-$RANK under ``accelerate
    launch`` or ``torchrun``, its keys are logged under that prefix (give
    ``prefix=""`` for keys as logged). They are checked here, so a bad one
    fails before training starts (ConfigError). Accelerate does not pass
    ``init_trackers``' project name to a tracker made by the user: give the
    W&B project as ``project=`` (or WANDB_PROJECT when syncing).

    ``main_process_only``: when true, :meth:`log` and
    :meth:`store_init_configuration` do nothing outside the main process;
    by default each process that calls them writes.

    A record is committed when :meth:`log` returns: a process killed later
    loses none of them.
    """

    name = "walbuf"
    requires_logging_directory = False

    def __init__(
        self,
        buffer: Location | None = None,
        *,
        main_process_only: bool = False,
        **options: Unpack[WriterOptions],
    ) -> None:
        super().__init__()
        # Resolved in the process that makes the tracker: a relative path
        # against its working directory, and its environment's run.
        self._settings = WriterSettings.resolve(buffer, **options)
        self.main_process_only = main_process_only
        self._writer: Writer | None = None

    @property
    def tracker(self) -> Writer:
        """This process's walbuf Writer, opened on first use."""
        if self._writer is None or self._writer.closed:
            self._writer = Writer.from_settings(self._settings)
        return self._writer

    def store_init_configuration(self, values: Mapping[str, Any]) -> None:
        """Store ``values`` as the run's config (what W&B's config cannot hold, as its str())."""
        if self._skipped():
            return
        self.tracker.config({str(k): plain_config(v) for k, v in values.items()})

    def log(self, values: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Log ``values`` (0-d tensors taken as numbers) as one record at ``step`` (default: the next)."""
        if self._skipped():
            return
        self.tracker.log({k: plain_metric(v) for k, v in values.items()}, step=step)

    def finish(self) -> None:
        """Close this process's writer (it is opened again if the tracker logs again)."""
        if self._writer is not None:
            self._writer.close()

    def _skipped(self) -> bool:
        return self.main_process_only and not _is_main_process()


def _is_main_process() -> bool:
    # Accelerate's own answer once a state exists; before one, the launcher's rank.
    if PartialState._shared_state:
        return bool(PartialState().is_main_process)
    return os.environ.get("RANK", "0") == "0"
