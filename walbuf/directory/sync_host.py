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

The file never exists without its whole content, so that no sync reads
it as naming no host while another host's sync is naming itself there. A
sync writes its host into a temporary of its own,
``sync-host.HASH.RANDOM.new`` (HASH names its host), then links it as
``sync-host``: the link fails where another host's sync linked its own
first, which then names the sync host. A take-over renames its temporary
over the file. Where the filesystem has no hard links, the file is made
(O_EXCL), then written, as an older walbuf does: a sync that finds it
empty, or holding what walbuf does not write, is refused (SyncHostError),
never takes it over, as the host naming itself may go on to sync; once
none does, ``--take-over`` replaces it.

A sync killed while naming its host may leave its temporary. Nothing reads
one, and its name is one walbuf gives there (not listed as "not opened").
The next claim of its host (in the same boot: a
boot is part of a host) removes it (the sync lock keeps one host's
claims one at a time, so none of that host's is under way), and any claim
removes one that is a second name of ``sync-host`` (linked in, then the
sync was killed): removing a name changes nothing the file says. One of
another host that never syncs the buffer again stays, harmless; remove it
by hand if it is in the way.

A host here is one client of the filesystem: a machine (machine id and
host name: stateless cluster images clone /etc/machine-id), its boot, its
PID namespace, and the device its mount of the buffer has. Where
the filesystem's locks span hosts, any host syncs and the sync lock alone
keeps them to one at a time; the file is not used there.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import secrets
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from ..errors import SyncHostError
from ..store import machine
from ..store.trust import Owner, fsync
from .layout import SYNC_HOST_TEMPORARY, Layout, host_name
from .mounts import coordination

_log = logging.getLogger(__name__)

SYNC_HOST = "sync-host"
_LIMIT = 4096
# What os.link fails with where a filesystem has no hard links (FUSE's ENOSYS where a filesystem lacks the call).
_NO_HARD_LINKS = frozenset({errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS})


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


@dataclass(frozen=True)
class Unnamed:
    """A sync-host file that names no host (see the module docstring): a sync is refused while it is there."""

    why: str


def named(layout: Layout) -> SyncHost | Unnamed | None:
    """What ``BUFFER/sync-host`` names: a host, no host (Unnamed), or None where there is no such file. Reads only."""
    data = _read(layout)
    if data is None:
        return None
    if not data:
        return Unnamed("it is empty")
    try:
        return SyncHost(**json.loads(data))
    except (ValueError, TypeError):
        return Unnamed("it holds what walbuf does not write there")


def sync_host(layout: Layout) -> SyncHost | None:
    """The host that syncs the buffer, where one is named; reads only."""
    found = named(layout)
    return found if isinstance(found, SyncHost) else None


def claim(layout: Layout, *, take_over: bool = False) -> None:
    """Before a sync writes the hub: make sure this host may, where only one host syncs the buffer (module docstring).

    Becomes the sync host if none is named (or ``take_over``, or the named
    one's machine booted since). Raises SyncHostError, having changed
    nothing but removed what killed claims left (see the module docstring),
    where another host is named, or a file there names none. The caller
    holds the sync lock: this host's claims run one at a time.
    """
    verdict = coordination(layout.root)
    if verdict.spans:
        return
    here = SyncHost.here(layout)
    owner = layout.own()
    _tidy(layout, here)
    found = named(layout)
    if found is None:
        found = _name(layout, owner, here)
        if found is None:
            _log.info("this host (%s) syncs %s from now on: %s", here.host, layout.root, verdict.why)
            return
    if isinstance(found, SyncHost) and found.names(here):
        if found != here:
            _replace(layout, owner, here)  # an older walbuf's note: now with the host name
        return
    if take_over or (isinstance(found, SyncHost) and found.rebooted_as(here)):
        _replace(layout, owner, here)
        was = found.host if isinstance(found, SyncHost) else f"a {SYNC_HOST} that named no host"
        _log.info("this host (%s) takes over syncing %s from %s", here.host, layout.root, was)
        return
    if isinstance(found, Unnamed):
        raise SyncHostError(
            f"{layout.root} is synced from one host only: {verdict.why}, so two hosts syncing it could damage its"
            f" hub; but its {SYNC_HOST} names no host ({found.why}). Another host's sync may be naming itself there"
            " now (an older walbuf's, or one where the filesystem has no hard links, makes the file, then writes"
            " it), or died doing so: run walbuf sync again; if the file still names no host, run"
            " `walbuf sync --take-over` here once no other host syncs the buffer (see docs/directory-buffers.md);"
            " nothing was changed"
        )
    raise SyncHostError(
        f"{layout.root} is synced from host {found.host} only: {verdict.why}, so two hosts syncing it could damage"
        f" its hub. Run walbuf sync on {found.host}; or, if {found.host} syncs it no more, run"
        " `walbuf sync --take-over` here once (see docs/directory-buffers.md); nothing was changed"
    )


def _name(layout: Layout, owner: Owner, here: SyncHost) -> SyncHost | Unnamed | None:
    """Name ``here`` the sync host where no file names one: None once it is, else what another host's sync named
    meanwhile."""
    path = layout.root / SYNC_HOST
    temporary = _written(layout, owner, here)
    try:
        # A link is made whole or not at all, and never over a file another host's sync linked in meanwhile.
        os.link(temporary, path, follow_symlinks=False)
    except FileExistsError:
        return named(layout) or Unnamed("it was removed as this sync named its host")
    except OSError as exc:
        if exc.errno not in _NO_HARD_LINKS:
            raise
        if not _made(owner, path, here):
            return named(layout) or Unnamed("it was removed as this sync named its host")
    finally:
        _remove(temporary)
    fsync(layout.root, folder=True)
    return None


def _made(owner: Owner, path: Path, here: SyncHost) -> bool:
    """Where the filesystem has no hard links: make ``path`` naming ``here``; False if another sync made it first.

    It is empty from its making until its writing: a sync of another host
    that reads it so is refused (claim), never takes it over.
    """
    try:
        fd = owner.open(path, os.O_WRONLY | os.O_EXCL, create=True)
    except FileExistsError:
        return False
    try:
        os.write(fd, _note(here))
        os.fsync(fd)
    finally:
        os.close(fd)
    return True


def _replace(layout: Layout, owner: Owner, here: SyncHost) -> None:
    """Name ``here`` the sync host, in place of what is named (written whole elsewhere, then renamed over it)."""
    temporary = _written(layout, owner, here)
    try:
        os.replace(temporary, layout.root / SYNC_HOST)
    except BaseException:
        _remove(temporary)
        raise
    fsync(layout.root, folder=True)


def _written(layout: Layout, owner: Owner, here: SyncHost) -> Path:
    """A new temporary of sync-host naming ``here``, whole on disk: of a name no other sync gives (two hosts may
    take over at once), which tells this host's from another's (see :func:`_tidy`)."""
    temporary = layout.root / f"{SYNC_HOST}.{_hash(here)}.{secrets.token_hex(8)}.new"
    fd = owner.open(temporary, os.O_WRONLY | os.O_EXCL, create=True)
    try:
        os.write(fd, _note(here))
        os.fsync(fd)  # whole before it is named sync-host: a crash never leaves a sync-host file that names no host
    except BaseException:
        os.close(fd)
        _remove(temporary)
        raise
    os.close(fd)
    return temporary


def _tidy(layout: Layout, here: SyncHost) -> None:
    """Remove the temporaries that syncs killed while naming their host left: this host's (its claims run one at a
    time: none is under way) and any that is a second name of sync-host (linked in, not removed yet: removing it
    removes a name, never what the file says)."""
    try:
        target: os.stat_result | None = os.lstat(layout.root / SYNC_HOST)
    except FileNotFoundError:
        target = None
    mine = _hash(here)
    for path, found, st in _temporaries(layout):
        if found == mine or (target is not None and (st.st_dev, st.st_ino) == (target.st_dev, target.st_ino)):
            _remove(path)


def _read(layout: Layout) -> bytes | None:
    """What sync-host holds (None if there is none).

    One other name of it is let be, unlike anywhere else in a buffer
    (walbuf.store.trust): walbuf never writes the file in place (it links
    it in, or renames another over it), so that name cannot carry a write
    elsewhere. It has one from the moment a sync links its temporary in
    until it removes that name, and may seem to have it a while longer
    through a mount whose attributes are cached (FUSE).
    """
    return layout.owner.read(layout.root / SYNC_HOST, _LIMIT, names=2)


def _temporaries(layout: Layout) -> list[tuple[Path, str, os.stat_result]]:
    """The temporaries of sync-host in the buffer: each one's path, its host's hash and its lstat."""
    found = []
    for name in os.listdir(layout.root):
        match = SYNC_HOST_TEMPORARY.fullmatch(name)
        if match is None:
            continue
        try:
            found.append((layout.root / name, match[1], os.lstat(layout.root / name)))
        except FileNotFoundError:
            pass  # its sync removed it since the listing
    return found


def _remove(temporary: Path) -> None:
    try:
        os.unlink(temporary)  # a name of the buffer's own: unlink removes the name, never a link's target
    except FileNotFoundError:
        pass  # another host's claim removed it, a second name of sync-host (see _tidy)


def _note(here: SyncHost) -> bytes:
    return json.dumps(asdict(here)).encode()


def _hash(here: SyncHost) -> str:
    """What names this host in its temporaries' names: a hash of all that makes it this host."""
    return hashlib.sha256(json.dumps(asdict(here), sort_keys=True).encode()).hexdigest()[:16]


def written_elsewhere(layout: Layout) -> str | None:
    """Where the hub may change under a reader here, unseen: the sync host's name, if it is another host and the
    filesystem's locks do not span hosts; else None."""
    named = sync_host(layout)
    if named is None or named.names(SyncHost.here(layout)) or coordination(layout.root).spans:
        return None
    return named.host


def every_sync_seen_here(layout: Layout) -> bool:
    """Whether every sync's hold on the hub is seen from this host: the filesystem's locks span hosts, or this host
    is the one named to sync the buffer (where none is named yet, another host may be naming itself now)."""
    if coordination(layout.root).spans:
        return True
    named = sync_host(layout)
    return named is not None and named.names(SyncHost.here(layout))
