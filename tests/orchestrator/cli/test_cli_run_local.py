"""`dtrun up/status/ls/logs/down` as a user runs them: real processes, the local provider, the real
node bootstrap, no terminal. The trainer is the bootstrap tests' stand-in (no torch) so these run
in seconds; the real trainer under torchrun is in test_e2e_local_*.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
DTRUN = [sys.executable, "-m", "orchestrator.cli"]
FAKE_TRAINER = REPO / "tests" / "fakes" / "fake_node_trainer.py"

JOB = """\
name: clijob
resources: {providers: [local], gpu: cpu, gpus_per_node: 1}
trainer: {model: tiny, steps: 40, batch_size: 2, seq_len: 16, precision: fp32}
checkpoint: {uri: "./runs/{name}", every_steps: 10}
budget: {max_usd: 1.0, max_hours: 1}
recovery: {poll_seconds: 0.5, backoff_seconds: 0.2, heartbeat_timeout_seconds: 60}
"""


@pytest.fixture
def env(tmp_path):
    (tmp_path / "job.yaml").write_text(JOB)
    e = dict(os.environ)
    e.update(DTRUN_HOME=str(tmp_path / "home"), DTRUN_TRAINER_CMD=f"{sys.executable} {FAKE_TRAINER}",
             FAKE_STEPS="40", FAKE_STEP_SECONDS="0.05", PYTHONPATH=str(REPO), DTRUN_WATCHDOG_SECONDS="1")
    e.pop("AWS_SECRET_ACCESS_KEY", None)
    return e


def dtrun(env, tmp_path, *args, timeout=120, check_rc=None):
    p = subprocess.run(DTRUN + list(args), cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=timeout, stdin=subprocess.DEVNULL)
    if check_rc is not None:
        assert p.returncode == check_rc, (p.returncode, p.stdout[-3000:], p.stderr[-3000:])
    return p


def status(env, tmp_path, name="clijob"):
    return json.loads(dtrun(env, tmp_path, "status", name, "--json", check_rc=0).stdout)


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    # zombies of a reaped group do not count
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                st = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(st[2]) == pgid and st[0] != "Z":
                return True
    return False


def wait_for(pred, timeout=30.0, what="condition"):
    end = time.time() + timeout
    while time.time() < end:
        v = pred()
        if v:
            return v
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_up_without_a_terminal_needs_yes(env, tmp_path):
    p = dtrun(env, tmp_path, "up", "job.yaml", check_rc=2)
    assert "pass --yes" in p.stderr and "Traceback" not in p.stderr
    assert json.loads(dtrun(env, tmp_path, "ls", "--json", check_rc=0).stdout) == {"jobs": []}


def test_up_runs_to_succeeded_and_reports(env, tmp_path):
    p = dtrun(env, tmp_path, "up", "job.yaml", "--yes", check_rc=0)
    assert "SUCCEEDED: wall" in p.stdout and "1 attempt(s)" in p.stdout
    assert "\x1b[" not in p.stdout.split("Budget:")[-1]  # plain lines without a terminal
    st = status(env, tmp_path)
    assert st["state"] == "SUCCEEDED" and st["step"] == 40 and st["attempts"] == 1
    assert st["cost_usd"] == 0.0 and st["controller_pid"] is None
    node = st["nodes"][0]
    assert node["provider"] == "local" and node["state"] == "TERMINATED" and node["pid"] and node["pgid"]
    assert not group_alive(node["pgid"])
    assert (tmp_path / "runs" / "clijob" / "job.yaml").exists()
    assert json.loads(dtrun(env, tmp_path, "ls", "--json", check_rc=0).stdout)["jobs"][0]["name"] == "clijob"
    logs = dtrun(env, tmp_path, "logs", "clijob", check_rc=0).stdout
    assert "trainer exited 0" in logs and "[state] SUCCEEDED" in logs
    # again: already finished, nothing rented
    p = dtrun(env, tmp_path, "up", "job.yaml", "--yes", check_rc=0)
    assert "already finished" in p.stdout
    assert status(env, tmp_path)["attempts_total"] == 1


def test_unknown_job_is_exit_6(env, tmp_path):
    for cmd in (["status", "nope"], ["down", "nope"], ["logs", "nope"]):
        p = dtrun(env, tmp_path, *cmd, check_rc=6)
        assert "no job named 'nope'" in p.stderr and "Traceback" not in p.stderr


def test_detach_status_down_graceful(env, tmp_path):
    env["FAKE_STEPS"] = "100000"
    p = dtrun(env, tmp_path, "up", "job.yaml", "--yes", "--detach", check_rc=0)
    assert "controller running in the background" in p.stdout
    st = wait_for(lambda: (s := status(env, tmp_path))["state"] == "RUNNING" and (s["step"] or 0) > 5 and s,
                  what="RUNNING")
    assert st["controller_pid"] and st["nodes"][0]["pid"]
    pgid = st["nodes"][0]["pgid"]
    p = dtrun(env, tmp_path, "down", "clijob", check_rc=0)
    assert "CANCELLED" in p.stdout
    st = status(env, tmp_path)
    assert st["state"] == "CANCELLED" and st["controller_pid"] is None
    # graceful: STOP honoured with a committed checkpoint at the step reached
    committed = sorted(int(d.name.split("-")[1]) for d in (tmp_path / "runs/clijob/checkpoints").iterdir()
                       if (d / "COMMITTED").exists())
    assert committed and committed[-1] >= st["step"] - 1
    assert not group_alive(pgid)
    # up again: a new session continues from the checkpoint instead of starting over
    env["FAKE_STEPS"] = str(committed[-1] + 20)
    p = dtrun(env, tmp_path, "up", "job.yaml", "--yes", check_rc=0)
    assert f"has a checkpoint at step {committed[-1]}" in p.stdout and "SUCCEEDED" in p.stdout
    st = status(env, tmp_path)
    assert st["attempts"] == 1 and st["attempts_total"] == 2 and st["step"] == committed[-1] + 20
    logs = dtrun(env, tmp_path, "logs", "clijob", "-f", timeout=30, check_rc=0).stdout
    assert "[state] CANCELLED" in logs and "[state] SUCCEEDED" in logs


def test_killed_controller_then_up_reattaches_then_down_now_without_controller(env, tmp_path):
    env["FAKE_STEPS"] = "100000"
    dtrun(env, tmp_path, "up", "job.yaml", "--yes", "--detach", check_rc=0)
    st = wait_for(lambda: (s := status(env, tmp_path))["state"] == "RUNNING" and s, what="RUNNING")
    os.kill(st["controller_pid"], signal.SIGKILL)
    wait_for(lambda: status(env, tmp_path)["controller_pid"] is None, what="controller gone")
    node = st["nodes"][0]
    assert group_alive(node["pgid"])  # the node keeps training without its controller
    # up again: re-attaches to the same node instead of launching another
    dtrun(env, tmp_path, "up", "job.yaml", "--yes", "--detach", check_rc=0)
    st2 = wait_for(lambda: (s := status(env, tmp_path))["controller_pid"] and s, what="new controller")
    assert st2["attempts_total"] == 1 and st2["nodes"][0]["instance_id"] == node["instance_id"]
    os.kill(st2["controller_pid"], signal.SIGKILL)
    wait_for(lambda: status(env, tmp_path)["controller_pid"] is None, what="controller gone")
    # down --now with no controller alive acts directly and confirms the node gone
    p = dtrun(env, tmp_path, "down", "clijob", "--now", check_rc=0)
    assert "no controller is running" in p.stdout
    st3 = status(env, tmp_path)
    assert st3["state"] == "CANCELLED" and st3["nodes"][0]["state"] == "TERMINATED"
    assert not group_alive(node["pgid"])


def test_ctrl_c_without_a_terminal_tears_down_gracefully(env, tmp_path):
    env["FAKE_STEPS"] = "100000"
    p = subprocess.Popen(DTRUN + ["up", "job.yaml", "--yes"], cwd=tmp_path, env=env, stdin=subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        st = wait_for(lambda: (r := dtrun(env, tmp_path, "status", "clijob", "--json")).returncode == 0
                      and (s := json.loads(r.stdout))["state"] == "RUNNING" and (s["step"] or 0) > 3 and s,
                      what="RUNNING")
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 1, (out[-2000:], err[-2000:])
    assert "tearing down gracefully" in out and "CANCELLED" in out
    st2 = status(env, tmp_path)
    assert st2["state"] == "CANCELLED" and st2["nodes"][0]["state"] == "TERMINATED"
    assert (tmp_path / "runs/clijob/checkpoints").exists()
    assert not group_alive(st["nodes"][0]["pgid"])
