"""The sync host: where a filesystem's locks or caches do not span hosts, one host syncs a directory buffer.

A sync writes the hub (a SQLite file) in place. On a filesystem whose
locks stay on each host (walbuf.directory.mounts), a second host's sync
would not see the first one's lock, nor, where caches do not follow the
locks, what it wrote: two syncs at once, or one after another from two
hosts, could damage the hub. So there the first sync names its host in
``BUFFER/sync-host``, and syncs of any other host are refused
(SyncHostError, nothing changed) until that host gives the buffer up:

- ``walbuf sync --take-over`` on the new host, once the old one syncs it
  no more (a person says so: no host can tell it of another);
- without it, where the sync host's machine has booted again since (the
  same machine id, another boot id): none of its old processes runs.

A host here is one client of the filesystem: a machine (machine id and
host name: stateless cluster images clone /etc/machine-id), its boot, its
PID namespace, and the device its mount of the buffer has. Where
the filesystem's locks span hosts, any host syncs and the sync lock alone
keeps them to one at a time; the file is not used there.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, replace

from ..errors import SyncHostError
from ..store import machine
from ..store.trust import Owner, fsync
from .layout import Layout, host_name
from .mounts import coordination

_log = logging.getLogger(__name__)

SYNC_HOST = "sync-host"
_LIMIT = 4096


@dataclass(frozen=True)
class SyncHost:
    """A host as a client of the filesystem (see the module docstring)."""

    host: str  # its WALBUF_HOST name, for messages
    machine: str
    boot: str
    pidns: str
    device: int  # st_dev of the buffer's folder as this host mounts it
    node: str = ""  # the machine's host name (uname); "" where an older walbuf named the host

    @classmethod
    def here(cls, layout: Layout) -> SyncHost:
        return cls(
            host_name(),
            machine.machine_id(),
            machine.boot_id(),
            machine.pid_namespace(),
            os.stat(layout.root).st_dev,
            machine.node(),
        )

    def names(self, here: SyncHost) -> bool:
        """Whether this named host is ``here`` (an older walbuf's note, without a host name, by the rest)."""
        return self == here or (not self.node and self == replace(here, node=""))

    def rebooted_as(self, other: SyncHost) -> bool:
        """Whether ``other`` is this host's machine (machine id and host name) since a boot: none of this host's
        processes runs any more. An older walbuf's note names no host name: its WALBUF_HOST name stands for it."""
        named = (self.machine, self.node or self.host)
        return named == (other.machine, other.node if self.node else other.host) and self.boot != other.boot


def sync_host(layout: Layout) -> SyncHost | None:
    """The host that syncs the buffer, where one is named; reads only."""
    data = layout.owner.read(layout.root / SYNC_HOST, _LIMIT)
    if data is None:
        return None
    try:
        value = json.loads(data)
        return SyncHost(**value)
    except (ValueError, TypeError):
        return None  # not one walbuf wrote: the next sync replaces it


def claim(layout: Layout, *, take_over: bool = False) -> None:
    """Before a sync writes the hub: make sure this host may, where only one host syncs the buffer (module docstring).

    Becomes the sync host if none is named (or ``take_over``, or the named
    one's machine booted since). Raises SyncHostError, having changed
    nothing, where another host is named. The caller holds the sync lock.
    """
    verdict = coordination(layout.root)
    if verdict.spans:
        return
    here = SyncHost.here(layout)
    owner = layout.own()
    path = layout.root / SYNC_HOST
    named = sync_host(layout)
    if named is not None and named.names(here):
        if named != here:
            _write(layout, owner, here)  # an older walbuf's note: now with the host name
        return
    if named is None and owner.entry(path) is None:
        try:
            fd = owner.open(path, os.O_WRONLY | os.O_EXCL, create=True)
        except FileExistsError:
            named = sync_host(layout)  # another host named itself meanwhile
        else:
            try:
                os.write(fd, json.dumps(asdict(here)).encode())
                os.fsync(fd)
            finally:
                os.close(fd)
            fsync(layout.root, folder=True)
            _log.info("this host (%s) syncs %s from now on: %s", here.host, layout.root, verdict.why)
            return
    if named is None or take_over or named.rebooted_as(here):
        _write(layout, owner, here)
        _log.info("this host (%s) takes over syncing %s from %s", here.host, layout.root, named.host if named else "-")
        return
    raise SyncHostError(
        f"{layout.root} is synced from host {named.host} only: {verdict.why}, so two hosts syncing it could damage"
        f" its hub. Run walbuf sync on {named.host}; or, if {named.host} syncs it no more, run"
        " `walbuf sync --take-over` here once (see docs/directory-buffers.md); nothing was changed"
    )


def _write(layout: Layout, owner: Owner, here: SyncHost) -> None:
    """Name ``here`` the sync host, in place of what is named (written whole elsewhere, then renamed over it)."""
    temporary = layout.root / f"{SYNC_HOST}.new"
    fd = owner.open(temporary, os.O_WRONLY | os.O_TRUNC, create=True)
    try:
        os.write(fd, json.dumps(asdict(here)).encode())
        os.fsync(fd)  # whole before it is renamed in: a crash never leaves a sync-host file that names no host
    finally:
        os.close(fd)
    os.replace(temporary, layout.root / SYNC_HOST)
    fsync(layout.root, folder=True)


def written_elsewhere(layout: Layout) -> str | None:
    """Where the hub may change under a reader here, unseen: the sync host's name, if it is another host and the
    filesystem's locks do not span hosts; else None."""
    named = sync_host(layout)
    if named is None or named.names(SyncHost.here(layout)) or coordination(layout.root).spans:
        return None
    return named.host
