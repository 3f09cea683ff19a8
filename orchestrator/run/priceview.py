"""The price view: the rows and capabilities of ``dtrun prices`` (provider, region, GPU, spot,
$/GPU-hour, where each price came from; each rentable provider's spot and multi-node support),
computed from the catalogs (``providers.catalog``) — by the embedded CLI
(``orchestrator.cli.prices``, which prints them) and by a server (``GET /v1/prices``,
``orchestrator.server.api_extra``), so both show the same table."""

from __future__ import annotations

from typing import Any

RENTABLE = ("runpod", "lambda", "vast", "modal")


def checked_gpu(gpu: str | None) -> str | None:
    """The canonical GPU name, or UsageError naming the known ones."""
    from orchestrator.contract.errors import UsageError
    from orchestrator.contract.gpus import canonical_gpu

    if gpu is not None:
        g = canonical_gpu(gpu)
        if g is None:
            from orchestrator.contract.gpus import GPUS

            raise UsageError(f"unknown GPU {gpu!r}; known: {', '.join(GPUS)}")
        gpu = g
    return gpu


def price_view(gpu: str | None, spot: bool | None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(rows, capabilities) of the price table: what ``dtrun prices`` prints, embedded or from a
    server (``GET /v1/prices``); ``gpu`` already canonical."""
    import time

    from providers import registry
    from providers.catalog import UNKNOWN_SPOT, all_rows

    caps = {}
    for name in RENTABLE:
        c = registry.get(name).capabilities()
        caps[name] = {
            "spot": {"supported": c.spot.supported, "reason": c.spot.reason},
            "multi_node": {"supported": c.multi_node.supported, "reason": c.multi_node.reason},
            "max_gpus_per_node": c.max_gpus_per_node,
        }
    rows = []
    for r in all_rows(gpu):
        kinds = []
        if spot is not True:
            kinds.append((False, r.price, r.source))
        if spot is not False and r.spot_sold and caps[r.provider]["spot"]["supported"]:
            if r.spot_price is not None:
                kinds.append((True, r.spot_price, r.source + (f"; {r.spot_note}" if r.spot_note else "")))
            else:
                kinds.append((True, r.price, f"{r.source}; {UNKNOWN_SPOT}"
                              + (f" ({r.spot_note})" if r.spot_note else "")))
        for is_spot, price, source in kinds:
            known = not is_spot or r.spot_price is not None
            rows.append({
                "provider": r.provider, "region": r.region, "gpu": r.gpu,
                "gpus_per_node": r.gpus_per_node, "spot": is_spot,
                "price_per_gpu_hour": round(price, 4), "price_source": source, "price_date": r.date,
                "price_known": known,
                "spot_bid": round(price, 4) if is_spot and known and r.fetched_at is not None else None,
                "price_fetched_at": r.fetched_at,
                "price_age_seconds": round(time.time() - r.fetched_at, 1) if r.fetched_at else None,
                "note": r.note,
            })
    return rows, caps
