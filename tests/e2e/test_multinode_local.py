"""One node of two lost, then a new two-node cluster resumes: bit-identical to a run never
interrupted. Two torchrun "nodes" on this machine (``--nnodes 2``, static rendezvous on 127.0.0.1,
as the node bootstrap runs them on a cluster), 2 ranks each, HSDP (dp_replicate 2 × dp_shard 2),
checkpoints from all four ranks to S3 (moto). Node 1 is SIGKILLed after step 4 is COMMITTED:
node 0's ranks must end on their own (the next collective fails; not hang), and the relaunched
pair resumes from the last COMMITTED step to the same final parameters (sha256 digest).
In `make e2e`, not `make test`: three two-node runs take minutes on the shared box."""

from __future__ import annotations

import signal
import time

import pytest

from orchestrator.contract import runuri
from tests.trainer.conftest import Trainer, free_port, two_nodes, wait_for

pytestmark = pytest.mark.slow


@pytest.fixture
def trainer(tmp_path):
    t = Trainer(tmp_path)
    yield t
    t.cleanup()

STEPS, EVERY = 12, 4
SLOW = {"DTRUN_DEBUG_STEP_SLEEP": "0.3"}
HSDP = {"dp_replicate": 2, "dp_shard": 2}


def _cluster(trainer, job, env=None):
    port = free_port()
    return [trainer.start(job, 2, env=env, launch=two_nodes(port, r)) for r in (0, 1)]


def _finish(nodes, timeout=240):
    outs = []
    for p in nodes:
        out, _ = p.communicate(timeout=timeout)
        outs.append(out)
    return [p.returncode for p in nodes], outs


def test_one_node_lost_then_a_new_cluster_resumes_bit_identical(trainer, s3_bucket):
    def job(name, uri):
        return trainer.job(name, nproc=4, run_uri=uri, steps=STEPS, every=EVERY, parallel=HSDP)

    ref = f"{s3_bucket}/ref"
    rcs, outs = _finish(_cluster(trainer, job("ref", ref)))
    assert rcs == [0, 0], outs[0][-3000:]
    done = runuri.read_json(runuri.join(ref, "DONE"))
    assert done["step"] == STEPS and done["world_size"] == 4

    lost = f"{s3_bucket}/lost"
    n0, n1 = _cluster(trainer, job("lost", lost), env=SLOW)
    wait_for(lambda: runuri.committed(lost, EVERY) is not None, timeout=180, what=f"step {EVERY} committed")
    t_kill = time.monotonic()
    trainer.kill(n1, signal.SIGKILL)  # the node's whole process group: launcher and both ranks
    n1.wait(timeout=60)
    try:
        out0, _ = n0.communicate(timeout=120)  # the survivors end on their own: the collective fails
    except Exception:
        trainer.kill(n0)
        raise AssertionError("node 0 hung after node 1 was lost")
    survivor_s = time.monotonic() - t_kill
    assert n0.returncode == runuri.EXIT_PREEMPTED, out0[-2000:]  # 75: "resume me" (a lost peer)
    assert not runuri.exists(runuri.join(lost, "DONE"))
    last = runuri.latest_committed(lost)[0]
    assert last >= EVERY and last < STEPS

    rcs, outs = _finish(_cluster(trainer, job("lost", lost)))  # a new two-node cluster
    assert rcs == [0, 0], outs[0][-3000:]
    assert f"resumed from checkpoint step {last}" in outs[0]
    again = runuri.read_json(runuri.join(lost, "DONE"))
    assert again["param_digest"] == done["param_digest"]
    print(f"survivors ended {survivor_s:.1f} s after node 1 was killed (exit {n0.returncode})")
