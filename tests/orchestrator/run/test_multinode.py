"""Several nodes without a cloud: each node's record in the job's state and `dtrun status`, one
node's output with `dtrun logs --node`, refusals before renting where SkyPilot has no multi-node,
and the money side (an attempt of N spot nodes ends when any one is lost; N × GPUs × hours).

The controller runs against the fake cloud on a virtual clock; a two-node "cluster" plays its
nodes through the run-URI contract, writing ``nodes/a<A>/node-<R>.json`` as the node bootstrap does
(the bootstrap's own writing is tested in tests/infra/test_node_bootstrap.py, and on the emulated
Lambda cloud in tests/e2e)."""

from __future__ import annotations

import json

import pytest
import yaml

from orchestrator.cli.app import main
from orchestrator.contract import runuri
from orchestrator.plan import estimate as est_mod
from orchestrator.plan.spec import parse_spec
from orchestrator.run.clock import VirtualClock
from orchestrator.run.controller import Controller
from orchestrator.run.simulate import simulate
from orchestrator.run.state import StateStore
from providers.fake import FakeOfferTemplate, FakeProvider

STEPS, STEP_S, EVERY = 300, 10.0, 100


class TwoNodes:
    """A fake-cloud workload: a cluster of two nodes training one run. Each node reports itself
    (record + log) as the bootstrap does; on attempt 1 node 1 vanishes at 25 minutes (its record
    is left RUNNING: a lost node writes nothing more) and the provider reports the cluster gone."""

    def __init__(self) -> None:
        self.start: dict[str, int] = {}

    def __call__(self, inst, now):
        uri, a = inst.env["DTRUN_RUN_URI"], int(inst.env["DTRUN_ATTEMPT"])
        if inst.id not in self.start:
            lc = runuri.latest_committed(uri)
            self.start[inst.id] = lc[0] if lc else 0
        s0 = self.start[inst.id]
        step = min(STEPS, s0 + int((now - inst.ready_at) / STEP_S))
        for k in range(s0 + 1, step + 1):
            if k % EVERY == 0 or k == STEPS:
                runuri.write_json(runuri.join(runuri.checkpoint_uri(uri, k), runuri.COMMITTED), {"step": k})
        runuri.write_json(runuri.join(uri, runuri.PROGRESS), {"step": step, "steps": STEPS, "loss": 2.0,
                                                              "time": now, "attempt": a})
        done = step >= STEPS
        for rank in (0, 1):
            runuri.write_json(runuri.node_uri(uri, a, rank), {
                "attempt": a, "rank": rank, "nnodes": 2, "ip": f"10.{a}.0.{rank + 2}", "host": f"n{rank}",
                "state": "EXITED" if done else "RUNNING", "exit_code": 0 if done else None, "updated": now})
            runuri.write_text(runuri.node_uri(uri, a, rank, "log"), f"attempt {a} node {rank} step {step}\n")
        if done:
            runuri.write_json(runuri.join(uri, runuri.DONE), {"step": step, "loss": 1.0, "time": now})
            return (0, now)
        return None


class LostWorker(TwoNodes):
    """Attempt 1 as SkyPilot reported it on the emulated Lambda cloud: node 1's machine vanished
    at step 150 (its record left RUNNING), node 0's ranks found their peer gone and exited 75, and
    the cluster's job came back FAILED without the exit marker (its driver saw node 1's task die)."""

    def __call__(self, inst, now):
        a = int(inst.env["DTRUN_ATTEMPT"])
        if a == 1 and now - inst.ready_at >= 150 * STEP_S:
            uri = inst.env["DTRUN_RUN_URI"]
            runuri.write_json(runuri.node_uri(uri, 1, 0), {
                "attempt": 1, "rank": 0, "nnodes": 2, "ip": "10.1.0.2", "host": "n0", "state": "EXITED",
                "exit_code": 75, "updated": now})
            return (1, now)
        return super().__call__(inst, now)


def _run_without_restarts(tmp_path, workload) -> tuple[str, StateStore]:
    """Run the two-node job on the fake cloud with ``max_restarts_on_errors: 0``: a trainer
    failure ends the job at once."""
    clock = VirtualClock()
    cloud = FakeProvider(clock=clock, offers=[FakeOfferTemplate("fake-east", "H100", True, 1.0)],
                         provision_seconds=60, autodown_seconds=None, workload=workload)
    store = StateStore()
    spec = _spec(tmp_path)
    spec.recovery.max_restarts_on_errors = 0
    return Controller(spec, store, clock=clock, providers={"fake": cloud}).run(), store


