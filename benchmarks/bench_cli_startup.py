"""CLI fast paths vs `import sky`: the dry run must take ≤ 0.15 × the time of `python -c "import
sky"` measured in the same run (`--help` and `prices` ≤ 0.3 ×), and none may import torch, sky or
boto3. The runs are interleaved (sky, then each case, repeated), so a machine busy with other work
slows both sides alike; the ratio is of medians.

Usage: python benchmarks/bench_cli_startup.py [--repeat N]   (prints one JSON object)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "sky", "boto3", "botocore", "modal")
PROBE = (
    "import sys; from orchestrator.cli.app import main; rc = main({argv!r}); "
    "heavy = sorted(m for m in {heavy!r} if m in sys.modules); "
    "sys.stderr.write('HEAVY=' + ','.join(heavy) + '\\n'); sys.exit(rc)"
)


def timed(cmd: list[str]) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    return time.perf_counter() - t0, p


def median_time(cmd: list[str], repeat: int) -> float:
    return statistics.median(timed(cmd)[0] for _ in range(repeat))


def heavy_modules(argv: list[str]) -> list[str]:
    _, p = timed([sys.executable, "-c", PROBE.format(argv=argv, heavy=HEAVY)])
    line = [ln for ln in p.stderr.splitlines() if ln.startswith("HEAVY=")]
    return [m for m in line[-1][len("HEAVY="):].split(",") if m] if line else ["<probe failed>"]


TARGETS = {"help": 0.3, "dry_run_gpt2": 0.15, "prices_h100": 0.3}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    dtrun = [sys.executable, "-m", "orchestrator.cli"]
    cases = {
        "help": ["--help"],
        "dry_run_gpt2": ["up", "jobs/gpt2-124m.yaml", "--dry-run"],
        "prices_h100": ["prices", "H100", "--json"],
    }
    sky_cmd = [sys.executable, "-c", "import sky"]
    for cmd in [sky_cmd] + [dtrun + a for a in cases.values()]:
        timed(cmd)  # warm the file cache and write the bytecode first
    times: dict[str, list[float]] = {"sky": [], **{n: [] for n in cases}}
    for _ in range(args.repeat):
        times["sky"].append(timed(sky_cmd)[0])
        for name, argv in cases.items():
            times[name].append(timed(dtrun + argv)[0])
    sky_s = statistics.median(times["sky"])
    out: dict = {"import_sky_s": round(sky_s, 3), "targets": TARGETS, "cases": {}}
    for name, argv in cases.items():
        t = statistics.median(times[name])
        out["cases"][name] = {
            "seconds": round(t, 3),
            "ratio_to_import_sky": round(t / sky_s, 3),
            "meets_target": t <= TARGETS[name] * sky_s,
            "heavy_modules_imported": heavy_modules(argv),
        }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
