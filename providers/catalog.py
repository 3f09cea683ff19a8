"""Prices and regions: the bundled snapshot, overridden by SkyPilot's cached catalogs when present.

Providers call :func:`catalog_offers` from their ``offers()``; the dry run and ``dtrun prices``
ask the providers. Reading SkyPilot's catalog is plain CSV (``~/.sky/catalogs/v8/<cloud>/vms.csv``):
``sky`` itself is never imported here (it costs seconds).

**GPU variants.** Every row is labelled with the GPU dtrun rents (``orchestrator.contract.gpus``):
RunPod's ``H100`` is the PCIe card (``H100-PCIe``) and its ``H100-SXM`` the SXM; Lambda and Vast
call both ``H100`` and tell them apart by instance type (``gpu_1x_h100_pcie`` / ``…_sxm5``,
``1x-H100_SXM-…`` / ``…_PCIE-…``; Vast's NVL is left out); Vast's ``A100`` is the 40 GB SXM4 or
the 80 GB PCIe (told apart by the row's GPU memory). An offer carries the SkyPilot instance type,
so the task rents exactly that variant, and the estimate uses that variant's peak FLOP/s.

**Regions.** Names are SkyPilot's (the catalog's ``Region`` column, else the snapshot's dated
list): RunPod ``US``/``CA``/…, Lambda ``us-east-1``/…, Vast ``"Texas, US, NA"``/…. A spec's
``resources.regions`` entry selects regions by exact name, or as a prefix: a country code
(``US``), a continent (``EU``, ``NA``, ``AS``, ``OC``), or the start of a Lambda name
(``us``, ``us-east``, ``europe``) — see :func:`select_regions`. Only real names reach SkyPilot.

**One offer per provider, variant and spot/on-demand**, holding every allowed region in price
order (``Offer.regions``): one launch lets SkyPilot fail over across them, so a region without
capacity does not cost a dtrun attempt.
"""

from __future__ import annotations

import ast
import csv
import datetime as _dt
import functools
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator.contract.gpus import canonical_gpu, gpu_family, gpu_matches
from providers.base import Offer, Requirements

SKY_CATALOG_VERSION = "v8"
SKY_CLOUDS = {"runpod": "runpod", "lambda": "lambda", "vast": "vast"}
SNAPSHOT_PATH = Path(__file__).parent / "data" / "prices.yaml"
UNKNOWN_SPOT = "spot price unknown: priced at on-demand (upper bound)"
ANY_REGION = "any"

# ISO country code → continent code, for selecting regions by continent (``EU``) on clouds whose
# region names carry a country (RunPod: the code itself; Vast: "State, CC, CONTINENT").
CONTINENT = {
    **dict.fromkeys(["US", "CA", "MX"], "NA"),
    **dict.fromkeys(["BR", "AR", "CL", "CO"], "SA"),
    **dict.fromkeys(["AT", "BE", "BG", "CH", "CZ", "DE", "DK", "EE", "ES", "FI", "FR", "GB", "GR", "HR",
                     "HU", "IE", "IS", "IT", "LT", "LU", "LV", "NL", "NO", "PL", "PT", "RO", "RS", "SE",
                     "SI", "SK", "UA"], "EU"),
    **dict.fromkeys(["CN", "HK", "ID", "IN", "JP", "KR", "MY", "PH", "SG", "TH", "TW", "VN"], "AS"),
    **dict.fromkeys(["AU", "NZ"], "OC"),
    **dict.fromkeys(["AE", "IL", "SA", "QA"], "ME"),
}
# Lambda's region names start with a continent word.
_LAMBDA_CONTINENT = {"NA": "us-", "EU": "europe-", "AS": "asia-", "OC": "australia-", "ME": "me-"}


@dataclass(frozen=True)
class PriceRow:
    provider: str
    gpu: str
    region: str
    gpus_per_node: int
    price: float                 # on-demand, USD per GPU-hour
    spot_price: float | None     # USD per GPU-hour; None = unknown
    spot_sold: bool
    source: str
    date: str
    note: str = ""
    instance_type: str | None = None
    fetched_at: float | None = None
    """Epoch seconds of a live fetch (``dtrun prices --refresh``); None for snapshot/cached rows."""
    spot_note: str = ""
    """How the spot figure was found and what SkyPilot will bid."""


