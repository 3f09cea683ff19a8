"""The parallel ladder: which layouts a job could run with, the bytes of each, the lowest that fits.

Pure Python (no torch): the dry run calls :func:`plan` on every invocation. Bytes per rank come
from ``plan/memory.py``; ``plan/planner.py`` (auto plan, fit check, ``resolve_parallel``) is the
front door.

The ladder (lowest first; the planner picks the lowest rung that fits)::

    single        one GPU, nothing to distribute
    ddp           replicate everything, all-reduce gradients (the trainer: HSDP with a shard group
                  of one, ``parallel: {replicate: true}``)
    hsdp-zero2/3  several nodes only: FSDP2 sharded within each node (``dp_shard`` = GPUs per
                  node) and replicated across nodes (``dp_replicate`` = nodes). Parameter
                  all-gathers and gradient reduce-scatters stay on the node's own links; one
                  gradient all-reduce per step crosses the inter-node network. More memory than
                  sharding over every GPU (the shard group is one node), far less traffic between
                  nodes, so it comes before the fsdp rungs when there is more than one node.
    fsdp-zero2    FSDP2 fully_shard(reshard_after_forward=False): parameters, gradients and optimizer
                  state sharded at rest; gathered parameters kept from forward to backward
    fsdp-zero3    FSDP2 resharding after forward: only ~one block's parameters gathered at a time
    fsdp-zero3+tpT   plus tensor parallel of degree T (T <= GPUs per node, divides the heads)
    …+epE         MoE models: experts split over E ranks (expert parallel; each MoE's experts are
                  their own FSDP unit sharded over the dp/E ranks holding the same experts; the
                  bundled trainer does not combine EP with TP)
    fsdp-zero3+cpC   context parallel: each rank a 1/C shard of every sequence (long sequences,
                  where activations dominate; C within a node; while the bundled trainer's job
                  check refuses cp, these rungs carry that refusal as their note)
    ppN+fsdp-zero3(+tpT)   several nodes only: pipeline parallel with one stage per node (pp =
                  nodes, 1f1b), FSDP (and TP) within the node: only activations cross nodes
                  (point to point), so auto tries these right after HSDP and before any layout
                  whose all-gathers cross nodes. Bytes per stage, the schedule's in-flight
                  microbatches and its bubble: ``plan/pipeline.py``

The rungs mirror ``trainer/parallel.py`` exactly (tests/trainer/test_planner_exact.py runs the
real trainer under torchrun and compares every rank's bytes). ``trainer.parallel: auto`` is
``planner.auto_plan``, which searches these rungs at smaller micro-batches and with activation
checkpointing too. When no rung fits, ``plan/suggest.py`` says what would.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from orchestrator.contract.errors import DtrunError, SpecError
from orchestrator.contract.gpus import GPUS, canonical_gpu
from orchestrator.plan.memory import (
    FIXED_OVERHEAD_BYTES, GB, HEADROOM, PREFETCHED_BLOCKS, Device, activation_bytes, local_shape, param_shapes,
    state_bytes_per_rank,
)
from orchestrator.plan.pipeline import (
    evaluate_pp_cp, job_check_refusal, microbatch_problem, pipeline_info, static_problem,
)
from orchestrator.plan.spec import JobSpec, Parallel
from orchestrator.plan.suggest import suggest_fit


@dataclass
class Rung:
    """One rung of the ladder evaluated for this job."""

    strategy: str
    parallel: Parallel
    memory_bytes: int = 0
    breakdown: dict[str, int] = field(default_factory=dict)
    fits: bool = False
    note: str = ""
    """Why the rung is not applicable (empty when it was evaluated)."""

    @property
    def memory_per_gpu_gb(self) -> float:
        return self.memory_bytes / GB

    def to_dict(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            "parallel": self.parallel.model_dump(),
            "memory_per_gpu_gb": round(self.memory_per_gpu_gb, 2),
            "fits": self.fits,
            "breakdown_gb": {k: round(v / GB, 3) for k, v in self.breakdown.items()},
            **({"note": self.note} if self.note else {}),
        }


@dataclass
class MemoryPlan:
    """The planner's answer for one job on one GPU type and layout."""

    strategy: str
    """The chosen rung (the lowest that fits), or the heaviest evaluated one when nothing fits."""
    memory_per_gpu_gb: float
    fits: bool
    parallel: Parallel
    breakdown: dict[str, int]
    """Bytes per GPU: params, grads, optimizer, gathered, activations, overhead."""
    rungs: list[Rung]
    gpu: str
    gpu_memory_gb: float | None
    """None for CPU ranks (host memory is not checked)."""
    gpus_per_node: int
    nodes: int
    micro_batch_size: int
    suggestion: str | None = None
    """When nothing fits: a GPU type and/or node count that would."""
    notes: list[str] = field(default_factory=list)
    activation_checkpointing: str = "none"
    """The activation checkpointing the plan was evaluated with (``auto_plan``: its choice)."""
    auto: dict[str, Any] | None = None
    """``auto_plan``: what auto was allowed to choose (``pinned``) and what it changed."""
    why: str | None = None
    """With several nodes: why this layout (HSDP or sharding over every GPU), for the dry run."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            "memory_per_gpu_gb": round(self.memory_per_gpu_gb, 2),
            "fits": self.fits,
            "gpu": self.gpu,
            "gpu_memory_gb": self.gpu_memory_gb,
            "gpus_per_node": self.gpus_per_node,
            "nodes": self.nodes,
            "micro_batch_size": self.micro_batch_size,
            "activation_checkpointing": self.activation_checkpointing,
            "parallel": self.parallel.model_dump(),
            "breakdown_gb": {k: round(v / GB, 3) for k, v in self.breakdown.items()},
            "rungs": [r.to_dict() for r in self.rungs],
            "suggestion": self.suggestion,
            "headroom": HEADROOM,
            "fixed_overhead_gb": FIXED_OVERHEAD_BYTES / GB,
            "notes": list(self.notes),
            **({"auto": self.auto} if self.auto is not None else {}),
            **({"why": self.why} if self.why else {}),
            **({"pipeline": self.pipeline} if self.pipeline else {}),
        }

    @property
    def pipeline(self) -> dict[str, Any] | None:
        """Schedule, microbatches and bubble of a pipelined plan (None without PP)."""
        return self.parallel_info.get("pipeline")

    parallel_info: dict[str, Any] = field(default_factory=dict)
    """``pipeline``: :func:`orchestrator.plan.pipeline.pipeline_info` of the chosen layout."""


def dp_degree(par: Parallel) -> int:
    """Data-parallel ranks (each reads its own slice of the batch): dp_replicate × dp_shard."""
    return max(1, par.dp_replicate) * max(1, par.dp_shard)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_rungs(spec: JobSpec, n: int, gpus_per_node: int) -> list[tuple[str, Parallel, str]]:
    """(strategy, degrees, note) in ladder order; a non-empty note means "not applicable"."""
    ms, t = spec.trainer.model_spec, spec.trainer
    out: list[tuple[str, Parallel, str]] = []
    if n == 1:
        out.append(("single", Parallel(dp_shard=1, tp=1, ep=1), ""))
        return out
    bs_note = "" if t.batch_size % n == 0 else f"batch_size {t.batch_size} not divisible by {n} ranks"
    out.append(("ddp", Parallel(dp_shard=n, replicate=True), bs_note))
    nodes = n // gpus_per_node
    if nodes > 1 and gpus_per_node > 1:
        for raf in (False, True):
            out.append((f"hsdp-zero{3 if raf else 2}",
                        Parallel(dp_replicate=nodes, dp_shard=gpus_per_node, reshard_after_forward=raf), bs_note))
    out.append(("fsdp-zero2", Parallel(dp_shard=n, reshard_after_forward=False), bs_note))
    out.append(("fsdp-zero3", Parallel(dp_shard=n), bs_note))
    eps = [1]
    if ms.moe is not None:
        eps += [e for e in _divisors(ms.moe.n_experts) if e > 1]
    tps = [1] + [x for x in (2, 4, 8, 16) if x <= n]
    for tp in tps:
        for ep in eps:
            if tp == 1 and ep == 1:
                continue
            name = "fsdp-zero3" + (f"+tp{tp}" if tp > 1 else "") + (f"+ep{ep}" if ep > 1 else "")
            note = ""
            dp = n // tp if n % tp == 0 else 0
            if tp > gpus_per_node:
                note = f"tp {tp} exceeds {gpus_per_node} GPUs per node"
            elif n % tp:
                note = f"tp {tp} does not divide {n} GPUs"
            elif ms.n_heads % tp or ms.kv_heads % tp:
                note = f"tp {tp} does not divide the heads ({ms.n_heads} q, {ms.kv_heads} kv)"
            elif ep > 1 and tp > 1:
                note = "the bundled trainer does not combine ep and tp"
            elif tp > 1 and ms.ff_dim % tp:
                note = f"tp {tp} does not divide the feed-forward size {ms.ff_dim}"
            elif ep > 1 and dp % ep:
                note = f"ep {ep} does not divide the data-parallel degree {dp}"
            elif t.batch_size % dp:
                note = f"batch_size {t.batch_size} not divisible by the data-parallel degree {dp}"
            out.append((name, Parallel(dp_shard=max(dp, 1), tp=tp, ep=ep), note))
    # EP before TP for MoE (moving tokens is cheaper than splitting every matmul); order by tp
    # then ep so the ladder stays "fewest/cheapest extras first".
    out += _cp_rungs(spec, n, gpus_per_node)
    out += _pp_rungs(spec, n, gpus_per_node)
    return out


def cp_supported() -> str:
    """Empty when the job check accepts ``cp > 1`` (the bundled trainer runs it), else its reason."""
    return job_check_refusal(cp=2)


def _cp_rungs(spec: JobSpec, n: int, gpn: int) -> list[tuple[str, Parallel, str]]:
    """Context parallel within a node (cp ∈ 2, 4, 8; alone, then under TP: tp × cp ≤ GPUs per
    node), FSDP over the rest (cp folded into its shard group)."""
    ms, t = spec.trainer.model_spec, spec.trainer
    out: list[tuple[str, Parallel, str]] = []
    for tp in (1, 2, 4):
        for cp in (2, 4, 8):
            if tp * cp > gpn or n % (tp * cp):
                continue
            dp = n // (tp * cp)
            par = Parallel(dp_shard=dp, tp=tp, cp=cp)
            note = static_problem(spec, par) or cp_supported()
            if not note and tp > 1 and (ms.n_heads % tp or ms.kv_heads % tp or ms.ff_dim % tp):
                note = f"tp {tp} does not divide the heads or the feed-forward size"
            if not note and t.batch_size % dp:
                note = f"batch_size {t.batch_size} not divisible by the data-parallel degree {dp}"
            out.append(("fsdp-zero3" + (f"+tp{tp}" if tp > 1 else "") + f"+cp{cp}", par, note))
    return out


def _pp_rungs(spec: JobSpec, n: int, gpn: int) -> list[tuple[str, Parallel, str]]:
    """One pipeline stage per node (1f1b), FSDP and then TP × FSDP within the node."""
    nodes = n // gpn
    if nodes < 2:
        return []
    ms, t = spec.trainer.model_spec, spec.trainer
    out: list[tuple[str, Parallel, str]] = []
    for tp in [1] + [x for x in (2, 4, 8) if x <= gpn]:
        par = Parallel(pp=nodes, dp_shard=gpn // tp, tp=tp)
        name = f"pp{nodes}+fsdp-zero3" + (f"+tp{tp}" if tp > 1 else "")
        note = static_problem(spec, par) or ""
        if not note and tp > 1 and (gpn % tp or ms.n_heads % tp or ms.kv_heads % tp or ms.ff_dim % tp):
            note = f"tp {tp} does not divide the GPUs per node, the heads or the feed-forward size"
        if not note and t.batch_size % (gpn // tp):
            note = f"batch_size {t.batch_size} not divisible by the data-parallel degree {gpn // tp}"
        out.append((name, par, note))
    return out


def _elem_bytes(spec: JobSpec, device: Device) -> tuple[int, bool]:
    """(activation/compute bytes per element, mixed precision?)."""
    if device == "cpu" or spec.trainer.precision == "fp32":
        return 4, False
    return 2, True


def planned_micro_batch(spec: JobSpec, par: Parallel) -> int:
    """Sequences per rank per forward pass: the spec's ``micro_batch_size``, else the pure
    data-parallel share ``batch_size / GPUs`` — kept when tensor parallel shrinks the
    data-parallel degree (gradient accumulation makes up the rest), so TP lowers per-rank
    activations instead of trading them for a bigger micro-batch. Must divide batch_size / dp."""
    t = spec.trainer
    if t.micro_batch_size:
        return t.micro_batch_size
    if par.pp > 1:
        # Auto's PP rungs: one sequence per microbatch — the most microbatches (the smallest bubble)
        # and the least activation memory held (resolve_parallel writes it). Written degrees run
        # the trainer's own default, batch / dp (then pp_microbatches splits it).
        return 1 if t.parallel == "auto" else max(1, t.batch_size // dp_degree(par))
    dp = dp_degree(par)
    per_dp = max(1, t.batch_size // dp)
    want = max(1, t.batch_size // (dp * par.tp))
    return max(m for m in range(1, want + 1) if per_dp % m == 0)


def evaluate_rung(spec: JobSpec, par: Parallel, strategy: str, device: Device,
                  micro_batch: int | None = None, checkpointing: str | None = None) -> Rung:
    """Per-GPU bytes of the job under the given degrees (rank 0, the largest shard)."""
    t, ms = spec.trainer, spec.trainer.model_spec
    elem, mixed = _elem_bytes(spec, device)
    dp = par.dp_shard
    mb = micro_batch or planned_micro_batch(spec, par)
    if par.pp > 1 or par.cp > 1:
        return _evaluate_pp_cp_rung(spec, par, strategy, device, mb, checkpointing or t.activation_checkpointing)
    state = state_bytes_per_rank(ms, par, optimizer=t.optimizer, padded=True)

    # Parameters/gradients in flight (unsharded, compute dtype), by FSDP unit.
    units: dict[str, int] = {}
    whole = Parallel(dp_shard=1, tp=par.tp, ep=1, replicate=True)
    for p in param_shapes(ms):
        n = math.prod(local_shape(p, whole, 0, 0, 0, True))
        if p.expert and par.ep > 1:
            n = n // par.ep  # the E/ep local experts, gathered over dp_rep with their block
        units[p.unit] = units.get(p.unit, 0) + n
    total_local = sum(units.values())
    blocks = [v for k, v in units.items() if k != "root"] or [0]
    biggest = max(blocks)
    if dp == 1:
        # One rank: whole weights, no FSDP; a bf16 copy of the weights if cast for compute.
        gathered = elem * total_local if mixed else 0
    elif not par.reshard_after_forward:
        gathered = elem * total_local + (elem + 4) * biggest
    else:
        # FSDP2 prefetches: the next block's all-gather runs while the current block computes
        # (forward; the previous one in backward), so two blocks' parameters are gathered at once.
        gathered = elem * (units.get("root", 0) + PREFETCHED_BLOCKS * biggest) + (elem + 4) * biggest
    acts = activation_bytes(ms, t.seq_len, mb, elem, tp=par.tp, ep=par.ep,
                            checkpointing=checkpointing or t.activation_checkpointing,
                            fused_attention=device == "gpu")
    modelled = state["params"] + state["grads"] + state["optimizer"] + gathered + acts
    overhead = int(HEADROOM * modelled) + (FIXED_OVERHEAD_BYTES if device == "gpu" else 0)
    breakdown = {
        "params": state["params"],
        "grads": state["grads"],
        "optimizer": state["optimizer"],
        "gathered": gathered,
        "activations": acts,
        "overhead": overhead,
    }
    return Rung(strategy, par, memory_bytes=modelled + overhead, breakdown=breakdown)


def _evaluate_pp_cp_rung(spec: JobSpec, par: Parallel, strategy: str, device: Device, mb: int,
                         checkpointing: str) -> Rung:
    """A PP/CP rung: ``plan/pipeline.py``'s worst rank plus the overhead; a layout that cannot run
    (at this micro-batch) comes back with its reason as the note."""
    elem, mixed = _elem_bytes(spec, device)
    note = static_problem(spec, par) or microbatch_problem(spec, par, mb)
    if note:
        return Rung(strategy, par, note=note)
    breakdown = evaluate_pp_cp(spec, par, mb, elem, mixed, checkpointing, fused=device == "gpu")
    modelled = sum(breakdown.values())
    breakdown["overhead"] = int(HEADROOM * modelled) + (FIXED_OVERHEAD_BYTES if device == "gpu" else 0)
    return Rung(strategy, par, memory_bytes=modelled + breakdown["overhead"], breakdown=breakdown)


def plan_target(spec: JobSpec, gpu: str | None, gpus_per_node: int | None, nodes: int | None
            ) -> tuple[str, int, int, int, Device, float | None]:
    """(gpu, GPUs per node, nodes, GPUs, device kind, memory limit in bytes or None) for a plan,
    the spec's resources filling what is not given."""
    r = spec.resources
    g = canonical_gpu(gpu) if gpu else r.gpu
    if g is None:
        raise DtrunError(f"unknown GPU {gpu!r}; known: {', '.join(GPUS)}")
    gpn = gpus_per_node or r.gpus_per_node
    nn = nodes or r.nodes
    device: Device = "cpu" if g == "cpu" else "gpu"
    return g, gpn, nn, gpn * nn, device, None if device == "cpu" else GPUS[g].memory_gb * GB


