"""Muon vs AdamW: training loss after the same number of tokens, ``tiny`` preset, CPU.

Runs the bundled trainer (``python -m trainer``, world size 1, fp32, synthetic data: arithmetic
progressions mod vocab with 10% noise) once per (optimizer, peak LR), same seed, same data order,
same schedule (warmup then cosine), and reads the loss curve from each run's ``metrics.jsonl``.
Reported per run: the mean training loss over the last 10% of steps (one step's loss is noisy)
and the loss at a few token counts; per optimizer the best LR. Muon's updates are scaled by
``0.2·sqrt(max(rows, cols))`` (trainer/optim.py), so one LR grid serves both.

    .venv/bin/python benchmarks/bench_muon.py [--steps 300] [--batch 16] [--seq 64] [--lrs 1e-3,3e-3,1e-2,3e-2,1e-1]

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def run(opt: str, lr: float, steps: int, batch: int, seq: int, tmp: Path) -> dict:
    name = f"muon-bench-{opt}-{str(lr).replace('.', 'p').replace('-', 'm')}"
    uri = "file://" + str(tmp / name)
    job = tmp / f"{name}.yaml"
    job.write_text(yaml.safe_dump({
        "name": name,
        "resources": {"providers": ["local"], "gpu": "cpu", "gpus_per_node": 1},
        "trainer": {"model": "tiny", "steps": steps, "batch_size": batch, "seq_len": seq, "precision": "fp32",
                    "optimizer": opt, "lr": lr, "warmup_steps": max(1, steps // 20), "log_every": 1,
                    "seed": 1234},
        "checkpoint": {"uri": uri, "every_steps": steps, "async_mode": "sync"},
    }))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.time()
    out = subprocess.run([sys.executable, "-m", "trainer", "--job", str(job)], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"{name} failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    rows = [json.loads(x) for x in (tmp / name / "metrics.jsonl").read_text().splitlines() if x.strip()]
    losses = [r["loss"] for r in rows]
    tail = losses[-max(1, len(losses) // 10):]
    tokens_per_step = batch * seq
    marks = {}
    for frac in (0.25, 0.5, 1.0):
        i = max(0, int(len(losses) * frac) - 1)
        marks[f"loss_at_{int(frac * 100)}pct_tokens"] = round(sum(losses[max(0, i - 4):i + 1]) / len(losses[max(0, i - 4):i + 1]), 4)
    return {"optimizer": opt, "lr": lr, "steps": steps, "tokens": steps * tokens_per_step,
            "final_loss_mean_last_10pct": round(sum(tail) / len(tail), 4), **marks,
            "wall_s": round(time.time() - t0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--lrs", default="1e-3,3e-3,1e-2,3e-2,1e-1")
    a = ap.parse_args()
    lrs = [float(x) for x in a.lrs.split(",")]
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-muon-") as tmp:
        for lr in lrs:
            for opt in ("adamw", "muon"):
                runs.append(run(opt, lr, a.steps, a.batch, a.seq, Path(tmp)))
                print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    best = {}
    for opt in ("adamw", "muon"):
        r = min((x for x in runs if x["optimizer"] == opt), key=lambda x: x["final_loss_mean_last_10pct"])
        best[opt] = {"lr": r["lr"], "final_loss": r["final_loss_mean_last_10pct"]}
    print(json.dumps({"model": "tiny", "device": "cpu", "tokens_per_run": runs[0]["tokens"], "runs": runs,
                      "best": best,
                      "muon_minus_adamw_best_loss": round(best["muon"]["final_loss"] - best["adamw"]["final_loss"], 4)},
                     indent=2))


if __name__ == "__main__":
    main()
