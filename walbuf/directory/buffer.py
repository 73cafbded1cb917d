"""A directory buffer: shards on shared storage, one per writing process, brought together in a hub.

Each process appends the frames of its writers to a shard of its own
(:mod:`.appender`), which nothing else writes and any host reads while it
grows; no lock is needed for that, on any filesystem. `walbuf sync` copies
what the hub lacks of every shard into the hub (:mod:`.ingest`), then
uploads the hub as it would a one-file buffer. Shards of an older walbuf
(SQLite files shared by the processes of one host) are still read, and
sealed on their own host (:mod:`.sealing`).
"""

from __future__ import annotations

import json
import logging
import os
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import sqlalchemy as sa

from ..errors import BufferNotFoundError, NotABufferError, StorageError
from ..record import Record
from ..store import Access, Durability, Storage
from ..store.backend import Lock
from ..store.schema import log_cursors, log_writers, runs, writers
from ..store.source import Backlog, SyncSource
from ..store.sqlite import SQLiteBackend
from ..store.storage import stored_metrics, writer_lock_name
from .appender import process_shard
from .host import Process, judged_running
from .ingest import hub_cursors, in_hub, ingest, pending_in
from .layout import MARKER, Layout, Shard, host_name, hub_backend
from .log_ingest import cursor_of, frames_not_in_hub, records_not_in_hub
from .sealing import seal_unused
from .segment import Hold, ShardSegment
from .shard import ShardError, ShardGone, ShardReader
from .sync_host import claim, written_elsewhere

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DirectoryBuffer:
    """A directory buffer at ``root`` (an absolute path). Made by :func:`walbuf.open_buffer`."""

    root: Path

    @property
    def location(self) -> str:
        return str(self.root)

    @property
    def layout(self) -> Layout:
        return Layout(self.root)

    def _hub(self, layout: Layout | None = None) -> SQLiteBackend:
        return hub_backend(layout or self.layout)

    def open_store(self, access: Access) -> Storage | None:
        """The hub; None if no sync has made it yet (only "create" makes it).

        Read on a host that does not sync the buffer, on a filesystem whose
        locks do not span hosts, a read that meets a sync's write under way
        there raises BufferUnavailableError (retry), not "damaged".
        """
        layout = self.layout
        if access == "create":
            layout.make()
        elif layout.owner.entry(layout.hub) is None:
            return None
        backend = hub_backend(layout)
        if access == "read":
            backend.written_by = written_elsewhere(layout)
        return Storage(backend, access=access, durability="fsync")

    def take_over_sync(self) -> None:
        """Make this host the one that syncs the buffer, where only one may (see walbuf.directory.sync_host)."""
        claim(self.layout, take_over=True)

    def sync_lock(self) -> Lock:
        return self._hub().lock("sync")

    def sync_running(self) -> bool:
        """Whether a syncer holds the sync lock now, or may: where another host syncs the buffer and locks do not
        span hosts, its lock cannot be seen from here. Changes nothing."""
        return written_elsewhere(self.layout) is not None or self._hub().lock_held("sync")

    def writer_alive(self, run: str, writer: str) -> bool:
        """Whether a process holds ``writer`` of ``run`` open now. Changes nothing.

        Open where its lock in locks/ is held as this host sees it (locks
        may not span hosts), or where a log shard the hub has taken in names
        it open and that shard's process runs: for sure on this machine,
        elsewhere judged by when it was last heard of (walbuf.directory.host).
        """
        if self._hub().writer_held(writer_lock_name(run, writer)):
            return True
        hub = self.open_store("read")
        if hub is None:
            return False
        with hub, hub.begin_read() as conn:
            rows = conn.execute(
                sa.select(log_cursors.c.process, log_cursors.c.seen)
                .join(log_writers, log_writers.c.shard == log_cursors.c.shard)
                .join(writers, writers.c.id == log_writers.c.writer_id)
                .join(runs, runs.c.id == writers.c.run_id)
                .where(runs.c.name == run, writers.c.name == writer, log_writers.c.open, sa.not_(log_cursors.c.ended))
            ).all()
        now = time.time()
        return any(judged_running(Process.from_json(json.loads(process)), seen, now) for process, seen in rows)

    def writer_close_note(self, run: str, writer: str) -> int | None:
        """The exit code ``writer`` of ``run`` noted beside its lock (in locks/) as it last closed; None if it did not.
        Changes nothing."""
        return self._hub().writer_close_note(writer_lock_name(run, writer))

    def open_for_sync(self, stop: Callable[[], bool] | None = None, *, check: bool = True) -> SyncSource:
        """Seal the live shards nobody uses (of any host), copy every shard this host may read into the hub; the hub,
        open.

        Also what was set aside (damaged or refused shards moved to
        quarantine/) and what was not opened (see Layout.strangers), a
        message each: the others went on. ``stop`` ends the copying early
        (see walbuf.directory.ingest). The hub is checked whole for damage
        unless ``check`` is off. Raises SyncHostError, with nothing changed,
        on a host that may not sync the buffer (walbuf.directory.sync_host).
        The caller holds the sync lock.
        """
        layout = self.layout
        layout.make()
        claim(layout)  # where locks do not span hosts: only the sync host goes on
        hub = self.open_store("create")
        assert hub is not None
        try:
            if check:
                hub.check_integrity()
            host = host_name()
            sealing = seal_unused(layout, host)
            taken = ingest(layout, hub, host, stop)
            strangers = tuple(f"{s.why}" for s in layout.strangers())
        except BaseException:
            hub.close()
            raise
        return SyncSource(hub, (*sealing.set_aside, *taken.set_aside), (*strangers, *taken.left_out), taken.stopped)

    def records(
        self, run: str | None = None, writer: str | None = None, *, quarantined: bool = False
    ) -> Iterator[Record]:
        """The records this host can see: the hub's, then what the hub lacks of each shard it may read.

        With ``quarantined``, only those a sync quarantined (all in the hub).
        """
        layout = self.layout
        hub = self.open_store("read")
        try:
            if hub is not None:
                yield from hub.read(run=run, writer=writer, quarantined=quarantined)
            if quarantined:
                return
            for shard in layout.readable_shards(host_name()):
                if shard.format == "log":
                    yield from records_not_in_hub(layout, hub, shard, run, writer)
                    continue
                cursors = _cursors(hub, shard)
                with _reader(layout, shard) as reader:
                    found = reader.writers()
                    after = {w.id: cursors.get((w.run, w.name), 0) for w in found.values()}
                    for chunk in reader.records_after(after):
                        for _, w, step, wall_time, metrics in chunk:
                            owner = found[w]
                            if run in (None, owner.run) and writer in (None, owner.name):
                                values = stored_metrics(metrics, owner.name, step, None, str(shard.path))
                                yield Record(owner.run, owner.name, step, wall_time, values)
        finally:
            if hub is not None:
                hub.close()

    def backlog(self) -> list[Backlog]:
        """Each shard not yet ingested, with how many of its records the hub lacks. Reads only."""
        host = host_name()
        hub = self.open_store("read")
        try:
            out = []
            for shard in self.layout.shards():
                if shard.state == "ingested":
                    continue
                if shard.format == "sqlite" and shard.state == "live" and shard.host != host:
                    out.append(_backlog(shard, None))
                    continue
                try:
                    missing = self.not_in_hub(shard, hub)
                except ShardGone:
                    continue  # sealed since the listing: the next look counts it
                except ShardError as exc:
                    out.append(_backlog(shard, None, str(exc)))
                    continue
                refused = cursor_of(hub, shard.id).refused if shard.format == "log" else None
                if missing or refused or shard.state != "sealed" or shard.format == "sqlite":
                    out.append(_backlog(shard, missing, refused))
            return out
        finally:
            if hub is not None:
                hub.close()

    def set_aside(self) -> list[tuple[str, str]]:
        """(shard id, why) of each shard a sync set aside in quarantine/, oldest first. Reads only."""
        return [(path.stem, why) for path, why in self.layout.quarantined()]

    def not_opened(self) -> list[str]:
        """Why walbuf does not open each thing in the buffer it does not trust or name, a message each. Reads only."""
        return [stranger.why for stranger in self.layout.strangers()]

    def all_in_store(self) -> bool:
        """Whether the store a sync uploads from (the hub) holds every record there is: no shard holds more than it,
        none was set aside, and nothing walbuf does not open lies there. Reads only."""
        layout = self.layout
        scan = layout.scan()
        if scan.strangers or layout.quarantined():
            return False
        waiting = [s for s in scan.shards if s.state != "ingested"]
        if not waiting:
            return True
        hub = self.open_store("read")
        if hub is None:
            return False
        with hub:
            try:
                return all(s.format == "log" and not frames_not_in_hub(layout, hub, s) for s in waiting)
            except (ShardGone, ShardError):
                return False  # moved meanwhile, or refused: not all there

    def not_in_hub(self, shard: Shard, hub: Storage | None) -> int:
        """How many of a shard's records ``hub`` (this buffer's, open; None: not made yet) lacks.

        Raises BadFrame (a ShardError) for a log shard that holds a
        frame walbuf would not write before its end, ShardGone for one that
        moved since it was listed.
        """
        if shard.format == "log":
            return sum(1 for r in records_not_in_hub(self.layout, hub, shard, None, None))
        with ShardReader.of(self.layout, shard) as reader:
            return pending_in(reader, _cursors(hub, shard))

    def remove_ingested(self, older_than: float, hub: Storage | None) -> tuple[int, list[str]]:
        """Delete the ingested shards sealed more than ``older_than`` seconds ago whose records ``hub`` holds.

        Also the sealed log shards of processes that died (no END frame) that
        the hub holds whole. Checked again here, before anything is deleted:
        a shard the hub lacks records of goes back to sealed/ (the next sync
        takes it in), and one that cannot be read is kept. Returns how many
        were deleted, and a message for each one that was not.
        """
        layout = self.layout
        layout.own()
        cutoff = time.time() - older_than
        removed, kept = 0, []
        ended = [s for s in layout.shards("sealed") if s.format == "log"]
        for shard in [*layout.shards("ingested"), *ended]:
            # A shard is last written when sealed: its records are older.
            if os.lstat(shard.path).st_mtime >= cutoff:
                continue
            try:
                covered = hub is not None and self._whole_in_hub(shard, hub)
            except StorageError as exc:
                kept.append(f"{shard.state} shard {shard.id} was kept: {exc}")
                continue
            if covered:
                shard.path.unlink()
                removed += 1
            elif shard.state == "ingested":
                os.replace(shard.path, shard.filed(layout.sealed))
                kept.append(
                    f"ingested shard {shard.id} holds records the hub lacks: it went back to sealed/,"
                    " and the next sync takes them in"
                )
        return removed, kept

    def _whole_in_hub(self, shard: Shard, hub: Storage) -> bool:
        if shard.format == "sqlite":
            return in_hub(self.layout, hub, shard)
        cursor = cursor_of(hub, shard.id)
        return cursor.ended or not frames_not_in_hub(self.layout, hub, shard)

    def size(self) -> int:
        """Bytes of every file in the buffer (links are not followed)."""
        total = 0
        for folder, _, names in os.walk(self.root):
            for name in names:
                st = os.lstat(os.path.join(folder, name))
                total += st.st_size if stat.S_ISREG(st.st_mode) else 0
        return total

    def open_segment(self, durability: Durability) -> ShardSegment:
        return ShardSegment(self.layout, host_name(), durability)

    def hold_shard(self) -> Hold:
        """Keep this process's live shard (so that many short writers share it) until the hold is let go."""
        return Hold(process_shard(self.layout, host_name()))


