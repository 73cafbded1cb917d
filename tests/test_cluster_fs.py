"""Directory buffers on two mounts of one folder: whatever the filesystem shares between hosts, nothing is lost.

Each test mounts one folder twice (tests/fsbed.py) as hosts A and B, with
locks that span the mounts or stay per mount, kernel caches kept, no page
cache at all, or sshfs. Processes of host B run in a PID namespace of their
own, so that a sync on A can tell of them only what it could of another
machine's. Uploads are asserted on what the W&B fake received.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import fsbed
import pytest
from conftest import require_strace, rows_of, run_sync, stopped_by_strace, the_run, walbuf_command

from walbuf.directory.layout import Layout
from walbuf.directory.shard import Logged, ShardGone, ShardReader, open_where_now

pytestmark = pytest.mark.slow  # mounts, real processes and syncs

TESTS = Path(__file__).parent


@pytest.fixture
def bed(request, tmp_path):
    fsbed.require()
    with fsbed.mounted(tmp_path / "bed", request.param) as mounted:
        yield mounted


def buffer_on(side: Path) -> str:
    return str(side / "buf") + "/"


def sync_on_a(server, bed, *args, quiet=True, env=None):
    return run_sync(server, buffer_on(bed.a), *args, env={"WALBUF_HOST": "hostA", **(env or {})}, quiet=quiet)


def sync_on_b(server, bed, *args, env=None):
    full = {**os.environ, **server.env(), "WALBUF_HOST": "hostB", **(env or {})}
    return subprocess.run(
        [*fsbed.ON_B, sys.executable, "-m", "walbuf", "sync", buffer_on(bed.b), "--quiet", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=full,
    )


def log_on(side, host, writer, n):
    """A writer process of ``host`` (in this PID namespace) logs ``n`` records on mount ``side`` and closes."""
    subprocess.run(
        [sys.executable, str(TESTS / "host_writer.py"), buffer_on(side), writer, str(n), "close"],
        env={**os.environ, "WALBUF_HOST": host},
        check=True,
        capture_output=True,
    )


def staying_on_a(bed, host, writer, n):
    """A writer process of ``host`` on mount A that logged ``n`` records and stays open until its stdin closes."""
    proc = subprocess.Popen(
        [sys.executable, str(TESTS / "host_writer.py"), buffer_on(bed.a), writer, str(n), "stay"],
        env={**os.environ, "WALBUF_HOST": host},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == f"logged {n}"
    return proc


def on_b(*command, env=None, **popen):
    """A process of host B (its own PID namespace), on B's mount."""
    return subprocess.Popen(
        [*fsbed.ON_B, sys.executable, *command], env={**os.environ, "WALBUF_HOST": "hostB", **(env or {})}, **popen
    )


def steps_of(fake_run, writer):
    return [metrics["i"] for _, metrics in rows_of(fake_run, writer)]


ALL_BEDS = list(fsbed.BEDS)


