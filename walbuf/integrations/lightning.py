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

import dataclasses
import os
from argparse import Namespace
from collections.abc import Mapping
from typing import Any

from lightning_fabric.utilities.logger import _convert_params, _sanitize_callable_params
from pytorch_lightning.loggers.logger import Logger
from pytorch_lightning.utilities import rank_zero_only

from ..settings import WriterSettings
from ..store import Durability
from ..writer import Writer
from .values import plain_config, plain_metric


class WalbufLogger(Logger):
    """Logs each rank's metrics, on its own step axis, and the hyperparameters, to a buffer.

    ``buffer``: a path, a directory or a PostgreSQL URL, as for
    :func:`walbuf.init` (default: $WALBUF_BUFFER). ``run``: the walbuf run
    (default: $WALBUF_RUN, else "default"); in W&B one run. By default every
    rank is a writer of its own, ``rank-<global rank>``, its metrics logged
    as ``rank-N/<metric>`` against ``rank-N/<step_axis>`` (the trainer's
    global step). With ``rank_zero_only=True`` only rank 0 writes.
    ``writer`` overrides the id; a "{rank}" in it is replaced by the rank.
    Hyperparameters become the W&B run's config at sync (see
    :meth:`walbuf.Writer.config`); values W&B cannot hold are stored as
    their str(), as WandbLogger does. ``project``, ``entity`` and ``run_id``
    choose the W&B run, as for :func:`walbuf.init`.

    Records are committed when log_metrics returns: a rank killed later
    loses none of them.
    """

    def __init__(
        self,
        buffer: str | os.PathLike[str] | None = None,
        *,
        run: str | None = None,
        writer: str | None = None,
        step_axis: str = "global_step",
        rank_zero_only: bool = False,
        project: str | None = None,
        entity: str | None = None,
        run_id: str | None = None,
        durability: Durability = "normal",
    ) -> None:
        super().__init__()
        # Resolved here, in the launcher: the buffer's path is made absolute
        # against its working directory, and the run comes from its environment.
        self._settings = WriterSettings.resolve(
            buffer,
            run=run,
            step_axis=step_axis,
            durability=durability,
            project=project,
            entity=entity,
            run_id=run_id,
        )
        self._writer_template = writer or "rank-{rank}"
        self._rank_zero_only = rank_zero_only
        self._writer: Writer | None = None

    # -- Logger's properties ------------------------------------------------------

    @property
    def name(self) -> str:
        """The walbuf run."""
        return self._settings.run

    @property
    def version(self) -> str:
        """This process's writer id."""
        return self._writer_template.format(rank=_rank())

    @property
    def experiment(self) -> Writer | None:
        """This process's walbuf Writer (opened on first use); None on ranks that do not write."""
        if not self._writes():
            return None
        if self._writer is None or self._writer.closed:
            self._writer = Writer.from_settings(dataclasses.replace(self._settings, writer=self.version))
        return self._writer

    # -- what Lightning calls -------------------------------------------------------

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        writer = self.experiment
        if writer is None:
            return
        values = {k: plain_metric(v) for k, v in metrics.items()}
        if step is not None and writer.last_step is not None and step < writer.last_step:
            step = writer.last_step  # Lightning may log epoch-end metrics for an earlier step
        writer.log(values, step=step)

    def log_hyperparams(self, params: dict[str, Any] | Namespace, *args: Any, **kwargs: Any) -> None:
        writer = self.experiment
        if writer is None:
            return
        params = _sanitize_callable_params(_convert_params(params))
        writer.config({str(k): plain_config(v) for k, v in params.items()})

    def save(self) -> None:
        # Every record is committed already; nothing to write out.
        pass

    def finalize(self, status: str) -> None:
        if self._writer is not None:
            self._writer.close()

    # -- pickling: settings only ---------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_writer"] = None  # a worker opens its own
        return state

    def _writes(self) -> bool:
        return not self._rank_zero_only or _rank() == 0


def _rank() -> int:
    # Lightning sets this in every process it starts (ddp, ddp_spawn), before the logger is used.
    return int(getattr(rank_zero_only, "rank", 0) or 0)
