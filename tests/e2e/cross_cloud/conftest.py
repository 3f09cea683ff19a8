"""Two labs at once (RunPod and Vast) behind ONE SkyPilot API server that sees both clouds.

Each lab has its own HOME and its own API server port; a job with ``providers: [runpod, vast]``
needs one SkyPilot that has both: ``two_clouds`` writes a combined HOME (RunPod's
``~/.runpod/config.toml`` and Vast's ``~/.config/vastai/vast_api_key``, both labs' SkyPilot
catalogs) and an environment with both ``RUNPOD_API_BASE_URL`` and ``VAST_URL`` (the vastai SDK
reads it at import, so the API server that dtrun's first SkyPilot call starts must have it) and
an API server port of its own (46610: Lambda's lab is on 46580, RunPod's 46590, Vast's 46600).
Afterwards (also after a failure) the API server is stopped, every process with that HOME is
ended, the HOME removed, and the session fails if one is left."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.e2e.clouds.lambdalab import lab as llab
from tests.e2e.clouds.runpodlab import lab as rlab
from tests.e2e.clouds.vastlab import lab as vlab
from tests.e2e.conftest import REPO

HOME = Path(os.environ.get("DTRUN_TWO_CLOUDS_DIR", "/var/lib/dtrun-lab/two-clouds")) / "home"
API_SERVER_PORT = 46610


def write_home() -> None:
    """Both labs' credentials and catalogs (as each lab wrote them at start) in one HOME."""
    for rel in (".runpod/config.toml", ".config/vastai/vast_api_key", ".sky/catalogs/v8/runpod/vms.csv",
                ".sky/catalogs/v8/vast/vms.csv", ".sky/catalogs/v8/common/accelerators.csv"):
        src = (rlab.home() if "runpod" in rel or "common" in rel else vlab.home()) / rel
        dst = HOME / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)
    for key in (HOME / ".runpod" / "config.toml", HOME / ".config" / "vastai" / "vast_api_key"):
        key.chmod(0o600)


@pytest.fixture(scope="session")
def two_clouds(rp_lab, vs_lab):
    """The environment of a dtrun that drives both labs through one SkyPilot API server."""
    llab.end_processes_with_home(str(HOME))  # whatever an earlier crashed run left
    shutil.rmtree(HOME.parent, ignore_errors=True)
    write_home()
    env = {**vs_lab, **rp_lab, "HOME": str(HOME), "RUNPOD_API_BASE_URL": rlab.endpoint(),
           "VAST_URL": vlab.endpoint(), "SKYPILOT_API_SERVER_LOCAL_PORT": str(API_SERVER_PORT),
           "SKYPILOT_DISABLE_USAGE_COLLECTION": "1", "PYTHONPATH": str(REPO)}
    env.pop("DTRUN_LAB_HOST_IP", None)  # two bridges: neither is "the" host IP
    try:
        yield env
    finally:
        subprocess.run([str(REPO / ".venv" / "bin" / "sky"), "api", "stop"], env=env, capture_output=True,
                       timeout=120, check=False)
        left = llab.end_processes_with_home(str(HOME))
        shutil.rmtree(HOME.parent, ignore_errors=True)
        assert not left, f"processes of the two-cloud SkyPilot HOME left: {left}"


def run_py(code: str, env: dict, timeout: float = 600) -> str:
    """``python -c code`` in the repository with ``env``; its stdout (an AssertionError if it fails)."""
    import sys

    p = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True,
                       timeout=timeout)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout
