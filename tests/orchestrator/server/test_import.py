"""``dtrun server import`` (the real CLI) of an embedded ``~/.dtrun`` made by real controllers on the
fake cloud, into SQLite and real PostgreSQL: ended jobs arrive with their state, attempts (a
preempted one included), booked spend and events; the team's month counts that spend; a job still
running is skipped and named; a second run imports nothing new; the source is left as it was."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys

import pytest
from sqlalchemy import select

from orchestrator.contract import runuri
from orchestrator.plan.spec import parse_spec
from orchestrator.run.clock import VirtualClock
from orchestrator.run.controller import Controller
from orchestrator.run.state import StateStore
from orchestrator.server import budget
from orchestrator.server.auth import create_team, create_user
from orchestrator.server.db import make_engine, session_scope
from orchestrator.server.migrate import upgrade
from orchestrator.server.models import Attempt, Event, Job, Team
from providers.fake import FakeOfferTemplate, FakeProvider

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
STEPS, STEP_S = 60, 10.0


def sim_trainer(inst, now):
    uri = inst.env["DTRUN_RUN_URI"]
    step = min(STEPS, int((now - inst.ready_at) / STEP_S))
    runuri.write_json(runuri.join(uri, runuri.PROGRESS),
                      {"step": step, "steps": STEPS, "loss": 2.0, "tokens_per_s": 1.0, "time": now,
                       "attempt": int(inst.env["DTRUN_ATTEMPT"]), "last_committed_step": None})
    if step >= STEPS and not inst.name.endswith("long-a1"):
        runuri.write_json(runuri.join(uri, runuri.DONE), {"step": step, "loss": 1.0, "tokens": step, "time": now})
        return (0, inst.ready_at + STEPS * STEP_S)
    return None


def spec(tmp_path, name):
    return parse_spec({"name": name, "resources": {"providers": ["fake"], "gpu": "H100", "gpus_per_node": 1,
                                                    "spot": True},
                       "trainer": {"model": "tiny", "steps": STEPS, "batch_size": 8, "seq_len": 64},
                       "checkpoint": {"uri": f"file://{tmp_path}/runs/{name}"}, "budget": {"max_usd": 100.0},
                       "recovery": {"poll_seconds": 30, "backoff_seconds": 10},
                       "teardown": {"idle_minutes": 10_000}})


def embedded_home(tmp_path):
    """A ~/.dtrun with: done (SUCCEEDED after a preemption), stopped (CANCELLED), long (RUNNING)."""
    clock = VirtualClock()
    cloud = FakeProvider(clock=clock, offers=[FakeOfferTemplate("fake-east", "H100", True, 2.0)],
                         provision_seconds=60, autodown_seconds=None, workload=sim_trainer)
    cloud.script("dtrun-done-a1", preempt_after=300)
    store = StateStore(tmp_path / "home" / "state.db")
    ctls = {n: Controller(spec(tmp_path, n), store, clock=clock, providers={"fake": cloud}, write_lease=False)
            for n in ("done", "stopped", "long")}
    for i in range(200):
        for n, c in ctls.items():
            c.tick()
        if i == 10:
            store.request_action("stopped", "stop")
        clock.advance(30)
        if store.get_job("done")["state"] == "SUCCEEDED" and store.get_job("stopped")["state"] == "CANCELLED":
            break
    states = {n: store.get_job(n)["state"] for n in ctls}
    assert states == {"done": "SUCCEEDED", "stopped": "CANCELLED", "long": "RUNNING"}
    return store, ctls


def _dtrun(args, env):
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def _counts(path):
    with sqlite3.connect(path) as c:
        return {t: c.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] for t in ("jobs", "attempts", "events", "spend")}


def test_import_brings_ended_jobs_attempts_and_spend_once(tmp_path, db_url):
    store, ctls = embedded_home(tmp_path)
    engine = make_engine(db_url)
    upgrade(engine)
    with session_scope(engine) as s:
        t = create_team(s, "ml", monthly_usd=500.0)
        create_user(s, t, "ann", "admin")
    before = _counts(tmp_path / "home" / "state.db")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DTRUN_")}
    env.update(DTRUN_HOME=str(tmp_path / "elsewhere"), PYTHONPATH=ROOT)
    args = ["server", "import", "--home", str(tmp_path / "home"), "--team", "ml", "--database", db_url]
    r = _dtrun(args, env)
    assert r.returncode == 0, r.stderr
    assert "skipped long: still RUNNING in the embedded store" in r.stdout
    assert "imported 2 jobs (3 attempts" in r.stdout
    with session_scope(engine) as s:
        jobs = {j.name: j for j in s.scalars(select(Job))}
        assert {n: j.state for n, j in jobs.items()} == {"done": "finished", "stopped": "stopped"}
        for n in ("done", "stopped"):
            assert jobs[n].spend_usd == pytest.approx(store.spend_total(n)) and jobs[n].spend_usd > 0
            assert jobs[n].updated == store.get_job(n)["updated"]
            assert jobs[n].spec["name"] == n
            n_events = len(store.events(n))
            assert s.scalar(select(Event.id).where(Event.job_id == jobs[n].id, Event.kind == "import"))
            assert len(list(s.scalars(select(Event).where(Event.job_id == jobs[n].id)))) == n_events + 1
        atts = list(s.scalars(select(Attempt).where(Attempt.job_id == jobs["done"].id).order_by(Attempt.n)))
        assert [(a.n, a.outcome) for a in atts] == [(1, "preempted"), (2, "succeeded")]
        assert sum(a.spend_usd for a in atts) == pytest.approx(store.spend_total("done"))
        month = budget.team_month(s, s.scalar(select(Team)), now=max(j.updated for j in jobs.values()))
        assert month["spent_usd"] == pytest.approx(store.spend_total("done") + store.spend_total("stopped"), abs=1e-5)
    r = _dtrun(args, env)  # the second run: nothing new
    assert r.returncode == 0 and "imported 0 jobs" in r.stdout
    assert "skipped done: already on the server" in r.stdout
    with session_scope(engine) as s:
        assert len(list(s.scalars(select(Job)))) == 2 and len(list(s.scalars(select(Attempt)))) == 3
    assert _counts(tmp_path / "home" / "state.db") == before  # the source was only read
    r = _dtrun(["server", "import", "--home", str(tmp_path / "nothing"), "--team", "ml", "--database", db_url], env)
    assert r.returncode == 6 and "--home: no embedded state store" in r.stderr and "Traceback" not in r.stderr
    r = _dtrun(["server", "import", "--home", str(tmp_path / "home"), "--team", "nope", "--database", db_url], env)
    assert r.returncode == 6 and "team: no team named 'nope'" in r.stderr
    ctls["long"].teardown.terminate_all(sleep=lambda _s: None)
    engine.dispose()
