"""WalbufTracker: real Accelerate under torchrun, 2 CPU processes; both arrive in one W&B run with histogram and image."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import walbuf
from conftest import rows_of, run_sync
from walbuf import ConfigError
from walbuf.integrations.accelerate import WalbufTracker

pytestmark = pytest.mark.slow  # real processes and syncs: not in the quick loop

EXAMPLE = Path(__file__).parent.parent / "scripts" / "accelerate_example.py"
STEPS = 6


def torchrun(script: Path, *args: str, env: dict[str, str] | None = None) -> dict[str, bool]:
    """``script`` under torchrun with 2 processes; process -> whether it imported wandb (each prints a line)."""
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script), *args],
        capture_output=True, text=True, timeout=600, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Each report is one write() of a short line, so it is never split; but the
    # Trainer prints on the same stdout, and another process's print may have
    # written its text and not yet its newline: find the reports anywhere.
    reports = [json.loads(found) for found in REPORT.findall(proc.stdout)]
    return {r["process"]: r["wandb_imported"] for r in reports}


REPORT = re.compile(r'\{"process": "[^"]*", "wandb_imported": (?:true|false)\}')


def the_run(server):
    (fake_run,) = server.runs.values()
    return fake_run


def test_two_processes_log_into_one_run_with_config_histogram_and_image(server, tmp_path):
    buffer = tmp_path / "accelerate.db"
    assert torchrun(EXAMPLE, str(buffer), "--steps", str(STEPS)) == {"rank-0": False, "rank-1": False}
    stored = {r.writer + "/" + key: value for r in walbuf.read(buffer) for key, value in r.metrics.items()}
    proc = run_sync(server, buffer)
    assert proc.returncode == 0, proc.stderr
    fake_run = the_run(server)
    for rank in (0, 1):
        steps = [step for step, metrics in rows_of(fake_run, f"rank-{rank}") if "loss" in metrics]
        assert steps == list(range(STEPS))
        assert fake_run.step_metric_of(f"rank-{rank}/loss") == f"rank-{rank}/step"
    config = {k: v["value"] for k, v in fake_run.config.items() if k != "_wandb"}
    assert config == {"lr": 0.05, "hidden": 4, "steps": STEPS}
    (last,) = [metrics for step, metrics in rows_of(fake_run, "rank-0") if step == STEPS]
    histogram = stored["rank-0/weights"]
    assert last["weights"] == {"_type": "histogram", "values": list(histogram.counts), "bins": list(histogram.bins)}
    assert last["weights_image"]["_type"] == "image-file" and last["weights_image"]["caption"] == "layer 0"
    assert fake_run.files[last["weights_image"]["path"]] == stored["rank-0/weights_image"].png
    assert fake_run.complete and fake_run.exit_code == 0  # both processes closed their writers


def test_a_bad_setting_fails_when_the_tracker_is_made(tmp_path):
    with pytest.raises(ConfigError, match="durability"):
        WalbufTracker(tmp_path / "b.db", durability="sometimes")  # type: ignore[arg-type]


def test_settings_default_from_the_environment_as_for_walbuf_init(tmp_path, monkeypatch):
    monkeypatch.setenv("WALBUF_BUFFER", str(tmp_path / "env.db"))
    monkeypatch.setenv("WALBUF_RUN", "from-env")
    monkeypatch.setenv("RANK", "3")
    tracker = WalbufTracker()
    tracker.store_init_configuration({"lr": 0.1, "dtype": object()})
    tracker.log({"loss": 1.0}, step=7)
    tracker.finish()
    (record,) = walbuf.read(tmp_path / "env.db")
    assert (record.run, record.writer, record.step, record.metrics) == ("from-env", "rank-3", 7, {"loss": 1.0})


def test_main_process_only_leaves_other_processes_silent(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    tracker = WalbufTracker(tmp_path / "b.db", main_process_only=True)
    tracker.store_init_configuration({"lr": 0.1})
    tracker.log({"loss": 1.0}, step=0)
    tracker.finish()
    assert not (tmp_path / "b.db").exists()
