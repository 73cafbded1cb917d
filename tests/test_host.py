"""Where a directory buffer runs: which filesystems let hosts take turns on the hub, and which processes still run."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from walbuf.directory.host import ENV_DEAD_AFTER, Process, judged_running, silent_after
from walbuf.directory.mounts import ENV_LOCKS_SPAN, Mount, _verdict, coordination, mount_of
from walbuf.errors import ConfigError


@pytest.mark.parametrize(
    "fstype, options, spans",
    [
        ("ext4", "rw,relatime", True),
        ("tmpfs", "rw", True),
        ("nfs4", "rw,vers=4.2,local_lock=none", True),
        ("nfs", "rw,vers=3", True),
        ("nfs", "rw,vers=3,nolock", False),
        ("nfs4", "rw,local_lock=all", False),
        ("nfs", "rw,local_lock=flock", False),
        ("lustre", "rw,flock", True),
        ("lustre", "rw,localflock", False),
        ("lustre", "rw", False),
        ("gpfs", "rw", True),
        ("ceph", "rw,name=admin", True),
        ("fuse.sshfs", "rw,user_id=0", False),
        ("beegfs", "rw", False),
        ("cifs", "rw", False),
    ],
)
def test_a_filesystem_lets_hosts_take_turns_on_the_hub_only_where_its_locks_span_them(fstype, options, spans):
    verdict = _verdict(Mount("/shared", fstype, "server:/export", tuple(options.split(","))))
    assert verdict.spans is spans
    assert "/shared" in verdict.why and fstype in verdict.why or spans


def test_the_mount_of_a_path_is_the_one_findmnt_names(tmp_path):
    found = subprocess.run(
        ["findmnt", "-n", "-o", "TARGET,FSTYPE", "--target", str(tmp_path)], capture_output=True, text=True, check=True
    ).stdout.split()
    mount = mount_of(tmp_path)
    assert mount is not None and [mount.point, mount.fstype] == found


@pytest.mark.parametrize("value, spans", [("yes", True), ("no", False), ("YES", True)])
def test_the_setting_overrides_what_the_mount_says(tmp_path, monkeypatch, value, spans):
    monkeypatch.setenv(ENV_LOCKS_SPAN, value)
    verdict = coordination(tmp_path)
    assert verdict.spans is spans and ENV_LOCKS_SPAN in verdict.why


def test_a_setting_other_than_yes_or_no_is_refused_naming_it(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_LOCKS_SPAN, "maybe")
    with pytest.raises(ConfigError, match=f"{ENV_LOCKS_SPAN} must be yes or no"):
        coordination(tmp_path)


@pytest.mark.parametrize("value", ["abc", "0", "60", "-5", "nan"])
def test_a_dead_after_time_that_is_not_over_the_heartbeat_is_refused_naming_it(monkeypatch, value):
    monkeypatch.setenv(ENV_DEAD_AFTER, value)
    with pytest.raises(ConfigError, match=f"{ENV_DEAD_AFTER} must be a number of seconds over 60"):
        silent_after()


def test_the_dead_after_time_is_ten_minutes_unless_set(monkeypatch):
    monkeypatch.delenv(ENV_DEAD_AFTER, raising=False)
    assert silent_after() == 600
    monkeypatch.setenv(ENV_DEAD_AFTER, "inf")  # never: a run waits for its writers for good
    assert silent_after() == float("inf")


def test_a_process_of_this_machine_is_known_to_run_or_to_have_ended():
    assert Process.this("h").running() is True
    child = subprocess.Popen([sys.executable, "-c", "import os; print(os.getpid())"], stdout=subprocess.PIPE, text=True)
    started = Process.this("h")  # of this process; the child's pid with this process's start time is another process
    pid = int(child.stdout.readline())
    child.wait()
    assert dataclasses.replace(started, pid=pid).running() is False


def test_a_process_of_another_machine_is_judged_by_when_it_was_last_heard_of(monkeypatch):
    monkeypatch.setenv(ENV_DEAD_AFTER, "100")
    other = dataclasses.replace(Process.this("h"), machine="another", boot="another boot")
    assert other.running() is None
    assert judged_running(other, last_seen=1000.0, now=1099.0) is True
    assert judged_running(other, last_seen=1000.0, now=1100.0) is False


def test_a_process_of_this_machine_before_it_booted_again_has_ended():
    earlier = dataclasses.replace(Process.this("h"), boot="a boot before this one")
    assert earlier.running() is False
