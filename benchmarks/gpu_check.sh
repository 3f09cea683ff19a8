#!/usr/bin/env bash
# GPU checks for the trainer (issues 12, 25 and 32): what only a GPU can show. Needs CUDA GPUs, torch
# with NCCL, and (for the fp8 step) torchao. Not yet run: no GPU was lent to the development
# sessions. About 12 minutes on 1–2 H100/H200 with the defaults (an estimate).
#
#   bash benchmarks/gpu_check.sh [NGPUS=2] [STEPS=40]
#
# Steps (each prints one JSON line; the last line is the summary of all of them):
#  versions   driver (nvidia-smi), torch and its CUDA, cuda.is_available, device, NCCL, Python
#  bf16-1gpu  $MODEL bf16 + compile, 1 GPU, async checkpoints every 10 steps (pinned staging):
#             tokens/s and MFU (causal attention FLOPs), planner bytes (no headroom, no fixed
#             allowance) vs every rank's max_memory_allocated AND max_memory_reserved, the loop's
#             checkpoint stall per save, and the device memory outside the allocator (driver view −
#             reserved: CUDA context, NCCL buffers) against the planner's fixed 2 GB
#  resume     the same run URI, 10 more steps: resumed from the last COMMITTED step, DONE reached,
#             final loss (GPU runs are not bitwise reproducible: the loss is reported, not compared)
#  sigterm    SIGTERM to torchrun mid-run: exit 75, progress.json "preempted", the stopped step
#             COMMITTED (the emergency save through pinned staging)
#  moe-gemm   one moe-small MoE layer fwd+bwd under bf16 autocast on 1 GPU: profiler counts of
#             aten::_grouped_mm vs aten::mm (the grouped GEMM must be taken: no per-expert loop)
#  bf16-Ngpu  FSDP2 on NGPUS GPUs (NGPUS > 1): tokens/s, MFU, planner vs reserved
#  tp2, ep2   (NGPUS ≥ 2) $MODEL with tp 2, $MOE_MODEL with ep 2, compile, under
#             TORCH_LOGS=graph_breaks,recompiles: graph breaks and recompiles counted from the log
#  pp2        (2 GPUs) $MODEL untied (pipeline stages cannot share the embedding), pp 2 1f1b,
#             $PP_MICROBATCHES microbatches: tokens/s, MFU, planner vs reserved; then `dtrun profile`
#             of the same job: the measured pipeline bubble next to the formula (reported; ok when
#             it is measured, the figure is not held to a bound)
#  cp2        (2 GPUs) $MODEL with cp 2 vs the same job at cp 1 on one GPU (same batch and
#             micro-batches): tokens/s of both, final loss equal within $CP_TOL (relative)
#  (pp2 and cp2 print a "skipped" line with the reason when fewer than 2 GPUs are there)
#  fp8        fp8 (torchao) vs bf16: final loss of the same 1-GPU run (skipped without torchao)
#
# Exit 1 if a run fails or a step's expectation does not hold (the summary says which).
#
# Smoke test of the script itself on a CPU box (gloo; no MFU, no CUDA peaks, fp8 skipped; CI runs
# it through tests/e2e/test_gpu_check_smoke.py):
#   GPU=cpu MODEL=tiny MOE_MODEL=tiny-moe SEQ=64 MB=2 PRECISION=fp32 bash benchmarks/gpu_check.sh 2 3
set -euo pipefail
cd "$(dirname "$0")/.."
NGPUS=${1:-2}
STEPS=${2:-40}
PY=${PY:-.venv/bin/python}
MODEL=${MODEL:-gpt2-124m}
MOE_MODEL=${MOE_MODEL:-moe-small}
SEQ=${SEQ:-1024}
MB=${MB:-8}
PRECISION=${PRECISION:-bf16}
GPU=${GPU:-H100}  # what the planner prices and checks memory against (the job is run here, by torchrun)
PP_MICROBATCHES=${PP_MICROBATCHES:-$MB}  # of the 2·MB sequences per step: MB microbatches of 2
if [ "$PRECISION" = fp32 ]; then CP_TOL=${CP_TOL:-1e-4}; else CP_TOL=${CP_TOL:-2e-2}; fi
if [ "$GPU" = cpu ]; then PROVIDER=local; COMPILE=false; else PROVIDER=${PROVIDER:-lambda}; COMPILE=true; fi
export PYTHONPATH=$PWD DTRUN_PARAM_DIGEST=${DTRUN_PARAM_DIGEST:-0}
OUT=${GPU_CHECK_OUT:-$(mktemp -d)}
mkdir -p "$OUT"
[ -n "${GPU_CHECK_OUT:-}" ] || trap 'rm -rf "$OUT"' EXIT
SUMMARY="$OUT/summary.jsonl"
: > "$SUMMARY"
say() { echo "$1"; echo "$1" >> "$SUMMARY"; }

