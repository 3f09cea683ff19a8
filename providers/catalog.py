"""Prices: the bundled snapshot, overridden by SkyPilot's cached catalogs when present.

Providers call :func:`catalog_offers` from their ``offers()``; the dry run and ``dtrun prices``
ask the providers. Reading SkyPilot's catalog is plain CSV (``~/.sky/catalogs/v8/<cloud>/vms.csv``):
``sky`` itself is never imported here (it costs seconds and starts an API server).
"""

from __future__ import annotations

import csv
import datetime as _dt
import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator.contract.gpus import canonical_gpu
from providers.base import Offer, Requirements

SKY_CATALOG_VERSION = "v8"
SKY_CLOUDS = {"runpod": "runpod", "lambda": "lambda", "vast": "vast"}
SNAPSHOT_PATH = Path(__file__).parent / "data" / "prices.yaml"
UNKNOWN_SPOT = "spot price unknown: priced at on-demand (upper bound)"
ANY_REGION = "any"


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
            rows.append(PriceRow(
                provider=r["provider"], gpu=r["gpu"], region=ANY_REGION, gpus_per_node=count,
                price=float(r["price"]),
                spot_price=_positive(r.get("spot_price")),
                spot_sold="spot_price" in r,
                source=f"snapshot {snap['date']}: {snap['sources'][r['provider']]}",
                date=snap["date"], note=r.get("note", ""),
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
    rows = []
    for r in reader:
        gpu = canonical_gpu(r.get("AcceleratorName") or "")
        count = _positive(r.get("AcceleratorCount"))
        price = _positive(r.get("Price"))
        if gpu is None or count is None or price is None or count != int(count):
            continue
        n = int(count)
        spot = _positive(r.get("SpotPrice"))
        rows.append(PriceRow(
            provider=provider, gpu=gpu, region=r.get("Region") or ANY_REGION, gpus_per_node=n,
            price=price / n, spot_price=(spot / n) if spot else None,
            spot_sold=provider in ("runpod", "vast"),
            source=f"skypilot catalog {cloud}/vms.csv ({mtime})", date=mtime,
            note=r.get("InstanceType") or "",
        ))
    return rows


def price_rows(provider: str) -> list[PriceRow]:
    """Every known price row for a provider: catalog rows replace snapshot rows per GPU type."""
    snap = [r for r in snapshot_rows() if r.provider == provider]
    cat = catalog_rows(provider)
    cat_gpus = {r.gpu for r in cat}
    return cat + [r for r in snap if r.gpu not in cat_gpus]


def _rows_to_offers(rows: list[PriceRow], req: Requirements) -> list[Offer]:
    want_spot = {True: [True], False: [False], "prefer": [False, True]}[req.spot]
    best: dict[tuple, Offer] = {}
    for r in rows:
        if r.gpu != req.gpu or r.gpus_per_node != req.gpus_per_node:
            continue
        if req.regions and r.region != ANY_REGION and r.region not in req.regions:
            continue
        for spot in want_spot:
            if spot and not r.spot_sold:
                continue
            price, source = r.price, r.source
            if spot:
                if r.spot_price is not None:
                    price = r.spot_price
                else:
                    source = f"{r.source}; {UNKNOWN_SPOT}"
            if req.max_price_per_gpu_hour is not None and price > req.max_price_per_gpu_hour:
                continue
            offer = Offer(
                provider=r.provider, region=r.region, gpu=r.gpu, gpus_per_node=r.gpus_per_node,
                spot=spot, price_per_gpu_hour=round(price, 4), price_source=source,
                price_date=r.date, nodes=req.nodes, instance_type=r.note or None,
            )
            k = (r.provider, r.region, spot)
            if k not in best or offer.price_per_gpu_hour < best[k].price_per_gpu_hour:
                best[k] = offer
    return sorted(best.values(), key=lambda o: (o.price_per_gpu_hour, o.provider, o.region, o.spot))


def catalog_offers(provider: str, req: Requirements) -> list[Offer]:
    """Offers for ``req`` from the snapshot and SkyPilot's cached catalogs, cheapest first.

    One offer per (region, spot/on-demand): the cheapest matching row. Capabilities are the
    provider's business (it refuses before calling this).
    """
    return _rows_to_offers(price_rows(provider), req)


def all_rows(gpu: str | None = None) -> list[PriceRow]:
    """Every price row of every rentable provider (for ``dtrun prices``)."""
    out = []
    for p in ("runpod", "lambda", "vast", "modal"):
        out.extend(r for r in price_rows(p) if gpu is None or r.gpu == gpu)
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
