"""walbuf sync, as cron runs it, against a fake W&B server the real wandb SDK talks to.

Every assertion about uploads is on what the fake server received.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from conftest import rows_of, run_sql, run_status, run_sync, the_run

import walbuf
from walbuf.syncer.syncer import _this_process
from walbuf.syncer.upload import READ_CHUNK

pytestmark = [pytest.mark.backends("sqlite", "postgresql"), pytest.mark.slow]

TESTS = Path(__file__).parent


def pending(buffer):
    return {(r["run"], w["writer"]): w["pending"] for r in run_status(buffer)["runs"] for w in r["writers"]}


def log_records(buffer, writer, n, *, run="exp1", start=0, axis="step", **target):
    with walbuf.Writer(buffer, writer=writer, run=run, step_axis=axis, **target) as w:
        for i in range(start, start + n):
            w.log({"loss": 1.0 / (i + 1), "i": i})


def test_every_record_arrives_once_on_its_writers_axis(server, buffer):
    log_records(buffer, "rank-0", 5)
    log_records(buffer, "rank-1", 3)
    log_records(buffer, "eval", 2, axis="eval_step")
    proc = run_sync(server, buffer, "--project", "proj", "--entity", "ent")
    assert proc.returncode == 0, proc.stderr
    fake_run = the_run(server, buffer)
    assert rows_of(fake_run, "rank-0") == [(i, {"loss": 1.0 / (i + 1), "i": i}) for i in range(5)]
    assert rows_of(fake_run, "rank-1") == [(i, {"loss": 1.0 / (i + 1), "i": i}) for i in range(3)]
    assert [step for step, _ in rows_of(fake_run, "eval", axis="eval_step")] == [0, 1]
    assert len(fake_run.history) == 10
    assert pending(buffer) == {("exp1", "rank-0"): 0, ("exp1", "rank-1"): 0, ("exp1", "eval"): 0}


def test_two_writers_logging_the_same_key_stay_apart(server, buffer):
    log_records(buffer, "rank-0", 2)
    log_records(buffer, "rank-1", 2)
    assert run_sync(server, buffer).returncode == 0
    keys = set().union(*the_run(server, buffer).history)
    assert {"rank-0/loss", "rank-1/loss", "rank-0/step", "rank-1/step"} <= keys
    assert "loss" not in keys


def test_each_metric_is_declared_on_its_writers_step_axis(server, buffer):
    log_records(buffer, "rank-0", 2)
    log_records(buffer, "eval", 1, axis="eval_step")
    assert run_sync(server, buffer).returncode == 0
    fake_run = the_run(server, buffer)
    assert fake_run.step_metric_of("rank-0/loss") == "rank-0/step"
    assert fake_run.step_metric_of("rank-0/i") == "rank-0/step"
    assert fake_run.step_metric_of("eval/loss") == "eval/eval_step"


def test_a_later_sync_declares_the_metrics_of_earlier_ones_again(server, buffer):
    log_records(buffer, "rank-0", 2)
    assert run_sync(server, buffer).returncode == 0
    with walbuf.Writer(buffer, writer="eval", run="exp1") as w:
        w.log({"acc": 0.5})
    assert run_sync(server, buffer).returncode == 0
    fake_run = the_run(server, buffer)
    assert (
        fake_run.step_metric_of("rank-0/loss") == "rank-0/step" and fake_run.step_metric_of("eval/acc") == "eval/step"
    )


def test_dots_in_writer_ids_and_keys_are_literal_in_metric_definitions(server, buffer):
    with walbuf.Writer(buffer, writer="node1.cluster-7", run="exp1") as w:
        w.log({"val.acc": 0.5})
    assert run_sync(server, buffer).returncode == 0
    fake_run = the_run(server, buffer)
    (row,) = fake_run.history
    assert row["node1.cluster-7/val.acc"] == 0.5 and "node1" not in row  # no nested copy of the axis
    assert fake_run.step_metric_of("node1.cluster-7/val.acc") == "node1.cluster-7/step"
    assert "node1\\.cluster-7/*" in fake_run.metric_definitions()  # the dot is escaped: literal


def test_values_of_every_kind_arrive(server, buffer):
    with walbuf.Writer(buffer, writer="w", run="exp1") as w:
        w.log(
            {
                "int": 3,
                "float": 0.25,
                "nan": float("nan"),
                "inf": float("inf"),
                "flag": True,
                "text": "hi",
                "none": None,
            }
        )
    assert run_sync(server, buffer).returncode == 0
    ((step, metrics),) = rows_of(the_run(server, buffer), "w")
    assert step == 0
    assert metrics["int"] == 3 and metrics["float"] == 0.25 and metrics["flag"] is True and metrics["text"] == "hi"
    assert math.isnan(metrics["nan"]) and metrics["inf"] == math.inf and metrics["none"] is None


def test_rows_carry_the_time_the_record_was_logged(server, buffer):
    log_records(buffer, "w", 1)
    (record,) = walbuf.read(buffer)
    assert run_sync(server, buffer).returncode == 0
    (row,) = the_run(server, buffer).history
    assert row["_timestamp"] == pytest.approx(record.time, abs=1e-3)


def test_cron_like_syncs_send_each_record_once(server, buffer):
    for round_ in range(3):
        log_records(buffer, "rank-0", 4, start=4 * round_)
        assert run_sync(server, buffer).returncode == 0
    assert run_sync(server, buffer).returncode == 0  # nothing new: nothing sent
    assert [s for s, _ in rows_of(the_run(server, buffer), "rank-0")] == list(range(12))


def test_records_appended_during_a_sync_go_in_the_next_one(server, buffer):
    writer = subprocess.Popen(
        [sys.executable, str(TESTS / "writer_loop.py"), str(buffer)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert writer.stdout is not None and writer.stdout.readline() == "ready\n"
        for _ in range(3):
            writer.stdout.readline()
            assert run_sync(server, buffer).returncode == 0
    finally:
        writer.kill()
        writer.wait()
    assert run_sync(server, buffer).returncode == 0
    logged = [r.step for r in walbuf.read(buffer)]
    received = [s for s, _ in rows_of(the_run(server, buffer, run="crash"), "victim")]
    assert sorted(received) == logged == list(range(len(logged)))


def test_server_down_exits_75_and_advances_nothing_then_a_retry_sends_all(server, buffer):
    log_records(buffer, "rank-0", 3)
    server.go_down()
    proc = run_sync(server, buffer)
    assert proc.returncode == 75, proc.stderr
    assert "W&B" in proc.stderr and "Traceback" not in proc.stderr
    assert pending(buffer) == {("exp1", "rank-0"): 3}
    server.go_up()
    assert run_sync(server, buffer).returncode == 0
    assert [s for s, _ in rows_of(the_run(server, buffer), "rank-0")] == [0, 1, 2]
    assert pending(buffer) == {("exp1", "rank-0"): 0}


def test_server_failing_mid_upload_exits_75_and_advances_nothing(server, buffer):
    log_records(buffer, "rank-0", 3)
    server.fail_with(500, paths="file_stream")
    proc = run_sync(server, buffer)
    assert proc.returncode == 75, proc.stderr
    assert pending(buffer) == {("exp1", "rank-0"): 3}
    status = run_status(buffer)["runs"][0]["last_sync"]
    assert status["status"] == "unreachable"
    server.fail_with(None)
    assert run_sync(server, buffer).returncode == 0
    assert pending(buffer) == {("exp1", "rank-0"): 0}


def test_target_is_stored_at_the_first_sync_and_reused(server, buffer):
    log_records(buffer, "w", 1)
    assert run_sync(server, buffer, "--project", "proj", "--entity", "ent").returncode == 0
    first = run_status(buffer)["runs"][0]
    assert (first["project"], first["entity"]) == ("proj", "ent") and first["wandb_id"]
    log_records(buffer, "w", 1, start=1)
    assert run_sync(server, buffer).returncode == 0
    assert run_status(buffer)["runs"][0]["wandb_id"] == first["wandb_id"]
    assert len(server.run(first["wandb_id"]).history) == 2


def test_target_given_to_init_is_used(server, buffer):
    log_records(buffer, "w", 1, project="proj", entity="ent", run_id="fixedid1")
    assert run_sync(server, buffer).returncode == 0
    fake_run = server.run("fixedid1")
    assert (fake_run.entity, fake_run.project) == ("ent", "proj")


def test_conflicting_override_is_a_clear_error_and_sends_nothing(server, buffer):
    log_records(buffer, "w", 1, project="proj")
    proc = run_sync(server, buffer, "--project", "other")
    assert proc.returncode == 78
    assert "'proj', not 'other'" in proc.stderr
    assert server.runs == {}
    assert pending(buffer) == {("exp1", "w"): 1}


def test_run_id_for_a_buffer_of_several_runs_needs_run(server, buffer):
    log_records(buffer, "w", 1, run="a")
    log_records(buffer, "w", 1, run="b")
    proc = run_sync(server, buffer, "--run-id", "x1")
    assert proc.returncode == 78 and "--run NAME" in proc.stderr


def test_several_runs_sync_into_several_wandb_runs(server, buffer):
    log_records(buffer, "w", 2, run="a")
    log_records(buffer, "w", 3, run="b")
    assert run_sync(server, buffer).returncode == 0
    assert len(the_run(server, buffer, run="a").history) == 2
    assert len(the_run(server, buffer, run="b").history) == 3


def test_run_option_syncs_only_that_run(server, buffer):
    log_records(buffer, "w", 2, run="a")
    log_records(buffer, "w", 3, run="b")
    assert run_sync(server, buffer, "--run", "b").returncode == 0
    assert pending(buffer) == {("a", "w"): 2, ("b", "w"): 0}


def test_max_records_bounds_one_sync(server, buffer):
    log_records(buffer, "rank-0", 5)
    log_records(buffer, "rank-1", 5)
    assert run_sync(server, buffer, "--max-records", "4").returncode == 0
    assert sum(pending(buffer).values()) == 6
    assert run_sync(server, buffer).returncode == 0
    fake_run = the_run(server, buffer)
    assert len(fake_run.history) == 10
    assert [s for s, _ in rows_of(fake_run, "rank-1")] == list(range(5))


def test_records_past_one_read_chunk_arrive_once_in_order_across_a_records_bound(in_process, buffer):
    n = READ_CHUNK + 600  # two read chunks; the bound cuts the second
    with walbuf.Writer(buffer, writer="rank-0") as w0, walbuf.Writer(buffer, writer="rank-1") as w1:
        for i in range(n):
            (w0, w1)[i % 2].log({"i": i})
    first = walbuf.sync(buffer, max_records=READ_CHUNK + 300)
    assert first.records == READ_CHUNK + 300 and walbuf.status(buffer).runs[0].pending == 300
    assert walbuf.sync(buffer).records == 300
    fake_run = in_process.run(first.runs[0].target.wandb_id)
    assert [m["i"] for _, m in rows_of(fake_run, "rank-0")] == list(range(0, n, 2))
    assert [m["i"] for _, m in rows_of(fake_run, "rank-1")] == list(range(1, n, 2))


def test_dry_run_sends_and_changes_nothing(server, buffer):
    log_records(buffer, "w", 3)
    proc = run_sync(server, buffer, "--dry-run", quiet=False)
    assert proc.returncode == 0
    assert "3 records would be sent" in proc.stdout
    assert server.runs == {}
    status = run_status(buffer)["runs"][0]
    assert status["pending"] == 3 and status["wandb_id"] is None and status["last_sync"] is None


def test_missing_buffer_exits_66(server, tmp_path):
    proc = run_sync(server, tmp_path / "nope.db")
    assert proc.returncode == 66 and "no buffer at" in proc.stderr


def test_second_syncer_exits_at_once_with_its_own_code(server, buffer):
    log_records(buffer, "w", 1)
    holder = walbuf.open_buffer(buffer).sync_lock()
    assert holder.acquire(timeout=0)
    try:
        start = time.monotonic()
        proc = run_sync(server, buffer)
        assert proc.returncode == 11
        assert "another walbuf sync" in proc.stderr
        assert time.monotonic() - start < 30
    finally:
        holder.release()
    assert server.runs == {}


def test_wait_lets_a_second_syncer_run_after_the_first(server, buffer):
    log_records(buffer, "w", 1)
    server.hold_uploads()
    first = subprocess.Popen(
        [sys.executable, "-m", "walbuf", "sync", str(buffer), "--quiet"], env={**os.environ, **server.env()}
    )
    server.wait_for_rows(1, timeout=60)  # the first holds the lock, mid-upload
    second = subprocess.Popen(
        [sys.executable, "-m", "walbuf", "sync", str(buffer), "--wait", "120"],
        env={**os.environ, **server.env()},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    # The second says it waits (once it found the lock taken); only then may the first finish.
    assert "waiting up to 120s" in second.stderr.readline()
    server.release_uploads()
    assert first.wait(timeout=120) == 0
    out, _ = second.communicate(timeout=120)
    assert second.returncode == 0 and "nothing to sync" in out
    assert len(the_run(server, buffer).history) == 1


def _kill_a_syncer_mid_upload_then_sync_again(server, buffer):
    log_records(buffer, "w", 200)
    server.hold_uploads()  # the upload is under way, not yet confirmed
    victim = subprocess.Popen(
        [sys.executable, "-m", "walbuf", "sync", str(buffer), "--quiet"],
        env={**os.environ, **server.env()},
    )
    server.wait_for_rows(1, timeout=60)
    os.kill(victim.pid, signal.SIGKILL)
    victim.wait()
    server.release_uploads()
    assert pending(buffer) == {("exp1", "w"): 200}
    assert run_status(buffer)["runs"][0]["last_sync"]["status"] == "died"
    proc = subprocess.run(
        [sys.executable, "-m", "walbuf", "sync", str(buffer), "--quiet"],
        capture_output=True,
        text=True,
        env={**os.environ, **server.env()},
    )
    assert proc.returncode == 0, proc.stderr
    # A warning that needs a person: printed even with --quiet.
    assert "200 records were in an earlier upload that was cut off" in proc.stderr
    received = Counter(s for s, _ in rows_of(the_run(server, buffer), "w"))
    assert set(received) == set(range(200))  # at least once each
    assert pending(buffer) == {("exp1", "w"): 0}


def test_a_quiet_sync_prints_nothing_and_leaves_no_files_behind(server, buffer, tmp_path):
    log_records(buffer, "w", 3)
    home, tmp, here = tmp_path / "home", tmp_path / "tmp", tmp_path / "here"
    for folder in (home, tmp, here):
        folder.mkdir()
    env = {**os.environ, **server.env(), "HOME": str(home), "TMPDIR": str(tmp)}
    del env["WANDB_SILENT"]  # as in a user's shell: walbuf silences wandb itself
    env.pop("XDG_CACHE_HOME", None)
    proc = subprocess.run(
        [sys.executable, "-m", "walbuf", "sync", str(buffer), "--quiet"],
        capture_output=True,
        text=True,
        env=env,
        cwd=here,
    )
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")
    assert len(the_run(server, buffer).history) == 3
    assert list(here.iterdir()) == [] and list(tmp.iterdir()) == []
    assert [p for p in home.rglob("*") if p.is_file()] == []


def test_verbose_shows_wandbs_own_messages(server, buffer):
    log_records(buffer, "w", 1)
    env = {**os.environ, **server.env()}
    del env["WANDB_SILENT"]
    proc = subprocess.run(
        [sys.executable, "-m", "walbuf", "sync", str(buffer), "--quiet", "--verbose"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert proc.returncode == 0 and "wandb:" in proc.stderr


# wandb.init merges a run's settings into those of its environment one at a
# time, in an order set by the interpreter's hash seed; these seeds gave an
# order that failed (exit 78, "Cannot skip transaction log in offline mode")
# before walbuf asked what mode wandb starts from. Fixed seeds: the order is
# the same in every run.
@pytest.mark.parametrize("hash_seed", ["5", "7"])
def test_a_job_environment_that_makes_wandb_offline_does_not_stop_an_online_sync(server, buffer, hash_seed):
    log_records(buffer, "w", 3)
    result = run_sync(server, buffer, env={"WANDB_MODE": "offline", "PYTHONHASHSEED": hash_seed})
    assert result.returncode == 0, result.stderr
    assert [step for step, _ in rows_of(the_run(server, buffer), "w")] == [0, 1, 2]


def test_kill_9_of_the_syncer_loses_nothing_and_reports_possible_duplicates(server, buffer):
    _kill_a_syncer_mid_upload_then_sync_again(server, buffer)


def test_a_killed_syncer_does_not_block_the_next_under_a_wandb_using_parent(in_process, server, buffer, tmp_path):
    log_records(tmp_path / "warm.db", "setup", 1)
    walbuf.sync(tmp_path / "warm.db")  # this process now runs a wandb service, in WANDB_SERVICE
    assert os.environ.get("WANDB_SERVICE")
    _kill_a_syncer_mid_upload_then_sync_again(server, buffer)


def test_status_json_has_records_and_pending_per_run_and_writer(buffer):
    log_records(buffer, "rank-0", 3)
    log_records(buffer, "rank-1", 1)
    (run,) = run_status(buffer)["runs"]
    assert run["run"] == "exp1" and run["records"] == 4 and run["pending"] == 4
    assert {w["writer"]: (w["records"], w["pending"]) for w in run["writers"]} == {"rank-0": (3, 3), "rank-1": (1, 1)}


def test_offline_mode_writes_a_run_directory_that_wandb_sync_uploads(server, buffer, tmp_path):
    log_records(buffer, "rank-0", 3, project="proj", entity="ent", run_id="offline1")
    proc = subprocess.run(
        [sys.executable, "-m", "walbuf", "sync", str(buffer), "--mode", "offline", "--dir", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        env={**os.environ, **server.env()},
    )
    assert proc.returncode == 0, proc.stderr
    command = next(line for line in proc.stdout.splitlines() if "wandb sync" in line).split("with: ", 1)[1]
    assert server.runs == {}  # offline: nothing went to a server
    assert pending(buffer) == {("exp1", "rank-0"): 0}
    # wandb's own reader of its offline format: `wandb sync` reads the .wandb file and uploads it.
    env = {k: v for k, v in {**os.environ, **server.env()}.items() if k != "WANDB_SERVICE"}
    upload = subprocess.run(command.split(), capture_output=True, text=True, env=env)
    assert upload.returncode == 0, upload.stderr
    fake_run = server.run("offline1")
    assert [s for s, _ in rows_of(fake_run, "rank-0")] == [0, 1, 2]
    assert fake_run.step_metric_of("rank-0/loss") == "rank-0/step"


def test_library_sync_reports_what_it_sent(in_process, buffer):
    server = in_process
    log_records(buffer, "rank-0", 3)
    log_records(buffer, "rank-1", 2)
    result = walbuf.sync(buffer, project="proj", entity="ent")
    (run,) = result.runs
    assert (result.records, run.per_writer, run.possibly_duplicated) == (5, {"rank-0": 3, "rank-1": 2}, 0)
    assert (run.target.project, run.target.entity) == ("proj", "ent")
    assert len(server.run(run.target.wandb_id).history) == 5
    assert walbuf.sync(buffer).runs == ()


def test_each_row_carries_the_jobs_runtime_counted_from_the_run_start_in_every_sync(in_process, buffer):
    with walbuf.Writer(buffer, writer="w") as w:
        w.log({"x": 0})
        w.log({"x": 1})
        walbuf.sync(buffer)  # while the job runs
        w.log({"x": 2})
        (writer,) = walbuf.status(buffer).runs[0].writers
        result = walbuf.sync(buffer)
    history = in_process.run(result.runs[0].target.wandb_id).history
    assert [row["w/x"] for row in history] == [0, 1, 2]
    # Not the uploading process's time: each sync's rows would start near 0 again.
    job_time = [row["_timestamp"] - writer.opened_at for row in history]
    assert [row["_runtime"] for row in history] == pytest.approx(job_time)


@pytest.mark.backends("sqlite")
def test_max_seconds_stops_sending_in_time_to_finish_and_the_rest_waits(in_process, buffer):
    with walbuf.Writer(buffer, writer="w") as w:
        for i in range(1_200_000):  # far more than a sync sends in 12 s (at most about 25,000 rows/s here)
            w.log({"i": i})
    result = walbuf.sync(buffer, max_seconds=12)
    # Sending stopped with time left for wandb's finish: no hard stop, a clean partial sync.
    assert result.stopped_early and 0 < result.records < 1_200_000
    assert walbuf.status(buffer).runs[0].pending == 1_200_000 - result.records
    assert len(in_process.run(result.runs[0].target.wandb_id).history) == result.records


def test_missing_credentials_exit_78_not_75_and_advance_nothing(server, buffer, tmp_path):
    log_records(buffer, "w", 1)
    env = {**os.environ, **server.env(), "HOME": str(tmp_path)}
    del env["WANDB_API_KEY"]
    proc = subprocess.run(
        [sys.executable, "-m", "walbuf", "sync", str(buffer), "--quiet"],
        capture_output=True,
        text=True,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 78 and proc.stderr.count("wandb login") == 1, proc.stderr
    assert pending(buffer) == {("exp1", "w"): 1}


def test_without_credentials_the_sync_never_says_it_is_sending(server, buffer, tmp_path):
    log_records(buffer, "w", 3)
    env = {**os.environ, **server.env(), "HOME": str(tmp_path)}
    del env["WANDB_API_KEY"]
    proc = subprocess.run(
        [sys.executable, "-m", "walbuf", "sync", str(buffer)],
        capture_output=True,
        text=True,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 78 and "no W&B API key" in proc.stderr, proc.stderr
    assert "sending" not in proc.stderr and "uploading" not in proc.stderr, proc.stderr


class _CutOff(BaseException):
    """What ends a sync in its own process once its upload began (a bug, a signal turned into an exception)."""


def _cut_off(_run):
    raise _CutOff


def test_a_sync_cut_off_in_its_process_leaves_the_run_to_the_next_sync_of_that_process(in_process, buffer):
    log_records(buffer, "w", 3)
    with pytest.raises(_CutOff):
        walbuf.sync(buffer, on_run=_cut_off)
    # Without the cut-off upload abandoned, wandb's service still holds the run: "run ID ... is in use".
    result = walbuf.sync(buffer)
    assert result.records == 3
    assert len(in_process.run(result.runs[0].target.wandb_id).history) == 3


def config_of(fake_run):
    """The run's config as the fake holds it: key -> value (wandb sends {"value": ...} per key)."""
    return {k: v["value"] for k, v in fake_run.config.items() if k != "_wandb"}


