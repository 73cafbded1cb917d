"""A FUSE passthrough of a folder, one mount of a two-"host" shared filesystem (tests/fsbed.py mounts it twice).

Usage: passfs.py ROOT MOUNTPOINT [--locks span|local] [--kernel-cache] [--direct-io] [--attr-timeout T]
                 [--lose-writes NAME]

Each mount is a daemon of its own, with the kernel's caches of its own, as
two hosts' clients of one server are:

  --locks span    flock() and fcntl() locks are passed to ROOT's files (flock
                  on the open's own file, fcntl ones as open file description
                  locks, one per lock owner): they exclude each other across
                  mounts, as NFSv4, Lustre -o flock or GPFS locks do.
  --locks local   lock requests stay with the kernel, per mount: a lock taken
                  through one mount is not seen through the other, as with NFS
                  -o local_lock=all or nolock, Lustre -o localflock, sshfs.
  --kernel-cache  pages stay cached across opens, and attributes and names for
                  --attr-timeout seconds: a mount may read pages the other has
                  since rewritten in place (a client without close-to-open
                  consistency).
  --direct-io     no page cache at all; a shared mmap is refused (ENODEV).
  --lose-writes NAME
                  writes to files named NAME are acknowledged and lost, as on a
                  filesystem that drops a file's data (a quota or a full disk
                  its writer never hears of): the file stays empty.

Prints "ready" once the filesystem is mounted (libfuse's init), then serves
until unmounted. Runs as root (allow_other); needs /dev/fuse and libfuse 2.
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import os
import struct
import sys
import threading

import mfusepy as fuse

parser = argparse.ArgumentParser()
parser.add_argument("root")
parser.add_argument("mountpoint")
parser.add_argument("--locks", choices=("span", "local"), default="span")
parser.add_argument("--kernel-cache", action="store_true")
parser.add_argument("--direct-io", action="store_true")
parser.add_argument("--attr-timeout", type=float, default=1.0)
parser.add_argument("--lose-writes", metavar="NAME")
args = parser.parse_args()
ROOT = os.path.realpath(args.root)
_FLOCK = "hhqqi4x"  # struct flock on Linux x86_64/aarch64: type, whence, start, len, pid


def _errors(fn):
    def wrapped(*a, **k):
        try:
            return fn(*a, **k)
        except BlockingIOError:
            raise fuse.FuseOSError(errno.EAGAIN) from None
        except OSError as exc:
            raise fuse.FuseOSError(exc.errno or errno.EIO) from None

    return wrapped


class Passthrough(fuse.Operations):
    use_ns = True

    def __init__(self) -> None:
        self.mutex = threading.Lock()
        self.posix: dict[tuple[int, int], int] = {}  # (fh, lock owner) -> a descriptor for its OFD locks

    def _path(self, path: str) -> str:
        return ROOT + path

    def init(self, path):
        print("ready", flush=True)

    @_errors
    def getattr(self, path, fh=None):
        st = os.fstat(fh.fh) if fh is not None and getattr(fh, "fh", 0) else os.lstat(self._path(path))
        out = {k: getattr(st, k) for k in ("st_mode", "st_nlink", "st_uid", "st_gid", "st_size", "st_ino", "st_blocks")}
        out.update(st_atime=st.st_atime_ns, st_mtime=st.st_mtime_ns, st_ctime=st.st_ctime_ns)
        return out

    @_errors
    def readdir_with_offset(self, path, offset, fh):
        # With each entry's inode number: an entry listed with inode 0 is one
        # that readdir(3) skips.
        if offset:
            return []
        entries = []
        for name in [".", "..", *os.listdir(self._path(path))]:
            try:
                st = os.lstat(os.path.join(self._path(path), name))
            except FileNotFoundError:
                continue  # removed meanwhile
            entries.append((name, {"st_ino": st.st_ino, "st_mode": st.st_mode}, 0))
        return entries

    @_errors
    def readlink(self, path):
        return os.readlink(self._path(path))

    @_errors
    def mkdir(self, path, mode):
        os.mkdir(self._path(path), mode)
        return 0

    @_errors
    def rmdir(self, path):
        os.rmdir(self._path(path))
        return 0

    @_errors
    def unlink(self, path):
        os.unlink(self._path(path))
        return 0

    @_errors
    def rename(self, old, new):
        os.rename(self._path(old), self._path(new))
        return 0

    @_errors
    def symlink(self, target, source):
        os.symlink(source, self._path(target))
        return 0

    @_errors
    def link(self, target, source):
        os.link(self._path(source), self._path(target))
        return 0

    @_errors
    def chmod(self, path, mode):
        os.chmod(self._path(path), mode)
        return 0

    @_errors
    def chown(self, path, uid, gid):
        os.lchown(self._path(path), uid, gid)
        return 0

    @_errors
    def utimens(self, path, times=None):
        os.utime(self._path(path), ns=times) if times else os.utime(self._path(path))
        return 0

    @_errors
    def statfs(self, path):
        s = os.statvfs(self._path(path))
        names = ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree", "f_files", "f_frsize")
        return {k: getattr(s, k) for k in (*names, "f_flag", "f_namemax")}

    def _opened(self, fi, fd):
        fi.fh = fd
        fi.direct_io = int(args.direct_io)
        fi.keep_cache = int(args.kernel_cache)
        return 0

    @_errors
    def open(self, path, fi):
        return self._opened(fi, os.open(self._path(path), fi.flags & ~(os.O_CREAT | os.O_EXCL) | os.O_NOFOLLOW))

    @_errors
    def create(self, path, mode, fi):
        return self._opened(fi, os.open(self._path(path), fi.flags | os.O_CREAT | os.O_NOFOLLOW, mode))

    @_errors
    def read(self, path, size, offset, fi):
        return os.pread(fi.fh, size, offset)

    @_errors
    def write(self, path, data, offset, fi):
        if os.path.basename(path) == args.lose_writes:
            return len(data)
        return os.pwrite(fi.fh, data, offset)

    @_errors
    def truncate(self, path, length, fh=None):
        if fh is not None and getattr(fh, "fh", 0):
            os.ftruncate(fh.fh, length)
        else:
            os.truncate(self._path(path), length)
        return 0

    @_errors
    def fsync(self, path, datasync, fi):
        (os.fdatasync if datasync else os.fsync)(fi.fh)
        return 0

    def flush(self, path, fi):
        return 0

    @_errors
    def release(self, path, fi):
        with self.mutex:
            for key in [k for k in self.posix if k[0] == fi.fh]:
                os.close(self.posix.pop(key))
        os.close(fi.fh)
        return 0

    @_errors
    def flock(self, path, fi, op):
        fcntl.flock(fi.fh, op)
        return 0

    @_errors
    def lock(self, path, fi, cmd, lockp):
        held = lockp.contents
        with self.mutex:
            fd = self.posix.get((fi.fh, fi.lock_owner))
            if fd is None:
                if held.l_type == fcntl.F_UNLCK and cmd != fcntl.F_GETLK:
                    return 0  # this owner holds nothing here
                fd = self.posix[(fi.fh, fi.lock_owner)] = os.open(f"/proc/self/fd/{fi.fh}", os.O_RDWR)
        request = struct.pack(_FLOCK, held.l_type, held.l_whence, held.l_start, held.l_len, 0)
        ofd = {fcntl.F_GETLK: fcntl.F_OFD_GETLK, fcntl.F_SETLK: fcntl.F_OFD_SETLK, fcntl.F_SETLKW: fcntl.F_OFD_SETLKW}
        try:
            answer = fcntl.fcntl(fd, ofd[cmd], request)
        except PermissionError:
            raise fuse.FuseOSError(errno.EAGAIN) from None
        if cmd == fcntl.F_GETLK:
            kind, whence, start, length, _ = struct.unpack(_FLOCK, answer)
            held.l_type, held.l_whence, held.l_start, held.l_len, held.l_pid = kind, whence, start, length, 1
        return 0


if args.locks == "local":  # the kernel keeps the locks, per mount
    Passthrough.flock = None  # type: ignore[assignment]
    Passthrough.lock = None  # type: ignore[assignment]

fuse.FUSE(
    Passthrough(),
    args.mountpoint,
    raw_fi=True,
    foreground=True,
    allow_other=True,
    use_ino=True,
    fsname=f"walbuf-passfs:{ROOT}",
    subtype="walbuf-passfs",
    attr_timeout=args.attr_timeout,
    entry_timeout=args.attr_timeout,
    negative_timeout=0,
)
sys.exit(0)
