"""Recovery on the local provider: from SIGKILL of the node's process group to the first training
step of the new attempt, split into

* detection       — kill → the controller records the preemption (target ≤ one poll interval)
* backoff         — the deliberate relaunch delay (recovery.backoff_seconds; 0 here)
* controller work — detection → the new attempt's launch returned, minus backoff (target ≤ 2 s)
* process start-up — launch → the trainer starts loading its checkpoint (bootstrap, torchrun,
                     Python + torch import, process group, model build)
* checkpoint load — the trainer's ``CheckpointManager.load_latest``
* first step      — load end → the first optimizer step of the new attempt is logged

Real parts: the controller (in this process, real clock), the local provider, the node bootstrap,
torchrun with 2 CPU ranks over gloo, the bundled trainer (tiny GPT), DCP checkpoints on local disk.
Usage: ``python benchmarks/bench_recovery.py [--poll 5] [--runs 1] [--json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def one_run(poll: float, workdir: Path, i: int) -> dict:
    from orchestrator.contract import runuri
    from orchestrator.run.controller import Controller
    from orchestrator.plan.spec import parse_spec
    from orchestrator.run.state import StateStore

    name = f"bench-recovery-{i}"
    uri = f"file://{workdir}/runs/{name}"
    spec = parse_spec({
        "name": name,
        "resources": {"providers": ["local"], "gpu": "cpu", "gpus_per_node": 2},
        "trainer": {"model": "tiny", "parallel": {"dp_shard": 2}, "steps": 400, "batch_size": 8, "seq_len": 64,
                    "precision": "fp32", "log_every": 1, "heartbeat_seconds": 0.5},
        "checkpoint": {"uri": uri, "every_steps": 20},
        "recovery": {"poll_seconds": poll, "backoff_seconds": 0, "heartbeat_timeout_seconds": 300},
    })
    store = StateStore()
    mark: dict = {}

    def on_tick(ctl: Controller) -> None:
        if "kill" in mark:
            if ctl.state == "RUNNING" and len(ctl.store.attempts(name)) >= 2:
                p = ctl.progress or {}
                if p.get("attempt") == 2 and (p.get("step") or 0) > (mark.get("resume_step") or 0):
                    ctl.store.request_action(name, "stop_now")
            return
        p = ctl.progress or {}
        lc = p.get("last_committed_step") or 0
        if ctl.state == "RUNNING" and p.get("attempt") == 1 and lc >= 40 and (p.get("step") or 0) >= lc + 5:
            nd = ctl.store.nodes(name, live_only=True)[0]
            import time

            # kill right after a tick, the worst case for detection is a whole poll interval later
            mark["kill"] = time.time()
            os.killpg(nd["handle"]["data"]["pgid"], signal.SIGKILL)
            mark["resume_step"] = lc

    ctl = Controller(spec, store)
    ctl.run(on_tick=on_tick)
    ev = store.events(name)
    t_detect = next(e["time"] for e in ev if e["type"] == "preempted")
    t_launch2 = next(e["time"] for e in ev if e["type"] == "launch" and e["data"]["attempt"] == 2)
    log = Path(store.get_attempt(name, 2)["log_path"]).read_text()
    bench = {m.group(1): float(m.group(2)) for m in re.finditer(r"^BENCH (\w+) ([\d.]+)$", log, re.M)}
    first = None
    for line in runuri.read_text(runuri.join(uri, runuri.METRICS)).splitlines():
        row = json.loads(line)
        if row.get("time", 0) > bench["load_end"]:
            first = row["time"]
            break
    assert first is not None, "no step after the resume"
    t_kill = mark["kill"]
    return {
        "detection_s": t_detect - t_kill,
        "backoff_s": 0.0,
        "controller_work_s": t_launch2 - t_detect,
        "process_startup_s": bench["load_start"] - t_launch2,
        "  of which python+torch import to trainer start_s": bench["python_start"] - t_launch2,
        "checkpoint_load_s": bench["load_end"] - bench["load_start"],
        "first_step_s": first - bench["load_end"],
        "total_s": first - t_kill,
        "resumed_from_step": mark.get("resume_step"),
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--poll", type=float, default=5.0, help="recovery.poll_seconds (default: the spec default, 5)")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="dtrun-bench-recovery-"))
    os.environ["DTRUN_HOME"] = str(work / "home")
    os.environ["DTRUN_TRAINER_MODULE"] = "_bench_timed_trainer"
    os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO / "benchmarks"), str(REPO)])
    rows = [one_run(a.poll, work, i) for i in range(a.runs)]
    out = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "resumed_from_step"}
    out["poll_seconds"] = a.poll
    out["runs"] = a.runs
    # The kill lands right after a tick (the worst case), so detection is one poll interval give
    # or take a few ms of tick work; 10 ms is allowed for that jitter.
    out["targets"] = {"detection_s <= poll (+10 ms jitter)": out["detection_s"] <= a.poll + 0.01,
                      "controller_work_s <= 2": out["controller_work_s"] <= 2.0}
    if a.json:
        print(json.dumps(out))
    else:
        print(f"recovery on the local provider (median of {a.runs}, poll {a.poll:g} s):")
        for k, v in out.items():
            if k.endswith("_s"):
                print(f"  {k:<52} {v:8.3f} s")
        print(f"  targets: {out['targets']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
