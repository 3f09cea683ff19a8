"""Prices from a refreshed SkyPilot catalog (issue 24), offline and fast: the live label and age
while the installed file is the one dtrun fetched, the bid SkyPilot places, RunPod's minimum bid,
unknown spot ranked last, Vast's bid in the SkyPilot task, and the spot-or-on-demand verdict.
(The fetchers themselves run against the price lab in tests/e2e/test_live_prices.py.)"""

from __future__ import annotations

import json
import os
import time

import pytest

from providers.base import LaunchRequest, Requirements
from providers.catalog import catalog_offers
from providers.skypilot import build_task_config
from providers.skypilot.catalog import catalog_rows, record_path
from providers.skypilot.prices import stale_clouds

HEADER = "InstanceType,AcceleratorName,AcceleratorCount,vCPUs,MemoryGiB,Region,SpotPrice,Price,AvailabilityZone,GpuInfo\n"


@pytest.fixture
def cat(tmp_path, monkeypatch):
    root = tmp_path / "catalogs"
    monkeypatch.setenv("DTRUN_SKY_CATALOG_DIR", str(root))
    monkeypatch.setenv("DTRUN_HOME", str(tmp_path / "dtrun"))
    return root


def install(root, cloud, text, spot=None, fetched_at=None):
    p = root / cloud / "vms.csv"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
    if fetched_at is not None:
        st = p.stat()
        rp = record_path(cloud)
        rp.parent.mkdir(parents=True, exist_ok=True)
        rp.write_text(json.dumps({"fetched_at": fetched_at, "last_attempt_at": fetched_at, "size": st.st_size,
                                  "mtime_ns": st.st_mtime_ns, "source": f"{cloud} api (test)", "spot": spot or {}}))
    return p


RUNPOD = HEADER + ("8x_H100-SXM_SECURE,H100-SXM,8,160,1000,US,11.60,21.52,US-TX-3,\n"
                   "8x_H100_SECURE,H100,8,128,1000,US,10.00,19.12,US-TX-3,\n")


def test_a_fetched_catalog_is_labelled_live_with_its_age_and_bid(cat):
    install(cat, "runpod", RUNPOD, spot={"min_bid_per_gpu": {"8x_H100-SXM_SECURE": 1.60, "8x_H100_SECURE": 1.10}},
            fetched_at=time.time() - 180)
    offers = catalog_offers("runpod", Requirements(gpu="H100-SXM", gpus_per_node=8, nodes=1, spot=True))
    (o,) = offers
    assert o.price_per_gpu_hour == pytest.approx(1.45) and o.spot_bid == pytest.approx(1.45)
    assert o.price_fetched_at is not None and o.price_known
    assert "runpod api (test), 3 min ago" in o.price_source
    assert "SkyPilot bids $1.45/GPU-h" in o.price_source and "BELOW RunPod's minimum bid $1.60" in o.price_source
    pcie = catalog_offers("runpod", Requirements(gpu="H100-PCIe", gpus_per_node=8, nodes=1, spot=True))[0]
    assert "RunPod's minimum bid $1.10" in pcie.price_source and "BELOW" not in pcie.price_source


def test_a_catalog_replaced_since_the_fetch_is_no_longer_live(cat):
    p = install(cat, "runpod", RUNPOD, fetched_at=time.time())
    p.write_text(RUNPOD + "1x_L4_SECURE,L4,1,8,45,US,0.3,0.44,US-TX-3,\n")   # SkyPilot's pull, a user's copy
    (row,) = [r for r in catalog_rows("runpod") if r.gpu == "H100-SXM"]
    assert row.fetched_at is None and row.source.startswith("skypilot catalog runpod/vms.csv")
    o = catalog_offers("runpod", Requirements(gpu="H100-SXM", gpus_per_node=8, nodes=1, spot=True))[0]
    assert o.spot_bid is None  # the bid is only quoted from a fetch dtrun made


def test_hosted_spot_equal_to_on_demand_is_unknown_and_ranks_last(cat):
    install(cat, "runpod", HEADER + "8x_H100_SECURE,H100,8,128,1000,US,19.12,19.12,US-TX-3,\n")
    offers = catalog_offers("runpod", Requirements(gpu="H100-PCIe", gpus_per_node=8, nodes=1, spot="prefer"))
    assert [o.spot for o in offers] == [False, True]
    assert offers[1].price_known is False and "spot price unknown" in offers[1].price_source
    assert "equals on-demand" in offers[1].price_source


def test_vast_spot_launch_carries_dtruns_bid(cat):
    install(cat, "vast", "InstanceType,AcceleratorName,AcceleratorCount,vCPUs,MemoryGiB,GpuInfo,Price,SpotPrice,Region,HostingType\n"
                         "8x-H100_SXM-32-65536,H100,8,32,64.0,,15.60,7.2000,\"Oregon, US, NA\",1\n",
            fetched_at=time.time())
    (o,) = catalog_offers("vast", Requirements(gpu="H100", gpus_per_node=8, nodes=1, spot=True))
    assert o.spot_bid == pytest.approx(0.9)
    cfg = build_task_config("vast", LaunchRequest(job="j", attempt=1, offer=o, nodes=1, command=["true"]))
    assert cfg["config"] == {"vast": {"create_instance_kwargs": {"price": pytest.approx(7.2)}}}
    od = catalog_offers("vast", Requirements(gpu="H100", gpus_per_node=8, nodes=1, spot=False))[0]
    assert "config" not in build_task_config("vast", LaunchRequest(job="j", attempt=1, offer=od, nodes=1,
                                                                   command=["true"]))


def test_only_clouds_refreshed_before_and_older_than_the_age_are_stale(cat, monkeypatch):
    install(cat, "runpod", RUNPOD, fetched_at=time.time() - 25 * 3600)
    install(cat, "lambda", HEADER, fetched_at=time.time() - 3600)
    assert stale_clouds() == ["runpod"]          # vast: never refreshed by dtrun → never automatic
    monkeypatch.setenv("DTRUN_PRICES_MAX_AGE_HOURS", "0")
    assert stale_clouds() == []


def test_spot_choice_names_both_sides_and_the_winner(cat, tmp_path, monkeypatch, provider_credentials):
    from orchestrator.cli.app import main
    from tests.orchestrator.cli.test_dryrun import job_file

    install(cat, "runpod", RUNPOD, fetched_at=time.time())
    f = job_file(tmp_path, resources__providers=["runpod"], resources__spot="prefer", resources__gpu="H100-SXM")
    import io
    import contextlib

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["up", str(f), "--dry-run", "--json"])
    out = json.loads(buf.getvalue())
    sc = out["spot_choice"]
    assert sc["won"] == "spot" and sc["spot"]["offer"].endswith("/spot") and not sc["on_demand"]["offer"].endswith("/spot")
    assert sc["spot"]["preemption_overhead_hours"] > 0 and sc["on_demand"]["preemption_overhead_hours"] == 0
    assert "spot is cheaper in expected cost" in sc["why"]
    assert out["chosen"]["spot"] is True and rc == 0
