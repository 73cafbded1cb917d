"""A sync when things go wrong: what W&B refuses for good, a damaged buffer, signals, deadlines.

A record W&B would refuse (one an older walbuf let in: inserted here with
SQL, as it stored them) is quarantined: never sent, kept with its reason,
and the records after it go on. A target W&B refuses blocks its run until a
sync gives another. What a retry cannot fix exits 78, not 75. A damaged
buffer sends nothing. Ctrl-C and SIGTERM cut an upload off cleanly. Every
assertion about uploads is on what the fake server holds.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import fsbed
import pytest
from conftest import rows_of, run_sql, run_sync, walbuf_command, wandb_cores

import walbuf

pytestmark = [pytest.mark.backends("sqlite", "postgresql"), pytest.mark.slow]


def status(buffer):
    proc = walbuf_command("status", str(buffer), "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["runs"][0]


def log_steps(buffer, steps, writer="w"):
    with walbuf.Writer(buffer, writer=writer, run="exp") as w:
        for step in steps:
            w.log({"i": step}, step=step)


def as_an_older_walbuf_stored_it(buffer, step, metrics_json, writer="w"):
    """A record that passed an older walbuf's checks: written with SQL, as walbuf stores a record."""
    (writer_id,) = run_sql(buffer, "SELECT id FROM writers WHERE name = :w", {"w": writer})[0]
    run_sql(
        buffer,
        "INSERT INTO records (writer_id, step, time, metrics) VALUES (:w, :s, 0, :m)",
        {"w": writer_id, "s": step, "m": metrics_json},
    )


def steps_arrived(server, buffer):
    return [step for step, _ in rows_of(server.run(status(buffer)["wandb_id"]), "w")]


POISON = {
    "a lone surrogate in a key": ('{"\\ud800": 1}', "is not valid text"),
    "a newline in a key": ('{"loss\\n": 1}', "control character"),
    "a reserved name": ('{"_step": 1}', "reserves for itself"),
    "an 11 MB value": (json.dumps({"blob": "x" * 11_000_000}), "over W&B's limit"),
    "a 2 MB value of a key sent before": (json.dumps({"i": "x" * 2_000_000}), "over W&B's limit of 1,000,000"),
}


@pytest.mark.parametrize("poison", sorted(POISON))
def test_a_poison_record_is_quarantined_and_the_others_arrive_once(server, buffer, poison):
    metrics_json, reason = POISON[poison]
    log_steps(buffer, [0, 1, 2])
    as_an_older_walbuf_stored_it(buffer, 3, metrics_json)
    log_steps(buffer, [4, 5])
    proc = run_sync(server, buffer)
    assert proc.returncode == 3, proc.stderr  # sent the rest; a person should look
    assert "quarantined w step 3" in proc.stderr and reason in proc.stderr
    assert steps_arrived(server, buffer) == [0, 1, 2, 4, 5]
    assert (status(buffer)["pending"], status(buffer)["quarantined"]) == (0, 1)
    again = run_sync(server, buffer)
    assert again.returncode == 0, again.stderr  # nothing blocks, nothing is sent twice
    assert steps_arrived(server, buffer) == [0, 1, 2, 4, 5]
    (held,) = walbuf.read(buffer, quarantined=True)
    assert held.step == 3 and reason in held.quarantined


def test_a_record_of_keys_sent_before_is_still_held_to_the_line_limit(server, buffer):
    # The same 34,001 keys as a record the sync found fine, each with an int of
    # 308 digits (within a 64-bit float's range): over 10 MB as a history line.
    keys = [f"k{i}" for i in range(34_000)]
    with walbuf.Writer(buffer, writer="w", run="exp") as w:
        w.log({**dict.fromkeys(keys, 0), "i": 0}, step=0)
    as_an_older_walbuf_stored_it(buffer, 1, json.dumps({**dict.fromkeys(keys, int("9" * 308)), "i": 1}))
    log_steps(buffer, [2])
    proc = run_sync(server, buffer)
    assert proc.returncode == 3, proc.stderr
    assert "quarantined w step 1" in proc.stderr and "as a W&B history line, over W&B's limit" in proc.stderr
    assert steps_arrived(server, buffer) == [0, 2]


