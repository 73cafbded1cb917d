"""Where a directory buffer lives: its mount, and whether that filesystem's locks and caches span hosts.

A directory buffer's shards need nothing from the filesystem but appends
and renames (walbuf.directory.appender). Its hub is another matter: a
SQLite file written in place by whichever host syncs, safe only if one host
writes it at a time (a lock every host sees) and each host reads what the
last one wrote (caches that follow the locks). Where a filesystem cannot be
trusted with that, one host syncs the buffer (walbuf.directory.sync_host).

Read from /proc/self/mountinfo, the mount a path is on (matched by device):

- local filesystems (ext4, xfs, btrfs, tmpfs, ...): one host; trusted.
- NFS: trusted unless mounted ``nolock`` or ``local_lock=`` other than
  ``none``, which keep locks on each client.
- Lustre: trusted when mounted ``-o flock``; ``localflock`` keeps flock
  locks per client, and with neither a client refuses them.
- GPFS (Spectrum Scale) and the kernel's CephFS: trusted (their locks and
  caches are cluster-wide).
- anything else (FUSE filesystems such as sshfs, CIFS, BeeGFS, WekaFS,
  9p, ...): walbuf cannot tell, so it does not trust them.

``WALBUF_LOCKS_SPAN_HOSTS=yes`` or ``no`` overrides the verdict: ``yes`` is
a promise that the filesystem's locks span hosts and its caches follow them
(a wrong promise can lose records, see docs/directory-buffers.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError

ENV_LOCKS_SPAN = "WALBUF_LOCKS_SPAN_HOSTS"

_LOCAL = frozenset(
    {
        "ext2",
        "ext3",
        "ext4",
        "xfs",
        "btrfs",
        "tmpfs",
        "ramfs",
        "zfs",
        "f2fs",
        "overlay",
        "reiserfs",
        "jfs",
        "bcachefs",
        "vfat",
        "exfat",
        "ntfs3",
        "hfsplus",
    }
)
_CLUSTER = frozenset({"gpfs", "ceph"})


@dataclass(frozen=True)
class Mount:
    """A mount, as /proc/self/mountinfo gives it."""

    point: str
    fstype: str  # "nfs4", "lustre", "fuse.sshfs", ...
    source: str
    options: tuple[str, ...]  # the mount's options, then its filesystem's

    def option(self, name: str) -> str | None:
        """The value of option ``name`` ("" for a flag), or None if it is not set."""
        for option in self.options:
            key, _, value = option.partition("=")
            if key == name:
                return value
        return None

    def shown(self) -> str:
        return f"{self.point} ({self.fstype} from {self.source})"


@dataclass(frozen=True)
class Coordination:
    """Whether hosts can take turns writing one file in place there: locks that span hosts, caches that follow them."""

    spans: bool
    why: str  # for messages: what was found, and what it means


def mount_of(path: Path) -> Mount | None:
    """The mount ``path`` (which must exist) is on; None where /proc/self/mountinfo is not there."""
    device = os.stat(path).st_dev
    wanted = f"{os.major(device)}:{os.minor(device)}"
    try:
        with open("/proc/self/mountinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    found = None
    for line in lines:
        fields, _, rest = line.partition(" - ")
        parts, tail = fields.split(" "), rest.split(" ")
        if len(parts) < 6 or len(tail) < 3 or parts[2] != wanted:
            continue
        # The last mount of a device on a path's way is the one in effect; mount points escape spaces.
        found = Mount(_unescape(parts[4]), tail[0], _unescape(tail[1]), (*parts[5].split(","), *tail[2].split(",")))
    return found


def coordination(path: Path) -> Coordination:
    """Whether the filesystem ``path`` is on lets hosts take turns writing a file in place (see the module docstring).

    Raises ConfigError for a WALBUF_LOCKS_SPAN_HOSTS other than yes or no.
    """
    given = os.environ.get(ENV_LOCKS_SPAN, "").strip().lower()
    if given:
        if given not in ("yes", "no"):
            raise ConfigError(f"{ENV_LOCKS_SPAN} must be yes or no (or unset, for walbuf to look), not {given!r}")
        said = "do" if given == "yes" else "do not"
        return Coordination(given == "yes", f"{ENV_LOCKS_SPAN}={given} says its locks {said} span hosts")
    mount = mount_of(path)
    if mount is None:
        return Coordination(False, "walbuf cannot tell which filesystem it is on (no /proc/self/mountinfo)")
    return _verdict(mount)


def _verdict(mount: Mount) -> Coordination:
    kind, where = mount.fstype, mount.shown()
    if kind in _LOCAL:
        return Coordination(True, f"{where} is a filesystem of one host")
    if kind in ("nfs", "nfs4"):
        local = mount.option("local_lock")
        if mount.option("nolock") is not None:
            return Coordination(False, f"{where} is mounted with nolock: its locks stay on each host")
        if local not in (None, "none"):
            return Coordination(False, f"{where} is mounted with local_lock={local}: its locks stay on each host")
        return Coordination(True, f"{where}: NFS with locks that span hosts, and caches that follow them")
    if kind == "lustre":
        if mount.option("flock") is not None:
            return Coordination(True, f"{where}: Lustre mounted with flock, whose locks span hosts")
        how = (
            "with localflock, whose locks stay on each host"
            if mount.option("localflock") is not None
            else ("without flock, so it refuses flock locks")
        )
        return Coordination(False, f"{where} is Lustre mounted {how}")
    if kind in _CLUSTER:
        return Coordination(True, f"{where}: {kind}, whose locks and caches span hosts")
    return Coordination(
        False,
        f"{where} is {kind}, of which walbuf cannot tell whether its locks span hosts and its caches follow them"
        f" (set {ENV_LOCKS_SPAN}=yes if you know they do)",
    )


def _unescape(text: str) -> str:
    """A mountinfo field: spaces, tabs, newlines and backslashes come as octal escapes (\\040)."""
    out, i = [], 0
    while i < len(text):
        if text[i] == "\\" and text[i + 1 : i + 4].isdigit():
            out.append(chr(int(text[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(text[i])
            i += 1
    return "".join(out)
