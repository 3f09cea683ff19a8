"""The server's HTTP API through FastAPI's TestClient, on a real SQLite database migrated by
Alembic: tokens (401, 429, only hashes stored), teams (404 for another team's job), the job body
validated by JobSpec (422 naming the field), the team budget in the dry run (409, exit 3), no
secret and no traceback in any answer, and a seeded, bounded fuzz of bodies and paths."""

from __future__ import annotations

import json
import random
import sqlite3
import time

import pytest
from fastapi.testclient import TestClient

from orchestrator.server.api import create_app
from orchestrator.server.auth import BadTokenLimiter, create_team, create_user, hash_token, issue_token
from orchestrator.server.db import make_engine, session_scope
from orchestrator.server.migrate import upgrade
from orchestrator.server import teamsecrets
from orchestrator.server.models import Job
from providers.fake import FakeOfferTemplate, FakeProvider

SECRET = "AKIA-very-secret-key-0123456789"


def job_body(name="j1", steps=10000, max_usd=1000):
    return {"name": name, "resources": {"providers": ["fake"], "gpu": "H100", "gpus_per_node": 1},
            "trainer": {"model": "tiny", "steps": steps, "batch_size": 8, "seq_len": 64},
            "checkpoint": {"uri": f"s3://bucket/dtrun/{name}"}, "budget": {"max_usd": max_usd}}


@pytest.fixture
def world(tmp_path):
    db = tmp_path / "server.db"
    engine = make_engine(f"sqlite:///{db}")
    upgrade(engine)
    with session_scope(engine) as s:
        a = create_team(s, "alpha", monthly_usd=100.0)
        b = create_team(s, "beta")
        ua = create_user(s, a, "ann", "admin")
        ub = create_user(s, b, "bob")
        ta, tb = issue_token(s, ua), issue_token(s, ub)
        teamsecrets.set_secret(s, a, "aws", f"AWS_ACCESS_KEY_ID=AKIAX\nAWS_SECRET_ACCESS_KEY={SECRET}\n", b"k" * 32)
    cloud = FakeProvider(offers=[FakeOfferTemplate("fake-east", "H100", False, 2.0)])
    app = create_app(engine, get=lambda n: cloud, limiter=BadTokenLimiter(limit=5, window=60))
    client = TestClient(app, raise_server_exceptions=False)
    yield {"client": client, "engine": engine, "db": db, "ta": ta, "tb": tb,
           "ha": {"Authorization": f"Bearer {ta}"}, "hb": {"Authorization": f"Bearer {tb}"}}
    engine.dispose()


def _clean(r):
    assert r.status_code != 500, r.text
    assert "Traceback" not in r.text and SECRET not in r.text
    return r


def test_every_endpoint_needs_a_token(world):
    c = world["client"]
    for method, path in [("get", "/v1/jobs"), ("get", "/v1/jobs/x"), ("get", "/v1/jobs/x/logs"),
                         ("get", "/v1/jobs/x/cost"), ("post", "/v1/jobs/x/down"), ("get", "/v1/cost/team"),
                         ("post", "/v1/up"), ("get", "/v1/whoami")]:
        r = _clean(getattr(c, method)(path))
        assert r.status_code == 401, (path, r.text)
        assert list(r.json()) == ["error"] and "\n" not in r.text
    r = _clean(c.get("/v1/whoami", headers={"Authorization": "Bearer nope"}))
    assert r.status_code == 401
    assert c.get("/v1/whoami", headers=world["ha"]).json() == {"user": "ann", "role": "admin", "team": "alpha"}


def test_repeated_bad_tokens_are_rate_limited(world):
    c = world["client"]
    codes = [c.get("/v1/jobs", headers={"Authorization": f"Bearer bad{i}"}).status_code for i in range(7)]
    assert codes[:5] == [401] * 5 and codes[5:] == [429, 429]
    # even a good token from that client waits out the window
    assert c.get("/v1/jobs", headers=world["ha"]).status_code == 429


def test_tokens_are_stored_only_as_hashes(world):
    con = sqlite3.connect(world["db"])
    rows = con.execute("SELECT sha256 FROM api_tokens").fetchall()
    dump = "\n".join(con.iterdump())
    con.close()
    assert sorted(r[0] for r in rows) == sorted([hash_token(world["ta"]), hash_token(world["tb"])])
    assert world["ta"] not in dump and world["tb"] not in dump


