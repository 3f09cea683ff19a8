"""A Hugging Face ``Trainer`` script under dtrun: one callback added, nothing else changed.

A tiny GPT-2 (a ``transformers`` config, random init) on seeded synthetic tokens, so it runs on
CPU in seconds; swap in your model and dataset. What dtrun needs from the script:

* ``output_dir`` = ``$DTRUN_CHECKPOINT_DIR`` and ``command.checkpoint_format: hf`` — the node
  uploads each finished ``checkpoint-N/`` and commits it;
* ``trainer.train(resume_from_checkpoint=resume_arg())`` — dtrun put the newest COMMITTED
  checkpoint into that folder before starting the script;
* ``callbacks=[DtrunCallback()]`` — SIGTERM (spot notice, budget, deadline) → save at the end of
  the step, stop, exit 75; progress lines for the node.
"""

from __future__ import annotations

import os
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from infra.adapters.hf import DtrunCallback, resume_arg

STEPS = int(os.environ.get("STEPS", "40"))
SAVE_EVERY = int(os.environ.get("SAVE_EVERY", "10"))
STEP_SLEEP = float(os.environ.get("STEP_SLEEP", "0"))  # to watch it (and kill it) mid-run
SEED = 1234


class Tokens(torch.utils.data.Dataset):
    """Seeded random token sequences (item i is always the same)."""

    def __init__(self, n: int = 512, seq: int = 32, vocab: int = 128):
        g = torch.Generator().manual_seed(SEED)
        self.data = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i):
        return {"input_ids": self.data[i], "labels": self.data[i]}


class Sleep(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(STEP_SLEEP)


def main() -> None:
    cfg = GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    torch.manual_seed(SEED)
    model = GPT2LMHeadModel(cfg)
    args = TrainingArguments(
        output_dir=os.environ.get("DTRUN_CHECKPOINT_DIR", "checkpoints"),
        max_steps=STEPS, save_steps=SAVE_EVERY, logging_steps=5, save_strategy="steps",
        per_device_train_batch_size=4, learning_rate=3e-3, warmup_steps=5, seed=SEED,
        report_to=[], disable_tqdm=True, dataloader_num_workers=0, use_cpu=not torch.cuda.is_available(),
    )
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(),
                      callbacks=[DtrunCallback()] + ([Sleep()] if STEP_SLEEP else []))
    trainer.train(resume_from_checkpoint=resume_arg())


if __name__ == "__main__":
    main()
