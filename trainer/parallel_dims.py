"""Parallel degrees and device meshes for the bundled trainer (torchtitan's ``parallel_dims.py``).

* ``ParallelDims(dp_shard, tp, ep, world_size)`` validated *before* any process group starts, with
  one error naming every factor and the world size.
* ``build_meshes``: the dense mesh ``(dp_shard, tp)``; ``(dp_replicate, dp_shard, tp)`` for HSDP
  (``dp_replicate`` > 1: FSDP2 shards over ``dp_shard`` and replicates over ``dp_replicate``, so
  the all-gathers and reduce-scatters stay inside a shard group — one node — and one gradient
  all-reduce crosses them) or for DDP-style replication (``replicate``: HSDP with a shard group
  of one); for expert parallelism, a separate expert mesh ``(dp_rep, ep)`` with
  ``dp_shard = dp_rep × ep``. With pp or cp > 1 (and only then: the meshes above are unchanged),
  the 5-D world mesh ``(pp, dp_replicate, dp_shard, cp, tp)`` with ``Meshes.pp``/``Meshes.cp``
  and cp folded into the FSDP/gradient mesh (``dp_shard_cp``, torchtitan's), see :func:`_nd_meshes`
  (cp's attention and sequence split: ``trainer/context.py``).

The parallelize steps that use these meshes (TP plan, EP, FSDP2) are in ``trainer/parallel.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from orchestrator.plan.presets import ModelSpec
from trainer.errors import ConfigError

@dataclass
class ParallelDims:
    dp_shard: int
    tp: int
    ep: int
    world_size: int
    replicate: bool = False
    dp_replicate: int = 1
    pp: int = 1
    cp: int = 1

    @classmethod
    def from_spec(cls, spec: Any, world_size: int) -> "ParallelDims":
        """Degrees from a JobSpec. ``dp_shard: -1`` and ``parallel: auto`` fill in from the
        actual world size (so a resumed run may use another node count)."""
        raw = spec.trainer.parallel
        if raw == "auto":
            return cls(world_size, 1, 1, world_size, False)
        rep = raw.dp_replicate
        dp = raw.dp_shard if raw.dp_shard != -1 else max(1, world_size // (raw.tp * rep * raw.pp * raw.cp))
        return cls(dp, raw.tp, raw.ep, world_size, raw.replicate, rep, raw.pp, raw.cp)

    def validate(self, model: ModelSpec | None = None) -> None:
        rep = f"dp_replicate ({self.dp_replicate}) × " if self.dp_replicate > 1 else ""
        pp = f"pp ({self.pp}) × " if self.pp > 1 else ""
        cp = f" × cp ({self.cp})" if self.cp > 1 else ""
        d = f"{pp}{rep}dp_shard ({self.dp_shard}){cp} × tp ({self.tp}), ep ({self.ep}), world size ({self.world_size})"
        problems = []
        if min(self.dp_shard, self.tp, self.ep, self.dp_replicate, self.pp, self.cp) < 1:
            problems.append("every degree must be ≥ 1")
        elif self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp != self.world_size:
            names = ("pp × " if pp else "") + ("dp_replicate × " if rep else "") + "dp_shard" + (" × cp" if cp else "") + " × tp"
            problems.append(f"{names} = {self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp} "
                            f"must equal the world size (torchrun --nproc-per-node × --nnodes)")
        if self.dp_replicate > 1 and (self.replicate or self.ep > 1):
            problems.append("dp_replicate > 1 (HSDP) with replicate: true or ep > 1 is not supported")
        if self.ep > 1 and self.dp_shard % self.ep:
            problems.append("ep must divide dp_shard")
        if self.ep > 1 and self.tp > 1:
            problems.append("ep > 1 with tp > 1 is not supported by the bundled trainer")
        if self.ep > 1 and self.replicate:
            problems.append("ep > 1 with replicate: true is not supported")
        if model is not None:
            if self.ep > 1 and model.moe is None:
                problems.append("ep > 1 needs a MoE model")
            if model.moe is not None and model.moe.n_experts % self.ep:
                problems.append(f"ep must divide n_experts ({model.moe.n_experts})")
            if model.n_heads % self.tp or model.kv_heads % self.tp:
                problems.append(f"tp must divide n_heads ({model.n_heads}) and n_kv_heads ({model.kv_heads})")
            if self.tp > 1 and model.ff_dim % self.tp:
                problems.append(f"tp must divide the feed-forward size ({model.ff_dim})")
        if problems:
            raise ConfigError(f"invalid parallel degrees: {d}: " + "; ".join(problems))

    @property
    def dp(self) -> int:
        """The data-parallel degree: every rank that reads its own slice of the batch."""
        return self.dp_replicate * self.dp_shard

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    def dp_rank(self, rank: int) -> int:
        """Data-parallel rank of a global rank. The mesh is (pp, dp_replicate, dp_shard, cp, tp),
        tp innermost: rank = (((pp_i·R + r)·S + s)·C + c)·T + t; cp and tp ranks read the same batch."""
        return (rank // (self.tp * self.cp)) % self.dp

    def cp_rank(self, rank: int) -> int:
        """Which sequence shard a global rank holds (0 when cp = 1)."""
        return (rank // self.tp) % self.cp

    def pp_rank(self, rank: int) -> int:
        """Which pipeline stage (group) a global rank runs (0 when pp = 1)."""
        return rank // (self.world_size // self.pp)


@dataclass
class Meshes:
    """``dense``: every rank's mesh (2-D/3-D as before; the 5-D world mesh under pp/cp);
    ``fsdp``: FSDP2's and the gradient reduction's mesh (cp folded in: ``dp_shard_cp``);
    ``tp``, ``pp``, ``cp``: 1-D meshes, None when that degree is 1; ``expert``: EP's own mesh."""

    dense: Any
    fsdp: Any | None
    tp: Any | None
    expert: Any | None
    pp: Any | None = None
    cp: Any | None = None