@pytest.mark.parametrize("bed", ALL_BEDS, indirect=True)
def test_records_a_host_logs_while_another_host_syncs_all_arrive_once(server, bed):
    # B's writer goes on to new shards every half second; A syncs meanwhile.
    writer = on_b(
        str(TESTS / "rotating_writer.py"),
        buffer_on(bed.b),
        "rb",
        env={"WALBUF_ROTATE_SECONDS": "0.5"},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert writer.stdout.readline() == "started\n"
        for _ in range(3):
            proc = sync_on_a(server, bed)
            assert proc.returncode == 0, proc.stderr
            assert the_run(server).complete is False  # B's writer is open
    finally:
        writer.stdin.close()
    logged = int(writer.stdout.readline().split()[1])
    assert writer.wait() == 0
    proc = sync_on_a(server, bed)
    assert proc.returncode == 0, proc.stderr
    assert steps_of(the_run(server), "rb") == list(range(logged))  # every acknowledged record, once, in order
    assert (the_run(server).complete, the_run(server).exit_code) == (True, 0)


@pytest.mark.parametrize("bed", ["passfs-local"], indirect=True)
def test_a_writer_open_on_another_host_keeps_its_run_running_until_it_closes(server, bed):
    idle = on_b(
        str(TESTS / "host_writer.py"),
        buffer_on(bed.b),
        "rb",
        "3",
        "stay",
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert idle.stdout.readline().strip() == "logged 3"
    assert sync_on_a(server, bed).returncode == 0
    assert steps_of(the_run(server), "rb") == [0, 1, 2]
    assert the_run(server).complete is False  # its lock says nothing on A; its shard says it runs
    idle.stdin.close()
    assert idle.wait() == 0
    assert sync_on_a(server, bed).returncode == 0
    assert (the_run(server).complete, the_run(server).exit_code) == (True, 0)


HOLD_HUB = """
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("PRAGMA cache_size=1")  # its changes spill into the file: its journal is hot to whoever sees no lock
conn.execute("BEGIN IMMEDIATE")
conn.execute("UPDATE runs SET project = 'changed by A'")
conn.execute("UPDATE records SET step = step + 0")
print("holding", flush=True)
sys.stdin.read()
conn.execute("COMMIT")
print("committed", flush=True)
"""


@pytest.mark.parametrize("bed", ["passfs-local"], indirect=True)
def test_reading_on_one_host_never_rolls_back_a_transaction_of_another_on_the_hub(server, bed):
    log_on(bed.a, "hostA", "ra", 3000)
    assert sync_on_a(server, bed).returncode == 0  # the hub exists now
    hub_a = Path(buffer_on(bed.a)) / "hub.db"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_HUB, str(hub_a)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline() == "holding\n"  # its journal is there; its lock is A's alone
        status = on_b(
            "-m", "walbuf", "status", buffer_on(bed.b), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        _, errors = status.communicate(timeout=120)
        assert status.returncode == 69, errors  # retry later: reading changes nothing, it rolled nothing back
        assert (bed.export / "buf" / "hub.db-journal").exists()
    finally:
        holder.stdin.close()
    assert holder.stdout.readline() == "committed\n"
    assert holder.wait() == 0
    hub = sqlite3.connect(bed.export / "buf" / "hub.db")
    try:
        assert hub.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        assert hub.execute("SELECT project FROM runs").fetchall() == [("changed by A",)]
    finally:
        hub.close()


@pytest.mark.parametrize("bed", ["passfs-local", "sshfs"], indirect=True)
def test_where_locks_do_not_span_hosts_one_host_syncs_and_another_may_take_over(server, bed):
    log_on(bed.a, "hostA", "ra", 3)
    assert sync_on_a(server, bed).returncode == 0  # A syncs it from now on
    hub = (bed.export / "buf" / "hub.db").read_bytes()
    proc = sync_on_b(server, bed)
    assert proc.returncode == 78, proc.stderr
    assert "synced from host hostA only" in proc.stderr and "fuse." in proc.stderr
    assert (bed.export / "buf" / "hub.db").read_bytes() == hub  # nothing was changed
    assert sync_on_b(server, bed, "--take-over").returncode == 0
    assert sync_on_a(server, bed).returncode == 78  # B syncs it now
    assert steps_of(the_run(server), "ra") == [0, 1, 2]


CLAIM = """
import sys
from pathlib import Path
from walbuf.directory.layout import Layout
from walbuf.directory.sync_host import claim
from walbuf.errors import SyncHostError
try:
    claim(Layout(Path(sys.argv[1])))
except SyncHostError:
    print("refused", flush=True)
else:
    print("claimed", flush=True)
"""


@pytest.mark.parametrize("bed", ["passfs-local", "sshfs"], indirect=True)
def test_a_host_claiming_a_buffer_while_another_is_stopped_naming_itself_there_leaves_one_sync_host(bed, tmp_path):
    # A's claim stops at its first write, that of its name (strace fails it with
    # EINTR, then stops it: the write is made again once it goes on); B's claim
    # runs meanwhile, then A goes on. Only one of them may sync the buffer.
    strace = require_strace()
    Layout(Path(buffer_on(bed.a))).make()  # made beforehand: A's claim writes nothing before its name
    trace = tmp_path / "trace"
    stop = ["-e", "trace=write", "-e", "inject=write:error=EINTR:signal=SIGSTOP:when=1"]
    first = subprocess.Popen(
        [strace, "-f", "-qq", "-o", str(trace), *stop, sys.executable, "-c", CLAIM, buffer_on(bed.a)],
        env={**os.environ, "WALBUF_HOST": "hostA"},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        stopped_a = stopped_by_strace(trace, "A's claim did not stop")
        second = on_b("-c", CLAIM, buffer_on(bed.b), stdout=subprocess.PIPE, text=True)
        said_b = second.communicate(timeout=120)[0]
        os.kill(stopped_a, signal.SIGCONT)
        said_a = first.communicate(timeout=120)[0]
    finally:
        if first.poll() is None:
            os.kill(int(trace.read_text().split()[0]), signal.SIGKILL)
            first.wait()
    assert sorted([said_a, said_b]) == ["claimed\n", "refused\n"]
    named = json.loads((bed.export / "buf" / "sync-host").read_text())["host"]
    assert named == ("hostA" if said_a == "claimed\n" else "hostB")


def claim_killed_before_removing_its_temporary(bed):
    """A's claim of a new buffer, killed as it enters its first unlink: its name is sync-host, and its temporary is
    left, a second name of that file."""
    strace = require_strace()
    Layout(Path(buffer_on(bed.a))).make()
    kill = ["-e", "trace=unlink", "-e", "inject=unlink:signal=SIGKILL:when=1"]
    subprocess.run(
        [strace, "-f", "-qq", "-o", os.devnull, *kill, sys.executable, "-c", CLAIM, buffer_on(bed.a)],
        env={**os.environ, "WALBUF_HOST": "hostA"},
        capture_output=True,
        timeout=120,
    )
    assert os.stat(bed.export / "buf" / "sync-host").st_nlink == 2
    assert len(list((bed.export / "buf").glob("sync-host.*.new"))) == 1


@pytest.mark.parametrize("bed", ["passfs-local"], indirect=True)
def test_a_sync_host_killed_before_removing_its_temporary_is_named_to_readers_on_other_hosts(bed):
    claim_killed_before_removing_its_temporary(bed)
    doctor_b = on_b("-m", "walbuf", "doctor", buffer_on(bed.b), stdout=subprocess.PIPE, text=True)
    said = doctor_b.communicate(timeout=120)[0]
    assert "one host syncs it; host hostA syncs it" in said and "hard links" not in said, said


@pytest.mark.parametrize("bed", ["passfs-local"], indirect=True)
def test_another_hosts_claim_removes_the_temporary_a_killed_claim_left_and_is_refused_naming_its_host(bed):
    claim_killed_before_removing_its_temporary(bed)
    second = on_b("-c", CLAIM, buffer_on(bed.b), stdout=subprocess.PIPE, text=True)
    assert second.communicate(timeout=120)[0] == "refused\n"
    assert json.loads((bed.export / "buf" / "sync-host").read_text())["host"] == "hostA"
    assert list((bed.export / "buf").glob("sync-host.*.new")) == []
    assert os.stat(bed.export / "buf" / "sync-host").st_nlink == 1


@pytest.mark.parametrize("bed", ["passfs-span"], indirect=True)
def test_hosts_take_turns_syncing_where_locks_are_known_to_span_them(server, bed):
    spans = {"WALBUF_LOCKS_SPAN_HOSTS": "yes"}
    for host, side in (("hostA", bed.a), ("hostB", bed.b)):
        log_on(side, host, f"r{host}", 3)
        assert sync_on_a(server, bed, env=spans).returncode == 0
        proc = sync_on_b(server, bed, env=spans)
        assert proc.returncode == 0, proc.stderr
    assert steps_of(the_run(server), "rhostA") == [0, 1, 2] and steps_of(the_run(server), "rhostB") == [0, 1, 2]


@pytest.mark.parametrize("bed", ["passfs-local"], indirect=True)
def test_two_machines_given_one_host_name_are_refused_before_anything_is_written(bed):
    first = staying_on_a(bed, "node1", "ra", 1)
    try:
        shards = sorted((bed.export / "buf" / "live").rglob("*"))
        second = on_b(
            "-c",
            "import sys, walbuf; walbuf.Writer(sys.argv[1], writer='rb', run='exp')",
            buffer_on(bed.b),
            env={"WALBUF_HOST": "node1"},
            stderr=subprocess.PIPE,
            text=True,
        )
        _, errors = second.communicate(timeout=120)
        assert second.returncode != 0
        assert "host name 'node1' is in use by another machine" in errors
        assert sorted((bed.export / "buf" / "live").rglob("*")) == shards
    finally:
        first.stdin.close()
    assert first.wait() == 0


REOPEN = """
import logging, sys, walbuf
logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(message)s")
with walbuf.Writer(sys.argv[1], writer="ra", run="exp") as w:
    print(w.last_step, w.log({"i": 1}), flush=True)
"""


@pytest.mark.parametrize("bed", ["passfs-local"], indirect=True)
def test_a_writer_starting_on_one_host_waits_out_a_transaction_of_another_on_the_hub(server, bed):
    killed = staying_on_a(bed, "hostA", "ra", 3000)
    killed.kill()  # it notes no last step as it dies: the next holder of the id reads the shards and the hub
    killed.wait()
    assert sync_on_a(server, bed).returncode == 0
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_HUB, str(Path(buffer_on(bed.a)) / "hub.db")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline() == "holding\n"
    writer = on_b("-c", REOPEN, buffer_on(bed.b), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in writer.stderr:
        if "waiting for a sync's transaction" in line:  # it met A's journal, and rolled nothing back
            break
    holder.stdin.close()
    assert holder.stdout.readline() == "committed\n" and holder.wait() == 0
    out, errors = writer.communicate(timeout=120)
    assert writer.returncode == 0, errors
    assert out.split() == ["2999", "3000"]


@pytest.mark.parametrize("bed", ["passfs-local"], indirect=True)
def test_a_sync_left_running_shows_as_died_on_the_sync_host_and_as_running_where_its_lock_is_not_seen(server, bed):
    log_on(bed.a, "hostA", "ra", 3)
    assert sync_on_a(server, bed).returncode == 0  # A syncs this buffer from now on
    hub = sqlite3.connect(bed.export / "buf" / "hub.db")
    with hub:  # as a sync on A killed during an upload leaves its entry
        hub.execute("UPDATE syncs SET status = 'running', finished_at = NULL WHERE id = (SELECT max(id) FROM syncs)")
    hub.close()
    on_a = walbuf_command("status", "--json", buffer_on(bed.a), env={"WALBUF_HOST": "hostA"})
    assert json.loads(on_a.stdout)["runs"][0]["last_sync"]["status"] == "died"
    status_b = on_b("-m", "walbuf", "status", "--json", buffer_on(bed.b), stdout=subprocess.PIPE, text=True)
    assert json.loads(status_b.communicate(timeout=120)[0])["runs"][0]["last_sync"]["status"] == "running"
    doctor_b = on_b("-m", "walbuf", "doctor", buffer_on(bed.b), stdout=subprocess.PIPE, text=True)
    assert "sync lock: not examined: host hostA syncs this buffer" in doctor_b.communicate(timeout=120)[0]


@pytest.mark.parametrize("bed", ["passfs-local", "sshfs"], indirect=True)
def test_a_shard_another_host_moves_while_this_one_reads_it_is_gone_from_here_never_unreadable(bed):
    # A client that reaches a file by its name (FUSE, sshfs) loses an open
    # file another host renamed: its reads fail with ENOENT. The shard moved
    # on (sealed, taken in); its reader must say so, so that it is read
    # where it went, not fail the sync.
    log_on(bed.a, "hostA", "ra", 5)
    layout = Layout(Path(buffer_on(bed.a)))
    (shard,) = layout.shards("sealed")
    with ShardReader(layout, shard) as reader:
        os.makedirs(Path(buffer_on(bed.b), "ingested"), mode=0o700, exist_ok=True)
        os.rename(
            Path(buffer_on(bed.b), "sealed", shard.path.name), Path(buffer_on(bed.b), "ingested", shard.path.name)
        )
        with pytest.raises(ShardGone):
            list(reader.events(0, set()))
    moved = open_where_now(layout, shard)
    assert moved is not None
    with moved:
        assert sum(isinstance(event, Logged) for _, event in moved.events(0, set())) == 5
