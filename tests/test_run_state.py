"""The state of the W&B run follows the job: running while a writer may log, then finished or failed.

Syncs run as cron runs them, in processes of their own, against the fake
W&B server; assertions are on the state the fake ends with.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_sync, the_run
from wandb_server import STALE_SECONDS

import walbuf

pytestmark = [pytest.mark.backends("sqlite", "postgresql"), pytest.mark.slow]

TESTS = Path(__file__).parent
# What a primary writer uploads about its host and environment: not the job's, from a syncer.
HOST_FILES = {"wandb-metadata.json", "requirements.txt", "config.yaml", "wandb-summary.json"}


def test_a_job_with_a_writer_open_stays_running_through_syncs(server, buffer):
    with walbuf.Writer(buffer, writer="train", run="exp") as w:
        for step in range(3):
            w.log({"loss": 1.0 / (step + 1)})
            assert run_sync(server, buffer).returncode == 0
        fake_run = the_run(server, buffer)
        assert not fake_run.complete
        assert not HOST_FILES & set(fake_run.files)  # the syncer's host is not the run's


def test_between_syncs_a_job_still_running_shows_preempted_never_crashed(server, buffer):
    with walbuf.Writer(buffer, writer="train", run="exp") as w:
        w.log({"loss": 1.0})
        assert run_sync(server, buffer).returncode == 0
        fake_run = the_run(server, buffer)
        assert server.state(fake_run.id) == "preempting"
        server.advance(STALE_SECONDS)  # the next cron sync is far off
        assert server.state(fake_run.id) == "preempted"
        w.log({"loss": 0.5})
        assert run_sync(server, buffer).returncode == 0
        assert server.state(fake_run.id) == "preempting"
    assert run_sync(server, buffer).returncode == 0
    server.advance(STALE_SECONDS)
    assert server.state(fake_run.id) == "finished"


def test_the_fake_marks_a_run_crashed_once_it_heard_nothing_for_5_minutes(server, tmp_path):
    """The server's rule the test above holds walbuf to, shown with wandb's own shared-mode writer."""
    code = (
        "import wandb\n"
        "run = wandb.init(id='quiet1', project='p', settings=wandb.Settings(mode='shared', x_primary=False,"
        " x_update_finish_state=False, console='off', silent=True))\n"
        "run.log({'loss': 1.0})\n"
        "run.finish()\n"
    )
    env = {k: v for k, v in {**os.environ, **server.env()}.items() if k != "WANDB_SERVICE"}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert server.state("quiet1") == "running"
    server.advance(STALE_SECONDS)
    assert server.state("quiet1") == "crashed"


def test_closing_every_writer_then_syncing_finishes_the_run_with_exit_code_0(server, buffer):
    with walbuf.Writer(buffer, writer="train", run="exp") as w:
        w.log({"loss": 1.0})
        assert run_sync(server, buffer).returncode == 0
    with walbuf.Writer(buffer, writer="eval", run="exp") as w:
        w.log({"acc": 0.5})
    proc = run_sync(server, buffer, quiet=False)
    assert proc.returncode == 0, proc.stderr
    assert "finished the W&B run with exit code 0" in proc.stdout
    fake_run = the_run(server, buffer)
    assert (fake_run.complete, fake_run.exit_code) == (True, 0)
    assert not HOST_FILES & set(fake_run.files)


def test_a_writer_killed_without_closing_makes_the_final_state_failed(server, buffer):
    with walbuf.Writer(buffer, writer="survivor", run="crash") as w:
        w.log({"x": 1})
    victim = subprocess.Popen(
        [sys.executable, str(TESTS / "writer_loop.py"), str(buffer)], stdout=subprocess.PIPE, text=True
    )
    assert victim.stdout.readline().strip() == "ready"
    victim.stdout.readline()  # it logged a record
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert run_sync(server, buffer).returncode == 0
    fake_run = the_run(server, buffer, run="crash")
    assert (fake_run.complete, fake_run.exit_code) == (True, 1)


def test_an_exception_leaving_the_writers_with_block_makes_the_final_state_failed(server, buffer):
    with pytest.raises(ZeroDivisionError), walbuf.Writer(buffer, writer="train", run="exp") as w:
        w.log({"loss": 1.0})
        raise ZeroDivisionError("the training step failed")
    proc = run_sync(server, buffer, quiet=False)
    assert proc.returncode == 0, proc.stderr
    assert "finished the W&B run with exit code 1: 'train' failed or died without closing" in proc.stdout
    fake_run = the_run(server, buffer)
    assert (fake_run.complete, fake_run.exit_code) == (True, 1)


def test_a_writer_that_opens_again_after_failing_and_closes_finishes_the_run_as_closed(server, buffer):
    with pytest.raises(ZeroDivisionError), walbuf.Writer(buffer, writer="train", run="exp") as w:
        w.log({"loss": 2.0})
        raise ZeroDivisionError("the training step failed")
    with walbuf.Writer(buffer, writer="train", run="exp") as w:
        w.log({"loss": 1.0})  # the job retried, and succeeded
    assert run_sync(server, buffer).returncode == 0
    fake_run = the_run(server, buffer)
    assert (fake_run.complete, fake_run.exit_code) == (True, 0)


def test_a_finished_run_is_not_finished_again_until_a_writer_opens_again(server, buffer):
    with walbuf.Writer(buffer, writer="train", run="exp") as w:
        w.log({"loss": 0.5})
    assert run_sync(server, buffer).returncode == 0
    fake_run = the_run(server, buffer)
    finishes = len(fake_run.upserts)
    assert run_sync(server, buffer).returncode == 0  # done, and said so: nothing to do
    assert len(fake_run.upserts) == finishes


def test_the_display_name_is_given_once_and_a_rename_in_wandb_stays(server, buffer):
    with walbuf.Writer(buffer, writer="train", run="exp") as w:
        w.log({"loss": 1.0})
        assert run_sync(server, buffer).returncode == 0
        fake_run = the_run(server, buffer)
        assert fake_run.display_name == "exp"
        server.rename(fake_run.id, "my best run")
        w.log({"loss": 0.5})
        assert run_sync(server, buffer).returncode == 0
    assert run_sync(server, buffer).returncode == 0
    assert fake_run.display_name == "my best run"


def test_a_sync_killed_mid_upload_leaves_the_run_running(server, buffer):
    with walbuf.Writer(buffer, writer="train", run="exp") as w:
        for step in range(50):
            w.log({"loss": float(step)})
    server.hold_uploads()
    syncer = subprocess.Popen(
        [sys.executable, "-m", "walbuf", "sync", str(buffer), "--quiet"], env={**os.environ, **server.env()}
    )
    server.wait_for_rows(1, timeout=60)
    syncer.send_signal(signal.SIGKILL)
    syncer.wait()
    server.release_uploads()
    (fake_run,) = server.runs.values()
    assert not fake_run.complete


@pytest.mark.parametrize("kind", ["sqlite", "directory"])
def test_a_close_the_buffer_could_not_take_finishes_the_run_as_closed_not_as_died(server, tmp_path, kind):
    # The writer's process may not write past byte 16 of any file any more
    # (RLIMIT_FSIZE, set from outside by prlimit(1)): as on a full disk, the
    # database refuses the close note; the note beside the lock fits.
    buffer = tmp_path / ("metrics.db" if kind == "sqlite" else "metrics/")
    job = subprocess.Popen(
        [sys.executable, str(TESTS / "stdin_writer.py"), str(buffer), "train", "exp"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    job.stdin.write("1\n")
    job.stdin.flush()
    assert job.stdout.readline() == "logged 1\n"
    subprocess.run(["prlimit", f"--pid={job.pid}", "--fsize=16"], check=True)
    out, err = job.communicate(timeout=60)
    assert out == "closed\n" and job.returncode == 0, err
    assert "disk I/O error" in err  # the database refused the close note
    proc = run_sync(server, buffer, quiet=False)
    assert proc.returncode == 0, proc.stderr
    fake_run = the_run(server, buffer)
    assert (fake_run.complete, fake_run.exit_code) == (True, 0)
    assert [row["train/i"] for row in fake_run.history] == [1]


def test_a_writer_killed_after_it_had_closed_once_makes_the_final_state_failed(server, tmp_path):
    # Its first close left "closed 0" beside the lock; opening again must take that back.
    buffer = tmp_path / "metrics.db"
    with walbuf.Writer(buffer, writer="train", run="exp") as w:
        w.log({"i": 0})
    job = subprocess.Popen(
        [sys.executable, str(TESTS / "stdin_writer.py"), str(buffer), "train", "exp"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    job.stdin.write("1\n")
    job.stdin.flush()
    assert job.stdout.readline() == "logged 1\n"
    job.kill()
    job.wait()
    assert run_sync(server, buffer).returncode == 0
    fake_run = the_run(server, buffer)
    assert (fake_run.complete, fake_run.exit_code) == (True, 1)
