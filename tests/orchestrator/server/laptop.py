"""Helpers of the laptop tests (``test_laptop_closed.py`` here, ``tests/e2e/lambda_cloud/
test_server_laptop.py``): a real ``dtrun server`` process with its own ``DTRUN_HOME`` (the
server's machine), admin team/user/token made with ``dtrun server admin``, and the real CLI run as
a separate process per command, with its own ``DTRUN_HOME`` and ``DTRUN_SERVER``/``DTRUN_TOKEN``.
Imported as ``tests.orchestrator.server.laptop`` (not a conftest: those collide across folders)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[3]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dtrun(args: list[str], env: dict, check: bool = True, timeout: float = 300,
          stdin: str | None = None) -> subprocess.CompletedProcess:
    """One CLI process (``python -m orchestrator.cli``), run to its end."""
    r = subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], cwd=ROOT, env=env, input=stdin,
                       capture_output=True, text=True, timeout=timeout)
    if check:
        assert r.returncode == 0, (args, r.stdout[-3000:], r.stderr[-3000:])
    return r


def clean_env(base: dict | None = None) -> dict:
    env = {k: v for k, v in (base if base is not None else os.environ).items() if not k.startswith("DTRUN_")}
    env["PYTHONPATH"] = f"{env['PYTHONPATH']}:{ROOT}" if env.get("PYTHONPATH") else str(ROOT)
    return env


@contextlib.contextmanager
def running_server(tmp: Path, database: str, env: dict, aws: dict | None = None) -> Iterator[dict]:
    """``dtrun server`` on 127.0.0.1 (a free port) over ``database``, its home ``tmp/server-home``;
    team ``alpha`` with admin ``ann`` and a token; with ``aws``, a server key and the team's ``aws``
    secret (``dtrun server admin secret set alpha aws --file``: the file is removed right after).
    Stopped after (SIGTERM to its session, SIGKILL after 30 s): no process is left."""
    home = tmp / "server-home"
    senv = env | {"DTRUN_HOME": str(home)}
    admin = ["--database", database]
    dtrun(["server", "admin", "team", "alpha", "--monthly-usd", "100", *admin], senv)
    dtrun(["server", "admin", "user", "alpha", "ann", "--role", "admin", *admin], senv)
    token = dtrun(["server", "admin", "token", "alpha", "ann", *admin], senv).stdout.strip()
    if aws:
        dtrun(["server", "admin", "key"], senv)
        f = tmp / "alpha-aws.env"
        f.write_text("".join(f"{k}={v}\n" for k, v in aws.items()))
        dtrun(["server", "admin", "secret", "set", "alpha", "aws", "--file", str(f), *admin], senv)
        f.unlink()
    port = free_port()
    log_path = tmp / "server.log"
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "server", "--port", str(port), *admin],
                            cwd=ROOT, env=senv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                urllib.request.urlopen(url + "/v1/whoami", timeout=2)
            except urllib.error.HTTPError as e:
                assert e.code == 401
                break
            except OSError:
                assert proc.poll() is None, log_path.read_text()
                assert time.monotonic() < deadline, "server did not start"
                time.sleep(0.3)
        yield {"url": url, "token": token, "database": database, "home": home, "log": log_path, "proc": proc, "env": senv}
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def laptop(tmp: Path, env: dict, server: dict, name: str) -> dict:
    """A CLI's environment: a fresh ``DTRUN_HOME`` of its own, the server and the token."""
    home = tmp / name
    home.mkdir()
    return env | {"DTRUN_HOME": str(home), "DTRUN_SERVER": server["url"], "DTRUN_TOKEN": server["token"]}


def server_status(cli_env: dict, job: str) -> dict:
    return json.loads(dtrun(["status", job, "--json"], cli_env).stdout)


def wait_server_state(cli_env: dict, job: str, want: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        st = server_status(cli_env, job)
        if st["state"] == want:
            return st
        assert st["state"] not in ("failed", "stopped") or want in ("failed", "stopped"), st
        assert time.monotonic() < deadline, (want, st)
        time.sleep(2)
