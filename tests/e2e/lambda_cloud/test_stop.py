"""Stopping a run on the lab, the two ways a user meets:

* `dtrun down JOB` mid-run (its controller alive): the trainer writes a final checkpoint, the
  cluster is terminated, the job ends CANCELLED; the lab lists no instance and the bill stops.
* `dtrun logs` while the node trains; then the controller is SIGKILLed mid-run (nothing tears the
  cluster down: the node keeps billing) → `dtrun gc --yes` finds the cluster as an orphan (a live
  node whose controller died on this host) and removes it; the lab lists no instance and the bill
  stops."""

from __future__ import annotations

import json
import os
import signal
from contextlib import contextmanager

import pytest

from tests.e2e.lambda_cloud.conftest import dtrun, dtrun_up_running, job_yaml, step, wait_until
from tests.e2e.clouds.lambdalab import lab as lablib

pytestmark = pytest.mark.timeout(2400)  # a launch takes minutes on 2 shared cores


@contextmanager
def _training(lab, s3_lab, tmp_path, name: str):
    """A job that trains until it is stopped, running under `dtrun up`, once its node has trained
    20 steps: yields (env, the `dtrun up` process)."""
    env = {**lab, **s3_lab["env"], "DTRUN_HOME": str(tmp_path / "dtrun-home")}
    job = job_yaml(tmp_path, name, s3_lab["bucket"], steps=100000, every=5000)
    with dtrun_up_running(job, env) as proc:
        wait_until(lambda: step(s3_lab, name) >= 20, 1500, "the lab node never trained")
        yield env, proc


def _nothing_billing(what: str) -> None:
    wait_until(lambda: not lablib.call("status")["instances"], 120, what)
    assert lablib.call("bill")["running"] == 0


def test_down_mid_run_checkpoints_and_terminates(lab, s3_lab, tmp_path):
    name = "lab-down"
    with _training(lab, s3_lab, tmp_path, name) as (env, proc):
        at = step(s3_lab, name)
        down = dtrun(["down", name], env, timeout=1200)
        out, _ = proc.communicate(timeout=600)
    st = json.loads(dtrun(["status", name, "--json"], env).stdout)
    assert st["state"] == "CANCELLED", (st, down.stdout[-2000:], out[-2000:])
    committed = [int(k.split("/step-")[1].split("/")[0]) for k in s3_lab["keys"](f"{name}/checkpoints/")
                 if k.endswith("/COMMITTED")]
    assert committed and max(committed) >= at, (committed, at)  # the final checkpoint (periodic: every 5000)
    _nothing_billing("the lab still lists the instance")


def test_logs_then_gc_after_controller_sigkill(lab, s3_lab, tmp_path):
    name = "lab-gc"
    with _training(lab, s3_lab, tmp_path, name) as (env, proc):
        logs = dtrun(["logs", name], env, timeout=300).stdout
        assert "[dtrun-node" in logs and "step " in logs, logs[-2000:]
        os.killpg(proc.pid, signal.SIGKILL)  # the controller dies with everything it started
        proc.communicate(timeout=30)
    [inst] = [i for i in lablib.call("status")["instances"] if i["name"].startswith(f"dtrun-{name}-a1")]
    assert inst["status"] == "active"  # left billing

    gc = dtrun(["gc", "--yes"], env, timeout=900, check=False)
    assert gc.returncode == 0, gc.stdout[-3000:] + gc.stderr[-3000:]
    assert f"dtrun-{name}-a1" in gc.stdout, gc.stdout
    _nothing_billing("gc left the instance")
