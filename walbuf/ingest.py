"""The ingest: copies the records of a directory buffer's shards into its hub.

The hub (``BUFFER/hub.db``) is a walbuf buffer like any other, which
`walbuf sync` then uploads with its cursors, targets and sync log. Processes
of several hosts open it in turn, so it keeps a rollback journal (not WAL)
and synchronous=FULL; only a syncer holding the buffer's sync lock writes it.

For each shard, run and writer, the hub stores the shard's id of the last
record it copied (``shard_cursors``), in the same transaction as the copies:
a syncer killed mid-ingest leaves the hub as it was before that transaction,
and the next one copies from there. Nothing is copied twice.

Which shards: every sealed one, from any host, and the syncer's own host's
live ones (read in one snapshot, while their writers go on). A sealed shard
whose records are all in the hub moves to ``ingested/``, where
`walbuf prune` removes it.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass

import sqlalchemy as sa

from . import shards
from .errors import BufferCorruptError
from .record import Record, decode
from .storage import Storage, Target, config_entries, records, shard_cursors

CHUNK = 10_000  # records per hub transaction


@dataclass
class IngestResult:
    records: int = 0  # copied into the hub now
    shards: int = 0  # shards read


def open_hub(layout: shards.Layout, *, create: bool = True) -> Storage:
    """The hub of a directory buffer (made if missing and ``create``)."""
    if create:
        layout.make()
    return Storage(layout.hub, durability="fsync", locks=layout.locks, journal="delete", create=create)


def ingest(layout: shards.Layout, hub: Storage, host: str) -> IngestResult:
    """Copy what the hub lacks of every shard ``host`` may read. The caller holds the sync lock."""
    result = IngestResult()
    for shard in shards.iter_shards_readable(layout, host):
        result.records += _ingest_shard(hub, shard)
        result.shards += 1
        if shard.state == "sealed":
            os.replace(shard.path, layout.ingested / shard.path.name)
    return result


@dataclass
class _ShardWriter:
    id: int
    run: str
    name: str
    step_axis: str
    host: str
    pid: int
    target: Target


def _ingest_shard(hub: Storage, shard: shards.Shard) -> int:
    conn = shard.connect()
    try:
        conn.execute("BEGIN")  # one snapshot of a live shard, while its writers go on
        try:
            found = _writers(conn)
        except sqlite3.OperationalError:
            return 0  # a shard whose first writer died before making its tables
        except sqlite3.DatabaseError as exc:
            raise BufferCorruptError(f"shard {shard.path} is not a readable walbuf shard ({exc})") from exc
        if not found:
            return 0
        cursors = _cursors(hub, shard.id)
        hub_ids = {}
        for w in found.values():
            hub_ids[w.id], _ = hub.register_writer(w.run, w.name, w.step_axis, w.host, w.pid, w.target)
        copied = 0
        for chunk in _pending(conn, found, cursors):
            with hub.begin_write() as hub_conn:
                hub_conn.execute(
                    records.insert(),
                    [{"writer_id": hub_ids[w], "step": s, "time": t, "metrics": m} for _, w, s, t, m in chunk],
                )
                reached: dict[int, int] = {}
                for record_id, w, *_ in chunk:
                    reached[w] = record_id
                for w, last_id in reached.items():
                    _set_cursor(hub_conn, shard.id, found[w], last_id, known=(found[w].run, found[w].name) in cursors)
                    cursors[(found[w].run, found[w].name)] = last_id
            copied += len(chunk)
        _ingest_config(conn, hub, shard.id, found, hub_ids)
        return copied
    finally:
        conn.close()


def _ingest_config(
    conn: sqlite3.Connection, hub: Storage, shard_id: str, found: dict[int, _ShardWriter], hub_ids: dict[int, int]
) -> None:
    """The shard's config entries the hub lacks, with their cursor, in one transaction."""
    try:
        rows = conn.execute("SELECT id, writer_id, kind, key, value, time FROM config_entries ORDER BY id").fetchall()
    except sqlite3.OperationalError:
        return  # a shard of an older walbuf: no config
    with hub.begin_write() as hub_conn:
        done = {
            (run, writer): config_id
            for run, writer, config_id in hub_conn.execute(
                sa.select(shard_cursors.c.run, shard_cursors.c.writer, shard_cursors.c.config_id).where(
                    shard_cursors.c.shard == shard_id
                )
            )
        }
        reached: dict[int, int] = {}
        for entry_id, w, kind, key, value, wall_time in rows:
            if entry_id > done.get((found[w].run, found[w].name), 0):
                hub_conn.execute(
                    config_entries.insert().values(
                        writer_id=hub_ids[w], kind=kind, key=key, value=value, time=wall_time
                    )
                )
                reached[w] = entry_id
        for w, entry_id in reached.items():
            key = (found[w].run, found[w].name)
            where = sa.and_(
                shard_cursors.c.shard == shard_id,
                shard_cursors.c.run == key[0],
                shard_cursors.c.writer == key[1],
            )
            if key in done:
                hub_conn.execute(shard_cursors.update().where(where).values(config_id=entry_id))
            else:
                hub_conn.execute(
                    shard_cursors.insert().values(
                        shard=shard_id, run=key[0], writer=key[1], last_id=0, config_id=entry_id
                    )
                )


