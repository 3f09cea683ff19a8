"""A Lightning callback for dtrun's node contract.

    from infra.adapters.lightning import DtrunLightningCallback, resume_ckpt_path
    ckpt = ModelCheckpoint(dirpath=os.environ["DTRUN_CHECKPOINT_DIR"], every_n_train_steps=500, save_top_k=-1)
    trainer = L.Trainer(..., callbacks=[ckpt, DtrunLightningCallback()])
    trainer.fit(model, data, ckpt_path=resume_ckpt_path())

* SIGTERM: Lightning's own signal connector notices it (rank 0 broadcasts it to every rank) and
  ends the fit with ``SIGTERMException`` at the next batch boundary (``training_epoch_loop``). This
  callback's ``on_exception`` then saves ``epoch=E-step=S.ckpt`` into the checkpoint folder (every
  rank takes part, rank 0 writes) and turns the exit into 75, "checkpointed, resume me"
  (Lightning's own exit for it is 0, which would read as "finished").
* Progress: a ``dtrun: step N/M loss L`` line every ``log_every_n_steps`` (rank 0).
* ``resume_ckpt_path()``: the checkpoint dtrun restored (the ``*.ckpt`` with the highest step in
  ``$DTRUN_CHECKPOINT_DIR``) when ``$DTRUN_RESUME_STEP`` is set, else None.

Use ``command.checkpoint_format: lightning``. Lightning restores model, optimizer, schedulers and
loop counters; whether a resume mid-epoch sees the same batches depends on your data loader
(a stateful one, or a seeded sampler per epoch): dtrun does not promise bit-identical ends here.
"""

from __future__ import annotations

import os
import re

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.exceptions import SIGTERMException

EXIT_RESUME = 75
_STEP = re.compile(r"step[=_-]?(\d+)")


def resume_ckpt_path() -> str | None:
    if not os.environ.get("DTRUN_RESUME_STEP", "").strip():
        return None
    root = os.environ.get("DTRUN_CHECKPOINT_DIR", "")
    best = None
    for name in os.listdir(root) if os.path.isdir(root) else []:
        m = _STEP.search(name)
        if name.endswith(".ckpt") and m and (best is None or int(m.group(1)) > best[0]):
            best = (int(m.group(1)), os.path.join(root, name))
    return best[1] if best else None


class DtrunLightningCallback(Callback):
    def __init__(self, dirpath: str | None = None) -> None:
        self.dirpath = dirpath or os.environ.get("DTRUN_CHECKPOINT_DIR") or "checkpoints"

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        every = max(1, int(getattr(trainer, "log_every_n_steps", 50) or 50))
        if trainer.is_global_zero and trainer.global_step % every == 0:
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
            try:
                tail = f" loss {float(loss):.6g}" if loss is not None else ""
            except (TypeError, ValueError):
                tail = ""
            total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
            print(f"dtrun: step {trainer.global_step}" + (f"/{total}" if total else "") + tail, flush=True)

    def on_exception(self, trainer, pl_module, exception):
        if not isinstance(exception, SIGTERMException):
            return
        path = os.path.join(self.dirpath, f"epoch={trainer.current_epoch}-step={trainer.global_step}.ckpt")
        trainer.save_checkpoint(path)
        if trainer.is_global_zero:
            print(f"dtrun: SIGTERM: saved step {trainer.global_step}, exiting {EXIT_RESUME}", flush=True)
        exception.code = EXIT_RESUME  # re-raised by Lightning: the process exits 75
