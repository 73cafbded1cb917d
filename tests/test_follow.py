"""`walbuf sync --follow`: records stream into W&B while the job runs, and the follow ends with it.

The follow and the writers run as processes of their own, against the fake
W&B server; each test waits on what the server holds or on a line a process
printed, never on time.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_sql, run_status, run_sync, wandb_cores

import walbuf

pytestmark = [pytest.mark.backends("sqlite"), pytest.mark.slow]

TESTS = Path(__file__).parent


def start_follow(server, buffer, *args, stderr=subprocess.PIPE):
    return subprocess.Popen(
        [sys.executable, "-m", "walbuf", "sync", str(buffer), "--follow", "--interval", "0.5", *args],
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env={**os.environ, **server.env()},
    )


def start_writer(buffer, writer="w"):
    return subprocess.Popen(
        [sys.executable, str(TESTS / "stdin_writer.py"), str(buffer), writer, "exp"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def log(writer, i):
    writer.stdin.write(f"{i}\n")
    writer.stdin.flush()
    assert writer.stdout.readline() == f"logged {i}\n"


def close(writer):
    writer.stdin.close()
    assert writer.stdout.readline() == "closed\n"
    assert writer.wait() == 0


def values(server):
    (fake_run,) = server.runs.values()
    return sorted(row["w/i"] for row in fake_run.history if "w/i" in row)


def test_records_stream_in_while_the_writer_is_open_and_the_follow_ends_with_the_job(server, buffer):
    follow = start_follow(server, buffer)  # before the job has made the buffer
    writer = start_writer(buffer)
    try:
        log(writer, 0)
        server.wait_for_rows(1, timeout=60)  # the follow sent it while the writer is open
        (fake_run,) = server.runs.values()
        assert server.state(fake_run.id) == "running" and not fake_run.complete
        log(writer, 1)
        server.wait_for_rows(2, timeout=60)
        close(writer)
        out, err = follow.communicate(timeout=120)
    finally:
        writer.kill()
        follow.kill()
    assert follow.returncode == 0, err
    assert "followed to the end" in out
    assert values(server) == [0, 1]
    assert server.state(fake_run.id) == "finished"


def test_a_cron_sync_during_a_follow_exits_11(server, buffer):
    writer = start_writer(buffer)
    follow = start_follow(server, buffer)
    try:
        log(writer, 0)
        server.wait_for_rows(1, timeout=60)  # the follow holds the sync lock by now
        assert run_sync(server, buffer).returncode == 11
        close(writer)
        assert follow.wait(timeout=120) == 0
    finally:
        writer.kill()
        follow.kill()


def test_sigterm_ends_a_follow_cleanly_and_the_next_sync_delivers_the_rest(server, buffer):
    writer = start_writer(buffer)
    follow = start_follow(server, buffer)
    try:
        log(writer, 0)
        server.wait_for_rows(1, timeout=60)
        follow.send_signal(signal.SIGTERM)
        _, err = follow.communicate(timeout=120)
        assert follow.returncode == 143 and "Traceback" not in err, err
        log(writer, 1)
        close(writer)
    finally:
        writer.kill()
        follow.kill()
    assert run_sync(server, buffer).returncode == 0
    assert set(values(server)) == {0, 1}


def test_a_follow_rides_out_w_and_b_going_down_and_nothing_is_lost(server, buffer):
    writer = start_writer(buffer)
    follow = start_follow(server, buffer)
    try:
        log(writer, 0)
        server.wait_for_rows(1, timeout=60)
        server.go_down()
        log(writer, 1)
        assert "the follow tries again" in follow.stderr.readline()  # a pass failed, and it goes on
        server.go_up()
        log(writer, 2)
        close(writer)
        out, err = follow.communicate(timeout=180)
        assert follow.returncode == 0, err
    finally:
        writer.kill()
        follow.kill()
    assert set(values(server)) == {0, 1, 2}


def history_streams(server):
    """The wandb processes' streams that sent the run's history: one per wandb.init of it."""
    (fake_run,) = server.runs.values()
    return {stream for stream, name in fake_run.lines if name == "wandb-history.jsonl"}


def pending(buffer):
    return sum(w["pending"] for r in run_status(buffer)["runs"] for w in r["writers"])


def test_a_follows_passes_send_into_one_w_and_b_run_kept_open(server, buffer):
    writer = start_writer(buffer)
    follow = start_follow(server, buffer)
    try:
        for i in range(3):
            log(writer, i)  # after the last arrived: each record is a pass of its own
            server.wait_for_rows(i + 1, timeout=60)
        assert len(history_streams(server)) == 1  # one wandb.init, not one per pass
        close(writer)
        out, err = follow.communicate(timeout=120)
    finally:
        writer.kill()
        follow.kill()
    assert follow.returncode == 0, err
    assert values(server) == [0, 1, 2]
    (fake_run,) = server.runs.values()
    assert server.state(fake_run.id) == "finished"


def test_a_kept_run_whose_posts_fail_marks_nothing_synced(server, buffer):
    writer = start_writer(buffer)
    follow = start_follow(server, buffer, stderr=subprocess.STDOUT)  # what the next pass says, in order
    try:
        log(writer, 0)
        assert "1 record synced" in follow.stdout.readline()  # the run is kept open
        server.fail_with(500, "file_stream")
        log(writer, 1)
        assert "the follow tries again" in follow.stdout.readline()  # not "1 record synced"
        assert pending(buffer) == 1
        server.fail_with(None)
        close(writer)
        out, err = follow.communicate(timeout=180)
    finally:
        writer.kill()
        follow.kill()
    assert follow.returncode == 0, err
    assert values(server) == [0, 1]
    assert pending(buffer) == 0


def test_a_follow_killed_with_its_run_kept_open_loses_and_repeats_nothing(server, buffer):
    writer = start_writer(buffer)
    follow = start_follow(server, buffer)
    try:
        log(writer, 0)
        assert "1 record" in follow.stdout.readline()  # synced: the run is kept open
        follow.kill()
        follow.wait()
        log(writer, 1)
        close(writer)
    finally:
        writer.kill()
        follow.kill()
    assert run_sync(server, buffer).returncode == 0
    assert values(server) == [0, 1]  # each once
    (fake_run,) = server.runs.values()
    assert server.state(fake_run.id) == "finished"


def test_follow_takes_no_bounds_or_offline_mode(server, buffer):
    for args in (["--max-seconds", "5"], ["--mode", "offline"], ["--dry-run"]):
        proc = subprocess.run(
            [sys.executable, "-m", "walbuf", "sync", str(buffer), "--follow", *args],
            capture_output=True,
            text=True,
            env={**os.environ, **server.env()},
        )
        assert proc.returncode == 2 and "--follow" in proc.stderr


def test_a_follow_restarts_wandbs_service_after_every_renew_every_uploads(in_process, buffer):
    # wandb-core keeps memory for each run it served: a follow of days must not keep one wandb-core.
    import walbuf

    writer = start_writer(buffer)
    log(writer, 0)
    cores = []

    def on_pass(done):
        cores.append(wandb_cores(os.getpid()))
        if len(cores) < 4:
            log(writer, len(cores))  # one more record: the next pass uploads again
        elif not writer.stdin.closed:
            close(writer)  # the job ends: the follow finishes the run and returns

    try:
        result = walbuf.follow(buffer, interval=0.1, renew_every=2, on_pass=on_pass)
    finally:
        writer.kill()
    assert result.records == 4 and result.finished == ("exp",)
    seen = set().union(*cores)
    assert len(seen) >= 2, cores  # uploads 1-2 on one wandb-core, 3-4 on another


def test_a_follow_of_a_buffer_not_made_yet_says_what_it_waits_for_and_a_mistyped_folder(server, tmp_path):
    mistyped = tmp_path / "rusn" / "exp1.db"  # its folder does not exist either
    follow = start_follow(server, mistyped)
    try:
        line = follow.stderr.readline()
        assert f"waiting for a writer to make {mistyped}" in line
        assert f"not even its folder {mistyped.parent} exists yet" in line
        follow.send_signal(signal.SIGINT)
        _, err = follow.communicate(timeout=120)
    finally:
        follow.kill()
    assert follow.returncode == 130, err
    assert "if it was uploading" in err and "an upload it cut off" not in err


def test_a_follow_that_quarantined_a_record_warns_and_exits_3_as_a_sync_does(server, buffer):
    with walbuf.Writer(buffer, writer="w", run="exp") as w:
        w.log({"i": 0})
        (writer_id,) = run_sql(buffer, "SELECT id FROM writers WHERE name = 'w'")[0]
        # A record an older walbuf let in, which W&B would refuse for good.
        run_sql(
            buffer,
            "INSERT INTO records (writer_id, step, time, metrics) VALUES (:w, 1, 0, :m)",
            {"w": writer_id, "m": '{"_step": 1}'},
        )
    follow = start_follow(server, buffer)  # the writer closed: the follow ends after one pass
    _, err = follow.communicate(timeout=120)
    assert follow.returncode == 3, err
    assert "quarantined w step 1" in err and "walbuf records" in err
    assert values(server) == [0]
