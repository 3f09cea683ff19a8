"""What SkyPilot 0.14.1 actually rented on Vast, checked against the offer dtrun quoted.

SkyPilot's Vast launch searches offers with a query string whose values it quotes
(``gpu_name="H100 SXM"``, ``sky/provision/vast/utils.py``); the vastai SDK's pre-parser accepts
only unquoted words and silently keeps the prefix before the first quoted value
(``vastai.utils.preprocess_search_query``), so the search carries no GPU, count, disk or region
filter and SkyPilot rents the top-scored offer of the whole market (seen on the Vast lab: an
RTX 4090 for an H100 job). Nothing dtrun can put in the task or SkyPilot's config reaches that
search; an API server dtrun starts loads its plugin that makes the search carry SkyPilot's
filters (:mod:`providers.skypilot.vastquery`), one dtrun did not start does not. Either way dtrun
checks the instance after the launch: its ``gpu_name`` and ``num_gpus`` against
the offer's instance type, and, for a spot offer, that it is a bid (``is_bid``; dtrun passes its
quoted bid as ``vast.create_instance_kwargs.price``, :mod:`providers.skypilot.task`). A mismatch
is destroyed by the caller at once (not left billing) and the offer refused.

The instance is read from Vast's REST API the way the vastai SDK reads it (``VAST_URL``, the key
SkyPilot reads, as a bearer token; ``GET /api/v1/instances/`` paged by ``next_token``): the row
labelled ``<cluster name on cloud>-head`` (SkyPilot's label).
"""

from __future__ import annotations

import json
import os
import urllib.parse
import urllib.request
from typing import Any

from providers.base import Offer


def expected_gpu(instance_type: str | None) -> str | None:
    """Vast's ``gpu_name`` for SkyPilot's instance type (``1x-H100_SXM-32-65536`` → ``H100 SXM``),
    parsed as SkyPilot's launch parses it; None without an instance type."""
    if not instance_type or instance_type.count("-") < 3:
        return None
    return instance_type.split("-")[1].replace("_", " ")


def mismatch(row: dict[str, Any], offer: Offer) -> str | None:
    """Why the rented instance ``row`` is not the offer (None: it is)."""
    why = []
    want = expected_gpu(offer.instance_type)
    if want is not None and str(row.get("gpu_name")) != want:
        why.append(f"GPU {row.get('gpu_name')!r}, not {want!r}")
    if row.get("num_gpus") is not None and int(row["num_gpus"]) != offer.gpus_per_node:
        why.append(f"{row['num_gpus']} GPUs, not {offer.gpus_per_node}")
    if offer.spot and not row.get("is_bid"):
        why.append("on-demand, not an interruptible bid")
    if not offer.spot and row.get("is_bid"):
        why.append("an interruptible bid, not on-demand")
    return "; ".join(why) or None


def instance_row(name_on_cloud: str, key: str, timeout: float = 30.0) -> dict[str, Any] | None:
    """The Vast instance SkyPilot labelled ``<name_on_cloud>-head``, or None if it is not listed."""
    base = (os.environ.get("VAST_URL") or "https://console.vast.ai").rstrip("/")
    params = {"select_filters": "{}", "order_by": json.dumps([{"col": "id", "dir": "asc"}]), "limit": "25"}
    label = f"{name_on_cloud}-head"
    for _ in range(1000):  # pages of 25
        url = f"{base}/api/v1/instances/?{urllib.parse.urlencode(params)}"
        req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}", "User-Agent": "dtrun"})
        with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 - Vast's API (or VAST_URL)
            data = json.loads(r.read())
        for row in data.get("instances") or []:
            if row.get("label") == label:
                return row
        if not data.get("next_token"):
            return None
        params["after_token"] = str(data["next_token"])
    return None
