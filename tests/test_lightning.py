"""WalbufLogger: real Lightning, CPU torch, 2 processes; every rank's metrics and the hyperparameters reach W&B once."""

from __future__ import annotations

import json
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import rows_of, run_sql, run_sync, the_run
from pytorch_lightning.loggers.logger import DummyExperiment

import walbuf
from walbuf.integrations.lightning import WalbufLogger

pytestmark = pytest.mark.slow  # real processes and syncs: not in the quick loop

EXAMPLE = Path(__file__).parent.parent / "scripts" / "lightning_example.py"
STEPS_PER_RANK = 8  # 64 samples, batches of 8, split over 2 ranks, 2 epochs


def example(buffer, strategy, *options):
    """The example, in processes of its own: each process's report (whether it imported wandb, its experiment)."""
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), str(buffer), "--strategy", strategy, *options],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {
        r["process"]: r for r in map(json.loads, (line for line in proc.stdout.splitlines() if line.startswith("{")))
    }


def train(buffer, strategy):
    return {process: report["wandb_imported"] for process, report in example(buffer, strategy).items()}


@pytest.mark.parametrize("strategy", ["ddp_spawn", "ddp"])
def test_both_ranks_metrics_and_the_hyperparameters_arrive_once(server, tmp_path, strategy):
    buffer = tmp_path / "lightning.db"
    assert train(buffer, strategy) == {"launcher": False, "rank-0": False, "rank-1": False}
    proc = run_sync(server, buffer)
    assert proc.returncode == 0, proc.stderr
    fake_run = the_run(server)
    for rank in (0, 1):
        steps = [
            step
            for step, metrics in rows_of(fake_run, f"rank-{rank}", axis="trainer/global_step")
            if "train/loss" in metrics
        ]
        assert steps == list(range(STEPS_PER_RANK))
    assert len(fake_run.history) == 2 * STEPS_PER_RANK
    config = {k: v["value"] for k, v in fake_run.config.items() if k != "_wandb"}
    assert config == {"lr": 0.05, "hidden": 4}
    assert "warning" not in proc.stderr  # both ranks gave the same hyperparameters
    assert fake_run.step_metric_of("rank-1/train/loss") == "rank-1/trainer/global_step"


def test_a_used_logger_pickles_and_hands_its_writer_over_to_the_copy(tmp_path):
    logger = WalbufLogger(tmp_path / "b.db", run="r", writer="w-{rank}")
    logger.log_metrics({"a": 1.0}, step=0)
    copy = pickle.loads(pickle.dumps(logger))  # what ddp_spawn does before its workers start
    assert (copy.name, copy.version, copy.save_dir) == (logger.name, logger.version, logger.save_dir)
    copy.log_metrics({"a": 2.0}, step=1)  # the same writer id, in the same process: the original let go
    copy.finalize("success")
    assert [(r.writer, r.step, r.metrics) for r in walbuf.read(tmp_path / "b.db")] == [
        ("w-0", 0, {"a": 1.0, "trainer/global_step": 0}),
        ("w-0", 1, {"a": 2.0, "trainer/global_step": 1}),
    ]


def test_rank_zero_only_leaves_other_ranks_silent(tmp_path, monkeypatch):
    from pytorch_lightning.utilities import rank_zero_only

    monkeypatch.setattr(rank_zero_only, "rank", 1, raising=False)
    logger = WalbufLogger(tmp_path / "b.db", rank_zero_only=True)
    logger.log_metrics({"a": 1.0}, step=0)
    logger.log_hyperparams({"lr": 0.1})
    assert isinstance(logger.experiment, DummyExperiment) and not (tmp_path / "b.db").exists()
    assert logger.experiment.log({"a": 1.0}) is None  # Lightning's no-op: anything, anywhere


def test_hyperparameters_walbuf_cannot_store_are_kept_as_text(tmp_path):
    logger = WalbufLogger(tmp_path / "b.db", run="r")
    logger.log_hyperparams({"optimizer": object, "sizes": (1, 2), "nested": {"p": Path("/x")}})
    logger.finalize("success")
    stored = dict(run_sql(tmp_path / "b.db", "SELECT key, value FROM config_entries"))
    assert json.loads(stored["sizes"]) == [1, 2] and json.loads(stored["nested"]) == {"p": "/x"}
    assert "object" in json.loads(stored["optimizer"])