def plan(spec: JobSpec, gpu: str | None = None, gpus_per_node: int | None = None,
         nodes: int | None = None, *, suggest: bool = True) -> MemoryPlan:
    """Evaluate every rung for the job on ``gpu`` × ``gpus_per_node`` × ``nodes`` (defaults:
    ``spec.resources``) and pick the lowest that fits with headroom. With explicit
    ``trainer.parallel`` the plan still evaluates the ladder; ``.strategy`` is the planner's pick,
    and the user's own degrees are evaluated by :func:`evaluate_spec_parallel`."""
    g, gpn, nn, n, device, limit = plan_target(spec, gpu, gpus_per_node, nodes)

    rungs: list[Rung] = []
    for name, par, note in candidate_rungs(spec, n, gpn):
        if note:
            rungs.append(Rung(name, par, note=note))
            continue
        rung = evaluate_rung(spec, par, name, device)
        rung.fits = not rung.note and (limit is None or rung.memory_bytes <= limit)
        rungs.append(rung)
    evaluated = [x for x in rungs if not x.note]
    notes: list[str] = []
    if device == "cpu":
        notes.append("CPU ranks: host memory is not checked; the lowest rung is chosen")
    if not evaluated:
        raise SpecError(
            f"trainer.parallel: no parallel layout is valid for {n} GPUs: "
            + "; ".join(f"{x.strategy}: {x.note}" for x in rungs))
    chosen = next((x for x in evaluated if x.fits), None)
    fits = chosen is not None
    if chosen is None:
        chosen = min(evaluated, key=lambda x: x.memory_bytes)
    mb = planned_micro_batch(spec, chosen.parallel)
    p = MemoryPlan(
        strategy=chosen.strategy,
        memory_per_gpu_gb=chosen.memory_per_gpu_gb,
        fits=fits,
        parallel=chosen.parallel,
        breakdown=dict(chosen.breakdown),
        rungs=rungs,
        gpu=g,
        gpu_memory_gb=None if limit is None else GPUS[g].memory_gb,
        gpus_per_node=gpn,
        nodes=nn,
        micro_batch_size=mb,
        notes=notes,
        activation_checkpointing=spec.trainer.activation_checkpointing,
        why=multi_node_why(chosen.strategy, rungs, nn, gpn),
        parallel_info={"pipeline": pipeline_info(spec, chosen.parallel, mb)},
    )
    if not fits and suggest:
        p.suggestion = suggest_fit(spec, g, gpn, nn, fits_on=_fits_on,
                                   layout_valid=lambda m: layout_valid(spec, gpn, m))
    return p


