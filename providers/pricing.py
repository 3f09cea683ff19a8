"""Price rows, region names and offers, for any provider: the dated snapshot and the rules.

A provider's prices are the bundled snapshot (``providers/data/prices.yaml``: sources and dates
per row) plus, where it has one, its own catalog (SkyPilot's cached catalogs for RunPod, Lambda
and Vast: ``providers.skypilot.catalog``). Every function here takes that catalog as rows
(``catalog``: empty for a provider without one, such as Modal) and knows no provider's files.

**Regions.** Names are the catalog's (its ``Region`` column, else the snapshot's dated list):
RunPod ``US``/``CA``/…, Lambda ``us-east-1``/…, Vast ``"Texas, US, NA"``/…. A spec's
``resources.regions`` entry selects regions by exact name, or as a prefix: a country code
(``US``), a continent (``EU``, ``NA``, ``AS``, ``OC``), or the start of a Lambda name
(``us``, ``us-east``, ``europe``) — see :func:`select_regions`. Only real names reach a cloud.

**One offer per provider, variant and spot/on-demand**, holding every allowed region in price
order (``Offer.regions``): one launch lets SkyPilot fail over across them, so a region without
capacity does not cost a dtrun attempt.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from orchestrator.contract.gpus import gpu_family, gpu_matches
from providers.base import Offer, Requirements

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
def load_snapshot() -> dict[str, Any]:
    """The bundled snapshot, parsed once per process."""
    import yaml

    # libyaml's loader when PyYAML has it (the snapshot grew start-up figures: the pure-Python
    # loader took ~0.15 s of every dry run), the pure-Python one otherwise; both are "safe".
    return yaml.load(SNAPSHOT_PATH.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def snapshot_rows() -> list[PriceRow]:
    snap = load_snapshot()
    rows = []
    for r in snap["rows"]:
        for count in r["counts"]:
            it = r.get("instance_type")
            rows.append(PriceRow(
                provider=r["provider"], gpu=r["gpu"], region=ANY_REGION, gpus_per_node=count,
                price=float(r["price"]),
                spot_price=positive(r.get("spot_price")),
                spot_sold="spot_price" in r,
                source=f"snapshot {snap['date']}: {snap['sources'][r['provider']]}",
                date=snap["date"], note=r.get("note", ""),
                instance_type=it.format(n=count) if it else None,
                spot_note=snapshot_spot_note(snap, r),
            ))
    return rows


def snapshot_spot_note(snap: dict[str, Any], row: dict[str, Any]) -> str:
    """Where a snapshot row's spot figure comes from, and the same file's on-demand beside it
    (the spot figures and the on-demand rows are from different catalogs)."""
    if "spot_price" not in row:
        return ""
    src = " ".join(str((snap.get("spot_sources") or {}).get(row["provider"], "")).split())
    return "; ".join(x for x in (src, row.get("spot_vs", "")) if x)


def positive(v: Any) -> float | None:
    """A usable price, or None: empty, unparsable, zero or negative prices are unknown."""
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if f > 0 else None


def merged_rows(provider: str, catalog: Sequence[PriceRow] = ()) -> list[PriceRow]:
    """Every known price row for a provider: its catalog's rows replace snapshot rows per GPU
    family (a catalog that sells H100-SXM but no H100-PCIe has the last word on both)."""
    snap = [r for r in snapshot_rows() if r.provider == provider]
    cat_gpus = {gpu_family(r.gpu) for r in catalog}
    return list(catalog) + [r for r in snap if gpu_family(r.gpu) not in cat_gpus]


# ---- regions ---------------------------------------------------------------------------------

def known_regions(provider: str, catalog: Sequence[PriceRow] = ()) -> tuple[list[str], str]:
    """(the region names for ``provider``, where they come from): its catalog's, else the
    snapshot's dated list; ``([], …)`` for a provider without regions (Modal)."""
    if catalog:
        return sorted({r.region for r in catalog if r.region != ANY_REGION}), catalog[0].source
    snap = load_snapshot()
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


def select_regions(provider: str, regions: Sequence[str], terms: Sequence[str]) -> tuple[list[str], list[str]]:
    """(the names among ``regions`` that ``terms`` select, the terms that selected none)."""
    chosen: list[str] = []
    unmatched: list[str] = []
    for t in terms:
        hit = [r for r in regions if region_matches(provider, r, t)]
        if not hit:
            unmatched.append(t)
        chosen.extend(r for r in hit if r not in chosen)
    return chosen, unmatched


def region_problem(provider: str, terms: Sequence[str], catalog: Sequence[PriceRow] = ()) -> str | None:
    """Why ``resources.regions`` selects nothing on ``provider`` (naming the valid names), or None."""
    if not terms:
        return None
    regions, src = known_regions(provider, catalog)
    if not regions:
        return None  # a provider without regions (Modal): placement is its own
    chosen, _bad = select_regions(provider, regions, terms)
    if chosen:
        return None
    shown = ", ".join(repr(r) if "," in r else r for r in regions[:40])
    return (f"{provider}: resources.regions {list(terms)} selects none of its regions (SkyPilot's names, "
            f"from the {src}: {shown}{' …' if len(regions) > 40 else ''}); use a name, a country code "
            f"(US), a continent (EU, NA, AS, OC) or a name prefix (us-east)")


# ---- offers ----------------------------------------------------------------------------------

def offers(provider: str, req: Requirements, catalog: Sequence[PriceRow] = ()) -> list[Offer]:
    """Offers for ``req`` from the snapshot and ``catalog`` (the provider's own rows), cheapest first.

    One offer per (GPU variant, spot/on-demand): the cheapest instance type, with every allowed
    region where it is sold in ``regions`` (cheapest first). Capabilities are the provider's
    business (it refuses before calling this)."""
    regions = known_regions(provider, catalog)[0] if req.regions else []
    return rows_to_offers(merged_rows(provider, catalog), req, regions)


def rows_to_offers(rows: list[PriceRow], req: Requirements, known: Sequence[str]) -> list[Offer]:
    """``rows`` (one provider's) → offers for ``req``; ``known``: that provider's region names,
    which ``req.regions`` selects from."""
    want_spot = {True: [True], False: [False], "prefer": [False, True]}[req.spot]
    allowed: set[str] | None = None
    rank: dict[str, int] = {}
    chosen: list[str] = []
    if req.regions and rows:
        chosen = select_regions(rows[0].provider, known, req.regions)[0]
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
            regions = list(chosen)  # snapshot rows: the dated list
        spread = {round(c[0], 4) for c in cands}
        if len(spread) > 1:
            source = f"{source}; cheapest of {len(regions)} regions (up to ${max(spread):.2f}/GPU-h)"
        if allowed is None:
            # No region asked for: SkyPilot may place it anywhere the provider sells it.
            region = regions[0] if len(regions) == 1 else ANY_REGION
            regions = []
        else:
            region = regions[0] if len(regions) == 1 else ANY_REGION
        known_price = not spot or row.spot_price is not None
        out.append(Offer(
            provider=provider, region=region, gpu=gpu,
            gpus_per_node=row.gpus_per_node, spot=spot, price_per_gpu_hour=round(price, 4),
            price_source=source, price_date=row.date, nodes=req.nodes, instance_type=it,
            regions=tuple(regions), price_known=known_price,
            spot_bid=round(price, 4) if spot and known_price and row.fetched_at is not None else None,
            price_fetched_at=row.fetched_at,
        ))
    return sorted(out, key=lambda o: (not o.price_known, o.price_per_gpu_hour, o.provider, o.gpu, o.spot))
