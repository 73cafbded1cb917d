"""The syncer: uploads what writers appended into W&B, one shared-mode run per walbuf run.

- :mod:`.syncer`: :func:`sync`, the whole invocation (lock, take-in, plan, upload per run)
- :mod:`.plan`: which records one run's upload covers, and its W&B target
- :mod:`.upload`: replaying them, and advancing the cursors once W&B confirmed
- :mod:`.wandb_run`: the one module that imports wandb
- :mod:`.results`: what a sync did

The key scheme (README): writer ``w``'s metric ``k`` is logged as ``w/k`` and
its step as ``w/<step_axis>``, declared with
``define_metric("w/k", step_metric="w/<step_axis>")``; writers never share a
key, so two ranks' ``loss`` stay apart.
"""

from .results import ConfigChange, RunSync, SyncMode, SyncResult
from .syncer import sync

__all__ = ["ConfigChange", "RunSync", "SyncMode", "SyncResult", "sync"]
