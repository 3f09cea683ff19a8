"""Checkpoint stall: how long the training loop stops for an async save ÷ a full synchronous save.

A GPT of ~51M parameters (d_model 512, 8 layers, vocab 50304) with AdamW state after real steps
(≈ 0.6 GB of fp32 state), saved by the trainer's own ``CheckpointManager`` to a moto S3 server
(a separate process over HTTP on 127.0.0.1, through s3fs): once with ``sync=True`` (the loop is
blocked for the whole upload) and once async (the loop is blocked only while DCP stages the
state; the upload runs in a background thread while training steps continue). Both are
committed (COMMITTED written) before the numbers are reported, and the async checkpoint is loaded
back through the resume path.

    .venv/bin/python benchmarks/bench_checkpoint.py

Prints one JSON object; target: stall_ratio ≤ 0.04.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    port = _free_port()
    moto = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        endpoint = f"http://127.0.0.1:{port}"
        os.environ.update({"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing",
                           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"})
        import boto3

        for _ in range(100):
            try:
                boto3.client("s3").create_bucket(Bucket="bench")
                break
            except Exception:  # noqa: BLE001 - server still starting
                time.sleep(0.1)
        run(f"s3://bench/run-{int(time.time())}")
    finally:
        moto.terminate()
        moto.wait(timeout=30)


def run(uri: str) -> None:
    import torch

    from orchestrator.contract import runuri
    from orchestrator.plan.presets import ModelSpec
    from trainer.checkpoint import CheckpointManager, param_digest
    from trainer.data import DataLoader, SyntheticSource
    from trainer.model import build_model, loss_fn

    spec = ModelSpec(vocab_size=50304, d_model=512, n_layers=8, n_heads=8, max_seq_len=256)
    model = build_model(spec, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    loader = DataLoader(SyntheticSource(spec.vocab_size, 64, 0), global_batch=2, micro_batch=2, dp_rank=0, dp=1,
                        device=torch.device("cpu"))

    def step(i: int) -> float:
        t0 = time.perf_counter()
        for x, y in loader.batches(i):
            loss_fn(model(x), y)[0].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loader.advance(i)
        return time.perf_counter() - t0

    for i in range(2):
        step(i)
    base_step = min(step(i) for i in range(2, 5))
    state_bytes = sum(p.numel() * 4 for p in model.parameters()) * 3
    mgr = CheckpointManager(uri, keep=2, async_mode="async", rank=0, world_size=1, dp_rank=0, describe={})

    def sd(i: int):
        return mgr.state_dict(model, opt, loader, {"step": i, "tokens": 0, "loss": 0.0})

    t0 = time.perf_counter()
    mgr.save(5, sd(5), {}, sync=True)
    sync_s = time.perf_counter() - t0
    assert mgr.last_committed == 5

    saved_digest = param_digest(model)  # the parameters checkpoint 6 holds (training continues after)
    t0 = time.perf_counter()
    mgr.save(6, sd(6), {})
    stall_s = time.perf_counter() - t0
    steps_during, i = [], 6
    while mgr._pending is not None and not mgr._pending[1].done():
        steps_during.append(step(i))
        i += 1
    t_upload = time.perf_counter() - t0
    mgr.wait()
    assert mgr.last_committed == 6 and runuri.committed(uri, 6) is not None

    # Round trip: the async checkpoint loads back (through resume's code path) into a fresh model.
    fresh = build_model(spec, seed=1)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-4, foreach=True)
    mgr2 = CheckpointManager(uri, keep=2, async_mode="async", rank=0, world_size=1, dp_rank=0, describe={})
    train = mgr2.load_latest(fresh, fresh_opt, loader)
    assert train["step"] == 6
    digest_saved = param_digest(fresh)
    assert digest_saved == saved_digest, "the async checkpoint did not load back bit-exactly"
    res = {
        "benchmark": "checkpoint_stall", "storage": "moto S3 (HTTP, s3fs)",
        "params": spec.num_params(), "state_bytes_fp32_params_plus_adamw": state_bytes,
        "sync_save_s": round(sync_s, 3), "async_stall_s": round(stall_s, 3),
        "stall_ratio": round(stall_s / sync_s, 4), "target": 0.04,
        "async_upload_s": round(t_upload, 3), "train_steps_during_upload": len(steps_during),
        "step_s_alone": round(base_step, 3),
        "step_s_during_upload_mean": round(sum(steps_during) / len(steps_during), 3) if steps_during else None,
        "loaded_back_step": train["step"], "loaded_digest_matches_saved": digest_saved == saved_digest,
    }
    print(json.dumps(res))


if __name__ == "__main__":
    main()
