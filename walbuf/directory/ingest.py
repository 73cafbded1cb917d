"""The ingest: what the hub lacks of each shard, taken in with the hub's place in the shard, in one transaction.

The hub (``BUFFER/hub.db``) is a walbuf buffer like any other, which
`walbuf sync` then uploads with its cursors, targets and sync log. It keeps
a rollback journal (not WAL) and synchronous=FULL; only a syncer holding
the buffer's sync lock writes it.

For each shard the hub keeps the offset up to which its frames are taken in
(``log_cursors``), which hub writer each writer the shard names is
(``log_writers``), and the ranges before that offset it could not take in
yet (``log_gaps``): bytes that held no whole frame while whole frames
followed (a page that never reached the disk before a crash, or one this
host's cache holds stale), and frames of a writer the shard named only in
such bytes. A chunk of frames, the gaps met on the way and the offset after
them are committed together: a syncer killed mid-ingest leaves the hub as it
was after its last whole chunk, and the next sync reads on from there.
Every sync reads each gap again and takes in what has become readable;
nothing is taken twice, nothing is passed for good, and nothing of a shard
is ever written. A gap still unreadable once its shard is sealed (its
process ended) is damage, reported with what it held.

A writer's state in the hub follows the latest of its opens and closes by
their frames' times on the file server's clock (each shard's process noted
the difference between its clock and the server's as it made the shard),
whichever shard and whatever order they are read in: a writer closed in one
process and opened again in another is open, whatever the two hosts' clocks
say. How long ago a shard's process was heard of is its mtime, by that
clock too.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

import sqlalchemy as sa

from ..errors import TargetConflictError, WriterConflictError
from ..store import Storage
from ..store.schema import config_entries, log_cursors, log_gaps, log_writers, records, runs, writers
from ..store.storage import find_writer
from .frames import Unread
from .layout import Layout, Shard
from .sealing import seal_ended
from .shard import (
    BadFrame,
    Closed,
    ConfigSet,
    Event,
    Heard,
    Item,
    Logged,
    Opened,
    ReadStopped,
    ShardError,
    ShardGone,
    ShardReader,
    Started,
    Unnamed,
)
from .view import Cursor, Gap, cursor_of, damage, named_writers

CHUNK = 10_000  # records per transaction at most...
CHUNK_BYTES = 64 * 2**20  # ... and about this much of their metrics

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Taken:
    """What one ingest of a shard did."""

    records: int  # taken in now
    cursor: Cursor  # where it stands now
    refused: str | None = None  # why reading stopped before the end (a frame walbuf would not write)


@dataclass(frozen=True)
class IngestResult:
    records: int  # copied into the hub now
    shards: int  # shards read
    left_out: tuple[str, ...] = ()  # shards not taken in whole for a reason a person must see, a message each
    stopped: bool = False  # ``stop`` said so before every shard was read


def ingest(layout: Layout, hub: Storage, stop: Callable[[], bool] | None = None) -> IngestResult:
    """Take in what the hub lacks of every shard, live or sealed, of every host. The caller holds the sync lock.

    First, live shards whose process ended on this machine are sealed
    (walbuf.directory.sealing). A sealed shard moves to ingested/ once the
    hub holds all of it (its END frame and every gap taken in). A frame
    walbuf would not write stops the reading of its shard there, and a gap
    of a sealed shard that cannot be read is damage: each is reported (the
    shard stays where it is). Any other error reading a shard (an I/O error,
    no permission) raises StorageError, and that shard stays where it was.
    ``stop`` is asked while shards are read: once it says so, the ingest
    ends, keeping what whole transactions took in.
    """
    copied = read = 0
    left_out: list[str] = []
    layout.own().folder(layout.ingested, make=True)
    seal_ended(layout)
    shards = [s for s in layout.shards() if s.state != "ingested"]
    while shards:
        shard = shards.pop(0)
        if stop is not None and stop():
            return IngestResult(copied, read, tuple(left_out), stopped=True)
        try:
            taken = ingest_shard(layout, hub, shard, stop)
        except ReadStopped:
            return IngestResult(copied, read, tuple(left_out), stopped=True)
        except ShardGone:
            # Sealed since the listing: take it in from sealed/, now, before the newer shards of its process.
            sealed = layout.sealed_as(shard)
            if sealed is None:
                # Not listed there yet (another host sealed it, and this host's
                # listing of sealed/ is older): the next sync takes it in.
                _log.info("shard %s was sealed meanwhile; the next sync takes it in", shard.id)
            else:
                shards.insert(0, sealed)
            continue
        except (ShardError, TargetConflictError) as exc:  # the shard's fault; one of the hub's goes up
            left_out.append(str(exc))
            continue
        copied += taken.records
        read += 1
        if taken.refused is not None:
            left_out.append(taken.refused)
        elif shard.state == "sealed" and taken.cursor.gaps:
            left_out.append(damage(layout, hub, shard, taken.cursor.gaps))
        elif shard.state == "sealed" and taken.cursor.ended:
            os.replace(shard.path, shard.filed(layout.ingested))
    return IngestResult(copied, read, tuple(left_out))


def ingest_shard(layout: Layout, hub: Storage, shard: Shard, stop: Callable[[], bool] | None = None) -> Taken:
    """Take in what the hub lacks of a shard (its gaps first, then what follows its cursor), a chunk per transaction.
    The caller holds the sync lock.

    Raises ShardGone if the shard moved since it was listed, StorageError if
    it cannot be read (what whole chunks took in stays), ReadStopped once
    ``stop`` says so between chunks.
    """
    cursor = cursor_of(hub, shard.id)
    if cursor.ended and not cursor.gaps:
        return Taken(0, cursor)
    mapping = {local: wid for local, (wid, _, _) in named_writers(hub, shard.id).items()}
    ingest = _Ingest(hub, shard, cursor, mapping, stop)
    with ShardReader(layout, shard) as log:
        size, heard = log.stat()
        if not cursor.gaps and cursor.process is not None and size == cursor.offset:
            if heard != cursor.seen:  # its process wrote nothing whole since, but is heard of
                ingest.heard(heard)
            return Taken(0, ingest.cursor, cursor.refused)  # nothing new
        ingest.seen = heard
        _log.info("taking in shard %s", shard.id)
        try:
            for gap in cursor.gaps:
                try:
                    ingest.read(log.events(gap.start, set(mapping), end=gap.until, unread=True), gap)
                except BadFrame as exc:
                    # What follows that frame in the range stays a gap (damage, once the shard is sealed); the rest
                    # of the shard goes on.
                    _log.info("%s", exc)
            if not cursor.ended:
                ingest.read(log.events(cursor.offset, set(mapping), unread=bool(ingest.cursor.gaps)), None)
                if log.stop == "damaged":
                    # Neither zeros (a page not written yet) nor the head of a frame (a write under way).
                    raise BadFrame(
                        f"shard {shard.path}: the bytes from {log.offset} on are not a frame walbuf writes, and no"
                        " whole frame follows them; nothing past them is read"
                    )
        except BadFrame as exc:
            ingest.refuse(str(exc))
    return Taken(ingest.records, ingest.cursor, ingest.cursor.refused)


class _Ingest:
    """One shard's ingest: chunks of what it reads, each committed with the cursor and gaps after it."""

    def __init__(
        self, hub: Storage, shard: Shard, cursor: Cursor, mapping: dict[int, int], stop: Callable[[], bool] | None
    ) -> None:
        self.hub, self.shard, self.cursor, self.mapping, self.stop = hub, shard, cursor, mapping, stop
        self.records = 0
        self.seen = cursor.seen  # the shard's mtime as this ingest found it

    def read(self, items: Iterator[Item], gap: Gap | None) -> None:
        """Take in ``items``: those of ``gap`` read again, or (None) those after the cursor."""
        chunk = _Chunk(self.cursor, gap, self.seen)
        while True:
            try:
                item = next(items)
            except StopIteration:
                break
            except BadFrame:
                self._commit(chunk)  # what came before the frame walbuf would not write
                raise
            if isinstance(item, Unread):
                chunk.skip(item.start, item.end)
            elif isinstance(item[1], Unnamed):
                chunk.skip(item[0].offset, item[0].end)
            else:
                chunk.add(item[1], item[0].end)
            if chunk.full():
                self._commit(chunk)
                chunk = _Chunk(self.cursor, chunk.rest(), self.seen)
                if self.stop is not None and self.stop():
                    raise ReadStopped(f"taking in shard {self.shard.path} stopped at the sync's time bound")
        self._commit(chunk)

    def heard(self, seen: float) -> None:
        """Note when the shard's process was last heard of, by the file server's clock (its mtime now)."""
        with self.hub.begin_write() as conn:
            self.cursor = replace(self.cursor, seen=seen)
            _set_cursor(conn, self.shard.id, self.cursor)

    def refuse(self, why: str) -> None:
        """Keep why the shard is read no further than its cursor, for status and doctor."""
        if why != self.cursor.refused:
            with self.hub.begin_write() as conn:
                self.cursor = replace(self.cursor, refused=why)
                _set_cursor(conn, self.shard.id, self.cursor)

    def _commit(self, chunk: _Chunk) -> None:
        """Take ``chunk`` in, with the cursor and gaps after it, in one transaction. What comes before an event the
        hub refuses (a writer or target that conflicts with what it holds) is taken in, and BadFrame raised."""
        try:
            self._take(chunk)
        except _Refused as exc:
            self._take(exc.before)
            raise BadFrame(f"shard {self.shard.path}: {exc.why}; nothing past it is read") from None

    def _take(self, chunk: _Chunk) -> None:
        if chunk.reached is None:
            return  # nothing read
        cursor = chunk.cursor()
        clock = cursor.clock
        added: dict[int, int] = {}
        rows = []
        with self.hub.begin_write() as conn:
            for event in chunk.events():
                if isinstance(event, Opened):
                    try:
                        added[event.local] = _opened(conn, self.shard.id, event, clock)
                    except (WriterConflictError, TargetConflictError) as exc:
                        raise _Refused(chunk.before(event), str(exc)) from None
                elif isinstance(event, Logged | ConfigSet | Closed):
                    wid = added.get(event.local) or self.mapping[event.local]
                    if isinstance(event, Logged):
                        rows.append(
                            {"writer_id": wid, "step": event.step, "time": event.time, "metrics": event.metrics}
                        )
                    elif isinstance(event, ConfigSet):
                        conn.execute(
                            config_entries.insert(),
                            [
                                {"writer_id": wid, "kind": event.kind, "key": k, "value": v, "time": event.time}
                                for k, v in event.entries.items()
                            ],
                        )
                    else:
                        _closed(conn, self.shard.id, event, wid, clock)
            if rows:
                conn.execute(records.insert(), rows)
            _set_cursor(conn, self.shard.id, cursor)
        self.mapping.update(added)
        self.records += len(rows)
        self.cursor = cursor


