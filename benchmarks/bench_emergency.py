"""Emergency save: upload MB/s with concurrent files per rank vs one stream, and SIGTERM → exit
of a real trainer run, on moto S3 behind a proxy adding ``--latency-ms`` per request.

1. Upload: ``dcp.save`` of a ``--mb`` MB state dict (one process) with DCP ``thread_count`` 1
   (one file: s3fs uploads its 50 MiB parts one after another) and 8 (eight files, eight
   multipart uploads at once — the trainer's ``UPLOAD_THREADS``). Best of ``--rounds``.
2. SIGTERM: ``python -m trainer`` (world 1, d_model 512 × 8 layers, ≈ 30M params + AdamW), S3 run
   URI through the proxy; SIGTERM once a step after the first checkpoint is running; time to
   exit and whether the emergency step is COMMITTED.

    .venv/bin/python benchmarks/bench_emergency.py [--mb 256] [--latency-ms 30]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "trainer"))


def upload_mb_s(endpoint: str, mb: int, threads: int, rounds: int) -> float:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    n = mb * (1 << 20) // 4 // 16
    sd = {f"t{i}": torch.randn(n) for i in range(16)}
    best = float("inf")
    for r in range(rounds):
        uri = f"s3://bench/up-{threads}-{r}-{time.time_ns()}"
        w = FsspecWriter(uri, sync_files=False, thread_count=threads, client_kwargs={"endpoint_url": endpoint})
        t = time.perf_counter()
        dcp.save(sd, storage_writer=w, no_dist=True)
        best = min(best, time.perf_counter() - t)
    return mb / best


def sigterm_to_exit(endpoint: str, env: dict) -> dict:
    import yaml

    from orchestrator.contract import runuri

    with tempfile.TemporaryDirectory() as tmp:
        uri = f"s3://bench/run-{time.time_ns()}"
        job = Path(tmp) / "job.yaml"
        job.write_text(yaml.safe_dump({
            "name": "bench", "resources": {"providers": ["local"], "gpu": "cpu", "gpus_per_node": 1},
            "trainer": {"model": {"vocab_size": 4096, "d_model": 512, "n_layers": 8, "n_heads": 8,
                                  "max_seq_len": 128},
                        "parallel": {"dp_shard": 1}, "steps": 50, "batch_size": 2, "seq_len": 64,
                        "precision": "fp32", "log_every": 1, "heartbeat_seconds": 1},
            "checkpoint": {"uri": uri, "every_steps": 2, "keep": 2},
        }))
        e = {**env, "AWS_ENDPOINT_URL": endpoint, "DTRUN_DEBUG_STEP_SLEEP": "0.5"}
        p = subprocess.Popen([sys.executable, "-m", "trainer", "--job", str(job)], cwd=REPO, env=e,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.environ["AWS_ENDPOINT_URL"] = endpoint
        while not (runuri.latest_committed(uri) and (runuri.read_json(runuri.join(uri, "progress.json")) or {})
                   .get("step", 0) >= 3):
            time.sleep(0.2)
        t = time.perf_counter()
        p.send_signal(signal.SIGTERM)
        rc = p.wait(timeout=300)
        dt = time.perf_counter() - t
        prog = runuri.read_json(runuri.join(uri, "progress.json")) or {}
        step = prog.get("step")
        return {"sigterm_to_exit_s": round(dt, 2), "exit_code": rc, "stopped_at_step": step,
                "emergency_step_committed": runuri.committed(uri, step) is not None if step else False}


def main() -> None:
    import boto3
    from moto.server import ThreadedMotoServer
    from s3proxy import S3Proxy

    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--latency-ms", type=float, default=30.0)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    creds = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}
    os.environ.update(creds)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    moto = f"http://{host}:{port}"
    boto3.client("s3", endpoint_url=moto, region_name="us-east-1").create_bucket(Bucket="bench")
    res: dict = {"benchmark": "emergency_save", "latency_ms": a.latency_ms, "state_mb": a.mb}
    with S3Proxy(moto, latency_s=a.latency_ms / 1000) as proxy:
        res["upload_MB_s_1_stream"] = round(upload_mb_s(proxy.url, a.mb, 1, a.rounds), 1)
        res["upload_MB_s_8_files"] = round(upload_mb_s(proxy.url, a.mb, 8, a.rounds), 1)
        res["concurrency_gain"] = round(res["upload_MB_s_8_files"] / res["upload_MB_s_1_stream"], 2)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        res.update(sigterm_to_exit(proxy.url, env))
    server.stop()
    print(json.dumps(res))


if __name__ == "__main__":
    main()
