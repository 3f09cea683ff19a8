"""Run every benchmark script in this folder, one after another; print each one's JSON.

Usage: python benchmarks/run_all.py [NAME ...]   (NAME: e.g. cli_startup, recovery, simulate)
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> int:
    wanted = set(sys.argv[1:])
    failed = 0
    for script in sorted(HERE.glob("bench_*.py")):
        name = script.stem.removeprefix("bench_")
        if wanted and name not in wanted:
            continue
        print(f"== {name}", flush=True)
        rc = subprocess.call([sys.executable, str(script)], cwd=HERE.parent)
        if rc:
            print(f"== {name} exited {rc}", flush=True)
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