def test_writer_config_arrives_as_the_runs_config(server, buffer):
    with walbuf.Writer(buffer, writer="rank-0", run="exp1") as w:
        w.config({"lr": 0.1, "model": {"depth": 4, "act": "relu"}, "layers": [64, 64]})
        w.log({"loss": 1.0})
    assert run_sync(server, buffer).returncode == 0
    assert config_of(the_run(server, buffer)) == {"lr": 0.1, "model": {"depth": 4, "act": "relu"}, "layers": [64, 64]}


def test_config_set_again_by_another_writer_takes_the_later_value_and_the_sync_says_so(server, buffer):
    with walbuf.Writer(buffer, writer="rank-0", run="exp1") as w:
        w.config({"lr": 0.1, "seed": 1})
    with walbuf.Writer(buffer, writer="rank-1", run="exp1") as w:
        w.config({"lr": 0.2})
        w.log({"loss": 1.0})
    proc = run_sync(server, buffer)
    assert proc.returncode == 0, proc.stderr
    assert "config 'lr' was 0.1 (from rank-0) and was set again to 0.2 (by rank-1)" in proc.stderr
    assert config_of(the_run(server, buffer)) == {"lr": 0.2, "seed": 1}
    again = run_sync(server, buffer)
    assert again.returncode == 0 and "warning" not in again.stderr  # said once


