"""A pure GPT (optionally mixture-of-experts) built from ``orchestrator.plan.presets.ModelSpec``.

Pure means: no meshes, no process groups, no parallelism. ``trainer/parallel.py`` applies tensor
parallelism, activation checkpointing, compile and FSDP2 afterwards (torchtitan's order), and the
MoE layer takes an optional *dispatcher* for expert parallelism (``MoE.ep_group``), set there.

Shapes follow the ModelSpec exactly, so ``sum(p.numel())`` equals ``ModelSpec.num_params()``
(tested for every preset on the meta device):

* pre-norm blocks: ``x + attn(norm1(x))`` then ``x + ffn(norm2(x))``; SDPA attention (flash on GPU),
  grouped-query heads, rotary (``pos: rope``) or learned absolute positions;
* QK-norm (``qk_norm``): an RMSNorm over each head's queries and keys (weights of ``head_dim``);
* feed-forward: GELU MLP or SwiGLU; or a MoE layer: a top-k softmax router, dropless by default
  (an optional capacity factor zeroes the overflow assignments' gates: the token keeps only the
  residual for that slot), experts as one grouped GEMM over expert-sorted tokens, and load
  balancing by an auxiliary loss (Switch/GShard) or a DeepSeek-V3 style router-bias update
  (``trainer/moe.py``);
* tied or separate output head.

``build_model(spec, device="meta")`` builds without allocating (for the planner and for FSDP2's
meta-device init); call ``model.init_weights(seed)`` after ``to_empty``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from orchestrator.plan.presets import LOSS_CHUNK_BYTES, ModelSpec  # the loss chunk: the planner counts it
from trainer.moe import Experts, MoE, _gmm_ok, grouped_mm  # noqa: F401  (the MoE layer; callers import it from here)


def _norm(spec: ModelSpec, dim: int) -> nn.Module:
    if spec.norm == "rmsnorm":
        return nn.RMSNorm(dim, eps=1e-6)
    return nn.LayerNorm(dim, bias=spec.bias)


_ROPE_CACHE: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _rope_table(T: int, half: int, base: float, device: torch.device, dtype: torch.dtype):
    """(cos, sin) of shape (1, T, 1, half): built once per shape/device/dtype and reused by every
    layer and step (under torch.compile it is traced, and the compiler hoists it)."""
    key = (T, half, base, device, dtype)
    hit = None if torch.compiler.is_compiling() else _ROPE_CACHE.get(key)
    if hit is not None:
        return hit
    inv = 1.0 / (base ** (torch.arange(0, half, device=device, dtype=torch.float32) / half))
    ang = torch.outer(torch.arange(T, device=device, dtype=torch.float32), inv)  # (T, half)
    out = (ang.cos()[None, :, None, :].to(dtype), ang.sin()[None, :, None, :].to(dtype))
    if not torch.compiler.is_compiling():
        _ROPE_CACHE[key] = out
    return out


def _rope(x: torch.Tensor, base: float = 10000.0, cp: Any = None) -> torch.Tensor:
    """Rotary positions on ``x`` of shape (B, T, H, D) (pairs (i, i + D/2), as in GPT-NeoX/Llama).
    Under context parallelism (``cp``: trainer/context.py) ``x`` holds this rank's tokens and
    each is rotated by its global position."""
    T, D = x.shape[1], x.shape[-1]
    half = D // 2
    if cp is None:
        cos, sin = _rope_table(T, half, base, x.device, x.dtype)
    else:  # this rank's rows of the whole sequence's table, built once per shape
        key = ("cp", cp.size, cp.rank, T, half, base, x.device, x.dtype)
        hit = None if torch.compiler.is_compiling() else _ROPE_CACHE.get(key)
        if hit is None:
            cos, sin = _rope_table(T * cp.size, half, base, x.device, x.dtype)
            pos = cp.positions(T, x.device)
            hit = (cos[:, pos], sin[:, pos])
            if not torch.compiler.is_compiling():
                _ROPE_CACHE[key] = hit
        cos, sin = hit
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        d, hd = spec.d_model, spec.head_dim
        self.head_dim = hd
        self.rope = spec.pos == "rope"
        self.wq = nn.Linear(d, spec.n_heads * hd, bias=spec.bias)
        self.wk = nn.Linear(d, spec.kv_heads * hd, bias=spec.bias)
        self.wv = nn.Linear(d, spec.kv_heads * hd, bias=spec.bias)
        self.wo = nn.Linear(spec.n_heads * hd, d, bias=spec.bias)
        self.q_norm = nn.RMSNorm(hd, eps=1e-6) if spec.qk_norm else None
        self.k_norm = nn.RMSNorm(hd, eps=1e-6) if spec.qk_norm else None
        self.cp: Any = None  # context parallelism (trainer/context.py apply_cp): this rank's sequence shard

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds n_heads / tp of them.
        q = self.wq(x).view(B, T, -1, self.head_dim)
        k = self.wk(x).view(B, T, -1, self.head_dim)
        v = self.wv(x).view(B, T, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope:
            q, k = _rope(q, cp=self.cp), _rope(k, cp=self.cp)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if self.cp is not None:  # local queries against the whole sequence's keys and values
            y = self.cp.attention(q, k, v)
        else:
            # Grouped-query attention: SDPA shares each kv head across its query heads (no copies).
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec, hidden: int):
        super().__init__()
        d = spec.d_model
        self.swiglu = spec.mlp == "swiglu"
        self.w1 = nn.Linear(d, hidden, bias=spec.bias)
        self.w2 = nn.Linear(hidden, d, bias=spec.bias)
        self.w3 = nn.Linear(d, hidden, bias=spec.bias) if self.swiglu else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    def __init__(self, spec: ModelSpec, i: int):
        super().__init__()
        self.norm1 = _norm(spec, spec.d_model)
        self.attn = Attention(spec)
        self.norm2 = _norm(spec, spec.d_model)
        self.ffn: nn.Module = MoE(spec) if spec.is_moe_layer(i) else MLP(spec, spec.ff_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.ffn(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        self.tok_emb = nn.Embedding(spec.vocab_size, spec.d_model)
        self.pos_emb = nn.Embedding(spec.max_seq_len, spec.d_model) if spec.pos == "learned" else None
        self.layers = nn.ModuleDict({str(i): Block(spec, i) for i in range(spec.n_layers)})
        self.norm = _norm(spec, spec.d_model)
        self.head = nn.Linear(spec.d_model, spec.vocab_size, bias=False)
        if spec.tie_embeddings:
            self.head.weight = self.tok_emb.weight
        self.cp: Any = None  # context parallelism (trainer/context.py): global positions of the shard

    def moe_layers(self) -> list[MoE]:
        return [m for m in self.modules() if isinstance(m, MoE)]

    @torch.no_grad()
    def init_weights(self, seed: int, params: bool = True) -> None:
        """GPT-2 style init (normal 0.02, residual projections scaled by 1/sqrt(2 n_layers);
        norms ones, biases and buffers zero).

        Every value is a function of ``(seed, parameter name, global index)`` only, so every
        world size and layout (FSDP, TP, dp×tp, EP, HSDP, one process) starts from the same
        weights, and each rank draws only the tiles of each parameter that overlap its own shard
        (see :func:`_normal_local`): no rank builds a full tensor. Call after ``to_empty``.
        ``params=False``: zero the buffers only (a checkpoint load fills the parameters)."""
        if params:
            resid_std = 0.02 / math.sqrt(2 * self.spec.n_layers)
            for name, p in self.named_parameters():  # the tied weight is visited once
                key = _canonical_name(name)
                if key.endswith(".bias") or key.split(".")[-1] in ("b1", "b2", "b3"):
                    _local(p).zero_()
                elif "norm" in key:
                    _local(p).fill_(1.0)
                elif key.endswith(("wo.weight", "w2.weight", "experts.w2")):
                    _init_normal(p, seed, key, resid_std)
                else:
                    _init_normal(p, seed, key, 0.02)
        for _, b in self.named_buffers():
            _local(b).zero_()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids → logits. A pipeline stage (trainer/pipeline.py deletes what it does not
        hold) without the embedding takes the previous stage's activations instead of ids, and
        one without the head returns its activations."""
        if self.tok_emb is None:
            x = idx
        else:
            x = self.tok_emb(idx)
            if self.pos_emb is not None:
                T = idx.shape[1]
                pos = torch.arange(T, device=idx.device) if self.cp is None else self.cp.positions(T, idx.device)
                x = x + self.pos_emb(pos)
        for block in self.layers.values():
            x = block(x)
        return x if self.head is None else self.head(self.norm(x))

    def aux_loss(self) -> torch.Tensor | None:
        losses = [m.aux_loss for m in self.moe_layers() if m.aux_loss is not None]
        return sum(losses) if losses else None  # type: ignore[return-value]


