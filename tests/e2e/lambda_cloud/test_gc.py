"""`dtrun logs` while the node trains; then the controller is SIGKILLed mid-run (nothing tears the
cluster down: the node keeps billing) → `dtrun gc --yes` finds the cluster as an orphan (a live
node whose controller died on this host) and removes it; the lab lists no instance and the bill
stops."""

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


def step(s3_lab, name: str) -> int:
    try:
        return int(json.loads(s3_lab["get"](f"{name}/progress.json")).get("step") or 0)
    except Exception:
        return 0


def test_logs_then_gc_after_controller_sigkill(lab, s3_lab, tmp_path):
    env = {**lab, **s3_lab["env"], "DTRUN_HOME": str(tmp_path / "dtrun-home")}
    name = "lab-gc"
    job = job_yaml(tmp_path, name, s3_lab["bucket"], steps=100000, every=5000)  # runs until stopped
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli.app", "up", str(job), "--yes"], env=env,
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        wait_until(lambda: step(s3_lab, name) >= 20, 1500, "the lab node never trained")
        logs = dtrun(["logs", name], env, timeout=300).stdout
        assert "[dtrun-node" in logs and "step " in logs, logs[-2000:]
        os.killpg(proc.pid, signal.SIGKILL)  # the controller dies with everything it started
        proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    [inst] = [i for i in lablib.call("status")["instances"] if i["name"].startswith(f"dtrun-{name}-a1")]
    assert inst["status"] == "active"  # left billing

    gc = dtrun(["gc", "--yes"], env, timeout=900, check=False)
    assert gc.returncode == 0, gc.stdout[-3000:] + gc.stderr[-3000:]
    assert f"dtrun-{name}-a1" in gc.stdout, gc.stdout
    wait_until(lambda: not lablib.call("status")["instances"], 120, "gc left the instance")
    assert lablib.call("bill")["running"] == 0
