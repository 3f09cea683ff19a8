"""A ``command:`` job's checkpoint overhead: the script's own save vs the node agent's upload.

A user script saves a checkpoint folder (``torch.save`` of ``--mb`` MiB of tensors in one file
or four into ``$DTRUN_CHECKPOINT_DIR/step-N/``, then ``DONE_WRITING``); the node agent
(``infra/usercode.py``) finds it finished, uploads it to the run URI and writes COMMITTED. Timed
separately: the script's save (what the script pays anyway), the agent's upload + commit (runs
beside the script, off its critical path), and the restore a resumed node does before starting.
The run URI is a moto S3 server (a separate process over HTTP on 127.0.0.1, through s3fs) and,
for comparison, a local folder.

    .venv/bin/python benchmarks/bench_usercode_upload.py [--mb 256]

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(uri: str, mb: int, work: str, files: int = 1) -> dict:
    import torch

    from infra import usercode

    os.environ["DTRUN_NODE_DIR"] = work
    cfg = SimpleNamespace(run_uri=uri, job="bench", attempt=1, node_rank=0, nnodes=1)
    cmd = {"run": "train.py", "checkpoint_format": "marker", "_keep": 2}
    s = usercode.UserCommand(cfg, cmd, [], "launch.py")
    n = mb * 2**20 // 4 // files
    parts = [torch.randn(n) for _ in range(files)]
    folder = os.path.join(s.ckpt_dir, "step-100")
    t0 = time.perf_counter()
    os.makedirs(folder)
    for i, t in enumerate(parts):  # e.g. the Trainer's model, optimizer, ... files
        torch.save({"part": t}, os.path.join(folder, f"part-{i}.pt"))
    with open(os.path.join(folder, "DONE_WRITING"), "w") as f:
        f.write('{"step": 100}')
    save_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    committed = s.sync(exited=False)
    upload_s = time.perf_counter() - t0
    assert committed == [100], committed
    r = usercode.UserCommand(cfg, cmd, [], "launch.py")
    t0 = time.perf_counter()
    r._restore()
    restore_s = time.perf_counter() - t0
    assert r.resume_step == 100
    size = sum(os.path.getsize(os.path.join(folder, f"part-{i}.pt")) for i in range(files))
    return {"bytes": size, "files": files, "script_save_s": round(save_s, 3), "agent_upload_commit_s": round(upload_s, 3),
            "upload_over_save": round(upload_s / save_s, 2), "restore_s": round(restore_s, 3),
            "upload_MiB_per_s": round(size / 2**20 / upload_s, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=256)
    args = ap.parse_args()
    port = _free_port()
    moto = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        endpoint = f"http://127.0.0.1:{port}"
        os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                          AWS_DEFAULT_REGION="us-east-1")
        import boto3

        for _ in range(100):
            try:
                boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench")
                break
            except Exception:
                time.sleep(0.1)
        with tempfile.TemporaryDirectory() as tmp:
            out = {"mb": args.mb,
                   "moto_s3_1_file": measure("s3://bench/run1", args.mb, os.path.join(tmp, "a"), 1),
                   "moto_s3_4_files": measure("s3://bench/run4", args.mb, os.path.join(tmp, "c"), 4),
                   "local_disk_4_files": measure(f"file://{tmp}/run", args.mb, os.path.join(tmp, "b"), 4)}
        print(json.dumps(out))
    finally:
        moto.terminate()
        moto.wait()


if __name__ == "__main__":
    main()
