"""`dtrun up --dry-run` and `dtrun prices`: offers from the providers, the estimate arithmetic,
the budget verdict and its exit codes, catalog overrides, and no heavy imports on the fast path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from orchestrator.cli.app import main
from orchestrator.contract.gpus import GPUS, gpu_matches

ROOT = Path(__file__).resolve().parents[3]
GPT2 = ROOT / "jobs" / "gpt2-124m.yaml"


def run_json(capsys, argv):
    rc = main(argv)
    out = capsys.readouterr().out
    return rc, json.loads(out)


def job_file(tmp_path, **changes) -> Path:
    data = yaml.safe_load(GPT2.read_text())
    for dotted, value in changes.items():
        node = data
        keys = dotted.split("__")
        for k in keys[:-1]:
            node = node[k]
        node[keys[-1]] = value
    f = tmp_path / "job.yaml"
    f.write_text(yaml.safe_dump(data))
    return f


@pytest.fixture(autouse=True)
def no_sky_catalog(tmp_path, monkeypatch, provider_credentials):
    monkeypatch.setenv("DTRUN_SKY_CATALOG_DIR", str(tmp_path / "no-catalogs"))


def test_gpt2_dry_run_json(capsys):
    rc, out = run_json(capsys, ["up", str(GPT2), "--dry-run", "--json"])
    assert rc == 0
    for key in ("offers", "chosen", "hours", "cost_usd", "buffer", "budget_usd", "within_budget"):
        assert key in out
    assert out["buffer"] == 0.20 and out["budget_usd"] == 250 and out["within_budget"] is True
    offers = out["offers"]
    assert {o["provider"] for o in offers} >= {"runpod", "lambda", "vast", "modal"}
    for o in offers:
        for key in ("provider", "region", "gpu", "gpus_per_node", "nodes", "spot", "price_per_gpu_hour"):
            assert key in o
        assert gpu_matches("H100", o["gpu"]) and o["gpus_per_node"] == 8
    # Ranked by expected cost, offers with an unknown (spot) price after the known ones; the
    # chosen one is the first.
    keys = [(not o["price_known"], o["expected_usd"]) for o in offers]
    assert keys == sorted(keys)
    assert out["chosen"] == offers[0]
    # Spot only where it is sold (RunPod, Vast); never on Lambda or Modal.
    assert not any(o["spot"] for o in offers if o["provider"] in ("lambda", "modal"))
    # The arithmetic: price × GPUs × hours × (1 + buffer).
    c = out["chosen"]
    assert out["cost_usd"] == pytest.approx(c["price_per_gpu_hour"] * 8 * out["hours"] * 1.2, rel=1e-3)
    b = out["breakdown"]
    # at the rented variant's peak (RunPod's H100 is the PCIe card: 756 TFLOP/s, not 989)
    assert b["peak_flops_per_gpu"] == GPUS[c["gpu"]].peak_bf16_flops
    compute_h = 6 * b["active_params"] * b["tokens"] / (8 * GPUS[c["gpu"]].peak_bf16_flops * 0.40) / 3600
    assert b["compute_hours"] == pytest.approx(compute_h, rel=1e-6)
    assert out["hours"] >= b["compute_hours"] + b["startup_hours"]


def test_over_budget_exit_3(capsys, tmp_path):
    rc, out = run_json(capsys, ["up", str(job_file(tmp_path, budget__max_usd=5)), "--dry-run", "--json"])
    assert rc == 3 and out["within_budget"] is False and out["cost_usd"] > 5


def test_over_budget_human_message(capsys, tmp_path):
    rc = main(["up", str(job_file(tmp_path, budget__max_usd=5)), "--dry-run"])
    assert rc == 3
    assert "over budget" in capsys.readouterr().out


@pytest.mark.parametrize("changes,reason", [
    ({"resources__providers": ["runpod"], "resources__nodes": 2}, "multi-node is not available on runpod"),
    ({"resources__providers": ["lambda"], "resources__spot": True}, "spot is not available on lambda"),
    ({"resources__providers": ["modal"], "resources__spot": True}, "spot is not available on modal"),
    ({"resources__providers": ["vast"], "resources__max_price_per_gpu_hour": 0.5}, "vast has no"),
])
def test_no_offer_exit_4_with_reason(capsys, tmp_path, changes, reason):
    rc, out = run_json(capsys, ["up", str(job_file(tmp_path, **changes)), "--dry-run", "--json"])
    assert rc == 4
    assert out["chosen"] is None
    assert any(reason in r for r in out["refusals"]), out["refusals"]


def test_spot_is_cheaper_only_when_priced(capsys, tmp_path):
    rc, out = run_json(capsys, ["up", str(job_file(tmp_path, resources__spot=True,
                                                  resources__providers=["vast"])), "--dry-run", "--json"])
    assert rc == 0
    o = out["chosen"]
    assert o["spot"] is True
    assert "unknown" in o["price_source"]  # the snapshot has no spot price: on-demand upper bound
    assert out["breakdown"]["preemption_overhead_hours"] > 0


def test_sky_catalog_overrides_snapshot_and_zero_spot_is_unknown(capsys, tmp_path, monkeypatch):
    cat = tmp_path / "catalogs"
    (cat / "runpod").mkdir(parents=True)
    (cat / "runpod" / "vms.csv").write_text(
        "InstanceType,AcceleratorName,AcceleratorCount,vCPUs,MemoryGiB,Region,SpotPrice,Price,AvailabilityZone,GpuInfo\n"
        "8x_H100_SECURE,H100,8,128,1000,CA,0.0,16.00,CA-MTL-1,H100\n"
        "8x_H100_SECURE,H100,8,128,1000,US,8.00,17.60,US-TX-3,H100\n"
    )
    monkeypatch.setenv("DTRUN_SKY_CATALOG_DIR", str(cat))
    f = job_file(tmp_path, resources__providers=["runpod"], resources__spot="prefer")
    rc, out = run_json(capsys, ["up", str(f), "--dry-run", "--json"])
    assert rc == 0
    # One offer per variant and spot/on-demand, priced at its cheapest region; SkyPilot places it.
    by = {o["spot"]: o for o in out["offers"]}
    assert len(out["offers"]) == 2
    assert by[False]["price_per_gpu_hour"] == pytest.approx(2.0) and by[False]["gpu"] == "H100-PCIe"
    assert "skypilot catalog" in by[False]["price_source"]
    assert by[True]["price_per_gpu_hour"] == pytest.approx(1.0)
    # A zero spot price is unknown, never free: priced at on-demand (CA only sells at 0.0 spot).
    f = job_file(tmp_path, resources__providers=["runpod"], resources__spot=True, resources__regions=["CA"])
    rc, out = run_json(capsys, ["up", str(f), "--dry-run", "--json"])
    (o,) = out["offers"]
    assert o["region"] == "CA" and o["regions"] == ["CA"]
    assert o["price_per_gpu_hour"] == pytest.approx(2.0)
    assert "unknown" in o["price_source"]


def test_quickstart_dry_run_on_local(capsys):
    rc, out = run_json(capsys, ["up", str(ROOT / "jobs" / "quickstart.yaml"), "--dry-run", "--json"])
    assert rc == 0
    assert out["chosen"]["provider"] == "local" and out["chosen"]["gpu"] == "cpu"
    assert out["cost_usd"] == 0


def test_prices_json(capsys):
    rc, out = run_json(capsys, ["prices", "H100", "--json"])
    assert rc == 0
    provs = {r["provider"] for r in out["prices"]}
    assert provs == {"runpod", "lambda", "vast", "modal"}
    assert all(gpu_matches("H100", r["gpu"]) and r["price_source"] for r in out["prices"])
    caps = out["capabilities"]
    assert caps["lambda"]["spot"]["supported"] is False and caps["lambda"]["spot"]["reason"]
    assert caps["lambda"]["multi_node"]["supported"] is True
    assert caps["runpod"]["multi_node"]["supported"] is False and caps["runpod"]["multi_node"]["reason"]
    assert caps["vast"]["spot"]["supported"] is True


def test_prices_for_a_gpu_nobody_prices_says_so_and_lists_the_priced_ones(capsys):
    assert main(["prices", "cpu"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "no provider lists a price for cpu (local CPU runs are free: providers: [local])" in out
    assert "GPUs with prices: " in out and "H100" in out


def test_prices_unknown_gpu_exit_2(capsys):
    assert main(["prices", "H900"]) == 2
    assert "H900" in capsys.readouterr().err


PROBE = ("import sys; from orchestrator.cli.app import main; rc = main({argv!r}); "
         "bad = [m for m in ('torch', 'sky', 'boto3', 'botocore', 'modal') if m in sys.modules]; "
         "print('HEAVY', bad, file=sys.stderr); sys.exit(rc)")


@pytest.mark.parametrize("argv", [["--help"], ["up", str(GPT2), "--dry-run"], ["prices", "--json"]])
def test_fast_paths_import_nothing_heavy(argv):
    p = subprocess.run([sys.executable, "-c", PROBE.format(argv=argv)], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    assert "HEAVY []" in p.stderr, p.stderr


def test_dry_run_shows_the_memory_plan(capsys):
    rc, out = run_json(capsys, ["up", str(GPT2), "--dry-run", "--json"])
    assert rc == 0
    assert out["plan"]["strategy"] == "ddp"
    assert 0 < out["plan"]["memory_per_gpu_gb"] < 80
    # 39 min of compute against ~6 min of start-up: the only trap is that start-up is > 10 % of it
    assert [t["code"] for t in out["traps"]] == ["startup-dominates"]


def test_strict_makes_traps_exit_2(capsys, tmp_path):
    f = job_file(tmp_path, trainer__warmup_steps=0)
    rc, out = run_json(capsys, ["up", str(f), "--dry-run", "--json"])
    assert rc == 0 and any(t["code"] == "no-lr-warmup" for t in out["traps"])
    rc, out = run_json(capsys, ["up", str(f), "--dry-run", "--json", "--strict"])
    assert rc == 2


def test_dry_run_refuses_a_local_run_uri_for_rented_nodes(capsys, tmp_path):
    f = job_file(tmp_path, checkpoint__uri="./runs/{name}")
    rc = main(["up", str(f), "--dry-run"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "checkpoint.uri" in err and "s3://" in err


DRY_RUN_PROBE = (
    "import sys; from orchestrator.cli.app import main; rc = main({argv!r}); "
    "from pydantic.plugin import _loader; "
    "print('LOADED', sorted(m for m in ('numpy', 'click', 'trainer.prepare', 'orchestrator.run.sweep') "
    "if m in sys.modules), 'PLUGINS', _loader._plugins, file=sys.stderr); "
    "sys.exit(rc)")


def test_the_dry_run_keeps_off_what_it_does_not_use():
    """What the dry run paid for without using it (issue 23: 0.27× of `import sky`, back to ≤ 0.15×):
    numpy through the data manifest check, click besides typer's own copy, the orphan sweep, and
    pydantic's scan of every package's entry points for plugins. (benchmarks/bench_cli_startup.py
    measures the time.)"""
    p = subprocess.run([sys.executable, "-c", DRY_RUN_PROBE.format(argv=["up", str(GPT2), "--dry-run"])],
                       capture_output=True, text=True, cwd=ROOT,
                       env={k: v for k, v in os.environ.items() if k != "PYDANTIC_DISABLE_PLUGINS"})
    assert p.returncode in (0, 5), p.stderr
    assert "LOADED [] PLUGINS None" in p.stderr, p.stderr[-2000:]


def test_the_schema_describes_every_documented_field():
    """Field docstrings reach `dtrun schema` without pydantic parsing them on every import."""
    from orchestrator.plan import presets, sections, spec

    schema = spec.json_schema()
    for name, docs in {**spec.field_docs(presets), **spec.field_docs(sections), **spec.field_docs(spec)}.items():
        props = (schema if name == "JobSpec" else schema["$defs"].get(name, {})).get("properties", {})
        for field in docs:
            if field in props:
                assert props[field].get("description"), (name, field)
    assert schema["$defs"]["ModelSpec"]["properties"]["vocab_size"]["description"]
    assert schema["$defs"]["Trainer"]["properties"]["parallel"]["description"]


def test_the_offers_title_says_unknown_spot_prices_rank_last(capsys):
    rc, out = run_json(capsys, ["up", str(GPT2), "--dry-run", "--json"])
    unknown = [o for o in out["offers"] if not o["price_known"]]
    assert unknown, "this job has spot offers without a known spot price"
    main(["up", str(GPT2), "--dry-run"])
    text = " ".join(capsys.readouterr().out.split())
    assert "Offers (cheapest expected cost first, unknown spot prices last)" in text