job() {  # name ngpus model steps parallel fp8 every [batch] -> path of a job yaml
  local name=$1 n=$2 model=$3 steps=$4 par=$5 fp8=$6 every=$7 batch=${8:-$((MB * $2))}
  cat > "$OUT/$name.yaml" <<YAML
name: $name
resources: {providers: [$PROVIDER], gpu: $GPU, gpus_per_node: $n}
trainer:
  model: $model
  parallel: $par
  steps: $steps
  batch_size: $batch
  micro_batch_size: $MB
  seq_len: $SEQ
  precision: $PRECISION
  compile: $COMPILE
  fp8: $fp8
  lr: 6.0e-4
  warmup_steps: 10
  log_every: 5
  heartbeat_seconds: 2
  collective_timeout_seconds: 300
checkpoint: {uri: "file://$OUT/run-$name", every_steps: $every}
YAML
  echo "$OUT/$name.yaml"
}

launch() {  # ngpus job log  (foreground)
  "$PY" infra/torchrun_launch.py --standalone --nproc-per-node="$1" -m trainer --job "$2" > "$3" 2>&1
}

run() {  # name ngpus model steps parallel fp8 every
  local j; j=$(job "$@")
  launch "$2" "$j" "$OUT/$1.log" || { tail -50 "$OUT/$1.log"; say "{\"check\": \"$1\", \"ok\": false, \"error\": \"run failed\"}"; exit 1; }
}

report() {  # name ngpus strategy
  say "$("$PY" - "$OUT" "$1" "$2" "$3" <<'PYEOF'
import json, re, sys
from orchestrator.plan.ladder import evaluate_rung
from orchestrator.plan.memory import FIXED_OVERHEAD_BYTES
from orchestrator.plan.spec import load_spec
out, name, n, strategy = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
prog = json.load(open(f"{out}/run-{name}/progress.json"))
done = json.load(open(f"{out}/run-{name}/DONE"))
spec = load_spec(f"{out}/{name}.yaml")
par = spec.trainer.parallel
rung = evaluate_rung(spec, par, strategy, "gpu")
predicted = rung.memory_bytes - rung.breakdown["overhead"]
ranks = [r or {} for r in done["state_bytes_per_rank"]]
alloc = [r.get("cuda_max_allocated") for r in ranks]
resv = [r.get("cuda_max_reserved") for r in ranks]
used = [r.get("cuda_device_used") for r in ranks]
log = open(f"{out}/{name}.log", errors="replace").read()
rec = {"check": name, "gpus": n, "tokens_per_s": prog.get("tokens_per_s"), "mfu": prog.get("mfu"),
       "mfu_counts": "6·N + 6·L·d·T (causal attention)", "final_loss": done["loss"],
       "checkpoint_stall_s": done.get("checkpoint_stall_s"), "planner_bytes": predicted,
       "max_memory_allocated": alloc, "max_memory_reserved": resv,
       "planner_over_reserved": round(predicted / max(resv), 3) if all(resv) else None,
       "planner_over_allocated": round(predicted / max(alloc), 3) if all(alloc) else None,
       "device_used": used,  # the driver's view at the last step: reserved + CUDA context + NCCL buffers
       "outside_allocator_gb": round(max(u - r for u, r in zip(used, resv)) / 1e9, 2) if all(used) and all(resv) else None,
       "planner_fixed_gb": FIXED_OVERHEAD_BYTES / 1e9,  # what the planner allows for it
       "graph_breaks": len(re.findall(r"Graph break", log)), "recompiles": len(re.findall(r"Recompiling", log)),
       "target_planner": "reserved within 15% of the planner"}
rec["ok"] = rec["planner_over_reserved"] is None or abs(rec["planner_over_reserved"] - 1) <= 0.15
print(json.dumps(rec))
PYEOF
)"
}

