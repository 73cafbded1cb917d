"""Directory buffers: each process appends to a shard of its own, and every shard reaches W&B from any host.

Hosts are faked with WALBUF_HOST, which names the folder a process's shard
goes in; another machine, where a sync cannot tell whether a process runs,
with a process in a PID namespace of its own (`unshare`). Syncs run as
`walbuf sync` processes against the W&B fake; every assertion about
uploads is on what the fake received. tests/test_cluster_fs.py runs the
same on two mounts of one folder whose locks and caches do not span them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from conftest import as_reader, require_strace, rows_of, run_sync, stopped_by_strace, the_run
from fsbed import ON_B

import walbuf
from walbuf import doctor, prune
from walbuf.directory.frames import END, FrameReader
from walbuf.directory.host import ENV_DEAD_AFTER
from walbuf.directory.ingest import ingest
from walbuf.directory.layout import ENV_HOST, ENV_ROTATE, Layout

pytestmark = pytest.mark.slow  # real processes and syncs: not in the quick loop

TESTS = Path(__file__).parent


@pytest.fixture
def directory(tmp_path):
    """A directory buffer that does not exist yet (the trailing '/' says it is one)."""
    return str(tmp_path / "buf") + "/"


@contextmanager
def on_host(name):
    """Writers opened inside pick this host's shard."""
    old = os.environ.get(ENV_HOST)
    os.environ[ENV_HOST] = name
    try:
        yield
    finally:
        if old is None:
            del os.environ[ENV_HOST]
        else:
            os.environ[ENV_HOST] = old


def log_on(host, directory, writer, n, start=0):
    with on_host(host), walbuf.Writer(directory, writer=writer, run="exp") as w:
        for i in range(start, start + n):
            w.log({"i": i})


def files(directory, part, suffix="log"):
    return sorted(p.name for p in (Path(directory) / part).rglob(f"*.{suffix}"))


def sync_on(server, host, directory, *args, quiet=True, prefix=()):
    return run_sync(server, directory, *args, env={ENV_HOST: host}, quiet=quiet, prefix=prefix)