def test_quarantined_records_are_shown_with_their_reason_and_doctor_asks_for_a_person(server, buffer):
    log_steps(buffer, [0])
    as_an_older_walbuf_stored_it(buffer, 1, '{"a\\u0000b": 1}')
    assert run_sync(server, buffer).returncode == 3
    proc = walbuf_command("records", str(buffer), "--quarantined")
    (line,) = [json.loads(line) for line in proc.stdout.splitlines()]
    assert line["step"] == 1 and "control character" in line["quarantined"]
    report = walbuf.doctor(buffer)
    assert {f.check for f in report.findings if not f.ok} == {"run exp quarantine"}


def test_prune_removes_quarantined_records_with_the_synced_ones(server, buffer):
    log_steps(buffer, [0])
    as_an_older_walbuf_stored_it(buffer, 1, '{"_runtime": 1}')
    log_steps(buffer, [2])
    assert run_sync(server, buffer).returncode == 3
    walbuf.prune(buffer, older_than=0)
    assert list(walbuf.read(buffer, quarantined=True)) == []
    assert status(buffer)["quarantined"] == 0


def test_a_config_entry_wandb_would_refuse_is_left_out_and_the_rest_arrives(server, buffer):
    with walbuf.Writer(buffer, writer="w", run="exp") as w:
        w.config({"lr": 0.1})
        w.log({"i": 0})
    (writer_id,) = run_sql(buffer, "SELECT id FROM writers")[0]
    run_sql(
        buffer,
        "INSERT INTO config_entries (writer_id, kind, key, value, time) VALUES (:w, 'config', '_wandb', '1', 0)",
        {"w": writer_id},
    )
    proc = run_sync(server, buffer)
    assert proc.returncode == 3 and "config '_wandb' (from w) left out" in proc.stderr
    config = server.run(status(buffer)["wandb_id"]).config
    assert config["lr"]["value"] == 0.1


def test_a_bad_run_id_is_refused_before_anything_is_stored(server, buffer):
    log_steps(buffer, [0])
    proc = run_sync(server, buffer, "--run-id", "bad id/x")
    assert proc.returncode == 78 and "W&B refuses any of" in proc.stderr and "credentials" not in proc.stderr
    assert status(buffer)["wandb_id"] is None
    assert run_sync(server, buffer, "--run-id", "good1").returncode == 0  # nothing to conflict with
    assert steps_arrived(server, buffer) == [0]


def test_a_bad_project_given_to_init_is_refused_there(buffer):
    with pytest.raises(walbuf.ConfigError, match="give the entity with --entity"):
        walbuf.init(buffer, writer="w", project="team/proj")
    with pytest.raises(walbuf.ConfigError, match="W&B refuses any of"):
        walbuf.Writer(buffer, writer="w", run_id="bad id/x")


def test_a_deleted_run_is_refused_with_78_and_its_run_waits_for_another_target(server, buffer):
    log_steps(buffer, [0], writer="w")
    assert run_sync(server, buffer, "--run-id", "gone1").returncode == 0
    server.delete_run("gone1")
    log_steps(buffer, [1])
    proc = run_sync(server, buffer)
    assert proc.returncode == 78, proc.stderr
    assert "previously created and deleted" in proc.stderr and "--run-id" in proc.stderr
    again = run_sync(server, buffer)  # cron's next try: refused at once, without asking W&B
    assert again.returncode == 78 and "W&B refused its target" in again.stderr
    assert status(buffer)["target_refused"]
    assert run_sync(server, buffer, "--run-id", "fresh1").returncode == 0
    assert [s for s, _ in rows_of(server.run("fresh1"), "w")] == [1]
    assert status(buffer)["target_refused"] is None


@pytest.mark.backends("sqlite")
@pytest.mark.parametrize(
    ("answer", "message", "code"),
    [
        (403, "permission denied", "PERMISSION_ERROR"),
        (404, "project not found", "NOT_FOUND"),
        (200, "permission denied", "PERMISSION_ERROR"),
    ],
    ids=["403", "404", "graphql-error-in-200"],
)
def test_a_refusal_of_the_first_request_exits_78_with_the_servers_words(server, buffer, answer, message, code):
    log_steps(buffer, [0])
    server.refuse_upserts(answer, message, code)
    proc = run_sync(server, buffer)
    assert proc.returncode == 78, proc.stderr
    assert message in proc.stderr and "may write there" in proc.stderr and "Traceback" not in proc.stderr
    assert status(buffer)["pending"] == 1