# -- versions ------------------------------------------------------------------------------------
say "$("$PY" - <<'PYEOF'
import json, platform, subprocess
import torch
rec = {"check": "versions", "torch": torch.__version__, "torch_cuda": torch.version.cuda,
       "cuda_available": torch.cuda.is_available(), "python": platform.python_version()}
try:
    rec["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,name", "--format=csv,noheader"],
                                   capture_output=True, text=True, timeout=30).stdout.strip().splitlines()
except OSError:
    rec["driver"] = None
if torch.cuda.is_available():
    rec["device"] = torch.cuda.get_device_name(0)
    rec["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
rec["ok"] = True
print(json.dumps(rec))
PYEOF
)"

# -- 1 GPU: throughput, memory, async pinned checkpoints, resume ----------------------------------
run bf16-1gpu 1 "$MODEL" "$STEPS" "{dp_shard: 1}" false 10; report bf16-1gpu 1 single
cp "$OUT/bf16-1gpu.yaml" "$OUT/resume.yaml"
sed -i "s/^  steps: .*/  steps: $((STEPS + 10))/" "$OUT/resume.yaml"
launch 1 "$OUT/resume.yaml" "$OUT/resume.log" || { tail -50 "$OUT/resume.log"; say '{"check": "resume", "ok": false}'; exit 1; }
say "$("$PY" - "$OUT" "$STEPS" <<'PYEOF'
import json, sys
out, steps = sys.argv[1], int(sys.argv[2])
log = open(f"{out}/resume.log", errors="replace").read()
done = json.load(open(f"{out}/run-bf16-1gpu/DONE"))
ok = f"resumed from checkpoint step {steps}" in log and done["step"] == steps + 10
print(json.dumps({"check": "resume", "resumed_from": steps, "done_step": done["step"], "final_loss": done["loss"],
                  "ok": ok}))
PYEOF
)"

# -- SIGTERM → emergency checkpoint → exit 75 ----------------------------------------------------
j=$(job sigterm 1 "$MODEL" $((STEPS * 50)) "{dp_shard: 1}" false 10)
"$PY" infra/torchrun_launch.py --standalone --nproc-per-node=1 -m trainer --job "$j" > "$OUT/sigterm.log" 2>&1 &
pid=$!
"$PY" - "$OUT" <<'PYEOF'
import sys, time
from orchestrator.contract import runuri
uri = f"file://{sys.argv[1]}/run-sigterm"
end = time.time() + 600
while time.time() < end:
    try:
        p = runuri.read_json(runuri.join(uri, "progress.json")) or {}
    except (OSError, ValueError):
        p = {}
    if p.get("step", 0) >= 13 and (p.get("last_committed_step") or 0) >= 10:
        break
    time.sleep(0.2)
PYEOF
t0=$(date +%s.%N)
kill -TERM "$pid"
code=0; wait "$pid" || code=$?
say "$("$PY" - "$OUT" "$code" "$t0" <<'PYEOF'
import json, sys, time
from orchestrator.contract import runuri
out, code, t0 = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
uri = f"file://{out}/run-sigterm"
p = runuri.read_json(runuri.join(uri, "progress.json")) or {}
rec = {"check": "sigterm", "exit_code": code, "exit_s": round(time.time() - t0, 1), "status": p.get("status"),
       "step": p.get("step"), "committed": runuri.committed(uri, p.get("step", -1)) is not None}
