"""Helpers for trainer tests: write a job spec, launch the real trainer under torchrun (through
``infra/torchrun_launch.py``, which passes the workers' exit codes through), read the run URI."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
LAUNCH = REPO / "infra" / "torchrun_launch.py"

def torchrun_script(tmp: Path, source: str | Path, nproc: int, *args: str, timeout: float = 300,
                    env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run a test script (its text, or a path) under the real torchrun on CPU (gloo, one thread per
    rank) from the repository root; the test fails with the script's output unless it exits 0."""
    if isinstance(source, str):
        path = tmp / "torchrun_script.py"
        path.write_text(source)
    else:
        path = source
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                          str(path), *args], cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **(env or {})})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-4000:]
    return out


# A dense model that exercises every TP path: untied head/embedding, QK-norm, SwiGLU, RMSNorm, GQA.
DENSE = {"vocab_size": 256, "d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
         "max_seq_len": 128, "qk_norm": True, "tie_embeddings": False, "mlp": "swiglu", "norm": "rmsnorm"}
# tiny-moe, dropless (the default) and without per-rank aux loss: EP and world 1 compute the same function.
MOE = {"vocab_size": 256, "d_model": 64, "n_layers": 2, "n_heads": 4, "max_seq_len": 128,
       "moe": {"n_experts": 4, "top_k": 2, "balance": "bias"}}


class Trainer:
    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.procs: list[subprocess.Popen] = []

    def job(self, name: str, *, nproc: int, run_uri: str, model: Any = "tiny", parallel: Any = None,
            steps: int = 8, every: int = 4, **trainer: Any) -> Path:
        spec = {
            "name": name,
            "resources": {"providers": ["local"], "gpu": "cpu", "gpus_per_node": nproc},
            "trainer": {"model": model, "parallel": parallel or {"dp_shard": nproc, "tp": 1},
                        "steps": steps, "batch_size": 4, "seq_len": 32, "precision": "fp32",
                        "lr": 0.01, "warmup_steps": 2, "log_every": 1, "heartbeat_seconds": 0.2,
                        **trainer},
            "checkpoint": {"uri": run_uri, "every_steps": every, "keep": 2},
        }
        path = self.tmp / f"{name}.yaml"
        path.write_text(yaml.safe_dump(spec))
        return path

    def start(self, job: Path, nproc: int, *, run_uri: str | None = None, env: dict | None = None,
              torchrun: bool = True, launch: list[str] | None = None) -> subprocess.Popen:
        """``launch``: torchrun's rendezvous flags instead of ``--standalone`` (one node of several)."""
        if torchrun:
            cmd = [sys.executable, str(LAUNCH), *(launch or ["--standalone"]), f"--nproc-per-node={nproc}",
                   "-m", "trainer", "--job", str(job)]
        else:
            cmd = [sys.executable, "-m", "trainer", "--job", str(job)]
        if run_uri:
            cmd += ["--run-uri", run_uri]
        e = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
        p = subprocess.Popen(cmd, cwd=REPO, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, start_new_session=True)
        self.procs.append(p)
        return p

    def run(self, job: Path, nproc: int, timeout: float = 240, **kw: Any) -> tuple[int, str]:
        p = self.start(job, nproc, **kw)
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill(p)
            out, _ = p.communicate()
            raise AssertionError(f"trainer timed out:\n{out[-4000:]}")
        return p.returncode, out

    @staticmethod
    def kill(p: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            pass

    def cleanup(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                self.kill(p)
                p.wait(timeout=30)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (a torchrun rendezvous of several launchers)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_nodes(port: int, rank: int) -> list[str]:
    """torchrun's flags for node ``rank`` of a two-node static rendezvous on 127.0.0.1."""
    return ["--nnodes", "2", "--node-rank", str(rank), "--master-addr", "127.0.0.1", "--master-port", str(port)]


def wait_for(cond, timeout: float = 120, every: float = 0.1, what: str = "condition") -> None:
    end = time.time() + timeout
    while time.time() < end:
        if cond():
            return
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")


def losses(run_uri: str) -> list[float]:
    from orchestrator.contract import runuri

    text = runuri.read_text(runuri.join(run_uri, "metrics.jsonl")) or ""
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    return [r["loss"] for r in rows if "loss" in r]  # validation rows carry val_loss only


@pytest.fixture
def trainer(tmp_path):
    t = Trainer(tmp_path)
    yield t
    t.cleanup()
