"""The quote tells the truth (issue 24, item 5): the buffered figure names what it is, an estimate
longer than budget.max_hours is refused unless the deadline is meant to cut, the "nothing caps the
spend" line is exact, and a tiny job's step has a floor."""

from __future__ import annotations

import json

import pytest
import yaml

from orchestrator.cli.app import main
from orchestrator.plan.estimate import step_floor_seconds
from orchestrator.plan.spec import load_spec
from tests.orchestrator.cli.test_dryrun import GPT2, job_file


@pytest.fixture(autouse=True)
def no_sky_catalog(tmp_path, monkeypatch, provider_credentials):
    monkeypatch.setenv("DTRUN_SKY_CATALOG_DIR", str(tmp_path / "no-catalogs"))


def dry(capsys, f, json_out=True):
    rc = main(["up", str(f), "--dry-run"] + (["--json"] if json_out else []))
    out = capsys.readouterr()
    return rc, (json.loads(out.out) if json_out else out.out + out.err)


def test_buffer_label_names_the_p95_floor_when_it_is_larger(capsys, tmp_path):
    f = job_file(tmp_path, resources__spot=True, resources__providers=["vast"],
                 resources__preemptions_per_hour=2.0)
    rc, out = dry(capsys, f)
    b = out["breakdown"]
    assert out["cost_usd"] > out["expected_usd"] * 1.2 + 1e-6      # the floor is the larger figure
    assert b["buffer_basis"].startswith("p95-preemptions floor")
    rc, text = dry(capsys, f, json_out=False)
    assert "with p95-preemptions floor" in text and "with 20% buffer" not in text


def test_buffer_label_says_20_percent_when_that_is_the_figure(capsys, tmp_path):
    f = job_file(tmp_path, resources__spot=False)
    rc, out = dry(capsys, f)
    assert out["cost_usd"] == pytest.approx(out["expected_usd"] * 1.2, rel=1e-4)
    assert out["breakdown"]["buffer_basis"] == "20% buffer"


def test_estimate_longer_than_max_hours_is_refused_with_what_the_deadline_trains(capsys, tmp_path):
    f = job_file(tmp_path, budget__max_hours=0.25, budget__max_usd=10_000)
    rc, out = dry(capsys, f)
    assert rc == 3 and out["within_budget"] is False
    dl = out["breakdown"]["deadline"]
    assert dl["max_hours"] == 0.25 and dl["estimate_hours"] > 0.25 and dl["cut"] is False
    assert 0 < dl["steps_by_deadline"] < out["steps"]
    rc, text = dry(capsys, f, json_out=False)
    assert rc == 3
    assert "longer than budget.max_hours (0.25 h)" in text and "would be trained" in text
    assert "budget.cut_at_deadline" in text and "nothing will be rented" in text


def test_cut_at_deadline_accepts_and_prices_up_to_the_deadline(capsys, tmp_path):
    f = job_file(tmp_path, budget__max_hours=0.25, budget__max_usd=10_000, budget__cut_at_deadline=True)
    rc, out = dry(capsys, f)
    assert rc == 0 and out["within_budget"] is True
    assert out["hours"] == pytest.approx(0.25)
    assert out["cost_usd"] == pytest.approx(out["breakdown"]["price_per_hour"] * 0.25)
    assert out["breakdown"]["deadline"]["cut"] is True
    rc, text = dry(capsys, f, json_out=False)
    total = next(x for x in text.splitlines() if x.strip().startswith("total"))
    assert total.endswith("(capped by budget.max_hours (0.25 h): the run stops there)") and " with " not in total


def test_a_command_jobs_refusal_names_the_command_fields_to_cut(capsys, tmp_path):
    (tmp_path / "train.py").write_text("print('step 1')\n")
    f = job_file(tmp_path, budget__max_hours=0.25, budget__max_usd=10_000)
    data = yaml.safe_load(f.read_text())
    del data["trainer"]
    data["command"] = {"run": "train.py", "hours": 2}
    f.write_text(yaml.safe_dump(data))
    rc, text = dry(capsys, f, json_out=False)
    text = " ".join(text.split())  # the console wraps long lines
    assert rc == 3 and "cut command.hours (or command.tokens)" in text and "trainer.tokens" not in text


def test_nothing_caps_the_spend_is_exact(capsys, tmp_path):
    data = yaml.safe_load(GPT2.read_text())
    data["budget"] = {}
    f = tmp_path / "nocap.yaml"
    f.write_text(yaml.safe_dump(data))
    rc, text = dry(capsys, f, json_out=False)
    assert "neither budget.max_usd nor budget.max_hours is set: nothing caps the spend." in text
    assert "but budget.max_hours" not in text
    data["budget"] = {"max_hours": 12}
    f.write_text(yaml.safe_dump(data))
    rc, text = dry(capsys, f, json_out=False)
    assert "only budget.max_hours (12 h) caps the spend" in text


def test_tiny_job_step_has_a_floor(capsys, tmp_path):
    data = yaml.safe_load(GPT2.read_text())
    data["resources"].update(gpu="L4", gpus_per_node=1, providers=["runpod"], spot=False)
    data["trainer"].update(model="tiny", tokens=200_000_000, seq_len=128, batch_size=8, micro_batch_size=8,
                           parallel="auto", compile=False)
    for k in ("data", "eval_every", "eval_tokens"):
        data["trainer"].pop(k, None)
    f = tmp_path / "tiny.yaml"
    f.write_text(yaml.safe_dump(data))
    rc, out = dry(capsys, f)
    b = out["breakdown"]
    floor = step_floor_seconds(load_spec(f), 1)
    assert b["flops_step_seconds"] < floor                  # FLOPs alone: microseconds
    assert b["step_seconds"] == pytest.approx(floor)
    assert b["compute_hours"] == pytest.approx(out["steps"] * floor / 3600)
    assert b["compute_hours"] * 60 > 1.0                     # not "0.0 min"
    rc, text = dry(capsys, f, json_out=False)
    assert "the per-step floor" in text


def test_cpu_ranks_on_a_gpu_node_are_timed_as_cpus_and_priced_as_the_node(capsys, tmp_path):
    from orchestrator.contract.gpus import GPUS

    f = job_file(tmp_path, resources__spot=False, resources__providers=["runpod"])
    rc, gpu_run = dry(capsys, f)
    data = yaml.safe_load(f.read_text())
    data["trainer"]["device"] = "cpu"  # the smoke run of the launch path
    f.write_text(yaml.safe_dump(data))
    rc, cpu_run = dry(capsys, f)
    g, c = gpu_run["breakdown"], cpu_run["breakdown"]
    assert c["peak_flops_per_gpu"] == GPUS["cpu"].peak_bf16_flops
    assert c["compute_hours"] == pytest.approx(g["compute_hours"] * g["peak_flops_per_gpu"] / GPUS["cpu"].peak_bf16_flops,
                                               rel=1e-6)
    assert c["price_per_hour"] > 0 and c["price_per_hour"] == pytest.approx(cpu_run["chosen"]["price_per_hour"])  # the node
