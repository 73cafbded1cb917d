"""A PyTorch Lightning logger that writes to a walbuf buffer from every rank.

    from walbuf.integrations.lightning import WalbufLogger
    trainer = pl.Trainer(logger=WalbufLogger("runs/exp1.db", run="exp1"), strategy="ddp_spawn", devices=2)

Unlike WandbLogger it never creates a wandb run, in any process: each rank
appends to the buffer (a local commit), and `walbuf sync` uploads later. It
pickles as its settings, so spawned workers get a logger of their own.

Needs the extra: pip install 'walbuf[lightning]'. Importing walbuf itself
imports neither lightning nor torch.
"""

from __future__ import annotations

import functools
import os
import secrets
import string
from argparse import Namespace
from collections.abc import Mapping
from typing import Any

from lightning_fabric.utilities.logger import _add_prefix, _convert_params, _sanitize_callable_params
from pytorch_lightning.loggers.logger import DummyExperiment, Logger
from pytorch_lightning.utilities import rank_zero_only

from ..image import Image
from ..settings import WriterSettings
from ..store import Durability
from ..writer import Writer
from .framework import FrameworkWriter

STEP_AXIS = "trainer/global_step"
"""The trainer's global step, named as WandbLogger names it."""


class Experiment:
    """What ``logger.experiment`` is: logging through the logger's writer, as with W&B's run.

    ``log(metrics)`` without a step logs at the trainer's last step (as W&B
    plots a row without its step metric, ``step_sync``), never moving the
    trainer's own records. ``writer`` is the :class:`walbuf.Writer` itself.
    """

    def __init__(self, log: FrameworkWriter) -> None:
        self._log = log

    def log(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Log ``metrics`` as one record at the trainer's ``step`` (default: its last one)."""
        self._log.log(metrics, axis=step)

    def config(self, values: Mapping[str, Any]) -> None:
        """Set run config (what W&B's config cannot hold, as text)."""
        self._log.config(values)

    def summary(self, values: Mapping[str, Any]) -> None:
        """Set run summary values."""
        self._log.summary(values)

    @property
    def writer(self) -> Writer:
        """This process's walbuf Writer (opened on first use)."""
        return self._log.writer


class WalbufLogger(Logger):
    """Logs each rank's metrics, on its own step axis, and the hyperparameters, to a buffer.

    ``buffer``: a path, a directory or a PostgreSQL URL, as for
    :func:`walbuf.init` (default: $WALBUF_BUFFER). ``run``: the walbuf run
    (default: $WALBUF_RUN, else "default"); in W&B one run, and this
    logger's ``name``. By default every rank is a writer of its own,
    ``rank-<global rank>``, its metrics logged as ``rank-N/<metric>``
    against ``rank-N/trainer/global_step``, the trainer's global step, which
    may go back (a fit resumed from a checkpoint) without moving any other
    record. With ``rank_zero_only=True`` only rank 0 writes, and
    ``experiment`` is Lightning's no-op dummy on the others. ``writer``
    overrides the id; a "{rank}" in it is replaced by the rank. ``prefix``
    goes before each metric key, joined with "-", as in Lightning's loggers.
    Values are stored as WandbLogger stores them (lists as lists, an array
    of more than 32 values as a histogram, an object as its text); a key
    walbuf cannot store is left out with a warning, never an error.
    Hyperparameters become the W&B run's config at sync (see
    :meth:`walbuf.Writer.config`). ``project``, ``entity`` and ``run_id``
    choose the W&B run, as for :func:`walbuf.init`.

    ``save_dir`` (default ".") is where checkpoints go, in
    ``save_dir/<run>/<version>/checkpoints``; ``version`` (default: the W&B
    run id if given, else a new id) tells this logger's runs apart there.

    Records are committed when log_metrics returns: a rank killed later
    loses none of them. The writer closes at the end of each fit, test or
    validation (``finalize``), and a logger pickled (for ``ddp_spawn``
    workers) hands its writer over: the process that pickles it closes it.
    """

    LOGGER_JOIN_CHAR = "-"

    def __init__(
        self,
        buffer: str | os.PathLike[str] | None = None,
        *,
        run: str | None = None,
        writer: str | None = None,
        step_axis: str = STEP_AXIS,
        prefix: str = "",
        rank_zero_only: bool = False,
        project: str | None = None,
        entity: str | None = None,
        run_id: str | None = None,
        durability: Durability = "normal",
        save_dir: str | os.PathLike[str] = ".",
        version: str | None = None,
    ) -> None:
        super().__init__()
        # Resolved here, in the launcher: the buffer's path is made absolute
        # against its working directory, and the run comes from its environment.
        settings = WriterSettings.resolve(
            buffer,
            run=run,
            step_axis=step_axis,
            durability=durability,
            project=project,
            entity=entity,
            run_id=run_id,
        )
        self._log = FrameworkWriter(settings, functools.partial(_writer_of_rank, writer or "rank-{rank}"))
        self._prefix = prefix
        self._rank_zero_only = rank_zero_only
        self._save_dir = os.fspath(save_dir)
        self._version = version or run_id or _new_version()

    # -- Logger's properties ------------------------------------------------------

    @property
    def name(self) -> str:
        """The walbuf run."""
        return self._log.settings.run

    @property
    def version(self) -> str:
        """This logger's id (the W&B run id if one was given)."""
        return self._version

    @property
    def save_dir(self) -> str:
        """Where checkpoints and LightningCLI's config go (under ``name/version``)."""
        return self._save_dir

    @property
    def experiment(self) -> Experiment | DummyExperiment:
        """Logging through this process's writer; Lightning's no-op dummy on a rank that does not write."""
        if not self._writes():
            return DummyExperiment()
        return Experiment(self._log)

    # -- what Lightning calls -------------------------------------------------------

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        if self._writes():
            self._log.log(_add_prefix(dict(metrics), self._prefix, self.LOGGER_JOIN_CHAR), axis=step)

    def log_hyperparams(self, params: dict[str, Any] | Namespace, *args: Any, **kwargs: Any) -> None:
        if self._writes():
            self._log.config(_sanitize_callable_params(_convert_params(params)))

    def log_image(self, key: str, images: list[Any], step: int | None = None, **kwargs: Any) -> None:
        """Log images (numpy arrays, torch tensors CxHxW or HxWxC, PIL images, file paths), as WandbLogger does.

        One image is logged as ``key``, several as ``key/0``, ``key/1``, ...
        (a record holds no list of images). Of the keyword arguments (lists,
        one item per image) ``caption`` is kept; the others are left out,
        with a warning.
        """
        if not isinstance(images, list):
            raise TypeError(f'Expected a list as "images", found {type(images)}')
        for name, values in kwargs.items():
            if len(values) != len(images):
                raise ValueError(f"Expected {len(images)} items but only found {len(values)} for {name}")
        for name in kwargs:
            if name != "caption":
                self._log.warn(
                    f"log_image {name}", f"log_image's {name!r} is left out: walbuf keeps an image's caption"
                )
        if not self._writes():
            return
        captions = kwargs.get("caption", [None] * len(images))
        record = {}
        for i, (image, caption) in enumerate(zip(images, captions, strict=False)):
            name = key if len(images) == 1 else f"{key}/{i}"
            try:
                record[name] = Image(_image_data(image), caption=None if caption is None else str(caption))
            except (
                TypeError,
                ValueError,
                ImportError,
            ) as exc:  # walbuf's MetricTypeError, MetricValueError, MissingExtraError
                self._log.warn(f"image {name}", f"image {name!r} was left out: {exc}")
        self.log_metrics(record, step)

    def save(self) -> None:
        # Every record is committed already; nothing to write out.
        pass

    def finalize(self, status: str) -> None:
        self._log.close()

    def _writes(self) -> bool:
        return not self._rank_zero_only or _rank() == 0


def _rank() -> int:
    # Lightning sets this in every process it starts (ddp, ddp_spawn), before the logger is used.
    return int(getattr(rank_zero_only, "rank", 0) or 0)


def _writer_of_rank(template: str) -> str:
    """The writer id of this process's rank (module-level: the logger pickles it)."""
    return template.format(rank=_rank())


def _new_version() -> str:
    """A new logger version: 8 base-36 digits, as wandb makes a run id."""
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


def _image_data(image: Any) -> Any:
    """A torch tensor as the HxWxC numpy array walbuf.Image takes (W&B's Image takes CxHxW tensors too)."""
    if type(image).__module__.startswith("torch") and hasattr(image, "detach"):
        array = image.detach().cpu()
        if array.is_floating_point():
            array = array.float()  # numpy has no bfloat16
        if array.ndim == 3 and array.shape[0] in (1, 3, 4) and array.shape[-1] not in (1, 3, 4):
            array = array.permute(1, 2, 0)
        return array.numpy()
    return image
