"""Transformers with walbuf: a tiny GPT-2 (built from a config, nothing downloaded) trained by the Trainer on CPU.

    pip install -e '.[test]'     # or: pip install 'walbuf[transformers,media]'
    torchrun --nproc_per_node 2 scripts/transformers_example.py [BUFFER] [--every-process]
    walbuf status runs/transformers.db
    walbuf sync runs/transformers.db --project my-project    # later, from anywhere with network

No process creates a wandb run (report_to="none"). WalbufCallback logs what
W&B's own callback would: train/loss, train/learning_rate, eval/loss, ...
against train/global_step, the TrainingArguments and model config as the
run's config, histograms of the parameters (log_parameters=True, as
wandb.watch would) and, from a callback of the script's own, an image of
the embeddings at the end. By default the main process writes; with
--every-process each process does, as a writer of its own. Prints one JSON
line per process: whether it imported wandb.
"""

import argparse
import json
import os
import sys
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

import walbuf
from walbuf.integrations.transformers import WalbufCallback


class Tokens(torch.utils.data.Dataset):
    """Short random token sequences: enough for the Trainer to run."""

    def __init__(self, n: int, seed: int) -> None:
        self.ids = torch.randint(0, 64, (n, 16), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class EmbeddingImage(TrainerCallback):
    """Logs the token embeddings as an image at the end, through the WalbufCallback's writer."""

    def __init__(self, walbuf_callback: WalbufCallback) -> None:
        self.walbuf_callback = walbuf_callback

    def on_train_end(self, args, state, control, model=None, **kwargs):
        if state.is_world_process_zero:
            embeddings = model.get_input_embeddings().weight.detach()
            scaled = (embeddings - embeddings.min()) / (embeddings.max() - embeddings.min())
            image = walbuf.Image(scaled.numpy(), caption=f"embeddings at step {state.global_step}")
            self.walbuf_callback.writer.log({"embeddings": image}, axis=state.global_step)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("buffer", nargs="?", default="runs/transformers.db")
    parser.add_argument("--every-process", action="store_true")
    args = parser.parse_args()

    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    callback = WalbufCallback(
        args.buffer, run="transformers-example", main_process_only=not args.every_process, log_parameters=True
    )
    with tempfile.TemporaryDirectory() as output_dir:
        training = TrainingArguments(
            output_dir,
            report_to="none",
            use_cpu=True,
            max_steps=6,
            per_device_train_batch_size=4,
            per_device_eval_batch_size=4,
            learning_rate=1e-3,
            logging_steps=2,
            eval_strategy="steps",
            eval_steps=3,
            save_strategy="no",
            disable_tqdm=True,
            seed=0,
        )
        trainer = Trainer(
            model,
            training,
            train_dataset=Tokens(64, seed=1),
            eval_dataset=Tokens(8, seed=2),
            callbacks=[callback, EmbeddingImage(callback)],
        )
        trainer.train()
    callback.close()
    if torch.distributed.is_initialized():
        # Before the interpreter ends: a process group left to exit with it
        # can make the C++ runtime abort ("terminate called without an
        # active exception", seen once in CI under torchrun).
        torch.distributed.destroy_process_group()
    line = json.dumps({"process": f"rank-{os.environ.get('RANK', '0')}", "wandb_imported": "wandb" in sys.modules})
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), (line + "\n").encode())  # one write: the processes share stdout


if __name__ == "__main__":
    main()