@dataclass
class _Chunk:
    """What was read of a shard since the last commit, in order, to be taken in in one transaction.

    ``gap`` is the gap being read again, or None for what follows the cursor.
    """

    start: Cursor
    gap: Gap | None
    seen: float  # the shard's mtime when this ingest opened it
    # Events, and ranges read but not taken in (new gaps), each with the offset after it.
    read: list[tuple[Event | Gap, int]] = field(default_factory=list)
    records: int = 0
    size: int = 0

    @property
    def reached(self) -> int | None:
        """The offset after the last thing read; None if nothing was."""
        return self.read[-1][1] if self.read else None

    def add(self, event: Event, end: int) -> None:
        self.read.append((event, end))
        if isinstance(event, Logged):
            self.records += 1
            self.size += len(event.metrics)

    def skip(self, start: int, end: int) -> None:
        last = self.read[-1][0] if self.read else None
        if isinstance(last, Gap) and last.until == start:
            self.read.pop()
            start = last.start
        self.read.append((Gap(start, end), end))

    def events(self) -> list[Event]:
        return [e for e, _ in self.read if not isinstance(e, Gap)]

    def full(self) -> bool:
        return self.records >= CHUNK or self.size >= CHUNK_BYTES

    def rest(self) -> Gap | None:
        """What is left of the gap being read after this chunk (None when reading after the cursor)."""
        if self.gap is None:
            return None
        reached = self.reached
        return Gap(reached if reached is not None else self.gap.start, self.gap.until)

    def cursor(self) -> Cursor:
        """The cursor once this chunk is taken in: the gap read again replaced by what reading it found."""
        process, ended, clock = self.start.process, self.start.ended, self.start.clock
        events = self.events()
        for event in events:
            if isinstance(event, Started):
                process, clock = event.process, event.clock
            if isinstance(event, Heard) and event.end:
                ended = True
        gaps = [g for g in self.start.gaps if g != self.gap]
        rest = self.rest()
        if rest is not None and rest.start < rest.until:
            gaps.append(rest)
        gaps.extend(g for g, _ in self.read if isinstance(g, Gap))
        offset = self.start.offset
        if self.gap is None and self.reached is not None:
            offset = self.reached
        refused = None if events and self.gap is None else self.start.refused
        return Cursor(offset, ended, process, self.seen, refused, tuple(sorted(gaps, key=lambda g: g.start)), clock)

    def before(self, event: Event) -> _Chunk:
        """The part of this chunk read before ``event``."""
        part = _Chunk(self.start, self.gap, self.seen)
        for item, end in self.read:
            if item is event:
                break
            if isinstance(item, Gap):
                part.skip(item.start, item.until)
            else:
                part.add(item, end)
        return part


