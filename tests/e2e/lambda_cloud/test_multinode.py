"""Several nodes on the emulated Lambda cloud: `dtrun up` with `resources.nodes: 2` (2 CPU ranks
per node, gloo over the lab's bridge) → SkyPilot provisions a two-instance cluster, both run the
node bootstrap, torchrun's rendezvous on the head's private IP, checkpoints from all four ranks
to S3 (moto on the bridge), DONE, both instances gone.

* FSDP over 4 ranks on 2 nodes: the final parameters equal a local world-4 run of the same
  trainer section (DONE ``param_digest``); `dtrun status` lists both nodes (rank, private IP,
  EXITED 0) and `dtrun logs --node N` prints each node's output; the lab bills two instances.
* HSDP (dp_replicate 2 × dp_shard 2) with one node lost: the worker instance is preempted mid-run
  → the head's ranks end (collective timeout / teardown, not a hang), dtrun tears the cluster
  down, launches a new two-node cluster, resumes from the last COMMITTED step, and ends
  bit-identical to a local uninterrupted world-4 HSDP run. Nothing is left afterwards."""

from __future__ import annotations

import json
import re
import time

import pytest
import yaml

from tests.e2e.lambda_cloud.conftest import (
    check_money, dtrun, dtrun_up_running, job_yaml, step, wait_for_next_attempt, wait_until,
)
from tests.e2e.clouds.lambdalab import lab as lablib

HSDP = {"dp_replicate": 2, "dp_shard": 2}

pytestmark = pytest.mark.timeout(3000)  # two launches of two nodes on 2 shared cores


def _job(tmp_path, name: str, bucket: str, parallel: dict, *, steps: int, every: int, local: bool = False,
         **trainer) -> "Path":  # noqa: F821
    p = job_yaml(tmp_path, name, bucket, steps=steps, every=every, nodes=2,
                 provider="local" if local else "lambda", uri=f"file://{tmp_path}/{name}" if local else None)
    data = yaml.safe_load(p.read_text())
    data["trainer"]["parallel"] = parallel
    data["trainer"].update(trainer)
    if local:  # the same trainer section as one local world of 4 CPU ranks
        data["resources"].update(gpu="cpu", gpus_per_node=4, nodes=1)
    p.write_text(yaml.safe_dump(data))
    return p


def _local_digest(tmp_path, env, name: str, parallel: dict, steps: int, every: int, **trainer) -> str:
    job = _job(tmp_path, name, "", parallel, steps=steps, every=every, local=True, **trainer)
    dtrun(["up", str(job), "--yes"], {**env, "HOME": str(tmp_path)}, timeout=900)
    return json.loads((tmp_path / name / "DONE").read_text())["param_digest"]


def _bill_rows(name: str) -> list[dict]:
    return sorted((r for r in lablib.call("bill")["instances"] if r["name"].startswith(f"dtrun-{name}-")),
                  key=lambda r: (r["start"], r["name"]))


def _nothing_left(name: str) -> list[dict]:
    wait_until(lambda: not lablib.call("status")["instances"], 180, "the lab still lists an instance")
    rows = _bill_rows(name)
    assert lablib.call("bill")["running"] == 0
    return rows


def test_two_nodes_fsdp_matches_local_world4(lab, s3_lab, tmp_path):
    env = {**lab, **s3_lab["env"], "DTRUN_HOME": str(tmp_path / "dtrun-home")}
    name, steps = "mn-fsdp", 30
    job = _job(tmp_path, name, s3_lab["bucket"], {"dp_shard": 4}, steps=steps, every=10)
    t0 = time.monotonic()
    p = dtrun(["up", str(job), "--yes"], env, timeout=2400, check=False)
    took = time.monotonic() - t0
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    st = json.loads(dtrun(["status", name, "--json"], env).stdout)
    assert st["state"] == "SUCCEEDED" and st["attempts_total"] == 1 and st["step"] == steps, st
    nodes = st["cluster"]
    assert [n["rank"] for n in nodes] == [0, 1], nodes
    assert all(n["ip"].startswith("10.77.0.") for n in nodes) and nodes[0]["ip"] != nodes[1]["ip"], nodes
    assert [(n["state"], n["exit_code"]) for n in nodes] == [("EXITED", 0), ("EXITED", 0)], nodes
    done = json.loads(s3_lab["get"](f"{name}/DONE"))
    assert done["world_size"] == 4
    # checkpoints written by the ranks of both nodes (DCP names its files ``__<rank>_<n>.distcp``)
    files = [k.rsplit("/", 1)[1] for k in s3_lab["keys"](f"{name}/checkpoints/step-{steps}/") if k.endswith(".distcp")]
    assert {int(f[2:].split("_")[0]) for f in files} == {0, 1, 2, 3}, files
    for r in (0, 1):
        out = dtrun(["logs", name, "--node", str(r)], env).stdout
        assert f"node {r}/2" in out and f"ip {nodes[r]['ip']}" in out and "trainer exited 0" in out, out[-2000:]
    joined = _joined(dtrun(["logs", name, "--node", "0"], env).stdout)
    rows = _nothing_left(name)
    assert len(rows) == 2 and {r["how"] for r in rows} == {"terminated"}, rows  # head and worker
    check_money(json.loads(dtrun(["cost", name, "--json"], env).stdout), rows)
    assert done["param_digest"] == _local_digest(tmp_path, env, f"{name}-local", {"dp_shard": 4}, steps, 10)
    print(f"two-node dtrun up (launch → SUCCEEDED → both instances gone): {took:.0f} s; 4 ranks on 2 nodes "
          f"joined the process group in {joined:.1f} s; node records {json.dumps(nodes)}")


