"""A Hugging Face ``TrainerCallback`` for dtrun's node contract.

    from infra.adapters.hf import DtrunCallback, resume_arg
    args = TrainingArguments(output_dir=os.environ["DTRUN_CHECKPOINT_DIR"], save_steps=..., ...)
    trainer = Trainer(..., args=args, callbacks=[DtrunCallback()])
    trainer.train(resume_from_checkpoint=resume_arg())

* SIGTERM (a spot notice, the budget or deadline watchdog) → at the end of the current step the
  ``Trainer`` saves a checkpoint (``control.should_save``) and stops; the process then exits 75,
  "checkpointed, resume me". Under torchrun every rank gets the signal; the ranks agree on the
  step to stop at (an all-reduce of the flag each step), so they save the same step.
* Progress: one ``dtrun: step N/M loss L`` line per log (rank 0), the node's default pattern.
* Importing it lets the ``Trainer`` resume a multi-process CPU run (gloo): it loads the optimizer
  with ``map_location="cpu:<rank>"``, which torch cannot restore unless told (see
  ``_restore_cpu_index``); GPU runs are unaffected.
* ``resume_arg()``: ``True`` when dtrun restored a checkpoint into the output folder (the
  ``Trainer`` then resumes from the newest ``checkpoint-N``), else ``None``.

Checkpoints go to ``output_dir`` = ``$DTRUN_CHECKPOINT_DIR`` with ``command.checkpoint_format: hf``.
"""

from __future__ import annotations

import os
import re
import signal
import sys

import torch.serialization
from transformers import TrainerCallback

EXIT_RESUME = 75


def _restore_cpu_index(storage, location):
    """``cpu:<N>`` restores on the CPU. The ``Trainer`` resumes the optimizer of a multi-process CPU
    run with ``torch.load(map_location=args.device)``, which is ``cpu:<rank>`` there, and torch
    knows only ``cpu`` ("don't know how to restore data location ... (tagged with cpu:0)")."""
    if isinstance(location, str) and re.fullmatch(r"cpu:\d+", location):
        return storage
    return None


torch.serialization.register_package(11, lambda _obj: None, _restore_cpu_index)


def resume_arg() -> bool | None:
    return True if os.environ.get("DTRUN_RESUME_STEP", "").strip() else None


class DtrunCallback(TrainerCallback):
    def __init__(self, exit_on_stop: bool = True) -> None:
        self.exit_on_stop = exit_on_stop
        self.signalled = False
        self.stopping = False
        self._prev = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, _signum, _frame) -> None:
        self.signalled = True

    def _agreed(self) -> bool:
        """Did any rank get SIGTERM? (every rank asks each step, so all stop at the same one)"""
        flag = self.signalled
        try:
            import torch
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                t = torch.tensor([1 if flag else 0], dtype=torch.int32)
                if dist.get_backend() == "nccl":
                    t = t.cuda()
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                flag = bool(t.item())
        except (ImportError, RuntimeError) as e:  # the group is broken: say so once, keep this rank's flag
            if not getattr(self, "_warned", False):
                self._warned = True
                print(f"dtrun: the ranks cannot agree on a stop step ({type(e).__name__}: {e}); this rank "
                      "follows its own SIGTERM", file=sys.stderr, flush=True)
        return flag

    def on_step_end(self, args, state, control, **kwargs):
        if not self.stopping and self._agreed():
            self.stopping = True
            control.should_save = True
            control.should_training_stop = True
            if state.is_world_process_zero:
                print(f"dtrun: SIGTERM: saving step {state.global_step} and stopping", flush=True)
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero:
            loss = (logs or {}).get("loss")
            tail = f" loss {loss:.6g}" if isinstance(loss, (int, float)) else ""
            print(f"dtrun: step {state.global_step}/{state.max_steps}{tail}", flush=True)
        return control

    def on_train_end(self, args, state, control, **kwargs):
        if self.stopping and self.exit_on_stop:
            sys.stdout.flush()
            sys.exit(EXIT_RESUME)
        return control
