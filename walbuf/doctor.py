"""Doctor: check a buffer and say what, if anything, needs a person.

Checks a SQLite file's integrity (SQLite's integrity_check) and journal mode,
or that a PostgreSQL server answers; then the schema revision, what is
pending, and the log of syncs: an upload that a dead syncer left "running"
(its records will be sent again, maybe twice), or a last sync that failed. Writer and sync locks are kernel file locks
(in PostgreSQL, advisory locks of a session), released when their process
dies, so they cannot go stale; doctor reports which are held.
"""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import sqlalchemy as sa

from . import ingest, shards
from .backends import Backend, SQLiteBackend, backend_for
from .errors import BufferNotFoundError, BufferNotWritableError, SchemaTooNewError, StorageError
from .status import read_runs
from .storage import HEAD_REVISION, KNOWN_REVISIONS, Storage, current_revision, syncs


@dataclass
class Finding:
    check: str
    ok: bool
    detail: str
    advice: str = ""


@dataclass
class DoctorReport:
    buffer: str
    findings: list[Finding] = field(default_factory=list)

    @property
    def healthy(self) -> bool:
        return all(f.ok for f in self.findings)


def doctor(buffer: str | os.PathLike[str]) -> DoctorReport:
    """Examine ``buffer``. Raises BufferNotFoundError if it does not exist.

    Changes nothing, but that a buffer of an older schema revision is
    upgraded, as whenever walbuf opens one.
    """
    if shards.is_directory(buffer):
        return _directory(shards.Layout(buffer))
    backend = backend_for(buffer)
    if not backend.exists():
        raise BufferNotFoundError(f"no buffer at {backend.location}")
    report = DoctorReport(backend.location)
    if isinstance(backend, SQLiteBackend):
        checked, revision = _file_findings(report, backend.path)
    else:
        checked, revision = _server_findings(report, backend)
    if checked:
        _contents(report, revision, lambda: Storage(backend.url, create=False))
    return report


def _contents(report: DoctorReport, revision: str | None, open_storage: Callable[[], Storage]) -> None:
    add = report.findings.append
    if revision not in (None, *KNOWN_REVISIONS):
        add(Finding("schema", False, f"revision {revision}, newer than {HEAD_REVISION}", "upgrade walbuf"))
        return report
    add(Finding("schema", True, f"revision {revision or 'none yet'} (this walbuf: {HEAD_REVISION})"))
    try:
        _sync_findings(report, open_storage())
    except (SchemaTooNewError, StorageError) as exc:
        add(Finding("contents", False, str(exc), "see the message"))


def _directory(layout: shards.Layout) -> DoctorReport:
    """The hub as a one-file buffer (in rollback-journal mode), then each shard not yet ingested."""
    if not layout.root.is_dir():
        raise BufferNotFoundError(f"no buffer at {layout.root}")
    report = DoctorReport(str(layout.root))
    add = report.findings.append
    if layout.hub.exists():
        checked, revision = _file_findings(report, layout.hub, journal="delete")
        if checked:
            _contents(report, revision, lambda: ingest.open_hub(layout, create=False))
    else:
        add(Finding("hub", True, "none yet: the first walbuf sync makes it"))
    host, age = shards.host_name(), shards.rotate_seconds()
    now = time.time()
    for shard, waiting in ingest.backlog(layout, host):
        name = f"shard {shard.id}"
        if shard.state == "sealed":
            add(_sealed_finding(name, shard, waiting))
        elif shard.host == host and not shards.in_use(shard.path):
            add(
                Finding(
                    name,
                    False,
                    f"live, {waiting} records not in the hub, and no process uses it (its writers died)",
                    "run walbuf sync on this host: it seals the shard and copies its records in",
                )
            )
        elif shard.host != host and now > shard.gen / 1e9 + 2 * age:
            add(
                Finding(
                    name,
                    False,
                    f"live on {shard.host} for longer than twice the rotation age ({age:g}s):"
                    " its writers there may have died, or hang",
                    f"on {shard.host}, run walbuf sync (it seals shards nobody uses) or check its writers",
                )
            )
        else:
            detail = "in use on this host" if shard.host == host else f"live on {shard.host}"
            add(Finding(name, True, detail + ("" if waiting is None else f", {waiting} records not in the hub")))
    return report


def _sealed_finding(name: str, shard: shards.Shard, waiting: int | None) -> Finding:
    conn = shard.connect()
    try:
        result = conn.execute("PRAGMA integrity_check").fetchall()
    except sqlite3.DatabaseError as exc:
        result = [(str(exc),)]
    finally:
        conn.close()
    if result != [("ok",)]:
        return Finding(
            name, False, "sealed, damaged: " + "; ".join(r[0] for r in result[:3]),
            f"copy {shard.path} aside and recover it with `sqlite3 FILE .recover`, then put the copy in its place",
        )
    return Finding(name, True, f"sealed, {waiting} records not in the hub yet")


