"""Stopping a spot run on the RunPod lab, the two ways a user meets (as the Lambda lab's test_stop):

* `dtrun down JOB` mid-run (its controller alive): the trainer writes a final checkpoint, the pod is
  terminated through SkyPilot, the job ends CANCELLED; the lab lists no pod and the bill stops.
* the controller SIGKILLed mid-run (nothing tears the pod down: it keeps billing at the bid) →
  `dtrun gc --yes` finds it as an orphan and removes it; the lab lists no pod and the bill stops."""

from __future__ import annotations

import json
import os
import signal
from contextlib import contextmanager

import pytest

from tests.e2e.clouds.runpodlab import lab as lablib
from tests.e2e.lambda_cloud.conftest import dtrun, dtrun_up_running
from tests.e2e.runpod_cloud.conftest import job_yaml
from tests.e2e.waiting import wait_until

pytestmark = pytest.mark.timeout(2400)  # a launch takes minutes on 2 shared cores


def _step(rp_s3, name: str) -> int:
    try:
        return int(json.loads(rp_s3["get"](f"{name}/progress.json")).get("step") or 0)
    except Exception:  # noqa: BLE001 - not there yet
        return 0


@contextmanager
def _training(rp_lab, rp_s3, tmp_path, name: str):
    """A spot job that trains until it is stopped, under `dtrun up`, once its pod trained 20 steps."""
    env = {**rp_lab, **rp_s3["env"], "DTRUN_HOME": str(tmp_path / "dtrun-home")}
    job = job_yaml(tmp_path, name, f"s3://{rp_s3['bucket']}/{{name}}", steps=100000, every=5000)
    with dtrun_up_running(job, env) as proc:
        wait_until(lambda: _step(rp_s3, name) >= 20 or proc.poll() is not None, 1500, "the pod never trained")
        assert proc.poll() is None, proc.stdout.read()[-4000:]
        yield env, proc


def _nothing_billing(name: str, what: str) -> list[dict]:
    wait_until(lambda: not lablib.call("status")["pods"], 180, what)
    bill = lablib.call("bill")
    assert bill["running"] == 0, bill
    return [r for r in bill["pods"] if r["name"].startswith(f"dtrun-{name}-")]


def test_down_mid_run_checkpoints_and_terminates_the_pod(rp_lab, rp_s3, tmp_path):
    name = "rp-down"
    with _training(rp_lab, rp_s3, tmp_path, name) as (env, proc):
        at = _step(rp_s3, name)
        down = dtrun(["down", name], env, timeout=1200)
        out, _ = proc.communicate(timeout=600)
    st = json.loads(dtrun(["status", name, "--json"], env).stdout)
    assert st["state"] == "CANCELLED", (st, down.stdout[-2000:], out[-2000:])
    keys = [k for k in rp_s3["keys"](f"{name}/checkpoints/") if k.endswith("/COMMITTED")]
    committed = [int(k.split("/step-")[1].split("/")[0]) for k in keys]
    assert committed and max(committed) >= at, (committed, at)  # the final checkpoint (periodic: every 5000)
    rows = _nothing_billing(name, "the lab still lists the pod")
    assert [r["how"] for r in rows] == ["terminated"], rows


def test_gc_after_controller_sigkill_removes_the_pod(rp_lab, rp_s3, tmp_path):
    name = "rp-gc"
    with _training(rp_lab, rp_s3, tmp_path, name) as (env, proc):
        os.killpg(proc.pid, signal.SIGKILL)  # the controller dies with everything it started
        proc.communicate(timeout=30)
    pods = [p for p in lablib.call("status")["pods"] if p["name"].startswith(f"dtrun-{name}-a1")]
    assert len(pods) == 1 and pods[0]["podType"] == "INTERRUPTABLE", pods  # left billing at its bid
    gc = dtrun(["gc", "--yes"], env, timeout=900, check=False)
    assert gc.returncode == 0, gc.stdout[-3000:] + gc.stderr[-3000:]
    assert f"dtrun-{name}-a1" in gc.stdout, gc.stdout
    rows = _nothing_billing(name, "gc left the pod")
    assert [r["how"] for r in rows] == ["terminated"], rows

