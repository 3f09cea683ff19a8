"""``dtrun init``: a rented job's tokens sized to the budget by the dry run's own estimate (or a
line saying why not), the terminal form asking GPUs per node and spot, and every answer written
by the YAML dumper (quoted where a plain scalar would be read as something else)."""

from __future__ import annotations

import io
import json

import pytest
import yaml

from orchestrator.cli.app import main
from orchestrator.plan.spec import load_spec


@pytest.fixture(autouse=True)
def _offline(tmp_path, monkeypatch, dtrun_home):
    monkeypatch.setenv("DTRUN_SKY_CATALOG_DIR", str(tmp_path / "no-catalogs"))
    monkeypatch.setattr("orchestrator.cli.init._tty", lambda: False)


def _dry(capsys, f):
    capsys.readouterr()
    rc = main(["up", str(f), "--dry-run", "--json"])
    return rc, json.loads(capsys.readouterr().out)


def test_tokens_are_sized_to_the_budget_the_dry_run_then_accepts(tmp_path, capsys, provider_credentials):
    f = tmp_path / "big.yaml"
    assert main(["init", "--model", "llama3-8b", "--gpu", "H100", "--gpus", "8", "--budget", "100",
                 "--out", str(f)]) == 0
    said = capsys.readouterr().out
    assert "20 per parameter (Chinchilla, 161B tokens) would cost $" in said and "> budget $100: sized to" in said
    job = yaml.safe_load(f.read_text())
    assert job["resources"]["gpus_per_node"] == 8 and 1e8 < job["trainer"]["tokens"] < 160e9
    assert "sized to budget.max_usd" in f.read_text()
    rc, rep = _dry(capsys, f)
    assert rc == 0 and rep["cost_usd"] <= 100
    assert rep["cost_usd"] > 80  # the most that fits (two significant digits), not a token amount


def test_a_budget_chinchilla_fits_keeps_twenty_tokens_per_parameter(tmp_path, capsys, provider_credentials):
    f = tmp_path / "gpt.yaml"
    assert main(["init", "--model", "gpt2-124m", "--gpu", "H100", "--budget", "40", "--out", str(f)]) == 0
    assert "sized" not in capsys.readouterr().out
    from orchestrator.plan.presets import PRESETS

    assert yaml.safe_load(f.read_text())["trainer"]["tokens"] == 20 * PRESETS["gpt2-124m"].num_params()


def test_a_budget_below_one_step_says_the_dry_run_will_refuse(tmp_path, capsys, provider_credentials):
    f = tmp_path / "tiny-budget.yaml"
    assert main(["init", "--model", "llama3-8b", "--gpu", "H100", "--gpus", "8", "--budget", "0.01",
                 "--out", str(f)]) == 0
    said = capsys.readouterr().out
    assert "even one step is estimated at $" in said and "will refuse it (exit 3)" in said
    rc, _ = _dry(capsys, f)
    assert rc == 3


@pytest.mark.parametrize("data", ["s3://b/a: b", "s3://b/a #b", "8", "yes", "./x: y #z"])
def test_answers_are_written_by_the_yaml_dumper(tmp_path, capsys, data):
    f = tmp_path / "q.yaml"
    assert main(["init", "--data", data, "--out", str(f)]) == 0
    assert yaml.safe_load(f.read_text())["trainer"]["data"] == data
    spec = load_spec(f)  # no ScannerError, no type error
    assert spec.trainer.data.endswith(data.lstrip("./")) or spec.trainer.data == data


def test_the_terminal_form_asks_gpus_per_node_and_spot(tmp_path, capsys, monkeypatch, provider_credentials):
    monkeypatch.setattr("orchestrator.cli.init._tty", lambda: True)
    monkeypatch.setattr("sys.stdin", io.StringIO("gpt2-124m\nH100\n\n400\n8\nfalse\n"))
    f = tmp_path / "asked.yaml"
    assert main(["init", "--out", str(f)]) == 0
    asked = capsys.readouterr().out
    assert "GPUs per node" in asked and "Spot" in asked
    job = yaml.safe_load(f.read_text())
    assert job["resources"]["gpus_per_node"] == 8 and job["resources"]["spot"] is False
    assert job["trainer"]["batch_size"] % 8 == 0
    monkeypatch.setattr("sys.stdin", io.StringIO("gpt2-124m\nH100\n\n400\neight\n"))
    assert main(["init", "--out", str(tmp_path / "typo.yaml")]) == 2
    err = capsys.readouterr().err
    assert "'eight' is not a whole number" in err and not (tmp_path / "typo.yaml").exists()
    assert main(["init", "--gpu", "H100", "--spot", "sometimes", "--out", str(tmp_path / "s.yaml")]) == 2
    assert "spot: 'sometimes'" in capsys.readouterr().err
