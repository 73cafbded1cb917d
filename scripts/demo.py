"""walbuf demo: writer processes log into one local buffer; `walbuf sync` replays it into W&B.

Two "DDP ranks" (spawned processes with RANK set, as torchrun would) log a
training loss every step; an evaluation function decorated with
@walbuf.logged runs in a process pool and logs on its own axis. Then
`walbuf sync` uploads the buffer, through the real wandb SDK, to a local
stand-in for a W&B server (the test suite's fake, on 127.0.0.1), and the demo
prints what that server received. No network and no W&B account are needed.

    python scripts/demo.py [--buffer runs/demo.db] [--steps 200]
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import subprocess
import sys
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import walbuf

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from wandb_server import FakeWandb  # noqa: E402 - the test suite's fake W&B server


def train(rank: int, buffer: str, steps: int) -> None:
    os.environ["RANK"] = str(rank)  # what a launcher sets; the writer id becomes rank-<N>
    walbuf.init(buffer, run="demo", step_axis="train_step")
    for step in range(steps):
        loss = 2.0 * math.exp(-step / 60) + 0.05 * rank
        walbuf.log({"train": {"loss": loss, "lr": 1e-3 * 0.99**step}})


@walbuf.logged(writer="eval", step_axis="eval_step", run="demo")
def evaluate(checkpoint_step: int) -> dict[str, float]:
    accuracy = 1 - math.exp(-checkpoint_step / 80)
    return {"accuracy": accuracy, "checkpoint": checkpoint_step}  # in W&B: eval/accuracy, ...


def _configure(buffer: str) -> None:
    os.environ["WALBUF_BUFFER"] = buffer  # the decorator reads it at call time, in the worker


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--buffer", default="runs/demo.db")
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    buffer = str(Path(args.buffer).absolute())
    for leftover in Path(buffer).parent.glob(Path(buffer).name + "*"):
        # The demo starts from an empty buffer of its own each time.
        if leftover.is_file():
            leftover.unlink()

    ctx = mp.get_context("spawn")
    ranks = [ctx.Process(target=train, args=(rank, buffer, args.steps)) for rank in range(2)]
    for p in ranks:
        p.start()
    with ProcessPoolExecutor(2, mp_context=ctx, initializer=_configure, initargs=(buffer,)) as pool:
        list(pool.map(evaluate, range(0, args.steps, 20)))
    for p in ranks:
        p.join()
        if p.exitcode != 0:
            raise SystemExit(f"a training rank failed (exit {p.exitcode})")

    per_writer: dict[str, list[walbuf.Record]] = defaultdict(list)
    for record in walbuf.read(buffer):
        per_writer[record.writer].append(record)
    print(f"buffer {buffer}")
    print(f"{'writer':<8} {'records':>7} {'steps':>9}  last metrics")
    for name, records in sorted(per_writer.items()):
        last = records[-1]
        metrics = ", ".join(f"{k}={v:.4g}" for k, v in last.metrics.items())
        print(f"{name:<8} {len(records):>7} {records[0].step:>4}-{last.step:<4}  {metrics}")
    print(f"\nEvery record: walbuf records {args.buffer}\n")

    with FakeWandb() as server:
        env = {**os.environ, **server.env(), "WANDB_DIR": str(Path(buffer).parent)}
        command = ["walbuf", "sync", args.buffer, "--project", "demo", "--entity", "walbuf"]
        print("$", " ".join(command))
        subprocess.run([sys.executable, "-m", "walbuf", *command[1:]], env=env, check=True)
        print(f"\n$ walbuf status {args.buffer}")
        subprocess.run([sys.executable, "-m", "walbuf", "status", args.buffer], check=True)
        (run,) = server.runs.values()
        print(f"\nThe W&B server received run {run.entity}/{run.project}/{run.id}: {len(run.history)} rows")
        keys = sorted({key for row in run.history for key in row if not key.startswith("_")})
        for key in keys:
            axis = run.step_metric_of(key)
            if axis is not None:  # a metric (an axis itself has none)
                points = sum(1 for row in run.history if key in row)
                print(f"  {key:<22} {points:>4} points on axis {axis}")


if __name__ == "__main__":
    main()
