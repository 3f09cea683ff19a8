"""Fresh-start initialisation per rank: wall time and peak RSS, old vs new (issue 12, defect 10).

One child process per case simulates rank 0 of a world of W under FSDP2 (``dp_shard: W``) with
torch's fake process group (``backend="fake"``: no peers, no communication — neither init needs
any): build on meta, ``fully_shard``, ``to_empty``, then initialise. The child reports the seconds
spent initialising, its peak RSS (``ru_maxrss``), the RSS before the init, and the normal draws
made (``torch.Tensor.normal_`` counted).

* ``new``: ``GPT.init_weights`` — each rank draws only the tiles overlapping its shard.
* ``old``: the init before this change, reproduced below (one seeded CPU generator, every full
  parameter drawn in order, then ``distribute_tensor(src_data_rank=None)`` slices the local shard).

    .venv/bin/python benchmarks/bench_init.py            # gpt2-medium-sized (354M), W = 1, 2, 8
    .venv/bin/python benchmarks/bench_init.py --big      # also llama3-8b rank 0 of 8, new only (~5 GB)
    .venv/bin/python benchmarks/bench_init.py --child old 8 llama3-8b   # the old init there (minutes)

Prints one JSON object.
"""

from __future__ import annotations

import json
import math
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MEDIUM = {"vocab_size": 50304, "d_model": 1024, "n_layers": 24, "n_heads": 16, "max_seq_len": 1024,
          "pos": "learned", "tie_embeddings": True, "bias": True}


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def old_init_weights(model, seed: int) -> None:
    """The init this change replaced, reproduced for comparison."""
    import torch
    from torch.distributed.tensor import DTensor, distribute_tensor

    def copy_full(t, full):
        if isinstance(t, DTensor):
            local = distribute_tensor(full.to(t.dtype), t.device_mesh, t.placements, src_data_rank=None)
            t.to_local().copy_(local.to_local())
        else:
            t.copy_(full.to(device=t.device, dtype=t.dtype))

    with torch.no_grad():
        g = torch.Generator(device="cpu").manual_seed(seed)
        resid_std = 0.02 / math.sqrt(2 * model.spec.n_layers)
        for name, p in model.named_parameters():
            if name.endswith(".bias") or name.split(".")[-1] in ("b1", "b2", "b3"):
                copy_full(p, torch.zeros(p.shape))
            elif "norm" in name:
                copy_full(p, torch.ones(p.shape))
            else:
                std = resid_std if name.endswith(("wo.weight", "w2.weight", "experts.w2")) else 0.02
                copy_full(p, torch.empty(p.shape, dtype=torch.float32).normal_(0.0, std, generator=g))
        for _, b in model.named_buffers():
            copy_full(b, torch.zeros(b.shape))


def child(mode: str, world: int, model_name: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from orchestrator.plan.presets import PRESETS, ModelSpec
    from trainer.model import build_model
    from trainer.parallel import ParallelDims, build_meshes, parallelize

    spec = ModelSpec(**MEDIUM) if model_name == "medium" else PRESETS[model_name]
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    dims = ParallelDims(world, 1, 1, world)
    meshes = build_meshes(dims, "cpu")
    model = build_model(spec, device="meta")
    parallelize(model, dims, meshes, device=torch.device("cpu"))
    model.to_empty(device="cpu")
    if spec.tie_embeddings and model.head.weight is not model.tok_emb.weight:
        model.head.weight = model.tok_emb.weight
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())
    drawn = [0]
    real = torch.Tensor.normal_

    def counting(self, *a, **k):
        drawn[0] += self.numel()
        return real(self, *a, **k)

    torch.Tensor.normal_ = counting
    rss0 = _rss_mb()
    t0 = time.perf_counter()
    if mode == "new":
        model.init_weights(0)
    else:
        old_init_weights(model, 0)
    dt = time.perf_counter() - t0
    torch.Tensor.normal_ = real
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    print(json.dumps({"mode": mode, "world": world, "model": model_name, "params": spec.num_params(),
                      "local_params": local, "drawn": drawn[0], "init_s": round(dt, 2),
                      "rss_before_init_mb": round(rss0), "peak_rss_mb": round(peak),
                      "init_peak_over_before_mb": round(peak - rss0)}))
    dist.destroy_process_group()


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], int(sys.argv[3]), sys.argv[4])
        return
    cases = [(m, w, "medium") for w in (1, 2, 8) for m in ("old", "new")]
    if "--big" in sys.argv:
        cases += [("new", 8, "llama3-8b")]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    rows = []
    for mode, world, name in cases:
        out = subprocess.run([sys.executable, __file__, "--child", mode, str(world), name], cwd=REPO, env=env,
                             capture_output=True, text=True, check=False)
        if out.returncode != 0:
            raise SystemExit(f"{mode} world {world} {name} failed:\n{out.stderr[-3000:]}")
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    print(json.dumps({"rank": 0, "layout": "FSDP2 dp_shard = world (fake process group)",
                      "load_average": os.getloadavg()[0], "cases": rows}))


if __name__ == "__main__":
    main()