@pytest.mark.backends("sqlite")
def test_a_refused_api_key_at_the_first_request_exits_78_asking_for_a_login(server, buffer):
    log_steps(buffer, [0])
    server.refuse_upserts(401, "user is not logged in", "UNAUTHENTICATED")
    proc = run_sync(server, buffer)
    assert proc.returncode == 78 and "user is not logged in" in proc.stderr and "wandb login" in proc.stderr
    assert status(buffer)["target_refused"] is None  # the target is not at fault


@pytest.mark.backends("sqlite")
def test_cron_reports_a_refusal_at_the_first_request_as_needing_a_person(server, buffer):
    log_steps(buffer, [0])
    server.refuse_upserts(403, "permission denied", "PERMISSION_ERROR")
    cron = Path(sys.executable).parent / "walbuf-cron"
    proc = subprocess.run(
        [cron, str(buffer)], capture_output=True, text=True, timeout=120, env={**os.environ, **server.env()}
    )
    assert proc.returncode == 78
    assert "exit 78, needs a person" in proc.stdout and "permission denied" in proc.stdout


@pytest.mark.backends("sqlite")
def test_https_against_a_plain_http_server_exits_78_naming_the_scheme(server, buffer):
    log_steps(buffer, [0])
    proc = run_sync(server, buffer, env={"WANDB_BASE_URL": server.url.replace("http://", "https://")})
    assert proc.returncode == 78 and "scheme" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert status(buffer)["pending"] == 1


@pytest.mark.parametrize("version", ["0.19.0", "0.32.0", "1.0.0"])
def test_a_wandb_outside_the_tested_range_is_refused_before_anything_is_sent(server, buffer, tmp_path, version):
    log_steps(buffer, [0])
    stub = tmp_path / "other-wandb" / "wandb"  # another wandb release, as far as walbuf can tell
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text(f"__version__ = {version!r}\n")
    proc = run_sync(server, buffer, env={"PYTHONPATH": str(stub.parent)})
    assert proc.returncode == 78, proc.stderr
    assert f"tested with wandb>=0.31.0,<0.32, and this environment has wandb {version}" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert server.runs == {} and status(buffer)["pending"] == 1 and status(buffer)["last_sync"] is None


def test_pyproject_declares_the_wandb_range_the_sync_checks():
    from walbuf.syncer.wandb import WANDB_RANGE

    pyproject = (Path(__file__).parent.parent / "pyproject.toml").read_text()
    assert f'"{WANDB_RANGE}",' in pyproject


def test_a_malformed_wandb_base_url_exits_78_not_75(server, buffer):
    log_steps(buffer, [0])
    proc = run_sync(server, buffer, env={"WANDB_BASE_URL": "htp//not a url"})
    assert proc.returncode == 78 and "WANDB_BASE_URL" in proc.stderr
    assert "wandb refused a setting: base_url: " in proc.stderr  # what it says of which setting
    assert status(buffer)["pending"] == 1


def test_a_server_error_after_earlier_batches_exits_75_and_the_next_sync_says_they_may_be_twice(server, buffer):
    with walbuf.Writer(buffer, writer="w", run="exp") as w:
        for step in range(3000):  # 27 MB of rows: wandb-core sends at most 10 MiB per post (filestream.go)
            w.log({"i": step, "pad": "x" * 9000}, step=step)
    server.fail_history_after(1, 500)  # the first history post is accepted, the rest fail
    proc = run_sync(server, buffer)
    assert proc.returncode == 75, proc.stderr
    assert status(buffer)["pending"] == 3000
    server.fail_history_after(10**9, 500)  # heals
    again = run_sync(server, buffer)
    assert again.returncode == 0, again.stderr
    assert "were in an earlier upload that was cut off" in again.stderr
    assert set(steps_arrived(server, buffer)) == set(range(3000))


