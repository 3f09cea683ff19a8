"""Chaos on the local provider with real processes: the detached controller is SIGKILLed mid-run.

* the node goes on alone (real torchrun + the bundled trainer), writes DONE, exits, and nothing is
  left running; `dtrun up` again then closes the books (SUCCEEDED, no second launch);
* with ``teardown.controller_lost_minutes`` set low the node checkpoints and stops soon after the
  lease goes stale; `dtrun up` again resumes from that checkpoint and finishes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orchestrator.contract import runuri

REPO = Path(__file__).resolve().parents[3]
DTRUN = [sys.executable, "-m", "orchestrator.cli"]
FAKE_TRAINER = REPO / "tests" / "fakes" / "fake_node_trainer.py"


def _env(tmp_path: Path, **kw: str) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("DTRUN_", "FAKE_"))}
    e.update(DTRUN_HOME=str(tmp_path / "home"), PYTHONPATH=str(REPO), DTRUN_WATCHDOG_SECONDS="0.5")
    e.update(kw)
    return e


def dtrun(env, cwd, *args, timeout=240):
    return subprocess.run(DTRUN + list(args), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def status(env, cwd, name):
    p = dtrun(env, cwd, "status", name, "--json")
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def wait_for(pred, timeout=120.0, what="condition"):
    end = time.time() + timeout
    while time.time() < end:
        v = pred()
        if v:
            return v
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}")


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


def tree(pid: int) -> set[int]:
    from infra.node_proctree import descendants

    return {pid, *descendants(pid)}


@pytest.mark.e2e  # a whole fault/resume scenario with the real trainer: `make e2e`
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_sigkilled_controller_node_finishes_alone_with_real_trainer(tmp_path):
    (tmp_path / "job.yaml").write_text("""\
name: alone
resources: {providers: [local], gpu: cpu, gpus_per_node: 1}
trainer: {model: tiny, steps: 120, batch_size: 2, seq_len: 16, precision: fp32, heartbeat_seconds: 0.5,
          log_every: 20}
checkpoint: {uri: "./runs/{name}", every_steps: 40}
budget: {max_usd: 1.0, max_hours: 1}
recovery: {poll_seconds: 0.5, backoff_seconds: 0.2, heartbeat_timeout_seconds: 120}
""")
    env = _env(tmp_path, DTRUN_DEBUG_STEP_SLEEP="0.05")
    uri = "file://" + str(tmp_path / "runs" / "alone")
    p = dtrun(env, tmp_path, "up", "job.yaml", "--yes", "--detach")
    assert p.returncode == 0, p.stderr
    st = wait_for(lambda: (s := status(env, tmp_path, "alone"))["state"] == "RUNNING" and (s["step"] or 0) >= 1
                  and s, what="training")
    node_pid = st["nodes"][0]["pid"]
    procs = tree(node_pid)
    os.kill(st["controller_pid"], signal.SIGKILL)
    assert runuri.read_json(runuri.join(uri, runuri.DONE)) is None, "too late: the run was already done"
    done = wait_for(lambda: runuri.read_json(runuri.join(uri, runuri.DONE)), 240, "DONE written without a controller")
    assert done["step"] == 120
    wait_for(lambda: not any(alive(p) for p in procs | tree(node_pid)), 60, "node processes gone")
    assert status(env, tmp_path, "alone")["controller_pid"] is None
    # `dtrun up` again: re-attaches, finds the node finished with DONE, closes the books
    p = dtrun(env, tmp_path, "up", "job.yaml", "--yes")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    s = status(env, tmp_path, "alone")
    assert s["state"] == "SUCCEEDED" and s["attempts"] == 1


@pytest.mark.e2e  # a whole fault/resume scenario with the real trainer: `make e2e`
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_controller_lost_node_checkpoints_and_stops_then_up_resumes(tmp_path):
    (tmp_path / "job.yaml").write_text("""\
name: lost
resources: {providers: [local], gpu: cpu, gpus_per_node: 1}
trainer: {model: tiny, steps: 600, batch_size: 2, seq_len: 16, precision: fp32}
checkpoint: {uri: "./runs/{name}", every_steps: 1000}
budget: {max_usd: 1.0, max_hours: 1}
teardown: {controller_lost_minutes: 0.05}
recovery: {poll_seconds: 0.5, backoff_seconds: 0.2, heartbeat_timeout_seconds: 60}
""")
    # the torch-free stand-in trainer (honours STOP with a checkpoint) keeps this one fast
    env = _env(tmp_path, DTRUN_TRAINER_CMD=f"{sys.executable} {FAKE_TRAINER}", FAKE_STEPS="600",
               FAKE_STEP_SECONDS="0.05")
    uri = "file://" + str(tmp_path / "runs" / "lost")
    assert dtrun(env, tmp_path, "up", "job.yaml", "--yes", "--detach").returncode == 0
    st = wait_for(lambda: (s := status(env, tmp_path, "lost"))["state"] == "RUNNING" and (s["step"] or 0) >= 5
                  and s, what="training")
    node_pid = st["nodes"][0]["pid"]
    procs = tree(node_pid)
    os.kill(st["controller_pid"], signal.SIGKILL)
    killed_at = time.time()
    wd = wait_for(lambda: runuri.read_json(runuri.join(uri, "watchdog.json")), 30, "the node's watchdog")
    assert wd["reason"] == "controller_lost"
    wait_for(lambda: not any(alive(p) for p in procs), 30, "node stopped")
    # lease: expires 1.5 s after the last tick; stale limit 3 s; checks every 0.5 s
    assert time.time() - killed_at < 20
    step, rec = runuri.latest_committed(uri)
    assert 5 <= step < 600  # the STOP checkpoint, not the end
    assert runuri.read_json(runuri.join(uri, runuri.DONE)) is None
    # `dtrun up` again resumes from the checkpoint and finishes
    p = dtrun(env, tmp_path, "up", "job.yaml", "--yes")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    s = status(env, tmp_path, "lost")
    assert s["state"] == "SUCCEEDED"
    assert runuri.read_json(runuri.join(uri, runuri.DONE))["step"] == 600
    assert s["attempts"] >= 2