def build_meshes(dims: ParallelDims, device_type: str) -> Meshes:
    from torch.distributed.device_mesh import init_device_mesh

    if dims.world_size == 1 and not dist.is_initialized():
        return Meshes(None, None, None, None)  # one process, no process group (python -m trainer)
    if dims.pp > 1 or dims.cp > 1:
        return _nd_meshes(dims, device_type)
    if dims.replicate or dims.dp_replicate > 1:
        # HSDP: ranks (r, s, t) with global rank (r·dp_shard + s)·tp + t — a shard group is
        # dp_shard × tp consecutive ranks, i.e. one node when dp_shard × tp = GPUs per node.
        shape = (dims.dp, 1, dims.tp) if dims.replicate else (dims.dp_replicate, dims.dp_shard, dims.tp)
        dense = init_device_mesh(device_type, shape, mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
        fsdp = dense["dp_replicate", "dp_shard"] if dims.dp > 1 else None
    else:
        dense = init_device_mesh(device_type, (dims.dp, dims.tp), mesh_dim_names=("dp_shard", "tp"))
        fsdp = dense["dp_shard"] if dims.dp > 1 else None
    tp = dense["tp"] if dims.tp > 1 else None
    expert = None
    if dims.ep > 1:
        expert = init_device_mesh(device_type, (dims.dp // dims.ep, dims.ep), mesh_dim_names=("dp_rep", "ep"))
    return Meshes(dense, fsdp, tp, expert)


ND_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


def _nd_meshes(dims: ParallelDims, device_type: str) -> Meshes:
    """The 5-D world mesh ``(pp, dp_replicate, dp_shard, cp, tp)`` (tp innermost, pp outermost:
    the rank order of :meth:`ParallelDims.dp_rank`/``cp_rank``/``pp_rank``) and its views, as
    torchtitan's ``parallel_dims``: ``dp_shard`` and ``cp`` flattened into ``dp_shard_cp`` (the cp
    ranks of one batch slice hold different tokens, so FSDP shards over them and the gradient
    reduction sums over them too); the FSDP mesh is ``dp_shard_cp``, or ``(dp_replicate,
    dp_shard_cp)`` for HSDP/replicate. Every view but the world's is inside one pipeline stage."""
    from torch.distributed.device_mesh import init_device_mesh

    if dims.ep > 1:
        raise ConfigError(f"trainer.parallel: ep ({dims.ep}) > 1 with pp ({dims.pp}) or cp ({dims.cp}) > 1 is not "
                          "supported by the bundled trainer")
    rep, shard = (dims.dp, 1) if dims.replicate else (dims.dp_replicate, dims.dp_shard)
    world = init_device_mesh(device_type, (dims.pp, rep, shard, dims.cp, dims.tp), mesh_dim_names=ND_DIMS)
    hsdp = dims.replicate or dims.dp_replicate > 1
    fsdp = None
    if dims.dp * dims.cp == 1:
        pass
    elif dims.cp == 1:
        fsdp = world["dp_replicate", "dp_shard"] if hsdp else world["dp_shard"]
    elif hsdp:  # the flattened mesh kept as made (slicing a flattened dim from the root is deprecated)
        fsdp = world["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")._unflatten(
            0, (rep, shard * dims.cp), ("dp_replicate", "dp_shard_cp"))
    else:
        fsdp = world["dp_shard", "cp"]._flatten("dp_shard_cp")
    return Meshes(world, fsdp, world["tp"] if dims.tp > 1 else None, None,
                  pp=world["pp"] if dims.pp > 1 else None, cp=world["cp"] if dims.cp > 1 else None)
