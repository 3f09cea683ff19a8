"""Team credentials on the server (``orchestrator.server.teamsecrets``), on SQLite and real
PostgreSQL: the column holds AES-GCM ciphertext, never the value (read raw by SQL); a ciphertext
moved to another team's row does not open; API answers, the events and the log never carry a
value; a replica hands team A's job A's secrets and not B's (the LaunchRequest the fake cloud
receives), never the server's own AWS keys; ``dtrun server admin secret`` reads values from
stdin or a file only and lists names only; the server refuses to start with secrets and no key."""

from __future__ import annotations

import logging
import os
import stat
import subprocess
import sys

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select, text

from orchestrator.contract.errors import ProviderRefused
from orchestrator.plan.spec import parse_spec
from orchestrator.run.clock import VirtualClock
from orchestrator.run.state import StateStore
from orchestrator.server import teamsecrets
from orchestrator.server.api import create_app
from orchestrator.server.auth import BadTokenLimiter, create_team, create_user, issue_token
from orchestrator.server.db import make_engine, session_scope
from orchestrator.server.jobs import submit_job
from orchestrator.server.migrate import upgrade
from orchestrator.server.models import Event, Team, TeamSecret, User
from orchestrator.server.replica import Replica
from providers.fake import FakeOfferTemplate, FakeProvider

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
A_TOKEN, B_TOKEN = "hf_alpha_plaintext_7f3a9c", "hf_beta_plaintext_41d2e8"
A_AWS = "alpha-aws-secret-access-key-9b8c7d"
KEY = teamsecrets.base64.urlsafe_b64encode(b"k" * 32).decode()


