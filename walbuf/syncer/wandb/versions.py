"""The wandb releases walbuf's sync is tested with, and the check that the installed one is among them."""

from __future__ import annotations

import re

from ...errors import ConfigError

# The wandb releases walbuf's sync is tested with (pyproject.toml says the
# same): it reaches into wandb's internals and wandb-core's messages
# (docs/wandb-server.md lists them), which any release may change.
WANDB_OLDEST = (0, 31, 0)


WANDB_BEYOND = (0, 32, 0)


WANDB_RANGE = "wandb>=0.31.0,<0.32"


def check_wandb() -> None:
    """ConfigError, before anything is planned or sent, where the installed wandb is outside WANDB_RANGE."""
    import wandb

    version = str(getattr(wandb, "__version__", "unknown"))
    found = re.match(r"(\d+)\.(\d+)\.(\d+)", version)
    release = tuple(int(n) for n in found.groups()) if found else None
    if release is None or not WANDB_OLDEST <= release < WANDB_BEYOND:
        raise ConfigError(
            f"walbuf's sync is tested with {WANDB_RANGE}, and this environment has wandb {version}: install one of"
            f" those (pip install '{WANDB_RANGE}'), or a walbuf tested with yours; nothing was sent"
        )
