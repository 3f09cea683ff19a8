"""benchmarks/gpu_check.sh in its CPU smoke mode (gloo, tiny models, 2 ranks): every step of the
script runs end to end and the summary says ok — so the day a GPU is lent, the script itself is
known to work and only the figures are new. (Nothing here measures a GPU.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_gpu_check_smoke_mode_runs_every_step(tmp_path):
    env = {**os.environ, "GPU": "cpu", "MODEL": "tiny", "MOE_MODEL": "tiny-moe", "SEQ": "64", "MB": "2",
           "PRECISION": "fp32", "PY": sys.executable, "GPU_CHECK_OUT": str(tmp_path), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_check.sh"), "2", "3"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=900, check=False)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    checks = {c["check"]: c for c in summary["gpu_check"]}
    assert summary["ok"] and set(checks) >= {"versions", "bf16-1gpu", "resume", "sigterm", "moe-gemm", "bf16-2gpu",
                                             "tp2", "ep2", "pp2", "pp2-bubble", "cp2", "cp2-vs-cp1",
                                             "fp8-vs-bf16"}, summary
    assert checks["sigterm"]["exit_code"] in (75, 143) and checks["sigterm"]["committed"]
    assert checks["resume"]["done_step"] == 13
    assert checks["moe-gemm"]["grouped_mm"] > 0
    # pp 2 (1f1b, MB = 2 microbatches) through the trainer and `dtrun profile`: both bubble figures
    b = checks["pp2-bubble"]
    assert (b["schedule"], b["microbatches"], b["pp"]) == ("1f1b", 2, 2) and b["formula"] == 0.3333
    assert 0 <= b["measured"] < 1 and len(b["busy_s_per_rank"]) == 2
    assert checks["pp2"]["tokens_per_s"] > 0 and checks["cp2"]["tokens_per_s"] > 0
    # cp 2 against cp 1 on the same batch: the loss of the same step, within the fp32 tolerance
    c = checks["cp2-vs-cp1"]
    assert c["step"] == 20 and c["rel_diff"] <= 1e-4 and c["cp1_tokens_per_s"] > 0
