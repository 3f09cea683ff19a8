"""The team cap while jobs run, on the fake cloud with SQLite and real PostgreSQL: a team's running
jobs are stopped with a checkpoint (STOP written, the node checkpoints and exits by itself) before
the team's ``monthly_usd`` is crossed — the same stop as a job's own budget (OVER_BUDGET), its
reason naming the team cap — while another team's job runs on; what was booked equals the fake
cloud's bill and stays under the cap."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from orchestrator.contract import runuri
from orchestrator.plan.spec import parse_spec
from orchestrator.run.clock import VirtualClock
from orchestrator.run.state import StateStore
from orchestrator.server.auth import create_team, create_user
from orchestrator.server.db import make_engine, session_scope
from orchestrator.server.jobs import submit_job
from orchestrator.server.migrate import upgrade
from orchestrator.server.models import Event, Job
from orchestrator.server.replica import Replica
from providers.fake import FakeOfferTemplate, FakeProvider

STEPS, STEP_S, TICK = 100_000, 10.0, 30.0
CAP = 1.0


def workload(inst, now):
    """A trainer that reports progress, and on STOP writes a checkpoint marker and exits 0."""
    uri = inst.env["DTRUN_RUN_URI"]
    step = int((now - inst.ready_at) / STEP_S)
    if runuri.exists(runuri.join(uri, runuri.STOP)):
        runuri.write_json(runuri.join(uri, "stopped-checkpoint.json"), {"step": step})
        return (0, now)
    runuri.write_json(runuri.join(uri, runuri.PROGRESS),
                      {"step": step, "steps": STEPS, "loss": 2.0, "tokens_per_s": 1.0, "time": now,
                       "attempt": int(inst.env["DTRUN_ATTEMPT"]), "last_committed_step": None})
    return None


def spec_dict(tmp_path, name):
    return {"name": name, "resources": {"providers": ["fake"], "gpu": "H100", "gpus_per_node": 1},
            "trainer": {"model": "tiny", "steps": STEPS, "batch_size": 8, "seq_len": 64},
            "checkpoint": {"uri": f"file://{tmp_path}/{name}", "every_steps": 1000},
            "budget": {"max_usd": 100.0},  # far above the team's cap: only the team cap can stop them
            "recovery": {"poll_seconds": 30, "heartbeat_timeout_seconds": 100_000},
            "teardown": {"idle_minutes": 10_000}}


def test_running_jobs_stop_with_a_checkpoint_before_the_team_cap(tmp_path, db_url):
    clock = VirtualClock()
    cloud = FakeProvider(clock=clock, offers=[FakeOfferTemplate("fake-east", "H100", False, 1.0)],
                         provision_seconds=60, autodown_seconds=None, workload=workload)
    engine = make_engine(db_url)
    upgrade(engine)
    with session_scope(engine) as s:
        capped, free = create_team(s, "capped", monthly_usd=CAP), create_team(s, "free")
        ua, ub = create_user(s, capped, "ann"), create_user(s, free, "bob")
        for team, user, name in ((capped, ua, "c1"), (capped, ua, "c2"), (free, ub, "f1")):
            spec = spec_dict(tmp_path, name)
            parse_spec(spec)
            submit_job(s, team, user, name, spec, None)
    r = Replica(engine, StateStore(tmp_path / "state.db"), {"fake": cloud}, clock, replica_id="r1", ttl=90.0,
                write_lease=False, tick_seconds=TICK)
    for _ in range(200):
        r.tick()
        clock.advance(TICK)
        with session_scope(engine) as s:
            states = {j.name: j.state for j in s.scalars(select(Job))}
        if states["c1"] == states["c2"] == "stopped":
            break
    with session_scope(engine) as s:
        jobs = {j.name: j for j in s.scalars(select(Job))}
        guard = [e.text for e in s.scalars(select(Event).where(Event.kind == "state"))]
    assert {n: j.state for n, j in jobs.items()} == {"c1": "stopped", "c2": "stopped", "f1": "running"}
    for name in ("c1", "c2"):
        assert "team budget: team 'capped'" in jobs[name].reason and "monthly_usd $1.00" in jobs[name].reason
        assert "stopping with a checkpoint" in jobs[name].reason
        assert runuri.exists(f"file://{tmp_path}/{name}/stopped-checkpoint.json")  # the node saw STOP
        assert "team budget" in runuri.read_text(f"file://{tmp_path}/{name}/STOP")
    assert any("stopped" in t and "team budget" in t for t in guard)
    booked = jobs["c1"].spend_usd + jobs["c2"].spend_usd
    billed = sum(row["cost_usd"] for row in cloud.bill()["rows"] if row["name"].startswith("dtrun-c"))
    assert CAP * 0.85 < booked < CAP  # stopped near the cap, never over it
    assert booked == pytest.approx(billed, abs=0.01)
    assert booked == pytest.approx(StateStore(tmp_path / "state.db").spend_total("c1")
                                   + StateStore(tmp_path / "state.db").spend_total("c2"), abs=1e-9)
    assert [i.name for i in cloud.instances() if i.gone_at is None] == ["dtrun-f1-a1"]
    for ctl in list(r.controllers.values()):
        ctl.teardown.terminate_all(sleep=lambda _s: clock.advance(1))
    engine.dispose()
