"""The ingest: copies the records of a directory buffer's shards into its hub.

The hub (``BUFFER/hub.db``) is a walbuf buffer like any other, which
`walbuf sync` then uploads with its cursors, targets and sync log. It keeps
a rollback journal (not WAL) and synchronous=FULL; only a syncer holding
the buffer's sync lock writes it.

Which shards: every log shard, live or sealed, of any host (frames one
process appends, readable while they grow: walbuf.directory.log_ingest),
and an older walbuf's SQLite shards: every sealed one, and the syncer's own
host's live ones (read in one snapshot, while their writers go on). A sealed
shard whose records are all in the hub moves to ``ingested/``, where
`walbuf prune` removes it.

What the hub holds of a shard is noted in the same transaction as what it
copies: per log shard the offset reached (``log_cursors``), per SQLite shard,
run and writer the shard's id of the last record copied (``shard_cursors``).
A syncer killed (or failing on a write error) mid-copy leaves the hub as it
was after its last whole transaction, and the next one copies from there.
Nothing is copied twice.

A shard is untrusted input. A log shard is read up to the first frame
walbuf would not have written, or damage, and reported (it stays where it
is, and nothing past that is read). An older walbuf's SQLite shard that is
damaged, holds what walbuf never writes, or names a W&B target the hub's run
does not have (or W&B's rules refuse) is set aside in quarantine/ with the
reason, before anything of it is copied, while the other shards go on; a
live one of this host is not moved (its writers use it): it is left out,
with the reason, until it is sealed.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import sqlalchemy as sa

from ..errors import TargetConflictError
from ..store import Storage, Target
from ..store.schema import config_entries, records, runs, shard_cursors
from ..store.target import merge_target
from .layout import Layout, Shard
from .log_ingest import ingest_log
from .sealing import seal_ended
from .shard import ReadStopped, ShardError, ShardGone, ShardReader, ShardRecord, ShardWriter

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class IngestResult:
    records: int  # copied into the hub now
    shards: int  # shards read
    set_aside: tuple[str, ...] = ()  # sealed shards moved to quarantine/, a message each
    left_out: tuple[str, ...] = ()  # live shards of this host not taken in, a message each
    stopped: bool = False  # ``stop`` said so before every shard was read


def ingest(layout: Layout, hub: Storage, host: str, stop: Callable[[], bool] | None = None) -> IngestResult:
    """Copy what the hub lacks of every shard ``host`` may read. The caller holds the sync lock.

    First, live log shards whose process ended on this machine are sealed
    (walbuf.directory.sealing). A sealed shard moves to ingested/ once the
    hub holds all of it (a log shard: its END frame is taken in). What a
    shard holds that walbuf would not write, or a log shard's damage, stops
    its reading there, and it is reported; an older walbuf's SQLite shard is
    set aside in quarantine/ instead (see the module docstring). Any other
    error reading a shard (an I/O error, no permission) raises StorageError,
    and that shard stays where it was. ``stop`` is asked while shards are
    read: once it says so, the ingest ends, keeping what whole transactions
    copied.
    """
    copied = read = 0
    set_aside: list[str] = []
    left_out: list[str] = []
    layout.own().folder(layout.ingested, make=True)
    seal_ended(layout)
    shards = layout.readable_shards(host)
    while shards:
        shard = shards.pop(0)
        if stop is not None and stop():
            return IngestResult(copied, read, tuple(set_aside), tuple(left_out), stopped=True)
        _log.info("taking in shard %s", shard.id)
        try:
            if shard.format == "log":
                taken = ingest_log(layout, hub, shard, stop)
                copied += taken.records
                if taken.refused is not None:
                    left_out.append(taken.refused)  # a log shard stays where it is, read up to there
                elif shard.state == "sealed" and taken.cursor.ended:
                    os.replace(shard.path, shard.filed(layout.ingested))
                read += 1
                continue
            copied += _ingest_shard(layout, hub, shard, stop)
        except ReadStopped:
            return IngestResult(copied, read, tuple(set_aside), tuple(left_out), stopped=True)
        except ShardGone:
            # Its writers let go and it was sealed since the listing: take it in from sealed/.
            sealed = layout.sealed_as(shard)
            if sealed is None and shard.format == "log":
                # Not listed there yet (another host sealed it, and this host's
                # listing of sealed/ is older): the next sync takes it in.
                _log.info("shard %s was sealed meanwhile; the next sync takes it in", shard.id)
                continue
            if sealed is None:
                raise
            shards.insert(0, sealed)  # now, before the newer shards its writers moved on to
            continue
        except (ShardError, TargetConflictError) as exc:  # the shard's fault; one of the hub's goes up
            if shard.format == "log":
                left_out.append(str(exc))
            elif shard.state == "sealed":
                set_aside.append(layout.set_aside(shard, str(exc)))
            else:  # a live shard's writers use it: it is not ours to move
                left_out.append(f"live shard {shard.id} was not taken in ({exc}); it is set aside once sealed")
            continue
        read += 1
        if shard.state == "sealed" and in_hub(layout, hub, shard):
            os.replace(shard.path, layout.ingested / shard.path.name)
    return IngestResult(copied, read, tuple(set_aside), tuple(left_out))


def in_hub(layout: Layout, hub: Storage, shard: Shard) -> bool:
    """Whether the hub's cursors cover every record and config entry of the shard."""
    with ShardReader.of(layout, shard) as reader:
        found = reader.writers()
        if pending_in(reader, hub_cursors(hub, shard.id)):
            return False
        done = config_cursors(hub, shard.id)
        return all(
            entry.id <= done.get((found[entry.writer_id].run, found[entry.writer_id].name), 0)
            for entry in reader.config_entries()
        )


