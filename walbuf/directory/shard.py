"""The shard reader: one read-only snapshot of a shard's writers, records and config.

A shard is a walbuf buffer file (the same tables as any buffer), read here
with plain sqlite3: read-only, and immutable once sealed, so that any host
may read a sealed shard and nothing is ever written to one.

Only a shard that provably holds no tables is empty (a writer that died
before making them leaves such a file); any other error while reading is
raised, as ShardError for a damaged file and StorageError for the
rest (an I/O error, a file that cannot be opened), never taken for the end
of the data.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from ..errors import (
    BufferBusyError,
    BufferCorruptError,
    ConfigError,
    NotABufferError,
    SchemaTooNewError,
    StorageError,
)
from ..store import Target
from ..store.schema import KNOWN_REVISIONS, check_objects, foreign_objects
from ..store.sqlite import COMPANIONS, failure, harden
from ..store.target import check_target
from .layout import Layout, Shard

CHUNK = 10_000  # records per batch at most...
CHUNK_BYTES = 64 * 2**20  # ... and about this much of their metrics text (a record may hold images)
# SQLite refuses to read a value longer than this from a shard ("string or blob
# too big"): over any record walbuf writes (a history line of 10 MiB, 32 MiB of images).
MAX_VALUE_BYTES = 64 * 2**20
HUB_WAIT = 60.0  # seconds a writer's start waits for a sync's transaction on the hub (see _hub_last_step)
PROGRESS_STEPS = 100_000  # SQLite VM steps between two looks at signals and the caller's stop

ShardRecord = tuple[int, int, int, float, str]
"""(id, writer id, step, time, metrics JSON) of a record, as the shard holds it."""

_log = logging.getLogger(__name__)

_REQUIRED = frozenset({"alembic_version", "runs", "writers", "records"})


class ShardError(BufferCorruptError):
    """A shard (never the hub) is damaged, or holds what walbuf would not write: a sync reports it or sets it aside,
    and goes on with the others."""


class ShardGone(StorageError):
    """The shard is no longer where it was found: sealed (renamed into sealed/) or taken in meanwhile."""


class ReadStopped(Exception):
    """The caller's stop condition (a sync's time bound) held while a shard was read; nothing half-read is used."""


@dataclass(frozen=True)
class ShardWriter:
    """A writer as a shard knows it (its id is the shard's own)."""

    id: int
    run: str
    name: str
    step_axis: str
    host: str
    pid: int
    target: Target
    closed_at: float | None  # when it closed; None while open, if it died, or in a shard of an older walbuf
    prefix: str  # its keys' prefix in W&B (its name, in a shard of a walbuf before revision 0008)
    close_exit: int  # the exit code it closed with (1: an exception escaped its with block); 0 before revision 0009


@dataclass(frozen=True)
class ConfigEntry:
    id: int
    writer_id: int
    kind: str
    key: str
    value: str
    time: float


class ShardReader:
    """One read snapshot of a shard file (or of a hub: the tables are the same), read as untrusted input.

    The file and its companions must be the buffer owner's (see
    walbuf.store.trust); the database must hold walbuf's tables and nothing
    else (no trigger, no view), at a schema revision this walbuf knows; every
    row read is checked to be of the types walbuf writes, naming writers the
    shard has. What fails raises ShardError (a
    sync sets such a shard aside), SchemaTooNewError, or StorageError for
    what is not about the shard (an I/O error). A value over
    MAX_VALUE_BYTES is not read. ``stop``, if given, is asked every
    PROGRESS_STEPS SQLite steps: once it says so, reading raises
    ReadStopped; Ctrl-C and SIGTERM end a read at the same moments.
    """

    def __init__(self, layout: Layout, path: Path, *, immutable: bool, stop: Callable[[], bool] | None = None) -> None:
        self.path = path
        if layout.owner.entry(path) is None:
            raise ShardGone(f"shard {path} is gone (sealed or taken in meanwhile)")
        for suffix in COMPANIONS:
            layout.owner.entry(Path(f"{path}{suffix}"))
        self._stop = stop
        self._stopped: BaseException | None = None
        watch = self._watch()
        next(watch)
        with self._translate():
            # A quoted path: a file name is never read as URI parameters.
            uri = f"file:{quote(str(path))}?mode=ro{'&immutable=1' if immutable else ''}"
            self._conn = sqlite3.connect(uri, uri=True)
        try:
            with self._translate():
                harden(self._conn)
                self._conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, MAX_VALUE_BYTES)
                self._conn.set_progress_handler(watch.__next__, PROGRESS_STEPS)
                # One snapshot of a live shard, while its writers go on.
                self._conn.execute("BEGIN")
                objects = self._conn.execute("SELECT type, name, tbl_name FROM sqlite_master").fetchall()
                self._tables = {name for kind, name, _ in objects if kind == "table"}
                try:
                    self._check_schema(objects)
                except NotABufferError as exc:  # a trigger or view: the shard's, not the hub's
                    raise ShardError(str(exc)) from None
        except BaseException:
            self._conn.close()
            raise

    @classmethod
    def of(cls, layout: Layout, shard: Shard, stop: Callable[[], bool] | None = None) -> ShardReader:
        """A reader of a shard: immutable once sealed, read-only while live."""
        return cls(layout, shard.path, immutable=shard.state != "live", stop=stop)

    @classmethod
    def of_hub(cls, layout: Layout) -> ShardReader:
        """A reader of the hub (a rollback-journal file: reading it writes nothing)."""
        return cls(layout, layout.hub, immutable=False)

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def empty(self) -> bool:
        """True for a file with no tables at all: a writer died before making them."""
        return not self._tables

    def _check_schema(self, objects: list[tuple[str, str, str]]) -> None:
        if self.empty:
            check_objects(foreign_objects(objects), f"shard {self.path}")
            return
        if "alembic_version" in self._tables:
            revision = self._conn.execute("SELECT version_num FROM alembic_version").fetchone()
            if revision is not None and revision[0] not in KNOWN_REVISIONS:
                raise SchemaTooNewError(
                    f"shard {self.path} was written by a newer walbuf (schema revision {revision[0]!r});"
                    " upgrade walbuf where this runs"
                )
        check_objects(foreign_objects(objects), f"shard {self.path}")
        if not _REQUIRED.issubset(self._tables):
            missing = ", ".join(sorted(_REQUIRED - self._tables))
            raise ShardError(f"shard {self.path} lacks walbuf's tables ({missing})")

    def writers(self) -> dict[int, ShardWriter]:
        """The shard's writers by their shard id; {} for an empty shard."""
        if self.empty:
            return {}
        with self._translate():
            columns = {row[1] for row in self._conn.execute("PRAGMA table_info(writers)")}
            closed = "w.closed_at" if "closed_at" in columns else "NULL"  # revision 0007 added it
            prefix = "COALESCE(w.prefix, w.name)" if "prefix" in columns else "w.name"  # and 0008 this
            close_exit = "COALESCE(w.close_exit, 0)" if "close_exit" in columns else "0"  # and 0009 this
            rows = self._conn.execute(
                "SELECT w.id, r.name, w.name, w.step_axis, w.host, w.pid, r.wandb_id, r.project, r.entity,"
                f" {closed}, {prefix}, {close_exit} FROM writers w JOIN runs r ON r.id = w.run_id"
            ).fetchall()
        found = {}
        for row in rows:
            problem = _writer_problem(row)
            if problem is not None:
                raise ShardError(f"shard {self.path} holds a writer walbuf would not have written: {problem}")
            found[row[0]] = ShardWriter(
                row[0], row[1], row[2], row[3], row[4], row[5], Target(row[6], row[7], row[8]), row[9], row[10], row[11]
            )
        return found

    def check_rows(self, after: int) -> None:
        """Raise ShardError naming the first record (past id ``after``) or config entry walbuf would not write.

        A record or entry must name a writer of the shard and hold values of
        the types walbuf writes (what each value is, the sync checks again).
        """
        if self.empty:
            return
        with self._translate():
            record = self._conn.execute(
                "SELECT id FROM records WHERE id > ? AND (writer_id NOT IN (SELECT id FROM writers)"
                " OR typeof(step) != 'integer' OR step < 0 OR typeof(time) NOT IN ('integer', 'real')"
                " OR typeof(metrics) != 'text') ORDER BY id LIMIT 1",
                (after,),
            ).fetchone()
            entry = None
            if "config_entries" in self._tables:
                entry = self._conn.execute(
                    "SELECT id FROM config_entries WHERE writer_id NOT IN (SELECT id FROM writers)"
                    " OR kind NOT IN ('config', 'summary') OR typeof(key) != 'text' OR typeof(value) != 'text'"
                    " OR typeof(time) NOT IN ('integer', 'real') ORDER BY id LIMIT 1"
                ).fetchone()
        if record is not None:
            raise ShardError(
                f"shard {self.path}: record {record[0]} names no writer of the shard, or holds values of types"
                " walbuf does not write"
            )
        if entry is not None:
            raise ShardError(
                f"shard {self.path}: config entry {entry[0]} names no writer of the shard, or holds values of"
                " types walbuf does not write"
            )

    def records_after(self, after: dict[int, int]) -> Iterator[list[ShardRecord]]:
        """Each writer's records with ids above ``after[writer id]``, in the shard's order, in chunks.

        A chunk holds at most CHUNK records and about CHUNK_BYTES of their
        metrics. A record of a writer not in ``after`` raises ShardError.
        """
        if not after:
            return
        with self._translate():
            rows = self._conn.execute(
                "SELECT id, writer_id, step, time, metrics FROM records WHERE id > ? ORDER BY id",
                (min(after.values()),),
            )
            chunk: list[ShardRecord] = []
            size = 0
            while True:
                batch = rows.fetchmany(500)
                for row in batch:
                    cursor = after.get(row[1])
                    if cursor is None:
                        raise ShardError(f"shard {self.path}: record {row[0]} names no writer of the shard")
                    if row[0] > cursor:
                        chunk.append(row)
                        size += len(row[4])
                if chunk and (not batch or len(chunk) >= CHUNK or size >= CHUNK_BYTES):
                    yield chunk
                    chunk, size = [], 0
                if not batch:
                    return

    def config_entries(self) -> list[ConfigEntry]:
        """Every config and summary entry, oldest first ([] for a shard of a walbuf before revision 0005)."""
        if "config_entries" not in self._tables:
            return []
        with self._translate():
            rows = self._conn.execute(
                "SELECT id, writer_id, kind, key, value, time FROM config_entries ORDER BY id"
            ).fetchall()
        return [ConfigEntry(*row) for row in rows]

    def last_step(self, run: str, writer: str) -> int | None:
        """The step of ``writer``'s newest record here (or of its last pruned one); None if it has none."""
        if self.empty:
            return None
        with self._translate():
            row = self._conn.execute(
                "SELECT w.id, w.pruned_step FROM writers w JOIN runs r ON r.id = w.run_id"
                " WHERE r.name = ? AND w.name = ?",
                (run, writer),
            ).fetchone()
            if row is None:
                return None
            step = self._conn.execute(
                "SELECT step FROM records WHERE writer_id = ? ORDER BY id DESC LIMIT 1", (row[0],)
            ).fetchone()
        value = step[0] if step is not None else row[1]
        if value is not None and type(value) is not int:
            raise ShardError(f"shard {self.path}: writer {writer!r} has a step that is not an int")
        return value

    def _watch(self) -> Iterator[int]:
        """SQLite's progress handler, as a generator: 1 stops the statement running.

        A generator because of how signals reach Python code: a handler
        (Ctrl-C's KeyboardInterrupt, the CLI's SIGTERM) runs when SQLite calls
        back into Python, and what it raises surfaces where the callback
        resumes. A plain function would receive it before its first line,
        outside any try, and sqlite3 would drop it; here it surfaces at the
        yield, inside the try, and is kept for _translate to raise again.
        """
        verdict = 0
        while True:
            try:
                while True:
                    yield verdict  # where the first next() stops: nothing is asked before SQLite asks
                    verdict = 1 if self._stop is not None and self._stop() else 0
            except GeneratorExit:  # the reader is gone
                return
            except BaseException as exc:  # raised by a signal handler: kept, and raised again by _translate
                self._stopped = exc
                verdict = 1

    @contextmanager
    def _translate(self) -> Iterator[None]:
        try:
            yield
        except sqlite3.Error as exc:
            if self._stopped is not None:
                raise self._stopped from None
            if failure(exc) == "interrupted":
                raise ReadStopped(f"reading shard {self.path} stopped at the sync's time bound") from None
            if not os.path.lexists(self.path):  # sealed meanwhile: its -wal and -shm went with it
                raise ShardGone(f"shard {self.path} is gone (sealed or taken in meanwhile)") from exc
            raise self._error(exc) from exc

    def _error(self, exc: sqlite3.Error) -> StorageError:
        message, kind = str(exc), failure(exc)
        if kind == "corrupt":
            return ShardError(f"shard {self.path} is not a readable walbuf shard ({message})")
        if kind == "too big":
            return ShardError(
                f"shard {self.path} holds a value over {MAX_VALUE_BYTES:,} bytes, which walbuf never writes"
            )
        if kind in ("busy", "read-only"):  # a transaction under way (a hub's sync): read-only, this reader waits
            return BufferBusyError(f"{self.path} is being written ({message}); nothing was taken from it, retry")
        return StorageError(f"shard {self.path} could not be read ({message}); nothing was taken from it")


