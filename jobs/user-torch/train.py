"""A plain PyTorch training script that gets every dtrun guarantee without importing dtrun.

It follows the node contract (docs/user-code.md) by hand, through the ``marker``
checkpoint format:

* checkpoints go to ``$DTRUN_CHECKPOINT_DIR/step-N/`` (model + optimizer + step), and a
  ``DONE_WRITING`` file is written last: only then does the node upload and commit the folder;
* on start it resumes from the newest folder that has ``DONE_WRITING`` (dtrun downloaded the newest
  COMMITTED checkpoint there before starting it);
* SIGTERM (a spot notice, the budget or deadline watchdog) → save at the end of this step, exit 75;
* a ``step N/M loss L`` line per step is the progress the node reads.

Run it under torchrun (``command.torchrun: true``): DDP over gloo on CPU, NCCL on GPUs. Data is
a seeded synthetic regression drawn per (step, rank), so a resumed run sees exactly the batches an
uninterrupted one would: its end state is the same.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time

import torch
import torch.distributed as dist

STEPS = int(os.environ.get("STEPS", "60"))
SAVE_EVERY = int(os.environ.get("SAVE_EVERY", "10"))
STEP_SLEEP = float(os.environ.get("STEP_SLEEP", "0"))  # to watch it (and kill it) mid-run
SEED = 1234

stop = False


def on_sigterm(_signum, _frame):
    global stop
    stop = True


def latest(root: str):
    best = None
    for name in os.listdir(root) if os.path.isdir(root) else []:
        mark = os.path.join(root, name, "DONE_WRITING")
        m = re.fullmatch(r"step-(\d+)", name)
        if m and os.path.exists(mark) and (best is None or int(m.group(1)) > best[0]):
            best = (int(m.group(1)), os.path.join(root, name))
    return best


def save(root: str, step: int, model, opt) -> None:
    folder = os.path.join(root, f"step-{step}")
    os.makedirs(folder, exist_ok=True)
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step},
               os.path.join(folder, "state.pt"))
    with open(os.path.join(folder, "DONE_WRITING"), "w") as f:  # last: the folder is whole
        f.write(json.dumps({"step": step}))


def main() -> int:
    signal.signal(signal.SIGTERM, on_sigterm)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if torch.cuda.is_available() else torch.device("cpu")
    torch.manual_seed(SEED)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)).to(device)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    root = os.environ.get("DTRUN_CHECKPOINT_DIR") or "checkpoints"
    start = 0
    found = latest(root)
    if found:
        state = torch.load(os.path.join(found[1], "state.pt"), map_location=device)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"]
        if rank == 0:
            print(f"resumed from step {start}", flush=True)
    w_true = torch.linspace(-1, 1, 16, device=device)
    for step in range(start + 1, STEPS + 1):
        g = torch.Generator().manual_seed(SEED * 100_003 + step * 101 + rank)
        x = torch.randn(32, 16, generator=g).to(device)
        y = (x @ w_true).unsqueeze(1)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0:
            print(f"step {step}/{STEPS} loss {loss.item():.6f}", flush=True)
        flag = torch.tensor([1 if stop else 0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank stops at the same step
        if step % SAVE_EVERY == 0 or step == STEPS or flag.item():
            if rank == 0:
                save(root, step, model, opt)
            dist.barrier()
        if flag.item():
            if rank == 0:
                print(f"SIGTERM: saved step {step}, exiting 75 (resume me)", flush=True)
            dist.destroy_process_group()
            return 75
        time.sleep(STEP_SLEEP)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