def _file_findings(report: DoctorReport, path: Path, journal: str = "wal") -> tuple[bool, str | None]:
    """Integrity and journal mode of a SQLite file; (examined, schema revision)."""
    add = report.findings.append
    # Plain sqlite3, read-only: a damaged or too-new file must still be examined.
    # Without a -wal the file holds everything: read it immutable, which needs
    # no -shm (that a reader without write access could not create).
    immutable = "" if Path(f"{path}-wal").exists() else "&immutable=1"
    conn = sqlite3.connect(f"file:{path}?mode=ro{immutable}", uri=True)
    try:
        try:
            result = conn.execute("PRAGMA integrity_check").fetchall()
        except sqlite3.DatabaseError as exc:
            add(Finding("integrity", False, str(exc), "restore the buffer from a copy; it is not readable"))
            return False, None
        ok = result == [("ok",)]
        add(
            Finding(
                "integrity",
                ok,
                "ok" if ok else "; ".join(r[0] for r in result[:5]),
                "" if ok else "copy the buffer aside, then `sqlite3 BUFFER .recover` into a new file",
            )
        )
        mode = conn.execute("PRAGMA journal_mode").fetchone()[0]
        if immutable:
            # An immutable connection reports no WAL; the file header says (bytes 18-19: 2 = WAL).
            with open(path, "rb") as file:
                mode = "wal" if file.read(20)[18:20] == b"\x02\x02" else mode
        add(
            Finding(
                "journal mode",
                mode == journal,
                mode,
                "" if mode == journal else f"open it once with walbuf on a local filesystem to switch it to {journal}",
            )
        )
        try:
            revision = conn.execute("SELECT version_num FROM alembic_version").fetchone()[0]
        except sqlite3.OperationalError:
            revision = None
    finally:
        conn.close()
    return True, revision


def _server_findings(report: DoctorReport, backend: Backend) -> tuple[bool, str | None]:
    """The server of a PostgreSQL buffer (it checks its own pages); (examined, schema revision)."""
    engine = backend.engine("normal", busy_timeout=10)
    try:
        with engine.connect() as conn:
            version = conn.exec_driver_sql("SHOW server_version").scalar()
            schema = conn.exec_driver_sql("SELECT current_schema()").scalar()
            revision = current_revision(conn)
    except sa.exc.DBAPIError as exc:
        raise backend.error(exc.orig) from exc
    finally:
        engine.dispose()
    report.findings.append(Finding("server", True, f"PostgreSQL {version}, schema {schema}"))
    return True, revision


def _sync_findings(report: DoctorReport, storage: Storage) -> None:
    add = report.findings.append
    cut_off: list[sa.Row] | None | bool
    try:
        with storage.begin_read() as conn:
            run_status = read_runs(conn)
        try:
            cut_off = _cut_off_syncs(storage)
        except BufferNotWritableError:
            cut_off = False  # a reader may not take the lock that tells a live sync from a dead one
    finally:
        storage.dispose()
    for run in run_status:
        add(Finding(f"run {run.run}", True, f"{run.records} records, {run.pending} pending"))
        last = run.last_sync
        if last is not None and last.status == "failed":
            add(
                Finding(
                    f"run {run.run} last sync",
                    False,
                    f"failed: {last.message}",
                    "fix what the message says, or wait for W&B to be reachable; then walbuf sync",
                )
            )
    if cut_off is None:
        add(Finding("sync lock", True, "held: a walbuf sync is running now"))
        return
    if cut_off is False:
        add(Finding("sync lock", True, "not examined: this process may not write the buffer's lock files"))
        return
    for entry in cut_off:
        add(
            Finding(
                "interrupted sync",
                False,
                f"sync {entry.id} (process {entry.pid} on {entry.host}) died during an upload of {entry.records} records",
                "run walbuf sync: it sends those records again, and W&B may then hold some of them twice",
            )
        )


def _cut_off_syncs(storage: Storage) -> list[sa.Row] | None:
    """Syncs left "running" by a syncer that died; None while a sync holds the lock (its entry is live)."""
    lock = storage.lock("sync")
    if not lock.acquire(timeout=0):
        return None
    try:
        with storage.begin_read() as conn:
            return list(
                conn.execute(
                    sa.select(syncs.c.id, syncs.c.host, syncs.c.pid, syncs.c.records).where(
                        syncs.c.status == "running"
                    )
                )
            )
    finally:
        lock.release()
