"""The mixture-of-experts feed-forward layer of ``trainer.model``'s GPT.

A top-k softmax router (dropless by default, an optional capacity factor), the experts as stacked
weights run through one grouped GEMM over expert-sorted tokens (``grouped_mm``), load balancing by
an auxiliary loss or a DeepSeek-V3 style router-bias update, and the expert-parallel dispatch
(``MoE.ep_group``, set by ``trainer/parallel.py``). No meshes are built here.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from orchestrator.plan.presets import ModelSpec

def _gmm_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes these operands: 16-byte aligned rows; bf16 on CUDA
    (Hopper's grouped GEMM) and under torch.compile (its meta kernel wants bf16); eager CPU takes
    fp32 too."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    e = x.element_size()
    if (x.shape[-1] * e) % 16 or (w.shape[-1] * e) % 16:
        return False
    if x.dtype == torch.bfloat16:
        return x.device.type in ("cpu", "cuda")
    return x.device.type == "cpu" and not torch.compiler.is_compiling()


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``x`` (M, a) rows grouped by expert (``counts[e]`` rows for expert ``e``) times ``w[e]``
    (E, a, b): one grouped GEMM with device-side offsets (no host sync). Fallback where the kernel
    does not apply: a loop over ``torch.unbind(w)`` (one host sync for the split sizes)."""
    if _gmm_ok(x, w):
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        return torch._grouped_mm(x, w, offs=offs)
    outs = [xe @ we for xe, we in zip(torch.split(x, counts.tolist()), torch.unbind(w))]
    return torch.cat(outs, dim=0) if outs else x.new_zeros(0, w.shape[-1])


class _Rows(torch.autograd.Function):
    """``x[idx]`` where every row of ``x`` is taken exactly ``k`` times and ``inv`` is the inverse
    permutation (row ``r``'s copies sit at ``inv[r·k : r·k+k]`` of the output). The backward is a
    gather through ``inv`` (plus a sum over the ``k`` copies) instead of autograd's zero-filled
    scatter-add (``index_put`` with accumulate): less memory traffic, no atomics on GPU."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, idx: torch.Tensor, inv: torch.Tensor, k: int) -> torch.Tensor:
        ctx.save_for_backward(inv)
        ctx.k = k
        return x.index_select(0, idx)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        (inv,) = ctx.saved_tensors
        gx = g.index_select(0, inv)
        if ctx.k > 1:
            gx = gx.view(-1, ctx.k, g.shape[-1]).sum(1)
        return gx, None, None, None


class Experts(nn.Module):
    """All experts of one MoE layer as stacked weights ``(n_experts, in, out)``.

    Under expert parallelism ``parallel.py`` turns each weight into a DTensor sharded on dim 0
    over the ``ep`` mesh axis; ``forward`` then runs only the local experts (``to_local``).
    """

    def __init__(self, spec: ModelSpec, n_experts: int, hidden: int):
        super().__init__()
        d = spec.d_model
        self.swiglu = spec.mlp == "swiglu"
        self.w1 = nn.Parameter(torch.empty(n_experts, d, hidden))
        self.w2 = nn.Parameter(torch.empty(n_experts, hidden, d))
        self.w3 = nn.Parameter(torch.empty(n_experts, d, hidden)) if self.swiglu else None
        if spec.bias:
            self.b1 = nn.Parameter(torch.zeros(n_experts, hidden))
            self.b2 = nn.Parameter(torch.zeros(n_experts, d))
            self.b3 = nn.Parameter(torch.zeros(n_experts, hidden)) if self.swiglu else None
        else:
            self.b1 = self.b2 = self.b3 = None

    @staticmethod
    def _local(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
        if t is None:
            return None
        t = t.to_local() if hasattr(t, "to_local") else t
        # Under FSDP (expert parallel included: the experts are their own FSDP unit on the expert
        # mesh) the weights arrive in the compute dtype from the all-gather, no cast here. Only a
        # run without FSDP under autocast (one GPU, TP only) gets fp32 weights and bf16 tokens.
        return t if t.dtype == dtype else t.to(dtype)

    def forward(self, x: torch.Tensor, counts: torch.Tensor, expert_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` holds tokens grouped by local expert, ``counts[e]`` of them for expert ``e``
        (a device tensor); ``expert_ids`` (per row) only when there are biases."""
        dt = x.dtype
        w1, w2, w3 = self._local(self.w1, dt), self._local(self.w2, dt), self._local(self.w3, dt)
        b1, b2, b3 = self._local(self.b1, dt), self._local(self.b2, dt), self._local(self.b3, dt)
        if b1 is not None and expert_ids is None:
            expert_ids = torch.repeat_interleave(torch.arange(counts.numel(), device=x.device), counts,
                                                 output_size=x.shape[0])
        h = grouped_mm(x, w1, counts)
        if b1 is not None:
            h = h + b1[expert_ids]
        if self.swiglu:
            g = grouped_mm(x, w3, counts)
            if b3 is not None:
                g = g + b3[expert_ids]
            h = F.silu(h) * g
        else:
            h = F.gelu(h)
        y = grouped_mm(h, w2, counts)
        if b2 is not None:
            y = y + b2[expert_ids]
        return y