def _joined(head_log: str) -> float:
    """The trainer's own measure of the rendezvous (rank 0, in the head node's log)."""
    m = re.search(r"4 ranks on 2 node\(s\) joined the process group in ([0-9.]+) s", head_log)
    assert m, head_log[-3000:]
    return float(m.group(1))


def test_one_node_lost_hsdp_resumes_bit_identical(lab, s3_lab, tmp_path):
    env = {**lab, **s3_lab["env"], "DTRUN_HOME": str(tmp_path / "dtrun-home")}
    name, steps, every = "mn-lost", 120, 10
    trainer = {"collective_timeout_seconds": 30}
    job = _job(tmp_path, name, s3_lab["bucket"], HSDP, steps=steps, every=every, **trainer)
    with dtrun_up_running(job, env) as proc:
        wait_until(lambda: step(s3_lab, name) >= 15, 2400, "no step 15 on the lab nodes")
        workers = [i for i in lablib.call("status")["instances"]
                   if i["name"].startswith(f"dtrun-{name}-a1") and i["name"].endswith("-worker")]
        assert len(workers) == 1, lablib.call("status")
        at_step = step(s3_lab, name)
        t_lost = time.time()
        assert lablib.call("preempt", {"name": workers[0]["name"]})["preempted"] == [workers[0]["name"]]
        # the head's ranks end on their own; the controller ends the attempt and tears the head down
        wait_until(lambda: not [i for i in lablib.call("status")["instances"] if f"dtrun-{name}-a1" in i["name"]],
                   900, "attempt 1's head instance is still there")
        head_gone = time.time() - t_lost
        wait_for_next_attempt(s3_lab, name, 2400)
        back = time.time() - t_lost
        out, _ = proc.communicate(timeout=2400)
    assert proc.returncode == 0, out[-4000:]
    st = json.loads(dtrun(["status", name, "--json"], env).stdout)
    assert st["state"] == "SUCCEEDED" and st["attempts_total"] == 2, st
    assert [(n["rank"], n["state"]) for n in st["cluster"]] == [(0, "EXITED"), (1, "EXITED")], st["cluster"]
    cost = json.loads(dtrun(["cost", name, "--json"], env).stdout)
    assert [a["outcome"] for a in sorted(cost["attempts"], key=lambda a: a["attempt"])] == ["preempted", "succeeded"]
    # the output of both nodes of the lost attempt is still readable
    lost = {r: dtrun(["logs", name, "--node", str(r), "--attempt", "1"], env).stdout for r in (0, 1)}
    for r in (0, 1):
        assert f"node {r}/2" in lost[r], lost[r][-2000:]
    print("attempt 1, the head's last lines:\n" + "\n".join(lost[0].splitlines()[-8:]))
    joined = [_joined(lost[0]), _joined(dtrun(["logs", name, "--node", "0"], env).stdout)]
    done = json.loads(s3_lab["get"](f"{name}/DONE"))
    assert done["step"] == steps and done["parallel"]["dp_replicate"] == 2
    rows = _nothing_left(name)
    assert len(rows) == 4 and sorted(r["how"] for r in rows) == ["preempted", "terminated", "terminated", "terminated"]
    check_money(cost, rows)
    assert done["param_digest"] == _local_digest(tmp_path, env, f"{name}-local", HSDP, steps, every, **trainer)
    print(f"worker preempted at step {at_step}; attempt 1's head gone {head_gone:.0f} s later; "
          f"both nodes of attempt 2 training {back:.0f} s after the preemption; process group joined in "
          f"{joined[0]:.1f} s (attempt 1), {joined[1]:.1f} s (attempt 2)")
