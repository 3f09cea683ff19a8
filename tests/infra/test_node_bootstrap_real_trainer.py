"""The node bootstrap with the real trainer under real torchrun and no controller at all: a node
whose budget runs out checkpoints, stops, exits 76 and leaves nothing running."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from infra import node_proctree
from orchestrator.contract import runuri

ROOT = Path(__file__).resolve().parents[2]
BOOT = ROOT / "infra" / "node_bootstrap.py"
sys.path.insert(0, str(ROOT / "infra"))
import node_bootstrap as nb  # noqa: E402

JOB = """\
name: budgetnode
resources: {providers: [local], gpu: cpu, gpus_per_node: 1}
trainer: {model: tiny, steps: 100000, batch_size: 2, seq_len: 16, precision: fp32, heartbeat_seconds: 0.5,
          log_every: 50}
checkpoint: {every_steps: 100000, keep: 2}
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.e2e  # a whole fault/resume scenario with the real trainer: `make e2e`
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_budget_runs_out_without_a_controller(tmp_path):
    uri = "file://" + str(tmp_path / "run")
    runuri.write_text(runuri.join(uri, "job.yaml"), JOB)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DTRUN_", "FAKE_"))}
    env.update(DTRUN_RUN_URI=uri, DTRUN_JOB="budgetnode", DTRUN_ATTEMPT="1", DTRUN_NPROC_PER_NODE="1",
               DTRUN_WATCHDOG_SECONDS="0.5", DTRUN_STOP_GRACE_SECONDS="60", DTRUN_KILL_GRACE_SECONDS="30",
               DTRUN_PRICE_PER_HOUR="3600", DTRUN_DEBUG_STEP_SLEEP="0.02", PYTHONPATH=str(ROOT))
    prog = runuri.join(uri, runuri.PROGRESS)
    # $1/s: budget for the trainer to start on a busy machine, then the watchdog must act
    start = time.time()
    p = subprocess.Popen([sys.executable, str(BOOT)], env={**env, "DTRUN_BUDGET_LEFT_USD": "1000000"},
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        # first measure how long the trainer takes to start here, then set the budget from it
        deadline = time.time() + 180
        while runuri.read_json(prog) is None and time.time() < deadline and p.poll() is None:
            time.sleep(0.2)
        startup = time.time() - start
    finally:
        os.killpg(p.pid, 9)
        p.wait()
        time.sleep(0.5)
    assert runuri.read_json(prog) is not None, "the trainer never started"
    runuri.remove(runuri.join(uri, "checkpoints"), recursive=True)
    runuri.remove(prog)
    budget = startup * 2 + 100  # STOP about startup×2 + 10 s in (look-ahead: check + 60 s + 30 s graces)
    t0 = time.time()
    p = subprocess.Popen([sys.executable, str(BOOT)], env={**env, "DTRUN_BUDGET_LEFT_USD": f"{budget:.1f}"},
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    seen: set[int] = set()
    while p.poll() is None and time.time() - t0 < 240:
        seen.update(node_proctree.descendants(p.pid))
        time.sleep(0.2)
    _, err = p.communicate(timeout=60)
    assert p.returncode == nb.EXIT_WATCHDOG, err[-3000:]
    wd = runuri.read_json(runuri.join(uri, "watchdog.json"))
    assert wd["reason"] == "budget" and wd["spend_usd"] < budget
    assert time.time() - t0 < budget  # it stopped before the money ran out
    last = runuri.latest_committed(uri)
    assert last is not None and last[0] >= 1, err[-3000:]  # the STOP checkpoint (interval is 100000)
    assert runuri.read_json(runuri.join(uri, runuri.DONE)) is None
    assert seen and not [pid for pid in seen if _alive(pid)], "a trainer process outlived the node"
