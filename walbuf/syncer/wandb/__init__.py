"""The wandb adapter: the one package that imports wandb, and what the syncer needs of it.

It opens one wandb run (shared mode online, wandb's offline mode otherwise)
with settings for a headless uploader: no console capture, no system metrics,
no code or git snapshot, history posted every 2 s, bounded retries so that
an unreachable server fails the sync instead of hanging it. One module per
concern:

- :mod:`.run`: the run (settings, rows, summary, finish) and RowRefused;
- :mod:`.handover`: rows handed to wandb's thread in one call (wandb's internals);
- :mod:`.confirmation`: what shows W&B took an upload (wandb-core's account);
- :mod:`.failures`: wandb's failures sorted into retry-later and not;
- :mod:`.service`: wandb's service in this process, renewed, restarted or stopped;
- :mod:`.media`: histograms and images as wandb objects;
- :mod:`.versions`: the wandb releases the sync is tested with.

Nothing outside this package knows that wandb uploads through a process of
its own; docs/wandb-server.md lists the internals it relies on.
"""

from .run import RowRefused, WandbRun
from .service import renew_wandb, restart_wandb, stop_uploads
from .versions import WANDB_RANGE, check_wandb

__all__ = ["WANDB_RANGE", "RowRefused", "WandbRun", "check_wandb", "renew_wandb", "restart_wandb", "stop_uploads"]
