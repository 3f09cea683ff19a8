"""What happens to a run when its controller's process is signalled: a real ``dtrun up`` on the
local provider with the torch-free stand-in trainer (tests/fakes/fake_node_trainer.py).

SIGHUP (the terminal was closed) hands the run to a detached controller; SIGTERM tears it down and
says SIGTERM; a detached controller that is signalled exits and says so; ``status`` says when no
controller watches an active run. Every exit is an event: ``controller_exit`` when the run goes on
without that controller, ``controller_done`` when its job reached a final state."""

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
name: sigjob
resources: {providers: [local], gpu: cpu, gpus_per_node: 1}
trainer: {model: tiny, steps: 100000, batch_size: 2, seq_len: 16, precision: fp32}
checkpoint: {uri: "./runs/{name}", every_steps: 10}
budget: {max_usd: 1.0, max_hours: 1}
recovery: {poll_seconds: 0.5, backoff_seconds: 0.2, heartbeat_timeout_seconds: 60}
"""

# a whole signal scenario each (a real `dtrun up`, its bootstrap and trainer processes, a pty): `make e2e`
pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture
def env(tmp_path):
    (tmp_path / "job.yaml").write_text(JOB)
    e = dict(os.environ)
    e.update(DTRUN_HOME=str(tmp_path / "home"), DTRUN_TRAINER_CMD=f"{sys.executable} {FAKE_TRAINER}",
             FAKE_STEPS="100000", FAKE_STEP_SECONDS="0.05", PYTHONPATH=str(REPO), DTRUN_WATCHDOG_SECONDS="1")
    e.pop("AWS_SECRET_ACCESS_KEY", None)
    return e


@pytest.fixture
def reaper():
    """Pids and process groups a test started; whatever is still alive at its end is killed."""
    pids: list[int] = []
    groups: list[int] = []
    yield pids, groups
    for pgid in groups:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def dtrun(env, tmp_path, *args, timeout=120, check_rc=None):
    p = subprocess.run(DTRUN + list(args), cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=timeout, stdin=subprocess.DEVNULL)
    if check_rc is not None:
        assert p.returncode == check_rc, (p.returncode, p.stdout[-3000:], p.stderr[-3000:])
    return p


def status(env, tmp_path):
    return json.loads(dtrun(env, tmp_path, "status", "sigjob", "--json", check_rc=0).stdout)


def events(env, tmp_path, type_="controller_exit"):
    out = dtrun(env, tmp_path, "logs", "sigjob", check_rc=0).stdout
    return [line for line in out.splitlines() if f"[{type_}]" in line]


def wait_for(pred, timeout=45.0, what="condition"):
    end = time.time() + timeout
    while time.time() < end:
        v = pred()
        if v:
            return v
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                st = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(st[2]) == pgid and st[0] != "Z":
                return True
    return False


def foreground_running(env, tmp_path, reaper):
    """A foreground ``dtrun up`` (no terminal) whose node is RUNNING past step 3: (process, status)."""
    p = subprocess.Popen(DTRUN + ["up", "job.yaml", "--yes"], cwd=tmp_path, env=env, stdin=subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    reaper[0].append(p.pid)

    def running():
        r = dtrun(env, tmp_path, "status", "sigjob", "--json")
        s = json.loads(r.stdout) if r.returncode == 0 else {}
        return s.get("state") == "RUNNING" and (s.get("step") or 0) > 3 and s

    st = wait_for(running, what="RUNNING")
    reaper[1].append(st["nodes"][0]["pgid"])
    return p, st


def test_sighup_hands_the_run_to_a_detached_controller(env, tmp_path, reaper):
    p, st = foreground_running(env, tmp_path, reaper)
    assert st["controller_pid"] == p.pid
    p.send_signal(signal.SIGHUP)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, (out[-2000:], err[-2000:])
    st2 = status(env, tmp_path)
    new = st2["controller_pid"]
    assert new and new != p.pid and st2["watched"] is True and st2["state"] == "RUNNING"
    reaper[0].append(new)
    exits = events(env, tmp_path)
    assert any("SIGHUP" in e and f"detached controller (pid {new})" in e for e in exits), exits
    # the same node goes on, watched by the new controller: the step advances, nothing relaunched
    step = st2["step"]
    st3 = wait_for(lambda: (s := status(env, tmp_path))["step"] > step + 5 and s, what="progress")
    assert st3["attempts_total"] == 1 and st3["nodes"][0]["instance_id"] == st["nodes"][0]["instance_id"]
    assert st3["controller_pid"] == new
    dtrun(env, tmp_path, "down", "sigjob", check_rc=0)
    st4 = status(env, tmp_path)
    assert st4["state"] == "CANCELLED" and st4["controller_pid"] is None
    assert not group_alive(st["nodes"][0]["pgid"])
    assert any("finished: CANCELLED" in e for e in events(env, tmp_path, "controller_done"))


def test_sigterm_tears_down_and_says_sigterm(env, tmp_path, reaper):
    p, st = foreground_running(env, tmp_path, reaper)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 1, (out[-2000:], err[-2000:])
    st2 = status(env, tmp_path)
    assert st2["state"] == "CANCELLED" and st2["nodes"][0]["state"] == "TERMINATED"
    assert "SIGTERM" in st2["reason"] and "dtrun down" not in st2["reason"]
    assert any("SIGTERM" in e for e in events(env, tmp_path, "cancel"))
    assert any("finished: CANCELLED" in e for e in events(env, tmp_path, "controller_done"))
    assert not group_alive(st["nodes"][0]["pgid"])


def test_status_says_when_no_controller_watches(env, tmp_path, reaper):
    dtrun(env, tmp_path, "up", "job.yaml", "--yes", "--detach", check_rc=0)
    st = wait_for(lambda: (s := status(env, tmp_path))["state"] == "RUNNING" and s["controller_pid"] and s,
                  what="RUNNING")
    reaper[0].append(st["controller_pid"])
    reaper[1].append(st["nodes"][0]["pgid"])
    assert st["watched"] is True
    # a signalled detached controller exits, leaves the node running, and says so
    os.kill(st["controller_pid"], signal.SIGTERM)
    wait_for(lambda: status(env, tmp_path)["controller_pid"] is None, what="controller gone")
    assert any("exited on SIGTERM" in e for e in events(env, tmp_path))
    st2 = status(env, tmp_path)
    assert st2["watched"] is False and st2["state"] == "RUNNING" and group_alive(st["nodes"][0]["pgid"])
    text = dtrun(env, tmp_path, "status", "sigjob", check_rc=0).stdout
    assert "no controller watches this run" in text
    # a killed one (no chance to say anything): status still says the run is unwatched, and whose pid is gone
    dtrun(env, tmp_path, "up", "job.yaml", "--yes", "--detach", check_rc=0)
    st3 = wait_for(lambda: (s := status(env, tmp_path))["controller_pid"] and s, what="new controller")
    reaper[0].append(st3["controller_pid"])
    os.kill(st3["controller_pid"], signal.SIGKILL)
    wait_for(lambda: status(env, tmp_path)["controller_pid"] is None, what="controller killed")
    st4 = status(env, tmp_path)
    assert st4["watched"] is False and st4["gone_controller_pid"] == st3["controller_pid"]
    text = dtrun(env, tmp_path, "status", "sigjob", check_rc=0).stdout
    assert f"no controller watches this run (controller pid {st3['controller_pid']} is gone)" in text
    dtrun(env, tmp_path, "down", "sigjob", "--now", check_rc=0)
    assert not group_alive(st["nodes"][0]["pgid"])


def test_closing_a_real_terminal_hands_the_run_over(env, tmp_path, reaper):
    """The same on a pseudo-terminal (the rich live view): closing its master side is the hang-up
    the kernel sends a closed terminal's session; writes to it fail from then on."""
    import pty
    import select

    env["TERM"] = "xterm"
    pid, fd = pty.fork()
    if pid == 0:  # the child: `dtrun up` with the pty as its controlling terminal
        os.chdir(tmp_path)
        os.execve(sys.executable, DTRUN + ["up", "job.yaml", "--yes"], env)
    reaper[0].append(pid)
    try:
        def running():
            while select.select([fd], [], [], 0)[0]:
                try:
                    os.read(fd, 65536)  # keep the terminal drained
                except OSError:
                    break
            r = dtrun(env, tmp_path, "status", "sigjob", "--json")
            s = json.loads(r.stdout) if r.returncode == 0 else {}
            return s.get("state") == "RUNNING" and (s.get("step") or 0) > 3 and s

        st = wait_for(running, what="RUNNING")
        reaper[1].append(st["nodes"][0]["pgid"])
        assert st["controller_pid"] == pid
    finally:
        os.close(fd)  # hang up
    _, code = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(code) == 0
    st2 = status(env, tmp_path)
    assert st2["state"] == "RUNNING" and st2["controller_pid"] not in (None, pid) and st2["watched"] is True
    reaper[0].append(st2["controller_pid"])
    assert any("SIGHUP" in e and f"(pid {st2['controller_pid']})" in e for e in events(env, tmp_path))
    log = (tmp_path / "home" / "logs" / "sigjob" / "controller.log").read_text()
    assert f"sigjob: detached; controller pid {st2['controller_pid']}" in log  # said where it can be read
    dtrun(env, tmp_path, "down", "sigjob", check_rc=0)
    assert status(env, tmp_path)["state"] == "CANCELLED" and not group_alive(st["nodes"][0]["pgid"])


