"""Memory and parallelism planner: will it fit, and which parallelism is the simplest that fits.

Pure Python (no torch): the dry run calls :func:`plan` on every invocation.

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

The rungs mirror ``trainer/parallel.py`` exactly (tests/trainer/test_planner_exact.py runs the
real trainer under torchrun and compares every rank's bytes). ``trainer.parallel: auto`` →
:func:`resolve_parallel`, which the controller applies before writing the job to the run URI.

Per-GPU bytes (what each rank holds; the trainer's FSDP2 mixed-precision policy keeps the sharded
parameters in fp32 — they *are* the master copy — gathers them in bf16 for compute and
reduce-scatters gradients in fp32):

==============  ================================  =====================================
                bf16 / fp16 on GPU                fp32 (and every CPU run)
==============  ================================  =====================================
params          4 B × local shard (fp32 master)   4 B × local shard
grads           4 B × local shard (fp32 reduce)   4 B × local shard
                (the trainer reduce-scatters after every micro-batch, so gradient accumulation
                holds no full-size accumulator: the same bytes at any accumulation count)
optimizer       AdamW: 8 B (two fp32 moments);    same
                Muon: 4 B momentum on the 2-D block weights, AdamW's 8 B on the rest
gathered        2 B × unsharded parameters in flight (ZeRO-3 and DDP/HSDP: the root unit + two
                blocks, FSDP2's prefetch; ZeRO-2: the whole model) + unsharded gradients of one
                block (2 + 4 B)
activations     Korthikanti et al. 2022 (below)
overhead        10 % headroom on the sum above + 2 GB fixed (CUDA context ~0.5–1 GB, NCCL
                buffers, allocator fragmentation)
==============  ================================  =====================================

That is the classic 16 bytes per parameter of mixed-precision Adam (ZeRO paper: 2 + 2 + 12),
partitioned the way FSDP2 actually stores it. The "local shard" is exact: FSDP2 splits dim 0 of
each parameter into ``ceil(dim0 / dp)`` rows per rank (``torch.chunk``; the last ranks may get
fewer or none), after tensor parallel has split the column-/row-parallel dimension (one measured
quirk: with TP and no FSDP, the untied embedding's gradient is a whole Replicate tensor). The plan's
headline uses the padded size (FSDP2's storage is padded to equal chunks);
:func:`state_bytes_per_rank` gives the unpadded bytes a given rank's ``DTensor.to_local()`` holds.

Activations per block follow V. Korthikanti et al., "Reducing Activation Recomputation in Large
Transformer Models" (2022), eq. 2–3: ``s·b·h·(34 + 5·a·s/h)`` bytes in 16-bit, and with tensor
parallel with sequence parallelism (what the trainer runs, eq. 4) ``s·b·h·(34 + 5·a·s/h)/t``. We keep its term structure
and adapt the terms to this model: no dropout (no masks), grouped-query K/V, SwiGLU (four ff-wide
tensors instead of GeLU's two), QK-norm inputs, and a fused attention kernel (SDPA/flash:
the ``5·a·s/h`` score terms become an fp32 log-sum-exp per head). Activation checkpointing keeps
only each checkpointed block's input (``s·b·h``) plus one block's full activations during its
recompute. The loss adds the logits and their gradient (compute dtype) plus one chunk's fp32 upcast,
log-probabilities and gradient (the trainer computes the loss in chunks; under loss parallel the
vocab-sharded logits are upcast in one shot). With
TP the planner keeps the micro-batch of the pure data-parallel layout (``batch_size / GPUs``;
gradient accumulation makes up the rest), so TP lowers per-rank activations.

Fit: ``(modelled bytes) × 1.10 + 2 GB ≤ the GPU's memory`` (vendor GB, 10^9 bytes). CPU ranks
are not checked. Not modelled: allocator caching beyond the headroom, torch.compile workspaces,
fp8 scaling state, NCCL's own buffers beyond the fixed 2 GB. Accuracy against
``torch.cuda.max_memory_allocated`` is what ``benchmarks/bench_planner.py`` measures on a GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Literal

from orchestrator.contract.errors import EXIT_NO_FIT, DtrunError, SpecError
from orchestrator.contract.gpus import GPUS, canonical_gpu
from orchestrator.plan.presets import ModelSpec
from orchestrator.plan.spec import JobSpec, Parallel

GB = 1e9
HEADROOM = 0.10
"""Fraction added on top of the modelled bytes (allocator fragmentation, temporaries)."""
PREFETCHED_BLOCKS = 2
"""Blocks whose parameters FSDP2 holds gathered at once under ZeRO-3: the one computing and the
one prefetched (torch 2.13 ``_fsdp_param_group.py``: forward prefetches the next, backward the
previous)."""
FIXED_OVERHEAD_BYTES = int(2.0 * GB)
"""CUDA context, cuBLAS/NCCL workspaces and buffers per GPU."""
HOST_FIXED_BYTES_PER_RANK = int(4.0 * GB)
"""Host memory of one GPU rank beside its checkpoint staging: torch and Python, the host side of
the CUDA context, gloo/NCCL buffers (an allowance, not measured here: no GPU)."""
HOST_LOADER_BYTES_PER_RANK = int(0.25 * GB)
"""The data loader's block cache and pinned batches per rank (8 MiB blocks, a few in flight)."""

