"""A fake-cloud job for the dashboard tests: the real controller on a virtual clock, the fake
cloud, ``SimTrainer`` writing progress and metrics through the real run-URI contract."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "run"))

from orchestrator.run.clock import VirtualClock  # noqa: E402
from orchestrator.run.controller import Controller  # noqa: E402
from orchestrator.run.state import StateStore  # noqa: E402
from providers.fake import FakeProvider  # noqa: E402
from test_controller_fake import OFFERS, SimTrainer, make_spec  # noqa: E402


class FakeWorld:
    def __init__(self, tmp_path: Path) -> None:
        self.tmp = tmp_path
        self.clock = VirtualClock()
        self.sim = SimTrainer(steps=1000, step_s=10.0, every=100)
        self.cloud = FakeProvider(clock=self.clock, offers=OFFERS, provision_seconds=60, autodown_seconds=None,
                                  workload=self.sim)
        self.db = tmp_path / "state.db"
        self.store = StateStore(self.db)

    def controller(self, **over) -> Controller:
        return Controller(make_spec(self.tmp, **over), self.store, clock=self.clock, providers={"fake": self.cloud})

    def tick_until(self, c: Controller, pred, seconds: float = 30.0, limit: int = 2000) -> None:
        for _ in range(limit):
            if pred():
                return
            self.clock.advance(seconds)
            c.tick()
        raise AssertionError("condition not reached")


@pytest.fixture
def world(tmp_path):
    return FakeWorld(tmp_path)


@pytest.fixture
def finished(world):
    """A job preempted once (attempt 1 at 25 min) that then succeeded."""
    world.cloud.script("dtrun-fakejob-a1", preempt_after=1500)
    assert world.controller().run() == "SUCCEEDED"
    write_metrics(world.store.get_job("fakejob")["run_uri"], 1000)
    return world


def write_metrics(run_uri: str, steps: int) -> None:
    """metrics.jsonl rows in the trainer's format (trainer/metrics.py): SimTrainer writes none."""
    import json
    import math

    from orchestrator.contract import runuri

    rows = [json.dumps({"step": s, "loss": 4.0 * math.exp(-s / 400) + 1.0, "tokens": s * 512,
                        "tokens_per_s": 5000.0 + s, "attempt": 1, "time": 0.0}) for s in range(10, steps + 1, 10)]
    rows += [json.dumps({"step": s, "val_loss": 4.2 * math.exp(-s / 400) + 1.1, "tokens": s * 512,
                         "attempt": 1, "time": 0.0}) for s in range(100, steps + 1, 100)]
    runuri.append_line(runuri.join(run_uri, runuri.METRICS), "\n".join(rows))


# ---- dtrun server with the dashboard mounted: two teams, jobs submitted through the API, a real
# controller replica on a virtual clock over the fake cloud ------------------------------------------

def _server_conftest():
    """tests/orchestrator/server/conftest.py by path (its PostgreSQL fixtures), not ``from conftest``."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "server" / "conftest.py"
    spec = importlib.util.spec_from_file_location("server_conftest_for_dashboard", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_srv = _server_conftest()
pg_cluster, pg_url, db_url = _srv.pg_cluster, _srv.pg_url, _srv.db_url

SERVER_STEPS, SERVER_STEP_S = 2000, 10.0


def server_sim(inst, now):
    """One step every SERVER_STEP_S from the node's ready time, progress through the run URI."""
    from orchestrator.contract import runuri

    uri = inst.env["DTRUN_RUN_URI"]
    step = max(0, min(SERVER_STEPS, int((now - inst.ready_at) / SERVER_STEP_S)))
    runuri.write_json(runuri.join(uri, runuri.PROGRESS),
                      {"step": step, "steps": SERVER_STEPS, "loss": 4.0 - step / 1000, "tokens_per_s": 5000.0 + step,
                       "time": now, "attempt": int(inst.env["DTRUN_ATTEMPT"]), "last_committed_step": None})
    if step >= SERVER_STEPS:
        runuri.write_json(runuri.join(uri, runuri.DONE), {"step": step, "loss": 2.0, "tokens": step, "time": now})
        return (0, inst.ready_at + SERVER_STEPS * SERVER_STEP_S)
    return None


