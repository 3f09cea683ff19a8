"""Restore preflight, orchestrator side: before a long run (on by default for spot), prove that a
checkpoint saved to the real run URI restores — resharded — before anything is rented.

Two stages, cheapest first:

1. :func:`storage_probe` (in this process, no torch, ~0.1 s): write, read back and delete one
   small object under the run URI (``orchestrator.contract.storeprobe``, the probe and the words
   the trainer's preflight uses too). A missing bucket, refused credentials or an unreachable
   endpoint fails here with one sentence naming the problem;
2. :func:`run_preflight`: the real thing — ``torchrun -m trainer.preflight`` on this machine's
   CPU (gloo, 2 ranks by default), a separate process (this side never imports the trainer): a
   small FSDP2-sharded model and AdamW state saved with the trainer's DCP/fsspec writer, restored
   into the same layout and resharded into whole tensors, compared bit for bit (see
   ``trainer/preflight.py``).

Failure → :class:`PreflightError` (one line; exit 6 for bucket/endpoint/storage, 5 for
credentials, 1 for a broken restore). The controller calls :func:`maybe_preflight` before the
first launch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator.contract.errors import EXIT_JOB_FAILED, EXIT_NOT_FOUND, EXIT_PROVIDER, DtrunError
from orchestrator.contract.storeprobe import probe
from orchestrator.plan.spec import JobSpec

DEFAULT_NPROC = 2
DEFAULT_TIMEOUT_S = 300.0

_EXIT_BY_PROBLEM = {"credentials": EXIT_PROVIDER, "restore": EXIT_JOB_FAILED, "resharding": EXIT_JOB_FAILED}


class PreflightError(DtrunError):
    """The run URI cannot hold a checkpoint that restores. ``problem`` names which part broke."""

    exit_code = EXIT_NOT_FOUND

    def __init__(self, problem: str, message: str):
        super().__init__(f"restore preflight failed ({problem}): {message}")
        self.problem = problem
        self.exit_code = _EXIT_BY_PROBLEM.get(problem, EXIT_NOT_FOUND)


@dataclass
class PreflightResult:
    ok: bool
    problem: str | None
    message: str
    seconds: float
    world_size: int

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "problem": self.problem, "message": self.message,
                "seconds": self.seconds, "world_size": self.world_size}


def preflight_enabled(spec: JobSpec) -> bool:
    """``checkpoint.preflight``, defaulting to on for spot capacity."""
    p = spec.checkpoint.preflight
    return spec.uses_spot if p is None else bool(p)


def storage_probe(run_uri: str) -> None:
    """Write/read/delete one object under the run URI; :class:`PreflightError` when that fails."""
    got = probe(run_uri)
    if got is not None:
        raise PreflightError(*got)


def run_preflight(spec: JobSpec, run_uri: str | None = None, *, nproc: int = DEFAULT_NPROC,
                  timeout_s: float = DEFAULT_TIMEOUT_S) -> PreflightResult:
    """The full round trip (probe first). Raises :class:`PreflightError` on any problem."""
    uri = run_uri or spec.run_uri
    storage_probe(uri)
    with tempfile.TemporaryDirectory(prefix="dtrun-preflight-") as tmp:
        result = Path(tmp) / "result.json"
        if nproc > 1:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                   "-m", "trainer.preflight", "--run-uri", uri, "--result", str(result)]
        else:
            cmd = [sys.executable, "-m", "trainer.preflight", "--run-uri", uri, "--result", str(result)]
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s,
                                  start_new_session=True)
        except subprocess.TimeoutExpired:
            raise PreflightError("timeout", f"the checkpoint round trip against {uri} took over "
                                 f"{timeout_s:.0f} s (is the storage reachable and fast enough?)") from None
        if not result.exists():
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-5:]
            raise PreflightError("crash", f"the preflight process exited {proc.returncode} without a verdict: "
                                 + " | ".join(tail)[-600:])
        verdict = json.loads(result.read_text())
    if not verdict["ok"]:
        raise PreflightError(verdict["problem"], verdict["message"])
    return PreflightResult(True, None, verdict["message"], float(verdict["seconds"]), int(verdict["world_size"]))


def maybe_preflight(spec: JobSpec, run_uri: str | None = None, **kw: Any) -> PreflightResult | None:
    """Run the preflight when the spec asks for it (default: spot jobs); None when skipped."""
    if not preflight_enabled(spec):
        return None
    return run_preflight(spec, run_uri, **kw)
