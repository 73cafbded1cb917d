"""The seeds' scenario: a trainer logs every step and starts an evaluation process every 20 steps; syncs run meanwhile.

At the end the W&B fake holds both histories complete, each record once.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import rows_of, run_sync

pytestmark = [pytest.mark.backends("sqlite", "postgresql"), pytest.mark.slow]

SCRIPT = Path(__file__).parent.parent / "scripts" / "train_with_eval.py"


def test_trainer_and_its_evaluation_processes_arrive_complete_each_record_once(server, buffer):
    trainer = subprocess.Popen(
        [sys.executable, str(SCRIPT), str(buffer), "--steps", "100", "--every", "20", "--step-seconds", "0.05"]
    )
    syncs_meanwhile = 0
    while trainer.poll() is None:  # as cron would: one sync after another while training runs
        proc = run_sync(server, buffer)
        assert proc.returncode in (0, 66), proc.stderr  # 66: the trainer has not made the buffer yet
        syncs_meanwhile += 1
    assert trainer.returncode == 0
    assert syncs_meanwhile >= 1
    proc = run_sync(server, buffer)
    assert proc.returncode == 0, proc.stderr
    (fake_run,) = server.runs.values()
    assert [step for step, _ in rows_of(fake_run, "trainer")] == list(range(100))
    evals = rows_of(fake_run, "eval", axis="eval_step")
    assert [step for step, _ in evals] == [0, 1, 2, 3, 4]
    assert sorted(m["checkpoint_step"] for _, m in evals) == [19, 39, 59, 79, 99]
    assert len(fake_run.history) == 105
    assert fake_run.step_metric_of("eval/accuracy") == "eval/eval_step"
