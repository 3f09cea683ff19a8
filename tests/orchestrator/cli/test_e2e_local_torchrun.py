"""End to end on the local provider with real torchrun (2 CPU ranks, gloo): the controller, the
node bootstrap and the bundled trainer, the run URI on local disk and on moto S3 (real HTTP).

* an uninterrupted run (local disk) finishes;
* the same job with the node's process group SIGKILLed twice mid-run (run URI on S3) is
  relaunched, resumes from the newest COMMITTED checkpoint, finishes, and its final parameters
  are bit-identical to the uninterrupted run (the trainer's DONE ``param_digest``);
* a trainer that crashes is restarted ``max_restarts_on_errors`` times, then the job FAILs with
  the reason and the trainer's last log lines.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from orchestrator.contract import runuri
from orchestrator.run.controller import Controller
from orchestrator.plan.spec import parse_spec
from orchestrator.run.state import StateStore

pytestmark = pytest.mark.slow  # real torchrun

REPO = Path(__file__).resolve().parents[3]


def job(uri: str, name: str = "e2e", steps: int = 80) -> dict:
    return {
        "name": name,
        "resources": {"providers": ["local"], "gpu": "cpu", "gpus_per_node": 2},
        "trainer": {"model": "tiny", "parallel": {"dp_shard": 2}, "steps": steps, "batch_size": 8, "seq_len": 64,
                    "precision": "fp32", "lr": 0.003, "warmup_steps": 5, "log_every": 10,
                    "heartbeat_seconds": 0.5},
        "checkpoint": {"uri": uri, "every_steps": 10, "keep": 2},
        "budget": {"max_usd": 1.0, "max_hours": 1},
        "recovery": {"poll_seconds": 0.5, "backoff_seconds": 0, "heartbeat_timeout_seconds": 120},
    }


def group_alive(pgid: int) -> bool:
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                st = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(st[2]) == pgid and st[0] != "Z":
                return True
    return False


def run(spec_dict: dict, kill_at_steps: tuple[int, ...] = ()) -> tuple[Controller, list[int]]:
    spec = parse_spec(spec_dict)
    store = StateStore()
    pgids: list[int] = []
    kills: list[int] = []

    def on_tick(ctl: Controller) -> None:
        att = ctl.current_attempt()
        nodes = ctl.store.nodes(ctl.name, live_only=True)
        for nd in nodes:
            pg = nd["handle"]["data"].get("pgid")
            if pg and pg not in pgids:
                pgids.append(pg)
        if len(kills) >= len(kill_at_steps) or ctl.state != "RUNNING" or not att:
            return
        p = ctl.progress or {}
        if p.get("attempt") == att["n"] and (p.get("step") or 0) >= kill_at_steps[len(kills)]:
            pg = [nd["handle"]["data"]["pgid"] for nd in nodes if nd["attempt"] == att["n"]][0]
            os.killpg(pg, signal.SIGKILL)  # what a spot reclaim looks like from inside the node
            kills.append(p["step"])

    ctl = Controller(spec, store)
    ctl.run(on_tick=on_tick)
    assert len(kills) == len(kill_at_steps), kills
    return ctl, pgids


@pytest.mark.e2e  # a whole fault/resume scenario with the real trainer: `make e2e`
@pytest.mark.timeout(600)
def test_sigkill_twice_resumes_bit_identical_on_s3(dtrun_home, tmp_path, s3_bucket):
    plain, pg1 = run(job(f"file://{tmp_path}/plain", "e2e-plain"))
    assert plain.state == "SUCCEEDED"
    done_plain = runuri.read_json(runuri.join(plain.run_uri, runuri.DONE))
    assert done_plain["step"] == 80 and done_plain["param_digest"]

    uri = f"{s3_bucket}/runs/e2e-killed"
    killed, pg2 = run(job(uri, "e2e-killed"), kill_at_steps=(25, 55))
    assert killed.state == "SUCCEEDED", killed.job()["reason"]
    atts = killed.store.attempts("e2e-killed")
    assert [a["outcome"] for a in atts] == ["preempted", "preempted", "succeeded"]
    assert atts[1]["start_step"] is not None and atts[1]["start_step"] >= 10
    assert atts[2]["start_step"] > atts[1]["start_step"]
    done = runuri.read_json(runuri.join(uri, runuri.DONE))
    assert done["step"] == 80
    assert done["param_digest"] == done_plain["param_digest"]  # bit-identical final parameters
    # Work lost to each kill = the step the controller last saw − the checkpoint the next attempt
    # resumed from (0 when a kill lands right after a commit, so the total is not asserted > 0).
    expected_lost = sum(max(0, (atts[i]["end_step"] or 0) - (atts[i + 1]["start_step"] or 0)) for i in range(2))
    assert killed.job()["steps_lost"] == expected_lost
    assert runuri.read_json(runuri.join(uri, runuri.LEASE))["controller"].startswith(f"{os.getpid()}@")
    assert runuri.exists(runuri.join(uri, "job.yaml"))
    assert not any(group_alive(pg) for pg in pg1 + pg2)
    assert all(n["terminated_at"] for n in killed.store.nodes("e2e-killed"))


@pytest.mark.timeout(300)
def test_trainer_crash_restarts_then_fails_with_reason(dtrun_home, tmp_path, monkeypatch):
    # a trainer that crashes (exit 1) under real torchrun: the bootstrap tests' stand-in
    monkeypatch.setenv("DTRUN_TRAINER_MODULE", "fake_node_trainer")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO / "tests" / "fakes"), str(REPO)]))
    monkeypatch.setenv("FAKE_MODE", "exit=1")
    d = job(f"file://{tmp_path}/crash", "e2e-crash")
    d["trainer"]["parallel"] = {"dp_shard": 1}
    d["resources"]["gpus_per_node"] = 1
    d["recovery"]["max_restarts_on_errors"] = 1
    ctl, pgids = run(d)
    assert ctl.state == "FAILED"
    reason = ctl.job()["reason"]
    assert "the trainer failed (2 failures, recovery.max_restarts_on_errors = 1)" in reason
    assert "last trainer log lines" in reason and "exited 1" in reason
    assert [a["outcome"] for a in ctl.store.attempts("e2e-crash")] == ["failed", "failed"]
    assert ctl.job()["restarts_used"] == 2
    assert not any(group_alive(pg) for pg in pgids)
