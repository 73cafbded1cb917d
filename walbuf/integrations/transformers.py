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

import dataclasses
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from transformers import TrainerCallback

from ..buffer import Location
from ..histogram import Histogram
from ..settings import ENV_RUN, ENV_STEP_AXIS, WriterOptions, WriterSettings
from ..writer import Writer
from .framework import FrameworkWriter

if TYPE_CHECKING:
    from typing_extensions import Unpack

STEP_AXIS = "train/global_step"
"""The Trainer's global step, named as W&B's own callback names it."""
SUMMARY_ONLY = frozenset(
    {"train_runtime", "train_samples_per_second", "train_steps_per_second", "train_loss", "total_flos"}
)
"""What the Trainer logs once at the end, which W&B's callback puts in the summary, not the history."""


class WalbufCallback(TrainerCallback):
    """A ``TrainerCallback`` that logs the Trainer's metrics, and its arguments and model config as the run config.

    ``buffer`` and ``options`` are the settings of :func:`walbuf.init`
    (``run``, ``writer``, ``prefix``, ``step_axis``, ``durability``,
    ``project``, ``entity``, ``run_id``), each defaulting from the
    environment as there, except the step axis: $WALBUF_STEP_AXIS, else
    "train/global_step", and the run: $WALBUF_RUN, else the
    ``TrainingArguments``' ``run_name``, else "default". They are checked
    here (ConfigError), before training starts.

    As W&B's callback does: each ``on_log`` is one record at the trainer's
    global step (its value on the step axis: a job resumed from a checkpoint
    logs again at the steps it logged before, and nothing fails), with
    ``eval_*`` keys renamed ``eval/*``, ``test_*`` ``test/*`` and the others
    ``train/*``; values as W&B's callback stores them (a list from
    ``compute_metrics`` as a list, an array of more than 32 values as a
    histogram, an object as its text), and a key walbuf cannot store left
    out with a warning, never an error; the end-of-training figures
    (``train_runtime``, ``train_loss``, ...) go to the run's summary; at the
    first event (of ``train``, ``evaluate`` or ``predict``) the
    ``TrainingArguments`` and the model's config (and
    ``model/num_parameters``) become the run's config. With ``prefix=""``
    the W&B run has exactly the names W&B's callback gives.

    ``main_process_only``: only the world's process zero writes; otherwise
    every process does. ``log_parameters``: each record of the training
    also holds a 64-bin :class:`walbuf.Histogram` of each parameter, named
    ``parameters/<name>`` as ``wandb.watch`` names them (needs numpy).
    Records are committed when the call returns. The writer closes at the
    end of training (another ``train()``, or another Trainer's callback in
    this process, opens it again) and when the process exits.
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
        # The run comes from TrainingArguments.run_name unless given here or in the environment.
        self._run_given = options.get("run") is not None or bool(os.environ.get(ENV_RUN))
        self._log = FrameworkWriter(WriterSettings.resolve(buffer, **options))
        self._set_up = False
        self.main_process_only = main_process_only
        self.log_parameters = log_parameters

    @property
    def writer(self) -> Writer:
        """This process's walbuf Writer, opened on first use."""
        return self._log.writer

    def close(self) -> None:
        """Close this process's writer (it opens again if the Trainer logs again)."""
        self._log.close()

    def _writes(self, state: Any) -> bool:
        return not self.main_process_only or bool(state.is_world_process_zero)

    def _setup(self, args: Any, state: Any, model: Any) -> None:
        """At the first event: the run (``run_name``), and the arguments and model config as the run's config."""
        if self._set_up or not self._writes(state):
            return
        self._set_up = True
        run_name = getattr(args, "run_name", None)
        if not self._run_given and isinstance(run_name, str) and run_name:
            self._log.settings = dataclasses.replace(self._log.settings, run=run_name)
        config: dict[str, Any] = {}
        model_config = getattr(model, "config", None)
        if model_config is not None:
            config.update(model_config if isinstance(model_config, dict) else model_config.to_dict())
        if args is not None:
            config.update(args.to_dict())
        num_parameters = getattr(model, "num_parameters", None)
        if callable(num_parameters):
            config["model/num_parameters"] = num_parameters()
        self._log.config(config)

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self._setup(args, state, model)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._log.close()

    def on_evaluate(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self._setup(args, state, model)

    def on_log(
        self,
        args: Any,
        state: Any,
        control: Any,
        model: Any = None,
        logs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        self._setup(args, state, model)
        if logs is None or not self._writes(state):
            return
        summary = {k: v for k, v in logs.items() if k in SUMMARY_ONLY}
        history = _renamed({k: v for k, v in logs.items() if k not in SUMMARY_ONLY})
        if summary:
            self._log.summary(summary)
        if not history:
            return
        if self.log_parameters and model is not None and "train/loss" in history:
            history.update({f"parameters/{name}": Histogram(p, num_bins=64) for name, p in model.named_parameters()})
        self._log.log(history, axis=state.global_step)

    def on_predict(self, args: Any, state: Any, control: Any, metrics: Mapping[str, Any], **kwargs: Any) -> None:
        self._setup(args, state, kwargs.get("model"))
        if self._writes(state):
            self._log.log(_renamed(metrics), axis=state.global_step)


def _renamed(logs: Mapping[str, Any]) -> dict[str, Any]:
    """The Trainer's keys as W&B's callback names them (transformers' rewrite_logs)."""
    out = {}
    for key, value in logs.items():
        if key.startswith("eval_"):
            name = "eval/" + key[len("eval_") :]
        elif key.startswith("test_"):
            name = "test/" + key[len("test_") :]
        else:
            name = "train/" + key
        out[name] = value
    return out
