"""Directory buffers: each host writes only its own shards, and sealed shards reach W&B from any host.

Hosts are faked with WALBUF_HOST, which names the shard a process writes.
Syncs run as `walbuf sync` processes against the W&B fake; every assertion
about uploads is on what the fake received.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

import pytest
from conftest import as_reader, rows_of, run_sync, walbuf_says

import walbuf
from walbuf import doctor, prune
from walbuf.directory.layout import ENV_HOST, ENV_ROTATE, Layout
from walbuf.directory.lease import in_use

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


def files(directory, part):
    return sorted(p.name for p in (Path(directory) / part).rglob("*.db"))


def sync_on(server, host, directory, *args, quiet=True):
    return run_sync(server, directory, *args, env={ENV_HOST: host}, quiet=quiet)


def status_on(host, directory):
    proc = subprocess.run(
        [sys.executable, "-m", "walbuf", "status", directory, "--json"],
        capture_output=True,
        text=True,
        env={**os.environ, ENV_HOST: host},
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def the_run(server):
    (fake_run,) = server.runs.values()
    return fake_run


def steps_of(fake_run, writer):
    return [metrics["i"] for _, metrics in rows_of(fake_run, writer)]


def test_each_host_writes_a_live_shard_of_its_own(directory):
    with on_host("a"), walbuf.Writer(directory, writer="ra"), on_host("b"), walbuf.Writer(directory, writer="rb"):
        assert [p.parent.name for p in sorted((Path(directory) / "live").rglob("*.db"))] == ["a", "b"]
        assert files(directory, "sealed") == []


def test_the_last_writer_to_close_seals_the_shard(directory):
    log_on("a", directory, "ra", 3)
    (sealed,) = (Path(directory) / "sealed").glob("a.*.db")
    assert files(directory, "live") == []
    assert not Path(f"{sealed}-wal").exists() and not Path(f"{sealed}-shm").exists()
    # The file format's read and write versions (header bytes 18 and 19):
    # 2 in WAL mode, 1 in rollback mode. (A connection opened with immutable=1
    # reports "delete" for either.)
    assert sealed.read_bytes()[18:20] == b"\x01\x01"
    conn = sqlite3.connect(f"file:{sealed}?mode=ro&immutable=1", uri=True)
    assert conn.execute("SELECT count(*) FROM records").fetchone()[0] == 3
    conn.close()


def test_a_shard_another_process_uses_is_not_sealed(directory):
    with on_host("a"):
        walbuf.Writer(directory, writer="first").close()  # the buffer, and one sealed shard
        # A use of the shard with no SQLite connection open on it, so that
        # nothing but walbuf's own check keeps it from being sealed.
        keeper = walbuf.open_buffer(directory).hold_shard()
        log_on("a", directory, "brief", 1)
        assert len(files(directory, "live")) == 1 and len(files(directory, "sealed")) == 1
        keeper.release()
    assert len(files(directory, "live")) == 0 and len(files(directory, "sealed")) == 2


def test_writers_move_to_a_new_shard_when_theirs_expires(directory, monkeypatch):
    monkeypatch.setenv(ENV_ROTATE, "1e-9")  # every log() finds its shard expired
    log_on("a", directory, "ra", 3)
    sealed = sorted((Path(directory) / "sealed").glob("a.*.db"))
    assert len(sealed) >= 3
    steps = []
    for path in sealed:
        conn = sqlite3.connect(f"file:{path}?mode=ro&immutable=1", uri=True)
        steps += [row[0] for row in conn.execute("SELECT step FROM records ORDER BY id")]
        conn.close()
    assert steps == [0, 1, 2]


def test_a_writer_reopened_in_a_new_shard_continues_its_steps(directory):
    log_on("a", directory, "ra", 3)
    with on_host("a"), walbuf.Writer(directory, writer="ra", run="exp") as w:
        assert w.last_step == 2 and w.log({"i": 3}) == 3


def test_a_writer_id_is_owned_across_hosts(directory):
    with on_host("a"), walbuf.Writer(directory, writer="rank-0", run="exp"):
        with on_host("b"), pytest.raises(walbuf.WriterConflictError):
            walbuf.Writer(directory, writer="rank-0", run="exp")


def test_read_sees_sealed_shards_and_this_hosts_live_one(directory):
    log_on("a", directory, "ra", 2)
    with on_host("b"), walbuf.Writer(directory, writer="rb", run="exp") as rb:
        rb.log({"i": 10})
        with on_host("b"):
            assert [(r.writer, r.step) for r in walbuf.read(directory)] == [("ra", 0), ("ra", 1), ("rb", 0)]
        with on_host("c"):  # b's live shard is not c's to read
            assert [(r.writer, r.step) for r in walbuf.read(directory)] == [("ra", 0), ("ra", 1)]


def test_a_sync_on_another_host_sends_sealed_shards_and_never_opens_live_ones_in_use(server, directory):
    log_on("a", directory, "ra", 3)
    with on_host("b"), walbuf.Writer(directory, writer="rb", run="exp") as rb:
        rb.log({"i": 100})
        # Another host's live shard in use, that is not even a database: opening it would fail the sync.
        planted = Path(directory) / "live" / "c" / f"{1:020d}.db"
        planted.parent.mkdir(parents=True)
        planted.write_bytes(b"not a database, and not ours to open" * 100)
        with open(f"{planted}.inuse", "w") as user:
            fcntl.flock(user, fcntl.LOCK_SH)  # as a process of host c using it would
            proc = sync_on(server, "s", directory)
            assert proc.returncode == 0, proc.stderr
            assert steps_of(the_run(server), "ra") == [0, 1, 2]
            assert steps_of(the_run(server), "rb") == []
            waiting = {s["host"]: s["not_in_hub"] for s in status_on("s", directory)["shards"]}
            assert waiting == {"b": None, "c": None}
    assert sync_on(server, "s", directory).returncode == 3  # b's shard is sealed now; c's is set aside
    assert steps_of(the_run(server), "ra") == [0, 1, 2]
    assert steps_of(the_run(server), "rb") == [100]
    assert not planted.exists() and len(files(directory, "quarantine")) == 1


def test_a_dry_run_counts_the_shards_records_and_copies_nothing_into_the_hub(server, directory):
    log_on("a", directory, "ra", 3)
    assert sync_on(server, "s", directory).returncode == 0
    log_on("a", directory, "ra", 2, start=3)
    with on_host("b"), walbuf.Writer(directory, writer="rb", run="exp") as rb:
        rb.log({"i": 100})
        proc = sync_on(server, "s", directory, "--dry-run", quiet=False)
        assert proc.returncode == 0, proc.stderr
        assert "and 2 records of shards not yet in the hub" in proc.stdout
        assert "1 live shards of other hosts are not readable" in proc.stdout
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


def test_a_killed_writers_shard_is_sealed_and_sent_by_a_sync_on_another_host(server, directory):
    victim = subprocess.Popen(
        [sys.executable, str(TESTS / "writer_loop.py"), directory],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, ENV_HOST: "k"},
    )
    assert victim.stdout.readline().strip() == "ready"
    acknowledged = [int(victim.stdout.readline()) for _ in range(25)]
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert sync_on(server, "s", directory).returncode == 0  # nothing of walbuf runs on k again
    sent = [step for step, _ in rows_of(the_run(server), "victim")]
    assert sent[: len(acknowledged)] == acknowledged  # every acknowledged record, in order
    assert len(sent) == len(set(sent))  # each once
    assert files(directory, "live") == [] and len(files(directory, "ingested")) == 1


def test_doctor_says_a_dead_writers_shard_needs_a_sync_from_any_host(directory):
    victim = subprocess.Popen(
        [sys.executable, str(TESTS / "writer_loop.py"), directory],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, ENV_HOST: "k"},
    )
    assert victim.stdout.readline().strip() == "ready"
    victim.stdout.readline()
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    with on_host("k"):
        (here,) = [f for f in doctor(directory).findings if not f.ok]
    with on_host("s"):
        (elsewhere,) = [f for f in doctor(directory).findings if not f.ok]
    assert here.check.startswith("shard k.") and "run walbuf sync on this host" in here.advice
    assert elsewhere.check == here.check and "run walbuf sync (on any host)" in elsewhere.advice


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


def hub_cursor(directory, writer):
    """The shard id of the last record of ``writer`` the hub holds (0: none), read with plain sqlite3."""
    hub = sqlite3.connect(f"file:{Path(directory) / 'hub.db'}?mode=ro", uri=True)
    try:
        row = hub.execute("SELECT max(last_id) FROM shard_cursors WHERE writer = ?", (writer,)).fetchone()
    finally:
        hub.close()
    return row[0] or 0


def test_an_ingest_cut_off_by_a_write_error_copies_nothing_twice(server, directory):
    log_on("a", directory, "first", 1)
    assert sync_on(server, "s", directory).returncode == 0  # the hub exists now
    log_on("a", directory, "ra", 25_000)  # one sealed shard: three chunks of the hub's copy
    # The kernel refuses to grow any file by more than ~500 KB: the first chunk
    # (~330 KB in the hub) commits, the second fails half-written.
    limit = (Path(directory) / "hub.db").stat().st_size + 500_000
    proc = run_sync(
        server,
        directory,
        env={ENV_HOST: "s"},
        prefix=[sys.executable, str(TESTS / "file_size_limit.py"), str(limit)],
    )
    assert proc.returncode not in (0, 75), proc.stderr
    assert 0 < hub_cursor(directory, "ra") < 25_000  # cut off midway
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


# -- hosts that die, damaged and unreadable shards ------------------------------------


def host_writer(directory, host, writer, n, then, *, env=None, stderr=None):
    """A writer process on ``host`` that has logged ``n`` records (see host_writer.py)."""
    proc = subprocess.Popen(
        [sys.executable, str(TESTS / "host_writer.py"), directory, writer, str(n), then],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env={**os.environ, ENV_HOST: host, **(env or {})},
    )
    assert proc.stdout.readline().strip() == f"logged {n}"
    return proc


def idle_writer(directory, host, writer, n):
    """A writer process on ``host`` that logged ``n`` records, stays open, and has let go of its shard since."""
    proc = host_writer(directory, host, writer, n, "stay", env={ENV_ROTATE: "1"}, stderr=subprocess.PIPE)
    # If it never says so, the watchdog ends it, and the loop with it: only a failing test waits for it.
    watchdog = threading.Timer(120, proc.kill)
    watchdog.start()
    try:
        logged = False
        for line in proc.stderr:
            logged = logged or line.strip() == f"logged {n}"
            if logged and "let go of its shard" in line:  # of the shard it logged into last
                return proc
    finally:
        watchdog.cancel()
    pytest.fail(f"writer {writer!r} on {host} never let go of its shard")


def test_a_writer_that_stays_open_and_idle_lets_go_of_its_shard_and_a_sync_on_another_host_sends_its_records(
    server, directory
):
    idle = idle_writer(directory, "c", "rc", 300)
    assert sync_on(server, "login", directory).returncode == 0
    assert steps_of(the_run(server), "rc") == list(range(300))
    assert the_run(server).complete is False  # the writer is still open: the job runs on
    idle.stdin.close()  # it closes with no shard open
    assert idle.wait() == 0
    assert sync_on(server, "login", directory).returncode == 0
    assert the_run(server).exit_code == 0  # its close was noted: not taken for dead
    assert steps_of(the_run(server), "rc") == list(range(300))


def test_an_idle_writer_that_logs_again_continues_in_a_new_shard_and_its_close_is_noted(server, directory, monkeypatch):
    with on_host("c"), walbuf_says("let go of its shard") as let_go:
        monkeypatch.setenv(ENV_ROTATE, "1")
        w = walbuf.Writer(directory, writer="rc", run="exp")
        w.log({"i": 0})
        # Until it let go of the shard it logged into (on a slow machine the
        # shard it opened may expire before the log(), which then opens another).
        while files(directory, "live"):
            assert let_go.wait(120), "the writer never let go of its shard"
            let_go.clear()
        assert files(directory, "sealed")  # it was the shard's last user: sealed
        monkeypatch.delenv(ENV_ROTATE)
        w.log({"i": 1})
        assert len(files(directory, "live")) == 1  # a new shard
        w.close()
    assert sync_on(server, "login", directory).returncode == 0
    assert steps_of(the_run(server), "rc") == [0, 1]
    assert the_run(server).exit_code == 0  # its close was noted: not taken for dead


def test_a_fork_waits_while_the_expiry_thread_lets_go_of_a_shard_and_the_child_logs_and_exits(directory):
    proc = subprocess.Popen(
        [sys.executable, str(TESTS / "fork_while_letting_go.py"), directory],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, ENV_HOST: "f", ENV_ROTATE: "1"},
        start_new_session=True,
    )
    # Only a failing test waits for it: it ends the process and a child it forked (which may hang).
    watchdog = threading.Timer(120, os.killpg, (proc.pid, signal.SIGKILL))
    watchdog.start()
    try:
        while True:
            proc.stdin.write("log\n")
            proc.stdin.flush()
            shard = Path(proc.stdout.readline().strip())
            # With the host's rotate.lock held here, letting go of a shard that is
            # still in use cannot end: the expiry thread waits for the lock to seal it.
            rotate_lock = os.open(shard.parent / "rotate.lock", os.O_RDWR | os.O_CREAT)
            fcntl.flock(rotate_lock, fcntl.LOCK_EX)
            if in_use(Layout(Path(directory)), shard):
                break
            os.close(rotate_lock)  # it expired already: log into a new one
        proc.stdin.write("fork\n")
        proc.stdin.flush()
        for line in proc.stderr:
            if "fork waits for walbuf's expiry thread" in line:
                break
        os.close(rotate_lock)  # the expiry thread seals the shard; then the fork goes on
        assert proc.stdout.readline().strip() == "child 0"
        assert proc.wait() == 0
    finally:
        watchdog.cancel()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert [r.writer for r in walbuf.read(directory)].count("child") == 1


def test_the_records_of_a_host_that_closed_of_a_preempted_one_and_of_an_idle_one_arrive_from_the_login_host(
    server, directory
):
    closed = host_writer(directory, "a", "ra", 300, "close")
    assert closed.wait() == 0
    preempted = host_writer(directory, "b", "rb", 300, "stay")
    preempted.send_signal(signal.SIGKILL)  # nothing of walbuf runs on b again
    preempted.wait()
    idle = idle_writer(directory, "c", "rc", 300)
    assert sync_on(server, "login", directory).returncode == 0  # syncs run on the login host only
    fake_run = the_run(server)
    assert [steps_of(fake_run, w) for w in ("ra", "rb", "rc")] == [list(range(300))] * 3  # each once, in order
    idle.stdin.close()
    assert idle.wait() == 0


def test_a_syncer_killed_while_sealing_another_hosts_shard_then_a_sync_delivers_each_record_once(server, directory):
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
        if "sealing shard b." in line:
            break  # walbuf says so just before it opens the shard
    syncer.send_signal(signal.SIGKILL)
    syncer.wait()
    assert sync_on(server, "login", directory).returncode == 0
    assert steps_of(the_run(server), "rb") == list(range(20_000))


def damage(path):
    """Overwrite a database file's header: SQLite then says "file is not a database"."""
    with open(path, "r+b") as f:
        f.write(b"\xff" * 100)


def test_a_damaged_sealed_shard_is_set_aside_and_the_other_shards_arrive(server, directory):
    log_on("a", directory, "ra", 3)
    log_on("b", directory, "rb", 3)
    (damaged,) = [p for p in (Path(directory) / "sealed").iterdir() if p.name.startswith("b.")]
    damage(damaged)
    proc = sync_on(server, "login", directory)
    assert proc.returncode == 3 and "quarantine" in proc.stderr, proc.stderr
    assert steps_of(the_run(server), "ra") == [0, 1, 2] and steps_of(the_run(server), "rb") == []
    assert files(directory, "quarantine") == [damaged.name]
    (shown,) = status_on("login", directory)["damaged_shards"]
    assert shown.startswith(damaged.stem + ": ") and "not a database" in shown
    with on_host("login"):
        (finding,) = [f for f in doctor(directory).findings if not f.ok]
    assert "quarantine" in finding.detail and ".recover" in finding.advice


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
    assert proc.returncode == 1 and "could not be read" in proc.stderr, proc.stderr
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
    # An ingested/ shard whose records the hub lacks (as an older walbuf could leave it).
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
