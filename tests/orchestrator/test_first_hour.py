"""The first hour of a new user (issue 23): prices before any account, refusals before renting,
run URIs that follow the job file, `dtrun init`, `--version`, `down --yes`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from orchestrator.cli.app import main

ROOT = Path(__file__).resolve().parents[2]
GPT2 = ROOT / "jobs" / "gpt2-124m.yaml"


@pytest.fixture
def no_credentials(tmp_path, monkeypatch):
    """A HOME with no provider credentials at all (a fresh machine)."""
    home = tmp_path / "bare-home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("DTRUN_SKY_CATALOG_DIR", str(tmp_path / "no-catalogs"))
    monkeypatch.setenv("MODAL_CONFIG_PATH", str(home / ".modal.toml"))
    for v in ("MODAL_TOKEN_ID", "MODAL_TOKEN_SECRET", "RUNPOD_API_KEY", "VAST_API_KEY", "LAMBDA_API_KEY"):
        monkeypatch.delenv(v, raising=False)
    return home


def _json(capsys, argv):
    rc = main(argv)
    return rc, json.loads(capsys.readouterr().out)


# ---- 1. prices before an account ---------------------------------------------------------------

def test_dry_run_without_any_account_prices_every_offer_and_exits_5(no_credentials, capsys):
    rc, out = _json(capsys, ["up", str(GPT2), "--dry-run", "--json"])
    assert rc == 5 and out["exit_code"] == 5
    assert out["usable"] is False and out["chosen"] is None
    offers = out["offers"]
    assert {o["provider"] for o in offers} == {"runpod", "lambda", "vast", "modal"}
    assert all(o["usable"] is False and o["fix"] for o in offers)
    costs = [o["expected_usd"] for o in offers]
    assert costs == sorted(costs)
    # the estimate and the budget verdict are there, for the offer it would choose
    assert out["would_choose"]["provider"] == offers[0]["provider"]
    assert out["cost_usd"] == pytest.approx(offers[0]["cost_usd"]) and out["cost_usd"] > 0
    assert out["budget_usd"] == 250 and out["within_budget"] is True
    # each fix names the credential file and the command that writes it
    fixes = {o["provider"]: o["fix"] for o in offers}
    assert "~/.runpod/config.toml" in fixes["runpod"] and "runpod config" in fixes["runpod"]
    assert "~/.config/vastai/vast_api_key" in fixes["vast"] and "vastai set api-key" in fixes["vast"]
    assert "~/.lambda_cloud/lambda_keys" in fixes["lambda"]
    assert "~/.modal.toml" in fixes["modal"] and "modal token set" in fixes["modal"]


def test_dry_run_without_any_account_human_output(no_credentials, capsys):
    rc = main(["up", str(GPT2), "--dry-run"])
    cap = capsys.readouterr()
    assert rc == 5
    assert "not offered" not in cap.out
    assert "Would choose" in cap.out and "total" in cap.out and "Budget:" in cap.out
    assert "* needs credentials: runpod" in cap.out and "runpod*" in cap.out
    assert "once its credentials are set" in cap.err and "dtrun simulate" in cap.err


def test_some_usable_are_ranked_first_the_others_need_credentials(no_credentials, capsys, monkeypatch):
    monkeypatch.setenv("MODAL_TOKEN_ID", "ak-placeholder")
    monkeypatch.setenv("MODAL_TOKEN_SECRET", "as-placeholder")
    rc, out = _json(capsys, ["up", str(GPT2), "--dry-run", "--json"])
    assert rc == 0 and out["usable"] is True and out["chosen"]["provider"] == "modal"
    usable = [o["usable"] for o in out["offers"]]
    assert usable[0] is True and usable == sorted(usable, reverse=True) and False in usable
    assert out["would_choose"] is None
    main(["up", str(GPT2), "--dry-run"])
    text = capsys.readouterr().out
    assert "Chosen:" in text and "vast*" in text and "* needs credentials: vast" in text
