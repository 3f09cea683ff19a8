"""A stand-in trainer for the node bootstrap's tests: honours the run-URI contract (progress.json,
COMMITTED checkpoints, STOP, DONE, exit 0/75) without torch, so tests of the watchdog run in
seconds. Runs either directly (DTRUN_TRAINER_CMD) or as a module under real torchrun
(DTRUN_TRAINER_MODULE=fake_node_trainer).

Behaviour from the environment:
  FAKE_STEPS         total steps (default 20)
  FAKE_STEP_SECONDS  seconds per step (default 0.05)
  FAKE_MODE          normal | hang (no progress, ignores STOP) | stubborn (ignores STOP and
                     SIGTERM) | exit=N (exit N at once) | spawn (normal, plus a grandchild in its
                     own session that sleeps forever; its pid goes to <run-uri>/grandchild.pid)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

from orchestrator.contract import runuri


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--job", required=True)
    ap.add_argument("--run-uri", required=True)
    a = ap.parse_args()
    uri = a.run_uri
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    mode = os.environ.get("FAKE_MODE", "normal")
    steps = int(os.environ.get("FAKE_STEPS", "20"))
    dt = float(os.environ.get("FAKE_STEP_SECONDS", "0.05"))
    attempt = int(os.environ.get("DTRUN_ATTEMPT", "0"))

    import yaml

    with open(a.job) as f:
        job = yaml.safe_load(f)
    if not isinstance(job, dict) or "name" not in job:
        print("fake trainer: bad job file", file=sys.stderr)
        return runuri.EXIT_BAD_CONFIG
    if mode.startswith("exit="):
        return int(mode.split("=", 1)[1])

    last = runuri.latest_committed(uri)
    step = last[0] if last else 0

    def commit(s: int) -> None:
        if rank == 0:
            runuri.write_json(runuri.join(runuri.checkpoint_uri(uri, s), runuri.COMMITTED),
                              {"step": s, "world_size": world, "time": time.time()})

    state = {"term": False}

    def on_term(*_):
        state["term"] = True

    if mode != "stubborn":
        signal.signal(signal.SIGTERM, on_term)
    else:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)

    if mode == "spawn" and rank == 0:
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
        runuri.write_text(runuri.join(uri, "grandchild.pid"), str(p.pid))

    while step < steps or mode in ("hang", "stubborn"):
        if state["term"]:
            commit(step)
            return runuri.EXIT_PREEMPTED
        if mode not in ("hang", "stubborn") and runuri.exists(runuri.join(uri, runuri.STOP)):
            commit(step)
            return runuri.EXIT_DONE
        time.sleep(dt)
        if mode == "hang":
            continue
        step += 1
        if rank == 0:
            runuri.write_json(runuri.join(uri, runuri.PROGRESS),
                              {"step": step, "steps": steps, "attempt": attempt, "time": time.time(),
                               "job": job["name"], "world_size": world})
    commit(step)
    if rank == 0:
        runuri.write_json(runuri.join(uri, runuri.DONE), {"step": step, "time": time.time()})
    return runuri.EXIT_DONE


if __name__ == "__main__":
    sys.exit(main())
