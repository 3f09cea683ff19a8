"""The pipeline bubble of a ``pp > 1`` job, measured for ``dtrun profile`` (:mod:`trainer.profiling`).

Every rank times two things, alternated in rounds after the profiled steps (so both see the same
load on the machine), ``max(MIN_ROUNDS, --steps)`` of each, medians:

* **pipelined**: one step's forward and backward through the schedule (``Pipeline.step``, its
  point-to-point sends and waits included; no optimizer), between two barriers: ``T_pp``;
* **busy**: the same work without the schedule — this rank's own stages' forward and backward on
  the step's ``m`` microbatches, back to back (the first stage: the step's tokens, sliced as the
  schedule slices them; later stages: random activations of the stage's static shape; the last
  stage: the loss; FSDP's gradient sync on the last microbatch only, as the schedule does), every
  rank at the same time: ``T_busy(r)``.

A rank's idle share of the pipelined step is ``1 − T_busy(r) / T_pp``; the **measured bubble** is
its mean over the ranks (the idle share of all the ranks' time), shown next to the planner's
formula ``(p − 1)/(m·v + p − 1)`` (:func:`orchestrator.plan.pipeline.bubble_fraction`). The
measured figure also holds what the formula leaves out — the sends and receives, the schedule's
per-microbatch work, stages of unequal cost (the embedding on the first, the head and the loss on
the last) — so on CPU it sits above the formula; ``benchmarks/bench_pp_bubble.py`` measures the
same curve against an unpipelined reference.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

MIN_ROUNDS = 3


def _stage_inputs(parts: Any, spec: Any, dims: Any, batches: list, device: Any) -> list[tuple[Any, list, list]]:
    """(stage, inputs per microbatch, targets per microbatch or None) for this rank's stages."""
    import torch

    pipe, t = parts.pipe, spec.trainer
    cfg = pipe.cfg
    xs, ys = zip(*batches)
    x, y = torch.cat(xs), torch.cat(ys)
    if pipe.cp is not None:
        x, y = pipe.cp.shard(x), pipe.cp.shard(y)
    xm, ym = list(x.tensor_split(cfg.microbatches)), list(y.tensor_split(cfg.microbatches))
    act = (parts.param_dtype or torch.float32) if parts.meshes.fsdp is not None else torch.float32
    seq = t.seq_len // dims.cp // dims.tp
    g = torch.Generator(device=device).manual_seed(t.seed)
    out = []
    for st in pipe.stages:
        if st.is_first:
            ins = xm
        else:  # one activation tensor of the static shape, reused for every microbatch
            a = torch.randn(cfg.rows, seq, t.model_spec.d_model, generator=g, device=device).to(act)
            ins = [a.requires_grad_(True)] * cfg.microbatches
        out.append((st, ins, ym if st.is_last else None))
    return out


def _busy_step(work: list, pipe: Any, model: Any, z_loss: float, amp: Any) -> None:
    """This rank's stages' forward + backward over the step's microbatches, without the schedule."""
    import torch
    from torch.distributed.fsdp import FSDPModule

    from trainer.model import loss_context, loss_fn

    m = pipe.cfg.microbatches
    for i in range(m):
        for st, ins, ys in work:
            mod = st.submod
            if isinstance(mod, FSDPModule):  # as the schedule: reduce (and reshard) after the last only
                mod.set_requires_gradient_sync(i == m - 1)
                mod.set_reshard_after_backward(i == m - 1)
            with loss_context(model), amp():
                out = mod(ins[i])
                if ys is not None:
                    loss, _ = loss_fn(out, ys[i], z_loss)
            if ys is not None:
                (loss / m).backward()
            else:
                out.backward(torch.ones_like(out))
            if ins[i].requires_grad:
                ins[i].grad = None


def measure(parts: Any, spec: Any, dims: Any, device: Any, step: int, sync: Any, rounds: int) -> dict[str, Any]:
    """The measured bubble next to the formula (see the module docstring); every rank calls it."""
    import torch
    import torch.distributed as dist

    from orchestrator.plan.pipeline import bubble_fraction
    from trainer.parallel import amp_context

    pipe, model, t = parts.pipe, parts.model, spec.trainer
    cfg = pipe.cfg
    batches = list(parts.loader.batches(step))
    work = _stage_inputs(parts, spec, dims, batches, device)

    def amp() -> Any:
        return amp_context(device, parts.param_dtype, parts.meshes)

    def zero() -> None:
        for p in parts.params:
            p.grad = None
        for mo in model.moe_layers():
            mo.tokens_per_expert.zero_()

    def pipelined() -> None:
        with amp():
            pipe.step(batches, parts.scaler, t.z_loss, model)

    def timed(fn: Any, barrier_after: bool) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        sync()
        if barrier_after:  # the pipelined step ends when its last rank does
            dist.barrier()
        dt = time.perf_counter() - t0
        if not barrier_after:
            dist.barrier()
        zero()
        return dt

    def busy() -> None:
        _busy_step(work, pipe, model, t.z_loss, amp)

    timed(busy, False)  # warm-up (the pipelined step is warm from the profiled steps)
    t_pp, t_busy = [], []
    rounds = max(MIN_ROUNDS, rounds)
    for _ in range(rounds):
        t_pp.append(timed(pipelined, True))
        t_busy.append(timed(busy, False))
    world = dist.get_world_size()
    mine = torch.tensor([statistics.median(t_pp), statistics.median(t_busy)], dtype=torch.float64)
    every = [torch.zeros(2, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(every, mine)  # CPU tensors: on gloo, or the CPU side of a cuda:…,cpu:gloo group
    t_step = max(float(e[0]) for e in every)
    busy_s = [float(e[1]) for e in every]
    idle = [max(0.0, 1.0 - b / t_step) for b in busy_s]
    return {"measured": round(statistics.fmean(idle), 4),
            "formula": round(bubble_fraction(cfg.pp, cfg.microbatches, cfg.v, cfg.schedule), 4),
            "schedule": cfg.schedule, "microbatches": cfg.microbatches, "pp": cfg.pp, "stages_per_rank": cfg.v,
            "pipelined_step_seconds": round(t_step, 4), "busy_seconds_per_rank": [round(b, 4) for b in busy_s],
            "rounds": rounds,
            "method": "1 - (each rank's own stages' forward+backward without the schedule) / (the pipelined "
                      "forward+backward), mean over the ranks"}


def render(b: dict[str, Any]) -> str:
    """The profile's line, worded like the dry run's ``pipeline bubble: X% (schedule, m microbatches, pp N)``."""
    v = f", {b['stages_per_rank']} stages per rank" if b["stages_per_rank"] > 1 else ""
    return (f"pipeline bubble: measured {b['measured']:.1%} vs formula {b['formula']:.1%} "
            f"({b['schedule']}, {b['microbatches']} microbatches, pp {b['pp']}{v})")
