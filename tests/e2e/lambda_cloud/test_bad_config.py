"""A GPU job on the lab's GPU-less nodes: `trainer.device: auto` (the default) on an H100-SXM
offer. On the node the trainer finds CUDA unusable and exits 2 ("bad config: do not retry"); a
SkyPilot node leaves no exit file on the controller's machine, only its record and its log in the
run URI. The controller reads the exit code there → one attempt, FAILED at once, the reason
names CUDA in the trainer's own words; one cluster was launched and it is gone. (Before issue 28
the exit read as a trainer failure: relaunched `recovery.max_restarts_on_errors` times, each
launch paid.)"""

from __future__ import annotations

import json

import pytest

from tests.e2e.clouds.lambdalab import lab as lablib
from tests.e2e.lambda_cloud.conftest import dtrun, job_yaml, wait_until

pytestmark = pytest.mark.timeout(2400)  # a launch takes minutes on 2 shared cores

CPU_LINE = "  device: cpu  # the lab's nodes have no GPU: CPU ranks on the H100-labelled node, said explicitly\n"


def test_a_gpu_job_on_a_node_without_cuda_fails_once_naming_cuda(lab, s3_lab, tmp_path):
    env = {**lab, **s3_lab["env"], "DTRUN_HOME": str(tmp_path / "dtrun-home")}
    name = "lab-nocuda"
    job = job_yaml(tmp_path, name, s3_lab["bucket"], steps=30)
    text = job.read_text()
    assert CPU_LINE in text
    job.write_text(text.replace(CPU_LINE, "  device: auto  # a GPU job: the trainer must find CUDA\n"))

    p = dtrun(["up", str(job), "--yes"], env, timeout=1800, check=False)
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]  # the job ended FAILED
    st = json.loads(dtrun(["status", name, "--json"], env).stdout)
    headline = (st["reason"] or "").splitlines()[0]
    assert st["state"] == "FAILED", st
    assert "rejected its configuration (exit 2)" in headline and "CUDA" in headline, st["reason"]
    cost = json.loads(dtrun(["cost", name, "--json"], env).stdout)
    # one attempt reached a node and failed; none was relaunched (an attempt whose launch never
    # reached the cloud, SkyPilot's API server not starting under load, would be a launch_error)
    tried = [a for a in cost["attempts"] if a["outcome"] != "launch_error"]
    assert [a["outcome"] for a in tried] == ["failed"], cost["attempts"]

    wait_until(lambda: not lablib.call("status")["instances"], 120, "the lab still lists an instance")
    bill = lablib.call("bill")
    assert bill["running"] == 0
    rows = [r for r in bill["instances"] if r["name"].startswith(f"dtrun-{name}-a")]
    assert len(rows) == 1, rows  # one cluster launched, and it is gone