def _up_on_a_pty(env, tmp_path, reaper):
    """``dtrun up`` with a pseudo-terminal as its controlling terminal, RUNNING past step 3:
    (pid, master fd, status, read) — ``read()`` drains the terminal and returns all it printed."""
    import pty
    import select

    env["TERM"] = "xterm"
    pid, fd = pty.fork()
    if pid == 0:
        os.chdir(tmp_path)
        os.execve(sys.executable, DTRUN + ["up", "job.yaml", "--yes"], env)
    reaper[0].append(pid)
    seen = bytearray()

    def read() -> str:
        while select.select([fd], [], [], 0)[0]:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            seen.extend(chunk)
        return seen.decode(errors="replace")

    def running():
        read()
        r = dtrun(env, tmp_path, "status", "sigjob", "--json")
        s = json.loads(r.stdout) if r.returncode == 0 else {}
        return s.get("state") == "RUNNING" and (s.get("step") or 0) > 3 and s

    st = wait_for(running, what="RUNNING")
    reaper[1].append(st["nodes"][0]["pgid"])
    return pid, fd, st, read


def test_ctrl_c_on_a_terminal_detach_and_tear_down_say_what_happened(env, tmp_path, reaper):
    pid, fd, st, read = _up_on_a_pty(env, tmp_path, reaper)
    try:
        os.write(fd, b"\x03")  # Ctrl-C
        wait_for(lambda: "[d]etach" in read(), what="the question")
        os.write(fd, b"d\n")
        wait_for(lambda: "detached; controller pid" in read(), what="detached")
        _, code = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(code) == 0
    finally:
        os.close(fd)
    st2 = status(env, tmp_path)
    assert st2["controller_pid"] not in (None, pid) and st2["watched"] is True
    reaper[0].append(st2["controller_pid"])
    assert any("detached at Ctrl-C" in e and f"(pid {st2['controller_pid']})" in e for e in events(env, tmp_path))
    dtrun(env, tmp_path, "down", "sigjob", check_rc=0)
    # up again in the foreground (it continues from the checkpoint); Ctrl-C → [t]ear down
    pid, fd, st3, read = _up_on_a_pty(env, tmp_path, reaper)
    try:
        os.write(fd, b"\x03")
        wait_for(lambda: "[d]etach" in read(), what="the question")
        os.write(fd, b"t\n")
        wait_for(lambda: "CANCELLED: wall" in read(), what="torn down")
        _, code = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(code) == 1
    finally:
        os.close(fd)
    st4 = status(env, tmp_path)
    assert st4["state"] == "CANCELLED" and "Ctrl-C" in st4["reason"] and "dtrun down" not in st4["reason"]
    assert not group_alive(st3["nodes"][0]["pgid"])
