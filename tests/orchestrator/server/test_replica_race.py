"""Replicas racing for jobs on the fake cloud, on SQLite and real PostgreSQL: N replicas tick M
jobs on a virtual clock, replicas are killed at random (dropped between ticks, nothing torn
down — what SIGKILL leaves) and replaced; every job must finish, each attempt launched exactly
once (one fake instance per attempt name), and the spend booked equal the fake cloud's bill —
with the controllers' state store one SQLite file all replicas share (one machine), and in the
server database (``CtlStore``), each replica with its own engine and store (one machine each)."""

from __future__ import annotations

import collections
import random

import pytest
from sqlalchemy import select

from orchestrator.contract import runuri
from orchestrator.plan.spec import spec_to_yaml, parse_spec
from orchestrator.run.clock import VirtualClock
from orchestrator.run.state import StateStore
from orchestrator.server.ctlstore import CtlStore
from orchestrator.server.db import make_engine, session_scope
from orchestrator.server.jobs import submit_job
from orchestrator.server.migrate import upgrade
from orchestrator.server.models import Event, Job, Lease, Team, User
from orchestrator.server.replica import Replica
from providers.fake import FakeOfferTemplate, FakeProvider

STEPS, STEP_S = 200, 10.0


def sim_trainer(inst, now):
    """One step every STEP_S from the node's ready time; DONE at STEPS (a real run-URI write)."""
    uri = inst.env["DTRUN_RUN_URI"]
    step = min(STEPS, int((now - inst.ready_at) / STEP_S))
    runuri.write_json(runuri.join(uri, runuri.PROGRESS),
                      {"step": step, "steps": STEPS, "loss": 2.0, "tokens_per_s": 1.0, "time": now,
                       "attempt": int(inst.env["DTRUN_ATTEMPT"]), "last_committed_step": None})
    if step >= STEPS:
        runuri.write_json(runuri.join(uri, runuri.DONE), {"step": step, "loss": 1.0, "tokens": step, "time": now})
        return (0, inst.ready_at + STEPS * STEP_S)
    return None


def spec_dict(tmp_path, i):
    return {
        "name": f"race{i}",
        "resources": {"providers": ["fake"], "gpu": "H100", "gpus_per_node": 1, "spot": True},
        "trainer": {"model": "tiny", "steps": STEPS, "batch_size": 8, "seq_len": 64},
        "checkpoint": {"uri": f"file://{tmp_path}/run{i}", "every_steps": 50},
        "budget": {"max_usd": 100.0},
        "recovery": {"poll_seconds": 30, "backoff_seconds": 10, "heartbeat_timeout_seconds": 600},
    }


