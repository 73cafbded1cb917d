"""Prune: delete records that are synced and old, then give the space back.

Never deletes a record W&B has not confirmed (id above its writer's cursor),
and never the newest record of the buffer: SQLite gives a new row the largest
id plus one, so keeping that row keeps ids growing and cursors sound
(PostgreSQL's sequence never reuses ids either way). A
writer whose records are all pruned remembers its last step (pruned_step),
so its steps never restart.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass

import sqlalchemy as sa

from .errors import ConfigError
from .storage import Storage, records, writers

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_age(text: str) -> float:
    """'90s', '30m', '12h', '7d', '2w' -> seconds. Raises ConfigError otherwise."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*", text)
    if not match:
        raise ConfigError(f"age {text!r} is not a number followed by s, m, h, d or w (like 7d)")
    return float(match.group(1)) * _UNITS[match.group(2)]


@dataclass
class PruneResult:
    deleted: int
    bytes_before: int
    bytes_after: int


def prune(buffer: str | os.PathLike[str], *, older_than: float, vacuum: bool = True) -> PruneResult:
    """Delete synced records logged more than ``older_than`` seconds ago; then VACUUM.

    Writers may keep logging meanwhile. In SQLite they wait on its lock
    while the deletion and the VACUUM run (up to the busy timeout), and the
    file shrinks. In PostgreSQL they never wait: plain VACUUM makes the space
    reusable by new records without giving it back to the filesystem.
    """
    if older_than < 0:
        raise ConfigError(f"older_than must not be negative, not {older_than!r}")
    storage = Storage(buffer, create=False)
    try:
        before = storage.size()
        cutoff = time.time() - older_than
        cursor = sa.select(writers.c.synced_id).where(writers.c.id == records.c.writer_id).scalar_subquery()
        newest = sa.select(sa.func.max(records.c.id)).scalar_subquery()
        doomed = sa.and_(records.c.time < cutoff, records.c.id <= cursor, records.c.id < newest)
        with storage.begin_write() as conn:
            last_pruned = (
                sa.select(sa.func.max(records.c.step))
                .where(doomed, records.c.writer_id == writers.c.id)
                .scalar_subquery()
            )
            conn.execute(
                writers.update()
                .where(sa.exists().where(doomed, records.c.writer_id == writers.c.id))
                # greatest(), spelt so that SQLite and PostgreSQL both read it.
                .values(pruned_step=sa.case((writers.c.pruned_step > last_pruned, writers.c.pruned_step), else_=last_pruned))
            )
            deleted = conn.execute(records.delete().where(doomed)).rowcount
        if vacuum and deleted:
            storage.reclaim()
        return PruneResult(deleted, before, storage.size())
    finally:
        storage.dispose()