def test_up_dry_run_then_confirm_and_another_teams_job_is_404(world):
    c = world["client"]
    r = _clean(c.post("/v1/up", json={"spec": job_body()}, headers=world["ha"]))
    assert r.status_code == 200 and r.json()["exit_code"] == 0 and r.json()["submitted"] is False
    est = r.json()["prepared"]["plan"]["estimate"]["cost_usd"]
    assert est > 0
    r = _clean(c.post("/v1/up", json={"spec": job_body(), "confirm": True}, headers=world["ha"]))
    assert r.status_code == 200 and r.json()["job"]["state"] == "queued"
    assert c.get("/v1/jobs/j1", headers=world["ha"]).json()["state"] == "queued"
    assert [e["kind"] for e in c.get("/v1/jobs/j1/logs", headers=world["ha"]).json()["events"]] == ["state"]
    # beta sees neither the job nor that it exists: the same 404 as a name never used
    for path in ("/v1/jobs/j1", "/v1/jobs/j1/logs", "/v1/jobs/j1/cost"):
        r1, r2 = c.get(path, headers=world["hb"]), c.get(path.replace("j1", "never"), headers=world["hb"])
        assert r1.status_code == r2.status_code == 404
        assert r1.json()["error"].replace("j1", "X") == r2.json()["error"].replace("never", "X")
    assert c.post("/v1/jobs/j1/down", headers=world["hb"]).status_code == 404
    assert c.get("/v1/jobs", headers=world["hb"]).json() == {"jobs": []}
    r = c.post("/v1/jobs/j1/down", json={"now": False}, headers=world["ha"])
    assert r.status_code == 200 and r.json()["requested_action"] == "stop"
    # the name is taken in alpha
    r = _clean(c.post("/v1/up", json={"spec": job_body(), "confirm": True}, headers=world["ha"]))
    assert r.status_code == 409 and "name" in r.json()["error"]


def test_bad_job_body_is_422_naming_the_field(world):
    c = world["client"]
    body = job_body()
    body["trainer"]["steps"] = "many"
    r = _clean(c.post("/v1/up", json={"spec": body}, headers=world["ha"]))
    assert r.status_code == 422 and "trainer.steps" in r.json()["error"], r.text
    r = _clean(c.post("/v1/up", json={"confirm": True}, headers=world["ha"]))
    assert r.status_code == 422 and r.json()["error"].startswith("spec:"), r.text
    r = _clean(c.post("/v1/up", content=b"{not json", headers=world["ha"] | {"content-type": "application/json"}))
    assert r.status_code == 422


def test_team_budget_refuses_a_job_over_what_is_left(world):
    c, engine = world["client"], world["engine"]
    est = c.post("/v1/up", json={"spec": job_body()}, headers=world["ha"]).json()["prepared"]["plan"]["estimate"]["cost_usd"]
    # a running job of alpha that has spent this month and is still expected to spend
    with session_scope(engine) as s:
        from orchestrator.server.models import Team, User

        team = s.query(Team).filter_by(name="alpha").one()
        user = s.query(User).filter_by(name="ann").one()
        s.add(Job(team_id=team.id, user_id=user.id, name="big", spec={}, state="running", spend_usd=60.0,
                  plan={"plan": {"estimate": {"cost_usd": 100.0 - est / 2}}}))
    month = c.get("/v1/cost/team", headers=world["ha"]).json()
    assert month["spent_usd"] == 60.0 and month["left_usd"] == pytest.approx(est / 2)
    r = _clean(c.post("/v1/up", json={"spec": job_body("j2"), "confirm": True}, headers=world["ha"]))
    assert r.status_code == 409 and r.json()["exit_code"] == 3 and "budget" in r.json()["error"]
    with session_scope(engine) as s:
        assert s.query(Job).filter_by(name="j2").count() == 0
    # beta has no monthly budget: the same job is fine there
    assert c.post("/v1/up", json={"spec": job_body("j2")}, headers=world["hb"]).json()["exit_code"] == 0


def test_fuzzed_bodies_and_paths_never_500(world):
    c, rng = world["client"], random.Random(30)
    paths = ["/v1/up", "/v1/jobs", "/v1/jobs/{}", "/v1/jobs/{}/logs", "/v1/jobs/{}/cost", "/v1/jobs/{}/down",
             "/v1/cost/team", "/v1/whoami", "/{}", "/v1/{}/{}"]
    junk = [None, 0, -1, 1e308, "", "x" * 5000, [], {}, {"a": [1, {"b": None}]}, True, "../../etc/passwd", "\u0000"]

    def value(depth=0):
        if depth < 3 and rng.random() < 0.3:
            return {rng.choice(["name", "resources", "trainer", "budget", "gpu", "steps", "x"]): value(depth + 1)
                    for _ in range(rng.randint(0, 4))}
        return rng.choice(junk)

    start, n = time.monotonic(), 0
    while n < 300 and time.monotonic() - start < 60:
        n += 1
        name = rng.choice(["j", "%2e%2e", "a" * 300, "%00", "ü", "x y"])
        path = rng.choice(paths).replace("{}", name)
        spec = job_body() if rng.random() < 0.3 else value()
        if isinstance(spec, dict) and rng.random() < 0.5 and isinstance(spec.get("trainer"), dict):
            spec["trainer"][rng.choice(["steps", "model", "batch_size"])] = value()
        body = rng.choice([{"spec": spec}, {"spec": spec, "confirm": rng.random() < 0.2}, value()])
        headers = rng.choice([world["ha"], world["hb"], {}])
        if rng.random() < 0.5:
            r = c.post(path, content=json.dumps(body), headers=headers | {"content-type": "application/json"})
        else:
            r = c.get(path, headers=headers)
        _clean(r)
    assert n == 300
