"""Pipeline (PP) and context (CP) parallel planning: the bytes of one rank of a pipeline stage
or a context shard, the schedule's bubble, and the refusals of a PP/CP layout.

Pure Python (no torch). ``plan/ladder.py`` calls :func:`evaluate_pp_cp` for any layout with
``pp > 1`` or ``cp > 1``; ``plan/hours.py`` prices :func:`bubble_fraction` into the step time.
The layout mirrors ``trainer/pipeline.py`` (``pp_config``, ``stage_ids``, ``split_stage``).

**Stages.** The layers split evenly into ``p × v`` stages (``v`` = stages per rank: 1 for
gpipe/1f1b, 2 by default for interleaved-1f1b, exactly 2 for zbv/dualpipev). Rank ``r`` holds
stages ``r, r + p, …`` (looped) or ``r`` and ``2p − 1 − r`` (the V schedules). The embedding
lives with stage 0, the final norm and head with the last (rank ``p − 1``; rank 0 for the V
schedules). Parameters, gradients and optimizer state are the rank's own layers, sharded by
FSDP within the stage (``dp_shard``; ``cp`` folded into the shard group as torchtitan's
``dp_shard_cp`` mesh does). zbv/dualpipev run FSDP with ``reshard_after_forward=False`` (the
trainer forces it: their split backward needs the gathered weights). The worst rank is the figure.

**Activations held at a rank's peak**, in microbatches of the rank's whole layer set (a chunk is
``1/v`` of it). Counted from torch 2.13's own schedules (``torch.distributed.pipelining``: the
forwards whose backward has not yet run; tests/orchestrator/plan/test_pipeline_plan.py replays
torch's ``pipeline_order`` and checks every rank):

* gpipe: all ``m`` forwards before the first backward (Huang et al. 2019, GPipe).
* 1f1b: ``min(m, p − r)`` warm-up forwards (``Schedule1F1B``: "first stage ``num_stages``
  warmups"); rank 0 holds ``p`` (Narayanan et al. 2021, Megatron-LM §2.2).
* interleaved-1f1b: ``(v − 1)·p + 2·(p − 1 − r) + 1`` chunks (``_get_warmup_ops`` plus the one in
  flight), capped at ``m·v``; rank 0: ``p + (p − 1)/v`` microbatches, Korthikanti et al. 2022
  §4.2.3's ``(1 + (p − 1)/(p·v))`` on 1F1B's ``p``.
* zbv: ``2p`` chunks = ``p`` microbatches on every rank once ``m ≥ 2p`` (Qi et al. 2024, "Zero
  Bubble Pipeline Parallelism", ZB-V: the same peak as 1F1B).
* dualpipev: ``2p + 1`` chunks = ``p + 1/2`` (DeepSeek's DualPipe README lists ``PP + 1``
  activations for two-copy DualPipe; torch's one-copy V form holds one chunk more than ZB-V).
* the last stage's logits and loss: one microbatch (its backward follows its forward; gpipe: ``m``).

**Bubble.** ``(p − 1)/(m·v + p − 1)`` of a step is idle (Narayanan et al. 2021: GPipe and 1F1B
``(p − 1)/(m + p − 1)``; interleaving divides the fill and drain by ``v``). zbv and dualpipev
split each backward into an input pass (B) and a weight pass (W) that fills the fill/drain: with
equal pass times the ideal is zero (Qi et al. 2024: ZB-V's bubble ``≈ 0`` when
``T_F = T_B = T_W``); the planner charges ZB-H1's residue instead, ``(p − 1)(T_F + T_B − T_W)``
against 1F1B's ``(p − 1)(T_F + T_B + T_W)`` — one third of the ``v = 2`` figure — as a margin for
unequal pass times. ``benchmarks/bench_pp_bubble.py`` measures what the schedules reach.

**CP.** Each rank holds ``seq_len / cp`` tokens of every sequence: every per-token activation is
divided by ``cp``; attention all-gathers K and V of the whole sequence and saves them for
backward (repeated to every head before SDPA): ``2·(s − s/cp)·b·h`` elements more per block, and
without a fused kernel the scores are ``(s/cp) × s`` instead of ``(s/cp)²``.
"""

