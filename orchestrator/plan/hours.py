"""How long a job takes on an offer: step time, start-up, checkpoint cost, preemption rate and the
checkpoint interval — the hours the estimate (``plan/estimate.py``) prices.

::

    compute  = 6 × active parameters × tokens / (GPUs × peak bf16 FLOP/s × MFU), never below the
               host's floor of launching a step's kernels
    start-up = provisioning + setup (with or without a prebuilt image) + first step (+ compile),
               per provider from the price snapshot's ``startup:`` figures (sources and dates there)
    interval = the spec's, or Young/Daly's √(2 · checkpoint cost · MTBF) for ``every_steps: auto``

Pure Python: no torch, no sky, no boto3 (the dry run must stay well under a second).
"""

from __future__ import annotations

import math
from typing import Any

from orchestrator.contract.gpus import GPUS
from orchestrator.plan.spec import JobSpec
from providers.base import Offer

IMAGE_PROVIDERS = ("runpod", "vast", "modal")
"""Providers whose nodes run a container image dtrun chooses (``resources.image``)."""
VM_TORCH_PROVIDERS = ("lambda",)
"""Providers whose VM image ships PyTorch (Lambda Stack): setup checks it instead of reinstalling."""
# Preemptions per hour assumed for spot capacity when the spec does not say
# (resources.preemptions_per_hour). No provider publishes a rate; one every five hours is a
# middle-of-the-road figure for GPU spot markets. `dtrun simulate` shows what other rates do.
DEFAULT_SPOT_PREEMPTIONS_PER_HOUR = 0.2
# Object-store write bandwidth assumed for a checkpoint, bytes/s (per node).
CHECKPOINT_BANDWIDTH = 1.0e9
# Fraction of a sync save the training loop stalls for with DCP async_save (measured on CPU:
# 0.2-0.3 s of 13-16 s => ~0.02).
ASYNC_STALL_FRACTION = 0.02


def young_daly_interval_s(checkpoint_cost_s: float, mtbf_s: float) -> float:
    """Optimal checkpoint interval (Young 1974 / Daly 2006 first order): √(2 · C · MTBF)."""
    return math.sqrt(2.0 * max(checkpoint_cost_s, 1e-6) * mtbf_s)


def poisson_quantile(mean: float, q: float) -> int:
    """Smallest k with P(X ≤ k) ≥ q for X ~ Poisson(mean)."""
    if mean <= 0:
        return 0
    k, term = 0, math.exp(-mean)
    cdf = term
    while cdf < q and k < 10_000:
        k += 1
        term *= mean / k
        cdf += term
    return k


RECOMPUTE_FACTOR = {"none": 1.0, "selective": 7.0 / 6.0, "full": 8.0 / 6.0}
"""Activation checkpointing re-runs the forward of each checkpointed block in backward: 2 of the
6 FLOPs per parameter and token again (full: every block, 8/6; selective, every other block as the
trainer defines it: 7/6)."""


# The floor under a step: eager PyTorch dispatches every operator from the host, one kernel
# launch or more each, however small the tensors. Operators per optimizer step MEASURED with
# torch.profiler on the bundled trainer's model (tiny preset, AdamW foreach, CPU, 2026-12-01):
# 342 top-level aten ops at 2 layers, 642 at 4 → 150 per layer per micro-batch + 42 per step
# (embedding, head, loss, optimizer). Seconds per op: ~10 µs of host dispatch + launch, the figure
# PyTorch's "Accelerating PyTorch with CUDA Graphs" (pytorch.org blog, 2021) gives for eager
# launch overhead ("a few microseconds" of launch plus the framework's dispatch per kernel).
OPS_PER_LAYER_PER_MICRO_BATCH = 150
OPS_PER_STEP = 42
SECONDS_PER_OP = 10e-6


