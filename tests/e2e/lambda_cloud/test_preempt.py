"""Preemption on the lab: the instance vanishes mid-run (`preempt`: killed, gone from Lambda's
list, billing ends) → dtrun notices, books the attempt as preempted, launches a new cluster,
resumes from the last COMMITTED step and finishes with parameters bit-identical to an
uninterrupted local run of the same trainer section (the trainer's DONE ``param_digest``)."""

from __future__ import annotations

import json
import time

import pytest

from tests.e2e import phases as phaselib
from tests.e2e.lambda_cloud.conftest import (
    check_money, dtrun, dtrun_up_running, job_yaml, step, wait_for_next_attempt, wait_until,
)
from tests.e2e.clouds.lambdalab import lab as lablib

STEPS = 300

pytestmark = pytest.mark.timeout(2400)  # a launch takes minutes on 2 shared cores


def test_preempt_resumes_bit_identical(lab, s3_lab, tmp_path):
    env = {**lab, **s3_lab["env"], "DTRUN_HOME": str(tmp_path / "dtrun-home")}
    name = "lab-pre"
    job = job_yaml(tmp_path, name, s3_lab["bucket"], steps=STEPS, every=25)
    with dtrun_up_running(job, env) as proc:
        # mid-run, after a committed checkpoint
        wait_until(lambda: step(s3_lab, name) >= 30, 1500, "no step 30 on the lab node")
        [inst] = [i for i in lablib.call("status")["instances"] if i["name"].startswith(f"dtrun-{name}-a1")]
        at_step = step(s3_lab, name)
        t_pre = time.time()
        watch = phaselib.ProgressWatch(s3_lab["get"], name).__enter__()
        assert lablib.call("preempt", {"name": inst["name"]})["preempted"] == [inst["name"]]
        wait_for_next_attempt(s3_lab, name, 1500)  # the next attempt trains again
        resumed_after = time.time() - t_pre
        wait_until(lambda: 2 in watch.stepped or proc.poll() is not None, 600, "no second step of attempt 2")
        watch.__exit__()
        out, _ = proc.communicate(timeout=1500)
    assert proc.returncode == 0, out[-4000:]
    st = json.loads(dtrun(["status", name, "--json"], env).stdout)
    assert st["state"] == "SUCCEEDED" and st["attempts_total"] == 2, st
    cost = json.loads(dtrun(["cost", name, "--json"], env).stdout)
    outcomes = [a["outcome"] for a in sorted(cost["attempts"], key=lambda a: a["attempt"])]
    assert outcomes == ["preempted", "succeeded"], cost["attempts"]
    done = json.loads(s3_lab["get"](f"{name}/DONE"))
    assert done["step"] == STEPS

    wait_until(lambda: not lablib.call("status")["instances"], 120, "the lab still lists an instance")
    rows = [r for r in lablib.call("bill")["instances"] if r["name"].startswith(f"dtrun-{name}-")]
    assert [r["how"] for r in sorted(rows, key=lambda r: r["start"])] == ["preempted", "terminated"], rows
    check_money(cost, rows)
    ph = phaselib.phases(env["DTRUN_HOME"], name, t_pre, watch, env["HOME"],
                         instance_start=sorted(rows, key=lambda r: r["start"])[1]["start"])
    phaselib.report("lambda", ph)
    assert set(phaselib.REQUIRED) <= set(ph["marks"]), ph  # every phase was seen on the lab
    assert list(ph["marks"].values()) == sorted(ph["marks"].values()), ph  # in the order the design says

    # the same trainer section, uninterrupted, on this machine (local provider, 2 CPU ranks)
    local = job_yaml(tmp_path, "lab-pre-local", "", steps=STEPS, every=25, provider="local",
                     uri=f"file://{tmp_path}/local-run")
    text = local.read_text().replace("gpu: H100-SXM", "gpu: cpu")
    local.write_text(text)
    dtrun(["up", str(local), "--yes"], {**env, "HOME": str(tmp_path)}, timeout=900)
    ref = json.loads((tmp_path / "local-run" / "DONE").read_text())
    assert done["param_digest"] == ref["param_digest"], (done, ref)  # bit-identical final parameters
    print(f"preempted at step {at_step}; a step of attempt 2 seen {resumed_after:.0f} s after the preemption")
