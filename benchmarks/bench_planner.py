"""Planner accuracy (GPU) and speed (anywhere).

Accuracy, on a CUDA machine: for ``gpt2-124m`` (all 12 layers) and ``llama3-8b`` (2 of its 32
layers, full vocab) at a few micro-batch sizes, one training step of the trainer's model
(``trainer.model.build_model`` + AdamW, one process = the planner's ``single`` rung) in fp32 and
under bf16 autocast; compare the planner's modelled bytes (params + grads + optimizer + gathered
+ activations, *without* the 10% headroom and the fixed CUDA-context overhead, which
``max_memory_allocated`` does not see) with ``torch.cuda.max_memory_allocated()``. Target: within
15%. Without CUDA the accuracy part prints ``not run`` (and the predictions it would check).

Speed: wall time of ``plan()`` (the dry run calls it) for every preset on 8×H100.

    .venv/bin/python benchmarks/bench_planner.py [--mbs 1,2,4] [--seq 1024]
"""

from __future__ import annotations

import argparse
import json
import time

from orchestrator.plan.planner import Parallel, evaluate_rung, plan
from orchestrator.plan.presets import PRESETS
from orchestrator.plan.spec import parse_spec


def spec_for(model, seq: int, mb: int, precision: str, gpu: str = "H100", gpn: int = 1):
    return parse_spec({
        "name": "bench-planner",
        "resources": {"providers": ["fake"], "gpu": gpu, "gpus_per_node": gpn},
        "trainer": {"model": model if isinstance(model, str) else model.model_dump(), "steps": 1,
                    "seq_len": seq, "batch_size": mb * gpn, "micro_batch_size": mb, "precision": precision,
                    "parallel": "auto"},
    })


def predicted_bytes(spec) -> int:
    r = evaluate_rung(spec, Parallel(dp_shard=1), "single", "gpu")
    return r.memory_bytes - r.breakdown["overhead"]


def measure(ms, seq: int, mb: int, precision: str) -> int:
    import torch

    from trainer.model import build_model, loss_fn

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model = build_model(ms, device="cuda", seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x = torch.randint(0, ms.vocab_size, (mb, seq + 1), device="cuda")
    ctx = torch.autocast("cuda", dtype=torch.bfloat16) if precision == "bf16" else torch.autocast("cuda", enabled=False)
    for _ in range(2):  # the second step has optimizer state from the start
        with ctx:
            loss, _ = loss_fn(model(x[:, :-1]), x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del model, opt
    return peak


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mbs", default="1,2,4")
    ap.add_argument("--seq", type=int, default=1024)
    a = ap.parse_args()
    mbs = [int(x) for x in a.mbs.split(",")]
    models = {"gpt2-124m": PRESETS["gpt2-124m"], "llama3-8b-2layers": PRESETS["llama3-8b"].model_copy(update={"n_layers": 2})}
    try:
        import torch

        cuda = torch.cuda.is_available()
    except ImportError:
        cuda = False
    rows = []
    for name, ms in models.items():
        for precision in ("fp32", "bf16"):
            for mb in mbs:
                pred = predicted_bytes(spec_for(ms, a.seq, mb, precision))
                row = {"model": name, "precision": precision, "micro_batch": mb, "seq": a.seq,
                       "predicted_gb": round(pred / 1e9, 3)}
                if cuda:
                    got = measure(ms, a.seq, mb, precision)
                    row.update(measured_gb=round(got / 1e9, 3), error=round(pred / got - 1, 4),
                               within_15pct=abs(pred / got - 1) <= 0.15)
                rows.append(row)
    speed = {}
    for name in PRESETS:
        s = spec_for(name, min(1024, PRESETS[name].max_seq_len), 1, "bf16", gpn=8)
        t0 = time.perf_counter()
        p = plan(s)
        speed[name] = {"ms": round((time.perf_counter() - t0) * 1000, 1), "strategy": p.strategy,
                       "memory_per_gpu_gb": round(p.memory_per_gpu_gb, 1)}
    print(json.dumps({
        "accuracy": rows if cuda else {"status": "not run: no CUDA device on this machine", "predictions": rows},
        "plan_latency_8xH100": speed,
    }, indent=2))


if __name__ == "__main__":
    main()
