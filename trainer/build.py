"""From the job spec to the run's parts, for :mod:`trainer.train` (its steps 1–3).

* :func:`check_job`: the spec against ``WORLD_SIZE`` before any process group (``ParallelDims``,
  batch sizes against the data-parallel degree, fp8, the data's vocabulary, trackers, eval);
* :func:`probe_run_uri`: the run URI is usable (write, read back, delete), or ConfigError;
* :func:`start_heartbeat`: the metrics, with the heartbeat thread running (phase ``starting``);
* :func:`build_parts`: meshes, the model (meta → parallelised → materialised), the optimizer, the
  data loader, the evaluator and the checkpoint manager, ready for the loop.

Every failure here is a ConfigError (exit 2) or, past the process groups, a peer lost (exit 75).
"""

from __future__ import annotations

import logging
import os
import uuid
from dataclasses import dataclass
from typing import Any

from orchestrator.contract import runuri
from trainer.errors import ConfigError

log = logging.getLogger("trainer")


def probe_run_uri(uri: str) -> None:
    """Write, read back and delete a small object under the run URI, or raise ConfigError."""
    probe = runuri.join(uri, f".dtrun-probe-{uuid.uuid4().hex[:8]}")
    try:
        runuri.write_text(probe, "ok")
        if runuri.read_text(probe) != "ok":
            raise OSError("read back a different value")
        runuri.remove(probe)
    except Exception as e:  # noqa: BLE001 - every storage error means "unusable"
        msg = str(e).splitlines()[0] if str(e) else ""
        raise ConfigError(f"run URI {uri} is not usable (write/read/delete failed): "
                          f"{type(e).__name__}: {msg[:300]}") from None


def check_data_vocab(data: str, vocab_size: int) -> None:
    """A job whose model vocabulary is smaller than its data's tokenizer (the ``data prepare``
    manifest beside ``trainer.data``) is refused: its token ids would index past the embedding."""
    from orchestrator.contract.dataset import read_manifest

    m = read_manifest(data)
    if m and int(m.get("vocab_size") or 0) > vocab_size:
        raise ConfigError(f"trainer.model: vocab_size {vocab_size} is smaller than the data's tokenizer "
                          f"({(m.get('tokenizer') or {}).get('name')}, {m['vocab_size']} tokens, manifest of "
                          f"{data}); use a model with vocab_size ≥ {m['vocab_size']}")


def check_job(spec: Any, world: int, rank: int) -> tuple[Any, int]:
    """``(ParallelDims, micro_batch)`` for the spec on ``world`` ranks, or ConfigError — before any
    process group."""
    from trainer.parallel import ParallelDims

    t = spec.trainer
    ms = t.model_spec
    dims = ParallelDims.from_spec(spec, world)
    dims.validate(ms)  # before any process group
    if t.batch_size % dims.dp:
        raise ConfigError(f"trainer.batch_size ({t.batch_size}) must be divisible by the data-parallel "
                          f"degree ({dims.dp})")
    mb = t.micro_batch_size or t.batch_size // dims.dp
    if t.batch_size % (dims.dp * mb):
        raise ConfigError(f"trainer.batch_size ({t.batch_size}) must be a multiple of micro_batch_size "
                          f"({mb}) × data-parallel degree ({dims.dp})")
    if dims.pp > 1:
        from trainer.pipeline import pp_config

        pp_config(spec, dims, mb)  # the schedule's refusals, before any process group
    if dims.cp > 1:
        _check_cp(dims, t.seq_len)
    if dims.tp > 1 and t.seq_len % dims.tp:
        raise ConfigError(f"trainer.seq_len ({t.seq_len}) must be divisible by tp ({dims.tp}): tensor "
                          "parallelism shards the sequence between blocks (sequence parallel)")
    if t.fp8:
        import importlib.util

        if dims.tp > 1:
            # Plain Colwise/RowwiseParallel on torchao's Float8Linear is untested and at best
            # leaves the TP collectives in bf16; torchao's Float8*Parallel styles are not wired in.
            raise ConfigError(f"trainer.fp8 with parallel.tp {dims.tp} is not supported (the float8 "
                              f"tensor-parallel styles are not wired in); use tp 1 or fp8: false")
        if importlib.util.find_spec("torchao") is None:
            raise ConfigError("trainer.fp8: true needs torchao (pip install torchao); it is not installed")
        if not t.compile and rank == 0:
            log.warning("trainer.fp8 without trainer.compile: torchao's float8 linears are slower than "
                        "bf16 uncompiled (torchao: compile is needed for competitive speed); set "
                        "trainer.compile: true")
    check_data_vocab(t.data, ms.vocab_size)
    import importlib.util

    for tracker, mod in (("tensorboard", "tensorboardX"), ("wandb", "wandb")):
        if tracker in t.trackers and importlib.util.find_spec(mod) is None:
            raise ConfigError(f"trainer.trackers: {tracker} needs the {mod} package (pip install {mod})")
    if t.eval_every and t.val_data is None and t.data == "synthetic":
        raise ConfigError("trainer.eval_every needs validation shards: set trainer.val_data or train on "
                          "`dtrun data prepare` output (its val_*.bin shards are used)")
    return dims, mb


