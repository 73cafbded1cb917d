"""One phase of a training job that is preempted and resumed, logged by W&B's own integration or by walbuf's.

Usage: side_by_side_job.py FRAMEWORK LOGGER PHASE WORKDIR

FRAMEWORK: transformers, lightning or accelerate. LOGGER: "wandb" (W&B's
own integration, offline: the W&B environment comes from the caller) or
"walbuf" (walbuf's, keys as logged; the buffer is WORKDIR/buffer.db).
PHASE 1 trains to step 4, checkpointing at steps 2 and 4; PHASE 2 is the
job started again after a preemption: it resumes from the checkpoint of
step 2 and trains to step 6. Each phase logs the loss at every step and,
at every second step, an evaluation whose metrics include a list. Run
from WORKDIR (relative paths, so both loggers see the same arguments).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

FRAMEWORK, LOGGER, PHASE, WORKDIR = sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])
BUFFER = str(WORKDIR / "buffer.db")
STEPS = 4 if PHASE == 1 else 6


def data(n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=generator)
    return x, 2 * x + 1


def per_class(step: int) -> list[float]:
    return [0.5, round(0.25 + step / 100, 4)]


def transformers_phase() -> None:
    from transformers import Trainer, TrainingArguments

    class Regression(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Parameter(torch.tensor(0.0))
            self.b = torch.nn.Parameter(torch.tensor(0.0))

        def forward(self, x, labels=None):
            y = self.a * x + self.b
            return {"loss": torch.nn.functional.mse_loss(y, labels), "logits": y}

    def compute_metrics(prediction):
        return {"per_class_f1": per_class(0)}

    callbacks = []
    if LOGGER == "walbuf":
        from walbuf.integrations.transformers import WalbufCallback

        callbacks.append(WalbufCallback(BUFFER, prefix=""))
    x, y = data()
    rows = [{"x": x[i], "labels": y[i]} for i in range(len(x))]
    args = TrainingArguments(
        output_dir="out",
        report_to="wandb" if LOGGER == "wandb" else "none",
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=2,
        save_steps=2,
        max_steps=STEPS,
        per_device_train_batch_size=8,
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        learning_rate=0.1,
        run_name="side-by-side",
    )
    trainer = Trainer(
        model=Regression(),
        args=args,
        train_dataset=rows,
        eval_dataset=rows[:8],
        compute_metrics=compute_metrics,
        callbacks=callbacks,
    )
    trainer.train(resume_from_checkpoint="out/checkpoint-2" if PHASE == 2 else None)


def lightning_phase() -> None:
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    class Model(pl.LightningModule):
        def __init__(self, lr: float = 0.1) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.layer = torch.nn.Linear(1, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.layer(x), y)
            self.log("train/loss", loss)
            return loss

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val/loss", torch.nn.functional.mse_loss(self.layer(x), y))

        def on_validation_epoch_end(self):
            if not self.trainer.sanity_checking:
                self.logger.log_metrics({"val/per_class": per_class(self.global_step)}, step=self.global_step)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

    if LOGGER == "wandb":
        from pytorch_lightning.loggers import WandbLogger

        logger = WandbLogger(project="side-by-side", offline=True, save_dir=".")
    else:
        from walbuf.integrations.lightning import WalbufLogger

        os.environ["WALBUF_PREFIX"] = ""  # keys as logged, as WandbLogger's
        logger = WalbufLogger(BUFFER, project="side-by-side", save_dir=".")
    x, y = data()
    loader = DataLoader(TensorDataset(x[:, None], y[:, None]), batch_size=8)
    checkpoints = ModelCheckpoint(dirpath="ckpt", every_n_train_steps=2, save_top_k=-1, filename="{step}")
    trainer = pl.Trainer(
        max_steps=STEPS,
        logger=logger,
        callbacks=[checkpoints],
        log_every_n_steps=1,
        val_check_interval=2,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        accelerator="cpu",
        devices=1,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    pl.seed_everything(0)
    trainer.fit(Model(), loader, loader, ckpt_path="ckpt/step=2.ckpt" if PHASE == 2 else None)


def accelerate_phase() -> None:
    from accelerate import Accelerator

    if LOGGER == "wandb":
        accelerator = Accelerator(cpu=True, log_with="wandb")
    else:
        from walbuf.integrations.accelerate import WalbufTracker

        accelerator = Accelerator(cpu=True, log_with=WalbufTracker(buffer=BUFFER, prefix=""))
    accelerator.init_trackers("side-by-side", config={"lr": 0.1, "steps": STEPS})
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    x, y = data()
    start = 0
    if PHASE == 2:
        accelerator.load_state("state-2")
        start = 2
    for step in range(start + 1, STEPS + 1):
        batch = slice((step - 1) * 8, step * 8)
        loss = torch.nn.functional.mse_loss(model(x[batch, None]), y[batch, None])
        optimizer.zero_grad()
        accelerator.backward(loss)
        optimizer.step()
        evaluation = {"eval/per_class": per_class(step)} if step % 2 == 0 else {}
        accelerator.log({"train/loss": loss.item(), **evaluation}, step=step)
        if evaluation:
            accelerator.save_state(f"state-{step}")
    accelerator.end_training()


if __name__ == "__main__":
    {"transformers": transformers_phase, "lightning": lightning_phase, "accelerate": accelerate_phase}[FRAMEWORK]()
