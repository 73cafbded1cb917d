"""Room on the disk: telling a full filesystem from damage, and keeping room aside for a sync's confirmation.

A full disk is no damage: every record written is intact, and what was
being written was not. SQLite, though, reports some of its failures for
lack of room as a bare "disk I/O error" (SQLITE_IOERR_SHMSIZE, when a
reader cannot make a WAL database's -shm; a short write): :func:`full`
asks the filesystem itself.

The costliest moment for a full disk is after an upload W&B took: if the
confirmation cannot be written, the next sync sends every record of it
again, and W&B holds them twice. So a sync keeps a :class:`Reserve`, a file
of RESERVE bytes beside the buffer's lock files, allocated before it
uploads anything; a confirmation that finds the disk full gives it up and
writes into the room it frees.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from .trust import Owner

# Less room than this (for this process) is a full disk: a SQLite reader's
# -shm alone takes 32 KiB, and a confirmation a few pages of WAL each time.
LOW_ROOM = 1 << 20
RESERVE = 1 << 20  # bytes kept aside: what confirming an upload needs, many times over
RESERVE_NAME = "room"  # the reserve's name, in the buffer's folder of lock files


def room(folder: Path) -> int:
    """Bytes this process may still write on the filesystem that holds ``folder`` (0 if it has no inode left)."""
    st = os.statvfs(folder)
    if st.f_files and not (st.f_ffree if os.geteuid() == 0 else st.f_favail):
        return 0
    # root may write into the blocks a filesystem keeps back for it
    return (st.f_bfree if os.geteuid() == 0 else st.f_bavail) * st.f_frsize


def full(folder: Path) -> bool:
    """Whether the filesystem that holds ``folder`` is full for this process (less than LOW_ROOM left)."""
    try:
        return room(folder) < LOW_ROOM
    except OSError:
        return False  # cannot tell: the caller reports the error it had


def is_full(exc: OSError) -> bool:
    """Whether an OSError is the disk's, or the account's quota's, being full."""
    return exc.errno in (errno.ENOSPC, errno.EDQUOT)


class Reserve:
    """A file of RESERVE bytes whose room a sync's confirmation may take (see the module docstring).

    Kept, once made: each sync makes sure it is whole before it uploads,
    and a confirmation that met a full disk removes it. Owner-only, opened
    like every file in a buffer (walbuf.store.trust).
    """

    def __init__(self, path: Path, owner: Owner) -> None:
        self.path = path
        self.owner = owner

    def keep(self) -> None:
        """Make sure the file holds RESERVE allocated bytes. Raises OSError (ENOSPC: no room for it)."""
        fd = self.owner.open(self.path, os.O_RDWR, create=True, private=True)
        try:
            if os.fstat(fd).st_blocks * 512 < RESERVE:
                os.posix_fallocate(fd, 0, RESERVE)
        except OSError:
            os.ftruncate(fd, 0)  # no half reserve: it would look whole by its size
            raise
        finally:
            os.close(fd)

    def give_up(self) -> bool:
        """Remove the file, freeing its room; whether it held any."""
        st = self.owner.entry(self.path)
        if st is None:
            return False
        os.unlink(self.path)
        return st.st_blocks > 0
