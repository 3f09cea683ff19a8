"""Runs one local node's command and records how it ended (stdlib only; the process-group leader).

    python wrapper.py --exit-file F [--deadline UNIX] [--grace S] -- CMD ARGS...

The wrapper leads the node's process group (the local provider starts it with
``start_new_session=True``). It runs CMD in the same group, waits for it and writes CMD's exit
status to ``F`` (an integer; negative ``-N`` = killed by signal N), then exits with the same code.
A SIGTERM/SIGINT to the group reaches CMD, which handles it (the trainer checkpoints and exits 75);
the wrapper itself survives it so it can still record the code. With ``--deadline`` the wrapper
enforces the hard deadline itself: SIGTERM to the group, then SIGKILL after ``--grace`` seconds.
A SIGKILL to the group leaves no exit file: the local provider reads that as "killed".
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time


def _write(path: str, code: int) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(f"{code}\n")
    os.replace(tmp, path)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="dtrun-local-wrapper")
    ap.add_argument("--exit-file", required=True)
    ap.add_argument("--deadline", type=float, default=None)
    ap.add_argument("--grace", type=float, default=30.0)
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        ap.error("no command")

    # Survive the group's SIGTERM/SIGINT (a Python handler, not SIG_IGN: the child must get the
    # default disposition back at exec, so it can handle the signal itself).
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: None)
    try:
        child = subprocess.Popen(cmd)
    except OSError as e:
        print(f"dtrun: cannot start {cmd[0]!r}: {e}", file=sys.stderr, flush=True)
        _write(args.exit_file, 127)
        return 127

    rc: int | None = None
    while rc is None:
        timeout = None if args.deadline is None else max(0.0, args.deadline - time.time())
        try:
            rc = child.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            print("dtrun: hard deadline reached: SIGTERM to the node's processes", file=sys.stderr, flush=True)
            os.killpg(os.getpgrp(), signal.SIGTERM)
            try:
                rc = child.wait(timeout=args.grace)
            except subprocess.TimeoutExpired:
                print("dtrun: still running after the grace: SIGKILL", file=sys.stderr, flush=True)
                _write(args.exit_file, -signal.SIGKILL)
                os.killpg(os.getpgrp(), signal.SIGKILL)
                return 137  # not reached
    _write(args.exit_file, rc)
    return rc if rc >= 0 else 128 - rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
