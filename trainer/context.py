"""Context parallelism (``trainer.parallel.cp`` > 1): each rank of a cp group holds a slice of the
sequence, and attention all-gathers K and V over the group (torchtitan's CP with the all-gather
rotation, written here because torch's own ``context_parallel`` knows only the CUDA SDPA kernels
and ``flex_attention`` has no CPU backward: one code path for gloo and NCCL).

* **Head-tail (zigzag) split**: the sequence is cut into ``2·cp`` chunks of ``S = T / (2·cp)``;
  cp rank ``r`` holds chunks ``r`` and ``2·cp − 1 − r``. Under a causal mask chunk ``c`` attends
  ``c + 1`` chunks of keys, so every rank does ``2·cp + 1`` chunks' work: balanced.
* **Positions**: RoPE (and learned positions) use the tokens' *global* positions
  (:meth:`CP.positions`), so a token's rotation is the one it has without CP.
* **Attention**: K and V stacked and all-gathered over the cp group
  (``all_gather_single``: its backward is a reduce-scatter, on gloo too), put back in global
  order; each local chunk of queries attends the key prefix up to its own end with a
  lower-right-aligned causal mask (``causal_lower_right``: on GPU SDPA keeps its fused
  efficient-attention kernel; on CPU the math kernel with the materialised mask).
* **Loss**: every rank's tokens are as many (the split is even) and its loss is the mean over
  them; FSDP2's gradient mean over ``dp_shard_cp`` (cp folded into the FSDP mesh,
  trainer/parallel_dims.py) is then the gradient of the global mean, and the step's all-reduce of
  the loss averages the ranks' means (the global token mean, as every rank has the same count).

Applied by ``trainer.parallel.parallelize`` (:func:`apply_cp`): the model stays pure (``cp`` is
``None`` on every module until then).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


EXPAND_KV_DEVICES = ("cuda", "xpu")
"""Devices whose SDPA takes the fused path for a lower-right causal mask (see :meth:`CP.attention`)."""


class CP:
    """One rank's place in its cp group: ``group`` (a ProcessGroup), ``size``, ``rank``."""

    def __init__(self, group: Any, size: int, rank: int):
        self.group, self.size, self.rank = group, size, rank
        self._pos: dict[tuple, torch.Tensor] = {}

    def chunks(self) -> tuple[int, int]:
        """The global chunk indices this rank holds (of ``2·size``)."""
        return self.rank, 2 * self.size - 1 - self.rank

    def shard(self, t: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's part of a full-sequence tensor (ids, labels): its two chunks, concatenated."""
        n = t.shape[dim]
        if n % (2 * self.size):
            raise ValueError(f"sequence length {n} is not divisible by 2 × cp = {2 * self.size}")
        s = n // (2 * self.size)
        a, b = self.chunks()
        return torch.cat([t.narrow(dim, a * s, s), t.narrow(dim, b * s, s)], dim=dim)

    def positions(self, local_len: int, device: torch.device) -> torch.Tensor:
        """Global positions (long, ``local_len``) of this rank's tokens."""
        key = (local_len, device)
        hit = self._pos.get(key)
        if hit is None:
            s = local_len // 2
            a, b = self.chunks()
            hit = torch.cat([torch.arange(a * s, (a + 1) * s), torch.arange(b * s, (b + 1) * s)]).to(device)
            self._pos[key] = hit
        return hit

    def gather_kv(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Local ``k``, ``v`` of shape (B, H, T_local, D) → the whole sequence's, (B, H, T, D), in
        global order. Differentiable: the backward reduce-scatters the gradients to their owners."""
        from torch.distributed._functional_collectives import all_gather_single_autograd

        B, H, tl, D = k.shape
        s = tl // 2
        kv = torch.stack([k, v]).contiguous()  # (2, B, H, T_local, D)
        g = all_gather_single_autograd(kv, 0, self.group)  # (cp·2, …): rank by rank
        if hasattr(g, "wait"):  # an AsyncCollectiveTensor outside compile
            g = g.wait()
        g = g.view(self.size, 2, B, H, 2, s, D)
        # chunks 0..cp-1 are the ranks' first halves in rank order; cp..2cp-1 their second halves
        # in reverse rank order.
        head = g[:, :, :, :, 0].permute(1, 2, 3, 0, 4, 5).reshape(2, B, H, self.size * s, D)
        tail = g.flip(0)[:, :, :, :, 1].permute(1, 2, 3, 0, 4, 5).reshape(2, B, H, self.size * s, D)
        full = torch.cat([head, tail], dim=3)
        return full[0], full[1]

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of the local queries (B, Hq, T_local, D) against the whole sequence's
        keys and values (gathered here); returns (B, Hq, T_local, D)."""
        from torch.nn.attention.bias import causal_lower_right

        kf, vf = self.gather_kv(k, v)
        s = q.shape[2] // 2
        gqa = q.shape[1] != kf.shape[1]
        kx = vx = None  # kv heads repeated per query head, for the fused lower-right kernels
        out = []
        for i, c in enumerate(self.chunks()):
            qc = q[:, :, i * s:(i + 1) * s]
            n = (c + 1) * s  # the keys up to this chunk's end
            if n == s:  # the first chunk: plain causal
                out.append(F.scaled_dot_product_attention(qc, kf[:, :, :n], vf[:, :, :n], is_causal=True,
                                                          enable_gqa=gqa))
            elif gqa and q.device.type in EXPAND_KV_DEVICES:
                # CausalBias's lower-right dispatch calls the flash/efficient kernels directly,
                # which take no GQA: repeat each kv head for its query heads (SDPA's grouping).
                if kx is None:
                    rep = q.shape[1] // kf.shape[1]
                    kx, vx = kf.repeat_interleave(rep, dim=1), vf.repeat_interleave(rep, dim=1)
                out.append(F.scaled_dot_product_attention(qc, kx[:, :, :n], vx[:, :, :n],
                                                          attn_mask=causal_lower_right(s, n)))
            else:
                out.append(F.scaled_dot_product_attention(qc, kf[:, :, :n], vf[:, :, :n],
                                                          attn_mask=causal_lower_right(s, n), enable_gqa=gqa))
        return torch.cat(out, dim=2)


def apply_cp(model: torch.nn.Module, cp_mesh: Any) -> None:
    """Give the model and every attention layer this rank's :class:`CP` (one object)."""
    from trainer.model import Attention

    cp = CP(cp_mesh.get_group(), cp_mesh.size(), cp_mesh.get_local_rank())
    model.cp = cp
    for m in model.modules():
        if isinstance(m, Attention):
            m.cp = cp