def status_on(host, directory):
    proc = subprocess.run(
        [sys.executable, "-m", "walbuf", "status", directory, "--json"],
        capture_output=True,
        text=True,
        env={**os.environ, ENV_HOST: host},
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def steps_of(fake_run, writer):
    return [metrics["i"] for _, metrics in rows_of(fake_run, writer)]


def frames_of(path):
    """The kinds of the whole frames of a log shard, in order (see walbuf.directory.frames)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return [frame.kind for frame in FrameReader(fd)]
    finally:
        os.close(fd)


OTHER_MACHINE = ON_B  # another machine (tests/fsbed.py): its own PID namespace, machine id and boot id


# -- writing ---------------------------------------------------------------------------


def test_each_process_appends_to_a_live_shard_of_its_own_under_its_host(directory):
    with on_host("a"), walbuf.Writer(directory, writer="ra"), on_host("b"), walbuf.Writer(directory, writer="rb"):
        assert [p.parent.name for p in sorted((Path(directory) / "live").rglob("*.log"))] == ["a", "b"]
        assert files(directory, "sealed") == []


def test_the_last_writer_of_a_process_to_close_seals_its_shard_whole(directory):
    with on_host("a"), walbuf.Writer(directory, writer="first") as first:
        first.log({"i": 0})
        with walbuf.Writer(directory, writer="second") as second:
            second.log({"i": 1})
        assert files(directory, "sealed") == [] and len(files(directory, "live")) == 1
    assert files(directory, "live") == []
    (sealed,) = (Path(directory) / "sealed").glob("a.*.log")
    assert frames_of(sealed)[-1] == END  # its process noted it whole


def test_a_held_shard_stays_live_when_its_writers_close_and_is_sealed_when_let_go(directory):
    with on_host("a"):
        hold = walbuf.open_buffer(directory, create=True).hold_shard()
        log_on("a", directory, "brief", 1)
        assert len(files(directory, "live")) == 1 and files(directory, "sealed") == []
        hold.release()
    assert files(directory, "live") == [] and len(files(directory, "sealed")) == 1


def test_a_process_moves_to_a_new_shard_when_its_own_expires(directory, monkeypatch):
    monkeypatch.setenv(ENV_ROTATE, "1e-9")  # every log() finds its shard expired
    log_on("a", directory, "ra", 3)
    assert len(files(directory, "sealed")) >= 3
    assert [r.step for r in walbuf.read(directory)] == [0, 1, 2]


def test_a_process_that_cannot_write_its_shards_first_frame_leaves_no_shard_behind(directory):
    log_on("h", directory, "first", 1)  # the buffer, its marker and folders exist
    proc = subprocess.run(  # every file of the process may hold no byte: its shard's first frame fails
        [sys.executable, str(TESTS / "file_size_limit.py"), "0", sys.executable, str(TESTS / "host_writer.py")]
        + [directory, "w", "1", "close"],
        capture_output=True,
        text=True,
        env={**os.environ, ENV_HOST: "h2"},
    )
    assert proc.returncode != 0 and "was not written" in proc.stderr, proc.stderr
    assert list((Path(directory) / "live").rglob("*.log")) == []  # no empty shard no sync could ever seal


def test_a_writer_reopened_continues_its_steps(directory):
    log_on("a", directory, "ra", 3)
    with on_host("b"), walbuf.Writer(directory, writer="ra", run="exp") as w:
        assert w.last_step == 2 and w.log({"i": 3}) == 3


def test_a_writer_reopened_after_its_process_was_killed_continues_from_its_last_record(directory):
    victim = host_writer(directory, "k", "ra", 250, "stay")
    victim.send_signal(signal.SIGKILL)  # it notes no last step as it dies
    victim.wait()
    with on_host("k"), walbuf.Writer(directory, writer="ra", run="exp") as w:
        assert w.last_step == 249


REOPEN = "import sys, walbuf; print('next', walbuf.Writer(sys.argv[1], writer='ra', run='exp').log({'i': -1}))"


def test_a_writer_reopened_after_its_process_was_killed_reads_a_shard_sealed_while_it_looked(directory, tmp_path):
    # Its next holder reads every shard, oldest first, for its last step.
    # The dead process's shard is sealed (renamed into sealed/, as a sync on
    # this host seals it) after the holder listed it, before it opens it:
    # strace stops the holder just after it opened the shard before it (its
    # Nth open of that one, counted in a clean run on a copy of the buffer),
    # the test moves the dead process's shard, and the holder goes on.
    strace = require_strace()
    log_on("k", directory, "other", 1)  # the older shard
    (older,) = Path(directory, "sealed").glob("*.log")
    victim = host_writer(directory, "k", "ra", 250, "stay")
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    (live,) = Path(directory, "live", "k").glob("*.log")
    copy = tmp_path / "copy"
    shutil.copytree(directory, copy, symlinks=True)
    paths = ["-P", str(copy / "sealed" / older.name), "-P", str(copy / "live" / "k" / live.name)]
    clean = subprocess.run(
        [strace, "-f", "-qq", "-o", "/dev/stderr", *paths, "-e", "trace=openat", sys.executable, "-c", REOPEN]
        + [f"{copy}/"],
        capture_output=True,
        text=True,
        env={**os.environ, ENV_HOST: "k"},
    )
    assert clean.stdout == "next 250\n", clean.stderr
    opens = [line for line in clean.stderr.splitlines() if "openat(" in line]
    last = max(i for i, line in enumerate(opens) if live.name in line)  # the read for the last step
    assert older.name in opens[last - 1]  # the older shard is read just before it
    when = sum(older.name in line for line in opens[:last])
    trace = tmp_path / "trace"
    holder = subprocess.Popen(
        [strace, "-f", "-qq", "-o", str(trace), "-P", str(older), "-e", "trace=openat"]
        + ["-e", f"inject=openat:signal=SIGSTOP:when={when}", sys.executable, "-c", REOPEN, directory],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, ENV_HOST: "k"},
    )
    try:
        stopped_pid = stopped_by_strace(trace, "the holder did not stop")
        os.rename(live, Path(directory, "sealed", f"k.{int(live.stem)}.log"))
        os.kill(stopped_pid, signal.SIGCONT)
        out, err = holder.communicate(timeout=120)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    assert (holder.returncode, out) == (0, "next 250\n"), err


def test_a_writer_reopened_after_its_process_was_killed_rolls_back_what_a_sync_killed_mid_transaction_left(
    server, directory
):
    # The sync is killed as it ends a transaction on the hub (at the unlink of
    # its rollback journal): the journal stays, which a read-only reader
    # cannot roll back. Each of the sync's first transactions in turn.
    strace = require_strace()
    journal = Path(directory, "hub.db-journal")
    for when in (1, 2, 3):
        victim = host_writer(directory, "k", "ra", 10, "stay")
        victim.send_signal(signal.SIGKILL)  # it notes no last step as it dies
        victim.wait()
        inject = ["-P", str(journal), "-e", "trace=unlink,unlinkat"]
        inject += ["-e", f"inject=unlink,unlinkat:signal=SIGKILL:when={when}"]
        killed = sync_on(server, "k", directory, prefix=[strace, "-f", "-qq", "-o", os.devnull, *inject])
        assert killed.returncode == -signal.SIGKILL and journal.exists(), killed.stderr
        with on_host("k"), walbuf.Writer(directory, writer="ra", run="exp") as w:
            assert w.last_step == 10 * when - 1
    assert sync_on(server, "k", directory).returncode == 0
    assert [step for step, _ in rows_of(the_run(server), "ra")] == list(range(30))


def test_a_writer_id_is_owned_across_hosts_where_locks_span_them(directory):
    with on_host("a"), walbuf.Writer(directory, writer="rank-0", run="exp"):
        with on_host("b"), pytest.raises(walbuf.WriterConflictError):
            walbuf.Writer(directory, writer="rank-0", run="exp")


def test_read_sees_every_shard_of_every_host_live_or_sealed(directory):
    log_on("a", directory, "ra", 2)
    with on_host("b"), walbuf.Writer(directory, writer="rb", run="exp") as rb:
        rb.log({"i": 10})
        with on_host("c"):  # b's live shard: appended only, so any host reads it
            assert [(r.writer, r.step) for r in walbuf.read(directory)] == [("ra", 0), ("ra", 1), ("rb", 0)]


# -- syncing ---------------------------------------------------------------------------


def test_a_sync_on_another_host_sends_the_records_of_live_shards_while_their_writers_go_on(server, directory):
    log_on("a", directory, "ra", 3)
    with on_host("b"), walbuf.Writer(directory, writer="rb", run="exp") as rb:
        rb.log({"i": 100})
        proc = sync_on(server, "s", directory)
        assert proc.returncode == 0, proc.stderr
        assert steps_of(the_run(server), "ra") == [0, 1, 2] and steps_of(the_run(server), "rb") == [100]
        rb.log({"i": 101})
    assert sync_on(server, "s", directory).returncode == 0
    assert steps_of(the_run(server), "rb") == [100, 101]  # each once
    assert files(directory, "live") == [] and files(directory, "sealed") == []
    assert len(files(directory, "ingested")) == 2


def test_a_shard_that_holds_what_walbuf_never_writes_is_reported_and_never_changed(server, directory):
    log_on("a", directory, "ra", 3)
    planted = Path(directory) / "live" / "c" / f"{1:020d}.log"
    planted.parent.mkdir(mode=0o700)
    planted.write_bytes(b"not a shard, and not ours to change " * 100)
    proc = sync_on(server, "s", directory, quiet=False)
    assert proc.returncode == 3, proc.stderr  # sent the rest; a person looks at it
    assert f"shard {planted}" in proc.stderr
    assert steps_of(the_run(server), "ra") == [0, 1, 2]
    assert planted.read_bytes() == b"not a shard, and not ours to change " * 100


def test_a_dry_run_counts_the_records_of_every_shard_and_copies_nothing_into_the_hub(server, directory):
    log_on("a", directory, "ra", 3)
    assert sync_on(server, "s", directory).returncode == 0
    log_on("a", directory, "ra", 2, start=3)
    with on_host("b"), walbuf.Writer(directory, writer="rb", run="exp") as rb:
        rb.log({"i": 100})
        proc = sync_on(server, "s", directory, "--dry-run", quiet=False)
        assert proc.returncode == 0, proc.stderr
        assert "and 3 records of shards not yet in the hub" in proc.stdout
    assert [name[0] for name in files(directory, "sealed")] == ["a", "b"]  # neither copied in
    assert len(files(directory, "ingested")) == 1
    assert steps_of(the_run(server), "ra") == [0, 1, 2]


def test_a_sync_on_the_writers_host_sends_its_live_shard_each_record_once(server, directory):
    with on_host("a"), walbuf.Writer(directory, writer="ra", run="exp") as w:
        for i in range(3):
            w.log({"i": i})
        assert sync_on(server, "a", directory).returncode == 0
        for i in range(3, 5):
            w.log({"i": i})
        assert sync_on(server, "a", directory).returncode == 0
    assert sync_on(server, "a", directory).returncode == 0
    assert steps_of(the_run(server), "ra") == [0, 1, 2, 3, 4]


def test_writer_processes_on_several_hosts_all_arrive_once_in_order(server, directory):
    code = (
        "import sys, walbuf\n"
        "w = walbuf.Writer(sys.argv[1], writer=sys.argv[2], run='exp')\n"
        "for i in range(40): w.log({'i': i})\n"
    )  # no close(): atexit closes the writer, and that seals the shard
    procs = [
        subprocess.Popen([sys.executable, "-c", code, directory, f"rank-{n}"], env={**os.environ, ENV_HOST: f"node{n}"})
        for n in range(3)
    ]
    assert [p.wait(timeout=60) for p in procs] == [0, 0, 0]
    assert len(files(directory, "sealed")) == 3
    proc = sync_on(server, "login", directory)
    assert proc.returncode == 0, proc.stderr
    for n in range(3):
        assert steps_of(the_run(server), f"rank-{n}") == list(range(40))
    assert len(the_run(server).history) == 120
    assert files(directory, "sealed") == [] and len(files(directory, "ingested")) == 3


def killed_writer(directory, *, prefix=()):
    """The steps a writer on host k acknowledged before it was killed -9 (writer_loop.py, writer "victim")."""
    victim = subprocess.Popen(
        [*prefix, sys.executable, str(TESTS / "writer_loop.py"), directory],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, ENV_HOST: "k"},
    )
    assert victim.stdout.readline().strip() == "ready"
    acknowledged = [int(victim.stdout.readline()) for _ in range(25)]
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    return acknowledged


def test_a_killed_writers_shard_is_sent_and_sealed_by_a_sync_on_its_machine(server, directory):
    acknowledged = killed_writer(directory)
    assert sync_on(server, "s", directory).returncode == 0  # nothing of walbuf runs on k again
    sent = [step for step, _ in rows_of(the_run(server), "victim")]
    assert sent[: len(acknowledged)] == acknowledged  # every acknowledged record, in order
    assert len(sent) == len(set(sent))  # each once
    assert (the_run(server).complete, the_run(server).exit_code) == (True, 1)  # its writer died
    assert files(directory, "live") == [] and len(files(directory, "sealed")) == 1  # no END: prune removes it


def test_a_sync_never_changes_the_shard_of_a_process_on_another_machine_and_sends_its_records(server, directory):
    acknowledged = killed_writer(directory, prefix=OTHER_MACHINE)
    (shard,) = (Path(directory) / "live" / "k").glob("*.log")
    before = shard.read_bytes()
    assert sync_on(server, "s", directory).returncode == 0
    assert shard.read_bytes() == before  # neither sealed nor moved: only its machine can tell its process ended
    sent = [step for step, _ in rows_of(the_run(server), "victim")]
    assert sent[: len(acknowledged)] == acknowledged and len(sent) == len(set(sent))
    assert the_run(server).complete is False  # heard of just now: taken for running


def test_a_writer_on_another_machine_silent_for_longer_than_the_dead_after_time_is_taken_for_dead(server, directory):
    victim = host_writer(directory, "k", "rk", 5, "stay", prefix=OTHER_MACHINE)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert sync_on(server, "s", directory).returncode == 0
    assert the_run(server).complete is False
    # The file server saw its last append long ago (tests/test_liveness.py: with clocks an hour off).
    (live,) = (Path(directory) / "live" / "k").glob("*.log")
    long_ago = time.time() - 120
    os.utime(live, (long_ago, long_ago))
    proc = run_sync(server, directory, env={ENV_HOST: "s", ENV_DEAD_AFTER: "61"})
    assert proc.returncode == 0, proc.stderr
    assert (the_run(server).complete, the_run(server).exit_code) == (True, 1)


def test_doctor_says_a_dead_writers_shard_with_records_waiting_needs_a_sync(directory):
    killed_writer(directory)
    with on_host("s"):
        (finding,) = [f for f in doctor(directory).findings if not f.ok]
    assert finding.check.startswith("shard k.") and "ended without sealing it" in finding.detail
    assert "run walbuf sync" in finding.advice


def test_prune_removes_ingested_shards_and_never_one_not_yet_ingested(server, directory):
    log_on("a", directory, "ra", 3)
    assert sync_on(server, "s", directory).returncode == 0
    log_on("b", directory, "rb", 2)  # sealed after the sync: not in the hub yet
    with on_host("c"), walbuf.Writer(directory, writer="rc", run="exp") as rc:
        rc.log({"i": 0})
        result = prune(directory, older_than=0)
        assert result.shards_removed == 1
        assert files(directory, "ingested") == []
        assert len(files(directory, "sealed")) == 1 and len(files(directory, "live")) == 1
    assert sync_on(server, "s", directory).returncode == 0
    assert steps_of(the_run(server), "rb") == [0, 1]


def test_prune_removes_a_dead_writers_sealed_shard_once_the_hub_holds_it(server, directory):
    victim = host_writer(directory, "k", "rk", 5, "stay")
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert prune(directory, older_than=0).shards_removed == 0  # live, and not in the hub
    assert sync_on(server, "s", directory).returncode == 0  # seals it: its process ended on this machine
    assert len(files(directory, "sealed")) == 1
    assert prune(directory, older_than=0).shards_removed == 1
    assert files(directory, "sealed") == [] and steps_of(the_run(server), "rk") == list(range(5))


def test_a_prune_that_finds_a_shard_gone_another_prune_removed_meanwhile_goes_on_and_exits_0(server, directory):
    # Two prunes at once (two cron jobs): strace stops the first just after
    # it removed the first of two ingested shards; the second prune removes
    # the other; then the first goes on and finds it gone.
    strace = require_strace()
    log_on("a", directory, "ra", 3)
    log_on("b", directory, "rb", 2)
    assert sync_on(server, "s", directory).returncode == 0
    first, _ = sorted(Path(directory, "ingested").glob("*.log"))
    trace = Path(directory).parent / "trace"
    inject = ["-P", str(first), "-e", "trace=unlink,unlinkat", "-e", "inject=unlink,unlinkat:signal=SIGSTOP:when=1"]
    stopped = subprocess.Popen(
        [strace, "-f", "-qq", "-o", str(trace), *inject, sys.executable, "-m", "walbuf", "prune", directory]
        + ["--older-than", "0s"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        stopped_pid = stopped_by_strace(trace, "the prune did not stop")
        assert prune(directory, older_than=0).shards_removed == 1
        os.kill(stopped_pid, signal.SIGCONT)
        out, err = stopped.communicate(timeout=120)
    finally:
        if stopped.poll() is None:
            stopped.kill()
            stopped.wait()
    assert stopped.returncode == 0, err
    assert files(directory, "ingested") == [] and files(directory, "sealed") == []
    assert doctor(directory).healthy


def test_a_hub_journal_that_is_a_link_is_never_rolled_back_by_a_writer_and_doctor_reports_it(server, directory):
    # A writer whose last holder died reads the hub, and rolls back a dead
    # sync's journal: never one that is a link (SQLite would copy what it
    # points at into the hub, and delete it).
    victim = host_writer(directory, "k", "ra", 5, "stay")
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert sync_on(server, "k", directory).returncode == 0
    victim = host_writer(directory, "k", "ra", 5, "stay")
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    elsewhere = Path(directory).parent / "elsewhere"
    elsewhere.write_bytes(bytes(range(256)) * 8)
    os.symlink(elsewhere, Path(directory, "hub.db-journal"))
    with pytest.raises(walbuf.UntrustedPathError, match="hub.db-journal"), on_host("k"):
        walbuf.Writer(directory, writer="ra", run="exp")
    assert elsewhere.read_bytes() == bytes(range(256)) * 8
    report = doctor(directory)
    (trust,) = [f for f in report.findings if f.check == "trust"]
    assert not trust.ok and "hub.db-journal" in trust.detail
    assert any(f.check.startswith("shard") for f in report.findings)  # and doctor went on to the shards


def hub_offset(directory):
    """The offset up to which the hub holds the one log shard it has a cursor of, read with plain sqlite3."""
    hub = sqlite3.connect(f"file:{Path(directory) / 'hub.db'}?mode=ro", uri=True)
    try:
        return hub.execute("SELECT max(offset) FROM log_cursors").fetchone()[0] or 0
    finally:
        hub.close()


def test_an_ingest_cut_off_by_a_write_error_copies_nothing_twice(server, directory):
    log_on("a", directory, "ra", 25_000)  # one sealed shard: three chunks of the hub's copy
    (shard,) = (Path(directory) / "sealed").glob("*.log")
    # The kernel refuses to grow any file by more than ~500 KB past the new hub's
    # size: the first chunk (~330 KB in the hub) commits, the second fails half-written.
    proc = run_sync(
        server,
        directory,
        env={ENV_HOST: "s"},
        prefix=[sys.executable, str(TESTS / "file_size_limit.py"), str(shard.stat().st_size // 2)],
    )
    assert proc.returncode not in (0, 75), proc.stderr
    assert 0 < hub_offset(directory) < shard.stat().st_size  # cut off midway
    assert len(files(directory, "sealed")) == 1  # not moved: its records are not all in the hub
    assert sync_on(server, "s", directory).returncode == 0
    assert steps_of(the_run(server), "ra") == list(range(25_000))  # each once, in order


def test_config_written_on_any_host_reaches_the_runs_config(server, directory):
    with on_host("a"), walbuf.Writer(directory, writer="ra", run="exp") as w:
        w.config({"lr": 0.1})
        w.log({"i": 0})
    with on_host("b"), walbuf.Writer(directory, writer="rb", run="exp") as w:
        w.config({"batch": 32})
    assert sync_on(server, "s", directory).returncode == 0
    assert sync_on(server, "s", directory).returncode == 0  # copies nothing again
    config = {k: v["value"] for k, v in the_run(server).config.items() if k != "_wandb"}
    assert config == {"lr": 0.1, "batch": 32}
    hub = sqlite3.connect(Path(directory) / "hub.db")
    assert hub.execute("SELECT count(*) FROM config_entries").fetchone()[0] == 2
    hub.close()


# -- hosts that die, idle writers, damaged and unreadable shards ---------------------------


def host_writer(directory, host, writer, n, then, *, env=None, stderr=None, prefix=()):
    """A writer process on ``host`` that has logged ``n`` records (see host_writer.py)."""
    proc = subprocess.Popen(
        [*prefix, sys.executable, str(TESTS / "host_writer.py"), directory, writer, str(n), then],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env={**os.environ, ENV_HOST: host, **(env or {})},
    )
    assert proc.stdout.readline().strip() == f"logged {n}"
    return proc


def test_an_idle_writers_records_arrive_while_it_stays_open_and_its_close_is_noted(server, directory):
    idle = host_writer(directory, "c", "rc", 300, "stay")
    assert sync_on(server, "login", directory).returncode == 0
    assert steps_of(the_run(server), "rc") == list(range(300))
    assert the_run(server).complete is False  # the writer is still open: the job runs on
    idle.stdin.close()
    assert idle.wait() == 0
    assert sync_on(server, "login", directory).returncode == 0
    assert the_run(server).exit_code == 0  # its close was noted: not taken for dead
    assert steps_of(the_run(server), "rc") == list(range(300))


def test_a_forked_child_appends_to_a_shard_of_its_own_and_both_arrive(server, directory):
    code = (
        "import os, sys, walbuf\n"
        "w = walbuf.Writer(sys.argv[1], writer='parent', run='exp')\n"
        "w.log({'i': 0})\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    with walbuf.Writer(sys.argv[1], writer='child', run='exp') as c:\n"
        "        c.log({'i': 0})\n"
        "    sys.exit(0)\n"
        "assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0\n"
        "w.log({'i': 1})\n"
        "w.close()\n"
    )
    subprocess.run([sys.executable, "-c", code, directory], check=True, env={**os.environ, ENV_HOST: "f"})
    assert len(files(directory, "sealed")) == 2 and files(directory, "live") == []
    assert sync_on(server, "login", directory).returncode == 0
    assert steps_of(the_run(server), "parent") == [0, 1] and steps_of(the_run(server), "child") == [0]


def test_the_records_of_a_host_that_closed_of_a_preempted_one_and_of_an_idle_one_arrive_from_the_login_host(
    server, directory
):
    closed = host_writer(directory, "a", "ra", 300, "close")
    assert closed.wait() == 0
    preempted = host_writer(directory, "b", "rb", 300, "stay", prefix=OTHER_MACHINE)
    preempted.send_signal(signal.SIGKILL)  # nothing of walbuf runs on b again
    preempted.wait()
    idle = host_writer(directory, "c", "rc", 300, "stay", prefix=OTHER_MACHINE)
    assert sync_on(server, "login", directory).returncode == 0  # syncs run on the login host only
    fake_run = the_run(server)
    assert [steps_of(fake_run, w) for w in ("ra", "rb", "rc")] == [list(range(300))] * 3  # each once, in order
    idle.stdin.close()
    assert idle.wait() == 0


def test_a_syncer_killed_while_taking_in_a_shard_then_a_sync_delivers_each_record_once(server, directory):
    preempted = host_writer(directory, "b", "rb", 20_000, "stay")
    preempted.send_signal(signal.SIGKILL)
    preempted.wait()
    syncer = subprocess.Popen(
        [sys.executable, "-m", "walbuf", "sync", directory],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env={**os.environ, **server.env(), ENV_HOST: "login"},
    )
    for line in syncer.stderr:
        if "taking in shard b." in line:
            break  # walbuf says so just before it reads the shard
    syncer.send_signal(signal.SIGKILL)
    syncer.wait()
    assert sync_on(server, "login", directory).returncode == 0
    assert steps_of(the_run(server), "rb") == list(range(20_000))


def test_a_shard_that_cannot_be_read_fails_the_sync_and_waits_for_the_next(server, directory):
    log_on("a", directory, "ra", 3)
    assert sync_on(server, "login", directory).returncode == 0
    log_on("b", directory, "rb", 3)
    (unreadable,) = files(directory, "sealed")
    path = Path(directory) / "sealed" / unreadable
    path.chmod(0)  # an injected I/O error: the file cannot be opened
    proc = subprocess.run(
        as_reader([sys.executable, "-m", "walbuf", "sync", directory, "--quiet"]),
        capture_output=True,
        text=True,
        env={**os.environ, **server.env(), ENV_HOST: "login"},
    )
    assert proc.returncode == 1 and "could not be opened" in proc.stderr, proc.stderr
    assert files(directory, "sealed") == [unreadable]  # neither ingested nor set aside
    assert steps_of(the_run(server), "rb") == []
    path.chmod(0o644)
    assert sync_on(server, "login", directory).returncode == 0
    assert steps_of(the_run(server), "rb") == [0, 1, 2]


def test_prune_checks_again_before_it_deletes_an_ingested_shard(server, directory):
    log_on("a", directory, "ra", 3)
    assert sync_on(server, "login", directory).returncode == 0  # the hub holds shard a's records
    log_on("b", directory, "rb", 3)
    (shard,) = files(directory, "sealed")
    # An ingested/ shard whose records the hub lacks (as a mistaken hand could leave it).
    os.replace(Path(directory) / "sealed" / shard, Path(directory) / "ingested" / shard)
    result = prune(directory, older_than=0)
    assert result.shards_removed == 1  # shard a's
    assert len(result.shards_kept) == 1 and "back to sealed" in result.shards_kept[0]
    assert files(directory, "sealed") == [shard]
    assert sync_on(server, "login", directory).returncode == 0
    assert steps_of(the_run(server), "rb") == [0, 1, 2]


def test_syncs_while_writers_move_to_new_shards_20_times_a_second_all_succeed_and_deliver_each_record_once(
    server, directory
):
    writers = [
        subprocess.Popen(
            [sys.executable, str(TESTS / "rotating_writer.py"), directory, f"w{i}"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, ENV_HOST: "h", ENV_ROTATE: "0.05"},
        )
        for i in range(2)
    ]
    try:
        for writer in writers:
            assert writer.stdout.readline() == "started\n"
        for _ in range(5):  # each sync reads live shards that their writers seal as it goes
            proc = sync_on(server, "h", directory)
            assert proc.returncode == 0, proc.stderr
    finally:
        for writer in writers:
            writer.stdin.close()
    logged = [int(writer.stdout.readline().split()[1]) for writer in writers]
    assert [writer.wait() for writer in writers] == [0, 0]
    assert sync_on(server, "h", directory).returncode == 0
    assert [steps_of(the_run(server), f"w{i}") for i in range(2)] == [list(range(n)) for n in logged]


def test_a_writer_that_failed_on_another_host_finishes_the_run_as_failed(server, directory):
    log_on("a", directory, "ra", 2)
    with pytest.raises(ZeroDivisionError), on_host("b"), walbuf.Writer(directory, writer="rb", run="exp") as w:
        w.log({"i": 0})
        raise ZeroDivisionError("the training step failed")
    assert sync_on(server, "a", directory).returncode == 0  # b's shard was sealed when rb closed
    assert (the_run(server).complete, the_run(server).exit_code) == (True, 1)


# -- an older walbuf's SQLite shards (tests/test_upgrade.py) ----------------------------------


def test_a_hub_that_fails_while_shards_are_taken_in_blames_no_shard(directory):
    log_on("a", directory, "ra", 3)
    log_on("b", directory, "rb", 3)
    layout = Layout(Path(directory))
    hub = walbuf.open_buffer(directory).open_store("create")
    with hub:
        # The hub's records table damaged from outside: its first insert fails as "malformed".
        conn = sqlite3.connect(layout.hub)
        (root,) = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = 'records'").fetchone()
        (size,) = conn.execute("PRAGMA page_size").fetchone()
        conn.close()
        with open(layout.hub, "r+b") as f:
            f.seek((root - 1) * size)
            f.write(b"\xee" * size)
        with pytest.raises(walbuf.BufferCorruptError, match="hub.db"):
            ingest(layout, hub)
    assert len(files(directory, "sealed")) == 2  # neither shard is blamed for the hub's damage, nor moved
    conn = sqlite3.connect(layout.hub)
    assert conn.execute("SELECT count(*) FROM log_cursors WHERE refused IS NOT NULL").fetchone() == (0,)
    conn.close()


def test_a_wal_an_older_walbuf_left_without_its_shard_is_reported_by_sync_and_doctor(server, directory):
    log_on("a", directory, "ra", 3)
    leftover = Path(directory) / "live" / "old" / f"{time.time_ns():020d}.db-wal"
    leftover.parent.mkdir(mode=0o700)
    leftover.write_bytes(b"frames of records committed after the shard was sealed")
    leftover.chmod(0o600)
    proc = sync_on(server, "s", directory, quiet=False)
    assert proc.returncode == 3 and "left without its shard" in proc.stderr, proc.stderr
    assert steps_of(the_run(server), "ra") == [0, 1, 2]
    with on_host("s"):
        (finding,) = [f for f in doctor(directory).findings if not f.ok]
    assert "left without its shard" in finding.detail
    assert leftover.exists()