class RecordingCloud(FakeProvider):
    """The fake cloud, keeping each LaunchRequest it was handed (in memory, for the assertions)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.requests = []

    def launch(self, request):
        self.requests.append(request)
        return super().launch(request)


def spec_dict(tmp_path, name, uri=None):
    return {"name": name, "resources": {"providers": ["fake"], "gpu": "H100", "gpus_per_node": 1},
            "trainer": {"model": "tiny", "steps": 100, "batch_size": 8, "seq_len": 64},
            "checkpoint": {"uri": uri or f"file://{tmp_path}/{name}"}, "budget": {"max_usd": 50.0},
            "recovery": {"poll_seconds": 30}}


@pytest.fixture
def world(tmp_path, db_url):
    engine = make_engine(db_url)
    upgrade(engine)
    key = teamsecrets._decode_key(KEY, "test")
    with session_scope(engine) as s:
        a, b = create_team(s, "alpha", 100.0), create_team(s, "beta")
        ua, ub = create_user(s, a, "ann"), create_user(s, b, "bob")
        tokens = issue_token(s, ua), issue_token(s, ub)
        teamsecrets.set_secret(s, a, "node", f"HF_TOKEN={A_TOKEN}\n", key)
        teamsecrets.set_secret(s, a, "aws", f"AWS_ACCESS_KEY_ID=AKIAALPHA\nAWS_SECRET_ACCESS_KEY={A_AWS}\n"
                                            "AWS_ENDPOINT_URL=http://127.0.0.1:9\n", key)
        teamsecrets.set_secret(s, b, "node", f"export HF_TOKEN='{B_TOKEN}'\n", key)
    yield {"engine": engine, "key": key, "tokens": tokens}
    engine.dispose()


def test_the_column_holds_ciphertext_bound_to_its_team_and_kind(world):
    engine, key = world["engine"], world["key"]
    with engine.connect() as c:
        raw = [bytes(r[0]) for r in c.execute(text("SELECT ciphertext FROM team_secrets"))]
    assert len(raw) == 3
    for blob in raw:
        for plain in (A_TOKEN, B_TOKEN, A_AWS, "HF_TOKEN", "AKIAALPHA"):
            assert plain.encode() not in blob
    with session_scope(engine) as s:
        a = s.scalar(select(Team).where(Team.name == "alpha"))
        b = s.scalar(select(Team).where(Team.name == "beta"))
        assert teamsecrets.list_secrets(s, a, key) == [
            {"kind": "aws", "names": ["AWS_ACCESS_KEY_ID", "AWS_ENDPOINT_URL", "AWS_SECRET_ACCESS_KEY"]},
            {"kind": "node", "names": ["HF_TOKEN"]}]
        assert teamsecrets.team_secrets(s, b.id, key) == {"node": {"HF_TOKEN": B_TOKEN}}
        a_node = s.scalar(select(TeamSecret).where(TeamSecret.team_id == a.id, TeamSecret.kind == "node"))
        b_node = s.scalar(select(TeamSecret).where(TeamSecret.team_id == b.id, TeamSecret.kind == "node"))
        b_node.ciphertext = a_node.ciphertext  # a database write moving A's token to B's row
    with session_scope(engine) as s:
        with pytest.raises(teamsecrets.SecretKeyError, match="does not open it") as e:
            teamsecrets.team_secrets(s, b.id, key)
        assert A_TOKEN not in str(e.value)
        with pytest.raises(teamsecrets.SecretKeyError, match="does not open it"):
            teamsecrets.team_secrets(s, a.id, b"x" * 32)  # another key


def test_bad_secret_text_names_the_line_never_the_value(world):
    with session_scope(world["engine"]) as s:
        a = s.scalar(select(Team).where(Team.name == "alpha"))
        with pytest.raises(Exception, match="line 2 is not NAME=VALUE") as e:
            teamsecrets.set_secret(s, a, "node", "A=1\nnot-a-pair-hunter2\n", world["key"])
        assert "hunter2" not in str(e.value)
        with pytest.raises(Exception, match="needs AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"):
            teamsecrets.set_secret(s, a, "aws", "AWS_ACCESS_KEY_ID=x\n", world["key"])
        with pytest.raises(Exception, match="kind: 'gcp' is not one of aws, node"):
            teamsecrets.set_secret(s, a, "gcp", "A=1\n", world["key"])
        with pytest.raises(teamsecrets.SecretKeyError, match="no server key"):
            teamsecrets.set_secret(s, a, "node", "A=1\n", None)


def test_a_replica_hands_each_team_only_its_own_secrets(world, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "SERVER-OWN-KEY")  # the server's own: never a team's node's
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "server-own-secret")
    caplog.set_level(logging.DEBUG)
    engine, key = world["engine"], world["key"]
    clock = VirtualClock()
    cloud = RecordingCloud(clock=clock, offers=[FakeOfferTemplate("fake-east", "H100", False, 1.0)],
                           provision_seconds=30, autodown_seconds=None)
    with session_scope(engine) as s:
        for team, user, name in (("alpha", "ann", "ja"), ("beta", "bob", "jb")):
            t = s.scalar(select(Team).where(Team.name == team))
            u = s.scalar(select(User).where(User.name == user))
            spec = spec_dict(tmp_path, name)
            parse_spec(spec)
            submit_job(s, t, u, name, spec, None)
    r = Replica(engine, StateStore(tmp_path / "state.db"), {"fake": cloud}, clock, replica_id="r1",
                ttl=90.0, write_lease=False, secret_key=key)
    for _ in range(3):
        r.tick()
        clock.advance(30)
    got = {req.job: req.secrets for req in cloud.requests}
    assert got == {"ja": {"HF_TOKEN": A_TOKEN}, "jb": {"HF_TOKEN": B_TOKEN}}  # no aws: file:// run URIs
    values = (A_TOKEN, B_TOKEN, A_AWS)
    for req in cloud.requests:
        assert not any(v in str(req.env) or v in repr(req) for v in values)
    for inst in cloud.instances():
        assert not any(v in str(inst.env) for v in values)
    client = TestClient(create_app(engine, limiter=BadTokenLimiter()), raise_server_exceptions=False)
    for token in world["tokens"]:
        h = {"Authorization": f"Bearer {token}"}
        for path in ("/v1/whoami", "/v1/jobs", "/v1/jobs/ja", "/v1/jobs/jb", "/v1/jobs/ja/logs",
                     "/v1/jobs/jb/logs", "/v1/jobs/ja/cost", "/v1/cost/team"):
            resp = client.get(path, headers=h)
            assert resp.status_code in (200, 404) and not any(v in resp.text for v in values), path
    with session_scope(engine) as s:
        assert not any(v in e.text for e in s.scalars(select(Event)) for v in values)
    assert not any(v in caplog.text for v in values)


def test_s3_jobs_get_their_teams_aws_keys_and_never_the_servers(world, tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "SERVER-OWN-KEY")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "server-own-secret")
    spec = parse_spec(spec_dict(tmp_path, "s3job", uri="s3://bucket/runs/s3job"))
    with session_scope(world["engine"]) as s:
        found = {t.name: teamsecrets.team_secrets(s, t.id, world["key"]) for t in s.scalars(select(Team))}
    env, sec = teamsecrets.team_node_storage(found["alpha"], "alpha", spec, "runpod")
    assert sec == {"HF_TOKEN": A_TOKEN, "AWS_ACCESS_KEY_ID": "AKIAALPHA", "AWS_SECRET_ACCESS_KEY": A_AWS}
    assert env == {"AWS_ENDPOINT_URL": "http://127.0.0.1:9"}
    with pytest.raises(ProviderRefused, match="no S3 credentials for team 'beta'.*secret set beta aws") as e:
        teamsecrets.team_node_storage(found["beta"], "beta", spec, "runpod")
    assert "server-own" not in str(e.value) and e.value.exit_code == 5


def _dtrun(args, env, input=None):
    return subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], cwd=ROOT, env=env, input=input,
                          capture_output=True, text=True, timeout=120)


def test_admin_secret_commands_and_the_server_refuses_to_start_without_its_key(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DTRUN_")}
    env.update(DTRUN_HOME=str(tmp_path / "home"), PYTHONPATH=ROOT)
    db = f"sqlite:///{tmp_path / 'server.db'}"
    assert _dtrun(["server", "admin", "team", "alpha", "--database", db], env).returncode == 0
    r = _dtrun(["server", "admin", "secret", "set", "alpha", "node", "--database", db], env, input="A=hunter2\n")
    assert r.returncode == 2 and "no server key" in r.stderr and "Traceback" not in r.stderr
    keyfile = tmp_path / "home" / "server.key"
    assert _dtrun(["server", "admin", "key"], env).returncode == 0
    assert stat.S_IMODE(keyfile.stat().st_mode) == 0o600
    r = _dtrun(["server", "admin", "secret", "set", "alpha", "node", "--database", db], env, input="HF_TOKEN=hunter2\n")
    assert r.returncode == 0 and "HF_TOKEN" in r.stdout and "hunter2" not in r.stdout + r.stderr
    (tmp_path / "aws.env").write_text("AWS_ACCESS_KEY_ID=AKIAX\nAWS_SECRET_ACCESS_KEY=s3cr3t-value\n")
    r = _dtrun(["server", "admin", "secret", "set", "alpha", "aws", "--file", str(tmp_path / "aws.env"),
                "--database", db], env)
    assert r.returncode == 0, r.stderr
    r = _dtrun(["server", "admin", "secret", "list", "alpha", "--database", db], env)
    assert r.returncode == 0 and r.stdout.splitlines() == ["aws: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY",
                                                          "node: HF_TOKEN"]
    assert "hunter2" not in r.stdout and "s3cr3t" not in r.stdout
    raw = (tmp_path / "server.db").read_bytes()
    assert b"hunter2" not in raw and b"s3cr3t-value" not in raw
    assert _dtrun(["server", "admin", "key"], env).returncode == 2  # never overwrites the key
    os.chmod(keyfile, 0o644)
    r = _dtrun(["server", "admin", "secret", "list", "alpha", "--database", db], env)
    assert r.returncode == 2 and "chmod 600" in r.stderr
    os.chmod(keyfile, 0o600)
    r = _dtrun(["server", "admin", "secret", "delete", "alpha", "aws", "--database", db], env)
    assert r.returncode == 0
    r = _dtrun(["server", "admin", "secret", "delete", "alpha", "aws", "--database", db], env)
    assert r.returncode == 6 and "no secret 'aws'" in r.stderr
    os.remove(keyfile)  # secrets stored, no key: the server refuses before it listens
    r = _dtrun(["server", "--port", "1", "--database", db], env)
    assert r.returncode == 2 and "DTRUN_SERVER_KEY" in r.stderr and "Traceback" not in r.stderr
