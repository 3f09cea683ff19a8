"""The memory model: the bytes one GPU rank holds for a job under given parallel degrees.

Pure Python (no torch). The parallel ladder (``plan/ladder.py``) evaluates each rung with these
functions; ``plan/planner.py`` is the front door (auto plan, fit check, ``resolve_parallel``).

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

Pipeline (``pp``) and context (``cp``) parallel layouts are counted per stage and per sequence
shard by ``plan/pipeline.py`` on top of these functions: a stage's own layers (the embedding on
the first, the norm, head and loss on the last), the activations of the microbatches its schedule
holds in flight (gpipe all ``m``, 1f1b ``p``, interleaved ``p + (p − 1)/v``, zbv ``p``, dualpipev
``p + 1/2``, checked against torch's own schedules), and under cp ``1/cp`` of every per-token
activation plus the all-gathered K/V.

Fit: ``(modelled bytes) × 1.10 + 2 GB ≤ the GPU's memory`` (vendor GB, 10^9 bytes). CPU ranks
are not checked. Not modelled: allocator caching beyond the headroom, torch.compile workspaces,
fp8 scaling state, NCCL's own buffers beyond the fixed 2 GB. Accuracy against
``torch.cuda.max_memory_allocated`` is what ``benchmarks/bench_planner.py`` measures on a GPU.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Iterable, Literal

from orchestrator.plan.presets import LOSS_CHUNK_BYTES, ModelSpec
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


@functools.lru_cache(maxsize=32)
def param_shapes(ms: ModelSpec) -> tuple[ParamShape, ...]:
    """Every parameter of the GPT (torchtitan-like layout: separate wq/wk/wv/wo, w1/w2(/w3),
    grouped experts ``(E, hidden, d)`` / ``(E, d, hidden)``). The total equals
    ``ms.num_params()``. Cached per model (``ModelSpec`` is frozen): a plan evaluates every rung
    at several micro-batches, and a 70B model has hundreds of tensors."""
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
    return tuple(out)


def _chunk(n: int, parts: int, idx: int) -> int:
    """Rows of ``torch.chunk(x, parts)[idx]`` along a dim of size n (0 for missing chunks)."""
    if parts == 1:
        return n
    c = -(-n // parts)
    return max(0, min(n, c * (idx + 1)) - c * idx)


def _padded(n: int, parts: int) -> int:
    return -(-n // parts)


def local_shape(p: ParamShape, par: Parallel, dp_rank: int, tp_rank: int, ep_rank: int,
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
        n = _numel(local_shape(p, par, dp_rank, tp_rank, ep_rank, padded))
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

