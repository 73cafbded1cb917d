"""Checks of the numbers walbuf's functions take as arguments: one rule and one wording for each kind.

A bad value raises ConfigError naming the argument, before anything is
opened or written.
"""

from __future__ import annotations

import math
import os

from .errors import ConfigError


def count(name: str, value: object) -> int:
    """``value``, a positive int (not a bool); else ConfigError naming the argument ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name} must be a positive int, not {value!r}")
    return value


def seconds(name: str, value: object, *, positive: bool = False) -> float:
    """``value``, a finite number of seconds >= 0 (> 0 if ``positive``; not a bool); else ConfigError naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"{name} must be a finite number of seconds >= 0, not {value!r}")
    if positive and value == 0:
        raise ConfigError(f"{name} must be positive, not {value!r}")
    return float(value)


def env_seconds(name: str, default: float, *, over: float = 0.0) -> float:
    """The environment variable ``name`` as a number of seconds over ``over`` (inf allowed); ``default`` if unset or
    empty; else ConfigError naming it."""
    text = os.environ.get(name)
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > over:  # NaN too
        raise ConfigError(f"{name} must be a number of seconds over {over:g}, not {text!r}")
    return value