Device = Literal["gpu", "cpu"]


class DoesNotFit(DtrunError):
    """No plan fits the GPU's memory (``auto`` found none, or the pinned settings do not fit):
    exit 4, nothing rented."""

    exit_code = EXIT_NO_FIT


# ---- parameter inventory -----------------------------------------------------------------------

@dataclass(frozen=True)
class ParamShape:
    """One parameter tensor as the trainer builds it.

    ``tp_dim``: the dimension tensor parallel splits (None: replicated over TP ranks).
    ``expert``: an expert weight whose dim 0 is the expert index (split by expert parallel).
    ``unit``: the FSDP unit (``root`` or ``layers.<i>``).
    ``matrix``: a 2-D (per expert) block weight — Muon orthogonalizes these.
    """

    name: str
    shape: tuple[int, ...]
    tp_dim: int | None
    unit: str
    expert: bool = False
    matrix: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def param_shapes(ms: ModelSpec) -> list[ParamShape]:
    """Every parameter of the GPT (torchtitan-like layout: separate wq/wk/wv/wo, w1/w2(/w3),
    grouped experts ``(E, hidden, d)`` / ``(E, d, hidden)``). The total equals
    ``ms.num_params()``."""
    d, hd, V = ms.d_model, ms.head_dim, ms.vocab_size
    q, kv = ms.n_heads * hd, ms.kv_heads * hd
    out: list[ParamShape] = []

    def norm(prefix: str, unit: str, dim: int = d) -> None:
        out.append(ParamShape(f"{prefix}.weight", (dim,), None, unit))
        if ms.norm == "layernorm" and ms.bias:
            out.append(ParamShape(f"{prefix}.bias", (dim,), None, unit))

    # trainer/parallel.py: the embedding is row-wise and the head column-wise over TP only when
    # untied; a tied embedding stays replicated over TP (sharded by FSDP over dp).
    out.append(ParamShape("tok_embeddings.weight", (V, d), None if ms.tie_embeddings else 0, "root"))
    if ms.pos == "learned":
        out.append(ParamShape("pos_embeddings.weight", (ms.max_seq_len, d), None, "root"))
    for i in range(ms.n_layers):
        u = f"layers.{i}"
        norm(f"{u}.attention_norm", u)
        for nm, rows in (("wq", q), ("wk", kv), ("wv", kv)):
            out.append(ParamShape(f"{u}.attention.{nm}.weight", (rows, d), 0, u, matrix=True))
            if ms.bias:
                out.append(ParamShape(f"{u}.attention.{nm}.bias", (rows,), 0, u))
        out.append(ParamShape(f"{u}.attention.wo.weight", (d, q), 1, u, matrix=True))
        if ms.bias:
            out.append(ParamShape(f"{u}.attention.wo.bias", (d,), None, u))
        if ms.qk_norm:
            out.append(ParamShape(f"{u}.attention.q_norm.weight", (hd,), None, u))
            out.append(ParamShape(f"{u}.attention.k_norm.weight", (hd,), None, u))
        norm(f"{u}.ffn_norm", u)
        up = ("w1", "w3") if ms.mlp == "swiglu" else ("w1",)
        if ms.is_moe_layer(i):
            assert ms.moe is not None
            E, h = ms.moe.n_experts, ms.expert_dim
            out.append(ParamShape(f"{u}.moe.router.weight", (E, d), None, u))
            # trainer/model.py Experts: w1/w3 (E, d, hidden), w2 (E, hidden, d), biases b1/b3
            # (E, hidden), b2 (E, d). The trainer does not split experts over TP (replicated there);
            # expert parallel splits dim 0 (the expert index).
            for nm in up:
                out.append(ParamShape(f"{u}.moe.experts.{nm}", (E, d, h), None, u, expert=True, matrix=True))
            out.append(ParamShape(f"{u}.moe.experts.w2", (E, h, d), None, u, expert=True, matrix=True))
            if ms.bias:
                for nm in ("b1", "b3") if ms.mlp == "swiglu" else ("b1",):
                    out.append(ParamShape(f"{u}.moe.experts.{nm}", (E, h), None, u, expert=True))
                out.append(ParamShape(f"{u}.moe.experts.b2", (E, d), None, u, expert=True))
        else:
            h = ms.ff_dim
            for nm in up:
                out.append(ParamShape(f"{u}.feed_forward.{nm}.weight", (h, d), 0, u, matrix=True))
                if ms.bias:
                    out.append(ParamShape(f"{u}.feed_forward.{nm}.bias", (h,), 0, u))
            out.append(ParamShape(f"{u}.feed_forward.w2.weight", (d, h), 1, u, matrix=True))
            if ms.bias:
                out.append(ParamShape(f"{u}.feed_forward.w2.bias", (d,), None, u))
    norm("norm", "root")
    if not ms.tie_embeddings:
        out.append(ParamShape("output.weight", (V, d), 0, "root"))
    return out


