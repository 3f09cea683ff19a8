"""The snapshot's dated spot figures (issue 33 item 12): RunPod and Vast spot offers are priced
before any account exists, labelled with the snapshot's date and source as a dated reference (not
live); a fetched catalog still wins; a figure without a date and source, or not below on-demand,
is refused."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from providers import pricing
from providers.base import Requirements
from providers.catalog import catalog_offers

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def offline(tmp_path, monkeypatch):
    monkeypatch.setenv("DTRUN_SKY_CATALOG_DIR", str(tmp_path / "no-catalogs"))
    monkeypatch.setenv("DTRUN_HOME", str(tmp_path / "dtrun"))
    return tmp_path


@pytest.mark.parametrize("provider, gpu", [("runpod", "H100-SXM"), ("runpod", "H100-PCIe"), ("vast", "H100"),
                                           ("runpod", "A100-80GB"), ("vast", "A100-80GB")])
def test_spot_offers_are_priced_offline_from_the_dated_snapshot(offline, provider, gpu):
    snap = pricing.load_snapshot()
    offers = catalog_offers(provider, Requirements(gpu=gpu, gpus_per_node=8, nodes=1, spot="prefer"))
    spot = next(o for o in offers if o.spot)
    od = next(o for o in offers if not o.spot)
    assert spot.price_known and spot.price_per_gpu_hour < od.price_per_gpu_hour
    row = next(r for r in snap["rows"] if r["provider"] == provider and r["gpu"] == gpu and 8 in r["counts"])
    assert spot.price_per_gpu_hour == pytest.approx(row["spot_price"])
    assert f"spot: snapshot of {snap['spot']['date']} (a dated reference, not live)" in spot.price_source
    assert snap["spot"]["sources"][provider] in spot.price_source
    assert spot.spot_bid is None  # a reference figure is never quoted as the bid
    assert "snapshot of" not in od.price_source


def test_every_snapshot_spot_figure_is_dated_sourced_and_below_on_demand():
    snap = pricing.load_snapshot()
    assert snap["spot"]["date"] and {"runpod", "vast"} <= set(snap["spot"]["sources"])
    text = (ROOT / "providers" / "data" / "prices.yaml").read_text()
    assert "DATED" in text and "not a live price" in text  # the file says what the figures are
    figures = [r for r in snap["rows"] if r.get("spot_price")]
    assert {r["provider"] for r in figures} == {"runpod", "vast"}
    for r in figures:
        assert 0 < r["spot_price"] < r["price"], r


def test_a_figure_without_its_source_or_not_below_on_demand_is_refused(monkeypatch):
    snap = pricing.load_snapshot()
    unsourced = {**snap, "spot": {"date": snap["spot"]["date"], "sources": {"runpod": "x"}}}
    monkeypatch.setattr(pricing, "load_snapshot", lambda: unsourced)
    with pytest.raises(ValueError, match="spot.sources.vast"):
        pricing.snapshot_rows()
    rows = [dict(r) for r in snap["rows"]]
    rows[0]["spot_price"] = rows[0]["price"]
    monkeypatch.setattr(pricing, "load_snapshot", lambda: {**snap, "rows": rows})
    with pytest.raises(ValueError, match="not below on-demand"):
        pricing.snapshot_rows()


def test_a_fetched_catalog_wins_over_the_snapshot_figure(offline):
    from providers.skypilot.catalog import record_path

    p = offline / "no-catalogs" / "runpod" / "vms.csv"
    p.parent.mkdir(parents=True)
    p.write_text("InstanceType,AcceleratorName,AcceleratorCount,vCPUs,MemoryGiB,Region,SpotPrice,Price,"
                 "AvailabilityZone,GpuInfo\n8x_H100-SXM_SECURE,H100-SXM,8,160,1000,US,9.60,21.52,US-TX-3,\n")
    st = p.stat()
    rp = record_path("runpod")
    rp.parent.mkdir(parents=True, exist_ok=True)
    now = time.time()
    rp.write_text(json.dumps({"fetched_at": now, "last_attempt_at": now, "size": st.st_size,
                              "mtime_ns": st.st_mtime_ns, "source": "runpod api (test)", "spot": {}}))
    (o,) = catalog_offers("runpod", Requirements(gpu="H100-SXM", gpus_per_node=8, nodes=1, spot=True))
    assert o.price_per_gpu_hour == pytest.approx(1.20) and o.price_known
    assert "runpod api (test)" in o.price_source and "snapshot of" not in o.price_source


def test_the_dry_run_without_an_account_shows_what_spot_saves(offline, capsys, monkeypatch):
    from orchestrator.cli.app import main

    home = offline / "bare-home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("MODAL_CONFIG_PATH", str(home / ".modal.toml"))
    for v in ("MODAL_TOKEN_ID", "MODAL_TOKEN_SECRET", "RUNPOD_API_KEY", "VAST_API_KEY", "LAMBDA_API_KEY"):
        monkeypatch.delenv(v, raising=False)

    main(["up", str(ROOT / "jobs" / "gpt2-124m.yaml"), "--dry-run", "--json"])
    out = json.loads(capsys.readouterr().out)
    sc = out["spot_choice"]
    assert sc["spot"] is not None and sc["on_demand"] is not None
    assert sc["spot"]["expected_usd"] < sc["on_demand"]["expected_usd"]
    assert "snapshot of" in sc["spot"]["price_source"]
