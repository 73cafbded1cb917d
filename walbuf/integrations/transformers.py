"""A Hugging Face Transformers callback that writes what the Trainer logs to a walbuf buffer.

    from transformers import Trainer, TrainingArguments
    from walbuf.integrations.transformers import WalbufCallback

    args = TrainingArguments("out", report_to="none", logging_steps=10)
    trainer = Trainer(model, args, train_dataset=..., callbacks=[WalbufCallback("runs/exp1.db", run="exp1")])
    trainer.train()

It logs what W&B's own callback (transformers' WandbCallback) logs, under
the same names, and never imports wandb: each record is a local commit, and
`walbuf sync` uploads later. Works under torchrun and ``accelerate launch``:
the main process writes (``main_process_only=True``), or every process,
each as a writer of its own (rank-$RANK by default).

Needs the extra: pip install 'walbuf[transformers]'.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from transformers import TrainerCallback

from ..buffer import Location
from ..histogram import Histogram
from ..settings import ENV_STEP_AXIS, WriterOptions, WriterSettings
from ..writer import Writer
from .values import plain_config, plain_metric

if TYPE_CHECKING:
    from typing_extensions import Unpack

STEP_AXIS = "train/global_step"
"""The Trainer's global step, named as W&B's own callback names it."""
SUMMARY_ONLY = frozenset({"train_runtime", "train_samples_per_second", "train_steps_per_second", "train_loss", "total_flos"})
"""What the Trainer logs once at the end, which W&B's callback puts in the summary, not the history."""


class WalbufCallback(TrainerCallback):
    """A ``TrainerCallback`` that logs the Trainer's metrics, and its arguments and model config as the run config.

    ``buffer`` and ``options`` are the settings of :func:`walbuf.init`
    (``run``, ``writer``, ``prefix``, ``step_axis``, ``durability``,
    ``project``, ``entity``, ``run_id``), each defaulting from the
    environment as there, except the step axis: $WALBUF_STEP_AXIS, else
    "train/global_step". They are checked here (ConfigError), before
    training starts.

    As W&B's callback does: each ``on_log`` is one record at the trainer's
    global step, with ``eval_*`` keys renamed ``eval/*``, ``test_*``
    ``test/*`` and the others ``train/*``; the end-of-training figures
    (``train_runtime``, ``train_loss``, ...) go to the run's summary; at
    the start of training the ``TrainingArguments`` and the model's config
    (and ``model/num_parameters``) become the run's config. With
    ``prefix=""`` the W&B run has exactly the names W&B's callback gives.

    ``main_process_only``: only the world's process zero writes; otherwise
    every process does. ``log_parameters``: each record of the training
    also holds a 64-bin :class:`walbuf.Histogram` of each parameter, named
    ``parameters/<name>`` as ``wandb.watch`` names them (needs numpy). Records are committed when the call returns; the
    writer closes when the process exits (or at :meth:`close`).
    """

    def __init__(
        self,
        buffer: Location | None = None,
        *,
        main_process_only: bool = True,
        log_parameters: bool = False,
        **options: Unpack[WriterOptions],
    ) -> None:
        if options.get("step_axis") is None:
            options["step_axis"] = os.environ.get(ENV_STEP_AXIS) or STEP_AXIS
        self._settings = WriterSettings.resolve(buffer, **options)
        self.main_process_only = main_process_only
        self.log_parameters = log_parameters
        self._writer: Writer | None = None

    @property
    def writer(self) -> Writer:
        """This process's walbuf Writer, opened on first use."""
        if self._writer is None or self._writer.closed:
            self._writer = Writer.from_settings(self._settings)
        return self._writer

    def close(self) -> None:
        """Close this process's writer (it opens again if the Trainer logs again)."""
        if self._writer is not None:
            self._writer.close()

    def _writes(self, state: Any) -> bool:
        return not self.main_process_only or bool(state.is_world_process_zero)

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if not self._writes(state):
            return
        config: dict[str, Any] = {}
        model_config = getattr(model, "config", None)
        if model_config is not None:
            config.update(model_config if isinstance(model_config, dict) else model_config.to_dict())
        config.update(args.to_dict())
        num_parameters = getattr(model, "num_parameters", None)
        if callable(num_parameters):
            config["model/num_parameters"] = num_parameters()
        self.writer.config({str(k): plain_config(v) for k, v in config.items()})

    def on_log(
        self, args: Any, state: Any, control: Any, model: Any = None, logs: Mapping[str, Any] | None = None, **kwargs: Any
    ) -> None:
        if logs is None or not self._writes(state):
            return
        summary = {k: plain_metric(v) for k, v in logs.items() if k in SUMMARY_ONLY}
        history = _renamed({k: v for k, v in logs.items() if k not in SUMMARY_ONLY})
        if summary:
            self.writer.summary(summary)
        if not history:
            return
        if self.log_parameters and model is not None and "train/loss" in history:
            history.update(
                {f"parameters/{name}": Histogram(p, num_bins=64) for name, p in model.named_parameters()}
            )
        self.writer.log(history, step=state.global_step)

    def on_predict(self, args: Any, state: Any, control: Any, metrics: Mapping[str, Any], **kwargs: Any) -> None:
        if self._writes(state):
            self.writer.log(_renamed(metrics), step=state.global_step)


def _renamed(logs: Mapping[str, Any]) -> dict[str, Any]:
    """The Trainer's keys as W&B's callback names them (transformers' rewrite_logs)."""
    out = {}
    for key, value in logs.items():
        if key.startswith("eval_"):
            name = "eval/" + key[len("eval_"):]
        elif key.startswith("test_"):
            name = "test/" + key[len("test_"):]
        else:
            name = "train/" + key
        out[name] = plain_metric(value)
    return out
