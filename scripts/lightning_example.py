"""Lightning with walbuf: a tiny model trained 2 epochs on 2 CPU processes, every rank logging.

    pip install -e '.[test]'            # or: pip install 'walbuf[lightning]'
    python scripts/lightning_example.py [BUFFER] [--strategy ddp_spawn|ddp] [--log-first] [--rank-zero-only]
    walbuf status runs/lightning.db     # both ranks' records, the hyperparameters pending
    walbuf sync runs/lightning.db       # later, with network: into project walbuf-tests, as the logger says

No process creates a wandb run: every rank appends to the buffer through
WalbufLogger, and `walbuf sync` uploads it into one W&B run, rank-0/... and
rank-1/... each on its own trainer/global_step axis, the hyperparameters as config.
Prints one JSON line per process at the end, each rank's and the launching
process's: whether it imported wandb (the tests check none did), and what
``logger.experiment`` is there. ``--log-first`` uses the logger in the
launching process before ``fit`` (WandbLogger's idiom: hyperparameters, a
first record); ``--rank-zero-only`` makes rank 0 the only writer.
"""

import argparse
import json
import os
import sys

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from walbuf.integrations.lightning import WalbufLogger


class Tiny(pl.LightningModule):
    def __init__(self, lr: float = 0.05, hidden: int = 4):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(3, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))

    def training_step(self, batch, _index):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

    def on_train_end(self):
        # Runs in every rank's process, spawned or launched: none may have made
        # a wandb run, so none may even have imported wandb.
        report(f"rank-{self.global_rank}", type(self.logger.experiment).__name__)


def report(process: str, experiment: str = "") -> None:
    # Both ranks share one stdout pipe: a single write() of a short line is
    # atomic, where print() may split the text and its newline between ranks.
    line = json.dumps({"process": process, "wandb_imported": "wandb" in sys.modules, "experiment": experiment}) + "\n"
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), line.encode())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("buffer", nargs="?", default="runs/lightning.db")
    parser.add_argument("--strategy", choices=["ddp_spawn", "ddp"], default="ddp_spawn")
    parser.add_argument("--log-first", action="store_true", help="use the logger in this process before fit")
    parser.add_argument("--rank-zero-only", action="store_true", help="only rank 0 writes")
    args = parser.parse_args()
    buffer, strategy = args.buffer, args.strategy
    torch.manual_seed(0)
    x = torch.randn(64, 3)
    data = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=8)
    logger = WalbufLogger(buffer, run="lightning", project="walbuf-tests", rank_zero_only=args.rank_zero_only)
    if args.log_first:
        logger.log_hyperparams({"seed": 0})
        logger.experiment.log({"launcher/ready": 1})
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_epochs=2,
        logger=logger,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Tiny(), data)
    if strategy == "ddp_spawn" or trainer.global_rank == 0:
        report("launcher")


if __name__ == "__main__":
    main()
