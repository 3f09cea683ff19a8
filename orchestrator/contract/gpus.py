"""GPU facts: canonical names, memory and peak dense bf16 throughput (vendor data sheets)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GPU:
    name: str
    memory_gb: float
    """Device memory in GB (10^9 bytes, as vendors quote it)."""
    peak_bf16_flops: float
    """Dense bf16 tensor-core FLOP/s (no sparsity)."""
    fp8: bool = False
    """Hopper or newer: fp8 tensor cores."""


GPUS: dict[str, GPU] = {
    g.name: g
    for g in [
        GPU("B200", 180, 2.25e15, fp8=True),
        GPU("H200", 141, 989e12, fp8=True),
        GPU("GH200", 96, 989e12, fp8=True),
        # "H100" = an H100 of either form factor (a catalog that does not say which); the estimate
        # uses the SXM figure for it. The variants are what dtrun rents when the catalog tells
        # them apart (RunPod: H100 = PCIe, H100-SXM; Lambda/Vast: by instance type).
        GPU("H100", 80, 989e12, fp8=True),
        GPU("H100-SXM", 80, 989e12, fp8=True),
        GPU("H100-PCIe", 80, 756e12, fp8=True),
        GPU("A100-80GB", 80, 312e12),
        GPU("A100", 40, 312e12),
        GPU("L40S", 48, 362e12, fp8=True),
        GPU("A10", 24, 125e12),
        GPU("L4", 24, 121e12, fp8=True),
        GPU("RTX4090", 24, 165e12, fp8=True),
        GPU("T4", 16, 65e12),
        # The local provider's CPU "GPU": each rank is a process; the peak is a rough figure for
        # a few cores of fp32, used only so estimates of CPU runs are not absurd.
        GPU("cpu", 0, 5e10),
    ]
}

_ALIASES = {
    "H100-SXM5": "H100-SXM", "H100-80GB": "H100", "H100-PCIE": "H100-PCIe", "H100-80GB-PCIE": "H100-PCIe",
    "A100-SXM4-80GB": "A100-80GB", "A100-80G": "A100-80GB", "A100-40GB": "A100", "A100-40G": "A100",
    "RTX-4090": "RTX4090", "GEFORCE-RTX-4090": "RTX4090", "4090": "RTX4090",
    "CPU": "cpu",
}


def canonical_gpu(name: str) -> str | None:
    """Canonical GPU name for a user's or a catalog's spelling, or None when unknown."""
    key = name.strip()
    if key in GPUS:
        return key
    up = key.upper().replace("_", "-").replace(" ", "-")
    for k in GPUS:
        if k.upper() == up:
            return k
    return _ALIASES.get(up)


VARIANTS: dict[str, tuple[str, ...]] = {"H100": ("H100-SXM", "H100-PCIe")}
"""A family name and the variants it accepts (a spec's ``gpu: H100`` rents either; ``H100-SXM``
only the SXM). A100 (40 GB) and A100-80GB are distinct GPUs, not variants of one another."""


def gpu_matches(requested: str, offered: str) -> bool:
    """An offer of ``offered`` serves a spec asking for ``requested``."""
    return offered == requested or offered in VARIANTS.get(requested, ())


def is_variant(name: str) -> bool:
    return any(name in v for v in VARIANTS.values())


def gpu_family(name: str) -> str:
    """The family a GPU belongs to (``H100-SXM`` → ``H100``); a GPU without variants is its own."""
    for fam, variants in VARIANTS.items():
        if name in variants:
            return fam
    return name
