"""`dtrun simulate`: the real controller on the fake cloud and a virtual clock, N runs."""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from orchestrator.cli.app import app
from orchestrator.plan.estimate import make_plan
from orchestrator.run.simnode import Model, SimNode
from orchestrator.run.simulate import simulate
from orchestrator.plan.spec import parse_spec


def _spec(**over) -> dict:
    d = {
        "name": "simjob",
        "resources": {"providers": ["fake"], "gpu": "H100", "gpus_per_node": 8, "spot": True},
        "trainer": {"model": "gpt2-124m", "tokens": 1_000_000_000, "batch_size": 512, "seq_len": 1024},
        "checkpoint": {"every_steps": 400},
        "budget": {"max_usd": 100},
    }
    for k, v in over.items():
        d[k] = {**d.get(k, {}), **v}
    return d


@pytest.fixture(autouse=True)
def _home(dtrun_home):
    yield


def test_node_model_progress_checkpoints_and_done():
    m = Model(total_steps=25, step_s=1.0, every=10, save_s=2.0, load_s=0, compile_s=0, provision_s=0)
    n = SimNode("i", 1, ready_at=0.0, start_step=0, train_start=100.0)
    assert n.progress(m, 50.0) == (0, 0, None)
    assert n.progress(m, 105.5) == (5, 0, None)
    assert n.progress(m, 111.0) == (10, 0, None)      # saving step 10
    assert n.progress(m, 112.0) == (10, 10, None)     # committed
    assert n.progress(m, 122.5) == (20, 10, None)
    assert n.progress(m, 200.0) == (25, 25, 131.0)    # 25 steps + 3 saves (10, 20, final)
    n2 = SimNode("j", 2, ready_at=0.0, start_step=17, train_start=0.0)
    assert n2.progress(m, 3.0) == (20, 17, None)      # resumes from 17, next checkpoint at 20


def test_on_demand_run_costs_what_the_estimate_says():
    spec = parse_spec(_spec(resources={"spot": False}))
    out = simulate(spec, runs=3, seed=1)
    assert out["states"] == {"SUCCEEDED": 3}
    assert out["preemptions_mean"] == 0 and out["attempts_mean"] == 1
    assert out["orphan_instance_seconds"] == 0
    # no randomness without preemptions: every run identical, within a tick of the estimate
    assert out["cost_usd_p95"] == pytest.approx(out["cost_usd_mean"])
    tick_usd = out["price_per_hour"] * out["poll_seconds"] / 3600
    assert abs(out["cost_usd_mean"] - out["expected_usd"]) <= tick_usd + 0.02 * out["expected_usd"]
    assert out["expected_usd"] == pytest.approx(make_plan(spec).estimate.expected_usd)
    assert 0 < out["goodput_mean"] < 1


def test_preemptions_cost_attempts_and_lost_work_and_nothing_leaks():
    spec = parse_spec(_spec())
    calm = simulate(spec, preemptions_per_hour=0.0, runs=20, seed=3)
    stormy = simulate(spec, preemptions_per_hour=12.0, runs=20, seed=3)
    assert stormy["states"].get("SUCCEEDED", 0) == 20
    assert stormy["attempts_mean"] > 1.5 and stormy["preemptions_mean"] > 0.5
    assert stormy["work_lost_steps_mean"] > 0
    assert stormy["cost_usd_mean"] > calm["cost_usd_mean"]
    assert stormy["goodput_mean"] < calm["goodput_mean"]
    assert stormy["orphan_instance_seconds"] == 0 and calm["orphan_instance_seconds"] == 0
    assert stormy["cost_usd_p95"] >= stormy["cost_usd_mean"]


def test_same_seed_same_answer_other_seed_other_answer():
    spec = parse_spec(_spec())
    a = simulate(spec, preemptions_per_hour=3.0, runs=6, seed=7)
    b = simulate(spec, preemptions_per_hour=3.0, runs=6, seed=7)
    c = simulate(spec, preemptions_per_hour=3.0, runs=6, seed=8)
    assert a["cost_usd_mean"] == b["cost_usd_mean"]
    assert a["cost_usd_mean"] != c["cost_usd_mean"]


def test_budget_too_small_stops_every_run_within_a_tick():
    spec = parse_spec(_spec(budget={"max_usd": 2.0}, resources={"spot": False}))
    out = simulate(spec, runs=3, seed=0)
    assert out["states"] == {"OVER_BUDGET": 3}
    assert out["budget_exceeded_runs"] == 3
    tick_usd = out["price_per_hour"] * out["poll_seconds"] / 3600
    assert out["cost_usd_max"] <= 2.0 + tick_usd
    assert out["orphan_instance_seconds"] == 0