def test_a_lost_node_that_fails_the_cluster_job_is_a_preemption_not_a_trainer_failure(tmp_path, dtrun_home):
    state, store = _run_without_restarts(tmp_path, LostWorker())
    assert state == "SUCCEEDED"
    atts = store.attempts("twonodes")
    assert [a["outcome"] for a in atts] == ["preempted", "succeeded"], [a["reason"] for a in atts]
    assert "node 1 of 2 stopped reporting (lost); node 0 exited 75" in atts[0]["reason"]
    assert store.get_job("twonodes")["restarts_used"] == 0


class CrashedWorker(TwoNodes):
    """The same cluster job FAILED, but node 1 reported its own exit 1 (its trainer crashed): that
    is a trainer failure, whatever node 0 exited with."""

    def __call__(self, inst, now):
        if now - inst.ready_at >= 150 * STEP_S:
            uri, a = inst.env["DTRUN_RUN_URI"], int(inst.env["DTRUN_ATTEMPT"])
            for rank, code in ((0, 75), (1, 1)):
                runuri.write_json(runuri.node_uri(uri, a, rank), {
                    "attempt": a, "rank": rank, "nnodes": 2, "ip": f"10.{a}.0.{rank + 2}", "host": f"n{rank}",
                    "state": "EXITED", "exit_code": code, "updated": now})
            return (1, now)
        return super().__call__(inst, now)


def test_a_node_that_reports_its_own_failure_is_a_trainer_failure(tmp_path, dtrun_home):
    state, store = _run_without_restarts(tmp_path, CrashedWorker())
    assert state == "FAILED"
    assert [a["outcome"] for a in store.attempts("twonodes")] == ["failed"]


def _spec(tmp_path, **res):
    return parse_spec({
        "name": "twonodes",
        "resources": {"providers": ["fake"], "gpu": "H100", "gpus_per_node": 8, "nodes": 2, "spot": True, **res},
        "trainer": {"model": "tiny", "steps": STEPS, "batch_size": 16, "seq_len": 64},
        "checkpoint": {"uri": f"file://{tmp_path}/run", "every_steps": EVERY},
        "budget": {"max_usd": 1000.0},
        "recovery": {"poll_seconds": 30, "backoff_seconds": 10, "heartbeat_timeout_seconds": 300},
    })


