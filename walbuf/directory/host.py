"""Which process appends a shard, and whether it still runs: told for sure on its own machine, judged elsewhere.

Cluster filesystems differ in what they give one host of another: many keep
file locks per host (NFS ``nolock``/``local_lock``, Lustre ``localflock``,
sshfs, most FUSE filesystems), so a lock cannot tell one host whether a
process of another host is alive. A shard therefore names its process
(:class:`Process`, its first frame) by what identifies it without locks: the
machine's boot id, its PID namespace, its pid and the process's start time.

- On the same machine (same boot id and PID namespace) the answer is sure:
  the process runs if a process of that pid started at that time does.
  A machine that booted again is sure too: none of its processes runs.
  A machine is its machine id and its host name together: stateless
  cluster images boot one /etc/machine-id on every node.
- Elsewhere it is judged by time, by one clock, the file server's: a
  process whose shard it last saw appended to (its mtime: every append,
  and the heartbeat a process appends while idle, every HEARTBEAT seconds)
  :func:`silent_after` seconds (``WALBUF_DEAD_AFTER``, default 600) before
  it (as a file the sync writes says: :func:`server_time`) is taken for
  dead. No host's clock is compared with another's. A judgement, never
  acted on by writing: nothing of another machine's shard is ever changed
  (docs/directory-buffers.md), it only decides whether a run's job may
  still log.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..arguments import env_seconds
from ..store import machine
from ..store.trust import Owner

ENV_DEAD_AFTER = "WALBUF_DEAD_AFTER"
DEFAULT_DEAD_AFTER = 600.0
HEARTBEAT = 60.0  # seconds between an idle process's heartbeats; well under any sensible WALBUF_DEAD_AFTER


@dataclass(frozen=True)
class Process:
    """A process as a shard names it."""

    host: str  # its WALBUF_HOST name (what the shard is filed under)
    machine: str  # the machine's id (/etc/machine-id), the same across its boots
    boot: str  # the machine's boot id (/proc/sys/kernel/random/boot_id): new at every boot
    pidns: str  # its PID namespace (/proc/self/ns/pid), as containers on one machine have their own
    pid: int
    start: int  # its start time, in clock ticks since boot (/proc/PID/stat): a reused pid has another
    node: str = ""  # its machine's host name (uname), with the machine id naming the machine; "" if not known

    @classmethod
    def this(cls, host: str) -> Process:
        """This process."""
        pid = os.getpid()
        return cls(
            host,
            machine.machine_id(),
            machine.boot_id(),
            machine.pid_namespace(),
            pid,
            machine.started(pid) or 0,
            machine.node(),
        )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, value: object) -> Process:
        """ValueError unless ``value`` is a Process's JSON as walbuf writes it."""
        keys = {"host", "machine", "boot", "pidns", "pid", "start"}
        if not isinstance(value, dict) or set(value) not in (keys, keys | {"node"}):  # an older walbuf's: no node
            raise ValueError("not a process's description")
        texts = (value["host"], value["machine"], value["boot"], value["pidns"], value.get("node", ""))
        numbers = (value["pid"], value["start"])
        if not all(type(v) is str for v in texts) or not all(type(v) is int and v >= 0 for v in numbers):
            raise ValueError("a process's description of wrong types")
        return cls(**value)

    def same_machine(self) -> bool:
        """Whether it ran on this machine, in this PID namespace, since its last boot: :meth:`running` is sure."""
        return bool(self.boot) and (self.boot, self.pidns) == (machine.boot_id(), machine.pid_namespace())

    def on_this_machine(self) -> bool:
        """Whether it ran on this machine since its last boot, in any PID namespace (container) of it."""
        return bool(self.boot) and (self.machine, self.boot) == (machine.machine_id(), machine.boot_id())

    def ended_by_boot(self) -> bool:
        """Whether its machine is this one (machine id and host name), booted since: it ended for sure (a reboot
        ends every process). Never for a process whose host name is not known (an older walbuf's shard)."""
        same = bool(self.machine and self.node) and (self.machine, self.node) == (machine.machine_id(), machine.node())
        return same and self.boot != machine.boot_id()

    def running(self) -> bool | None:
        """Whether it runs now (a zombie counts as ended); None where this process cannot tell (another machine)."""
        if self.ended_by_boot():
            return False
        if not self.same_machine():
            return None
        return machine.running(self.pid, self.start)


def silent_after() -> float:
    """Seconds after its last frame that a process of another machine is taken for dead: $WALBUF_DEAD_AFTER, else 600.

    It must be longer than any pause of a live process (a job suspended by
    the scheduler, a node swapping) plus the clock difference between
    hosts; a process judged dead too early makes a sync finish its run while
    it may still log (the run is running again once it does).
    """
    return env_seconds(ENV_DEAD_AFTER, DEFAULT_DEAD_AFTER, over=HEARTBEAT)


def judged_running(process: Process, last_seen: float, now: float) -> bool:
    """Whether ``process`` runs: for sure on this machine, else by whether it was heard of (``last_seen``, its
    shard's mtime) within :func:`silent_after` seconds of ``now`` (by the same clock: see :func:`server_time`)."""
    running = process.running()
    if running is not None:
        return running
    return now - last_seen < silent_after()


CLOCK = "clock"  # in a buffer's locks/: the file whose mtime tells the file server's time (server_time)


def server_time(locks: Path, owner: Owner) -> float:
    """The file server's time now, as the mtime it gives a write to ``locks/clock``; this host's clock where this
    process may not write there (a reader of another account's buffer: its judgements are by this host's clock).

    Every shard's mtime is the file server's time of its last append: a
    process's silence is measured against this, never against this host's
    clock (hosts' clocks differ; a process heard of "in the future" would
    never be taken for dead, one behind would be at once).
    """
    if owner.uid != os.geteuid():
        return time.time()
    fd = owner.open(locks / CLOCK, os.O_WRONLY | os.O_TRUNC, create=True, private=True)
    try:
        os.write(fd, b"t")
        return os.fstat(fd).st_mtime
    finally:
        os.close(fd)
