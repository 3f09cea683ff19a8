"""MoE block forward + backward tokens/s on CPU (8 experts, top-2), this tree vs a baseline
revision of ``trainer/model.py`` (default: the commit before issue 12's MoE work), plus
``torch._dynamo.explain`` graph-break counts for a dense block and a MoE block without EP.

The block is ``trainer.model.Block`` of a MoE model (d_model 256, SwiGLU experts of 512, 8
experts, top-2, bias balancing), input (batch 8 × 256 tokens), fp32, one thread; both sides with today's default capacity factor
1.25, and this tree's dropless default (more tokens computed) against the same baseline; best of
``--rounds`` timed runs of ``--iters`` forward+backward passes after a warm-up.

    .venv/bin/python benchmarks/bench_moe.py [--baseline b68747c]

Prints one JSON object; target: speedup ≥ 3, graph breaks 0.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MOE = {"vocab_size": 256, "d_model": 256, "n_layers": 1, "n_heads": 8, "max_seq_len": 256, "mlp": "swiglu",
       "norm": "rmsnorm", "moe": {"n_experts": 8, "top_k": 2, "d_expert": 512, "balance": "bias", "capacity_factor": 1.25}}
DENSE = {"vocab_size": 256, "d_model": 256, "n_layers": 1, "n_heads": 8, "max_seq_len": 256, "mlp": "swiglu",
         "norm": "rmsnorm"}


def _load(rev: str | None):
    if rev is None:
        import trainer.model as m

        return m
    src = subprocess.run(["git", "show", f"{rev}:trainer/model.py"], cwd=REPO, check=True, capture_output=True,
                         text=True).stdout
    path = Path(tempfile.mkdtemp()) / "model_baseline.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("model_baseline", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def tokens_per_s(mod, spec_dict: dict, iters: int, rounds: int) -> float:
    import torch

    from orchestrator.plan.presets import ModelSpec

    torch.manual_seed(0)
    ms = ModelSpec.model_validate(spec_dict)
    block = mod.Block(ms, 0)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(8, 256, ms.d_model, requires_grad=True)
    g = torch.randn_like(x)
    for _ in range(3):
        (block(x) * g).sum().backward()
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(iters):
            (block(x) * g).sum().backward()
        best = min(best, time.perf_counter() - t)
    return iters * x.shape[0] * x.shape[1] / best


def graph_breaks(spec_dict: dict) -> int:
    import torch

    import trainer.model as m
    from orchestrator.plan.presets import ModelSpec

    ms = ModelSpec.model_validate(spec_dict)
    block = m.Block(ms, 0).to(torch.bfloat16)  # compile runs with bf16 compute (the GPU setting)
    torch._dynamo.reset()
    return torch._dynamo.explain(block)(torch.randn(2, 16, ms.d_model, dtype=torch.bfloat16)).graph_break_count


def main() -> None:
    import torch

    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", default="b68747c")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(1)
    base = tokens_per_s(_load(a.baseline), MOE, a.iters, a.rounds)
    now = tokens_per_s(_load(None), MOE, a.iters, a.rounds)
    dropless = {**MOE, "moe": {k: v for k, v in MOE["moe"].items() if k != "capacity_factor"}}
    now_dropless = tokens_per_s(_load(None), dropless, a.iters, a.rounds)
    res = {"benchmark": "moe", "device": "cpu", "threads": 1, "baseline": a.baseline,
           "baseline_tokens_per_s": round(base), "tokens_per_s": round(now), "speedup": round(now / base, 2),
           "dropless_tokens_per_s": round(now_dropless), "speedup_dropless_vs_baseline": round(now_dropless / base, 2),
           "graph_breaks_dense_block": graph_breaks(DENSE), "graph_breaks_moe_block": graph_breaks(MOE),
           "target": {"speedup": 3.0, "graph_breaks": 0}}
    print(json.dumps(res))


if __name__ == "__main__":
    main()
