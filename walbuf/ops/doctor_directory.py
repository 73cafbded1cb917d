"""doctor's examination of a directory buffer: what walbuf does not open there, its filesystem, the hub, each shard."""

from __future__ import annotations

import time

from ..directory import DirectoryBuffer
from ..directory.host import silent_after
from ..directory.layout import Layout, Older, Shard, host_name
from ..directory.mounts import coordination
from ..directory.shard import BadFrame
from ..directory.sync_host import Unnamed, named, written_elsewhere
from ..directory.upgrade import describe, problem, remaining_message
from ..directory.view import Gap, HubView, examine, hub_view
from ..errors import StorageError, UntrustedPathError
from .findings import UNTRUSTED_ADVICE, Finding, contents, file_findings, room_finding


def examine_directory(findings: list[Finding], buffer: DirectoryBuffer) -> None:
    """What walbuf does not open there, the hub as a one-file buffer (rollback journal), each shard not yet ingested,
    and an older walbuf's shards."""
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
    now = time.time()
    try:
        hub = buffer.open_store("read")
        view = hub_view(hub)
    except StorageError:
        # Reported above (an older schema, damage, a write under way elsewhere): the shards are read as if the hub
        # held nothing of them.
        hub, view = None, hub_view(None)
    try:
        scan = layout.scan()
        for shard in scan.shards:
            finding = _shard_finding(layout, shard, view, now)
            if finding is not None:
                add(finding)
        host = host_name()
        for older in scan.older:
            add(_older_finding(layout, older, host))
    finally:
        if hub is not None:
            hub.close()


def _filesystem_findings(findings: list[Finding], layout: Layout) -> None:
    """The filesystem the buffer is on, whether hosts may take turns syncing it, and which host syncs it."""
    verdict = coordination(layout.root)
    if verdict.spans:
        findings.append(Finding("filesystem", True, f"{verdict.why}: any host may sync it"))
        return
    found = named(layout)
    if isinstance(found, Unnamed):
        findings.append(
            Finding(
                "filesystem",
                False,
                f"{verdict.why}: one host syncs it; but its sync-host names no host ({found.why}), and every sync"
                " is refused while it does",
                "another host's sync may be naming itself there now: run doctor again; if it still names no host,"
                " run `walbuf sync --take-over` on the host that is to sync it, once no other host does",
            )
        )
        return
    who = f"host {found.host} syncs it" if found else "the first host that syncs it will be its only syncer"
    findings.append(Finding("filesystem", True, f"{verdict.why}: one host syncs it; {who}"))


def _shard_finding(layout: Layout, shard: Shard, view: HubView, now: float) -> Finding | None:
    """What reading a shard whole finds: whether walbuf wrote all of it, what the hub lacks of it, its process (None
    for an ingested shard taken in whole: the hub holds its records)."""
    name = f"shard {shard.id}"
    cursor = view.cursor(shard.id)
    if cursor.refused is not None:
        return Finding(
            name,
            False,
            f"{shard.state}, not read past where the last sync stopped: {cursor.refused}",
            "the frames before it are taken in, none after it: keep a copy of the file for a person to look at;"
            " if it is not yours, see docs/security.md",
        )
    try:
        seen = examine(layout, shard, view)
    except BadFrame as exc:
        return Finding(name, False, f"{shard.state}: {exc}", "keep a copy of the file for a person to look at")
    except StorageError as exc:
        return Finding(name, False, str(exc), "see the message")
    gaps = cursor.gaps or seen.unread
    if shard.state == "ingested":
        if gaps:
            return Finding(
                name,
                True,
                f"ingested with bytes {_ranges(gaps)} given up: they could not be read, and a person moved it here",
            )
        return None
    waiting = f"{seen.waiting} records not in the hub"
    if gaps and shard.state == "sealed":
        return Finding(
            name,
            False,
            f"sealed, damaged: bytes {_ranges(gaps)} cannot be read, and whole frames follow them; every frame"
            f" that can be read is taken in ({waiting} yet), and each sync reads them again",
            "keep a copy of the file. If a copy from before the damage exists (a backup), put it in place of this"
            " one and run walbuf sync: it takes in what the hub lacks, nothing twice. If not, the records there"
            f" are lost (`walbuf sync` names the steps around them); to stop the warning, move the file to"
            f" {layout.ingested}/ (this deletes nothing: every readable record is in the hub)",
        )
    if gaps:
        waiting += f"; bytes {_ranges(gaps)} cannot be read yet (read again at each sync: its process may still write)"
    if shard.state == "sealed":
        return Finding(name, True, f"sealed, {waiting} yet")
    process = seen.process
    if process is None:
        if now - seen.last_heard < silent_after():
            return Finding(name, True, f"live on {shard.host}, just made")
        if seen.frames == 0 and not gaps:
            # Its process was killed (or interrupted twice) between making it
            # and writing its first frame. No sync removes it: a process
            # stopped (SIGSTOP) in between would go on writing records into it.
            return Finding(
                name,
                True,
                f"live on {shard.host}, holds no record: its process ended while it made it, before its first"
                f" frame was written whole, {now - seen.last_heard:.0f}s ago; it may be removed once no process of"
                f" {shard.host} from then may still run",
            )
        return Finding(
            name,
            False,
            f"live on {shard.host}, but its first frame, naming its process, cannot be read, and nothing was appended"
            f" to it for {now - seen.last_heard:.0f}s; {waiting}",
            "no sync can tell whether its process runs, so none seals it: once none appends to it (see its mtime),"
            f" move it to {layout.sealed}/ under the name {shard.id}.log; every readable frame of it is taken in"
            " then, and the sync names what cannot be read",
        )
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
            f" if {process.host} never runs walbuf again, move it to {layout.ingested}/",
        )
    return Finding(name, True, f"live, appended by {who}, {waiting}")


def _older_finding(layout: Layout, older: Older, host: str) -> Finding:
    """An older walbuf's SQLite shard: taken in at the next sync, waiting for a step of a person's, or given up."""
    name = f"shard {older.id}"
    if older.state == "ingested":
        return Finding(name, True, "an older walbuf's, taken in: walbuf prune removes it")
    if older.state == "sealed":
        why = problem(layout, older)
        if why is None:
            return Finding(name, True, "an older walbuf's, sealed: the next walbuf sync takes it in")
        return Finding(
            name,
            False,
            why,
            f"if it is damaged, recover what it holds with `sqlite3 {older.path} .recover | sqlite3 NEW.db`, or"
            " mend what the message says in a copy, NEW.db; make sure it is yours. Then put NEW.db in its place"
            " (the next sync takes its records in); or move it out of the buffer to give its records up",
        )
    if older.state == "live":
        return Finding(name, False, "an older walbuf's, live", remaining_message(older, host))
    return Finding(
        name,
        False,
        f"set aside by an older walbuf in quarantine/ ({describe(layout.owner, older)}): its records are not sent",
        f"if it is damaged, recover what it holds with `sqlite3 {older.path} .recover | sqlite3 NEW.db`;"
        " if it was refused, make sure it is yours and mend what the reason says in a copy, NEW.db."
        f" Then move NEW.db to {layout.sealed / older.path.name} (the next sync takes its records in) and delete"
        f" {older.path} and its .why; or delete both to give its records up",
    )


def _ranges(gaps: tuple[Gap, ...]) -> str:
    return ", ".join(f"{g.start}-{g.until}" for g in gaps)
