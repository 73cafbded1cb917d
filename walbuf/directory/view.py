"""The hub's place in each shard, and what a shard holds past it: read in one snapshot, never written here.

For each shard the hub keeps how far it took the frames in (a
:class:`Cursor`, ``log_cursors``), the ranges before that it could not take
in yet (:class:`Gap`, ``log_gaps``) and which hub writer each writer the
shard names is (``log_writers``); walbuf.directory.ingest moves them. A
:class:`HubView` is all of it and the hub's newest record id, read in one
transaction: with it a reader lists each record once, from the hub or from
its shard, whatever a sync commits meanwhile, and lets the hub go at once.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

import sqlalchemy as sa

from ..record import Record
from ..store import Storage
from ..store.schema import log_cursors, log_gaps, log_writers, records, runs, writers
from ..store.storage import stored_metrics
from .frames import Unread
from .host import Process
from .layout import Layout, Shard
from .shard import Heard, Item, Logged, Opened, ShardError, ShardGone, ShardReader, Started, Unnamed, open_where_now


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
    log = open_where_now(layout, shard)
    if log is None:
        return  # sealed by another host and not listed here yet, or pruned: the next look reads it
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
    frames: int  # whole frames


def examine(layout: Layout, shard: Shard, view: HubView) -> Exam:
    """Read a shard whole. Raises BadFrame where it holds a frame walbuf would not write, StorageError."""
    cursor = view.cursor(shard.id)
    process, waiting, ended, unread, frames = None, 0, False, [], 0
    with ShardReader(layout, shard) as log:
        _, heard = log.stat()
        for item in log.events(0, set(), unread=True):
            if isinstance(item, Unread):
                unread.append(Gap(item.start, item.end))
                continue
            frame, event = item
            frames += 1
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
    return Exam(process, waiting, heard, ended, tuple(unread), frames)