def _writer_problem(row: tuple[object, ...]) -> str | None:
    """Why a writers row (as writers() selects it) is not one walbuf writes, or None."""
    wid, run, name, axis, host, pid, wandb_id, project, entity, closed_at, prefix, close_exit = row
    if type(wid) is not int or type(pid) is not int:
        return "an id that is not an int"
    if not all(type(v) is str and v for v in (run, name, axis, host)) or type(prefix) is not str:
        return f"writer {wid}: a name that is not text"
    if closed_at is not None and type(closed_at) not in (int, float):
        return f"writer {name!r}: a closing time that is not a number"
    if close_exit not in (0, 1) or type(close_exit) is not int:
        return f"writer {name!r}: an exit code walbuf never writes"
    if not all(v is None or type(v) is str for v in (wandb_id, project, entity)):
        return f"writer {name!r}: a W&B target that is not text"
    try:
        check_target(Target(wandb_id, project, entity))  # type: ignore[arg-type]
    except ConfigError as exc:
        return f"writer {name!r}: {exc}"
    return None


def last_step(layout: Layout, host: str, run: str, writer: str, *, before: int) -> int | None:
    """The last step ``writer`` of ``run`` logged in this host's shards older than ``before``, or in the hub."""
    candidates = [s for s in layout.shards(host=host) if s.gen < before and s.format == "sqlite"]
    for shard in reversed(candidates):
        with ShardReader.of(layout, shard) as reader:
            step = reader.last_step(run, writer)
        if step is not None:
            return step
    if layout.owner.entry(layout.hub) is not None:
        return _hub_last_step(layout, run, writer)
    return None


def _hub_last_step(layout: Layout, run: str, writer: str) -> int | None:
    """The writer's last step in the hub, read-only; a sync's transaction under way there (on any host) is waited for.

    A reader that may not see the syncer's lock (locks per host) meets its
    journal, or pages it is rewriting: read again until HUB_WAIT seconds
    have passed, then BufferBusyError.
    """
    deadline = time.monotonic() + HUB_WAIT
    pause = 0.01
    while True:
        try:
            with ShardReader.of_hub(layout) as reader:
                return reader.last_step(run, writer)
        except (BufferBusyError, ShardError) as exc:
            if time.monotonic() >= deadline:
                raise BufferBusyError(
                    f"{layout.hub} could not be read whole for {HUB_WAIT:g}s ({exc}): a sync (maybe on another"
                    " host) is writing it; retry once it has ended"
                ) from exc
            _log.info("waiting for a sync's transaction on %s to end", layout.hub)
            time.sleep(pause)
            pause = min(pause * 2, 1.0)
