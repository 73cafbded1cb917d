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
from ..record import Record
from ..store import Storage
from ..store.schema import config_entries, log_cursors, log_gaps, log_writers, records, runs, writers
from ..store.storage import find_writer, stored_metrics
from .frames import Unread
from .host import Process
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

CHUNK = 10_000  # records per transaction at most...
CHUNK_BYTES = 64 * 2**20  # ... and about this much of their metrics

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Gap:
    """Bytes ``start`` to ``until`` of a shard, before its cursor, that the hub could not take in yet."""

    start: int
    until: int


@dataclass(frozen=True)
class Cursor:
    """How far the hub has taken a shard in."""

    offset: int
    ended: bool  # its END frame is taken in: nothing more will come after the offset
    process: Process | None  # None until its first frame is taken in
    seen: float  # its mtime when a sync last read it: when its process was last heard of, by the file server's clock
    refused: str | None = None  # why the last sync stopped reading it here, short of its end
    gaps: tuple[Gap, ...] = ()  # ranges before the offset not taken in yet
    clock: float = 0.0  # the file server's clock minus its process's (see Started)


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


def cursor_of(hub: Storage | None, shard_id: str) -> Cursor:
    """The hub's cursor of a shard, with its gaps (at its start if none, or if there is no hub yet)."""
    if hub is None:
        return Cursor(0, False, None, 0.0)
    with hub.begin_read() as conn:
        return _cursor(conn, shard_id)


def _cursor(conn: sa.Connection, shard_id: str) -> Cursor:
    row = conn.execute(sa.select(log_cursors).where(log_cursors.c.shard == shard_id)).first()
    if row is None:
        return Cursor(0, False, None, 0.0)
    gaps = tuple(
        Gap(start, until)
        for start, until in conn.execute(
            sa.select(log_gaps.c.start, log_gaps.c.until).where(log_gaps.c.shard == shard_id).order_by(log_gaps.c.start)
        )
    )
    process = Process.from_json(json.loads(row.process)) if row.process is not None else None
    return Cursor(row.offset, bool(row.ended), process, row.seen, row.refused, gaps, row.clock)


def named_writers(hub: Storage | None, shard_id: str) -> dict[int, tuple[int, str, str]]:
    """Local id -> (hub writer id, run, writer) of each writer of the shard the hub has taken in."""
    if hub is None:
        return {}
    with hub.begin_read() as conn:
        return _named(conn, shard_id)


def _named(conn: sa.Connection, shard_id: str) -> dict[int, tuple[int, str, str]]:
    rows = conn.execute(
        sa.select(log_writers.c.local_id, writers.c.id, runs.c.name, writers.c.name)
        .join(writers, writers.c.id == log_writers.c.writer_id)
        .join(runs, runs.c.id == writers.c.run_id)
        .where(log_writers.c.shard == shard_id)
    )
    return {local: (wid, run, name) for local, wid, run, name in rows}


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
        try:
            for item in items:
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
        except BadFrame:
            self._commit(chunk)  # what came before the frame walbuf would not write
            raise
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


def damage(layout: Layout, hub: Storage, shard: Shard, gaps: tuple[Gap, ...]) -> str:
    """The report of a sealed shard's gaps that still cannot be taken in: where, and what they held."""
    ranges = "; ".join(
        f"bytes {g.start}-{g.until} ({held})" for g, held in zip(gaps, _held(layout, hub, shard, gaps), strict=True)
    )
    return (
        f"shard {shard.path} is damaged: {ranges} cannot be taken in, and its process has ended; every frame"
        " around them is taken in, and they are read again at each sync (keep a copy of the file; `walbuf doctor`"
        " says what to do)"
    )


def _held(layout: Layout, hub: Storage | None, shard: Shard, gaps: tuple[Gap, ...]) -> list[str]:
    """For each gap, what it held as far as its neighbours tell: the records before and after it."""
    names = {local: name for local, (_, _, name) in named_writers(hub, shard.id).items()}
    before: dict[Gap, str] = {}
    after: dict[Gap, str] = {}
    try:
        with ShardReader(layout, shard) as log:
            for item in log.events(0, set(), unread=True):
                if isinstance(item, Unread):
                    continue
                frame, event = item
                if isinstance(event, Opened):
                    names[event.local] = event.entry.name
                if not isinstance(event, Logged):
                    continue
                here = f"{names.get(event.local, f'writer {event.local}')!r} step {event.step}"
                for gap in gaps:
                    if frame.end <= gap.start:
                        before[gap] = here
                    elif frame.offset >= gap.until:
                        after.setdefault(gap, here)
    except (ShardError, ShardGone):
        pass  # what could be read is told
    return [f"records between {before.get(g, 'the start')} and {after.get(g, 'the end')}" for g in gaps]


@dataclass(frozen=True)
class HubView:
    """One read of the hub (a consistent snapshot): the newest record id it holds, and its place in each shard.

    Records with ids up to ``top`` are the hub's; what a shard holds past its
    cursor (and in its gaps) is not in the hub: together, each record once,
    whatever a sync commits meanwhile.
    """

    top: int
    cursors: dict[str, Cursor]
    names: dict[str, dict[int, tuple[int, str, str]]]

    def cursor(self, shard_id: str) -> Cursor:
        return self.cursors.get(shard_id, Cursor(0, False, None, 0.0))


