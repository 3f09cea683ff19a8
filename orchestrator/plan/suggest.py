"""What would fit when nothing does: the suggestion a refused plan carries.

A suggestion is checked the way the plan it follows was made (the caller passes that way in, as
``fits_on``), so it never proposes what was already tried:

- after ``ladder.plan`` (the ladder at the spec's own micro-batch and activation checkpointing):
  a bigger GPU or more nodes with the same settings, then full checkpointing or a smaller
  micro-batch on the same GPUs;
- after ``planner.auto_plan`` (micro-batch and checkpointing already searched): a bigger GPU or
  more nodes *with auto's search there* (so the node count is the smallest that auto would make
  fit), and checkpointing or micro-batch only where the user pinned them — what auto was free to
  change it already changed.

Node counts are tried from one more than asked up to :data:`MAX_NODES`, smallest first (counts at
which no layout is valid, e.g. a batch that does not divide, are skipped without planning).
Imports no planner module (they import this one).
"""

from __future__ import annotations

from typing import Any, Callable

from orchestrator.contract.gpus import GPUS
from orchestrator.plan.spec import JobSpec

MAX_NODES = 64
"""The largest node count a suggestion offers."""

FitsOn = Callable[[JobSpec, str, int, int], Any]
"""(spec, gpu, GPUs per node, nodes) → the plan that fits there (a ``MemoryPlan``), or None:
the same kind of plan as the one refused (the ladder's, or auto's search)."""


def _how(p: Any, searched: bool) -> str:
    """``fsdp-zero3+tp8 at 78.2 GB/GPU`` and, after auto, the micro-batch and checkpointing it would
    choose there when they differ from the job's."""
    out = f"{p.strategy} at {p.memory_per_gpu_gb:.1f} GB/GPU"
    if searched and p.auto and p.auto.get("changed"):
        out += f" (micro_batch_size {p.micro_batch_size}, activation_checkpointing {p.activation_checkpointing})"
    return out


def suggest_fit(spec: JobSpec, gpu: str, gpn: int, nodes: int, *, fits_on: FitsOn,
                layout_valid: Callable[[int], bool], pinned: dict[str, bool] | None = None) -> str:
    """Which GPU (same layout) or node count (same GPU; the smallest) would fit, and which of
    the settings left to change would fit the GPUs asked for.

    ``fits_on`` plans the way the refused plan was made; ``layout_valid(nodes)``: some layout is
    valid on that many nodes (cheap: no planning); ``pinned``: after auto, what the user wrote
    (``planner.pinned``) — None for the ladder, where every setting stays as written."""
    searched = pinned is not None
    pin = pinned if pinned is not None else {"micro_batch_size": True, "activation_checkpointing": True}
    t = spec.trainer
    parts: list[str] = []
    bigger = sorted((x for x in GPUS.values() if x.name != "cpu" and x.memory_gb > GPUS[gpu].memory_gb),
                    key=lambda x: (x.memory_gb, x.peak_bf16_flops))
    for cand in bigger:
        p = fits_on(spec, cand.name, gpn, nodes)
        if p is not None:
            parts.append(f"{cand.name} ({cand.memory_gb:g} GB) × {gpn * nodes} fits with {_how(p, searched)}")
            break
    for more in (m for m in range(nodes + 1, MAX_NODES + 1) if layout_valid(m)):
        p = fits_on(spec, gpu, gpn, more)
        if p is not None:
            parts.append(f"{more} nodes × {gpn} {gpu} fit with {_how(p, searched)}")
            break
    mb = t.micro_batch_size or max(1, t.batch_size // (gpn * nodes))
    can_cut_mb = pin["micro_batch_size"] and mb > 1
    can_ac = pin["activation_checkpointing"] and t.activation_checkpointing != "full"
    if not parts:
        left = (["micro_batch_size"] if can_cut_mb else []) + ["seq_len"]
        tried = [] if not searched else [x for x, free in (
            ("micro_batch_size 1", not pin["micro_batch_size"]),
            ("activation_checkpointing full", not pin["activation_checkpointing"])) if free]
        parts.append(f"no bigger GPU type or node count up to {MAX_NODES} fits"
                     + (f", even at {' with '.join(tried)} (auto tried them)" if tried else "")
                     + f"; reduce {' or '.join(left)}"
                     + (", or turn on activation_checkpointing: full" if can_ac else "")
                     + ", or train a smaller model")
    if can_ac:
        alt = spec.model_copy(deep=True)
        alt.trainer.activation_checkpointing = "full"
        p = fits_on(alt, gpu, gpn, nodes)
        if p is not None:
            parts.append(f"or activation_checkpointing: full fits as is ({p.strategy}, "
                         f"{p.memory_per_gpu_gb:.1f} GB/GPU)")
    while can_cut_mb and mb > 1:
        mb //= 2
        alt = spec.model_copy(deep=True)
        alt.trainer.micro_batch_size = mb  # gradient accumulation keeps the global batch
        p = fits_on(alt, gpu, gpn, nodes)
        if p is not None:
            parts.append(f"or trainer.micro_batch_size: {mb} fits as is ({p.strategy}, "
                         f"{p.memory_per_gpu_gb:.1f} GB/GPU"
                         + (f", activation_checkpointing {p.activation_checkpointing}" if searched else "") + ")")
            break
    return "; ".join(parts)
