"""The laptop test, on this machine: a job submitted through the CLI to a real ``dtrun server``
process (PostgreSQL), the CLI's process gone and its ``DTRUN_HOME`` deleted; once a COMMITTED
checkpoint exists the node (the local provider's process group, real torchrun + the bundled
trainer) is SIGKILLed — a preemption; the server relaunches on its own, the trainer resumes from
the checkpoint, and a *new* CLI home with the same token sees the job finished after two attempts
(preempted, succeeded), with final parameters bit-identical (DONE's ``param_digest``) to an
uninterrupted embedded run of the same trainer section. The server is stopped after; no process
of the job is left."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.orchestrator.server.laptop import (
    ROOT, clean_env, dtrun, laptop, running_server, server_status, wait_server_state,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]

STEPS = 200
JOB = """\
name: {name}
resources: {{providers: [local], gpu: cpu, gpus_per_node: 1}}
trainer: {{model: tiny, steps: {steps}, batch_size: 8, seq_len: 64, precision: fp32, lr: 0.003,
          warmup_steps: 5, log_every: 10, heartbeat_seconds: 0.5}}
checkpoint: {{uri: '{uri}', every_steps: 20, keep: 2}}
budget: {{max_usd: 1.0, max_hours: 1}}
recovery: {{poll_seconds: 1, backoff_seconds: 0, heartbeat_timeout_seconds: 300}}
"""


def _group_alive(pgid: int) -> bool:
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                st = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(st[2]) == pgid and st[0] != "Z":
                return True
    return False


def _progress(run: Path) -> dict:
    try:
        return json.loads((run / "progress.json").read_text())
    except (OSError, ValueError):
        return {}


def _wait(pred, timeout: float, what: str, every: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(every)
    raise AssertionError(f"after {timeout:.0f} s: {what}")


def _nodes(server_home: Path, name: str) -> list[dict]:
    """The local provider's records of the job's nodes on the server's machine."""
    try:
        reg = json.loads((server_home / "local" / "instances.json").read_text())
    except (OSError, ValueError):
        return []
    return sorted((r for r in reg["instances"].values() if re.fullmatch(f"dtrun-{name}-a[0-9]+", r["name"])),
                  key=lambda r: r["created_at"])


def test_laptop_closed_local(pg_url, tmp_path):
    env = clean_env()
    name = "laptop1"
    run = tmp_path / "runs" / name
    job = tmp_path / "job.yaml"
    job.write_text(JOB.format(name=name, steps=STEPS, uri=f"file://{run}"))
    ref_job = tmp_path / "ref.yaml"
    ref_run = tmp_path / "runs" / "ref"
    ref_job.write_text(JOB.format(name="laptop1-ref", steps=STEPS, uri=f"file://{ref_run}"))
    ref = None
    with running_server(tmp_path, pg_url, env) as srv:
        try:
            cli = laptop(tmp_path, env, srv, "laptop-a")
            t0 = time.time()
            r = dtrun(["up", str(job), "--yes"], cli)  # the CLI process exits here
            assert "submitted to the server" in r.stdout, r.stdout
            assert not (Path(cli["DTRUN_HOME"]) / "state.db").exists()  # nothing runs on the laptop
            shutil.rmtree(cli["DTRUN_HOME"])  # the laptop is closed for good

            # the server's replica launched the node; a checkpoint is committed
            committed = _wait(lambda: sorted(run.glob("checkpoints/step-*/COMMITTED")), 600,
                              "no COMMITTED checkpoint from the server's node")
            [a1] = _wait(lambda: [n for n in _nodes(srv["home"], name) if n["name"].endswith("-a1")], 30, "no node record")
            at = _progress(run)
            assert not (run / "DONE").exists() and (at.get("step") or 0) < STEPS, at
            t_kill = time.time()
            os.killpg(int(a1["pgid"]), signal.SIGKILL)  # the spot node is reclaimed
            _wait(lambda: not _group_alive(int(a1["pgid"])), 30, "the killed node's group is still alive")
            # the uninterrupted reference, embedded on this machine, while the server recovers
            ref = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "up", str(ref_job), "--yes"], cwd=ROOT,
                                   env=env | {"DTRUN_HOME": str(tmp_path / "ref-home")}, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, start_new_session=True)

            # the server relaunches on its own and the trainer resumes from the checkpoint
            p2 = _wait(lambda: (p := _progress(run)).get("attempt", 1) >= 2 and p.get("step") and p, 600,
                       "no step from a second attempt")
            resumed_s = time.time() - t_kill
            last_committed = int(committed[-1].parent.name.split("-")[1])
            assert p2["step"] >= last_committed, (p2, last_committed)  # resumed, not restarted from 0

            other = laptop(tmp_path, env, srv, "laptop-b")  # another laptop, same token
            st = wait_server_state(other, name, "finished", 900)
            total_s = time.time() - t0
            assert st["attempt"] == 2 and st["spend_usd"] == 0.0, st
            cost = json.loads(dtrun(["cost", name, "--json"], other).stdout)
            assert [(a["attempt"], a["outcome"]) for a in cost["attempts"]] == [(1, "preempted"), (2, "succeeded")], cost
            assert cost["state"] == "finished", cost
            kinds = [ln.split(" ", 2)[2] for ln in dtrun(["logs", name], other).stdout.splitlines()]
            assert kinds[0] == "state: queued" and kinds[-1].startswith("state: finished"), kinds

            out, _ = ref.communicate(timeout=900)
            assert ref.returncode == 0, out[-3000:]
        finally:
            if ref is not None and ref.poll() is None:
                os.killpg(ref.pid, signal.SIGKILL)
                ref.communicate()
        done = json.loads((run / "DONE").read_text())
        want = json.loads((ref_run / "DONE").read_text())
        assert done["step"] == STEPS and done["param_digest"] == want["param_digest"], (done, want)
        nodes = _nodes(srv["home"], name)
        assert len(nodes) == 2, nodes
    assert srv["proc"].poll() is not None
    assert not any(_group_alive(int(n["pgid"])) for n in nodes)  # no node of the job is left
    assert srv["token"] not in srv["log"].read_text()
    print(f"laptop test (local): killed at step {at.get('step')} (COMMITTED {last_committed}); attempt 2 "
          f"trained again {resumed_s:.0f} s after the kill (step {p2['step']}); finished {total_s:.0f} s after submit")
