"""``dtrun prices``, ``simulate`` and ``gc`` through a server, and the job file's paths on the way
(issue 30): the real API (``create_app`` on a SQLite database migrated by Alembic, served by
uvicorn on 127.0.0.1) and the real CLI (``orchestrator.cli.app``) talking to it over HTTP with
``DTRUN_SERVER``/``DTRUN_TOKEN``. Every new endpoint is 401 without a token; the simulate body is
validated by the job file's models (422 naming the field, also for a simulation past the server's
time limit); the CLI's output through the server is the embedded output (prices, simulate with the
same seed); ``gc`` sees and terminates only the
caller's team's orphans on the fake cloud (an admin also the unowned ones, nobody another team's);
``up`` resolves a relative checkpoint path before sending and refuses local data and user code."""

from __future__ import annotations

import json
import re
import socket
import threading
import time

import pytest
from fastapi.testclient import TestClient

from orchestrator.server.api import create_app
from orchestrator.server.auth import create_team, create_user, issue_token
from orchestrator.server.db import make_engine, session_scope
from orchestrator.server.migrate import upgrade
from orchestrator.server.models import Job
from providers import registry
from providers.base import LaunchRequest, Offer
from providers.fake import FakeOfferTemplate, FakeProvider

OFFERS = [FakeOfferTemplate("fake-east", "H100", True, 1.0), FakeOfferTemplate("fake-east", "H100", False, 2.0)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def world(tmp_path, monkeypatch):
    import uvicorn

    home = tmp_path / "server-home"  # the server's DTRUN_HOME: its controllers' state store
    home.mkdir()
    monkeypatch.setenv("DTRUN_HOME", str(home))
    monkeypatch.setenv("DTRUN_FAKE_CLOUD", str(tmp_path / "account" / "fake-cloud.json"))
    monkeypatch.setenv("DTRUN_SKY_CATALOG_DIR", str(tmp_path / "no-catalogs"))
    for v in ("DTRUN_SERVER", "DTRUN_TOKEN"):
        monkeypatch.delenv(v, raising=False)
    (tmp_path / "account").mkdir()
    registry.unregister("fake")
    cloud = FakeProvider(tmp_path / "account" / "fake-cloud.json", offers=OFFERS, provision_seconds=3600,
                         autodown_seconds=None)
    engine = make_engine(f"sqlite:///{tmp_path / 'server.db'}")
    upgrade(engine)
    tokens = {}
    with session_scope(engine) as s:
        a, b = create_team(s, "alpha"), create_team(s, "beta")
        users = {"ann": create_user(s, a, "ann", "admin"), "amy": create_user(s, a, "amy"),
                 "bob": create_user(s, b, "bob")}
        for n, u in users.items():
            tokens[n] = issue_token(s, u)
        for team, user, name in ((a, users["amy"], "ajob"), (b, users["bob"], "bjob"), (a, users["amy"], "shared"),
                                 (b, users["bob"], "shared")):
            s.add(Job(team_id=team.id, user_id=user.id, name=name, spec={"name": name}, state="finished"))
    api = create_app(engine)
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(api, host="127.0.0.1", port=port, log_level="warning"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    deadline = time.time() + 30
    while not server.started:
        assert time.time() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    yield {"url": f"http://127.0.0.1:{port}", "tokens": tokens, "cloud": cloud, "engine": engine, "api": api,
           "tmp": tmp_path}
    server.should_exit = True
    t.join(30)
    engine.dispose()
    registry.unregister("fake")


class Ran:
    def __init__(self, code, out, err):
        self.exit_code, self.stdout, self.output = code, out, out + err


@pytest.fixture
def run(monkeypatch, capsys):
    """The CLI's ``main`` (its exit codes and one-line errors), embedded (``world`` None) or
    through the server as ``who``; stdout and stdout+stderr."""
    from orchestrator.cli.app import main

    def _run(args, world=None, who="amy"):
        if world:
            monkeypatch.setenv("DTRUN_SERVER", world["url"])
            monkeypatch.setenv("DTRUN_TOKEN", world["tokens"][who])
        else:
            monkeypatch.delenv("DTRUN_SERVER", raising=False)
            monkeypatch.delenv("DTRUN_TOKEN", raising=False)
        capsys.readouterr()
        code = main(list(args))
        c = capsys.readouterr()
        return Ran(code, c.out, c.err)
    return _run


def test_each_new_endpoint_needs_a_token(world, run):
    c = TestClient(world["api"], raise_server_exceptions=False)
    for method, path in (("get", "/v1/prices"), ("post", "/v1/simulate"), ("post", "/v1/gc")):
        for headers in ({}, {"Authorization": "Bearer nope"}):
            r = getattr(c, method)(path, headers=headers)
            assert r.status_code == 401, (path, r.text)
            assert list(r.json()) == ["error"] and "Traceback" not in r.text
    r = run(["prices"], {**world, "tokens": {"amy": "wrong"}})
    assert r.exit_code == 5 and "HTTP 401" in r.output


def _sim_body(**spec_over):
    spec = {"name": "simjob", "resources": {"providers": ["fake"], "gpu": "H100", "gpus_per_node": 8, "spot": True},
            "trainer": {"model": "gpt2-124m", "tokens": 100_000_000, "batch_size": 512, "seq_len": 1024},
            "checkpoint": {"uri": "s3://b/{name}", "every_steps": 100}, "budget": {"max_usd": 100}}
    for k, v in spec_over.items():
        spec[k] = {**spec[k], **v}
    return {"spec": spec, "runs": 5, "seed": 1, "preemptions_per_hour": 1.0}


def test_simulate_body_is_validated_naming_the_field(world):
    c = TestClient(world["api"], raise_server_exceptions=False)
    h = {"Authorization": f"Bearer {world['tokens']['amy']}"}
    r = c.post("/v1/simulate", json=_sim_body(trainer={"batch_size": -3}), headers=h)
    assert r.status_code == 422 and "trainer.batch_size" in r.json()["error"] and r.json()["exit_code"] == 2
    r = c.post("/v1/simulate", json={**_sim_body(), "runs": 100_000}, headers=h)
    assert r.status_code == 422 and r.json()["error"].startswith("runs:") and "1000" in r.json()["error"]
    r = c.post("/v1/simulate", json={**_sim_body(), "preemptions_per_hour": -1}, headers=h)
    assert r.status_code == 422 and "preemptions-per-hour" in r.json()["error"]
    r = c.post("/v1/simulate", json={**_sim_body(), "bogus": 1}, headers=h)
    assert r.status_code == 422 and "bogus" in r.json()["error"]
    r = c.get("/v1/prices?gpu=NOPE", headers=h)
    assert r.status_code == 422 and r.json()["error"].startswith("gpu:")


def test_a_simulation_past_the_servers_time_limit_is_refused_naming_runs(world, monkeypatch):
    from orchestrator.server import api_extra

    monkeypatch.setattr(api_extra, "SIM_TIMEOUT_S", 0.05)  # the child is killed long before it answers
    c = TestClient(world["api"], raise_server_exceptions=False)
    r = c.post("/v1/simulate", json=_sim_body(), headers={"Authorization": f"Bearer {world['tokens']['amy']}"})
    assert r.status_code == 422 and r.json()["error"].startswith("runs: 5 simulated runs") and "--runs" in r.text


def test_prices_through_the_server_print_what_embedded_prints(world, run):
    for args in (["prices"], ["prices", "H100", "--spot"], ["prices", "--json"], ["prices", "cpu"]):
        here, there = run(args), run(args, world)
        assert here.exit_code == there.exit_code == 0, (args, there.output)
        assert there.output == here.output and here.output.strip(), args
    assert json.loads(run(["prices", "--json"], world).stdout)["prices"]
    r = run(["prices", "--refresh"], world)
    assert r.exit_code == 2 and "--refresh" in r.output and "Traceback" not in r.output


def _no_elapsed(d):
    """The report without ``elapsed_s`` (the simulation's own wall time, different on every run)."""
    if isinstance(d, dict):
        return {k: _no_elapsed(v) for k, v in d.items() if k != "elapsed_s"}
    return d


def test_simulate_through_the_server_prints_what_embedded_prints(world, run, tmp_path):
    import yaml

    job = tmp_path / "sim.yaml"
    job.write_text(yaml.safe_dump(_sim_body()["spec"]))
    args = ["simulate", str(job), "--runs", "6", "--seed", "3", "--preemptions-per-hour", "2"]
    here, there = run(args + ["--json"]), run(args + ["--json"], world)
    assert here.exit_code == there.exit_code == 0, there.output
    h, t = json.loads(here.stdout), json.loads(there.stdout)
    assert h["runs"] == 6 and h["preemptions_mean"] > 0
    assert _no_elapsed(t) == _no_elapsed(h)
    here, there = run(args), run(args, world)
    assert here.exit_code == there.exit_code == 0, there.output

    def norm(s):
        return re.sub(r"\(\d+\.\d s\)", "(… s)", s)
    assert norm(there.output) == norm(here.output) and "simjob: 6 simulated runs" in here.output
    other = run(["simulate", str(job), "--runs", "6", "--seed", "4", "--preemptions-per-hour", "2", "--json"], world)
    assert _no_elapsed(json.loads(other.stdout)) != _no_elapsed(h)  # the seed reached the server
    r = run(["simulate", str(job), "--runs", "5000"], world)
    assert r.exit_code == 2 and "runs" in r.output and "Traceback" not in r.output


def _launch(cloud, job, attempt, owner, handle=False):
    offer = Offer("fake", "fake-east", "H100", 1, True, 1.0)
    h = cloud.launch(LaunchRequest(job=job, attempt=attempt, offer=offer, nodes=1, command=["true"], owner=owner))
    return h if handle else h.name


def _live(cloud):
    return sorted(i.name for i in cloud.instances() if i.gone_at is None)




def test_gc_through_the_server_is_scoped_to_the_team(world, run):
    from orchestrator.run.state import StateStore

    def run_gc(who, *args):
        r = run(["gc", *args], world, who)
        return r.exit_code, r.output

    cloud = world["cloud"]
    server_owner = StateStore().owner_id  # the server's controllers launch with this owner id
    names = {k: _launch(cloud, job, n, owner) for k, job, n, owner in (
        ("a", "ajob", 1, server_owner), ("b", "bjob", 1, server_owner), ("shared", "shared", 1, server_owner),
        ("stray", "stray", 1, "another-home"), ("a_other", "ajob", 2, "another-home"))}
    assert len(_live(cloud)) == 5

    def listed(who):
        r = run(["gc", "--json"], world, who)
        assert r.exit_code == 0, r.output
        return {(o["name"], o["ours"]) for o in json.loads(r.stdout)["orphans"]}

    assert listed("amy") == {(names["a"], True)}  # a member: the team's orphans only

    # a running job whose controller process is gone (a replica SIGKILLed): its recorded node is
    # the next replica's to re-attach to, not an orphan (embedded gc would call it one)
    import subprocess
    import sys

    store = StateStore()
    store.create_job("ljob", "name: ljob\n", "s3://b/ljob")
    store.set_state("ljob", "RUNNING")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    assert store.claim_controller("ljob", pid=dead.pid)
    h = _launch(cloud, "ljob", 1, server_owner, handle=True)
    store.add_node("ljob", 1, h.to_dict(), time.time(), state="RUNNING")
    with session_scope(world["engine"]) as s:
        amy = s.query(Job).filter_by(name="ajob").one()
        s.add(Job(team_id=amy.team_id, user_id=amy.user_id, name="ljob", spec={"name": "ljob"}, state="running"))
    assert listed("amy") == {(names["a"], True)} and h.name in _live(cloud)
    assert listed("bob") == {(names["b"], True)}
    assert listed("ann") == {(names["a"], True), (names["stray"], False), (names["a_other"], False)}  # admin
    code, out = run_gc("amy")
    assert code == 0 and "1 orphan instance(s):" in out and names["a"] in out and names["b"] not in out
    code, out = run_gc("amy", "--all", "--yes")
    assert code == 5 and "admins" in out and len(_live(cloud)) == 6  # refused, nothing touched
    code, out = run_gc("amy", names["b"], "--yes")  # another team's instance, named: not found
    assert code == 1 and f"no orphan instance named {names['b']!r}" in out and names["b"] in _live(cloud)

    code, out = run_gc("amy", "--yes")
    assert code == 0 and f"{names['a']}: terminated" in out, out
    assert names["a"] not in _live(cloud) and names["b"] in _live(cloud) and names["stray"] in _live(cloud)
    code, out = run_gc("bob", "--yes")
    assert code == 0 and f"{names['b']}: terminated" in out
    code, out = run_gc("ann", "--all", "--yes")
    assert code == 0 and f"{names['stray']}: terminated" in out and names["shared"] not in out
    assert _live(cloud) == sorted([names["shared"], h.name])  # a name two teams share: nobody's; ljob's: adopted
    assert listed("amy") == set() and listed("bob") == set()


def test_up_resolves_relative_paths_and_refuses_local_inputs(world, run, tmp_path):
    sub = tmp_path / "project"
    sub.mkdir()
    base = ("name: rel1\nresources: {providers: [fake], gpu: H100, gpus_per_node: 1}\n"
            "budget: {max_usd: 50}\n")
    tr = "trainer: {model: tiny, steps: 100, batch_size: 8, seq_len: 64%s}\n"
    job = sub / "job.yaml"
    job.write_text(base + tr % "" + "checkpoint: {uri: 'runs/{name}'}\n")
    r = run(["up", str(job), "--yes"], world)
    assert r.exit_code == 0, r.output
    with session_scope(world["engine"]) as s:
        spec = s.query(Job).filter_by(name="rel1").one().spec
    assert spec["checkpoint"]["uri"] == str(sub / "runs" / "{name}")  # the job file's folder, not the server's cwd

    for extra, field in ((tr % ", data: shards/train", "trainer.data"),
                         (tr % ", val_data: 'file:///data/val'", "trainer.val_data")):
        job.write_text(base.replace("rel1", "rel2") + extra)
        r = run(["up", str(job), "--dry-run"], world)
        assert r.exit_code == 2 and field in r.output and "s3://" in r.output, r.output
        assert "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1
    (sub / "code").mkdir()
    (sub / "code" / "train.py").write_text("print('hi')\n")
    job.write_text(base.replace("rel1", "rel3") + "command: {code: code, run: train.py, hours: 1}\n")
    r = run(["up", str(job), "--dry-run"], world)
    assert r.exit_code == 2 and "command.code" in r.output and str(sub / "code") in r.output, r.output
    with session_scope(world["engine"]) as s:
        assert {j.name for j in s.query(Job)} == {"ajob", "bjob", "shared", "rel1"}  # nothing else reached it


def test_fuzzed_bodies_of_the_new_endpoints_never_500(world):
    """A seeded, bounded fuzz: the simulate and gc bodies with one field replaced by junk (or
    dropped), and junk query strings for prices — always a 2xx or a 4xx with one line, never a 500."""
    import random

    rnd = random.Random(30)
    junk = [None, -1, 0, 1e308, "x" * 300, [], {}, {"a": 1}, True, "1", -10**18, [1, "a"], "../../etc"]
    c = TestClient(world["api"], raise_server_exceptions=False)
    h = {"Authorization": f"Bearer {world['tokens']['amy']}"}
    seen = set()
    for i in range(25):
        body = {**_sim_body(), "runs": 1}
        where = rnd.choice(["spec", "runs", "seed", "preemptions_per_hour", "no_capacity", "notice_seconds",
                            "soft_fraction", "spec.name", "spec.resources", "spec.trainer", "spec.checkpoint",
                            "spec.budget"])
        target, key = (body["spec"], where[5:]) if where.startswith("spec.") else (body, where)
        if rnd.random() < 0.15:
            target.pop(key, None)
        else:
            target[key] = rnd.choice(junk)
        r = c.post("/v1/simulate", json=body, headers=h)
        seen.add(r.status_code)
        assert r.status_code < 500 and "Traceback" not in r.text, (where, target.get(key), r.text)
        r = c.post("/v1/gc", json={rnd.choice(["names", "all", "terminate", "bogus"]): rnd.choice(junk)}, headers=h)
        assert r.status_code < 500 and "Traceback" not in r.text, r.text
        r = c.get(f"/v1/prices?gpu={rnd.choice(['H100', 'x' * 300, '%00', ''])}&spot={rnd.choice(['1', 'maybe'])}",
                  headers=h)
        assert r.status_code < 500 and "Traceback" not in r.text, r.text
    assert 422 in seen, seen
