"""Kernel file locks (flock) on a buffer's lock files: owner-only, never through a link, never another account's.

A lock file is made owner-only (0600) in a folder of the buffer's owner, so
no other account can open it, let alone hold it. It is opened with
O_NOFOLLOW and checked on its descriptor before it is locked (see
walbuf.store.trust): a link planted in its place, or a file of another
account, raises UntrustedPathError naming it and its owner.

The kernel releases a flock when its process dies, kill -9 included, so
these locks never go stale. A wait for one polls, up to a bound the caller
gives.

A held lock can leave a short note in its file (:meth:`FileLock.note`), for
whoever finds the lock free later: a writer notes there that it closed. The
note has a fixed width and is written over the same bytes each time, so once
the file holds one, noting again needs no new space on the disk (a full
disk refuses a database's close note, never this one).
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

from .trust import Owner

_POLL_FIRST = 0.001  # seconds between attempts while a lock stays taken, doubling...
_POLL_MAX = 0.05  # ... up to this
NOTE_WIDTH = 40  # bytes of a lock file's note (see FileLock.note)
_OLD_NOTE_WIDTH = 16  # what walbuf before the step in a writer's note wrote


class FileLock:
    """An exclusive flock on the lock file ``path`` (made owner-only if missing), held until released or the process
    dies.

    Not reentrant: a second FileLock of the same path in one process waits
    for the first, as another process would.
    """

    def __init__(self, path: Path, owner: Owner) -> None:
        self.path = path
        self.owner = owner
        self._fd = -1

    def acquire(self, timeout: float) -> bool:
        """Take the lock, waiting up to ``timeout`` seconds; False if it stayed taken.

        Raises UntrustedPathError for a lock file that is a link or another
        account's, and the OSError of opening it (no permission, say).
        """
        if self._fd >= 0:
            raise RuntimeError(f"{self.path} is held by this FileLock already")
        fd = self.owner.open(self.path, os.O_RDWR, create=True, private=True)
        deadline = time.monotonic() + timeout
        pause = _POLL_FIRST
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        os.close(fd)
                        return False
                    time.sleep(min(pause, left))
                    pause = min(pause * 2, _POLL_MAX)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return True

    def note(self, text: str) -> None:
        """Write ``text`` (ASCII, under NOTE_WIDTH bytes) as the lock file's note, over the previous one. Raises
        OSError."""
        if self._fd < 0:
            raise RuntimeError(f"{self.path} is not held: only its holder notes in it")
        data = text.encode("ascii").ljust(NOTE_WIDTH - 1) + b"\n"
        if len(data) != NOTE_WIDTH:
            raise ValueError(f"a lock note is under {NOTE_WIDTH} bytes: {text!r}")
        os.pwrite(self._fd, data, 0)

    def current_note(self) -> str | None:
        """The note in the held lock file now (a previous holder's, until :meth:`note` replaces it); None if none."""
        if self._fd < 0:
            raise RuntimeError(f"{self.path} is not held")
        return _note(os.pread(self._fd, NOTE_WIDTH, 0))

    def release(self) -> None:
        """Let go (closing the descriptor drops the flock); nothing if not held."""
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)


def held(path: Path, owner: Owner) -> bool:
    """Whether a process holds a flock on the lock file ``path`` (False if there is none).

    A probe on a descriptor opened for reading: it needs no write access and
    creates nothing (it holds the lock for an instant if it is free). Raises
    UntrustedPathError for a link or another account's file, PermissionError
    where this process may not open it.
    """
    try:
        fd = owner.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # and with it the probe's lock
    return False


def read_note(path: Path, owner: Owner) -> str | None:
    """The note a holder last left in the lock file ``path`` (see FileLock.note); None if there is none.

    Reads only. Raises UntrustedPathError for a link or another account's
    file, and the OSError of reading it.
    """
    try:
        fd = owner.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        # Another host's writes to it may be cached here: read it as it is now.
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        data = os.pread(fd, NOTE_WIDTH, 0)
    finally:
        os.close(fd)
    return _note(data)


def _note(data: bytes) -> str | None:
    if len(data) not in (NOTE_WIDTH, _OLD_NOTE_WIDTH) or not data.endswith(b"\n"):
        return None  # no note, or one cut off
    return data.decode("ascii", errors="replace").strip()