def _check_cp(dims: Any, seq_len: int) -> None:
    """Context parallelism's refusals (trainer/context.py), before any process group."""
    cp = dims.cp
    if dims.ep > 1:
        raise ConfigError(f"trainer.parallel: cp ({cp}) > 1 with ep ({dims.ep}) > 1 is not supported by the "
                          "bundled trainer; use one of them")
    if seq_len % (2 * cp):
        raise ConfigError(f"trainer.seq_len ({seq_len}) must be divisible by 2 × trainer.parallel.cp = {2 * cp}: "
                          "context parallelism cuts the sequence into 2·cp head-tail balanced chunks")
    if dims.tp > 1 and (seq_len // cp) % dims.tp:
        raise ConfigError(f"trainer.seq_len ({seq_len}) / trainer.parallel.cp ({cp}) = {seq_len // cp} must be "
                          f"divisible by tp ({dims.tp}): tensor parallelism shards each rank's sequence slice")


def staging_mode(params: list) -> str:
    """``async``, or ``sync`` when the pinned staging copies of this node's ranks (fp32 weights
    + optimizer state: at most 3× the local parameter bytes, AdamW's) do not fit its available
    host memory. Every rank takes the same mode (one all-reduce)."""
    import torch
    import torch.distributed as dist

    from trainer.checkpoint import mem_available, staging_fits

    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in params) * 4
    ok, why = staging_fits(local * 3, int(os.environ.get("LOCAL_WORLD_SIZE", "1")), mem_available())
    flag = torch.tensor([1.0 if ok else 0.0])
    if dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if flag.item() >= 1:
        return "async"
    log.warning("checkpoint.async_mode async → sync (every rank saves the same way): %s", why)
    return "sync"


def _trackers(spec: Any, run_uri: str, rank: int, world: int):
    t = spec.trainer
    if not t.trackers or rank != 0:
        return None
    from trainer.trackers import Trackers

    return Trackers(t.trackers, run_uri=run_uri, job=spec.name,
                    attempt=int(os.environ.get("DTRUN_ATTEMPT", "0") or 0),
                    config={"model": str(t.model), "steps": t.total_steps, "batch_size": t.batch_size,
                            "seq_len": t.seq_len, "lr": t.lr, "world_size": world})


def start_heartbeat(spec: Any, run_uri: str, rank: int, world: int, device: Any):
    """Metrics with the heartbeat thread running (phase ``starting``): from here on rank 0
    rewrites progress.json every ``trainer.heartbeat_seconds``, whatever the main thread is
    doing (building the model, loading a checkpoint, compiling the first step)."""
    from trainer.metrics import Metrics, peak_flops

    t = spec.trainer
    metrics = Metrics(run_uri, rank=rank, steps=t.total_steps, world_size=world,
                      tokens_per_step=t.tokens_per_step, flops_per_token=t.model_spec.flops_per_token(t.seq_len),
                      peak_flops_per_rank=peak_flops(device.type), heartbeat_s=t.heartbeat_seconds,
                      log_every=t.log_every, stall_s=spec.recovery.heartbeat_timeout_seconds / 2,
                      trackers=_trackers(spec, run_uri, rank, world))
    step, committed = 0, None
    if rank == 0:
        try:  # until the resume, report the step it will most likely resume from
            lc = runuri.latest_committed(run_uri)
            if lc:
                step = committed = lc[0]
        except Exception:  # noqa: BLE001 - only a hint; the load decides
            pass
    metrics.start_heartbeat(step, committed)
    return metrics


@dataclass
class Parts:
    """What the loop trains with (:func:`build_parts`)."""

    model: Any
    params: list
    optimizer: Any
    loader: Any
    evaluator: Any  # None without validation shards
    ckpt: Any
    scaler: Any
    meshes: Any
    on_gpu: bool
    param_dtype: Any
    pipe: Any = None  # trainer.pipeline.Pipeline when pp > 1


