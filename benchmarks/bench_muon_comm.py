"""Distributed Muon step: the scatter scheme (trainer/optim.py: shards → owner by
all_to_all_single, NS on the owner, shards back) vs the gather scheme it replaced (every rank
gathers every full matrix with ``full_tensor()``, the owner runs NS and broadcasts the result —
still in optim.py as the fallback for meshes no process group spans; forced here), FSDP2 on a
gloo world of 2 (default), CPU, fp32 NS.

Per scheme: median ``Muon.step`` wall time over the timed steps (the median of ``--rounds``
alternating runs: the box is shared), and the bytes each rank handed
to / got from collectives per step (counted at the c10d op level with a TorchDispatchMode, as
tests/trainer/test_muon.py does), next to the rank's local momentum bytes.

    .venv/bin/python benchmarks/bench_muon_comm.py [--nproc 2] [--d-model 512] [--layers 4] [--steps 6] [--rounds 3]

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def worker(scheme: str, d_model: int, layers: int, steps: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    from orchestrator.plan.presets import ModelSpec
    from trainer import optim
    from trainer.model import build_model
    from trainer.parallel import ParallelDims, build_meshes, parallelize

    def nbytes(x):
        return sum(t.numel() * t.element_size() for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor))

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.sent = self.recv = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            res = func(*args, **(kwargs or {}))
            name = func._schema.name.split("::")[-1]
            if func.namespace in ("c10d", "_c10d_functional"):
                if name == "alltoall_base_":
                    self.sent += nbytes(args[1])
                    self.recv += nbytes(args[0])
                elif name == "all_gather_into_tensor":
                    self.sent += nbytes(args[0])
                    self.recv += nbytes(res)
                elif name == "broadcast_":
                    b = nbytes(args[0])
                    if args[2] == dist.get_rank():  # the world group here: group rank = rank
                        self.sent += b
                    else:
                        self.recv += b
            return res

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    if scheme == "gather":
        optim._scatterable = lambda u: None  # every sharded matrix through the gather + broadcast path
    spec = ModelSpec.model_validate({"vocab_size": 256, "d_model": d_model, "n_layers": layers,
                                     "n_heads": max(1, d_model // 64), "max_seq_len": 64, "mlp": "swiglu",
                                     "tie_embeddings": False})
    dims = ParallelDims(world, 1, 1, world)
    meshes = build_meshes(dims, "cpu")
    model = build_model(spec, device="meta")
    parallelize(model, dims, meshes, device=torch.device("cpu"))
    model.to_empty(device="cpu")
    model.init_weights(0)
    mats, _, _ = optim.param_groups(model)
    opt = optim.Muon([{"params": mats, "kind": "muon"}], lr=0.01, ns_dtype=torch.float32)
    gen = torch.Generator().manual_seed(rank)
    for p in mats:
        p.grad = DTensor.from_local(torch.randn(p.to_local().shape, generator=gen), p.device_mesh, p.placements,
                                    run_check=False, shape=p.shape, stride=p.stride())
    times, count = [], None
    for i in range(steps + 1):
        dist.barrier()
        c = Count()
        t0 = time.perf_counter()
        with c:
            opt.step()
        dist.barrier()
        times.append(time.perf_counter() - t0)
        count = c
    mom = sum(p.to_local().numel() * 4 for p in mats)
    res = {"rank": rank, "step_s_median": statistics.median(times[1:]), "sent": count.sent, "recv": count.recv,
           "momentum_bytes": mom, "matrices": len(mats)}
    Path(out, f"{scheme}-rank{rank}.json").write_text(json.dumps(res))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3, help="gather/scatter runs alternate; the median round counts")
    ap.add_argument("--worker", default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.worker:
        worker(a.worker, a.d_model, a.layers, a.steps, a.out)
        return
    result = {"world": a.nproc, "d_model": a.d_model, "layers": a.layers, "device": "cpu", "ns_dtype": "fp32"}
    rounds: dict[str, list[dict]] = {"gather": [], "scatter": []}
    for i in range(a.rounds):
        for scheme in (("gather", "scatter") if i % 2 == 0 else ("scatter", "gather")):
            rounds[scheme].append(_launch(a, scheme))
    for scheme, rs in rounds.items():
        r = sorted(rs, key=lambda x: x["step_s_median"])[len(rs) // 2]
        result[scheme] = {**r, "step_s_rounds": [x["step_s_median"] for x in rs]}
    result["speedup"] = round(result["gather"]["step_s_median"] / result["scatter"]["step_s_median"], 2)
    print(json.dumps(result, indent=2))


def _launch(a: argparse.Namespace, scheme: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-muon-comm-") as tmp:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={a.nproc}",
               __file__, "--worker", scheme, "--out", tmp, "--d-model", str(a.d_model),
               "--layers", str(a.layers), "--steps", str(a.steps)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800, check=False)
        if p.returncode:
            raise SystemExit(f"{scheme} failed:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
        ranks = [json.loads(Path(tmp, f"{scheme}-rank{r}.json").read_text()) for r in range(a.nproc)]
    mom = max(r["momentum_bytes"] for r in ranks)
    return {
        "step_s_median": round(max(r["step_s_median"] for r in ranks), 4),
        "sent_per_rank_MB": round(max(r["sent"] for r in ranks) / 1e6, 3),
        "recv_per_rank_MB": round(max(r["recv"] for r in ranks) / 1e6, 3),
        "momentum_per_rank_MB": round(mom / 1e6, 3),
        "recv_over_momentum": round(max(r["recv"] for r in ranks) / mom, 2),
        "matrices": ranks[0]["matrices"],
    }


if __name__ == "__main__":
    main()
