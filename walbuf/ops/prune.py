"""`walbuf prune`: delete records that are synced and old, then give the space back.

Never deletes a record W&B has not confirmed (id above its writer's cursor),
and never the newest record of the buffer: SQLite gives a new row the largest
id plus one, so keeping that row keeps ids growing and cursors sound
(PostgreSQL's sequence never reuses ids either way). A
writer whose records are all pruned remembers its last step (pruned_step),
so its steps never restart.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

import sqlalchemy as sa

from ..arguments import seconds
from ..buffer import Location, open_buffer
from ..errors import ConfigError
from ..store import Storage
from ..store.schema import pending, quarantine, records, writers

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_age(text: str) -> float:
    """'90s', '30m', '12h', '7d', '2w' -> seconds. Raises ConfigError otherwise."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*", text)
    if not match:
        raise ConfigError(f"age {text!r} is not a number followed by s, m, h, d or w (like 7d)")
    return float(match.group(1)) * _UNITS[match.group(2)]


@dataclass(frozen=True)
class PruneResult:
    deleted: int  # records
    bytes_before: int
    bytes_after: int
    shards_removed: int = 0  # of a directory buffer: ingested shards deleted
    # Of a directory buffer: ingested shards not deleted after all, a message each
    # (the hub lacks some of their records, or they could not be read).
    shards_kept: tuple[str, ...] = ()


def prune(buffer: Location, *, older_than: float, vacuum: bool = True) -> PruneResult:
    """Delete synced records logged more than ``older_than`` seconds ago; then VACUUM.

    Of a directory buffer: the hub's synced records, and the ingested shards
    (whose records the hub holds) sealed longer ago than ``older_than``. A
    live or sealed shard not yet ingested is never touched, and an ingested
    one is deleted only if the hub's cursors still cover all of it (else it
    goes back to sealed/ for the next sync to take in).

    Writers may keep logging meanwhile, and wait for one short transaction
    at most: records are deleted PRUNE_BATCH at a time, and SQLite gives the
    space back to the filesystem a step at a time (see
    SQLiteBackend.reclaim). In PostgreSQL plain VACUUM makes the space
    reusable by new records without giving it back to the filesystem.
    """
    older_than = seconds("older_than", older_than)
    located = open_buffer(buffer)
    deleted = 0
    store = located.open_store("write")  # None: a directory buffer no sync has made a hub for yet
    if store is None:
        before = located.size()
        removed, kept = located.remove_ingested(older_than, None)
    else:
        with store:
            before = located.size()  # once opened: an older buffer is upgraded first
            deleted = _delete_synced(store, older_than, vacuum)
            removed, kept = located.remove_ingested(older_than, store)
    return PruneResult(deleted, before, located.size(), removed, tuple(kept))


PRUNE_BATCH = 1000  # records per transaction: writers wait for one batch at most, never the whole prune


def _delete_synced(storage: Storage, older_than: float, vacuum: bool) -> int:
    """Delete the synced records older than ``older_than`` seconds (see the module docstring); how many.

    In transactions of PRUNE_BATCH records each, in id order, so a writer
    waits for one batch at most. A prune stopped between batches leaves
    every batch before it done and the buffer consistent.
    """
    cutoff = time.time() - older_than
    cursor = sa.select(writers.c.synced_id).where(writers.c.id == records.c.writer_id).scalar_subquery()
    doomed = sa.and_(records.c.time < cutoff, sa.not_(pending(cursor)))
    deleted, after = 0, 0
    newest: int | None = None
    while True:
        with storage.begin_write() as conn:
            if newest is None:
                newest = conn.scalar(sa.select(sa.func.max(records.c.id))) or 0
            last = conn.scalar(
                sa.select(sa.func.max(sa.literal_column("id"))).select_from(
                    sa.select(records.c.id)
                    .where(records.c.id > after, records.c.id < newest, doomed)
                    .order_by(records.c.id)
                    .limit(PRUNE_BATCH)
                    .subquery()
                )
            )
            # The last, empty batch runs its statements too: a buffer this
            # process may not write is refused even with nothing to delete.
            end = after if last is None else last
            # One upper bound on the id only: SQLite's range search takes one.
            batch = sa.and_(records.c.id > after, records.c.id <= end, doomed)
            last_pruned = (
                sa.select(sa.func.max(records.c.step))
                .where(batch, records.c.writer_id == writers.c.id)
                .scalar_subquery()
            )
            conn.execute(
                writers.update()
                .where(sa.exists().where(batch, records.c.writer_id == writers.c.id))
                # greatest(), spelt so that SQLite and PostgreSQL both read it.
                .values(
                    pruned_step=sa.case((writers.c.pruned_step > last_pruned, writers.c.pruned_step), else_=last_pruned)
                )
            )
            # A quarantined record goes with the synced ones: its cursor passed it.
            conn.execute(quarantine.delete().where(quarantine.c.record_id.in_(sa.select(records.c.id).where(batch))))
            deleted += conn.execute(records.delete().where(batch)).rowcount
        if last is None:
            break
        after = last
        storage.yield_to_writers()
    if vacuum and deleted:
        storage.reclaim()
    return deleted