# ---- initialisation: each rank draws only its own shard ---------------------------------------
# A parameter is cut into tiles over its dims 0 and 1 (dims ≥ 2 whole); each tile is drawn from
# its own CPU generator seeded by a stable hash of (seed, name, tile index). Tile sizes depend on
# the parameter's shape only (never on the world size), so a value depends on (seed, name,
# global index) only. CPU generators everywhere: a CUDA generator gives another stream, and a
# run must start identically on any device; the local piece is then copied to the device.
INIT_TILE_ELEMS = 16384  # elements per tile (64 KB fp32): small enough for fine shards, large
INIT_TILE_ROWS = 32  # enough that the per-tile overhead (seed, copy) stays small beside the draw
INIT_TILE_COLS = 512  # width on dim 1 (× the inner dims): TP column shards round up to this


def _canonical_name(name: str) -> str:
    """The parameter's name without wrapper prefixes (activation checkpointing, compile), so the
    same weight gets the same draws with or without them."""
    for w in ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module."):
        name = name.replace(w, "")
    return name


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _tile_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """(rows on dim 0, columns on dim 1) of one tile — a function of ``shape`` only. Dims ≥ 2
    are whole in a tile (an expert's (d, h) matrix: one tile per few of its rows)."""
    if len(shape) == 1:
        return INIT_TILE_ELEMS, 1
    inner = max(1, math.prod(shape[2:]))
    cols = max(1, min(shape[1], INIT_TILE_COLS // inner))
    return max(1, min(INIT_TILE_ROWS, INIT_TILE_ELEMS // (cols * inner))), cols


def _tile_seed(seed: int, name: str, rt: int, ct: int) -> int:
    import hashlib

    h = hashlib.blake2b(f"{seed}/{name}/{rt}/{ct}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


def local_indices(shape: tuple[int, ...], mesh_shape: tuple[int, ...], coord: list[int] | None,
                  placements: Any) -> list[torch.Tensor | None]:
    """For each dim of a tensor of global ``shape`` sharded by ``placements`` over a mesh of
    ``mesh_shape``, the global indices held at mesh coordinate ``coord`` (``None``: the whole
    dim). Follows DTensor's own rule (``compute_local_shape_and_global_offset``), including
    uneven ``torch.chunk`` shards and FSDP2-over-TP's ``_StridedShard`` (whose indices need not
    be contiguous)."""
    from torch.distributed.tensor._utils import _get_shard_size_and_offsets
    from torch.distributed.tensor.placement_types import Shard, _StridedShard

    idx: list[torch.Tensor | None] = [None] * len(shape)
    if coord is None:  # this rank is not in the mesh: it holds nothing
        return [torch.empty(0, dtype=torch.long) for _ in shape]
    size = list(shape)
    for md, pl in enumerate(placements):
        if not isinstance(pl, (Shard, _StridedShard)):
            continue
        d = pl.dim % len(shape)
        n, offs = _get_shard_size_and_offsets(size[d], mesh_shape[md], coord[md], pl, idx[d], shape[d], False)
        size[d] = n
        idx[d] = offs.to(torch.long) if n > 0 else torch.empty(0, dtype=torch.long)
    return idx


def _segments(idx: torch.Tensor | None, n: int, t: int) -> list[tuple[int, Any, Any]]:
    """Split the global indices ``idx`` (``None``: all ``n``) by tile of ``t``: a list of
    (tile number, positions in the local piece, offsets in the tile) — slices where the indices
    are a contiguous range (every layout but FSDP2-over-TP's ``_StridedShard`` with uneven
    chunks), index tensors otherwise."""
    if idx is None or (len(idx) and int(idx[-1]) - int(idx[0]) + 1 == len(idx)
                       and bool((idx[1:] > idx[:-1]).all())):
        a, b = (0, n) if idx is None else (int(idx[0]), int(idx[-1]) + 1)
        out = []
        for k in range(a // t, (b - 1) // t + 1) if b > a else ():
            lo, hi = max(a, k * t), min(b, (k + 1) * t)
            out.append((k, slice(lo - a, hi - a), slice(lo - k * t, hi - k * t)))
        return out
    tiles = idx // t
    out = []
    for k in torch.unique(tiles).tolist():
        pos = (tiles == k).nonzero().squeeze(1)
        out.append((k, pos, idx[pos] - k * t))
    return out


def _as_index(s: Any) -> torch.Tensor:
    return torch.arange(s.start, s.stop) if isinstance(s, slice) else s


def _normal_local(shape: tuple[int, ...], idx: list[torch.Tensor | None], std: float, seed: int,
                  name: str) -> torch.Tensor:
    """The fp32 values at the global indices ``idx`` (per dim, ``None`` = all) of a
    ``normal(0, std)`` parameter, drawing only the tiles that overlap them (whole tiles: a
    tile's stream depends on its shape only)."""
    shape = tuple(shape)
    tr, tc = _tile_shape(shape)
    two = len(shape) > 1
    inner = shape[2:]
    lens = [len(i) if i is not None else s for i, s in zip(idx, shape)]
    out = torch.empty((lens[0], lens[1], *inner) if two else (lens[0],), dtype=torch.float32)
    g = torch.Generator(device="cpu")
    row_segs = _segments(idx[0], shape[0], tr)
    col_segs = _segments(idx[1], shape[1], tc) if two else [(0, None, None)]
    for rt, pr, ro in row_segs:
        h = min(tr, shape[0] - rt * tr)
        for ct, pc, co in col_segs:
            g.manual_seed(_tile_seed(seed, name, rt, ct))
            if not two:
                out[pr] = torch.empty(h, dtype=torch.float32).normal_(0.0, std, generator=g)[ro]
                continue
            w = min(tc, shape[1] - ct * tc)
            tile = torch.empty((h, w, *inner), dtype=torch.float32).normal_(0.0, std, generator=g)
            if all(isinstance(x, slice) for x in (pr, pc, ro, co)):
                out[pr, pc] = tile[ro, co]
            else:
                out[_as_index(pr)[:, None], _as_index(pc)[None, :]] = tile[_as_index(ro)[:, None], _as_index(co)[None, :]]
    for d in range(2, len(shape)):  # sharded on a dim ≥ 2 (no layout here does that): select it
        if idx[d] is not None:
            out = out.index_select(d, idx[d])
    return out


def _init_normal(t: torch.Tensor, seed: int, name: str, std: float) -> None:
    """Fill ``t`` (a plain tensor or this rank's DTensor shard) with its values of the
    seeded init, drawing only the local shard's tiles."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        mesh = t.device_mesh
        idx = local_indices(tuple(t.shape), tuple(mesh.shape), mesh.get_coordinate(), t.placements)
    else:
        idx = [None] * t.dim()
    local = _local(t)
    if local.numel() == 0:
        return
    vals = _normal_local(tuple(t.shape), idx, std, seed, name)
    if vals.shape != local.shape:
        raise RuntimeError(f"init of {name}: computed local shape {tuple(vals.shape)} != shard {tuple(local.shape)}")
    local.copy_(vals.to(device=local.device, dtype=local.dtype))


def build_model(spec: ModelSpec, device: str | torch.device = "cpu", seed: int | None = None) -> GPT:
    """The GPT for ``spec``. On ``meta`` nothing is allocated (the planner counts shapes;
    parallel.py shards then materialises). With ``seed`` the weights are initialised."""
    with torch.device(device):
        model = GPT(spec)
    if seed is not None and str(device) != "meta":
        model.init_weights(seed)
    return model




def _logsumexp(lf: torch.Tensor) -> torch.Tensor:
    """``logsumexp`` over the last dim. On vocab-sharded logits (a DTensor under loss parallel)
    from the local shards: one all-reduce of the row maxima and one of the row sums —
    ``torch.logsumexp`` on the DTensor would all-gather the whole vocabulary on every rank."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(lf, DTensor) or not any(getattr(p, "dim", None) in (-1, lf.ndim - 1) for p in lf.placements):
        return torch.logsumexp(lf, dim=-1)
    rep = [Replicate()] * lf.device_mesh.ndim
    m = lf.detach().amax(dim=-1, keepdim=True).redistribute(lf.device_mesh, rep)
    s = (lf - m).exp().sum(dim=-1).redistribute(lf.device_mesh, rep)
    return m.squeeze(-1) + s.log()


def _ce_sum(logits: torch.Tensor, targets: torch.Tensor, z_loss: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed cross-entropy and summed logsumexp² of one chunk, computed in fp32."""
    lf = logits.float()
    ce = F.cross_entropy(lf, targets, reduction="sum")
    if z_loss > 0:
        return ce, torch.logsumexp(lf, dim=-1).pow(2).sum()
    return ce, ce.new_zeros(())


def loss_fn(logits: torch.Tensor, targets: torch.Tensor, z_loss: float = 0.0,
            chunk_bytes: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(total loss, cross-entropy) in fp32. ``z_loss`` adds coef · mean(logsumexp(logits)²) (PaLM).

    The logits stay in the compute dtype: the fp32 upcast (and the log-softmax autograd keeps for
    backward) exist for one chunk of tokens at a time — about ``chunk_bytes`` (default
    :data:`LOSS_CHUNK_BYTES`) — and are recomputed chunk by chunk in backward
    (``torch.utils.checkpoint``), not held for the whole micro-batch: at V 128k, T 8192 and
    micro-batch 1 that is ~8.6 GB of fp32 (upcast + saved log-probabilities) less per GPU.

    Vocab-sharded logits (a DTensor from the TP head) need the caller to run this and the
    backward under :func:`loss_context` (``loss_parallel``); they are 1/tp of the vocabulary
    already and take the one-shot path."""
    flat, tgt = logits.flatten(0, 1), targets.reshape(-1)
    n, v = flat.shape
    limit = LOSS_CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    rows = max(1, limit // (4 * v))
    if hasattr(flat, "to_local") or n <= rows:  # one shot (loss_parallel reduces a mean)
        lf = flat.float()
        ce = F.cross_entropy(lf, tgt)
        if z_loss > 0:
            return ce + z_loss * _logsumexp(lf).pow(2).mean(), ce
        return ce, ce
    from torch.utils.checkpoint import checkpoint

    grad = torch.is_grad_enabled() and flat.requires_grad
    parts = [checkpoint(_ce_sum, lg, tg, z_loss, use_reentrant=False) if grad else _ce_sum(lg, tg, z_loss)
             for lg, tg in zip(flat.split(rows), tgt.split(rows))]
    ce = torch.stack([p[0] for p in parts]).sum() / n
    if z_loss > 0:
        return ce + z_loss * (torch.stack([p[1] for p in parts]).sum() / n), ce
    return ce, ce


def loss_context(model: nn.Module):
    """``loss_parallel()`` when the model's head is vocab-sharded over TP (an untied head under
    tensor parallelism), else a no-op. Wrap the forward's loss *and* the backward in it."""
    import contextlib

    if getattr(model, "loss_parallel", False):
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()
    return contextlib.nullcontext()


def add_aux(loss: torch.Tensor, aux: torch.Tensor | None) -> torch.Tensor:
    """``loss + aux``; under loss parallel the loss is a (replicated) DTensor and the MoE
    auxiliary loss a local tensor of this rank's tokens."""
    if aux is None:
        return loss
    from torch.distributed.tensor import DTensor

    if isinstance(loss, DTensor) and not isinstance(aux, DTensor):
        aux = DTensor.from_local(aux, loss.device_mesh, loss.placements)
    return loss + aux


def local_value(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor for logging (a replicated DTensor's local copy)."""
    return t.to_local() if hasattr(t, "to_local") else t
