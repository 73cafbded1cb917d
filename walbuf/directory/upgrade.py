"""An older walbuf's SQLite shards, taken in once: each becomes a sealed shard of frames, and is then like any other.

Before frames, the processes of a host shared a SQLite shard in WAL mode
(``live/HOST/GEN.db``, each process holding a shared flock on
``GEN.db.inuse``), which a sync on that host sealed (checkpointed, out of
WAL mode, renamed to ``sealed/HOST.GEN.db``) once no process used it, and
the hub noted per shard, run and writer the shard's id of the last record
and config entry it had copied in (``shard_cursors``).

A sync of this walbuf, before it upgrades the hub (revision 0012 drops
``shard_cursors``):

1. seals its own host's older live shards that no process uses, as the
   older walbuf did (under ``live/HOST/rotate.lock`` and the flock);
2. writes each sealed older shard's records and config entries that the hub
   lacks (by those cursors), and its writers' opens and closes, as frames
   into ``sealed/HOST.GEN.log`` (made in ``locks/upgrade.part``, then
   renamed), and moves the older shard to ``ingested/`` (prune removes it).
   A crash between the two leaves both: the next sync makes the same shard
   of frames again over the first (from the same shard and cursors), before
   any sync takes it in. Nothing is taken twice.
3. names the older live shards it cannot take in: in use on this host, or
   of another host, whose processes only a sync there can judge. While one
   remains, the hub is not upgraded (its cursors are still needed), and the
   sync stops before it changes anything else (OlderShardsError).

An older shard is untrusted input like any other: read immutable and
read-only, refused if it holds a trigger or a view or a value of a type
walbuf never writes (reported, never moved). Those an older walbuf set
aside in ``quarantine/`` stay there for a person (walbuf doctor says how).
"""

from __future__ import annotations

import fcntl
import logging
import os
import sqlite3
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from urllib.parse import quote

from ..errors import ConfigError, NotABufferError, OlderShardsError, StorageError
from ..store import Target
from ..store.backend import holding
from ..store.flock import FileLock
from ..store.schema import KNOWN_REVISIONS, check_objects, foreign_objects
from ..store.sqlite import COMPANIONS, failure, harden
from ..store.target import check_target
from ..store.trust import Owner, fsync
from . import frames
from .frames import WriterEntry
from .host import Process
from .layout import Layout, Older

_log = logging.getLogger(__name__)

PART = "upgrade.part"  # in locks/: a shard of frames being made
ROTATE_WAIT = 60.0  # seconds to wait for an older walbuf's process choosing a shard of the host
MAX_VALUE_BYTES = 64 * 2**20  # SQLite refuses to read a longer value: over any record walbuf writes
_REQUIRED = frozenset({"alembic_version", "runs", "writers", "records"})

Cursors = dict[tuple[str, str, str], tuple[int, int]]
"""(shard id, run, writer) -> the shard's ids of the last record and config entry the hub took in."""


class OlderShardError(StorageError):
    """An older walbuf's shard cannot be read, or holds what walbuf never writes; it is left where it is."""


def take_in(layout: Layout, host: str) -> list[str]:
    """Make every older shard this host can take in a shard of frames (see the module docstring). The caller holds
    the sync lock, and has not opened the hub for writing.

    Returns a message for each older shard left out (one that cannot be
    read, or holds what walbuf never writes, or a live one of another host
    where the hub keeps no cursors). Raises OlderShardsError, having taken
    nothing in, where older live shards remain while the hub still keeps
    cursors of them (a hub of a revision before 0012).
    """
    scan = layout.scan()
    if not scan.older:
        return []
    for older in scan.older:
        if older.state == "live" and older.host == host:
            _seal_if_unused(layout, older)
    scan = layout.scan()
    remaining = [remaining_message(o, host) for o in scan.older if o.state == "live"]
    revision = hub_revision(layout) if remaining else None
    if revision in KNOWN_REVISIONS[: KNOWN_REVISIONS.index("0012")]:  # the hub keeps cursors of them still
        raise OlderShardsError(
            f"{layout.root} holds live shards of an older walbuf: " + "; ".join(remaining) + ". Until they are"
            " taken in this walbuf does not upgrade the hub, which keeps what it took in of them, nor send"
            " anything; this host's own older shards that no process used were sealed (docs/directory-buffers.md)"
        )
    left_out = []
    cursors = _hub_cursors(layout)
    for older in scan.older:
        if older.state == "sealed":
            try:
                _convert(layout, older, cursors)
            except OlderShardError as exc:
                left_out.append(str(exc))
    if left_out and hub_revision(layout) in KNOWN_REVISIONS[: KNOWN_REVISIONS.index("0012")]:
        raise OlderShardsError(
            "; ".join(left_out) + ". Until it is mended in place (walbuf doctor says how) or moved out of the buffer"
            " (its records given up), this walbuf does not upgrade the hub, which keeps what it took in of it; the"
            " other older shards were taken in, nothing was sent"
        )
    return [*left_out, *remaining]