from __future__ import annotations

import functools
import math
from typing import Any

from orchestrator.plan.memory import (
    LOSS_CHUNK_BYTES, PREFETCHED_BLOCKS, block_activation_bytes, local_shape, param_shapes,
)
from orchestrator.plan.presets import ModelSpec
from orchestrator.plan.spec import JobSpec, Parallel

V_SCHEDULES = ("zbv", "dualpipev")
"""The V-placed schedules with a split (input/weight) backward."""
ZB_RESIDUAL = 1.0 / 3.0
"""Share of the ``v = 2`` bubble the planner charges zbv/dualpipev (ZB-H1's over 1F1B's, equal
pass times; see the module docstring)."""


def stages_per_rank(par: Parallel) -> int:
    """``v``: the spec's ``pp_stages_per_rank``, else 2 for interleaved/V schedules, 1 otherwise."""
    if par.pp_stages_per_rank:
        return par.pp_stages_per_rank
    return 2 if par.pp_schedule in ("interleaved-1f1b", *V_SCHEDULES) else 1


def dp_ranks(par: Parallel) -> int:
    """Ranks that read different sequences: dp_replicate × dp_shard (cp and tp ranks share them)."""
    return max(1, par.dp_replicate) * max(1, par.dp_shard)


def microbatches(par: Parallel, batch_size: int, micro_batch: int) -> tuple[int, int]:
    """(``m`` microbatches per step, sequences per microbatch), as ``trainer/pipeline.pp_config``:
    ``m`` = ``pp_microbatches``, else the accumulation count batch / (dp × micro-batch)."""
    accum = max(1, batch_size // (dp_ranks(par) * max(1, micro_batch)))
    rows = accum * max(1, micro_batch)
    m = par.pp_microbatches or accum
    return m, max(1, rows // m)


def bubble_fraction(pp: int, m: int, v: int = 1, schedule: str = "1f1b") -> float:
    """Idle share of a pipelined step: ``(p − 1)/(m·v + p − 1)`` (gpipe/1f1b: v = 1), a third of
    the ``v = 2`` figure for zbv/dualpipev; 0 without PP."""
    if pp <= 1:
        return 0.0
    if schedule in ("gpipe", "1f1b"):
        v = 1
    f = (pp - 1) / (m * v + pp - 1)
    return f * ZB_RESIDUAL if schedule in V_SCHEDULES else f


def in_flight(schedule: str, p: int, m: int, v: int, rank: int) -> float:
    """Microbatches of rank ``rank``'s layers whose activations are held at its peak (chunks / v)."""
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b":
        return float(min(m, p - rank))
    if schedule == "interleaved-1f1b":
        chunks = (v - 1) * p + 2 * (p - 1 - rank) + 1
    elif schedule == "zbv":
        chunks = 2 * p
    else:  # dualpipev
        chunks = 2 * p + 1
    return min(chunks, m * v) / v


def rank_layers(L: int, p: int, v: int, schedule: str, rank: int) -> tuple[list[int], bool, bool]:
    """(layers, holds the embedding, holds the norm and head) of pipeline rank ``rank``."""
    per = L // (p * v)
    stages = [rank, 2 * p - 1 - rank] if schedule in V_SCHEDULES else [rank + k * p for k in range(v)]
    layers = [i for s in stages for i in range(s * per, (s + 1) * per)]
    return layers, 0 in stages, p * v - 1 in stages


@functools.lru_cache(maxsize=8)
def job_check_refusal(**degrees: int) -> str:
    """Empty when the job check (``plan/spec.py``, which mirrors the bundled trainer's refusals)
    accepts these degrees on a small CPU job, else its message: the PP/CP rungs follow what the
    trainer runs (cp, pp × cp) without a second list of what is supported."""
    n = max(1, degrees.get("pp", 1)) * max(1, degrees.get("cp", 1))
    try:
        JobSpec.model_validate({"name": "degree-probe", "resources": {"providers": ["local"], "gpu": "cpu",
                                                                      "gpus_per_node": n},
                                "trainer": {"model": "tiny", "parallel": {"dp_shard": 1, **degrees}, "steps": 1,
                                            "batch_size": 8, "seq_len": 128}})
    except ValueError as e:
        errs = e.errors() if hasattr(e, "errors") else [{"msg": str(e)}]
        msg = str(errs[0].get("msg", "")).removeprefix("Value error, ") if errs else ""
        return msg or f"trainer.parallel {degrees} is refused by the job check"
    return ""


def static_problem(spec: JobSpec, par: Parallel) -> str | None:
    """Why a PP/CP layout cannot run whatever the micro-batch (trainer/pipeline.pp_config's
    refusals, the field named), else None."""
    t, ms = spec.trainer, spec.trainer.model_spec
    if par.cp > 1 and t.seq_len % (2 * par.cp):
        return (f"trainer.parallel.cp ({par.cp}): trainer.seq_len ({t.seq_len}) must be divisible by "
                f"2 × cp = {2 * par.cp}")
    if par.cp > 1 and (t.seq_len // par.cp) % par.tp:
        return (f"trainer.parallel.cp ({par.cp}): seq_len / cp ({t.seq_len // par.cp}) must be divisible by "
                f"tp ({par.tp}) (sequence parallel)")
    if par.pp <= 1:
        return None
    if par.cp > 1 and job_check_refusal(pp=2, cp=2):
        return job_check_refusal(pp=2, cp=2)
    v, name = stages_per_rank(par), par.pp_schedule
    if name in V_SCHEDULES and v != 2:
        return f"trainer.parallel.pp_stages_per_rank ({v}): {name} holds exactly 2 stages per rank"
    if name in ("gpipe", "1f1b") and v != 1:
        return f"trainer.parallel.pp_stages_per_rank ({v}): {name} holds one stage per rank"
    if name == "interleaved-1f1b" and v < 2:
        return "trainer.parallel.pp_stages_per_rank (1): interleaved-1f1b needs ≥ 2; use 1f1b"
    if ms.n_layers % (par.pp * v):
        return (f"trainer.parallel.pp ({par.pp}) × pp_stages_per_rank ({v}) = {par.pp * v} does not divide "
                f"the model's {ms.n_layers} layers")
    if ms.tie_embeddings:
        return (f"trainer.parallel.pp ({par.pp}): the model ties its embedding and head, which live on "
                "different stages; untie them or use pp: 1")
    if ms.moe is not None and ms.moe.balance == "aux_loss":
        return f"trainer.parallel.pp ({par.pp}): the MoE aux loss is not supported under PP; use moe.balance: bias"
    if par.ep > 1:
        return f"trainer.parallel.pp ({par.pp}) with ep > 1 is not supported by the bundled trainer"
    if t.eval_every:
        return f"trainer.parallel.pp ({par.pp}) with trainer.eval_every is not supported yet"
    return None


def microbatch_problem(spec: JobSpec, par: Parallel, micro_batch: int) -> str | None:
    """Why the pipeline cannot run at this micro-batch (too few microbatches), else None."""
    if par.pp <= 1:
        return None
    t, v = spec.trainer, stages_per_rank(par)
    accum = max(1, t.batch_size // (dp_ranks(par) * max(1, micro_batch)))
    rows = accum * micro_batch
    m = par.pp_microbatches or accum
    if rows % m:
        return (f"trainer.parallel.pp_microbatches ({m}) must divide the sequences per step and "
                f"data-parallel rank ({rows})")
    need = {"gpipe": 1, "1f1b": par.pp, "interleaved-1f1b": par.pp}.get(par.pp_schedule, par.pp * v)
    if m < need:
        return (f"trainer.parallel.pp_microbatches ({m}) < {need}: {par.pp_schedule} at pp {par.pp} needs at "
                "least that many microbatches per step (fewer leave stages idle or hang); raise batch_size "
                "or lower micro_batch_size")
    if par.pp_schedule == "interleaved-1f1b" and m % max(1, m // par.pp):
        return f"trainer.parallel.pp_microbatches ({m}): interleaved-1f1b needs a multiple of pp ({par.pp})"
    return None


def pipeline_info(spec: JobSpec, par: Parallel, micro_batch: int) -> dict[str, Any] | None:
    """The schedule, microbatches, stages per rank and bubble of a pipelined layout (None at pp 1)."""
    if par.pp <= 1:
        return None
    v = stages_per_rank(par)
    m, rows = microbatches(par, spec.trainer.batch_size, micro_batch)
    return {"pp": par.pp, "schedule": par.pp_schedule, "microbatches": m, "microbatch_rows": rows,
            "stages_per_rank": v, "bubble": bubble_fraction(par.pp, m, v, par.pp_schedule)}


def _head_bytes(ms: ModelSpec, s: int, b: int, elem: int, tp: int) -> int:
    """The final norm, head input and logits (and their loss) for one microbatch (memory.py's terms)."""
    h = ms.d_model
    total = s * b * h * elem // tp + s * b * h * elem
    logits = s * b * ms.vocab_size
    if tp > 1 and not ms.tie_embeddings:
        return total + logits * (elem + 4 + 4) // tp
    return total + logits * 2 * elem + 3 * min(logits * 4, LOSS_CHUNK_BYTES)


def _layers_activation(ms: ModelSpec, layers: list[int], s: int, b: int, elem: int, tp: int, ep: int,
                       checkpointing: str, fused: bool, extra: int) -> tuple[int, int]:
    """(saved bytes of these layers for one microbatch, one recomputed block's bytes)."""
    per = {i: block_activation_bytes(ms, i, s, b, elem, tp, ep, fused) + extra for i in layers}
    if checkpointing == "none":
        ckpt: set[int] = set()
    elif checkpointing == "full":
        ckpt = set(layers)
    else:  # selective: every other block of the whole model (the trainer's definition)
        ckpt = {i for i in layers if i % 2 == 0}
    saved = sum(s * b * ms.d_model * elem // tp if i in ckpt else per[i] for i in layers)
    return saved, max((per[i] for i in ckpt), default=0)


def cp_extra_bytes(ms: ModelSpec, seq: int, cp: int, b: int, elem: int, tp: int, fused: bool) -> int:
    """Per block and microbatch, what a CP rank saves beyond a ``seq/cp``-token sequence: the
    gathered K and V of the other shards (repeated to every head), and unfused, the wider scores."""
    if cp <= 1:
        return 0
    s_loc = seq // cp
    out = 2 * (seq - s_loc) * b * ms.d_model * elem
    if not fused:
        out += elem * ms.n_heads * b * s_loc * (seq - s_loc)
    return out // tp


@functools.lru_cache(maxsize=64)
def _unit_table(ms: ModelSpec, dp_shard: int, tp: int, ep: int, replicate: bool,
                muon: bool) -> dict[str, tuple[int, int, int]]:
    """Per FSDP unit (the root split into ``root:emb`` and ``root:head``): (parameter bytes of
    this rank's padded shard, optimizer bytes, unsharded elements under TP). Cached: the ladder
    evaluates every pipeline rank of every rung, and the suggestion search many layouts."""
    shard = Parallel(dp_shard=dp_shard, tp=tp, ep=ep, replicate=replicate)
    whole = Parallel(dp_shard=1, tp=tp, ep=1, replicate=True)
    out: dict[str, tuple[int, int, int]] = {}
    for prm in param_shapes(ms):
        key = prm.unit
        if key == "root":
            key = "root:emb" if prm.name.startswith(("tok_embeddings", "pos_embeddings")) else "root:head"
        n = math.prod(local_shape(prm, shard, 0, 0, 0, True))
        o = 4 * n if (muon and prm.matrix) else 8 * n
        a, b, c = out.get(key, (0, 0, 0))
        out[key] = (a + 4 * n, b + o, c + math.prod(local_shape(prm, whole, 0, 0, 0, True)))
    return out


def evaluate_pp_cp(spec: JobSpec, par: Parallel, micro_batch: int, elem: int, mixed: bool,
                   checkpointing: str, fused: bool) -> dict[str, int]:
    """The worst pipeline rank's bytes (params, grads, optimizer, gathered, activations; no
    overhead) under ``par`` with ``pp`` and/or ``cp`` above 1."""
    rows = [rank_bytes(spec, par, r, micro_batch, elem, mixed, checkpointing, fused) for r in range(par.pp)]
    return max(rows, key=lambda x: sum(x.values()))


def rank_bytes(spec: JobSpec, par: Parallel, rank: int, micro_batch: int, elem: int, mixed: bool,
               checkpointing: str, fused: bool) -> dict[str, int]:
    """Bytes of pipeline rank ``rank`` (its FSDP shard 0, padded) under ``par``."""
    t, ms = spec.trainer, spec.trainer.model_spec
    p, cp, v = par.pp, par.cp, stages_per_rank(par)
    m, rows = microbatches(par, t.batch_size, micro_batch)
    s = t.seq_len // cp
    extra = cp_extra_bytes(ms, t.seq_len, cp, rows, elem, par.tp, fused)
    # FSDP within the stage; cp folded into the shard group (torchtitan's dp_shard_cp mesh).
    shard = par.model_copy(update={"dp_shard": max(1, par.dp_shard) * cp, "pp": 1, "cp": 1})
    raf = par.reshard_after_forward and not (p > 1 and par.pp_schedule in V_SCHEDULES)
    layers, emb, head = (rank_layers(ms.n_layers, p, v, par.pp_schedule, rank) if p > 1
                         else (list(range(ms.n_layers)), True, True))
    table = _unit_table(ms, shard.dp_shard, par.tp, par.ep, shard.replicate, t.optimizer == "muon")
    keys = [f"layers.{i}" for i in layers] + (["root:emb"] if emb else []) + (["root:head"] if head else [])
    params = sum(table[k][0] for k in keys if k in table)
    opt = sum(table[k][1] for k in keys if k in table)
    units: dict[str, int] = {}
    for k in keys:
        if k in table:
            u = "root" if k.startswith("root") else k
            units[u] = units.get(u, 0) + table[k][2]
    total_local = sum(units.values())
    biggest = max([u for k, u in units.items() if k != "root"] or [0])
    if shard.dp_shard == 1 or shard.replicate:
        gathered = elem * total_local if mixed else 0
    elif not raf:
        gathered = elem * total_local + (elem + 4) * biggest
    else:
        gathered = elem * (units.get("root", 0) + PREFETCHED_BLOCKS * biggest) + (elem + 4) * biggest
    k = in_flight(par.pp_schedule, p, m, v, rank) if p > 1 else 1.0
    saved, recompute = _layers_activation(ms, layers, s, rows, elem, par.tp, par.ep, checkpointing, fused, extra)
    # The last stage's loss and backward follow its forward at once (gpipe: after all m forwards).
    k_head = float(m) if p > 1 and par.pp_schedule == "gpipe" else 1.0
    acts = int(k * saved) + recompute + (int(k_head * _head_bytes(ms, s, rows, elem, par.tp)) if head else 0)
    return {"params": params, "grads": params, "optimizer": opt, "gathered": gathered, "activations": acts}
