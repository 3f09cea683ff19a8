"""The lab itself, driven through SkyPilot's own Lambda client (lambda_utils.LambdaCloudClient):
the wire format, capacity, a real node over SSH, preemption, the bill."""

from __future__ import annotations

import subprocess
import time

import pytest

from tests.e2e.clouds.lambdalab import lab as lablib
from tests.e2e.clouds.lambdalab import node


@pytest.fixture
def client(lab, monkeypatch, tmp_path):
    from sky.provision.lambda_cloud import lambda_utils

    monkeypatch.setenv("HOME", lab["HOME"])
    monkeypatch.setattr(lambda_utils, "API_ENDPOINT", lab["DTRUN_LAB_ENDPOINT"])
    key = tmp_path / "key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    c = lambda_utils.LambdaCloudClient()
    name = f"test-key-{time.time_ns()}"
    c.register_ssh_key(name, (tmp_path / "key.pub").read_text())
    return c, name, key


def _ssh(key, ip: str, cmd: str) -> str:
    return subprocess.run(["ssh", "-i", str(key), "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
                           "-o", "BatchMode=yes", "-o", "LogLevel=ERROR", f"ubuntu@{ip}", cmd],
                          capture_output=True, text=True, timeout=60, check=True).stdout


def test_capacity_launch_ssh_preempt_bill(client):
    from sky.provision.lambda_cloud import lambda_utils

    c, keyname, key = client
    assert {"us-east-1", "us-west-1"} <= {r["name"] for r in c.list_catalog()["gpu_1x_a10"]["regions_with_capacity_available"]}
    assert c.list_catalog()["gpu_1x_a10"]["instance_type"]["price_cents_per_hour"] == 129  # the catalog's $1.29

    lablib.call("capacity", {"region": "us-east-1", "on": False})
    with pytest.raises(lambda_utils.LambdaCloudError, match="insufficient-capacity"):
        c.create_instances("gpu_1x_a10", "us-east-1", 1, "t-head", keyname)
    lablib.call("capacity", {"region": "us-east-1", "on": True})

    [iid] = c.create_instances("gpu_1x_a10", "us-east-1", 1, "t-head", keyname)
    for _ in range(300):
        [inst] = [i for i in c.list_instances() if i["id"] == iid]
        if inst["status"] == "active":
            break
        assert inst["status"] == "booting"
        time.sleep(0.2)
    assert inst["status"] == "active" and inst["ip"] == inst["private_ip"]
    out = _ssh(key, inst["ip"], "id -un; sudo -n id -un; hostname; ps -e --no-headers | wc -l; "
                                "sudo touch /etc/dtlab-probe && ls /etc/dtlab-probe")
    user, root, host, nproc, probe = out.split()
    assert (user, root, probe) == ("ubuntu", "root", "/etc/dtlab-probe")
    assert host.startswith("lambda-") and int(nproc) < 15  # its own PID namespace
    import os
    assert not os.path.exists("/etc/dtlab-probe")  # the node's /etc is its own

    r = lablib.call("preempt", {"name": "t-head"})
    assert r["preempted"] == ["t-head"]
    assert [i for i in c.list_instances() if i["id"] == iid] == []
    assert node.all_netns() == []
    [b] = [b for b in lablib.call("bill")["instances"] if b["id"] == iid]
    assert b["how"] == "preempted" and not b["running"]
    assert b["usd"] == pytest.approx(b["seconds"] / 3600 * 1.29, rel=1e-3, abs=1e-6)  # the bill rounds to 1e-6
