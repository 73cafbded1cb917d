"""Taking a log shard into the hub: what its frames hold past the hub's offset, with the offset, in one transaction.

For each log shard the hub keeps the offset up to which its frames are
taken in (``log_cursors``), and which hub writer each writer the shard
names is (``log_writers``). A chunk of frames and the offset after it are
committed together: a syncer killed mid-ingest leaves the hub as it was
after its last whole chunk, and the next sync reads on from there. Nothing
is taken twice, and nothing of a shard is ever written.

A writer's state in the hub follows the latest of its opens and closes by
their frames' times, whichever shard and whatever order they are read in:
a writer closed in one process and opened again in another is open.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

import sqlalchemy as sa

from ..errors import TargetConflictError, WriterConflictError
from ..record import Record
from ..store import Storage
from ..store.schema import config_entries, log_cursors, log_writers, records, runs, writers
from ..store.storage import find_writer, stored_metrics
from .host import Process
from .layout import Layout, Shard
from .log_shard import BadFrame, Closed, ConfigSet, Event, Heard, Logged, LogShard, Opened, Started
from .shard import ReadStopped, ShardGone

CHUNK = 10_000  # records per transaction at most...
CHUNK_BYTES = 64 * 2**20  # ... and about this much of their metrics


@dataclass(frozen=True)
class Cursor:
    """How far the hub has taken a log shard in."""

    offset: int
    ended: bool  # its END frame is taken in: nothing more will come
    process: Process | None  # None until its first frame is taken in
    seen: float  # the time of its last frame taken in
    refused: str | None = None  # why the last sync stopped reading it here, short of its end


@dataclass(frozen=True)
class LogTaken:
    """What one ingest of a log shard did."""

    records: int  # taken in now
    cursor: Cursor  # where it stands now
    refused: str | None = None  # why reading stopped before the end (a frame walbuf would not write, or damage)
    stopped: bool = False  # the caller's stop condition held


def cursor_of(hub: Storage | None, shard_id: str) -> Cursor:
    """The hub's cursor of a shard (at its start if none, or if there is no hub yet)."""
    if hub is None:
        return Cursor(0, False, None, 0.0)
    with hub.begin_read() as conn:
        row = conn.execute(sa.select(log_cursors).where(log_cursors.c.shard == shard_id)).first()
    if row is None:
        return Cursor(0, False, None, 0.0)
    process = Process.from_json(json.loads(row.process)) if row.process is not None else None
    return Cursor(row.offset, bool(row.ended), process, row.seen, row.refused)


def named_writers(hub: Storage | None, shard_id: str) -> dict[int, tuple[int, str, str]]:
    """Local id -> (hub writer id, run, writer) of each writer of the shard the hub has taken in."""
    if hub is None:
        return {}
    with hub.begin_read() as conn:
        rows = conn.execute(
            sa.select(log_writers.c.local_id, writers.c.id, runs.c.name, writers.c.name)
            .join(writers, writers.c.id == log_writers.c.writer_id)
            .join(runs, runs.c.id == writers.c.run_id)
            .where(log_writers.c.shard == shard_id)
        )
        return {local: (wid, run, name) for local, wid, run, name in rows}


def ingest_log(layout: Layout, hub: Storage, shard: Shard, stop: Callable[[], bool] | None = None) -> LogTaken:
    """Take in what the hub lacks of a log shard, a chunk per transaction. The caller holds the sync lock.

    Raises ShardGone if the shard moved since it was listed, StorageError if
    it cannot be read (what whole chunks took in stays).
    """
    cursor = cursor_of(hub, shard.id)
    if cursor.ended:
        return LogTaken(0, cursor)
    mapping = {local: wid for local, (wid, _, _) in named_writers(hub, shard.id).items()}
    taken = 0
    with LogShard(layout, shard) as log:
        if cursor.process is not None and log.size() == cursor.offset:
            return LogTaken(0, cursor, cursor.refused)  # nothing new
        chunk = _Chunk(cursor)
        refused = None
        try:
            for frame, event in log.events(cursor.offset, set(mapping)):
                chunk.add(event, frame.end)
                if chunk.full():
                    taken += _commit(hub, shard.id, chunk, mapping)
                    chunk = _Chunk(chunk.cursor())
                    if stop is not None and stop():
                        raise ReadStopped(f"taking in shard {shard.path} stopped at the sync's time bound")
        except BadFrame as exc:
            refused = str(exc)
        try:
            taken += _commit(hub, shard.id, chunk, mapping)
        except _Refused as exc:
            # What comes before the frame that was refused is taken in; the rest waits for a person.
            taken += _commit(hub, shard.id, exc.before, mapping)
            chunk, refused = exc.before, f"shard {shard.path}: {exc.why}; nothing past it is read"
        if refused is None and log.stop == "damaged":
            refused = (
                f"shard {shard.path} is damaged at byte {log.offset}: a frame there cannot be read, and whole frames"
                " follow it; nothing past it is read (`walbuf doctor` says what to do)"
            )
        cursor = chunk.cursor()
        if refused != cursor.refused:
            _note_refusal(hub, shard.id, cursor, refused)
        return LogTaken(taken, replace(cursor, refused=refused), refused)


