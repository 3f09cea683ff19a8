"""The local provider with real processes: cross-process poll/terminate, exit-code file, zombies,
pid reuse, the wrapper's hard deadline, logs and environment."""

from __future__ import annotations

import os
import sys
import time

import pytest

from providers import errors as perr
from providers.base import Handle, LaunchRequest, NodeState, Requirements
from providers.local import LocalProvider


def _wait(pred, timeout=10.0):
    end = time.time() + timeout
    while time.time() < end:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


@pytest.fixture
def local(dtrun_home):
    p = LocalProvider(grace_seconds=1.0, confirm_wait_seconds=5.0)
    yield p
    for o in p.list_owned():  # never leave processes behind
        p.terminate(Handle("local", o.name, o.instance_id))


def _req(p, argv, attempt=1, **kw):
    offer = p.offers(Requirements("cpu", 1))[0]
    return LaunchRequest("loc", attempt, offer, 1, argv, **kw)


PY = sys.executable


def test_another_process_sees_and_terminates_the_node(local, dtrun_home):
    h = local.launch(_req(local, [PY, "-c", "import time; time.sleep(60)"], env={"DTRUN_RUN_URI": "file:///x"}))
    assert h.data["pid"] == h.data["pgid"] and h.data["log_path"].startswith(str(dtrun_home / "logs"))
    other = LocalProvider(grace_seconds=1.0)  # no Popen object: pid liveness + registry only
    same = Handle.from_dict(h.to_dict())
    assert other.poll(same) is NodeState.RUNNING
    assert [o.instance_id for o in other.list_owned()] == [h.instance_id]
    other.terminate(same)
    assert other.list_owned() == []
    assert local.poll(h) is NodeState.TERMINATED


def test_exit_code_learned_from_the_file_even_while_a_zombie(local):
    h = local.launch(_req(local, ["sh", "-c", "echo hello; exit 3"]))
    # the launching provider has not reaped its child yet: it is a zombie
    _wait(lambda: os.path.exists(h.data["exit_path"]))
    time.sleep(0.2)
    other = LocalProvider()
    assert other.poll(Handle.from_dict(h.to_dict())) is NodeState.FAILED
    assert local.poll(h) is NodeState.FAILED
    assert "hello" in local.logs(h)
    assert open(h.data["exit_path"]).read().strip() == "3"


def test_env_is_merged_over_os_environ(local, tmp_path):
    out = tmp_path / "env.txt"
    h = local.launch(_req(local, [PY, "-c", f"import os; open({str(out)!r}, 'w').write(os.environ['DTRUN_X'] + ':' + str(bool(os.environ.get('PATH'))))"],
                          env={"DTRUN_X": "yes"}, log_path=str(tmp_path / "n.log")))
    _wait(lambda: local.poll(h).is_terminal)
    assert local.poll(h) is NodeState.SUCCEEDED
    assert out.read_text() == "yes:True"
    assert h.data["log_path"] == str(tmp_path / "n.log")


def test_a_recycled_pid_is_never_ours(local, dtrun_home):
    h = local.launch(_req(local, ["sh", "-c", "exit 0"]))
    _wait(lambda: local.poll(h).is_terminal)
    # Pretend the node's pid now belongs to an unrelated live process (this test process).
    fake = Handle.from_dict(h.to_dict())
    import json

    reg_path = dtrun_home / "local" / "instances.json"
    reg = json.loads(reg_path.read_text())
    reg["instances"][h.instance_id].update(pid=os.getpid(), pgid=os.getpgrp())
    reg_path.write_text(json.dumps(reg))
    os.remove(h.data["exit_path"])
    other = LocalProvider()
    assert other.poll(fake) is NodeState.PREEMPTED  # gone, no exit code: not "running"
    assert other.list_owned() == []
    other.terminate(fake)  # must not signal us (this test process would die of it)


def test_sigterm_handled_by_the_node_then_terminated(local, tmp_path):
    ready = tmp_path / "ready"
    code = ("import signal,sys,time,pathlib\n"
            "signal.signal(signal.SIGTERM, lambda *a: sys.exit(75))\n"
            f"pathlib.Path({str(ready)!r}).touch()\n"
            "time.sleep(60)\n")
    h = local.launch(_req(local, [PY, "-c", code]))
    _wait(ready.exists)
    local.terminate(h)
    assert open(h.data["exit_path"]).read().strip() == "75"  # the wrapper survived to record it
    assert local.poll(h) is NodeState.TERMINATED


def test_stubborn_node_is_killed_after_the_grace(local, tmp_path):
    ready = tmp_path / "ready"
    code = ("import signal,time,pathlib\n"
            "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            f"pathlib.Path({str(ready)!r}).touch()\n"
            "time.sleep(60)\n")
    h = local.launch(_req(local, [PY, "-c", code]))
    _wait(ready.exists)
    p = LocalProvider(grace_seconds=1.0, confirm_wait_seconds=0.2)
    with pytest.raises(perr.TerminateNotConfirmed):
        p.terminate(Handle.from_dict(h.to_dict()))
    time.sleep(1.0)
    local.terminate(h)  # past the grace: SIGKILL, confirmed
    assert local.list_owned() == []
    assert local.poll(h) is NodeState.TERMINATED


def test_wrapper_enforces_the_hard_deadline(local, tmp_path):
    h = local.launch(_req(local, [PY, "-c", "import time; time.sleep(60)"], deadline=time.time() + 1.0))
    _wait(lambda: local.poll(h).is_terminal, timeout=15)
    assert local.poll(h) is NodeState.PREEMPTED  # stopped from outside, resumable
    assert "hard deadline" in local.logs(h)


def test_missing_command_fails_cleanly(local):
    h = local.launch(_req(local, ["/nonexistent/bootstrap"]))
    _wait(lambda: local.poll(h).is_terminal)
    assert local.poll(h) is NodeState.FAILED
    assert "cannot start" in local.logs(h)