def _fits_on(spec: JobSpec, gpu: str, gpn: int, nodes: int) -> MemoryPlan | None:
    """The ladder's plan (the spec's micro-batch and checkpointing) when it fits there, else None."""
    try:
        p = plan(spec, gpu=gpu, gpus_per_node=gpn, nodes=nodes, suggest=False)
    except DtrunError:
        return None
    return p if p.fits else None


def layout_valid(spec: JobSpec, gpn: int, nodes: int) -> bool:
    """Some parallel layout is valid for the job on ``nodes`` × ``gpn`` GPUs (no bytes counted)."""
    return any(not note for _, _, note in candidate_rungs(spec, nodes * gpn, gpn))


def multi_node_why(strategy: str, rungs: list[Rung], nodes: int, gpus_per_node: int,
                   hsdp_searched: str | None = None) -> str | None:
    """The dry run's reason for the chosen layout across nodes (None on one node).
    ``hsdp_searched``: auto searched HSDP at every micro-batch and checkpointing it may choose
    and none fits — its smallest (``"hsdp-zero3 at 97.0 GB/GPU with …"``), said instead of HSDP's
    figure at the chosen micro-batch."""
    if nodes < 2:
        return None
    by = {r.strategy: r for r in rungs if not r.note}

    def gb(name: str) -> str:
        r = by.get(name)
        return f"{r.memory_per_gpu_gb:.1f} GB/GPU" if r else "n/a"

    if strategy.startswith("hsdp"):
        return (f"{strategy}: sharded within each node (dp_shard {gpus_per_node}) and replicated across the "
                f"{nodes} nodes (dp_replicate {nodes}): parameter all-gathers and gradient reduce-scatters stay on "
                f"a node's own links, one gradient all-reduce per step crosses nodes; ddp needs {gb('ddp')} "
                f"(does not fit)")
    if strategy.startswith("pp"):
        hs_why = (f"HSDP (one node's shard group) fits at no micro-batch or activation checkpointing auto may "
                  f"choose (smallest: {hsdp_searched})" if hsdp_searched else
                  f"HSDP needs {gb('hsdp-zero3')} and does not fit")
        return (f"{strategy}: one pipeline stage per node (pp {nodes}), sharded within it — only activations "
                f"cross nodes, point to point; {hs_why}")
    if strategy == "ddp":
        return f"ddp fits ({gb('ddp')}): one gradient all-reduce per step crosses nodes, nothing else"
    hs = [r for r in rungs if r.strategy.startswith("hsdp")]
    if not hs:
        return f"{strategy} across {nodes} nodes: no HSDP layout for this job"
    if all(r.note for r in hs):
        return f"{strategy} across {nodes} nodes: HSDP is not applicable ({hs[0].note})"
    if hsdp_searched:
        return (f"{strategy}: sharded over all {nodes * gpus_per_node} GPUs, every all-gather crosses nodes — "
                f"HSDP (one node's shard group) fits at no micro-batch or activation checkpointing auto may "
                f"choose (smallest: {hsdp_searched})")
    return (f"{strategy}: sharded over all {nodes * gpus_per_node} GPUs, every all-gather crosses nodes — "
            f"HSDP (one node's shard group) needs {gb('hsdp-zero3')} and does not fit")


