"""Run SkyPilot 0.14.1's own catalog fetcher for one cloud, in a process of its own:

    python -m providers.skypilot.fetch {runpod|vast|lambda} OUT_DIR

writes ``OUT_DIR/vms.csv`` (SkyPilot's catalog format, what the fetcher writes) and
``OUT_DIR/spot.json`` (the live spot figures the CSV cannot hold). ``providers.skypilot.prices``
starts it with a timeout and installs the result; it is a process of its own so that ``sky``,
``pandas`` and the SDKs are never imported by the dry run, and a hung API can be killed.

Per cloud, what is SkyPilot's and what is dtrun's:

* **RunPod** — ``fetch_runpod.fetch_runpod_catalog`` + ``save_catalog`` as they are (GPU rows;
  the CPU-only rows of the current catalog are kept: dtrun rents no CPU pods and the fetcher
  spends hundreds of queries on them). ``SpotPrice`` is the fetcher's ``secureSpotPrice`` × GPUs:
  what SkyPilot bids (``bid_per_gpu`` = the type's cheapest ``SpotPrice`` ÷ GPUs,
  ``clouds/runpod.py``). The fetcher's own query also returns ``lowestPrice.minimumBidPrice``
  (RunPod's current minimum bid for interruptible pods) and drops it; dtrun wraps
  ``get_gpu_details`` to keep it per (GPU, count) in ``spot.json``.
* **Vast** — ``fetch_vast`` (a script: run as ``__main__`` in OUT_DIR, it writes ``vast/vms.csv``).
  Its ``SpotPrice`` is always 0.00: it searches with ``chunked = true``, and the SDK's chunking
  (``vastai.utils.postprocess_search_results``) floors ``min_bid`` to 0 on every offer. SkyPilot's
  launch searches the same way and bids ``price = min_bid`` = 0. So the fetcher cannot give the
  spot price; dtrun asks the same SDK call once more without chunking, ``type = bid``, keeps the
  offers the chunked search keeps (≥ 32 cores, ≥ 64 GiB RAM: SkyPilot's instance type is
  ``<n>x-<gpu>-32-65536``), and takes per instance type and continent the highest ``min_bid``
  (the bid every matching offer accepts; the fetcher's own ``maxBid`` rule). That figure goes
  into ``SpotPrice`` and ``spot.json``; dtrun passes it to SkyPilot as the bid
  (``vast.create_instance_kwargs.price``).
* **Lambda** — ``fetch_lambda_cloud.create_catalog(key, path)`` as it is (no spot product).

Keys are read from the files SkyPilot reads (``providers.skypilot.credentials``) and passed to
the fetcher the way it takes them; they are never written anywhere. Exit 0 on success; otherwise
the last line on stderr says why.
"""

from __future__ import annotations

import csv
import json
import os
import runpy
import sys
import tomllib
from pathlib import Path
from typing import Any

VAST_CORES, VAST_RAM_MB = 32, 64 * 1024  # vastai.utils: chunked floors cpu_cores/cpu_ram to these


def _runpod_key() -> str:
    with Path("~/.runpod/config.toml").expanduser().open("rb") as f:
        return str(tomllib.load(f)["default"]["api_key"])


def _lambda_key() -> str:
    for line in Path("~/.lambda_cloud/lambda_keys").expanduser().read_text().splitlines():
        if " = " in line and line.split(" = ")[0].strip() == "api_key":
            return line.split(" = ", 1)[1].strip()
    raise ValueError("~/.lambda_cloud/lambda_keys has no api_key line")


def _cpu_rows(current: Path) -> list[dict[str, str]]:
    try:
        with current.open(newline="") as f:
            return [r for r in csv.DictReader(f) if not (r.get("AcceleratorName") or "").strip()]
    except (OSError, csv.Error):
        return []


def fetch_runpod(out: Path, current: Path) -> dict[str, Any]:
    import runpod

    from sky.catalog.data_fetchers import fetch_runpod as f

    min_bids: dict[str, float] = {}
    details = f.get_gpu_details

    def keep_min_bid(gpu_id: str, gpu_count: int = 1) -> dict[str, Any]:
        d = details(gpu_id, gpu_count)
        bid = (d.get("lowestPrice") or {}).get("minimumBidPrice")
        if isinstance(bid, (int, float)) and bid > 0:
            min_bids[f"{gpu_count}x_{f.format_gpu_name(d)}_SECURE"] = float(bid)
        return d

    f.get_gpu_details = keep_min_bid
    runpod.api_key = os.environ["RUNPOD_API_KEY"] = _runpod_key()
    instances = f.fetch_runpod_catalog(no_gpu=False, no_cpu=True)
    f.save_catalog(instances, str(out / "vms.csv"))
    cpu = _cpu_rows(current)
    if cpu:
        with (out / "vms.csv").open("a", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=f.USEFUL_COLUMNS, extrasaction="ignore")
            w.writerows(cpu)
    return {"min_bid_per_gpu": min_bids,
            "bid_rule": "SkyPilot bids the catalog's cheapest SpotPrice / GPUs (secureSpotPrice)"}


