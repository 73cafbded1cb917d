"""The syncer: uploads what writers appended into W&B, one shared-mode run per walbuf run.

- :mod:`.syncer`: :func:`sync`, the whole invocation (lock, take-in, plan, upload per run)
- :mod:`.follow`: :func:`follow`, passes of sync in one process until the job ends (``sync --follow``)
- :mod:`.plan`: which records one run's upload covers, and its W&B target
- :mod:`.upload`: replaying them, and advancing the cursors once W&B confirmed
- :mod:`.metrics`: the run's metric definitions, key claims and last values
- :mod:`.finish`: when a sync finishes the W&B run, and with which exit code
- :mod:`.budget`: the bound of --max-records and --max-seconds
- :mod:`.wandb`: the one package that imports wandb
- :mod:`.results`: what a sync did

The key scheme (docs/logging.md): a writer with prefix ``p`` (by default its writer
id) has its metric ``k`` logged as ``p/k`` and its step as ``p/<step_axis>``,
declared with ``define_metric("p/*", step_metric="p/<step_axis>")``, so two
ranks' ``loss`` stay apart. With the prefix "" keys and axis are sent as
logged, each key declared against the axis (see :mod:`.metrics`).
"""

from .follow import FollowResult, follow
from .results import ConfigChange, RunSync, SyncMode, SyncResult
from .syncer import sync

__all__ = ["ConfigChange", "FollowResult", "RunSync", "SyncMode", "SyncResult", "follow", "sync"]
