"""WalbufLogger: real Lightning, CPU torch, 2 processes; every rank's metrics and the hyperparameters reach W&B once."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

import walbuf
from conftest import rows_of, run_sql, run_sync
from walbuf.integrations.lightning import WalbufLogger

pytestmark = pytest.mark.slow  # real processes and syncs: not in the quick loop

EXAMPLE = Path(__file__).parent.parent / "scripts" / "lightning_example.py"
STEPS_PER_RANK = 8  # 64 samples, batches of 8, split over 2 ranks, 2 epochs


def train(buffer, strategy):
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), str(buffer), "--strategy", strategy],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return {r["process"]: r["wandb_imported"] for r in reports}


def the_run(server):
    (fake_run,) = server.runs.values()
    return fake_run


@pytest.mark.parametrize("strategy", ["ddp_spawn", "ddp"])
def test_both_ranks_metrics_and_the_hyperparameters_arrive_once(server, tmp_path, strategy):
    buffer = tmp_path / "lightning.db"
    assert train(buffer, strategy) == {"launcher": False, "rank-0": False, "rank-1": False}
    proc = run_sync(server, buffer)
    assert proc.returncode == 0, proc.stderr
    fake_run = the_run(server)
    for rank in (0, 1):
        steps = [step for step, metrics in rows_of(fake_run, f"rank-{rank}", axis="global_step") if "train/loss" in metrics]
        assert steps == list(range(STEPS_PER_RANK))
    assert len(fake_run.history) == 2 * STEPS_PER_RANK
    config = {k: v["value"] for k, v in fake_run.config.items() if k != "_wandb"}
    assert config == {"lr": 0.05, "hidden": 4}
    assert "warning" not in proc.stderr  # both ranks gave the same hyperparameters
    assert fake_run.step_metric_of("rank-1/train/loss") == "rank-1/global_step"


def test_the_logger_pickles_as_its_settings_and_a_copy_writes_on_its_own(tmp_path):
    logger = WalbufLogger(tmp_path / "b.db", run="r", writer="w-{rank}")
    logger.log_metrics({"a": 1.0}, step=0)
    copy = pickle.loads(pickle.dumps(logger))
    assert copy._writer is None and copy.name == "r" and copy.version == "w-0"
    logger.finalize("success")
    copy.log_metrics({"a": 2.0}, step=1)
    copy.finalize("success")
    assert [(r.writer, r.step, r.metrics) for r in walbuf.read(tmp_path / "b.db")] == [
        ("w-0", 0, {"a": 1.0}),
        ("w-0", 1, {"a": 2.0}),
    ]


def test_rank_zero_only_leaves_other_ranks_silent(tmp_path, monkeypatch):
    from pytorch_lightning.utilities import rank_zero_only

    monkeypatch.setattr(rank_zero_only, "rank", 1, raising=False)
    logger = WalbufLogger(tmp_path / "b.db", rank_zero_only=True)
    logger.log_metrics({"a": 1.0}, step=0)
    logger.log_hyperparams({"lr": 0.1})
    assert logger.experiment is None and not (tmp_path / "b.db").exists()


def test_hyperparameters_walbuf_cannot_store_are_kept_as_text(tmp_path):
    logger = WalbufLogger(tmp_path / "b.db", run="r")
    logger.log_hyperparams({"optimizer": object, "sizes": (1, 2), "nested": {"p": Path("/x")}})
    logger.finalize("success")
    stored = dict(run_sql(tmp_path / "b.db", "SELECT key, value FROM config_entries"))
    assert json.loads(stored["sizes"]) == [1, 2] and json.loads(stored["nested"]) == {"p": "/x"}
    assert "object" in json.loads(stored["optimizer"])


def test_importing_walbuf_imports_neither_lightning_nor_torch():
    code = "import sys, walbuf; print(sorted(m for m in ('torch', 'pytorch_lightning', 'lightning') if m in sys.modules))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "[]"
