"""What the fake cloud sells: priced GPU types per region, sized to each request."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from orchestrator.contract.gpus import gpu_matches
from providers.base import Offer, Requirements


@dataclass(frozen=True)
class FakeOfferTemplate:
    """A priced GPU type in a region; ``offers()`` sizes it to the request."""

    region: str
    gpu: str
    spot: bool
    price_per_gpu_hour: float

    def to_dict(self) -> dict[str, Any]:
        return {"region": self.region, "gpu": self.gpu, "spot": self.spot,
                "price_per_gpu_hour": self.price_per_gpu_hour}


DEFAULT_OFFERS: tuple[FakeOfferTemplate, ...] = (
    FakeOfferTemplate("fake-east", "H100", False, 2.49),
    FakeOfferTemplate("fake-east", "H100", True, 1.29),
    FakeOfferTemplate("fake-west", "H100", False, 2.89),
    FakeOfferTemplate("fake-west", "H100", True, 1.49),
    FakeOfferTemplate("fake-east", "A100-80GB", False, 1.79),
    FakeOfferTemplate("fake-west", "A100-80GB", True, 0.89),
    FakeOfferTemplate("fake-east", "L4", False, 0.59),
    FakeOfferTemplate("fake-west", "L4", True, 0.29),
    FakeOfferTemplate("fake-east", "cpu", False, 0.05),
    FakeOfferTemplate("fake-west", "cpu", True, 0.02),
)


def matching_offers(templates: Iterable[FakeOfferTemplate], req: Requirements) -> list[Offer]:
    """The templates that fit ``req`` (GPU, spot, regions, price cap) as offers, cheapest first."""
    out = []
    for t in templates:
        if not gpu_matches(req.gpu, t.gpu):  # `H100` takes either variant, as on a real cloud
            continue
        if (req.spot is True and not t.spot) or (req.spot is False and t.spot):
            continue
        if req.regions and t.region not in req.regions:
            continue
        if req.max_price_per_gpu_hour is not None and t.price_per_gpu_hour > req.max_price_per_gpu_hour:
            continue
        out.append(Offer("fake", t.region, t.gpu, req.gpus_per_node, t.spot, t.price_per_gpu_hour,
                         price_source="fake cloud", nodes=req.nodes))
    return sorted(out, key=lambda o: o.price_per_hour)
