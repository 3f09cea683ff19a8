"""Pipeline parallelism (``trainer.parallel.pp`` > 1): a parallelize step on the pure model of
:mod:`trainer.model`, run by ``torch.distributed.pipelining``'s schedules (torchtitan's
``pipeline_parallel.py``).

* The split: the whole model is built on the meta device, copied once per local stage, and each
  copy keeps only its layers (the embedding on the first stage, the final norm and head on the
  last; ``GPT.forward`` runs whatever a stage holds). Each stage is then parallelised
  (TP → AC → FSDP2, :func:`trainer.parallel.parallelize`) on the meshes inside its pipeline
  stage, and materialised. Stage ``s`` holds layers ``s·L/S … (s+1)·L/S − 1`` of ``S = pp × v``
  stages (``v`` stages per rank): placed round-robin (``loop``: rank ``r`` holds ``r, r + pp, …``)
  for gpipe, 1f1b and interleaved-1f1b, in a V (rank ``r`` holds ``r`` and ``2·pp − 1 − r``) for
  zbv and dualpipev, so rank 0 holds both the first and the last stage there.
* :class:`PipelineModel`: this rank's stages seen as one module whose parameter names are the
  whole model's (``layers.5.attn.wq.weight``), so the optimizer, DCP (which loads by name: a pp=2
  checkpoint resumes at pp=1 and back) and the weight init (a function of name and index) are
  those of the model without PP.
* :class:`Pipeline`: the schedule. Static shapes (meta example tensors carrying
  ``requires_grad``: without them the first ``step()`` runs an extra forward/backward to infer
  them). The loss is computed on the last stage, per microbatch, divided by the microbatch count
  (``scale_grads=False``): the same sum of gradients, in the same order, as the loop without PP.
* FSDP2 under zbv/dualpipev: ``reshard_after_forward=False`` (measured here: with resharding their
  split input/weight backward gave wrong gradients, max error 1.6e-2, some None).

Refusals (ConfigError, exit 2): fewer microbatches than a schedule needs, layers not divisible by
``pp × stages per rank``, tied embeddings (one weight on the first and last stage), the MoE aux
loss (its gradient would reach only the stage holding the router), ep > 1, evaluation.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from trainer.errors import ConfigError

log = logging.getLogger("trainer")

# name → (torch schedule class, default stages per rank, stage placement)
SCHEDULES = {"gpipe": ("ScheduleGPipe", 1, "loop"), "1f1b": ("Schedule1F1B", 1, "loop"),
             "interleaved-1f1b": ("ScheduleInterleaved1F1B", 2, "loop"),
             "zbv": ("ScheduleZBVZeroBubble", 2, "v"), "dualpipev": ("ScheduleDualPipeV", 2, "v")}
SPLIT_BACKWARD = ("zbv", "dualpipev")  # input/weight backward split: FSDP must not reshard after forward


@dataclass(frozen=True)
class PPConfig:
    pp: int
    schedule: str
    v: int  # stages per rank
    microbatches: int  # per optimizer step and data-parallel rank
    rows: int  # sequences per microbatch

    @property
    def n_stages(self) -> int:
        return self.pp * self.v


def pp_config(spec: Any, dims: Any, mb: int) -> PPConfig | None:
    """The pipeline of a job, or None at pp = 1; ConfigError naming the field when it cannot run."""
    if dims.pp <= 1:
        return None
    t, p = spec.trainer, spec.trainer.parallel
    ms = t.model_spec
    name = p.pp_schedule
    v = p.pp_stages_per_rank or SCHEDULES[name][1]
    where = f"trainer.parallel (pp {dims.pp}, pp_schedule {name}, stages per rank {v})"
    if name in ("gpipe", "1f1b") and v != 1:
        raise ConfigError(f"{where}: {name} runs one stage per rank; set pp_stages_per_rank: 1 or use "
                          "interleaved-1f1b")
    if name in ("zbv", "dualpipev") and v != 2:
        raise ConfigError(f"{where}: {name} needs exactly 2 stages per rank (a V); set pp_stages_per_rank: 2")
    if name == "interleaved-1f1b" and v < 2:
        raise ConfigError(f"{where}: interleaved-1f1b needs ≥ 2 stages per rank; use 1f1b for one")
    stages = dims.pp * v
    if ms.n_layers % stages:
        raise ConfigError(f"{where}: the model's {ms.n_layers} layers do not split into pp × stages per rank "
                          f"= {stages} equal stages")
    if ms.tie_embeddings:
        raise ConfigError(f"{where}: tied embeddings (trainer.model tie_embeddings: true) cannot be pipelined: "
                          "the one weight would live on the first and the last stage; untie them")
    if ms.moe is not None and ms.moe.balance == "aux_loss":
        raise ConfigError(f"{where}: the MoE auxiliary balancing loss is not supported under PP (its "
                          "gradient would only reach the last stage's loss); use moe.balance: bias or none")
    if dims.ep > 1:
        raise ConfigError(f"{where}: ep > 1 with pp > 1 is not supported by the bundled trainer")
    if t.eval_every:
        raise ConfigError(f"{where}: trainer.eval_every with pp > 1 is not supported yet (evaluation "
                          "runs the whole model on one rank); set eval_every: 0")
    accum = t.batch_size // (dims.dp * mb)
    m = p.pp_microbatches or accum
    rows = accum * mb
    if rows % m:
        raise ConfigError(f"{where}: pp_microbatches ({m}) must divide the sequences per step and data-parallel "
                          f"rank (batch_size / dp = {rows})")
    need = {"gpipe": 1, "1f1b": dims.pp, "interleaved-1f1b": dims.pp, "zbv": stages, "dualpipev": stages}[name]
    if m < need:
        raise ConfigError(f"{where}: {m} microbatches per step, the schedule needs ≥ {need} (fewer leave stages "
                          f"without work or hang); raise trainer.parallel.pp_microbatches or batch_size")
    if name == "interleaved-1f1b" and m % max(1, m // dims.pp):
        raise ConfigError(f"{where}: interleaved-1f1b needs the microbatches ({m}) to be a multiple of "
                          f"microbatches // pp ({m // dims.pp}); use a multiple of pp")
    return PPConfig(dims.pp, name, v, m, rows // m)


def stage_ids(pp_rank: int, cfg: PPConfig) -> list[int]:
    """The stages this pipeline rank runs, in order."""
    if SCHEDULES[cfg.schedule][2] == "v":
        return [pp_rank, 2 * cfg.pp - 1 - pp_rank]
    return [pp_rank + k * cfg.pp for k in range(cfg.v)]


def placement(rank: int, ids: list[int], cfg: PPConfig, n_layers: int, env: Any = None) -> str:
    """The line each rank logs at start: which stages (and layers) it runs, on which node
    (torchrun's ``GROUP_RANK``), so a multi-node job shows where its pipeline landed."""
    import os

    env = os.environ if env is None else env
    per = n_layers // cfg.n_stages
    layers = ", ".join(f"{s * per}-{(s + 1) * per - 1}" for s in ids)
    return (f"pipeline: rank {rank} (node {env.get('GROUP_RANK', '?')}, local rank {env.get('LOCAL_RANK', '?')}) "
            f"runs stage {', '.join(map(str, ids))} of {cfg.n_stages} (layers {layers} of {n_layers})")


def split_stage(full: nn.Module, stage: int, n_stages: int) -> nn.Module:
    """A copy of the (meta) model holding only stage ``stage``'s layers (names kept)."""
    part = copy.deepcopy(full)
    n = len(full.layers)
    per = n // n_stages
    keep = {str(i) for i in range(stage * per, (stage + 1) * per)}
    for name in [k for k in part.layers if k not in keep]:
        del part.layers[name]
    if stage != 0:
        part.tok_emb = None
        part.pos_emb = None
    if stage != n_stages - 1:
        part.norm = None
        part.head = None
    return part


class PipelineModel(nn.Module):
    """This rank's stages as one module named like the whole model. The stages' modules are
    registered here too (shared, not copied): ``named_parameters``/``state_dict`` give the whole
    model's names; ``forward`` is the schedule's (:class:`Pipeline`), not this module's."""

    def __init__(self, stages: list[nn.Module], spec: Any):
        super().__init__()
        self.spec = spec
        self.stage_modules = stages  # a plain list: not registered twice
        self.layers = nn.ModuleDict()
        for part in stages:
            for name in ("tok_emb", "pos_emb", "norm", "head"):
                mod = getattr(part, name, None)
                if mod is not None:
                    setattr(self, name, mod)
        for name, block in sorted(((k, b) for part in stages for k, b in part.layers.items()), key=lambda kb: int(kb[0])):
            self.layers[name] = block
        self.loss_parallel = any(getattr(part, "loss_parallel", False) for part in stages)

    def moe_layers(self) -> list[nn.Module]:
        from trainer.model import MoE

        return [m for m in self.modules() if isinstance(m, MoE)]

    def aux_loss(self) -> None:
        return None  # refused under PP (pp_config)

    def init_weights(self, seed: int, params: bool = True) -> None:
        from trainer.model import GPT

        GPT.init_weights(self, seed, params=params)  # a function of (seed, name, index): names are the model's

    def forward(self, *a: Any, **k: Any) -> Any:
        raise RuntimeError("a pipelined model runs through trainer.pipeline.Pipeline.step")


def build(spec: Any, dims: Any, meshes: Any, cfg: PPConfig, *, device: torch.device, rank: int,
          param_dtype: torch.dtype | None, reshard_after_forward: bool) -> tuple[PipelineModel, "Pipeline"]:
    """Split, parallelise and materialise this rank's stages; the schedule over them."""
    from torch.distributed import pipelining

    from trainer.model import build_model
    from trainer.parallel import parallelize

    t = spec.trainer
    full = build_model(t.model_spec, device="meta")
    ids = stage_ids(dims.pp_rank(rank), cfg)
    log.info("%s", placement(rank, ids, cfg, t.model_spec.n_layers))
    raf = reshard_after_forward and cfg.schedule not in SPLIT_BACKWARD
    if reshard_after_forward and not raf and rank == 0:
        log.info("pp_schedule %s: FSDP2 reshard_after_forward=False (its split backward needs the gathered "
                 "parameters)", cfg.schedule)
    parts = []
    for s in ids:
        part = split_stage(full, s, cfg.n_stages)
        parallelize(part, dims, meshes, device=device, activation_checkpointing=t.activation_checkpointing,
                    compile=t.compile and device.type == "cuda", fp8=t.fp8, param_dtype=param_dtype,
                    reshard_after_forward=raf)
        part.to_empty(device=device)
        part.train()
        parts.append(part)
    del full
    model = PipelineModel(parts, t.model_spec)
    # Activation dtypes: FSDP's mixed precision computes in param_dtype throughout; autocast (GPU,
    # no FSDP: trainer.parallel.amp_context) keeps the residual stream fp32, the head's logits not.
    logits_dt = param_dtype or torch.float32
    act = logits_dt if meshes.fsdp is not None else torch.float32
    tokens = t.seq_len // dims.cp  # context parallelism: each rank's slice of the sequence
    seq = tokens // dims.tp  # sequence parallel between blocks under TP
    d, V = t.model_spec.d_model, t.model_spec.vocab_size
    group = meshes.pp.get_group()
    stages = []
    for s, part in zip(ids, parts):
        def meta(*shape: int, dtype: torch.dtype = act, grad: bool = True) -> torch.Tensor:
            return torch.empty(*shape, dtype=dtype, device="meta").requires_grad_(grad)

        x = meta(cfg.rows, tokens, dtype=torch.long, grad=False) if s == 0 else meta(cfg.rows, seq, d)
        y = meta(cfg.rows, tokens, V, dtype=logits_dt) if s == cfg.n_stages - 1 else meta(cfg.rows, seq, d)
        stages.append(pipelining.PipelineStage(part, s, cfg.n_stages, device, input_args=(x,), output_args=(y,),
                                               group=group))
    return model, Pipeline(cfg, stages, group, meshes)


class Pipeline:
    """One optimizer step's forward and backward through the schedule (:meth:`step`)."""

    def __init__(self, cfg: PPConfig, stages: list[Any], group: Any, meshes: Any):
        from torch.distributed import pipelining

        self.cfg, self.stages, self.group = cfg, stages, group
        self.first = any(st.is_first for st in stages)
        self.last = any(st.is_last for st in stages)
        self._ces: list[torch.Tensor] = []
        self._scale: Any = None
        self.z_loss = 0.0
        cls = getattr(pipelining, SCHEDULES[cfg.schedule][0])
        arg = stages if cfg.v > 1 or cfg.schedule in ("interleaved-1f1b", "zbv", "dualpipev") else stages[0]
        self.schedule = cls(arg, n_microbatches=cfg.microbatches, loss_fn=self._loss, scale_grads=False)
        self.stage_group = _stage_group(meshes)
        self.cp = getattr(stages[0].submod, "cp", None)  # trainer/context.py: this rank's sequence slice

    def _loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        from trainer.model import loss_fn

        loss, ce = loss_fn(logits, y, self.z_loss)
        self._ces.append(ce.detach())
        return self._scale(loss / self.cfg.microbatches)

    def step(self, batches: Any, scaler: Any, z_loss: float, model: nn.Module) -> torch.Tensor:
        """Forward + backward of the step's microbatches; the mean cross-entropy on the last stage's
        ranks, 0 elsewhere (the loop's all-reduce carries it to every rank)."""
        from trainer.model import local_value, loss_context

        xs, ys = zip(*batches)
        x, y = torch.cat(xs), torch.cat(ys)
        if self.cp is not None:  # the tokens and labels of every microbatch, sliced alike (head-tail)
            x, y = self.cp.shard(x), self.cp.shard(y)
        self._ces, self._scale, self.z_loss = [], scaler.scale_loss, z_loss
        with loss_context(model):
            self.schedule.step(*((x,) if self.first else ()), target=y if self.last else None,
                               return_outputs=False)
        acc = torch.zeros((), device=y.device)
        for c in self._ces if self.last else ():  # the loop's own sum, in its order
            acc += local_value(c) / len(self._ces)
        return acc

    def param_digest(self, model: nn.Module) -> str | None:
        return param_digest(model, self.group, dist.get_world_size() // self.cfg.pp)


def _stage_group(meshes: Any) -> Any:
    """The ranks holding the same stage (every mesh dimension but pp), for reductions of per-stage
    values such as the MoE token counts."""
    world = meshes.dense
    rest = tuple(n for n in world.mesh_dim_names if n != "pp")
    return world[rest]._flatten("pp_stage").get_group()


def _digest_items(model: nn.Module) -> dict[str, bytes]:
    from torch.distributed.tensor import DTensor

    from trainer.model import _canonical_name

    out = {}
    for k, v in model.state_dict().items():
        if isinstance(v, DTensor):
            v = v.full_tensor()  # collective inside the stage
        if isinstance(v, torch.Tensor):
            out[_canonical_name(k)] = v.detach().float().cpu().contiguous().numpy().tobytes()
    return out


def param_digest(model: nn.Module, group: Any, stage_size: int) -> str | None:
    """:func:`trainer.checkpoint.param_digest` of the whole model under PP (the same hash as a
    pp = 1 run with the same parameters): each stage's first rank sends its full tensors to rank 0."""
    import hashlib

    items = _digest_items(model)
    rank = dist.get_rank()
    if rank % stage_size:
        return None
    parts: list[Any] = [None] * dist.get_world_size(group) if rank == 0 else None
    dist.gather_object(items, parts, dst=0, group=group)
    if rank != 0:
        return None
    merged = {k: v for p in parts for k, v in p.items()}
    h = hashlib.sha256()
    for name in sorted(merged):
        h.update(name.encode())
        h.update(merged[name])
    return h.hexdigest()