@functools.lru_cache(maxsize=1)
def _snapshot() -> dict[str, Any]:
    import yaml

    # libyaml's loader when PyYAML has it (the snapshot grew start-up figures: the pure-Python
    # loader took ~0.15 s of every dry run), the pure-Python one otherwise; both are "safe".
    return yaml.load(SNAPSHOT_PATH.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def snapshot_rows() -> list[PriceRow]:
    snap = _snapshot()
    rows = []
    for r in snap["rows"]:
        for count in r["counts"]:
            it = r.get("instance_type")
            rows.append(PriceRow(
                provider=r["provider"], gpu=r["gpu"], region=ANY_REGION, gpus_per_node=count,
                price=float(r["price"]),
                spot_price=_positive(r.get("spot_price")),
                spot_sold="spot_price" in r,
                source=f"snapshot {snap['date']}: {snap['sources'][r['provider']]}",
                date=snap["date"], note=r.get("note", ""),
                instance_type=it.format(n=count) if it else None,
            ))
    return rows


def _positive(v: Any) -> float | None:
    """A usable price, or None: empty, unparsable, zero or negative prices are unknown."""
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if f > 0 else None


def sky_catalog_path(cloud: str) -> Path:
    root = os.environ.get("DTRUN_SKY_CATALOG_DIR") or os.path.join(
        os.path.expanduser("~"), ".sky", "catalogs", SKY_CATALOG_VERSION
    )
    return Path(root) / cloud / "vms.csv"


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


def catalog_rows(provider: str) -> list[PriceRow]:
    """Rows from SkyPilot's cached catalog for ``provider`` (empty if absent or unreadable)."""
    cloud = SKY_CLOUDS.get(provider)
    if cloud is None:
        return []
    path = sky_catalog_path(cloud)
    try:
        mtime = _dt.datetime.fromtimestamp(path.stat().st_mtime, _dt.timezone.utc).date().isoformat()
        with path.open(newline="") as f:
            reader = list(csv.DictReader(f))
    except (OSError, csv.Error, UnicodeDecodeError):
        return []
    from providers.skypilot.prices import age_text, live_record

    rec = live_record(cloud, path)
    fetched_at = float(rec["fetched_at"]) if rec else None
    if rec:
        when = _dt.datetime.fromtimestamp(fetched_at, _dt.timezone.utc)
        source = f"{rec.get('source') or cloud + ' api'}, {age_text(time.time() - fetched_at)}"
        date = when.strftime("%Y-%m-%d %H:%M UTC")
    else:
        source, date = f"skypilot catalog {cloud}/vms.csv ({mtime})", mtime
    spot_live = (rec or {}).get("spot") or {}
    rows = []
    for r in reader:
        count = _positive(r.get("AcceleratorCount"))
        price = _positive(r.get("Price"))
        if count is None or price is None or count != int(count):
            continue
        n = int(count)
        it = r.get("InstanceType") or ""
        gpu = variant_of(cloud, r.get("AcceleratorName") or "", it, r.get("GpuInfo") or "", n)
        if gpu is None:
            continue
        spot = _positive(r.get("SpotPrice"))
        spot, spot_note = _spot_figure(cloud, it, n, price, spot, bool(rec), spot_live)
        rows.append(PriceRow(
            provider=provider, gpu=gpu, region=r.get("Region") or ANY_REGION, gpus_per_node=n,
            price=price / n, spot_price=spot,
            spot_sold=provider in ("runpod", "vast"),
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


def price_rows(provider: str) -> list[PriceRow]:
    """Every known price row for a provider: catalog rows replace snapshot rows per GPU family
    (a catalog that sells H100-SXM but no H100-PCIe has the last word on both)."""
    snap = [r for r in snapshot_rows() if r.provider == provider]
    cat = catalog_rows(provider)
    cat_gpus = {gpu_family(r.gpu) for r in cat}
    return cat + [r for r in snap if gpu_family(r.gpu) not in cat_gpus]


# ---- regions ---------------------------------------------------------------------------------

def known_regions(provider: str) -> tuple[list[str], str]:
    """(SkyPilot's region names for ``provider``, where they come from): the cached catalog's,
    else the snapshot's dated list; ``([], …)`` for a provider without regions (Modal)."""
    cat = catalog_rows(provider)
    if cat:
        return sorted({r.region for r in cat if r.region != ANY_REGION}), cat[0].source
    snap = _snapshot()
    regs = list((snap.get("regions") or {}).get(provider) or [])
    return regs, f"snapshot region list {snap.get('regions_date', snap['date'])}"


def _country(provider: str, region: str) -> str | None:
    parts = [p.strip() for p in region.split(",")]
    if len(parts) == 3:          # Vast: "Texas, US, NA"
        return parts[1].upper() or None
    if provider == "runpod" and re.fullmatch(r"[A-Za-z]{2}", region):
        return region.upper()
    return None


def region_matches(provider: str, region: str, term: str) -> bool:
    """``term`` (a spec's ``resources.regions`` entry) selects ``region`` (a SkyPilot name)."""
    t = term.strip().lower()
    r = region.strip().lower()
    if not t:
        return False
    if r == t:
        return True
    parts = [p.strip().lower() for p in region.split(",")]
    if len(parts) == 3 and t in parts[1:]:                 # Vast: country or continent code
        return True
    if r.startswith(t + "-"):                              # Lambda: us → us-east-1, us-east → us-east-1
        return True
    cc = _country(provider, region)
    if cc and CONTINENT.get(cc) == t.upper():              # RunPod: EU → SE, FR, …
        return True
    pre = _LAMBDA_CONTINENT.get(t.upper())
    return provider == "lambda" and pre is not None and r.startswith(pre)


def select_regions(provider: str, terms: tuple[str, ...] | list[str]) -> tuple[list[str], list[str]]:
    """(SkyPilot region names of ``provider`` selected by ``terms``, the terms that selected none)."""
    regions, _src = known_regions(provider)
    chosen: list[str] = []
    unmatched: list[str] = []
    for t in terms:
        hit = [r for r in regions if region_matches(provider, r, t)]
        if not hit:
            unmatched.append(t)
        chosen.extend(r for r in hit if r not in chosen)
    return chosen, unmatched


def region_problem(provider: str, terms: tuple[str, ...] | list[str]) -> str | None:
    """Why ``resources.regions`` selects nothing on ``provider`` (naming the valid names), or None."""
    if not terms:
        return None
    regions, src = known_regions(provider)
    if not regions:
        return None  # a provider without regions (Modal): placement is its own
    chosen, _bad = select_regions(provider, terms)
    if chosen:
        return None
    shown = ", ".join(repr(r) if "," in r else r for r in regions[:40])
    return (f"{provider}: resources.regions {list(terms)} selects none of its regions (SkyPilot's names, "
            f"from the {src}: {shown}{' …' if len(regions) > 40 else ''}); use a name, a country code "
            f"(US), a continent (EU, NA, AS, OC) or a name prefix (us-east)")


# ---- offers ----------------------------------------------------------------------------------

def _rows_to_offers(rows: list[PriceRow], req: Requirements) -> list[Offer]:
    want_spot = {True: [True], False: [False], "prefer": [False, True]}[req.spot]
    allowed: set[str] | None = None
    rank: dict[str, int] = {}
    if req.regions and rows:
        chosen = select_regions(rows[0].provider, req.regions)[0]
        allowed = set(chosen)
        rank = {r: i for i, r in enumerate(chosen)}  # at equal prices, the order the user gave
    # (provider, gpu, spot) → {instance type → [(price, region, row, source)]}
    groups: dict[tuple, dict[str | None, list[tuple[float, str, PriceRow, str]]]] = {}
    for r in rows:
        if not gpu_matches(req.gpu, r.gpu) or r.gpus_per_node != req.gpus_per_node:
            continue
        if allowed is not None and r.region != ANY_REGION and r.region not in allowed:
            continue
        for spot in want_spot:
            if spot and not r.spot_sold:
                continue
            price, source = r.price, r.source
            if spot:
                if r.spot_price is not None:
                    price = r.spot_price
                    if r.spot_note:
                        source = f"{r.source}; {r.spot_note}"
                else:
                    source = f"{r.source}; {UNKNOWN_SPOT}" + (f" ({r.spot_note})" if r.spot_note else "")
            if req.max_price_per_gpu_hour is not None and price > req.max_price_per_gpu_hour:
                continue
            groups.setdefault((r.provider, r.gpu, spot), {}).setdefault(r.instance_type, []).append(
                (price, r.region, r, source))
    out = []
    for (provider, gpu, spot), by_type in groups.items():
        # The cheapest instance type of this variant; its regions in price order.
        it, cands = min(by_type.items(), key=lambda kv: (min(c[0] for c in kv[1]), kv[0] or ""))
        cands.sort(key=lambda c: (c[0], rank.get(c[1], len(rank)), c[1]))
        price, _region, row, source = cands[0]
        regions: list[str] = []
        for c in cands:
            if c[1] != ANY_REGION and c[1] not in regions:
                regions.append(c[1])
        if not regions and allowed is not None:
            regions = [x for x in select_regions(provider, req.regions)[0]]  # snapshot: the dated list
        spread = {round(c[0], 4) for c in cands}
        if len(spread) > 1:
            source = f"{source}; cheapest of {len(regions)} regions (up to ${max(spread):.2f}/GPU-h)"
        if allowed is None:
            # No region asked for: SkyPilot may place it anywhere the provider sells it.
            region = regions[0] if len(regions) == 1 else ANY_REGION
            regions = []
        else:
            region = regions[0] if len(regions) == 1 else ANY_REGION
        known = not spot or row.spot_price is not None
        out.append(Offer(
            provider=provider, region=region, gpu=gpu,
            gpus_per_node=row.gpus_per_node, spot=spot, price_per_gpu_hour=round(price, 4),
            price_source=source, price_date=row.date, nodes=req.nodes, instance_type=it,
            regions=tuple(regions), price_known=known,
            spot_bid=round(price, 4) if spot and known and row.fetched_at is not None else None,
            price_fetched_at=row.fetched_at,
        ))
    return sorted(out, key=lambda o: (not o.price_known, o.price_per_gpu_hour, o.provider, o.gpu, o.spot))


def catalog_offers(provider: str, req: Requirements) -> list[Offer]:
    """Offers for ``req`` from the snapshot and SkyPilot's cached catalogs, cheapest first.

    One offer per (GPU variant, spot/on-demand): the cheapest instance type, with every allowed
    region where it is sold in ``regions`` (cheapest first). Capabilities are the provider's
    business (it refuses before calling this)."""
    return _rows_to_offers(price_rows(provider), req)


def all_rows(gpu: str | None = None) -> list[PriceRow]:
    """Every price row of every rentable provider (for ``dtrun prices``)."""
    out = []
    for p in ("runpod", "lambda", "vast", "modal"):
        out.extend(r for r in price_rows(p) if gpu is None or gpu_matches(gpu, r.gpu))
    return sorted(out, key=lambda r: (r.gpu, r.price, r.provider, r.gpus_per_node))


# ---- start-up figures ----------------------------------------------------------------------------

STARTUP_KEYS = ("provisioning", "setup_image", "setup_install", "first_step")


@dataclass(frozen=True)
class StartupFigure:
    minutes: float
    source: str
    date: str


@dataclass(frozen=True)
class StartupFigures:
    """One provider's start-up figures from the snapshot (``startup:`` in prices.yaml)."""

    provider: str
    provisioning: StartupFigure
    setup_image: StartupFigure
    setup_install: StartupFigure
    first_step: StartupFigure
    compile: StartupFigure

    def to_dict(self) -> dict[str, Any]:
        return {k: {"minutes": getattr(self, k).minutes, "source": getattr(self, k).source,
                    "date": getattr(self, k).date} for k in STARTUP_KEYS + ("compile",)}


def _figure(raw: Any, where: str) -> StartupFigure:
    if not isinstance(raw, dict) or "minutes" not in raw:
        raise ValueError(f"{SNAPSHOT_PATH}: {where}: expected {{minutes, source, date}}")
    minutes = float(raw["minutes"])
    if minutes < 0 or not raw.get("source") or not raw.get("date"):
        raise ValueError(f"{SNAPSHOT_PATH}: {where}: minutes must be ≥ 0 and source and date given")
    return StartupFigure(minutes, str(raw["source"]), str(raw["date"]))


def startup_figures(provider: str) -> StartupFigures:
    """The snapshot's start-up figures for ``provider``; an unknown provider gets the slowest
    rentable provider's figure for each item (an upper bound, labelled so)."""
    snap = _snapshot().get("startup") or {}
    table = snap.get("providers") or {}
    compile_ = _figure(snap.get("compile"), "startup.compile")
    if provider in table:
        row = table[provider]
        return StartupFigures(provider, *(_figure(row.get(k), f"startup.providers.{provider}.{k}")
                                          for k in STARTUP_KEYS), compile=compile_)
    worst = []
    for k in STARTUP_KEYS:
        cands = [_figure(table[p].get(k), f"startup.providers.{p}.{k}") for p in SKY_CLOUDS.keys() | {"modal"}
                 if p in table]
        f = max(cands, key=lambda x: x.minutes)
        worst.append(StartupFigure(f.minutes, f"{provider} has no figure: the slowest provider's ({f.source})", f.date))
    return StartupFigures(provider, *worst, compile=compile_)


@dataclass(frozen=True)
class PreemptionNotice:
    """How a provider preempts: ``notice_seconds`` of grace for ``soft_fraction`` of preemptions."""

    provider: str
    notice_seconds: float
    soft_fraction: float
    source: str
    date: str


def preemption_notice(provider: str) -> PreemptionNotice:
    """The snapshot's ``preemption:`` row for ``provider`` (unknown: hard preemptions, no notice)."""
    row = (_snapshot().get("preemption") or {}).get(provider)
    if not row:
        return PreemptionNotice(provider, 0.0, 0.0, f"{provider}: no figure; assumed hard (no notice)", "")
    frac = float(row.get("soft_fraction", 0.0))
    if not 0.0 <= frac <= 1.0:
        raise ValueError(f"{SNAPSHOT_PATH}: preemption.{provider}.soft_fraction must be within [0, 1]")
    return PreemptionNotice(provider, float(row.get("notice_seconds", 0.0)), frac,
                            str(row.get("source", "")), str(row.get("date", "")))
