"""Known traps: the classic mistakes, caught before a dollar is spent.

The dry run prints each :class:`Trap` as a warning; ``--strict`` makes any trap exit 2.
Pure Python (no torch). Every check is a small function over (spec, offer, plan); the table:

=============================  ==================================================================
code                           fires when
=============================  ==================================================================
fp16-on-bf16-gpu               precision fp16 on an Ampere-or-newer GPU (bf16 needs no loss scaling)
spot-without-checkpoints       spot, and the checkpoint interval is at least the whole run
spot-checkpoints-on-node       spot on a remote provider with a file:// run URI (dies with the node)
checkpoint-interval-too-long   spot, and the interval is longer than the expected time between
                               preemptions (1 / preemptions per hour; estimate's default rate)
no-lr-warmup                   warmup_steps: 0
no-grad-clip                   grad_clip: null
moe-no-load-balancing          a MoE model with balance none (or a zero coefficient / rate)
tp-across-nodes                tensor-parallel degree above the GPUs per node
fsdp-across-nodes              explicit FSDP sharding over GPUs of several nodes where HSDP (shard
                               within a node, replicate across) fits the GPU
heavier-rung-than-needed       explicit ZeRO-3 or TP where plain DDP fits the GPU
debug-job-on-big-node          an 8×H100-class offer for a job one smaller GPU finishes in < 1 h
fp32-at-scale                  fp32 training on GPUs at ≥ 1B parameters or ≥ 8 GPUs
does-not-fit                   the memory planner finds no rung that fits (or the explicit degrees
                               do not fit while another rung would)
startup-dominates              start-up (provisioning, setup, first step, compile: the snapshot's
                               figures) is more than 10 % of an attempt's expected length
=============================  ==================================================================
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from pydantic import ValidationError

from orchestrator.contract.errors import DtrunError
from orchestrator.contract.gpus import GPUS, gpu_family, gpu_matches
from orchestrator.plan.spec import JobSpec
from providers.base import Offer

BF16_GPUS = frozenset({"A100", "A100-80GB", "A10", "L4", "L40S", "RTX4090", "H100", "H200", "GH200", "B200"})
"""Ampere or newer: bf16 tensor cores. (T4 is Turing: fp16 only.) By family: H100-SXM is an H100."""
BIG_NODE_GPUS = frozenset({"H100", "H200", "GH200", "B200"})
DEBUG_JOB_HOURS = 1.0
"""A job one small GPU finishes within this many compute hours is "debugging-sized"."""
FP32_SCALE_PARAMS = 1_000_000_000
FP32_SCALE_GPUS = 8


@dataclass(frozen=True)
class Trap:
    code: str
    message: str

    def to_dict(self) -> dict[str, str]:
        return {"code": self.code, "message": self.message}


@dataclass(frozen=True)
class _Ctx:
    spec: JobSpec
    offer: Offer | None
    plan: object  # MemoryPlan (typed loosely: the planner is imported lazily)
    gpu: str
    gpus_per_node: int
    nodes: int

    @property
    def gpus(self) -> int:
        return self.gpus_per_node * self.nodes


def _fp16(c: _Ctx) -> Trap | None:
    if c.spec.trainer.precision == "fp16" and gpu_family(c.gpu) in BF16_GPUS:
        return Trap("fp16-on-bf16-gpu",
                    f"trainer.precision: fp16 on {c.gpu}: use bf16 — same speed, fp32's range, "
                    "no loss scaling or overflow skips")
    return None


def _spot_interval(c: _Ctx) -> list[Trap]:
    from orchestrator.plan.hours import preemption_rate, step_seconds

    s = c.spec
    out: list[Trap] = []
    if not s.uses_spot:
        return out
    if s.run_uri.startswith("file://") and any(p not in ("local", "fake") for p in s.resources.providers):
        out.append(Trap("spot-checkpoints-on-node",
                        f"spot with checkpoint.uri {s.checkpoint.uri!r} on the node's own disk: a preemption "
                        "takes the checkpoints with it; use an s3:// run URI"))
    every = s.checkpoint.every_steps
    if every == "auto":
        return out
    total = s.trainer.total_steps
    if every >= total:
        out.append(Trap("spot-without-checkpoints",
                        f"spot capacity but checkpoint.every_steps ({every}) ≥ the run's {total} steps: "
                        "a preemption restarts from scratch; set every_steps (or auto)"))
        return out
    rate = preemption_rate(s)
    if rate <= 0:
        return out
    step_s = step_seconds(s, gpu=c.gpu, gpus=c.gpus)
    interval_h = every * step_s / 3600.0
    mtbp_h = 1.0 / rate
    if interval_h > mtbp_h:
        out.append(Trap("checkpoint-interval-too-long",
                        f"checkpoint.every_steps {every} ≈ {interval_h:.1f} h of training, longer than the "
                        f"expected {mtbp_h:.1f} h between spot preemptions ({rate:g}/h): most work would be "
                        "lost each time; use every_steps: auto (Young/Daly)"))
    return out


def _warmup(c: _Ctx) -> Trap | None:
    if c.spec.trainer.warmup_steps == 0:
        return Trap("no-lr-warmup", "trainer.warmup_steps: 0 — Adam's early updates at the peak LR often "
                    "diverge; a linear warmup of ~1–5% of the steps is standard")
    return None


def _clip(c: _Ctx) -> Trap | None:
    if c.spec.trainer.grad_clip is None:
        return Trap("no-grad-clip", "trainer.grad_clip: null — one bad batch's gradient spike can wreck the "
                    "run; global-norm clipping at 1.0 is standard")
    return None


def _moe_balance(c: _Ctx) -> Trap | None:
    moe = c.spec.trainer.model_spec.moe
    if moe is None:
        return None
    off = (moe.balance == "none" or (moe.balance == "aux_loss" and moe.aux_loss_coef == 0)
           or (moe.balance == "bias" and moe.bias_update_rate == 0))
    if off:
        return Trap("moe-no-load-balancing",
                    "MoE without load balancing (balance: none or a zero coefficient): the router collapses "
                    "onto a few experts (dropless: those few do all the work; with a capacity factor the rest "
                    "of the tokens are dropped); use balance: aux_loss or bias")
    return None


def _tp_nodes(c: _Ctx) -> Trap | None:
    par = c.spec.trainer.parallel
    if par != "auto" and par.tp > c.gpus_per_node:
        return Trap("tp-across-nodes",
                    f"trainer.parallel.tp {par.tp} > {c.gpus_per_node} GPUs per node: tensor parallel "
                    "all-reduces every layer over the inter-node network; keep tp within a node")
    return None


def _fsdp_nodes(c: _Ctx) -> Trap | None:
    par, p = c.spec.trainer.parallel, c.plan
    if par == "auto" or c.nodes < 2 or c.gpus_per_node < 2 or p is None or c.gpu == "cpu":
        return None
    par = c.spec.parallel_degrees
    if par.replicate or par.dp_replicate > 1 or par.ep > 1 or par.dp_shard * par.tp <= c.gpus_per_node:
        return None
    want = "hsdp-zero3" if par.reshard_after_forward else "hsdp-zero2"  # same resharding as asked
    hs = [r for r in p.rungs if r.strategy == want and not r.note and r.fits]
    if not hs:
        return None
    return Trap("fsdp-across-nodes",
                f"trainer.parallel shards over {par.dp_shard} ranks across {c.nodes} nodes: every parameter "
                f"all-gather and gradient reduce-scatter crosses the inter-node network, while {hs[0].strategy} "
                f"fits ({hs[0].memory_per_gpu_gb:.1f} GB/GPU on {c.gpu}) with only one gradient all-reduce per "
                f"step between nodes; use parallel: {{dp_replicate: {c.nodes}, dp_shard: {c.gpus_per_node}}} or auto")


def _heavier_rung(c: _Ctx) -> Trap | None:
    from orchestrator.plan.ladder import strategy_name

    s, p = c.spec, c.plan
    par = s.trainer.parallel
    if par == "auto" or c.gpu == "cpu" or c.gpus == 1 or p is None:
        return None
    par = s.parallel_degrees
    heavy = par.tp > 1 or (not par.replicate and par.reshard_after_forward)
    if not heavy:
        return None
    ddp = next((r for r in p.rungs if r.strategy in ("ddp", "single") and not r.note), None)
    if ddp is not None and ddp.fits:
        name = strategy_name(par, c.gpus)
        return Trap("heavier-rung-than-needed",
                    f"trainer.parallel gives {name}, but plain DDP fits ({ddp.memory_per_gpu_gb:.1f} GB/GPU "
                    f"on {c.gpu}): {'tensor parallel' if par.tp > 1 else 'ZeRO-3 resharding'} only adds "
                    "communication; use parallel: {replicate: true} or auto")
    return None


def _smallest_gpu(spec: JobSpec) -> tuple[str, object] | None:
    """The smallest (memory, then peak) GPU that runs the job alone, with the same micro-batch."""
    from orchestrator.plan.ladder import plan, planned_micro_batch

    mb = spec.trainer.micro_batch_size or planned_micro_batch(spec, spec.parallel_degrees)
    data = spec.model_dump(mode="json", exclude_none=True)
    data["trainer"]["parallel"] = {"dp_shard": 1}
    data["trainer"]["micro_batch_size"] = mb
    data["resources"].update(gpus_per_node=1, nodes=1)
    if data["resources"]["gpu"] == "cpu":
        return None
    try:
        single = JobSpec.model_validate(data)
    except ValidationError:  # a layout the spec rejects just means "no single-GPU answer"
        return None
    for g in sorted((x for x in GPUS.values() if x.name != "cpu"), key=lambda x: (x.memory_gb, x.peak_bf16_flops)):
        p = plan(single, gpu=g.name, gpus_per_node=1, nodes=1, suggest=False)
        if p.fits:
            return g.name, p
    return None


def _debug_big_node(c: _Ctx) -> Trap | None:
    if gpu_family(c.gpu) not in BIG_NODE_GPUS or c.gpus < 8:
        return None
    s = c.spec
    found = _smallest_gpu(s)
    if found is None:
        return None
    g, p = found
    hours = 6.0 * s.trainer.model_spec.active_params() * s.trainer.total_tokens / (
        GPUS[g].peak_bf16_flops * s.budget.mfu) / 3600.0
    if hours >= DEBUG_JOB_HOURS:
        return None
    return Trap("debug-job-on-big-node",
                f"a {c.gpus}×{c.gpu} offer for a debugging-sized job: one {g} ({GPUS[g].memory_gb:g} GB) holds it "
                f"({p.memory_per_gpu_gb:.1f} GB) and finishes it in ~{hours * 60:.0f} min of compute; "
                f"set resources.gpu: {g}, gpus_per_node: 1")


def _fp32_scale(c: _Ctx) -> Trap | None:
    s = c.spec
    if c.gpu == "cpu" or s.trainer.precision != "fp32":
        return None
    n = s.trainer.model_spec.num_params()
    if n >= FP32_SCALE_PARAMS or c.gpus >= FP32_SCALE_GPUS:
        return Trap("fp32-at-scale",
                    f"trainer.precision: fp32 for {n / 1e9:.2f}B parameters on {c.gpus} GPUs: tensor cores run "
                    "bf16 ~15× faster than fp32 (TF32 ~2×) and activations take twice the memory; use bf16 "
                    "(fp32 master weights and reductions are kept)")
    return None


def _fit(c: _Ctx) -> Trap | None:
    from orchestrator.plan.ladder import evaluate_spec_parallel

    p = c.plan
    if p is None or c.gpu == "cpu":
        return None
    if not p.fits:
        return Trap("does-not-fit",
                    f"no parallel layout fits {c.nodes}×{c.gpus_per_node} {c.gpu} "
                    f"(best: {p.strategy} at {p.memory_per_gpu_gb:.1f} GB/GPU): {p.suggestion}")
    r = c.spec.resources
    # The offer's GPU may be a variant of the spec's (gpu: H100 rented as H100-SXM): the same
    # degrees run there, so they are checked there.
    if c.spec.trainer.parallel != "auto" and gpu_matches(r.gpu, c.gpu) and (c.gpus_per_node, c.nodes) == (
            r.gpus_per_node, r.nodes):
        mine = evaluate_spec_parallel(c.spec, gpu=c.gpu)
        if mine is not None and not mine.fits:
            return Trap("does-not-fit",
                        f"trainer.parallel ({mine.strategy}) needs {mine.memory_per_gpu_gb:.1f} GB/GPU on {c.gpu} "
                        f"({GPUS[c.gpu].memory_gb:g} GB); {p.strategy} fits at {p.memory_per_gpu_gb:.1f} GB "
                        "(or use parallel: auto)")
    return None


STARTUP_SHARE = 0.10
"""Start-up above this share of an attempt's expected length is a trap."""


