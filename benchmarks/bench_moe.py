"""MoE forward + backward tokens/s on CPU (top-2), this tree vs a baseline revision of
``trainer/model.py`` (default b68747c: the per-expert loop before issue 12), with the compute
ceiling of each shape, plus ``torch._dynamo.explain`` graph-break counts for a dense block and a
MoE block without EP.

Measured, each on both sides with the same shape, dtype (fp32), one thread, capacity factor 1.25
(the baseline cannot run dropless; this tree's dropless default is reported next to it):

* ``block``: the issue's target — ``trainer.model.Block`` of a MoE model (d_model 256, 8 SwiGLU
  experts of 512, top-2, bias balancing), input 8 × 256 tokens.
* ``cases``: the MoE layer alone (router, dispatch, experts, combine) at that shape, at the
  repo's MoE presets (``tiny-moe``, ``moe-small``; one layer at their d_model/expert size) and at
  several tokens per expert.

Ceiling: both sides do the same expert matmuls (9 GEMMs per expert for forward + backward; the
rows are the routed tokens). ``gemm_ms`` times exactly those GEMMs, without autograd, routing or
activations, on equal per-expert splits; no fp32 one-core implementation can beat it, so
``ceiling_speedup = baseline time / gemm time`` (for the block: / (rest of the block + gemm)) is
the most any MoE rewrite can gain at that shape.

Timing: the process's CPU time (``time.process_time``) of ``--iters`` passes after a warm-up, in
``--rounds`` rounds interleaving the sides; best and median reported. CPU time, not wall time,
because the box is shared: with one thread it equals wall time on an idle core, and descheduled
time does not count against either side.

    .venv/bin/python benchmarks/bench_moe.py [--baseline b68747c] [--rounds 5]

Prints one JSON object; target: block speedup ≥ 3, graph breaks 0.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CAP = 1.25
MOE = {"vocab_size": 256, "d_model": 256, "n_layers": 1, "n_heads": 8, "max_seq_len": 256, "mlp": "swiglu",
       "norm": "rmsnorm", "moe": {"n_experts": 8, "top_k": 2, "d_expert": 512, "balance": "bias", "capacity_factor": CAP}}
DENSE = {"vocab_size": 256, "d_model": 256, "n_layers": 1, "n_heads": 8, "max_seq_len": 256, "mlp": "swiglu",
         "norm": "rmsnorm"}


def _cases() -> list[tuple[str, dict, tuple[int, int]]]:
    """(name, model spec, (batch, seq)) of the layer-alone cases."""
    from orchestrator.plan.presets import PRESETS

    def preset(name: str) -> dict:
        d = PRESETS[name].model_dump(exclude_none=True)
        d["moe"] = {**d["moe"], "capacity_factor": CAP}
        return d

    out = [("issue shape", MOE, (8, 256)),
           ("tiny-moe", preset("tiny-moe"), (8, 128)),
           ("moe-small", preset("moe-small"), (1, 2048))]
    for tokens in (256, 1024, 8192):  # tokens per expert = tokens · top_k / n_experts
        out.append((f"issue shape, {tokens} tokens", MOE, (tokens // 256, 256)))
    return out


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


def _dropless(spec: dict) -> dict:
    return {**spec, "moe": {k: v for k, v in spec["moe"].items() if k != "capacity_factor"}}


class _Pass:
    """One forward + backward of a module (a Block or a MoE layer) on a fixed input."""

    def __init__(self, mod, spec: dict, shape: tuple[int, int], layer: bool, ffn_only: bool = False):
        import torch

        from orchestrator.plan.presets import ModelSpec

        torch.manual_seed(0)
        ms = ModelSpec.model_validate(spec)
        self.m = mod.MoE(ms) if layer else mod.Block(ms, 0)
        for p in self.m.parameters():
            torch.nn.init.normal_(p, std=0.02)
        if ffn_only:  # the block without its MoE layer: what the rewrite did not touch
            self.m.ffn = torch.nn.Identity()
        self.x = torch.randn(*shape, ms.d_model, requires_grad=True)
        self.g = torch.randn_like(self.x)
        self.tokens = shape[0] * shape[1]

    def __call__(self) -> None:
        (self.m(self.x) * self.g).sum().backward()
        self.x.grad = None
        self.m.zero_grad(set_to_none=True)


class _Gemm:
    """Exactly the expert GEMMs of forward + backward (3 forward, 6 backward per expert for
    SwiGLU; 2 + 4 for a GELU MLP) on equal per-expert splits of the routed rows: no autograd,
    routing or activation."""

    def __init__(self, spec: dict, tokens: int):
        import torch

        from orchestrator.plan.presets import ModelSpec

        ms = ModelSpec.model_validate(spec)
        d, E, k, h = ms.d_model, ms.moe.n_experts, ms.moe.top_k, ms.expert_dim
        rows = tokens * k // E
        self.swiglu = ms.mlp == "swiglu"
        self.x = torch.randn(E, rows, d)
        self.w1, self.w3 = torch.randn(E, d, h), torch.randn(E, d, h)
        self.w2 = torch.randn(E, h, d)
        self.dy = torch.randn(E, rows, d)
        self.h = torch.randn(E, rows, h)
        n = 3 if self.swiglu else 2
        self.flops = 3 * n * 2 * E * rows * d * h
        self.tokens = tokens

    def __call__(self) -> None:
        for e in range(self.x.shape[0]):
            x, dy, hh = self.x[e], self.dy[e], self.h[e]
            x @ self.w1[e]
            hh @ self.w2[e]
            dh = dy @ self.w2[e].T
            hh.T @ dy
            x.T @ dh
            dh @ self.w1[e].T
            if self.swiglu:
                x @ self.w3[e]
                x.T @ dh
                dh @ self.w3[e].T


def _time(fns: dict, rounds: int, target_s: float = 0.4) -> dict[str, list[float]]:
    """Seconds per pass of each callable, ``rounds`` interleaved rounds (process CPU time)."""
    iters = {}
    for name, f in fns.items():
        f()  # warm-up
        t = time.process_time()
        f()
        one = max(time.process_time() - t, 1e-4)
        iters[name] = max(1, round(target_s / one))
    out: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, f in fns.items():
            t = time.process_time()
            for _ in range(iters[name]):
                f()
            out[name].append((time.process_time() - t) / iters[name])
    return out


def _row(times: dict[str, list[float]], tokens: int) -> dict:
    best = {k: min(v) for k, v in times.items()}
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "baseline_tokens_per_s": round(tokens / best["baseline"]),
        "tokens_per_s": round(tokens / best["new"]),
        "speedup": round(best["baseline"] / best["new"], 2),
        "speedup_median": round(med["baseline"] / med["new"], 2),
        "dropless_tokens_per_s": round(tokens / best["dropless"]),
        "speedup_dropless": round(best["baseline"] / best["dropless"], 2),
    }


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

    from orchestrator.plan.presets import ModelSpec

    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", default="b68747c")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="only the block and the issue shape")
    a = ap.parse_args()
    torch.set_num_threads(1)
    old, new = _load(a.baseline), _load(None)

    # The target: the whole block.
    shape = (8, 256)
    t = _time({"baseline": _Pass(old, MOE, shape, layer=False), "new": _Pass(new, MOE, shape, layer=False),
               "dropless": _Pass(new, _dropless(MOE), shape, layer=False),
               "rest": _Pass(new, MOE, shape, layer=False, ffn_only=True), "gemm": _Gemm(MOE, 2048)}, a.rounds)
    block = _row(t, 2048)
    block["ceiling_speedup"] = round(min(t["baseline"]) / (min(t["rest"]) + min(t["gemm"])), 2)

    cases = []
    for name, spec, shape in _cases()[: 1 if a.quick else None]:
        tokens = shape[0] * shape[1]
        gemm = _Gemm(spec, tokens)
        t = _time({"baseline": _Pass(old, spec, shape, layer=True), "new": _Pass(new, spec, shape, layer=True),
                   "dropless": _Pass(new, _dropless(spec), shape, layer=True), "gemm": gemm}, a.rounds)
        ms = ModelSpec.model_validate(spec)
        cases.append({"case": name, "d_model": ms.d_model, "n_experts": ms.moe.n_experts, "d_expert": ms.expert_dim,
                      "mlp": ms.mlp, "tokens": tokens,
                      "tokens_per_expert": tokens * ms.moe.top_k // ms.moe.n_experts, **_row(t, tokens),
                      "gemm_ms": round(min(t["gemm"]) * 1e3, 2),
                      "gemm_gflop_per_s": round(gemm.flops / min(t["gemm"]) / 1e9, 1),
                      "gemm_share_of_new": round(min(t["gemm"]) / min(t["new"]), 2),
                      "ceiling_speedup": round(min(t["baseline"]) / min(t["gemm"]), 2)})

    res = {"benchmark": "moe", "device": "cpu", "threads": 1, "dtype": "float32", "clock": "process_time",
           "baseline": a.baseline, "capacity_factor": CAP, "rounds": a.rounds,
           **{k: block[k] for k in ("baseline_tokens_per_s", "tokens_per_s", "speedup", "speedup_median",
                                    "dropless_tokens_per_s", "speedup_dropless", "ceiling_speedup")},
           "layer_cases": cases,
           "graph_breaks_dense_block": graph_breaks(DENSE), "graph_breaks_moe_block": graph_breaks(MOE),
           "target": {"speedup": 3.0, "graph_breaks": 0}}
    print(json.dumps(res))


if __name__ == "__main__":
    main()
