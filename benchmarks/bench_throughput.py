"""Throughput: the bundled trainer's tokens/s ÷ a plain single-file PyTorch loop, same model, same run.

Both train the ``tiny`` preset's shape (d_model 64, 2 layers, 4 heads, vocab 256, rotary, tied,
GELU MLP, bias-free LayerNorm) with AdamW on batch × seq_len tokens per step, fp32, one process
each on this machine's CPU (the bundled trainer as ``python -m trainer`` at world size 1; the
plain loop is below, nanoGPT style, with its own model code). Runs alternate (plain, trainer,
plain, trainer, …); ``ratio`` is best ÷ best (the machine is shared), and the median of the
per-round ratios is printed too. The trainer's
rate comes from its metrics.jsonl between the first and the last logged step (start-up, the
first steps and the final checkpoint excluded); the plain loop skips the same warm-up steps.

    .venv/bin/python benchmarks/bench_throughput.py [--steps 60] [--batch 16] [--seq 128]

Prints one JSON object; target: ratio ≥ 0.95.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def plain_loop(steps: int, batch: int, seq: int, warmup: int) -> float:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    torch.manual_seed(0)
    V, D, L, H = 256, 64, 2, 4

    def rope(x):
        T, hd = x.shape[1], x.shape[-1]
        inv = 1.0 / (10000 ** (torch.arange(0, hd // 2).float() / (hd // 2)))
        ang = torch.outer(torch.arange(T).float(), inv)
        cos, sin = ang.cos()[None, :, None], ang.sin()[None, :, None]
        x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.n1, self.n2 = nn.LayerNorm(D, bias=False), nn.LayerNorm(D, bias=False)
            self.q, self.k, self.v, self.o = (nn.Linear(D, D, bias=False) for _ in range(4))
            self.fc, self.proj = nn.Linear(D, 4 * D, bias=False), nn.Linear(4 * D, D, bias=False)

        def forward(self, x):
            B, T, _ = x.shape
            h = self.n1(x)
            q, k, v = (m(h).view(B, T, H, D // H) for m in (self.q, self.k, self.v))
            q, k = rope(q), rope(k)
            y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
            x = x + self.o(y.transpose(1, 2).reshape(B, T, D))
            return x + self.proj(F.gelu(self.fc(self.n2(x))))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(V, D)
            self.blocks = nn.ModuleList(Block() for _ in range(L))
            self.norm = nn.LayerNorm(D, bias=False)
            self.head = nn.Linear(D, V, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, idx):
            x = self.emb(idx)
            for b in self.blocks:
                x = b(x)
            return self.head(self.norm(x))

    model = GPT()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95), foreach=True)
    data = torch.randint(0, V, (steps, batch, seq + 1))
    t0 = None
    for s in range(steps):
        if s == warmup:
            t0 = time.perf_counter()
        x, y = data[s, :, :-1], data[s, :, 1:]
        loss = F.cross_entropy(model(x).float().view(-1, V), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return (steps - warmup) * batch * seq / (time.perf_counter() - t0)


def trainer_run(steps: int, batch: int, seq: int, warmup: int) -> float:
    import yaml

    with tempfile.TemporaryDirectory() as tmp:
        job = Path(tmp) / "job.yaml"
        job.write_text(yaml.safe_dump({
            "name": "bench", "resources": {"providers": ["local"], "gpu": "cpu", "gpus_per_node": 1},
            "trainer": {"model": "tiny", "parallel": {"dp_shard": 1}, "steps": steps, "batch_size": batch,
                        "seq_len": seq, "precision": "fp32", "lr": 3e-3, "log_every": warmup,
                        "heartbeat_seconds": 3600},
            "checkpoint": {"uri": f"{tmp}/run", "every_steps": 100000},
        }))
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        subprocess.run([sys.executable, "-m", "trainer", "--job", str(job)], cwd=REPO, env=env, check=True,
                       stdout=subprocess.DEVNULL)
        rows = [json.loads(x) for x in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
        first, last = rows[0], rows[-1]
        return (last["step"] - first["step"]) * batch * seq / (last["time"] - first["time"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--plain", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.plain:
        print(plain_loop(a.steps, a.batch, a.seq, a.warmup))
        return
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    plain, trainer = [], []
    for _ in range(a.rounds):
        out = subprocess.run([sys.executable, __file__, "--plain", "--steps", str(a.steps), "--batch", str(a.batch),
                              "--seq", str(a.seq), "--warmup", str(a.warmup)], env=env, check=True,
                             capture_output=True, text=True).stdout
        plain.append(float(out.strip().splitlines()[-1]))
        trainer.append(trainer_run(a.steps, a.batch, a.seq, a.warmup))
    res = {"benchmark": "throughput", "device": "cpu", "model": "tiny", "batch": a.batch, "seq_len": a.seq,
           "steps": a.steps, "omp_threads": env["OMP_NUM_THREADS"],
           "plain_tokens_per_s": [round(x, 1) for x in plain], "trainer_tokens_per_s": [round(x, 1) for x in trainer],
           "ratio": round(max(trainer) / max(plain), 3),
           "ratio_median_of_rounds": round(sorted(t / p for t, p in zip(trainer, plain))[len(plain) // 2], 3),
           "target": 0.95}
    print(json.dumps(res))
    assert not math.isnan(res["ratio"])


if __name__ == "__main__":
    main()
