"""The real ``dtrun server`` process (uvicorn on 127.0.0.1, a free port, SQLite) and the real CLI
against it with ``DTRUN_SERVER``/``DTRUN_TOKEN`` and after ``dtrun login``: admin makes a team, a
user and a token; ``up --dry-run`` is planned by the server and shown by the CLI; ``up --yes``
submits, and the server's own controller replica runs the job (the CLI's home never gets a state
store); ``status``, ``cost --team``, ``logs`` and ``down`` (which stops the running job) read the
server. The server is stopped after (no process left)."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
import urllib.request

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dtrun(args, env, check=True):
    r = subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    if check:
        assert r.returncode == 0, (args, r.stdout, r.stderr)
    return r


@pytest.fixture
def server(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DTRUN_")}
    env.update(DTRUN_HOME=str(tmp_path / "home"), PYTHONPATH=ROOT)
    db = f"sqlite:///{tmp_path / 'server.db'}"
    _dtrun(["server", "admin", "team", "alpha", "--monthly-usd", "50", "--database", db], env)
    _dtrun(["server", "admin", "user", "alpha", "ann", "--role", "admin", "--database", db], env)
    token = _dtrun(["server", "admin", "token", "alpha", "ann", "--database", db], env).stdout.strip()
    port = _free_port()
    log = open(tmp_path / "server.log", "w")
    server_env = env | {"DTRUN_HOME": str(tmp_path / "server-home")}  # the server's machine, not the CLI's
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "server", "--port", str(port),
                             "--database", db], cwd=ROOT, env=server_env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(url + "/v1/whoami", timeout=2)
            except urllib.error.HTTPError as e:
                assert e.code == 401
                break
            except OSError:
                assert proc.poll() is None, (tmp_path / "server.log").read_text()
                assert time.monotonic() < deadline, "server did not start"
                time.sleep(0.2)
        yield {"env": env, "url": url, "token": token, "tmp": tmp_path, "log": tmp_path / "server.log"}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
    assert proc.poll() is not None


def _wait_state(env, job, want, timeout=240):
    deadline = time.monotonic() + timeout
    while True:
        st = json.loads(_dtrun(["status", job, "--json"], env).stdout)
        if st["state"] == want:
            return st
        assert time.monotonic() < deadline, (want, st)
        time.sleep(1)


def test_cli_against_a_real_server(server):
    env, tmp = dict(server["env"]), server["tmp"]
    job = tmp / "job.yaml"
    job.write_text(f"name: remote1\nresources: {{providers: [local], gpu: cpu}}\n"
                   f"trainer: {{model: tiny, steps: 100000, batch_size: 4, seq_len: 32}}\n"
                   f"checkpoint: {{uri: 'file://{tmp}/runs/remote1'}}\nbudget: {{max_usd: 5}}\n")
    # no token: one line, exit 5, no traceback
    r = _dtrun(["status"], env | {"DTRUN_SERVER": server["url"]}, check=False)
    assert r.returncode == 5 and "DTRUN_TOKEN" in r.stderr and "Traceback" not in r.stderr
    r = _dtrun(["status"], env | {"DTRUN_SERVER": server["url"], "DTRUN_TOKEN": "wrong"}, check=False)
    assert r.returncode == 5 and "HTTP 401" in r.stderr and "Traceback" not in r.stderr

    remote = env | {"DTRUN_SERVER": server["url"], "DTRUN_TOKEN": server["token"]}
    r = _dtrun(["up", str(job), "--dry-run", "--json"], remote)
    report = json.loads(r.stdout)
    assert report["exit_code"] == 0 and report["team_month"]["monthly_usd"] == 50
    _dtrun(["up", str(job), "--yes"], remote)
    assert not (tmp / "home" / "state.db").exists()  # nothing ran embedded
    st = json.loads(_dtrun(["status", "remote1", "--json"], remote).stdout)
    assert st["name"] == "remote1" and st["state"] in ("queued", "running")
    _wait_state(remote, "remote1", "running")  # the server's replica launched it: no CLI process runs it

    # after login, without the variables; the file is the user's only
    r = _dtrun(["login", server["url"], "--token", server["token"]], env)
    saved = tmp / "home" / "server.json"
    assert stat.S_IMODE(saved.stat().st_mode) == 0o600
    out = _dtrun(["cost", "--team"], env).stdout
    assert "team alpha" in out and "$50.00 a month" in out and "remote1" in out
    assert "stop requested" in _dtrun(["down", "remote1"], env).stdout
    _wait_state(env, "remote1", "stopped")  # the replica passed the stop to the run's controller
    kinds = [ln.split(" ", 2)[2] for ln in _dtrun(["logs", "remote1"], env).stdout.splitlines()]
    assert kinds[0] == "state: queued" and kinds[1].startswith("state: running")
    assert "request: stop" in kinds and kinds[-1].startswith("state: stopped")
    assert not (tmp / "home" / "state.db").exists()
    r = _dtrun(["status", "nope"], env, check=False)
    assert r.returncode == 6 and "no job named 'nope'" in r.stderr
    assert server["token"] not in server["log"].read_text()