class _Refused(Exception):
    """An event of the chunk the hub refuses (a writer or target that conflicts with what it holds)."""

    def __init__(self, before: _Chunk, why: str) -> None:
        self.before, self.why = before, why


def forget(hub: Storage, shard_id: str) -> None:
    """Drop the hub's place in a shard that is gone for good (prune deleted it, its records in the hub)."""
    with hub.begin_write() as conn:
        for table in (log_gaps, log_writers, log_cursors):
            conn.execute(table.delete().where(table.c.shard == shard_id))


def _set_cursor(conn: sa.Connection, shard_id: str, cursor: Cursor) -> None:
    values = {
        "offset": cursor.offset,
        "ended": cursor.ended,
        "process": json.dumps(cursor.process.to_json()) if cursor.process is not None else None,
        "seen": cursor.seen,
        "refused": cursor.refused,
        "clock": cursor.clock,
    }
    updated = conn.execute(log_cursors.update().where(log_cursors.c.shard == shard_id).values(**values))
    if updated.rowcount == 0:
        conn.execute(log_cursors.insert().values(shard=shard_id, **values))
    conn.execute(log_gaps.delete().where(log_gaps.c.shard == shard_id))
    if cursor.gaps:
        conn.execute(log_gaps.insert(), [{"shard": shard_id, "start": g.start, "until": g.until} for g in cursor.gaps])


