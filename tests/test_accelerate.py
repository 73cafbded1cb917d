"""WalbufTracker: real Accelerate under torchrun, 2 CPU processes; both arrive in one W&B run with histogram and
image."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import rows_of, run_sql, run_sync, the_run

import walbuf
from walbuf import ConfigError
from walbuf.integrations.accelerate import WalbufTracker

pytestmark = pytest.mark.slow  # real processes and syncs: not in the quick loop

EXAMPLE = Path(__file__).parent.parent / "scripts" / "accelerate_example.py"
STEPS = 6


def torchrun(script: Path, *args: str, env: dict[str, str] | None = None) -> dict[str, bool]:
    """``script`` under torchrun with 2 processes; process -> whether it imported wandb (each prints a line)."""
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script), *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Each report is one write() of a short line, so it is never split; but the
    # Trainer prints on the same stdout, and another process's print may have
    # written its text and not yet its newline: find the reports anywhere.
    reports = [json.loads(found) for found in REPORT.findall(proc.stdout)]
    return {r["process"]: r["wandb_imported"] for r in reports}


REPORT = re.compile(r'\{"process": "[^"]*", "wandb_imported": (?:true|false)\}')


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
        WalbufTracker(buffer=tmp_path / "b.db", durability="sometimes")  # type: ignore[arg-type]


def test_settings_default_from_the_environment_as_for_walbuf_init(tmp_path, monkeypatch):
    monkeypatch.setenv("WALBUF_BUFFER", str(tmp_path / "env.db"))
    monkeypatch.setenv("WALBUF_RUN", "from-env")
    monkeypatch.setenv("RANK", "3")
    tracker = WalbufTracker()
    tracker.store_init_configuration({"lr": 0.1, "dtype": object()})
    tracker.log({"loss": 1.0}, step=7)
    tracker.finish()
    (record,) = walbuf.read(tmp_path / "env.db")
    assert (record.run, record.writer, record.step, record.metrics) == (
        "from-env",
        "rank-3",
        0,
        {"loss": 1.0, "step": 7},
    )


def test_main_process_only_leaves_other_processes_silent(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    tracker = WalbufTracker(buffer=tmp_path / "b.db", main_process_only=True)
    tracker.store_init_configuration({"lr": 0.1})
    tracker.log({"loss": 1.0}, step=0)
    tracker.finish()
    assert not (tmp_path / "b.db").exists()


# -- Accelerate's tracker contracts (modeled on its test_tracking.py custom-tracker tests) --------------


@pytest.fixture
def accelerate_state():
    """Accelerate's process-wide state, reset afterwards (an Accelerator in this process sets it)."""
    from accelerate.state import AcceleratorState, PartialState

    yield
    AcceleratorState._reset_state(True)
    PartialState._reset_state()


def test_a_tracker_registered_by_name_writes_to_walbuf_buffer_and_takes_the_project_name(
    tmp_path, monkeypatch, accelerate_state
):
    from accelerate import Accelerator
    from accelerate.tracking import register_tracker_class

    monkeypatch.setenv("WALBUF_BUFFER", str(tmp_path / "env.db"))
    monkeypatch.chdir(tmp_path)
    register_tracker_class(WalbufTracker)
    accelerator = Accelerator(cpu=True, log_with="walbuf")
    accelerator.init_trackers("some_project", config={"lr": 0.1})
    accelerator.log({"loss": 1.0}, step=3)
    accelerator.end_training()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["env.db", "env.db.locks"]
    (record,) = walbuf.read(tmp_path / "env.db")
    assert record.metrics == {"loss": 1.0, "step": 3}
    (run,) = walbuf.status(tmp_path / "env.db").runs
    assert run.project == "some_project"


@pytest.mark.parametrize("given", [str, Path], ids=["str", "pathlib.Path"])
def test_a_buffer_given_where_accelerate_puts_its_project_name_is_refused_with_what_to_do(tmp_path, given):
    with pytest.raises(ConfigError, match="give the buffer as buffer="):
        WalbufTracker(given(tmp_path / "b.db"))


def test_a_log_without_a_step_counts_one_on_as_w_and_bs_tracker_does(tmp_path):
    tracker = WalbufTracker(buffer=tmp_path / "b.db", writer="w", run="exp")
    tracker.log({"loss": 1.0})
    tracker.log({"loss": 0.9})
    tracker.log({"loss": 0.8}, step=3)
    tracker.log({"loss": 0.7})
    tracker.finish()
    assert [r.metrics["step"] for r in walbuf.read(tmp_path / "b.db")] == [0, 1, 3, 4]


def test_the_custom_tracker_flow_stores_config_records_and_closes(tmp_path, accelerate_state):
    from accelerate import Accelerator

    tracker = WalbufTracker(buffer=tmp_path / "b.db", run="exp", writer="w", prefix="")
    accelerator = Accelerator(cpu=True, log_with=tracker)
    accelerator.init_trackers("exp", config={"num_iterations": 12, "learning_rate": 1e-2, "some_boolean": False})
    for step in (0, 1, 2, 1):  # the last as a resumed job sends it again
        accelerator.log({"total_loss": 0.1 * step}, step=step)
    buffer = walbuf.open_buffer(tmp_path / "b.db")
    assert buffer.writer_alive("exp", "w")
    accelerator.end_training()  # closes the writer: its W&B run may be finished at the next sync
    assert not buffer.writer_alive("exp", "w")
    assert [r.metrics["step"] for r in walbuf.read(tmp_path / "b.db")] == [0, 1, 2, 1]
    config = {k: json.loads(v) for k, v in run_sql(tmp_path / "b.db", "SELECT key, value FROM config_entries")}
    assert config == {"num_iterations": 12, "learning_rate": 1e-2, "some_boolean": False}


def test_log_images_logs_walbuf_images_and_unknown_keywords_are_warned_once(tmp_path):
    import numpy as np

    tracker = WalbufTracker(buffer=tmp_path / "b.db")
    with pytest.warns(UserWarning, match="'commit' is left out") as warned:
        tracker.log_images({"samples": [np.zeros((2, 3), dtype=np.uint8), np.ones((2, 3))]}, step=1, commit=True)
        tracker.log({"loss": 0.5}, step=1, commit=True)
    assert len([w for w in warned if "commit" in str(w.message)]) == 2  # once for log_images, once for log
    tracker.finish()
    first, second = walbuf.read(tmp_path / "b.db")
    assert {k: type(v).__name__ for k, v in first.metrics.items()} == {
        "samples/0": "Image",
        "samples/1": "Image",
        "step": "int",
    }
    assert second.metrics == {"loss": 0.5, "step": 1}


def test_hyperparameters_w_and_b_stores_as_text_are_stored_as_text(tmp_path):
    import numpy as np

    tracker = WalbufTracker(buffer=tmp_path / "b.db")
    tracker.store_init_configuration(
        {"complex": np.complex64(1 + 2j), "date": np.datetime64("2026-01-02"), "raw": np.bytes_(b"x")}
    )
    tracker.finish()
    config = {k: json.loads(v) for k, v in run_sql(tmp_path / "b.db", "SELECT key, value FROM config_entries")}
    assert config == {"complex": "(1+2j)", "date": "2026-01-02", "raw": "x"}