rec["ok"] = code in (75, 143) and rec["status"] == "preempted" and rec["committed"]  # 143: torchrun itself got the signal (the bootstrap maps it to 75)
print(json.dumps(rec))
PYEOF
)"

# -- MoE: grouped GEMM under autocast on one GPU ------------------------------------------------
say "$("$PY" - "$MOE_MODEL" <<'PYEOF'
import json, sys
import torch
from torch.profiler import ProfilerActivity, profile
from orchestrator.plan.presets import resolve_model
from trainer.model import build_model
ms = resolve_model(sys.argv[1])
dev = "cuda" if torch.cuda.is_available() else "cpu"
model = build_model(ms, device=dev)
model.init_weights(0)
moe = model.moe_layers()[0]
x = torch.randn(4, 256, ms.d_model, device=dev, requires_grad=True)
acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
with profile(activities=acts) as prof:
    with torch.autocast(dev, dtype=torch.bfloat16):
        y = moe(x)
    y.float().sum().backward()
names = [e.name for e in prof.events()]
rec = {"check": "moe-gemm", "device": dev, "grouped_mm": names.count("aten::_grouped_mm"),
       "mm": names.count("aten::mm"), "tolist_syncs": names.count("aten::item") + names.count("aten::_local_scalar_dense")}
rec["ok"] = rec["grouped_mm"] > 0
print(json.dumps(rec))
PYEOF
)"

# -- several GPUs: FSDP2, TP, EP with compile ---------------------------------------------------
if [ "$NGPUS" -gt 1 ]; then
  run "bf16-${NGPUS}gpu" "$NGPUS" "$MODEL" "$STEPS" "{dp_shard: $NGPUS}" false 100000
  report "bf16-${NGPUS}gpu" "$NGPUS" fsdp-zero3
  export TORCH_LOGS=graph_breaks,recompiles
  run tp2 2 "$MODEL" 20 "{dp_shard: 1, tp: 2}" false 100000; report tp2 2 fsdp-zero3+tp2
  run ep2 2 "$MOE_MODEL" 20 "{dp_shard: 2, ep: 2}" false 100000; report ep2 2 fsdp-zero3+ep2
  unset TORCH_LOGS
fi

# -- pipeline (pp 2, 1f1b) and context (cp 2) parallel on 2 GPUs -------------------------------
if [ "$GPU" = cpu ]; then HAVE=$NGPUS; else HAVE=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true); fi
if [ "$NGPUS" -lt 2 ] || [ "${HAVE:-0}" -lt 2 ]; then
  why="needs 2 GPUs: NGPUS=$NGPUS"; [ "$GPU" = cpu ] || why="$why, nvidia-smi lists $HAVE"
  say "{\"check\": \"pp2\", \"skipped\": \"$why\", \"ok\": true}"
  say "{\"check\": \"cp2\", \"skipped\": \"$why\", \"ok\": true}"
