"""The shard reader: one read-only snapshot of a shard's writers, records and config.

A shard is a walbuf buffer file (the same tables as any buffer), read here
with plain sqlite3: read-only, and immutable once sealed, so that any host
may read a sealed shard and nothing is ever written to one.

Only a shard that provably holds no tables is empty (a writer that died
before making them leaves such a file); any other error while reading is
raised, as BufferCorruptError for a damaged file and StorageError for the
rest (an I/O error, a file that cannot be opened), never taken for the end
of the data.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ..errors import BufferCorruptError, StorageError
from ..store import Target
from .layout import Layout, Shard

CHUNK = 10_000  # records per batch

ShardRecord = tuple[int, int, int, float, str]
"""(id, writer id, step, time, metrics JSON) of a record, as the shard holds it."""


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


@dataclass(frozen=True)
class ConfigEntry:
    id: int
    writer_id: int
    kind: str
    key: str
    value: str
    time: float


class ShardReader:
    """One read snapshot of a shard file (or of a hub: the tables are the same)."""

    def __init__(self, path: Path, connect: str) -> None:
        self.path = path
        try:
            self._conn = sqlite3.connect(connect, uri=True)
        except sqlite3.Error as exc:
            raise self._error(exc) from exc
        with self._translate():
            # One snapshot of a live shard, while its writers go on.
            self._conn.execute("BEGIN")
            self._tables = {
                row[0] for row in self._conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
            }

    @classmethod
    def of(cls, shard: Shard) -> ShardReader:
        """A reader of a shard: immutable once sealed, read-only while live."""
        immutable = "" if shard.state == "live" else "&immutable=1"
        return cls(shard.path, f"file:{shard.path}?mode=ro{immutable}")

    @classmethod
    def of_hub(cls, layout: Layout) -> ShardReader:
        """A reader of the hub (a rollback-journal file: reading it writes nothing)."""
        return cls(layout.hub, f"file:{layout.hub}?mode=ro")

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

    def writers(self) -> dict[int, ShardWriter]:
        """The shard's writers by their shard id; {} for an empty shard."""
        if self.empty:
            return {}
        with self._translate():
            columns = {row[1] for row in self._conn.execute("PRAGMA table_info(writers)")}
            closed = "w.closed_at" if "closed_at" in columns else "NULL"  # revision 0007 added it
            prefix = "COALESCE(w.prefix, w.name)" if "prefix" in columns else "w.name"  # and 0008 this
            rows = self._conn.execute(
                "SELECT w.id, r.name, w.name, w.step_axis, w.host, w.pid, r.wandb_id, r.project, r.entity,"
                f" {closed}, {prefix} FROM writers w JOIN runs r ON r.id = w.run_id"
            ).fetchall()
        return {
            row[0]: ShardWriter(
                row[0], row[1], row[2], row[3], row[4], row[5], Target(row[6], row[7], row[8]), row[9], row[10]
            )
            for row in rows
        }

    def records_after(self, after: dict[int, int]) -> Iterator[list[ShardRecord]]:
        """Each writer's records with ids above ``after[writer id]``, in the shard's order, in chunks."""
        if not after:
            return
        with self._translate():
            rows = self._conn.execute(
                "SELECT id, writer_id, step, time, metrics FROM records WHERE id > ? ORDER BY id",
                (min(after.values()),),
            )
            while True:
                batch = rows.fetchmany(CHUNK)
                if not batch:
                    return
                chunk = [row for row in batch if row[0] > after[row[1]]]
                if chunk:
                    yield chunk

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
        return int(step[0]) if step is not None else row[1]

    @contextmanager
    def _translate(self) -> Iterator[None]:
        try:
            yield
        except sqlite3.Error as exc:
            raise self._error(exc) from exc

    def _error(self, exc: sqlite3.Error) -> StorageError:
        message = str(exc)
        if isinstance(exc, sqlite3.DatabaseError) and ("not a database" in message or "malformed" in message):
            return BufferCorruptError(f"shard {self.path} is not a readable walbuf shard ({message})")
        return StorageError(f"shard {self.path} could not be read ({message}); nothing was taken from it")


def last_step(layout: Layout, host: str, run: str, writer: str, *, before: int) -> int | None:
    """The last step ``writer`` of ``run`` logged in this host's shards older than ``before``, or in the hub."""
    candidates = [s for s in layout.shards(host=host) if s.gen < before]
    for shard in reversed(candidates):
        with ShardReader.of(shard) as reader:
            step = reader.last_step(run, writer)
        if step is not None:
            return step
    if layout.hub.exists():
        with ShardReader.of_hub(layout) as reader:
            return reader.last_step(run, writer)
    return None