def test_rate_limits_are_waited_out(server, buffer):
    log_steps(buffer, range(5))
    server.rate_limit(3)  # 429 with Retry-After, as the real server answers
    proc = run_sync(server, buffer)
    assert proc.returncode == 0, proc.stderr
    assert steps_arrived(server, buffer) == list(range(5))


@pytest.mark.backends("sqlite")
def test_a_buffer_damaged_where_the_sync_does_not_read_sends_nothing_and_exits_65(server, buffer):
    log_steps(buffer, range(3500))
    assert run_sync(server, buffer).returncode == 0
    log_steps(buffer, range(3500, 6300))
    fake_run = server.run(status(buffer)["wandb_id"])
    run_sql(buffer, "PRAGMA wal_checkpoint(TRUNCATE)")
    data = bytearray(buffer.read_bytes())
    data[len(data) // 4 : len(data) // 4 + 8192] = b"\xff" * 8192  # among the records already synced
    buffer.write_bytes(bytes(data))
    proc = run_sync(server, buffer)
    assert proc.returncode == 65, proc.stderr
    assert len(fake_run.history) == 3500  # nothing of the 2,800 new records was sent
    dry = run_sync(server, buffer, "--dry-run")
    assert dry.returncode == 65


@pytest.mark.backends("sqlite")
@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_a_signal_cuts_the_upload_off_cleanly_and_the_next_sync_completes_it(server, buffer, signum, code):
    log_steps(buffer, range(200))
    server.hold_uploads()  # the rows are on their way; their confirmation is not
    syncer = subprocess.Popen(
        [sys.executable, "-m", "walbuf", "sync", str(buffer), "--quiet"],
        env={**os.environ, **server.env()},
        stderr=subprocess.PIPE,
        text=True,
    )
    server.wait_for_rows(1, timeout=60)
    syncer.send_signal(signum)
    _, err = syncer.communicate(timeout=120)
    server.release_uploads()
    assert syncer.returncode == code, err
    assert err.count("\n") == 1 and "walbuf: error: stopped by" in err and "Traceback" not in err
    assert status(buffer)["last_sync"]["status"] == "interrupted"
    assert status(buffer)["last_sync"]["message"] == (
        "interrupted (Ctrl-C)" if code == 130 else "interrupted (SIGTERM)"
    )
    assert status(buffer)["pending"] == 200
    assert not server.run(status(buffer)["wandb_id"]).complete  # the interrupted sync left the run's state alone
    again = run_sync(server, buffer)
    assert again.returncode == 0, again.stderr
    assert "200 records were in an earlier upload that was cut off" in again.stderr
    assert set(steps_arrived(server, buffer)) == set(range(200))


@pytest.mark.backends("sqlite")
def test_max_seconds_bounds_the_whole_sync_against_a_server_that_never_answers(server, buffer):
    log_steps(buffer, range(10))
    server.stall()
    start = time.monotonic()
    proc = run_sync(server, buffer, "--max-seconds", "8")
    elapsed = time.monotonic() - start
    server.unstall()
    assert proc.returncode == 75, proc.stderr
    assert elapsed < 8 + 1  # from the process's start to its end (101 s before the hard stop)
    assert status(buffer)["pending"] == 10


@pytest.mark.parametrize("value", ["nan", "inf", "0", "-1", "soon"])
def test_max_seconds_must_be_a_finite_positive_number(server, buffer, value):
    log_steps(buffer, [0])
    proc = run_sync(server, buffer, "--max-seconds", value)
    assert proc.returncode == 2 and "--max-seconds" in proc.stderr
    assert status(buffer)["pending"] == 1


@pytest.mark.backends("sqlite")
def test_max_seconds_ends_waiting_for_a_confirmation_that_does_not_come(server, buffer):
    log_steps(buffer, range(10))
    server.hold_uploads()  # wandb opens the run, sends the rows, and waits at its finish
    start = time.monotonic()
    proc = run_sync(server, buffer, "--max-seconds", "10")
    elapsed = time.monotonic() - start
    server.release_uploads()
    assert proc.returncode == 75 and "time bound passed before W&B confirmed" in proc.stderr, proc.stderr
    assert elapsed < 10 + 1
    assert status(buffer)["pending"] == 10
    again = run_sync(server, buffer)
    assert again.returncode == 0 and "10 records were in an earlier upload that was cut off" in again.stderr


def wandb_with_core(root, core):
    """An environment whose wandb is the installed one with ``core`` (bytes and a mode, or None: none) as its
    wandb-core.

    The package is a folder of links to the installed one's files, first on
    PYTHONPATH; wandb runs ``bin/wandb-core`` beside its own modules.
    """
    import wandb

    real = Path(wandb.__file__).parent
    package = root / "wandb"
    (package / "bin").mkdir(parents=True)
    for entry in real.iterdir():
        if entry.name != "bin":
            (package / entry.name).symlink_to(entry)
    for entry in (real / "bin").iterdir():
        if entry.name != "wandb-core":
            (package / "bin" / entry.name).symlink_to(entry)
    if core is not None:
        data, mode = core
        (package / "bin" / "wandb-core").write_bytes(data)
        (package / "bin" / "wandb-core").chmod(mode)
    return {"PYTHONPATH": str(root)}


@pytest.mark.backends("sqlite")
@pytest.mark.parametrize(
    "core",
    [None, (b"#!/bin/sh\nexit 3\n", 0o644), (b"\x00\x01not a program", 0o755)],
    ids=["missing", "not-executable", "not-a-program"],
)
def test_a_wandb_core_that_cannot_run_exits_78_asking_to_reinstall_wandb(server, buffer, tmp_path, core):
    log_steps(buffer, [0])
    proc = run_sync(server, buffer, env=wandb_with_core(tmp_path, core))
    assert proc.returncode == 78, proc.stderr
    assert "reinstall wandb" in proc.stderr and "Traceback" not in proc.stderr
    assert status(buffer)["pending"] == 1


@pytest.mark.backends("sqlite")
def test_a_wandb_core_that_exits_at_start_exits_75(server, buffer, tmp_path):
    log_steps(buffer, [0])
    proc = run_sync(server, buffer, env=wandb_with_core(tmp_path, (b"#!/bin/sh\nexit 3\n", 0o755)))
    assert proc.returncode == 75 and "exited with code 3" in proc.stderr and "Traceback" not in proc.stderr
    assert status(buffer)["pending"] == 1


@pytest.mark.backends("sqlite")
def test_wandb_core_killed_mid_sync_exits_75_in_one_line_and_the_next_sync_delivers_every_record(server, buffer):
    log_steps(buffer, range(50))
    server.hold_uploads()  # wandb-core sends rows and waits for the answer
    syncer = subprocess.Popen(
        [sys.executable, "-m", "walbuf", "sync", str(buffer), "--quiet"],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **server.env()},
    )
    server.wait_for_rows(1, timeout=60)
    (core,) = wandb_cores(syncer.pid)
    os.kill(core, signal.SIGKILL)
    server.release_uploads()
    _, stderr = syncer.communicate(timeout=120)
    assert syncer.returncode == 75, stderr
    assert (
        stderr.startswith("walbuf: error: wandb-core, the process wandb uploads through, ended")
        and stderr.count("\n") == 1
    )
    assert run_sync(server, buffer).returncode == 0
    assert set(steps_arrived(server, buffer)) == set(range(50))


