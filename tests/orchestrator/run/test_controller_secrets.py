"""S3 credentials reach remote nodes as LaunchRequest.secrets and nowhere else; missing ones are
exit 5 before anything is rented; a provider that refuses credentials is skipped, not fatal.

The real controller and the real SkyPilot/Modal adapters over the recorded SDK fakes, a real S3
API (moto) for the run URI, a virtual clock."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest


from provider_fakes import FakeModalAPI, FakeSkyAPI  # noqa: E402

from orchestrator.run.clock import VirtualClock  # noqa: E402
from orchestrator.run.controller import Controller  # noqa: E402
from orchestrator.contract.errors import EXIT_PROVIDER, DtrunError, ProviderRefused  # noqa: E402
from orchestrator.plan.estimate import make_plan  # noqa: E402
from orchestrator.plan.spec import parse_spec  # noqa: E402
from orchestrator.run.state import StateStore  # noqa: E402
from providers.base import Offer  # noqa: E402
from providers.modal import ModalProvider  # noqa: E402
from providers.skypilot import SkyPilotProvider  # noqa: E402

SECRET = "dummysecret123"
KEY_ID = "dummykeyid777"
TOKEN = "dummytoken999"


def _spec(uri: str, providers: list[str], **trainer):
    return parse_spec({
        "name": "sj",
        "resources": {"providers": providers, "gpu": "H100", "gpus_per_node": 1, "spot": False},
        "trainer": {"model": "tiny", "steps": 100, "batch_size": 8, "seq_len": 64, **trainer},
        "checkpoint": {"uri": uri, "every_steps": 10},
        "budget": {"max_usd": 50.0},
        "recovery": {"poll_seconds": 30, "backoff_seconds": 10},
    })


def _InvalidCloudCredentials(msg: str) -> Exception:
    """What SkyPilot raises for a rejected key: its own class (the adapter maps by class)."""
    from sky.exceptions import InvalidCloudCredentials

    return InvalidCloudCredentials(msg)


@pytest.fixture
def world(tmp_path, dtrun_home, s3_bucket, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    (home / ".runpod").mkdir()  # the file SkyPilot reads RunPod's key from
    (home / ".runpod" / "config.toml").write_text('[default]\napi_key = "dummy-runpod"\n')
    monkeypatch.setenv("RUNPOD_API_KEY", "dummy-runpod")
    monkeypatch.setenv("MODAL_TOKEN_ID", "dummy-id")
    monkeypatch.setenv("MODAL_TOKEN_SECRET", "dummy-modal")
    # the controller's own AWS keys (moto accepts any)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_SESSION_TOKEN", TOKEN)
    # boto3's chain must find nothing outside the test
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(home / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(home / "no-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    for k in ("AWS_PROFILE", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
              "AWS_WEB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(k, raising=False)
    sky, mod = FakeSkyAPI(), FakeModalAPI()
    providers = {"runpod": SkyPilotProvider("runpod", sky, home=dtrun_home),
                 "modal": ModalProvider(mod, home=dtrun_home, confirm_wait_seconds=0.0)}
    store = StateStore(dtrun_home / "state.db")
    events: list[str] = []

    def make(offers: list[Offer], spec=None):
        spec = spec or _spec(s3_bucket + "/runs/{name}", sorted({o.provider for o in offers}))
        return Controller(spec, store, clock=VirtualClock(), providers=providers,
                          plan=make_plan(spec, offers=offers), on_event=lambda t, m: events.append(f"{t} {m}"))

    yield dict(sky=sky, modal=mod, store=store, make=make, events=events, home=home, bucket=s3_bucket,
               dtrun_home=dtrun_home, tmp=tmp_path)
    store.close()


RUNPOD = Offer("runpod", "any", "H100", 1, False, 2.0)
MODAL = Offer("modal", "any", "H100", 1, False, 6.0)  # dearer than RunPod in expected cost, start-up included


def _launches(w) -> list:
    return [c for c in w["sky"].calls if c[0] == "launch"] + [c for c in w["modal"].calls if c[0] == "create"]


def _nowhere(w, *needles: str) -> None:
    """No secret in any file dtrun wrote (state store + WAL, memo files, logs), nor in events."""
    w["store"].close()
    for p in Path(w["tmp"]).rglob("*"):
        if p.is_file() and w["home"] not in p.parents:  # HOME holds the user's own credentials file
            raw = p.read_bytes()
            for n in needles:
                assert n.encode() not in raw, f"{n} found in {p}"
    text = "\n".join(w["events"])
    for n in needles:
        assert n not in text


@pytest.mark.parametrize("offer", [RUNPOD, MODAL], ids=["runpod", "modal"])
def test_remote_launch_gets_the_aws_keys_as_secrets_only(world, offer, capsys):
    w = world
    c = w["make"]([offer])
    c.start()
    for _ in range(3):
        c.tick()
    assert c.state in ("PROVISIONING", "RUNNING")
    (call,) = _launches(w)
    want = {"AWS_ACCESS_KEY_ID": KEY_ID, "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_SESSION_TOKEN": TOKEN}
    if offer.provider == "modal":
        secrets, env = call[1].secrets, call[1].env
    else:
        secrets, env = call[1]["config"]["secrets"], call[1]["config"]["envs"]
    assert secrets == want
    assert env["AWS_ENDPOINT_URL"].startswith("http://127.0.0.1") and env["AWS_DEFAULT_REGION"] == "us-east-1"
    assert not any(k in env for k in want)
    assert env["DTRUN_RUN_URI"].startswith(w["bucket"])
    c.store.request_action("sj", "stop_now")
    for _ in range(5):
        if c.tick() in ("CANCELLED", "FAILED"):
            break
    out = capsys.readouterr()
    assert SECRET not in out.out + out.err
    from orchestrator.cli.jobs import job_status

    assert SECRET not in json.dumps(job_status(w["store"], w["store"].get_job("sj")))
    _nowhere(w, SECRET, KEY_ID, TOKEN)


def test_keys_from_the_aws_credentials_file_when_the_environment_has_none(world, monkeypatch):
    w = world
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(k)
    creds = w["home"] / "credentials"
    creds.write_text("[default]\naws_access_key_id = chainkey555\naws_secret_access_key = chainsecret456\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    c = w["make"]([RUNPOD])
    c.start()
    c.tick()
    (call,) = _launches(w)
    assert call[1]["config"]["secrets"] == {"AWS_ACCESS_KEY_ID": "chainkey555", "AWS_SECRET_ACCESS_KEY": "chainsecret456"}
    _nowhere(w, "chainsecret456")


def test_no_aws_credentials_for_a_remote_node_is_exit_5_and_nothing_launched(world, monkeypatch):
    w = world
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(k)
    c = w["make"]([RUNPOD])
    with pytest.raises(ProviderRefused) as ei:
        c.run()
    assert ei.value.exit_code == EXIT_PROVIDER
    msg = str(ei.value)
    assert "AWS_ACCESS_KEY_ID" in msg and "AWS_SECRET_ACCESS_KEY" in msg and "checkpoint.uri" in msg
    assert "nothing rented" in msg
    assert _launches(w) == [] and w["store"].get_job("sj") is None


def test_s3_training_data_needs_credentials_too(world, monkeypatch, tmp_path):
    w = world
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(k)
    from orchestrator.run.nodecreds import node_storage

    spec = _spec(f"file://{tmp_path}/run", ["runpod"], data="s3://data-bucket/shards/")
    with pytest.raises(ProviderRefused, match="trainer.data"):
        node_storage(spec, "runpod")
    assert node_storage(spec, "local") == ({}, {})  # local nodes inherit the environment
    assert node_storage(_spec(f"file://{tmp_path}/run", ["runpod"]), "runpod") == ({}, {})


def test_dtrun_up_without_aws_credentials_is_exit_5(world, monkeypatch, tmp_path):
    from orchestrator.cli.up import cmd_up

    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(k)
    job = tmp_path / "job.yaml"
    job.write_text("name: rp\nresources: {providers: [runpod], gpu: H100, gpus_per_node: 1, spot: false}\n"
                   "trainer: {model: tiny, steps: 10, batch_size: 8, seq_len: 64}\n"
                   "checkpoint: {uri: 's3://bucket/runs/{name}'}\nbudget: {max_usd: 10}\n")
    with pytest.raises(DtrunError) as ei:
        cmd_up(job, yes=True)
    assert ei.value.exit_code == EXIT_PROVIDER and "AWS_SECRET_ACCESS_KEY" in str(ei.value)
    assert w_store_has_no_job(world, "rp")


def w_store_has_no_job(w, name: str) -> bool:
    return StateStore().get_job(name) is None and _launches(w) == []


def test_auth_error_skips_that_provider_and_launches_the_next_offer(world):
    w = world
    w["sky"].fail("launch", _InvalidCloudCredentials("RunPod API key rejected"))
    c = w["make"]([RUNPOD, MODAL])
    assert c.plan.chosen.provider == "runpod"
    c.start()
    c.tick()                        # runpod refuses: its offers are dropped
    assert c.state == "RECOVERING"
    c.tick()                        # modal at once
    assert c.state in ("PROVISIONING", "RUNNING")
    assert [x[0] for x in _launches(w)] == ["launch", "create"]
    atts = w["store"].attempts("sj")
    assert [a["outcome"] for a in atts[:1]] == ["refused"] and atts[1]["provider"] == "modal"
    assert any(e.startswith("refused runpod refused") for e in w["events"])


def test_auth_error_from_every_provider_fails_the_job(world):
    w = world
    w["sky"].fail("launch", _InvalidCloudCredentials("RunPod API key rejected"))
    from modal.exception import AuthError

    w["modal"].fail("create", AuthError("token rejected"))
    c = w["make"]([RUNPOD, MODAL])
    assert c.run() == "FAILED"
    reason = w["store"].get_job("sj")["reason"]
    assert reason.startswith("modal refused:")
    assert len(_launches(w)) == 2
