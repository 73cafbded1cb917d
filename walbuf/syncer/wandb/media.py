"""Histograms and images in their stored forms, as the wandb objects that upload them."""

from __future__ import annotations

from typing import Any

from ...errors import MissingExtraError
from ...histogram import TYPE as HISTOGRAM


def histograms(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` with each histogram in its stored form (a dict) made a wandb.Histogram of the same bins and counts."""
    if not any(type(v) is dict and v.get("_type") == HISTOGRAM for v in values.values()):
        return values  # the common case: scalars only
    import wandb

    return {
        key: wandb.Histogram(np_histogram=(value["values"], value["bins"]))
        if type(value) is dict and value.get("_type") == HISTOGRAM
        else value
        for key, value in values.items()
    }


def pillow() -> Any:
    try:
        import PIL.Image
    except ImportError:
        raise MissingExtraError(
            "the run has images, and sending them needs Pillow: pip install 'walbuf[media]' where walbuf sync runs"
        ) from None
    return PIL.Image
