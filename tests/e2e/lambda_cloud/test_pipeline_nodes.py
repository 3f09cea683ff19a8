"""Pipeline parallelism across nodes on the emulated Lambda cloud: `dtrun up` of a two-node job
with ``pp: 2 × dp_shard: 2`` (2 CPU ranks per node, gloo over the lab's bridge). pp is the
outermost mesh dimension, so node 0's two ranks hold stage 0 (the embedding and layer 0) and
node 1's hold stage 1 (layer 1, the norm and the head): only the activations and their gradients
(1f1b, 4 microbatches) cross the nodes' link. Each rank logs its stage at start
(``trainer.pipeline.placement``); the test reads that from each node's log.

The worker instance is preempted mid-run, after a COMMITTED checkpoint → the head's ranks end
(exit 75: the peer's connections close; trainer.collective_timeout_seconds bounds a silent loss),
dtrun tears attempt 1 down, launches a new two-node cluster, resumes from the last committed step
and ends bit-identical to a local uninterrupted world-4 run of the same trainer section (DONE
``param_digest``). Nothing is left afterwards."""

from __future__ import annotations

import json
import time

import pytest

from orchestrator.plan.presets import resolve_model
from tests.e2e.clouds.lambdalab import lab as lablib
from tests.e2e.lambda_cloud.conftest import (
    check_money, dtrun, dtrun_up_running, progress, wait_for_next_attempt, wait_until,
)
from tests.e2e.lambda_cloud.test_multinode import _job, _local_digest, _nothing_left

PP = {"pp": 2, "dp_shard": 2, "pp_schedule": "1f1b", "pp_microbatches": 4}  # 1f1b needs ≥ pp microbatches
# tiny (2 layers: one per stage) untied: a pipeline refuses one embedding weight on its first and last stage
UNTIED = resolve_model("tiny").model_copy(update={"tie_embeddings": False}).model_dump(exclude_none=True)
TRAINER = {"model": UNTIED, "collective_timeout_seconds": 30}

pytestmark = pytest.mark.timeout(3000)  # two launches of two nodes on 2 shared cores


def _stages(log: str) -> set[tuple[int, int, int]]:
    """(rank, node, stage) of every ``pipeline: rank R (node N, …) runs stage S of 2`` line."""
    import re

    return {tuple(map(int, m)) for m in
            re.findall(r"pipeline: rank (\d+) \(node (\d+), local rank \d+\) runs stage (\d+) of 2 ", log)}


def test_pp2_one_stage_per_node_preempted_resumes_bit_identical(lab, s3_lab, tmp_path):
    env = {**lab, **s3_lab["env"], "DTRUN_HOME": str(tmp_path / "dtrun-home")}
    name, steps, every = "pp-nodes", 120, 10
    job = _job(tmp_path, name, s3_lab["bucket"], PP, steps=steps, every=every, **TRAINER)
    t0 = time.time()
    with dtrun_up_running(job, env) as proc:
        # mid-run, after a COMMITTED checkpoint (the resume point must be one of attempt 1's steps)
        wait_until(lambda: (progress(s3_lab, name).get("last_committed_step") or 0) >= every, 2400,
                   f"no committed checkpoint of step {every} on the lab nodes")
        t_first = time.time() - t0
        workers = [i for i in lablib.call("status")["instances"]
                   if i["name"].startswith(f"dtrun-{name}-a1") and i["name"].endswith("-worker")]
        if len(workers) != 1:  # attempt 1 ended on its own: say how
            st = dtrun(["status", name, "--json"], env, check=False).stdout
            tails = [dtrun(["logs", name, "--node", str(r), "--attempt", "1"], env, check=False).stdout[-3000:]
                     for r in (0, 1)]
            raise AssertionError(f"no worker of attempt 1: {lablib.call('status')}\n{st}\n" + "\n---\n".join(tails))
        at = progress(s3_lab, name)
        assert at.get("attempt", 1) == 1 and at["step"] < steps, at  # still running when the node goes
        t_lost = time.time()
        assert lablib.call("preempt", {"name": workers[0]["name"]})["preempted"] == [workers[0]["name"]]
        wait_until(lambda: not [i for i in lablib.call("status")["instances"] if f"dtrun-{name}-a1" in i["name"]],
                   900, "attempt 1's head instance is still there")
        head_gone = time.time() - t_lost
        wait_for_next_attempt(s3_lab, name, 2400)
        back = time.time() - t_lost
        out, _ = proc.communicate(timeout=2400)
    took = time.time() - t0
    assert proc.returncode == 0, out[-4000:]
    st = json.loads(dtrun(["status", name, "--json"], env).stdout)
    assert st["state"] == "SUCCEEDED" and st["attempts_total"] == 2, st
    assert [(n["rank"], n["state"], n["exit_code"]) for n in st["cluster"]] == [(0, "EXITED", 0), (1, "EXITED", 0)]
    cost = json.loads(dtrun(["cost", name, "--json"], env).stdout)
    assert [a["outcome"] for a in sorted(cost["attempts"], key=lambda a: a["attempt"])] == ["preempted", "succeeded"]
    # one stage per node: node 0 runs ranks 0, 1 on stage 0, node 1 ranks 2, 3 on stage 1 (attempt 2;
    # of attempt 1 the head's log: the preempted worker's last seconds of output went with it, as on
    # a real cloud — its log is uploaded every 15 s)
    logs = {(a, r): dtrun(["logs", name, "--node", str(r), "--attempt", str(a)], env).stdout
            for a, r in ((1, 0), (2, 0), (2, 1))}
    for a in (1, 2):
        assert _stages(logs[a, 0]) == {(0, 0, 0), (1, 0, 0)}, (a, logs[a, 0][-3000:])
    assert _stages(logs[2, 1]) == {(2, 1, 1), (3, 1, 1)}, logs[2, 1][-3000:]
    print("attempt 1, the head's last lines:\n" + "\n".join(logs[1, 0].splitlines()[-6:]))
    done = json.loads(s3_lab["get"](f"{name}/DONE"))
    assert done["step"] == steps and done["world_size"] == 4, done
    assert done["parallel"] == {"dp_replicate": 1, "dp_shard": 2, "ep": 1, "pp": 2, "tp": 1}, done["parallel"]
    rows = _nothing_left(name)
    assert len(rows) == 4 and sorted(r["how"] for r in rows) == ["preempted", "terminated", "terminated", "terminated"]
    check_money(cost, rows)
    assert done["param_digest"] == _local_digest(tmp_path, env, f"{name}-local", PP, steps, every, **TRAINER)
    print(f"pp2 × dp_shard2 on 2 nodes: launch → SUCCEEDED {took:.0f} s (first committed checkpoint "
          f"{t_first:.0f} s after launch); worker preempted at step {at['step']} (committed "
          f"{at['last_committed_step']}); attempt 1's head gone {head_gone:.0f} s later; attempt 2 training "
          f"{back:.0f} s after the preemption")
