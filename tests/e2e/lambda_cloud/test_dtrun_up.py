"""`dtrun up` with providers: [lambda] against the lab: the real dtrun CLI, SkyPilot's own API
server started the way dtrun starts it, moto S3 on the bridge's host IP, a tiny model on 2 CPU
ranks per node. One launch with the first region out of capacity (SkyPilot fails over inside the
launch), then: SUCCEEDED, DONE in the run URI, the cluster gone, the lab's bill stopped and within
5 % of `dtrun cost`, `dtrun logs` with the trainer's lines."""

from __future__ import annotations

import json
import time

import pytest

from tests.e2e.lambda_cloud.conftest import check_money, dtrun, job_yaml, wait_until
from tests.e2e.clouds.lambdalab import lab as lablib

pytestmark = pytest.mark.timeout(2400)  # a launch takes minutes on 2 shared cores


def test_up_succeeds_with_region_failover_and_bill_matches(lab, s3_lab, tmp_path):
    env = {**lab, **s3_lab["env"], "DTRUN_HOME": str(tmp_path / "dtrun-home")}
    job = job_yaml(tmp_path, "lab-up", s3_lab["bucket"], steps=30)
    lablib.call("capacity", {"region": "us-east-1", "on": False})
    try:
        t0 = time.monotonic()
        p = dtrun(["up", str(job), "--yes"], env, timeout=1800, check=False)
        took = time.monotonic() - t0
    finally:
        lablib.call("capacity", {"region": "us-east-1", "on": True})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    st = json.loads(dtrun(["status", "lab-up", "--json"], env).stdout)
    assert st["state"] == "SUCCEEDED" and st["step"] == 30, st  # (an attempt whose launch never reached
    # the cloud — SkyPilot's API server not starting under load — is retried; the bill below shows one instance)
    assert s3_lab["exists"]("lab-up/DONE")

    # the cluster is gone (down=True / dtrun's terminate) and the bill has stopped
    wait_until(lambda: not lablib.call("status")["instances"], 120, "the lab still lists an instance")
    bill = lablib.call("bill")
    assert bill["running"] == 0
    rows = [r for r in bill["instances"] if r["name"].startswith("dtrun-lab-up-a")]
    assert len(rows) == 1 and rows[0]["region"] in ("us-west-1", "us-south-1"), rows  # failed over past us-east-1
    assert rows[0]["how"] == "terminated"
    time.sleep(3)
    assert lablib.call("bill")["total_usd"] == bill["total_usd"]  # nothing billed after DONE

    cost = json.loads(dtrun(["cost", "lab-up", "--json"], env).stdout)
    check_money(cost, rows)

    logs = dtrun(["logs", "lab-up"], env).stdout
    assert "dtrun-node" in logs and "DTRUN_EXIT_CODE=0" in logs, logs[-2000:]
    print(f"dtrun up (launch → SUCCEEDED → cluster gone): {took:.0f} s; lab bill ${rows[0]['usd']:.4f}, "
          f"dtrun cost ${cost['cost_usd']:.4f}")


