"""``dtrun weights`` on gpt2-124m from a 4-rank FSDP checkpoint: seconds and peak memory.

Makes the checkpoint with the real trainer (torchrun, 4 CPU ranks, FSDP2 over gloo, one AdamW step,
so the checkpoint holds model + optimizer state sharded 4 ways, ≈1.5 GB on local disk), then runs
``dtrun weights`` as a child process for each format and reads the child's peak resident memory
(``wait4`` rusage) beside the size of the model it wrote. A bare ``python -c "import torch"`` is
measured too: the floor any torch process pays. Each format runs with the default read group
(256 MB of checkpoint per ``dcp.load``) and with 32 MB (``DTRUN_EXPORT_GROUP_MB``): the memory
follows the group (and the largest single tensor: the 154 MB embedding), not the model.

    .venv/bin/python benchmarks/bench_weights.py

Prints one JSON object.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def _run(cmd: list[str], env: dict) -> tuple[float, float, str]:
    """(seconds, peak RSS MB, output) of a child process."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    _, status, ru = os.wait4(p.pid, 0)
    dt = time.perf_counter() - t0
    out = p.stdout.read().decode(errors="replace")
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{cmd} failed:\n{out[-3000:]}")
    return dt, ru.ru_maxrss / 1024.0, out


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="dtrun-bench-weights-"))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    try:
        job = tmp / "job.yaml"
        job.write_text(yaml.safe_dump({
            "name": "bench-weights", "resources": {"providers": ["local"], "gpu": "cpu", "gpus_per_node": 4},
            "trainer": {"model": "gpt2-124m", "parallel": {"dp_shard": 4, "tp": 1}, "steps": 1, "batch_size": 4,
                        "seq_len": 32, "precision": "fp32", "log_every": 1, "warmup_steps": 0},
            "checkpoint": {"uri": str(tmp / "run"), "every_steps": 1, "keep": 2, "async_mode": "sync"}}))
        t_train, _, _ = _run([sys.executable, str(REPO / "infra" / "torchrun_launch.py"), "--standalone",
                              "--nproc-per-node=4", "-m", "trainer", "--job", str(job)], env)
        ck = tmp / "run" / "checkpoints" / "step-1"
        ck_bytes = sum(f.stat().st_size for f in ck.iterdir())
        res = {"model": "gpt2-124m", "ranks": 4, "checkpoint_mb": round(ck_bytes / 1e6, 1),
               "checkpoint_files": sorted(f.name for f in ck.iterdir() if f.suffix == ".distcp"),
               "make_checkpoint_s": round(t_train, 1), "load_average": os.getloadavg()[0]}
        _, rss_torch, _ = _run([sys.executable, "-c", "import torch"], env)
        res["python_import_torch_peak_rss_mb"] = round(rss_torch)
        for fmt, group_mb in (("safetensors", 256), ("hf", 256), ("safetensors", 32), ("hf", 32)):
            out = tmp / f"w-{fmt}-{group_mb}"
            dt, rss, _ = _run([sys.executable, "-m", "orchestrator.cli", "weights", str(job), "--out", str(out),
                               "--format", fmt], {**env, "DTRUN_EXPORT_GROUP_MB": str(group_mb)})
            key = f"{fmt}_group{group_mb}mb"
            res[f"{key}_s"] = round(dt, 1)
            res[f"{key}_peak_rss_mb"] = round(rss)
            res[f"{fmt}_model_mb"] = round((out / "model.safetensors").stat().st_size / 1e6, 1)
        print(json.dumps(res))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
