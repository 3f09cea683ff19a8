"""`dtrun logs` while the node trains; then the controller is SIGKILLed mid-run (nothing tears the
cluster down: the node keeps billing). `dtrun gc` leaves it alone — by design a live node of an
active job is owned, not an orphan: the job can be re-attached — and `dtrun down JOB` (no
controller left) re-attaches here, has the trainer write a final checkpoint, terminates the
cluster and ends the job CANCELLED; the lab lists no instance and the bill stops."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from tests.e2e.lambda_cloud.conftest import REPO, dtrun, job_yaml, wait_until
from tests.e2e.lambdalab import lab as lablib

pytestmark = pytest.mark.timeout(2400)  # a launch takes minutes on 2 shared cores


def test_logs_then_down_after_controller_sigkill(lab, s3_lab, tmp_path):
    env = {**lab, **s3_lab["env"], "DTRUN_HOME": str(tmp_path / "dtrun-home")}
    name = "lab-down"
    job = job_yaml(tmp_path, name, s3_lab["bucket"], steps=100000, every=5000)  # runs until stopped
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli.app", "up", str(job), "--yes"], env=env,
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)

    def step() -> int:
        try:
            return int(json.loads(s3_lab["get"](f"{name}/progress.json")).get("step") or 0)
        except Exception:
            return 0

    try:
        wait_until(lambda: step() >= 20, 1500, "the lab node never trained")
        logs = dtrun(["logs", name], env, timeout=300).stdout
        assert "[dtrun-node" in logs and "step " in logs, logs[-2000:]
        os.killpg(proc.pid, signal.SIGKILL)  # the controller dies with everything it started
        proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    killed_at = step()
    [inst] = [i for i in lablib.call("status")["instances"] if i["name"].startswith(f"dtrun-{name}-a1")]
    assert inst["status"] == "active"  # left billing

    gc = dtrun(["gc"], env, timeout=600)
    assert "no orphan instances" in gc.stdout and "1 owned" in gc.stdout, gc.stdout
    assert [i["id"] for i in lablib.call("status")["instances"]] == [inst["id"]]

    down = dtrun(["down", name], env, timeout=1200)
    st = json.loads(dtrun(["status", name, "--json"], env).stdout)
    assert st["state"] == "CANCELLED", (st, down.stdout[-2000:])
    committed = [int(k.split("/step-")[1].split("/")[0]) for k in s3_lab["keys"](f"{name}/checkpoints/")
                 if k.endswith("/COMMITTED")]
    assert committed and max(committed) >= killed_at, (committed, killed_at)  # the final checkpoint
    wait_until(lambda: not lablib.call("status")["instances"], 120, "the lab still lists the instance")
    assert lablib.call("bill")["running"] == 0