class MoE(nn.Module):
    """Top-k routed experts, dropless by default, with load balancing.

    Without expert parallelism the forward has no host synchronisation: tokens are sorted by
    expert on the device (``argsort``), counted with ``scatter_add`` (``bincount`` would sync), run
    through one grouped GEMM per expert weight and combined by a gather (each token has exactly
    ``top_k`` rows). A capacity factor, when set, zeroes the gates of the overflow assignments
    (the first ``C`` per expert, in token order, are kept) instead of compacting, so shapes stay
    static. ``torch.compile`` sees no graph break in this block.

    ``ep_group`` (set by parallel.py) is the expert-parallel process group: tokens go to the rank
    that owns their expert with ``all_to_all_single`` (uneven split sizes, which the host must
    know: one count exchange per layer) and come back the same way.
    """

    def __init__(self, spec: ModelSpec):
        super().__init__()
        assert spec.moe is not None
        m = spec.moe
        self.n_experts, self.top_k = m.n_experts, m.top_k
        self.capacity_factor = m.capacity_factor
        self.balance, self.aux_coef, self.bias_rate = m.balance, m.aux_loss_coef, m.bias_update_rate
        self.router = nn.Linear(spec.d_model, m.n_experts, bias=False)
        self.experts = Experts(spec, m.n_experts, spec.expert_dim)
        # DeepSeek-V3 style balancing: a bias added to the scores for *selection* only.
        self.register_buffer("expert_bias", torch.zeros(m.n_experts), persistent=True)
        self.register_buffer("tokens_per_expert", torch.zeros(m.n_experts), persistent=False)
        self.ep_group: Any = None
        self.ep_size = 1
        self.tp_group: Any = None  # set under TP: this layer runs on the rank's sequence shard
        self.aux_loss: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        xf = x.reshape(-1, d)
        N, E, k = xf.shape[0], self.n_experts, self.top_k
        probs = F.softmax(self.router(xf).float(), dim=-1)  # (N, E)
        with torch.no_grad():
            sel = torch.topk(probs + self.expert_bias, k, dim=-1).indices  # (N, k)
        gates = probs.gather(1, sel)
        gates = (gates / gates.sum(-1, keepdim=True)).reshape(-1)  # (N·k,) fp32

        flat_e = sel.reshape(-1)
        ones = torch.ones_like(flat_e, dtype=torch.float32)
        counts_f = torch.zeros(E, device=x.device, dtype=torch.float32).scatter_add_(0, flat_e, ones)
        if self.training:
            with torch.no_grad():
                self.tokens_per_expert.add_(counts_f.to(self.tokens_per_expert.dtype))
        if self.balance == "aux_loss" and self.aux_coef > 0:
            self.aux_loss = self.aux_coef * E * (counts_f / (N * k) * probs.mean(0)).sum()
        else:
            self.aux_loss = None
        counts = counts_f.to(torch.int64)
        # Expert parallel: start the count exchange now; it runs while the tokens are sorted.
        pending = self._ep_counts_start(counts) if self.ep_group is not None else None

        order = torch.argsort(flat_e, stable=True)  # assignments grouped by expert, token order kept
        sorted_e = flat_e[order]
        # inv[a]: where assignment a (= token·k + slot) sits in the expert-sorted order.
        inv = torch.empty_like(order).scatter_(0, order, torch.arange(N * k, device=x.device))
        if self.capacity_factor is not None:
            cap = max(1, math.ceil(self.capacity_factor * N * k / E))
            starts = torch.cumsum(counts, 0) - counts
            keep = (torch.arange(N * k, device=x.device) - starts[sorted_e]) < cap  # in sorted order
            gates = gates * keep[inv].to(gates.dtype)
        xs = _Rows.apply(xf, order // k, inv, k)
        dev = xs.device.type
        if torch.is_autocast_enabled(dev) and xs.dtype != torch.get_autocast_dtype(dev):
            # Autocast leaves the residual stream fp32 (the embedding is not autocast, bf16 + fp32
            # adds promote), and the grouped GEMM takes the compute dtype only (bf16 on CUDA): cast
            # once here, or every MoE layer falls back to a per-expert loop with host syncs.
            xs = xs.to(torch.get_autocast_dtype(dev))

        if self.ep_group is None:
            ys = self.experts(xs, counts, sorted_e)
        else:
            ys = self._ep_forward(xs, counts, pending)

        # Combine: each token's k expert outputs weighted by its gates. (A bmm of (1, k)·(k, d) per
        # token is faster on CPU at d ≥ 256 but slower at small d and not fusable under compile.)
        y = (_Rows.apply(ys, inv, order, 1).view(N, k, d) * gates.view(N, k, 1).to(ys.dtype)).sum(1)
        return y.view(B, T, d)

    # The dispatch stays out of torch.compile (trainer.compile compiles each block): an async
    # collective and host split sizes that change every step would break the block's graph and
    # recompile it on every new token count; eager here, compiled around it.
    @torch.compiler.disable
    def _ep_counts_start(self, counts: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Launch the exchange of per-expert token counts (``recv[r·el + e]``: tokens rank ``r``
        sends to my local expert ``e``) without waiting for it.

        Why the host still has to see the counts once per layer: ``all_to_all_single`` (c10d and
        the functional/autograd variant alike) takes its split sizes as host integers — NCCL's
        all-to-all is launched with per-peer byte counts, and the receive buffer must be sized
        before the launch. torch's only device-split all-to-all
        (``torch.ops.symm_mem.all_to_all_vdev``) needs NVSHMEM symmetric-memory buffers sized for
        the worst case, CUDA only — not usable here, and not tested on CPU. So the honest version:
        the exchange is issued asynchronously as soon as the counts exist, overlaps the token sort
        and gather, and is waited for (with one device→host read for both directions' splits)
        only when the token all-to-all needs its split sizes."""
        import torch.distributed as dist

        recv = torch.empty_like(counts)
        work = dist.all_to_all_single(recv, counts, group=self.ep_group, async_op=True)
        return recv, work

    @torch.compiler.disable
    def _ep_forward(self, xs: torch.Tensor, counts: torch.Tensor,
                    pending: tuple[torch.Tensor, Any]) -> torch.Tensor:
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        ep, E = self.ep_size, self.n_experts
        el = E // ep
        recv, work = pending  # the count exchange issued by _ep_counts_start
        work.wait()
        recv_2d = recv.view(ep, el)
        # One host read for both split lists: [sent to rank r] + [received from rank r].
        splits = torch.cat([counts.view(ep, el).sum(1), recv_2d.sum(1)]).tolist()
        send_splits, recv_splits = splits[:ep], splits[ep:]
        xr = all_to_all_single_autograd(xs, recv_splits, send_splits, self.ep_group)
        # Arrived grouped by (source rank, local expert): regroup by local expert.
        seg_expert = torch.arange(el, device=xs.device).repeat(ep)
        tok_expert = torch.repeat_interleave(seg_expert, recv_2d.reshape(-1), output_size=xr.shape[0])
        perm = torch.argsort(tok_expert, stable=True)
        ys = self.experts(xr[perm], recv_2d.sum(0))
        back = torch.empty_like(ys)
        back[perm] = ys
        return all_to_all_single_autograd(back, send_splits, recv_splits, self.ep_group)

    @torch.no_grad()
    def update_bias(self, counts: torch.Tensor) -> None:
        """DeepSeek-V3 balancing: raise the bias of under-loaded experts, lower over-loaded ones."""
        if self.balance == "bias" and self.bias_rate > 0:
            self.expert_bias += self.bias_rate * torch.sign(counts.mean() - counts)
