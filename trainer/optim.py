"""Optimizers and the LR schedule.

* ``adamw``: ``torch.optim.AdamW`` with two groups: weight decay on matmul weights only (not on
  norms, biases, embeddings or the MoE router).
* ``muon``: ``Muon`` below — Newton–Schulz orthogonalised momentum on the 2-D matmul weights of the
  blocks (attention and MLP projections) and on each expert matrix of the 3-D expert weights;
  AdamW on embeddings, head, norms, biases and the router, all in one ``torch.optim.Optimizer``
  (so one state dict for DCP).

  **Sharding (FSDP2/TP):** the orthogonalisation needs the whole matrix. Each rank gathers the
  full momentum-corrected update with ``DTensor.full_tensor()``, gets it orthogonalised (below)
  and keeps only its own shard (``Replicate → original placements``, a
  local slice, no communication). The NS work is split across ranks: the i-th sharded matrix of a
  step is orthogonalised by rank ``i mod n`` of its mesh only and broadcast (modded-nanogpt's
  scheme; here NS stays in fp32). Expert weights sharded on the expert dim (EP) are
  orthogonalised locally, expert by expert (no gather needed).

  The update is scaled by ``0.2 · sqrt(max(rows, cols))`` (Moonshot's "Muon is scalable"), so
  its RMS matches AdamW's and one ``lr`` serves both groups.

* ``lr_at(step)``: linear warmup then cosine decay to ``min_lr_ratio · lr`` — a pure function of the
  step, so the schedule's whole state is the step saved in the checkpoint.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch
import torch.nn as nn


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


@torch.no_grad()
def newton_schulz(g: torch.Tensor, steps: int = 5, polish: int = 3, eps: float = 1e-7) -> torch.Tensor:
    """Orthogonalise the last two dims of ``g`` (batched): ``U Vᵀ`` of its SVD, approximately.

    ``steps`` quintic iterations bring every singular value into ~[0.7, 1.1]; ``polish`` cubic
    iterations (``1.5 X − 0.5 X Xᵀ X``) then pull them to 1 within ~1e-3, so the update really is
    orthogonal (tested). Runs in fp32.
    """
    x = g.float()
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


def _orthogonal_update(u: torch.Tensor, index: int = 0) -> torch.Tensor:
    """NS on a (possibly sharded) update; returns it with the same placements.

    A matrix sharded over several ranks is orthogonalised by one of them only — the ``index``-th
    matrix by rank ``index mod n`` of its mesh — and broadcast: the Newton–Schulz work of a step is
    split across ranks (as modded-nanogpt does) instead of repeated on each."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(u, DTensor):
        o = newton_schulz(u)
    elif u.ndim == 3 and all(isinstance(pl, Replicate) or (isinstance(pl, Shard) and pl.dim == 0)
                            for pl in u.placements):
        # Expert weights sharded on the expert dim: whole matrices are local.
        o = DTensor.from_local(newton_schulz(u.to_local()).to(u.dtype), u.device_mesh, u.placements,
                               run_check=False, shape=u.shape, stride=u.stride())
        return o * _scale(u)
    else:
        import torch.distributed as dist

        mesh = u.device_mesh
        full = u.full_tensor()
        group = _mesh_group(mesh)
        if group is not None and mesh.size() > 1:
            ranks = mesh.mesh.flatten().tolist()
            owner = ranks[index % len(ranks)]
            out = newton_schulz(full).to(u.dtype) if dist.get_rank() == owner else torch.empty_like(full)
            dist.broadcast(out, src=owner, group=group)
        else:
            out = newton_schulz(full).to(u.dtype)
        rep = DTensor.from_local(out, mesh, [Replicate()] * mesh.ndim, run_check=False)
        o = rep.redistribute(u.device_mesh, u.placements)
        return o * _scale(u)
    return o.to(u.dtype) * _scale(u)


def _scale(u: torch.Tensor) -> float:
    return 0.2 * math.sqrt(max(u.shape[-2], u.shape[-1]))


class Muon(torch.optim.Optimizer):
    """Muon on groups with ``kind: muon``; AdamW on groups with ``kind: adamw``."""

    def __init__(self, params: Iterable[Any], lr: float = 3e-4, momentum: float = 0.95,
                 nesterov: bool = True, betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.0):
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, betas=betas, eps=eps,
                        weight_decay=weight_decay, kind="adamw")
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = closure() if closure is not None else None
        n_mat = 0  # muon matrices so far this step: assigns each to an owner rank
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                st = self.state[p]
                if group["kind"] == "muon":
                    if "momentum_buffer" not in st:
                        st["momentum_buffer"] = torch.zeros_like(g)
                    buf = st["momentum_buffer"]
                    buf.mul_(group["momentum"]).add_(g)
                    u = g.add(buf, alpha=group["momentum"]) if group["nesterov"] else buf
                    upd = _orthogonal_update(u, n_mat)
                    n_mat += 1
                    if wd:
                        p.mul_(1 - lr * wd)
                    p.add_(upd, alpha=-lr)
                else:
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
        return loss
