"""The record: what one log() call stores, and the validation of its metrics.

A record is (run, writer, step, time, metrics). Metric values are int, float,
bool, str or None; numpy and torch scalars and 0-d arrays are converted to
those (without importing numpy or torch: they are recognised by type name);
nested mappings are flattened with "/". Anything else is refused with a
:class:`~walbuf.errors.MetricTypeError` naming the key, before anything is
written.

Metrics are stored as JSON text. Python's json module writes NaN and +-inf as
the literals NaN/Infinity/-Infinity and reads them back, and floats round-trip
exactly through repr, so every accepted value comes back as it went in.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Union

from .errors import MetricTypeError, MetricValueError

Value = Union[int, float, bool, str, None]
"""A metric value as stored and read back."""

_PRIMITIVE = frozenset({int, float, bool, str, type(None)})


@dataclass(frozen=True)
class Record:
    """One logged record, as read back from a buffer.

    ``step`` is the writer's own step (its step axis), ``time`` the wall-clock
    time (seconds since the epoch) at which log() was called, ``metrics`` the
    flattened metrics.
    """

    run: str
    writer: str
    step: int
    time: float
    metrics: dict[str, Value]


def _scalar(value: Any) -> Any:
    """Convert a numpy/torch scalar or 0-d array to a Python value; else return ``value``."""
    module = type(value).__module__ or ""
    if module == "numpy" or module.startswith(("numpy.", "torch")):
        ndim = getattr(value, "ndim", None)
        if ndim == 0 and hasattr(value, "item"):
            return value.item()
    return value


def _convert(key: str, value: Any) -> Value:
    kind = type(value)
    if kind in _PRIMITIVE:
        return value
    # Subclasses (numpy.float64 is a float, IntEnum an int) are stored as the base kind.
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, str):
        return str(value)
    converted = _scalar(value)
    if converted is not value and type(converted) in _PRIMITIVE:
        return converted
    raise MetricTypeError(
        f"metric {key!r} has a value of type {kind.__module__}.{kind.__qualname__}, "
        "which walbuf does not store; log an int, float, bool, str, None, a numpy or "
        "torch scalar, or a dict of those (nothing was written)"
    )


def flatten(metrics: Any, reserved: str | None = None) -> dict[str, Value]:
    """Validate ``metrics`` and return them flattened, nested keys joined with "/".

    ``reserved`` is a key the caller may not use (the writer's step axis).
    Raises MetricTypeError or MetricValueError, naming the key.
    """
    if not isinstance(metrics, Mapping):
        raise MetricTypeError(
            f"metrics must be a dict of name -> value, not {type(metrics).__qualname__}"
            " (nothing was written)"
        )
    flat: dict[str, Value] = {}
    _flatten_into(flat, "", metrics)
    if reserved is not None and reserved in flat:
        raise MetricValueError(
            f"metric {reserved!r} is this writer's step axis; pass the step as "
            "log(..., step=N) instead (nothing was written)"
        )
    return flat


def _flatten_into(flat: dict[str, Value], prefix: str, metrics: Mapping[Any, Any]) -> None:
    for key, value in metrics.items():
        if (
            type(key) is str
            and key
            and "*" not in key
            and type(value) in _PRIMITIVE
            and prefix + key not in flat
        ):
            flat[prefix + key] = value  # the common case, checked cheaply
            continue
        if type(key) is not str:
            if not isinstance(key, str):
                raise MetricTypeError(
                    f"metric key {prefix + repr(key)} is of type {type(key).__qualname__};"
                    " keys must be str (nothing was written)"
                )
            key = str(key)
        if "*" in key:
            raise MetricValueError(
                f"metric key {prefix + key!r} contains '*', which W&B's define_metric"
                " reads as a wildcard; rename it (nothing was written)"
            )
        if not key:
            raise MetricValueError(
                f"empty metric key{' under ' + repr(prefix[:-1]) if prefix else ''}"
                " (nothing was written)"
            )
        name = prefix + key
        if isinstance(value, Mapping):
            _flatten_into(flat, name + "/", value)
            continue
        if name in flat:
            raise MetricValueError(
                f"metric {name!r} is given twice (once nested, once with '/' in its key)"
                " (nothing was written)"
            )
        flat[name] = _convert(name, value)


# Made once: json.dumps() with arguments builds a new encoder on every call.
encode = json.JSONEncoder(separators=(",", ":"), allow_nan=True).encode
"""Serialise flattened metrics for storage (JSON; NaN and +-inf kept)."""

decode = json.JSONDecoder().decode
"""Inverse of :func:`encode`."""


def encode_config(values: Any) -> dict[str, str]:
    """Run config as given to Writer.config(): each top-level key with its value as JSON text.

    Values are what W&B's config holds: int, float, bool, str, None, numpy or
    torch scalars, and lists and str-keyed dicts of those (kept nested).
    Anything else raises MetricTypeError naming the key; an empty or non-str
    key, MetricValueError. Nothing is stored on error.
    """
    if not isinstance(values, Mapping):
        raise MetricTypeError(f"config must be a mapping of str keys, not {type(values).__qualname__}")
    encoded = {}
    for key, value in values.items():
        if not isinstance(key, str) or not key:
            raise MetricValueError(f"config key {key!r} must be a non-empty str (nothing was stored)")
        encoded[key] = json.dumps(_config_value(key, value), allow_nan=True)
    return encoded


def _config_value(key: str, value: Any) -> Any:
    if isinstance(value, Mapping):
        out = {}
        for sub, item in value.items():
            if not isinstance(sub, str):
                raise MetricValueError(f"config key {key!r} holds a non-str key {sub!r} (nothing was stored)")
            out[sub] = _config_value(f"{key}.{sub}", item)
        return out
    if isinstance(value, (list, tuple)):
        return [_config_value(f"{key}[{i}]", item) for i, item in enumerate(value)]
    try:
        return _convert(key, value)
    except MetricTypeError:
        kind = type(value)
        raise MetricTypeError(
            f"config key {key!r} has a value of type {kind.__module__}.{kind.__qualname__};"
            " give an int, float, bool, str, None, or a list or dict of those (nothing was stored)"
        ) from None