def test_importing_walbuf_imports_neither_lightning_nor_torch():
    code = (
        "import sys, walbuf; print(sorted(m for m in ('torch', 'pytorch_lightning', 'lightning') if m in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "[]"


# -- Lightning's logger contracts (modeled on tests_pytorch/loggers: test_all.py, test_wandb.py) --------


def trainer_for(logger, tmp_path, **options):
    from pytorch_lightning import Trainer

    settings = dict(
        max_epochs=1,
        limit_train_batches=1,
        limit_val_batches=1,
        log_every_n_steps=1,
        default_root_dir=tmp_path,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
    )
    return Trainer(logger=logger, **{**settings, **options})


class HistoryLogger(WalbufLogger):
    """What Lightning handed log_metrics, as test_all.py's StoreHistoryLogger keeps it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.history = []

    def log_metrics(self, metrics, step=None):
        super().log_metrics(metrics, step)
        self.history.append((step, dict(metrics)))


def axis_and_keys(buffer, writer="rank-0"):
    """(its trainer/global_step, its other keys) of each record of ``writer``, in order."""
    return [
        (r.metrics.get("trainer/global_step"), sorted(k for k in r.metrics if k != "trainer/global_step"))
        for r in walbuf.read(buffer, writer=writer)
    ]


def test_fit_then_test_keep_the_steps_lightning_hands_the_logger(tmp_path):
    from pytorch_lightning.demos.boring_classes import BoringModel

    class Model(BoringModel):
        def training_step(self, batch, batch_idx):
            loss = self.step(batch)
            self.log("train_some_val", loss)
            return {"loss": loss}

        def on_validation_epoch_end(self):
            self.log_dict({"early_stop_on": torch.tensor(1), "val_loss": torch.tensor(0.5)})

        def on_test_epoch_end(self):
            self.log("test_loss", torch.tensor(2))

    logger = HistoryLogger(tmp_path / "b.db", save_dir=tmp_path)
    trainer = trainer_for(logger, tmp_path)
    trainer.fit(Model())
    trainer.test(Model(), verbose=False)
    expected = [
        (0, ["epoch", "train_some_val"]),
        (0, ["early_stop_on", "epoch", "val_loss"]),
        (1, ["epoch", "test_loss"]),
    ]
    assert [(step, sorted(metrics)) for step, metrics in logger.history] == expected
    assert axis_and_keys(tmp_path / "b.db") == expected


def test_a_fit_resumed_from_a_checkpoint_logs_again_at_the_steps_it_logged(tmp_path):
    from pytorch_lightning.callbacks import ModelCheckpoint
    from pytorch_lightning.demos.boring_classes import BoringModel

    class Model(BoringModel):
        def training_step(self, batch, batch_idx):
            out = super().training_step(batch, batch_idx)
            self.log("loss", out["loss"])
            return out

    buffer = tmp_path / "b.db"
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    first = HistoryLogger(buffer, save_dir=tmp_path)
    trainer_for(first, tmp_path, max_steps=6, limit_train_batches=64, callbacks=[checkpoints]).fit(Model())
    second = HistoryLogger(buffer, save_dir=tmp_path)  # the job, preempted, started again
    step_4 = next((tmp_path / "ckpt").glob("*step=4.ckpt"))
    trainer_for(second, tmp_path, max_steps=8, limit_train_batches=64).fit(Model(), ckpt_path=step_4)
    sent = [step for step, metrics in first.history + second.history if "loss" in metrics]
    assert sent[:6] == [0, 1, 2, 3, 4, 5] and sent[6:] == [4, 5, 6, 7]  # Lightning's own steps, going back
    assert [axis for axis, keys in axis_and_keys(buffer) if "loss" in keys] == sent


def test_an_unstepped_log_through_the_experiment_lands_at_the_last_step_and_moves_no_other(tmp_path):
    from pytorch_lightning.demos.boring_classes import BoringModel

    class Model(BoringModel):
        def training_step(self, batch, batch_idx):
            out = super().training_step(batch, batch_idx)
            self.log("loss", out["loss"])
            return out

        def validation_step(self, batch, batch_idx):
            self.logger.experiment.log({"sample": 1.0})  # no step, as with W&B's run.log
            return super().validation_step(batch, batch_idx)

    logger = HistoryLogger(tmp_path / "b.db", save_dir=tmp_path)
    trainer_for(logger, tmp_path, max_epochs=2, limit_train_batches=3, limit_val_batches=2).fit(Model())
    stored = axis_and_keys(tmp_path / "b.db")
    assert [axis for axis, keys in stored if "loss" in keys] == [step for step, m in logger.history if "loss" in m]
    assert [axis for axis, keys in stored if keys == ["sample"]] == [0, 0, 2, 2, 5, 5]  # the sanity check's at 0


def test_a_metric_named_global_step_is_logged_like_any_other(tmp_path):
    logger = WalbufLogger(tmp_path / "b.db")
    logger.log_metrics({"global_step": 3.0, "loss": 0.5}, step=3)
    logger.finalize("success")
    (record,) = walbuf.read(tmp_path / "b.db")
    assert record.metrics == {"global_step": 3.0, "loss": 0.5, "trainer/global_step": 3}


def test_a_prefix_goes_before_each_metric_key_as_in_lightnings_loggers(tmp_path):
    logger = WalbufLogger(tmp_path / "b.db", prefix="tmp")
    logger.log_metrics({"test": 1.0}, step=0)
    logger.finalize("success")
    (record,) = walbuf.read(tmp_path / "b.db")
    assert record.metrics == {"tmp-test": 1.0, "trainer/global_step": 0}


def test_what_walbuf_cannot_store_is_stored_as_wandb_logger_stores_it_or_left_out_with_a_warning(tmp_path):
    import numpy as np

    logger = WalbufLogger(tmp_path / "b.db")
    with pytest.warns(UserWarning, match=re.escape("'bad\\nkey' was left out")):
        logger.log_metrics(
            {
                "per_class": torch.tensor([0.5, 0.25]),
                "weights": torch.zeros(40),
                "when": np.datetime64("2026-01-02"),
                "bad\nkey": 1.0,
                "loss": 0.5,
            },
            step=1,
        )
    logger.log_hyperparams(
        {"complex": np.complex128(1 + 2j), "date": np.datetime64("2026-01-02"), "raw": np.bytes_(b"x")}
    )
    logger.finalize("success")
    (record,) = walbuf.read(tmp_path / "b.db")
    assert record.metrics["per_class"] == [0.5, 0.25] and record.metrics["when"] == "2026-01-02"
    assert isinstance(record.metrics["weights"], walbuf.Histogram) and record.metrics["loss"] == 0.5
    assert "bad\nkey" not in record.metrics
    stored = dict(run_sql(tmp_path / "b.db", "SELECT key, value FROM config_entries"))
    assert {k: json.loads(v) for k, v in stored.items()} == {"complex": "(1+2j)", "date": "2026-01-02", "raw": "x"}


def test_log_image_logs_walbuf_images_with_their_captions(tmp_path):
    import numpy as np

    logger = WalbufLogger(tmp_path / "b.db")
    chw = torch.rand(3, 4, 5)
    logger.log_image("samples", [np.zeros((4, 5), dtype=np.uint8), chw], step=2, caption=["a", "b"])
    logger.log_image("one", [np.zeros((2, 2), dtype=np.uint8)], step=2)
    logger.finalize("success")
    first, second = walbuf.read(tmp_path / "b.db")
    assert {k: (v.width, v.height, v.caption) for k, v in first.metrics.items() if k != "trainer/global_step"} == {
        "samples/0": (5, 4, "a"),
        "samples/1": (5, 4, "b"),
    }
    assert isinstance(second.metrics["one"], walbuf.Image) and first.metrics["trainer/global_step"] == 2


def test_checkpoints_and_the_cli_config_go_under_save_dir_run_and_a_version_of_each_logger(tmp_path):
    from pytorch_lightning.demos.boring_classes import BoringModel

    dirs = []
    for _ in range(2):  # two experiments on the default run
        logger = WalbufLogger(tmp_path / "b.db", save_dir=tmp_path / "out")
        trainer = trainer_for(logger, tmp_path)
        assert trainer.log_dir == str(tmp_path / "out")
        trainer.fit(BoringModel())
        dirs.append(Path(trainer.checkpoint_callback.dirpath))
    assert dirs[0] != dirs[1] and all(d.parent.parent == tmp_path / "out" / "default" for d in dirs)


def test_lightning_cli_fits_with_the_logger_and_saves_its_config(tmp_path):
    pytest.importorskip("jsonargparse")
    from pytorch_lightning.cli import LightningCLI
    from pytorch_lightning.demos.boring_classes import BoringDataModule, BoringModel

    class Model(BoringModel):
        def training_step(self, batch, batch_idx):
            out = super().training_step(batch, batch_idx)
            self.log("loss", out["loss"])
            return out

    cli = LightningCLI(
        Model,
        BoringDataModule,
        args=[
            "fit",
            "--trainer.max_steps=2",
            "--trainer.limit_val_batches=1",
            "--trainer.log_every_n_steps=1",
            "--trainer.enable_progress_bar=false",
            "--trainer.logger=walbuf.integrations.lightning.WalbufLogger",
            f"--trainer.logger.buffer={tmp_path / 'b.db'}",
            f"--trainer.logger.save_dir={tmp_path / 'out'}",
        ],
    )
    assert (tmp_path / "out" / "config.yaml").exists()
    assert [r.metrics["trainer/global_step"] for r in walbuf.read(tmp_path / "b.db")] == [0, 1]
    assert cli.trainer.global_step == 2


def test_the_logger_used_in_the_launcher_before_ddp_spawn_hands_its_writer_to_rank_0(tmp_path):
    buffer = tmp_path / "b.db"
    reports = example(buffer, "ddp_spawn", "--log-first")
    assert set(reports) == {"launcher", "rank-0", "rank-1"}
    assert {r.writer for r in walbuf.read(buffer)} == {"rank-0", "rank-1"}
    assert [r.metrics for r in walbuf.read(buffer, writer="rank-0")][0] == {
        "launcher/ready": 1,
        "trainer/global_step": 0,
    }


def test_with_rank_zero_only_other_ranks_get_lightnings_dummy_experiment(tmp_path):
    buffer = tmp_path / "b.db"
    reports = example(buffer, "ddp_spawn", "--rank-zero-only")
    assert reports["rank-0"]["experiment"] == "Experiment" and reports["rank-1"]["experiment"] == "_DummyExperiment"
    assert {r.writer for r in walbuf.read(buffer)} == {"rank-0"}