@pytest.mark.backends("sqlite")
def test_max_seconds_bounds_the_process_when_wandb_core_stops_answering(server, buffer):
    log_steps(buffer, range(10))
    server.hold_uploads()
    start = time.monotonic()
    syncer = subprocess.Popen(
        [sys.executable, "-m", "walbuf", "sync", str(buffer), "--quiet", "--max-seconds", "8"],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **server.env()},
    )
    server.wait_for_rows(1, timeout=60)
    (core,) = wandb_cores(syncer.pid)
    os.kill(core, signal.SIGSTOP)  # frozen: wandb's finish, and its teardown at exit, wait for it
    server.release_uploads()
    _, stderr = syncer.communicate(timeout=120)
    elapsed = time.monotonic() - start
    assert syncer.returncode == 75, stderr
    # Cut off in run.finish(), the upload is abandoned (wandb-core killed):
    # wandb's exit hook has nothing to wait for.
    assert "time bound passed before W&B confirmed the upload" in stderr and "Traceback" not in stderr
    assert elapsed < 8 + 1, elapsed
    assert process_state(core) in (None, "Z")  # killed with the sync: it sends nothing more
    assert status(buffer)["pending"] == 10


@pytest.mark.backends("sqlite")
def test_a_sync_cut_off_inside_wandb_init_leaves_no_wandb_core_behind(server, buffer, tmp_path):
    log_steps(buffer, range(10))
    server.stall()  # W&B answers nothing: wandb.init waits
    errors = tmp_path / "stderr"
    start = time.monotonic()
    with errors.open("w") as stderr:  # a file, not a pipe: a wandb-core left behind would hold a pipe open
        syncer = subprocess.Popen(
            [sys.executable, "-m", "walbuf", "sync", str(buffer), "--quiet", "--max-seconds", "8"],
            stderr=stderr,
            env={**os.environ, **server.env()},
        )
    while not (cores := wandb_cores(syncer.pid)):
        assert syncer.poll() is None, errors.read_text()
        time.sleep(0.01)  # how often to look; nothing waits on its length
    (core,) = cores
    # Frozen as it starts: it never answers wandb.init, and cannot notice the
    # sync's end (wandb-core ends itself when the process that started it does).
    os.kill(core, signal.SIGSTOP)
    try:
        syncer.wait(timeout=60)
        elapsed = time.monotonic() - start
        assert process_state(core) in (None, "Z")  # killed with the sync: it sends nothing, ever
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(core, signal.SIGKILL)
        server.unstall()
    assert syncer.returncode == 75, errors.read_text()
    assert "time bound passed" in errors.read_text() and "Traceback" not in errors.read_text()
    assert elapsed < 8 + 1, elapsed
    assert status(buffer)["pending"] == 10


