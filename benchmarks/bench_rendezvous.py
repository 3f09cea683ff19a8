"""Multi-node rendezvous: how long two torchrun "nodes" take from the later node's start until
every rank has passed its first collective — what each node of a cluster pays before training.

Two ``infra/torchrun_launch.py`` launchers on this machine (``--nnodes 2``, static rendezvous on
127.0.0.1 as the node bootstrap runs it on a cluster's private IPs), ``--nproc-per-node`` ranks
each; every worker runs ``init_process_group(gloo)`` and a barrier and records the time. Node 1
starts ``--stagger`` seconds after node 0 (a cluster's nodes do not start together). Reported:
the median of ``--rounds`` for (a) later start → every rank past the barrier, (b) init alone.
Loopback only: the real network adds its round trips (a handful per rank) on top.

    .venv/bin/python benchmarks/bench_rendezvous.py [--rounds 5] [--nproc 2] [--stagger 2]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAUNCH = REPO / "infra" / "torchrun_launch.py"

WORKER = """
import json, os, sys, time
t0 = time.time()
import torch.distributed as dist
dist.init_process_group("gloo")
t1 = time.time()
dist.barrier()
t2 = time.time()
with open(os.path.join(sys.argv[1], f"r{dist.get_rank()}.json"), "w") as f:
    json.dump({"start": t0, "init": t1, "barrier": t2}, f)
dist.destroy_process_group()
"""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_round(nproc: int, stagger: float) -> dict:
    with tempfile.TemporaryDirectory() as d:
        w = Path(d) / "w.py"
        w.write_text(WORKER)
        port = _port()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        procs, starts = [], []
        for rank in (0, 1):
            if rank:
                time.sleep(stagger)
            starts.append(time.time())
            procs.append(subprocess.Popen(
                [sys.executable, str(LAUNCH), "--nnodes", "2", "--node-rank", str(rank), f"--nproc-per-node={nproc}",
                 "--master-addr", "127.0.0.1", "--master-port", str(port), str(w), d],
                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        for p in procs:
            _, err = p.communicate(timeout=300)
            if p.returncode:
                raise SystemExit(f"launcher exited {p.returncode}: {err[-2000:]}")
        rows = [json.loads((Path(d) / f"r{r}.json").read_text()) for r in range(2 * nproc)]
        last_start = max(starts)
        return {"rendezvous_s": max(r["barrier"] for r in rows) - last_start,
                "init_s": max(r["init"] for r in rows) - max(r["start"] for r in rows),
                "python_start_s": max(r["start"] for r in rows) - last_start}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--stagger", type=float, default=2.0)
    a = ap.parse_args()
    rounds = [one_round(a.nproc, a.stagger) for _ in range(a.rounds)]
    out = {k: round(statistics.median(r[k] for r in rounds), 3) for k in rounds[0]}
    out.update(rounds=a.rounds, nodes=2, nproc_per_node=a.nproc, stagger_s=a.stagger,
               all=[{k: round(v, 3) for k, v in r.items()} for r in rounds])
    print(json.dumps(out))


if __name__ == "__main__":
    main()