def waiting(layout: Layout) -> None:
    """Raise OlderShardsError, changing nothing, if the hub keeps cursors of an older walbuf's shards that are not
    taken in yet: upgrading it would drop them (walbuf sync takes them in first)."""
    left = [o for o in layout.scan().older if o.state in ("live", "sealed")]
    if left and hub_revision(layout) in KNOWN_REVISIONS[: KNOWN_REVISIONS.index("0012")]:
        raise OlderShardsError(
            f"{layout.root} holds shards of an older walbuf ({', '.join(str(o.path) for o in left[:3])}) that its"
            " hub keeps what it took in of: run walbuf sync first, which takes them in before it upgrades the hub"
            " (docs/directory-buffers.md); nothing was changed"
        )


def remaining_message(older: Older, host: str) -> str:
    """What a person does about an older walbuf's live shard this host cannot take in."""
    if older.host == host:
        return (
            f"{older.path} (this host, {host}) is in use by a process of the older walbuf: stop that walbuf's jobs"
            " here, then run walbuf sync here once"
        )
    return (
        f"{older.path} is live on host {older.host}, whose processes only a sync there can judge: stop the older"
        f" walbuf's jobs on {older.host}, then run walbuf sync on {older.host} once (where one host syncs the buffer,"
        f" with --take-over, and again with --take-over here afterwards)"
    )


# -- 1. sealing an older live shard ---------------------------------------------------


def _seal_if_unused(layout: Layout, older: Older) -> None:
    """Seal an older live shard of this host if no process uses it (its .inuse flock is free), as the older walbuf
    did: its WAL checkpointed into it, out of WAL mode, renamed into sealed/."""
    owner = layout.own()
    lock = FileLock(layout.live(older.host) / "rotate.lock", owner)
    waiting = f"{lock.path}: a process of an older walbuf is choosing or sealing a shard of {older.host}"
    busy = f"{lock.path} stayed held for {ROTATE_WAIT:g}s: find the older walbuf's process with `fuser {lock.path}`"
    with holding(lock, ROTATE_WAIT, waiting, busy):
        if owner.entry(older.path) is None:
            return
        fd = owner.open(Path(f"{older.path}.inuse"), os.O_RDWR, create=True, private=True)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return  # a process uses it
            _log.info("sealing an older walbuf's shard %s: no process uses it", older.path)
            for suffix in COMPANIONS:  # SQLite opens them by name: each must be the owner's
                owner.entry(Path(f"{older.path}{suffix}"))
            try:
                with closing(sqlite3.connect(older.path, isolation_level=None)) as conn:
                    harden(conn)
                    conn.execute("PRAGMA busy_timeout=10000")
                    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
                    conn.execute("PRAGMA journal_mode=DELETE")
            except sqlite3.DatabaseError as exc:
                raise StorageError(
                    f"an older walbuf's shard {older.path} could not be sealed ({exc}; {failure(exc)}); it stays"
                    " where it is, and `walbuf doctor` says what to do"
                ) from exc
            fsync(older.path)
            owner.folder(layout.sealed, make=True)
            os.replace(older.path, layout.sealed / f"{older.id}.db")
            for leftover in (Path(f"{older.path}-wal"), Path(f"{older.path}-shm")):
                if owner.entry(leftover) is not None:
                    leftover.unlink()
            fsync(layout.sealed, folder=True)
            Path(f"{older.path}.inuse").unlink()
        finally:
            os.close(fd)


# -- 2. a sealed older shard as frames ---------------------------------------------------


