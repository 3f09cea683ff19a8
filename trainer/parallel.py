"""Parallelism for the pure model in ``trainer/model.py`` (torchtitan's order and its
``parallelize.py``: the steps that apply the meshes to the model).

* ``ParallelDims`` (degrees, validated before any process group starts), ``Meshes`` and
  ``build_meshes`` live in :mod:`trainer.parallel_dims` and are importable from here.
* ``parallelize``: tensor parallelism (column-wise wq/wk/wv/w1/w3, row-wise wo/w2; QK-norm as a
  head-sharded DTensor so its gradient sums over heads; embedding/head only when untied), then
  activation checkpointing, then torch.compile (GPU only), then FSDP2 ``fully_shard`` per block
  and on the root (bf16 params / fp32 reduce on GPU, fp32 on CPU). MoE experts become DTensors
  ``[Replicate(), Shard(0)]`` on the expert mesh (so DCP saves every expert), then each MoE's
  experts module gets its own ``fully_shard`` on the expert mesh's ``dp_rep`` dimension (the
  ranks holding the same experts; torchtitan's ``dp_shard_mod_ep``/``efsdp``): the weights arrive
  in the compute dtype from FSDP's all-gather and their gradients are reduce-scattered during
  backward, divided by dp like every other gradient (:func:`_shard_experts`).
  Restrictions (clear errors): ep > 1 needs tp = 1; ``replicate`` and ``dp_replicate`` > 1 need
  ep = 1.
* ``clip_grad_norm_``: global L2 norm over DTensor grads on several meshes.
* ``sharded_state_bytes(model, optimizer)``: for the planner (issue 7) — bytes of *this rank's*
  local shards of parameters, gradients and optimizer state.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from trainer.errors import ConfigError
from trainer.parallel_dims import Meshes, ParallelDims, build_meshes  # noqa: F401 - build_meshes: imported from here


def apply_tp(model: nn.Module, tp_mesh: Any) -> None:
    """Tensor + sequence parallelism as torchtitan does it.

    The residual stream between blocks is sharded on the sequence (``Shard(1)``, local tensors):
    norms run as ``SequenceParallel`` on their sequence shard; attention and the MLP all-gather
    their input (``PrepareModuleInput``), run column-wise wq/wk/wv/w1/w3 and row-wise wo/w2, and
    reduce-scatter back to the sequence shard. QK-norm runs per head shard (its weight's gradient
    sums over heads).

    * Untied head: column-wise with a vocab-sharded output kept as a DTensor — the loss runs under
      ``loss_parallel`` (no full-vocab all-gather; each rank computes its vocab shard's part of the
      cross-entropy). The untied embedding is row-wise; it reduce-scatters into the sequence shard
      (rotary) or all-reduces and the first block takes its own slice (learned positions, which
      are added to the whole sequence first).
    * Tied embeddings (documented choice): one Parameter cannot be both the row-wise embedding and
      the column-wise head, so it stays replicated over TP (sharded by FSDP over dp). The
      embedding output is sliced into the sequence shard (no communication); the final norm's
      output is all-gathered and every TP rank computes the head and the loss on the whole
      sequence (the same values, so the tied weight's gradient needs no TP reduction). The cost:
      the head's matmul is repeated TP times; untie the head for large-vocab TP runs.
    * MoE blocks: the router and experts are replicated over TP and run on the rank's own
      sequence shard (tokens are independent in a MoE layer: no communication, no repeated work);
      their gradients are summed over TP after backward (:func:`finish_expert_grads`).
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel, parallelize_module)

    from trainer.model import MLP

    for block in model.layers.values():
        plan: dict[str, Any] = {
            "norm1": SequenceParallel(),
            "attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
            "attn.wo": RowwiseParallel(output_layouts=Shard(1)),
            "norm2": SequenceParallel(),
        }
        if isinstance(block.ffn, MLP):
            plan["ffn"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
            plan["ffn.w1"] = ColwiseParallel()
            plan["ffn.w2"] = RowwiseParallel(output_layouts=Shard(1))
            if block.ffn.w3 is not None:
                plan["ffn.w3"] = ColwiseParallel()
        else:  # MoE: on the local sequence shard, weights replicated over TP
            plan["ffn"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),),
                                             use_local_output=True)
            block.ffn.tp_group = tp_mesh.get_group()
        if block.attn.q_norm is not None:
            # Each rank normalises its own heads: a DTensor sharded on the head dim (2) makes the
            # replicated norm weight's gradient a sum over every head.
            plan["attn.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
            plan["attn.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        parallelize_module(block, tp_mesh, plan)
    # A pipeline stage (trainer/pipeline.py) may hold neither the embedding nor the head: its
    # input and output are then the sequence-sharded residual stream between blocks.
    first = next(iter(model.layers.values()))
    top: dict[str, Any] = {"norm": SequenceParallel()} if model.head is not None else {}
    untied = not model.spec.tie_embeddings
    if model.tok_emb is None:
        pass
    elif untied and model.pos_emb is None:
        top["tok_emb"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    else:
        if untied:
            top["tok_emb"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        # The whole sequence (positions added) → this rank's slice: a local split, no comms.
        parallelize_module(first, tp_mesh, PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True))
    if model.head is None:
        pass
    elif untied:
        top["head"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
        model.loss_parallel = True  # trainer.model.loss_context
    else:
        top["head"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                         use_local_output=True)
    if top:
        parallelize_module(model, tp_mesh, top)


def apply_ep(model: nn.Module, expert_mesh: Any) -> None:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from trainer.model import Experts

    for moe in model.moe_layers():
        moe.ep_group = expert_mesh.get_group("ep")
        moe.ep_size = expert_mesh.size(1)
        ex: Experts = moe.experts
        for name, p in list(ex.named_parameters(recurse=False)):
            dt = distribute_tensor(p.data, expert_mesh, [Replicate(), Shard(0)], src_data_rank=None)
            ex.register_parameter(name, nn.Parameter(dt, requires_grad=p.requires_grad))


def apply_ac(model: nn.Module, mode: str) -> None:
    if mode == "none":
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for i, (name, block) in enumerate(list(model.layers.items())):
        if mode == "full" or (mode == "selective" and i % 2 == 0):
            model.layers[name] = checkpoint_wrapper(block, preserve_rng_state=False)


def apply_fp8(model: nn.Module) -> None:
    try:
        from torchao.float8 import convert_to_float8_training  # type: ignore[import-not-found]
    except ImportError:
        raise ConfigError("trainer.fp8: true needs torchao (pip install torchao); it is not installed") from None

    convert_to_float8_training(model, module_filter_fn=fp8_keep)


def fp8_keep(mod: nn.Module, fqn: str) -> bool:
    """Which linears become float8: not the head, not a MoE router (routing decisions from
    fp8-quantised logits; torchtitan's MoE configs exclude routers too), and only shapes
    ``_scaled_mm`` takes (both dims divisible by 16)."""
    if not isinstance(mod, nn.Linear) or fqn == "head" or fqn.split(".")[-1] == "router":
        return False
    return mod.in_features % 16 == 0 and mod.out_features % 16 == 0


def parallelize(model: nn.Module, dims: ParallelDims, meshes: Meshes, *, device: torch.device,
                activation_checkpointing: str = "none", compile: bool = False, fp8: bool = False,
                param_dtype: torch.dtype | None = None, reshard_after_forward: bool = True) -> nn.Module:
    """fp8 (it swaps the linears) → CP → TP → EP → AC → compile → FSDP2, in place on a (meta)
    model. Returns the model."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if fp8:
        if device.type != "cuda":
            raise ConfigError("trainer.fp8: true needs a CUDA GPU (Hopper or newer); this run is on CPU")
        apply_fp8(model)
    if meshes.cp is not None:  # the sequence shard's positions and all-gather-KV attention
        from trainer.context import apply_cp

        apply_cp(model, meshes.cp)
    if meshes.tp is not None:
        apply_tp(model, meshes.tp)
    if meshes.expert is not None:
        apply_ep(model, meshes.expert)
    apply_ac(model, activation_checkpointing)
    if compile and device.type == "cuda":
        for name, block in model.layers.items():
            block.compile()
    if meshes.fsdp is not None:
        mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype else MixedPrecisionPolicy()
        blocks = list(model.layers.values())
        experts = []
        for i, block in enumerate(blocks):
            # The last block's parameters are needed again right at the start of backward: keep
            # them (torchtitan). The root keeps FSDP2's own heuristic (reshard_after_forward
            # unset: not resharded, the embedding/head are needed at once for backward).
            raf = reshard_after_forward and i < len(blocks) - 1
            # Expert-parallel experts: their own FSDP unit on the expert mesh, applied first so
            # the block's unit leaves them alone; with ep = 1 they are ordinary parameters,
            # sharded and reduced by FSDP with the rest of the block.
            ex = _shard_experts(block, dims, meshes, mp, raf, device) if meshes.expert is not None else None
            experts.append(ex)
            fully_shard(block, mesh=meshes.fsdp, mp_policy=mp, reshard_after_forward=raf)
        fully_shard(model, mesh=meshes.fsdp, mp_policy=mp)
        if meshes.expert is not None:
            _ep_prefetch(model, blocks, experts)
    return model


def _shard_experts(block: nn.Module, dims: ParallelDims, meshes: Meshes, mp: Any, raf: bool,
                   device: torch.device) -> nn.Module | None:
    """FSDP2 on one MoE's experts over the expert mesh's ``dp_rep`` dimension (torchtitan's
    ``efsdp`` unit). Returns the experts module, or None for a dense block.

    * The parameters are already DTensors ``[Replicate(), Shard(0)]`` on ``(dp_rep, ep)``;
      ``dp_mesh_dims`` tells FSDP to shard over ``dp_rep`` (the replicas of the same experts) and
      keep the ``ep`` split. Sharded on dim 0 (whole experts per rank, which also keeps Muon's
      expert-by-expert path local) unless ``dp_rep × ep`` exceeds the number of experts (some
      ranks would hold none): then dim 1, as torchtitan does, for each weight whose dim 1 splits
      evenly over dp_rep (FSDP2 pads only dim 0).
    * Gradient scale: every owner receives tokens from every rank of its ep group, so its local
      gradient is already a *sum* over ep ranks' losses; the reduce-scatter sums over ``dp_rep``
      and must divide by the whole dp (not by ``dp_rep``, FSDP's default for this mesh) to give
      the FSDP-averaged gradient of the mean loss — ``set_gradient_divide_factor(dp)``
      (torchtitan: "consistent with data"). NCCL does that as PREMUL_SUM; gloo has no PREMUL_SUM,
      so off CUDA the collective is a SUM followed by FSDP's own division.
    * ``dp_rep == 1`` (dp == ep): a size-1 FSDP unit. Nothing is communicated; it still gives
      the experts FSDP's mixed precision (the compute-dtype copy is made when the unit unshards,
      the fp32 master stays, the gradient comes back in fp32) and the ÷dp, on one code path —
      instead of a hand-kept bf16 copy that would have to be refreshed after every step.
    """
    from torch.distributed.fsdp import DataParallelMeshDims, fully_shard
    from torch.distributed.tensor import Shard

    from trainer.model import MoE

    moe = next((m for m in block.modules() if isinstance(m, MoE)), None)
    if moe is None:
        return None
    ex = moe.experts
    dp_rep = meshes.expert.size(0)
    def dim1(p: nn.Parameter) -> Shard | None:  # per weight: dim 1 where it splits evenly (FSDP needs that)
        return Shard(1) if p.shape[1] % dp_rep == 0 else None

    fully_shard(ex, mesh=meshes.expert, dp_mesh_dims=DataParallelMeshDims(shard="dp_rep"), mp_policy=mp,
                reshard_after_forward=raf, shard_placement_fn=dim1 if dp_rep * dims.ep > moe.n_experts else None)
    ex.set_gradient_divide_factor(float(dims.dp))
    if device.type != "cuda" and dp_rep > 1:
        # Not at dp_rep 1: there torch 2.13 copies the (only) shard divided by the factor *and*
        # applies the forced-SUM post-division again (÷dp², measured); without the flag the
        # size-1 path divides once and issues no collective, so gloo never sees PREMUL_SUM.
        ex.set_force_sum_reduction_for_comms(True)
    return ex


def _ep_prefetch(model: nn.Module, blocks: list[nn.Module], experts: list[nn.Module | None]) -> None:
    """Explicit FSDP prefetching with EP (torchtitan): the expert-parallel forward waits on the
    host for the token counts, which would otherwise delay issuing the experts' all-gather until
    the tokens are already there. Each block prefetches the next block and its experts in
    forward, the previous ones in backward."""
    def units(i: int) -> list[nn.Module]:
        return [blocks[i]] + ([experts[i]] if experts[i] is not None else [])

    n = len(blocks)
    model.set_modules_to_forward_prefetch(units(0))
    for i in range(n):
        if i + 1 < n:
            blocks[i].set_modules_to_forward_prefetch(units(i + 1))
        if i > 0:
            blocks[i].set_modules_to_backward_prefetch(units(i - 1))
    model.set_modules_to_backward_prefetch(units(n - 1))



def amp_context(device: torch.device, param_dtype: torch.dtype | None, meshes: Meshes) -> Any:
    """Mixed precision for forward + loss when FSDP2 does not provide it.

    FSDP2's ``MixedPrecisionPolicy`` casts parameters to ``param_dtype`` only where ``fully_shard``
    was applied; a run without a data-parallel mesh (one GPU, or TP only, or DDP at dp = 1) would
    otherwise train in fp32 although ``precision: bf16`` was asked for. There: ``torch.autocast``.
    """
    import contextlib

    if device.type != "cuda" or param_dtype is None or meshes.fsdp is not None:
        return contextlib.nullcontext()
    return torch.autocast(device_type="cuda", dtype=param_dtype)

@torch.no_grad()
def finish_expert_grads(model: nn.Module, dims: ParallelDims, meshes: Meshes) -> None:
    """Gradients FSDP does not finish.

    * Tensor parallel (sequence-parallel MoE): each TP rank ran the router and experts on its own
      sequence shard, so their gradients are partial: one all-reduce (sum) over the TP group.
    * Expert parallel needs nothing here any more: the experts are their own FSDP unit on the
      expert mesh, reduce-scattered over ``dp_rep`` (÷ dp) during backward (:func:`_shard_experts`)."""
    if meshes.tp is not None:
        from torch.distributed.tensor import DTensor

        from trainer.model import MoE

        gs = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
              for m in model.modules() if isinstance(m, MoE) for p in m.parameters() if p.grad is not None]
        if gs:
            flat = torch.cat([g.reshape(-1) for g in gs])
            dist.all_reduce(flat, group=meshes.tp.get_group())
            torch._foreach_copy_(gs, [f.view_as(g) for f, g in zip(flat.split([g.numel() for g in gs]), gs)])


@torch.no_grad()
def clip_grad_norm_(params: list[nn.Parameter], max_norm: float | None, pp_group: Any = None) -> torch.Tensor:
    """Global L2 norm of all gradients (DTensors on any meshes, or plain tensors); clip in place
    when ``max_norm`` is set. Returns the norm before clipping. ``pp_group``: this rank holds one
    pipeline stage's parameters; the squared norms are summed over the stages first."""
    from torch.distributed.tensor import DTensor

    groups: dict[Any, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is None:
            continue
        g = p.grad
        key = (id(g.device_mesh), tuple(g.placements)) if isinstance(g, DTensor) else None
        groups.setdefault(key, []).append(g)
    total_sq = None
    for gs in groups.values():
        n = torch.nn.utils.get_total_norm(gs, 2.0)
        if isinstance(n, DTensor):
            n = n.full_tensor()
        sq = n.float() ** 2
        total_sq = sq if total_sq is None else total_sq + sq
    if pp_group is not None:
        total_sq = total_sq if total_sq is not None else torch.zeros((), device=params[0].device)
        dist.all_reduce(total_sq, group=pp_group)
    if total_sq is None:
        return torch.zeros(())
    total = total_sq.sqrt()
    if max_norm is not None:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        locals_ = [g.to_local() if isinstance(g, DTensor) else g for gs in groups.values() for g in gs]
        torch._foreach_mul_(locals_, coef.to(locals_[0].device))
    return total


def _local_bytes(t: torch.Tensor) -> int:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.to_local()
    return t.numel() * t.element_size()


def sharded_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """This rank's bytes of local shards: ``{"params", "grads", "optimizer", "total"}``.

    Parameters are counted once (tied weights too); grads only where ``.grad`` is set (call after a
    backward); optimizer state is every tensor in ``optimizer.state`` (AdamW: exp_avg, exp_avg_sq
    and the 0-dim ``step`` counters; Muon: momentum buffers), all as held (DTensor local shards).
    Buffers (e.g. MoE router bias) are not counted.
    """
    seen: set[int] = set()
    params = grads = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        params += _local_bytes(p)
        if p.grad is not None:
            grads += _local_bytes(p.grad)
    opt = 0
    if optimizer is not None:
        for st in optimizer.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor):
                    opt += _local_bytes(v)
    return {"params": params, "grads": grads, "optimizer": opt, "total": params + grads + opt}


def held_grad_bytes(model: nn.Module) -> int:
    """Gradient bytes this rank holds right now: ``.grad`` local shards, plus any *unsharded*
    gradient FSDP2 keeps between backwards (``set_requires_gradient_sync(False)`` accumulates the
    full-size gradient in its parameter groups until the next reduce-scatter). Tied weights once."""
    from torch.distributed.fsdp import FSDPModule

    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if p.grad is not None:
            total += _local_bytes(p.grad)
    for m in model.modules():
        if not isinstance(m, FSDPModule):
            continue
        group = m._get_fsdp_state()._fsdp_param_group  # torch-internal: no public accessor
        for fp in (group.fsdp_params if group is not None else ()):
            acc = getattr(fp, "unsharded_accumulated_grad", None)
            if acc is not None:
                total += acc.numel() * acc.element_size()
            up = getattr(fp, "_unsharded_param", None)
            if up is not None and up.grad is not None:
                total += up.grad.numel() * up.grad.element_size()
    return total


class DynamicLossScaler:
    """Dynamic loss scaling for ``precision: fp16`` that works with FSDP2, TP and EP.

    ``torch.amp.GradScaler`` checks for inf/nan per device and FSDP1's ``ShardedGradScaler``
    syncs that flag over one process group; with FSDP2 the gradients are DTensors on several
    meshes (dense, expert). This scaler needs no extra collective: the step's *global* gradient
    norm (``clip_grad_norm_``, reduced over every mesh so every rank holds the same value) is
    finite exactly when every gradient shard on every rank is. So: backward on ``loss × scale``;
    :meth:`unscale_` multiplies the local shards by ``1/scale`` (a power of two: exact); the
    caller computes the norm; :meth:`update` skips the optimizer step and halves the scale on a
    non-finite norm, and doubles it after ``growth_interval`` good steps (torch's defaults). The
    state (scale, good steps) is saved in the checkpoint. Disabled: every method is a no-op.
    """

    def __init__(self, enabled: bool, init_scale: float = 2.0 ** 16, growth_interval: int = 2000,
                 min_scale: float = 1.0):
        self.enabled, self.scale, self.growth_interval, self.min_scale = enabled, float(init_scale), growth_interval, min_scale
        self.good_steps = 0
        self.skipped = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale if self.enabled else loss

    @torch.no_grad()
    def unscale_(self, params: list[nn.Parameter]) -> None:
        if not self.enabled:
            return
        from torch.distributed.tensor import DTensor

        grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, 1.0 / self.scale)

    def update(self, grad_norm: torch.Tensor) -> bool:
        """True: take the optimizer step. False: overflow, skip it (every rank agrees)."""
        if not self.enabled:
            return True
        if not bool(torch.isfinite(grad_norm)):  # one host sync per step, fp16 only
            self.scale = max(self.scale * 0.5, self.min_scale)
            self.good_steps = 0
            self.skipped += 1
            return False
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= 2.0
            self.good_steps = 0
        return True

    def state_dict(self) -> dict[str, float]:
        return {"scale": self.scale, "good_steps": float(self.good_steps)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.scale, self.good_steps = float(sd["scale"]), int(sd["good_steps"])