# ---- the user's own degrees -------------------------------------------------------------------

def strategy_name(par: Parallel, n: int) -> str:
    """The ladder name of explicit degrees."""
    if n == 1:
        return "single"
    if par.pp > 1:
        inner = strategy_name(par.model_copy(update={"pp": 1}), n // par.pp) if n > par.pp else "single"
        return f"pp{par.pp}" + ("" if inner == "single" else f"+{inner}")
    if par.cp > 1:
        return strategy_name(par.model_copy(update={"cp": 1}), max(2, n)) + f"+cp{par.cp}"
    if par.replicate and par.tp == 1 and par.ep == 1:
        return "ddp"
    base = ("hsdp" if par.dp_replicate > 1 else "fsdp") + ("-zero3" if par.reshard_after_forward else "-zero2")
    if par.tp > 1:
        base += f"+tp{par.tp}"
    if par.ep > 1:
        base += f"+ep{par.ep}"
    return base


def evaluate_spec_parallel(spec: JobSpec, gpu: str | None = None) -> Rung | None:
    """The user's explicit ``trainer.parallel`` evaluated like a rung (None for ``auto``) on
    ``gpu`` (default ``spec.resources.gpu``; an offer's variant, ``H100-SXM`` for ``gpu: H100``,
    is checked against its own memory): the degrees the nodes run, whichever GPU serves them."""
    if spec.trainer.parallel == "auto":
        return None
    g = (canonical_gpu(gpu) if gpu else None) or spec.resources.gpu
    par = spec.parallel_degrees
    n = spec.resources.total_gpus
    device: Device = "cpu" if g == "cpu" else "gpu"
    rung = evaluate_rung(spec, par, strategy_name(par, n), device)
    limit = None if device == "cpu" else GPUS[g].memory_gb * GB
    rung.fits = not rung.note and (limit is None or rung.memory_bytes <= limit)
    return rung
