"""Which exit code wins when several things are wrong at once (docs/commands.md, "When several
things are wrong"): over budget (3) comes before missing provider credentials (5) and before the
run URI's credentials (6) — it is the verdict the user asked for — in the dry run and in `up`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from orchestrator.cli.app import main

ROOT = Path(__file__).resolve().parents[3]
GPT2 = ROOT / "jobs" / "gpt2-124m.yaml"


def _job(tmp_path: Path, max_usd: float, uri: str = "s3://my-bucket/dtrun/{name}") -> Path:
    data = yaml.safe_load(GPT2.read_text())
    data["budget"]["max_usd"] = max_usd
    data["checkpoint"]["uri"] = uri
    f = tmp_path / "job.yaml"
    f.write_text(yaml.safe_dump(data))
    return f


@pytest.fixture
def no_aws(monkeypatch, tmp_path):
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
              "AWS_DEFAULT_PROFILE", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
              "AWS_CONTAINER_CREDENTIALS_FULL_URI", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_ROLE_ARN"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


def _codes(capsys, f: Path) -> tuple[int, int, int, str]:
    """(dry run, dry run --json and its exit_code field agree, up --yes) and up's stderr."""
    rc_dry = main(["up", str(f), "--dry-run"])
    capsys.readouterr()
    rc_json = main(["up", str(f), "--dry-run", "--json"])
    out = capsys.readouterr().out
    if out.strip():  # a verdict is a JSON object; a refusal after it is one line on stderr
        assert json.loads(out)["exit_code"] == rc_json
    rc_up = main(["up", str(f), "--yes"])
    return rc_dry, rc_json, rc_up, capsys.readouterr().err


def test_over_budget_and_no_provider_credentials_is_3(no_credentials, dtrun_home, no_aws, tmp_path, capsys):
    rc_dry, rc_json, rc_up, err = _codes(capsys, _job(tmp_path, max_usd=1))
    assert (rc_dry, rc_json, rc_up) == (3, 3, 3), err
    assert "over budget" in err and "nothing rented" in err and "Traceback" not in err


def test_within_budget_and_no_provider_credentials_is_5(no_credentials, dtrun_home, no_aws, tmp_path, capsys):
    rc_dry, rc_json, rc_up, err = _codes(capsys, _job(tmp_path, max_usd=250))
    assert (rc_dry, rc_json, rc_up) == (5, 5, 5), err


def test_over_budget_with_credentials_is_3(provider_credentials, dtrun_home, no_aws, tmp_path, capsys):
    # the run URI's S3 credentials are missing too (6 by themselves): the budget still decides
    rc_dry, rc_json, rc_up, err = _codes(capsys, _job(tmp_path, max_usd=1))
    assert (rc_dry, rc_json, rc_up) == (3, 3, 3), err


def test_within_budget_with_provider_credentials_but_no_s3_credentials_is_not_3(
        provider_credentials, dtrun_home, no_aws, tmp_path, capsys):
    # the other order: the budget passes, so what is missing decides (the object store's keys)
    rc_dry, rc_json, rc_up, err = _codes(capsys, _job(tmp_path, max_usd=250))
    assert rc_up == 5 and rc_dry == rc_json == 5, err  # the rented node's S3 keys (nodecreds)
    assert "AWS_ACCESS_KEY_ID" in err and "nothing rented" in err
