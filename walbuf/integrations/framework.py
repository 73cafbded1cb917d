"""What the integrations share: a writer that follows a framework's life cycle and never raises into training.

A framework's logger must not take a training job down for what it is
given. :class:`FrameworkWriter` wraps a :class:`walbuf.Writer` so that:

- each value is stored as W&B's own integrations store it
  (:func:`walbuf.integrations.values.metric_value`); a key walbuf still
  cannot store (a name W&B refuses, a value over W&B's limit) is left out
  with one warning naming it, and the rest of the record is logged;
- the framework's step is the record's value on the step axis
  (``Writer.log``'s ``axis``), as W&B's loggers log ``trainer/global_step``
  and ``train/global_step``: it may go back (a job resumed from a
  checkpoint, a second ``fit``) and never moves another record;
- the writer opens at first use and closes with :meth:`close` (the end of
  training), to open again at the next use; pickling hands it over (the
  pickling process closes it), so the process that unpickles, a spawned
  worker with the same writer id, can open it.

What is about the buffer (no space left, a buffer of another account) is
raised as ever: those lose records, and a person must know.
"""

from __future__ import annotations

import dataclasses
import operator
import warnings
from collections.abc import Callable, Mapping
from typing import Any, Literal

from ..errors import MetricTypeError, MetricValueError, MissingExtraError
from ..record import encode_config, flatten
from ..settings import WriterSettings
from ..writer import Writer
from .values import metric_value, plain_config


class FrameworkWriter:
    """A Writer for a framework's logger (see the module docstring); picklable as its settings.

    ``writer_id`` gives the writer id in the process that opens it (a
    module-level function, so that it pickles), else the settings' own.
    """

    def __init__(self, settings: WriterSettings, writer_id: Callable[[], str] | None = None) -> None:
        self.settings = settings
        self._writer_id = writer_id
        self._writer: Writer | None = None
        self._warned: set[str] = set()
        self.last_axis = 0  # the framework's last step logged in this process (its steps start at 0)
        self._counted = False  # a log() was called in this process: the next counted one is last_axis + 1

    @property
    def writer(self) -> Writer:
        """This process's Writer, opened on first use (and again after :meth:`close`)."""
        if self._writer is None or self._writer.closed:
            settings = self.settings
            if self._writer_id is not None:
                settings = dataclasses.replace(settings, writer=self._writer_id())
            self._writer = Writer.from_settings(settings)
        return self._writer

    def log(self, values: Mapping[str, Any], axis: Any = None, *, counting: bool = False) -> None:
        """Log ``values`` as one record at the framework's step ``axis``.

        Without ``axis``: the last step logged (0 at first), or, ``counting``,
        the one after it (0 at first), as a tracker whose every call is a
        step of its own (wandb.log without step) counts them.
        """
        record = self._storable(values)
        if axis is None and counting:
            axis = self.last_axis + 1 if self._counted else 0
        self._counted = True
        if axis is not None:
            step = _step(axis)
            if step is None:
                self.warn(f"step {axis!r}", f"a step is an int >= 0, not {axis!r}: logged at the last step")
            else:
                self.last_axis = step
        if not record:
            return
        try:
            self.writer.log(record, axis=self.last_axis)
        except (
            MetricTypeError,
            MetricValueError,
        ) as exc:  # the record as a whole (its size), a key another writer plots
            self.warn(str(exc), f"a record was left out: {exc}")

    def config(self, values: Mapping[str, Any]) -> None:
        """Store ``values`` as the run's config, as W&B's integrations do (what its config cannot hold, as text)."""
        self._set("config", values)

    def summary(self, values: Mapping[str, Any]) -> None:
        """Store ``values`` in the run's summary (what W&B cannot hold, as text)."""
        self._set("summary", values)

    def close(self) -> None:
        """Close this process's writer (it opens again at the next use)."""
        if self._writer is not None:
            self._writer.close()

    def warn(self, key: str, message: str) -> None:
        """Say ``message`` as a Python warning, once for ``key``."""
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(f"walbuf: {message}", stacklevel=3)

    def _set(self, kind: Literal["config", "summary"], values: Mapping[str, Any]) -> None:
        kept = {}
        for key, value in values.items():
            name, plain = str(key), plain_config(value)
            try:
                encode_config({name: plain}, kind)
            except (MetricTypeError, MetricValueError) as exc:
                self.warn(f"{kind} {name}", f"{kind} key {name!r} was left out: {exc}")
                continue
            kept[name] = plain
        if kept:
            (self.writer.config if kind == "config" else self.writer.summary)(kept)

    def _storable(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """``values`` as W&B's integrations store them, less each key walbuf cannot store (warned once)."""
        record: dict[str, Any] = {}
        axis = self.settings.axis()
        for key, value in values.items():
            try:
                item = {key: metric_value(value)}
                flatten(item, axis)
            except (MetricTypeError, MetricValueError, MissingExtraError) as exc:
                self.warn(f"metric {key}", f"metric {key!r} was left out: {exc}")
                continue
            record.update(item)
        return record

    def __getstate__(self) -> dict[str, Any]:
        # Handed over: the process that unpickles opens the writer id anew.
        self.close()
        return {**self.__dict__, "_writer": None}


def _step(value: Any) -> int | None:
    """A framework's step as an int >= 0, or None if it is not one."""
    if isinstance(value, bool):
        return None
    try:
        step = operator.index(value)
    except TypeError:
        return None
    return step if step >= 0 else None
