"""End-to-end suites against emulated clouds: every test collected under tests/e2e/ is marked `e2e`,
so `make test` (-m "not e2e") leaves them to `make e2e`.

The spot labs' session fixtures live here, so one session starts each lab at most once and a test may
use two labs at once (the cross-cloud failover test does): each lab is started at its first use,
stopped at the end of the session (also after a failure), and the session fails if anything of it is
left (namespace, veth, bridge, process, mount). Where a lab cannot run (not root, no namespaces, no
sshd), every test using it FAILS with one line saying why: never a silent skip."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "/tests/e2e/" in str(item.fspath):
            item.add_marker(pytest.mark.e2e)


def _lab(lablib, name: str):
    why = lablib.preflight()
    if why:
        pytest.fail(f"{name} lab cannot run here: {why}", pytrace=False)
    lablib.stop(log=lambda m: None)  # whatever an earlier crashed run left
    env = lablib.start(log=print)
    try:
        yield {**os.environ, **env, "PYTHONPATH": str(REPO)}
    finally:
        left = lablib.stop(log=print)
        assert not any(left.values()), f"the {name} lab left: {left}"


@pytest.fixture(scope="session")
def rp_lab():
    from tests.e2e.clouds.runpodlab import lab as lablib

    yield from _lab(lablib, "RunPod")


@pytest.fixture(scope="session")
def rp_s3(rp_lab):
    """moto S3 bound to the RunPod bridge's host IP (the pods reach it there; nothing else does)."""
    from tests.e2e.clouds.runpodlab import pod as podlib
    from tests.e2e.s3lab import moto_bucket

    with moto_bucket(podlib.HOST_IP, "rplab") as s3:
        yield s3


@pytest.fixture(scope="session")
def vs_lab():
    from tests.e2e.clouds.vastlab import lab as lablib

    yield from _lab(lablib, "Vast")


@pytest.fixture(scope="session")
def vs_s3(vs_lab):
    """moto S3 bound to the Vast bridge's host IP (the instances reach it there; nothing else does)."""
    from tests.e2e.clouds.vastlab import machine
    from tests.e2e.s3lab import moto_bucket

    with moto_bucket(machine.NET.host_ip, "vslab") as s3:
        yield s3
