"""WalbufCallback: the real Trainer under torchrun, 2 CPU processes, a tiny GPT-2 built from a config.

What the Trainer logs arrives in one W&B run under W&B's own callback's
names, with the arguments and model config, parameter histograms and an image.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

import walbuf
from conftest import rows_of, run_sync
from test_accelerate import the_run, torchrun
from walbuf import ConfigError
from walbuf.integrations.transformers import WalbufCallback

pytestmark = pytest.mark.slow  # real processes and syncs: not in the quick loop

EXAMPLE = Path(__file__).parent.parent / "scripts" / "transformers_example.py"
AXIS = "train/global_step"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The example run once with 2 processes, the main one writing, then synced: (buffer, reports, the W&B run)."""
    from wandb_server import FakeWandb

    buffer = tmp_path_factory.mktemp("transformers") / "main.db"
    reports = torchrun(EXAMPLE, str(buffer))
    with FakeWandb() as server:
        proc = run_sync(server, buffer)
        assert proc.returncode == 0, proc.stderr
        yield buffer, reports, the_run(server)


def test_no_process_imports_wandb(trained):
    assert trained[1] == {"rank-0": False, "rank-1": False}


def test_the_trainers_logs_arrive_on_its_global_step_under_w_and_bs_names(trained):
    _, _, fake_run = trained
    rows = rows_of(fake_run, "rank-0", axis=AXIS)
    assert [step for step, metrics in rows if "train/loss" in metrics] == [2, 4, 6]
    assert [step for step, metrics in rows if "eval/loss" in metrics] == [3, 6]
    assert fake_run.step_metric_of("rank-0/eval/loss") == "rank-0/" + AXIS
    assert {"train/learning_rate", "train/grad_norm", "train/epoch"} <= set(rows[0][1])


def test_the_arguments_and_model_config_are_the_runs_config_and_end_figures_its_summary(trained):
    _, _, fake_run = trained
    config = {k: v["value"] for k, v in fake_run.config.items() if k != "_wandb"}
    assert config["learning_rate"] == 1e-3 and config["max_steps"] == 6 and config["report_to"] == []
    assert config["n_embd"] == 16 and config["model_type"] == "gpt2" and config["model/num_parameters"] > 0
    assert fake_run.summary["train_runtime"] > 0 and "train_loss" in fake_run.summary
    assert not any("train_runtime" in row for row in fake_run.history)


def test_parameter_histograms_and_the_image_arrive(trained):
    buffer, _, fake_run = trained
    stored = {(r.step, key): value for r in walbuf.read(buffer) for key, value in r.metrics.items()}
    rows = dict(rows_of(fake_run, "rank-0", axis=AXIS))
    histogram = stored[(4, "parameters/transformer.wte.weight")]
    assert rows[4]["parameters/transformer.wte.weight"] == {
        "_type": "histogram", "values": list(histogram.counts), "bins": list(histogram.bins)
    }
    (image_row,) = [metrics for step, metrics in rows_of(fake_run, "rank-0", axis=AXIS) if "embeddings" in metrics]
    assert fake_run.files[image_row["embeddings"]["path"]] == stored[(6, "embeddings")].png


def test_with_every_process_each_is_a_writer_and_both_arrive_in_one_run(server, tmp_path):
    buffer = tmp_path / "every.db"
    assert torchrun(EXAMPLE, str(buffer), "--every-process") == {"rank-0": False, "rank-1": False}
    assert run_sync(server, buffer).returncode == 0
    fake_run = the_run(server)
    for writer in ("rank-0", "rank-1"):
        assert [s for s, m in rows_of(fake_run, writer, axis=AXIS) if "train/loss" in m] == [2, 4, 6]
    assert fake_run.complete and fake_run.exit_code == 0


def test_a_process_that_is_not_the_main_one_writes_nothing_by_default(tmp_path):
    callback = WalbufCallback(tmp_path / "b.db")
    state = SimpleNamespace(is_world_process_zero=False, global_step=1)
    callback.on_log(None, state, None, logs={"loss": 1.0})
    assert not (tmp_path / "b.db").exists()


def test_settings_default_from_the_environment_and_are_checked_at_once(tmp_path, monkeypatch):
    monkeypatch.setenv("WALBUF_BUFFER", str(tmp_path / "env.db"))
    monkeypatch.setenv("WALBUF_PREFIX", "")
    callback = WalbufCallback(run="r")
    callback.on_log(None, SimpleNamespace(is_world_process_zero=True, global_step=5), None, logs={"eval_acc": 0.5})
    callback.close()
    (record,) = walbuf.read(tmp_path / "env.db")
    assert (record.step, record.metrics) == (5, {"eval/acc": 0.5})
    with pytest.raises(ConfigError, match="run"):
        WalbufCallback(run="")