def _convert(layout: Layout, older: Older, cursors: Cursors) -> None:
    """Write what the hub lacks of a sealed older shard as a sealed shard of frames, then move it to ingested/.

    In that order: a sync that dies between the two leaves both, and the
    next one makes the same shard of frames again (from the same shard and
    cursors) over the first, which no sync has taken in yet.
    """
    owner = layout.own()
    frames_path = layout.sealed / f"{older.id}.log"
    part = layout.locks / PART
    fd = owner.open(part, os.O_WRONLY | os.O_TRUNC, create=True, private=True)
    try:
        for data in _frames(layout, older, cursors):
            frames.write_whole(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.chmod(part, owner.file_mode)
    os.replace(part, frames_path)
    fsync(layout.sealed, folder=True)
    owner.folder(layout.ingested, make=True)
    os.replace(older.path, layout.ingested / older.path.name)
    fsync(layout.ingested, folder=True)
    _log.info("took in an older walbuf's shard %s as %s", older.path, frames_path)


def _frames(layout: Layout, older: Older, cursors: Cursors) -> Iterator[bytes]:
    """The frames of a shard holding what the hub lacks of ``older``, in order: its writers, records, config,
    closes, and its end. Raises OlderShardError (perhaps after some frames) if it is not a shard walbuf wrote."""
    try:
        yield from _read_frames(layout, older, cursors)
    except sqlite3.Error as exc:
        raise _unreadable(older, exc) from exc


def _read_frames(layout: Layout, older: Older, cursors: Cursors) -> Iterator[bytes]:
    with _open(layout, older) as conn:
        tables = _check(conn, older)
        found = _writers(conn, older)
        start = older.gen / 1e9
        process = Process(older.host, "", "", "", 0, 0)
        yield frames.json_frame(frames.PROCESS, {"format": 1, "process": process.to_json(), "time": start})
        for wid, (entry, opened, _, _) in found.items():
            yield frames.json_frame(frames.WRITER, entry.to_json(wid, opened or start))
        last = start
        done = {wid: cursors.get((older.id, e.run, e.name), (0, 0)) for wid, (e, _, _, _) in found.items()}
        rows = conn.execute("SELECT id, writer_id, step, time, metrics FROM records ORDER BY id")
        while batch := rows.fetchmany(500):
            for rid, wid, step, time, metrics in batch:
                if wid not in found or type(step) is not int or step < 0 or type(time) not in (int, float):
                    why = f"record {rid!r} names no writer of it, or holds values of types walbuf does not write"
                    raise _refused(older, why)
                if type(metrics) is not str:
                    raise _refused(older, f"record {rid!r} holds values of types walbuf does not write")
                if rid > done[wid][0]:
                    yield frames.record_frame(wid, step, float(time), metrics)
                    last = max(last, float(time))
        if "config_entries" in tables:
            rows = conn.execute("SELECT id, writer_id, kind, key, value, time FROM config_entries ORDER BY id")
            while batch := rows.fetchmany(500):
                for cid, wid, kind, key, value, time in batch:
                    if wid not in found or kind not in ("config", "summary") or type(time) not in (int, float):
                        raise _refused(older, f"config entry {cid!r} names no writer of it, or is of a wrong kind")
                    if type(key) is not str or type(value) is not str:
                        raise _refused(older, f"config entry {cid!r} holds a key or value that is not text")
                    if cid > done[wid][1]:
                        body = {"writer": wid, "kind": kind, "time": float(time), "entries": {key: value}}
                        yield frames.json_frame(frames.CONFIG, body)
        for wid, (_, _, closed, code) in found.items():
            if closed is not None:
                yield frames.json_frame(frames.CLOSED, {"writer": wid, "exit": code, "time": closed})
                last = max(last, closed)
        yield frames.json_frame(frames.END, {"time": last})


def _open(layout: Layout, older: Older) -> closing[sqlite3.Connection]:
    """The older shard, read-only and immutable (sealed: nothing writes it), as data, never code."""
    if layout.owner.entry(older.path) is None:
        raise OlderShardError(f"an older walbuf's shard {older.path} is gone")
    # A quoted path: a file name is never read as URI parameters.
    try:
        conn = sqlite3.connect(f"file:{quote(str(older.path))}?mode=ro&immutable=1", uri=True)
    except sqlite3.Error as exc:
        raise _unreadable(older, exc) from exc
    harden(conn)
    conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, MAX_VALUE_BYTES)
    return closing(conn)


def _check(conn: sqlite3.Connection, older: Older) -> set[str]:
    """Its tables, once it is known to hold a walbuf buffer's and nothing else (no trigger, no view)."""
    try:
        objects = conn.execute("SELECT type, name, tbl_name FROM sqlite_master").fetchall()
        check_objects(foreign_objects(objects), f"an older walbuf's shard {older.path}")
        tables = {name for kind, name, _ in objects if kind == "table"}
        if not tables:
            return tables  # a writer died before it made them: an empty shard
        if not _REQUIRED.issubset(tables):
            raise _refused(older, f"it lacks walbuf's tables ({', '.join(sorted(_REQUIRED - tables))})")
        revision = conn.execute("SELECT version_num FROM alembic_version").fetchone()
        if revision is not None and revision[0] not in KNOWN_REVISIONS:
            raise _refused(older, f"it is of a schema revision this walbuf does not know ({revision[0]!r})")
    except NotABufferError as exc:
        raise OlderShardError(str(exc)) from None
    except sqlite3.Error as exc:
        raise _unreadable(older, exc) from exc
    return tables


