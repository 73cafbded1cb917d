"""A tiny model trained 2 epochs on 2 CPU processes, logging through WalbufLogger.

    python lightning_train.py BUFFER STRATEGY     # STRATEGY: ddp_spawn or ddp

Prints one JSON line at the end (rank 0 of the launching process): whether
wandb was imported in it.
"""

import json
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


def main() -> None:
    buffer, strategy = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    x = torch.randn(64, 3)
    data = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=8)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_epochs=2,
        logger=WalbufLogger(buffer, run="lightning", project="walbuf-tests"),
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Tiny(), data)
    if trainer.global_rank == 0:
        # No process may have made a wandb run: none even imported wandb.
        print(json.dumps({"wandb_imported": "wandb" in sys.modules}), flush=True)


if __name__ == "__main__":
    main()
