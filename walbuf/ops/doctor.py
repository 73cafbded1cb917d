"""`walbuf doctor`: check a buffer and say what, if anything, needs a person.

Checks a SQLite file's integrity (SQLite's integrity_check) and journal mode,
or that a PostgreSQL server answers; then the schema revision, what is
pending, and the log of syncs: an upload that a dead syncer left "running"
(its records will be sent again, maybe twice), or a last sync that failed.
Of a directory buffer, also each shard not yet in the hub. Writer and sync
locks are kernel file locks (in PostgreSQL, advisory locks of a session),
released when their process dies, so they cannot go stale.

Doctor changes nothing; it needs only read access.
"""

from __future__ import annotations

import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import sqlalchemy as sa

from ..buffer import DatabaseBuffer, Location, open_buffer
from ..directory import DirectoryBuffer
from ..directory.host import silent_after
from ..directory.layout import Layout, Shard, host_name, rotate_seconds
from ..directory.log_ingest import cursor_of, examine_log
from ..directory.log_shard import BadFrame
from ..directory.mounts import coordination
from ..directory.sealing import in_use
from ..directory.sync_host import sync_host, written_elsewhere
from ..errors import BufferNotFoundError, NotABufferError, StorageError, UntrustedPathError
from ..store import Storage
from ..store.backend import Backend
from ..store.schema import HEAD_REVISION, KNOWN_REVISIONS, foreign_objects, syncs
from ..store.space import LOW_ROOM, full, room
from ..store.sqlite import COMPANIONS, SQLiteBackend, failure, harden
from ..store.trust import Owner
from .status import read_runs

_UNTRUSTED_ADVICE = "see docs/security.md: find out who made it and why before you remove it"


@dataclass(frozen=True)
class Finding:
    """One check: what was checked, whether it is fine, what was found, and what to do."""

    check: str
    ok: bool
    detail: str
    advice: str = ""


@dataclass(frozen=True)
class DoctorReport:
    buffer: str
    findings: tuple[Finding, ...]

    @property
    def healthy(self) -> bool:
        """True when nothing needs a person."""
        return all(f.ok for f in self.findings)


def doctor(buffer: Location) -> DoctorReport:
    """Examine ``buffer``; what needs a person is a finding that is not ok.

    Raises BufferNotFoundError if there is no buffer, NotABufferError if
    the location holds something else (a database of another application,
    a directory that is not a directory buffer).
    """
    located = open_buffer(buffer)
    findings: list[Finding] = []
    # The one caller that looks at the kind: doctor examines what each keeps
    # on disk or on its server (files and their owners, shards, a server's
    # settings), which is the kind's own.
    if isinstance(located, DirectoryBuffer):
        _directory(findings, located)
    elif isinstance(located, DatabaseBuffer):
        _database(findings, located)
    else:
        raise TypeError(f"doctor does not know buffers of kind {type(located).__name__}")
    return DoctorReport(located.location, tuple(findings))


def _database(findings: list[Finding], buffer: DatabaseBuffer) -> None:
    backend = buffer.backend
    if isinstance(backend, SQLiteBackend):
        try:
            owner = Owner.of(backend.path, write=False)
            if owner.folder(backend.locks):
                for lock in sorted(backend.locks.iterdir()):
                    owner.entry(lock)
        except UntrustedPathError as exc:
            findings.append(Finding("trust", False, str(exc), _UNTRUSTED_ADVICE))
            return
        _room_finding(findings, backend.path.parent)
        readable, revision = _file_findings(findings, backend.path, owner)
    else:
        readable, revision = True, _server_findings(findings, backend)
    if readable:
        _contents(findings, revision, buffer)


