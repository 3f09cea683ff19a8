"""Local HTTP servers answering the price APIs SkyPilot 0.14.1's catalog fetchers call, on
127.0.0.1, with bodies shaped by the code that parses them:

* RunPod GraphQL ``POST /graphql`` (the runpod SDK's ``run_graphql_query`` honours
  ``RUNPOD_API_BASE_URL``): ``gpuTypes { id displayName memoryInGb }`` (``runpod.get_gpus``) and
  ``gpuTypes(input: {id: …}) { … lowestPrice(input: {gpuCount: N}) { minimumBidPrice … } }``
  (``fetch_runpod.get_gpu_details``; the fields ``get_gpu_instance_configurations`` and
  ``get_gpu_info`` read).
* Vast ``POST /api/v0/bundles/`` (``vastai.api.offers.search_offers``; the SDK honours
  ``VAST_URL``): ``{"offers": [...]}`` with the fields ``fetch_vast`` maps and the SDK's chunked
  post-processing reads (``cpu_cores``, ``cpu_ram``, ``min_bid``, ``gpu_ram``, ``disk_space``).
* Lambda ``GET /instance-types`` (``fetch_lambda_cloud.create_catalog``): ``{"data": {name:
  {"instance_type": {"price_cents_per_hour", "specs": {vcpus, memory_gib, gpus}}}}}``. The
  fetcher's endpoint is a constant; :func:`lambda_endpoint_hook` writes a ``sitecustomize`` that
  points it here in the fetcher's process (test infrastructure: the product knows nothing of it).

Not emulated: authentication (any bearer key is accepted), the query filters (every search
returns every offer; ``type`` is recorded, not applied), RunPod's CPU flavours, rate limits,
pagination. ``mode`` turns a server into a failing one: ``slow`` (answers after ``delay`` s),
``garbage`` (HTTP 200 with a body that is not the API's shape).
"""

from __future__ import annotations

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

# RunPod: id → (displayName, memoryInGb, securePrice, secureSpotPrice, minimumBidPrice) per GPU.
RUNPOD_GPUS = {
    "NVIDIA H100 PCIe": ("H100 PCIe", 80, 2.39, 1.25, 1.10),
    "NVIDIA H100 80GB HBM3": ("H100 SXM", 80, 2.69, 1.45, 1.60),   # SkyPilot's bid < RunPod's minimum
}

# Vast offers: (gpu_name, num_gpus, $/h total, min_bid total, geolocation) — three per type so the
# fetcher keeps them (it lists an instance type once two offers share its type, continent, hosting).
VAST_OFFERS = [
    ("H100 SXM", 8, 15.20, 6.40, "Texas, US"),
    ("H100 SXM", 8, 15.60, 7.20, "Oregon, US"),
    ("H100 SXM", 8, 16.00, 6.80, "Quebec, CA"),
    ("H100 SXM", 1, 1.95, 0.85, "Texas, US"),
    ("H100 SXM", 1, 2.05, 0.95, "Oregon, US"),
    ("H100 SXM", 1, 2.10, 0.90, "Quebec, CA"),
]

LAMBDA_TYPES = {
    "gpu_8x_h100_sxm5": (2392, 208, 1800, 8),
    "gpu_1x_h100_pcie": (249, 26, 200, 1),
}


def runpod_gpu(gpu_id: str, count: int) -> dict[str, Any]:
    name, mem, price, spot, min_bid = RUNPOD_GPUS[gpu_id]
    return {
        "maxGpuCount": 8, "id": gpu_id, "displayName": name, "manufacturer": "Nvidia", "memoryInGb": mem,
        "cudaCores": 0, "secureCloud": True, "communityCloud": True, "securePrice": price,
        "communityPrice": price - 0.2, "oneMonthPrice": None, "threeMonthPrice": None, "oneWeekPrice": None,
        "communitySpotPrice": spot - 0.1, "secureSpotPrice": spot,
        "lowestPrice": {"minimumBidPrice": min_bid, "uninterruptablePrice": price, "minVcpu": 16 * count,
                        "minMemory": 125 * count, "stockStatus": "High", "compliance": None,
                        "maxUnreservedGpuCount": 8, "availableGpuCounts": [1, 2, 4, 8]},
    }


def vast_offers() -> list[dict[str, Any]]:
    out = []
    for i, (gpu, n, dph, bid, geo) in enumerate(VAST_OFFERS):
        out.append({
            "id": 1000 + i, "gpu_name": gpu, "num_gpus": n, "cpu_cores": 64, "cpu_ram": 257_000,
            "gpu_ram": 81_559, "gpu_total_ram": 81_559 * n, "disk_space": 500.0, "inet_down": 900.0,
            "search": {"totalHour": dph}, "dph_total": dph, "min_bid": bid, "geolocation": geo,
            "hosting_type": 1, "reliability": 0.99, "verified": True, "rentable": True,
        })
    return out


