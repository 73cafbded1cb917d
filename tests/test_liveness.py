"""Whether a process of another machine still runs: what names a machine, and one clock, the file server's.

Another machine is a process in PID, mount (and UTS) namespaces of its own
with a boot id of its own (tests/fsbed.py); a cloned machine is one that
also keeps this machine's /etc/machine-id, as stateless cluster images boot
one image on every node. A host's clock an hour off is tests/clock_ahead.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import run_sync, the_run
from fsbed import ON_B

import walbuf
from walbuf.directory.host import ENV_DEAD_AFTER
from walbuf.directory.layout import ENV_HOST
from walbuf.directory.mounts import ENV_LOCKS_SPAN
from walbuf.store import machine

pytestmark = pytest.mark.slow  # real processes and syncs

TESTS = Path(__file__).parent
HOUR = 3600.0
_CLONE = (
    "hostname node-b"
    " && mount -t tmpfs walbuf-clone /mnt"
    " && echo c10c10c1-0000-4000-8000-c10c10c10c10 > /mnt/boot_id"
    " && mount --bind /mnt/boot_id /proc/sys/kernel/random/boot_id"
    ' && exec "$@"'
)
ON_CLONE = ["unshare", "--mount", "--uts", "--pid", "--fork", "--mount-proc", "--kill-child", "sh", "-c", _CLONE, "c"]
"""Another node booted from this machine's image: its own host name, boot and PID namespace, this machine's id."""


@pytest.fixture
def directory(tmp_path):
    return str(tmp_path / "buf") + "/"


def writer(directory, host, name, n, *, prefix=(), clock=0.0):
    """A writer process on ``host`` that has logged ``n`` records and stays open until its stdin closes."""
    command = [sys.executable, "-m", "host_writer", directory, name, str(n), "stay"]
    if clock:
        command = [sys.executable, str(TESTS / "clock_ahead.py"), str(clock), *command]
    proc = subprocess.Popen(
        [*prefix, *command],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=TESTS,
        env={**os.environ, ENV_HOST: host, "PYTHONPATH": str(TESTS)},
    )
    assert proc.stdout.readline().strip() == f"logged {n}"
    return proc


def closed(proc):
    proc.stdin.close()
    assert proc.wait(timeout=120) == 0


def sync(server, directory, **env):
    proc = run_sync(server, directory, env={ENV_HOST: "login", **env}, quiet=False)
    assert proc.returncode == 0, proc.stderr
    return the_run(server)


def test_a_live_shard_of_a_node_with_a_cloned_machine_id_is_never_sealed_here(server, directory):
    other = writer(directory, "b", "rb", 5, prefix=ON_CLONE)
    try:
        (live,) = (Path(directory) / "live" / "b").glob("*.log")
        assert sync(server, directory).complete is False
        assert live.exists()  # its process runs on another node: not this sync's to seal
    finally:
        closed(other)
    run = sync(server, directory)
    assert (run.complete, run.exit_code) == (True, 0)  # its own close was noted, not a death


def test_a_sync_host_on_a_node_with_a_cloned_machine_id_is_not_taken_over_without_asking(server, directory):
    with walbuf.Writer(directory, writer="w", run="exp") as w:
        w.log({"i": 0})
    named = {
        "host": "b",
        "machine": machine.machine_id(),  # cloned
        "boot": "c10c10c1-0000-4000-8000-c10c10c10c10",
        "pidns": machine.pid_namespace(),
        "device": os.stat(directory).st_dev,
        "node": "node-b",
    }
    Path(directory, "sync-host").write_text(json.dumps(named))
    refused = run_sync(server, directory, env={ENV_LOCKS_SPAN: "no"}, quiet=False)
    assert refused.returncode == 78 and "synced from host b only" in refused.stderr, refused.stderr
    assert json.loads(Path(directory, "sync-host").read_text()) == named
    assert run_sync(server, directory, "--take-over", env={ENV_LOCKS_SPAN: "no"}).returncode == 0


def test_a_writer_reopened_on_a_node_whose_clock_is_an_hour_behind_is_open_whatever_the_clocks_say(server, directory):
    os.environ[ENV_HOST] = "a"
    with walbuf.Writer(directory, writer="w", run="exp") as w:
        w.log({"i": 0})
    del os.environ[ENV_HOST]
    requeued = writer(directory, "b", "w", 1, clock=-HOUR)  # the job, requeued on another node, opens it again
    try:
        # Its open is after that close by the file server's clock, an hour before it by the writers' clocks.
        assert sync(server, directory).complete is False
    finally:
        closed(requeued)
    run = sync(server, directory)
    assert (run.complete, run.exit_code) == (True, 0)


@pytest.mark.parametrize("clock", [-HOUR, +HOUR], ids=["an hour behind", "an hour ahead"])
def test_a_writer_on_another_machine_with_its_clock_off_runs_until_it_is_silent_by_the_file_servers_clock(
    server, directory, clock
):
    other = writer(directory, "b", "rb", 3, prefix=ON_B, clock=clock)
    (live,) = (Path(directory) / "live" / "b").glob("*.log")
    assert sync(server, directory, **{ENV_DEAD_AFTER: "61"}).complete is False  # heard of just now
    other.kill()
    other.wait()
    long_ago = time.time() - 120
    os.utime(live, (long_ago, long_ago))  # its last append, as the file server saw it, 120 s ago
    run = sync(server, directory, **{ENV_DEAD_AFTER: "61"})
    assert (run.complete, run.exit_code) == (True, 1)  # taken for dead: it never closed


def test_a_machine_whose_clock_is_an_hour_ahead_cannot_take_a_host_name_another_machine_appends_under(directory):
    first = writer(directory, "node1", "ra", 1, prefix=ON_B)
    try:
        shards = sorted((Path(directory) / "live").rglob("*"))
        ahead = [sys.executable, str(TESTS / "clock_ahead.py"), str(HOUR)]
        second = subprocess.run(
            [*ahead, sys.executable, "-m", "host_writer", directory, "rb", "1", "close"],
            capture_output=True,
            text=True,
            cwd=TESTS,
            env={**os.environ, ENV_HOST: "node1", "PYTHONPATH": str(TESTS)},
        )
        assert second.returncode != 0
        assert "host name 'node1' is in use by another machine" in second.stderr
        assert sorted((Path(directory) / "live").rglob("*")) == shards  # nothing written
    finally:
        closed(first)


def test_the_sync_host_an_older_walbuf_named_is_this_host_again_after_a_reboot(server, directory):
    with walbuf.Writer(directory, writer="w", run="exp") as w:
        w.log({"i": 0})
    # An older walbuf's note names no host name; this machine id, this WALBUF_HOST, another boot.
    named = {
        "host": "login",
        "machine": machine.machine_id(),
        "boot": "00000000-0000-4000-8000-000000000000",
        "pidns": machine.pid_namespace(),
        "device": os.stat(directory).st_dev,
    }
    Path(directory, "sync-host").write_text(json.dumps(named))
    proc = run_sync(server, directory, env={ENV_HOST: "login", ENV_LOCKS_SPAN: "no"}, quiet=False)
    assert proc.returncode == 0, proc.stderr  # none of its processes runs after a boot: taken over
    assert json.loads(Path(directory, "sync-host").read_text())["boot"] == machine.boot_id()