def _contents(findings: list[Finding], revision: str | None, buffer: DatabaseBuffer | DirectoryBuffer) -> None:
    """Schema, runs and syncs, read from the database sync uploads from."""
    add = findings.append
    if revision is not None and revision not in KNOWN_REVISIONS:
        add(Finding("schema", False, f"revision {revision}, newer than {HEAD_REVISION}", "upgrade walbuf"))
        return
    if revision is not None and revision != HEAD_REVISION:
        add(
            Finding(
                "schema",
                True,
                f"revision {revision}, older than this walbuf's {HEAD_REVISION}: the next walbuf sync"
                " or writer upgrades it (doctor changes nothing, so it reads no further)",
            )
        )
        return
    add(Finding("schema", True, f"revision {revision or 'none yet'} (this walbuf: {HEAD_REVISION})"))
    try:
        storage = buffer.open_store("read")
        if storage is None:
            return
        with storage:
            _sync_findings(findings, storage, buffer)
    except (NotABufferError, BufferNotFoundError):
        raise
    except StorageError as exc:
        add(Finding("contents", False, str(exc), "see the message"))


def _directory(findings: list[Finding], buffer: DirectoryBuffer) -> None:
    """What walbuf does not open there, the hub as a one-file buffer (rollback journal), each shard not yet ingested."""
    add = findings.append
    layout = buffer.layout
    try:
        strangers = layout.strangers()
    except UntrustedPathError as exc:  # the buffer's own folder or one of walbuf's in it
        add(Finding("trust", False, str(exc), _UNTRUSTED_ADVICE))
        return
    for stranger in strangers:
        add(Finding("not opened", False, stranger.why, _UNTRUSTED_ADVICE))
    _filesystem_findings(findings, layout)
    _room_finding(findings, layout.root)
    try:
        hub_there = layout.owner.entry(layout.hub) is not None
    except UntrustedPathError as exc:
        add(Finding("trust", False, str(exc), _UNTRUSTED_ADVICE))
        return
    if hub_there:
        elsewhere = written_elsewhere(layout)
        readable, revision = _file_findings(findings, layout.hub, layout.owner, journal="delete", written_by=elsewhere)
        if readable:
            _contents(findings, revision, buffer)
    else:
        add(Finding("hub", True, "none yet: the first walbuf sync makes it"))
    host, age = host_name(), rotate_seconds()
    now = time.time()
    try:
        hub = buffer.open_store("read")
    except StorageError:
        return  # reported above; what the shards add to it cannot be counted
    try:
        for shard in layout.shards():
            finding = _shard_finding(buffer, layout, shard, hub, host, age, now)
            if shard.state != "ingested" or not finding.ok:  # the hub holds an ingested one's records
                add(finding)
        for path, why in layout.quarantined():
            add(
                Finding(
                    f"shard {path.stem}",
                    False,
                    f"set aside by a sync in quarantine/ ({why}): its records are not sent",
                    f"if it is damaged, recover what it holds with `sqlite3 {path} .recover | sqlite3 NEW.db`;"
                    " if it was refused, make sure it is yours and mend what the reason says in a copy, NEW.db."
                    f" Then move NEW.db to {layout.sealed / path.name} (the next sync takes in the records the hub"
                    f" lacks, none twice) and delete {path} and its .why; or delete both to give its records up",
                )
            )
    finally:
        if hub is not None:
            hub.close()


def _filesystem_findings(findings: list[Finding], layout: Layout) -> None:
    """The filesystem the buffer is on, whether hosts may take turns syncing it, and which host syncs it."""
    verdict = coordination(layout.root)
    if verdict.spans:
        findings.append(Finding("filesystem", True, f"{verdict.why}: any host may sync it"))
        return
    named = sync_host(layout)
    who = f"host {named.host} syncs it" if named else "the first host that syncs it will be its only syncer"
    findings.append(Finding("filesystem", True, f"{verdict.why}: one host syncs it; {who}"))


def _room_finding(findings: list[Finding], folder: Path) -> None:
    """Whether the buffer's disk has room: on a full one writers fail and syncs send nothing (nothing is damaged)."""
    left = room(folder)
    if left >= LOW_ROOM:
        findings.append(Finding("disk space", True, f"{left:,} bytes left on the filesystem of {folder}"))
        return
    findings.append(
        Finding(
            "disk space",
            False,
            f"the filesystem of {folder} is full ({left:,} bytes left): writers fail, and a sync sends nothing"
            " (it could not mark it synced); the buffer is not damaged by it",
            "free space on that filesystem (walbuf prune removes synced records); nothing is to be restored",
        )
    )


