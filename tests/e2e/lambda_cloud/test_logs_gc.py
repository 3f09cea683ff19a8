"""`dtrun logs` while the node trains, then the controller SIGKILLed mid-run (nothing tears the
cluster down: the node keeps billing) → `dtrun gc --yes` finds the cluster as an orphan and
removes it; the lab lists no instance and the bill stops."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from tests.e2e.lambda_cloud.conftest import REPO, dtrun, job_yaml, wait_until
from tests.e2e.lambdalab import lab as lablib


def test_logs_while_running_then_gc_after_controller_sigkill(lab, s3_lab, tmp_path):
    env = {**lab, **s3_lab["env"], "DTRUN_HOME": str(tmp_path / "dtrun-home")}
    name = "lab-gc"
    job = job_yaml(tmp_path, name, s3_lab["bucket"], steps=100000, every=500)  # runs until killed
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli.app", "up", str(job), "--yes"], env=env,
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        def training():
            try:
                return json.loads(s3_lab["get"](f"{name}/progress.json")).get("step", 0) >= 20
            except Exception:
                return False
        wait_until(training, 1500, "the lab node never trained")
        logs = dtrun(["logs", name], env, timeout=300).stdout
        assert "[dtrun-node" in logs and "step " in logs, logs[-2000:]
        os.killpg(proc.pid, signal.SIGKILL)  # the controller dies; SkyPilot's API server was its child
        proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    [inst] = [i for i in lablib.call("status")["instances"] if i["name"].startswith(f"dtrun-{name}-a1")]
    assert inst["status"] == "active"  # left billing
    t0 = time.monotonic()
    p = dtrun(["gc", "--yes"], env, timeout=900, check=False)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert f"dtrun-{name}-a1" in p.stdout
    wait_until(lambda: not lablib.call("status")["instances"], 120, "gc left the instance")
    assert lablib.call("bill")["running"] == 0
    print(f"gc removed the orphan in {time.monotonic() - t0:.0f} s")