def test_auto_interval_is_young_daly():
    spec = parse_spec(_spec(checkpoint={"every_steps": "auto"}))
    out = simulate(spec, preemptions_per_hour=2.0, runs=2, seed=0)
    step_s = out["step_seconds"]
    cost = max(step_s, out["step_seconds"])  # checkpoint stall < one step here: the estimate floors at a step
    want = round(math.sqrt(2 * cost * 3600 / 2.0) / step_s)
    assert out["young_daly_every_steps"] == want
    assert out["checkpoint_every_steps"] == want


def test_cli_json_has_the_contract_keys():
    import yaml

    from orchestrator.plan.spec import spec_to_yaml

    spec = parse_spec(_spec())
    import tempfile, os

    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(spec_to_yaml(spec))
    try:
        r = CliRunner().invoke(app, ["simulate", f.name, "--preemptions-per-hour", "1", "--runs", "8",
                                     "--seed", "2", "--json"])
        assert r.exit_code == 0, r.output
        d = json.loads(r.output)
        for k in ("runs", "goodput_mean", "cost_usd_mean", "cost_usd_p95", "expected_usd", "estimate_usd",
                  "budget_exceeded_runs", "orphan_instance_seconds"):
            assert k in d, k
        assert d["runs"] == 8 and d["orphan_instance_seconds"] == 0
        assert d["young_daly"]["checkpoint_every_steps"] == d["young_daly_every_steps"]
        r = CliRunner().invoke(app, ["simulate", f.name, "--runs", "3"])
        assert r.exit_code == 0 and "goodput" in r.output and "Young/Daly" in r.output
    finally:
        os.unlink(f.name)


def test_bad_runs_is_a_usage_error(tmp_path):
    from orchestrator.cli.app import main
    from orchestrator.plan.spec import spec_to_yaml

    p = tmp_path / "j.yaml"
    p.write_text(spec_to_yaml(parse_spec(_spec())))
    assert main(["simulate", str(p), "--runs", "0"]) == 2


def test_text_report_for_a_free_local_job(tmp_path):
    from orchestrator.cli.app import main

    p = tmp_path / "q.yaml"
    p.write_text("name: quick\nresources: {providers: [local], gpu: cpu, gpus_per_node: 2}\n"
                 "trainer: {model: tiny, steps: 100, batch_size: 8, seq_len: 64}\n")
    r = CliRunner().invoke(app, ["simulate", str(p), "--runs", "2"])
    assert r.exit_code == 0, r.output
    assert "$0.00" in r.output and "orphans     0 instance-seconds" in r.output
    assert main(["simulate", str(tmp_path / "missing.yaml")]) == 2


def test_preemption_count_matches_the_exposure_model():
    # preemptions strike only while a node runs: N = λ·W / (1 − λ·ℓ), with W the work and ℓ the
    # running time lost per preemption (half an interval + checkpoint load + compile)
    spec = parse_spec(_spec(trainer={"tokens": 4_000_000_000}, checkpoint={"every_steps": 400}))
    rate = 4.0
    out = simulate(spec, preemptions_per_hour=rate, runs=100, seed=11)
    W = out["steps"] * out["step_seconds"] / 3600
    ell = (400 * out["step_seconds"] / 2 + out["checkpoint_load_seconds"]) / 3600
    n = rate * W / (1 - rate * ell)
    assert out["preemptions_mean"] == pytest.approx(n, abs=0.3)
    assert out["attempts_mean"] == pytest.approx(1 + out["preemptions_mean"], abs=0.05)


def test_prefer_with_a_rate_simulates_the_spot_offer(capsys):
    import json
    from pathlib import Path

    from orchestrator.cli.simulate import cmd_simulate

    job = Path(__file__).resolve().parents[3] / "jobs" / "gpt2-124m.yaml"
    assert cmd_simulate(job, 2.0, 20, 0, True) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["offer"].endswith("/spot")
    assert out["preemptions_per_hour"] == 2.0 and out["preemptions_mean"] > 0
    assert "spot" in out["note"]


def _rented(**over):
    d = _spec(resources={"providers": ["runpod", "vast"], "spot": True},
              checkpoint={"uri": "s3://b/{name}", "every_steps": 400}, **over)
    return parse_spec(d)


def test_simulate_fails_over_between_offers_when_capacity_runs_out(monkeypatch, tmp_path):
    monkeypatch.setenv("DTRUN_SKY_CATALOG_DIR", str(tmp_path / "none"))
    out = simulate(_rented(), preemptions_per_hour=1.0, runs=12, seed=3, no_capacity=0.5)
    assert len(out["offers_sold"]) >= 2 and out["no_capacity_mean"] > 0
    assert out["runs_with_failover"] > 0  # the controller moved to the next offer, as it would
    assert out["states"] == {"SUCCEEDED": 12} and out["orphan_instance_seconds"] == 0
    base = simulate(_rented(), preemptions_per_hour=1.0, runs=12, seed=3)
    assert base["runs_with_failover"] == 0 and base["no_capacity_mean"] == 0


