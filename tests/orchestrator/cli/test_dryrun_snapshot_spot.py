"""Issue 33, item 12 end to end: with no catalog and no live fetch, a RunPod spot dry run is priced
at the snapshot's dated SkyPilot-catalog spot figure and says where it comes from, and
`dtrun prices` prints the same label; a GPU the catalog has no spot for stays "unknown"."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from orchestrator.cli.app import main

ROOT = Path(__file__).resolve().parents[3]
LABEL = "skypilot-catalog@0727c2b v7/runpod/vms.csv SpotPrice"


@pytest.fixture(autouse=True)
def no_sky_catalog(tmp_path, monkeypatch, provider_credentials):
    monkeypatch.setenv("DTRUN_SKY_CATALOG_DIR", str(tmp_path / "no-catalogs"))


def dry_run(capsys, tmp_path, gpu, spot):
    data = yaml.safe_load((ROOT / "jobs" / "gpt2-124m.yaml").read_text())
    data["resources"].update(providers=["runpod"], gpu=gpu, spot=spot)
    f = tmp_path / "job.yaml"
    f.write_text(yaml.safe_dump(data))
    rc = main(["up", str(f), "--dry-run", "--json"])
    return rc, json.loads(capsys.readouterr().out)


def test_offline_runpod_spot_dry_run_uses_the_dated_catalog_spot_price(capsys, tmp_path):
    rc, out = dry_run(capsys, tmp_path, "H100-SXM", True)
    assert rc == 0
    (o,) = [o for o in out["offers"] if o["spot"]]
    assert o["price_known"] and o["price_per_gpu_hour"] == pytest.approx(2.69)
    blob = json.dumps(o)
    assert LABEL in blob and "read 2026-12-02" in blob and "may no longer be sold" in blob
    assert out["chosen"]["price_per_gpu_hour"] == pytest.approx(2.69)


def test_prefer_shows_spot_beside_on_demand(capsys, tmp_path):
    rc, out = dry_run(capsys, tmp_path, "H100-SXM", "prefer")
    assert rc == 0
    by_side = {o["spot"]: o["price_per_gpu_hour"] for o in out["offers"]}
    assert by_side == {True: pytest.approx(2.69), False: pytest.approx(3.29)}  # what spot saves


def test_no_catalog_spot_stays_unknown(capsys, tmp_path):
    rc, out = dry_run(capsys, tmp_path, "H100-PCIe", True)
    (o,) = [o for o in out["offers"] if o["spot"]]
    assert not o["price_known"] and "spot price unknown" in json.dumps(o)


def test_dtrun_prices_prints_the_label(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    env.update(COLUMNS="100", DTRUN_HOME=str(tmp_path / "home"),
               DTRUN_SKY_CATALOG_DIR=str(tmp_path / "no-catalogs"))
    p = subprocess.run([sys.executable, "-m", "orchestrator.cli", "prices", "H100-SXM", "--spot"],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=60)
    assert p.returncode == 0, p.stderr
    flat = " ".join(p.stdout.split())
    assert "2.69" in flat and LABEL in flat and "read 2026-12-02" in flat
    assert "on-demand $2.99 in the same file" in flat
    assert all(len(ln) <= 100 for ln in p.stdout.splitlines())
