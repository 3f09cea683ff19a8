"""Optimizers and the LR schedule.

* ``adamw``: ``torch.optim.AdamW`` with two groups: weight decay on matmul weights only (not on
  norms, biases, embeddings or the MoE router).
* ``muon``: ``Muon`` below — Newton–Schulz orthogonalised momentum on the 2-D matmul weights of the
  blocks (attention and MLP projections) and on each expert matrix of the 3-D expert weights;
  AdamW on embeddings, head, norms, biases and the router, all in one ``torch.optim.Optimizer``
  (so one state dict for DCP).

  **Sharding (FSDP2/TP/HSDP):** the orthogonalisation needs the whole matrix, but only one rank
  needs it. Per bucket of matrices (``bucket_bytes`` of local momentum), each matrix gets an owner
  rank (largest first to the least-loaded rank: the NS work is split across ranks, as in
  modded-nanogpt); one ``all_to_all_single`` sends every rank's shards to the owners, each owner
  runs Newton–Schulz on its whole matrices, and one ``all_to_all_single`` returns to every rank
  only its own shard of each result — about one local momentum's bytes each way per rank, where
  gathering each full matrix on every rank and broadcasting the result moved ~3× (tested by
  counting bytes). Where each shard lies comes from torch's own DTensor layout logic (uneven
  FSDP shards, TP Shard(0)/Shard(1), FSDP2's ``_StridedShard`` on a dp×tp mesh, replicated mesh
  dims). Buckets are pipelined: the next bucket's shards travel while this one's NS runs.
  Expert weights sharded on the expert dim (EP, or FSDP's Shard(0) of a 3-D weight) are
  orthogonalised locally, expert by expert (no communication). A mesh no process group spans (a
  2-D sub-mesh of a larger world) falls back to gathering the full matrix on every rank.

  **Precision:** NS runs in bf16 on CUDA (Keller Jordan's Muon: cast, normalise, iterate in
  bf16) and fp32 on CPU (``ns_dtype_for``; ``Muon(ns_dtype=...)`` overrides it, for tests); the
  shards travel in the NS dtype (bf16 on CUDA: half the bytes — the cast is elementwise, so it is
  the same as casting the gathered matrix) and the result is cast back to the momentum's dtype.

  The update is scaled by ``0.2 · sqrt(max(rows, cols))`` (Moonshot's "Muon is scalable"), so
  its RMS matches AdamW's and one ``lr`` serves both groups.

* ``lr_at(step)``: linear warmup then cosine decay to ``min_lr_ratio · lr`` — a pure function of the
  step, so the schedule's whole state is the step saved in the checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn


def lr_at(step: int, *, lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """LR for optimizer step ``step`` (0-based)."""
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    decay = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay)
    cos = 0.5 * (1.0 + math.cos(math.pi * progress))
    return lr * (min_lr_ratio + (1.0 - min_lr_ratio) * cos)


def _is_matrix_weight(name: str, p: nn.Parameter) -> bool:
    """A matmul weight inside a block: attention/MLP projections and expert matrices."""
    leaf = name.split(".")[-1]
    if "layers." not in name or "router" in name or "norm" in name:
        return False
    if p.ndim == 2 and leaf == "weight":
        return True
    return p.ndim == 3 and leaf in ("w1", "w2", "w3")


def param_groups(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter], list[nn.Parameter]]:
    """(block matrices, other decayed weights, no-decay params), each parameter once."""
    mats, decay, no_decay = [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if _is_matrix_weight(name, p):
            mats.append(p)
        elif p.ndim >= 2 and "emb" not in name and "router" not in name and not name.startswith("head"):
            decay.append(p)
        else:
            no_decay.append(p)
    return mats, decay, no_decay


def build_optimizer(model: nn.Module, cfg: Any, device: torch.device) -> torch.optim.Optimizer:
    """``cfg`` is ``spec.trainer``: optimizer, lr, betas, weight_decay."""
    mats, decay, no_decay = param_groups(model)
    if cfg.optimizer == "muon":
        return Muon([
            {"params": mats, "kind": "muon", "weight_decay": cfg.weight_decay},
            {"params": decay, "kind": "adamw", "weight_decay": cfg.weight_decay},
            {"params": no_decay, "kind": "adamw", "weight_decay": 0.0},
        ], lr=cfg.lr, betas=tuple(cfg.betas))
    groups = [
        {"params": mats + decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    # foreach (multi-tensor) kernels cannot mix DTensors and plain tensors (e.g. TP without FSDP
    # leaves the norms plain): fall back to the per-parameter loop then.
    from torch.distributed.tensor import DTensor

    kinds = {isinstance(p, DTensor) for p in model.parameters()}
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), foreach=len(kinds) == 1)


# ---- Muon --------------------------------------------------------------------------------------

_NS_COEFFS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic: fast, singular values → ~[0.7, 1.1]


def ns_dtype_for(device: torch.device | str) -> torch.dtype:
    """Newton–Schulz dtype for ``device``: bf16 on CUDA (as modded-nanogpt / Keller Jordan's Muon:
    tensor cores, half the bytes), fp32 elsewhere (bf16 matmuls are ~13× slower than fp32 on the
    CPUs this runs on in tests)."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