@dataclass
class _Chunk:
    """Events read from a shard, to be taken in in one transaction, and the cursor after them."""

    start: Cursor
    events: list[Event] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)  # the offset after each event's frame
    records: int = 0
    size: int = 0

    def add(self, event: Event, end: int) -> None:
        self.events.append(event)
        self.ends.append(end)
        if isinstance(event, Logged):
            self.records += 1
            self.size += len(event.metrics)

    def full(self) -> bool:
        return self.records >= CHUNK or self.size >= CHUNK_BYTES

    def cursor(self) -> Cursor:
        process, seen, ended = self.start.process, self.start.seen, self.start.ended
        for event in self.events:
            if isinstance(event, Started):
                process = event.process
            if isinstance(event, Heard) and event.end:
                ended = True
            seen = max(seen, event.time)
        offset = self.ends[-1] if self.ends else self.start.offset
        return Cursor(offset, ended, process, seen, None if self.events else self.start.refused)

    def before(self, index: int) -> _Chunk:
        part = _Chunk(self.start)
        for event, end in zip(self.events[:index], self.ends[:index], strict=True):
            part.add(event, end)
        return part


class _Refused(Exception):
    """An event of the chunk the hub refuses (a writer or target that conflicts with what it holds)."""

    def __init__(self, before: _Chunk, why: str) -> None:
        self.before, self.why = before, why


def _commit(hub: Storage, shard_id: str, chunk: _Chunk, mapping: dict[int, int]) -> int:
    """Take ``chunk`` in, with the cursor after it, in one transaction; the records taken. Raises _Refused (nothing
    of the chunk taken) for an event the hub refuses."""
    if not chunk.events:
        return 0
    cursor = chunk.cursor()
    added: dict[int, int] = {}
    with hub.begin_write() as conn:
        rows = []
        for index, event in enumerate(chunk.events):
            if isinstance(event, Opened):
                try:
                    added[event.local] = _opened(conn, shard_id, event)
                except (WriterConflictError, TargetConflictError) as exc:
                    raise _Refused(chunk.before(index), str(exc)) from None
            elif isinstance(event, Logged):
                wid = added.get(event.local) or mapping[event.local]
                rows.append({"writer_id": wid, "step": event.step, "time": event.time, "metrics": event.metrics})
            elif isinstance(event, ConfigSet):
                wid = added.get(event.local) or mapping[event.local]
                conn.execute(
                    config_entries.insert(),
                    [
                        {"writer_id": wid, "kind": event.kind, "key": k, "value": v, "time": event.time}
                        for k, v in event.entries.items()
                    ],
                )
            elif isinstance(event, Closed):
                _closed(conn, shard_id, event, added.get(event.local) or mapping[event.local])
        if rows:
            conn.execute(records.insert(), rows)
        _set_cursor(conn, shard_id, cursor)
    mapping.update(added)
    return len(rows)


def _note_refusal(hub: Storage, shard_id: str, cursor: Cursor, why: str | None) -> None:
    """Keep why the shard is read no further than its cursor (None: it is again), for status and doctor."""
    with hub.begin_write() as conn:
        _set_cursor(conn, shard_id, replace(cursor, refused=why))


def _set_cursor(conn: sa.Connection, shard_id: str, cursor: Cursor) -> None:
    values = {
        "offset": cursor.offset,
        "ended": cursor.ended,
        "process": json.dumps(cursor.process.to_json()) if cursor.process is not None else None,
        "seen": cursor.seen,
        "refused": cursor.refused,
    }
    updated = conn.execute(log_cursors.update().where(log_cursors.c.shard == shard_id).values(**values))
    if updated.rowcount == 0:
        conn.execute(log_cursors.insert().values(shard=shard_id, **values))


