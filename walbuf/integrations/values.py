"""What the integrations share: framework values made into what walbuf stores.

Frameworks hand trackers 0-d tensors for metrics and objects of every kind
for hyperparameters (dtypes, enums, paths, callables). Metrics keep walbuf's
rules (a value it cannot store is an error naming the key); hyperparameters
W&B's config cannot hold are stored as their str(), as W&B's own
integrations do. Imports no framework.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

_PLAIN = (int, float, bool, str, type(None))


def plain_metric(value: Any) -> Any:
    """A 0-d tensor or array as its Python value; anything else as it is (the writer checks it)."""
    item = getattr(value, "item", None)
    if not isinstance(value, _PLAIN) and callable(item) and getattr(value, "ndim", 0) == 0:
        return item()
    return value


def plain_config(value: Any) -> Any:
    """``value`` as W&B's config holds it: plain values, lists and str-keyed dicts; anything else as str()."""
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, Mapping):
        return {str(k): plain_config(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain_config(v) for v in value]
    item = getattr(value, "item", None)
    if callable(item) and getattr(value, "ndim", None) == 0:
        return item()
    return str(value)