def _startup_share(c: _Ctx) -> Trap | None:
    """An attempt lasts the whole run on-demand, about 1/λ on spot (λ preemptions per hour);
    each pays the start-up again."""
    from orchestrator.plan.estimate import estimate_offer

    if c.offer is None or c.spec.budget.hours is not None or c.offer.price_per_gpu_hour == 0:
        return None  # (a free offer, this machine: start-up costs time, not money)
    est, _ = estimate_offer(c.spec, c.offer)
    b = est.breakdown
    startup_h = b["startup_hours"]
    if startup_h <= 0 or not est.hours or est.hours == float("inf"):
        return None
    attempt_h = est.hours / (1.0 + b["expected_preemptions"])
    share = startup_h / attempt_h
    if share <= STARTUP_SHARE:
        return None
    su = b["startup"]
    hint = ("use a prebuilt image (resources.image: default) instead of installing torch on every start; "
            if not su["prebuilt_image"] and c.offer.provider not in ("local", "fake") else "")
    return Trap("startup-dominates",
                f"start-up ({su['total_minutes']:.1f} min on {c.offer.provider}: provisioning "
                f"{su['provisioning_minutes']:g}, setup {su['setup_minutes']:g}, first step "
                f"{su['first_step_minutes']:g}, compile {su['compile_minutes']:g}) is {share:.0%} of an attempt's "
                f"expected length ({attempt_h * 60:.0f} min): {hint}"
                + ("fewer preemptions (on-demand) or a longer run per start pay it less often"
                   if b["expected_preemptions"] else "a job this short spends much of its money starting up"))