def _opened(conn: sa.Connection, shard_id: str, event: Opened) -> int:
    """The hub writer of a writer the shard names, open from the event's time unless it closed later."""
    e = event.entry
    wid, new = find_writer(conn, e.run, e.name, e.step_axis, e.prefix, e.host, e.pid, e.target, event.time)
    conn.execute(log_writers.delete().where(log_writers.c.shard == shard_id, log_writers.c.local_id == event.local))
    conn.execute(log_writers.insert().values(shard=shard_id, local_id=event.local, writer_id=wid, open=True))
    reopened = new
    if not new:
        # Open again, unless a close later than this open was taken in already.
        later_close = sa.and_(writers.c.closed_at.is_not(None), writers.c.closed_at > event.time)
        opened_at = sa.case((writers.c.opened_at > event.time, writers.c.opened_at), else_=event.time)
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


def _closed(conn: sa.Connection, shard_id: str, event: Closed, wid: int) -> None:
    conn.execute(
        log_writers.update()
        .where(log_writers.c.shard == shard_id, log_writers.c.local_id == event.local)
        .values(open=False)
    )
    # Closed, unless it opened again later (in another process).
    conn.execute(
        writers.update()
        .where(writers.c.id == wid, writers.c.opened_at <= event.time)
        .values(closed_at=event.time, close_exit=event.exit)
    )


@dataclass(frozen=True)
class LogExam:
    """What reading a log shard whole found (see :func:`examine_log`)."""

    process: Process | None  # None: its first frame is not whole yet
    waiting: int  # records past what the hub took in
    last_heard: float  # the time of its last frame
    ended: bool  # its END frame is there: its process appends nothing more
    damaged_at: int | None  # a frame that cannot be read, with whole frames after it, starts here


def examine_log(layout: Layout, shard: Shard, hub: Storage | None) -> LogExam:
    """Read a log shard whole. Raises BadFrame where it holds a frame walbuf would not write, StorageError."""
    offset = cursor_of(hub, shard.id).offset
    process, waiting, heard, ended = None, 0, 0.0, False
    with LogShard(layout, shard) as log:
        for frame, event in log.events(0, set()):
            heard = max(heard, event.time)
            if isinstance(event, Started):
                process = event.process
            elif isinstance(event, Logged) and frame.offset >= offset:
                waiting += 1
            elif isinstance(event, Heard) and event.end:
                ended = True
        damaged = log.offset if log.stop == "damaged" else None
    return LogExam(process, waiting, heard, ended, damaged)


def frames_not_in_hub(layout: Layout, hub: Storage, shard: Shard) -> bool:
    """Whether a log shard holds a whole frame past what ``hub`` took in of it (a frame cut off is none).

    Raises BadFrame for a frame walbuf would not write there, ShardGone.
    """
    cursor = cursor_of(hub, shard.id)
    if cursor.ended:
        return False
    with LogShard(layout, shard) as log:
        if cursor.process is not None and log.size() == cursor.offset:
            return False
        known = set(named_writers(hub, shard.id))
        return next(iter(log.events(cursor.offset, known)), None) is not None


def records_not_in_hub(
    layout: Layout, hub: Storage | None, shard: Shard, run: str | None, writer: str | None
) -> Iterator[Record]:
    """The records of a log shard the hub does not hold (of one run / writer if given), in the order logged."""
    names = {local: (r, w) for local, (_, r, w) in named_writers(hub, shard.id).items()}
    cursor = cursor_of(hub, shard.id)
    if cursor.ended:
        return
    try:
        log = LogShard(layout, shard)
    except ShardGone:
        sealed = layout.sealed_as(shard)
        if sealed is None:
            return  # sealed by another host, and not listed here yet: the next look reads it
        log = LogShard(layout, sealed)
    with log:
        for _, event in log.events(cursor.offset, set(names)):
            if isinstance(event, Opened):
                names[event.local] = (event.entry.run, event.entry.name)
            elif isinstance(event, Logged):
                r, w = names[event.local]
                if run in (None, r) and writer in (None, w):
                    values = stored_metrics(event.metrics, w, event.step, None, str(shard.path))
                    yield Record(r, w, event.step, event.time, values)