def test_config_set_after_the_last_sync_is_synced_without_new_records(server, buffer):
    log_records(buffer, "w", 1)
    assert run_sync(server, buffer).returncode == 0
    with walbuf.Writer(buffer, writer="w", run="exp1") as w:
        w.config({"epochs": 3})
    assert run_sync(server, buffer).returncode == 0
    assert config_of(the_run(server, buffer)) == {"epochs": 3}
    assert len(the_run(server, buffer).history) == 1


def test_config_value_walbuf_cannot_store_is_refused_and_nothing_is_stored(buffer):
    with walbuf.Writer(buffer, writer="w", run="exp1") as w:
        w.config({"ok": 1})
        with pytest.raises(walbuf.MetricTypeError, match="'bad'"):
            w.config({"fine": 2, "bad": object()})
    assert [row[0] for row in run_sql(buffer, "SELECT key FROM config_entries ORDER BY id")] == ["ok"]


def test_writer_summary_arrives_in_the_runs_summary_later_value_winning(server, buffer):
    with walbuf.Writer(buffer, writer="eval", run="exp1") as w:
        w.log({"accuracy": 0.5})
        w.summary({"best_accuracy": 0.5, "checkpoint": "ckpt-1"})
        w.summary({"best_accuracy": 0.7})
    assert run_sync(server, buffer).returncode == 0
    summary = the_run(server, buffer).summary
    assert summary["best_accuracy"] == 0.7 and summary["checkpoint"] == "ckpt-1"
    assert config_of(the_run(server, buffer)) == {}  # summary is not config


