"""The Vast lab for the e2e suite: started once per session, stopped at the end (also after a
failure), and the suite fails if anything of it is left (namespace, veth, bridge, process, mount).

Where the lab cannot run (not root, no namespaces, no sshd), every test here FAILS with one line
saying why: never a silent skip."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.e2e.clouds.vastlab import lab as lablib

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="session")
def vs_lab():
    why = lablib.preflight()
    if why:
        pytest.fail(f"Vast lab cannot run here: {why}", pytrace=False)
    lablib.stop(log=lambda m: None)  # whatever an earlier crashed run left
    env = lablib.start(log=print)
    try:
        yield {**os.environ, **env, "PYTHONPATH": str(REPO)}
    finally:
        left = lablib.stop(log=print)
        assert not any(left.values()), f"the Vast lab left: {left}"
