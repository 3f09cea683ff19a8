"""Provider latencies on this machine: the fake cloud's calls (in memory and file-shared), and the
local provider's launch → RUNNING → terminate-confirmed with real processes.

Usage: python benchmarks/bench_providers.py [--n N]   (prints one JSON object)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from providers.base import LaunchRequest, NodeState, Requirements  # noqa: E402
from providers.fake import FakeProvider  # noqa: E402
from providers.local import LocalProvider  # noqa: E402


def fake_calls(cloud: FakeProvider, n: int) -> dict[str, float]:
    offer = cloud.offers(Requirements("H100", 8))[0]
    t0 = time.perf_counter()
    handles = [cloud.launch(LaunchRequest("bench", i, offer, 1, ["true"])) for i in range(n)]
    t1 = time.perf_counter()
    for h in handles:
        cloud.poll(h)
    t2 = time.perf_counter()
    for h in handles:
        cloud.terminate(h)
    t3 = time.perf_counter()
    return {"launch_ms": (t1 - t0) / n * 1e3, "poll_ms": (t2 - t1) / n * 1e3, "terminate_ms": (t3 - t2) / n * 1e3}


def local_cycle(p: LocalProvider, i: int) -> tuple[float, float]:
    offer = p.offers(Requirements("cpu", 1))[0]
    t0 = time.perf_counter()
    h = p.launch(LaunchRequest("bench", i, offer, 1, [sys.executable, "-c", "import time; time.sleep(30)"]))
    while p.poll(h) is not NodeState.RUNNING:
        time.sleep(0.005)
    t1 = time.perf_counter()
    p.terminate(h)
    t2 = time.perf_counter()
    return (t1 - t0) * 1e3, (t2 - t1) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        mem = fake_calls(FakeProvider(clock=lambda: 1000.0), args.n)
        shared = fake_calls(FakeProvider(Path(d) / "cloud.json", clock=lambda: 1000.0), min(args.n, 100))
        p = LocalProvider(Path(d) / "home")
        cycles = [local_cycle(p, i) for i in range(5)]
    print(json.dumps({
        "fake_in_memory": {k: round(v, 3) for k, v in mem.items()},
        "fake_file_shared_100_instances": {k: round(v, 3) for k, v in shared.items()},
        "local_launch_to_running_ms_median": round(statistics.median(c[0] for c in cycles), 1),
        "local_terminate_confirmed_ms_median": round(statistics.median(c[1] for c in cycles), 1),
    }))


if __name__ == "__main__":
    main()
