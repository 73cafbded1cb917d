"""Accelerate with walbuf: a tiny model trained on 2 CPU processes, every process logging.

    pip install -e '.[test]'     # or: pip install 'walbuf[accelerate,media]'
    torchrun --nproc_per_node 2 scripts/accelerate_example.py [BUFFER] [--steps N]
    walbuf status runs/accelerate.db
    walbuf sync runs/accelerate.db --project my-project    # later, from anywhere with network

No process creates a wandb run. Each process logs its own loss through
``tracker.log`` (its writer is rank-$RANK, so W&B shows rank-0/loss and
rank-1/loss, each against its own step axis); the main process logs the
config through ``init_trackers`` and, through ``accelerator.log`` as any
Accelerate tracker would, a histogram of the weights and an image of them
at the end. Prints one JSON line per process: whether it imported wandb.
"""

import argparse
import json
import os
import sys

import numpy as np
import torch
from accelerate import Accelerator

import walbuf
from walbuf.integrations.accelerate import WalbufTracker


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("buffer", nargs="?", default="runs/accelerate.db")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    tracker = WalbufTracker(buffer=args.buffer, run="accelerate-example")
    accelerator = Accelerator(cpu=True, log_with=tracker)
    accelerator.init_trackers("accelerate-example", config={"lr": 0.05, "hidden": 4, "steps": args.steps})

    torch.manual_seed(accelerator.process_index)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = accelerator.prepare(model, optimizer)
    for step in range(args.steps):
        x = torch.randn(16, 3)
        loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
        optimizer.zero_grad()
        accelerator.backward(loss)
        optimizer.step()
        tracker.log({"loss": loss.detach()}, step=step)  # every process: its own writer

    weights = accelerator.unwrap_model(model)[0].weight.detach()
    scaled = (weights - weights.min()) / (weights.max() - weights.min() + 1e-12)
    accelerator.log(  # the main process only: Accelerate's rule for accelerator.log
        {
            "weights": walbuf.Histogram(weights, num_bins=8),
            "weights_image": walbuf.Image(np.kron(scaled.numpy(), np.ones((8, 8))), caption="layer 0"),
        },
        step=args.steps,
    )
    accelerator.end_training()  # closes the main process's writer
    tracker.finish()  # and each other process's
    line = json.dumps({"process": f"rank-{accelerator.process_index}", "wandb_imported": "wandb" in sys.modules})
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), (line + "\n").encode())  # one write: the processes share stdout


if __name__ == "__main__":
    main()
