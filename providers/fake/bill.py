"""The fake cloud's bill: every instance's seconds × price, from the start of provisioning until
the cloud confirms it gone (still-live instances count up to now). Tests read it to prove that
nothing leaked or was overcharged."""

from __future__ import annotations

from typing import Any

from providers.fake.instances import ordered


def bill(st: dict[str, Any], now: float) -> dict[str, Any]:
    """Per-instance rows and the total in USD, as of ``now`` (the state already advanced to it)."""
    rows = []
    for r in ordered(st):
        end = r["gone_at"] if r["gone_at"] is not None else now
        seconds = max(0.0, end - r["created_at"])
        cost = seconds / 3600.0 * r["price_per_hour"]
        rows.append({"id": r["id"], "name": r["name"], "offer": r["offer_key"],
                     "price_per_hour": r["price_per_hour"], "start": r["created_at"],
                     "end": r["gone_at"], "live": r["gone_at"] is None,
                     "seconds": seconds, "cost_usd": cost})
    return {"rows": rows, "total_usd": sum(x["cost_usd"] for x in rows), "time": now}