_CHECKS: list[Callable[[_Ctx], Trap | list[Trap] | None]] = [
    _startup_share,
    _fit, _fp16, _fp32_scale, _spot_interval, _warmup, _clip, _moe_balance, _tp_nodes, _fsdp_nodes,
    _heavier_rung,
    _debug_big_node,
]


def find_traps(spec: JobSpec, offer: Offer | None = None, plan: object | None = None) -> list[Trap]:
    """Every known trap the job (on ``offer``, else on ``spec.resources``) walks into.

    ``plan`` is the memory planner's plan for the same GPU/layout; computed here when omitted."""
    r = spec.resources
    if offer is not None:
        gpu, gpn, nodes = offer.gpu, offer.gpus_per_node, max(offer.nodes, r.nodes)
    else:
        gpu, gpn, nodes = r.gpu, r.gpus_per_node, r.nodes
    if gpu not in GPUS:
        from orchestrator.contract.gpus import canonical_gpu

        gpu = canonical_gpu(gpu) or r.gpu
    if plan is None:
        from orchestrator.plan.ladder import plan as make_plan

        try:
            plan = make_plan(spec, gpu=gpu, gpus_per_node=gpn, nodes=nodes)
        except DtrunError:  # no valid rung for this layout: no plan; the other traps still apply
            plan = None
    c = _Ctx(spec, offer, plan, gpu, gpn, nodes)
    out: list[Trap] = []
    for check in _CHECKS:
        got = check(c)
        if got is None:
            continue
        out.extend(got if isinstance(got, list) else [got])
    return out