def _shard_finding(
    buffer: DirectoryBuffer, layout: Layout, shard: Shard, hub: Storage | None, host: str, age: float, now: float
) -> Finding:
    if shard.format == "log":
        return _log_finding(layout, shard, hub, now)
    name = f"shard {shard.id}"
    if shard.state == "live" and shard.host != host:
        # An older walbuf's shard: only a sync on its own host may seal it (its lock does not span hosts).
        if now > shard.gen / 1e9 + 2 * age:
            return Finding(
                name,
                False,
                f"an older walbuf's shard, live on {shard.host} for longer than twice the rotation age ({age:g}s)",
                f"run walbuf sync on {shard.host}: it seals the shard once no process there uses it",
            )
        return Finding(name, True, f"an older walbuf's shard, live on {shard.host}")
    try:
        used = in_use(layout, shard.path) if shard.state == "live" else False
    except PermissionError:
        return Finding(name, True, f"live on {shard.host}; whether a process uses it, only its owner can tell")
    if shard.state in ("sealed", "ingested"):
        damage = _integrity(layout, shard)
        if damage and shard.state == "ingested":
            return Finding(
                name,
                False,
                "ingested, damaged: " + damage,
                "its records were in the hub when it was taken in; keep it for a person to look at (it should"
                " not be damaged), or delete it",
            )
        if damage:
            return Finding(
                name,
                False,
                "sealed, damaged: " + damage,
                "run walbuf sync: it sets the shard aside in quarantine/, and walbuf doctor then says how to"
                " recover it",
            )
        if shard.state == "ingested":
            return Finding(name, True, "ingested: its records are in the hub")
    try:
        waiting = buffer.not_in_hub(shard, hub)
    except StorageError as exc:
        return Finding(name, False, str(exc), "see the message")
    if shard.state == "sealed":
        return Finding(name, True, f"sealed, {waiting} records not in the hub yet")
    if not used:
        return Finding(
            name,
            False,
            f"live, {waiting} records not in the hub, and no process uses it (its writers died)",
            "run walbuf sync on this host: it seals the shard and copies its records in",
        )
    return Finding(name, True, f"in use on this host, {waiting} records not in the hub")


def _log_finding(layout: Layout, shard: Shard, hub: Storage | None, now: float) -> Finding:
    """What reading a log shard whole finds: whether walbuf wrote all of it, how much the hub lacks, its process."""
    name = f"shard {shard.id}"
    refused = cursor_of(hub, shard.id).refused
    if refused is not None:
        return Finding(
            name,
            False,
            f"{shard.state}, not read past where the last sync stopped: {refused}",
            _damaged_log_advice(shard),
        )
    try:
        seen = examine_log(layout, shard, hub)
    except BadFrame as exc:
        return Finding(name, False, f"{shard.state}: {exc}", _damaged_log_advice(shard))
    except StorageError as exc:
        return Finding(name, False, str(exc), "see the message")
    if seen.damaged_at is not None:
        return Finding(
            name,
            False,
            f"{shard.state}, damaged at byte {seen.damaged_at}: whole frames follow a frame that cannot be read",
            _damaged_log_advice(shard),
        )
    if shard.state == "ingested":
        if not seen.ended:
            return Finding(
                name, False, "ingested, but it does not end as a whole shard does", _damaged_log_advice(shard)
            )
        return Finding(name, True, "ingested: its records are in the hub")
    waiting = f"{seen.waiting} records not in the hub"
    if shard.state == "sealed":
        return Finding(name, True, f"sealed, {waiting} yet")
    process = seen.process
    if process is None:
        return Finding(name, True, f"live on {shard.host}, just made")
    who = f"process {process.pid} on {process.host}"
    running = process.running()
    if running is False:
        if seen.waiting:
            return Finding(
                name,
                False,
                f"live, {waiting}, and {who} (this machine) ended without sealing it",
                "run walbuf sync: it copies the records in, and on this machine seals the shard",
            )
        return Finding(name, True, f"{who} ended without sealing it; the next walbuf sync here seals it")
    if running is None and now - seen.last_heard >= silent_after():
        quiet = f"{who} (another machine) was last heard of {now - seen.last_heard:.0f}s ago: taken for dead"
        if seen.waiting:
            return Finding(name, False, f"live, {waiting}; {quiet}", "run walbuf sync (on any host)")
        return Finding(
            name,
            True,
            f"{quiet}; the hub holds all of it. Only a sync on that machine seals it (none elsewhere changes it):"
            f" if {process.host} never runs walbuf again, delete the file",
        )
    return Finding(name, True, f"live, appended by {who}, {waiting}")


