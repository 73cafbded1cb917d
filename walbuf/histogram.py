"""walbuf.Histogram: a histogram computed when it is logged, stored as its bins and counts.

A record stays small whatever the size of the values (a layer's weights,
say): only ``num_bins + 1`` edges and ``num_bins`` counts are stored, in the
JSON form W&B keeps in a history row (``{"_type": "histogram", "values":
counts, "bins": edges}``: wandb's sdk/data_types/histogram.py, to_json). The
syncer sends it as a ``wandb.Histogram`` made from those (``np_histogram=``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypedDict

from .errors import NOTHING_WRITTEN, MetricTypeError, MetricValueError, MissingExtraError

MAX_BINS = 512
"""wandb.Histogram refuses more (Histogram.MAX_LENGTH in wandb's sdk/data_types/histogram.py)."""
TYPE = "histogram"
"""The ``_type`` of a histogram in a W&B history row."""


class HistogramJSON(TypedDict):
    """A histogram as stored and as a W&B history row holds it (wandb.Histogram's JSON form)."""

    _type: Literal["histogram"]
    values: list[int]  # the counts
    bins: list[float]  # the edges, one more than the counts


@dataclass(frozen=True, init=False)
class Histogram:
    """A histogram of ``values`` in ``num_bins`` equal bins between their least and greatest finite value.

    ``values``: a sequence of numbers, a numpy array or a torch tensor (any
    shape; it is flattened). NaN and +-inf are left out of the counts (W&B
    has no bin for them); a MetricValueError says so if nothing finite is
    left. Bins as numpy.histogram makes them (the last bin includes its right
    edge; equal values get a bin of width 1 around them). Needs numpy.

    ``bins`` are the ``num_bins + 1`` edges, ``counts`` the values in each bin.
    """

    bins: tuple[float, ...]
    counts: tuple[int, ...]

    def __init__(self, values: Any, num_bins: int = 64) -> None:
        if isinstance(num_bins, bool) or not isinstance(num_bins, int) or not 1 <= num_bins <= MAX_BINS:
            raise MetricValueError(f"num_bins must be an int from 1 to {MAX_BINS} (W&B's limit), not {num_bins!r}")
        np = _numpy()
        array = _as_array(np, values)
        finite = array[np.isfinite(array)]
        if finite.size == 0:
            left = f" (of {array.size}, all NaN or infinite)" if array.size else ""
            raise MetricValueError(f"a Histogram needs at least one finite value, and none is left{left}")
        try:
            counts, edges = np.histogram(finite, bins=num_bins)
        except ValueError as exc:  # a range too narrow for num_bins floats at its magnitude, or too wide for one
            raise MetricValueError(f"numpy cannot bin these values in {num_bins} bins: {exc}; use fewer bins") from None
        object.__setattr__(self, "bins", tuple(float(e) for e in edges))
        object.__setattr__(self, "counts", tuple(int(c) for c in counts))

    @classmethod
    def from_counts(cls, counts: Sequence[int], bins: Sequence[float]) -> Histogram:
        """A histogram given by its counts and its bins' edges (one more than counts), as stored."""
        problem = _check(counts, bins)
        if problem is not None:
            raise MetricValueError(f"not a histogram: {problem}")
        histogram = cls.__new__(cls)
        object.__setattr__(histogram, "bins", tuple(float(b) for b in bins))
        object.__setattr__(histogram, "counts", tuple(int(c) for c in counts))
        return histogram

    def to_json(self) -> HistogramJSON:
        """The form stored in the buffer and in a W&B history row."""
        return {"_type": "histogram", "values": list(self.counts), "bins": list(self.bins)}


def stored(name: str, value: Mapping[Any, Any]) -> dict[str, Any] | None:
    """``value`` if it is a histogram as stored (its JSON form), checked; None if it is not one (a nested dict).

    Raises MetricValueError if it says it is a histogram but is not a valid one.
    """
    if value.get("_type") != TYPE:
        return None
    problem = None if set(value) == {"_type", "values", "bins"} else "keys other than _type, values and bins"
    problem = problem or _check(value["values"], value["bins"])
    if problem is not None:
        raise MetricValueError(f"metric {name!r} is marked a histogram but is not one: {problem}", NOTHING_WRITTEN)
    return dict(value)


def _check(counts: Any, bins: Any) -> str | None:
    if not isinstance(counts, Sequence) or not isinstance(bins, Sequence):
        return "counts and bins must be lists"
    if not 1 <= len(counts) <= MAX_BINS:
        return f"it needs from 1 to {MAX_BINS} counts, not {len(counts)}"
    if len(bins) != len(counts) + 1:
        return f"{len(counts)} counts need {len(counts) + 1} bin edges, not {len(bins)}"
    if not all(type(c) is int and c >= 0 for c in counts):
        return "counts must be ints >= 0"
    if not all(type(b) in (int, float) and math.isfinite(b) for b in bins):
        return "bin edges must be finite numbers"
    if any(b >= a for a, b in zip(bins[1:], bins, strict=False)):
        return "bin edges must increase"
    return None


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:
        raise MissingExtraError("walbuf.Histogram needs numpy: pip install 'walbuf[media]' (or numpy)") from None
    return numpy


def _as_array(np: Any, values: Any) -> Any:
    """``values`` as a flat float64 numpy array (a torch tensor is detached and copied to the CPU)."""
    if type(values).__module__.startswith("torch") and hasattr(values, "detach"):
        values = values.detach().float().cpu().numpy()  # .float(): numpy has no bfloat16
    try:
        array = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise MetricTypeError(
            f"a Histogram takes a sequence of numbers, a numpy array or a torch tensor, not"
            f" {type(values).__qualname__} ({exc})"
        ) from None
    return array.reshape(-1)