@torch.no_grad()
def newton_schulz(g: torch.Tensor, steps: int = 5, polish: int = 3, eps: float = 1e-7,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Orthogonalise the last two dims of ``g`` (batched): ``U Vᵀ`` of its SVD, approximately.

    ``steps`` quintic iterations bring every singular value into ~[0.7, 1.1]; ``polish`` cubic
    iterations (``1.5 X − 0.5 X Xᵀ X``) then pull them to 1 (within ~1e-3 in fp32, within bf16's
    resolution in bf16), so the update really is orthogonal (tested). Runs in ``dtype`` (cast,
    normalise, iterate — all in that dtype, as Keller Jordan's ``X = G.bfloat16()``) and returns
    that dtype.
    """
    x = g.to(dtype)
    transposed = x.shape[-2] > x.shape[-1]
    if transposed:
        x = x.transpose(-2, -1)
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + eps)
    a, b, c = _NS_COEFFS
    for _ in range(steps):
        A = x @ x.transpose(-2, -1)
        B = b * A + c * A @ A
        x = a * x + B @ x
    for _ in range(polish):
        x = 1.5 * x - 0.5 * (x @ x.transpose(-2, -1)) @ x
    if transposed:
        x = x.transpose(-2, -1)
    return x


def _mesh_group(mesh: Any) -> Any:
    """A process group over every rank of ``mesh`` (None: none available)."""
    import torch.distributed as dist

    if mesh.ndim == 1:
        return mesh.get_group()
    if dist.is_initialized() and mesh.size() == dist.get_world_size():
        return dist.group.WORLD
    return None


def _scale(u: torch.Tensor) -> float:
    return 0.2 * math.sqrt(max(u.shape[-2], u.shape[-1]))


def _expert_local(u: torch.Tensor) -> bool:
    """Expert weights sharded on the expert dim only (EP, FSDP's Shard(0) of a 3-D weight, or
    EP experts FSDP-sharded on dim 0 over dp_rep — a ``_StridedShard(0)``): every expert matrix
    is whole on its rank, no communication needed."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    return u.ndim == 3 and all(isinstance(pl, Replicate) or (isinstance(pl, (Shard, _StridedShard)) and pl.dim == 0)
                               for pl in u.placements)


def _orthogonal_update(u: torch.Tensor, index: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """NS on a local tensor, an expert-local DTensor, or — the fallback when no process group
    spans the DTensor's mesh — a sharded matrix gathered whole on every rank (``index`` picks the
    rank that computes it when a group exists). Returns ``u``'s dtype and placements, scaled."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(u, DTensor):
        return newton_schulz(u, dtype=dtype).to(u.dtype) * _scale(u)
    if _expert_local(u) or u.device_mesh.size() == 1:
        o = newton_schulz(u.to_local(), dtype=dtype).to(u.dtype)
        return DTensor.from_local(o, u.device_mesh, u.placements, run_check=False,
                                  shape=u.shape, stride=u.stride()) * _scale(u)
    import torch.distributed as dist

    mesh = u.device_mesh
    full = u.full_tensor()
    group = _mesh_group(mesh)
    if group is not None:
        ranks = dist.get_process_group_ranks(group)
        owner = ranks[index % len(ranks)]
        out = newton_schulz(full, dtype=dtype).to(u.dtype) if dist.get_rank() == owner else torch.empty_like(full)
        dist.broadcast(out, src=owner, group=group)
    else:
        out = newton_schulz(full, dtype=dtype).to(u.dtype)
    rep = DTensor.from_local(out, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return rep.redistribute(mesh, u.placements) * _scale(u)


# -- scatter scheme: each matrix goes whole to one owner rank only, and back as shards --------

_LAYOUTS: dict[Any, Any] = {}


class _Layout:
    """Where each rank's shard of one DTensor lies in the full tensor, for every rank of the
    process group ``ranks`` (global ranks in group order): torch's own per-placement offset
    logic (``torch.distributed.tensor._utils._get_shard_size_and_offsets``, which DCP uses and
    which knows FSDP2's ``_StridedShard`` under TP), keeping the full index per dim, not only
    the first offset."""

    def __init__(self, shape: torch.Size, mesh: Any, placements: tuple, ranks: list[int]):
        from torch.distributed.tensor import Replicate

        mshape = tuple(mesh.mesh.shape)
        self.coords = [tuple((mesh.mesh == r).nonzero()[0].tolist()) for r in ranks]
        self.rep_dims = [d for d, pl in enumerate(placements) if isinstance(pl, Replicate)]
        self.shapes, self.index = [], []
        for c in self.coords:
            shp, idx = _shard_index(shape, mshape, c, placements)
            self.shapes.append(shp)
            self.index.append(idx)
        self.numels = [math.prod(s) for s in self.shapes]

    def sends(self, g: int, owner: int) -> bool:
        """Whether group rank ``g`` sends its shard to ``owner``: of the ranks holding the same
        shard (replicated mesh dims), only the one on the owner's coordinates (the owner itself
        when it holds a copy, e.g. DDP: no traffic)."""
        return all(self.coords[g][d] == self.coords[owner][d] for d in self.rep_dims)


def _shard_index(shape: torch.Size, mesh_shape: tuple, coord: tuple, placements: tuple) -> tuple:
    """(local shape, per-dim index into the full tensor: a slice, or a LongTensor when a strided
    shard makes it non-contiguous) of the shard at mesh coordinate ``coord`` — the global indices
    from :func:`trainer.model.local_indices` (the local-shard init's rule: DTensor's own)."""
    from trainer.model import local_indices

    held = local_indices(tuple(shape), mesh_shape, list(coord), placements)
    local = [shape[d] if i is None else len(i) for d, i in enumerate(held)]
    index: list[Any] = []
    for i in held:
        if i is None:
            index.append(slice(None))
        elif len(i) == 0:
            index.append(slice(0, 0))
        else:
            lo = int(i[0])
            index.append(slice(lo, lo + len(i)) if torch.equal(i, torch.arange(lo, lo + len(i))) else i)
    if any(isinstance(i, torch.Tensor) for i in index):  # open-mesh (np.ix_) indexing
        n = len(index)
        index = [(torch.arange(shape[d]) if i == slice(None) else
                  torch.arange(i.start, i.stop) if isinstance(i, slice) else i).view(
                     [-1 if k == d else 1 for k in range(n)]) for d, i in enumerate(index)]
    return tuple(local), tuple(index)


def _layout(u: Any, ranks: list[int]) -> _Layout:
    key = (tuple(u.shape), u.device_mesh, tuple(u.placements))
    lay = _LAYOUTS.get(key)
    if lay is None:
        lay = _LAYOUTS[key] = _Layout(u.shape, u.device_mesh, tuple(u.placements), ranks)
    return lay


class _Exchange:
    """One bucket of sharded matrices, orthogonalised by the scatter scheme:

    1. one ``all_to_all_single``: every rank sends each of its shards to that matrix's owner
       (only the owner ever holds the whole matrix);
    2. the owner runs Newton–Schulz on its matrices;
    3. one ``all_to_all_single`` back: every rank receives only its own shard of each result.

    Bytes per rank ≈ the rank's momentum shards each way (vs. every rank gathering every full
    matrix). Sent in the NS dtype (bf16 on CUDA: the owner would cast to it anyway, and casting is
    elementwise, so it is the same as casting the gathered matrix; the result is cast back).
    Both collectives are issued with ``async_op``: the next bucket's sends overlap this bucket's
    Newton–Schulz."""

    def __init__(self, us: list[Any], owners: list[int], group: Any, ranks: list[int], me: int,
                 dtype: torch.dtype):
        import torch.distributed as dist

        self.us, self.owners, self.group, self.me, self.dtype = us, owners, group, me, dtype
        self.n = len(ranks)
        self.lays = [_layout(u, ranks) for u in us]
        for u, lay in zip(us, self.lays):
            if tuple(u.to_local().shape) != lay.shapes[me]:
                raise RuntimeError(f"Muon: local shard {tuple(u.to_local().shape)} of a {tuple(u.shape)} "
                                   f"{u.placements} DTensor is not where torch's layout puts it ({lay.shapes[me]})")
        dev = us[0].to_local().device
        self.mine = [k for k, o in enumerate(owners) if o == me]
        send, in_split = [], [0] * self.n
        for k, (u, lay, o) in enumerate(zip(us, self.lays, owners)):
            if lay.sends(me, o):
                send.append((o, k, u.to_local().reshape(-1)))
                in_split[o] += lay.numels[me]
        send.sort(key=lambda t: (t[0], t[1]))
        self.out_split = [sum(self.lays[k].numels[g] for k in self.mine if self.lays[k].sends(g, me))
                          for g in range(self.n)]
        self.in_split = in_split
        sbuf = (torch.cat([t[2] for t in send]).to(dtype) if send else torch.empty(0, dtype=dtype, device=dev))
        self.rbuf = torch.empty(sum(self.out_split), dtype=dtype, device=dev)
        self.work = dist.all_to_all_single(self.rbuf, sbuf, self.out_split, in_split, group=group, async_op=True)
        self._sbuf = sbuf  # alive until the collective is done

    def orthogonalise(self) -> None:
        """Wait for the shards, Newton–Schulz on the owned matrices, start sending results back."""
        import torch.distributed as dist

        self.work.wait()
        del self._sbuf
        dev = self.rbuf.device
        fulls = {k: torch.empty(self.us[k].shape, dtype=self.dtype, device=dev) for k in self.mine}
        pos = 0
        for g in range(self.n):
            for k in self.mine:
                lay = self.lays[k]
                if lay.sends(g, self.me):
                    m = lay.numels[g]
                    fulls[k][lay.index[g]] = self.rbuf[pos:pos + m].view(lay.shapes[g])
                    pos += m
        del self.rbuf
        outs = {k: newton_schulz(f, dtype=self.dtype) for k, f in fulls.items()}
        del fulls
        back = [outs[k][self.lays[k].index[g]].reshape(-1) for g in range(self.n) for k in self.mine]
        sbuf = torch.cat(back) if back else torch.empty(0, dtype=self.dtype, device=dev)
        back_in = [sum(self.lays[k].numels[g] for k in self.mine) for g in range(self.n)]
        back_out = [sum(self.lays[k].numels[self.me] for k, o in enumerate(self.owners) if o == d)
                    for d in range(self.n)]
        self.result = torch.empty(sum(back_out), dtype=self.dtype, device=dev)
        self.work = dist.all_to_all_single(self.result, sbuf, back_out, back_in, group=self.group, async_op=True)
        self._sbuf = sbuf

    def updates(self) -> list[Any]:
        """The scaled orthogonal updates, as DTensors with each ``u``'s placements."""
        from torch.distributed.tensor import DTensor

        self.work.wait()
        del self._sbuf
        order = sorted(range(len(self.us)), key=lambda k: (self.owners[k], k))
        out: list[Any] = [None] * len(self.us)
        pos = 0
        for k in order:
            u, lay = self.us[k], self.lays[k]
            m = lay.numels[self.me]
            local = self.result[pos:pos + m].view(lay.shapes[self.me]).to(u.dtype)
            pos += m
            out[k] = DTensor.from_local(local, u.device_mesh, u.placements, run_check=False,
                                        shape=u.shape, stride=u.stride()) * _scale(u)
        return out


def _scatterable(u: torch.Tensor) -> Any:
    """The process group for the scatter scheme, or None (local NS, or the gather fallback)."""
    from torch.distributed.tensor import DTensor, Partial

    if not isinstance(u, DTensor) or _expert_local(u) or u.device_mesh.size() == 1:
        return None
    if any(isinstance(pl, Partial) for pl in u.placements):
        return None
    return _mesh_group(u.device_mesh)


class Muon(torch.optim.Optimizer):
    """Muon on groups with ``kind: muon``; AdamW on groups with ``kind: adamw``.

    ``ns_dtype``: Newton–Schulz dtype, default from the parameters' device (``ns_dtype_for``:
    bf16 on CUDA, fp32 on CPU); set it to exercise the bf16 path on CPU. ``bucket_bytes``: local
    momentum bytes per scatter exchange (a bucket is in flight while the previous one's NS runs;
    at most three buckets' buffers are alive)."""

    def __init__(self, params: Iterable[Any], lr: float = 3e-4, momentum: float = 0.95,
                 nesterov: bool = True, betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.0, ns_dtype: torch.dtype | None = None,
                 bucket_bytes: int = 128 << 20):
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, betas=betas, eps=eps,
                        weight_decay=weight_decay, kind="adamw")
        super().__init__(params, defaults)
        self.ns_dtype = ns_dtype
        self.bucket_bytes = bucket_bytes

    def _momentum(self, p: Any, group: dict) -> Any:
        st = self.state[p]
        g = p.grad
        if "momentum_buffer" not in st:
            st["momentum_buffer"] = torch.zeros_like(g)
        buf = st["momentum_buffer"]
        buf.mul_(group["momentum"]).add_(g)
        return g.add(buf, alpha=group["momentum"]) if group["nesterov"] else buf

    @staticmethod
    def _apply(p: Any, group: dict, upd: Any) -> None:
        lr, wd = group["lr"], group["weight_decay"]
        if wd:
            p.mul_(1 - lr * wd)
        p.add_(upd, alpha=-lr)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = closure() if closure is not None else None
        muon: list[tuple[Any, dict]] = []
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if group["kind"] == "muon":
                    muon.append((p, group))
                    continue
                g = p.grad
                st = self.state[p]
                b1, b2 = group["betas"]
                if "step" not in st:
                    st["step"] = torch.zeros((), dtype=torch.float32)
                    st["exp_avg"] = torch.zeros_like(g)
                    st["exp_avg_sq"] = torch.zeros_like(g)
                st["step"] += 1
                t = float(st["step"])
                st["exp_avg"].lerp_(g, 1 - b1)
                st["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
                denom = (st["exp_avg_sq"] / (1 - b2 ** t)).sqrt_().add_(group["eps"])
                if wd:
                    p.mul_(1 - lr * wd)
                p.addcdiv_(st["exp_avg"], denom, value=-lr / (1 - b1 ** t))
        if muon:
            self._muon_step(muon)
        return loss

    def _muon_step(self, items: list[tuple[Any, dict]]) -> None:
        import torch.distributed as dist

        dtype = self.ns_dtype or ns_dtype_for(items[0][0].device)
        scatter: dict[int, tuple[Any, list[tuple[Any, dict]]]] = {}
        for i, (p, group) in enumerate(items):
            pg = _scatterable(p.grad)
            if pg is None:  # one process, expert-local, or no group spans the mesh: one at a time
                self._apply(p, group, _orthogonal_update(self._momentum(p, group), i, dtype))
            else:
                scatter.setdefault(id(pg), (pg, []))[1].append((p, group))
        for pg, its in scatter.values():
            ranks = dist.get_process_group_ranks(pg)
            me = ranks.index(dist.get_rank())
            loads = [0] * len(ranks)
            buckets, cur, nbytes = [], [], 0
            for p, group in its:
                cur.append((p, group))
                nbytes += p.grad.to_local().numel() * p.grad.element_size()
                if nbytes >= self.bucket_bytes:
                    buckets.append(cur)
                    cur, nbytes = [], 0
            if cur:
                buckets.append(cur)
            inflight: list[tuple[_Exchange, list]] = []
            for b in buckets:
                # Owners: largest matrix first to the least-loaded rank so far (same on every rank).
                owners = [0] * len(b)
                for k in sorted(range(len(b)), key=lambda k: -b[k][0].numel()):
                    o = min(range(len(ranks)), key=lambda r: (loads[r], r))
                    owners[k] = o
                    loads[o] += b[k][0].numel()
                us = [self._momentum(p, group) for p, group in b]
                inflight.append((_Exchange(us, owners, pg, ranks, me, dtype), b))
                del us
                if len(inflight) >= 2:
                    inflight[-2][0].orthogonalise()  # NS of the previous bucket while this one's shards travel
                if len(inflight) == 3:
                    self._finish(*inflight.pop(0))
            if inflight:
                inflight[-1][0].orthogonalise()  # the last bucket's (the others' NS already ran)
            for ex, b in inflight:
                self._finish(ex, b)

    def _finish(self, ex: _Exchange, b: list) -> None:
        for (p, group), upd in zip(b, ex.updates()):
            self._apply(p, group, upd)
