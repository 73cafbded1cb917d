"""A writer's segment of a directory buffer: the process's live shard, as walbuf.writer.Writer uses it.

Every writer of a process appends to the process's shard (see
walbuf.directory.appender): registering there, claiming its keys among the
process's writers, appending records and config, noting its close. Its
last step, where the shard does not know it, comes from the note its
previous holder left beside its lock, else from every shard and the hub.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from contextlib import closing
from pathlib import Path
from urllib.parse import quote

from ..errors import BufferBusyError, BufferCorruptError, NotABufferError, StorageError
from ..store import Durability, Target
from ..store.backend import WriterLock
from ..store.claims import Claims, Conflict
from ..store.schema import check_objects, foreign_objects
from ..store.sqlite import failure, harden
from ..store.storage import ConfigKind, writer_lock_name
from .appender import ProcessShard, process_shard
from .frames import Unread, WriterEntry
from .layout import Layout, hub_backend
from .shard import BadFrame, Logged, Opened, open_where_now
from .sync_host import every_sync_seen_here, written_elsewhere

HUB_WAIT = 60.0  # seconds a writer's start waits for a sync's transaction on the hub (see _hub_last_step)

_log = logging.getLogger(__name__)


class ShardSegment:
    """Where a writer of this process appends: the process's live shard (see walbuf.directory.appender)."""

    def __init__(self, layout: Layout, host: str, durability: Durability) -> None:
        self._layout, self._host = layout, host
        self._durable = durability == "fsync"
        self._shard = process_shard(layout, host)
        self._shard.hold()

    def writer_lock(self, run: str, writer: str) -> WriterLock:
        # In locks/, for every host: where locks span hosts, a writer id is owned across them.
        return hub_backend(self._layout).writer_lock(writer_lock_name(run, writer), None)

    def holder(self, run: str, writer: str) -> str | None:
        return None  # the lock says only that a process holds it

    def register(
        self, run: str, writer: str, step_axis: str, prefix: str, host: str, pid: int, target: Target | None
    ) -> tuple[int, int | None]:
        entry = WriterEntry(run, writer, step_axis, prefix, host, pid, target or Target())
        return self._shard.register(entry, self._durable)

    def last_step_before(self, run: str, writer: str, owner: WriterLock) -> int | None:
        if owner.noted_step is not None or not owner.opened_before:
            return owner.noted_step
        return last_step_anywhere(self._layout, run, writer)

    def claim(self, writer_pk: int, wanted: Claims) -> Conflict | None:
        return self._shard.claim(writer_pk, wanted)

    def append(self, writer_pk: int, step: int, now: float, payload: str) -> None:
        self._shard.append_record(writer_pk, step, now, payload, self._durable)

    def add_config(self, writer_pk: int, encoded: dict[str, str], kind: ConfigKind) -> None:
        self._shard.add_config(writer_pk, encoded, kind, self._durable)

    def flush(self, writer_pk: int) -> None:
        self._shard.flush()

    def close(self, writer_pk: int, exit_code: int) -> None:
        try:
            self._shard.close_writer(writer_pk, exit_code)
        except StorageError as exc:
            # Every record is written already, and the note beside the
            # writer's lock tells the syncer it closed.
            _log.warning("could not note in the shard that a writer closed: %s", exc)
        finally:
            self._shard.let_go()

    def release(self) -> None:
        self._shard.let_go()

    def abandon(self) -> None:
        pass  # the parent's shard: a forked child appends to one of its own


class Hold:
    """A hold on this process's live shard, kept until :meth:`release` (see walbuf.decorator)."""

    def __init__(self, shard: ProcessShard) -> None:
        self._shard: ProcessShard | None = shard
        shard.hold()

    def release(self) -> None:
        if self._shard is not None:
            shard, self._shard = self._shard, None
            shard.let_go()

    def abandon(self) -> None:
        """In a forked child: the parent's hold."""
        self._shard = None


def last_step_anywhere(layout: Layout, run: str, writer: str) -> int | None:
    """The last step ``writer`` of ``run`` logged in any shard or in the hub; None if none.

    Read where the step its previous holder noted is not known (it died,
    or an older walbuf closed it): every shard is read whole, where it is
    when read (a shard sealed or taken in since the listing is read there).
    A shard's frames past one walbuf would not write are not read (a sync
    reports it).
    """
    steps = []
    for shard in layout.shards():
        log = open_where_now(layout, shard)
        if log is None:
            continue  # pruned since the listing: the hub holds its steps
        with log:
            mine: set[int] = set()
            try:
                for item in log.events(0, set(), unread=True):
                    if isinstance(item, Unread):
                        continue
                    event = item[1]
                    if isinstance(event, Opened) and (event.entry.run, event.entry.name) == (run, writer):
                        mine.add(event.local)
                    elif isinstance(event, Logged) and event.local in mine:
                        steps.append(event.step)
            except BadFrame:
                pass  # the steps before it count; the sync says what the shard holds
    hub = _hub_last_step(layout, run, writer)
    if hub is not None:
        steps.append(hub)
    return max(steps, default=None)


