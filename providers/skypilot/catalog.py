"""SkyPilot's catalogs for RunPod, Lambda and Vast, read as dtrun's price rows.

SkyPilot keeps one CSV per cloud (``~/.sky/catalogs/v8/<cloud>/vms.csv``; ``DTRUN_SKY_CATALOG_DIR``
overrides the root); reading it is plain CSV, ``sky`` itself is never imported here (it costs
seconds). When ``dtrun prices --refresh`` installed the file (``providers.skypilot.prices``), the
record it left (``$DTRUN_HOME/prices/<cloud>.json``) labels the rows live, with their age, as
long as the file is still the one it installed.

**GPU variants.** Every row is labelled with the GPU dtrun rents (``orchestrator.contract.gpus``):
RunPod's ``H100`` is the PCIe card (``H100-PCIe``) and its ``H100-SXM`` the SXM; Lambda and Vast
call both ``H100`` and tell them apart by instance type (``gpu_1x_h100_pcie`` / ``…_sxm5``,
``1x-H100_SXM-…`` / ``…_PCIE-…``; Vast's NVL is left out); Vast's ``A100`` is the 40 GB SXM4 or
the 80 GB PCIe (told apart by the row's GPU memory). An offer carries the SkyPilot instance type,
so the task rents exactly that variant, and the estimate uses that variant's peak FLOP/s.

Offers and regions then follow the shared rules (``providers.pricing``) over these rows.
"""

from __future__ import annotations

import ast
import csv
import datetime as _dt
import json
import os
import time
from pathlib import Path
from typing import Any

from orchestrator.contract.gpus import canonical_gpu
from providers import pricing
from providers._jsonstore import dtrun_home
from providers.base import Offer, Requirements
from providers.pricing import ANY_REGION, PriceRow, positive
from providers.skypilot.clouds import CLOUDS

SKY_CATALOG_VERSION = "v8"


def sky_catalog_path(cloud: str) -> Path:
    """The catalog file SkyPilot reads for ``cloud`` (and ``dtrun prices --refresh`` replaces)."""
    root = os.environ.get("DTRUN_SKY_CATALOG_DIR") or os.path.join(
        os.path.expanduser("~"), ".sky", "catalogs", SKY_CATALOG_VERSION
    )
    return Path(root) / cloud / "vms.csv"


# ---- the record of dtrun's last live fetch ------------------------------------------------------

def record_path(cloud: str) -> Path:
    return dtrun_home() / "prices" / f"{cloud}.json"


def read_record(cloud: str) -> dict[str, Any] | None:
    try:
        return json.loads(record_path(cloud).read_text())
    except (OSError, ValueError):
        return None


def live_record(cloud: str, catalog: Path) -> dict[str, Any] | None:
    """The record of the last refresh when ``catalog`` is still the file it installed, else None."""
    rec = read_record(cloud)
    if not rec or not rec.get("fetched_at"):
        return None
    try:
        st = catalog.stat()
    except OSError:
        return None
    if rec.get("size") != st.st_size or rec.get("mtime_ns") != st.st_mtime_ns:
        return None
    return rec


def age_text(seconds: float) -> str:
    s = max(0.0, seconds)
    if s < 90:
        return f"{s:.0f} s ago"
    if s < 90 * 60:
        return f"{s / 60:.0f} min ago"
    if s < 48 * 3600:
        return f"{s / 3600:.1f} h ago"
    return f"{s / 86400:.0f} days ago"


# ---- rows ----------------------------------------------------------------------------------------

def _gpu_mib_per_device(gpu_info: str, count: int) -> float | None:
    """GPU memory per device from a catalog row's GpuInfo (a Python-literal dict)."""
    try:
        info = ast.literal_eval(gpu_info) if gpu_info else None
    except (ValueError, SyntaxError):
        return None
    if not isinstance(info, dict):
        return None
    gpus = info.get("Gpus") or [{}]
    per = (gpus[0].get("MemoryInfo") or {}).get("SizeInMiB")
    total = info.get("TotalGpuMemoryInMiB")
    if isinstance(total, (int, float)) and count > 0 and total > (per or 0):
        return float(total) / count
    return float(per) if isinstance(per, (int, float)) else None


def variant_of(cloud: str, accelerator: str, instance_type: str, gpu_info: str = "", count: int = 1) -> str | None:
    """The dtrun GPU a SkyPilot catalog row rents (None: a GPU dtrun does not plan for)."""
    acc = accelerator.strip()
    it = instance_type.upper()
    if cloud == "runpod":
        if acc == "H100":
            return "H100-PCIe"        # RunPod's H100 is the PCIe card (GpuInfo: 'H100 PCIe')
        if acc == "H100-SXM":
            return "H100-SXM"
        if acc in ("H100-NVL",):
            return None
        if acc == "A100-80GB-SXM":
            return "A100-80GB"
    elif cloud in ("lambda", "vast") and acc == "H100":
        if "NVL" in it:
            return None
        if "PCIE" in it:
            return "H100-PCIe"
        if "SXM" in it:
            return "H100-SXM"
        return "H100"
    if cloud == "vast" and acc == "A100":
        mib = _gpu_mib_per_device(gpu_info, count)
        if mib is not None and mib >= 60_000:
            return "A100-80GB"
        return "A100"
    return canonical_gpu(acc) if acc else None