def _reader(layout: Layout, shard: Shard) -> ShardReader:
    """A reader of ``shard``; of its sealed self if it was sealed since it was listed live."""
    try:
        return ShardReader.of(layout, shard)
    except ShardGone:
        sealed = layout.sealed_as(shard)
        if sealed is None:
            raise
        return ShardReader.of(layout, sealed)


def _cursors(hub: Storage | None, shard: Shard) -> dict[tuple[str, str], int]:
    return hub_cursors(hub, shard.id) if hub is not None else {}


def check_directory(root: Path, *, create: bool) -> None:
    """Raise unless ``root`` is a directory buffer, or (with ``create``) a directory that may become one.

    Missing: BufferNotFoundError, unless ``create``. A directory that holds
    other things than a directory buffer: NotABufferError, naming them.
    Changes nothing.
    """
    if not root.exists():
        if create:
            return
        raise BufferNotFoundError(f"no buffer at {root}")
    if not root.is_dir():
        raise NotABufferError(f"{root} is a file, not a directory: give it without the trailing '/'")
    names = sorted(os.listdir(root))
    if Layout(root).is_buffer() or (create and not names):
        return
    if not names:
        raise BufferNotFoundError(f"no buffer at {root}: it is an empty directory")
    buffers = [n for n in names if n.endswith(".db") and (root / n).is_file()]
    if root.name.endswith(".locks") and root.with_name(root.name[: -len(".locks")]).is_file():
        what = f"it is the lock folder of the buffer {root.with_name(root.name[: -len('.locks')])}: give that"
    elif buffers:
        what = "it holds " + ", ".join(buffers[:8]) + ": give one of those as the buffer"
    else:
        what = "it holds " + ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
    raise NotABufferError(
        f"{root} is a directory, but not a walbuf directory buffer (it has no {MARKER} file);"
        f" {what} (nothing was changed)"
    )


def _backlog(shard: Shard, not_in_hub: int | None, refused: str | None = None) -> Backlog:
    return Backlog(shard.id, shard.host, shard.state == "live", shard.gen / 1e9, not_in_hub, refused)