def _damaged_log_advice(shard: Shard) -> str:
    return (
        "the frames before it are taken in, none after it: keep a copy of the file for a person to look at."
        " If its process has ended and you give up what follows the damage, cut the file there"
        f" (`truncate -s BYTE {shard.path}`), and the next sync takes the shard in as whole"
    )


def _integrity(layout: Layout, shard: Shard) -> str:
    """What SQLite's integrity check finds wrong with a sealed shard ("" if nothing)."""
    conn = _connect(shard.path, layout.owner, immutable=True)
    try:
        result = conn.execute("PRAGMA integrity_check").fetchall()
    except sqlite3.DatabaseError as exc:
        result = [(str(exc),)]
    finally:
        conn.close()
    return "" if result == [("ok",)] else "; ".join(r[0] for r in result[:3])


def _connect(path: Path, owner: Owner, *, immutable: bool) -> sqlite3.Connection:
    """Plain sqlite3, read-only, on a file and companions checked to be the owner's (UntrustedPathError)."""
    for suffix in ("", *COMPANIONS):
        owner.entry(Path(f"{path}{suffix}"))
    conn = sqlite3.connect(f"file:{quote(str(path))}?mode=ro{'&immutable=1' if immutable else ''}", uri=True)
    harden(conn)
    return conn


def _file_findings(
    findings: list[Finding], path: Path, owner: Owner, journal: str = "wal", written_by: str | None = None
) -> tuple[bool, str | None]:
    """Integrity, journal mode and schema objects of a SQLite file; (whether it could be read, its schema revision).

    ``written_by``: the host whose syncs write the file, where a read here
    may meet a write under way there (see walbuf.directory.sync_host).
    """
    add = findings.append
    damaged = "copy the buffer aside, then `sqlite3 BUFFER .recover` into a new file"
    unreadable = "restore the buffer from a copy; it is not readable"
    if written_by is not None:
        damaged = unreadable = (
            f"host {written_by} syncs this buffer, and a read here may meet its write under way:"
            f" run walbuf doctor on {written_by} before anything else"
        )
    # Plain sqlite3, read-only: a damaged or too-new file must still be examined.
    # Without a -wal (or with an empty one) the file holds everything: read it
    # immutable, which needs no -shm (that a reader without write access, or
    # on a full disk, could not create).
    wal = owner.entry(Path(f"{path}-wal"))
    immutable = wal is None or wal.st_size == 0
    try:
        conn = _connect(path, owner, immutable=immutable)
    except UntrustedPathError as exc:
        add(Finding("trust", False, str(exc), _UNTRUSTED_ADVICE))
        return False, None
    try:
        try:
            result = conn.execute("PRAGMA integrity_check").fetchall()
        except sqlite3.DatabaseError as exc:
            if failure(exc) in ("full", "i/o") and full(path.parent):
                # SQLite could not make the -shm a WAL file with a -wal needs:
                # no sign of damage (see "disk space").
                add(Finding("integrity", False, f"not examined: {exc}, for the disk is full", "free space first"))
            else:
                add(Finding("integrity", False, str(exc), unreadable))
            return False, None
        ok = result == [("ok",)]
        add(
            Finding(
                "integrity",
                ok,
                "ok" if ok else "; ".join(r[0] for r in result[:5]),
                "" if ok else damaged,
            )
        )
        mode = conn.execute("PRAGMA journal_mode").fetchone()[0]
        if immutable:
            # An immutable connection reports no WAL; the file header says (bytes 18-19: 2 = WAL).
            header = owner.read(path, 20) or b""
            mode = "wal" if header[18:20] == b"\x02\x02" else mode
        add(
            Finding(
                "journal mode",
                mode == journal,
                mode,
                ""
                if mode == journal
                else f"with no process using it, switch it back: sqlite3 {path} 'PRAGMA journal_mode={journal}'",
            )
        )
        try:
            row = conn.execute("SELECT version_num FROM alembic_version").fetchone()
        except sqlite3.OperationalError:
            row = None
        strange = foreign_objects(conn.execute("SELECT type, name, tbl_name FROM sqlite_master").fetchall())
    finally:
        conn.close()
    if strange and row is not None and row[0] in KNOWN_REVISIONS:
        add(
            Finding(
                "schema objects",
                False,
                f"it holds {', '.join(strange[:5])}, which walbuf never makes: walbuf refuses it",
                "a trigger or view runs in whoever opens the file: " + _UNTRUSTED_ADVICE,
            )
        )
        return False, None
    return True, row[0] if row else None


