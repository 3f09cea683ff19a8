"""A short profiled run: where the time goes, tokens/s, MFU and a verdict.

Run under torchrun like the trainer (``dtrun profile JOB`` does it)::

    torchrun --standalone --nproc-per-node N -m trainer.profiling --job JOB.yaml --run-uri URI \
        --profile-steps 10 --result breakdown.json

It builds the job exactly as the trainer does (``trainer.build.check_job`` and ``build_parts``:
the model or, at ``pp > 1``, this rank's pipeline stages and their schedule; ``cp`` slices every
sequence), runs one un-profiled warm-up step, then ``--profile-steps``
steps under ``torch.profiler`` with one checkpoint save in the middle (the trainer's
``CheckpointManager``, to a scratch folder that is deleted afterwards), and splits rank 0's wall
time into:

* **data** — ``dtrun/data`` ranges (fetching and moving the micro-batches);
* **communication** — collective ops on the training thread (FSDP all-gather / reduce-scatter,
  all-reduce, all-to-all, barrier and waits on them), merged so overlaps count once;
* **compute** — forward, backward and optimizer ranges minus the communication inside them;
* **checkpoint stall** — ``dtrun/checkpoint`` ranges (staging for async saves; the whole save
  for sync);
* **idle** — the rest of the wall time (logging, Python, waiting on stragglers).

On GPU the split is of host wall time with a device synchronise at the end of every step (kernel
time is in compute unless a collective blocks). Traces (Chrome JSON, one per rank) and the
breakdown go to ``<run-uri>/profile/``. MFU = achieved FLOP/s (``ModelSpec.flops_per_token``) over
the ranks' peak (the GPU's data-sheet bf16 peak; on CPU, ``orchestrator.contract.gpus``' nominal CPU figure).

At ``pp > 1`` the result also holds ``pipeline_bubble``: the bubble measured after the profiled
steps next to the planner's formula (:mod:`trainer.profile_bubble`); ``None`` at ``pp = 1``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

from orchestrator.contract import runuri

PROFILE_DIR = "profile"
MFU_VERDICT_THRESHOLD = 0.30
VERDICT_LOW = "MFU below 30%: communication- or dataloader-bound; fix before scaling"

_COMM_MARKERS = ("all_gather", "allgather", "reduce_scatter", "reducescatter", "all_reduce", "allreduce",
                 "broadcast", "all_to_all", "alltoall", "barrier", "c10d::", "gloo:", "nccl:", "wait_tensor",
                 "record_param_comms")


def is_comm(name: str) -> bool:
    low = name.lower()
    return any(m in low for m in _COMM_MARKERS)


def merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def total(intervals: list[tuple[float, float]]) -> float:
    return sum(e - s for s, e in intervals)


def intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length of the overlap of two merged interval lists."""
    i = j = 0
    acc = 0.0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if e > s:
            acc += e - s
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return acc


def breakdown_from_events(events: list[Any], wall_us: float) -> dict[str, float]:
    """Seconds per category from profiler FunctionEvents of this process (see module docstring)."""
    ranges: dict[str, list[tuple[float, float]]] = {"data": [], "compute": [], "checkpoint": []}
    comm: list[tuple[float, float]] = []
    main_threads = {ev.thread for ev in events if ev.name.startswith("dtrun/")}
    for ev in events:
        tr = ev.time_range
        iv = (float(tr.start), float(tr.end))
        if ev.name == "dtrun/data":
            ranges["data"].append(iv)
        elif ev.name in ("dtrun/forward_backward", "dtrun/optimizer"):
            ranges["compute"].append(iv)
        elif ev.name == "dtrun/checkpoint":
            ranges["checkpoint"].append(iv)
        elif ev.thread in main_threads and is_comm(ev.name):
            comm.append(iv)
    comm_m = merge(comm)
    compute_m = merge(ranges["compute"])
    data_m, ckpt_m = merge(ranges["data"]), merge(ranges["checkpoint"])
    comm_in_compute = intersect(comm_m, compute_m)
    comm_s = (comm_in_compute + intersect(comm_m, merge(data_m + ckpt_m))) / 1e6
    comm_s = min(comm_s, total(comm_m) / 1e6)
    compute_s = max(0.0, total(compute_m) - comm_in_compute) / 1e6
    data_s = total(data_m) / 1e6
    ckpt_s = total(ckpt_m) / 1e6
    wall_s = wall_us / 1e6
    idle_s = max(0.0, wall_s - compute_s - comm_s - data_s - ckpt_s)
    return {"compute": compute_s, "communication": comm_s, "data": data_s, "checkpoint_stall": ckpt_s,
            "idle": idle_s, "wall": wall_s}


