"""Spot prices before any account (issue 33, item 12): the bundled snapshot carries RunPod's spot
figures from SkyPilot's own catalog file, labelled with where they come from and the date they
were read, beside that file's own on-demand; Vast's catalog has none, and the label says why."""

from __future__ import annotations

import pytest

from providers.base import Requirements
from providers.catalog import catalog_offers


@pytest.fixture(autouse=True)
def no_catalog(tmp_path, monkeypatch):
    monkeypatch.setenv("DTRUN_SKY_CATALOG_DIR", str(tmp_path / "no-catalogs"))  # the snapshot only
    monkeypatch.setenv("DTRUN_HOME", str(tmp_path / "dtrun"))


def offer(provider, gpu, spot, n=8):
    return catalog_offers(provider, Requirements(gpu=gpu, gpus_per_node=n, nodes=1, spot=spot))


def test_runpod_spot_is_priced_offline_with_its_source_and_date():
    (o,) = offer("runpod", "H100-SXM", True)
    assert o.price_known and o.price_per_gpu_hour == pytest.approx(2.69)
    assert "skypilot-catalog@0727c2b" in o.price_source and "read 2026-12-02" in o.price_source
    assert "on-demand $2.99 in the same file" in o.price_source
    assert "may no longer be sold" in o.price_source  # RunPod dropped spot from its docs
    assert o.spot_bid is None  # a snapshot figure is a quote, never the bid SkyPilot places


def test_spot_prefer_shows_what_spot_saves():
    by_side = {o.spot: o for o in offer("runpod", "A100-80GB", "prefer", n=1)}
    assert by_side[True].price_per_gpu_hour == pytest.approx(1.19)
    assert by_side[False].price_per_gpu_hour == pytest.approx(1.39)  # the snapshot's on-demand


def test_a_gpu_the_catalog_has_no_spot_for_stays_unknown_and_says_so():
    (o,) = offer("runpod", "H100-PCIe", True)
    assert not o.price_known and "spot price unknown" in o.price_source
    assert "no spot price for it either" in o.price_source


def test_vast_spot_stays_unknown_with_the_reason():
    (o,) = offer("vast", "A100-80GB", True, n=1)
    assert not o.price_known and "SpotPrice 0.00 on every row" in o.price_source