def _chunk(n: int, parts: int, idx: int) -> int:
    """Rows of ``torch.chunk(x, parts)[idx]`` along a dim of size n (0 for missing chunks)."""
    if parts == 1:
        return n
    c = -(-n // parts)
    return max(0, min(n, c * (idx + 1)) - c * idx)


def _padded(n: int, parts: int) -> int:
    return -(-n // parts)


def _local_shape(p: ParamShape, par: Parallel, dp_rank: int, tp_rank: int, ep_rank: int,
                 padded: bool) -> tuple[int, ...]:
    """Shape of this rank's shard, as trainer/parallel.py lays it out: TP first (its dim), then
    FSDP2 on dim 0 of the TP-local tensor over the data-parallel ranks. Expert weights under
    expert parallel: E/ep experts per ep rank (dim 0), then their own FSDP unit over the
    dp_rep = dp/ep ranks holding the same experts (``dp_rank // ep`` is the index there): dim 0
    of the E/ep local experts, or dim 1 (even) when dp_rep·ep exceeds E, as
    ``trainer.parallel._shard_experts`` does. DDP (replicate: HSDP with a shard group of one)
    keeps the TP-local tensor whole. HSDP (``dp_replicate`` > 1) shards over ``dp_shard`` only:
    the shard index is ``dp_rank mod dp_shard`` (the replicas hold the same shards)."""
    dp = par.dp_shard
    dp_rank %= max(1, dp)
    shape = list(p.shape)
    split = _padded if padded else None

    def cut(n: int, parts: int, idx: int) -> int:
        return split(n, parts) if split else _chunk(n, parts, idx)

    if par.tp > 1 and p.tp_dim is not None and not (p.expert and par.ep > 1):
        shape[p.tp_dim] = cut(shape[p.tp_dim], par.tp, tp_rank)
    if p.expert and par.ep > 1:
        E = shape[0]
        shape[0] = cut(E, par.ep, ep_rank)
        rep = dp // par.ep
        if rep > 1:
            if rep * par.ep > E and shape[1] % rep == 0:
                shape[1] //= rep
            else:
                shape[0] = cut(shape[0], rep, dp_rank // par.ep)
        return tuple(shape)
    if not par.replicate and dp > 1:
        shape[0] = cut(shape[0], dp, dp_rank)
    return tuple(shape)


def _numel(shape: Iterable[int]) -> int:
    return math.prod(shape)


def state_bytes_per_rank(ms: ModelSpec, par: Parallel, *, dp_rank: int = 0, tp_rank: int = 0,
                         ep_rank: int = 0, optimizer: str = "adamw", padded: bool = False,
                         master_bytes: int = 4, grad_bytes: int = 4,
                         count_step_scalars: bool = False) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state one rank holds.

    ``padded=False`` gives what ``DTensor.to_local()`` returns on that rank (unpadded);
    ``padded=True`` gives FSDP2's padded storage (the same on every rank; the plan uses it).
    ``count_step_scalars`` adds AdamW's per-parameter ``step`` tensor (a 4-byte fp32 scalar on
    the parameter's device for CPU runs; on GPU it lives on the host unless fused/capturable).
    ``par.dp_shard`` must be concrete (not -1).
    """
    if par.dp_shard < 1:
        raise ValueError("state_bytes_per_rank needs concrete degrees (dp_shard >= 1)")
    params = grads = opt = 0
    n_adam = 0
    for p in param_shapes(ms):
        n = _numel(_local_shape(p, par, dp_rank, tp_rank, ep_rank, padded))
        params += master_bytes * n
        if par.tp > 1 and par.dp_shard == 1 and p.name == "tok_embeddings.weight" and p.tp_dim is not None:
            # Without FSDP, the row-wise (vocab-sharded) embedding's gradient comes back from
            # torch's embedding backward as a Replicate DTensor: every TP rank holds all of it
            # (measured: torch 2.13, tests/trainer/test_planner_exact.py). FSDP's reduce-scatter
            # shards it again when dp > 1.
            grads += grad_bytes * p.numel
        else:
            grads += grad_bytes * n
        if optimizer == "muon" and p.matrix:
            opt += 4 * n  # momentum buffer (fp32)
        else:
            opt += 8 * n  # exp_avg + exp_avg_sq (fp32)
            n_adam += 1
    if count_step_scalars:
        opt += 4 * n_adam
    return {"params": params, "grads": grads, "optimizer": opt}


# ---- activations ------------------------------------------------------------------------------

def block_activation_bytes(ms: ModelSpec, layer: int, seq: int, micro_batch: int, elem: int,
                           tp: int = 1, ep: int = 1, fused_attention: bool = True) -> int:
    """Bytes one block saves for backward (Korthikanti et al. 2022, eq. 2–3, adapted; see the
    module docstring). ``elem``: bytes per activation element (2 for bf16/fp16, 4 for fp32)."""
    s, b, h, a = seq, micro_batch, ms.d_model, ms.n_heads
    sbh = s * b * h
    kv = s * b * ms.kv_heads * ms.head_dim
    # Korthikanti's "10" less the two dropout masks: both norm inputs, the attention input and the
    # MLP input. The trainer runs TP with sequence parallelism (eq. 4): these are sharded on the
    # sequence too.
    replicated = 4 * sbh * elem // tp
    # Split over TP ranks (Korthikanti's "24/t"): what SDPA saves — Q, K and V (grouped-query K/V
    # are repeated to every head before SDPA, so sbh each), its output — and the output
    # projection's input (a reshaped copy of the output), then the feed-forward's wide tensors.
    # Rotary saves only its cos/sin tables.
    attn = 5 * sbh * elem
    if ms.qk_norm:
        attn += (sbh + kv) * elem
    if fused_attention:
        attn += 4 * b * a * s  # fp32 log-sum-exp per head and query
    else:
        attn += elem * a * s * s * b  # the softmax output (no dropout)
    wide = 4 if ms.mlp == "swiglu" else 2  # swiglu: w1 out, silu out, w3 out, product; gelu: in, out
    if ms.is_moe_layer(layer):
        assert ms.moe is not None
        E, k = ms.moe.n_experts, ms.moe.top_k
        # Token copies processed by the experts: every assignment (dropless by default; with a
        # capacity factor the trainer zeroes the overflow's gates rather than compacting).
        routed = s * b * k
        mlp = 4 * s * b * E  # fp32 router logits / probabilities
        mlp += routed * h * elem * 2  # dispatched inputs and expert outputs before combine
        mlp += routed * ms.expert_dim * elem * wide
        # Expert parallel moves tokens, not their count: the same per-rank volume on average.
    else:
        mlp = s * b * ms.ff_dim * elem * wide
    return replicated + (attn + mlp) // tp


LOSS_CHUNK_BYTES = 256 << 20
"""fp32 logits bytes the trainer's loss (``trainer.model.loss_fn``) upcasts at a time."""


def activation_bytes(ms: ModelSpec, seq: int, micro_batch: int, elem: int, tp: int = 1,
                     ep: int = 1, checkpointing: str = "none", fused_attention: bool = True) -> int:
    """Saved activations of the whole model for one micro-batch, at the peak (start of backward)."""
    s, b, h, L = seq, micro_batch, ms.d_model, ms.n_layers
    per = [block_activation_bytes(ms, i, s, b, elem, tp, ep, fused_attention) for i in range(L)]
    layer_input = s * b * h * elem
    if checkpointing == "none":
        ckpt: set[int] = set()
    elif checkpointing == "full":
        ckpt = set(range(L))
    else:  # selective: every other block (the trainer's definition)
        ckpt = {i for i in range(L) if i % 2 == 0}
    total = sum(layer_input // tp if i in ckpt else per[i] for i in range(L))  # sequence-parallel inputs
    if ckpt:
        total += max(per[i] for i in ckpt)  # one block recomputed in backward
    # Final norm input (sequence shard) + head input (gathered), then the logits.
    total += s * b * h * elem // tp + s * b * h * elem
    logits = s * b * ms.vocab_size
    if tp > 1 and not ms.tie_embeddings:
        # Loss parallel (an untied head under TP): vocab-sharded logits, their fp32 upcast and
        # gradient, in one shot.
        total += logits * (elem + 4 + 4) // tp
    else:
        # The whole vocabulary on every rank (a tied head runs on the whole sequence on every TP
        # rank, trainer/parallel.py apply_tp): logits and their gradient in the compute dtype; the
        # fp32 upcast, its log-probabilities and their gradient exist for one chunk of
        # LOSS_CHUNK_BYTES at a time (trainer.model.loss_fn).
        total += logits * 2 * elem + 3 * min(logits * 4, LOSS_CHUNK_BYTES)
    return total


# ---- rungs ------------------------------------------------------------------------------------

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
        }


def dp_degree(par: Parallel) -> int:
    """Data-parallel ranks (each reads its own slice of the batch): dp_replicate × dp_shard."""
    return max(1, par.dp_replicate) * max(1, par.dp_shard)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _candidate_rungs(spec: JobSpec, n: int, gpus_per_node: int) -> list[tuple[str, Parallel, str]]:
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
    state = state_bytes_per_rank(ms, par, optimizer=t.optimizer, padded=True)

    # Parameters/gradients in flight (unsharded, compute dtype), by FSDP unit.
    units: dict[str, int] = {}
    whole = Parallel(dp_shard=1, tp=par.tp, ep=1, replicate=True)
    for p in param_shapes(ms):
        n = _numel(_local_shape(p, whole, 0, 0, 0, True))
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


def _target(spec: JobSpec, gpu: str | None, gpus_per_node: int | None, nodes: int | None
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
    g, gpn, nn, n, device, limit = _target(spec, gpu, gpus_per_node, nodes)

    rungs: list[Rung] = []
    for name, par, note in _candidate_rungs(spec, n, gpn):
        if note:
            rungs.append(Rung(name, par, note=note))
            continue
        rung = evaluate_rung(spec, par, name, device)
        rung.fits = limit is None or rung.memory_bytes <= limit
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
    )
    if not fits and suggest:
        p.suggestion = _suggest(spec, g, gpn, nn)
    return p


def multi_node_why(strategy: str, rungs: list[Rung], nodes: int, gpus_per_node: int) -> str | None:
    """The dry run's reason for the chosen layout across nodes (None on one node)."""
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
    if strategy == "ddp":
        return f"ddp fits ({gb('ddp')}): one gradient all-reduce per step crosses nodes, nothing else"
    hs = [r for r in rungs if r.strategy.startswith("hsdp")]
    if not hs:
        return f"{strategy} across {nodes} nodes: no HSDP layout for this job"
    if all(r.note for r in hs):
        return f"{strategy} across {nodes} nodes: HSDP is not applicable ({hs[0].note})"
    return (f"{strategy}: sharded over all {nodes * gpus_per_node} GPUs, every all-gather crosses nodes — "
            f"HSDP (one node's shard group) needs {gb('hsdp-zero3')} and does not fit")


def _fits_somewhere(spec: JobSpec, gpu: str, gpn: int, nodes: int) -> MemoryPlan | None:
    try:
        p = plan(spec, gpu=gpu, gpus_per_node=gpn, nodes=nodes, suggest=False)
    except DtrunError:
        return None
    return p if p.fits else None


def _suggest(spec: JobSpec, gpu: str, gpn: int, nodes: int) -> str:
    """Which GPU (same layout) or node count (same GPU) would fit."""
    parts: list[str] = []
    bigger = sorted((x for x in GPUS.values() if x.name != "cpu" and x.memory_gb > GPUS[gpu].memory_gb),
                    key=lambda x: (x.memory_gb, x.peak_bf16_flops))
    for cand in bigger:
        p = _fits_somewhere(spec, cand.name, gpn, nodes)
        if p is not None:
            parts.append(f"{cand.name} ({cand.memory_gb:g} GB) × {gpn * nodes} fits with {p.strategy} "
                         f"at {p.memory_per_gpu_gb:.1f} GB/GPU")
            break
    for more in sorted({nodes * 2, nodes * 4, nodes * 8, nodes * 16} | set(range(nodes + 1, nodes + 8))):
        if more > 64:
            continue
        p = _fits_somewhere(spec, gpu, gpn, more)
        if p is not None:
            parts.append(f"{more} nodes × {gpn} {gpu} fit with {p.strategy} at {p.memory_per_gpu_gb:.1f} GB/GPU")
            break
    if not parts:
        parts.append("no GPU type or node count up to 64 fits; reduce micro_batch_size or seq_len, "
                     "or turn on activation_checkpointing: full")
    if spec.trainer.activation_checkpointing != "full":
        alt = spec.model_copy(deep=True)
        alt.trainer.activation_checkpointing = "full"
        p = _fits_somewhere(alt, gpu, gpn, nodes)
        if p is not None:
            parts.append(f"or activation_checkpointing: full fits as is ({p.strategy}, "
                         f"{p.memory_per_gpu_gb:.1f} GB/GPU)")
    mb = spec.trainer.micro_batch_size or max(1, spec.trainer.batch_size // (gpn * nodes))
    while mb > 1:
        mb //= 2
        alt = spec.model_copy(deep=True)
        alt.trainer.micro_batch_size = mb  # gradient accumulation keeps the global batch
        p = _fits_somewhere(alt, gpu, gpn, nodes)
        if p is not None:
            parts.append(f"or trainer.micro_batch_size: {mb} fits as is ({p.strategy}, "
                         f"{p.memory_per_gpu_gb:.1f} GB/GPU)")
            break
    return "; ".join(parts)


# ---- the user's own degrees -------------------------------------------------------------------

def strategy_name(par: Parallel, n: int) -> str:
    """The ladder name of explicit degrees."""
    if n == 1:
        return "single"
    if par.replicate and par.tp == 1 and par.ep == 1:
        return "ddp"
    base = ("hsdp" if par.dp_replicate > 1 else "fsdp") + ("-zero3" if par.reshard_after_forward else "-zero2")
    if par.tp > 1:
        base += f"+tp{par.tp}"
    if par.ep > 1:
        base += f"+ep{par.ep}"
    return base


def evaluate_spec_parallel(spec: JobSpec) -> Rung | None:
    """The user's explicit ``trainer.parallel`` evaluated like a rung (None for ``auto``)."""
    if spec.trainer.parallel == "auto":
        return None
    par = spec.parallel_degrees
    n = spec.resources.total_gpus
    device: Device = "cpu" if spec.resources.gpu == "cpu" else "gpu"
    rung = evaluate_rung(spec, par, strategy_name(par, n), device)
    limit = None if device == "cpu" else GPUS[spec.resources.gpu].memory_gb * GB
    rung.fits = limit is None or rung.memory_bytes <= limit
    return rung


AC_ORDER = ("none", "selective", "full")
"""Activation checkpointing from cheapest (no recompute) to dearest (every block recomputed)."""


def pinned(spec: JobSpec) -> dict[str, bool]:
    """What the user wrote (auto keeps it): ``micro_batch_size`` (set, not None) and
    ``activation_checkpointing`` (written in the YAML, whatever its value)."""
    t = spec.trainer
    return {"micro_batch_size": t.micro_batch_size is not None,
            "activation_checkpointing": "activation_checkpointing" in t.model_fields_set}


def _mb_below(per_dp: int, target: int) -> int:
    """The largest micro-batch ≤ target that divides the per-replica batch (≥ 1)."""
    return max(m for m in range(1, max(1, target) + 1) if per_dp % m == 0)


def auto_plan(spec: JobSpec, gpu: str | None = None, gpus_per_node: int | None = None,
              nodes: int | None = None, *, suggest: bool = True) -> MemoryPlan:
    """``trainer.parallel: auto`` in full: the cheapest plan that fits by this module's bytes.

    In order of cost, the first that fits wins:

    1. the lowest parallel rung at the default micro-batch, no activation checkpointing;
    2. a smaller micro-batch (halved each round; gradient accumulation keeps ``batch_size``),
       again lowest rung first;
    3. the same with selective, then with full activation checkpointing.

    A ``micro_batch_size`` or ``activation_checkpointing`` the user wrote is kept (only what is
    left to auto is searched). ``.fits`` False: nothing fits; ``.suggestion`` says what would."""
    g, gpn, nn, n, device, limit = _target(spec, gpu, gpus_per_node, nodes)
    pin = pinned(spec)
    t = spec.trainer
    acs = [t.activation_checkpointing] if pin["activation_checkpointing"] else list(AC_ORDER)
    cands = _candidate_rungs(spec, n, gpn)
    valid = [(name, par) for name, par, note in cands if not note]
    if not valid:
        raise SpecError(
            f"trainer.parallel: no parallel layout is valid for {n} GPUs: "
            + "; ".join(f"{name}: {note}" for name, _, note in cands))

    def rungs_at(ac: str, k: int) -> list[tuple[Rung, int]]:
        out = []
        for name, par in valid:
            default = planned_micro_batch(spec, par)
            if pin["micro_batch_size"]:
                if k:
                    continue
                mb = default
            else:
                if default >> k < 1:
                    continue
                mb = _mb_below(max(1, t.batch_size // dp_degree(par)), default >> k)
            rung = evaluate_rung(spec, par, name, device, micro_batch=mb, checkpointing=ac)
            rung.fits = limit is None or rung.memory_bytes <= limit
            out.append((rung, mb))
        return out

    chosen: tuple[Rung, int, str] | None = None
    best: tuple[Rung, int, str] | None = None
    for ac in acs:
        k = 0
        while True:
            evald = rungs_at(ac, k)
            if not evald:
                break
            for rung, mb in evald:
                if best is None or rung.memory_bytes < best[0].memory_bytes:
                    best = (rung, mb, ac)
            hit = next(((rung, mb) for rung, mb in evald if rung.fits), None)
            if hit is not None:
                chosen = (hit[0], hit[1], ac)
                break
            k += 1
        if chosen is not None:
            break
    fits = chosen is not None
    pick = chosen or best
    assert pick is not None
    rung, mb, ac = pick
    # The ladder shown is the one at the chosen micro-batch and checkpointing.
    shown: list[Rung] = []
    for name, par, note in cands:
        if note:
            shown.append(Rung(name, par, note=note))
            continue
        default = planned_micro_batch(spec, par)
        m = default if pin["micro_batch_size"] else _mb_below(
            max(1, t.batch_size // dp_degree(par)), min(default, mb))
        x = evaluate_rung(spec, par, name, device, micro_batch=m, checkpointing=ac)
        x.fits = limit is None or x.memory_bytes <= limit
        shown.append(x)
    default_mb = planned_micro_batch(spec, rung.parallel)
    changed = []
    if not pin["micro_batch_size"] and mb != default_mb:
        changed.append(f"micro_batch_size {default_mb} → {mb} (gradient accumulation keeps batch_size "
                       f"{t.batch_size})")
    if not pin["activation_checkpointing"] and ac != t.activation_checkpointing:
        changed.append(f"activation_checkpointing {t.activation_checkpointing} → {ac}")
    notes = ["CPU ranks: host memory is not checked; the lowest rung is chosen"] if device == "cpu" else []
    p = MemoryPlan(
        strategy=rung.strategy, memory_per_gpu_gb=rung.memory_per_gpu_gb, fits=fits,
        parallel=rung.parallel, breakdown=dict(rung.breakdown), rungs=shown, gpu=g,
        gpu_memory_gb=None if limit is None else GPUS[g].memory_gb, gpus_per_node=gpn, nodes=nn,
        micro_batch_size=mb, notes=notes, activation_checkpointing=ac,
        auto={"pinned": [k for k, v in pin.items() if v], "changed": changed},
        why=multi_node_why(rung.strategy, shown, nn, gpn),
    )
    if not fits and suggest:
        p.suggestion = _suggest(spec, g, gpn, nn)
    return p


def host_bytes_per_node(spec: JobSpec, par: Parallel, gpus_per_node: int) -> dict[str, int]:
    """Host memory a GPU node needs (bytes): async checkpoints stage a copy of each rank's model
    and optimizer state in pinned host memory, kept for the whole run (DCP's stager: about 12 B
    per parameter per rank with AdamW's fp32 master and moments), plus the loader and a fixed
    allowance per rank."""
    state = state_bytes_per_rank(spec.trainer.model_spec, par, optimizer=spec.trainer.optimizer, padded=True)
    staging = 0 if spec.checkpoint.async_mode == "sync" else state["params"] + state["optimizer"]
    out = {"staging": staging * gpus_per_node, "loader": HOST_LOADER_BYTES_PER_RANK * gpus_per_node,
           "fixed": HOST_FIXED_BYTES_PER_RANK * gpus_per_node}
    out["total"] = sum(out.values())
    return out


def host_memory_problem(spec: JobSpec, p: MemoryPlan) -> str | None:
    """Where dtrun sizes the node's host memory (Modal: ``resources.memory_gb_per_gpu`` × GPUs is
    the container's limit), why the plan's host memory does not fit it (else None). Instance
    providers give the instance's memory, which the offers do not carry: the trainer checks
    that at start (``trainer/checkpoint.py``, sync saves when the staging copy does not fit)."""
    if p.gpu == "cpu" or "modal" not in spec.resources.providers:
        return None
    need = host_bytes_per_node(spec, p.parallel, p.gpus_per_node)
    have = spec.resources.memory_gb_per_gpu * p.gpus_per_node * 2**30
    if need["total"] <= have:
        return None
    per_gpu = need["total"] / p.gpus_per_node / 2**30
    return (f"resources.memory_gb_per_gpu ({spec.resources.memory_gb_per_gpu:g} GiB) is too little host memory "
            f"on Modal: each GPU's rank needs about {per_gpu:.0f} GiB (async checkpoint staging "
            f"{need['staging'] / p.gpus_per_node / 2**30:.1f} GiB, loader and process "
            f"{(need['loader'] + need['fixed']) / p.gpus_per_node / 2**30:.1f} GiB); raise it to "
            f"{int(per_gpu) + 1}, or set checkpoint.async_mode: sync")


def fit_check(spec: JobSpec, gpu: str | None = None) -> tuple[MemoryPlan, str | None]:
    """The memory plan the job would run with on ``gpu`` and, when it does not fit — GPU memory,
    or the host memory dtrun requests on Modal — why (else None)."""
    p, why = _gpu_fit_check(spec, gpu)
    return p, why or host_memory_problem(spec, p)


def _gpu_fit_check(spec: JobSpec, gpu: str | None = None) -> tuple[MemoryPlan, str | None]:
    """The memory plan the job would run with on ``gpu`` (auto: :func:`auto_plan`; explicit
    degrees: the ladder for reference) and, when it does not fit, why (else None).
    CPU ranks always fit (host memory is not checked)."""
    if spec.trainer.parallel == "auto":
        p = auto_plan(spec, gpu=gpu)
        if p.fits:
            return p, None
        pin = p.auto["pinned"] if p.auto else []
        kept = (f" (auto kept what you pinned: {', '.join('trainer.' + k for k in pin)})" if pin else "")
        return p, (f"no plan fits {p.nodes}×{p.gpus_per_node} {p.gpu} ({p.gpu_memory_gb:g} GB){kept}: "
                   f"the smallest is {p.strategy} at {p.memory_per_gpu_gb:.1f} GB/GPU "
                   f"(micro_batch_size {p.micro_batch_size}, activation_checkpointing "
                   f"{p.activation_checkpointing}); {p.suggestion}")
    p = plan(spec, gpu=gpu)
    g = p.gpu
    if g == "cpu" or (gpu is not None and canonical_gpu(gpu) != spec.resources.gpu):
        return p, (None if p.fits else f"no parallel layout fits {g}: {p.suggestion}")
    mine = evaluate_spec_parallel(spec)
    assert mine is not None
    if mine.fits:
        return p, None
    other = f"; {p.strategy} fits at {p.memory_per_gpu_gb:.1f} GB/GPU (or use parallel: auto)" if p.fits \
        else f"; {p.suggestion}"
    return p, (f"trainer.parallel ({mine.strategy}) needs {mine.memory_per_gpu_gb:.1f} GB/GPU on {g} "
               f"({GPUS[g].memory_gb:g} GB){other}")


def resolve_parallel(spec: JobSpec, force: bool = False) -> JobSpec:
    """A copy of the spec with explicit degrees: ``trainer.parallel: auto`` becomes
    :func:`auto_plan`'s pick — degrees, and the micro-batch and activation checkpointing it chose
    where the user left them open (validated through the spec's own checks); explicit degrees are
    returned unchanged. Raises :class:`DoesNotFit` (exit 4) when nothing fits (the message says
    what would) unless ``force`` (``dtrun up --force``: the smallest plan found, which may OOM).
    This is what the controller writes to the run URI's job.yaml: the trainer runs exactly the
    plan the dry run printed."""
    if spec.trainer.parallel != "auto":
        return spec.model_copy(deep=True)
    p, why = fit_check(spec)
    if why is not None and not force:
        raise DoesNotFit(f"trainer.parallel: auto: {spec.trainer.model_spec.num_params() / 1e9:.2f}B-parameter "
                         f"model does not fit: {why}")
    data = spec.model_dump(mode="json", exclude_none=True)
    data["trainer"]["parallel"] = p.parallel.model_dump()
    if spec.trainer.micro_batch_size is None and p.micro_batch_size != spec.trainer.batch_size // dp_degree(p.parallel):
        data["trainer"]["micro_batch_size"] = p.micro_batch_size  # TP or auto's smaller micro-batch
    data["trainer"]["activation_checkpointing"] = p.activation_checkpointing
    return JobSpec.model_validate(data)
