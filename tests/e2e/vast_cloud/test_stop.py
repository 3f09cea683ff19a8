"""Stopping a spot run on the Vast lab (as the Lambda and RunPod labs' test_stop):

* `dtrun down JOB` mid-run (its controller alive): the trainer writes a final checkpoint, the
  instance is destroyed through SkyPilot (not merely stopped: a stopped Vast instance bills its
  storage), the job ends CANCELLED; the lab lists no instance and nothing bills.
* the controller SIGKILLed mid-run (the instance keeps billing at its bid) → `dtrun gc --yes`
  finds it as an orphan and destroys it; nothing bills."""

from __future__ import annotations

import json
import os
import signal
from contextlib import contextmanager

import pytest

from tests.e2e.clouds.vastlab import lab as lablib
from tests.e2e.lambda_cloud.conftest import dtrun, dtrun_up_running
from tests.e2e.vast_cloud.conftest import job_yaml, live_vast_prices
from tests.e2e.vast_cloud.test_dtrun import whole_market  # noqa: F401 - the fixture: the market as the lab started it
from tests.e2e.waiting import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]


def _step(vs_s3, name: str) -> int:
    try:
        return int(json.loads(vs_s3["get"](f"{name}/progress.json")).get("step") or 0)
    except Exception:  # noqa: BLE001 - not there yet
        return 0


def _mine(name: str, what: str = "status") -> list[dict]:
    return [i for i in lablib.call(what)["instances"] if (i["label"] or "").startswith(f"dtrun-{name}-")]


@contextmanager
def _training(vs_lab, vs_s3, tmp_path, name: str):
    """A spot job that trains until it is stopped, under `dtrun up`, once its instance trained 20 steps."""
    env = {**vs_lab, **vs_s3["env"], "DTRUN_HOME": str(tmp_path / "dtrun-home")}
    live_vast_prices(env)  # dtrun's bid from the lab
    job = job_yaml(tmp_path, name, f"s3://{vs_s3['bucket']}/{{name}}", steps=100000, every=5000)
    with dtrun_up_running(job, env) as proc:
        wait_until(lambda: _step(vs_s3, name) >= 20 or proc.poll() is not None, 1200, "the instance never trained")
        assert proc.poll() is None, proc.stdout.read()[-4000:]
        yield env, proc


def _nothing_billing(name: str, what: str) -> list[dict]:
    wait_until(lambda: not _mine(name), 180, what)
    rows = _mine(name, "bill")
    assert rows and not any(r["billing"] for r in rows), rows  # compute and storage both stopped
    return rows


def test_down_mid_run_checkpoints_and_destroys_the_instance(vs_lab, vs_s3, whole_market, tmp_path):  # noqa: F811
    name = "vs-down"
    with _training(vs_lab, vs_s3, tmp_path, name) as (env, proc):
        at = _step(vs_s3, name)
        down = dtrun(["down", name], env, timeout=1200)
        out, _ = proc.communicate(timeout=600)
    st = json.loads(dtrun(["status", name, "--json"], env).stdout)
    assert st["state"] == "CANCELLED", (st, down.stdout[-2000:], out[-2000:])
    keys = [k for k in vs_s3["keys"](f"{name}/checkpoints/") if k.endswith("/COMMITTED")]
    committed = [int(k.split("/step-")[1].split("/")[0]) for k in keys]
    assert committed and max(committed) >= at, (committed, at)  # the final checkpoint (periodic: every 5000)
    rows = _nothing_billing(name, "the lab still lists the instance")
    assert [r["how"] for r in rows] == ["destroyed"], rows


def test_gc_after_controller_sigkill_destroys_the_instance(vs_lab, vs_s3, whole_market, tmp_path):  # noqa: F811
    name = "vs-gc"
    with _training(vs_lab, vs_s3, tmp_path, name) as (env, proc):
        os.killpg(proc.pid, signal.SIGKILL)  # the controller dies with everything it started
        proc.communicate(timeout=30)
    [i] = _mine(name)
    assert i["is_bid"], i  # left billing at its bid
    gc = dtrun(["gc", "--yes"], env, timeout=900, check=False)
    assert gc.returncode == 0, gc.stdout[-3000:] + gc.stderr[-3000:]
    assert f"dtrun-{name}-a1" in gc.stdout, gc.stdout
    rows = _nothing_billing(name, "gc left the instance")
    assert [r["how"] for r in rows] == ["destroyed"], rows