def _opened(conn: sa.Connection, shard_id: str, event: Opened, clock: float) -> int:
    """The hub writer of a writer the shard names, open from the event's time unless it closed later (both by the
    file server's clock: ``clock`` is the shard's)."""
    e = event.entry
    at = event.time + clock
    wid, new = find_writer(conn, e.run, e.name, e.step_axis, e.prefix, e.host, e.pid, e.target, at)
    conn.execute(log_writers.delete().where(log_writers.c.shard == shard_id, log_writers.c.local_id == event.local))
    conn.execute(log_writers.insert().values(shard=shard_id, local_id=event.local, writer_id=wid, open=True))
    reopened = new
    if not new:
        # Open again, unless a close later than this open was taken in already.
        later_close = sa.and_(writers.c.closed_at.is_not(None), writers.c.closed_at > at)
        opened_at = sa.case((writers.c.opened_at > at, writers.c.opened_at), else_=at)
        changed = conn.execute(
            writers.update()
            .where(writers.c.id == wid, sa.not_(later_close))
            .values(opened_at=opened_at, closed_at=None, close_exit=0, host=e.host, pid=e.pid)
        )
        reopened = changed.rowcount > 0
    if reopened:  # the run's job logs again: it is not finished
        run_id = sa.select(writers.c.run_id).where(writers.c.id == wid).scalar_subquery()
        conn.execute(runs.update().where(runs.c.id == run_id).values(finished_exit=None))
    return wid


def _closed(conn: sa.Connection, shard_id: str, event: Closed, wid: int, clock: float) -> None:
    conn.execute(
        log_writers.update()
        .where(log_writers.c.shard == shard_id, log_writers.c.local_id == event.local)
        .values(open=False)
    )
    # Closed, unless it opened again later (in another process).
    conn.execute(
        writers.update()
        .where(writers.c.id == wid, writers.c.opened_at <= event.time + clock)
        .values(closed_at=event.time + clock, close_exit=event.exit)
    )