def _hub_last_step(layout: Layout, run: str, writer: str) -> int | None:
    """The writer's last step in the hub (of its newest record, or the last one pruned); None if it has none there.

    Read-only, at any schema revision (a writer may start before the first
    sync of this walbuf upgraded the hub). A sync's transaction under way on
    the hub (on another host, whose lock this host may not see) is waited
    out: read again until HUB_WAIT seconds have passed, then BufferBusyError.
    Where every sync's locks are seen here, the transaction a sync that died
    left is rolled back first, and a hub that reads as damaged raises
    BufferCorruptError at once.
    """
    if layout.owner.entry(layout.hub) is None:
        return None
    deadline = time.monotonic() + HUB_WAIT
    pause = 0.01
    while True:
        try:
            with closing(sqlite3.connect(f"file:{quote(str(layout.hub))}?mode=ro", uri=True)) as conn:
                harden(conn)
                conn.execute("BEGIN")
                objects = conn.execute("SELECT type, name, tbl_name FROM sqlite_master").fetchall()
                check_objects(foreign_objects(objects), str(layout.hub))
                if ("table", "writers") not in {(kind, name) for kind, name, _ in objects}:
                    return None  # made by a sync that died before its first revision was committed
                row = conn.execute(
                    "SELECT w.id, w.pruned_step FROM writers w JOIN runs r ON r.id = w.run_id"
                    " WHERE r.name = ? AND w.name = ?",
                    (run, writer),
                ).fetchone()
                if row is None:
                    return None
                step = conn.execute(
                    "SELECT step FROM records WHERE writer_id = ? ORDER BY id DESC LIMIT 1", (row[0],)
                ).fetchone()
            value = step[0] if step is not None else row[1]
            return value if type(value) is int else None
        except NotABufferError:
            raise
        except sqlite3.Error as exc:
            kind = failure(exc)
            if kind not in ("busy", "read-only", "corrupt"):
                raise StorageError(f"{layout.hub} could not be read ({exc})") from exc
            seen_here = every_sync_seen_here(layout)
            if seen_here and kind == "corrupt":
                # Every sync's locks are seen here: no transaction under way shows it half written.
                raise BufferCorruptError(
                    f"{layout.hub} is damaged ({exc}): the writer cannot tell its last step; run walbuf doctor"
                ) from exc
            if seen_here and kind == "read-only":
                # A journal no process holds SQLite's lock on (those are seen
                # here): the transaction of a sync that died. A read-only
                # reader cannot roll it back; a reader that may write does, as
                # the next sync would, under SQLite's own lock.
                _roll_back_dead_sync(layout)  # then read again
            # Else pages of a transaction under way, on a host whose lock this one may not see.
            if time.monotonic() >= deadline:
                elsewhere = written_elsewhere(layout)
                raise BufferBusyError(
                    f"{layout.hub} could not be read whole for {HUB_WAIT:g}s ({exc}): a sync on"
                    f" {elsewhere or 'this host'} is writing it, or died while it did; retry once it has ended (run"
                    f" walbuf sync on {elsewhere or 'this host'} if none runs)"
                ) from exc
            _log.info("waiting for a sync's transaction on %s to end", layout.hub)
            time.sleep(pause)  # no event tells when another host's transaction ends: look again, less often
            pause = min(pause * 2, 1.0)


def _roll_back_dead_sync(layout: Layout) -> None:
    """Roll back the transaction a sync that died left in the hub (its rollback journal), as SQLite does at the
    first read of a connection that may write; a sync that starts meanwhile waits for it (SQLite's lock)."""
    # SQLite copies the journal's pages into the hub: it must be one walbuf trusts (not a link, the owner's).
    layout.owner.entry(Path(f"{layout.hub}-journal"))
    try:
        with closing(sqlite3.connect(f"file:{quote(str(layout.hub))}?mode=rw", uri=True)) as conn:
            harden(conn)
            conn.execute("SELECT count(*) FROM sqlite_master").fetchall()
    except sqlite3.Error as exc:
        if failure(exc) != "busy":  # busy: another process rolls it back, or a sync began
            raise StorageError(
                f"{layout.hub} holds the unfinished transaction of a sync that died, and it could not be rolled"
                f" back here ({exc}): run walbuf sync, which does"
            ) from exc
