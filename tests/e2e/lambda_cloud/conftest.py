"""The Lambda lab for the e2e suite: started once per session, stopped at the end (also after a
failure), and the suite fails if anything of it is left (namespace, veth, bridge, process, mount).

Where the lab cannot run (not root, no namespaces, no sshd), every test here FAILS with one line
saying why: never a silent skip."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.e2e.lambdalab import lab as lablib

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="session")
def lab():
    why = lablib.preflight()
    if why:
        pytest.fail(f"Lambda lab cannot run here: {why}", pytrace=False)
    lablib.stop(log=lambda m: None)  # whatever an earlier crashed run left
    env = lablib.start(log=print)
    try:
        yield {**os.environ, **env, "PYTHONPATH": f"{env['PYTHONPATH']}:{REPO}"}
    finally:
        left = lablib.stop(log=print)
        assert not any(left.values()), f"the lab left: {left}"


def sh(cmd: list[str], env: dict, timeout: float = 900, check: bool = True, cwd=None) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd)
    if check and p.returncode != 0:
        raise AssertionError(f"{cmd} exited {p.returncode}\n--- stdout\n{p.stdout[-4000:]}\n--- stderr\n{p.stderr[-4000:]}")
    return p
