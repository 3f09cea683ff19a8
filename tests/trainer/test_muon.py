"""Muon: Newton–Schulz in bf16 vs fp32, the NS dtype chosen from the device, and the distributed
step (scatter to owners, NS, scatter back) under real torchrun/gloo: equal to one process's step,
and moving about one local momentum's bytes each way (the gather scheme moved ~3×)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import worlds_per_size

from trainer import optim
from trainer.optim import Muon, newton_schulz, ns_dtype_for

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("muon_dist_check.py")

# id, nproc, layout, ns_dtype, bucket_bytes
DIST_CASES = [
    ("fsdp-w3-uneven", 3, "fsdp", None, None),  # FSDP2 Shard(0), uneven shards (40 rows over 3 ranks)
    # dp2×tp2: 2-D mesh, _StridedShard + Shard(1); one matrix per bucket (pipeline)
    ("dptp-w4-buckets", 4, "dptp", "fp32", 1),
    # TP Shard(0)/Shard(1), replicated experts; bf16 NS and bf16 transfers
    ("tp-moe-w2-bf16", 2, "tp-moe", "bf16", None),
    ("ddp-w2", 2, "ddp", None, None),  # (Replicate, Shard(0)): the owner uses its own copy
    ("ep-moe-w4", 4, "ep-moe", None, None),  # ep 2: experts (_StridedShard(0), Shard(0)) stay local, the rest scatters
]


@pytest.fixture(scope="module")
def muon_worlds(request, tmp_path_factory):
    """``muon_worlds(nproc)``: one torchrun world per size for every selected case of that size, in
    turn in one process group (tests/trainer/muon_dist_check.py): a torch start-up per size."""
    return worlds_per_size(request, tmp_path_factory.mktemp("muon"), WORKER, [
        (n, {"name": name, "layout": layout, "ns_dtype": ns, "bucket_bytes": bucket})
        for name, n, layout, ns, bucket in DIST_CASES])


def test_newton_schulz_in_bf16_is_orthogonal_and_close_to_fp32():
    g = torch.Generator().manual_seed(0)
    for shape in [(64, 128), (128, 64), (3, 32, 48)]:
        x = torch.randn(*shape, generator=g)
        o32 = newton_schulz(x)
        o16 = newton_schulz(x, dtype=torch.bfloat16)
        assert o32.dtype == torch.float32 and o16.dtype == torch.bfloat16
        s = torch.linalg.svdvals(o16.float())
        assert torch.allclose(s, torch.ones_like(s), atol=2e-2), s
        assert float((o16.float() - o32).norm() / o32.norm()) < 0.03


def test_ns_dtype_follows_the_device_and_can_be_overridden(monkeypatch):
    assert ns_dtype_for("cuda") == torch.bfloat16 and ns_dtype_for(torch.device("cuda", 3)) == torch.bfloat16
    assert ns_dtype_for("cpu") == torch.float32
    seen = []
    real = optim.newton_schulz

    def spy(g, *a, **k):
        seen.append(k.get("dtype"))
        return real(g, *a, **k)

    monkeypatch.setattr(optim, "newton_schulz", spy)
    for dtype, want in [(None, torch.float32), (torch.bfloat16, torch.bfloat16)]:
        w = torch.nn.Parameter(torch.randn(32, 48))
        w.grad = torch.randn(32, 48)
        before = w.detach().clone()
        Muon([{"params": [w], "kind": "muon"}], lr=0.1, momentum=0.0, ns_dtype=dtype).step()
        assert seen[-1] == want
        assert w.dtype == torch.float32
        s = torch.linalg.svdvals((before - w.detach()) / (0.1 * 0.2 * 48 ** 0.5))
        assert torch.allclose(s, torch.ones_like(s), atol=2e-2)


@pytest.mark.slow
@pytest.mark.parametrize("name,nproc,layout", [c[:3] for c in DIST_CASES], ids=[c[0] for c in DIST_CASES])
def test_distributed_muon_equals_one_process_and_moves_one_shard_each_way(muon_worlds, name, nproc, layout):
    world = muon_worlds(nproc)
    rc, out = world.case(name)
    assert rc == 0, out[-3000:]
    res = [json.loads((world.dir(name) / f"rank{r}.json").read_text()) for r in range(nproc)]
    for r in res:
        # The same full matrix reaches NS as in one process: the parameters after two steps
        # (momentum, weight decay, AdamW groups too) equal the one-process run's.
        assert r["max_diff"] <= 1e-6, r
        mom = r["momentum_bytes"]
        assert mom > 0
        for st in r["steps"]:
            # Only all_to_all_single; ≤ ~1.1× the local momentum shards each way (sent and received),
            # where gathering every full matrix on every rank (and broadcasting NS results) received ~3×.
            assert st["recv"] <= 2.2 * mom and st["sent"] <= 2.2 * mom, (st, mom)
            assert st["ops"] == ["alltoall_base_"], st
    if layout == "fsdp":
        assert len({tuple(map(tuple, r["local_shapes"])) for r in res}) > 1  # shards really are uneven
