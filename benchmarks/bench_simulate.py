"""`dtrun simulate jobs/gpt2-124m.yaml` on spot at 1 preemption per hour.

Targets (issue "money and leaks"):
  * goodput (useful GPU time ÷ paid GPU time) ≥ 95 %
  * the dry run's expected cost (before the buffer) within 10 % of the simulated mean cost
  * the buffered estimate ≥ the simulated 95th percentile cost
  * orphan instance-seconds = 0
  * 200 runs in seconds

The job says ``spot: prefer``; at 1 preemption/h the plan ranks an on-demand offer first (in
the price snapshot spot costs the same as on-demand), so this benchmark pins ``spot: true`` to
measure what the issue asks: the spot run.

Measured 2026-11-29 on the 2-core dev box (load ~6), 200 runs, seed 0, vast/H100x8/spot $16/h:
  cost mean $15.20, p50 $13.18, p95 $18.93; expected $15.05 (−0.9 %), buffered $21.59 (≥ p95)
  (after the estimate adopted N = λW/(1−λℓ) and the p95-count floor; before: $15.96, $19.16);
  goodput 70.6 % (p5 55.4 %) — 94.9 % counting only paid time after provisioning + setup;
  1.72 attempts, 0.72 preemptions, 168 steps lost per run; 0 orphan instance-seconds;
  Young/Daly (241 steps vs the job's 500): mean $15.14, p95 $18.69; 14-24 s for 200 runs (load).
  The goodput target cannot be met by this job: it computes for 39 min and every start pays
  10 min (4 provisioning + 5 setup + 1 compile), so even a run with no preemption is at 79.7 %.

Re-measured 2026-12-01 with the snapshot's start-up figures (vast, prebuilt image: 6 min a start):
  expected $13.28 vs mean $13.37, buffered $17.33 ≥ p95 $15.85, goodput 79.4 %, 0 orphans.
``--scenario long``, 200 runs, 2026-12-01: prebuilt image 200/200 SUCCEEDED, goodput 0.878,
  expected $218.03 vs mean $218.37, buffered $261.64 ≥ p95 $229.36, 0 orphans; reinstall on
  every start: goodput 0.817, mean $235.04. (docs/benchmarks.md.)

Usage: python benchmarks/bench_simulate.py [--runs 200] [--rate 1.0] [--seed 0] [--job PATH]
       python benchmarks/bench_simulate.py --scenario long [--runs 200]
Prints one JSON object.

``--scenario long`` (issue 14): gpt2-1.5b for ~12 h of compute on 8×H100 spot (RunPod, Vast),
micro-batch 16, checkpoint interval Young/Daly, one preemption per hour, run twice: with the
prebuilt node image (resources.image: default) and reinstalling torch on every start
(resources.image: none). Targets for the prebuilt run: no run FAILED, goodput ≥ 0.90, expected
cost within 10 % of the simulated mean, buffered estimate ≥ the simulated p95, 0 orphan seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


LONG_JOB = {
    "name": "gpt2-1p5b-12h",
    "resources": {"providers": ["runpod", "vast"], "gpu": "H100", "gpus_per_node": 8, "spot": True},
    "trainer": {"model": "gpt2-1.5b", "tokens": 14_600_000_000, "batch_size": 512, "micro_batch_size": 16,
                "seq_len": 1024, "compile": True, "parallel": "auto"},
    "checkpoint": {"uri": "s3://bench-bucket/{name}", "every_steps": "auto"},
    "budget": {"max_usd": 5000, "max_hours": 48},
}
KEEP_LONG = ("runs", "elapsed_s", "offer", "price_per_hour", "states", "failed_runs", "failed_reasons",
             "wall_hours_mean", "cost_usd_mean", "cost_usd_p95", "expected_usd", "estimate_usd",
             "expected_vs_simulated_mean", "goodput_mean", "goodput_p5", "training_goodput_mean", "attempts_mean",
             "attempts_max", "preemptions_mean", "soft_preemptions_mean", "work_lost_steps_mean",
             "orphan_instance_seconds", "checkpoint_every_steps", "startup", "step_seconds", "steps")


def long_scenario(runs: int, rate: float, seed: int) -> dict:
    from orchestrator.plan.spec import parse_spec
    from orchestrator.run.simulate import simulate

    out = {}
    for label, image in (("prebuilt_image", "default"), ("reinstall_every_start", "none")):
        d = json.loads(json.dumps(LONG_JOB))
        d["resources"]["image"] = image
        r = simulate(parse_spec(d), rate, runs, seed)
        ratio = r["expected_usd"] / r["cost_usd_mean"]
        r["targets"] = {
            "no_run_failed": r["failed_runs"] == 0,
            "goodput_ge_90pct": r["goodput_mean"] >= 0.90,
            "expected_within_10pct_of_mean": abs(ratio - 1) <= 0.10,
            "estimate_ge_p95": r["estimate_usd"] >= r["cost_usd_p95"],
            "no_orphans": r["orphan_instance_seconds"] == 0,
        }
        out[label] = {k: r[k] for k in KEEP_LONG + ("targets",)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenario", choices=("short", "long"), default="short")
    ap.add_argument("--job", default=str(ROOT / "jobs" / "gpt2-124m.yaml"))
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--rate", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    os.environ.setdefault("DTRUN_HOME", tempfile.mkdtemp(prefix="dtrun-bench-"))
    if args.scenario == "long":
        print(json.dumps(long_scenario(args.runs, args.rate, args.seed), indent=1, default=float))
        return

    from orchestrator.run.simulate import compare_young_daly, simulate
    from orchestrator.plan.spec import load_spec

    spec = load_spec(args.job)
    spec = spec.model_copy(update={"resources": spec.resources.model_copy(update={"spot": True})})
    out = simulate(spec, args.rate, args.runs, args.seed)
    out["young_daly"] = compare_young_daly(spec, out, args.rate, args.runs, args.seed)
    ratio = out["expected_usd"] / out["cost_usd_mean"]
    out["targets"] = {
        "goodput_ge_95pct": out["goodput_mean"] >= 0.95,
        "expected_within_10pct_of_mean": abs(ratio - 1) <= 0.10,
        "estimate_ge_p95": out["estimate_usd"] >= out["cost_usd_p95"],
        "no_orphans": out["orphan_instance_seconds"] == 0,
    }
    keep = ("runs", "elapsed_s", "offer", "price_per_hour", "preemptions_per_hour", "states", "wall_hours_mean",
            "wall_hours_p95", "cost_usd_mean", "cost_usd_p50", "cost_usd_p95", "cost_usd_max", "expected_usd",
            "estimate_usd", "expected_vs_simulated_mean", "goodput_mean", "goodput_p5", "training_goodput_mean",
            "attempts_mean", "attempts_max", "preemptions_mean", "work_lost_steps_mean", "budget_exceeded_runs",
            "orphan_instance_seconds", "checkpoint_every_steps", "young_daly_every_steps", "young_daly",
            "startup_seconds", "step_seconds", "steps", "poll_seconds", "targets")
    print(json.dumps({k: out[k] for k in keep}, indent=1, sort_keys=False, default=float))


if __name__ == "__main__":
    main()