def _writers(conn: sqlite3.Connection, older: Older) -> dict[int, tuple[WriterEntry, float | None, float | None, int]]:
    """Its writers by their id in it: each as a frame names it, when it opened, closed (None: it did not), exit."""
    try:
        if not conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'writers'").fetchone():
            return {}
        columns = {row[1] for row in conn.execute("PRAGMA table_info(writers)")}
        closed = "w.closed_at" if "closed_at" in columns else "NULL"  # revision 0007 added it
        prefix = "COALESCE(w.prefix, w.name)" if "prefix" in columns else "w.name"  # and 0008 this
        close_exit = "COALESCE(w.close_exit, 0)" if "close_exit" in columns else "0"  # and 0009 this
        rows = conn.execute(
            "SELECT w.id, r.name, w.name, w.step_axis, w.host, w.pid, r.wandb_id, r.project, r.entity,"
            f" w.opened_at, {closed}, {prefix}, {close_exit} FROM writers w JOIN runs r ON r.id = w.run_id"
        ).fetchall()
    except sqlite3.Error as exc:
        raise _unreadable(older, exc) from exc
    found = {}
    for wid, run, name, axis, host, pid, wandb_id, project, entity, opened, closed_at, pfx, code in rows:
        if type(wid) is not int or not 0 < wid < 2**32 or type(pid) is not int:
            raise _refused(older, "a writer whose id or pid is not an int walbuf writes")
        if not all(type(v) is str and v for v in (run, name, axis, host)) or type(pfx) is not str:
            raise _refused(older, f"writer {wid}: a name that is not text")
        if any(v is not None and type(v) not in (int, float) for v in (opened, closed_at)) or code not in (0, 1):
            raise _refused(older, f"writer {name!r}: a time or exit code of a wrong type")
        if not all(v is None or type(v) is str for v in (wandb_id, project, entity)):
            raise _refused(older, f"writer {name!r}: a W&B target that is not text")
        target = Target(wandb_id, project, entity)
        try:
            check_target(target)
        except ConfigError as exc:
            raise _refused(older, f"writer {name!r}: {exc}") from None
        entry = WriterEntry(run, name, axis, pfx, host, pid, target)
        found[wid] = (entry, opened, closed_at, code)
    return found


def _refused(older: Older, why: str) -> OlderShardError:
    return OlderShardError(
        f"an older walbuf's shard {older.path} holds what walbuf never writes ({why}): it is not taken in, and stays"
        " where it is (`walbuf doctor` says what to do)"
    )


def _unreadable(older: Older, exc: sqlite3.Error) -> OlderShardError:
    if failure(exc) == "too big":
        return _refused(older, f"a value over {MAX_VALUE_BYTES:,} bytes")
    return OlderShardError(
        f"an older walbuf's shard {older.path} cannot be read ({exc}): it is not taken in, and stays where it is"
        " (`walbuf doctor` says what to do)"
    )


# -- the hub's cursors of older shards ----------------------------------------------------


def _hub_cursors(layout: Layout) -> Cursors:
    """What the hub (of a revision before 0012) took in of each older shard; {} if it keeps none."""
    rows = _hub_rows(layout, "SELECT * FROM shard_cursors", (), "shard_cursors")
    found: Cursors = {}
    for row in rows:
        shard, run, writer, last_id, *config = row
        key = (str(shard), str(run), str(writer))
        found[key] = (int(last_id), int(config[0]) if config else 0)  # type: ignore[call-overload]
    return found


def _hub_rows(layout: Layout, query: str, params: tuple[object, ...], table: str) -> list[tuple[object, ...]]:
    """Rows of a hub table ([] without a hub or that table). The caller holds the sync lock: a journal a killed sync
    left is rolled back, as the sync's own opening of the hub would."""
    if layout.owner.entry(layout.hub) is None:
        return []
    layout.owner.entry(Path(f"{layout.hub}-journal"))  # SQLite opens it by name: it must be the owner's
    try:
        uri = f"file:{quote(str(layout.hub))}?mode=rw"
        with closing(sqlite3.connect(uri, uri=True)) as conn:
            harden(conn)
            if not conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (table,)).fetchone():
                return []
            return conn.execute(query, params).fetchall()
    except sqlite3.Error as exc:
        raise StorageError(
            f"{layout.hub} could not be read ({exc}); nothing was changed: `walbuf doctor` says more"
        ) from exc


def hub_revision(layout: Layout) -> str | None:
    """The hub's schema revision; None without a hub. The caller holds the sync lock."""
    rows = _hub_rows(layout, "SELECT version_num FROM alembic_version", (), "alembic_version")
    return str(rows[0][0]) if rows else None


def problem(layout: Layout, older: Older) -> str | None:
    """Why a sealed older shard cannot be taken in, if it cannot (it is read whole; nothing is written)."""
    try:
        for _ in _frames(layout, older, {}):
            pass
    except OlderShardError as exc:
        return str(exc)
    return None


def describe(owner: Owner, older: Older) -> str:
    """The note an older walbuf left beside a shard it set aside in quarantine/ (why), if any."""
    data = owner.read(Path(f"{older.path}.why"), 4096)
    return data.decode("utf-8", "replace").strip() if data else "no reason was noted"
