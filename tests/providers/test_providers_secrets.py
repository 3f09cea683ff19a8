"""LaunchRequest.secrets: each remote provider hands them to its SDK's secret mechanism, and no
provider writes them anywhere (memo files, the fake cloud's file, handles, repr, exported YAML)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from provider_fakes import make_env
from providers.base import LaunchRequest, Offer

SECRET = "dummysecret123"
KEY_ID = "dummykeyid777"
SECRETS = {"AWS_ACCESS_KEY_ID": KEY_ID, "AWS_SECRET_ACCESS_KEY": SECRET}


def _files_with(root: Path, needle: str) -> list[str]:
    raw = needle.encode()
    return [str(p) for p in root.rglob("*") if p.is_file() and raw in p.read_bytes()]


def test_repr_of_a_launch_request_shows_no_secret():
    req = LaunchRequest("j", 1, Offer("runpod", "any", "H100", 8, False, 2.5), 1, ["true"], secrets=dict(SECRETS))
    assert SECRET not in repr(req) and KEY_ID not in repr(req) and "secrets" not in repr(req)
    assert req.secrets == SECRETS


@pytest.mark.parametrize("name", ["runpod", "lambda", "vast", "modal"])
def test_remote_launch_carries_secrets_to_the_sdk_and_stores_none(name, tmp_path, credentials, monkeypatch):
    home = tmp_path / "dtrun-home"
    monkeypatch.setenv("DTRUN_HOME", str(home))
    penv = make_env(name, tmp_path)
    req = dataclasses.replace(penv.request(secrets=dict(SECRETS)),
                              env={"DTRUN_RUN_URI": "s3://b/run", "AWS_ENDPOINT_URL": "http://s3.x"})
    h = penv.provider.launch(req)
    if name == "modal":  # what the real SDK sent to the (local fake) control plane
        (sb,) = penv.fake.sandboxes.values()
        sent = [penv.fake.secrets[s] for s in sb.definition.secret_ids]
        assert SECRETS in sent                              # its own modal.Secret.from_dict
        (env,) = [d for d in sent if d != SECRETS]           # the plain `env`, with no secret in it
        assert SECRET not in json.dumps(env) and env["AWS_ENDPOINT_URL"] == "http://s3.x"
    else:
        calls = [c for c in penv.fake.calls if c[0] in ("launch", "create")]
        assert len(calls) == 1
        cfg = calls[0][1]["config"]
        assert cfg["secrets"] == SECRETS                    # SkyPilot task `secrets:`
        assert SECRET not in json.dumps(cfg["envs"])
        assert cfg["envs"]["AWS_ENDPOINT_URL"] == "http://s3.x"
    # nothing the provider keeps or returns holds a secret
    assert SECRET not in json.dumps(h.to_dict()) and KEY_ID not in json.dumps(h.to_dict())
    assert _files_with(tmp_path, SECRET) == [] and _files_with(tmp_path, KEY_ID) == []
    penv.provider.poll(h)
    penv.provider.terminate(h)
    assert _files_with(tmp_path, SECRET) == []


def test_skypilot_accepts_the_task_with_secrets_and_redacts_them(tmp_path, credentials, monkeypatch):
    monkeypatch.setenv("DTRUN_HOME", str(tmp_path / "dtrun-home"))
    penv = make_env("runpod", tmp_path)
    cfg = penv.provider.task_config(penv.request(secrets=dict(SECRETS)))  # validated by sky.Task
    from providers.skypilot.api import task_from_config

    task = task_from_config(cfg)
    assert {k: v.get_secret_value() for k, v in task.secrets.items()} == SECRETS
    assert SECRET not in json.dumps(task.to_yaml_config(use_user_specified_yaml=True))  # what SkyPilot stores
    # no secrets → no `secrets:` key at all
    assert "secrets" not in penv.provider.task_config(penv.request())


def test_modal_api_passes_a_modal_secret_to_sandbox_create(monkeypatch):
    from providers.modal.api import ModalAPI, SandboxSpec

    from provider_fakes import modal_server

    server = modal_server()
    spec = SandboxSpec(name="dtrun-j-a1", command=["python", "x.py"], env={"A": "1"}, gpu="H100:1", timeout=60,
                       secrets=dict(SECRETS))
    sid = ModalAPI().create(spec)
    sent = [server.secrets[s] for s in server.sandboxes[sid].definition.secret_ids]
    assert SECRETS in sent and {"A": "1"} in sent and len(sent) == 2
    sid = ModalAPI().create(SandboxSpec(name="n", command=["true"], env={}, gpu="H100:1", timeout=60))
    assert list(server.sandboxes[sid].definition.secret_ids) == []


def test_fake_cloud_drops_secrets(tmp_path):
    from providers.fake import FakeProvider
    from providers.base import Requirements

    path = tmp_path / "fake-cloud.json"
    cloud = FakeProvider(path=path)
    offer = cloud.offers(Requirements("H100", 8, 1, "prefer"))[0]
    h = cloud.launch(LaunchRequest("j", 1, offer, 1, ["true"], env={"DTRUN_RUN_URI": "s3://b/r"},
                                   secrets=dict(SECRETS)))
    assert path.is_file() and SECRET not in path.read_text() and KEY_ID not in path.read_text()
    assert SECRET not in json.dumps(h.to_dict())


def test_export_lists_secret_keys_without_values_and_sky_launch_fills_them(tmp_path, capsys, monkeypatch):
    from orchestrator.cli.app import main

    for k, v in SECRETS.items():
        monkeypatch.setenv(k, v)
    job = tmp_path / "j.yaml"
    job.write_text("name: ex\nresources: {providers: [runpod], gpu: H100, gpus_per_node: 1, spot: false}\n"
                   "trainer: {model: tiny, steps: 10, batch_size: 8, seq_len: 64}\n"
                   "checkpoint: {uri: 's3://bucket/runs/{name}'}\nbudget: {max_usd: 10}\n")
    assert main(["export", str(job), "--skypilot"]) == 0
    out = capsys.readouterr().out
    assert SECRET not in out and KEY_ID not in out
    assert "--secret AWS_ACCESS_KEY_ID --secret AWS_SECRET_ACCESS_KEY" in out
    cfg = yaml.safe_load(out)
    assert cfg["secrets"] == {"AWS_ACCESS_KEY_ID": None, "AWS_SECRET_ACCESS_KEY": None}
    import sky

    # what `sky launch <file> --secret AWS_ACCESS_KEY_ID --secret AWS_SECRET_ACCESS_KEY` does
    task = sky.Task.from_yaml_config(dict(cfg), secrets_overrides=list(SECRETS.items()))
    assert {k: v.get_secret_value() for k, v in task.secrets.items()} == SECRETS
    # a file:// job exports no secrets section
    job.write_text(job.read_text().replace("s3://bucket/runs/{name}", "file:///tmp/x/{name}"))
    assert main(["export", str(job), "--skypilot"]) == 0
    assert "secrets" not in yaml.safe_load(capsys.readouterr().out)


def test_a_price_fetchers_error_line_never_quotes_a_key(tmp_path, monkeypatch, capsys):
    """providers/skypilot/fetch.py prints the fetcher's exception (it reaches the terminal and the
    refresh record): an SDK error quoting the request URL with the key in it is masked."""
    from providers.skypilot import fetch
    from tests.conftest import write_provider_credentials

    monkeypatch.setenv("HOME", str(tmp_path))
    write_provider_credentials(tmp_path)

    def leaky(out):
        raise ConnectionError("GET https://console.vast.ai/api/v0/bundles/?api_key=vast-placeholder failed; "
                              "runpod rp-placeholder, lambda lambda-placeholder")

    monkeypatch.setattr(fetch, "fetch_vast", leaky)
    assert fetch.main(["vast", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "vast fetcher failed: ConnectionError" in err and err.count("<key>") == 3
    assert "placeholder" not in err
