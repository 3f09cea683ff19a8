"""``make e2e`` as several pytest processes at once, so the suites that mostly wait overlap the
ones that compute.

A cloud lab's test spends most of its minutes waiting on SkyPilot (the API server's requests,
provisioning, the runtime's setup over SSH) and on a one-rank CPU job in a pod; the fault/resume,
pipeline and context-parallel scenarios keep both cores busy with torchrun ranks. Run one after
the other they took 43 min + 22 min here; run side by side they share the wait. Each group is its
own pytest session (its own lab fixtures, which start each lab once per group; the labs coexist:
bridges, ports and SkyPilot API servers are their own), so a group's failure never hides
another's. Every line of a group's output is printed as it comes, prefixed with the group's name;
the exit status is 0 only when every group passed (else the first failing group's). Ctrl-C or
SIGTERM reaches every group, whose fixtures then stop their labs.

    python -m tests.e2e.split [--pytest-arg ARG ...] NAME=PATH[,PATH...] ... REST_NAME

Each ``NAME=PATHS`` group runs ``pytest -m e2e PATHS``; the last name runs every other test marked
e2e (``pytest -m e2e tests --ignore=`` each path of the groups before it).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def commands(groups: list[str], rest: str, extra: list[str]) -> list[tuple[str, list[str]]]:
    """(name, argv) of each group's pytest; raises ValueError naming a malformed group or a path
    that is not there."""
    base = [sys.executable, "-m", "pytest", "-m", "e2e", *extra]
    out, taken = [], []
    for g in groups:
        name, sep, paths = g.partition("=")
        parts = [p for p in paths.split(",") if p]
        if not sep or not name or not parts:
            raise ValueError(f"group {g!r}: expected NAME=PATH[,PATH...]")
        missing = [p for p in parts if not (REPO / p).exists()]
        if missing:
            raise ValueError(f"group {name}: no such path {missing[0]!r}")
        out.append((name, base + parts))
        taken += parts
    out.append((rest, base + ["tests"] + [f"--ignore={p}" for p in taken]))
    return out


def _pump(name: str, stream, lock: threading.Lock) -> None:
    for line in iter(stream.readline, ""):
        with lock:
            sys.stdout.write(f"[{name}] {line}")
            sys.stdout.flush()


def run(cmds: list[tuple[str, list[str]]]) -> int:
    lock = threading.Lock()
    procs, pumps, t0 = [], [], time.monotonic()
    for name, argv in cmds:
        print(f"[{name}] $ {' '.join(argv[1:])}", flush=True)
        p = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             bufsize=1, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        procs.append((name, p))
        t = threading.Thread(target=_pump, args=(name, p.stdout, lock), daemon=True)
        t.start()
        pumps.append(t)

    def forward(signum, _frame):
        for _, p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)  # pytest's KeyboardInterrupt: fixtures tear down

    before = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    codes = []
    for name, p in procs:
        while True:
            try:
                codes.append((name, p.wait(), time.monotonic() - t0))
                break
            except InterruptedError:
                continue
    for t in pumps:
        t.join(timeout=5)
    for s, h in before.items():
        signal.signal(s, h)
    for name, code, took in codes:
        print(f"[{name}] exit {code} after {took / 60:.1f} min", flush=True)
    return next((c for _, c, _ in codes if c), 0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.e2e.split", description=__doc__.split("\n\n")[0])
    ap.add_argument("--pytest-arg", action="append", default=[], help="passed to every group's pytest")
    ap.add_argument("groups", nargs="+", help="NAME=PATH[,PATH...] ... REST_NAME")
    a = ap.parse_args(argv)
    try:
        cmds = commands(a.groups[:-1], a.groups[-1], a.pytest_arg)
    except ValueError as e:
        print(f"tests.e2e.split: {e}", file=sys.stderr)
        return 2
    return run(cmds)


if __name__ == "__main__":
    sys.exit(main())
