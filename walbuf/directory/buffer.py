"""A directory buffer: shards on shared storage, one per writing process, brought together in a hub.

Each process appends the frames of its writers to a shard of its own
(:mod:`.appender`), which nothing else writes and any host reads while it
grows; no lock is needed for that, on any filesystem. `walbuf sync` takes
what the hub lacks of every shard into the hub (:mod:`.ingest`), then
uploads the hub as it would a one-file buffer. An older walbuf's SQLite
shards are taken in once, before the hub is upgraded (:mod:`.upgrade`).
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
from ..store.source import Backlog, Backlogs, SyncSource
from ..store.sqlite import SQLiteBackend
from ..store.storage import writer_lock_name
from .appender import process_shard
from .host import Process, judged_running, server_time
from .ingest import forget, ingest
from .layout import MARKER, Layout, Shard, host_name, hub_backend
from .segment import Hold, ShardSegment
from .shard import ShardError, ShardGone
from .sync_host import claim, written_elsewhere
from .upgrade import describe, problem, remaining_message, take_in, waiting
from .view import HubView, damage_note, frames_not_in_hub, frames_past, hub_view, records_not_in_hub

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
        there raises BufferUnavailableError (retry), not "damaged". For
        writing, OlderShardsError while the hub keeps cursors of an older
        walbuf's shards not taken in yet (a sync takes them in first).
        """
        layout = self.layout
        if access == "create":
            layout.make()
        elif layout.owner.entry(layout.hub) is None:
            return None
        if access != "read":
            # Opening for writing upgrades the hub, and revision 0012 drops what it took in of an older walbuf's
            # shards: only a sync takes them in first (open_for_sync), and nothing else upgrades it before.
            waiting(layout)
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
        """Whether a process holds ``writer`` of ``run`` open now. Changes no shard and not the hub.

        Open where its lock in locks/ is held as this host sees it (locks
        may not span hosts), or where a shard the hub has taken in names it
        open and that shard's process runs: for sure on this machine,
        elsewhere judged by when it was last heard of, by the file server's
        clock (walbuf.directory.host; this process notes that clock's time in
        locks/clock, where it may).
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
        if not rows:
            return False
        layout = self.layout
        now = server_time(layout.locks, layout.owner)
        return any(
            process is None or judged_running(Process.from_json(json.loads(process)), seen, now)
            for process, seen in rows
        )  # a shard whose first frame the hub has not read yet: its process may run

    def writer_close_note(self, run: str, writer: str) -> int | None:
        """The exit code ``writer`` of ``run`` noted beside its lock (in locks/) as it last closed; None if it did not.
        Changes nothing."""
        return self._hub().writer_close_note(writer_lock_name(run, writer))

    def open_for_sync(self, stop: Callable[[], bool] | None = None, *, check: bool = True) -> SyncSource:
        """Take an older walbuf's shards in (walbuf.directory.upgrade), then every shard into the hub; the hub, open.

        Also what was not taken in (a shard holding what walbuf never
        writes, or damaged; an older walbuf's shard that cannot be) and what
        was not opened (see Layout.strangers), a message each: the others
        went on. ``stop`` ends the copying early (see walbuf.directory.ingest).
        The hub is checked whole for damage unless ``check`` is off. Raises
        SyncHostError, with nothing changed, on a host that may not sync the
        buffer (walbuf.directory.sync_host), and OlderShardsError while an
        older walbuf's live shard remains that the hub keeps cursors of. The
        caller holds the sync lock.
        """
        layout = self.layout
        layout.make()
        claim(layout)  # where locks do not span hosts: only the sync host goes on
        older = take_in(layout, host_name())
        hub = self.open_store("create")
        assert hub is not None
        try:
            if check:
                hub.check_integrity()
            taken = ingest(layout, hub, stop)
            strangers = tuple(s.why for s in layout.strangers())
        except BaseException:
            hub.close()
            raise
        return SyncSource(hub, refused=(*strangers, *older, *taken.left_out), stopped=taken.stopped)

    def records(
        self, run: str | None = None, writer: str | None = None, *, quarantined: bool = False
    ) -> Iterator[Record]:
        """The records this host can see, each once: the hub's, then what the hub lacks of each shard.

        The hub's place in every shard and its newest record are read in one
        snapshot first, then the hub in short reads: a sync committing
        meanwhile changes nothing of what is read, and a slow reader never
        holds the hub. With ``quarantined``, only those a sync quarantined
        (all in the hub).
        """
        layout = self.layout
        hub = self.open_store("read")
        try:
            view = hub_view(hub)
            if hub is not None:
                yield from hub.read(run=run, writer=writer, quarantined=quarantined, up_to=view.top)
            if quarantined:
                return
            for shard in layout.shards():  # ingested ones too: one taken in after the view is not in it
                yield from records_not_in_hub(layout, view, shard, run, writer)
        finally:
            if hub is not None:
                hub.close()

    def backlog(self) -> Backlogs:
        """Each shard not yet ingested, with how many of its records the hub lacks as one read of the hub saw it (let
        go before the shards are read), and each older walbuf's shard not yet taken in. Reads only."""
        hub = self.open_store("read")
        try:
            view = hub_view(hub)
            out = []
            scan = self.layout.scan()
            for shard in scan.shards:
                if shard.state == "ingested":
                    continue
                try:
                    missing = sum(1 for _ in records_not_in_hub(self.layout, view, shard))
                except ShardGone:
                    continue  # sealed since the listing: the next look counts it
                except ShardError as exc:
                    out.append(_backlog(shard, None, str(exc)))
                    continue
                cursor = view.cursor(shard.id)
                refused = cursor.refused
                if refused is None and shard.state == "sealed" and cursor.gaps:
                    refused = damage_note(cursor.gaps)
                if missing or refused or cursor.gaps or shard.state != "sealed":
                    out.append(_backlog(shard, missing, refused))
            host = host_name()
            for older in scan.older:
                if older.state in ("live", "sealed"):
                    why = remaining_message(older, host) if older.state == "live" else problem(self.layout, older)
                    out.append(Backlog(older.id, older.host, older.state == "live", older.gen / 1e9, None, why))
            return Backlogs(tuple(out), view.top)
        finally:
            if hub is not None:
                hub.close()

    def damaged(self) -> list[tuple[str, str]]:
        """(name, why) of each part a person must look at: an older walbuf's shard it set aside in quarantine/.
        Reads only."""
        layout = self.layout
        return [(o.id, describe(layout.owner, o)) for o in layout.scan().older if o.state == "quarantine"]

    def not_opened(self) -> list[str]:
        """Why walbuf does not open each thing in the buffer it does not trust or name, a message each. Reads only."""
        return [stranger.why for stranger in self.layout.strangers()]

    def all_in_store(self) -> bool:
        """Whether the store a sync uploads from (the hub) holds every record there is: no shard holds more than it,
        no older walbuf's shard waits, and nothing walbuf does not open lies there. Reads only."""
        layout = self.layout
        scan = layout.scan()
        if scan.strangers or any(o.state != "ingested" for o in scan.older):
            return False
        waiting = [s for s in scan.shards if s.state != "ingested"]
        if not waiting:
            return True
        hub = self.open_store("read")
        if hub is None:
            return False
        with hub:
            view = hub_view(hub)
            try:
                return not any(frames_not_in_hub(layout, view, s) for s in waiting)
            except (ShardGone, ShardError):
                return False  # moved meanwhile, or refused: not all there

    def remove_ingested(self, older_than: float, hub: Storage | None) -> tuple[int, list[str]]:
        """Delete the ingested shards sealed more than ``older_than`` seconds ago whose records ``hub`` holds.

        Also the sealed shards of processes that died (no END frame) that
        the hub holds whole, and an older walbuf's ingested shards. Checked
        again here, before anything is deleted: a shard the hub lacks
        records of goes back to sealed/ (the next sync takes them in), and
        one that cannot be read is kept. The hub's place in a deleted shard
        goes with it (the gaps of an ingested shard too: a person gave them
        up, docs/directory-buffers.md). Returns how many were deleted, and a
        message for each one that was not.
        """
        layout = self.layout
        layout.own()
        cutoff = time.time() - older_than
        removed, kept = 0, []
        scan = layout.scan()
        # A shard moved or removed since the listing (by a sync, or another
        # prune) raises FileNotFoundError at the step that finds it gone: it
        # is left to the next prune, and the hub's place in it kept.
        for older in scan.older:
            try:
                if older.state == "ingested" and os.lstat(older.path).st_mtime < cutoff:
                    older.path.unlink()  # an older walbuf's, taken in whole (walbuf.directory.upgrade)
                    removed += 1
            except FileNotFoundError:
                continue
        view = hub_view(hub)
        ended = [s for s in scan.shards if s.state == "sealed"]
        for shard in [*(s for s in scan.shards if s.state == "ingested"), *ended]:
            try:
                # A shard is last written when sealed: its records are older.
                if os.lstat(shard.path).st_mtime >= cutoff:
                    continue
                covered = hub is not None and _whole_in_hub(layout, view, shard)
                if covered:
                    shard.path.unlink()
                elif shard.state == "ingested":
                    os.replace(shard.path, shard.filed(layout.sealed))
            except (FileNotFoundError, ShardGone):
                continue
            except StorageError as exc:
                kept.append(f"{shard.state} shard {shard.id} was kept: {exc}")
                continue
            if covered:
                if hub is not None:
                    forget(hub, shard.id)  # after the file: a prune killed between leaves a row, never a file unknown
                removed += 1
            elif shard.state == "ingested":
                kept.append(
                    f"ingested shard {shard.id} holds records the hub lacks: it went back to sealed/,"
                    " and the next sync takes them in"
                )
        return removed, kept

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


def _whole_in_hub(layout: Layout, view: HubView, shard: Shard) -> bool:
    """Whether the hub holds every whole frame of a sealed or ingested shard (an ingested one's gaps given up)."""
    cursor = view.cursor(shard.id)
    if cursor.gaps and shard.state != "ingested":
        return False
    return cursor.ended or not frames_past(layout, view, shard)


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
