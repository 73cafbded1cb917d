"""What walbuf trusts in a buffer: its owner's own files and folders, never a symbolic link.

Buffers live on shared storage (a group project directory, world-writable
scratch), where other accounts may create files. The rules
(docs/security.md says why):

- A buffer belongs to the account that owns its root: a directory buffer's
  directory, a SQLite buffer's file. A new one belongs to the account that
  makes it.
- walbuf writes, syncs and prunes only a buffer of its own account
  (:meth:`Owner.of` with ``write``); any account that may read a buffer may
  read it.
- Inside a buffer walbuf acts only on files and folders of its owner. One of
  another account, a symbolic link, a file with more than one name (a hard
  link), or a file or folder that others may write raises
  UntrustedPathError, naming it, its owner and what to do; it is never
  opened, followed or written. (One file walbuf never writes in place may
  have a second name it knows of: walbuf.directory.sync_host.)
- What walbuf makes is owner-only (folders 0700, files 0600) whatever the
  umask, plus the read bits the owner gave the root: ``chmod g+rX`` on a
  buffer grants a group read access on purpose, to what is there and to
  what walbuf makes later. Lock files stay owner-only, so that no other
  account can hold one.
- Every file inside a buffer is opened with O_NOFOLLOW, and checked on the
  descriptor it opened (:meth:`Owner.open`).
"""

from __future__ import annotations

import errno
import os
import pwd
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ..errors import BufferNotWritableError, UntrustedPathError

PRIVATE_FOLDER = 0o700
PRIVATE_FILE = 0o600
READ_BITS = 0o055  # of the root's mode: group and others' read and search, what walbuf passes on
OTHERS_WRITE = 0o022

Kind = Literal["file", "folder"]


def shown(path: Path | str) -> str:
    """A path for a message: as it is, or quoted if it holds what is not printable (a newline could forge a log
    line)."""
    text = str(path)
    return text if text.isprintable() else repr(text)


def account(uid: int) -> str:
    """An account's name for messages: "alice (uid 1001)", or "uid 1001" if it has none here."""
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


