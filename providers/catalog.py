"""Prices and start-up figures for every provider: the one place the orchestrator asks.

``price_rows``/``catalog_offers``/``all_rows`` (the dry run, ``dtrun prices``, ``dtrun export``)
take each provider's rows from where they live: SkyPilot's cached catalogs for RunPod, Lambda and
Vast (``providers.skypilot.catalog``), the bundled snapshot for the rest (``providers.pricing``,
which holds the rows, region and offer rules). Providers yield their own offers from those two
modules and never import this one. Start-up figures and preemption notices come from the
snapshot's ``startup:`` and ``preemption:`` sections (sources and dates there, not constants in
code): the estimate and ``dtrun simulate`` use them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from orchestrator.contract.gpus import gpu_matches
from providers import pricing
from providers.base import Offer, Requirements
from providers.pricing import SNAPSHOT_PATH, UNKNOWN_SPOT, PriceRow
from providers.pricing import load_snapshot as _snapshot  # one name, so a test can swap the snapshot
from providers.skypilot import catalog as sky_catalog
from providers.skypilot.clouds import CLOUDS as SKY_CLOUDS

RENTABLE = ("runpod", "lambda", "vast", "modal")


def price_rows(provider: str) -> list[PriceRow]:
    """Every known price row for ``provider`` (its catalog's first, then the snapshot's)."""
    if provider in SKY_CLOUDS:
        return sky_catalog.price_rows(provider)
    return pricing.merged_rows(provider)


def catalog_offers(provider: str, req: Requirements) -> list[Offer]:
    """Offers for ``req`` on ``provider`` from its catalog and the snapshot, cheapest first (see
    ``providers.pricing.offers``); capabilities are the provider's business."""
    if provider in SKY_CLOUDS:
        return sky_catalog.catalog_offers(provider, req)
    return pricing.offers(provider, req)


def all_rows(gpu: str | None = None) -> list[PriceRow]:
    """Every price row of every rentable provider (for ``dtrun prices``)."""
    out = []
    for p in RENTABLE:
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
        cands = [_figure(table[p].get(k), f"startup.providers.{p}.{k}") for p in RENTABLE
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


__all__ = ["price_rows", "catalog_offers", "all_rows", "PriceRow", "UNKNOWN_SPOT", "StartupFigure",
           "StartupFigures", "startup_figures", "PreemptionNotice", "preemption_notice", "STARTUP_KEYS"]
