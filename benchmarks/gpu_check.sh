#!/usr/bin/env bash
# GPU checks for the trainer (issue 12). Needs CUDA GPUs, torch with NCCL, and (for the fp8 part)
# torchao. Not run in the CPU-only development session: results go into the README when run.
#
#   bash benchmarks/gpu_check.sh [NGPUS=8] [STEPS=60]
#
# 1. gpt2-124m, bf16 + torch.compile, synthetic data, seq 1024: tokens/s and MFU on 1 GPU and on
#    NGPUS GPUs (FSDP2), from progress.json (the trainer's own window rate and MFU).
# 2. Planner bytes vs torch.cuda.max_memory_allocated: the planner's modelled bytes for the same
#    job (without the 10% headroom and the fixed 2 GB CUDA-context allowance, which
#    max_memory_allocated does not see) against every rank's peak, reported by the trainer in DONE.
# 3. fp8 (torchao) vs bf16: final loss of the same 1-GPU run with trainer.fp8 true/false.
#
# Prints one JSON object per check; exit 1 if a run fails.
#
# Smoke test of the script itself on a CPU box (gloo; no MFU, no CUDA peaks, fp8 skipped):
#   GPU=cpu MODEL=tiny SEQ=64 MB=2 PRECISION=fp32 bash benchmarks/gpu_check.sh 2 3
set -euo pipefail
cd "$(dirname "$0")/.."
NGPUS=${1:-8}
STEPS=${2:-60}
PY=${PY:-.venv/bin/python}
MODEL=${MODEL:-gpt2-124m}
SEQ=${SEQ:-1024}
MB=${MB:-8}
PRECISION=${PRECISION:-bf16}
GPU=${GPU:-H100}  # what the planner prices and checks memory against (the job is run here, by torchrun)
if [ "$GPU" = cpu ]; then PROVIDER=local; else PROVIDER=${PROVIDER:-lambda}; fi
export PYTHONPATH=$PWD
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT

job() {  # name ngpus fp8 -> path of a job yaml
  local name=$1 n=$2 fp8=$3
  cat > "$OUT/$name.yaml" <<YAML
name: $name
resources: {providers: [$PROVIDER], gpu: $GPU, gpus_per_node: $n}
trainer:
  model: $MODEL
  parallel: {dp_shard: $n}
  steps: $STEPS
  batch_size: $((MB * n))
  micro_batch_size: $MB
  seq_len: $SEQ
  precision: $PRECISION
  compile: true
  fp8: $fp8
  lr: 6.0e-4
  warmup_steps: 10
  log_every: 10
  heartbeat_seconds: 5
checkpoint: {uri: "file://$OUT/run-$name", every_steps: 100000}
YAML
  echo "$OUT/$name.yaml"
}

run() {  # name ngpus fp8
  local j; j=$(job "$1" "$2" "$3")
  "$PY" infra/torchrun_launch.py --standalone --nproc-per-node="$2" -m trainer --job "$j" > "$OUT/$1.log" 2>&1 \
    || { tail -50 "$OUT/$1.log"; exit 1; }
}

report() {  # name ngpus
  "$PY" - "$OUT" "$1" "$2" <<'PYEOF'
import json, sys
from orchestrator.plan.planner import Parallel, evaluate_rung
from orchestrator.plan.spec import load_spec
out, name, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
prog = json.load(open(f"{out}/run-{name}/progress.json"))
done = json.load(open(f"{out}/run-{name}/DONE"))
spec = load_spec(f"{out}/{name}.yaml")
par = Parallel(dp_shard=n)
rung = evaluate_rung(spec, par, "single" if n == 1 else "fsdp-zero3", "gpu")
predicted = rung.memory_bytes - rung.breakdown["overhead"]
peaks = [r.get("cuda_max_allocated") for r in done["state_bytes_per_rank"]]
print(json.dumps({"check": name, "gpus": n, "tokens_per_s": prog.get("tokens_per_s"), "mfu": prog.get("mfu"),
                  "final_loss": done["loss"], "planner_bytes": predicted, "max_memory_allocated": peaks,
                  "planner_over_measured": round(predicted / max(peaks), 3) if all(peaks) else None,
                  "target_planner": "within 15%"}))
PYEOF
}

run bf16-1gpu 1 false; report bf16-1gpu 1
if [ "$NGPUS" -gt 1 ]; then run "bf16-${NGPUS}gpu" "$NGPUS" false; report "bf16-${NGPUS}gpu" "$NGPUS"; fi
if "$PY" -c "import torchao" 2>/dev/null; then
  run fp8-1gpu 1 true; report fp8-1gpu 1
  "$PY" - "$OUT" <<'PYEOF'
import json, sys
out = sys.argv[1]
a = json.load(open(f"{out}/run-bf16-1gpu/DONE"))["loss"]
b = json.load(open(f"{out}/run-fp8-1gpu/DONE"))["loss"]
print(json.dumps({"check": "fp8-vs-bf16", "bf16_loss": a, "fp8_loss": b, "rel_diff": round(abs(b - a) / a, 4),
                  "target": "fp8 final loss within 2% of bf16"}))
PYEOF
else
  echo '{"check": "fp8-vs-bf16", "skipped": "torchao not installed"}'
fi