def test_soft_preemptions_with_enough_notice_lose_no_work(monkeypatch, tmp_path):
    monkeypatch.setenv("DTRUN_SKY_CATALOG_DIR", str(tmp_path / "none"))
    hard = simulate(_rented(), preemptions_per_hour=2.0, runs=10, seed=5, soft_fraction=0.0)
    soft = simulate(_rented(), preemptions_per_hour=2.0, runs=10, seed=5, notice_seconds=120, soft_fraction=1.0)
    assert hard["preemptions_mean"] > 0 and hard["work_lost_steps_mean"] > 0 and hard["soft_preemptions_mean"] == 0
    assert soft["soft_preemptions_mean"] == pytest.approx(soft["preemptions_mean"])
    assert soft["work_lost_steps_mean"] < 0.2 * hard["work_lost_steps_mean"]
    # a notice too short for the emergency checkpoint saves nothing
    short = simulate(_rented(), preemptions_per_hour=2.0, runs=10, seed=5, notice_seconds=0.1, soft_fraction=1.0)
    assert short["soft_preemptions_saved_mean"] == 0


def _lambda_job(tmp_path, spot="prefer"):
    import yaml
    from pathlib import Path

    d = yaml.safe_load((Path(__file__).resolve().parents[3] / "jobs" / "gpt2-124m.yaml").read_text())
    d["resources"].update(providers=["lambda"], spot=spot)
    p = tmp_path / "lambda.yaml"
    p.write_text(yaml.safe_dump(d, sort_keys=False))
    return p


def test_prefer_without_a_rate_says_it_simulates_on_demand_and_why(capsys, monkeypatch, tmp_path):
    from orchestrator.cli.app import main

    monkeypatch.setenv("DTRUN_SKY_CATALOG_DIR", str(tmp_path / "none"))
    assert main(["simulate", str(_lambda_job(tmp_path)), "--runs", "2"]) == 0
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    assert first.startswith("resources.spot: prefer: simulating on-demand lambda/")
    assert "0 preemptions/h" in first and "--preemptions-per-hour" in first
    assert main(["simulate", str(_lambda_job(tmp_path)), "--runs", "2", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["spot"] is False and d["note"] == first and d["spot_choice"]["won"] == "on-demand"


@pytest.mark.parametrize("spot, why", [("prefer", "Lambda sells no spot"), (False, "resources.spot: false")])
def test_a_preemption_rate_on_an_on_demand_job_is_refused_not_zeroed(capsys, monkeypatch, tmp_path, spot, why):
    from orchestrator.cli.app import main

    monkeypatch.setenv("DTRUN_SKY_CATALOG_DIR", str(tmp_path / "none"))
    assert main(["simulate", str(_lambda_job(tmp_path, spot)), "--preemptions-per-hour", "0.5", "--runs", "2"]) == 2
    err = capsys.readouterr().err
    assert "--preemptions-per-hour 0.5" in err and why in err and "not preempted" in err
    assert len(err.strip().splitlines()) == 1
    # a rate of 0 asks nothing of spot: still simulated
    assert main(["simulate", str(_lambda_job(tmp_path, spot)), "--preemptions-per-hour", "0", "--runs", "2"]) == 0


def test_failed_runs_print_their_reason(tmp_path):
    from orchestrator.plan.spec import spec_to_yaml

    p = tmp_path / "j.yaml"
    p.write_text(spec_to_yaml(parse_spec(_spec())))
    r = CliRunner().invoke(app, ["simulate", str(p), "--runs", "4", "--preemptions-per-hour", "1",
                                 "--no-capacity", "0.99"])
    assert r.exit_code == 0, r.output
    assert "outcome     FAILED 3" in r.output
    assert "failed      3 run(s): gave up after 20 failed launches" in r.output


def test_simulate_prints_money_as_the_dry_run_does(tmp_path):
    from orchestrator.plan.spec import spec_to_yaml

    p = tmp_path / "j.yaml"
    p.write_text(spec_to_yaml(parse_spec(_spec(trainer={"tokens": 1_000_000_000_000}, budget={"max_usd": 100_000},
                                               resources={"spot": False}))))
    r = CliRunner().invoke(app, ["simulate", str(p), "--runs", "1", "--json"])
    d = json.loads(r.output)
    assert d["estimate_usd"] > 1000
    r = CliRunner().invoke(app, ["simulate", str(p), "--runs", "1"])
    assert f"with 20% buffer ${d['estimate_usd']:,.2f}" in r.output and f"${d['cost_usd_mean']:,.2f}" in r.output