def build_parts(spec: Any, dims: Any, mb: int, device: Any, rank: int, world: int, run_uri: str) -> Parts:
    """Seed, meshes, the model (meta → parallelise → materialise → initialise, or left for the
    checkpoint to fill), optimizer, data loader, evaluator and checkpoint manager."""
    import torch
    import torch.distributed as dist

    from trainer.checkpoint import CheckpointManager
    from trainer.distenv import collective_timeout
    from trainer.data import DataLoader, build_source, build_val_source
    from trainer.model import build_model
    from trainer.optim import build_optimizer
    from trainer.parallel import DynamicLossScaler, build_meshes, parallelize

    t = spec.trainer
    ms = t.model_spec
    torch.manual_seed(t.seed + rank)
    on_gpu = device.type == "cuda"
    param_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(t.precision) if on_gpu else None
    if on_gpu:
        torch.backends.cuda.matmul.allow_tf32 = True
    # fp16: dynamic loss scaling (also on CPU, where compute stays fp32: same maths, tested there).
    scaler = DynamicLossScaler(enabled=t.precision == "fp16")

    meshes = build_meshes(dims, device.type)
    raf = spec.trainer.parallel.reshard_after_forward if spec.trainer.parallel != "auto" else True
    pipe = None
    if dims.pp > 1:  # the stages of this rank (trainer/pipeline.py), named like the whole model
        from trainer import pipeline

        model, pipe = pipeline.build(spec, dims, meshes, pipeline.pp_config(spec, dims, mb), device=device,
                                     rank=rank, param_dtype=param_dtype, reshard_after_forward=raf)
    else:
        model = build_model(ms, device="meta")
        parallelize(model, dims, meshes, device=device, activation_checkpointing=t.activation_checkpointing,
                    compile=t.compile and on_gpu, fp8=t.fp8, param_dtype=param_dtype, reshard_after_forward=raf)
    if t.compile and not on_gpu and rank == 0:
        log.info("trainer.compile ignored on CPU")
    if pipe is None:
        model.to_empty(device=device)
    if ms.tie_embeddings and model.head.weight is not model.tok_emb.weight:
        model.head.weight = model.tok_emb.weight
    model.train()
    params = list(model.parameters())
    optimizer = build_optimizer(model, t, device)

    dp_rank = dims.dp_rank(rank)
    source = build_source(t.data, t.seq_len, ms.vocab_size, t.seed)
    loader = DataLoader(source, global_batch=t.batch_size, micro_batch=mb, dp_rank=dp_rank,
                        dp=dims.dp, device=device)
    from trainer.evaluate import Evaluator

    vsrc = build_val_source(t.data, t.val_data, t.seq_len, ms.vocab_size, t.seed)
    if pipe is not None and vsrc is not None:  # eval_every is refused under PP (pipeline.pp_config)
        if rank == 0:
            log.warning("validation shards found, but evaluation does not run under pp > 1 yet: no val_loss")
        vsrc = None
    if t.eval_every and vsrc is None:
        raise ConfigError(f"trainer.eval_every: no validation shards (val_*.bin) beside {t.data}; set "
                          f"trainer.val_data")
    evaluator = (Evaluator(vsrc, seq_len=t.seq_len, eval_tokens=t.eval_tokens, micro_batch=mb,
                           dp=dims.dp, dp_rank=dp_rank) if vsrc is not None else None)
    if evaluator is not None:
        evaluator.check()
    describe = {"dp_shard": dims.dp_shard, "tp": dims.tp, "ep": dims.ep, "replicate": dims.replicate,
                "dp_replicate": dims.dp_replicate}
    if pipe is not None:
        describe.update(pp=dims.pp, pp_schedule=pipe.cfg.schedule)
    if dims.cp > 1:
        describe.update(cp=dims.cp)
    async_mode = spec.checkpoint.async_mode
    if on_gpu and async_mode == "async":
        async_mode = staging_mode(params)
    ckpt = CheckpointManager(run_uri, keep=spec.checkpoint.keep, async_mode=async_mode,
                             rank=rank, world_size=world, dp_rank=dp_rank, describe=describe,
                             pinned=on_gpu, timeout=collective_timeout(spec))
    if scaler.enabled:
        ckpt.register("loss_scaler", scaler)
    if pipe is not None:  # this rank holds some of the model's names; the checkpoint holds them all
        keys: list = [None] * dims.pp
        dist.all_gather_object(keys, sorted(model.state_dict()), group=pipe.group)
        ckpt.whole_model_keys = {k for ks in keys for k in ks}
        ckpt.flat_optim = True  # param groups by name: each stage saves its own
    # Fresh start: each rank draws only its own shard of the initial weights (model.py). Resuming:
    # the checkpoint overwrites every parameter, so skip drawing them; buffers are still zeroed.
    model.init_weights(t.seed, params=not ckpt.committed_steps())
    return Parts(model=model, params=params, optimizer=optimizer, loader=loader, evaluator=evaluator,
                 ckpt=ckpt, scaler=scaler, meshes=meshes, on_gpu=on_gpu, param_dtype=param_dtype, pipe=pipe)
