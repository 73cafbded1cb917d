"""What the integrations share: framework values made into what walbuf stores, as W&B's integrations store them.

The reference is wandb's own conversion of a logged value
(``wandb.util.json_friendly``, which W&B's Lightning logger, Transformers
callback and Accelerate tracker all go through): a tensor or array of one
value is that value, of up to 32 values a list, of more a 32-bin histogram;
a numpy scalar its Python value; bytes decoded text; a date its ISO text;
an enum its name; a set a list; a function its qualified name. What wandb
has no form for is stored as its ``str()`` (for a metric wandb would fail,
for a hyperparameter W&B's loggers store ``str()`` too). Imports no
framework: arrays and tensors are recognised by what they have
(``tolist``, ``size``/``numel``).
"""

from __future__ import annotations

import datetime
import enum
from collections.abc import Mapping
from typing import Any

from ..histogram import Histogram
from ..image import Image

_PLAIN = (int, float, bool, str, type(None))
ARRAY_AS_LIST = 32  # values: an array of more is a histogram (wandb.util: json_friendly, maybe_compress_history)


def metric_value(value: Any) -> Any:
    """A logged value as W&B's integrations store it (see the module docstring); dicts and lists converted inside."""
    if isinstance(value, (*_PLAIN, Histogram, Image)):
        return value
    if isinstance(value, Mapping):
        return {k: metric_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [metric_value(v) for v in value]
    size = _size(value)
    if size is not None:
        if size == 1:
            return _item(value)
        if size <= ARRAY_AS_LIST:
            return value.tolist()
        return Histogram(value, num_bins=ARRAY_AS_LIST)
    return _text(value)


def plain_config(value: Any) -> Any:
    """``value`` as W&B's config holds it: plain values, lists and str-keyed dicts; anything else as text."""
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, Mapping):
        return {str(k): plain_config(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [plain_config(v) for v in value]
    if _size(value) == 1:
        item = _item(value)
        return item if isinstance(item, _PLAIN) else _text(value)
    return _text(value)


def _size(value: Any) -> int | None:
    """How many values an array or tensor holds (None: it is not one)."""
    if not callable(getattr(value, "tolist", None)):
        return None
    numel = getattr(value, "numel", None)  # torch: size is a method
    size = numel() if callable(numel) else getattr(value, "size", None)
    return size if isinstance(size, int) else None


def _item(value: Any) -> Any:
    """The one value of an array, tensor or numpy scalar, as Python's (complex and dates as text)."""
    item = value.item() if callable(getattr(value, "item", None)) else value.tolist()
    while isinstance(item, list) and len(item) == 1:
        item = item[0]
    return item if isinstance(item, _PLAIN) else _text(item)


def _text(value: Any) -> Any:
    """What has no JSON form, as wandb writes it: bytes as text, a date in ISO form, an enum's name, a function's
    name."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, (datetime.date, datetime.datetime)):
        return value.isoformat()
    if isinstance(value, enum.Enum):
        return value.name
    if callable(value) and hasattr(value, "__qualname__") and hasattr(value, "__module__"):
        return f"{value.__module__}.{value.__qualname__}"
    return str(value)
