"""Input pipeline: the same job fed from token shards in S3 behind a 30 ms/request proxy vs
synthetic data (generated in-process: no I/O at all).

moto's S3 server (``ThreadedMotoServer``) behind ``tests/trainer/s3proxy.py``, which adds
``--latency-ms`` to every request — S3's first-byte latency from a cloud VM is 10–50 ms. The
trainer runs as ``python -m trainer`` (world 1, ``tiny``, batch × seq tokens per step, fp32 on
CPU); its rate comes from metrics.jsonl between the first and the last logged step. Two S3
configurations: the default 8 MiB blocks (one GET serves many steps) and ``--small-block``
bytes (≈ one GET per step, so the prefetch thread must hide every request's latency), with the
loader's read-ahead (``READ_AHEAD_BLOCKS`` blocks in flight) and, for comparison, with
``--compare-read-ahead`` blocks (1: the loader before it read several blocks ahead).

    .venv/bin/python benchmarks/bench_input.py [--steps 60] [--latency-ms 30]
    .venv/bin/python benchmarks/bench_input.py --loader-only [--step-ms 10,30] [--rounds 3]

Prints one JSON object; target: s3 tokens/s ≥ 0.95 × synthetic.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "trainer"))


def run(data: str, steps: int, batch: int, seq: int, env: dict) -> tuple[float, float]:
    import yaml

    with tempfile.TemporaryDirectory() as tmp:
        job = Path(tmp) / "job.yaml"
        job.write_text(yaml.safe_dump({
            "name": "bench", "resources": {"providers": ["local"], "gpu": "cpu", "gpus_per_node": 1},
            "trainer": {"model": "tiny", "parallel": {"dp_shard": 1}, "steps": steps, "batch_size": batch,
                        "seq_len": seq, "precision": "fp32", "lr": 3e-3, "log_every": 5, "data": data,
                        "heartbeat_seconds": 3600},
            "checkpoint": {"uri": f"{tmp}/run", "every_steps": 100000},
        }))
        subprocess.run([sys.executable, "-m", "trainer", "--job", str(job)], cwd=REPO, env=env, check=True,
                       stdout=subprocess.DEVNULL)
        rows = [json.loads(x) for x in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
        rows = [r for r in rows if "loss" in r and "step" in r]  # training rows (not eval/summary rows)
        first, last = rows[1], rows[-1]
        return (last["step"] - first["step"]) * batch * seq / (last["time"] - first["time"]), last["loss"]


def loader_only(proxy_url: str, creds: dict, steps: int, batch: int, seq: int, block: int, step_ms: float,
                read_ahead: int) -> float:
    """The loader alone (no trainer: immune to the shared box's CPU swings): consume ``steps``
    steps of batches from the S3 shards, "computing" ``step_ms`` per step (a sleep, like a GPU
    step the host waits on). Returns ideal time ÷ actual time (1.0: the input is fully hidden)."""
    import time

    import torch

    from trainer import data

    os.environ.update({**creds, "AWS_ENDPOINT_URL": proxy_url})
    data.READ_BLOCK_BYTES, data.READ_AHEAD_BLOCKS = block, read_ahead
    src = (data.SyntheticSource(256, seq, 0) if proxy_url == "synthetic" else  # the ceiling: no I/O
           data.build_source("s3://data/fw", seq_len=seq, vocab_size=256, seed=0))  # a fresh block cache
    ld = data.DataLoader(src, global_batch=batch, micro_batch=batch, dp_rank=0, dp=1, device=torch.device("cpu"))
    for _ in ld.batches(0):  # first step: connection set-up, not counted
        pass
    t0 = time.perf_counter()
    for s in range(1, steps + 1):
        for _ in ld.batches(s):
            pass
        time.sleep(step_ms / 1000)
    dt = time.perf_counter() - t0
    ld.close()
    return steps * step_ms / 1000 / dt


def main() -> None:
    import boto3
    import numpy as np
    from moto.server import ThreadedMotoServer
    from s3proxy import S3Proxy

    from trainer.shards import encode

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--latency-ms", type=float, default=30.0)
    ap.add_argument("--small-block", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--loader-only", action="store_true",
                    help="no trainer: the loader alone with a --step-ms sleep per step, small blocks, read-ahead 1 vs the default")
    ap.add_argument("--step-ms", default="10,30")
    ap.add_argument("--loader-worker", default=None, help=argparse.SUPPRESS)  # "url,block,step_ms,read_ahead"
    ap.add_argument("--compare-read-ahead", type=int, default=1,
                    help="also run the small-block case with this many blocks read ahead (1: the old loader); 0: skip")
    a = ap.parse_args()
    if a.loader_worker:  # a process of its own: moto and the proxy must not share the loader's GIL
        url, block, ms, ra = a.loader_worker.split(",")
        print(loader_only(url, {}, a.steps, a.batch, a.seq, int(block), float(ms), int(ra)))
        return

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    moto = f"http://{host}:{port}"
    creds = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}
    s3 = boto3.client("s3", endpoint_url=moto, region_name="us-east-1", aws_access_key_id="bench",
                      aws_secret_access_key="bench")
    s3.create_bucket(Bucket="data")
    rng = np.random.default_rng(0)
    for i in range(4):  # 4 × 1M tokens, llm.c uint16 shards (+ a val shard the loader must skip)
        s3.put_object(Bucket="data", Key=f"fw/fineweb_train_{i + 1:06d}.bin",
                      Body=encode(rng.integers(0, 256, 1_000_000), 256))
    s3.put_object(Bucket="data", Key="fw/fineweb_val_000000.bin", Body=encode(rng.integers(0, 256, 100_000), 256))
    base = {**os.environ, **creds, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            "PYTHONPATH": str(REPO)}
    res: dict = {"benchmark": "input", "device": "cpu", "model": "tiny", "batch": a.batch, "seq_len": a.seq,
                 "steps": a.steps, "latency_ms": a.latency_ms, "synthetic": [], "s3_8MiB_blocks": [],
                 f"s3_{a.small_block}B_blocks": []}
    cmp_key = f"s3_{a.small_block}B_blocks_read_ahead_{a.compare_read_ahead}"
    if a.compare_read_ahead:
        res[cmp_key] = []
    if a.loader_only:
        from trainer import data

        out: dict = {"benchmark": "input-loader-only", "batch": a.batch, "seq_len": a.seq, "steps": a.steps,
                     "latency_ms": a.latency_ms, "block_bytes": a.small_block,
                     "step_bytes": a.batch * (a.seq + 1) * 2, "rounds": a.rounds}
        with S3Proxy(moto, latency_s=a.latency_ms / 1000) as proxy:
            for ms in [float(x) for x in a.step_ms.split(",")]:
                for ra in ("synthetic", a.compare_read_ahead or 1, data.READ_AHEAD_BLOCKS):
                    r = []
                    spec = (f"synthetic,{a.small_block},{ms},1" if ra == "synthetic" else
                            f"{proxy.url},{a.small_block},{ms},{ra}")
                    for _ in range(a.rounds):
                        p = subprocess.run([sys.executable, __file__, "--loader-worker", spec, "--steps", str(a.steps),
                                            "--batch", str(a.batch), "--seq", str(a.seq)],
                                           env={**base, **creds}, capture_output=True, text=True, check=True)
                        r.append(float(p.stdout.strip().splitlines()[-1]))
                    out[f"step_{ms:g}ms_" + (ra if ra == "synthetic" else f"s3_read_ahead_{ra}")] = {"ideal_over_actual": sorted(round(x, 3) for x in r)}
        server.stop()
        print(json.dumps(out))
        return
    with S3Proxy(moto, latency_s=a.latency_ms / 1000) as proxy:
        env = {**base, "AWS_ENDPOINT_URL": proxy.url}
        for _ in range(a.rounds):
            res["synthetic"].append(run("synthetic", a.steps, a.batch, a.seq, base)[0])
            n0 = proxy.requests
            res["s3_8MiB_blocks"].append(run("s3://data/fw", a.steps, a.batch, a.seq, env)[0])
            res["requests_8MiB_run"] = proxy.requests - n0
            n0 = proxy.requests
            small = {**env, "DTRUN_DATA_BLOCK_BYTES": str(a.small_block)}
            res[f"s3_{a.small_block}B_blocks"].append(run("s3://data/fw", a.steps, a.batch, a.seq, small)[0])
            res[f"requests_{a.small_block}B_run"] = proxy.requests - n0
            if a.compare_read_ahead:
                res[cmp_key].append(run("s3://data/fw", a.steps, a.batch, a.seq,
                                        {**small, "DTRUN_DATA_READ_AHEAD": str(a.compare_read_ahead)})[0])
    server.stop()
    best = max(res["synthetic"])
    for k in ("s3_8MiB_blocks", f"s3_{a.small_block}B_blocks") + ((cmp_key,) if a.compare_read_ahead else ()):
        per_round = sorted(x / y for x, y in zip(res[k], res["synthetic"]))
        res[k] = [round(x, 1) for x in res[k]]
        res[f"ratio_{k}"] = round(max(res[k]) / best, 3)
        res[f"ratio_{k}_median_of_rounds"] = round(per_round[len(per_round) // 2], 3)
    res["synthetic"] = [round(x, 1) for x in res["synthetic"]]
    res["target"] = 0.95
    print(json.dumps(res))


if __name__ == "__main__":
    main()