def _server_findings(findings: list[Finding], backend: Backend) -> str | None:
    """The server of a PostgreSQL buffer (it checks its own pages); the schema revision."""
    engine = backend.engine("normal", busy_timeout=10, access="read")
    try:
        with engine.connect() as conn:
            version = conn.exec_driver_sql("SHOW server_version").scalar()
            schema = conn.exec_driver_sql("SELECT current_schema()").scalar()
            revision = None
            if sa.inspect(conn).has_table("alembic_version"):
                revision = conn.exec_driver_sql("SELECT version_num FROM alembic_version").scalar()
    except sa.exc.DBAPIError as exc:
        raise backend.error(exc.orig) from exc
    finally:
        engine.dispose()
    findings.append(Finding("server", True, f"PostgreSQL {version}, schema {schema}"))
    return revision


def _sync_findings(findings: list[Finding], storage: Storage, buffer: DatabaseBuffer | DirectoryBuffer) -> None:
    add = findings.append
    with storage.begin_read() as conn:
        run_status = read_runs(conn)
        running = list(
            conn.execute(
                sa.select(syncs.c.id, syncs.c.host, syncs.c.pid, syncs.c.records).where(syncs.c.status == "running")
            )
        )
    for run in run_status:
        add(Finding(f"run {run.run}", True, f"{run.records} records, {run.pending} pending"))
        if run.quarantined:
            add(
                Finding(
                    f"run {run.run} quarantine",
                    False,
                    f"{run.quarantined} records quarantined: W&B refuses them, so they are never sent",
                    "see them and why with walbuf records BUFFER --quarantined; prune removes them with the"
                    " synced records",
                )
            )
        if run.target_refused:
            add(
                Finding(
                    f"run {run.run} target",
                    False,
                    f"not sent: W&B refused its target: {run.target_refused}",
                    "walbuf sync with --project, --entity or --run-id to give another",
                )
            )
        last = run.last_sync
        if last is not None and last.status == "failed":
            add(Finding(f"run {run.run} last sync", False, f"failed: {last.message}", "fix what the message says"))
        elif last is not None and last.status == "unreachable":
            # What a retry fixes by itself needs no person (as walbuf-cron says).
            add(Finding(f"run {run.run} last sync", True, f"W&B unreachable: {last.message}; the next sync retries"))
    try:
        live = buffer.sync_running()
    except PermissionError:
        add(Finding("sync lock", True, "not examined: this process may not read the buffer's lock files"))
        return
    except UntrustedPathError as exc:  # held by another role of the PostgreSQL server
        add(Finding("sync lock", False, str(exc), "see the message"))
        return
    elsewhere = written_elsewhere(buffer.layout) if isinstance(buffer, DirectoryBuffer) else None
    if elsewhere is not None:
        add(
            Finding(
                "sync lock", True, f"not examined: host {elsewhere} syncs this buffer, and its lock is not seen here"
            )
        )
        return
    if live:
        add(Finding("sync lock", True, "held: a walbuf sync is running now"))
        return
    for entry in running:
        add(
            Finding(
                "interrupted sync",
                False,
                f"sync {entry.id} (process {entry.pid} on {entry.host}) died during an upload of"
                f" {entry.records} records",
                "run walbuf sync: it sends those records again, and W&B may then hold some of them twice",
            )
        )