def test_records_logged_with_axis_values_are_plotted_there_even_when_the_values_go_back(server, buffer):
    # A trainer's global step, as a job resumed from the checkpoint at step 5 sends it again.
    with walbuf.Writer(buffer, writer="trainer", run="exp1", step_axis="global_step") as w:
        for global_step in (4, 5, 6, 5, 6, 7):
            w.log({"loss": float(global_step)}, axis=global_step)
    assert [r.step for r in walbuf.read(buffer)] == [0, 1, 2, 3, 4, 5]  # the records keep their order
    assert run_sync(server, buffer).returncode == 0
    fake_run = the_run(server, buffer)
    assert rows_of(fake_run, "trainer", axis="global_step") == [(s, {"loss": float(s)}) for s in (4, 5, 6, 5, 6, 7)]
    assert fake_run.step_metric_of("trainer/loss") == "trainer/global_step"
    assert fake_run.summary["trainer/global_step"] == 7


def test_a_list_metric_arrives_as_the_list_w_and_b_keeps(server, buffer):
    with walbuf.Writer(buffer, writer="eval", run="exp1") as w:
        w.log({"per_class_f1": [0.5, 0.25], "nested": [[1, 2], [3]]})
        w.log({"per_class_f1": [0.75, 0.5], "nested": []})
    assert run_sync(server, buffer).returncode == 0
    fake_run = the_run(server, buffer)
    assert rows_of(fake_run, "eval") == [
        (0, {"per_class_f1": [0.5, 0.25], "nested": [[1, 2], [3]]}),
        (1, {"per_class_f1": [0.75, 0.5], "nested": []}),
    ]
    assert fake_run.summary["eval/per_class_f1"] == [0.75, 0.5]


