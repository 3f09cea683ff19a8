"""CLI fast paths vs `import sky`: `dtrun --help` and the dry run must take ≤ 0.3 × the time of
`python -c "import sky"` measured in the same run, and must not import torch, sky or boto3.

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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    dtrun = [sys.executable, "-m", "orchestrator.cli"]
    sky_s = median_time([sys.executable, "-c", "import sky"], args.repeat)
    cases = {
        "help": ["--help"],
        "dry_run_gpt2": ["up", "jobs/gpt2-124m.yaml", "--dry-run"],
        "prices_h100": ["prices", "H100", "--json"],
    }
    out: dict = {"import_sky_s": round(sky_s, 3), "target_ratio": 0.3, "cases": {}}
    for name, argv in cases.items():
        t = median_time(dtrun + argv, args.repeat)
        out["cases"][name] = {
            "seconds": round(t, 3),
            "ratio_to_import_sky": round(t / sky_s, 3),
            "meets_target": t <= 0.3 * sky_s,
            "heavy_modules_imported": heavy_modules(argv),
        }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
