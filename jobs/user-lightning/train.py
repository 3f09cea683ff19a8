"""A Lightning script under dtrun: ``ModelCheckpoint`` into ``$DTRUN_CHECKPOINT_DIR``, one callback
added, ``ckpt_path=resume_ckpt_path()``. A tiny regression on seeded synthetic data (CPU, seconds).
"""

from __future__ import annotations

import os
import time

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from infra.adapters.lightning import DtrunLightningCallback, resume_ckpt_path

STEPS = int(os.environ.get("STEPS", "60"))
SAVE_EVERY = int(os.environ.get("SAVE_EVERY", "10"))
STEP_SLEEP = float(os.environ.get("STEP_SLEEP", "0"))  # to watch it (and signal it) mid-run


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))

    def training_step(self, batch, _idx):
        x, y = batch
        if STEP_SLEEP:
            time.sleep(STEP_SLEEP)
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def data() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(4096, 16, generator=g)
    y = (x @ torch.linspace(-1, 1, 16)).unsqueeze(1)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)


def main() -> None:
    L.seed_everything(1234)
    ckpt = ModelCheckpoint(dirpath=os.environ.get("DTRUN_CHECKPOINT_DIR", "checkpoints"),
                           every_n_train_steps=SAVE_EVERY, save_top_k=-1)
    trainer = L.Trainer(max_steps=STEPS, accelerator="auto", devices="auto", log_every_n_steps=5,
                        callbacks=[ckpt, DtrunLightningCallback()], enable_progress_bar=False, logger=False)
    trainer.fit(Regression(), data(), ckpt_path=resume_ckpt_path())


if __name__ == "__main__":
    main()
