"""A server job's attempts through the API: the replica copies each attempt's outcome and booked
spend from its controllers' state store into the server's ``attempts`` table, and
``GET /v1/jobs/{name}/cost`` (``dtrun cost --json`` through the server, from any laptop) lists
them — a job preempted once shows attempt 1 preempted, attempt 2 succeeded, each booked as its
controller booked it (the fake cloud's bill). SQLite and real PostgreSQL."""

from __future__ import annotations

from fastapi.testclient import TestClient

from orchestrator.contract import runuri
from orchestrator.plan.spec import parse_spec
from orchestrator.run.clock import VirtualClock
from orchestrator.run.state import StateStore
from orchestrator.server.api import create_app
from orchestrator.server.auth import create_team, create_user, issue_token
from orchestrator.server.db import make_engine, session_scope
from orchestrator.server.jobs import submit_job
from orchestrator.server.migrate import upgrade
from orchestrator.server.replica import Replica
from providers.fake import FakeOfferTemplate, FakeProvider

STEPS, STEP_S = 60, 10.0


def sim_trainer(inst, now):
    uri = inst.env["DTRUN_RUN_URI"]
    step = min(STEPS, int((now - inst.ready_at) / STEP_S))
    runuri.write_json(runuri.join(uri, runuri.PROGRESS),
                      {"step": step, "steps": STEPS, "loss": 2.0, "tokens_per_s": 1.0, "time": now,
                       "attempt": int(inst.env["DTRUN_ATTEMPT"]), "last_committed_step": None})
    if step >= STEPS:
        runuri.write_json(runuri.join(uri, runuri.DONE), {"step": step, "loss": 1.0, "tokens": step, "time": now})
        return (0, inst.ready_at + STEPS * STEP_S)
    return None


def test_cost_through_the_server_lists_the_attempts(tmp_path, db_url):
    clock = VirtualClock()
    cloud = FakeProvider(clock=clock, offers=[FakeOfferTemplate("fake-east", "H100", True, 1.0)],
                         provision_seconds=60, autodown_seconds=None, workload=sim_trainer)
    cloud.script("dtrun-att-a1", preempt_after=300)
    engine = make_engine(db_url)
    upgrade(engine)
    spec = {"name": "att", "resources": {"providers": ["fake"], "gpu": "H100", "gpus_per_node": 1, "spot": True},
            "trainer": {"model": "tiny", "steps": STEPS, "batch_size": 8, "seq_len": 64},
            "checkpoint": {"uri": f"file://{tmp_path}/run", "every_steps": 20}, "budget": {"max_usd": 100.0},
            "recovery": {"poll_seconds": 30, "backoff_seconds": 10, "heartbeat_timeout_seconds": 600}}
    parse_spec(spec)
    with session_scope(engine) as s:
        team = create_team(s, "alpha")
        user = create_user(s, team, "ann")
        token = issue_token(s, user)
        submit_job(s, team, user, "att", spec, None)
    store = StateStore(tmp_path / "state.db")
    r = Replica(engine, store, {"fake": cloud}, clock, replica_id="r1", ttl=90.0, write_lease=False)
    client = TestClient(create_app(engine, get=lambda n: cloud), raise_server_exceptions=False)
    head = {"Authorization": f"Bearer {token}"}
    for _ in range(200):
        r.tick()
        clock.advance(30)
        if client.get("/v1/jobs/att", headers=head).json()["state"] == "finished":
            break
    d = client.get("/v1/jobs/att/cost", headers=head).json()
    assert d["state"] == "finished"
    assert [(a["attempt"], a["provider"], a["outcome"]) for a in d["attempts"]] == \
        [(1, "fake", "preempted"), (2, "fake", "succeeded")], d
    booked = {row["attempt"]: row["usd"] for row in store.spend_by_attempt("att")}
    assert {a["attempt"]: a["usd"] for a in d["attempts"]} == booked and all(v > 0 for v in booked.values())
    assert abs(sum(booked.values()) - d["spend_usd"]) < 1e-9
    engine.dispose()
