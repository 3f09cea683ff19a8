"""The laptop test on the Lambda lab: a real ``dtrun server`` process (SQLite database; its HOME the
lab's, where SkyPilot reads the Lambda keys) runs the job; the team's S3 credentials are a team
secret (``dtrun server admin secret set alpha aws``), the only S3 keys the nodes get. The CLI
submits ``up --yes`` with its own ``DTRUN_HOME`` and exits; that home is deleted. After a
COMMITTED checkpoint the lab node is preempted (killed, gone from Lambda's list, billing ends);
the server relaunches on its own, the trainer resumes, and a new CLI home with the same token sees
the job finished after two attempts (preempted, succeeded), its final parameters bit-identical to
an uninterrupted local run of the same trainer section, the money booked within the lab's bill,
and nothing left in the lab."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.clouds.lambdalab import lab as lablib
from tests.e2e.lambda_cloud.conftest import check_money, job_yaml, progress, step, wait_until
from tests.orchestrator.server.laptop import (
    ROOT, dtrun, laptop, running_server, wait_server_state,
)

STEPS = 300


def _booked(database: str, name: str) -> dict:
    """What the server's controllers booked, per attempt (``dtrun cost --json``'s embedded rows),
    read from the controllers' state store in the server's database."""
    from orchestrator.cli.money import job_cost
    from orchestrator.server.ctlstore import CtlStore
    from orchestrator.server.db import make_engine

    engine = make_engine(database)
    store = CtlStore(engine)
    try:
        return job_cost(store, store.get_job(name))
    finally:
        store.close()
        engine.dispose()

pytestmark = pytest.mark.timeout(2400)  # a launch takes minutes on 2 shared cores


def test_server_recovers_a_preempted_lab_node_with_the_laptop_gone(lab, s3_lab, tmp_path):
    # the server's machine: the lab (Lambda keys in HOME), and the server's own S3 access for the
    # controller's reads of the run URI; no DTRUN_ variable of this test process but the lab's
    env = {k: v for k, v in lab.items() if not k.startswith("DTRUN_") or k.startswith("DTRUN_LAB_")}
    server_env = env | s3_lab["env"]
    cli_base = {k: v for k, v in env.items() if not k.startswith("AWS_")}  # the laptop has no S3 keys
    name = "lab-srv"
    job = job_yaml(tmp_path, name, s3_lab["bucket"], steps=STEPS, every=25)
    local = job_yaml(tmp_path, "lab-srv-local", "", steps=STEPS, every=25, provider="local",
                     uri=f"file://{tmp_path}/local-run")
    local.write_text(local.read_text().replace("gpu: H100-SXM", "gpu: cpu"))
    ref = None
    with running_server(tmp_path, f"sqlite:///{tmp_path / 'server.db'}", server_env, aws=s3_lab["env"]) as srv:
        try:
            cli = laptop(tmp_path, cli_base, srv, "laptop-a")
            t0 = time.time()
            r = dtrun(["up", str(job), "--yes"], cli)
            assert "submitted to the server" in r.stdout, r.stdout
            assert not (Path(cli["DTRUN_HOME"]) / "state.db").exists()
            shutil.rmtree(cli["DTRUN_HOME"])  # the laptop is closed for good

            wait_until(lambda: [k for k in s3_lab["keys"](f"{name}/checkpoints/") if k.endswith("/COMMITTED")],
                       1500, "no COMMITTED checkpoint from the lab node", every=2)
            [inst] = [i for i in lablib.call("status")["instances"] if i["name"].startswith(f"dtrun-{name}-a1")]
            at_step = step(s3_lab, name)
            assert at_step < STEPS and not s3_lab["exists"](f"{name}/DONE")
            t_pre = time.time()
            assert lablib.call("preempt", {"name": inst["name"]})["preempted"] == [inst["name"]]
            # the uninterrupted reference on this machine (local provider, 2 CPU ranks), meanwhile
            ref = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "up", str(local), "--yes"], cwd=ROOT,
                                   env=env | {"HOME": str(tmp_path), "DTRUN_HOME": str(tmp_path / "ref-home")},
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                   start_new_session=True)
            wait_until(lambda: progress(s3_lab, name).get("attempt", 1) >= 2 and progress(s3_lab, name).get("step"),
                       1500, "no step from a second attempt", every=2)
            resumed_s = time.time() - t_pre

            other = laptop(tmp_path, cli_base, srv, "laptop-b")  # another laptop, same token
            st = wait_server_state(other, name, "finished", 1500)
            total_s = time.time() - t0
            assert st["attempt"] == 2, st
            cost = json.loads(dtrun(["cost", name, "--json"], other).stdout)
            assert [(a["attempt"], a["provider"], a["outcome"]) for a in cost["attempts"]] == \
                [(1, "lambda", "preempted"), (2, "lambda", "succeeded")], cost
            out, _ = ref.communicate(timeout=1200)
            assert ref.returncode == 0, out[-3000:]
        finally:
            if ref is not None and ref.poll() is None:
                os.killpg(ref.pid, signal.SIGKILL)
                ref.communicate()
        booked = _booked(srv["database"], name)
    assert srv["proc"].poll() is not None
    assert {a["attempt"]: round(a["usd"], 6) for a in cost["attempts"]} == \
        {a["attempt"]: round(a["usd"], 6) for a in booked["attempts"]}, (cost, booked)
    done = json.loads(s3_lab["get"](f"{name}/DONE"))
    want = json.loads((tmp_path / "local-run" / "DONE").read_text())
    assert done["step"] == STEPS and done["param_digest"] == want["param_digest"], (done, want)

    wait_until(lambda: not lablib.call("status")["instances"], 120, "the lab still lists an instance")
    rows = [r for r in lablib.call("bill")["instances"] if r["name"].startswith(f"dtrun-{name}-")]
    assert [r["how"] for r in sorted(rows, key=lambda r: r["start"])] == ["preempted", "terminated"], rows
    check_money(booked, rows)
    assert srv["token"] not in srv["log"].read_text()
    print(f"laptop test (Lambda lab): preempted at step {at_step}; attempt 2 trained again {resumed_s:.0f} s "
          f"after the preemption; finished {total_s:.0f} s after submit")