def _continent(geolocation: str) -> str:
    return geolocation.strip()[-2:]


def fetch_vast(out: Path) -> dict[str, Any]:
    import re

    cwd = os.getcwd()
    os.chdir(out)
    try:
        runpy.run_module("sky.catalog.data_fetchers.fetch_vast", run_name="__main__")
    finally:
        os.chdir(cwd)
    (out / "vast" / "vms.csv").replace(out / "vms.csv")
    (out / "vast").rmdir()

    from sky.adaptors import vast

    offers = vast.vast().search_offers(query="georegion = true inet_down >= 100 disk_space >= 80",
                                       type="bid", limit=10000)
    if not isinstance(offers, list):
        raise ValueError(f"Vast bid search returned {type(offers).__name__}, not a list of offers")
    bids: dict[str, float] = {}
    for o in offers:
        try:
            if o["cpu_cores"] < VAST_CORES or o["cpu_ram"] < VAST_RAM_MB:
                continue
            bid = float(o["min_bid"])
            name = re.sub(r"\s", "_", o["gpu_name"])  # fetch_vast.create_instance_type's stubify
            it = f"{o['num_gpus']}x-{name}-{VAST_CORES}-{VAST_RAM_MB}"
            key = f"{it}|{_continent(o['geolocation'])}"
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"Vast bid search: an offer without {e}") from None
        if bid > 0:
            bids[key] = max(bids.get(key, 0.0), bid)
    # The fetcher's SpotPrice is 0.00 (see the module doc): write the live bid in its place.
    with (out / "vms.csv").open(newline="") as fh:
        reader = csv.DictReader(fh)
        fields = list(reader.fieldnames or [])
        rows = list(reader)
    for r in rows:
        b = bids.get(f"{r['InstanceType']}|{_continent(r.get('Region') or '')}")
        r["SpotPrice"] = f"{b:.4f}" if b else ""
    with (out / "vms.csv").open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)
    return {"bid_per_instance": bids,
            "bid_rule": "the highest min_bid of the instance type's interruptible offers on the continent"}


def fetch_lambda(out: Path) -> dict[str, Any]:
    from sky.catalog.data_fetchers import fetch_lambda_cloud as f

    f.create_catalog(_lambda_key(), str(out / "vms.csv"))
    return {}


def _masked(text: str) -> str:
    """``text`` with every provider key replaced by ``<key>`` (an SDK's error may quote the request,
    and this line reaches the terminal and the refresh record)."""
    from providers.skypilot.credentials import read_key

    for cloud in ("runpod", "lambda", "vast"):
        try:
            key = read_key(cloud)
        except Exception:  # noqa: BLE001 — an unreadable key file has nothing to mask
            key = None
        if key and len(key) >= 8:
            text = text.replace(key, "<key>")
    return text


def main(argv: list[str]) -> int:
    cloud, out = argv[0], Path(argv[1])
    current = Path(argv[2]) if len(argv) > 2 else Path("/nonexistent")
    out.mkdir(parents=True, exist_ok=True)
    try:
        if cloud == "runpod":
            spot = fetch_runpod(out, current)
        elif cloud == "vast":
            spot = fetch_vast(out)
        elif cloud == "lambda":
            spot = fetch_lambda(out)
        else:
            print(f"unknown cloud {cloud!r}", file=sys.stderr)
            return 2
    except SystemExit as e:  # the fetchers' own exits (fetch_runpod's main path, argparse)
        print(f"{cloud} fetcher exited with {e.code}", file=sys.stderr)
        return 1
    except Exception as e:  # noqa: BLE001 — any failure of a third-party fetcher: one line, exit 1
        msg = " ".join(_masked(str(e)).split())[:300] or type(e).__name__
        print(f"{cloud} fetcher failed: {type(e).__name__}: {msg}", file=sys.stderr)
        return 1
    (out / "spot.json").write_text(json.dumps(spot, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