def server_job(tmp_path: Path, name: str, max_usd: float = 100.0) -> dict:
    return {"name": name, "resources": {"providers": ["fake"], "gpu": "H100", "gpus_per_node": 1, "spot": True},
            "trainer": {"model": "tiny", "steps": SERVER_STEPS, "batch_size": 8, "seq_len": 64},
            "checkpoint": {"uri": f"file://{tmp_path}/runs/{name}", "every_steps": 100},
            "budget": {"max_usd": max_usd},
            "recovery": {"poll_seconds": 30, "backoff_seconds": 10, "heartbeat_timeout_seconds": 600}}


class ServerWorld:
    """alpha (ann: admin, amy: member; $500 a month) runs a-one (ann) and a-two (amy); beta (bob)
    runs b-one. Jobs go through ``POST /v1/up``; ``tick`` drives the replica and the fake cloud."""

    def __init__(self, tmp_path: Path, db_url: str, monkeypatch) -> None:
        from fastapi.testclient import TestClient

        from orchestrator.server.api import create_app
        from orchestrator.server.auth import BadTokenLimiter, create_team, create_user, issue_token
        from orchestrator.server.db import make_engine, session_scope
        from orchestrator.server.migrate import upgrade
        from orchestrator.server.replica import Replica
        from providers.fake import FakeOfferTemplate

        self.tmp = tmp_path
        home = tmp_path / "home"
        monkeypatch.setenv("DTRUN_HOME", str(home))  # the store the mounted dashboard opens
        self.clock = VirtualClock()
        self.cloud = FakeProvider(clock=self.clock, offers=[FakeOfferTemplate("fake-east", "H100", True, 2.0)],
                                  provision_seconds=60, autodown_seconds=None, workload=server_sim)
        self.engine = make_engine(db_url)
        upgrade(self.engine)
        with session_scope(self.engine) as s:
            alpha, beta = create_team(s, "alpha", monthly_usd=500.0), create_team(s, "beta")
            self.tokens = {u: issue_token(s, create_user(s, t, u, role))
                           for u, t, role in (("ann", alpha, "admin"), ("amy", alpha, "member"), ("bob", beta, "member"))}
        self.app = create_app(self.engine, get=lambda n: self.cloud, limiter=BadTokenLimiter(limit=1000, window=60))
        self.client = TestClient(self.app, raise_server_exceptions=False)
        for user, name in (("ann", "a-one"), ("amy", "a-two"), ("bob", "b-one")):
            r = self.client.post("/v1/up", json={"spec": server_job(tmp_path, name), "confirm": True},
                                 headers=self.h(user))
            assert r.status_code == 200 and r.json()["submitted"], r.text
        self.store = StateStore(home / "state.db")
        self.replica = Replica(self.engine, self.store, {"fake": self.cloud}, self.clock, replica_id="r0",
                               ttl=90.0, write_lease=False)

    def h(self, user: str) -> dict:
        return {"Authorization": f"Bearer {self.tokens[user]}"}

    def tick(self, pred, seconds: float = 30.0, limit: int = 1000) -> None:
        for _ in range(limit):
            self.replica.tick()
            if pred():
                return
            self.clock.advance(seconds)
        raise AssertionError("condition not reached")

    def step(self, name: str) -> int:
        return (self.store.get_job(name) or {}).get("step") or 0

    def close(self) -> None:
        self.store.close()
        self.engine.dispose()


@pytest.fixture
def server_world(tmp_path, db_url, monkeypatch):
    w = ServerWorld(tmp_path, db_url, monkeypatch)
    yield w
    w.close()


@pytest.fixture
def pg_server_world(tmp_path, pg_url, monkeypatch):
    """``server_world`` on real PostgreSQL only (the browser test: once is enough)."""
    w = ServerWorld(tmp_path, pg_url, monkeypatch)
    yield w
    w.close()