def _writers(conn: sqlite3.Connection) -> dict[int, _ShardWriter]:
    rows = conn.execute(
        "SELECT w.id, r.name, w.name, w.step_axis, w.host, w.pid, r.wandb_id, r.project, r.entity"
        " FROM writers w JOIN runs r ON r.id = w.run_id"
    )
    return {
        row[0]: _ShardWriter(row[0], row[1], row[2], row[3], row[4], row[5], Target(row[6], row[7], row[8]))
        for row in rows
    }


def _cursors(hub: Storage, shard_id: str) -> dict[tuple[str, str], int]:
    with hub.begin_read() as conn:
        rows = conn.execute(
            sa.select(shard_cursors.c.run, shard_cursors.c.writer, shard_cursors.c.last_id).where(
                shard_cursors.c.shard == shard_id
            )
        )
        return {(run, writer): last_id for run, writer, last_id in rows}


def _pending(
    conn: sqlite3.Connection, found: dict[int, _ShardWriter], cursors: dict[tuple[str, str], int]
) -> Iterator[list[tuple[int, int, int, float, str]]]:
    """The shard's records past the hub's cursors, in the shard's order, in chunks."""
    after = {w.id: cursors.get((w.run, w.name), 0) for w in found.values()}
    low = min(after.values())
    rows = conn.execute(
        "SELECT id, writer_id, step, time, metrics FROM records WHERE id > ? ORDER BY id", (low,)
    )
    while True:
        batch = rows.fetchmany(CHUNK)
        if not batch:
            return
        chunk = [row for row in batch if row[0] > after[row[1]]]
        if chunk:
            yield chunk


def _set_cursor(conn: sa.Connection, shard_id: str, writer: _ShardWriter, last_id: int, *, known: bool) -> None:
    key = sa.and_(
        shard_cursors.c.shard == shard_id, shard_cursors.c.run == writer.run, shard_cursors.c.writer == writer.name
    )
    if known:
        conn.execute(shard_cursors.update().where(key).values(last_id=last_id))
    else:
        conn.execute(
            shard_cursors.insert().values(shard=shard_id, run=writer.run, writer=writer.name, last_id=last_id)
        )


def _hub_cursors(layout: shards.Layout, shard_id: str) -> dict[tuple[str, str], int]:
    if not layout.hub.exists():
        return {}
    hub = open_hub(layout, create=False)
    try:
        return _cursors(hub, shard_id)
    finally:
        hub.dispose()


def backlog(layout: shards.Layout, host: str) -> list[tuple[shards.Shard, int | None]]:
    """Each shard not yet ingested, with how many of its records the hub lacks (None: another host's live shard)."""
    out: list[tuple[shards.Shard, int | None]] = []
    for shard in layout.shards():
        if shard.state == "ingested":
            continue
        if shard.state == "live" and shard.host != host:
            out.append((shard, None))
            continue
        out.append((shard, sum(len(chunk) for chunk in _shard_records(layout, shard))))
    return out


def _shard_records(layout: shards.Layout, shard: shards.Shard) -> Iterator[list[tuple[int, int, int, float, str]]]:
    conn = shard.connect()
    try:
        conn.execute("BEGIN")
        try:
            found = _writers(conn)
        except sqlite3.OperationalError:
            return
        if found:
            yield from _pending(conn, found, _hub_cursors(layout, shard.id))
    finally:
        conn.close()


def read_directory(
    layout: shards.Layout, host: str, run: str | None, writer: str | None
) -> Iterator[Record]:
    """The records of a directory buffer this host can see: the hub's, then what the hub lacks of each shard."""
    if layout.hub.exists():
        hub = open_hub(layout, create=False)
        try:
            yield from hub.read(run=run, writer=writer)
        finally:
            hub.dispose()
    for shard in shards.iter_shards_readable(layout, host):
        conn = shard.connect()
        try:
            try:
                found = _writers(conn)
            except sqlite3.OperationalError:
                continue
        finally:
            conn.close()
        for chunk in _shard_records(layout, shard):
            for _, w, step, wall_time, metrics in chunk:
                owner = found[w]
                if run in (None, owner.run) and writer in (None, owner.name):
                    yield Record(owner.run, owner.name, step, wall_time, decode(metrics))
