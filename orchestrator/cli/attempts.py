"""Every attempt of a job, billed or not, as ``dtrun status --json``'s ``attempt_list`` shows it
(``dtrun cost`` lists the booked ones only): where it went and how it ended."""

from __future__ import annotations

from typing import Any


def offer_key(offer: Any) -> str | None:
    """``provider/region/GPUxN[/spot]`` of a stored offer (None if the record is not one)."""
    from providers.base import Offer

    try:
        return Offer.from_dict(offer).key()
    except (TypeError, ValueError, AttributeError):
        return None


def attempt_list(attempts: list[dict]) -> list[dict[str, Any]]:
    """One row per stored attempt: number, provider, offer key, state, outcome, reason."""
    return [{"attempt": a["n"], "provider": a["provider"], "offer": offer_key(a["offer"]),
             "state": a["state"], "outcome": a["outcome"], "reason": a["reason"]} for a in attempts]
