"""A full disk: reading still works, nothing advises restoring an intact buffer, and a sync sends nothing twice.

Each test puts its buffer on a small tmpfs of its own, filled by another
file the way a co-located job fills a scratch disk.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import rows_of, run_sync, walbuf_command

import walbuf

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounts a small tmpfs: needs root")

RECORDS = 300


class SmallDisk:
    """A tmpfs of a few MiB, and a file that fills it up."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.filler = root / "filler"

    def fill(self, leave: int = 0) -> None:
        """Write to the filler until the filesystem has no room left, then give back ``leave`` bytes."""
        block = b"\0" * 65536
        fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            for size in (65536, 4096, 512, 1):
                try:
                    while True:
                        os.write(fd, block[:size])
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC, exc
        finally:
            os.close(fd)
        assert os.statvfs(self.root).f_bfree == 0
        if leave:
            os.truncate(self.filler, self.filler.stat().st_size - leave)

    def free(self) -> None:
        self.filler.unlink()


@pytest.fixture
def disk():
    with tempfile.TemporaryDirectory() as mountpoint:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m,mode=0700", "tmpfs", mountpoint], check=True)
        try:
            yield SmallDisk(Path(mountpoint))
        finally:
            subprocess.run(["umount", "-l", mountpoint], check=True)


def logged(path: Path, n: int = RECORDS) -> None:
    with walbuf.Writer(path, writer="w", run="exp", project="p") as w:
        for i in range(n):
            w.log({"loss": i / 10})


def test_status_and_records_read_a_buffer_on_a_full_disk(disk):
    buffer = disk.root / "exp.db"
    logged(buffer)
    disk.fill()
    for _ in range(2):  # the second read finds what the first one's SQLite could not finish
        status = walbuf_command("status", "--json", str(buffer))
        assert status.returncode == 0, status.stderr
        [run] = json.loads(status.stdout)["runs"]
        assert (run["records"], run["pending"]) == (RECORDS, RECORDS)
    records = walbuf_command("records", str(buffer))
    assert records.returncode == 0, records.stderr
    assert len(records.stdout.splitlines()) == RECORDS


def test_doctor_tells_a_full_disk_from_damage(disk):
    buffer = disk.root / "exp.db"
    logged(buffer)
    disk.fill()
    result = walbuf_command("doctor", str(buffer))
    assert result.returncode == 1
    assert "FAIL  disk space: the filesystem of" in result.stdout and "free space" in result.stdout
    assert "ok    integrity: ok" in result.stdout
    assert "from a copy" not in result.stdout
    disk.free()
    assert walbuf_command("doctor", str(buffer)).returncode == 0


def test_a_sync_on_a_full_disk_sends_nothing_and_says_so(disk, server):
    buffer = disk.root / "exp.db"
    logged(buffer)
    disk.fill()
    result = run_sync(server, buffer)
    assert result.returncode == 74, result.stderr
    assert "disk is full" in result.stderr and "free space" in result.stderr
    assert server.runs == {}
    disk.free()
    status = json.loads(walbuf_command("status", "--json", str(buffer)).stdout)
    assert status["runs"][0]["pending"] == RECORDS
    assert status["runs"][0]["last_sync"] is None  # nothing was noted: nothing was sent


def test_a_disk_that_fills_during_an_upload_gets_it_confirmed_and_nothing_is_sent_twice(disk, server):
    buffer = disk.root / "exp.db"
    logged(buffer)
    assert run_sync(server, buffer).returncode == 0  # the first sync keeps room aside
    logged(buffer)  # RECORDS more, steps RECORDS..
    server.when_history_arrives(disk.fill)
    result = run_sync(server, buffer)
    # Confirmed in the room kept aside; the upload that would finish the W&B
    # run then finds the disk full, and is not made.
    assert result.returncode == 74, result.stderr
    assert "the disk filled during the upload" in result.stderr
    status = json.loads(walbuf_command("status", "--json", str(buffer)).stdout)
    assert status["runs"][0]["pending"] == 0
    disk.free()
    again = run_sync(server, buffer)
    assert again.returncode == 0, again.stderr
    [fake_run] = server.runs.values()
    steps = [step for step, _ in rows_of(fake_run, "w")]
    assert steps == list(range(2 * RECORDS))  # each once
    assert fake_run.complete  # and the run finished at last


def test_an_online_sync_needs_no_room_for_a_copy_of_the_records_it_sends(disk, server, tmp_path):
    # wandb keeps a copy of all a run sends (its transaction log, the run's
    # .wandb file) in the sync's working folder unless told not to: with a
    # home quota smaller than the backlog, every sync failed at the same
    # point. The buffer is that copy already.
    buffer = tmp_path / "exp.db"
    logged(buffer, 4000)
    disk.fill(leave=256 * 1024)
    result = run_sync(server, buffer, env={"XDG_CACHE_HOME": str(disk.root)})
    assert result.returncode == 0, result.stderr
    [fake_run] = server.runs.values()
    assert [step for step, _ in rows_of(fake_run, "w")] == list(range(4000))


def test_a_sync_that_died_during_its_upload_shows_as_died(tmp_path, server):
    buffer = tmp_path / "exp.db"
    logged(buffer)
    server.hold_uploads()
    proc = subprocess.Popen(
        [sys.executable, "-m", "walbuf", "sync", "--quiet", str(buffer)],
        env={**os.environ, **server.env()},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        server.wait_for_rows(1, timeout=60)  # the upload is under way: rows arrived, unanswered
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        server.release_uploads()
    status = walbuf_command("status", str(buffer))
    assert status.returncode == 0, status.stderr
    assert f": died, {RECORDS} records: its syncer ended during the upload" in status.stdout
    assert f"sends those {RECORDS} records again" in status.stdout
