"""Two "hosts" on one machine: one folder mounted twice, each mount with the caches (and maybe the locks) of its own.

A cluster's hosts see one folder on shared storage, each through a client of
its own. Here ``export/`` is mounted at ``A/`` and ``B/``:

- "passfs-span": tests/passfs.py with locks passed to the folder's files, so
  they exclude each other across the mounts (NFSv4, Lustre -o flock, GPFS);
- "passfs-local": the same with locks kept per mount (NFS nolock or
  local_lock, Lustre localflock);
- "passfs-cache": locks spanning the mounts, but pages and attributes
  cached across opens for 30 s (a client without close-to-open
  consistency: what one host rewrote in place another may not see);
- "passfs-direct": no page cache at all, and no shared mmap (FUSE direct_io);
- "sshfs": sshfs to an sshd on 127.0.0.1 (locks per mount, sshfs's caches
  but its cache of directory listings, which would only delay by up to its
  20 s what a host sees of shards another host sealed).

Processes of host B run as on another machine (:data:`ON_B`): in a PID
namespace of their own, with host B's machine id and boot id, so that a
sync on A can no more see whether they run than it could on another machine.
Needs root, /dev/fuse, Debian's libfuse2, fuse3, sshfs and openssh-server
(.ci/run installs them); without them, a test fails in CI and is skipped
elsewhere.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import pytest

PASSFS = Path(__file__).parent / "passfs.py"
_ANOTHER_MACHINE = (
    "mount -t tmpfs walbuf-host-b /mnt"
    " && echo b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0 > /mnt/machine-id"
    " && echo b0b0b0b0-0000-4000-8000-b0b0b0b0b0b0 > /mnt/boot_id"
    " && { [ ! -e /etc/machine-id ] || mount --bind /mnt/machine-id /etc/machine-id; }"
    " && mount --bind /mnt/boot_id /proc/sys/kernel/random/boot_id"
    ' && exec "$@"'
)
ON_B = ["unshare", "--mount", "--pid", "--fork", "--mount-proc", "--kill-child", "sh", "-c", _ANOTHER_MACHINE, "b"]
"""The prefix of a process of host B, as on another machine: its own PID namespace, and the machine id and
boot id of host B (the same for every process of B), in a mount namespace of its own."""

BEDS = {
    "passfs-span": ("passfs", ["--locks", "span"]),
    "passfs-local": ("passfs", ["--locks", "local"]),
    "passfs-cache": ("passfs", ["--locks", "span", "--kernel-cache", "--attr-timeout", "30"]),
    "passfs-direct": ("passfs", ["--locks", "local", "--direct-io"]),
    "sshfs": ("sshfs", ["-o", "dir_cache=no"]),
}


@dataclass(frozen=True)
class Bed:
    """One folder (``export``) as two hosts see it: ``a`` and ``b``."""

    kind: str
    export: Path
    a: Path
    b: Path


def missing() -> str | None:
    """What this machine lacks to mount a bed, or None."""
    if os.geteuid() != 0:
        return "the two-mount bed mounts as root"
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse"
    for tool in ("unshare", "sshfs", "fusermount3"):
        if shutil.which(tool) is None:
            return f"no {tool} (Debian: apt-get install fuse3 libfuse2 sshfs openssh-server)"
    if not os.path.exists("/usr/sbin/sshd"):
        return "no /usr/sbin/sshd (Debian: apt-get install openssh-server)"
    return None


def require() -> None:
    why = missing()
    if why is not None:
        if os.environ.get("CI"):
            pytest.fail(f"the two-mount bed cannot run in CI: {why}")
        pytest.skip(why)


@contextmanager
def mounted(base: Path, kind: str) -> Iterator[Bed]:
    """A bed of ``kind`` (see BEDS) under ``base``, unmounted afterwards."""
    tool, options = BEDS[kind]
    export, a, b = base / "export", base / "A", base / "B"
    for folder in (export, a, b):
        folder.mkdir(mode=0o755, parents=True)
    mounts = (_passfs if tool == "passfs" else _sshfs)(base, export, (a, b), options)
    try:
        with mounts:
            yield Bed(kind, export, a, b)
    finally:
        for mount in (a, b):
            _unmount(mount)


@contextmanager
def lossy(base: Path, name: str) -> Iterator[Path]:
    """A folder under ``base`` in which writes to files named ``name`` are acknowledged and lost (passfs --lose-writes).

    Unmounted afterwards.
    """
    export, point = base / "lossy-export", base / "lossy"
    for folder in (export, point):
        folder.mkdir(mode=0o755, parents=True)
    with _passfs(base, export, (point,), ["--lose-writes", name]):
        yield point


@contextmanager
def _passfs(base: Path, export: Path, points: tuple[Path, ...], options: list[str]) -> Iterator[None]:
    daemons = []
    try:
        for point in points:
            daemon = subprocess.Popen(
                [sys.executable, str(PASSFS), str(export), str(point), *options],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            daemons.append(daemon)
            if daemon.stdout.readline().strip() != "ready":  # printed once the kernel mounted it
                pytest.fail(f"passfs did not mount {point}: {daemon.stderr.read()}")
        yield
    finally:
        for point in points:
            _unmount(point)
        for daemon in daemons:
            with suppress(subprocess.TimeoutExpired):
                daemon.wait(timeout=30)
            if daemon.poll() is None:
                daemon.kill()
                daemon.wait()


@contextmanager
def _sshfs(base: Path, export: Path, points: tuple[Path, Path], options: list[str]) -> Iterator[None]:
    keys = base / "ssh"
    keys.mkdir(mode=0o700)
    for key in ("host", "client"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(keys / key)], check=True)
    (keys / "authorized_keys").write_text((keys / "client.pub").read_text())
    config = keys / "sshd_config"
    config.write_text(
        "ListenAddress 127.0.0.1\nPort 0\n"
        f"HostKey {keys / 'host'}\nPermitRootLogin prohibit-password\nPasswordAuthentication no\n"
        f"KbdInteractiveAuthentication no\nAuthorizedKeysFile {keys / 'authorized_keys'}\nStrictModes no\n"
        "Subsystem sftp internal-sftp\nUsePAM no\nPidFile none\n"
    )
    port = _free_port()
    config.write_text(config.read_text().replace("Port 0", f"Port {port}"))
    Path("/run/sshd").mkdir(exist_ok=True)
    sshd = subprocess.Popen(
        ["/usr/sbin/sshd", "-D", "-e", "-f", str(config)], stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        for line in sshd.stderr:  # -D -e: it says so once it listens
            if "Server listening" in line:
                break
        else:
            pytest.fail("sshd did not start")
        ssh = f"IdentityFile={keys / 'client'},StrictHostKeyChecking=no,UserKnownHostsFile=/dev/null,BatchMode=yes"
        for point in points:
            # Without -f sshfs returns once the mount is made.
            subprocess.run(
                [
                    "sshfs",
                    "-p",
                    str(port),
                    "-o",
                    ssh,
                    "-o",
                    "allow_other",
                    *options,
                    f"root@127.0.0.1:{export}",
                    str(point),
                ],
                check=True,
                capture_output=True,
            )
        yield
    finally:
        for point in points:
            _unmount(point)
        os.killpg(sshd.pid, signal.SIGTERM)
        sshd.wait()


def _unmount(point: Path) -> None:
    with open("/proc/mounts") as mounts:
        if not any(line.split()[1] == str(point) for line in mounts):
            return
    if subprocess.run(["umount", str(point)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(point)], capture_output=True)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