def step_floor_seconds(spec: JobSpec, gpus: int | None = None) -> float:
    """The host-side floor of one optimizer step: operators launched × seconds per operator,
    with one forward/backward per micro-batch (gradient accumulation over the data-parallel ranks)."""
    t = spec.trainer
    n = gpus or spec.resources.total_gpus
    micro = t.micro_batch_size or max(1, t.batch_size // n)
    micro_batches = max(1, math.ceil(t.batch_size / (micro * n)))
    ops = OPS_PER_LAYER_PER_MICRO_BATCH * t.model_spec.n_layers * micro_batches + OPS_PER_STEP
    return ops * SECONDS_PER_OP


def flops_device(spec: JobSpec, gpu: str) -> str:
    """Whose peak FLOP/s the estimate uses: the CPU's when ``trainer.device: cpu`` trains CPU ranks
    on a GPU node (priced as the GPU node, timed as CPUs), else the GPU's."""
    return "cpu" if spec.trainer is not None and spec.trainer.device == "cpu" else gpu


def compute_step_seconds(spec: JobSpec, gpu: str | None = None, gpus: int | None = None) -> float:
    """Seconds per optimizer step from FLOPs alone at the assumed MFU (recompute included)."""
    t = spec.trainer
    g = GPUS[flops_device(spec, gpu or spec.resources.gpu)]
    n = gpus or spec.resources.total_gpus
    flops = 6.0 * t.model_spec.active_params() * t.tokens_per_step * RECOMPUTE_FACTOR[t.activation_checkpointing]
    return flops / (n * g.peak_bf16_flops * spec.budget.mfu)


def step_seconds(spec: JobSpec, gpu: str | None = None, gpus: int | None = None) -> float:
    """Seconds per optimizer step: the FLOPs at the assumed MFU, never below the per-step floor
    (:func:`step_floor_seconds`: a tiny model's step is bound by launching its kernels)."""
    return max(compute_step_seconds(spec, gpu, gpus), step_floor_seconds(spec, gpus))


def node_image(spec: JobSpec, provider: str) -> str | None:
    """The container image a node of ``provider`` runs (None: the provider's own image/VM)."""
    from orchestrator.plan.sections import DEFAULT_NODE_IMAGE

    img = spec.resources.image
    if provider not in IMAGE_PROVIDERS or img == "none":
        return None
    if img == "default" and provider == "modal":
        # Modal builds its own layered image once (debian-slim, torch for Modal's driver, the
        # dependencies, the code) and caches every layer: already "prebuilt", and smaller than
        # building on the PyTorch image, which would add a second torch. A named image is the base.
        return None
    return DEFAULT_NODE_IMAGE if img == "default" else img


def prebuilt(spec: JobSpec, provider: str) -> bool:
    """Does a node start with Python and torch installed (an image, or Lambda's VM PyTorch)?"""
    if spec.resources.image == "none":
        return False
    return provider in IMAGE_PROVIDERS or provider in VM_TORCH_PROVIDERS or provider == "local"


def startup(spec: JobSpec, offer: Offer) -> dict[str, Any]:
    """One attempt's start-up in minutes, from the snapshot's figures for the offer's provider:
    provisioning, setup (prebuilt image or full install), first step, compile (GPU + compile)."""
    from providers.catalog import startup_figures

    f = startup_figures(offer.provider)
    pre = prebuilt(spec, offer.provider)
    setup = f.setup_image if pre else f.setup_install
    comp = f.compile.minutes if spec.trainer is not None and spec.trainer.compile and offer.gpu != "cpu" else 0.0
    total = f.provisioning.minutes + setup.minutes + f.first_step.minutes + comp
    return {
        "provider": offer.provider, "prebuilt_image": pre, "image": node_image(spec, offer.provider),
        "provisioning_minutes": f.provisioning.minutes, "setup_minutes": setup.minutes,
        "first_step_minutes": f.first_step.minutes, "compile_minutes": comp, "total_minutes": total,
        "sources": {"provisioning": f"{f.provisioning.source} ({f.provisioning.date})",
                    "setup": f"{setup.source} ({setup.date})",
                    "first_step": f"{f.first_step.source} ({f.first_step.date})",
                    **({"compile": f"{f.compile.source} ({f.compile.date})"} if comp else {})},
    }


def checkpoint_bytes(spec: JobSpec) -> float:
    """Model + AdamW state as DCP writes it: fp32 params and two fp32 moments (12 B/param)."""
    if spec.command is not None:  # the same 12 B/param from command.params (0 when not given)
        return 12.0 * (spec.command.params or 0.0)
    return 12.0 * spec.trainer.model_spec.num_params()


def checkpoint_save_seconds(spec: JobSpec) -> float:
    """Seconds one checkpoint costs the training loop (async: the staging stall only)."""
    sync = checkpoint_bytes(spec) / (CHECKPOINT_BANDWIDTH * spec.resources.nodes)
    return sync * (ASYNC_STALL_FRACTION if spec.checkpoint.async_mode == "async" else 1.0)


def preemption_rate(spec: JobSpec, override: float | None = None) -> float:
    """Spot preemptions per hour of one node (``resources.preemptions_per_hour`` or the override)."""
    if override is not None:
        return override
    rate = getattr(spec.resources, "preemptions_per_hour", None)
    return DEFAULT_SPOT_PREEMPTIONS_PER_HOUR if rate is None else rate


def attempt_preemption_rate(spec: JobSpec, nodes: int, override: float | None = None) -> float:
    """Preemptions per hour that end an attempt of ``nodes`` spot nodes. Losing any one node ends
    the whole attempt — the surviving ranks' collectives fail, the node watchdogs end them, the
    controller tears the rest down and relaunches every node from the last COMMITTED step — so a
    cluster loses its attempt N times as often as one node does."""
    return preemption_rate(spec, override) * max(1, nodes)


def checkpoint_interval_steps(spec: JobSpec, rate_per_hour: float, step_s: float) -> int:
    """The spec's interval, or Young/Daly's for ``every_steps: auto``."""
    every = spec.checkpoint.every_steps
    if every != "auto":
        return int(every)
    if rate_per_hour <= 0:
        return max(1, spec.trainer.total_steps // 10)
    cost = max(checkpoint_save_seconds(spec), step_s)
    interval = young_daly_interval_s(cost, 3600.0 / rate_per_hour)
    return max(1, min(spec.trainer.total_steps, round(interval / step_s)))


def command_compute_hours(spec: JobSpec, gpu: str, gpus: int) -> float:
    """A command job's uninterrupted run: ``command.hours``, else 6·N·D at ``budget.mfu``."""
    c = spec.command
    assert c is not None
    if c.hours is not None:
        return c.hours
    assert c.params is not None and c.tokens is not None
    return 6.0 * c.params * c.tokens / (gpus * GPUS[gpu].peak_bf16_flops * spec.budget.mfu) / 3600.0


def workload(spec: JobSpec, offer: Offer, rate: float) -> dict[str, Any]:
    """What the job computes on ``offer``: step time, steps, checkpoint interval (steps and hours),
    compute and checkpoint hours, and where the hours come from. The bundled trainer's from its
    model and token budget; a command job's from ``command.hours`` or 6·N·D (its own saves are
    inside those hours; its lost work per preemption is half of ``checkpoint_every_minutes``)."""
    gpus = offer.gpus_per_node * offer.nodes
    b = spec.budget
    c = spec.command
    if c is not None:
        compute_h = command_compute_hours(spec, offer.gpu, gpus)
        steps = c.steps or 0
        step_s = compute_h * 3600.0 / steps if steps else 0.0
        tau_h = min(c.checkpoint_every_minutes / 60.0, compute_h)
        every = max(1, round(tau_h * 3600.0 / step_s)) if steps else 0
        tokens = int(c.tokens or 0)
        return {"step_s": step_s, "steps": steps, "every": every, "compute_h": compute_h, "ckpt_h": 0.0,
                "tau_h": tau_h, "tokens_per_step": tokens // steps if steps else 0,
                "hours_source": ("budget.hours" if b.hours is not None else "command.hours"
                                 if c.hours is not None else "6·N·D (command.params × command.tokens)"),
                "params": int(c.params or 0), "active_params": int(c.params or 0), "tokens": tokens,
                "step_floor_seconds": 0.0, "flops_step_seconds": step_s}
    t = spec.trainer
    assert t is not None
    pipe = pipeline_for(spec, offer.gpu, offer.gpus_per_node, offer.nodes)
    flops_s = compute_step_seconds(spec, offer.gpu, gpus) / (1.0 - (pipe["bubble"] if pipe else 0.0))
    step_s = max(flops_s, step_floor_seconds(spec, gpus))
    every = checkpoint_interval_steps(spec, rate, step_s)
    steps = t.total_steps
    return {"step_s": step_s, "steps": steps, "every": every, "compute_h": steps * step_s / 3600.0,
            "ckpt_h": (steps // every) * checkpoint_save_seconds(spec) / 3600.0,
            "tau_h": every * step_s / 3600.0, "tokens_per_step": t.tokens_per_step,
            "hours_source": "budget.hours" if b.hours is not None else "token budget",
            "params": t.model_spec.num_params(), "active_params": t.model_spec.active_params(),
            "tokens": t.total_tokens, "step_floor_seconds": step_floor_seconds(spec, gpus),
            "flops_step_seconds": flops_s, "pipeline": pipe}


_PIPE_CACHE: dict[tuple[int, str, int, int], tuple[JobSpec, dict[str, Any] | None]] = {}


def pipeline_for(spec: JobSpec, gpu: str, gpus_per_node: int, nodes: int) -> dict[str, Any] | None:
    """The pipeline the job runs on that shape (``plan/pipeline.pipeline_info``: schedule,
    microbatches, bubble), None without PP: the written degrees, or for ``parallel: auto`` the
    planner's pick there (PP rungs exist only on several nodes). Its bubble is idle time: the
    FLOPs' step time is divided by ``1 − bubble``."""
    from orchestrator.plan.ladder import planned_micro_batch
    from orchestrator.plan.pipeline import pipeline_info

    t = spec.trainer
    if t.parallel != "auto":
        par = spec.parallel_degrees
        return pipeline_info(spec, par, planned_micro_batch(spec, par)) if par.pp > 1 else None
    if nodes < 2 or gpu == "cpu":
        return None
    key = (id(spec), gpu, gpus_per_node, nodes)
    hit = _PIPE_CACHE.get(key)
    if hit is None or hit[0] is not spec:
        from orchestrator.contract.errors import DtrunError
        from orchestrator.plan.planner import auto_plan

        try:
            p = auto_plan(spec, gpu=gpu, gpus_per_node=gpus_per_node, nodes=nodes, suggest=False)
            info = p.pipeline if p.fits else None
        except DtrunError:
            info = None
        if len(_PIPE_CACHE) > 64:
            _PIPE_CACHE.clear()
        hit = _PIPE_CACHE[key] = (spec, info)
    return hit[1]