def _ingest_shard(layout: Layout, hub: Storage, shard: Shard, stop: Callable[[], bool] | None) -> int:
    with ShardReader.of(layout, shard, stop) as reader:
        found = reader.writers()
        if not found:
            return 0
        cursors = hub_cursors(hub, shard.id)
        # Everything is checked before anything is copied.
        reader.check_rows(min(_after(found, cursors).values()))
        _check_targets(hub, shard, found)
        hub_ids = {}
        for w in found.values():
            hub_ids[w.id], _ = hub.register_writer(
                w.run,
                w.name,
                w.step_axis,
                w.prefix,
                w.host,
                w.pid,
                w.target,
                closed_at=w.closed_at,
                close_exit=w.close_exit,
            )
        copied = 0
        for chunk in reader.records_after(_after(found, cursors)):
            _copy_chunk(hub, shard.id, found, hub_ids, cursors, chunk)
            copied += len(chunk)
        _ingest_config(reader, hub, shard.id, found, hub_ids)
        return copied


def _check_targets(hub: Storage, shard: Shard, found: dict[int, ShardWriter]) -> None:
    """Raise TargetConflictError if a run of the shard names a W&B target the hub's run of that name does not have."""
    with hub.begin_read() as conn:
        rows = conn.execute(sa.select(runs.c.name, runs.c.wandb_id, runs.c.project, runs.c.entity))
        stored = {name: Target(wandb_id, project, entity) for name, wandb_id, project, entity in rows}
    for w in found.values():
        if w.run in stored:
            try:
                merge_target(stored[w.run], w.target, w.run)
            except TargetConflictError as exc:
                raise TargetConflictError(
                    f"shard {shard.id} holds run {w.run!r} with another W&B target: {exc}"
                ) from None


def _after(found: dict[int, ShardWriter], cursors: dict[tuple[str, str], int]) -> dict[int, int]:
    """Each shard writer's cursor: the shard's id of its last record in the hub."""
    return {w.id: cursors.get((w.run, w.name), 0) for w in found.values()}


def pending_in(reader: ShardReader, cursors: dict[tuple[str, str], int]) -> int:
    """How many of the shard's records the hub lacks, given the hub's cursors of that shard."""
    found = reader.writers()
    return sum(len(chunk) for chunk in reader.records_after(_after(found, cursors)))


def _copy_chunk(
    hub: Storage,
    shard_id: str,
    found: dict[int, ShardWriter],
    hub_ids: dict[int, int],
    cursors: dict[tuple[str, str], int],
    chunk: list[ShardRecord],
) -> None:
    """One chunk of records and the cursors that cover it, in one hub transaction."""
    with hub.begin_write() as conn:
        conn.execute(
            records.insert(),
            [{"writer_id": hub_ids[w], "step": s, "time": t, "metrics": m} for _, w, s, t, m in chunk],
        )
        reached: dict[int, int] = {}
        for record_id, w, *_ in chunk:
            reached[w] = record_id
        for w, last_id in reached.items():
            key = (found[w].run, found[w].name)
            _set_cursor(conn, shard_id, key, known=key in cursors, last_id=last_id)
            cursors[key] = last_id


def _ingest_config(
    reader: ShardReader, hub: Storage, shard_id: str, found: dict[int, ShardWriter], hub_ids: dict[int, int]
) -> None:
    """The shard's config entries the hub lacks, with their cursor, in one transaction."""
    entries = reader.config_entries()
    if not entries:
        return
    with hub.begin_write() as conn:
        done = {
            (run, writer): config_id
            for run, writer, config_id in conn.execute(
                sa.select(shard_cursors.c.run, shard_cursors.c.writer, shard_cursors.c.config_id).where(
                    shard_cursors.c.shard == shard_id
                )
            )
        }
        reached: dict[tuple[str, str], int] = {}
        for entry in entries:
            owner = found[entry.writer_id]
            key = (owner.run, owner.name)
            if entry.id > done.get(key, 0):
                conn.execute(
                    config_entries.insert().values(
                        writer_id=hub_ids[entry.writer_id],
                        kind=entry.kind,
                        key=entry.key,
                        value=entry.value,
                        time=entry.time,
                    )
                )
                reached[key] = entry.id
        for key, entry_id in reached.items():
            _set_cursor(conn, shard_id, key, known=key in done, config_id=entry_id)


def config_cursors(hub: Storage, shard_id: str) -> dict[tuple[str, str], int]:
    """(run, writer) -> the shard's id of the last config entry of it the hub holds."""
    return _cursors(hub, shard_id, shard_cursors.c.config_id)


def hub_cursors(hub: Storage, shard_id: str) -> dict[tuple[str, str], int]:
    """(run, writer) -> the shard's id of the last record of it the hub holds."""
    return _cursors(hub, shard_id, shard_cursors.c.last_id)


def _cursors(hub: Storage, shard_id: str, column: sa.Column[int]) -> dict[tuple[str, str], int]:
    with hub.begin_read() as conn:
        rows = conn.execute(
            sa.select(shard_cursors.c.run, shard_cursors.c.writer, column).where(shard_cursors.c.shard == shard_id)
        )
        return {(run, writer): cursor for run, writer, cursor in rows}


def _set_cursor(conn: sa.Connection, shard_id: str, key: tuple[str, str], *, known: bool, **values: int) -> None:
    run, writer = key
    if known:
        where = sa.and_(shard_cursors.c.shard == shard_id, shard_cursors.c.run == run, shard_cursors.c.writer == writer)
        conn.execute(shard_cursors.update().where(where).values(**values))
    else:
        conn.execute(shard_cursors.insert().values(shard=shard_id, run=run, writer=writer, **{"last_id": 0, **values}))
