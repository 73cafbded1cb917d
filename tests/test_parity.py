"""Parity with the seed: the run walbuf makes is the run the user would have had logging online.

The scenario of wandb's shared-mode pull request (tests/seed_scenario.py)
runs twice against one fake server: natively, with the real wandb SDK in
shared mode as the seed's train.py and eval.py do, and through walbuf with
prefix="" and syncs while the job runs. The two W&B runs must end with the
same history keys, the same metric definitions and the same values on each
axis.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import walbuf

pytestmark = pytest.mark.slow

SCENARIO = Path(__file__).with_name("seed_scenario.py")
WANDB_OWN = {"_step", "_runtime", "_timestamp"}


def history_keys(fake_run):
    return {key for row in fake_run.history for key in row} - WANDB_OWN


def definitions(fake_run):
    return {name: step for name, step in fake_run.metric_definitions().items() if step is not None}


def values_on_axes(fake_run):
    """metric -> sorted (value of its step metric, value) of the rows holding it."""
    found = {}
    for name, axis in definitions(fake_run).items():
        found[name] = sorted((row[axis], row[name]) for row in fake_run.history if name in row)
    return found


def test_the_seed_scenario_through_walbuf_ends_as_the_native_shared_mode_run(server, tmp_path):
    env = {k: v for k, v in {**os.environ, **server.env()}.items() if k != "WANDB_SERVICE"}
    native_dir, walbuf_dir = tmp_path / "native", tmp_path / "walbuf"
    native_dir.mkdir()
    walbuf_dir.mkdir()
    subprocess.run(
        [sys.executable, str(SCENARIO), "native-train", "parity-native"],
        check=True,
        env=env,
        cwd=native_dir,
        timeout=600,
        capture_output=True,
    )
    buffer = walbuf_dir / "runs.db"
    subprocess.run(
        [sys.executable, str(SCENARIO), "walbuf-train", str(buffer)],
        check=True,
        env={**env, "WALBUF_RUN": "seed"},
        cwd=walbuf_dir,
        timeout=600,
        capture_output=True,
    )
    (native,) = [run for (_, project, _), run in server.runs.items() if project == "parity-native"]
    through_walbuf = server.run(walbuf.status(buffer).runs[0].wandb_id)

    assert history_keys(through_walbuf) == history_keys(native) == {"loss", "train_step", "eval_accuracy", "eval_step"}
    assert definitions(through_walbuf) == definitions(native) == {"loss": "train_step", "eval_accuracy": "eval_step"}
    assert values_on_axes(through_walbuf) == values_on_axes(native)
    assert len(values_on_axes(native)["loss"]) == 60 and len(values_on_axes(native)["eval_accuracy"]) == 3