def process_state(pid):
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    return stat[stat.rindex(")") + 2]


@pytest.mark.backends("sqlite")
def test_storage_refusing_an_image_upload_is_retried_later_and_never_refuses_the_runs_target(server, buffer):
    import numpy as np

    with walbuf.Writer(buffer, writer="w", run="exp") as w:
        w.log({"x": 0, "img": walbuf.Image(np.zeros((4, 4, 3), dtype=np.uint8))})
        w.log({"x": 1})
    server.refuse_file_uploads(403)
    proc = run_sync(server, buffer)
    assert proc.returncode == 75 and "file storage refused the upload of media/images/" in proc.stderr, proc.stderr
    assert status(buffer)["target_refused"] is None and status(buffer)["pending"] == 2
    server.refuse_file_uploads(None)
    assert run_sync(server, buffer).returncode == 0
    (fake_run,) = server.runs.values()
    assert any(name.startswith("media/images/") for name in fake_run.files)
    assert set(steps_arrived(server, buffer)) == {0, 1}


# What confirms an upload is wandb-core's account of W&B's answers, never the absence of an error
# line: where that account is lost (its log's writes dropped by the filesystem), nothing is marked synced.


@pytest.mark.backends("sqlite")
def test_a_failed_upload_whose_log_was_lost_marks_nothing_synced(server, buffer, tmp_path):
    fsbed.require()
    log_steps(buffer, range(2_000))
    server.fail_with(500, "file_stream")
    with fsbed.lossy(tmp_path, "debug-internal.log") as cache:
        proc = run_sync(server, buffer, env={"XDG_CACHE_HOME": str(cache)})
    assert proc.returncode == 75 and "W&B did not confirm the upload" in proc.stderr, proc.stderr
    assert status(buffer)["pending"] == 2_000


@pytest.mark.backends("sqlite")
def test_an_upload_w_and_b_took_is_still_not_marked_synced_without_wandb_cores_account_of_it(server, buffer, tmp_path):
    fsbed.require()
    log_steps(buffer, range(20))
    with fsbed.lossy(tmp_path, "debug-internal.log") as cache:
        proc = run_sync(server, buffer, env={"XDG_CACHE_HOME": str(cache)})
    assert proc.returncode == 75 and "holds no account of the upload" in proc.stderr, proc.stderr
    assert status(buffer)["pending"] == 20  # sent again by the next sync: at least once, never lost
