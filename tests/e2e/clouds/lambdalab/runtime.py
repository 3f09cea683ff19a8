"""The node runtime cache: built once, kept on disk outside the repository, reused by every lab.

Layout under ``$DTRUN_LAB_CACHE`` (default ``/var/cache/dtrun-lab``)::

    wheelhouse/             every wheel a node installs (the nodes' package index: no internet)
    uv                      the uv binary (from the PyPI ``uv`` wheel) → a node's ~/.local/bin/uv
    runtime/skypilot-runtime  SkyPilot's remote venv (Python 3.11 of the host's /usr; 0.14.1 would
                            download CPython 3.10 when it is missing), ray[default]==2.9.3 and
                            skypilot[lambda,remote]==0.14.1 preinstalled → a node's ~/skypilot-runtime
    usr/lib/python3/dist-packages  the "Lambda Stack" layer: torch (CPU) importable from the
                            system python3, as Lambda's VM image ships it; overlaid on /usr
    STAMP                   the key of what was built (a changed requirement set rebuilds)

Run ``python -m tests.e2e.clouds.lambdalab runtime`` to build it alone; ``start`` builds it when missing.
"""

from __future__ import annotations

import fcntl
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

CACHE = Path(os.environ.get("DTRUN_LAB_CACHE", "/var/cache/dtrun-lab"))
NODE_PYTHON = "/usr/bin/python3.11"
"""The interpreter every node's venvs are built on (Debian 12's python3; visible in every node)."""
RAY = "ray[default]==2.9.3"
SKY = "skypilot[lambda,remote]==0.14.1"
# What SkyPilot's RAY_INSTALLATION_COMMANDS install (sky/skylet/constants.py, 0.14.1).
RUNTIME_REQS = [RAY, SKY, "pydantic-core==2.41.1", "click<8.3.0", "setuptools<70"]
TORCH = "torch==2.13.0"
STACK_REQS = [TORCH, "numpy>=1.26"]
# dtrun's own dependencies (pyproject) but torch: node_setup.py installs the missing ones from the
# nodes' index; setuptools>=77 + wheel for its `pip install --no-deps -e .` build.
EXTRA_WHEELS = ["pydantic>=2.7,<3", "typer>=0.12", "rich>=13", "pyyaml>=6", "fsspec>=2024.6",
                "s3fs>=2024.6", "boto3>=1.34", "wheel", "pip", "uv==0.9.5"]
BUILD_WHEELS = ["setuptools>=77"]  # a second resolve: SkyPilot pins setuptools<70 in its venv
KEY = hashlib.sha256(json.dumps([NODE_PYTHON, RUNTIME_REQS, STACK_REQS, EXTRA_WHEELS, BUILD_WHEELS, 3]).encode()).hexdigest()[:16]


def ready() -> bool:
    return (CACHE / "STAMP").is_file() and (CACHE / "STAMP").read_text().split()[0] == KEY


def _run(cmd: list[str], **kw) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, **kw)


def _torch_wheel() -> list[str]:
    """The CPU torch wheel on this machine's disk (pip's find-links), else the pin from the index."""
    for d in ("/opt/wheels",):
        hits = sorted(glob.glob(f"{d}/torch-2.13.0+cpu-cp311-*.whl"))
        if hits:
            return [hits[-1]]
    return [TORCH, "--extra-index-url", "https://download.pytorch.org/whl/cpu"]


def build(log=print) -> dict:
    """Build the cache (no-op when the stamp matches). Returns {seconds, bytes}. One build at a
    time on the host (``make e2e``'s groups start their labs at once): the others wait on the
    lock, then find the stamp."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _build(log)


def _build(log) -> dict:
    if ready():
        return json.loads((CACHE / "STAMP").read_text().split(None, 1)[1])
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="build.", dir=CACHE))
    try:
        return _build_in(tmp, log)
    finally:  # an interrupted or failed build leaves no half-built folder (the stamp is written last)
        shutil.rmtree(tmp, ignore_errors=True)


def _build_in(tmp: Path, log) -> dict:
    t0 = time.monotonic()
    pip = [sys.executable, "-m", "pip"]
    wh = tmp / "wheelhouse"
    wh.mkdir()
    # 1. the wheelhouse: one resolve of everything a node installs
    _run(pip + ["download", "-q", "-d", str(wh), *RUNTIME_REQS, *EXTRA_WHEELS])
    _run(pip + ["download", "-q", "-d", str(wh), *STACK_REQS[1:], *BUILD_WHEELS])
    for sdist in list(wh.glob("*.tar.gz")) + list(wh.glob("*.zip")):  # gpustat: an sdist only
        _run(pip + ["wheel", "-q", "--no-deps", "-w", str(wh), str(sdist)])
        sdist.unlink()
    # 2. uv out of its wheel
    uvwhl = next(wh.glob("uv-*.whl"))
    with zipfile.ZipFile(uvwhl) as z:
        name = next(n for n in z.namelist() if n.endswith("/scripts/uv"))
        (tmp / "uv").write_bytes(z.read(name))
    (tmp / "uv").chmod(0o755)
    uv = str(tmp / "uv")
    env = {**os.environ, "UV_NO_CONFIG": "1", "UV_PYTHON_DOWNLOADS": "never", "UV_CACHE_DIR": str(tmp / "uvcache")}
    offline = ["--no-index", "--find-links", str(wh)]
    # 3. SkyPilot's runtime venv, built at its final path (venvs embed absolute paths)
    rt = CACHE / "runtime" / "skypilot-runtime"
    shutil.rmtree(rt, ignore_errors=True)
    rt.parent.mkdir(parents=True, exist_ok=True)
    _run([uv, "venv", "-q", "--seed", "--python", NODE_PYTHON, str(rt), *offline], env=env)
    _run([uv, "pip", "install", "-q", "--python", str(rt / "bin" / "python"), *offline, *RUNTIME_REQS], env=env)
    subprocess.run(["chown", "-R", "-h", "1000:1000", str(rt)], check=True)  # ubuntu's, as SkyPilot made it
    # 4. the Lambda Stack layer: torch importable from the system python3
    usr = tmp / "usr"
    site = usr / "lib" / "python3" / "dist-packages"
    site.mkdir(parents=True)
    _run(pip + ["install", "-q", "--no-compile", "--target", str(site), *_torch_wheel(), *STACK_REQS[1:]])
    shutil.rmtree(site / "bin", ignore_errors=True)
    # swap in
    for name in ("wheelhouse", "uv", "usr"):
        shutil.rmtree(CACHE / name, ignore_errors=True)
        if (CACHE / name).exists():
            (CACHE / name).unlink()
        (tmp / name).rename(CACHE / name)
    shutil.rmtree(tmp, ignore_errors=True)
    size = int(subprocess.run(["du", "-sb", str(CACHE)], capture_output=True, text=True).stdout.split()[0])
    info = {"seconds": round(time.monotonic() - t0, 1), "bytes": size}
    (CACHE / "STAMP").write_text(f"{KEY} {json.dumps(info)}\n")
    log(f"runtime cache built in {info['seconds']} s, {size / 2**30:.2f} GiB at {CACHE}")
    return info


if __name__ == "__main__":
    print(json.dumps(build()))
