"""Side by side with W&B's own integrations: one job, preempted and resumed, logged by each; the runs compared.

For each framework the job of tests/side_by_side_job.py (a phase to step 4,
then the job started again from the checkpoint of step 2 to step 6, with a
list among its evaluation metrics) runs twice: once with W&B's integration
in offline mode, uploaded by `wandb sync`, once with walbuf's, uploaded by
`walbuf sync`, both into the fake server. What the server ends with must
be the same: history names and values at the same framework steps, each
key's step metric, the summary, the config. The differences docs/integrations.md states:

- W&B's integration makes a new run for the resumed job (unless told the
  run's id), walbuf's run holds both phases: walbuf's history is W&B's two
  histories one after the other, and its summary the latest values of both.
- Timing figures (runtimes, throughput) differ from run to run in value:
  their names are compared, not their values.
- The config's ``report_to`` names the integration each side used.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # real training processes, two uploads

JOB = Path(__file__).parent / "side_by_side_job.py"
TIMING = ("runtime", "per_second", "total_flos")
W_AND_B_OWN = ("_step", "_runtime", "_timestamp", "_wandb")


def run_job(framework: str, logger: str, workdir: Path, env: dict[str, str]) -> None:
    workdir.mkdir()
    for phase in (1, 2):
        proc = subprocess.run(
            [sys.executable, str(JOB), framework, logger, str(phase), str(workdir)],
            cwd=workdir,
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]


def job_env(server, tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "WALBUF_"))}
    return {**env, "WANDB_MODE": "offline", "WANDB_PROJECT": "side-by-side", "WANDB_SILENT": "true"}


def by_wandb(server, framework: str, tmp_path: Path) -> list:
    """W&B's integration, offline, then `wandb sync`: its runs on the server, oldest first."""
    workdir = tmp_path / "wandb-side"
    env = job_env(server, tmp_path)
    run_job(framework, "wandb", workdir, {**env, "WANDB_DIR": str(workdir)})
    offline = sorted((workdir / "wandb").glob("offline-run-*"))
    assert len(offline) == 2
    sync = Path(sys.executable).parent / "wandb"
    for directory in offline:
        proc = subprocess.run(
            [str(sync), "sync", str(directory)],
            capture_output=True,
            text=True,
            timeout=300,
            env={**env, **server.env(), "WANDB_MODE": "online"},
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
    runs = list(server.runs.values())
    server.runs.clear()
    return runs


def by_walbuf(server, framework: str, tmp_path: Path):
    """walbuf's integration, then `walbuf sync`: its one run on the server."""
    workdir = tmp_path / "walbuf-side"
    env = job_env(server, tmp_path)
    run_job(framework, "walbuf", workdir, env)
    proc = subprocess.run(
        [sys.executable, "-m", "walbuf", "sync", str(workdir / "buffer.db"), "--quiet", "--project", "side-by-side"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**env, **server.env()},
    )
    assert proc.returncode == 0, proc.stderr
    (run,) = server.runs.values()
    return run


def comparable(row: dict) -> dict:
    """A history row or summary less W&B's own keys, timing figures by name only."""
    return {k: ("(timing)" if any(t in k for t in TIMING) else v) for k, v in row.items() if k not in W_AND_B_OWN}


def config_of(run) -> dict:
    return {k: v["value"] for k, v in run.config.items() if k not in ("_wandb", "report_to")}


@pytest.mark.parametrize(
    "framework, axis",
    [("transformers", "train/global_step"), ("lightning", "trainer/global_step"), ("accelerate", None)],
)
def test_a_resumed_job_with_a_list_metric_ends_as_w_and_bs_own_integration_leaves_it(server, tmp_path, framework, axis):
    first, resumed = by_wandb(server, framework, tmp_path)
    ours = by_walbuf(server, framework, tmp_path)
    theirs = [comparable(row) for row in first.history + resumed.history]
    rows = [comparable(row) for row in ours.history]
    if axis is None:  # W&B's tracker logs at W&B's own step; walbuf's at its step axis, "step"
        steps = first.history + resumed.history
        theirs = [{**row, "step": step["_step"]} for row, step in zip(theirs, steps, strict=True)]
    assert rows == theirs
    assert any(isinstance(v, list) for row in rows for v in row.values())  # the list metric, as W&B keeps it
    keys = set().union(*rows) - {axis or "step"}
    assert {k: ours.step_metric_of(k) for k in keys} == {k: (axis if axis else "step") for k in keys}
    if axis is not None:
        assert {k: resumed.step_metric_of(k) for k in keys} == {k: axis for k in keys}
    last_of_both = {**comparable(first.summary), **comparable(resumed.summary)}
    if axis is None:
        last_of_both["step"] = resumed.summary["_step"]
    assert comparable(ours.summary) == last_of_both
    assert config_of(ours) == config_of(resumed)