@pytest.mark.parametrize("seed,where", [(1, "file"), (2, "file"), (1, "database"), (2, "database")])
def test_replicas_killed_at_random_finish_every_job_once_with_spend_equal_to_the_bill(tmp_path, db_url, seed, where):
    rng = random.Random(seed)
    clock = VirtualClock()
    cloud = FakeProvider(clock=clock, offers=[FakeOfferTemplate("fake-east", "H100", True, 1.0)],
                         provision_seconds=60, autodown_seconds=None, workload=sim_trainer)
    for i in range(0, 6, 2):  # half the jobs are preempted once: a second attempt, maybe by another owner
        cloud.script(f"dtrun-race{i}-a1", preempt_after=600 + 200 * i)
    engine = make_engine(db_url)
    upgrade(engine)
    store = StateStore(tmp_path / "state.db") if where == "file" else CtlStore(engine)
    engines = []
    m_jobs = 6
    with session_scope(engine) as s:
        team = Team(name="ml")
        s.add(team)
        s.flush()
        user = User(team_id=team.id, name="ada", role="member")
        s.add(user)
        s.flush()
        for i in range(m_jobs):
            spec = spec_dict(tmp_path, i)
            parse_spec(spec)  # valid
            submit_job(s, team, user, spec["name"], spec, None)

    def new_replica(k):
        own = store
        if where == "database":  # another machine: its own engine and store, nothing shared but the database
            engines.append(make_engine(db_url))
            own = CtlStore(engines[-1])
        return Replica(engine, own, {"fake": cloud}, clock, replica_id=f"r{k}", ttl=90.0, max_jobs=3,
                       write_lease=False)

    replicas = [new_replica(k) for k in range(3)]
    born, kills = 3, 0
    for _round in range(400):
        for r in list(replicas):
            r.tick()
        if rng.random() < 0.15:  # kill one at random, start a fresh one in its place
            replicas.remove(rng.choice(replicas))
            replicas.append(new_replica(born))
            born, kills = born + 1, kills + 1
        clock.advance(30)
        with session_scope(engine) as s:
            if all(j.state == "finished" for j in s.scalars(select(Job))):
                break
    with session_scope(engine) as s:
        jobs = list(s.scalars(select(Job)))
        assert {j.name: j.state for j in jobs} == {f"race{i}": "finished" for i in range(m_jobs)}, kills
        booked = sum(j.spend_usd for j in jobs)
        epochs = [lease.epoch for lease in s.scalars(select(Lease))]
        reattached = [e for e in s.scalars(select(Event).where(Event.kind == "state"))]
    assert kills > 0 and max(epochs) > 1  # ownership did change hands
    names = collections.Counter(i.name for i in cloud.instances())
    assert names and all(n == 1 for n in names.values()), names  # each attempt launched once
    assert len([n for n in names if n.endswith("-a1")]) == m_jobs
    assert sorted(n for n in names if n.endswith("-a2")) == ["dtrun-race0-a2", "dtrun-race2-a2", "dtrun-race4-a2"]
    assert [i for i in cloud.instances() if i.gone_at is None] == []
    assert booked > 0 and booked == pytest.approx(cloud.bill()["total_usd"], abs=0.01)
    assert booked == pytest.approx(sum(store.spend_total(f"race{i}") for i in range(m_jobs)), abs=1e-9)
    assert reattached
    for e in engines:
        e.dispose()
    engine.dispose()


def test_a_second_replica_waits_while_the_first_is_healthy_and_a_paused_one_launches_nothing(tmp_path, db_url):
    clock = VirtualClock()
    cloud = FakeProvider(clock=clock, offers=[FakeOfferTemplate("fake-east", "H100", True, 1.0)],
                         provision_seconds=60, autodown_seconds=None, workload=sim_trainer)
    cloud.script("dtrun-race0-a1", preempt_after=300)  # the node dies while A is paused
    store = StateStore(tmp_path / "state.db")
    engine = make_engine(db_url)
    upgrade(engine)
    with session_scope(engine) as s:
        team = Team(name="ml")
        s.add(team)
        s.flush()
        user = User(team_id=team.id, name="ada")
        s.add(user)
        s.flush()
        submit_job(s, team, user, "race0", spec_dict(tmp_path, 0), None)
    a, b = (Replica(engine, store, {"fake": cloud}, clock, replica_id=r, ttl=90.0, write_lease=False) for r in "AB")
    for _ in range(5):  # A healthy: B only polls, claims nothing
        a.tick()
        b.tick()
        clock.advance(30)
    assert list(a.owned) == [1] and b.owned == {} and b.controllers == {}
    for _ in range(12):  # A paused (a long GC, SIGSTOP): its lease expires, B takes over and relaunches
        b.tick()
        clock.advance(30)
    assert list(b.owned) == [1]
    with session_scope(engine) as s:
        assert s.get(Lease, 1).replica == "B" and s.get(Lease, 1).epoch == 2
    launched = sorted(i.name for i in cloud.instances())
    assert launched == ["dtrun-race0-a1", "dtrun-race0-a2"]
    a.tick()  # A wakes: it finds its lease gone and drops the job without ticking its controller
    assert a.owned == {} and a.controllers == {}
    assert sorted(i.name for i in cloud.instances()) == launched
    engine.dispose()