else
  # The model untied: a pipeline cannot put one embedding weight on its first and last stage.
  UNTIED=$("$PY" -c "import json, sys; from orchestrator.plan.presets import resolve_model
print(json.dumps(resolve_model(sys.argv[1]).model_copy(update={'tie_embeddings': False}).model_dump(exclude_none=True)))" "$MODEL")
  run pp2 2 "$UNTIED" 20 "{dp_shard: 1, pp: 2, pp_schedule: 1f1b, pp_microbatches: $PP_MICROBATCHES}" false 100000
  report pp2 2 pp2
  "$PY" -m orchestrator.cli.app profile "$OUT/pp2.yaml" --steps "$((STEPS < 10 ? STEPS : 10))" --json \
    > "$OUT/pp2-profile.json" 2> "$OUT/pp2-profile.log" \
    || { tail -30 "$OUT/pp2-profile.log"; say '{"check": "pp2-bubble", "ok": false, "error": "dtrun profile failed"}'; exit 1; }
  say "$("$PY" - "$OUT" <<'PYEOF'
import json, sys
res = json.load(open(f"{sys.argv[1]}/pp2-profile.json"))
b = res.get("pipeline_bubble") or {}
rec = {"check": "pp2-bubble", "measured": b.get("measured"), "formula": b.get("formula"),
       "schedule": b.get("schedule"), "microbatches": b.get("microbatches"), "pp": b.get("pp"),
       "pipelined_step_s": b.get("pipelined_step_seconds"), "busy_s_per_rank": b.get("busy_seconds_per_rank"),
       "profile_tokens_per_s": res.get("tokens_per_s"), "profile_mfu": res.get("mfu"),
       "target": "reported: the measured bubble next to (p-1)/(m+p-1); sends and unequal stages add to it"}
rec["ok"] = isinstance(b.get("measured"), float) and 0 <= b["measured"] < 1
print(json.dumps(rec))
PYEOF
)"
  run cp2 2 "$MODEL" 20 "{dp_shard: 1, cp: 2}" false 100000 $((2 * MB)); report cp2 2 cp2
  run cp1 1 "$MODEL" 20 "{dp_shard: 1}" false 100000 $((2 * MB))
  say "$("$PY" - "$OUT" "$CP_TOL" <<'PYEOF'
import json, sys
out, tol = sys.argv[1], float(sys.argv[2])
a, b = (json.load(open(f"{out}/run-{n}/DONE")) for n in ("cp1", "cp2"))
ta, tb = (json.load(open(f"{out}/run-{n}/progress.json")).get("tokens_per_s") for n in ("cp1", "cp2"))
rec = {"check": "cp2-vs-cp1", "step": b["step"], "cp1_loss": a["loss"], "cp2_loss": b["loss"],
       "rel_diff": abs(b["loss"] - a["loss"]) / abs(a["loss"]), "cp1_tokens_per_s": ta, "cp2_tokens_per_s": tb,
       "target": f"cp 2 loss within {tol:g} (relative) of cp 1 at the same step, same batch"}
rec["ok"] = a["step"] == b["step"] and rec["rel_diff"] <= tol
print(json.dumps(rec))
PYEOF
)"
fi

# -- fp8 vs bf16 -------------------------------------------------------------------------------
if [ "$GPU" != cpu ] && "$PY" -c "import torchao" 2>/dev/null; then
  run fp8-1gpu 1 "$MODEL" "$STEPS" "{dp_shard: 1}" true 100000; report fp8-1gpu 1 single
  say "$("$PY" - "$OUT" <<'PYEOF'
import json, sys
out = sys.argv[1]
a = json.load(open(f"{out}/run-bf16-1gpu/DONE"))["loss"]  # (resumed: 10 steps more than fp8's run)
b = json.load(open(f"{out}/run-fp8-1gpu/DONE"))["loss"]
a = [json.loads(l) for l in open(f"{out}/run-bf16-1gpu/metrics.jsonl") if '"loss"' in l]
step = json.load(open(f"{out}/run-fp8-1gpu/DONE"))["step"]
a = next((r["loss"] for r in a if r.get("step") == step), a[-1]["loss"])
rec = {"check": "fp8-vs-bf16", "bf16_loss": a, "fp8_loss": b, "rel_diff": round(abs(b - a) / a, 4),
       "target": "fp8 loss within 2% of bf16 at the same step"}
rec["ok"] = rec["rel_diff"] <= 0.02
print(json.dumps(rec))
PYEOF
)"
else
  say '{"check": "fp8-vs-bf16", "skipped": "no CUDA or no torchao", "ok": true}'
fi

"$PY" - "$SUMMARY" <<'PYEOF'
import json, sys
checks = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
failed = [c["check"] for c in checks if not c.get("ok", True)]
print(json.dumps({"gpu_check": checks, "failed": failed, "ok": not failed}))
sys.exit(1 if failed else 0)
PYEOF