def catalog_rows(cloud: str) -> list[PriceRow]:
    """Rows from SkyPilot's cached catalog for ``cloud`` (empty if absent or unreadable)."""
    if cloud not in CLOUDS:
        return []
    path = sky_catalog_path(CLOUDS[cloud].sky_name)
    try:
        mtime = _dt.datetime.fromtimestamp(path.stat().st_mtime, _dt.timezone.utc).date().isoformat()
        with path.open(newline="") as f:
            reader = list(csv.DictReader(f))
    except (OSError, csv.Error, UnicodeDecodeError):
        return []
    rec = live_record(cloud, path)
    fetched_at = float(rec["fetched_at"]) if rec else None
    if rec:
        when = _dt.datetime.fromtimestamp(fetched_at, _dt.timezone.utc)
        source = f"{rec.get('source') or cloud + ' api'}, {age_text(time.time() - fetched_at)}"
        date = when.strftime("%Y-%m-%d %H:%M UTC")
    else:
        source, date = f"skypilot catalog {cloud}/vms.csv ({mtime})", mtime
    spot_live = (rec or {}).get("spot") or {}
    spot_sold = CLOUDS[cloud].capabilities.spot.supported
    rows = []
    for r in reader:
        count = positive(r.get("AcceleratorCount"))
        price = positive(r.get("Price"))
        if count is None or price is None or count != int(count):
            continue
        n = int(count)
        it = r.get("InstanceType") or ""
        gpu = variant_of(cloud, r.get("AcceleratorName") or "", it, r.get("GpuInfo") or "", n)
        if gpu is None:
            continue
        spot = positive(r.get("SpotPrice"))
        spot, spot_note = _spot_figure(cloud, it, n, price, spot, bool(rec), spot_live)
        rows.append(PriceRow(
            provider=cloud, gpu=gpu, region=r.get("Region") or ANY_REGION, gpus_per_node=n,
            price=price / n, spot_price=spot, spot_sold=spot_sold,
            source=source, date=date, note=it, instance_type=it or None,
            fetched_at=fetched_at, spot_note=spot_note,
        ))
    return rows


def _spot_figure(cloud: str, instance_type: str, n: int, price: float, spot: float | None, live: bool,
                 spot_live: dict[str, Any]) -> tuple[float | None, str]:
    """(spot USD per GPU-hour or None, what it is and what SkyPilot bids) for one catalog row."""
    if spot is None:
        return None, ""
    if not live and spot >= price:
        # SkyPilot's hosted RunPod catalog carries spot = on-demand: not a spot figure.
        return None, "the catalog's spot price equals on-demand (not a live spot figure)"
    per_gpu = spot / n
    if cloud == "runpod":
        note = f"SkyPilot bids ${per_gpu:.2f}/GPU-h (bid_per_gpu: the catalog's spot price)"
        floor = (spot_live.get("min_bid_per_gpu") or {}).get(instance_type)
        if isinstance(floor, (int, float)) and floor > per_gpu + 1e-9:
            note += f"; BELOW RunPod's minimum bid ${floor:.2f}/GPU-h: the pod may not be placed"
        elif isinstance(floor, (int, float)):
            note += f"; RunPod's minimum bid ${floor:.2f}/GPU-h"
        return per_gpu, note
    if cloud == "vast":
        if not live:
            return per_gpu, "the catalog's spot price (not fetched by dtrun)"
        return per_gpu, f"dtrun bids ${spot:.2f}/h per instance (highest min_bid on the continent)"
    return per_gpu, ""


# ---- what the provider asks ----------------------------------------------------------------------

def price_rows(cloud: str) -> list[PriceRow]:
    """Every known price row for ``cloud``: its catalog's, then the snapshot's for other GPUs."""
    return pricing.merged_rows(cloud, catalog_rows(cloud))


def catalog_offers(cloud: str, req: Requirements) -> list[Offer]:
    """Offers for ``req`` on ``cloud`` from its catalog and the snapshot, cheapest first."""
    return pricing.offers(cloud, req, catalog_rows(cloud))


def region_problem(cloud: str, terms: tuple[str, ...] | list[str]) -> str | None:
    """Why ``resources.regions`` selects none of ``cloud``'s regions (naming them), or None."""
    return pricing.region_problem(cloud, terms, catalog_rows(cloud)) if terms else None
