"""WalbufCallback: the real Trainer under torchrun, 2 CPU processes, a tiny GPT-2 built from a config.

What the Trainer logs arrives in one W&B run under W&B's own callback's
names, with the arguments and model config, parameter histograms and an image.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import rows_of, run_sql, run_sync
from test_accelerate import the_run, torchrun

import walbuf
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
    stored = {(r.metrics[AXIS], key): value for r in walbuf.read(buffer) for key, value in r.metrics.items()}
    rows = dict(rows_of(fake_run, "rank-0", axis=AXIS))
    histogram = stored[(4, "parameters/transformer.wte.weight")]
    assert rows[4]["parameters/transformer.wte.weight"] == {
        "_type": "histogram",
        "values": list(histogram.counts),
        "bins": list(histogram.bins),
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
    assert (record.run, record.step, record.metrics) == ("r", 0, {"eval/acc": 0.5, AXIS: 5})
    with pytest.raises(ConfigError, match="run"):
        WalbufCallback(run="")


# -- the Trainer's event flow, as transformers' test_trainer_callback.py drives it: in this process --------


class Regression(torch.nn.Module):
    """y = a*x + b: a model the Trainer trains (it returns its loss), as transformers' tests' RegressionModel."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.tensor(0.0))
        self.b = torch.nn.Parameter(torch.tensor(0.0))

    def forward(self, x, labels=None):
        y = self.a * x + self.b
        return {"loss": torch.nn.functional.mse_loss(y, labels), "logits": y} if labels is not None else {"logits": y}


def regression_data(n=64):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=generator)
    return [{"x": x[i], "labels": 2 * x[i] + 1} for i in range(n)]


def a_trainer(tmp_path, callback, **arguments):
    from transformers import Trainer, TrainingArguments

    settings = dict(
        output_dir=str(tmp_path / "out"),
        report_to="none",
        logging_steps=1,
        per_device_train_batch_size=8,
        max_steps=4,
        save_steps=2,
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        learning_rate=0.1,
    )
    args = TrainingArguments(**{**settings, **arguments})
    data = regression_data()
    return Trainer(model=Regression(), args=args, train_dataset=data, eval_dataset=data, callbacks=[callback])


def axis_values(buffer, key="train/loss"):
    return [r.metrics[AXIS] for r in walbuf.read(buffer) if key in r.metrics]


def test_a_job_resumed_from_its_checkpoint_logs_again_at_the_steps_it_logged(tmp_path):
    buffer = tmp_path / "b.db"
    a_trainer(tmp_path, WalbufCallback(buffer)).train()
    resumed = a_trainer(tmp_path, WalbufCallback(buffer), max_steps=6)  # the job, preempted, started again
    resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    assert axis_values(buffer) == [1, 2, 3, 4, 3, 4, 5, 6]


def test_train_called_twice_on_one_trainer_logs_both(tmp_path):
    buffer = tmp_path / "b.db"
    trainer = a_trainer(tmp_path, WalbufCallback(buffer), max_steps=2)
    trainer.train()
    trainer.train()
    assert axis_values(buffer) == [1, 2, 1, 2]


def test_lists_from_compute_metrics_are_stored_as_w_and_bs_callback_stores_them(tmp_path):
    import numpy as np

    def compute_metrics(prediction):
        return {"per_class_f1": [0.5, 0.25], "confusion": np.array([[1, 0], [0, 1]]), "kind": object}

    buffer = tmp_path / "b.db"
    trainer = a_trainer(tmp_path, WalbufCallback(buffer), max_steps=2)
    trainer.compute_metrics = compute_metrics
    trainer.train()
    metrics = trainer.evaluate()
    (record,) = [r for r in walbuf.read(buffer) if "eval/per_class_f1" in r.metrics]
    assert record.metrics["eval/per_class_f1"] == [0.5, 0.25] == metrics["eval_per_class_f1"]
    assert record.metrics["eval/confusion"] == [[1, 0], [0, 1]]
    assert record.metrics["eval/kind"] == "builtins.object" and record.metrics[AXIS] == 2  # as wandb names a class


def test_a_second_trainer_with_a_callback_of_its_own_in_one_process_logs_on(tmp_path):
    buffer = tmp_path / "b.db"
    for fold in range(2):  # a k-fold loop, a notebook run twice
        a_trainer(tmp_path / str(fold), WalbufCallback(buffer), max_steps=2).train()
    assert axis_values(buffer) == [1, 2, 1, 2]


def test_evaluate_alone_stores_the_config_in_the_run_its_arguments_name(tmp_path):
    buffer = tmp_path / "b.db"
    trainer = a_trainer(tmp_path, WalbufCallback(buffer), run_name="my-run")
    trainer.evaluate()
    assert {r.run for r in walbuf.read(buffer)} == {"my-run"}
    config = dict(run_sql(buffer, "SELECT key, value FROM config_entries"))
    assert config["run_name"] == '"my-run"' and config["max_steps"] == "4"


def test_hyperparameters_w_and_b_stores_as_text_are_stored_as_text(tmp_path):
    import numpy as np

    class Arguments:
        def to_dict(self):
            return {"complex": np.complex64(1 + 2j), "date": np.datetime64("2026-01-02"), "raw": np.bytes_(b"x")}

    callback = WalbufCallback(tmp_path / "b.db")
    callback.on_train_begin(Arguments(), SimpleNamespace(is_world_process_zero=True, global_step=0), None, model=None)
    callback.close()
    config = {k: json.loads(v) for k, v in run_sql(tmp_path / "b.db", "SELECT key, value FROM config_entries")}
    assert config == {"complex": "(1+2j)", "date": "2026-01-02", "raw": "x"}