def test_node_records_reach_the_job_state_status_and_logs(tmp_path, dtrun_home, capsys):
    clock = VirtualClock()
    cloud = FakeProvider(clock=clock, offers=[FakeOfferTemplate("fake-east", "H100", True, 1.0)],
                         provision_seconds=60, autodown_seconds=None, workload=TwoNodes())
    cloud.script("dtrun-twonodes-a1", preempt_after=1500)  # one node of two lost: the attempt ends
    store = StateStore()
    c = Controller(_spec(tmp_path), store, clock=clock, providers={"fake": cloud})
    assert c.run() == "SUCCEEDED"
    atts = store.attempts("twonodes")
    assert [a["outcome"] for a in atts] == ["preempted", "succeeded"]
    # The job's record keeps each node of each attempt: rank, private IP, state.
    first, last = atts[0]["cluster"], atts[1]["cluster"]
    assert [(r["rank"], r["ip"]) for r in first] == [(0, "10.1.0.2"), (1, "10.1.0.3")]
    assert [(r["rank"], r["ip"], r["state"], r["exit_code"]) for r in last] == [
        (0, "10.2.0.2", "EXITED", 0), (1, "10.2.0.3", "EXITED", 0)]
    assert atts[1]["start_step"] == 100  # resumed from the last COMMITTED step (lost at ~step 144)

    assert main(["status", "twonodes", "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert [(n["rank"], n["ip"], n["state"], n["exit_code"]) for n in st["cluster"]] == [
        (0, "10.2.0.2", "EXITED", 0), (1, "10.2.0.3", "EXITED", 0)]
    assert main(["status", "twonodes"]) == 0
    text = capsys.readouterr().out
    assert "node 1: 10.2.0.3 (n1) EXITED exit 0" in text and "dtrun logs twonodes --node 1" in text

    # Attempt 1 ended with its records still RUNNING (the lost node never reported again): GONE.
    from orchestrator.cli.jobs import cluster_nodes

    assert {n["state"] for n in cluster_nodes(c.run_uri, atts[0], live=True)} == {"GONE"}

    assert main(["logs", "twonodes", "--node", "1"]) == 0
    out = capsys.readouterr().out
    assert "attempt 2 node 1 step 300" in out and "node 0" not in out.split("---\n", 1)[1]
    assert main(["logs", "twonodes", "--node", "0", "--attempt", "1"]) == 0
    assert "attempt 1 node 0 step" in capsys.readouterr().out
    assert main(["logs", "twonodes", "--node", "5"]) == 6  # no such node: exit 6, says which reported
    err = capsys.readouterr().err
    assert "--node 5" in err and "nodes that reported: 0, 1" in err


def test_single_node_jobs_show_no_cluster(tmp_path, dtrun_home, capsys):
    clock = VirtualClock()
    cloud = FakeProvider(clock=clock, offers=[FakeOfferTemplate("fake-east", "H100", False, 1.0)],
                         provision_seconds=60, autodown_seconds=None, workload=TwoNodes())
    store = StateStore()
    spec = _spec(tmp_path, nodes=1, spot=False)
    Controller(spec, store, clock=clock, providers={"fake": cloud}).run()
    assert store.attempts("twonodes")[0]["cluster"] == []


# ---- refused before renting where SkyPilot has no multi-node ---------------------------------

GPT2 = {"name": "mn", "resources": {"gpu": "H100", "gpus_per_node": 8, "nodes": 2},
        "trainer": {"model": "gpt2-124m", "tokens": 100_000_000, "batch_size": 64, "seq_len": 1024},
        "checkpoint": {"uri": "s3://bucket/{name}"}, "budget": {"max_usd": 1000}}


@pytest.mark.parametrize("provider,why", [
    ("runpod", "SkyPilot: multi-node is not supported on RunPod"),
    ("vast", "SkyPilot: multi-node is not supported on Vast"),
    ("modal", "a Modal sandbox is one container"),
])
def test_two_nodes_refused_before_renting(tmp_path, dtrun_home, provider_credentials, monkeypatch, capsys,
                                          provider, why):
    monkeypatch.setenv("DTRUN_SKY_CATALOG_DIR", str(tmp_path / "no-catalogs"))
    f = tmp_path / "job.yaml"
    f.write_text(yaml.safe_dump({**GPT2, "resources": {**GPT2["resources"], "providers": [provider]}}))
    assert main(["up", str(f), "--dry-run", "--json"]) == 4
    out = json.loads(capsys.readouterr().out)
    assert out["chosen"] is None
    assert any(f"multi-node is not available on {provider}" in r and why in r for r in out["refusals"]), out
    # `dtrun up --yes` refuses the same way: exit 4, the reason, and nothing launched or recorded.
    assert main(["up", str(f), "--yes"]) == 4
    cap = capsys.readouterr()
    assert f"multi-node is not available on {provider}" in cap.out + cap.err
    store = StateStore()
    assert store.nodes("mn") == [] and store.attempts("mn") == []


# ---- money: one lost node ends the attempt; N nodes × GPUs × hours ------------------------------

def _sim_spec(nodes, spot=True, rate=1.0):
    return parse_spec({
        "name": "simmn",
        "resources": {"providers": ["fake"], "gpu": "H100", "gpus_per_node": 8, "nodes": nodes, "spot": spot,
                      "preemptions_per_hour": rate},
        "trainer": {"model": "gpt2-124m", "tokens": 2_000_000_000, "batch_size": 512, "seq_len": 1024},
        "checkpoint": {"every_steps": 200},
        "budget": {"max_usd": 1000},
    })


def test_estimate_counts_a_cluster_preemption_per_node():
    one = est_mod.make_plan(_sim_spec(1)).estimate.breakdown
    two = est_mod.make_plan(_sim_spec(2)).estimate.breakdown
    assert one["preemptions_per_hour"] == 1.0 and one["nodes"] == 1
    assert two["preemptions_per_hour"] == 2.0 and two["preemptions_per_node_hour"] == 1.0 and two["nodes"] == 2
    # per hour of work, a two-node attempt is lost about twice as often
    assert two["expected_preemptions"] / two["compute_hours"] > 1.8 * one["expected_preemptions"] / one["compute_hours"]
    assert two["price_per_hour"] == pytest.approx(16 * two["price_per_gpu_hour"])


def test_simulate_bills_nodes_times_gpus_and_loses_attempts_per_node(dtrun_home):
    od = simulate(_sim_spec(2, spot=False), runs=2, seed=1)
    assert od["states"] == {"SUCCEEDED": 2} and od["nodes"] == 2
    # on-demand, nothing random: the fake cloud's bill is 2 nodes × 8 GPUs × price × the hours it ran
    assert od["price_per_hour"] == pytest.approx(16 * _price(_sim_spec(2, spot=False)))
    assert od["cost_usd_mean"] == pytest.approx(od["price_per_hour"] * od["wall_hours_mean"], rel=0.02)
    spot2 = simulate(_sim_spec(2), runs=40, seed=3)
    spot1 = simulate(_sim_spec(1), runs=40, seed=3)
    assert spot2["preemptions_per_hour"] == 2.0 and spot2["preemptions_per_node_hour"] == 1.0
    # the two-node run is lost more often per hour it runs than one node (each loss ends the attempt)
    assert (spot2["preemptions_mean"] / spot2["wall_hours_mean"]) > 1.3 * (spot1["preemptions_mean"] / spot1["wall_hours_mean"])


def _price(spec) -> float:
    return est_mod.make_plan(spec).chosen.price_per_gpu_hour
