"""What the W&B run is made of: its keys and axes (prefixes, claims), its summary, its one mode.

Syncs run in this process against the session's fake server (``in_process``),
through the real wandb SDK; tests assert on what the fake ended with.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys

import pytest
import sqlalchemy as sa
from conftest import buffer_exists, buffer_url, record_count, run_sql

import walbuf
from walbuf.directory.layout import ENV_HOST
from walbuf.store import schema

pytestmark = pytest.mark.slow


def synced_run(server, buffer, **options):
    (run,) = walbuf.sync(buffer, **options).runs
    return server.run(run.target.wandb_id)


def definitions(fake_run):
    """Metric name -> step metric, of the definitions that name one (wandb also lists each step metric alone)."""
    return {name: step for name, step in fake_run.metric_definitions().items() if step is not None}


def metric_rows(fake_run, *keys):
    """The rows holding every one of ``keys``, as tuples of their values."""
    return [tuple(row[k] for k in keys) for row in fake_run.history if all(k in row for k in keys)]


# -- prefixes -------------------------------------------------------------------


def test_prefix_empty_sends_keys_and_step_axis_as_logged(in_process, buffer):
    with walbuf.Writer(buffer, writer="train", prefix="", step_axis="train_step") as w:
        for i in range(3):
            w.log({"loss": 1.0 / (i + 1)})
    fake = synced_run(in_process, buffer)
    assert metric_rows(fake, "train_step", "loss") == [(0, 1.0), (1, 0.5), (2, 1.0 / 3)]
    assert not any(key.startswith("train/") for row in fake.history for key in row)
    assert definitions(fake) == {"loss": "train_step"}


def test_writers_with_one_prefix_and_axis_make_one_curve_with_one_definition(in_process, buffer):
    with (
        walbuf.Writer(buffer, writer="eval-1", prefix="eval", step_axis="epoch") as a,
        walbuf.Writer(buffer, writer="eval-2", prefix="eval", step_axis="epoch") as b,
    ):
        a.log({"accuracy": 0.5}, step=0)
        b.log({"accuracy": 0.7}, step=1)
    fake = synced_run(in_process, buffer)
    assert metric_rows(fake, "eval/epoch", "eval/accuracy") == [(0, 0.5), (1, 0.7)]
    assert definitions(fake) == {"eval/*": "eval/epoch"}
    assert fake.step_metric_of("eval/accuracy") == "eval/epoch"


def test_walbuf_prefix_from_the_environment_may_be_empty(in_process, buffer, monkeypatch):
    monkeypatch.setenv("WALBUF_PREFIX", "")
    with walbuf.Writer(buffer, writer="rank-0") as w:
        w.log({"loss": 1.0})
    fake = synced_run(in_process, buffer)
    assert metric_rows(fake, "step", "loss") == [(0, 1.0)]


def test_without_a_prefix_setting_keys_are_under_the_writer_id(in_process, buffer):
    with walbuf.Writer(buffer, writer="rank-3") as w:
        w.log({"loss": 1.0})
    fake = synced_run(in_process, buffer)
    assert metric_rows(fake, "rank-3/step", "rank-3/loss") == [(0, 1.0)]
    assert definitions(fake) == {"rank-3/*": "rank-3/step"}


@pytest.mark.parametrize("prefix", ["a*", "a/", "/a", "  ", "a\nb", 3])
def test_a_prefix_w_and_b_cannot_take_is_refused_before_anything_is_stored(buffer, prefix):
    with pytest.raises(walbuf.ConfigError, match="prefix"):
        walbuf.Writer(buffer, writer="w", prefix=prefix)
    assert not buffer_exists(buffer)


def test_a_writer_reopened_with_another_prefix_is_refused(buffer):
    with walbuf.Writer(buffer, writer="w", prefix="") as w:
        w.log({"loss": 1.0})
    with pytest.raises(walbuf.WriterConflictError, match="prefix"):
        walbuf.Writer(buffer, writer="w", prefix="other")


# -- claims: one W&B key, one axis ------------------------------------------------


@pytest.mark.backends("sqlite", "postgresql")
def test_two_writers_putting_one_key_on_two_axes_are_refused_at_log_naming_the_other(buffer):
    with (
        walbuf.Writer(buffer, writer="train", prefix="", step_axis="train_step") as train,
        walbuf.Writer(buffer, writer="eval", prefix="", step_axis="eval_step") as evaluation,
    ):
        train.log({"loss": 1.0})
        with pytest.raises(walbuf.KeyConflictError, match=r"'loss'.*'train'.*prefix"):
            evaluation.log({"loss": 2.0, "accuracy": 0.5})
        evaluation.log({"accuracy": 0.5})
    assert [(r.writer, r.metrics) for r in walbuf.read(buffer)] == [
        ("train", {"loss": 1.0}),
        ("eval", {"accuracy": 0.5}),
    ]


def test_a_record_refused_for_a_key_conflict_is_refused_every_time(buffer):
    with (
        walbuf.Writer(buffer, writer="train", prefix="", step_axis="train_step") as train,
        walbuf.Writer(buffer, writer="eval", prefix="", step_axis="eval_step") as evaluation,
    ):
        train.log({"loss": 1.0})
        for _ in range(2):  # nothing of a refused record is remembered as checked
            with pytest.raises(walbuf.KeyConflictError):
                evaluation.log({"loss": 2.0})
    assert record_count(buffer) == 1


def test_a_metric_named_like_another_writers_step_axis_is_refused(buffer):
    with (
        walbuf.Writer(buffer, writer="train", prefix="", step_axis="train_step") as train,
        walbuf.Writer(buffer, writer="other", prefix="") as other,
    ):
        train.log({"loss": 1.0})
        with pytest.raises(walbuf.KeyConflictError, match="step axis of writer 'train'"):
            other.log({"train_step": 3})
    assert record_count(buffer) == 1


def test_a_claim_holds_across_processes_and_reopening(buffer):
    with walbuf.Writer(buffer, writer="train", prefix="", step_axis="train_step") as w:
        w.log({"loss": 1.0})
    code = (
        "import sys, walbuf\n"
        "with walbuf.Writer(sys.argv[1], writer='eval', prefix='', step_axis='eval_step') as w:\n"
        "    try:\n"
        "        w.log({'loss': 2.0})\n"
        "    except walbuf.KeyConflictError:\n"
        "        sys.exit(7)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(buffer)], capture_output=True, text=True)
    assert proc.returncode == 7, proc.stderr


def test_on_a_directory_buffer_a_conflict_across_hosts_is_quarantined_at_sync(in_process, tmp_path, monkeypatch):
    directory = str(tmp_path / "buf") + "/"  # the trailing '/' makes it a directory buffer
    monkeypatch.setenv(ENV_HOST, "node1")
    with walbuf.Writer(directory, writer="train", prefix="", step_axis="train_step") as w:
        w.log({"loss": 1.0})
    # Another host's shard: log() there cannot see node1's claims.
    monkeypatch.setenv(ENV_HOST, "node2")
    with walbuf.Writer(directory, writer="eval", prefix="", step_axis="eval_step") as w:
        w.log({"loss": 2.0})
        w.log({"accuracy": 0.5})
    monkeypatch.setenv(ENV_HOST, "node1")
    result = walbuf.sync(directory)
    (run,) = result.runs
    (quarantined,) = run.quarantined
    assert quarantined.writer == "eval" and "'train'" in quarantined.reason
    fake = in_process.run(run.target.wandb_id)
    assert metric_rows(fake, "train_step", "loss") == [(0, 1.0)]
    assert metric_rows(fake, "eval_step", "accuracy") == [(1, 0.5)]
    assert definitions(fake) == {"loss": "train_step", "accuracy": "eval_step"}


# -- the decorator ------------------------------------------------------------------


def test_a_decorated_function_in_a_process_pool_logs_one_stream_named_for_it(buffer):
    with concurrent.futures.ProcessPoolExecutor(2) as pool:
        results = list(pool.map(_evaluate, [str(buffer)] * 6, range(6)))
    assert sorted(r["n"] for r in results) == list(range(6))
    records = list(walbuf.read(buffer))
    assert {r.writer for r in records} == {"_evaluate_checkpoint"}
    assert sorted(r.step for r in records) == list(range(6))


def _evaluate(buffer, n):
    @walbuf.logged(buffer)
    def _evaluate_checkpoint(n):
        return {"n": n}

    return _evaluate_checkpoint(n)


# -- buffers of an older walbuf ------------------------------------------------------


@pytest.mark.backends("sqlite", "postgresql")
def test_a_buffer_of_an_older_walbuf_keeps_its_names_in_w_and_b(in_process, buffer):
    if not isinstance(buffer, str):
        buffer.parent.mkdir(parents=True, exist_ok=True)
    engine = sa.create_engine(buffer_url(buffer))
    with engine.begin() as conn:
        schema.upgrade(conn, "0007")
        conn.exec_driver_sql("INSERT INTO runs (id, name, created_at) VALUES (1, 'exp1', 0)")
        conn.exec_driver_sql(
            "INSERT INTO writers (id, run_id, name, step_axis, host, pid, opened_at, closed_at)"
            " VALUES (1, 1, 'rank-0', 'step', 'h', 1, 0, 1)"
        )
        conn.exec_driver_sql("INSERT INTO records (writer_id, step, time, metrics) VALUES (1, 0, 0, '{\"loss\": 1.5}')")
    engine.dispose()
    with walbuf.Writer(buffer, writer="rank-0", run="exp1") as w:  # upgrades the buffer
        w.log({"loss": 0.5})
    assert run_sql(buffer, "SELECT name, prefix FROM writers") == [("rank-0", "rank-0")]
    fake = synced_run(in_process, buffer)
    assert metric_rows(fake, "rank-0/step", "rank-0/loss") == [(0, 1.5), (1, 0.5)]


# -- the summary -----------------------------------------------------------------------


@pytest.mark.backends("sqlite", "postgresql")
def test_every_sync_sends_the_whole_summary_last_values_overlaid_by_explicit_entries(in_process, buffer):
    with walbuf.Writer(buffer, writer="train", prefix="", step_axis="train_step") as w:
        for i in range(3):
            w.log({"loss": 3.0 - i})
        w.summary({"best_loss": 1.0})
    fake = synced_run(in_process, buffer)
    assert {k: fake.summary.get(k) for k in ("loss", "train_step", "best_loss")} == {
        "loss": 1.0,
        "train_step": 2,
        "best_loss": 1.0,
    }
    walbuf.prune(buffer, older_than=0)  # the synced records go; their last values stay known
    with walbuf.Writer(buffer, writer="eval", prefix="", step_axis="eval_step") as w:
        w.log({"accuracy": 0.9})
        w.summary({"loss": 0.25})  # an explicit entry wins over the last value
    fake = synced_run(in_process, buffer)
    assert {k: fake.summary.get(k) for k in ("loss", "train_step", "best_loss", "accuracy", "eval_step")} == {
        "loss": 0.25,
        "train_step": 2,
        "best_loss": 1.0,
        "accuracy": 0.9,
        "eval_step": 0,
    }


# -- config and definitions ---------------------------------------------------------


def test_each_sync_sends_the_whole_config_from_its_first_update_and_all_definitions_after(in_process, buffer):
    with walbuf.Writer(buffer, writer="a", run="exp1") as a:
        a.config({"lr": 0.1})
        a.log({"loss": 1.0})
    fake = synced_run(in_process, buffer)
    first_sync = len(fake.upserts)
    with walbuf.Writer(buffer, writer="b", run="exp1") as b:
        b.log({"loss": 2.0})
    synced_run(in_process, buffer)
    second = [json.loads(u["config"]) for u in fake.upserts[first_sync:] if u.get("config")]
    assert second and all(c.get("lr", {}).get("value") == 0.1 for c in second)
    # Each wandb.init's own update carries the config but no definitions yet
    # (wandb-core adds a process's definitions as it makes them: runupserter.go);
    # every other update carries all of them, never a part.
    sets = [{e.get("2") for e in c["_wandb"]["value"]["m"] if e.get("5")} for c in second]
    assert {"a/*", "b/*"} in sets and all(found in ({"a/*", "b/*"}, set()) for found in sets)
    assert definitions(fake) == {"a/*": "a/step", "b/*": "b/step"}


# -- one mode per W&B run -----------------------------------------------------------


def test_a_run_synced_offline_is_refused_online_and_nothing_is_sent(in_process, buffer, tmp_path):
    with walbuf.Writer(buffer, writer="w", run_id="modes1") as w:
        w.log({"loss": 1.0})
    walbuf.sync(buffer, mode="offline", directory=tmp_path / "offline")
    with walbuf.Writer(buffer, writer="w") as w:
        w.log({"loss": 2.0})
    with pytest.raises(walbuf.ConfigError, match=r"synced offline.*--run-id NEW_ID"):
        walbuf.sync(buffer)
    assert ("walbuf-test", "uncategorized", "modes1") not in in_process.runs
    assert walbuf.status(buffer).runs[0].pending == 1


def test_a_run_synced_online_is_refused_offline(in_process, buffer, tmp_path):
    with walbuf.Writer(buffer, writer="w") as w:
        w.log({"loss": 1.0})
    walbuf.sync(buffer)
    with walbuf.Writer(buffer, writer="w") as w:
        w.log({"loss": 2.0})
    with pytest.raises(walbuf.ConfigError, match="synced online"):
        walbuf.sync(buffer, mode="offline", directory=tmp_path / "offline")
    assert not (tmp_path / "offline").exists()


def test_another_mode_goes_to_the_new_w_and_b_run_given(in_process, buffer, tmp_path):
    with walbuf.Writer(buffer, writer="w", run_id="modes2") as w:
        w.log({"loss": 1.0})
    walbuf.sync(buffer, mode="offline", directory=tmp_path / "offline")
    with walbuf.Writer(buffer, writer="w") as w:
        w.log({"loss": 2.0})
    fake = synced_run(in_process, buffer, run_id="modes2-online")
    assert metric_rows(fake, "w/step", "w/loss") == [(1, 2.0)]
    assert walbuf.status(buffer).runs[0].wandb_id == "modes2-online"


def test_the_fake_refuses_a_shared_writer_on_a_history_wandb_sync_made(server, buffer, tmp_path):
    """The server's rule that the refusal above spares users, shown with wandb's own uploader."""
    with walbuf.Writer(buffer, writer="w", run_id="mixed1", project="mixing") as w:
        w.log({"loss": 1.0})
    env = {k: v for k, v in {**os.environ, **server.env()}.items() if k != "WANDB_SERVICE"}
    proc = subprocess.run(
        [sys.executable, "-m", "walbuf", "sync", str(buffer), "--mode", "offline", "--dir", str(tmp_path / "off")],
        capture_output=True,
        text=True,
        env=env,
    )
    command = next(line for line in proc.stdout.splitlines() if "wandb sync" in line).split("with: ", 1)[1]
    assert subprocess.run(command.split(), capture_output=True, text=True, env=env).returncode == 0
    code = (
        "import wandb\n"
        "run = wandb.init(id='mixed1', project='mixing', settings=wandb.Settings(mode='shared',"
        " x_primary=False, x_update_finish_state=False, console='off', silent=True))\n"
        "run.log({'loss': 9.0})\n"
        "run.finish()\n"
    )
    subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    fake = server.run("mixed1")
    assert fake.refused_posts >= 1
    assert [row.get("w/loss", row.get("loss")) for row in fake.history] == [1.0]