def verdict(mfu: float | None, shares: dict[str, float]) -> str:
    if mfu is None:
        return "MFU unknown (no peak FLOP/s for this device)"
    if mfu < MFU_VERDICT_THRESHOLD:
        worst = max(("communication", "data", "checkpoint_stall", "idle"), key=lambda k: shares.get(k, 0.0))
        return f"{VERDICT_LOW} (largest non-compute share: {worst} {shares.get(worst, 0.0):.0%})"
    return f"MFU {mfu:.0%} ≥ 30%: compute-bound; scaling out is reasonable"


def run(job: str, run_uri: str | None, steps: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function

    from orchestrator.contract.gpus import GPUS
    from orchestrator.plan.spec import load_spec
    from trainer.build import build_parts, check_job
    from trainer.distenv import init_distributed, select_device
    from trainer.metrics import peak_flops
    from trainer.model import add_aux, local_value, loss_context, loss_fn
    from trainer.optim import lr_at
    from trainer.parallel import amp_context, clip_grad_norm_, finish_expert_grads

    spec = load_spec(job)
    uri = run_uri or spec.run_uri
    t = spec.trainer
    ms = t.model_spec
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dims, _mb = check_job(spec, world, rank)  # the trainer's refusals, before any process group
    device = select_device(spec, local_rank)  # GPU asked, CUDA unusable: ConfigError, never CPU
    use_cuda = device.type == "cuda"
    if world > 1 and not dist.is_initialized():
        init_distributed(spec, device)
    try:
        # The trainer's own parts (trainer/build.py: meshes, the model or its pipeline stages,
        # optimizer, loader), with the checkpoint manager on a scratch folder under the profile.
        scratch = runuri.join(uri, PROFILE_DIR, "scratch-checkpoint")
        if rank == 0:  # a profile killed earlier may have left one: its steps would skip the weight init
            runuri.remove(scratch, recursive=True)
        if dist.is_initialized():
            dist.barrier()
        parts = build_parts(spec, dims, _mb, device, rank, world, scratch)
        model, params, optimizer, loader, ckpt = parts.model, parts.params, parts.optimizer, parts.loader, parts.ckpt
        scaler, meshes, param_dtype, pipe = parts.scaler, parts.meshes, parts.param_dtype, parts.pipe
        pp_group = pipe.group if pipe is not None else None
        cp = getattr(model, "cp", None)

        def sync() -> None:
            if use_cuda:
                torch.cuda.synchronize()

        def one_step(step: int, save: bool) -> torch.Tensor:
            lr = lr_at(step, lr=t.lr, warmup_steps=t.warmup_steps, total_steps=steps + 1,
                       min_lr_ratio=t.min_lr_ratio)
            for g in optimizer.param_groups:
                g["lr"] = lr
            accum = loader.accum_steps
            loss_val = torch.zeros((), device=device)
            if pipe is not None:  # the schedule runs every micro-batch's forward and backward
                with record_function("dtrun/data"):
                    batches = list(loader.batches(step))
                with record_function("dtrun/forward_backward"), amp_context(device, param_dtype, meshes):
                    loss_val = pipe.step(batches, scaler, t.z_loss, model)  # 0 off the last stage
            it = iter(loader.batches(step)) if pipe is None else iter(())
            while True:
                with record_function("dtrun/data"):
                    batch = next(it, None)
                if batch is None:
                    break
                x, y = batch
                if cp is not None:  # the tokens and their labels, sliced alike (head-tail)
                    x, y = cp.shard(x), cp.shard(y)
                # as train.py: every micro-batch reduce-scatters its gradients
                with record_function("dtrun/forward_backward"), loss_context(model):
                    with amp_context(device, param_dtype, meshes):
                        loss, ce = loss_fn(model(x), y, t.z_loss)
                        loss = add_aux(loss, model.aux_loss())
                    scaler.scale_loss(loss / accum).backward()
                    loss_val += local_value(ce.detach()) / accum
            with record_function("dtrun/optimizer"):
                finish_expert_grads(model, dims, meshes)
                scaler.unscale_(params)
                gnorm = clip_grad_norm_(params, t.grad_clip, pp_group)
                if scaler.update(gnorm):
                    optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                sync()
            loader.advance(step)
            if save:
                with record_function("dtrun/checkpoint"):
                    sd = ckpt.state_dict(model, optimizer, loader, {"step": step + 1, "tokens": 0, "loss": 0.0})
                    ckpt.save(step + 1, sd, {"tokens": 0, "loss": 0.0})
                    sync()
            return loss_val

        one_step(0, save=False)  # warm-up: allocations, first all-gathers, lazy init
        if dist.is_initialized():
            dist.barrier()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if use_cuda else [])
        with profile(activities=activities, record_shapes=False, with_stack=False) as prof:
            t0 = time.perf_counter()
            for s in range(1, steps + 1):
                last_loss = one_step(s, save=(s == max(1, steps // 2)))
            sync()
            wall = time.perf_counter() - t0
        ckpt.wait()
        ckpt.close()
        if pipe is not None:  # the loss lives on the last stage's ranks (0 elsewhere)
            dist.all_reduce(last_loss)
            last_loss /= world // dims.pp
        last_loss = float(last_loss)
        bubble = None
        if pipe is not None:
            from trainer import profile_bubble

            bubble = profile_bubble.measure(parts, spec, dims, device, steps + 1, sync, rounds=steps)
        loader.close()

        trace_uri = runuri.join(uri, PROFILE_DIR, f"trace-rank{rank}.json")
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "trace.json")
            prof.export_chrome_trace(path)
            _upload(path, trace_uri)
        parts_s = breakdown_from_events(list(prof.events()), wall * 1e6)
        tokens_per_s = t.tokens_per_step * steps / wall
        peak = peak_flops(device.type) or (GPUS["cpu"].peak_bf16_flops if device.type == "cpu" else None)
        mfu = (ms.flops_per_token(t.seq_len) * tokens_per_s / (world * peak)) if peak else None
        shares = {k: v / parts_s["wall"] for k, v in parts_s.items() if k != "wall"} if parts_s["wall"] else {}
        par = {"dp_shard": dims.dp_shard, "tp": dims.tp, "ep": dims.ep, "replicate": dims.replicate}
        par.update({k: getattr(dims, k) for k in ("pp", "cp") if getattr(dims, k) > 1})
        if pipe is not None:
            par["pp_schedule"] = pipe.cfg.schedule
        result = {
            "steps": steps, "world_size": world, "device": device.type, "parallel": par,
            "seconds": {k: round(v, 4) for k, v in parts_s.items()},
            "shares": {k: round(v, 4) for k, v in shares.items()},
            "step_seconds": round(wall / steps, 4),
            "tokens_per_s": round(tokens_per_s, 1),
            "mfu": None if mfu is None else round(mfu, 4),
            "peak_flops_per_rank": peak,
            "peak_note": "nominal CPU figure (orchestrator.contract.gpus 'cpu')" if device.type == "cpu" else "data-sheet bf16",
            "loss": last_loss,
            "pipeline_bubble": bubble,  # None at pp = 1 (trainer/profile_bubble.py)
            "verdict": verdict(mfu, shares),
            "trace_uris": [runuri.join(uri, PROFILE_DIR, f"trace-rank{r}.json") for r in range(world)],
            "breakdown_uri": runuri.join(uri, PROFILE_DIR, "breakdown.json"),
        }
        if dist.is_initialized():
            dist.barrier()  # every rank's trace is uploaded
        if rank == 0:
            runuri.write_json(result["breakdown_uri"], result)
            runuri.remove(scratch, recursive=True)
        return result
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _upload(local: str, uri: str) -> None:
    lp = runuri.local_path(uri)
    if lp is not None:
        import shutil

        os.makedirs(os.path.dirname(lp), exist_ok=True)
        shutil.copyfile(local, lp)
        return
    fs, path = runuri._fs(uri)
    fs.put_file(local, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer.profiling", allow_abbrev=False)
    p.add_argument("--job", required=True)
    p.add_argument("--run-uri", dest="run_uri", default=None)
    p.add_argument("--profile-steps", dest="profile_steps", type=int, default=10)
    p.add_argument("--result", dest="result", default=None)
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    from trainer.errors import ConfigError

    try:
        res = run(a.job, a.run_uri, max(1, a.profile_steps))
    except ConfigError as e:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"dtrun profile: error: {e}", file=sys.stderr, flush=True)
        return 2
    if int(os.environ.get("RANK", "0")) == 0:
        line = json.dumps(res)
        print("PROFILE " + line, flush=True)
        if a.result:
            with open(a.result, "w") as f:
                f.write(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
