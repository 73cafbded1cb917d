"""What every kind's examination by doctor shares: the finding, the disk's room, a SQLite file, the contents.

A kind's own checks are in its module (doctor_database.py, doctor_directory.py).
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import sqlalchemy as sa

from ..buffer import Buffer
from ..errors import BufferNotFoundError, NotABufferError, StorageError, UntrustedPathError
from ..store import Storage
from ..store.schema import HEAD_REVISION, KNOWN_REVISIONS, foreign_objects, syncs
from ..store.space import LOW_ROOM, full, room
from ..store.sqlite import COMPANIONS, failure, harden
from ..store.trust import Owner
from .status import read_runs

UNTRUSTED_ADVICE = "see docs/security.md: find out who made it and why before you remove it"


@dataclass(frozen=True)
class Finding:
    """One check: what was checked, whether it is fine, what was found, and what to do."""

    check: str
    ok: bool
    detail: str
    advice: str = ""


def room_finding(findings: list[Finding], folder: Path) -> None:
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


def connect(path: Path, owner: Owner, *, immutable: bool) -> sqlite3.Connection:
    """Plain sqlite3, read-only, on a file and companions checked to be the owner's (UntrustedPathError)."""
    for suffix in ("", *COMPANIONS):
        owner.entry(Path(f"{path}{suffix}"))
    conn = sqlite3.connect(f"file:{quote(str(path))}?mode=ro{'&immutable=1' if immutable else ''}", uri=True)
    harden(conn)
    return conn


def file_findings(
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
    try:
        journal_file = owner.entry(Path(f"{path}-journal")) if journal == "delete" else None
    except UntrustedPathError as exc:
        add(Finding("trust", False, str(exc), UNTRUSTED_ADVICE))
        return False, None
    if journal_file is not None and journal_file.st_size > 0:
        # Read as it is, its pages may be half written: a reader never rolls
        # the journal back (the transaction may be another host's, under way).
        add(
            Finding(
                "integrity",
                True,
                "not examined: it holds the journal of a transaction under way or cut off (a sync's): a sync"
                " under way completes it, and the next walbuf sync rolls back one a sync that died left",
            )
        )
        return False, None
    # Plain sqlite3, read-only: a damaged or too-new file must still be examined.
    # Without a -wal (or with an empty one) the file holds everything: read it
    # immutable, which needs no -shm (that a reader without write access, or
    # on a full disk, could not create).
    wal = owner.entry(Path(f"{path}-wal"))
    immutable = wal is None or wal.st_size == 0
    try:
        conn = connect(path, owner, immutable=immutable)
    except UntrustedPathError as exc:
        add(Finding("trust", False, str(exc), UNTRUSTED_ADVICE))
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
                "a trigger or view runs in whoever opens the file: " + UNTRUSTED_ADVICE,
            )
        )
        return False, None
    return True, row[0] if row else None


def contents(findings: list[Finding], revision: str | None, buffer: Buffer, elsewhere: str | None = None) -> None:
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
            sync_findings(findings, storage, buffer, elsewhere)
    except (NotABufferError, BufferNotFoundError):
        raise
    except StorageError as exc:
        add(Finding("contents", False, str(exc), "see the message"))


def sync_findings(findings: list[Finding], storage: Storage, buffer: Buffer, elsewhere: str | None) -> None:
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