def test_a_summary_over_the_line_limit_arrives_without_its_largest_values_and_a_person_is_told(server, buffer):
    # 12 writers, each with a last value of 0.9 MB: one summary line would pass
    # wandb-core's limit, and wandb-core would skip it whole with no error.
    for i in range(12):
        with walbuf.Writer(buffer, writer=f"w{i}", run="exp1") as w:
            w.log({"notes": chr(ord("a") + i) * (900_000 + i), "loss": float(i)})
    proc = run_sync(server, buffer)
    assert proc.returncode == 3, proc.stderr
    fake_run = the_run(server, buffer)
    assert fake_run.dropped_lines == 0
    left_out = [k for k in (f"w{i}/notes" for i in range(12)) if k not in fake_run.summary]
    assert left_out == ["w11/notes"]  # the largest, and no more than needed
    assert "summary 'w11/notes'" in proc.stderr and "line limit" in proc.stderr
    assert all(fake_run.summary[f"w{i}/loss"] == float(i) for i in range(12))


def test_status_after_a_sync_that_finished_the_run_counts_the_records_it_sent(server, buffer):
    log_records(buffer, "rank-0", 5)  # closed: the sync finishes the run, in an upload of no records of its own
    assert run_sync(server, buffer).returncode == 0
    assert the_run(server, buffer).complete
    (run,) = run_status(buffer)["runs"]
    assert (run["last_sync"]["status"], run["last_sync"]["records"]) == ("ok", 5)


