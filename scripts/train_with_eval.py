"""A trainer that logs every step and, every 20 steps, starts an evaluation in a separate interpreter.

    python scripts/train_with_eval.py runs/seeds.db [--steps 100] [--every 20]
    walbuf sync runs/seeds.db          # meanwhile, as cron would, and once more at the end

The trainer is writer "trainer" of run "seeds", on the axis "step". Each
evaluation is a new Python process (not a fork, not a pool worker) that
evaluates the checkpoint and returns its metrics from a function decorated
with @walbuf.logged: writer "eval", axis "eval_step", the same run. Nothing
here talks to W&B; `walbuf sync` puts both histories in one W&B run.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time

import walbuf

RUN = "seeds"


@walbuf.logged(writer="eval", step_axis="eval_step", run=RUN)  # buffer: $WALBUF_BUFFER, at call time
def evaluate(checkpoint_step: int) -> dict:
    return {"accuracy": 1 - math.exp(-checkpoint_step / 50), "checkpoint_step": checkpoint_step}


def train(buffer: str, steps: int, every: int, step_seconds: float) -> None:
    writer = walbuf.init(buffer, writer="trainer", run=RUN)
    evaluations = []
    for step in range(steps):
        time.sleep(step_seconds)  # the training computation
        writer.log({"loss": 1 / (step + 1)})
        if (step + 1) % every == 0:
            # A separate interpreter, as a job scheduler would start it.
            evaluations.append(
                subprocess.Popen(
                    [sys.executable, __file__, "--evaluate", str(step)],
                    env={**os.environ, "WALBUF_BUFFER": buffer},
                )
            )
    writer.close()
    failed = [p.args for p in evaluations if p.wait() != 0]
    if failed:
        sys.exit(f"evaluations failed: {failed}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("buffer", nargs="?", default="runs/seeds.db")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--step-seconds", type=float, default=0.02)
    parser.add_argument("--evaluate", type=int, metavar="STEP", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.evaluate is not None:
        evaluate(args.evaluate)
    else:
        train(args.buffer, args.steps, args.every, args.step_seconds)


if __name__ == "__main__":
    main()
