"""The Modal lab's executing sandboxes through the real ``modal`` client (``providers.modal.api``,
the adapter's own seam), no trainer: the command runs as sent, with the env and secrets as sent,
in its workdir holding the code the client uploaded; output streams while it runs; exit codes and
result statuses are real; terminate, the timeout and the faults end it; the bill adds up."""

from __future__ import annotations

import os
import time

import pytest

from providers.modal.api import ModalAPI, SandboxSpec
from tests.e2e.clouds.modal_lab import ExecutingModal

PROG = """import os, sys, time, signal, pkg
signal.signal(signal.SIGTERM, lambda *a: (print('got SIGTERM', flush=True), sys.exit(75)))
print('cwd', os.getcwd(), 'X', pkg.X, 'secret', os.environ.get('MYSECRET'), 'foo', os.environ.get('FOO'), flush=True)
print('to stderr', file=sys.stderr, flush=True)
for i in range(int(os.environ.get('TICKS', '0'))):
    print('tick', i, flush=True)
    time.sleep(0.2)
sys.exit(int(os.environ.get('CODE', '0')))
"""


@pytest.fixture
def lab(tmp_path, monkeypatch):
    proj = tmp_path / "proj"
    (proj / "pkg").mkdir(parents=True)
    (proj / "pyproject.toml").write_text('[project]\nname = "p"\nversion = "0"\ndependencies = []\n')
    (proj / "pkg" / "__init__.py").write_text("X = 41\n")
    (proj / "pkg" / "empty.py").write_text("")  # an empty file uploads too
    (proj / "run.py").write_text(PROG)
    with ExecutingModal(tmp_path / "lab", terminate_grace=2.0) as server:
        import modal.client

        monkeypatch.setenv("MODAL_SERVER_URL", server.url)
        monkeypatch.setenv("MODAL_TOKEN_ID", "ak-lab")
        monkeypatch.setenv("MODAL_TOKEN_SECRET", "as-lab")
        modal.client._Client._client_from_env = None
        yield server, ModalAPI(), proj
        modal.client._Client._client_from_env = None


def _spec(proj, name: str, **env) -> SandboxSpec:
    return SandboxSpec(name=name, command=["python", "run.py"], env={"FOO": "bar", **env}, gpu="T4:2",
                       timeout=int(env.pop("TIMEOUT", 60)), workdir=str(proj), secrets={"MYSECRET": "s3cr3t"},
                       gpu_wait=3.0)


def _end(api: ModalAPI, sid: str, within: float = 30.0):
    end = time.monotonic() + within
    while time.monotonic() < end:
        r = api.result(sid)
        if not r.running:
            return r
        time.sleep(0.1)
    raise AssertionError("the sandbox did not end")


@pytest.mark.timeout(120)
def test_the_command_runs_as_sent_with_the_uploaded_code_and_its_exit_code_is_real(lab):
    server, api, proj = lab
    sid = api.create(_spec(proj, "dtrun-x-a1", CODE="3"))
    r = _end(api, sid)
    assert (r.status, r.exitcode) == ("failure", 3)
    text = api.logs(sid, 50)
    sb = server.sandboxes[sid]
    assert f"cwd {sb.folder}/fs/root/dtrun X 41 secret s3cr3t foo bar" in text  # the upload, not the checkout
    assert "to stderr" in text
    assert (sb.folder / "fs/root/dtrun/pkg/empty.py").read_bytes() == b""
    bill = server.bill()
    assert bill["sandboxes"][0]["usd_per_hour"] == pytest.approx(2 * 0.59)  # dtrun's catalog, T4 × 2
    assert bill["usd"] == pytest.approx(bill["seconds"] / 3600 * 1.18, abs=1e-6)


@pytest.mark.timeout(120)
def test_output_is_readable_while_it_runs_and_terminate_is_sigterm_then_the_result(lab):
    server, api, proj = lab
    sid = api.create(_spec(proj, "dtrun-x-a2", TICKS="200"))
    time.sleep(1.5)
    assert api.result(sid).running
    assert "tick 1" in api.logs(sid, 50)  # while it runs
    api.terminate(sid)
    r = _end(api, sid)
    # the SDK reports any TERMINATED result as 137 (modal.sandbox._common._result_returncode),
    # whatever the process returned (here 75 from its handler)
    assert (r.status, r.exitcode) == ("terminated", 137)
    assert server.sandboxes[sid].result.exitcode == 75
    assert "got SIGTERM" in api.logs(sid, 50)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fault,status,code", [("evict", "eviction", 137), ("oom", "oom", 137),
                                               ("expire", "timeout", 124)])
def test_faults_kill_everything_and_say_so(lab, fault, status, code):
    server, api, proj = lab
    sid = api.create(_spec(proj, f"dtrun-x-{fault}", TICKS="200"))
    time.sleep(1.0)
    server.fault(f"dtrun-x-{fault}", fault)
    r = _end(api, sid)
    assert (r.status, r.exitcode) == (status, code)
    pid = server.sandboxes[sid].proc.pid
    assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"


@pytest.mark.timeout(120)
def test_the_timeout_is_enforced(lab):
    server, api, proj = lab
    sid = api.create(_spec(proj, "dtrun-x-to", TICKS="200", TIMEOUT="2"))
    r = _end(api, sid)
    assert (r.status, r.exitcode) == ("timeout", 124)


@pytest.mark.timeout(120)
def test_capacity_refused_is_the_clients_insufficient_capacity(lab):
    from modal.exception import ResourceExhaustedError

    server, api, proj = lab
    server.refuse_capacity(1)
    with pytest.raises(ResourceExhaustedError, match="Insufficient capacity"):
        api.create(_spec(proj, "dtrun-x-cap"))
    (sb,) = server.sandboxes.values()
    assert not sb.scheduled and sb.id in server.terminated  # the client ended it
    sid = api.create(_spec(proj, "dtrun-x-cap2"))  # the next create is scheduled
    assert _end(api, sid).status == "success"
