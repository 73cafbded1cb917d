"""The scenario of wandb's shared-mode pull request (../shared/seeds/, train.py and eval.py), two ways.

    python seed_scenario.py native-train PROJECT     the seed's train.py: a shared-mode run that
                                                     starts an evaluation process every 20 steps
    python seed_scenario.py native-eval RUN_ID PROJECT EVAL_STEP
    python seed_scenario.py walbuf-train BUFFER      the same job logging through walbuf (prefix="")
    python seed_scenario.py walbuf-eval BUFFER EVAL_STEP

As in the seed, each evaluation is a separate interpreter (native: with its
own wandb service, WANDB_SERVICE cleared, "to mimic a multi-node scenario").
Values are the seed's curves without their random noise, so that the two
runs can be compared value for value. walbuf-train runs `walbuf sync` after
each evaluation: the upload happens while the job goes on, as from cron.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

STEPS = 60
EVAL_EVERY = 20


def loss(train_step: int) -> float:
    return math.exp(-train_step / 100)


def accuracy(eval_step: int) -> float:
    return min(math.log(eval_step + 1) / 5, 1)


def native_train(project: str) -> None:
    import wandb

    run = wandb.init(
        project=project,
        settings=wandb.Settings(init_timeout=60, mode="shared", console="off", disable_job_creation=True, silent=True),
    )
    run.define_metric(name="loss", step_metric="train_step")
    run.define_metric(name="eval_accuracy", step_metric="eval_step")
    eval_step = 0
    for train_step in range(STEPS):
        run.log({"train_step": train_step, "loss": loss(train_step)})
        if (train_step + 1) % EVAL_EVERY == 0:
            _child("native-eval", run.id, project, str(eval_step), env={**os.environ, "WANDB_SERVICE": ""})
            eval_step += 1
    run.finish()


def native_eval(run_id: str, project: str, eval_step: int) -> None:
    import wandb

    run = wandb.init(
        id=run_id,
        project=project,
        settings=wandb.Settings(
            mode="shared", console="off", x_disable_machine_info=True, x_disable_stats=True, silent=True
        ),
    )
    run.log({"eval_accuracy": accuracy(eval_step), "eval_step": eval_step})
    run.finish()


def walbuf_train(buffer: str) -> None:
    import walbuf

    with walbuf.Writer(buffer, writer="train", prefix="", step_axis="train_step") as w:
        eval_step = 0
        for train_step in range(STEPS):
            w.log({"loss": loss(train_step)}, step=train_step)
            if (train_step + 1) % EVAL_EVERY == 0:
                _child("walbuf-eval", buffer, str(eval_step), env=os.environ)
                eval_step += 1
                subprocess.run([sys.executable, "-m", "walbuf", "sync", buffer, "--quiet"], check=True)
    subprocess.run([sys.executable, "-m", "walbuf", "sync", buffer, "--quiet"], check=True)


def walbuf_eval(buffer: str, eval_step: int) -> None:
    import walbuf

    with walbuf.Writer(buffer, writer=f"eval-{eval_step}", prefix="", step_axis="eval_step") as w:
        w.log({"eval_accuracy": accuracy(eval_step)}, step=eval_step)


def _child(*args: str, env: os._Environ[str] | dict[str, str]) -> None:
    subprocess.run([sys.executable, __file__, *args], check=True, env=dict(env))


if __name__ == "__main__":
    command, *rest = sys.argv[1:]
    if command == "native-train":
        native_train(rest[0])
    elif command == "native-eval":
        native_eval(rest[0], rest[1], int(rest[2]))
    elif command == "walbuf-train":
        walbuf_train(rest[0])
    elif command == "walbuf-eval":
        walbuf_eval(rest[0], int(rest[1]))
    else:
        raise SystemExit(f"unknown command {command!r}")
