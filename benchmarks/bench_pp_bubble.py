"""The pipeline bubble measured on CPU (torchrun, gloo, 2 ranks, pp 2) next to the planner's formula.

The bundled trainer's own pipeline (``trainer/build.build_parts`` → ``trainer/pipeline.Pipeline``)
on a small untied GPT (8 layers, d_model 256, seq 128, fp32, one thread per rank), one optimizer
step's forward + backward (``Pipeline.step``; no optimizer) for gpipe, 1f1b and interleaved-1f1b
(2 stages per rank) at m = 2, 4, 8 microbatches of a fixed 8-sequence batch. The reference is the
same model unpipelined in one process (pp 1 on rank 0 while rank 1 waits, the same 8 sequences as m
gradient-accumulation micro-batches, timed in the same world and interleaved with the pipelined
cases in rounds): with two ranks splitting the work evenly, a step without any idle time would take
half of it, so

    measured bubble = 1 − (T_pp1 / 2) / T_pp2          formula = (p − 1)/(m·v + p − 1)

The measured figure also holds the point-to-point sends and the per-microbatch overheads that the
formula leaves out, so it is the shape of the curve to compare (falling with m, lower interleaved),
not the absolute value. Median of ``--rounds`` × ``--steps`` timed steps after two warm-up steps per case.

    .venv/bin/python benchmarks/bench_pp_bubble.py [--steps 3] [--rounds 3]

Prints one JSON object (also the table in docs/benchmarks.md). About 1–2 minutes on 2 cores.
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
sys.path.insert(0, str(REPO))

MODEL = {"vocab_size": 256, "d_model": 256, "n_layers": 8, "n_heads": 8, "max_seq_len": 128,
         "tie_embeddings": False}
BATCH, SEQ = 8, 128
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")
MICRO = (2, 4, 8)


def _job(tmp: Path, name: str, nproc: int, parallel: dict, m: int) -> Path:
    import yaml

    spec = {"name": name, "resources": {"providers": ["local"], "gpu": "cpu", "gpus_per_node": nproc},
            "trainer": {"model": MODEL, "parallel": parallel, "steps": 100, "batch_size": BATCH,
                        "micro_batch_size": BATCH // m, "seq_len": SEQ, "precision": "fp32"},
            "checkpoint": {"uri": f"file://{tmp}/{name}/run", "every_steps": 1000}}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def worker(cases: list[tuple[str, str]], steps: int, rounds: int, out: str) -> None:
    """Inside torchrun (2 ranks): build every case once, then time them in interleaved rounds (the
    box is shared: interleaving spreads its load over every case alike). ``pp1-*``: rank 0 runs
    the whole model alone while rank 1 waits at the barrier."""
    import torch
    import torch.distributed as dist

    from orchestrator.plan.spec import load_spec
    from trainer.build import build_parts, check_job
    from trainer.model import build_model, loss_fn

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    built = {}
    for name, job in cases:
        spec = load_spec(job)
        if name.startswith("pp1"):
            m = spec.trainer.batch_size // spec.trainer.micro_batch_size
            model = build_model(spec.trainer.model_spec, device="cpu") if rank == 0 else None
            g = torch.Generator().manual_seed(0)
            data = [(torch.randint(0, MODEL["vocab_size"], (BATCH // m, SEQ), generator=g),) * 2 for _ in range(m)]
            built[name] = ("ref", model, data)
        else:
            dims, mb = check_job(spec, world, rank)
            built[name] = ("pp", build_parts(spec, dims, mb, torch.device("cpu"), rank, world, spec.run_uri), None)

    def step(name: str, s: int) -> None:
        kind, obj, data = built[name]
        if kind == "pp":
            obj.pipe.step(obj.loader.batches(s), obj.scaler, 0.0, obj.model)
            params = obj.params
        elif rank == 0:
            for x, y in data:
                loss, _ = loss_fn(obj(x), y, 0.0)
                (loss / len(data)).backward()
            params = list(obj.parameters())
        else:
            params = []
        for p in params:
            p.grad = None

    times: dict[str, list[float]] = {name: [] for name, _ in cases}
    for name, _ in cases:  # warm-up
        for s in range(2):
            step(name, s)
        dist.barrier()
    for r in range(rounds):
        for name, _ in cases:
            for s in range(steps):
                dist.barrier()
                t0 = time.perf_counter()
                step(name, 2 + r * steps + s)
                dist.barrier()
                times[name].append(time.perf_counter() - t0)
    for kind, obj, _ in built.values():
        if kind == "pp":
            obj.loader.close()
            obj.ckpt.close()
    if rank == 0:
        Path(out).write_text(json.dumps({k: statistics.median(v) for k, v in times.items()}))
    dist.destroy_process_group()


def _torchrun(nproc: int, cases: list[tuple[str, str]], steps: int, rounds: int, tmp: Path) -> dict[str, float]:
    out = tmp / f"times-{nproc}.json"
    cmd = [sys.executable, str(REPO / "infra" / "torchrun_launch.py"), "--standalone", f"--nproc-per-node={nproc}",
           str(Path(__file__).resolve()), "--worker", json.dumps(cases), "--steps", str(steps),
           "--rounds", str(rounds), "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise SystemExit(f"torchrun failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return json.loads(out.read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--worker")
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.worker:
        worker(json.loads(a.worker), a.steps, a.rounds, a.out)
        return 0
    from orchestrator.plan.pipeline import bubble_fraction

    t0 = time.time()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        ref = [(f"pp1-m{m}", str(_job(tmp, f"pp1-m{m}", 1, {"dp_shard": 1}, m))) for m in MICRO]
        piped = [(f"{s}-m{m}", str(_job(tmp, f"x{i}-m{m}", 2, {"dp_shard": 1, "pp": 2, "pp_schedule": s}, m)))
                 for i, s in enumerate(SCHEDULES) for m in MICRO]
        t = _torchrun(2, [c for m in MICRO for c in [ref[MICRO.index(m)]] + piped[MICRO.index(m)::len(MICRO)]],
                      a.steps, a.rounds, tmp)
        t1 = t2 = t
    rows = []
    for s in SCHEDULES:
        v = 2 if s == "interleaved-1f1b" else 1
        for m in MICRO:
            ref_s, pp_s = t1[f"pp1-m{m}"], t2[f"{s}-m{m}"]
            rows.append({"schedule": s, "m": m, "v": v, "pp1_step_s": round(ref_s, 4), "pp2_step_s": round(pp_s, 4),
                         "speedup": round(ref_s / pp_s, 3), "measured_bubble": round(1 - ref_s / (2 * pp_s), 3),
                         "formula_bubble": round(bubble_fraction(2, m, v, s), 3)})
    print(json.dumps({"model": MODEL, "batch": BATCH, "seq_len": SEQ, "steps": a.steps,
                      "wall_s": round(time.time() - t0, 1), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
