"""Facts of this machine that tell one process from another without locks: boot id, PID namespace, start times.

A pid names one process only within one boot of one machine, and within
one PID namespace (containers have their own); with the process's start
time it names one process for sure. PostgreSQL writer leases and directory
buffer shards use these to tell whether a process of this machine still runs.
"""

from __future__ import annotations

import os


def boot_id() -> str:
    """This machine's boot id, new at every boot ('' where the kernel gives none)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as file:
            return file.read().strip()
    except OSError:
        return ""


def pid_namespace() -> str:
    """This process's PID namespace ('' where the kernel gives none)."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _stat_fields(pid: int) -> list[bytes] | None:
    """The fields of /proc/PID/stat from its third on; None if there is no such process (or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            stat = file.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: count from its end.
    return stat[stat.rindex(b")") + 2 :].split()


def started(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot; None if there is no such process (or no /proc)."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields is not None else None  # field 22 of proc(5)


def running(pid: int, start: int) -> bool:
    """Whether the process ``pid`` that started at ``start`` (see :func:`started`) runs, not ended as a zombie."""
    fields = _stat_fields(pid)
    return fields is not None and int(fields[19]) == start and fields[0] not in (b"Z", b"X")


def node() -> str:
    """This machine's host name as its kernel knows it (uname's nodename).

    With the machine id it names a machine: stateless cluster images boot
    one image, /etc/machine-id included, on every node.
    """
    return os.uname().nodename


def machine_id() -> str:
    """This machine's id, the same across boots (systemd's /etc/machine-id); the boot id where it has none."""
    for path in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        try:
            with open(path) as file:
                text = file.read().strip()
        except OSError:
            continue
        if text:
            return text
    return boot_id()
