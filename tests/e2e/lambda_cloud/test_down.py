"""`dtrun down JOB` mid-run (its controller alive): the trainer writes a final checkpoint, the
cluster is terminated, the job ends CANCELLED; the lab lists no instance and the bill stops."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.e2e.lambda_cloud.conftest import REPO, dtrun, job_yaml, wait_until
from tests.e2e.lambda_cloud.test_gc import step
from tests.e2e.lambdalab import lab as lablib

pytestmark = pytest.mark.timeout(2400)  # a launch takes minutes on 2 shared cores


def test_down_mid_run_checkpoints_and_terminates(lab, s3_lab, tmp_path):
    env = {**lab, **s3_lab["env"], "DTRUN_HOME": str(tmp_path / "dtrun-home")}
    name = "lab-down"
    job = job_yaml(tmp_path, name, s3_lab["bucket"], steps=100000, every=5000)  # runs until stopped
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli.app", "up", str(job), "--yes"], env=env,
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until(lambda: step(s3_lab, name) >= 20, 1500, "the lab node never trained")
        at = step(s3_lab, name)
        down = dtrun(["down", name], env, timeout=1200)
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    st = json.loads(dtrun(["status", name, "--json"], env).stdout)
    assert st["state"] == "CANCELLED", (st, down.stdout[-2000:], out[-2000:])
    committed = [int(k.split("/step-")[1].split("/")[0]) for k in s3_lab["keys"](f"{name}/checkpoints/")
                 if k.endswith("/COMMITTED")]
    assert committed and max(committed) >= at, (committed, at)  # the final checkpoint (periodic: every 5000)
    wait_until(lambda: not lablib.call("status")["instances"], 120, "the lab still lists the instance")
    assert lablib.call("bill")["running"] == 0