@pytest.mark.backends("sqlite")
def test_a_sync_removes_the_working_folders_that_syncers_killed_on_this_host_left(server, buffer, tmp_path):
    from fsbed import ON_B

    cache = tmp_path / "cache" / "walbuf" / "sync"
    cache.mkdir(parents=True)
    name = "from walbuf.syncer.syncer import _this_process; print(_this_process())"
    gone = subprocess.run([sys.executable, "-c", name], capture_output=True, text=True, check=True)
    dead = cache / f"{gone.stdout.strip()}-x1"  # a syncer killed with -9
    living = cache / f"{_this_process()}-x2"  # this process: alive
    contained = subprocess.run([*ON_B, sys.executable, "-c", name], capture_output=True, text=True, check=True)
    # A container's syncer (its own PID namespace, sharing this home folder): whether it runs, this host cannot tell.
    container = cache / f"{contained.stdout.strip()}-x3"
    elsewhere = cache / f"another-host-{gone.stdout.strip().partition('-')[2]}-x4"  # a shared home: another host's
    for folder in (dead, living, container, elsewhere):
        folder.mkdir()
    log_records(buffer, "rank-0", 2)
    assert run_sync(server, buffer, env={"XDG_CACHE_HOME": str(tmp_path / "cache")}).returncode == 0
    assert sorted(p.name for p in cache.iterdir()) == sorted([living.name, container.name, elsewhere.name])


