"""An Accelerate tracker that writes to a walbuf buffer: ``Accelerator(log_with=WalbufTracker(buffer=...))``.

    from accelerate import Accelerator
    from walbuf.integrations.accelerate import WalbufTracker

    tracker = WalbufTracker(buffer="runs/exp1.db", run="exp1")  # or WALBUF_BUFFER, WALBUF_RUN, ...
    accelerator = Accelerator(log_with=tracker)
    accelerator.init_trackers("my-project", config={"lr": 1e-3})  # the config, stored once
    accelerator.log({"loss": loss}, step=step)                    # the main process
    tracker.log({"loss": local_loss}, step=step)                  # any process, each a writer of its own
    accelerator.end_training()

Or by name, as Accelerate's own trackers (Accelerate >= 1.15)::

    register_tracker_class(WalbufTracker)
    accelerator = Accelerator(log_with="walbuf")                  # the buffer: WALBUF_BUFFER
    accelerator.init_trackers("my-project")                       # the W&B project, as for W&B's tracker

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
from ..errors import ConfigError
from ..image import Image
from ..settings import WriterOptions, WriterSettings
from ..writer import Writer
from .framework import FrameworkWriter

if TYPE_CHECKING:
    from typing_extensions import Unpack


class WalbufTracker(GeneralTracker):
    """An Accelerate ``GeneralTracker`` whose run is a walbuf writer.

    ``run_name`` is Accelerate's project name, which it passes to a tracker
    it makes by name (``init_trackers("my-project")`` after
    ``register_tracker_class``): as for W&B's tracker, it is the W&B project
    unless ``project=`` is given. ``buffer`` and ``options`` are the settings
    of :func:`walbuf.init` (``run``, ``writer``, ``prefix``, ``step_axis``,
    ``durability``, ``project``, ``entity``, ``run_id``), each defaulting
    from the environment as there (the buffer: $WALBUF_BUFFER): the writer
    id is rank-$RANK under ``accelerate launch`` or ``torchrun``, its keys
    are logged under that prefix (give ``prefix=""`` for keys as logged).
    They are checked here, so a bad one fails before training starts
    (ConfigError).

    ``log``'s step is the record's value on the step axis: it may go back
    (a job resumed from a checkpoint) without moving another record. Values
    are stored as W&B's tracker stores them (lists as lists, an array of
    more than 32 values as a histogram, an object as its text); a key
    walbuf cannot store, and a keyword argument walbuf has no use for, are
    left out with a warning, never an error.

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
        run_name: str | None = None,
        *,
        buffer: Location | None = None,
        main_process_only: bool = False,
        **options: Unpack[WriterOptions],
    ) -> None:
        super().__init__()
        if run_name is not None:
            if not isinstance(run_name, str) or "/" in run_name or run_name.endswith(".db"):
                raise ConfigError(
                    f"WalbufTracker's first argument is Accelerate's project name, not a buffer ({run_name!r});"
                    " give the buffer as buffer=..."
                )
            if options.get("project") is None:
                options["project"] = run_name
        # Resolved in the process that makes the tracker: a relative path
        # against its working directory, and its environment's run.
        self._log = FrameworkWriter(WriterSettings.resolve(buffer, **options))
        self.main_process_only = main_process_only

    @property
    def tracker(self) -> Writer:
        """This process's walbuf Writer, opened on first use."""
        return self._log.writer

    def store_init_configuration(self, values: Mapping[str, Any]) -> None:
        """Store ``values`` as the run's config (what W&B's config cannot hold, as its text)."""
        if not self._skipped():
            self._log.config(values)

    def log(self, values: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Log ``values`` as one record at ``step`` (default: the step after the last one logged, 0 at first, as
        W&B's tracker counts a log without a step)."""
        self._unused(kwargs, "log")
        if not self._skipped():
            self._log.log(values, axis=step, counting=True)

    def log_images(self, values: Mapping[str, list[Any]], step: int | None = None, **kwargs: Any) -> None:
        """Log images (numpy arrays, PIL images, file paths): a list of them per key, as W&B's tracker takes.

        One image is logged as its key, several as ``key/0``, ``key/1``, ...
        """
        self._unused(kwargs, "log_images")
        if self._skipped():
            return
        record = {}
        for key, images in values.items():
            for i, image in enumerate(images):
                name = key if len(images) == 1 else f"{key}/{i}"
                try:
                    record[name] = Image(image)
                except (
                    TypeError,
                    ValueError,
                    ImportError,
                ) as exc:  # walbuf's MetricTypeError, ...ValueError, MissingExtraError
                    self._log.warn(f"image {name}", f"image {name!r} was left out: {exc}")
        self._log.log(record, axis=step, counting=True)

    def finish(self) -> None:
        """Close this process's writer (it is opened again if the tracker logs again)."""
        self._log.close()

    def _unused(self, kwargs: Mapping[str, Any], method: str) -> None:
        for name in kwargs:
            self._log.warn(f"{method} {name}", f"{method}'s {name!r} is left out: walbuf has no use for it")

    def _skipped(self) -> bool:
        return self.main_process_only and not _is_main_process()


def _is_main_process() -> bool:
    # Accelerate's own answer once a state exists; before one, the launcher's rank.
    if PartialState._shared_state:
        return bool(PartialState().is_main_process)
    return os.environ.get("RANK", "0") == "0"
