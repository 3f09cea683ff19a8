"""The device and the process groups of a trainer process (train.py and profiling.py share them).

* **No silent CPU fallback**: a spec that asks for a GPU (``resources.gpu`` other than ``cpu``)
  gets CUDA or a ``ConfigError`` (exit 2) naming the reason — a CPU build of torch, a driver too
  old for the build's CUDA, fewer visible GPUs than ranks on the node. Never eight billed GPUs
  idle while the job trains on CPU/gloo.
* **Bounded collectives**: every process group gets ``trainer.collective_timeout_seconds``
  (torch's default for ``"cpu:gloo,cuda:nccl"`` is 30 minutes, not NCCL's 10: see
  ``distributed_c10d._get_default_timeout``); NCCL's asynchronous error handling is on
  (``TORCH_NCCL_ASYNC_ERROR_HANDLING``, torch's default mode 3: a timed-out NCCL collective tears
  the process down instead of leaving it blocked in a CUDA sync).
* the CUDA caching allocator uses expandable segments (:data:`ALLOC_CONF`) unless told otherwise.
* :func:`peer_lost` tells a failed collective (a rank on another node died, or hung past the
  timeout) from the trainer's own errors: the survivors then exit 75 ("resume me"), and the
  attempt resumes from the last COMMITTED checkpoint.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

from trainer.errors import ConfigError

NCCL_ASYNC_ERROR_HANDLING = "3"
"""``TORCH_NCCL_ASYNC_ERROR_HANDLING`` when the environment does not set it: 3 (SkipCleanUp) tears
the process down at a collective timeout without ``ncclCommAbort`` (which can itself hang); the
mode torch documents as its default, set explicitly so an image's environment cannot turn it off
unnoticed (0 would leave a rank blocked forever)."""

# gloo reports a vanished peer as a plain RuntimeError: these are its transport's messages
# (checked against torch 2.13: "[…/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting
# 3000ms for recv operation to complete", "Connection closed by peer", ECONNRESET, EPIPE).
_PEER_LOST_MARKERS = ("gloo/transport", "Connection closed by peer", "Connection reset by peer",
                      "Broken pipe", "Timed out waiting", "NCCL communicator was aborted",
                      "Watchdog caught collective operation timeout")


def cuda_problem(gpu: str, local_world: int, torch_mod: Any = None) -> str | None:
    """Why this node cannot run ``local_world`` ranks of a ``gpu`` job on CUDA (None: it can)."""
    torch = torch_mod
    if torch is None:
        import torch
    build_cuda = getattr(torch.version, "cuda", None)
    if build_cuda is None:
        return (f"resources.gpu is {gpu} but this torch ({torch.__version__}) is a CPU-only build; "
                f"install the CUDA build (check `python -c 'import torch; print(torch.version.cuda)'`)")
    if not torch.cuda.is_available():
        return (f"resources.gpu is {gpu} but CUDA is not usable (torch {torch.__version__}, built for CUDA "
                f"{build_cuda}): no GPU visible, or the driver is older than CUDA {build_cuda} needs; "
                f"check `nvidia-smi` (driver version, CUDA_VISIBLE_DEVICES)")
    n = torch.cuda.device_count()
    if n < local_world:
        return (f"resources.gpu is {gpu}: {local_world} ranks on this node but only {n} GPU(s) visible; "
                f"check `nvidia-smi` and CUDA_VISIBLE_DEVICES, or resources.gpus_per_node")
    return None


def select_device(spec: Any, local_rank: int, torch_mod: Any = None):
    """The rank's device: ``cuda:<local_rank>`` when the spec asks for a GPU (or ConfigError,
    exit 2, when CUDA cannot serve it), ``cpu`` when it says ``gpu: cpu`` or, explicitly,
    ``trainer.device: cpu``."""
    import torch

    gpu = spec.resources.gpu
    if gpu == "cpu" or spec.trainer.device == "cpu":
        return torch.device("cpu")
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    why = cuda_problem(gpu, local_world, torch_mod)
    if why:
        raise ConfigError(why)
    use_expandable_segments()
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    return device


ALLOC_CONF = "expandable_segments:True"
"""The CUDA caching allocator's setting unless the environment has one: FSDP2's all-gather and
reduce-scatter buffers on side streams and EP's per-step token counts fragment fixed segments, so
``reserved`` runs well above ``allocated``; expandable segments grow in place (torchtitan sets it)."""


def use_expandable_segments() -> bool:
    """Expandable segments for this process's CUDA allocator (before its first allocation),
    unless ``PYTORCH_ALLOC_CONF``/``PYTORCH_CUDA_ALLOC_CONF`` says otherwise. True if set here."""
    import torch

    if os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF"):
        return False
    os.environ["PYTORCH_ALLOC_CONF"] = ALLOC_CONF  # read at the allocator's first use; children inherit it
    torch.cuda.memory._set_allocator_settings(ALLOC_CONF)  # in case it is already initialised
    return True


def collective_timeout(spec: Any) -> timedelta:
    return timedelta(seconds=float(spec.trainer.collective_timeout_seconds))


def init_distributed(spec: Any, device) -> None:
    """``init_process_group`` with the spec's collective timeout (gloo on CPU; nccl + gloo for
    CPU tensors and object collectives on GPU), NCCL's async error handling on."""
    import torch.distributed as dist

    on_gpu = device.type == "cuda"
    if on_gpu:
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", NCCL_ASYNC_ERROR_HANDLING)
    dist.init_process_group(backend="cpu:gloo,cuda:nccl" if on_gpu else "gloo",
                            device_id=device if on_gpu else None, timeout=collective_timeout(spec))


def peer_lost(e: BaseException) -> bool:
    """True when ``e`` is a collective that failed because another rank is gone or hung past the
    collective timeout (not this rank's own error)."""
    import torch.distributed as dist

    from trainer.errors import CheckpointUnavailable

    if isinstance(e, (ConfigError, CheckpointUnavailable)):  # the trainer's own verdicts
        return False
    if isinstance(e, dist.DistError):  # DistBackendError, DistNetworkError, DistStoreError
        return True
    failures = getattr(e, "failures", None)  # DCP's CheckpointException: {rank: exception}
    if isinstance(failures, dict):
        inner = [x[0] if isinstance(x, tuple) else x for x in failures.values()]
        return any(isinstance(x, BaseException) and peer_lost(x) for x in inner)
    return isinstance(e, RuntimeError) and any(m in str(e) for m in _PEER_LOST_MARKERS)