def lambda_types() -> dict[str, Any]:
    return {name: {"instance_type": {"name": name, "description": name, "price_cents_per_hour": cents,
                                     "specs": {"vcpus": vcpus, "memory_gib": mem, "storage_gib": 1000, "gpus": gpus}},
                   "regions_with_capacity_available": [{"name": "us-east-1", "description": "Virginia"}]}
            for name, (cents, vcpus, mem, gpus) in LAMBDA_TYPES.items()}


class PriceServers:
    """The three APIs on one ephemeral port each; ``mode`` per cloud: ok, slow or garbage."""

    def __init__(self, modes: dict[str, str] | None = None, delay: float = 30.0) -> None:
        self.modes = dict(modes or {})
        self.delay = delay
        self.requests: list[tuple[str, str, Any]] = []
        self._servers: dict[str, ThreadingHTTPServer] = {}
        self._stop = threading.Event()

    def url(self, cloud: str) -> str:
        host, port = self._servers[cloud].server_address[:2]
        return f"http://{host}:{port}"

    def _answer(self, cloud: str, path: str, body: Any) -> tuple[int, str]:
        mode = self.modes.get(cloud, "ok")
        self.requests.append((cloud, path, body))
        if mode == "slow":
            self._stop.wait(self.delay)
        if mode == "garbage":
            return 200, "<html>502 upstream gateway</html>" if cloud != "vast" else json.dumps({"offers": "n/a"})
        if cloud == "runpod":
            q = (body or {}).get("query", "")
            m = re.search(r'gpuTypes\(input: \{id: "([^"]+)"\}\)', q)
            if not m:
                return 200, json.dumps({"data": {"gpuTypes": [
                    {"id": k, "displayName": v[0], "memoryInGb": v[1]} for k, v in RUNPOD_GPUS.items()]}})
            c = re.search(r"gpuCount: (\d+)", q)
            return 200, json.dumps({"data": {"gpuTypes": [runpod_gpu(m.group(1), int(c.group(1)) if c else 1)]}})
        if cloud == "vast":
            return 200, json.dumps({"offers": vast_offers()})
        return 200, json.dumps({"data": lambda_types()})

    def start(self) -> "PriceServers":
        outer = self

        def handler(cloud: str) -> type[BaseHTTPRequestHandler]:
            class H(BaseHTTPRequestHandler):
                def log_message(self, *a: Any) -> None:
                    pass

                def _send(self, body: Any) -> None:
                    code, text = outer._answer(cloud, self.path, body)
                    data = text.encode()
                    try:
                        self.send_response(code)
                        self.send_header("Content-Type", "application/json")
                        self.send_header("Content-Length", str(len(data)))
                        self.end_headers()
                        self.wfile.write(data)
                    except (BrokenPipeError, ConnectionResetError):
                        pass

                def do_POST(self) -> None:
                    n = int(self.headers.get("Content-Length") or 0)
                    raw = self.rfile.read(n) if n else b""
                    try:
                        body = json.loads(raw) if raw else None
                    except ValueError:
                        body = None
                    self._send(body)

                def do_GET(self) -> None:
                    self._send(None)

            return H

        for cloud in ("runpod", "vast", "lambda"):
            srv = ThreadingHTTPServer(("127.0.0.1", 0), handler(cloud))
            srv.daemon_threads = True
            threading.Thread(target=srv.serve_forever, daemon=True).start()
            self._servers[cloud] = srv
        return self

    def stop(self) -> None:
        self._stop.set()
        for srv in self._servers.values():
            srv.shutdown()
            srv.server_close()

    def env(self, hook_dir: Path) -> dict[str, str]:
        """What the fetchers' process needs to talk to these servers instead of the providers."""
        lambda_endpoint_hook(hook_dir)
        return {"RUNPOD_API_BASE_URL": self.url("runpod"), "VAST_URL": self.url("vast"),
                "DTRUN_TEST_LAMBDA_ENDPOINT": f"{self.url('lambda')}/instance-types"}


HOOK = '''"""Test infrastructure (tests/e2e/clouds/pricelab/servers.py): point SkyPilot's Lambda fetcher,
whose endpoint is a module constant, at DTRUN_TEST_LAMBDA_ENDPOINT once it is imported."""
import importlib.abc
import os
import sys

_NAME = "sky.catalog.data_fetchers.fetch_lambda_cloud"


class _Patch(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != _NAME or not os.environ.get("DTRUN_TEST_LAMBDA_ENDPOINT"):
            return None
        sys.meta_path.remove(self)
        import importlib.util

        spec = importlib.util.find_spec(fullname)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module.ENDPOINT = os.environ["DTRUN_TEST_LAMBDA_ENDPOINT"]

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Patch())
'''


def lambda_endpoint_hook(hook_dir: Path) -> Path:
    hook_dir.mkdir(parents=True, exist_ok=True)
    (hook_dir / "sitecustomize.py").write_text(HOOK)
    return hook_dir