@dataclass(frozen=True)
class Owner:
    """The account a buffer belongs to, and the read bits its root grants to what walbuf makes in it."""

    uid: int
    shared: int = 0  # group and others' read bits of the root's mode (see READ_BITS)
    group: int = -1  # the root's group: what walbuf makes with shared read bits gets it too

    @classmethod
    def of(cls, root: Path, *, write: bool) -> Owner:
        """The owner of the buffer whose root (its directory, or its SQLite file) is ``root``.

        A root not made yet belongs to this process's account. Raises
        UntrustedPathError for a root that is a symbolic link or that others
        may write, and with ``write`` BufferNotWritableError for a buffer of
        another account. Changes nothing.
        """
        try:
            st = os.lstat(root)
        except FileNotFoundError:
            return cls(os.geteuid())
        owner = cls(st.st_uid, stat.S_IMODE(st.st_mode) & READ_BITS, st.st_gid)
        if write:
            owner.require_mine(root)
        owner.check(root, st, "folder" if stat.S_ISDIR(st.st_mode) else "file")
        return owner

    def require_mine(self, buffer: Path) -> None:
        """Raise BufferNotWritableError unless the owner is this process's account (before walbuf writes ``buffer``)."""
        me = os.geteuid()
        if self.uid != me:
            raise BufferNotWritableError(
                f"{buffer} belongs to {account(self.uid)}, and walbuf writes, syncs and prunes only buffers"
                f" of its own account ({account(me)}); use a buffer of your own, or run this as its owner"
                " (reading it with walbuf records, status or doctor works where its owner grants read access)"
            )

    @property
    def folder_mode(self) -> int:
        return PRIVATE_FOLDER | self.shared

    @property
    def file_mode(self) -> int:
        return PRIVATE_FILE | (self.shared & 0o044)

    def check(self, path: Path, st: os.stat_result, kind: Kind, *, names: int = 1) -> None:
        """Raise UntrustedPathError unless ``st`` (of lstat or fstat) is a ``kind`` of the owner that others may not
        write, and a file of at most ``names`` names (see :meth:`open`)."""
        if stat.S_ISLNK(st.st_mode):
            raise UntrustedPathError(_link(path))
        if st.st_uid != self.uid:
            raise UntrustedPathError(
                f"{shown(path)} belongs to {account(st.st_uid)}, not to {account(self.uid)}, who owns the buffer:"
                " walbuf never reads, writes or follows another account's file in a buffer; find out who put it"
                " there and why, then remove it (see docs/security.md)"
            )
        is_kind = stat.S_ISDIR(st.st_mode) if kind == "folder" else stat.S_ISREG(st.st_mode)
        if not is_kind:
            raise UntrustedPathError(f"{shown(path)} is not a {kind}, where walbuf keeps a {kind}: remove it")
        if kind == "file" and st.st_nlink > names:
            raise UntrustedPathError(
                f"{shown(path)} has {st.st_nlink} names (hard links): what walbuf wrote there would change a file"
                " elsewhere too, maybe one another account linked in; find its other names"
                f" (`find / -samefile {shown(path)}`) and remove the one that does not belong (see docs/security.md)"
            )
        if st.st_mode & OTHERS_WRITE:
            who = {0o020: "its group", 0o002: "every account"}.get(
                st.st_mode & OTHERS_WRITE, "its group and every account"
            )
            raise UntrustedPathError(
                f"{shown(path)} may be written by {who} (mode {stat.S_IMODE(st.st_mode):04o}), so another account"
                f" could change what walbuf reads from it; make the buffer private with `chmod -R go-w {shown(path)}`"
                " (see docs/security.md)"
            )

    def shelter(self, folder: Path, what: Path) -> None:
        """Raise UntrustedPathError unless only the owner (or root) may make names in ``folder``, where ``what`` is.

        SQLite opens a database's -wal, -shm and -journal by name, anew at
        each connection: in a folder another account may write (a group
        project folder, sticky scratch), it could put a file of its own
        there between two connections, which would be read or written as
        the buffer. Changes nothing.
        """
        st = os.stat(folder)
        if st.st_uid in (self.uid, 0) and not st.st_mode & OTHERS_WRITE:
            return
        if st.st_uid not in (self.uid, 0):
            who = f"{account(st.st_uid)}, who owns it,"
        else:
            who = {0o020: "its group", 0o002: "every account"}.get(st.st_mode & OTHERS_WRITE, "every account")
        raise UntrustedPathError(
            f"{shown(what)} is in {shown(folder)}, where {who} may make files: another account could put a -wal,"
            " -shm or -journal of its own beside it, which SQLite would read or write as the buffer; move it into"
            " a folder only you may write (`mkdir -m 700 ~/runs`), or use a directory buffer (a path ending in"
            " /), whose database walbuf keeps in a folder of its own (see docs/security.md)"
        )

    def folder(self, path: Path, *, make: bool = False, private: bool = False) -> bool:
        """Whether the folder ``path`` exists; UntrustedPathError unless it is trusted.

        ``make`` makes it first if missing: owner-only, with the shared read
        bits unless ``private`` (a folder of lock files: no other account may
        open one to hold it). A private folder that others may enter is made
        owner-only again, where this process is its owner.
        """
        if make:
            wanted = PRIVATE_FOLDER if private else self.folder_mode
            try:
                os.mkdir(path, wanted)
            except FileExistsError:
                pass
            else:
                os.chmod(path, wanted, follow_symlinks=False)  # the umask took the root's read bits away
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return False
        self.check(path, st, "folder")
        if st.st_uid == os.geteuid():
            if private and st.st_mode & 0o077:
                os.chmod(path, PRIVATE_FOLDER)  # access granted to the whole buffer (chmod -R) never reaches its locks
            elif not private:
                self._share(path, st)
        return True

    def entry(self, path: Path) -> os.stat_result | None:
        """The lstat of the file ``path`` (None if there is none); UntrustedPathError unless it is trusted."""
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return None
        self.check(path, st, "file")
        return st

    def open(self, path: Path, flags: int, *, create: bool = False, private: bool = False, names: int = 1) -> int:
        """A descriptor of the file ``path``, never through a symbolic link, checked on the descriptor.

        ``create`` makes it if missing (owner-only; ``private``: never with
        the shared read bits, as for a lock file); one made with O_EXCL gets
        exactly that mode, whatever the umask. ``names`` more than one lets
        a file have that many names (hard links), for a file walbuf never
        writes in place, whose other name it knows of (see :meth:`check`).
        Raises UntrustedPathError
        for a link or a file that is not trusted, FileNotFoundError for a
        missing one without ``create``, and the OSError of the open.
        """
        mode = PRIVATE_FILE if private else self.file_mode
        try:
            fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_CREAT if create else 0), mode)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise UntrustedPathError(_link(path)) from None
            raise
        try:
            st = os.fstat(fd)
            self.check(path, st, "file", names=names)
            if create and flags & os.O_EXCL and stat.S_IMODE(st.st_mode) != mode:
                os.fchmod(fd, mode)  # made here (O_EXCL): the umask took the root's read bits away
            if create and not private and st.st_uid == os.geteuid():
                self._share(fd, st)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _share(self, target: int | Path, st: os.stat_result) -> None:
        """Give a folder or file of the owner's the root's group, where the root grants read access (see the module
        docstring)."""
        if self.shared and self.group >= 0 and st.st_gid != self.group:
            try:
                os.chown(target, -1, self.group)
            except PermissionError:
                # The owner is not in the root's group (any more): it keeps its
                # own, and readers of that group lose nothing they had.
                pass

    def create(self, path: Path, data: bytes) -> None:
        """Write a new file ``path`` holding ``data`` (owner-only), replacing one of the owner's; never through a
        link."""
        if self.entry(path) is not None:
            os.unlink(path)  # the owner's own file: unlink removes the name, never a link's target
        fd = self.open(path, os.O_WRONLY | os.O_EXCL, create=True)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)

    def read(self, path: Path, limit: int, *, names: int = 1) -> bytes | None:
        """At most ``limit`` bytes of the file ``path`` (None if there is none), never through a link; ``names`` as for
        :meth:`open`."""
        try:
            fd = self.open(path, os.O_RDONLY, names=names)
        except FileNotFoundError:
            return None
        try:
            return os.read(fd, limit)
        finally:
            os.close(fd)


def fsync(path: Path | str, *, folder: bool = False) -> None:
    """Make ``path`` (a file, or with ``folder`` a folder's entries) durable, never through a symbolic link.

    Raises FileNotFoundError if it is not there.
    """
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_DIRECTORY if folder else 0)
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_folders(path: Path) -> None:
    """Make ``path`` and its missing parents, each owner-only (0700) whatever the umask; existing ones are left as they
    are."""
    missing = []
    while not os.path.lexists(path):
        missing.append(path)
        if path.parent == path:
            break
        path = path.parent
    for folder in reversed(missing):
        try:
            os.mkdir(folder, PRIVATE_FOLDER)
        except FileExistsError:
            pass


def _link(path: Path) -> str:
    try:
        target = f" (to {shown(os.readlink(path))})"
    except OSError:
        target = ""
    return (
        f"{shown(path)} is a symbolic link{target}: walbuf never follows a link inside a buffer, where another account"
        " may have made it; remove it (see docs/security.md)"
    )
