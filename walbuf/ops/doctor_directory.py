"""doctor's examination of a directory buffer: what walbuf does not open there, its filesystem, the hub, each shard."""

from __future__ import annotations

import sqlite3
import time

from ..directory import DirectoryBuffer
from ..directory.host import silent_after
from ..directory.layout import Layout, Shard, host_name, rotate_seconds
from ..directory.log_ingest import cursor_of, examine_log
from ..directory.log_shard import BadFrame
from ..directory.mounts import coordination
from ..directory.sealing import in_use
from ..directory.sync_host import sync_host, written_elsewhere
from ..errors import StorageError, UntrustedPathError
from ..store import Storage
from .findings import UNTRUSTED_ADVICE, Finding, connect, contents, file_findings, room_finding


def examine_directory(findings: list[Finding], buffer: DirectoryBuffer) -> None:
    """What walbuf does not open there, the hub as a one-file buffer (rollback journal), each shard not yet ingested."""
    add = findings.append
    layout = buffer.layout
    try:
        strangers = layout.strangers()
    except UntrustedPathError as exc:  # the buffer's own folder or one of walbuf's in it
        add(Finding("trust", False, str(exc), UNTRUSTED_ADVICE))
        return
    for stranger in strangers:
        add(Finding("not opened", False, stranger.why, UNTRUSTED_ADVICE))
    _filesystem_findings(findings, layout)
    room_finding(findings, layout.root)
    try:
        hub_there = layout.owner.entry(layout.hub) is not None
    except UntrustedPathError as exc:
        add(Finding("trust", False, str(exc), UNTRUSTED_ADVICE))
        return
    if hub_there:
        elsewhere = written_elsewhere(layout)
        readable, revision = file_findings(findings, layout.hub, layout.owner, journal="delete", written_by=elsewhere)
        if readable:
            contents(findings, revision, buffer, elsewhere)
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
    conn = connect(shard.path, layout.owner, immutable=True)
    try:
        result = conn.execute("PRAGMA integrity_check").fetchall()
    except sqlite3.DatabaseError as exc:
        result = [(str(exc),)]
    finally:
        conn.close()
    return "" if result == [("ok",)] else "; ".join(r[0] for r in result[:3])