def _count_hand_offs(monkeypatch):
    """Count the calls into wandb's asyncio thread (each one a wake-up that the caller waits for)."""
    from wandb.sdk.lib.asyncio_manager import AsyncioManager

    calls = Counter()
    real = AsyncioManager.run

    def counted(self, fn):
        calls["run"] += 1
        return real(self, fn)

    monkeypatch.setattr(AsyncioManager, "run", counted)
    return calls


@pytest.mark.backends("sqlite")
def test_a_sync_hands_rows_to_wandb_in_batches_not_one_by_one(in_process, buffer, monkeypatch):
    log_records(buffer, "w", 2000)
    calls = _count_hand_offs(monkeypatch)
    result = walbuf.sync(buffer)
    assert result.records == 2000
    assert len(in_process.run(result.runs[0].target.wandb_id).history) == 2000
    assert calls["run"] < 200  # one per 500 rows, and wandb's own around them


@pytest.mark.backends("sqlite")
def test_a_sync_with_a_time_bound_hands_rows_over_in_batches_each_paced_by_wandb_core(in_process, buffer, monkeypatch):
    from wandb.sdk.interface.interface_sock import InterfaceSock
    from wandb.sdk.wandb_run import Run

    log_records(buffer, "w", 2000)
    calls = _count_hand_offs(monkeypatch)
    # The marks the pacing waits for: StopStatus requests, which wandb-core's
    # sender answers in order with the rows, sent before run.finish().
    marks, finishing = Counter(), []
    real_deliver, real_finish = InterfaceSock._deliver, Run.finish

    def deliver(self, record):
        if record.request.HasField("stop_status"):
            marks["in finish" if finishing else "before finish"] += 1
        return real_deliver(self, record)

    def finish(self, *args, **kwargs):
        finishing.append(True)
        return real_finish(self, *args, **kwargs)

    monkeypatch.setattr(InterfaceSock, "_deliver", deliver)
    monkeypatch.setattr(Run, "finish", finish)
    result = walbuf.sync(buffer, max_seconds=600)
    assert result.records == 2000
    assert len(in_process.run(result.runs[0].target.wandb_id).history) == 2000
    assert calls["run"] < 200  # one hand-over per 500 rows, not one per row
    assert marks["before finish"] == 4  # one mark per batch of 500
