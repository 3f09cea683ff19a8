"""The dry run checks the object store's credentials for an ``s3://`` URI (offline: somewhere for
boto3's chain to take keys from, no network, no boto3) and refuses with the message and the exit
code `dtrun up` gives — exit 6 for nodes on this machine, exit 5 for rented ones — instead of
saying 0 and leaving `up --yes` to refuse."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from orchestrator.cli.app import main

ROOT = Path(__file__).resolve().parents[3]
GPT2 = ROOT / "jobs" / "gpt2-124m.yaml"
AWS_VARS = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION",
            "AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_SHARED_CREDENTIALS_FILE",
            "AWS_CONFIG_FILE", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
            "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_ROLE_ARN")


@pytest.fixture
def bare_aws(tmp_path, monkeypatch, provider_credentials, dtrun_home):
    """Provider keys, but no AWS credentials anywhere (no variables, HOME without ~/.aws); the
    instance metadata endpoint is off so `up`'s real chain does not wait on the network."""
    for k in AWS_VARS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("DTRUN_SKY_CATALOG_DIR", str(tmp_path / "no-catalogs"))
    import shutil

    shutil.rmtree(provider_credentials / ".aws")  # the provider keys stay; the AWS profile goes
    return provider_credentials


def _job(tmp_path: Path, providers: list[str], gpu: str, gpus: int = 1) -> Path:
    data = yaml.safe_load(GPT2.read_text())
    data["resources"].update(providers=providers, gpu=gpu, gpus_per_node=gpus)
    data["resources"].pop("spot", None)
    data["trainer"].update(model="tiny", tokens=20_000, batch_size=8, seq_len=64, data="synthetic")
    data["checkpoint"] = {"uri": "s3://my-bucket/dtrun/{name}"}
    data["budget"] = {"max_usd": 250}
    f = tmp_path / "job.yaml"
    f.write_text(yaml.safe_dump(data))
    return f


def _err(capsys, argv) -> tuple[int, str]:
    rc = main(argv)
    return rc, capsys.readouterr().err.strip()


@pytest.mark.parametrize("providers,gpu,code", [(["local"], "cpu", 6), (["runpod"], "H100", 5)])
def test_dry_run_refuses_s3_without_credentials_as_up_does(bare_aws, tmp_path, capsys, providers, gpu, code):
    f = _job(tmp_path, providers, gpu)
    rc_dry, err_dry = _err(capsys, ["up", str(f), "--dry-run"])
    rc_up, err_up = _err(capsys, ["up", str(f), "--yes"])
    assert rc_up == code, err_up
    assert rc_dry == code, err_dry
    assert err_dry.splitlines()[-1] == err_up.splitlines()[-1]  # the same one line
    assert "AWS_ACCESS_KEY_ID" in err_dry and "nothing rented" in err_dry and "Traceback" not in err_dry
    rc_json, err_json = _err(capsys, ["up", str(f), "--dry-run", "--json"])
    assert rc_json == code and err_json == err_dry.splitlines()[-1]


@pytest.mark.parametrize("how", ["env", "credentials-file", "config-sso", "profile"])
def test_dry_run_passes_when_the_chain_has_somewhere_to_look(bare_aws, tmp_path, capsys, monkeypatch, how):
    home = bare_aws
    if how == "env":
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAEXAMPLE")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    elif how == "credentials-file":
        (home / ".aws").mkdir()
        (home / ".aws" / "credentials").write_text("[default]\naws_access_key_id = A\naws_secret_access_key = B\n")
    elif how == "config-sso":
        (home / ".aws").mkdir()
        (home / ".aws" / "config").write_text("[default]\nsso_session = corp\nsso_account_id = 1\n")
    else:
        (home / ".aws").mkdir()
        (home / ".aws" / "credentials").write_text("[work]\naws_access_key_id = A\naws_secret_access_key = B\n")
        monkeypatch.setenv("AWS_PROFILE", "work")
    f = _job(tmp_path, ["runpod"], "H100")
    rc, err = _err(capsys, ["up", str(f), "--dry-run"])
    assert rc == 0, err


def test_another_profile_than_the_one_with_keys_is_refused(bare_aws, tmp_path, capsys, monkeypatch):
    (bare_aws / ".aws").mkdir()
    (bare_aws / ".aws" / "credentials").write_text("[work]\naws_access_key_id = A\naws_secret_access_key = B\n")
    f = _job(tmp_path, ["local"], "cpu")
    rc, err = _err(capsys, ["up", str(f), "--dry-run"])
    assert rc == 6 and "checkpoint.uri" in err, err


def test_a_local_run_needs_no_aws_credentials(bare_aws, tmp_path, capsys):
    f = _job(tmp_path, ["local"], "cpu")
    data = yaml.safe_load(f.read_text())
    data["checkpoint"]["uri"] = "./runs/{name}"
    f.write_text(yaml.safe_dump(data))
    rc, err = _err(capsys, ["up", str(f), "--dry-run"])
    assert rc == 0, err