def hub_view(hub: Storage | None) -> HubView:
    """The hub's :class:`HubView`, read in one transaction and let go (an empty one if there is no hub yet)."""
    if hub is None:
        return HubView(0, {}, {})
    with hub.begin_read() as conn:
        return hub_view_on(conn)


def hub_view_on(conn: sa.Connection) -> HubView:
    """The hub's :class:`HubView`, read on ``conn`` (in its read transaction)."""
    top = conn.scalar(sa.select(sa.func.coalesce(sa.func.max(records.c.id), 0))) or 0
    shards = [row[0] for row in conn.execute(sa.select(log_cursors.c.shard))]
    cursors = {shard: _cursor(conn, shard) for shard in shards}
    names = {shard: _named(conn, shard) for shard in shards}
    return HubView(top, cursors, names)


def records_not_in_hub(
    layout: Layout, view: HubView, shard: Shard, run: str | None = None, writer: str | None = None
) -> Iterator[Record]:
    """The records of a shard that the hub as ``view`` saw it lacks (of one run / writer if given): those of its gaps
    that can be read now, then those past its cursor, each in the order logged."""
    cursor = view.cursor(shard.id)
    if cursor.ended and not cursor.gaps:
        return
    names = {local: (r, w) for local, (_, r, w) in view.names.get(shard.id, {}).items()}
    try:
        log = ShardReader(layout, shard)
    except ShardGone:
        moved = layout.moved(shard)
        if moved is None:
            return  # sealed by another host, and not listed here yet: the next look reads it
        log = ShardReader(layout, moved)
    with log:
        known = set(names)
        parts: list[Iterator[Item]] = [log.events(g.start, known, end=g.until, unread=True) for g in cursor.gaps]
        if not cursor.ended:
            parts.append(log.events(cursor.offset, known, unread=bool(cursor.gaps)))
        for part in parts:
            for item in part:
                if isinstance(item, Unread):
                    continue
                event = item[1]
                if isinstance(event, Opened):
                    names[event.local] = (event.entry.run, event.entry.name)
                elif isinstance(event, Logged) and event.local in names:
                    r, w = names[event.local]
                    if run in (None, r) and writer in (None, w):
                        values = stored_metrics(event.metrics, w, event.step, None, str(shard.path))
                        yield Record(r, w, event.step, event.time, values)


def frames_not_in_hub(layout: Layout, view: HubView, shard: Shard) -> bool:
    """Whether a shard holds what the hub (as ``view`` saw it) lacks: a gap, or a whole frame past its cursor.

    Raises BadFrame for a frame walbuf would not write there, ShardGone.
    """
    return bool(view.cursor(shard.id).gaps) or frames_past(layout, view, shard)


def frames_past(layout: Layout, view: HubView, shard: Shard) -> bool:
    """Whether a shard holds a whole frame past the hub's cursor (as ``view`` saw it); its gaps aside."""
    cursor = view.cursor(shard.id)
    if cursor.ended:
        return False
    with ShardReader(layout, shard) as log:
        if cursor.process is not None and log.size() == cursor.offset:
            return False
        known = set(view.names.get(shard.id, {}))
        return any(not isinstance(item, Unread) for item in log.events(cursor.offset, known, unread=True))


def damage_note(gaps: tuple[Gap, ...]) -> str:
    """In short, what a sealed shard's gaps are (:func:`damage` says what they held)."""
    ranges = ", ".join(f"{g.start}-{g.until}" for g in gaps)
    return (
        f"damaged: bytes {ranges} cannot be taken in, and its process has ended; they are read again at each"
        " sync (`walbuf doctor` says what to do)"
    )


@dataclass(frozen=True)
class Exam:
    """What reading a shard whole found (see :func:`examine`)."""

    process: Process | None  # None: its first frame cannot be read (yet)
    waiting: int  # records the hub lacks, of those that can be read
    last_heard: float  # its mtime: when its process last appended, by the file server's clock
    ended: bool  # its END frame is there: its process appends nothing more
    unread: tuple[Gap, ...]  # bytes that hold no whole frame, with whole frames after them


def examine(layout: Layout, shard: Shard, view: HubView) -> Exam:
    """Read a shard whole. Raises BadFrame where it holds a frame walbuf would not write, StorageError."""
    cursor = view.cursor(shard.id)
    process, waiting, ended, unread = None, 0, False, []
    with ShardReader(layout, shard) as log:
        _, heard = log.stat()
        for item in log.events(0, set(), unread=True):
            if isinstance(item, Unread):
                unread.append(Gap(item.start, item.end))
                continue
            frame, event = item
            if isinstance(event, Unnamed):
                continue
            if isinstance(event, Started):
                process = event.process
            elif isinstance(event, Logged) and (
                frame.offset >= cursor.offset or any(g.start <= frame.offset < g.until for g in cursor.gaps)
            ):
                waiting += 1
            elif isinstance(event, Heard) and event.end:
                ended = True
    return Exam(process, waiting, heard, ended, tuple(unread))
